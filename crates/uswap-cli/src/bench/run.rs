//! `uswap bench run -- CMD ARGS…`: one program under the kernel's swap and under `uswap
//! run` (thread mode, the default fault mode, the compressed tier on or off), in
//! interleaved rounds, every run timed and measured; the report is [`super::run_report`]'s.

use super::run_report::{self, Mode, Record, Report};
use crate::args::{existing_dir, nonzero_size, KernelArgs};
use crate::kernel::{self, program, Environment, ProgramSwap};
use anyhow::{bail, ensure, Context, Result};
use clap::{value_parser, Args};
use indicatif::{ProgressBar, ProgressStyle};
use std::ffi::OsString;
use std::fs::{self, File};
use std::os::unix::fs::PermissionsExt;
use std::path::{Path, PathBuf};
use std::process::{Command, ExitCode, Stdio};
use uswap_core::{Ztier, ZtierSize};

#[derive(Args, Debug)]
#[command(after_help = run_report::COLUMNS_HELP)]
pub struct BenchRunArgs {
    /// Memory every run may keep resident: the kernel's cgroup limit, `uswap run --memory`
    #[arg(long, value_name = "SIZE", value_parser = nonzero_size)]
    pub memory: u64,

    /// Rounds; each runs every mode once, in the order of --modes
    #[arg(long, value_name = "N", default_value_t = 3, value_parser = value_parser!(u32).range(1..=1000))]
    pub rounds: u32,

    /// What to run the program under: `kernel` (the kernel's swap in a memory cgroup, root),
    /// `thread` (`uswap run --fault-mode thread`), `default` (`uswap run` with its default
    /// fault mode), `ztier-on` and `ztier-off` (`uswap run --ztier on|off`)
    #[arg(long, value_enum, value_name = "MODE,…", value_delimiter = ',',
          default_values_t = [Mode::Kernel, Mode::Thread, Mode::Default])]
    pub modes: Vec<Mode>,

    /// Directory for every run's swap (`uswap run --swap-dir`; the kernel's swap file)
    /// [default: $TMPDIR or /tmp]
    #[arg(long, value_name = "DIR", value_parser = existing_dir)]
    pub swap_dir: Option<PathBuf>,

    /// Swap size of every run [default: as `uswap run` picks it]
    #[arg(long, value_name = "SIZE", value_parser = nonzero_size)]
    pub swap_size: Option<u64>,

    /// The compressed pool's size in every uswap run, and for `--kernel-swap zswap` the
    /// kernel's zswap pool limit [default: as `uswap run` picks it]
    #[arg(long, value_name = "auto|SIZE|N%", value_parser = |s: &str| s.parse::<ZtierSize>())]
    pub ztier_size: Option<ZtierSize>,

    #[command(flatten)]
    pub kernel: KernelArgs,

    /// Directory for the logs, one per run with the program's stdout and stderr [default:
    /// a new uswap-bench-run-PID directory in $TMPDIR]
    #[arg(long, value_name = "DIR", value_parser = existing_dir)]
    pub log_dir: Option<PathBuf>,

    /// Let the program's stdout and stderr through instead of logging them
    #[arg(long)]
    pub show_output: bool,

    /// Print one JSON object with every run instead of tables
    #[arg(long)]
    pub json: bool,

    /// The program and its arguments (run directly, not through a shell; stdin is
    /// /dev/null)
    #[arg(required = true, trailing_var_arg = true, value_name = "CMD")]
    pub command: Vec<OsString>,
}

/// Runs every round and prints the report. A run that fails is reported and makes the
/// command fail after the report; an interrupted bench reports what it finished and exits
/// as the signal asks (128 + N).
pub fn run(a: &BenchRunArgs) -> Result<ExitCode> {
    check_modes(&a.modes)?;
    if a.modes.iter().any(|m| *m != Mode::Kernel) {
        crate::run::preload_library()?;
    }
    let logs = log_dir(a)?;
    let swap_dir = a.swap_dir.clone().unwrap_or_else(std::env::temp_dir);
    let progress = progress_bar(a.rounds as u64 * a.modes.len() as u64);
    let mut records = Vec::new();
    let mut environment = None;
    let mut interrupted = None;
    'rounds: for round in 1..=a.rounds {
        for &mode in &a.modes {
            progress.set_message(format!("round {round} of {}: {mode}", a.rounds));
            let log = logs
                .as_ref()
                .map(|dir| dir.join(format!("round{round}-{mode}.log")));
            let output = Output::new(log.as_deref())?;
            let record = match mode {
                Mode::Kernel => {
                    let (record, env) = run_kernel(a, &swap_dir, round, output)?;
                    environment.get_or_insert(env);
                    record
                }
                _ => run_uswap(a, &swap_dir, mode, round, output)?,
            };
            records.push(Record { log, ..record });
            progress.inc(1);
            interrupted = kernel::interrupted();
            if interrupted.is_some() {
                break 'rounds;
            }
        }
    }
    progress.finish_and_clear();
    let report = Report {
        bench: "run",
        command: a
            .command
            .iter()
            .map(|s| s.to_string_lossy().into_owned())
            .collect(),
        memory: a.memory,
        rounds: a.rounds,
        modes: a.modes.clone(),
        log_dir: logs,
        kernel: environment,
        summary: run_report::summarize(&a.modes, &records),
        runs: records,
    };
    super::emit(&report, a.json, run_report::print)?;
    if let Some(signal) = interrupted {
        eprintln!("uswap bench run: interrupted (signal {signal}); the report has the runs done");
        return Ok(ExitCode::from(128 + signal as u8));
    }
    let failed = report.failed();
    ensure!(
        failed == 0,
        "{failed} of {} runs failed (exit status above; the logs say why)",
        report.runs.len()
    );
    Ok(ExitCode::SUCCESS)
}

fn check_modes(modes: &[Mode]) -> Result<()> {
    for (i, mode) in modes.iter().enumerate() {
        if modes[..i].contains(mode) {
            bail!("--modes names {mode} twice: name each mode once (--rounds repeats them)");
        }
    }
    Ok(())
}

/// The directory the logs go in, made if it is the default; `None` with --show-output.
fn log_dir(a: &BenchRunArgs) -> Result<Option<PathBuf>> {
    if a.show_output {
        return Ok(None);
    }
    if let Some(dir) = &a.log_dir {
        return Ok(Some(dir.clone()));
    }
    let dir = std::env::temp_dir().join(format!("uswap-bench-run-{}", std::process::id()));
    fs::create_dir(&dir).with_context(|| format!("creating log directory {}", dir.display()))?;
    Ok(Some(dir))
}

fn progress_bar(runs: u64) -> ProgressBar {
    let bar = ProgressBar::new(runs);
    let style = ProgressStyle::with_template("{elapsed:>4} [{bar:20}] {pos}/{len} runs  {msg}")
        .expect("a valid template")
        .progress_chars("=> ");
    bar.set_style(style);
    bar
}

/// Where a run's stdout and stderr go.
enum Output {
    /// Both into one log file.
    Log(File),
    /// Through to this process's own.
    Shown,
}

impl Output {
    fn new(log: Option<&Path>) -> Result<Output> {
        match log {
            Some(path) => File::create(path)
                .map(Output::Log)
                .with_context(|| format!("creating log {}", path.display())),
            None => Ok(Output::Shown),
        }
    }

    fn apply(self, command: &mut Command) -> Result<()> {
        command.stdin(Stdio::null());
        if let Output::Log(file) = self {
            command.stderr(file.try_clone().context("sharing the log file")?);
            command.stdout(file);
        }
        Ok(())
    }
}

fn run_kernel(
    a: &BenchRunArgs,
    swap_dir: &Path,
    round: u32,
    output: Output,
) -> Result<(Record, Environment)> {
    let setup = crate::run::kernel_setup(
        a.memory,
        swap_dir.to_path_buf(),
        a.swap_size,
        a.kernel.kernel_swap,
        a.kernel.zswap_tunables(
            Ztier {
                size: a.ztier_size.unwrap_or(Ztier::default().size),
                ..Ztier::default()
            },
            a.memory,
        )?,
    );
    let mut command = Command::new(&a.command[0]);
    command.args(&a.command[1..]);
    output.apply(&mut command)?;
    let (done, env) = kernel::run_program(&setup, command)
        .context("the kernel side (run it alone with `uswap run --backend kernel`)")?;
    let mut record = Record::new(round, Mode::Kernel, &done.finished);
    record.cgroup_peak_bytes = Some(done.cgroup_peak_bytes);
    record.swap = Some(done.swap);
    Ok((record, env))
}

/// `uswap run` (this binary) with the mode's settings, the program under it.
fn run_uswap(
    a: &BenchRunArgs,
    swap_dir: &Path,
    mode: Mode,
    round: u32,
    output: Output,
) -> Result<Record> {
    let exe = std::env::current_exe().context("finding the uswap binary")?;
    let mut command = Command::new(exe);
    command.args(["run", "--memory", &a.memory.to_string()]);
    match mode {
        Mode::Thread => command.args(["--fault-mode", "thread"]),
        Mode::ZtierOn => command.args(["--ztier", "on"]),
        Mode::ZtierOff => command.args(["--ztier", "off"]),
        Mode::Kernel | Mode::Default => &mut command,
    };
    if let Some(size) = a.ztier_size {
        command.arg(format!("--ztier-size={size}"));
    }
    command.arg("--swap-dir").arg(swap_dir);
    if let Some(size) = a.swap_size {
        command.args(["--swap-size", &size.to_string()]);
    }
    // Writable by every user, as /tmp is: the tree may start programs as other users (a
    // database's server, started by its script as its own user). Its random name sits in
    // a directory others may pass through but not list.
    let hidden = tempfile::tempdir().context("making a directory for the run's counters")?;
    fs::set_permissions(hidden.path(), fs::Permissions::from_mode(0o711))
        .context("making the run's counters directory")?;
    let stats =
        tempfile::tempdir_in(hidden.path()).context("making a directory for the run's counters")?;
    fs::set_permissions(stats.path(), fs::Permissions::from_mode(0o1777))
        .context("opening the run's counters directory to the tree's users")?;
    command.arg("--stats-dir").arg(stats.path());
    command.arg("--").args(&a.command);
    output.apply(&mut command)?;
    let done = program::run(command, false)?;
    let mut record = Record::new(round, mode, &done);
    record.swap = left_counters(stats.path())?;
    Ok(record)
}

/// The pages the tree swapped in and out, summed over the counters its programs left in
/// `dir` at exit (`uswap run --stats-dir`: `PID.json` or `PID.N.json`, regular files);
/// `None` when none left any. Anything else there is left out with a warning: the run
/// is reported all the same.
fn left_counters(dir: &Path) -> Result<Option<ProgramSwap>> {
    let mut total: Option<ProgramSwap> = None;
    for entry in fs::read_dir(dir).context("reading the run's counters")? {
        let path = entry.context("reading the run's counters")?.path();
        match program_counters(&path) {
            Ok(Some((pswpin, pswpout))) => {
                let sum = total.get_or_insert(ProgramSwap {
                    pswpin: 0,
                    pswpout: 0,
                    source: "uswap",
                });
                sum.pswpin += pswpin;
                sum.pswpout += pswpout;
            }
            Ok(None) => {}
            Err(e) => eprintln!("uswap bench run: left out of the swap counts: {e:#}"),
        }
    }
    Ok(total)
}

/// One program's (pswpin, pswpout) from the file it left; `None` for a file that is not
/// one of those (the partial file of a program still writing, for one).
fn program_counters(path: &Path) -> Result<Option<(u64, u64)>> {
    let name = path.file_name().unwrap_or_default().to_string_lossy();
    let stem = name.strip_suffix(".json").unwrap_or_default();
    let named = !stem.is_empty() && stem.split('.').all(|part| part.parse::<u32>().is_ok());
    if !named || stem.split('.').count() > 2 {
        return Ok(None);
    }
    let kind = fs::symlink_metadata(path).with_context(|| format!("{}", path.display()))?;
    ensure!(kind.is_file(), "{} is not a regular file", path.display());
    let text = fs::read_to_string(path).with_context(|| format!("reading {}", path.display()))?;
    let snapshot: serde_json::Value = serde_json::from_str(&text)
        .with_context(|| format!("{} is not a snapshot (JSON)", path.display()))?;
    let count = |name: &str| snapshot["stats"]["vmstat"][name].as_u64();
    match (count("pswpin"), count("pswpout")) {
        (Some(pswpin), Some(pswpout)) => Ok(Some((pswpin, pswpout))),
        _ => bail!("{} holds no swap counters", path.display()),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn snapshot(pswpin: u64, pswpout: u64) -> String {
        serde_json::json!({"pid": 1, "stats": {"vmstat": {"pswpin": pswpin, "pswpout": pswpout}}})
            .to_string()
    }

    #[test]
    fn the_counters_programs_left_are_summed_and_anything_else_is_left_out() {
        let dir = tempfile::tempdir().unwrap();
        assert!(left_counters(dir.path()).unwrap().is_none(), "nothing left");
        fs::write(dir.path().join("100.json"), snapshot(10, 20)).unwrap();
        fs::write(dir.path().join("100.1.json"), snapshot(1, 2)).unwrap();
        fs::write(dir.path().join("200.json"), snapshot(5, 0)).unwrap();
        // A program still writing, a cut-off file, a stranger's file, a link, a directory.
        fs::write(dir.path().join(".300.partial"), snapshot(1000, 1000)).unwrap();
        fs::write(dir.path().join("400.json"), &snapshot(1000, 1000)[..20]).unwrap();
        fs::write(dir.path().join("notes.json"), snapshot(1000, 1000)).unwrap();
        std::os::unix::fs::symlink("200.json", dir.path().join("500.json")).unwrap();
        fs::create_dir(dir.path().join("600.json")).unwrap();
        let sum = left_counters(dir.path()).unwrap().unwrap();
        assert_eq!((sum.pswpin, sum.pswpout, sum.source), (16, 22, "uswap"));
    }
}
