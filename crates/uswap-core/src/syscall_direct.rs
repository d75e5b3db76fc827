//! Direct system calls: the calls a program makes most, run by the C library's wrappers
//! (as `uswap run`'s preload library exports them) without the trap of syscall dispatch.
//!
//! A dispatching thread's system call costs a SIGSYS round trip (`syscall_dispatch.rs`,
//! about 3.4 µs on the development VM). A wrapper that knows it is about to make a call can
//! do what the handler does without the signal: name the call's buffers
//! (`syscall_args.rs`), pin those in region memory (`gup.rs`), and make the call from the
//! range dispatch always lets through. [`call`] does that when the pins can be had from
//! user space alone (no system call of uswap's own, so nothing runs with the selector at
//! *allow* while the program's signal handlers may run): each pinned page is touched as
//! the kernel will use it (read, or written with an atomic no-op), which serves any fault
//! on it the way a program access is served, then must be active and unlocked in the page
//! table. Otherwise it declines, and the wrapper takes the C library's path, whose call is
//! dispatched and brings the buffers in. A call's result is the kernel's, EFAULT included:
//! it is never made twice.
//!
//! Cancellation: a call that is a cancellation point in the C library runs with
//! asynchronous cancellation on, as the C library's own wrappers do, so `pthread_cancel`
//! of a thread blocked in it unwinds from the system call through this module's frame,
//! which holds nothing to drop: the call's pins live in the thread's [`HELD`] record, and
//! a thread that is unwound gives them back at its exit.
//!
//! uswap's own calls of these functions inside its SIGBUS and SIGSYS handlers are made
//! directly too, and never act on a pending cancellation: the C library's would, and the
//! unwinding would cross the handler's frames.
//!
//! A signal handler that interrupts a direct call and makes one of its own (or a call
//! left by `siglongjmp`, which never gives its pins back) finds the thread's record in
//! use, and its calls are dispatched.

use crate::sigbus::CallPins;
use crate::sud::{dispatching_program_code, in_uswap_handler, raw_syscall};
use crate::syscall_args;
use std::cell::{Cell, UnsafeCell};

/// The pins of this thread's direct call, given back when the call returns, or at the
/// thread's exit when the call was unwound.
struct Held(UnsafeCell<CallPins>);

impl Drop for Held {
    fn drop(&mut self) {
        self.0.get_mut().release();
    }
}

thread_local! {
    static HELD: Held = Held(UnsafeCell::new(CallPins::usable_only()));
    /// A direct call of this thread holds `HELD`.
    static IN_CALL: Cell<bool> = const { Cell::new(false) };
}

const PTHREAD_CANCEL_ASYNCHRONOUS: libc::c_int = 1;

extern "C-unwind" {
    // Unwinds when it turns asynchronous cancellation on with a cancellation pending.
    fn pthread_setcanceltype(kind: libc::c_int, old: *mut libc::c_int) -> libc::c_int;
}

/// Runs system call `nr` with arguments `a` directly, when this thread runs the program's
/// code with syscall dispatch on and the call's buffers in region memory are usable as they
/// stand, or runs one of uswap's signal handlers; `None` when the caller must make the call
/// the ordinary (dispatched) way. A
/// `cancellation_point` call runs with asynchronous cancellation on. Returns the kernel's
/// result (a negative errno on failure).
///
/// `nr` must be a call whose buffers `syscall_args` names exactly and that the SIGSYS
/// handler passes on unchanged (no signal masks, no `clone`, no futex wait).
pub fn call(nr: i64, a: [u64; 6], cancellation_point: bool) -> Option<i64> {
    if in_uswap_handler() {
        // uswap's own call, from its fault path: never a cancellation point.
        return Some(raw_syscall(nr, a));
    }
    if !dispatching_program_code() || IN_CALL.get() {
        return None;
    }
    IN_CALL.set(true);
    // Declined too once the thread's record is gone (calls made at thread or process exit).
    let usable = with_pins(|pins| {
        syscall_args::pin_buffers(nr, &a, pins);
        pins.all_usable()
    })
    .unwrap_or(false);
    let result = usable.then(|| {
        if cancellation_point {
            cancellable(nr, a)
        } else {
            raw_syscall(nr, a)
        }
    });
    with_pins(CallPins::release);
    IN_CALL.set(false);
    result
}

/// Sets up this thread's record now, in the program's code: made the first time it is
/// used, it registers its destructor with the C library, which allocates and takes the
/// loader's lock, as a signal handler interrupting either must not. Called when a thread
/// turns dispatch on.
pub fn prepare_thread() {
    let _ = HELD.try_with(|_| ());
}

/// A child of fork, whose forking thread may have been inside a direct call (a program
/// handler that interrupted one and forked): its pins are the parent's, forgotten here
/// without being given back (the child's regions are new).
pub fn forget_in_child() {
    IN_CALL.set(false);
    with_pins(CallPins::forget);
}

/// `f` on this thread's record; `None` once the record is destroyed.
fn with_pins<T>(f: impl FnOnce(&mut CallPins) -> T) -> Option<T> {
    // SAFETY: the record is this thread's, used only while IN_CALL is set by this call
    // (a nested call declines), and never across the system call itself.
    HELD.try_with(|held| f(unsafe { &mut *held.0.get() })).ok()
}

/// The call with asynchronous cancellation on, as the C library's wrapper makes it.
fn cancellable(nr: i64, a: [u64; 6]) -> i64 {
    let mut old = 0;
    // SAFETY: switching this thread's cancellation type, then back.
    unsafe { pthread_setcanceltype(PTHREAD_CANCEL_ASYNCHRONOUS, &mut old) };
    let result = raw_syscall(nr, a);
    // SAFETY: as above.
    unsafe { pthread_setcanceltype(old, std::ptr::null_mut()) };
    result
}
