//! `fork` without `exec`: the child gets its own copy of the program's memory, as the
//! kernel gives a child its parent's (`uswap_core::fork` does the copying), and never finds
//! an allocator lock held by a thread it does not have.
//!
//! uswap's core registers no fork handlers here (`handle_fork_manually`): these handlers
//! call it in the order the locks need.
//! - Before the fork: every heap arena's and slab's lock and the space's book, so that no
//!   allocation changes region memory or the allocators' own state from the moment the
//!   region is copied until the fork; then the core's copy, which allocates from the
//!   internal heap; then the internal heap's lock.
//! - After it, on both sides, the locks go in reverse order and the core finishes: in the
//!   child it builds the region again (or stops the child with a message when it cannot),
//!   and the child gets a control socket of its own.
//!
//! The parent's handlers make their system calls straight to the kernel (`OwnCalls`); the
//! child has no syscall dispatch until its handler turns it on at the end.
//!
//! A fork made with `syscall(SYS_clone, …)` without `CLONE_VM` runs no `pthread_atfork`
//! handlers: the `syscall` exported here runs them around it (a dispatching thread's raw
//! `clone` instruction gets them in the SIGSYS handler, `uswap_core::syscall_dispatch`).

use crate::threads::next;
use crate::{heap, internal, slab, space, sys};
use libc::{c_long, c_void};
use std::sync::atomic::AtomicPtr;
use uswap_core::syscall_dispatch::OwnCalls;

/// Locks held across `fork`, by the forking thread only. Fields drop in order, which lets
/// go of the internal heap before the vectors of slab and arena guards are freed into it.
struct Held {
    _internal: std::sync::MutexGuard<'static, dlmalloc::Dlmalloc<internal::KernelPages>>,
    _book: Option<space::BookGuard>,
    _unbuilt: Option<space::UnbuiltGuard>,
    _slabs: Vec<std::sync::MutexGuard<'static, slab::Slab>>,
    _arenas: Vec<std::sync::MutexGuard<'static, dlmalloc::Dlmalloc<heap::SpaceGranules>>>,
}

static mut HELD: Option<Held> = None;

extern "C" fn prepare() {
    let _inside = internal::Inside::enter();
    let _own = OwnCalls::new();
    // The order every allocation nests in: arena or slab, build lock, book, internal heap.
    let arenas = heap::lock_all();
    let slabs = slab::lock_all();
    let unbuilt = space::get().map(|s| s.lock_unbuilt());
    let book = space::get().map(|s| s.lock_book());
    uswap_core::fork::prepare();
    let internal = internal::heap();
    // SAFETY: only the forking thread touches HELD, between prepare and parent/child.
    unsafe {
        HELD = Some(Held {
            _internal: internal,
            _book: book,
            _unbuilt: unbuilt,
            _slabs: slabs,
            _arenas: arenas,
        })
    };
}

extern "C" fn parent() {
    let _inside = internal::Inside::enter();
    let _own = OwnCalls::new();
    // SAFETY: as in prepare.
    drop(unsafe { (*std::ptr::addr_of_mut!(HELD)).take() });
    uswap_core::fork::parent();
}

extern "C" fn child() {
    let _inside = internal::Inside::enter();
    // SAFETY: as in prepare; the child has this one thread.
    drop(unsafe { (*std::ptr::addr_of_mut!(HELD)).take() });
    uswap_core::fork::child();
    crate::threads::dispatch_in_fork_child();
    crate::child_start();
}

/// Registers the handlers, and has the core leave fork to them; called before the space
/// is made.
pub fn register() {
    // Looked up now: uswap's own system calls come here too, some from signal handlers,
    // where `dlsym` must not run.
    // SAFETY: the slot's function is `syscall` (only its address is taken).
    unsafe { next::<*mut c_void>(&REAL_SYSCALL, c"syscall") };
    uswap_core::fork::handle_fork_manually(uswap_core::fork::ForkHandlers {
        prepare,
        parent,
        child,
    });
    // SAFETY: plain function pointers with C linkage.
    if unsafe { libc::pthread_atfork(Some(prepare), Some(parent), Some(child)) } != 0 {
        sys::warn(
            "uswap: pthread_atfork failed; a child of fork would not get its memory, so \
             fork is not served\n",
        );
    }
}

static REAL_SYSCALL: AtomicPtr<c_void> = AtomicPtr::new(std::ptr::null_mut());

/// `syscall(2)`, the C library's, except that a fork made with it (`SYS_clone` or
/// `SYS_clone3` without `CLONE_VM`) gets the fork handlers around it, as `fork` would.
/// Declared with six fixed arguments: on x86-64 a variadic call passes them in the same
/// registers.
#[no_mangle]
pub unsafe extern "C" fn syscall(
    nr: c_long,
    a1: c_long,
    a2: c_long,
    a3: c_long,
    a4: c_long,
    a5: c_long,
    a6: c_long,
) -> c_long {
    type F = unsafe extern "C" fn(c_long, c_long, c_long, c_long, c_long, c_long, c_long) -> c_long;
    let real = next::<F>(&REAL_SYSCALL, c"syscall");
    let flags = match nr {
        libc::SYS_clone => a1 as u64,
        // SAFETY: the program's clone_args, whose first word is the flags (a bad pointer
        // faults here, where the kernel would return EFAULT).
        libc::SYS_clone3 if a1 != 0 && a2 >= 8 => unsafe {
            std::ptr::read_unaligned(a1 as *const u64)
        },
        libc::SYS_seccomp => {
            // A filter may take away what the region's build needs (`credentials`).
            crate::space::build_region();
            return real(nr, a1, a2, a3, a4, a5, a6);
        }
        _ => return real(nr, a1, a2, a3, a4, a5, a6),
    };
    if flags & libc::CLONE_VM as u64 != 0 {
        // A thread of the program's own making: the region is built while it has one
        // (a `vfork`-style child execs or exits instead).
        if flags & libc::CLONE_VFORK as u64 == 0 {
            crate::space::build_region();
        }
        return real(nr, a1, a2, a3, a4, a5, a6);
    }
    let mut errno = 0;
    let result = uswap_core::fork::around_raw_fork(|| {
        let r = real(nr, a1, a2, a3, a4, a5, a6);
        // SAFETY: this thread's errno, read before the handlers run.
        errno = unsafe { *libc::__errno_location() };
        r
    });
    // SAFETY: this thread's errno, as the call left it.
    unsafe { *libc::__errno_location() = errno };
    result as c_long
}
