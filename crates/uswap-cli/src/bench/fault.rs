//! `uswap bench fault`: first-touch faults per second, will-it-scale page_fault1 style.
//! With `--region per-thread` each thread maps, touches and drops regions of its own (no
//! shared uswap state but the swap-free budget); with `--region shared` the threads share
//! one region, as a process's threads share its heap: each touches its slice and discards
//! it with `MADV_DONTNEED`, so every fault and discard meets the others on the region's
//! LRU lists (seed 001).

use super::{no_reclaim_limit, Backend};
use crate::args::{nonzero_size, seconds, CoreArgs};
use crate::kernel::{self, child, Environment};
use crate::report;
use crate::workload::fault::{self, FaultOutcome, FaultParams};
use crate::workload::mem::{Mapped, Mem};
use anyhow::{bail, ensure, Context, Result};
use clap::{value_parser, Args, ValueEnum};
use serde::Serialize;
use std::sync::atomic::{AtomicU64, Ordering::Relaxed};
use std::sync::Mutex;
use uswap_core::{LockClass, Region, PAGE_SIZE};

/// Where the faulting threads' memory lives (uswap backend).
#[derive(Clone, Copy, Debug, PartialEq, Eq, ValueEnum, Serialize)]
#[serde(rename_all = "kebab-case")]
pub enum Layout {
    /// Each thread maps and drops regions of its own
    PerThread,
    /// One region for all threads; each touches its slice, then MADV_DONTNEEDs it
    Shared,
}

#[derive(Args, Debug)]
pub struct FaultArgs {
    /// Memory each thread maps (or, shared, its slice), touches and drops per iteration
    #[arg(long, value_name = "SIZE", default_value = "128M", value_parser = nonzero_size)]
    pub size: u64,

    /// Faulting threads
    #[arg(long, value_name = "N", default_value_t = 1, value_parser = value_parser!(u16).range(1..=1024))]
    pub threads: u16,

    /// uswap backend: regions per thread, or one region shared by the threads
    #[arg(long, value_enum, default_value_t = Layout::PerThread)]
    pub region: Layout,

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
    region: Layout,
    /// userfaultfd faults handled: fewer than pages touched when fault-around maps several.
    fault_events: u64,
    zero_filled_pages: u64,
    /// Lock statistics of the shared region (empty with regions per thread).
    lockstat: Vec<LockClass>,
}

/// One thread's slice of the shared region.
struct Slice {
    mem: Mem,
    index: usize,
}

impl Mapped for Slice {
    fn mem(&self) -> Mem {
        self.mem
    }
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
    match a.region {
        Layout::PerThread => run_uswap_per_thread(a, params),
        Layout::Shared => run_uswap_shared(a, params),
    }
}

fn run_uswap_shared(a: &FaultArgs, params: &FaultParams) -> Result<Report> {
    let total = a
        .size
        .checked_mul(params.threads as u64)
        .context("--size × --threads overflows")?;
    let limit = no_reclaim_limit(total);
    let region = Region::new(total, a.core.config(limit)?)
        .with_context(|| format!("creating a {} region", report::size(total)))?;
    let free = Mutex::new((0..params.threads).collect::<Vec<_>>());
    let before = region.stats();
    let outcome = fault::run(
        params,
        || {
            let index = free.lock().unwrap().pop().context("a slice per thread")?;
            let offset = index * a.size as usize;
            // SAFETY: the slice lies inside the region, which outlives the run.
            let mem = unsafe { Mem::new(region.as_ptr().add(offset), a.size as usize) };
            Ok(Slice { mem, index })
        },
        |slice| {
            let start = slice.mem.page(0).as_ptr() as *mut libc::c_void;
            // SAFETY: the thread's own slice of the region; it reads as zeros afterwards.
            let rc = unsafe { libc::madvise(start, a.size as usize, libc::MADV_DONTNEED) };
            assert_eq!(rc, 0, "madvise: {}", std::io::Error::last_os_error());
            free.lock().unwrap().push(slice.index);
        },
    )?;
    let after = region.stats();
    let memory = format!(
        "one {} region, limit {}: reclaim never runs",
        report::size(total),
        report::size(limit)
    );
    let detail = UswapDetail {
        region: Layout::Shared,
        fault_events: after.vmstat.pgfault - before.vmstat.pgfault,
        zero_filled_pages: after.vmstat.pgzerofill - before.vmstat.pgzerofill,
        lockstat: report::lockstat_since(&after.lockstat, &before.lockstat),
    };
    Ok(uswap_report(a, outcome, memory, detail))
}

fn uswap_report(a: &FaultArgs, outcome: FaultOutcome, memory: String, d: UswapDetail) -> Report {
    Report {
        bench: "fault",
        backend: Backend::Uswap,
        size: a.size,
        threads: a.threads as usize,
        faults_per_s: outcome.touch_pages_per_s,
        outcome,
        memory,
        uswap: Some(d),
        kernel: None,
    }
}

fn run_uswap_per_thread(a: &FaultArgs, params: &FaultParams) -> Result<Report> {
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
    let memory = format!(
        "each region's limit is {}: reclaim never runs",
        report::size(limit)
    );
    let detail = UswapDetail {
        region: Layout::PerThread,
        fault_events: events.into_inner(),
        zero_filled_pages: zero_filled.into_inner(),
        lockstat: Vec::new(),
    };
    Ok(uswap_report(a, outcome, memory, detail))
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
        "uswap bench fault: backend {}, {} per thread{}, {} thread(s), {:.1} s",
        r.backend,
        report::size(r.size),
        match &r.uswap {
            Some(u) if u.region == Layout::Shared => " (one shared region)",
            _ => "",
        },
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
        "  pages touched          {}  in {} iterations",
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
        if !u.lockstat.is_empty() {
            report::lockstat(&u.lockstat);
        }
    }
    println!("  memory                 {}", r.memory);
    if let Some(k) = &r.kernel {
        println!("  kernel                 cgroup {}", k.cgroup);
    }
}
