//! Dropping a region gives everything back. A test binary of its own, so no other test's
//! memory moves the resident set while it is measured.

mod common;

use uswap_core::swapfile::SwapDevice;
use uswap_core::{Config, Region, SwapConfig, PAGE_SIZE};

fn resident_bytes() -> u64 {
    let statm = std::fs::read_to_string("/proc/self/statm").unwrap();
    let pages: u64 = statm.split_whitespace().nth(1).unwrap().parse().unwrap();
    pages * PAGE_SIZE as u64
}

fn threads() -> usize {
    std::fs::read_dir("/proc/self/task").unwrap().count()
}

#[test]
fn drop_returns_memory_slots_and_threads() {
    const MIB: u64 = 1 << 20;
    let swap = SwapDevice::open(&SwapConfig::default()).unwrap();
    let (rss_before, threads_before) = (resident_bytes(), threads());
    let region = Region::with_swap(64 * MIB, Config::new(32 * MIB), swap.clone()).unwrap();
    for p in 0..region.len() / PAGE_SIZE {
        unsafe { common::fill(region.as_ptr(), p, 3) };
    }
    for p in (0..region.len() / PAGE_SIZE).step_by(7) {
        unsafe { common::check(region.as_ptr(), p, 3) }.unwrap();
    }
    assert!(swap.used_pages() > 0);
    assert!(
        resident_bytes() > rss_before + 16 * MIB,
        "the region's pages are resident"
    );
    assert!(threads() > threads_before, "handler threads and kswapd run");
    drop(region);
    assert_eq!(swap.used_pages(), 0, "every slot is freed");
    assert_eq!(
        threads(),
        threads_before,
        "handler threads and kswapd have stopped"
    );
    let rss_after = resident_bytes();
    assert!(
        rss_after < rss_before + 4 * MIB,
        "resident set {rss_after} did not return to about {rss_before}"
    );
}
