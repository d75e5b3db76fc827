//! `fork` without `exec`: the child gets its own copy of the program's memory, as the
//! kernel gives a child its parent's (`uswap_core::fork` does the copying), and never finds
//! an allocator lock held by a thread it does not have.
//!
//! uswap's core registers no fork handlers here (`handle_fork_manually`): these handlers
//! call it in the order the locks need.
//! - Before the fork: every heap arena's lock and the space's book, so that no
//!   allocation changes region memory or the allocators' own state from the moment the
//!   region is copied until the fork; then the core's copy, which allocates from the
//!   internal heap; then the internal heap's lock.
//! - After it, on both sides, the locks go in reverse order and the core finishes: in the
//!   child it builds the region again (or stops the child with a message when it cannot),
//!   and the child gets a control socket of its own.

use crate::{heap, internal, space, sys};

/// Locks held across `fork`, by the forking thread only. Fields drop in order, which lets
/// go of the internal heap before the vector of arena guards is freed into it.
struct Held {
    _internal: std::sync::MutexGuard<'static, dlmalloc::Dlmalloc<internal::KernelPages>>,
    _book: Option<space::BookGuard>,
    _arenas: Vec<std::sync::MutexGuard<'static, dlmalloc::Dlmalloc<heap::SpaceGranules>>>,
}

static mut HELD: Option<Held> = None;

extern "C" fn prepare() {
    let _inside = internal::Inside::enter();
    // The order every allocation nests in: arena, book, internal heap.
    let arenas = heap::lock_all();
    let book = space::get().map(|s| s.lock_book());
    uswap_core::fork::prepare();
    let internal = internal::heap();
    // SAFETY: only the forking thread touches HELD, between prepare and parent/child.
    unsafe {
        HELD = Some(Held {
            _internal: internal,
            _book: book,
            _arenas: arenas,
        })
    };
}

extern "C" fn parent() {
    let _inside = internal::Inside::enter();
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
    crate::child_control();
}

/// Registers the handlers, and has the core leave fork to them; called before the space
/// is made.
pub fn register() {
    uswap_core::fork::handle_fork_manually();
    // SAFETY: plain function pointers with C linkage.
    if unsafe { libc::pthread_atfork(Some(prepare), Some(parent), Some(child)) } != 0 {
        sys::warn(
            "uswap: pthread_atfork failed; a child of fork would not get its memory, so \
             fork is not served\n",
        );
    }
}
