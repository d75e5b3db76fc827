//! `uswap bench fault`: first-touch faults per second, will-it-scale page_fault1 style.

use super::{no_reclaim_limit, Backend};
use crate::args::{nonzero_size, seconds, CoreArgs};
use crate::kernel::{self, child, Environment};
use crate::report;
use crate::workload::fault::{self, FaultOutcome, FaultParams};
use anyhow::{bail, ensure, Context, Result};
use clap::{value_parser, Args};
use serde::Serialize;
use std::sync::atomic::{AtomicU64, Ordering::Relaxed};
use uswap_core::{Region, PAGE_SIZE};

#[derive(Args, Debug)]
pub struct FaultArgs {
    /// Size of the region each thread maps, touches and drops per iteration
    #[arg(long, value_name = "SIZE", default_value = "128M", value_parser = nonzero_size)]
    pub size: u64,

    /// Faulting threads, each with its own regions
    #[arg(long, value_name = "N", default_value_t = 1, value_parser = value_parser!(u16).range(1..=1024))]
    pub threads: u16,

    /// How long to keep going
    #[arg(long, value_name = "S", default_value = "5", value_parser = seconds)]
    pub seconds: f64,

    /// Which swap runs the workload
    #[arg(long, value_enum, default_value_t = Backend::Uswap)]
    pub backend: Backend,

    /// Print one JSON object instead of a table
    #[arg(long)]
    pub json: bool,

    #[command(flatten)]
    pub core: CoreArgs,
}

#[derive(Serialize)]
struct Report {
    bench: &'static str,
    backend: Backend,
    size: u64,
    threads: usize,
    /// Pages first-touched per second, counting only the time spent touching.
    faults_per_s: f64,
    #[serde(flatten)]
    outcome: FaultOutcome,
    /// How memory was limited, so the run measures fault cost and nothing else.
    memory: String,
    #[serde(skip_serializing_if = "Option::is_none")]
    uswap: Option<UswapDetail>,
    #[serde(skip_serializing_if = "Option::is_none")]
    kernel: Option<Environment>,
}

#[derive(Serialize)]
struct UswapDetail {
    /// userfaultfd faults handled: fewer than pages touched when fault-around maps several.
    fault_events: u64,
    zero_filled_pages: u64,
}

pub fn run(a: &FaultArgs) -> Result<()> {
    ensure!(
        a.size >= PAGE_SIZE as u64,
        "--size {} is smaller than one page (4 KiB)",
        a.size
    );
    let params = FaultParams {
        threads: a.threads as usize,
        seconds: a.seconds,
    };
    let r = match a.backend {
        Backend::Uswap => run_uswap(a, &params)?,
        Backend::Kernel => run_kernel(a, &params)?,
    };
    if a.json {
        report::json(&r)
    } else {
        print(&r);
        Ok(())
    }
}

fn run_uswap(a: &FaultArgs, params: &FaultParams) -> Result<Report> {
    let limit = no_reclaim_limit(a.size);
    let cfg = a.core.config(limit)?;
    let (events, zero_filled) = (AtomicU64::new(0), AtomicU64::new(0));
    let outcome = fault::run(
        params,
        || {
            Region::new(a.size, cfg.clone())
                .with_context(|| format!("creating a {} region", report::size(a.size)))
        },
        |region| {
            let v = region.stats().vmstat;
            events.fetch_add(v.pgfault, Relaxed);
            zero_filled.fetch_add(v.pgzerofill, Relaxed);
        },
    )?;
    Ok(Report {
        bench: "fault",
        backend: Backend::Uswap,
        size: a.size,
        threads: params.threads,
        faults_per_s: outcome.touch_pages_per_s,
        outcome,
        memory: format!(
            "each region's limit is {}: reclaim never runs",
            report::size(limit)
        ),
        uswap: Some(UswapDetail {
            fault_events: events.into_inner(),
            zero_filled_pages: zero_filled.into_inner(),
        }),
        kernel: None,
    })
}

fn run_kernel(a: &FaultArgs, params: &FaultParams) -> Result<Report> {
    let setup = kernel::Setup {
        memory_limit: None,
        swap: None,
        tunables: Vec::new(),
    };
    let spec = child::Spec::Fault {
        size: a.size,
        params: *params,
    };
    let (child_report, env) = kernel::run(&setup, &spec)?;
    let child::Report::Fault { outcome } = child_report else {
        bail!("the kernel-backend child sent a report for another workload");
    };
    Ok(Report {
        bench: "fault",
        backend: Backend::Kernel,
        size: a.size,
        threads: params.threads,
        faults_per_s: outcome.touch_pages_per_s,
        outcome,
        memory: "memory cgroup with no limit: no swapping, fault cost only".to_string(),
        uswap: None,
        kernel: Some(env),
    })
}

fn print(r: &Report) {
    let o = &r.outcome;
    println!(
        "uswap bench fault: backend {}, {} per region, {} thread(s), {:.1} s",
        r.backend,
        report::size(r.size),
        r.threads,
        o.wall_s
    );
    println!(
        "  first-touch faults/s   {}  (pages touched per second of touching)",
        report::count(r.faults_per_s as u64)
    );
    println!(
        "  with create + drop     {}/s",
        report::count(o.total_pages_per_s as u64)
    );
    println!(
        "  pages touched          {}  in {} regions",
        report::count(o.pages_touched),
        report::count(o.iterations)
    );
    if let Some(u) = &r.uswap {
        println!(
            "  uffd faults handled    {}  ({:.1} pages each; zero-filled {})",
            report::count(u.fault_events),
            o.pages_touched as f64 / u.fault_events.max(1) as f64,
            report::count(u.zero_filled_pages)
        );
    }
    println!("  memory                 {}", r.memory);
    if let Some(k) = &r.kernel {
        println!("  kernel                 cgroup {}", k.cgroup);
    }
}
