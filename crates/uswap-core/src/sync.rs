//! Atomics, locks and waiting, switched to loom's model-checked versions under `--cfg loom`,
//! and the one way uswap takes a mutex.

#[cfg(loom)]
pub(crate) use loom::sync::{
    atomic::{AtomicBool, AtomicU32, AtomicU64, AtomicUsize},
    Mutex, MutexGuard, RwLock, RwLockReadGuard, RwLockWriteGuard,
};
#[cfg(not(loom))]
pub(crate) use std::sync::{
    atomic::{AtomicBool, AtomicU32, AtomicU64, AtomicUsize},
    Mutex, MutexGuard, RwLock, RwLockReadGuard, RwLockWriteGuard,
};

/// Takes a std mutex (one that loom does not model, outside the modelled structures),
/// tolerating poison: a thread that panicked while holding it (a dying handler, say) must
/// not take every later fault down with it. Every structure behind a uswap mutex is left
/// consistent at each step, so its contents are still valid.
pub(crate) fn lock_std<T>(m: &std::sync::Mutex<T>) -> std::sync::MutexGuard<'_, T> {
    m.lock().unwrap_or_else(|e| e.into_inner())
}

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
