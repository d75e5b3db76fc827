//! A region: anonymous memory backed by uswap, and its lifetime.

use crate::config::{Config, FaultMode, Watermarks, MAX_SIZE};
use crate::error::{Error, Result};
use crate::lru::Lru;
use crate::page::{Kind, PageTable, MAX_FRAMES};
use crate::page_alloc::{FrameBudget, Mapping, Staging};
use crate::stats::{FaultKind, FaultLatency, Latency, Stats, VmStat};
use crate::swap_io::PageBuf;
use crate::swapfile::SwapDevice;
use crate::uffd::{self, Uffd};
use crate::vmscan::Kswapd;
use crate::{handler, sigbus, PAGE_SIZE};
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering::Relaxed};
use std::sync::{Arc, Mutex};
use std::thread::JoinHandle;

/// What the kernel lets this region use beyond the required MISSING and MOVE support.
#[derive(Clone, Copy, Debug)]
pub(crate) struct Caps {
    /// Write-protect faults: a swapped-in page keeps its slot until written.
    pub write_protect: bool,
    /// UFFDIO_POISON: a page that cannot be served fails every access with SIGBUS.
    pub poison: bool,
}

/// What to do with a range of a region, as `madvise` does for ordinary memory.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Advice {
    /// Move resident pages to the inactive list (like MADV_COLD).
    Cold,
    /// Write the pages out and free their memory now (like MADV_PAGEOUT).
    PageOut,
}

/// State shared by the application's faults, the handler threads and the reclaimer.
pub(crate) struct RegionCore {
    pub map: Mapping,
    pub pages: PageTable,
    pub lru: Lru,
    pub budget: FrameBudget,
    pub staging: Staging,
    pub swap: Arc<SwapDevice>,
    pub uffd: Uffd,
    pub caps: Caps,
    pub cfg: Config,
    pub marks: Watermarks,
    /// Inactive list length reclaim keeps, in pages.
    pub inactive_target: usize,
    pub vmstat: VmStat,
    pub latency: FaultLatency,
    pub kswapd: Kswapd,
    /// Source of zeros for first-touch fills: never written, so it reads as the zero page.
    pub zeros: Mapping,
    bounce: Mutex<Vec<PageBuf>>,
    /// Swap slots this region's pages hold.
    pub slots_held: AtomicU64,
    pub shutdown: AtomicBool,
}

impl RegionCore {
    pub fn page_addr(&self, page: usize) -> usize {
        self.map.addr() + page * PAGE_SIZE
    }

    /// The page containing `addr`, if it is inside the region.
    pub fn page_of(&self, addr: usize) -> Option<usize> {
        let off = addr.checked_sub(self.map.addr())?;
        (off < self.map.len()).then_some(off / PAGE_SIZE)
    }

    pub fn take_bounce(&self) -> PageBuf {
        self.bounce
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .pop()
            .unwrap_or_default()
    }

    pub fn return_bounce(&self, buf: PageBuf) {
        self.bounce
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .push(buf);
    }

    /// Frees a slot a page of this region held.
    pub fn release_slot(&self, slot: u32) {
        self.swap.free_slot(slot);
        self.slots_held.fetch_sub(1, Relaxed);
    }

    pub fn record(&self, kind: FaultKind, since: std::time::Instant) {
        self.latency.record(kind, since.elapsed());
    }
}

/// Anonymous memory of `len()` bytes that may exceed the memory limit: cold pages go to the
/// swap device and come back on access. Dropping the region frees its memory and slots.
pub struct Region {
    core: Arc<RegionCore>,
    _reservation: SwapReservation,
    workers: Vec<JoinHandle<()>>,
    handlers: Option<handler::Handlers>,
}

fn required_features(probe: &uffd::Probe, mode: FaultMode) -> Result<u64> {
    let need = |bit: u64, feature: &'static str| {
        if probe.has(bit) {
            Ok(bit)
        } else {
            Err(Error::UnsupportedFeature {
                kernel: probe.kernel.clone(),
                feature,
            })
        }
    };
    let mut features = need(uffd::FEATURE_MOVE, "UFFDIO_MOVE (Linux 6.8 or later)")?;
    if mode == FaultMode::Sigbus {
        features |= need(
            uffd::FEATURE_SIGBUS,
            "UFFD_FEATURE_SIGBUS (Linux 4.14 or later)",
        )?;
    }
    for optional in [
        uffd::FEATURE_WP,
        uffd::FEATURE_POISON,
        uffd::FEATURE_THREAD_ID,
    ] {
        if probe.has(optional) {
            features |= optional;
        }
    }
    Ok(features)
}

impl Region {
    /// A region of `size` bytes (rounded up to pages) with its own swap device.
    pub fn new(size: u64, cfg: Config) -> Result<Region> {
        cfg.validate()?;
        let swap = SwapDevice::open(&cfg.swap)?;
        Region::with_swap(size, cfg, swap)
    }

    /// A region that swaps to `swap`, which other regions may share.
    pub fn with_swap(size: u64, cfg: Config, swap: Arc<SwapDevice>) -> Result<Region> {
        cfg.validate()?;
        if size == 0 || size > MAX_SIZE || size.div_ceil(PAGE_SIZE as u64) >= u32::MAX as u64 {
            return Err(Error::invalid(
                "region size",
                format!("{size} bytes: use between 4 KiB and 16 TiB"),
            ));
        }
        let limit = cfg.limit_pages();
        if limit > MAX_FRAMES {
            return Err(Error::invalid(
                "memory limit",
                format!("{} bytes: at most 1 TiB per region", cfg.memory_limit),
            ));
        }
        let pages = size.div_ceil(PAGE_SIZE as u64);
        let needed = pages.saturating_sub(limit);
        if needed > swap.capacity_pages() {
            return Err(Error::RegionTooLarge {
                region: pages * PAGE_SIZE as u64,
                memory: limit * PAGE_SIZE as u64,
                swap: swap.capacity_pages() * PAGE_SIZE as u64,
            });
        }
        let reservation = SwapReservation::new(&swap, needed)?;

        let probe = uffd::probe()?;
        let uffd = Uffd::open(required_features(&probe, cfg.fault_mode)?)?;
        let caps = Caps {
            write_protect: probe.has(uffd::FEATURE_WP),
            poison: probe.has(uffd::FEATURE_POISON),
        };
        let map = Mapping::new(pages as usize * PAGE_SIZE)?;
        let staging = Staging::new(limit)?;
        // Both ranges are registered with the same modes: UFFDIO_MOVE needs the destination
        // registered and both sides with the same page protection.
        let mode = uffd::REGISTER_MODE_MISSING
            | if caps.write_protect {
                uffd::REGISTER_MODE_WP
            } else {
                0
            };
        for m in [&map, staging.mapping()] {
            uffd.register(m.addr(), m.len(), mode)
                .map_err(|source| Error::Os {
                    op: "UFFDIO_REGISTER",
                    source,
                })?;
        }
        let core = Arc::new(RegionCore {
            pages: PageTable::new(pages as usize),
            lru: Lru::new(pages as usize),
            budget: FrameBudget::new(limit),
            marks: cfg.watermarks(),
            inactive_target: (limit as usize * cfg.inactive_percent as usize / 100)
                .max(cfg.reclaim_batch),
            zeros: Mapping::new(cfg.fault_around * PAGE_SIZE)?,
            map,
            staging,
            swap,
            uffd,
            caps,
            vmstat: VmStat::default(),
            latency: FaultLatency::default(),
            kswapd: Kswapd::default(),
            bounce: Mutex::new(Vec::new()),
            slots_held: AtomicU64::new(0),
            shutdown: AtomicBool::new(false),
            cfg,
        });
        let mut region = Region {
            _reservation: reservation,
            workers: vec![crate::vmscan::spawn_kswapd(core.clone())?],
            handlers: None,
            core,
        };
        match region.core.cfg.fault_mode {
            FaultMode::Thread => region.handlers = Some(handler::Handlers::start(&region.core)?),
            FaultMode::Sigbus => sigbus::register(&region.core)?,
        }
        Ok(region)
    }

    /// Start of the region. Its pages read as zeros until written.
    pub fn as_ptr(&self) -> *mut u8 {
        self.core.map.addr() as *mut u8
    }

    pub fn len(&self) -> usize {
        self.core.map.len()
    }

    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }

    pub fn swap_device(&self) -> &Arc<SwapDevice> {
        &self.core.swap
    }

    /// The event counters alone: cheap enough to poll.
    pub fn vmstat(&self) -> crate::VmStatSnapshot {
        self.core.vmstat.snapshot()
    }

    pub fn stats(&self) -> Stats {
        let c = &self.core;
        Stats {
            vmstat: c.vmstat.snapshot(),
            first_touch: Latency::of(&c.latency.merged(FaultKind::FirstTouch)),
            minor: Latency::of(&c.latency.merged(FaultKind::Minor)),
            major: Latency::of(&c.latency.merged(FaultKind::Major)),
            resident_pages: c.budget.resident(),
            swap_used_pages: c.slots_held.load(Relaxed),
        }
    }

    /// Applies `advice` to the pages overlapping `[offset, offset + len)`.
    pub fn advise(&self, offset: usize, len: usize, advice: crate::Advice) -> Result<()> {
        let end = offset
            .checked_add(len)
            .filter(|&e| e <= self.len())
            .ok_or_else(|| {
                Error::invalid(
                    "advise range",
                    format!(
                        "{offset}+{len} is outside the region of {} bytes",
                        self.len()
                    ),
                )
            })?;
        let pages = offset / PAGE_SIZE..end.div_ceil(PAGE_SIZE);
        let batch = self.core.cfg.reclaim_batch;
        let starts: Vec<usize> = pages.clone().step_by(batch).collect();
        for first in &starts {
            let chunk = *first..(*first + batch).min(pages.end);
            self.core
                .deactivate(self.core.lock_kind(chunk, Kind::Active));
        }
        if advice == crate::Advice::PageOut {
            for first in starts {
                let chunk = first..(first + batch).min(pages.end);
                self.core.evict(self.core.lock_kind(chunk, Kind::Inactive));
            }
        }
        Ok(())
    }
}

/// Swap space promised to one region, given back when the region is dropped.
struct SwapReservation {
    swap: Arc<SwapDevice>,
    pages: u64,
}

impl SwapReservation {
    fn new(swap: &Arc<SwapDevice>, pages: u64) -> Result<Self> {
        if !swap.reserve(pages) {
            return Err(Error::SwapExhausted {
                needed: pages,
                free: swap.capacity_pages().saturating_sub(swap.reserved_pages()),
                capacity: swap.capacity_pages(),
            });
        }
        Ok(SwapReservation {
            swap: swap.clone(),
            pages,
        })
    }
}

impl Drop for SwapReservation {
    fn drop(&mut self) {
        self.swap.unreserve(self.pages);
    }
}

impl Drop for Region {
    fn drop(&mut self) {
        let core = &self.core;
        core.shutdown.store(true, Relaxed);
        if core.cfg.fault_mode == FaultMode::Sigbus {
            sigbus::unregister(core);
        }
        if let Some(h) = self.handlers.take() {
            h.stop();
        }
        core.kswapd.wake();
        for w in self.workers.drain(..) {
            let _ = w.join();
        }
        for p in 0..core.pages.len() {
            if let Some(slot) = core.pages.peek(p).0.slot() {
                core.release_slot(slot);
            }
        }
        // The mappings are unmapped when the core is dropped just after this.
    }
}
