//! The LRU policies and working-set detection, end to end: where new pages go under each
//! policy, a switch while the region runs, refaults seen within the working set, and the
//! data intact throughout.

mod common;

use common::{check, fill};
use std::time::{Duration, Instant};
use uswap_core::{Config, LruPolicy, LruStats, ReadaheadPolicy, Region, PAGE_SIZE};

const MIB: u64 = 1 << 20;

/// 16 MiB over a 4 MiB limit; list adds not batched, so list lengths are exact at once;
/// no readahead, so every swap-in is a fault's own.
fn region(policy: LruPolicy) -> Region {
    let mut cfg = Config::new(4 * MIB);
    cfg.lru_policy = policy;
    cfg.lru_batch = 1;
    cfg.readahead.policy = ReadaheadPolicy::None;
    Region::new(16 * MIB, cfg).unwrap()
}

fn fill_pages(region: &Region, pages: std::ops::Range<usize>, version: u32) {
    for p in pages {
        unsafe { fill(region.as_ptr(), p, version) };
    }
}

fn check_pages(region: &Region, pages: std::ops::Range<usize>, version: u32) {
    for p in pages {
        unsafe { check(region.as_ptr(), p, version) }.unwrap();
    }
}

/// The lists once `pages` pages are on them: a handler thread adds the last fault's pages
/// after the fill has woken the program.
fn lists_holding(region: &Region, pages: u64) -> LruStats {
    let deadline = Instant::now() + Duration::from_secs(5);
    loop {
        let lru = region.stats().lru;
        if lru.active + lru.probation + lru.inactive == pages || Instant::now() > deadline {
            return lru;
        }
        std::thread::sleep(Duration::from_millis(1));
    }
}

#[test]
fn s3fifo_puts_new_pages_on_probation_and_a_switch_changes_where_the_next_go() {
    let region = region(LruPolicy::S3fifo);
    // Reclaim may have begun aging (from probation, first) below the limit: kswapd keeps
    // the inactive list at its target.
    fill_pages(&region, 0..256, 1);
    let lru = lists_holding(&region, 256);
    assert_eq!(lru.policy, LruPolicy::S3fifo);
    assert_eq!(
        (lru.active, lru.probation + lru.inactive),
        (0, 256),
        "{lru:?}"
    );
    region.set_lru_policy(LruPolicy::TwoList);
    fill_pages(&region, 256..512, 1);
    let lru = lists_holding(&region, 512);
    assert_eq!(lru.policy, LruPolicy::TwoList);
    assert_eq!(lru.active, 256, "{lru:?}");
    assert_eq!(lru.probation + lru.inactive, 256, "{lru:?}");
    // Past the limit, `two-list` ages what is left on probation first, until none is.
    let pages = region.len() / PAGE_SIZE;
    fill_pages(&region, 512..pages, 1);
    assert_eq!(region.stats().lru.probation, 0, "{:?}", region.stats().lru);
    check_pages(&region, 0..pages, 1);
    region.check_invariants().unwrap();
}

/// The first pages written are the first evicted under both policies (the tail of the
/// list they joined); read back soon after, each is a refault well within the mapped
/// lists, and goes to the active list.
#[test]
fn a_page_evicted_and_read_soon_after_refaults_within_the_working_set() {
    for &policy in LruPolicy::ALL {
        let region = region(policy);
        let mut written = 0;
        while region.stats().vmstat.pswpout < 64 {
            fill_pages(&region, written..written + 1, 7);
            written += 1;
        }
        let before = region.stats();
        check_pages(&region, 0..32, 7);
        let after = region.stats();
        let (b, a) = (before.vmstat, after.vmstat);
        let refaults = a.workingset_refault - b.workingset_refault;
        let activated = a.workingset_activate - b.workingset_activate;
        assert!(
            a.pgmajfault > b.pgmajfault,
            "{policy}: nothing was out: {a:?}"
        );
        assert!(
            activated > 0 && activated <= refaults && refaults <= a.pgmajfault - b.pgmajfault,
            "{policy}: {refaults} refaults, {activated} in the working set, of {} majors",
            a.pgmajfault - b.pgmajfault
        );
        assert!(after.lru.active > 0, "{policy}: {:?}", after.lru);
        check_pages(&region, 0..written, 7);
        region.check_invariants().unwrap();
    }
}

/// Sequential passes over four times the limit: each page read again was evicted about
/// three limits' worth of evictions earlier, far past the mapped lists, so its refault is
/// distant (the pages of a scan stay on probation under `s3fifo`).
#[test]
fn pages_read_a_pass_after_their_eviction_refault_outside_the_working_set() {
    let region = region(LruPolicy::S3fifo);
    let pages = region.len() / PAGE_SIZE;
    fill_pages(&region, 0..pages, 1);
    check_pages(&region, 0..pages, 1);
    let before = region.stats().vmstat;
    check_pages(&region, 0..pages, 1);
    let after = region.stats().vmstat;
    let refaults = after.workingset_refault - before.workingset_refault;
    let activated = after.workingset_activate - before.workingset_activate;
    assert!(refaults > (pages / 2) as u64, "{after:?}");
    assert!(
        activated * 10 < refaults,
        "{activated} of {refaults} called recent"
    );
    region.check_invariants().unwrap();
}
