//! The program's private anonymous mappings, served from the space: `mmap`, `munmap`,
//! `mremap` and `mprotect` as exported here, and `madvise` before the region is built. Read-write mappings are committed memory;
//! `PROT_NONE` ones are reservations, committed later in place by `mmap(MAP_FIXED)` or
//! `mprotect` and uncommitted the same ways, as the JVM, V8 and Go manage their heaps.
//! File mappings, shared mappings, stacks, mappings made executable or read-only from the
//! start, and every mapping made while uswap code runs go to the kernel unchanged.

use crate::book::Use;
use crate::internal::{self, Inside};
use crate::space::{self, Space, NO_ARENA};
use crate::sys;
use libc::{c_int, c_void, off_t, size_t};
use std::sync::atomic::{AtomicBool, Ordering::Relaxed};
use uswap_core::PAGE_SIZE;

const PROT_RW: c_int = libc::PROT_READ | libc::PROT_WRITE;

/// Flags that keep a mapping with the kernel even when it is private and anonymous.
const KERNEL_ONLY: c_int =
    libc::MAP_GROWSDOWN | libc::MAP_STACK | libc::MAP_HUGETLB | libc::MAP_32BIT | libc::MAP_LOCKED;

/// The mapping-type field of the flags (`MAP_SHARED`, `MAP_PRIVATE`, `MAP_SHARED_VALIDATE`,
/// which has both bits set).
const MAP_TYPE: c_int = 0x0f;

fn space() -> Option<&'static Space> {
    space::get().filter(|_| !internal::inside())
}

fn fail<T>(errno: c_int, value: T) -> T {
    sys::set_errno(errno);
    value
}

fn page_round(len: size_t) -> Option<size_t> {
    len.checked_next_multiple_of(PAGE_SIZE)
}

#[no_mangle]
pub unsafe extern "C" fn mmap(
    addr: *mut c_void,
    len: size_t,
    prot: c_int,
    flags: c_int,
    fd: c_int,
    off: off_t,
) -> *mut c_void {
    let anon = flags & libc::MAP_ANONYMOUS != 0
        && flags & MAP_TYPE == libc::MAP_PRIVATE
        && flags & KERNEL_ONLY == 0
        && len > 0;
    let fixed = flags & (libc::MAP_FIXED | libc::MAP_FIXED_NOREPLACE) != 0;
    let Some(space) = space() else {
        return sys::mmap(addr, len, prot, flags, fd, off);
    };
    if fixed && space.overlaps(addr as usize, len) {
        return map_fixed_inside(space, (addr, len, prot, flags, fd, off), anon);
    }
    if !anon || fixed || (prot != PROT_RW && prot != libc::PROT_NONE) {
        return sys::mmap(addr, len, prot, flags, fd, off);
    }
    let Some(len) = page_round(len) else {
        return fail(libc::ENOMEM, libc::MAP_FAILED);
    };
    let _inside = Inside::enter();
    if prot == libc::PROT_NONE {
        return match space.reserve(len) {
            Some(at) => at as *mut c_void,
            None => {
                warn_reservation_outside(len);
                sys::mmap(addr, len, prot, flags, fd, off)
            }
        };
    }
    match space.alloc(len, PAGE_SIZE) {
        Some(at) => at as *mut c_void,
        None => fail(libc::ENOMEM, libc::MAP_FAILED),
    }
}

/// Says once that a reservation went to the kernel, and what that means.
fn warn_reservation_outside(len: usize) {
    static SAID: AtomicBool = AtomicBool::new(false);
    if !SAID.swap(true, Relaxed) {
        sys::warn(&format!(
            "uswap: a reservation of {} MiB (PROT_NONE) did not fit in the address space \
             uswap keeps for the program; what the program commits in it is the kernel's \
             memory, outside the limit. Rerun with a larger --address-space.\n",
            len >> 20
        ));
    }
}

/// A fixed mapping over the space, on a range of the program's (not the malloc heap). A
/// private anonymous one is that memory made zero again, and the program's: committed
/// when accessible (a runtime committing part of its reserved heap), reserved when
/// `PROT_NONE` (uncommitting it), with the protection asked for. Any other kind is lent
/// to the kernel.
unsafe fn map_fixed_inside(
    space: &Space,
    (addr, len, prot, flags, fd, off): (*mut c_void, size_t, c_int, c_int, c_int, off_t),
    anon: bool,
) -> *mut c_void {
    let start = addr as usize;
    let Some(len) = page_round(len) else {
        return fail(libc::ENOMEM, libc::MAP_FAILED);
    };
    if flags & libc::MAP_FIXED_NOREPLACE != 0 {
        return fail(libc::EEXIST, libc::MAP_FAILED);
    }
    if !start.is_multiple_of(PAGE_SIZE) || !space.holds(start, len) || holds_heap(space, start, len)
    {
        sys::warn(
            "uswap: refused a fixed mapping over memory uswap manages that mmap did not \
             return (the malloc heap, or a range not page aligned)\n",
        );
        return fail(libc::EINVAL, libc::MAP_FAILED);
    }
    let _inside = Inside::enter();
    if !anon || !space.lent_in(start, len).is_empty() {
        // A file or shared mapping over the program's own range (the JVM maps its class
        // data archive into its reservation): the kernel's from now on. uswap hears of
        // the pages it replaces as unmapped (userfaultfd) and lets them go.
        let got = sys::mmap(addr, len, prot, flags, fd, off);
        if got != libc::MAP_FAILED {
            space.lend(start, len);
        }
        return got;
    }
    if !space.zero(start, len) {
        return fail(libc::ENOMEM, libc::MAP_FAILED);
    }
    // Over pages that were free too (mapped again where it unmapped before): they are its.
    if !space.claim(start, len, use_of(prot)) {
        return fail(libc::ENOMEM, libc::MAP_FAILED);
    }
    if prot != PROT_RW && sys::mprotect(addr, len, prot) != 0 {
        return libc::MAP_FAILED;
    }
    addr
}

/// What a protection makes of the space's pages.
fn use_of(prot: c_int) -> Use {
    match prot & (libc::PROT_READ | libc::PROT_WRITE | libc::PROT_EXEC) {
        libc::PROT_NONE => Use::Reserved,
        _ => Use::Committed,
    }
}

/// `mprotect(2)`. Over the program's mappings in the space, making pages accessible
/// commits them (within the commit limit, or ENOMEM as the kernel's strict overcommit
/// says), making them inaccessible uncommits them. The heap's pages stay committed.
/// Pages made other than read-write stay uswap memory, resident and never swapped out
/// (reclaim cannot move them).
#[no_mangle]
pub unsafe extern "C" fn mprotect(addr: *mut c_void, len: size_t, prot: c_int) -> c_int {
    let start = addr as usize;
    let Some(space) = space().filter(|s| s.overlaps(start, len)) else {
        return sys::mprotect(addr, len, prot);
    };
    let Some(len) = page_round(len).filter(|&l| l > 0) else {
        return sys::mprotect(addr, len, prot);
    };
    if !start.is_multiple_of(PAGE_SIZE) {
        return fail(libc::EINVAL, -1);
    }
    // The book allocates under its lock: from uswap's own heap.
    let _inside = Inside::enter();
    let accounted = space.holds(start, len)
        && !holds_heap(space, start, len)
        && space.lent_in(start, len).is_empty();
    if accounted && space.protect(start, len, use_of(prot)).is_err() {
        return fail(libc::ENOMEM, -1);
    }
    sys::mprotect(addr, len, prot)
}

/// `madvise(2)`. Before the program's region is built, `MADV_FREE` over the program's
/// pages in the space (none of them lent) is `MADV_DONTNEED`, which it may always be: the build would take a lazily freed page for
/// an ordinary one, which the kernel could then drop with nobody told. Everything else
/// goes to the kernel unchanged (a built region hears of discards from it).
#[no_mangle]
pub unsafe extern "C" fn madvise(addr: *mut c_void, len: size_t, advice: c_int) -> c_int {
    let start = addr as usize;
    let unbuilt = |s: &Space| {
        // The book allocates under its lock: from uswap's own heap.
        let _inside = Inside::enter();
        s.region().is_none() && s.holds(start, len) && s.lent_in(start, len).is_empty()
    };
    let advice = match space() {
        Some(s) if advice == libc::MADV_FREE && unbuilt(s) => libc::MADV_DONTNEED,
        _ => advice,
    };
    sys::madvise(addr, len, advice)
}

#[no_mangle]
pub unsafe extern "C" fn mmap64(
    addr: *mut c_void,
    len: size_t,
    prot: c_int,
    flags: c_int,
    fd: c_int,
    off: off_t,
) -> *mut c_void {
    mmap(addr, len, prot, flags, fd, off)
}

#[no_mangle]
pub unsafe extern "C" fn munmap(addr: *mut c_void, len: size_t) -> c_int {
    let start = addr as usize;
    let Some(space) = space().filter(|s| s.overlaps(start, len)) else {
        return sys::munmap(addr, len);
    };
    let Some(len) = page_round(len).filter(|&l| l > 0) else {
        return fail(libc::EINVAL, -1);
    };
    if !start.is_multiple_of(PAGE_SIZE) || !space.holds(start, len) || holds_heap(space, start, len)
    {
        sys::warn("uswap: refused munmap() of memory uswap manages that mmap did not return\n");
        return fail(libc::EINVAL, -1);
    }
    let _inside = Inside::enter();
    let mut at = start;
    for (lent, n) in space
        .lent_in(start, len)
        .into_iter()
        .chain([(start + len, 0)])
    {
        if lent > at {
            space.release(at, lent - at);
        }
        if n > 0 && !hold_lent(lent, n) {
            return -1;
        }
        at = lent + n;
    }
    0
}

/// Unmaps a range lent to the kernel, keeping its addresses with an inaccessible
/// placeholder: they are inside uswap's range, where the kernel must not put the
/// program's next mapping.
unsafe fn hold_lent(addr: usize, len: usize) -> bool {
    let flags = libc::MAP_PRIVATE | libc::MAP_ANONYMOUS | libc::MAP_FIXED | libc::MAP_NORESERVE;
    sys::mmap(addr as *mut c_void, len, libc::PROT_NONE, flags, -1, 0) != libc::MAP_FAILED
}

/// Whether any granule of `[start, start + len)` belongs to the malloc heap.
fn holds_heap(space: &Space, start: usize, len: usize) -> bool {
    (start..start + len)
        .step_by(PAGE_SIZE)
        .any(|a| space.owner(a) != NO_ARENA)
}

/// `mremap(2)`. Declared with its optional fifth argument as a plain one: on x86-64 and
/// aarch64 Linux a variadic pointer argument is passed where a fixed one is.
#[no_mangle]
pub unsafe extern "C" fn mremap(
    old: *mut c_void,
    old_len: size_t,
    new_len: size_t,
    flags: c_int,
    new_addr: *mut c_void,
) -> *mut c_void {
    let start = old as usize;
    let fixed = flags & libc::MREMAP_FIXED != 0;
    let Some(space) = space().filter(|s| s.overlaps(start, old_len)) else {
        if fixed && space().is_some_and(|s| s.overlaps(new_addr as usize, new_len)) {
            sys::warn("uswap: refused an mremap() onto memory uswap manages\n");
            return fail(libc::EINVAL, libc::MAP_FAILED);
        }
        let target = if fixed {
            new_addr
        } else {
            std::ptr::null_mut()
        };
        return sys::mremap(old, old_len, new_len, flags, target);
    };
    let (Some(old_len), Some(new_len)) = (page_round(old_len), page_round(new_len)) else {
        return fail(libc::EINVAL, libc::MAP_FAILED);
    };
    // The book allocates under its lock: from uswap's own heap.
    let _inside = Inside::enter();
    if !start.is_multiple_of(PAGE_SIZE)
        || old_len == 0
        || new_len == 0
        || !space.holds(start, old_len)
        || holds_heap(space, start, old_len)
        || space.any_reserved(start, old_len)
        || !space.lent_in(start, old_len).is_empty()
        || flags & (libc::MREMAP_FIXED | libc::MREMAP_DONTUNMAP) != 0
    {
        sys::warn("uswap: refused an mremap() of memory uswap manages that it cannot do\n");
        return fail(libc::EINVAL, libc::MAP_FAILED);
    }
    if new_len <= old_len {
        if new_len < old_len {
            space.release(start + new_len, old_len - new_len);
        }
        return old;
    }
    if space.holds(start, new_len) && space.take(start + old_len, new_len - old_len) {
        return old;
    }
    if flags & libc::MREMAP_MAYMOVE == 0 {
        return fail(libc::ENOMEM, libc::MAP_FAILED);
    }
    let Some(to) = space.alloc(new_len, PAGE_SIZE) else {
        return fail(libc::ENOMEM, libc::MAP_FAILED);
    };
    // Copied through memory: pages out on swap come back on the way.
    std::ptr::copy_nonoverlapping(old as *const u8, to as *mut u8, old_len);
    space.release(start, old_len);
    to as *mut c_void
}
