//! Many threads allocate slots, write distinct pages, read them back and free them, on one
//! shared swap device. Every page must come back bit-identical, no slot may have two owners,
//! and the device must end empty; also with transient I/O faults injected under it.

use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use uswap_core::config::FaultPlan;
use uswap_core::swapfile::swap_io::PageBuf;
use uswap_core::swapfile::{SlotId, SwapDevice};
use uswap_core::{IoMode, SlotAlloc, SwapConfig, SwapLocation};

const THREADS: u64 = 8;
const ITERATIONS: u64 = 300;
/// Pages a thread keeps between iterations. With a batch of up to 8 on top, the threads hold
/// at most 8 x 32 = 256 of the device's 512 slots, and slots cycle through every cluster.
const MAX_HELD: usize = 24;

/// A page whose contents depend on every bit of `seed` (xorshift stream).
fn pattern(seed: u64) -> PageBuf {
    let mut page = PageBuf::new();
    let mut x = seed | 1;
    for chunk in page.as_mut_slice().chunks_mut(8) {
        x ^= x << 13;
        x ^= x >> 7;
        x ^= x << 17;
        chunk.copy_from_slice(&x.to_le_bytes());
    }
    page.as_mut_slice()[..8].copy_from_slice(&seed.to_le_bytes());
    page
}

struct Held {
    slot: SlotId,
    page: PageBuf,
}

fn verify(dev: &SwapDevice, held: &Held) {
    let mut back = PageBuf::new();
    unsafe { dev.read_page(held.slot, back.as_mut_ptr()) }
        .unwrap_or_else(|e| panic!("slot {}: {e}", held.slot));
    assert!(
        back.as_slice() == held.page.as_slice(),
        "slot {} read back different bytes",
        held.slot
    );
}

fn release(dev: &SwapDevice, owners: &[AtomicBool], held: Held) {
    verify(dev, &held);
    owners[held.slot as usize].store(false, Ordering::SeqCst);
    dev.free_slot(held.slot);
}

/// One thread's work: each iteration writes a batch of new pages, checks all it holds and
/// frees some, so allocation and freeing interleave with the other threads.
fn worker(dev: &SwapDevice, owners: &[AtomicBool], thread: u64) {
    let mut held: Vec<Held> = Vec::new();
    for iteration in 0..ITERATIONS {
        let batch_len = 1 + ((thread + iteration) % 8) as usize;
        let mut fresh: Vec<Held> = Vec::with_capacity(batch_len);
        for i in 0..batch_len as u64 {
            let slot = dev
                .alloc_slot()
                .expect("the device has room for every thread");
            let was_owned = owners[slot as usize].swap(true, Ordering::SeqCst);
            assert!(!was_owned, "slot {slot} handed to two owners");
            let seed = (thread << 48) | (iteration << 16) | i;
            fresh.push(Held {
                slot,
                page: pattern(seed),
            });
        }
        let batch: Vec<(SlotId, *const u8)> =
            fresh.iter().map(|h| (h.slot, h.page.as_ptr())).collect();
        for (result, h) in unsafe { dev.write_pages(&batch) }.iter().zip(&fresh) {
            assert!(result.is_ok(), "write of slot {}: {result:?}", h.slot);
        }
        held.extend(fresh);
        held.iter().for_each(|h| verify(dev, h));
        while held.len() > MAX_HELD || (iteration % 3 == 0 && held.len() > MAX_HELD / 2) {
            release(
                dev,
                owners,
                held.swap_remove((iteration as usize * 7) % held.len()),
            );
        }
    }
    held.into_iter().for_each(|h| release(dev, owners, h));
}

fn stress(io: IoMode, faults: Option<FaultPlan>) {
    stress_with(io, faults, SwapConfig::default().slot_alloc);
}

fn stress_with(io: IoMode, faults: Option<FaultPlan>, slot_alloc: SlotAlloc) {
    let dir = tempfile::tempdir().unwrap();
    let cfg = SwapConfig {
        location: SwapLocation::TempIn(dir.path().into()),
        size: Some(2 << 20),
        io,
        faults,
        slot_alloc,
        ..SwapConfig::default()
    };
    let dev = SwapDevice::open(&cfg).unwrap();
    assert_eq!(dev.slot_alloc(), slot_alloc);
    let owners: Arc<Vec<AtomicBool>> = Arc::new(
        (0..dev.capacity_pages())
            .map(|_| AtomicBool::new(false))
            .collect(),
    );
    let threads: Vec<_> = (0..THREADS)
        .map(|t| {
            let (dev, owners) = (dev.clone(), owners.clone());
            std::thread::spawn(move || worker(&dev, &owners, t))
        })
        .collect();
    for t in threads {
        t.join().expect("a worker failed");
    }
    assert_eq!(dev.used_pages(), 0);
    let stats = dev.io_stats();
    assert_eq!(
        stats.read_errors + stats.write_errors + stats.checksum_errors,
        0,
        "{stats:?}"
    );
    if faults.is_some() {
        assert!(
            stats.injected_faults > 0 && stats.io_retries > 0,
            "{stats:?}"
        );
        assert!(stats.reread_healed > 0, "{stats:?}");
    }
    assert!(owners.iter().all(|o| !o.load(Ordering::SeqCst)));
    let locks = dev.lockstat();
    let classes: Vec<_> = locks.iter().map(|c| c.name).collect();
    let mut expected = vec![
        "swap_cache",
        "swap_scan",
        "swap_cluster",
        "swap_lists",
        "zswap_order",
        "zpool_class",
    ];
    if io == IoMode::Uring {
        // Every batch took a ring from the pool and gave it back.
        expected.push("io_rings");
        assert!(locks[6].stat.acquisitions >= 2, "{:?}", locks[6]);
    }
    assert_eq!(classes, expected);
    drop(dev);
    assert_eq!(std::fs::read_dir(dir.path()).unwrap().count(), 0);
}

#[test]
fn eight_threads_roundtrip_pages_through_io_uring() {
    stress(IoMode::Uring, None);
}

#[test]
fn eight_threads_roundtrip_pages_through_pread() {
    stress(IoMode::Pread, None);
}

#[test]
fn eight_threads_roundtrip_pages_through_io_uring_under_transient_faults() {
    stress(IoMode::Uring, Some(FaultPlan::transient(41, 0.05)));
}

#[test]
fn eight_threads_roundtrip_pages_through_pread_under_transient_faults() {
    stress(IoMode::Pread, Some(FaultPlan::transient(42, 0.05)));
}

#[test]
fn eight_threads_roundtrip_pages_with_one_shared_scan_base() {
    stress_with(IoMode::Pread, None, SlotAlloc::Shared);
}
