//! Staging frames: a second anonymous mapping, registered with a userfaultfd of its own,
//! where inactive pages are parked by UFFDIO_MOVE: unmapped from the region but still in
//! memory. One frame per page of the memory limit, handed out from a free list. The
//! mapping is reserved for the largest limit the region can be given (its size), so raising
//! the limit only adds frames to the free list.
//!
//! With `pcp` on, per-CPU lists sit in front of the shared free list, as the page
//! allocator's per-CPU page lists sit in front of its zone free lists: a single frame is
//! freed to, and a small batch taken from, the list of the CPU the thread runs on, without
//! the shared lock. Each list has a lock of its own (seed 004), so a CPU short of frames
//! drains the others directly instead of asking their owners (the kernel's lists were
//! protected by disabling interrupts, which only the owner can do, and drained with IPIs).
//! Lock order: a per-CPU list, then the shared list.
//!
//! A fork may lend frames to its child (`mm/lender.rs`): from its note until the child
//! exists, such a frame is *pinned*, and a release that would free its memory is held
//! back until the fork unpins it ([`FramePins`]), so the child's copy of the staging area
//! has the frame's data even if its page left the frame meanwhile.

use crate::error::Result;
use crate::lockdep::Rank;
use crate::lockstat::{Counted, LockClass, StatMutex};
use crate::mapping::Mapping;
use crate::sync::{zeroed_slice, AtomicU64};
use crate::PAGE_SIZE;
use crossbeam_utils::CachePadded;
use std::sync::atomic::Ordering::SeqCst;
use std::sync::OnceLock;

/// Frames whose memory is freed together (see [`Staging::release_later`]).
const DEFERRED_BATCH: usize = 64;

/// Frames a per-CPU list takes from, or gives back to, the shared list at a time (the
/// kernel's `pcp->batch`), and how many it may hold (`pcp->high`).
const PCP_BATCH: usize = 16;
const PCP_HIGH: usize = 6 * PCP_BATCH;

/// The shared free list: the frames given back (a bitmap, one bit per frame, lowest
/// first) and those never handed out (`fresh`, lowest first). Kept as a range, the fresh
/// frames cost nothing until used: written out, the list was 4 bytes a frame of the memory
/// limit (256 KiB at 256 MiB) written at every process's and fork child's start under
/// `uswap run`; the bitmap is one bit a frame (2 KiB at 64 MiB). A bitmap, not a stack,
/// so that adjacent free frames can be found: a run of adjacent pages moves into a run of
/// adjacent frames with one UFFDIO_MOVE, one TLB flush ([`Staging::alloc_runs`]). It has a
/// bit for every frame there is (grown with the limit), so giving one back never
/// allocates.
struct FreeFrames {
    given_back: Vec<u64>,
    /// Frames set in `given_back`.
    count: usize,
    /// No word below this one has a bit set.
    lowest: usize,
    fresh: std::ops::Range<u32>,
}

impl FreeFrames {
    fn new(frames: u32) -> FreeFrames {
        FreeFrames {
            given_back: vec![0; (frames as usize).div_ceil(64)],
            count: 0,
            lowest: usize::MAX,
            fresh: 0..frames,
        }
    }

    fn len(&self) -> usize {
        self.count + self.fresh.len()
    }

    /// Frames up to `frames` join the list (a raised limit), with a bit each. (The fresh
    /// range always ends at the frame count so far.)
    fn grow(&mut self, frames: u32) {
        self.given_back.resize((frames as usize).div_ceil(64), 0);
        self.fresh.end = frames;
    }

    /// Moves up to `n` frames into `to`: the given back first, lowest first, then fresh
    /// ones.
    fn take_into(&mut self, to: &mut Vec<u32>, n: usize) {
        let from_bitmap = n.min(self.count);
        let mut want = from_bitmap;
        let mut w = self.lowest;
        while want > 0 {
            let word = &mut self.given_back[w];
            while *word != 0 && want > 0 {
                let bit = word.trailing_zeros();
                *word &= *word - 1;
                to.push((w * 64) as u32 + bit);
                want -= 1;
                self.count -= 1;
            }
            if *word == 0 {
                w += 1;
            }
        }
        self.lowest = if self.count == 0 { usize::MAX } else { w };
        let from_fresh = (n - from_bitmap).min(self.fresh.len()) as u32;
        let start = self.fresh.start;
        to.extend(start..start + from_fresh);
        self.fresh.start += from_fresh;
    }

    /// Takes `k` adjacent frames (`2 <= k <= 64`) into `to`, given back ones first (the
    /// lowest run, within a word of the bitmap or across two), then fresh ones; false,
    /// taking nothing, when there are none.
    fn take_run(&mut self, to: &mut Vec<u32>, k: usize) -> bool {
        debug_assert!((2..=64).contains(&k));
        if self.count >= k {
            // Every frame given back is below the fresh range's end.
            let words = (self.fresh.end as usize).div_ceil(64);
            for w in self.lowest..words {
                let word = self.given_back[w];
                let starts = run_starts(word, k);
                let first = if starts != 0 {
                    w * 64 + starts.trailing_zeros() as usize
                } else {
                    // A run across this word's top and the next word's bottom.
                    let top = word.leading_ones() as usize;
                    let next = self
                        .given_back
                        .get(w + 1)
                        .map_or(0, |n| n.trailing_ones() as usize);
                    if top == 0 || top + next < k {
                        continue;
                    }
                    w * 64 + 64 - top
                };
                for frame in first..first + k {
                    self.given_back[frame / 64] &= !(1u64 << (frame % 64));
                }
                self.count -= k;
                to.extend(first as u32..(first + k) as u32);
                self.settle_lowest();
                return true;
            }
        }
        if self.fresh.len() >= k {
            let start = self.fresh.start;
            to.extend(start..start + k as u32);
            self.fresh.start += k as u32;
            return true;
        }
        false
    }

    fn give_back(&mut self, frames: impl IntoIterator<Item = u32>) {
        for frame in frames {
            let (w, bit) = (frame as usize / 64, 1u64 << (frame % 64));
            debug_assert_eq!(self.given_back[w] & bit, 0, "frame {frame} freed twice");
            // Counted once however often it is given back, so the count never runs ahead
            // of the bits (the walker finds a frame both free and held by a page).
            self.count += usize::from(self.given_back[w] & bit == 0);
            self.given_back[w] |= bit;
            self.lowest = self.lowest.min(w);
        }
    }

    /// Moves `lowest` past the words emptied from the bottom.
    fn settle_lowest(&mut self) {
        if self.count == 0 {
            self.lowest = usize::MAX;
            return;
        }
        while self.given_back[self.lowest] == 0 {
            self.lowest += 1;
        }
    }

    fn all(&self) -> impl Iterator<Item = u32> + '_ {
        let given_back = self.given_back.iter().enumerate().flat_map(|(w, &word)| {
            (0..64)
                .filter(move |bit| word & (1u64 << bit) != 0)
                .map(move |bit| (w * 64 + bit) as u32)
        });
        given_back.chain(self.fresh.clone())
    }
}

/// The bits of `word` that start a run of `k` set bits (`1 <= k <= 64`) inside it.
fn run_starts(word: u64, k: usize) -> u64 {
    // `runs` marks the starts of runs of `len` set bits; doubling `len` costs one shift
    // each, then the last step covers what is left of `k`.
    let (mut runs, mut len) = (word, 1);
    while len * 2 <= k {
        runs &= runs >> len;
        len *= 2;
    }
    if len < k {
        runs &= runs >> (k - len);
    }
    runs
}

pub struct Staging {
    map: Mapping,
    free: StatMutex<FreeFrames>,
    /// Per-CPU free lists (empty with `pcp` off), each with room for `PCP_HIGH + 1` frames
    /// so freeing to one never allocates.
    pcp: Box<[CachePadded<StatMutex<Vec<u32>>>]>,
    /// Frames emptied by a copy, waiting to have their memory freed in one batch.
    deferred: StatMutex<Vec<u32>>,
    /// Frames handed to the free list so far (the highest memory limit yet).
    frames: std::sync::atomic::AtomicU32,
    /// Frames lent to a fork child, made by the first fork that lends one.
    pins: OnceLock<FramePins>,
}

/// Frames pinned for a fork, and those released while pinned: one bit per frame in each.
/// The two sides meet with one bit each way, so exactly one of them frees a frame released
/// while pinned: the release, if the frame was unpinned first, else the unpin. Lock-free
/// and allocation-free (the SIGBUS handler releases frames).
pub(crate) struct FramePins {
    pinned: Box<[AtomicU64]>,
    released: Box<[AtomicU64]>,
}

impl FramePins {
    pub(crate) fn new(frames: usize) -> FramePins {
        let words = frames.div_ceil(64);
        FramePins {
            pinned: zeroed_slice(words, || AtomicU64::new(0)),
            released: zeroed_slice(words, || AtomicU64::new(0)),
        }
    }

    fn bit(frame: u32) -> (usize, u64) {
        (frame as usize / 64, 1 << (frame % 64))
    }

    pub(crate) fn pin(&self, frame: u32) {
        let (w, b) = Self::bit(frame);
        self.pinned[w].fetch_or(b, SeqCst);
    }

    /// A release of `frame`: true when it is held back (the unpin frees it), false when
    /// the caller frees it now.
    pub(crate) fn hold_back(&self, frame: u32) -> bool {
        let (w, b) = Self::bit(frame);
        if self.pinned[w].load(SeqCst) & b == 0 {
            return false;
        }
        self.released[w].fetch_or(b, SeqCst);
        if self.pinned[w].load(SeqCst) & b != 0 {
            return true;
        }
        // Unpinned meanwhile: whoever takes the released bit back frees the frame.
        self.released[w].fetch_and(!b, SeqCst) & b == 0
    }

    /// Unpins `frame`: true when a release was held back and the caller frees it now.
    pub(crate) fn unpin(&self, frame: u32) -> bool {
        let (w, b) = Self::bit(frame);
        self.pinned[w].fetch_and(!b, SeqCst);
        self.released[w].fetch_and(!b, SeqCst) & b != 0
    }
}

impl Staging {
    /// `frames` frames now (at most `max_frames`), room for `max_frames`, and a per-CPU
    /// list for each of `cpus` CPUs (0: none).
    pub fn new(frames: u64, max_frames: u64, cpus: usize) -> Result<Self> {
        let frames = frames.min(max_frames);
        let map = Mapping::new(max_frames as usize * PAGE_SIZE)?;
        Ok(Staging {
            map,
            free: StatMutex::new(Rank::Staging, FreeFrames::new(frames as u32)),
            pcp: (0..cpus)
                .map(|_| {
                    CachePadded::new(StatMutex::new(
                        Rank::StagingPcp,
                        Vec::with_capacity(PCP_HIGH + 1),
                    ))
                })
                .collect(),
            deferred: StatMutex::new(Rank::Staging, Vec::with_capacity(DEFERRED_BATCH)),
            frames: (frames as u32).into(),
            pins: OnceLock::new(),
        })
    }

    /// Makes `frames` frames available in all (a raised memory limit); fewer is a no-op.
    pub fn grow(&self, frames: u64) {
        let frames = (frames as u32).min((self.map.len() / PAGE_SIZE) as u32);
        let mut free = self.free_list();
        let have = self.frames.load(std::sync::atomic::Ordering::Relaxed);
        if frames > have {
            free.grow(frames);
            self.frames
                .store(frames, std::sync::atomic::Ordering::Relaxed);
        }
    }

    /// Lets a fork child have the staging area (copy-on-write), or not: only while a fork
    /// lends it frames (`mm/lender.rs`).
    pub fn inherit_on_fork(&self, inherit: bool) {
        self.map
            .inherit_on_fork(0, self.map.len() / PAGE_SIZE, inherit);
    }

    pub fn mapping(&self) -> &Mapping {
        &self.map
    }

    pub fn addr(&self, frame: u32) -> usize {
        self.map.addr() + frame as usize * PAGE_SIZE
    }

    /// Up to `n` frames, in ascending order, so a batch of adjacent pages can often be
    /// moved into them with one UFFDIO_MOVE. A small batch comes from this CPU's list.
    pub fn alloc_many(&self, n: usize) -> Vec<u32> {
        let mut frames = match self.local_list() {
            Some(list) if n <= PCP_BATCH => self.alloc_local(list, n),
            _ => self.alloc_shared(n),
        };
        frames.sort_unstable();
        frames
    }

    /// Frames for pages in runs of adjacent pages (`runs`: the runs' lengths, in order):
    /// the frames in the same order, each run's adjacent where the shared list has such
    /// frames, so the run moves with one UFFDIO_MOVE (one TLB flush, an IPI to every other
    /// CPU running the program: 14 µs a page moved alone against 0.6 in runs of 32 here).
    /// Fewer than asked for when the lists are short.
    pub fn alloc_runs(&self, runs: &[usize]) -> Vec<u32> {
        let n: usize = runs.iter().sum();
        self.make_room(n);
        let mut frames = Vec::with_capacity(n);
        let mut free = self.free_list();
        for &run in runs {
            let mut left = run;
            while left > 0 {
                let k = left.min(64);
                if k == 1 || !free.take_run(&mut frames, k) {
                    free.take_into(&mut frames, k);
                }
                left -= k;
            }
        }
        frames
    }

    /// From a per-CPU list, refilled with a batch from the shared list when short.
    fn alloc_local(&self, list: &StatMutex<Vec<u32>>, n: usize) -> Vec<u32> {
        let mut local = list.lock();
        if local.len() < n {
            let take = PCP_BATCH + n - local.len();
            self.free_list().take_into(&mut local, take);
        }
        if local.len() < n {
            // The shared list is short too: take what the other lists hold.
            drop(local);
            return self.alloc_shared(n);
        }
        let at = local.len() - n;
        local.split_off(at)
    }

    /// From the shared list, made room in first ([`Staging::make_room`]).
    fn alloc_shared(&self, n: usize) -> Vec<u32> {
        self.make_room(n);
        let mut frames = Vec::with_capacity(n);
        self.free_list().take_into(&mut frames, n);
        frames
    }

    /// When the shared list holds fewer than `n` frames, frees the deferred frames and
    /// drains every per-CPU list into it.
    fn make_room(&self, n: usize) {
        if self.free_list().len() < n {
            self.flush_deferred();
            self.drain_pcp();
        }
    }

    /// Moves every per-CPU list's frames to the shared list, locking each list in turn,
    /// whichever CPU owns it.
    fn drain_pcp(&self) {
        for list in self.pcp.iter() {
            let mut local = list.lock();
            if !local.is_empty() {
                self.free_list().give_back(local.drain(..));
            }
        }
    }

    /// Puts a free frame on this CPU's list (giving a batch back to the shared list when it
    /// holds more than `PCP_HIGH`), or on the shared list. Allocates nothing.
    fn free_frame(&self, frame: u32) {
        let Some(list) = self.local_list() else {
            self.free_list().give_back([frame]);
            return;
        };
        let mut local = list.lock();
        local.push(frame);
        if local.len() > PCP_HIGH {
            let at = local.len() - PCP_BATCH;
            self.free_list().give_back(local.drain(at..));
        }
    }

    fn local_list(&self) -> Option<&StatMutex<Vec<u32>>> {
        match self.pcp.len() {
            0 => None,
            n => Some(&self.pcp[crate::cpu::current() % n]),
        }
    }

    /// Returns a frame whose page was moved away (nothing to free).
    pub fn release_empty(&self, frame: u32) {
        self.free_frame(frame);
    }

    /// Returns a frame after freeing its memory, so the next MOVE finds it empty (or,
    /// pinned for a fork, when the fork unpins it). Allocates nothing (the SIGBUS handler
    /// uses it).
    pub fn release(&self, frame: u32) {
        if self.held_back(frame) {
            return;
        }
        self.map.discard(frame as usize, 1);
        self.free_frame(frame);
    }

    fn held_back(&self, frame: u32) -> bool {
        self.pins.get().is_some_and(|p| p.hold_back(frame))
    }

    /// Pins frames a fork lends its child (see [`FramePins`]).
    pub fn pin(&self, frames: &[u32]) {
        let pins = self
            .pins
            .get_or_init(|| FramePins::new(self.map.len() / PAGE_SIZE));
        for &frame in frames {
            pins.pin(frame);
        }
    }

    /// After the fork: unpins frames [`Staging::pin`] pinned, and frees those released
    /// meanwhile.
    pub fn unpin(&self, frames: &[u32]) {
        let Some(pins) = self.pins.get() else {
            return;
        };
        for &frame in frames {
            if pins.unpin(frame) {
                self.release(frame);
            }
        }
    }

    /// Returns a frame whose page was copied away, freeing its memory later, with
    /// [`DEFERRED_BATCH`] others: one MADV_DONTNEED (one TLB flush, an IPI to every CPU
    /// running the process) per run of adjacent frames instead of one per frame. Until then
    /// the frame is on neither list and its stale copy costs memory outside the budget,
    /// about 256 KiB (a little more while threads add frames at once).
    pub fn release_later(&self, frame: u32) {
        let full = {
            let mut deferred = self.deferred.lock();
            deferred.push(frame);
            deferred.len() >= DEFERRED_BATCH
        };
        if full {
            self.flush_deferred();
        }
    }

    /// [`Staging::release_later`] that never allocates, for the SIGBUS handler: the frame
    /// waits for the next batch while the batch has room (reclaim frees the waiting frames
    /// with each batch it evicts, [`Staging::release_all_and_deferred`]), else its memory
    /// is freed now.
    pub fn release_later_in_signal(&self, frame: u32) {
        {
            let mut deferred = self.deferred.lock();
            if deferred.len() < deferred.capacity() {
                deferred.push(frame);
                return;
            }
        }
        self.release(frame);
    }

    /// Frees the memory of the frames [`Staging::release_later`] holds back.
    pub fn flush_deferred(&self) {
        let frames = {
            let mut deferred = self.deferred.lock();
            if deferred.is_empty() {
                return;
            }
            std::mem::replace(&mut *deferred, Vec::with_capacity(DEFERRED_BATCH))
        };
        self.release_all(frames);
    }

    /// [`Staging::release_all`] of `frames` and of the frames waiting to be freed, in the
    /// same call (one flush for both). Called with the page locks of `frames` held, so a
    /// walker, which holds every page lock, never sees the waiting frames in between.
    pub fn release_all_and_deferred(&self, mut frames: Vec<u32>) {
        if !frames.is_empty() {
            frames.append(&mut self.deferred.lock());
        }
        self.release_all(frames);
    }

    /// Frees the memory of many frames, runs of adjacent frames together, in one call
    /// ([`Mapping::discard_runs`]: one TLB flush, an IPI to every CPU running the process,
    /// for the batch), then returns them to the free list.
    pub fn release_all(&self, mut frames: Vec<u32>) {
        frames.retain(|&f| !self.held_back(f));
        frames.sort_unstable();
        let runs: Vec<(usize, usize)> = frames
            .chunk_by(|a, b| a + 1 == *b)
            .map(|run| (run[0] as usize, run.len()))
            .collect();
        self.map.discard_runs(&runs);
        self.free_list().give_back(frames);
    }

    /// The frames on the free lists or waiting to be freed (for the invariant walker).
    pub fn free_frames(&self) -> Vec<u32> {
        let mut frames: Vec<u32> = self.free_list().all().collect();
        frames.extend(self.deferred.lock().iter());
        for list in self.pcp.iter() {
            frames.extend(list.lock().iter());
        }
        frames
    }

    /// All frames, free or holding a page.
    pub fn frames(&self) -> usize {
        self.frames.load(std::sync::atomic::Ordering::Relaxed) as usize
    }

    fn free_list(&self) -> crate::lockstat::StatGuard<'_, FreeFrames> {
        self.free.lock()
    }

    /// The statistics of the shared free-list locks, and of the per-CPU lists' locks.
    pub fn lockstat(&self) -> [LockClass; 2] {
        [
            LockClass::sum("staging", [&self.free as &dyn Counted, &self.deferred]),
            LockClass::sum("staging_pcp", self.pcp.iter().map(|l| &**l)),
        ]
    }
}

#[cfg(all(test, not(loom)))]
mod tests {
    use super::*;

    #[test]
    fn a_frame_pinned_for_a_fork_keeps_its_data_until_it_is_unpinned() {
        let s = Staging::new(8, 8, 0).unwrap();
        let frames = s.alloc_many(3);
        for &f in &frames {
            // SAFETY: a frame of the staging mapping, handed out to this test.
            unsafe { *(s.addr(f) as *mut u8) = 7 };
        }
        s.pin(&frames[..2]);
        s.release(frames[0]);
        s.release_all(vec![frames[1], frames[2]]);
        let read = |f: u32| unsafe { *(s.addr(f) as *const u8) };
        assert_eq!(
            (read(frames[0]), read(frames[1])),
            (7, 7),
            "pinned: data kept"
        );
        assert_eq!(read(frames[2]), 0, "not pinned: freed at once");
        assert_eq!(s.free_frames().len(), 6, "the pinned two are not free yet");
        s.unpin(&frames[..2]);
        assert_eq!(
            (read(frames[0]), read(frames[1])),
            (0, 0),
            "freed by the unpin"
        );
        assert_eq!(s.free_frames().len(), 8);
        // Unpinned and never released: nothing to do, and released at once later.
        s.pin(&[frames[2]]);
        s.unpin(&[frames[2]]);
        assert_eq!(s.free_frames().len(), 8);
    }

    #[test]
    fn frames_released_together_come_back_in_order() {
        let s = Staging::new(8, 8, 0).unwrap();
        let all = s.alloc_many(8);
        assert_eq!(all, (0..8).collect::<Vec<u32>>());
        s.release_all(vec![6, 2, 3, 5, 4]);
        assert_eq!(s.alloc_many(3), vec![2, 3, 4]);
        assert_eq!(s.alloc_many(9), vec![5, 6]);
        assert!(s.alloc_many(1).is_empty());
    }

    #[test]
    fn per_cpu_lists_keep_single_frames_and_are_drained_when_the_shared_list_is_short() {
        let s = Staging::new(64, 64, 2).unwrap();
        let all = s.alloc_many(64);
        assert_eq!(all.len(), 64);
        for &f in &all {
            s.release_empty(f);
        }
        assert_eq!(
            s.free_list().len(),
            0,
            "single frames went to the per-CPU lists"
        );
        assert_eq!(s.free_frames().len(), 64, "and count as free");
        let some = s.alloc_many(3);
        assert!(some.windows(2).all(|w| w[0] < w[1]), "{some:?}");
        let rest = s.alloc_many(100);
        assert_eq!(rest.len(), 61, "a big batch drains every list");
        let s2 = s.lockstat();
        assert_eq!((s2[1].name, s2[1].locks), ("staging_pcp", 2));
    }

    #[test]
    fn frames_given_back_are_reused_before_fresh_ones_lowest_first() {
        let s = Staging::new(8, 16, 0).unwrap();
        assert_eq!(s.alloc_many(3), vec![0, 1, 2]);
        s.release_empty(1);
        assert_eq!(s.alloc_many(3), vec![1, 3, 4]);
        s.grow(10);
        assert_eq!(s.alloc_many(8), vec![5, 6, 7, 8, 9]);
        assert_eq!(s.free_frames(), Vec::<u32>::new());
    }

    #[test]
    fn growth_leaves_room_for_every_frame() {
        let s = Staging::new(100, 1000, 0).unwrap();
        let in_use = s.alloc_many(90);
        s.grow(1000);
        assert!(s.free_list().given_back.len() * 64 >= 1000);
        for f in in_use {
            s.release_empty(f);
        }
        assert_eq!(s.free_frames().len(), 1000);
        let mut all = s.alloc_many(2000);
        all.sort_unstable();
        assert_eq!(all, (0..1000).collect::<Vec<u32>>());
    }

    #[test]
    fn run_starts_marks_exactly_the_starts_of_runs_of_set_bits() {
        let naive = |word: u64, k: usize| -> u64 {
            (0..=64 - k)
                .filter(|&b| (b..b + k).all(|i| word & (1u64 << i) != 0))
                .fold(0, |m, b| m | 1u64 << b)
        };
        let mut x: u64 = 0x9e37_79b9_7f4a_7c15;
        let mut words = vec![
            0,
            !0,
            1,
            1 << 63,
            0xffff_0000_ffff_0000,
            0x7fff_ffff_ffff_fffe,
        ];
        for _ in 0..300 {
            // xorshift, and ANDs of it for denser and sparser words.
            x ^= x << 13;
            x ^= x >> 7;
            x ^= x << 17;
            words.extend([x, x | x >> 3, x & x >> 1]);
        }
        for &w in &words {
            for k in 1..=64 {
                assert_eq!(run_starts(w, k), naive(w, k), "word {w:#x}, k {k}");
            }
        }
    }

    #[test]
    fn runs_of_pages_get_adjacent_frames_after_the_free_list_is_shuffled() {
        let s = Staging::new(256, 256, 0).unwrap();
        let mut all = s.alloc_many(256);
        // Given back one by one in a scattered order, as reclaim and faults free them:
        // a stack handed them out scattered again.
        all.sort_unstable_by_key(|&f| (f * 97) % 256);
        for f in all {
            s.release_empty(f);
        }
        let frames = s.alloc_runs(&[32, 1, 3, 64, 70]);
        assert_eq!(frames.len(), 170);
        let adjacent = |run: &[u32]| run.windows(2).all(|w| w[1] == w[0] + 1);
        assert!(adjacent(&frames[..32]), "{:?}", &frames[..32]);
        assert!(adjacent(&frames[33..36]));
        assert!(adjacent(&frames[36..100]));
        assert!(adjacent(&frames[100..164]) && adjacent(&frames[164..]));
        let mut unique = frames.clone();
        unique.sort_unstable();
        unique.dedup();
        assert_eq!(unique.len(), 170, "no frame handed out twice");
        assert_eq!(s.free_frames().len(), 86);
        // Short: what is left, adjacent or not, and no more.
        let rest = s.alloc_runs(&[64, 64]);
        assert_eq!(rest.len(), 86);
        assert!(s.alloc_runs(&[2]).is_empty());
    }

    #[test]
    fn a_run_across_two_words_of_the_bitmap_is_found() {
        let s = Staging::new(192, 192, 0).unwrap();
        let _all = s.alloc_many(192);
        s.release_all((50..80).chain(100..110).collect());
        assert_eq!(s.alloc_runs(&[30]), (50..80).collect::<Vec<u32>>());
        s.release_all((120..184).collect());
        assert_eq!(s.alloc_runs(&[64]), (120..184).collect::<Vec<u32>>());
        assert_eq!(s.alloc_runs(&[8]), (100..108).collect::<Vec<u32>>());
        assert_eq!(s.free_frames(), vec![108, 109]);
    }

    #[test]
    fn a_run_comes_from_fresh_frames_when_the_given_back_ones_are_scattered() {
        let s = Staging::new(200, 200, 0).unwrap();
        let first = s.alloc_many(100);
        for f in first.iter().filter(|&&f| f % 2 == 0) {
            s.release_empty(*f);
        }
        assert_eq!(s.alloc_runs(&[16]), (100..116).collect::<Vec<u32>>());
        assert_eq!(
            s.alloc_runs(&[1, 1]),
            vec![0, 2],
            "single frames: lowest first"
        );
    }

    #[test]
    fn frames_never_outnumber_the_room_reserved() {
        let s = Staging::new(8, 4, 0).unwrap();
        assert_eq!((s.frames(), s.alloc_many(10).len()), (4, 4));
        s.grow(100);
        assert_eq!(s.frames(), 4, "growth stops at the room reserved");
    }

    #[test]
    fn frames_released_later_are_freed_in_a_batch_or_when_needed() {
        let s = Staging::new(4, 4, 0).unwrap();
        let frames = s.alloc_many(4);
        for &f in &frames {
            // SAFETY: the frame is ours and mapped.
            unsafe { *(s.addr(f) as *mut u8) = 9 };
        }
        s.release_later(frames[1]);
        s.release_later(frames[2]);
        assert_eq!(s.free_frames().len(), 2, "counted as free");
        assert_eq!(
            s.alloc_many(1).len(),
            1,
            "short: the deferred frames are freed first"
        );
        for f in s.alloc_many(4) {
            // SAFETY: as above; their memory was freed.
            assert_eq!(unsafe { *(s.addr(f) as *const u8) }, 0);
        }
    }

    #[test]
    fn frames_released_in_a_signal_wait_for_a_batch_with_room_else_are_freed_at_once() {
        let s = Staging::new(DEFERRED_BATCH as u64 * 2, DEFERRED_BATCH as u64 * 2, 0).unwrap();
        let frames = s.alloc_many(DEFERRED_BATCH * 2);
        for &f in &frames {
            // SAFETY: the frame is ours and mapped.
            unsafe { *(s.addr(f) as *mut u8) = 7 };
        }
        let room = s.deferred.lock().capacity();
        let (waiting, beyond) = frames.split_at(room);
        for &f in waiting {
            s.release_later_in_signal(f);
        }
        assert_eq!(s.deferred.lock().len(), room, "all wait for the batch");
        for &f in waiting {
            // SAFETY: as above; not freed yet.
            assert_eq!(unsafe { *(s.addr(f) as *const u8) }, 7);
        }
        s.release_later_in_signal(beyond[0]);
        let (len, capacity) = {
            let deferred = s.deferred.lock();
            (deferred.len(), deferred.capacity())
        };
        assert_eq!(
            (len, capacity),
            (room, room),
            "a full batch neither grows nor takes the frame"
        );
        // SAFETY: as above; freed at once.
        assert_eq!(unsafe { *(s.addr(beyond[0]) as *const u8) }, 0);
        s.flush_deferred();
        assert!(s.deferred.lock().is_empty());
        for &f in waiting {
            // SAFETY: as above; freed by the flush.
            assert_eq!(unsafe { *(s.addr(f) as *const u8) }, 0);
        }
        assert_eq!(s.free_frames().len(), room + 1);
    }

    #[test]
    fn staging_frames_are_unique_and_come_back_empty() {
        let s = Staging::new(2, 4, 0).unwrap();
        assert_eq!(s.alloc_many(10).len(), 2);
        s.release_all(vec![0, 1]);
        s.grow(4);
        let frames = s.alloc_many(10);
        assert_eq!(frames.len(), 4);
        let f = frames[2];
        // SAFETY: the frame is ours and mapped (not registered with any userfaultfd here).
        unsafe { *(s.addr(f) as *mut u8) = 7 };
        s.release(f);
        assert_eq!(s.alloc_many(1), vec![f]);
        // SAFETY: as above; MADV_DONTNEED made it read as zero.
        assert_eq!(unsafe { *(s.addr(f) as *const u8) }, 0);
        assert!(s.alloc_many(1).is_empty());
    }
}

#[cfg(all(test, loom))]
mod loom_tests {
    //! RUSTFLAGS="--cfg loom" cargo test -p uswap-core --lib --release staging::loom_tests
    use super::*;
    use loom::sync::Arc;

    /// A pinned frame released while the fork unpins it is freed exactly once.
    #[test]
    fn a_frame_released_while_it_is_unpinned_is_freed_once() {
        loom::model(|| {
            let pins = Arc::new(FramePins::new(64));
            pins.pin(5);
            let releaser = {
                let pins = pins.clone();
                loom::thread::spawn(move || !pins.hold_back(5))
            };
            let by_unpin = pins.unpin(5);
            let by_release = releaser.join().unwrap();
            assert_eq!(usize::from(by_unpin) + usize::from(by_release), 1);
            assert!(!pins.hold_back(5), "unpinned: released at once from now on");
        });
    }
}
