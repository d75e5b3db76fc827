//! The compressed tier's storage (the job of mm/zsmalloc.c, done more simply): objects of
//! up to [`MAX_OBJECT_WORDS`] words kept in cells of fixed size classes, each class's cells
//! in chunks of [`CHUNK_BYTES`] mapped straight from the kernel (under `uswap run` the C
//! library's `mmap` is the program's).
//!
//! A cell is given back by clearing one bit of its chunk's bitmap: a free takes no lock and
//! allocates nothing, so the SIGBUS handler may free (a fault that frees its slot). Cells
//! are taken, and chunks added or given back, only by stores (reclaim), under the class's
//! lock, so no two takers race for a bit. Chunks stay mapped while the pool lives: a reader
//! may still be copying a cell another thread has just freed and reused, and learns of it
//! from the slot's location word afterwards (`zswap.rs`). A chunk whose cells are all free
//! gives its memory back to the kernel ([`ZPool::shrink`]) and is mapped again, zero, when
//! its class needs room.
//!
//! A cell's words are atomics, written and read relaxed: the writer's release fence after
//! it takes the cell and the reader's acquire fence before it looks at the location word
//! again make the pair a seqlock.

use crate::lockdep::Rank;
use crate::lockstat::{LockClass, StatMutex};
use crate::sync::{fence, AtomicBool, AtomicPtr, AtomicU32, AtomicU64};
use std::sync::atomic::Ordering::{Acquire, Relaxed, Release};
use std::sync::OnceLock;

/// Bytes of one chunk of cells.
#[cfg(not(loom))]
pub(super) const CHUNK_BYTES: usize = 64 << 10;
#[cfg(loom)]
pub(super) const CHUNK_BYTES: usize = 256;
const CHUNK_WORDS: usize = CHUNK_BYTES / 8;

/// Words of a class-1 cell; class `k` cells hold `k` times this (class 0 holds 2 words:
/// a header and one value, for pages that repeat one word).
const STEP_WORDS: usize = 16;

/// Size classes: 0 (2 words) and 1 to 24 (128 to 3,072 bytes).
pub(super) const CLASSES: usize = 25;

/// The largest object the pool keeps, in words.
pub(super) const MAX_OBJECT_WORDS: usize = (CLASSES - 1) * STEP_WORDS;

/// Bits of a handle that number the cell in its chunk (class 0 has the most cells).
const CELL_BITS: u32 = (CHUNK_WORDS / 2).trailing_zeros();

/// Chunks the pool may have: handles are 32 bits (with 64 KiB chunks, 256 GiB of cells).
#[cfg(not(loom))]
const MAX_CHUNKS: usize = 1 << (32 - CELL_BITS);
#[cfg(loom)]
const MAX_CHUNKS: usize = 8;

/// Chunk pointers per lazily allocated piece of the chunk table.
#[cfg(not(loom))]
const TABLE_PIECE: usize = 1024;
#[cfg(loom)]
const TABLE_PIECE: usize = 4;

const BITMAP_WORDS: usize = (CHUNK_WORDS / 2).div_ceil(64);

/// Where an object lives: chunk number and cell, in 32 bits (the location word keeps it).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(super) struct Handle(pub(super) u32);

impl Handle {
    fn new(chunk: u32, cell: u32) -> Handle {
        Handle((chunk << CELL_BITS) | cell)
    }

    fn chunk(self) -> usize {
        (self.0 >> CELL_BITS) as usize
    }

    fn cell(self) -> usize {
        (self.0 & ((1 << CELL_BITS) - 1)) as usize
    }
}

/// Words of a cell of `class`.
fn class_words(class: usize) -> usize {
    match class {
        0 => 2,
        k => k * STEP_WORDS,
    }
}

/// The smallest class whose cells hold `words`; `None` past [`MAX_OBJECT_WORDS`].
fn class_for(words: usize) -> Option<usize> {
    match words {
        0..=2 => Some(0),
        w if w <= MAX_OBJECT_WORDS => Some(w.div_ceil(STEP_WORDS)),
        _ => None,
    }
}

/// One chunk: its words, which cells are taken, and how many.
struct Chunk {
    class: usize,
    data: ChunkData,
    /// Bit set: cell taken. Bits past the class's cell count stay set.
    bitmap: [AtomicU64; BITMAP_WORDS],
    /// Cells taken.
    live: AtomicU32,
    /// False once its memory went back to the kernel, until its class takes it again.
    resident: AtomicBool,
}

impl Chunk {
    fn cells(&self) -> usize {
        CHUNK_WORDS / class_words(self.class)
    }

    fn word(&self, i: usize) -> &AtomicU64 {
        self.data.word(i)
    }
}

/// A chunk's words: mapped from the kernel (zero until written, given back with
/// `MADV_DONTNEED`); under loom, model atomics.
#[cfg(not(loom))]
struct ChunkData(*mut AtomicU64);

#[cfg(not(loom))]
impl ChunkData {
    fn map() -> Option<ChunkData> {
        use crate::sud::raw_syscall;
        let rw = (libc::PROT_READ | libc::PROT_WRITE) as u64;
        let flags = (libc::MAP_PRIVATE | libc::MAP_ANONYMOUS) as u64;
        let len = CHUNK_BYTES as u64;
        let at = raw_syscall(libc::SYS_mmap, [0, len, rw, flags, u64::MAX, 0]);
        (at >= 0).then_some(ChunkData(at as *mut AtomicU64))
    }

    fn word(&self, i: usize) -> &AtomicU64 {
        assert!(i < CHUNK_WORDS, "word {i} of a chunk of {CHUNK_WORDS}");
        // SAFETY: within the mapping, which lives as long as the chunk; zeroed memory is a
        // valid atomic.
        unsafe { &*self.0.add(i) }
    }

    fn unmap(&self) {
        let (at, len) = (self.0 as u64, CHUNK_BYTES as u64);
        crate::sud::raw_syscall(libc::SYS_munmap, [at, len, 0, 0, 0, 0]);
    }

    /// Gives the memory back; the words read as zero afterwards.
    fn release(&self) {
        let (at, len) = (self.0 as u64, CHUNK_BYTES as u64);
        crate::sud::raw_syscall(
            libc::SYS_madvise,
            [at, len, libc::MADV_DONTNEED as u64, 0, 0, 0],
        );
    }
}

#[cfg(not(loom))]
impl Drop for ChunkData {
    fn drop(&mut self) {
        self.unmap();
    }
}

#[cfg(loom)]
struct ChunkData(Box<[AtomicU64]>);

#[cfg(loom)]
impl ChunkData {
    fn map() -> Option<ChunkData> {
        Some(ChunkData(
            (0..CHUNK_WORDS).map(|_| AtomicU64::new(0)).collect(),
        ))
    }

    fn word(&self, i: usize) -> &AtomicU64 {
        &self.0[i]
    }

    fn release(&self) {
        for w in self.0.iter() {
            w.store(0, Relaxed);
        }
    }

    fn unmap(&self) {}
}

/// The chunks of one class, for takers (under the class's lock).
#[derive(Default)]
struct ClassChunks {
    ids: Vec<u32>,
    /// Index in `ids` of the chunk to look in first.
    hint: usize,
}

/// [`TABLE_PIECE`] chunk pointers (null until the chunk is made).
type Piece = Box<[AtomicPtr<Chunk>]>;

/// Every chunk by number, in pieces allocated as the pool grows (readers find a chunk
/// without a lock).
struct ChunkTable {
    pieces: Box<[OnceLock<Piece>]>,
    count: AtomicU32,
}

impl ChunkTable {
    fn get(&self, id: usize) -> Option<&Chunk> {
        let piece = self.pieces.get(id / TABLE_PIECE)?.get()?;
        let chunk = piece[id % TABLE_PIECE].load(Acquire);
        // SAFETY: a published chunk lives as long as the table (freed in `ZPool::drop`).
        (!chunk.is_null()).then(|| unsafe { &*chunk })
    }

    /// Adds a chunk; its number, or `None` when the table is full.
    fn push(&self, chunk: Box<Chunk>) -> Option<u32> {
        let id = self.count.fetch_add(1, Relaxed) as usize;
        if id >= MAX_CHUNKS {
            self.count.fetch_sub(1, Relaxed);
            return None;
        }
        let piece = self.pieces[id / TABLE_PIECE].get_or_init(|| {
            (0..TABLE_PIECE)
                .map(|_| AtomicPtr::new(std::ptr::null_mut()))
                .collect()
        });
        piece[id % TABLE_PIECE].store(Box::into_raw(chunk), Release);
        Some(id as u32)
    }
}

/// The pool: cells of every class, and the memory they take.
pub(super) struct ZPool {
    table: ChunkTable,
    classes: Box<[StatMutex<ClassChunks>]>,
    /// Chunks holding memory now.
    resident: AtomicU64,
}

// SAFETY: chunks are reached through atomics and freed only when the pool is dropped.
unsafe impl Send for ZPool {}
unsafe impl Sync for ZPool {}

impl ZPool {
    pub(super) fn new() -> ZPool {
        ZPool {
            table: ChunkTable {
                pieces: (0..MAX_CHUNKS.div_ceil(TABLE_PIECE))
                    .map(|_| OnceLock::new())
                    .collect(),
                count: AtomicU32::new(0),
            },
            classes: (0..CLASSES)
                .map(|_| StatMutex::new(Rank::ZpoolClass, ClassChunks::default()))
                .collect(),
            resident: AtomicU64::new(0),
        }
    }

    /// Stores `words` (at most [`MAX_OBJECT_WORDS`]) in a cell of the smallest class that
    /// holds them. `None` when they do not fit or the kernel refused a chunk.
    pub(super) fn store(&self, words: &[u64]) -> Option<Handle> {
        let class = class_for(words.len())?;
        let (chunk, handle) = self.take_cell(class)?;
        // Readers of the cell's previous object must see it changed once they see any of
        // these words (the seqlock's write side).
        fence(Release);
        let first = handle.cell() * class_words(class);
        for (i, &w) in words.iter().enumerate() {
            chunk.word(first + i).store(w, Relaxed);
        }
        Some(handle)
    }

    /// Copies the object at `handle` into `out` (as many words as its cell holds, up to
    /// `out`'s length) and returns how many; `None` for a handle naming no chunk. The words
    /// may be torn by a concurrent free and reuse: the caller checks, after
    /// [`ZPool::read_done`], that the handle is still the slot's.
    pub(super) fn read(&self, handle: Handle, out: &mut [u64]) -> Option<usize> {
        let chunk = self.table.get(handle.chunk())?;
        if handle.cell() >= chunk.cells() {
            return None;
        }
        let words = class_words(chunk.class).min(out.len());
        let first = handle.cell() * class_words(chunk.class);
        for (i, w) in out[..words].iter_mut().enumerate() {
            *w = chunk.word(first + i).load(Relaxed);
        }
        Some(words)
    }

    /// Orders a reader's copies before its second look at the location word.
    pub(super) fn read_done() {
        fence(Acquire);
    }

    /// Gives a cell back. Takes no lock and allocates nothing.
    pub(super) fn free(&self, handle: Handle) {
        let chunk = self
            .table
            .get(handle.chunk())
            .expect("a stored cell's chunk");
        let (word, bit) = (handle.cell() / 64, handle.cell() % 64);
        let before = chunk.bitmap[word].fetch_and(!(1 << bit), Release);
        debug_assert!(before & (1 << bit) != 0, "cell {handle:?} freed twice");
        chunk.live.fetch_sub(1, Release);
    }

    /// Bytes a cell of `handle`'s chunk's class takes.
    pub(super) fn cell_bytes(&self, handle: Handle) -> u64 {
        self.table
            .get(handle.chunk())
            .map_or(0, |c| class_words(c.class) as u64 * 8)
    }

    /// Bytes of memory the pool holds now (its resident chunks).
    pub(super) fn bytes(&self) -> u64 {
        self.resident.load(Relaxed) * CHUNK_BYTES as u64
    }

    /// Gives the memory of every chunk with no cell taken back to the kernel; returns how
    /// many chunks.
    pub(super) fn shrink(&self) -> u64 {
        let mut released = 0;
        for class in self.classes.iter() {
            let chunks = class.lock();
            for &id in &chunks.ids {
                let chunk = self.table.get(id as usize).expect("a class's chunk");
                // Takers hold this lock, and frees only lower `live`: zero stays zero.
                if chunk.resident.load(Relaxed) && chunk.live.load(Acquire) == 0 {
                    chunk.resident.store(false, Relaxed);
                    chunk.data.release();
                    self.resident.fetch_sub(1, Relaxed);
                    released += 1;
                }
            }
        }
        released
    }

    /// In a fork child, for a pool it abandons: unmaps every chunk (the child's copy of
    /// the parent's pool, which the child never reads). The pool must never be used or
    /// dropped after this.
    pub(super) fn unmap_in_child(&self) {
        for id in 0..self.table.count.load(Relaxed) as usize {
            if let Some(chunk) = self.table.get(id) {
                chunk.data.unmap();
            }
        }
    }

    /// The statistics of the classes' locks (`zpool_class`).
    pub(super) fn lockstat(&self) -> LockClass {
        LockClass::sum("zpool_class", self.classes.iter())
    }

    /// A free cell of `class`, now taken: from the chunk last found with room on, then a
    /// chunk given back before, then a new one.
    fn take_cell(&self, class: usize) -> Option<(&Chunk, Handle)> {
        let mut chunks = self.classes[class].lock();
        let n = chunks.ids.len();
        for k in 0..n {
            let at = (chunks.hint + k) % n;
            let id = chunks.ids[at];
            let chunk = self.table.get(id as usize).expect("a class's chunk");
            if !chunk.resident.load(Relaxed) {
                continue;
            }
            if let Some(cell) = take_bit(chunk) {
                chunks.hint = at;
                return Some((chunk, Handle::new(id, cell)));
            }
        }
        let revived = chunks.ids.iter().position(|&id| {
            let chunk = self.table.get(id as usize).expect("a class's chunk");
            !chunk.resident.load(Relaxed)
        });
        let at = match revived {
            Some(at) => {
                let chunk = self
                    .table
                    .get(chunks.ids[at] as usize)
                    .expect("a class's chunk");
                chunk.resident.store(true, Relaxed);
                at
            }
            None => {
                let id = self.table.push(new_chunk(class)?)?;
                chunks.ids.push(id);
                chunks.ids.len() - 1
            }
        };
        self.resident.fetch_add(1, Relaxed);
        chunks.hint = at;
        let id = chunks.ids[at];
        let chunk = self.table.get(id as usize).expect("a class's chunk");
        let cell = take_bit(chunk).expect("an empty chunk has room");
        Some((chunk, Handle::new(id, cell)))
    }
}

impl Drop for ZPool {
    fn drop(&mut self) {
        for id in 0..self.table.count.load(Relaxed) as usize {
            let piece = self.table.pieces[id / TABLE_PIECE].get();
            if let Some(piece) = piece {
                let chunk = piece[id % TABLE_PIECE].load(Relaxed);
                if !chunk.is_null() {
                    // SAFETY: made by `Box::into_raw` in `push`, freed once, here.
                    drop(unsafe { Box::from_raw(chunk) });
                }
            }
        }
    }
}

fn new_chunk(class: usize) -> Option<Box<Chunk>> {
    let chunk = Box::new(Chunk {
        class,
        data: ChunkData::map()?,
        bitmap: std::array::from_fn(|_| AtomicU64::new(0)),
        live: AtomicU32::new(0),
        resident: AtomicBool::new(true),
    });
    // Bits past the last cell stay taken.
    let cells = chunk.cells();
    for (w, word) in chunk.bitmap.iter().enumerate() {
        let valid = cells.saturating_sub(w * 64);
        if valid < 64 {
            word.store(!0u64 << valid, Relaxed);
        }
    }
    Some(chunk)
}

/// Takes a free cell of `chunk`'s; the caller holds the class's lock, so only frees race.
fn take_bit(chunk: &Chunk) -> Option<u32> {
    if chunk.live.load(Relaxed) as usize >= chunk.cells() {
        return None;
    }
    for (w, word) in chunk.bitmap.iter().enumerate() {
        let bits = word.load(Relaxed);
        if bits == !0 {
            continue;
        }
        let bit = (!bits).trailing_zeros();
        let before = word.fetch_or(1 << bit, Acquire);
        debug_assert!(before & (1 << bit) == 0, "only takers set bits");
        chunk.live.fetch_add(1, Relaxed);
        return Some((w * 64) as u32 + bit);
    }
    None
}

#[cfg(all(test, not(loom)))]
mod tests {
    use super::*;

    #[test]
    fn objects_go_to_the_smallest_class_that_holds_them() {
        assert_eq!(class_for(1), Some(0));
        assert_eq!(class_for(2), Some(0));
        assert_eq!(class_for(3), Some(1));
        assert_eq!(class_for(16), Some(1));
        assert_eq!(class_for(17), Some(2));
        assert_eq!(class_for(MAX_OBJECT_WORDS), Some(CLASSES - 1));
        assert_eq!(class_for(MAX_OBJECT_WORDS + 1), None);
    }

    #[test]
    fn stored_objects_read_back_and_freed_cells_are_reused() {
        let pool = ZPool::new();
        let objects: Vec<Vec<u64>> = (1..200u64)
            .map(|n| {
                (0..(n as usize % MAX_OBJECT_WORDS) + 1)
                    .map(|i| n * 1000 + i as u64)
                    .collect()
            })
            .collect();
        let handles: Vec<Handle> = objects.iter().map(|o| pool.store(o).unwrap()).collect();
        for (o, &h) in objects.iter().zip(&handles) {
            let mut out = [0u64; MAX_OBJECT_WORDS];
            let n = pool.read(h, &mut out).unwrap();
            assert!(n >= o.len());
            assert_eq!(&out[..o.len()], &o[..]);
        }
        let bytes = pool.bytes();
        assert!(bytes > 0);
        for &h in &handles {
            pool.free(h);
        }
        let again: Vec<Handle> = objects.iter().map(|o| pool.store(o).unwrap()).collect();
        assert_eq!(
            pool.bytes(),
            bytes,
            "freed cells are taken again before new chunks"
        );
        let mut sorted = again.clone();
        sorted.sort_by_key(|h| h.0);
        sorted.dedup();
        assert_eq!(sorted.len(), again.len(), "no cell handed out twice");
    }

    #[test]
    fn an_emptied_chunk_gives_its_memory_back_and_comes_back_zeroed() {
        let pool = ZPool::new();
        let cells = CHUNK_WORDS / class_words(1);
        let handles: Vec<Handle> = (0..cells as u64 + 1)
            .map(|n| pool.store(&[n; 16]).unwrap())
            .collect();
        assert_eq!(pool.bytes(), 2 * CHUNK_BYTES as u64);
        // Empty the first chunk only.
        for &h in &handles[..cells] {
            pool.free(h);
        }
        assert_eq!(pool.shrink(), 1);
        assert_eq!(pool.bytes(), CHUNK_BYTES as u64);
        let mut out = [0u64; 16];
        pool.read(handles[cells], &mut out).unwrap();
        assert_eq!(out, [cells as u64; 16], "the live chunk keeps its data");
        pool.read(handles[0], &mut out).unwrap();
        assert_eq!(out, [0; 16], "a released chunk reads as zero");
        for _ in 0..cells - 1 {
            pool.store(&[5; 16]).unwrap();
        }
        assert_eq!(
            pool.bytes(),
            CHUNK_BYTES as u64,
            "the live chunk fills first"
        );
        let h = pool.store(&[7; 16]).unwrap();
        assert_eq!(
            pool.bytes(),
            2 * CHUNK_BYTES as u64,
            "the released chunk is taken again"
        );
        pool.read(h, &mut out).unwrap();
        assert_eq!(out, [7; 16]);
    }

    #[test]
    fn cells_past_a_chunks_end_are_never_handed_out() {
        // Class 24's cells (384 words) do not divide a chunk evenly.
        let pool = ZPool::new();
        let cells = CHUNK_WORDS / class_words(24);
        let handles: Vec<Handle> = (0..3 * cells)
            .map(|_| pool.store(&[1; MAX_OBJECT_WORDS]).unwrap())
            .collect();
        assert!(handles.iter().all(|h| h.cell() < cells));
        assert_eq!(pool.bytes(), 3 * CHUNK_BYTES as u64);
    }

    #[test]
    fn stores_and_frees_from_many_threads_never_share_a_cell() {
        let pool = ZPool::new();
        std::thread::scope(|s| {
            for t in 0..4u64 {
                let pool = &pool;
                s.spawn(move || {
                    let mut mine = Vec::new();
                    for n in 0..20_000u64 {
                        let len = 1 + (n as usize * 7 + t as usize) % 40;
                        let v = (t << 32) | n;
                        mine.push((pool.store(&vec![v; len]).unwrap(), v, len));
                        if n % 3 == 0 {
                            let (h, v, len) = mine.swap_remove((n as usize * 13) % mine.len());
                            let mut out = [0u64; 48];
                            pool.read(h, &mut out).unwrap();
                            assert!(out[..len].iter().all(|&w| w == v), "a cell was shared");
                            pool.free(h);
                        }
                    }
                    for (h, v, len) in mine {
                        let mut out = [0u64; 48];
                        pool.read(h, &mut out).unwrap();
                        assert!(out[..len].iter().all(|&w| w == v), "a cell was shared");
                        pool.free(h);
                    }
                });
            }
        });
        assert!(pool.shrink() > 0);
        assert_eq!(pool.bytes(), 0);
    }
}

#[cfg(test)]
impl ZPool {
    /// Test hook: flips a bit of the object's second word (its first after the header).
    pub(super) fn corrupt(&self, handle: Handle) {
        let chunk = self
            .table
            .get(handle.chunk())
            .expect("a stored cell's chunk");
        let second = handle.cell() * class_words(chunk.class) + 1;
        chunk.word(second).fetch_xor(1 << 9, Relaxed);
    }
}
