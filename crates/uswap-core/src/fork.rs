//! `fork(2)` for regions: the child gets a region of its own at the same address, holding
//! the memory as it was when the parent forked (resident, inactive and swapped pages
//! alike), as the kernel gives a child its parent's anonymous memory, and at about the
//! kernel's cost: what is mapped is shared copy-on-write, and what is not is lent.
//!
//! - **prepare** (the parent, in the forking thread, just before the fork system call):
//!   for each region, its fork fence is taken (`Mm::fork_fence`: aging moves no page in
//!   or out of the region until the child exists) and a new swap device is made like the
//!   region's (an unlinked file beside it). Then, in one pass, the **note**: a mapped page
//!   (active or lazily freed) is only noted: the kernel will map it in the child, shared
//!   with the parent. A page that is not mapped is try-locked and lent, not copied
//!   (`mm/lender.rs`): a swapped page (in the file or the compressed pool) or a clean
//!   inactive one keeps its slot, held for the child until the fork's lifeline hangs up
//!   (`swapfile/swap_map.rs`); a dirty inactive page keeps its staging frame, pinned until
//!   the child exists (`Staging::pin`), and the kernel shares the staging area with the
//!   child; what an ancestor lent this process is passed on. A page whose lock is busy,
//!   or that cannot be lent, sends the fork back: the notes give back what they lent,
//!   the fences go, those pages are copied to the child's device (verified on the way)
//!   under their locks, and the notes are taken again. The image says which page is
//!   where. Last, the region's runs are let be inherited (`MADV_DOFORK`; they are
//!   `MADV_DONTFORK` at any other time, so a fork these handlers do not see leaves the
//!   child no region memory rather than zeros where pages were swapped).
//! - **child**: each region is built again on the mapping the kernel gave it, from its
//!   image: a page the kernel mapped is *shared* (`PageState::shared`: write-protected,
//!   charged to the parent, on no LRU list) until its first write here or until the parent
//!   no longer maps it; a lent page is *borrowed* (`PageState::borrowed`), read from its
//!   lender at its first access; a copied page is `Swapped` in the child's own device. The
//!   parent's structures, copied into the child's memory, are abandoned and never dropped
//!   (their threads do not exist there); the descriptors they hold are closed, but for the
//!   swap files the child borrows from, so the child cannot act on the parent's memory
//!   through them.
//! - **parent**: the runs (and staging areas) are not inherited again, the fences go, the
//!   pinned frames are unpinned, and each device watches the fork's lifeline. A page it
//!   still shares is copied by reclaim before it is moved out (UFFDIO_MOVE moves only
//!   pages mapped once; `vmscan.rs`).
//!
//! The fork costs the page tables (the kernel's share), a look at each page (a lock and a
//! hold for each one not mapped), and a copy of what could not be lent. A child that
//! cannot get its copy (no space for the device, a write error) is stopped with a message
//! and exit status 125 before it runs any code of the program: it would read wrong memory
//! otherwise.
//!
//! Regions of both fault modes are served. A SIGBUS-mode child gets a SIGBUS service of
//! its own, and the parent's registration is forgotten there (`sigbus::Service::
//! forget_in_child`), so the child's faults find the child's region. Syscall dispatch is
//! not inherited (the kernel clears it in a child): a child that wants it turns it on.
//!
//! The program's other threads run during the fork. A page that another thread writes
//! during the fork reaches the child with its old or its new contents, as with a write
//! racing the kernel's fork; a page a discard or first touch has locked at the note is
//! given to the child as lazily freed (mapped or not, its first access there tells).
//!
//! Lock order: the registry lock, then each region's fork fence, then page locks (one at a
//! time, try-locked, at the note; a batch at a time, in address order, to copy, with the
//! fences let go), then what reclaim and the swap device take under them. No page lock is
//! held past `prepare`.

use crate::assembly::{Assembly, Contents};
use crate::error::{Error, Result};
use crate::fork_image::RegionImage;
use crate::lockdep::{Rank, Ranked};
use crate::mm::lender::Lender;
use crate::mm::Mm;
use crate::page::{Kind, PageLock, PageTable};
use crate::signals::Quiet;
use crate::stats::VmEvent;
use crate::swapfile::swap_io::PageBuf;
use crate::swapfile::{SlotId, SwapDevice};
use crate::sync::{lock_std, RwLockWriteGuard};
use crate::PAGE_SIZE;
use std::cell::{OnceCell, UnsafeCell};
use std::collections::HashMap;
use std::ops::Range;
use std::os::fd::{FromRawFd, OwnedFd};
use std::sync::atomic::{AtomicBool, Ordering::Relaxed};
use std::sync::{Arc, Mutex, MutexGuard, Once, OnceLock};

/// A region of this process, where its contents live (boxed, so it stays put).
struct Entry(*const UnsafeCell<Assembly>);

// SAFETY: the pointer is only followed while the region is registered (it unregisters
// before it is dropped), under the registry lock.
unsafe impl Send for Entry {}

/// Every region of the process.
static REGIONS: Mutex<Vec<Entry>> = Mutex::new(Vec::new());

/// The registry, held (first in the lock order, `lockdep.rs`).
fn registry() -> Ranked<MutexGuard<'static, Vec<Entry>>> {
    Ranked::take(Rank::ForkRegistry, || lock_std(&REGIONS))
}

/// Set when the embedding program calls [`prepare`], [`parent`] and [`child`] itself.
static MANUAL: AtomicBool = AtomicBool::new(false);
static ATFORK: Once = Once::new();

/// The fork handlers in force, the embedder's or uswap's own, for a fork the C library's
/// `fork` did not make (see [`around_raw_fork`]).
static HANDLERS: OnceLock<ForkHandlers> = OnceLock::new();

/// `pthread_atfork`'s three handlers: before the fork, then in the parent or the child.
#[derive(Clone, Copy)]
pub struct ForkHandlers {
    pub prepare: extern "C" fn(),
    pub parent: extern "C" fn(),
    pub child: extern "C" fn(),
}

/// Pages locked and copied at a time.
const BATCH: usize = 64;

pub(crate) fn register(inner: &UnsafeCell<Assembly>) {
    if !MANUAL.load(Relaxed) {
        ATFORK.call_once(|| {
            let _ = HANDLERS.set(ForkHandlers {
                prepare: prepare_c,
                parent: parent_c,
                child: child_c,
            });
            // SAFETY: plain function pointers with C linkage.
            let rc =
                unsafe { libc::pthread_atfork(Some(prepare_c), Some(parent_c), Some(child_c)) };
            if rc != 0 {
                eprintln!(
                    "uswap: pthread_atfork failed ({rc}); a child of fork will not get \
                     its regions' memory"
                );
            }
        });
    }
    registry().push(Entry(inner));
}

pub(crate) fn unregister(inner: &UnsafeCell<Assembly>) {
    registry().retain(|e| !std::ptr::eq(e.0, inner));
}

/// The embedding program (the preload library of `uswap run`) calls [`prepare`],
/// [`parent`] and [`child`] from its own fork handlers, `handlers`, in the order its
/// allocator locks need; uswap registers none of its own, and runs `handlers` around a fork
/// the C library's `fork` did not make. Call it before making the first region.
pub fn handle_fork_manually(handlers: ForkHandlers) {
    MANUAL.store(true, Relaxed);
    let _ = HANDLERS.set(handlers);
}

/// Whether a fork's handlers are running: [`prepare`] has run and neither [`parent`] nor
/// [`child`] yet.
pub(crate) fn in_progress() -> bool {
    // SAFETY: read by the thread that would be forking; another thread's fork at the same
    // moment is taken for this one's, and this one then runs no handlers of its own.
    unsafe { (*std::ptr::addr_of!(HELD)).is_some() }
}

/// Makes a fork that the C library's `fork` did not make (a raw `clone` without
/// `CLONE_VM`, which runs no `pthread_atfork` handlers) with the fork handlers around it,
/// so its child gets its memory as a child of `fork` does: `clone` makes the system call
/// and returns its result, 0 in the child. With no regions, or inside a fork's handlers
/// already, it only calls `clone`.
pub fn around_raw_fork(clone: impl FnOnce() -> i64) -> i64 {
    let Some(h) = HANDLERS.get().filter(|_| !in_progress()) else {
        return clone();
    };
    (h.prepare)();
    let result = clone();
    match result {
        0 => (h.child)(),
        _ => (h.parent)(),
    }
    result
}

extern "C" fn prepare_c() {
    prepare();
}

extern "C" fn parent_c() {
    parent();
}

extern "C" fn child_c() {
    child();
}

/// One region's copy for the child, or why it has none.
enum Copy {
    Made {
        image: RegionImage,
        /// Slots of the region's device held for the child.
        lent: Vec<SlotId>,
        /// Staging frames lent, pinned until the child exists.
        pinned: Vec<u32>,
        owned: Vec<Range<usize>>,
        /// Its device, in `Held::devices`.
        device: usize,
        /// The region's fork fence, held until the child exists.
        fence: Ranked<RwLockWriteGuard<'static, ()>>,
    },
    Failed(Error),
}

/// What the forking thread holds from `prepare` to `parent` or `child`. The copies go
/// first: their fences must be let go while the registry still keeps their regions alive.
struct Held {
    copies: Vec<Copy>,
    /// The child's devices, one per device of the parent's regions (same order).
    devices: Vec<Arc<SwapDevice>>,
    /// The fork's lifeline, when it lends slots.
    lifeline: Option<Pipe>,
    regions: Ranked<MutexGuard<'static, Vec<Entry>>>,
}

/// A pipe: its read and write ends.
struct Pipe {
    read: OwnedFd,
    write: OwnedFd,
}

/// The fork's lifeline (`swapfile/swap_map.rs`), made when its first slot is lent: the
/// child and its descendants keep the write end, the parent watches the read end. `None`
/// inside when no pipe could be made: the pages are copied then.
#[derive(Default)]
struct Lifeline(OnceCell<Option<Pipe>>);

impl Lifeline {
    /// Whether the fork has a lifeline, made now if need be.
    fn ready(&self) -> bool {
        self.0
            .get_or_init(|| {
                let mut fds = [0; 2];
                // SAFETY: `fds` has room for the two descriptors.
                let rc = unsafe { libc::pipe2(fds.as_mut_ptr(), libc::O_CLOEXEC) };
                // SAFETY: on success both are new descriptors owned by nothing else.
                (rc == 0).then(|| unsafe {
                    Pipe {
                        read: OwnedFd::from_raw_fd(fds[0]),
                        write: OwnedFd::from_raw_fd(fds[1]),
                    }
                })
            })
            .is_some()
    }
}

static mut HELD: Option<Held> = None;

/// How long a fork waits for the vma events being handled when it comes to take its notes.
const EVENTS_WAIT: std::time::Duration = std::time::Duration::from_secs(2);

/// How many times a fork looks again, 200 µs apart, when pages it must lend are locked,
/// before it copies them instead.
const LOCKED_LOOKS: u32 = 10;

/// Before the fork system call, in the forking thread: notes every region for the child.
/// Holds the region registry until [`parent`] or [`child`].
///
/// Under every region's fork fence at once, the pages mapped now are noted (they stay
/// mapped until the child exists), and those that are not are lent. A page that cannot be
/// lent (its lock busy: a thread holding a page lock may be waiting for reclaim, which the
/// fences hold up) is copied with every fence let go, while the program and reclaim go
/// on, and the notes are taken again.
pub fn prepare() {
    let _quiet = Quiet::new();
    let regions = registry();
    let mut devices = Devices::default();
    let lifeline = Lifeline::default();
    let mut copiers: Vec<Result<Copier<'_>>> = regions
        .iter()
        .map(|e| {
            // SAFETY: registered regions are alive; see `Entry`.
            let mm = unsafe { &*(*e.0).get() }.fault().mm();
            // Slots lent at earlier forks whose families are done are free again.
            mm.swap().reap_forks();
            mm.swap().begin_fork();
            let device = devices.child_of(mm.swap())?;
            let child_device = devices.children[device].clone();
            Ok(Copier::new(mm, device, child_device, &lifeline))
        })
        .collect();
    let events_deadline = std::time::Instant::now() + EVENTS_WAIT;
    let mut locked_looks = 0;
    let copies = loop {
        let fences: Vec<_> = copiers
            .iter()
            .map(|c| c.as_ref().ok().map(|c| c.mm.fork_fence().exclusive()))
            .collect();
        // Events read and still being handled (an munmap whose pages are not all marked
        // unmapped yet) would give the child pages the program has unmapped, and so
        // whatever was mapped there since: wait for them, fences let go. A read in
        // progress counts too: the program's munmap returns as soon as the kernel hands
        // its event to the read, before the reader has said it holds events.
        let handling = copiers
            .iter()
            .flatten()
            .any(|c| c.mm.fill_gate().changing());
        if handling && std::time::Instant::now() < events_deadline {
            drop(fences);
            std::thread::sleep(std::time::Duration::from_micros(100));
            continue;
        }
        let notes: Vec<Option<Note>> = copiers
            .iter_mut()
            .map(|c| c.as_mut().ok().map(Copier::note))
            .collect();
        if notes.iter().flatten().all(|note| note.left.is_empty()) {
            break made(copiers, notes, fences);
        }
        drop(fences);
        // Every note is taken back before any page lock is waited for.
        let lefts: Vec<Vec<usize>> = copiers
            .iter_mut()
            .zip(notes)
            .map(|(copier, note)| match (copier.as_mut(), note) {
                (Ok(c), Some(note)) => c.undo(note),
                _ => Vec::new(),
            })
            .collect();
        // Pages locked at the look are most often a reclaim batch being written: looked
        // at again a moment later they can be lent, where a copy costs a write each.
        if locked_looks < LOCKED_LOOKS {
            locked_looks += 1;
            std::thread::sleep(std::time::Duration::from_micros(200));
            continue;
        }
        for (copier, left) in copiers.iter_mut().zip(lefts) {
            let Ok(c) = copier.as_mut() else {
                continue;
            };
            if let Err(e) = left.chunks(BATCH).try_for_each(|batch| c.copy(batch)) {
                *copier = Err(e);
            }
        }
    };
    let held = Held {
        copies,
        devices: devices.children,
        lifeline: lifeline.0.into_inner().flatten(),
        regions,
    };
    // SAFETY: only the forking thread touches HELD, between prepare and parent/child.
    unsafe { *std::ptr::addr_of_mut!(HELD) = Some(held) };
}

/// After the fork, in the parent: the regions are not inherited by a fork again unless
/// through these handlers, reclaim goes on, and the child's devices are the child's alone.
pub fn parent() {
    // SAFETY: as in prepare.
    let Some(held) = (unsafe { (*std::ptr::addr_of_mut!(HELD)).take() }) else {
        return;
    };
    for (e, copy) in held.regions.iter().zip(&held.copies) {
        // SAFETY: as in prepare.
        let mm = unsafe { &*(*e.0).get() }.fault().mm();
        mm.swap().end_fork();
        if let Copy::Made {
            owned,
            lent,
            pinned,
            ..
        } = copy
        {
            mm.inherit_on_fork(owned, false);
            if !pinned.is_empty() {
                mm.staging().inherit_on_fork(false);
                mm.staging().unpin(pinned);
            }
            mm.set_reclaim_paused(false);
            let watched = held.lifeline.as_ref().map(|l| l.read.try_clone());
            match watched {
                Some(Ok(fd)) if !lent.is_empty() => mm.swap().watch_fork(fd, lent.clone()),
                // Without a descriptor to watch, the slots stay held while this runs:
                // space lost, never data.
                Some(Err(e)) if !lent.is_empty() => eprintln!(
                    "uswap: cannot watch a fork child's hold on {} swap slots ({e}); they \
                     stay in use until this process exits",
                    lent.len()
                ),
                _ => {}
            }
        }
    }
    // The parent's ends go: the child's write end is the lifeline now.
    drop(held);
}

/// After the fork, in the child (one thread): builds every region again from its copy.
/// A child that cannot have its memory ends here, loudly.
pub fn child() {
    // First: every swap device made before the fork is the parent's from now on (a raw
    // clone's child runs no `pthread_atfork` handler of the swap devices' own).
    crate::swapfile::refresh_pid();
    // SAFETY: as in prepare; the child has this one thread.
    let Some(held) = (unsafe { (*std::ptr::addr_of_mut!(HELD)).take() }) else {
        return;
    };
    let Held {
        copies,
        mut devices,
        lifeline,
        regions,
    } = held;
    if let Some(pipe) = lifeline {
        drop(pipe.read);
        // Kept open for the rest of this process's life (closed by `exec`): while it is,
        // the parent holds the slots lent to this child and to its own fork children.
        std::mem::forget(pipe.write);
    }
    // The fences are the parent's structures' (abandoned here); every copy must be whole.
    let copies: Vec<(RegionImage, Vec<Range<usize>>, usize)> = copies
        .into_iter()
        .map(|copy| match copy {
            Copy::Made {
                image,
                owned,
                device,
                fence,
                ..
            } => {
                drop(fence);
                (image, owned, device)
            }
            Copy::Failed(e) => die(&e),
        })
        .collect();
    // The parent's descriptors go first, so that nothing made here takes their numbers
    // while the abandoned structures still name them.
    // What was lent to the child stays: swap files open, staging areas mapped.
    let lenders: Vec<Lender> = copies
        .iter()
        .flat_map(|(image, ..)| image.lenders.iter().cloned())
        .collect();
    let mut closed: Vec<*const SwapDevice> = Vec::new();
    for e in regions.iter() {
        // SAFETY: as in prepare.
        let old = unsafe { &*(*e.0).get() };
        old.abandon_in_child(&lenders, &mut closed);
    }
    let mut regions = regions;
    for device in &mut devices {
        // The only handle: the parent's went with `parent()` there.
        if let Some(d) = Arc::get_mut(device) {
            d.renew_io();
        }
    }
    let mut inherited = Vec::new();
    for (e, (image, owned, device)) in regions.drain(..).zip(copies) {
        // SAFETY: see `Entry`; the child has one thread and no reference into the old
        // contents, which are abandoned: overwritten without being dropped.
        let cell = unsafe { &*e.0 };
        let old = unsafe { &*cell.get() };
        match rebuild(old, &image, &owned, devices[device].clone()) {
            // SAFETY: as above.
            Ok(inner) => unsafe { std::ptr::write(cell.get(), inner) },
            Err(e) => die(&e),
        }
        inherited.push(e);
    }
    *regions = inherited;
    drop(regions);
}

fn die(e: &Error) -> ! {
    let pid = std::process::id();
    let msg = format!(
        "uswap: child {pid} of fork cannot have its parent's memory ({e}); it is stopped \
         with status 125 rather than run with wrong memory\n"
    );
    // SAFETY: writing a buffer to stderr, then ending the process without running the
    // parent's exit handlers.
    unsafe {
        libc::write(2, msg.as_ptr().cast(), msg.len());
        libc::_exit(125)
    }
}

/// A child's region made as `old` was, at the same address, on the mapping the kernel
/// gave the child, from `image`.
fn rebuild(
    old: &Assembly,
    image: &RegionImage,
    owned: &[Range<usize>],
    device: Arc<SwapDevice>,
) -> Result<Assembly> {
    let mm = old.fault().mm();
    let mut cfg = old.config().clone();
    // The LRU policy and readahead in force, which the program may have switched since
    // the region was made.
    cfg.lru_policy = mm.workingset().policy();
    cfg.readahead = old.fault().readahead.get();
    // A private group was the parent's alone; a tree's group is joined anew.
    cfg.memcg = cfg.memcg.filter(|cg| cg.is_shared());
    // The parent's own runs, where the child has them: a run the program unmapped just
    // before the fork (its event not read yet) is not the child's.
    let owned = mapped_runs(mm.start(), mm.len(), owned);
    let map = crate::mapping::Mapping::inherited(mm.start(), mm.len(), &owned);
    Assembly::build(cfg, device, map, &owned, Contents::Forked(image))
}

/// The child's devices: one made like each device of the parent's regions.
#[derive(Default)]
struct Devices {
    parents: Vec<*const SwapDevice>,
    children: Vec<Arc<SwapDevice>>,
}

impl Devices {
    /// The index of the child's device standing for `parent`, made on first use.
    fn child_of(&mut self, parent: &Arc<SwapDevice>) -> Result<usize> {
        let key = Arc::as_ptr(parent);
        if let Some(i) = self.parents.iter().position(|&p| std::ptr::eq(p, key)) {
            return Ok(i);
        }
        self.children.push(parent.open_like()?);
        self.parents.push(key);
        Ok(self.children.len() - 1)
    }
}

/// The copies, once every region's note found nothing left to copy: each region's runs
/// are let be inherited for the fork, and its fence is held until the child exists.
fn made(
    copiers: Vec<Result<Copier<'_>>>,
    notes: Vec<Option<Note>>,
    fences: Vec<Option<Ranked<RwLockWriteGuard<'_, ()>>>>,
) -> Vec<Copy> {
    let parts = copiers.into_iter().zip(notes).zip(fences);
    parts
        .map(|((copier, note), fence)| match (copier, note, fence) {
            (Ok(c), Some(Note { image, pinned, .. }), Some(fence)) => {
                let pinned: Vec<u32> = pinned.into_iter().map(|(_, frame)| frame).collect();
                let lent = c.lent(&image);
                // SAFETY: the region stays registered, so alive, while the registry is
                // held, which is until `parent` or `child`; `Held` lets the fence go first.
                let fence = unsafe {
                    std::mem::transmute::<
                        Ranked<RwLockWriteGuard<'_, ()>>,
                        Ranked<RwLockWriteGuard<'static, ()>>,
                    >(fence)
                };
                c.mm.set_reclaim_paused(true);
                let owned = owned_runs(c.mm);
                c.mm.inherit_on_fork(&owned, true);
                if !pinned.is_empty() {
                    c.mm.staging().inherit_on_fork(true);
                }
                Copy::Made {
                    owned,
                    image,
                    lent,
                    pinned,
                    device: c.device_index,
                    fence,
                }
            }
            (Err(e), _, _) => Copy::Failed(e),
            _ => unreachable!("a region with a copier has a note and a fence"),
        })
        .collect()
}

/// The page runs of `owned` (of the region at `start`, `len` bytes) that are mapped in
/// this process; `owned` itself when that cannot be found out.
fn mapped_runs(start: usize, len: usize, owned: &[Range<usize>]) -> Vec<Range<usize>> {
    let Some(ranges) = crate::mapping::mapped_ranges(start, start + len) else {
        return owned.to_vec();
    };
    let mapped: Vec<Range<usize>> = ranges
        .into_iter()
        .map(|r| (r.start - start) / PAGE_SIZE..(r.end - start) / PAGE_SIZE)
        .collect();
    let mut runs = Vec::new();
    for own in owned {
        for m in &mapped {
            let (a, b) = (own.start.max(m.start), own.end.min(m.end));
            if a < b {
                match runs.last_mut() {
                    Some(Range { end, .. }) if *end == a => *end = b,
                    _ => runs.push(a..b),
                }
            }
        }
    }
    runs
}

/// The page runs that are still the region's (not unmapped by the program).
fn owned_runs(mm: &Mm) -> Vec<Range<usize>> {
    let pages = mm.pages();
    let mut runs = Vec::new();
    let mut start = 0;
    // Pages outside the used chunks are untouched: the region's own.
    for page in pages.used_runs().into_iter().flatten() {
        if pages.peek(page).0.kind() == Kind::Unmapped {
            if start < page {
                runs.push(start..page);
            }
            start = page + 1;
        }
    }
    if start < pages.len() {
        runs.push(start..pages.len());
    }
    runs
}

/// What the child gets for a page that was not mapped at the fork (but for a staging
/// frame lent: see [`Note::pinned`]).
#[derive(Clone, Copy)]
enum Kept {
    /// A copy, in this slot of the child's device.
    Copied(SlotId),
    /// The page's slot on the region's device, held for the child.
    Lent(SlotId),
    /// What an ancestor lent this process (slot or frame `at` of `Mm::lenders()[lender]`),
    /// passed on.
    Passed { lender: u32, at: u32 },
    /// Nothing: its data is lost, and the child's accesses fail too.
    Lost,
}

/// A region's note, taken under its fork fence.
struct Note {
    image: RegionImage,
    /// Pages not mapped and not yet copied or lent, for a copy with the fences let go.
    left: Vec<usize>,
    /// What the note lent (slots, and what an ancestor lent), by page.
    lent: Vec<(u32, Kept)>,
    /// Inactive pages whose staging frames the note lent, (page, frame); the frames are
    /// pinned (their data kept) until the child exists.
    pinned: Vec<(u32, u32)>,
}

/// Where a locked page that is not mapped has its data.
enum Source {
    /// In a staging frame, which only its lock holder changes.
    Parked(usize),
    Slot(SlotId),
    /// Borrowed from what an ancestor lent: read at once.
    Borrowed,
    Lost,
}

struct Copier<'a> {
    mm: &'a Mm,
    /// The child's device (in `Held::devices` at `device_index`).
    device: Arc<SwapDevice>,
    device_index: usize,
    lifeline: &'a Lifeline,
    /// A batch's buffers, made by the first copy: most forks (a shell's, before `exec`)
    /// have nothing to copy.
    bufs: Vec<PageBuf>,
    /// Pages that were not mapped, copied (or lent) with the fences let go.
    copied: HashMap<u32, Kept>,
}

impl<'a> Copier<'a> {
    fn new(
        mm: &'a Mm,
        device_index: usize,
        device: Arc<SwapDevice>,
        lifeline: &'a Lifeline,
    ) -> Self {
        Copier {
            mm,
            device,
            device_index,
            lifeline,
            bufs: Vec::new(),
            copied: HashMap::new(),
        }
    }

    /// The slots of the region's device held for the child whose `image` this is.
    fn lent(&self, image: &RegionImage) -> Vec<SlotId> {
        let own = image
            .lenders
            .iter()
            .position(|l| l.same(&Lender::Device(self.mm.swap().clone())));
        let lent = image
            .borrowed
            .iter()
            .filter(|&&(_, lender, _)| Some(lender as usize) == own);
        lent.map(|&(_, _, slot)| slot).collect()
    }

    /// What the child gets of a locked swapped (or clean inactive) page without a copy:
    /// its slot lent, or what an ancestor lent this process passed on; `None` when the
    /// page must be copied.
    fn lend(&self, lock: &PageLock<'_>) -> Option<Kept> {
        let state = lock.state();
        match (lock.kind(), state.slot(), state.borrowed()) {
            (Kind::Swapped, _, Some((lender, at))) => Some(Kept::Passed { lender, at }),
            // A parked page with a slot is clean: the slot holds its data too.
            (Kind::Swapped | Kind::Inactive, Some(slot), None)
                if self.lifeline.ready() && self.mm.swap().share_with_fork(slot) =>
            {
                self.mm.count(VmEvent::fork_lent, 1);
                Some(Kept::Lent(slot))
            }
            _ => None,
        }
    }

    /// Takes back what a note that is not used lent, and returns its pages left over.
    fn undo(&mut self, note: Note) -> Vec<usize> {
        for (_, kept) in note.lent {
            if let Kept::Lent(slot) = kept {
                self.mm.uncount(VmEvent::fork_lent, 1);
                self.mm.swap().unshare_with_fork(slot);
            }
        }
        let frames: Vec<u32> = note.pinned.iter().map(|&(_, frame)| frame).collect();
        self.mm.uncount(VmEvent::fork_lent, frames.len() as u64);
        self.mm.staging().unpin(&frames);
        note.left
    }

    /// Copies those of `pages` (at most a batch, in address order) that are not mapped and
    /// not copied yet to the child's device. (Nothing is lent here: between the fences a
    /// lent page could leave what it was lent from, and the next note keeps a copy.)
    fn copy(&mut self, pages: &[usize]) -> Result<()> {
        let table = self.mm.pages();
        let locks: Vec<PageLock<'_>> = pages
            .iter()
            .filter(|&&p| !self.copied.contains_key(&(p as u32)))
            .map(|&p| table.lock(p))
            .filter(|l| matches!(l.kind(), Kind::Inactive | Kind::Swapped | Kind::Poisoned))
            .collect();
        if locks.is_empty() {
            return Ok(());
        }
        if self.bufs.is_empty() {
            self.bufs = (0..BATCH).map(|_| PageBuf::new()).collect();
        }
        let sources = self.read(&locks);
        self.write(&locks, &sources)
    }

    /// Under the fork fence: the image of the region as the child gets it, with what is
    /// not mapped lent, and the pages that could be neither lent nor copied yet (the
    /// fences must be let go to copy them). A page copied earlier that is mapped now, or
    /// was discarded since, gives its copy back.
    fn note(&mut self) -> Note {
        let pages: &PageTable = self.mm.pages();
        let mut note = Note {
            image: RegionImage::default(),
            left: Vec::new(),
            lent: Vec::new(),
            pinned: Vec::new(),
        };
        // One look per page decides it: a page seen swapped may be swapped in a moment
        // later (swap-ins pass the fence), and must then keep its copy, which the child
        // drops for the mapped page the kernel gives it; looking twice could lose both.
        // A page that is not mapped is looked at under its lock.
        for page in pages.used_runs().into_iter().flatten() {
            let (state, locked) = pages.peek(page);
            let kind = state.kind();
            let unmapped = matches!(kind, Kind::Inactive | Kind::Swapped | Kind::Poisoned);
            if !self.copied.is_empty() && self.copied.contains_key(&(page as u32)) {
                if unmapped {
                    continue;
                }
                self.drop_copy(page);
            }
            if unmapped {
                match pages.try_lock(page) {
                    Some(lock) => self.note_unmapped(lock, &mut note),
                    None => note.left.push(page),
                }
            } else if locked && matches!(kind, Kind::Lazyfree | Kind::Discarded | Kind::None) {
                // A discard or a first touch under way may leave it mapped or not: the
                // child finds out at its first access, as for a lazily freed page.
                note.image.lazyfree.push(page as u32);
            } else {
                note_mapped(page, kind, &mut note.image);
            }
        }
        let mut lenders = Lenders::default();
        // The region's own device, named once (not a lookup per page lent).
        let mut own = None;
        let image = &mut note.image;
        let copied = self.copied.iter().map(|(&page, &kept)| (page, kept));
        for (page, kept) in note.lent.iter().copied().chain(copied) {
            match kept {
                Kept::Copied(slot) => image.pages.push((page, slot)),
                Kept::Lost => image.poisoned.push(page),
                Kept::Lent(slot) => {
                    let lender = *own.get_or_insert_with(|| {
                        lenders.index(&Lender::Device(self.mm.swap().clone()))
                    });
                    image.borrowed.push((page, lender, slot));
                }
                Kept::Passed { lender, at } => {
                    let lender = lenders.index(&self.mm.lenders()[lender as usize]);
                    image.borrowed.push((page, lender, at));
                }
            }
        }
        if !note.pinned.is_empty() {
            let staging = self.mm.staging().mapping();
            let lender = lenders.index(&Lender::Staging {
                base: staging.addr(),
                len: staging.len(),
            });
            for &(page, frame) in &note.pinned {
                image.borrowed.push((page, lender, frame));
            }
        }
        image.lenders = lenders.0;
        note
    }

    /// A page not mapped at the last look, locked: lent (its slot or frame, or what an
    /// ancestor lent), lost, or left to be copied; or noted as what it has become since.
    /// A frame is pinned: the page may leave it before the fork, its data may not.
    fn note_unmapped(&self, lock: PageLock<'_>, note: &mut Note) {
        let page = lock.page();
        let state = lock.state();
        match (lock.kind(), state.frame(), state.slot()) {
            (Kind::Inactive, Some(frame), None) => {
                self.mm.staging().pin(&[frame]);
                self.mm.count(VmEvent::fork_lent, 1);
                note.pinned.push((page as u32, frame));
            }
            (Kind::Inactive | Kind::Swapped, ..) => match self.lend(&lock) {
                Some(kept) => note.lent.push((page as u32, kept)),
                None => note.left.push(page),
            },
            (Kind::Poisoned, ..) => note.image.poisoned.push(page as u32),
            (kind, ..) => note_mapped(page, kind, &mut note.image),
        }
    }

    /// A page copied with the fences let go is mapped now, or was discarded: the copy goes.
    fn drop_copy(&mut self, page: usize) {
        match self.copied.remove(&(page as u32)) {
            Some(Kept::Copied(slot)) => self.device.free_slot(slot),
            Some(Kept::Lent(slot)) => {
                self.mm.uncount(VmEvent::fork_lent, 1);
                self.mm.swap().unshare_with_fork(slot);
            }
            _ => {}
        }
    }

    /// Reads the locked pages into the buffers.
    fn read(&mut self, locks: &[PageLock<'_>]) -> Vec<Source> {
        let mm = self.mm;
        let mut sources: Vec<Source> = locks
            .iter()
            .map(|l| match (l.kind(), l.state().frame(), l.state().slot()) {
                (Kind::Inactive, Some(frame), _) => Source::Parked(mm.staging().addr(frame)),
                (Kind::Swapped, _, Some(slot)) => Source::Slot(slot),
                (Kind::Swapped, ..) if l.state().borrowed().is_some() => Source::Borrowed,
                _ => Source::Lost,
            })
            .collect();
        let mut reads: Vec<(SlotId, *mut u8)> = Vec::new();
        let mut read_index = Vec::new();
        for i in 0..sources.len() {
            match sources[i] {
                // SAFETY: a staging frame of a locked inactive page.
                Source::Parked(addr) => unsafe { copy_page(addr, &mut self.bufs[i]) },
                Source::Borrowed => {
                    let dst = self.bufs[i].as_mut_ptr();
                    // SAFETY: the buffer is a page-aligned page, not otherwise used.
                    if unsafe { mm.read_swapped(locks[i].state(), dst) }.is_err() {
                        sources[i] = Source::Lost;
                    }
                }
                Source::Slot(slot) => {
                    reads.push((slot, self.bufs[i].as_mut_ptr()));
                    read_index.push(i);
                }
                Source::Lost => {}
            }
        }
        if !reads.is_empty() {
            // SAFETY: each buffer is a page-aligned page, not otherwise used meanwhile.
            let results = unsafe { mm.swap().read_pages(&reads) };
            for ((i, result), &(slot, dst)) in read_index.into_iter().zip(results).zip(&reads) {
                // One batch read is not retried: read the page alone, with its re-reads.
                // SAFETY: as above.
                if result.is_err() && unsafe { mm.swap().read_page(slot, dst) }.is_err() {
                    sources[i] = Source::Lost;
                }
            }
        }
        sources
    }

    /// Writes what `read` gathered to new slots of the child's device.
    fn write(&mut self, locks: &[PageLock<'_>], sources: &[Source]) -> Result<()> {
        let mut batch: Vec<(SlotId, *const u8)> = Vec::new();
        let mut written = Vec::new();
        for (i, (l, source)) in locks.iter().zip(sources).enumerate() {
            if let Source::Lost = source {
                self.copied.insert(l.page() as u32, Kept::Lost);
                continue;
            }
            let slot = self
                .device
                .alloc_slot()
                .ok_or_else(|| Error::SwapExhausted {
                    needed: 1,
                    free: 0,
                    capacity: self.device.capacity_pages(),
                })?;
            batch.push((slot, self.bufs[i].as_ptr()));
            written.push((l.page() as u32, slot));
        }
        // SAFETY: the buffers are page-aligned pages, unchanged until this returns.
        let results = unsafe { self.device.write_pages(&batch) };
        for result in results {
            result.map_err(|source| Error::Os {
                op: "writing a fork child's copy of a page",
                source,
            })?;
        }
        self.mm.count(VmEvent::fork_copied, written.len() as u64);
        self.copied.extend(
            written
                .into_iter()
                .map(|(page, slot)| (page, Kept::Copied(slot))),
        );
        Ok(())
    }
}

/// Notes a page that is mapped (or lazily freed, or has nothing) in the image.
fn note_mapped(page: usize, kind: Kind, image: &mut RegionImage) {
    match kind {
        Kind::Active => image.add_mapped(page),
        Kind::Lazyfree => image.lazyfree.push(page as u32),
        _ => {}
    }
}

/// What a child's image names for its borrowed pages, each once.
#[derive(Default)]
struct Lenders(Vec<Lender>);

impl Lenders {
    fn index(&mut self, lender: &Lender) -> u32 {
        let found = self.0.iter().position(|l| l.same(lender));
        let i = found.unwrap_or_else(|| {
            self.0.push(lender.clone());
            self.0.len() - 1
        });
        i as u32
    }
}

/// # Safety
/// `addr` must be a readable page that does not fault.
unsafe fn copy_page(addr: usize, buf: &mut PageBuf) {
    std::ptr::copy_nonoverlapping(addr as *const u8, buf.as_mut_ptr(), PAGE_SIZE);
}
