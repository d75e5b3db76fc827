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
    pub fn inherited(addr: usize, len: usize, owned: &[std::ops::Range<usize>]) -> Self {
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
