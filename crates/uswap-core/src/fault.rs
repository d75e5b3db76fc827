//! Fault resolution, shared by the handler threads and SIGBUS mode ([mm/memory.c]'s
//! `do_anonymous_page`, `do_swap_page` and `do_wp_page`, in user space).

use crate::lru::LruList;
use crate::page::{Kind, PageLock, PageState};
use crate::region::RegionCore;
use crate::stats::FaultKind;
use crate::swap_io::PageBuf;
use crate::PAGE_SIZE;
use std::sync::atomic::Ordering::Relaxed;
use std::time::{Duration, Instant};

/// How a fault ended.
pub(crate) enum Outcome {
    /// The page is mapped (or poisoned, so the retried access fails by itself).
    Resolved,
    /// Nothing could be mapped: the faulting thread must get SIGBUS.
    Fatal,
}

/// Direct reclaim gives up after this long without finding a free page.
const OOM_AFTER: Duration = Duration::from_secs(2);
const OOM: &str = "out of memory: no page could be reclaimed";

impl RegionCore {
    /// Resolves a fault on `page`. `write_protect` is set for a write to a write-protected
    /// (clean, swap-backed) page; in SIGBUS mode the caller cannot tell and passes `None`,
    /// and the page state decides.
    pub fn handle_fault(&self, page: usize, write_protect: Option<bool>) -> Outcome {
        self.vmstat.pgfault.fetch_add(1, Relaxed);
        let start = Instant::now();
        let lock = self.pages.lock(page);
        let kind = lock.state().kind();
        match (kind, write_protect) {
            (Kind::Active, Some(false)) => {
                // Another handler mapped it (fault-around or a racing fault on the same page).
                drop(lock);
                self.wake(page);
                Outcome::Resolved
            }
            (Kind::Active, _) => self.write_fault(lock),
            (Kind::None, _) => self.first_touch(lock, start),
            (Kind::Inactive, _) => self.activate(lock, start),
            (Kind::Swapped, _) => self.swap_in(lock, start),
            (Kind::Poisoned, _) => {
                drop(lock);
                Outcome::Fatal
            }
        }
    }

    fn wake(&self, page: usize) {
        if self.cfg.fault_mode == crate::FaultMode::Thread {
            let _ = self.uffd.wake(self.page_addr(page), PAGE_SIZE);
        }
    }

    /// First write to a page whose swap copy is valid: the copy goes stale, so the slot is
    /// freed and the page becomes writable (dirty).
    fn write_fault(&self, mut lock: PageLock<'_>) -> Outcome {
        let st = lock.state();
        if let Some(slot) = st.slot() {
            self.release_slot(slot);
            lock.set(st.with_slot(None));
        }
        let addr = self.page_addr(lock.page());
        match self.uffd.write_protect(addr, PAGE_SIZE, false) {
            Ok(()) => Outcome::Resolved,
            Err(e) => self.fail(lock, &format!("cannot make the page writable: {e}"), false),
        }
    }

    /// Zero-fills the faulting page and its untouched neighbours in its fault-around window
    /// with one UFFDIO_COPY.
    fn first_touch(&self, lock: PageLock<'_>, start: Instant) -> Outcome {
        let page = lock.page();
        let window = self.cfg.fault_around;
        let (lo_bound, hi_bound) = (
            page - page % window,
            (page - page % window + window).min(self.pages.len()),
        );
        let Some(granted) = self.charge((hi_bound - lo_bound) as u64) else {
            return self.fail(lock, OOM, true);
        };
        let granted = granted as usize;
        let (mut lo, mut hi) = (page, page + 1);
        while hi < hi_bound && hi - lo < granted && self.pages.try_claim(hi, PageState::NONE) {
            hi += 1;
        }
        while lo > lo_bound && hi - lo < granted && self.pages.try_claim(lo - 1, PageState::NONE) {
            lo -= 1;
        }
        self.budget.uncharge((granted - (hi - lo)) as u64);
        // Counters move before the fill, which wakes the faulting thread: a caller that
        // reads them right after its access must see this fault.
        self.vmstat.pgzerofill.fetch_add((hi - lo) as u64, Relaxed);
        let filled = self.uffd.copy(
            self.page_addr(lo),
            self.zeros.addr() as *const u8,
            (hi - lo) * PAGE_SIZE,
            false,
        );
        let state = match filled {
            Ok(()) => PageState::new(Kind::Active),
            Err(_) => PageState::NONE,
        };
        for p in (lo..hi).filter(|&p| p != page) {
            self.pages.publish(p, state);
        }
        if let Err(e) = filled {
            self.vmstat.pgzerofill.fetch_sub((hi - lo) as u64, Relaxed);
            self.budget.uncharge((hi - lo) as u64);
            return self.fail(lock, &format!("zero-fill failed: {e}"), false);
        }
        self.lru.add(LruList::Active, lo..hi);
        let mut lock = lock;
        lock.set(state);
        drop(lock);
        self.record(FaultKind::FirstTouch, start);
        Outcome::Resolved
    }

    /// A touch of an inactive page: its data is still in memory, so it comes back without
    /// I/O and is promoted to the active list (the reference signal).
    fn activate(&self, mut lock: PageLock<'_>, start: Instant) -> Outcome {
        let st = lock.state();
        let frame = st.frame().expect("an inactive page has a staging frame");
        let (dst, src) = (self.page_addr(lock.page()), self.staging.addr(frame));
        // A clean page must come back write-protected, which only COPY does atomically;
        // a dirty one moves back without copying.
        let clean = st.slot().is_some() && self.caps.write_protect;
        self.vmstat.pgactivate.fetch_add(1, Relaxed);
        let back = if clean {
            self.uffd.copy(dst, src as *const u8, PAGE_SIZE, true)
        } else {
            self.uffd
                .move_pages(dst, src, PAGE_SIZE, true)
                .map_err(|p| p.error)
        };
        if let Err(e) = back {
            self.vmstat.pgactivate.fetch_sub(1, Relaxed);
            return self.fail(
                lock,
                &format!("cannot map the inactive page back: {e}"),
                false,
            );
        }
        self.lru.add(LruList::Active, [lock.page()]);
        lock.set(st.with_kind(Kind::Active).with_frame(None));
        drop(lock);
        if clean {
            self.staging.release(frame);
        } else {
            self.staging.release_empty(frame);
        }
        self.record(FaultKind::Minor, start);
        Outcome::Resolved
    }

    /// Reads the page from its slot, verifies it and maps it. The read goes to a bounce
    /// buffer outside the budget, so when swap is short the slot can be freed before the
    /// page is charged: the reclaim that makes room may need exactly that slot.
    fn swap_in(&self, mut lock: PageLock<'_>, start: Instant) -> Outcome {
        let slot = lock.state().slot().expect("a swapped page has a slot");
        let mut buf = self.take_bounce();
        // SAFETY: the buffer is one aligned page we own.
        if let Err(e) = unsafe { self.swap.read_page(slot, buf.as_mut_ptr()) } {
            self.return_bounce(buf);
            let counter = match e {
                crate::swapfile::ReadError::Checksum { .. } => &self.vmstat.verify_errors,
                _ => &self.vmstat.io_errors,
            };
            counter.fetch_add(1, Relaxed);
            self.release_slot(slot);
            lock.set(PageState::new(Kind::Poisoned));
            let why = format!("swap-in from slot {slot} failed: {e}; the page's data is lost");
            return self.fail(lock, &why, false);
        }
        self.vmstat.pswpin.fetch_add(1, Relaxed);
        // Keep the swap copy (and write-protect to learn of the first write) unless swap
        // space is getting short, as the kernel frees the slot when vm_swap_full().
        let keep = self.caps.write_protect && !self.swap.nearly_full();
        if !keep {
            self.release_slot(slot);
        }
        if self.charge(1).is_none() {
            let outcome = self.fail(self.put_back(lock, &buf, keep), OOM, true);
            self.return_bounce(buf);
            return outcome;
        }
        self.vmstat.pgmajfault.fetch_add(1, Relaxed);
        let mapped = self
            .uffd
            .copy(self.page_addr(lock.page()), buf.as_ptr(), PAGE_SIZE, keep);
        if let Err(e) = mapped {
            self.vmstat.pgmajfault.fetch_sub(1, Relaxed);
            self.budget.uncharge(1);
            let lock = self.put_back(lock, &buf, keep);
            self.return_bounce(buf);
            return self.fail(lock, &format!("cannot map the swapped-in page: {e}"), false);
        }
        self.return_bounce(buf);
        self.lru.add(LruList::Active, [lock.page()]);
        lock.set(PageState::new(Kind::Active).with_slot(keep.then_some(slot)));
        drop(lock);
        self.record(FaultKind::Major, start);
        Outcome::Resolved
    }

    /// Charges `want` pages (at least one) to the budget, reclaiming directly when the free
    /// pages fall under the min watermark. `None` when nothing could be freed for a while:
    /// the swap device is full or failing.
    pub fn charge(&self, want: u64) -> Option<u64> {
        let mut deadline = None;
        let mut round = 0u32;
        loop {
            if self.budget.free() < self.marks.min {
                self.vmstat.direct_reclaim.fetch_add(1, Relaxed);
                self.shrink();
            }
            let got = self.budget.try_charge(want);
            if self.budget.free() < self.marks.low {
                self.kswapd.wake();
            }
            if got > 0 {
                return Some(got);
            }
            // Only a charge that has to wait reads the clock.
            let give_up = *deadline.get_or_insert_with(|| Instant::now() + OOM_AFTER);
            if Instant::now() > give_up {
                return None;
            }
            round += 1;
            std::thread::sleep(Duration::from_micros(50 * round.min(20) as u64));
        }
    }

    /// After a swap-in that could not be mapped: when its slot was already freed, writes the
    /// page back to a new slot so its data survives, or marks it poisoned if that fails too.
    fn put_back<'a>(&self, mut lock: PageLock<'a>, buf: &PageBuf, slot_kept: bool) -> PageLock<'a> {
        if slot_kept {
            return lock;
        }
        let written = self.swap.alloc_slot().filter(|&slot| {
            // SAFETY: the buffer is one aligned page we own.
            let ok = unsafe { self.swap.write_pages(&[(slot, buf.as_ptr())]) }
                .remove(0)
                .is_ok();
            if !ok {
                self.swap.free_slot(slot);
            }
            ok
        });
        lock.set(match written {
            Some(slot) => {
                self.slots_held.fetch_add(1, Relaxed);
                PageState::new(Kind::Swapped).with_slot(Some(slot))
            }
            None => PageState::new(Kind::Poisoned),
        });
        lock
    }

    /// Fails the access loudly. Lost data (`oom` false) poisons the page so every later
    /// access fails too; running out of memory leaves the page as it was.
    fn fail(&self, lock: PageLock<'_>, why: &str, oom: bool) -> Outcome {
        let page = lock.page();
        let addr = self.page_addr(page);
        self.vmstat.failed_faults.fetch_add(1, Relaxed);
        let poisoned = lock.state().kind() == Kind::Poisoned;
        drop(lock);
        eprintln!(
            "uswap: access to {addr:#x} (page {page} of region at {:#x}) fails with SIGBUS: {why}{}",
            self.map.addr(),
            if oom {
                format!(
                    " (memory limit {} pages, swap {} of {} pages used; raise the memory limit or the swap size)",
                    self.budget.limit(),
                    self.swap.used_pages(),
                    self.swap.capacity_pages()
                )
            } else {
                String::new()
            }
        );
        if poisoned && self.caps.poison && self.uffd.poison(addr, PAGE_SIZE).is_ok() {
            // The retried access hits the poison marker: SIGBUS for a user access, EFAULT
            // for a kernel one, like a hardware memory error.
            return Outcome::Resolved;
        }
        Outcome::Fatal
    }
}
