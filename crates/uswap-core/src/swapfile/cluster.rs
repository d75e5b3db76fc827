//! The swap slot allocator, a small version of the cluster allocator in mm/swapfile.c.
//!
//! Slots are grouped in clusters. Allocation fills one *current* cluster before it takes
//! another, so pages written out together land next to each other on disk. A new current
//! cluster comes from the nonfull list first (reusing holes), then from the free list.
//! Freeing the last slot of a cluster puts it back on the free list; a full cluster that gets
//! a slot back goes to the nonfull list. One mutex guards everything for now.

#[cfg(loom)]
use loom::sync::{
    atomic::{AtomicU64, Ordering},
    Mutex, MutexGuard,
};
#[cfg(not(loom))]
use std::sync::{
    atomic::{AtomicU64, Ordering},
    Mutex, MutexGuard,
};

use super::SlotId;
use crate::list::{Link, Links, ListHead};

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum ClusterState {
    /// No slot in use; on the free list.
    Free,
    /// Some slots in use, some not; on the nonfull list.
    Nonfull,
    /// Every slot in use; on no list.
    Full,
    /// The cluster allocation is filling; on no list, never full.
    Current,
}

#[derive(Clone, Copy, Debug)]
struct Cluster {
    used: u32,
    state: ClusterState,
    /// Links on the free or nonfull list (`crate::list`).
    link: Link,
}

struct Clusters(Vec<Cluster>);

impl Links for Clusters {
    fn link(&mut self, i: u32) -> &mut Link {
        &mut self.0[i as usize].link
    }
}

struct Inner {
    cluster_size: u32,
    /// Slots managed; the last cluster may be partial.
    slots: u64,
    /// One bit per slot, set while the slot is in use.
    bitmap: Vec<u64>,
    clusters: Clusters,
    free: ListHead,
    nonfull: ListHead,
    current: Option<u32>,
    used: u64,
}

impl Inner {
    fn alloc(&mut self) -> Option<SlotId> {
        let c = match self.current {
            Some(c) => c,
            None => self.take_cluster()?,
        };
        let slot = self
            .first_free(c)
            .expect("the current cluster always has a free slot");
        self.bitmap[slot as usize / 64] |= 1 << (slot % 64);
        self.used += 1;
        let len = self.cluster_len(c);
        let cluster = &mut self.clusters.0[c as usize];
        cluster.used += 1;
        if cluster.used == len {
            cluster.state = ClusterState::Full;
            self.current = None;
        }
        Some(slot)
    }

    /// Makes a nonfull cluster, or else a free one, the current cluster.
    fn take_cluster(&mut self) -> Option<u32> {
        let c = self
            .nonfull
            .pop_front(&mut self.clusters)
            .or_else(|| self.free.pop_front(&mut self.clusters))?;
        self.clusters.0[c as usize].state = ClusterState::Current;
        self.current = Some(c);
        Some(c)
    }

    /// Releases `slot`; false if it was not in use (or does not exist).
    fn free(&mut self, slot: SlotId) -> bool {
        if u64::from(slot) >= self.slots || !self.in_use(slot) {
            return false;
        }
        self.bitmap[slot as usize / 64] &= !(1 << (slot % 64));
        self.used -= 1;
        let c = slot / self.cluster_size;
        let cluster = &mut self.clusters.0[c as usize];
        cluster.used -= 1;
        match (cluster.state, cluster.used) {
            // The current cluster stays current, even when empty: allocation goes on there.
            (ClusterState::Current, _) => {}
            (ClusterState::Full | ClusterState::Nonfull, 0) => {
                if cluster.state == ClusterState::Nonfull {
                    self.nonfull.remove(&mut self.clusters, c);
                }
                self.clusters.0[c as usize].state = ClusterState::Free;
                self.free.push_back(&mut self.clusters, c);
            }
            (ClusterState::Full, _) => {
                cluster.state = ClusterState::Nonfull;
                self.nonfull.push_back(&mut self.clusters, c);
            }
            (ClusterState::Nonfull, _) => {}
            (ClusterState::Free, _) => unreachable!("free cluster {c} had slot {slot} in use"),
        }
        true
    }

    fn in_use(&self, slot: SlotId) -> bool {
        self.bitmap[slot as usize / 64] & (1 << (slot % 64)) != 0
    }

    /// Number of slots in cluster `c` (the last one may be short).
    fn cluster_len(&self, c: u32) -> u32 {
        let start = u64::from(c) * u64::from(self.cluster_size);
        (self.slots - start).min(u64::from(self.cluster_size)) as u32
    }

    /// Lowest free slot of cluster `c`.
    fn first_free(&self, c: u32) -> Option<SlotId> {
        let start = u64::from(c) * u64::from(self.cluster_size);
        let end = start + u64::from(self.cluster_len(c));
        let mut word_start = start / 64 * 64;
        while word_start < end {
            let lo = start.max(word_start) - word_start;
            let hi = end.min(word_start + 64) - word_start;
            let free = !self.bitmap[(word_start / 64) as usize] & bit_range(lo, hi);
            if free != 0 {
                return Some((word_start + u64::from(free.trailing_zeros())) as SlotId);
            }
            word_start += 64;
        }
        None
    }

    /// Appends `n` free clusters. The slots managed so far must be whole clusters.
    fn add_clusters(&mut self, n: u32) {
        let size = u64::from(self.cluster_size);
        assert_eq!(self.slots % size, 0, "cannot grow past a partial cluster");
        let first = self.clusters.0.len() as u32;
        for c in first..first + n {
            self.clusters.0.push(Cluster {
                used: 0,
                state: ClusterState::Free,
                link: Link::UNLINKED,
            });
            self.free.push_back(&mut self.clusters, c);
        }
        self.slots += u64::from(n) * size;
        self.bitmap.resize(self.slots.div_ceil(64) as usize, 0);
    }
}

/// Bits `lo..hi` of a word set (`hi` <= 64).
fn bit_range(lo: u64, hi: u64) -> u64 {
    let width = hi - lo;
    let ones = if width == 64 {
        u64::MAX
    } else {
        (1 << width) - 1
    };
    ones << lo
}

/// Hands out and takes back swap slots.
pub(crate) struct ClusterAllocator {
    inner: Mutex<Inner>,
    /// Copy of `Inner::used`, readable without the lock.
    used: AtomicU64,
}

impl ClusterAllocator {
    /// An allocator of `slots` slots (0 is allowed: grow with [`Self::add_clusters`]) in
    /// clusters of `cluster_size` slots.
    pub(crate) fn new(cluster_size: u32, slots: u64) -> ClusterAllocator {
        assert!(cluster_size > 0, "cluster size must be at least one slot");
        let mut inner = Inner {
            cluster_size,
            slots: 0,
            bitmap: Vec::new(),
            clusters: Clusters(Vec::new()),
            free: ListHead::EMPTY,
            nonfull: ListHead::EMPTY,
            current: None,
            used: 0,
        };
        inner.add_clusters(slots.div_ceil(u64::from(cluster_size)) as u32);
        // Whole clusters were added; cut the last one short when `slots` asks for that.
        inner.slots = slots;
        inner.bitmap.truncate(slots.div_ceil(64) as usize);
        ClusterAllocator {
            inner: Mutex::new(inner),
            used: AtomicU64::new(0),
        }
    }

    /// A free slot, or `None` when every slot is in use.
    pub(crate) fn alloc(&self) -> Option<SlotId> {
        let mut inner = self.lock();
        let slot = inner.alloc();
        self.used.store(inner.used, Ordering::Relaxed);
        slot
    }

    /// Gives `slot` back. Panics if it is not in use: a double free would hand the slot to
    /// two owners later.
    pub(crate) fn free(&self, slot: SlotId) {
        let mut inner = self.lock();
        let freed = inner.free(slot);
        self.used.store(inner.used, Ordering::Relaxed);
        drop(inner); // panic without poisoning the lock
        assert!(
            freed,
            "swap slot {slot} freed while not in use (double free?)"
        );
    }

    /// Grows the allocator by `n` free clusters.
    pub(crate) fn add_clusters(&self, n: u32) {
        self.lock().add_clusters(n);
    }

    pub(crate) fn used(&self) -> u64 {
        self.used.load(Ordering::Relaxed)
    }

    /// Slots managed now (grows with [`Self::add_clusters`]).
    pub(crate) fn slots(&self) -> u64 {
        self.lock().slots
    }

    fn lock(&self) -> MutexGuard<'_, Inner> {
        crate::sync::lock(&self.inner)
    }
}

#[cfg(all(test, not(loom)))]
mod tests {
    use super::*;
    use proptest::prelude::*;
    use std::collections::HashSet;

    /// Allocates `n` slots, which must all succeed.
    fn fill(a: &ClusterAllocator, n: u32) {
        for _ in 0..n {
            a.alloc().expect("a free slot");
        }
    }

    fn state(a: &ClusterAllocator, c: u32) -> ClusterState {
        a.lock().clusters.0[c as usize].state
    }

    /// Cross-checks counts, bitmap, states and list membership.
    fn check_invariants(a: &ClusterAllocator) {
        let mut inner = a.lock();
        let inner = &mut *inner;
        let free = inner.free.walk(&mut inner.clusters).unwrap();
        let nonfull = inner.nonfull.walk(&mut inner.clusters).unwrap();
        let mut total = 0;
        for c in 0..inner.clusters.0.len() as u32 {
            let len = inner.cluster_len(c);
            let start = c * inner.cluster_size;
            let used = (start..start + len).filter(|&s| inner.in_use(s)).count() as u32;
            let cluster = inner.clusters.0[c as usize];
            assert_eq!(cluster.used, used, "cluster {c}");
            total += u64::from(used);
            assert_eq!(
                free.contains(&c),
                cluster.state == ClusterState::Free,
                "cluster {c}"
            );
            assert_eq!(
                nonfull.contains(&c),
                cluster.state == ClusterState::Nonfull,
                "cluster {c}"
            );
            assert_eq!(
                inner.current == Some(c),
                cluster.state == ClusterState::Current
            );
            match cluster.state {
                ClusterState::Free => assert_eq!(used, 0),
                ClusterState::Nonfull => assert!(used > 0 && used < len),
                ClusterState::Full => assert_eq!(used, len),
                ClusterState::Current => assert!(used < len),
            }
        }
        assert_eq!(total, inner.used);
        assert_eq!(a.used(), inner.used);
    }

    #[test]
    fn fills_clusters_in_order_then_reports_full() {
        let a = ClusterAllocator::new(256, 4 * 256);
        for expected in 0..4 * 256 {
            assert_eq!(a.alloc(), Some(expected));
        }
        assert_eq!(a.alloc(), None);
        assert_eq!(a.used(), 1024);
        check_invariants(&a);
    }

    #[test]
    fn partial_last_cluster_and_odd_cluster_sizes_hand_out_each_slot_once() {
        for (cluster_size, slots) in [(256, 300), (100, 1000), (3, 10), (1, 5), (64, 129)] {
            let a = ClusterAllocator::new(cluster_size, slots);
            let got: HashSet<SlotId> = (0..slots).map(|_| a.alloc().unwrap()).collect();
            assert_eq!(got.len() as u64, slots, "size {cluster_size}");
            assert!(got.iter().all(|&s| u64::from(s) < slots));
            assert_eq!(a.alloc(), None);
            check_invariants(&a);
        }
    }

    #[test]
    fn a_freed_slot_is_allocated_again() {
        let a = ClusterAllocator::new(256, 256);
        fill(&a, 256);
        a.free(5);
        assert_eq!(a.used(), 255);
        assert_eq!(a.alloc(), Some(5));
        assert_eq!(a.alloc(), None);
    }

    #[test]
    fn nonfull_clusters_are_preferred_over_free_ones() {
        let a = ClusterAllocator::new(256, 4 * 256);
        fill(&a, 3 * 256);
        a.free(300);
        assert_eq!(state(&a, 1), ClusterState::Nonfull);
        check_invariants(&a);
        assert_eq!(a.alloc(), Some(300));
        assert_eq!(state(&a, 1), ClusterState::Full);
        assert_eq!(a.alloc(), Some(768), "then the free cluster 3");
        check_invariants(&a);
    }

    #[test]
    fn an_emptied_cluster_returns_to_the_free_list_and_is_reused() {
        let a = ClusterAllocator::new(256, 2 * 256);
        fill(&a, 512);
        for slot in 0..255 {
            a.free(slot);
            assert_eq!(state(&a, 0), ClusterState::Nonfull);
        }
        a.free(255);
        assert_eq!(state(&a, 0), ClusterState::Free);
        check_invariants(&a);
        let again: Vec<SlotId> = (0..256).map(|_| a.alloc().unwrap()).collect();
        assert_eq!(again, (0..256).collect::<Vec<_>>());
        assert_eq!(a.alloc(), None);
    }

    #[test]
    fn an_empty_current_cluster_stays_current() {
        let a = ClusterAllocator::new(4, 8);
        let s = a.alloc().unwrap();
        a.free(s);
        assert_eq!(state(&a, 0), ClusterState::Current);
        assert_eq!(a.alloc(), Some(s));
        check_invariants(&a);
    }

    #[test]
    fn added_clusters_become_allocatable() {
        let a = ClusterAllocator::new(256, 0);
        assert_eq!(a.alloc(), None);
        a.add_clusters(2);
        assert_eq!(a.slots(), 512);
        let got: HashSet<SlotId> = (0..512).map(|_| a.alloc().unwrap()).collect();
        assert_eq!(got.len(), 512);
        assert_eq!(a.alloc(), None);
        check_invariants(&a);
    }

    #[test]
    #[should_panic(expected = "swap slot 7 freed while not in use")]
    fn double_free_panics() {
        let a = ClusterAllocator::new(256, 256);
        fill(&a, 8);
        a.free(7);
        a.free(7);
    }

    #[test]
    #[should_panic(expected = "freed while not in use")]
    fn freeing_a_slot_that_does_not_exist_panics() {
        ClusterAllocator::new(4, 4).free(4);
    }

    #[derive(Debug, Clone)]
    enum Op {
        Alloc,
        /// Frees the live slot at this position (modulo the number live).
        Free(usize),
    }

    fn op() -> impl Strategy<Value = Op> {
        prop_oneof![3 => Just(Op::Alloc), 2 => any::<usize>().prop_map(Op::Free)]
    }

    proptest! {
        #[test]
        fn random_alloc_free_sequences_match_a_set_model(
            cluster_size in 1u32..300,
            slots in 0u64..1200,
            ops in proptest::collection::vec(op(), 0..1500),
        ) {
            let a = ClusterAllocator::new(cluster_size, slots);
            let mut live: Vec<SlotId> = Vec::new();
            let mut model: HashSet<SlotId> = HashSet::new();
            for op in ops {
                match op {
                    Op::Alloc => match a.alloc() {
                        Some(slot) => {
                            prop_assert!(u64::from(slot) < slots);
                            prop_assert!(model.insert(slot), "slot {} handed out twice", slot);
                            live.push(slot);
                        }
                        None => prop_assert_eq!(model.len() as u64, slots, "None while not full"),
                    },
                    Op::Free(i) if !live.is_empty() => {
                        let slot = live.swap_remove(i % live.len());
                        a.free(slot);
                        model.remove(&slot);
                    }
                    Op::Free(_) => {}
                }
                prop_assert_eq!(a.used(), model.len() as u64);
            }
            check_invariants(&a);
        }
    }
}

#[cfg(all(test, loom))]
mod loom_tests {
    //! Run with:
    //! RUSTFLAGS="--cfg loom" cargo test -p uswap-core --lib --release swapfile::cluster::loom_tests
    use super::*;
    use loom::sync::atomic::AtomicBool;
    use loom::sync::Arc;

    /// Each thread allocates, claims the slot in an ownership table (failing if another
    /// thread holds it), releases it and frees it, `rounds` times. Preemptions are bounded
    /// to 3 (as loom recommends for larger models) so each model finishes in about a second.
    fn model(threads: usize, rounds: usize, cluster_size: u32, slots: u64) {
        let mut builder = loom::model::Builder::new();
        builder.preemption_bound = Some(3);
        builder.check(move || {
            let alloc = Arc::new(ClusterAllocator::new(cluster_size, slots));
            let owned: Arc<Vec<AtomicBool>> =
                Arc::new((0..slots).map(|_| AtomicBool::new(false)).collect());
            let handles: Vec<_> = (0..threads)
                .map(|_| {
                    let (alloc, owned) = (alloc.clone(), owned.clone());
                    loom::thread::spawn(move || {
                        for _ in 0..rounds {
                            let Some(slot) = alloc.alloc() else { continue };
                            let was_owned = owned[slot as usize].swap(true, Ordering::SeqCst);
                            assert!(!was_owned, "slot {slot} owned twice");
                            owned[slot as usize].store(false, Ordering::SeqCst);
                            alloc.free(slot);
                        }
                    })
                })
                .collect();
            handles.into_iter().for_each(|h| h.join().unwrap());
            assert_eq!(alloc.used(), 0);
            let mut again: Vec<SlotId> = (0..slots).filter_map(|_| alloc.alloc()).collect();
            again.dedup();
            assert_eq!(
                again.len() as u64,
                slots,
                "every slot is free again, handed out once"
            );
        });
    }

    #[test]
    fn three_threads_share_one_small_cluster() {
        model(3, 1, 2, 2);
    }

    #[test]
    fn two_threads_move_single_slot_clusters_between_lists() {
        model(2, 2, 1, 2);
    }
}
