//! The page table: one atomic 64-bit state word per page of a region.
//!
//! ```text
//!  63            32 31              4  3      2..0
//! +----------------+------------------+------+------+
//! | swap slot      | staging frame    | lock | kind |
//! +----------------+------------------+------+------+
//! ```
//! `kind` says where the data is. A page with a swap slot has a valid copy on the swap
//! device (it is clean); a write after swap-in frees the slot. The frame is the staging
//! frame holding an inactive page's data. The lock bit serialises every transition: the
//! fault path and reclaim both take it, so the rest of the word only changes under it.

use crate::sync::{backoff, AtomicU64};
use std::sync::atomic::Ordering::{Acquire, Relaxed, Release};

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
#[repr(u8)]
pub enum Kind {
    /// Never touched (or dropped as all zeros): the next touch zero-fills.
    None = 0,
    /// Mapped in the region, on the active list.
    Active = 1,
    /// Unmapped, data kept in a staging frame, on the inactive list.
    Inactive = 2,
    /// Data only in its swap slot.
    Swapped = 3,
    /// Data lost (failed verification or I/O): every access fails.
    Poisoned = 4,
}

const KIND_MASK: u64 = 0b111;
const LOCKED: u64 = 1 << 3;
const FRAME_SHIFT: u32 = 4;
const FRAME_BITS: u32 = 28;
const FRAME_NONE: u32 = (1 << FRAME_BITS) - 1;
const SLOT_SHIFT: u32 = 32;
const SLOT_NONE: u32 = u32::MAX;

/// Largest number of staging frames (resident pages) a region can have: 1 TiB.
pub const MAX_FRAMES: u64 = FRAME_NONE as u64;

/// A decoded state word (never includes the lock bit).
#[derive(Clone, Copy, PartialEq, Eq)]
pub struct PageState(u64);

impl std::fmt::Debug for PageState {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(
            f,
            "{:?}(frame {:?}, slot {:?})",
            self.kind(),
            self.frame(),
            self.slot()
        )
    }
}

impl PageState {
    pub const NONE: PageState = PageState::new(Kind::None);

    pub const fn new(kind: Kind) -> Self {
        PageState(
            kind as u64 | ((FRAME_NONE as u64) << FRAME_SHIFT) | ((SLOT_NONE as u64) << SLOT_SHIFT),
        )
    }

    pub fn kind(self) -> Kind {
        match self.0 & KIND_MASK {
            0 => Kind::None,
            1 => Kind::Active,
            2 => Kind::Inactive,
            3 => Kind::Swapped,
            _ => Kind::Poisoned,
        }
    }

    pub fn frame(self) -> Option<u32> {
        let f = ((self.0 >> FRAME_SHIFT) as u32) & FRAME_NONE;
        (f != FRAME_NONE).then_some(f)
    }

    pub fn slot(self) -> Option<u32> {
        let s = (self.0 >> SLOT_SHIFT) as u32;
        (s != SLOT_NONE).then_some(s)
    }

    pub fn with_kind(self, kind: Kind) -> Self {
        PageState((self.0 & !KIND_MASK) | kind as u64)
    }

    pub fn with_frame(self, frame: Option<u32>) -> Self {
        let f = frame.unwrap_or(FRAME_NONE);
        debug_assert!(f <= FRAME_NONE);
        let mask = (FRAME_NONE as u64) << FRAME_SHIFT;
        PageState((self.0 & !mask) | ((f as u64) << FRAME_SHIFT))
    }

    pub fn with_slot(self, slot: Option<u32>) -> Self {
        let s = slot.unwrap_or(SLOT_NONE);
        PageState((self.0 & !((SLOT_NONE as u64) << SLOT_SHIFT)) | ((s as u64) << SLOT_SHIFT))
    }
}

/// The state words of all pages of one region.
pub struct PageTable {
    words: Box<[AtomicU64]>,
}

impl PageTable {
    pub fn new(pages: usize) -> Self {
        PageTable {
            words: (0..pages)
                .map(|_| AtomicU64::new(PageState::NONE.0))
                .collect(),
        }
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
            .map(|_| PageLock {
                word,
                page,
                state: PageState(w),
            })
    }

    /// Locks a page only if it is unlocked and in state `expect`, without a guard: for
    /// batches (fault-around) that finish with [`PageTable::publish`].
    pub fn try_claim(&self, page: usize, expect: PageState) -> bool {
        self.words[page]
            .compare_exchange(expect.0, expect.0 | LOCKED, Acquire, Relaxed)
            .is_ok()
    }

    /// Releases a page taken with [`PageTable::try_claim`], publishing its new state.
    pub fn publish(&self, page: usize, state: PageState) {
        self.words[page].store(state.0, Release);
    }

    /// Takes the page lock, waiting for the holder (a fault or reclaim in progress).
    pub fn lock(&self, page: usize) -> PageLock<'_> {
        let mut round = 0;
        loop {
            if let Some(l) = self.try_lock(page) {
                return l;
            }
            backoff(round);
            round += 1;
        }
    }
}

/// A held page lock. The state is written back and the lock released on drop.
pub struct PageLock<'a> {
    word: &'a AtomicU64,
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

    /// The state published when the lock is released.
    pub fn set(&mut self, state: PageState) {
        self.state = state;
    }
}

impl Drop for PageLock<'_> {
    fn drop(&mut self) {
        self.word.store(self.state.0, Release);
    }
}

#[cfg(all(test, not(loom)))]
mod tests {
    use super::*;
    use proptest::prelude::*;

    proptest! {
        #[test]
        fn fields_round_trip_independently(kind in 0u8..5, frame in proptest::option::of(0u32..FRAME_NONE), slot in proptest::option::of(0u32..SLOT_NONE)) {
            let kinds = [Kind::None, Kind::Active, Kind::Inactive, Kind::Swapped, Kind::Poisoned];
            let s = PageState::NONE.with_slot(slot).with_frame(frame).with_kind(kinds[kind as usize]);
            prop_assert_eq!(s.kind(), kinds[kind as usize]);
            prop_assert_eq!(s.frame(), frame);
            prop_assert_eq!(s.slot(), slot);
            prop_assert_eq!(s.0 & LOCKED, 0);
        }
    }

    #[test]
    fn lock_publishes_state_on_release_and_excludes_others() {
        let t = PageTable::new(2);
        let mut l = t.lock(1);
        assert!(t.try_lock(1).is_none());
        assert!(t.peek(1).1);
        l.set(PageState::new(Kind::Swapped).with_slot(Some(7)));
        drop(l);
        let (s, locked) = t.peek(1);
        assert!(!locked);
        assert_eq!((s.kind(), s.slot()), (Kind::Swapped, Some(7)));
        assert_eq!(t.peek(0).0, PageState::NONE);
    }

    #[test]
    fn stress_many_threads_increment_under_the_page_lock() {
        let t = PageTable::new(4);
        std::thread::scope(|s| {
            for _ in 0..8 {
                s.spawn(|| {
                    for i in 0..20_000u32 {
                        let mut l = t.lock(i as usize % 4);
                        let n = l.state().slot().map_or(0, |v| v + 1);
                        l.set(l.state().with_slot(Some(n)));
                    }
                });
            }
        });
        let total: u32 = (0..4).map(|p| t.peek(p).0.slot().unwrap() + 1).sum();
        assert_eq!(total, 8 * 20_000);
    }
}

/// Model check of the page lock: `RUSTFLAGS="--cfg loom" cargo test -p uswap-core --lib --release page::loom`.
#[cfg(all(test, loom))]
mod loom_tests {
    use super::*;

    #[test]
    fn page_lock_is_mutually_exclusive_and_publishes_updates() {
        loom::model(|| {
            let t = std::sync::Arc::new(PageTable::new(1));
            let handles: Vec<_> = (0..2)
                .map(|_| {
                    let t = t.clone();
                    loom::thread::spawn(move || {
                        let mut l = t.lock(0);
                        let n = l.state().slot().map_or(0, |v| v + 1);
                        l.set(l.state().with_slot(Some(n)));
                    })
                })
                .collect();
            for h in handles {
                h.join().unwrap();
            }
            assert_eq!(t.peek(0).0.slot(), Some(1));
        });
    }
}
