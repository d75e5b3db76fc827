//! `--backend kernel`: the same workload in a child process under the kernel's own swap, in
//! a memory cgroup with the same limit and a swap file on the same file system as uswap's.

mod cgroup;
pub mod child;
mod swap;
mod teardown;
mod vmstat;

use anyhow::{bail, Context, Result};
use cgroup::{Cgroup, Hierarchy};
use serde::Serialize;
use std::io::{Read, Write};
use std::os::unix::process::ExitStatusExt;
use std::path::{Path, PathBuf};
use std::process::{self, Child, Command, Stdio};

/// What the child needs around it.
pub struct Setup {
    /// The cgroup's memory limit; `None`: no limit.
    pub memory_limit: Option<u64>,
    /// Swap the run may use; `None`: it needs none.
    pub swap_bytes: Option<u64>,
    /// Where a swap file goes (uswap's swap directory).
    pub swap_dir: PathBuf,
}

/// How the kernel was set up, for the report.
#[derive(Clone, Debug, Serialize)]
pub struct Environment {
    pub cgroup: String,
    pub memory_limit: Option<u64>,
    pub swap: String,
}

/// Runs `spec` in a child under the kernel's swap and returns its report. Everything made
/// for it is removed before this returns, also on errors and on Ctrl-C.
pub fn run(setup: &Setup, spec: &child::Spec) -> Result<(child::Report, Environment)> {
    // SAFETY: geteuid has no preconditions.
    if unsafe { libc::geteuid() } != 0 {
        bail!("--backend kernel needs root: it creates a memory cgroup and a swap file (run with sudo)");
    }
    let _cleanup = teardown::Guard::new()?;
    let swap = match setup.swap_bytes {
        Some(bytes) => prepare_swap(&setup.swap_dir, bytes)?,
        None => "not used".to_string(),
    };
    let hierarchy = Hierarchy::detect(Path::new("/sys/fs/cgroup"))?;
    let name = format!("uswap-bench-{}", process::id());
    let cgroup = teardown::with(|t| -> Result<String> {
        let group = Cgroup::create(&hierarchy, &name, setup.memory_limit)?;
        let path = group.path().display().to_string();
        t.cgroup = Some(group);
        Ok(path)
    })?;
    let report = run_child(spec)?;
    let env = Environment {
        cgroup,
        memory_limit: setup.memory_limit,
        swap,
    };
    Ok((report, env))
}

/// Reuses swap that is already on, or makes and enables a swap file of `bytes` in `dir`.
fn prepare_swap(dir: &Path, bytes: u64) -> Result<String> {
    let active = swap::active()?;
    if !active.is_empty() {
        let names: Vec<&str> = active.iter().map(|s| s.name.as_str()).collect();
        let free: u64 = active
            .iter()
            .map(|s| (s.size_kib - s.used_kib) * 1024)
            .sum();
        let mut note = format!("reusing swap that is already on: {}", names.join(", "));
        if free < bytes {
            note += &format!(" (only {free} bytes free; this run may need {bytes})");
        }
        return Ok(note);
    }
    let path = swap::file_path(dir, process::id());
    teardown::with(|t| {
        t.swap_file = Some(path.clone());
        swap::create_and_enable(&path, bytes)
    })?;
    Ok(format!(
        "swap file {} of {} MiB (removed afterwards)",
        path.display(),
        bytes >> 20
    ))
}

/// Starts the child, moves it into the cgroup, lets it go and collects its report.
fn run_child(spec: &child::Spec) -> Result<child::Report> {
    let exe = std::env::current_exe().context("finding the uswap binary to run the child")?;
    let mut child = teardown::with(|t| -> Result<Child> {
        let group = t.cgroup.as_ref().context("the cgroup is gone")?;
        let child = Command::new(&exe)
            .args(child::command_args(spec))
            .stdin(Stdio::piped())
            .stdout(Stdio::piped())
            .spawn()
            .with_context(|| format!("starting {}", exe.display()))?;
        t.child = Some(child.id());
        group.add_process(child.id())?;
        Ok(child)
    })?;
    let mut stdin = child.stdin.take().context("child stdin")?;
    stdin.write_all(b"g").context("starting the child")?;
    drop(stdin);
    let mut out = String::new();
    child
        .stdout
        .take()
        .context("child stdout")?
        .read_to_string(&mut out)
        .context("reading the child's report")?;
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
    let line = out
        .lines()
        .rev()
        .find(|l| !l.trim().is_empty())
        .unwrap_or("");
    serde_json::from_str(line).with_context(|| format!("reading the child's report {line:?}"))
}
