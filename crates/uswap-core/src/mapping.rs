//! Anonymous mappings uswap owns: the region, the staging area, the zero source.

use crate::error::{Error, Result};
use crate::PAGE_SIZE;
use std::sync::atomic::{AtomicBool, Ordering::Relaxed};

/// An anonymous private mapping with no reserve, unmapped on drop.
pub struct Mapping {
    addr: usize,
    len: usize,
    /// Cleared when the owner unmapped (part of) it itself.
    owned: AtomicBool,
}

impl Mapping {
    pub fn new(len: usize) -> Result<Self> {
        // SAFETY: a fresh anonymous mapping; no existing memory is affected.
        let addr = unsafe {
            libc::mmap(
                std::ptr::null_mut(),
                len,
                libc::PROT_READ | libc::PROT_WRITE,
                libc::MAP_PRIVATE | libc::MAP_ANONYMOUS | libc::MAP_NORESERVE,
                -1,
                0,
            )
        };
        if addr == libc::MAP_FAILED {
            return Err(Error::os("mmap"));
        }
        let m = Mapping {
            addr: addr as usize,
            len,
            owned: AtomicBool::new(true),
        };
        advise_private(m.addr, len)?;
        Ok(m)
    }

    /// In a fork child, first thing: holds the page runs `owned` of the parent's region at
    /// `addr` with inaccessible memory, so that nothing else is mapped there before the
    /// region is built again (`fixed`), and an access to a region the child does not
    /// inherit fails with SIGSEGV instead of reaching whatever the kernel put there.
    pub fn reserve_in_child(addr: usize, owned: &[std::ops::Range<usize>]) -> Result<()> {
        // MAP_FIXED_NOREPLACE maps only where nothing is mapped (the parent's region is not
        // inherited: MADV_DONTFORK).
        map_runs(addr, owned, libc::PROT_NONE, libc::MAP_FIXED_NOREPLACE)
    }

    /// A fork child's copy of a region's mapping at `addr`, over what `reserve_in_child`
    /// reserved: the page runs `owned` are mapped, fresh; the rest of `[addr, addr + len)`
    /// is left as it is (the parent had unmapped it; it may hold someone else's mapping).
    pub fn fixed(addr: usize, len: usize, owned: &[std::ops::Range<usize>]) -> Result<Self> {
        // MAP_FIXED replaces the runs' reservations, ours.
        map_runs(
            addr,
            owned,
            libc::PROT_READ | libc::PROT_WRITE,
            libc::MAP_FIXED,
        )?;
        for run in owned {
            advise_private(addr + run.start * PAGE_SIZE, run.len() * PAGE_SIZE)?;
        }
        Ok(Mapping {
            addr,
            len,
            owned: AtomicBool::new(true),
        })
    }

    pub fn addr(&self) -> usize {
        self.addr
    }

    pub fn len(&self) -> usize {
        self.len
    }

    /// Frees the memory behind `pages` pages at page index `first` (they read as missing after).
    pub fn discard(&self, first: usize, pages: usize) {
        // SAFETY: the range lies inside our mapping; its contents are no longer needed.
        unsafe {
            libc::madvise(
                (self.addr + first * PAGE_SIZE) as *mut _,
                pages * PAGE_SIZE,
                libc::MADV_DONTNEED,
            )
        };
    }

    /// The owner has unmapped what was still its own: dropping must not unmap the range,
    /// which may hold someone else's mappings by now.
    pub fn disown(&self) {
        self.owned.store(false, Relaxed);
    }
}

/// Maps fresh anonymous memory over each page run of `runs` at `addr`, where the runs are,
/// with `prot` and `fixed` (`MAP_FIXED` or `MAP_FIXED_NOREPLACE`).
fn map_runs(
    addr: usize,
    runs: &[std::ops::Range<usize>],
    prot: libc::c_int,
    fixed: libc::c_int,
) -> Result<()> {
    for run in runs {
        let (start, len) = (addr + run.start * PAGE_SIZE, run.len() * PAGE_SIZE);
        let flags = libc::MAP_PRIVATE | libc::MAP_ANONYMOUS | libc::MAP_NORESERVE | fixed;
        // SAFETY: an anonymous mapping at a fixed place the caller owns (MAP_FIXED) or
        // where nothing is (MAP_FIXED_NOREPLACE).
        let got = unsafe { libc::mmap(start as *mut _, len, prot, flags, -1, 0) };
        if got == libc::MAP_FAILED {
            return Err(Error::os("mmap of a fork child's region"));
        }
        if got as usize != start {
            // SAFETY: unmapping what this call just mapped elsewhere (old kernels treat
            // MAP_FIXED_NOREPLACE as a hint).
            unsafe { libc::munmap(got, len) };
            return Err(Error::invalid(
                "fork",
                "the kernel did not map the child's region where the parent had it",
            ));
        }
    }
    Ok(())
}

/// uswap manages base pages; and a child of fork() must not inherit the mapping: it would
/// read zeros where pages are swapped out, and sharing the parent's pages would stop
/// UFFDIO_MOVE from taking them (it moves only pages mapped once). The child gets a copy
/// of its own instead (`fork.rs`).
fn advise_private(addr: usize, len: usize) -> Result<()> {
    for advice in [libc::MADV_NOHUGEPAGE, libc::MADV_DONTFORK] {
        // SAFETY: advising our own mapping.
        if unsafe { libc::madvise(addr as *mut _, len, advice) } != 0 {
            return Err(Error::os("madvise"));
        }
    }
    Ok(())
}

impl Drop for Mapping {
    fn drop(&mut self) {
        if self.owned.load(Relaxed) {
            // SAFETY: unmapping the mapping we created.
            unsafe { libc::munmap(self.addr as *mut _, self.len) };
        }
    }
}
