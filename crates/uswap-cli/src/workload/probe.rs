//! A flood-ping-like probe of how fast a program can touch its hot memory while the rest of
//! it swaps (seed 003's experiment: ping latency during swap-out).
//!
//! The memory is split: the first `hot_pages` pages are the probe's hot set, the rest the
//! thrashed set. Setup fills every page with its pattern (not measured), the hot set last so
//! that it starts resident. Then, for the measured interval, `threads` thrashers write the
//! header of uniformly random thrashed pages back to back (every write dirties the page, so
//! reclaim must write it out again each time it evicts it), while one probe thread, every
//! `interval_us` (0: back to back), reads and writes the header of the next hot page in turn
//! and times that one access. The probe is the only writer of the hot set, so it knows the
//! version each hot page must show; thrashers check that the page they write is theirs.

use super::mem::Mem;
use super::pattern::{self, ErrorLog};
use super::random::for_page_ranges;
use super::rng::Rng;
use hdrhistogram::Histogram;
use serde::{Deserialize, Serialize};
use std::sync::atomic::AtomicBool;
use std::sync::atomic::Ordering::Relaxed;
use std::thread;
use std::time::{Duration, Instant};
use uswap_core::stats::{new_histogram, record};

#[derive(Clone, Copy, Debug, Serialize, Deserialize, PartialEq)]
pub struct ProbeParams {
    /// Thrashing threads.
    pub threads: usize,
    /// Pages of the hot set, at the start of the memory.
    pub hot_pages: usize,
    /// Time from one probe's start to the next one's; 0: back to back.
    pub interval_us: u64,
    pub seconds: f64,
}

#[derive(Clone, Debug, Serialize, Deserialize)]
pub struct ProbeOutcome {
    /// Pages of the thrashed set.
    pub thrashed_pages: u64,
    pub hot_pages: u64,
    /// Filling every page with its pattern.
    pub setup_s: f64,
    pub measured_s: f64,
    /// The probe's access times over the measured interval.
    pub rtt: Rtt,
    /// Writes by the thrashers over the measured interval.
    pub writes: u64,
    /// Pages that showed the wrong header to the probe or a thrasher.
    pub verify_errors: u64,
}

/// Probe times as ping reports them (min/avg/max/mdev, exact) with percentiles (from a
/// histogram, within 0.1%), in microseconds.
#[derive(Clone, Copy, Debug, Default, Serialize, Deserialize, PartialEq)]
pub struct Rtt {
    pub probes: u64,
    pub min_us: f64,
    pub avg_us: f64,
    pub max_us: f64,
    /// Standard deviation, as ping's mdev: sqrt(mean of squares - square of mean).
    pub mdev_us: f64,
    pub p50_us: f64,
    pub p99_us: f64,
    pub p999_us: f64,
}

/// The probe's times: running sums for the exact figures, a histogram for the percentiles.
struct Samples {
    hist: Histogram<u64>,
    count: u64,
    sum_ns: u128,
    sum_sq_ns: u128,
    min_ns: u64,
    max_ns: u64,
}

impl Samples {
    fn new() -> Self {
        Samples {
            hist: new_histogram(),
            count: 0,
            sum_ns: 0,
            sum_sq_ns: 0,
            min_ns: u64::MAX,
            max_ns: 0,
        }
    }

    fn record(&mut self, took: Duration) {
        let ns = took.as_nanos() as u64;
        record(&mut self.hist, took);
        self.count += 1;
        self.sum_ns += ns as u128;
        self.sum_sq_ns += ns as u128 * ns as u128;
        self.min_ns = self.min_ns.min(ns);
        self.max_ns = self.max_ns.max(ns);
    }

    fn rtt(&self) -> Rtt {
        if self.count == 0 {
            return Rtt::default();
        }
        let n = self.count as f64;
        let mean = self.sum_ns as f64 / n;
        let variance = (self.sum_sq_ns as f64 / n - mean * mean).max(0.0);
        let us = |ns: u64| ns as f64 / 1000.0;
        // A bucket's highest value may pass the largest sample: clamp to what was seen.
        let at = |q: f64| {
            us(self
                .hist
                .value_at_quantile(q)
                .clamp(self.min_ns, self.max_ns))
        };
        Rtt {
            probes: self.count,
            min_us: us(self.min_ns),
            avg_us: mean / 1000.0,
            max_us: us(self.max_ns),
            mdev_us: variance.sqrt() / 1000.0,
            p50_us: at(0.50),
            p99_us: at(0.99),
            p999_us: at(0.999),
        }
    }
}

/// Runs the workload on `mem`. `snapshot` is called just before and just after the measured
/// interval (to read swap counters); both results are returned with the outcome.
pub fn run<S>(mem: Mem, p: &ProbeParams, mut snapshot: impl FnMut() -> S) -> (ProbeOutcome, S, S) {
    assert!(
        p.hot_pages >= 1 && p.hot_pages < mem.pages(),
        "the hot set must leave pages to thrash"
    );
    let started = Instant::now();
    fill(mem, p.hot_pages, p.threads);
    let setup_s = started.elapsed().as_secs_f64();

    let errors = ErrorLog::new("probe");
    let interval = Duration::from_micros(p.interval_us);
    let before = snapshot();
    let started = Instant::now();
    let stop = AtomicBool::new(false);
    let (samples, writes) = thread::scope(|s| {
        let (stop, errors) = (&stop, &errors);
        let thrashers: Vec<_> = (0..p.threads)
            .map(|id| s.spawn(move || thrash(mem, p.hot_pages, id as u64, stop, errors)))
            .collect();
        let probe = s.spawn(move || probe_loop(mem, p.hot_pages, interval, stop, errors));
        thread::sleep(Duration::from_secs_f64(p.seconds));
        stop.store(true, Relaxed);
        let writes: u64 = thrashers.into_iter().map(join).sum();
        (join(probe), writes)
    });
    let measured_s = started.elapsed().as_secs_f64();
    let after = snapshot();

    let outcome = ProbeOutcome {
        thrashed_pages: (mem.pages() - p.hot_pages) as u64,
        hot_pages: p.hot_pages as u64,
        setup_s,
        measured_s,
        rtt: samples.rtt(),
        writes,
        verify_errors: errors.count(),
    };
    (outcome, before, after)
}

fn join<T>(t: thread::ScopedJoinHandle<T>) -> T {
    t.join().unwrap_or_else(|e| std::panic::resume_unwind(e))
}

/// Writes every page's pattern: the thrashed set in parallel, then the hot set, so that the
/// hot set is the most recently used memory when the measurement starts.
fn fill(mem: Mem, hot_pages: usize, threads: usize) {
    for_page_ranges(mem.pages() - hot_pages, threads, |pages| {
        for page in pages {
            let page = hot_pages + page;
            pattern::fill(mem.page(page), page as u64, pattern::Data::Random);
        }
    });
    for page in 0..hot_pages {
        pattern::fill(mem.page(page), page as u64, pattern::Data::Random);
    }
}

/// Bumps the version of uniformly random thrashed pages until `stop`; returns the writes.
fn thrash(mem: Mem, hot_pages: usize, seed: u64, stop: &AtomicBool, log: &ErrorLog) -> u64 {
    let mut rng = Rng::new(seed);
    let thrashed = (mem.pages() - hot_pages) as u64;
    let mut writes = 0;
    while !stop.load(Relaxed) {
        let page = hot_pages as u64 + rng.below(thrashed);
        let old = mem.page(page as usize)[0].fetch_add(1, Relaxed);
        log.check(pattern::check_header(page, old, 0));
        writes += 1;
    }
    writes
}

/// Probes the hot pages in turn, one every `interval`, until `stop` (at least once).
fn probe_loop(
    mem: Mem,
    hot_pages: usize,
    interval: Duration,
    stop: &AtomicBool,
    log: &ErrorLog,
) -> Samples {
    precise_sleeps();
    let mut samples = Samples::new();
    let mut due = Instant::now();
    loop {
        let n = samples.count as usize;
        let (page, version) = (n % hot_pages, (n / hot_pages) as u32);
        let header = &mem.page(page)[0];
        let started = Instant::now();
        let old = header.load(Relaxed);
        header.store(old + 1, Relaxed);
        samples.record(started.elapsed());
        log.check(exact_header(page as u64, old, version));
        if stop.load(Relaxed) {
            return samples;
        }
        wait_until_due(&mut due, interval);
    }
}

/// The probe writes its pages alone: their version is known exactly.
fn exact_header(page: u64, found: u64, version: u32) -> Result<(), pattern::Mismatch> {
    pattern::check_header(page, found, version)?;
    if pattern::header_version(found) != version {
        return Err(pattern::Mismatch {
            page,
            word: 0,
            expected: pattern::header(page, version),
            found,
        });
    }
    Ok(())
}

/// Sleeps until the next probe is due, `interval` after the last one was due. A probe that
/// is late goes at once and the schedule restarts from it, as `ping -i` does: no burst to
/// catch up.
fn wait_until_due(due: &mut Instant, interval: Duration) {
    if interval.is_zero() {
        return;
    }
    *due += interval;
    let now = Instant::now();
    match due.checked_duration_since(now) {
        Some(wait) => thread::sleep(wait),
        None => *due = now,
    }
}

/// Asks the kernel to wake this thread on time: the default timer slack (50 µs) would
/// stretch a 100 µs interval by half.
fn precise_sleeps() {
    // SAFETY: PR_SET_TIMERSLACK only changes this thread's timer slack.
    unsafe { libc::prctl(libc::PR_SET_TIMERSLACK, 1 as libc::c_ulong) };
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::workload::mem::{AnonMap, Mapped};
    use uswap_core::PAGE_SIZE;

    fn params(interval_us: u64, seconds: f64) -> ProbeParams {
        ProbeParams {
            threads: 2,
            hot_pages: 4,
            interval_us,
            seconds,
        }
    }

    /// The versions of pages `range`: how often each was written since the fill.
    fn versions(mem: Mem, range: std::ops::Range<usize>) -> u64 {
        range
            .map(|p| pattern::header_version(mem.page(p)[0].load(Relaxed)) as u64)
            .sum()
    }

    #[test]
    fn every_probe_and_every_thrasher_write_lands_in_memory() {
        let map = AnonMap::new(64 * PAGE_SIZE).unwrap();
        let mem = map.mem();
        let mut calls = 0;
        let (out, before, after) = run(mem, &params(0, 0.05), || {
            calls += 1;
            calls
        });
        assert_eq!((before, after), (1, 2));
        assert_eq!((out.hot_pages, out.thrashed_pages), (4, 60));
        assert_eq!(out.verify_errors, 0);
        assert!(out.writes > 0 && out.rtt.probes > 0, "{out:?}");
        assert_eq!(versions(mem, 0..4), out.rtt.probes);
        assert_eq!(versions(mem, 4..64), out.writes);
        for page in 4..64 {
            assert!(
                pattern::check_page(mem.page(page), page as u64, 0, pattern::Data::Random)[1..]
                    .is_empty()
            );
        }
    }

    #[test]
    fn an_interval_bounds_the_number_of_probes() {
        let map = AnonMap::new(16 * PAGE_SIZE).unwrap();
        let (out, (), ()) = run(map.mem(), &params(2000, 0.1), || ());
        let most = (out.measured_s / 0.002).floor() as u64 + 1;
        assert!(
            (1..=most).contains(&out.rtt.probes),
            "{} probes in {:.3} s at 2 ms",
            out.rtt.probes,
            out.measured_s
        );
        // Back to back, the probe runs far more often than every 2 ms.
        let (flood, (), ()) = run(map.mem(), &params(0, 0.1), || ());
        assert!(flood.rtt.probes > 1000, "{flood:?}");
    }

    #[test]
    fn a_late_probe_restarts_the_schedule() {
        let start = Instant::now();
        let mut due = start - Duration::from_millis(10);
        wait_until_due(&mut due, Duration::from_micros(100));
        assert!(due >= start, "no catching up on missed probes");
        let mut due = Instant::now();
        let was = due;
        wait_until_due(&mut due, Duration::from_micros(500));
        assert_eq!(due, was + Duration::from_micros(500));
        assert!(Instant::now() >= due);
    }

    #[test]
    fn a_wrong_version_in_the_hot_set_is_caught() {
        assert!(exact_header(3, pattern::header(3, 7), 7).is_ok());
        assert!(exact_header(3, pattern::header(3, 8), 7).is_err());
        assert!(exact_header(3, pattern::header(3, 6), 7).is_err());
        assert!(exact_header(3, pattern::header(4, 7), 7).is_err());
    }

    fn samples_us(values: impl IntoIterator<Item = u64>) -> Rtt {
        let mut s = Samples::new();
        for us in values {
            s.record(Duration::from_micros(us));
        }
        s.rtt()
    }

    #[test]
    fn min_avg_max_mdev_are_exact() {
        // 2, 4, 4, 4, 5, 5, 7, 9: mean 5, population standard deviation 2.
        let r = samples_us([2, 4, 4, 4, 5, 5, 7, 9]);
        assert_eq!(r.probes, 8);
        assert_eq!((r.min_us, r.avg_us, r.max_us), (2.0, 5.0, 9.0));
        assert!((r.mdev_us - 2.0).abs() < 1e-9, "{r:?}");
        let one = samples_us([40]);
        assert_eq!((one.min_us, one.max_us, one.mdev_us), (40.0, 40.0, 0.0));
        assert_eq!(
            (one.p50_us, one.p999_us),
            (40.0, 40.0),
            "percentiles within min..max"
        );
        assert_eq!(samples_us([]), Rtt::default());
    }

    #[test]
    fn percentiles_come_from_the_distribution() {
        let r = samples_us(1..=1000);
        let near = |v: f64, want: f64| (v - want).abs() <= want * 0.002;
        assert!(near(r.p50_us, 500.0), "{r:?}");
        assert!(near(r.p99_us, 990.0), "{r:?}");
        assert!(near(r.p999_us, 999.0), "{r:?}");
        assert!((r.avg_us - 500.5).abs() < 1e-9);
        // One slow probe in a thousand shows at p99.9 but not at p99.
        let r = samples_us((0..999).map(|_| 10).chain([5000]));
        assert!(near(r.p99_us, 10.0) && near(r.max_us, 5000.0), "{r:?}");
        assert!(r.p999_us <= 10.01, "the 1000th value is above p99.9: {r:?}");
    }
}
