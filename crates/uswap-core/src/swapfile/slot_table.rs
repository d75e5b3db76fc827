//! A table of one word per swap slot, allocated in pieces as slots are first used (the
//! device's guards and owners, and the compressed tier's locations).

use super::cluster::SlotId;
use crate::sync::AtomicU64;
use crate::PAGE_SIZE;
use std::sync::atomic::Ordering;
use std::sync::OnceLock;

/// Slots per lazily allocated piece of a [`SlotTable`] (1 GiB of swap, a 2 MiB piece). A
/// piece is allocated zeroed, so its memory is the kernel's until its words are written;
/// large pieces keep the table of pieces small for a device as large as a file system's
/// free space, which every process under `uswap run` makes.
#[cfg(not(loom))]
pub(super) const TABLE_CHUNK: u64 = (1 << 30) / PAGE_SIZE as u64;
#[cfg(loom)]
pub(super) const TABLE_CHUNK: u64 = 4;

/// One word per slot, allocated in pieces as slots are first used so a large, growing
/// device costs memory only for what it uses. A word never set reads as 0.
pub(super) struct SlotTable {
    chunks: Box<[OnceLock<Box<[AtomicU64]>>]>,
}

impl SlotTable {
    pub(super) fn new(slots: u64) -> SlotTable {
        let chunks = slots.div_ceil(TABLE_CHUNK);
        SlotTable {
            chunks: (0..chunks).map(|_| OnceLock::new()).collect(),
        }
    }

    pub(super) fn set(&self, slot: SlotId, value: u64) {
        self.word(slot).store(value, Ordering::Release);
    }

    /// The slot's word, its piece of the table allocated first if need be (so never from
    /// the SIGBUS handler: it reads through [`SlotTable::entry`]).
    pub(super) fn word(&self, slot: SlotId) -> &AtomicU64 {
        let (chunk, index) = Self::position(slot);
        let entries = self.chunks[chunk].get_or_init(zeroed_chunk);
        &entries[index]
    }

    pub(super) fn clear(&self, slot: SlotId) {
        if let Some(entry) = self.entry(slot) {
            entry.store(0, Ordering::Release);
        }
    }

    pub(super) fn get(&self, slot: SlotId) -> u64 {
        self.entry(slot).map_or(0, |e| e.load(Ordering::Acquire))
    }

    pub(super) fn entry(&self, slot: SlotId) -> Option<&AtomicU64> {
        let (chunk, index) = Self::position(slot);
        self.chunks.get(chunk)?.get().map(|entries| &entries[index])
    }

    fn position(slot: SlotId) -> (usize, usize) {
        let slot = u64::from(slot);
        ((slot / TABLE_CHUNK) as usize, (slot % TABLE_CHUNK) as usize)
    }
}

/// A piece of the table, every word 0, from zeroed memory (`alloc_zeroed` maps a large
/// block fresh, and the kernel supplies its pages as they are first written).
#[cfg(not(loom))]
fn zeroed_chunk() -> Box<[AtomicU64]> {
    let layout = std::alloc::Layout::array::<AtomicU64>(TABLE_CHUNK as usize)
        .expect("a table piece's size fits in memory");
    // SAFETY: a non-zero size; the block, all zero bits, holds TABLE_CHUNK valid
    // AtomicU64 words (0), and the box frees it with the same layout.
    unsafe {
        let words = std::alloc::alloc_zeroed(layout).cast::<AtomicU64>();
        if words.is_null() {
            std::alloc::handle_alloc_error(layout);
        }
        Box::from_raw(std::ptr::slice_from_raw_parts_mut(
            words,
            TABLE_CHUNK as usize,
        ))
    }
}

#[cfg(loom)]
fn zeroed_chunk() -> Box<[AtomicU64]> {
    (0..TABLE_CHUNK).map(|_| AtomicU64::new(0)).collect()
}
