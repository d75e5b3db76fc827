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

/// Pages in a per-CPU LRU batch by default: the kernel's `PAGEVEC_SIZE`/folio batch.
pub const DEFAULT_LRU_BATCH: usize = 31;

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
#[derive(Clone, Copy, Debug, PartialEq, Eq, serde::Serialize, serde::Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum FaultMode {
    /// Handler threads read fault events from the userfaultfd. Correct for every access,
    /// including the kernel's own (a `read()` system call into a swapped-out page).
    Thread,
    /// The faulting thread gets SIGBUS and resolves its own fault: fewer context switches,
    /// but a kernel access to a missing page fails with EFAULT unless the thread runs with
    /// syscall dispatch (`syscall_dispatch::enable_for_this_thread`).
    Sigbus,
    /// SIGBUS mode where this kernel offers syscall dispatch, thread mode where it does not
    /// (resolved when the region is made, see [`FaultMode::resolve`]). `uswap run`'s
    /// default: it runs every program thread with dispatch. A library user that chooses it
    /// turns dispatch on in each thread whose system calls use region memory.
    Auto,
}

impl FaultMode {
    /// The mode a region runs in: `Auto` becomes `Sigbus` when syscall dispatch works on
    /// this kernel, else `Thread`.
    pub fn resolve(self) -> FaultMode {
        match self {
            FaultMode::Auto if crate::sud::supported() => FaultMode::Sigbus,
            FaultMode::Auto => FaultMode::Thread,
            mode => mode,
        }
    }
}

impl FromStr for FaultMode {
    type Err = Error;
    fn from_str(s: &str) -> Result<Self> {
        match s {
            "thread" => Ok(FaultMode::Thread),
            "sigbus" => Ok(FaultMode::Sigbus),
            "auto" => Ok(FaultMode::Auto),
            _ => Err(Error::invalid(
                "fault mode",
                format!("{s:?}: use `auto`, `thread` or `sigbus`"),
            )),
        }
    }
}

/// How swap I/O is issued.
#[derive(Clone, Copy, Debug, PartialEq, Eq, serde::Serialize, serde::Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum IoMode {
    /// `uring` for a swap file on a disk, `pread` for one in memory (tmpfs, ramfs), where
    /// each transfer is a memory copy that io_uring hands to a worker thread: 1.45x the
    /// random-access rate and 1.7x the swapoff rate with `pread` there, measured (see
    /// docs/benchmarks.md).
    Auto,
    /// io_uring, falling back to pread/pwrite when the kernel refuses io_uring.
    Uring,
    /// Plain pread/pwrite.
    Pread,
}

impl IoMode {
    /// The mode `Auto` means for a file on `backing`; other modes stay as they are.
    pub fn resolve(self, in_memory: bool) -> IoMode {
        match self {
            IoMode::Auto if in_memory => IoMode::Pread,
            IoMode::Auto => IoMode::Uring,
            mode => mode,
        }
    }
}

impl FromStr for IoMode {
    type Err = Error;
    fn from_str(s: &str) -> Result<Self> {
        match s {
            "auto" => Ok(IoMode::Auto),
            "uring" | "io_uring" => Ok(IoMode::Uring),
            "pread" => Ok(IoMode::Pread),
            _ => Err(Error::invalid(
                "I/O mode",
                format!("{s:?}: use `auto`, `uring` or `pread`"),
            )),
        }
    }
}

/// A setting that is one of a few named modes: parsed from its name (an unknown name gets
/// an error listing the names), printed as its name, serialized as its name.
macro_rules! named_modes {
    ($(#[$doc:meta])* $name:ident, $setting:literal { $($(#[$vdoc:meta])* $variant:ident = $text:literal,)* }) => {
        $(#[$doc])*
        #[derive(Clone, Copy, Debug, PartialEq, Eq)]
        pub enum $name { $($(#[$vdoc])* $variant,)* }

        impl $name {
            /// Every mode, in declaration order.
            pub const ALL: &'static [$name] = &[$($name::$variant,)*];

            pub fn name(self) -> &'static str {
                match self { $($name::$variant => $text,)* }
            }
        }

        impl FromStr for $name {
            type Err = Error;
            fn from_str(s: &str) -> Result<Self> {
                match s {
                    $($text => Ok($name::$variant),)*
                    _ => Err(Error::invalid(
                        $setting,
                        format!("{s:?}: use one of {}", [$(concat!("`", $text, "`"),)*].join(", ")),
                    )),
                }
            }
        }

        impl std::fmt::Display for $name {
            fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
                f.write_str(self.name())
            }
        }

        impl serde::Serialize for $name {
            fn serialize<S: serde::Serializer>(&self, s: S) -> std::result::Result<S::Ok, S::Error> {
                s.serialize_str(self.name())
            }
        }

        impl<'de> serde::Deserialize<'de> for $name {
            fn deserialize<D: serde::Deserializer<'de>>(d: D) -> std::result::Result<Self, D::Error> {
                let name = <std::borrow::Cow<'de, str>>::deserialize(d)?;
                name.parse().map_err(serde::de::Error::custom)
            }
        }
    };
}

named_modes! {
    /// Where a CPU looks for a free swap slot (seed 000).
    SlotAlloc, "slot allocation" {
        /// One next-slot position for all CPUs, under one lock (the kernel's behaviour for
        /// rotating disks, where writes should go to one place).
        Shared = "shared",
        /// Each CPU allocates from a cluster of its own (the seed's per-CPU scan base; the
        /// kernel's behaviour for solid-state devices).
        Percpu = "percpu",
    }
}

named_modes! {
    /// How the LRU lists are locked (seed 001).
    LruLockMode, "LRU lock" {
        /// One mutex, taken for every operation.
        Mutex = "mutex",
        /// One spinlock, taken for every operation.
        Spin = "spin",
        /// A two-mode lock: single-page adds and removes take it shared and use SMP-safe
        /// list operations; batch isolation takes it exclusive.
        RwLock = "rwlock",
    }
}

named_modes! {
    /// Which pages aging unmaps first (`workingset.rs`). Can be changed while a region is
    /// in use (`Region::set_lru_policy`).
    LruPolicy, "LRU policy" {
        /// Every page mapped joins the active list; aging unmaps its tail (the kernel's
        /// two lists, with the inactive list unmapped).
        TwoList = "two-list",
        /// New pages start on a probation list aged first; refaults within the working set
        /// and pages touched again go to the active list (S3-FIFO).
        S3fifo = "s3fifo",
    }
}

named_modes! {
    /// How aging learns that a mapped page is in use. Fixed when a region is made: the
    /// userfaultfd's features are chosen then.
    References, "reference source" {
        /// Only by faults: aging unmaps a page and a touch brings it back (a minor fault).
        /// A swapped-in page keeps its slot until its first write, which a write-protect
        /// fault shows, so a clean page is dropped without a write.
        Faults = "faults",
        /// Also by written bits: pages are write-protected without faults
        /// (`UFFD_FEATURE_WP_ASYNC`, Linux 6.7) and aging asks `PAGEMAP_SCAN` which were
        /// written since it last looked; those stay mapped (a second chance) without a
        /// fault. Reads are not seen. Write protection then serves only this, so a page
        /// gives up its slot when it is swapped in and is written again when evicted, and
        /// pages a fork shares are counted by both processes from the fork.
        Written = "written",
    }
}

named_modes! {
    /// How the swap cache is locked (seed 000).
    SwapCacheMode, "swap cache" {
        /// One lock for the whole device.
        Single = "single",
        /// One lock per 64 MiB of slots (16,384), as the kernel split its swap address
        /// space in 4.11.
        Trunks = "trunks",
    }
}

named_modes! {
    /// How pages are kept on the swap device (`swapfile/seal.rs`).
    SwapEncryption, "swap encryption" {
        /// Encrypted and authenticated (AES-256-GCM, or ChaCha20-Poly1305 without AES
        /// instructions) under a random key held only in memory: the default.
        On = "on",
        /// Plain, with a CRC32C of each page kept in memory.
        Off = "off",
    }
}

// `named_modes!` makes the enum, so its default cannot be derived there.
#[allow(clippy::derivable_impls)]
impl Default for LruPolicy {
    fn default() -> Self {
        LruPolicy::S3fifo
    }
}

// `named_modes!` makes the enum, so its default cannot be derived there.
#[allow(clippy::derivable_impls)]
impl Default for References {
    fn default() -> Self {
        References::Faults
    }
}

// `named_modes!` makes the enum, so its default cannot be derived there.
#[allow(clippy::derivable_impls)]
impl Default for SwapEncryption {
    fn default() -> Self {
        SwapEncryption::On
    }
}

/// The compressed tier in front of the swap file (zswap per device: `swapfile/zswap.rs`).
#[derive(Clone, Copy, Debug, PartialEq, Eq, serde::Serialize, serde::Deserialize)]
pub struct Ztier {
    /// Whether evicted pages are compressed into the pool (off: they go to the file, and
    /// what the pool holds is written back as reclaim runs).
    pub enabled: bool,
    /// The most the pool's stored objects may take.
    pub size: ZtierSize,
    pub compressor: Compressor,
}

impl Default for Ztier {
    /// On, sized `auto`, LZ4: measured (docs/benchmarks.md, "The pool sized by its
    /// refaults"), it serves 3:1 data 2.5x the kernel's plain swap with one thread, and
    /// random data within noise of the tier off.
    fn default() -> Self {
        Ztier {
            enabled: true,
            size: ZtierSize::Auto,
            compressor: Compressor::Lz4,
        }
    }
}

/// The share of the memory limit an `auto` pool starts from: the most it may take, as the
/// kernel lets zswap's pool grow inside a cgroup as far as reclaim takes it (its
/// `max_pool_percent`, 20%, is of the machine's memory); its refaults then bring it to
/// where memory saves the most (docs/benchmarks.md, issue 27).
pub const AUTO_ZTIER_START_PERCENT: u8 = 90;

/// The compressed pool's size: bytes, a share of the memory limit, or `auto`: moved while
/// the program runs to where memory saves the most fault time (`swapfile/zswap_shrinker.rs`).
#[derive(Clone, Copy, Debug, PartialEq, Eq, serde::Serialize, serde::Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum ZtierSize {
    Bytes(u64),
    Percent(u8),
    Auto,
}

impl ZtierSize {
    /// The pool's most bytes under a memory limit of `limit_bytes` (for `auto`, where it
    /// starts).
    pub fn bytes(self, limit_bytes: u64) -> u64 {
        match self {
            ZtierSize::Bytes(b) => b,
            ZtierSize::Percent(p) => limit_bytes / 100 * u64::from(p),
            ZtierSize::Auto => limit_bytes / 100 * u64::from(AUTO_ZTIER_START_PERCENT),
        }
    }
}

impl FromStr for ZtierSize {
    type Err = Error;
    /// `auto`, `25%` (a share of the memory limit, 1 to 90) or a size (`256M`).
    fn from_str(s: &str) -> Result<Self> {
        if s.trim().eq_ignore_ascii_case("auto") {
            return Ok(ZtierSize::Auto);
        }
        match s.trim().strip_suffix('%') {
            Some(p) => match p.trim().parse::<u8>() {
                Ok(p @ 1..=90) => Ok(ZtierSize::Percent(p)),
                _ => Err(Error::invalid(
                    "compressed pool size",
                    format!("{s:?}: a share of the memory limit is 1% to 90%"),
                )),
            },
            None => parse_size(s).map(ZtierSize::Bytes),
        }
    }
}

impl std::fmt::Display for ZtierSize {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            ZtierSize::Bytes(b) => write!(f, "{b}"),
            ZtierSize::Percent(p) => write!(f, "{p}%"),
            ZtierSize::Auto => f.write_str("auto"),
        }
    }
}

/// How the compressed tier compresses pages.
#[derive(Clone, Copy, Debug, PartialEq, Eq, serde::Serialize, serde::Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum Compressor {
    /// LZ4 (`lz4_flex`): fast both ways; the SIGBUS handler decompresses in place.
    Lz4,
    /// Zstandard at a level (`zstd`): smaller, slower; its pages are decompressed off the
    /// signal handler (by the fault path's full route).
    Zstd(i32),
}

impl FromStr for Compressor {
    type Err = Error;
    /// `lz4`, `zstd` (level 1) or `zstd:LEVEL` (1 to 19).
    fn from_str(s: &str) -> Result<Self> {
        let bad = || {
            Error::invalid(
                "compressor",
                format!("{s:?}: use `lz4`, `zstd` or `zstd:LEVEL` (LEVEL 1 to 19)"),
            )
        };
        match s.split_once(':') {
            None if s == "lz4" => Ok(Compressor::Lz4),
            None if s == "zstd" => Ok(Compressor::Zstd(1)),
            Some(("zstd", level)) => match level.parse::<i32>() {
                Ok(l @ 1..=19) => Ok(Compressor::Zstd(l)),
                _ => Err(bad()),
            },
            _ => Err(bad()),
        }
    }
}

impl std::fmt::Display for Compressor {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            Compressor::Lz4 => f.write_str("lz4"),
            Compressor::Zstd(level) => write!(f, "zstd:{level}"),
        }
    }
}

named_modes! {
    /// Which swap slots a swap-in reads beside the faulting one (seed 002).
    ReadaheadPolicy, "readahead policy" {
        /// Only the faulting slot.
        None = "none",
        /// Always the aligned block of 2^page-cluster slots around the faulting one (the
        /// seed's policy).
        Fixed = "fixed",
        /// The kernel's hit-based window (`swapin_nr_pages`): up to 2^page-cluster slots,
        /// growing while readahead pages are used and shrinking when they are not.
        Scaling = "scaling",
        /// A window of virtual addresses around the fault, reading the slots those pages
        /// hold (the kernel's default since 4.14 on solid-state swap), sized like `scaling`.
        Vma = "vma",
        /// The kernel's choice for the swap device: `vma` on solid-state or RAM-backed
        /// swap, `scaling` on a rotating disk, where neighbouring slots are the cheap ones.
        Auto = "auto",
    }
}

impl ReadaheadPolicy {
    /// The policy in effect on a swap device that is `rotational` or not.
    pub fn on_device(self, rotational: bool) -> ReadaheadPolicy {
        match self {
            ReadaheadPolicy::Auto if rotational => ReadaheadPolicy::Scaling,
            ReadaheadPolicy::Auto => ReadaheadPolicy::Vma,
            policy => policy,
        }
    }
}

/// The readahead setting: a policy and its `page-cluster` (log2 of the largest window, as
/// `vm.page-cluster`). Can be changed while a region is in use (`Region::set_readahead`).
#[derive(Clone, Copy, Debug, PartialEq, Eq, serde::Serialize, serde::Deserialize)]
pub struct Readahead {
    pub policy: ReadaheadPolicy,
    /// 0 to [`Readahead::MAX_PAGE_CLUSTER`]; the window is at most 2^page_cluster pages.
    pub page_cluster: u8,
}

impl Readahead {
    pub const MAX_PAGE_CLUSTER: u8 = 8;

    pub fn validate(&self) -> Result<()> {
        if self.page_cluster > Self::MAX_PAGE_CLUSTER {
            return Err(Error::invalid(
                "page-cluster",
                format!(
                    "{}: use 0 to {} (a window of 1 to {} pages)",
                    self.page_cluster,
                    Self::MAX_PAGE_CLUSTER,
                    1 << Self::MAX_PAGE_CLUSTER
                ),
            ));
        }
        Ok(())
    }

    /// The largest window, in pages.
    pub fn max_pages(&self) -> usize {
        1 << self.page_cluster
    }
}

impl Default for Readahead {
    /// The kernel's defaults: its choice of readahead for the device, `vm.page-cluster` 3
    /// (8 pages).
    fn default() -> Self {
        Readahead {
            policy: ReadaheadPolicy::Auto,
            page_cluster: 3,
        }
    }
}

/// Where the swap file lives.
#[derive(Clone, Debug, PartialEq, Eq, serde::Serialize, serde::Deserialize)]
pub enum SwapLocation {
    /// An unlinked `O_TMPFILE` (mode 0600) in this directory: nothing is left behind.
    TempIn(PathBuf),
    /// A new file at this path (mode 0600), unlinked as soon as it is open, so nothing is
    /// left behind even on a crash. An existing path (or a symbolic link) is refused, never
    /// overwritten.
    File(PathBuf),
}

impl Default for SwapLocation {
    fn default() -> Self {
        SwapLocation::TempIn(std::env::temp_dir())
    }
}

/// The swap device: where, how big, how I/O is done.
#[derive(Clone, Debug, serde::Serialize, serde::Deserialize)]
pub struct SwapConfig {
    pub location: SwapLocation,
    /// Fixed size in bytes; `None` grows the file on demand (bounded by the free space of
    /// its file system, checked when a region is created).
    pub size: Option<u64>,
    pub io: IoMode,
    pub slot_alloc: SlotAlloc,
    pub swap_cache: SwapCacheMode,
    /// How long a batch of swap-in reads through io_uring (a handler's, or the SIGBUS
    /// handler's one page) polls for its completions before its thread sleeps on them, in
    /// µs (0 = sleep at once, and the SIGBUS handler reads with `pread`); see `swap_io.rs`.
    #[serde(default = "default_read_poll_us")]
    pub read_poll_us: u64,
    /// Whether slots are sealed (encrypted and authenticated) or plain with a checksum.
    #[serde(default)]
    pub encryption: SwapEncryption,
    /// Faults to inject into the device's I/O, for tests. `None` (the default) costs
    /// nothing.
    pub faults: Option<FaultPlan>,
    /// The compressed tier in front of the file.
    #[serde(default)]
    pub ztier: Ztier,
}

impl Default for SwapConfig {
    fn default() -> Self {
        SwapConfig {
            location: SwapLocation::default(),
            size: None,
            io: IoMode::Auto,
            slot_alloc: SlotAlloc::Percpu,
            swap_cache: SwapCacheMode::Trunks,
            read_poll_us: default_read_poll_us(),
            encryption: SwapEncryption::On,
            faults: None,
            ztier: Ztier::default(),
        }
    }
}

fn default_read_poll_us() -> u64 {
    250
}

/// I/O faults to inject, each as a probability per I/O attempt (0.0 to 1.0), applied inside
/// the swap device's I/O engine in both I/O modes, so everything above it sees them as it
/// would see a failing disk.
///
/// Transient faults (`eagain`, `short_read`, `short_write`, `read_eio`, `read_flip`) model
/// trouble that clears before the retry budget does: they never strike an operation's last
/// allowed try, so with only these a correct stack loses nothing. Permanent faults
/// (`read_eio_persistent`, `write_flip`) and write failures (`write_eio`, `write_enospc`,
/// not retried) may lose or refuse data.
///
/// Decisions come from a splitmix64 stream seeded with `seed`: the same sequence of
/// operations meets the same faults.
#[derive(Clone, Copy, Debug, Default, PartialEq, serde::Serialize, serde::Deserialize)]
pub struct FaultPlan {
    pub seed: u64,
    /// A read fails with EIO (transient: a later try succeeds).
    pub read_eio: f64,
    /// A read fails with EIO on every try (a bad sector).
    pub read_eio_persistent: f64,
    /// A write fails with EIO.
    pub write_eio: f64,
    /// A write fails with ENOSPC.
    pub write_enospc: f64,
    /// A read transfers less than asked; the bytes beyond are garbage.
    pub short_read: f64,
    /// A write transfers less than asked; the bytes beyond are garbage on the device.
    pub short_write: f64,
    /// Any transfer fails with EAGAIN.
    pub eagain: f64,
    /// A read returns a page with one bit flipped (in transit: a re-read gets good data).
    pub read_flip: f64,
    /// A write puts a page with one bit flipped on the device (permanent corruption).
    pub write_flip: f64,
}

impl FaultPlan {
    /// Every transient fault at `rate`, no permanent ones.
    pub fn transient(seed: u64, rate: f64) -> FaultPlan {
        FaultPlan {
            seed,
            read_eio: rate,
            short_read: rate,
            short_write: rate,
            eagain: rate,
            read_flip: rate,
            ..FaultPlan::default()
        }
    }

    /// The rates by name, for messages and validation.
    pub fn rates(&self) -> [(&'static str, f64); 9] {
        [
            ("read_eio", self.read_eio),
            ("read_eio_persistent", self.read_eio_persistent),
            ("write_eio", self.write_eio),
            ("write_enospc", self.write_enospc),
            ("short_read", self.short_read),
            ("short_write", self.short_write),
            ("eagain", self.eagain),
            ("read_flip", self.read_flip),
            ("write_flip", self.write_flip),
        ]
    }

    /// Checks that every rate is a probability and that the rates of one kind of
    /// operation add up to at most 1.
    pub fn validate(&self) -> Result<()> {
        for (name, rate) in self.rates() {
            if !(0.0..=1.0).contains(&rate) {
                return Err(Error::invalid(
                    "fault plan",
                    format!("{name} = {rate}: a rate is a probability from 0.0 to 1.0"),
                ));
            }
        }
        let reads = self.read_eio
            + self.read_eio_persistent
            + self.short_read
            + self.eagain
            + self.read_flip;
        let writes =
            self.write_eio + self.write_enospc + self.short_write + self.eagain + self.write_flip;
        for (kind, sum) in [("read", reads), ("write", writes)] {
            if sum > 1.0 {
                return Err(Error::invalid(
                    "fault plan",
                    format!("the {kind} fault rates add up to {sum}, more than 1.0"),
                ));
            }
        }
        Ok(())
    }
}

/// Free-page watermarks of the resident budget, in pages, as in the kernel's zone
/// watermarks: below `low` the background reclaimer wakes and works until `high`; a fault
/// that finds fewer than `min` free pages reclaims directly.
#[derive(Clone, Copy, Debug, PartialEq, Eq, serde::Serialize, serde::Deserialize)]
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

/// One fault handler per four CPUs the process can keep busy (1 to 8). On a small VM every
/// extra handler costs a cross-CPU wake-up per fault, which is dearer there than the
/// parallelism it buys.
fn default_handler_threads() -> usize {
    let cpus = crate::cpu::usable();
    // Two, so that two faulting threads' swap-ins overlap (a second handler is woken only
    // then, see handler.rs); beyond that one per four CPUs.
    (cpus / 4).clamp(2.min(cpus), 8)
}

/// The default aging block: a page table's worth would be 512; 32 already moves a random
/// batch in runs.
fn default_aging_block() -> usize {
    32
}

/// Everything that shapes a region. Build with [`Config::new`] and adjust the fields.
/// Serialized, it travels to programs run under `uswap run` (in their environment).
#[derive(Clone, Debug, serde::Serialize, serde::Deserialize)]
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
    /// Aging looks around the pages it takes from the active tail and deactivates their
    /// active neighbours in the same aligned block of this many pages with them (1 = each
    /// page alone), as MGLRU's look-around ages a page table's neighbours together: they
    /// move in one UFFDIO_MOVE, one TLB flush where the kernel batches them. 32 by default:
    /// faster than page by page on uniform random access in SIGBUS mode, where the
    /// faulting thread runs on the CPU aging would otherwise send an IPI to for every
    /// page, and level or faster in thread mode (docs/benchmarks.md, "Aging moves random
    /// batches in runs").
    #[serde(default = "default_aging_block")]
    pub aging_block: usize,
    /// Swap-in readahead at creation; changeable later with `Region::set_readahead`.
    pub readahead: Readahead,
    /// How the LRU lists are locked.
    pub lru_lock: LruLockMode,
    /// Which pages aging unmaps first; changeable later with `Region::set_lru_policy`.
    #[serde(default)]
    pub lru_policy: LruPolicy,
    /// How aging sees that a mapped page is in use.
    #[serde(default)]
    pub references: References,
    /// Single-page LRU adds gathered per CPU before they take the LRU lock (the kernel's
    /// folio batch of 31); 1 adds every page at once.
    pub lru_batch: usize,
    /// Time every phase of faults and reclaim (`Region::phase_times`); a clock read per
    /// phase when on.
    pub breakdown: bool,
    /// Per-CPU stocks in front of the resident budget (the memcg charge stock) and per-CPU
    /// lists in front of the staging frame list (the page allocator's per-CPU lists).
    pub pcp: bool,
    /// A memory cgroup whose limit this region shares with others, e.g. every process of a
    /// tree under `uswap run` (`None`: a limit of its own, `memory_limit`). Not serialized:
    /// a process joins its tree's group through an inherited descriptor.
    #[serde(skip)]
    pub memcg: Option<std::sync::Arc<crate::memcg::MemCgroup>>,
    /// Bytes of the region that may hold data at once, as the kernel's `CommitLimit`:
    /// the swap the region promises itself is this less the memory limit. For a region
    /// larger than what its user keeps in it, the rest being address space reserved
    /// (`PROT_NONE`) and committed later; the user keeps what is accessible within it
    /// (`uswap run`'s preload does). `None`: the whole region.
    #[serde(default)]
    pub commit_limit: Option<u64>,
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
            aging_block: default_aging_block(),
            readahead: Readahead::default(),
            pcp: true,
            lru_lock: LruLockMode::Mutex,
            lru_policy: LruPolicy::default(),
            references: References::default(),
            lru_batch: DEFAULT_LRU_BATCH,
            breakdown: false,
            memcg: None,
            commit_limit: None,
        }
    }

    pub fn limit_pages(&self) -> u64 {
        self.memory_limit / PAGE_SIZE as u64
    }

    /// Pages of a region of `pages` that may hold data at once ([`Config::commit_limit`]).
    pub fn commit_pages(&self, pages: u64) -> u64 {
        self.commit_limit
            .map_or(pages, |bytes| bytes.div_ceil(PAGE_SIZE as u64).min(pages))
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
        if self.swap.read_poll_us > 10_000 {
            return Err(Error::invalid(
                "read poll",
                format!(
                    "{} µs: use 0 (sleep on swap-in reads at once) to 10000",
                    self.swap.read_poll_us
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
        if !(1..=512).contains(&self.aging_block) {
            return Err(Error::invalid(
                "aging block",
                format!(
                    "{} pages: use 1 (each page alone) to 512 pages (2 MiB)",
                    self.aging_block
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
        if !(1..=256).contains(&self.lru_batch) {
            return Err(Error::invalid(
                "LRU batch",
                format!("{}: use 1 (no batching) to 256 pages", self.lru_batch),
            ));
        }
        self.readahead.validate()?;
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
    fn fault_plans_must_hold_probabilities() {
        FaultPlan::default().validate().unwrap();
        FaultPlan::transient(1, 0.2).validate().unwrap();
        let bad = FaultPlan {
            write_flip: 1.5,
            ..FaultPlan::default()
        };
        let msg = bad.validate().unwrap_err().to_string();
        assert!(msg.contains("write_flip") && msg.contains("1.5"), "{msg}");
        let bad = FaultPlan {
            read_eio: f64::NAN,
            ..FaultPlan::default()
        };
        assert!(bad.validate().is_err());
        let msg = FaultPlan::transient(1, 0.3)
            .validate()
            .unwrap_err()
            .to_string();
        assert!(msg.contains("read fault rates"), "{msg}");
    }

    #[test]
    fn named_modes_parse_print_and_list_the_names_on_error() {
        assert_eq!("percpu".parse::<SlotAlloc>().unwrap(), SlotAlloc::Percpu);
        assert_eq!(SwapCacheMode::Single.to_string(), "single");
        assert_eq!(ReadaheadPolicy::ALL.len(), 5);
        for p in ReadaheadPolicy::ALL {
            assert_eq!(p.name().parse::<ReadaheadPolicy>().unwrap(), *p);
        }
        let msg = "sideways"
            .parse::<ReadaheadPolicy>()
            .unwrap_err()
            .to_string();
        assert!(
            msg.contains("readahead policy") && msg.contains("`vma`"),
            "{msg}"
        );
        assert_eq!(IoMode::Auto.resolve(true), IoMode::Pread);
        assert_eq!(IoMode::Auto.resolve(false), IoMode::Uring);
        assert_eq!(
            IoMode::Uring.resolve(true),
            IoMode::Uring,
            "asked for: kept"
        );
        assert_eq!("auto".parse::<IoMode>().unwrap(), IoMode::Auto);
        let mut c = Config::new(1 << 20);
        c.readahead.page_cluster = 9;
        assert!(c
            .validate()
            .unwrap_err()
            .to_string()
            .contains("page-cluster"));
    }

    #[test]
    fn watermarks_parse_as_sizes() {
        let w = Watermarks::parse("4K,8K,1M").unwrap();
        assert_eq!((w.min, w.low, w.high), (1, 2, 256));
        assert!(Watermarks::parse("4K,8K").is_err());
    }
}
