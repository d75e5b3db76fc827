//! Streams (`FILE`) come from the internal heap: in a child of fork the C library walks
//! every open stream and resets its lock before any fork handler runs, before uswap has
//! given the child its memory, so a stream in the space would crash it. A stream's buffer,
//! allocated at its first read or write, is not touched then and stays the program's.

use crate::internal::Inside;
use crate::threads::next;
use libc::{c_char, c_int, c_void, size_t, FILE};
use std::sync::atomic::AtomicPtr;

macro_rules! stream_constructor {
    ($name:ident, $slot:ident, ($($arg:ident: $ty:ty),*)) => {
        static $slot: AtomicPtr<c_void> = AtomicPtr::new(std::ptr::null_mut());

        #[no_mangle]
        pub unsafe extern "C" fn $name($($arg: $ty),*) -> *mut FILE {
            let _inside = Inside::enter();
            type F = unsafe extern "C" fn($($ty),*) -> *mut FILE;
            let name = concat!(stringify!($name), "\0");
            let name = std::ffi::CStr::from_bytes_with_nul(name.as_bytes()).expect("a C name");
            next::<F>(&$slot, name)($($arg),*)
        }
    };
}

stream_constructor!(fopen, REAL_FOPEN, (path: *const c_char, mode: *const c_char));
stream_constructor!(fopen64, REAL_FOPEN64, (path: *const c_char, mode: *const c_char));
stream_constructor!(fdopen, REAL_FDOPEN, (fd: c_int, mode: *const c_char));
stream_constructor!(popen, REAL_POPEN, (command: *const c_char, mode: *const c_char));
stream_constructor!(fmemopen, REAL_FMEMOPEN, (buf: *mut c_void, size: size_t, mode: *const c_char));
stream_constructor!(open_memstream, REAL_OPEN_MEMSTREAM, (buf: *mut *mut c_char, size: *mut size_t));
stream_constructor!(tmpfile, REAL_TMPFILE, ());
stream_constructor!(tmpfile64, REAL_TMPFILE64, ());
