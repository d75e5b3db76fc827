//! Telling uswap's threads from the program's: `pthread_create` as exported here marks a
//! thread started while uswap code runs (a fault handler, kswapd, the control server) as
//! uswap's before its first instruction, so even what the C and Rust runtimes allocate
//! for it on the way in comes from the internal heap. Were it served from the space, the
//! new handler thread could fault on a page only it can bring in.

use crate::internal::{self, Inside};
use libc::{c_int, c_void, pthread_attr_t, pthread_t};
use std::sync::atomic::{AtomicPtr, Ordering::Acquire, Ordering::Release};

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

#[no_mangle]
pub unsafe extern "C" fn pthread_create(
    thread: *mut pthread_t,
    attr: *const pthread_attr_t,
    routine: StartRoutine,
    arg: *mut c_void,
) -> c_int {
    if !internal::inside() {
        return real()(thread, attr, routine, arg);
    }
    let start = Box::into_raw(Box::new(Start { routine, arg }));
    let rc = real()(thread, attr, start_uswap_thread, start.cast());
    if rc != 0 {
        drop(Box::from_raw(start));
    }
    rc
}
