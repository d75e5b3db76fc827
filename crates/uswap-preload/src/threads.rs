//! Telling uswap's threads from the program's: `pthread_create` as exported here marks a
//! thread started while uswap code runs (a fault handler, kswapd, the control server) as
//! uswap's before its first instruction, so even what the C and Rust runtimes allocate
//! for it on the way in comes from the internal heap. Were it served from the space, the
//! new handler thread could fault on a page only it can bring in.
//!
//! What the C library allocates for any thread (its dynamic thread vector, its
//! thread-specific data blocks) comes from the internal heap too, and uswap's threads run
//! on stacks of their own, never on a cached stack of a dead thread. A child of fork
//! touches these before uswap has given it its memory: the C library clears the lost
//! threads' data, and reusing a lost program thread's stack frees that thread's TLS
//! blocks, which live in the space.

use crate::internal::{self, Inside};
use crate::sys;
use libc::{c_int, c_void, pthread_attr_t, pthread_t};
use std::sync::atomic::{AtomicBool, AtomicPtr, Ordering::Acquire, Ordering::Release};

type StartRoutine = extern "C" fn(*mut c_void) -> *mut c_void;
type PthreadCreate =
    unsafe extern "C" fn(*mut pthread_t, *const pthread_attr_t, StartRoutine, *mut c_void) -> c_int;

static REAL: AtomicPtr<c_void> = AtomicPtr::new(std::ptr::null_mut());

/// The C library's `pthread_create`.
fn real() -> PthreadCreate {
    let mut f = REAL.load(Acquire);
    if f.is_null() {
        let _inside = Inside::enter();
        // SAFETY: looking up a symbol by a NUL-terminated name.
        f = unsafe { libc::dlsym(libc::RTLD_NEXT, c"pthread_create".as_ptr()) };
        assert!(!f.is_null(), "uswap: the C library has no pthread_create");
        REAL.store(f, Release);
    }
    // SAFETY: the symbol is pthread_create, with this signature.
    unsafe { std::mem::transmute::<*mut c_void, PthreadCreate>(f) }
}

struct Start {
    routine: StartRoutine,
    arg: *mut c_void,
}

extern "C" fn start_uswap_thread(start: *mut c_void) -> *mut c_void {
    internal::mark_uswap_thread();
    // SAFETY: made by Box::into_raw in pthread_create below, taken back once.
    let start = unsafe { Box::from_raw(start.cast::<Start>()) };
    (start.routine)(start.arg)
}

/// Whether the program's threads run with syscall dispatch (SIGBUS mode).
static DISPATCH: AtomicBool = AtomicBool::new(false);

/// From now on the program's new threads turn syscall dispatch on before they run.
pub(crate) fn dispatch_in_new_threads() {
    DISPATCH.store(true, Release);
}

/// A fork child's thread: dispatch is not inherited, so it is turned on again.
pub(crate) fn dispatch_in_fork_child() {
    uswap_core::syscall_direct::forget_in_child();
    if DISPATCH.load(Acquire) {
        if let Err(e) = uswap_core::syscall_dispatch::enable_for_this_thread() {
            sys::warn(&format!(
                "uswap: the child of fork runs without syscall dispatch: {e}\n"
            ));
        }
    }
}

extern "C" fn start_dispatching_thread(start: *mut c_void) -> *mut c_void {
    // SAFETY: made by Box::into_raw in pthread_create below, taken back once.
    let start = unsafe { Box::from_raw(start.cast::<Start>()) };
    if let Err(e) = uswap_core::syscall_dispatch::enable_for_this_thread() {
        // Its system calls could fail on swapped-out memory: stop rather than risk it.
        sys::warn(&format!(
            "uswap run: a new thread cannot turn syscall dispatch on: {e}\n"
        ));
        // SAFETY: ending the process.
        unsafe { libc::_exit(125) };
    }
    uswap_core::syscall_direct::prepare_thread();
    let Start { routine, arg } = {
        let _inside = Inside::enter();
        *start
    };
    routine(arg)
}

#[no_mangle]
pub unsafe extern "C" fn pthread_create(
    thread: *mut pthread_t,
    attr: *const pthread_attr_t,
    routine: StartRoutine,
    arg: *mut c_void,
) -> c_int {
    if !internal::inside() {
        let _inside = Inside::enter();
        // The region is built while the program has one thread (`space`).
        crate::space::build_region();
        if !DISPATCH.load(Acquire) {
            return real()(thread, attr, routine, arg);
        }
        let start = Box::into_raw(Box::new(Start { routine, arg }));
        let rc = real()(thread, attr, start_dispatching_thread, start.cast());
        if rc != 0 {
            drop(Box::from_raw(start));
        }
        return rc;
    }
    let Some(stack) = OwnStack::new(attr) else {
        return libc::EAGAIN;
    };
    let start = Box::into_raw(Box::new(Start { routine, arg }));
    let rc = real()(thread, stack.attr(), start_uswap_thread, start.cast());
    if rc != 0 {
        drop(Box::from_raw(start));
    }
    stack.release(rc == 0);
    rc
}

/// A thread stack of uswap's own, mapped from the kernel: the C library never caches a
/// stack it was given, so it never reuses another thread's for it. The stack lives as
/// long as the process (uswap's threads live as long as their region).
struct OwnStack {
    attr: libc::pthread_attr_t,
    base: *mut c_void,
    len: usize,
}

/// Stack size when the creator asks for none (the C library's default on x86-64).
const DEFAULT_STACK: usize = 8 << 20;

impl OwnStack {
    unsafe fn new(like: *const pthread_attr_t) -> Option<OwnStack> {
        let mut size = 0;
        if like.is_null() || libc::pthread_attr_getstacksize(like, &mut size) != 0 || size == 0 {
            size = DEFAULT_STACK;
        }
        let page = uswap_core::PAGE_SIZE;
        let len = size.div_ceil(page) * page + page;
        let rw = libc::PROT_READ | libc::PROT_WRITE;
        let flags = libc::MAP_PRIVATE | libc::MAP_ANONYMOUS | libc::MAP_NORESERVE | libc::MAP_STACK;
        let base = sys::mmap(std::ptr::null_mut(), len, rw, flags, -1, 0);
        if base == libc::MAP_FAILED {
            return None;
        }
        // The lowest page guards against overflow.
        sys::mprotect(base, page, libc::PROT_NONE);
        let mut attr: libc::pthread_attr_t = std::mem::zeroed();
        libc::pthread_attr_init(&mut attr);
        if libc::pthread_attr_setstack(&mut attr, base.cast::<u8>().add(page).cast(), len - page)
            != 0
        {
            sys::munmap(base, len);
            return None;
        }
        Some(OwnStack { attr, base, len })
    }

    fn attr(&self) -> *const pthread_attr_t {
        &self.attr
    }

    /// Done with the attributes; the stack stays if a thread runs on it.
    unsafe fn release(mut self, in_use: bool) {
        libc::pthread_attr_destroy(&mut self.attr);
        if !in_use {
            sys::munmap(self.base, self.len);
        }
    }
}

type PthreadSetspecific = unsafe extern "C" fn(libc::pthread_key_t, *const c_void) -> c_int;

static REAL_SETSPECIFIC: AtomicPtr<c_void> = AtomicPtr::new(std::ptr::null_mut());

/// `pthread_setspecific` allocates the second-level blocks of a thread's keys with
/// `calloc`, and a child of fork clears the blocks of the threads it lost before any fork
/// handler runs, before uswap has given the child its memory. So those blocks come from
/// the internal heap, which the child inherits as ordinary memory.
#[no_mangle]
pub unsafe extern "C" fn pthread_setspecific(
    key: libc::pthread_key_t,
    value: *const c_void,
) -> c_int {
    let _inside = Inside::enter();
    next::<PthreadSetspecific>(&REAL_SETSPECIFIC, c"pthread_setspecific")(key, value)
}

/// Calls the C library's `name` (resolved once into `slot`) as type `F`, inside uswap.
///
/// # Safety
/// `F` must be the function type of `name`.
pub(crate) unsafe fn next<F: Copy>(slot: &AtomicPtr<c_void>, name: &std::ffi::CStr) -> F {
    let mut f = slot.load(Acquire);
    if f.is_null() {
        f = libc::dlsym(libc::RTLD_NEXT, name.as_ptr());
        assert!(!f.is_null(), "uswap: the C library has no {name:?}");
        slot.store(f, Release);
    }
    std::mem::transmute_copy::<*mut c_void, F>(&f)
}

static REAL_SETLOCALE: AtomicPtr<c_void> = AtomicPtr::new(std::ptr::null_mut());
static REAL_NEWLOCALE: AtomicPtr<c_void> = AtomicPtr::new(std::ptr::null_mut());

/// Locale data comes from the internal heap: every thread reads the global locale's when
/// it starts, uswap's new fault handlers included, which must never fault on the space
/// (in a child of fork, nothing of the space is in memory yet).
#[no_mangle]
pub unsafe extern "C" fn setlocale(
    category: c_int,
    locale: *const libc::c_char,
) -> *mut libc::c_char {
    let _inside = Inside::enter();
    type F = unsafe extern "C" fn(c_int, *const libc::c_char) -> *mut libc::c_char;
    next::<F>(&REAL_SETLOCALE, c"setlocale")(category, locale)
}

/// As `setlocale`: a thread may make a locale of its own current (`uselocale`).
#[no_mangle]
pub unsafe extern "C" fn newlocale(
    mask: c_int,
    locale: *const libc::c_char,
    base: libc::locale_t,
) -> libc::locale_t {
    let _inside = Inside::enter();
    type F = unsafe extern "C" fn(c_int, *const libc::c_char, libc::locale_t) -> libc::locale_t;
    next::<F>(&REAL_NEWLOCALE, c"newlocale")(mask, locale, base)
}
