//! The compressed tier in front of the swap file (mm/zswap.c, one per device): a page
//! written to a slot is compressed into an in-memory pool (`zpool.rs`) instead of the file
//! when the tier is on and the page compresses well enough (to at most 3,072 bytes with
//! its header, else it goes to the file: zswap's `reject_compress_poor`); a page that
//! repeats one word keeps just the word. A read of the slot looks here first. When the
//! pool's objects take more than its size, the oldest are written back to their slots in
//! the file along with reclaim's own writes (zswap's shrinker), and a pool made smaller or
//! turned off drains the same way.
//!
//! Where each slot's data is, is one atomic word per slot (as vmcache keeps a page's state):
//!
//! ```text
//!  EMPTY ──store──▶ STORED{handle, gen} ──invalidate──▶ EMPTY (cell freed)
//!                     │    ▲         │
//!     start_writeback │    │ failed  │ clean copy dropped (the file holds the page too)
//!                     ▼    │         ▼
//!                   WRITEBACK ──written_back──▶ EMPTY+shadow (cell freed, page in the file)
//!
//!  EMPTY ──no room for a clean page──▶ EMPTY+shadow ──file read or invalidate──▶ EMPTY
//! ```
//!
//! EMPTY means the file holds the slot's data, if any (the device's guard knows). A page
//! that leaves the pool (written back, or a clean copy dropped), or a clean page a full
//! pool had no room for, leaves a shadow in its EMPTY word: the count of such departures
//! at the time. The file read of the slot takes it (`zswap_shrinker.rs` sizes an `auto`
//! pool by such refaults); an invalidation clears it. Only the
//! slot's user stores and invalidates (reclaim writing its page, a fault or an unmap
//! freeing it); writeback takes any STORED slot. An invalidation that finds WRITEBACK waits
//! for the write to end: the writer is reclaim, which holds none of the slot's page locks.
//! Readers (faults, readahead, the SIGBUS handler) copy the object, then look at the word
//! again: a changed word means the copy may be torn (its cell freed and reused), and they
//! look again; an unchanged word with a wrong checksum is corruption, reported as such.

use super::cluster::SlotId;
use super::slot_table::SlotTable;
use super::swap_io::page_buf::PageBuf;
use super::zpool::{Handle, ZPool, CHUNK_BYTES, MAX_OBJECT_WORDS};
use super::zswap_shrinker::{Seen, Shrinker};
use crate::lockdep::Rank;
use crate::lockstat::{LockClass, StatMutex};
use crate::sync::{AtomicBool, AtomicU32, AtomicU64};
use crate::{Compressor, Ztier, ZtierSize, PAGE_SIZE};
use serde::Serialize;
use std::cell::RefCell;
use std::collections::VecDeque;
use std::sync::atomic::Ordering::{AcqRel, Acquire, Relaxed, Release};
use std::time::Instant;

const PAGE_WORDS: usize = PAGE_SIZE / 8;

/// An object's first word: the page's CRC32C, the compressed length, and how it is kept.
const LEN_SHIFT: u32 = 32;
const LEN_MASK: u64 = 0xffff;
const SAME_FILLED: u64 = 1 << 48;
const ZSTD: u64 = 1 << 49;

/// Compressed bytes an object may hold after its header.
const MAX_PAYLOAD: usize = (MAX_OBJECT_WORDS - 1) * 8;

/// Words of the buffer a page is compressed into: a header and the most LZ4 may write
/// (it wants room for that before it starts).
const SCRATCH_WORDS: usize = 1 + lz4_flex::block::get_maximum_output_size(PAGE_SIZE).div_ceil(8);

/// The location word: generation (low 30 bits, never 0 once stored), handle, state.
const GEN_BITS: u32 = 30;
const HANDLE_SHIFT: u32 = GEN_BITS;
const STATE_SHIFT: u32 = 62;
const EMPTY: u64 = 0;
const STORED: u64 = 1;
const WRITEBACK: u64 = 2;

/// In an EMPTY word: the slot's page left the pool when the departure count's low bits
/// were the word's low [`SHADOW_BITS`].
const SHADOW: u64 = 1 << 61;
const SHADOW_BITS: u32 = 40;
const SHADOW_MASK: u64 = (1 << SHADOW_BITS) - 1;
const GEN_MASK: u64 = (1 << GEN_BITS) - 1;

fn state(word: u64) -> u64 {
    word >> STATE_SHIFT
}

fn handle(word: u64) -> Handle {
    Handle((word >> HANDLE_SHIFT) as u32)
}

fn with_state(word: u64, s: u64) -> u64 {
    (word & !(3 << STATE_SHIFT)) | (s << STATE_SHIFT)
}

/// After this many pages in a row failed to compress, only one page in this many is tried
/// until one compresses: incompressible data costs a compression attempt per 32 pages.
const POOR_STREAK: u32 = 32;

/// What a read of a slot found here.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(super) enum Load {
    /// The slot's data is not in the pool: read the file.
    NotHere,
    /// The page is in the destination, verified.
    Page,
    /// The object failed its checksum: the page is lost.
    Corrupt,
    /// Kept by a compressor the signal handler cannot run (zstd allocates): read it off
    /// the handler.
    NotInSignal,
}

/// A stored page taken for writeback, decompressed into `page`. It must be settled with
/// [`Victim::written_back`] or [`Victim::failed`]; one dropped unsettled (a panic between
/// taking it and writing it) goes back to the pool, so no slot is left in WRITEBACK, where
/// a free of it would wait forever.
pub(super) struct Victim<'z> {
    zswap: &'z Zswap,
    pub(super) slot: SlotId,
    word: u64,
    pub(super) page: PageBuf,
    settled: bool,
}

impl Victim<'_> {
    /// The page is in the file now (its guard recorded): its object goes.
    pub(super) fn written_back(mut self, started: Instant) {
        self.settled = true;
        let z = self.zswap;
        let location = z.locations.entry(self.slot).expect("a stored slot's word");
        let swapped = location.compare_exchange(self.word, z.next_shadow(), AcqRel, Relaxed);
        debug_assert!(swapped.is_ok(), "only writeback leaves WRITEBACK");
        z.counters.left.fetch_add(1, Relaxed);
        z.release(self.word);
        z.counters.written_back.fetch_add(1, Relaxed);
        z.counters.writeback_ns.fetch_add(nanos(started), Relaxed);
    }

    /// The write failed: the pool keeps the page.
    pub(super) fn failed(mut self) {
        self.settled = true;
        self.zswap.keep(self.slot, with_state(self.word, STORED));
    }
}

impl Drop for Victim<'_> {
    fn drop(&mut self) {
        if !self.settled {
            self.zswap.keep(self.slot, with_state(self.word, STORED));
        }
    }
}

/// The tier's counters, named after zswap's.
#[derive(Default)]
struct Counters {
    stored_pages: AtomicU64,
    same_filled_pages: AtomicU64,
    stored_bytes: AtomicU64,
    stores: AtomicU64,
    loads: AtomicU64,
    written_back: AtomicU64,
    stored_clean: AtomicU64,
    dropped_clean: AtomicU64,
    /// Pages that left the pool for the file (written back or dropped clean) and clean
    /// pages a full pool had no room for: the clock shadows are read on.
    left: AtomicU64,
    reject_compress_poor: AtomicU64,
    reject_alloc_fail: AtomicU64,
    skipped_poor: AtomicU64,
    store_ns: AtomicU64,
    load_ns: AtomicU64,
    writeback_ns: AtomicU64,
}

/// What the compressed tier holds and has done (`uswap stat`, the benches' JSON).
#[derive(Clone, Debug, Default, PartialEq, Serialize, serde::Deserialize)]
pub struct ZtierStats {
    pub enabled: bool,
    pub compressor: String,
    /// The most bytes the pool's objects may take now.
    pub limit_bytes: u64,
    /// Times an `auto` size raised and lowered that limit (`zswap_shrinker.rs`).
    #[serde(default)]
    pub limit_raised: u64,
    #[serde(default)]
    pub limit_lowered: u64,
    /// Pages held in the pool now, same-filled ones included.
    pub stored_pages: u64,
    /// Of those, pages that repeat one word, kept as the word.
    pub same_filled_pages: u64,
    /// Bytes the stored objects take (their cells).
    pub stored_bytes: u64,
    /// Memory the pool holds (its chunks).
    pub pool_bytes: u64,
    /// Pool pages charged to the memory limit (as of reclaim's last look).
    pub charged_pages: u64,
    /// Page bytes held per byte of pool memory.
    pub compression_ratio: f64,
    /// Pages stored since the device was made.
    pub stores: u64,
    /// Pages read back from the pool (decompressed).
    pub loads: u64,
    /// Pages written back to the file to make room.
    pub written_back: u64,
    /// Clean pages stored (their data in the file too), and such pages dropped to make
    /// room, with no write.
    #[serde(default)]
    pub stored_clean: u64,
    #[serde(default)]
    pub dropped_clean: u64,
    /// Pages that did not compress well enough, sent to (or, clean, left in) the file.
    pub reject_compress_poor: u64,
    /// Pages sent to the file because the pool could not get memory.
    pub reject_alloc_fail: u64,
    /// Pages sent to the file untried, during a run of incompressible ones.
    pub skipped_poor: u64,
    pub store_ms: f64,
    pub load_ms: f64,
    pub writeback_ms: f64,
}

impl ZtierStats {
    /// The counts since `earlier` (what the tier holds stays as it is now).
    pub fn since(&self, earlier: &ZtierStats) -> ZtierStats {
        ZtierStats {
            stores: self.stores - earlier.stores,
            loads: self.loads - earlier.loads,
            limit_raised: self.limit_raised - earlier.limit_raised,
            limit_lowered: self.limit_lowered - earlier.limit_lowered,
            written_back: self.written_back - earlier.written_back,
            stored_clean: self.stored_clean - earlier.stored_clean,
            dropped_clean: self.dropped_clean - earlier.dropped_clean,
            reject_compress_poor: self.reject_compress_poor - earlier.reject_compress_poor,
            reject_alloc_fail: self.reject_alloc_fail - earlier.reject_alloc_fail,
            skipped_poor: self.skipped_poor - earlier.skipped_poor,
            store_ms: self.store_ms - earlier.store_ms,
            load_ms: self.load_ms - earlier.load_ms,
            writeback_ms: self.writeback_ms - earlier.writeback_ms,
            ..self.clone()
        }
    }
}

pub(super) struct Zswap {
    compressor: Compressor,
    enabled: AtomicBool,
    /// The pool's size as set ([`encode_size`]).
    size: AtomicU64,
    /// The most bytes the objects may take (from `size` and the memory limit; none, so no
    /// writeback, until [`Zswap::balance`] first sets it).
    limit: AtomicU64,
    /// Where an `auto` size puts the limit.
    shrinker: Shrinker,
    /// The most the pool's chunks may take before writeback empties some: 90% of the
    /// memory limit (from [`Zswap::balance`]).
    ceiling: AtomicU64,
    pool: ZPool,
    locations: SlotTable,
    /// Stored slots, oldest first, with the word they were stored with (stale entries are
    /// skipped when met).
    order: StatMutex<VecDeque<(SlotId, u64)>>,
    next_gen: AtomicU32,
    poor_in_row: AtomicU32,
    /// Pool pages charged to the memory limit so far ([`Zswap::balance`]).
    charged: AtomicU64,
    /// The region the pool is charged to (the first to balance it), or [`NO_OWNER`].
    owner: AtomicU32,
    balances: AtomicU64,
    counters: Counters,
}

impl Zswap {
    pub(super) fn new(cfg: &Ztier, slots: u64) -> Zswap {
        Zswap {
            compressor: cfg.compressor,
            enabled: AtomicBool::new(cfg.enabled),
            size: AtomicU64::new(encode_size(cfg.size)),
            limit: AtomicU64::new(u64::MAX),
            shrinker: Shrinker::new(),
            ceiling: AtomicU64::new(u64::MAX),
            pool: ZPool::new(),
            locations: SlotTable::new(slots),
            order: StatMutex::new(Rank::ZswapLru, VecDeque::new()),
            next_gen: AtomicU32::new(1),
            poor_in_row: AtomicU32::new(0),
            charged: AtomicU64::new(0),
            owner: AtomicU32::new(NO_OWNER),
            balances: AtomicU64::new(0),
            counters: Counters::default(),
        }
    }

    pub(super) fn set_enabled(&self, on: bool) {
        self.enabled.store(on, Relaxed);
    }

    pub(super) fn set_size(&self, size: ZtierSize) {
        self.size.store(encode_size(size), Relaxed);
    }

    pub(super) fn size(&self) -> ZtierSize {
        decode_size(self.size.load(Relaxed))
    }

    /// Sets the pool's limit for a memory limit of `limit_bytes` (at most 90% of it; an
    /// `auto` size moved by the shrinker, which is told of the `evictions` reclaim made
    /// since the last call and of the file's mean read time), gives back the memory of
    /// emptied chunks, and returns the change in pool pages since the last call, for the
    /// caller to charge (positive) or uncharge (negative) against the memory limit.
    /// `others_bytes`: what the other processes under a limit shared by a process tree
    /// hold; the pool takes at most 90% of the rest, so that it leaves this process room
    /// for its own resident pages.
    pub(super) fn balance(
        &self,
        limit_bytes: u64,
        others_bytes: u64,
        region: u32,
        evictions: u64,
        file_read_ns: u64,
    ) -> i64 {
        let owner = self
            .owner
            .compare_exchange(NO_OWNER, region, Relaxed, Relaxed);
        if owner.is_err_and(|o| o != region) {
            return 0;
        }
        let size = decode_size(self.size.load(Relaxed));
        let limit = match size {
            ZtierSize::Auto => self.shrinker.decide(
                &self.seen(limit_bytes, evictions, file_read_ns),
                size.bytes(limit_bytes),
            ),
            fixed => fixed.bytes(limit_bytes),
        };
        // At most 90% of the limit, less what the others under it hold.
        let most = limit_bytes.saturating_sub(others_bytes) / 10 * 9;
        self.limit.store(limit.min(most), Relaxed);
        self.ceiling.store(most, Relaxed);
        // Emptied chunks are looked for (a walk of every chunk) only once the pool holds
        // clearly more than its objects take, and then every 16th call.
        let stored = self.counters.stored_bytes.load(Relaxed);
        let slack = stored / 8 + 4 * CHUNK_BYTES as u64;
        if self.pool.bytes() > stored + slack
            && self.balances.fetch_add(1, Relaxed).is_multiple_of(16)
        {
            self.pool.shrink();
        }
        let now = self.pool.bytes() / PAGE_SIZE as u64;
        let before = self.charged.swap(now, Relaxed);
        now as i64 - before as i64
    }

    fn seen(&self, limit_bytes: u64, evictions: u64, file_read_ns: u64) -> Seen {
        let c = &self.counters;
        Seen {
            limit_bytes,
            stored_bytes: c.stored_bytes.load(Relaxed),
            stored_pages: c.stored_pages.load(Relaxed),
            stores: c.stores.load(Relaxed),
            evictions,
            load_ns: c.load_ns.load(Relaxed) / c.loads.load(Relaxed).max(1),
            file_read_ns,
        }
    }

    /// Whether the pool holds `slot`'s data.
    pub(super) fn holds(&self, slot: SlotId) -> bool {
        state(self.locations.get(slot)) != EMPTY
    }

    /// The file is read for `slot`: a shadow it left when it left the pool tells the
    /// shrinker how many departures ago that was, once.
    pub(super) fn refault(&self, slot: SlotId) {
        let Some(location) = self.locations.entry(slot) else {
            return;
        };
        let word = location.load(Relaxed);
        if word & SHADOW == 0
            || state(word) != EMPTY
            || location
                .compare_exchange(word, EMPTY, Relaxed, Relaxed)
                .is_err()
        {
            return;
        }
        let now = self.counters.left.load(Relaxed);
        self.shrinker
            .refaulted(now.wrapping_sub(word) & SHADOW_MASK);
    }

    /// The shadow of the next page to leave the pool; its taker moves the clock on.
    fn next_shadow(&self) -> u64 {
        SHADOW | (self.counters.left.load(Relaxed) & SHADOW_MASK)
    }

    /// Stores a clean page, whose data the file holds at `slot` too, when the pool has
    /// room below its limit: reading it back then takes no file read. Without room the
    /// slot gets a shadow instead, so a read of it counts as a refault that a larger pool
    /// would have saved. False when the page was not stored.
    ///
    /// # Safety
    /// As [`Zswap::store`].
    pub(super) unsafe fn store_clean(&self, slot: SlotId, page: *const u8) -> bool {
        if !self.enabled.load(Relaxed) || self.holds(slot) {
            return false;
        }
        let room =
            self.counters.stored_bytes.load(Relaxed) + PAGE_SIZE as u64 <= self.limit.load(Relaxed);
        if room {
            let stored = self.store(slot, page);
            if stored {
                self.counters.stored_clean.fetch_add(1, Relaxed);
            }
            return stored;
        }
        if let Some(location) = self.locations.entry(slot) {
            let word = location.load(Relaxed);
            if state(word) == EMPTY
                && location
                    .compare_exchange(word, self.next_shadow(), Relaxed, Relaxed)
                    .is_ok()
            {
                self.counters.left.fetch_add(1, Relaxed);
            }
        }
        false
    }

    /// Stores the page at `page` for `slot` (whose location must be EMPTY: the device
    /// invalidates first). False when the tier is off or the page goes to the file.
    ///
    /// # Safety
    /// `page` must be valid for reading 4096 bytes, 8-byte aligned.
    pub(super) unsafe fn store(&self, slot: SlotId, page: *const u8) -> bool {
        if !self.enabled.load(Relaxed) {
            return false;
        }
        let started = Instant::now();
        let words = std::slice::from_raw_parts(page.cast::<u64>(), PAGE_WORDS);
        let bytes = std::slice::from_raw_parts(page, PAGE_SIZE);
        let crc = u64::from(crc32c::crc32c(bytes));
        let mut object = [0u64; SCRATCH_WORDS];
        let len = if words.iter().all(|&w| w == words[0]) {
            object[0] = crc | SAME_FILLED;
            object[1] = words[0];
            2
        } else {
            let streak = self.poor_in_row.load(Relaxed);
            if streak >= POOR_STREAK && !streak.is_multiple_of(POOR_STREAK) {
                self.poor_in_row.fetch_add(1, Relaxed);
                self.counters.skipped_poor.fetch_add(1, Relaxed);
                return false;
            }
            let payload = object_payload(&mut object);
            let Some((n, flag)) = self.compress(bytes, payload) else {
                self.poor_in_row.fetch_add(1, Relaxed);
                self.counters.reject_compress_poor.fetch_add(1, Relaxed);
                return false;
            };
            self.poor_in_row.store(0, Relaxed);
            object[0] = crc | ((n as u64) << LEN_SHIFT) | flag;
            1 + n.div_ceil(8)
        };
        let Some(handle) = self.pool.store(&object[..len]) else {
            self.counters.reject_alloc_fail.fetch_add(1, Relaxed);
            return false;
        };
        let gen = u64::from(self.next_gen()) & GEN_MASK;
        let word = (STORED << STATE_SHIFT) | (u64::from(handle.0) << HANDLE_SHIFT) | gen;
        // Counted before it is published: a writeback may take it and release it at once.
        let c = &self.counters;
        c.stored_pages.fetch_add(1, Relaxed);
        if len == 2 {
            c.same_filled_pages.fetch_add(1, Relaxed);
        }
        c.stored_bytes
            .fetch_add(self.pool.cell_bytes(handle), Relaxed);
        let location = self.locations.word(slot);
        let before = location.swap(word, Release);
        debug_assert_eq!(state(before), EMPTY, "slot {slot} stored over {before:#x}");
        let mut order = self.order.lock();
        order.push_back((slot, word));
        // Pages loaded or freed leave their entries behind: dropped once they are most.
        if order.len() > 2 * c.stored_pages.load(Relaxed) as usize + 4096 {
            order.retain(|&(slot, word)| self.locations.get(slot) == word);
        }
        drop(order);
        c.stores.fetch_add(1, Relaxed);
        c.store_ns.fetch_add(nanos(started), Relaxed);
        true
    }

    /// Compresses `page` into `out`; its length and the header flag of the compressor, or
    /// `None` when it takes more than [`MAX_PAYLOAD`] bytes.
    fn compress(&self, page: &[u8], out: &mut [u8]) -> Option<(usize, u64)> {
        let (n, flag) = match self.compressor {
            Compressor::Lz4 => (lz4_flex::block::compress_into(page, out).ok()?, 0),
            Compressor::Zstd(level) => (zstd_compress(page, &mut out[..MAX_PAYLOAD], level)?, ZSTD),
        };
        (n <= MAX_PAYLOAD).then_some((n, flag))
    }

    /// Forgets `slot`'s object, if any, waiting for a writeback of it to end. Takes no
    /// lock and allocates nothing (the SIGBUS handler frees slots).
    pub(super) fn invalidate(&self, slot: SlotId) {
        let Some(location) = self.locations.entry(slot) else {
            return;
        };
        let mut round = 0;
        loop {
            let word = location.load(Acquire);
            match state(word) {
                EMPTY => {
                    if word != EMPTY {
                        // Its shadow goes with it: the slot may be used again.
                        let _ = location.compare_exchange(word, EMPTY, Relaxed, Relaxed);
                    }
                    return;
                }
                STORED => {
                    if location
                        .compare_exchange(word, EMPTY, AcqRel, Relaxed)
                        .is_ok()
                    {
                        self.release(word);
                        return;
                    }
                }
                _ => {
                    crate::sync::backoff(round);
                    round += 1;
                }
            }
        }
    }

    /// Reads `slot`'s page into `dst` if the pool holds it, verified against its checksum.
    /// Allocates nothing when `in_signal` (a zstd object is then left for the full path);
    /// takes about 3 KiB of stack for the object's copy, which a signal handler must have
    /// to spare (`SwapDevice::read_page_in_place` asks).
    ///
    /// # Safety
    /// `dst` must be valid for writing 4096 bytes, 8-byte aligned.
    pub(super) unsafe fn load(&self, slot: SlotId, dst: *mut u8, in_signal: bool) -> Load {
        let Some(location) = self.locations.entry(slot) else {
            return Load::NotHere;
        };
        let started = Instant::now();
        let mut object = [0u64; MAX_OBJECT_WORDS];
        loop {
            let word = location.load(Acquire);
            if state(word) == EMPTY {
                self.refault(slot);
                return Load::NotHere;
            }
            let read = self.pool.read(handle(word), &mut object);
            ZPool::read_done();
            if location.load(Relaxed) != word {
                continue;
            }
            let Some(read) = read else {
                return Load::Corrupt;
            };
            let header = object[0];
            if header & ZSTD != 0 && in_signal {
                return Load::NotInSignal;
            }
            let out = std::slice::from_raw_parts_mut(dst, PAGE_SIZE);
            if !unpack(&object[..read], out) {
                return Load::Corrupt;
            }
            self.counters.loads.fetch_add(1, Relaxed);
            self.counters.load_ns.fetch_add(nanos(started), Relaxed);
            // Pages stored after this one: the gens handed out since its own.
            let stored_at = (word & GEN_MASK) as u32;
            let after = self
                .next_gen
                .load(Relaxed)
                .wrapping_sub(stored_at)
                .wrapping_sub(1);
            self.shrinker.loaded(u64::from(after) & GEN_MASK);
            return Load::Page;
        }
    }

    /// Takes up to `max` of the oldest stored pages for writeback, decompressing each
    /// into a buffer of its own, when the pool is over its size: its objects over it (down
    /// to 90%, as zswap accepts again below its threshold), or its chunks over it by a
    /// quarter and a few chunks (cells freed all over leave chunks that cannot be given
    /// back; writing the oldest pages back empties whole chunks, which were filled
    /// together). A page that fails its check stays, last in line (its fault reports it).
    /// A page the file holds too (`in_file`: stored clean) is dropped here, unwritten.
    pub(super) fn victims(&self, max: usize, in_file: impl Fn(SlotId) -> bool) -> Vec<Victim<'_>> {
        self.take_oldest(max, self.bytes_over(), in_file)
    }

    /// Takes up to `max` of the oldest stored pages for writeback whatever the pool's
    /// size: reclaim found nothing else to free (the pool holds all this process has of
    /// a limit the others under it hold the rest of), as the kernel's zswap shrinker
    /// writes back under a memory cgroup's pressure. [`Zswap::release_empty_chunks`]
    /// then gives the chunks they emptied back.
    pub(super) fn victims_under_pressure(
        &self,
        max: usize,
        in_file: impl Fn(SlotId) -> bool,
    ) -> Vec<Victim<'_>> {
        self.take_oldest(max, u64::MAX, in_file)
    }

    /// Gives the memory of the chunks with no object left back; returns how many.
    pub(super) fn release_empty_chunks(&self) -> u64 {
        self.pool.shrink()
    }

    /// Bytes the pool holds over its size: objects or chunks (see [`Zswap::victims`]).
    fn bytes_over(&self) -> u64 {
        let limit = match self.enabled.load(Relaxed) {
            true => self.limit.load(Relaxed),
            false => 0,
        };
        let stored = self.counters.stored_bytes.load(Relaxed);
        let objects_over = match stored > limit {
            true => stored - limit / 10 * 9,
            false => 0,
        };
        // A few chunks are partly full whatever is freed (a class's last one): not counted,
        // short of 90% of the memory limit.
        let slack = limit / 4 + 8 * CHUNK_BYTES as u64;
        let most = limit
            .saturating_add(slack)
            .min(self.ceiling.load(Relaxed).max(limit));
        let chunks_over = self.pool.bytes().saturating_sub(most);
        objects_over.max(chunks_over)
    }

    /// Takes up to `max` of the oldest stored pages, until their cells free `to_free`
    /// bytes; pages the file holds too are dropped, not taken.
    fn take_oldest(
        &self,
        max: usize,
        mut to_free: u64,
        in_file: impl Fn(SlotId) -> bool,
    ) -> Vec<Victim<'_>> {
        let mut taken = Vec::new();
        if to_free == 0 || max == 0 {
            return taken;
        }
        let mut order = self.order.lock();
        let mut looked = order.len();
        // Clean copies dropped count towards `max` too: a pass under pressure, with no
        // bytes to stop at, would drop every one in the pool.
        let mut dropped = 0;
        while taken.len() + dropped < max && to_free > 0 && looked > 0 {
            looked -= 1;
            let Some((slot, word)) = order.pop_front() else {
                break;
            };
            let Some(location) = self.locations.entry(slot) else {
                continue;
            };
            if in_file(slot) {
                // The file's copy stays valid while the word is STORED: the slot's user
                // invalidates before it writes the slot again.
                if location
                    .compare_exchange(word, self.next_shadow(), AcqRel, Relaxed)
                    .is_ok()
                {
                    self.counters.left.fetch_add(1, Relaxed);
                    to_free = to_free.saturating_sub(self.pool.cell_bytes(handle(word)));
                    self.release(word);
                    self.counters.dropped_clean.fetch_add(1, Relaxed);
                    dropped += 1;
                }
                continue;
            }
            let writing = with_state(word, WRITEBACK);
            if location
                .compare_exchange(word, writing, AcqRel, Relaxed)
                .is_err()
            {
                continue;
            }
            let mut page = PageBuf::new();
            let mut object = [0u64; MAX_OBJECT_WORDS];
            let read = self.pool.read(handle(word), &mut object).unwrap_or(0);
            if !unpack(&object[..read], page.as_mut_slice()) {
                location.store(word, Release);
                order.push_back((slot, word));
                continue;
            }
            to_free = to_free.saturating_sub(self.pool.cell_bytes(handle(word)));
            taken.push(Victim {
                zswap: self,
                slot,
                word: writing,
                page,
                settled: false,
            });
        }
        taken
    }

    /// Puts a page taken for writeback back in the pool, last in line.
    fn keep(&self, slot: SlotId, stored: u64) {
        let location = self.locations.entry(slot).expect("a stored slot's word");
        location.store(stored, Release);
        self.order.lock().push_back((slot, stored));
    }

    /// Frees the cell of an object whose word just left it.
    fn release(&self, word: u64) {
        let handle = handle(word);
        let (c, bytes) = (&self.counters, self.pool.cell_bytes(handle));
        c.stored_bytes.fetch_sub(bytes, Relaxed);
        c.stored_pages.fetch_sub(1, Relaxed);
        if bytes == 16 {
            c.same_filled_pages.fetch_sub(1, Relaxed);
        }
        self.pool.free(handle);
    }

    fn next_gen(&self) -> u32 {
        loop {
            let gen = self.next_gen.fetch_add(1, Relaxed);
            if u64::from(gen) & GEN_MASK != 0 {
                return gen;
            }
        }
    }

    pub(super) fn stats(&self) -> ZtierStats {
        let c = &self.counters;
        let stored_pages = c.stored_pages.load(Relaxed);
        let pool_bytes = self.pool.bytes();
        let moves = self.shrinker.moves();
        ZtierStats {
            enabled: self.enabled.load(Relaxed),
            compressor: self.compressor.to_string(),
            limit_bytes: match self.limit.load(Relaxed) {
                u64::MAX => 0,
                limit => limit,
            },
            limit_raised: moves.raised,
            limit_lowered: moves.lowered,
            stored_pages,
            same_filled_pages: c.same_filled_pages.load(Relaxed),
            stored_bytes: c.stored_bytes.load(Relaxed),
            pool_bytes,
            charged_pages: self.charged.load(Relaxed),
            compression_ratio: match pool_bytes {
                0 => 0.0,
                b => (stored_pages * PAGE_SIZE as u64) as f64 / b as f64,
            },
            stores: c.stores.load(Relaxed),
            loads: c.loads.load(Relaxed),
            written_back: c.written_back.load(Relaxed),
            stored_clean: c.stored_clean.load(Relaxed),
            dropped_clean: c.dropped_clean.load(Relaxed),
            reject_compress_poor: c.reject_compress_poor.load(Relaxed),
            reject_alloc_fail: c.reject_alloc_fail.load(Relaxed),
            skipped_poor: c.skipped_poor.load(Relaxed),
            store_ms: c.store_ns.load(Relaxed) as f64 / 1e6,
            load_ms: c.load_ns.load(Relaxed) as f64 / 1e6,
            writeback_ms: c.writeback_ns.load(Relaxed) as f64 / 1e6,
        }
    }

    /// In a fork child, for a device it abandons: the parent's pool goes.
    pub(super) fn close_in_child(&self) {
        self.pool.unmap_in_child();
    }

    /// The statistics of the tier's locks (`zswap_order`, `zpool_class`).
    pub(super) fn lockstat(&self) -> Vec<LockClass> {
        vec![
            LockClass::sum("zswap_order", [&self.order]),
            self.pool.lockstat(),
        ]
    }
}

const PERCENT: u64 = 1 << 63;
const AUTO: u64 = 1 << 62;

const NO_OWNER: u32 = u32::MAX;

/// A pool size in one word: bytes, or a share with the top bit set.
fn encode_size(size: ZtierSize) -> u64 {
    match size {
        ZtierSize::Bytes(b) => b & !(PERCENT | AUTO),
        ZtierSize::Percent(p) => PERCENT | u64::from(p),
        ZtierSize::Auto => AUTO,
    }
}

fn decode_size(word: u64) -> ZtierSize {
    match (word & PERCENT, word & AUTO) {
        (0, 0) => ZtierSize::Bytes(word),
        (0, _) => ZtierSize::Auto,
        _ => ZtierSize::Percent(word as u8),
    }
}

/// The bytes after an object's header, where the compressed page goes.
fn object_payload(object: &mut [u64; SCRATCH_WORDS]) -> &mut [u8] {
    let payload = &mut object[1..];
    // SAFETY: plain words viewed as bytes, within the array.
    unsafe { std::slice::from_raw_parts_mut(payload.as_mut_ptr().cast::<u8>(), payload.len() * 8) }
}

/// Rebuilds a page from an object (its header first) and checks it against the header's
/// CRC32C; false for an empty object, one that does not decompress to exactly one page,
/// or a page that fails its check.
fn unpack(object: &[u64], out: &mut [u8]) -> bool {
    let Some((&header, payload)) = object.split_first() else {
        return false;
    };
    decompress(header, payload, out) && u64::from(crc32c::crc32c(out)) == header & 0xffff_ffff
}

/// Rebuilds a page from an object's words after its header; false when they do not
/// decompress to exactly one page.
fn decompress(header: u64, payload: &[u64], out: &mut [u8]) -> bool {
    if header & SAME_FILLED != 0 {
        let Some(&value) = payload.first() else {
            return false;
        };
        for chunk in out.chunks_exact_mut(8) {
            chunk.copy_from_slice(&value.to_ne_bytes());
        }
        return true;
    }
    let len = ((header >> LEN_SHIFT) & LEN_MASK) as usize;
    // SAFETY: plain words viewed as bytes.
    let bytes =
        unsafe { std::slice::from_raw_parts(payload.as_ptr().cast::<u8>(), payload.len() * 8) };
    let Some(src) = bytes.get(..len) else {
        return false;
    };
    match header & ZSTD != 0 {
        false => matches!(lz4_flex::block::decompress_into(src, out), Ok(PAGE_SIZE)),
        true => zstd_decompress(src, out),
    }
}

thread_local! {
    /// This thread's zstd compressor and its level (a thread compresses for one device's
    /// level at a time), made on first use.
    static ZSTD_COMPRESSOR: RefCell<Option<(zstd::bulk::Compressor<'static>, i32)>> =
        const { RefCell::new(None) };
    static ZSTD_DECOMPRESSOR: RefCell<Option<zstd::bulk::Decompressor<'static>>> =
        const { RefCell::new(None) };
}

/// Compresses with this thread's zstd context (made again when the level changes).
fn zstd_compress(page: &[u8], out: &mut [u8], level: i32) -> Option<usize> {
    ZSTD_COMPRESSOR.with(|cell| {
        let mut ctx = cell.borrow_mut();
        if ctx.as_ref().is_none_or(|&(_, l)| l != level) {
            *ctx = Some((zstd::bulk::Compressor::new(level).ok()?, level));
        }
        let (compressor, _) = ctx.as_mut()?;
        compressor.compress_to_buffer(page, out).ok()
    })
}

fn zstd_decompress(src: &[u8], out: &mut [u8]) -> bool {
    ZSTD_DECOMPRESSOR.with(|cell| {
        let mut ctx = cell.borrow_mut();
        if ctx.is_none() {
            *ctx = zstd::bulk::Decompressor::new().ok();
        }
        ctx.as_mut()
            .is_some_and(|d| matches!(d.decompress_to_buffer(src, out), Ok(PAGE_SIZE)))
    })
}

fn nanos(since: Instant) -> u64 {
    since.elapsed().as_nanos() as u64
}

#[cfg(test)]
impl Zswap {
    /// Test hook: flips a bit of `slot`'s stored object.
    pub(super) fn corrupt(&self, slot: SlotId) {
        let word = self.locations.get(slot);
        assert_eq!(state(word), STORED, "slot {slot} is not in the pool");
        self.pool.corrupt(handle(word));
    }
}

#[cfg(all(test, not(loom)))]
mod tests {
    use super::*;

    /// A page that compresses about 3:1: every third word differs.
    fn compressible(seed: u64) -> PageBuf {
        let mut page = PageBuf::new();
        for (i, chunk) in page.as_mut_slice().chunks_exact_mut(8).enumerate() {
            let word = match i % 3 {
                0 => (seed << 32 | i as u64).wrapping_mul(0x9e37_79b9_7f4a_7c15),
                _ => 0x5555,
            };
            chunk.copy_from_slice(&word.to_ne_bytes());
        }
        page
    }

    fn auto_tier(slots: u64) -> Zswap {
        Zswap::new(&Ztier::default(), slots)
    }

    const LIMIT: u64 = 4 << 20;

    fn balance(z: &Zswap) {
        z.balance(LIMIT, 0, 1, 64, 100_000);
    }

    #[test]
    fn pool_loads_soon_after_stores_lower_an_auto_pool_and_file_reads_of_pages_just_written_back_raise_it(
    ) {
        let z = auto_tier(4096);
        balance(&z);
        let start = z.stats().limit_bytes;
        assert_eq!(
            start,
            LIMIT / 10 * 9,
            "an auto pool starts at 90% of the limit"
        );
        // Pages loaded from the pool soon after they were stored: resident memory would
        // have kept them, so the pool gives way, down to what it holds less a step.
        let mut slot = 0;
        while z.stats().limit_lowered == 0 {
            assert!(slot < 1000, "no lowering: {:?}", z.stats());
            assert!(unsafe { z.store(slot, compressible(slot.into()).as_ptr()) });
            let mut page = PageBuf::new();
            assert_eq!(
                unsafe { z.load(slot, page.as_mut_ptr(), false) },
                Load::Page
            );
            assert_eq!(page.as_slice(), compressible(slot.into()).as_slice());
            z.invalidate(slot);
            slot += 1;
            balance(&z);
        }
        let lowered = z.stats().limit_bytes;
        assert_eq!(
            lowered,
            LIMIT / 100 * 5,
            "the pool held nothing: down to the floor"
        );
        // Batches stored over the limit; their oldest pages go to the file and are read
        // again at once (each shadow is taken once): a larger pool would have kept them.
        while z.stats().limit_raised == 0 {
            assert!(slot < 4000, "no raise after {slot} pages: {:?}", z.stats());
            for _ in 0..32 {
                assert!(unsafe { z.store(slot, compressible(slot.into()).as_ptr()) });
                slot += 1;
            }
            for victim in z.victims(64, |_| false) {
                let at = victim.slot;
                victim.written_back(Instant::now());
                let mut page = PageBuf::new();
                assert_eq!(
                    unsafe { z.load(at, page.as_mut_ptr(), false) },
                    Load::NotHere
                );
            }
            balance(&z);
        }
        assert_eq!(
            z.stats().limit_bytes,
            lowered + LIMIT / 64,
            "{:?}",
            z.stats()
        );
    }

    #[test]
    fn a_shadow_is_read_once_and_goes_with_its_slot() {
        let z = auto_tier(16);
        z.balance(0, 0, 1, 0, 100_000);
        assert!(unsafe { z.store(3, compressible(3).as_ptr()) });
        let victims = z.victims(4, |_| false);
        assert_eq!(victims.len(), 1);
        victims
            .into_iter()
            .for_each(|v| v.written_back(Instant::now()));
        let word = z.locations.get(3);
        assert!(word & SHADOW != 0 && state(word) == EMPTY && !z.holds(3));
        z.refault(3);
        assert_eq!(z.locations.get(3), EMPTY, "taken by the read");
        // A clean page the pool has no room for leaves one; a free takes it away.
        assert!(!unsafe { z.store_clean(5, compressible(5).as_ptr()) });
        assert!(z.locations.get(5) & SHADOW != 0);
        z.invalidate(5);
        assert_eq!(z.locations.get(5), EMPTY);
        // A store over a shadow replaces it.
        assert!(!unsafe { z.store_clean(6, compressible(6).as_ptr()) });
        assert!(unsafe { z.store(6, compressible(6).as_ptr()) });
        assert!(z.holds(6));
    }
}

/// The location word's transitions against each other, with pages that repeat one word
/// (two-word objects keep the model small).
#[cfg(all(test, loom))]
mod loom_tests {
    use super::*;
    use loom::sync::Arc;

    fn filled(word: u64) -> PageBuf {
        let mut page = PageBuf::new();
        for chunk in page.as_mut_slice().chunks_exact_mut(8) {
            chunk.copy_from_slice(&word.to_ne_bytes());
        }
        page
    }

    fn tier() -> Zswap {
        let cfg = Ztier {
            enabled: true,
            size: ZtierSize::Bytes(0),
            ..Ztier::default()
        };
        // A limit of 0: writeback takes every stored page.
        let z = Zswap::new(&cfg, 4);
        z.balance(0, 0, 1, 0, 0);
        z
    }

    /// What a load of `slot` finds: the page's word, or `None` when the pool does not
    /// hold it.
    fn load(z: &Zswap, slot: SlotId) -> Option<u64> {
        let mut page = PageBuf::new();
        match unsafe { z.load(slot, page.as_mut_ptr(), true) } {
            Load::Page => Some(u64::from_ne_bytes(page.as_slice()[..8].try_into().unwrap())),
            Load::NotHere => None,
            other => panic!("a load found {other:?}"),
        }
    }

    /// A reader against the slot's invalidation and its cell's reuse by another slot: the
    /// reader gets the page it stored or learns the pool no longer holds it, never a torn
    /// or foreign page and never a false corruption.
    #[test]
    fn loom_a_reader_never_sees_a_reused_cell() {
        loom::model(|| {
            let z = Arc::new(tier());
            assert!(unsafe { z.store(0, filled(0xa).as_ptr()) });
            let reader = {
                let z = z.clone();
                loom::thread::spawn(move || load(&z, 0))
            };
            z.invalidate(0);
            assert!(unsafe { z.store(1, filled(0xb).as_ptr()) });
            let seen = reader.join().unwrap();
            assert!(matches!(seen, Some(0xa) | None), "read {seen:?}");
            assert_eq!(load(&z, 1), Some(0xb));
        });
    }

    /// Writeback against the slot's owner freeing and storing it again: the owner waits
    /// for a writeback in flight, no cell is freed twice, and the slot ends holding the
    /// owner's new page.
    #[test]
    fn loom_writeback_and_a_rewrite_of_the_same_slot() {
        loom::model(|| {
            let z = Arc::new(tier());
            assert!(unsafe { z.store(0, filled(0xa).as_ptr()) });
            let writeback = {
                let z = z.clone();
                loom::thread::spawn(move || {
                    let started = Instant::now();
                    for victim in z.victims(4, |_| false) {
                        let page = victim.page.as_slice();
                        let word = u64::from_ne_bytes(page[..8].try_into().unwrap());
                        assert!(
                            matches!((victim.slot, word), (0, 0xa | 0xb)),
                            "victim {word:#x}"
                        );
                        victim.written_back(started);
                    }
                })
            };
            z.invalidate(0);
            assert!(unsafe { z.store(0, filled(0xb).as_ptr()) });
            writeback.join().unwrap();
            let held = load(&z, 0);
            let stats = z.stats();
            // The new page is held unless the writeback took it after the store (then the
            // file has it).
            match held {
                Some(word) => {
                    assert_eq!(word, 0xb);
                    assert_eq!(stats.stored_pages, 1);
                }
                None => assert_eq!(stats.stored_pages, 0),
            }
        });
    }

    /// A clean copy (the file holds the page too) dropped by writeback against its owner
    /// rewriting the slot with a dirty page: the owner forgets the file's copy before it
    /// stores, so the dirty page is never dropped as clean; it is held, or written back.
    #[test]
    fn loom_a_clean_drop_never_takes_a_dirty_rewrite() {
        loom::model(|| {
            let z = Arc::new(tier());
            let in_file = Arc::new(loom::sync::atomic::AtomicBool::new(true));
            assert!(unsafe { z.store(0, filled(0xa).as_ptr()) });
            let writeback = {
                let (z, in_file) = (z.clone(), in_file.clone());
                loom::thread::spawn(move || {
                    let victims = z.victims(4, |_| in_file.load(Acquire));
                    let mut wrote = None;
                    for victim in victims {
                        let page = victim.page.as_slice();
                        wrote = Some(u64::from_ne_bytes(page[..8].try_into().unwrap()));
                        victim.written_back(Instant::now());
                    }
                    wrote
                })
            };
            z.invalidate(0);
            in_file.store(false, Release);
            assert!(unsafe { z.store(0, filled(0xb).as_ptr()) });
            let wrote = writeback.join().unwrap();
            let held = load(&z, 0);
            assert!(
                held == Some(0xb) || wrote == Some(0xb),
                "the dirty page was lost: held {held:?}, wrote {wrote:?}"
            );
            assert_ne!(wrote, Some(0xa), "a clean copy is never written");
        });
    }
}
