//! The preload library of `uswap run`: an unmodified, dynamically linked program's
//! anonymous memory in a uswap region, limited in what it keeps resident, the rest swapped.
//!
//! `uswap run` sets `LD_PRELOAD` to this library and [`uswap_core::run::ENV`] to the
//! region's settings. When the library is loaded (before the program's own constructors),
//! it makes the space, whose region (userfaultfds, swap file, uswap's threads, control
//! socket) is built when the program first outgrows a start-up allowance or starts a
//! thread (`space`), and from then on serves:
//! - `malloc` and its family from arenas whose segments are the space's (`heap`);
//! - private anonymous read-write `mmap`s from the space, with `munmap` and `mremap` on
//!   them (`mmap`); jemalloc-style allocators land here;
//! - `madvise` unchanged once the region is built: the kernel tells uswap about discards
//!   through userfaultfd.
//!
//! uswap's own allocations never use the space (`internal`). Faults are served by handler
//! threads (thread mode), so the program's system calls can read and write its memory; or,
//! in SIGBUS mode, by the faulting thread itself, every program thread running with
//! syscall dispatch (`uswap_core::syscall_dispatch`) so that its system calls still can.

mod allowance;
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
mod slab;
mod space;
mod stdio;
mod sys;
mod threads;

use std::ops::Range;
use std::path::PathBuf;
use std::sync::{Arc, Mutex, OnceLock};
use uswap_core::control::ControlServer;
use uswap_core::memcg::MemCgroup;
use uswap_core::run::{Settings, ENV};
use uswap_core::{Config, FaultMode, Mapping, Region, PAGE_SIZE};

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
    credentials::resolve();
    warm_up_name_services();
    match start(&text) {
        Ok(plan) => {
            let _ = PLAN.set((plan.config, program));
            // SAFETY: registering a function with C linkage.
            unsafe { libc::atexit(at_exit) };
            space::install(plan.map, plan.commit_limit, plan.allowance, build);
        }
        Err(e) => stop(&program, &e),
    }
}

/// Running the program without its limit would hide a failure to put it in uswap memory:
/// it stops instead, with status 125.
fn stop(program: &str, e: &uswap_core::Error) -> ! {
    sys::warn(&format!(
        "uswap run: cannot put {program} in uswap memory: {e}\n"
    ));
    // The tree's memory cgroup file goes with the last process, as at exit.
    if let Some(cg) = MEMCG.get() {
        cg.last_one_out();
    }
    // SAFETY: ending the process.
    unsafe { libc::_exit(125) };
}

/// The region's configuration and the program's name, for the build.
static PLAN: OnceLock<(Config, String)> = OnceLock::new();

/// The space's builder (`space::Builder`): the region on the program's memory, with what
/// the program wrote so far, its fault mode turned on and its control socket.
fn build(map: Mapping, lent: &[Range<usize>], written: &[Range<usize>]) -> Arc<Region> {
    let _inside = internal::Inside::enter();
    let (config, program) = PLAN.get().expect("the plan is made before the space");
    let mut config = config.clone();
    if config.fault_mode == FaultMode::Sigbus && sys::threads() > 1 {
        // Threads uswap did not see start (the C library's own, a raw `clone`): syscall
        // dispatch cannot be turned on in them from here, and thread mode needs none.
        sys::warn(&format!(
            "uswap run: {program} has threads uswap did not see start; its faults are \
             served by handler threads (thread mode)\n"
        ));
        config.fault_mode = FaultMode::Thread;
    }
    if let Err(e) = turn_on(config.fault_mode) {
        stop(program, &e);
    }
    let _own = uswap_core::syscall_dispatch::OwnCalls::new();
    // The region's budget takes a member slot of its own, and charges what it adopts.
    allowance::give_back();
    let region = match Region::adopt(map, config, lent, written) {
        Ok(region) => Arc::new(region),
        Err(e) => stop(program, &e),
    };
    serve_control(&region, program.clone());
    region
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
/// and the child answers `uswap stat` and `uswap ctl` on a socket of its own; a child of
/// a parent whose region was not built yet holds an allowance of its own, or builds its
/// region now if the tree's limit has no room for one.
fn child_start() {
    *CONTROL_SOCKET.lock().unwrap_or_else(|e| e.into_inner()) = None;
    let Some(space) = space::get() else {
        return;
    };
    space.forked();
    match space.region() {
        Some(region) => {
            let _own = uswap_core::syscall_dispatch::OwnCalls::new();
            let program = std::env::args().next().unwrap_or_default();
            serve_control(region, program);
        }
        None => {
            if !allowance::take_in_child(space.committed_pages()) {
                space::build_region();
            }
        }
    }
}

/// This process's control socket, removed at exit.
static CONTROL_SOCKET: Mutex<Option<PathBuf>> = Mutex::new(None);

/// The tree's memory cgroup, when this program shares one.
static MEMCG: OnceLock<Arc<MemCgroup>> = OnceLock::new();

/// On the way out: the control socket goes, and the tree's memory cgroup file if this was
/// the last process of the tree.
extern "C" fn at_exit() {
    // Not from a child that shares the space without a region of its own (vfork, a raw
    // clone), whose counters would be the parent's; not from inside uswap's own code (an
    // exit from a signal handler that interrupted it), where the internal heap's lock
    // may be held by the same thread.
    let space = space::get().filter(|s| s.ours());
    if let (Some(dir), Some(region)) = (STATS_DIR.get(), space.and_then(|s| s.region())) {
        match internal::inside() {
            false => leave_stats(dir, region),
            true => sys::warn("uswap run: exit from inside uswap: no counters left\n"),
        }
    }
    allowance::give_back();
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

/// Where the program leaves its counters at exit (`Settings::stats_dir`).
static STATS_DIR: OnceLock<PathBuf> = OnceLock::new();

/// Leaves the region's counters in `dir` for `uswap run --stats-dir`; a failure is told
/// and the exit goes on.
fn leave_stats(dir: &std::path::Path, region: &Region) {
    let _inside = internal::Inside::enter();
    let text = uswap_core::control::snapshot(region).to_string();
    if let Err(e) = write_new(dir, std::process::id(), text.as_bytes()) {
        sys::warn(&format!(
            "uswap run: cannot leave this program's counters in {}: {e}\n",
            dir.display()
        ));
    }
}

/// Writes `bytes` as `PID.json` in `dir` (`PID.N.json` when a program of an earlier `pid`
/// left one): under a name of its own first, never through a link someone left there,
/// then linked in, so a reader never sees half of it.
fn write_new(dir: &std::path::Path, pid: u32, bytes: &[u8]) -> std::io::Result<()> {
    use std::io::{ErrorKind, Write};
    use std::os::unix::fs::OpenOptionsExt;
    let partial = dir.join(format!(".{pid}.partial"));
    let mut file = std::fs::OpenOptions::new()
        .write(true)
        .create_new(true)
        .mode(0o644)
        .custom_flags(libc::O_NOFOLLOW | libc::O_CLOEXEC)
        .open(&partial)?;
    let linked = file.write_all(bytes).and_then(|()| {
        let names =
            std::iter::once(format!("{pid}.json")).chain((1..8).map(|n| format!("{pid}.{n}.json")));
        for name in names {
            // A link fails on any name that exists: nothing is replaced or followed.
            match std::fs::hard_link(&partial, dir.join(name)) {
                Err(e) if e.kind() == ErrorKind::AlreadyExists => continue,
                done => return done,
            }
        }
        Err(ErrorKind::AlreadyExists.into())
    });
    let _ = std::fs::remove_file(&partial);
    linked
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
/// run with syscall dispatch (`turn_on`). Whether this kernel gives it is tried before
/// anything is made, so that a kernel without it is refused, or in auto mode gets thread
/// mode, at the start.
fn fault_mode(asked: FaultMode) -> uswap_core::Result<FaultMode> {
    use uswap_core::syscall_dispatch::supported_here;
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
        // Tried on this thread (it turns dispatch on, dispatching nothing), then off
        // until the region is built.
        if !supported_here() {
            return Err(uswap_core::Error::InvalidConfig {
                what: "fault mode",
                why: "sigbus needs syscall user dispatch, which this kernel refuses (Linux \
                      5.11 or later on x86-64; it may be turned off by sysctl); use \
                      --fault-mode auto or thread"
                    .into(),
            });
        }
        uswap_core::syscall_dispatch::disable_for_this_thread();
    }
    Ok(mode)
}

/// Turns `mode` on for the program's one thread and those it starts, as its region is
/// built.
fn turn_on(mode: FaultMode) -> uswap_core::Result<()> {
    if mode == FaultMode::Sigbus {
        uswap_core::syscall_dispatch::enable_for_this_thread()?;
        uswap_core::syscall_direct::prepare_thread();
        threads::dispatch_in_new_threads();
    }
    Ok(())
}

/// The program's memory before its region is built.
struct Plan {
    map: Mapping,
    config: Config,
    /// Bytes of the region that may be committed at once.
    commit_limit: u64,
    /// Bytes the program may commit before its region is built (`allowance`).
    allowance: u64,
}

/// The plan for the program's memory.
fn start(text: &str) -> uswap_core::Result<Plan> {
    if !malloc_is_ours() {
        return Err(uswap_core::Error::InvalidConfig {
            what: "program",
            why: "it brings a malloc of its own (linked into the executable), which uswap \
                  cannot serve from its memory"
                .into(),
        });
    }
    let mut settings = Settings::parse(text)?;
    if let Some(dir) = settings.stats_dir.take() {
        let _ = STATS_DIR.set(dir);
    }
    settings.config.fault_mode = fault_mode(settings.config.fault_mode)?;
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
    // Whatever is wrong is said at the start, not when the region is built.
    Region::check(size, &config)?;
    let map = Mapping::new(size.next_multiple_of(PAGE_SIZE as u64) as usize)?;
    // A build adopts what pagemap shows mapped, on the one thread the program has.
    let can_wait = sys::threads() == 1 && std::fs::File::open("/proc/self/pagemap").is_ok();
    let asked = if can_wait {
        settings.start_allowance
    } else {
        Some(0)
    };
    let allowance = allowance::take(&config, asked);
    Ok(Plan {
        map,
        config,
        commit_limit: settings.vm_size,
        allowance,
    })
}
