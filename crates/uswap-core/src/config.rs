//! Configuration of a region and its swap device, with validation.
//!
//! Every value is checked in [`Config::validate`]; a bad value gives an error that names the
//! setting, the value and the accepted range.

use crate::error::{Error, Result};
use crate::PAGE_SIZE;
use std::path::PathBuf;
use std::str::FromStr;

/// Largest size uswap accepts for a region, a memory limit or a swap device: 64 TiB, well
/// inside the 128 TiB user address space of x86-64 and arm64.
pub const MAX_SIZE: u64 = 64 << 40;

/// Smallest memory limit: reclaim needs room for a batch plus the watermarks.
pub const MIN_MEMORY_PAGES: u64 = 16;

/// Parses a byte size such as `4096`, `64K`, `16M`, `2G`, `1T` (also `2GiB`, `2gb`).
/// Suffixes are binary (K = 1024).
pub fn parse_size(text: &str) -> Result<u64> {
    let t = text.trim();
    let bad = |why: &str| {
        Error::invalid(
            "size",
            format!("{text:?}: {why} (examples: 4096, 64K, 512M, 2G)"),
        )
    };
    let digits_end = t.find(|c: char| !c.is_ascii_digit()).unwrap_or(t.len());
    if digits_end == 0 {
        return Err(bad("expected a number"));
    }
    let number: u64 = t[..digits_end]
        .parse()
        .map_err(|_| bad("number too large"))?;
    let suffix = t[digits_end..].trim().to_ascii_lowercase();
    let shift = match suffix.trim_end_matches("ib").trim_end_matches('b') {
        "" => 0,
        "k" => 10,
        "m" => 20,
        "g" => 30,
        "t" => 40,
        _ => return Err(bad("unknown suffix; use K, M, G or T")),
    };
    number
        .checked_mul(1u64 << shift)
        .ok_or_else(|| bad("size overflows 64 bits"))
}

/// How faults reach uswap.
#[derive(Clone, Copy, Debug, PartialEq, Eq, serde::Serialize)]
#[serde(rename_all = "lowercase")]
pub enum FaultMode {
    /// Handler threads read fault events from the userfaultfd. Correct for every access,
    /// including the kernel's own (a `read()` system call into a swapped-out page).
    Thread,
    /// The faulting thread gets SIGBUS and resolves its own fault: fewer context switches,
    /// but a kernel access to a missing page fails with EFAULT. Opt-in.
    Sigbus,
}

impl FromStr for FaultMode {
    type Err = Error;
    fn from_str(s: &str) -> Result<Self> {
        match s {
            "thread" => Ok(FaultMode::Thread),
            "sigbus" => Ok(FaultMode::Sigbus),
            _ => Err(Error::invalid(
                "fault mode",
                format!("{s:?}: use `thread` or `sigbus`"),
            )),
        }
    }
}

/// How swap I/O is issued.
#[derive(Clone, Copy, Debug, PartialEq, Eq, serde::Serialize)]
#[serde(rename_all = "lowercase")]
pub enum IoMode {
    /// io_uring, falling back to pread/pwrite when the kernel refuses io_uring.
    Uring,
    /// Plain pread/pwrite.
    Pread,
}

impl FromStr for IoMode {
    type Err = Error;
    fn from_str(s: &str) -> Result<Self> {
        match s {
            "uring" | "io_uring" => Ok(IoMode::Uring),
            "pread" => Ok(IoMode::Pread),
            _ => Err(Error::invalid(
                "I/O mode",
                format!("{s:?}: use `uring` or `pread`"),
            )),
        }
    }
}

/// Where the swap file lives.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum SwapLocation {
    /// An unlinked `O_TMPFILE` (mode 0600) in this directory: nothing is left behind.
    TempIn(PathBuf),
    /// A named file, created (mode 0600) or truncated; removed when the device is dropped.
    File(PathBuf),
}

impl Default for SwapLocation {
    fn default() -> Self {
        SwapLocation::TempIn(std::env::temp_dir())
    }
}

/// The swap device: where, how big, how I/O is done.
#[derive(Clone, Debug)]
pub struct SwapConfig {
    pub location: SwapLocation,
    /// Fixed size in bytes; `None` grows the file on demand (bounded by the free space of
    /// its file system, checked when a region is created).
    pub size: Option<u64>,
    pub io: IoMode,
}

impl Default for SwapConfig {
    fn default() -> Self {
        SwapConfig {
            location: SwapLocation::default(),
            size: None,
            io: IoMode::Uring,
        }
    }
}

/// Free-page watermarks of the resident budget, in pages, as in the kernel's zone
/// watermarks: below `low` the background reclaimer wakes and works until `high`; a fault
/// that finds fewer than `min` free pages reclaims directly.
#[derive(Clone, Copy, Debug, PartialEq, Eq, serde::Serialize)]
pub struct Watermarks {
    pub min: u64,
    pub low: u64,
    pub high: u64,
}

impl Watermarks {
    /// Defaults scaled to the memory limit (about 0.4%, 0.8%, 1.2%), with floors so small
    /// limits still reclaim in whole batches, and at most a quarter of the limit.
    pub fn for_limit(limit_pages: u64) -> Self {
        let cap = limit_pages / 4;
        Watermarks {
            min: (limit_pages / 256).max(4).min(cap),
            low: (limit_pages / 128).max(8).min(cap),
            high: (limit_pages * 3 / 256).max(12).min(cap),
        }
    }

    /// Parses `MIN,LOW,HIGH` as sizes (`4M,8M,12M`) and converts them to pages.
    pub fn parse(text: &str) -> Result<Self> {
        let parts: Vec<&str> = text.split(',').collect();
        if parts.len() != 3 {
            return Err(Error::invalid(
                "watermarks",
                format!("{text:?}: expected MIN,LOW,HIGH sizes such as 4M,8M,12M"),
            ));
        }
        let page = |s: &str| parse_size(s).map(|b| b.div_ceil(PAGE_SIZE as u64));
        Ok(Watermarks {
            min: page(parts[0])?,
            low: page(parts[1])?,
            high: page(parts[2])?,
        })
    }
}

/// One fault handler per four CPUs (1 to 8). On a small VM every extra handler costs a
/// cross-CPU wake-up per fault, which is dearer there than the parallelism it buys.
fn default_handler_threads() -> usize {
    let cpus = std::thread::available_parallelism().map_or(1, |n| n.get());
    (cpus / 4).clamp(1, 8)
}

/// Everything that shapes a region. Build with [`Config::new`] and adjust the fields.
#[derive(Clone, Debug)]
pub struct Config {
    /// Resident memory the region may use, in bytes (rounded down to pages).
    pub memory_limit: u64,
    pub swap: SwapConfig,
    pub fault_mode: FaultMode,
    /// Fault handler threads (thread mode only).
    pub handler_threads: usize,
    /// How long a waiting handler polls for the next fault before it sleeps, in µs.
    pub handler_spin_us: u64,
    /// `None`: derived from the memory limit by [`Watermarks::for_limit`].
    pub watermarks: Option<Watermarks>,
    /// Pages mapped around a first-touch fault in one operation (1 = no fault-around).
    pub fault_around: usize,
    /// Share of the resident pages kept unmapped on the inactive list, in percent. These are
    /// the reference-detection window: a page touched while inactive is promoted.
    pub inactive_percent: u8,
    /// Pages reclaimed per pass (the kernel's SWAP_CLUSTER_MAX).
    pub reclaim_batch: usize,
}

impl Config {
    pub fn new(memory_limit: u64) -> Self {
        Config {
            memory_limit,
            swap: SwapConfig::default(),
            fault_mode: FaultMode::Thread,
            handler_threads: default_handler_threads(),
            handler_spin_us: 50,
            watermarks: None,
            fault_around: 16,
            inactive_percent: 10,
            reclaim_batch: 32,
        }
    }

    pub fn limit_pages(&self) -> u64 {
        self.memory_limit / PAGE_SIZE as u64
    }

    pub fn watermarks(&self) -> Watermarks {
        self.watermarks
            .unwrap_or_else(|| Watermarks::for_limit(self.limit_pages()))
    }

    /// Checks every value; the error names the setting and the accepted range.
    pub fn validate(&self) -> Result<()> {
        let pages = self.limit_pages();
        if self.memory_limit > MAX_SIZE {
            return Err(Error::invalid(
                "memory limit",
                format!(
                    "{} bytes is larger than the maximum of 64 TiB",
                    self.memory_limit
                ),
            ));
        }
        if pages < MIN_MEMORY_PAGES {
            return Err(Error::invalid(
                "memory limit",
                format!(
                    "{} bytes is too small: at least {} KiB ({MIN_MEMORY_PAGES} pages)",
                    self.memory_limit,
                    MIN_MEMORY_PAGES * PAGE_SIZE as u64 / 1024
                ),
            ));
        }
        if let Some(size) = self.swap.size {
            if size < PAGE_SIZE as u64 || size > MAX_SIZE {
                return Err(Error::invalid(
                    "swap size",
                    format!("{size} bytes: use between 4 KiB and 64 TiB, or leave it unset to grow on demand"),
                ));
            }
        }
        if self.fault_mode == FaultMode::Thread && !(1..=64).contains(&self.handler_threads) {
            return Err(Error::invalid(
                "handler threads",
                format!("{}: use 1 to 64", self.handler_threads),
            ));
        }
        if self.handler_spin_us > 10_000 {
            return Err(Error::invalid(
                "handler spin",
                format!(
                    "{} µs: use 0 (sleep at once) to 10000",
                    self.handler_spin_us
                ),
            ));
        }
        if !(1..=512).contains(&self.fault_around) {
            return Err(Error::invalid(
                "fault-around",
                format!(
                    "{} pages: use 1 (off) to 512 pages (2 MiB)",
                    self.fault_around
                ),
            ));
        }
        if self.inactive_percent > 50 {
            return Err(Error::invalid(
                "inactive percent",
                format!("{}: use 0 to 50", self.inactive_percent),
            ));
        }
        if !(1..=256).contains(&self.reclaim_batch) {
            return Err(Error::invalid(
                "reclaim batch",
                format!("{}: use 1 to 256 pages", self.reclaim_batch),
            ));
        }
        let w = self.watermarks();
        if !(w.min >= 1 && w.min <= w.low && w.low <= w.high && w.high <= pages / 2) {
            return Err(Error::invalid(
                "watermarks",
                format!(
                    "min {} <= low {} <= high {} pages must hold, with min >= 1 and high at most \
                     half the memory limit ({} pages)",
                    w.min,
                    w.low,
                    w.high,
                    pages / 2
                ),
            ));
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn sizes_parse_with_binary_suffixes() {
        assert_eq!(parse_size("4096").unwrap(), 4096);
        assert_eq!(parse_size("64K").unwrap(), 64 << 10);
        assert_eq!(parse_size("16m").unwrap(), 16 << 20);
        assert_eq!(parse_size("2GiB").unwrap(), 2 << 30);
        assert_eq!(parse_size("1TB").unwrap(), 1 << 40);
    }

    #[test]
    fn bad_sizes_are_rejected_with_the_input_named() {
        for bad in ["", "G", "12X", "-5", "99999999999999999999", "20000000000T"] {
            let err = parse_size(bad).unwrap_err().to_string();
            assert!(err.contains(&format!("{bad:?}")), "{err}");
        }
    }

    #[test]
    fn default_config_is_valid_and_watermarks_are_ordered() {
        for limit in [64 << 10, 1 << 20, 1 << 30, 64 << 30] {
            let cfg = Config::new(limit);
            cfg.validate().unwrap();
            let w = cfg.watermarks();
            assert!(w.min <= w.low && w.low <= w.high && w.high <= cfg.limit_pages() / 4);
        }
    }

    #[test]
    fn zero_absurd_and_inconsistent_values_are_rejected() {
        let msg = |c: Config| c.validate().unwrap_err().to_string();
        assert!(msg(Config::new(0)).contains("memory limit"));
        assert!(msg(Config::new(1 << 60)).contains("64 TiB"));
        let mut c = Config::new(1 << 20);
        c.handler_threads = 0;
        assert!(msg(c).contains("handler threads"));
        let mut c = Config::new(1 << 20);
        c.fault_around = 0;
        assert!(msg(c).contains("fault-around"));
        let mut c = Config::new(1 << 20);
        c.watermarks = Some(Watermarks {
            min: 8,
            low: 4,
            high: 16,
        });
        assert!(msg(c).contains("watermarks"));
        let mut c = Config::new(1 << 20);
        c.swap.size = Some(0);
        assert!(msg(c).contains("swap size"));
    }

    #[test]
    fn watermarks_parse_as_sizes() {
        let w = Watermarks::parse("4K,8K,1M").unwrap();
        assert_eq!((w.min, w.low, w.high), (1, 2, 256));
        assert!(Watermarks::parse("4K,8K").is_err());
    }
}
