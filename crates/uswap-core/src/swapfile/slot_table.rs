//! A table of one word per swap slot, allocated in pieces as slots are first used (the
//! device's guards and owners, and the compressed tier's locations).

use super::cluster::SlotId;
use crate::sync::AtomicU64;
use crate::PAGE_SIZE;
use std::sync::atomic::Ordering;
use std::sync::OnceLock;

/// Slots per lazily allocated piece of a [`SlotTable`] (64 MiB of swap).
#[cfg(not(loom))]
pub(super) const TABLE_CHUNK: u64 = (64 << 20) / PAGE_SIZE as u64;
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
        let entries = self.chunks[chunk]
            .get_or_init(|| (0..TABLE_CHUNK).map(|_| AtomicU64::new(0)).collect());
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
