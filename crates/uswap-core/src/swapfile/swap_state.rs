//! The swap cache ([mm/swap_state.c]): which swap slots have their data in memory, found by
//! slot. A slot is in the cache while a page holding it is resident: a page under
//! write-back, a clean page swapped in or parked inactive with its slot kept, and a page
//! brought in by readahead, which carries a marker until its first use. Swap-in looks the
//! slot up before any I/O.
//!
//! An entry names the page that holds the data (region and page number); the page's state
//! word holds the data's whereabouts (mapped, or its staging frame). The page lock of that
//! page orders every change to its entry: entries are added and deleted only by a thread
//! holding it.
//!
//! The cache is split into address spaces of [`TRUNK_SLOTS`] slots (64 MiB of swap), each
//! under its own lock, as the kernel split `swapper_spaces` in 4.11; [`SwapCacheMode::Single`]
//! puts the whole device under one lock instead, to show what the split buys. A space, and
//! each trunk's table, is allocated by the first add to it: a growing swap file's device
//! counts the file system's free space as its capacity (a thousand trunks for 64 GB), and
//! every process under `uswap run` makes a device. Lock order: `lockdep.rs` (under page
//! locks and readahead's window; nothing under it).

use super::cluster::SlotId;
use crate::config::SwapCacheMode;
use crate::lockdep::Rank;
use crate::lockstat::{LockClass, StatMutex};
use serde::Serialize;
use std::sync::atomic::{AtomicU64, Ordering::Relaxed};
use std::sync::OnceLock;

/// Slots per trunk: 64 MiB of 4 KiB pages.
pub const TRUNK_SLOTS: u64 = 16_384;

/// Marks an entry brought in by readahead and not used yet.
const READAHEAD: u64 = 1 << 31;
const PAGE_MASK: u64 = READAHEAD - 1;

/// Where a cached slot's data is: page `page` of the region numbered `region`.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct CacheEntry {
    pub region: u32,
    pub page: u32,
    /// Brought in by readahead and not used since.
    pub readahead: bool,
}

impl CacheEntry {
    fn encode(self) -> u64 {
        debug_assert!(self.region != 0 && u64::from(self.page) <= PAGE_MASK);
        (u64::from(self.region) << 32)
            | u64::from(self.page)
            | if self.readahead { READAHEAD } else { 0 }
    }

    fn decode(word: u64) -> Option<CacheEntry> {
        (word != 0).then_some(CacheEntry {
            region: (word >> 32) as u32,
            page: (word & PAGE_MASK) as u32,
            readahead: word & READAHEAD != 0,
        })
    }
}

/// The cache's counters (the kernel's `swap_cache_info`).
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Serialize)]
pub struct SwapCacheStats {
    /// Swap-in lookups.
    pub lookups: u64,
    /// Lookups that found the data in memory.
    pub hits: u64,
    /// Hits on a page brought in by readahead (the first use of that page).
    pub readahead_hits: u64,
    /// Pages added (write-back, swap-in keeping the slot, readahead).
    pub adds: u64,
    /// Pages deleted (written and dropped, slot freed, page gone).
    pub deletes: u64,
}

impl SwapCacheStats {
    fn add(&mut self, o: &SwapCacheStats) {
        self.lookups += o.lookups;
        self.hits += o.hits;
        self.readahead_hits += o.readahead_hits;
        self.adds += o.adds;
        self.deletes += o.deletes;
    }

    /// The change since `earlier`.
    pub fn since(&self, earlier: &SwapCacheStats) -> SwapCacheStats {
        SwapCacheStats {
            lookups: self.lookups - earlier.lookups,
            hits: self.hits - earlier.hits,
            readahead_hits: self.readahead_hits - earlier.readahead_hits,
            adds: self.adds - earlier.adds,
            deletes: self.deletes - earlier.deletes,
        }
    }
}

/// The slots of one trunk, and the counters of the operations on it.
#[derive(Default)]
struct Trunk {
    entries: Option<Box<[u64]>>,
    stats: SwapCacheStats,
}

/// What one lock covers: one trunk, or (single mode) all of them.
struct Space {
    trunks: Vec<Trunk>,
}

pub struct SwapCache {
    mode: SwapCacheMode,
    /// Slots of the device.
    slots: u64,
    /// Each made by the first add under it.
    spaces: Box<[OnceLock<Box<StatMutex<Space>>>]>,
    /// Lookups in spaces not made yet (they hold nothing).
    cold_lookups: AtomicU64,
}

impl SwapCache {
    /// A cache for a device of `slots` slots.
    pub fn new(mode: SwapCacheMode, slots: u64) -> SwapCache {
        let spaces = match mode {
            SwapCacheMode::Single => 1,
            SwapCacheMode::Trunks => Self::trunks(slots),
        };
        SwapCache {
            mode,
            slots,
            spaces: (0..spaces).map(|_| OnceLock::new()).collect(),
            cold_lookups: AtomicU64::new(0),
        }
    }

    fn trunks(slots: u64) -> usize {
        slots.div_ceil(TRUNK_SLOTS).max(1) as usize
    }

    /// The space at `index`, made now if it was not.
    fn space(&self, index: usize) -> &StatMutex<Space> {
        self.spaces[index].get_or_init(|| {
            let trunks = match self.mode {
                SwapCacheMode::Single => Self::trunks(self.slots),
                SwapCacheMode::Trunks => 1,
            };
            Box::new(StatMutex::new(
                Rank::SwapCache,
                Space {
                    trunks: (0..trunks).map(|_| Trunk::default()).collect(),
                },
            ))
        })
    }

    /// The spaces made so far.
    fn made(&self) -> impl Iterator<Item = (usize, &StatMutex<Space>)> {
        self.spaces
            .iter()
            .enumerate()
            .filter_map(|(i, s)| Some((i, &**s.get()?)))
    }

    /// Runs `f` on `slot`'s entry and its trunk's counters, under the lock that covers it;
    /// on an empty entry, with no counters kept, in a space not made yet (never made here:
    /// the SIGBUS handler calls this, and must not allocate).
    fn with<R>(&self, slot: SlotId, f: impl FnOnce(&mut u64, &mut SwapCacheStats) -> R) -> R {
        let (space, within, index) = self.position(slot);
        match self.spaces[space].get() {
            Some(space) => Self::apply(&mut space.lock(), within, index, f),
            None => f(&mut 0, &mut SwapCacheStats::default()),
        }
    }

    /// The lock that covers `slot`, its trunk within that lock, and its index in the trunk.
    fn position(&self, slot: SlotId) -> (usize, usize, usize) {
        let trunk = (u64::from(slot) / TRUNK_SLOTS) as usize;
        let index = (u64::from(slot) % TRUNK_SLOTS) as usize;
        match self.mode {
            SwapCacheMode::Single => (0, trunk, index),
            SwapCacheMode::Trunks => (trunk, 0, index),
        }
    }

    fn apply<R>(
        space: &mut Space,
        within: usize,
        index: usize,
        f: impl FnOnce(&mut u64, &mut SwapCacheStats) -> R,
    ) -> R {
        let trunk = &mut space.trunks[within];
        match &mut trunk.entries {
            Some(entries) => f(&mut entries[index], &mut trunk.stats),
            // A trunk never added to holds nothing; only an add allocates its table (the
            // other operations run in the SIGBUS handler too, which must not allocate).
            None => f(&mut 0, &mut trunk.stats),
        }
    }

    /// Adds `slot`, whose data is now in memory as `entry`'s page. Its page lock is held.
    pub fn add(&self, slot: SlotId, entry: CacheEntry) {
        let (space, within, index) = self.position(slot);
        let mut space = self.space(space).lock();
        let trunk = &mut space.trunks[within];
        let entries = trunk
            .entries
            .get_or_insert_with(|| vec![0; TRUNK_SLOTS as usize].into_boxed_slice());
        Self::insert(slot, &mut entries[index], &mut trunk.stats, entry);
    }

    fn insert(slot: SlotId, word: &mut u64, stats: &mut SwapCacheStats, entry: CacheEntry) {
        debug_assert_eq!(
            CacheEntry::decode(*word),
            None,
            "slot {slot} is cached twice"
        );
        *word = entry.encode();
        stats.adds += 1;
    }

    /// Deletes `slot` (its data left memory, or the slot is being freed); what it was, if
    /// it was cached.
    pub fn delete(&self, slot: SlotId) -> Option<CacheEntry> {
        self.with(slot, |word, stats| {
            let old = CacheEntry::decode(std::mem::take(word));
            stats.deletes += u64::from(old.is_some());
            old
        })
    }

    /// Points `slot`'s entry at another page of the same region (mremap moved the page).
    pub fn rehome(&self, slot: SlotId, page: u32) {
        self.with(slot, |word, _| {
            if let Some(mut e) = CacheEntry::decode(*word) {
                e.page = page;
                *word = e.encode();
            }
        });
    }

    /// The swap-in lookup: where `slot`'s data is, if it is in memory. A hit on a page
    /// brought in by readahead clears its marker and says so (`readahead` set in the
    /// result), once.
    pub fn lookup(&self, slot: SlotId) -> Option<CacheEntry> {
        let (space, ..) = self.position(slot);
        if self.spaces[space].get().is_none() {
            self.cold_lookups.fetch_add(1, Relaxed);
            return None;
        }
        self.with(slot, Self::find)
    }

    fn find(word: &mut u64, stats: &mut SwapCacheStats) -> Option<CacheEntry> {
        stats.lookups += 1;
        let found = CacheEntry::decode(*word)?;
        stats.hits += 1;
        if found.readahead {
            stats.readahead_hits += 1;
            *word &= !READAHEAD;
        }
        Some(found)
    }

    /// Readahead's inferred use of a page it mapped (see `readahead.rs`): if `slot` is
    /// cached for region `region` with the readahead marker, clears the marker and counts a
    /// lookup that hit a readahead page. False (nothing counted) otherwise, also for a slot
    /// past the device's end.
    pub fn mark_used(&self, slot: SlotId, region: u32) -> bool {
        if u64::from(slot) >= self.slots {
            return false;
        }
        self.with(slot, |word, stats| match CacheEntry::decode(*word) {
            Some(e) if e.region == region && e.readahead => {
                *word &= !READAHEAD;
                stats.lookups += 1;
                stats.hits += 1;
                stats.readahead_hits += 1;
                true
            }
            _ => false,
        })
    }

    /// `slot`'s entry, without counting or clearing anything (the invariant walker).
    pub fn peek(&self, slot: SlotId) -> Option<CacheEntry> {
        self.with(slot, |word, _| CacheEntry::decode(*word))
    }

    /// Every entry of region `region` (the invariant walker).
    pub fn entries_of(&self, region: u32) -> Vec<(SlotId, CacheEntry)> {
        let mut found = Vec::new();
        for (s, space) in self.made() {
            let space = space.lock();
            for (t, trunk) in space.trunks.iter().enumerate() {
                let first = (s + t) as u64 * TRUNK_SLOTS;
                let entries = trunk.entries.iter().flat_map(|e| e.iter().enumerate());
                for (i, &word) in entries {
                    match CacheEntry::decode(word) {
                        Some(e) if e.region == region => {
                            found.push(((first + i as u64) as SlotId, e))
                        }
                        _ => {}
                    }
                }
            }
        }
        found
    }

    pub fn stats(&self) -> SwapCacheStats {
        let mut total = SwapCacheStats {
            lookups: self.cold_lookups.load(Relaxed),
            ..Default::default()
        };
        for (_, space) in self.made() {
            for trunk in &space.lock().trunks {
                total.add(&trunk.stats);
            }
        }
        total
    }

    pub fn lockstat(&self) -> LockClass {
        LockClass::sum("swap_cache", self.made().map(|(_, s)| s))
    }
}

#[cfg(all(test, not(loom)))]
mod tests {
    use super::*;
    use std::sync::Arc;

    fn entry(page: u32, readahead: bool) -> CacheEntry {
        CacheEntry {
            region: 7,
            page,
            readahead,
        }
    }

    #[test]
    fn entries_are_found_by_slot_in_both_modes() {
        for mode in SwapCacheMode::ALL {
            let c = SwapCache::new(*mode, 3 * TRUNK_SLOTS);
            let far = (2 * TRUNK_SLOTS + 5) as SlotId;
            c.add(3, entry(30, false));
            c.add(far, entry(50, true));
            assert_eq!(c.lookup(3), Some(entry(30, false)));
            assert_eq!(c.lookup(4), None);
            assert_eq!(c.lookup(far), Some(entry(50, true)), "first use: marked");
            assert_eq!(
                c.lookup(far),
                Some(entry(50, false)),
                "the marker is cleared"
            );
            c.rehome(far, 51);
            assert_eq!(
                c.entries_of(7),
                vec![(3, entry(30, false)), (far, entry(51, false))]
            );
            assert!(c.entries_of(8).is_empty());
            assert_eq!(c.delete(3), Some(entry(30, false)));
            assert_eq!(c.delete(3), None);
            assert!(c.peek(3).is_none() && c.peek(far).is_some());
            let s = c.stats();
            assert_eq!(
                (s.lookups, s.hits, s.readahead_hits, s.adds, s.deletes),
                (4, 3, 1, 2, 1),
                "{mode}"
            );
        }
    }

    #[test]
    fn trunks_have_a_lock_each_and_single_has_one() {
        let trunks = SwapCache::new(SwapCacheMode::Trunks, 4 * TRUNK_SLOTS);
        let single = SwapCache::new(SwapCacheMode::Single, 4 * TRUNK_SLOTS);
        for c in [&trunks, &single] {
            for t in 0..4 {
                c.add((t * TRUNK_SLOTS) as SlotId, entry(t as u32, false));
                c.lookup((t * TRUNK_SLOTS) as SlotId);
            }
        }
        assert_eq!(
            (trunks.lockstat().locks, trunks.lockstat().stat.acquisitions),
            (4, 8)
        );
        assert_eq!(
            (single.lockstat().locks, single.lockstat().stat.acquisitions),
            (1, 8)
        );
    }

    #[test]
    fn a_space_is_made_by_the_first_add_and_lookups_before_it_count() {
        for mode in SwapCacheMode::ALL {
            let c = SwapCache::new(*mode, 4 * TRUNK_SLOTS);
            let slot = (2 * TRUNK_SLOTS + 5) as SlotId;
            assert_eq!(c.lookup(slot), None, "{mode}");
            assert_eq!(c.delete(slot), None, "{mode}");
            assert!(!c.mark_used(slot, 7), "{mode}");
            assert_eq!(c.lockstat().locks, 0, "{mode}: nothing made by reads");
            c.add(slot, entry(9, false));
            assert_eq!(c.lockstat().locks, 1, "{mode}: one space made");
            assert_eq!(c.lookup(slot), Some(entry(9, false)), "{mode}");
            assert_eq!(c.entries_of(7), vec![(slot, entry(9, false))], "{mode}");
            let s = c.stats();
            assert_eq!((s.lookups, s.hits, s.adds), (2, 1, 1), "{mode}");
        }
    }

    /// Threads add, look up and delete their own slots, spread over trunks: every entry is
    /// found as it was added and the counters add up.
    #[test]
    fn concurrent_owners_see_their_own_entries() {
        for mode in SwapCacheMode::ALL {
            let c = Arc::new(SwapCache::new(*mode, 4 * TRUNK_SLOTS));
            let threads: Vec<_> = (0..4u32)
                .map(|t| {
                    let c = c.clone();
                    std::thread::spawn(move || {
                        for round in 0..2_000u32 {
                            let slot = (round * 31 + t) % (4 * TRUNK_SLOTS as u32);
                            let slot = slot - slot % 4 + t; // each thread owns its slots
                            c.add(slot, entry(round, round % 2 == 0));
                            let e = c.lookup(slot).expect("own entry");
                            assert_eq!((e.page, e.readahead), (round, round % 2 == 0));
                            assert_eq!(c.delete(slot).map(|e| e.page), Some(round));
                        }
                    })
                })
                .collect();
            threads.into_iter().for_each(|t| t.join().unwrap());
            let s = c.stats();
            assert_eq!(
                (s.adds, s.deletes, s.lookups, s.hits),
                (8000, 8000, 8000, 8000)
            );
            assert_eq!(s.readahead_hits, 4000);
            assert!(c.entries_of(7).is_empty());
        }
    }
}
