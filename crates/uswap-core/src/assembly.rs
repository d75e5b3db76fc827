//! A region's assembly: its memory (`mm`), reclaim, fault path and fault source, built in
//! that order and held, with the swap space promised to it. Below the public handle
//! (`region.rs`) and below `fork.rs`, which copies an assembly for a child and builds it
//! again there.

use crate::config::{Config, FaultMode, References, Watermarks};
use crate::error::{Error, Result};
use crate::fault::FaultPath;
use crate::fork_image::RegionImage;
use crate::handler::{HandlerConfig, Handlers};
use crate::lockdep::Rank;
use crate::lockstat::{LockClass, StatMutex};
use crate::mapping::Mapping;
use crate::mm::lender::Lender;
use crate::mm::{Caps, Mm, Parts};
use crate::mmap_changing::MmapChanging;
use crate::page::MAX_FRAMES;
use crate::sigbus;
use crate::signals::Quiet;
use crate::staging::Staging;
use crate::swapfile::SwapDevice;
use crate::uffd::{self, Uffd};
use crate::vmscan::Reclaim;
use crate::PAGE_SIZE;
use std::sync::Arc;
use std::thread::JoinHandle;

/// Where faults come from.
enum Source {
    Handlers(Handlers),
    Sigbus(sigbus::Service),
}

/// What a region's pages hold when it is built.
pub(crate) enum Contents<'a> {
    /// Nothing: every page is untouched.
    Untouched,
    /// A fork child's inherited data.
    Forked(&'a RegionImage),
    /// Whatever the program wrote in these page runs (sorted) before the region was built
    /// on its memory: the pages the kernel has mapped there become resident.
    Written(&'a [std::ops::Range<usize>]),
}

/// What a region is made of.
pub(crate) struct Assembly {
    pub(crate) fault: Arc<FaultPath>,
    pub(crate) reservation: SwapReservation,
    /// Watermarks the configuration fixed, kept when the memory limit changes.
    pub(crate) watermarks: Option<Watermarks>,
    kswapd: Option<JoinHandle<()>>,
    source: Option<Source>,
    /// The configuration it was made with, to make a fork child's copy the same way.
    cfg: Config,
    /// Set in a fork child for a region it did not inherit: its threads do not exist
    /// there, so it is never dropped.
    pub(crate) abandoned: std::sync::atomic::AtomicBool,
}

/// The userfaultfd features a region needs: the error names the first one missing.
fn features(
    probe: &uffd::Probe,
    required: &[(u64, &'static str)],
    optional: &[u64],
) -> Result<u64> {
    let mut features = 0;
    for &(bit, feature) in required {
        if !probe.has(bit) {
            return Err(Error::UnsupportedFeature {
                kernel: probe.kernel.clone(),
                feature,
            });
        }
        features |= bit;
    }
    Ok(features
        | optional
            .iter()
            .filter(|&&b| probe.has(b))
            .fold(0, |a, b| a | b))
}

const MOVE: (u64, &str) = (uffd::FEATURE_MOVE, "UFFDIO_MOVE (Linux 6.8 or later)");
const SIGBUS: (u64, &str) = (
    uffd::FEATURE_SIGBUS,
    "UFFD_FEATURE_SIGBUS (Linux 4.14 or later)",
);
/// What `References::Written` needs: write protection resolved by the kernel, whose
/// written bits `PAGEMAP_SCAN` reads (both Linux 6.7).
const WRITTEN_BITS: [(u64, &str); 2] = [
    (
        uffd::FEATURE_WP,
        "UFFD_FEATURE_PAGEFAULT_FLAG_WP (Linux 5.7 or later), which --references written \
         needs (leave it out: faults)",
    ),
    (
        uffd::FEATURE_WP_ASYNC,
        "UFFD_FEATURE_WP_ASYNC (Linux 6.7 or later), which --references written needs \
         (leave it out: faults)",
    ),
];
const EVENTS: [(u64, &str); 3] = [
    (
        uffd::FEATURE_EVENT_REMAP,
        "UFFD_FEATURE_EVENT_REMAP (Linux 4.11 or later)",
    ),
    (
        uffd::FEATURE_EVENT_REMOVE,
        "UFFD_FEATURE_EVENT_REMOVE (Linux 4.11 or later)",
    ),
    (
        uffd::FEATURE_EVENT_UNMAP,
        "UFFD_FEATURE_EVENT_UNMAP (Linux 4.11 or later)",
    ),
];

/// The userfaultfd features of a region in `mode` (resolved) with `references`: the error
/// names the first one the kernel lacks.
fn region_features(probe: &uffd::Probe, mode: FaultMode, references: References) -> Result<u64> {
    let mut optional = vec![uffd::FEATURE_POISON, uffd::FEATURE_THREAD_ID];
    let mut required = vec![MOVE];
    required.extend(EVENTS);
    if mode == FaultMode::Sigbus {
        required.push(SIGBUS);
    }
    match references {
        References::Faults => optional.push(uffd::FEATURE_WP),
        References::Written => required.extend(WRITTEN_BITS),
    }
    features(probe, &required, &optional)
}

/// Whether this kernel gives a region in `mode` with `references` what it needs
/// (userfaultfd and its features); the error says what is missing.
pub(crate) fn check_kernel(mode: FaultMode, references: References) -> Result<()> {
    region_features(&uffd::probe()?, mode.resolve(), references).map(|_| ())
}

fn register(uffd: &Uffd, addr: usize, len: usize, mode: u64) -> Result<()> {
    uffd.register(addr, len, mode).map_err(|source| Error::Os {
        op: "UFFDIO_REGISTER",
        source,
    })
}

impl Assembly {
    /// Builds a region on `map`, whose page runs `owned` are its own (all of it, but in a
    /// fork child, the runs the parent had not unmapped, or in memory the program used
    /// before, the runs no other mapping took), its pages holding `contents`.
    pub(crate) fn build(
        cfg: Config,
        swap: Arc<SwapDevice>,
        map: Mapping,
        owned: &[std::ops::Range<usize>],
        contents: Contents<'_>,
    ) -> Result<Assembly> {
        let mut cfg = cfg;
        cfg.fault_mode = cfg.fault_mode.resolve();
        let pages = (map.len() / PAGE_SIZE) as u64;
        let limit = cfg.limit_pages();
        let needed = cfg.commit_pages(pages).saturating_sub(limit);
        if needed > swap.capacity_pages() {
            return Err(Error::RegionTooLarge {
                region: cfg.commit_pages(pages) * PAGE_SIZE as u64,
                memory: limit * PAGE_SIZE as u64,
                swap: swap.capacity_pages() * PAGE_SIZE as u64,
            });
        }
        let reservation = SwapReservation::new(&swap, needed)?;

        let probe = uffd::probe()?;
        let mmap_changing = Arc::new(MmapChanging::default());
        let uffd = Uffd::open(
            region_features(&probe, cfg.fault_mode, cfg.references)?,
            mmap_changing.clone(),
        )?;
        // Staging has a userfaultfd of its own, without events: freeing a staging frame must
        // not raise an event that blocks reclaim until a handler reads it. Nothing should
        // ever fault there; if something does, SIGBUS makes it loud.
        // Its moves take pages out of the region, so they pass the region's fence too.
        let staging_uffd = Uffd::open(
            features(&probe, &[MOVE], &[uffd::FEATURE_WP, uffd::FEATURE_SIGBUS])?,
            mmap_changing.clone(),
        )?;
        // With written bits, write protection says only that: no write-protect fault ever
        // reaches uswap, so none can mark a clean page dirty or a shared one copied.
        let written_bits = cfg.references == References::Written;
        let caps = Caps {
            write_protect: probe.has(uffd::FEATURE_WP) && !written_bits,
            written_bits,
            poison: probe.has(uffd::FEATURE_POISON),
        };
        // No more pages can be parked than the region has, whatever the limit.
        let cpus = if cfg.pcp { crate::cpu::count() } else { 0 };
        let staging = Staging::new(limit, pages.min(MAX_FRAMES), cpus)?;
        // Every range is registered with the same modes: UFFDIO_MOVE needs both sides with
        // the same page protection, and the destination registered with the ioctl's fd.
        let mode = uffd::REGISTER_MODE_MISSING
            | if caps.write_protect || caps.written_bits {
                uffd::REGISTER_MODE_WP
            } else {
                0
            };
        for run in owned {
            let (addr, len) = (map.addr() + run.start * PAGE_SIZE, run.len() * PAGE_SIZE);
            register(&uffd, addr, len, mode)?;
        }
        let staging_map = staging.mapping();
        register(&staging_uffd, staging_map.addr(), staging_map.len(), mode)?;
        let mm = Mm::new(Parts {
            map,
            staging,
            mmap_changing,
            uffd,
            staging_uffd,
            swap,
            lenders: match contents {
                Contents::Forked(image) => image.lenders.clone(),
                _ => Vec::new(),
            },
            caps,
            limit,
            mode: cfg.fault_mode,
            fault_around: cfg.fault_around,
            bounce_buffers: cfg.handler_threads + 2,
            pcp: cfg.pcp,
            memcg: cfg.memcg.clone(),
            lru_lock: cfg.lru_lock,
            lru_batch: cfg.lru_batch,
            lru_policy: cfg.lru_policy,
            breakdown: cfg.breakdown,
        })?;
        match contents {
            Contents::Untouched => {}
            Contents::Forked(image) => image.apply(&mm, owned),
            Contents::Written(runs) => {
                adopt_present(&mm, runs)?;
                mm.unmap_outside(owned);
            }
        }
        let reclaim = Reclaim::new(
            mm,
            cfg.watermarks,
            cfg.inactive_percent,
            cfg.reclaim_batch,
            cfg.aging_block,
        );
        let fault = Arc::new(FaultPath::new(reclaim, cfg.fault_around, cfg.readahead));
        let mut inner = Assembly {
            reservation,
            watermarks: cfg.watermarks,
            kswapd: None,
            source: None,
            fault: fault.clone(),
            cfg,
            abandoned: Default::default(),
        };
        inner.kswapd = Some(crate::vmscan::spawn_kswapd(
            fault.clone(),
            FaultPath::reclaim,
            crate::walker::after_reclaim,
        )?);
        inner.source = Some(match inner.cfg.fault_mode {
            // `build` resolved auto.
            FaultMode::Thread | FaultMode::Auto => Source::Handlers(Handlers::start(
                &fault,
                HandlerConfig {
                    threads: inner.cfg.handler_threads,
                    spin_us: inner.cfg.handler_spin_us,
                },
            )?),
            FaultMode::Sigbus => Source::Sigbus(sigbus::register(&fault)?),
        });
        Ok(inner)
    }

    pub(crate) fn fault(&self) -> &Arc<FaultPath> {
        &self.fault
    }

    /// The statistics of every lock class of the region and its swap device.
    pub(crate) fn lockstat(&self) -> Vec<LockClass> {
        let mm = self.fault.mm();
        let mut classes = vec![mm.lru().lockstat(), mm.lru().batch_lockstat()];
        classes.extend(mm.staging().lockstat());
        classes.extend(mm.swap().lockstat());
        classes.extend(self.fault.lockstat());
        classes.push(self.fault.reclaim().lockstat());
        classes.push(LockClass::sum("fork_fence", [mm.fork_fence()]));
        if let Some(Source::Handlers(h)) = &self.source {
            classes.extend(h.lockstat());
        }
        classes.push(mm.latency().lockstat());
        classes.extend(mm.breakdown().map(|b| b.lockstat()));
        classes
    }

    pub(crate) fn config(&self) -> &Config {
        &self.cfg
    }

    /// In a fork child, for the parent's region copied into the child's memory: closes the
    /// descriptors that act on the parent (its userfaultfds and pagemap; its swap file and
    /// rings, once per device, `closed` listing those done), and what an ancestor lent it,
    /// but for what the child borrows (`lenders`: swap files stay open, staging areas
    /// mapped), and marks it never to be dropped.
    pub(crate) fn abandon_in_child(&self, lenders: &[Lender], closed: &mut Vec<*const SwapDevice>) {
        if self.abandoned.load(std::sync::atomic::Ordering::Relaxed) {
            return;
        }
        if let Some(Source::Sigbus(s)) = &self.source {
            s.forget_in_child();
        }
        let mm = self.fault.mm();
        mm.close_in_child();
        let lent = |l: &Lender| lenders.iter().any(|k| k.same(l));
        let device = Arc::as_ptr(mm.swap());
        if !closed.contains(&device) {
            mm.swap()
                .close_in_child(lent(&Lender::Device(mm.swap().clone())));
            closed.push(device);
        }
        // What an ancestor lent this region stays only if the child borrows from it too.
        for lender in mm.lenders().iter().filter(|l| !lent(l)) {
            match lender {
                Lender::Device(d) if !closed.contains(&Arc::as_ptr(d)) => {
                    d.close_file_in_child();
                    closed.push(Arc::as_ptr(d));
                }
                Lender::Device(_) => {}
                Lender::Staging { .. } => lender.keep_only(&[]),
            }
        }
        self.abandoned
            .store(true, std::sync::atomic::Ordering::Relaxed);
    }
}

/// The pages of `runs` the kernel has mapped become resident pages of the region, read
/// from pagemap 64 pages at a time: a page uswap believed untouched while it was mapped
/// would be neither charged nor ever reclaimed. Pages mapped elsewhere too are shared.
fn adopt_present(mm: &Mm, runs: &[std::ops::Range<usize>]) -> Result<()> {
    let mut entries = [Default::default(); 64];
    // Mapped in another process too (a fork child's, from a parent whose region was not
    // built either) or the kernel's zero page: shared, as a fork child's pages are.
    let mut shared = Vec::new();
    for run in runs {
        let mut first = run.start;
        while first < run.end {
            let n = entries.len().min(run.end - first);
            if !mm.pagemap_entries(first, &mut entries[..n]) {
                return Err(Error::Os {
                    op: "reading /proc/self/pagemap for the pages written before uswap",
                    source: std::io::Error::last_os_error(),
                });
            }
            for (i, entry) in entries[..n].iter_mut().enumerate() {
                if entry.swapped {
                    *entry = brought_back(mm, first + i)?;
                }
                match (entry.present, entry.exclusive) {
                    (true, true) => mm.adopt_mapped(&mut mm.pages().lock(first + i), false),
                    (true, false) => shared.push(first + i),
                    (false, _) => {}
                }
            }
            first += n;
        }
    }
    crate::fork_image::share(mm, &shared);
    Ok(())
}

/// Page `page`, out in the kernel's swap (or being migrated) when the region was built,
/// read so that the kernel brings it back (such a page raises no userfaultfd fault), and
/// its pagemap entry then: a page left there would come back later uncharged, and a
/// child of fork would not get it.
fn brought_back(mm: &Mm, page: usize) -> Result<crate::mm::PagemapEntry> {
    // SAFETY: a page of the region's own mapping, which the kernel maps back on this read.
    unsafe { std::ptr::read_volatile(mm.page_addr(page) as *const u8) };
    let mut entry = [Default::default()];
    if mm.pagemap_entries(page, &mut entry) && entry[0].present {
        return Ok(entry[0]);
    }
    Err(Error::Os {
        op: "bringing back a page the kernel had swapped out before uswap watched it",
        source: std::io::Error::from_raw_os_error(libc::EAGAIN),
    })
}

/// Swap space promised to one region, given back when the region is dropped.
pub(crate) struct SwapReservation {
    swap: Arc<SwapDevice>,
    pages: StatMutex<u64>,
}

impl SwapReservation {
    fn new(swap: &Arc<SwapDevice>, pages: u64) -> Result<Self> {
        reserve(swap, pages)?;
        Ok(SwapReservation {
            swap: swap.clone(),
            pages: StatMutex::new(Rank::Reservation, pages),
        })
    }

    /// Makes the promise at least `pages` (a lowered memory limit needs more swap).
    pub(crate) fn grow_to(&self, pages: u64) -> Result<()> {
        let mut held = self.pages.lock();
        let more = pages.saturating_sub(*held);
        if more > 0 {
            reserve(&self.swap, more)?;
            *held += more;
        }
        Ok(())
    }
}

/// Reserves `pages` of `swap`, or says how short it is.
fn reserve(swap: &SwapDevice, pages: u64) -> Result<()> {
    if swap.reserve(pages) {
        return Ok(());
    }
    Err(Error::SwapExhausted {
        needed: pages,
        free: swap.capacity_pages().saturating_sub(swap.reserved_pages()),
        capacity: swap.capacity_pages(),
    })
}

impl Drop for SwapReservation {
    fn drop(&mut self) {
        self.swap.unreserve(*self.pages.lock());
    }
}

impl Drop for Assembly {
    fn drop(&mut self) {
        let _quiet = Quiet::new();
        match self.source.take() {
            Some(Source::Handlers(h)) => h.stop(),
            Some(Source::Sigbus(s)) => s.stop(),
            None => {}
        }
        self.fault.vma().drain_events();
        self.fault.reclaim().stop_kswapd();
        if let Some(k) = self.kswapd.take() {
            let _ = k.join();
        }
        let mm = self.fault.mm();
        for p in 0..mm.pages().len() {
            if let Some(slot) = mm.pages().peek(p).0.slot() {
                mm.release_slot(slot);
            }
        }
        // The mappings are unregistered and unmapped when the last reference to the fault
        // path (held only here now) goes, just after this.
    }
}

#[cfg(all(test, not(loom)))]
mod tests {
    use super::*;

    fn probe(feature_bits: u64) -> uffd::Probe {
        uffd::Probe {
            kernel: "6.6".into(),
            features: Vec::new(),
            feature_bits,
        }
    }

    #[test]
    fn written_references_need_asynchronous_write_protection() {
        let base = uffd::FEATURE_MOVE
            | uffd::FEATURE_EVENT_REMAP
            | uffd::FEATURE_EVENT_REMOVE
            | uffd::FEATURE_EVENT_UNMAP
            | uffd::FEATURE_WP;
        let old = probe(base);
        let err = region_features(&old, FaultMode::Thread, References::Written).unwrap_err();
        assert!(
            err.to_string().contains("UFFD_FEATURE_WP_ASYNC (Linux 6.7"),
            "{err}"
        );
        let faults = region_features(&old, FaultMode::Thread, References::Faults).unwrap();
        assert_eq!(faults, base, "faults: synchronous write protection");
        let new = probe(base | uffd::FEATURE_WP_ASYNC);
        let written = region_features(&new, FaultMode::Thread, References::Written).unwrap();
        assert_eq!(written, base | uffd::FEATURE_WP_ASYNC);
        let faults = region_features(&new, FaultMode::Thread, References::Faults).unwrap();
        assert_eq!(
            faults & uffd::FEATURE_WP_ASYNC,
            0,
            "asked for only when wanted"
        );
    }
}
