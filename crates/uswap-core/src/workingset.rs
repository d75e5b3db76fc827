//! Working-set detection ([mm/workingset.c]) and the replacement policy that uses it.
//!
//! # Shadows and refault distance
//!
//! When a page leaves memory (written out, or dropped clean) it keeps a shadow: the
//! region's nonresident age at that moment. The age counts evictions and activations (a
//! page promoted from the inactive list), as the kernel's `lruvec->nonresident_age` does.
//! When the page faults back in, the age gone by since its eviction is its *refault
//! distance*: how many more pages memory would have needed to hold it. A distance no longer
//! than the mapped lists (active and probation) means the page was evicted while pages
//! used less recently stayed mapped: it belongs to the working set and goes to the active
//! list (`workingset_activate`). (The kernel compares with its active lists, which hold
//! most of its memory; under `s3fifo` most new pages are on probation, so uswap counts
//! both, as S3-FIFO's ghost queue is as long as its main queue.) Every swap-in that finds
//! a shadow is a refault (`workingset_refault`).
//!
//! Shadows are one `u32` per page (4 bytes per page of the region, touched only for pages
//! that were evicted), written and taken under the page lock; the age wraps, so a shadow
//! older than 2^32 events reads as a recent one. A policy hint only: it decides a list,
//! never what a page holds.
//!
//! # Policies (`Config::lru_policy`, switchable while the region runs)
//!
//! - `two-list` (uswap's behaviour before the policies): every page mapped goes to the
//!   head of the active list, readahead to its tail; aging takes the active tail into the
//!   inactive window (unmapped), where a touch promotes it. Shadows are kept and refaults
//!   counted, nothing else changes.
//! - `s3fifo`, the default: S3-FIFO (Yang et al., SOSP 2023) on uswap's lists. New pages —
//!   first touch, and swap-ins whose refault distance is past the working set — go to the
//!   probation list, which aging empties first: the next pages aging unmaps are the newest arrivals,
//!   so probation and the inactive window together are S3-FIFO's small FIFO. A page
//!   touched in the window is promoted to the active list (the main FIFO), one not touched
//!   is evicted and leaves a shadow (the ghost FIFO); a refault within the working set
//!   goes straight to the active list. A page used once (a scan, the cold tail of a skewed
//!   set) passes through and out without pushing the working set down the active list.
//!   S3-FIFO counts hits on resident objects; uswap cannot see references to mapped pages,
//!   so a touch in the window stands in for a hit (one bit, the referenced flag, for the
//!   main list). Aging probation first is what the kernel does with new anonymous pages
//!   (they start on its inactive list); a simulation of both on the benchmark's traces
//!   (docs/benchmarks.md, "Issue 26") found it missed less than a probation list kept at
//!   a tenth of the mapped pages, S3-FIFO's own proportion.
//!
//! Switching changes where the next pages go; pages on probation when `two-list` comes
//! back are aged first until the list is empty.

use crate::config::LruPolicy;
use crate::lru::{Lru, LruList};
use crate::sync::{zeroed_slice, AtomicU32};
use std::sync::atomic::Ordering::Relaxed;

/// What a swap-in found of its page's past.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum Refault {
    /// No shadow: the page was never evicted here (a fork child's inherited page).
    None,
    /// Evicted longer ago than the mapped lists are long.
    Distant,
    /// Evicted within the working set: it goes to the active list.
    Workingset,
}

/// How a page came to be mapped, for [`Workingset::place`].
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum Arrival {
    FirstTouch,
    SwapIn(Refault),
    /// Read ahead of a fault that did not ask for it.
    Readahead,
}

pub(crate) struct Workingset {
    /// Evictions and activations so far (the kernel's nonresident age).
    age: AtomicU32,
    /// Per page: the age when it was evicted, 0 when it has no shadow.
    shadows: Box<[AtomicU32]>,
    /// The policy's index in `LruPolicy::ALL`.
    policy: AtomicU32,
}

impl Workingset {
    pub fn new(pages: usize, policy: LruPolicy) -> Workingset {
        Workingset {
            age: AtomicU32::new(0),
            shadows: zeroed_slice(pages, || AtomicU32::new(0)),
            policy: AtomicU32::new(policy as u32),
        }
    }

    pub fn policy(&self) -> LruPolicy {
        LruPolicy::ALL[self.policy.load(Relaxed) as usize]
    }

    /// Switches the policy: the next pages mapped are placed by it.
    pub fn set_policy(&self, policy: LruPolicy) {
        self.policy.store(policy as u32, Relaxed);
    }

    /// A page (locked) left memory: it keeps a shadow of the age now.
    pub fn evicted(&self, page: usize) {
        let stamp = self.age.fetch_add(1, Relaxed).wrapping_add(1).max(1);
        self.shadows[page].store(stamp, Relaxed);
    }

    /// A page (locked) that left the region, or whose data the program discarded, has no
    /// past here.
    pub fn forget(&self, page: usize) {
        self.shadows[page].store(0, Relaxed);
    }

    /// The page at `from` moved to `to` (both locked, mremap inside the region): its
    /// shadow goes with it.
    pub fn moved(&self, from: usize, to: usize) {
        self.shadows[to].store(self.shadows[from].swap(0, Relaxed), Relaxed);
    }

    /// An inactive page was promoted, or a refault joined the active list: the age moves
    /// on, as it does for an eviction.
    pub fn activated(&self) {
        self.age.fetch_add(1, Relaxed);
    }

    /// A page (locked) is being swapped in: its shadow, taken, against the mapped lists
    /// of `lru`.
    pub fn refault(&self, page: usize, lru: &Lru) -> Refault {
        let stamp = self.shadows[page].swap(0, Relaxed);
        if stamp == 0 {
            return Refault::None;
        }
        let distance = self.age.load(Relaxed).wrapping_sub(stamp) as usize;
        if distance <= lru.len(LruList::Active) + lru.len(LruList::Probation) {
            Refault::Workingset
        } else {
            Refault::Distant
        }
    }

    /// The list a page mapped by `arrival` joins, and whether at its tail (first to age).
    pub fn place(&self, arrival: Arrival) -> (LruList, bool) {
        match (self.policy(), arrival) {
            (_, Arrival::SwapIn(Refault::Workingset)) => (LruList::Active, false),
            (LruPolicy::TwoList, Arrival::Readahead) => (LruList::Active, true),
            (LruPolicy::TwoList, _) => (LruList::Active, false),
            (LruPolicy::S3fifo, Arrival::Readahead) => (LruList::Probation, true),
            (LruPolicy::S3fifo, _) => (LruList::Probation, false),
        }
    }

    /// The mapped list aging takes its next batch from: probation while it holds any
    /// page (under `two-list`, only pages left from `s3fifo`), else the active list.
    pub fn aging_source(&self, lru: &Lru) -> LruList {
        if lru.len(LruList::Probation) > 0 {
            LruList::Probation
        } else {
            LruList::Active
        }
    }
}

#[cfg(all(test, not(loom)))]
mod tests {
    use super::*;
    use crate::config::LruLockMode;

    fn lru_with_active(pages: usize, active: usize) -> Lru {
        let lru = Lru::new(pages, LruLockMode::Mutex, 1, 1);
        lru.add(LruList::Active, 0..active);
        lru
    }

    #[test]
    fn a_refault_within_the_mapped_lists_is_in_the_working_set() {
        let (ws, lru) = (
            Workingset::new(16, LruPolicy::S3fifo),
            lru_with_active(16, 3),
        );
        // 3 active and 1 on probation are mapped; inactive pages do not count.
        lru.add(LruList::Probation, [3]);
        lru.add(LruList::Inactive, [4, 5]);
        ws.evicted(10);
        (0..3).for_each(|_| ws.activated());
        assert_eq!(ws.refault(10, &lru), Refault::Workingset, "distance 3 of 4");
        assert_eq!(ws.refault(10, &lru), Refault::None, "the shadow is taken");
        ws.evicted(11);
        (0..4).for_each(|p| ws.evicted(p));
        assert_eq!(ws.refault(11, &lru), Refault::Workingset, "distance 4 of 4");
        ws.evicted(12);
        (0..5).for_each(|p| ws.evicted(p));
        assert_eq!(ws.refault(12, &lru), Refault::Distant, "distance 5 of 4");
        assert_eq!(ws.refault(13, &lru), Refault::None, "never evicted");
    }

    #[test]
    fn s3fifo_puts_new_pages_on_probation_and_the_working_set_on_the_active_list() {
        let ws = Workingset::new(1, LruPolicy::S3fifo);
        assert_eq!(ws.place(Arrival::FirstTouch), (LruList::Probation, false));
        let distant = Arrival::SwapIn(Refault::Distant);
        assert_eq!(ws.place(distant), (LruList::Probation, false));
        assert_eq!(ws.place(Arrival::Readahead), (LruList::Probation, true));
        let near = Arrival::SwapIn(Refault::Workingset);
        assert_eq!(ws.place(near), (LruList::Active, false));
        ws.set_policy(LruPolicy::TwoList);
        assert_eq!(ws.place(distant), (LruList::Active, false));
        assert_eq!(ws.place(Arrival::Readahead), (LruList::Active, true));
    }

    #[test]
    fn aging_takes_probation_while_it_holds_a_page() {
        let ws = Workingset::new(64, LruPolicy::S3fifo);
        let lru = lru_with_active(64, 40);
        lru.add(LruList::Probation, [40]);
        assert_eq!(ws.aging_source(&lru), LruList::Probation);
        ws.set_policy(LruPolicy::TwoList);
        assert_eq!(
            ws.aging_source(&lru),
            LruList::Probation,
            "drained after a switch"
        );
        lru.remove(40);
        assert_eq!(ws.aging_source(&lru), LruList::Active);
    }
}
