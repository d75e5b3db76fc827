//! Value parsers for the command line and the options shared by the bench commands.

use crate::kernel::tunables::{self, Tunable};
use crate::kernel::KernelSwap;
use anyhow::{Context, Result};
use clap::{Args, ValueEnum};
use serde::Serialize;
use std::path::PathBuf;
use uswap_core::swapfile::Backing;
use uswap_core::{
    parse_size, Compressor, Config, FaultMode, IoMode, LruLockMode, LruPolicy, Readahead,
    ReadaheadPolicy, References, SlotAlloc, SwapCacheMode, SwapEncryption, SwapLocation,
    Watermarks, Ztier, ZtierSize,
};

/// Which swap runs the workload.
#[derive(Clone, Copy, Debug, PartialEq, Eq, ValueEnum, Serialize)]
#[serde(rename_all = "lowercase")]
pub enum Backend {
    /// uswap, in this process
    Uswap,
    /// The kernel's own swap, in a child process inside a memory cgroup (needs root)
    Kernel,
}

/// A byte size such as `0`, `4096`, `64K`, `512M`, `2G`.
pub fn size(text: &str) -> Result<u64, String> {
    parse_size(text).map_err(|e| e.to_string())
}

/// A byte size such as `4096`, `64K`, `512M`, `2G`; zero is refused.
pub fn nonzero_size(text: &str) -> Result<u64, String> {
    match parse_size(text) {
        Ok(0) => Err("the size must be greater than 0".to_string()),
        Ok(bytes) => Ok(bytes),
        Err(e) => Err(e.to_string()),
    }
}

/// A number of seconds greater than 0, such as `10` or `0.5`.
pub fn seconds(text: &str) -> Result<f64, String> {
    match text.parse::<f64>() {
        Ok(s) if s > 0.0 && s <= 86_400.0 => Ok(s),
        _ => Err("use a number of seconds greater than 0 (at most a day)".to_string()),
    }
}

/// `on` or `off`.
pub fn on_off(text: &str) -> Result<bool, String> {
    match text {
        "on" => Ok(true),
        "off" => Ok(false),
        _ => Err("use `on` or `off`".to_string()),
    }
}

/// A directory that exists.
pub fn existing_dir(text: &str) -> Result<PathBuf, String> {
    let path = PathBuf::from(text);
    match std::fs::metadata(&path) {
        Ok(m) if m.is_dir() => Ok(path),
        Ok(_) => Err("not a directory".to_string()),
        Err(e) => Err(format!("cannot use this directory: {e}")),
    }
}

/// uswap's own settings. Unset options keep the library's defaults.
#[derive(Args, Debug, Clone)]
pub struct CoreArgs {
    /// Directory for the swap file [default: $TMPDIR or /tmp]; `--backend kernel` puts its
    /// swap file there too
    #[arg(long, value_name = "DIR", value_parser = existing_dir)]
    pub swap_dir: Option<PathBuf>,

    /// Fixed swap size [default: grows on demand]; also the kernel backend's swap file size
    #[arg(long, value_name = "SIZE", value_parser = nonzero_size)]
    pub swap_size: Option<u64>,

    /// How faults reach uswap: `thread` (handler threads), `sigbus` (the faulting thread;
    /// under `uswap run` every program thread also runs with syscall dispatch, so its
    /// system calls see swapped-out memory), or `auto` (sigbus where the kernel offers
    /// syscall dispatch, else thread) [default: auto for `uswap run`, thread for benches]
    #[arg(long, value_name = "MODE", value_parser = |s: &str| s.parse::<FaultMode>())]
    pub fault_mode: Option<FaultMode>,

    /// Fault handler threads (thread mode)
    #[arg(long, value_name = "N")]
    pub handlers: Option<usize>,

    /// µs a waiting fault handler polls before it sleeps (0 = sleep at once)
    #[arg(long, value_name = "US")]
    pub handler_spin: Option<u64>,

    /// µs a batch of swap-in reads through io_uring (also the SIGBUS handler's) polls for its completions before its thread sleeps (0 = sleep at once) [default: 250]
    #[arg(long, value_name = "US")]
    pub read_poll: Option<u64>,

    /// Pages mapped around a first-touch fault (1 = off)
    #[arg(long, value_name = "PAGES")]
    pub fault_around: Option<usize>,

    /// Aging deactivates the active neighbours of each page it picks, within an aligned
    /// block of this many pages (1 = the page alone) [default: 32]
    #[arg(long, value_name = "PAGES")]
    pub aging_block: Option<usize>,

    /// Swap I/O: `auto` (io_uring on a disk, pread for a file in memory), `uring` or
    /// `pread` [default: auto]
    #[arg(long, value_name = "MODE", value_parser = |s: &str| s.parse::<IoMode>())]
    pub io: Option<IoMode>,

    /// Swap slot allocation: `percpu` (a cluster per CPU) or `shared` (one scan base)
    /// [default: percpu]
    #[arg(long, value_name = "MODE", value_parser = |s: &str| s.parse::<SlotAlloc>())]
    pub slot_alloc: Option<SlotAlloc>,

    /// Swap encryption: `on` (each page encrypted and authenticated on its way out, with
    /// AES-256-GCM, or ChaCha20-Poly1305 without AES instructions, under a random key held
    /// only in memory) or `off` (plain pages with a CRC32C) [default: on]
    #[arg(long, value_name = "ON|OFF", value_parser = |s: &str| s.parse::<SwapEncryption>())]
    pub swap_encryption: Option<SwapEncryption>,

    /// The compressed tier in front of the swap file (zswap in user space): `on` (pages
    /// that compress to at most 3 KiB are kept compressed in memory, charged to the memory
    /// limit, the oldest written to the file when the pool is full) or `off` [default: on]
    #[arg(long, value_name = "ON|OFF", value_parser = on_off)]
    pub ztier: Option<bool>,

    /// The compressed pool's size: `auto` (moved while the program runs to where memory
    /// saves the most fault time, between 5% and 90% of the memory limit, from 90%), a
    /// share of the memory limit (`25%`) or a size (`256M`) [default: auto]
    #[arg(long, value_name = "auto|SIZE|N%", value_parser = |s: &str| s.parse::<ZtierSize>())]
    pub ztier_size: Option<ZtierSize>,

    /// The compressed tier's compressor: `lz4`, `zstd` or `zstd:LEVEL` [default: lz4]
    #[arg(long, value_name = "NAME", value_parser = |s: &str| s.parse::<Compressor>())]
    pub ztier_compressor: Option<Compressor>,

    /// Swap cache locking: `trunks` (a lock per 64 MiB of swap) or `single` [default: trunks]
    #[arg(long, value_name = "MODE", value_parser = |s: &str| s.parse::<SwapCacheMode>())]
    pub swap_cache: Option<SwapCacheMode>,

    /// Swap-in readahead: `none`, `fixed`, `scaling`, `vma` or `auto` (the kernel's rule:
    /// `vma` on solid-state or RAM-backed swap, `scaling` on a rotating disk) [default:
    /// auto]; the kernel backend sets vma_ra_enabled for the run (`auto`: true, its
    /// default, which it follows only while no rotational swap is on; it has no `fixed`)
    /// [default there: as found]
    #[arg(long, value_name = "POLICY", value_parser = |s: &str| s.parse::<ReadaheadPolicy>())]
    pub readahead: Option<ReadaheadPolicy>,

    /// Largest readahead window as a power of two, 0 to 8, like vm.page-cluster [default: 3];
    /// the kernel backend sets vm.page-cluster for the run [default there: as found]
    #[arg(long, value_name = "N", value_parser = clap::value_parser!(u8).range(0..=8))]
    pub page_cluster: Option<u8>,

    /// LRU lock: `mutex`, `spin`, or `rwlock` (single-page adds and removes shared, with
    /// SMP-safe list operations) [default: mutex]
    #[arg(long, value_name = "MODE", value_parser = |s: &str| s.parse::<LruLockMode>())]
    pub lru_lock: Option<LruLockMode>,

    /// LRU policy: `two-list` (every page mapped joins the active list) or `s3fifo` (new
    /// pages on a probation list aged first; refaults within the working set and pages
    /// touched again on the active list); changeable at run time with
    /// `uswap ctl PID lru_policy=…` [default: s3fifo]
    #[arg(long, value_name = "POLICY", value_parser = |s: &str| s.parse::<LruPolicy>())]
    pub lru_policy: Option<LruPolicy>,

    /// How aging sees that a mapped page is in use: `faults` (it unmaps the page and a touch
    /// brings it back with a minor fault) or `written` (written bits, Linux 6.7: pages
    /// written since aging last looked stay mapped without a fault; reads are not seen,
    /// and a swapped-in page is written again when evicted) [default: faults]
    #[arg(long, value_name = "SOURCE", value_parser = |s: &str| s.parse::<References>())]
    pub references: Option<References>,

    /// Share of the memory limit kept unmapped on the inactive list, 0 to 50: the window in
    /// which a touch shows that a page is in use (a minor fault) [default: 10]
    #[arg(long, value_name = "PERCENT", value_parser = clap::value_parser!(u8).range(0..=50))]
    pub inactive_percent: Option<u8>,

    /// Single-page LRU adds gathered per CPU before they take the LRU lock, 1 to 256
    /// (1 = every page at once; the kernel batches 31) [default: 31]
    #[arg(long, value_name = "N", value_parser = clap::value_parser!(u16).range(1..=256))]
    pub lru_batch: Option<u16>,

    /// Per-CPU charge stocks and free-frame lists: `on` or `off` [default: on]
    #[arg(long, value_name = "ON|OFF", value_parser = on_off)]
    pub pcp: Option<bool>,

    /// Reclaim watermarks as sizes, e.g. 4M,8M,12M [default: scaled to the memory limit]
    #[arg(long, value_name = "MIN,LOW,HIGH", value_parser = |s: &str| Watermarks::parse(s))]
    pub watermarks: Option<Watermarks>,
}

/// Settings of `--backend kernel` shared by the bench commands that swap.
#[derive(Args, Debug, Clone)]
pub struct KernelArgs {
    /// The kernel backend's swap: `file` (the swap already on, or else a swap file in
    /// --swap-dir) or `zram` (a zram device of its own, compressed RAM; the RAM-backed
    /// counterpart for uswap is --swap-dir /dev/shm)
    #[arg(long, value_enum, value_name = "KIND", default_value_t = KernelSwap::File)]
    pub kernel_swap: KernelSwap,
}

impl KernelArgs {
    /// The kernel settings a run changes: the readahead `core` asks for, and with
    /// `--kernel-swap zswap`, zswap's, its pool `--ztier-size` of `memory` (with `auto`, the
    /// kernel's own limit).
    pub fn tunables(&self, core: &CoreArgs, memory: u64) -> Result<Vec<(Tunable, String)>> {
        let mut settings = tunables::for_readahead(core.readahead, core.page_cluster)?;
        settings.extend(self.zswap_tunables(core.ztier(), memory)?);
        Ok(settings)
    }

    /// With `--kernel-swap zswap`, the settings that give the kernel's zswap `ztier`'s
    /// compressor and its pool size under `memory`; none otherwise.
    pub fn zswap_tunables(&self, ztier: Ztier, memory: u64) -> Result<Vec<(Tunable, String)>> {
        match self.kernel_swap {
            KernelSwap::Zswap => {
                let pool = (ztier.size != ZtierSize::Auto).then(|| ztier.size.bytes(memory));
                tunables::for_zswap(ztier.compressor, pool)
            }
            KernelSwap::File | KernelSwap::Zram => Ok(Vec::new()),
        }
    }
}

impl CoreArgs {
    /// The options set that only uswap has (not the swap directory, size and readahead,
    /// which the kernel backend applies too, nor the compressed pool's size and compressor,
    /// which `--kernel-swap zswap` gives the kernel's), by name.
    pub fn uswap_only_options(&self) -> Vec<&'static str> {
        let set = [
            ("--fault-mode", self.fault_mode.is_some()),
            ("--handlers", self.handlers.is_some()),
            ("--handler-spin", self.handler_spin.is_some()),
            ("--read-poll", self.read_poll.is_some()),
            ("--fault-around", self.fault_around.is_some()),
            ("--aging-block", self.aging_block.is_some()),
            ("--io", self.io.is_some()),
            ("--slot-alloc", self.slot_alloc.is_some()),
            ("--swap-cache", self.swap_cache.is_some()),
            ("--swap-encryption", self.swap_encryption.is_some()),
            ("--ztier", self.ztier.is_some()),
            ("--lru-lock", self.lru_lock.is_some()),
            ("--lru-batch", self.lru_batch.is_some()),
            ("--lru-policy", self.lru_policy.is_some()),
            ("--references", self.references.is_some()),
            ("--inactive-percent", self.inactive_percent.is_some()),
            ("--pcp", self.pcp.is_some()),
            ("--watermarks", self.watermarks.is_some()),
        ];
        set.into_iter()
            .filter_map(|(name, is_set)| is_set.then_some(name))
            .collect()
    }

    /// The compressed tier these options ask for (the library's default for what is unset).
    pub fn ztier(&self) -> Ztier {
        let default = Ztier::default();
        Ztier {
            enabled: self.ztier.unwrap_or(default.enabled),
            size: self.ztier_size.unwrap_or(default.size),
            compressor: self.ztier_compressor.unwrap_or(default.compressor),
        }
    }

    /// The directory swap files go in.
    pub fn swap_dir(&self) -> PathBuf {
        self.swap_dir.clone().unwrap_or_else(std::env::temp_dir)
    }

    /// The readahead these options ask for (the library's default for what is unset).
    pub fn readahead(&self) -> Readahead {
        let default = Readahead::default();
        Readahead {
            policy: self.readahead.unwrap_or(default.policy),
            page_cluster: self.page_cluster.unwrap_or(default.page_cluster),
        }
    }

    /// A validated configuration for a region with this memory limit. A swap directory
    /// in RAM (tmpfs) is said on stderr: swapping there saves no memory.
    pub fn config(&self, memory_limit: u64) -> Result<Config> {
        let mut cfg = Config::new(memory_limit);
        let dir = self.swap_dir();
        if let Some(backing) = Backing::of_path(&dir).ok().filter(|b| b.in_memory()) {
            eprintln!(
                "uswap: warning: the swap directory {} is on {backing}: swapped pages stay in \
                 RAM, so swapping there saves no memory; point --swap-dir (or TMPDIR) at a disk",
                dir.display()
            );
        }
        cfg.swap.location = SwapLocation::TempIn(dir);
        cfg.swap.size = self.swap_size;
        if let Some(mode) = self.fault_mode {
            cfg.fault_mode = mode;
        }
        if let Some(n) = self.handlers {
            cfg.handler_threads = n;
        }
        if let Some(us) = self.handler_spin {
            cfg.handler_spin_us = us;
        }
        if let Some(us) = self.read_poll {
            cfg.swap.read_poll_us = us;
        }
        if let Some(pages) = self.fault_around {
            cfg.fault_around = pages;
        }
        if let Some(pages) = self.aging_block {
            cfg.aging_block = pages;
        }
        if let Some(io) = self.io {
            cfg.swap.io = io;
        }
        cfg.watermarks = self.watermarks.or(cfg.watermarks);
        if let Some(mode) = self.slot_alloc {
            cfg.swap.slot_alloc = mode;
        }
        if let Some(mode) = self.swap_cache {
            cfg.swap.swap_cache = mode;
        }
        if let Some(mode) = self.swap_encryption {
            cfg.swap.encryption = mode;
        }
        cfg.swap.ztier = self.ztier();
        cfg.readahead = self.readahead();
        if let Some(pcp) = self.pcp {
            cfg.pcp = pcp;
        }
        if let Some(n) = self.lru_batch {
            cfg.lru_batch = n as usize;
        }
        if let Some(mode) = self.lru_lock {
            cfg.lru_lock = mode;
        }
        if let Some(policy) = self.lru_policy {
            cfg.lru_policy = policy;
        }
        if let Some(references) = self.references {
            cfg.references = references;
        }
        if let Some(percent) = self.inactive_percent {
            cfg.inactive_percent = percent;
        }
        cfg.validate().context("bad uswap option")?;
        Ok(cfg)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use clap::Parser;

    #[derive(Parser)]
    struct Probe {
        #[command(flatten)]
        core: CoreArgs,
    }

    fn core(args: &[&str]) -> Result<CoreArgs, clap::Error> {
        Probe::try_parse_from(std::iter::once("t").chain(args.iter().copied())).map(|p| p.core)
    }

    #[test]
    fn sizes_and_seconds_are_checked() {
        assert_eq!(nonzero_size("4K"), Ok(4096));
        assert!(nonzero_size("0").unwrap_err().contains("greater than 0"));
        assert!(nonzero_size("12X").unwrap_err().contains("\"12X\""));
        assert_eq!(seconds("0.5"), Ok(0.5));
        assert!(seconds("0").is_err() && seconds("-1").is_err() && seconds("x").is_err());
    }

    #[test]
    fn options_override_the_library_defaults() {
        let c = core(&["--handlers", "3", "--fault-around", "1", "--io", "pread"]).unwrap();
        let cfg = c.config(64 << 20).unwrap();
        assert_eq!(
            (cfg.handler_threads, cfg.fault_around, cfg.swap.io),
            (3, 1, IoMode::Pread)
        );
        let defaults = Config::new(64 << 20);
        let c = core(&["--slot-alloc", "shared", "--swap-cache", "single"]).unwrap();
        let cfg = c.clone().config(64 << 20).unwrap();
        assert_eq!(
            (cfg.swap.slot_alloc, cfg.swap.swap_cache),
            (SlotAlloc::Shared, SwapCacheMode::Single)
        );
        let c = core(&["--readahead", "fixed", "--page-cluster", "5"]).unwrap();
        assert_eq!(
            c.config(64 << 20).unwrap().readahead,
            Readahead {
                policy: ReadaheadPolicy::Fixed,
                page_cluster: 5
            }
        );
        let cfg = core(&[]).unwrap().config(64 << 20).unwrap();
        assert_eq!(cfg.readahead, Readahead::default());
        assert_eq!(cfg.handler_threads, defaults.handler_threads);
        assert_eq!(
            cfg.swap.location,
            SwapLocation::TempIn(std::env::temp_dir())
        );
    }

    #[test]
    fn uswap_only_options_are_named_and_shared_ones_are_not() {
        assert!(core(&["--swap-size", "1G", "--page-cluster", "2"])
            .unwrap()
            .uswap_only_options()
            .is_empty());
        let c = core(&["--fault-mode", "thread", "--pcp", "off"]).unwrap();
        assert_eq!(c.uswap_only_options(), ["--fault-mode", "--pcp"]);
    }

    #[test]
    fn bad_values_are_refused_with_the_setting_named() {
        assert!(core(&["--fault-mode", "fast"]).is_err());
        assert!(core(&["--watermarks", "1M,2M"]).is_err());
        assert!(core(&["--swap-dir", "/nonexistent/dir"]).is_err());
        assert!(core(&["--page-cluster", "9"]).is_err());
        assert!(core(&["--pcp", "maybe"]).is_err());
        assert!(
            !core(&["--pcp", "off"])
                .unwrap()
                .config(64 << 20)
                .unwrap()
                .pcp
        );
        assert!(core(&["--lru-batch", "0"]).is_err());
        assert!(core(&["--lru-batch", "257"]).is_err());
        let batch = core(&["--lru-batch", "1"])
            .unwrap()
            .config(64 << 20)
            .unwrap();
        assert_eq!(batch.lru_batch, 1);
        assert!(core(&["--readahead", "sideways"]).is_err());
        assert!(core(&["--slot-alloc", "global"]).is_err());
        let err = core(&["--handlers", "0"])
            .unwrap()
            .config(64 << 20)
            .unwrap_err();
        assert!(format!("{err:#}").contains("handler threads"), "{err:#}");
    }
}
