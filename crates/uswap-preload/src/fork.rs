//! `fork` without `exec`: not supported yet, and loud about it.
//!
//! The region is not inherited (`MADV_DONTFORK`): a child that only calls `exec` (a shell
//! running a command, `system`, `popen`) works, its allocations served by the internal
//! heap until then. A child that touches memory of its parent dies of SIGSEGV with a
//! message saying why, instead of reading zeros where pages were swapped out.
//!
//! Every allocator lock is taken before `fork` and let go after it on both sides, so the
//! child never finds a lock held by a thread it does not have.

use crate::{heap, internal, space, sys};
use std::sync::atomic::{AtomicBool, Ordering::Relaxed};

static IN_CHILD: AtomicBool = AtomicBool::new(false);

/// Whether this process is a child of `fork` that lost its parent's memory.
pub fn in_child() -> bool {
    IN_CHILD.load(Relaxed)
}

/// Locks held across `fork`, by the forking thread only. Fields drop in order, which lets
/// go of the internal heap before the vector of arena guards is freed into it.
struct Held {
    _internal: std::sync::MutexGuard<'static, dlmalloc::Dlmalloc<internal::KernelPages>>,
    _free_list: Option<space::FreeListGuard>,
    _arenas: Vec<std::sync::MutexGuard<'static, dlmalloc::Dlmalloc<heap::SpaceGranules>>>,
}

static mut HELD: Option<Held> = None;

extern "C" fn prepare() {
    // The order every allocation nests in: arena, free list, internal heap.
    let arenas = heap::lock_all();
    let free_list = space::get().map(|s| s.lock_free_list());
    let internal = internal::heap();
    // SAFETY: only the forking thread touches HELD, between prepare and parent/child.
    unsafe {
        HELD = Some(Held {
            _internal: internal,
            _free_list: free_list,
            _arenas: arenas,
        })
    };
}

extern "C" fn parent() {
    // SAFETY: as in prepare.
    drop(unsafe { (*std::ptr::addr_of_mut!(HELD)).take() });
}

extern "C" fn child() {
    IN_CHILD.store(true, Relaxed);
    // SAFETY: as in prepare; the child has this one thread.
    drop(unsafe { (*std::ptr::addr_of_mut!(HELD)).take() });
    install_segv_message();
}

/// Registers the handlers; called once the space exists.
pub fn register() {
    // SAFETY: plain function pointers with C linkage.
    if unsafe { libc::pthread_atfork(Some(prepare), Some(parent), Some(child)) } != 0 {
        sys::warn("uswap: pthread_atfork failed; a child of fork may deadlock in malloc\n");
    }
}

static mut OLD_SEGV: std::mem::MaybeUninit<libc::sigaction> = std::mem::MaybeUninit::uninit();

fn install_segv_message() {
    // SAFETY: installing a handler in a single-threaded child; OLD_SEGV is written once here.
    unsafe {
        let mut act: libc::sigaction = std::mem::zeroed();
        act.sa_sigaction = segv as *const () as usize;
        act.sa_flags = libc::SA_SIGINFO;
        libc::sigemptyset(&mut act.sa_mask);
        libc::sigaction(
            libc::SIGSEGV,
            &act,
            (*std::ptr::addr_of_mut!(OLD_SEGV)).as_mut_ptr(),
        );
    }
}

extern "C" fn segv(_sig: libc::c_int, info: *mut libc::siginfo_t, _ctx: *mut libc::c_void) {
    // SAFETY: the kernel passes a valid siginfo for SIGSEGV.
    let addr = unsafe { (*info).si_addr() } as usize;
    if space::get().is_some_and(|s| s.contains(addr)) {
        sys::warn(
            "uswap: a child of fork() touched memory of its parent, which uswap does not \
             give to children yet (fork without exec is not supported); it is killed \
             rather than let it read wrong data\n",
        );
        // SAFETY: back to the default action; returning re-runs the access and dies.
        unsafe { libc::signal(libc::SIGSEGV, libc::SIG_DFL) };
        return;
    }
    // Not ours: the handler that was there before takes the fault when it comes again.
    // SAFETY: restoring the action saved when ours was installed.
    unsafe {
        libc::sigaction(
            libc::SIGSEGV,
            (*std::ptr::addr_of!(OLD_SEGV)).as_ptr(),
            std::ptr::null_mut(),
        )
    };
}
