//! Page events: each change of a page's state, done together with everything the state
//! says the page holds — its place on the LRU lists, its charge in the budget, its staging
//! frame, its swap slot and that slot's swap cache entry — and the counter that names the
//! event. Fault resolution, reclaim, vma events, readahead and fork change pages only
//! through these, so no caller can change a word and forget what goes with it. (The kernel
//! spreads the same steps over `do_anonymous_page`, `do_swap_page`, `shrink_folio_list`
//! and `__remove_mapping`, around `set_pte_at`.)
//!
//! Each event is called with the page locked and after the ioctl that made the kernel's
//! page tables agree has succeeded, so a step that fails changes nothing here. In debug
//! builds each ends with [`Mm::check_page`], the invariant walker's check of one page.
//! Counters a faulting thread must see when its access returns are counted before the
//! fill by the fault path, not here (see `stats.rs`).

use super::Mm;
use crate::lru::LruList;
use crate::page::{Kind, PageLock, PageState};
use crate::stats::VmEvent;
use crate::workingset::{Arrival, Refault};
use crate::PAGE_SIZE;
use std::ops::Range;
use std::sync::atomic::Ordering::Relaxed;

/// How an inactive page went back into place, which says what its frame holds now.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum MappedBack {
    /// UFFDIO_MOVE (no page for a copy): the frame is empty.
    Moved,
    /// UFFDIO_COPY on a thread that may allocate: the frame is zapped with the next batch.
    Copied,
    /// UFFDIO_COPY in a signal handler, which must not allocate: the frame is zapped with
    /// the next batch if the batch has room, else now.
    CopiedInSignal,
}

/// What becomes of a swapped page's slot once its data is mapped.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum SlotAfter {
    /// Kept, the page clean (write-protected) and its slot in the swap cache.
    Cached,
    /// Freed now: the page is dirty.
    Freed,
    /// Already freed, before the page was charged (swap nearly full, or a write).
    FreedBefore,
    /// A borrowed page's: the lender keeps it, and the page, clean against it
    /// (write-protected), stays borrowed (see `PageState::borrowed`).
    Lent,
}

impl Mm {
    /// Page event, first touch: zero pages were mapped over the first `filled` pages of
    /// `claimed`, the faulting page (`lock`) and the neighbours claimed with it
    /// (`PageTable::try_claim_none`), all charged and counted as filled. The filled ones
    /// become active, on the active list (joined while still claimed, so a vma event
    /// waiting for one finds it there); the rest are untouched again, their charge and count
    /// taken back. A discarded page filled stays lazily freed: the zap of its discard may
    /// still be running (see `FaultPath::refill_lazyfree`). Whether `lock`'s page was
    /// filled.
    pub fn zero_filled(
        &self,
        lock: &mut PageLock<'_>,
        claimed: Range<usize>,
        filled: usize,
    ) -> bool {
        let page = lock.page();
        let done = claimed.start..claimed.start + filled;
        let (list, _) = self.workingset().place(Arrival::FirstTouch);
        self.lru().add(list, done.clone());
        for p in claimed.clone().filter(|&p| p != page && done.contains(&p)) {
            self.pages().publish_active(p);
        }
        self.unclaim(claimed.clone().filter(|&p| p != page && !done.contains(&p)));
        if !done.contains(&page) {
            self.budget().uncharge(1);
            self.uncount(VmEvent::pgzerofill, 1);
            return false;
        }
        let discarded = lock.kind() == Kind::Discarded;
        lock.map_new();
        if discarded {
            lock.lazyfree();
        }
        self.debug_check(lock);
        true
    }

    /// Neighbours claimed for a zero fill that were not filled: untouched again, their
    /// charge and their count taken back.
    pub fn unclaim(&self, pages: impl Iterator<Item = usize>) {
        let mut n = 0;
        for p in pages {
            self.pages().unclaim(p);
            n += 1;
        }
        if n > 0 {
            self.budget().uncharge(n);
            self.uncount(VmEvent::pgzerofill, n);
        }
    }

    /// Page event: an inactive page was mapped back from its staging frame (a minor
    /// fault). Active and referenced, on the active list; its frame given back as `how`
    /// says (under the page lock: a walker that holds every page lock must never find a
    /// frame that is neither free nor held). A clean page keeps its slot and its swap
    /// cache entry.
    pub fn mapped_back(&self, lock: &mut PageLock<'_>, how: MappedBack) {
        self.lru().cache_add(LruList::Active, lock.page(), false);
        self.workingset().activated();
        let frame = lock.activate();
        match how {
            MappedBack::Moved => self.staging().release_empty(frame),
            MappedBack::Copied => self.staging().release_later(frame),
            MappedBack::CopiedInSignal => self.staging().release_later_in_signal(frame),
        }
        self.debug_check(lock);
    }

    /// Page event: a swapped page's data was read, verified and mapped (by a fault, or
    /// ahead of one when `readahead`: such a page waits at the tail of its list, first in
    /// line to be aged, and its cache entry says readahead brought it). Its shadow decides
    /// its list (`workingset.rs`). Its slot goes as `slot` says.
    ///
    /// With written bits, a page read ahead, or swapped in for a read, is armed: uswap
    /// mapped it write-protected and no write has been seen yet, so its written bit shows
    /// use from now on (`written`: the fault was a write, which will write it at once).
    pub fn swapped_in(
        &self,
        lock: &mut PageLock<'_>,
        slot: SlotAfter,
        readahead: bool,
        written: bool,
    ) {
        let page = lock.page();
        let before = lock.state();
        let held = before.slot();
        debug_assert!(
            held.is_some()
                || (before.borrowed().is_some()
                    && matches!(slot, SlotAfter::FreedBefore | SlotAfter::Lent))
        );
        let refault = self.workingset().refault(page, self.lru());
        let arrival = if readahead {
            Arrival::Readahead
        } else {
            if refault != Refault::None {
                self.count(VmEvent::workingset_refault, 1);
            }
            if refault == Refault::Workingset {
                self.workingset().activated();
                self.count(VmEvent::workingset_activate, 1);
            }
            Arrival::SwapIn(refault)
        };
        let (list, tail) = self.workingset().place(arrival);
        self.lru().cache_add(list, page, tail);
        match slot {
            SlotAfter::Cached => {
                let held = held.expect("a clean page keeps its slot");
                self.swap()
                    .cache()
                    .add(held, self.cache_entry(page, readahead));
                lock.swap_in(Some(held));
            }
            SlotAfter::Freed => {
                self.release_slot(held.expect("a swapped page has a slot"));
                lock.swap_in(None);
            }
            SlotAfter::FreedBefore => lock.swap_in(None),
            SlotAfter::Lent => lock.map_borrowed(),
        }
        if slot != SlotAfter::Lent {
            self.returned(before);
        }
        if self.caps.written_bits && !written {
            lock.arm();
        }
        self.debug_check(lock);
    }

    /// Page event: a swapped page whose slot was freed before it was charged (see
    /// [`SlotAfter::FreedBefore`]) could not be charged after all, and its data was
    /// written to `slot` instead: it holds that one now.
    pub fn rehomed(&self, lock: &mut PageLock<'_>, slot: u32) {
        self.returned(lock.state());
        self.slots_taken(1);
        self.own_slot(slot, lock.page());
        lock.rehome(slot);
        self.debug_check(lock);
    }

    /// Page event: the first write to a clean page, whose swap copy is now stale: the slot
    /// and its cache entry go (a borrowed page's lender's copy is given back). True when
    /// readahead had brought the page in and this is its first use.
    pub fn dirtied(&self, lock: &mut PageLock<'_>) -> bool {
        let before = lock.state();
        let Some(slot) = lock.dirty() else {
            self.returned(before);
            self.debug_check(lock);
            return false;
        };
        let first_use = self.swap().cache().mark_used(slot, self.region_id());
        self.release_slot(slot);
        self.debug_check(lock);
        first_use
    }

    /// Page event: the page's data is lost (an I/O error, a bad checksum, a mapped page
    /// gone behind uswap's back): off its list, `Poisoned` (every later access fails), and
    /// what it held given back.
    pub fn poisoned(&self, lock: &mut PageLock<'_>) {
        self.off_list(lock);
        let held = lock.poison();
        self.release_held(held);
        self.debug_check(lock);
    }

    /// Page event, aging: isolated active pages were moved with their data, each
    /// `locks[i]` into `frames[i]` where that is `Some` (the others did not move). Inactive,
    /// on the inactive list (in one add for the batch); a clean page keeps its slot. A
    /// borrowed page (unchanged since it was read from its lender) is dropped instead:
    /// borrowed again, its frame and charge given back, as reclaim drops a clean page.
    /// Returns the pages dropped.
    pub fn parked(&self, locks: &mut [PageLock<'_>], frames: &[Option<u32>]) -> u64 {
        let mut parked = Vec::with_capacity(locks.len());
        let mut dropped = Vec::new();
        for (lock, frame) in locks.iter_mut().zip(frames) {
            let Some(frame) = *frame else {
                continue;
            };
            if lock.state().borrowed().is_some() {
                lock.drop_borrowed();
                self.workingset().evicted(lock.page());
                dropped.push(frame);
            } else {
                lock.deactivate(frame);
                parked.push(lock.page());
            }
            // Seen now, while aging still holds the fork fence (`Mm::fork_fence`).
            lock.show();
            self.debug_check(lock);
        }
        self.count(VmEvent::pgdeactivate, parked.len() as u64);
        self.lru().add(LruList::Inactive, parked);
        if dropped.is_empty() {
            return 0;
        }
        self.count(VmEvent::borrowed_dropped, dropped.len() as u64);
        self.reclaimed(dropped)
    }

    /// Page event, aging: an isolated lazily freed page was found zapped by the kernel
    /// (nothing to move): discarded, its charge given back.
    pub fn lazyfree_zapped(&self, lock: &mut PageLock<'_>) {
        let held = lock.discard();
        self.release_held(held);
        self.count(VmEvent::pglazyfreed, 1);
        self.debug_check(lock);
    }

    /// Page event, reclaim: an isolated inactive page whose data is all zeros is forgotten
    /// (untouched again, its slot freed). Returns its frame, for [`Mm::reclaimed`].
    pub fn dropped_zero(&self, lock: &mut PageLock<'_>) -> u32 {
        let held = lock.drop_zero();
        if let Some(slot) = held.slot() {
            self.release_slot(slot);
        }
        self.count(VmEvent::pgzero_dropped, 1);
        self.debug_check(lock);
        held.frame().expect("an inactive page has a frame")
    }

    /// Page event, reclaim: an isolated clean inactive page is dropped without I/O (its
    /// slot holds its data): swapped, out of the swap cache. Returns its frame.
    pub fn dropped_clean(&self, lock: &mut PageLock<'_>) -> u32 {
        let slot = lock.state().slot().expect("a clean page has a slot");
        self.swap().cache().delete(slot);
        let frame = lock.drop_clean();
        self.workingset().evicted(lock.page());
        self.count(VmEvent::pgclean_dropped, 1);
        self.debug_check(lock);
        frame
    }

    /// Page event, reclaim: an isolated dirty inactive page was written to `slot` (which
    /// the write-back put in the swap cache): swapped, holding the slot, out of the cache.
    /// Returns its frame.
    pub fn swapped_out(&self, lock: &mut PageLock<'_>, slot: u32) -> u32 {
        self.swap().cache().delete(slot);
        let frame = lock.swap_out(slot);
        self.workingset().evicted(lock.page());
        self.slots_taken(1);
        self.count(VmEvent::pswpout, 1);
        self.debug_check(lock);
        frame
    }

    /// The end of a reclaim batch: the frames of the pages it dropped or wrote go back, and
    /// so does their charge. Returns the pages freed.
    pub fn reclaimed(&self, frames: Vec<u32>) -> u64 {
        let freed = frames.len() as u64;
        // The frames minor faults copied pages from go with them: one flush for all.
        self.staging().release_all_and_deferred(frames);
        self.budget().uncharge(freed);
        self.count(VmEvent::pgsteal, freed);
        freed
    }

    /// Page event, MADV_DONTNEED or MADV_FREE on a mapped page: lazily freed (the kernel
    /// may or may not zap it), its slot freed, still charged. The caller moves it to the
    /// tail of the active list, with the rest of its batch.
    pub fn lazyfreed(&self, lock: &mut PageLock<'_>) {
        self.forget_slot(lock);
        if lock.state().shared() {
            // A lazily freed page is charged: this process answers for it from now on.
            self.budget().overdraw(1);
            self.shared_pages.fetch_sub(1, Relaxed);
        }
        lock.lazyfree();
        self.count(VmEvent::pglazyfree, 1);
        self.debug_check(lock);
    }

    /// Page event: the page leaves the region's address space (munmap, the target of an
    /// mremap, a gap a fork child does not inherit): off its list, `Unmapped`, and what it
    /// held given back.
    pub fn unmap_page(&self, lock: &mut PageLock<'_>) {
        self.off_list(lock);
        self.workingset().forget(lock.page());
        let held = lock.unmap();
        self.release_held(held);
        self.debug_check(lock);
    }

    /// Every page outside the page runs `owned` (sorted) is `Unmapped`: not the region's
    /// (a fork child's parent had unmapped it, or another mapping took its place before
    /// the region was built).
    pub fn unmap_outside(&self, owned: &[std::ops::Range<usize>]) {
        let mut next = 0;
        let ends = owned.iter().map(|r| (r.start, r.end));
        for (start, end) in ends.chain(std::iter::once((self.pages().len(), 0))) {
            for page in next..start {
                self.unmap_page(&mut self.pages().lock(page));
            }
            next = end;
        }
    }

    /// Page event: the page's data goes elsewhere (the source of an mremap): off its list
    /// and `Unmapped`; what it held is returned for its new place, not given back.
    pub fn take_out(&self, lock: &mut PageLock<'_>) -> PageState {
        self.off_list(lock);
        let held = lock.unmap();
        self.debug_check(lock);
        held
    }

    /// Page event, mremap inside the region: `dst` takes over what the page at `from`
    /// held (`moved`, from [`Mm::take_out`]; its lock held too), with its slot's owner,
    /// swap cache entry and shadow, on `list`, the list the page was on.
    pub fn moved_in(
        &self,
        dst: &mut PageLock<'_>,
        from: &PageLock<'_>,
        moved: PageState,
        list: Option<LruList>,
    ) {
        let page = dst.page();
        self.workingset().moved(from.page(), page);
        if let Some(slot) = moved.slot() {
            self.own_slot(slot, page);
            if moved.is_resident() {
                self.swap().cache().rehome(slot, page as u32);
            }
        }
        dst.install(moved);
        if let Some(list) = list {
            self.lru().add(list, [page]);
        }
        self.count(VmEvent::pgremap, 1);
        self.debug_check(dst);
    }

    /// Page event: the program discarded a page that is not mapped (MADV_DONTNEED or
    /// MADV_FREE on an untouched, inactive, swapped or poisoned page): off its list,
    /// `Discarded` (zeros from now on), and what it held given back.
    pub fn discard_page(&self, lock: &mut PageLock<'_>) {
        self.off_list(lock);
        self.workingset().forget(lock.page());
        let held = lock.discard();
        self.release_held(held);
        self.debug_check(lock);
    }

    /// Page event, fork: a child's page the kernel mapped copy-on-write from the parent
    /// (its caller write-protects it): shared, not charged, on no list.
    pub fn shared(&self, lock: &mut PageLock<'_>) {
        lock.share();
        self.shared_pages.fetch_add(1, Relaxed);
        self.count(VmEvent::fork_shared, 1);
        self.debug_check(lock);
    }

    /// Page event: a page the kernel mapped before uswap watched it, this process's own
    /// from now on: charged, on the active list. A fork child's page mapped from the
    /// parent and not to be shared (lazily freed there, `lazyfree`, kept so here; or with
    /// no write protection to see its first write here), or a page the program wrote
    /// before its region was built on its memory (`Region::adopt`).
    pub fn adopt_mapped(&self, lock: &mut PageLock<'_>, lazyfree: bool) {
        lock.map_new();
        if lazyfree {
            lock.lazyfree();
        }
        self.budget().overdraw(1);
        self.lru().add(LruList::Active, [lock.page()]);
        self.debug_check(lock);
    }

    /// Page event: a shared page became this process's own, charged by the caller
    /// (`event` says how: the first write here, or found mapped here alone): an ordinary
    /// active page, on the active list.
    pub fn unshared(&self, lock: &mut PageLock<'_>, event: VmEvent) {
        lock.unshare();
        self.shared_pages.fetch_sub(1, Relaxed);
        self.lru().cache_add(LruList::Active, lock.page(), false);
        self.count(event, 1);
        self.debug_check(lock);
    }

    /// Page event, fork: a child's page starts out with the parent's data in `slot` of
    /// the child's own swap device.
    pub fn inherited(&self, lock: &mut PageLock<'_>, slot: u32) {
        lock.inherit(slot);
        self.own_slot(slot, lock.page());
        self.slots_taken(1);
        self.debug_check(lock);
    }

    /// Page event, fork: a child's page starts out with the parent's data in `slot` of
    /// lender `device`, lent at the fork (see `PageState::borrowed`).
    pub fn inherited_borrowed(&self, lock: &mut PageLock<'_>, device: u32, slot: u32) {
        lock.inherit_borrowed(device, slot);
        self.borrowed_pages.fetch_add(1, Relaxed);
        self.debug_check(lock);
    }

    /// Gives back what a page held: budget, staging frame, swap slot.
    pub fn release_held(&self, held: PageState) {
        if held.is_charged() {
            self.budget().uncharge(1);
        }
        if held.shared() {
            self.shared_pages.fetch_sub(1, Relaxed);
        }
        self.returned(held);
        if let Some(frame) = held.frame() {
            self.staging().release(frame);
        }
        if let Some(slot) = held.slot() {
            self.release_slot(slot);
        }
    }

    /// Page event: a locked resident page gives up its swap slot (swapoff, a discard), or
    /// a mapped borrowed page its lender's copy. True when it had either.
    pub fn forget_slot(&self, lock: &mut PageLock<'_>) -> bool {
        let page = lock.page();
        let before = lock.state();
        let active = lock.kind() == Kind::Active;
        match lock.forget_slot() {
            Some(slot) => self.release_slot(slot),
            None if before.borrowed().is_some() => self.returned(before),
            None => return false,
        }
        if active && self.caps().write_protect {
            // Dirty from now on: its writes must not fault (in SIGBUS mode without
            // pagemap, a write fault on a page with no slot could not be told).
            let addr = self.page_addr(page);
            let _ = self.uffd().write_protect(addr, PAGE_SIZE, false);
        }
        self.debug_check(lock);
        true
    }

    /// Takes a page off the LRU list its kind puts it on (only charged pages are on one).
    fn off_list(&self, lock: &PageLock<'_>) {
        if lock.state().is_charged() {
            self.lru().remove(lock.page());
        }
    }

    /// The invariant walker's check of one locked page, for what holds at the end of every
    /// page event: the word is well-formed, a slot it holds is in the swap cache exactly
    /// while the page is in memory and then as this page, and its frame exists. (Its list
    /// is checked by whole-region walks only: list adds wait in per-CPU batches.)
    pub fn check_page(&self, lock: &PageLock<'_>) -> Result<(), String> {
        let (page, st) = (lock.page(), lock.state());
        if !st.is_well_formed() {
            return Err(format!("page {page}: malformed state {st:?}"));
        }
        if let Some(slot) = st.slot() {
            let cached = self.swap().cache().peek(slot).map(|e| (e.region, e.page));
            let want = st.is_resident().then_some((self.region_id(), page as u32));
            if cached != want {
                return Err(format!(
                    "page {page} is {st:?} but its slot's swap cache entry is {cached:?}"
                ));
            }
        }
        match st.frame() {
            Some(f) if f as usize >= self.staging().frames() => {
                Err(format!("page {page} holds frame {f}, which does not exist"))
            }
            _ => Ok(()),
        }
    }

    /// Debug builds: [`Mm::check_page`] at the end of a page event, panicking on a
    /// disagreement. Nothing in release builds.
    fn debug_check(&self, lock: &PageLock<'_>) {
        #[cfg(debug_assertions)]
        if let Err(e) = self.check_page(lock) {
            panic!("after a page event: {e}");
        }
        #[cfg(not(debug_assertions))]
        let _ = lock;
    }
}

/// The page events, each on a real region (thread mode, nothing reclaimed unless asked):
/// what a page held goes where the event says, in the word, the lists, the budget, the
/// staging frames and the swap slots together. They need no root: unit-test builds fall
/// back to a user-mode-only userfaultfd (`uffd.rs`).
#[cfg(all(test, not(loom)))]
mod tests {
    use super::*;
    use crate::region::{testing, Advice, Region};

    fn untouched(pages: usize) -> Region {
        testing::region(pages, 0, |_| {})
    }

    fn region() -> Region {
        testing::region(64, 64, |_| {})
    }

    #[test]
    fn unmapping_an_active_page_gives_back_its_charge_and_its_place_on_the_list() {
        let region = region();
        let mm = region.mm();
        let resident = mm.budget().resident();
        let mut lock = mm.pages().lock(5);
        assert_eq!(lock.kind(), Kind::Active);
        mm.unmap_page(&mut lock);
        assert_eq!(lock.kind(), Kind::Unmapped);
        drop(lock);
        assert_eq!(mm.budget().resident(), resident - 1);
        assert_eq!(mm.lru().list_of(5), None);
    }

    #[test]
    fn a_page_taken_out_keeps_its_frame_until_what_it_held_is_released() {
        let region = region();
        region.advise(0, 8 * PAGE_SIZE, Advice::Cold).unwrap();
        let mm = region.mm();
        let free = mm.staging().free_frames().len();
        let mut lock = mm.pages().lock(3);
        assert_eq!(lock.kind(), Kind::Inactive);
        let held = mm.take_out(&mut lock);
        assert_eq!((lock.kind(), held.kind()), (Kind::Unmapped, Kind::Inactive));
        assert_eq!(mm.lru().list_of(3), None);
        assert_eq!(
            mm.staging().free_frames().len(),
            free,
            "the frame goes with the data"
        );
        mm.release_held(held);
        drop(lock);
        assert_eq!(mm.staging().free_frames().len(), free + 1);
        assert_eq!(
            mm.lru().list_of(4),
            Some(LruList::Inactive),
            "its neighbour stays"
        );
    }

    #[test]
    fn discarding_a_swapped_page_frees_its_slot() {
        let region = region();
        region.advise(0, 8 * PAGE_SIZE, Advice::PageOut).unwrap();
        let mm = region.mm();
        let slots = mm.slots_held();
        let mut lock = mm.pages().lock(2);
        assert_eq!(lock.kind(), Kind::Swapped);
        mm.discard_page(&mut lock);
        assert_eq!((lock.kind(), lock.state().slot()), (Kind::Discarded, None));
        drop(lock);
        assert_eq!(mm.slots_held(), slots - 1);
        region.check_invariants().unwrap();
    }

    #[test]
    fn a_zero_fill_that_stopped_short_gives_back_the_neighbours_it_did_not_fill() {
        let region = untouched(64);
        let mm = region.mm();
        let mut lock = mm.pages().lock(8);
        assert!(mm.pages().try_claim_none(9) && mm.pages().try_claim_none(10));
        let charged = mm.budget().try_charge(3);
        assert_eq!(charged, 3);
        mm.count(VmEvent::pgzerofill, 3);
        // As if the kernel filled pages 8 and 9 only (the ioctl is not this test's).
        assert!(mm.zero_filled(&mut lock, 8..11, 2));
        assert_eq!(lock.kind(), Kind::Active);
        drop(lock);
        assert_eq!(mm.pages().peek(9).0.kind(), Kind::Active);
        assert_eq!(mm.pages().peek(10).0.kind(), Kind::None);
        assert!(!mm.pages().peek(10).1, "unlocked");
        assert_eq!(mm.budget().resident(), 2);
        assert_eq!(mm.vmstat().get(VmEvent::pgzerofill), 2);
        mm.lru().drain_all();
        let (list, _) = mm.workingset().place(Arrival::FirstTouch);
        assert_eq!(mm.lru().list_of(8), Some(list));
        assert_eq!(mm.lru().list_of(10), None);
    }

    #[test]
    fn a_page_filled_after_its_discard_stays_lazily_freed() {
        let region = untouched(16);
        let mm = region.mm();
        let mut lock = mm.pages().lock(3);
        mm.discard_page(&mut lock);
        assert_eq!(mm.budget().try_charge(1), 1);
        assert!(mm.zero_filled(&mut lock, 3..4, 1));
        assert_eq!(lock.kind(), Kind::Lazyfree);
    }

    #[test]
    fn a_clean_page_mapped_back_keeps_its_slot_and_gives_back_its_frame() {
        let region = region();
        let mm = region.mm();
        // Out and back in clean: the page holds a slot, cached as it.
        region.advise(0, 4 * PAGE_SIZE, Advice::PageOut).unwrap();
        assert_eq!(testing::read(&region, 1), 2, "a read brings it back clean");
        region.advise(PAGE_SIZE, PAGE_SIZE, Advice::Cold).unwrap();
        let free = mm.staging().free_frames().len();
        let mut lock = mm.pages().lock(1);
        assert_eq!(lock.kind(), Kind::Inactive);
        let slot = lock.state().slot().expect("clean");
        // The frame still holds the data (this test maps nothing): given back, its
        // memory freed with the next batch.
        mm.mapped_back(&mut lock, MappedBack::CopiedInSignal);
        assert_eq!(
            (lock.kind(), lock.state().slot()),
            (Kind::Active, Some(slot))
        );
        assert!(lock.state().referenced());
        drop(lock);
        assert_eq!(mm.staging().free_frames().len(), free + 1);
        let cached = mm.swap().cache().peek(slot).expect("still cached");
        assert_eq!(cached.page, 1);
    }

    #[test]
    fn a_swapped_in_page_keeps_or_frees_its_slot_as_told() {
        let region = region();
        region.advise(0, 8 * PAGE_SIZE, Advice::PageOut).unwrap();
        let mm = region.mm();
        let slots = mm.slots_held();
        let resident = mm.budget().resident();
        let mut kept = mm.pages().lock(2);
        let kept_slot = kept.state().slot().unwrap();
        mm.swapped_in(&mut kept, SlotAfter::Cached, true, false);
        assert_eq!(kept.state().slot(), Some(kept_slot));
        let entry = mm.swap().cache().peek(kept_slot).unwrap();
        assert!(entry.readahead && entry.page == 2);
        let mut freed = mm.pages().lock(3);
        mm.swapped_in(&mut freed, SlotAfter::Freed, false, false);
        assert_eq!((freed.kind(), freed.state().slot()), (Kind::Active, None));
        assert_eq!(mm.slots_held(), slots - 1);
        // The charge is the fault path's, taken before the page is mapped.
        assert_eq!(mm.budget().resident(), resident);
        // What the kernel's page tables would hold, to let the walker agree.
        drop((kept, freed));
        mm.budget().try_charge(2);
        for (page, keep) in [(2usize, true), (3, false)] {
            let buf = [page as u8 + 1; PAGE_SIZE];
            mm.uffd()
                .copy(mm.page_addr(page), buf.as_ptr(), PAGE_SIZE, keep)
                .unwrap();
        }
        region.check_invariants().unwrap();
    }

    #[test]
    fn the_first_write_to_a_page_read_ahead_frees_its_slot_and_counts_as_its_use() {
        let region = region();
        let mm = region.mm();
        region.advise(0, 8 * PAGE_SIZE, Advice::PageOut).unwrap();
        let mut lock = mm.pages().lock(4);
        mm.swapped_in(&mut lock, SlotAfter::Cached, true, false);
        let slots = mm.slots_held();
        assert!(mm.dirtied(&mut lock), "its first use");
        assert_eq!((lock.kind(), lock.state().slot()), (Kind::Active, None));
        assert_eq!(mm.slots_held(), slots - 1);
        assert!(!mm.dirtied(&mut lock), "nothing left to free");
    }

    #[test]
    fn reclaim_events_free_frames_charges_and_slots_together() {
        let region = region();
        let mm = region.mm();
        // Page 0 all zeros, page 1 clean (slot cached), page 2 dirty.
        // SAFETY: inside the region.
        unsafe { region.as_ptr().write_bytes(0, PAGE_SIZE) };
        region
            .advise(PAGE_SIZE, PAGE_SIZE, Advice::PageOut)
            .unwrap();
        assert_eq!(testing::read(&region, 1), 2, "a read brings it back clean");
        region.advise(0, 3 * PAGE_SIZE, Advice::Cold).unwrap();
        mm.lru().drain_all();
        let resident = mm.budget().resident();
        let free = mm.staging().free_frames().len();
        let mut locks: Vec<_> = (0..3).map(|p| mm.pages().lock(p)).collect();
        for l in &locks {
            assert_eq!(l.kind(), Kind::Inactive);
            mm.lru().remove(l.page());
        }
        let clean_slot = locks[1].state().slot().unwrap();
        let new_slot = mm.swap().alloc_slot().unwrap();
        mm.swap().cache().add(new_slot, mm.cache_entry(2, false));
        let frames = vec![
            mm.dropped_zero(&mut locks[0]),
            mm.dropped_clean(&mut locks[1]),
            mm.swapped_out(&mut locks[2], new_slot),
        ];
        assert_eq!(mm.reclaimed(frames), 3);
        let kinds: Vec<_> = locks.iter().map(|l| l.kind()).collect();
        assert_eq!(kinds, [Kind::None, Kind::Swapped, Kind::Swapped]);
        assert_eq!(locks[1].state().slot(), Some(clean_slot));
        assert_eq!(mm.swap().cache().peek(clean_slot), None);
        assert_eq!(mm.swap().cache().peek(new_slot), None);
        assert_eq!(mm.budget().resident(), resident - 3);
        assert_eq!(mm.staging().free_frames().len(), free + 3);
        // Page 2's data is not in its new slot (this test wrote nothing there): forget it.
        mm.discard_page(&mut locks[2]);
        drop(locks);
        region.check_invariants().unwrap();
    }

    #[test]
    fn a_poisoned_page_gives_back_what_it_held() {
        let region = region();
        region.advise(0, 8 * PAGE_SIZE, Advice::PageOut).unwrap();
        let mm = region.mm();
        let slots = mm.slots_held();
        let mut lock = mm.pages().lock(6);
        mm.poisoned(&mut lock);
        assert_eq!((lock.kind(), lock.state().slot()), (Kind::Poisoned, None));
        drop(lock);
        assert_eq!(mm.slots_held(), slots - 1);
        region.check_invariants().unwrap();
    }

    #[test]
    fn a_discarded_clean_page_is_lazily_freed_keeping_its_charge_until_found_zapped() {
        let region = region();
        let mm = region.mm();
        region.advise(0, PAGE_SIZE, Advice::PageOut).unwrap();
        assert_eq!(testing::read(&region, 0), 1, "back in, clean");
        let (slots, resident) = (mm.slots_held(), mm.budget().resident());
        let mut lock = mm.pages().lock(0);
        assert!(lock.state().slot().is_some());
        mm.lazyfreed(&mut lock);
        assert_eq!((lock.kind(), lock.state().slot()), (Kind::Lazyfree, None));
        assert_eq!(mm.slots_held(), slots - 1);
        assert_eq!(mm.budget().resident(), resident, "still charged");
        assert_eq!(mm.vmstat().get(VmEvent::pglazyfree), 1);
        // Reclaim isolates it and finds it zapped.
        mm.lru().drain_all();
        mm.lru().remove(0);
        mm.lazyfree_zapped(&mut lock);
        assert_eq!(lock.kind(), Kind::Discarded);
        assert_eq!(mm.budget().resident(), resident - 1);
        assert_eq!(mm.vmstat().get(VmEvent::pglazyfreed), 1);
    }

    #[test]
    fn a_clean_page_that_forgets_its_slot_is_dirty_and_writable() {
        let region = region();
        let mm = region.mm();
        region.advise(0, PAGE_SIZE, Advice::PageOut).unwrap();
        assert_eq!(testing::read(&region, 0), 1, "back in, clean");
        let slots = mm.slots_held();
        let mut lock = mm.pages().lock(0);
        assert!(mm.forget_slot(&mut lock));
        assert_eq!(lock.state().slot(), None);
        assert!(!mm.forget_slot(&mut lock), "nothing left to forget");
        drop(lock);
        assert_eq!(mm.slots_held(), slots - 1);
        assert!(!mm.pagemap_entry(0).unwrap().write_protected);
        region.check_invariants().unwrap();
    }

    #[test]
    fn an_inherited_or_rehomed_page_holds_its_new_slot() {
        let region = untouched(16);
        let mm = region.mm();
        let slot = mm.swap().alloc_slot().unwrap();
        let mut lock = mm.pages().lock(3);
        mm.inherited(&mut lock, slot);
        assert_eq!(
            (lock.kind(), lock.state().slot()),
            (Kind::Swapped, Some(slot))
        );
        assert_eq!(mm.slots_held(), 1);
        assert_eq!(mm.swap().owner(slot), Some((mm.region_id(), 3)));
        // A swap-in that freed its slot early, then wrote the page to another one.
        mm.release_slot(slot);
        let other = mm.swap().alloc_slot().unwrap();
        mm.rehomed(&mut lock, other);
        assert_eq!(lock.state().slot(), Some(other));
        assert_eq!(mm.slots_held(), 1);
        // Nothing was written to the slots: the page goes.
        mm.discard_page(&mut lock);
        drop(lock);
        assert_eq!(mm.slots_held(), 0);
        region.check_invariants().unwrap();
    }

    #[test]
    fn the_page_check_names_a_slot_the_swap_cache_does_not_hold_as_the_page() {
        let region = region();
        region.advise(0, 8 * PAGE_SIZE, Advice::PageOut).unwrap();
        let mm = region.mm();
        let lock = mm.pages().lock(1);
        assert_eq!(mm.check_page(&lock), Ok(()));
        let slot = lock.state().slot().unwrap();
        mm.swap().cache().add(slot, mm.cache_entry(1, false));
        let err = mm.check_page(&lock).unwrap_err();
        assert!(err.contains("swap cache"), "{err}");
        mm.swap().cache().delete(slot);
    }
}
