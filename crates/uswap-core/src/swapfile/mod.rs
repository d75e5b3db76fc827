//! The swap device: a file of page-sized slots, the slot allocator, and the guard of each
//! written slot (mm/swapfile.c): its seal (encryption on, the default: `seal.rs`) or a
//! CRC32C of the page (encryption off).
//!
//! Guards are kept in memory only, so a page read back is verified against what was
//! written in this process: bad data never reaches the region silently. A page that fails
//! its check is read again a few times before it is given up: the first read may have
//! gone bad in transit.

mod backing;
mod cluster;
mod seal;
mod slot_table;
pub mod swap_io;
mod swap_map;
pub mod swap_state;
mod zpool;
mod zswap;
mod zswap_shrinker;

pub use backing::Backing;
pub use cluster::SlotId;
pub use seal::speed as sealing_speed;
pub use zswap::ZtierStats;

use crate::lockdep::Rank;
use crate::lockstat::{LockClass, StatMutex};
use crate::{Error, IoMode, SlotAlloc, SwapConfig, SwapEncryption, SwapLocation, PAGE_SIZE};
use arrayvec::ArrayVec;
use cluster::ClusterAllocator;
use seal::{Seal, Sealed};
use slot_table::SlotTable;
use std::fs::File;
use std::io;
use std::os::fd::AsRawFd;
use std::os::unix::fs::OpenOptionsExt;
use std::path::Path;
use std::sync::atomic::{AtomicBool, AtomicU32, AtomicU64, Ordering::Relaxed};
use std::sync::Arc;
use std::time::{Duration, Instant};
use swap_io::PageBuf;
use swap_io::{IoEngine, PageOp, SignalBatch, SIGNAL_BATCH};
use swap_map::{Freed, SwapMap};
use swap_state::SwapCache;
use zswap::{Load, Zswap};

/// Slots per cluster, as the kernel's `SWAPFILE_CLUSTER`.
pub const SWAPFILE_CLUSTER: u32 = 256;

const CLUSTER_BYTES: u64 = SWAPFILE_CLUSTER as u64 * PAGE_SIZE as u64;

/// A growing swap file is extended by this much at a time.
const GROW_CHUNK: u64 = 64 << 20;

/// Most slots a device can have: whole clusters whose ids fit a [`SlotId`].
const MAX_SLOTS: u64 = u32::MAX as u64 / SWAPFILE_CLUSTER as u64 * SWAPFILE_CLUSTER as u64;

#[derive(Debug, thiserror::Error)]
pub enum ReadError {
    #[error("swap read failed: {0}")]
    Io(#[from] io::Error),
    #[error(
        "swap slot {slot} is corrupt: checksum {found:#010x}, expected {expected:#010x} \
         (the swap file was modified, or the storage returned bad data)"
    )]
    Checksum {
        slot: SlotId,
        expected: u32,
        found: u32,
    },
    #[error(
        "swap slot {slot} failed authentication: it does not hold what uswap wrote there \
         (the swap file was modified, or the storage returned bad data)"
    )]
    Tag { slot: SlotId },
    #[error("swap slot {slot} was never written (or was freed since)")]
    NeverWritten { slot: SlotId },
    #[error(
        "swap slot {slot}'s page in the compressed pool failed its checksum \
         (uswap's memory was overwritten)"
    )]
    Pool { slot: SlotId },
}

/// Reads of a page whose checksum does not match before it is given up: the first and
/// three re-reads.
pub const READ_TRIES: u32 = 4;

/// The swap device's I/O counters at one moment.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, serde::Serialize)]
pub struct IoStats {
    /// Transfers tried again after a transient error (EAGAIN, EINTR, ENOMEM, EBUSY, EIO on
    /// a read) or a short transfer.
    pub io_retries: u64,
    /// Pages read again because they failed their check (checksum or tag).
    pub rereads: u64,
    /// Reads whose failed check a re-read cured.
    pub reread_healed: u64,
    /// Faults injected by the configured [`crate::config::FaultPlan`].
    pub injected_faults: u64,
    /// Page reads that failed with an I/O error after every retry.
    pub read_errors: u64,
    /// Page reads that still failed their check (checksum or tag) after every re-read.
    pub checksum_errors: u64,
    /// Page writes that failed after every retry.
    pub write_errors: u64,
    /// Emptied clusters punched out of the swap file.
    pub discarded_clusters: u64,
    /// Reads of the file a fault waited for (a readahead window counts once), and their
    /// time in all, ns.
    pub file_reads: u64,
    pub file_read_ns: u64,
}

/// The device's own counters (the I/O engine keeps the rest).
#[derive(Default)]
struct Counters {
    rereads: AtomicU64,
    reread_healed: AtomicU64,
    read_errors: AtomicU64,
    checksum_errors: AtomicU64,
    write_errors: AtomicU64,
    discarded_clusters: AtomicU64,
    /// Reads of the file a fault waited for (a readahead window counts once), and their
    /// time: what a page the compressed pool wrote back costs when it is wanted again.
    file_reads: AtomicU64,
    file_read_ns: AtomicU64,
}

impl Counters {
    fn file_read(&self, started: Instant) {
        self.file_reads.fetch_add(1, Relaxed);
        self.file_read_ns
            .fetch_add(started.elapsed().as_nanos() as u64, Relaxed);
    }

    /// A file read's mean time so far, ns; a disk's guess (100 µs) before the first.
    fn mean_file_read_ns(&self) -> u64 {
        match self.file_reads.load(Relaxed) {
            0 => 100_000,
            n => self.file_read_ns.load(Relaxed) / n,
        }
    }
}

/// This process's pid, taken again in every fork child (a `pthread_atfork` handler, and
/// `fork.rs` for raw clones) before anything there uses a swap device: a device compares
/// it with the pid it was made in on every I/O, one relaxed load.
static PID: AtomicU32 = AtomicU32::new(0);

/// Takes the process's pid again; returns it.
pub(crate) fn refresh_pid() -> u32 {
    let pid = std::process::id();
    PID.store(pid, Relaxed);
    pid
}

/// The process's pid, as [`refresh_pid`] last took it (after installing the fork handler
/// that keeps it current, once).
fn current_pid() -> u32 {
    static ATFORK: std::sync::Once = std::sync::Once::new();
    extern "C" fn in_child() {
        refresh_pid();
    }
    ATFORK.call_once(|| {
        // SAFETY: registers a handler that only reads the pid and stores it.
        unsafe { libc::pthread_atfork(None, None, Some(in_child)) };
        refresh_pid();
    });
    PID.load(Relaxed)
}

/// A swap file and its slots. Shared through `Arc` by every thread of a region.
pub struct SwapDevice {
    file: File,
    /// The process the device belongs to: a fork child's copy of its parent's device
    /// (a handle a library user kept across `fork`) refuses I/O ([`SwapDevice::file`]).
    owner_pid: u32,
    io: IoEngine,
    direct: bool,
    backing: Backing,
    /// Whether the file lies on a rotating disk ([`Backing::rotational`]; where that cannot
    /// be told, no: most swap today is solid-state).
    rotational: bool,
    counters: Counters,
    slots: ClusterAllocator,
    /// Slots the device may ever have (a growing file is not that long yet).
    capacity: u64,
    guard: Guard,
    /// The compressed tier: slots whose pages are kept compressed in memory.
    zswap: Zswap,
    owners: OwnerTable,
    cache: SwapCache,
    /// Slots fork children hold, which are not reused until they let go.
    map: SwapMap,
    /// Forks under way that lend this device's slots, from their notes until the child
    /// exists: the compressed pool keeps the lent slots' entries where they are
    /// meanwhile, so the child's copy of the pool, made by the kernel piece by piece while
    /// other threads run, finds each of them whole.
    forking: AtomicU32,
    /// For a growing file: bytes allocated to it so far and when growing last failed.
    /// `None` for a fixed size.
    grown: Option<StatMutex<Growth>>,
    /// Set while the file system refuses to let a growing file grow (ENOSPC).
    growth_failed: AtomicBool,
    /// Set once the file system said it cannot punch holes: freed clusters stay in the file.
    punch_unsupported: AtomicBool,
    /// Slots promised to regions (their size beyond their memory limit), so regions that
    /// share the device cannot together need more than it has.
    reserved: AtomicU64,
    /// What it was made with, for a fork child's device (`SwapDevice::open_like`).
    cfg: SwapConfig,
    /// The file offset alignment of its I/O.
    align: usize,
}

impl SwapDevice {
    /// Creates the swap file as `cfg` says. A fixed size is allocated at once; without one
    /// the file grows in 64 MiB steps, up to the free space of its file system now.
    pub fn open(cfg: &SwapConfig) -> Result<Arc<SwapDevice>, Error> {
        if let Some(plan) = &cfg.faults {
            plan.validate()?;
        }
        let dir = location_dir(&cfg.location);
        let file = open_file(&cfg.location)?;
        let backing = Backing::of_file(&file).unwrap_or(Backing::Other { fs_type: 0 });
        let rotational = !backing.in_memory() && Backing::rotational(&file).unwrap_or(false);
        let create_error = |source: io::Error| Error::SwapCreate {
            dir: dir.to_path_buf(),
            source: match backing.in_memory() {
                true => io::Error::new(source.kind(), format!("{source} (on {backing})")),
                false => source,
            },
        };
        let direct = enable_direct_io(&file).map_err(create_error)?;
        let (capacity, grown) = match cfg.size {
            Some(bytes) => {
                let slots = fixed_slots(bytes)?;
                reserve(&file, 0, slots * PAGE_SIZE as u64).map_err(create_error)?;
                (slots, None)
            }
            None => (
                free_space_slots(&file).map_err(create_error)?,
                Some(StatMutex::new(Rank::SwapGrowth, Growth::default())),
            ),
        };
        let initial = if grown.is_some() { 0 } else { capacity };
        let align = if direct {
            direct_io_alignment(&file)
        } else {
            1
        };
        Ok(Arc::new(SwapDevice {
            file,
            io: IoEngine::new(
                cfg.io.resolve(backing.in_memory()),
                cfg.faults,
                align,
                Duration::from_micros(cfg.read_poll_us),
            ),
            direct,
            backing,
            rotational,
            counters: Counters::default(),
            slots: ClusterAllocator::new(SWAPFILE_CLUSTER, initial, cfg.slot_alloc),
            capacity,
            guard: Guard::new(cfg.encryption, capacity).map_err(create_error)?,
            zswap: Zswap::new(&cfg.ztier, capacity),
            owners: OwnerTable(SlotTable::new(capacity)),
            cache: SwapCache::new(cfg.swap_cache, capacity),
            map: SwapMap::new(capacity),
            forking: AtomicU32::new(0),
            grown,
            growth_failed: AtomicBool::new(false),
            punch_unsupported: AtomicBool::new(false),
            owner_pid: current_pid(),
            reserved: AtomicU64::new(0),
            cfg: cfg.clone(),
            align,
        }))
    }

    /// A new, empty device made as this one was, in the same directory: a fork child's.
    /// A named file's child gets an unnamed one beside it, and the child's file grows as
    /// it is used (a fixed size would be allocated in full at every fork, in memory on
    /// tmpfs).
    pub fn open_like(&self) -> Result<Arc<SwapDevice>, Error> {
        let cfg = SwapConfig {
            location: SwapLocation::TempIn(location_dir(&self.cfg.location).to_path_buf()),
            size: None,
            ..self.cfg.clone()
        };
        let device = SwapDevice::open(&cfg)?;
        // The parent writes the child's image through it: kept compressed, it would sit in
        // the parent's memory, uncharged. The child turns the tier on (`renew_io`).
        device.zswap.set_enabled(false);
        Ok(device)
    }

    /// In a fork child: I/O on rings of its own. The rings the device was made with are
    /// shared with the parent, whose device this was made for (`open_like`).
    pub(crate) fn renew_io(&mut self) {
        self.owner_pid = refresh_pid();
        self.zswap.set_enabled(self.cfg.ztier.enabled);
        self.io = IoEngine::new(
            self.cfg.io.resolve(self.backing.in_memory()),
            self.cfg.faults,
            self.align,
            Duration::from_micros(self.cfg.read_poll_us),
        );
        // The child's first transfer may be its SIGBUS handler's read of a copied page,
        // which cannot make rings.
        if self.used_pages() > 0 {
            self.io.start();
        }
    }

    /// In a fork child: closes the descriptors of the parent's io_uring rings and, unless
    /// `keep_file` (the child reads slots the parent shared at the fork:
    /// [`SwapDevice::read_shared`]), closes its swap file (it would keep the file's space
    /// alive after the parent is gone) and unmaps its compressed pool. Nothing but
    /// `read_shared` may use the device after this, and it must never be dropped.
    pub(crate) fn close_in_child(&self, keep_file: bool) {
        self.io.close_in_child();
        self.map.close_in_child();
        if !keep_file {
            // SAFETY: closing a descriptor of the leaked parent device, never used again.
            unsafe { libc::close(self.file.as_raw_fd()) };
            self.zswap.close_in_child();
        }
    }

    /// In a fork child: closes the file of an ancestor's device (whose rings were closed
    /// in the child that got it first) that this child reads nothing from, and unmaps its
    /// copy of the pool.
    pub(crate) fn close_file_in_child(&self) {
        // SAFETY: as in `close_in_child`.
        unsafe { libc::close(self.file.as_raw_fd()) };
        self.zswap.close_in_child();
    }

    /// The swap file, unless this is a fork child's copy of its parent's device: there
    /// the key and write generations are the parent's (a write would reuse nonces) and,
    /// for a device a region used, the descriptor is closed (its number may name another
    /// file by now), so a handle a library user kept across `fork` gets this error from
    /// every read, write and growth instead of touching either process's data.
    fn file(&self) -> io::Result<&File> {
        if !self.owned() {
            return Err(io::Error::other(
                "this swap device is the parent process's, and a fork child cannot use it \
                 (the child's regions have devices of their own; make a new one in the child)",
            ));
        }
        Ok(&self.file)
    }

    /// Whether this process owns the device (see [`SwapDevice::file`]); one relaxed load,
    /// for the signal handler's readers, which must not build an error.
    fn owned(&self) -> bool {
        self.owner_pid == PID.load(Relaxed)
    }

    pub fn capacity_pages(&self) -> u64 {
        self.capacity
    }

    pub fn used_pages(&self) -> u64 {
        self.slots.used()
    }

    /// True when more than half the slots are in use (the kernel's `vm_swap_full()`), or
    /// when the file system stopped a growing file from growing.
    pub fn nearly_full(&self) -> bool {
        self.used_pages() * 2 > self.capacity || self.growth_failed.load(Relaxed)
    }

    /// Whether a page read back from `slot` may keep it as its swap copy: not when swap
    /// is nearly full (the kernel's `vm_swap_full()`), nor when the compressed pool holds
    /// it (the kernel drops a zswap entry it loads rather than keep a second copy in memory).
    pub fn keeps_slot(&self, slot: SlotId) -> bool {
        !self.nearly_full() && !self.zswap.holds(slot)
    }

    /// Promises `pages` slots to a region; false (and nothing promised) when fewer than
    /// that are left unpromised.
    pub fn reserve(&self, pages: u64) -> bool {
        self.reserved
            .fetch_update(Relaxed, Relaxed, |r| {
                r.checked_add(pages).filter(|&total| total <= self.capacity)
            })
            .is_ok()
    }

    /// Takes back a promise made by [`SwapDevice::reserve`].
    pub fn unreserve(&self, pages: u64) {
        self.reserved.fetch_sub(pages, Relaxed);
    }

    pub fn reserved_pages(&self) -> u64 {
        self.reserved.load(Relaxed)
    }

    /// One free slot, or `None` when the device is full.
    pub fn alloc_slot(&self) -> Option<SlotId> {
        loop {
            if let Some(slot) = self.slots.alloc() {
                return Some(slot);
            }
            if self.reap_forks() == 0 && !self.grow() {
                return None;
            }
        }
    }

    /// Gives a slot back and forgets its guard and owner. Panics if the slot is not in
    /// use. The slot must not be in the swap cache. A slot a fork child still holds is
    /// given back when the child lets go (`swap_map.rs`).
    pub fn free_slot(&self, slot: SlotId) {
        self.check_slot(slot);
        if self.map.release(slot) == Freed::Later {
            // Outside a fork, a child reads the slot's pool entry from its own copy of the
            // pool, and the parent's goes now; during one, it goes with the slot.
            if self.forking.load(Relaxed) == 0 {
                self.zswap.invalidate(slot);
            }
            return;
        }
        self.give_back(slot);
    }

    /// Frees a slot no one holds any more.
    fn give_back(&self, slot: SlotId) {
        // Forget first: once freed, the slot may be reallocated and written by another
        // thread. The compressed copy goes first: a writeback of it records the guard.
        self.zswap.invalidate(slot);
        self.guard.forget(slot);
        self.owners.0.clear(slot);
        self.slots
            .free_with(slot, |first, n| self.discard(first, n));
    }

    /// Lets a fork child read `slot` instead of getting a copy of its page: from this
    /// device's file, or from the child's copy of the compressed pool, as it was at the
    /// fork (the pool's memory is copy-on-write in the child). True when the slot holds
    /// its page in either; the slot is then held until the fork's lifeline hangs up
    /// ([`SwapDevice::watch_fork`]), since the pool's writeback may move the page to the
    /// file before the fork. The caller holds the lock of the page that owns it.
    pub(crate) fn share_with_fork(&self, slot: SlotId) -> bool {
        self.check_slot(slot);
        let written = self.guard.get(slot).is_some() || self.zswap.holds(slot);
        // Held slots cannot be reused: a device close to full copies to the child's own.
        self.owned() && written && !self.nearly_full() && self.map.duplicate(slot)
    }

    /// A fork that may lend this device's slots starts its note (see `forking`).
    pub(crate) fn begin_fork(&self) {
        self.forking.fetch_add(1, Relaxed);
    }

    /// The fork that [`SwapDevice::begin_fork`] announced is done, in the parent.
    pub(crate) fn end_fork(&self) {
        self.forking.fetch_sub(1, Relaxed);
    }

    /// Takes back a hold of [`SwapDevice::share_with_fork`] before the fork (the page was
    /// mapped again, and the child gets the mapped page).
    pub(crate) fn unshare_with_fork(&self, slot: SlotId) {
        if self.map.put(slot) == Freed::Now {
            self.give_back(slot);
        }
    }

    /// After a fork: the holds on `slots` last until `lifeline` (the read end of a pipe
    /// whose write end the child and its descendants keep) hangs up.
    pub(crate) fn watch_fork(&self, lifeline: std::os::fd::OwnedFd, slots: Vec<SlotId>) {
        self.map.watch(lifeline, slots);
    }

    /// Drops the holds of forks whose families have all exited or called `exec`, and
    /// frees the slots they kept from being reused; returns how many. One `poll` when
    /// forks are watched, nothing otherwise.
    pub(crate) fn reap_forks(&self) -> usize {
        let freed = self.map.reap();
        for &slot in &freed {
            self.give_back(slot);
        }
        freed.len()
    }

    /// Slots that fork children hold (they read their pages from this device).
    pub fn fork_shared_slots(&self) -> u64 {
        self.map.shared()
    }

    /// Whether a fork child holds `slot`.
    #[cfg(test)]
    pub(crate) fn held_by_fork(&self, slot: SlotId) -> bool {
        self.map.held(slot)
    }

    /// In a fork child: reads a slot its parent shared at the fork (this is the child's
    /// copy of the parent's device, whose guards and pool are as they were at the fork)
    /// into `dst`, and checks it: from the pool's copy, or with the file's plain reads (the
    /// rings are the parent's). `in_signal` is `Some(stack_room)` for the SIGBUS handler:
    /// then it allocates nothing, and leaves to the full path, as an error, a slot the
    /// pool holds when the stack has no room for its copy, and a zstd object.
    ///
    /// # Safety
    /// `dst` must be valid for writing 4096 bytes until this returns, and page-aligned.
    pub(crate) unsafe fn read_shared(
        &self,
        slot: SlotId,
        dst: *mut u8,
        in_signal: Option<bool>,
    ) -> Result<(), ReadError> {
        if in_signal == Some(false) && self.zswap.holds(slot) {
            return Err(ReadError::Pool { slot });
        }
        match self.zswap.load(slot, dst, in_signal.is_some()) {
            Load::Page => return Ok(()),
            Load::Corrupt | Load::NotInSignal => return Err(ReadError::Pool { slot }),
            Load::NotHere => {}
        }
        let expected = self
            .guard
            .get(slot)
            .ok_or(ReadError::NeverWritten { slot })?;
        for read in 0..READ_TRIES {
            let n = libc::pread(
                self.file.as_raw_fd(),
                dst.cast(),
                PAGE_SIZE,
                slot_offset(slot) as libc::off_t,
            );
            if n != PAGE_SIZE as isize {
                let e = match n {
                    -1 if io::Error::last_os_error().raw_os_error() == Some(libc::EINTR) => {
                        continue
                    }
                    -1 => io::Error::last_os_error(),
                    _ => io::ErrorKind::UnexpectedEof.into(),
                };
                return Err(ReadError::Io(e));
            }
            match self.guard.check(slot, expected, dst) {
                Ok(()) => return Ok(()),
                Err(e) if read + 1 == READ_TRIES => return Err(e),
                Err(_) => {}
            }
        }
        Err(ReadError::Io(io::ErrorKind::Interrupted.into()))
    }

    /// Punches the file range of `n` freed slots from `first` out of a swap file in memory
    /// (tmpfs): the file no longer keeps what they held, and their memory is freed. On a
    /// disk the range stays allocated: a punch there takes the file's lock against every
    /// read in flight, and the slots' next writes would have to allocate blocks again
    /// (failing when the file system is full, which a fixed-size device promised they
    /// would not); what they hold there is sealed, with encryption on. Discarding on disks
    /// needs the kernel's design: a background worker, and clusters kept off the free list
    /// until their discard is done.
    fn discard(&self, first: SlotId, n: u32) {
        if !self.backing.in_memory() || self.punch_unsupported.load(Relaxed) {
            return;
        }
        let Ok(file) = self.file() else {
            return;
        };
        let mode = libc::FALLOC_FL_PUNCH_HOLE | libc::FALLOC_FL_KEEP_SIZE;
        let len = i64::from(n) * PAGE_SIZE as i64;
        let at = slot_offset(first) as i64;
        // SAFETY: plain system call on the device's own file.
        if unsafe { libc::fallocate(file.as_raw_fd(), mode, at, len) } == 0 {
            self.counters.discarded_clusters.fetch_add(1, Relaxed);
        } else if matches!(
            io::Error::last_os_error().raw_os_error(),
            Some(libc::EOPNOTSUPP | libc::ENOSYS | libc::EINVAL)
        ) {
            self.punch_unsupported.store(true, Relaxed);
        }
    }

    /// Records that page `page` of region `region` holds `slot` (a hint: see [`OwnerTable`]).
    pub fn set_owner(&self, slot: SlotId, region: u32, page: u32) {
        self.owners.set(slot, region, page);
    }

    /// The page that last recorded holding `slot`, as (region, page), if any.
    pub fn owner(&self, slot: SlotId) -> Option<(u32, u32)> {
        if u64::from(slot) >= self.capacity {
            return None;
        }
        self.owners.get(slot)
    }

    /// The swap cache of this device.
    pub fn cache(&self) -> &SwapCache {
        &self.cache
    }

    /// Writes each page to its slot as one batch and records the guard of every page
    /// written (sealed pages go out from copies, encrypted). With the compressed tier on,
    /// a page that compresses well is kept in the pool instead, and the pool's oldest pages
    /// go to the file with the batch when it is over its size. Returns one result per
    /// entry, in order; a failed write leaves its slot reading as never written.
    ///
    /// # Safety
    /// Each pointer must be valid for reading 4096 bytes until this returns, and page-aligned.
    pub unsafe fn write_pages(&self, batch: &[(SlotId, *const u8)]) -> Vec<io::Result<()>> {
        let file = match self.file() {
            Ok(file) => file,
            Err(e) => {
                let refused = || Err(io::Error::new(e.kind(), e.to_string()));
                return batch.iter().map(|_| refused()).collect();
            }
        };
        for &(slot, _) in batch {
            self.check_slot(slot);
            // Whatever the slot held is about to be overwritten.
            self.zswap.invalidate(slot);
            self.guard.forget(slot);
        }
        let mut results: Vec<Option<io::Result<()>>> = batch
            .iter()
            .map(|&(slot, src)| self.zswap.store(slot, src).then_some(Ok(())))
            .collect();
        let started = Instant::now();
        let victims = self
            .zswap
            .victims(2 * batch.len() + 8, |slot| self.file_holds(slot));
        let to_file: Vec<(SlotId, *const u8)> = batch
            .iter()
            .zip(&results)
            .filter(|(_, stored)| stored.is_none())
            .map(|(&page, _)| page)
            .chain(victims.iter().map(|v| (v.slot, v.page.as_ptr())))
            .collect();
        let mut written = self.write_to_file(file, &to_file).into_iter();
        for result in results.iter_mut().filter(|r| r.is_none()) {
            *result = written.next();
        }
        settle(victims, written, started);
        results
            .into_iter()
            .map(|r| r.expect("a result for every page"))
            .collect()
    }

    /// Whether the file holds `slot`'s page (its guard is recorded): a pool entry of the
    /// slot is then a clean copy, dropped rather than written back.
    fn file_holds(&self, slot: SlotId) -> bool {
        self.guard.get(slot).is_some()
    }

    /// Reclaim drops a clean page whose data the file holds at `slot`: the compressed pool
    /// keeps a copy when it has room (the page then comes back with no file read; writeback
    /// drops the copy without a write). True when it did.
    ///
    /// # Safety
    /// `src` must be valid for reading 4096 bytes, page-aligned; the caller holds the lock
    /// of the page that owns `slot`.
    pub unsafe fn keep_clean(&self, slot: SlotId, src: *const u8) -> bool {
        self.check_slot(slot);
        self.owned() && self.forking.load(Relaxed) == 0 && self.zswap.store_clean(slot, src)
    }

    /// Writes the compressed pool's oldest pages (at most `max`) to their slots in the file
    /// when the pool is over its size, with no batch of reclaim's own to go along (its
    /// pages were all clean, or the limit went down). Returns how many went.
    pub fn ztier_writeback(&self, max: usize) -> usize {
        self.ztier_write_oldest(|z| z.victims(max, |slot| self.file_holds(slot)))
    }

    /// Writes up to `max` of the compressed pool's oldest pages to the file whatever its
    /// size (clean copies are dropped), and gives the pool's emptied chunks back: reclaim
    /// found nothing else to free (see [`Zswap::victims_under_pressure`]). Returns how
    /// many pages left the pool.
    pub fn ztier_shrink(&self, max: usize) -> u64 {
        let before = self.zswap.stats().stored_pages;
        self.ztier_write_oldest(|z| z.victims_under_pressure(max, |slot| self.file_holds(slot)));
        if self.forking.load(Relaxed) == 0 {
            self.zswap.release_empty_chunks();
        }
        before.saturating_sub(self.zswap.stats().stored_pages)
    }

    /// Writes the pool's pages `take` takes to the file, as one batch.
    fn ztier_write_oldest<'z>(
        &'z self,
        take: impl FnOnce(&'z Zswap) -> Vec<zswap::Victim<'z>>,
    ) -> usize {
        let Ok(file) = self.file() else {
            return 0;
        };
        if self.forking.load(Relaxed) > 0 {
            // Writeback frees pool cells, which a fork child's copy may still name.
            return 0;
        }
        let victims = take(&self.zswap);
        if victims.is_empty() {
            return 0;
        }
        let started = Instant::now();
        let batch: Vec<(SlotId, *const u8)> =
            victims.iter().map(|v| (v.slot, v.page.as_ptr())).collect();
        // SAFETY: each source is a victim's own page buffer, alive until it is settled.
        let results = unsafe { self.write_to_file(file, &batch) };
        let written = results.iter().filter(|r| r.is_ok()).count();
        settle(victims, results.into_iter(), started);
        written
    }

    /// Writes each page to its slot in the file as one batch, recording the guard of
    /// every page written.
    ///
    /// # Safety
    /// As [`SwapDevice::write_pages`].
    unsafe fn write_to_file(
        &self,
        file: &File,
        batch: &[(SlotId, *const u8)],
    ) -> Vec<io::Result<()>> {
        if batch.is_empty() {
            return Vec::new();
        }
        let sealed: Vec<(PageBuf, Sealed)> = match &self.guard {
            Guard::Checksum(_) => Vec::new(),
            Guard::Sealed(seal, _) => batch
                .iter()
                .map(|&(slot, src)| {
                    let mut copy = PageBuf::copy_of(src);
                    let s = seal.seal(slot, copy.as_mut_slice());
                    (copy, s)
                })
                .collect(),
        };
        let ops: Vec<PageOp> = batch
            .iter()
            .enumerate()
            .map(|(i, &(slot, src))| PageOp::Write {
                offset: slot_offset(slot),
                src: sealed.get(i).map_or(src, |(copy, _)| copy.as_ptr()),
            })
            .collect();
        let results = self.io.run(file, &ops);
        for (i, (&(slot, src), result)) in batch.iter().zip(&results).enumerate() {
            match (result, &self.guard) {
                (Ok(()), Guard::Checksum(sums)) => sums.record(slot, page_checksum(src)),
                (Ok(()), Guard::Sealed(_, seals)) => seals.record(slot, sealed[i].1),
                (Err(_), _) => {
                    self.counters.write_errors.fetch_add(1, Relaxed);
                }
            }
        }
        results
    }

    /// Reads a slot into `dst` and checks it against the guard recorded when it was
    /// written (decrypting it when sealed); a mismatch is read again, up to
    /// [`READ_TRIES`] reads in all. On an error `dst` holds no usable data.
    ///
    /// # Safety
    /// `dst` must be valid for writing 4096 bytes until this returns, and page-aligned.
    pub unsafe fn read_page(&self, slot: SlotId, dst: *mut u8) -> Result<(), ReadError> {
        let file = self.file()?;
        self.check_slot(slot);
        match self.zswap.load(slot, dst, false) {
            Load::Page => return Ok(()),
            Load::Corrupt | Load::NotInSignal => return Err(self.pool_error(slot)),
            Load::NotHere => {}
        }
        let expected = self
            .guard
            .get(slot)
            .ok_or(ReadError::NeverWritten { slot })?;
        let mut read = 0;
        loop {
            let reread_follows = read + 1 < READ_TRIES;
            let started = Instant::now();
            if let Err(e) = self.io.read(file, slot_offset(slot), dst, reread_follows) {
                self.counters.read_errors.fetch_add(1, Relaxed);
                return Err(ReadError::Io(e));
            }
            if read == 0 {
                self.counters.file_read(started);
            }
            match self.guard.check(slot, expected, dst) {
                Ok(()) => {
                    if read > 0 {
                        self.counters.reread_healed.fetch_add(1, Relaxed);
                    }
                    return Ok(());
                }
                Err(e) if !reread_follows => {
                    self.counters.checksum_errors.fetch_add(1, Relaxed);
                    return Err(e);
                }
                Err(_) => {
                    self.counters.rereads.fetch_add(1, Relaxed);
                    read += 1;
                }
            }
        }
    }

    /// Reads a batch of slots with one submission (readahead's window) and verifies each
    /// page once, returning one result per entry, in order. A page that fails is not read
    /// again here: the caller drops a speculative page, and reads the one it must have
    /// with [`SwapDevice::read_page`], which does.
    ///
    /// # Safety
    /// Each pointer must be valid for writing 4096 bytes until this returns, and
    /// page-aligned.
    pub unsafe fn read_pages(&self, batch: &[(SlotId, *mut u8)]) -> Vec<Result<(), ReadError>> {
        let file = match self.file() {
            Ok(file) => file,
            Err(e) => {
                let refused = || Err(ReadError::Io(io::Error::new(e.kind(), e.to_string())));
                return batch.iter().map(|_| refused()).collect();
            }
        };
        let pooled: Vec<Load> = batch
            .iter()
            .map(|&(slot, dst)| {
                self.check_slot(slot);
                self.zswap.load(slot, dst, false)
            })
            .collect();
        let expected: Vec<Option<Expected>> = batch
            .iter()
            .map(|&(slot, _)| self.guard.get(slot))
            .collect();
        let ops: Vec<PageOp> = batch
            .iter()
            .zip(&expected)
            .zip(&pooled)
            .filter(|((_, sum), &load)| sum.is_some() && load == Load::NotHere)
            .map(|((&(slot, dst), _), _)| PageOp::Read {
                offset: slot_offset(slot),
                dst,
            })
            .collect();
        let started = Instant::now();
        let mut results = self.io.read_batch(file, &ops).into_iter();
        if !ops.is_empty() {
            self.counters.file_read(started);
        }
        batch
            .iter()
            .zip(expected)
            .zip(pooled)
            .map(|((&(slot, dst), sum), load)| {
                match load {
                    Load::Page => return Ok(()),
                    Load::Corrupt | Load::NotInSignal => return Err(self.pool_error(slot)),
                    Load::NotHere => {}
                }
                let expected = sum.ok_or(ReadError::NeverWritten { slot })?;
                results.next().expect("one result per read").map_err(|e| {
                    self.counters.read_errors.fetch_add(1, Relaxed);
                    ReadError::Io(e)
                })?;
                self.guard.check(slot, expected, dst)
            })
            .collect()
    }

    /// [`SwapDevice::read_page`] for the SIGBUS handler: one read, allocating nothing
    /// (on a signal ring, polled, when the engine polls its reads; else `pread`).
    /// True when the page was read and verified; false when it was not (an error, a
    /// failed check, or a fault plan in force): then `read_page` reads it again and
    /// reports what goes wrong.
    ///
    /// # Safety
    /// As [`SwapDevice::read_page`].
    pub unsafe fn read_page_in_place(&self, slot: SlotId, dst: *mut u8, stack_room: bool) -> bool {
        if !self.owned() {
            return false;
        }
        if !stack_room && self.zswap.holds(slot) {
            // The pool's copy of an object takes 3 KiB of stack: left to the full path.
            return false;
        }
        match self.zswap.load(slot, dst, true) {
            Load::Page => return true,
            Load::Corrupt | Load::NotInSignal => return false,
            Load::NotHere => {}
        }
        let Some(expected) = self.guard.get(slot) else {
            return false;
        };
        let started = Instant::now();
        let read = matches!(
            self.io.read_in_place(&self.file, slot_offset(slot), dst),
            Some(Ok(()))
        );
        if read {
            self.counters.file_read(started);
        }
        read && self.guard.passes(slot, expected, dst)
    }

    /// [`SwapDevice::read_pages`] for the SIGBUS handler's readahead: reads `slots` (at
    /// most [`SIGNAL_BATCH`]) in one submission into buffers of the engine's own, checks
    /// each, and lends them to `f`, allocating nothing; a page not read or not verified is
    /// marked failed, not read again (its own fault reads and reports it). `None` when no
    /// set of buffers is free or a fault plan is in force: use `read_pages`.
    ///
    /// # Safety
    /// The slots must stay allocated until this returns.
    pub(crate) unsafe fn read_pages_in_place<R>(
        &self,
        slots: &[SlotId],
        f: impl FnOnce(&mut SignalBatch<'_>) -> R,
    ) -> Option<R> {
        if slots.len() > SIGNAL_BATCH || !self.owned() {
            return None;
        }
        let expected: ArrayVec<Option<Expected>, SIGNAL_BATCH> =
            slots.iter().map(|&slot| self.guard.get(slot)).collect();
        // Slots the pool holds are not read from the file: their buffers are filled here.
        let offsets: ArrayVec<Option<u64>, SIGNAL_BATCH> = slots
            .iter()
            .map(|&slot| (!self.zswap.holds(slot)).then(|| slot_offset(slot)))
            .collect();
        let from_file = offsets.iter().flatten().count();
        let started = Instant::now();
        self.io.read_batch_in_place(&self.file, &offsets, |batch| {
            if from_file > 0 {
                self.counters.file_read(started);
            }
            for (i, (&slot, expected)) in slots.iter().zip(expected).enumerate() {
                let good = match offsets[i] {
                    None => self.zswap.load(slot, batch.page(i), true) == Load::Page,
                    Some(_) => {
                        self.zswap.refault(slot);
                        batch.ok(i)
                            && expected.is_some_and(|e| self.guard.passes(slot, e, batch.page(i)))
                    }
                };
                batch.set_ok(i, good);
            }
            f(batch)
        })
    }

    /// Counts a page the compressed pool holds that failed its check, and the error.
    fn pool_error(&self, slot: SlotId) -> ReadError {
        self.counters.checksum_errors.fetch_add(1, Relaxed);
        ReadError::Pool { slot }
    }

    /// What the compressed tier holds and has done.
    pub fn ztier_stats(&self) -> ZtierStats {
        self.zswap.stats()
    }

    /// Turns the compressed tier on or off (off: nothing more is stored, and what the pool
    /// holds is written back as reclaim runs).
    pub fn set_ztier(&self, on: bool) {
        self.zswap.set_enabled(on);
    }

    /// Sets the compressed pool's size.
    pub fn set_ztier_size(&self, size: crate::ZtierSize) {
        self.zswap.set_size(size);
    }

    pub fn ztier_size(&self) -> crate::ZtierSize {
        self.zswap.size()
    }

    /// Sets the pool's limit for a memory limit of `limit_bytes` of which the other
    /// processes under it hold `others_bytes` (an `auto` size told of the `evictions`
    /// reclaim made since the last call), gives emptied pool chunks back,
    /// and returns the change in the pool's memory, in pages, since the last call: the
    /// caller charges it to (or takes it off) the memory limit, as a cgroup charges
    /// zswap's pool.
    ///
    /// On a device regions share, the first region to call this owns the pool: its limit
    /// sets the pool's, and the pool is charged to it alone (others get 0).
    pub fn ztier_balance(
        &self,
        limit_bytes: u64,
        others_bytes: u64,
        region: u32,
        evictions: u64,
    ) -> i64 {
        let read_ns = self.counters.mean_file_read_ns();
        self.zswap
            .balance(limit_bytes, others_bytes, region, evictions, read_ns)
    }

    /// The cipher sealing the device's slots; None with encryption off.
    pub fn cipher(&self) -> Option<&'static str> {
        match &self.guard {
            Guard::Sealed(seal, _) => Some(seal.cipher()),
            Guard::Checksum(_) => None,
        }
    }

    /// The I/O counters: retries, re-reads, injected faults, errors.
    pub fn io_stats(&self) -> IoStats {
        let c = &self.counters;
        IoStats {
            io_retries: self.io.retries(),
            rereads: c.rereads.load(Relaxed),
            reread_healed: c.reread_healed.load(Relaxed),
            injected_faults: self.io.injected(),
            read_errors: c.read_errors.load(Relaxed),
            checksum_errors: c.checksum_errors.load(Relaxed),
            write_errors: c.write_errors.load(Relaxed),
            discarded_clusters: c.discarded_clusters.load(Relaxed),
            file_reads: c.file_reads.load(Relaxed),
            file_read_ns: c.file_read_ns.load(Relaxed),
        }
    }

    /// What the swap file is stored on; [`Backing::in_memory`] when swapping to it saves no
    /// memory.
    pub fn backing(&self) -> Backing {
        self.backing
    }

    /// Whether the swap file lies on a rotating disk, where reading neighbouring slots is
    /// cheaper than reading scattered ones (a swap the kernel counts in `nr_rotate_swap`).
    pub fn rotational(&self) -> bool {
        self.rotational
    }

    /// The I/O mode in effect (pread when io_uring was asked for but refused).
    pub fn io_mode(&self) -> IoMode {
        self.io.mode()
    }

    /// Whether the file is open with `O_DIRECT` (not on file systems that refuse it).
    pub fn direct_io(&self) -> bool {
        self.direct
    }

    /// Where CPUs look for free slots.
    pub fn slot_alloc(&self) -> SlotAlloc {
        self.slots.mode()
    }

    /// The statistics of the device's locks: the swap cache's (`swap_cache`), the slot
    /// allocator's (`swap_scan`, `swap_cluster`, `swap_lists`), the I/O rings' pool
    /// (`io_rings`) and a growing file's size (`swap_growth`).
    pub fn lockstat(&self) -> Vec<LockClass> {
        let mut classes = vec![self.cache.lockstat()];
        classes.extend(self.slots.lockstat());
        classes.extend(self.zswap.lockstat());
        classes.extend(self.io.lockstat());
        classes.extend(
            self.grown
                .as_ref()
                .map(|g| LockClass::sum("swap_growth", [g])),
        );
        classes
    }

    fn check_slot(&self, slot: SlotId) {
        assert!(
            u64::from(slot) < self.capacity,
            "swap slot {slot} is beyond the device's {} slots",
            self.capacity
        );
    }

    /// Extends a growing file by one step and hands the new clusters to the allocator.
    /// False when the device cannot grow: fixed size, at capacity, or no space left. After
    /// a failure it waits [`GROW_RETRY`] before trying again: a failing fallocate on a full
    /// file system costs milliseconds, and reclaim asks for slots in a loop.
    fn grow(&self) -> bool {
        let Some(growth) = &self.grown else {
            return false;
        };
        let mut growth = growth.lock();
        if self.slots.used() < self.slots.slots() {
            return true; // another thread grew the file, or a slot was freed meanwhile
        }
        if growth.failed_at.is_some_and(|t| t.elapsed() < GROW_RETRY) {
            return false;
        }
        let limit = self.capacity * PAGE_SIZE as u64;
        let step = GROW_CHUNK.min(limit - growth.bytes);
        if step == 0 {
            return false;
        }
        if self
            .file()
            .and_then(|f| reserve(f, growth.bytes, step))
            .is_err()
        {
            growth.failed_at = Some(Instant::now());
            self.growth_failed.store(true, Relaxed);
            return false;
        }
        growth.failed_at = None;
        self.growth_failed.store(false, Relaxed);
        growth.bytes += step;
        self.slots.add_clusters((step / CLUSTER_BYTES) as u32);
        true
    }
}

/// How far a growing swap file has grown.
#[derive(Default)]
struct Growth {
    bytes: u64,
    failed_at: Option<Instant>,
}

/// How long a growing file waits after a failed growth before it tries again.
const GROW_RETRY: Duration = Duration::from_secs(1);

/// Creates the swap file, mode 0600, without `O_DIRECT` (see [`enable_direct_io`]). A
/// named file must not exist yet (`O_EXCL`, `O_NOFOLLOW`: an existing file or a symbolic
/// link is refused, never written over) and is unlinked at once, so no crash leaves it
/// behind.
fn open_file(location: &SwapLocation) -> Result<File, Error> {
    let mut options = File::options();
    options.read(true).write(true).mode(0o600);
    let path = match location {
        SwapLocation::TempIn(dir) => {
            options.custom_flags(libc::O_TMPFILE);
            dir
        }
        SwapLocation::File(path) => {
            options.create_new(true).custom_flags(libc::O_NOFOLLOW);
            path
        }
    };
    let create_error = |source| Error::SwapCreate {
        dir: location_dir(location).to_path_buf(),
        source,
    };
    let file = options.open(path).map_err(|e| match location {
        SwapLocation::File(path) if e.raw_os_error() == Some(libc::EEXIST) => {
            Error::SwapFileExists { path: path.clone() }
        }
        _ => create_error(e),
    })?;
    if let SwapLocation::File(path) = location {
        std::fs::remove_file(path).map_err(create_error)?;
    }
    Ok(file)
}

/// Turns `O_DIRECT` on where the file system allows it; false (buffered I/O) where it
/// refuses (EINVAL: ramfs, some FUSE and network file systems). tmpfs accepts it since
/// Linux 6.6.
fn enable_direct_io(file: &File) -> io::Result<bool> {
    let fd = file.as_raw_fd();
    // SAFETY: plain fcntl calls on a descriptor we own.
    let flags = unsafe { libc::fcntl(fd, libc::F_GETFL) };
    if flags < 0 {
        return Err(io::Error::last_os_error());
    }
    // SAFETY: as above.
    if unsafe { libc::fcntl(fd, libc::F_SETFL, flags | libc::O_DIRECT) } == 0 {
        return Ok(true);
    }
    let err = io::Error::last_os_error();
    match err.raw_os_error() {
        Some(libc::EINVAL) => Ok(false),
        _ => Err(err),
    }
}

/// The file offset alignment direct I/O needs (statx `STATX_DIOALIGN`), or a page where
/// the kernel does not say.
fn direct_io_alignment(file: &File) -> usize {
    let mut st = std::mem::MaybeUninit::<libc::statx>::zeroed();
    // SAFETY: statx fills `st` on an empty path with AT_EMPTY_PATH.
    let rc = unsafe {
        libc::statx(
            file.as_raw_fd(),
            c"".as_ptr(),
            libc::AT_EMPTY_PATH,
            libc::STATX_DIOALIGN,
            st.as_mut_ptr(),
        )
    };
    // SAFETY: zeroed, and filled when rc is 0.
    let st = unsafe { st.assume_init() };
    let align = st.stx_dio_offset_align as usize;
    if rc == 0 && st.stx_mask & libc::STATX_DIOALIGN != 0 && align.is_power_of_two() {
        align.min(PAGE_SIZE)
    } else {
        PAGE_SIZE
    }
}

/// The directory the swap file lives in, for error messages.
fn location_dir(location: &SwapLocation) -> &Path {
    match location {
        SwapLocation::TempIn(dir) => dir,
        SwapLocation::File(path) => path
            .parent()
            .filter(|p| !p.as_os_str().is_empty())
            .unwrap_or(Path::new(".")),
    }
}

fn fixed_slots(bytes: u64) -> Result<u64, Error> {
    let slots = bytes / PAGE_SIZE as u64;
    if slots == 0 || slots > MAX_SLOTS {
        return Err(Error::invalid(
            "swap size",
            format!("{bytes} bytes: a swap device holds 4 KiB to 16 TiB"),
        ));
    }
    Ok(slots)
}

/// Whole clusters' worth of slots that fit in the free space of the file's file system.
fn free_space_slots(file: &File) -> io::Result<u64> {
    let mut st = std::mem::MaybeUninit::<libc::statvfs>::uninit();
    // SAFETY: fstatvfs fills `st` when it returns 0.
    if unsafe { libc::fstatvfs(file.as_raw_fd(), st.as_mut_ptr()) } != 0 {
        return Err(io::Error::last_os_error());
    }
    // SAFETY: initialised by the successful call above.
    let st = unsafe { st.assume_init() };
    #[allow(clippy::unnecessary_cast)] // the field types are narrower on 32-bit targets
    let bytes = (st.f_bavail as u64).saturating_mul(st.f_frsize as u64);
    Ok((bytes / CLUSTER_BYTES * u64::from(SWAPFILE_CLUSTER)).min(MAX_SLOTS))
}

/// Allocates `len` bytes of the file at `offset` (its current end), so later writes do not
/// fail for lack of space. File systems without fallocate get a plain size change.
fn reserve(file: &File, offset: u64, len: u64) -> io::Result<()> {
    let fd = file.as_raw_fd();
    // SAFETY: plain system calls on a file descriptor we own.
    if unsafe { libc::fallocate(fd, 0, offset as libc::off_t, len as libc::off_t) } == 0 {
        return Ok(());
    }
    let err = io::Error::last_os_error();
    if err.raw_os_error() != Some(libc::EOPNOTSUPP) {
        return Err(err);
    }
    // SAFETY: as above.
    if unsafe { libc::ftruncate(fd, (offset + len) as libc::off_t) } == 0 {
        Ok(())
    } else {
        Err(io::Error::last_os_error())
    }
}

fn slot_offset(slot: SlotId) -> u64 {
    u64::from(slot) * PAGE_SIZE as u64
}

/// # Safety
/// `page` must be valid for reading 4096 bytes.
unsafe fn page_checksum(page: *const u8) -> u32 {
    crc32c::crc32c(std::slice::from_raw_parts(page, PAGE_SIZE))
}

/// Settles each writeback victim by the result of its write, in order.
fn settle(
    victims: Vec<zswap::Victim<'_>>,
    results: impl Iterator<Item = io::Result<()>>,
    started: Instant,
) {
    for (victim, result) in victims.into_iter().zip(results) {
        match result {
            Ok(()) => victim.written_back(started),
            Err(_) => victim.failed(),
        }
    }
}

/// Set in a checksum word whose slot holds a written page; the low 32 bits are its crc32c.
/// Keeping validity apart from the value lets a page whose checksum is 0 be told from a
/// slot never written.
const WRITTEN: u64 = 1 << 32;

/// Memory kept outside the limit for each slot written, to check it when it is read: its
/// seal (generation and tag) with encryption on, its checksum word with it off.
pub fn guard_bytes_per_slot(encryption: SwapEncryption) -> u64 {
    match encryption {
        SwapEncryption::On => 24,
        SwapEncryption::Off => 8,
    }
}

/// What a written slot must read as.
#[derive(Clone, Copy)]
enum Expected {
    Checksum(u32),
    Sealed(Sealed),
}

/// How a slot's contents are kept and checked: sealed (encrypted and authenticated), or
/// plain with a CRC32C.
enum Guard {
    Checksum(ChecksumTable),
    Sealed(Seal, SealTable),
}

impl Guard {
    fn new(encryption: SwapEncryption, slots: u64) -> io::Result<Guard> {
        Ok(match encryption {
            SwapEncryption::On => Guard::Sealed(Seal::new()?, SealTable::new(slots)),
            SwapEncryption::Off => Guard::Checksum(ChecksumTable::new(slots)),
        })
    }

    fn forget(&self, slot: SlotId) {
        match self {
            Guard::Checksum(sums) => sums.forget(slot),
            Guard::Sealed(_, seals) => seals.forget(slot),
        }
    }

    /// None for a slot not written (or freed since).
    fn get(&self, slot: SlotId) -> Option<Expected> {
        match self {
            Guard::Checksum(sums) => sums.get(slot).map(Expected::Checksum),
            Guard::Sealed(_, seals) => seals.get(slot).map(Expected::Sealed),
        }
    }

    /// Checks a page just read from `slot`, decrypting it in place when sealed.
    ///
    /// # Safety
    /// `page` must be valid for reading and writing 4096 bytes.
    unsafe fn check(
        &self,
        slot: SlotId,
        expected: Expected,
        page: *mut u8,
    ) -> Result<(), ReadError> {
        match (self, expected) {
            (Guard::Checksum(_), Expected::Checksum(expected)) => {
                let found = page_checksum(page);
                match found == expected {
                    true => Ok(()),
                    false => Err(ReadError::Checksum {
                        slot,
                        expected,
                        found,
                    }),
                }
            }
            (Guard::Sealed(seal, _), Expected::Sealed(sealed)) => {
                let page = std::slice::from_raw_parts_mut(page, PAGE_SIZE);
                match seal.open(slot, sealed, page) {
                    true => Ok(()),
                    false => Err(ReadError::Tag { slot }),
                }
            }
            _ => unreachable!("a guard expects only its own kind"),
        }
    }

    /// [`Guard::check`] without building an error (the SIGBUS handler allocates nothing).
    ///
    /// # Safety
    /// As [`Guard::check`].
    unsafe fn passes(&self, slot: SlotId, expected: Expected, page: *mut u8) -> bool {
        match (self, expected) {
            (Guard::Checksum(_), Expected::Checksum(expected)) => page_checksum(page) == expected,
            (Guard::Sealed(seal, _), Expected::Sealed(sealed)) => seal.open(
                slot,
                sealed,
                std::slice::from_raw_parts_mut(page, PAGE_SIZE),
            ),
            _ => false,
        }
    }
}

/// The seal of every written slot: its generation (0 for a slot not written) and tag.
struct SealTable {
    generation: SlotTable,
    tag: [SlotTable; 2],
}

impl SealTable {
    fn new(slots: u64) -> SealTable {
        SealTable {
            generation: SlotTable::new(slots),
            tag: [SlotTable::new(slots), SlotTable::new(slots)],
        }
    }

    fn record(&self, slot: SlotId, sealed: Sealed) {
        let (lo, hi) = sealed.tag.split_at(8);
        self.tag[0].set(slot, u64::from_le_bytes(lo.try_into().expect("8 bytes")));
        self.tag[1].set(slot, u64::from_le_bytes(hi.try_into().expect("8 bytes")));
        // Last, with release: a reader that sees the generation sees the tag.
        self.generation.set(slot, sealed.generation);
    }

    fn forget(&self, slot: SlotId) {
        self.generation.clear(slot);
    }

    /// The slot's seal. Readers hold the lock of the page owning the slot, so it is not
    /// rewritten meanwhile; should it be, the generation read again after the tag tells,
    /// and the words are read again (a torn seal would only fail its tag, loudly).
    fn get(&self, slot: SlotId) -> Option<Sealed> {
        loop {
            let generation = self.generation.get(slot);
            if generation == 0 {
                return None;
            }
            let mut tag = [0u8; 16];
            tag[..8].copy_from_slice(&self.tag[0].get(slot).to_le_bytes());
            tag[8..].copy_from_slice(&self.tag[1].get(slot).to_le_bytes());
            if self.generation.get(slot) == generation {
                return Some(Sealed { generation, tag });
            }
        }
    }
}

/// The checksum of every written slot.
struct ChecksumTable(SlotTable);

impl ChecksumTable {
    fn new(slots: u64) -> ChecksumTable {
        ChecksumTable(SlotTable::new(slots))
    }

    fn record(&self, slot: SlotId, crc: u32) {
        self.0.set(slot, WRITTEN | u64::from(crc));
    }

    fn forget(&self, slot: SlotId) {
        self.0.clear(slot);
    }

    fn get(&self, slot: SlotId) -> Option<u32> {
        let value = self.0.get(slot);
        (value & WRITTEN != 0).then_some(value as u32)
    }
}

/// Which page holds each slot: region number (high half) and page (low half); 0 for none.
/// A hint for readahead, which reads slots by their neighbourhood on the device and needs
/// the page each belongs to; it is checked under that page's lock before it is trusted.
struct OwnerTable(SlotTable);

impl OwnerTable {
    fn set(&self, slot: SlotId, region: u32, page: u32) {
        self.0
            .set(slot, (u64::from(region) << 32) | u64::from(page));
    }

    fn get(&self, slot: SlotId) -> Option<(u32, u32)> {
        let word = self.0.get(slot);
        (word != 0).then_some(((word >> 32) as u32, word as u32))
    }
}

#[cfg(all(test, not(loom)))]
mod tests {
    use super::*;
    use crate::config::FaultPlan;
    use std::io::Read;
    use std::os::unix::fs::{FileExt, MetadataExt, PermissionsExt};
    use swap_io::tests::uring_allowed;
    use swap_io::PageBuf;

    /// A device's settings for the tests of the file: the compressed tier off, so every
    /// page goes to the file (its own tests turn it on).
    fn config(location: SwapLocation, size: Option<u64>, io: IoMode) -> SwapConfig {
        SwapConfig {
            location,
            size,
            io,
            ztier: crate::Ztier {
                enabled: false,
                ..crate::Ztier::default()
            },
            ..SwapConfig::default()
        }
    }

    /// A 1 MiB device in a fresh temp dir that injects `faults`.
    fn faulty_device(io: IoMode, faults: FaultPlan) -> (tempfile::TempDir, Arc<SwapDevice>) {
        let dir = tempfile::tempdir().unwrap();
        let cfg = SwapConfig {
            faults: Some(faults),
            ..config(SwapLocation::TempIn(dir.path().into()), Some(1 << 20), io)
        };
        (dir, SwapDevice::open(&cfg).unwrap())
    }

    /// The device's file opened again (through /proc, as it has no name), without
    /// `O_DIRECT`, to change it behind the device's back.
    fn reopen(dev: &SwapDevice) -> File {
        File::options()
            .read(true)
            .write(true)
            .open(format!("/proc/self/fd/{}", dev.file.as_raw_fd()))
            .unwrap()
    }

    /// A device on an unlinked file in a fresh temp dir (returned to keep it alive).
    fn temp_device(size: Option<u64>, io: IoMode) -> (tempfile::TempDir, Arc<SwapDevice>) {
        let dir = tempfile::tempdir().unwrap();
        let dev =
            SwapDevice::open(&config(SwapLocation::TempIn(dir.path().into()), size, io)).unwrap();
        (dir, dev)
    }

    /// A page whose every byte depends on `seed`.
    fn page(seed: u64) -> PageBuf {
        let mut p = PageBuf::new();
        for (i, chunk) in p.as_mut_slice().chunks_mut(8).enumerate() {
            let x = seed
                .wrapping_mul(0x9e37_79b9_7f4a_7c15)
                .wrapping_add(i as u64);
            chunk.copy_from_slice(&(x ^ (x >> 29)).to_le_bytes());
        }
        p
    }

    fn write(dev: &SwapDevice, pages: &[(SlotId, &PageBuf)]) {
        let batch: Vec<(SlotId, *const u8)> = pages.iter().map(|(s, p)| (*s, p.as_ptr())).collect();
        let results = unsafe { dev.write_pages(&batch) };
        assert_eq!(results.len(), pages.len());
        assert!(results.iter().all(|r| r.is_ok()), "{results:?}");
    }

    fn read(dev: &SwapDevice, slot: SlotId) -> Result<PageBuf, ReadError> {
        let mut buf = PageBuf::new();
        unsafe { dev.read_page(slot, buf.as_mut_ptr()) }.map(|()| buf)
    }

    fn roundtrip(io: IoMode) {
        let (_dir, dev) = temp_device(Some(4 << 20), io);
        if io == IoMode::Pread || uring_allowed() {
            assert_eq!(dev.io_mode(), io);
        }
        assert_eq!(dev.capacity_pages(), 1024);
        let slots: Vec<SlotId> = (0..64).map(|_| dev.alloc_slot().unwrap()).collect();
        // Page 0 is all zeroes: it must read back as written, not as never written.
        let pages: Vec<PageBuf> = (0..64)
            .map(|i| if i == 0 { PageBuf::new() } else { page(i) })
            .collect();
        let batch: Vec<(SlotId, &PageBuf)> = slots.iter().copied().zip(&pages).collect();
        write(&dev, &batch);
        for (slot, expected) in batch {
            assert_eq!(
                read(&dev, slot).unwrap().as_slice(),
                expected.as_slice(),
                "slot {slot}"
            );
        }
    }

    #[test]
    fn a_slot_lent_to_a_fork_is_not_reused_until_both_sides_let_go() {
        let (_dir, dev) = temp_device(None, IoMode::Pread);
        let slot = dev.alloc_slot().unwrap();
        let data = page(11);
        write(&dev, &[(slot, &data)]);
        let unwritten = dev.alloc_slot().unwrap();
        assert!(
            !dev.share_with_fork(unwritten),
            "nothing to lend in a slot never written"
        );
        dev.free_slot(unwritten);
        assert!(dev.share_with_fork(slot));
        assert_eq!(dev.fork_shared_slots(), 1);
        let used = dev.used_pages();
        dev.free_slot(slot);
        assert_eq!(dev.used_pages(), used, "given up by its owner, still held");
        assert!(dev.held_by_fork(slot));
        // What the child reads is what was written.
        let mut buf = PageBuf::new();
        unsafe { dev.read_shared(slot, buf.as_mut_ptr(), None) }.unwrap();
        assert_eq!(buf.as_slice(), data.as_slice());
        // Every other slot is handed out before this one comes back.
        let others: Vec<SlotId> = std::iter::from_fn(|| dev.alloc_slot())
            .take(3 * SWAPFILE_CLUSTER as usize)
            .collect();
        assert!(!others.contains(&slot), "a held slot was handed out again");
        let used = used + others.len() as u64;
        dev.unshare_with_fork(slot);
        assert_eq!(dev.fork_shared_slots(), 0);
        assert_eq!(dev.used_pages(), used - 1, "freed by the last to let go");
    }

    #[test]
    fn device_is_send_and_sync() {
        fn shareable<T: Send + Sync>() {}
        shareable::<SwapDevice>();
        shareable::<PageBuf>();
    }

    #[test]
    fn pages_roundtrip_through_io_uring() {
        roundtrip(IoMode::Uring);
    }

    #[test]
    fn pages_roundtrip_through_pread() {
        roundtrip(IoMode::Pread);
    }

    #[test]
    fn a_rewritten_slot_reads_its_latest_page() {
        let (_dir, dev) = temp_device(Some(1 << 20), IoMode::Uring);
        let slot = dev.alloc_slot().unwrap();
        write(&dev, &[(slot, &page(1))]);
        write(&dev, &[(slot, &page(2))]);
        assert_eq!(read(&dev, slot).unwrap().as_slice(), page(2).as_slice());
    }

    #[test]
    fn a_slot_corrupted_on_disk_fails_its_checksum() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("swap");
        let dev = SwapDevice::open(&SwapConfig {
            encryption: SwapEncryption::Off,
            ..config(
                SwapLocation::File(path.clone()),
                Some(1 << 20),
                IoMode::Uring,
            )
        })
        .unwrap();
        let slots: Vec<SlotId> = (0..4).map(|_| dev.alloc_slot().unwrap()).collect();
        let pages: Vec<PageBuf> = (0..4).map(page).collect();
        write(&dev, &[(slots[2], &pages[2]), (slots[3], &pages[3])]);
        let other = reopen(&dev);
        other
            .write_all_at(b"corrupt", slot_offset(slots[2]) + 100)
            .unwrap();
        other.sync_all().unwrap();
        match read(&dev, slots[2]) {
            Err(ReadError::Checksum {
                slot,
                expected,
                found,
            }) => {
                assert_eq!(slot, slots[2]);
                assert_eq!(expected, crc32c::crc32c(pages[2].as_slice()));
                assert_ne!(found, expected);
            }
            other => panic!("expected a checksum error, got {:?}", other.map(|_| ())),
        }
        let stats = dev.io_stats();
        assert_eq!(stats.rereads, u64::from(READ_TRIES - 1));
        assert_eq!((stats.checksum_errors, stats.reread_healed), (1, 0));
        assert_eq!(
            read(&dev, slots[3]).unwrap().as_slice(),
            pages[3].as_slice()
        );
    }

    /// A 1 MiB device made with `encryption`, on an unlinked file in a fresh temp dir.
    fn device_with(encryption: SwapEncryption) -> (tempfile::TempDir, Arc<SwapDevice>) {
        let dir = tempfile::tempdir().unwrap();
        let dev = SwapDevice::open(&SwapConfig {
            encryption,
            ..config(
                SwapLocation::TempIn(dir.path().into()),
                Some(1 << 20),
                IoMode::Pread,
            )
        })
        .unwrap();
        (dir, dev)
    }

    const MARKER: &[u8; 16] = b"uswap-secret-42!";

    fn marker_page() -> PageBuf {
        let mut p = PageBuf::new();
        for chunk in p.as_mut_slice().chunks_mut(MARKER.len()) {
            chunk.copy_from_slice(MARKER);
        }
        p
    }

    /// With encryption on, the swap file holds no page as the program wrote it; off, the
    /// marker is there (so the search can find it).
    #[test]
    fn a_sealed_device_leaves_nothing_readable_in_its_file() {
        for encryption in [SwapEncryption::On, SwapEncryption::Off] {
            let (_dir, dev) = device_with(encryption);
            let page = marker_page();
            let slots: Vec<SlotId> = (0..16).map(|_| dev.alloc_slot().unwrap()).collect();
            let batch: Vec<(SlotId, &PageBuf)> = slots.iter().map(|&s| (s, &page)).collect();
            write(&dev, &batch);
            let mut raw = Vec::new();
            reopen(&dev).read_to_end(&mut raw).unwrap();
            let found = raw.windows(MARKER.len()).filter(|w| w == MARKER).count();
            match encryption {
                SwapEncryption::On => assert_eq!(found, 0, "{} sealed", dev.cipher().unwrap()),
                SwapEncryption::Off => assert_eq!(found, 16 * PAGE_SIZE / MARKER.len()),
            }
            for &slot in &slots {
                assert_eq!(read(&dev, slot).unwrap().as_slice(), page.as_slice());
            }
        }
    }

    /// A slot's ciphertext copied over another slot's, or one bit of a slot flipped, fails
    /// its tag after every re-read; the slot it came from still reads.
    #[test]
    fn a_sealed_slot_replayed_or_flipped_fails_its_tag() {
        let (_dir, dev) = device_with(SwapEncryption::On);
        let slots: Vec<SlotId> = (0..3).map(|_| dev.alloc_slot().unwrap()).collect();
        let pages: Vec<PageBuf> = (0..3).map(page).collect();
        let batch: Vec<(SlotId, &PageBuf)> = slots.iter().copied().zip(&pages).collect();
        write(&dev, &batch);
        let file = reopen(&dev);
        let mut sealed = vec![0u8; PAGE_SIZE];
        file.read_exact_at(&mut sealed, slot_offset(slots[0]))
            .unwrap();
        file.write_all_at(&sealed, slot_offset(slots[1])).unwrap();
        let mut byte = [0u8];
        file.read_exact_at(&mut byte, slot_offset(slots[2]) + 999)
            .unwrap();
        file.write_all_at(&[byte[0] ^ 0x04], slot_offset(slots[2]) + 999)
            .unwrap();
        for &bad in &slots[1..] {
            assert!(
                matches!(read(&dev, bad), Err(ReadError::Tag { slot }) if slot == bad),
                "slot {bad}"
            );
        }
        assert_eq!(
            read(&dev, slots[0]).unwrap().as_slice(),
            pages[0].as_slice()
        );
        let stats = dev.io_stats();
        assert_eq!(stats.checksum_errors, 2);
        assert_eq!(stats.rereads, 2 * u64::from(READ_TRIES - 1));
    }

    /// A cluster whose every slot is freed is punched out of a swap file in memory (the
    /// kernel's cluster discard): tmpfs frees its memory, and its slots serve again.
    #[test]
    fn an_emptied_cluster_is_punched_out_of_a_file_in_memory() {
        let shm = Path::new("/dev/shm");
        if !Backing::of_path(shm).is_ok_and(|b| b.in_memory()) {
            eprintln!("skipped: /dev/shm is not in memory here");
            return;
        }
        let dir = tempfile::tempdir_in(shm).unwrap();
        let dev = SwapDevice::open(&SwapConfig {
            slot_alloc: SlotAlloc::Shared,
            ..config(
                SwapLocation::TempIn(dir.path().into()),
                Some(4 << 20),
                IoMode::Pread,
            )
        })
        .unwrap();
        let per_cluster = SWAPFILE_CLUSTER as usize;
        let slots: Vec<SlotId> = (0..=per_cluster)
            .map(|_| dev.alloc_slot().unwrap())
            .collect();
        let data = page(9);
        let batch: Vec<(SlotId, &PageBuf)> = slots.iter().map(|&s| (s, &data)).collect();
        write(&dev, &batch);
        let blocks = || reopen(&dev).metadata().unwrap().blocks();
        let before = blocks();
        for &slot in &slots[..per_cluster] {
            dev.free_slot(slot);
        }
        if dev.punch_unsupported.load(Relaxed) {
            eprintln!("skipped: this file system cannot punch holes");
            return;
        }
        assert_eq!(dev.io_stats().discarded_clusters, 1);
        let cluster_blocks = CLUSTER_BYTES / 512;
        assert!(
            blocks() + cluster_blocks <= before,
            "{before} blocks before, {} after",
            blocks()
        );
        assert_eq!(
            read(&dev, slots[per_cluster]).unwrap().as_slice(),
            data.as_slice()
        );
        let again = dev.alloc_slot().unwrap();
        write(&dev, &[(again, &data)]);
        assert_eq!(read(&dev, again).unwrap().as_slice(), data.as_slice());
    }

    #[test]
    fn never_written_and_freed_slots_read_as_never_written() {
        let (_dir, dev) = temp_device(Some(1 << 20), IoMode::Pread);
        let slot = dev.alloc_slot().unwrap();
        assert!(matches!(read(&dev, slot), Err(ReadError::NeverWritten { slot: s }) if s == slot));
        write(&dev, &[(slot, &page(7))]);
        dev.free_slot(slot);
        assert_eq!(dev.used_pages(), 0);
        assert!(matches!(
            read(&dev, slot),
            Err(ReadError::NeverWritten { .. })
        ));
    }

    #[test]
    fn a_full_fixed_device_refuses_slots_and_keeps_its_pages() {
        let dir = tempfile::tempdir().unwrap();
        let size = 2 * CLUSTER_BYTES;
        let dev = SwapDevice::open(&config(
            SwapLocation::TempIn(dir.path().into()),
            Some(size),
            IoMode::Uring,
        ))
        .unwrap();
        assert_eq!(dev.capacity_pages(), 512);
        let mut slots = Vec::new();
        for i in 0..512 {
            assert_eq!(dev.nearly_full(), i > 256, "with {i} used");
            slots.push(dev.alloc_slot().expect("a free slot"));
        }
        assert_eq!(dev.alloc_slot(), None);
        assert_eq!(dev.used_pages(), 512);
        let pages: Vec<PageBuf> = slots.iter().map(|&s| page(u64::from(s) + 1000)).collect();
        for chunk in slots
            .iter()
            .copied()
            .zip(&pages)
            .collect::<Vec<_>>()
            .chunks(100)
        {
            write(&dev, chunk);
        }
        assert_eq!(dev.alloc_slot(), None);
        for (&slot, expected) in slots.iter().zip(&pages) {
            assert_eq!(
                read(&dev, slot).unwrap().as_slice(),
                expected.as_slice(),
                "slot {slot}"
            );
        }
        slots.iter().for_each(|&s| dev.free_slot(s));
        assert_eq!(dev.used_pages(), 0);
        assert!(!dev.nearly_full());
    }

    #[test]
    #[should_panic(expected = "freed while not in use")]
    fn freeing_a_free_slot_panics() {
        let (_dir, dev) = temp_device(Some(1 << 20), IoMode::Pread);
        let slot = dev.alloc_slot().unwrap();
        dev.free_slot(slot);
        dev.free_slot(slot);
    }

    #[test]
    fn a_missing_directory_is_a_swap_create_error_naming_it() {
        let dir = tempfile::tempdir().unwrap();
        let missing = dir.path().join("no-such-dir");
        for location in [
            SwapLocation::TempIn(missing.clone()),
            SwapLocation::File(missing.join("swap")),
        ] {
            let err = SwapDevice::open(&config(location, None, IoMode::Uring))
                .err()
                .expect("an error");
            assert!(
                matches!(&err, Error::SwapCreate { dir, .. } if *dir == missing),
                "{err:?}"
            );
            assert!(err.to_string().contains(missing.to_str().unwrap()), "{err}");
        }
    }

    #[test]
    fn an_impossible_fixed_size_is_refused() {
        let dir = tempfile::tempdir().unwrap();
        for size in [100, 32 << 40] {
            let err = SwapDevice::open(&config(
                SwapLocation::TempIn(dir.path().into()),
                Some(size),
                IoMode::Uring,
            ));
            let msg = err.err().expect("an error").to_string();
            assert!(
                msg.contains("swap size") && msg.contains(&size.to_string()),
                "{msg}"
            );
        }
        assert_eq!(std::fs::read_dir(dir.path()).unwrap().count(), 0);
    }

    #[test]
    fn a_temp_file_leaves_nothing_in_its_directory() {
        let (dir, dev) = temp_device(None, IoMode::Uring);
        let slot = dev.alloc_slot().unwrap();
        write(&dev, &[(slot, &page(3))]);
        assert_eq!(
            std::fs::read_dir(dir.path()).unwrap().count(),
            0,
            "while open"
        );
        drop(dev);
        assert_eq!(
            std::fs::read_dir(dir.path()).unwrap().count(),
            0,
            "after drop"
        );
    }

    #[test]
    fn a_named_file_is_private_and_unlinked_while_open() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("swap");
        let dev = SwapDevice::open(&config(
            SwapLocation::File(path.clone()),
            Some(1 << 20),
            IoMode::Uring,
        ))
        .unwrap();
        assert!(!path.exists(), "unlinked as soon as it is open");
        let meta = dev.file.metadata().unwrap();
        assert_eq!(meta.permissions().mode() & 0o777, 0o600);
        assert_eq!(meta.nlink(), 0);
        assert_eq!(meta.len(), 1 << 20, "preallocated");
        let slot = dev.alloc_slot().unwrap();
        write(&dev, &[(slot, &page(5))]);
        assert_eq!(read(&dev, slot).unwrap().as_slice(), page(5).as_slice());
        drop(dev);
        assert_eq!(std::fs::read_dir(dir.path()).unwrap().count(), 0);
    }

    #[test]
    fn an_existing_file_or_link_is_refused_and_left_alone() {
        let dir = tempfile::tempdir().unwrap();
        let file = dir.path().join("data");
        std::fs::write(&file, b"precious").unwrap();
        let link = dir.path().join("link");
        let target = dir.path().join("target");
        std::os::unix::fs::symlink(&target, &link).unwrap();
        for path in [&file, &link] {
            let err = SwapDevice::open(&config(
                SwapLocation::File(path.clone()),
                Some(1 << 20),
                IoMode::Pread,
            ))
            .err()
            .expect("an error");
            assert!(
                matches!(&err, Error::SwapFileExists { path: p } if p == path),
                "{err:?}"
            );
            let msg = err.to_string();
            assert!(
                msg.contains(path.to_str().unwrap()) && msg.contains("Remove"),
                "{msg}"
            );
        }
        assert_eq!(std::fs::read(&file).unwrap(), b"precious");
        assert!(!target.exists(), "nothing created through the link");
    }

    #[test]
    fn a_read_corrupted_in_transit_is_healed_by_a_reread() {
        for io in [IoMode::Uring, IoMode::Pread] {
            // Every read that a re-read follows comes back with a bit flipped.
            let faults = FaultPlan {
                read_flip: 1.0,
                ..FaultPlan::default()
            };
            let (_dir, dev) = faulty_device(io, faults);
            let slot = dev.alloc_slot().unwrap();
            write(&dev, &[(slot, &page(21))]);
            assert_eq!(read(&dev, slot).unwrap().as_slice(), page(21).as_slice());
            let stats = dev.io_stats();
            assert_eq!(stats.rereads, u64::from(READ_TRIES - 1), "{io:?}");
            assert_eq!(stats.reread_healed, 1, "{io:?}");
            assert_eq!(stats.injected_faults, u64::from(READ_TRIES - 1), "{io:?}");
            assert_eq!(stats.checksum_errors, 0, "{io:?}");
        }
    }

    #[test]
    fn a_page_corrupted_on_its_way_to_the_device_fails_its_checksum() {
        for io in [IoMode::Uring, IoMode::Pread] {
            let faults = FaultPlan {
                write_flip: 1.0,
                ..FaultPlan::default()
            };
            let (_dir, dev) = faulty_device(io, faults);
            let slot = dev.alloc_slot().unwrap();
            write(&dev, &[(slot, &page(22))]);
            assert!(
                matches!(read(&dev, slot), Err(ReadError::Tag { .. })),
                "{io:?}"
            );
            let stats = dev.io_stats();
            assert_eq!((stats.checksum_errors, stats.reread_healed), (1, 0));
            assert_eq!(stats.rereads, u64::from(READ_TRIES - 1));
        }
    }

    #[test]
    fn io_errors_are_counted_after_their_retries() {
        for io in [IoMode::Uring, IoMode::Pread] {
            let faults = FaultPlan {
                read_eio_persistent: 1.0,
                write_enospc: 0.5,
                seed: 3,
                ..FaultPlan::default()
            };
            let (_dir, dev) = faulty_device(io, faults);
            let slots: Vec<SlotId> = (0..40).map(|_| dev.alloc_slot().unwrap()).collect();
            let pages: Vec<PageBuf> = (0..40).map(page).collect();
            let batch: Vec<(SlotId, *const u8)> = slots
                .iter()
                .zip(&pages)
                .map(|(&s, p)| (s, p.as_ptr()))
                .collect();
            let results = unsafe { dev.write_pages(&batch) };
            let failed = results.iter().filter(|r| r.is_err()).count() as u64;
            assert!(failed > 5 && failed < 35, "{io:?}: {failed}");
            let written = slots
                .iter()
                .zip(&results)
                .find(|(_, r)| r.is_ok())
                .unwrap()
                .0;
            let err = read(&dev, *written).err().expect("a read error");
            assert!(matches!(&err, ReadError::Io(e) if e.raw_os_error() == Some(libc::EIO)));
            let stats = dev.io_stats();
            assert_eq!(stats.write_errors, failed, "{io:?}");
            assert_eq!(stats.read_errors, 1, "{io:?}");
            assert_eq!(stats.io_retries, u64::from(swap_io::READ_EIO_TRIES - 1));
            assert_eq!(stats.injected_faults, failed + 1, "{io:?}");
        }
    }

    #[test]
    fn transient_faults_never_reach_the_caller() {
        for io in [IoMode::Uring, IoMode::Pread] {
            let (_dir, dev) = faulty_device(io, FaultPlan::transient(7, 0.15));
            let slots: Vec<SlotId> = (0..200).map(|_| dev.alloc_slot().unwrap()).collect();
            let pages: Vec<PageBuf> = slots.iter().map(|&s| page(u64::from(s) + 50)).collect();
            let batch: Vec<(SlotId, &PageBuf)> = slots.iter().copied().zip(&pages).collect();
            write(&dev, &batch);
            for _ in 0..3 {
                for (slot, expected) in &batch {
                    assert!(
                        read(&dev, *slot).unwrap().as_slice() == expected.as_slice(),
                        "{io:?} slot {slot}"
                    );
                }
            }
            let stats = dev.io_stats();
            assert!(stats.io_retries > 50, "{io:?}: {stats:?}");
            assert!(stats.reread_healed > 10, "{io:?}: {stats:?}");
            assert_eq!(
                stats.read_errors + stats.write_errors + stats.checksum_errors,
                0
            );
        }
    }

    #[test]
    fn a_bad_fault_plan_is_refused() {
        let dir = tempfile::tempdir().unwrap();
        let cfg = SwapConfig {
            faults: Some(FaultPlan {
                eagain: -1.0,
                ..FaultPlan::default()
            }),
            ..config(SwapLocation::TempIn(dir.path().into()), None, IoMode::Pread)
        };
        let msg = SwapDevice::open(&cfg).err().expect("an error").to_string();
        assert!(
            msg.contains("fault plan") && msg.contains("eagain"),
            "{msg}"
        );
    }

    #[test]
    fn a_growing_file_is_extended_in_64_mib_steps() {
        let (_dir, dev) = temp_device(None, IoMode::Uring);
        assert!(
            dev.capacity_pages() >= 2 * GROW_CHUNK / PAGE_SIZE as u64,
            "needs 128 MiB free in the temp dir"
        );
        assert_eq!(dev.capacity_pages() % u64::from(SWAPFILE_CLUSTER), 0);
        let len = || dev.file.metadata().unwrap().len();
        assert_eq!(len(), 0);
        let per_step = GROW_CHUNK / PAGE_SIZE as u64;
        for _ in 0..per_step {
            dev.alloc_slot().unwrap();
        }
        assert_eq!(len(), GROW_CHUNK);
        let last = dev.alloc_slot().unwrap();
        assert_eq!(u64::from(last), per_step);
        assert_eq!(len(), 2 * GROW_CHUNK);
        write(&dev, &[(last, &page(9))]);
        assert_eq!(read(&dev, last).unwrap().as_slice(), page(9).as_slice());
    }

    /// A fresh file system of type `fs` mounted on a temp dir, unmounted on drop. `None`
    /// where this process may not mount (not root).
    struct Mounted(tempfile::TempDir);

    impl Mounted {
        fn new(fs: &str) -> Option<Mounted> {
            let dir = tempfile::tempdir().unwrap();
            let c = |s: &str| std::ffi::CString::new(s).unwrap();
            let target = c(dir.path().to_str().unwrap());
            // SAFETY: valid C strings.
            let rc = unsafe {
                libc::mount(
                    c(fs).as_ptr(),
                    target.as_ptr(),
                    c(fs).as_ptr(),
                    0,
                    std::ptr::null(),
                )
            };
            (rc == 0).then_some(Mounted(dir))
        }
    }

    impl Drop for Mounted {
        fn drop(&mut self) {
            let target = std::ffi::CString::new(self.0.path().to_str().unwrap()).unwrap();
            // SAFETY: a valid C string.
            unsafe { libc::umount2(target.as_ptr(), libc::MNT_DETACH) };
        }
    }

    #[test]
    fn swap_in_ram_is_detected_and_still_works() {
        for (fs, expected) in [("tmpfs", Backing::Tmpfs), ("ramfs", Backing::Ramfs)] {
            let Some(mounted) = Mounted::new(fs) else {
                eprintln!("skipped: cannot mount {fs} (not root)");
                return;
            };
            let dir = mounted.0.path();
            assert_eq!(Backing::of_path(dir).unwrap(), expected);
            for location in [
                SwapLocation::TempIn(dir.into()),
                SwapLocation::File(dir.join("swap")),
            ] {
                for io in [IoMode::Uring, IoMode::Pread] {
                    let dev = SwapDevice::open(&config(location.clone(), Some(1 << 20), io))
                        .unwrap_or_else(|e| panic!("{fs} {location:?}: {e}"));
                    assert_eq!(dev.backing(), expected);
                    assert!(dev.backing().in_memory());
                    assert!(!dev.rotational(), "swap in RAM seeks nothing");
                    let text = dev.backing().to_string();
                    assert!(
                        text.starts_with(fs) && text.contains("swap in RAM counts against"),
                        "{text}"
                    );
                    // ramfs refuses O_DIRECT; the device falls back to buffered I/O.
                    if expected == Backing::Ramfs {
                        assert!(!dev.direct_io());
                    }
                    let slots: Vec<SlotId> = (0..8).map(|_| dev.alloc_slot().unwrap()).collect();
                    let pages: Vec<PageBuf> = (0..8).map(|i| page(i + 30)).collect();
                    let batch: Vec<(SlotId, &PageBuf)> =
                        slots.iter().copied().zip(&pages).collect();
                    write(&dev, &batch);
                    for (slot, expected) in batch {
                        assert_eq!(read(&dev, slot).unwrap().as_slice(), expected.as_slice());
                    }
                    drop(dev);
                    assert_eq!(std::fs::read_dir(dir).unwrap().count(), 0, "{fs}");
                }
            }
        }
    }

    #[test]
    fn the_device_reports_the_file_system_of_its_directory() {
        let dir = tempfile::tempdir().unwrap();
        let location = SwapLocation::TempIn(dir.path().into());
        let dev = SwapDevice::open(&config(location, Some(1 << 20), IoMode::Pread)).unwrap();
        let backing = Backing::of_path(dir.path()).unwrap();
        assert_eq!(dev.backing(), backing);
        assert_eq!(backing.to_string().contains("RAM"), backing.in_memory());
    }

    /// A device with the compressed tier on, its pool `size` bytes (for a 1 GiB limit).
    fn ztier_device(
        compressor: crate::Compressor,
        size: u64,
    ) -> (tempfile::TempDir, Arc<SwapDevice>) {
        let dir = tempfile::tempdir().unwrap();
        let dev = SwapDevice::open(&SwapConfig {
            ztier: crate::Ztier {
                enabled: true,
                size: crate::ZtierSize::Bytes(size),
                compressor,
            },
            ..config(
                SwapLocation::TempIn(dir.path().into()),
                Some(8 << 20),
                IoMode::Pread,
            )
        })
        .unwrap();
        dev.ztier_balance(1 << 30, 0, 0, 0);
        (dir, dev)
    }

    /// A page of random words, which no compressor shrinks.
    fn random_page(seed: u64) -> PageBuf {
        let mut p = PageBuf::new();
        let mut x = seed;
        for chunk in p.as_mut_slice().chunks_mut(8) {
            x = x.wrapping_add(0x9e37_79b9_7f4a_7c15);
            let mut z = x;
            z = (z ^ (z >> 30)).wrapping_mul(0xbf58_476d_1ce4_e5b9);
            z = (z ^ (z >> 27)).wrapping_mul(0x94d0_49bb_1331_11eb);
            chunk.copy_from_slice(&(z ^ (z >> 31)).to_le_bytes());
        }
        p
    }

    /// A page that compresses about 8:1: an eighth of it random, the rest one repeated
    /// 8-byte word.
    fn compressible(seed: u64) -> PageBuf {
        let mut p = random_page(seed);
        for chunk in p.as_mut_slice()[512..].chunks_mut(8) {
            chunk.copy_from_slice(&seed.to_le_bytes());
        }
        p
    }

    fn same_filled(word: u64) -> PageBuf {
        let mut p = PageBuf::new();
        for chunk in p.as_mut_slice().chunks_mut(8) {
            chunk.copy_from_slice(&word.to_le_bytes());
        }
        p
    }

    /// Reads `slots` every way a fault may: one page, a batch, and the SIGBUS handler's
    /// single and batched reads; each must give back `expected`.
    fn read_every_way(dev: &SwapDevice, slots: &[SlotId], expected: &[PageBuf]) {
        for (&slot, want) in slots.iter().zip(expected) {
            assert_eq!(
                read(dev, slot).unwrap().as_slice(),
                want.as_slice(),
                "read_page {slot}"
            );
            let mut buf = PageBuf::new();
            assert!(unsafe { dev.read_page_in_place(slot, buf.as_mut_ptr(), true) });
            assert_eq!(buf.as_slice(), want.as_slice(), "read_page_in_place {slot}");
        }
        let mut bufs: Vec<PageBuf> = slots.iter().map(|_| PageBuf::new()).collect();
        let batch: Vec<(SlotId, *mut u8)> = slots
            .iter()
            .zip(&mut bufs)
            .map(|(&s, b)| (s, b.as_mut_ptr()))
            .collect();
        let results = unsafe { dev.read_pages(&batch) };
        assert!(results.iter().all(|r| r.is_ok()), "{results:?}");
        for (got, want) in bufs.iter().zip(expected) {
            assert_eq!(got.as_slice(), want.as_slice(), "read_pages");
        }
        for (chunk, wants) in slots
            .chunks(SIGNAL_BATCH)
            .zip(expected.chunks(SIGNAL_BATCH))
        {
            let checked = unsafe {
                dev.read_pages_in_place(chunk, |batch| {
                    (0..chunk.len()).all(|i| {
                        batch.ok(i)
                            && std::slice::from_raw_parts(batch.page(i), PAGE_SIZE)
                                == wants[i].as_slice()
                    })
                })
            };
            assert_eq!(checked, Some(true), "read_pages_in_place");
        }
    }

    #[test]
    fn compressible_pages_stay_in_the_pool_and_come_back_every_way() {
        for compressor in [crate::Compressor::Lz4, crate::Compressor::Zstd(3)] {
            let (_dir, dev) = ztier_device(compressor, 64 << 20);
            let slots: Vec<SlotId> = (0..100).map(|_| dev.alloc_slot().unwrap()).collect();
            let pages: Vec<PageBuf> = (0..100u64)
                .map(|i| match i % 4 {
                    0 => same_filled(i * 0x0101_0101),
                    1 => random_page(i),
                    _ => compressible(i),
                })
                .collect();
            write(&dev, &slots.iter().copied().zip(&pages).collect::<Vec<_>>());
            let z = dev.ztier_stats();
            assert_eq!(
                z.stored_pages, 75,
                "{compressor}: random pages go to the file"
            );
            assert_eq!(z.same_filled_pages, 25);
            assert_eq!(z.reject_compress_poor, 25);
            assert!(z.stored_bytes < 50 * PAGE_SIZE as u64 / 4, "{z:?}");
            for (i, &slot) in slots.iter().enumerate() {
                assert_eq!(dev.zswap.holds(slot), i % 4 != 1);
            }
            if compressor == crate::Compressor::Lz4 {
                read_every_way(&dev, &slots, &pages);
            } else {
                // zstd objects are read off the signal handler only.
                for (&slot, want) in slots.iter().zip(&pages) {
                    assert_eq!(read(&dev, slot).unwrap().as_slice(), want.as_slice());
                    let mut buf = PageBuf::new();
                    let in_place = unsafe { dev.read_page_in_place(slot, buf.as_mut_ptr(), true) };
                    assert_eq!(
                        in_place,
                        !dev.zswap.holds(slot) || buf.as_slice() == want.as_slice()
                    );
                }
            }
            for &slot in &slots {
                dev.free_slot(slot);
            }
            let z = dev.ztier_stats();
            assert_eq!(
                (z.stored_pages, z.same_filled_pages, z.stored_bytes),
                (0, 0, 0)
            );
            assert!(matches!(
                read(&dev, slots[0]),
                Err(ReadError::NeverWritten { .. })
            ));
        }
    }

    #[test]
    fn a_full_pool_writes_its_oldest_pages_back_to_the_file() {
        // Room for about 50 of these pages' objects (class 5, 640 bytes each).
        let (_dir, dev) = ztier_device(crate::Compressor::Lz4, 32 << 10);
        let slots: Vec<SlotId> = (0..400).map(|_| dev.alloc_slot().unwrap()).collect();
        let pages: Vec<PageBuf> = (0..400u64).map(compressible).collect();
        for (s, p) in slots.chunks(16).zip(pages.chunks(16)) {
            write(&dev, &s.iter().copied().zip(p).collect::<Vec<_>>());
            assert!(dev.ztier_stats().stored_bytes <= (32 << 10) + 16 * 1024);
        }
        let z = dev.ztier_stats();
        assert!(z.written_back >= 300, "{z:?}");
        assert_eq!(z.stored_pages + z.written_back, 400, "{z:?}");
        assert!(
            dev.zswap.holds(*slots.last().unwrap()),
            "the newest pages stay"
        );
        assert!(!dev.zswap.holds(slots[0]), "the oldest went to the file");
        read_every_way(&dev, &slots, &pages);
    }

    #[test]
    fn a_clean_page_kept_in_the_pool_comes_back_from_it_and_goes_without_a_write() {
        let (_dir, dev) = ztier_device(crate::Compressor::Lz4, 64 << 20);
        let slots: Vec<SlotId> = (0..32).map(|_| dev.alloc_slot().unwrap()).collect();
        let pages: Vec<PageBuf> = (0..32u64).map(compressible).collect();
        // Written to the file (the tier off), then swapped in and evicted clean.
        dev.set_ztier(false);
        write(&dev, &slots.iter().copied().zip(&pages).collect::<Vec<_>>());
        dev.set_ztier(true);
        for (&slot, page) in slots.iter().zip(&pages) {
            assert!(unsafe { dev.keep_clean(slot, page.as_ptr()) });
            assert!(
                !unsafe { dev.keep_clean(slot, page.as_ptr()) },
                "held already"
            );
        }
        let z = dev.ztier_stats();
        assert_eq!((z.stored_pages, z.stored_clean), (32, 32), "{z:?}");
        let loads = z.loads;
        read_every_way(&dev, &slots, &pages);
        assert!(dev.ztier_stats().loads > loads, "read from the pool");
        // Made to leave, the clean copies are dropped: nothing is written.
        dev.set_ztier_size(crate::ZtierSize::Bytes(0));
        dev.ztier_balance(1 << 30, 0, 0, 0);
        assert_eq!(dev.ztier_writeback(64), 0, "nothing to write");
        let z = dev.ztier_stats();
        assert_eq!(
            (z.stored_pages, z.dropped_clean, z.written_back),
            (0, 32, 0),
            "{z:?}"
        );
        read_every_way(&dev, &slots, &pages);
        // A pool with no room leaves no copy.
        assert!(!unsafe { dev.keep_clean(slots[0], pages[0].as_ptr()) });
        // A dirty page stored on a slot freed and taken again is written back, not dropped.
        dev.free_slot(slots[1]);
        let slot = dev.alloc_slot().unwrap();
        dev.set_ztier_size(crate::ZtierSize::Bytes(64 << 20));
        dev.ztier_balance(1 << 30, 0, 0, 0);
        write(&dev, &[(slot, &pages[2])]);
        dev.set_ztier_size(crate::ZtierSize::Bytes(0));
        dev.ztier_balance(1 << 30, 0, 0, 0);
        while dev.ztier_writeback(64) > 0 {}
        let z = dev.ztier_stats();
        assert_eq!((z.written_back, z.dropped_clean), (1, 32), "{z:?}");
        assert_eq!(read(&dev, slot).unwrap().as_slice(), pages[2].as_slice());
    }

    #[test]
    fn a_tier_turned_off_drains_into_the_file_as_reclaim_writes() {
        let (_dir, dev) = ztier_device(crate::Compressor::Lz4, 64 << 20);
        let slots: Vec<SlotId> = (0..200).map(|_| dev.alloc_slot().unwrap()).collect();
        let pages: Vec<PageBuf> = (0..200u64).map(compressible).collect();
        write(
            &dev,
            &slots[..100]
                .iter()
                .copied()
                .zip(&pages[..100])
                .collect::<Vec<_>>(),
        );
        assert_eq!(dev.ztier_stats().stored_pages, 100);
        dev.set_ztier(false);
        for (s, p) in slots[100..].chunks(32).zip(pages[100..].chunks(32)) {
            write(&dev, &s.iter().copied().zip(p).collect::<Vec<_>>());
        }
        let z = dev.ztier_stats();
        assert_eq!(
            (z.stored_pages, z.written_back, z.stores),
            (0, 100, 100),
            "{z:?}"
        );
        read_every_way(&dev, &slots, &pages);
    }

    #[test]
    fn a_pool_over_its_size_drains_without_a_batch_and_unsettled_victims_stay() {
        let (_dir, dev) = ztier_device(crate::Compressor::Lz4, 64 << 20);
        let slots: Vec<SlotId> = (0..64).map(|_| dev.alloc_slot().unwrap()).collect();
        let pages: Vec<PageBuf> = (0..64u64).map(compressible).collect();
        write(&dev, &slots.iter().copied().zip(&pages).collect::<Vec<_>>());
        assert_eq!(dev.ztier_writeback(64), 0, "under its size: nothing to do");
        // Victims dropped unsettled (a panic mid-writeback) go back to the pool.
        dev.set_ztier_size(crate::ZtierSize::Bytes(0));
        dev.ztier_balance(1 << 30, 0, 0, 0);
        drop(dev.zswap.victims(8, |_| false));
        assert_eq!(dev.ztier_stats().stored_pages, 64);
        dev.free_slot(slots[0]);
        assert!(matches!(
            read(&dev, slots[0]),
            Err(ReadError::NeverWritten { .. })
        ));
        // A limit lowered under what the pool holds drains it, no batch needed.
        let mut drained = 0;
        while dev.ztier_stats().stored_pages > 0 {
            let n = dev.ztier_writeback(16);
            assert!(n > 0, "{:?}", dev.ztier_stats());
            drained += n;
        }
        assert_eq!(drained, 63);
        read_every_way(&dev, &slots[1..], &pages[1..]);
    }

    /// Under pressure (reclaim found nothing else to free) a pool under its size writes
    /// its oldest pages back all the same and gives the chunks they emptied back; a pool
    /// whose process's tree holds most of the limit is sized to the rest.
    #[test]
    fn a_pool_under_pressure_shrinks_under_its_size_and_sizes_itself_to_its_share() {
        let (_dir, dev) = ztier_device(crate::Compressor::Lz4, 64 << 20);
        let slots: Vec<SlotId> = (0..600).map(|_| dev.alloc_slot().unwrap()).collect();
        let pages: Vec<PageBuf> = (0..600u64).map(compressible).collect();
        for (s, p) in slots.chunks(32).zip(pages.chunks(32)) {
            write(&dev, &s.iter().copied().zip(p).collect::<Vec<_>>());
        }
        let limit = 1u64 << 30;
        dev.ztier_balance(limit, 0, 0, 0);
        let before = dev.ztier_stats();
        assert_eq!(before.stored_pages, 600, "{before:?}");
        assert_eq!(dev.ztier_writeback(64), 0, "under its size: nothing to do");
        let mut written = 0;
        while dev.ztier_stats().pool_bytes == before.pool_bytes {
            let n = dev.ztier_shrink(256);
            assert!(
                n > 0,
                "nothing written under pressure: {:?}",
                dev.ztier_stats()
            );
            written += n;
        }
        let after = dev.ztier_stats();
        assert!(after.pool_bytes < before.pool_bytes, "{after:?}");
        assert_eq!(after.written_back, written, "{after:?}");
        read_every_way(&dev, &slots, &pages);
        // The others under the limit hold all but 1 MiB: the pool may take 90% of that.
        dev.ztier_balance(limit, limit - (1 << 20), 0, 0);
        assert_eq!(dev.ztier_stats().limit_bytes, (1 << 20) / 10 * 9);
        dev.ztier_balance(limit, 0, 0, 0);
        assert!(dev.ztier_stats().limit_bytes > 1 << 20);
    }

    /// A single read in the SIGBUS handler without stack to spare leaves pooled pages to
    /// the full path, and still reads the file's.
    #[test]
    fn a_handler_short_of_stack_leaves_pooled_pages_to_the_full_path() {
        let (_dir, dev) = ztier_device(crate::Compressor::Lz4, 64 << 20);
        let (pooled, filed) = (dev.alloc_slot().unwrap(), dev.alloc_slot().unwrap());
        write(
            &dev,
            &[(pooled, &compressible(1)), (filed, &random_page(2))],
        );
        let mut buf = PageBuf::new();
        assert!(!unsafe { dev.read_page_in_place(pooled, buf.as_mut_ptr(), false) });
        assert!(unsafe { dev.read_page_in_place(filed, buf.as_mut_ptr(), false) });
        assert_eq!(buf.as_slice(), random_page(2).as_slice());
    }

    #[test]
    fn a_rewritten_slot_in_the_pool_reads_its_latest_page() {
        let (_dir, dev) = ztier_device(crate::Compressor::Lz4, 64 << 20);
        let slot = dev.alloc_slot().unwrap();
        write(&dev, &[(slot, &compressible(1))]);
        write(&dev, &[(slot, &random_page(2))]);
        assert!(
            !dev.zswap.holds(slot),
            "an incompressible rewrite goes to the file"
        );
        assert_eq!(
            read(&dev, slot).unwrap().as_slice(),
            random_page(2).as_slice()
        );
        write(&dev, &[(slot, &compressible(3))]);
        assert_eq!(
            read(&dev, slot).unwrap().as_slice(),
            compressible(3).as_slice()
        );
        assert_eq!(dev.ztier_stats().stored_pages, 1);
    }

    #[test]
    fn a_page_corrupted_in_the_pool_fails_loudly() {
        let (_dir, dev) = ztier_device(crate::Compressor::Lz4, 64 << 20);
        let slot = dev.alloc_slot().unwrap();
        write(&dev, &[(slot, &compressible(9))]);
        dev.zswap.corrupt(slot);
        assert!(matches!(read(&dev, slot), Err(ReadError::Pool { .. })));
        let mut buf = PageBuf::new();
        assert!(!unsafe { dev.read_page_in_place(slot, buf.as_mut_ptr(), true) });
        assert_eq!(dev.io_stats().checksum_errors, 1);
    }

    #[test]
    fn incompressible_runs_are_skipped_after_a_streak_and_tried_again() {
        let (_dir, dev) = ztier_device(crate::Compressor::Lz4, 64 << 20);
        let slots: Vec<SlotId> = (0..200).map(|_| dev.alloc_slot().unwrap()).collect();
        let pages: Vec<PageBuf> = (0..200u64).map(random_page).collect();
        write(&dev, &slots.iter().copied().zip(&pages).collect::<Vec<_>>());
        let z = dev.ztier_stats();
        assert_eq!(z.reject_compress_poor + z.skipped_poor, 200);
        assert!(z.skipped_poor >= 150, "{z:?}");
        // A compressible page is stored again once one is tried.
        let more: Vec<SlotId> = (0..40).map(|_| dev.alloc_slot().unwrap()).collect();
        let good: Vec<PageBuf> = (0..40u64).map(compressible).collect();
        write(&dev, &more.iter().copied().zip(&good).collect::<Vec<_>>());
        assert!(dev.ztier_stats().stored_pages >= 1);
        read_every_way(&dev, &slots, &pages);
        read_every_way(&dev, &more, &good);
    }

    #[test]
    fn readers_writers_and_writeback_racing_never_see_a_wrong_page() {
        let (_dir, dev) = ztier_device(crate::Compressor::Lz4, 256 << 10);
        let threads = 4;
        std::thread::scope(|s| {
            for t in 0..threads {
                let dev = &dev;
                s.spawn(move || {
                    let mut mine: Vec<(SlotId, u64)> = Vec::new();
                    for n in 0..3000u64 {
                        let seed = (t << 32) | n;
                        let slot = dev.alloc_slot().unwrap();
                        let p = if n.is_multiple_of(5) {
                            random_page(seed)
                        } else {
                            compressible(seed)
                        };
                        write(dev, &[(slot, &p)]);
                        mine.push((slot, seed));
                        let (slot, seed) = mine[(n as usize * 7) % mine.len()];
                        let want = if (seed as u32).is_multiple_of(5) {
                            random_page(seed)
                        } else {
                            compressible(seed)
                        };
                        let mut buf = PageBuf::new();
                        if n % 2 == 0 {
                            unsafe { dev.read_page(slot, buf.as_mut_ptr()) }.unwrap();
                        } else {
                            assert!(unsafe {
                                dev.read_page_in_place(slot, buf.as_mut_ptr(), true)
                            });
                        }
                        assert_eq!(
                            buf.as_slice(),
                            want.as_slice(),
                            "slot {slot} seed {seed:#x}"
                        );
                        if mine.len() > 200 {
                            let (slot, _) = mine.swap_remove(n as usize % mine.len());
                            dev.free_slot(slot);
                        }
                    }
                    for (slot, _) in mine {
                        dev.free_slot(slot);
                    }
                });
            }
        });
        let z = dev.ztier_stats();
        assert!(z.written_back > 0, "{z:?}");
        assert_eq!((z.stored_pages, z.stored_bytes), (0, 0), "{z:?}");
        assert_eq!(dev.used_pages(), 0);
    }
}
