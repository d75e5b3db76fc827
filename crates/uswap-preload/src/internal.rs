//! uswap's own heap, in kernel memory: never in the region it manages. A fault handler that
//! needed a swapped-out page to allocate would wait for itself.
//!
//! Everything Rust code of this library allocates comes from here (it is the global
//! allocator), and so does `malloc` called by a thread while it runs uswap code: uswap's
//! threads all the time (they are marked when they start), a program thread while it is
//! inside an interposed call, and every thread before the region exists.

use crate::sys;
use dlmalloc::{Allocator, Dlmalloc};
use std::alloc::{GlobalAlloc, Layout};
use std::cell::Cell;
use std::sync::atomic::{AtomicUsize, Ordering::Acquire, Ordering::Release};
use std::sync::{Mutex, MutexGuard};

/// Pages straight from the kernel, with every segment recorded so `free` can tell this
/// heap's blocks from anything else's.
pub struct KernelPages;

/// Segments of the heap, as (start, end); 0 marks an empty entry. A segment is never
/// forgotten once recorded (its range is only reused by this heap), so `owns` errs on the
/// side of yes for a range given back to the kernel.
const SEGMENTS: usize = 4096;
static SEGMENT_START: [AtomicUsize; SEGMENTS] = [const { AtomicUsize::new(0) }; SEGMENTS];
static SEGMENT_END: [AtomicUsize; SEGMENTS] = [const { AtomicUsize::new(0) }; SEGMENTS];
static SEGMENT_COUNT: AtomicUsize = AtomicUsize::new(0);

fn record_segment(start: usize, len: usize) {
    let count = SEGMENT_COUNT.load(Acquire);
    let end = start + len;
    for i in 0..count {
        let (s, e) = (SEGMENT_START[i].load(Acquire), SEGMENT_END[i].load(Acquire));
        if s <= start && end <= e {
            return;
        }
    }
    if count < SEGMENTS {
        SEGMENT_START[count].store(start, Release);
        SEGMENT_END[count].store(end, Release);
        SEGMENT_COUNT.store(count + 1, Release);
    } else {
        sys::warn("uswap: internal heap segment table full; blocks freed by C code leak\n");
    }
}

/// Whether `ptr` lies in a segment of this heap.
pub fn owns(ptr: usize) -> bool {
    let count = SEGMENT_COUNT.load(Acquire);
    (0..count).any(|i| SEGMENT_START[i].load(Acquire) <= ptr && ptr < SEGMENT_END[i].load(Acquire))
}

// SAFETY: segments are fresh private anonymous mappings, page aligned and zeroed.
unsafe impl Allocator for KernelPages {
    fn alloc(&self, size: usize) -> (*mut u8, usize, u32) {
        let flags = libc::MAP_PRIVATE | libc::MAP_ANONYMOUS;
        // SAFETY: a new mapping at an address of the kernel's choice.
        let p = unsafe { sys::mmap(std::ptr::null_mut(), size, PROT_RW, flags, -1, 0) };
        if p == libc::MAP_FAILED {
            return (std::ptr::null_mut(), 0, 0);
        }
        record_segment(p as usize, size);
        (p.cast(), size, 0)
    }

    fn remap(&self, _ptr: *mut u8, _old: usize, _new: usize, _can_move: bool) -> *mut u8 {
        std::ptr::null_mut()
    }

    fn free_part(&self, ptr: *mut u8, old: usize, new: usize) -> bool {
        // SAFETY: the tail of a segment this heap no longer uses.
        unsafe { sys::munmap(ptr.add(new).cast(), old - new) == 0 }
    }

    fn free(&self, ptr: *mut u8, size: usize) -> bool {
        // SAFETY: a whole segment this heap no longer uses.
        unsafe { sys::munmap(ptr.cast(), size) == 0 }
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

const PROT_RW: libc::c_int = libc::PROT_READ | libc::PROT_WRITE;

static HEAP: Mutex<Dlmalloc<KernelPages>> = Mutex::new(Dlmalloc::new_with_allocator(KernelPages));

pub fn heap() -> MutexGuard<'static, Dlmalloc<KernelPages>> {
    HEAP.lock().unwrap_or_else(|e| e.into_inner())
}

struct InternalHeap;

/// Rust allocations this large or larger (a region's page table) are mappings of their own:
/// zeroed by the kernel and touched only where used, where dlmalloc would clear them.
const DIRECT: usize = 1 << 20;

fn is_direct(layout: &Layout) -> bool {
    layout.size() >= DIRECT && layout.align() <= uswap_core::PAGE_SIZE
}

fn map_direct(size: usize) -> *mut u8 {
    let flags = libc::MAP_PRIVATE | libc::MAP_ANONYMOUS;
    // SAFETY: a new mapping at an address of the kernel's choice.
    match unsafe { sys::mmap(std::ptr::null_mut(), size, PROT_RW, flags, -1, 0) } {
        libc::MAP_FAILED => std::ptr::null_mut(),
        p => p.cast(),
    }
}

// SAFETY: dlmalloc honours size and alignment and every call holds the heap's lock; direct
// mappings are page aligned and unmapped with the size they were made with.
unsafe impl GlobalAlloc for InternalHeap {
    unsafe fn alloc(&self, layout: Layout) -> *mut u8 {
        match is_direct(&layout) {
            true => map_direct(layout.size()),
            false => heap().malloc(layout.size(), layout.align()),
        }
    }

    unsafe fn alloc_zeroed(&self, layout: Layout) -> *mut u8 {
        match is_direct(&layout) {
            true => map_direct(layout.size()),
            false => heap().calloc(layout.size(), layout.align()),
        }
    }

    unsafe fn dealloc(&self, ptr: *mut u8, layout: Layout) {
        match is_direct(&layout) {
            true => {
                sys::munmap(ptr.cast(), layout.size());
            }
            false => heap().free(ptr, layout.size(), layout.align()),
        }
    }

    unsafe fn realloc(&self, ptr: *mut u8, layout: Layout, new_size: usize) -> *mut u8 {
        let new_layout = Layout::from_size_align_unchecked(new_size, layout.align());
        match (is_direct(&layout), is_direct(&new_layout)) {
            (false, false) => heap().realloc(ptr, layout.size(), layout.align(), new_size),
            (true, true) => {
                let flags = libc::MREMAP_MAYMOVE;
                match sys::mremap(
                    ptr.cast(),
                    layout.size(),
                    new_size,
                    flags,
                    std::ptr::null_mut(),
                ) {
                    libc::MAP_FAILED => std::ptr::null_mut(),
                    p => p.cast(),
                }
            }
            _ => {
                let new = self.alloc(new_layout);
                if !new.is_null() {
                    std::ptr::copy_nonoverlapping(ptr, new, layout.size().min(new_size));
                    self.dealloc(ptr, layout);
                }
                new
            }
        }
    }
}

#[global_allocator]
static GLOBAL: InternalHeap = InternalHeap;

thread_local! {
    /// Nonzero while this thread runs uswap code; uswap's own threads keep it set.
    static INSIDE: Cell<u32> = const { Cell::new(0) };
}

/// Marks the calling thread as one of uswap's for good (the core's thread start hook).
pub fn mark_uswap_thread() {
    INSIDE.with(|c| c.set(c.get() + 1));
}

/// Whether the calling thread is running uswap code now.
pub fn inside() -> bool {
    INSIDE.with(|c| c.get() != 0)
}

/// While alive, the calling thread counts as running uswap code.
pub struct Inside(());

impl Inside {
    pub fn enter() -> Inside {
        INSIDE.with(|c| c.set(c.get() + 1));
        Inside(())
    }
}

impl Drop for Inside {
    fn drop(&mut self) {
        INSIDE.with(|c| c.set(c.get() - 1));
    }
}
