//! The C library's wrappers of the system calls programs make most (`read`, `write`,
//! `recv`, `send`, `epoll_wait`, `poll`, `accept`, `close`, …), exported so that a
//! program thread running with syscall dispatch (SIGBUS mode) makes them without a trap:
//! `uswap_core::syscall_direct::call` pins the buffers from user space and makes the call
//! from dispatch's exempt range. When it declines (a thread without dispatch, uswap's own
//! code, a buffer that is not in memory), the C library's wrapper runs as it would without
//! uswap, and in a dispatching thread its call is dispatched.
//!
//! Each wrapper makes the system call the C library's makes for it on x86-64 (`recv` is
//! `recvfrom` with no address, `send` is `sendto`), sets `errno` the same way, and is a
//! cancellation point where the C library's is. Calls the C library makes for itself
//! (`printf` writing its buffer) do not come through here and are dispatched.

use crate::threads::next;
use libc::{c_int, c_void, iovec, msghdr, nfds_t, off_t, pollfd, size_t, sockaddr, socklen_t};
use std::ffi::CStr;
use uswap_core::syscall_direct;

/// The C library's convention: a failed call returns -1 with its error in `errno`.
fn to_c(result: i64) -> i64 {
    if (-4095..0).contains(&result) {
        // SAFETY: this thread's errno.
        unsafe { *libc::__errno_location() = -result as c_int };
        -1
    } else {
        result
    }
}

/// `exports! { name(arg: type, …) -> ret = SYS_nr, [the call's six words], cancellation
/// point; … }`: each wrapper, the slot of the C library's function behind it (in a module of
/// the same name), and [`resolve_all`].
macro_rules! exports {
    ($($name:ident($($arg:ident: $ty:ty),*) -> $ret:ty = $nr:expr, [$($word:expr),*], $cancel:expr;)*) => {
        $(
            mod $name {
                pub(super) static REAL: std::sync::atomic::AtomicPtr<libc::c_void> =
                    std::sync::atomic::AtomicPtr::new(std::ptr::null_mut());
            }

            #[no_mangle]
            pub unsafe extern "C-unwind" fn $name($($arg: $ty),*) -> $ret {
                let words: &[u64] = &[$($word as u64),*];
                let mut a = [0u64; 6];
                a[..words.len()].copy_from_slice(words);
                match syscall_direct::call($nr, a, $cancel) {
                    Some(result) => to_c(result) as $ret,
                    None => {
                        type F = unsafe extern "C-unwind" fn($($ty),*) -> $ret;
                        next::<F>(&$name::REAL, name_of(concat!(stringify!($name), "\0")))
                            ($($arg),*)
                    }
                }
            }
        )*

        /// Looks every C library function behind the wrappers up now: a wrapper may first
        /// be called from a signal handler, where `dlsym` must not run.
        pub(crate) fn resolve_all() {
            $(
                // SAFETY: the slot's function is `$name` (only its address is taken).
                unsafe {
                    next::<*mut c_void>(&$name::REAL, name_of(concat!(stringify!($name), "\0")));
                }
            )*
        }
    };
}

fn name_of(name: &'static str) -> &'static CStr {
    CStr::from_bytes_with_nul(name.as_bytes()).expect("one NUL, at the end")
}

exports! {
read(fd: c_int, buf: *mut c_void, n: size_t) -> isize =
    libc::SYS_read, [fd, buf, n], true;
write(fd: c_int, buf: *const c_void, n: size_t) -> isize =
    libc::SYS_write, [fd, buf, n], true;
pread64(fd: c_int, buf: *mut c_void, n: size_t, off: off_t) -> isize =
    libc::SYS_pread64, [fd, buf, n, off], true;
pwrite64(fd: c_int, buf: *const c_void, n: size_t, off: off_t) -> isize =
    libc::SYS_pwrite64, [fd, buf, n, off], true;
pread(fd: c_int, buf: *mut c_void, n: size_t, off: off_t) -> isize =
    libc::SYS_pread64, [fd, buf, n, off], true;
pwrite(fd: c_int, buf: *const c_void, n: size_t, off: off_t) -> isize =
    libc::SYS_pwrite64, [fd, buf, n, off], true;
readv(fd: c_int, iov: *const iovec, n: c_int) -> isize =
    libc::SYS_readv, [fd, iov, n], true;
writev(fd: c_int, iov: *const iovec, n: c_int) -> isize =
    libc::SYS_writev, [fd, iov, n], true;
recv(fd: c_int, buf: *mut c_void, n: size_t, flags: c_int) -> isize =
    libc::SYS_recvfrom, [fd, buf, n, flags, 0, 0], true;
recvfrom(fd: c_int, buf: *mut c_void, n: size_t, flags: c_int,
        from: *mut sockaddr, len: *mut socklen_t) -> isize =
    libc::SYS_recvfrom, [fd, buf, n, flags, from, len], true;
send(fd: c_int, buf: *const c_void, n: size_t, flags: c_int) -> isize =
    libc::SYS_sendto, [fd, buf, n, flags, 0, 0], true;
sendto(fd: c_int, buf: *const c_void, n: size_t, flags: c_int,
        to: *const sockaddr, len: socklen_t) -> isize =
    libc::SYS_sendto, [fd, buf, n, flags, to, len], true;
recvmsg(fd: c_int, msg: *mut msghdr, flags: c_int) -> isize =
    libc::SYS_recvmsg, [fd, msg, flags], true;
sendmsg(fd: c_int, msg: *const msghdr, flags: c_int) -> isize =
    libc::SYS_sendmsg, [fd, msg, flags], true;
epoll_wait(epfd: c_int, events: *mut libc::epoll_event, max: c_int, timeout: c_int)
        -> c_int = libc::SYS_epoll_wait, [epfd, events, max, timeout], true;
epoll_ctl(epfd: c_int, op: c_int, fd: c_int, event: *mut libc::epoll_event)
        -> c_int = libc::SYS_epoll_ctl, [epfd, op, fd, event], false;
poll(fds: *mut pollfd, n: nfds_t, timeout: c_int) -> c_int =
    libc::SYS_poll, [fds, n, timeout], true;
accept(fd: c_int, addr: *mut sockaddr, len: *mut socklen_t) -> c_int =
    libc::SYS_accept, [fd, addr, len], true;
accept4(fd: c_int, addr: *mut sockaddr, len: *mut socklen_t, flags: c_int) -> c_int =
    libc::SYS_accept4, [fd, addr, len, flags], true;
connect(fd: c_int, addr: *const sockaddr, len: socklen_t) -> c_int =
    libc::SYS_connect, [fd, addr, len], true;
close(fd: c_int) -> c_int = libc::SYS_close, [fd], true;
lseek(fd: c_int, off: off_t, whence: c_int) -> off_t =
    libc::SYS_lseek, [fd, off, whence], false;
lseek64(fd: c_int, off: off_t, whence: c_int) -> off_t =
    libc::SYS_lseek, [fd, off, whence], false;
getpid() -> libc::pid_t = libc::SYS_getpid, [], false;
getppid() -> libc::pid_t = libc::SYS_getppid, [], false;
}
