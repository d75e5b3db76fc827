//! Signals that cannot deadlock: process-directed signals (a profiling timer, SIGURG) whose
//! handlers read region memory, delivered while threads thrash a region far larger than
//! its memory limit, in both fault modes. uswap's own threads must never run them, and the
//! SIGBUS handler must be safe to enter from inside them.
//!
//! The two modes run one after the other in one test: signal dispositions and timers are
//! process-wide.

mod common;

use std::sync::atomic::{AtomicBool, AtomicU64, AtomicUsize, Ordering::Relaxed};
use std::time::{Duration, Instant};
use uswap_core::{Config, FaultMode, Region, PAGE_SIZE};

/// Region pages the signal handlers read; never written after setup.
const SHARED: usize = 512;

static BASE: AtomicUsize = AtomicUsize::new(0);
static SEED: AtomicU64 = AtomicU64::new(1);
static SEEN: AtomicU64 = AtomicU64::new(0);
static WRONG: AtomicU64 = AtomicU64::new(0);

/// Reads a word of a shared page and checks it: async-signal-safe (atomics and loads).
extern "C" fn touch(_sig: libc::c_int) {
    let base = BASE.load(Relaxed);
    if base == 0 {
        return;
    }
    let mut x = SEED.fetch_add(0x9E37_79B9_7F4A_7C15, Relaxed);
    x ^= x >> 29;
    let (page, word) = (x as usize % SHARED, (x >> 20) as usize % common::WORDS);
    let got = unsafe {
        ((base + page * PAGE_SIZE) as *const u64)
            .add(word)
            .read_volatile()
    };
    if got != common::word(page, 0, word) {
        WRONG.fetch_add(1, Relaxed);
    }
    SEEN.fetch_add(1, Relaxed);
}

fn install(sig: libc::c_int) {
    unsafe {
        let mut act: libc::sigaction = std::mem::zeroed();
        act.sa_sigaction = touch as *const () as usize;
        act.sa_flags = libc::SA_RESTART;
        assert_eq!(libc::sigaction(sig, &act, std::ptr::null_mut()), 0);
    }
}

fn profiling_timer(interval_us: i64) {
    let t = libc::timeval {
        tv_sec: 0,
        tv_usec: interval_us,
    };
    let it = libc::itimerval {
        it_interval: t,
        it_value: t,
    };
    unsafe { libc::setitimer(libc::ITIMER_PROF, &it, std::ptr::null_mut()) };
}

/// Aborts the process if `done` is not set in time: a deadlock must fail the test, not
/// hang CI.
fn watchdog(done: &'static AtomicBool, what: &'static str) {
    std::thread::spawn(move || {
        // Immune to the storm itself, so it can still act when everything else is stuck.
        unsafe {
            let mut all: libc::sigset_t = std::mem::zeroed();
            libc::sigfillset(&mut all);
            libc::pthread_sigmask(libc::SIG_BLOCK, &all, std::ptr::null_mut());
        }
        let deadline = Instant::now() + Duration::from_secs(90);
        while !done.load(Relaxed) {
            if Instant::now() > deadline {
                eprintln!("deadlock: {what} did not finish in 90 s");
                std::process::abort();
            }
            std::thread::sleep(Duration::from_millis(50));
        }
    });
}

fn storm(mode: FaultMode) {
    static DONE: AtomicBool = AtomicBool::new(false);
    DONE.store(false, Relaxed);
    watchdog(&DONE, "the signal storm");
    let mut cfg = Config::new(4 << 20);
    cfg.fault_mode = mode;
    let region = Region::new(16 << 20, cfg).unwrap();
    let pages = region.len() / PAGE_SIZE;
    for p in 0..pages {
        unsafe { common::fill(region.as_ptr(), p, 0) };
    }
    let (seen0, wrong0) = (SEEN.load(Relaxed), WRONG.load(Relaxed));
    BASE.store(region.as_ptr() as usize, Relaxed);
    install(libc::SIGPROF);
    install(libc::SIGURG);
    profiling_timer(200);
    let stop = AtomicBool::new(false);
    let base = region.as_ptr() as usize;
    std::thread::scope(|s| {
        // Process-directed SIGURG, as Go's runtime sends for preemption.
        s.spawn(|| {
            while !stop.load(Relaxed) {
                unsafe { libc::kill(libc::getpid(), libc::SIGURG) };
                std::thread::sleep(Duration::from_micros(100));
            }
        });
        let workers: Vec<_> = (0..2)
            .map(|t| {
                s.spawn(move || {
                    let base = base as *mut u8;
                    let mine: Vec<usize> = (SHARED + t..pages).step_by(2).collect();
                    let mut version = vec![0u32; mine.len()];
                    let mut x = 0x2545_F491_4F6C_DD1Du64 + t as u64;
                    let until = Instant::now() + Duration::from_secs(3);
                    while Instant::now() < until {
                        x ^= x << 13;
                        x ^= x >> 7;
                        x ^= x << 17;
                        let k = x as usize % mine.len();
                        if x.is_multiple_of(3) {
                            version[k] += 1;
                            unsafe { common::fill(base, mine[k], version[k]) };
                        } else {
                            unsafe { common::check(base, mine[k], version[k]) }.unwrap();
                        }
                    }
                })
            })
            .collect();
        for w in workers {
            w.join().unwrap();
        }
        stop.store(true, Relaxed);
    });
    profiling_timer(0);
    BASE.store(0, Relaxed);
    DONE.store(true, Relaxed);
    let (seen, wrong) = (SEEN.load(Relaxed) - seen0, WRONG.load(Relaxed) - wrong0);
    let s = region.stats().vmstat;
    eprintln!("{mode:?}: {seen} signal handlers read region memory; {s:?}");
    assert!(
        seen > 100,
        "the storm must really happen: {seen} handler runs"
    );
    assert_eq!(wrong, 0, "a signal handler read wrong data");
    assert!(s.pswpin > 0 && s.pswpout > 0, "the region must really swap");
    assert_eq!(s.failed_faults, 0);
    region.check_invariants().unwrap();
}

#[test]
fn signal_storm_with_handlers_touching_region_memory_in_both_modes() {
    storm(FaultMode::Thread);
    storm(FaultMode::Sigbus);
}
