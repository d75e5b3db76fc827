//! The benchmark commands.

pub mod fault;
pub mod random;
pub mod refault;
pub mod swapback;

use clap::ValueEnum;
use serde::Serialize;

/// Which swap runs the workload.
#[derive(Clone, Copy, Debug, PartialEq, Eq, ValueEnum, Serialize)]
#[serde(rename_all = "lowercase")]
pub enum Backend {
    /// uswap, in this process
    Uswap,
    /// The kernel's own swap, in a child process inside a memory cgroup (needs root)
    Kernel,
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
