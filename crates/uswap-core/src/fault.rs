//! Fault resolution ([mm/memory.c]'s `do_anonymous_page`, `do_swap_page` and `do_wp_page`,
//! in user space), shared by both fault sources: the handler threads and the SIGBUS
//! handler. Built on reclaim (`vmscan`), which it calls to charge pages.
//!
//! Each resolution takes the page lock, does its ioctl, and only then applies the named
//! transition: a step that fails leaves the page as it was. A fill that finds the range gone
//! (unmapped or remapped under it) or busy (a vma event not yet handled) backs out with
//! [`Outcome::Retry`]: the thread retries its access, which the kernel or the next fault
//! then answers.

use crate::breakdown::{Laps, Phase};
use crate::config::Readahead;
use crate::lockstat::LockClass;
use crate::mm::events::{MappedBack, SlotAfter};
use crate::mm::Mm;
use crate::page::{Kind, PageLock};
use crate::readahead::{read_around, read_around_in_signal, Destination, ReadaheadState, Window};
use crate::stats::{FaultKind, VmEvent};
use crate::vma::{Vma, VmaState};
use crate::vmscan::{ChargeFailure, Reclaim};
use crate::workingset::Arrival;
use crate::PAGE_SIZE;
use std::sync::atomic::Ordering::Relaxed;
use std::time::Instant;

/// How a fault ended.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum Outcome {
    /// The page is mapped (or poisoned, so the retried access fails by itself).
    Resolved,
    /// Nothing changed; the faulting thread retries its access (woken in thread mode).
    Retry,
    /// Nothing could be mapped: the faulting thread must get SIGBUS.
    Fatal,
}

const OOM: &str = "out of memory: no page could be reclaimed";

/// The fault path of one region.
pub(crate) struct FaultPath {
    reclaim: Reclaim,
    fault_around: usize,
    /// What vma events keep between them (`vma.rs`).
    vma: VmaState,
    /// Test hook: the next full fault resolution panics (see `Region::inject_handler_panic`).
    inject_panic: std::sync::atomic::AtomicBool,
    pub(crate) readahead: ReadaheadState,
}

impl FaultPath {
    pub fn new(reclaim: Reclaim, fault_around: usize, readahead: Readahead) -> FaultPath {
        FaultPath {
            readahead: ReadaheadState::new(readahead, reclaim.mm().swap().rotational()),
            reclaim,
            fault_around,
            vma: VmaState::default(),
            inject_panic: Default::default(),
        }
    }

    pub fn reclaim(&self) -> &Reclaim {
        &self.reclaim
    }

    pub fn mm(&self) -> &Mm {
        self.reclaim.mm()
    }

    /// The statistics of the fault path's own locks: readahead's last window and the
    /// vma placements.
    pub fn lockstat(&self) -> [LockClass; 2] {
        [self.readahead.lockstat(), self.vma.lockstat()]
    }

    /// The region's vma events.
    pub fn vma(&self) -> Vma<'_> {
        Vma::new(self.mm(), &self.vma)
    }

    /// Makes the next full fault resolution panic, to test that a dying handler fails the
    /// fault it held loudly.
    pub fn inject_panic(&self) {
        self.inject_panic.store(true, Relaxed);
    }

    /// Whether vma events are being read or handled (see `mmap_changing.rs`).
    pub(crate) fn events_pending(&self) -> bool {
        self.mm().mmap_changing()
    }

    /// Swapoff's step for one page (`unuse_pte`): brings it into memory, mapped, if it is
    /// out on swap or parked inactive. Retries while a vma event holds it up.
    pub fn unuse(&self, page: usize) -> Outcome {
        loop {
            let start = Instant::now();
            let lock = self.mm().pages().lock(page);
            let outcome = match lock.kind() {
                Kind::Inactive => self
                    .activate(lock, start, Laps::new(None, start), true, false)
                    .unwrap_or(Outcome::Retry),
                Kind::Swapped => {
                    let laps = Laps::new(None, start);
                    self.swap_in(lock, start, laps, Destination::Dirty, false)
                }
                _ => Outcome::Resolved,
            };
            if outcome != Outcome::Retry {
                return outcome;
            }
            std::thread::sleep(std::time::Duration::from_micros(100));
        }
    }

    /// Swapoff's last step for one page: a resident page gives up its swap slot. True when
    /// it had one.
    pub fn forget_slot(&self, page: usize) -> bool {
        let mut lock = self.mm().pages().lock(page);
        if !lock.state().is_resident() {
            return false;
        }
        // A mapped borrowed page becomes this process's own too, but its copy is on its
        // lender's device: no slot of this one is freed.
        let own = lock.state().slot().is_some();
        self.mm().forget_slot(&mut lock) && own
    }

    /// Resolves a fault on `page`. `write_protect` is set for a write to a write-protected
    /// (clean, swap-backed) page; in SIGBUS mode the caller cannot tell and passes `None`.
    /// `write`: the access is known to be a write, so a page brought back from swap or
    /// from the inactive list is mapped dirty at once (its slot freed) instead of clean,
    /// which would fault again on the write (the kernel's `do_swap_page` does the same).
    /// May block, reclaim and allocate: not for a signal handler (see
    /// [`FaultPath::resolve_in_signal`]).
    pub fn handle_fault(&self, page: usize, write_protect: Option<bool>, write: bool) -> Outcome {
        let mm = self.mm();
        mm.count(VmEvent::pgfault, 1);
        let start = Instant::now();
        let lock = mm.pages().lock(page);
        let mut laps = Laps::new(mm.breakdown(), start);
        laps.lap(Phase::PageLock);
        if self.inject_panic.load(Relaxed) && self.inject_panic.swap(false, Relaxed) {
            panic!("injected fault-handler panic (test hook)");
        }
        match lock.kind() {
            Kind::Active => self.fault_on_active(lock, write_protect),
            Kind::None | Kind::Discarded => self
                .first_touch(lock, start, true)
                .unwrap_or(Outcome::Retry),
            Kind::Inactive => self
                .activate(lock, start, laps, true, write)
                .unwrap_or(Outcome::Retry),
            Kind::Swapped => self.swap_in(lock, start, laps, Destination::Clean, write),
            Kind::Lazyfree => self.refill_lazyfree(lock),
            Kind::Poisoned => {
                drop(lock);
                Outcome::Fatal
            }
            Kind::Unmapped => self.regrown(lock, start),
        }
    }

    /// The part of fault resolution a signal handler may run: it allocates nothing, takes
    /// no lock a program thread could hold, and never reclaims; its only I/O is a swap-in's
    /// read, with its readahead window when `room_to_read_ahead` says the handler's stack
    /// allows (asked only when the window may read ahead; on a signal set's ring, polled,
    /// or with `pread`). `None` means the fault needs
    /// the full path (on a thread that may block).
    pub fn resolve_in_signal(
        &self,
        page: usize,
        write: bool,
        room_to_read_ahead: fn() -> bool,
    ) -> Option<Outcome> {
        if self.inject_panic.load(Relaxed) {
            return None; // the test hook panics on the full path
        }
        let mm = self.mm();
        let start = Instant::now();
        let lock = mm.pages().lock(page);
        if self.events_pending() {
            return Some(Outcome::Retry);
        }
        let outcome = match lock.kind() {
            Kind::None | Kind::Discarded => self.first_touch(lock, start, false)?,
            Kind::Inactive => self.activate(lock, start, Laps::new(None, start), false, false)?,
            Kind::Swapped => self.swap_in_in_signal(lock, start, room_to_read_ahead, write)?,
            // Only what can be told and done without a report: a missing page needs the
            // full path's loud failure.
            Kind::Active => match mm.pagemap_entry(page) {
                Some(e) if e.present && mm.write_stops_at(e) => self.write_fault(lock, false)?,
                Some(e) if e.present => Outcome::Resolved,
                _ => return None,
            },
            _ => return None,
        };
        mm.count(VmEvent::pgfault, 1);
        Some(outcome)
    }

    /// A fault on a page the table calls mapped: a write to a clean (write-protected) page,
    /// a fault that another handler already resolved, or, when the page is not mapped
    /// after all, something uswap was not told about: that fails loudly, never loops.
    fn fault_on_active(&self, lock: PageLock<'_>, write_protect: Option<bool>) -> Outcome {
        let mm = self.mm();
        let page = lock.page();
        match write_protect {
            Some(true) => return self.write_fault_reported(lock),
            Some(false) => {
                // Usually fault-around or a racing fault mapped it first.
                if mm.pagemap_entry(page).is_none_or(|e| e.present) {
                    drop(lock);
                    mm.wake(page);
                    return Outcome::Resolved;
                }
            }
            _ => match mm.pagemap_entry(page) {
                Some(e) if e.present && mm.write_stops_at(e) => {
                    return self.write_fault_reported(lock)
                }
                Some(e) if e.present => return Outcome::Resolved,
                // Without pagemap, a clean page's fault is taken for its first write.
                None if lock.state().write_faults() => return self.write_fault_reported(lock),
                None => return Outcome::Resolved,
                Some(_) => {}
            },
        }
        if self.events_pending() {
            return Outcome::Retry;
        }
        mm.count(VmEvent::unexplained_faults, 1);
        let mut lock = lock;
        mm.poisoned(&mut lock);
        self.fail(
            lock,
            "the page was mapped and is gone (unmapped behind uswap's back, or a hardware \
             memory error); its data is lost",
            false,
        )
    }

    /// A fault on a lazily freed page: the kernel zapped it (MADV_DONTNEED), so it reads as
    /// zeros; it is still charged. The lazily freed pages after it in its fault-around
    /// window are refilled with it: the kernel zaps in address order, so those it has
    /// passed are gone too, and at one it has not reached yet (still mapped) the fill stops
    /// (EEXIST). The pages stay lazily freed: a discard being handled may still have its
    /// zap to come, and a page it takes must then read as zeros again, not fail. If the
    /// page itself is mapped, this is a racing fault or a write to a page MADV_FREE left
    /// write-protected (its protection clear can meet the kernel's own fence).
    fn refill_lazyfree(&self, lock: PageLock<'_>) -> Outcome {
        let mm = self.mm();
        let page = lock.page();
        let end = (page - page % self.fault_around + self.fault_around).min(mm.pages().len());
        let mut after: Vec<PageLock<'_>> = Vec::new();
        for p in page + 1..end {
            match mm.pages().try_lock(p) {
                Some(l) if l.kind() == Kind::Lazyfree => after.push(l),
                _ => break,
            }
        }
        let zeros = mm.zeros() as *const u8;
        let len = (1 + after.len()) * PAGE_SIZE;
        // Counted before the fill, which wakes the thread (see `first_touch`).
        mm.count(VmEvent::pgzerofill, 1 + after.len() as u64);
        let mut filled = mm.uffd().copy(mm.page_addr(page), zeros, len, false);
        if !after.is_empty() && matches!(&filled, Err(p) if p.failed_whole()) {
            // The window may span two mappings: the page alone.
            mm.uncount(VmEvent::pgzerofill, after.len() as u64);
            after.clear();
            filled = mm.uffd().copy(mm.page_addr(page), zeros, PAGE_SIZE, false);
        }
        let done = match &filled {
            Ok(()) => 1 + after.len(),
            Err(p) => p.done / PAGE_SIZE,
        };
        mm.uncount(VmEvent::pgzerofill, (1 + after.len() - done) as u64);
        if done > 0 {
            // Zeros again, as at a first touch.
            let (list, _) = mm.workingset().place(Arrival::FirstTouch);
            mm.lru().cache_add(list, page, false);
            for l in &after[..done - 1] {
                mm.lru().cache_add(list, l.page(), false);
            }
            return Outcome::Resolved;
        }
        match filled {
            Err(p) if p.error.raw_os_error() == Some(libc::EEXIST) => {
                if mm.caps().write_protect {
                    let addr = mm.page_addr(page);
                    if let Err(e) = mm.uffd().write_protect(addr, PAGE_SIZE, false) {
                        if e.raw_os_error() == Some(libc::EAGAIN) {
                            return Outcome::Retry;
                        }
                    }
                }
                drop(lock);
                mm.wake(page);
                Outcome::Resolved
            }
            Err(p) if p.vanished() || p.busy() => Outcome::Retry,
            Err(p) => self.fail(
                lock,
                &format!("zero-filling a discarded page failed: {p}"),
                false,
            ),
            Ok(()) => unreachable!("a whole fill maps the faulting page"),
        }
    }

    /// First write to a page whose swap copy is valid: the copy goes stale, so the slot is
    /// freed and the page becomes writable (dirty).
    fn write_fault_reported(&self, lock: PageLock<'_>) -> Outcome {
        self.write_fault(lock, true).expect("reported")
    }

    /// `None` when it failed and `report` is off (as in [`FaultPath::activate`]); `report`
    /// off also means a signal handler, which may not reclaim.
    fn write_fault(&self, mut lock: PageLock<'_>, report: bool) -> Option<Outcome> {
        let mm = self.mm();
        if lock.state().shared() {
            // The kernel copies the page for this write (or takes it over, if the other
            // process let go of it): one page more is this process's.
            let charged = if report {
                match self.reclaim.charge(1, true) {
                    Ok(_) => true,
                    Err(ChargeFailure::EventsPending) => return Some(Outcome::Retry),
                    Err(ChargeFailure::OutOfMemory) => {
                        return Some(self.fail(lock, OOM, true));
                    }
                }
            } else {
                self.reclaim.charge_without_reclaim(1).is_some()
            };
            if !charged {
                return None;
            }
            mm.unshared(&mut lock, VmEvent::cow_break);
        }
        // The slot goes first: clearing the protection wakes the thread, which must find the
        // page dirty by then. A page whose protection then stays is made writable by its
        // next write fault.
        if mm.dirtied(&mut lock) {
            // The first use of a page readahead mapped, when it is a write: credited here,
            // since its slot (and marker) go now and the next window's inference cannot
            // see it (a sequential rewrite's windows stayed at two pages without this).
            self.readahead.written_hit(lock.page());
            mm.count(VmEvent::swap_ra_hit, 1);
        }
        let addr = mm.page_addr(lock.page());
        match mm.uffd().write_protect(addr, PAGE_SIZE, false) {
            Ok(()) => Some(Outcome::Resolved),
            Err(e) if matches!(e.raw_os_error(), Some(libc::ENOENT | libc::EAGAIN)) => {
                Some(Outcome::Retry)
            }
            Err(_) => report.then(|| self.fail(lock, "cannot make the page writable", false)),
        }
    }

    /// Zero-fills the faulting page and its untouched neighbours in its fault-around window
    /// with one UFFDIO_COPY. `None` when it cannot be done without reclaim and
    /// `may_reclaim` is off, or the fill failed for a reason the full path reports.
    fn first_touch(
        &self,
        lock: PageLock<'_>,
        start: Instant,
        may_reclaim: bool,
    ) -> Option<Outcome> {
        let mm = self.mm();
        let page = lock.page();
        let window = match lock.kind() {
            Kind::Discarded => 1,
            _ => self.fault_around,
        };
        let lo_bound = page - page % window;
        let hi_bound = (lo_bound + window).min(mm.pages().len());
        let want = (hi_bound - lo_bound) as u64;
        let granted = if may_reclaim {
            match self.reclaim.charge(want, true) {
                Ok(n) => n as usize,
                Err(ChargeFailure::EventsPending) => return Some(Outcome::Retry),
                Err(ChargeFailure::OutOfMemory) => return Some(self.fail(lock, OOM, true)),
            }
        } else {
            self.reclaim.charge_without_reclaim(want)? as usize
        };
        let (mut lo, mut hi) = (page, page + 1);
        while hi < hi_bound && hi - lo < granted && mm.pages().try_claim_none(hi) {
            hi += 1;
        }
        while lo > lo_bound && hi - lo < granted && mm.pages().try_claim_none(lo - 1) {
            lo -= 1;
        }
        if granted > hi - lo {
            mm.budget().uncharge((granted - (hi - lo)) as u64);
        }
        // Counters move before the fill, which wakes the faulting thread: a caller that
        // reads them right after its access must see this fault.
        mm.count(VmEvent::pgzerofill, (hi - lo) as u64);
        let zeros = mm.zeros() as *const u8;
        let mut filled = mm
            .uffd()
            .copy(mm.page_addr(lo), zeros, (hi - lo) * PAGE_SIZE, false);
        if hi - lo > 1 && matches!(&filled, Err(p) if p.failed_whole()) {
            // The window may span two mappings: the faulting page alone, not zero pages
            // mapped into a neighbouring reservation.
            mm.unclaim((lo..hi).filter(|&p| p != page));
            (lo, hi) = (page, page + 1);
            filled = mm.uffd().copy(mm.page_addr(page), zeros, PAGE_SIZE, false);
        }
        // A partial fill maps a prefix of the window.
        let done = match &filled {
            Ok(()) => hi - lo,
            Err(p) => p.done / PAGE_SIZE,
        };
        let mut lock = lock;
        if mm.zero_filled(&mut lock, lo..hi, done) {
            drop(lock);
            mm.record(FaultKind::FirstTouch, start);
            return Some(Outcome::Resolved);
        }
        match filled {
            Err(p) if p.vanished() || p.busy() => Some(Outcome::Retry),
            _ if !may_reclaim => None,
            _ => Some(self.fail(lock, "zero-fill failed", false)),
        }
    }

    /// A page the program unmapped came back into a registered mapping (mremap grew the
    /// region's mapping in place over it): it reads as zeros, like new anonymous memory.
    fn regrown(&self, mut lock: PageLock<'_>, start: Instant) -> Outcome {
        if self.events_pending() {
            return Outcome::Retry;
        }
        let mm = self.mm();
        match self.reclaim.charge(1, true) {
            Ok(_) => {}
            Err(ChargeFailure::EventsPending) => return Outcome::Retry,
            Err(ChargeFailure::OutOfMemory) => return self.fail(lock, OOM, true),
        }
        let addr = mm.page_addr(lock.page());
        mm.count(VmEvent::pgzerofill, 1);
        if let Err(p) = mm
            .uffd()
            .copy(addr, mm.zeros() as *const u8, PAGE_SIZE, false)
        {
            mm.budget().uncharge(1);
            mm.uncount(VmEvent::pgzerofill, 1);
            if p.vanished() || p.busy() {
                return Outcome::Retry;
            }
            return self.fail(lock, &format!("zero-fill failed: {p}"), false);
        }
        let page = lock.page();
        mm.zero_filled(&mut lock, page..page + 1, 1);
        drop(lock);
        mm.record(FaultKind::FirstTouch, start);
        Outcome::Resolved
    }

    /// A touch of an inactive page: its data is still in memory, so it comes back without
    /// I/O and is promoted to the active list (the reference signal). Allocates nothing
    /// unless it fails; `None` when it failed and `report` is off (a signal handler leaves
    /// the report to the full path).
    fn activate(
        &self,
        mut lock: PageLock<'_>,
        start: Instant,
        mut laps: Laps<'_>,
        report: bool,
        write: bool,
    ) -> Option<Outcome> {
        let mm = self.mm();
        let st = lock.state();
        let frame = st.frame().expect("an inactive page has a staging frame");
        let (dst, src) = (mm.page_addr(lock.page()), mm.staging().addr(frame));
        // The page comes back by COPY, write-protected if clean, and its frame's memory is
        // freed with a batch of others: MOVE would save the copy of 4 KiB but flushes the
        // TLB for the frame's old address, an IPI to every CPU running the program (about
        // 14 µs on this VM with another thread of it running), and fails where the program
        // changed the protection of its range or a fork child shares the frame. MOVE is
        // kept for when the kernel has no page for a copy (ENOMEM: a cgroup around the
        // program is full), since it allocates nothing.
        if let Some(slot) = st.slot() {
            let hit = self.cache_lookup(slot);
            debug_assert!(
                hit.is_some_and(|e| e.page as usize == lock.page()),
                "slot {slot} of inactive page {} is not cached as it",
                lock.page()
            );
        }
        if write {
            // Written at once: dirty, its swap copy stale.
            mm.forget_slot(&mut lock);
        }
        let st = lock.state();
        let clean = st.slot().is_some() && mm.caps().write_protect;
        mm.count(VmEvent::pgactivate, 1);
        let mut moved = false;
        let mut back = mm.uffd().copy(dst, src as *const u8, PAGE_SIZE, clean);
        let no_memory = matches!(&back, Err(p) if p.error.raw_os_error() == Some(libc::ENOMEM));
        if no_memory && report {
            // Moved, it comes back dirty: its swap copy, if any, goes.
            mm.forget_slot(&mut lock);
            moved = true;
            back = mm.uffd().move_pages(dst, src, PAGE_SIZE, true);
        }
        if let Err(p) = back {
            mm.uncount(VmEvent::pgactivate, 1);
            if p.vanished() || p.busy() {
                return Some(Outcome::Retry);
            }
            // The data is still in its staging frame; only this access fails.
            return report.then(|| {
                self.fail(
                    lock,
                    &format!("cannot map the inactive page back: {p}"),
                    false,
                )
            });
        }
        laps.lap(Phase::Map);
        let how = match (moved, report) {
            (true, _) => MappedBack::Moved,
            (false, true) => MappedBack::Copied,
            // In a signal handler, which must not allocate (a flush does).
            (false, false) => MappedBack::CopiedInSignal,
        };
        mm.mapped_back(&mut lock, how);
        drop(lock);
        laps.lap(Phase::Finish);
        mm.record(FaultKind::Minor, start);
        Some(Outcome::Resolved)
    }

    /// Reads the page from its slot, verifies it and maps it. The read goes to a bounce
    /// buffer outside the budget, so when swap is short the slot can be freed before the
    /// page is charged: the reclaim that makes room may need exactly that slot. Data that
    /// is read is never lost: a page that cannot be charged goes back to a slot (and the
    /// access fails loudly), or, with no slot either, is mapped over the limit.
    /// Pages read ahead are mapped as `readahead` says (clean for a fault, dirty for
    /// swapoff). A page whose data is in an ancestor's slot (a fork's, borrowed) is read
    /// alone, and mapped clean against that slot unless it is written (`Mm::maps_borrowed_clean`).
    fn swap_in(
        &self,
        mut lock: PageLock<'_>,
        start: Instant,
        mut laps: Laps<'_>,
        readahead: Destination,
        write: bool,
    ) -> Outcome {
        let mm = self.mm();
        let state = lock.state();
        let own = state.slot();
        let cached = own.and_then(|slot| mm.swap().cache().lookup(slot));
        debug_assert_eq!(
            cached,
            None,
            "swapped page {}'s slot is cached",
            lock.page()
        );
        let mut buf = mm.take_bounce(true).expect("may allocate");
        let (window, writable) = match own {
            Some(slot) => self
                .readahead
                .window(slot, lock.page(), mm.pages().len(), |last| {
                    self.mark_readahead_used(last)
                }),
            None => (Window::None, false),
        };
        let readahead = match readahead {
            Destination::Clean if writable => Destination::Writable,
            dest => dest,
        };
        laps.lap(Phase::Prepare);
        // SAFETY: the buffer is one aligned page we own.
        let read = unsafe {
            match own {
                Some(slot) => read_around(
                    &self.reclaim,
                    &self.readahead,
                    &lock,
                    (slot, buf.as_mut_ptr()),
                    window,
                    readahead,
                ),
                None => mm.read_swapped(state, buf.as_mut_ptr()),
            }
        };
        if let Err(e) = read {
            drop(buf);
            let event = match e {
                crate::swapfile::ReadError::Checksum { .. }
                | crate::swapfile::ReadError::Tag { .. }
                | crate::swapfile::ReadError::Pool { .. } => VmEvent::verify_errors,
                _ => VmEvent::io_errors,
            };
            mm.count(event, 1);
            mm.poisoned(&mut lock);
            let why = match state.borrowed() {
                None => format!("swap-in from slot {} failed: {e}", own.unwrap_or_default()),
                Some((_, slot)) => format!("swap-in from slot {slot} of the parent's swap file, shared at fork, failed: {e}"),
            };
            let why = format!("{why}; the page's data is lost");
            return self.fail(lock, &why, false);
        }
        laps.lap(Phase::Read);
        mm.count(VmEvent::pswpin, 1);
        // Keep the swap copy (and write-protect to learn of the first write) unless the
        // device says not to (`SwapDevice::keeps_slot`) or the access is a write. A page of
        // a window the walk writes is mapped dirty too, but its slot goes only once it is
        // mapped: until then the fault may still back out.
        let keep =
            own.is_some_and(|slot| mm.caps().write_protect && mm.swap().keeps_slot(slot)) && !write;
        // Swapoff (`Destination::Dirty`) makes every page this process's own.
        let lent_clean = !write && readahead != Destination::Dirty && mm.maps_borrowed_clean(state);
        let clean = (keep && readahead != Destination::Writable) || lent_clean;
        if let (false, Some(slot)) = (keep, own) {
            mm.release_slot(slot);
        }
        // The data is still where it came from: its slot kept, or the lender's.
        let still_there = keep || state.borrowed().is_some();
        // Backing out while events are handled is safe only with the data still there; a
        // page whose slot is already freed waits for memory as before.
        match self.reclaim.charge(1, still_there) {
            Ok(_) => {}
            Err(ChargeFailure::EventsPending) => {
                mm.uncount(VmEvent::pswpin, 1);
                return Outcome::Retry;
            }
            Err(ChargeFailure::OutOfMemory)
                if still_there || self.write_back(&mut lock, buf.as_ptr()) =>
            {
                drop(buf);
                return self.fail(lock, OOM, true);
            }
            Err(_) => {
                mm.budget().overdraw(1);
                mm.count(VmEvent::overdraft, 1);
            }
        }
        mm.count(VmEvent::pgmajfault, 1);
        laps.lap(Phase::Charge);
        let addr = mm.page_addr(lock.page());
        let mapped = mm.uffd().copy(addr, buf.as_ptr(), PAGE_SIZE, clean);
        laps.lap(Phase::Map);
        if let Err(p) = mapped {
            mm.uncount(VmEvent::pgmajfault, 1);
            mm.budget().uncharge(1);
            let written = still_there || self.write_back(&mut lock, buf.as_ptr());
            drop(buf);
            if !written {
                // Its slot was freed before the charge, which was given back: it holds
                // nothing more (what `Mm::poisoned` would give back is gone already).
                lock.poison();
                return self.fail(
                    lock,
                    &format!("cannot map the swapped-in page ({p}) nor write it back"),
                    false,
                );
            }
            if p.vanished() || p.busy() {
                return Outcome::Retry;
            }
            return self.fail(lock, &format!("cannot map the swapped-in page: {p}"), false);
        }
        drop(buf);
        let after = match (clean, keep) {
            _ if lent_clean => SlotAfter::Lent,
            (true, _) => SlotAfter::Cached,
            (false, true) => SlotAfter::Freed,
            (false, false) => SlotAfter::FreedBefore,
        };
        mm.swapped_in(&mut lock, after, false, write);
        drop(lock);
        laps.lap(Phase::Finish);
        mm.record(FaultKind::Major, start);
        Outcome::Resolved
    }

    /// The common case of [`FaultPath::swap_in`], allocating nothing: the page (and its
    /// readahead window, on buffers of the swap device's, when the stack has `room`) read
    /// in place, verified, charged without reclaim, mapped. `None` for anything else (no
    /// buffer free, an I/O error, a bad checksum, direct reclaim needed): the full path
    /// then does it and reports what goes wrong. (The window is then sized twice for one
    /// fault; the second sees the faulting page inside the last window, not after it, and
    /// reads at most half as much ahead.)
    fn swap_in_in_signal(
        &self,
        mut lock: PageLock<'_>,
        start: Instant,
        room: fn() -> bool,
        write: bool,
    ) -> Option<Outcome> {
        let mm = self.mm();
        if lock.state().borrowed().is_some() {
            let mut buf = mm.take_bounce(false)?;
            // SAFETY: the buffer is one aligned page we own.
            let read =
                unsafe { mm.read_borrowed_in_signal(lock.state(), buf.as_mut_ptr(), room()) };
            let outcome =
                read.then(|| self.map_in_signal(&mut lock, None, buf.as_ptr(), false, write))??;
            if outcome == Outcome::Resolved {
                drop(lock);
                mm.record(FaultKind::Major, start);
            }
            return Some(outcome);
        }
        let (page, slot) = (lock.page(), lock.state().slot().expect("swapped"));
        let (window, writable) =
            self.readahead
                .window_in_signal(slot, page, mm.pages().len(), room, |last| {
                    self.mark_readahead_used(last)
                })?;
        let cached = self.cache_lookup(slot);
        debug_assert_eq!(cached, None, "swapped page {page}'s slot is cached");
        let outcome = if window == Window::None {
            let mut buf = mm.take_bounce(false)?;
            // SAFETY: the buffer is one aligned page we own.
            let read = unsafe { mm.swap().read_page_in_place(slot, buf.as_mut_ptr(), room()) };
            read.then(|| self.map_in_signal(&mut lock, Some(slot), buf.as_ptr(), false, write))?
        } else {
            let dest = match writable {
                true => Destination::Writable,
                false => Destination::Clean,
            };
            // SAFETY: the page is locked and holds the slot.
            unsafe {
                read_around_in_signal(
                    &self.reclaim,
                    &self.readahead,
                    (page, slot),
                    window,
                    dest,
                    |data| self.map_in_signal(&mut lock, Some(slot), data, writable, write),
                )
            }
        }?;
        if outcome == Outcome::Resolved {
            drop(lock);
            mm.record(FaultKind::Major, start);
        }
        Some(outcome)
    }

    /// Charges (without reclaim) and maps the swapped-in copy of `lock`'s page (which
    /// holds `slot`, or `None`: borrowed) at `data`, clean and cached while the slot is
    /// kept (clean against the lender's slot, for a borrowed page that may be), dirty when
    /// `writable` (a window the walk writes); `write`: the fault was a write (with written
    /// bits, such a page is not armed). `None` when it cannot be charged or mapped for a
    /// reason the full path reports.
    fn map_in_signal(
        &self,
        lock: &mut PageLock<'_>,
        slot: Option<u32>,
        data: *const u8,
        writable: bool,
        write: bool,
    ) -> Option<Outcome> {
        let mm = self.mm();
        self.reclaim.charge_without_reclaim(1)?;
        let keep = !writable
            && match slot {
                Some(s) => mm.caps().write_protect && mm.swap().keeps_slot(s),
                None => mm.maps_borrowed_clean(lock.state()),
            };
        mm.count(VmEvent::pswpin, 1);
        mm.count(VmEvent::pgmajfault, 1);
        let mapped = mm
            .uffd()
            .copy(mm.page_addr(lock.page()), data, PAGE_SIZE, keep);
        if let Err(p) = mapped {
            mm.uncount(VmEvent::pswpin, 1);
            mm.uncount(VmEvent::pgmajfault, 1);
            mm.budget().uncharge(1);
            return (p.vanished() || p.busy()).then_some(Outcome::Retry);
        }
        let after = match (keep, slot) {
            (true, Some(_)) => SlotAfter::Cached,
            (true, None) => SlotAfter::Lent,
            (false, Some(_)) => SlotAfter::Freed,
            (false, None) => SlotAfter::FreedBefore,
        };
        mm.swapped_in(lock, after, false, write || writable);
        Some(Outcome::Resolved)
    }

    /// Writes a page whose slot was given up early to a new slot; false when no slot can
    /// be had or the write fails.
    fn write_back(&self, lock: &mut PageLock<'_>, buf: *const u8) -> bool {
        let mm = self.mm();
        let Some(slot) = mm.swap().alloc_slot() else {
            return false;
        };
        // SAFETY: the buffer is one aligned page we own.
        let written = unsafe { mm.swap().write_pages(&[(slot, buf)]) }
            .remove(0)
            .is_ok();
        if !written {
            mm.swap().free_slot(slot);
            return false;
        }
        mm.rehomed(lock, slot);
        true
    }

    /// Marks the pages readahead mapped in `window` used (the walk went through it) and
    /// says how many were.
    fn mark_readahead_used(&self, window: Window) -> u32 {
        let mm = self.mm();
        let (cache, region) = (mm.swap().cache(), mm.region_id());
        let used = match window {
            Window::None => 0,
            Window::Pages { start, end } => (start..end)
                .filter_map(|p| mm.pages().peek(p).0.slot())
                .filter(|&s| cache.mark_used(s, region))
                .count(),
            Window::Slots { first, last } => (first..=last)
                .filter(|&s| cache.mark_used(s, region))
                .count(),
        };
        mm.count(VmEvent::swap_ra_hit, used as u64);
        used as u32
    }

    /// Looks `slot` up in the swap cache (a swap-in's first step). A hit tells the
    /// readahead policy; one on a page brought in by readahead is credited to it.
    fn cache_lookup(&self, slot: u32) -> Option<crate::swapfile::swap_state::CacheEntry> {
        let found = self.mm().swap().cache().lookup(slot);
        if let Some(e) = found {
            self.readahead.cache_hit(e.page as usize, e.readahead);
            if e.readahead {
                self.mm().count(VmEvent::swap_ra_hit, 1);
            }
        }
        found
    }

    /// Fails the access loudly. Lost data (`oom` false) poisons the page so every later
    /// access fails too; running out of memory leaves the page as it was.
    fn fail(&self, lock: PageLock<'_>, why: &str, oom: bool) -> Outcome {
        let mm = self.mm();
        let page = lock.page();
        let addr = mm.page_addr(page);
        mm.count(VmEvent::failed_faults, 1);
        let poisoned = lock.kind() == Kind::Poisoned;
        drop(lock);
        let detail = if oom {
            let unmovable = mm.vmstat().get(VmEvent::pgskip_unmovable);
            let budget = mm.budget();
            format!(
                " (memory limit {} pages: {} resident here, {} in the compressed pool{}; \
                 swap {} of {} pages used{}; raise the memory limit or the swap size)",
                budget.limit(),
                mm.resident(),
                mm.pool_charged(),
                match budget.held_by_others() {
                    0 => String::new(),
                    n => format!(" and {n} held by the other processes under the limit"),
                },
                mm.swap().used_pages(),
                mm.swap().capacity_pages(),
                if unmovable > 0 {
                    format!(
                        "; reclaim could not unmap pages {unmovable} times because the \
                         program mlocked or mprotected them"
                    )
                } else {
                    String::new()
                }
            )
        } else {
            String::new()
        };
        eprintln!(
            "uswap: access to {addr:#x} (page {page} of region at {:#x}) fails with SIGBUS: \
             {why}{detail}",
            mm.start(),
        );
        if poisoned && mm.caps().poison && mm.uffd().poison(addr, PAGE_SIZE).is_ok() {
            // The retried access hits the poison marker: SIGBUS for a user access, EFAULT
            // for a kernel one, like a hardware memory error.
            return Outcome::Resolved;
        }
        Outcome::Fatal
    }
}

/// Fault resolution called directly on pages put in each state, on a real region (the
/// handler thread serves only the test's own accesses): what each fault maps, what the
/// page keeps, and what it counts. No root needed (see `uffd.rs`).
#[cfg(all(test, not(loom)))]
mod tests {
    use super::*;
    use crate::config::FaultPlan;
    use crate::region::{testing, Advice, Region};

    fn count(mm: &Mm, event: VmEvent) -> u64 {
        mm.vmstat().get(event)
    }

    /// 64 written pages, the first 8 out on swap.
    fn swapped(change: impl FnOnce(&mut crate::Config)) -> Region {
        let region = testing::region(64, 64, change);
        region.advise(0, 8 * PAGE_SIZE, Advice::PageOut).unwrap();
        region
    }

    #[test]
    fn a_read_fault_on_a_swapped_page_maps_it_clean_and_keeps_its_slot() {
        let region = swapped(|_| {});
        let (mm, fault) = (region.mm(), region.fault_path());
        let (majflt, resident) = (count(mm, VmEvent::pgmajfault), mm.budget().resident());
        assert_eq!(fault.handle_fault(3, None, false), Outcome::Resolved);
        let st = mm.pages().peek(3).0;
        assert_eq!(st.kind(), Kind::Active);
        assert_eq!(count(mm, VmEvent::pgmajfault), majflt + 1);
        assert_eq!(mm.budget().resident(), resident + 1);
        let mapped = mm.pagemap_entry(3).expect("pagemap");
        assert!(mapped.present);
        if mm.caps().write_protect {
            let slot = st.slot().expect("clean: its swap copy is kept");
            assert_eq!(mm.swap().cache().peek(slot).map(|e| e.page), Some(3));
            assert!(mapped.write_protected, "its first write must be seen");
        }
        assert_eq!(testing::read(&region, 3), 4, "its data");
        region.check_invariants().unwrap();
    }

    #[test]
    fn a_write_fault_on_a_swapped_page_maps_it_dirty_and_frees_its_slot() {
        let region = swapped(|_| {});
        let (mm, fault) = (region.mm(), region.fault_path());
        let slots = mm.slots_held();
        assert_eq!(fault.handle_fault(5, None, true), Outcome::Resolved);
        let st = mm.pages().peek(5).0;
        assert_eq!((st.kind(), st.slot()), (Kind::Active, None));
        assert_eq!(mm.slots_held(), slots - 1);
        assert!(!mm.pagemap_entry(5).unwrap().write_protected);
        assert_eq!(testing::read(&region, 5), 6);
        region.check_invariants().unwrap();
    }

    #[test]
    fn a_touch_of_an_inactive_page_maps_it_back_without_reading_swap() {
        let region = testing::region(64, 64, |_| {});
        region.advise(0, 8 * PAGE_SIZE, Advice::Cold).unwrap();
        let (mm, fault) = (region.mm(), region.fault_path());
        let (pswpin, activate) = (count(mm, VmEvent::pswpin), count(mm, VmEvent::pgactivate));
        let free = mm.staging().free_frames().len();
        assert_eq!(mm.pages().peek(2).0.kind(), Kind::Inactive);
        assert_eq!(fault.handle_fault(2, None, false), Outcome::Resolved);
        let st = mm.pages().peek(2).0;
        assert_eq!(st.kind(), Kind::Active);
        assert!(
            st.referenced(),
            "a touch while inactive is the reference signal"
        );
        assert_eq!(count(mm, VmEvent::pswpin), pswpin);
        assert_eq!(count(mm, VmEvent::pgactivate), activate + 1);
        assert_eq!(mm.staging().free_frames().len(), free + 1);
        assert_eq!(testing::read(&region, 2), 3);
        region.check_invariants().unwrap();
    }

    #[test]
    fn a_first_touch_zero_fills_its_fault_around_window() {
        let region = testing::region(64, 0, |c| c.fault_around = 8);
        let (mm, fault) = (region.mm(), region.fault_path());
        assert_eq!(fault.handle_fault(10, None, false), Outcome::Resolved);
        for page in 0..64 {
            let want = if (8..16).contains(&page) {
                Kind::Active
            } else {
                Kind::None
            };
            assert_eq!(mm.pages().peek(page).0.kind(), want, "page {page}");
        }
        assert_eq!(count(mm, VmEvent::pgzerofill), 8);
        assert_eq!(mm.budget().resident(), 8);
        assert_eq!(testing::read(&region, 15), 0);
        region.check_invariants().unwrap();
    }

    #[test]
    fn a_page_whose_swap_copy_cannot_be_read_is_poisoned_and_gives_back_its_slot() {
        let region = swapped(|c| {
            c.swap.faults = Some(FaultPlan {
                read_eio_persistent: 1.0,
                ..FaultPlan::default()
            })
        });
        let (mm, fault) = (region.mm(), region.fault_path());
        let slots = mm.slots_held();
        let outcome = fault.handle_fault(4, None, false);
        // With UFFDIO_POISON the retried access finds a poison marker and fails by itself.
        let want = match mm.caps().poison {
            true => Outcome::Resolved,
            false => Outcome::Fatal,
        };
        assert_eq!(outcome, want);
        assert_eq!(mm.pages().peek(4).0.kind(), Kind::Poisoned);
        assert_eq!(mm.slots_held(), slots - 1);
        assert_eq!(count(mm, VmEvent::io_errors), 1);
        assert_eq!(count(mm, VmEvent::failed_faults), 1);
        region.check_invariants().unwrap();
    }

    #[test]
    fn a_mapped_page_lost_behind_uswaps_back_fails_loudly_and_leaves_its_list() {
        let region = testing::region(64, 64, |_| {});
        let (mm, fault) = (region.mm(), region.fault_path());
        let resident = mm.budget().resident();
        region.simulate_lost_page(5 * PAGE_SIZE);
        let outcome = fault.handle_fault(5, Some(false), false);
        assert_ne!(outcome, Outcome::Retry, "never loops");
        assert_eq!(mm.pages().peek(5).0.kind(), Kind::Poisoned);
        assert_eq!(count(mm, VmEvent::unexplained_faults), 1);
        assert_eq!(mm.budget().resident(), resident - 1);
        mm.lru().drain_all();
        assert_eq!(mm.lru().list_of(5), None);
        region.check_invariants().unwrap();
    }
}
