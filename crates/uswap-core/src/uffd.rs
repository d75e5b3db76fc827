//! userfaultfd: creation, feature detection and the raw ioctls uswap uses.
//!
//! The `userfaultfd` crate builds its bindings with bindgen (libclang at build time) and has
//! no MOVE, POISON or register-mode-WP-with-COPY-WP support, so the few structures and
//! ioctl numbers of `include/uapi/linux/userfaultfd.h` are declared here.

use crate::error::{Error, Result};
use crate::mmap_changing::{MmapChanging, Raised};
use crate::PAGE_SIZE;
use std::io;
use std::os::fd::{AsRawFd, FromRawFd, OwnedFd, RawFd};
use std::sync::Arc;

pub const API: u64 = 0xAA;

pub const FEATURE_SIGBUS: u64 = 1 << 7;
pub const FEATURE_THREAD_ID: u64 = 1 << 8;
pub const FEATURE_POISON: u64 = 1 << 14;
/// Write-protect faults resolved by the kernel without a message: a write only clears the
/// page's protection, which `PAGEMAP_SCAN` then reports as written (Linux 6.7).
pub const FEATURE_WP_ASYNC: u64 = 1 << 15;
pub const FEATURE_MOVE: u64 = 1 << 16;
/// Write-protect faults on anonymous memory (`UFFD_FEATURE_PAGEFAULT_FLAG_WP`).
pub const FEATURE_WP: u64 = 1 << 0;
/// The non-cooperative events: mremap, madvise(DONTNEED/FREE/REMOVE), munmap.
pub const FEATURE_EVENT_REMAP: u64 = 1 << 2;
pub const FEATURE_EVENT_REMOVE: u64 = 1 << 3;
pub const FEATURE_EVENT_UNMAP: u64 = 1 << 6;

const FEATURE_NAMES: &[(u64, &str)] = &[
    (1 << 0, "pagefault_flag_wp"),
    (1 << 1, "event_fork"),
    (1 << 2, "event_remap"),
    (1 << 3, "event_remove"),
    (1 << 6, "event_unmap"),
    (1 << 7, "sigbus"),
    (1 << 8, "thread_id"),
    (1 << 11, "exact_address"),
    (1 << 13, "wp_unpopulated"),
    (1 << 14, "poison"),
    (1 << 15, "wp_async"),
    (1 << 16, "move"),
];

pub const REGISTER_MODE_MISSING: u64 = 1 << 0;
pub const REGISTER_MODE_WP: u64 = 1 << 1;

pub const EVENT_PAGEFAULT: u8 = 0x12;
pub const EVENT_REMAP: u8 = 0x14;
pub const EVENT_REMOVE: u8 = 0x15;
pub const EVENT_UNMAP: u8 = 0x16;
pub const PAGEFAULT_FLAG_WRITE: u64 = 1 << 0;
pub const PAGEFAULT_FLAG_WP: u64 = 1 << 1;

const COPY_MODE_WP: u64 = 1 << 1;
const MOVE_MODE_DONTWAKE: u64 = 1 << 0;
const MOVE_MODE_ALLOW_SRC_HOLES: u64 = 1 << 1;
const WRITEPROTECT_MODE_WP: u64 = 1 << 0;

const fn iowr(nr: u64, size: usize) -> u64 {
    (3 << 30) | ((size as u64) << 16) | (0xAA << 8) | nr
}
const fn ior(nr: u64, size: usize) -> u64 {
    (2 << 30) | ((size as u64) << 16) | (0xAA << 8) | nr
}

#[repr(C)]
#[derive(Default)]
struct ApiArg {
    api: u64,
    features: u64,
    ioctls: u64,
}

#[repr(C)]
#[derive(Default, Clone, Copy)]
struct Range {
    start: u64,
    len: u64,
}

#[repr(C)]
struct RegisterArg {
    range: Range,
    mode: u64,
    ioctls: u64,
}

#[repr(C)]
struct CopyArg {
    dst: u64,
    src: u64,
    len: u64,
    mode: u64,
    copied: i64,
}

#[repr(C)]
struct WriteProtectArg {
    range: Range,
    mode: u64,
}

#[repr(C)]
struct PoisonArg {
    range: Range,
    mode: u64,
    updated: i64,
}

const UFFDIO_API: u64 = iowr(0x3F, std::mem::size_of::<ApiArg>());
const UFFDIO_REGISTER: u64 = iowr(0x00, std::mem::size_of::<RegisterArg>());
const UFFDIO_UNREGISTER: u64 = ior(0x01, std::mem::size_of::<Range>());
const UFFDIO_WAKE: u64 = ior(0x02, std::mem::size_of::<Range>());
const UFFDIO_COPY: u64 = iowr(0x03, std::mem::size_of::<CopyArg>());
// struct uffdio_move has the same layout as uffdio_copy.
const UFFDIO_MOVE: u64 = iowr(0x05, std::mem::size_of::<CopyArg>());
const UFFDIO_WRITEPROTECT: u64 = iowr(0x06, std::mem::size_of::<WriteProtectArg>());
const UFFDIO_POISON: u64 = iowr(0x08, std::mem::size_of::<PoisonArg>());
const USERFAULTFD_IOC_NEW: u64 = 0xAA00;

/// One message read from the userfaultfd (`struct uffd_msg`, 32 bytes): an event code and
/// three words whose meaning depends on it.
#[repr(C)]
#[derive(Clone, Copy, Default)]
pub struct Msg {
    pub event: u8,
    _reserved: [u8; 7],
    arg: [u64; 3],
}

/// A decoded message.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Event {
    /// An access to a missing page, or a write to a write-protected one; `write` says the
    /// access was a write; `tid` is the faulting thread (0 without
    /// UFFD_FEATURE_THREAD_ID).
    Fault {
        address: usize,
        write_protect: bool,
        write: bool,
        tid: u32,
    },
    /// mremap moved `len` bytes from `from` to `to`.
    Remap { from: usize, to: usize, len: usize },
    /// madvise(MADV_DONTNEED/MADV_FREE/MADV_REMOVE) on `[start, end)`.
    Remove { start: usize, end: usize },
    /// munmap (or the part of an mremap that unmaps) of `[start, end)`.
    Unmap { start: usize, end: usize },
    /// Something uswap did not register for (fork).
    Other(u8),
}

impl Msg {
    pub fn decode(&self) -> Event {
        let [a, b, c] = self.arg;
        match self.event {
            EVENT_PAGEFAULT => Event::Fault {
                address: b as usize,
                write_protect: a & PAGEFAULT_FLAG_WP != 0,
                write: a & PAGEFAULT_FLAG_WRITE != 0,
                tid: c as u32,
            },
            EVENT_REMAP => Event::Remap {
                from: a as usize,
                to: b as usize,
                len: c as usize,
            },
            EVENT_REMOVE => Event::Remove {
                start: a as usize,
                end: b as usize,
            },
            EVENT_UNMAP => Event::Unmap {
                start: a as usize,
                end: b as usize,
            },
            other => Event::Other(other),
        }
    }
}

/// What the running kernel offers.
#[derive(Clone, Debug, serde::Serialize)]
pub struct Probe {
    pub kernel: String,
    pub features: Vec<&'static str>,
    #[serde(skip)]
    pub feature_bits: u64,
}

impl Probe {
    pub fn has(&self, bit: u64) -> bool {
        self.feature_bits & bit != 0
    }
}

impl std::fmt::Display for Probe {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        writeln!(f, "kernel: {}", self.kernel)?;
        write!(f, "userfaultfd features: {}", self.features.join(" "))
    }
}

/// The kernel release (`uname -r`).
pub fn kernel_release() -> String {
    // SAFETY: utsname is plain data; uname fills it.
    let mut u: libc::utsname = unsafe { std::mem::zeroed() };
    if unsafe { libc::uname(&mut u) } != 0 {
        return "unknown".into();
    }
    let bytes: Vec<u8> = u
        .release
        .iter()
        .take_while(|&&c| c != 0)
        .map(|&c| c as u8)
        .collect();
    String::from_utf8_lossy(&bytes).into_owned()
}

/// Detects what userfaultfd offers here, with a throw-away descriptor.
pub fn probe() -> Result<Probe> {
    let fd = open_raw()?;
    let mut arg = ApiArg {
        api: API,
        ..Default::default()
    };
    // SAFETY: valid descriptor and argument.
    if unsafe { libc::ioctl(fd.as_raw_fd(), UFFDIO_API as _, &mut arg) } != 0 {
        return Err(Error::os("UFFDIO_API"));
    }
    Ok(Probe {
        kernel: kernel_release(),
        features: FEATURE_NAMES
            .iter()
            .filter(|(bit, _)| arg.features & bit != 0)
            .map(|&(_, name)| name)
            .collect(),
        feature_bits: arg.features,
    })
}

fn open_raw() -> Result<OwnedFd> {
    let flags = libc::O_CLOEXEC | libc::O_NONBLOCK;
    // SAFETY: plain system call.
    let fd = unsafe { libc::syscall(libc::SYS_userfaultfd, flags) } as RawFd;
    if fd >= 0 {
        // SAFETY: we own the new descriptor.
        return Ok(unsafe { OwnedFd::from_raw_fd(fd) });
    }
    let syscall_err = io::Error::last_os_error();
    match syscall_err.raw_os_error() {
        Some(libc::EPERM) | Some(libc::EACCES) => {
            let dev = open_dev(flags);
            #[cfg(test)]
            let dev = dev.or_else(|e| open_user_mode_only(flags).ok_or(e));
            dev.map_err(|dev_err| Error::UffdNotPermitted {
                cause: format!(
                    "userfaultfd(2): {syscall_err}; /dev/userfaultfd: {dev_err}; \
                     vm.unprivileged_userfaultfd = {}",
                    std::fs::read_to_string("/proc/sys/vm/unprivileged_userfaultfd")
                        .map(|s| s.trim().to_string())
                        .unwrap_or_else(|_| "unknown".into())
                ),
            })
        }
        Some(libc::ENOSYS) => Err(Error::UffdUnavailable(format!(
            "kernel {} was built without CONFIG_USERFAULTFD",
            kernel_release()
        ))),
        _ => Err(Error::UffdUnavailable(syscall_err.to_string())),
    }
}

/// Unit tests without root: the descriptor an unprivileged user may have, which sees only
/// faults of user-mode accesses (a system call's access to a missing page gets EFAULT).
/// The unit tests touch region memory from user mode only; a program's system calls do
/// not, so `uswap run` and the library never take this mode.
#[cfg(test)]
fn open_user_mode_only(flags: i32) -> Option<OwnedFd> {
    const UFFD_USER_MODE_ONLY: i32 = 1;
    // SAFETY: plain system call.
    let fd = unsafe { libc::syscall(libc::SYS_userfaultfd, flags | UFFD_USER_MODE_ONLY) } as RawFd;
    // SAFETY: we own the new descriptor.
    (fd >= 0).then(|| unsafe { OwnedFd::from_raw_fd(fd) })
}

fn open_dev(flags: i32) -> io::Result<OwnedFd> {
    let dev = std::fs::OpenOptions::new()
        .read(true)
        .write(true)
        .open("/dev/userfaultfd")?;
    // SAFETY: valid descriptor; the ioctl returns a new descriptor.
    let fd = unsafe { libc::ioctl(dev.as_raw_fd(), USERFAULTFD_IOC_NEW as _, flags) };
    if fd < 0 {
        return Err(io::Error::last_os_error());
    }
    // SAFETY: we own the new descriptor.
    Ok(unsafe { OwnedFd::from_raw_fd(fd) })
}

/// A COPY or MOVE that stopped part-way: `done` bytes were filled before `error`.
#[derive(Debug)]
pub struct Partial {
    pub done: usize,
    pub error: io::Error,
}

impl std::fmt::Display for Partial {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "{} (after {} bytes)", self.error, self.done)
    }
}

/// How often COPY/MOVE retry EAGAIN before reporting it.
const EAGAIN_RETRIES: u32 = 8;

impl Partial {
    /// The range stopped being there (unmapped or remapped under the operation): not a
    /// failure of the page, the access is retried by the program.
    pub fn vanished(&self) -> bool {
        matches!(self.error.raw_os_error(), Some(libc::ENOENT | libc::ESRCH))
    }

    /// Nothing was filled and the range is not (all) registered: the range vanished, or,
    /// when it was more than a page, it spans two mappings of the region (the program
    /// changed the protection of part of it, as runtimes commit their heaps), which a
    /// fill cannot cross. Callers then fill what they must one page at a time.
    pub fn failed_whole(&self) -> bool {
        self.done == 0 && self.vanished()
    }

    /// A non-cooperative event is pending: back out and retry after it is handled.
    pub fn busy(&self) -> bool {
        self.error.raw_os_error() == Some(libc::EAGAIN)
    }
}

/// A read of a userfaultfd that failed but may succeed again: interrupted, or the kernel
/// was short of memory for an event.
pub(crate) fn transient(e: &io::Error) -> bool {
    matches!(e.raw_os_error(), Some(libc::EINTR | libc::ENOMEM))
}

/// The region's userfaultfd cannot be read: no fault or event in it can be served from now
/// on, and the threads waiting on them would sleep in the kernel for ever. The process
/// stops, loudly.
pub(crate) fn unreadable(region: usize, e: &io::Error) -> ! {
    eprintln!(
        "uswap: fatal: reading the userfaultfd of the region at {region:#x} failed: {e}; no \
         fault in it can be served any more, so the process stops here (SIGABRT) rather than \
         hang"
    );
    std::process::abort()
}

/// An open userfaultfd with its API handshake done. Its fills pass the region's
/// [`MmapChanging`] gate, and it reads messages only with that fence raised.
pub struct Uffd {
    fd: OwnedFd,
    gate: Arc<MmapChanging>,
    /// Test hook: the next read of messages fails with EIO.
    fail_next_read: std::sync::atomic::AtomicBool,
    /// With asynchronous write protection (`FEATURE_WP_ASYNC`) every page filled is
    /// write-protected, so that it reads as written only once the program writes it.
    protect_fills: bool,
}

/// Whether a move left the page at `src` and landed at `dst` without the kernel counting
/// it. Linux 6.18 (6.18.44 here) does that under load: a UFFDIO_MOVE of 64 pages whose
/// accessed bits another thread clears moved all 64 and failed with ENOENT, 0 moved, in 53
/// of 1,500 calls (`move_tests`). As we read its batched move loop, a batch that meets
/// EAGAIN (a PTE changed under it) is retried, the stale EAGAIN outlives the retry's
/// success, and the call stops at the page it has just moved (its source now empty:
/// ENOENT; a destination now full: EEXIST) counting only the pages before the batch.
/// Trusting that count leaves a page's data at `dst` while its owner believes it at `src`:
/// the page is lost on its next access.
fn moved_uncounted(dst: usize, src: usize) -> bool {
    mapped(dst) && !mapped(src)
}

/// Whether the page at `addr` has a page-table entry that maps it (mincore; false where
/// nothing is mapped at all).
fn mapped(addr: usize) -> bool {
    let mut resident = 0u8;
    // SAFETY: one page's residency, into one byte.
    let ret = unsafe { libc::mincore(addr as *mut libc::c_void, PAGE_SIZE, &mut resident) };
    ret == 0 && resident & 1 != 0
}

fn check(ret: libc::c_int) -> io::Result<()> {
    if ret == 0 {
        Ok(())
    } else {
        Err(io::Error::last_os_error())
    }
}

impl Uffd {
    /// Opens a userfaultfd with exactly `features` enabled, its fills passing `gate`.
    pub(crate) fn open(features: u64, gate: Arc<MmapChanging>) -> Result<Uffd> {
        let fd = open_raw()?;
        let mut arg = ApiArg {
            api: API,
            features,
            ioctls: 0,
        };
        // SAFETY: valid descriptor and argument.
        if unsafe { libc::ioctl(fd.as_raw_fd(), UFFDIO_API as _, &mut arg) } != 0 {
            return Err(Error::os("UFFDIO_API"));
        }
        Ok(Uffd {
            fd,
            gate,
            fail_next_read: Default::default(),
            protect_fills: features & FEATURE_WP_ASYNC != 0,
        })
    }

    pub fn raw(&self) -> RawFd {
        self.fd.as_raw_fd()
    }

    pub fn register(&self, start: usize, len: usize, mode: u64) -> io::Result<()> {
        let mut arg = RegisterArg {
            range: Range {
                start: start as u64,
                len: len as u64,
            },
            mode,
            ioctls: 0,
        };
        // SAFETY: valid descriptor and argument.
        check(unsafe { libc::ioctl(self.raw(), UFFDIO_REGISTER as _, &mut arg) })
    }

    /// Removes `[start, start + len)` from this userfaultfd: its faults go back to the
    /// kernel's ordinary handling.
    pub fn unregister(&self, start: usize, len: usize) -> io::Result<()> {
        let mut arg = Range {
            start: start as u64,
            len: len as u64,
        };
        // SAFETY: valid descriptor and argument.
        check(unsafe { libc::ioctl(self.raw(), UFFDIO_UNREGISTER as _, &mut arg) })
    }

    /// Atomically fills `len` bytes at `dst` (unmapped) with a copy of `src`, optionally
    /// write-protected (always, with asynchronous write protection), and wakes the threads
    /// waiting on that range. On failure, says how many bytes were filled.
    pub fn copy(
        &self,
        dst: usize,
        src: *const u8,
        len: usize,
        write_protect: bool,
    ) -> std::result::Result<(), Partial> {
        let mode = if write_protect || self.protect_fills {
            COPY_MODE_WP
        } else {
            0
        };
        self.fill(UFFDIO_COPY, dst, src as usize, len, mode)
    }

    /// Atomically moves the pages at `src` to the unmapped `dst` (zero copy), waking the
    /// threads waiting on `dst` when asked to. On failure, says how many bytes did move.
    pub fn move_pages(
        &self,
        dst: usize,
        src: usize,
        len: usize,
        wake: bool,
    ) -> std::result::Result<(), Partial> {
        let mode = if wake { 0 } else { MOVE_MODE_DONTWAKE };
        self.fill(UFFDIO_MOVE, dst, src, len, mode)
    }

    /// Moves whatever pages are present in `[src, src + len)` to `dst` and skips the holes;
    /// for taking pages out of the region without knowing which are mapped.
    pub fn move_present(
        &self,
        dst: usize,
        src: usize,
        len: usize,
    ) -> std::result::Result<(), Partial> {
        self.fill(
            UFFDIO_MOVE,
            dst,
            src,
            len,
            MOVE_MODE_DONTWAKE | MOVE_MODE_ALLOW_SRC_HOLES,
        )
    }

    /// COPY and MOVE share a layout and both may complete partially or ask to be retried.
    /// EAGAIN is retried a few times; it persists while a non-cooperative event (mremap,
    /// madvise, munmap) is queued and not yet read, so it is then returned: the caller backs
    /// out and lets the thread that reads events get on. A MOVE that failed is checked
    /// against the page tables: pages it moved without counting them (`moved_uncounted`)
    /// count as moved, and the move goes on after them.
    fn fill(
        &self,
        op: u64,
        dst: usize,
        src: usize,
        len: usize,
        mode: u64,
    ) -> std::result::Result<(), Partial> {
        let mut done = 0usize;
        let mut eagain = 0;
        while done < len {
            let mut arg = CopyArg {
                dst: (dst + done) as u64,
                src: (src + done) as u64,
                len: (len - done) as u64,
                mode,
                copied: 0,
            };
            let Some(pass) = self.gate.enter_fill() else {
                return Err(Partial {
                    done,
                    error: io::Error::from_raw_os_error(libc::EAGAIN),
                });
            };
            // SAFETY: valid descriptor and argument; the kernel checks the ranges.
            let ret = unsafe { libc::ioctl(self.raw(), op as _, &mut arg) };
            drop(pass);
            if arg.copied > 0 {
                done += arg.copied as usize;
            }
            if ret != 0 {
                let err = io::Error::last_os_error();
                if op == UFFDIO_MOVE
                    && matches!(err.raw_os_error(), Some(libc::ENOENT | libc::EEXIST))
                {
                    let counted = done;
                    while done < len && moved_uncounted(dst + done, src + done) {
                        done += PAGE_SIZE;
                    }
                    if done > counted {
                        // The kernel wakes only for the pages it counted.
                        if mode & MOVE_MODE_DONTWAKE == 0 {
                            let _ = self.wake(dst + counted, done - counted);
                        }
                        continue;
                    }
                }
                eagain += 1;
                if err.raw_os_error() != Some(libc::EAGAIN) || eagain > EAGAIN_RETRIES {
                    return Err(Partial { done, error: err });
                }
                std::thread::yield_now();
            }
        }
        Ok(())
    }

    /// Sets or clears write protection on a range; clearing wakes the waiting threads.
    pub fn write_protect(&self, start: usize, len: usize, protect: bool) -> io::Result<()> {
        let mut arg = WriteProtectArg {
            range: Range {
                start: start as u64,
                len: len as u64,
            },
            mode: if protect { WRITEPROTECT_MODE_WP } else { 0 },
        };
        // SAFETY: valid descriptor and argument.
        check(unsafe { libc::ioctl(self.raw(), UFFDIO_WRITEPROTECT as _, &mut arg) })
    }

    /// Marks the range poisoned: every later access gets SIGBUS (a kernel access EFAULT),
    /// like a hardware memory error.
    pub fn poison(&self, start: usize, len: usize) -> io::Result<()> {
        let mut arg = PoisonArg {
            range: Range {
                start: start as u64,
                len: len as u64,
            },
            mode: 0,
            updated: 0,
        };
        let _pass = self
            .gate
            .enter_fill()
            .ok_or_else(|| io::Error::from_raw_os_error(libc::EAGAIN))?;
        // SAFETY: valid descriptor and argument.
        check(unsafe { libc::ioctl(self.raw(), UFFDIO_POISON as _, &mut arg) })
    }

    pub fn wake(&self, start: usize, len: usize) -> io::Result<()> {
        let mut r = Range {
            start: start as u64,
            len: len as u64,
        };
        // SAFETY: valid descriptor and argument.
        check(unsafe { libc::ioctl(self.raw(), UFFDIO_WAKE as _, &mut r) })
    }

    /// Reads pending messages without blocking, with the fence up (see `mmap_changing.rs`):
    /// how many were read, and, when they hold a vma event, the fence, which keeps fills
    /// out until the caller has handled the events and drops it.
    pub(crate) fn read_messages(&self, out: &mut [Msg]) -> io::Result<(usize, Option<Raised<'_>>)> {
        let raised = self.gate.raise();
        let n = self.read_raw(out)?;
        let events = out[..n]
            .iter()
            .any(|m| !matches!(m.decode(), Event::Fault { .. }));
        Ok(if events {
            raised.hold_for_events();
            (n, Some(raised))
        } else {
            (n, None)
        })
    }

    /// Test hook: the next [`Uffd::read_messages`] fails with EIO, as a kernel error would.
    pub(crate) fn fail_next_read(&self) {
        self.fail_next_read
            .store(true, std::sync::atomic::Ordering::Relaxed);
    }

    fn read_raw(&self, out: &mut [Msg]) -> io::Result<usize> {
        if self
            .fail_next_read
            .swap(false, std::sync::atomic::Ordering::Relaxed)
        {
            return Err(io::Error::from_raw_os_error(libc::EIO));
        }
        let size = std::mem::size_of::<Msg>();
        // SAFETY: `out` is valid for its length in bytes; Msg is plain data.
        let n = unsafe {
            libc::read(
                self.raw(),
                out.as_mut_ptr().cast(),
                std::mem::size_of_val(out),
            )
        };
        if n < 0 {
            let err = io::Error::last_os_error();
            return if err.raw_os_error() == Some(libc::EAGAIN) {
                Ok(0)
            } else {
                Err(err)
            };
        }
        Ok(n as usize / size)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn ioctl_numbers_match_the_kernel_abi() {
        assert_eq!(std::mem::size_of::<Msg>(), 32);
        assert_eq!(UFFDIO_API, 0xc018_aa3f);
        assert_eq!(UFFDIO_REGISTER, 0xc020_aa00);
        assert_eq!(UFFDIO_UNREGISTER, 0x8010_aa01);
        assert_eq!(UFFDIO_COPY, 0xc028_aa03);
        assert_eq!(UFFDIO_MOVE, 0xc028_aa05);
        assert_eq!(UFFDIO_WRITEPROTECT, 0xc018_aa06);
        assert_eq!(UFFDIO_POISON, 0xc020_aa08);
    }

    #[test]
    fn messages_decode_by_event() {
        let msg = |event, arg| Msg {
            event,
            arg,
            ..Default::default()
        };
        assert_eq!(
            msg(EVENT_PAGEFAULT, [PAGEFAULT_FLAG_WP, 0x1000, 7]).decode(),
            Event::Fault {
                address: 0x1000,
                write_protect: true,
                write: false,
                tid: 7
            }
        );
        assert_eq!(
            msg(EVENT_PAGEFAULT, [PAGEFAULT_FLAG_WRITE, 0x2000, 0]).decode(),
            Event::Fault {
                address: 0x2000,
                write_protect: false,
                write: true,
                tid: 0
            }
        );
        assert_eq!(
            msg(EVENT_REMAP, [1, 2, 3]).decode(),
            Event::Remap {
                from: 1,
                to: 2,
                len: 3
            }
        );
        assert_eq!(
            msg(EVENT_REMOVE, [4, 5, 0]).decode(),
            Event::Remove { start: 4, end: 5 }
        );
        assert_eq!(
            msg(EVENT_UNMAP, [4, 5, 0]).decode(),
            Event::Unmap { start: 4, end: 5 }
        );
        assert_eq!(msg(0x13, [0; 3]).decode(), Event::Other(0x13));
    }

    #[test]
    fn probe_reports_the_kernel_and_missing_fault_support() {
        let p = probe().expect("tests run where userfaultfd is permitted (root)");
        assert!(!p.kernel.is_empty());
        assert_eq!(
            p.features.len(),
            (p.feature_bits & FEATURE_NAMES.iter().map(|f| f.0).sum::<u64>()).count_ones() as usize
        );
    }
}

#[cfg(all(test, not(loom)))]
mod move_tests {
    use super::*;
    use std::sync::atomic::{AtomicBool, Ordering};

    const PAGES: usize = 64;

    fn map_anon(pages: usize) -> usize {
        // SAFETY: a fresh private anonymous mapping.
        let addr = unsafe {
            libc::mmap(
                std::ptr::null_mut(),
                pages * PAGE_SIZE,
                libc::PROT_READ | libc::PROT_WRITE,
                libc::MAP_PRIVATE | libc::MAP_ANONYMOUS,
                -1,
                0,
            )
        };
        assert_ne!(addr, libc::MAP_FAILED);
        // SAFETY: our own mapping; huge pages would move as a whole or split.
        unsafe { libc::madvise(addr, pages * PAGE_SIZE, libc::MADV_NOHUGEPAGE) };
        addr as usize
    }

    fn page_number(addr: usize) -> u64 {
        // SAFETY: a mapped page of our own.
        unsafe { std::ptr::read_volatile(addr as *const u64) }
    }

    /// The count a move reports is what moved: the pages before it are at the destination,
    /// the rest at the source, each with its own data. A thread ages both areas all along
    /// (MADV_COLD clears the accessed bits the reads set), so the kernel meets PTEs that
    /// changed under it and retries batches with EAGAIN, where Linux 6.18 loses count of a
    /// batch (see `moved_uncounted`).
    #[test]
    fn a_move_reports_exactly_the_pages_it_moved_while_they_are_aged() {
        let uffd = match Uffd::open(FEATURE_MOVE, Arc::new(MmapChanging::default())) {
            Ok(uffd) => uffd,
            Err(e) => return eprintln!("skipped: no userfaultfd with UFFDIO_MOVE here: {e}"),
        };
        let len = PAGES * PAGE_SIZE;
        let (mut from, mut to) = (map_anon(PAGES), map_anon(PAGES));
        for area in [from, to] {
            uffd.register(area, len, REGISTER_MODE_MISSING).unwrap();
        }
        let mut page = vec![0u8; PAGE_SIZE];
        for i in 0..PAGES {
            page[..8].copy_from_slice(&(i as u64).to_le_bytes());
            uffd.copy(from + i * PAGE_SIZE, page.as_ptr(), PAGE_SIZE, false)
                .unwrap();
        }
        let stop = Arc::new(AtomicBool::new(false));
        let ager = {
            let stop = stop.clone();
            std::thread::spawn(move || {
                while !stop.load(Ordering::Relaxed) {
                    for area in [from, to] {
                        // SAFETY: advice on our own mappings; MADV_COLD keeps the data.
                        unsafe { libc::madvise(area as *mut libc::c_void, len, libc::MADV_COLD) };
                    }
                }
            })
        };
        let mut partial = 0;
        for round in 0..1500 {
            for i in 0..PAGES {
                page_number(from + i * PAGE_SIZE);
            }
            let moved = match uffd.move_pages(to, from, len, false) {
                Ok(()) => PAGES,
                Err(p) => p.done / PAGE_SIZE,
            };
            partial += usize::from(moved < PAGES);
            for i in 0..PAGES {
                let (at, away) = if i < moved { (to, from) } else { (from, to) };
                let (at, away) = (at + i * PAGE_SIZE, away + i * PAGE_SIZE);
                assert!(
                    mapped(at) && !mapped(away),
                    "round {round}: page {i} not where a move of {moved} pages puts it"
                );
                assert_eq!(page_number(at), i as u64, "round {round}");
            }
            let mut rest = moved;
            while rest < PAGES {
                let at = rest * PAGE_SIZE;
                rest = match uffd.move_pages(to + at, from + at, len - at, false) {
                    Ok(()) => PAGES,
                    Err(p) => rest + p.done / PAGE_SIZE,
                };
            }
            std::mem::swap(&mut from, &mut to);
        }
        stop.store(true, Ordering::Relaxed);
        ager.join().unwrap();
        eprintln!("{partial} of 1500 moves stopped part way");
        for area in [from, to] {
            // SAFETY: our own mappings, no longer used.
            unsafe { libc::munmap(area as *mut libc::c_void, len) };
        }
    }
}
