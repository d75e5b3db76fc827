//! Soak under injected I/O faults: several threads hammer a region eight times larger than
//! its memory limit, and every access checks the whole page against the version its thread
//! last wrote.
//!
//! Each scenario runs in a child process (this binary re-executed with `child ...`), so a
//! child that dies can be judged from outside; hence a custom harness.
//!
//! - Transient faults (EAGAIN, short transfers, bit flips in transit, occasional read EIO)
//!   and failed writes (EIO, ENOSPC: the page stays in memory for a later try): the child
//!   must finish with every access correct, no failed fault, and counters proving the
//!   faults were injected, retried, and the failed writes counted.
//! - Permanent faults too (bits flipped on the device, persistent read EIO): a page may
//!   really be lost, so the child may die by SIGBUS with a uswap message, or finish; it
//!   must never see a wrong page.
//!
//! `USWAP_SOAK_ACCESSES` sets the verified accesses per scenario (default 25000) for a
//! long run; `USWAP_SOAK_SEED` varies the injected faults (default 0);
//! `USWAP_SOAK_SECONDS` stops each worker at that age of the child even if its accesses are
//! not done (for time-boxed runs of many scenarios side by side; 10 s or more, so that the
//! injected faults the transient checks count have happened), and the child reports the
//! accesses it checked; `USWAP_SOAK_LOSS_EVERY` sets the accesses per lost page the
//! permanent faults aim at (default: `USWAP_SOAK_ACCESSES`, one loss somewhere in the run).

mod common;

use std::io::Write;
use std::os::unix::process::ExitStatusExt;
use std::process::Command;
use std::sync::atomic::{AtomicU64, Ordering::Relaxed};
use std::time::Instant;
use uswap_core::config::FaultPlan;
use uswap_core::{Advice, Config, FaultMode, IoMode, Region, PAGE_SIZE};

const THREADS: usize = 4;
/// Memory limit of the region; the region is eight times larger.
const MEMORY: usize = 4 << 20;
const OVERSUBSCRIPTION: usize = 8;
const DEFAULT_ACCESSES: u64 = 25_000;
/// Exit status of a child that saw a wrong page.
const WRONG_PAGE: i32 = 3;

fn env_number(name: &str, default: u64) -> u64 {
    std::env::var(name)
        .ok()
        .map(|v| v.parse().unwrap_or_else(|_| panic!("{name}: a number")))
        .unwrap_or(default)
}

fn accesses() -> u64 {
    env_number("USWAP_SOAK_ACCESSES", DEFAULT_ACCESSES)
}

/// When the workers stop even if their accesses are not done.
fn deadline() -> Option<Instant> {
    std::env::var_os("USWAP_SOAK_SECONDS").map(|_| {
        Instant::now() + std::time::Duration::from_secs(env_number("USWAP_SOAK_SECONDS", 0))
    })
}

/// Faults that clear before the retries run out, and writes that fail (EIO, ENOSPC): a
/// page whose write fails stays in memory for a later try, so nothing may be lost.
fn transient(seed: u64) -> FaultPlan {
    FaultPlan {
        seed,
        eagain: 0.03,
        short_read: 0.03,
        short_write: 0.03,
        read_flip: 0.03,
        read_eio: 0.005,
        write_eio: 0.01,
        write_enospc: 0.01,
        ..FaultPlan::default()
    }
}

/// Transient faults plus bits flipped on the device and bad sectors, at rates that lose
/// about one page in `loss_every` accesses (by default one somewhere in the run, or none),
/// so that many accesses are checked on either side of it.
fn permanent(seed: u64, loss_every: u64) -> FaultPlan {
    let per_run = 1.0 / loss_every.max(1) as f64;
    FaultPlan {
        write_flip: 2.0 * per_run,
        read_eio_persistent: per_run,
        ..transient(seed)
    }
}

/// A small xorshift generator for the access pattern.
struct Rng(u64);

impl Rng {
    fn next(&mut self) -> u64 {
        self.0 ^= self.0 << 13;
        self.0 ^= self.0 >> 7;
        self.0 ^= self.0 << 17;
        self.0
    }
}

/// Accesses checked so far by all threads, printed every thousand, so a child that dies
/// tells how far it got.
static CHECKED: AtomicU64 = AtomicU64::new(0);

/// Base address of the region, shareable between the worker threads.
#[derive(Clone, Copy)]
struct Base(usize);

/// One thread's share: the pages `thread`, `thread + THREADS`, ..., each filled once and
/// then read (and a quarter of the time rewritten) at random, every read checked against
/// the version last written, until `accesses` or the deadline. Returns the checked
/// accesses.
fn worker(
    region: &Region,
    base: Base,
    thread: usize,
    accesses: u64,
    deadline: Option<Instant>,
) -> u64 {
    let base = base.0 as *mut u8;
    let pages = region.len() / PAGE_SIZE;
    let mine: Vec<usize> = (thread..pages).step_by(THREADS).collect();
    let mut versions = vec![1u32; mine.len()];
    for &page in &mine {
        unsafe { common::fill(base, page, 1) };
    }
    let mut rng = Rng(0x9e37_79b9_7f4a_7c15 ^ ((thread as u64 + 1) * 0x1234_5679));
    for n in 0..accesses {
        if n.is_multiple_of(256) && deadline.is_some_and(|d| Instant::now() >= d) {
            return n;
        }
        let r = rng.next();
        let i = (r % mine.len() as u64) as usize;
        let page = mine[i];
        if let Err(e) = unsafe { common::check(base, page, versions[i]) } {
            println!("WRONG PAGE after {n} accesses: {e}");
            std::io::stdout().flush().unwrap();
            std::process::exit(WRONG_PAGE);
        }
        let total = CHECKED.fetch_add(1, Relaxed) + 1;
        if total.is_multiple_of(1000) {
            println!("progress: {total} accesses checked");
        }
        if (r >> 32).is_multiple_of(4) {
            versions[i] += 1;
            unsafe { common::fill(base, page, versions[i]) };
        }
        if (r >> 40).is_multiple_of(1024) {
            let start = page.min(pages - 16) * PAGE_SIZE;
            region
                .advise(start, 16 * PAGE_SIZE, Advice::PageOut)
                .unwrap();
        }
    }
    accesses
}

/// The child: runs the workload under `faults` and prints what happened.
fn child(kind: &str, mode: FaultMode, io: IoMode) {
    let seed =
        env_number("USWAP_SOAK_SEED", 0) ^ 0x5eed ^ ((mode as u64) << 8) ^ ((io as u64) << 4);
    let faults = match kind {
        "transient" => transient(seed),
        "permanent" => permanent(seed, env_number("USWAP_SOAK_LOSS_EVERY", accesses())),
        _ => panic!("unknown fault kind {kind}"),
    };
    let mut cfg = Config::new(MEMORY as u64);
    cfg.fault_mode = mode;
    cfg.swap.io = io;
    cfg.swap.faults = Some(faults);
    let region = Region::new((MEMORY * OVERSUBSCRIPTION) as u64, cfg).unwrap();
    let per_thread = accesses().div_ceil(THREADS as u64);
    let deadline = deadline();
    let base = Base(region.as_ptr() as usize);
    let checked: u64 = std::thread::scope(|s| {
        let workers: Vec<_> = (0..THREADS)
            .map(|t| {
                let region = &region;
                s.spawn(move || worker(region, base, t, per_thread, deadline))
            })
            .collect();
        workers.into_iter().map(|w| w.join().unwrap()).sum()
    });
    region.check_invariants().unwrap();
    let vm = region.stats().vmstat;
    let io_stats = region.stats().io;
    println!(
        "checked {checked} accesses: pswpin {} pswpout {} failed_faults {} verify_errors {} \
         io_errors {}; {io_stats:?}",
        vm.pswpin, vm.pswpout, vm.failed_faults, vm.verify_errors, vm.io_errors
    );
    if kind == "transient" {
        assert_eq!(vm.failed_faults, 0, "no access may fail");
        assert_eq!(vm.verify_errors, 0, "{vm:?}");
        assert_eq!(
            io_stats.read_errors + io_stats.checksum_errors,
            0,
            "{io_stats:?}"
        );
        // Failed writes are counted (and said once on stderr), and their pages kept.
        assert!(io_stats.write_errors > 0, "{io_stats:?}");
        assert_eq!(vm.io_errors, io_stats.write_errors, "{vm:?} {io_stats:?}");
        assert!(
            vm.pswpin > checked / 4,
            "the region must really swap: {vm:?}"
        );
        assert!(io_stats.injected_faults > 0, "{io_stats:?}");
        assert!(io_stats.io_retries > 0, "{io_stats:?}");
        assert!(io_stats.reread_healed > 0, "{io_stats:?}");
    }
    // Permanent faults: reaching here means no page was lost; check that faults were
    // injected at all.
    assert!(io_stats.injected_faults > 0, "{io_stats:?}");
    println!("finished");
}

/// Runs one scenario in a child and judges how it ended.
fn run(kind: &str, mode: &str, io: &str) -> Result<String, String> {
    let start = Instant::now();
    let out = Command::new(std::env::current_exe().unwrap())
        .args(["child", kind, mode, io])
        .output()
        .map_err(|e| e.to_string())?;
    let took = start.elapsed().as_secs_f64();
    let (stdout, stderr) = (
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr),
    );
    let report = |what: &str| {
        format!(
            "{what} ({:?})\nstdout: {stdout}\nstderr: {stderr}",
            out.status
        )
    };
    if stdout.contains("WRONG PAGE") || out.status.code() == Some(WRONG_PAGE) {
        return Err(report("a wrong page was served"));
    }
    let summary = stdout.lines().find(|l| l.starts_with("checked"));
    if out.status.success() && stdout.contains("finished") {
        return Ok(format!("{took:.1} s, {}", summary.unwrap_or("")));
    }
    let loud = out.status.signal() == Some(libc::SIGBUS)
        && stderr.contains("uswap: access to")
        && stderr.contains("fails with SIGBUS");
    if kind == "permanent" && loud {
        let why = stderr.lines().find(|l| l.contains("fails with SIGBUS"));
        let progress = stdout.lines().rfind(|l| l.starts_with("progress"));
        return Ok(format!(
            "{took:.1} s, {}, then lost a page loudly: {}",
            progress.unwrap_or("progress: none"),
            why.unwrap_or("")
        ));
    }
    Err(report(
        "the child must finish, or die loudly of a lost page",
    ))
}

fn parse_child(args: &[String]) {
    let mode = args[3].parse().expect("a fault mode");
    let io = args[4].parse().expect("an I/O mode");
    child(&args[2], mode, io);
}

fn main() {
    let args: Vec<String> = std::env::args().collect();
    if args.get(1).map(String::as_str) == Some("child") {
        return parse_child(&args);
    }
    let filter = args.iter().skip(1).find(|a| !a.starts_with('-'));
    let mut failed = 0;
    for kind in ["transient", "permanent"] {
        for (mode, io) in [
            ("thread", "uring"),
            ("sigbus", "uring"),
            ("thread", "pread"),
            ("sigbus", "pread"),
        ] {
            let name = format!("soak_{kind}_faults_{mode}_mode_{io}");
            if filter.is_some_and(|f| !name.contains(f.as_str())) {
                continue;
            }
            match run(kind, mode, io) {
                Ok(summary) => println!("test {name} ... ok: {summary}"),
                Err(e) => {
                    println!("test {name} ... FAILED\n{e}");
                    failed += 1;
                }
            }
        }
    }
    if failed > 0 {
        std::process::exit(1);
    }
}
