//! Undoing what the kernel backend set up: on success, on errors and on Ctrl-C.
//!
//! Everything created is recorded here under one lock, in the same critical section that
//! creates it, so a signal never finds something made but not yet recorded. The signal
//! thread keeps the lock while it cleans up and exits, so the main thread cannot go on.

use super::cgroup::Cgroup;
use super::swap::OwnSwap;
use super::tunables::Tunable;
use anyhow::{Context, Result};
use signal_hook::consts::{SIGHUP, SIGINT, SIGTERM};
use signal_hook::iterator::Signals;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Mutex, MutexGuard};
use std::thread;

/// What exists now and must be undone.
pub struct Teardown {
    /// The running child's pid.
    pub child: Option<u32>,
    /// Swap this process created (turned on or not yet).
    pub swap: Option<OwnSwap>,
    pub cgroup: Option<Cgroup>,
    /// Settings this process changed, with their old values, in the order changed.
    pub restore: Vec<(Tunable, String)>,
}

static STATE: Mutex<Teardown> = Mutex::new(Teardown {
    child: None,
    swap: None,
    cgroup: None,
    restore: Vec::new(),
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
    /// Kills the child, then removes the swap and the cgroup (the child must be gone first:
    /// swapoff and rmdir wait for or fail on its memory and membership), then puts the
    /// settings back.
    fn run(&mut self) {
        if let Some(pid) = self.child.take() {
            // SAFETY: plain system calls on a child of this process.
            unsafe {
                libc::kill(pid as libc::pid_t, libc::SIGKILL);
                libc::waitpid(pid as libc::pid_t, std::ptr::null_mut(), 0);
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
}

/// Cleans up when dropped; while one exists, SIGINT, SIGTERM and SIGHUP clean up and exit.
pub struct Guard(());

impl Guard {
    pub fn new() -> Result<Guard> {
        if !SIGNALS_WATCHED.swap(true, Ordering::SeqCst) {
            let mut signals =
                Signals::new([SIGINT, SIGTERM, SIGHUP]).context("installing signal handlers")?;
            thread::spawn(move || {
                if let Some(signal) = signals.forever().next() {
                    let mut state = lock();
                    eprintln!("interrupted: removing the swap and cgroup this run made, restoring settings");
                    state.run();
                    std::process::exit(128 + signal);
                }
            });
        }
        Ok(Guard(()))
    }
}

impl Drop for Guard {
    fn drop(&mut self) {
        lock().run();
    }
}
