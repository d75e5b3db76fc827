//! Pins for kernel accesses (the kernel's `pin_user_pages`): page ranges of a region that
//! a system call is about to read or write, kept mapped until the call returns.
//!
//! In SIGBUS mode a kernel access to a page that is not mapped fails with EFAULT instead of
//! being served, so a system call that takes a buffer in a region needs the buffer mapped
//! for the whole call (`syscall_dispatch.rs` brings it in first). Aging must then not
//! unmap it: [`Pins::covers`] is asked for every page aging is about to move out, and a
//! pinned page stays active.
//!
//! The race with aging is settled like the kernel's `FOLL_PIN` against `try_to_unmap`, by
//! ordering: a pinner publishes its range, then looks at each page's state word; aging
//! locks a page, then looks at the pins. Each side issues a sequentially consistent fence
//! between its store and its load, so at least one sees the other: either aging sees the
//! pin and spares the page, or the pinner sees the page locked (or already moved out) and
//! brings it back after aging is done with it, after which aging will see the pin.
//!
//! A pin is one word in a fixed table (no allocation: pins are taken in a signal handler).
//! `used` counts the pins held, so that aging, which asks for every page it moves, pays
//! one load when nothing is pinned. When every word is taken (more calls blocked on region
//! memory at once than the table has words), a pin overflows: while any overflowed pin is
//! held, every page of the region counts as pinned. Aging then moves nothing out, but no
//! call ever waits for another's pin, which could wait for ever (300 threads blocked in
//! `read` into region memory once left the 257th spinning). The overflow counter is
//! published and read with the same fences as a word, so the race argument is the same.
//!
//! The table has room for a server's worth of blocked calls: with 256 words, 300 threads
//! blocked in `recv` or `epoll_wait` on buffers in region memory (a thread per connection)
//! overflowed it for as long as they waited, reclaim freed nothing, and the program's next
//! fault that needed memory failed as out of memory. Words are claimed lowest first and
//! aging reads only up to the highest ever claimed (`high`, published before the fence
//! like the word itself), so aging reads as many words as the most calls ever blocked at
//! once, not the whole table.

use crate::sync::{fence, AtomicU64, AtomicUsize};
use std::ops::Range;
use std::sync::atomic::Ordering::{Relaxed, Release, SeqCst};

/// Ranges pinned at once per region: one per system call in progress (a vectored call
/// takes one per buffer, up to its share). More overflow (see the module documentation).
#[cfg(not(loom))]
pub(crate) const PIN_SLOTS: usize = 4096;
/// One word, so that a model reaches the overflow in a few steps.
#[cfg(loom)]
pub(crate) const PIN_SLOTS: usize = 1;

/// The pinned ranges of one region.
pub(crate) struct Pins {
    /// `start | end << 32` in pages, `end > start`; 0 when free. `PIN_SLOTS` words.
    slots: Box<[AtomicU64]>,
    /// One more than the highest word ever claimed: aging reads the words below it.
    high: AtomicUsize,
    /// Pins held, in words and overflowed.
    used: AtomicUsize,
    /// Overflowed pins held: while any is, every page is pinned.
    overflow: AtomicUsize,
}

/// A pinned range (a word of the table, or [`OVERFLOWED`]); give it back with
/// [`Pins::unpin`].
#[must_use]
pub(crate) struct Pin(usize);

/// The word index of a pin that found every word taken.
const OVERFLOWED: usize = usize::MAX;

/// `PIN_SLOTS` free words from a zeroed allocation: 32 KiB the kernel zeroes page by page
/// when first used, not written at every region's start.
#[cfg(not(loom))]
fn free_slots() -> Box<[AtomicU64]> {
    let words: Box<[u64]> = vec![0u64; PIN_SLOTS].into_boxed_slice();
    // SAFETY: AtomicU64 has the size and bit validity of u64, and its alignment on
    // x86-64 (the only target syscall dispatch serves).
    unsafe { Box::from_raw(Box::into_raw(words) as *mut [AtomicU64]) }
}

#[cfg(loom)]
fn free_slots() -> Box<[AtomicU64]> {
    (0..PIN_SLOTS).map(|_| AtomicU64::new(0)).collect()
}

fn pack(pages: &Range<usize>) -> u64 {
    debug_assert!(pages.start < pages.end && pages.end <= u32::MAX as usize);
    pages.start as u64 | (pages.end as u64) << 32
}

impl Pins {
    pub fn new() -> Pins {
        Pins {
            slots: free_slots(),
            high: AtomicUsize::new(0),
            used: AtomicUsize::new(0),
            overflow: AtomicUsize::new(0),
        }
    }

    /// Publishes `pages` as pinned: in a free word, or, when every word is taken, as an
    /// overflow that pins the whole region. The caller then checks each page's state
    /// (after this call's fence) and brings in what is not there.
    pub fn pin(&self, pages: Range<usize>) -> Pin {
        let word = pack(&pages);
        self.used.fetch_add(1, SeqCst);
        let found = self.slots.iter().position(|s| {
            s.load(Relaxed) == 0 && s.compare_exchange(0, word, SeqCst, Relaxed).is_ok()
        });
        match found {
            Some(i) => {
                self.high.fetch_max(i + 1, SeqCst);
            }
            None => {
                self.overflow.fetch_add(1, SeqCst);
            }
        }
        fence(SeqCst);
        Pin(found.unwrap_or(OVERFLOWED))
    }

    pub fn unpin(&self, pin: Pin) {
        if pin.0 == OVERFLOWED {
            self.overflow.fetch_sub(1, Release);
        } else {
            self.slots[pin.0].store(0, Release);
        }
        self.used.fetch_sub(1, Release);
    }

    /// Which of `pages` are pinned. Called with those pages locked (by aging, before it
    /// unmaps them): the fence orders the locks before the loads here.
    pub fn pinned_among(&self, pages: impl Iterator<Item = usize>) -> Vec<usize> {
        fence(SeqCst);
        if self.used.load(SeqCst) == 0 {
            return Vec::new();
        }
        if self.overflow.load(SeqCst) > 0 {
            return pages.collect();
        }
        let high = self.high.load(SeqCst).min(self.slots.len());
        let ranges: Vec<Range<usize>> = self.slots[..high]
            .iter()
            .map(|s| s.load(SeqCst))
            .filter(|&w| w != 0)
            .map(|w| w as u32 as usize..(w >> 32) as usize)
            .collect();
        pages
            .filter(|p| ranges.iter().any(|r| r.contains(p)))
            .collect()
    }

    #[cfg(test)]
    fn covers(&self, page: usize) -> bool {
        !self.pinned_among(std::iter::once(page)).is_empty()
    }
}

#[cfg(all(test, not(loom)))]
mod tests {
    use super::*;

    #[test]
    fn a_pin_covers_its_pages_until_it_is_given_back() {
        let pins = Pins::new();
        assert!(!pins.covers(5));
        let pin = pins.pin(4..7);
        assert!(pins.covers(4) && pins.covers(6));
        assert!(!pins.covers(3) && !pins.covers(7));
        pins.unpin(pin);
        assert!(!pins.covers(5));
    }

    /// A pin that finds every word taken still pins (everything, while it is held), and
    /// the table works as before once it and the others are given back.
    #[test]
    fn a_full_table_overflows_into_pinning_everything() {
        let pins = Pins::new();
        let held: Vec<Pin> = (0..PIN_SLOTS).map(|i| pins.pin(i..i + 1)).collect();
        assert!(!pins.covers(100_000));
        let over = pins.pin(100_000..100_001);
        assert!(pins.covers(100_000) && pins.covers(7_777_777));
        assert_eq!(pins.used.load(SeqCst), PIN_SLOTS + 1);
        pins.unpin(over);
        assert!(!pins.covers(100_000) && pins.covers(3));
        for p in held {
            pins.unpin(p);
        }
        assert_eq!(pins.used.load(SeqCst), 0);
        let again = pins.pin(100..101);
        assert!(pins.covers(100) && !pins.covers(99));
        pins.unpin(again);
    }

    #[test]
    fn stress_pins_taken_and_given_back_from_many_threads_stay_exact() {
        let pins = Pins::new();
        std::thread::scope(|s| {
            for t in 0..4usize {
                let pins = &pins;
                s.spawn(move || {
                    for i in 0..20_000usize {
                        let page = t * 1_000 + i % 500;
                        let pin = pins.pin(page..page + 2);
                        assert!(pins.covers(page) && pins.covers(page + 1));
                        pins.unpin(pin);
                    }
                });
            }
        });
        assert_eq!(pins.used.load(SeqCst), 0);
        assert!((0..5_000).all(|p| !pins.covers(p)));
    }
}

#[cfg(all(test, loom))]
mod loom_tests {
    use super::*;
    use crate::page::{Kind, PageTable};
    use loom::sync::Arc;

    /// Aging (lock the page, ask the pins, move it out unless pinned) against a pinner
    /// (pin, then look at the page: still active and unlocked means it stays mapped). Never
    /// both: aging moving the page out and the pinner taking it for mapped. With
    /// `table_full`, another call holds the model's one word first, so the pin overflows.
    fn pinner_against_aging(table_full: bool) {
        loom::model(move || {
            let table = Arc::new((PageTable::new(2), Pins::new()));
            {
                let mut lock = table.0.lock(0);
                lock.map_new();
            }
            let other = table_full.then(|| table.1.pin(1..2));
            let aging = {
                let table = table.clone();
                loom::thread::spawn(move || {
                    let (pages, pins) = (&table.0, &table.1);
                    let Some(mut lock) = pages.try_lock(0) else {
                        return false;
                    };
                    if pins.covers(0) {
                        return false;
                    }
                    lock.deactivate(1);
                    true
                })
            };
            let (pages, pins) = (&table.0, &table.1);
            let pin = pins.pin(0..1);
            let (state, locked) = pages.peek(0);
            let taken_for_mapped = !locked && state.kind() == Kind::Active;
            let moved_out = aging.join().unwrap();
            assert!(!(moved_out && taken_for_mapped));
            pins.unpin(pin);
            if let Some(other) = other {
                pins.unpin(other);
            }
        });
    }

    #[test]
    fn loom_a_pinned_page_is_never_moved_out_behind_the_pinners_back() {
        pinner_against_aging(false);
    }

    #[test]
    fn loom_an_overflowed_pin_is_never_moved_out_behind_the_pinners_back() {
        pinner_against_aging(true);
    }
}
