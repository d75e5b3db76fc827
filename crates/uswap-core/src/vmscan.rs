//! Reclaim ([mm/vmscan.c]): the resident budget's `charge` with direct reclaim, the
//! background reclaimer (kswapd), aging the active list into the inactive list, and batched
//! write-out of inactive pages. Built on `mm`; the fault path is built on it.

use crate::breakdown::{Laps, Phase};
use crate::config::Watermarks;
use crate::error::{Error, Result};
use crate::lockdep::Rank;
use crate::lockstat::{LockClass, StatMutex};
use crate::lru::LruList;
use crate::mm::Mm;
use crate::page::{Kind, PageLock};
use crate::stats::VmEvent;
use crate::sync::Condvar;
use crate::PAGE_SIZE;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering::Relaxed};
use std::sync::Arc;
use std::time::{Duration, Instant};

/// Direct reclaim gives up after this long without finding a free page.
const OOM_AFTER: Duration = Duration::from_secs(2);

/// Pool pages a reclaim pass that found nothing else writes back at a time: a 64 KiB
/// chunk holds about this many pages at lz4's ratio on sparse data (15:1).
const POOL_SHRINK_PAGES: usize = 256;

/// Most batches moved from the active to the inactive list in one reclaim pass.
const REFILL_BATCHES: usize = 4;

/// With look-around, an aging batch takes this share of its pages from the active tail
/// and fills the rest with their neighbours.
const LOOK_AROUND_SHARE: usize = 4;

/// Wake-up channel of the background reclaimer.
struct Kswapd {
    /// Test hook: the next wake-up panics (`Region::inject_kswapd_panic`).
    inject_panic: AtomicBool,
    pending: AtomicBool,
    lock: StatMutex<()>,
    cv: Condvar,
}

impl Default for Kswapd {
    fn default() -> Kswapd {
        Kswapd {
            inject_panic: AtomicBool::new(false),
            pending: AtomicBool::new(false),
            lock: StatMutex::new(Rank::Kswapd, ()),
            cv: Condvar::new(),
        }
    }
}

impl Kswapd {
    /// Asks kswapd to run; cheap when a wake-up is already pending.
    fn wake(&self) {
        if !self.pending.load(Relaxed) {
            let _g = self.lock.lock();
            self.pending.store(true, Relaxed);
            self.cv.notify_one();
        }
    }

    /// Sleeps until woken (or a periodic check is due).
    fn sleep(&self) {
        let g = self.lock.lock();
        if !self.pending.load(Relaxed) {
            drop(g.wait_with(|g| {
                let waited = self.cv.wait_timeout(g, Duration::from_millis(100));
                waited.unwrap_or_else(|e| e.into_inner()).0
            }));
        }
        self.pending.store(false, Relaxed);
    }
}

/// The watermarks and the inactive target, which follow the memory limit when it changes
/// (`Reclaim::set_limit`): atomics, since every charge reads them.
struct Marks {
    min: AtomicU64,
    low: AtomicU64,
    high: AtomicU64,
    /// Inactive list length reclaim keeps, in pages.
    inactive_target: AtomicU64,
    /// Watermarks the configuration fixed (`None`: scaled to the limit).
    fixed: Option<Watermarks>,
    inactive_percent: u8,
}

impl Marks {
    fn new(limit: u64, fixed: Option<Watermarks>, inactive_percent: u8, batch: usize) -> Marks {
        let m = Marks {
            min: AtomicU64::new(0),
            low: AtomicU64::new(0),
            high: AtomicU64::new(0),
            inactive_target: AtomicU64::new(0),
            fixed,
            inactive_percent,
        };
        m.set_for(limit, batch);
        m
    }

    fn set_for(&self, limit: u64, batch: usize) {
        let w = self.fixed.unwrap_or_else(|| Watermarks::for_limit(limit));
        self.min.store(w.min, Relaxed);
        self.low.store(w.low, Relaxed);
        self.high.store(w.high, Relaxed);
        let target = (limit * u64::from(self.inactive_percent) / 100).max(batch as u64);
        self.inactive_target.store(target, Relaxed);
    }

    fn min(&self) -> u64 {
        self.min.load(Relaxed)
    }

    fn low(&self) -> u64 {
        self.low.load(Relaxed)
    }

    fn high(&self) -> u64 {
        self.high.load(Relaxed)
    }
}

/// Reclaim of one region, over its [`Mm`].
pub(crate) struct Reclaim {
    mm: Mm,
    marks: Marks,
    batch: usize,
    /// Aligned block of pages aging looks around in (`Config::aging_block`).
    aging_block: usize,
    kswapd: Kswapd,
}

fn is_zero_page(addr: usize) -> bool {
    // SAFETY: the caller passes a populated, page-aligned staging frame.
    let words = unsafe { std::slice::from_raw_parts(addr as *const u64, PAGE_SIZE / 8) };
    words.iter().all(|&w| w == 0)
}

impl Reclaim {
    /// `fixed`: watermarks the configuration set (`None`: scaled to the limit).
    pub fn new(
        mm: Mm,
        fixed: Option<Watermarks>,
        inactive_percent: u8,
        batch: usize,
        aging_block: usize,
    ) -> Reclaim {
        let limit = mm.budget().limit();
        let reclaim = Reclaim {
            marks: Marks::new(limit, fixed, inactive_percent, batch),
            mm,
            batch,
            aging_block,
            kswapd: Kswapd::default(),
        };
        // Sets the compressed pool's limit and owner before anything is stored.
        reclaim.balance_ztier(0);
        reclaim
    }

    pub fn mm(&self) -> &Mm {
        &self.mm
    }

    /// The high watermark in pages: kswapd reclaims until this many are free.
    pub fn high_watermark(&self) -> u64 {
        self.marks.high()
    }

    /// Charges up to `want` pages without reclaiming and without taking the free pages
    /// under the low watermark (readahead's charge: speculative pages must not eat the
    /// reserve the faulting page and others need).
    pub fn charge_spare(&self, want: u64) -> u64 {
        let spare = self.mm.budget().free().saturating_sub(self.marks.low());
        match want.min(spare) {
            0 => 0,
            n => self.mm.budget().try_charge(n),
        }
    }

    /// A new memory limit, in pages: the budget, the staging frames and the watermarks
    /// follow it, and kswapd is woken to bring a lowered budget under it.
    pub fn set_limit(&self, pages: u64) {
        self.mm.staging().grow(pages);
        self.marks.set_for(pages, self.batch);
        self.mm.budget().set_limit(pages);
        self.kswapd.wake();
    }

    /// Charges `want` pages (at least one) to the budget, reclaiming directly when the free
    /// pages fall under the min watermark. `None` when nothing could be freed for a while:
    /// memory and swap are both spent (or nothing left can be unmapped).
    /// With `may_back_out`, a charge that makes no progress while vma events are handled
    /// gives up with [`ChargeFailure::EventsPending`]; without, it waits as for memory.
    pub fn charge(&self, want: u64, may_back_out: bool) -> std::result::Result<u64, ChargeFailure> {
        let budget = self.mm.budget();
        let mut deadline = None;
        let mut round = 0u32;
        loop {
            if budget.free() < self.marks.min() {
                // Pages stocked on other CPUs count as used: take them back first.
                budget.drain_stocks();
            }
            if budget.free() < self.marks.min()
                && !(budget.reap_dead_members() && budget.free() >= self.marks.min())
            {
                self.mm.count(VmEvent::direct_reclaim, 1);
                if self.shrink() > 0 {
                    // Reclaim is making progress (a lowered limit being reached, say):
                    // out of memory is only declared when it stops.
                    deadline = None;
                }
            }
            let got = budget.try_charge(want);
            if budget.free() < self.marks.low() {
                self.kswapd.wake();
            }
            if got > 0 {
                return Ok(got);
            }
            if may_back_out && self.mm.mmap_events_held() {
                // Aging cannot move pages out while events are handled, and the handler
                // may be waiting for the page lock this fault holds: back out.
                return Err(ChargeFailure::EventsPending);
            }
            if self.mm.reclaim_paused() {
                // The walker or a fork holds pages for a while: not out of memory.
                deadline = None;
            }
            // Only a charge that has to wait reads the clock.
            let give_up = *deadline.get_or_insert_with(|| Instant::now() + OOM_AFTER);
            if Instant::now() > give_up {
                return Err(ChargeFailure::OutOfMemory);
            }
            round += 1;
            std::thread::sleep(Duration::from_micros(50 * round.min(20) as u64));
        }
    }

    /// A charge that never reclaims, sleeps or allocates (the SIGBUS handler's): `None`
    /// when the free pages are under the min watermark and direct reclaim would be needed.
    pub fn charge_without_reclaim(&self, want: u64) -> Option<u64> {
        let budget = self.mm.budget();
        if budget.free() < self.marks.min() {
            self.kswapd.wake();
            return None;
        }
        let got = budget.try_charge(want);
        if budget.free() < self.marks.low() {
            self.kswapd.wake();
        }
        (got > 0).then_some(got)
    }

    /// One reclaim pass: top the inactive list up from the tail of a mapped list (the
    /// policy's choice, `Workingset::aging_source`; at most a few batches per pass, so a
    /// direct reclaimer is not held long), then reclaim a batch from the inactive tail.
    /// Pages deactivated now sit behind older inactive pages, so they get their second
    /// chance: a touch before they reach the tail promotes them. Returns the pages freed.
    pub fn shrink(&self) -> u64 {
        let (mm, batch) = (&self.mm, self.batch);
        mm.lru().drain_all();
        let target = self.marks.inactive_target.load(Relaxed) as usize;
        let mut isolated = Isolated::new(mm, batch);
        // Aging frees pages itself too: a fork child's borrowed pages it drops.
        let mut freed = 0;
        let mut scanned = 0;
        for _ in 0..REFILL_BATCHES {
            let short = (target + batch).saturating_sub(mm.lru().len(LruList::Inactive));
            if short == 0 {
                break;
            }
            // With look-around a batch is a few pages from the tail and their neighbours:
            // its page locks are held no longer than a batch of single pages would be,
            // and it may take the inactive list past its target by under a batch.
            let victims = if self.aging_block > 1 {
                (batch / LOOK_AROUND_SHARE).max(1)
            } else {
                batch
            };
            // Probation first; if every page there is locked (faults in progress), the
            // active list, so a busy probation list cannot stall aging.
            let mut from = mm.workingset().aging_source(mm.lru());
            mm.lru()
                .isolate(mm.pages(), from, victims.min(short), &mut isolated);
            if isolated.is_empty() && from == LruList::Probation {
                from = LruList::Active;
                mm.lru()
                    .isolate(mm.pages(), from, victims.min(short), &mut isolated);
            }
            scanned += isolated.len();
            let crossed = self.look_around(&mut isolated, from, batch);
            if mm.caps().written_bits {
                self.see_writes(&mut isolated);
            }
            freed += self.deactivate_from(&mut isolated, from, &crossed);
            isolated.clear();
        }
        mm.lru()
            .isolate(mm.pages(), LruList::Inactive, batch, &mut isolated);
        scanned += isolated.len();
        match freed + self.evict(&mut isolated) {
            // The lists held nothing to take (empty, or every page locked): the pool is
            // what is left. A pass that freed nothing because its pages had their second
            // chance leaves the pool alone: the next one frees them.
            0 if scanned == 0 => self.shrink_pool(),
            freed => freed,
        }
    }

    /// Adds to pages isolated from a mapped list their neighbours in the same aligned
    /// block (`aging_block` pages) that are active, on a mapped list (active or probation:
    /// at a random access's steady state a block's mapped pages are spread over both), not
    /// referenced since the last aging and not locked, up to `max` pages in all. A random
    /// batch then moves in runs instead of page by page: UFFDIO_MOVE flushes the TLB once
    /// per run on kernels that batch its flushes (Linux 6.18 here: 0.6 µs a page in runs
    /// of 32, 14 µs alone, with the program's thread on the other CPU), where the kernel's
    /// own reclaim flushes once per batch. The accessed bit that would say which neighbours
    /// are in use is not visible to user space; a neighbour in use comes back with a minor
    /// fault.
    ///
    /// Returns the neighbours taken from the other mapped list than `from`, sorted.
    fn look_around<'t>(
        &'t self,
        isolated: &mut Vec<PageLock<'t>>,
        from: LruList,
        max: usize,
    ) -> Vec<usize> {
        let mut crossed = Vec::new();
        let block = self.aging_block;
        if block <= 1 {
            return crossed;
        }
        let (pages, lru) = (self.mm.pages(), self.mm.lru());
        // Around the pages aging will move: a referenced one goes round again, and so
        // do its neighbours.
        let mut blocks: Vec<usize> = isolated
            .iter()
            .filter(|l| !l.state().referenced())
            .map(|l| l.page() / block)
            .collect();
        blocks.sort_unstable();
        blocks.dedup();
        for b in blocks {
            for page in b * block..((b + 1) * block).min(pages.len()) {
                if isolated.len() >= max {
                    return crossed;
                }
                // The pages already isolated are locked: their try-lock fails.
                let Some(lock) = pages.try_lock(page) else {
                    continue;
                };
                let list = lru.list_of(page);
                if lock.kind() == Kind::Active
                    && !lock.state().referenced()
                    && matches!(list, Some(LruList::Active | LruList::Probation))
                {
                    if list != Some(from) {
                        crossed.push(page);
                    }
                    lru.remove(page);
                    isolated.push(lock);
                }
            }
        }
        crossed
    }

    /// Locks the pages of `range` that are in state `kind` and takes them off their list
    /// (a shared page is on none, and left to the process that pays for it).
    pub fn lock_kind(&self, range: std::ops::Range<usize>, kind: Kind) -> Vec<PageLock<'_>> {
        let locks: Vec<PageLock<'_>> = range
            .map(|p| self.mm.pages().lock(p))
            .filter(|l| l.kind() == kind && !l.state().shared())
            .collect();
        for l in &locks {
            self.mm.lru().remove(l.page());
        }
        locks
    }

    /// Unmaps isolated active pages into staging frames (data kept) and puts them on the
    /// inactive list; a later touch is a minor fault that promotes the page back. Pages that
    /// are adjacent, with adjacent frames, move together: one UFFDIO_MOVE, one TLB flush.
    /// A page that cannot be moved (mlocked or mprotected by the program, pinned by I/O in
    /// flight, or unmapped under us) stays active and is counted.
    pub fn deactivate(&self, locks: &mut [PageLock<'_>], from: LruList) -> u64 {
        self.deactivate_from(locks, from, &[])
    }

    /// [`Reclaim::deactivate`] of pages from list `from` but for `crossed` (sorted), which
    /// came from the other mapped list and go back there if they stay.
    fn deactivate_from(&self, locks: &mut [PageLock<'_>], from: LruList, crossed: &[usize]) -> u64 {
        let mm = &self.mm;
        let mut laps = Laps::new(mm.breakdown(), Instant::now());
        // Pages a system call has pinned (SIGBUS mode) stay as they are; referenced pages
        // go round once more. Both sort last, stay active and go back to the head with the
        // pages that could not move.
        let mut pinned = mm.pins().pinned_among(locks.iter().map(|l| l.page()));
        pinned.sort_unstable();
        locks.sort_unstable_by_key(|l| {
            let is_pinned = pinned.binary_search(&l.page()).is_ok();
            (is_pinned, l.state().referenced(), l.page())
        });
        let movable = locks.len() - pinned.len();
        let mut spared = 0;
        for l in locks[..movable].iter_mut().rev() {
            if !l.second_chance() {
                break;
            }
            spared += 1;
        }
        mm.count(VmEvent::pgreferenced, spared as u64);
        mm.count(VmEvent::pgskip_pinned, pinned.len() as u64);
        // A fork taking its snapshot counts on mapped pages staying mapped: none moves.
        let fence = mm.fork_fence().try_shared();
        let moving = if fence.is_some() { movable - spared } else { 0 };
        let freed = self.move_to_staging(&mut locks[..moving]);
        drop(fence);
        // The pages parked are on the inactive list now, and a lazily freed one found
        // zapped on none. Of those that stayed mapped, the ones that cannot move for a
        // while (mlocked or mprotected, so tried in vain; pinned by a call that may block
        // for ever) go to the active list, where aging comes back to them last: on
        // probation they would hold aging there, and a probation list of pinned pages
        // alone once left reclaim freeing nothing until the program was out of memory.
        // The rest (referenced, or all while a fork held its fence) go back to the list
        // they came from: `from`, or the other mapped list for a neighbour look-around
        // took from there.
        let mapped = |l: &&PageLock<'_>| LruList::Active.holds(l.kind());
        let (tried, untried) = locks.split_at(moving);
        let (spared, held) = untried.split_at(untried.len() - pinned.len());
        let stuck = tried.iter().chain(held).filter(mapped).map(|l| l.page());
        mm.lru().add(LruList::Active, stuck);
        let (crossed_back, back): (Vec<usize>, Vec<usize>) = spared
            .iter()
            .filter(mapped)
            .map(|l| l.page())
            .partition(|p| crossed.binary_search(p).is_ok());
        mm.lru().add(from, back);
        let other = match from {
            LruList::Probation => LruList::Active,
            _ => LruList::Probation,
        };
        mm.lru().add(other, crossed_back);
        laps.lap(Phase::Deactivate);
        freed
    }

    /// Reads the written bits of the isolated active pages that aging write-protected
    /// before (armed): one written since stays mapped this time (referenced), as the
    /// kernel's accessed bit keeps a page in use, without the minor fault that unmapping it
    /// would cost at its next touch. Pages going round anyway (referenced by a fault) are
    /// protected now, so that their next look counts; the others are unmapped unread,
    /// since a page just mapped reads as written after the access that faulted it in.
    /// One scan per run of neighbouring pages.
    fn see_writes(&self, locks: &mut [PageLock<'_>]) {
        let mm = &self.mm;
        let looked_at = |l: &PageLock<'_>| {
            l.kind() == Kind::Active && (l.state().armed() || l.state().referenced())
        };
        let mut pages: Vec<usize> = locks
            .iter()
            .filter(|l| looked_at(l))
            .map(|l| l.page())
            .collect();
        if pages.is_empty() {
            return;
        }
        pages.sort_unstable();
        let mut written = Vec::new();
        let mut unread = Vec::new();
        for run in pages.chunk_by(|a, b| a + 1 == *b) {
            if !mm.take_written(run[0], run.len(), &mut written) {
                // Nothing seen: these pages are aged this time as without written bits.
                unread.extend_from_slice(run);
                mm.count(VmEvent::written_scan_failed, 1);
            }
        }
        written.sort_unstable();
        let mut seen = 0;
        let read = |l: &PageLock<'_>| looked_at(l) && unread.binary_search(&l.page()).is_err();
        for l in locks.iter_mut().filter(|l| read(l)) {
            let was_written = l.state().armed() && written.binary_search(&l.page()).is_ok();
            seen += u64::from(was_written && !l.state().referenced());
            l.armed_after(was_written);
        }
        mm.count(VmEvent::pgreferenced_written, seen);
    }

    /// Moves active pages (sorted by page) into staging frames, runs of neighbours with
    /// adjacent frames in one UFFDIO_MOVE; a lazily freed page found zapped is freed instead,
    /// and a page a fork relative still maps is made this process's own copy first.
    /// Returns the pages freed: borrowed pages dropped ([`Mm::parked`]).
    fn move_to_staging(&self, locks: &mut [PageLock<'_>]) -> u64 {
        let mm = &self.mm;
        let runs: Vec<usize> = locks
            .chunk_by(|a, b| a.page() + 1 == b.page())
            .map(<[_]>::len)
            .collect();
        let frames = mm.staging().alloc_runs(&runs);
        // The frame each page moved into, parked together at the end (one list add).
        let mut moved_to = vec![None; locks.len()];
        let mut start = 0;
        // After a run that stopped at its first page, that page is tried alone: a run
        // spanning two mappings (the program changed the protection of part of the
        // region) fails whole, where its pages one by one may move.
        let mut alone = false;
        // The page last copied for being shared: tried once more, alone, then left.
        let mut copied = None;
        let mut again = false;
        while start < frames.len() {
            let mut end = start + 1;
            while !alone
                && end < frames.len()
                && locks[end].page() == locks[end - 1].page() + 1
                && frames[end] == frames[end - 1] + 1
            {
                end += 1;
            }
            alone = false;
            let (dst, src) = (
                mm.staging().addr(frames[start]),
                mm.page_addr(locks[start].page()),
            );
            let moved =
                match mm
                    .staging_uffd()
                    .move_pages(dst, src, (end - start) * PAGE_SIZE, false)
                {
                    Ok(()) => end - start,
                    Err(partial) if partial.done == 0 && end - start > 1 => {
                        alone = true;
                        continue;
                    }
                    Err(partial) => {
                        let stuck = &mut locks[start + partial.done / PAGE_SIZE];
                        match partial.error.raw_os_error() {
                            Some(libc::EINVAL) => {
                                mm.count(VmEvent::pgskip_unmovable, 1);
                            }
                            // Nothing mapped: the kernel zapped the lazily freed page.
                            Some(libc::ENOENT) if stuck.kind() == Kind::Lazyfree => {
                                mm.lazyfree_zapped(stuck);
                            }
                            Some(libc::EBUSY)
                                if copied != Some(stuck.page()) && self.break_cow(stuck) =>
                            {
                                copied = Some(stuck.page());
                                again = true;
                            }
                            _ => {}
                        }
                        partial.done / PAGE_SIZE
                    }
                };
            for i in start..start + moved {
                moved_to[i] = Some(frames[i]);
            }
            if std::mem::take(&mut again) {
                // Its own copy now: once more, alone, into the frame it had.
                start += moved;
                alone = true;
                continue;
            }
            if start + moved < end {
                mm.staging().release_empty(frames[start + moved]);
                start += moved + 1;
            } else {
                start = end;
            }
        }
        mm.parked(locks, &moved_to)
    }

    /// Makes a mapped page that a fork relative maps too (UFFDIO_MOVE refused it: EBUSY)
    /// this process's own copy, so it can move: the kernel's copy-on-write, asked for with
    /// MADV_POPULATE_WRITE (data unchanged; a racing write by the program lands in one copy
    /// or the other, as it would in a fork). A clean page gives up its slot and its write
    /// protection first: the fault would otherwise come to uswap, whose handler waits for
    /// this page's lock. False when the page is not mapped, or cannot be copied.
    ///
    /// Inside the fill gate: a discard's zap cannot land between the look at the page and
    /// the fault, which would then be a missing fault waiting for this page's lock.
    fn break_cow(&self, lock: &mut PageLock<'_>) -> bool {
        let mm = &self.mm;
        let addr = mm.page_addr(lock.page());
        let Some(_pass) = mm.fill_gate().enter_fill() else {
            return false;
        };
        let Some(entry) = mm.pagemap_entry(lock.page()) else {
            return false;
        };
        // A lazily freed page may be dropped by the kernel at any moment: the fault below
        // would then be a missing fault, waiting for this page's lock.
        if !entry.present || lock.state().shared() || lock.kind() == Kind::Lazyfree {
            return false;
        }
        if mm.write_stops_at(entry) {
            mm.forget_slot(lock);
            if mm.uffd().write_protect(addr, PAGE_SIZE, false).is_err() {
                return false;
            }
        }
        // SAFETY: one page of the region, which this thread holds locked; the advice
        // changes no data.
        let rc = unsafe { libc::madvise(addr as *mut _, PAGE_SIZE, libc::MADV_POPULATE_WRITE) };
        if rc != 0 {
            return false;
        }
        mm.count(VmEvent::cow_reclaim, 1);
        true
    }

    /// Reclaims isolated inactive pages: all-zero pages are forgotten, clean pages with a
    /// valid swap copy are dropped, dirty pages are written out in one batch. Pages that
    /// cannot be written (swap full, I/O error) stay in memory on the inactive list.
    pub fn evict(&self, locks: &mut [PageLock<'_>]) -> u64 {
        let mm = &self.mm;
        mm.count(VmEvent::pgscan, locks.len() as u64);
        let mut freed_frames = Vec::with_capacity(locks.len());
        let mut writes = Vec::new();
        for (i, lock) in locks.iter_mut().enumerate() {
            let st = lock.state();
            let frame = st.frame().expect("an inactive page has a staging frame");
            if is_zero_page(mm.staging().addr(frame)) {
                freed_frames.push(mm.dropped_zero(lock));
            } else if let Some(slot) = st.slot() {
                // SAFETY: the page's populated staging frame, held by its page lock.
                unsafe {
                    mm.swap()
                        .keep_clean(slot, mm.staging().addr(frame) as *const u8)
                };
                freed_frames.push(mm.dropped_clean(lock));
            } else if let Some(slot) = mm.swap().alloc_slot() {
                writes.push((i, slot));
            } else {
                mm.count(VmEvent::swap_full, 1);
            }
        }
        let mut laps = Laps::new(mm.breakdown(), Instant::now());
        self.write_out(locks, &writes, &mut freed_frames);
        if !writes.is_empty() {
            laps.lap(Phase::WriteOut);
        }
        let freed = mm.reclaimed(freed_frames);
        self.balance_ztier(freed);
        laps.lap(Phase::FrameRelease);
        let still_inactive = locks
            .iter()
            .filter(|l| l.kind() == Kind::Inactive)
            .map(|l| l.page());
        mm.lru().add(LruList::Inactive, still_inactive);
        freed
    }

    /// Charges the compressed pool's growth to the budget and takes off what it gave back,
    /// as a cgroup charges zswap's pool, so resident pages and pool together stay under
    /// the limit; the pool's size follows the limit. A pool over its size (the limit went
    /// down, or this batch had no dirty page to write its oldest pages out with) writes
    /// some back first. `evicted`: the pages this batch freed (an `auto` pool's size
    /// weighs them).
    fn balance_ztier(&self, evicted: u64) {
        let (mm, swap) = (&self.mm, self.mm.swap());
        swap.ztier_writeback(self.batch);
        let page = PAGE_SIZE as u64;
        let (limit, others) = (mm.budget().limit(), mm.budget().held_by_others());
        match swap.ztier_balance(limit * page, others * page, mm.id(), evicted) {
            0 => {}
            pages => mm.charge_pool(pages),
        }
    }

    /// Reclaim found nothing on the LRU lists: the compressed pool's oldest pages go to
    /// the file whatever its size, until the chunks they empty give some memory back (a
    /// chunk of same-filled pages holds thousands). Returns the pages the pool gave
    /// back. Without it a process whose share of a limit its tree shares is all pool (the
    /// others hold the rest) could free nothing, and would wait for the others' kswapd,
    /// or be out of memory.
    fn shrink_pool(&self) -> u64 {
        let mm = &self.mm;
        let before = mm.pool_charged();
        if before == 0 {
            return 0;
        }
        loop {
            let left = mm.swap().ztier_shrink(POOL_SHRINK_PAGES);
            self.balance_ztier(0);
            if left == 0 || mm.pool_charged() < before {
                return before.saturating_sub(mm.pool_charged());
            }
        }
    }

    /// Writes dirty inactive pages straight from their staging frames, as one batch; the
    /// frames of the pages written go to `freed`.
    fn write_out(&self, locks: &mut [PageLock<'_>], writes: &[(usize, u32)], freed: &mut Vec<u32>) {
        if writes.is_empty() {
            return;
        }
        let mm = &self.mm;
        // Pages under write-back are in the swap cache, as in the kernel: a readahead of
        // their slot finds them there instead of reading a slot not written yet.
        let batch: Vec<(u32, *const u8)> = writes
            .iter()
            .map(|&(i, slot)| {
                let page = locks[i].page();
                mm.own_slot(slot, page);
                mm.swap().cache().add(slot, mm.cache_entry(page, false));
                let frame = locks[i].state().frame().expect("inactive page has a frame");
                (slot, mm.staging().addr(frame) as *const u8)
            })
            .collect();
        // SAFETY: each source is a populated staging frame, held by its page lock.
        let results = unsafe { mm.swap().write_pages(&batch) };
        for (&(i, slot), result) in writes.iter().zip(results) {
            match result {
                Ok(()) => freed.push(mm.swapped_out(&mut locks[i], slot)),
                Err(e) => {
                    mm.swap().cache().delete(slot);
                    mm.swap().free_slot(slot);
                    if mm.count(VmEvent::io_errors, 1) == 0 {
                        eprintln!("uswap: swap write to slot {slot} failed: {e}; the page stays in memory");
                    }
                }
            }
        }
    }
}

/// Pages a reclaim pass has taken off the LRU lists, locked. Should the pass panic (kswapd
/// is supervised and starts again: `signals::supervise`), unwinding puts each page still
/// off its list back on the list its state says before its lock is released, so no page
/// is lost to reclaim for good. (A panic inside `move_to_staging`, between pages' moves
/// and their parking at the end of the batch, leaves those pages' words active while
/// their data sits in frames: their next access fails loudly as a page lost, never
/// silently.)
struct Isolated<'t> {
    mm: &'t Mm,
    locks: Vec<PageLock<'t>>,
}

impl<'t> Isolated<'t> {
    fn new(mm: &'t Mm, capacity: usize) -> Isolated<'t> {
        Isolated {
            mm,
            locks: Vec::with_capacity(capacity),
        }
    }
}

impl<'t> std::ops::Deref for Isolated<'t> {
    type Target = Vec<PageLock<'t>>;
    fn deref(&self) -> &Vec<PageLock<'t>> {
        &self.locks
    }
}

impl std::ops::DerefMut for Isolated<'_> {
    fn deref_mut(&mut self) -> &mut Self::Target {
        &mut self.locks
    }
}

impl Drop for Isolated<'_> {
    fn drop(&mut self) {
        if !std::thread::panicking() {
            return;
        }
        let lru = self.mm.lru();
        for list in [LruList::Active, LruList::Inactive] {
            let off = self.locks.iter().filter(|l| {
                let page = l.page();
                list.holds(l.kind()) && lru.list_of(page).is_none() && !lru.is_pending(page)
            });
            lru.add(list, off.map(|l| l.page()));
        }
    }
}

/// Why [`Reclaim::charge`] got nothing.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum ChargeFailure {
    /// Reclaim made no progress for `OOM_AFTER`: memory and swap are spent.
    OutOfMemory,
    /// Vma events are being handled; the fault backs out (its page lock released) and
    /// retries after them.
    EventsPending,
}

/// Starts kswapd for the reclaim that `owner` holds (`reclaim` finds it).
pub(crate) fn spawn_kswapd<T: Send + Sync + 'static>(
    owner: Arc<T>,
    reclaim: fn(&T) -> &Reclaim,
    after_balancing: fn(&T),
) -> Result<std::thread::JoinHandle<()>> {
    let supervised = move || {
        let r = reclaim(&owner);
        let panicked = || {
            r.mm.count(VmEvent::handler_panics, 1);
        };
        let balanced = || after_balancing(&owner);
        crate::signals::supervise("kswapd", || kswapd(r, balanced), panicked);
    };
    crate::signals::spawn_quiet("uswap-kswapd", supervised).map_err(|source| Error::Os {
        op: "spawn kswapd",
        source,
    })
}

impl Reclaim {
    /// The statistics of kswapd's wake-up lock (`kswapd`).
    pub fn lockstat(&self) -> LockClass {
        LockClass::sum("kswapd", [&self.kswapd.lock])
    }

    /// Test hook: kswapd's next wake-up panics, as a bug would.
    pub fn inject_kswapd_panic(&self) {
        self.kswapd.inject_panic.store(true, Relaxed);
    }

    /// Stops kswapd at its next look (the caller joins it).
    pub fn stop_kswapd(&self) {
        self.mm.shut_down();
        self.kswapd.wake();
    }
}

/// Balances the region: whenever free pages drop under the low watermark, reclaim until
/// they reach the high one, then calls `balanced`.
fn kswapd(r: &Reclaim, balanced: impl Fn()) {
    let budget = r.mm.budget();
    let mut shared_looked = Instant::now();
    while !r.mm.shutting_down() {
        r.kswapd.sleep();
        // Slots held for fork children whose families are done become free.
        r.mm.swap().reap_forks();
        if r.mm.shared_pages() > 0 && shared_looked.elapsed() >= SHARED_LOOK_EVERY {
            r.claim_unshared();
            shared_looked = Instant::now();
        }
        if r.mm.shutting_down() || budget.free() >= r.marks.low() {
            continue;
        }
        if budget.reap_dead_members() && budget.free() >= r.marks.low() {
            continue;
        }
        r.mm.count(VmEvent::kswapd_wake, 1);
        if r.kswapd.inject_panic.swap(false, Relaxed) {
            panic!("injected kswapd panic (test hook)");
        }
        budget.drain_stocks();
        while budget.free() < r.marks.high() && !r.mm.shutting_down() {
            if r.shrink() == 0 {
                // Nothing reclaimable right now (all pages busy, or swap full): back off.
                std::thread::sleep(Duration::from_millis(1));
                break;
            }
        }
        balanced();
    }
}

/// How often kswapd looks for shared pages the other process no longer maps.
const SHARED_LOOK_EVERY: Duration = Duration::from_secs(1);

impl Reclaim {
    /// Shared pages (a fork's, `PageState::shared`) that this process now maps alone (the
    /// other process wrote to its copy, reclaimed it, unmapped it or exited) become its
    /// own: charged, on the active list, as a cgroup charges the page left to the process
    /// still using it. Reclaim then brings the budget back under the limit.
    fn claim_unshared(&self) {
        let mm = &self.mm;
        let pages = mm.pages();
        const N: usize = 64;
        let mut entries = [Default::default(); N];
        let chunks = pages.used_runs().into_iter().flat_map(|run| {
            run.clone()
                .step_by(N)
                .map(move |first| first..(first + N).min(run.end))
        });
        for chunk in chunks {
            let n = chunk.len();
            if !chunk.clone().any(|p| pages.peek(p).0.shared()) {
                continue;
            }
            if !mm.pagemap_entries(chunk.start, &mut entries[..n]) {
                return;
            }
            for (page, entry) in chunk.zip(&entries[..n]) {
                if !(entry.present && entry.exclusive) {
                    continue;
                }
                let Some(mut lock) = pages.try_lock(page) else {
                    continue;
                };
                if lock.state().shared() {
                    mm.budget().overdraw(1);
                    mm.unshared(&mut lock, VmEvent::cow_alone);
                }
            }
        }
    }
}

/// Aging and reclaim called directly on locked pages of a real region: where each page
/// goes, what it keeps, and that its data comes back intact. No root needed (see
/// `uffd.rs`).
#[cfg(all(test, not(loom)))]
mod tests {
    use super::*;
    use crate::config::{LruPolicy, References};
    use crate::region::{testing, Advice, Region};

    fn count(mm: &Mm, event: VmEvent) -> u64 {
        mm.vmstat().get(event)
    }

    #[test]
    fn aged_pages_are_parked_then_written_out_and_come_back_intact() {
        let region = testing::region(64, 64, |_| {});
        let (mm, reclaim) = (region.mm(), region.fault_path().reclaim());
        let resident = mm.budget().resident();
        let mut locks = reclaim.lock_kind(0..8, Kind::Active);
        assert_eq!(locks.len(), 8);
        reclaim.deactivate(&mut locks, LruList::Active);
        assert!(locks.iter().all(|l| l.kind() == Kind::Inactive));
        drop(locks);
        assert_eq!(count(mm, VmEvent::pgdeactivate), 8);
        assert_eq!(mm.lru().list_of(3), Some(LruList::Inactive));
        assert!(!mm.pagemap_entry(3).unwrap().present, "unmapped, data kept");
        let mut locks = reclaim.lock_kind(0..8, Kind::Inactive);
        assert_eq!(reclaim.evict(&mut locks), 8);
        assert!(locks.iter().all(|l| l.kind() == Kind::Swapped));
        drop(locks);
        assert_eq!(count(mm, VmEvent::pswpout), 8);
        assert_eq!(mm.slots_held(), 8);
        assert_eq!(mm.resident(), resident - 8);
        region.check_invariants().unwrap();
        for page in 0..8 {
            assert_eq!(testing::read(&region, page), page as u8 + 1);
        }
    }

    /// A region of 64 pages with 0..32 on the active list (as if touched again) and
    /// 32..64 on probation. (The handler thread lists the last fault's pages after the
    /// fill has woken the writer: wait for them.)
    fn region_with_pages_on_probation() -> Region {
        let region = testing::region(64, 64, |cfg| cfg.lru_policy = LruPolicy::S3fifo);
        let (mm, reclaim) = (region.mm(), region.fault_path().reclaim());
        let locks = reclaim.lock_kind(0..32, Kind::Active);
        mm.lru()
            .add(LruList::Active, locks.iter().map(|l| l.page()));
        drop(locks);
        let deadline = Instant::now() + Duration::from_secs(5);
        while mm.lru().len(LruList::Probation) < 32 && Instant::now() < deadline {
            std::thread::sleep(Duration::from_millis(1));
            mm.lru().drain_all();
        }
        assert_eq!(mm.lru().len(LruList::Probation), 32);
        region
    }

    /// Aging passes over a region from [`region_with_pages_on_probation`] whose probation
    /// pages cannot move: it goes on to the active list, and the stuck pages leave
    /// probation.
    fn aging_gets_past_stuck_probation(region: &Region) {
        let (mm, reclaim) = (region.mm(), region.fault_path().reclaim());
        for _ in 0..4 {
            reclaim.shrink();
        }
        let parked = (0..32).filter(|&p| mm.pages().peek(p).0.kind() != Kind::Active);
        assert!(parked.count() > 0, "aging reached the active list");
        assert_eq!(
            mm.lru().len(LruList::Probation),
            0,
            "the stuck pages left it"
        );
    }

    fn every_page_intact(region: &Region) {
        region.check_invariants().unwrap();
        for page in 0..64 {
            assert_eq!(testing::read(region, page), page as u8 + 1);
        }
    }

    /// A probation list of pages that cannot move (the program made them read-only, as
    /// a JVM or node does with parts of its heap) must not hold aging there: they go to
    /// the active list, and aging goes on to pages that can move.
    #[test]
    fn probation_pages_that_cannot_move_do_not_hold_aging_there() {
        let region = region_with_pages_on_probation();
        let ro = testing::byte_at(&region, 32).cast();
        // SAFETY: pages of the region, made readable only, then writable again below.
        assert_eq!(
            unsafe { libc::mprotect(ro, 32 * PAGE_SIZE, libc::PROT_READ) },
            0
        );
        aging_gets_past_stuck_probation(&region);
        assert!(count(region.mm(), VmEvent::pgskip_unmovable) >= 32);
        // SAFETY: as above.
        let rw = libc::PROT_READ | libc::PROT_WRITE;
        assert_eq!(unsafe { libc::mprotect(ro, 32 * PAGE_SIZE, rw) }, 0);
        every_page_intact(&region);
    }

    /// The same for pages a system call has pinned (SIGBUS mode: a `read(2)` blocked on
    /// an empty pipe holds its buffer's pages for as long as it waits). Once, pinned pages
    /// went back to probation, so a probation list of them alone held aging there and
    /// reclaim freed nothing until the program's next fault was declared out of memory.
    #[test]
    fn probation_pages_pinned_by_a_blocked_call_do_not_hold_aging_there() {
        let region = region_with_pages_on_probation();
        let pin = region.mm().pins().pin(32..64);
        aging_gets_past_stuck_probation(&region);
        assert!(count(region.mm(), VmEvent::pgskip_pinned) >= 32);
        assert!((32..64).all(|p| region.mm().pages().peek(p).0.kind() == Kind::Active));
        region.mm().pins().unpin(pin);
        every_page_intact(&region);
    }

    #[test]
    fn reclaim_forgets_zero_pages_and_drops_clean_ones_without_writing() {
        let region = testing::region(64, 64, |_| {});
        let (mm, reclaim) = (region.mm(), region.fault_path().reclaim());
        // SAFETY: inside the region.
        unsafe { testing::byte_at(&region, 0).write_volatile(0) };
        region
            .advise(PAGE_SIZE, PAGE_SIZE, Advice::PageOut)
            .unwrap();
        assert_eq!(testing::read(&region, 1), 2, "back in, clean");
        mm.lru().drain_all();
        let written = count(mm, VmEvent::pswpout);
        let clean_slot = mm.pages().peek(1).0.slot();
        let mut locks = reclaim.lock_kind(0..2, Kind::Active);
        reclaim.deactivate(&mut locks, LruList::Active);
        drop(locks);
        let mut locks = reclaim.lock_kind(0..2, Kind::Inactive);
        assert_eq!(reclaim.evict(&mut locks), 2);
        drop(locks);
        assert_eq!(mm.pages().peek(0).0.kind(), Kind::None);
        let clean = mm.pages().peek(1).0;
        assert_eq!(clean.kind(), Kind::Swapped);
        if mm.caps().write_protect {
            assert_eq!(clean.slot(), clean_slot, "its swap copy was still good");
            assert_eq!(count(mm, VmEvent::pgclean_dropped), 1);
            assert_eq!(count(mm, VmEvent::pswpout), written);
        }
        assert_eq!(count(mm, VmEvent::pgzero_dropped), 1);
        region.check_invariants().unwrap();
        assert_eq!(testing::read(&region, 0), 0);
        assert_eq!(testing::read(&region, 1), 2);
    }

    #[test]
    fn the_pages_a_panicking_reclaim_pass_held_go_back_on_their_lists() {
        let region = testing::region(64, 64, |_| {});
        let mm = region.mm();
        region.advise(0, 4 * PAGE_SIZE, Advice::Cold).unwrap();
        mm.lru().drain_all();
        let mut held = 0;
        let pass = std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| {
            let mut isolated = Isolated::new(mm, 12);
            let mapped = mm.workingset().aging_source(mm.lru());
            mm.lru().isolate(mm.pages(), mapped, 8, &mut isolated);
            mm.lru()
                .isolate(mm.pages(), LruList::Inactive, 4, &mut isolated);
            held = isolated.len();
            panic!("injected mid-pass (test)");
        }));
        assert!(pass.is_err());
        assert_eq!(held, 12, "the pass held mapped and inactive pages");
        assert_eq!(mm.lru().list_of(0), Some(LruList::Inactive));
        // Every page in memory is on its list again.
        region.check_invariants().unwrap();
    }

    /// With written bits, aging reads whether a page it protected was written since: a page
    /// written stays mapped, and its next touch is no fault; one only read, or untouched,
    /// is unmapped. A page just mapped is not read (it shows the access that faulted it
    /// in) unless it came back for a read, mapped protected.
    #[test]
    fn with_written_bits_aging_keeps_pages_written_since_it_looked() {
        let region = testing::region(64, 64, |cfg| cfg.references = References::Written);
        let (mm, reclaim) = (region.mm(), region.fault_path().reclaim());
        assert_eq!(region.references(), References::Written);
        let age = |pages: std::ops::Range<usize>| {
            mm.lru().drain_all();
            let mut locks = reclaim.lock_kind(pages, Kind::Active);
            reclaim.see_writes(&mut locks);
            reclaim.deactivate(&mut locks, LruList::Active);
            locks.sort_unstable_by_key(|l| l.page());
            locks.iter().map(|l| l.kind()).collect::<Vec<_>>()
        };
        let write = |page: usize, value: u8| {
            // SAFETY: inside the region.
            unsafe { testing::byte_at(&region, page).write_volatile(value) }
        };
        // Written when first touched: unmapped unread, as without written bits.
        assert_eq!(age(0..4), [Kind::Inactive; 4]);
        assert_eq!(count(mm, VmEvent::pgreferenced_written), 0);
        // A minor fault brings each back referenced: passed over once, and protected (page
        // 0, written meanwhile, again).
        for page in 0..4 {
            assert_eq!(testing::read(&region, page), page as u8 + 1);
        }
        write(0, 1);
        assert!(!mm.pagemap_entry(0).unwrap().write_protected);
        assert_eq!(age(0..4), [Kind::Active; 4]);
        assert!((0..4).all(|p| mm.pages().peek(p).0.armed()));
        assert!(mm.pagemap_entry(0).unwrap().write_protected);
        // Now 0 and 1 are written, 2 only read, 3 untouched.
        write(0, 100);
        write(1, 101);
        assert_eq!(testing::read(&region, 2), 3);
        assert!(
            !mm.pagemap_entry(0).unwrap().write_protected,
            "the kernel let it write"
        );
        let faults = count(mm, VmEvent::pgfault);
        assert_eq!(
            age(0..4),
            [Kind::Active, Kind::Active, Kind::Inactive, Kind::Inactive]
        );
        assert_eq!(count(mm, VmEvent::pgreferenced_written), 2);
        assert!(
            mm.pagemap_entry(1).unwrap().write_protected,
            "protected again"
        );
        write(1, 111);
        assert_eq!(
            count(mm, VmEvent::pgfault),
            faults,
            "no fault came to uswap"
        );
        // Swapped out, then back for a read: armed at once. For a write: not.
        let mut locks = reclaim.lock_kind(2..4, Kind::Inactive);
        assert_eq!(reclaim.evict(&mut locks), 2);
        drop(locks);
        assert_eq!(testing::read(&region, 2), 3);
        write(3, 104);
        assert_eq!(mm.pages().peek(2).0.kind(), Kind::Active);
        assert!(mm.pages().peek(2).0.armed(), "swapped in for a read");
        assert!(!mm.pages().peek(3).0.armed(), "swapped in for a write");
        // What the program advises goes by what it says: a written page pages out.
        write(1, 112);
        region
            .advise(PAGE_SIZE, PAGE_SIZE, Advice::PageOut)
            .unwrap();
        assert_eq!(mm.pages().peek(1).0.kind(), Kind::Swapped);
        region.check_invariants().unwrap();
        let want = [100, 112, 3, 104];
        for (page, want) in want.into_iter().enumerate() {
            assert_eq!(testing::read(&region, page), want);
        }
        for page in 4..64 {
            assert_eq!(testing::read(&region, page), page as u8 + 1);
        }
    }

    #[test]
    fn a_page_touched_while_inactive_stays_active_once_more() {
        let region = testing::region(64, 64, |_| {});
        let (mm, reclaim) = (region.mm(), region.fault_path().reclaim());
        region
            .advise(2 * PAGE_SIZE, PAGE_SIZE, Advice::Cold)
            .unwrap();
        assert_eq!(testing::read(&region, 2), 3, "promoted, referenced");
        mm.lru().drain_all();
        let mut locks = reclaim.lock_kind(2..3, Kind::Active);
        reclaim.deactivate(&mut locks, LruList::Active);
        assert_eq!(locks[0].kind(), Kind::Active);
        assert!(!locks[0].state().referenced(), "its second chance is spent");
        drop(locks);
        assert_eq!(count(mm, VmEvent::pgreferenced), 1);
        assert_eq!(mm.lru().list_of(2), Some(LruList::Active));
        let mut locks = reclaim.lock_kind(2..3, Kind::Active);
        reclaim.deactivate(&mut locks, LruList::Active);
        assert_eq!(locks[0].kind(), Kind::Inactive);
        drop(locks);
        region.check_invariants().unwrap();
    }

    /// A region of 1,024 pages under a limit of 256 pages shared with other processes of
    /// a tree (a group file in the returned directory), with `change` made to its
    /// configuration. No per-CPU stock: its refills ask for more than is free, and reap
    /// dead members when short.
    fn region_in_a_tree(
        change: impl FnOnce(&mut crate::Config),
    ) -> (
        tempfile::TempDir,
        std::sync::Arc<crate::memcg::MemCgroup>,
        Region,
    ) {
        let dir = tempfile::tempdir().unwrap();
        let (cg, _) = crate::memcg::MemCgroup::create_shared(256, dir.path()).unwrap();
        let cg = std::sync::Arc::new(cg);
        let region = testing::region(1024, 0, |cfg| {
            cfg.memcg = Some(cg.clone());
            cfg.pcp = false;
            change(cfg);
        });
        (dir, cg, region)
    }

    /// A process of the tree that died (or ended with `_exit`, past every exit hook) leaves
    /// its charges in its member slot. A region that lives on what its own reclaim frees
    /// never comes up short, so the dead member must be reaped when reclaim is needed
    /// (a second redis-server thrashed with nothing resident, the first one's 1 GiB still
    /// charged to the tree).
    #[test]
    fn a_dead_members_charges_come_back_to_a_region_that_reclaims() {
        let (_dir, cg, region) = region_in_a_tree(|_| {});
        let value = |page: usize| (page as u8).wrapping_add(1);
        for page in 0..1024 {
            // SAFETY: inside the region.
            unsafe { testing::byte_at(&region, page).write_volatile(value(page)) };
        }
        let mut child = std::process::Command::new("true").spawn().unwrap();
        let dead = child.id();
        child.wait().unwrap();
        // The dead process holds all the region left free: every swap-in from now on
        // charges one page, which the region's own reclaim can always free.
        let slot = cg.join_as(dead, 256 - cg.usage());
        // Reaping runs at most every 100 ms, which a pass over the region may take less
        // than; without it, no number of passes frees the slot.
        let give_up = std::time::Instant::now() + std::time::Duration::from_secs(10);
        loop {
            for page in 0..1024 {
                assert_eq!(testing::read(&region, page), value(page));
            }
            if cg.is_free(slot) || std::time::Instant::now() > give_up {
                break;
            }
        }
        assert!(cg.is_free(slot), "the dead member's charges were reaped");
        region.check_invariants().unwrap();
    }

    /// A process of a tree whose share of the shared limit is all compressed pool (the
    /// others hold the rest, and its LRU lists are empty) frees memory by writing the
    /// pool back: reclaim had nothing to take, and a fork child of raw_clone waited on
    /// its parent until it was declared out of memory.
    #[test]
    fn a_region_whose_share_is_all_pool_writes_the_pool_back_to_charge() {
        let (_dir, cg, region) = region_in_a_tree(|cfg| cfg.swap.ztier.enabled = true);
        // A word per page: a pool chunk holds many.
        let word = |page: usize| (page as u64 + 1).wrapping_mul(0x9e37_79b9_7f4a_7c15);
        let at = |page: usize| testing::byte_at(&region, page).cast::<u64>();
        for page in 0..1024 {
            // SAFETY: inside the region, aligned.
            unsafe { at(page).add(100).write_volatile(word(page)) };
        }
        region
            .advise(0, region.len(), crate::Advice::PageOut)
            .unwrap();
        let mm = region.mm();
        assert_eq!(
            mm.lru().len(LruList::Active) + mm.lru().len(LruList::Inactive),
            0
        );
        assert!(mm.pool_charged() > 0, "{:?}", region.stats().ztier);
        // Another process of the tree (alive: this one's pid) holds the rest.
        cg.join_as(std::process::id(), 256 - cg.usage());
        for page in 0..1024 {
            // SAFETY: as above.
            assert_eq!(unsafe { at(page).add(100).read_volatile() }, word(page));
        }
        assert!(region.stats().ztier.written_back > 0);
        region.check_invariants().unwrap();
    }
}
