//! Thread mode: handler threads read messages from the region's userfaultfd and act on
//! them: faults go to the fault path, vma events (mremap, madvise, munmap) to `vma.rs`.
//! Kernel accesses (a `read()` into a swapped-out page) are served like user accesses.
//! A fault source: built on the fault path.

use crate::error::{Error, Result};
use crate::fault::{FaultPath, Outcome};
use crate::lockdep::Rank;
use crate::lockstat::{LockClass, StatMutex};
use crate::mmap_changing::Raised;
use crate::stats::VmEvent;
use crate::swapfile::swap_io::set_read_wait_hook;
use crate::sync::Condvar;
use crate::uffd::{Event, Msg};
use std::cell::{Cell, RefCell};
use std::os::fd::{AsRawFd, FromRawFd, OwnedFd};
use std::panic::{catch_unwind, AssertUnwindSafe};
use std::sync::atomic::{
    AtomicUsize,
    Ordering::{Acquire, Relaxed, Release},
};
use std::sync::Arc;
use std::thread::JoinHandle;
use std::time::{Duration, Instant};

pub(crate) struct Handlers {
    stop: OwnedFd,
    threads: Vec<JoinHandle<()>>,
    shared: Arc<Shared>,
}

/// Settings of the handler threads.
pub(crate) struct HandlerConfig {
    pub threads: usize,
    pub spin_us: u64,
}

impl Handlers {
    pub fn start(fault: &Arc<FaultPath>, cfg: HandlerConfig) -> Result<Handlers> {
        // SAFETY: plain system call; we own the new descriptor.
        let fd = unsafe { libc::eventfd(0, libc::EFD_CLOEXEC) };
        if fd < 0 {
            return Err(Error::os("eventfd"));
        }
        let shared = Arc::new(Shared {
            // With several handlers each read takes one message, so a fault that arrives
            // during another's swap-in read goes to the next handler and their reads
            // overlap; alone, a handler takes a batch.
            batch: if cfg.threads > 1 { 1 } else { MAX_BATCH },
            leader: Leadership::default(),
            busy: AtomicUsize::new(0),
            spin: Duration::from_micros(cfg.spin_us),
            retry: StatMutex::new(Rank::RetryList, Vec::new()),
        });
        let mut handlers = Handlers {
            // SAFETY: the descriptor is new and ours.
            stop: unsafe { OwnedFd::from_raw_fd(fd) },
            threads: Vec::new(),
            shared: shared.clone(),
        };
        for i in 0..cfg.threads {
            let (fault, shared) = (fault.clone(), shared.clone());
            let t = crate::signals::spawn_quiet(&format!("uswap-fault-{i}"), move || {
                HANDLER.set(Some(Handler {
                    shared: shared.clone(),
                    uffd: fault.mm().uffd().raw(),
                }));
                set_read_wait_hook(Some(lend_leadership));
                serve(&fault, fd, &shared);
                set_read_wait_hook(None);
                HANDLER.take();
            })
            .map_err(|source| Error::Os {
                op: "spawn fault handler",
                source,
            })?;
            handlers.threads.push(t);
        }
        Ok(handlers)
    }

    /// The statistics of the handlers' locks: leadership (`handler_leader`) and the
    /// list of faults to retry (`handler_retry`).
    pub fn lockstat(&self) -> [LockClass; 2] {
        [
            LockClass::sum("handler_leader", [&self.shared.leader.taken]),
            LockClass::sum("handler_retry", [&self.shared.retry]),
        ]
    }

    /// Stops and joins the handler threads.
    pub fn stop(mut self) {
        let one: u64 = 1;
        // SAFETY: writing 8 bytes to our eventfd; every poller sees it readable.
        unsafe { libc::write(self.stop.as_raw_fd(), (&one as *const u64).cast(), 8) };
        for t in self.threads.drain(..) {
            let _ = t.join();
        }
    }
}

/// Most messages one read takes.
const MAX_BATCH: usize = 16;

/// How long a thread whose fault backed out waits for the event that held it up.
const RETRY_PARK: Duration = Duration::from_millis(1);

/// What the handler threads of one region share.
struct Shared {
    /// Messages one read takes.
    batch: usize,
    /// Held by the one thread that reads messages.
    leader: Leadership,
    /// Handlers resolving faults right now.
    busy: AtomicUsize,
    /// How long a waiting leader polls before it sleeps.
    spin: Duration,
    /// Pages whose fault backed out (`Outcome::Retry`), with when, their threads not woken
    /// yet. A fill backs out when a vma event is pending, and the kernel hands out pending
    /// faults before events: a thread woken while the event waits raises its fault again
    /// ahead of it, and with other threads faulting too (a runtime's GC threads while
    /// another thread discards memory), the event can wait behind them for seconds. They
    /// are woken after a read that returns an event or nothing, or once they have waited
    /// [`RETRY_PARK`].
    retry: StatMutex<Vec<(usize, Instant)>>,
}

/// Leader/follower: one handler at a time waits for messages (spinning briefly, then in
/// poll) and resolves the faults it read. It keeps leadership while it does, unless
/// another message arrives while its swap-in read is in flight: then it hands leadership
/// on (`lend_leadership`), so a second faulting thread's read overlaps the first's. One
/// faulting thread thus never wakes a second handler, and a fault that follows soon after
/// the last one finds a handler already running instead of waking a sleeping CPU. A batch
/// with a vma event keeps leadership and the fence (`mmap_changing.rs`) until its events
/// are handled, so every message read after an event sees its effect; the batch's faults,
/// raised before the event, are served after it, seeing the pages as the event left them.
fn serve(fault: &FaultPath, stop: i32, shared: &Arc<Shared>) {
    let mut msgs = [Msg::default(); MAX_BATCH];
    let msgs = &mut msgs[..shared.batch];
    let mut leading = false;
    loop {
        if !leading {
            shared.leader.take(shared.spin);
        }
        let retrying = std::mem::take(&mut *shared.retry.lock());
        let Some((n, fence)) = next_messages(fault, stop, msgs, shared, !retrying.is_empty())
        else {
            // The others see the stop (or the failure) once they lead.
            shared.leader.release();
            return;
        };
        // Busy before leadership passes on: the next leader must see this handler busy, or
        // it could sleep without a timeout while this one backs a fault out.
        let _busy = Busy::enter(&shared.busy);
        let event_read = fence.is_some();
        let keep = event_read || fault.vma().has_pending();
        LENDABLE.set(!keep);
        let is_fault = |e: &Event| matches!(e, Event::Fault { .. });
        for event in msgs[..n].iter().map(Msg::decode).filter(|e| !is_fault(e)) {
            handle_message(fault, event);
        }
        drop(fence);
        for event in msgs[..n].iter().map(Msg::decode).filter(is_fault) {
            if let Some(page) = handle_message(fault, event) {
                shared.retry.lock().push((page, Instant::now()));
            }
        }
        if fault.vma().has_pending() {
            fault.vma().place_pending();
        }
        let now = Instant::now();
        for (page, since) in retrying {
            if event_read || n == 0 || now.duration_since(since) >= RETRY_PARK {
                fault.mm().wake(page);
            } else {
                shared.retry.lock().push((page, since));
            }
        }
        // Still leading unless the batch lent leadership out while it waited for a read.
        leading = keep || LENDABLE.replace(false);
    }
}

/// Leadership of the handlers: taken by the thread that reads messages, waited for by the
/// others.
struct Leadership {
    taken: StatMutex<bool>,
    free: Condvar,
}

impl Default for Leadership {
    fn default() -> Leadership {
        Leadership {
            taken: StatMutex::new(Rank::Leadership, false),
            free: Condvar::new(),
        }
    }
}

impl Leadership {
    /// Takes leadership, polling for it for `spin` (yielding the CPU at each look) before
    /// sleeping until it is free.
    fn take(&self, spin: Duration) {
        let spin_until = Instant::now() + spin;
        while Instant::now() < spin_until {
            if let Some(mut taken) = self.taken.try_lock() {
                if !*taken {
                    *taken = true;
                    return;
                }
            }
            // SAFETY: no arguments.
            unsafe { libc::sched_yield() };
        }
        let mut taken = self.taken.lock();
        while *taken {
            taken = taken.wait_with(|g| self.free.wait(g).unwrap_or_else(|e| e.into_inner()));
        }
        *taken = true;
    }

    fn release(&self) {
        *self.taken.lock() = false;
        self.free.notify_one();
    }
}

/// What `lend_leadership` needs of the handler running on this thread.
struct Handler {
    shared: Arc<Shared>,
    uffd: i32,
}

thread_local! {
    static HANDLER: RefCell<Option<Handler>> = const { RefCell::new(None) };
    /// Set while this handler leads and resolves faults it may hand leadership on from.
    static LENDABLE: Cell<bool> = const { Cell::new(false) };
}

/// A handler's read-wait hook: while its swap-in read is in flight, it hands leadership on
/// when another message is waiting, so another handler reads that fault meanwhile. With
/// one handler nobody takes it and the leader takes it back after its batch.
fn lend_leadership() {
    if !LENDABLE.get() {
        return;
    }
    HANDLER.with_borrow(|handler| {
        let Some(h) = handler else { return };
        if wait_readable(h.uffd, -1, 0) == Readiness::Readable {
            LENDABLE.set(false);
            h.shared.leader.release();
        }
    });
}

/// Handles one message; the page whose fault backed out and whose thread is to be woken
/// later, if any.
fn handle_message(fault: &FaultPath, event: Event) -> Option<usize> {
    let Event::Fault {
        address,
        write_protect,
        write,
        tid,
    } = event
    else {
        if catch_unwind(AssertUnwindSafe(|| fault.vma().handle_event(event))).is_err() {
            fault.mm().count(VmEvent::handler_panics, 1);
            eprintln!("uswap: handling {event:?} panicked; the region may be inconsistent");
        }
        return None;
    };
    let Some(page) = fault.mm().page_of(address) else {
        fault.vma().foreign_fault(address);
        return None;
    };
    let outcome = catch_unwind(AssertUnwindSafe(|| {
        fault.handle_fault(page, Some(write_protect), write)
    }));
    match outcome {
        Ok(Outcome::Resolved) => None,
        Ok(Outcome::Retry) => Some(page),
        Ok(Outcome::Fatal) => {
            kill_faulting_thread(tid);
            // A kernel access (GUP: mlock, read(2) into the page) may wait uninterruptibly:
            // woken, it sees the fatal signal and gives up instead of waiting forever.
            fault.mm().wake(page);
            None
        }
        Err(_) => {
            // The page lock was released as the panic unwound; the fault it held fails
            // loudly instead of hanging, and the handler goes on serving.
            fault.mm().count(VmEvent::handler_panics, 1);
            eprintln!(
                "uswap: a fault handler panicked on the access to {address:#x}; that access \
                 fails with SIGBUS"
            );
            kill_faulting_thread(tid);
            fault.mm().wake(page);
            None
        }
    }
}

/// Counts a handler as busy while alive.
struct Busy<'a>(&'a AtomicUsize);

impl<'a> Busy<'a> {
    fn enter(count: &'a AtomicUsize) -> Self {
        count.fetch_add(1, Relaxed);
        Busy(count)
    }
}

impl Drop for Busy<'_> {
    fn drop(&mut self) {
        // Release: the retries this handler queued are visible to a leader that sees it
        // leave.
        self.0.fetch_sub(1, Release);
    }
}

/// Waits for messages and reads them: how many, and the fence when they hold a vma event;
/// `None` when the region is shutting down or the descriptor failed. It looks with `poll`
/// and reads only what is there: every read raises the fence against fills.
/// Spins first only while no other handler is busy: a busy handler means a faulting thread
/// is blocked, and a spinning CPU would take time from that fault's I/O and from kswapd.
/// With `retrying` (threads wait to be woken), it gives up after a millisecond with none.
fn next_messages<'a>(
    fault: &'a FaultPath,
    stop: i32,
    msgs: &mut [Msg],
    shared: &Shared,
    retrying: bool,
) -> Option<(usize, Option<Raised<'a>>)> {
    let mm = fault.mm();
    let spin = if shared.busy.load(Relaxed) == 0 {
        shared.spin
    } else {
        Duration::ZERO
    };
    let spin_until = Instant::now() + spin;
    loop {
        let timeout = if Instant::now() < spin_until {
            0
        } else if fault.vma().has_pending()
            || retrying
            || !shared.retry.lock().is_empty()
            || shared.busy.load(Acquire) > 0
        {
            // A busy handler may back a fault out (the fence) and queue its thread to be
            // woken after the next read: look at that queue every millisecond.
            // While pages moved out of the region wait to be put in place, look again soon:
            // the kernel refuses the fills until it has counted the last event as read.
            1
        } else {
            -1
        };
        match wait_readable(mm.uffd().raw(), stop, timeout) {
            Readiness::Stop => return None,
            Readiness::Readable => match mm.uffd().read_messages(msgs) {
                Ok((0, _)) => {}
                Ok(read) => return Some(read),
                Err(e) if crate::uffd::transient(&e) => {}
                Err(e) => crate::uffd::unreadable(mm.start(), &e),
            },
            Readiness::TimedOut if timeout > 0 && (retrying || !shared.retry.lock().is_empty()) => {
                return Some((0, None))
            }
            Readiness::TimedOut => std::hint::spin_loop(),
        }
        if mm.shutting_down() {
            return None;
        }
        if timeout > 0 && fault.vma().has_pending() {
            fault.vma().place_pending();
        }
    }
}

#[derive(PartialEq, Eq)]
enum Readiness {
    Readable,
    TimedOut,
    Stop,
}

/// Sleeps until `fd` is readable, `stop` is readable, or `timeout_ms` passed.
fn wait_readable(fd: i32, stop: i32, timeout_ms: i32) -> Readiness {
    let mut fds = [
        libc::pollfd {
            fd,
            events: libc::POLLIN,
            revents: 0,
        },
        libc::pollfd {
            fd: stop,
            events: libc::POLLIN,
            revents: 0,
        },
    ];
    // SAFETY: valid pollfd array.
    let ready = unsafe { libc::poll(fds.as_mut_ptr(), 2, timeout_ms) };
    if ready < 0 && std::io::Error::last_os_error().kind() != std::io::ErrorKind::Interrupted {
        return Readiness::Stop;
    }
    if fds[1].revents != 0 {
        Readiness::Stop
    } else if fds[0].revents != 0 {
        Readiness::Readable
    } else {
        Readiness::TimedOut
    }
}

/// Delivers SIGBUS to the thread whose fault could not be served. Without its thread id
/// (no UFFD_FEATURE_THREAD_ID) the whole process is aborted: never leave it hanging.
fn kill_faulting_thread(tid: u32) {
    if tid == 0 {
        std::process::abort();
    }
    // SAFETY: plain system calls; a stale tid at worst fails with ESRCH.
    unsafe {
        libc::syscall(
            libc::SYS_tgkill,
            libc::getpid(),
            tid as libc::pid_t,
            libc::SIGBUS,
        );
    }
}

#[cfg(all(test, not(loom)))]
mod tests {
    use super::*;
    use std::sync::atomic::AtomicBool;

    /// Handlers taking and releasing leadership, some polling for it and some sleeping at
    /// once: never two leaders, and no handler left waiting on a free leadership (the run
    /// finishes).
    #[test]
    fn leadership_has_one_holder_and_loses_no_wakeup() {
        let leadership = Arc::new(Leadership::default());
        let inside = Arc::new(AtomicBool::new(false));
        let taken = Arc::new(AtomicUsize::new(0));
        let (done_tx, done_rx) = std::sync::mpsc::channel();
        let threads: Vec<_> = (0..4u64)
            .map(|i| {
                let (leadership, inside, taken) =
                    (leadership.clone(), inside.clone(), taken.clone());
                let done_tx = done_tx.clone();
                std::thread::spawn(move || {
                    let mut exclusive = true;
                    for round in 0..20_000u64 {
                        leadership.take(Duration::from_micros((i % 2) * 20));
                        exclusive &= !inside.swap(true, Acquire);
                        taken.fetch_add(1, Relaxed);
                        if round % 7 == i {
                            std::thread::yield_now();
                        }
                        inside.store(false, Release);
                        leadership.release();
                    }
                    done_tx.send(exclusive).unwrap();
                })
            })
            .collect();
        for _ in 0..threads.len() {
            let exclusive = done_rx
                .recv_timeout(Duration::from_secs(60))
                .expect("a handler waits for leadership that nobody holds");
            assert!(exclusive, "two leaders at once");
        }
        for t in threads {
            t.join().unwrap();
        }
        assert_eq!(taken.load(Relaxed), 80_000);
    }
}
