//! Swap-back: fill a set larger than memory, so that the older part of it is swapped out,
//! then bring all of it back, by touching every page or by turning swap off, and check it.
//!
//! The timed touch reads each page's header and one pattern word, enough to fault the page
//! in and to see that it is the right page; every word of every page is checked after the
//! timed phase, so that the check's arithmetic is not measured as swap-in time.

use super::mem::{Mem, WORDS};
use super::pattern::{self, ErrorLog};
use super::rng::Rng;
use anyhow::{Context, Result};
use clap::ValueEnum;
use serde::{Deserialize, Serialize};
use std::sync::atomic::Ordering::Relaxed;
use std::time::Instant;

/// How the set is brought back.
#[derive(Clone, Copy, Debug, PartialEq, Eq, ValueEnum, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum Mode {
    /// Read every page once, faulting in what is swapped out
    Touch,
    /// Turn swap off (after lifting the memory limit), which reads every page back
    Swapoff,
}

/// The order of the pages in touch mode.
#[derive(Clone, Copy, Debug, PartialEq, Eq, ValueEnum, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum Order {
    /// Address order
    Seq,
    /// A random permutation
    Random,
}

#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct SwapbackParams {
    pub mode: Mode,
    pub order: Order,
}

#[derive(Clone, Debug, Serialize, Deserialize)]
pub struct SwapbackOutcome {
    pub pages: u64,
    /// Filling every page with its pattern, in address order.
    pub fill_s: f64,
    /// The swap-back phase: the touching loop, or swapoff.
    pub swapback_s: f64,
    /// Pages in memory right after the swap-back phase (mincore).
    pub resident_after: u64,
    /// Checking every word of every page afterwards.
    pub verify_s: f64,
    /// Pages whose header or word was wrong when touched.
    pub errors_during_touch: u64,
    /// Pages with wrong words in the check afterwards.
    pub errors_final_check: u64,
}

impl SwapbackOutcome {
    pub fn verify_errors(&self) -> u64 {
        self.errors_during_touch + self.errors_final_check
    }
}

/// Runs the experiment on `mem`. `snapshot` is called just before and just after the
/// swap-back phase (for swap counters); in swapoff mode that phase is `swapoff`.
pub fn run<S>(
    mem: Mem,
    p: &SwapbackParams,
    mut snapshot: impl FnMut() -> S,
    swapoff: impl FnOnce() -> Result<()>,
) -> Result<(SwapbackOutcome, S, S)> {
    let started = Instant::now();
    for page in 0..mem.pages() {
        pattern::fill(mem.page(page), page as u64, pattern::Data::Random);
    }
    let fill_s = started.elapsed().as_secs_f64();

    let order = page_order(mem.pages(), p.order);
    let touch_errors = ErrorLog::new("touch");
    let before = snapshot();
    let started = Instant::now();
    match p.mode {
        Mode::Touch => touch(mem, &order, &touch_errors),
        Mode::Swapoff => swapoff()?,
    }
    let swapback_s = started.elapsed().as_secs_f64();
    let after = snapshot();

    let resident_after = mem
        .resident_pages()
        .context("counting resident pages (mincore)")?;
    let started = Instant::now();
    let errors_final_check = check_all(mem);
    let outcome = SwapbackOutcome {
        pages: mem.pages() as u64,
        fill_s,
        swapback_s,
        resident_after,
        verify_s: started.elapsed().as_secs_f64(),
        errors_during_touch: touch_errors.count(),
        errors_final_check,
    };
    Ok((outcome, before, after))
}

/// The pages in the order touch mode visits them (made before the timing starts).
fn page_order(pages: usize, order: Order) -> Vec<u32> {
    // The page number fits 32 bits: the pattern's header keeps it there.
    let mut list: Vec<u32> = (0..pages as u32).collect();
    if order == Order::Random {
        let mut rng = Rng::new(pages as u64);
        for i in (1..list.len()).rev() {
            list.swap(i, rng.below(i as u64 + 1) as usize);
        }
    }
    list
}

/// Reads the header and one pattern word of every page in `order`.
fn touch(mem: Mem, order: &[u32], log: &ErrorLog) {
    for &page in order {
        let page = page as u64;
        let words = mem.page(page as usize);
        let header = words[0].load(Relaxed);
        let i = 1 + page as usize % (WORDS - 1);
        log.check(pattern::check_header(page, header, 0));
        log.check(pattern::check_word(
            pattern::Data::Random,
            page,
            i,
            words[i].load(Relaxed),
        ));
    }
}

/// Checks every word of every page; returns the pages with wrong words.
fn check_all(mem: Mem) -> u64 {
    let log = ErrorLog::new("final check");
    for page in 0..mem.pages() {
        let bad = pattern::check_page(mem.page(page), page as u64, 0, pattern::Data::Random);
        if let Some(first) = bad.first() {
            log.report(first, bad.len());
        }
    }
    log.count()
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::workload::mem::{AnonMap, Mapped};
    use uswap_core::PAGE_SIZE;

    #[test]
    fn a_random_order_visits_every_page_once() {
        let mut seen = page_order(1000, Order::Random);
        assert_ne!(seen, page_order(1000, Order::Seq));
        seen.sort_unstable();
        assert_eq!(seen, page_order(1000, Order::Seq));
    }

    #[test]
    fn touch_mode_on_plain_memory_is_clean_and_resident() {
        let map = AnonMap::new(32 * PAGE_SIZE).unwrap();
        let p = SwapbackParams {
            mode: Mode::Touch,
            order: Order::Random,
        };
        let mut calls = 0;
        let (out, before, after) = run(
            map.mem(),
            &p,
            || {
                calls += 1;
                calls
            },
            || panic!("touch mode never turns swap off"),
        )
        .unwrap();
        assert_eq!((before, after), (1, 2));
        assert_eq!((out.pages, out.resident_after), (32, 32));
        assert_eq!(out.verify_errors(), 0);
    }

    #[test]
    fn swapoff_mode_runs_the_swapoff_and_the_check_finds_damage() {
        let map = AnonMap::new(8 * PAGE_SIZE).unwrap();
        let mem = map.mem();
        let p = SwapbackParams {
            mode: Mode::Swapoff,
            order: Order::Seq,
        };
        // The "swapoff" damages a page; the check afterwards must see it.
        let (out, ..) = run(
            mem,
            &p,
            || (),
            || {
                mem.page(3)[7].store(0, Relaxed);
                Ok(())
            },
        )
        .unwrap();
        assert_eq!(out.errors_during_touch, 0);
        assert_eq!(out.errors_final_check, 1);
    }
}
