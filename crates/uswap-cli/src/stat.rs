//! `uswap stat PID`: the counters and fault latency of a program running under uswap, once
//! or every few seconds like vmstat, read from its control socket.

use crate::args::seconds;
use crate::report;
use anyhow::{Context, Result};
use clap::Args;
use serde::Deserialize;
use serde_json::{json, Value};
use std::time::{Duration, Instant};
use uswap_core::{control, Latency, LruStats, VmStatSnapshot, PAGE_SIZE};

#[derive(Args, Debug)]
pub struct StatArgs {
    /// The process: a program running under uswap (such as `uswap bench random`)
    pub pid: u32,

    /// Print a line of per-second rates every SECS seconds, like vmstat, until the process
    /// ends
    #[arg(long, value_name = "SECS", value_parser = seconds)]
    pub watch: Option<f64>,

    /// Print the raw snapshot as JSON (one object per line with --watch)
    #[arg(long)]
    pub json: bool,
}

/// The parts of a snapshot printed here (the JSON has more).
#[derive(Deserialize)]
struct Snapshot {
    size: u64,
    knobs: Knobs,
    stats: Counters,
}

#[derive(Deserialize)]
struct Knobs {
    memory: u64,
    swap_ra_policy: String,
    #[serde(rename = "page-cluster")]
    page_cluster: u8,
    #[serde(default)]
    lru_policy: String,
    #[serde(default)]
    references: String,
}

#[derive(Deserialize)]
struct Counters {
    vmstat: VmStatSnapshot,
    first_touch: Latency,
    minor: Latency,
    major: Latency,
    resident_pages: u64,
    swap_used_pages: u64,
    #[serde(default)]
    lru: LruStats,
    #[serde(default)]
    shared_pages: u64,
    #[serde(default)]
    fork_lent_slots: u64,
    #[serde(default)]
    borrowed_pages: u64,
    #[serde(default)]
    ztier: uswap_core::ZtierStats,
}

pub fn run(a: &StatArgs) -> Result<()> {
    match a.watch {
        None => once(a),
        Some(secs) => watch(a, Duration::from_secs_f64(secs)),
    }
}

fn raw(pid: u32) -> uswap_core::Result<Value> {
    control::request(pid, &json!({"cmd": "stat"}))
}

fn parse(raw: Value) -> Result<Snapshot> {
    serde_json::from_value(raw).context("the process sent statistics this uswap cannot read")
}

fn once(a: &StatArgs) -> Result<()> {
    let raw = raw(a.pid)?;
    if a.json {
        return report::json(&raw);
    }
    print_block(a.pid, &parse(raw)?);
    Ok(())
}

fn mib(pages: u64) -> String {
    format!(
        "{:.1}",
        (pages * PAGE_SIZE as u64) as f64 / (1 << 20) as f64
    )
}

fn print_block(pid: u32, s: &Snapshot) {
    let (c, v, k) = (&s.stats, &s.stats.vmstat, &s.knobs);
    let n = report::count;
    println!(
        "uswap stat {pid}: region {}, memory limit {}, readahead {} (page-cluster {})",
        report::size(s.size),
        report::size(k.memory),
        k.swap_ra_policy,
        k.page_cluster
    );
    println!(
        "  memory     resident {} of {} MiB   swap used {} MiB",
        mib(c.resident_pages),
        mib(k.memory / PAGE_SIZE as u64),
        mib(c.swap_used_pages)
    );
    if v.fork_shared + v.fork_copied + v.fork_lent + c.fork_lent_slots + c.borrowed_pages > 0 {
        println!(
            "  fork       shared {} MiB (copy-on-write, counted by the process that made them); \
             inherited shared {}, copied at forks {}, lent at forks {}; copy-on-write \
             breaks {}, left alone {}, copied for reclaim {} pages",
            mib(c.shared_pages),
            n(v.fork_shared),
            n(v.fork_copied),
            n(v.fork_lent),
            n(v.cow_break),
            n(v.cow_alone),
            n(v.cow_reclaim)
        );
        println!(
            "  fork swap  {} MiB of swap slots held for fork children; {} MiB still borrowed \
             from what a parent lent this process (its slots and staging frames, unread or \
             read and unchanged); read, unchanged and dropped without a write {} pages",
            mib(c.fork_lent_slots),
            mib(c.borrowed_pages),
            n(v.borrowed_dropped)
        );
    }
    if c.ztier.enabled || c.ztier.stored_pages > 0 {
        println!(
            "  ztier      {} ({})",
            report::ztier(&c.ztier),
            c.ztier.compressor
        );
    }
    if let Some(anon) = uswap_core::stats::rss_anon_bytes(pid) {
        let held = c.resident_pages * PAGE_SIZE as u64 + c.ztier.pool_bytes;
        println!(
            "  process    RssAnon {} MiB: uswap holds {} MiB, outside {} MiB (stacks, code, \
             the kernel's mappings, uswap's metadata)",
            mib(anon / PAGE_SIZE as u64),
            mib(held / PAGE_SIZE as u64),
            mib(anon.saturating_sub(held) / PAGE_SIZE as u64)
        );
    }
    println!(
        "  faults     {} in all: first-touch {}  minor {}  major {}",
        n(v.pgfault),
        n(c.first_touch.count),
        n(c.minor.count),
        n(c.major.count)
    );
    println!(
        "  swap       pswpin {}  pswpout {} pages",
        n(v.pswpin),
        n(v.pswpout)
    );
    println!(
        "  readahead  {} pages read ahead, {} used (hits)",
        n(v.swap_ra),
        n(v.swap_ra_hit)
    );
    println!(
        "  reclaim    pgscan {}  pgsteal {}  kswapd wake-ups {}  direct {}",
        n(v.pgscan),
        n(v.pgsteal),
        n(v.kswapd_wake),
        n(v.direct_reclaim)
    );
    println!(
        "  lru        {}: active {} probation {} inactive {} MiB; refaults {}, in the \
         working set {}; promoted {}, passed over {} ({} seen written; references: {})",
        k.lru_policy,
        mib(c.lru.active),
        mib(c.lru.probation),
        mib(c.lru.inactive),
        n(v.workingset_refault),
        n(v.workingset_activate),
        n(v.pgactivate),
        n(v.pgreferenced),
        n(v.pgreferenced_written),
        k.references
    );
    println!("fault service time (since the region was made):");
    report::service_times(&[
        ("first-touch", &c.first_touch),
        ("minor", &c.minor),
        ("major", &c.major),
    ]);
}

/// Lines between repeated headers, as vmstat.
const HEADER_EVERY: usize = 20;

fn watch(a: &StatArgs, every: Duration) -> Result<()> {
    if a.json {
        watch_json(a.pid, every)
    } else {
        watch_lines(a.pid, every)
    }
}

fn watch_json(pid: u32, every: Duration) -> Result<()> {
    println!("{}", raw(pid)?);
    loop {
        std::thread::sleep(every);
        match raw(pid) {
            Ok(now) => println!("{now}"),
            Err(e) => return ended(pid, e),
        }
    }
}

fn watch_lines(pid: u32, every: Duration) -> Result<()> {
    let mut prev = (Instant::now(), parse(raw(pid)?)?);
    let mut lines = 0;
    loop {
        if lines % HEADER_EVERY == 0 {
            print_header();
        }
        std::thread::sleep(every);
        let now = match raw(pid) {
            Ok(now) => (Instant::now(), parse(now)?),
            Err(e) => return ended(pid, e),
        };
        print_rates(&prev.1, &now.1, now.0 - prev.0);
        prev = now;
        lines += 1;
    }
}

/// Watching ends quietly when the process does. A request the process was ending too late
/// to answer fails otherwise; the next one tells whether it ended.
fn ended(pid: u32, e: uswap_core::Error) -> Result<()> {
    let gone = |e: &uswap_core::Error| {
        matches!(
            e,
            uswap_core::Error::NoSuchProcess { .. } | uswap_core::Error::NotUnderUswap { .. }
        )
    };
    if gone(&e) || raw(pid).as_ref().is_err_and(gone) {
        eprintln!("uswap stat: process {pid} has ended");
        return Ok(());
    }
    Err(e.into())
}

fn print_header() {
    println!(
        "{:>8} {:>8} {:>8} {:>8} {:>8} {:>8} {:>9} {:>9} {:>8} {:>8} {:>8} {:>8}",
        "res MiB",
        "swap MiB",
        "flt/s",
        "first/s",
        "minor/s",
        "major/s",
        "pswpin/s",
        "pswpout/s",
        "ra/s",
        "rahit/s",
        "scan/s",
        "steal/s"
    );
}

/// One line: memory now, and events per second since `before`.
fn print_rates(before: &Snapshot, after: &Snapshot, took: Duration) {
    let (a, b) = (&after.stats, &before.stats);
    let v = a.vmstat.since(&b.vmstat);
    let secs = took.as_secs_f64().max(1e-3);
    let rate = |n: u64| format!("{:.0}", n as f64 / secs);
    let faults = |l: &Latency, e: &Latency| rate(l.count.saturating_sub(e.count));
    println!(
        "{:>8} {:>8} {:>8} {:>8} {:>8} {:>8} {:>9} {:>9} {:>8} {:>8} {:>8} {:>8}",
        mib(a.resident_pages),
        mib(a.swap_used_pages),
        rate(v.pgfault),
        faults(&a.first_touch, &b.first_touch),
        faults(&a.minor, &b.minor),
        faults(&a.major, &b.major),
        rate(v.pswpin),
        rate(v.pswpout),
        rate(v.swap_ra),
        rate(v.swap_ra_hit),
        rate(v.pgscan),
        rate(v.pgsteal)
    );
}
