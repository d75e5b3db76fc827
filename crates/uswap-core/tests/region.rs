//! End-to-end behaviour of a region: data integrity under threads, kernel accesses,
//! advice, and clear errors for bad input.

mod common;

use common::{check, check_slice, fill};
use std::sync::atomic::{AtomicU64, Ordering::Relaxed};
use uswap_core::{Advice, Config, FaultMode, ReadaheadPolicy, Region, SwapLocation, PAGE_SIZE};

const MIB: u64 = 1 << 20;

fn xorshift(s: &mut u64) -> u64 {
    *s ^= *s << 13;
    *s ^= *s >> 7;
    *s ^= *s << 17;
    *s
}

/// Threads own interleaved pages (page % threads) and randomly read (verify the whole
/// page) or write (bump its version) them; the region is 4x the memory limit.
fn random_threads(mode: FaultMode) {
    const THREADS: usize = 4;
    let mut cfg = Config::new(4 * MIB);
    cfg.fault_mode = mode;
    let region = Region::new(16 * MIB, cfg).unwrap();
    let pages = region.len() / PAGE_SIZE;
    let base = region.as_ptr() as usize;
    let errors = AtomicU64::new(0);
    let versions: Vec<Vec<u32>> = std::thread::scope(|s| {
        let handles: Vec<_> = (0..THREADS)
            .map(|t| {
                let errors = &errors;
                s.spawn(move || {
                    let base = base as *mut u8;
                    let mine: Vec<usize> = (t..pages).step_by(THREADS).collect();
                    let mut version = vec![0u32; mine.len()];
                    for &p in &mine {
                        unsafe { fill(base, p, 0) };
                    }
                    let mut seed = 0x9E37_79B9_7F4A_7C15u64 ^ (t as u64 + 1);
                    for _ in 0..6000 {
                        let k = xorshift(&mut seed) as usize % mine.len();
                        if xorshift(&mut seed).is_multiple_of(5) {
                            version[k] += 1;
                            unsafe { fill(base, mine[k], version[k]) };
                        } else if let Err(e) = unsafe { check(base, mine[k], version[k]) } {
                            eprintln!("{e}");
                            errors.fetch_add(1, Relaxed);
                        }
                    }
                    version
                })
            })
            .collect();
        handles.into_iter().map(|h| h.join().unwrap()).collect()
    });
    assert_eq!(
        errors.load(Relaxed),
        0,
        "pages read back wrong during the run"
    );
    for (t, version) in versions.iter().enumerate() {
        for (k, p) in (t..pages).step_by(THREADS).enumerate() {
            unsafe { check(region.as_ptr(), p, version[k]) }.unwrap();
        }
    }
    let s = region.stats();
    assert!(
        s.vmstat.pswpout > 0 && s.vmstat.pswpin > 0,
        "the run must really swap: {:?}",
        s.vmstat
    );
    assert!(
        s.resident_pages <= 1024,
        "resident {} pages over the 1024-page limit",
        s.resident_pages
    );
    assert_eq!(
        s.vmstat.verify_errors + s.vmstat.io_errors + s.vmstat.failed_faults,
        0
    );
    region.check_invariants().unwrap();
}

#[test]
fn threads_random_read_write_4x_limit_thread_mode() {
    random_threads(FaultMode::Thread);
}

#[test]
fn threads_random_read_write_4x_limit_sigbus_mode() {
    random_threads(FaultMode::Sigbus);
}

fn pipe() -> (i32, i32) {
    let mut fds = [0; 2];
    assert_eq!(unsafe { libc::pipe(fds.as_mut_ptr()) }, 0);
    (fds[0], fds[1])
}

#[test]
fn kernel_accesses_to_swapped_out_pages_are_served_in_thread_mode() {
    let region = Region::new(2 * MIB, Config::new(MIB)).unwrap();
    let pages = region.len() / PAGE_SIZE;
    for p in 0..pages {
        unsafe { fill(region.as_ptr(), p, 1) };
    }
    region.advise(0, region.len(), Advice::PageOut).unwrap();
    assert!(region.stats().vmstat.pswpout > 0);
    let (r, w) = pipe();
    // write(2) reads the swapped-out page from inside the kernel.
    let n = unsafe { libc::write(w, region.as_ptr().add(5 * PAGE_SIZE).cast(), PAGE_SIZE) };
    assert_eq!(n, PAGE_SIZE as isize, "{}", std::io::Error::last_os_error());
    let mut buf = vec![0u8; PAGE_SIZE];
    assert_eq!(
        unsafe { libc::read(r, buf.as_mut_ptr().cast(), PAGE_SIZE) },
        PAGE_SIZE as isize
    );
    assert!(
        check_slice(&buf, 5, 1),
        "write(2) from a swapped-out page saw wrong data"
    );
    // read(2) stores into a swapped-out page from inside the kernel.
    let page9: Vec<u8> = (0..common::WORDS)
        .flat_map(|i| common::word(9, 2, i).to_ne_bytes())
        .collect();
    assert_eq!(
        unsafe { libc::write(w, page9.as_ptr().cast(), PAGE_SIZE) },
        PAGE_SIZE as isize
    );
    let n = unsafe { libc::read(r, region.as_ptr().add(9 * PAGE_SIZE).cast(), PAGE_SIZE) };
    assert_eq!(n, PAGE_SIZE as isize, "{}", std::io::Error::last_os_error());
    region.advise(0, region.len(), Advice::PageOut).unwrap();
    for p in 0..pages {
        unsafe { check(region.as_ptr(), p, if p == 9 { 2 } else { 1 }) }.unwrap();
    }
    unsafe { libc::close(r) };
    unsafe { libc::close(w) };
}

#[test]
fn clean_pages_are_dropped_without_io_and_writes_dirty_them() {
    // The limit is above the region size, so only the advice reclaims.
    let region = Region::new(MIB, Config::new(2 * MIB)).unwrap();
    let pages = region.len() / PAGE_SIZE;
    for p in 0..pages {
        unsafe { fill(region.as_ptr(), p, 0) };
    }
    region.advise(0, region.len(), Advice::PageOut).unwrap();
    let out1 = region.stats().vmstat.pswpout;
    assert_eq!(out1, pages as u64, "every dirty page is written once");
    assert_eq!(region.stats().swap_used_pages, pages as u64);
    assert_eq!(region.swap_device().used_pages(), pages as u64);
    for p in 0..pages {
        unsafe { check(region.as_ptr(), p, 0) }.unwrap();
    }
    unsafe { fill(region.as_ptr(), 3, 7) };
    assert_eq!(
        region.stats().swap_used_pages,
        pages as u64 - 1,
        "the written page lost its slot"
    );
    region.advise(0, region.len(), Advice::PageOut).unwrap();
    let s = region.stats().vmstat;
    assert_eq!(
        s.pswpout - out1,
        1,
        "only the page written after swap-in goes out again"
    );
    assert_eq!(s.pgclean_dropped, pages as u64 - 1);
    unsafe { check(region.as_ptr(), 3, 7) }.unwrap();
}

/// A write that faults on a swapped-out or inactive page maps it dirty at once (slot
/// freed, writable): one fault per page, not a fault to map it and another to write it.
#[test]
fn a_write_to_a_swapped_or_inactive_page_maps_it_dirty_with_one_fault() {
    let mut cfg = Config::new(2 * MIB);
    cfg.readahead.policy = ReadaheadPolicy::None;
    let region = Region::new(MIB, cfg).unwrap();
    let pages = region.len() / PAGE_SIZE;
    for p in 0..pages {
        unsafe { fill(region.as_ptr(), p, 0) };
    }
    // Every page clean (swapped out and read back, keeping its slot), then the first
    // half swapped out again and the second half inactive.
    region.advise(0, region.len(), Advice::PageOut).unwrap();
    for p in 0..pages {
        unsafe { check(region.as_ptr(), p, 0) }.unwrap();
    }
    region.advise(0, region.len() / 2, Advice::PageOut).unwrap();
    region
        .advise(region.len() / 2, region.len() / 2, Advice::Cold)
        .unwrap();
    assert_eq!(region.stats().swap_used_pages, pages as u64);
    let before = region.stats().vmstat;
    for p in 0..pages {
        unsafe { fill(region.as_ptr(), p, 1) };
    }
    let d = region.stats().vmstat.since(&before);
    assert_eq!(d.pgfault, pages as u64, "one fault per page written: {d:?}");
    assert_eq!(
        region.stats().swap_used_pages,
        0,
        "every written page freed its slot"
    );
    for p in 0..pages {
        unsafe { check(region.as_ptr(), p, 1) }.unwrap();
    }
    let out = region.stats().vmstat.pswpout;
    region.advise(0, region.len(), Advice::PageOut).unwrap();
    assert_eq!(
        region.stats().vmstat.pswpout - out,
        pages as u64,
        "all dirty"
    );
    region.check_invariants().unwrap();
}

#[test]
fn inactive_pages_come_back_without_io_and_are_promoted() {
    let region = Region::new(MIB, Config::new(2 * MIB)).unwrap();
    for p in 0..64 {
        unsafe { fill(region.as_ptr(), p, 4) };
    }
    region.advise(0, 64 * PAGE_SIZE, Advice::Cold).unwrap();
    let before = region.stats().vmstat;
    assert_eq!(before.pgdeactivate, 64);
    for p in 0..64 {
        unsafe { check(region.as_ptr(), p, 4) }.unwrap();
    }
    let d = region.stats().vmstat.since(&before);
    assert_eq!((d.pgactivate, d.pswpin, d.pswpout), (64, 0, 0), "{d:?}");
}

#[test]
fn untouched_and_zero_pages_read_as_zero_and_cost_no_swap() {
    let region = Region::new(4 * MIB, Config::new(MIB)).unwrap();
    let words = region.len() / 8;
    let base = region.as_ptr() as *const u64;
    assert!((0..words)
        .step_by(97)
        .all(|i| unsafe { base.add(i).read_volatile() } == 0));
    region.advise(0, region.len(), Advice::PageOut).unwrap();
    let s = region.stats().vmstat;
    assert_eq!(s.pswpout, 0);
    assert!(s.pgzero_dropped > 0);
}

#[test]
fn bad_inputs_give_clear_errors() {
    let err = |size: u64, cfg: Config| Region::new(size, cfg).err().expect("must fail").to_string();
    assert!(err(0, Config::new(MIB)).contains("region size"));
    assert!(err(1 << 62, Config::new(MIB)).contains("region size"));
    assert!(err(MIB, Config::new(0)).contains("memory limit"));
    let mut cfg = Config::new(MIB);
    cfg.swap.location = SwapLocation::TempIn("/nonexistent/uswap-test".into());
    let e = err(MIB, cfg);
    assert!(
        e.contains("/nonexistent/uswap-test") && e.contains("swap"),
        "{e}"
    );
    let mut cfg = Config::new(MIB);
    cfg.swap.size = Some(MIB);
    let e = err(4 * MIB, cfg);
    assert!(e.contains("does not fit") && e.contains("swap"), "{e}");
    let r = Region::new(MIB, Config::new(MIB)).unwrap();
    assert!(r
        .advise(r.len() - 8, 16, Advice::Cold)
        .unwrap_err()
        .to_string()
        .contains("outside"));
}

#[test]
fn a_full_shared_swap_device_refuses_new_regions_and_loses_nothing() {
    let mut cfg = Config::new(MIB);
    cfg.swap.size = Some(4 * MIB);
    let swap = uswap_core::swapfile::SwapDevice::open(&cfg.swap).unwrap();
    // A holds the whole device: 1 MiB of memory plus 4 MiB of swap.
    let a = Region::with_swap(5 * MIB, cfg.clone(), swap.clone()).unwrap();
    let pages = a.len() / PAGE_SIZE;
    for p in 0..pages {
        unsafe { fill(a.as_ptr(), p, 1) };
    }
    assert!(swap.used_pages() > 0);
    let e = Region::with_swap(2 * MIB, cfg.clone(), swap.clone())
        .err()
        .expect("no swap left for B");
    let msg = e.to_string();
    assert!(
        msg.contains("swap device is full") && msg.contains("256 pages"),
        "{msg}"
    );
    // A region that fits in its memory limit needs no swap and is still allowed.
    let c = Region::with_swap(MIB, cfg.clone(), swap.clone()).unwrap();
    unsafe { fill(c.as_ptr(), 0, 9) };
    for p in 0..pages {
        unsafe { check(a.as_ptr(), p, 1) }.unwrap();
    }
    unsafe { check(c.as_ptr(), 0, 9) }.unwrap();
    assert_eq!(a.stats().vmstat.failed_faults, 0);
    drop(a);
    // Its promise is given back with it.
    Region::with_swap(2 * MIB, cfg, swap).unwrap();
}

#[test]
fn sigbus_mode_is_refused_on_a_thread_that_blocks_sigbus() {
    let err = std::thread::spawn(|| {
        unsafe {
            let mut set: libc::sigset_t = std::mem::zeroed();
            libc::sigemptyset(&mut set);
            libc::sigaddset(&mut set, libc::SIGBUS);
            libc::pthread_sigmask(libc::SIG_BLOCK, &set, std::ptr::null_mut());
        }
        let mut cfg = Config::new(MIB);
        cfg.fault_mode = FaultMode::Sigbus;
        Region::new(MIB, cfg).err().map(|e| e.to_string())
    })
    .join()
    .unwrap()
    .expect("refused");
    assert!(
        err.contains("SIGBUS is blocked") && err.contains("thread mode"),
        "{err}"
    );
}

/// Which pages of the region are mapped now (mincore): aging and eviction unmap them.
fn resident(region: &Region, pages: usize) -> Vec<bool> {
    let mut vec = vec![0u8; pages];
    // SAFETY: the region's mapping covers `pages` pages; mincore writes one byte per page.
    let rc = unsafe { libc::mincore(region.as_ptr().cast(), pages * PAGE_SIZE, vec.as_mut_ptr()) };
    assert_eq!(rc, 0, "mincore: {}", std::io::Error::last_os_error());
    vec.iter().map(|b| b & 1 != 0).collect()
}

/// Aging looks around: the active neighbours of a page it takes from the active tail go to
/// the inactive list with it (one UFFDIO_MOVE), so the pages pushed out of memory come in
/// runs even when they were touched in random order; with a block of one page they are
/// scattered. 384 pages are touched in random order (all fit), then 256 more in order
/// push about half of the first ones out; measured as the share of those out of memory
/// whose both neighbours are out too.
#[test]
fn aging_takes_a_pages_active_neighbours_with_it() {
    let (random, pages) = (384, 640);
    let clustering = |block: usize| {
        let mut cfg = Config::new(2 * MIB);
        cfg.fault_around = 1;
        cfg.aging_block = block;
        let region = Region::new((pages * PAGE_SIZE) as u64, cfg).unwrap();
        let mut order: Vec<usize> = (0..random).collect();
        let mut seed = 0x5eed_u64;
        for i in (1..random).rev() {
            order.swap(i, xorshift(&mut seed) as usize % (i + 1));
        }
        for p in order.into_iter().chain(random..pages) {
            unsafe { fill(region.as_ptr(), p, 1) };
        }
        region.check_invariants().unwrap();
        let out: Vec<bool> = resident(&region, random).iter().map(|r| !r).collect();
        let gone = out.iter().filter(|&&g| g).count();
        let inside = (1..random - 1)
            .filter(|&i| out[i - 1] && out[i] && out[i + 1])
            .count();
        for p in 0..pages {
            unsafe { check(region.as_ptr(), p, 1) }.unwrap();
        }
        assert!(
            gone >= random / 4,
            "reclaim ran: {gone} of {random} pages out"
        );
        inside as f64 / gone as f64
    };
    let (alone, around) = (clustering(1), clustering(32));
    assert!(
        around > 2.0 * alone && around > 0.5,
        "pages out of memory with both neighbours out: {alone:.2} page by page, {around:.2} \
         with look-around"
    );
}

/// A bug in the background reclaimer (an injected panic at a wake-up) does not stop it: it
/// starts again, said on stderr and counted, and reclaim goes on waking it. Before, the
/// thread ended and every later shortage fell to direct reclaim.
#[test]
fn a_panicking_kswapd_starts_again() {
    for mode in [FaultMode::Thread, FaultMode::Sigbus] {
        let mut cfg = Config::new(2 * MIB);
        cfg.fault_mode = mode;
        let region = Region::new(8 * MIB, cfg).unwrap();
        region.inject_kswapd_panic();
        let pages = region.len() / PAGE_SIZE;
        for version in 1..=3 {
            for p in 0..pages {
                if version > 1 {
                    unsafe { check(region.as_ptr(), p, version - 1) }.unwrap();
                }
                unsafe { fill(region.as_ptr(), p, version) };
            }
        }
        let v = region.stats().vmstat;
        assert_eq!(v.handler_panics, 1, "{mode:?}: {v:?}");
        assert!(
            v.kswapd_wake >= 2,
            "woken again after the panic: {mode:?}: {v:?}"
        );
        assert_eq!(v.failed_faults, 0, "{mode:?}: {v:?}");
        region.check_invariants().unwrap();
    }
}

/// A region built on memory the program already wrote (`Region::adopt`, as `uswap run`
/// builds a program's region when it outgrows its start-up allowance): written pages
/// become resident and charged, a page only read (the kernel's zero page) is shared and
/// write-protected, a lent run is not the region's; every page reads back after all of
/// them were paged out, and the walker agrees throughout.
#[test]
fn a_region_adopts_the_pages_written_before_it_was_built() {
    const PAGES: usize = 64;
    let map = uswap_core::Mapping::new(PAGES * PAGE_SIZE).unwrap();
    let base = map.addr() as *mut u8;
    for p in 0..40 {
        unsafe { fill(base, p, 7) };
    }
    // SAFETY: reading a page of the mapping never written: the zero page.
    let zero = unsafe { std::ptr::read_volatile(base.add(50 * PAGE_SIZE)) };
    assert_eq!(zero, 0);
    let cfg = Config::new(MIB);
    let (lent, written) = (60..PAGES, 0..60);
    let one = std::slice::from_ref;
    let region = Region::adopt(map, cfg, one(&lent), one(&written)).unwrap();
    assert_eq!(
        region.resident_pages(),
        40,
        "the written pages are resident"
    );
    let stats = region.stats();
    assert_eq!(stats.shared_pages, 1, "the zero page is shared");
    region.check_invariants().unwrap();
    region.advise(0, 60 * PAGE_SIZE, Advice::PageOut).unwrap();
    assert!(
        region.resident_pages() < 40,
        "adopted pages can be paged out"
    );
    for p in 0..40 {
        unsafe { check(base, p, 7) }.unwrap();
    }
    // SAFETY: as above; now written, it is this region's own.
    unsafe { std::ptr::write_volatile(base.add(50 * PAGE_SIZE), 1) };
    assert_eq!(region.stats().shared_pages, 0);
    region.check_invariants().unwrap();
    let bad = uswap_core::Mapping::new(PAGES * PAGE_SIZE).unwrap();
    let err = Region::adopt(bad, Config::new(MIB), &[], one(&(0..PAGES + 1)));
    assert!(err.is_err(), "runs past the end are refused");
}
