//! `uswap bench probe`: how long one access to hot memory takes while writers thrash a set
//! larger than memory (seed 003's flood ping during swap-out), reported like `ping`.

use super::{Backend, KERNEL_SWAP_MARGIN};
use crate::args::{nonzero_size, seconds, CoreArgs, KernelArgs};
use crate::kernel::{self, child, vmstat, Environment};
use crate::report;
use crate::workload::mem::Mapped;
use crate::workload::probe::{self, ProbeOutcome, ProbeParams};
use anyhow::{bail, ensure, Context, Result};
use clap::{value_parser, Args};
use serde::Serialize;
use uswap_core::{LockClass, Region, Stats, SwapCacheStats, VmStatSnapshot, PAGE_SIZE};

#[derive(Args, Debug)]
pub struct ProbeArgs {
    /// Size of the set the threads thrash with writes
    #[arg(long, value_name = "SIZE", default_value = "512M", value_parser = nonzero_size)]
    pub size: u64,

    /// Memory the thrashed set and the hot set may keep resident together (uswap's limit;
    /// the kernel backend's cgroup limit)
    #[arg(long, value_name = "SIZE", default_value = "256M", value_parser = nonzero_size)]
    pub memory: u64,

    /// Thrashing threads, each writing random pages of the set back to back
    #[arg(long, value_name = "N", default_value_t = 2, value_parser = value_parser!(u16).range(1..=1024))]
    pub threads: u16,

    /// Size of the probe's hot set (beside the thrashed set, in the same memory), at most
    /// half of --memory
    #[arg(long, value_name = "SIZE", default_value = "1M", value_parser = nonzero_size)]
    pub hot: u64,

    /// µs from one probe to the next; 0: back to back (flood). Each hot page is touched
    /// once every interval × hot pages (25.6 ms by default): much longer, and reclaim takes
    /// the hot set too
    #[arg(long, value_name = "US", default_value_t = 100, value_parser = value_parser!(u64).range(0..=1_000_000))]
    pub interval_us: u64,

    /// Length of the measured interval; filling the memory first is not counted
    #[arg(long, value_name = "S", default_value = "10", value_parser = seconds)]
    pub seconds: f64,

    /// Which swap runs the workload
    #[arg(long, value_enum, default_value_t = Backend::Uswap)]
    pub backend: Backend,

    /// Print one JSON object instead of a table
    #[arg(long)]
    pub json: bool,

    #[command(flatten)]
    pub core: CoreArgs,

    #[command(flatten)]
    pub kernel: KernelArgs,
}

#[derive(Serialize)]
struct Report {
    bench: &'static str,
    backend: Backend,
    /// The thrashed set.
    size: u64,
    hot: u64,
    memory: u64,
    threads: usize,
    interval_us: u64,
    /// The thrashers' writes per second.
    accesses_per_s: f64,
    swap_in_mb_s: f64,
    swap_out_mb_s: f64,
    #[serde(flatten)]
    outcome: ProbeOutcome,
    #[serde(skip_serializing_if = "Option::is_none")]
    uswap: Option<UswapDetail>,
    #[serde(skip_serializing_if = "Option::is_none")]
    kernel: Option<KernelDetail>,
}

#[derive(Serialize)]
struct UswapDetail {
    /// Counters over the measured interval.
    vmstat: VmStatSnapshot,
    /// Lock statistics over the measured interval, one entry per lock class.
    lockstat: Vec<LockClass>,
    /// Swap cache counters over the measured interval.
    swap_cache: SwapCacheStats,
    /// The region's statistics at the end of the measured interval (service times since
    /// the region was made).
    stats: Stats,
}

#[derive(Serialize)]
struct KernelDetail {
    #[serde(flatten)]
    environment: Environment,
    /// LRU counters of /proc/vmstat over the measured interval (machine-wide).
    vmstat: vmstat::Named,
}

pub fn run(a: &ProbeArgs) -> Result<()> {
    let params = params(a)?;
    let bytes = (super::set_pages(a.size)? + params.hot_pages as u64) * PAGE_SIZE as u64;
    super::set_pages(bytes)?;
    let r = match a.backend {
        Backend::Uswap => run_uswap(a, bytes, &params)?,
        Backend::Kernel => run_kernel(a, bytes, &params)?,
    };
    super::emit(&r, a.json, print)?;
    ensure!(
        r.outcome.verify_errors == 0,
        "{} verify errors: pages did not come back as they were written",
        r.outcome.verify_errors
    );
    Ok(())
}

fn params(a: &ProbeArgs) -> Result<ProbeParams> {
    let hot_pages = a.hot / PAGE_SIZE as u64;
    ensure!(hot_pages >= 1, "--hot {} is smaller than one page", a.hot);
    ensure!(
        a.hot <= a.memory / 2,
        "--hot {} is more than half of --memory {}: the hot set must stay resident beside \
         the thrashers' pages",
        report::size(a.hot),
        report::size(a.memory)
    );
    Ok(ProbeParams {
        threads: a.threads as usize,
        hot_pages: hot_pages as usize,
        interval_us: a.interval_us,
        seconds: a.seconds,
    })
}

fn run_uswap(a: &ProbeArgs, bytes: u64, params: &ProbeParams) -> Result<Report> {
    let cfg = a.core.config(a.memory)?;
    let region = Region::new(bytes, cfg).with_context(|| {
        format!(
            "creating a {} region with a {} memory limit",
            report::size(bytes),
            report::size(a.memory)
        )
    })?;
    let (outcome, before, after) = probe::run(region.mem(), params, || region.stats());
    let vmstat = after.vmstat.since(&before.vmstat);
    let swapped = (vmstat.pswpin, vmstat.pswpout);
    let detail = UswapDetail {
        vmstat,
        lockstat: report::lockstat_since(&after.lockstat, &before.lockstat),
        swap_cache: after.swap_cache.since(&before.swap_cache),
        stats: after,
    };
    Ok(build_report(a, outcome, swapped, Some(detail), None))
}

fn run_kernel(a: &ProbeArgs, bytes: u64, params: &ProbeParams) -> Result<Report> {
    let setup = kernel::Setup {
        memory_limit: Some(a.memory),
        swap: Some(kernel::SwapPlan {
            kind: a.kernel.kernel_swap,
            bytes: a.core.swap_size.unwrap_or(bytes + KERNEL_SWAP_MARGIN),
            dir: a.core.swap_dir(),
            own: false,
        }),
        tunables: a.kernel.tunables(&a.core, a.memory)?,
    };
    let spec = child::Spec::Probe {
        size: bytes,
        params: *params,
    };
    let (child_report, environment) = kernel::run(&setup, &spec)?;
    let child::Report::Probe { outcome, swap, lru } = child_report else {
        bail!("the kernel-backend child sent a report for another workload");
    };
    let detail = KernelDetail {
        environment,
        vmstat: lru,
    };
    let swapped = (swap.pswpin, swap.pswpout);
    Ok(build_report(a, outcome, swapped, None, Some(detail)))
}

fn build_report(
    a: &ProbeArgs,
    outcome: ProbeOutcome,
    (pswpin, pswpout): (u64, u64),
    uswap: Option<UswapDetail>,
    kernel: Option<KernelDetail>,
) -> Report {
    let secs = outcome.measured_s;
    Report {
        bench: "probe",
        backend: a.backend,
        size: a.size,
        hot: outcome.hot_pages * PAGE_SIZE as u64,
        memory: a.memory,
        threads: a.threads as usize,
        interval_us: a.interval_us,
        accesses_per_s: outcome.writes as f64 / secs,
        swap_in_mb_s: report::mb_per_s(pswpin, secs),
        swap_out_mb_s: report::mb_per_s(pswpout, secs),
        outcome,
        uswap,
        kernel,
    }
}

fn print(r: &Report) {
    let o = &r.outcome;
    let pace = match r.interval_us {
        0 => "probes back to back (flood)".to_string(),
        us => format!("a probe every {us} µs"),
    };
    println!(
        "uswap bench probe: backend {}, {} thrashed by {} writing thread(s), {} hot set, {} \
         memory, {pace}",
        r.backend,
        report::size(r.size),
        r.threads,
        report::size(r.hot),
        report::size(r.memory)
    );
    println!(
        "  time             setup (fill) {:.2} s   measured {:.2} s",
        o.setup_s, o.measured_s
    );
    println!(
        "  thrashers        {} writes  ({}/s)   swap in {:.1} MB/s   out {:.1} MB/s",
        report::count(o.writes),
        report::count(r.accesses_per_s as u64),
        r.swap_in_mb_s,
        r.swap_out_mb_s
    );
    print_rtt(r);
    if let Some(u) = &r.uswap {
        print_uswap(u);
    }
    if let Some(k) = &r.kernel {
        k.environment.print();
        println!("kernel LRU counters over the measured interval (machine-wide):");
        report::named_counters(&k.vmstat);
    }
}

/// The probe's times, as ping prints them, then percentiles.
fn print_rtt(r: &Report) {
    let t = &r.outcome.rtt;
    println!("--- probe statistics ---");
    println!(
        "{} probes, rtt min/avg/max/mdev = {:.3}/{:.3}/{:.3}/{:.3} us",
        t.probes, t.min_us, t.avg_us, t.max_us, t.mdev_us
    );
    println!(
        "p50 {:.3}  p99 {:.3}  p99.9 {:.3} us   verify errors {}",
        t.p50_us, t.p99_us, t.p999_us, r.outcome.verify_errors
    );
}

fn print_uswap(u: &UswapDetail) {
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
        "  swap cache  lookups {}  hits {}  readahead hits {}  adds {}  deletes {}",
        report::count(c.lookups),
        report::count(c.hits),
        report::count(c.readahead_hits),
        report::count(c.adds),
        report::count(c.deletes)
    );
    println!("uswap lock statistics over the measured interval:");
    report::lockstat(&u.lockstat);
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::kernel::KernelSwap;
    use clap::Parser;

    #[derive(Parser)]
    struct Cmd {
        #[command(flatten)]
        args: ProbeArgs,
    }

    fn parse(args: &[&str]) -> Result<ProbeArgs, clap::Error> {
        Cmd::try_parse_from(std::iter::once("probe").chain(args.iter().copied())).map(|c| c.args)
    }

    #[test]
    fn defaults_and_flood() {
        let a = parse(&[]).unwrap();
        assert_eq!(
            (a.size, a.memory, a.threads, a.hot, a.interval_us),
            (512 << 20, 256 << 20, 2, 1 << 20, 100)
        );
        assert_eq!((a.seconds, a.backend), (10.0, Backend::Uswap));
        let p = params(&a).unwrap();
        assert_eq!((p.hot_pages, p.threads, p.interval_us), (256, 2, 100));
        let a = parse(&[
            "--interval-us",
            "0",
            "--backend",
            "kernel",
            "--kernel-swap",
            "zram",
        ]);
        let a = a.unwrap();
        assert_eq!(
            (a.interval_us, a.backend, a.kernel.kernel_swap),
            (0, Backend::Kernel, KernelSwap::Zram)
        );
    }

    #[test]
    fn bad_values_are_refused() {
        assert!(parse(&["--threads", "0"]).is_err());
        assert!(parse(&["--hot", "0"]).is_err());
        assert!(parse(&["--interval-us", "-1"]).is_err());
        assert!(parse(&["--interval-us", "2000000"]).is_err());
        let small = parse(&["--hot", "100"]).unwrap();
        assert!(format!("{:#}", params(&small).unwrap_err()).contains("one page"));
        let big = parse(&["--hot", "200M", "--memory", "256M"]).unwrap();
        assert!(format!("{:#}", params(&big).unwrap_err()).contains("half of --memory"));
    }
}
