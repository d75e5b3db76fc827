//! Which memory a system call reads or writes: the buffers syscall dispatch pins before it
//! runs a call (`syscall_dispatch.rs`), by call number and arguments (x86-64).
//!
//! Each known call names its buffers and their direction: a buffer the kernel writes is
//! made writable too (a clean page is write-protected until its first write). Paths and
//! argument strings are measured by reading them. Vectors (`readv`, `recvmsg`, `execve`'s
//! arguments) pin each buffer while the call has pins left, and what covers them all when
//! it has not. A call this table does not know pins, for each argument that points into a
//! region, the page it points to, made writable: the small structures most calls take
//! fit in it. The memory-management calls take addresses, not buffers, and pin nothing.

use crate::sigbus::{in_region, CallPins};
use crate::PAGE_SIZE;

const R: bool = false;
const W: bool = true;

/// Longest string a call takes (`MAX_ARG_STRLEN`, an execve argument).
const MAX_STRING: usize = 32 * PAGE_SIZE;

/// Pins the buffers of call `nr` with arguments `a`.
pub(crate) fn pin_buffers(nr: i64, a: &[u64; 6], pins: &mut CallPins) {
    let p = |i: usize| a[i] as usize;
    let buf = |pins: &mut CallPins, addr: usize, len: usize, write: bool| {
        if addr != 0 && len != 0 {
            pins.pin(addr, len, write);
        }
    };
    match nr {
        libc::SYS_read
        | libc::SYS_pread64
        | libc::SYS_getdents64
        | libc::SYS_getdents
        | libc::SYS_getcwd
        | libc::SYS_getrandom => {
            let (addr, len) = if nr == libc::SYS_getcwd || nr == libc::SYS_getrandom {
                (p(0), p(1))
            } else {
                (p(1), p(2))
            };
            buf(pins, addr, len, W)
        }
        libc::SYS_write | libc::SYS_pwrite64 => buf(pins, p(1), p(2), R),
        libc::SYS_readv | libc::SYS_preadv | libc::SYS_preadv2 => iovec(pins, p(1), p(2), W),
        libc::SYS_writev | libc::SYS_pwritev | libc::SYS_pwritev2 => iovec(pins, p(1), p(2), R),
        // Which way vmsplice copies depends on the pipe end: writable covers both.
        libc::SYS_vmsplice => iovec(pins, p(1), p(2), W),
        libc::SYS_process_vm_readv | libc::SYS_process_vm_writev => {
            iovec(pins, p(1), p(2), nr == libc::SYS_process_vm_readv);
            buf(pins, p(3), p(4).min(1024) * 16, R);
        }
        libc::SYS_recvfrom => {
            buf(pins, p(1), p(2), W);
            socket_address(pins, p(4), p(5));
        }
        libc::SYS_sendto => {
            buf(pins, p(1), p(2), R);
            buf(pins, p(4), p(5), R);
        }
        libc::SYS_recvmsg => msghdr(pins, p(1), W),
        libc::SYS_sendmsg => msghdr(pins, p(1), R),
        libc::SYS_recvmmsg | libc::SYS_sendmmsg => {
            let write = nr == libc::SYS_recvmmsg;
            mmsghdrs(pins, p(1), p(2).min(1024), write);
            if write {
                buf(pins, p(4), 16, W);
            }
        }
        libc::SYS_accept | libc::SYS_accept4 | libc::SYS_getsockname | libc::SYS_getpeername => {
            socket_address(pins, p(1), p(2))
        }
        libc::SYS_connect | libc::SYS_bind => buf(pins, p(1), p(2), R),
        libc::SYS_setsockopt => buf(pins, p(3), p(4), R),
        libc::SYS_getsockopt => socket_address(pins, p(3), p(4)),
        libc::SYS_socketpair => buf(pins, p(3), 8, W),
        libc::SYS_pipe | libc::SYS_pipe2 => buf(pins, p(0), 8, W),
        libc::SYS_poll => buf(pins, p(0), p(1) * 8, W),
        libc::SYS_ppoll => {
            buf(pins, p(0), p(1) * 8, W);
            buf(pins, p(2), 16, W);
        }
        libc::SYS_select | libc::SYS_pselect6 => {
            let set = p(0).div_ceil(64) * 8;
            for i in 1..=3 {
                buf(pins, p(i), set, W);
            }
            buf(pins, p(4), 16, W);
            if nr == libc::SYS_pselect6 {
                buf(pins, p(5), 16, R);
            }
        }
        libc::SYS_epoll_wait | libc::SYS_epoll_pwait | libc::SYS_epoll_pwait2 => {
            buf(pins, p(1), p(2) * 12, W);
            if nr == libc::SYS_epoll_pwait2 {
                buf(pins, p(3), 16, R);
            }
        }
        libc::SYS_epoll_ctl => buf(pins, p(3), 12, R),
        libc::SYS_futex => futex(pins, a),
        libc::SYS_nanosleep => {
            buf(pins, p(0), 16, R);
            buf(pins, p(1), 16, W);
        }
        libc::SYS_clock_nanosleep => {
            buf(pins, p(2), 16, R);
            buf(pins, p(3), 16, W);
        }
        libc::SYS_clock_gettime | libc::SYS_clock_getres => buf(pins, p(1), 16, W),
        libc::SYS_gettimeofday => {
            buf(pins, p(0), 16, W);
            buf(pins, p(1), 8, W);
        }
        libc::SYS_fstat => buf(pins, p(1), 144, W),
        libc::SYS_stat | libc::SYS_lstat => {
            string(pins, p(0));
            buf(pins, p(1), 144, W);
        }
        libc::SYS_newfstatat => {
            string(pins, p(1));
            buf(pins, p(2), 144, W);
        }
        libc::SYS_statx => {
            string(pins, p(1));
            buf(pins, p(4), 256, W);
        }
        libc::SYS_statfs => {
            string(pins, p(0));
            buf(pins, p(1), 120, W);
        }
        libc::SYS_fstatfs => buf(pins, p(1), 120, W),
        libc::SYS_open
        | libc::SYS_access
        | libc::SYS_chdir
        | libc::SYS_mkdir
        | libc::SYS_rmdir
        | libc::SYS_creat
        | libc::SYS_unlink
        | libc::SYS_chmod
        | libc::SYS_chown
        | libc::SYS_lchown
        | libc::SYS_truncate
        | libc::SYS_memfd_create
        | libc::SYS_chroot
        | libc::SYS_acct
        | libc::SYS_mknod => string(pins, p(0)),
        libc::SYS_openat
        | libc::SYS_mkdirat
        | libc::SYS_fchownat
        | libc::SYS_unlinkat
        | libc::SYS_fchmodat
        | libc::SYS_faccessat
        | libc::SYS_faccessat2
        | libc::SYS_mknodat => string(pins, p(1)),
        libc::SYS_openat2 => {
            string(pins, p(1));
            buf(pins, p(2), p(3), R);
        }
        libc::SYS_rename | libc::SYS_link | libc::SYS_symlink => {
            string(pins, p(0));
            string(pins, p(1));
        }
        libc::SYS_renameat | libc::SYS_renameat2 | libc::SYS_linkat => {
            string(pins, p(1));
            string(pins, p(3));
        }
        libc::SYS_symlinkat => {
            string(pins, p(0));
            string(pins, p(2));
        }
        libc::SYS_readlink => {
            string(pins, p(0));
            buf(pins, p(1), p(2), W);
        }
        libc::SYS_readlinkat => {
            string(pins, p(1));
            buf(pins, p(2), p(3), W);
        }
        libc::SYS_utimensat => {
            string(pins, p(1));
            buf(pins, p(2), 32, R);
        }
        libc::SYS_execve | libc::SYS_execveat => {
            let first = usize::from(nr == libc::SYS_execveat);
            string(pins, p(first));
            strings(pins, p(first + 1));
            strings(pins, p(first + 2));
        }
        libc::SYS_wait4 => {
            buf(pins, p(1), 4, W);
            buf(pins, p(3), 144, W);
        }
        libc::SYS_waitid => {
            buf(pins, p(2), 128, W);
            buf(pins, p(4), 144, W);
        }
        libc::SYS_uname => buf(pins, p(0), 390, W),
        libc::SYS_sysinfo => buf(pins, p(0), 112, W),
        libc::SYS_getrusage => buf(pins, p(1), 144, W),
        libc::SYS_times => buf(pins, p(0), 32, W),
        libc::SYS_getrlimit | libc::SYS_setrlimit => buf(pins, p(1), 16, W),
        libc::SYS_prlimit64 => {
            buf(pins, p(2), 16, R);
            buf(pins, p(3), 16, W);
        }
        libc::SYS_sigaltstack => {
            buf(pins, p(0), 24, R);
            buf(pins, p(1), 24, W);
        }
        libc::SYS_rt_sigtimedwait => {
            buf(pins, p(0), 8, R);
            buf(pins, p(1), 128, W);
            buf(pins, p(2), 16, R);
        }
        libc::SYS_sched_setaffinity => buf(pins, p(2), p(1), R),
        libc::SYS_sched_getaffinity => buf(pins, p(2), p(1), W),
        libc::SYS_sendfile => buf(pins, p(2), 8, W),
        libc::SYS_copy_file_range => {
            buf(pins, p(1), 8, W);
            buf(pins, p(3), 8, W);
        }
        libc::SYS_mincore => buf(pins, p(2), p(1).div_ceil(PAGE_SIZE), W),
        // Addresses, not buffers; or kernel-kept pointers to thread data, never region
        // memory the call itself reads.
        libc::SYS_mmap
        | libc::SYS_munmap
        | libc::SYS_mremap
        | libc::SYS_mprotect
        | libc::SYS_pkey_mprotect
        | libc::SYS_madvise
        | libc::SYS_process_madvise
        | libc::SYS_msync
        | libc::SYS_mlock
        | libc::SYS_mlock2
        | libc::SYS_munlock
        | libc::SYS_brk
        | libc::SYS_mbind
        | libc::SYS_shmat
        | libc::SYS_shmdt
        | libc::SYS_remap_file_pages
        | libc::SYS_set_tid_address
        | libc::SYS_set_robust_list
        | libc::SYS_rseq
        | libc::SYS_arch_prctl
        | libc::SYS_exit
        | libc::SYS_exit_group
        | libc::SYS_close
        | libc::SYS_lseek
        | libc::SYS_fsync
        | libc::SYS_fdatasync
        | libc::SYS_getpid
        | libc::SYS_gettid
        | libc::SYS_sched_yield
        | libc::SYS_kill
        | libc::SYS_tgkill
        | libc::SYS_dup
        | libc::SYS_dup2
        | libc::SYS_dup3 => {}
        _ => {
            for &arg in a {
                let addr = arg as usize;
                if in_region(addr, 1) {
                    pins.pin(addr, PAGE_SIZE - addr % PAGE_SIZE, W);
                }
            }
        }
    }
}

/// Pins the buffers `each` yields (address, length), each on its own while the call has
/// pins enough, else one range that covers them all.
fn pin_each(pins: &mut CallPins, write: bool, each: impl Fn(&mut dyn FnMut(usize, usize))) {
    let (mut count, mut low, mut high) = (0, usize::MAX, 0);
    each(&mut |addr, len| {
        if len != 0 && in_region(addr, len) {
            count += 1;
            low = low.min(addr);
            high = high.max(addr.saturating_add(len));
        }
    });
    if count == 0 {
        return;
    }
    if count <= pins.free() {
        each(&mut |addr, len| {
            if len != 0 && in_region(addr, len) {
                pins.pin(addr, len, write);
            }
        });
    } else {
        pins.pin(low, high - low, write);
    }
}

/// Reads the `i`th word at `addr`: the program's memory, faulted in if it is swapped out.
fn word(addr: usize, i: usize) -> usize {
    // SAFETY: memory the program passed to a system call; a bad pointer faults here as it
    // would in the C library's wrapper.
    unsafe { std::ptr::read_unaligned((addr as *const usize).add(i)) }
}

/// Calls `f` with each buffer (address, length) of the `iovec` array at `iov`.
fn each_iov(iov: usize, count: usize, f: &mut dyn FnMut(usize, usize)) {
    if iov != 0 {
        for i in 0..count.min(1024) {
            f(word(iov, 2 * i), word(iov, 2 * i + 1));
        }
    }
}

/// An `iovec` array and its buffers.
fn iovec(pins: &mut CallPins, iov: usize, count: usize, write: bool) {
    if iov == 0 {
        return;
    }
    pins.pin(iov, count.min(1024) * 16, R);
    pin_each(pins, write, |f| each_iov(iov, count, f));
}

/// A `msghdr`: the header, its address, vector and control buffer.
fn msghdr(pins: &mut CallPins, msg: usize, write: bool) {
    messages(pins, msg, 1, 56, write);
}

/// An `mmsghdr` vector (each a `msghdr` and the length the kernel writes after it).
fn mmsghdrs(pins: &mut CallPins, vec: usize, count: usize, write: bool) {
    messages(pins, vec, count, 64, write);
}

/// `count` message headers 64 bytes apart from `first` (`header` bytes of each read or
/// written by the kernel): the headers, then their iovec arrays, then every buffer they
/// name, each pinned alone while pins last, else one range covering them.
fn messages(pins: &mut CallPins, first: usize, count: usize, header: usize, write: bool) {
    if first == 0 || count == 0 {
        return;
    }
    pins.pin(first, (count - 1) * 64 + header, W);
    let msg = |i: usize| first + i * 64;
    pin_each(pins, R, |f| {
        for i in 0..count {
            f(word(msg(i), 2), word(msg(i), 3).min(1024) * 16);
        }
    });
    pin_each(pins, write, |f| {
        for i in 0..count {
            let m = msg(i);
            f(word(m, 0), word(m, 1) & 0xffff_ffff);
            f(word(m, 4), word(m, 5));
            each_iov(word(m, 2), word(m, 3), f);
        }
    });
}

/// A socket address the kernel writes, with its length (in and out).
fn socket_address(pins: &mut CallPins, addr: usize, len: usize) {
    if len == 0 {
        return;
    }
    pins.pin(len, 4, W);
    // SAFETY: as in `word`.
    let size = unsafe { std::ptr::read_unaligned(len as *const u32) } as usize;
    if addr != 0 && size != 0 {
        pins.pin(addr, size, W);
    }
}

/// A NUL-terminated string the kernel reads.
fn string(pins: &mut CallPins, addr: usize) {
    if addr == 0 || !in_region(addr, 1) {
        return;
    }
    // SAFETY: as in `word`.
    let len = unsafe { libc::strnlen(addr as *const libc::c_char, MAX_STRING) };
    pins.pin(addr, len + 1, R);
}

/// A NULL-terminated array of strings (execve's arguments and environment).
fn strings(pins: &mut CallPins, array: usize) {
    if array == 0 {
        return;
    }
    let count = (0..).take_while(|&i| word(array, i) != 0).count();
    pins.pin(array, (count + 1) * 8, R);
    pin_each(pins, R, |f| {
        for i in 0..count {
            let s = word(array, i);
            if in_region(s, 1) {
                // SAFETY: as in `word`.
                f(
                    s,
                    unsafe { libc::strnlen(s as *const libc::c_char, MAX_STRING) } + 1,
                );
            }
        }
    });
}

/// `futex`, but for the waits (`futex_wait_word`): the word and the second word of a
/// requeue or wake-op, the timeout of a lock. A wake only looks the word's address up.
fn futex(pins: &mut CallPins, a: &[u64; 6]) {
    let op = a[1] as i32 & libc::FUTEX_CMD_MASK;
    match op {
        libc::FUTEX_WAKE | libc::FUTEX_WAKE_BITSET => {}
        libc::FUTEX_LOCK_PI | libc::FUTEX_LOCK_PI2 | libc::FUTEX_WAIT_REQUEUE_PI => {
            pins.pin(a[0] as usize, 4, W);
            if a[3] != 0 {
                pins.pin(a[3] as usize, 16, R);
            }
            if op == libc::FUTEX_WAIT_REQUEUE_PI {
                pins.pin(a[4] as usize, 4, W);
            }
        }
        libc::FUTEX_REQUEUE
        | libc::FUTEX_CMP_REQUEUE
        | libc::FUTEX_WAKE_OP
        | libc::FUTEX_CMP_REQUEUE_PI => {
            pins.pin(a[0] as usize, 4, W);
            pins.pin(a[4] as usize, 4, W);
        }
        _ => {
            pins.pin(a[0] as usize, 4, W);
        }
    }
}

/// Whether `futex` call `a` is a plain wait: it reads its word (and timeout) once before
/// it sleeps and changes nothing when that read fails, so it is retried on EFAULT instead
/// of holding a pin for as long as it sleeps.
pub(crate) fn is_futex_wait(nr: i64, a: &[u64; 6]) -> bool {
    nr == libc::SYS_futex
        && matches!(
            a[1] as i32 & libc::FUTEX_CMD_MASK,
            libc::FUTEX_WAIT | libc::FUTEX_WAIT_BITSET
        )
}

/// Brings a futex wait's word and timeout in, without keeping them pinned.
pub(crate) fn bring_in_futex_wait(a: &[u64; 6]) {
    let mut pins = CallPins::new();
    pins.pin(a[0] as usize, 4, W);
    if a[3] != 0 {
        pins.pin(a[3] as usize, 16, R);
    }
    pins.release();
}
