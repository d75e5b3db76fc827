//! What the kernel's page tables say about this process's pages, from
//! `/proc/self/pagemap`: whether a page is mapped and write-protected (one entry per page,
//! read with `pread`), and, under asynchronous write protection, which pages were written
//! since they were last protected (`PAGEMAP_SCAN`, Linux 6.7).

use crate::PAGE_SIZE;
use std::fs::File;
use std::os::fd::{AsRawFd, RawFd};
use std::os::unix::fs::FileExt;

/// What the kernel's page tables say about one page.
#[derive(Clone, Copy, Debug, Default)]
pub(crate) struct PagemapEntry {
    pub present: bool,
    /// The userfaultfd write-protect bit (`PM_UFFD_WP`).
    pub write_protected: bool,
    /// Mapped by this process alone (`PM_MMAP_EXCLUSIVE`): no fork relative maps it too.
    pub exclusive: bool,
    /// Out in the kernel's swap, or being migrated (`PM_SWAP`): not present, yet not
    /// missing either (the kernel brings it back itself).
    pub swapped: bool,
}

/// `PAGEMAP_SCAN` of `include/uapi/linux/fs.h` (Linux 6.7): `_IOWR('f', 16, pm_scan_arg)`.
const PAGEMAP_SCAN: u64 = 0xC060_6610;
/// Write-protect the pages that match (the written ones).
const PM_SCAN_WP_MATCHING: u64 = 1 << 0;
/// Fail unless the range is registered for asynchronous write protection.
const PM_SCAN_CHECK_WPASYNC: u64 = 1 << 1;
/// A page written since its protection was last set (or never protected).
const PAGE_IS_WRITTEN: u64 = 1 << 1;
/// A page mapped. Asked for with `PAGE_IS_WRITTEN`: alone, that takes the kernel's fast
/// path, which counts an empty entry as written and leaves a protection marker in it.
const PAGE_IS_PRESENT: u64 = 1 << 3;

#[repr(C)]
#[derive(Default)]
struct PmScanArg {
    size: u64,
    flags: u64,
    start: u64,
    end: u64,
    walk_end: u64,
    vec: u64,
    vec_len: u64,
    max_pages: u64,
    category_inverted: u64,
    category_mask: u64,
    category_anyof_mask: u64,
    return_mask: u64,
}

#[repr(C)]
#[derive(Clone, Copy, Default)]
struct PageRegion {
    start: u64,
    end: u64,
    categories: u64,
}

/// This process's `/proc/self/pagemap`, open.
pub(crate) struct Pagemap(File);

impl Pagemap {
    pub fn open() -> std::io::Result<Pagemap> {
        File::open("/proc/self/pagemap").map(Pagemap)
    }

    pub fn raw(&self) -> RawFd {
        self.0.as_raw_fd()
    }

    /// The entries of `into.len()` pages (at most 64) from the page at `addr`, in one
    /// pread; false when they cannot be read.
    pub fn entries(&self, addr: usize, into: &mut [PagemapEntry]) -> bool {
        let mut raw = [0u64; 64];
        let raw = &mut raw[..into.len()];
        // SAFETY: the u64 array viewed as its bytes.
        let bytes =
            unsafe { std::slice::from_raw_parts_mut(raw.as_mut_ptr().cast(), raw.len() * 8) };
        let offset = (addr / PAGE_SIZE * 8) as u64;
        if self.0.read_exact_at(bytes, offset).is_err() {
            return false;
        }
        for (entry, bits) in into.iter_mut().zip(raw.iter()) {
            *entry = PagemapEntry {
                present: bits & (1 << 63) != 0,
                swapped: bits & (1 << 62) != 0,
                write_protected: bits & (1 << 57) != 0,
                exclusive: bits & (1 << 56) != 0,
            };
        }
        true
    }

    /// Calls `written` with each range of mapped pages in `[start, end)` written since
    /// they were last write-protected, and protects them again: the look and the new
    /// protection are one step under the page table lock (`PM_SCAN_WP_MATCHING`). The
    /// range must be registered for asynchronous write protection
    /// (`PM_SCAN_CHECK_WPASYNC`), or the scan fails. False when it failed.
    pub fn take_written(
        &self,
        mut start: usize,
        end: usize,
        mut written: impl FnMut(usize, usize),
    ) -> bool {
        let mut regions = [PageRegion::default(); 32];
        while start < end {
            let mut arg = PmScanArg {
                size: std::mem::size_of::<PmScanArg>() as u64,
                flags: PM_SCAN_WP_MATCHING | PM_SCAN_CHECK_WPASYNC,
                start: start as u64,
                end: end as u64,
                vec: regions.as_mut_ptr() as u64,
                vec_len: regions.len() as u64,
                category_mask: PAGE_IS_WRITTEN | PAGE_IS_PRESENT,
                return_mask: PAGE_IS_WRITTEN,
                ..PmScanArg::default()
            };
            // SAFETY: the argument and its output array outlive the call.
            let found = unsafe { libc::ioctl(self.raw(), PAGEMAP_SCAN as _, &mut arg) };
            if found < 0 {
                return false;
            }
            for r in &regions[..found as usize] {
                written(r.start as usize, r.end as usize);
            }
            // The walk stops early only when the output array is full; a walk that did not
            // move on is taken for a failure rather than tried again for ever.
            let walked = arg.walk_end as usize;
            if walked <= start || walked > end {
                return false;
            }
            start = walked;
        }
        true
    }
}
