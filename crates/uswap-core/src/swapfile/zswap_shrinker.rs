//! The compressed pool's size when it is `auto` (the default): moved a step at a time to
//! where a byte of memory saves the most fault time. The kernel lets zswap's pool grow
//! inside a cgroup as reclaim dictates and writes its cold entries back with a shrinker;
//! it balances its two LRUs by what their refaults cost (`lru_note_cost`) and tells a
//! refault that more memory would have saved by its shadow entry (mm/workingset.c). Here
//! the two sides are resident memory and the pool, judged the same way:
//!
//! - a page loaded from the pool within a step's worth of evictions of being stored would
//!   have stayed resident with a step more resident memory, and saved a pool fault (the
//!   fault, a decompression, the copy into place);
//! - a page read from the file within a step's worth of departures from the pool (pages
//!   written back, clean copies dropped, clean pages a full pool had no room for) of its
//!   own departure (its shadow, kept in the slot's location word) would have stayed in a
//!   pool a step larger, which holds a step times the compression ratio of pages, and saved
//!   a file read less a decompression.
//!
//! Once enough of either is seen, the pool's limit moves toward the side whose step saved
//! more time, between [`FLOOR_PERCENT`] and 90% of the memory limit. A step is 1/64 of the
//! limit; each move the same way as the last one (decisions not to move do not count)
//! doubles it, up to eight steps, and a turn starts again from one. Only a pool that fills its limit is raised, and a lowered limit starts
//! from what the pool holds, so the limit stays where it binds.

use crate::sync::{AtomicBool, AtomicU64};
use crate::PAGE_SIZE;
use std::sync::atomic::Ordering::{AcqRel, Relaxed, Release};

/// The least share of the memory limit an `auto` pool keeps.
pub(super) const FLOOR_PERCENT: u64 = 5;

/// A step is 1/this of the memory limit.
const STEPS: u64 = 64;

/// Moves the same way in a row double the stride up to `1 << MAX_DOUBLINGS` steps.
const MAX_DOUBLINGS: u64 = 3;

/// Young refaults of both kinds seen before the limit moves.
const DECIDE_AFTER: u64 = 64;

/// What a fault served from the pool costs beyond its decompression on this VM: the trap,
/// the copy into place and the mapping (docs/benchmarks.md, issue 27: 12.7 µs at the
/// median, 3.5 µs of it decompression). A fault from the file pays it too, so only the
/// resident side saves it.
const POOL_FAULT_NS: u64 = 9_000;

/// Directions of a move.
const NONE: u64 = 0;
const UP: u64 = 1;
const DOWN: u64 = 2;

/// Read from [`Shrinker::decide`]: what the pool and the device did since the last move.
pub(super) struct Seen {
    /// The memory limit, bytes.
    pub limit_bytes: u64,
    /// Bytes the pool's objects take now, and pages they hold.
    pub stored_bytes: u64,
    pub stored_pages: u64,
    /// Pages the pool has stored since it was made.
    pub stores: u64,
    /// Pages reclaim evicted (stored, rejected, written, dropped clean) since the last call.
    pub evictions: u64,
    /// Mean time of a decompression, and of a read of the file, in ns.
    pub load_ns: u64,
    pub file_read_ns: u64,
}

/// Where the `auto` limit stands, and the refaults judged against it.
pub(super) struct Shrinker {
    /// The pool's limit now, bytes (0 until the first decision sets it from the memory
    /// limit).
    target: AtomicU64,
    /// A load of a page stored less than this many stores ago is young.
    load_window: AtomicU64,
    /// A file read of a page written back less than this many writebacks ago is young.
    refault_window: AtomicU64,
    young_loads: AtomicU64,
    young_refaults: AtomicU64,
    /// The pool's store count at the last move, and evictions since (the load window's
    /// scale).
    stores_at_move: AtomicU64,
    evictions: AtomicU64,
    deciding: AtomicBool,
    /// The last move's direction ([`UP`], [`DOWN`], or [`NONE`] yet) and how often the
    /// stride has doubled since the last turn.
    last_move: AtomicU64,
    doublings: AtomicU64,
    raised: AtomicU64,
    lowered: AtomicU64,
}

/// How the `auto` limit moved (`uswap stat`, the benches' JSON).
#[derive(Clone, Copy, Debug, Default)]
pub(super) struct Moves {
    pub raised: u64,
    pub lowered: u64,
}

impl Shrinker {
    pub(super) fn new() -> Shrinker {
        Shrinker {
            target: AtomicU64::new(0),
            load_window: AtomicU64::new(0),
            refault_window: AtomicU64::new(0),
            young_loads: AtomicU64::new(0),
            young_refaults: AtomicU64::new(0),
            stores_at_move: AtomicU64::new(0),
            evictions: AtomicU64::new(0),
            deciding: AtomicBool::new(false),
            last_move: AtomicU64::new(0),
            doublings: AtomicU64::new(0),
            raised: AtomicU64::new(0),
            lowered: AtomicU64::new(0),
        }
    }

    /// A page came back from the pool after `age` more pages were stored.
    pub(super) fn loaded(&self, age: u64) {
        if age < self.load_window.load(Relaxed) {
            self.young_loads.fetch_add(1, Relaxed);
        }
    }

    /// A page was read from the file after `distance` more pages left the pool.
    pub(super) fn refaulted(&self, distance: u64) {
        if distance < self.refault_window.load(Relaxed) {
            self.young_refaults.fetch_add(1, Relaxed);
        }
    }

    /// The limit for an `auto` pool under `seen`, moved when enough young refaults were
    /// seen since the last move. `start` is where it starts. One caller decides at a time;
    /// the others get the limit as it is.
    pub(super) fn decide(&self, seen: &Seen, start: u64) -> u64 {
        let floor = seen.limit_bytes / 100 * FLOOR_PERCENT;
        let most = seen.limit_bytes / 10 * 9;
        self.evictions.fetch_add(seen.evictions, Relaxed);
        if self
            .deciding
            .compare_exchange(false, true, AcqRel, Relaxed)
            .is_err()
        {
            return match self.target.load(Relaxed) {
                0 => start,
                t => t,
            }
            .clamp(floor, most);
        }
        let target = match self.target.load(Relaxed) {
            0 => start,
            t => t,
        }
        .clamp(floor, most);
        let moved = self.moved(seen, target, floor, most);
        self.target.store(moved, Relaxed);
        self.deciding.store(false, Release);
        moved
    }

    /// Under `deciding`: where `target` goes.
    fn moved(&self, seen: &Seen, target: u64, floor: u64, most: u64) -> u64 {
        let step = (seen.limit_bytes / STEPS).max(PAGE_SIZE as u64);
        let step_pages = step / PAGE_SIZE as u64;
        let (loads, refaults) = (
            self.young_loads.load(Relaxed),
            self.young_refaults.load(Relaxed),
        );
        if self.load_window.load(Relaxed) == 0 {
            self.set_windows(seen, step);
            return target;
        }
        if loads + refaults < DECIDE_AFTER {
            // Windows drawn from a short or unusual stretch are drawn again now and then.
            if self.evictions.load(Relaxed) >= 4 * step_pages {
                self.set_windows(seen, step);
            }
            return target;
        }
        let resident_saves = loads * (POOL_FAULT_NS + seen.load_ns);
        let pool_saves = refaults * seen.file_read_ns.saturating_sub(seen.load_ns);
        let full = seen.stored_bytes + 2 * step >= target;
        let direction = match () {
            _ if pool_saves > resident_saves && full => UP,
            _ if pool_saves > resident_saves => NONE,
            _ => DOWN,
        };
        let doublings = match self.last_move.load(Relaxed) == direction {
            true => (self.doublings.load(Relaxed) + 1).min(MAX_DOUBLINGS),
            false => 0,
        };
        let stride = step << doublings;
        let moved = match direction {
            UP => (target + stride).min(most),
            DOWN => target
                .min(seen.stored_bytes)
                .saturating_sub(stride)
                .max(floor),
            _ => target,
        };
        if direction != NONE {
            self.last_move.store(direction, Relaxed);
            self.doublings.store(doublings, Relaxed);
        }
        match moved.cmp(&target) {
            std::cmp::Ordering::Greater => self.raised.fetch_add(1, Relaxed),
            std::cmp::Ordering::Less => self.lowered.fetch_add(1, Relaxed),
            std::cmp::Ordering::Equal => 0,
        };
        self.set_windows(seen, step);
        self.young_loads.store(0, Relaxed);
        self.young_refaults.store(0, Relaxed);
        moved
    }

    /// A step's worth of each clock: of stores (a step of resident pages, scaled by the
    /// share of evictions that are stores) and of departures from the pool (a step of pool
    /// bytes, in the pages it holds).
    fn set_windows(&self, seen: &Seen, step: u64) {
        let step_pages = step / PAGE_SIZE as u64;
        let stores = seen
            .stores
            .saturating_sub(self.stores_at_move.swap(seen.stores, Relaxed));
        let evictions = self.evictions.swap(0, Relaxed);
        let load_window = match (stores, evictions) {
            (0, _) | (_, 0) => step_pages,
            (s, e) => (step_pages * s.min(e) / e).max(1),
        };
        let page_bytes = match seen.stored_pages {
            0 => PAGE_SIZE as u64 / 2,
            n => (seen.stored_bytes / n).max(16),
        };
        self.load_window.store(load_window, Relaxed);
        self.refault_window.store(step / page_bytes, Relaxed);
    }

    pub(super) fn moves(&self) -> Moves {
        Moves {
            raised: self.raised.load(Relaxed),
            lowered: self.lowered.load(Relaxed),
        }
    }
}

#[cfg(all(test, not(loom)))]
mod tests {
    use super::*;

    const GIB: u64 = 1 << 30;

    fn seen(stored_bytes: u64) -> Seen {
        Seen {
            limit_bytes: GIB,
            stored_bytes,
            stored_pages: stored_bytes / 1400,
            stores: 0,
            evictions: 1000,
            load_ns: 3_500,
            file_read_ns: 100_000,
        }
    }

    /// Enough young file refaults for a decision.
    fn young_refaults(s: &Shrinker) {
        for _ in 0..DECIDE_AFTER {
            s.refaulted(0);
        }
    }

    /// Enough young pool loads for a decision.
    fn young_loads(s: &Shrinker) {
        for _ in 0..DECIDE_AFTER {
            s.loaded(0);
        }
    }

    /// Runs the first decision (which sets the windows) and returns the limit.
    fn started(s: &Shrinker, stored: u64) -> u64 {
        s.decide(&seen(stored), GIB / 5)
    }

    #[test]
    fn file_reads_a_larger_pool_would_have_saved_raise_a_full_pool() {
        let s = Shrinker::new();
        let start = started(&s, GIB / 5);
        assert_eq!(start, GIB / 5);
        young_refaults(&s);
        let raised = s.decide(&seen(GIB / 5), GIB / 5);
        assert_eq!(raised, GIB / 5 + GIB / STEPS);
        assert_eq!(s.moves().raised, 1);
    }

    #[test]
    fn old_refaults_and_too_few_young_ones_leave_the_limit() {
        let s = Shrinker::new();
        let start = started(&s, GIB / 5);
        let window = s.refault_window.load(Relaxed);
        for _ in 0..10 * DECIDE_AFTER {
            s.refaulted(window);
        }
        for _ in 0..DECIDE_AFTER - 1 {
            s.refaulted(0);
        }
        assert_eq!(s.decide(&seen(GIB / 5), GIB / 5), start);
    }

    #[test]
    fn pool_loads_resident_memory_would_have_saved_lower_it_from_what_the_pool_holds() {
        let s = Shrinker::new();
        started(&s, GIB / 5);
        young_loads(&s);
        // The pool holds less than its limit: the lowered limit starts from what it holds.
        let lowered = s.decide(&seen(GIB / 10), GIB / 5);
        assert_eq!(lowered, GIB / 10 - GIB / STEPS);
        assert_eq!(s.moves().lowered, 1);
    }

    #[test]
    fn a_pool_below_its_limit_is_not_raised_and_limits_stay_within_bounds() {
        let s = Shrinker::new();
        started(&s, 0);
        young_refaults(&s);
        assert_eq!(
            s.decide(&seen(0), GIB / 5),
            GIB / 5,
            "the pool does not fill its limit"
        );
        for _ in 0..200 {
            young_loads(&s);
            s.decide(&seen(GIB), GIB / 5);
        }
        assert_eq!(s.decide(&seen(GIB), GIB / 5), GIB / 100 * FLOOR_PERCENT);
        for _ in 0..200 {
            young_refaults(&s);
            s.decide(&seen(GIB), GIB / 5);
        }
        assert_eq!(s.decide(&seen(GIB), GIB / 5), GIB / 10 * 9);
    }

    #[test]
    fn moves_the_same_way_double_the_stride_and_a_turn_starts_again() {
        let s = Shrinker::new();
        let mut limit = started(&s, GIB / 5);
        let mut strides = Vec::new();
        for _ in 0..5 {
            young_refaults(&s);
            let next = s.decide(&seen(limit), GIB / 5);
            strides.push((next - limit) / (GIB / STEPS));
            limit = next;
        }
        assert_eq!(strides, [1, 2, 4, 8, 8]);
        young_loads(&s);
        let lowered = s.decide(&seen(limit), GIB / 5);
        assert_eq!(limit - lowered, GIB / STEPS, "a turn moves one step");
    }

    #[test]
    fn on_a_file_as_fast_as_the_pool_resident_memory_wins() {
        let s = Shrinker::new();
        started(&s, GIB / 5);
        young_refaults(&s);
        s.loaded(0);
        let fast_file = Seen {
            file_read_ns: 3_000,
            ..seen(GIB / 5)
        };
        assert!(s.decide(&fast_file, GIB / 5) < GIB / 5);
    }
}
