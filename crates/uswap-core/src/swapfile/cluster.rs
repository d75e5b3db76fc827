//! The swap slot allocator, a small version of the cluster allocator in mm/swapfile.c.
//!
//! Slots are grouped in clusters. A *scan base* fills one current cluster before it takes
//! another, so pages written out together land next to each other on disk. A new current
//! cluster comes from the nonfull list first (reusing holes), then from the free list.
//! Freeing the last slot of a cluster puts it back on the free list; a full cluster that gets
//! a slot back goes to the nonfull list.
//!
//! [`SlotAlloc`] decides how many scan bases there are. `Shared` has one for all CPUs (the
//! kernel's choice for rotating disks: writes stay in one place). `Percpu` has one per CPU,
//! so CPUs fill clusters of their own and seldom meet on a lock (the kernel's
//! `percpu_cluster`). A base that has no current cluster and finds both lists empty takes a
//! slot from another base's current cluster: `alloc` fails only when every slot is in use.
//!
//! # Locking
//!
//! - `swap_scan`, one per scan base: which cluster the base fills (`ScanBase::current`).
//!   Only a holder of a base's lock allocates from the cluster current to that base.
//! - `swap_cluster`, one per cluster: the cluster's bitmap, its count of slots in use and
//!   its [`ClusterState`].
//! - `swap_lists`, one: the free and nonfull lists, which list each cluster is on, and
//!   growth (appending clusters).
//!
//! The order is `swap_scan` → `swap_cluster` → `swap_lists`, at most one lock of each
//! class at a time: a base looks at the next base only after releasing its own. A free
//! takes its cluster's lock, and the list lock too only when the cluster changes list.
//!
//! Taking a cluster off a list would need the list lock before the cluster lock, against
//! the order, so the taker *isolates* it: it unlinks the cluster under the list lock alone,
//! drops that lock, then locks the cluster and makes it current. A free that meanwhile finds
//! the cluster on no list leaves it to the taker. An isolated cluster is reachable through
//! its taker's base, whose lock the taker holds throughout.

use crate::config::SlotAlloc;
use crate::list::{Link, Links, ListHead};
use crate::lockdep::Rank;
use crate::lockstat::{LockClass, StatMutex};
use crate::sync::AtomicU64;
use crossbeam_utils::CachePadded;
use std::sync::atomic::Ordering::{Acquire, Relaxed, Release};
use std::sync::OnceLock;

/// Index of a page-sized slot in the swap file.
pub type SlotId = u32;

/// Most scan bases in `Percpu` mode; CPUs beyond share them.
const MAX_SCAN_BASES: usize = 64;

/// Scan bases in `Percpu` mode under loom: few, and not tied to real CPU numbers, so the
/// models are deterministic.
#[cfg(loom)]
const LOOM_SCAN_BASES: usize = 2;

/// The list a cluster that is neither full nor current waits on.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum ListKind {
    /// No slot in use.
    Free,
    /// Some slots in use, some not.
    Nonfull,
}

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum ClusterState {
    /// No slot in use; on the free list (or being taken off it).
    Free,
    /// Some slots in use, some not; on the nonfull list (or being taken off it).
    Nonfull,
    /// Every slot in use; on no list.
    Full,
    /// Filled by the scan base with this index; on no list, never full.
    Current(usize),
}

impl From<ListKind> for ClusterState {
    fn from(list: ListKind) -> ClusterState {
        match list {
            ListKind::Free => ClusterState::Free,
            ListKind::Nonfull => ClusterState::Nonfull,
        }
    }
}

/// What a cluster's lock protects.
struct Cluster {
    used: u32,
    state: ClusterState,
    /// One bit per slot of the cluster, set while the slot is in use.
    words: Box<[u64]>,
}

impl Cluster {
    fn new(cluster_size: u32) -> Cluster {
        Cluster {
            used: 0,
            state: ClusterState::Free,
            words: vec![0; cluster_size.div_ceil(64) as usize].into(),
        }
    }

    /// Marks the lowest free one of the first `len` slots in use and returns its index.
    fn take_first_free(&mut self, len: u32) -> Option<u32> {
        let (w, free) = self
            .words
            .iter()
            .enumerate()
            .map(|(w, &word)| (w, !word & valid_bits(len, w)))
            .find(|&(_, free)| free != 0)?;
        let bit = free.trailing_zeros();
        self.words[w] |= 1 << bit;
        self.used += 1;
        Some(w as u32 * 64 + bit)
    }

    /// Marks slot `i` free; false if it was not in use.
    fn release(&mut self, i: u32) -> bool {
        let mask = 1u64 << (i % 64);
        let word = &mut self.words[i as usize / 64];
        if *word & mask == 0 {
            return false;
        }
        *word &= !mask;
        self.used -= 1;
        true
    }
}

/// The bits of word `w` that stand for one of the first `len` slots.
fn valid_bits(len: u32, w: usize) -> u64 {
    match len.saturating_sub(w as u32 * 64) {
        bits @ 0..64 => (1 << bits) - 1,
        _ => u64::MAX,
    }
}

/// The clusters, in segments of 1, 2, 4, ... clusters. A segment is allocated when growth
/// first needs it and never moves, so a cluster is reached without a lock on the whole table.
struct ClusterTable {
    segments: [OnceLock<Box<[StatMutex<Cluster>]>>; 32],
    cluster_size: u32,
}

impl ClusterTable {
    fn new(cluster_size: u32) -> ClusterTable {
        ClusterTable {
            segments: std::array::from_fn(|_| OnceLock::new()),
            cluster_size,
        }
    }

    /// The lock of cluster `c`, which must be below a count passed to [`Self::reserve`].
    fn get(&self, c: u32) -> &StatMutex<Cluster> {
        let (segment, i) = segment_of(c);
        &self.segments[segment]
            .get()
            .expect("cluster reserved before use")[i]
    }

    /// Makes clusters `0..count` exist (free, on no list yet).
    fn reserve(&self, count: u32) {
        let Some(last) = count.checked_sub(1) else {
            return;
        };
        for segment in 0..=segment_of(last).0 {
            self.segments[segment].get_or_init(|| {
                (0..1 << segment)
                    .map(|_| StatMutex::new(Rank::SwapCluster, Cluster::new(self.cluster_size)))
                    .collect()
            });
        }
    }
}

/// The segment of cluster `c` in a [`ClusterTable`] and its index there: segment `k` holds
/// clusters `2^k - 1 .. 2^(k+1) - 1`.
fn segment_of(c: u32) -> (usize, usize) {
    let position = u64::from(c) + 1;
    let segment = position.ilog2();
    (segment as usize, (position - (1 << segment)) as usize)
}

/// A cluster's place on the lists: its links and the list it is on.
#[derive(Clone, Copy)]
struct ListNode {
    link: Link,
    on: Option<ListKind>,
}

struct ListNodes(Vec<ListNode>);

impl Links for ListNodes {
    fn link(&mut self, i: u32) -> &mut Link {
        &mut self.0[i as usize].link
    }
}

/// What the list lock protects.
struct Lists {
    free: ListHead,
    nonfull: ListHead,
    /// One per cluster added so far.
    nodes: ListNodes,
}

impl Lists {
    fn parts(&mut self, list: ListKind) -> (&mut ListHead, &mut ListNodes) {
        let head = match list {
            ListKind::Free => &mut self.free,
            ListKind::Nonfull => &mut self.nonfull,
        };
        (head, &mut self.nodes)
    }

    fn push(&mut self, list: ListKind, c: u32) {
        let (head, nodes) = self.parts(list);
        head.push_back(nodes, c);
        nodes.0[c as usize].on = Some(list);
    }

    /// Takes `c` off the list it is on; false if it is on none (isolated).
    fn unlink(&mut self, c: u32) -> bool {
        let Some(list) = self.nodes.0[c as usize].on.take() else {
            return false;
        };
        let (head, nodes) = self.parts(list);
        head.remove(nodes, c);
        true
    }

    /// Unlinks the first nonfull cluster, or else the first free one, for a new current
    /// cluster.
    fn isolate(&mut self) -> Option<u32> {
        let c = (self.nonfull.pop_front(&mut self.nodes))
            .or_else(|| self.free.pop_front(&mut self.nodes))?;
        self.nodes.0[c as usize].on = None;
        Some(c)
    }
}

/// What a scan base's lock protects.
struct ScanBase {
    /// The cluster this base fills.
    current: Option<u32>,
}

/// Hands out and takes back swap slots.
pub(crate) struct ClusterAllocator {
    mode: SlotAlloc,
    cluster_size: u32,
    bases: Box<[CachePadded<StatMutex<ScanBase>>]>,
    clusters: ClusterTable,
    lists: StatMutex<Lists>,
    /// Slots managed; the last cluster may be partial. Written under the list lock.
    slots: AtomicU64,
    /// Slots in use, readable without a lock.
    used: AtomicU64,
}

impl ClusterAllocator {
    /// An allocator of `slots` slots (0 is allowed: grow with [`Self::add_clusters`]) in
    /// clusters of `cluster_size` slots, with the scan bases `mode` asks for.
    pub(crate) fn new(cluster_size: u32, slots: u64, mode: SlotAlloc) -> ClusterAllocator {
        Self::with_bases(cluster_size, slots, mode, scan_bases(mode))
    }

    fn with_bases(cluster_size: u32, slots: u64, mode: SlotAlloc, bases: usize) -> Self {
        assert!(cluster_size > 0, "cluster size must be at least one slot");
        let a = ClusterAllocator {
            mode,
            cluster_size,
            bases: (0..bases)
                .map(|_| {
                    CachePadded::new(StatMutex::new(Rank::SwapScan, ScanBase { current: None }))
                })
                .collect(),
            clusters: ClusterTable::new(cluster_size),
            lists: StatMutex::new(
                Rank::SwapLists,
                Lists {
                    free: ListHead::EMPTY,
                    nonfull: ListHead::EMPTY,
                    nodes: ListNodes(Vec::new()),
                },
            ),
            slots: AtomicU64::new(0),
            used: AtomicU64::new(0),
        };
        let clusters = slots.div_ceil(u64::from(cluster_size)) as u32;
        a.append_clusters(&mut a.lists.lock(), clusters, slots);
        a
    }

    pub(crate) fn mode(&self) -> SlotAlloc {
        self.mode
    }

    /// A free slot, or `None` when every slot is in use.
    pub(crate) fn alloc(&self) -> Option<SlotId> {
        self.alloc_at(self.home_base())
    }

    /// A free slot, looking at scan base `home` first and then at the others in turn.
    ///
    /// A round over the bases can miss every free slot when other threads move slots about
    /// meanwhile (one fills the cluster of a base this thread is about to look at while
    /// another frees a slot in a cluster it has passed); then it goes round again. `used`
    /// drops only once a freed slot can be found, so a failed round while `used` is below
    /// `slots` means other threads made progress.
    fn alloc_at(&self, home: usize) -> Option<SlotId> {
        let n = self.bases.len();
        loop {
            let slot = (0..n)
                .map(|i| (home + i) % n)
                .find_map(|b| self.alloc_from_base(b, &mut self.bases[b].lock()));
            if slot.is_some() || self.used() >= self.slots() {
                return slot;
            }
        }
    }

    /// A slot from the current cluster of base `b`, after making a listed cluster current
    /// if the base has none.
    fn alloc_from_base(&self, b: usize, base: &mut ScanBase) -> Option<SlotId> {
        let c = match base.current {
            Some(c) => c,
            None => self.lists.lock().isolate()?,
        };
        let len = self.cluster_len(c);
        let mut cluster = self.clusters.get(c).lock();
        debug_assert!(
            base.current.is_none() || cluster.state == ClusterState::Current(b),
            "cluster {c} is {:?}, not current to base {b}",
            cluster.state
        );
        let i = cluster
            .take_first_free(len)
            .expect("a current or listed cluster has a free slot");
        self.used.fetch_add(1, Relaxed);
        let full = cluster.used == len;
        cluster.state = if full {
            ClusterState::Full
        } else {
            ClusterState::Current(b)
        };
        base.current = (!full).then_some(c);
        Some(c * self.cluster_size + i)
    }

    /// Gives `slot` back. Panics if it is not in use: a double free would hand the slot to
    /// two owners later.
    #[cfg(test)]
    pub(crate) fn free(&self, slot: SlotId) {
        self.free_with(slot, |_, _| {});
    }

    /// Frees `slot`. When that empties its cluster (one no base is filling), `emptied`
    /// runs with the cluster's first slot and size under the cluster's lock (and the list
    /// lock, for a cluster on the nonfull list), before any base can take it again: the
    /// device discards the cluster's file range there (the kernel's cluster discard).
    pub(crate) fn free_with(&self, slot: SlotId, emptied: impl FnOnce(SlotId, u32)) {
        let freed = u64::from(slot) < self.slots() && self.release(slot, emptied);
        assert!(
            freed,
            "swap slot {slot} freed while not in use (double free?)"
        );
    }

    /// Marks `slot` free and moves its cluster to the list it now belongs on; false (and
    /// nothing changed) if the slot was not in use.
    fn release(&self, slot: SlotId, emptied: impl FnOnce(SlotId, u32)) -> bool {
        let c = slot / self.cluster_size;
        let mut cluster = self.clusters.get(c).lock();
        if !cluster.release(slot % self.cluster_size) {
            return false;
        }
        let first = c * self.cluster_size;
        match (cluster.state, cluster.used) {
            // A current cluster stays current, even when empty: allocation goes on there.
            (ClusterState::Current(_), _) | (ClusterState::Nonfull, 1..) => {}
            (ClusterState::Full, used) => {
                let list = if used == 0 {
                    emptied(first, self.cluster_size);
                    ListKind::Free
                } else {
                    ListKind::Nonfull
                };
                self.lists.lock().push(list, c);
                cluster.state = list.into();
            }
            (ClusterState::Nonfull, 0) => {
                // Not on the list: a base is taking it and will make it current. `emptied`
                // runs under the list lock: a cluster on no list for a moment would have
                // an allocator that finds the device not full, and no list to take from,
                // spin until it is back.
                let mut lists = self.lists.lock();
                if lists.unlink(c) {
                    emptied(first, self.cluster_size);
                    lists.push(ListKind::Free, c);
                    cluster.state = ClusterState::Free;
                }
            }
            (ClusterState::Free, _) => unreachable!("free cluster {c} had slot {slot} in use"),
        }
        // Only now that the slot can be found again (see `alloc_at`).
        self.used.fetch_sub(1, Relaxed);
        true
    }

    /// Grows the allocator by `n` free clusters. The slots managed so far must be whole
    /// clusters.
    pub(crate) fn add_clusters(&self, n: u32) {
        let mut lists = self.lists.lock();
        let size = u64::from(self.cluster_size);
        let slots = self.slots();
        assert_eq!(slots % size, 0, "cannot grow past a partial cluster");
        self.append_clusters(&mut lists, n, slots + u64::from(n) * size);
    }

    /// Appends `n` clusters to the free list; `slots` is the new total.
    fn append_clusters(&self, lists: &mut Lists, n: u32, slots: u64) {
        let first = lists.nodes.0.len() as u32;
        self.clusters.reserve(first + n);
        let unlinked = ListNode {
            link: Link::UNLINKED,
            on: None,
        };
        lists.nodes.0.resize((first + n) as usize, unlinked);
        // Before the clusters are listed: whoever finds one must see its slots counted.
        self.slots.store(slots, Release);
        (first..first + n).for_each(|c| lists.push(ListKind::Free, c));
    }

    pub(crate) fn used(&self) -> u64 {
        self.used.load(Relaxed)
    }

    /// Slots managed now (grows with [`Self::add_clusters`]).
    pub(crate) fn slots(&self) -> u64 {
        self.slots.load(Acquire)
    }

    /// The scan base, cluster and list lock classes.
    pub(crate) fn lockstat(&self) -> Vec<LockClass> {
        let clusters = (0..self.cluster_count()).map(|c| self.clusters.get(c));
        vec![
            LockClass::sum("swap_scan", self.bases.iter().map(|b| &**b)),
            LockClass::sum("swap_cluster", clusters),
            LockClass::sum("swap_lists", [&self.lists]),
        ]
    }

    fn cluster_count(&self) -> u32 {
        self.slots().div_ceil(u64::from(self.cluster_size)) as u32
    }

    /// Number of slots in cluster `c` (the last one may be short).
    fn cluster_len(&self, c: u32) -> u32 {
        let start = u64::from(c) * u64::from(self.cluster_size);
        (self.slots() - start).min(u64::from(self.cluster_size)) as u32
    }

    /// The scan base of the calling thread's CPU.
    #[cfg(not(loom))]
    fn home_base(&self) -> usize {
        crate::cpu::current() % self.bases.len()
    }

    /// Under loom, base 0: the models pick other bases through [`Self::alloc_at`].
    #[cfg(loom)]
    fn home_base(&self) -> usize {
        0
    }
}

/// How many scan bases `mode` has on this machine.
fn scan_bases(mode: SlotAlloc) -> usize {
    match mode {
        SlotAlloc::Shared => 1,
        SlotAlloc::Percpu => cpus().min(MAX_SCAN_BASES),
    }
}

#[cfg(not(loom))]
fn cpus() -> usize {
    crate::cpu::count()
}

#[cfg(loom)]
fn cpus() -> usize {
    LOOM_SCAN_BASES
}

#[cfg(test)]
impl ClusterAllocator {
    /// Cross-checks counts, bitmaps, states, list membership and scan bases. Takes one lock
    /// at a time, so the allocator must be idle.
    fn check_invariants(&self) {
        let currents: Vec<Option<u32>> = self.bases.iter().map(|b| b.lock().current).collect();
        let (free, nonfull, on) = {
            let mut lists = self.lists.lock();
            let lists = &mut *lists;
            let free = lists.free.walk(&mut lists.nodes).unwrap();
            let nonfull = lists.nonfull.walk(&mut lists.nodes).unwrap();
            let on: Vec<Option<ListKind>> = lists.nodes.0.iter().map(|n| n.on).collect();
            (free, nonfull, on)
        };
        assert_eq!(on.len() as u32, self.cluster_count());
        let mut total = 0;
        for c in 0..self.cluster_count() {
            let len = self.cluster_len(c);
            let cluster = self.clusters.get(c).lock();
            let bits: u32 = cluster.words.iter().map(|w| w.count_ones()).sum();
            let valid: u32 = (0..cluster.words.len())
                .map(|w| (cluster.words[w] & valid_bits(len, w)).count_ones())
                .sum();
            assert_eq!(bits, valid, "cluster {c}: bits set past its {len} slots");
            assert_eq!(cluster.used, bits, "cluster {c}");
            total += u64::from(bits);
            let listed = |list: &[u32], kind| {
                let on_list = list.contains(&c);
                assert_eq!(on_list, on[c as usize] == Some(kind), "cluster {c}");
                on_list
            };
            assert_eq!(
                listed(&free, ListKind::Free),
                cluster.state == ClusterState::Free
            );
            assert_eq!(
                listed(&nonfull, ListKind::Nonfull),
                cluster.state == ClusterState::Nonfull
            );
            let current_to: Vec<usize> = (0..currents.len())
                .filter(|&b| currents[b] == Some(c))
                .collect();
            match cluster.state {
                ClusterState::Free => assert_eq!(bits, 0),
                ClusterState::Nonfull => assert!(bits > 0 && bits < len, "cluster {c}"),
                ClusterState::Full => assert_eq!(bits, len),
                ClusterState::Current(_) => assert!(bits < len, "cluster {c}"),
            }
            match cluster.state {
                ClusterState::Current(b) => assert_eq!(current_to, [b], "cluster {c}"),
                _ => assert!(current_to.is_empty(), "cluster {c}"),
            }
        }
        assert_eq!(total, self.used());
    }
}

#[cfg(all(test, not(loom)))]
mod tests {
    use super::*;
    use proptest::prelude::*;
    use std::collections::HashSet;

    fn shared(cluster_size: u32, slots: u64) -> ClusterAllocator {
        ClusterAllocator::new(cluster_size, slots, SlotAlloc::Shared)
    }

    fn percpu(cluster_size: u32, slots: u64, bases: usize) -> ClusterAllocator {
        ClusterAllocator::with_bases(cluster_size, slots, SlotAlloc::Percpu, bases)
    }

    fn state(a: &ClusterAllocator, c: u32) -> ClusterState {
        a.clusters.get(c).lock().state
    }

    /// Allocates `n` slots, which must all succeed.
    fn fill(a: &ClusterAllocator, n: u32) {
        for _ in 0..n {
            a.alloc().expect("a free slot");
        }
    }

    #[test]
    fn fills_clusters_in_order_then_reports_full() {
        let a = shared(256, 4 * 256);
        for expected in 0..4 * 256 {
            assert_eq!(a.alloc(), Some(expected));
        }
        assert_eq!(a.alloc(), None);
        assert_eq!(a.used(), 1024);
        a.check_invariants();
    }

    #[test]
    fn partial_last_cluster_and_odd_cluster_sizes_hand_out_each_slot_once() {
        for mode in SlotAlloc::ALL {
            for (cluster_size, slots) in [(256, 300), (100, 1000), (3, 10), (1, 5), (64, 129)] {
                let a = ClusterAllocator::new(cluster_size, slots, *mode);
                let got: HashSet<SlotId> = (0..slots).map(|_| a.alloc().unwrap()).collect();
                assert_eq!(got.len() as u64, slots, "{mode} size {cluster_size}");
                assert!(got.iter().all(|&s| u64::from(s) < slots));
                assert_eq!(a.alloc(), None);
                a.check_invariants();
            }
        }
    }

    #[test]
    fn a_freed_slot_is_allocated_again() {
        for mode in SlotAlloc::ALL {
            let a = ClusterAllocator::new(256, 256, *mode);
            fill(&a, 256);
            a.free(5);
            assert_eq!(a.used(), 255);
            assert_eq!(a.alloc(), Some(5));
            assert_eq!(a.alloc(), None);
        }
    }

    #[test]
    fn nonfull_clusters_are_preferred_over_free_ones() {
        let a = shared(256, 4 * 256);
        fill(&a, 3 * 256);
        a.free(300);
        assert_eq!(state(&a, 1), ClusterState::Nonfull);
        a.check_invariants();
        assert_eq!(a.alloc(), Some(300));
        assert_eq!(state(&a, 1), ClusterState::Full);
        assert_eq!(a.alloc(), Some(768), "then the free cluster 3");
        a.check_invariants();
    }

    #[test]
    fn an_emptied_cluster_returns_to_the_free_list_and_is_reused() {
        let a = shared(256, 2 * 256);
        fill(&a, 512);
        for slot in 0..255 {
            a.free(slot);
            assert_eq!(state(&a, 0), ClusterState::Nonfull);
        }
        a.free(255);
        assert_eq!(state(&a, 0), ClusterState::Free);
        a.check_invariants();
        let again: Vec<SlotId> = (0..256).map(|_| a.alloc().unwrap()).collect();
        assert_eq!(again, (0..256).collect::<Vec<_>>());
        assert_eq!(a.alloc(), None);
    }

    #[test]
    fn an_empty_current_cluster_stays_current() {
        let a = shared(4, 8);
        let s = a.alloc().unwrap();
        a.free(s);
        assert_eq!(state(&a, 0), ClusterState::Current(0));
        assert_eq!(a.alloc(), Some(s));
        a.check_invariants();
    }

    #[test]
    fn added_clusters_become_allocatable() {
        for mode in SlotAlloc::ALL {
            let a = ClusterAllocator::new(256, 0, *mode);
            assert_eq!(a.alloc(), None);
            a.add_clusters(2);
            assert_eq!(a.slots(), 512);
            a.add_clusters(3);
            let got: HashSet<SlotId> = (0..5 * 256).map(|_| a.alloc().unwrap()).collect();
            assert_eq!(got.len(), 5 * 256);
            assert_eq!(a.alloc(), None);
            a.check_invariants();
        }
    }

    #[test]
    #[should_panic(expected = "cannot grow past a partial cluster")]
    fn growing_past_a_partial_cluster_panics() {
        shared(4, 6).add_clusters(1);
    }

    #[test]
    #[should_panic(expected = "swap slot 7 freed while not in use")]
    fn double_free_panics() {
        let a = shared(256, 256);
        fill(&a, 8);
        a.free(7);
        a.free(7);
    }

    #[test]
    #[should_panic(expected = "freed while not in use")]
    fn freeing_a_slot_that_does_not_exist_panics() {
        shared(4, 4).free(4);
    }

    #[test]
    fn each_base_fills_a_cluster_of_its_own() {
        let a = percpu(4, 16, 3);
        assert_eq!(a.alloc_at(0), Some(0));
        assert_eq!(a.alloc_at(1), Some(4));
        assert_eq!(a.alloc_at(2), Some(8));
        assert_eq!(a.alloc_at(0), Some(1));
        assert_eq!(a.alloc_at(1), Some(5));
        assert_eq!(state(&a, 2), ClusterState::Current(2));
        a.check_invariants();
    }

    #[test]
    fn a_base_with_a_full_cluster_takes_a_nonfull_one_then_a_free_one() {
        let a = percpu(2, 8, 2);
        fill_base(&a, 0, 2); // cluster 0 full
        fill_base(&a, 1, 2); // cluster 1 full
        a.free(3);
        assert_eq!(a.alloc_at(0), Some(3), "the nonfull cluster 1");
        assert_eq!(a.alloc_at(0), Some(4), "then the free cluster 2");
        a.check_invariants();
    }

    fn fill_base(a: &ClusterAllocator, base: usize, n: u32) {
        for _ in 0..n {
            a.alloc_at(base).expect("a free slot");
        }
    }

    #[test]
    fn a_base_without_a_cluster_takes_slots_from_other_bases() {
        let a = percpu(4, 8, 3);
        assert_eq!(a.alloc_at(0), Some(0));
        assert_eq!(a.alloc_at(1), Some(4));
        assert_eq!(a.alloc_at(2), Some(1), "both lists empty: base 0's cluster");
        a.check_invariants();
        fill_base(&a, 2, 5);
        assert_eq!(a.used(), 8);
        assert_eq!(a.alloc_at(2), None);
        assert_eq!(a.alloc_at(0), None);
        a.check_invariants();
        a.free(6);
        assert_eq!(a.alloc_at(0), Some(6), "from the nonfull list");
        a.check_invariants();
    }

    #[test]
    fn lock_classes_count_their_locks_and_acquisitions() {
        let a = percpu(4, 10, 3);
        fill(&a, 5);
        let classes = a.lockstat();
        let names: Vec<_> = classes.iter().map(|c| (c.name, c.locks)).collect();
        assert_eq!(
            names,
            [("swap_scan", 3), ("swap_cluster", 3), ("swap_lists", 1)]
        );
        assert!(
            classes.iter().all(|c| c.stat.acquisitions > 0),
            "{classes:?}"
        );
        assert_eq!(shared(4, 10).lockstat()[0].locks, 1);
    }

    #[test]
    fn percpu_mode_has_a_base_per_cpu_up_to_the_cap() {
        let a = ClusterAllocator::new(4, 4, SlotAlloc::Percpu);
        assert_eq!(a.mode(), SlotAlloc::Percpu);
        assert_eq!(a.bases.len(), cpus().min(MAX_SCAN_BASES));
        assert_eq!(shared(4, 4).bases.len(), 1);
    }

    #[test]
    fn clusters_sit_in_doubling_segments() {
        for (c, place) in [
            (0, (0, 0)),
            (1, (1, 0)),
            (2, (1, 1)),
            (3, (2, 0)),
            (6, (2, 3)),
        ] {
            assert_eq!(segment_of(c), place, "cluster {c}");
        }
        assert_eq!(segment_of(u32::MAX - 1), (31, (1 << 31) - 1));
    }

    /// Each of 4 threads allocates and frees 20,000 times, holding up to 32 slots, and
    /// claims every slot in an ownership table. The allocator is big enough that its lists
    /// are never empty, so every allocation must succeed.
    fn stress(mode: SlotAlloc) {
        const THREADS: usize = 4;
        const ROUNDS: usize = 20_000;
        const HELD: usize = 32;
        let a = ClusterAllocator::new(16, 4096, mode);
        assert!(THREADS * HELD + 2 * a.bases.len() * 16 < 4096);
        let owned: Vec<std::sync::atomic::AtomicBool> =
            (0..4096).map(|_| Default::default()).collect();
        std::thread::scope(|s| {
            for t in 0..THREADS {
                let (a, owned) = (&a, &owned);
                s.spawn(move || {
                    let mut held = Vec::new();
                    let mut x = t as u64 * 0x9e37_79b9 + 1;
                    for _ in 0..ROUNDS {
                        x ^= x << 13;
                        x ^= x >> 7;
                        x ^= x << 17;
                        if held.len() < HELD && (held.is_empty() || !x.is_multiple_of(3)) {
                            let slot = a.alloc().expect("room for every thread");
                            let was = owned[slot as usize].swap(true, Relaxed);
                            assert!(!was, "slot {slot} owned twice");
                            held.push(slot);
                        } else {
                            let slot = held.swap_remove(x as usize % held.len());
                            owned[slot as usize].store(false, Relaxed);
                            a.free(slot);
                        }
                    }
                    held.into_iter().for_each(|slot| {
                        owned[slot as usize].store(false, Relaxed);
                        a.free(slot);
                    });
                });
            }
        });
        assert_eq!(a.used(), 0);
        a.check_invariants();
    }

    #[test]
    fn four_threads_alloc_and_free_with_a_shared_scan_base() {
        stress(SlotAlloc::Shared);
    }

    #[test]
    fn four_threads_alloc_and_free_with_percpu_scan_bases() {
        stress(SlotAlloc::Percpu);
    }

    #[derive(Debug, Clone)]
    enum Op {
        /// From the calling CPU's base (`None`), or from this base (modulo their number).
        Alloc(Option<usize>),
        /// Frees the live slot at this position (modulo the number live).
        Free(usize),
    }

    fn op() -> impl Strategy<Value = Op> {
        prop_oneof![
            3 => any::<Option<usize>>().prop_map(Op::Alloc),
            2 => any::<usize>().prop_map(Op::Free),
        ]
    }

    fn allocator() -> impl Strategy<Value = (SlotAlloc, usize)> {
        prop_oneof![
            Just((SlotAlloc::Shared, 1)),
            (1usize..5).prop_map(|n| (SlotAlloc::Percpu, n))
        ]
    }

    proptest! {
        /// Whichever bases the allocations come from, no slot is handed out twice and
        /// `None` means full.
        #[test]
        fn random_alloc_free_sequences_match_a_set_model(
            (mode, bases) in allocator(),
            cluster_size in 1u32..300,
            slots in 0u64..1200,
            ops in proptest::collection::vec(op(), 0..1500),
        ) {
            let a = ClusterAllocator::with_bases(cluster_size, slots, mode, bases);
            let mut live: Vec<SlotId> = Vec::new();
            let mut model: HashSet<SlotId> = HashSet::new();
            for op in ops {
                match op {
                    Op::Alloc(base) => {
                        let got = match base {
                            Some(b) => a.alloc_at(b % bases),
                            None => a.alloc(),
                        };
                        match got {
                            Some(slot) => {
                                prop_assert!(u64::from(slot) < slots);
                                prop_assert!(model.insert(slot), "slot {} handed out twice", slot);
                                live.push(slot);
                            }
                            None => prop_assert_eq!(model.len() as u64, slots, "None while not full"),
                        }
                    }
                    Op::Free(i) if !live.is_empty() => {
                        let slot = live.swap_remove(i % live.len());
                        a.free(slot);
                        model.remove(&slot);
                    }
                    Op::Free(_) => {}
                }
                prop_assert_eq!(a.used(), model.len() as u64);
            }
            a.check_invariants();
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
    use std::sync::atomic::Ordering::SeqCst;

    fn builder() -> loom::model::Builder {
        let mut builder = loom::model::Builder::new();
        // Bounded as loom recommends for larger models, so each finishes in seconds.
        builder.preemption_bound = Some(3);
        builder
    }

    /// Each thread allocates from its own base (thread `t` from base `t` modulo their
    /// number), claims the slot in an ownership table (failing if another thread holds it),
    /// releases it and frees it, `rounds` times.
    fn model(mode: SlotAlloc, threads: usize, rounds: usize, cluster_size: u32, slots: u64) {
        builder().check(move || {
            let alloc = Arc::new(ClusterAllocator::new(cluster_size, slots, mode));
            let owned: Arc<Vec<AtomicBool>> =
                Arc::new((0..slots).map(|_| AtomicBool::new(false)).collect());
            let handles: Vec<_> = (0..threads)
                .map(|t| {
                    let (alloc, owned) = (alloc.clone(), owned.clone());
                    loom::thread::spawn(move || {
                        for _ in 0..rounds {
                            let Some(slot) = alloc.alloc_at(t % alloc.bases.len()) else {
                                continue;
                            };
                            let was_owned = owned[slot as usize].swap(true, SeqCst);
                            assert!(!was_owned, "slot {slot} owned twice");
                            owned[slot as usize].store(false, SeqCst);
                            alloc.free(slot);
                        }
                    })
                })
                .collect();
            handles.into_iter().for_each(|h| h.join().unwrap());
            assert_eq!(alloc.used(), 0);
            alloc.check_invariants();
            let mut again: Vec<SlotId> = (0..slots).filter_map(|_| alloc.alloc()).collect();
            again.sort_unstable();
            again.dedup();
            assert_eq!(
                again.len() as u64,
                slots,
                "every slot free again, handed out once"
            );
        });
    }

    #[test]
    fn shared_three_threads_share_one_small_cluster() {
        model(SlotAlloc::Shared, 3, 1, 2, 2);
    }

    #[test]
    fn shared_two_threads_move_single_slot_clusters_between_lists() {
        model(SlotAlloc::Shared, 2, 2, 1, 2);
    }

    #[test]
    fn percpu_two_bases_share_one_small_cluster() {
        model(SlotAlloc::Percpu, 2, 2, 2, 2);
    }

    #[test]
    fn percpu_two_bases_move_single_slot_clusters_between_lists() {
        model(SlotAlloc::Percpu, 2, 2, 1, 2);
    }

    /// Sets up `slots` in clusters of `cluster_size` with `setup`, then runs a free of
    /// `freed` against an allocation from base 1, which must get one of `expected`.
    fn free_against_alloc(
        cluster_size: u32,
        slots: u64,
        setup: fn(&ClusterAllocator),
        freed: SlotId,
        expected: &'static [SlotId],
    ) {
        builder().check(move || {
            let alloc = Arc::new(ClusterAllocator::new(
                cluster_size,
                slots,
                SlotAlloc::Percpu,
            ));
            setup(&alloc);
            let free = {
                let alloc = alloc.clone();
                loom::thread::spawn(move || alloc.free(freed))
            };
            let got = alloc.alloc_at(1).expect("a slot is free throughout");
            assert!(expected.contains(&got), "got slot {got}");
            free.join().unwrap();
            alloc.check_invariants();
        });
    }

    /// Base 0 fills cluster 0 and base 1 fills cluster 1; base 1 then finds both lists
    /// empty and takes slot 1 from base 0, unless the concurrent free of slot 2 has put its
    /// cluster on the nonfull list first.
    #[test]
    fn a_percpu_base_takes_from_another_base_or_a_relisted_cluster() {
        free_against_alloc(
            2,
            4,
            |a| {
                assert_eq!(a.alloc_at(0), Some(0));
                assert_eq!(a.alloc_at(1), Some(2));
                assert_eq!(a.alloc_at(1), Some(3));
            },
            2,
            &[1, 2],
        );
    }

    /// Cluster 0 is nonfull with slot 1 in use. Base 1 takes it off the nonfull list while
    /// the free of slot 1 empties it and wants it on the free list.
    #[test]
    fn a_free_empties_a_cluster_while_a_percpu_base_takes_it() {
        free_against_alloc(
            2,
            2,
            |a| {
                assert_eq!(a.alloc_at(0), Some(0));
                assert_eq!(a.alloc_at(0), Some(1));
                a.free(0);
            },
            1,
            &[0],
        );
    }
}
