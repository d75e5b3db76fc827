//! Atomics and waiting, switched to loom's model-checked versions under `--cfg loom`.

#[cfg(loom)]
pub(crate) use loom::sync::{atomic::AtomicU64, Mutex, MutexGuard};
#[cfg(not(loom))]
pub(crate) use std::sync::{atomic::AtomicU64, Mutex, MutexGuard};

/// Backs off while waiting for another thread: spin briefly, then yield, then sleep, so a
/// waiter on a page under I/O does not burn the CPU the I/O completion needs.
pub(crate) fn backoff(round: u32) {
    #[cfg(loom)]
    {
        let _ = round;
        loom::thread::yield_now();
    }
    #[cfg(not(loom))]
    {
        if round < 64 {
            std::hint::spin_loop();
        } else if round < 128 {
            std::thread::yield_now();
        } else {
            std::thread::sleep(std::time::Duration::from_micros(20));
        }
    }
}
