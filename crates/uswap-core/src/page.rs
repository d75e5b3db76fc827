//! The page table: one atomic 64-bit state word per page of a region, and the named
//! transitions between page states.
//!
//! ```text
//!  63            32 31            7   6    5    4    3    2..0
//! +----------------+---------------+----+----+----+----+------+
//! | swap slot      | staging frame | arm| sh | ref|lock| kind |
//! +----------------+---------------+----+----+----+----+------+
//! ```
//! `kind` says where the data is. A page with a swap slot has a valid copy on the swap
//! device (it is clean); a write after swap-in frees the slot. The frame is the staging
//! frame holding an inactive page's data. `ref` is the referenced bit (second-chance
//! aging of hot pages); `arm` says that this active page has been write-protected, with no
//! write seen, since it was mapped, so its written bit shows use (`References::Written`);
//! `sh` marks an active page shared copy-on-write with another process since a fork (see [`PageState::shared`]), or a page whose data a fork child
//! borrows (see [`PageState::borrowed`]: swapped, or mapped and unchanged since it was
//! read; the frame field then names what it is borrowed from, and the slot field the slot
//! or staging frame there). The lock bit serialises every transition.
//!
//! # Locking
//!
//! The page lock (the lock bit of a page's word) guards the page's kind, frame and slot,
//! and the page's presence in the region's page tables: no one maps or unmaps a page
//! without it. It is held across swap I/O and across `charge` (which may reclaim
//! directly), so **reclaim never waits for a page lock**: it only try-locks
//! (`Lru::isolate`, `try_claim_none`) and skips pages it cannot take. Where it sits among
//! uswap's other locks, and what each path takes under it, is the lock table of
//! `lockdep.rs`; [`PageTable::lock`] and the guards report to it in debug builds.

use crate::lockdep::{self, Rank};
use crate::sync::{backoff, zeroed_slice, AtomicU64, XorU64};
use std::sync::atomic::Ordering::{Acquire, Relaxed, Release};

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
#[repr(u8)]
pub enum Kind {
    /// Never touched, or discarded (MADV_DONTNEED): the next touch zero-fills.
    None = 0,
    /// Mapped in the region, on the active list, charged to the budget.
    Active = 1,
    /// Unmapped, data kept in a staging frame, on the inactive list, charged.
    Inactive = 2,
    /// Data only in its swap slot.
    Swapped = 3,
    /// Data lost (failed verification or I/O): every access fails.
    Poisoned = 4,
    /// The program unmapped (munmap) or moved (mremap) this page away: nothing is here.
    Unmapped = 5,
    /// The program discarded it (MADV_DONTNEED/MADV_FREE): the next touch zero-fills, but
    /// only this page. Fault-around leaves it alone, because the kernel zaps the range only
    /// after uswap has read the event, and would take a neighbour filled in between.
    Discarded = 6,
    /// Mapped when the program discarded it: MADV_DONTNEED zaps it, MADV_FREE leaves it
    /// mapped with its data until it is written or reclaimed, and the event does not say
    /// which; or zero-filled after a discard, when the discard's zap may still follow.
    /// Charged, on the active list, no slot. A fault on it means the kernel zapped it
    /// (zero-filled again, no new charge, still lazily freed); aging moves it out like an
    /// active page, or, finding nothing to move, frees it (the kernel's lazy free,
    /// `pglazyfreed`).
    Lazyfree = 7,
}

const KIND_MASK: u64 = 0b111;
const LOCKED: u64 = 1 << 3;
/// An active page that was referenced again after aging had taken it off the active list
/// (it faulted back from the inactive list): aging passes over it once more (second
/// chance), as the kernel's accessed bit would keep a hot page.
const REFERENCED: u64 = 1 << 4;
/// An active page a fork child inherited mapped: the kernel maps it copy-on-write here and
/// in the process that made it, which pays for it (see [`PageState::shared`]); on a
/// swapped page, one the child borrows (see [`PageState::borrowed`]).
const SHARED: u64 = 1 << 5;
/// An active page aging has write-protected since it was mapped (`References::Written`):
/// its written bit shows a write since, where a page just mapped reads as written after
/// the very access that faulted it in.
const ARMED: u64 = 1 << 6;
const FRAME_SHIFT: u32 = 7;
const FRAME_BITS: u32 = 25;
const FRAME_NONE: u32 = (1 << FRAME_BITS) - 1;
const SLOT_SHIFT: u32 = 32;
const SLOT_NONE: u32 = u32::MAX;

/// Largest number of staging frames (resident pages) a region can have: 128 GiB.
pub const MAX_FRAMES: u64 = FRAME_NONE as u64;

/// A decoded state word (never includes the lock bit).
#[derive(Clone, Copy, PartialEq, Eq)]
pub struct PageState(u64);

impl std::fmt::Debug for PageState {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        if let Some((lender, at)) = self.borrowed() {
            return write!(f, "{:?}(borrowed: lender {lender}, at {at})", self.kind());
        }
        write!(
            f,
            "{:?}(frame {:?}, slot {:?}{}{})",
            self.kind(),
            self.frame(),
            self.slot(),
            if self.referenced() {
                ", referenced"
            } else {
                ""
            },
            if self.armed() { ", armed" } else { "" }
        )
    }
}

impl PageState {
    pub const NONE: PageState = PageState::of(Kind::None, None, None);

    const fn of(kind: Kind, frame: Option<u32>, slot: Option<u32>) -> Self {
        let f = match frame {
            Some(f) => f,
            None => FRAME_NONE,
        };
        let s = match slot {
            Some(s) => s,
            None => SLOT_NONE,
        };
        PageState(kind as u64 | ((f as u64) << FRAME_SHIFT) | ((s as u64) << SLOT_SHIFT))
    }

    pub fn kind(self) -> Kind {
        match self.0 & KIND_MASK {
            0 => Kind::None,
            1 => Kind::Active,
            2 => Kind::Inactive,
            3 => Kind::Swapped,
            4 => Kind::Poisoned,
            5 => Kind::Unmapped,
            6 => Kind::Discarded,
            _ => Kind::Lazyfree,
        }
    }

    pub fn frame(self) -> Option<u32> {
        let f = self.frame_field();
        (f != FRAME_NONE && !self.is_borrowed()).then_some(f)
    }

    /// The page's slot on the region's own swap device.
    pub fn slot(self) -> Option<u32> {
        let s = self.slot_field();
        (s != SLOT_NONE && !self.is_borrowed()).then_some(s)
    }

    /// A page of a fork child whose data its parent (or an earlier ancestor) lent at the
    /// fork rather than copied: (which of the region's lenders, the slot or staging frame
    /// there; `mm/lender.rs`). The child never frees it (the ancestor does, once the
    /// fork's family is done: `swapfile/swap_map.rs`). Swapped, the child reads it from
    /// there at its first access. Active, it was read from a lender's slot and is
    /// unchanged since: mapped write-protected and charged like a clean page, it becomes
    /// this process's own at its first write, and aging drops it back to swapped without a
    /// write, as the kernel drops a clean swap cache page both processes' entries name.
    pub fn borrowed(self) -> Option<(u32, u32)> {
        self.is_borrowed()
            .then(|| (self.frame_field(), self.slot_field()))
    }

    fn is_borrowed(self) -> bool {
        let kind = self.0 & KIND_MASK;
        self.0 & SHARED != 0
            && (kind == Kind::Swapped as u64 || kind == Kind::Active as u64)
            && self.frame_field() != FRAME_NONE
    }

    fn frame_field(self) -> u32 {
        ((self.0 >> FRAME_SHIFT) as u32) & FRAME_NONE
    }

    fn slot_field(self) -> u32 {
        (self.0 >> SLOT_SHIFT) as u32
    }

    /// Whether aging is to pass over this active page once more.
    pub fn referenced(self) -> bool {
        self.0 & REFERENCED != 0
    }

    /// Whether aging has write-protected this active page since it was mapped.
    pub fn armed(self) -> bool {
        self.0 & ARMED != 0
    }

    /// Whether the page's data is in memory (mapped, parked or lazily freed).
    pub fn is_resident(self) -> bool {
        matches!(self.kind(), Kind::Active | Kind::Inactive | Kind::Lazyfree)
    }

    /// An active page this process inherited at a fork, still mapped copy-on-write with
    /// the process that made it (a cgroup charges a page once, to whoever allocated it):
    /// not charged here, on no LRU list (moving it out would copy it, and free nothing
    /// while the other process maps it), write-protected so its first write here is seen.
    /// It becomes an ordinary active page at that write, or when found mapped here alone.
    pub fn shared(self) -> bool {
        self.0 & (SHARED | KIND_MASK) == SHARED | Kind::Active as u64
            && self.frame_field() == FRAME_NONE
    }

    /// Whether a write to this active page faults to uswap first: it keeps a swap copy
    /// (clean, its own or borrowed), or is shared with a fork relative; all are
    /// write-protected.
    pub fn write_faults(self) -> bool {
        self.slot().is_some() || self.0 & SHARED != 0
    }

    /// Whether the page counts against the resident budget (and sits on an LRU list).
    pub fn is_charged(self) -> bool {
        self.is_resident() && !self.shared()
    }

    /// The invariants of each kind: which of frame and slot it may carry.
    pub fn is_well_formed(self) -> bool {
        if self.0 & LOCKED != 0 {
            return false;
        }
        if self.is_borrowed() {
            return self.slot_field() != SLOT_NONE;
        }
        if (self.referenced() || self.armed()) && self.kind() != Kind::Active {
            return false;
        }
        if self.0 & SHARED != 0 && !self.shared() {
            return false;
        }
        if self.shared() && self.slot().is_some() {
            return false;
        }
        match self.kind() {
            Kind::None | Kind::Poisoned | Kind::Unmapped | Kind::Discarded => {
                self.frame().is_none() && self.slot().is_none()
            }
            Kind::Active => self.frame().is_none(),
            Kind::Lazyfree => self.frame().is_none() && self.slot().is_none(),
            Kind::Inactive => self.frame().is_some(),
            Kind::Swapped => self.frame().is_none() && self.slot().is_some(),
        }
    }
}

/// A page's state word, reading `NONE` from zeroed memory.
type Word = XorU64<{ PageState::NONE.0 }>;

/// Pages per bit of [`PageTable`]'s map of used chunks.
pub const CHUNK_PAGES: usize = 512;

/// The state words of all pages of one region.
pub struct PageTable {
    words: Box<[Word]>,
    /// A bit per chunk of `CHUNK_PAGES` pages, set once any of its pages has been anything
    /// but `None` (never cleared): a walk over a large, mostly untouched region (fork's)
    /// skips the rest.
    used: Box<[AtomicU64]>,
}

impl PageTable {
    /// Every page `None`, from zeroed memory: a word costs nothing until its page is used.
    pub fn new(pages: usize) -> Self {
        let chunks = pages.div_ceil(CHUNK_PAGES);
        PageTable {
            words: zeroed_slice(pages, || Word::new(PageState::NONE.0)),
            used: (0..chunks.div_ceil(64))
                .map(|_| AtomicU64::new(0))
                .collect(),
        }
    }

    /// Publishes `page`'s word (unlocked), noting its chunk as used first.
    fn publish(&self, page: usize, word: u64) {
        if word != PageState::NONE.0 {
            let chunk = page / CHUNK_PAGES;
            let (bits, bit) = (&self.used[chunk / 64], 1u64 << (chunk % 64));
            if bits.load(Relaxed) & bit == 0 {
                bits.fetch_or(bit, Relaxed);
            }
        }
        self.words[page].store(word, Release);
    }

    /// A locked page's coming state, stored with the lock bit still set.
    fn show(&self, page: usize, word: u64) {
        self.publish(page, word | LOCKED);
    }

    /// The page ranges of the chunks that have been used, in order (adjacent ones merged):
    /// every page outside them is `None`, unless it changes meanwhile.
    pub fn used_runs(&self) -> Vec<std::ops::Range<usize>> {
        let mut runs: Vec<std::ops::Range<usize>> = Vec::new();
        for (i, bits) in self.used.iter().enumerate() {
            let mut b = bits.load(Acquire);
            while b != 0 {
                let chunk = i * 64 + b.trailing_zeros() as usize;
                b &= b - 1;
                let start = chunk * CHUNK_PAGES;
                let end = (start + CHUNK_PAGES).min(self.words.len());
                match runs.last_mut() {
                    Some(run) if run.end == start => run.end = end,
                    _ => runs.push(start..end),
                }
            }
        }
        runs
    }

    pub fn len(&self) -> usize {
        self.words.len()
    }

    /// The state and whether someone holds the page lock.
    pub fn peek(&self, page: usize) -> (PageState, bool) {
        let w = self.words[page].load(Acquire);
        (PageState(w & !LOCKED), w & LOCKED != 0)
    }

    /// Takes the page lock if it is free.
    pub fn try_lock(&self, page: usize) -> Option<PageLock<'_>> {
        let word = &self.words[page];
        let w = word.load(Relaxed);
        if w & LOCKED != 0 {
            return None;
        }
        word.compare_exchange(w, w | LOCKED, Acquire, Relaxed)
            .ok()
            .map(|_| {
                lockdep::acquired(Rank::Page);
                PageLock {
                    table: self,
                    page,
                    state: PageState(w),
                }
            })
    }

    /// Takes the page lock, waiting for the holder (a fault or reclaim in progress).
    pub fn lock(&self, page: usize) -> PageLock<'_> {
        lockdep::before_blocking(Rank::Page);
        let mut round = 0;
        loop {
            if let Some(l) = self.try_lock(page) {
                return l;
            }
            backoff(round);
            round += 1;
        }
    }

    /// Locks an untouched page without a guard, for a fault-around batch that allocates
    /// nothing; finish with [`PageTable::publish_active`] or [`PageTable::unclaim`].
    pub fn try_claim_none(&self, page: usize) -> bool {
        let none = PageState::NONE.0;
        let claimed = self.words[page]
            .compare_exchange(none, none | LOCKED, Acquire, Relaxed)
            .is_ok();
        if claimed {
            lockdep::acquired(Rank::Page);
        }
        claimed
    }

    /// A claimed page was filled with zeros: it is active now, and unlocked.
    pub fn publish_active(&self, page: usize) {
        debug_assert_eq!(self.words[page].load(Relaxed), PageState::NONE.0 | LOCKED);
        self.publish(page, PageState::of(Kind::Active, None, None).0);
        lockdep::released(Rank::Page);
    }

    /// A claimed page was not filled after all: untouched again, and unlocked.
    pub fn unclaim(&self, page: usize) {
        debug_assert_eq!(self.words[page].load(Relaxed), PageState::NONE.0 | LOCKED);
        self.words[page].store(PageState::NONE.0, Release);
        lockdep::released(Rank::Page);
    }
}

/// A held page lock. Its state changes only through the named transitions below, each of
/// which checks (in debug builds) that it starts from a kind it applies to. The state is
/// published and the lock released on drop.
pub struct PageLock<'a> {
    table: &'a PageTable,
    page: usize,
    state: PageState,
}

impl PageLock<'_> {
    pub fn page(&self) -> usize {
        self.page
    }

    pub fn state(&self) -> PageState {
        self.state
    }

    pub fn kind(&self) -> Kind {
        self.state.kind()
    }

    fn become_(&mut self, kind: Kind, frame: Option<u32>, slot: Option<u32>) -> PageState {
        let old = self.state;
        self.state = PageState::of(kind, frame, slot);
        if kind == Kind::Active && old.kind() == Kind::Active {
            self.state.0 |= old.0 & (REFERENCED | ARMED);
            if old.shared() {
                self.state.0 |= SHARED;
            }
        }
        debug_assert!(self.state.is_well_formed(), "{:?}", self.state);
        old
    }

    fn expect(&self, kinds: &[Kind], transition: &str) {
        debug_assert!(
            kinds.contains(&self.kind()),
            "page {}: {transition} from {:?}",
            self.page,
            self.state
        );
    }

    /// Shows the state this lock will publish to those who look without the lock, before
    /// it is let go (the word stays locked): a fork's note must not take a page moved out
    /// of the region for a mapped one.
    pub fn show(&self) {
        self.table.show(self.page, self.state.0);
    }

    /// First touch: an untouched (or discarded, or regrown) page was zero-filled and mapped.
    pub fn map_new(&mut self) {
        self.expect(&[Kind::None, Kind::Unmapped, Kind::Discarded], "map_new");
        self.become_(Kind::Active, None, None);
    }

    /// An inactive page was mapped back: returns its staging frame. A clean page keeps its
    /// slot.
    pub fn activate(&mut self) -> u32 {
        self.expect(&[Kind::Inactive], "activate");
        let old = self.become_(Kind::Active, None, self.state.slot());
        self.state.0 |= REFERENCED;
        old.frame().expect("an inactive page has a frame")
    }

    /// This active page was mapped write-protected and not written by the access that
    /// faulted it in: from now on its written bit shows use.
    pub fn arm(&mut self) {
        self.expect(&[Kind::Active], "arm");
        self.state.0 |= ARMED;
    }

    /// Aging write-protected this active page: from now on its written bit shows use.
    /// `written`: it had been written since aging last protected it, so it is referenced,
    /// as a fault back from the inactive list would have made it.
    pub fn armed_after(&mut self, written: bool) {
        self.expect(&[Kind::Active], "armed_after");
        self.state.0 |= ARMED | if written { REFERENCED } else { 0 };
    }

    /// Aging reached a referenced active page: it stays active this time, unreferenced.
    /// Whether it was referenced.
    pub fn second_chance(&mut self) -> bool {
        let referenced = self.state.referenced();
        self.state.0 &= !REFERENCED;
        referenced
    }

    /// An active (or lazily freed, still mapped) page was moved into staging `frame`
    /// (unmapped, data kept).
    pub fn deactivate(&mut self, frame: u32) {
        self.expect(&[Kind::Active, Kind::Lazyfree], "deactivate");
        self.become_(Kind::Inactive, Some(frame), self.state.slot());
    }

    /// A dirty inactive page was written to `slot`: returns its frame, now free.
    pub fn swap_out(&mut self, slot: u32) -> u32 {
        self.expect(&[Kind::Inactive], "swap_out");
        debug_assert!(self.state.slot().is_none(), "a dirty page has no slot");
        let old = self.become_(Kind::Swapped, None, Some(slot));
        old.frame().expect("an inactive page has a frame")
    }

    /// A clean inactive page (its slot still holds its data) was dropped without I/O:
    /// returns its frame.
    pub fn drop_clean(&mut self) -> u32 {
        self.expect(&[Kind::Inactive], "drop_clean");
        let old = self.become_(Kind::Swapped, None, self.state.slot());
        debug_assert!(old.slot().is_some(), "only a clean page is dropped");
        old.frame().expect("an inactive page has a frame")
    }

    /// An all-zero inactive page was forgotten: returns what it held (frame, maybe slot).
    pub fn drop_zero(&mut self) -> PageState {
        self.expect(&[Kind::Inactive], "drop_zero");
        self.become_(Kind::None, None, None)
    }

    /// A swapped page was read, verified and mapped. `slot` is the slot it keeps (clean,
    /// write-protected) or `None` when the slot was given up.
    pub fn swap_in(&mut self, slot: Option<u32>) {
        self.expect(&[Kind::Swapped], "swap_in");
        self.become_(Kind::Active, None, slot);
    }

    /// A borrowed swapped page was read from a lender's slot and mapped write-protected:
    /// active, its data still the lender's too (see [`PageState::borrowed`]).
    pub fn map_borrowed(&mut self) {
        self.expect(&[Kind::Swapped], "map_borrowed");
        let (lender, at) = self.state.borrowed().expect("a borrowed page");
        self.state = PageState::of(Kind::Active, Some(lender), Some(at));
        self.state.0 |= SHARED;
    }

    /// Aging moved out an active borrowed page, unchanged since it was read: borrowed
    /// again, as the kernel drops a clean swap-cache page whose slot is still shared.
    pub fn drop_borrowed(&mut self) {
        self.expect(&[Kind::Active], "drop_borrowed");
        let (lender, at) = self.state.borrowed().expect("a borrowed page");
        self.state = PageState::of(Kind::Swapped, Some(lender), Some(at));
        self.state.0 |= SHARED;
    }

    /// Swapoff: a resident page gives up its slot (it is dirty from now on), or a mapped
    /// borrowed page its lender's copy (it is this process's own). Returns the slot to
    /// free.
    pub fn forget_slot(&mut self) -> Option<u32> {
        self.expect(
            &[Kind::Active, Kind::Inactive, Kind::Lazyfree],
            "forget_slot",
        );
        let frame = self.state.frame();
        self.become_(self.state.kind(), frame, None).slot()
    }

    /// A swapped page whose slot was given up early (swap nearly full) was written back to
    /// a new slot, because it could not be charged after all.
    pub fn rehome(&mut self, slot: u32) {
        self.expect(&[Kind::Swapped], "rehome");
        self.become_(Kind::Swapped, None, Some(slot));
    }

    /// The first write to a clean page: its swap copy is stale (or its lender's, for a
    /// borrowed page, which is this process's own from now on). Returns the slot to free.
    pub fn dirty(&mut self) -> Option<u32> {
        self.expect(&[Kind::Active], "dirty");
        debug_assert!(!self.state.shared(), "a shared page is unshared first");
        self.become_(Kind::Active, None, None).slot()
    }

    /// A fork child's page the kernel mapped copy-on-write from the parent (see
    /// [`PageState::shared`]).
    pub fn share(&mut self) {
        self.expect(&[Kind::None], "share");
        self.become_(Kind::Active, None, None);
        self.state.0 |= SHARED;
    }

    /// A shared page became this process's own (its first write here, or the other
    /// process no longer maps it): an ordinary active page from now on.
    pub fn unshare(&mut self) {
        self.expect(&[Kind::Active], "unshare");
        debug_assert!(self.state.shared());
        self.state.0 &= !SHARED;
    }

    /// A fork child's page: its data, as the parent had it, is in `slot` of the child's
    /// own swap device.
    pub fn inherit(&mut self, slot: u32) {
        self.expect(&[Kind::None], "inherit");
        self.become_(Kind::Swapped, None, Some(slot));
    }

    /// A fork child's page: its data, as the parent had it, is at `slot` (a slot or a
    /// staging frame) of lender `device` (see [`PageState::borrowed`]).
    pub fn inherit_borrowed(&mut self, device: u32, slot: u32) {
        self.expect(&[Kind::None], "inherit_borrowed");
        debug_assert!(device < FRAME_NONE && slot != SLOT_NONE);
        self.state = PageState::of(Kind::Swapped, Some(device), Some(slot));
        self.state.0 |= SHARED;
    }

    /// The data is lost: every later access fails. Returns what the page held.
    pub fn poison(&mut self) -> PageState {
        self.become_(Kind::Poisoned, None, None)
    }

    /// MADV_DONTNEED/MADV_FREE: the range reads as zeros from now on. Returns what the page
    /// held, for the caller to release (budget, frame, slot).
    pub fn discard(&mut self) -> PageState {
        self.become_(Kind::Discarded, None, None)
    }

    /// MADV_DONTNEED/MADV_FREE on a mapped page without a slot: the kernel may or may not
    /// have zapped it (see [`Kind::Lazyfree`]).
    pub fn lazyfree(&mut self) {
        self.expect(&[Kind::Active], "lazyfree");
        debug_assert!(self.state.slot().is_none(), "its slot is freed first");
        self.become_(Kind::Lazyfree, None, None);
    }

    /// munmap, or the source of an mremap: nothing is mapped here any more. Returns what the
    /// page held, for the caller to release or move.
    pub fn unmap(&mut self) -> PageState {
        self.become_(Kind::Unmapped, None, None)
    }

    /// The target of an mremap inside the region: takes over what the source page held.
    pub fn install(&mut self, moved: PageState) {
        self.expect(&[Kind::Unmapped, Kind::None, Kind::Discarded], "install");
        debug_assert!(moved.is_well_formed());
        self.state = moved;
    }
}

impl Drop for PageLock<'_> {
    fn drop(&mut self) {
        // The end of every page event: what it leaves must be a state a page can be in.
        debug_assert!(
            self.state.is_well_formed(),
            "page {} left malformed: {:?}",
            self.page,
            self.state
        );
        self.table.publish(self.page, self.state.0);
        lockdep::released(Rank::Page);
    }
}

#[cfg(all(test, not(loom)))]
mod tests {
    use super::*;
    use proptest::prelude::*;

    const KINDS: [Kind; 8] = [
        Kind::None,
        Kind::Active,
        Kind::Inactive,
        Kind::Swapped,
        Kind::Poisoned,
        Kind::Unmapped,
        Kind::Discarded,
        Kind::Lazyfree,
    ];

    proptest! {
        #[test]
        fn fields_round_trip_independently(kind in 0usize..8, frame in proptest::option::of(0u32..FRAME_NONE), slot in proptest::option::of(0u32..SLOT_NONE)) {
            let s = PageState::of(KINDS[kind], frame, slot);
            prop_assert_eq!(s.kind(), KINDS[kind]);
            prop_assert_eq!(s.frame(), frame);
            prop_assert_eq!(s.slot(), slot);
            prop_assert_eq!(s.0 & (LOCKED | SHARED), 0);
        }
    }

    #[test]
    fn used_runs_cover_every_chunk_a_page_left_none_in_and_no_other() {
        let t = PageTable::new(5 * CHUNK_PAGES + 7);
        assert!(t.used_runs().is_empty());
        t.lock(3).map_new();
        let mut l = t.lock(CHUNK_PAGES + 1);
        l.map_new();
        l.unmap();
        drop(l);
        assert!(t.try_claim_none(5 * CHUNK_PAGES + 2));
        t.publish_active(5 * CHUNK_PAGES + 2);
        // A lock taken and let go with the page still untouched marks nothing.
        drop(t.lock(3 * CHUNK_PAGES));
        assert_eq!(
            t.used_runs(),
            vec![0..2 * CHUNK_PAGES, 5 * CHUNK_PAGES..5 * CHUNK_PAGES + 7]
        );
    }

    #[test]
    fn a_page_goes_out_and_comes_back_through_named_transitions() {
        let t = PageTable::new(1);
        let mut l = t.lock(0);
        l.map_new();
        l.deactivate(7);
        assert_eq!(l.swap_out(3), 7);
        assert_eq!((l.kind(), l.state().slot()), (Kind::Swapped, Some(3)));
        l.swap_in(Some(3));
        assert_eq!(l.dirty(), Some(3));
        l.deactivate(9);
        assert_eq!(l.discard().frame(), Some(9));
        assert_eq!(l.kind(), Kind::Discarded);
        l.map_new();
        l.deactivate(5);
        assert_eq!(l.activate(), 5);
        assert!(
            l.state().referenced(),
            "a page faulted back from inactive is referenced"
        );
        assert_eq!(l.dirty(), None);
        assert!(
            l.second_chance(),
            "the bit survives a transition within active"
        );
        assert!(!l.second_chance());
        l.lazyfree();
        l.deactivate(4);
        assert_eq!(l.kind(), Kind::Inactive);
        l.unmap();
        drop(l);
        assert_eq!(t.peek(0).0.kind(), Kind::Unmapped);
    }

    #[test]
    #[cfg(debug_assertions)]
    #[should_panic(expected = "activate from")]
    fn a_transition_from_the_wrong_kind_is_caught() {
        let t = PageTable::new(1);
        t.lock(0).activate();
    }

    #[test]
    fn lock_publishes_state_on_release_and_excludes_others() {
        let t = PageTable::new(2);
        let mut l = t.lock(1);
        assert!(t.try_lock(1).is_none());
        assert!(t.peek(1).1);
        l.map_new();
        drop(l);
        let (s, locked) = t.peek(1);
        assert!(!locked);
        assert_eq!(s.kind(), Kind::Active);
        assert_eq!(t.peek(0).0, PageState::NONE);
        assert!(t.try_claim_none(0));
        assert!(!t.try_claim_none(0));
        t.publish_active(0);
        assert_eq!(t.peek(0), (PageState::of(Kind::Active, None, None), false));
    }

    #[test]
    fn a_borrowed_page_read_clean_is_dropped_back_each_time_and_owned_when_written() {
        let t = PageTable::new(1);
        let mut l = t.lock(0);
        l.inherit_borrowed(2, 77);
        let lent = l.state();
        assert_eq!(lent.borrowed(), Some((2, 77)));
        assert!(!lent.is_charged());
        l.map_borrowed();
        let st = l.state();
        assert_eq!((st.kind(), st.borrowed()), (Kind::Active, Some((2, 77))));
        assert_eq!((st.frame(), st.slot()), (None, None), "not this region's");
        assert!(st.is_charged() && st.write_faults() && !st.shared());
        assert!(st.is_well_formed());
        l.drop_borrowed();
        let st = l.state();
        assert_eq!((st.kind(), st.borrowed()), (Kind::Swapped, Some((2, 77))));
        assert!(!st.is_charged() && st.is_well_formed());
        assert_eq!(st, lent, "dropped, as it was lent");
        l.map_borrowed();
        assert_eq!(
            l.state().borrowed(),
            Some((2, 77)),
            "read again, still borrowed"
        );
        assert_eq!(l.dirty(), None, "a lender's slot is not freed here");
        let st = l.state();
        assert_eq!(
            (st.kind(), st.borrowed(), st.slot()),
            (Kind::Active, None, None)
        );
        assert!(!st.write_faults() && !st.shared() && st.is_well_formed());
    }

    #[test]
    fn stress_many_threads_move_a_page_through_its_states_under_the_lock() {
        let t = PageTable::new(4);
        std::thread::scope(|s| {
            for _ in 0..8 {
                s.spawn(|| {
                    for i in 0..20_000u32 {
                        let mut l = t.lock(i as usize % 4);
                        match l.kind() {
                            Kind::None | Kind::Discarded => l.map_new(),
                            Kind::Active => l.deactivate(i),
                            Kind::Inactive => {
                                l.swap_out(i);
                            }
                            Kind::Swapped => {
                                l.poison();
                            }
                            Kind::Poisoned => {
                                l.unmap();
                            }
                            Kind::Unmapped => {
                                l.discard();
                            }
                            Kind::Lazyfree => l.deactivate(i),
                        }
                        assert!(l.state().is_well_formed());
                    }
                });
            }
        });
        // Each page made 40,000 transitions: None -> Active, then 39,999 round the cycle
        // of 6 from Active (Inactive, Swapped, Poisoned, Unmapped, Discarded, Active):
        // 39,999 = 6 * 6666 + 3 ends three steps on, at Poisoned.
        for p in 0..4 {
            assert_eq!(t.peek(p).0.kind(), Kind::Poisoned);
        }
    }
}

/// Model check of the page lock: `RUSTFLAGS="--cfg loom" cargo test -p uswap-core --lib --release page::loom`.
#[cfg(all(test, loom))]
mod loom_tests {
    use super::*;

    #[test]
    fn page_lock_is_mutually_exclusive_and_publishes_transitions() {
        loom::model(|| {
            let t = std::sync::Arc::new(PageTable::new(1));
            let handles: Vec<_> = (0..2)
                .map(|_| {
                    let t = t.clone();
                    loom::thread::spawn(move || {
                        let mut l = t.lock(0);
                        match l.kind() {
                            Kind::None | Kind::Discarded => l.map_new(),
                            _ => l.deactivate(1),
                        }
                    })
                })
                .collect();
            for h in handles {
                h.join().unwrap();
            }
            let (s, locked) = t.peek(0);
            assert!(!locked);
            assert_eq!((s.kind(), s.frame()), (Kind::Inactive, Some(1)));
        });
    }
}
