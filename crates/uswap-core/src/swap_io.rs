//! Page-sized swap I/O: io_uring with a pool of rings, or plain `pread`/`pwrite`.
//!
//! A batch of page writes goes to the kernel in one `io_uring_enter`. When the kernel refuses
//! io_uring (too old, `kernel.io_uring_disabled`, seccomp) the engine falls back to
//! `pread`/`pwrite` once, at creation, and reports the effective mode.

use crate::{IoMode, PAGE_SIZE};
use io_uring::{opcode, types, IoUring, Probe};
use std::fs::File;
use std::io;
use std::os::fd::{AsRawFd, RawFd};
use std::sync::Mutex;

/// Submission queue size of each ring; a larger batch is split into several submissions.
/// 256 is the largest reclaim batch the configuration allows.
const RING_ENTRIES: u32 = 256;

#[repr(C, align(4096))]
struct AlignedPage([u8; PAGE_SIZE]);

/// An owned, zeroed, 4096-byte-aligned buffer of one page (for `O_DIRECT`).
pub struct PageBuf(Box<AlignedPage>);

impl PageBuf {
    pub fn new() -> PageBuf {
        PageBuf(Box::new(AlignedPage([0; PAGE_SIZE])))
    }

    pub fn as_ptr(&self) -> *const u8 {
        self.0 .0.as_ptr()
    }

    pub fn as_mut_ptr(&mut self) -> *mut u8 {
        self.0 .0.as_mut_ptr()
    }

    pub fn as_slice(&self) -> &[u8] {
        &self.0 .0
    }

    pub fn as_mut_slice(&mut self) -> &mut [u8] {
        &mut self.0 .0
    }
}

impl Default for PageBuf {
    fn default() -> Self {
        PageBuf::new()
    }
}

/// One page-sized transfer at a byte offset of the swap file.
#[derive(Clone, Copy, Debug)]
pub(crate) enum PageOp {
    Read { offset: u64, dst: *mut u8 },
    Write { offset: u64, src: *const u8 },
}

/// Issues [`PageOp`]s against a file, through io_uring or `pread`/`pwrite`.
pub(crate) struct IoEngine {
    /// `None` in pread mode, requested or fallen back to.
    rings: Option<RingPool>,
}

impl IoEngine {
    /// An engine for `requested`; io_uring falls back to pread when it cannot be set up.
    pub(crate) fn new(requested: IoMode) -> IoEngine {
        let rings = match requested {
            IoMode::Uring => RingPool::probe(),
            IoMode::Pread => None,
        };
        IoEngine { rings }
    }

    /// The mode in effect after any fallback.
    pub(crate) fn mode(&self) -> IoMode {
        match self.rings {
            Some(_) => IoMode::Uring,
            None => IoMode::Pread,
        }
    }

    /// Runs every op and returns one result per op, in order. A short transfer is an error.
    ///
    /// # Safety
    /// Each op's buffer must be valid for `PAGE_SIZE` bytes (writable for reads) until this
    /// returns, and aligned as the file's `O_DIRECT` mode requires.
    pub(crate) unsafe fn run(&self, file: &File, ops: &[PageOp]) -> Vec<io::Result<()>> {
        let fd = file.as_raw_fd();
        match &self.rings {
            Some(pool) => pool.run(fd, ops),
            None => ops.iter().map(|op| run_sync(fd, op)).collect(),
        }
    }
}

/// Rings not in use right now. A thread takes one for a batch and gives it back after.
struct RingPool(Mutex<Vec<IoUring>>);

impl RingPool {
    /// A pool holding one ring, or `None` when this kernel cannot do our reads and writes
    /// through io_uring.
    fn probe() -> Option<RingPool> {
        let ring = IoUring::new(RING_ENTRIES).ok()?;
        let mut probe = Probe::new();
        ring.submitter().register_probe(&mut probe).ok()?;
        let usable =
            probe.is_supported(opcode::Read::CODE) && probe.is_supported(opcode::Write::CODE);
        usable.then(|| RingPool(Mutex::new(vec![ring])))
    }

    /// A ring from the pool, or a new one; `None` if none can be made now (e.g. out of
    /// locked memory), in which case the caller does this batch with pread/pwrite.
    fn take(&self) -> Option<IoUring> {
        let pooled = self.0.lock().unwrap_or_else(|e| e.into_inner()).pop();
        pooled.or_else(|| IoUring::new(RING_ENTRIES).ok())
    }

    fn give_back(&self, ring: IoUring) {
        self.0.lock().unwrap_or_else(|e| e.into_inner()).push(ring);
    }

    /// # Safety
    /// As [`IoEngine::run`].
    unsafe fn run(&self, fd: RawFd, ops: &[PageOp]) -> Vec<io::Result<()>> {
        let Some(mut ring) = self.take() else {
            return ops.iter().map(|op| run_sync(fd, op)).collect();
        };
        let mut results = Vec::with_capacity(ops.len());
        let mut healthy = true;
        for chunk in ops.chunks(RING_ENTRIES as usize) {
            if healthy {
                let (chunk_results, ok) = run_on_ring(&mut ring, fd, chunk);
                results.extend(chunk_results);
                healthy = ok;
            } else {
                results.extend(chunk.iter().map(|op| run_sync(fd, op)));
            }
        }
        // A ring whose submission failed may hold stale entries: never use it again.
        if healthy {
            self.give_back(ring);
        }
        results
    }
}

/// Submits at most `RING_ENTRIES` ops and waits for all of them. Returns the results and
/// whether the ring is still fit for reuse.
///
/// # Safety
/// As [`IoEngine::run`].
unsafe fn run_on_ring(
    ring: &mut IoUring,
    fd: RawFd,
    ops: &[PageOp],
) -> (Vec<io::Result<()>>, bool) {
    let mut results: Vec<Option<io::Result<()>>> = (0..ops.len()).map(|_| None).collect();
    {
        let mut sq = ring.submission();
        for (i, op) in ops.iter().enumerate() {
            let sqe = sqe_for(fd, op).user_data(i as u64);
            // Cannot fail: the queue was empty and ops.len() <= RING_ENTRIES.
            sq.push(&sqe).expect("io_uring submission queue overflow");
        }
    }
    let (mut submitted, mut done) = (0, 0);
    while done < ops.len() {
        match ring.submit_and_wait(ops.len() - done) {
            Ok(n) => submitted += n,
            Err(e) if is_transient(&e) => {}
            Err(e) if submitted == done => {
                // Nothing is in flight, so no buffer is still in the kernel's hands.
                fill_missing(&mut results, &e);
                return (results.into_iter().map(Option::unwrap).collect(), false);
            }
            Err(e) => panic!(
                "io_uring_enter failed with {} requests in flight: {e}",
                submitted - done
            ),
        }
        for cqe in ring.completion() {
            results[cqe.user_data() as usize] = Some(page_result(cqe.result()));
            done += 1;
        }
    }
    (results.into_iter().map(Option::unwrap).collect(), true)
}

fn sqe_for(fd: RawFd, op: &PageOp) -> io_uring::squeue::Entry {
    let len = PAGE_SIZE as u32;
    match *op {
        PageOp::Read { offset, dst } => opcode::Read::new(types::Fd(fd), dst, len)
            .offset(offset)
            .build(),
        PageOp::Write { offset, src } => opcode::Write::new(types::Fd(fd), src, len)
            .offset(offset)
            .build(),
    }
}

fn is_transient(e: &io::Error) -> bool {
    matches!(
        e.raw_os_error(),
        Some(libc::EINTR | libc::EAGAIN | libc::EBUSY)
    )
}

fn fill_missing(results: &mut [Option<io::Result<()>>], e: &io::Error) {
    for slot in results.iter_mut().filter(|r| r.is_none()) {
        *slot = Some(Err(io::Error::new(
            e.kind(),
            format!("io_uring submission failed: {e}"),
        )));
    }
}

/// Turns a transfer's return value (bytes, or a negated errno) into a result.
fn page_result(ret: i32) -> io::Result<()> {
    match ret {
        r if r < 0 => Err(io::Error::from_raw_os_error(-r)),
        r if r as usize == PAGE_SIZE => Ok(()),
        r => Err(io::Error::new(
            io::ErrorKind::UnexpectedEof,
            format!("short transfer: {r} of {PAGE_SIZE} bytes"),
        )),
    }
}

/// # Safety
/// As [`IoEngine::run`].
unsafe fn run_sync(fd: RawFd, op: &PageOp) -> io::Result<()> {
    loop {
        let ret = match *op {
            PageOp::Read { offset, dst } => {
                libc::pread(fd, dst.cast(), PAGE_SIZE, offset as libc::off_t)
            }
            PageOp::Write { offset, src } => {
                libc::pwrite(fd, src.cast(), PAGE_SIZE, offset as libc::off_t)
            }
        };
        if ret < 0 {
            let err = io::Error::last_os_error();
            if err.raw_os_error() == Some(libc::EINTR) {
                continue;
            }
            return Err(err);
        }
        return page_result(ret as i32);
    }
}

#[cfg(all(test, not(loom)))]
pub(crate) mod tests {
    use super::*;

    fn roundtrip(mode: IoMode) {
        let dir = tempfile::tempdir().unwrap();
        let file = File::options()
            .read(true)
            .write(true)
            .create(true)
            .truncate(true)
            .open(dir.path().join("io"))
            .unwrap();
        let engine = IoEngine::new(mode);
        let mut pages: Vec<PageBuf> = (0..300u32)
            .map(|i| {
                let mut p = PageBuf::new();
                p.as_mut_slice().fill(i as u8);
                p.as_mut_slice()[..4].copy_from_slice(&i.to_le_bytes());
                p
            })
            .collect();
        let writes: Vec<PageOp> = pages
            .iter()
            .enumerate()
            .map(|(i, p)| PageOp::Write {
                offset: (i * PAGE_SIZE) as u64,
                src: p.as_ptr(),
            })
            .collect();
        // 300 ops also exercise the split into two ring submissions.
        let results = unsafe { engine.run(&file, &writes) };
        assert!(results.iter().all(|r| r.is_ok()), "{results:?}");
        let mut back: Vec<PageBuf> = (0..pages.len()).map(|_| PageBuf::new()).collect();
        let reads: Vec<PageOp> = back
            .iter_mut()
            .enumerate()
            .map(|(i, p)| PageOp::Read {
                offset: (i * PAGE_SIZE) as u64,
                dst: p.as_mut_ptr(),
            })
            .collect();
        let results = unsafe { engine.run(&file, &reads) };
        assert!(results.iter().all(|r| r.is_ok()), "{results:?}");
        for (a, b) in pages.iter_mut().zip(&back) {
            assert_eq!(a.as_slice(), b.as_slice());
        }
    }

    #[test]
    fn page_buf_is_aligned_and_zeroed() {
        let b = PageBuf::new();
        assert_eq!(b.as_ptr() as usize % PAGE_SIZE, 0);
        assert_eq!(b.as_slice().len(), PAGE_SIZE);
        assert!(b.as_slice().iter().all(|&x| x == 0));
    }

    /// Whether this kernel lets us use io_uring, so a test can insist on it.
    pub(crate) fn uring_allowed() -> bool {
        std::fs::read_to_string("/proc/sys/kernel/io_uring_disabled").is_ok_and(|v| v.trim() == "0")
    }

    #[test]
    fn uring_engine_roundtrips_a_large_batch() {
        if uring_allowed() {
            assert_eq!(IoEngine::new(IoMode::Uring).mode(), IoMode::Uring);
        }
        roundtrip(IoMode::Uring);
    }

    #[test]
    fn pread_engine_roundtrips_a_large_batch() {
        assert_eq!(IoEngine::new(IoMode::Pread).mode(), IoMode::Pread);
        roundtrip(IoMode::Pread);
    }

    #[test]
    fn reading_past_the_end_is_a_short_transfer_error() {
        let dir = tempfile::tempdir().unwrap();
        let file = File::options()
            .read(true)
            .write(true)
            .create_new(true)
            .open(dir.path().join("empty"))
            .unwrap();
        for mode in [IoMode::Uring, IoMode::Pread] {
            let mut buf = PageBuf::new();
            let op = PageOp::Read {
                offset: 0,
                dst: buf.as_mut_ptr(),
            };
            let results = unsafe { IoEngine::new(mode).run(&file, &[op]) };
            let err = results.into_iter().next().unwrap().unwrap_err();
            assert_eq!(err.kind(), io::ErrorKind::UnexpectedEof, "{mode:?}: {err}");
        }
    }
}
