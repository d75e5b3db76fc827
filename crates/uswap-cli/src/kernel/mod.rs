//! `--backend kernel`: the same workload, or the same program, in a child process under the
//! kernel's own swap, in a memory cgroup with the same limit, with a swap file on the same
//! file system as uswap's or a zram device.

mod cgroup;
pub mod child;
pub mod program;
mod swap;
mod teardown;
pub mod tunables;
pub mod vmstat;
mod zram;

use anyhow::{bail, Context, Result};
use cgroup::{Cgroup, Hierarchy};
use clap::ValueEnum;
use serde::Serialize;
use std::io::{BufRead, BufReader, Write};
use std::os::unix::process::ExitStatusExt;
use std::path::{Path, PathBuf};
use std::process::{self, Child, Command, Stdio};
use swap::OwnSwap;
pub use teardown::interrupted;
use tunables::{Tunable, TunableState};

/// Which swap device the kernel backend uses.
#[derive(Clone, Copy, Debug, PartialEq, Eq, ValueEnum, Serialize)]
#[serde(rename_all = "lowercase")]
pub enum KernelSwap {
    /// The swap already on, or else a swap file of our own in the swap directory
    File,
    /// A zram device of our own (compressed RAM), above any swap already on
    Zram,
    /// A swap file as `file` has, with the kernel's zswap (a compressed pool in front of
    /// it) on for the run: the compressor of --ztier-compressor if the kernel has it, else
    /// lzo-rle; the pool's limit --ztier-size of the memory limit, as a whole percent of
    /// the machine's memory (the kernel's limit is machine-wide)
    Zswap,
}

/// What the child needs around it.
pub struct Setup {
    /// The cgroup's memory limit; `None`: no limit.
    pub memory_limit: Option<u64>,
    /// Swap the run may use; `None`: it needs none.
    pub swap: Option<SwapPlan>,
    /// Swap settings to change for the run (restored afterwards); the others are reported
    /// as found.
    pub tunables: Vec<(Tunable, String)>,
}

/// The swap a run needs.
pub struct SwapPlan {
    pub kind: KernelSwap,
    pub bytes: u64,
    /// Where a swap file goes (uswap's swap directory).
    pub dir: PathBuf,
    /// The run turns its swap off ([`lift_limit_and_swapoff`]), so it must make its own
    /// instead of reusing swap that is on.
    pub own: bool,
}

/// How the kernel was set up, for the report.
#[derive(Clone, Debug, Serialize)]
pub struct Environment {
    pub cgroup: String,
    pub memory_limit: Option<u64>,
    pub swap: String,
    /// What the zram device stored, with `--kernel-swap zram`.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub zram: Option<zram::ZramUsage>,
    /// The swap settings during the run, with the old values of those it changed.
    #[serde(skip_serializing_if = "Vec::is_empty")]
    pub tunables: Vec<TunableState>,
    /// Whether a swap that is on lies on a rotating disk (the kernel then reads ahead by
    /// slot whatever `vma_ra_enabled` says); absent when that cannot be told.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub swap_rotational: Option<bool>,
}

impl Environment {
    /// Prints how the kernel backend was set up: cgroup, swap, what zram stored, swap
    /// settings.
    pub fn print(&self) {
        println!("kernel: cgroup {}; swap: {}", self.cgroup, self.swap);
        if let Some(z) = &self.zram {
            println!("  {}", z.summary());
        }
        if !self.tunables.is_empty() {
            let states: Vec<String> = self.tunables.iter().map(|t| t.to_string()).collect();
            println!("  {}", states.join(", "));
        }
        if let Some(readahead) = self.readahead() {
            println!("  readahead in effect: {readahead}");
        }
    }

    /// The swap readahead in effect, named as `--readahead` names it.
    pub fn readahead(&self) -> Option<String> {
        let value = |name: &str| {
            let state = self.tunables.iter().find(|t| t.name == name)?;
            Some(state.value.as_str())
        };
        Some(tunables::describe(
            value(Tunable::PageCluster.name())?,
            value(Tunable::VmaReadahead.name())?,
            self.swap_rotational,
        ))
    }
}

/// What a program run under the kernel's swap did, as the cgroup and the kernel saw it.
#[derive(Debug)]
pub struct ProgramRun {
    pub finished: program::Finished,
    /// The most memory the cgroup used at once (`memory.peak`, v1's
    /// `memory.max_usage_in_bytes`): the whole tree's, page cache and kernel memory included.
    pub cgroup_peak_bytes: u64,
    pub swap: ProgramSwap,
}

/// Pages the run swapped in and out.
#[derive(Clone, Copy, Debug, Serialize)]
pub struct ProgramSwap {
    pub pswpin: u64,
    pub pswpout: u64,
    /// `cgroup`: the cgroup's own counters (v2 memory.stat); `machine`: /proc/vmstat over the
    /// run, everything the machine swapped meanwhile (cgroup v1 has no per-group counters);
    /// `uswap`: what a uswap run's programs left at exit (`uswap run --stats-dir`).
    pub source: &'static str,
}

/// Runs `spec` in a child under the kernel's swap and returns its report. Everything made
/// for it is removed, and every setting changed for it restored, before this returns, also
/// on errors and on Ctrl-C.
pub fn run(setup: &Setup, spec: &child::Spec) -> Result<(child::Report, Environment)> {
    run_paused(setup, spec, || {
        bail!("the kernel-backend child paused, but this workload has nothing to do then")
    })
}

/// [`run`] for a workload that pauses midway: `at_pause` runs while the child waits.
pub fn run_paused(
    setup: &Setup,
    spec: &child::Spec,
    at_pause: impl FnMut() -> Result<()>,
) -> Result<(child::Report, Environment)> {
    with_environment(setup, || run_child(spec, at_pause))
}

/// Runs `command` (a program, `exec`ed as given) in the memory cgroup under the kernel's
/// swap. SIGINT, SIGTERM and SIGHUP sent to this process are passed on to it meanwhile; the
/// cleanup is the same as [`run`]'s and follows the program's exit.
pub fn run_program(setup: &Setup, command: Command) -> Result<(ProgramRun, Environment)> {
    with_environment(setup, || {
        let before = vmstat::read()?;
        let finished = program::run(command, true)?;
        let after = vmstat::read()?;
        let (peak, stat) = teardown::with(|t| -> Result<_> {
            let group = t.cgroup.as_ref().context("the cgroup is gone")?;
            Ok((group.peak()?, group.stat()?))
        })?;
        let swap = match (stat.get("pswpin"), stat.get("pswpout")) {
            (Some(&pswpin), Some(&pswpout)) => ProgramSwap {
                pswpin,
                pswpout,
                source: "cgroup",
            },
            _ => {
                let moved = after.since(&before);
                ProgramSwap {
                    pswpin: moved.pswpin,
                    pswpout: moved.pswpout,
                    source: "machine",
                }
            }
        };
        Ok(ProgramRun {
            finished,
            cgroup_peak_bytes: peak,
            swap,
        })
    })
}

/// Sets up the cgroup, swap and settings `setup` asks for, runs `body` in them, and undoes
/// everything before it returns, also on errors and on Ctrl-C.
fn with_environment<T>(
    setup: &Setup,
    body: impl FnOnce() -> Result<T>,
) -> Result<(T, Environment)> {
    // SAFETY: geteuid has no preconditions.
    if unsafe { libc::geteuid() } != 0 {
        bail!("--backend kernel needs root: it creates a memory cgroup and swap (run with sudo)");
    }
    // Before anything is changed: a machine without the controller is refused untouched.
    let hierarchy = Hierarchy::detect(Path::new("/sys/fs/cgroup"))?;
    let _cleanup = teardown::Guard::new()?;
    let swap = match &setup.swap {
        Some(plan) => prepare_swap(plan)?,
        None => "not used".to_string(),
    };
    let (tunables, swap_rotational) = match setup.swap {
        Some(_) => (apply_tunables(&setup.tunables)?, swap::any_is_rotational()),
        None => (Vec::new(), None),
    };
    let name = format!("uswap-kernel-{}", process::id());
    let cgroup = teardown::with(|t| -> Result<String> {
        let group = Cgroup::create(&hierarchy, &name, setup.memory_limit)?;
        let path = group.path().display().to_string();
        t.cgroup = Some(group);
        Ok(path)
    })?;
    let outcome = body()?;
    let zram = teardown::with(|t| match &t.swap {
        Some(OwnSwap::Zram(z)) => Some(z.usage()),
        _ => None,
    })
    .transpose()?;
    let env = Environment {
        cgroup,
        memory_limit: setup.memory_limit,
        swap,
        zram,
        tunables,
        swap_rotational,
    };
    Ok((outcome, env))
}

/// For a pause in swapoff mode: lifts the cgroup's memory limit, so the whole set fits in
/// memory, and turns off the swap this run made (every page on it comes back).
pub fn lift_limit_and_swapoff() -> Result<()> {
    let path = teardown::with(|t| -> Result<PathBuf> {
        let group = t.cgroup.as_ref().context("the cgroup is gone")?;
        group.set_limit(None)?;
        t.swap
            .as_ref()
            .map(OwnSwap::path)
            .context("this run made no swap to turn off")
    })?;
    // Outside the lock: on Ctrl-C the teardown must not wait for the whole swapoff.
    swap::turn_off(&path)
}

/// Sets what `settings` asks for, in its order; returns the state of every setting a
/// report shows and of those set.
fn apply_tunables(settings: &[(Tunable, String)]) -> Result<Vec<TunableState>> {
    let extra = settings
        .iter()
        .map(|&(t, _)| t)
        .filter(|t| !Tunable::ALL.contains(t));
    Tunable::ALL
        .into_iter()
        .chain(extra)
        .map(|tunable| {
            let found = tunable.read()?;
            let wanted = settings.iter().find(|(t, _)| *t == tunable);
            let state = match wanted {
                Some((_, value)) if *value != found => {
                    teardown::with(|t| {
                        t.restore.push((tunable, found.clone()));
                        tunable.write(value)
                    })?;
                    TunableState {
                        name: tunable.name(),
                        value: value.clone(),
                        previous: Some(found),
                    }
                }
                _ => TunableState {
                    name: tunable.name(),
                    value: found,
                    previous: None,
                },
            };
            Ok(state)
        })
        .collect()
}

/// Sets up the swap `plan` asks for; returns what it is, for the report.
fn prepare_swap(plan: &SwapPlan) -> Result<String> {
    let active = swap::active()?;
    match plan.kind {
        KernelSwap::File | KernelSwap::Zswap if !active.is_empty() && plan.own => bail!(
            "this run turns its swap off afterwards, but swap is already on ({}) and \
             --kernel-swap file would reuse it; turning that off is not ours to do: use \
             --kernel-swap zram, or turn that swap off first",
            names(&active)
        ),
        KernelSwap::File | KernelSwap::Zswap if !active.is_empty() => {
            Ok(reuse_note(&active, plan.bytes))
        }
        KernelSwap::File | KernelSwap::Zswap => make_swap_file(&plan.dir, plan.bytes),
        KernelSwap::Zram => make_zram(&active, plan.bytes),
    }
}

fn names(active: &[swap::ActiveSwap]) -> String {
    let names: Vec<&str> = active.iter().map(|s| s.name.as_str()).collect();
    names.join(", ")
}

fn reuse_note(active: &[swap::ActiveSwap], bytes: u64) -> String {
    let free: u64 = active
        .iter()
        .map(|s| (s.size_kib - s.used_kib) * 1024)
        .sum();
    let mut note = format!("reusing swap that is already on: {}", names(active));
    if free < bytes {
        note += &format!(" (only {free} bytes free; this run may need {bytes})");
    }
    note
}

fn make_swap_file(dir: &Path, bytes: u64) -> Result<String> {
    let path = swap::file_path(dir, process::id());
    teardown::with(|t| {
        t.swap = Some(OwnSwap::File(path.clone()));
        swap::create_file_and_enable(&path, bytes)
    })
    .with_context(|| {
        format!(
            "cannot make a swap file in {}: swap files need a disk file system with room for \
             {} MiB (ext4, xfs, btrfs; not tmpfs or overlayfs): give --swap-dir on one, a \
             smaller --swap-size, or use --kernel-swap zram",
            dir.display(),
            bytes >> 20
        )
    })?;
    Ok(format!(
        "swap file {} of {} MiB (removed afterwards)",
        path.display(),
        bytes >> 20
    ))
}

/// A zram device of `bytes`, at a priority above the swap already on so that it takes every
/// page this run swaps out.
fn make_zram(active: &[swap::ActiveSwap], bytes: u64) -> Result<String> {
    let priority = swap::priority_above(active);
    let (device, algorithm) = teardown::with(|t| -> Result<_> {
        let zram = zram::Zram::add()?;
        t.swap = Some(OwnSwap::Zram(zram));
        let algorithm = zram.configure(bytes)?;
        swap::format_and_enable(&zram.dev_path(), priority)?;
        Ok((zram.dev_path(), algorithm))
    })?;
    let mut note = format!(
        "zram device {} of {} MiB, {algorithm} (removed afterwards)",
        device.display(),
        bytes >> 20
    );
    if let Some(p) = priority {
        note += &format!(
            "; priority {p}, above the swap already on: {}",
            names(active)
        );
    }
    Ok(note)
}

/// Starts the child, moves it into the cgroup, lets it go (and on at each pause, after
/// `at_pause`) and collects its report.
fn run_child(
    spec: &child::Spec,
    mut at_pause: impl FnMut() -> Result<()>,
) -> Result<child::Report> {
    let exe = std::env::current_exe().context("finding the uswap binary to run the child")?;
    let mut child = teardown::with(|t| -> Result<Child> {
        let group = t.cgroup.as_ref().context("the cgroup is gone")?;
        let child = Command::new(&exe)
            .args(child::command_args(spec))
            .stdin(Stdio::piped())
            .stdout(Stdio::piped())
            .spawn()
            .with_context(|| format!("starting {}", exe.display()))?;
        t.child = Some(teardown::Child::workload(child.id()));
        group.add_process(child.id())?;
        Ok(child)
    })?;
    let mut stdin = child.stdin.take().context("child stdin")?;
    stdin.write_all(b"g").context("starting the child")?;
    let stdout = BufReader::new(child.stdout.take().context("child stdout")?);
    let mut last = String::new();
    for line in stdout.lines() {
        let line = line.context("reading the child's report")?;
        if line == child::PAUSE {
            at_pause()?;
            // A child that died meanwhile is reported below, from its exit status.
            let _ = stdin.write_all(b"g");
        } else if !line.trim().is_empty() {
            last = line;
        }
    }
    drop(stdin);
    let status = child.wait().context("waiting for the child")?;
    teardown::with(|t| t.child = None);
    if status.signal() == Some(libc::SIGKILL) {
        bail!(
            "the kernel-backend child was killed (SIGKILL), most likely by the memory cgroup's \
             OOM killer: is there enough swap (--swap-size)?"
        );
    }
    if !status.success() {
        bail!("the kernel-backend child failed ({status}); its messages are above");
    }
    serde_json::from_str(&last).with_context(|| format!("reading the child's report {last:?}"))
}
