//! The resident budget and the staging frames.
//!
//! The budget counts the region's resident pages (active + inactive + being filled) against
//! the memory limit, like a zone's free-page count against its watermarks. The staging area
//! is a second anonymous mapping, registered with the same userfaultfd, where inactive pages
//! are parked by UFFDIO_MOVE: unmapped from the region but still in memory.

use crate::error::{Error, Result};
use crate::sync::AtomicU64;
use crate::PAGE_SIZE;
use std::sync::atomic::Ordering::Relaxed;
use std::sync::Mutex;

pub struct FrameBudget {
    limit: u64,
    resident: AtomicU64,
}

impl FrameBudget {
    pub fn new(limit: u64) -> Self {
        FrameBudget {
            limit,
            resident: AtomicU64::new(0),
        }
    }

    /// Charges up to `want` pages; returns how many were granted (0 when the budget is spent).
    pub fn try_charge(&self, want: u64) -> u64 {
        let mut cur = self.resident.load(Relaxed);
        loop {
            let got = want.min(self.limit.saturating_sub(cur));
            if got == 0 {
                return 0;
            }
            match self
                .resident
                .compare_exchange_weak(cur, cur + got, Relaxed, Relaxed)
            {
                Ok(_) => return got,
                Err(now) => cur = now,
            }
        }
    }

    pub fn uncharge(&self, pages: u64) {
        let before = self.resident.fetch_sub(pages, Relaxed);
        debug_assert!(before >= pages, "uncharging more pages than are resident");
    }

    pub fn resident(&self) -> u64 {
        self.resident.load(Relaxed)
    }

    pub fn free(&self) -> u64 {
        self.limit.saturating_sub(self.resident())
    }

    pub fn limit(&self) -> u64 {
        self.limit
    }
}

/// An anonymous private mapping with no reserve, unmapped on drop.
pub struct Mapping {
    addr: usize,
    len: usize,
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
}

impl Drop for Mapping {
    fn drop(&mut self) {
        // SAFETY: unmapping the mapping we created.
        unsafe { libc::munmap(self.addr as *mut _, self.len) };
    }
}

/// Staging frames: one per page of the memory limit, handed out from a free list.
pub struct Staging {
    map: Mapping,
    free: Mutex<Vec<u32>>,
}

impl Staging {
    pub fn new(frames: u64) -> Result<Self> {
        let map = Mapping::new(frames as usize * PAGE_SIZE)?;
        Ok(Staging {
            map,
            free: Mutex::new((0..frames as u32).rev().collect()),
        })
    }

    pub fn mapping(&self) -> &Mapping {
        &self.map
    }

    pub fn addr(&self, frame: u32) -> usize {
        self.map.addr() + frame as usize * PAGE_SIZE
    }

    /// Up to `n` frames; frames released together come back together and in order, so a
    /// batch of pages can often be moved into them with one UFFDIO_MOVE.
    pub fn alloc_many(&self, n: usize) -> Vec<u32> {
        let mut free = self.free_list();
        let take = n.min(free.len());
        let at = free.len() - take;
        let mut frames = free.split_off(at);
        frames.reverse();
        frames
    }

    /// Returns a frame whose page was moved away (nothing to free).
    pub fn release_empty(&self, frame: u32) {
        self.free_list().push(frame);
    }

    /// Returns a frame after freeing its memory, so the next MOVE finds it empty.
    pub fn release(&self, frame: u32) {
        self.release_all(vec![frame]);
    }

    /// Frees the memory of many frames with one MADV_DONTNEED per run of adjacent frames
    /// (each call is a TLB flush, an IPI to every CPU running the process), then returns
    /// them to the free list.
    pub fn release_all(&self, mut frames: Vec<u32>) {
        frames.sort_unstable();
        for run in frames.chunk_by(|a, b| a + 1 == *b) {
            self.map.discard(run[0] as usize, run.len());
        }
        frames.reverse();
        self.free_list().extend(frames);
    }

    fn free_list(&self) -> std::sync::MutexGuard<'_, Vec<u32>> {
        self.free.lock().unwrap_or_else(|e| e.into_inner())
    }
}

#[cfg(all(test, not(loom)))]
mod tests {
    use super::*;

    #[test]
    fn budget_grants_at_most_the_limit() {
        let b = FrameBudget::new(10);
        assert_eq!(b.try_charge(4), 4);
        assert_eq!(b.try_charge(8), 6);
        assert_eq!(b.try_charge(1), 0);
        b.uncharge(3);
        assert_eq!((b.resident(), b.free()), (7, 3));
    }

    #[test]
    fn stress_concurrent_charges_never_exceed_the_limit() {
        let b = FrameBudget::new(1000);
        std::thread::scope(|s| {
            for _ in 0..4 {
                s.spawn(|| {
                    for _ in 0..50_000 {
                        let got = b.try_charge(3);
                        assert!(b.resident() <= 1000);
                        b.uncharge(got);
                    }
                });
            }
        });
        assert_eq!(b.resident(), 0);
    }

    #[test]
    fn frames_released_together_come_back_in_order() {
        let s = Staging::new(8).unwrap();
        let all = s.alloc_many(8);
        assert_eq!(all, (0..8).collect::<Vec<u32>>());
        s.release_all(vec![6, 2, 3, 5, 4]);
        assert_eq!(s.alloc_many(3), vec![2, 3, 4]);
        assert_eq!(s.alloc_many(9), vec![5, 6]);
        assert!(s.alloc_many(1).is_empty());
    }

    #[test]
    fn staging_frames_are_unique_and_come_back_empty() {
        let s = Staging::new(4).unwrap();
        let frames = s.alloc_many(10);
        assert_eq!(frames.len(), 4);
        let f = frames[2];
        // SAFETY: the frame is ours and mapped (not registered with any userfaultfd here).
        unsafe { *(s.addr(f) as *mut u8) = 7 };
        s.release(f);
        assert_eq!(s.alloc_many(1), vec![f]);
        // SAFETY: as above; MADV_DONTNEED made it read as zero.
        assert_eq!(unsafe { *(s.addr(f) as *const u8) }, 0);
        assert!(s.alloc_many(1).is_empty());
    }
}

/// Model check of the budget: `RUSTFLAGS="--cfg loom" cargo test -p uswap-core --lib --release page_alloc::loom`.
#[cfg(all(test, loom))]
mod loom_tests {
    use super::*;

    #[test]
    fn concurrent_charges_never_exceed_the_limit_and_all_come_back() {
        loom::model(|| {
            let b = std::sync::Arc::new(FrameBudget::new(3));
            let threads: Vec<_> = (0..2)
                .map(|_| {
                    let b = b.clone();
                    loom::thread::spawn(move || {
                        let got = b.try_charge(2);
                        assert!(b.resident() <= 3);
                        got
                    })
                })
                .collect();
            let granted: Vec<u64> = threads.into_iter().map(|t| t.join().unwrap()).collect();
            assert_eq!(
                granted.iter().sum::<u64>(),
                3,
                "{granted:?}: all of the limit, no more"
            );
            b.uncharge(3);
            assert_eq!(b.resident(), 0);
        });
    }
}
