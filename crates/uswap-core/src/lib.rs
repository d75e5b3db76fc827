//! uswap: user-space swap on userfaultfd.
//!
//! A [`Region`] is anonymous memory that may be larger than the memory it is allowed to keep
//! resident. Cold pages go to a swap file and come back on access. Modules are named after
//! the kernel parts they mirror; see `docs/architecture.md` for the map.

pub mod config;
pub mod cpu;
pub mod error;
mod fault;
mod handler;
mod lru;
mod page;
mod page_alloc;
mod region;
mod sigbus;
pub mod stats;
mod sync;
pub mod uffd;
mod vmscan;

pub use config::{parse_size, Config, FaultMode, IoMode, SwapConfig, SwapLocation, Watermarks};
pub use error::{Error, Result};
pub use region::{Advice, Region};
pub use stats::{Latency, Stats, VmStatSnapshot};
pub use uffd::{probe, Probe};

/// The base page size uswap manages (x86-64 and arm64 4 KiB kernels).
pub const PAGE_SIZE: usize = 4096;
pub mod swap_io;
pub mod swapfile;
