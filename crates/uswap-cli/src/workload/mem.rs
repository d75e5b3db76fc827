//! Views of the memory a workload runs on: a uswap region or a plain anonymous mapping.

use std::io;
use std::sync::atomic::{AtomicU64, AtomicU8};
use uswap_core::{Region, PAGE_SIZE};

/// Words of one page.
pub const WORDS: usize = PAGE_SIZE / 8;

/// A raw, shareable view of page-aligned memory. Every access goes through atomics, so
/// threads may share it freely.
#[derive(Clone, Copy)]
pub struct Mem {
    ptr: *mut u8,
    pages: usize,
}

// SAFETY: `Mem` is only a pointer and a length; all accesses through it are atomic.
unsafe impl Send for Mem {}
unsafe impl Sync for Mem {}

impl Mem {
    /// # Safety
    /// `ptr` must be page-aligned and valid for reads and writes of `len` bytes for as long
    /// as this `Mem` (or a copy) is used.
    pub unsafe fn new(ptr: *mut u8, len: usize) -> Self {
        debug_assert_eq!(ptr as usize % PAGE_SIZE, 0);
        Mem {
            ptr,
            pages: len / PAGE_SIZE,
        }
    }

    pub fn pages(&self) -> usize {
        self.pages
    }

    /// The words of page `p`.
    pub fn page(&self, p: usize) -> &[AtomicU64] {
        assert!(p < self.pages, "page {p} out of range");
        // SAFETY: in bounds, 8-byte aligned, valid per `new`'s contract; AtomicU64 has the
        // layout of u64.
        unsafe {
            std::slice::from_raw_parts(self.ptr.add(p * PAGE_SIZE) as *const AtomicU64, WORDS)
        }
    }

    /// How many of the pages are in memory now (mincore: swapped-out pages are not).
    pub fn resident_pages(&self) -> io::Result<u64> {
        let mut in_core = vec![0u8; self.pages];
        // SAFETY: the range is valid per `new`'s contract; the vector has a byte per page.
        let r = unsafe {
            libc::mincore(
                self.ptr.cast(),
                self.pages * PAGE_SIZE,
                in_core.as_mut_ptr(),
            )
        };
        if r != 0 {
            return Err(io::Error::last_os_error());
        }
        Ok(in_core.iter().filter(|&&b| b & 1 != 0).count() as u64)
    }

    /// The first byte of page `p`, for workloads that touch one byte per page.
    pub fn byte(&self, p: usize) -> &AtomicU8 {
        assert!(p < self.pages, "page {p} out of range");
        // SAFETY: in bounds and valid per `new`'s contract; AtomicU8 has the layout of u8.
        unsafe { &*(self.ptr.add(p * PAGE_SIZE) as *const AtomicU8) }
    }
}

/// Memory a workload can be given; dropping it unmaps it.
pub trait Mapped {
    fn mem(&self) -> Mem;
}

impl Mapped for Region {
    fn mem(&self) -> Mem {
        // SAFETY: a region's memory is page-aligned and lives as long as the region.
        unsafe { Mem::new(self.as_ptr(), self.len()) }
    }
}

/// Plain anonymous memory, as an ordinary program gets it; the kernel's own swap backs it.
pub struct AnonMap {
    ptr: *mut u8,
    len: usize,
}

impl AnonMap {
    pub fn new(len: usize) -> io::Result<Self> {
        // SAFETY: a fresh private anonymous mapping; no existing memory is touched.
        let ptr = unsafe {
            libc::mmap(
                std::ptr::null_mut(),
                len,
                libc::PROT_READ | libc::PROT_WRITE,
                libc::MAP_PRIVATE | libc::MAP_ANONYMOUS | libc::MAP_NORESERVE,
                -1,
                0,
            )
        };
        if ptr == libc::MAP_FAILED {
            return Err(io::Error::last_os_error());
        }
        Ok(AnonMap {
            ptr: ptr.cast(),
            len,
        })
    }
}

impl Mapped for AnonMap {
    fn mem(&self) -> Mem {
        // SAFETY: mmap returns page-aligned memory that lives until drop.
        unsafe { Mem::new(self.ptr, self.len) }
    }
}

impl Drop for AnonMap {
    fn drop(&mut self) {
        // SAFETY: unmaps exactly the mapping made in `new`.
        unsafe { libc::munmap(self.ptr.cast(), self.len) };
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::sync::atomic::Ordering::Relaxed;

    #[test]
    fn anonymous_memory_starts_zero_and_keeps_writes() {
        let map = AnonMap::new(4 * PAGE_SIZE).unwrap();
        let mem = map.mem();
        assert_eq!(mem.pages(), 4);
        assert_eq!(mem.page(3)[WORDS - 1].load(Relaxed), 0);
        assert_eq!(mem.resident_pages().unwrap(), 1, "only the page read");
        mem.page(2)[5].store(42, Relaxed);
        assert_eq!(mem.page(2)[5].load(Relaxed), 42);
        assert_eq!(mem.resident_pages().unwrap(), 2);
    }
}
