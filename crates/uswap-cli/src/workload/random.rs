//! pmbench-like random access with every read verified.
//!
//! Setup writes every page's pattern (not measured). Then each thread picks random pages
//! (uniformly, or skewed as its [`Distribution`] says); an access touches one page: a
//! write bumps the page's version in its header, a read checks the header and one random
//! pattern word. With scans on (`RandomParams::scan_every`), each thread also reads its
//! share of the region in page order after every so many accesses, each page checked as a
//! read is: a scan through the whole set that pushes other pages out, as a query or a
//! backup does. The versions each writer produced are kept
//! in a side table outside the measured memory, so a reader knows the lowest version a page
//! may show. A final pass checks every word of every page.

use super::cpu::CpuUse;
use super::distribution::{Distribution, Picker};
use super::mem::{Mem, WORDS};
use super::pattern::{self, Data, ErrorLog};
use super::rng::Rng;
use serde::{Deserialize, Serialize};
use std::ops::Range;
use std::sync::atomic::Ordering::{AcqRel, Acquire, Relaxed, Release};
use std::sync::atomic::{AtomicBool, AtomicU32};
use std::thread;
use std::time::{Duration, Instant};
use uswap_core::stats::{new_histogram, record, Latency};

/// The final pass uses at least this many threads, so a swap device sees some queue depth.
const MIN_VERIFY_THREADS: usize = 4;

#[derive(Clone, Copy, Debug, Serialize, Deserialize, PartialEq)]
pub struct RandomParams {
    pub threads: usize,
    /// Share of accesses that are writes, in percent.
    pub write_pct: u8,
    pub seconds: f64,
    /// Each accessing thread runs with syscall dispatch on (SIGBUS mode).
    #[serde(default)]
    pub syscall_dispatch: bool,
    /// How accesses are spread over the pages.
    #[serde(default)]
    pub distribution: Distribution,
    /// After every this many of its accesses, each thread reads its share of the region in
    /// page order (0: never).
    #[serde(default)]
    pub scan_every: u64,
    /// What the pages hold (how well they compress).
    #[serde(default)]
    pub data: Data,
}

#[derive(Clone, Debug, Serialize, Deserialize)]
pub struct RandomOutcome {
    pub pages: u64,
    /// Filling every page with its pattern.
    pub setup_s: f64,
    pub measured_s: f64,
    /// The final check of every page.
    pub verify_s: f64,
    pub reads: u64,
    pub writes: u64,
    /// Reads made by sequential scans (`scan_every`), besides `reads`.
    #[serde(default)]
    pub scan_reads: u64,
    /// Time of one access (including any fault it took), measured by the accessing thread.
    pub access_latency: Latency,
    /// What the process spent over the measured interval, every thread counted.
    pub cpu: CpuUse,
    /// Wrong words seen by reads during the measured run.
    pub errors_during_run: u64,
    /// Pages with wrong words found by the final pass.
    pub errors_final_pass: u64,
}

impl RandomOutcome {
    pub fn accesses(&self) -> u64 {
        self.reads + self.writes + self.scan_reads
    }

    pub fn verify_errors(&self) -> u64 {
        self.errors_during_run + self.errors_final_pass
    }
}

/// Runs the workload on `mem`. `snapshot` is called just before and just after the measured
/// interval (to read swap counters); both results are returned with the outcome.
pub fn run<S>(
    mem: Mem,
    p: &RandomParams,
    mut snapshot: impl FnMut() -> S,
) -> (RandomOutcome, S, S) {
    let written: Vec<AtomicU32> = (0..mem.pages()).map(|_| AtomicU32::new(0)).collect();

    let started = Instant::now();
    for_page_ranges(mem.pages(), p.threads, |pages| {
        for page in pages {
            pattern::fill(mem.page(page), page as u64, p.data);
        }
    });
    let setup_s = started.elapsed().as_secs_f64();

    let run_errors = ErrorLog::new("read");
    let before = snapshot();
    let cpu_before = CpuUse::now();
    let started = Instant::now();
    let stop = AtomicBool::new(false);
    let results: Vec<ThreadResult> = thread::scope(|s| {
        let threads: Vec<_> = (0..p.threads)
            .map(|id| {
                let (written, stop, log) = (&written, &stop, &run_errors);
                s.spawn(move || {
                    if p.syscall_dispatch {
                        uswap_core::syscall_dispatch::enable_for_this_thread()
                            .expect("turning syscall dispatch on");
                    }
                    let picker = Picker::new(p.distribution, mem.pages() as u64, id as u64);
                    let chunk = mem.pages().div_ceil(p.threads);
                    let scan = Scan {
                        every: p.scan_every,
                        share: (id * chunk).min(mem.pages())..((id + 1) * chunk).min(mem.pages()),
                    };
                    let r = access_loop(
                        mem,
                        written,
                        (picker, p.write_pct, scan, p.data),
                        id as u64,
                        stop,
                        log,
                    );
                    if p.syscall_dispatch {
                        uswap_core::syscall_dispatch::disable_for_this_thread();
                    }
                    r
                })
            })
            .collect();
        thread::sleep(Duration::from_secs_f64(p.seconds));
        stop.store(true, Relaxed);
        threads
            .into_iter()
            .map(|t| t.join().unwrap_or_else(|e| std::panic::resume_unwind(e)))
            .collect()
    });
    let measured_s = started.elapsed().as_secs_f64();
    let cpu = CpuUse::now().since(&cpu_before);
    let after = snapshot();

    let started = Instant::now();
    let final_errors = verify_all(mem, &written, p.threads.max(MIN_VERIFY_THREADS), p.data);
    let verify_s = started.elapsed().as_secs_f64();

    let mut hist = new_histogram();
    for r in &results {
        hist.add(&r.latency).expect("histograms share bounds");
    }
    let outcome = RandomOutcome {
        pages: mem.pages() as u64,
        setup_s,
        measured_s,
        verify_s,
        reads: results.iter().map(|r| r.reads).sum(),
        writes: results.iter().map(|r| r.writes).sum(),
        scan_reads: results.iter().map(|r| r.scan_reads).sum(),
        access_latency: Latency::of(&hist),
        cpu,
        errors_during_run: run_errors.count(),
        errors_final_pass: final_errors,
    };
    (outcome, before, after)
}

struct ThreadResult {
    reads: u64,
    writes: u64,
    scan_reads: u64,
    latency: hdrhistogram::Histogram<u64>,
}

/// One thread's sequential scans: after every `every` accesses (0: never), its `share` of
/// the region read in page order.
struct Scan {
    every: u64,
    share: Range<usize>,
}

fn access_loop(
    mem: Mem,
    written: &[AtomicU32],
    (mut picker, write_pct, scan, data): (Picker, u8, Scan, Data),
    seed: u64,
    stop: &AtomicBool,
    log: &ErrorLog,
) -> ThreadResult {
    let mut rng = Rng::new(seed);
    let mut r = ThreadResult {
        reads: 0,
        writes: 0,
        scan_reads: 0,
        latency: new_histogram(),
    };
    let mut since_scan = 0;
    while !stop.load(Relaxed) {
        if scan.every > 0 {
            since_scan += 1;
            if since_scan > scan.every {
                since_scan = 0;
                for page in scan.share.clone() {
                    if stop.load(Relaxed) {
                        break;
                    }
                    let i = 1 + rng.below(WORDS as u64 - 1) as usize;
                    let started = Instant::now();
                    let checks = read(mem, written, page as u64, i, data);
                    record(&mut r.latency, started.elapsed());
                    r.scan_reads += 1;
                    log.check(checks.0);
                    log.check(checks.1);
                }
                continue;
            }
        }
        let page = picker.pick(&mut rng);
        let dice = rng.next_u64();
        let words = mem.page(page as usize);
        let started = Instant::now();
        if dice % 100 < write_pct as u64 {
            let old = words[0].fetch_add(1, AcqRel);
            // Publish the new version only after the page holds it: a reader that sees it
            // in the side table must see at least it in the page.
            written[page as usize].fetch_max(pattern::header_version(old) + 1, Release);
            record(&mut r.latency, started.elapsed());
            r.writes += 1;
            log.check(pattern::check_header(page, old, 0));
        } else {
            let i = 1 + (dice >> 32) as usize % (WORDS - 1);
            let checks = read(mem, written, page, i, data);
            record(&mut r.latency, started.elapsed());
            r.reads += 1;
            log.check(checks.0);
            log.check(checks.1);
        }
    }
    r
}

/// One read access: `page`'s header against the lowest version it may show, and its word
/// `i` against what `data` puts there. The checks' results, for the caller to log after it has timed the read.
fn read(
    mem: Mem,
    written: &[AtomicU32],
    page: u64,
    i: usize,
    data: Data,
) -> (Result<(), pattern::Mismatch>, Result<(), pattern::Mismatch>) {
    let words = mem.page(page as usize);
    let min_version = written[page as usize].load(Acquire);
    let header = words[0].load(Acquire);
    let word = words[i].load(Relaxed);
    (
        pattern::check_header(page, header, min_version),
        pattern::check_word(data, page, i, word),
    )
}

/// Checks every word of every page against its final version; returns the bad pages.
fn verify_all(mem: Mem, written: &[AtomicU32], threads: usize, data: Data) -> u64 {
    let log = ErrorLog::new("final pass");
    for_page_ranges(mem.pages(), threads, |pages| {
        for page in pages {
            let bad = pattern::check_page(
                mem.page(page),
                page as u64,
                written[page].load(Relaxed),
                data,
            );
            if let Some(first) = bad.first() {
                log.report(first, bad.len());
            }
        }
    });
    log.count()
}

/// Splits `0..pages` into one contiguous range per thread and runs `work` on each.
pub fn for_page_ranges(pages: usize, threads: usize, work: impl Fn(Range<usize>) + Sync) {
    let chunk = pages.div_ceil(threads.max(1)).max(1);
    thread::scope(|s| {
        for start in (0..pages).step_by(chunk) {
            let work = &work;
            s.spawn(move || work(start..(start + chunk).min(pages)));
        }
    });
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::workload::mem::{AnonMap, Mapped};

    #[test]
    fn a_short_run_on_plain_memory_is_clean_and_counts_snapshots() {
        let map = AnonMap::new(64 * uswap_core::PAGE_SIZE).unwrap();
        let params = RandomParams {
            threads: 2,
            write_pct: 50,
            seconds: 0.05,
            syscall_dispatch: false,
            distribution: Distribution::Zipf { s: 0.99 },
            scan_every: 100,
            data: Data::Compressible(3),
        };
        let mut calls = 0;
        let (out, before, after) = run(map.mem(), &params, || {
            calls += 1;
            calls
        });
        assert_eq!((before, after), (1, 2));
        assert!(out.reads > 0 && out.writes > 0, "{out:?}");
        // 64 pages, two threads: each scan reads a thread's 32.
        assert!(out.scan_reads >= 32, "{out:?}");
        assert_eq!(out.verify_errors(), 0);
        assert_eq!(out.access_latency.count, out.accesses());
    }

    #[test]
    fn the_final_pass_finds_a_corrupted_page() {
        let map = AnonMap::new(8 * uswap_core::PAGE_SIZE).unwrap();
        let mem = map.mem();
        let written: Vec<AtomicU32> = (0..8).map(|_| AtomicU32::new(0)).collect();
        for page in 0..8 {
            pattern::fill(mem.page(page), page as u64, Data::Text);
        }
        assert_eq!(verify_all(mem, &written, 3, Data::Text), 0);
        mem.page(6)[17].store(0, Relaxed);
        // A lost write: the side table says version 1, the page still has 0.
        written[2].store(1, Relaxed);
        assert_eq!(verify_all(mem, &written, 3, Data::Text), 2);
    }

    #[test]
    fn page_ranges_cover_every_page_once() {
        let seen: Vec<AtomicU32> = (0..10).map(|_| AtomicU32::new(0)).collect();
        for_page_ranges(10, 3, |r| {
            for p in r {
                seen[p].fetch_add(1, Relaxed);
            }
        });
        assert!(seen.iter().all(|s| s.load(Relaxed) == 1));
    }
}
