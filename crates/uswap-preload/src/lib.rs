//! The preload library of `uswap run`: an unmodified, dynamically linked program's
//! anonymous memory in a uswap region, limited in what it keeps resident, the rest swapped.
//!
//! `uswap run` sets `LD_PRELOAD` to this library and [`uswap_core::run::ENV`] to the
//! region's settings. When the library is loaded (before the program's own constructors),
//! it makes the region (the space), starts uswap's threads, and from then on serves:
//! - `malloc` and its family from arenas whose segments are the space's (`heap`);
//! - private anonymous read-write `mmap`s from the space, with `munmap` and `mremap` on
//!   them (`mmap`); jemalloc-style allocators land here;
//! - `madvise` unchanged: the kernel tells uswap about discards through userfaultfd.
//!
//! uswap's own allocations never use the space (`internal`). Faults are served by handler
//! threads (thread mode), so the program's system calls can read and write its memory; or,
//! in SIGBUS mode, by the faulting thread itself, every program thread running with
//! syscall dispatch (`uswap_core::syscall_dispatch`) so that its system calls still can.

mod book;
mod calls;
mod credentials;
mod fork;
mod heap;
mod internal;
mod large;
mod mmap;
mod outside;
mod program;
mod runs;
mod space;
mod stdio;
mod sys;
mod threads;

use std::path::PathBuf;
use std::sync::{Arc, Mutex, OnceLock};
use uswap_core::control::ControlServer;
use uswap_core::memcg::MemCgroup;
use uswap_core::run::{Settings, ENV};
use uswap_core::{FaultMode, Region};

/// Runs when the library is loaded, before the program's constructors.
#[used]
#[link_section = ".init_array"]
static INIT: extern "C" fn() = init;

extern "C" fn init() {
    let _inside = internal::Inside::enter();
    let Ok(text) = std::env::var(ENV) else {
        return;
    };
    let program = std::env::args().next().unwrap_or_default();
    fork::register();
    calls::resolve_all();
    warm_up_name_services();
    match start(&text) {
        Ok((region, commit_limit)) => {
            let _own = uswap_core::syscall_dispatch::OwnCalls::new();
            serve_control(&region, program);
            space::install(region, commit_limit);
            // SAFETY: registering a function with C linkage.
            unsafe { libc::atexit(at_exit) };
        }
        Err(e) => {
            // Running the program without its limit would hide the failure; stop instead.
            sys::warn(&format!(
                "uswap run: cannot put {program} in uswap memory: {e}\n"
            ));
            // The tree's memory cgroup file goes with the last process, as at exit.
            if let Some(cg) = MEMCG.get() {
                cg.last_one_out();
            }
            // SAFETY: ending the process before the program starts.
            unsafe { libc::_exit(125) };
        }
    }
}

/// Has the C library allocate its name service state now, from the internal heap: a child
/// of fork rewrites that state before any fork handler runs, before uswap has given the
/// child its memory. Any lookup allocates it. This one looks up an entry every system's
/// `/etc/networks` has: a database `nscd` does not cache (a cached answer would leave the
/// state unmade), found in the file, so a `networks: files dns` setting (Fedora, RHEL)
/// never reaches DNS; it costs a third of a lookup in the services database, where the C
/// library may first look for a `db` module on every library path (Debian).
fn warm_up_name_services() {
    extern "C" {
        // The C library's (POSIX); the `libc` crate declares only its `_r` form.
        fn getnetbyname(name: *const libc::c_char) -> *mut libc::c_void;
    }
    // SAFETY: a lookup by a NUL-terminated name; the result is not used.
    unsafe { getnetbyname(c"loopback".as_ptr()) };
}

/// Starts the control socket of `uswap stat` and `uswap ctl`, whose thread also watches
/// the memory outside uswap (`outside`); the program runs without them (and is told) if
/// it cannot be made.
fn serve_control(region: &Arc<Region>, program: String) {
    let watch = outside::watch(region.clone(), program);
    match ControlServer::start_with_watch(region.clone(), Some(watch)) {
        Ok(server) => {
            let path = server.path().to_path_buf();
            // The server lives as long as the process; its socket goes at exit.
            std::mem::forget(server);
            *CONTROL_SOCKET.lock().unwrap_or_else(|e| e.into_inner()) = Some(path);
        }
        Err(e) => sys::warn(&format!(
            "uswap run: no control socket for uswap stat/ctl: {e}\n"
        )),
    }
}

/// A child of fork: the parent's control server (its thread is not here) is left alone,
/// and the child answers `uswap stat` and `uswap ctl` on a socket of its own.
fn child_control() {
    *CONTROL_SOCKET.lock().unwrap_or_else(|e| e.into_inner()) = None;
    if let Some(space) = space::get() {
        let _own = uswap_core::syscall_dispatch::OwnCalls::new();
        let program = std::env::args().next().unwrap_or_default();
        serve_control(space.region(), program);
    }
}

/// This process's control socket, removed at exit.
static CONTROL_SOCKET: Mutex<Option<PathBuf>> = Mutex::new(None);

/// The tree's memory cgroup, when this program shares one.
static MEMCG: OnceLock<Arc<MemCgroup>> = OnceLock::new();

/// On the way out: the control socket goes, and the tree's memory cgroup file if this was
/// the last process of the tree.
extern "C" fn at_exit() {
    if let Some(path) = CONTROL_SOCKET
        .lock()
        .unwrap_or_else(|e| e.into_inner())
        .take()
    {
        let _ = std::fs::remove_file(path);
    }
    if let Some(cg) = MEMCG.get() {
        cg.last_one_out();
    }
}

/// Whether the program's `malloc` is this library's: a program that brings its own (a
/// statically linked tcmalloc or jemalloc) would put the C library's allocations for
/// uswap's threads in memory uswap swaps, where a fault handler could wait for itself.
fn malloc_is_ours() -> bool {
    // SAFETY: looking up a symbol by a NUL-terminated name.
    let found = unsafe { libc::dlsym(libc::RTLD_DEFAULT, c"malloc".as_ptr()) };
    std::ptr::eq(found.cast_const(), heap::malloc as *const libc::c_void)
}

/// The program's system calls must see its swapped-out memory: in SIGBUS mode its threads
/// run with syscall dispatch, this one first (before the region, so that a kernel without
/// it is refused, or in auto mode gets thread mode, before anything is made).
fn fault_mode(asked: FaultMode) -> uswap_core::Result<FaultMode> {
    use uswap_core::syscall_dispatch::{enable_for_this_thread, supported_here};
    let mode = match asked {
        FaultMode::Auto if program::is_go() => {
            sys::warn(
                "uswap run: a Go program: its signal handlers need the signal stacks Go sets \
                 up, which SIGBUS mode cannot give them; faults are served by handler \
                 threads (thread mode)\n",
            );
            FaultMode::Thread
        }
        FaultMode::Sigbus if program::is_go() => {
            return Err(uswap_core::Error::InvalidConfig {
                what: "fault mode",
                why: "sigbus cannot serve a Go program (Go's signal handlers need the signal \
                      stacks Go sets up); use --fault-mode auto or thread"
                    .into(),
            })
        }
        // This thread is the first to get dispatch: tried on it, not in a probe thread.
        FaultMode::Auto if !supported_here() => {
            sys::warn(
                "uswap run: this kernel has no syscall user dispatch (Linux 5.11+, x86-64): \
                 faults are served by handler threads (thread mode)\n",
            );
            FaultMode::Thread
        }
        FaultMode::Auto | FaultMode::Sigbus => FaultMode::Sigbus,
        FaultMode::Thread => FaultMode::Thread,
    };
    if mode == FaultMode::Sigbus {
        enable_for_this_thread()?;
        uswap_core::syscall_direct::prepare_thread();
    }
    Ok(mode)
}

/// The program's region, and how much of it may be committed at once.
fn start(text: &str) -> uswap_core::Result<(Arc<Region>, u64)> {
    if !malloc_is_ours() {
        return Err(uswap_core::Error::InvalidConfig {
            what: "program",
            why: "it brings a malloc of its own (linked into the executable), which uswap \
                  cannot serve from its memory"
                .into(),
        });
    }
    let mut settings = Settings::parse(text)?;
    settings.config.fault_mode = fault_mode(settings.config.fault_mode)?;
    let _own = uswap_core::syscall_dispatch::OwnCalls::new();
    if settings.config.fault_mode == FaultMode::Sigbus {
        threads::dispatch_in_new_threads();
    }
    settings.config.memcg =
        settings
            .memcg
            .as_deref()
            .and_then(|p| match MemCgroup::open_shared(p) {
                Ok(cg) => {
                    cg.forget_previous_image();
                    Some(MEMCG.get_or_init(|| Arc::new(cg)).clone())
                }
                Err(e) => {
                    sys::warn(&format!(
                "uswap run: this program gets a memory limit of its own, not a share of its \
                 tree's: {e}\n"
            ));
                    None
                }
            });
    let mut config = settings.config;
    config.commit_limit = Some(settings.vm_size);
    let size = settings.address_space.max(settings.vm_size);
    Ok((Arc::new(Region::new(size, config)?), settings.vm_size))
}
