//! `uswap bench refault`: the software cost per page of each kind of fault.
//!
//! (a) first touch, with fault-around off and at its configured size; (b) a minor fault: the
//! page is on the inactive list, unmapped but still in memory; (c) a major fault: the page is
//! read back from the swap device. Each phase reads one byte of every page once, in order.

use super::no_reclaim_limit;
use crate::args::CoreArgs;
use crate::report;
use crate::workload::mem::Mapped;
use anyhow::{ensure, Context, Result};
use clap::{value_parser, Args};
use serde::Serialize;
use std::sync::atomic::Ordering::Relaxed;
use std::time::Instant;
use uswap_core::{Advice, Latency, Region, Stats, VmStatSnapshot, PAGE_SIZE};

#[derive(Args, Debug)]
pub struct RefaultArgs {
    /// Pages touched in each phase
    #[arg(long, value_name = "N", default_value_t = 16384, value_parser = value_parser!(u64).range(16..=1 << 28))]
    pub pages: u64,

    /// Print one JSON object instead of a table
    #[arg(long)]
    pub json: bool,

    #[command(flatten)]
    pub core: CoreArgs,
}

#[derive(Serialize)]
struct Report {
    bench: &'static str,
    pages: u64,
    phases: Vec<Phase>,
    verify_errors: u64,
}

#[derive(Serialize)]
struct Phase {
    name: String,
    /// Wall time of the touching loop divided by the pages touched.
    us_per_page: f64,
    /// The library's service times for this phase's fault kind (the region's total).
    service_time: Latency,
    /// Counters over the phase.
    vmstat: VmStatSnapshot,
    /// Pages whose byte read back wrong.
    wrong_bytes: u64,
}

/// Picks one fault kind's service times out of a region's statistics.
type KindOf = fn(&Stats) -> Latency;

/// What a page holds after the setup write: never zero, so pages are not dropped as empty.
fn marker(page: usize) -> u8 {
    (page % 251) as u8 + 1
}

pub fn run(a: &RefaultArgs) -> Result<()> {
    let bytes = a.pages * PAGE_SIZE as u64;
    let cfg = a.core.config(no_reclaim_limit(bytes))?;
    let create = |cfg| {
        Region::new(bytes, cfg)
            .with_context(|| format!("creating a {} region", report::size(bytes)))
    };
    let zero = |_| 0;
    let first_touch = |s: &Stats| s.first_touch;

    let mut off = cfg.clone();
    off.fault_around = 1;
    let region = create(off)?;
    let mut phases = vec![phase(
        "first touch, fault-around off",
        &region,
        first_touch,
        zero,
    )];
    drop(region);

    let name = format!("first touch, fault-around {} pages", cfg.fault_around);
    let region = create(cfg)?;
    phases.push(phase(&name, &region, first_touch, zero));

    let mem = region.mem();
    for page in 0..mem.pages() {
        mem.byte(page).store(marker(page), Relaxed);
    }
    let steps: [(Advice, &str, KindOf); 2] = [
        (Advice::Cold, "minor: inactive, still in memory", |s| {
            s.minor
        }),
        (Advice::PageOut, "major: read from the swap device", |s| {
            s.major
        }),
    ];
    for (advice, name, kind) in steps {
        region
            .advise(0, region.len(), advice)
            .with_context(|| format!("preparing the phase \"{name}\""))?;
        phases.push(phase(name, &region, kind, marker));
    }

    let r = Report {
        bench: "refault",
        pages: a.pages,
        verify_errors: phases.iter().map(|p| p.wrong_bytes).sum(),
        phases,
    };
    super::emit(&r, a.json, print)?;
    ensure!(
        r.verify_errors == 0,
        "{} pages read back wrong",
        r.verify_errors
    );
    Ok(())
}

/// Reads one byte of every page in order and checks it against `expected`.
fn phase(
    name: &str,
    region: &Region,
    kind: impl Fn(&Stats) -> Latency,
    expected: impl Fn(usize) -> u8,
) -> Phase {
    let mem = region.mem();
    let before = region.stats();
    let started = Instant::now();
    let mut seen = Vec::with_capacity(mem.pages());
    for page in 0..mem.pages() {
        seen.push(mem.byte(page).load(Relaxed));
    }
    let took = started.elapsed();
    let after = region.stats();
    let wrong_bytes = seen
        .iter()
        .enumerate()
        .filter(|&(page, &b)| b != expected(page))
        .count() as u64;
    Phase {
        name: name.to_string(),
        us_per_page: took.as_secs_f64() * 1e6 / mem.pages() as f64,
        service_time: kind(&after),
        vmstat: after.vmstat.since(&before.vmstat),
        wrong_bytes,
    }
}

fn print(r: &Report) {
    println!(
        "uswap bench refault: {} pages per phase",
        report::count(r.pages)
    );
    println!(
        "  {:<38} {:>9} {:>9} {:>9} {:>9} {:>10} {:>9}",
        "phase", "µs/page", "faults", "majors", "p50 µs", "p99 µs", "swapped in"
    );
    for p in &r.phases {
        println!(
            "  {:<38} {:>9.2} {:>9} {:>9} {:>9.1} {:>10.1} {:>9}",
            p.name,
            p.us_per_page,
            report::count(p.vmstat.pgfault),
            report::count(p.vmstat.pgmajfault),
            p.service_time.p50_us,
            p.service_time.p99_us,
            report::count(p.vmstat.pswpin)
        );
    }
    println!("  (p50/p99: the library's service time for the phase's fault kind)");
    println!("  verify errors {}", r.verify_errors);
}
