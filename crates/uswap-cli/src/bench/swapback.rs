//! `uswap bench swapback`: how fast swapped-out memory comes back (seed 002's experiment).
//!
//! A set about twice the memory limit is filled in address order, so that its older half is
//! swapped out; then all of it is brought back, by touching every page (in address order or
//! at random) or by lifting the limit and turning swap off, and only that phase is timed.

use super::{no_reclaim_limit, Backend, KERNEL_SWAP_MARGIN};
use crate::args::{nonzero_size, CoreArgs, KernelArgs};
use crate::kernel::{self, child, Environment};
use crate::report;
use crate::workload::mem::Mapped;
use crate::workload::swapback::{self, Mode, Order, SwapbackOutcome, SwapbackParams};
use anyhow::{bail, ensure, Context, Result};
use clap::{Args, ValueEnum};
use serde::Serialize;
use uswap_core::{Region, SwapCacheStats, SwapoffReport, VmStatSnapshot};

#[derive(Args, Debug)]
pub struct SwapbackArgs {
    /// Size of the set filled and brought back (about twice --memory, so that about half
    /// is swapped out)
    #[arg(long, value_name = "SIZE", default_value = "512M", value_parser = nonzero_size)]
    pub size: u64,

    /// Memory the set may keep resident while it is filled (uswap's limit; the kernel
    /// backend's cgroup limit)
    #[arg(long, value_name = "SIZE", default_value = "256M", value_parser = nonzero_size)]
    pub memory: u64,

    /// How the set is brought back
    #[arg(long, value_enum, default_value_t = Mode::Touch)]
    pub mode: Mode,

    /// The order touch mode reads the pages in
    #[arg(long, value_enum, default_value_t = Order::Seq)]
    pub order: Order,

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
    size: u64,
    memory: u64,
    mode: Mode,
    order: Order,
    /// The readahead in effect, as `--readahead` names it.
    readahead: String,
    /// Pages read from swap during the swap-back phase.
    pages_back: u64,
    pages_per_s: f64,
    mb_per_s: f64,
    /// Pages written to swap during the phase (touch mode evicts as it goes).
    pages_out: u64,
    /// Faults that waited for swap during the phase (swapoff reads pages without faults).
    major_faults: u64,
    verify_errors: u64,
    #[serde(flatten)]
    outcome: SwapbackOutcome,
    #[serde(skip_serializing_if = "Option::is_none")]
    uswap: Option<UswapDetail>,
    #[serde(skip_serializing_if = "Option::is_none")]
    kernel: Option<Environment>,
}

#[derive(Serialize)]
struct UswapDetail {
    /// The region's counters over the swap-back phase.
    vmstat: VmStatSnapshot,
    /// The swap cache's counters over the phase.
    swap_cache: SwapCacheStats,
    /// What the region's swapoff reported, in swapoff mode.
    #[serde(skip_serializing_if = "Option::is_none")]
    swapoff: Option<SwapoffReport>,
}

/// Swap counters of the phase: (pages read, pages written, major faults).
type PhaseCounts = (u64, u64, u64);

pub fn run(a: &SwapbackArgs) -> Result<()> {
    super::set_pages(a.size)?;
    ensure!(
        a.memory < a.size,
        "--memory {} is not below --size {}: nothing would be swapped out (use about half \
         the size)",
        report::size(a.memory),
        report::size(a.size)
    );
    let params = SwapbackParams {
        mode: a.mode,
        order: a.order,
    };
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

fn run_uswap(a: &SwapbackArgs, params: &SwapbackParams) -> Result<Report> {
    let cfg = a.core.config(a.memory)?;
    let region = Region::new(a.size, cfg).with_context(|| {
        format!(
            "creating a {} region with a {} memory limit",
            report::size(a.size),
            report::size(a.memory)
        )
    })?;
    // As the region chose it (`auto` names the policy it picked for the device).
    let chosen = region.readahead();
    let readahead = format!("{}, page-cluster {}", chosen.policy, chosen.page_cluster);
    let mut swapoff = None;
    let (outcome, before, after) = swapback::run(
        region.mem(),
        params,
        || region.stats(),
        || {
            swapoff = Some(lift_limit_and_swapoff(&region, a.size)?);
            Ok(())
        },
    )?;
    let vmstat = after.vmstat.since(&before.vmstat);
    let counts = (vmstat.pswpin, vmstat.pswpout, vmstat.pgmajfault);
    let detail = UswapDetail {
        vmstat,
        swap_cache: after.swap_cache.since(&before.swap_cache),
        swapoff,
    };
    Ok(build_report(
        a,
        readahead,
        outcome,
        counts,
        Some(detail),
        None,
    ))
}

/// Swapoff mode on uswap: a limit that holds the whole set, then the region's swapoff.
fn lift_limit_and_swapoff(region: &Region, size: u64) -> Result<SwapoffReport> {
    region
        .set_memory_limit(no_reclaim_limit(size))
        .context("raising the memory limit to hold the whole set")?;
    let mut progress = report::Progress::new("swapoff");
    let done = region
        .swapoff(&mut |done, total| progress.update(done, total))
        .context("swapoff");
    progress.finish();
    let done = done?;
    // A lost page's access fails (SIGBUS): the check afterwards must not touch it.
    ensure!(
        done.lost == 0,
        "swapoff could not read back {} pages (reported above)",
        done.lost
    );
    Ok(done)
}

fn run_kernel(a: &SwapbackArgs, params: &SwapbackParams) -> Result<Report> {
    let setup = kernel::Setup {
        memory_limit: Some(a.memory),
        swap: Some(kernel::SwapPlan {
            kind: a.kernel.kernel_swap,
            bytes: a.core.swap_size.unwrap_or(a.size + KERNEL_SWAP_MARGIN),
            dir: a.core.swap_dir(),
            own: a.mode == Mode::Swapoff,
        }),
        tunables: a.kernel.tunables(&a.core, a.memory)?,
    };
    let spec = child::Spec::Swapback {
        size: a.size,
        params: *params,
    };
    let (child_report, env) = kernel::run_paused(&setup, &spec, kernel::lift_limit_and_swapoff)?;
    let child::Report::Swapback { outcome, swap } = child_report else {
        bail!("the kernel-backend child sent a report for another workload");
    };
    let readahead = env
        .readahead()
        .context("the kernel's readahead settings were not read")?;
    let counts = (swap.pswpin, swap.pswpout, swap.pgmajfault);
    Ok(build_report(a, readahead, outcome, counts, None, Some(env)))
}

fn build_report(
    a: &SwapbackArgs,
    readahead: String,
    outcome: SwapbackOutcome,
    (pages_back, pages_out, major_faults): PhaseCounts,
    uswap: Option<UswapDetail>,
    kernel: Option<Environment>,
) -> Report {
    let secs = outcome.swapback_s;
    Report {
        bench: "swapback",
        backend: a.backend,
        size: a.size,
        memory: a.memory,
        mode: a.mode,
        order: a.order,
        readahead,
        pages_back,
        pages_per_s: pages_back as f64 / secs,
        mb_per_s: report::mb_per_s(pages_back, secs),
        pages_out,
        major_faults,
        verify_errors: outcome.verify_errors(),
        outcome,
        uswap,
        kernel,
    }
}

/// A choice as it is written on the command line.
fn name(choice: impl ValueEnum) -> String {
    choice
        .to_possible_value()
        .map_or_else(String::new, |v| v.get_name().to_string())
}

fn print(r: &Report) {
    let o = &r.outcome;
    let order = match r.mode {
        Mode::Touch => format!(", order {}", name(r.order)),
        Mode::Swapoff => String::new(),
    };
    println!(
        "uswap bench swapback: backend {}, {} set, {} memory, mode {}{order}",
        r.backend,
        report::size(r.size),
        report::size(r.memory),
        name(r.mode)
    );
    println!("  readahead        {}", r.readahead);
    println!(
        "  fill             {:.2} s  ({} pages, in address order)",
        o.fill_s,
        report::count(o.pages)
    );
    println!(
        "  swap-back        {:.3} s   {} pages read from swap   {}/s   {:.1} MB/s",
        o.swapback_s,
        report::count(r.pages_back),
        report::count(r.pages_per_s as u64),
        r.mb_per_s
    );
    println!(
        "  meanwhile        major faults {}   pages swapped out {}",
        report::count(r.major_faults),
        report::count(r.pages_out)
    );
    println!(
        "  afterwards       resident {} of {} pages   check {:.2} s   verify errors {}",
        report::count(o.resident_after),
        report::count(o.pages),
        o.verify_s,
        r.verify_errors
    );
    if let Some(u) = &r.uswap {
        if let Some(off) = &u.swapoff {
            println!(
                "uswap swapoff: {} pages brought back in {:.3} s, {} slots freed",
                report::count(off.pages),
                off.seconds,
                report::count(off.slots_freed)
            );
        }
        let c = &u.swap_cache;
        println!(
            "uswap swap cache: lookups {}   hits {}   readahead hits {}   added {}",
            report::count(c.lookups),
            report::count(c.hits),
            report::count(c.readahead_hits),
            report::count(c.adds)
        );
        println!("uswap counters over the swap-back phase:");
        report::vmstat(&u.vmstat);
    }
    if let Some(k) = &r.kernel {
        k.print();
    }
}
