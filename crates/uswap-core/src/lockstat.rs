//! Lock statistics, the content of the kernel's `/proc/lock_stat` for uswap's own locks:
//! for each lock, how often it was taken, how often the taker found it held (contended),
//! and how long contended takers waited in all and at most.
//!
//! Always on. An uncontended acquisition costs one relaxed add on a counter that sits
//! beside the mutex (its cache line is the taker's already); only a contended one reads
//! the clock, twice. Counters live in each lock, not per lock class, so sharded locks do
//! not share a counter line and contend on it; owners sum their locks' counters when asked.

use crate::lockdep::{self, Rank, Ranked};
use crate::sync::{AtomicBool, Mutex, MutexGuard, RwLock, RwLockReadGuard, RwLockWriteGuard};
use serde::Serialize;
use std::sync::atomic::AtomicU64;
use std::sync::atomic::Ordering::{Acquire, Relaxed, Release};
use std::time::Instant;

/// The statistics of one lock, or of a class of locks summed.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Serialize)]
pub struct LockStat {
    /// Times the lock was taken.
    pub acquisitions: u64,
    /// Times the taker found it held and had to wait.
    pub contended: u64,
    /// Nanoseconds contended takers waited, in all.
    pub wait_ns_total: u64,
    /// The longest single wait, in nanoseconds.
    pub wait_ns_max: u64,
}

impl LockStat {
    /// Adds another lock's statistics (for a class of locks).
    pub fn add(&mut self, other: LockStat) {
        self.acquisitions += other.acquisitions;
        self.contended += other.contended;
        self.wait_ns_total += other.wait_ns_total;
        self.wait_ns_max = self.wait_ns_max.max(other.wait_ns_max);
    }

    /// The change since `earlier` (the maximum is kept: it cannot be taken apart).
    pub fn since(&self, earlier: &LockStat) -> LockStat {
        LockStat {
            acquisitions: self.acquisitions.saturating_sub(earlier.acquisitions),
            contended: self.contended.saturating_sub(earlier.contended),
            wait_ns_total: self.wait_ns_total.saturating_sub(earlier.wait_ns_total),
            wait_ns_max: self.wait_ns_max,
        }
    }

    /// Share of acquisitions that had to wait.
    pub fn contention_ratio(&self) -> f64 {
        if self.acquisitions == 0 {
            0.0
        } else {
            self.contended as f64 / self.acquisitions as f64
        }
    }
}

/// One named lock class and its summed statistics, as reported.
#[derive(Clone, Debug, PartialEq, Eq, Serialize)]
pub struct LockClass {
    /// The class name, such as `swap_cache` or `swap_cluster`.
    pub name: &'static str,
    /// How many locks of the class there are.
    pub locks: usize,
    #[serde(flatten)]
    pub stat: LockStat,
}

impl LockClass {
    /// Sums `locks` into one class line.
    pub(crate) fn sum<'a, L: Counted + ?Sized + 'a>(
        name: &'static str,
        locks: impl IntoIterator<Item = &'a L>,
    ) -> LockClass {
        let mut class = LockClass {
            name,
            locks: 0,
            stat: LockStat::default(),
        };
        for l in locks {
            class.locks += 1;
            class.stat.add(l.stat());
        }
        class
    }

    /// The change since `earlier` (the same class, read before).
    pub fn since(&self, earlier: &LockClass) -> LockClass {
        LockClass {
            name: self.name,
            locks: self.locks,
            stat: self.stat.since(&earlier.stat),
        }
    }
}

/// A lock that keeps a [`LockStat`].
pub(crate) trait Counted {
    fn stat(&self) -> LockStat;
}

/// The counters every kind of lock here keeps.
#[derive(Default)]
struct Counters {
    acquisitions: AtomicU64,
    contended: AtomicU64,
    wait_ns_total: AtomicU64,
    wait_ns_max: AtomicU64,
}

impl Counters {
    fn acquired(&self) {
        self.acquisitions.fetch_add(1, Relaxed);
    }

    /// A contended acquisition that waited since `start`.
    fn waited(&self, start: Instant) {
        let ns = start.elapsed().as_nanos() as u64;
        self.contended.fetch_add(1, Relaxed);
        self.wait_ns_total.fetch_add(ns, Relaxed);
        self.wait_ns_max.fetch_max(ns, Relaxed);
    }

    /// Takes a lock with `try_take`, falling back to the blocking `take` (then counted as
    /// contended), tolerating poison.
    fn take<G>(
        &self,
        try_take: impl FnOnce() -> std::sync::TryLockResult<G>,
        take: impl FnOnce() -> std::sync::LockResult<G>,
    ) -> G {
        let guard = match try_take() {
            Ok(g) => g,
            Err(std::sync::TryLockError::Poisoned(e)) => e.into_inner(),
            Err(std::sync::TryLockError::WouldBlock) => {
                let start = Instant::now();
                let g = take().unwrap_or_else(|e| e.into_inner());
                self.waited(start);
                g
            }
        };
        self.acquired();
        guard
    }

    fn stat(&self) -> LockStat {
        LockStat {
            acquisitions: self.acquisitions.load(Relaxed),
            contended: self.contended.load(Relaxed),
            wait_ns_total: self.wait_ns_total.load(Relaxed),
            wait_ns_max: self.wait_ns_max.load(Relaxed),
        }
    }
}

/// A mutex that keeps its [`LockStat`], of a class in the lock table (`lockdep.rs`).
/// Poison is tolerated, as with `sync::lock_std`.
pub(crate) struct StatMutex<T> {
    inner: Mutex<T>,
    counters: Counters,
    rank: Rank,
}

/// A held [`StatMutex`].
pub(crate) type StatGuard<'a, T> = Ranked<MutexGuard<'a, T>>;

impl<T> StatMutex<T> {
    pub(crate) fn new(rank: Rank, value: T) -> StatMutex<T> {
        StatMutex {
            inner: Mutex::new(value),
            counters: Counters::default(),
            rank,
        }
    }

    /// Takes the lock, waiting if it is held.
    pub(crate) fn lock(&self) -> StatGuard<'_, T> {
        Ranked::take(self.rank, || {
            self.counters
                .take(|| self.inner.try_lock(), || self.inner.lock())
        })
    }

    /// Takes the lock if it is free.
    pub(crate) fn try_lock(&self) -> Option<StatGuard<'_, T>> {
        let guard = match self.inner.try_lock() {
            Ok(g) => g,
            Err(std::sync::TryLockError::Poisoned(e)) => e.into_inner(),
            Err(std::sync::TryLockError::WouldBlock) => return None,
        };
        self.counters.acquired();
        Some(Ranked::taken(self.rank, guard))
    }
}

impl<T> Counted for StatMutex<T> {
    fn stat(&self) -> LockStat {
        self.counters.stat()
    }
}

/// A spinlock that keeps its [`LockStat`]: a waiter spins (then yields) instead of
/// sleeping in the kernel.
pub(crate) struct StatSpin {
    held: AtomicBool,
    counters: Counters,
    rank: Rank,
}

pub(crate) struct SpinGuard<'a>(&'a StatSpin);

impl Drop for SpinGuard<'_> {
    fn drop(&mut self) {
        self.0.held.store(false, Release);
        lockdep::released(self.0.rank);
    }
}

impl StatSpin {
    pub(crate) fn new(rank: Rank) -> StatSpin {
        StatSpin {
            held: AtomicBool::new(false),
            counters: Counters::default(),
            rank,
        }
    }

    pub(crate) fn lock(&self) -> SpinGuard<'_> {
        lockdep::before_blocking(self.rank);
        lockdep::acquired(self.rank);
        if !self.try_take() {
            let start = Instant::now();
            let mut round = 0;
            while !self.try_take() {
                crate::sync::backoff(round);
                round += 1;
            }
            self.counters.waited(start);
        }
        self.counters.acquired();
        SpinGuard(self)
    }

    fn try_take(&self) -> bool {
        !self.held.load(Relaxed)
            && self
                .held
                .compare_exchange(false, true, Acquire, Relaxed)
                .is_ok()
    }
}

impl Counted for StatSpin {
    fn stat(&self) -> LockStat {
        self.counters.stat()
    }
}

/// A reader-writer lock used as a two-mode lock (seed 001): shared by code that keeps
/// itself consistent with finer means, exclusive for code that needs the whole structure.
/// Keeps one [`LockStat`] for both modes.
pub(crate) struct StatRwLock {
    inner: RwLock<()>,
    counters: Counters,
    rank: Rank,
}

impl StatRwLock {
    pub(crate) fn new(rank: Rank) -> StatRwLock {
        StatRwLock {
            inner: RwLock::new(()),
            counters: Counters::default(),
            rank,
        }
    }

    pub(crate) fn shared(&self) -> Ranked<RwLockReadGuard<'_, ()>> {
        Ranked::take(self.rank, || {
            self.counters
                .take(|| self.inner.try_read(), || self.inner.read())
        })
    }

    /// Shared, when no one holds or waits for it exclusive; never waits.
    pub(crate) fn try_shared(&self) -> Option<Ranked<RwLockReadGuard<'_, ()>>> {
        let guard = match self.inner.try_read() {
            Ok(g) => g,
            Err(std::sync::TryLockError::Poisoned(e)) => e.into_inner(),
            Err(std::sync::TryLockError::WouldBlock) => return None,
        };
        self.counters.acquired();
        Some(Ranked::taken(self.rank, guard))
    }

    pub(crate) fn exclusive(&self) -> Ranked<RwLockWriteGuard<'_, ()>> {
        Ranked::take(self.rank, || {
            self.counters
                .take(|| self.inner.try_write(), || self.inner.write())
        })
    }
}

impl Counted for StatRwLock {
    fn stat(&self) -> LockStat {
        self.counters.stat()
    }
}

#[cfg(all(test, not(loom)))]
mod tests {
    use super::*;
    use std::sync::{Arc, Barrier};
    use std::time::Duration;

    #[test]
    fn uncontended_acquisitions_are_counted_without_waits() {
        let m = StatMutex::new(Rank::Latency, 0u32);
        for _ in 0..5 {
            *m.lock() += 1;
        }
        let s = m.stat();
        assert_eq!((s.acquisitions, s.contended, s.wait_ns_total), (5, 0, 0));
    }

    #[test]
    fn a_taker_that_finds_the_lock_held_counts_its_wait() {
        let m = Arc::new(StatMutex::new(Rank::Latency, ()));
        let held = Arc::new(Barrier::new(2));
        let guard = m.lock();
        let waiter = {
            let (m, held) = (m.clone(), held.clone());
            std::thread::spawn(move || {
                held.wait();
                drop(m.lock());
            })
        };
        held.wait();
        // The waiter cannot get in before this sleep ends.
        std::thread::sleep(Duration::from_millis(20));
        drop(guard);
        waiter.join().unwrap();
        let s = m.stat();
        assert_eq!((s.acquisitions, s.contended), (2, 1));
        assert!(s.wait_ns_max >= 10_000_000, "waited {} ns", s.wait_ns_max);
        assert_eq!(s.wait_ns_total, s.wait_ns_max);
    }

    #[test]
    fn classes_sum_their_locks_and_subtract_an_earlier_reading() {
        let locks: Vec<StatMutex<()>> = (0..3).map(|_| StatMutex::new(Rank::Latency, ())).collect();
        drop(locks[0].lock());
        let before = LockClass::sum("t", &locks);
        drop(locks[1].lock());
        drop(locks[2].lock());
        let after = LockClass::sum("t", &locks);
        assert_eq!((after.locks, after.stat.acquisitions), (3, 3));
        assert_eq!(after.since(&before).stat.acquisitions, 2);
    }
}
