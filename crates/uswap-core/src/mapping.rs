//! Anonymous mappings uswap owns: the region, the staging area, the zero source.

use crate::error::{Error, Result};
use crate::PAGE_SIZE;
use std::sync::atomic::{AtomicBool, Ordering::Relaxed};

/// Most ranges one vectored call takes (the kernel's UIO_MAXIOV).
const IOV_MAX: usize = 1024;

/// The pidfd sentinel for the calling process (Linux 6.15, `linux/pidfd.h`).
const PIDFD_SELF_THREAD_GROUP: libc::c_int = -10001;

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

    /// A fork child's region mapping at `addr`, as the kernel gave it (the parent let the
    /// page runs `owned` be inherited for the fork, `Mm::inherit_on_fork`): not inherited
    /// by this child's own children again, except through a fork's handlers. The rest of
    /// `[addr, addr + len)` is left as it is (the parent had unmapped it; it may hold
    /// someone else's mapping).
    pub(crate) fn inherited(addr: usize, len: usize, owned: &[std::ops::Range<usize>]) -> Self {
        let m = Mapping {
            addr,
            len,
            owned: AtomicBool::new(true),
        };
        for run in owned {
            m.inherit_on_fork(run.start, run.len(), false);
        }
        m
    }

    /// Whether a child of fork gets `pages` pages at page index `first` (MADV_DOFORK) or
    /// nothing there (MADV_DONTFORK, the default: see `advise_private`).
    pub fn inherit_on_fork(&self, first: usize, pages: usize, inherit: bool) {
        let advice = if inherit {
            libc::MADV_DOFORK
        } else {
            libc::MADV_DONTFORK
        };
        // SAFETY: advising our own mapping; it changes no data. A range the program
        // unmapped meanwhile is refused (ENOMEM) where nothing is mapped, and nothing is
        // lost: the child has no page there either way.
        unsafe {
            libc::madvise(
                (self.addr + first * PAGE_SIZE) as *mut _,
                pages * PAGE_SIZE,
                advice,
            )
        };
    }

    pub fn addr(&self) -> usize {
        self.addr
    }

    pub fn len(&self) -> usize {
        self.len
    }

    pub fn is_empty(&self) -> bool {
        self.len == 0
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

    /// Frees the memory behind several runs of pages, each `(first, pages)`, with one
    /// `process_madvise` call for all of them: the kernel then flushes the TLB once (Linux
    /// 6.16 batches it), where one `madvise` per run is one flush, an IPI to every CPU
    /// running the process, each. Where the kernel refuses that call, one `madvise` per
    /// run.
    pub fn discard_runs(&self, runs: &[(usize, usize)]) {
        if runs.len() > 1 && self.discard_vector(runs) {
            return;
        }
        for &(first, pages) in runs {
            self.discard(first, pages);
        }
    }

    /// `discard_runs` as one vector; false when not every run was freed that way.
    fn discard_vector(&self, runs: &[(usize, usize)]) -> bool {
        // Set once the kernel refuses the call for good: no MADV_DONTNEED there (before
        // 6.13) or no self sentinel (before 6.15, when the flush was not batched yet).
        static REFUSED: AtomicBool = AtomicBool::new(false);
        if REFUSED.load(Relaxed) {
            return false;
        }
        let iov: Vec<libc::iovec> = runs
            .iter()
            .map(|&(first, pages)| libc::iovec {
                iov_base: (self.addr + first * PAGE_SIZE) as *mut _,
                iov_len: pages * PAGE_SIZE,
            })
            .collect();
        for chunk in iov.chunks(IOV_MAX) {
            let want: usize = chunk.iter().map(|v| v.iov_len).sum();
            // SAFETY: every range lies inside our mapping; its contents are no longer
            // needed. The sentinel names this process without a descriptor, which the
            // program's own descriptor handling could race or a fork child inherit.
            let done = unsafe {
                libc::syscall(
                    libc::SYS_process_madvise,
                    PIDFD_SELF_THREAD_GROUP,
                    chunk.as_ptr(),
                    chunk.len(),
                    libc::MADV_DONTNEED,
                    0,
                )
            };
            if done != want as i64 {
                let transient = done >= 0
                    || matches!(
                        std::io::Error::last_os_error().raw_os_error(),
                        Some(libc::ENOMEM | libc::EAGAIN | libc::EINTR)
                    );
                if !transient {
                    REFUSED.store(true, Relaxed);
                }
                return false;
            }
        }
        true
    }

    /// The owner has unmapped what was still its own: dropping must not unmap the range,
    /// which may hold someone else's mappings by now.
    pub fn disown(&self) {
        self.owned.store(false, Relaxed);
    }
}

/// The parts of `start..end` mapped in this process, as address ranges in address order;
/// `None` when `/proc/self/maps` cannot be read. One `PROCMAP_QUERY` per mapping in the
/// range (Linux 6.11), else the whole file read and parsed: for a shell, a hundred
/// mappings that a fork child took a third of a millisecond to read.
pub fn mapped_ranges(start: usize, end: usize) -> Option<Vec<std::ops::Range<usize>>> {
    let maps = std::fs::File::open("/proc/self/maps").ok()?;
    match query_ranges(&maps, start, end) {
        Ok(ranges) => Some(ranges),
        Err(_) => Some(ranges_in_text(&read_whole(maps)?, start, end)),
    }
}

/// `struct procmap_query` of `linux/fs.h`.
#[repr(C)]
#[derive(Default)]
struct ProcmapQuery {
    size: u64,
    query_flags: u64,
    query_addr: u64,
    vma_start: u64,
    vma_end: u64,
    vma_flags: u64,
    vma_page_size: u64,
    vma_offset: u64,
    inode: u64,
    dev_major: u32,
    dev_minor: u32,
    vma_name_size: u32,
    build_id_size: u32,
    vma_name_addr: u64,
    build_id_addr: u64,
}

/// `_IOWR('f', 17, struct procmap_query)`.
const PROCMAP_QUERY: libc::c_ulong = 0xC068_6611;
/// The mapping at the address, or the first one after it.
const PROCMAP_QUERY_COVERING_OR_NEXT_VMA: u64 = 0x10;

/// The mapped ranges by `PROCMAP_QUERY`; an error where the kernel has no such ioctl.
fn query_ranges(
    maps: &std::fs::File,
    start: usize,
    end: usize,
) -> std::io::Result<Vec<std::ops::Range<usize>>> {
    use std::os::fd::AsRawFd;
    let mut ranges = Vec::new();
    let mut addr = start;
    while addr < end {
        let mut q = ProcmapQuery {
            size: std::mem::size_of::<ProcmapQuery>() as u64,
            query_flags: PROCMAP_QUERY_COVERING_OR_NEXT_VMA,
            query_addr: addr as u64,
            ..Default::default()
        };
        // SAFETY: the ioctl reads and writes `q`, of the size it says.
        if unsafe { libc::ioctl(maps.as_raw_fd(), PROCMAP_QUERY, &mut q) } != 0 {
            let e = std::io::Error::last_os_error();
            match e.raw_os_error() {
                // No mapping at or after the address.
                Some(libc::ENOENT) => break,
                _ => return Err(e),
            }
        }
        let (a, b) = (
            (q.vma_start as usize).max(start),
            (q.vma_end as usize).min(end),
        );
        if a >= end {
            break;
        }
        if a < b {
            ranges.push(a..b);
        }
        addr = q.vma_end as usize;
    }
    Ok(ranges)
}

/// `/proc/self/maps`, read in large pieces (each read walks the mappings from the start of
/// the piece again).
fn read_whole(mut maps: std::fs::File) -> Option<String> {
    use std::io::Read;
    let mut text = String::with_capacity(64 << 10);
    maps.read_to_string(&mut text).ok()?;
    Some(text)
}

/// The mapped ranges within `start..end` that `maps` (the file's text) lists.
fn ranges_in_text(maps: &str, start: usize, end: usize) -> Vec<std::ops::Range<usize>> {
    let mut ranges = Vec::new();
    for line in maps.lines() {
        let Some((a, b)) = line
            .split_whitespace()
            .next()
            .and_then(|range| range.split_once('-'))
        else {
            continue;
        };
        let (Ok(a), Ok(b)) = (usize::from_str_radix(a, 16), usize::from_str_radix(b, 16)) else {
            continue;
        };
        let (a, b) = (a.max(start), b.min(end));
        if a < b {
            ranges.push(a..b);
        }
    }
    ranges
}

/// uswap manages base pages; and a child of fork() inherits a region only through uswap's
/// fork handlers, which let the kernel share its mapped pages and give the child the rest
/// (`fork.rs`): without them the child would read zeros where pages are swapped out.
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

#[cfg(all(test, not(loom)))]
mod tests {
    use super::*;

    /// A mapping of `pages` pages, page i filled with byte i + 1.
    fn filled(pages: usize) -> Mapping {
        let m = Mapping::new(pages * PAGE_SIZE).unwrap();
        for i in 0..pages {
            // SAFETY: inside the mapping, which is ours and read-write.
            unsafe {
                std::ptr::write_bytes(
                    (m.addr() + i * PAGE_SIZE) as *mut u8,
                    i as u8 + 1,
                    PAGE_SIZE,
                )
            };
        }
        m
    }

    fn first_byte(m: &Mapping, page: usize) -> u8 {
        // SAFETY: inside the mapping.
        unsafe { *((m.addr() + page * PAGE_SIZE) as *const u8) }
    }

    #[test]
    fn mapped_ranges_skip_holes_by_query_and_by_the_text_alike() {
        let m = filled(12);
        let (start, end) = (m.addr(), m.addr() + 12 * PAGE_SIZE);
        // A hole of two pages, and a page made read-only (a mapping of its own).
        // SAFETY: parts of our own mapping, which nothing else uses.
        unsafe {
            libc::munmap((start + 3 * PAGE_SIZE) as *mut _, 2 * PAGE_SIZE);
            libc::mprotect(
                (start + 8 * PAGE_SIZE) as *mut _,
                PAGE_SIZE,
                libc::PROT_READ,
            );
        }
        let pages = |ranges: Vec<std::ops::Range<usize>>| -> Vec<usize> {
            ranges
                .into_iter()
                .flat_map(|r| (r.start - start) / PAGE_SIZE..(r.end - start) / PAGE_SIZE)
                .collect()
        };
        let expected = vec![0, 1, 2, 5, 6, 7, 8, 9, 10, 11];
        assert_eq!(pages(mapped_ranges(start, end).unwrap()), expected);
        let text = std::fs::read_to_string("/proc/self/maps").unwrap();
        assert_eq!(pages(ranges_in_text(&text, start, end)), expected);
        let maps = std::fs::File::open("/proc/self/maps").unwrap();
        match query_ranges(&maps, start, end) {
            Ok(ranges) => assert_eq!(pages(ranges), expected),
            // Before Linux 6.11: the text is what is used.
            Err(e) => assert_eq!(e.raw_os_error(), Some(libc::ENOTTY), "{e}"),
        }
        // Past the last mapping of the range: nothing.
        assert_eq!(
            mapped_ranges(start + 3 * PAGE_SIZE, start + 5 * PAGE_SIZE),
            Some(vec![])
        );
        m.disown();
        // SAFETY: what is left of our mapping.
        unsafe { libc::munmap(start as *mut _, 12 * PAGE_SIZE) };
    }

    #[test]
    fn discarded_runs_read_as_zeros_and_the_pages_between_keep_their_data() {
        let runs = [(1, 2), (4, 1), (7, 3)];
        let m = filled(12);
        m.discard_runs(&runs);
        let m2 = filled(12);
        // The vectored call alone, where this kernel takes it, does the same.
        let vectored = m2.discard_vector(&runs);
        for page in 0..12 {
            let gone = runs.iter().any(|&(f, n)| (f..f + n).contains(&page));
            let expected = if gone { 0 } else { page as u8 + 1 };
            assert_eq!(first_byte(&m, page), expected, "page {page}");
            if vectored {
                assert_eq!(first_byte(&m2, page), expected, "page {page}, vectored");
            }
        }
    }
}
