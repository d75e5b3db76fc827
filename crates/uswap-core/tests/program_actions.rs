//! What programs do to their memory, done to region memory: madvise, munmap, mremap,
//! mprotect. Each must keep the kernel's meaning (never stale data, never silent zeros),
//! give back what it frees, and leave the region's bookkeeping consistent.

mod common;

use common::{check, fill};
use uswap_core::{Advice, Config, FaultMode, Region, PAGE_SIZE};

const MIB: u64 = 1 << 20;

fn region(size: u64, limit: u64, mode: FaultMode) -> Region {
    let mut cfg = Config::new(limit);
    cfg.fault_mode = mode;
    Region::new(size, cfg).unwrap()
}

/// Waits (up to 5 s) for `done`: the bookkeeping of a vma event follows the program's
/// system call, which returns as soon as uswap has read the event.
fn eventually(what: &str, done: impl Fn() -> bool) {
    let deadline = std::time::Instant::now() + std::time::Duration::from_secs(5);
    while !done() {
        assert!(
            std::time::Instant::now() < deadline,
            "never happened: {what}"
        );
        std::thread::sleep(std::time::Duration::from_millis(1));
    }
}

/// Slots freed between two snapshots, not counting slots reclaim took meanwhile for other
/// pages (kswapd keeps working while a test looks).
fn freed_slots(before: &uswap_core::Stats, after: &uswap_core::Stats) -> i64 {
    let written = after.vmstat.pswpout - before.vmstat.pswpout;
    before.swap_used_pages as i64 + written as i64 - after.swap_used_pages as i64
}

fn page_ptr(r: &Region, page: usize) -> *mut u8 {
    unsafe { r.as_ptr().add(page * PAGE_SIZE) }
}

fn is_zero(r: &Region, page: usize) -> bool {
    let p = page_ptr(r, page) as *const u64;
    (0..PAGE_SIZE / 8).all(|i| unsafe { p.add(i).read_volatile() } == 0)
}

/// Fills every page, then leaves pages 0..64 swapped out, 64..96 inactive (in memory,
/// unmapped) and the rest of the first 128 mapped.
fn mixed_states(r: &Region) {
    for p in 0..r.len() / PAGE_SIZE {
        unsafe { fill(r.as_ptr(), p, 1) };
    }
    for p in 64..128 {
        unsafe { check(r.as_ptr(), p, 1) }.unwrap();
    }
    r.advise(0, 64 * PAGE_SIZE, Advice::PageOut).unwrap();
    r.advise(64 * PAGE_SIZE, 32 * PAGE_SIZE, Advice::Cold)
        .unwrap();
}

fn dontneed_reads_zeros(mode: FaultMode, advice: libc::c_int) {
    let r = region(8 * MIB, 2 * MIB, mode);
    mixed_states(&r);
    let before = r.stats();
    let rc = unsafe { libc::madvise(r.as_ptr().cast(), 128 * PAGE_SIZE, advice) };
    assert_eq!(rc, 0, "{}", std::io::Error::last_os_error());
    // MADV_FREE leaves a mapped page to the kernel until it is written or reclaimed: it
    // reads as its old data or as zeros, never anything else. Pages that were not mapped
    // (swapped, inactive) always read as zeros.
    let lazy = if advice == libc::MADV_FREE {
        96..128
    } else {
        0..0
    };
    for p in 0..128 {
        let old = lazy.contains(&p) && unsafe { check(r.as_ptr(), p, 1) }.is_ok();
        assert!(
            is_zero(&r, p) || old,
            "page {p} reads neither zeros nor its old data"
        );
    }
    // A write after MADV_FREE keeps the page and its new data, through reclaim too.
    if !lazy.is_empty() {
        unsafe { fill(r.as_ptr(), lazy.start, 3) };
        r.advise(0, r.len(), Advice::PageOut).unwrap();
        unsafe { check(r.as_ptr(), lazy.start, 3) }.unwrap();
    }
    eventually("128 pages discarded", || {
        r.stats().vmstat.pgdiscard - before.vmstat.pgdiscard == 128
    });
    let after = r.stats();
    assert!(
        freed_slots(&before, &after) >= 64,
        "the discarded pages' slots are freed: {} -> {}",
        before.swap_used_pages,
        after.swap_used_pages
    );
    for p in 128..r.len() / PAGE_SIZE {
        unsafe { check(r.as_ptr(), p, 1) }.unwrap();
    }
    r.check_invariants().unwrap();
    // The discarded range is ordinary memory again: written, swapped and read back, with
    // the pages the kernel zapped behind uswap's back (MADV_DONTNEED of mapped pages) among
    // them.
    for p in 0..128 {
        unsafe { fill(r.as_ptr(), p, 2) };
    }
    r.advise(0, r.len(), Advice::PageOut).unwrap();
    for p in 0..128 {
        unsafe { check(r.as_ptr(), p, 2) }.unwrap();
    }
    r.check_invariants().unwrap();
}

#[test]
fn dontneed_over_swapped_inactive_and_mapped_pages_reads_zeros_thread_mode() {
    dontneed_reads_zeros(FaultMode::Thread, libc::MADV_DONTNEED);
}

#[test]
fn dontneed_over_swapped_inactive_and_mapped_pages_reads_zeros_sigbus_mode() {
    dontneed_reads_zeros(FaultMode::Sigbus, libc::MADV_DONTNEED);
}

#[test]
fn madv_free_frees_unmapped_pages_and_leaves_mapped_ones_to_the_kernel() {
    dontneed_reads_zeros(FaultMode::Thread, libc::MADV_FREE);
}

fn mremap_within(mode: FaultMode) {
    let r = region(8 * MIB, 2 * MIB, mode);
    mixed_states(&r);
    // Move pages 0..128 (swapped, inactive, mapped) onto pages 1024..1152 of the region.
    let to = page_ptr(&r, 1024);
    let got = unsafe {
        libc::mremap(
            r.as_ptr().cast(),
            128 * PAGE_SIZE,
            128 * PAGE_SIZE,
            libc::MREMAP_MAYMOVE | libc::MREMAP_FIXED,
            to,
        )
    };
    assert_eq!(got, to.cast(), "{}", std::io::Error::last_os_error());
    for i in 0..128 {
        let p = unsafe { to.add(i * PAGE_SIZE) } as *const u64;
        let first = unsafe { p.read_volatile() };
        assert_eq!(first, common::word(i, 1, 0), "moved page {i} lost its data");
    }
    eventually("128 pages remapped", || r.stats().vmstat.pgremap == 128);
    r.check_invariants().unwrap();
    // Pages not moved are untouched, and the moved ones keep swapping.
    r.advise(0, r.len(), Advice::PageOut).unwrap();
    for i in 0..128 {
        let p = unsafe { to.add(i * PAGE_SIZE) } as *const u64;
        assert_eq!(unsafe { p.read_volatile() }, common::word(i, 1, 0));
    }
    for p in (128..1024).chain(1152..r.len() / PAGE_SIZE) {
        unsafe { check(r.as_ptr(), p, 1) }.unwrap();
    }
    r.check_invariants().unwrap();
}

#[test]
fn mremap_within_the_region_moves_swapped_and_inactive_pages_with_their_data_thread_mode() {
    mremap_within(FaultMode::Thread);
}

#[test]
fn mremap_within_the_region_moves_swapped_and_inactive_pages_with_their_data_sigbus_mode() {
    mremap_within(FaultMode::Sigbus);
}

fn mremap_out(mode: FaultMode) {
    let r = region(8 * MIB, 2 * MIB, mode);
    mixed_states(&r);
    let before = r.stats();
    // Grow and move: the kernel picks a new address outside the region.
    let got = unsafe {
        libc::mremap(
            r.as_ptr().cast(),
            128 * PAGE_SIZE,
            256 * PAGE_SIZE,
            libc::MREMAP_MAYMOVE,
        )
    };
    assert_ne!(got, libc::MAP_FAILED, "{}", std::io::Error::last_os_error());
    let out = got as *mut u8;
    assert!(
        (out as usize) < r.as_ptr() as usize || out as usize >= r.as_ptr() as usize + r.len(),
        "the kernel moved it out of the region"
    );
    for i in 0..128 {
        let p = unsafe { out.add(i * PAGE_SIZE) } as *const u64;
        assert_eq!(
            unsafe { p.read_volatile() },
            common::word(i, 1, 0),
            "page {i}"
        );
    }
    for i in 128..256 {
        let p = unsafe { out.add(i * PAGE_SIZE) } as *const u64;
        assert_eq!(
            unsafe { p.read_volatile() },
            0,
            "grown page {i} reads as zero"
        );
        unsafe { (p as *mut u64).write_volatile(i as u64) };
    }
    eventually("moved-out pages free their slots", || {
        freed_slots(&before, &r.stats()) >= 64
    });
    r.check_invariants().unwrap();
    for p in 128..r.len() / PAGE_SIZE {
        unsafe { check(r.as_ptr(), p, 1) }.unwrap();
    }
    unsafe { libc::munmap(out.cast(), 256 * PAGE_SIZE) };
}

#[test]
fn mremap_out_of_the_region_keeps_every_page_thread_mode() {
    mremap_out(FaultMode::Thread);
}

#[test]
fn mremap_out_of_the_region_keeps_every_page_sigbus_mode() {
    mremap_out(FaultMode::Sigbus);
}

#[test]
fn mremap_shrink_then_grow_in_place_reads_zeros_in_the_regrown_part() {
    let r = region(4 * MIB, MIB, FaultMode::Thread);
    mixed_states(&r);
    let base = r.as_ptr();
    // Shrink pages 0..128 to 0..32: 32..128 are unmapped.
    let got = unsafe { libc::mremap(base.cast(), 128 * PAGE_SIZE, 32 * PAGE_SIZE, 0) };
    assert_eq!(got, base.cast(), "{}", std::io::Error::last_os_error());
    eventually("96 pages unmapped", || r.stats().vmstat.pgunmap == 96);
    r.check_invariants().unwrap();
    // Grow back in place over the hole.
    let got = unsafe { libc::mremap(base.cast(), 32 * PAGE_SIZE, 128 * PAGE_SIZE, 0) };
    assert_eq!(got, base.cast(), "{}", std::io::Error::last_os_error());
    for p in 0..32 {
        unsafe { check(base, p, 1) }.unwrap();
    }
    for p in 32..128 {
        assert!(is_zero(&r, p), "regrown page {p} must read as zero");
        unsafe { fill(base, p, 3) };
    }
    r.advise(0, r.len(), Advice::PageOut).unwrap();
    for p in 32..128 {
        unsafe { check(base, p, 3) }.unwrap();
    }
    r.check_invariants().unwrap();
}

#[test]
fn munmap_gives_back_and_drop_leaves_a_later_mapping_alone() {
    let r = region(4 * MIB, MIB, FaultMode::Thread);
    mixed_states(&r);
    let before = r.stats();
    let hole = page_ptr(&r, 0);
    assert_eq!(unsafe { libc::munmap(hole.cast(), 128 * PAGE_SIZE) }, 0);
    eventually("128 pages unmapped", || r.stats().vmstat.pgunmap == 128);
    assert!(freed_slots(&before, &r.stats()) >= 64);
    r.check_invariants().unwrap();
    // Someone else maps the hole.
    let other = unsafe {
        libc::mmap(
            hole.cast(),
            128 * PAGE_SIZE,
            libc::PROT_READ | libc::PROT_WRITE,
            libc::MAP_PRIVATE | libc::MAP_ANONYMOUS | libc::MAP_FIXED_NOREPLACE,
            -1,
            0,
        )
    };
    assert_eq!(other, hole.cast(), "{}", std::io::Error::last_os_error());
    unsafe { (other as *mut u64).write_volatile(0xfeed) };
    for p in 128..r.len() / PAGE_SIZE {
        unsafe { check(r.as_ptr(), p, 1) }.unwrap();
    }
    drop(r);
    assert_eq!(
        unsafe { (other as *const u64).read_volatile() },
        0xfeed,
        "dropping the region must not unmap what was mapped in its hole"
    );
    unsafe { libc::munmap(other, 128 * PAGE_SIZE) };
}

fn mprotected(mode: FaultMode) {
    let r = region(8 * MIB, 2 * MIB, mode);
    let pages = r.len() / PAGE_SIZE;
    for p in 0..pages {
        unsafe { fill(r.as_ptr(), p, 1) };
    }
    // Pages 0..64 are read-only now: reclaim cannot move them, but may not stop either.
    let rc = unsafe { libc::mprotect(r.as_ptr().cast(), 64 * PAGE_SIZE, libc::PROT_READ) };
    assert_eq!(rc, 0);
    for round in 0..3 {
        for p in 0..pages {
            unsafe { check(r.as_ptr(), p, 1) }.unwrap_or_else(|e| panic!("round {round}: {e}"));
        }
    }
    let s = r.stats().vmstat;
    assert!(s.pswpout > 0 && s.pswpin > 0, "reclaim went on: {s:?}");
    assert!(
        s.pgskip_unmovable > 0,
        "the read-only pages were skipped: {s:?}"
    );
    r.check_invariants().unwrap();
    assert_eq!(s.failed_faults, 0);
}

#[test]
fn mprotected_pages_are_skipped_and_reclaim_goes_on_thread_mode() {
    mprotected(FaultMode::Thread);
}

#[test]
fn mprotected_pages_are_skipped_and_reclaim_goes_on_sigbus_mode() {
    mprotected(FaultMode::Sigbus);
}

/// Two threads, each filling its half of one region and `MADV_DONTNEED`ing it over and over
/// (an allocator freeing memory from several threads): every page reads its data back
/// before the discard and zeros after it, and nothing hangs (a discard handler that took
/// pages out behind the kernel's own zap could livelock with it in UFFDIO_MOVE).
fn concurrent_discards(mode: FaultMode, limit: u64) {
    const HALF: usize = 16 * MIB as usize / PAGE_SIZE;
    let r = std::sync::Arc::new(region(32 * MIB, limit, mode));
    let (done_tx, done_rx) = std::sync::mpsc::channel();
    for t in 0..2 {
        let (r, done_tx) = (r.clone(), done_tx.clone());
        std::thread::spawn(move || {
            let base = r.as_ptr();
            let deadline = std::time::Instant::now() + std::time::Duration::from_millis(1500);
            let pages = t * HALF..(t + 1) * HALF;
            let mut round = 1u32;
            let result = loop {
                if std::time::Instant::now() > deadline {
                    break Ok(round);
                }
                for p in pages.clone() {
                    unsafe { fill(base, p, round) };
                }
                if let Some(bad) = pages
                    .clone()
                    .find(|&p| unsafe { check(base, p, round) }.is_err())
                {
                    break Err(format!("page {bad} lost its data before the discard"));
                }
                let start = unsafe { base.add(pages.start * PAGE_SIZE) };
                assert_eq!(
                    unsafe { libc::madvise(start.cast(), HALF * PAGE_SIZE, libc::MADV_DONTNEED) },
                    0
                );
                if let Some(bad) = pages.clone().step_by(7).find(|&p| !is_zero(&r, p)) {
                    break Err(format!("page {bad} kept data after MADV_DONTNEED"));
                }
                round += 1;
            };
            let _ = done_tx.send(result);
        });
    }
    for _ in 0..2 {
        let result = done_rx
            .recv_timeout(std::time::Duration::from_secs(60))
            .expect("a thread doing madvise(MADV_DONTNEED) hung");
        let rounds = result.unwrap();
        assert!(rounds > 1, "no round completed");
    }
    r.check_invariants().unwrap();
}

#[test]
fn concurrent_discards_from_two_threads_never_hang_thread_mode() {
    concurrent_discards(FaultMode::Thread, 48 * MIB);
}

#[test]
fn concurrent_discards_from_two_threads_never_hang_sigbus_mode() {
    concurrent_discards(FaultMode::Sigbus, 48 * MIB);
}

#[test]
fn concurrent_discards_under_reclaim_never_hang() {
    concurrent_discards(FaultMode::Thread, 12 * MIB);
}

/// A clean page (swapped in, write-protected, slot kept) that the program `MADV_FREE`s and
/// then writes: the write must go through, once. The discard's write-protection clear can
/// meet the kernel's own fence (EAGAIN); the write fault must then clear it (found in
/// review: it looped forever).
fn madv_free_then_write_a_clean_page(mode: FaultMode) {
    const PAGES: usize = 256;
    let r = std::sync::Arc::new(region(8 * MIB, 4 * MIB, mode));
    for p in 0..PAGES {
        unsafe { fill(r.as_ptr(), p, 1) };
    }
    r.advise(0, PAGES * PAGE_SIZE, Advice::PageOut).unwrap();
    for p in 0..PAGES {
        unsafe { check(r.as_ptr(), p, 1) }.unwrap();
    }
    for p in 0..PAGES {
        let rc = unsafe { libc::madvise(page_ptr(&r, p).cast(), PAGE_SIZE, libc::MADV_FREE) };
        assert_eq!(rc, 0);
        let (tx, rx) = std::sync::mpsc::channel();
        let writer = r.clone();
        std::thread::spawn(move || {
            unsafe { fill(writer.as_ptr(), p, 2) };
            let _ = tx.send(());
        });
        rx.recv_timeout(std::time::Duration::from_secs(10))
            .unwrap_or_else(|_| panic!("a write to page {p} after MADV_FREE hung"));
        unsafe { check(r.as_ptr(), p, 2) }.unwrap();
    }
    r.check_invariants().unwrap();
}

#[test]
fn a_write_after_madv_free_of_a_clean_page_goes_through_thread_mode() {
    madv_free_then_write_a_clean_page(FaultMode::Thread);
}

#[test]
fn a_write_after_madv_free_of_a_clean_page_goes_through_sigbus_mode() {
    madv_free_then_write_a_clean_page(FaultMode::Sigbus);
}

/// One thread `MADV_DONTNEED`s a few pages over and over while another writes them: the
/// kernel allows zeros or the data, never a failure. The kernel's zap runs after uswap has
/// handled the event and can take a page zero-filled since (found in review: it was then
/// "unexplained" and poisoned).
#[test]
fn writes_racing_dontneed_never_fail() {
    const PAGES: usize = 4;
    let r = std::sync::Arc::new(region(8 * MIB, 4 * MIB, FaultMode::Thread));
    let stop = std::sync::Arc::new(std::sync::atomic::AtomicBool::new(false));
    let writer = {
        let (r, stop) = (r.clone(), stop.clone());
        std::thread::spawn(move || {
            let mut v = 1u8;
            while !stop.load(std::sync::atomic::Ordering::Relaxed) {
                for p in 0..PAGES {
                    unsafe { page_ptr(&r, p).write_volatile(v) };
                }
                v = v.wrapping_add(1);
            }
        })
    };
    let deadline = std::time::Instant::now() + std::time::Duration::from_secs(3);
    while std::time::Instant::now() < deadline {
        let rc =
            unsafe { libc::madvise(r.as_ptr().cast(), PAGES * PAGE_SIZE, libc::MADV_DONTNEED) };
        assert_eq!(rc, 0);
    }
    stop.store(true, std::sync::atomic::Ordering::Relaxed);
    writer.join().unwrap();
    let v = r.stats().vmstat;
    assert_eq!((v.unexplained_faults, v.failed_faults), (0, 0));
    r.check_invariants().unwrap();
}

/// The window `writes_racing_dontneed_never_fail` hits by chance, made certain: a page
/// still untouched when the program discards it may be touched before the kernel's zap
/// runs, so its first touch must fill it alone (a fault-around fill would map neighbours
/// the zap then takes, and their next fault would be "unexplained").
#[test]
fn the_first_touch_after_a_discard_of_untouched_pages_fills_one_page() {
    let r = region(8 * MIB, 4 * MIB, FaultMode::Thread);
    let rc = unsafe { libc::madvise(r.as_ptr().cast(), 64 * PAGE_SIZE, libc::MADV_DONTNEED) };
    assert_eq!(rc, 0);
    eventually("64 pages discarded", || r.stats().vmstat.pgdiscard == 64);
    let before = r.stats().vmstat.pgzerofill;
    unsafe { page_ptr(&r, 0).write_volatile(7) };
    assert_eq!(r.stats().vmstat.pgzerofill - before, 1);
    // Past the discarded range, fault-around maps the whole window again.
    unsafe { page_ptr(&r, 64).write_volatile(7) };
    assert!(r.stats().vmstat.pgzerofill - before > 2);
    r.check_invariants().unwrap();
}

/// A fault a handler backs out of because another handler holds the fence for an event is
/// queued to be woken after the next read; the thread must be woken even when no other
/// message comes (found in review: it could sleep until one did).
#[test]
fn a_fault_backed_out_by_the_fence_is_woken() {
    const PAGES: usize = 2048;
    const DISCARDED: std::ops::Range<usize> = 4096..12288;
    let mut cfg = Config::new(16 * MIB);
    cfg.handler_threads = 2;
    let r = std::sync::Arc::new(Region::new(64 * MIB, cfg).unwrap());
    for p in (0..PAGES).chain(DISCARDED) {
        unsafe { fill(r.as_ptr(), p, 1) };
    }
    r.advise(0, r.len(), Advice::PageOut).unwrap();
    let progress = std::sync::Arc::new(std::sync::atomic::AtomicUsize::new(0));
    let reader = {
        let (r, progress) = (r.clone(), progress.clone());
        std::thread::spawn(move || {
            for _ in 0..10 {
                for p in 0..PAGES {
                    unsafe { check(r.as_ptr(), p, 1) }.unwrap();
                    progress.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
                }
                r.advise(0, PAGES * PAGE_SIZE, Advice::PageOut).unwrap();
            }
        })
    };
    let len = DISCARDED.len() * PAGE_SIZE;
    while !reader.is_finished() {
        let rc = unsafe {
            libc::madvise(
                page_ptr(&r, DISCARDED.start).cast(),
                len,
                libc::MADV_DONTNEED,
            )
        };
        assert_eq!(rc, 0);
        let before = progress.load(std::sync::atomic::Ordering::Relaxed);
        let since = std::time::Instant::now();
        while progress.load(std::sync::atomic::Ordering::Relaxed) == before && !reader.is_finished()
        {
            assert!(
                since.elapsed() < std::time::Duration::from_secs(3),
                "no progress for 3 s after {before} pages: a backed-out fault was never woken"
            );
            std::thread::sleep(std::time::Duration::from_millis(1));
        }
    }
    reader.join().unwrap();
}
