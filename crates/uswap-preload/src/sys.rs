//! The system calls behind the symbols this library interposes, made directly: uswap's own
//! mappings, and the program's mappings that stay the kernel's, must not come back through
//! `mmap` and friends as exported here.

use libc::{c_int, c_void, off_t, size_t};

pub unsafe fn mmap(
    addr: *mut c_void,
    len: size_t,
    prot: c_int,
    flags: c_int,
    fd: c_int,
    off: off_t,
) -> *mut c_void {
    libc::syscall(libc::SYS_mmap, addr, len, prot, flags, fd, off) as *mut c_void
}

pub unsafe fn munmap(addr: *mut c_void, len: size_t) -> c_int {
    libc::syscall(libc::SYS_munmap, addr, len) as c_int
}

pub unsafe fn mremap(
    old: *mut c_void,
    old_len: size_t,
    new_len: size_t,
    flags: c_int,
    new_addr: *mut c_void,
) -> *mut c_void {
    libc::syscall(libc::SYS_mremap, old, old_len, new_len, flags, new_addr) as *mut c_void
}

pub unsafe fn mprotect(addr: *mut c_void, len: size_t, prot: c_int) -> c_int {
    libc::syscall(libc::SYS_mprotect, addr, len, prot) as c_int
}

pub unsafe fn madvise(addr: *mut c_void, len: size_t, advice: c_int) -> c_int {
    libc::syscall(libc::SYS_madvise, addr, len, advice) as c_int
}

/// Writes `msg` to standard error with one system call and no allocation (usable inside
/// `malloc` and in a signal handler).
pub fn warn(msg: &str) {
    // SAFETY: writing a valid buffer to fd 2.
    unsafe { libc::write(2, msg.as_ptr().cast(), msg.len()) };
}

/// The process's threads, from `/proc/self/status` (2 when it cannot be read: more than
/// one is the cautious answer).
pub fn threads() -> usize {
    std::fs::read_to_string("/proc/self/status")
        .ok()
        .and_then(|status| {
            let line = status.lines().find(|l| l.starts_with("Threads:"))?;
            line["Threads:".len()..].trim().parse().ok()
        })
        .unwrap_or(2)
}

pub fn set_errno(e: c_int) {
    // SAFETY: errno is this thread's own.
    unsafe { *libc::__errno_location() = e };
}
