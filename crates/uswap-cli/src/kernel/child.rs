//! The child process of the kernel backend (`uswap __kernel-child SPEC`).
//!
//! It waits for one byte on stdin before allocating anything, so that the parent can first
//! move it into the memory cgroup; then it runs the workload on plain anonymous memory and
//! prints its report as one JSON line on stdout. A workload that needs the parent to act
//! midway (swapback's swapoff mode) prints [`PAUSE`] and waits for another byte.

use super::vmstat::{self, SwapCounters};
use crate::workload::fault::{self, FaultOutcome, FaultParams};
use crate::workload::mem::{AnonMap, Mapped};
use crate::workload::probe::{self, ProbeOutcome, ProbeParams};
use crate::workload::random::{self, RandomOutcome, RandomParams};
use crate::workload::swapback::{self, SwapbackOutcome, SwapbackParams};
use anyhow::{Context, Result};
use serde::{Deserialize, Serialize};
use std::io::Read;

/// The hidden subcommand name.
pub const SUBCOMMAND: &str = "__kernel-child";

/// The line the child prints when it waits for the parent to act.
pub const PAUSE: &str = "paused";

/// What the child is to run.
#[derive(Clone, Debug, Serialize, Deserialize, PartialEq)]
#[serde(tag = "workload", rename_all = "lowercase")]
pub enum Spec {
    Random {
        size: u64,
        params: RandomParams,
    },
    Fault {
        size: u64,
        params: FaultParams,
    },
    Swapback {
        size: u64,
        params: SwapbackParams,
    },
    /// `size`: the whole mapping, hot set and thrashed set.
    Probe {
        size: u64,
        params: ProbeParams,
    },
}

/// What the child measured.
#[derive(Debug, Serialize, Deserialize)]
#[serde(tag = "workload", rename_all = "lowercase")]
pub enum Report {
    Random {
        outcome: RandomOutcome,
        /// Swap counters over the measured interval.
        swap: SwapCounters,
        /// Fault path and reclaim counters of /proc/vmstat over the measured interval.
        vm: vmstat::Named,
    },
    Fault {
        outcome: FaultOutcome,
    },
    Swapback {
        outcome: SwapbackOutcome,
        /// Swap counters over the swap-back phase.
        swap: SwapCounters,
    },
    Probe {
        outcome: ProbeOutcome,
        /// Swap counters over the measured interval.
        swap: SwapCounters,
        /// LRU counters of /proc/vmstat over the measured interval.
        lru: vmstat::Named,
    },
}

/// The arguments that make the uswap binary run `spec` as the child.
pub fn command_args(spec: &Spec) -> Vec<String> {
    let json = serde_json::to_string(spec).expect("a spec always serializes");
    vec![SUBCOMMAND.to_string(), json]
}

pub fn main(spec_json: &str) -> Result<()> {
    let spec: Spec = serde_json::from_str(spec_json).context("reading the workload spec")?;
    wait_for_parent().context("waiting for the parent to start the workload")?;
    let report = run(spec)?;
    println!("{}", serde_json::to_string(&report)?);
    Ok(())
}

fn wait_for_parent() -> std::io::Result<()> {
    let mut go = [0u8; 1];
    std::io::stdin().read_exact(&mut go)
}

/// Lets the parent act (stdout is line-buffered, so the line goes out at once).
fn pause() -> Result<()> {
    println!("{PAUSE}");
    wait_for_parent().context("waiting for the parent to go on")
}

fn anon(size: u64) -> Result<AnonMap> {
    AnonMap::new(size as usize).with_context(|| format!("mapping {size} bytes of anonymous memory"))
}

fn run(spec: Spec) -> Result<Report> {
    match spec {
        Spec::Random { size, params } => {
            let map = anon(size)?;
            let read = || counters(&vmstat::FAULT_PATH);
            let (outcome, before, after) = random::run(map.mem(), &params, read);
            let (swap, vm) = counters_since(after, before)?;
            Ok(Report::Random { outcome, swap, vm })
        }
        Spec::Fault { size, params } => {
            let outcome = fault::run(&params, || anon(size), drop)?;
            Ok(Report::Fault { outcome })
        }
        Spec::Swapback { size, params } => {
            let map = anon(size)?;
            let (outcome, before, after) = swapback::run(map.mem(), &params, vmstat::read, pause)?;
            let swap = after?.since(&before?);
            Ok(Report::Swapback { outcome, swap })
        }
        Spec::Probe { size, params } => {
            let map = anon(size)?;
            let read = || counters(&vmstat::LRU);
            let (outcome, before, after) = probe::run(map.mem(), &params, read);
            let (swap, lru) = counters_since(after, before)?;
            Ok(Report::Probe { outcome, swap, lru })
        }
    }
}

/// Swap counters and the /proc/vmstat counters of `names`, read together.
fn counters(names: &[&str]) -> Result<(SwapCounters, vmstat::Named)> {
    Ok((vmstat::read()?, vmstat::read_named(names)?))
}

/// What [`counters`] moved between two reads.
fn counters_since(
    after: Result<(SwapCounters, vmstat::Named)>,
    before: Result<(SwapCounters, vmstat::Named)>,
) -> Result<(SwapCounters, vmstat::Named)> {
    let ((swap_after, named_after), (swap_before, named_before)) = (after?, before?);
    Ok((
        swap_after.since(&swap_before),
        vmstat::named_since(&named_after, &named_before),
    ))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_spec_travels_as_one_argument_and_comes_back_equal() {
        let spec = Spec::Random {
            size: 8 << 20,
            params: RandomParams {
                threads: 3,
                write_pct: 20,
                seconds: 1.5,
                syscall_dispatch: false,
                distribution: crate::workload::distribution::Distribution::Hot {
                    pct: 90,
                    of_pct: 10,
                },
                scan_every: 50_000,
                data: crate::workload::pattern::Data::Compressible(3),
            },
        };
        let args = command_args(&spec);
        assert_eq!(args.len(), 2);
        assert_eq!(args[0], "__kernel-child");
        assert!(args[1].contains(r#""workload":"random""#), "{}", args[1]);
        assert_eq!(serde_json::from_str::<Spec>(&args[1]).unwrap(), spec);
    }

    #[test]
    fn a_probe_run_on_plain_memory_reports_probes_and_counters() {
        let spec = Spec::Probe {
            size: 32 * uswap_core::PAGE_SIZE as u64,
            params: ProbeParams {
                threads: 1,
                hot_pages: 2,
                interval_us: 0,
                seconds: 0.01,
            },
        };
        let json = serde_json::to_string(&run(spec).unwrap()).unwrap();
        let Report::Probe { outcome, lru, .. } = serde_json::from_str(&json).unwrap() else {
            panic!("wrong report kind");
        };
        assert!(outcome.rtt.probes > 0 && outcome.writes > 0);
        assert!(lru.contains_key("pgdeactivate"), "{lru:?}");
    }

    #[test]
    fn a_fault_run_on_plain_memory_reports_pages() {
        let spec = Spec::Fault {
            size: 1 << 20,
            params: FaultParams {
                threads: 1,
                seconds: 0.01,
            },
        };
        let Report::Fault { outcome } = run(spec).unwrap() else {
            panic!("wrong report kind");
        };
        assert_eq!(outcome.pages_touched % 256, 0);
        assert!(outcome.pages_touched > 0);
    }
}
