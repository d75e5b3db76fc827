//! Changes of user and group in a process that has uswap's threads beside the program's,
//! and every change of privilege a region's build needs to come before.
//!
//! A program's region is built when it first needs one (`space`), by whatever user and
//! privileges the program has then. A change of ids, of capabilities, of root or of
//! namespace, a seccomp filter or `PR_SET_DUMPABLE` may take away what the build needs
//! (userfaultfd, `/proc/self/pagemap`, the swap directory), so each builds it first.
//!
//! The C library makes every thread of a process take new ids (its `setxid` broadcast) and
//! aborts the program, without a word, if the change fails in some threads only. A program
//! that keeps its capabilities across a change of user (`PR_SET_KEEPCAPS`, then `capset`, as
//! `setpriv` does) raises them again in its own thread alone: uswap's threads lost theirs
//! with the change of user, so a later change of group fails in them and the program is
//! aborted. Such a call is refused here instead, with EPERM and one line that says why and
//! what to do; every other call goes to the C library as before.

use crate::internal::Inside;
use crate::threads::next;
use libc::{c_int, c_ulong, c_void, gid_t, size_t, uid_t};
use std::ffi::CStr;
use std::sync::atomic::AtomicPtr;

/// The capability bits (`linux/capability.h`) a change of group or of user needs.
const CAP_SETGID: u32 = 6;
const CAP_SETUID: u32 = 7;

/// A thread of this process that lacks `cap` while the calling thread has it in effect
/// (`CapEff` in `/proc/…/status`): its id and name.
fn thread_without(cap: u32) -> Option<(String, String)> {
    let effective = |status: &str| {
        status
            .lines()
            .find_map(|line| line.strip_prefix("CapEff:"))
            .and_then(|hex| u64::from_str_radix(hex.trim(), 16).ok())
            .map(|bits| bits & (1 << cap) != 0)
    };
    let own = std::fs::read_to_string("/proc/thread-self/status").ok()?;
    if effective(&own) != Some(true) {
        return None;
    }
    // SAFETY: gettid has no preconditions.
    let me = unsafe { libc::gettid() }.to_string();
    std::fs::read_dir("/proc/self/task")
        .ok()?
        .flatten()
        .find_map(|task| {
            let tid = task.file_name().to_string_lossy().into_owned();
            let status = std::fs::read_to_string(task.path().join("status")).ok()?;
            if tid == me || effective(&status) != Some(false) {
                return None;
            }
            let name = std::fs::read_to_string(task.path().join("comm")).unwrap_or_default();
            Some((tid, name.trim().to_string()))
        })
}

/// Whether `call`, which needs `cap`, must be refused; says why on stderr if so.
fn refused(call: &str, cap: u32) -> bool {
    let _inside = Inside::enter();
    let Some((tid, name)) = thread_without(cap) else {
        return false;
    };
    let cap_name = if cap == CAP_SETGID {
        "CAP_SETGID"
    } else {
        "CAP_SETUID"
    };
    eprintln!(
        "uswap: {call} refused (EPERM): this thread has {cap_name} but thread {tid} ({name}) \
         of the process has not, since the program changed user keeping its capabilities in \
         this thread only (PR_SET_KEEPCAPS and capset, as setpriv does); the C library would \
         abort the program. Change user before uswap starts instead: setpriv … -- uswap run \
         -- PROGRAM"
    );
    // SAFETY: this thread's errno.
    unsafe { *libc::__errno_location() = libc::EPERM };
    true
}

/// `wrappers! { name(arg: type, …) needs CAP; … }`: each wrapper refuses the call when
/// [`refused`] says so, else calls the C library's function of the same name.
macro_rules! wrappers {
    ($($name:ident($($arg:ident: $ty:ty),*) needs $cap:expr;)*) => {
        $(
            #[no_mangle]
            pub unsafe extern "C" fn $name($($arg: $ty),*) -> c_int {
                static REAL: AtomicPtr<c_void> = AtomicPtr::new(std::ptr::null_mut());
                // Built by the user that started the program: the new one may not be
                // allowed userfaultfd, pagemap or the swap directory.
                crate::space::build_region();
                if refused(stringify!($name), $cap) {
                    return -1;
                }
                type F = unsafe extern "C" fn($($ty),*) -> c_int;
                let name = CStr::from_bytes_with_nul(concat!(stringify!($name), "\0").as_bytes())
                    .expect("one NUL, at the end");
                next::<F>(&REAL, name)($($arg),*)
            }
        )*
    };
}

/// `builds_first! { name(arg: type, …); … }`: each wrapper builds the program's region,
/// then calls the C library's function of the same name.
macro_rules! builds_first {
    ($($name:ident($($arg:ident: $ty:ty),*);)*) => {
        $(
            #[no_mangle]
            pub unsafe extern "C" fn $name($($arg: $ty),*) -> c_int {
                static REAL: AtomicPtr<c_void> = AtomicPtr::new(std::ptr::null_mut());
                crate::space::build_region();
                type F = unsafe extern "C" fn($($ty),*) -> c_int;
                let name = CStr::from_bytes_with_nul(concat!(stringify!($name), "\0").as_bytes())
                    .expect("one NUL, at the end");
                next::<F>(&REAL, name)($($arg),*)
            }
        )*
    };
}

builds_first! {
    capset(header: *mut c_void, data: *const c_void);
    chroot(path: *const libc::c_char);
    unshare(flags: c_int);
    setns(fd: c_int, nstype: c_int);
}

/// `prctl(2)`'s options that take away what a region's build needs.
fn drops_privilege(option: c_int) -> bool {
    [
        libc::PR_SET_DUMPABLE,
        libc::PR_SET_SECCOMP,
        libc::PR_SET_NO_NEW_PRIVS,
        libc::PR_CAPBSET_DROP,
        libc::PR_SET_SECUREBITS,
        libc::PR_CAP_AMBIENT,
    ]
    .contains(&option)
}

/// The C library's `prctl`, looked up at load: uswap's own `prctl` calls (turning
/// syscall dispatch on in a child of fork, which may be born in a signal handler) come
/// through the export below, where `dlsym` must not run.
static REAL_PRCTL: AtomicPtr<c_void> = AtomicPtr::new(std::ptr::null_mut());

type Prctl = unsafe extern "C" fn(c_int, c_ulong, c_ulong, c_ulong, c_ulong) -> c_int;

pub fn resolve() {
    // SAFETY: the slot's function is `prctl` (only its address is taken).
    unsafe { next::<Prctl>(&REAL_PRCTL, c"prctl") };
}

/// `prctl(2)`, declared with its five words: on x86-64 a variadic call passes them in the
/// same registers.
#[no_mangle]
pub unsafe extern "C" fn prctl(
    option: c_int,
    a2: c_ulong,
    a3: c_ulong,
    a4: c_ulong,
    a5: c_ulong,
) -> c_int {
    if drops_privilege(option) {
        crate::space::build_region();
    }
    next::<Prctl>(&REAL_PRCTL, c"prctl")(option, a2, a3, a4, a5)
}

wrappers! {
    setgid(gid: gid_t) needs CAP_SETGID;
    setegid(gid: gid_t) needs CAP_SETGID;
    setregid(rgid: gid_t, egid: gid_t) needs CAP_SETGID;
    setresgid(rgid: gid_t, egid: gid_t, sgid: gid_t) needs CAP_SETGID;
    setgroups(size: size_t, list: *const gid_t) needs CAP_SETGID;
    setuid(uid: uid_t) needs CAP_SETUID;
    seteuid(uid: uid_t) needs CAP_SETUID;
    setreuid(ruid: uid_t, euid: uid_t) needs CAP_SETUID;
    setresuid(ruid: uid_t, euid: uid_t, suid: uid_t) needs CAP_SETUID;
}
