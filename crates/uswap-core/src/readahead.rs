//! Swap-in readahead ([mm/swap_state.c]'s `swapin_readahead`): which slots a swap-in reads
//! beside the faulting one, by a policy that can be switched while the region runs (seed
//! 002's knob).
//!
//! - `none`: the faulting slot only.
//! - `fixed`: the aligned block of 2^page-cluster slots around it, always (the seed).
//! - `scaling`: the same block, sized by `swapin_nr_pages`: two more than the readahead
//!   pages used since the last swap-in, rounded up to a power of two, at most
//!   2^page-cluster; one when nothing was used and the fault does not follow the previous
//!   one; never under half the previous window.
//! - `vma`: a window of the region's pages around the faulting page, sized the same way
//!   from the previous fault address and capped at 32 pages (the kernel's
//!   `SWAP_RA_ORDER_CEILING`); placed ahead of a forward walk, behind a backward one,
//!   centred otherwise. It reads the slots those pages hold, wherever they are.
//! - `auto` (the default): the kernel's rule (`swap_use_vma_readahead`), by the region's
//!   one device: `vma` on solid-state or RAM-backed swap, `scaling` on a rotating disk,
//!   where neighbouring slots cost one seek. (The kernel turns vma readahead off for all
//!   swap while any rotational swap is on; a region has one device.) A device that cannot
//!   be told counts as solid-state, where the kernel counts a swap without a block device
//!   as rotational: most swap today is on SSDs, and overlayfs or btrfs hide theirs.
//!
//! Pages read ahead are charged to the budget, mapped around the fault (clean, write-
//! protected) and added to the swap cache with the readahead marker (see
//! [`Destination::Clean`] for why they are mapped). Their use raises no fault, so it is
//! inferred: a miss right after the last window means the walk went through it, and its
//! marked pages count as hits, which widen the next window. State is per region (the
//! kernel keeps the hit count per system for `scaling` and per vma for `vma`).

use crate::config::{Readahead, ReadaheadPolicy};
use crate::lockdep::Rank;
use crate::lockstat::{LockClass, StatMutex};
use crate::mm::events::SlotAfter;
use crate::page::{Kind, PageLock};
use crate::stats::VmEvent;
use crate::swapfile::swap_io::SIGNAL_BATCH;
use crate::swapfile::ReadError;
use crate::vmscan::Reclaim;
use crate::PAGE_SIZE;
use arrayvec::ArrayVec;
use std::sync::atomic::{AtomicBool, AtomicU32, AtomicUsize, Ordering::Relaxed};

/// The largest vma window: 2^5 pages.
const VMA_MAX_ORDER: u8 = 5;

/// What a swap-in reads around the faulting slot (which is always read).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum Window {
    /// Nothing more.
    None,
    /// These slots of the device (inclusive).
    Slots { first: u32, last: u32 },
    /// The slots held by these pages of the region (end exclusive).
    Pages { start: usize, end: usize },
}

impl Window {
    /// Whether a fault at `slot`/`page` comes right after this window, either way.
    fn is_followed_by(self, slot: u32, page: usize) -> bool {
        match self {
            Window::None => false,
            Window::Slots { first, last } => {
                slot == last.wrapping_add(1) || slot.wrapping_add(1) == first
            }
            Window::Pages { start, end } => page == end || page + 1 == start,
        }
    }
}

/// The readahead setting and what it learned, for one region.
pub(crate) struct ReadaheadState {
    /// Whether the region's swap device is a rotating disk (what `auto` chooses by).
    rotational: bool,
    /// Policy in effect (low byte) and page-cluster (second byte).
    setting: AtomicU32,
    /// Readahead pages used since the last window was sized.
    hits: AtomicU32,
    /// Of those, the pages whose first use was a write (their write fault said so).
    written: AtomicU32,
    /// Windows still to be mapped writable (see [`ReadaheadState::learn`]).
    writable_windows: AtomicU32,
    /// Whether the window sized last is mapped writable: written and read under `last`.
    writable: AtomicBool,
    /// The slot (scaling) or page (vma) of the previous swap-in, and its window.
    prev_slot: AtomicU32,
    prev_page: AtomicUsize,
    prev_window: AtomicU32,
    /// The last window read (for inferring the use of its pages). Taken with a page lock
    /// held; swap cache locks are taken under it, nothing else.
    last: StatMutex<Window>,
}

impl ReadaheadState {
    /// The state for a region whose swap device is `rotational` or not (which `auto`
    /// chooses by).
    pub fn new(setting: Readahead, rotational: bool) -> ReadaheadState {
        let s = ReadaheadState {
            rotational,
            setting: AtomicU32::new(0),
            hits: AtomicU32::new(0),
            written: AtomicU32::new(0),
            writable_windows: AtomicU32::new(0),
            writable: AtomicBool::new(false),
            prev_slot: AtomicU32::new(u32::MAX),
            prev_page: AtomicUsize::new(usize::MAX),
            prev_window: AtomicU32::new(0),
            last: StatMutex::new(Rank::ReadaheadWindow, Window::None),
        };
        s.set(setting);
        s
    }

    /// The statistics of the last window's lock (`readahead_window`).
    pub fn lockstat(&self) -> LockClass {
        LockClass::sum("readahead_window", [&self.last])
    }

    /// Switches policy and page-cluster; what was learned starts over. `auto` is stored as
    /// the policy it chooses for the device.
    pub fn set(&self, setting: Readahead) {
        let in_effect = setting.policy.on_device(self.rotational);
        let policy = ReadaheadPolicy::ALL
            .iter()
            .position(|p| *p == in_effect)
            .expect("a listed policy") as u32;
        self.hits.store(0, Relaxed);
        self.written.store(0, Relaxed);
        self.writable_windows.store(0, Relaxed);
        self.writable.store(false, Relaxed);
        self.prev_window.store(0, Relaxed);
        *self.last.lock() = Window::None;
        self.setting
            .store(policy | (u32::from(setting.page_cluster) << 8), Relaxed);
    }

    /// The setting in effect (never `auto`).
    pub fn get(&self) -> Readahead {
        let v = self.setting.load(Relaxed);
        Readahead {
            policy: ReadaheadPolicy::ALL[(v & 0xff) as usize],
            page_cluster: (v >> 8) as u8,
        }
    }

    /// A fault found `page` in the swap cache; `readahead` when readahead had put it there
    /// and this is its first use. As in the kernel, any hit moves the vma policy's last
    /// fault address (so the next miss of a forward walk reads ahead of it, not around
    /// it), and a readahead hit counts toward the next window.
    pub fn cache_hit(&self, page: usize, readahead: bool) {
        self.prev_page.store(page, Relaxed);
        if readahead {
            self.hits.fetch_add(1, Relaxed);
        }
    }

    /// A page readahead mapped clean was written before the next window was sized (a hit,
    /// as `cache_hit`, counted apart for [`ReadaheadState::learn`]).
    pub fn written_hit(&self, page: usize) {
        self.cache_hit(page, true);
        self.written.fetch_add(1, Relaxed);
    }

    /// The window for a swap-in of `slot` at `page` of a region of `pages` pages, and
    /// whether its pages, the faulting one with them, are to be mapped writable (dirty,
    /// their slots freed), as their write faults would leave them (see
    /// [`ReadaheadState::learn`]). When the fault comes right after the last window, in
    /// either direction, the walk went through it: `used` is called with that window, marks
    /// its pages used and says how many there were, and they count as hits before the new
    /// window is sized.
    pub fn window(
        &self,
        slot: u32,
        page: usize,
        pages: usize,
        used: impl FnOnce(Window) -> u32,
    ) -> (Window, bool) {
        // Held throughout, so two swap-ins cannot both take credit for one window.
        let mut last = self.last.lock();
        self.next(&mut last, slot, page, pages, used)
    }

    /// [`ReadaheadState::window`] for the SIGBUS handler, which waits for no lock and reads
    /// at most [`SIGNAL_BATCH`] pages, and only when `room` says its stack has room for it
    /// (asked only of a fault that may read ahead): `None`, with nothing changed, while
    /// another swap-in sizes a window, or when the window may read ahead and the handler
    /// cannot (the policy's windows may be larger, or no room).
    pub fn window_in_signal(
        &self,
        slot: u32,
        page: usize,
        pages: usize,
        room: impl FnOnce() -> bool,
        used: impl FnOnce(Window) -> u32,
    ) -> Option<(Window, bool)> {
        // A panic elsewhere leaves a window, still a window: poison is ignored.
        let mut last = self.last.try_lock()?;
        if last.is_followed_by(slot, page) || self.would_read_ahead(slot, page) {
            let fits = self.largest_window() <= SIGNAL_BATCH;
            return (fits && room()).then(|| self.next(&mut last, slot, page, pages, used));
        }
        // Sized for real, so the policy learns from this fault as from any other; a hit
        // counted since the look above may widen it, and the page alone is read anyway.
        self.size_window(slot, page, pages);
        *last = Window::None;
        Some((Window::None, false))
    }

    /// Whether the next window for `slot` at `page` would hold more than the faulting
    /// page, by what the policy has learned so far (nothing changes).
    fn would_read_ahead(&self, slot: u32, page: usize) -> bool {
        let setting = self.get();
        let (follows, max) = match setting.policy {
            ReadaheadPolicy::None => return false,
            ReadaheadPolicy::Auto => unreachable!("stored as the policy it chooses"),
            ReadaheadPolicy::Fixed => return setting.max_pages() > 1,
            ReadaheadPolicy::Scaling => {
                let prev = self.prev_slot.load(Relaxed);
                let near = prev == slot.wrapping_add(1) || prev.wrapping_add(1) == slot;
                (near, 1 << setting.page_cluster)
            }
            ReadaheadPolicy::Vma => {
                let prev = self.prev_page.load(Relaxed);
                let near = prev == page + 1 || prev.wrapping_add(1) == page;
                (near, 1 << setting.page_cluster.min(VMA_MAX_ORDER))
            }
        };
        let (hits, prev_window) = (self.hits.load(Relaxed), self.prev_window.load(Relaxed));
        max > 1 && next_window(hits, follows, max, prev_window) > 1
    }

    fn next(
        &self,
        last: &mut Window,
        slot: u32,
        page: usize,
        pages: usize,
        used: impl FnOnce(Window) -> u32,
    ) -> (Window, bool) {
        if last.is_followed_by(slot, page) {
            self.hits.fetch_add(used(*last), Relaxed);
            // The last page the walk used, as a swap cache hit there would have recorded.
            if let Window::Pages { start, end } = *last {
                let prev = if page == end { end - 1 } else { start };
                self.prev_page.store(prev, Relaxed);
            }
        }
        *last = self.size_window(slot, page, pages);
        (*last, self.writable.load(Relaxed))
    }

    /// The most pages a window of the current setting holds, the faulting one among them.
    fn largest_window(&self) -> usize {
        let setting = self.get();
        match setting.policy {
            ReadaheadPolicy::None => 1,
            ReadaheadPolicy::Auto => unreachable!("stored as the policy it chooses"),
            ReadaheadPolicy::Fixed | ReadaheadPolicy::Scaling => setting.max_pages(),
            ReadaheadPolicy::Vma => 1 << setting.page_cluster.min(VMA_MAX_ORDER),
        }
    }

    fn size_window(&self, slot: u32, page: usize, pages: usize) -> Window {
        self.writable.store(false, Relaxed);
        let setting = self.get();
        match setting.policy {
            ReadaheadPolicy::None => Window::None,
            ReadaheadPolicy::Auto => unreachable!("stored as the policy it chooses"),
            ReadaheadPolicy::Fixed => slot_block(slot, setting.max_pages() as u32),
            ReadaheadPolicy::Scaling => {
                let prev = self.prev_slot.load(Relaxed);
                let near = prev == slot.wrapping_add(1) || prev.wrapping_add(1) == slot;
                let (win, hits) = self.learn(near, 1 << setting.page_cluster);
                // As the kernel: the position moves only while readahead is not paying.
                if hits == 0 {
                    self.prev_slot.store(slot, Relaxed);
                }
                slot_block(slot, win)
            }
            ReadaheadPolicy::Vma => {
                let prev = self.prev_page.swap(page, Relaxed);
                let max = 1 << setting.page_cluster.min(VMA_MAX_ORDER);
                let near = prev == page + 1 || prev.wrapping_add(1) == page;
                let win = self.learn(near, max).0 as usize;
                if win <= 1 {
                    return Window::None;
                }
                let (start, end) = if prev.wrapping_add(1) == page {
                    (page, page + win)
                } else if prev == page + 1 {
                    ((page + 1).saturating_sub(win), page + 1)
                } else {
                    let left = (win - 1) / 2;
                    let start = page.saturating_sub(left);
                    (start, start + win)
                };
                Window::Pages {
                    start,
                    end: end.min(pages),
                }
            }
        }
    }

    /// Sizes the next window from the hits since the last one (`swapin_nr_pages`) and
    /// starts counting hits again: (window, hits).
    ///
    /// It also decides whether the window is mapped writable. A walk that first used three
    /// of four pages or more of its windows by writing them (a rewrite, a copy) gets its
    /// next [`WRITABLE_RUN`] windows mapped writable: each write fault on a clean page is a
    /// fault round trip and a protection change whose TLB flush interrupts every CPU the
    /// process runs on, where the kernel's costs a minor fault. Their pages count as hits
    /// when mapped (their use raises no fault to tell). After the run one window is mapped
    /// clean again, to see whether the walk still writes.
    fn learn(&self, follows_previous: bool, max: u32) -> (u32, u32) {
        if max <= 1 {
            return (1, 0);
        }
        let hits = self.hits.swap(0, Relaxed);
        let written = self.written.swap(0, Relaxed);
        let prev_window = self.prev_window.load(Relaxed);
        let win = next_window(hits, follows_previous, max, prev_window);
        self.prev_window.store(win, Relaxed);
        let left = self.writable_windows.load(Relaxed);
        let writable = if left > 0 {
            self.writable_windows.store(left - 1, Relaxed);
            true
        } else if hits >= 2 && written * 4 >= hits * 3 {
            self.writable_windows.store(WRITABLE_RUN - 1, Relaxed);
            true
        } else {
            false
        };
        self.writable.store(writable && win > 1, Relaxed);
        (win, hits)
    }
}

/// Windows mapped writable after a window whose pages were mostly first used by writes.
const WRITABLE_RUN: u32 = 16;

/// What happens to the pages a readahead reads, besides the faulting one.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum Destination {
    /// A swap-in: mapped around the fault, clean (write-protected, slot kept, in the swap
    /// cache with the readahead marker), so reading one costs no fault. The kernel leaves
    /// them unmapped in its swap cache, where a touch is a cheap minor fault; here a fault
    /// is a round trip through a handler (20 µs in thread mode), so uswap maps around, as
    /// the kernel's `filemap_map_pages` does for file pages. Since reading such a page
    /// raises no fault, a use is inferred (see [`ReadaheadState::window`]); a write is
    /// seen at its fault.
    Clean,
    /// A swap-in of a walk that writes what it reads (see [`ReadaheadState::learn`]):
    /// mapped dirty, slots freed, each counted used, as their write faults would leave
    /// them.
    Writable,
    /// Swapoff, which maps every page anyway: mapped dirty, slots freed, each counted used.
    Dirty,
}

/// Pages besides the faulting one that a window can hold: 2^8, page-cluster's largest.
const MAX_AHEAD: usize = 255;

/// Reads the faulting page's `slot` into `dst` and, in the same submission, the swapped
/// pages of `window`, and maps them as `dest` says. Only pages whose lock is free are
/// read ahead, and only as many as the budget grants without reclaiming. Runs of adjacent
/// pages are mapped with one ioctl each. The result is the faulting page's read; a
/// readahead page that fails is simply left swapped, for its own fault to read and report.
///
/// # Safety
/// `dst` must be valid for writing 4096 bytes, and page-aligned.
pub(crate) unsafe fn read_around(
    reclaim: &Reclaim,
    state: &ReadaheadState,
    fault: &PageLock<'_>,
    (slot, dst): (u32, *mut u8),
    window: Window,
    dest: Destination,
) -> Result<(), ReadError> {
    let mm = reclaim.mm();
    let mut ahead = gather::<MAX_AHEAD>(reclaim, fault.page(), window);
    if ahead.is_empty() {
        return mm.swap().read_page(slot, dst);
    }
    // The region cannot be read into (a kernel write to a missing page there faults):
    // the window is read into one buffer and copied in.
    let mut bounce = vec![0u8; (ahead.len() + 1) * PAGE_SIZE];
    let base = bounce
        .as_mut_ptr()
        .add(bounce.as_ptr().align_offset(PAGE_SIZE));
    let buf = |i: usize| base.add(i * PAGE_SIZE);
    let mut batch = vec![(slot, dst)];
    batch.extend(
        ahead
            .iter()
            .enumerate()
            .map(|(i, l)| (l.state().slot().expect("swapped"), buf(i))),
    );
    let mut results = mm.swap().read_pages(&batch).into_iter();
    let faulting = results.next().expect("one result per page");
    let read_ok: Vec<bool> = results.map(|r| r.is_ok()).collect();
    map_ahead(
        reclaim,
        state,
        &mut ahead,
        (|i| buf(i), |i| read_ok[i]),
        dest,
    );
    match faulting {
        Ok(()) => Ok(()),
        // Read again, with the re-reads and error counting of a single read.
        Err(_) => mm.swap().read_page(slot, dst),
    }
}

/// [`read_around`] for a swap-in in the SIGBUS handler: allocates nothing and waits for no
/// lock. The window (at most [`SIGNAL_BATCH`] pages) is read into buffers of the swap
/// device's own; the pages read ahead are mapped as `dest` says, and then the faulting
/// page's verified copy is lent to `map_fault`, whose result this returns. `None` when no buffers
/// are free or the faulting page was not read and verified (the pages read ahead are
/// mapped all the same): the full path then reads it again and reports what goes wrong.
///
/// # Safety
/// `fault_page` must be locked by the caller and hold `slot`.
pub(crate) unsafe fn read_around_in_signal<R>(
    reclaim: &Reclaim,
    state: &ReadaheadState,
    (fault_page, slot): (usize, u32),
    window: Window,
    dest: Destination,
    map_fault: impl FnOnce(*const u8) -> Option<R>,
) -> Option<R> {
    let mm = reclaim.mm();
    let mut ahead = gather::<{ SIGNAL_BATCH - 1 }>(reclaim, fault_page, window);
    let mut slots: ArrayVec<u32, SIGNAL_BATCH> = ArrayVec::new();
    slots.push(slot);
    slots.extend(ahead.iter().map(|l| l.state().slot().expect("swapped")));
    let done = mm.swap().read_pages_in_place(&slots, |batch| {
        map_ahead(
            reclaim,
            state,
            &mut ahead,
            (|i| batch.page(i + 1), |i| batch.ok(i + 1)),
            dest,
        );
        batch.ok(0).then(|| map_fault(batch.page(0))).flatten()
    });
    if done.is_none() {
        mm.budget().uncharge(ahead.len() as u64);
    }
    done.flatten()
}

/// Locks the swapped pages in `window` other than `fault_page`, and charges as many as the
/// budget grants without reclaiming (the nearest first), in address order so adjacent
/// pages form runs. Pages whose lock is held are skipped (never waited for: the caller
/// holds a page lock), and so are slots of other regions or pages that no longer hold the
/// slot. At most `N`: a window never holds more besides the faulting page.
fn gather<const N: usize>(
    reclaim: &Reclaim,
    fault_page: usize,
    window: Window,
) -> ArrayVec<PageLock<'_>, N> {
    let mm = reclaim.mm();
    let pages = mm.pages();
    let swapped = |p: usize, slot: Option<u32>| {
        let lock = pages.try_lock(p)?;
        let held = lock.state().slot();
        // A page whose slot is an ancestor's has none here, and is read alone.
        let own = held.is_some() && (slot.is_none() || held == slot);
        (lock.kind() == Kind::Swapped && own).then_some(lock)
    };
    let mut found: ArrayVec<PageLock<'_>, N> = ArrayVec::new();
    let mut keep = |lock: Option<_>| {
        if let Some(lock) = lock {
            let _ = found.try_push(lock);
        }
    };
    match window {
        Window::None => {}
        Window::Pages { start, end } => (start..end)
            .filter(|&p| p != fault_page)
            .for_each(|p| keep(swapped(p, None))),
        Window::Slots { first, last } => (first..=last).for_each(|s| match mm.swap().owner(s) {
            Some((region, p)) if region == mm.region_id() => {
                let p = p as usize;
                if p != fault_page && p < pages.len() {
                    keep(swapped(p, Some(s)));
                }
            }
            _ => {}
        }),
    }
    // Unstable sorts: they sort in place, allocating nothing (the SIGBUS handler's).
    found.sort_unstable_by_key(|l| l.page().abs_diff(fault_page));
    let granted = reclaim.charge_spare(found.len() as u64) as usize;
    found.truncate(granted);
    found.sort_unstable_by_key(|l| l.page());
    found
}

/// Maps the pages read ahead that were read whole (`ahead[i]` into `buf(i)` when
/// `read_ok(i)`), a run of adjacent pages with one ioctl, and records each as `dest`
/// says; a page not mapped is uncharged and stays swapped. Allocates nothing.
///
/// # Safety
/// Each `buf(i)` of a page read whole must be valid for reading 4096 bytes.
unsafe fn map_ahead(
    reclaim: &Reclaim,
    state: &ReadaheadState,
    ahead: &mut [PageLock<'_>],
    (buf, read_ok): (impl Fn(usize) -> *const u8, impl Fn(usize) -> bool),
    dest: Destination,
) {
    let mm = reclaim.mm();
    // A clean page must be mapped write-protected to learn of its first write; without
    // that (or with swap nearly full) it is mapped dirty, its slot freed.
    let clean = dest == Destination::Clean && mm.caps().write_protect && !mm.swap().nearly_full();
    let mut read = 0;
    let mut record = |lock: &mut PageLock<'_>, mapped: bool| {
        if !mapped {
            mm.budget().uncharge(1);
            return;
        }
        read += 1;
        let page = lock.page();
        // Speculative pages wait at the tail, first in line to be aged, as the kernel puts
        // them on the inactive list; a use keeps them mapped.
        let after = if clean {
            SlotAfter::Cached
        } else {
            SlotAfter::Freed
        };
        mm.swapped_in(lock, after, true, false);
        if dest != Destination::Clean {
            // Its use will raise no fault to tell: counted now.
            state.cache_hit(page, true);
            mm.count(VmEvent::swap_ra_hit, 1);
        }
    };
    let mut i = 0;
    while i < ahead.len() {
        if !read_ok(i) {
            record(&mut ahead[i], false);
            i += 1;
            continue;
        }
        let mut end = i + 1;
        while end < ahead.len() && read_ok(end) && ahead[end].page() == ahead[end - 1].page() + 1 {
            end += 1;
        }
        let to = mm.page_addr(ahead[i].page());
        let mapped = match mm.uffd().copy(to, buf(i), (end - i) * PAGE_SIZE, clean) {
            Ok(()) => end - i,
            Err(p) if p.failed_whole() && end - i > 1 => {
                // The run may span two mappings: page by page.
                for (k, lock) in ahead[i..end].iter_mut().enumerate() {
                    let at = mm.page_addr(lock.page());
                    let one = mm.uffd().copy(at, buf(i + k), PAGE_SIZE, clean).is_ok();
                    record(lock, one);
                }
                i = end;
                continue;
            }
            Err(p) => p.done / PAGE_SIZE,
        };
        for (k, lock) in ahead[i..end].iter_mut().enumerate() {
            record(lock, k < mapped);
        }
        i = end;
    }
    mm.count(VmEvent::swap_ra, read);
    mm.count(VmEvent::pswpin, read);
}

/// `__swapin_nr_pages`: two more than the hits, rounded up to a power of two (from 4),
/// capped at `max`; one page when nothing hit and the fault does not follow the previous
/// one; never shrinking below half the previous window.
fn next_window(hits: u32, follows_previous: bool, max: u32, prev_window: u32) -> u32 {
    let mut pages = hits + 2;
    if pages == 2 {
        if !follows_previous {
            pages = 1;
        }
    } else {
        pages = pages.next_power_of_two().max(4);
    }
    pages.min(max).max(prev_window / 2).max(1)
}

/// The aligned block of `win` slots (a power of two) around `slot`.
fn slot_block(slot: u32, win: u32) -> Window {
    if win <= 1 {
        return Window::None;
    }
    let mask = win - 1;
    Window::Slots {
        first: slot & !mask,
        last: slot | mask,
    }
}

#[cfg(all(test, not(loom)))]
mod tests {
    use super::*;

    fn state(policy: ReadaheadPolicy, page_cluster: u8) -> ReadaheadState {
        let setting = Readahead {
            policy,
            page_cluster,
        };
        ReadaheadState::new(setting, false)
    }

    #[test]
    fn auto_is_stored_as_what_the_kernel_would_choose_for_the_device() {
        let auto = Readahead {
            policy: ReadaheadPolicy::Auto,
            page_cluster: 3,
        };
        for (rotational, in_effect) in [
            (true, ReadaheadPolicy::Scaling),
            (false, ReadaheadPolicy::Vma),
        ] {
            let s = ReadaheadState::new(auto, rotational);
            assert_eq!(s.get().policy, in_effect);
            // A fault next to the previous one opens a window of that policy's kind.
            s.size_window(100, 10, 1000);
            let window = s.size_window(101, 11, 1000);
            let slots = matches!(window, Window::Slots { .. });
            assert_eq!(
                slots, rotational,
                "{window:?} on a rotational device: {rotational}"
            );
            // Switched at run time, an explicit policy stays as given.
            s.set(Readahead {
                policy: ReadaheadPolicy::None,
                ..auto
            });
            assert_eq!(s.get().policy, ReadaheadPolicy::None);
            s.set(auto);
            assert_eq!(s.get().policy, in_effect);
        }
    }

    #[test]
    fn fixed_reads_the_aligned_block_always() {
        let s = state(ReadaheadPolicy::Fixed, 3);
        for _ in 0..3 {
            assert_eq!(
                s.size_window(21, 0, 100),
                Window::Slots {
                    first: 16,
                    last: 23
                }
            );
        }
        s.set(Readahead {
            policy: ReadaheadPolicy::Fixed,
            page_cluster: 0,
        });
        assert_eq!(s.size_window(21, 0, 100), Window::None);
    }

    #[test]
    fn the_signal_handler_sizes_the_same_windows_when_it_has_room_for_them() {
        for policy in [ReadaheadPolicy::Vma, ReadaheadPolicy::Scaling] {
            let (full, signal) = (state(policy, 3), state(policy, 3));
            // A forward walk with a jump in it, and readahead hits along the way.
            for (slot, page) in [(500, 50), (501, 51), (503, 53), (511, 61), (90, 9)] {
                let a = full.window(slot, page, 100, |_| 2);
                let b = signal.window_in_signal(slot, page, 100, || true, |_| 2);
                assert_eq!(Some(a), b, "{policy:?} at page {page}");
            }
        }
        // While another swap-in sizes a window, the signal handler does not wait for it.
        let s = state(ReadaheadPolicy::Vma, 3);
        let sizing = s.last.lock();
        assert_eq!(
            s.window_in_signal(1, 1, 10, || true, |_| 0).map(|(w, _)| w),
            None
        );
        drop(sizing);
        // Windows past the handler's batch are left to the full path (vma's are capped),
        // unless they hold the faulting page alone.
        for (policy, page_cluster, fits) in [
            (ReadaheadPolicy::Fixed, 5, true),
            (ReadaheadPolicy::Fixed, 6, false),
            (ReadaheadPolicy::Vma, 8, true),
            (ReadaheadPolicy::None, 8, true),
        ] {
            let s = state(policy, page_cluster);
            let w = s
                .window_in_signal(100, 100, 1000, || true, |_| 0)
                .map(|(w, _)| w);
            assert_eq!(w.is_some(), fits, "{policy:?} page-cluster {page_cluster}");
        }
        let s = state(ReadaheadPolicy::Scaling, 8);
        assert_eq!(
            s.window_in_signal(100, 100, 1000, || true, |_| 0)
                .map(|(w, _)| w),
            Some(Window::None),
            "a random fault reads its page alone"
        );
    }

    #[test]
    fn without_room_the_signal_handler_reads_only_lone_pages() {
        for policy in [ReadaheadPolicy::Vma, ReadaheadPolicy::Scaling] {
            let s = state(policy, 3);
            // A random walk: every window is the faulting page alone, and the stack is
            // not even asked about (a system call in the handler).
            for (slot, page) in [(500, 50), (90, 9), (310, 31)] {
                let asked = || -> bool { panic!("room asked for a lone page") };
                let w = s
                    .window_in_signal(slot, page, 100, asked, |_| 0)
                    .map(|(w, _)| w);
                assert_eq!(w, Some(Window::None), "{policy:?} {page}");
            }
            // A walk that follows its last fault would read ahead: not in the handler, and
            // the full path's window sizes it as if the look had not been.
            assert_eq!(
                s.window_in_signal(311, 32, 100, || false, |_| 0)
                    .map(|(w, _)| w),
                None
            );
            assert!(
                s.window(311, 32, 100, |_| 0).0 != Window::None,
                "{policy:?}"
            );
            // Readahead hits since: the next window grows.
            s.cache_hit(33, true);
            assert_eq!(
                s.window_in_signal(700, 70, 100, || false, |_| 0)
                    .map(|(w, _)| w),
                None
            );
        }
        let lone = |policy, page_cluster| {
            state(policy, page_cluster)
                .window_in_signal(1, 1, 10, || false, |_| 0)
                .map(|(w, _)| w)
        };
        assert_eq!(lone(ReadaheadPolicy::None, 3), Some(Window::None));
        assert_eq!(lone(ReadaheadPolicy::Fixed, 3), None);
        assert_eq!(lone(ReadaheadPolicy::Fixed, 0), Some(Window::None));
    }

    #[test]
    fn a_walk_that_writes_what_it_reads_gets_writable_windows_then_one_clean_look() {
        let s = state(ReadaheadPolicy::Vma, 3);
        let mut page = 10;
        let mut walk = |written: u32, read: u32| {
            page += 8;
            for _ in 0..written {
                s.written_hit(page - 1);
            }
            for _ in 0..read {
                s.cache_hit(page - 1, true);
            }
            s.window(0, page, 10_000, |_| 0)
        };
        assert!(!walk(0, 0).1, "no history");
        assert!(!walk(2, 6).1, "mostly read: clean");
        assert!(walk(6, 2).1, "three of four written: writable");
        // The run: 15 more windows writable whatever their hits say (none are seen).
        for i in 0..WRITABLE_RUN - 1 {
            assert!(walk(0, 8).1, "window {i} of the run");
        }
        assert!(!walk(0, 8).1, "then one clean window to look again");
        assert!(walk(8, 0).1, "still writing: another run");
        // A random walk with a lone written hit between faults is never mapped writable.
        let s = state(ReadaheadPolicy::Vma, 3);
        for page in [5_000, 70, 3_000, 9_000] {
            s.written_hit(page + 1);
            assert!(!s.window(0, page, 10_000, |_| 0).1, "page {page}");
        }
    }

    #[test]
    fn none_reads_nothing_more() {
        assert_eq!(
            state(ReadaheadPolicy::None, 8).size_window(5, 5, 100),
            Window::None
        );
    }

    #[test]
    fn the_scaling_window_grows_with_hits_and_shrinks_by_halves() {
        assert_eq!(
            next_window(0, false, 8, 0),
            1,
            "a random fault reads one page"
        );
        assert_eq!(next_window(0, true, 8, 0), 2, "a sequential one two");
        assert_eq!(next_window(1, false, 8, 0), 4);
        assert_eq!(next_window(3, false, 8, 0), 8);
        assert_eq!(next_window(30, false, 8, 0), 8, "capped by page-cluster");
        assert_eq!(
            next_window(0, false, 8, 8),
            4,
            "never below half the last window"
        );

        let s = state(ReadaheadPolicy::Scaling, 3);
        assert_eq!(
            s.size_window(100, 0, 10),
            Window::None,
            "first fault, no history"
        );
        s.cache_hit(0, true);
        s.cache_hit(0, true);
        s.cache_hit(0, true);
        assert_eq!(
            s.size_window(300, 0, 10),
            Window::Slots {
                first: 296,
                last: 303
            }
        );
        assert_eq!(
            s.size_window(700, 0, 10),
            Window::Slots {
                first: 700,
                last: 703
            }
        );
    }

    #[test]
    fn the_vma_window_follows_the_direction_of_the_walk() {
        let s = state(ReadaheadPolicy::Vma, 8);
        assert_eq!(s.size_window(0, 50, 1000), Window::None, "no history yet");
        assert_eq!(
            s.size_window(0, 51, 1000),
            Window::Pages { start: 51, end: 53 },
            "forward: ahead of the fault"
        );
        for _ in 0..40 {
            s.cache_hit(51, true);
        }
        assert_eq!(
            s.size_window(0, 52, 1000),
            Window::Pages { start: 52, end: 84 },
            "capped at 32 pages"
        );
        s.cache_hit(52, true);
        assert_eq!(
            s.size_window(0, 51, 1000),
            Window::Pages { start: 36, end: 52 },
            "backward: behind it, at least half the last window"
        );
        s.cache_hit(0, true);
        s.cache_hit(0, true);
        assert_eq!(
            s.size_window(0, 990, 1000),
            Window::Pages {
                start: 987,
                end: 995
            },
            "a jump: centred, clipped to the region"
        );
    }

    #[test]
    fn a_fault_right_after_the_last_window_counts_its_pages_used() {
        let s = state(ReadaheadPolicy::Vma, 3);
        let mut offered = Vec::new();
        let mut walk = |page| {
            s.window(0, page, 1000, |w| {
                offered.push(w);
                7
            })
            .0
        };
        assert_eq!(walk(10), Window::None);
        assert_eq!(walk(11), Window::Pages { start: 11, end: 13 });
        // The walk went through 11..13 and faults at 13: the window's pages were used.
        assert_eq!(
            walk(13),
            Window::Pages { start: 13, end: 21 },
            "7 hits: 8 pages"
        );
        assert_eq!(
            walk(500),
            Window::Pages {
                start: 499,
                end: 503
            },
            "a jump: no credit"
        );
        assert_eq!(
            offered,
            vec![Window::Pages { start: 11, end: 13 }],
            "only the window the walk came through is offered"
        );
    }

    #[test]
    fn a_switch_takes_effect_and_forgets_the_history() {
        let s = state(ReadaheadPolicy::Vma, 3);
        s.cache_hit(0, true);
        let fixed = Readahead {
            policy: ReadaheadPolicy::Fixed,
            page_cluster: 2,
        };
        s.set(fixed);
        assert_eq!(s.get(), fixed);
        assert_eq!(
            s.size_window(9, 0, 10),
            Window::Slots { first: 8, last: 11 }
        );
    }
}
