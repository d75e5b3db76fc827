//! A region: anonymous memory backed by uswap, its creation, public calls and lifetime. The
//! top layer: it builds the parts (mm -> reclaim -> fault path -> fault source) and holds
//! them.

use crate::assembly::{Assembly, Contents};
use crate::config::{Config, LruPolicy, Readahead, References, MAX_SIZE};
use crate::error::{Error, Result};
use crate::lru::LruList;
use crate::mapping::Mapping;
use crate::mm::check_page_size;
use crate::page::{Kind, MAX_FRAMES};
use crate::signals::Quiet;
use crate::stats::{FaultKind, Latency, LruStats, Stats};
use crate::swapfile::SwapDevice;
use crate::MAX_MEMORY;
use crate::PAGE_SIZE;
use std::cell::UnsafeCell;
use std::mem::ManuallyDrop;
use std::ops::Range;
use std::sync::Arc;

/// What to do with a range of a region, as `madvise` does for ordinary memory.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Advice {
    /// Move resident pages to the inactive list (like MADV_COLD).
    Cold,
    /// Write the pages out and free their memory now (like MADV_PAGEOUT).
    PageOut,
}

/// Anonymous memory of `len()` bytes that may exceed the memory limit: cold pages go to the
/// swap device and come back on access. Dropping the region frees its memory and slots.
///
/// The program may `madvise(MADV_DONTNEED/MADV_FREE)`, `munmap` and `mremap` region memory
/// as it would ordinary memory (see `docs/architecture.md` for what each does here), and
/// `fork`: the child gets a region of its own holding the memory as it was (`fork.rs`).
pub struct Region {
    /// Replaced only in a child of `fork`, while the child has one thread (`fork.rs`);
    /// boxed so the fork registry can find it where the `Region` moves.
    inner: ManuallyDrop<Box<UnsafeCell<Assembly>>>,
}

// SAFETY: `Assembly` is Send and Sync; the cell is written only by `fork::child`, in a process
// that has a single thread at that moment and no reference into the old contents.
unsafe impl Send for Region {}
unsafe impl Sync for Region {}

impl Region {
    /// A region of `size` bytes (rounded up to pages) with its own swap device.
    pub fn new(size: u64, cfg: Config) -> Result<Region> {
        cfg.validate()?;
        let swap = SwapDevice::open(&cfg.swap)?;
        Region::with_swap(size, cfg, swap)
    }

    /// A region that swaps to `swap`, which other regions may share.
    pub fn with_swap(size: u64, cfg: Config, swap: Arc<SwapDevice>) -> Result<Region> {
        let pages = check_size(size, &cfg)?;
        let map = Mapping::new(pages as usize * PAGE_SIZE)?;
        let whole = 0..pages as usize;
        let owned = std::slice::from_ref(&whole);
        Region::assembled(Assembly::build(cfg, swap, map, owned, Contents::Untouched)?)
    }

    /// A region on `map`, memory the program used before uswap watched it (`uswap run`
    /// builds a small program's region only when it grows past its start-up allowance).
    /// The page runs `lent` (sorted) hold other mappings now and are not the region's; in
    /// the runs `written` (sorted), the pages the kernel has mapped become resident pages,
    /// charged and active. The caller's other threads must not touch `map` meanwhile. On
    /// an error `map` is gone (unmapped): a program living in it must stop.
    pub fn adopt(
        map: Mapping,
        cfg: Config,
        lent: &[Range<usize>],
        written: &[Range<usize>],
    ) -> Result<Region> {
        let pages = check_size(map.len() as u64, &cfg)? as usize;
        for (what, runs) in [("lent runs", lent), ("written runs", written)] {
            let ordered = runs.windows(2).all(|w| w[0].end <= w[1].start);
            if !ordered || runs.iter().any(|r| r.start > r.end || r.end > pages) {
                return Err(Error::invalid(
                    what,
                    format!("{runs:?}: page runs must be sorted, apart and within {pages} pages"),
                ));
            }
        }
        let swap = SwapDevice::open(&cfg.swap)?;
        let mut owned = Vec::with_capacity(lent.len() + 1);
        let mut next = 0;
        for gap in lent.iter().chain(std::iter::once(&(pages..pages))) {
            if gap.start > next {
                owned.push(next..gap.start);
            }
            next = gap.end;
        }
        // A fork child gets region memory only through uswap's fork handlers from now on.
        for run in &owned {
            map.inherit_on_fork(run.start, run.len(), false);
        }
        let contents = Contents::Written(written);
        Region::assembled(Assembly::build(cfg, swap, map, &owned, contents)?)
    }

    /// Whether a region of `size` bytes with `cfg` can be made here: its sizes, the page
    /// size, userfaultfd and the features its fault mode needs; the error says what is
    /// wrong. For a program that builds its region later (`Region::adopt`) and wants to
    /// be told at its start.
    pub fn check(size: u64, cfg: &Config) -> Result<()> {
        check_size(size, cfg)?;
        crate::assembly::check_kernel(cfg.fault_mode, cfg.references)
    }

    fn assembled(inner: Assembly) -> Result<Region> {
        let region = Region {
            inner: ManuallyDrop::new(Box::new(UnsafeCell::new(inner))),
        };
        crate::fork::register(&region.inner);
        Ok(region)
    }

    fn inner(&self) -> &Assembly {
        // SAFETY: see `Region::inner`; only a fork child's single thread replaces it.
        unsafe { &*self.inner.get() }
    }

    /// The region's memory, for unit tests of the layers under it.
    #[cfg(all(test, not(loom)))]
    pub(crate) fn mm(&self) -> &crate::mm::Mm {
        self.inner().fault().mm()
    }

    /// The region's fault path (with its reclaim and vma events), for unit tests of the
    /// layers under it.
    #[cfg(all(test, not(loom)))]
    pub(crate) fn fault_path(&self) -> &crate::fault::FaultPath {
        self.inner().fault()
    }

    /// Start of the region. Its pages read as zeros until written.
    pub fn as_ptr(&self) -> *mut u8 {
        self.inner().fault.mm().start() as *mut u8
    }

    pub fn len(&self) -> usize {
        self.inner().fault.mm().len()
    }

    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }

    pub fn swap_device(&self) -> &Arc<SwapDevice> {
        self.inner().fault.mm().swap()
    }

    /// The event counters alone: cheap enough to poll.
    pub fn vmstat(&self) -> crate::VmStatSnapshot {
        self.inner().fault.mm().vmstat().snapshot()
    }

    pub fn stats(&self) -> Stats {
        let _quiet = Quiet::new();
        let mm = self.inner().fault.mm();
        let latency = |kind| Latency::of(&mm.latency().merged(kind));
        Stats {
            vmstat: mm.vmstat().snapshot(),
            first_touch: latency(FaultKind::FirstTouch),
            minor: latency(FaultKind::Minor),
            major: latency(FaultKind::Major),
            resident_pages: mm.resident(),
            swap_used_pages: mm.slots_held(),
            shared_pages: mm.shared_pages(),
            fork_lent_slots: mm.swap().fork_shared_slots(),
            borrowed_pages: mm.borrowed_pages(),
            metadata_bytes: metadata_bytes(mm.pages().len() as u64),
            lru: LruStats {
                policy: mm.workingset().policy(),
                active: mm.lru().len(LruList::Active) as u64,
                inactive: mm.lru().len(LruList::Inactive) as u64,
                probation: mm.lru().len(LruList::Probation) as u64,
            },
            io: mm.swap().io_stats(),
            swap_cache: mm.swap().cache().stats(),
            readahead: self.inner().fault.readahead.get(),
            charge_stock: mm.budget().stock_stats(),
            lockstat: self.inner().lockstat(),
            ztier: mm.swap().ztier_stats(),
        }
    }

    /// Checks that page states, LRU lists, budget, staging frames and swap slots agree;
    /// the error lists every disagreement. It stops faults and reclaim while it walks:
    /// for tests and debugging.
    pub fn check_invariants(&self) -> std::result::Result<(), String> {
        let _quiet = Quiet::new();
        let fault = &self.inner().fault;
        crate::walker::check_region(fault.mm(), &fault.vma())
    }

    /// Test hook: the next fault that needs the full path (swap-in, reclaim) panics inside
    /// uswap, as a bug would. The fault it held must fail loudly (SIGBUS for the faulting
    /// thread, counted in `handler_panics`), never hang.
    #[doc(hidden)]
    pub fn inject_handler_panic(&self) {
        self.inner().fault.inject_panic();
    }

    /// Test hook: the background reclaimer's next wake-up panics, as a bug would. It must
    /// start again (counted in `handler_panics`), never leave reclaim to stop.
    #[doc(hidden)]
    pub fn inject_kswapd_panic(&self) {
        self.inner().fault.reclaim().inject_kswapd_panic();
    }

    /// Test hook: the next read of the region's userfaultfd fails with EIO. The process
    /// must stop loudly (SIGABRT, with a message), never leave faults asleep for ever.
    #[doc(hidden)]
    pub fn inject_uffd_read_error(&self) {
        self.inner().fault.mm().uffd().fail_next_read();
    }

    /// Test hook: takes the page at `offset` out of the region's page tables without telling
    /// uswap, as a hardware error or a bug would. The next access must fail loudly (counted
    /// in `unexplained_faults`), never loop.
    #[doc(hidden)]
    pub fn simulate_lost_page(&self, offset: usize) {
        let _quiet = Quiet::new();
        let mm = self.inner().fault.mm();
        let page = offset / PAGE_SIZE;
        let _lock = mm.pages().lock(page);
        if let Some(&frame) = mm.staging().alloc_many(1).first() {
            let moved = mm.staging_uffd().move_pages(
                mm.staging().addr(frame),
                mm.page_addr(page),
                PAGE_SIZE,
                false,
            );
            assert!(moved.is_ok(), "test hook: the page could not be taken out");
            mm.staging().release(frame);
        }
    }

    /// Where the time of faults and reclaim went so far, phase by phase; `None` unless
    /// `Config::breakdown` is on. [`PhaseTimes::since`] gives an interval.
    pub fn phase_times(&self) -> Option<crate::PhaseTimes> {
        self.inner().fault.mm().breakdown().map(|b| b.times())
    }

    /// The memory limit in force, in bytes (whole pages).
    pub fn memory_limit(&self) -> u64 {
        self.inner().fault.mm().budget().limit() * PAGE_SIZE as u64
    }

    /// Pages resident now (active + inactive): cheap enough to poll.
    pub fn resident_pages(&self) -> u64 {
        self.inner().fault.mm().resident()
    }

    /// Pages of the region's data uswap keeps in memory: resident, in the compressed
    /// pool (its size in pages), and, in a fork child, mapped copy-on-write with the
    /// parent, which holds and is charged for them. Cheap enough to poll.
    pub fn held_pages(&self) -> u64 {
        let mm = self.inner().fault.mm();
        mm.budget().resident() + mm.shared_pages()
    }

    /// The swap-in readahead in force (`auto` as the policy it chose for the device).
    pub fn readahead(&self) -> Readahead {
        self.inner().fault.readahead.get()
    }

    /// Switches swap-in readahead while the region is in use (the seed's sysfs knob): the
    /// next swap-in uses the new policy and page-cluster.
    pub fn set_readahead(&self, readahead: Readahead) -> Result<()> {
        let _quiet = Quiet::new();
        readahead.validate()?;
        self.inner().fault.readahead.set(readahead);
        Ok(())
    }

    /// How aging sees that a mapped page is in use (fixed when the region was made).
    pub fn references(&self) -> References {
        match self.inner().fault.mm().caps().written_bits {
            true => References::Written,
            false => References::Faults,
        }
    }

    /// The LRU policy in force.
    pub fn lru_policy(&self) -> LruPolicy {
        self.inner().fault.mm().workingset().policy()
    }

    /// Switches the LRU policy while the region is in use: pages mapped from now on are
    /// placed by it, and aging follows it from its next batch (`workingset.rs`).
    pub fn set_lru_policy(&self, policy: LruPolicy) {
        self.inner().fault.mm().workingset().set_policy(policy);
    }

    /// Changes the memory limit while the region is in use. A lower limit is reached by
    /// reclaim (kswapd is woken; faults reclaim directly meanwhile) and needs the swap to
    /// hold what no longer fits; a higher one lets more pages stay resident.
    pub fn set_memory_limit(&self, bytes: u64) -> Result<()> {
        let _quiet = Quiet::new();
        let mut cfg = Config::new(bytes);
        cfg.watermarks = self.inner().watermarks;
        cfg.validate()?;
        let limit = cfg.limit_pages();
        if limit > MAX_FRAMES {
            return Err(Error::invalid(
                "memory limit",
                format!(
                    "{bytes} bytes: at most {MAX_MEMORY} bytes (128 GiB less a page) per region"
                ),
            ));
        }
        let pages = self.inner().fault.mm().pages().len() as u64;
        let committable = self.inner().config().commit_pages(pages);
        self.inner()
            .reservation
            .grow_to(committable.saturating_sub(limit))?;
        self.inner().fault.reclaim().set_limit(limit);
        Ok(())
    }

    /// Brings every page of the region that is out on swap back into memory and frees
    /// their slots, as `swapoff` does for a device (`try_to_unuse`): pages in address
    /// order, each swap-in reading ahead by the readahead policy in force. `progress` gets
    /// (pages done, pages to do) now and then. The memory limit must already hold the
    /// whole region's data (see [`Region::set_memory_limit`]). Pages that cannot be read
    /// back are reported (their accesses fail loudly) and counted in the result.
    pub fn swapoff(&self, progress: &mut dyn FnMut(u64, u64)) -> Result<SwapoffReport> {
        let _quiet = Quiet::new();
        let start = std::time::Instant::now();
        let mm = self.inner().fault.mm();
        let out_of_memory =
            |p: usize| matches!(mm.pages().peek(p).0.kind(), Kind::Swapped | Kind::Inactive);
        let out: Vec<usize> = (0..mm.pages().len())
            .filter(|&p| out_of_memory(p))
            .collect();
        let swapped = out
            .iter()
            .filter(|&&p| mm.pages().peek(p).0.kind() == Kind::Swapped)
            .count() as u64;
        // Room above the high watermark too: below it kswapd would push pages out again.
        let need = mm.budget().resident() + swapped + self.inner().fault.reclaim().high_watermark();
        if need > mm.budget().limit() {
            return Err(Error::invalid(
                "memory limit",
                format!(
                    "swapoff needs {} MiB of limit ({swapped} pages are out on swap, plus the \
                     reclaim watermark) but the limit is {} MiB: raise it with \
                     set_memory_limit first",
                    (need * PAGE_SIZE as u64).div_ceil(1 << 20),
                    (mm.budget().limit() * PAGE_SIZE as u64) >> 20
                ),
            ));
        }
        let total = out.len() as u64;
        let mut report = SwapoffReport::default();
        let mut last = std::time::Instant::now();
        progress(0, total);
        for (done, &p) in out.iter().enumerate() {
            match self.inner().fault.unuse(p) {
                crate::fault::Outcome::Fatal => report.lost += 1,
                _ => report.pages += 1,
            }
            if last.elapsed() >= std::time::Duration::from_millis(200) {
                progress(done as u64 + 1, total);
                last = std::time::Instant::now();
            }
        }
        for p in 0..mm.pages().len() {
            report.slots_freed += u64::from(self.inner().fault.forget_slot(p));
        }
        // Like the kernel's try_to_unuse, swapoff is done only when nothing is left out: the
        // program may have pushed pages out meanwhile (faulting in more than the room left).
        let left = (0..mm.pages().len())
            .filter(|&p| mm.pages().peek(p).0.kind() == Kind::Swapped)
            .count();
        if left > 0 {
            return Err(Error::invalid(
                "memory limit",
                format!(
                    "swapoff brought {} pages back but {left} went out again meanwhile (the \
                     program used more memory): raise the limit and call swapoff again",
                    report.pages
                ),
            ));
        }
        progress(total, total);
        report.seconds = start.elapsed().as_secs_f64();
        Ok(report)
    }

    /// The program is done with `[offset, offset + len)` and has discarded it with
    /// `MADV_DONTNEED`, which has returned: every page of it reads as zeros from now on.
    /// This closes a window the discard event leaves open: between uswap's handling of the
    /// event and the kernel's zap, reclaim may move a still-mapped page out to a staging
    /// frame (it must, to keep the data of a page `MADV_FREE`d and written again), and the
    /// zap then finds nothing. An allocator that hands discarded memory out again as zeros
    /// calls this after `madvise` and before reuse (the preload library of `uswap run`
    /// does); the range must not be touched meanwhile. A program that reads discarded
    /// memory back without this may see its old contents there instead of zeros (see
    /// docs/architecture.md, "Known gap").
    pub fn forget(&self, offset: usize, len: usize) -> Result<()> {
        let end = offset
            .checked_add(len)
            .filter(|&e| e <= self.len())
            .ok_or_else(|| {
                Error::invalid(
                    "forget range",
                    format!(
                        "{offset}+{len} is outside the region of {} bytes",
                        self.len()
                    ),
                )
            })?;
        let _quiet = Quiet::new();
        // On a program thread that runs with syscall dispatch (the preload's `free`), the
        // discard's own calls (a page lock's backoff among them) must go straight to the
        // kernel: a dispatched one pins its buffers, and a pinned page that is out waits
        // for the vma events to be handled, while the SIGBUS service thread, handling the
        // very discard that made this call, waits for the page locks held here.
        let _allowed = crate::sud::Allowed::new();
        // And it begins once the service thread is done with the events it has read (the
        // REMOVE of the program's `madvise` among them): a fault on this thread's own
        // stack while the locks below are held is retried until no events are pending,
        // which would never be while that thread waits for these locks.
        while self.inner().fault.events_pending() {
            crate::sync::give_way();
        }
        let start = self.as_ptr() as usize;
        self.inner().fault.vma().forget(start + offset, start + end);
        Ok(())
    }

    /// Applies `advice` to the pages overlapping `[offset, offset + len)`.
    pub fn advise(&self, offset: usize, len: usize, advice: Advice) -> Result<()> {
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
        let _quiet = Quiet::new();
        let reclaim = self.inner().fault.reclaim();
        // Pages waiting in per-CPU batches join their lists first, as the advice expects.
        reclaim.mm().lru().drain_all();
        let pages = offset / PAGE_SIZE..end.div_ceil(PAGE_SIZE);
        let batch = ADVISE_BATCH;
        let chunks = || {
            pages
                .clone()
                .step_by(batch)
                .map(move |first| first..(first + batch).min(pages.end))
        };
        for chunk in chunks() {
            let mut locks = reclaim.lock_kind(chunk, Kind::Active);
            // Advice goes by what the program says, not by how the pages were used.
            locks.iter_mut().for_each(|l| {
                l.second_chance();
            });
            reclaim.deactivate(&mut locks, LruList::Active);
        }
        if advice == Advice::PageOut {
            for chunk in chunks() {
                reclaim.evict(&mut reclaim.lock_kind(chunk, Kind::Inactive));
            }
        }
        Ok(())
    }
}

/// Checks a region's size against its configuration; its pages.
fn check_size(size: u64, cfg: &Config) -> Result<u64> {
    cfg.validate()?;
    check_page_size()?;
    if size == 0 || size > MAX_SIZE || size.div_ceil(PAGE_SIZE as u64) >= u32::MAX as u64 {
        return Err(Error::invalid(
            "region size",
            format!("{size} bytes: use between 4 KiB and 16 TiB"),
        ));
    }
    if cfg.limit_pages() > MAX_FRAMES {
        return Err(Error::invalid(
            "memory limit",
            format!(
                "{} bytes: at most {MAX_MEMORY} bytes (128 GiB less a page) per region",
                cfg.memory_limit
            ),
        ));
    }
    Ok(size.div_ceil(PAGE_SIZE as u64))
}

/// Pages `advise` locks and moves at a time.
const ADVISE_BATCH: usize = 64;

/// What [`Region::swapoff`] did.
#[derive(Clone, Copy, Debug, Default, PartialEq, serde::Serialize)]
pub struct SwapoffReport {
    /// Pages brought back into memory (swapped or parked inactive before).
    pub pages: u64,
    /// Pages whose data could not be read back (each was reported; accesses fail).
    pub lost: u64,
    /// Swap slots given up by resident pages afterwards.
    pub slots_freed: u64,
    pub seconds: f64,
}

/// Memory uswap keeps per region page beyond the limit: the page word, the LRU links and
/// the shadow an evicted page leaves (`workingset.rs`).
pub fn metadata_bytes(pages: u64) -> u64 {
    pages * (8 + 12 + 4)
}

impl Drop for Region {
    fn drop(&mut self) {
        // Out of the registry first: a fork from now on leaves this region alone.
        crate::fork::unregister(&self.inner);
        // A fork child's copy of a region it did not inherit is left alone: its threads
        // and mappings are the parent's.
        if !self
            .inner()
            .abandoned
            .load(std::sync::atomic::Ordering::Relaxed)
        {
            // SAFETY: dropped once, here; the region is not used after.
            unsafe { ManuallyDrop::drop(&mut self.inner) };
        }
    }
}

/// Regions for the unit tests of the layers under the region: real ones, in thread mode,
/// that need no root (see `uffd.rs`).
#[cfg(all(test, not(loom)))]
pub(crate) mod testing {
    use super::Region;
    use crate::config::ReadaheadPolicy;
    use crate::{Config, FaultMode, PAGE_SIZE};

    /// A thread-mode region of `pages` pages under a 1 MiB limit, without readahead, with
    /// `change` made to its configuration; each of its first `written` pages holds its
    /// number plus one in its first byte, and no page waits in an LRU batch.
    pub fn region(pages: usize, written: usize, change: impl FnOnce(&mut Config)) -> Region {
        let mut cfg = Config::new(1 << 20);
        cfg.fault_mode = FaultMode::Thread;
        cfg.readahead.policy = ReadaheadPolicy::None;
        // Pages of one byte repeated would all stay in the compressed tier.
        cfg.swap.ztier.enabled = false;
        change(&mut cfg);
        let region = Region::new((pages * PAGE_SIZE) as u64, cfg).unwrap();
        for page in 0..written {
            // SAFETY: inside the region.
            unsafe { byte_at(&region, page).write_volatile(page as u8 + 1) };
        }
        region.mm().lru().drain_all();
        region
    }

    /// The first byte of `page`; reading it is an access like the program's.
    pub fn byte_at(region: &Region, page: usize) -> *mut u8 {
        assert!(page * PAGE_SIZE < region.len());
        // SAFETY: inside the region.
        unsafe { region.as_ptr().add(page * PAGE_SIZE) }
    }

    /// Reads the first byte of `page` as the program would (a fault if it is not mapped).
    pub fn read(region: &Region, page: usize) -> u8 {
        // SAFETY: inside the region.
        unsafe { byte_at(region, page).read_volatile() }
    }
}
