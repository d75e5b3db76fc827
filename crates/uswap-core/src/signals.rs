//! Signal masks for uswap's own threads and for the public calls that take uswap's locks.
//!
//! uswap's threads (fault handlers, kswapd, the SIGBUS service) block every asynchronous
//! signal, so a process-directed signal (a profiling timer, SIGURG, SIGCHLD, Ctrl-C) is
//! delivered to one of the program's threads. Were it delivered to a handler thread whose
//! signal handler touched region memory, the fault would wait for the very thread that
//! took it. Public calls that take uswap locks block them too while they run, so a signal
//! handler of the program never interrupts a thread that holds a uswap lock.

/// The signals the kernel raises synchronously for the instruction a thread runs: blocking
/// them would turn a fault into a kill, so they stay open.
const SYNCHRONOUS: [libc::c_int; 5] = [
    libc::SIGSEGV,
    libc::SIGBUS,
    libc::SIGFPE,
    libc::SIGILL,
    libc::SIGTRAP,
];

/// Every signal except the synchronous ones.
pub(crate) fn asynchronous() -> libc::sigset_t {
    // SAFETY: sigset_t is plain data; the calls only fill it.
    unsafe {
        let mut set: libc::sigset_t = std::mem::zeroed();
        libc::sigfillset(&mut set);
        for sig in SYNCHRONOUS {
            libc::sigdelset(&mut set, sig);
        }
        set
    }
}

/// The C library's own signals (thread cancellation and `set*id` broadcasts, 32 and 33),
/// which its `sigfillset` leaves out and its `pthread_sigmask` never blocks.
const LIBC_INTERNAL: [libc::c_int; 2] = [32, 33];

/// What uswap's signal handlers block while they run: every asynchronous signal, the C
/// library's own included. A thread cancellation acting inside a handler would unwind
/// through uswap's frames (which cannot unwind: the process aborted); blocked, it acts
/// when the handler returns, at the program's instruction.
pub(crate) fn handler_mask() -> libc::sigset_t {
    let mut set = asynchronous();
    // SAFETY: the kernel's mask is the first word of the C library's sigset_t (its
    // sigaddset refuses these two).
    let word = unsafe { &mut *(&mut set as *mut libc::sigset_t).cast::<u64>() };
    for sig in LIBC_INTERNAL {
        *word |= 1 << (sig - 1);
    }
    set
}

/// While alive, the calling thread has every asynchronous signal blocked; the old mask comes
/// back on drop.
pub struct Quiet {
    old: libc::sigset_t,
}

impl Quiet {
    // A guard that blocks signals when made is not a default value of anything.
    #[allow(clippy::new_without_default)]
    #[must_use = "the signals come back when the guard is dropped"]
    pub fn new() -> Quiet {
        let set = asynchronous();
        // SAFETY: plain data; pthread_sigmask changes only this thread's mask.
        unsafe {
            let mut old: libc::sigset_t = std::mem::zeroed();
            libc::pthread_sigmask(libc::SIG_BLOCK, &set, &mut old);
            Quiet { old }
        }
    }
}

impl Drop for Quiet {
    fn drop(&mut self) {
        // SAFETY: restoring the mask saved in `new`.
        unsafe { libc::pthread_sigmask(libc::SIG_SETMASK, &self.old, std::ptr::null_mut()) };
    }
}

/// Spawns a uswap thread with every asynchronous signal blocked from its first instruction
/// (it inherits the mask, so no signal can slip in before it sets one). Every uswap thread
/// starts this way: a program's process-directed signal must never run the program's
/// handler on a uswap thread (PostgreSQL forks its helpers in such handlers; a child forked
/// from a uswap thread is a copy of that thread).
pub fn spawn_quiet<F>(name: &str, f: F) -> std::io::Result<std::thread::JoinHandle<()>>
where
    F: FnOnce() + Send + 'static,
{
    let _quiet = Quiet::new();
    std::thread::Builder::new().name(name.into()).spawn(f)
}

/// Panics a supervised uswap thread survives before the program is stopped.
const MAX_RESTARTS: u32 = 10;

/// Runs a uswap thread's loop, `body`, again after it panics (the panic's message is on
/// stderr by then), with a line that says so and `panicked` run (to count it), so that a
/// fault waiting for the loop is served instead of hanging. The loops supervised this way
/// (kswapd, the SIGBUS service) keep their state in the region, and unwinding releases
/// the page locks they hold and puts the pages a reclaim pass had taken off the LRU lists
/// back on them (`vmscan::Isolated`). One that keeps panicking stops the program (SIGABRT)
/// rather than leave it to hang. Returns when `body` does.
pub(crate) fn supervise(name: &str, body: impl Fn(), panicked: impl Fn()) {
    let mut restarts = 0;
    while std::panic::catch_unwind(std::panic::AssertUnwindSafe(&body)).is_err() {
        panicked();
        restarts += 1;
        if restarts >= MAX_RESTARTS {
            eprintln!(
                "uswap: the {name} thread panicked {restarts} times; stopping the program \
                 rather than leave its faults to hang"
            );
            std::process::abort();
        }
        eprintln!(
            "uswap: the {name} thread panicked; it starts again ({restarts} of {MAX_RESTARTS})"
        );
    }
}

/// Whether `sig` is blocked in the calling thread.
pub(crate) fn is_blocked(sig: libc::c_int) -> bool {
    // SAFETY: querying this thread's mask.
    unsafe {
        let mut cur: libc::sigset_t = std::mem::zeroed();
        libc::pthread_sigmask(libc::SIG_BLOCK, std::ptr::null(), &mut cur);
        libc::sigismember(&cur, sig) == 1
    }
}

#[cfg(all(test, not(loom)))]
mod tests {
    #[test]
    fn a_supervised_loop_starts_again_after_each_panic_until_it_returns() {
        use std::sync::atomic::{AtomicU32, Ordering::Relaxed};
        let (runs, panics) = (AtomicU32::new(0), AtomicU32::new(0));
        super::supervise(
            "test",
            || {
                if runs.fetch_add(1, Relaxed) < 3 {
                    panic!("injected (test)");
                }
            },
            || {
                panics.fetch_add(1, Relaxed);
            },
        );
        assert_eq!((runs.into_inner(), panics.into_inner()), (4, 3));
    }

    use super::*;

    #[test]
    fn quiet_threads_block_async_signals_and_keep_synchronous_ones() {
        let t = spawn_quiet("t", || {
            assert!(is_blocked(libc::SIGPROF) && is_blocked(libc::SIGINT));
            assert!(!is_blocked(libc::SIGSEGV) && !is_blocked(libc::SIGBUS));
        })
        .unwrap();
        t.join().unwrap();
        assert!(!is_blocked(libc::SIGPROF), "the spawner's mask is restored");
        {
            let _q = Quiet::new();
            assert!(is_blocked(libc::SIGPROF));
        }
        assert!(!is_blocked(libc::SIGPROF));
    }
}
