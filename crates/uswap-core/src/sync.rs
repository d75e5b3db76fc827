//! Atomics, locks and waiting, switched to loom's model-checked versions under `--cfg loom`,
//! and the one way uswap takes a mutex.

#[cfg(loom)]
pub(crate) use loom::sync::{
    atomic::{fence, AtomicBool, AtomicPtr, AtomicU32, AtomicU64, AtomicUsize},
    Condvar, Mutex, MutexGuard, RwLock, RwLockReadGuard, RwLockWriteGuard,
};
#[cfg(not(loom))]
pub(crate) use std::sync::{
    atomic::{fence, AtomicBool, AtomicPtr, AtomicU32, AtomicU64, AtomicUsize},
    Condvar, Mutex, MutexGuard, RwLock, RwLockReadGuard, RwLockWriteGuard,
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

/// An atomic word that holds `value ^ INIT`, so that all-zero memory reads as `INIT`.
/// Per-page metadata made of these comes from zeroed allocations, which the kernel maps on
/// first touch: a region's page table costs memory and start-up time only for the pages the
/// program uses, not for its whole address space. Bits that are clear in `INIT` read and
/// change as in a plain atomic (`fetch_and` keeps to those).
macro_rules! xor_atomic {
    ($name:ident, $atomic:ident, $int:ty) => {
        #[repr(transparent)]
        pub(crate) struct $name<const INIT: $int>($atomic);

        impl<const INIT: $int> $name<INIT> {
            pub fn new(value: $int) -> Self {
                $name($atomic::new(value ^ INIT))
            }

            pub fn load(&self, order: std::sync::atomic::Ordering) -> $int {
                self.0.load(order) ^ INIT
            }

            pub fn store(&self, value: $int, order: std::sync::atomic::Ordering) {
                self.0.store(value ^ INIT, order)
            }

            pub fn compare_exchange(
                &self,
                current: $int,
                new: $int,
                success: std::sync::atomic::Ordering,
                failure: std::sync::atomic::Ordering,
            ) -> Result<$int, $int> {
                self.0
                    .compare_exchange(current ^ INIT, new ^ INIT, success, failure)
                    .map(|v| v ^ INIT)
                    .map_err(|v| v ^ INIT)
            }

            /// `mask` must keep every bit set in `INIT`: those are stored inverted.
            #[allow(dead_code)] // not every width needs it
            pub fn fetch_and(&self, mask: $int, order: std::sync::atomic::Ordering) -> $int {
                debug_assert_eq!(
                    mask & INIT,
                    INIT,
                    "fetch_and would clear a stored-inverted bit"
                );
                self.0.fetch_and(mask, order) ^ INIT
            }
        }
    };
}

xor_atomic!(XorU32, AtomicU32, u32);
xor_atomic!(XorU64, AtomicU64, u64);

/// `n` values of `T` whose all-zero bits are their initial state (a type made only of the
/// atomics above), from zeroed memory: nothing is written, so nothing is touched. Under loom,
/// whose atomics are not plain memory, each is made with `init`.
pub(crate) fn zeroed_slice<T>(n: usize, init: impl Fn() -> T) -> Box<[T]> {
    #[cfg(loom)]
    {
        (0..n).map(|_| init()).collect()
    }
    #[cfg(not(loom))]
    {
        let _ = init;
        let layout = std::alloc::Layout::array::<T>(n).expect("a table that fits in memory");
        if layout.size() == 0 {
            return Vec::new().into_boxed_slice();
        }
        // SAFETY: a non-empty layout for `n` values; callers pass only types made of std
        // atomics wrapped by `xor_atomic!`, for which all-zero bits are a valid value, the
        // initial one, so the zeroed memory holds `n` initialized values owned by the box.
        unsafe {
            let ptr = std::alloc::alloc_zeroed(layout).cast::<T>();
            if ptr.is_null() {
                std::alloc::handle_alloc_error(layout);
            }
            Box::from_raw(std::ptr::slice_from_raw_parts_mut(ptr, n))
        }
    }
}
