//! `uswap bench random`: pmbench-like random access (uniform, or skewed with
//! `--distribution`) on a region larger than memory.

use super::{Backend, KERNEL_SWAP_MARGIN};
use crate::args::{nonzero_size, seconds, CoreArgs, KernelArgs};
use crate::kernel::{self, child, vmstat, Environment};
use crate::report;
use crate::workload::distribution::Distribution;
use crate::workload::mem::Mapped;
use crate::workload::pattern::Data;
use crate::workload::random::{self, RandomOutcome, RandomParams};
use anyhow::{bail, ensure, Context, Result};
use clap::{value_parser, Args};
use serde::Serialize;
use std::io::IsTerminal;
use std::sync::Arc;
use uswap_core::control::ControlServer;
use uswap_core::{
    LockClass, PhaseSummary, Region, SlotAlloc, Stats, SwapCacheMode, SwapCacheStats,
    VmStatSnapshot, ZtierStats,
};

#[derive(Args, Debug)]
pub struct RandomArgs {
    /// Size of the region the threads access
    #[arg(long, value_name = "SIZE", default_value = "512M", value_parser = nonzero_size)]
    pub size: u64,

    /// Memory it may keep resident (uswap's limit; the kernel backend's cgroup limit)
    #[arg(long, value_name = "SIZE", default_value = "256M", value_parser = nonzero_size)]
    pub memory: u64,

    /// Accessing threads
    #[arg(long, value_name = "N", default_value_t = 1, value_parser = value_parser!(u16).range(1..=1024))]
    pub threads: u16,

    /// Share of accesses that are writes, in percent
    #[arg(long, value_name = "P", default_value_t = 20, value_parser = value_parser!(u8).range(0..=100))]
    pub write_pct: u8,

    /// How accesses spread over the pages: uniform, zipf:S (Zipf with exponent S, such as
    /// zipf:0.99) or hot:P/Q (P% of accesses to Q% of the pages); skewed ranks are
    /// scattered over the region
    #[arg(long, value_name = "DIST", default_value = "uniform")]
    pub distribution: Distribution,

    /// After every N of its accesses, each thread reads its share of the region in page
    /// order, every page checked: together a sequential scan through the whole set (0:
    /// never). Scan reads count as accesses and are reported apart too
    #[arg(long, value_name = "N", default_value_t = 0)]
    pub scan: u64,

    /// What the pages hold, which sets how well they compress: random, text,
    /// compressible:R (about R:1) or zeros:P (P% of the pages zero but for their first
    /// word); every read is checked against it
    #[arg(long, value_name = "DATA", default_value = "random")]
    pub data: Data,

    /// Length of the measured interval; filling the region first is not counted
    #[arg(long, value_name = "S", default_value = "8", value_parser = seconds)]
    pub seconds: f64,

    /// Which swap runs the workload
    #[arg(long, value_enum, default_value_t = Backend::Uswap)]
    pub backend: Backend,

    /// Print one JSON object instead of a table
    #[arg(long)]
    pub json: bool,

    /// Time every phase of uswap's faults and reclaim and print where the time went
    #[arg(long)]
    pub breakdown: bool,

    /// Run each accessing thread with syscall dispatch on, as `uswap run --fault-mode
    /// sigbus` runs a program's threads (needs --fault-mode sigbus; auto turns it on)
    #[arg(long)]
    pub syscall_dispatch: bool,

    #[command(flatten)]
    pub core: CoreArgs,

    #[command(flatten)]
    pub kernel: KernelArgs,
}

#[derive(Serialize)]
struct Report {
    bench: &'static str,
    backend: Backend,
    size: u64,
    memory: u64,
    threads: usize,
    write_pct: u8,
    distribution: String,
    /// `--scan`: accesses between a thread's scans of its share (0: none).
    scan_every: u64,
    /// `--data`: what the pages hold.
    data: String,
    slot_alloc: String,
    swap_cache_mode: String,
    accesses: u64,
    accesses_per_s: f64,
    swap_in_mb_s: f64,
    swap_out_mb_s: f64,
    /// Pages swapped in over the measured interval.
    swap_ins: u64,
    /// Accesses that waited for a read from swap (uswap's `pgmajfault`; the kernel's
    /// `ru_majflt` of the accessing process), over the measured interval.
    major_faults: u64,
    major_faults_per_1000: f64,
    /// Pages written to the swap file over the measured interval (for uswap, pages
    /// swapped out less those kept by the compressed tier, plus its writebacks; for the
    /// kernel, `pswpout`, which zswap's stores do not count).
    disk_writes: u64,
    disk_write_mb_s: f64,
    verify_errors: u64,
    #[serde(flatten)]
    outcome: RandomOutcome,
    #[serde(skip_serializing_if = "Option::is_none")]
    uswap: Option<UswapDetail>,
    #[serde(skip_serializing_if = "Option::is_none")]
    kernel: Option<KernelDetail>,
}

#[derive(Serialize)]
struct KernelDetail {
    #[serde(flatten)]
    environment: Environment,
    /// Fault path and reclaim counters of /proc/vmstat over the measured interval
    /// (machine-wide): the kernel's side of `--breakdown`, which has no per-phase clock.
    vmstat: vmstat::Named,
}

#[derive(Serialize)]
struct UswapDetail {
    /// Counters over the measured interval.
    vmstat: VmStatSnapshot,
    /// Lock statistics over the measured interval, one entry per lock class.
    lockstat: Vec<LockClass>,
    /// Swap cache counters over the measured interval.
    swap_cache: SwapCacheStats,
    /// The compressed tier over the measured interval (counts), and what it held at the
    /// end.
    ztier: ZtierStats,
    /// The region's statistics at the end of the measured interval (service times since
    /// the region was made).
    stats: Stats,
    /// Time per phase over the measured interval (`--breakdown`).
    #[serde(skip_serializing_if = "Vec::is_empty")]
    breakdown: Vec<PhaseSummary>,
}

pub fn run(a: &RandomArgs) -> Result<()> {
    super::set_pages(a.size)?;
    use uswap_core::FaultMode;
    // Auto mode runs the accessing threads as `uswap run` runs a program's.
    let auto_sigbus = a.core.fault_mode.map(FaultMode::resolve) == Some(FaultMode::Sigbus)
        && a.core.fault_mode == Some(FaultMode::Auto);
    let params = RandomParams {
        threads: a.threads as usize,
        write_pct: a.write_pct,
        seconds: a.seconds,
        syscall_dispatch: a.syscall_dispatch || auto_sigbus,
        distribution: a.distribution,
        scan_every: a.scan,
        data: a.data,
    };
    if a.syscall_dispatch
        && (a.backend != Backend::Uswap
            || a.core.fault_mode.map(FaultMode::resolve) != Some(FaultMode::Sigbus))
    {
        bail!("--syscall-dispatch is a part of uswap's SIGBUS mode: add --fault-mode sigbus (and leave --backend at uswap)");
    }
    let r = match a.backend {
        Backend::Uswap => run_uswap(a, &params)?,
        Backend::Kernel => run_kernel(a, &params)?,
    };
    super::emit(&r, a.json, print)?;
    ensure!(
        r.verify_errors == 0,
        "{} verify errors: pages did not come back as they were written",
        r.verify_errors
    );
    Ok(())
}

fn run_uswap(a: &RandomArgs, params: &RandomParams) -> Result<Report> {
    let mut cfg = a.core.config(a.memory)?;
    cfg.breakdown = a.breakdown;
    let region = Arc::new(Region::new(a.size, cfg).with_context(|| {
        format!(
            "creating a {} region with a {} memory limit",
            report::size(a.size),
            report::size(a.memory)
        )
    })?);
    let _control = serve_control(&region);
    let (outcome, (before, times_before), (after, times_after)) =
        random::run(region.mem(), params, || {
            (region.stats(), region.phase_times())
        });
    let breakdown = match (times_after, times_before) {
        (Some(t), Some(b)) => t.since(&b).summary(),
        _ => Vec::new(),
    };
    let vmstat = after.vmstat.since(&before.vmstat);
    let ztier = after.ztier.since(&before.ztier);
    let dirty_stores = ztier.stores.saturating_sub(ztier.stored_clean);
    let disk_writes = (vmstat.pswpout + ztier.written_back).saturating_sub(dirty_stores);
    let swapped = (
        vmstat.pswpin,
        vmstat.pswpout,
        vmstat.pgmajfault,
        disk_writes,
    );
    let detail = UswapDetail {
        vmstat,
        lockstat: report::lockstat_since(&after.lockstat, &before.lockstat),
        swap_cache: after.swap_cache.since(&before.swap_cache),
        ztier,
        stats: after,
        breakdown,
    };
    Ok(build_report(a, outcome, swapped, Some(detail), None))
}

/// Serves the region on this process's control socket, so that `uswap stat` and `uswap ctl`
/// can watch and tune the run. The benchmark runs without it if it cannot be had.
fn serve_control(region: &Arc<Region>) -> Option<ControlServer> {
    match ControlServer::start(region.clone()) {
        Ok(server) => {
            if std::io::stderr().is_terminal() {
                eprintln!(
                    "live: uswap stat {pid} --watch 1, uswap ctl {pid}",
                    pid = std::process::id()
                );
            }
            Some(server)
        }
        Err(e) => {
            eprintln!("uswap bench random: no live statistics: {e}");
            None
        }
    }
}

fn run_kernel(a: &RandomArgs, params: &RandomParams) -> Result<Report> {
    let setup = kernel::Setup {
        memory_limit: Some(a.memory),
        swap: Some(kernel::SwapPlan {
            kind: a.kernel.kernel_swap,
            bytes: a.core.swap_size.unwrap_or(a.size + KERNEL_SWAP_MARGIN),
            dir: a.core.swap_dir(),
            own: false,
        }),
        tunables: a.kernel.tunables(&a.core, a.memory)?,
    };
    let spec = child::Spec::Random {
        size: a.size,
        params: *params,
    };
    let (child_report, environment) = kernel::run(&setup, &spec)?;
    let child::Report::Random { outcome, swap, vm } = child_report else {
        bail!("the kernel-backend child sent a report for another workload");
    };
    let major_faults = outcome.cpu.major_faults;
    Ok(build_report(
        a,
        outcome,
        (swap.pswpin, swap.pswpout, major_faults, swap.pswpout),
        None,
        Some(KernelDetail {
            environment,
            vmstat: vm,
        }),
    ))
}

fn build_report(
    a: &RandomArgs,
    outcome: RandomOutcome,
    (pswpin, pswpout, major_faults, disk_writes): (u64, u64, u64, u64),
    uswap: Option<UswapDetail>,
    kernel: Option<KernelDetail>,
) -> Report {
    let secs = outcome.measured_s;
    Report {
        bench: "random",
        backend: a.backend,
        size: a.size,
        memory: a.memory,
        threads: a.threads as usize,
        write_pct: a.write_pct,
        distribution: a.distribution.to_string(),
        scan_every: a.scan,
        data: a.data.to_string(),
        slot_alloc: a.core.slot_alloc.unwrap_or(SlotAlloc::Percpu).to_string(),
        swap_cache_mode: a
            .core
            .swap_cache
            .unwrap_or(SwapCacheMode::Trunks)
            .to_string(),
        accesses: outcome.accesses(),
        accesses_per_s: outcome.accesses() as f64 / secs,
        swap_in_mb_s: report::mb_per_s(pswpin, secs),
        swap_out_mb_s: report::mb_per_s(pswpout, secs),
        swap_ins: pswpin,
        major_faults,
        major_faults_per_1000: 1000.0 * major_faults as f64 / outcome.accesses().max(1) as f64,
        disk_writes,
        disk_write_mb_s: report::mb_per_s(disk_writes, secs),
        verify_errors: outcome.verify_errors(),
        outcome,
        uswap,
        kernel,
    }
}

fn print(r: &Report) {
    let o = &r.outcome;
    let pct = |n: u64| 100.0 * n as f64 / r.accesses.max(1) as f64;
    println!(
        "uswap bench random: backend {}, {} region, {} memory, {} thread(s), {}% writes, {}, {} data",
        r.backend,
        report::size(r.size),
        report::size(r.memory),
        r.threads,
        r.write_pct,
        r.distribution,
        r.data
    );
    println!(
        "  time             setup (fill) {:.2} s   measured {:.2} s   final check {:.2} s",
        o.setup_s, o.measured_s, o.verify_s
    );
    println!(
        "  accesses         {}  ({}/s)   reads {:.1}%  writes {:.1}%  scan reads {:.1}%",
        report::count(r.accesses),
        report::count(r.accesses_per_s as u64),
        pct(o.reads),
        pct(o.writes),
        pct(o.scan_reads)
    );
    println!(
        "  swap             in {:.1} MB/s   out {:.1} MB/s   major faults {} ({:.1} per 1,000 accesses)",
        r.swap_in_mb_s,
        r.swap_out_mb_s,
        report::count(r.major_faults),
        r.major_faults_per_1000
    );
    println!(
        "  swap file        written {:.1} MB/s ({} pages)",
        r.disk_write_mb_s,
        report::count(r.disk_writes)
    );
    if let Some(z) = r
        .uswap
        .as_ref()
        .map(|u| &u.ztier)
        .filter(|z| z.stores + z.stored_pages > 0)
    {
        println!("  ztier            {}", report::ztier(z));
    }
    println!(
        "  access latency   {}",
        report::access_latency(&o.access_latency)
    );
    println!(
        "  verify errors    {}  (during run {}, final check {})",
        r.verify_errors, o.errors_during_run, o.errors_final_pass
    );
    println!(
        "  process          {}",
        report::cpu_use(&o.cpu, r.accesses, r.swap_ins)
    );
    if let Some(u) = &r.uswap {
        println!("uswap fault service time (since the region was made):");
        report::service_times(&[
            ("first-touch", &u.stats.first_touch),
            ("minor", &u.stats.minor),
            ("major", &u.stats.major),
        ]);
        println!("uswap counters over the measured interval:");
        report::vmstat(&u.vmstat);
        let c = &u.swap_cache;
        println!(
            "  swap cache ({}, {})  lookups {}  hits {}  readahead hits {}  adds {}  deletes {}",
            u.stats.readahead.policy,
            u.stats.readahead.page_cluster,
            report::count(c.lookups),
            report::count(c.hits),
            report::count(c.readahead_hits),
            report::count(c.adds),
            report::count(c.deletes)
        );
        println!(
            "uswap swap side: slot allocation {}, swap cache {}",
            r.slot_alloc, r.swap_cache_mode
        );
        println!("uswap lock statistics over the measured interval:");
        report::lockstat(&u.lockstat);
        if !u.breakdown.is_empty() {
            println!("uswap time per phase over the measured interval (--breakdown):");
            report::breakdown(&u.breakdown);
        }
    }
    if let Some(k) = &r.kernel {
        println!("kernel counters over the measured interval (/proc/vmstat, machine-wide):");
        report::named_counters(&k.vmstat);
        k.environment.print();
    }
}
