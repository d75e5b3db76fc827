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
            give_way();
        } else {
            nap();
        }
    }
}

#[cfg(not(loom))]
thread_local! {
    /// Until when this thread takes its CPU for a busy one (see [`give_way`]).
    static CPU_BUSY_UNTIL: std::cell::Cell<Option<std::time::Instant>> =
        const { std::cell::Cell::new(None) };
}

/// A yield that took longer than this found the CPU busy with other programs.
#[cfg(not(loom))]
const YIELD_GAVE_A_SLICE: std::time::Duration = std::time::Duration::from_micros(200);

/// How long a thread that found its CPU busy naps instead of yielding.
#[cfg(not(loom))]
const BUSY_FOR: std::time::Duration = std::time::Duration::from_millis(50);

/// Lets another thread run while this one waits for it: `sched_yield`, unless a recent
/// yield found the CPU busy with other programs. There a yield gives the rest of the time
/// slice away (most of a millisecond) to a program that wants the CPU anyway, where the
/// kernel's own waiters sleep and are woken when their event comes; a nap ([`nap`]) is
/// woken within a tenth of that. Safe in a signal handler (a thread-local cell and the
/// vDSO's clock).
#[cfg(not(loom))]
pub(crate) fn give_way() {
    let before = std::time::Instant::now();
    if cpu_busy(before) {
        return nap();
    }
    sched_yield();
    note_yield(before, std::time::Instant::now());
}

#[cfg(not(loom))]
fn cpu_busy(now: std::time::Instant) -> bool {
    CPU_BUSY_UNTIL.get().is_some_and(|until| now < until)
}

/// A yield from `before` to `after` that took long found the CPU busy.
#[cfg(not(loom))]
fn note_yield(before: std::time::Instant, after: std::time::Instant) {
    if after - before > YIELD_GAVE_A_SLICE {
        CPU_BUSY_UNTIL.set(Some(after + BUSY_FOR));
    }
}

#[cfg(not(loom))]
fn sched_yield() {
    // SAFETY: no arguments; async-signal-safe.
    unsafe { libc::syscall(libc::SYS_sched_yield) };
}

/// The looks of a poller that yields between them, told the time by the poller's own
/// clock (a poll reads it anyway): a yield that took longer than [`YIELD_GAVE_A_SLICE`]
/// marks the thread's CPU busy, and for [`BUSY_FOR`] after, a look does the poller's
/// `busy` step instead of yielding (see [`give_way`]).
#[cfg(not(loom))]
pub(crate) struct Looks {
    last: std::time::Instant,
}

#[cfg(not(loom))]
impl Looks {
    /// Looks that start at `now`.
    pub fn new(now: std::time::Instant) -> Looks {
        Looks { last: now }
    }

    /// The poller read the clock: `now`. Told before the poller decides whether its time
    /// is up, since one yield that gave a slice away takes longer than a whole poll.
    pub fn at(&mut self, now: std::time::Instant) {
        note_yield(self.last, now);
        self.last = now;
    }

    /// One look: a yield, or `busy` on a CPU found busy.
    pub fn look(&self, busy: impl FnOnce()) {
        if cpu_busy(self.last) {
            busy();
        } else {
            sched_yield();
        }
    }
}

/// Sleeps 20 µs (about 70 with the default timer slack). Through `syscall(2)`: neither a
/// cancellation point (the C library's `nanosleep` is one, and a cancellation acting inside
/// uswap's signal handlers would abort the process) nor a panic on an error as
/// `std::thread::sleep` (a waiter whose stack page aging took out sees EFAULT, and only
/// waits less). Async-signal-safe.
#[cfg(not(loom))]
pub(crate) fn nap() {
    let pause = libc::timespec {
        tv_sec: 0,
        tv_nsec: 20_000,
    };
    // SAFETY: a timespec on our stack; no remainder is asked for.
    unsafe {
        libc::syscall(
            libc::SYS_nanosleep,
            &pause,
            std::ptr::null_mut::<libc::timespec>(),
        )
    };
}

/// Under loom, every wait is a yield to the model's scheduler.
#[cfg(loom)]
pub(crate) fn give_way() {
    loom::thread::yield_now();
}

#[cfg(loom)]
pub(crate) struct Looks;

#[cfg(loom)]
impl Looks {
    pub fn new(_now: std::time::Instant) -> Looks {
        Looks
    }

    pub fn at(&mut self, _now: std::time::Instant) {}

    pub fn look(&self, _busy: impl FnOnce()) {
        loom::thread::yield_now();
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
