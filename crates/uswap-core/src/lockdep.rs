//! The lock table: every lock uswap takes, with its rank, and a small lockdep that holds
//! the code to it in debug builds.
//!
//! Locks nest in rank order, outermost first. A thread may block on a lock only while every
//! lock it holds has a lower rank, except page locks, which a thread may hold many of at
//! once (reclaim's isolated batch, a vma event's range, the walker, fork's batch); those
//! it takes blocking only in address order, and every other holder of several only
//! try-locks. A try-lock may be taken at any point: it cannot deadlock, it only counts as
//! held for what the thread takes under it.
//!
//! In debug builds (not under loom) each thread keeps a count of the locks it holds per
//! rank, and each blocking acquisition asserts the order, naming both locks; release
//! builds keep nothing and check nothing. Page locks, the lock statistics locks
//! (`lockstat.rs`) and the few std mutexes outside them all report here.
//!
//! The order, with the function at each nesting (rank: lock, where it is taken, and what
//! is taken under it):
//!
//! 1. `ForkRegistry` (`fork.rs`, the registry of live regions): held by `fork::prepare`
//!    until `parent` or `child`; page locks, reclaim and swap I/O under it.
//!    - `ForkFence` (`Mm::fork_fence`, one per region): taken exclusive under the registry
//!      by `fork::prepare`, every region's in the registry's order (held like it), before
//!      page locks; aging only try-locks it shared, under its isolated pages' locks.
//! 2. `Page` (the lock bit of a page's word, `page.rs`): the fault path holds one across
//!    swap I/O and `charge` (direct reclaim try-locks others under it); `Vma::discard`,
//!    the walker and `fork::Copier` take many blocking, in address order; reclaim only
//!    try-locks.
//! 3. `VmaPlacements` (`vma.rs`): `Vma::move_out` pushes under a page lock;
//!    `Vma::place_pending` holds it across swap reads, the bounce pool and slot frees.
//! 4. `LruBatch` (`lru.rs`, per CPU): held while a batch is linked, which takes `Lru`.
//! 5. `Lru` (`lru.rs`): list membership; under page locks; only try-locks pages.
//! 6. `ReadaheadWindow` (`readahead.rs`): the last window, held by
//!    `ReadaheadState::window` while the swap cache marks the window's pages used.
//! 7. `StagingPcp` (`staging.rs`, per CPU): a per-CPU free list, which refills from and
//!    spills to the shared one.
//! 8. `Staging` (`staging.rs`): the shared free list and the deferred list.
//! 9. `SwapGrowth` (`swapfile/mod.rs`): a growing file's size, held while clusters are
//!    appended to the allocator (which takes `SwapLists`).
//! 10. `SwapScan`, 11. `SwapCluster`, 12. `SwapLists` (`swapfile/cluster.rs`): the slot
//!     allocator, at most one lock of each at a time, in that order.
//! 13. `SwapCache` (`swapfile/swap_state.rs`, per trunk): under the page lock of the page
//!     an entry names, and under `ReadaheadWindow`.
//! 14. `RingPool` (`swapfile/swap_io.rs`): taking and giving back an io_uring; under page
//!     locks, never across I/O.
//! 15. The leaves, under which nothing is taken: `Reservation` (`assembly.rs`),
//!     `Leadership` and `RetryList` (`handler.rs`), `Kswapd` (`vmscan.rs`), `Latency`
//!     (`stats.rs`) and `Phases` (`breakdown.rs`), whose histogram shards are recorded
//!     into at the end of a fault; the compressed tier's `ZswapLru` (`swapfile/zswap.rs`,
//!     its store order) and `ZpoolClass` (`swapfile/zpool.rs`, a size class's chunks),
//!     taken by reclaim's writes under page locks; `SwapLifelines` (`swapfile/swap_map.rs`,
//!     the forks whose holds on slots a device watches), taken by the fork handlers, by
//!     kswapd and by a slot allocation that finds the device full.
//!
//! The resident budget, the bounce pool, the swap cache's readahead markers, the pins of
//! `gup.rs` and the SIGBUS handler's tables are lock-free. The fill gate of
//! `mmap_changing.rs` is not a lock: a fill waits on it only while a read is in progress.

/// Declares [`Rank`] and the list of every rank, from one list of names.
macro_rules! ranks {
    ($($name:ident,)*) => {
        /// Every lock class, in the order they nest (see the module's text).
        #[derive(Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord)]
        #[repr(u8)]
        pub(crate) enum Rank { $($name,)* }

        /// Every rank, by number.
        #[cfg(all(debug_assertions, not(loom)))]
        const ALL: &[Rank] = &[$(Rank::$name,)*];
    };
}

ranks! {
    ForkRegistry,
    ForkFence,
    Page,
    VmaPlacements,
    LruBatch,
    Lru,
    ReadaheadWindow,
    StagingPcp,
    Staging,
    SwapGrowth,
    SwapScan,
    SwapCluster,
    SwapLists,
    SwapCache,
    RingPool,
    Reservation,
    Leadership,
    RetryList,
    Kswapd,
    Latency,
    Phases,
    ZswapLru,
    ZpoolClass,
    SwapLifelines,
}

#[cfg(all(debug_assertions, not(loom)))]
mod checked {
    use super::{Rank, ALL};
    use std::cell::Cell;

    const RANKS: usize = ALL.len();

    impl Rank {
        /// Whether a thread may hold several locks of this rank (pages: taking them in
        /// address order, or only try-locking; fork fences: taken exclusive only by the
        /// forking thread, under the registry, in its order).
        fn nests_with_itself(self) -> bool {
            matches!(self, Rank::Page | Rank::ForkFence)
        }
    }

    thread_local! {
        /// Locks this thread holds, per rank. Constant-initialised and without a
        /// destructor, so the SIGBUS handler may read it.
        static HELD: [Cell<u32>; RANKS] = const { [const { Cell::new(0) }; RANKS] };
    }

    pub(super) fn check(rank: Rank) {
        HELD.with(|held| {
            for (r, count) in held.iter().enumerate().skip(rank as usize) {
                let same = r == rank as usize;
                if count.get() > 0 && !(same && rank.nests_with_itself()) {
                    let holding = ALL[r];
                    panic!(
                        "lock order: this thread blocks on a {rank:?} lock while holding a \
                         {holding:?} lock (the order is in lockdep.rs)"
                    );
                }
            }
        });
    }

    pub(super) fn add(rank: Rank, n: i64) {
        HELD.with(|held| {
            let count = &held[rank as usize];
            let now = i64::from(count.get()) + n;
            assert!(
                now >= 0,
                "lockdep: this thread releases a {rank:?} lock it does not hold (taken on \
                 another thread?)"
            );
            count.set(now as u32);
        });
    }

    #[cfg(test)]
    pub(super) fn held(rank: Rank) -> u32 {
        HELD.with(|held| held[rank as usize].get())
    }
}

/// Before a blocking acquisition of a `rank` lock: asserts (debug builds) that the thread
/// holds no lock it must not block under.
#[inline]
pub(crate) fn before_blocking(rank: Rank) {
    #[cfg(all(debug_assertions, not(loom)))]
    checked::check(rank);
    #[cfg(not(all(debug_assertions, not(loom))))]
    let _ = rank;
}

/// A `rank` lock was taken (blocking or not).
#[inline]
pub(crate) fn acquired(rank: Rank) {
    #[cfg(all(debug_assertions, not(loom)))]
    checked::add(rank, 1);
    #[cfg(not(all(debug_assertions, not(loom))))]
    let _ = rank;
}

/// A `rank` lock was released.
#[inline]
pub(crate) fn released(rank: Rank) {
    #[cfg(all(debug_assertions, not(loom)))]
    checked::add(rank, -1);
    #[cfg(not(all(debug_assertions, not(loom))))]
    let _ = rank;
}

/// A guard of a ranked lock: the lock's own guard, reported released when dropped.
pub(crate) struct Ranked<G> {
    guard: G,
    rank: Rank,
}

impl<G> Ranked<G> {
    /// Takes a lock blocking through `take`, checking the order first.
    pub(crate) fn take(rank: Rank, take: impl FnOnce() -> G) -> Ranked<G> {
        before_blocking(rank);
        let guard = take();
        acquired(rank);
        Ranked { guard, rank }
    }

    /// A lock `try_take` got without waiting (no order to check).
    pub(crate) fn taken(rank: Rank, guard: G) -> Ranked<G> {
        acquired(rank);
        Ranked { guard, rank }
    }

    /// Passes the lock's own guard through `f`, a condition variable's wait, which
    /// gives it back held. As far as the order goes it stays held throughout.
    pub(crate) fn wait_with(self, f: impl FnOnce(G) -> G) -> Ranked<G> {
        /// Reports the lock released should `f` unwind (the guard it owns goes with it).
        struct OnUnwind(Rank);
        impl Drop for OnUnwind {
            fn drop(&mut self) {
                released(self.0);
            }
        }
        let this = std::mem::ManuallyDrop::new(self);
        // SAFETY: `this` is never dropped, so the guard read out of it is the only one.
        let guard = unsafe { std::ptr::read(&this.guard) };
        let on_unwind = OnUnwind(this.rank);
        let guard = f(guard);
        std::mem::forget(on_unwind);
        Ranked {
            guard,
            rank: this.rank,
        }
    }
}

impl<G: std::ops::Deref> std::ops::Deref for Ranked<G> {
    type Target = G::Target;
    fn deref(&self) -> &G::Target {
        &self.guard
    }
}

impl<G: std::ops::DerefMut> std::ops::DerefMut for Ranked<G> {
    fn deref_mut(&mut self) -> &mut G::Target {
        &mut self.guard
    }
}

impl<G> Drop for Ranked<G> {
    fn drop(&mut self) {
        released(self.rank);
    }
}

#[cfg(all(test, debug_assertions, not(loom)))]
mod tests {
    use super::checked::held;
    use super::*;

    #[test]
    fn locks_taken_in_rank_order_pass_and_page_locks_nest() {
        let a = Ranked::take(Rank::ForkRegistry, || ());
        let p1 = Ranked::take(Rank::Page, || ());
        let p2 = Ranked::take(Rank::Page, || ());
        let leaf = Ranked::take(Rank::SwapCache, || ());
        assert_eq!(held(Rank::Page), 2);
        drop((leaf, p2, p1, a));
        assert_eq!(held(Rank::Page), 0);
    }

    #[test]
    fn blocking_on_a_lower_rank_while_holding_a_higher_one_is_caught() {
        let caught = std::panic::catch_unwind(|| {
            let _leaf = Ranked::take(Rank::SwapCache, || ());
            let _page = Ranked::take(Rank::Page, || ());
        });
        let message = *caught.unwrap_err().downcast::<String>().unwrap();
        assert!(
            message.contains("blocks on a Page lock while holding a SwapCache"),
            "{message}"
        );
        assert_eq!(held(Rank::SwapCache), 0, "unwinding released it");
    }

    #[test]
    fn two_locks_of_one_rank_that_does_not_nest_are_caught_and_a_try_lock_is_not() {
        let scan = Ranked::take(Rank::SwapScan, || ());
        let also = Ranked::taken(Rank::SwapScan, ());
        assert!(std::panic::catch_unwind(|| Ranked::take(Rank::SwapScan, || ())).is_err());
        drop((also, scan));
    }
}
