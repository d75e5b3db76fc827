//! The memory of one region and what backs it (the kernel's `mm_struct` and its anonymous
//! vma, reduced to what uswap needs): the mapping, its page table and LRU lists, the
//! resident budget, the staging frames, the swap slots it holds, the userfaultfds, and the
//! counters. The bottom layer: reclaim (`vmscan`) and the fault path (`fault`) are built on
//! it, and it knows neither. Lock order: `lockdep.rs`.

pub(crate) mod events;
pub(crate) mod lender;
mod pagemap;

use pagemap::Pagemap;
pub(crate) use pagemap::PagemapEntry;

use lender::Lender;

use crate::breakdown::Breakdown;
use crate::budget::Budget;
use crate::config::FaultMode;
use crate::error::{Error, Result};
use crate::gup::Pins;
use crate::lockdep::Rank;
use crate::lockstat::StatRwLock;
use crate::lru::Lru;
use crate::mapping::Mapping;
use crate::mmap_changing::MmapChanging;
use crate::page::{Kind, PageTable};
use crate::staging::Staging;
use crate::stats::{FaultKind, FaultLatency, VmEvent, VmStat};
use crate::swapfile::swap_io::PageBuf;
use crate::swapfile::swap_state::CacheEntry;
use crate::swapfile::SwapDevice;
use crate::uffd::Uffd;
use crate::workingset::Workingset;
use crate::PAGE_SIZE;
use std::sync::atomic::{AtomicBool, AtomicU32, AtomicU64, Ordering::Relaxed};
use std::sync::Arc;
use std::time::Instant;

/// What the kernel lets this region use beyond the required MISSING, MOVE and event support.
#[derive(Clone, Copy, Debug)]
pub(crate) struct Caps {
    /// Write-protect faults: a swapped-in page keeps its slot until written.
    pub write_protect: bool,
    /// Written bits (`References::Written`): the region's write protection is resolved by
    /// the kernel, and aging reads which pages were written ([`Mm::take_written`]).
    pub written_bits: bool,
    /// UFFDIO_POISON: a page that cannot be served fails every access with SIGBUS.
    pub poison: bool,
}

/// Swap-in buffers taken and given back with one atomic each: a signal handler may take
/// one (a mutex-guarded list could need to grow, and allocate, on the way back).
struct BouncePool {
    bufs: Box<[std::cell::UnsafeCell<PageBuf>]>,
    taken: Box<[AtomicBool]>,
}

// SAFETY: a buffer is only reached through the `Bounce` that holds its `taken` flag.
unsafe impl Sync for BouncePool {}

impl BouncePool {
    fn new(n: usize) -> BouncePool {
        BouncePool {
            bufs: (0..n)
                .map(|_| std::cell::UnsafeCell::new(PageBuf::new()))
                .collect(),
            taken: (0..n).map(|_| AtomicBool::new(false)).collect(),
        }
    }

    fn take(&self, may_alloc: bool) -> Option<Bounce<'_>> {
        let free = self.taken.iter().position(|t| {
            t.compare_exchange(false, true, std::sync::atomic::Ordering::Acquire, Relaxed)
                .is_ok()
        });
        match free {
            // SAFETY: the flag just taken makes this buffer ours until the Bounce drops.
            Some(i) => Some(Bounce {
                buf: unsafe { &mut *self.bufs[i].get() }.as_mut_ptr(),
                back: Some(&self.taken[i]),
                _own: None,
            }),
            None if may_alloc => {
                let mut own = PageBuf::new();
                Some(Bounce {
                    buf: own.as_mut_ptr(),
                    back: None,
                    _own: Some(own),
                })
            }
            None => None,
        }
    }
}

/// One page-aligned swap-in buffer, given back on drop.
pub(crate) struct Bounce<'a> {
    buf: *mut u8,
    back: Option<&'a AtomicBool>,
    _own: Option<PageBuf>,
}

impl Bounce<'_> {
    pub fn as_ptr(&self) -> *const u8 {
        self.buf
    }

    pub fn as_mut_ptr(&mut self) -> *mut u8 {
        self.buf
    }
}

impl Drop for Bounce<'_> {
    fn drop(&mut self) {
        if let Some(flag) = self.back {
            flag.store(false, std::sync::atomic::Ordering::Release);
        }
    }
}

/// The pieces a region is made of, built by `Region::with_swap`.
pub(crate) struct Parts {
    pub map: Mapping,
    pub staging: Staging,
    pub mmap_changing: Arc<MmapChanging>,
    pub uffd: Uffd,
    pub staging_uffd: Uffd,
    pub swap: Arc<SwapDevice>,
    /// What a fork child's borrowed pages are read from.
    pub lenders: Vec<Lender>,
    pub caps: Caps,
    pub limit: u64,
    pub mode: FaultMode,
    pub fault_around: usize,
    pub bounce_buffers: usize,
    /// Per-CPU stocks and lists in front of the shared budget and frame lists.
    pub pcp: bool,
    /// The memory cgroup to charge (`None`: a private one of `limit`).
    pub memcg: Option<std::sync::Arc<crate::memcg::MemCgroup>>,
    pub lru_lock: crate::config::LruLockMode,
    pub lru_batch: usize,
    pub lru_policy: crate::config::LruPolicy,
    pub breakdown: bool,
}

pub(crate) struct Mm {
    // Fields drop in this order: the mappings go while still registered (cheap: closing a
    // userfaultfd first would walk every page of them to clear write protection), then the
    // userfaultfds. The region itself is unmapped by `Drop for Mm`, before all of these.
    map: Mapping,
    zeros: Mapping,
    staging: Staging,
    /// The fence between reading vma events and filling pages (both userfaultfds).
    mmap_changing: Arc<MmapChanging>,
    uffd: Uffd,
    staging_uffd: Uffd,
    pages: PageTable,
    /// Ranges a system call is reading or writing (SIGBUS mode): aging leaves them mapped.
    pins: Pins,
    lru: Lru,
    workingset: Workingset,
    budget: Budget,
    /// Pages of the compressed pool charged to `budget` (`Reclaim::balance_ztier`): the
    /// budget counts them beside the resident pages.
    pool_charged: AtomicU64,
    swap: Arc<SwapDevice>,
    /// What this fork child's borrowed pages (`PageState::borrowed`) are read from.
    lenders: Vec<Lender>,
    /// Borrowed pages.
    borrowed_pages: AtomicU64,
    caps: Caps,
    mode: FaultMode,
    vmstat: VmStat,
    latency: FaultLatency,
    /// Per-phase times, when asked for (`Config::breakdown`).
    breakdown: Option<Breakdown>,
    /// Swap slots this region's pages hold.
    slots_held: AtomicU64,
    /// Pages shared copy-on-write with the process that made them (`PageState::shared`).
    shared_pages: AtomicU64,
    /// Page-sized buffers for swap-in, preallocated so the fault path allocates nothing.
    bounce: BouncePool,
    /// `/proc/self/pagemap`, to tell whether a page the table calls active is really mapped.
    pagemap: Option<Pagemap>,
    shutdown: AtomicBool,
    /// See [`Mm::reclaim_paused`].
    reclaim_paused: AtomicU32,
    fork_fence: StatRwLock,
    /// This region's number in its swap device's swap cache and owner table.
    id: u32,
}

/// Region numbers, unique in the process (0 means none in the swap cache's entries).
static NEXT_REGION_ID: std::sync::atomic::AtomicU32 = std::sync::atomic::AtomicU32::new(1);

fn next_region_id() -> u32 {
    loop {
        let id = NEXT_REGION_ID.fetch_add(1, Relaxed);
        if id != 0 {
            return id;
        }
    }
}

impl Mm {
    pub fn new(p: Parts) -> Result<Mm> {
        let pages = p.map.len() / PAGE_SIZE;
        let cpus = if p.pcp { crate::cpu::count() } else { 0 };
        let budget = match p.memcg {
            None => Budget::new(p.limit, cpus),
            Some(cg) => Budget::in_group(cg, cpus).ok_or_else(|| {
                Error::invalid(
                    "memory cgroup",
                    format!(
                        "its {} member slots are all taken: too many processes of the tree \
                         use uswap at once",
                        crate::memcg::MEMBERS
                    ),
                )
            })?,
        };
        let pagemap = Pagemap::open();
        if let (true, Err(e)) = (p.caps.written_bits, &pagemap) {
            return Err(Error::invalid(
                "references",
                format!(
                    "written bits are read from /proc/self/pagemap, which cannot be opened \
                     ({e}); leave out --references written"
                ),
            ));
        }
        Ok(Mm {
            zeros: Mapping::new(p.fault_around * PAGE_SIZE)?,
            pages: PageTable::new(pages),
            pins: Pins::new(),
            lru: Lru::new(pages, p.lru_lock, p.lru_batch, crate::cpu::count()),
            workingset: Workingset::new(pages, p.lru_policy),
            budget,
            pool_charged: AtomicU64::new(0),
            bounce: BouncePool::new(p.bounce_buffers),
            pagemap: pagemap.ok(),
            uffd: p.uffd,
            staging_uffd: p.staging_uffd,
            map: p.map,
            staging: p.staging,
            mmap_changing: p.mmap_changing,
            swap: p.swap,
            lenders: p.lenders,
            borrowed_pages: AtomicU64::new(0),
            caps: p.caps,
            mode: p.mode,
            vmstat: VmStat::default(),
            latency: FaultLatency::default(),
            breakdown: p.breakdown.then(Breakdown::new),
            slots_held: AtomicU64::new(0),
            shared_pages: AtomicU64::new(0),
            shutdown: AtomicBool::new(false),
            reclaim_paused: AtomicU32::new(0),
            fork_fence: StatRwLock::new(Rank::ForkFence),
            id: next_region_id(),
        })
    }

    pub fn pages(&self) -> &PageTable {
        &self.pages
    }

    pub fn pins(&self) -> &Pins {
        &self.pins
    }

    pub fn lru(&self) -> &Lru {
        &self.lru
    }

    pub fn workingset(&self) -> &Workingset {
        &self.workingset
    }

    /// The region's number (swap slot owners name it).
    pub fn id(&self) -> u32 {
        self.id
    }

    pub fn budget(&self) -> &Budget {
        &self.budget
    }

    /// Pages the budget counts that are resident (it also counts the compressed pool).
    pub fn resident(&self) -> u64 {
        self.budget.resident().saturating_sub(self.pool_charged())
    }

    /// Pages of the compressed pool charged to the budget.
    pub fn pool_charged(&self) -> u64 {
        self.pool_charged.load(Relaxed)
    }

    /// Charges `pages` of pool growth to the budget (past the limit: reclaim brings it
    /// back), or, negative, takes pages the pool gave back off it (never more than was
    /// charged).
    pub fn charge_pool(&self, pages: i64) {
        if pages >= 0 {
            self.pool_charged.fetch_add(pages as u64, Relaxed);
            self.budget.overdraw(pages as u64);
            return;
        }
        let want = pages.unsigned_abs();
        let took = self
            .pool_charged
            .fetch_update(Relaxed, Relaxed, |c| Some(c - c.min(want)))
            .map_or(0, |c| c.min(want));
        self.budget.uncharge(took);
    }

    pub fn staging(&self) -> &Staging {
        &self.staging
    }

    pub fn swap(&self) -> &Arc<SwapDevice> {
        &self.swap
    }

    /// [`Mm::read_swapped`] of a borrowed page, for the SIGBUS handler: allocates
    /// nothing; false when the full path must read it (and report what fails).
    ///
    /// # Safety
    /// As [`Mm::read_swapped`].
    pub unsafe fn read_borrowed_in_signal(
        &self,
        state: crate::page::PageState,
        dst: *mut u8,
        stack_room: bool,
    ) -> bool {
        let Some((lender, at)) = state.borrowed() else {
            return false;
        };
        let lender = &self.lenders[lender as usize];
        lender.read(at, dst, Some(stack_room)).is_ok()
    }

    /// What this fork child's borrowed pages are read from.
    pub fn lenders(&self) -> &[Lender] {
        &self.lenders
    }

    /// Pages whose data is borrowed from what a fork ancestor lent.
    pub fn borrowed_pages(&self) -> u64 {
        self.borrowed_pages.load(Relaxed)
    }

    /// Whether borrowed page `state` (swapped, locked) is mapped clean when it is read
    /// (see `PageState::borrowed`): its lender is a swap device, which holds the slot for
    /// as long as this process may need it (as the kernel keeps a page whose slot is
    /// shared in the swap cache, read-only, however often it is read). A staging frame's
    /// copy is let go once read, and so cannot be read again.
    pub fn maps_borrowed_clean(&self, state: crate::page::PageState) -> bool {
        let Some((lender, _)) = state.borrowed() else {
            return false;
        };
        self.caps.write_protect && matches!(self.lenders[lender as usize], Lender::Device(_))
    }

    /// A borrowed page (`held`, what its state was) is no longer: its lender may let go
    /// of its copy, and the count goes down. Nothing for a page that was not borrowed.
    pub(crate) fn returned(&self, held: crate::page::PageState) {
        if let Some((lender, at)) = held.borrowed() {
            self.lenders[lender as usize].let_go(at);
            self.borrowed_pages.fetch_sub(1, Relaxed);
        }
    }

    /// Reads the data of a swapped page (`state`, locked) into `dst` and checks it, from
    /// its own slot or from what a fork ancestor lent.
    ///
    /// # Safety
    /// `dst` must be valid for writing 4096 bytes until this returns, and page-aligned.
    pub unsafe fn read_swapped(
        &self,
        state: crate::page::PageState,
        dst: *mut u8,
    ) -> std::result::Result<(), crate::swapfile::ReadError> {
        match (state.slot(), state.borrowed()) {
            (Some(slot), _) => self.swap.read_page(slot, dst),
            (None, Some((lender, at))) => self.lenders[lender as usize].read(at, dst, None),
            (None, None) => unreachable!("a swapped page has a slot: {state:?}"),
        }
    }

    /// The region's userfaultfd: faults, events, and every fill of region pages.
    pub fn uffd(&self) -> &Uffd {
        &self.uffd
    }

    /// The staging area's userfaultfd (no events): moves into staging go through it.
    pub fn staging_uffd(&self) -> &Uffd {
        &self.staging_uffd
    }

    pub fn caps(&self) -> Caps {
        self.caps
    }

    /// Counts `n` events of one kind in this region's vmstat; returns the count before.
    pub fn count(&self, event: VmEvent, n: u64) -> u64 {
        self.vmstat.count(event, n)
    }

    /// Takes back `n` events counted ahead of a fill that failed (see `stats::VmStat`).
    pub fn uncount(&self, event: VmEvent, n: u64) {
        self.vmstat.uncount(event, n);
    }

    pub fn vmstat(&self) -> &VmStat {
        &self.vmstat
    }

    pub fn latency(&self) -> &FaultLatency {
        &self.latency
    }

    pub fn breakdown(&self) -> Option<&Breakdown> {
        self.breakdown.as_ref()
    }

    /// Whether vma events are being read or handled: page states may be about to change.
    pub fn mmap_changing(&self) -> bool {
        self.mmap_changing.changing()
    }

    /// In a fork child, for the abandoned parent's region: closes its userfaultfds and its
    /// `/proc/self/pagemap` (which names the parent's memory). Never used again after.
    pub(crate) fn close_in_child(&self) {
        // SAFETY: descriptors of the abandoned region, never used by the child again.
        unsafe {
            libc::close(self.uffd.raw());
            libc::close(self.staging_uffd.raw());
            if let Some(pagemap) = &self.pagemap {
                libc::close(pagemap.raw());
            }
        }
    }

    /// The fence fills pass. Inside it no vma event is read, so the kernel's zap of a
    /// discard (which waits for its event to be read) cannot land meanwhile.
    pub(crate) fn fill_gate(&self) -> &MmapChanging {
        &self.mmap_changing
    }

    /// Whether vma events are being handled: moves out of the region back out meanwhile.
    pub fn mmap_events_held(&self) -> bool {
        self.mmap_changing.events_held()
    }

    /// A source of zeros for first-touch fills (never written).
    pub fn zeros(&self) -> usize {
        self.zeros.addr()
    }

    pub fn start(&self) -> usize {
        self.map.addr()
    }

    pub fn len(&self) -> usize {
        self.map.len()
    }

    pub fn page_addr(&self, page: usize) -> usize {
        self.map.addr() + page * PAGE_SIZE
    }

    /// The page containing `addr`, if it is inside the region.
    pub fn page_of(&self, addr: usize) -> Option<usize> {
        let off = addr.checked_sub(self.map.addr())?;
        (off < self.map.len()).then_some(off / PAGE_SIZE)
    }

    /// Pages of the region overlapping `[start, end)`, clipped to it.
    pub fn pages_in(&self, start: usize, end: usize) -> std::ops::Range<usize> {
        let lo = start.max(self.start()).min(self.start() + self.len());
        let hi = end.max(lo).min(self.start() + self.len());
        (lo - self.start()) / PAGE_SIZE..(hi - self.start()).div_ceil(PAGE_SIZE)
    }

    /// Whether the invariant walker holds every page lock, or a fork holds mapped pages in
    /// place (`Mm::fork_fence`): reclaim finds little to take meanwhile, which is not a
    /// sign of being out of memory.
    pub fn reclaim_paused(&self) -> bool {
        self.reclaim_paused.load(Relaxed) > 0
    }

    /// Starts (`true`) or ends one pause of reclaim (the walker's, a fork's; they may
    /// overlap).
    pub(crate) fn set_reclaim_paused(&self, paused: bool) {
        if paused {
            self.reclaim_paused.fetch_add(1, Relaxed);
        } else {
            self.reclaim_paused.fetch_sub(1, Relaxed);
        }
    }

    /// Whether a fork child gets the page runs `runs` (the region's own) mapped as they
    /// are, shared copy-on-write by the kernel (only while a fork's handlers run: a fork
    /// they do not see must not give a child region memory without its swapped pages).
    pub(crate) fn inherit_on_fork(&self, runs: &[std::ops::Range<usize>], inherit: bool) {
        for run in runs {
            self.map.inherit_on_fork(run.start, run.len(), inherit);
        }
    }

    /// Held exclusive by a fork from its snapshot of the region until the child exists,
    /// shared (try-lock) by aging around its moves: no mapped page leaves the region while
    /// the fork counts on the kernel to give it to the child.
    pub(crate) fn fork_fence(&self) -> &StatRwLock {
        &self.fork_fence
    }

    pub fn shutting_down(&self) -> bool {
        self.shutdown.load(Relaxed)
    }

    pub fn shut_down(&self) {
        self.shutdown.store(true, Relaxed);
    }

    /// Wakes a thread waiting on `page` in thread mode (it retries the access).
    pub fn wake(&self, page: usize) {
        if self.mode == FaultMode::Thread {
            let _ = self.uffd.wake(self.page_addr(page), PAGE_SIZE);
        }
    }

    /// A slot a page of this region now holds (written out, or rehomed).
    pub fn slots_taken(&self, n: u64) {
        self.slots_held.fetch_add(n, Relaxed);
    }

    /// Frees a slot a page of this region held, deleting it from the swap cache first.
    pub fn release_slot(&self, slot: u32) {
        self.swap.cache().delete(slot);
        self.swap.free_slot(slot);
        self.slots_held.fetch_sub(1, Relaxed);
    }

    pub fn region_id(&self) -> u32 {
        self.id
    }

    /// The swap cache entry for `page` of this region.
    pub fn cache_entry(&self, page: usize, readahead: bool) -> CacheEntry {
        CacheEntry {
            region: self.id,
            page: page as u32,
            readahead,
        }
    }

    /// Records in the swap device that `page` holds `slot` (readahead's hint).
    pub fn own_slot(&self, slot: u32, page: usize) {
        self.swap.set_owner(slot, self.id, page as u32);
    }

    /// Pages mapped copy-on-write with the process that made them, not charged here.
    pub fn shared_pages(&self) -> u64 {
        self.shared_pages.load(Relaxed)
    }

    pub fn slots_held(&self) -> u64 {
        self.slots_held.load(Relaxed)
    }

    /// A bounce buffer from the pool, or (only when `may_alloc`) a new one when the pool
    /// is empty. It goes back when dropped.
    pub fn take_bounce(&self, may_alloc: bool) -> Option<Bounce<'_>> {
        self.bounce.take(may_alloc)
    }

    pub fn record(&self, kind: FaultKind, since: Instant) {
        self.latency.record(kind, since.elapsed());
    }

    /// Whether `page` is mapped in the process's page tables right now, and write-protected
    /// by uswap, from `/proc/self/pagemap`. `None` when pagemap cannot be read. Allocates
    /// nothing (one pread).
    pub fn pagemap_entry(&self, page: usize) -> Option<PagemapEntry> {
        let mut entry = [PagemapEntry::default()];
        self.pagemap_entries(page, &mut entry).then_some(entry[0])
    }

    /// [`Mm::pagemap_entry`] for `into.len()` pages (at most 64) from `first`, in one
    /// pread; false when pagemap cannot be read.
    pub fn pagemap_entries(&self, first: usize, into: &mut [PagemapEntry]) -> bool {
        let addr = self.page_addr(first);
        self.pagemap.as_ref().is_some_and(|p| p.entries(addr, into))
    }

    /// Whether a write to a present page with this pagemap entry faults to uswap first:
    /// it is write-protected, and the protection is uswap's to lift (with written bits
    /// the kernel lifts it at the write, and only notes that it did).
    pub fn write_stops_at(&self, entry: PagemapEntry) -> bool {
        entry.write_protected && !self.caps.written_bits
    }

    /// Which of the `count` pages from `first` were written since this last looked at them
    /// (or were mapped since), pushed onto `written`; those are write-protected again, so
    /// their next write shows ([`Pagemap::take_written`]). Only with written bits
    /// ([`Caps::written_bits`]); false when the scan failed (nothing seen).
    pub fn take_written(&self, first: usize, count: usize, written: &mut Vec<usize>) -> bool {
        let Some(pagemap) = self.pagemap.as_ref().filter(|_| self.caps.written_bits) else {
            return false;
        };
        let (start, end) = (self.page_addr(first), self.page_addr(first + count));
        pagemap.take_written(start, end, |a, b| written.extend(self.pages_in(a, b)))
    }

    /// Unmaps what is still the region's: runs of pages the program did not unmap or move
    /// away. A range the program unmapped may hold someone else's mapping now, and is left
    /// alone. The region is still registered, so each munmap raises an event the kernel
    /// waits to see read: a short-lived thread reads them (the fault sources have stopped).
    fn unmap_owned(&self) {
        let reader = EventSink::start(self.uffd.raw());
        let mut page = 0;
        while page < self.pages.len() {
            let owned = |p: usize| self.pages.peek(p).0.kind() != Kind::Unmapped;
            if !owned(page) {
                page += 1;
                continue;
            }
            let start = page;
            while page < self.pages.len() && owned(page) {
                page += 1;
            }
            let (addr, len) = (self.page_addr(start), (page - start) * PAGE_SIZE);
            if reader.is_none() {
                // Without a reader, unregister first (slower: it walks the range).
                let _ = self.uffd.unregister(addr, len);
            }
            // SAFETY: these pages are the region's own mapping, which nothing uses any more.
            unsafe { libc::munmap(addr as *mut _, len) };
        }
        self.map.disown();
    }
}

/// A thread that reads and drops a userfaultfd's messages until it is stopped.
struct EventSink {
    stop: std::os::fd::OwnedFd,
    thread: Option<std::thread::JoinHandle<()>>,
}

impl EventSink {
    fn start(fd: i32) -> Option<EventSink> {
        use std::os::fd::{AsRawFd, FromRawFd};
        // SAFETY: plain system call; we own the new descriptor.
        let stop = unsafe { libc::eventfd(0, libc::EFD_CLOEXEC) };
        if stop < 0 {
            return None;
        }
        // SAFETY: the descriptor is new and ours.
        let stop = unsafe { std::os::fd::OwnedFd::from_raw_fd(stop) };
        let stop_fd = stop.as_raw_fd();
        let thread = crate::signals::spawn_quiet("uswap-unmap", move || {
            let mut msgs = [crate::uffd::Msg::default(); 16];
            loop {
                let mut fds = [fd, stop_fd].map(|fd| libc::pollfd {
                    fd,
                    events: libc::POLLIN,
                    revents: 0,
                });
                // SAFETY: valid pollfd array.
                unsafe { libc::poll(fds.as_mut_ptr(), 2, -1) };
                if fds[1].revents != 0 {
                    return;
                }
                // SAFETY: reading into a buffer of plain messages.
                unsafe { libc::read(fd, msgs.as_mut_ptr().cast(), std::mem::size_of_val(&msgs)) };
            }
        })
        .ok()?;
        Some(EventSink {
            stop,
            thread: Some(thread),
        })
    }
}

impl Drop for EventSink {
    fn drop(&mut self) {
        use std::os::fd::AsRawFd;
        let one: u64 = 1;
        // SAFETY: writing 8 bytes to our eventfd.
        unsafe { libc::write(self.stop.as_raw_fd(), (&one as *const u64).cast(), 8) };
        if let Some(t) = self.thread.take() {
            let _ = t.join();
        }
    }
}

impl Drop for Mm {
    fn drop(&mut self) {
        self.unmap_owned();
    }
}

/// Refuses to run where the kernel's page size is not the one uswap is built for.
pub(crate) fn check_page_size() -> Result<()> {
    // SAFETY: sysconf has no preconditions.
    let kernel = unsafe { libc::sysconf(libc::_SC_PAGESIZE) };
    if kernel != PAGE_SIZE as libc::c_long {
        return Err(Error::UnsupportedPageSize {
            kernel: kernel as usize,
        });
    }
    Ok(())
}
