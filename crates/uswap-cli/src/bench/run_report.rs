//! The report of `uswap bench run`: one record per run, the summary per mode (median wall
//! time, and speed against the kernel: the kernel's wall time over the mode's, each round
//! and their median), as tables or JSON.

use crate::kernel::program::{self, Finished, Usage};
use crate::kernel::{Environment, ProgramSwap};
use crate::report;
use clap::ValueEnum;
use serde::Serialize;
use std::path::PathBuf;

/// What `--help` says about the columns.
pub const COLUMNS_HELP: &str = "\
Columns: wall time from start to exit; CPU time user+system of the program and the processes \
it waited for (uswap's fault handler threads included); max RSS, the largest resident set of \
any one process of the tree (ru_maxrss, every mode); cg peak, the kernel cgroup's peak \
(memory.peak, v1 memory.max_usage_in_bytes: the whole tree, page cache included; kernel only); \
major faults (ru_majflt); swap in/out in pages: for the kernel the cgroup's pswpin/pswpout \
(cgroup v2) or else /proc/vmstat over the run (machine-wide); for uswap the counters each \
program of the tree left when it exited (`uswap run --stats-dir`; one that execs another, \
dies of a signal or ends with _exit leaves none). Runs that exit non-zero are marked failed and left out of the \
medians.";

/// What a run's program runs under.
#[derive(Clone, Copy, Debug, PartialEq, Eq, ValueEnum, Serialize)]
#[serde(rename_all = "lowercase")]
pub enum Mode {
    /// The kernel's swap, in a memory cgroup
    Kernel,
    /// `uswap run --fault-mode thread`
    Thread,
    /// `uswap run` with its default fault mode
    Default,
    /// `uswap run --ztier on` (default fault mode)
    ZtierOn,
    /// `uswap run --ztier off` (default fault mode)
    ZtierOff,
}

impl std::fmt::Display for Mode {
    fn fmt(&self, f: &mut std::fmt::Formatter) -> std::fmt::Result {
        f.write_str(match self {
            Mode::Kernel => "kernel",
            Mode::Thread => "thread",
            Mode::Default => "default",
            Mode::ZtierOn => "ztier-on",
            Mode::ZtierOff => "ztier-off",
        })
    }
}

/// One run.
#[derive(Debug, Serialize)]
pub struct Record {
    pub round: u32,
    pub mode: Mode,
    /// Exited with status 0.
    pub ok: bool,
    /// `exit N` or `signal N`.
    pub status: String,
    /// The status a shell would report: the exit code, or 128 + the signal.
    pub exit_code: u8,
    pub wall_s: f64,
    #[serde(flatten)]
    pub usage: Usage,
    /// The kernel cgroup's peak memory (kernel mode only).
    pub cgroup_peak_bytes: Option<u64>,
    /// Pages swapped: the kernel's counters, or what uswap's programs left at exit.
    pub swap: Option<ProgramSwap>,
    /// The program's stdout and stderr (none with --show-output).
    pub log: Option<PathBuf>,
}

impl Record {
    pub fn new(round: u32, mode: Mode, done: &Finished) -> Record {
        let status = match done.status.code() {
            Some(code) => format!("exit {code}"),
            None => format!("signal {}", program::exit_code(done.status) - 128),
        };
        Record {
            round,
            mode,
            ok: done.status.success(),
            status,
            exit_code: program::exit_code(done.status),
            wall_s: done.wall.as_secs_f64(),
            usage: done.usage,
            cgroup_peak_bytes: None,
            swap: None,
            log: None,
        }
    }
}

/// One mode over the rounds.
#[derive(Debug, Serialize, PartialEq)]
pub struct Summary {
    pub mode: Mode,
    pub runs: usize,
    pub failed: usize,
    /// Median wall time of the runs that succeeded.
    pub median_wall_s: Option<f64>,
    /// The median of `round_speeds`: above 1, faster than the kernel.
    pub speed_vs_kernel: Option<f64>,
    /// Each round's speed against the kernel's in the same round: the kernel's wall time
    /// over this mode's (none where either failed).
    pub round_speeds: Vec<Option<f64>>,
}

#[derive(Debug, Serialize)]
pub struct Report {
    pub bench: &'static str,
    pub command: Vec<String>,
    pub memory: u64,
    pub rounds: u32,
    pub modes: Vec<Mode>,
    pub log_dir: Option<PathBuf>,
    /// How the kernel mode's cgroup and swap were set up (its first run).
    pub kernel: Option<Environment>,
    pub runs: Vec<Record>,
    pub summary: Vec<Summary>,
}

impl Report {
    pub fn failed(&self) -> usize {
        self.runs.iter().filter(|r| !r.ok).count()
    }
}

fn median(mut values: Vec<f64>) -> Option<f64> {
    values.sort_by(f64::total_cmp);
    let n = values.len();
    match n {
        0 => None,
        _ if n % 2 == 1 => Some(values[n / 2]),
        _ => Some((values[n / 2 - 1] + values[n / 2]) / 2.0),
    }
}

/// Wall time of the successful run of `mode` in `round`.
fn wall_of(runs: &[Record], mode: Mode, round: u32) -> Option<f64> {
    runs.iter()
        .find(|r| r.mode == mode && r.round == round && r.ok)
        .map(|r| r.wall_s)
}

pub fn summarize(modes: &[Mode], runs: &[Record]) -> Vec<Summary> {
    let median_of = |mode: Mode| {
        median(
            runs.iter()
                .filter(|r| r.mode == mode && r.ok)
                .map(|r| r.wall_s)
                .collect(),
        )
    };
    let last_round = runs.iter().map(|r| r.round).max().unwrap_or(0);
    modes
        .iter()
        .map(|&mode| {
            let of_mode = runs.iter().filter(|r| r.mode == mode);
            let round_speeds: Vec<Option<f64>> = (1..=last_round)
                .map(|round| {
                    let kernel = wall_of(runs, Mode::Kernel, round)?;
                    Some(kernel / wall_of(runs, mode, round)?)
                })
                .collect();
            Summary {
                mode,
                runs: of_mode.clone().count(),
                failed: of_mode.filter(|r| !r.ok).count(),
                median_wall_s: median_of(mode),
                speed_vs_kernel: median(round_speeds.iter().flatten().copied().collect()),
                round_speeds,
            }
        })
        .collect()
}

fn or_dash<T>(value: Option<T>, show: impl Fn(T) -> String) -> String {
    value.map_or("-".to_string(), show)
}

pub fn print(r: &Report) {
    println!(
        "uswap bench run: {}   memory {}, {} round(s) of {}",
        r.command.join(" "),
        report::size(r.memory),
        r.rounds,
        r.modes
            .iter()
            .map(Mode::to_string)
            .collect::<Vec<_>>()
            .join(", ")
    );
    if let Some(k) = &r.kernel {
        k.print();
    }
    if let Some(dir) = &r.log_dir {
        println!("logs (stdout and stderr of each run): {}", dir.display());
    }
    println!(
        "{:>5} {:<8} {:<15} {:>8} {:>15} {:>10} {:>10} {:>9} {:>9} {:>9}  log",
        "round",
        "mode",
        "status",
        "wall s",
        "cpu s usr+sys",
        "max RSS",
        "cg peak",
        "maj flt",
        "swap in",
        "swap out"
    );
    for run in &r.runs {
        let status = match run.ok {
            true => run.status.clone(),
            false => format!("FAILED {}", run.status),
        };
        let log = run.log.as_ref().and_then(|p| p.file_name());
        println!(
            "{:>5} {:<8} {:<15} {:>8.2} {:>15} {:>10} {:>10} {:>9} {:>9} {:>9}  {}",
            run.round,
            run.mode.to_string(),
            status,
            run.wall_s,
            format!("{:.2}+{:.2}", run.usage.user_s, run.usage.system_s),
            report::size(run.usage.max_rss_bytes),
            or_dash(run.cgroup_peak_bytes, report::size),
            report::count(run.usage.major_faults),
            or_dash(run.swap, |s| report::count(s.pswpin)),
            or_dash(run.swap, |s| report::count(s.pswpout)),
            log.map_or("-".into(), |name| name.to_string_lossy())
        );
    }
    let kernel = r.runs.iter().filter(|run| run.mode == Mode::Kernel);
    if let Some(source) = kernel.filter_map(|run| run.swap).map(|s| s.source).next() {
        let source = match source {
            "cgroup" => "the cgroup's own counters",
            _ => "/proc/vmstat over the run, machine-wide (cgroup v1 has no per-group ones)",
        };
        println!(
            "swap in/out: the kernel's from {source}; uswap's from the counters its programs \
             left at exit"
        );
    }
    println!("summary: median wall time of the runs that succeeded; speed against the kernel in each round (its wall time over the mode's: above 1 is faster) and their median");
    println!(
        "{:<8} {:>6} {:>10} {:>9}  rounds",
        "mode", "ok", "median s", "speed"
    );
    for s in &r.summary {
        let rounds: Vec<String> = s
            .round_speeds
            .iter()
            .map(|ratio| or_dash(*ratio, |x| format!("{x:.2}")))
            .collect();
        println!(
            "{:<8} {:>6} {:>10} {:>9}  {}",
            s.mode.to_string(),
            format!("{}/{}", s.runs - s.failed, s.runs),
            or_dash(s.median_wall_s, |m| format!("{m:.2}")),
            or_dash(s.speed_vs_kernel, |x| format!("{x:.2}")),
            rounds.join(" ")
        );
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn record(round: u32, mode: Mode, wall_s: f64, ok: bool) -> Record {
        Record {
            round,
            mode,
            ok,
            status: if ok { "exit 0" } else { "exit 1" }.into(),
            exit_code: u8::from(!ok),
            wall_s,
            usage: Usage::default(),
            cgroup_peak_bytes: None,
            swap: None,
            log: None,
        }
    }

    #[test]
    fn medians_leave_out_failed_runs() {
        assert_eq!(median(vec![]), None);
        assert_eq!(median(vec![3.0, 1.0, 2.0]), Some(2.0));
        assert_eq!(median(vec![4.0, 1.0, 2.0, 3.0]), Some(2.5));
        let runs = [
            record(1, Mode::Kernel, 2.0, true),
            record(1, Mode::Thread, 3.0, true),
            record(2, Mode::Kernel, 4.0, true),
            record(2, Mode::Thread, 100.0, false),
            record(3, Mode::Kernel, 3.0, true),
            record(3, Mode::Thread, 9.0, true),
        ];
        let s = summarize(&[Mode::Kernel, Mode::Thread], &runs);
        assert_eq!(s[0].median_wall_s, Some(3.0));
        assert_eq!(s[0].speed_vs_kernel, Some(1.0));
        assert_eq!(s[1].runs, 3);
        assert_eq!(s[1].failed, 1);
        assert_eq!(s[1].median_wall_s, Some(6.0));
        assert_eq!(s[1].speed_vs_kernel, Some(0.5));
        assert_eq!(
            s[1].round_speeds,
            vec![Some(2.0 / 3.0), None, Some(1.0 / 3.0)]
        );
    }

    #[test]
    fn without_the_kernel_there_are_no_ratios() {
        let runs = [record(1, Mode::Default, 2.0, true)];
        let s = summarize(&[Mode::Default], &runs);
        assert_eq!(s[0].median_wall_s, Some(2.0));
        assert_eq!(
            (s[0].speed_vs_kernel, s[0].round_speeds.clone()),
            (None, vec![None])
        );
    }
}
