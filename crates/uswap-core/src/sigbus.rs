//! SIGBUS mode: the kernel sends the faulting thread SIGBUS instead of queueing a fault
//! message, and the thread resolves its own fault in the signal handler. No context
//! switch, but a kernel access to a missing page fails with EFAULT instead of being served.
//! A fault source: built on the fault path.
//!
//! The handler is async-signal-safe: it allocates nothing and takes no lock a program
//! thread could hold (uswap's public calls run with asynchronous signals blocked, so no
//! program signal handler interrupts a thread inside one). It runs with every asynchronous
//! signal blocked, on the thread's alternate stack when it has one, and keeps `errno`. What
//! it cannot do that way (swap I/O, direct reclaim, reporting a failure) it hands to the
//! region's service thread through a preallocated request and waits on a futex. The service
//! thread also reads the region's vma events, and watches for threads that block SIGBUS and
//! for another handler replacing uswap's, saying so on stderr before it costs a process.

use crate::error::{Error, Result};
use crate::fault::{FaultPath, Outcome};
use crate::gup::Pin;
use crate::page::Kind;
use crate::stats::VmEvent;
use crate::sud::{self, raw_syscall, KernelSigaction, SA_RESTORER};
use crate::uffd::Msg;
use std::os::fd::{AsRawFd, FromRawFd, OwnedFd};
use std::panic::{catch_unwind, AssertUnwindSafe};
use std::sync::atomic::{
    AtomicPtr, AtomicU32, AtomicUsize,
    Ordering::{AcqRel, Acquire, Relaxed, Release, SeqCst},
};
use std::sync::{Arc, Once};
use std::thread::JoinHandle;
use std::time::{Duration, Instant};

const MAX_REGIONS: usize = 64;

/// Regions in SIGBUS mode, looked up by the signal handler without locks or allocation.
static REGIONS: [AtomicPtr<Served>; MAX_REGIONS] =
    [const { AtomicPtr::new(std::ptr::null_mut()) }; MAX_REGIONS];
/// Signal handlers inside each entry of `REGIONS`; unregistering waits for zero.
static IN_FLIGHT: [AtomicU32; MAX_REGIONS] = [const { AtomicU32::new(0) }; MAX_REGIONS];
/// The address range of each entry, readable without touching the entry: the handler
/// announces itself in `IN_FLIGHT` only for the entry whose range holds the address.
static RANGES: [(AtomicUsize, AtomicUsize); MAX_REGIONS] =
    [const { (AtomicUsize::new(0), AtomicUsize::new(0)) }; MAX_REGIONS];
/// One past the highest entry ever registered: lookups stop there (a process usually has
/// one region, and a direct system call looks up each of its buffers).
static ENTRIES_USED: AtomicUsize = AtomicUsize::new(0);

/// The entries that may be registered.
fn entries() -> std::ops::Range<usize> {
    0..ENTRIES_USED.load(Acquire)
}

/// The SIGBUS action found before ours, for signals that are not about a region. Leaked
/// on purpose: the handler may read it at any time.
static PREVIOUS: AtomicPtr<libc::sigaction> = AtomicPtr::new(std::ptr::null_mut());
static INSTALL: Once = Once::new();

/// Faults handed from signal handlers to the service thread at once, per region.
const REQUESTS: usize = 32;

const FREE: u32 = 0;
const CLAIMED: u32 = 1;
const PENDING: u32 = 2;
const DONE_RESOLVED: u32 = 3;
const DONE_FATAL: u32 = 4;

struct Request {
    /// FREE -> CLAIMED (handler) -> PENDING (handler) -> DONE_* (service) -> FREE (handler).
    /// The futex word the handler waits on.
    state: AtomicU32,
    page: AtomicUsize,
}

/// One region as the signal handler and its service thread see it.
struct Served {
    fault: Arc<FaultPath>,
    requests: [Request; REQUESTS],
    /// Rung by a handler that queued a request.
    doorbell: OwnedFd,
    stop: OwnedFd,
}

/// A region registered for SIGBUS mode, with its service thread.
pub(crate) struct Service {
    index: usize,
    served: Arc<Served>,
    thread: Option<JoinHandle<()>>,
}

fn eventfd() -> Result<OwnedFd> {
    // SAFETY: plain system call; we own the new descriptor.
    let fd = unsafe { libc::eventfd(0, libc::EFD_CLOEXEC | libc::EFD_NONBLOCK) };
    if fd < 0 {
        return Err(Error::os("eventfd"));
    }
    // SAFETY: the descriptor is new and ours.
    Ok(unsafe { OwnedFd::from_raw_fd(fd) })
}

pub(crate) fn register(fault: &Arc<FaultPath>) -> Result<Service> {
    if crate::signals::is_blocked(libc::SIGBUS) {
        return Err(Error::invalid(
            "fault mode",
            "SIGBUS is blocked in this thread, so SIGBUS mode would kill the process on the \
             first swapped-out page: unblock SIGBUS or use thread mode",
        ));
    }
    install_handler()?;
    let served = Arc::new(Served {
        fault: fault.clone(),
        requests: std::array::from_fn(|_| Request {
            state: AtomicU32::new(FREE),
            page: AtomicUsize::new(0),
        }),
        doorbell: eventfd()?,
        stop: eventfd()?,
    });
    let ptr = Arc::as_ptr(&served) as *mut Served;
    let index = (0..MAX_REGIONS)
        .find(|&i| {
            REGIONS[i]
                .compare_exchange(std::ptr::null_mut(), ptr, AcqRel, Acquire)
                .is_ok()
        })
        .ok_or_else(|| {
            Error::invalid(
                "fault mode",
                format!(
                    "at most {MAX_REGIONS} regions can use SIGBUS mode at once; use thread mode"
                ),
            )
        })?;
    let mm = fault.mm();
    ENTRIES_USED.fetch_max(index + 1, SeqCst);
    RANGES[index].0.store(mm.start(), SeqCst);
    RANGES[index].1.store(mm.start() + mm.len(), SeqCst);
    let mut service = Service {
        index,
        served: served.clone(),
        thread: None,
    };
    let supervised = move || {
        let panicked = || {
            served.fault.mm().count(VmEvent::handler_panics, 1);
        };
        crate::signals::supervise("SIGBUS service", || serve(&served), panicked);
    };
    match crate::signals::spawn_quiet("uswap-sigbus", supervised) {
        Ok(thread) => {
            service.thread = Some(thread);
            Ok(service)
        }
        Err(source) => {
            // Unregister before the region goes: no handler may find it after this.
            service.stop();
            Err(Error::Os {
                op: "spawn SIGBUS service",
                source,
            })
        }
    }
}

impl Service {
    /// Unregisters the region, waits for signal handlers still inside it, and stops the
    /// service thread.
    pub fn stop(mut self) {
        RANGES[self.index].1.store(0, SeqCst);
        REGIONS[self.index].store(std::ptr::null_mut(), SeqCst);
        while IN_FLIGHT[self.index].load(SeqCst) != 0 {
            std::thread::yield_now();
        }
        ring(self.served.stop.as_raw_fd());
        if let Some(t) = self.thread.take() {
            let _ = t.join();
        }
    }
}

impl Service {
    /// In a fork child: the parent's registration goes, without waiting for handlers (the
    /// threads inside them are not in the child), so that the child's own region, built
    /// at the same address, is the one its faults find.
    pub fn forget_in_child(&self) {
        RANGES[self.index].1.store(0, SeqCst);
        REGIONS[self.index].store(std::ptr::null_mut(), SeqCst);
        IN_FLIGHT[self.index].store(0, SeqCst);
    }
}

fn ring(fd: i32) {
    let one: u64 = 1;
    // SAFETY: writing 8 bytes to an eventfd; async-signal-safe.
    unsafe { libc::write(fd, (&one as *const u64).cast(), 8) };
}

/// How often the service thread checks that uswap's SIGBUS handler is still installed and
/// that no thread blocks SIGBUS.
const WATCH_PERIOD: Duration = Duration::from_secs(1);

/// The service thread: vma events, faults handed over by signal handlers, and the watch
/// on signal dispositions.
fn serve(s: &Served) {
    let mm = s.fault.mm();
    let mut msgs = [Msg::default(); 16];
    // The first look waits a period too: a short-lived process (a shell's command) never
    // pays for reading every thread's status.
    let mut next_watch = Instant::now() + WATCH_PERIOD;
    let mut watch = Watch::default();
    loop {
        if Instant::now() >= next_watch {
            watch.look();
            next_watch = Instant::now() + WATCH_PERIOD;
        }
        let mut fds =
            [mm.uffd().raw(), s.doorbell.as_raw_fd(), s.stop.as_raw_fd()].map(|fd| libc::pollfd {
                fd,
                events: libc::POLLIN,
                revents: 0,
            });
        let timeout = if s.fault.vma().has_pending() { 1 } else { 1000 };
        // SAFETY: valid pollfd array.
        unsafe { libc::poll(fds.as_mut_ptr(), 3, timeout) };
        if fds[2].revents != 0 {
            return;
        }
        if fds[0].revents != 0 {
            // The fence stays up while the events are handled: once an event is read, the
            // program's syscall goes on and its page states are about to change.
            match mm.uffd().read_messages(&mut msgs) {
                Ok((n, _fence)) => {
                    for m in &msgs[..n] {
                        let event = m.decode();
                        if catch_unwind(AssertUnwindSafe(|| s.fault.vma().handle_event(event)))
                            .is_err()
                        {
                            mm.count(VmEvent::handler_panics, 1);
                            eprintln!("uswap: handling {event:?} panicked");
                        }
                    }
                }
                Err(e) if crate::uffd::transient(&e) => {}
                Err(e) => crate::uffd::unreadable(mm.start(), &e),
            }
        }
        if s.fault.vma().has_pending() {
            s.fault.vma().place_pending();
        }
        if fds[1].revents != 0 {
            let mut count = 0u64;
            // SAFETY: reading our eventfd's counter.
            unsafe { libc::read(s.doorbell.as_raw_fd(), (&mut count as *mut u64).cast(), 8) };
            serve_requests(s);
        }
    }
}

fn serve_requests(s: &Served) {
    for r in &s.requests {
        if r.state.load(Acquire) != PENDING {
            continue;
        }
        let page = r.page.load(Relaxed);
        let outcome = catch_unwind(AssertUnwindSafe(|| s.fault.handle_fault(page, None, false)))
            .unwrap_or_else(|_| {
                s.fault.mm().count(VmEvent::handler_panics, 1);
                eprintln!("uswap: the SIGBUS service panicked on page {page}; that access fails");
                Outcome::Fatal
            });
        let done = match outcome {
            Outcome::Fatal => DONE_FATAL,
            _ => DONE_RESOLVED,
        };
        r.state.store(done, Release);
        futex_wake(&r.state);
    }
}

/// What the service thread has already seen and said about signal dispositions.
#[derive(Default)]
struct Watch {
    /// Threads seen blocking SIGBUS at the last look: a thread being created has every
    /// signal blocked for a moment, so only one seen twice in a row is reported.
    suspects: Vec<i32>,
    reported: Vec<i32>,
}

impl Watch {
    fn look(&mut self) {
        if !handler_is_ours() {
            eprintln!(
                "uswap: another SIGBUS handler replaced uswap's; SIGBUS-mode regions would \
                 kill the process on their next fault, so uswap installs its handler again \
                 and passes other SIGBUS signals on to that one"
            );
            reinstall();
        }
        let blocking = threads_blocking_sigbus();
        let suspects = std::mem::replace(&mut self.suspects, blocking.clone());
        for tid in blocking.into_iter().filter(|t| suspects.contains(t)) {
            if !self.reported.contains(&tid) {
                self.reported.push(tid);
                eprintln!(
                    "uswap: thread {tid} blocks SIGBUS; in SIGBUS mode its first access to a \
                     page that is not resident kills the process. Unblock SIGBUS there or use \
                     thread mode"
                );
            }
        }
    }
}

/// Threads of this process whose signal mask blocks SIGBUS (uswap's own block only
/// asynchronous signals). io_uring's worker threads (`iou-wrk-*`, `iou-sqp-*`) block every
/// signal but never run program code, so they are left out.
fn threads_blocking_sigbus() -> Vec<i32> {
    let Ok(dir) = std::fs::read_dir("/proc/self/task") else {
        return Vec::new();
    };
    let bit = 1u64 << (libc::SIGBUS - 1);
    dir.filter_map(|e| {
        let e = e.ok()?;
        let tid: i32 = e.file_name().to_str()?.parse().ok()?;
        let status = std::fs::read_to_string(e.path().join("status")).ok()?;
        let name = status.lines().find_map(|l| l.strip_prefix("Name:"))?;
        if name.trim().starts_with("iou-") {
            return None;
        }
        let mask = status.lines().find_map(|l| l.strip_prefix("SigBlk:"))?;
        let mask = u64::from_str_radix(mask.trim(), 16).ok()?;
        (mask & bit != 0).then_some(tid)
    })
    .collect()
}

fn our_action() -> libc::sigaction {
    // SAFETY: sigaction is plain data.
    let mut act: libc::sigaction = unsafe { std::mem::zeroed() };
    act.sa_sigaction = on_sigbus as *const () as usize;
    // Asynchronous signals (thread cancellation included) wait while the handler runs, and
    // act at the program's instruction when it returns. SIGBUS itself stays open
    // (SA_NODEFER): a thread inside the handler must not look like one that blocks it, and
    // a synchronous SIGBUS there would kill the process if it were blocked.
    act.sa_flags = libc::SA_SIGINFO | libc::SA_ONSTACK | libc::SA_RESTART | libc::SA_NODEFER;
    act.sa_mask = crate::signals::handler_mask();
    act
}

fn install_handler() -> Result<()> {
    let mut result = Ok(());
    INSTALL.call_once(|| {
        // SAFETY: installing a handler; `old` is filled by the kernel.
        unsafe {
            let mut old: libc::sigaction = std::mem::zeroed();
            if libc::sigaction(libc::SIGBUS, &our_action(), &mut old) != 0 {
                result = Err(Error::os("sigaction(SIGBUS)"));
                return;
            }
            PREVIOUS.store(Box::into_raw(Box::new(old)), Release);
        }
        return_through_range();
    });
    result
}

/// Whether uswap's SIGBUS handler has been installed in this process.
pub(crate) fn installed() -> bool {
    INSTALL.is_completed() && handler_is_ours()
}

/// Program actions for SIGBUS recorded by syscall dispatch; reused in turn, never freed (a
/// handler may be reading one).
static mut RECORDS: [std::mem::MaybeUninit<libc::sigaction>; 16] =
    [const { std::mem::MaybeUninit::uninit() }; 16];
static NEXT_RECORD: AtomicUsize = AtomicUsize::new(0);

/// The program's own SIGBUS action as dispatch sees it: returns the one recorded (handler,
/// flags, mask word) and, given `new`, records that one as where SIGBUS signals that are
/// not about a region go. uswap's handler stays installed.
pub(crate) fn program_action(new: Option<(usize, u64, u64)>) -> (usize, u64, u64) {
    // SAFETY: PREVIOUS points to a never freed record once set.
    let old = unsafe { PREVIOUS.load(Acquire).as_ref() }
        .map(|p| {
            // SAFETY: the kernel's mask is the first word of the C library's sigset_t.
            let mask = unsafe { *(&p.sa_mask as *const libc::sigset_t).cast::<u64>() };
            (p.sa_sigaction, p.sa_flags as u64, mask)
        })
        .unwrap_or((libc::SIG_DFL, 0, 0));
    if let Some((handler, flags, mask)) = new {
        // SAFETY: plain data; a record is written before it is published, and the 16 are
        // reused in turn.
        unsafe {
            let mut record: libc::sigaction = std::mem::zeroed();
            record.sa_sigaction = handler;
            record.sa_flags = flags as libc::c_int;
            *(&mut record.sa_mask as *mut libc::sigset_t).cast::<u64>() = mask;
            let i = NEXT_RECORD.fetch_add(1, Relaxed) % 16;
            let slot = std::ptr::addr_of_mut!(RECORDS[i]).cast::<libc::sigaction>();
            slot.write(record);
            PREVIOUS.store(slot, Release);
        }
    }
    old
}

fn handler_is_ours() -> bool {
    // SAFETY: reading the current disposition.
    unsafe {
        let mut cur: libc::sigaction = std::mem::zeroed();
        libc::sigaction(libc::SIGBUS, std::ptr::null(), &mut cur);
        cur.sa_sigaction == on_sigbus as *const () as usize
    }
}

/// Has uswap's SIGBUS handler return through the range's signal return: through the C
/// library's, each fault of a dispatching thread would cost a second signal. Called when
/// either handler is installed.
pub(crate) fn return_through_range() {
    let mut act = KernelSigaction {
        handler: 0,
        flags: 0,
        restorer: 0,
        mask: 0,
    };
    let sigbus = libc::SIGBUS as u64;
    raw_syscall(
        libc::SYS_rt_sigaction,
        [sigbus, 0, &mut act as *mut _ as u64, 8, 0, 0],
    );
    if is_our_handler(act.handler as usize) {
        act.flags |= SA_RESTORER;
        act.restorer = sud::sigreturn_address();
        raw_syscall(
            libc::SYS_rt_sigaction,
            [sigbus, &act as *const _ as u64, 0, 8, 0, 0],
        );
    }
}

/// Installs uswap's handler again over one that replaced it, which becomes the one that
/// other SIGBUS signals are passed to.
fn reinstall() {
    // SAFETY: as in install_handler.
    unsafe {
        let mut old: libc::sigaction = std::mem::zeroed();
        if libc::sigaction(libc::SIGBUS, &our_action(), &mut old) == 0 {
            // The previous record is leaked, not freed: a handler may be reading it.
            PREVIOUS.store(Box::into_raw(Box::new(old)), Release);
        }
        return_through_range();
    }
}

pub(crate) fn is_our_handler(handler: usize) -> bool {
    handler == on_sigbus as *const () as usize
}

thread_local! {
    /// Set while the thread runs uswap's SIGBUS handler.
    static IN_HANDLER: std::cell::Cell<bool> = const { std::cell::Cell::new(false) };
}

/// Whether the calling thread is inside uswap's SIGBUS handler, where nothing may be
/// allocated (the thread it interrupted may hold the allocator's lock): for a test's
/// allocator to check.
#[doc(hidden)]
pub fn in_sigbus_handler() -> bool {
    IN_HANDLER.with(|h| h.get())
}

extern "C" fn on_sigbus(sig: libc::c_int, info: *mut libc::siginfo_t, ctx: *mut libc::c_void) {
    // A dispatching thread's system calls from here on are uswap's own.
    let _allowed = sud::Allowed::new();
    // SAFETY: __errno_location is the calling thread's errno; restored on the way out.
    let errno = unsafe { *libc::__errno_location() };
    let outer = IN_HANDLER.with(|h| h.replace(true));
    dispatch(sig, info, ctx);
    IN_HANDLER.with(|h| h.set(outer));
    // SAFETY: as above.
    unsafe { *libc::__errno_location() = errno };
}

fn dispatch(sig: libc::c_int, info: *mut libc::siginfo_t, ctx: *mut libc::c_void) {
    // SAFETY: the kernel passes a valid siginfo for SA_SIGINFO handlers.
    let (addr, code) = unsafe { ((*info).si_addr() as usize, (*info).si_code) };
    // A userfaultfd fault is BUS_ADRERR; a poisoned page (uswap's UFFDIO_POISON or a
    // hardware memory error) is BUS_MCEERR_*: that one is never retried here.
    let uffd_fault = code == libc::BUS_ADRERR;
    for i in entries() {
        let (entry, start, end) = (&REGIONS[i], &RANGES[i].0, &RANGES[i].1);
        if addr < start.load(Relaxed) || addr >= end.load(Relaxed) {
            continue;
        }
        IN_FLIGHT[i].fetch_add(1, SeqCst);
        let ptr = entry.load(SeqCst);
        // SAFETY: an entry stays valid while IN_FLIGHT is non-zero (Service::stop waits).
        let served = unsafe { ptr.as_ref() };
        let page = served.and_then(|s| s.fault.mm().page_of(addr));
        let outcome = match (served, page) {
            (Some(s), Some(page)) if uffd_fault => Some(resolve(s, page, fault_was_write(ctx))),
            (Some(_), Some(_)) => Some(Outcome::Fatal),
            _ => None,
        };
        IN_FLIGHT[i].fetch_sub(1, SeqCst);
        match outcome {
            None => continue,
            Some(Outcome::Fatal) => return restore_default(),
            Some(_) => return,
        }
    }
    if uffd_fault && (moving_out(addr) || first_sight(addr)) {
        // A page mremap moved out of a region, not in place yet: retry until it is.
        crate::sync::give_way();
        return;
    }
    forward(sig, info, ctx);
}

/// Whether the access that raised this SIGBUS was a write: bit 1 of the page-fault error
/// code the kernel leaves in the signal frame (`REG_ERR` on x86-64, where `do_sigbus`
/// records it); elsewhere not known, and taken for a write.
fn fault_was_write(ctx: *mut libc::c_void) -> bool {
    #[cfg(target_arch = "x86_64")]
    {
        // SAFETY: an SA_SIGINFO handler's third argument is the interrupted ucontext.
        let err =
            unsafe { (*ctx.cast::<libc::ucontext_t>()).uc_mcontext.gregs[libc::REG_ERR as usize] };
        err & 2 != 0
    }
    #[cfg(not(target_arch = "x86_64"))]
    {
        let _ = ctx;
        true
    }
}

thread_local! {
    /// The last address outside every region this thread took a SIGBUS for, and how often.
    static UNKNOWN: std::cell::Cell<(usize, u32)> = const { std::cell::Cell::new((0, 0)) };
}

/// Whether this thread meets a fault at `addr` (outside every region) for the first few
/// times in a row. The signal is raised when the fault happens; a service thread may have
/// handed the range to the kernel (after an mremap out of a region) between that and this
/// look, so the access is retried a few times before the SIGBUS is taken as foreign.
fn first_sight(addr: usize) -> bool {
    UNKNOWN.with(|c| {
        let (last, n) = c.get();
        let n = if last == addr { n + 1 } else { 1 };
        c.set((addr, n));
        n <= 3
    })
}

/// Whether `addr` is where a region's service thread is about to put a page that mremap
/// moved out of the region.
fn moving_out(addr: usize) -> bool {
    REGIONS.iter().enumerate().any(|(i, entry)| {
        if entry.load(Relaxed).is_null() {
            return false;
        }
        IN_FLIGHT[i].fetch_add(1, SeqCst);
        // SAFETY: as in dispatch.
        let pending =
            unsafe { entry.load(SeqCst).as_ref() }.is_some_and(|s| s.fault.vma().is_pending(addr));
        IN_FLIGHT[i].fetch_sub(1, SeqCst);
        pending
    })
}

/// Stack a swap-in that reads ahead in the handler may take below the handler's frame, with
/// a margin (its buffers are the swap device's; its page locks and slot lists, and the
/// cipher's frames, are on the stack): about 8 KiB measured in an optimized build, 20 KiB
/// unoptimized.
const READAHEAD_STACK: usize = if cfg!(debug_assertions) {
    48 << 10
} else {
    24 << 10
};

/// Whether the handler runs with room for a swap-in that reads ahead: on an alternate stack
/// when [`READAHEAD_STACK`] is left below this frame (`uswap run` gives every thread 64 KiB;
/// Rust's runtime gives its threads 8 KiB, where the handler reads lone pages and hands
/// windows to the service thread). Off an alternate stack the handler runs on the thread's
/// own, megabytes as a rule, and is taken to have room; an alternate stack set with
/// `SS_AUTODISARM` looks the same while the handler runs on it. No room when it cannot
/// be told.
fn room_to_read_ahead() -> bool {
    // SAFETY: plain data, filled by the kernel.
    let mut ss: libc::stack_t = unsafe { std::mem::zeroed() };
    // Straight to the kernel: under syscall dispatch the C library's call sees the
    // program's view of its alternate stack.
    let got = raw_syscall(
        libc::SYS_sigaltstack,
        [0, &mut ss as *mut _ as u64, 0, 0, 0, 0],
    );
    if got != 0 {
        return false;
    }
    if ss.ss_flags & libc::SS_ONSTACK == 0 {
        return true;
    }
    let here = &ss as *const _ as usize;
    here.saturating_sub(ss.ss_sp as usize) >= READAHEAD_STACK
}

/// Resolves a fault in the handler when it can, else hands it to the service thread and
/// waits.
fn resolve(s: &Served, page: usize, write: bool) -> Outcome {
    match s.fault.resolve_in_signal(page, write, room_to_read_ahead) {
        Some(Outcome::Retry) => {
            crate::sync::give_way();
            Outcome::Retry
        }
        Some(outcome) => outcome,
        None => {
            s.fault.mm().count(VmEvent::sigbus_handovers, 1);
            hand_over(s, page)
        }
    }
}

/// Whether `[addr, addr + len)` overlaps a SIGBUS-mode region.
pub(crate) fn in_region(addr: usize, len: usize) -> bool {
    let end = addr.saturating_add(len);
    RANGES[entries()]
        .iter()
        .any(|(start, stop)| addr < stop.load(Relaxed) && end > start.load(Relaxed))
}

/// Pins a system call holds on region memory (SIGBUS mode with syscall dispatch), given
/// back by [`CallPins::release`]. Each keeps its region registered (`IN_FLIGHT`) until then.
pub(crate) struct CallPins {
    /// The first `len` entries are held.
    held: [Option<(usize, Pin)>; CALL_PINS],
    len: usize,
    /// How a pinned page that is not usable is treated: brought in (a dispatched call, in
    /// the SIGSYS handler), or only noted (a direct call, which then takes the trap).
    bring_in: bool,
    /// A direct call's pins found a page that is not usable as it is.
    missed: bool,
}

/// Ranges one system call may pin; a call with more buffers pins what covers them.
pub(crate) const CALL_PINS: usize = 64;

impl CallPins {
    pub fn new() -> CallPins {
        CallPins {
            held: [const { None }; CALL_PINS],
            len: 0,
            bring_in: true,
            missed: false,
        }
    }

    /// Pins that bring nothing in: a page that is not mapped and usable for the call as it
    /// stands is noted instead ([`CallPins::all_usable`]). For calls made outside a signal
    /// handler (`syscall_direct.rs`), which must not make system calls of their own.
    pub fn usable_only() -> CallPins {
        CallPins {
            bring_in: false,
            ..CallPins::new()
        }
    }

    /// Drops the pins without giving them back (a fork child's copy of its parent's).
    pub fn forget(&mut self) {
        self.held[..self.len].fill_with(|| None);
        self.len = 0;
        self.missed = false;
    }

    /// Whether every page pinned so far was usable as it stood (`usable_only` pins).
    pub fn all_usable(&self) -> bool {
        !self.missed
    }

    pub fn free(&self) -> usize {
        CALL_PINS - self.len
    }

    /// Brings in every page of `[addr, addr + len)` that lies in a SIGBUS-mode region,
    /// writable when the kernel is to `write` there, and pins it until `release`. Pages
    /// outside regions are left to the kernel; a page whose data is lost stays out, and the
    /// call fails on it (EFAULT) as an access would. Returns false when no pin slot was
    /// left in this call (nothing pinned for the range then).
    pub fn pin(&mut self, addr: usize, len: usize, write: bool) -> bool {
        let end = addr.saturating_add(len);
        for i in entries() {
            if len == 0 || end <= RANGES[i].0.load(Relaxed) || addr >= RANGES[i].1.load(Relaxed) {
                continue;
            }
            if self.len == CALL_PINS {
                return false;
            }
            IN_FLIGHT[i].fetch_add(1, SeqCst);
            // SAFETY: an entry stays valid while IN_FLIGHT is non-zero (Service::stop waits).
            let Some(served) = (unsafe { REGIONS[i].load(SeqCst).as_ref() }) else {
                IN_FLIGHT[i].fetch_sub(1, SeqCst);
                continue;
            };
            let mm = served.fault.mm();
            let pages = mm.pages_in(addr, end);
            if pages.is_empty() {
                IN_FLIGHT[i].fetch_sub(1, SeqCst);
                continue;
            }
            let pin = mm.pins().pin(pages.clone());
            if self.bring_in {
                bring_in(served, pages, write);
            } else if !made_usable(served, pages, write) {
                self.missed = true;
            }
            mm.count(VmEvent::syscall_pins, 1);
            self.hold(i, pin);
        }
        true
    }

    /// Pins every SIGBUS-mode region whole, bringing nothing in: aging leaves them alone
    /// until `release` (a child that shares the memory runs without dispatch meanwhile).
    pub fn hold_off_aging(&mut self) {
        for i in entries() {
            if self.len == CALL_PINS {
                return;
            }
            IN_FLIGHT[i].fetch_add(1, SeqCst);
            // SAFETY: as in `pin`.
            let pin = unsafe { REGIONS[i].load(SeqCst).as_ref() }.and_then(|served| {
                let pages = served.fault.mm().pages().len();
                (pages > 0).then(|| served.fault.mm().pins().pin(0..pages))
            });
            match pin {
                Some(pin) => self.hold(i, pin),
                None => {
                    IN_FLIGHT[i].fetch_sub(1, SeqCst);
                }
            }
        }
    }

    fn hold(&mut self, region: usize, pin: Pin) {
        self.held[self.len] = Some((region, pin));
        self.len += 1;
    }

    /// Gives every pin back and lets their regions go.
    pub fn release(&mut self) {
        self.missed = false;
        let len = std::mem::take(&mut self.len);
        for (i, pin) in self.held[..len].iter_mut().filter_map(Option::take) {
            // SAFETY: registered while IN_FLIGHT is raised, as in `pin`.
            if let Some(served) = unsafe { REGIONS[i].load(SeqCst).as_ref() } {
                served.fault.mm().pins().unpin(pin);
            }
            IN_FLIGHT[i].fetch_sub(1, SeqCst);
        }
    }
}

/// Brings pinned pages in, as the faults the kernel's accesses would raise: mapped, and
/// writable (no longer write-protected, a swap copy given up) when they are to be written.
/// Called after the pin is published, so aging does not take them out again. The page
/// tables are read (pagemap) a batch at a time: the page table's state alone does not say
/// whether a page is write-protected (a write fault may have left the protection for the
/// next one to clear).
fn bring_in(served: &Served, pages: std::ops::Range<usize>, write: bool) {
    let mm = served.fault.mm();
    let mut entries = [crate::mm::PagemapEntry::default(); 64];
    let mut first = pages.start;
    while first < pages.end {
        let n = (pages.end - first).min(entries.len());
        let known = mm.pagemap_entries(first, &mut entries[..n]);
        for (i, entry) in entries[..n].iter().enumerate() {
            let page = first + i;
            let (state, locked) = mm.pages().peek(page);
            let usable = !locked
                && match state.kind() {
                    Kind::Active | Kind::Lazyfree if known => {
                        entry.present && !(write && mm.write_stops_at(*entry))
                    }
                    Kind::Active => !write || !state.write_faults(),
                    _ => false,
                };
            if !usable {
                bring_in_one(served, page, write);
            }
        }
        first += n;
    }
}

/// Most pages a direct call touches: a longer buffer (or a count the kernel will refuse)
/// is left to the dispatched path.
const MAX_DIRECT_PAGES: usize = 16_384;

/// Makes pinned pages usable for a direct call from the program's own code, without a
/// system call: each is touched as the kernel will use it (read, or written with an atomic
/// no-op), so that a missing, discarded or write-protected page is served by the SIGBUS
/// handler as a program access would be. Then each must be active and unlocked (aging,
/// which locks a page before it reads the pins, either saw this pin or is done with the
/// page, so it stays mapped) and, when written, not write-protected (no swap copy kept,
/// not shared with a fork relative). False when a page is not the program's (unmapped, poisoned: the
/// dispatched path fails the call as the kernel would) or does not settle.
fn made_usable(served: &Served, pages: std::ops::Range<usize>, write: bool) -> bool {
    let mm = served.fault.mm();
    let table = mm.pages();
    if pages.len() > MAX_DIRECT_PAGES {
        return false;
    }
    for page in pages.clone() {
        if matches!(table.peek(page).0.kind(), Kind::Unmapped | Kind::Poisoned) {
            return false;
        }
        touch(mm.page_addr(page), write);
    }
    pages.into_iter().all(|page| {
        let (state, locked) = table.peek(page);
        !locked && state.kind() == Kind::Active && !(write && state.write_faults())
    })
}

/// One access to the byte at `addr`: a read, or an atomic write of what is there.
fn touch(addr: usize, write: bool) {
    // SAFETY: `addr` is a page of the program's region memory that the program hands to
    // the kernel; the atomic OR with zero leaves its contents as they are even while
    // other threads write it.
    unsafe {
        if write {
            std::arch::asm!("lock or byte ptr [{0}], 0", in(reg) addr, options(nostack));
        } else {
            std::ptr::read_volatile(addr as *const u8);
        }
    }
}

/// One page of [`bring_in`] found missing, or not yet writable, or busy.
fn bring_in_one(served: &Served, page: usize, write: bool) {
    let mm = served.fault.mm();
    // Served faults that left the page as it was: an access would fail the same way.
    let mut served_in_vain = 0;
    while served_in_vain < 4 {
        let (state, locked) = mm.pages().peek(page);
        if locked || served.fault.events_pending() {
            // A fault or aging is at work on it, or a discard or unmap the program made is
            // being handled (the table may not say yet that the page is gone): look again
            // when it is done.
            crate::sync::give_way();
            continue;
        }
        let usable = |e: crate::mm::PagemapEntry| e.present && !(write && mm.write_stops_at(e));
        match state.kind() {
            Kind::Active | Kind::Lazyfree => match mm.pagemap_entry(page) {
                Some(e) if usable(e) => return,
                None if state.kind() == Kind::Lazyfree || !write || !state.write_faults() => return,
                _ => {}
            },
            // Not the program's memory any more, or lost: the call fails as an access would.
            Kind::Unmapped | Kind::Poisoned => return,
            _ => {}
        }
        match resolve(served, page, write) {
            Outcome::Fatal => return,
            Outcome::Resolved => served_in_vain += 1,
            Outcome::Retry => {}
        }
    }
}

fn hand_over(s: &Served, page: usize) -> Outcome {
    let Some(r) = s.requests.iter().find(|r| {
        r.state
            .compare_exchange(FREE, CLAIMED, Acquire, Relaxed)
            .is_ok()
    }) else {
        // Every request is taken: let the access retry.
        crate::sync::give_way();
        return Outcome::Retry;
    };
    r.page.store(page, Relaxed);
    r.state.store(PENDING, Release);
    ring(s.doorbell.as_raw_fd());
    let mut waited = 0;
    while r.state.load(Acquire) == PENDING {
        if !futex_wait(&r.state, PENDING, HAND_OVER_PATIENCE) {
            // A slow disk can take this long; a stuck service thread must not be silent.
            waited += HAND_OVER_PATIENCE.as_secs();
            say_waiting(page, waited);
        }
    }
    let done = r.state.load(Acquire);
    r.state.store(FREE, Release);
    if done == DONE_FATAL {
        Outcome::Fatal
    } else {
        Outcome::Resolved
    }
}

/// How long a handed-over fault waits before it says so on stderr (and waits on).
const HAND_OVER_PATIENCE: Duration = Duration::from_secs(10);

/// Waits while `word` holds `expected`, at most `timeout`; false when the time ran out.
fn futex_wait(word: &AtomicU32, expected: u32, timeout: Duration) -> bool {
    let limit = libc::timespec {
        tv_sec: timeout.as_secs() as libc::time_t,
        tv_nsec: timeout.subsec_nanos() as libc::c_long,
    };
    // SAFETY: a private futex on a word we own; returns on wake, mismatch, signal or time.
    let r = unsafe {
        libc::syscall(
            libc::SYS_futex,
            word.as_ptr(),
            libc::FUTEX_WAIT | libc::FUTEX_PRIVATE_FLAG,
            expected,
            &limit,
        )
    };
    !(r == -1 && std::io::Error::last_os_error().raw_os_error() == Some(libc::ETIMEDOUT))
}

/// Writes "uswap: a fault on page P has waited S s for the SIGBUS service thread" to
/// stderr, allocating nothing (a signal handler's).
fn say_waiting(page: usize, seconds: u64) {
    let mut line = [0u8; 128];
    let mut len = 0;
    let mut put = |bytes: &[u8]| {
        let n = bytes.len().min(line.len() - len);
        line[len..len + n].copy_from_slice(&bytes[..n]);
        len += n;
    };
    let mut digits = [0u8; 20];
    put(b"uswap: a fault on page ");
    put(decimal(page as u64, &mut digits));
    put(b" has waited ");
    put(decimal(seconds, &mut digits));
    put(b" s for the SIGBUS service thread; still waiting\n");
    // SAFETY: writing our buffer to stderr; async-signal-safe.
    unsafe { libc::write(2, line.as_ptr().cast(), len) };
}

/// `n` in decimal, in the end of `buf`.
fn decimal(mut n: u64, buf: &mut [u8; 20]) -> &[u8] {
    let mut at = buf.len();
    loop {
        at -= 1;
        buf[at] = b'0' + (n % 10) as u8;
        n /= 10;
        if n == 0 {
            return &buf[at..];
        }
    }
}

fn futex_wake(word: &AtomicU32) {
    // SAFETY: as above.
    unsafe {
        libc::syscall(
            libc::SYS_futex,
            word.as_ptr(),
            libc::FUTEX_WAKE | libc::FUTEX_PRIVATE_FLAG,
            i32::MAX,
        );
    }
}

/// The access cannot be served: with the default action restored, the retried access
/// kills the process with SIGBUS.
fn restore_default() {
    // SAFETY: resetting a signal disposition; async-signal-safe.
    unsafe { libc::signal(libc::SIGBUS, libc::SIG_DFL) };
}

/// Passes a SIGBUS that is not about a uswap region to whoever handled it before.
fn forward(sig: libc::c_int, info: *mut libc::siginfo_t, ctx: *mut libc::c_void) {
    // SAFETY: PREVIOUS points to a leaked, never freed record once set.
    let previous = unsafe { PREVIOUS.load(Acquire).as_ref() };
    match previous {
        Some(old)
            if old.sa_sigaction != libc::SIG_DFL
                && old.sa_sigaction != libc::SIG_IGN
                && old.sa_sigaction != on_sigbus as *const () as usize =>
        {
            // SAFETY: calling the previously installed handler with the same arguments.
            unsafe {
                if old.sa_flags & libc::SA_SIGINFO != 0 {
                    let f: extern "C" fn(libc::c_int, *mut libc::siginfo_t, *mut libc::c_void) =
                        std::mem::transmute(old.sa_sigaction);
                    f(sig, info, ctx);
                } else {
                    let f: extern "C" fn(libc::c_int) = std::mem::transmute(old.sa_sigaction);
                    f(sig);
                }
            }
        }
        _ => restore_default(),
    }
}
