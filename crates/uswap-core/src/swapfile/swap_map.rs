//! Slots shared with fork children: how many children hold each slot of this device (the
//! kernel's `swap_map` counts, `swap_duplicate` and `swap_free`), and how long they hold it.
//!
//! A fork lends a swapped page's slot to the child rather than copying the page: the child
//! reads the slot from this device's file (or from its copy of the compressed pool) when
//! it first needs the page. So the owner (the process that wrote the slot) must neither
//! reuse nor discard the slot while a child may still read it, even after the owner
//! itself no longer needs it.
//!
//! - **Counts.** One word per slot: the number of forks that shared it, and a `RELEASED`
//!   bit set when the owner gave it up while it was held. A slot goes back to the
//!   allocator when both say so: the owner's free of a slot no fork holds is immediate;
//!   otherwise the last hold to go frees it. Both sides change the word with one atomic
//!   update, so neither can free a slot the other still holds.
//! - **Lifelines.** A child cannot be trusted to give its holds back: it may be killed,
//!   and its descendants, which inherit its memory, may outlive it. So each fork that
//!   shares slots makes a pipe: the child keeps the write end (close-on-exec) for its
//!   whole life, its own fork children inherit it, and the owner keeps the read end. When
//!   the last process that could read the shared slots has exited or called `exec`, the
//!   read end hangs up, and the owner drops that fork's holds ([`SwapMap::reap`]). A
//!   process that closes descriptors it does not know of (every open descriptor, after a
//!   fork) cuts its lifeline early: its parent may then reuse the slots, and the child's
//!   reads of them fail their checks, loudly; such a program also closes uswap's own
//!   descriptors, which it cannot run without.
//!
//! The owner holds the slots longer than the kernel would: until the fork's whole family
//! is done (for a long-lived child, its whole life), not until each page is read back or
//! written in the child.

use super::cluster::SlotId;
use super::slot_table::SlotTable;
use crate::lockdep::Rank;
use crate::lockstat::StatMutex;
use crate::sync::AtomicU64;
use std::os::fd::{AsRawFd, OwnedFd};
use std::sync::atomic::Ordering::{AcqRel, Relaxed};

/// A slot's count: 16 bits, four to a word of the table (a fork touches a quarter of
/// the memory a word per slot would: the first fork of a large program pays for it).
const LANE_BITS: u32 = 16;
const LANES: u32 = 64 / LANE_BITS;
const LANE: u64 = (1 << LANE_BITS) - 1;
/// Set in a slot's count when the owner gave the slot up while forks still held it.
const RELEASED: u64 = 1 << (LANE_BITS - 1);
/// The forks holding the slot: the count's other bits.
const HOLDS: u64 = RELEASED - 1;

/// What a slot's word says after a hold went, or after the owner gave the slot up.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(super) enum Freed {
    /// Free the slot now: no one holds or needs it.
    Now,
    /// Someone still holds it: whoever lets go last frees it.
    Later,
}

/// One fork's holds and the read end of its lifeline.
struct Lifeline {
    fd: OwnedFd,
    slots: Vec<SlotId>,
}

/// The holds of fork children on the slots of one device.
pub(super) struct SwapMap {
    counts: SlotTable,
    /// Slots held by one fork at least.
    shared: AtomicU64,
    lifelines: StatMutex<Vec<Lifeline>>,
    /// Forks whose lifelines are watched, read without the lock.
    watched: AtomicU64,
}

impl SwapMap {
    pub(super) fn new(slots: u64) -> SwapMap {
        SwapMap {
            counts: SlotTable::new(slots.div_ceil(u64::from(LANES))),
            shared: AtomicU64::new(0),
            lifelines: StatMutex::new(Rank::SwapLifelines, Vec::new()),
            watched: AtomicU64::new(0),
        }
    }

    /// The word holding `slot`'s count, and the count's shift in it.
    fn lane(slot: SlotId) -> (SlotId, u32) {
        (slot / LANES, (slot % LANES) * LANE_BITS)
    }

    /// A fork holds `slot` (the owner's, written and not given up: the caller holds the
    /// lock of the page that owns it). False, and nothing held, when the slot's count is
    /// full (32,767 forks).
    pub(super) fn duplicate(&self, slot: SlotId) -> bool {
        let (at, shift) = Self::lane(slot);
        let added = self.counts.word(at).fetch_update(AcqRel, Relaxed, |w| {
            let count = (w >> shift) & LANE;
            debug_assert_eq!(count & RELEASED, 0, "slot {slot} was given up");
            (count & HOLDS < HOLDS).then_some(w + (1 << shift))
        });
        match added {
            Ok(before) if (before >> shift) & LANE == 0 => {
                self.shared.fetch_add(1, Relaxed);
                true
            }
            Ok(_) => true,
            Err(_) => false,
        }
    }

    /// A fork's hold on `slot` goes.
    pub(super) fn put(&self, slot: SlotId) -> Freed {
        let (at, shift) = Self::lane(slot);
        let word = self.counts.entry(at).expect("a held slot has a count");
        let before = word
            .fetch_update(AcqRel, Relaxed, |w| {
                let count = (w >> shift) & LANE;
                debug_assert!(count & HOLDS > 0, "slot {slot} is not held");
                let left = match count - 1 {
                    RELEASED => 0,
                    left => left,
                };
                Some(w & !(LANE << shift) | left << shift)
            })
            .expect("the update always applies");
        let count = (before >> shift) & LANE;
        if count & HOLDS > 1 {
            return Freed::Later;
        }
        self.shared.fetch_sub(1, Relaxed);
        match count & RELEASED {
            0 => Freed::Later,
            _ => Freed::Now,
        }
    }

    /// The owner gives `slot` up: free it now unless forks hold it. Allocates nothing
    /// (the SIGBUS handler frees slots).
    pub(super) fn release(&self, slot: SlotId) -> Freed {
        let (at, shift) = Self::lane(slot);
        let Some(word) = self.counts.entry(at) else {
            return Freed::Now;
        };
        let held = word.fetch_update(AcqRel, Relaxed, |w| {
            ((w >> shift) & HOLDS != 0).then_some(w | RELEASED << shift)
        });
        match held {
            Ok(_) => Freed::Later,
            Err(_) => Freed::Now,
        }
    }

    /// Whether `slot` is held by a fork.
    #[cfg(any(test, loom))]
    pub(super) fn held(&self, slot: SlotId) -> bool {
        let (at, shift) = Self::lane(slot);
        (self.counts.get(at) >> shift) & HOLDS != 0
    }

    /// Slots held by one fork at least.
    pub(super) fn shared(&self) -> u64 {
        self.shared.load(Relaxed)
    }

    /// After a fork: its holds on `slots` last until `fd`, the read end of its lifeline,
    /// hangs up.
    pub(super) fn watch(&self, fd: OwnedFd, slots: Vec<SlotId>) {
        let mut lifelines = self.lifelines.lock();
        lifelines.push(Lifeline { fd, slots });
        self.watched.store(lifelines.len() as u64, Relaxed);
    }

    /// In a fork child, for its copy of the parent's device: closes the read ends of the
    /// parent's lifelines, which are the parent's to watch (the copy is never dropped).
    pub(super) fn close_in_child(&self) {
        // A lock some other thread of the parent held at the fork stays held here: its
        // descriptors stay open then.
        let Some(lifelines) = self.lifelines.try_lock() else {
            return;
        };
        for lifeline in lifelines.iter() {
            // SAFETY: a descriptor of the abandoned copy, never used here again.
            unsafe { libc::close(lifeline.fd.as_raw_fd()) };
        }
    }

    /// Whether any fork's lifeline is watched.
    pub(super) fn watching(&self) -> bool {
        self.watched.load(Relaxed) > 0
    }

    /// Drops the holds of every fork whose lifeline hung up; returns the slots that the
    /// owner gave up meanwhile, to be freed now.
    pub(super) fn reap(&self) -> Vec<SlotId> {
        if !self.watching() {
            return Vec::new();
        }
        let ended: Vec<Lifeline> = {
            let mut lifelines = self.lifelines.lock();
            let mut polls: Vec<libc::pollfd> = lifelines
                .iter()
                .map(|l| libc::pollfd {
                    fd: l.fd.as_raw_fd(),
                    events: 0,
                    revents: 0,
                })
                .collect();
            // SAFETY: `polls` is a valid array of its length; a zero timeout never blocks.
            let n = unsafe { libc::poll(polls.as_mut_ptr(), polls.len() as libc::nfds_t, 0) };
            if n <= 0 {
                return Vec::new();
            }
            let (ended, alive): (Vec<_>, Vec<_>) = std::mem::take(&mut *lifelines)
                .into_iter()
                .zip(&polls)
                .partition(|(_, p)| p.revents & (libc::POLLHUP | libc::POLLERR) != 0);
            *lifelines = alive.into_iter().map(|(l, _)| l).collect();
            self.watched.store(lifelines.len() as u64, Relaxed);
            ended.into_iter().map(|(l, _)| l).collect()
        };
        ended
            .iter()
            .flat_map(|l| &l.slots)
            .copied()
            .filter(|&slot| self.put(slot) == Freed::Now)
            .collect()
    }
}

#[cfg(all(test, not(loom)))]
mod tests {
    use super::*;
    use std::os::fd::FromRawFd;

    fn pipe() -> (OwnedFd, OwnedFd) {
        let mut fds = [0; 2];
        assert_eq!(unsafe { libc::pipe2(fds.as_mut_ptr(), libc::O_CLOEXEC) }, 0);
        // SAFETY: two new descriptors, ours.
        unsafe { (OwnedFd::from_raw_fd(fds[0]), OwnedFd::from_raw_fd(fds[1])) }
    }

    #[test]
    fn a_slot_is_freed_by_whoever_lets_go_last() {
        let map = SwapMap::new(64);
        assert_eq!(map.release(1), Freed::Now, "never held");
        map.duplicate(2);
        assert_eq!(map.release(2), Freed::Later, "the owner went first");
        assert!(map.held(2));
        assert_eq!(map.put(2), Freed::Now, "the fork went last");
        assert!(!map.held(2));
        map.duplicate(3);
        assert_eq!(map.put(3), Freed::Later, "the fork went first");
        assert_eq!(map.release(3), Freed::Now, "the owner went last");
        map.duplicate(4);
        map.duplicate(4);
        assert_eq!(map.shared(), 1);
        assert_eq!(map.release(4), Freed::Later);
        assert_eq!(map.put(4), Freed::Later, "a second fork still holds it");
        assert_eq!(map.put(4), Freed::Now);
        assert_eq!(map.shared(), 0);
        // Held again after it was freed: a new life, counted from nothing.
        map.duplicate(4);
        assert_eq!(map.put(4), Freed::Later);
        assert_eq!(map.release(4), Freed::Now);
    }

    #[test]
    fn counts_sharing_a_word_stay_apart_and_a_full_count_refuses_more() {
        let map = SwapMap::new(64);
        // Slots 8 to 11 share a word of the table.
        assert!(map.duplicate(9));
        assert!(map.duplicate(10));
        assert!(map.duplicate(10));
        assert_eq!(map.release(9), Freed::Later);
        assert_eq!(
            map.release(8),
            Freed::Now,
            "a neighbour's bit is not this slot's"
        );
        assert_eq!(map.release(11), Freed::Now);
        assert_eq!(map.put(10), Freed::Later);
        assert!(map.held(10) && map.held(9) && !map.held(8) && !map.held(11));
        assert_eq!(map.put(9), Freed::Now);
        assert_eq!(
            map.put(10),
            Freed::Later,
            "never given up: the owner frees it"
        );
        assert_eq!(map.release(10), Freed::Now);
        for _ in 0..HOLDS {
            assert!(map.duplicate(12));
        }
        assert!(!map.duplicate(12), "a full count refuses another hold");
        assert!(!map.held(13), "and does not spill into its neighbour");
        assert_eq!(map.shared(), 1);
    }

    #[test]
    fn holds_go_when_the_lifeline_hangs_up_and_only_then() {
        let map = SwapMap::new(64);
        let (read_a, write_a) = pipe();
        let (read_b, write_b) = pipe();
        for slot in [5, 6, 7] {
            map.duplicate(slot);
        }
        map.duplicate(7);
        map.watch(read_a, vec![5, 6, 7]);
        map.watch(read_b, vec![7]);
        assert_eq!(map.release(5), Freed::Later);
        assert_eq!(map.release(7), Freed::Later);
        assert!(map.reap().is_empty(), "both families alive");
        // A descendant keeps the lifeline alive after the child itself is gone.
        let inherited = write_a.try_clone().unwrap();
        drop(write_a);
        assert!(
            map.reap().is_empty(),
            "a descendant still holds the write end"
        );
        drop(inherited);
        assert_eq!(
            map.reap(),
            vec![5],
            "6 is still the owner's, 7 the other fork's"
        );
        assert!(map.watching());
        drop(write_b);
        assert_eq!(map.reap(), vec![7]);
        assert!(!map.watching());
        assert_eq!(map.shared(), 0);
        assert_eq!(map.release(6), Freed::Now);
    }
}

#[cfg(all(test, loom))]
mod loom_tests {
    //! RUSTFLAGS="--cfg loom" cargo test -p uswap-core --lib --release swapfile::swap_map::loom_tests
    use super::*;
    use loom::sync::Arc;

    /// The owner gives a slot up while two forks let go of it: exactly one of the three
    /// frees it, after the other two.
    #[test]
    fn exactly_one_frees_a_slot_the_owner_and_two_forks_let_go_of_at_once() {
        loom::model(|| {
            let map = Arc::new(SwapMap::new(4));
            map.duplicate(1);
            map.duplicate(1);
            let forks: Vec<_> = (0..2)
                .map(|_| {
                    let map = map.clone();
                    loom::thread::spawn(move || map.put(1) == Freed::Now)
                })
                .collect();
            let owner = map.release(1) == Freed::Now;
            let frees = forks
                .into_iter()
                .map(|f| f.join().unwrap())
                .filter(|&f| f)
                .count()
                + usize::from(owner);
            assert_eq!(frees, 1);
            assert!(!map.held(1));
            assert_eq!(map.shared(), 0);
        });
    }

    /// Two slots whose counts share a word change at once: neither disturbs the other.
    #[test]
    fn neighbours_in_one_word_change_at_once_without_mixing() {
        loom::model(|| {
            let map = Arc::new(SwapMap::new(4));
            map.duplicate(1);
            map.duplicate(2);
            let fork = {
                let map = map.clone();
                loom::thread::spawn(move || map.put(2))
            };
            assert_eq!(map.release(1), Freed::Later);
            assert_eq!(fork.join().unwrap(), Freed::Later);
            assert!(map.held(1) && !map.held(2));
            assert_eq!(map.put(1), Freed::Now);
            assert_eq!(map.release(2), Freed::Now);
        });
    }
}
