//! Running a program (an argv, not a workload of ours) as a child: in a memory cgroup from
//! its first instruction when asked, with SIGINT, SIGTERM and SIGHUP to this process passed
//! on to it, and its exit status and resource use (its own and its waited-for
//! descendants') collected when it ends.

use super::cgroup::Cgroup;
use super::teardown::{self, Child};
use anyhow::{Context, Result};
use serde::Serialize;
use std::fs::OpenOptions;
use std::io;
use std::os::fd::AsRawFd;
use std::os::unix::process::{CommandExt, ExitStatusExt};
use std::process::{Command, ExitStatus};
use std::time::{Duration, Instant};

/// How a program run ended and what it used.
#[derive(Debug)]
pub struct Finished {
    pub status: ExitStatus,
    /// From just before the start to the exit.
    pub wall: Duration,
    pub usage: Usage,
}

/// What the program and its waited-for descendants used (wait4's rusage).
#[derive(Clone, Copy, Debug, Default, Serialize, PartialEq)]
pub struct Usage {
    pub user_s: f64,
    pub system_s: f64,
    /// The largest resident set of any one process of the tree (ru_maxrss), in bytes.
    pub max_rss_bytes: u64,
    /// Faults that waited for a read (ru_majflt).
    pub major_faults: u64,
}

impl Usage {
    fn from_rusage(r: &libc::rusage) -> Usage {
        let seconds = |t: libc::timeval| t.tv_sec as f64 + t.tv_usec as f64 / 1e6;
        Usage {
            user_s: seconds(r.ru_utime),
            system_s: seconds(r.ru_stime),
            max_rss_bytes: r.ru_maxrss as u64 * 1024,
            major_faults: r.ru_majflt as u64,
        }
    }
}

/// The exit status a wrapper passes on: the program's exit code, or 128 + the signal that
/// killed it, as a shell reports it.
pub fn exit_code(status: ExitStatus) -> u8 {
    match (status.code(), status.signal()) {
        (Some(code), _) => code as u8,
        (None, Some(signal)) => (128 + signal) as u8,
        (None, None) => 1,
    }
}

/// Starts `command` (in the run's cgroup when `in_cgroup`), passes signals on to it while
/// it runs, and waits for it.
pub fn run(mut command: Command, in_cgroup: bool) -> Result<Finished> {
    teardown::watch_signals()?;
    let start = Instant::now();
    let pid = teardown::with(|t| -> Result<u32> {
        // Open before the fork and closed at exec (O_CLOEXEC): the child moves itself in
        // ("0" is the writer) before exec, so nothing it runs is ever outside the cgroup.
        let procs = match (in_cgroup, &t.cgroup) {
            (false, _) => None,
            (true, Some(group)) => Some(open_procs(group)?),
            (true, None) => anyhow::bail!("the cgroup is gone"),
        };
        if let Some(fd) = procs.as_ref().map(AsRawFd::as_raw_fd) {
            // SAFETY: the closure makes one async-signal-safe system call on an open fd.
            unsafe {
                command.pre_exec(move || {
                    if libc::write(fd, b"0".as_ptr().cast(), 1) != 1 {
                        return Err(io::Error::last_os_error());
                    }
                    Ok(())
                });
            }
        }
        let child = command.spawn().with_context(|| describe_spawn(&command))?;
        t.child = Some(Child::program(child.id()));
        Ok(child.id())
    })?;
    wait_exited(pid)?;
    let wall = start.elapsed();
    // Reaped under the lock, so that a signal is never passed on to a pid that is free.
    let (status, usage) = teardown::with(|t| {
        t.child = None;
        reap(pid)
    })?;
    Ok(Finished {
        status,
        wall,
        usage,
    })
}

fn open_procs(group: &Cgroup) -> Result<std::fs::File> {
    let path = group.path().join("cgroup.procs");
    OpenOptions::new()
        .write(true)
        .open(&path)
        .with_context(|| format!("opening {}", path.display()))
}

fn describe_spawn(command: &Command) -> String {
    format!("cannot run {}", command.get_program().to_string_lossy())
}

/// Waits until `pid` has exited, leaving it unreaped (WNOWAIT).
fn wait_exited(pid: u32) -> Result<()> {
    loop {
        // SAFETY: waitid fills the siginfo it is given.
        let mut info: libc::siginfo_t = unsafe { std::mem::zeroed() };
        let flags = libc::WEXITED | libc::WNOWAIT;
        if unsafe { libc::waitid(libc::P_PID, pid, &mut info, flags) } == 0 {
            return Ok(());
        }
        let e = io::Error::last_os_error();
        if e.kind() != io::ErrorKind::Interrupted {
            return Err(e).context("waiting for the program");
        }
    }
}

/// Collects an exited child's status and resource use.
fn reap(pid: u32) -> Result<(ExitStatus, Usage)> {
    let mut status = 0;
    // SAFETY: wait4 fills the status and rusage it is given.
    let mut rusage: libc::rusage = unsafe { std::mem::zeroed() };
    if unsafe { libc::wait4(pid as libc::pid_t, &mut status, 0, &mut rusage) } < 0 {
        return Err(io::Error::last_os_error()).context("collecting the program's exit status");
    }
    Ok((ExitStatus::from_raw(status), Usage::from_rusage(&rusage)))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn exit_codes_and_signals_become_a_shells_status() {
        assert_eq!(exit_code(ExitStatus::from_raw(7 << 8)), 7);
        assert_eq!(exit_code(ExitStatus::from_raw(libc::SIGTERM)), 128 + 15);
    }

    #[test]
    fn a_program_runs_and_its_status_and_usage_come_back() {
        let mut command = Command::new("sh");
        command.args(["-c", "exit 3"]);
        let done = run(command, false).unwrap();
        assert_eq!(done.status.code(), Some(3));
        assert!(done.usage.max_rss_bytes > 0, "{:?}", done.usage);
        assert!(run(Command::new("/nonexistent/program"), false).is_err());
    }
}
