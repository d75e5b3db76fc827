//! The program's `malloc`: dlmalloc arenas whose segments are granules of the space, so
//! the heap (glibc's brk heap included, which this replaces) is uswap memory.
//!
//! A thread takes a set of arenas round robin on its first call and keeps it; within the
//! set, each size class has an arena of its own, so small blocks (a hash table's entries
//! and keys, say) are packed together apart from large ones (its values), as jemalloc's
//! and mimalloc's size-segregated slabs keep them: a program's hot small objects then
//! share few pages, which stay in memory while the rest swaps. Once the region is built,
//! blocks above 1 KiB and up to 16 KiB come from the set's slabs instead (`slab`), laid
//! out to cross few pages.
//! `free` goes to the arena or slab owning the block's granule, whichever thread calls it.
//! A call made while the thread runs uswap code, or before the space exists, is served by
//! the internal heap (kernel memory), and `free` sends such blocks back there by address.

use crate::internal::{self, Inside};
use crate::large;
use crate::slab;
use crate::space::{self, Space, GRANULE, NO_ARENA};
use crate::sys;
use dlmalloc::{Allocator, Dlmalloc};
use libc::{c_int, c_void, size_t};
use std::cell::Cell;
use std::sync::atomic::{AtomicUsize, Ordering::Relaxed};
use std::sync::{Mutex, MutexGuard};

/// Sets of arenas, one taken by each thread (with the slabs of the same index).
const ARENA_SETS: usize = slab::SETS;
/// The largest request of each size class but the last, which takes everything up to a
/// large block's threshold.
const CLASS_LIMITS: [usize; 2] = [128, 1024];
const CLASSES: usize = CLASS_LIMITS.len() + 1;
const ARENAS: usize = ARENA_SETS * CLASSES;
// Granule owner bytes: arenas are 1 ..= ARENAS, below the slabs'.
const _: () = assert!(ARENAS < slab::OWNER_BASE as usize);
/// dlmalloc's alignment (two words); memalign is needed only above it.
const MIN_ALIGN: usize = 16;

/// Granules of the space for one arena.
pub struct SpaceGranules {
    arena: u8,
}

// SAFETY: segments are whole granules of the space, zeroed (freshly discarded), owned by
// this arena until given back.
unsafe impl Allocator for SpaceGranules {
    fn alloc(&self, size: usize) -> (*mut u8, usize, u32) {
        let Some(space) = space::get() else {
            return (std::ptr::null_mut(), 0, 0);
        };
        let size = size.next_multiple_of(GRANULE);
        match space.alloc(size, GRANULE) {
            Some(addr) => {
                space.set_owner(addr, size, self.arena + 1);
                (addr as *mut u8, size, 0)
            }
            None => (std::ptr::null_mut(), 0, 0),
        }
    }

    fn remap(&self, _ptr: *mut u8, _old: usize, _new: usize, _can_move: bool) -> *mut u8 {
        std::ptr::null_mut()
    }

    fn free_part(&self, ptr: *mut u8, old: usize, new: usize) -> bool {
        // Only whole granules go back, so the granule table stays exact.
        let cut = ptr as usize + new;
        if !cut.is_multiple_of(GRANULE) {
            return false;
        }
        release(cut, old - new);
        true
    }

    fn free(&self, ptr: *mut u8, size: usize) -> bool {
        release(ptr as usize, size);
        true
    }

    fn can_release_part(&self, _flags: u32) -> bool {
        true
    }

    fn allocates_zeros(&self) -> bool {
        true
    }

    fn page_size(&self) -> usize {
        uswap_core::PAGE_SIZE
    }
}

fn release(addr: usize, len: usize) {
    if let Some(space) = space::get() {
        let _inside = Inside::enter();
        space.release(addr, len);
    }
}

type Arena = Mutex<Dlmalloc<SpaceGranules>>;

static ARENA: [Arena; ARENAS] = {
    let mut arenas =
        [const { Mutex::new(Dlmalloc::new_with_allocator(SpaceGranules { arena: 0 })) }; ARENAS];
    let mut i = 0;
    while i < ARENAS {
        arenas[i] = Mutex::new(Dlmalloc::new_with_allocator(SpaceGranules {
            arena: i as u8,
        }));
        i += 1;
    }
    arenas
};

static NEXT_ARENA: AtomicUsize = AtomicUsize::new(0);

thread_local! {
    static MY_ARENA: Cell<usize> = const { Cell::new(usize::MAX) };
}

fn lock(i: usize) -> MutexGuard<'static, Dlmalloc<SpaceGranules>> {
    ARENA[i].lock().unwrap_or_else(|e| e.into_inner())
}

/// The size class of a request of `size` bytes.
fn class_of(size: usize) -> usize {
    CLASS_LIMITS
        .iter()
        .position(|&limit| size <= limit)
        .unwrap_or(CLASS_LIMITS.len())
}

/// This thread's arena set.
fn my_set() -> usize {
    MY_ARENA.with(|a| {
        if a.get() == usize::MAX {
            a.set(NEXT_ARENA.fetch_add(1, Relaxed) % ARENA_SETS);
        }
        a.get()
    })
}

/// This thread's arena for requests of `size` bytes.
fn my_arena(size: usize) -> usize {
    my_set() * CLASSES + class_of(size)
}

/// The slab class of a request, if a slab serves it: once the region is built (before,
/// nothing swaps, and the arena packs blocks into fewer granules, which a process charges
/// to the tree's limit until then), for alignment up to malloc's own.
fn slab_class(space: &Space, size: usize, align: usize) -> Option<usize> {
    slab::class_of(size).filter(|_| align <= MIN_ALIGN && space.region().is_some())
}

/// Whether a block resized to `size` bytes would now come from a slab.
fn to_a_slab(size: usize) -> bool {
    space::get().is_some_and(|space| slab_class(space, size, MIN_ALIGN).is_some())
}

/// The space, if this call should be served from it.
fn serving() -> Option<&'static Space> {
    space::get().filter(|_| !internal::inside())
}

/// Where a block lives.
enum Owner {
    Arena(usize),
    /// A slab, by its owner byte.
    Slab(u8),
    Large,
    Internal,
    /// Neither: a block of the dynamic loader's early allocator, say. Left alone.
    Foreign,
}

fn owner(ptr: usize) -> Owner {
    if let Some(space) = space::get().filter(|s| s.contains(ptr)) {
        return match space.owner(ptr) {
            NO_ARENA => invalid_free(ptr),
            large::OWNER => Owner::Large,
            s if slab::owns(s) => Owner::Slab(s),
            a => Owner::Arena(a as usize - 1),
        };
    }
    match internal::owns(ptr) {
        true => Owner::Internal,
        false => Owner::Foreign,
    }
}

fn invalid_free(ptr: usize) -> ! {
    let _ = ptr;
    sys::warn("uswap: free() of a pointer into program memory that malloc did not return\n");
    std::process::abort()
}

/// Whether a request goes to a large block of its own.
fn is_large(size: usize, align: usize) -> bool {
    size >= large::THRESHOLD && align <= large::MAX_ALIGN
}

unsafe fn alloc(size: usize, align: usize) -> *mut u8 {
    let align = align.max(MIN_ALIGN);
    let ptr = match serving() {
        Some(space) if is_large(size, align) => large::alloc(space, size, align),
        Some(space) => match slab_class(space, size, align) {
            Some(class) => slab::alloc(space, my_set(), class),
            // An aligned block may take up to its alignment more: it is classed by both.
            None => {
                let footprint = if align > MIN_ALIGN {
                    size + align
                } else {
                    size
                };
                lock(my_arena(footprint)).malloc(size, align)
            }
        },
        None => internal::heap().malloc(size, align),
    };
    if ptr.is_null() {
        sys::set_errno(libc::ENOMEM);
    }
    ptr
}

/// The bytes usable at `ptr`, read from dlmalloc 0.2.14's chunk header: the chunk size
/// (the word before the block, less its three flag bits) minus the chunk's overhead, one
/// word, or two for a chunk mapped on its own (both in-use bits clear).
unsafe fn usable_size(ptr: *mut u8) -> usize {
    let head = *(ptr as *const usize).sub(1);
    let size = head & !7;
    let overhead = if head & 3 == 0 { 16 } else { 8 };
    size - overhead
}

#[no_mangle]
pub unsafe extern "C" fn malloc(size: size_t) -> *mut c_void {
    alloc(size, MIN_ALIGN).cast()
}

#[no_mangle]
pub unsafe extern "C" fn calloc(n: size_t, size: size_t) -> *mut c_void {
    let Some(bytes) = n.checked_mul(size) else {
        sys::set_errno(libc::ENOMEM);
        return std::ptr::null_mut();
    };
    // Large blocks and fresh segments are zero; dlmalloc clears what it reuses, and a slab
    // block is cleared here (it may be one freed before).
    let ptr = match serving() {
        Some(space) if is_large(bytes, MIN_ALIGN) => large::alloc(space, bytes, MIN_ALIGN),
        Some(space) => match slab_class(space, bytes, MIN_ALIGN) {
            Some(class) => zeroed(slab::alloc(space, my_set(), class), class),
            None => lock(my_arena(bytes)).calloc(bytes, MIN_ALIGN),
        },
        None => internal::heap().calloc(bytes, MIN_ALIGN),
    };
    if ptr.is_null() {
        sys::set_errno(libc::ENOMEM);
    }
    ptr.cast()
}

/// A slab block of `class` cleared, all its usable bytes, or null.
unsafe fn zeroed(ptr: *mut u8, class: usize) -> *mut u8 {
    if !ptr.is_null() {
        std::ptr::write_bytes(ptr, 0, slab::SIZES[class]);
    }
    ptr
}

#[no_mangle]
pub unsafe extern "C" fn free(ptr: *mut c_void) {
    if ptr.is_null() {
        return;
    }
    match owner(ptr as usize) {
        Owner::Arena(a) => lock(a).c_free(ptr.cast()),
        Owner::Slab(s) => free_slab(s, ptr.cast()),
        Owner::Large => free_large(ptr.cast()),
        Owner::Internal => internal::heap().c_free(ptr.cast()),
        Owner::Foreign => {}
    }
}

fn free_slab(owner: u8, ptr: *mut u8) {
    let space = space::get().expect("a slab lives in the space");
    slab::free(space, owner, ptr);
}

unsafe fn free_large(ptr: *mut u8) {
    let space = space::get().expect("a large block lives in the space");
    let _inside = Inside::enter();
    large::free(space, ptr);
}

/// Moves a block to a new one of `size` bytes (of whatever kind suits that size).
unsafe fn move_block(ptr: *mut u8, old_usable: usize, size: usize) -> *mut u8 {
    let new = alloc(size, MIN_ALIGN);
    if !new.is_null() {
        std::ptr::copy_nonoverlapping(ptr, new, old_usable.min(size));
        free(ptr.cast());
    }
    new
}

#[no_mangle]
pub unsafe extern "C" fn realloc(ptr: *mut c_void, size: size_t) -> *mut c_void {
    if ptr.is_null() {
        return malloc(size);
    }
    if size == 0 {
        free(ptr);
        return std::ptr::null_mut();
    }
    let ptr = ptr.cast::<u8>();
    let new = match owner(ptr as usize) {
        Owner::Arena(_) if is_large(size, MIN_ALIGN) => move_block(ptr, usable_size(ptr), size),
        // A block that grows or shrinks into another size class moves to its arena or
        // slab; a shrink that cannot move stays where it is, as a shrink never fails.
        Owner::Arena(a) if a % CLASSES != class_of(size) || to_a_slab(size) => {
            match move_block(ptr, usable_size(ptr), size) {
                moved if moved.is_null() && size <= usable_size(ptr) => {
                    lock(a).c_realloc(ptr, size)
                }
                moved => moved,
            }
        }
        Owner::Arena(a) => lock(a).c_realloc(ptr, size),
        Owner::Slab(s) => {
            slab::check_in_use(s, ptr);
            if slab::class_of(size) == Some(slab::class_of_owner(s)) {
                ptr
            } else {
                match move_block(ptr, slab::block_size(s), size) {
                    moved if moved.is_null() && size <= slab::block_size(s) => ptr,
                    moved => moved,
                }
            }
        }
        Owner::Large if size >= large::THRESHOLD => {
            let space = space::get().expect("a large block lives in the space");
            // The guard ends before a move: a block allocated while uswap code runs would
            // come from uswap's own heap, outside the region and the limit.
            let resized = {
                let _inside = Inside::enter();
                large::resize_in_place(space, ptr, size)
            };
            match resized {
                true => ptr,
                false => move_block(ptr, large::usable_size(ptr), size),
            }
        }
        Owner::Large => match move_block(ptr, large::usable_size(ptr), size) {
            moved if moved.is_null() => ptr,
            moved => moved,
        },
        Owner::Internal => internal::heap().c_realloc(ptr, size),
        Owner::Foreign => return std::ptr::null_mut(),
    };
    if new.is_null() {
        sys::set_errno(libc::ENOMEM);
    }
    new.cast()
}

#[no_mangle]
pub unsafe extern "C" fn reallocarray(ptr: *mut c_void, n: size_t, size: size_t) -> *mut c_void {
    match n.checked_mul(size) {
        Some(bytes) => realloc(ptr, bytes),
        None => {
            sys::set_errno(libc::ENOMEM);
            std::ptr::null_mut()
        }
    }
}

#[no_mangle]
pub unsafe extern "C" fn posix_memalign(
    out: *mut *mut c_void,
    align: size_t,
    size: size_t,
) -> c_int {
    if !align.is_power_of_two() || !align.is_multiple_of(std::mem::size_of::<usize>()) {
        return libc::EINVAL;
    }
    let p = alloc(size, align);
    if p.is_null() {
        return libc::ENOMEM;
    }
    *out = p.cast();
    0
}

#[no_mangle]
pub unsafe extern "C" fn aligned_alloc(align: size_t, size: size_t) -> *mut c_void {
    if !align.is_power_of_two() {
        sys::set_errno(libc::EINVAL);
        return std::ptr::null_mut();
    }
    alloc(size, align).cast()
}

#[no_mangle]
pub unsafe extern "C" fn memalign(align: size_t, size: size_t) -> *mut c_void {
    match align.max(1).checked_next_power_of_two() {
        Some(align) => aligned_alloc(align, size),
        None => {
            sys::set_errno(libc::EINVAL);
            std::ptr::null_mut()
        }
    }
}

#[no_mangle]
pub unsafe extern "C" fn valloc(size: size_t) -> *mut c_void {
    alloc(size, uswap_core::PAGE_SIZE).cast()
}

#[no_mangle]
pub unsafe extern "C" fn pvalloc(size: size_t) -> *mut c_void {
    match size.max(1).checked_next_multiple_of(uswap_core::PAGE_SIZE) {
        Some(size) => alloc(size, uswap_core::PAGE_SIZE).cast(),
        None => {
            sys::set_errno(libc::ENOMEM);
            std::ptr::null_mut()
        }
    }
}

#[no_mangle]
pub unsafe extern "C" fn malloc_usable_size(ptr: *mut c_void) -> size_t {
    if ptr.is_null() {
        return 0;
    }
    match owner(ptr as usize) {
        Owner::Large => large::usable_size(ptr.cast()),
        Owner::Slab(s) => slab::block_size(s),
        Owner::Foreign => 0,
        _ => usable_size(ptr.cast()),
    }
}

// glibc's own names for the same functions, which some programs call directly: a block
// from one must be freed by the other.

#[no_mangle]
pub unsafe extern "C" fn __libc_malloc(size: size_t) -> *mut c_void {
    malloc(size)
}

#[no_mangle]
pub unsafe extern "C" fn __libc_calloc(n: size_t, size: size_t) -> *mut c_void {
    calloc(n, size)
}

#[no_mangle]
pub unsafe extern "C" fn __libc_realloc(ptr: *mut c_void, size: size_t) -> *mut c_void {
    realloc(ptr, size)
}

#[no_mangle]
pub unsafe extern "C" fn __libc_free(ptr: *mut c_void) {
    free(ptr)
}

#[no_mangle]
pub unsafe extern "C" fn __libc_memalign(align: size_t, size: size_t) -> *mut c_void {
    memalign(align, size)
}

/// Gives free memory at the top of every arena, and every slab's empty span, back (glibc's
/// `malloc_trim`); 1 if any went.
#[no_mangle]
pub unsafe extern "C" fn malloc_trim(pad: size_t) -> c_int {
    let mut trimmed = false;
    for i in 0..ARENAS {
        let _inside = Inside::enter();
        trimmed |= lock(i).trim(pad);
    }
    if let Some(space) = space::get() {
        trimmed |= slab::trim(space);
    }
    c_int::from(trimmed)
}

/// Takes every arena's lock (before `fork`), so the child finds none held by a thread it
/// does not have. The guards are kept until [`unlock_all`].
pub fn lock_all() -> Vec<MutexGuard<'static, Dlmalloc<SpaceGranules>>> {
    (0..ARENAS).map(lock).collect()
}
