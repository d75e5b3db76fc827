//! The swap side: the swap cache, swap-in readahead (every policy, switched while the region
//! is in use) and swapoff, checked for data, counters and invariants.

mod common;

use std::sync::atomic::{AtomicBool, Ordering::Relaxed};
use std::sync::Arc;
use uswap_core::{
    Advice, Config, FaultMode, Readahead, ReadaheadPolicy, Region, SwapCacheMode, PAGE_SIZE,
};

const MIB: u64 = 1 << 20;

fn config(memory: u64, readahead: ReadaheadPolicy, page_cluster: u8) -> Config {
    let mut cfg = Config::new(memory);
    cfg.readahead = Readahead {
        policy: readahead,
        page_cluster,
    };
    cfg
}

/// A region of `pages` pages, every page filled (version 1) and then paged out in order,
/// so slot order follows address order.
fn swapped_out(cfg: Config, pages: usize) -> Region {
    let region = Region::new((pages * PAGE_SIZE) as u64, cfg).unwrap();
    for p in 0..pages {
        unsafe { common::fill(region.as_ptr(), p, 1) };
    }
    region.advise(0, region.len(), Advice::PageOut).unwrap();
    assert_eq!(region.stats().vmstat.pswpout, pages as u64);
    region
}

fn pages_of(region: &Region) -> usize {
    region.len() / PAGE_SIZE
}

#[test]
fn a_sequential_swap_back_reads_ahead_by_each_policy_and_loses_nothing() {
    for mode in [FaultMode::Thread, FaultMode::Sigbus] {
        for policy in ReadaheadPolicy::ALL {
            let mut cfg = config(4 * MIB, *policy, 3);
            cfg.fault_mode = mode;
            let region = swapped_out(cfg, 512);
            for p in 0..pages_of(&region) {
                unsafe { common::check(region.as_ptr(), p, 1) }.unwrap();
            }
            let s = region.stats();
            let v = s.vmstat;
            let what = format!("{mode:?} {policy}: {v:?} {:?}", s.swap_cache);
            assert_eq!(v.failed_faults, 0, "{what}");
            assert_eq!(v.pswpin, 512, "every page read once: {what}");
            match policy {
                ReadaheadPolicy::None => assert_eq!(v.swap_ra, 0, "{what}"),
                // Fixed reads 7 pages ahead per 8; the others learn first.
                ReadaheadPolicy::Fixed => assert!(v.swap_ra >= 400, "{what}"),
                _ => assert!(v.swap_ra >= 256, "{what}"),
            }
            // A walk through mapped readahead pages raises no fault: their use is inferred
            // when the next miss follows the window (in the region, or on the device for
            // the slot policies, where a cluster boundary can break the sequence).
            assert!(
                v.swap_ra_hit * 10 >= v.swap_ra * 9 && v.swap_ra_hit <= v.swap_ra,
                "a sequential walk uses nearly all: {what}"
            );
            assert_eq!(s.swap_cache.readahead_hits, v.swap_ra_hit, "{what}");
            assert_eq!(v.pgmajfault + v.swap_ra, 512, "{what}");
            region.check_invariants().unwrap();
        }
    }
}

/// A walk that checks each page and then rewrites it (a usemem-like program) uses every
/// page readahead mapped with a write: those uses count as hits, so the windows grow to
/// page-cluster's size as for a read-only walk. (They were credited only when the next
/// window's inference found the pages still clean, and stayed at two pages.)
#[test]
fn a_sequential_rewrite_is_credited_to_readahead_and_its_windows_grow() {
    for mode in [FaultMode::Thread, FaultMode::Sigbus] {
        for policy in [ReadaheadPolicy::Vma, ReadaheadPolicy::Scaling] {
            let mut cfg = config(4 * MIB, policy, 3);
            cfg.fault_mode = mode;
            let region = swapped_out(cfg, 512);
            // Room for the SIGBUS handler to read ahead, as `uswap run` gives each thread.
            let stack = common::AltStack::new(64 << 10);
            for p in 0..pages_of(&region) {
                unsafe { common::check(region.as_ptr(), p, 1) }.unwrap();
                unsafe { common::fill(region.as_ptr(), p, 2) };
            }
            // The handler stays well inside the room it asks for (sigbus::READAHEAD_STACK,
            // 24 KiB; 48 KiB unoptimized): 11 KiB measured, the kernel's frame included.
            assert!(
                stack.used() < 20 << 10,
                "{} bytes: {mode:?} {policy}",
                stack.used()
            );
            drop(stack);
            let s = region.stats();
            let v = s.vmstat;
            let what = format!("{mode:?} {policy}: {v:?}");
            assert_eq!(v.failed_faults, 0, "{what}");
            assert_eq!(v.pswpin, 512, "every page read once: {what}");
            assert!(
                v.swap_ra_hit * 10 >= v.swap_ra * 9,
                "the writes are uses: {what}"
            );
            // Eight-page windows once grown: well under one major fault per four pages.
            assert!(v.pgmajfault * 4 <= 512, "windows grew: {what}");
            // Once the walk is seen to write what it reads, its windows are mapped
            // writable: most pages take no write fault (one each before).
            assert!(v.pgfault * 2 <= 512, "few write faults: {what}");
            // The SIGBUS handler reads windows itself: none handed to the service thread
            // (the region's memory is ample, so no fault needs direct reclaim).
            assert_eq!(v.sigbus_handovers, 0, "{what}");
            for p in 0..pages_of(&region) {
                unsafe { common::check(region.as_ptr(), p, 2) }.unwrap();
            }
            region.check_invariants().unwrap();
        }
    }
}

/// A walk that only reads, after one that wrote, gets clean windows again: its pages keep
/// their swap copies, so paging them out again writes almost nothing.
#[test]
fn a_read_only_walk_after_a_rewrite_keeps_its_swap_copies() {
    for mode in [FaultMode::Thread, FaultMode::Sigbus] {
        let mut cfg = config(4 * MIB, ReadaheadPolicy::Vma, 3);
        cfg.fault_mode = mode;
        let region = swapped_out(cfg, 512);
        let _stack = common::AltStack::new(64 << 10);
        for p in 0..pages_of(&region) {
            unsafe { common::check(region.as_ptr(), p, 1) }.unwrap();
            unsafe { common::fill(region.as_ptr(), p, 2) };
        }
        region.advise(0, region.len(), Advice::PageOut).unwrap();
        let before = region.stats().vmstat;
        for p in 0..pages_of(&region) {
            unsafe { common::check(region.as_ptr(), p, 2) }.unwrap();
        }
        region.advise(0, region.len(), Advice::PageOut).unwrap();
        let v = region.stats().vmstat.since(&before);
        let what = format!("{mode:?}: {v:?}");
        assert_eq!(v.pswpin, 512, "{what}");
        // The rewrite's writable run ends within 16 windows of 8 pages; then clean.
        assert!(v.pswpout <= 160, "read pages were written again: {what}");
        assert!(v.pgclean_dropped >= 352, "{what}");
        region.check_invariants().unwrap();
    }
}

#[test]
fn the_swap_cache_holds_pages_in_memory_with_a_slot_in_both_modes() {
    for mode in SwapCacheMode::ALL {
        let mut cfg = config(4 * MIB, ReadaheadPolicy::None, 0);
        cfg.swap.swap_cache = *mode;
        let region = swapped_out(cfg, 64);
        // Read back (clean: slots kept, so cached), then write half (dirty: slot freed).
        for p in 0..64 {
            unsafe { common::check(region.as_ptr(), p, 1) }.unwrap();
        }
        for p in 0..32 {
            unsafe { common::fill(region.as_ptr(), p, 2) };
        }
        region.check_invariants().unwrap();
        let c = region.stats().swap_cache;
        assert_eq!(c.lookups, 64, "{mode}: {c:?}");
        assert_eq!(c.hits, 0, "{mode}: swapped pages are not in memory: {c:?}");
        // 64 written (added and deleted around write-back), 64 swapped in, 32 freed.
        assert_eq!((c.adds, c.deletes), (128, 96), "{mode}: {c:?}");
        // Parked inactive and touched again: a hit, no I/O.
        region.advise(0, region.len(), Advice::Cold).unwrap();
        let before = region.stats();
        for p in 32..64 {
            unsafe { common::check(region.as_ptr(), p, 1) }.unwrap();
        }
        let after = region.stats();
        assert_eq!(after.vmstat.pswpin, before.vmstat.pswpin, "{mode}");
        let hits = after.swap_cache.hits - before.swap_cache.hits;
        assert_eq!(hits, 32, "{mode}: {:?}", after.swap_cache);
        region.check_invariants().unwrap();
        let lock = after
            .lockstat
            .iter()
            .find(|l| l.name == "swap_cache")
            .unwrap();
        assert!(lock.stat.acquisitions > 0);
    }
}

/// Threads walk the region and check every page while the main thread switches the policy
/// and page-cluster: each switch takes effect (readahead stops under `none`, resumes after)
/// and no page is lost.
#[test]
fn switching_readahead_under_load_takes_effect_and_loses_nothing() {
    let pages = 2048;
    let region = Arc::new(swapped_out(
        config(2 * MIB, ReadaheadPolicy::Fixed, 3),
        pages,
    ));
    let stop = Arc::new(AtomicBool::new(false));
    let walkers: Vec<_> = (0..2)
        .map(|t| {
            let (region, stop) = (region.clone(), stop.clone());
            std::thread::spawn(move || {
                let mut checked = 0u64;
                while !stop.load(Relaxed) {
                    for i in 0..pages {
                        let p = if t == 0 { i } else { pages - 1 - i };
                        unsafe { common::check(region.as_ptr(), p, 1) }.unwrap();
                        checked += 1;
                    }
                }
                checked
            })
        })
        .collect();
    let ra = |policy, page_cluster| Readahead {
        policy,
        page_cluster,
    };
    let phase = |setting: Readahead| {
        region.set_readahead(setting).unwrap();
        assert_eq!(region.readahead(), setting);
        // Let swap-ins begun under the old setting finish before measuring.
        std::thread::sleep(std::time::Duration::from_millis(20));
        let before = region.stats().vmstat;
        std::thread::sleep(std::time::Duration::from_millis(300));
        region.stats().vmstat.since(&before)
    };
    for round in 0..2 {
        let none = phase(ra(ReadaheadPolicy::None, 3));
        assert!(
            none.pgmajfault > 0,
            "round {round}: the walk swaps in: {none:?}"
        );
        assert_eq!(none.swap_ra, 0, "round {round}: none reads nothing ahead");
        let fixed = phase(ra(ReadaheadPolicy::Fixed, 4));
        assert!(fixed.swap_ra > fixed.pgmajfault, "round {round}: {fixed:?}");
        phase(ra(ReadaheadPolicy::Scaling, 2));
        phase(ra(ReadaheadPolicy::Vma, 5));
    }
    let bad = Readahead {
        policy: ReadaheadPolicy::Fixed,
        page_cluster: 9,
    };
    assert!(region.set_readahead(bad).is_err());
    stop.store(true, Relaxed);
    for w in walkers {
        assert!(w.join().unwrap() > 0);
    }
    assert_eq!(region.stats().vmstat.failed_faults, 0);
    region.check_invariants().unwrap();
}

#[test]
fn swapoff_brings_every_page_back_and_frees_every_slot() {
    for policy in [
        ReadaheadPolicy::None,
        ReadaheadPolicy::Fixed,
        ReadaheadPolicy::Vma,
    ] {
        let pages = 1024;
        let region = swapped_out(config(2 * MIB, policy, 3), pages);
        // Half the pages were written again since: only the others keep valid copies.
        for p in (0..pages).step_by(2) {
            unsafe { common::fill(region.as_ptr(), p, 2) };
        }
        let refused = region.swapoff(&mut |_, _| {}).unwrap_err().to_string();
        assert!(refused.contains("set_memory_limit"), "{refused}");

        region.set_memory_limit(8 * MIB).unwrap();
        let at_swapoff = region.stats().vmstat;
        let mut calls = Vec::new();
        let report = region
            .swapoff(&mut |done, total| calls.push((done, total)))
            .unwrap();
        assert_eq!(report.lost, 0, "{policy}");
        assert!(
            report.pages > 0 && report.slots_freed > 0,
            "{policy}: {report:?}"
        );
        assert_eq!(calls.first().map(|c| c.0), Some(0));
        assert_eq!(calls.last(), Some(&(report.pages, report.pages)));
        let s = region.stats();
        assert_eq!(s.swap_used_pages, 0, "{policy}: every slot freed");
        assert_eq!(s.resident_pages, pages as u64, "{policy}");
        if policy != ReadaheadPolicy::None {
            assert!(s.vmstat.swap_ra > 0, "{policy}: swapoff reads ahead");
        }
        let before = s.vmstat;
        for p in 0..pages {
            let version = if p % 2 == 0 { 2 } else { 1 };
            unsafe { common::check(region.as_ptr(), p, version) }.unwrap();
        }
        let after = region.stats().vmstat.since(&before);
        assert_eq!(after.pswpin, 0, "{policy}: nothing left to read: {after:?}");
        // Every page gave up its slot, so it is dirty: writing raises no write-protect
        // fault. A fault since swapoff can only be on a page a reclaim pass still running
        // when the limit was raised parked inactive again.
        for p in 0..pages {
            unsafe { common::fill(region.as_ptr(), p, 3) };
        }
        let writes = region.stats().vmstat.since(&before);
        let parked = region.stats().vmstat.since(&at_swapoff).pgdeactivate;
        assert!(
            writes.pgfault <= parked,
            "{policy}: {parked} parked, {writes:?}"
        );
        region.check_invariants().unwrap();
    }
}

#[test]
fn a_lowered_memory_limit_is_reached_by_reclaim() {
    let region = Region::new(16 * MIB, Config::new(8 * MIB)).unwrap();
    let pages = pages_of(&region);
    for p in 0..pages / 2 {
        unsafe { common::fill(region.as_ptr(), p, 1) };
    }
    region.set_memory_limit(2 * MIB).unwrap();
    // kswapd works toward the new limit; a fault reclaims directly meanwhile.
    let limit_pages = (2 * MIB) as usize / PAGE_SIZE;
    for _ in 0..200 {
        if region.stats().resident_pages <= limit_pages as u64 {
            break;
        }
        std::thread::sleep(std::time::Duration::from_millis(10));
    }
    assert!(region.stats().resident_pages <= limit_pages as u64);
    for p in 0..pages {
        let version = if p < pages / 2 { 1 } else { 0 };
        if version == 1 {
            unsafe { common::check(region.as_ptr(), p, 1) }.unwrap();
        } else {
            assert_eq!(unsafe { *region.as_ptr().add(p * PAGE_SIZE) }, 0);
        }
    }
    assert!(region.set_memory_limit(1).is_err(), "too small");
    region.check_invariants().unwrap();
}
