//! Staging frames: a second anonymous mapping, registered with a userfaultfd of its own,
//! where inactive pages are parked by UFFDIO_MOVE: unmapped from the region but still in
//! memory. One frame per page of the memory limit, handed out from a free list. The
//! mapping is reserved for the largest limit the region can be given (its size), so raising
//! the limit only adds frames to the free list.

use crate::error::Result;
use crate::lockstat::{LockClass, StatMutex};
use crate::mapping::Mapping;
use crate::PAGE_SIZE;

/// Frames whose memory is freed together (see [`Staging::release_later`]).
const DEFERRED_BATCH: usize = 64;

pub struct Staging {
    map: Mapping,
    free: StatMutex<Vec<u32>>,
    /// Frames emptied by a copy, waiting to have their memory freed in one batch.
    deferred: StatMutex<Vec<u32>>,
    /// Frames handed to the free list so far (the highest memory limit yet).
    frames: std::sync::atomic::AtomicU32,
}

impl Staging {
    /// `frames` frames now (at most `max_frames`), room for `max_frames`.
    pub fn new(frames: u64, max_frames: u64) -> Result<Self> {
        let frames = frames.min(max_frames);
        let map = Mapping::new(max_frames as usize * PAGE_SIZE)?;
        let mut free = Vec::with_capacity(frames as usize);
        free.extend((0..frames as u32).rev());
        Ok(Staging {
            map,
            free: StatMutex::new(free),
            deferred: StatMutex::new(Vec::with_capacity(DEFERRED_BATCH)),
            frames: (frames as u32).into(),
        })
    }

    /// Makes `frames` frames available in all (a raised memory limit); fewer is a no-op.
    pub fn grow(&self, frames: u64) {
        let frames = (frames as u32).min((self.map.len() / PAGE_SIZE) as u32);
        let mut free = self.free_list();
        let have = self.frames.load(std::sync::atomic::Ordering::Relaxed);
        if frames > have {
            free.reserve_exact((frames - have) as usize);
            free.extend((have..frames).rev());
            self.frames
                .store(frames, std::sync::atomic::Ordering::Relaxed);
        }
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
        if self.free_list().len() < n {
            self.flush_deferred();
        }
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
    /// Allocates nothing (the SIGBUS handler uses it).
    pub fn release(&self, frame: u32) {
        self.map.discard(frame as usize, 1);
        self.free_list().push(frame);
    }

    /// Returns a frame whose page was copied away, freeing its memory later, with
    /// [`DEFERRED_BATCH`] others: one MADV_DONTNEED (one TLB flush, an IPI to every CPU
    /// running the process) per run of adjacent frames instead of one per frame. Until then
    /// the frame is on neither list and its stale copy costs memory outside the budget,
    /// at most 256 KiB.
    pub fn release_later(&self, frame: u32) {
        let full = {
            let mut deferred = self.deferred.lock();
            deferred.push(frame);
            deferred.len() >= DEFERRED_BATCH
        };
        if full {
            self.flush_deferred();
        }
    }

    /// Frees the memory of the frames [`Staging::release_later`] holds back.
    pub fn flush_deferred(&self) {
        let frames = std::mem::replace(
            &mut *self.deferred.lock(),
            Vec::with_capacity(DEFERRED_BATCH),
        );
        if !frames.is_empty() {
            self.release_all(frames);
        }
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

    /// The frames on the free list or waiting to be freed (for the invariant walker).
    pub fn free_frames(&self) -> Vec<u32> {
        let mut frames = self.free_list().clone();
        frames.extend(self.deferred.lock().iter());
        frames
    }

    /// All frames, free or holding a page.
    pub fn frames(&self) -> usize {
        self.frames.load(std::sync::atomic::Ordering::Relaxed) as usize
    }

    /// The free list never grows past the frame count, so pushing onto it never allocates:
    /// it was created (or grown) holding every frame.
    fn free_list(&self) -> crate::sync::MutexGuard<'_, Vec<u32>> {
        self.free.lock()
    }

    /// The statistics of the free-list lock.
    pub fn lockstat(&self) -> LockClass {
        LockClass::sum("staging", [&self.free, &self.deferred])
    }
}

#[cfg(all(test, not(loom)))]
mod tests {
    use super::*;

    #[test]
    fn frames_released_together_come_back_in_order() {
        let s = Staging::new(8, 8).unwrap();
        let all = s.alloc_many(8);
        assert_eq!(all, (0..8).collect::<Vec<u32>>());
        s.release_all(vec![6, 2, 3, 5, 4]);
        assert_eq!(s.alloc_many(3), vec![2, 3, 4]);
        assert_eq!(s.alloc_many(9), vec![5, 6]);
        assert!(s.alloc_many(1).is_empty());
    }

    #[test]
    fn frames_never_outnumber_the_room_reserved() {
        let s = Staging::new(8, 4).unwrap();
        assert_eq!((s.frames(), s.alloc_many(10).len()), (4, 4));
        s.grow(100);
        assert_eq!(s.frames(), 4, "growth stops at the room reserved");
    }

    #[test]
    fn frames_released_later_are_freed_in_a_batch_or_when_needed() {
        let s = Staging::new(4, 4).unwrap();
        let frames = s.alloc_many(4);
        for &f in &frames {
            // SAFETY: the frame is ours and mapped.
            unsafe { *(s.addr(f) as *mut u8) = 9 };
        }
        s.release_later(frames[1]);
        s.release_later(frames[2]);
        assert_eq!(s.free_frames().len(), 2, "counted as free");
        assert_eq!(
            s.alloc_many(1).len(),
            1,
            "short: the deferred frames are freed first"
        );
        for f in s.alloc_many(4) {
            // SAFETY: as above; their memory was freed.
            assert_eq!(unsafe { *(s.addr(f) as *const u8) }, 0);
        }
    }

    #[test]
    fn staging_frames_are_unique_and_come_back_empty() {
        let s = Staging::new(2, 4).unwrap();
        assert_eq!(s.alloc_many(10).len(), 2);
        s.release_all(vec![0, 1]);
        s.grow(4);
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
