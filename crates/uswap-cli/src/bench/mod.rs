//! The benchmark commands.

pub mod fault;
pub mod probe;
pub mod random;
pub mod refault;
pub mod run;
pub mod run_report;
pub mod swapback;

pub use crate::args::Backend;
use crate::report;
use anyhow::{ensure, Result};
use serde::Serialize;
use uswap_core::PAGE_SIZE;

/// The pages of a `--size` the workloads can address: at least one, and few enough for the
/// page header's 32-bit page number.
pub fn set_pages(size: u64) -> Result<u64> {
    let pages = size / PAGE_SIZE as u64;
    ensure!(pages >= 1, "--size {size} is smaller than one page (4 KiB)");
    ensure!(
        pages <= u32::MAX as u64,
        "--size {} is too large: at most 16 TiB",
        report::size(size)
    );
    Ok(pages)
}

/// Prints a report as JSON or as a table (`print`).
pub fn emit<R: Serialize>(r: &R, json: bool, print: impl Fn(&R)) -> Result<()> {
    if json {
        report::json(r)
    } else {
        print(r);
        Ok(())
    }
}

/// Extra swap beyond the set size for the kernel backend's swap file or zram device.
pub const KERNEL_SWAP_MARGIN: u64 = 64 << 20;

/// A memory limit with enough room above `bytes` that reclaim never wakes (the default high
/// watermark is about 1.2% of the limit), for benchmarks of fault cost alone.
pub fn no_reclaim_limit(bytes: u64) -> u64 {
    bytes + bytes / 16 + (1 << 20)
}

impl std::fmt::Display for Backend {
    fn fmt(&self, f: &mut std::fmt::Formatter) -> std::fmt::Result {
        f.write_str(match self {
            Backend::Uswap => "uswap",
            Backend::Kernel => "kernel",
        })
    }
}
