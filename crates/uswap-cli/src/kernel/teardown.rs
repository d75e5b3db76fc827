//! Undoing what the kernel backend set up: on success, on errors and on Ctrl-C; and
//! passing SIGINT, SIGTERM and SIGHUP on to a program run under it.
//!
//! Everything created is recorded here under one lock, in the same critical section that
//! creates it, so a signal never finds something made but not yet recorded. The signal
//! thread keeps the lock while it cleans up and exits, so the main thread cannot go on.
//! While a program child runs ([`Child::program`]), a signal is not the end of the run: it
//! is passed on to the child, which decides, and the cleanup follows its exit as usual.

use super::cgroup::Cgroup;
use super::swap::OwnSwap;
use super::tunables::Tunable;
use anyhow::{Context, Result};
use signal_hook::consts::{SIGHUP, SIGINT, SIGTERM};
use signal_hook::iterator::exfiltrator::WithRawSiginfo;
use signal_hook::iterator::SignalsInfo;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Mutex, MutexGuard};
use std::thread;
use std::time::Duration;

/// The running child, and what a signal to this process does to it.
#[derive(Clone, Copy, Debug)]
pub struct Child {
    pub pid: u32,
    /// Signals are passed on to it (a program) rather than ending the run (a workload).
    forward: bool,
}

impl Child {
    /// A workload child: a signal kills it, cleans up and exits.
    pub fn workload(pid: u32) -> Child {
        Child {
            pid,
            forward: false,
        }
    }

    /// A program child: a signal is passed on to it.
    pub fn program(pid: u32) -> Child {
        Child { pid, forward: true }
    }
}

/// What exists now and must be undone.
pub struct Teardown {
    /// The running child.
    pub child: Option<Child>,
    /// Swap this process created (turned on or not yet).
    pub swap: Option<OwnSwap>,
    pub cgroup: Option<Cgroup>,
    /// Settings this process changed, with their old values, in the order changed.
    pub restore: Vec<(Tunable, String)>,
    /// The last signal passed on to (or meant for) a program child.
    interrupted: Option<i32>,
}

static STATE: Mutex<Teardown> = Mutex::new(Teardown {
    child: None,
    swap: None,
    cgroup: None,
    restore: Vec::new(),
    interrupted: None,
});

static SIGNALS_WATCHED: AtomicBool = AtomicBool::new(false);

fn lock() -> MutexGuard<'static, Teardown> {
    // A panic elsewhere must not stop the cleanup.
    STATE.lock().unwrap_or_else(|e| e.into_inner())
}

/// Runs `f` on the record under its lock.
pub fn with<T>(f: impl FnOnce(&mut Teardown) -> T) -> T {
    f(&mut lock())
}

impl Teardown {
    /// Kills the child and whatever it left in the cgroup, then removes the swap and the
    /// cgroup (its processes must be gone first: swapoff and rmdir wait for or fail on
    /// their memory and membership), then puts the settings back.
    fn run(&mut self) {
        if let Some(child) = self.child.take() {
            let pid = child.pid as libc::pid_t;
            // SAFETY: plain system calls on a child of this process.
            unsafe {
                libc::kill(pid, libc::SIGKILL);
                libc::waitpid(pid, std::ptr::null_mut(), 0);
            }
        }
        if let Some(group) = &self.cgroup {
            match group.kill_all(Duration::from_secs(1), Duration::from_secs(5)) {
                Ok(0) => {}
                Ok(n) => eprintln!(
                    "note: ended {n} process(es) the command left running in cgroup {}",
                    group.path().display()
                ),
                Err(e) => eprintln!(
                    "warning: cannot empty cgroup {}: {e}",
                    group.path().display()
                ),
            }
        }
        if let Some(swap) = self.swap.take() {
            if let Err(e) = swap.remove() {
                eprintln!(
                    "warning: {e:#}. Remove it by hand: {}",
                    swap.manual_removal()
                );
            }
        }
        if let Some(group) = self.cgroup.take() {
            if let Err(e) = group.remove() {
                eprintln!(
                    "warning: cannot remove cgroup {0}: {e}. Remove it by hand: rmdir {0}",
                    group.path().display()
                );
            }
        }
        while let Some((tunable, old)) = self.restore.pop() {
            if let Err(e) = tunable.write(&old) {
                eprintln!(
                    "warning: {e:#}. Restore it by hand: echo {old} > {}",
                    tunable.path()
                );
            }
        }
    }

    fn holds_anything(&self) -> bool {
        self.swap.is_some() || self.cgroup.is_some() || !self.restore.is_empty()
    }

    /// What `signal` does: passed on to a program child, else the end of the run.
    fn on_signal(&mut self, info: &libc::siginfo_t) {
        let signal = info.si_signo;
        match self.child {
            Some(Child { pid, forward: true }) => {
                self.interrupted = Some(signal);
                // A terminal's Ctrl-C (sent by the kernel) already went to the child, which
                // is in this process's group; pass on only what a process sent, as sudo does.
                if info.si_code <= 0 {
                    // SAFETY: a plain system call on a child of this process, not yet reaped.
                    unsafe { libc::kill(pid as libc::pid_t, signal) };
                }
            }
            _ => {
                if self.holds_anything() {
                    eprintln!(
                        "interrupted: removing the swap and cgroup this run made, restoring \
                         settings"
                    );
                }
                self.run();
                std::process::exit(128 + signal);
            }
        }
    }
}

/// The last signal meant for a program child since this process started.
pub fn interrupted() -> Option<i32> {
    lock().interrupted
}

/// From now on SIGINT, SIGTERM and SIGHUP go through [`Teardown`]: passed on to a program
/// child, or else they clean up and exit.
pub fn watch_signals() -> Result<()> {
    if SIGNALS_WATCHED.swap(true, Ordering::SeqCst) {
        return Ok(());
    }
    let mut signals = SignalsInfo::<WithRawSiginfo>::new([SIGINT, SIGTERM, SIGHUP])
        .context("installing signal handlers")?;
    thread::spawn(move || {
        for info in signals.forever() {
            lock().on_signal(&info);
        }
    });
    Ok(())
}

/// Cleans up when dropped; while one exists, signals act as [`watch_signals`] says.
pub struct Guard(());

impl Guard {
    pub fn new() -> Result<Guard> {
        watch_signals()?;
        Ok(Guard(()))
    }
}

impl Drop for Guard {
    fn drop(&mut self) {
        lock().run();
    }
}
