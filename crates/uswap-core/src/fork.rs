//! `fork(2)` for regions: the child gets a region of its own at the same address, holding
//! the memory as it was when the parent forked (resident, inactive and swapped pages
//! alike), as the kernel gives a child its parent's anonymous memory.
//!
//! The kernel cannot give it here. A region's mapping is `MADV_DONTFORK`: a child sharing
//! the parent's pages would stop `UFFDIO_MOVE` from taking them in the parent (it moves
//! only pages mapped once), and, without the parent's userfaultfd, would read zeros where
//! pages are out on swap. So uswap checkpoints each region to a swap device of the
//! child's:
//!
//! - **prepare** (the parent, in the forking thread, just before the fork system call):
//!   for each region, a new swap device made like the region's (an unlinked file beside
//!   it), and every page holding data is written to a slot of it, a resident page from
//!   memory and a swapped one from its slot (verified on the way). Pages are locked while
//!   they are copied, and mapped ones are read inside the fill gate, so no vma event's zap
//!   lands meanwhile, through `/proc/self/mem`, which fails instead of waiting on a page
//!   that is not there (the kernel may drop a lazily freed page at any time: it then reads
//!   as zeros in the child). The image says which page went to which slot.
//! - **child**: each region is built again at the same address from its image: every
//!   page with data is `Swapped` in the child's own device, and comes back on access. The
//!   parent's structures, copied into the child's memory, are abandoned and never dropped
//!   (their threads do not exist there); the descriptors they hold are closed, so the
//!   child cannot act on the parent's memory through them.
//! - **parent**: lets go of the child's device. Nothing of its own changed.
//!
//! Parent and child share no page and no slot afterwards: each reclaims and swaps on its
//! own, within its own limit or its share of the tree's (`memcg.rs`). The cost is paid by
//! the fork: it writes every page of its regions that holds data, and the child starts
//! with nothing resident. A child that cannot get its copy (no space for the device, a
//! write error) is stopped with a message and exit status 125 before it runs any code of
//! the program: it would read wrong memory otherwise.
//!
//! Regions of both fault modes are copied. A SIGBUS-mode child gets a SIGBUS service of
//! its own, and the parent's registration is forgotten there (`sigbus::Service::
//! forget_in_child`), so the child's faults find the child's region. Syscall dispatch is
//! not inherited (the kernel clears it in a child): a child that wants it turns it on.
//!
//! Pages are copied batch after batch while the program's other threads run. A page that
//! another thread writes during the fork reaches the child with its old or its new
//! contents, as with a write racing the kernel's fork; unlike the kernel's fork, a write
//! to a page copied earlier is not held back until the fork ends.
//!
//! Lock order: the registry lock, then page locks (a batch at a time, in address order),
//! then what reclaim and the swap device take under them.

use crate::assembly::Assembly;
use crate::error::{Error, Result};
use crate::fork_image::RegionImage;
use crate::lockdep::{Rank, Ranked};
use crate::mm::Mm;
use crate::page::{Kind, PageLock};
use crate::signals::Quiet;
use crate::swapfile::swap_io::PageBuf;
use crate::swapfile::{SlotId, SwapDevice};
use crate::sync::lock_std;
use crate::PAGE_SIZE;
use std::cell::UnsafeCell;
use std::ops::Range;
use std::os::unix::fs::FileExt;
use std::sync::atomic::{AtomicBool, Ordering::Relaxed};
use std::sync::{Arc, Mutex, MutexGuard, Once, OnceLock};
use std::time::Duration;

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
        owned: Vec<Range<usize>>,
        /// Page ranges the program gave a protection other than read-write.
        protections: Vec<(Range<usize>, libc::c_int)>,
        /// Its device, in `Held::devices`.
        device: usize,
    },
    Failed(Error),
}

/// What the forking thread holds from `prepare` to `parent` or `child`.
struct Held {
    regions: Ranked<MutexGuard<'static, Vec<Entry>>>,
    copies: Vec<Copy>,
    /// The child's devices, one per device of the parent's regions (same order).
    devices: Vec<Arc<SwapDevice>>,
}

static mut HELD: Option<Held> = None;

/// Before the fork system call, in the forking thread: copies every region for the
/// child. Holds the region registry until [`parent`] or [`child`].
pub fn prepare() {
    let _quiet = Quiet::new();
    let regions = registry();
    let mut devices = Devices::default();
    let copies = regions
        .iter()
        // SAFETY: registered regions are alive; see `Entry`.
        .map(|e| copy_region(unsafe { &*(*e.0).get() }, &mut devices))
        .collect();
    let held = Held {
        regions,
        copies,
        devices: devices.children,
    };
    // SAFETY: only the forking thread touches HELD, between prepare and parent/child.
    unsafe { *std::ptr::addr_of_mut!(HELD) = Some(held) };
}

/// After the fork, in the parent: the child's devices are the child's alone now.
pub fn parent() {
    // SAFETY: as in prepare.
    drop(unsafe { (*std::ptr::addr_of_mut!(HELD)).take() });
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
        regions,
        copies,
        mut devices,
    } = held;
    // Before anything is mapped: the regions' addresses, held.
    for (e, copy) in regions.iter().zip(&copies) {
        // SAFETY: as in prepare.
        let start = unsafe { &*(*e.0).get() }.fault().mm().start();
        let reserved = match copy {
            Copy::Made { owned, .. } => crate::mapping::Mapping::reserve_in_child(start, owned),
            Copy::Failed(_) => Ok(()),
        };
        if let Err(e) = reserved {
            die(&e);
        }
    }
    // The parent's descriptors go next, so that nothing made here takes their numbers
    // while the abandoned structures still name them.
    let mut closed: Vec<*const SwapDevice> = Vec::new();
    for e in regions.iter() {
        // SAFETY: as in prepare.
        let old = unsafe { &*(*e.0).get() };
        old.abandon_in_child(&mut closed);
    }
    let mut regions = regions;
    for device in &mut devices {
        // The only handle: the parent's went with `parent()` there.
        if let Some(d) = Arc::get_mut(device) {
            d.renew_io();
        }
    }
    let mut inherited = Vec::new();
    for (e, copy) in regions.drain(..).zip(copies) {
        let (image, owned, protections, device) = match copy {
            Copy::Made {
                image,
                owned,
                protections,
                device,
            } => (image, owned, protections, &devices[device]),
            Copy::Failed(e) => die(&e),
        };
        // SAFETY: see `Entry`; the child has one thread and no reference into the old
        // contents, which are abandoned: overwritten without being dropped.
        let cell = unsafe { &*e.0 };
        let old = unsafe { &*cell.get() };
        let start = old.fault().mm().start();
        match rebuild(old, &image, &owned, device.clone()) {
            // SAFETY: as above.
            Ok(inner) => unsafe { std::ptr::write(cell.get(), inner) },
            Err(e) => die(&e),
        }
        protect(start, &owned, &protections);
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

/// A child's region made as `old` was, at the same address, from `image`.
fn rebuild(
    old: &Assembly,
    image: &RegionImage,
    owned: &[Range<usize>],
    device: Arc<SwapDevice>,
) -> Result<Assembly> {
    let mm = old.fault().mm();
    let mut cfg = old.config().clone();
    // A private group was the parent's alone; a tree's group is joined anew.
    cfg.memcg = cfg.memcg.filter(|cg| cg.is_shared());
    let map = crate::mapping::Mapping::fixed(mm.start(), mm.len(), owned)?;
    Assembly::build(cfg, device, map, owned, Some(image))
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

/// Copies one region for the child, onto the child's device standing for its own.
fn copy_region(inner: &Assembly, devices: &mut Devices) -> Copy {
    let fault = inner.fault();
    let mm = fault.mm();
    let device = match devices.child_of(mm.swap()) {
        Ok(i) => i,
        Err(e) => return Copy::Failed(e),
    };
    let memory = match std::fs::File::open("/proc/self/mem") {
        Ok(m) => m,
        Err(source) => {
            return Copy::Failed(Error::Os {
                op: "opening /proc/self/mem",
                source,
            })
        }
    };
    let mut copier = Copier {
        mm,
        memory: &memory,
        device: &devices.children[device],
        bufs: (0..BATCH).map(|_| PageBuf::new()).collect(),
        image: RegionImage::default(),
    };
    let pages = mm.pages().len();
    for first in (0..pages).step_by(BATCH) {
        if let Err(e) = copier.copy_batch(first..(first + BATCH).min(pages)) {
            return Copy::Failed(e);
        }
    }
    let image = copier.image;
    Copy::Made {
        protections: protections(mm.start(), mm.len()),
        owned: owned_runs(mm),
        image,
        device,
    }
}

/// The page ranges of `[start, start + len)` with a protection other than read-write
/// (`mprotect` by the program), from `/proc/self/maps`; none when it cannot be read.
fn protections(start: usize, len: usize) -> Vec<(Range<usize>, libc::c_int)> {
    let Ok(maps) = std::fs::read_to_string("/proc/self/maps") else {
        return Vec::new();
    };
    let end = start + len;
    let mut found = Vec::new();
    for line in maps.lines() {
        let mut fields = line.split_whitespace();
        let (Some(range), Some(perms)) = (fields.next(), fields.next()) else {
            continue;
        };
        let Some((a, b)) = range.split_once('-') else {
            continue;
        };
        let (Ok(a), Ok(b)) = (usize::from_str_radix(a, 16), usize::from_str_radix(b, 16)) else {
            continue;
        };
        let (a, b) = (a.max(start), b.min(end));
        if a >= b {
            continue;
        }
        let bit = |i: usize, c: u8, p: libc::c_int| {
            if perms.as_bytes().get(i) == Some(&c) {
                p
            } else {
                0
            }
        };
        let prot = bit(0, b'r', libc::PROT_READ)
            | bit(1, b'w', libc::PROT_WRITE)
            | bit(2, b'x', libc::PROT_EXEC);
        if prot != libc::PROT_READ | libc::PROT_WRITE {
            found.push(((a - start) / PAGE_SIZE..(b - start) / PAGE_SIZE, prot));
        }
    }
    found
}

/// Gives the child's region (at `start`) the protections the parent's had, within its
/// own runs (what lies in the gaps is someone else's).
fn protect(start: usize, owned: &[Range<usize>], protections: &[(Range<usize>, libc::c_int)]) {
    for (range, prot) in protections {
        for run in owned {
            let (a, b) = (range.start.max(run.start), range.end.min(run.end));
            if a < b {
                // SAFETY: pages of the child's own region.
                unsafe {
                    libc::mprotect(
                        (start + a * PAGE_SIZE) as *mut libc::c_void,
                        (b - a) * PAGE_SIZE,
                        *prot,
                    )
                };
            }
        }
    }
}

/// The page runs that are still the region's (not unmapped by the program).
fn owned_runs(mm: &Mm) -> Vec<Range<usize>> {
    let mut runs = Vec::new();
    let mut page = 0;
    let pages = mm.pages().len();
    while page < pages {
        let owned = |p: usize| mm.pages().peek(p).0.kind() != Kind::Unmapped;
        if !owned(page) {
            page += 1;
            continue;
        }
        let start = page;
        while page < pages && owned(page) {
            page += 1;
        }
        runs.push(start..page);
    }
    runs
}

/// Kinds whose page holds data (or lost data) a child must get.
fn holds_data(kind: Kind) -> bool {
    matches!(
        kind,
        Kind::Active | Kind::Inactive | Kind::Swapped | Kind::Lazyfree | Kind::Poisoned
    )
}

/// Where a locked page's data is read from.
enum Source {
    /// Mapped in the region: read inside the fill gate.
    Mapped(usize),
    /// In a staging frame, or anywhere else only its lock holder changes.
    Parked(usize),
    Slot(SlotId),
    /// A lazily freed page the kernel dropped: it reads as zeros, in the child too.
    Zero,
    Lost,
}

struct Copier<'a> {
    mm: &'a Mm,
    /// `/proc/self/mem`.
    memory: &'a std::fs::File,
    device: &'a Arc<SwapDevice>,
    bufs: Vec<PageBuf>,
    image: RegionImage,
}

impl Copier<'_> {
    /// Copies the pages of `range` that hold data to the child's device.
    fn copy_batch(&mut self, range: Range<usize>) -> Result<()> {
        let pages = self.mm.pages();
        if !range.clone().any(|p| holds_data(pages.peek(p).0.kind())) {
            return Ok(());
        }
        let mut round = 0u32;
        loop {
            let locks: Vec<PageLock<'_>> = range
                .clone()
                .filter(|&p| holds_data(pages.peek(p).0.kind()))
                .map(|p| pages.lock(p))
                .filter(|l| holds_data(l.kind()))
                .collect();
            let sources = self.read(&locks);
            let Some(sources) = sources else {
                // Vma events are being handled and may need these page locks.
                drop(locks);
                std::thread::sleep(Duration::from_micros(50 << round.min(6)));
                round += 1;
                continue;
            };
            return self.write(&locks, &sources);
        }
    }

    /// Reads the locked pages into the buffers; `None` when vma events are being handled
    /// and the batch must let go of its locks first.
    fn read(&mut self, locks: &[PageLock<'_>]) -> Option<Vec<Source>> {
        let mm = self.mm;
        let mut sources: Vec<Source> = locks
            .iter()
            .map(|l| match (l.kind(), l.state().frame()) {
                (Kind::Active | Kind::Lazyfree, _) => Source::Mapped(mm.page_addr(l.page())),
                (Kind::Inactive, Some(frame)) => Source::Parked(mm.staging().addr(frame)),
                (Kind::Swapped, _) => match l.state().slot() {
                    Some(slot) => Source::Slot(slot),
                    None => Source::Lost,
                },
                _ => Source::Lost,
            })
            .collect();
        if sources.iter().any(|s| matches!(s, Source::Mapped(_))) {
            // Inside the gate no vma event is read, so no zap runs until it is left.
            let _pass = mm.fill_gate().enter_fill()?;
            for (i, (l, source)) in locks.iter().zip(sources.iter_mut()).enumerate() {
                let Source::Mapped(addr) = *source else {
                    continue;
                };
                // A mapped page the kernel no longer has would fault here, on a page this
                // thread holds locked: a lazily freed one was dropped by the kernel (it
                // reads as zeros), any other was taken from under uswap (lost).
                let gone = mm
                    .pagemap_entry(l.page())
                    .is_some_and(|e| !e.present && !e.kernel_swapped);
                if gone {
                    *source = match l.kind() {
                        Kind::Lazyfree => Source::Zero,
                        _ => Source::Lost,
                    };
                    continue;
                }
                // Through /proc/self/mem, which reads a page the program made unreadable
                // (mprotect) instead of faulting.
                if self
                    .memory
                    .read_exact_at(self.bufs[i].as_mut_slice(), addr as u64)
                    .is_err()
                {
                    *source = Source::Lost;
                }
            }
        }
        let mut reads: Vec<(SlotId, *mut u8)> = Vec::new();
        let mut read_index = Vec::new();
        for (i, source) in sources.iter().enumerate() {
            match *source {
                // SAFETY: a staging frame of a locked inactive page.
                Source::Parked(addr) => unsafe { copy_page(addr, &mut self.bufs[i]) },
                Source::Slot(slot) => {
                    reads.push((slot, self.bufs[i].as_mut_ptr()));
                    read_index.push(i);
                }
                _ => {}
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
        Some(sources)
    }

    /// Writes what `read` gathered to new slots of the child's device.
    fn write(&mut self, locks: &[PageLock<'_>], sources: &[Source]) -> Result<()> {
        let mut batch: Vec<(SlotId, *const u8)> = Vec::new();
        let mut written = Vec::new();
        for (i, (l, source)) in locks.iter().zip(sources).enumerate() {
            match source {
                Source::Lost => {
                    self.image.poisoned.push(l.page() as u32);
                    continue;
                }
                Source::Zero => continue,
                _ => {}
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
        self.image.pages.extend(written);
        Ok(())
    }
}

/// # Safety
/// `addr` must be a readable page that does not fault.
unsafe fn copy_page(addr: usize, buf: &mut PageBuf) {
    std::ptr::copy_nonoverlapping(addr as *const u8, buf.as_mut_ptr(), PAGE_SIZE);
}
