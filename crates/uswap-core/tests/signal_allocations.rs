//! The SIGBUS handler allocates nothing: the thread it interrupted may be inside the
//! allocator, holding its lock. This test binary's allocator counts every allocation made
//! while a thread runs uswap's handler, through first touches, swap-ins with and without
//! readahead windows, write faults and writable windows.

mod common;

use std::alloc::{GlobalAlloc, Layout, System};
use std::sync::atomic::{AtomicU64, Ordering::Relaxed};
use uswap_core::{Advice, Config, FaultMode, Region, PAGE_SIZE};

static IN_HANDLER_ALLOCATIONS: AtomicU64 = AtomicU64::new(0);

struct Watched;

unsafe impl GlobalAlloc for Watched {
    unsafe fn alloc(&self, layout: Layout) -> *mut u8 {
        if uswap_core::in_sigbus_handler() {
            IN_HANDLER_ALLOCATIONS.fetch_add(1, Relaxed);
        }
        System.alloc(layout)
    }

    unsafe fn dealloc(&self, ptr: *mut u8, layout: Layout) {
        System.dealloc(ptr, layout)
    }
}

#[global_allocator]
static ALLOCATOR: Watched = Watched;

#[test]
fn the_sigbus_handler_allocates_nothing() {
    let mut cfg = Config::new(4 << 20);
    cfg.fault_mode = FaultMode::Sigbus;
    let region = Region::new(16 << 20, cfg).unwrap();
    let pages = region.len() / PAGE_SIZE;
    // The room `uswap run` gives each thread, so windows are read in the handler too.
    let _stack = common::AltStack::new(64 << 10);
    for p in 0..pages {
        unsafe { common::fill(region.as_ptr(), p, 1) };
    }
    region.advise(0, region.len(), Advice::PageOut).unwrap();
    // Sequential: readahead windows; then a rewrite: write faults, writable windows.
    for p in 0..pages {
        unsafe { common::check(region.as_ptr(), p, 1) }.unwrap();
    }
    for p in 0..pages {
        unsafe { common::check(region.as_ptr(), p, 1) }.unwrap();
        unsafe { common::fill(region.as_ptr(), p, 2) };
    }
    // Random: lone pages, reclaim running beside.
    let mut x = 0x9e37_79b9_7f4a_7c15u64;
    for _ in 0..4 * pages {
        x ^= x << 13;
        x ^= x >> 7;
        x ^= x << 17;
        let p = (x % pages as u64) as usize;
        unsafe { common::check(region.as_ptr(), p, 2) }.unwrap();
    }
    let v = region.stats().vmstat;
    assert!(
        v.pgmajfault > 1000 && v.swap_ra > 1000,
        "the handler was exercised: {v:?}"
    );
    assert!(
        v.sigbus_handovers * 2 < v.pgmajfault,
        "most faults stayed in the handler: {v:?}"
    );
    assert_eq!(IN_HANDLER_ALLOCATIONS.load(Relaxed), 0, "{v:?}");
    region.check_invariants().unwrap();
}
