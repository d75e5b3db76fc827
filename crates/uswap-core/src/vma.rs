//! What the program does to the region's mapping, told by userfaultfd's non-cooperative
//! events, given the kernel's meaning ([mm/madvise.c], [mm/mremap.c], [mm/mmap.c] through
//! fs/userfaultfd.c's `userfaultfd_remove`, `mremap_userfaultfd_complete` and
//! `userfaultfd_unmap_complete`):
//!
//! - `madvise(MADV_DONTNEED | MADV_FREE)`: the range reads as zeros afterwards; its budget,
//!   staging frames and swap slots are released.
//! - `munmap`: the pages are gone; the same resources come back; uswap never unmaps that
//!   range again (someone else may map there).
//! - `mremap` within the region: each page's state (mapped, inactive, swapped) follows the
//!   data to its new address. Out of the region: the data follows too; pages not in memory
//!   are brought back at the new address, and the range leaves uswap (ordinary memory, not
//!   counted against the limit), said once on stderr.
//!
//! Events are handled one at a time, each before any message read after it (thread mode:
//! by the handler that holds leadership; SIGBUS mode: by the service thread), with fills
//! fenced off from the read until they are handled (`mmap_changing.rs`): no page is filled
//! between uswap's read of an event and its handling. The kernel's zap of a discard runs
//! after the read and may still take pages filled after the handling; those are kept
//! `Lazyfree`, so a fault on them refills zeros. uswap never takes a page out behind the
//! kernel. Page locks are taken blocking, in address order.

use crate::lockdep::Rank;
use crate::lockstat::{LockClass, StatGuard, StatMutex};
use crate::lru::LruList;
use crate::mm::Mm;
use crate::page::{Kind, PageLock, PageState};
use crate::stats::VmEvent;
use crate::uffd::Event;
use crate::PAGE_SIZE;
use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering::Relaxed};

/// Pages whose locks a discard holds at a time.
const DISCARD_BATCH: usize = 512;

/// Said once per process: region memory moved out of a region.
static MOVED_OUT_SAID: AtomicBool = AtomicBool::new(false);

/// Pages mremap moved out of the region whose data uswap still has to put in place, and
/// the ranges to hand to the kernel once they are.
#[derive(Default)]
struct Placements {
    pages: Vec<(usize, PageState)>,
    ranges: Vec<(usize, usize)>,
}

/// What a region keeps between vma events: pages mremap moved out, still to be put in
/// place, and the bounds of the addresses they go to (read by the SIGBUS handler).
pub(crate) struct VmaState {
    placements: StatMutex<Placements>,
    pending_lo: AtomicUsize,
    pending_hi: AtomicUsize,
}

impl Default for VmaState {
    fn default() -> VmaState {
        VmaState {
            placements: StatMutex::new(Rank::VmaPlacements, Placements::default()),
            pending_lo: AtomicUsize::new(usize::MAX),
            pending_hi: AtomicUsize::new(0),
        }
    }
}

impl VmaState {
    /// The statistics of the placements' lock (`vma_placements`).
    pub fn lockstat(&self) -> LockClass {
        LockClass::sum("vma_placements", [&self.placements])
    }
}

/// A region's vma events: its memory (`mm`) and what the events keep (`state`).
pub(crate) struct Vma<'a> {
    mm: &'a Mm,
    state: &'a VmaState,
}

impl<'a> Vma<'a> {
    pub fn new(mm: &'a Mm, state: &'a VmaState) -> Vma<'a> {
        Vma { mm, state }
    }

    /// Handles one non-fault event.
    pub fn handle_event(&self, event: Event) {
        match event {
            Event::Remove { start, end } => self.discard(start, end),
            Event::Unmap { start, end } => self.unmap(start, end),
            Event::Remap { from, to, len } => self.remap(from, to, len),
            Event::Fault { .. } => unreachable!("faults are not vma events"),
            Event::Other(code) => {
                eprintln!("uswap: ignoring userfaultfd event {code:#x} it did not ask for");
            }
        }
    }

    /// Handles the events still queued once the fault sources have stopped (a region being
    /// dropped): an munmap read late must still keep uswap off the range it freed.
    /// Pages that mremap moved out and still wait to be put in place are put there first
    /// (trying for up to 5 s): once the userfaultfd closes, they would read as zeros.
    pub fn drain_events(&self) {
        let mut msgs = [crate::uffd::Msg::default(); 16];
        let deadline = std::time::Instant::now() + std::time::Duration::from_secs(5);
        loop {
            while let Ok((n @ 1.., _fence)) = self.mm.uffd().read_messages(&mut msgs) {
                for m in &msgs[..n] {
                    match m.decode() {
                        Event::Fault { address, .. } => {
                            let page = address & !(PAGE_SIZE - 1);
                            let _ = self.mm.uffd().wake(page, PAGE_SIZE);
                        }
                        event => self.handle_event(event),
                    }
                }
            }
            if self.place_pending() {
                return;
            }
            if std::time::Instant::now() > deadline {
                eprintln!(
                    "uswap: pages moved out of the region by mremap could not be put in place \
                     before the region was dropped; they will read as zeros"
                );
                return;
            }
            std::thread::sleep(std::time::Duration::from_millis(1));
        }
    }

    /// MADV_DONTNEED/MADV_FREE: every page of the range that is not mapped reads as zeros
    /// from now on. A mapped page is the kernel's to zap (DONTNEED) or keep until written
    /// or reclaimed (FREE); uswap never zaps behind it (two zaps of one range can livelock
    /// in UFFDIO_MOVE), and keeps such a page charged until it learns which
    /// (`Kind::Lazyfree`).
    fn discard(&self, start: usize, end: usize) {
        let mm = self.mm;
        let range = mm.pages_in(start, end);
        let mut first = range.start;
        while first < range.end {
            let chunk = first..(first + DISCARD_BATCH).min(range.end);
            let mut locks: Vec<PageLock<'_>> = chunk.clone().map(|p| mm.pages().lock(p)).collect();
            let mut lazy = Vec::new();
            for lock in &mut locks {
                match lock.kind() {
                    Kind::Unmapped | Kind::Discarded => {}
                    // Holds nothing, but the zap may still follow: a touch before it must
                    // fill this page alone and keep it lazily freed, as for a discarded one.
                    Kind::None => mm.discard_page(lock),
                    Kind::Lazyfree => lazy.push(lock.page()),
                    Kind::Active => {
                        mm.lazyfreed(lock);
                        lazy.push(lock.page());
                    }
                    _ => mm.discard_page(lock),
                }
            }
            // Like the kernel's lazy-free pages: reclaim takes them first (it ages the
            // probation list before the active one, under either policy).
            mm.lru().add_tail(LruList::Probation, lazy);
            mm.count(VmEvent::pgdiscard, chunk.len() as u64);
            first = chunk.end;
        }
    }

    /// A discarded range whose zap has run (`Region::forget`): discarded again, which
    /// catches pages reclaim moved out before the zap.
    pub(crate) fn forget(&self, start: usize, end: usize) {
        self.discard(start, end);
    }

    /// munmap: nothing is mapped in the range any more.
    fn unmap(&self, start: usize, end: usize) {
        let mm = self.mm;
        for page in mm.pages_in(start, end) {
            let mut lock = mm.pages().lock(page);
            if lock.kind() != Kind::Unmapped {
                mm.unmap_page(&mut lock);
                mm.count(VmEvent::pgunmap, 1);
            }
        }
    }

    /// mremap moved `len` bytes from `from` to `to`.
    fn remap(&self, from: usize, to: usize, len: usize) {
        let mm = self.mm;
        let inside = |addr: usize| mm.page_of(addr);
        let mut moved_out = 0usize;
        for i in 0..len / PAGE_SIZE {
            let (src, dst) = (from + i * PAGE_SIZE, to + i * PAGE_SIZE);
            match (inside(src), inside(dst)) {
                (Some(a), Some(b)) => self.move_page(a, b),
                (Some(a), None) => {
                    self.move_out(a, dst);
                    moved_out += 1;
                }
                // Memory from outside the region moved in: it is not uswap's, and its range
                // is not registered (only registered ranges raise this event, and uswap
                // registers nothing outside its regions), so the kernel serves it.
                (None, _) => {}
            }
        }
        if moved_out > 0 {
            // Until the pages are in place and the range is the kernel's, faults there wait
            // (the mapping may have grown past `len`: cover all of it).
            let (lo, hi) = vma_around(to).unwrap_or((to, to + len));
            self.pending_range(lo, hi);
            self.placements().ranges.push((lo, hi));
            if !MOVED_OUT_SAID.swap(true, Relaxed) {
                eprintln!(
                    "uswap: mremap moved {moved_out} pages out of the region at {:#x} to {to:#x}; \
                     they keep their data but are ordinary memory now, outside uswap's limit",
                    mm.start()
                );
            }
        }
    }

    /// The page at region page `a` now lives at region page `b`.
    fn move_page(&self, a: usize, b: usize) {
        let mm = self.mm;
        let (first, second) = (mm.pages().lock(a.min(b)), mm.pages().lock(a.max(b)));
        let (mut src, mut dst) = if a < b {
            (first, second)
        } else {
            (second, first)
        };
        if !matches!(dst.kind(), Kind::Unmapped | Kind::None | Kind::Discarded) {
            // The kernel unmapped the target first; its event was handled before this one.
            mm.unmap_page(&mut dst);
        }
        let list = mm.lru().list_of(a);
        let moved = mm.take_out(&mut src);
        mm.moved_in(&mut dst, &src, moved, list);
    }

    /// The page at region page `a` moved to `dst`, outside the region. A mapped page moved
    /// with the kernel's page tables; one that is not in memory is put there by
    /// [`FaultPath::place_pending`], since the kernel refuses fills until the events of the
    /// same mremap that follow this one are read.
    fn move_out(&self, a: usize, dst: usize) {
        let mm = self.mm;
        let mut lock = mm.pages().lock(a);
        let held = mm.take_out(&mut lock);
        if let (Kind::Inactive, Some(slot)) = (held.kind(), held.slot()) {
            // No longer a page of the region; the slot is freed once the page is placed.
            mm.swap().cache().delete(slot);
        }
        match held.kind() {
            Kind::Inactive | Kind::Swapped | Kind::Poisoned => {
                self.placements().pages.push((dst, held));
            }
            _ => mm.release_held(held),
        }
    }

    fn placements(&self) -> StatGuard<'a, Placements> {
        self.state.placements.lock()
    }

    /// Widens the range where faults wait for placements to cover `[lo, hi)`.
    fn pending_range(&self, lo: usize, hi: usize) {
        self.state.pending_lo.fetch_min(lo, Relaxed);
        self.state.pending_hi.fetch_max(hi, Relaxed);
    }

    /// Pages moved out by mremap that still wait to be put in place.
    pub fn placing(&self) -> usize {
        self.placements().pages.len()
    }

    /// Whether pages that left the region wait to be put in place.
    pub fn has_pending(&self) -> bool {
        self.state.pending_hi.load(Relaxed) != 0
    }

    /// Whether a fault at `addr`, outside the region, must wait: pages that left the
    /// region are still to be put there, or an event is being read or handled.
    pub fn is_pending(&self, addr: usize) -> bool {
        self.mm.mmap_changing()
            || (addr >= self.state.pending_lo.load(Relaxed)
                && addr < self.state.pending_hi.load(Relaxed))
    }

    /// Puts the pages that mremap moved out of the region in place, then hands their ranges
    /// to the kernel. False while the kernel still refuses fills (more events to read).
    pub fn place_pending(&self) -> bool {
        let mut p = self.placements();
        while let Some(&(dst, held)) = p.pages.last() {
            match self.place(dst, held) {
                Err(()) => return false,
                Ok(()) => {
                    p.pages.pop();
                    self.mm.release_held(held);
                }
            }
        }
        for (start, end) in std::mem::take(&mut p.ranges) {
            self.release_foreign(start, end);
        }
        self.state.pending_hi.store(0, Relaxed);
        self.state.pending_lo.store(usize::MAX, Relaxed);
        true
    }

    /// Fills `dst` with the data `held` describes. `Err` when the kernel says to retry.
    fn place(&self, dst: usize, held: PageState) -> Result<(), ()> {
        let mm = self.mm;
        let copy = |src: *const u8| match mm.uffd().copy(dst, src, PAGE_SIZE, false) {
            Err(p) if p.busy() => Err(()),
            Err(p) if !p.vanished() => {
                eprintln!("uswap: cannot place a page moved by mremap at {dst:#x}: {p}");
                Ok(())
            }
            _ => Ok(()),
        };
        match held.kind() {
            Kind::Inactive => {
                let frame = held.frame().expect("an inactive page has a frame");
                copy(mm.staging().addr(frame) as *const u8)
            }
            Kind::Swapped => {
                let mut buf = mm.take_bounce(true).expect("may allocate");
                // SAFETY: the buffer is one aligned page we own.
                let placed = match unsafe { mm.read_swapped(held, buf.as_mut_ptr()) } {
                    Ok(()) => copy(buf.as_ptr()),
                    Err(e) => {
                        eprintln!(
                            "uswap: page moved by mremap to {dst:#x} could not be read back \
                             from swap: {e}; it is poisoned"
                        );
                        mm.count(VmEvent::failed_faults, 1);
                        self.poison_at(dst)
                    }
                };
                drop(buf);
                placed
            }
            _ => self.poison_at(dst),
        }
    }

    fn poison_at(&self, dst: usize) -> Result<(), ()> {
        match self.mm.uffd().poison(dst, PAGE_SIZE) {
            Err(e) if e.raw_os_error() == Some(libc::EAGAIN) => Err(()),
            _ => Ok(()),
        }
    }

    /// Unregisters the parts of the mapping around `[start, end)` that lie outside the
    /// region: the kernel serves them from now on (a grown tail included).
    pub fn release_foreign(&self, start: usize, end: usize) {
        let mm = self.mm;
        let (lo, hi) = vma_around(start).unwrap_or((start, end));
        let (rs, re) = (mm.start(), mm.start() + mm.len());
        for (a, b) in [(lo, hi.min(rs)), (lo.max(re), hi)] {
            if a < b {
                let _ = mm.uffd().unregister(a, b - a);
            }
        }
    }

    /// A fault outside the region on memory registered with its userfaultfd (mremap grew
    /// the region's mapping in place past its end): hands the range to the kernel and lets
    /// the thread retry.
    pub fn foreign_fault(&self, addr: usize) {
        let page = addr & !(PAGE_SIZE - 1);
        // Pages that left the region go in place before any range is handed back.
        if self.has_pending() && !self.place_pending() {
            let _ = self.mm.uffd().wake(page, PAGE_SIZE);
            return;
        }
        self.release_foreign(page, page + PAGE_SIZE);
        self.mm.count(VmEvent::foreign_faults, 1);
        let _ = self.mm.uffd().wake(page, PAGE_SIZE);
    }
}

/// The bounds of the mapping that contains `addr`, from /proc/self/maps.
fn vma_around(addr: usize) -> Option<(usize, usize)> {
    let maps = std::fs::read_to_string("/proc/self/maps").ok()?;
    maps.lines().find_map(|line| {
        let range = line.split_whitespace().next()?;
        let (a, b) = range.split_once('-')?;
        let (a, b) = (
            usize::from_str_radix(a, 16).ok()?,
            usize::from_str_radix(b, 16).ok()?,
        );
        (a <= addr && addr < b).then_some((a, b))
    })
}

/// Vma events handled directly on a real region whose affected pages are not mapped (so
/// the kernel has nothing to zap or move): what the pages give back and where their data
/// goes. No root needed (see `uffd.rs`).
#[cfg(all(test, not(loom)))]
mod tests {
    use crate::page::Kind;
    use crate::region::{testing, Advice};
    use crate::stats::VmEvent;
    use crate::uffd::Event;
    use crate::PAGE_SIZE;

    #[test]
    fn a_discard_of_pages_out_of_memory_gives_back_their_slots_and_frames() {
        let region = testing::region(64, 64, |_| {});
        region.advise(0, 4 * PAGE_SIZE, Advice::PageOut).unwrap();
        region
            .advise(4 * PAGE_SIZE, 4 * PAGE_SIZE, Advice::Cold)
            .unwrap();
        let mm = region.mm();
        let (slots, resident) = (mm.slots_held(), mm.budget().resident());
        let free = mm.staging().free_frames().len();
        let (start, end) = (mm.page_addr(0), mm.page_addr(8));
        region
            .fault_path()
            .vma()
            .handle_event(Event::Remove { start, end });
        for page in 0..8 {
            assert_eq!(
                mm.pages().peek(page).0.kind(),
                Kind::Discarded,
                "page {page}"
            );
        }
        assert_eq!(mm.slots_held(), slots - 4);
        assert_eq!(mm.budget().resident(), resident - 4);
        assert_eq!(mm.staging().free_frames().len(), free + 4);
        assert_eq!(mm.vmstat().get(VmEvent::pgdiscard), 8);
        region.check_invariants().unwrap();
        assert_eq!(testing::read(&region, 1), 0, "zeros from now on");
        assert_eq!(testing::read(&region, 6), 0);
    }

    #[test]
    fn a_swapped_page_moved_inside_the_region_takes_its_slot_and_data_along() {
        // Pages 0..16 are written (one fault-around window); 48 is untouched.
        let region = testing::region(64, 8, |_| {});
        region
            .advise(2 * PAGE_SIZE, PAGE_SIZE, Advice::PageOut)
            .unwrap();
        let mm = region.mm();
        let slot = mm.pages().peek(2).0.slot().expect("swapped");
        assert_eq!(mm.pages().peek(48).0.kind(), Kind::None);
        let (from, to) = (mm.page_addr(2), mm.page_addr(48));
        region.fault_path().vma().handle_event(Event::Remap {
            from,
            to,
            len: PAGE_SIZE,
        });
        assert_eq!(mm.pages().peek(2).0.kind(), Kind::Unmapped);
        let moved = mm.pages().peek(48).0;
        assert_eq!((moved.kind(), moved.slot()), (Kind::Swapped, Some(slot)));
        assert_eq!(mm.vmstat().get(VmEvent::pgremap), 1);
        region.check_invariants().unwrap();
        assert_eq!(
            testing::read(&region, 48),
            3,
            "page 2's data, at its new place"
        );
    }

    #[test]
    fn an_unmap_gives_back_what_every_kind_of_page_held() {
        let region = testing::region(64, 64, |_| {});
        region.advise(0, 4 * PAGE_SIZE, Advice::PageOut).unwrap();
        region
            .advise(4 * PAGE_SIZE, 4 * PAGE_SIZE, Advice::Cold)
            .unwrap();
        let mm = region.mm();
        let (slots, resident) = (mm.slots_held(), mm.budget().resident());
        let (start, end) = (mm.page_addr(0), mm.page_addr(12));
        region
            .fault_path()
            .vma()
            .handle_event(Event::Unmap { start, end });
        for page in 0..12 {
            assert_eq!(
                mm.pages().peek(page).0.kind(),
                Kind::Unmapped,
                "page {page}"
            );
        }
        assert_eq!(mm.slots_held(), slots - 4);
        // 4 inactive and 4 active pages were charged.
        assert_eq!(mm.budget().resident(), resident - 8);
        mm.lru().drain_all();
        assert_eq!(mm.lru().list_of(10), None);
    }
}
