//! Rings and buffers for swap-in reads in the SIGBUS handler.
//!
//! The faulting thread reads its page itself in SIGBUS mode, inside a signal handler, so it
//! may neither lock (the thread it interrupted may hold the lock) nor allocate. `pread`
//! meets that, but sleeps: the thread's vCPU halts until the device's interrupt wakes it,
//! which on a VM costs tens of µs per swap-in. A read on one of these rings is polled for
//! its completion first, as the handler threads' reads are (`SwapConfig::read_poll_us`).
//!
//! The engine makes one [`Set`] per CPU (at most [`MAX_SETS`]): a ring, where the engine
//! uses io_uring and polls its reads, and [`SIGNAL_BATCH`] page buffers, made once, for a
//! swap-in that reads ahead (the faulting page and its window in one submission). A thread
//! owns a set from its claim to its release ([`Claims`]); a handler that finds none free
//! reads its page with `pread`, or leaves a readahead to the full path. A set whose
//! submission failed is never freed again: its ring may hold an entry the kernel did not
//! take, which would still write to its buffers.

use super::page_buf::AlignedPage;
use crate::sud::raw_syscall;
use crate::sync::AtomicBool;
use crate::PAGE_SIZE;
use io_uring::{opcode, types, IoUring};
use std::cell::UnsafeCell;
use std::os::fd::{AsRawFd, RawFd};
use std::sync::atomic::Ordering;
use std::time::{Duration, Instant};

/// Sets made at most, whatever the number of CPUs.
const MAX_SETS: usize = 16;

/// The most pages one read in the SIGBUS handler takes: the faulting page and 31 read ahead
/// (a vma window is at most 32 pages, the faulting one among them).
pub(crate) const SIGNAL_BATCH: usize = 32;

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

/// What one claimed owner reads with: a ring (none in pread mode, or where the kernel
/// would not make one) and the batch's buffers.
struct Set {
    ring: Option<IoUring>,
    pages: Pages,
}

/// The pages of a batch read in the SIGBUS handler, in the order asked for, and whether
/// each was read whole (and, once the device has looked, verified). Valid until the
/// closure it is lent to returns.
pub(crate) struct SignalBatch<'a> {
    pages: *mut AlignedPage,
    len: usize,
    ok: [bool; SIGNAL_BATCH],
    set: std::marker::PhantomData<&'a mut Set>,
}

impl SignalBatch<'_> {
    /// Page `i`'s buffer (`i` below the batch's length: the signal handler must not panic,
    /// so this is checked in debug builds only).
    pub(crate) fn page(&self, i: usize) -> *mut u8 {
        debug_assert!(i < self.len, "page {i} of a batch of {}", self.len);
        // SAFETY: within the set's buffers, which the batch borrows whole.
        unsafe { std::ptr::addr_of_mut!((*self.pages.add(i)).0).cast() }
    }

    /// Whether page `i` was read whole (and passed its check, once checked); false past
    /// the batch's end.
    pub(crate) fn ok(&self, i: usize) -> bool {
        i < self.len && self.ok[i]
    }

    /// Whether page `i` is to be used (false: it was not read, or failed its check).
    pub(crate) fn set_ok(&mut self, i: usize, ok: bool) {
        if i < self.len {
            self.ok[i] = ok;
        }
    }
}

pub(super) struct SignalSets {
    claims: Claims,
    sets: Box<[UnsafeCell<Set>]>,
    /// Whether any set has a ring (single reads look for one only then).
    rings: bool,
}

// SAFETY: a set is used only by the thread that claimed it, until it releases it; its
// buffers are owned by it alone.
unsafe impl Sync for SignalSets {}
unsafe impl Send for SignalSets {}

impl SignalSets {
    /// One set per CPU, each with a ring when `with_rings` and the kernel makes one (the
    /// first it refuses ends the rings: a locked-memory limit reached stays reached), or
    /// fewer sets when their buffers cannot be mapped.
    pub(super) fn new(with_rings: bool) -> SignalSets {
        let cpus = crate::cpu::count();
        let mut making_rings = with_rings;
        let mut sets = Vec::new();
        for _ in 0..cpus.min(MAX_SETS) {
            let Some(pages) = Pages::map(SIGNAL_BATCH) else {
                break;
            };
            let ring = making_rings
                .then(|| IoUring::new(SIGNAL_BATCH as u32).ok())
                .flatten();
            making_rings &= ring.is_some();
            sets.push(UnsafeCell::new(Set { ring, pages }));
        }
        let sets = sets.into_boxed_slice();
        // SAFETY: no set is claimed yet.
        let rings = sets.iter().any(|s| unsafe { (*s.get()).ring.is_some() });
        SignalSets {
            claims: Claims::new(sets.len()),
            sets,
            rings,
        }
    }

    /// A free set, from this CPU's on (threads on different CPUs rarely meet), owned by
    /// the caller until it releases the claim.
    fn claim(&self) -> Option<usize> {
        // SAFETY: no arguments.
        let first = usize::try_from(unsafe { libc::sched_getcpu() }).unwrap_or(0);
        self.claims.claim(first)
    }

    /// Reads the page at `offset` into `dst` on a free set's ring, polling for its
    /// completion for `poll` before sleeping on it. `false` when the sets have no rings,
    /// none was free, or the read did not transfer the whole page: the caller then reads
    /// it with `pread`. Locks and allocates nothing.
    ///
    /// # Safety
    /// `dst` must be valid for a page and aligned as the file's `O_DIRECT` mode requires.
    pub(super) unsafe fn read(&self, fd: RawFd, offset: u64, dst: *mut u8, poll: Duration) -> bool {
        if !self.rings {
            return false;
        }
        let Some(i) = self.claim() else {
            return false;
        };
        // SAFETY: this thread owns the set until it releases the claim.
        let set = unsafe { &mut *self.sets[i].get() };
        let Some(ring) = set.ring.as_mut() else {
            self.claims.release(i);
            return false;
        };
        let mut whole = false;
        // SAFETY: `dst` stays valid until the completion is reaped.
        if !unsafe { submit_and_reap(ring, fd, &[(0, offset, dst)], poll, |_, n| whole = n) } {
            return false; // the set stays taken
        }
        self.claims.release(i);
        whole
    }

    /// Reads the pages at `offsets` (at most [`SIGNAL_BATCH`]) into a free set's buffers,
    /// on its ring, polled, in one submission; a page the ring did not read whole, or every
    /// page in a set without a ring, is read with `read_one` (true when read whole). Then
    /// lends the pages to `f` and frees the set. `None` when the batch is too long, no set
    /// was free or the submission failed. Locks and allocates nothing.
    ///
    /// # Safety
    /// `read_one` must read one page at the offset into the buffer, or say it did not.
    pub(super) unsafe fn read_batch<R>(
        &self,
        fd: RawFd,
        offsets: &[Option<u64>],
        poll: Duration,
        read_one: impl Fn(u64, *mut u8) -> bool,
        f: impl FnOnce(&mut SignalBatch<'_>) -> R,
    ) -> Option<R> {
        if offsets.len() > SIGNAL_BATCH {
            return None;
        }
        let i = self.claim()?;
        // SAFETY: this thread owns the set until it releases the claim.
        let set = unsafe { &mut *self.sets[i].get() };
        let mut ok = [false; SIGNAL_BATCH];
        let base = set.pages.0;
        // SAFETY: `i` is below SIGNAL_BATCH, the set's page count.
        let page = |i: usize| unsafe { std::ptr::addr_of_mut!((*base.add(i)).0).cast::<u8>() };
        if let Some(ring) = set.ring.as_mut() {
            let mut reads = [(0usize, 0u64, std::ptr::null_mut()); SIGNAL_BATCH];
            let mut n = 0;
            for (k, offset) in offsets.iter().enumerate() {
                if let Some(offset) = *offset {
                    reads[n] = (k, offset, page(k));
                    n += 1;
                }
            }
            let reads = &reads[..n];
            // SAFETY: the set's buffers live as long as the set, which stays taken on failure.
            if !unsafe { submit_and_reap(ring, fd, reads, poll, |k, whole| ok[k] = whole) } {
                return None;
            }
        }
        for (k, offset) in offsets.iter().enumerate() {
            if let (false, Some(offset)) = (ok[k], *offset) {
                ok[k] = read_one(offset, page(k));
            }
        }
        let result = f(&mut SignalBatch {
            pages: base,
            len: offsets.len(),
            ok,
            set: std::marker::PhantomData,
        });
        self.claims.release(i);
        Some(result)
    }

    /// In a fork child, for an engine it abandons: closes the descriptors of the rings
    /// that no thread was using at the fork (they are the parent's).
    pub(super) fn close_in_child(&self) {
        while let Some(i) = self.claims.claim(0) {
            // SAFETY: the set is ours now and never used again (never released).
            if let Some(ring) = unsafe { &(*self.sets[i].get()).ring } {
                // SAFETY: as above.
                unsafe { libc::close(ring.as_raw_fd()) };
            }
        }
    }
}

/// A set's page buffers, mapped straight from the kernel (under `uswap run` the C library's
/// `mmap` is the program's, served from its region): untouched, they take no memory, so a
/// set that never reads a window costs only address space.
struct Pages(*mut AlignedPage, usize);

impl Pages {
    fn map(n: usize) -> Option<Pages> {
        let len = (n * PAGE_SIZE) as u64;
        let rw = (libc::PROT_READ | libc::PROT_WRITE) as u64;
        let flags = (libc::MAP_PRIVATE | libc::MAP_ANONYMOUS) as u64;
        let at = raw_syscall(libc::SYS_mmap, [0, len, rw, flags, u64::MAX, 0]);
        (at >= 0).then(|| Pages(at as *mut AlignedPage, n))
    }
}

impl Drop for Pages {
    fn drop(&mut self) {
        let len = (self.1 * PAGE_SIZE) as u64;
        raw_syscall(libc::SYS_munmap, [self.0 as u64, len, 0, 0, 0, 0]);
    }
}

/// Submits one read per `(index, offset, dst)` on the empty `ring` and reaps every
/// completion, telling `done` each read's index and whether it transferred the whole
/// page: polls the completion queue for `poll` (yielding at each look, see
/// [`crate::sync::Looks`]), then sleeps in
/// `io_uring_enter`. Never returns before the last completion: the kernel writes to the
/// buffers until then. False when the submission failed (entries may be left queued).
///
/// # Safety
/// Every `dst` must be valid for a page until this returns.
unsafe fn submit_and_reap(
    ring: &mut IoUring,
    fd: RawFd,
    reads: &[(usize, u64, *mut u8)],
    poll: Duration,
    mut done: impl FnMut(usize, bool),
) -> bool {
    if reads.is_empty() {
        return true;
    }
    for &(k, offset, dst) in reads {
        let sqe = opcode::Read::new(types::Fd(fd), dst, PAGE_SIZE as u32)
            .offset(offset)
            .build()
            .user_data(k as u64);
        // SAFETY: the caller keeps `dst` valid until its completion is reaped.
        if unsafe { ring.submission().push(&sqe) }.is_err() {
            return false;
        }
    }
    loop {
        match ring.submit() {
            Ok(_) => break,
            Err(e) if matches!(e.raw_os_error(), Some(libc::EINTR | libc::EAGAIN)) => {}
            Err(_) => return false,
        }
    }
    let mut left = reads.len();
    let mut reap = |ring: &mut IoUring, left: &mut usize| {
        for cqe in ring.completion() {
            done(cqe.user_data() as usize, cqe.result() == PAGE_SIZE as i32);
            *left -= 1;
        }
    };
    let start = Instant::now();
    let mut looks = crate::sync::Looks::new(start);
    loop {
        reap(ring, &mut left);
        let now = Instant::now();
        looks.at(now);
        if left == 0 || now - start >= poll {
            break;
        }
        looks.look(|| enter_for_completions(ring));
    }
    while left > 0 {
        if let Err(e) = ring.submit_and_wait(left) {
            if !matches!(
                e.raw_os_error(),
                Some(libc::EINTR | libc::EAGAIN | libc::EBUSY)
            ) {
                // The reads are in flight whatever the error: keep looking, without sleeping.
                // SAFETY: no arguments.
                unsafe { libc::sched_yield() };
            }
        }
        reap(ring, &mut left);
    }
    true
}

/// Enters the kernel, which runs the ring's completion work, and returns at once: a poll's
/// look on a CPU found busy ([`crate::sync::Looks`]), where a yield would give the rest of
/// the time slice away.
pub(super) fn enter_for_completions(ring: &IoUring) {
    /// `io_uring_enter`'s flag to reap completions (linux/io_uring.h).
    const IORING_ENTER_GETEVENTS: u32 = 1;
    // SAFETY: no submissions and no argument; waits for nothing.
    let _ = unsafe {
        ring.submitter()
            .enter::<libc::sigset_t>(0, 0, IORING_ENTER_GETEVENTS, None)
    };
}

#[cfg(all(test, not(loom)))]
mod tests {
    use super::*;
    use crate::swapfile::swap_io::PageBuf;
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

    /// Sets with rings, or `None` (the test is skipped) where the kernel refuses io_uring.
    fn rings() -> Option<SignalSets> {
        let sets = SignalSets::new(true);
        if !sets.rings {
            eprintln!("skipped: io_uring is not available here");
            return None;
        }
        Some(sets)
    }

    fn read(rings: &SignalSets, file: &File, page: u64, poll: Duration) -> (bool, PageBuf) {
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
        for _ in 0..=rings.sets.len() {
            let (whole, buf) = read(&rings, &file, 1, Duration::ZERO);
            assert!(whole);
            assert_eq!(buf.as_slice(), pattern(1).as_slice());
        }
    }

    /// A batch read: every page whole and in its place, with rings and without (every page
    /// through `read_one` then); a page past the end of the file is not, and its set is
    /// free again after.
    #[test]
    fn a_batch_reads_each_page_into_its_own_buffer() {
        let (_dir, file) = file_of(64, true);
        let fd = file.as_raw_fd();
        let pread = |offset: u64, dst: *mut u8| {
            // SAFETY: a page buffer of the set.
            let n = unsafe { libc::pread(fd, dst.cast(), PAGE_SIZE, offset as libc::off_t) };
            n == PAGE_SIZE as isize
        };
        for with_rings in [true, false] {
            let sets = SignalSets::new(with_rings);
            if with_rings && !sets.rings {
                eprintln!("skipped with rings: io_uring is not available here");
                continue;
            }
            let pages: Vec<u64> = vec![40, 3, 4, 5, 63, 200, 0];
            // A last entry asks for no read (a page the caller fills itself).
            let offsets: Vec<Option<u64>> = pages
                .iter()
                .map(|p| Some(p * PAGE_SIZE as u64))
                .chain([None])
                .collect();
            for _ in 0..=sets.sets.len() {
                let seen = unsafe {
                    sets.read_batch(fd, &offsets, Duration::from_micros(50), pread, |b| {
                        assert!(!b.ok(pages.len()), "an entry not read is not ok");
                        (0..pages.len())
                            .map(|i| {
                                let page = std::slice::from_raw_parts(b.page(i), PAGE_SIZE);
                                (b.ok(i), page == pattern(pages[i]).as_slice())
                            })
                            .collect::<Vec<_>>()
                    })
                }
                .expect("a set is free");
                for (i, &page) in pages.iter().enumerate() {
                    let whole = page < 64;
                    assert_eq!(seen[i].0, whole, "page {page}, rings {with_rings}");
                    assert!(
                        seen[i].1 || !whole,
                        "page {page}'s data, rings {with_rings}"
                    );
                }
            }
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
        let threads: Vec<_> = (0..rings.sets.len() as u64 + 3)
            .map(|t| {
                let (rings, file, busy) = (rings.clone(), file.clone(), busy.clone());
                std::thread::spawn(move || {
                    let mut x = t + 1;
                    for _ in 0..READS {
                        x = crate::swapfile::swap_io::splitmix64(x);
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
