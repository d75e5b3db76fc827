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
        // uswap manages base pages; a child of fork() must not see the mapping at all
        // (it would read zeros where pages are swapped out), so it gets none.
        for advice in [libc::MADV_NOHUGEPAGE, libc::MADV_DONTFORK] {
            // SAFETY: advising our own mapping.
            if unsafe { libc::madvise(m.addr as *mut _, len, advice) } != 0 {
                return Err(Error::os("madvise"));
            }
        }
        Ok(m)
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

impl Drop for Mapping {
    fn drop(&mut self) {
        if self.owned.load(Relaxed) {
            // SAFETY: unmapping the mapping we created.
            unsafe { libc::munmap(self.addr as *mut _, self.len) };
        }
    }
}
