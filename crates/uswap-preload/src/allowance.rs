//! The start-up allowance: memory a program may commit before its region is built
//! (`space`). What it commits meanwhile is charged to the tree's memory cgroup, as a
//! region's resident pages are, so that the tree's limit covers the programs that never
//! build one; a commit the limit has no room for builds the region first, whose reclaim
//! can make room.
//!
//! A process charges a member slot of its own, which the group frees when the process is
//! gone (`MemCgroup::reap_dead`) or `exec`s (`forget_previous_image`); it is given back
//! before the region's budget takes a slot of its own. The slot is the process's that took
//! it: a child made without fork's handlers (the C library's `clone`, a `vfork` child)
//! shares this library's state, and must neither charge nor free it.

use std::sync::atomic::{AtomicU64, Ordering::Relaxed};
use std::sync::{Arc, OnceLock};
use uswap_core::memcg::MemCgroup;
use uswap_core::run::default_start_allowance;
use uswap_core::{Config, PAGE_SIZE};

/// The tree's group, when the program charges one.
static GROUP: OnceLock<Arc<MemCgroup>> = OnceLock::new();

/// The member slot charged with this process's commits: the pid that took it in the high
/// half, the slot plus one in the low half; 0 when none is held.
static SLOT: AtomicU64 = AtomicU64::new(0);

/// Bytes of the allowance a program with `config` gets, `asked` or by default: 0 when the
/// region is to be built at once (asked so, or the tree has no member slot for it). An
/// allowance never passes the limit.
pub fn take(config: &Config, asked: Option<u64>) -> u64 {
    let bytes = asked
        .unwrap_or_else(|| default_start_allowance(config.memory_limit))
        .min(config.memory_limit)
        .next_multiple_of(PAGE_SIZE as u64);
    if let Some(cg) = &config.memcg {
        let _ = GROUP.set(cg.clone());
    }
    if bytes == 0 || !join(0) {
        return 0;
    }
    bytes
}

/// In a child of fork whose region is not built: a slot of its own, charged with the
/// `pages` it inherited committed. False when the tree's limit has no room for them.
pub fn take_in_child(pages: usize) -> bool {
    SLOT.store(0, Relaxed);
    join(pages as u64)
}

fn join(pages: u64) -> bool {
    let Some(cg) = GROUP.get() else {
        // A limit of its own: nothing else charges it.
        return true;
    };
    match cg.join_holding(pages) {
        Some(slot) => {
            SLOT.store(
                u64::from(std::process::id()) << 32 | (slot as u64 + 1),
                Relaxed,
            );
            true
        }
        None => false,
    }
}

/// This process's slot, if it took one.
fn own_slot() -> Option<usize> {
    let held = SLOT.load(Relaxed);
    let (pid, slot) = ((held >> 32) as u32, (held & u64::from(u32::MAX)) as usize);
    (slot > 0 && pid == std::process::id()).then(|| slot - 1)
}

/// Charges `pages` committed in all, if the tree's limit has room for them (always, for a
/// limit of the program's own).
pub fn charge(pages: usize) -> bool {
    match (own_slot(), GROUP.get()) {
        (Some(slot), Some(cg)) => cg.set_charge(slot, pages as u64),
        _ => true,
    }
}

/// Gives the slot back (the region is about to be built, or the process ends).
pub fn give_back() {
    if let (Some(slot), Some(cg)) = (own_slot(), GROUP.get()) {
        SLOT.store(0, Relaxed);
        cg.leave(slot);
    }
}
