//! The program's anonymous memory: one uswap region, carved into the program's private
//! mappings and the segments of its `malloc` heap.
//!
//! Ranges are handed out first fit by address from the free runs of the space's
//! [`Book`], which also keeps what is committed (accessible) within the commit limit, and
//! what is only reserved (`PROT_NONE`, committed later by `mmap(MAP_FIXED)` or
//! `mprotect`, as language runtimes do with their heaps). A range given back is discarded
//! first (`MADV_DONTNEED`: the kernel tells uswap, which frees its frames and swap slots),
//! so a range handed out again reads as zeros, as a fresh mapping does. Heap segments are
//! whole granules of 64 KiB, and the granule table says which heap arena, slab or large
//! block owns each one, so `free` finds a block's owner without a lock.
//!
//! The region on the space is built when the program first needs it (`build`): before
//! it commits more than its start-up allowance, or starts a second thread. Until then
//! the space is plain memory, inherited by a child of fork as the kernel does it, and a
//! short command (a shell's `true`, `grep`, `sed`) runs to its end without uswap's
//! threads, userfaultfds or swap file; what it commits is charged to the tree's limit
//! (`allowance`).
//!
//! Lock order: an arena's or a slab's lock (`heap`, `slab`), then the space's build lock
//! (`unbuilt`), then the book's lock.

use crate::book::{Book, Refusal, Use};
use crate::sys;
use std::ops::Range;
use std::sync::atomic::{AtomicU32, AtomicU8, Ordering::Relaxed};
use std::sync::{Arc, Mutex, OnceLock};
use uswap_core::{Mapping, Region, PAGE_SIZE};

/// Heap segments are made of whole granules of this size.
pub const GRANULE: usize = 64 * 1024;

const PROT_RW: libc::c_int = libc::PROT_READ | libc::PROT_WRITE;

/// Granule owner meaning "no heap arena" (a mapping, or free).
pub const NO_ARENA: u8 = 0;

pub type BookGuard = std::sync::MutexGuard<'static, Book>;

pub type UnbuiltGuard = std::sync::MutexGuard<'static, Option<(Mapping, Builder)>>;

/// Builds the region on the space's mapping, given the page runs lent to other mappings
/// and those that may hold data; it stops the process when it cannot.
pub type Builder = fn(Mapping, &[Range<usize>], &[Range<usize>]) -> Arc<Region>;

pub struct Space {
    /// The region, once built (kept here so it lives as long as the process).
    region: OnceLock<Arc<Region>>,
    /// The mapping and what builds the region on it, until it is built.
    unbuilt: Mutex<Option<(Mapping, Builder)>>,
    /// Pages the program may commit before its region is built.
    allowance: usize,
    /// The process the space is this library's in: a child made without fork's handlers
    /// (a `vfork` child, the C library's `clone`) shares the library's state, and must
    /// not build or charge anything for the process it came from.
    pid: AtomicU32,
    start: usize,
    end: usize,
    book: Mutex<Book>,
    /// For each granule, its owner's byte (an arena's index plus one, a slab's
    /// `slab::OWNER_BASE` plus its index, `large::OWNER`), or `NO_ARENA`.
    owner: Box<[AtomicU8]>,
}

static SPACE: OnceLock<Space> = OnceLock::new();

/// The space, once it exists.
pub fn get() -> Option<&'static Space> {
    SPACE.get()
}

/// Makes `map` the program's memory, of which at most `commit_limit` bytes may be
/// accessible at once; `build` makes its region when the program has committed more than
/// `allowance` bytes (0: at once) or starts a thread.
pub fn install(map: Mapping, commit_limit: u64, allowance: u64, build: Builder) {
    let (start, len) = (map.addr(), map.len());
    let pages = len / PAGE_SIZE;
    let commit_pages = commit_limit.div_ceil(PAGE_SIZE as u64).min(pages as u64) as usize;
    let granules = (start + len - 1) / GRANULE - start / GRANULE + 1;
    // Plain memory until the region is built: a child of fork gets it as the kernel gives
    // one anything else.
    map.inherit_on_fork(0, pages, true);
    let space = Space {
        start,
        end: start + len,
        book: Mutex::new(Book::new(pages, commit_pages)),
        owner: unowned(granules),
        region: OnceLock::new(),
        unbuilt: Mutex::new(Some((map, build))),
        allowance: allowance.div_ceil(PAGE_SIZE as u64) as usize,
        pid: AtomicU32::new(std::process::id()),
    };
    if SPACE.set(space).is_err() {
        sys::warn("uswap: the program's memory was set up twice; keeping the first\n");
        return;
    }
    if allowance == 0 {
        build_region();
    }
}

/// Builds the program's region now, if there is a space and its region is not built.
pub fn build_region() {
    if let Some(space) = get().filter(|s| s.region.get().is_none()) {
        space.build();
    }
}

/// `granules` owner bytes, all `NO_ARENA`, from a zeroed allocation: the table is a
/// megabyte for the preload's 68 GiB space, which the internal heap maps fresh, so the
/// kernel zeroes each page when it is first touched. Written out at start, it cost every
/// process under `uswap run` 270 page faults.
fn unowned(granules: usize) -> Box<[AtomicU8]> {
    const _: () = assert!(NO_ARENA == 0);
    let bytes: Box<[u8]> = vec![0u8; granules].into_boxed_slice();
    // SAFETY: AtomicU8 has the size, alignment and bit validity of u8.
    unsafe { Box::from_raw(Box::into_raw(bytes) as *mut [AtomicU8]) }
}

impl Space {
    /// The region, once built.
    pub fn region(&self) -> Option<&Arc<Region>> {
        self.region.get()
    }

    /// Builds the region on the space, adopting what the program wrote so far. The
    /// program has one thread (a second one builds it first) or the builder is told
    /// otherwise; the book stays locked, so no other range is handed out meanwhile, and
    /// signals that could run a handler which allocates are held off.
    fn build(&self) {
        if !self.ours() {
            return;
        }
        let _quiet = uswap_core::Quiet::new();
        let mut unbuilt = self.lock_unbuilt();
        let Some((map, build)) = unbuilt.take() else {
            return;
        };
        let book = self.lock_book();
        let region = build(map, &book.lent_runs(), &book.handed_out_runs());
        let _ = self.region.set(region);
    }

    /// The build lock, held across `fork` (a child must not find it held by a thread it
    /// does not have).
    pub fn lock_unbuilt(&self) -> std::sync::MutexGuard<'_, Option<(Mapping, Builder)>> {
        self.unbuilt.lock().unwrap_or_else(|e| e.into_inner())
    }

    /// Whether this process is the one the space was set up for (see `pid`).
    pub fn ours(&self) -> bool {
        self.pid.load(Relaxed) == std::process::id()
    }

    /// Whether the region is not built and this process is the space's: its commits
    /// are charged and may build it.
    fn unbuilt_here(&self) -> bool {
        self.region.get().is_none() && self.ours()
    }

    /// In a child of fork, after its handlers ran: the space is this process's now.
    pub fn forked(&self) {
        self.pid.store(std::process::id(), Relaxed);
    }

    /// Before its region is built, the program's commits are charged to the tree's limit
    /// (`allowance`): a commit that adds `added(book)` pages builds the region first when
    /// that would pass the allowance or the limit has no room for them.
    fn before_commit(&self, added: impl FnOnce(&Book) -> usize) {
        if !self.unbuilt_here() {
            return;
        }
        let after = {
            let book = self.lock_book();
            book.committed() + added(&book)
        };
        if after > self.allowance || !crate::allowance::charge(after) {
            self.build();
        }
    }

    /// Charges what the program has committed while its region is not built.
    fn charge_commits(&self) {
        if self.unbuilt_here() {
            crate::allowance::charge(self.lock_book().committed());
        }
    }

    /// Pages the program has committed.
    pub fn committed_pages(&self) -> usize {
        self.lock_book().committed()
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

    /// The owner byte of the granule of `addr` (see `owner`), or `NO_ARENA`.
    pub fn owner(&self, addr: usize) -> u8 {
        self.owner[self.granule(addr)].load(Relaxed)
    }

    /// The index of the granule holding `addr` (granules are aligned in the address
    /// space, not to the region's start).
    fn granule(&self, addr: usize) -> usize {
        addr / GRANULE - self.start / GRANULE
    }

    /// A committed range of `len` bytes (a multiple of pages) aligned to `align` bytes,
    /// or `None` when the space is used up (said once on stderr).
    pub fn alloc(&self, len: usize, align: usize) -> Option<usize> {
        self.hand_out(len, align, Use::Committed)
    }

    /// A reserved range of `len` bytes: handed out, inaccessible (`PROT_NONE`), not
    /// charged until committed. `None` when no free run is large enough.
    pub fn reserve(&self, len: usize) -> Option<usize> {
        let at = self.hand_out(len, PAGE_SIZE, Use::Reserved)?;
        // SAFETY: a range of the space just handed out, not in use.
        if unsafe { sys::mprotect(at as *mut _, len, libc::PROT_NONE) } != 0 {
            self.lock_book()
                .give_back(self.pages(at, len).0, len / PAGE_SIZE);
            return None;
        }
        Some(at)
    }

    fn hand_out(&self, len: usize, align: usize, use_: Use) -> Option<usize> {
        if use_ == Use::Committed {
            // Wherever it lands, all of it is new.
            self.before_commit(|_| len / PAGE_SIZE);
        }
        let align_pages = (align / PAGE_SIZE).max(1);
        let got =
            self.lock_book()
                .alloc(len / PAGE_SIZE, align_pages, self.start / PAGE_SIZE, use_);
        match got {
            Ok(at) => Some(self.start + at * PAGE_SIZE),
            Err(refusal) => {
                if use_ == Use::Committed {
                    warn_exhausted(refusal);
                }
                None
            }
        }
    }

    /// Commits `[addr, addr + len)` if all of it is free (growing a range in place).
    /// False if it is not, or the commit limit is reached (said once on stderr).
    pub fn take(&self, addr: usize, len: usize) -> bool {
        let (first, pages) = self.pages(addr, len);
        // All of it is free, or it is refused.
        self.before_commit(|_| pages);
        match self.lock_book().take(first, pages) {
            Ok(()) => true,
            Err(Refusal::OverCommit) => {
                warn_exhausted(Refusal::OverCommit);
                false
            }
            Err(_) => false,
        }
    }

    /// Makes `[addr, addr + len)` the program's, committed or reserved, whatever it was
    /// (a fixed mapping over it). False when committing it would pass the commit limit
    /// (said once on stderr).
    pub fn claim(&self, addr: usize, len: usize, use_: Use) -> bool {
        let (first, pages) = self.pages(addr, len);
        if use_ == Use::Committed {
            self.before_commit(|book| book.uncommitted(first, pages));
        }
        let done = self.lock_book().map(first, pages, use_);
        if let Err(refusal) = done {
            warn_exhausted(refusal);
        }
        done.is_ok()
    }

    /// Makes `[addr, addr + len)`, all of it handed out, committed or reserved
    /// (`mprotect`).
    pub fn protect(&self, addr: usize, len: usize, use_: Use) -> Result<(), Refusal> {
        let (first, pages) = self.pages(addr, len);
        if use_ == Use::Committed {
            self.before_commit(|book| book.uncommitted(first, pages));
        }
        let done = self.lock_book().protect(first, pages, use_);
        if done == Err(Refusal::OverCommit) {
            warn_exhausted(Refusal::OverCommit);
        }
        done
    }

    /// Whether any page of `[addr, addr + len)` is reserved (inaccessible).
    pub fn any_reserved(&self, addr: usize, len: usize) -> bool {
        let (first, pages) = self.pages(addr, len);
        self.lock_book().any_reserved(first, pages)
    }

    /// Records that the kernel mapped `[addr, addr + len)` for the program (a file over
    /// part of its reservation): not uswap memory from now on, and never handed out again.
    pub fn lend(&self, addr: usize, len: usize) {
        let (first, pages) = self.pages(addr, len);
        // Lent pages are not charged: this cannot be refused.
        let _ = self.lock_book().map(first, pages, Use::Lent);
    }

    /// The ranges of `[addr, addr + len)` lent to the kernel, as (address, bytes).
    pub fn lent_in(&self, addr: usize, len: usize) -> Vec<(usize, usize)> {
        let (first, pages) = self.pages(addr, len);
        let lent = self.lock_book().lent_in(first, pages);
        lent.into_iter()
            .map(|(p, n)| (self.start + p * PAGE_SIZE, n * PAGE_SIZE))
            .collect()
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
        self.lock_book().give_back(first, pages);
        self.charge_commits();
    }

    fn pages(&self, addr: usize, len: usize) -> (usize, usize) {
        ((addr - self.start) / PAGE_SIZE, len / PAGE_SIZE)
    }

    /// The book, locked (held across `fork` too).
    pub fn lock_book(&self) -> std::sync::MutexGuard<'_, Book> {
        self.book.lock().unwrap_or_else(|e| e.into_inner())
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
        zapped
            && self
                .region
                .get()
                .is_none_or(|r| r.forget(addr - self.start, len).is_ok())
    }

    /// Records the owner byte of the whole granules of `[addr, addr + len)`.
    pub fn set_owner(&self, addr: usize, len: usize, owner: u8) {
        let base = self.start / GRANULE;
        let (first, end) = (addr.div_ceil(GRANULE) - base, (addr + len) / GRANULE - base);
        for g in first..end {
            self.owner[g].store(owner, Relaxed);
        }
    }
}

/// Says once that the space is used up, and what to do.
fn warn_exhausted(refusal: Refusal) {
    static SAID: [std::sync::atomic::AtomicBool; 2] =
        [const { std::sync::atomic::AtomicBool::new(false) }; 2];
    let (i, message) = match refusal {
        Refusal::OverCommit => (
            0,
            "uswap: the program used up the memory uswap set aside for it (resident and \
             swapped together); allocations now fail with ENOMEM. Rerun with a larger \
             --vm-size (or --swap-size).\n",
        ),
        Refusal::NoRoom | Refusal::NotHandedOut => (
            1,
            "uswap: the program used up the address space uswap keeps for its memory \
             (committed and reserved together); allocations now fail with ENOMEM. Rerun \
             with a larger --address-space.\n",
        ),
    };
    if !SAID[i].swap(true, Relaxed) {
        sys::warn(message);
    }
}
