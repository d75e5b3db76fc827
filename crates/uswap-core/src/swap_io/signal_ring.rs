//! Rings for swap-in reads in the SIGBUS handler.
//!
//! The faulting thread reads its page itself in SIGBUS mode, inside a signal handler, so it
//! may neither lock (the thread it interrupted may hold the lock) nor allocate. `pread`
//! meets that, but sleeps: the thread's vCPU halts until the device's interrupt wakes it,
//! which on a VM costs tens of µs per swap-in. A read on one of these rings is polled for
//! its completion first, as the handler threads' reads are (`SwapConfig::read_poll_us`).
//!
//! The rings are made with the engine, one per CPU (at most [`MAX_RINGS`]). A thread owns
//! a ring from its claim to its release ([`Claims`]); a handler that finds none free reads
//! with `pread` instead. A ring whose submission failed is never freed again: it may hold an
//! entry the kernel did not take.

use crate::sync::AtomicBool;
use crate::PAGE_SIZE;
use io_uring::{opcode, types, IoUring};
use std::cell::UnsafeCell;
use std::os::fd::{AsRawFd, RawFd};
use std::sync::atomic::Ordering;
use std::time::{Duration, Instant};

/// Rings made at most, whatever the number of CPUs.
const MAX_RINGS: usize = 16;

/// Entries of each ring: one read at a time.
const ENTRIES: u32 = 2;

/// Ownership flags of a set of slots: a thread owns a slot from the `claim` that returned
/// it (Acquire) until it `release`s it (Release).
pub(super) struct Claims(Box<[AtomicBool]>);

impl Claims {
    pub(super) fn new(n: usize) -> Claims {
        Claims((0..n).map(|_| AtomicBool::new(false)).collect())
    }

    /// A free slot, looked for from `first` on, now owned by the caller; `None` when all
    /// are owned.
    pub(super) fn claim(&self, first: usize) -> Option<usize> {
        let n = self.0.len();
        (0..n).map(|i| (first + i) % n).find(|&i| {
            self.0[i]
                .compare_exchange(false, true, Ordering::Acquire, Ordering::Relaxed)
                .is_ok()
        })
    }

    pub(super) fn release(&self, slot: usize) {
        debug_assert!(
            self.0[slot].load(Ordering::Relaxed),
            "slot {slot} released unowned"
        );
        self.0[slot].store(false, Ordering::Release);
    }
}

pub(super) struct SignalRings {
    claims: Claims,
    rings: Box<[UnsafeCell<IoUring>]>,
}

// SAFETY: a ring is used only by the thread that claimed it, until it releases it.
unsafe impl Sync for SignalRings {}

impl SignalRings {
    /// One ring per CPU, or `None` when none can be made.
    pub(super) fn new() -> Option<SignalRings> {
        let cpus = std::thread::available_parallelism().map_or(1, |n| n.get());
        let rings: Box<[UnsafeCell<IoUring>]> = (0..cpus.min(MAX_RINGS))
            .map_while(|_| IoUring::new(ENTRIES).ok())
            .map(UnsafeCell::new)
            .collect();
        (!rings.is_empty()).then(|| SignalRings {
            claims: Claims::new(rings.len()),
            rings,
        })
    }

    /// Reads the page at `offset` into `dst` on a free ring, polling for its completion
    /// for `poll` before sleeping on it. `false` when no ring was free or the read did not
    /// transfer the whole page: the caller then reads it with `pread`. Locks and allocates
    /// nothing.
    ///
    /// # Safety
    /// `dst` must be valid for a page and aligned as the file's `O_DIRECT` mode requires.
    pub(super) unsafe fn read(&self, fd: RawFd, offset: u64, dst: *mut u8, poll: Duration) -> bool {
        // Start at this CPU's ring: threads on different CPUs rarely meet.
        let first = usize::try_from(libc::sched_getcpu()).unwrap_or(0);
        let Some(slot) = self.claims.claim(first) else {
            return false;
        };
        // SAFETY: this thread owns the ring until it releases the claim.
        let ring = unsafe { &mut *self.rings[slot].get() };
        let sqe = opcode::Read::new(types::Fd(fd), dst, PAGE_SIZE as u32)
            .offset(offset)
            .build();
        // SAFETY: `dst` stays valid until the completion is reaped below.
        if unsafe { ring.submission().push(&sqe) }.is_err() {
            // Only a ring left with an entry in it is full; it stays taken.
            return false;
        }
        let result = loop {
            match ring.submit() {
                Ok(_) => break wait(ring, poll),
                Err(e) if matches!(e.raw_os_error(), Some(libc::EINTR | libc::EAGAIN)) => {}
                // The entry may still be queued: the ring stays taken.
                Err(_) => return false,
            }
        };
        self.claims.release(slot);
        result == PAGE_SIZE as i32
    }

    /// In a fork child, for an engine it abandons: closes the descriptors of the rings
    /// that no thread was using at the fork (they are the parent's).
    pub(super) fn close_in_child(&self) {
        while let Some(slot) = self.claims.claim(0) {
            // SAFETY: the ring is ours now and never used again (never released).
            unsafe { libc::close((*self.rings[slot].get()).as_raw_fd()) };
        }
    }
}

/// Waits for the one read in flight on `ring` and returns its result: polls the completion
/// queue for `poll`, yielding the CPU at each look, then sleeps in `io_uring_enter`. Never
/// returns before the completion: the kernel writes to the buffer until then.
fn wait(ring: &mut IoUring, poll: Duration) -> i32 {
    let start = Instant::now();
    loop {
        if let Some(cqe) = ring.completion().next() {
            return cqe.result();
        }
        if start.elapsed() >= poll {
            break;
        }
        // SAFETY: no arguments. The yield also enters the kernel, which posts completions.
        unsafe { libc::sched_yield() };
    }
    loop {
        if let Err(e) = ring.submit_and_wait(1) {
            if !matches!(
                e.raw_os_error(),
                Some(libc::EINTR | libc::EAGAIN | libc::EBUSY)
            ) {
                // The read is in flight whatever the error: keep looking, without sleeping.
                // SAFETY: no arguments.
                unsafe { libc::sched_yield() };
            }
        }
        if let Some(cqe) = ring.completion().next() {
            return cqe.result();
        }
    }
}

#[cfg(all(test, not(loom)))]
mod tests {
    use super::*;
    use crate::swap_io::PageBuf;
    use std::fs::File;
    use std::os::unix::fs::{FileExt, OpenOptionsExt};
    use std::sync::atomic::AtomicU64;
    use std::sync::Arc;

    /// Page `i`'s contents: its number, then a byte pattern of it.
    fn pattern(i: u64) -> PageBuf {
        let mut p = PageBuf::new();
        p.as_mut_slice().fill(i as u8 ^ 0x5a);
        p.as_mut_slice()[..8].copy_from_slice(&i.to_le_bytes());
        p
    }

    /// A file of `pages` patterned pages, opened with `O_DIRECT` when `direct`.
    fn file_of(pages: u64, direct: bool) -> (tempfile::TempDir, File) {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("swap");
        let plain = File::create_new(&path).unwrap();
        for i in 0..pages {
            plain
                .write_all_at(pattern(i).as_slice(), i * PAGE_SIZE as u64)
                .unwrap();
        }
        let file = File::options()
            .read(true)
            .custom_flags(if direct { libc::O_DIRECT } else { 0 })
            .open(&path)
            .unwrap();
        (dir, file)
    }

    /// The rings, or `None` (the test is skipped) where the kernel refuses io_uring.
    fn rings() -> Option<SignalRings> {
        let rings = SignalRings::new();
        if rings.is_none() {
            eprintln!("skipped: io_uring is not available here");
        }
        rings
    }

    fn read(rings: &SignalRings, file: &File, page: u64, poll: Duration) -> (bool, PageBuf) {
        let mut buf = PageBuf::new();
        buf.as_mut_slice().fill(0xee);
        // SAFETY: an aligned page of our own.
        let whole = unsafe {
            rings.read(
                file.as_raw_fd(),
                page * PAGE_SIZE as u64,
                buf.as_mut_ptr(),
                poll,
            )
        };
        (whole, buf)
    }

    #[test]
    fn a_page_is_read_whole_whether_polled_or_slept_on() {
        let Some(rings) = rings() else { return };
        for direct in [false, true] {
            let (_dir, file) = file_of(16, direct);
            let polls = [0, 1, 250, 10_000].map(Duration::from_micros);
            for (page, poll) in (0..16).zip(polls.iter().cycle()) {
                let (whole, buf) = read(&rings, &file, page, *poll);
                assert!(whole, "page {page}, poll {poll:?}, direct {direct}");
                assert_eq!(buf.as_slice(), pattern(page).as_slice(), "page {page}");
            }
        }
    }

    #[test]
    fn a_read_that_is_not_whole_says_so_and_frees_its_ring() {
        let Some(rings) = rings() else { return };
        let (_dir, file) = file_of(2, false);
        // Past the end of the file: a read of 0 bytes.
        let (whole, _) = read(&rings, &file, 5, Duration::from_micros(250));
        assert!(!whole);
        // Every ring is free again: as many reads as rings, then one more, all succeed.
        for _ in 0..=rings.rings.len() {
            let (whole, buf) = read(&rings, &file, 1, Duration::ZERO);
            assert!(whole);
            assert_eq!(buf.as_slice(), pattern(1).as_slice());
        }
    }

    /// More threads than rings read random pages at once, each trying again until it gets
    /// a ring: every read either returns the right page or finds no ring free and leaves
    /// the buffer untouched. Two threads on one ring would reap each other's completions
    /// and see the wrong page.
    #[test]
    fn threads_never_share_a_ring() {
        const PAGES: u64 = 128;
        const READS: u64 = 400;
        let Some(rings) = rings().map(Arc::new) else {
            return;
        };
        let (_dir, file) = file_of(PAGES, true);
        let file = Arc::new(file);
        let busy = Arc::new(AtomicU64::new(0));
        let threads: Vec<_> = (0..rings.rings.len() as u64 + 3)
            .map(|t| {
                let (rings, file, busy) = (rings.clone(), file.clone(), busy.clone());
                std::thread::spawn(move || {
                    let mut x = t + 1;
                    for _ in 0..READS {
                        x = crate::swap_io::splitmix64(x);
                        let (page, poll) = (x % PAGES, Duration::from_micros(x >> 60));
                        loop {
                            let (whole, buf) = read(&rings, &file, page, poll);
                            if whole {
                                assert_eq!(buf.as_slice(), pattern(page).as_slice());
                                break;
                            }
                            assert!(buf.as_slice().iter().all(|&b| b == 0xee));
                            busy.fetch_add(1, Ordering::Relaxed);
                            std::thread::yield_now();
                        }
                    }
                })
            })
            .collect();
        for t in threads {
            t.join().unwrap();
        }
        eprintln!("{} tries found no ring free", busy.load(Ordering::Relaxed));
    }
}

/// Model check of ring ownership:
/// `RUSTFLAGS="--cfg loom" cargo test -p uswap-core --lib --release signal_ring::loom`.
#[cfg(all(test, loom))]
mod loom_tests {
    use super::*;
    use loom::sync::atomic::AtomicUsize;
    use loom::sync::Arc;

    #[test]
    fn a_slot_has_at_most_one_owner() {
        loom::model(|| {
            let claims = Arc::new(Claims::new(2));
            let owners = Arc::new([AtomicUsize::new(0), AtomicUsize::new(0)]);
            let threads: Vec<_> = (0..3)
                .map(|t| {
                    let (claims, owners) = (claims.clone(), owners.clone());
                    loom::thread::spawn(move || {
                        if let Some(slot) = claims.claim(t) {
                            assert_eq!(owners[slot].fetch_add(1, Ordering::Relaxed), 0);
                            owners[slot].fetch_sub(1, Ordering::Relaxed);
                            claims.release(slot);
                            true
                        } else {
                            false
                        }
                    })
                })
                .collect();
            let claimed = threads
                .into_iter()
                .map(|t| t.join().unwrap())
                .filter(|&c| c)
                .count();
            // Two slots for three threads: at least two claims succeed.
            assert!(claimed >= 2);
            // Every claim was released.
            let again = (claims.claim(0), claims.claim(0), claims.claim(0));
            assert_eq!(again, (Some(0), Some(1), None));
        });
    }
}
