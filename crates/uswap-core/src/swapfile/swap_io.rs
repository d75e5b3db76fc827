//! Page-sized swap I/O: io_uring with a pool of rings, or plain `pread`/`pwrite`.
//!
//! A batch of page writes goes to the kernel in one `io_uring_enter`. The rings are made by
//! the engine's first transfer outside a signal handler (the first swap-out, in practice),
//! not with the engine: most processes under `uswap run` never swap, and a ring costs
//! them a tenth of a millisecond to set up and tear down. When the kernel refuses io_uring
//! (too old, `kernel.io_uring_disabled`, seccomp) the engine falls back to `pread`/`pwrite`
//! then, once, and reports the effective mode.
//!
//! Transient failures are retried in both modes: EAGAIN, EINTR, ENOMEM and EBUSY up to
//! [`MAX_TRIES`] tries with a short backoff, EIO on a read up to [`READ_EIO_TRIES`], and a
//! short transfer by resubmitting the remainder (or the whole page, where `O_DIRECT`
//! alignment forbids the remainder's offset). A [`FaultPlan`] injects faults here, under
//! everything above.
//!
//! A batch of reads through io_uring is polled for its completions for a while
//! (`SwapConfig::read_poll_us`) before the thread sleeps on them. A swap-in read is what a
//! faulting thread waits for; a handler that slept on it is woken by the completion,
//! and on a VM whose idle vCPUs halt that wake-up costs tens of µs on top of the device's
//! time, in every major fault. The poller yields its CPU at each look, so a thread that
//! wants the CPU gets it, unless a yield found the CPU busy with other programs: there a
//! yield gives the rest of the time slice away, and a look only enters the kernel
//! (`sync::Looks`). While it waits, a thread's read-wait hook (`set_read_wait_hook`)
//! runs at each look and once before it sleeps: a fault handler uses it to hand the
//! reading of new faults on to another handler while its own read is in flight. The
//! SIGBUS handler's reads, which may not lock or allocate, go to rings of their own
//! (`signal_ring`).

pub(crate) mod page_buf;
mod signal_ring;

use crate::config::FaultPlan;
use crate::lockdep::Rank;
use crate::lockstat::{LockClass, StatMutex};
use crate::{IoMode, PAGE_SIZE};
use io_uring::{opcode, types, IoUring, Probe};
pub use page_buf::PageBuf;
use signal_ring::SignalSets;
pub(crate) use signal_ring::{SignalBatch, SIGNAL_BATCH};
use std::cell::Cell;
use std::fs::File;
use std::io;
use std::os::fd::{AsRawFd, RawFd};
use std::sync::atomic::{AtomicU64, Ordering::Relaxed};
use std::sync::OnceLock;
use std::time::{Duration, Instant};

thread_local! {
    static READ_WAIT_HOOK: Cell<Option<fn()>> = const { Cell::new(None) };
}

/// Sets (or clears) what this thread runs while it waits for its reads through io_uring:
/// at each look while it polls, and once before it sleeps.
pub(crate) fn set_read_wait_hook(hook: Option<fn()>) {
    READ_WAIT_HOOK.set(hook);
}

fn read_wait() {
    if let Some(hook) = READ_WAIT_HOOK.get() {
        hook();
    }
}

/// Submission queue size of each ring; a larger batch is split into several submissions.
/// 256 is the largest reclaim batch the configuration allows.
const RING_ENTRIES: u32 = 256;

/// One page-sized transfer at a byte offset of the swap file.
#[derive(Clone, Copy, Debug)]
pub(crate) enum PageOp {
    Read { offset: u64, dst: *mut u8 },
    Write { offset: u64, src: *const u8 },
}

impl PageOp {
    fn is_read(&self) -> bool {
        matches!(self, PageOp::Read { .. })
    }
}

/// Tries of one page transfer (the first and the retries) before its error is returned.
pub(crate) const MAX_TRIES: u32 = 8;

/// Tries of a read that keeps failing with EIO: disks return transient read errors, but a
/// bad sector stays bad, so only a couple of retries.
pub(crate) const READ_EIO_TRIES: u32 = 3;

/// Wait before the next try after a transient error: 20 µs, doubling to at most 1.3 ms.
fn backoff(tries: u32) -> Duration {
    Duration::from_micros(10 << tries.min(7))
}

/// Issues [`PageOp`]s against a file, through io_uring or `pread`/`pwrite`, retrying
/// transient errors and short transfers.
pub(crate) struct IoEngine {
    requested: IoMode,
    /// Made by the first transfer that may allocate ([`IoEngine::rings`]).
    rings: OnceLock<Rings>,
    /// The fault injector; `None` unless the configuration asks for faults.
    faults: Option<Injector>,
    /// Offset alignment a resubmitted remainder must keep (`O_DIRECT`); a short transfer
    /// that ends off it redoes the whole page.
    align: usize,
    /// Tries repeated after a transient error or a short transfer.
    retries: AtomicU64,
    /// How long a batch of reads on a ring polls for its completions before it sleeps.
    read_poll: Duration,
}

/// An engine's rings and the buffers of its signal handler reads.
struct Rings {
    /// `None` in pread mode, requested or fallen back to.
    pool: Option<RingPool>,
    /// Buffers for the SIGBUS handler's batch reads, and rings for its reads unless in
    /// pread mode or without polling.
    signal_sets: SignalSets,
}

impl IoEngine {
    /// An engine for `requested` (resolved: not `Auto`); io_uring falls back to pread when
    /// it cannot be set up. `align` is the file's direct I/O offset alignment (1 for
    /// buffered I/O). Reads on a ring poll for `read_poll` before they sleep.
    pub(crate) fn new(
        requested: IoMode,
        faults: Option<FaultPlan>,
        align: usize,
        read_poll: Duration,
    ) -> IoEngine {
        IoEngine {
            requested,
            rings: OnceLock::new(),
            faults: faults.map(Injector::new),
            align: align.clamp(1, PAGE_SIZE),
            retries: AtomicU64::new(0),
            read_poll,
        }
    }

    /// The rings, made now if they were not: never from a signal handler (it allocates).
    fn rings(&self) -> &Rings {
        self.rings.get_or_init(|| {
            let pool = match self.requested {
                IoMode::Uring | IoMode::Auto => RingPool::probe(),
                IoMode::Pread => None,
            };
            let signal_sets = SignalSets::new(pool.is_some() && !self.read_poll.is_zero());
            Rings { pool, signal_sets }
        })
    }

    /// Makes the rings now, for an engine whose first transfer may be a signal handler's
    /// read (a fork child's, of pages its parent wrote).
    pub(crate) fn start(&self) {
        self.rings();
    }

    /// The statistics of the ring pool's lock (`io_rings`), when the engine has rings.
    pub(crate) fn lockstat(&self) -> Option<LockClass> {
        let pool = self.rings.get()?.pool.as_ref()?;
        Some(LockClass::sum("io_rings", [&pool.0]))
    }

    /// In a fork child, for an engine it abandons: closes the rings' descriptors, which
    /// are the parent's rings. A pool its parent was using at the fork is left alone.
    pub(crate) fn close_in_child(&self) {
        let Some(rings) = self.rings.get() else {
            return;
        };
        if let Some(pool) = &rings.pool {
            if let Some(rings) = pool.0.try_lock() {
                for ring in rings.iter() {
                    // SAFETY: the abandoned engine never uses its rings again.
                    unsafe { libc::close(ring.as_raw_fd()) };
                }
            }
        }
        rings.signal_sets.close_in_child();
    }

    /// The mode in effect after any fallback (the rings are made to find it out).
    pub(crate) fn mode(&self) -> IoMode {
        match self.rings().pool {
            Some(_) => IoMode::Uring,
            None => IoMode::Pread,
        }
    }

    /// Tries repeated so far after transient errors and short transfers.
    pub(crate) fn retries(&self) -> u64 {
        self.retries.load(Relaxed)
    }

    /// Faults injected so far (0 without a fault plan).
    pub(crate) fn injected(&self) -> u64 {
        self.faults.as_ref().map_or(0, |f| f.injected.load(Relaxed))
    }

    /// Runs every op and returns one result per op, in order. Transient errors (EAGAIN,
    /// EINTR, ENOMEM, EBUSY, and EIO on reads) and short transfers are retried, up to
    /// [`MAX_TRIES`] tries per op; what is left after that is returned.
    ///
    /// # Safety
    /// Each op's buffer must be valid for `PAGE_SIZE` bytes (writable for reads) until this
    /// returns, and aligned as the file's `O_DIRECT` mode requires.
    pub(crate) unsafe fn run(&self, file: &File, ops: &[PageOp]) -> Vec<io::Result<()>> {
        self.run_with(file, ops, false)
    }

    /// [`IoEngine::run`] for one read that the caller will verify and may read again:
    /// `reread_follows` lets the fault injector corrupt the data in transit.
    ///
    /// # Safety
    /// As [`IoEngine::run`].
    pub(crate) unsafe fn read(
        &self,
        file: &File,
        offset: u64,
        dst: *mut u8,
        reread_follows: bool,
    ) -> io::Result<()> {
        let op = PageOp::Read { offset, dst };
        let mut results = self.run_with(file, &[op], reread_follows);
        results.pop().expect("one result per op")
    }

    /// Reads a batch (one submission) that the caller verifies, reading again whatever
    /// fails verification: the fault injector may corrupt data in transit.
    ///
    /// # Safety
    /// As [`IoEngine::run`]; every op is a read.
    pub(crate) unsafe fn read_batch(&self, file: &File, ops: &[PageOp]) -> Vec<io::Result<()>> {
        debug_assert!(ops.iter().all(PageOp::is_read));
        self.run_with(file, ops, true)
    }

    /// One read, allocating and locking nothing: for the SIGBUS handler. On a free signal
    /// ring and polled when the engine polls its reads; otherwise, or when that read does
    /// not transfer the whole page, with `pread`, its transient errors retried. `None`
    /// under a fault plan (the injector may allocate): use [`IoEngine::read`].
    ///
    /// # Safety
    /// As [`IoEngine::run`].
    pub(crate) unsafe fn read_in_place(
        &self,
        file: &File,
        offset: u64,
        dst: *mut u8,
    ) -> Option<io::Result<()>> {
        if self.faults.is_some() {
            return None;
        }
        // Without rings yet (no transfer outside a handler so far), a plain read.
        let sets = self.rings.get().map(|r| &r.signal_sets);
        if sets.is_some_and(|sets| sets.read(file.as_raw_fd(), offset, dst, self.read_poll)) {
            return Some(Ok(()));
        }
        Some(self.read_sync_in_place(file.as_raw_fd(), offset, dst))
    }

    /// Reads the pages at `offsets` (at most [`SIGNAL_BATCH`]) in one submission, allocating
    /// and locking nothing, and lends them to `f`, for the SIGBUS handler's readahead: on a
    /// signal set's ring, polled, or with `pread`, transient errors retried. `None` under a
    /// fault plan, when no set is free or the engine has none yet: use
    /// [`IoEngine::read_batch`].
    ///
    /// # Safety
    /// As [`IoEngine::run`].
    pub(crate) unsafe fn read_batch_in_place<R>(
        &self,
        file: &File,
        offsets: &[Option<u64>],
        f: impl FnOnce(&mut SignalBatch<'_>) -> R,
    ) -> Option<R> {
        if self.faults.is_some() {
            return None;
        }
        let fd = file.as_raw_fd();
        let read_one = |offset, dst| self.read_sync_in_place(fd, offset, dst).is_ok();
        self.rings
            .get()?
            .signal_sets
            .read_batch(fd, offsets, self.read_poll, read_one, f)
    }

    /// One page read with `pread`, its transient errors retried; allocates nothing.
    ///
    /// # Safety
    /// As [`IoEngine::run`].
    unsafe fn read_sync_in_place(&self, fd: RawFd, offset: u64, dst: *mut u8) -> io::Result<()> {
        let ctx = Ctx {
            engine: self,
            may_flip: false,
        };
        run_sync(fd, &mut Transfer::new(PageOp::Read { offset, dst }), &ctx)
    }

    /// # Safety
    /// As [`IoEngine::run`].
    unsafe fn run_with(&self, file: &File, ops: &[PageOp], may_flip: bool) -> Vec<io::Result<()>> {
        let fd = file.as_raw_fd();
        let ctx = Ctx {
            engine: self,
            may_flip,
        };
        let mut transfers: Vec<Transfer> = ops.iter().map(|&op| Transfer::new(op)).collect();
        match &self.rings().pool {
            Some(pool) => pool.run(fd, &mut transfers, &ctx),
            None => transfers
                .iter_mut()
                .map(|t| run_sync(fd, t, &ctx))
                .collect(),
        }
    }
}

/// What a batch's transfers share: the engine and whether read data may be corrupted.
struct Ctx<'a> {
    engine: &'a IoEngine,
    may_flip: bool,
}

/// One page transfer in progress: how far it got and what it met.
struct Transfer {
    op: PageOp,
    /// Bytes transferred so far, from the start of the page.
    done: usize,
    /// Tries made so far, after the first.
    tries: u32,
    /// Reads that failed with EIO so far.
    eio: u32,
    /// Set when the wait before the next try is due.
    pause: Option<Duration>,
    /// Injected: every try fails with EIO.
    dead: bool,
    /// Injected: flip a bit of the page once it has been read.
    flip_read: Option<u64>,
    /// Injected: the page as it will land on the device, one bit flipped.
    corrupt: Option<PageBuf>,
    /// Injected short transfer in flight: the bytes to report, and for a write the page
    /// with garbage past them.
    short: Option<usize>,
    scratch: Option<PageBuf>,
}

/// What the next try of a transfer is.
enum Piece {
    /// Fails at once with this errno (injected).
    Fail(i32),
    /// Transfers `len` bytes between `buf` and `offset`.
    Go {
        offset: u64,
        buf: *mut u8,
        len: usize,
    },
}

impl Transfer {
    fn new(op: PageOp) -> Transfer {
        Transfer {
            op,
            done: 0,
            tries: 0,
            eio: 0,
            pause: None,
            dead: false,
            flip_read: None,
            corrupt: None,
            short: None,
            scratch: None,
        }
    }

    /// The next try: the remainder of the page, after any injected fault.
    ///
    /// # Safety
    /// The op's buffer must be valid for a page.
    unsafe fn next_piece(&mut self, ctx: &Ctx<'_>) -> Piece {
        let left = PAGE_SIZE - self.done;
        self.short = None;
        if self.dead {
            return Piece::Fail(libc::EIO);
        }
        let fault = match &ctx.engine.faults {
            Some(injector) => injector.decide(self, ctx.may_flip),
            None => None,
        };
        let (offset, mut buf) = match self.op {
            PageOp::Read { offset, dst } => (offset, dst),
            PageOp::Write { offset, src } => match &self.corrupt {
                Some(page) => (offset, page.as_ptr().cast_mut()),
                None => (offset, src.cast_mut()),
            },
        };
        match fault {
            None => {}
            Some((Fault::Errno(errno), _)) => return Piece::Fail(errno),
            Some((Fault::DeadSector, _)) => {
                self.dead = true;
                return Piece::Fail(libc::EIO);
            }
            Some((Fault::ReadFlip, r)) => self.flip_read = Some(r),
            Some((Fault::WriteFlip, r)) => {
                let mut page = PageBuf::new();
                page.as_mut_slice()
                    .copy_from_slice(std::slice::from_raw_parts(buf, PAGE_SIZE));
                let bit = self.done * 8 + (r % (left as u64 * 8)) as usize;
                page.as_mut_slice()[bit / 8] ^= 1 << (bit % 8);
                buf = page.as_ptr().cast_mut();
                self.corrupt = Some(page);
            }
            Some((Fault::Short, r)) => {
                // Whole sectors short of the remainder, so O_DIRECT can resubmit the rest.
                let sectors = (left / 512) as u64;
                let short = 512 * (1 + r % (sectors - 1)) as usize;
                self.short = Some(short);
                if !self.op.is_read() {
                    // The device gets the page with garbage past what is reported written.
                    let page = self.scratch.get_or_insert_with(PageBuf::new);
                    page.as_mut_slice()
                        .copy_from_slice(std::slice::from_raw_parts(buf, PAGE_SIZE));
                    page.as_mut_slice()[self.done + short..].fill(0xA5);
                    buf = page.as_ptr().cast_mut();
                }
            }
        }
        Piece::Go {
            offset: offset + self.done as u64,
            buf: buf.add(self.done),
            len: left,
        }
    }

    /// Takes the outcome of a try (bytes transferred, or a negated errno): `Some` when the
    /// transfer is finished, `None` when it needs another try (after `self.pause`).
    ///
    /// # Safety
    /// The op's buffer must be valid for a page.
    unsafe fn settle(&mut self, ret: i64, engine: &IoEngine) -> Option<io::Result<()>> {
        let left = PAGE_SIZE - self.done;
        let ret = match self.short.take() {
            Some(short) if ret == left as i64 => {
                if let PageOp::Read { dst, .. } = self.op {
                    // What a short read leaves past its end is not data.
                    std::ptr::write_bytes(dst.add(self.done + short), 0xA5, left - short);
                }
                short as i64
            }
            _ => ret,
        };
        let last_try = self.tries + 1 >= MAX_TRIES;
        if ret < 0 {
            let errno = (-ret) as i32;
            let transient = match errno {
                libc::EAGAIN | libc::EINTR | libc::ENOMEM | libc::EBUSY => true,
                libc::EIO if self.op.is_read() => {
                    self.eio += 1;
                    self.eio < READ_EIO_TRIES
                }
                _ => false,
            };
            if !transient || last_try {
                return Some(Err(io::Error::from_raw_os_error(errno)));
            }
            self.tries += 1;
            engine.retries.fetch_add(1, Relaxed);
            self.pause = (errno != libc::EINTR).then(|| backoff(self.tries));
            return None;
        }
        let moved = ret as usize;
        if moved >= left {
            if let (Some(r), PageOp::Read { dst, .. }) = (self.flip_read.take(), self.op) {
                let bit = (r % (PAGE_SIZE as u64 * 8)) as usize;
                *dst.add(bit / 8) ^= 1 << (bit % 8);
            }
            return Some(Ok(()));
        }
        if moved == 0 && self.op.is_read() {
            return Some(Err(io::Error::new(
                io::ErrorKind::UnexpectedEof,
                format!(
                    "short transfer: end of file after {} of {PAGE_SIZE} bytes",
                    self.done
                ),
            )));
        }
        if last_try {
            return Some(Err(io::Error::new(
                io::ErrorKind::UnexpectedEof,
                format!(
                    "short transfer: {} of {PAGE_SIZE} bytes after {MAX_TRIES} tries",
                    self.done + moved
                ),
            )));
        }
        self.done += moved;
        if !self.done.is_multiple_of(engine.align) {
            // The remainder cannot be resubmitted at this offset under O_DIRECT.
            self.done = 0;
        }
        self.tries += 1;
        engine.retries.fetch_add(1, Relaxed);
        None
    }
}

/// Runs one transfer to its end with `pread`/`pwrite`.
///
/// # Safety
/// As [`IoEngine::run`].
unsafe fn run_sync(fd: RawFd, t: &mut Transfer, ctx: &Ctx<'_>) -> io::Result<()> {
    loop {
        let ret = match t.next_piece(ctx) {
            Piece::Fail(errno) => -i64::from(errno),
            Piece::Go { offset, buf, len } => {
                let ret = match t.op {
                    PageOp::Read { .. } => libc::pread(fd, buf.cast(), len, offset as libc::off_t),
                    PageOp::Write { .. } => {
                        libc::pwrite(fd, buf.cast(), len, offset as libc::off_t)
                    }
                };
                if ret < 0 {
                    -i64::from(
                        io::Error::last_os_error()
                            .raw_os_error()
                            .unwrap_or(libc::EIO),
                    )
                } else {
                    ret as i64
                }
            }
        };
        if let Some(result) = t.settle(ret, ctx.engine) {
            return result;
        }
        if let Some(pause) = t.pause.take() {
            std::thread::sleep(pause);
        }
    }
}

/// Rings not in use right now. A thread takes one for a batch and gives it back after.
struct RingPool(StatMutex<Vec<IoUring>>);

impl RingPool {
    /// A pool holding one ring, or `None` when this kernel cannot do our reads and writes
    /// through io_uring.
    fn probe() -> Option<RingPool> {
        let ring = IoUring::new(RING_ENTRIES).ok()?;
        let mut probe = Probe::new();
        ring.submitter().register_probe(&mut probe).ok()?;
        let usable =
            probe.is_supported(opcode::Read::CODE) && probe.is_supported(opcode::Write::CODE);
        usable.then(|| RingPool(StatMutex::new(Rank::RingPool, vec![ring])))
    }

    /// A ring from the pool, or a new one; `None` if none can be made now (e.g. out of
    /// locked memory), in which case the caller does this batch with pread/pwrite.
    fn take(&self) -> Option<IoUring> {
        let pooled = self.0.lock().pop();
        pooled.or_else(|| IoUring::new(RING_ENTRIES).ok())
    }

    fn give_back(&self, ring: IoUring) {
        self.0.lock().push(ring);
    }

    /// # Safety
    /// As [`IoEngine::run`].
    unsafe fn run(
        &self,
        fd: RawFd,
        transfers: &mut [Transfer],
        ctx: &Ctx<'_>,
    ) -> Vec<io::Result<()>> {
        let Some(mut ring) = self.take() else {
            return transfers.iter_mut().map(|t| run_sync(fd, t, ctx)).collect();
        };
        let mut results = Vec::with_capacity(transfers.len());
        let mut healthy = true;
        for chunk in transfers.chunks_mut(RING_ENTRIES as usize) {
            let mut done: Vec<Option<io::Result<()>>> = (0..chunk.len()).map(|_| None).collect();
            if healthy {
                healthy = run_on_ring(&mut ring, fd, chunk, &mut done, ctx);
            }
            // What the ring could not finish (it failed) goes through pread/pwrite.
            for (t, result) in chunk.iter_mut().zip(done) {
                results.push(result.unwrap_or_else(|| run_sync(fd, t, ctx)));
            }
        }
        // A ring whose submission failed may hold stale entries: never use it again.
        if healthy {
            self.give_back(ring);
        }
        results
    }
}

/// Runs at most `RING_ENTRIES` transfers to their end, in rounds: each round submits the
/// next try of every unfinished transfer and waits for all of them. Returns whether the
/// ring is still fit for use; when it is not, the transfers without a result are left for
/// the caller.
///
/// # Safety
/// As [`IoEngine::run`].
unsafe fn run_on_ring(
    ring: &mut IoUring,
    fd: RawFd,
    transfers: &mut [Transfer],
    results: &mut [Option<io::Result<()>>],
    ctx: &Ctx<'_>,
) -> bool {
    loop {
        let mut pause = None;
        let mut queued = 0;
        {
            let mut sq = ring.submission();
            for (i, t) in transfers.iter_mut().enumerate() {
                if results[i].is_some() {
                    continue;
                }
                match t.next_piece(ctx) {
                    Piece::Fail(errno) => {
                        results[i] = t.settle(-i64::from(errno), ctx.engine);
                        pause = pause.max(t.pause.take());
                    }
                    Piece::Go { offset, buf, len } => {
                        let sqe = sqe_for(fd, &t.op, offset, buf, len).user_data(i as u64);
                        // Cannot fail: the queue was empty and there are at most
                        // RING_ENTRIES transfers.
                        sq.push(&sqe).expect("io_uring submission queue overflow");
                        queued += 1;
                    }
                }
            }
        }
        if queued == 0 && results.iter().all(Option::is_some) {
            return true;
        }
        let (mut submitted, mut done) = (0, 0);
        let reads_only = transfers.iter().all(|t| t.op.is_read());
        let mut reap = |ring: &mut IoUring, done: &mut usize, pause: &mut Option<Duration>| {
            for cqe in ring.completion() {
                let i = cqe.user_data() as usize;
                results[i] = transfers[i].settle(i64::from(cqe.result()), ctx.engine);
                *pause = (*pause).max(transfers[i].pause.take());
                *done += 1;
            }
        };
        if reads_only && !ctx.engine.read_poll.is_zero() {
            if let Ok(n) = ring.submit() {
                submitted += n;
                let start = Instant::now();
                let mut looks = crate::sync::Looks::new(start);
                loop {
                    let now = Instant::now();
                    looks.at(now);
                    if done >= submitted || now - start >= ctx.engine.read_poll {
                        break;
                    }
                    looks.look(|| signal_ring::enter_for_completions(ring));
                    reap(ring, &mut done, &mut pause);
                    if done < submitted {
                        read_wait();
                    }
                }
            }
        }
        if reads_only && done < queued {
            read_wait();
        }
        while done < queued {
            match ring.submit_and_wait(queued - done) {
                Ok(n) => submitted += n,
                Err(e) if is_transient(&e) => {}
                // Nothing is in flight, so no buffer is still in the kernel's hands.
                Err(_) if submitted == done => return false,
                Err(e) => panic!(
                    "io_uring_enter failed with {} requests in flight: {e}",
                    submitted - done
                ),
            }
            reap(ring, &mut done, &mut pause);
        }
        if let Some(pause) = pause {
            std::thread::sleep(pause);
        }
    }
}

fn sqe_for(
    fd: RawFd,
    op: &PageOp,
    offset: u64,
    buf: *mut u8,
    len: usize,
) -> io_uring::squeue::Entry {
    let len = len as u32;
    match op {
        PageOp::Read { .. } => opcode::Read::new(types::Fd(fd), buf, len)
            .offset(offset)
            .build(),
        PageOp::Write { .. } => opcode::Write::new(types::Fd(fd), buf, len)
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

/// A fault the injector chose for one try.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Fault {
    /// The try fails with this errno.
    Errno(i32),
    /// This and every later try of the read fail with EIO.
    DeadSector,
    /// The try transfers less than asked.
    Short,
    /// The data read has a bit flipped.
    ReadFlip,
    /// The data written has a bit flipped.
    WriteFlip,
}

/// Draws faults from a [`FaultPlan`] with a splitmix64 stream: one draw per try.
struct Injector {
    plan: FaultPlan,
    draws: AtomicU64,
    injected: AtomicU64,
}

impl Injector {
    fn new(plan: FaultPlan) -> Injector {
        Injector {
            plan,
            draws: AtomicU64::new(0),
            injected: AtomicU64::new(0),
        }
    }

    /// The fault for the next try of `t`, with a random number for its details. Transient
    /// faults never strike a try that has no retry left.
    fn decide(&self, t: &Transfer, may_flip: bool) -> Option<(Fault, u64)> {
        let n = self.draws.fetch_add(1, Relaxed);
        let r = splitmix64(self.plan.seed.wrapping_add(n.wrapping_mul(GOLDEN)));
        let detail = splitmix64(r);
        let u = (r >> 11) as f64 / (1u64 << 53) as f64;
        let p = &self.plan;
        let retry_left = t.tries + 1 < MAX_TRIES;
        let short_ok = retry_left && PAGE_SIZE - t.done >= 1024;
        let candidates = if t.op.is_read() {
            [
                (
                    Fault::DeadSector,
                    p.read_eio_persistent,
                    t.tries == 0 && t.done == 0,
                ),
                (
                    Fault::Errno(libc::EIO),
                    p.read_eio,
                    retry_left && t.eio + 1 < READ_EIO_TRIES,
                ),
                (Fault::Short, p.short_read, short_ok),
                (Fault::Errno(libc::EAGAIN), p.eagain, retry_left),
                (Fault::ReadFlip, p.read_flip, may_flip),
            ]
        } else {
            [
                (Fault::Errno(libc::EIO), p.write_eio, true),
                (Fault::Errno(libc::ENOSPC), p.write_enospc, true),
                (Fault::Short, p.short_write, short_ok),
                (Fault::Errno(libc::EAGAIN), p.eagain, retry_left),
                (Fault::WriteFlip, p.write_flip, t.corrupt.is_none()),
            ]
        };
        let mut below = 0.0;
        for (fault, rate, allowed) in candidates {
            below += rate;
            if u < below {
                if !allowed {
                    return None;
                }
                self.injected.fetch_add(1, Relaxed);
                return Some((fault, detail));
            }
        }
        None
    }
}

const GOLDEN: u64 = 0x9e37_79b9_7f4a_7c15;

fn splitmix64(x: u64) -> u64 {
    let mut z = x.wrapping_add(GOLDEN);
    z = (z ^ (z >> 30)).wrapping_mul(0xbf58_476d_1ce4_e5b9);
    z = (z ^ (z >> 27)).wrapping_mul(0x94d0_49bb_1331_11eb);
    z ^ (z >> 31)
}

#[cfg(all(test, not(loom)))]
pub(crate) mod tests {
    use super::*;
    use std::os::unix::fs::OpenOptionsExt;

    fn roundtrip(mode: IoMode) {
        let engine = IoEngine::new(mode, None, 1, Duration::ZERO);
        roundtrip_with(&engine, false);
        assert_eq!((engine.retries(), engine.injected()), (0, 0));
    }

    /// An empty file "io" in `dir`, opened with `O_DIRECT` when `direct`.
    fn io_file(dir: &tempfile::TempDir, direct: bool) -> File {
        File::options()
            .read(true)
            .write(true)
            .create(true)
            .truncate(true)
            .custom_flags(if direct { libc::O_DIRECT } else { 0 })
            .open(dir.path().join("io"))
            .unwrap()
    }

    /// Writes 300 distinct pages and reads them back through `engine` (every op must
    /// succeed and every byte match), in a file opened with `O_DIRECT` when `direct`.
    fn roundtrip_with(engine: &IoEngine, direct: bool) {
        let dir = tempfile::tempdir().unwrap();
        let file = io_file(&dir, direct);
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
        for (i, (a, b)) in pages.iter_mut().zip(&back).enumerate() {
            assert!(a.as_slice() == b.as_slice(), "page {i} read back wrong");
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
    fn rings_are_made_by_the_first_transfer_and_a_handler_read_before_it_reads_plainly() {
        let engine = IoEngine::new(IoMode::Uring, None, 1, Duration::from_micros(50));
        assert!(engine.rings.get().is_none(), "no rings at creation");
        let dir = tempfile::tempdir().unwrap();
        let file = io_file(&dir, false);
        let mut page = PageBuf::new();
        page.as_mut_slice().fill(0x5a);
        std::fs::write(dir.path().join("io"), page.as_slice()).unwrap();
        let mut back = PageBuf::new();
        // SAFETY: a page-sized buffer of this thread.
        let read = unsafe { engine.read_in_place(&file, 0, back.as_mut_ptr()) };
        assert!(matches!(read, Some(Ok(()))), "{read:?}");
        assert_eq!(back.as_slice(), page.as_slice());
        assert!(
            engine.rings.get().is_none(),
            "a handler's read makes no rings"
        );
        let none = unsafe { engine.read_batch_in_place(&file, &[Some(0)], |_| ()) };
        assert!(
            none.is_none(),
            "no signal sets yet: the caller's other path"
        );
        let op = PageOp::Write {
            offset: PAGE_SIZE as u64,
            src: page.as_ptr(),
        };
        // SAFETY: as above.
        let results = unsafe { engine.run(&file, &[op]) };
        assert!(results.iter().all(|r| r.is_ok()));
        assert!(engine.rings.get().is_some(), "the first transfer made them");
    }

    #[test]
    fn uring_engine_roundtrips_a_large_batch() {
        if uring_allowed() {
            assert_eq!(
                IoEngine::new(IoMode::Uring, None, 1, Duration::ZERO).mode(),
                IoMode::Uring
            );
        }
        roundtrip(IoMode::Uring);
    }

    #[test]
    fn uring_engine_polling_for_reads_roundtrips_a_large_batch() {
        // A budget long enough to reap most reads by polling, and one so short that the
        // batch is left to the sleeping wait part way.
        for poll_us in [1, 500] {
            for direct in [false, true] {
                let engine = IoEngine::new(IoMode::Uring, None, 1, Duration::from_micros(poll_us));
                roundtrip_with(&engine, direct);
                assert_eq!(engine.retries(), 0, "poll {poll_us} µs, direct {direct}");
            }
        }
    }

    #[test]
    fn pread_engine_roundtrips_a_large_batch() {
        assert_eq!(
            IoEngine::new(IoMode::Pread, None, 1, Duration::ZERO).mode(),
            IoMode::Pread
        );
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
            let results = unsafe { IoEngine::new(mode, None, 1, Duration::ZERO).run(&file, &[op]) };
            let err = results.into_iter().next().unwrap().unwrap_err();
            assert_eq!(err.kind(), io::ErrorKind::UnexpectedEof, "{mode:?}: {err}");
        }
    }

    fn plan(seed: u64) -> FaultPlan {
        FaultPlan {
            seed,
            ..FaultPlan::default()
        }
    }

    /// An engine of each mode for a plan, io_uring once sleeping on its reads and once
    /// polling for them.
    fn each_mode(faults: FaultPlan, check: impl Fn(&IoEngine, IoMode)) {
        for (mode, poll_us) in [(IoMode::Uring, 0), (IoMode::Uring, 200), (IoMode::Pread, 0)] {
            let engine = IoEngine::new(mode, Some(faults), 1, Duration::from_micros(poll_us));
            check(&engine, mode);
        }
    }

    #[test]
    fn eagain_is_retried_with_a_bounded_number_of_tries() {
        // Every try that may fail transiently does: each op takes all its tries, and the
        // last one, left alone, succeeds.
        let faults = FaultPlan {
            eagain: 1.0,
            ..plan(1)
        };
        each_mode(faults, |engine, mode| {
            roundtrip_with(engine, false);
            let expected = 600 * u64::from(MAX_TRIES - 1);
            assert_eq!(engine.retries(), expected, "{mode:?}");
            assert_eq!(engine.injected(), expected, "{mode:?}");
        });
    }

    #[test]
    fn short_transfers_resubmit_the_remainder() {
        // The bytes past an injected short transfer are garbage (on the device for a
        // write, in the buffer for a read): only a retry of the remainder gets them right.
        let faults = FaultPlan {
            short_read: 0.5,
            short_write: 0.5,
            ..plan(2)
        };
        each_mode(faults, |engine, mode| {
            roundtrip_with(engine, false);
            assert!(engine.injected() > 100, "{mode:?}: {}", engine.injected());
            assert!(engine.retries() >= engine.injected(), "{mode:?}");
        });
    }

    #[test]
    fn short_transfers_under_o_direct_keep_the_alignment() {
        let faults = FaultPlan {
            short_read: 0.5,
            short_write: 0.5,
            eagain: 0.1,
            ..plan(3)
        };
        for mode in [IoMode::Uring, IoMode::Pread] {
            // 512-byte remainders, and whole-page redos when the alignment is a page.
            for align in [512, PAGE_SIZE] {
                let engine = IoEngine::new(mode, Some(faults), align, Duration::ZERO);
                roundtrip_with(&engine, true);
                assert!(engine.retries() > 100, "{mode:?} {align}");
            }
        }
    }

    #[test]
    fn transient_read_eio_is_retried() {
        let faults = FaultPlan {
            read_eio: 0.6,
            ..plan(4)
        };
        each_mode(faults, |engine, mode| {
            roundtrip_with(engine, false);
            assert!(engine.retries() > 100, "{mode:?}");
        });
    }

    /// One file with one written page, for single-op checks.
    fn file_with_a_page() -> (tempfile::TempDir, File) {
        let dir = tempfile::tempdir().unwrap();
        let file = File::options()
            .read(true)
            .write(true)
            .create_new(true)
            .open(dir.path().join("f"))
            .unwrap();
        file.set_len(PAGE_SIZE as u64).unwrap();
        (dir, file)
    }

    #[test]
    fn a_persistent_read_eio_is_returned_after_a_few_tries() {
        let (_dir, file) = file_with_a_page();
        let faults = FaultPlan {
            read_eio_persistent: 1.0,
            ..plan(5)
        };
        each_mode(faults, |engine, mode| {
            let mut buf = PageBuf::new();
            let err = unsafe { engine.read(&file, 0, buf.as_mut_ptr(), true) }.unwrap_err();
            assert_eq!(err.raw_os_error(), Some(libc::EIO), "{mode:?}");
            assert_eq!(engine.retries(), u64::from(READ_EIO_TRIES - 1), "{mode:?}");
        });
    }

    #[test]
    fn write_errors_are_not_retried() {
        let (_dir, file) = file_with_a_page();
        for (faults, errno) in [
            (
                FaultPlan {
                    write_eio: 1.0,
                    ..plan(6)
                },
                libc::EIO,
            ),
            (
                FaultPlan {
                    write_enospc: 1.0,
                    ..plan(6)
                },
                libc::ENOSPC,
            ),
        ] {
            each_mode(faults, |engine, mode| {
                let page = PageBuf::new();
                let op = PageOp::Write {
                    offset: 0,
                    src: page.as_ptr(),
                };
                let err = unsafe { engine.run(&file, &[op]) }.remove(0).unwrap_err();
                assert_eq!(err.raw_os_error(), Some(errno), "{mode:?}");
                assert_eq!((engine.retries(), engine.injected()), (0, 1), "{mode:?}");
            });
        }
    }

    #[test]
    fn read_flips_corrupt_only_reads_that_will_be_verified_and_retried() {
        let (_dir, file) = file_with_a_page();
        let faults = FaultPlan {
            read_flip: 1.0,
            ..plan(7)
        };
        each_mode(faults, |engine, mode| {
            let mut buf = PageBuf::new();
            unsafe { engine.read(&file, 0, buf.as_mut_ptr(), false) }.unwrap();
            assert!(buf.as_slice().iter().all(|&b| b == 0), "{mode:?}");
            unsafe { engine.read(&file, 0, buf.as_mut_ptr(), true) }.unwrap();
            let ones: u32 = buf.as_slice().iter().map(|b| b.count_ones()).sum();
            assert_eq!(ones, 1, "{mode:?}: one bit flipped");
        });
    }

    #[test]
    fn write_flips_land_on_the_device() {
        let (_dir, file) = file_with_a_page();
        let faults = FaultPlan {
            write_flip: 1.0,
            ..plan(8)
        };
        each_mode(faults, |engine, mode| {
            let page = PageBuf::new();
            let op = PageOp::Write {
                offset: 0,
                src: page.as_ptr(),
            };
            unsafe { engine.run(&file, &[op]) }.remove(0).unwrap();
            assert!(page.as_slice().iter().all(|&b| b == 0), "source untouched");
            let clean = IoEngine::new(IoMode::Pread, None, 1, Duration::ZERO);
            let mut back = PageBuf::new();
            unsafe { clean.read(&file, 0, back.as_mut_ptr(), false) }.unwrap();
            let ones: u32 = back.as_slice().iter().map(|b| b.count_ones()).sum();
            assert_eq!(ones, 1, "{mode:?}: one bit flipped on the device");
        });
    }

    #[test]
    fn the_same_seed_injects_the_same_faults() {
        let run = |seed| {
            let engine = IoEngine::new(
                IoMode::Pread,
                Some(FaultPlan::transient(seed, 0.1)),
                1,
                Duration::ZERO,
            );
            roundtrip_with(&engine, false);
            (engine.injected(), engine.retries())
        };
        assert_eq!(run(11), run(11));
        assert_ne!(run(11), run(12));
    }
}
