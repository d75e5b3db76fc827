//! A program whose allocator lives in the region: its worker threads' `malloc` is served
//! from region memory under the allocator's own lock, so a fault can strike while that
//! lock is held. uswap must then resolve the fault without allocating through the same
//! allocator (the SIGBUS handler runs on the faulting thread) and without needing any lock
//! the faulting thread holds. Profiling signals whose handlers read the allocator's state
//! in the region make it harder. Both fault modes, one after the other.

mod common;

use std::alloc::{GlobalAlloc, Layout, System};
use std::cell::Cell;
use std::sync::atomic::{
    AtomicBool, AtomicUsize, Ordering::Acquire, Ordering::Relaxed, Ordering::Release,
};
use std::time::{Duration, Instant};
use uswap_core::{Config, FaultMode, Region, PAGE_SIZE};

/// Size classes 16 B .. 64 KiB; larger requests come from the bump area whole.
const CLASSES: usize = 13;

/// The arena's header, at the start of the region: free-list heads and the bump pointer.
#[repr(C)]
struct Header {
    free: [usize; CLASSES],
    bump: usize,
}

static ARENA: AtomicUsize = AtomicUsize::new(0);
static ARENA_END: AtomicUsize = AtomicUsize::new(0);
static LOCK: AtomicBool = AtomicBool::new(false);
/// A finished run's arena: a block from it freed late (by a thread's exit, say) is leaked.
static RETIRED: (AtomicUsize, AtomicUsize) = (AtomicUsize::new(0), AtomicUsize::new(0));

thread_local! {
    /// Set on the threads whose allocations go to the region.
    static IN_REGION: Cell<bool> = const { Cell::new(false) };
}

struct RegionAlloc;

fn class(layout: &Layout) -> usize {
    let size = layout
        .size()
        .max(layout.align())
        .max(16)
        .next_power_of_two();
    size.trailing_zeros() as usize - 4
}

fn lock() {
    while LOCK
        .compare_exchange_weak(false, true, Acquire, Relaxed)
        .is_err()
    {
        std::hint::spin_loop();
    }
}

unsafe impl GlobalAlloc for RegionAlloc {
    unsafe fn alloc(&self, layout: Layout) -> *mut u8 {
        let base = ARENA.load(Relaxed);
        if base == 0 || !IN_REGION.with(Cell::get) {
            return System.alloc(layout);
        }
        let c = class(&layout);
        let size = 16usize << c;
        lock();
        let h = &mut *(base as *mut Header);
        let p = if c < CLASSES && h.free[c] != 0 {
            let p = h.free[c];
            h.free[c] = *(p as *const usize);
            p
        } else {
            let p = h.bump.next_multiple_of(size.min(PAGE_SIZE));
            if p + size > ARENA_END.load(Relaxed) {
                // The arena is used up (blocks are reused only within their size class):
                // the rest comes from the system.
                LOCK.store(false, Release);
                return System.alloc(layout);
            }
            h.bump = p + size;
            p
        };
        LOCK.store(false, Release);
        p as *mut u8
    }

    unsafe fn dealloc(&self, ptr: *mut u8, layout: Layout) {
        let (base, end) = (ARENA.load(Relaxed), ARENA_END.load(Relaxed));
        let p = ptr as usize;
        if p >= RETIRED.0.load(Relaxed) && p < RETIRED.1.load(Relaxed) {
            return;
        }
        if base == 0 || p < base || p >= end {
            return System.dealloc(ptr, layout);
        }
        let c = class(&layout);
        if c >= CLASSES {
            return; // large blocks are not reused
        }
        lock();
        let h = &mut *(base as *mut Header);
        *(ptr as *mut usize) = h.free[c];
        h.free[c] = ptr as usize;
        LOCK.store(false, Release);
    }
}

#[global_allocator]
static GLOBAL: RegionAlloc = RegionAlloc;

/// Reads the allocator's header in the region from a signal handler.
extern "C" fn peek(_sig: libc::c_int) {
    let base = ARENA.load(Relaxed);
    if base != 0 {
        let h = base as *const Header;
        unsafe { std::ptr::addr_of!((*h).bump).read_volatile() };
    }
}

fn run(mode: FaultMode) {
    let mut cfg = Config::new(8 << 20);
    cfg.fault_mode = mode;
    let region = Region::new(128 << 20, cfg).unwrap();
    let base = region.as_ptr() as usize;
    unsafe { (*(base as *mut Header)).bump = base + PAGE_SIZE };
    ARENA_END.store(base + region.len(), Relaxed);
    ARENA.store(base, Relaxed);
    unsafe {
        let mut act: libc::sigaction = std::mem::zeroed();
        act.sa_sigaction = peek as *const () as usize;
        act.sa_flags = libc::SA_RESTART;
        libc::sigaction(libc::SIGPROF, &act, std::ptr::null_mut());
        let t = libc::timeval {
            tv_sec: 0,
            tv_usec: 300,
        };
        let it = libc::itimerval {
            it_interval: t,
            it_value: t,
        };
        libc::setitimer(libc::ITIMER_PROF, &it, std::ptr::null_mut());
    }
    let done = AtomicBool::new(false);
    std::thread::scope(|s| {
        s.spawn(|| {
            let deadline = Instant::now() + Duration::from_secs(90);
            while !done.load(Relaxed) {
                if Instant::now() > deadline {
                    eprintln!("deadlock: allocator in the region, {mode:?} mode");
                    std::process::abort();
                }
                std::thread::sleep(Duration::from_millis(50));
            }
        });
        let workers: Vec<_> = (0..2u64)
            .map(|t| {
                s.spawn(move || {
                    IN_REGION.with(|f| f.set(true));
                    let mut x = 0x9E37_79B9_7F4A_7C15u64 ^ t;
                    let mut live: Vec<Vec<u64>> = Vec::new();
                    let until = Instant::now() + Duration::from_secs(3);
                    let mut rounds = 0u64;
                    while Instant::now() < until {
                        x ^= x << 13;
                        x ^= x >> 7;
                        x ^= x << 17;
                        rounds += 1;
                        if live.len() < 500 && !x.is_multiple_of(3) {
                            let len = (x >> 8) as usize % 3000 + 1;
                            let tag = x >> 20;
                            live.push((0..len as u64).map(|i| tag ^ i).collect());
                        } else if !live.is_empty() {
                            let v = live.swap_remove(x as usize % live.len());
                            let tag = v[0];
                            assert!(v.iter().enumerate().all(|(i, &w)| w == tag ^ i as u64));
                        }
                    }
                    for v in &live {
                        let tag = v[0];
                        assert!(v.iter().enumerate().all(|(i, &w)| w == tag ^ i as u64));
                    }
                    drop(live);
                    IN_REGION.with(|f| f.set(false));
                    rounds
                })
            })
            .collect();
        let rounds: u64 = workers.into_iter().map(|w| w.join().unwrap()).sum();
        done.store(true, Relaxed);
        let s = region.stats().vmstat;
        eprintln!("{mode:?}: {rounds} allocator rounds; {s:?}");
        assert!(
            s.pswpout > 0 && s.pswpin > 0,
            "the arena must really swap: {s:?}"
        );
        assert_eq!(s.failed_faults, 0);
    });
    unsafe {
        let zero: libc::itimerval = std::mem::zeroed();
        libc::setitimer(libc::ITIMER_PROF, &zero, std::ptr::null_mut());
    }
    RETIRED.0.store(base, Relaxed);
    RETIRED.1.store(base + region.len(), Relaxed);
    ARENA.store(0, Relaxed);
    region.check_invariants().unwrap();
}

#[test]
fn an_allocator_living_in_the_region_never_deadlocks_in_both_modes() {
    run(FaultMode::Thread);
    run(FaultMode::Sigbus);
}
