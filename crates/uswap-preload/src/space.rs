//! The program's anonymous memory: one uswap region, carved into the program's private
//! mappings and the segments of its `malloc` heap.
//!
//! Ranges are handed out first fit by address from a free list of page runs. A range given
//! back is discarded first (`MADV_DONTNEED`: the kernel tells uswap, which frees its
//! frames and swap slots), so a range handed out again reads as zeros, as a fresh mapping
//! does. Heap segments are whole granules of 64 KiB, and the granule table says which
//! heap arena owns each one, so `free` finds a block's arena without a lock.
//!
//! Lock order: an arena's lock (`heap`), then the free list's lock.

use crate::{runs, sys};
use std::collections::BTreeMap;
use std::sync::atomic::{AtomicU8, Ordering::Relaxed};
use std::sync::{Arc, Mutex, OnceLock};
use uswap_core::{Region, PAGE_SIZE};

/// Heap segments are made of whole granules of this size.
pub const GRANULE: usize = 64 * 1024;

const PROT_RW: libc::c_int = libc::PROT_READ | libc::PROT_WRITE;

/// Granule owner meaning "no heap arena" (a mapping, or free).
pub const NO_ARENA: u8 = 0;

pub type FreeListGuard = std::sync::MutexGuard<'static, BTreeMap<usize, usize>>;

pub struct Space {
    /// The region (kept here so it lives as long as the process).
    region: Arc<Region>,
    start: usize,
    end: usize,
    /// Free runs: first page index → pages.
    free: Mutex<BTreeMap<usize, usize>>,
    /// For each granule, the heap arena owning it plus one, or `NO_ARENA`.
    owner: Box<[AtomicU8]>,
}

static SPACE: OnceLock<Space> = OnceLock::new();

/// The space, once it exists.
pub fn get() -> Option<&'static Space> {
    SPACE.get()
}

/// Makes `region` the program's memory.
pub fn install(region: Arc<Region>) {
    let start = region.as_ptr() as usize;
    let pages = region.len() / PAGE_SIZE;
    let granules = (start + region.len() - 1) / GRANULE - start / GRANULE + 1;
    let space = Space {
        start,
        end: start + region.len(),
        free: Mutex::new(BTreeMap::from([(0, pages)])),
        owner: (0..granules).map(|_| AtomicU8::new(NO_ARENA)).collect(),
        region,
    };
    if SPACE.set(space).is_err() {
        sys::warn("uswap: the program's memory was set up twice; keeping the first\n");
    }
}

impl Space {
    pub fn region(&self) -> &Arc<Region> {
        &self.region
    }

    pub fn contains(&self, addr: usize) -> bool {
        (self.start..self.end).contains(&addr)
    }

    /// Whether `[addr, addr + len)` touches the space.
    pub fn overlaps(&self, addr: usize, len: usize) -> bool {
        addr < self.end && addr.saturating_add(len) > self.start
    }

    /// Whether `[addr, addr + len)` lies wholly inside the space.
    pub fn holds(&self, addr: usize, len: usize) -> bool {
        addr >= self.start && addr.saturating_add(len) <= self.end
    }

    /// The heap arena owning the granule of `addr` (plus one), or `NO_ARENA`.
    pub fn owner(&self, addr: usize) -> u8 {
        self.owner[self.granule(addr)].load(Relaxed)
    }

    /// The index of the granule holding `addr` (granules are aligned in the address
    /// space, not to the region's start).
    fn granule(&self, addr: usize) -> usize {
        addr / GRANULE - self.start / GRANULE
    }

    /// A range of `len` bytes (a multiple of pages) aligned to `align` bytes, or `None`
    /// when the space is used up.
    pub fn alloc(&self, len: usize, align: usize) -> Option<usize> {
        let align_pages = (align / PAGE_SIZE).max(1);
        let mut free = self.lock_free();
        let at = runs::alloc(
            &mut free,
            len / PAGE_SIZE,
            align_pages,
            self.start / PAGE_SIZE,
        )?;
        Some(self.start + at * PAGE_SIZE)
    }

    /// Takes `[addr, addr + len)` out of the free list if all of it is free (growing a
    /// range in place).
    pub fn take(&self, addr: usize, len: usize) -> bool {
        let (first, pages) = self.pages(addr, len);
        let mut free = self.lock_free();
        let ok = runs::all_free(&free, first, pages);
        if ok {
            runs::claim(&mut free, first, pages);
        }
        ok
    }

    /// Makes `[addr, addr + len)` the program's whatever it was (a fixed mapping over it):
    /// what was free is taken off the free list.
    pub fn claim(&self, addr: usize, len: usize) {
        let (first, pages) = self.pages(addr, len);
        runs::claim(&mut self.lock_free(), first, pages);
    }

    /// Gives `[addr, addr + len)` back: its contents are discarded and it reads as zeros
    /// when handed out again. Parts already free stay free (munmap of a range partly
    /// unmapped already).
    pub fn release(&self, addr: usize, len: usize) {
        if !self.zero(addr, len) {
            // The contents would survive into the next user of the range: keep it out.
            sys::warn("uswap: discarding freed program memory failed; the range is kept\n");
            return;
        }
        self.set_owner(addr, len, NO_ARENA);
        let (first, pages) = self.pages(addr, len);
        runs::give_back(&mut self.lock_free(), first, pages);
    }

    fn pages(&self, addr: usize, len: usize) -> (usize, usize) {
        ((addr - self.start) / PAGE_SIZE, len / PAGE_SIZE)
    }

    fn lock_free(&self) -> std::sync::MutexGuard<'_, BTreeMap<usize, usize>> {
        self.free.lock().unwrap_or_else(|e| e.into_inner())
    }

    /// Makes `[addr, addr + len)` read as zeros: discarded (the kernel tells uswap, which
    /// frees its frames and slots), then forgotten, so a page reclaim moved out between
    /// uswap's handling of the discard and the kernel's zap does not come back with its
    /// old data. The range must not be in use. False if the kernel refused.
    pub fn zero(&self, addr: usize, len: usize) -> bool {
        // A range made inaccessible or read-only (a guard page, a JIT's code) is read-write
        // memory again for its next user, as a fresh mapping would be.
        // SAFETY: the range is the space's own and no longer in use.
        let writable = unsafe { sys::mprotect(addr as *mut _, len, PROT_RW) } == 0;
        // SAFETY: as above.
        let zapped =
            writable && unsafe { sys::madvise(addr as *mut _, len, libc::MADV_DONTNEED) } == 0;
        zapped && self.region.forget(addr - self.start, len).is_ok()
    }

    /// Records the heap arena owning the whole granules of `[addr, addr + len)`.
    pub fn set_owner(&self, addr: usize, len: usize, owner: u8) {
        let base = self.start / GRANULE;
        let (first, end) = (addr.div_ceil(GRANULE) - base, (addr + len) / GRANULE - base);
        for g in first..end {
            self.owner[g].store(owner, Relaxed);
        }
    }

    /// Holds the free list (across `fork`).
    pub fn lock_free_list(&'static self) -> FreeListGuard {
        self.free.lock().unwrap_or_else(|e| e.into_inner())
    }
}

/// Says once that the space is used up, and what to do.
pub fn warn_exhausted() {
    static SAID: std::sync::atomic::AtomicBool = std::sync::atomic::AtomicBool::new(false);
    if !SAID.swap(true, Relaxed) {
        sys::warn(
            "uswap: the program used up the memory uswap set aside for it (resident and \
             swapped together); allocations now fail with ENOMEM. Rerun with a larger \
             --vm-size (or --swap-size).\n",
        );
    }
}
