//! Large blocks of the program's heap: each one a range of the space of its own, as glibc
//! serves large requests from mappings of their own. Freed, the range goes back to the
//! space at once; `calloc` needs no clearing (a range handed out reads as zeros), so a
//! large zeroed array costs nothing until it is touched; and `realloc` grows in place when
//! the pages after the block are free.
//!
//! A block starts on a granule boundary with a header (its length and the offset of the
//! pointer handed out); its granules are marked [`OWNER`] in the space's granule table.

use crate::space::{Space, GRANULE};

/// Requests this large or larger are large blocks (glibc's default mmap threshold is
/// 128 KiB, and grows with use; a fixed 256 KiB keeps a block's last granule at most a
/// fifth unused).
pub const THRESHOLD: usize = 256 * 1024;

/// The granule owner of large blocks (arenas are 1 ..= 24).
pub const OWNER: u8 = u8::MAX;

/// The most alignment a large block serves (the pointer must stay in its first granule).
pub const MAX_ALIGN: usize = GRANULE / 4;

#[repr(C)]
struct Header {
    /// Bytes of the range, a multiple of granules.
    len: usize,
    /// Where the pointer handed out starts, from the range's start.
    offset: usize,
}

const HEADER: usize = std::mem::size_of::<Header>();

fn range_len(size: usize, offset: usize) -> Option<usize> {
    size.checked_add(offset)?.checked_next_multiple_of(GRANULE)
}

/// A large block of `size` bytes aligned to `align` (at most [`MAX_ALIGN`]), or null when
/// the space is used up.
pub fn alloc(space: &Space, size: usize, align: usize) -> *mut u8 {
    debug_assert!(align <= MAX_ALIGN);
    let offset = HEADER.max(align);
    let Some(len) = range_len(size, offset) else {
        return std::ptr::null_mut();
    };
    let Some(base) = space.alloc(len, GRANULE) else {
        return std::ptr::null_mut();
    };
    space.set_owner(base, len, OWNER);
    // SAFETY: the range is ours, and the header fits in its first page.
    unsafe { (base as *mut Header).write(Header { len, offset }) };
    (base + offset) as *mut u8
}

/// The header of the block at `ptr`.
///
/// # Safety
/// `ptr` must be a live large block.
unsafe fn header<'a>(ptr: *mut u8) -> &'a mut Header {
    &mut *((ptr as usize & !(GRANULE - 1)) as *mut Header)
}

/// # Safety
/// `ptr` must be a live large block.
pub unsafe fn usable_size(ptr: *mut u8) -> usize {
    let h = header(ptr);
    h.len - h.offset
}

/// # Safety
/// `ptr` must be a live large block; it is gone after.
pub unsafe fn free(space: &Space, ptr: *mut u8) {
    let h = header(ptr);
    let (base, len) = (ptr as usize - h.offset, h.len);
    space.release(base, len);
}

/// Resizes the block at `ptr` where it is: shrinks it (giving whole granules back) or grows
/// it over free pages after it. False when it cannot grow in place.
///
/// # Safety
/// `ptr` must be a live large block.
pub unsafe fn resize_in_place(space: &Space, ptr: *mut u8, size: usize) -> bool {
    let h = header(ptr);
    let base = ptr as usize - h.offset;
    let Some(len) = range_len(size, h.offset) else {
        return false;
    };
    if len < h.len {
        space.release(base + len, h.len - len);
        h.len = len;
    } else if len > h.len {
        if !space.take(base + h.len, len - h.len) {
            return false;
        }
        space.set_owner(base + h.len, len - h.len, OWNER);
        h.len = len;
    }
    true
}
