//! Where the time of a fault and of reclaim goes, phase by phase (`Config::breakdown`).
//! A [`Laps`] stopwatch runs through the full fault path and reclaim; each lap ends one
//! phase and records its duration in that phase's histogram. Off, a stopwatch reads no
//! clock; on, one clock read per phase (about 25 ns against faults of 10 µs and more).
//! The signal-handler path is not timed (it must not take the histogram locks).

use crate::lockdep::Rank;
use crate::lockstat::{LockClass, StatMutex};
use crate::stats::{new_histogram, record};
use hdrhistogram::Histogram;
use serde::Serialize;
use std::time::Instant;

/// The phases, in the order a fault or a reclaim pass goes through them.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Phase {
    /// Fault: from the handler taking the fault to holding the page lock.
    PageLock,
    /// Swap-in: swap cache lookup, bounce buffer, readahead window.
    Prepare,
    /// Swap-in: the read of the faulting slot and its readahead window, submit to
    /// complete, with the checksum and the mapping of the pages read ahead.
    Read,
    /// Fault: charging the page to the budget, direct reclaim included.
    Charge,
    /// Fault: the ioctl that maps the page (COPY or MOVE), which wakes the faulting thread.
    Map,
    /// Fault: LRU add, swap cache and page state, after the thread is awake.
    Finish,
    /// Reclaim: moving one isolated batch of active pages into staging (one TLB flush per
    /// run of neighbours).
    Deactivate,
    /// Reclaim: writing one batch of dirty inactive pages.
    WriteOut,
    /// Reclaim: freeing the staging frames of one evicted batch.
    FrameRelease,
}

const PHASES: [Phase; 9] = [
    Phase::PageLock,
    Phase::Prepare,
    Phase::Read,
    Phase::Charge,
    Phase::Map,
    Phase::Finish,
    Phase::Deactivate,
    Phase::WriteOut,
    Phase::FrameRelease,
];

impl Phase {
    pub fn name(self) -> &'static str {
        match self {
            Phase::PageLock => "page lock",
            Phase::Prepare => "prepare",
            Phase::Read => "read + readahead",
            Phase::Charge => "charge",
            Phase::Map => "map + wake",
            Phase::Finish => "finish",
            Phase::Deactivate => "deactivate batch",
            Phase::WriteOut => "write-out batch",
            Phase::FrameRelease => "frame release",
        }
    }
}

/// The histograms of every phase, sharded by CPU.
pub(crate) struct Breakdown {
    shards: Vec<StatMutex<Vec<Histogram<u64>>>>,
}

const SHARDS: usize = 8;

impl Breakdown {
    pub fn new() -> Self {
        Breakdown {
            shards: (0..SHARDS)
                .map(|_| {
                    StatMutex::new(
                        Rank::Phases,
                        PHASES.iter().map(|_| new_histogram()).collect(),
                    )
                })
                .collect(),
        }
    }

    fn record(&self, phase: Phase, since: Instant, now: Instant) {
        let shard = crate::cpu::current() % SHARDS;
        record(&mut self.shards[shard].lock()[phase as usize], now - since);
    }

    /// The statistics of the shards' locks (`phases`).
    pub fn lockstat(&self) -> LockClass {
        LockClass::sum("phases", self.shards.iter())
    }

    /// Every phase's histogram so far.
    pub fn times(&self) -> PhaseTimes {
        let mut all: Vec<Histogram<u64>> = PHASES.iter().map(|_| new_histogram()).collect();
        for shard in &self.shards {
            for (sum, h) in all.iter_mut().zip(shard.lock().iter()) {
                sum.add(h).expect("same bounds");
            }
        }
        PhaseTimes(all)
    }
}

/// A stopwatch through the phases of one fault or reclaim pass; `None` inside when the
/// breakdown is off.
pub(crate) struct Laps<'a>(Option<(&'a Breakdown, Instant)>);

impl<'a> Laps<'a> {
    /// Starts at `start` (the moment the handler took the fault, or reclaim began).
    pub fn new(breakdown: Option<&'a Breakdown>, start: Instant) -> Self {
        Laps(breakdown.map(|b| (b, start)))
    }

    /// Ends `phase` now; the next phase starts now.
    pub fn lap(&mut self, phase: Phase) {
        if let Some((b, last)) = &mut self.0 {
            let now = Instant::now();
            b.record(phase, *last, now);
            *last = now;
        }
    }
}

/// The histograms of every phase at one moment (see [`crate::Region::phase_times`]).
#[derive(Clone)]
pub struct PhaseTimes(Vec<Histogram<u64>>);

/// One phase's line of the breakdown.
#[derive(Clone, Debug, Serialize)]
pub struct PhaseSummary {
    pub phase: &'static str,
    pub count: u64,
    pub mean_ns: f64,
    pub p50_ns: u64,
    pub p99_ns: u64,
    /// Sum of all durations: where the time went.
    pub total_ms: f64,
}

impl PhaseTimes {
    /// What was recorded between `earlier` and this.
    pub fn since(&self, earlier: &PhaseTimes) -> PhaseTimes {
        let mut delta = self.0.clone();
        for (d, e) in delta.iter_mut().zip(&earlier.0) {
            // Counts only grow, so the subtraction never underflows.
            let _ = d.subtract(e);
        }
        PhaseTimes(delta)
    }

    /// One line per phase that recorded anything.
    pub fn summary(&self) -> Vec<PhaseSummary> {
        PHASES
            .iter()
            .zip(&self.0)
            .filter(|(_, h)| !h.is_empty())
            .map(|(p, h)| PhaseSummary {
                phase: p.name(),
                count: h.len(),
                mean_ns: h.mean(),
                p50_ns: h.value_at_quantile(0.5),
                p99_ns: h.value_at_quantile(0.99),
                total_ms: h.mean() * h.len() as f64 / 1e6,
            })
            .collect()
    }
}

#[cfg(all(test, not(loom)))]
mod tests {
    use super::*;
    use std::time::Duration;

    #[test]
    fn laps_record_each_phase_and_differences_subtract() {
        let b = Breakdown::new();
        let start = Instant::now();
        let mut laps = Laps::new(Some(&b), start);
        std::thread::sleep(Duration::from_millis(2));
        laps.lap(Phase::Read);
        laps.lap(Phase::Map);
        let first = b.times();
        let s = first.summary();
        assert_eq!(s.len(), 2);
        assert_eq!((s[0].phase, s[0].count), ("read + readahead", 1));
        assert!(s[0].mean_ns >= 2e6, "{s:?}");
        Laps::new(Some(&b), Instant::now()).lap(Phase::Map);
        let delta = b.times().since(&first).summary();
        assert_eq!(delta.len(), 1);
        assert_eq!((delta[0].phase, delta[0].count), ("map + wake", 1));
    }

    #[test]
    fn a_stopwatch_without_a_breakdown_records_nothing() {
        let mut laps = Laps::new(None, Instant::now());
        laps.lap(Phase::Read);
        assert!(laps.0.is_none());
    }
}
