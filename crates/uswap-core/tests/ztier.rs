//! A region with the compressed tier on: every page comes back as written, in both fault
//! modes, while resident pages and the pool together stay under the memory limit.

use std::sync::atomic::{AtomicBool, AtomicU64, Ordering::Relaxed};
use uswap_core::{Compressor, Config, FaultMode, Region, Ztier, ZtierSize, PAGE_SIZE};

const MIB: u64 = 1 << 20;
const WORDS: usize = PAGE_SIZE / 8;

/// Word `i` of page `page` at `version`: a header, a third random, the rest one word
/// (about 3:1 with LZ4); every fourth page repeats one word (same-filled) until written.
fn word(page: usize, version: u32, i: usize) -> u64 {
    if version == 0 && page.is_multiple_of(4) {
        return 0x0101_0101_0101_0101 * (page as u64 & 0xff);
    }
    match i {
        0 => ((page as u64) << 32) | u64::from(version),
        i if i < WORDS / 3 => {
            let mut x = ((page as u64) << 24) ^ (u64::from(version) << 12) ^ i as u64;
            x = (x ^ (x >> 30)).wrapping_mul(0xbf58_476d_1ce4_e5b9);
            x = (x ^ (x >> 27)).wrapping_mul(0x94d0_49bb_1331_11eb);
            x ^ (x >> 31)
        }
        _ => 0x5bd1_e995 ^ page as u64,
    }
}

unsafe fn fill(base: *mut u64, page: usize, version: u32) {
    for i in 0..WORDS {
        base.add(page * WORDS + i)
            .write_volatile(word(page, version, i));
    }
}

unsafe fn check(base: *const u64, page: usize, version: u32) -> Result<(), String> {
    for i in 0..WORDS {
        let got = base.add(page * WORDS + i).read_volatile();
        if got != word(page, version, i) {
            return Err(format!("page {page} v{version} word {i}: got {got:#x}"));
        }
    }
    Ok(())
}

/// Two threads write and check a region four times the limit, a third samples what the
/// region holds in memory: its resident pages and its pool.
fn under_the_limit(mode: FaultMode, size: ZtierSize) {
    let limit = 32 * MIB;
    let mut cfg = Config::new(limit);
    cfg.fault_mode = mode;
    cfg.swap.ztier = Ztier {
        enabled: true,
        size,
        compressor: Compressor::Lz4,
    };
    let region = Region::new(4 * limit, cfg).unwrap();
    let pages = region.len() / PAGE_SIZE;
    let base = region.as_ptr() as usize;
    let done = AtomicBool::new(false);
    let peak = AtomicU64::new(0);
    std::thread::scope(|s| {
        s.spawn(|| {
            while !done.load(Relaxed) {
                let st = region.stats();
                let held = st.resident_pages * PAGE_SIZE as u64 + st.ztier.pool_bytes;
                peak.fetch_max(held, Relaxed);
                std::thread::sleep(std::time::Duration::from_millis(2));
            }
        });
        let workers: Vec<_> = (0..2)
            .map(|t| {
                s.spawn(move || {
                    let base = base as *mut u64;
                    let mine: Vec<usize> = (t..pages).step_by(2).collect();
                    let mut version = vec![0u32; mine.len()];
                    for &p in &mine {
                        unsafe { fill(base, p, 0) };
                    }
                    let mut seed = 0x2545_f491_4f6c_dd1du64 + t as u64;
                    for _ in 0..20_000 {
                        seed ^= seed << 13;
                        seed ^= seed >> 7;
                        seed ^= seed << 17;
                        let k = seed as usize % mine.len();
                        if seed.is_multiple_of(5) {
                            version[k] += 1;
                            unsafe { fill(base, mine[k], version[k]) };
                        } else {
                            unsafe { check(base, mine[k], version[k]) }.unwrap();
                        }
                    }
                    for (k, &p) in mine.iter().enumerate() {
                        unsafe { check(base, p, version[k]) }.unwrap();
                    }
                })
            })
            .collect();
        for w in workers {
            w.join().unwrap();
        }
        done.store(true, Relaxed);
    });
    let st = region.stats();
    let z = &st.ztier;
    assert!(z.stores > 0 && z.loads > 0, "{z:?}");
    assert!(
        z.same_filled_pages > 0 || z.stores > z.stored_pages,
        "{z:?}"
    );
    assert!(
        z.written_back + z.dropped_clean > 0,
        "a pool of at most 90% of a limit a quarter of the data overflows: {z:?}"
    );
    if let ZtierSize::Percent(p) = size {
        assert_eq!(z.limit_bytes, limit / 100 * u64::from(p), "{z:?}");
    }
    assert!(
        z.compression_ratio > 2.0,
        "about 3:1 data keeps over 2 page bytes per pool byte: {z:?}"
    );
    assert_eq!(st.vmstat.verify_errors, 0);
    // Reclaim charges the pool's growth at the end of each batch, so the sampled sum may
    // run ahead of the limit by what one batch adds; 1 MiB of 32 bounds that.
    let peak = peak.load(Relaxed);
    assert!(
        peak <= limit + MIB,
        "resident pages and pool peaked at {} MiB under a {} MiB limit",
        peak >> 20,
        limit >> 20
    );
    region.check_invariants().unwrap();
}

#[test]
fn a_region_with_the_tier_keeps_its_pages_and_its_pool_under_the_limit_thread_mode() {
    under_the_limit(FaultMode::Thread, ZtierSize::Percent(25));
}

#[test]
fn a_region_with_an_auto_sized_pool_keeps_its_pages_and_its_pool_under_the_limit() {
    under_the_limit(FaultMode::Auto, ZtierSize::Auto);
}

#[test]
fn a_region_with_the_tier_keeps_its_pages_and_its_pool_under_the_limit_sigbus_mode() {
    if FaultMode::Auto.resolve() != FaultMode::Sigbus {
        eprintln!("SKIPPED: this kernel has no syscall user dispatch (SIGBUS mode)");
        return;
    }
    under_the_limit(FaultMode::Sigbus, ZtierSize::Percent(25));
}
