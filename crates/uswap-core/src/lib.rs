//! uswap: user-space swap on userfaultfd.
//!
//! A [`Region`] is anonymous memory that may be larger than the memory it is allowed to keep
//! resident. Cold pages go to a swap file and come back on access. Modules are named after
//! the kernel parts they mirror; see `docs/architecture.md` for the map.

mod assembly;
mod breakdown;
mod budget;
pub mod config;
pub mod control;
pub mod cpu;
pub mod error;
mod fault;
pub mod fork;
mod fork_image;
mod gup;
mod handler;
mod list;
mod lockdep;
pub mod lockstat;
mod lru;
mod mapping;
pub mod memcg;
mod mm;
mod mmap_changing;
mod page;
mod readahead;
mod region;
pub mod run;
mod sigbus;
mod signals;
mod staging;
pub mod stats;
mod sud;
mod sync;
mod syscall_args;
pub mod syscall_direct;
pub mod syscall_dispatch;
pub mod uffd;
mod vma;
mod vmscan;
mod walker;
mod workingset;

pub use breakdown::{PhaseSummary, PhaseTimes};
pub use budget::StockStats;
pub use config::{
    parse_size, Compressor, Config, FaultMode, FaultPlan, IoMode, LruLockMode, LruPolicy,
    Readahead, ReadaheadPolicy, References, SlotAlloc, SwapCacheMode, SwapConfig, SwapEncryption,
    SwapLocation, Watermarks, Ztier, ZtierSize,
};
pub use error::{Error, Result};
pub use lockstat::{LockClass, LockStat};
pub use mapping::Mapping;
pub use region::{metadata_bytes, Advice, Region, SwapoffReport};
pub use sigbus::in_sigbus_handler;
pub use signals::{spawn_quiet, Quiet};
pub use stats::{Latency, LruStats, Stats, VmStatSnapshot};
pub use swapfile::swap_state::SwapCacheStats;
pub use swapfile::{Backing, IoStats, ZtierStats};
pub use uffd::{probe, Probe};

/// The page size uswap is built for, and the one place it is written down. Regions check
/// the kernel's own page size (`sysconf(_SC_PAGESIZE)`) against it when they are made and
/// refuse, with [`Error::UnsupportedPageSize`], to run on a kernel with other pages (arm64
/// with 16 or 64 KiB pages, for example).
pub const PAGE_SIZE: usize = 4096;

/// The largest memory limit a region can have, in bytes (its resident pages are numbered
/// in 25 bits of the page state word).
pub const MAX_MEMORY: u64 = page::MAX_FRAMES * PAGE_SIZE as u64;
pub mod swapfile;
