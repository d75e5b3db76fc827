//! Syscall user dispatch (the kernel's `PR_SET_SYSCALL_USER_DISPATCH`): system calls of a
//! SIGBUS-mode program that still see its swapped-out memory.
//!
//! In SIGBUS mode the faulting thread serves its own faults, but a kernel access to a page
//! that is not mapped fails with EFAULT: `read(2)` into a swapped-out buffer would fail, or
//! worse, consume a pipe's data and then fail. With dispatch on, every system call a
//! dispatching thread makes outside uswap's own code stops with SIGSYS before it runs. The
//! handler here finds the call's buffers (`syscall_args.rs`), brings those in region memory
//! in, pins them against aging (`gup.rs`, `sigbus::CallPins`), runs the call itself, and
//! gives the pins back. A thread turns dispatch on for itself
//! ([`enable_for_this_thread`]); the kernel clears it in a new thread and across exec.
//!
//! Which system calls go straight to the kernel is decided by a per-thread selector byte
//! the kernel reads at each call, and by an address range it always lets through:
//! - the selector says *block* while the program's code runs, and *allow* while uswap's
//!   handlers run (they make system calls of their own through the C library);
//! - the range holds four small routines (below): a six-argument system call, the
//!   program's call, the signal return uswap's handlers return through, and `clone` for a
//!   new thread. The program's call runs with the selector at *block*, the program's own
//!   signal mask and on the program's own stack, so a signal that interrupts it runs the
//!   program's handler as and where it would have, and that handler's own system calls are
//!   dispatched too.
//!
//! What the handler does itself instead of passing the call on:
//! - `rt_sigreturn` from a program's signal handler resumes at the range's signal return
//!   (the C library's return path lies outside the range);
//! - `rt_sigprocmask` changes the mask the handler returns to, never blocking SIGSYS or
//!   SIGBUS (a blocked synchronous signal kills the process), and `rt_sigaction` and the
//!   calls that wait with a mask of their own (`rt_sigsuspend`, `ppoll`, `pselect6`,
//!   `epoll_pwait`) get a mask without them; a program's SIGBUS action is recorded, not
//!   installed (`sigbus::program_action`): it gets the SIGBUS signals that are not uswap's;
//! - a futex wait has its word brought in but not pinned while it sleeps, and runs again
//!   if it fails with EFAULT (it changed nothing then);
//! - `clone` and `clone3` for a thread with a stack of its own start the child at the
//!   program's next instruction with the program's registers; `vfork` becomes
//!   `clone3(CLONE_VM | CLONE_VFORK)` on the program's stack (the handler runs on an
//!   alternate stack, so the child does not overwrite its frame), and a `CLONE_VFORK`
//!   child gives up the alternate stack it inherits and runs while aging is held off every
//!   SIGBUS-mode region, as it reads its arguments without dispatch;
//! - `sigaltstack` is kept as the program's view: uswap's alternate stack stays in place.

use crate::error::{Error, Result};
use crate::sigbus::CallPins;
use crate::sud::{
    self, raw_syscall, set_selector, Allowed, KernelSigaction, ALLOW, BLOCK, SA_RESTORER,
};
use crate::syscall_args;
use std::sync::atomic::{AtomicI32, AtomicU64, Ordering::Relaxed};
use std::sync::Once;

pub use crate::sud::{disable_for_this_thread, supported, supported_here};

/// `si_code` of a SIGSYS raised by dispatch.
const SYS_USER_DISPATCH: libc::c_int = 2;

fn bit(sig: libc::c_int) -> u64 {
    1 << (sig - 1)
}

/// Signals a dispatching thread must never block: SIGSYS (dispatch itself) and SIGBUS
/// (its faults); the kernel kills a thread that blocks a signal it forces.
fn never_blocked() -> u64 {
    bit(libc::SIGSYS) | bit(libc::SIGBUS)
}

/// The signals blocked while uswap's SIGSYS handler runs, as a kernel mask word: every
/// asynchronous one, the C library's own included (`signals::handler_mask`).
fn handler_mask() -> u64 {
    mask_word(&crate::signals::handler_mask())
}

/// `set` as a kernel mask word, less the signals never blocked.
fn mask_word(set: &libc::sigset_t) -> u64 {
    // SAFETY: the kernel's mask is the first word of the C library's sigset_t.
    unsafe { *(set as *const libc::sigset_t).cast::<u64>() & !never_blocked() }
}

/// `rt_sigprocmask(how, new, old)` on kernel mask words, from inside the range (never
/// dispatched).
fn set_mask_raw(how: libc::c_int, new: &u64, old: Option<&mut u64>) {
    let old = old.map_or(0, |o| o as *mut u64 as u64);
    raw_syscall(
        libc::SYS_rt_sigprocmask,
        [how as u64, new as *const u64 as u64, old, 8, 0, 0],
    );
}

static INSTALL: Once = Once::new();
/// The errno of a failed install (0: installed).
static INSTALL_ERROR: AtomicI32 = AtomicI32::new(0);

/// Installs the SIGSYS handler, returning through the range's signal return.
fn install_handler() -> Result<()> {
    INSTALL.call_once(|| {
        let act = KernelSigaction {
            handler: on_sigsys as *const () as u64,
            flags: (libc::SA_SIGINFO | libc::SA_ONSTACK | libc::SA_NODEFER) as u64 | SA_RESTORER,
            restorer: sud::sigreturn_address(),
            mask: handler_mask(),
        };
        let mut old = KernelSigaction {
            handler: 0,
            flags: 0,
            restorer: 0,
            mask: 0,
        };
        let rc = raw_syscall(
            libc::SYS_rt_sigaction,
            [
                libc::SIGSYS as u64,
                &act as *const _ as u64,
                &mut old as *mut _ as u64,
                8,
                0,
                0,
            ],
        );
        if rc < 0 {
            INSTALL_ERROR.store(-rc as i32, Relaxed);
            return;
        }
        // A program whose region is built after it started may have set one: its view.
        for (slot, value) in PROGRAM_SIGSYS
            .iter()
            .zip([old.handler, old.flags, old.mask])
        {
            slot.store(value, Relaxed);
        }
        crate::sigbus::return_through_range();
    });
    match INSTALL_ERROR.load(Relaxed) {
        0 => Ok(()),
        errno => Err(Error::Os {
            op: "rt_sigaction(SIGSYS)",
            source: std::io::Error::from_raw_os_error(errno),
        }),
    }
}

/// While alive, the calling thread's system calls go straight to the kernel, as in uswap's
/// signal handlers: for uswap's own work on a thread that runs with dispatch (a process's
/// start under `uswap run`, the parent's fork handlers), none of whose calls take the
/// program's memory. Dispatched, each would be a SIGSYS round trip: a shell's command made
/// about 200 of them, setting up its regions. Asynchronous signals wait meanwhile: a
/// program handler run inside would have its calls undispatched. The C library's own two
/// stay open, unlike in uswap's handlers: threads made meanwhile (uswap's, at a process's
/// start) inherit the mask, and one that blocked the `set*id` broadcast would hang the
/// program's next `setgid` for ever. Made after dispatch is turned on (it puts back the
/// selector and mask it found); not `Send`.
pub struct OwnCalls {
    /// The mask to put back, after the selector.
    mask: u64,
    allowed: std::mem::ManuallyDrop<Allowed>,
    _this_thread: std::marker::PhantomData<*mut ()>,
}

impl OwnCalls {
    #[allow(clippy::new_without_default)]
    pub fn new() -> OwnCalls {
        let mut mask = 0u64;
        let block = mask_word(&crate::signals::asynchronous());
        set_mask_raw(libc::SIG_BLOCK, &block, Some(&mut mask));
        OwnCalls {
            mask,
            allowed: std::mem::ManuallyDrop::new(Allowed::new()),
            _this_thread: std::marker::PhantomData,
        }
    }
}

impl Drop for OwnCalls {
    fn drop(&mut self) {
        // The selector first: a signal let in by the mask then finds the thread
        // dispatching again.
        // SAFETY: dropped once, here.
        unsafe { std::mem::ManuallyDrop::drop(&mut self.allowed) };
        set_mask_raw(libc::SIG_SETMASK, &self.mask, None);
    }
}

/// Turns syscall user dispatch on for the calling thread: from now on its system calls
/// that touch SIGBUS-mode region memory are served as in thread mode. SIGBUS and SIGSYS are
/// unblocked in it. Threads it creates start without dispatch.
pub fn enable_for_this_thread() -> Result<()> {
    install_handler()?;
    ensure_alternate_stack()?;
    if let Err(source) = sud::turn_on_with_selector_at_allow() {
        return Err(match source.raw_os_error() {
            Some(libc::EINVAL | libc::ENOSYS | libc::EPERM) => Error::invalid(
                "syscall dispatch",
                format!(
                    "this kernel refuses syscall user dispatch ({source}; it needs Linux 5.11 \
                     or later on x86-64, and may be turned off by sysctl); use thread mode \
                     for a program whose system calls read its memory"
                ),
            ),
            _ => Error::Os {
                op: "prctl(PR_SET_SYSCALL_USER_DISPATCH)",
                source,
            },
        });
    }
    // SAFETY: plain data; unblocking two signals in this thread.
    unsafe {
        let mut set: libc::sigset_t = std::mem::zeroed();
        libc::sigemptyset(&mut set);
        libc::sigaddset(&mut set, libc::SIGSYS);
        libc::sigaddset(&mut set, libc::SIGBUS);
        libc::pthread_sigmask(libc::SIG_UNBLOCK, &set, std::ptr::null_mut());
    }
    set_selector(BLOCK);
    Ok(())
}

extern "C" fn on_sigsys(_sig: libc::c_int, info: *mut libc::siginfo_t, ctx: *mut libc::c_void) {
    // SAFETY: the kernel passes a valid siginfo and ucontext to an SA_SIGINFO handler.
    let (info, uc) = unsafe { (&*info, &mut *ctx.cast::<libc::ucontext_t>()) };
    if info.si_code != SYS_USER_DISPATCH {
        return not_ours();
    }
    let g = &mut uc.uc_mcontext.gregs;
    let nr = g[libc::REG_RAX as usize];
    if nr == libc::SYS_rt_sigreturn {
        // A program's handler returns: through our range, on the same frame.
        g[libc::REG_RIP as usize] = sud::sigreturn_address() as i64;
        return;
    }
    let allowed = Allowed::new();
    // SAFETY: this thread's errno, restored on the way out.
    let errno = unsafe { *libc::__errno_location() };
    // SAFETY: the kernel's mask is the first word of the saved sigset_t.
    let mask = unsafe { &mut *(&mut uc.uc_sigmask as *mut libc::sigset_t).cast::<u64>() };
    let result = dispatch(nr, g, mask, &mut uc.uc_stack);
    g[libc::REG_RAX as usize] = result;
    // SAFETY: as above.
    unsafe { *libc::__errno_location() = errno };
    drop(allowed);
}

/// A SIGSYS that dispatch did not raise (a seccomp filter's): the default action, as
/// without uswap. A handler the program set for SIGSYS is only recorded
/// ([`PROGRAM_SIGSYS`]): runtimes that install a handler for every signal, as Go's does,
/// expect the call to succeed, and a seccomp denial ends the program either way.
fn not_ours() {
    let dfl = KernelSigaction {
        handler: 0,
        flags: 0,
        restorer: 0,
        mask: 0,
    };
    raw_syscall(
        libc::SYS_rt_sigaction,
        [libc::SIGSYS as u64, &dfl as *const _ as u64, 0, 8, 0, 0],
    );
    let pid = raw_syscall(libc::SYS_getpid, [0; 6]);
    let tid = raw_syscall(libc::SYS_gettid, [0; 6]);
    raw_syscall(
        libc::SYS_tgkill,
        [pid as u64, tid as u64, libc::SIGSYS as u64, 0, 0, 0],
    );
}

/// The program's registers at its system call: rdi, rsi, rdx, r10, r8, r9.
fn args_of(g: &[i64; 23]) -> [u64; 6] {
    [
        libc::REG_RDI,
        libc::REG_RSI,
        libc::REG_RDX,
        libc::REG_R10,
        libc::REG_R8,
        libc::REG_R9,
    ]
    .map(|r| g[r as usize] as u64)
}

fn dispatch(nr: i64, g: &[i64; 23], mask: &mut u64, uc_stack: &mut libc::stack_t) -> i64 {
    let mut a = args_of(g);
    let program = Program {
        mask: *mask,
        sp: g[libc::REG_RSP as usize] as u64,
    };
    match nr {
        libc::SYS_rt_sigprocmask => return sigprocmask(a, mask),
        libc::SYS_rt_sigaction => return sigaction(a),
        libc::SYS_vfork => return vfork(g, *mask),
        libc::SYS_clone | libc::SYS_clone3 => return clone(nr, g, a, program),
        libc::SYS_sigaltstack => return sigaltstack(a, program, uc_stack),
        _ => {}
    }
    // A wait with a mask of its own must not block SIGSYS or SIGBUS either.
    let mask_arg = match nr {
        libc::SYS_rt_sigsuspend => Some(0),
        libc::SYS_ppoll => Some(3),
        libc::SYS_epoll_pwait | libc::SYS_epoll_pwait2 => Some(4),
        _ => None,
    };
    let own_mask = mask_arg.filter(|&i| a[i] != 0).map(|i| {
        // SAFETY: the program's mask argument; a bad pointer faults here as it would in
        // the C library's wrapper.
        let m = unsafe { std::ptr::read_unaligned(a[i] as *const u64) };
        (i, m & !never_blocked())
    });
    if let Some((i, m)) = &own_mask {
        a[*i] = m as *const u64 as u64;
    }
    // pselect6 passes its mask through a { mask pointer, size } pair.
    let pselect = (nr == libc::SYS_pselect6 && a[5] != 0).then(|| {
        // SAFETY: as above.
        let pair = unsafe { std::ptr::read_unaligned(a[5] as *const [u64; 2]) };
        // SAFETY: as above.
        let mask =
            (pair[0] != 0).then(|| unsafe { std::ptr::read_unaligned(pair[0] as *const u64) });
        (pair, mask.map(|m| m & !never_blocked()))
    });
    let pselect_pair = pselect.as_ref().map(|(pair, mask)| {
        let mask = mask.as_ref().map_or(0, |m| m as *const u64 as u64);
        [mask, pair[1]]
    });
    if let Some(pair) = &pselect_pair {
        a[5] = pair.as_ptr() as u64;
    }
    if syscall_args::is_futex_wait(nr, &a) {
        return futex_wait(a, program);
    }
    let mut pins = CallPins::new();
    syscall_args::pin_buffers(nr, &a, &mut pins);
    run(nr, a, program, &mut pins)
}

/// The program at its system call: its signal mask and stack pointer.
#[derive(Clone, Copy)]
struct Program {
    mask: u64,
    sp: u64,
}

/// A futex wait: its word is brought in, not pinned (a wait may last for good, and a pin
/// held that long would keep a slot of the region's table); if aging takes the page out
/// before the kernel reads the word, the wait fails with EFAULT having done nothing, and
/// runs again.
fn futex_wait(a: [u64; 6], program: Program) -> i64 {
    let mut result = 0;
    for _ in 0..8 {
        syscall_args::bring_in_futex_wait(&a);
        result = run(libc::SYS_futex, a, program, &mut CallPins::new());
        let in_region = crate::sigbus::in_region(a[0] as usize, 4)
            || (a[3] != 0 && crate::sigbus::in_region(a[3] as usize, 16));
        if result != -(libc::EFAULT as i64) || !in_region {
            break;
        }
    }
    result
}

/// Runs the program's call with the program's signal mask on the program's stack (so a
/// signal interrupts it as it would have, and its handler runs where it would have) and the
/// selector at block (so the program's handlers are dispatched), then gives the pins back.
fn run(nr: i64, a: [u64; 6], program: Program, pins: &mut CallPins) -> i64 {
    let result = if never_waits(nr) {
        // Nothing for a signal to interrupt: it is delivered when the handler returns.
        raw_syscall(nr, a)
    } else {
        on_program_stack(nr, a, program)
    };
    pins.release();
    result
}

/// Calls that return without waiting on anything a signal could cut short: they run with
/// the handler's signal mask, which saves two mask changes.
fn never_waits(nr: i64) -> bool {
    matches!(
        nr,
        libc::SYS_getpid
            | libc::SYS_getppid
            | libc::SYS_gettid
            | libc::SYS_getuid
            | libc::SYS_geteuid
            | libc::SYS_getgid
            | libc::SYS_getegid
            | libc::SYS_getpgrp
            | libc::SYS_getpgid
            | libc::SYS_getsid
            | libc::SYS_getcwd
            | libc::SYS_getrusage
            | libc::SYS_getrlimit
            | libc::SYS_prlimit64
            | libc::SYS_clock_gettime
            | libc::SYS_clock_getres
            | libc::SYS_gettimeofday
            | libc::SYS_time
            | libc::SYS_times
            | libc::SYS_uname
            | libc::SYS_sysinfo
            | libc::SYS_sched_yield
            | libc::SYS_sched_getaffinity
            | libc::SYS_sched_setaffinity
            | libc::SYS_lseek
            | libc::SYS_fstat
            | libc::SYS_dup
            | libc::SYS_dup2
            | libc::SYS_dup3
            | libc::SYS_pipe
            | libc::SYS_pipe2
            | libc::SYS_eventfd2
            | libc::SYS_epoll_create1
            | libc::SYS_epoll_ctl
            | libc::SYS_mmap
            | libc::SYS_munmap
            | libc::SYS_mprotect
            | libc::SYS_madvise
            | libc::SYS_mremap
            | libc::SYS_brk
            | libc::SYS_kill
            | libc::SYS_tgkill
            | libc::SYS_exit
            | libc::SYS_exit_group
    )
}

/// Runs the program's call through `uswap_sud_call`. A program handler it lets in runs on
/// the program's stack, as without dispatch, not on uswap's alternate stack below this
/// handler: there it had 64 KiB at most, and a process forked in it (PostgreSQL's
/// postmaster forks its helpers in its handlers) lived its whole life there.
fn on_program_stack(nr: i64, a: [u64; 6], program: Program) -> i64 {
    let call = [nr as u64, a[0], a[1], a[2], a[3], a[4], a[5]];
    let masks = [program.mask, program.mask | handler_mask()];
    let here = &call as *const _ as u64;
    let alt = ALT_RANGE.with(|r| r.get());
    let on_alt = |sp: u64| sp > alt.base && sp <= alt.base + alt.size;
    // Room below this frame for the routine's own, then for nested handlers.
    let below = here.saturating_sub(1024);
    let switch = on_alt(here) && !on_alt(program.sp) && below > alt.base;
    let stack = |top: u64| libc::stack_t {
        ss_sp: alt.base as *mut libc::c_void,
        ss_flags: 0,
        ss_size: top.saturating_sub(alt.base) as usize,
    };
    // Windows nest (a program handler's own calls): each gives back the one before.
    let stacks = [stack(below), stack(alt.top)];
    let sp = if switch { program.sp } else { 0 };
    if switch {
        ALT_RANGE.with(|r| r.set(AltRange { top: below, ..alt }));
    }
    set_selector(BLOCK);
    // SAFETY: the routine makes the program's call on the program's stack below its stack
    // pointer (nothing is written there but the frames of handlers the call lets in), and
    // gives the handler's stacks back before it returns; see its comment.
    let result = unsafe { sud::program_call(&call, sp, &masks, &stacks) };
    set_selector(ALLOW);
    ALT_RANGE.with(|r| r.set(alt));
    result
}

fn with_program_mask(program_mask: u64, call: impl FnOnce() -> i64) -> i64 {
    let handler_mask = program_mask | handler_mask();
    set_selector(BLOCK);
    set_mask_raw(libc::SIG_SETMASK, &program_mask, None);
    let result = call();
    set_mask_raw(libc::SIG_SETMASK, &handler_mask, None);
    set_selector(ALLOW);
    result
}

/// `rt_sigprocmask`, applied to the mask the handler returns to.
fn sigprocmask(a: [u64; 6], mask: &mut u64) -> i64 {
    let (how, set, old, size) = (a[0] as i32, a[1] as *const u64, a[2] as *mut u64, a[3]);
    if size != 8 {
        return -(libc::EINVAL as i64);
    }
    // SAFETY: the program's pointers; a bad one faults here as in the C library's wrapper.
    let new = (!set.is_null()).then(|| unsafe { std::ptr::read_unaligned(set) });
    let next = match (how, new) {
        (_, None) => *mask,
        (libc::SIG_BLOCK, Some(n)) => *mask | n,
        (libc::SIG_UNBLOCK, Some(n)) => *mask & !n,
        (libc::SIG_SETMASK, Some(n)) => n,
        _ => return -(libc::EINVAL as i64),
    };
    if !old.is_null() {
        // SAFETY: as above.
        unsafe { std::ptr::write_unaligned(old, *mask) };
    }
    *mask = next & !never_blocked() & !bit(libc::SIGKILL) & !bit(libc::SIGSTOP);
    0
}

/// The SIGSYS action the program set, as it reads it back (handler, flags, mask); never
/// installed (see [`not_ours`]).
static PROGRAM_SIGSYS: [AtomicU64; 3] = [const { AtomicU64::new(0) }; 3];

/// `rt_sigaction`, with SIGSYS and SIGBUS left out of the handler's mask. SIGSYS itself
/// stays uswap's. So does SIGBUS while uswap's handler is installed: the program's action
/// is recorded and gets the SIGBUS signals that are not about a region (a program's crash
/// reporter, say, which would otherwise take uswap's faults for crashes).
fn sigaction(a: [u64; 6]) -> i64 {
    let (sig, act, old) = (
        a[0] as i32,
        a[1] as *const KernelSigaction,
        a[2] as *mut KernelSigaction,
    );
    if a[3] != 8 {
        return -(libc::EINVAL as i64);
    }
    // SAFETY: the program's pointers; a bad one faults here as in the C library's wrapper.
    let new = (!act.is_null()).then(|| unsafe { std::ptr::read_unaligned(act) });
    if sig == libc::SIGSYS {
        let recorded = |a: &AtomicU64| a.load(Relaxed);
        let previous = KernelSigaction {
            handler: recorded(&PROGRAM_SIGSYS[0]),
            flags: recorded(&PROGRAM_SIGSYS[1]),
            restorer: 0,
            mask: recorded(&PROGRAM_SIGSYS[2]),
        };
        if let Some(n) = new {
            for (slot, value) in PROGRAM_SIGSYS.iter().zip([n.handler, n.flags, n.mask]) {
                slot.store(value, Relaxed);
            }
        }
        if !old.is_null() {
            // SAFETY: as above.
            unsafe { std::ptr::write_unaligned(old, previous) };
        }
        return 0;
    }
    if sig == libc::SIGBUS && crate::sigbus::installed() {
        let previous =
            crate::sigbus::program_action(new.map(|n| (n.handler as usize, n.flags, n.mask)));
        if !old.is_null() {
            let (handler, flags, mask) = previous;
            let record = KernelSigaction {
                handler: handler as u64,
                flags,
                restorer: 0,
                mask,
            };
            // SAFETY: as above.
            unsafe { std::ptr::write_unaligned(old, record) };
        }
        return 0;
    }
    let mut a = a;
    let filtered = new.map(|mut n| {
        n.mask &= !never_blocked();
        n
    });
    if let Some(n) = &filtered {
        a[1] = n as *const KernelSigaction as u64;
    }
    raw_syscall(libc::SYS_rt_sigaction, a)
}

thread_local! {
    /// The alternate signal stack the program asked for (disabled until it asks): uswap's
    /// own stays in place, as its handlers need the room, and the program's handlers run
    /// on it too.
    static PROGRAM_ALT_STACK: std::cell::Cell<(u64, i32, u64)> =
        const { std::cell::Cell::new((0, libc::SS_DISABLE, 0)) };
}

/// `sigaltstack`, kept as the program's view. The real call would fail here: this handler
/// runs on the alternate stack, which the kernel will not change while it is in use. The
/// program's stack is not taken as it is either: it lies in region memory (the program's
/// `malloc` or `mmap`), where the kernel could not write a signal frame to a page that is
/// out. When the program asks for a larger stack than the thread's, its handlers need the
/// room: uswap gives the thread one of that size of its own.
fn sigaltstack(a: [u64; 6], program: Program, uc_stack: &mut libc::stack_t) -> i64 {
    let (new, old) = (a[0] as *const libc::stack_t, a[1] as *mut libc::stack_t);
    let (sp, flags, size) = PROGRAM_ALT_STACK.with(|s| s.get());
    if !old.is_null() {
        let record = libc::stack_t {
            ss_sp: sp as *mut libc::c_void,
            ss_flags: flags,
            ss_size: size as usize,
        };
        // SAFETY: the program's pointer, as above.
        unsafe { std::ptr::write_unaligned(old, record) };
    }
    if !new.is_null() {
        // SAFETY: as above.
        let n = unsafe { std::ptr::read_unaligned(new) };
        if n.ss_flags & !libc::SS_DISABLE != 0 {
            return -(libc::EINVAL as i64);
        }
        if n.ss_flags & libc::SS_DISABLE == 0 && n.ss_size < libc::MINSIGSTKSZ {
            return -(libc::ENOMEM as i64);
        }
        PROGRAM_ALT_STACK.with(|s| s.set((n.ss_sp as u64, n.ss_flags, n.ss_size as u64)));
        if n.ss_flags & libc::SS_DISABLE == 0 {
            grow_alternate_stack(n.ss_size, program, uc_stack);
        }
    }
    0
}

/// Gives the thread an alternate stack of `size` bytes of uswap's own when its present one
/// is smaller (see [`sigaltstack`]). Only from a handler that is the only one on the stack:
/// the program was not on it, and no call of the program is under way below this handler
/// (a frame there would go on using the old one). The kernel changes a thread's alternate
/// stack only while the thread is off it, so the change is made by `uswap_sud_call`, on
/// the program's stack, around a call that does nothing; the handler's saved stack
/// (`uc_stack`, which sigreturn restores) says the new one too. The stack it replaces is
/// freed at the next change or when the thread ends.
fn grow_alternate_stack(size: usize, program: Program, uc_stack: &mut libc::stack_t) {
    let alt = ALT_RANGE.with(|r| r.get());
    let on_alt = program.sp > alt.base && program.sp <= alt.base + alt.size;
    let alone = alt.top == alt.base + alt.size;
    if size as u64 <= alt.size || on_alt || !alone || alt.size == 0 || program.sp == 0 {
        return;
    }
    let Ok((own, stack)) = map_alternate_stack(size) else {
        return; // the program's handlers keep the room they had
    };
    let call = [libc::SYS_getpid as u64, 0, 0, 0, 0, 0, 0];
    let blocked = program.mask | handler_mask();
    let (masks, stacks) = ([blocked, blocked], [stack, stack]);
    set_selector(BLOCK);
    // SAFETY: as in `on_program_stack`; the call is getpid, with every signal it could let
    // in blocked.
    unsafe { sud::program_call(&call, program.sp, &masks, &stacks) };
    set_selector(ALLOW);
    *uc_stack = stack;
    ALT_RANGE.with(|r| r.set(AltRange::whole(stack.ss_sp as u64, stack.ss_size as u64)));
    let old = ALT_STACK.with(|s| s.borrow_mut().replace(own));
    // This handler runs on the old one until it returns: freed only at the next change.
    RETIRED_ALT_STACK.with(|r| *r.borrow_mut() = old.map(Retired));
}

const CLONE_ARGS_STACK: usize = 5;
const CLONE_ARGS_STACK_SIZE: usize = 6;

/// `clone` and `clone3`. A child that shares the address space and has a stack of its
/// own starts at the program's next instruction with the program's registers; one that
/// would share this handler's stack (vfork style) gets a copy of the address space
/// instead; any other child (fork style) returns through this handler like the parent.
fn clone(nr: i64, g: &[i64; 23], mut a: [u64; 6], program: Program) -> i64 {
    let mut pins = CallPins::new();
    let mut args = [0u64; 16];
    let (flags, stack) = if nr == libc::SYS_clone {
        (a[0], a[1])
    } else {
        let size = (a[1] as usize).min(std::mem::size_of_val(&args));
        if a[0] == 0 || size < 8 * (CLONE_ARGS_STACK_SIZE + 1) {
            return raw_syscall(nr, a);
        }
        a[1] = size as u64;
        // SAFETY: the program's clone_args, `size` bytes of it.
        unsafe { std::ptr::copy_nonoverlapping(a[0] as *const u8, args.as_mut_ptr().cast(), size) };
        let top = args[CLONE_ARGS_STACK] + args[CLONE_ARGS_STACK_SIZE];
        (args[0], if args[CLONE_ARGS_STACK] == 0 { 0 } else { top })
    };
    let shares_memory = flags & libc::CLONE_VM as u64 != 0;
    let vfork = flags & libc::CLONE_VFORK as u64 != 0;
    let on_own_stack = shares_memory && stack != 0;
    if shares_memory && vfork && stack == 0 {
        let flags = flags & !((libc::CLONE_VM | libc::CLONE_VFORK) as u64);
        if nr == libc::SYS_clone {
            a[0] = flags;
        } else {
            args[0] = flags;
        }
    }
    if on_own_stack {
        let sp = child_returns_to_program(stack, g);
        if nr == libc::SYS_clone {
            a[1] = sp;
        } else {
            args[CLONE_ARGS_STACK_SIZE] -= stack - sp;
        }
        if vfork {
            // The child runs without dispatch until it execs, reading its arguments from
            // the parent's memory: no aging until then.
            pins.hold_off_aging();
        }
    }
    if nr == libc::SYS_clone3 {
        a[0] = args.as_ptr() as u64;
    }
    if !shares_memory {
        // A fork; made without the C library's `fork` (a raw clone), it gets the fork
        // handlers here, or its child would find the regions gone.
        return crate::fork::around_raw_fork(|| run(nr, a, program, &mut pins));
    }
    if !on_own_stack {
        return run(nr, a, program, &mut pins);
    }
    clone_on(nr, a, g, program.mask, &mut pins)
}

/// Writes what the clone routine's child pops below `top`, the top of its stack: the
/// program's rdi and next instruction. Returns the child's stack pointer.
fn child_returns_to_program(top: u64, g: &[i64; 23]) -> u64 {
    let sp = top - 16;
    // SAFETY: the top of the child's stack, which the program handed over (or, for vfork,
    // the free space below the program's own stack pointer).
    unsafe {
        std::ptr::write(sp as *mut u64, g[libc::REG_RDI as usize] as u64);
        std::ptr::write((sp + 8) as *mut u64, g[libc::REG_RIP as usize] as u64);
    }
    sp
}

/// Runs `clone` or `clone3` through the clone routine, the child on a stack prepared by
/// [`child_returns_to_program`].
fn clone_on(nr: i64, a: [u64; 6], g: &[i64; 23], mask: u64, pins: &mut CallPins) -> i64 {
    let r = |reg: libc::c_int| g[reg as usize] as u64;
    let regs: [u64; 13] = [
        nr as u64,
        a[0],
        a[1],
        a[2],
        a[3],
        a[4],
        a[5],
        r(libc::REG_RBX),
        r(libc::REG_RBP),
        r(libc::REG_R12),
        r(libc::REG_R13),
        r(libc::REG_R14),
        r(libc::REG_R15),
    ];
    // SAFETY: the routine loads these registers and makes the call; see its comment.
    let result = with_program_mask(mask, || unsafe { sud::clone_with_registers(&regs) });
    pins.release();
    result
}

/// `vfork`: the child runs on the parent's stack until it execs or exits, which is where
/// this handler runs unless the thread has an alternate signal stack (the child's frames
/// would overwrite the handler's). On one, the child is made as `clone3(CLONE_VM |
/// CLONE_VFORK)` with its stack pointer where the program's was, returning where the
/// program's call would have. Without one, the C library's `fork` makes a copy instead
/// (uswap's fork handlers copy the regions, which costs a write of their data).
fn vfork(g: &[i64; 23], mask: u64) -> i64 {
    if !on_alternate_stack() {
        // SAFETY: fork from the handler; the child returns through it like the parent.
        return match unsafe { libc::fork() } {
            -1 => -(unsafe { *libc::__errno_location() }) as i64,
            pid => pid as i64,
        };
    }
    let program_sp = g[libc::REG_RSP as usize] as u64;
    let sp = child_returns_to_program(program_sp, g);
    let mut args = [0u64; 11];
    args[0] = (libc::CLONE_VM | libc::CLONE_VFORK) as u64;
    args[4] = libc::SIGCHLD as u64;
    args[CLONE_ARGS_STACK] = sp - 16;
    args[CLONE_ARGS_STACK_SIZE] = 16;
    let a = [
        args.as_ptr() as u64,
        std::mem::size_of_val(&args) as u64,
        0,
        0,
        0,
        0,
    ];
    let mut pins = CallPins::new();
    pins.hold_off_aging();
    clone_on(libc::SYS_clone3, a, g, mask, &mut pins)
}

fn on_alternate_stack() -> bool {
    // SAFETY: reading this thread's alternate stack settings.
    unsafe {
        let mut ss: libc::stack_t = std::mem::zeroed();
        libc::sigaltstack(std::ptr::null(), &mut ss) == 0 && ss.ss_flags & libc::SS_ONSTACK != 0
    }
}

/// An alternate signal stack uswap gave a dispatching thread, freed when the thread ends.
struct OwnAltStack {
    base: *mut libc::c_void,
    len: usize,
}

impl Drop for OwnAltStack {
    /// Frees the stack unless the thread is running on it: a thread may end inside a
    /// signal handler that runs there (`exit` in a program handler that interrupted a
    /// dispatched call, or a fork child born in such a handler, as PostgreSQL's helper
    /// processes are). The kernel then refuses to disable it, and the stack stays mapped
    /// for the few instructions the thread has left.
    fn drop(&mut self) {
        if self.len == 0 {
            return; // retired and unmapped already
        }
        // Straight to the kernel, not dispatched: the handler would run on this very stack.
        let off = libc::stack_t {
            ss_sp: std::ptr::null_mut(),
            ss_flags: libc::SS_DISABLE,
            ss_size: 0,
        };
        let disabled = raw_syscall(
            libc::SYS_sigaltstack,
            [&off as *const _ as u64, 0, 0, 0, 0, 0],
        );
        if disabled != 0 {
            return;
        }
        raw_syscall(
            libc::SYS_munmap,
            [self.base as u64, self.len as u64, 0, 0, 0, 0],
        );
    }
}

/// An alternate stack uswap no longer has the kernel use, unmapped when dropped.
struct Retired(OwnAltStack);

impl Drop for Retired {
    fn drop(&mut self) {
        let (base, len) = (self.0.base as u64, self.0.len as u64);
        // Not the kernel's alternate stack any more: unmapped without disabling it.
        self.0.len = 0;
        raw_syscall(libc::SYS_munmap, [base, len, 0, 0, 0, 0]);
    }
}

thread_local! {
    static ALT_STACK: std::cell::RefCell<Option<OwnAltStack>> = const { std::cell::RefCell::new(None) };
    static RETIRED_ALT_STACK: std::cell::RefCell<Option<Retired>> = const { std::cell::RefCell::new(None) };
    static ALT_RANGE: std::cell::Cell<AltRange> =
        const { std::cell::Cell::new(AltRange { base: 0, size: 0, top: 0 }) };
}

/// The alternate stack uswap's handlers run on (uswap's or the program's), and the top the
/// kernel now has for it: lower while a call runs on the program's stack.
#[derive(Clone, Copy)]
struct AltRange {
    base: u64,
    size: u64,
    top: u64,
}

impl AltRange {
    fn whole(base: u64, size: u64) -> AltRange {
        AltRange {
            base,
            size,
            top: base + size,
        }
    }
}

/// Size of the alternate stack uswap gives a thread that has none.
const ALT_STACK_SIZE: usize = 64 << 10;

/// Gives the calling thread an alternate signal stack when it has none or a small one, so
/// that uswap's handlers (the fault path runs in them) run off the program's stack (see
/// [`vfork`]) with room enough.
fn ensure_alternate_stack() -> Result<()> {
    // Straight to the kernel: `uswap run` serves the program's anonymous mmaps from its
    // region, where a signal stack must not be.
    let call = |nr, a: [u64; 6], op: &'static str| match raw_syscall(nr, a) {
        r if r < 0 => Err(Error::Os {
            op,
            source: std::io::Error::from_raw_os_error(-r as i32),
        }),
        r => Ok(r as u64),
    };
    // SAFETY: plain data, filled by the kernel.
    let mut ss: libc::stack_t = unsafe { std::mem::zeroed() };
    call(
        libc::SYS_sigaltstack,
        [0, &mut ss as *mut _ as u64, 0, 0, 0, 0],
        "sigaltstack",
    )?;
    // uswap's own, which a fork child's thread inherits, is kept.
    let sp = ss.ss_sp as usize;
    let ours = ALT_STACK.with(|s| {
        s.borrow()
            .as_ref()
            .is_some_and(|own| (own.base as usize..own.base as usize + own.len).contains(&sp))
    });
    let enabled = ss.ss_flags & libc::SS_DISABLE == 0;
    if enabled && ours {
        ALT_RANGE.with(|r| r.set(AltRange::whole(sp as u64, ss.ss_size as u64)));
        return Ok(());
    }
    // Any other is the program's (Rust's runtime gives each thread a small one; a program
    // whose region is built after it started may have set one in region memory): its
    // view, with room of uswap's own as large for its handlers, as `sigaltstack` gives.
    PROGRAM_ALT_STACK.with(|p| {
        p.set((
            ss.ss_sp as u64,
            ss.ss_flags & libc::SS_DISABLE,
            ss.ss_size as u64,
        ))
    });
    let size = if enabled {
        ss.ss_size.max(ALT_STACK_SIZE)
    } else {
        ALT_STACK_SIZE
    };
    let (own, stack) = map_alternate_stack(size)?;
    call(
        libc::SYS_sigaltstack,
        [&stack as *const _ as u64, 0, 0, 0, 0, 0],
        "sigaltstack",
    )?;
    ALT_STACK.with(|s| *s.borrow_mut() = Some(own));
    ALT_RANGE.with(|r| r.set(AltRange::whole(stack.ss_sp as u64, stack.ss_size as u64)));
    Ok(())
}

/// Maps an alternate stack of `size` bytes (rounded up to pages) with a guard page below
/// it, straight from the kernel: `uswap run` serves the program's anonymous mmaps from its
/// region, where a signal stack must not be. Allocates nothing (a handler may call it).
fn map_alternate_stack(size: usize) -> Result<(OwnAltStack, libc::stack_t)> {
    let call = |nr, a: [u64; 6], op: &'static str| match raw_syscall(nr, a) {
        r if r < 0 => Err(Error::Os {
            op,
            source: std::io::Error::from_raw_os_error(-r as i32),
        }),
        r => Ok(r as u64),
    };
    let size = size.next_multiple_of(crate::PAGE_SIZE);
    let len = size + crate::PAGE_SIZE;
    let rw = (libc::PROT_READ | libc::PROT_WRITE) as u64;
    let flags = (libc::MAP_PRIVATE | libc::MAP_ANONYMOUS | libc::MAP_STACK) as u64;
    let mmap = [0, len as u64, rw, flags, u64::MAX, 0];
    let base = call(libc::SYS_mmap, mmap, "mmap (alternate signal stack)")?;
    let own = OwnAltStack {
        base: base as *mut libc::c_void,
        len,
    };
    // The lowest page guards against overflow.
    let guard = [
        base,
        crate::PAGE_SIZE as u64,
        libc::PROT_NONE as u64,
        0,
        0,
        0,
    ];
    call(
        libc::SYS_mprotect,
        guard,
        "mprotect (alternate signal stack)",
    )?;
    let stack = libc::stack_t {
        ss_sp: (base as usize + crate::PAGE_SIZE) as *mut libc::c_void,
        ss_flags: 0,
        ss_size: size,
    };
    Ok((own, stack))
}
