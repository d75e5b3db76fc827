//! Reclaim ([mm/vmscan.c]): the background reclaimer (kswapd), direct reclaim, aging the
//! active list into the inactive list, and batched write-out of inactive pages.

use crate::error::{Error, Result};
use crate::lru::LruList;
use crate::page::{Kind, PageLock, PageState};
use crate::region::RegionCore;
use crate::PAGE_SIZE;
use std::sync::atomic::{AtomicBool, Ordering::Relaxed};
use std::sync::{Arc, Condvar, Mutex};
use std::time::Duration;

/// Wake-up channel of the background reclaimer.
#[derive(Default)]
pub(crate) struct Kswapd {
    pending: AtomicBool,
    lock: Mutex<()>,
    cv: Condvar,
}

impl Kswapd {
    /// Asks kswapd to run; cheap when a wake-up is already pending.
    pub fn wake(&self) {
        if !self.pending.load(Relaxed) {
            let _g = self.lock.lock().unwrap_or_else(|e| e.into_inner());
            self.pending.store(true, Relaxed);
            self.cv.notify_one();
        }
    }

    /// Sleeps until woken (or a periodic check is due); returns whether a wake was pending.
    fn sleep(&self) -> bool {
        let mut g = self.lock.lock().unwrap_or_else(|e| e.into_inner());
        if !self.pending.load(Relaxed) {
            g = self
                .cv
                .wait_timeout(g, Duration::from_millis(100))
                .unwrap_or_else(|e| e.into_inner())
                .0;
        }
        drop(g);
        self.pending.swap(false, Relaxed)
    }
}

pub(crate) fn spawn_kswapd(core: Arc<RegionCore>) -> Result<std::thread::JoinHandle<()>> {
    std::thread::Builder::new()
        .name("uswap-kswapd".into())
        .spawn(move || kswapd(&core))
        .map_err(|source| Error::Os {
            op: "spawn kswapd",
            source,
        })
}

/// Balances the region: whenever free pages drop under the low watermark, reclaim until
/// they reach the high one.
fn kswapd(core: &RegionCore) {
    while !core.shutdown.load(Relaxed) {
        core.kswapd.sleep();
        if core.shutdown.load(Relaxed) || core.budget.free() >= core.marks.low {
            continue;
        }
        core.vmstat.kswapd_wake.fetch_add(1, Relaxed);
        while core.budget.free() < core.marks.high && !core.shutdown.load(Relaxed) {
            if core.shrink() == 0 {
                // Nothing reclaimable right now (all pages busy, or swap full): back off.
                std::thread::sleep(Duration::from_millis(1));
                break;
            }
        }
    }
}

/// Most batches moved from the active to the inactive list in one reclaim pass.
const REFILL_BATCHES: usize = 4;

fn is_zero_page(addr: usize) -> bool {
    // SAFETY: the caller passes a populated, page-aligned staging frame.
    let words = unsafe { std::slice::from_raw_parts(addr as *const u64, PAGE_SIZE / 8) };
    words.iter().all(|&w| w == 0)
}

impl RegionCore {
    /// One reclaim pass: top the inactive list up from the active tail (at most a few
    /// batches per pass, so a direct reclaimer is not held long), then reclaim a batch from
    /// the inactive tail. Pages deactivated now sit behind older inactive pages, so they get
    /// their second chance: a touch before they reach the tail promotes them. Returns the
    /// pages freed.
    pub fn shrink(&self) -> u64 {
        let batch = self.cfg.reclaim_batch;
        let short = (self.inactive_target + batch).saturating_sub(self.lru.len(LruList::Inactive));
        for _ in 0..short.div_ceil(batch).min(REFILL_BATCHES) {
            self.deactivate(self.lru.isolate(&self.pages, LruList::Active, batch));
        }
        self.evict(self.lru.isolate(&self.pages, LruList::Inactive, batch))
    }

    /// Locks the pages of `range` that are in state `kind` and takes them off their list.
    pub fn lock_kind(&self, range: std::ops::Range<usize>, kind: Kind) -> Vec<PageLock<'_>> {
        let locks: Vec<PageLock<'_>> = range
            .map(|p| self.pages.lock(p))
            .filter(|l| l.state().kind() == kind)
            .collect();
        for l in &locks {
            self.lru.remove(l.page());
        }
        locks
    }

    /// Unmaps isolated active pages into staging frames (data kept) and puts them on the
    /// inactive list; a later touch is a minor fault that promotes the page back. Pages that
    /// are adjacent, with adjacent frames, move together: one UFFDIO_MOVE, one TLB flush.
    pub fn deactivate(&self, mut locks: Vec<PageLock<'_>>) {
        locks.sort_unstable_by_key(|l| l.page());
        let frames = self.staging.alloc_many(locks.len());
        let mut start = 0;
        while start < frames.len() {
            let mut end = start + 1;
            while end < frames.len()
                && locks[end].page() == locks[end - 1].page() + 1
                && frames[end] == frames[end - 1] + 1
            {
                end += 1;
            }
            let (dst, src) = (
                self.staging.addr(frames[start]),
                self.page_addr(locks[start].page()),
            );
            let moved = match self
                .uffd
                .move_pages(dst, src, (end - start) * PAGE_SIZE, false)
            {
                Ok(()) => end - start,
                // The page after the moved ones is pinned (O_DIRECT I/O in flight) or shared:
                // it stays active and is tried again later.
                Err(partial) => partial.done / PAGE_SIZE,
            };
            for (lock, &frame) in locks[start..start + moved].iter_mut().zip(&frames[start..]) {
                let st = lock.state();
                lock.set(st.with_kind(Kind::Inactive).with_frame(Some(frame)));
            }
            if start + moved < end {
                self.staging.release_empty(frames[start + moved]);
                start += moved + 1;
            } else {
                start = end;
            }
        }
        let (inactive, active): (Vec<_>, Vec<_>) = locks
            .iter()
            .map(|l| (l.page(), l.state().kind()))
            .partition(|&(_, k)| k == Kind::Inactive);
        self.vmstat
            .pgdeactivate
            .fetch_add(inactive.len() as u64, Relaxed);
        self.lru
            .add(LruList::Inactive, inactive.into_iter().map(|(p, _)| p));
        self.lru
            .add(LruList::Active, active.into_iter().map(|(p, _)| p));
    }

    /// Reclaims isolated inactive pages: all-zero pages are forgotten, clean pages with a
    /// valid swap copy are dropped, dirty pages are written out in one batch. Pages that
    /// cannot be written (swap full, I/O error) stay in memory on the inactive list.
    pub fn evict(&self, mut locks: Vec<PageLock<'_>>) -> u64 {
        self.vmstat.pgscan.fetch_add(locks.len() as u64, Relaxed);
        let mut freed_frames = Vec::with_capacity(locks.len());
        let mut writes = Vec::new();
        for (i, lock) in locks.iter_mut().enumerate() {
            let st = lock.state();
            let frame = st.frame().expect("an inactive page has a staging frame");
            if is_zero_page(self.staging.addr(frame)) {
                if let Some(slot) = st.slot() {
                    self.release_slot(slot);
                }
                lock.set(PageState::NONE);
                self.vmstat.pgzero_dropped.fetch_add(1, Relaxed);
            } else if st.slot().is_some() {
                lock.set(st.with_kind(Kind::Swapped).with_frame(None));
                self.vmstat.pgclean_dropped.fetch_add(1, Relaxed);
            } else {
                match self.swap.alloc_slot() {
                    Some(slot) => writes.push((i, slot)),
                    None => {
                        self.vmstat.swap_full.fetch_add(1, Relaxed);
                    }
                }
                continue;
            }
            freed_frames.push(frame);
        }
        self.write_out(&mut locks, &writes, &mut freed_frames);
        let freed = freed_frames.len() as u64;
        self.staging.release_all(freed_frames);
        let still_inactive = locks
            .iter()
            .filter(|l| l.state().kind() == Kind::Inactive)
            .map(|l| l.page());
        self.lru.add(LruList::Inactive, still_inactive);
        self.budget.uncharge(freed);
        self.vmstat.pgsteal.fetch_add(freed, Relaxed);
        freed
    }

    /// Writes dirty inactive pages straight from their staging frames, as one batch; the
    /// frames of the pages written go to `freed`.
    fn write_out(&self, locks: &mut [PageLock<'_>], writes: &[(usize, u32)], freed: &mut Vec<u32>) {
        if writes.is_empty() {
            return;
        }
        let batch: Vec<(u32, *const u8)> = writes
            .iter()
            .map(|&(i, slot)| {
                let frame = locks[i].state().frame().expect("inactive page has a frame");
                (slot, self.staging.addr(frame) as *const u8)
            })
            .collect();
        // SAFETY: each source is a populated staging frame, held by its page lock.
        let results = unsafe { self.swap.write_pages(&batch) };
        let mut written = 0;
        for (&(i, slot), result) in writes.iter().zip(results) {
            let st = locks[i].state();
            match result {
                Ok(()) => {
                    freed.push(st.frame().expect("inactive page has a frame"));
                    locks[i].set(
                        st.with_kind(Kind::Swapped)
                            .with_frame(None)
                            .with_slot(Some(slot)),
                    );
                    written += 1;
                }
                Err(e) => {
                    self.swap.free_slot(slot);
                    if self.vmstat.io_errors.fetch_add(1, Relaxed) == 0 {
                        eprintln!("uswap: swap write to slot {slot} failed: {e}; the page stays in memory");
                    }
                }
            }
        }
        self.vmstat.pswpout.fetch_add(written, Relaxed);
        self.slots_held.fetch_add(written, Relaxed);
    }
}
