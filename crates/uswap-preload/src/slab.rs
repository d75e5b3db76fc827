//! Mid-size blocks of the program's heap (above 1 KiB, up to 16 KiB): each size class cut
//! from spans of its own, as jemalloc cuts its small classes from slabs.
//!
//! Why: a program that reads values of a few KiB at random (a cache, redis) swaps in every
//! page a value touches. dlmalloc lays its blocks back to back with a header word between
//! them, so a 1.5 KiB block crosses a page boundary 37% of the time and a 4,000-byte one
//! almost always; in a span of 1,536-byte blocks one block in four crosses one, and a
//! 2 KiB or 4 KiB block never does. Under the kernel's swap the same program runs on
//! jemalloc (or glibc), so its values cost it fewer page reads than dlmalloc's layout costs
//! it under uswap (redis's GETs of 4,000-byte values read twice the pages). The classes are
//! jemalloc's, four per doubling; a request is rounded up to its class, as there.
//!
//! A span is one granule (64 KiB, aligned), cut into as many blocks as fit from its start:
//! the pattern of page crossings is the same as in jemalloc's slabs, and the tail left
//! over, less than a block, is never touched (at most an eighth of the span, for
//! 14,336-byte blocks; a fiftieth for blocks up to 4 KiB). Which blocks are free is a
//! bitmap kept in uswap's own heap, not in the span, so the program's pages hold only its
//! data. The spans of one class in one arena set (a thread's, see `heap`) are a slab, under
//! a lock of its own. The granules of a span carry its slab's owner byte in the space's
//! granule table, so `free` from any thread finds the slab. Blocks come from the current
//! span, then from the lowest span with free blocks (as jemalloc reuses its lowest slab,
//! which keeps the others emptying). A span whose blocks are all free goes back to the
//! space at once, unless it is the current one (a block allocated and freed in a loop
//! would otherwise map and discard a span each time).
//!
//! A span commits no more of the space than a dlmalloc arena grows by, and a process
//! serves these requests from a dlmalloc arena until its region is built: until then
//! nothing of it swaps, and what it commits is charged to its tree's limit (PostgreSQL's
//! helper processes each committed about 1.5 MB more with spans of up to 448 KiB, and the
//! sorting backend was left 3k pages fewer of a 57k-page limit).

use crate::internal::Inside;
use crate::space::{Space, GRANULE};
use std::collections::{BTreeMap, BTreeSet};
use std::sync::{Mutex, MutexGuard};

/// Arena sets: `heap` gives each thread one, for its dlmalloc arenas and its slabs alike.
pub const SETS: usize = 8;
/// The largest request the dlmalloc arenas keep: larger ones, up to the largest class,
/// are served here.
const LARGEST_ARENA_REQUEST: usize = 1024;
/// The block sizes, smallest first: a request takes the first that holds it.
pub const SIZES: [usize; 16] = [
    1280, 1536, 1792, 2048, 2560, 3072, 3584, 4096, 5120, 6144, 7168, 8192, 10240, 12288, 14336,
    16384,
];
const CLASSES: usize = SIZES.len();
const SLABS: usize = SETS * CLASSES;
/// A slab's owner byte is this plus its index (dlmalloc arenas are 1 ..= 24, large blocks
/// 255).
pub const OWNER_BASE: u8 = 64;
const _: () = assert!(OWNER_BASE as usize + SLABS < u8::MAX as usize);
/// The blocks of a span of `class`.
const fn blocks(class: usize) -> usize {
    GRANULE / SIZES[class]
}

const _: () = {
    let mut c = 0;
    while c < CLASSES {
        assert!(blocks(c) <= 64, "a span's bitmap is one word");
        assert!(
            SIZES[c].is_multiple_of(16),
            "blocks keep malloc's 16-byte alignment"
        );
        c += 1;
    }
};

/// The class of a request of `size` bytes, if it is served here.
pub fn class_of(size: usize) -> Option<usize> {
    if size <= LARGEST_ARENA_REQUEST {
        return None;
    }
    SIZES.iter().position(|&s| size <= s)
}

/// Whether `owner` (a granule's owner byte) is a slab's.
pub fn owns(owner: u8) -> bool {
    (OWNER_BASE..OWNER_BASE + SLABS as u8).contains(&owner)
}

/// The index of the slab with owner byte `owner`.
fn index_of(owner: u8) -> usize {
    debug_assert!(owns(owner));
    usize::from(owner - OWNER_BASE)
}

/// The class of the slab with owner byte `owner`.
pub fn class_of_owner(owner: u8) -> usize {
    index_of(owner) % CLASSES
}

/// The usable bytes of a block of the slab with owner byte `owner`.
pub fn block_size(owner: u8) -> usize {
    SIZES[class_of_owner(owner)]
}

/// Which blocks of one span are free.
struct Span {
    free: u64,
    used: usize,
}

impl Span {
    fn new(blocks: usize) -> Span {
        let free = if blocks == 64 {
            u64::MAX
        } else {
            (1 << blocks) - 1
        };
        Span { free, used: 0 }
    }

    /// Takes the lowest free block.
    fn take(&mut self) -> Option<usize> {
        if self.free == 0 {
            return None;
        }
        let b = self.free.trailing_zeros() as usize;
        self.free &= !(1 << b);
        self.used += 1;
        Some(b)
    }

    fn in_use(&self, b: usize) -> bool {
        self.free & (1 << b) == 0
    }

    /// Gives block `b`, in use, back.
    fn give(&mut self, b: usize) {
        debug_assert!(self.in_use(b));
        self.free |= 1 << b;
        self.used -= 1;
    }

    fn full(&self) -> bool {
        self.free == 0
    }
}

/// The spans of one class in one arena set.
pub struct Slab {
    /// Every span, by its granule's first byte.
    spans: BTreeMap<usize, Span>,
    /// The span blocks come from (0: none yet).
    current: usize,
    /// Spans other than the current one that have free blocks: a span joins when a free
    /// finds it full, and leaves when it becomes the current one or goes back.
    partial: BTreeSet<usize>,
}

static SLAB: [Mutex<Slab>; SLABS] = [const {
    Mutex::new(Slab {
        spans: BTreeMap::new(),
        current: 0,
        partial: BTreeSet::new(),
    })
}; SLABS];

fn lock(index: usize) -> MutexGuard<'static, Slab> {
    SLAB[index].lock().unwrap_or_else(|e| e.into_inner())
}

/// Takes every slab's lock (before `fork`, after the arenas'), so the child finds none held
/// by a thread it does not have.
pub fn lock_all() -> Vec<MutexGuard<'static, Slab>> {
    (0..SLABS).map(lock).collect()
}

/// A block of class `class` from arena set `set`, or null when the space is used up.
pub fn alloc(space: &Space, set: usize, class: usize) -> *mut u8 {
    let index = set * CLASSES + class;
    let size = SIZES[class];
    let mut slab = lock(index);
    let slab = &mut *slab;
    loop {
        if let Some(span) = slab.spans.get_mut(&slab.current) {
            if let Some(b) = span.take() {
                return (slab.current + b * size) as *mut u8;
            }
        }
        match slab.partial.pop_first() {
            Some(start) => slab.current = start,
            None => {
                let Some(start) = space.alloc(GRANULE, GRANULE) else {
                    return std::ptr::null_mut();
                };
                space.set_owner(start, GRANULE, OWNER_BASE + index as u8);
                slab.spans.insert(start, Span::new(blocks(class)));
                slab.current = start;
            }
        }
    }
}

/// Frees the block at `ptr`, in a granule marked with slab owner byte `owner`; aborts
/// with a message if `ptr` is not a block in use.
pub fn free(space: &Space, owner: u8, ptr: *mut u8) {
    let class = class_of_owner(owner);
    let mut slab = lock(index_of(owner));
    let (start, span) = block_in_use(&mut slab, class, ptr);
    let was_full = span.full();
    span.give((ptr as usize - start) / SIZES[class]);
    let empty = span.used == 0;
    if start == slab.current {
        return;
    }
    if empty {
        slab.spans.remove(&start);
        slab.partial.remove(&start);
        drop(slab);
        // A stray free of the span's blocks finds it gone (its granules keep the owner
        // byte until the space takes them back) and aborts.
        release(space, start);
    } else if was_full {
        slab.partial.insert(start);
    }
}

/// Aborts with a message unless `ptr`, in a granule marked with slab owner byte `owner`,
/// is a block in use (`realloc` checks what `free` would).
pub fn check_in_use(owner: u8, ptr: *mut u8) {
    block_in_use(&mut lock(index_of(owner)), class_of_owner(owner), ptr);
}

/// The span holding the block in use at `ptr` (its start and bitmap); aborts otherwise.
fn block_in_use(slab: &mut Slab, class: usize, ptr: *mut u8) -> (usize, &mut Span) {
    let start = ptr as usize & !(GRANULE - 1);
    let Some(span) = slab.spans.get_mut(&start) else {
        invalid("uswap: free() or realloc() of a pointer into a slab that malloc did not return\n");
    };
    let offset = ptr as usize - start;
    if !offset.is_multiple_of(SIZES[class]) || offset / SIZES[class] >= blocks(class) {
        invalid("uswap: free() or realloc() of a pointer that is not a block's start\n");
    }
    if !span.in_use(offset / SIZES[class]) {
        invalid("uswap: free() or realloc() of a block already freed\n");
    }
    (start, span)
}

/// Gives the current spans whose blocks are all free back to the space
/// (`malloc_trim`); true if any went.
pub fn trim(space: &Space) -> bool {
    let mut trimmed = false;
    for index in 0..SLABS {
        let mut slab = lock(index);
        let current = slab.current;
        if slab.spans.get(&current).is_some_and(|span| span.used == 0) {
            slab.spans.remove(&current);
            slab.current = 0;
            drop(slab);
            release(space, current);
            trimmed = true;
        }
    }
    trimmed
}

fn release(space: &Space, start: usize) {
    let _inside = Inside::enter();
    space.release(start, GRANULE);
}

fn invalid(message: &str) -> ! {
    crate::sys::warn(message);
    std::process::abort()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_request_takes_the_smallest_class_that_holds_it() {
        assert_eq!(class_of(1024), None);
        assert_eq!(class_of(1025), Some(0));
        assert_eq!(class_of(1280), Some(0));
        assert_eq!(class_of(1281), Some(1));
        assert_eq!(class_of(1506), Some(1));
        assert_eq!(class_of(4000), Some(7));
        assert_eq!(class_of(16384), Some(CLASSES - 1));
        assert_eq!(class_of(16385), None);
    }

    #[test]
    fn power_of_two_blocks_never_cross_a_page_and_mid_sizes_rarely() {
        let page = uswap_core::PAGE_SIZE;
        let crossings = |class: usize| {
            let size = SIZES[class];
            let crossing =
                (0..blocks(class)).filter(|b| (b * size) / page != (b * size + size - 1) / page);
            crossing.count() as f64 / blocks(class) as f64
        };
        assert_eq!(crossings(class_of(2048).unwrap()), 0.0);
        assert_eq!(crossings(class_of(4096).unwrap()), 0.0);
        // Two in eight, and the granule's 42 blocks end part way through the pattern.
        let mid = crossings(class_of(1536).unwrap());
        assert!((0.23..=0.27).contains(&mid), "{mid}");
    }

    #[test]
    fn a_span_wastes_at_most_an_eighth_of_its_granule() {
        for (class, size) in SIZES.iter().enumerate() {
            let tail = GRANULE - blocks(class) * size;
            assert!(tail * 8 <= GRANULE, "{size}: {tail}");
        }
    }

    #[test]
    fn a_span_hands_out_each_block_once_and_takes_each_back_once() {
        for class in 0..CLASSES {
            let blocks = blocks(class);
            let mut span = Span::new(blocks);
            let taken: Vec<usize> = std::iter::from_fn(|| span.take()).collect();
            assert_eq!(taken, (0..blocks).collect::<Vec<_>>(), "lowest first");
            assert!(span.full());
            assert_eq!(span.used, blocks);
            span.give(blocks / 2);
            assert!(!span.in_use(blocks / 2), "a freed block is seen free");
            assert!(!span.full());
            assert_eq!(span.take(), Some(blocks / 2));
            for b in 0..blocks {
                assert!(span.in_use(b));
                span.give(b);
            }
            assert_eq!(span.used, 0);
            assert!((0..blocks).all(|b| !span.in_use(b)));
        }
    }
}
