//! The invariant walker: checks that a region's page states, LRU lists, budget, staging
//! frames, swap slots and swap cache agree with each other and with the kernel's page
//! tables (mimalloc's `mi_page_is_valid` walks, for uswap's page word).
//!
//! It locks every page, so it waits for faults and reclaim in progress and stops them
//! while it runs: for tests, debugging and debug builds, never a release hot path.
//!
//! Debug builds run it inside the code too: kswapd walks its region at the end of each
//! balancing run (one walk per [`WALK_EVERY`] in the process, regions of up to
//! [`WALK_MAX_PAGES`] pages),
//! and a disagreement aborts the process with the walker's report, so the test that
//! caused it fails where it happened. Release builds do neither.

use crate::fault::FaultPath;
use crate::lru::LISTS;
use crate::mm::Mm;
use crate::page::{Kind, PageLock};
use crate::vma::Vma;

/// Debug builds: the least time between two walks by kswapd, in the process.
#[cfg(debug_assertions)]
pub(crate) const WALK_EVERY: std::time::Duration = std::time::Duration::from_millis(100);

/// Debug builds: kswapd walks regions of at most this many pages (1 GiB); a walk reads
/// pagemap once per page.
#[cfg(debug_assertions)]
pub(crate) const WALK_MAX_PAGES: usize = 1 << 18;

/// Called by kswapd at the end of each balancing run: in debug builds, walks the region
/// (see the module's text) and aborts on a disagreement; nothing in release builds.
pub(crate) fn after_reclaim(fault: &FaultPath) {
    #[cfg(debug_assertions)]
    {
        use std::sync::atomic::{AtomicU64, Ordering::Relaxed};
        use std::sync::OnceLock;
        use std::time::Instant;
        static START: OnceLock<Instant> = OnceLock::new();
        static LAST_WALK_MS: AtomicU64 = AtomicU64::new(0);
        let mm = fault.mm();
        let now = START.get_or_init(Instant::now).elapsed().as_millis() as u64;
        let last = LAST_WALK_MS.load(Relaxed);
        let due = last == 0 || now.saturating_sub(last) >= WALK_EVERY.as_millis() as u64;
        // While vma events are read or handled, or pages mremap moved out wait to be
        // placed, the region is between two states: not walked then.
        let vma = fault.vma();
        if !due || mm.pages().len() > WALK_MAX_PAGES || mm.mmap_changing() || vma.has_pending() {
            return;
        }
        LAST_WALK_MS.store(now.max(1), Relaxed);
        if let Some(Err(report)) = try_check_region(mm, &vma) {
            // Straight to the descriptor: a test harness would capture `eprintln!`, and
            // lose it with the process.
            let msg = format!("uswap: the invariant walker found, after reclaim:\n{report}\n");
            // SAFETY: writing a buffer we own to stderr.
            unsafe { libc::write(2, msg.as_ptr().cast(), msg.len()) };
            std::process::abort();
        }
    }
    #[cfg(not(debug_assertions))]
    let _ = fault;
}

/// Walks the region and checks that page states, LRU lists, budget, staging frames and
/// swap slots agree. For tests and debugging: it locks every page, so it waits for
/// faults and reclaim in progress and stops them while it runs.
pub(crate) fn check_region(mm: &Mm, vma: &Vma<'_>) -> Result<(), String> {
    mm.lru().drain_all();
    let locks: Vec<PageLock<'_>> = (0..mm.pages().len()).map(|p| mm.pages().lock(p)).collect();
    check_locked(mm, vma, locks, true)
}

/// [`check_region`] from inside the code (kswapd), without the kernel's page tables
/// (the program may be changing them): it only try-locks, and gives up (`None`, nothing
/// checked) at the first page another thread holds. A thread holding a
/// page lock may be waiting for memory, which reclaim cannot free while the walker holds
/// the rest; reclaim's out-of-memory clock stops while the walker runs (`Mm::reclaim_paused`).
#[cfg(debug_assertions)]
fn try_check_region(mm: &Mm, vma: &Vma<'_>) -> Option<Result<(), String>> {
    mm.lru().drain_all();
    mm.set_reclaim_paused(true);
    let locks: Option<Vec<PageLock<'_>>> = (0..mm.pages().len())
        .map(|p| mm.pages().try_lock(p))
        .collect();
    let checked = locks.map(|locks| check_locked(mm, vma, locks, false));
    mm.set_reclaim_paused(false);
    checked
}

/// The checks, on a region whose pages `locks` holds, every one; against the kernel's
/// page tables too when `kernel_tables` (only where the program is quiet: an munmap or a
/// discard changes them before uswap reads its event).
fn check_locked(
    mm: &Mm,
    vma: &Vma<'_>,
    locks: Vec<PageLock<'_>>,
    kernel_tables: bool,
) -> Result<(), String> {
    let mut errors = Vec::new();
    let mut resident = 0u64;
    let mut shared = 0u64;
    let mut slots = std::collections::HashSet::new();
    let mut ancestor_slots = std::collections::HashSet::new();
    let mut frames = std::collections::HashSet::new();
    let placing = vma.placing();
    // With every page locked no page can join a batch: a drain must leave none waiting
    // (one still waiting lost its batch entry).
    mm.lru().drain_all();
    for l in &locks {
        if mm.lru().is_pending(l.page()) {
            errors.push(format!("page {} waits in no LRU batch", l.page()));
        }
        let st = l.state();
        // The word, its slot's swap cache entry, its frame: what every page event leaves.
        if let Err(e) = mm.check_page(l) {
            errors.push(e);
        }
        // The kernel's page tables must agree: mapped exactly when active, and
        // write-protected when active and clean.
        if let Some(e) = kernel_tables.then(|| mm.pagemap_entry(l.page())).flatten() {
            let active = st.kind() == Kind::Active;
            let unknown = matches!(st.kind(), Kind::Poisoned | Kind::Unmapped | Kind::Lazyfree);
            if e.present != active && !unknown {
                let not = if e.present { "" } else { "not " };
                errors.push(format!("page {} is {st:?} but {not}mapped", l.page()));
            }
            let clean = st.slot().is_some() || st.borrowed().is_some();
            if active && clean && mm.caps().write_protect && !e.write_protected {
                errors.push(format!("clean page {} is not write-protected", l.page()));
            }
            if st.shared() && !e.write_protected {
                errors.push(format!("shared page {} is not write-protected", l.page()));
            }
        }
        // With written bits, protection serves aging alone: no active page keeps a slot, is
        // shared or borrowed (a write the kernel let through would go unseen); without
        // them, no page is armed.
        let written_bits = mm.caps().written_bits;
        if st.armed() && !written_bits {
            errors.push(format!("page {} is armed without written bits", l.page()));
        }
        if written_bits && st.kind() == Kind::Active && st.write_faults() {
            errors.push(format!("page {} is {st:?} under written bits", l.page()));
        }
        // Charged pages are on a list that holds their kind; a shared page is on none:
        // reclaim leaves it to the process that pays for it.
        let on_list = st.is_charged();
        let list = mm.lru().list_of(l.page());
        if list.map(|list| list.holds(st.kind())) != on_list.then_some(true) {
            errors.push(format!(
                "page {} is {st:?} but on list {:?}",
                l.page(),
                mm.lru().list_of(l.page())
            ));
        }
        resident += st.is_charged() as u64;
        shared += st.shared() as u64;
        if let Some(slot) = st.slot() {
            if !slots.insert(slot) {
                errors.push(format!("slot {slot} is held by two pages"));
            }
        }
        if let Some((device, slot)) = st.borrowed() {
            if device as usize >= mm.lenders().len() {
                errors.push(format!(
                    "page {} reads from ancestor device {device} of {}",
                    l.page(),
                    mm.lenders().len()
                ));
            }
            if !ancestor_slots.insert((device, slot)) {
                errors.push(format!(
                    "slot {slot} of ancestor device {device} is held by two pages"
                ));
            }
        }
        if let Some(f) = st.frame() {
            if !frames.insert(f) {
                errors.push(format!("frame {f} is held by two pages"));
            }
        }
    }
    for (slot, e) in mm.swap().cache().entries_of(mm.region_id()) {
        let st = locks.get(e.page as usize).map(|l| l.state());
        if st.is_none_or(|st| st.slot() != Some(slot) || !st.is_resident()) {
            errors.push(format!(
                "slot {slot} is cached as page {} which is {st:?}",
                e.page
            ));
        }
    }
    if placing > 0 {
        errors.push(format!(
            "{placing} pages moved out by mremap wait to be placed"
        ));
    }
    for list in LISTS {
        if let Err(e) = mm.lru().members(list) {
            errors.push(format!("{list:?} list: {e}"));
        }
    }
    if resident != mm.resident() {
        errors.push(format!(
            "{resident} pages are resident but the budget counts {} (besides {} of the \
             compressed pool)",
            mm.resident(),
            mm.pool_charged()
        ));
    }
    if shared != mm.shared_pages() {
        errors.push(format!(
            "{shared} pages are shared but the region counts {}",
            mm.shared_pages()
        ));
    }
    if ancestor_slots.len() as u64 != mm.borrowed_pages() {
        errors.push(format!(
            "{} pages read from ancestors' slots but the region counts {}",
            ancestor_slots.len(),
            mm.borrowed_pages()
        ));
    }
    if slots.len() as u64 != mm.slots_held() {
        errors.push(format!(
            "pages hold {} slots but the region counts {}",
            slots.len(),
            mm.slots_held()
        ));
    }
    let free = mm.staging().free_frames();
    let mut seen = std::collections::HashSet::new();
    if let Some(f) = free
        .iter()
        .find(|&&f| frames.contains(&f) || !seen.insert(f))
    {
        errors.push(format!(
            "frame {f} is free twice, or free and held by a page"
        ));
    }
    if free.len() + frames.len() != mm.staging().frames() {
        errors.push(format!(
            "{} free + {} held staging frames != {}",
            free.len(),
            frames.len(),
            mm.staging().frames()
        ));
    }
    drop(locks);
    if errors.is_empty() {
        Ok(())
    } else {
        Err(errors.join("\n"))
    }
}
