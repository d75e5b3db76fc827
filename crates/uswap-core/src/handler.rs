//! Thread mode: handler threads read fault events from the userfaultfd and resolve them.
//! Kernel accesses (a `read()` into a swapped-out page) are served like user accesses.

use crate::error::{Error, Result};
use crate::fault::Outcome;
use crate::region::RegionCore;
use crate::uffd::{Msg, EVENT_PAGEFAULT, PAGEFAULT_FLAG_WP};
use std::os::fd::{AsRawFd, FromRawFd, OwnedFd};
use std::sync::atomic::{AtomicUsize, Ordering::Relaxed};
use std::sync::{Arc, Mutex};
use std::thread::JoinHandle;
use std::time::{Duration, Instant};

pub(crate) struct Handlers {
    stop: OwnedFd,
    threads: Vec<JoinHandle<()>>,
}

impl Handlers {
    pub fn start(core: &Arc<RegionCore>) -> Result<Handlers> {
        // SAFETY: plain system call; we own the new descriptor.
        let fd = unsafe { libc::eventfd(0, libc::EFD_CLOEXEC) };
        if fd < 0 {
            return Err(Error::os("eventfd"));
        }
        let mut handlers = Handlers {
            stop: unsafe { OwnedFd::from_raw_fd(fd) },
            threads: Vec::new(),
        };
        let shared = Arc::new(Shared {
            leader: Mutex::new(()),
            busy: AtomicUsize::new(0),
        });
        for i in 0..core.cfg.handler_threads {
            let (core, stop, shared) = (core.clone(), fd, shared.clone());
            let t = std::thread::Builder::new()
                .name(format!("uswap-fault-{i}"))
                .spawn(move || serve(&core, stop, &shared))
                .map_err(|source| Error::Os {
                    op: "spawn fault handler",
                    source,
                })?;
            handlers.threads.push(t);
        }
        Ok(handlers)
    }

    /// Stops and joins the handler threads.
    pub fn stop(mut self) {
        let one: u64 = 1;
        // SAFETY: writing 8 bytes to our eventfd; every poller sees it readable.
        unsafe { libc::write(self.stop.as_raw_fd(), (&one as *const u64).cast(), 8) };
        for t in self.threads.drain(..) {
            let _ = t.join();
        }
    }
}

/// Leader/follower: one handler at a time waits for events (spinning briefly, then in
/// poll), hands leadership on as soon as it has events, and resolves them. Only one thread
/// wakes per event, and a fault that follows soon after the last one finds a handler already
/// running instead of waking a sleeping CPU: on a VM that wake-up costs more than the fault.
fn serve(core: &RegionCore, stop: i32, shared: &Shared) {
    let mut msgs = [Msg::default(); 16];
    loop {
        let n = {
            let _leader = shared.leader.lock().unwrap_or_else(|e| e.into_inner());
            match next_events(core, stop, &mut msgs, &shared.busy) {
                Some(n) => n,
                None => return,
            }
        };
        let _busy = Busy::enter(&shared.busy);
        for m in msgs[..n].iter().filter(|m| m.event == EVENT_PAGEFAULT) {
            let Some(page) = core.page_of(m.address as usize) else {
                continue;
            };
            let wp = m.flags & PAGEFAULT_FLAG_WP != 0;
            if let Outcome::Fatal = core.handle_fault(page, Some(wp)) {
                kill_faulting_thread(m.ptid);
            }
        }
    }
}

/// What the handler threads of one region share.
struct Shared {
    /// Held by the one thread waiting for events.
    leader: Mutex<()>,
    /// Handlers resolving faults right now.
    busy: AtomicUsize,
}

/// Counts a handler as busy while alive.
struct Busy<'a>(&'a AtomicUsize);

impl<'a> Busy<'a> {
    fn enter(count: &'a AtomicUsize) -> Self {
        count.fetch_add(1, Relaxed);
        Busy(count)
    }
}

impl Drop for Busy<'_> {
    fn drop(&mut self) {
        self.0.fetch_sub(1, Relaxed);
    }
}

/// Waits for fault events; `None` when the region is shutting down or the descriptor failed.
/// Spins first only while no other handler is busy: a busy handler means a faulting thread
/// is blocked, and a spinning CPU would take time from that fault's I/O and from kswapd.
fn next_events(
    core: &RegionCore,
    stop: i32,
    msgs: &mut [Msg],
    busy: &AtomicUsize,
) -> Option<usize> {
    let spin = if busy.load(Relaxed) == 0 {
        core.cfg.handler_spin_us
    } else {
        0
    };
    let spin_until = Instant::now() + Duration::from_micros(spin);
    loop {
        match core.uffd.read_events(msgs) {
            Ok(0) => {}
            Ok(n) => return Some(n),
            Err(e) => {
                eprintln!("uswap: reading userfaultfd events failed: {e}; fault handler stops");
                return None;
            }
        }
        if core.shutdown.load(Relaxed) {
            return None;
        }
        if Instant::now() < spin_until {
            std::hint::spin_loop();
            continue;
        }
        let mut fds = [
            libc::pollfd {
                fd: core.uffd.raw(),
                events: libc::POLLIN,
                revents: 0,
            },
            libc::pollfd {
                fd: stop,
                events: libc::POLLIN,
                revents: 0,
            },
        ];
        // SAFETY: valid pollfd array.
        let ready = unsafe { libc::poll(fds.as_mut_ptr(), 2, -1) };
        if ready < 0 && std::io::Error::last_os_error().kind() != std::io::ErrorKind::Interrupted {
            return None;
        }
        if fds[1].revents != 0 {
            return None;
        }
    }
}

/// Delivers SIGBUS to the thread whose fault could not be served. Without its thread id
/// (no UFFD_FEATURE_THREAD_ID) the whole process is aborted: never leave it hanging.
fn kill_faulting_thread(tid: u32) {
    if tid == 0 {
        std::process::abort();
    }
    // SAFETY: plain system calls; a stale tid at worst fails with ESRCH.
    unsafe {
        libc::syscall(
            libc::SYS_tgkill,
            libc::getpid(),
            tid as libc::pid_t,
            libc::SIGBUS,
        );
    }
}
