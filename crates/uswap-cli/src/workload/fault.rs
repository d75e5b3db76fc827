//! First-touch faults, will-it-scale page_fault1 style: each thread repeatedly maps a fresh
//! region, writes one byte to every page, and unmaps it.

use super::mem::Mapped;
use anyhow::Result;
use serde::{Deserialize, Serialize};
use std::sync::atomic::Ordering::Relaxed;
use std::sync::Barrier;
use std::thread;
use std::time::{Duration, Instant};

#[derive(Clone, Copy, Debug, Serialize, Deserialize, PartialEq)]
pub struct FaultParams {
    pub threads: usize,
    pub seconds: f64,
}

#[derive(Clone, Debug, Serialize, Deserialize)]
pub struct FaultOutcome {
    pub pages_touched: u64,
    pub iterations: u64,
    /// Sum over threads of each thread's pages per second of touching alone.
    pub touch_pages_per_s: f64,
    /// The same, with creating and dropping the regions counted in.
    pub total_pages_per_s: f64,
    pub wall_s: f64,
}

/// Runs the loop in `p.threads` threads. `fresh` makes a new mapping; `retire` disposes of
/// one (and may read its statistics first).
pub fn run<M: Mapped>(
    p: &FaultParams,
    fresh: impl Fn() -> Result<M> + Sync,
    retire: impl Fn(M) + Sync,
) -> Result<FaultOutcome> {
    let start_line = Barrier::new(p.threads);
    let started = Instant::now();
    let per_thread: Vec<Result<ThreadResult>> = thread::scope(|s| {
        let threads: Vec<_> = (0..p.threads)
            .map(|_| {
                let (fresh, retire, start_line) = (&fresh, &retire, &start_line);
                let seconds = Duration::from_secs_f64(p.seconds);
                s.spawn(move || {
                    start_line.wait();
                    touch_loop(seconds, fresh, retire)
                })
            })
            .collect();
        threads
            .into_iter()
            .map(|t| t.join().unwrap_or_else(|e| std::panic::resume_unwind(e)))
            .collect()
    });
    let wall_s = started.elapsed().as_secs_f64();
    let results = per_thread.into_iter().collect::<Result<Vec<_>>>()?;
    Ok(FaultOutcome {
        pages_touched: results.iter().map(|r| r.pages).sum(),
        iterations: results.iter().map(|r| r.iterations).sum(),
        touch_pages_per_s: results.iter().map(|r| r.pages as f64 / r.touch_s).sum(),
        total_pages_per_s: results.iter().map(|r| r.pages as f64 / r.total_s).sum(),
        wall_s,
    })
}

struct ThreadResult {
    pages: u64,
    iterations: u64,
    touch_s: f64,
    total_s: f64,
}

fn touch_loop<M: Mapped>(
    seconds: Duration,
    fresh: &impl Fn() -> Result<M>,
    retire: &impl Fn(M),
) -> Result<ThreadResult> {
    let mut r = ThreadResult {
        pages: 0,
        iterations: 0,
        touch_s: 0.0,
        total_s: 0.0,
    };
    let started = Instant::now();
    // At least one iteration, however short the time asked for.
    while r.iterations == 0 || started.elapsed() < seconds {
        let map = fresh()?;
        let mem = map.mem();
        let touch = Instant::now();
        for page in 0..mem.pages() {
            mem.byte(page).store(1, Relaxed);
        }
        r.touch_s += touch.elapsed().as_secs_f64();
        r.pages += mem.pages() as u64;
        r.iterations += 1;
        retire(map);
    }
    r.total_s = started.elapsed().as_secs_f64();
    Ok(r)
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::workload::mem::AnonMap;
    use std::sync::atomic::AtomicU64;
    use uswap_core::PAGE_SIZE;

    #[test]
    fn every_page_of_every_mapping_is_touched() {
        let retired = AtomicU64::new(0);
        let p = FaultParams {
            threads: 2,
            seconds: 0.02,
        };
        let out = run(
            &p,
            || Ok(AnonMap::new(16 * PAGE_SIZE)?),
            |map| {
                let mem = map.mem();
                assert!((0..16).all(|pg| mem.page(pg)[0].load(Relaxed) == 1));
                retired.fetch_add(1, Relaxed);
            },
        )
        .unwrap();
        assert_eq!(out.iterations, retired.load(Relaxed));
        assert_eq!(out.pages_touched, out.iterations * 16);
        assert!(out.touch_pages_per_s >= out.total_pages_per_s);
    }

    #[test]
    fn a_failing_mapping_is_an_error() {
        let p = FaultParams {
            threads: 1,
            seconds: 0.01,
        };
        let err = run(
            &p,
            || -> Result<AnonMap> { anyhow::bail!("no memory") },
            drop,
        )
        .unwrap_err();
        assert!(err.to_string().contains("no memory"));
    }
}
