//! SIGBUS mode with syscall dispatch: the program's system calls read and write its
//! swapped-out memory as in thread mode, and what dispatch does itself (signal returns,
//! signal masks, new threads, fork, spawn) behaves as without it.

mod common;

use common::{check, check_slice, fill};
use uswap_core::{syscall_dispatch, Advice, Config, FaultMode, Region, PAGE_SIZE};

const MIB: usize = 1 << 20;

/// A SIGBUS-mode region of `size` bytes, every page filled with its pattern and then
/// paged out, with dispatch on in the calling thread when `dispatch`.
fn swapped_out(size: usize, dispatch: bool) -> Region {
    let mut cfg = Config::new(MIB as u64);
    cfg.fault_mode = FaultMode::Sigbus;
    let region = Region::new(size as u64, cfg).unwrap();
    for p in 0..size / PAGE_SIZE {
        unsafe { fill(region.as_ptr(), p, 1) };
    }
    region.advise(0, region.len(), Advice::PageOut).unwrap();
    assert!(region.stats().vmstat.pswpout > 0, "nothing was paged out");
    if dispatch {
        syscall_dispatch::enable_for_this_thread().unwrap();
    }
    region
}

/// A pipe, closed when dropped.
struct Pipe {
    r: i32,
    w: i32,
}

impl Drop for Pipe {
    fn drop(&mut self) {
        unsafe { libc::close(self.r) };
        unsafe { libc::close(self.w) };
    }
}

fn pipe() -> Pipe {
    let mut fds = [0; 2];
    assert_eq!(unsafe { libc::pipe(fds.as_mut_ptr()) }, 0);
    Pipe {
        r: fds[0],
        w: fds[1],
    }
}

fn errno() -> std::io::Error {
    std::io::Error::last_os_error()
}

/// Runs `f` on a thread of its own (dispatch is per thread and stays with it).
fn on_thread<T: Send>(f: impl FnOnce() -> T + Send) -> T {
    std::thread::scope(|s| s.spawn(f).join().unwrap())
}

#[test]
fn without_dispatch_a_kernel_access_to_a_swapped_out_page_fails() {
    on_thread(|| {
        let region = swapped_out(2 * MIB, false);
        let pipe = pipe();
        let w = pipe.w;
        let n = unsafe { libc::write(w, region.as_ptr().add(7 * PAGE_SIZE).cast(), PAGE_SIZE) };
        assert_eq!(
            n, -1,
            "write(2) from a swapped-out page succeeded without dispatch"
        );
        assert_eq!(errno().raw_os_error(), Some(libc::EFAULT));
    });
}

#[test]
fn write_and_read_move_swapped_out_pages_through_a_pipe_bit_identical() {
    on_thread(|| {
        let region = swapped_out(4 * MIB, true);
        let base = region.as_ptr();
        let pages = region.len() / PAGE_SIZE;
        let pipe = pipe();
        let (r, w) = (pipe.r, pipe.w);
        // Page p goes out through write(2) and comes back into page pages/2 + p/2's place
        // through read(2): both sides are out on swap when the call starts.
        for p in (0..pages / 2).step_by(7) {
            let n = unsafe { libc::write(w, base.add(p * PAGE_SIZE).cast(), PAGE_SIZE) };
            assert_eq!(n, PAGE_SIZE as isize, "write(2) of page {p}: {}", errno());
            let dst = pages / 2 + p;
            let n = unsafe { libc::read(r, base.add(dst * PAGE_SIZE).cast(), PAGE_SIZE) };
            assert_eq!(
                n,
                PAGE_SIZE as isize,
                "read(2) into page {dst}: {}",
                errno()
            );
            let copied =
                unsafe { std::slice::from_raw_parts(base.add(dst * PAGE_SIZE), PAGE_SIZE) };
            assert!(
                check_slice(copied, p, 1),
                "page {dst} did not get page {p}'s data"
            );
        }
        let stats = region.stats().vmstat;
        assert!(stats.syscall_pins > 0, "no call pinned anything");
        syscall_dispatch::disable_for_this_thread();
    });
}

#[test]
fn vectored_calls_and_a_stat_buffer_in_swapped_out_memory_are_served() {
    on_thread(|| {
        let region = swapped_out(2 * MIB, true);
        let base = region.as_ptr();
        let pipe = pipe();
        let (r, w) = (pipe.r, pipe.w);
        // The iovec array itself lies in swapped-out memory too (it overwrites page 100).
        let iov = unsafe { base.add(100 * PAGE_SIZE) } as *mut libc::iovec;
        for (i, page) in [3usize, 40, 77].into_iter().enumerate() {
            unsafe {
                *iov.add(i) = libc::iovec {
                    iov_base: base.add(page * PAGE_SIZE).cast(),
                    iov_len: PAGE_SIZE,
                }
            };
        }
        region.advise(0, region.len(), Advice::PageOut).unwrap();
        let n = unsafe { libc::writev(w, iov, 3) };
        assert_eq!(n, 3 * PAGE_SIZE as isize, "writev: {}", errno());
        for (i, page) in [200usize, 260, 300].into_iter().enumerate() {
            unsafe { (*iov.add(i)).iov_base = base.add(page * PAGE_SIZE).cast() };
        }
        region.advise(0, region.len(), Advice::PageOut).unwrap();
        let n = unsafe { libc::readv(r, iov, 3) };
        assert_eq!(n, 3 * PAGE_SIZE as isize, "readv: {}", errno());
        for (from, to) in [(3usize, 200usize), (40, 260), (77, 300)] {
            let got = unsafe { std::slice::from_raw_parts(base.add(to * PAGE_SIZE), PAGE_SIZE) };
            assert!(
                check_slice(got, from, 1),
                "page {to} did not get page {from}'s data"
            );
        }
        let st = unsafe { base.add(400 * PAGE_SIZE + 8) } as *mut libc::stat;
        region.advise(0, region.len(), Advice::PageOut).unwrap();
        assert_eq!(unsafe { libc::fstat(r, st) }, 0, "fstat: {}", errno());
        assert_eq!(unsafe { (*st).st_mode } & libc::S_IFMT, libc::S_IFIFO);
        syscall_dispatch::disable_for_this_thread();
    });
}

static SIGNALLED: std::sync::atomic::AtomicUsize = std::sync::atomic::AtomicUsize::new(0);

extern "C" fn count_and_call(_: libc::c_int) {
    // A system call inside the program's handler is dispatched too.
    let pid = unsafe { libc::getpid() };
    assert!(pid > 0);
    SIGNALLED.fetch_add(1, std::sync::atomic::Ordering::SeqCst);
}

#[test]
fn a_program_signal_handler_returns_and_blocking_every_signal_keeps_dispatch_alive() {
    on_thread(|| {
        let region = swapped_out(MIB, true);
        unsafe {
            libc::signal(
                libc::SIGUSR1,
                count_and_call as *const () as libc::sighandler_t,
            );
            for _ in 0..3 {
                libc::raise(libc::SIGUSR1);
            }
        }
        assert_eq!(SIGNALLED.load(std::sync::atomic::Ordering::SeqCst), 3);
        // A thread that blocks every signal still has SIGSYS and SIGBUS open.
        unsafe {
            let mut all: libc::sigset_t = std::mem::zeroed();
            let mut old: libc::sigset_t = std::mem::zeroed();
            libc::sigfillset(&mut all);
            assert_eq!(libc::pthread_sigmask(libc::SIG_BLOCK, &all, &mut old), 0);
            let mut now: libc::sigset_t = std::mem::zeroed();
            libc::pthread_sigmask(libc::SIG_BLOCK, std::ptr::null(), &mut now);
            assert_eq!(libc::sigismember(&now, libc::SIGUSR1), 1);
            assert_eq!(libc::sigismember(&now, libc::SIGSYS), 0);
            assert_eq!(libc::sigismember(&now, libc::SIGBUS), 0);
            // Touching a swapped-out page with every other signal blocked.
            assert!(check(region.as_ptr(), 9, 1).is_ok());
            libc::pthread_sigmask(libc::SIG_SETMASK, &old, std::ptr::null_mut());
        }
        syscall_dispatch::disable_for_this_thread();
    });
}

#[test]
fn threads_fork_and_spawn_from_a_dispatching_thread_work() {
    on_thread(|| {
        let region = swapped_out(MIB, true);
        let base = region.as_ptr() as usize;
        // A new thread (clone3 on its own stack) starts where the program expects.
        let sum = std::thread::spawn(move || {
            (0..8)
                .map(|p| unsafe { check(base as *const u8, p, 1) }.is_ok() as u32)
                .sum::<u32>()
        })
        .join()
        .unwrap();
        assert_eq!(sum, 8);
        // fork: the child returns through the handler like the parent.
        let pid = unsafe { libc::fork() };
        if pid == 0 {
            unsafe { libc::_exit(7) };
        }
        assert!(pid > 0, "fork: {}", errno());
        let mut status = 0;
        assert_eq!(unsafe { libc::waitpid(pid, &mut status, 0) }, pid);
        assert!(libc::WIFEXITED(status) && libc::WEXITSTATUS(status) == 7);
        // posix_spawn (a CLONE_VFORK child on a stack of its own).
        let out = std::process::Command::new("/bin/echo")
            .arg("spawned")
            .output()
            .unwrap();
        assert_eq!(out.stdout, b"spawned\n");
        syscall_dispatch::disable_for_this_thread();
    });
}

/// Calls that read and write swapped-out pages while another thread's accesses keep aging
/// and reclaim busy over the same pages: every call succeeds and every page keeps its
/// data (a pin lost to aging would show as EFAULT; a wrong page as a pattern mismatch).
#[test]
fn stress_calls_on_pages_aging_keeps_taking_away() {
    const ROUNDS: usize = 10_000;
    let region = swapped_out(8 * MIB, false);
    let (base, pages) = (region.as_ptr() as usize, region.len() / PAGE_SIZE);
    let stop = std::sync::atomic::AtomicBool::new(false);
    std::thread::scope(|s| {
        s.spawn(|| {
            let mut x = 0x9e37_79b9_7f4a_7c15u64;
            while !stop.load(std::sync::atomic::Ordering::Relaxed) {
                x ^= x << 13;
                x ^= x >> 7;
                x ^= x << 17;
                let p = x as usize % pages;
                assert!(unsafe { check(base as *const u8, p, 1) }.is_ok());
            }
        });
        syscall_dispatch::enable_for_this_thread().unwrap();
        let pipe = pipe();
        let (r, w) = (pipe.r, pipe.w);
        let mut buf = vec![0u8; PAGE_SIZE];
        let mut x = 0x2545_f491_4f6c_dd1du64;
        for _ in 0..ROUNDS {
            x ^= x << 13;
            x ^= x >> 7;
            x ^= x << 17;
            let p = x as usize % pages;
            // Out through write(2) from the region, back through read(2) into the same
            // page (its own data, so the other thread's checks hold), and once more into a
            // private buffer to compare.
            let at = (base + p * PAGE_SIZE) as *mut libc::c_void;
            assert_eq!(
                unsafe { libc::write(w, at, PAGE_SIZE) },
                PAGE_SIZE as isize,
                "{}",
                errno()
            );
            assert_eq!(
                unsafe { libc::read(r, at, PAGE_SIZE) },
                PAGE_SIZE as isize,
                "{}",
                errno()
            );
            assert_eq!(
                unsafe { libc::write(w, at, PAGE_SIZE) },
                PAGE_SIZE as isize,
                "{}",
                errno()
            );
            assert_eq!(
                unsafe { libc::read(r, buf.as_mut_ptr().cast(), PAGE_SIZE) },
                PAGE_SIZE as isize
            );
            assert!(
                check_slice(&buf, p, 1),
                "page {p} came back wrong through the pipe"
            );
        }
        syscall_dispatch::disable_for_this_thread();
        stop.store(true, std::sync::atomic::Ordering::Relaxed);
    });
    let stats = region.stats().vmstat;
    assert!(
        stats.pswpin > 0 && stats.syscall_pins >= 3 * ROUNDS as u64,
        "{stats:?}"
    );
    eprintln!(
        "aging passed over pinned pages {} times",
        stats.pgskip_pinned
    );
}

/// A read(2) blocked on an empty pipe keeps its swapped-out destination pinned: another
/// thread cycles every other page through the 1 MiB limit meanwhile, so aging reaches the
/// pinned page and must leave it mapped, or the data read into it would be refused.
#[test]
fn a_page_pinned_by_a_blocked_read_stays_mapped_while_aging_cycles_the_rest() {
    let region = swapped_out(8 * MIB, false);
    let (base, pages) = (region.as_ptr() as usize, region.len() / PAGE_SIZE);
    let pipe = pipe();
    let (r, w) = (pipe.r, pipe.w);
    let target = 1_000;
    std::thread::scope(|s| {
        s.spawn(|| {
            for round in 0..4 {
                for p in (0..pages).filter(|&p| p != target) {
                    if let Err(e) = unsafe { check(base as *const u8, p, 1) } {
                        panic!("round {round}: {e}");
                    }
                }
            }
            // The data: page 5's pattern, from a private copy (this thread has no dispatch).
            let page5 = unsafe {
                std::slice::from_raw_parts((base + 5 * PAGE_SIZE) as *const u8, PAGE_SIZE)
            }
            .to_vec();
            let n = unsafe { libc::write(w, page5.as_ptr().cast(), PAGE_SIZE) };
            assert_eq!(n, PAGE_SIZE as isize);
        });
        syscall_dispatch::enable_for_this_thread().unwrap();
        let at = (base + target * PAGE_SIZE) as *mut libc::c_void;
        let n = unsafe { libc::read(r, at, PAGE_SIZE) };
        syscall_dispatch::disable_for_this_thread();
        assert_eq!(n, PAGE_SIZE as isize, "read(2): {}", errno());
    });
    assert!(unsafe { check(base as *const u8, target, 1) }.is_err());
    let got =
        unsafe { std::slice::from_raw_parts((base + target * PAGE_SIZE) as *const u8, PAGE_SIZE) };
    assert!(
        check_slice(got, 5, 1),
        "the page read into holds something else"
    );
    let stats = region.stats().vmstat;
    assert!(
        stats.pgskip_pinned > 0,
        "aging never reached the pinned page: {stats:?}"
    );
}

/// 300 calls blocked on region memory at once (a thread per connection), and the calls
/// that wake them need pins too (the writes come from swapped-out region memory): every
/// one goes through, with its data, and while they wait, reclaim goes on for the rest of
/// the region, twice its limit. With a table of 256 words, the 257th pinner once spun in
/// `sched_yield` for ever; later the overflow pinned the whole region, reclaim freed
/// nothing, and the first fault that needed memory failed as out of memory.
#[test]
fn three_hundred_blocked_calls_complete_and_reclaim_goes_on_meanwhile() {
    use std::sync::atomic::{AtomicUsize, Ordering::SeqCst};
    const CALLS: usize = 300;
    let mut cfg = Config::new(4 * MIB as u64);
    cfg.fault_mode = FaultMode::Sigbus;
    let region = Region::new(8 * MIB as u64, cfg).unwrap();
    for p in 0..region.len() / PAGE_SIZE {
        unsafe { fill(region.as_ptr(), p, 1) };
    }
    let base = region.as_ptr() as usize;
    let at = |i: usize| base + (i * 4 + 3) * PAGE_SIZE;
    let from = |i: usize| base + (i * 4 + 1) * PAGE_SIZE;
    for i in 0..CALLS {
        unsafe { (from(i) as *mut u64).write_volatile(i as u64 + 1_000) };
    }
    region.advise(0, region.len(), Advice::PageOut).unwrap();
    let pipes: Vec<Pipe> = (0..CALLS).map(|_| pipe()).collect();
    let started = AtomicUsize::new(0);
    std::thread::scope(|s| {
        for (i, p) in pipes.iter().enumerate() {
            let (r, started) = (p.r, &started);
            s.spawn(move || {
                syscall_dispatch::enable_for_this_thread().unwrap();
                started.fetch_add(1, SeqCst);
                let n = unsafe { libc::read(r, at(i) as *mut libc::c_void, 8) };
                syscall_dispatch::disable_for_this_thread();
                assert_eq!(n, 8, "read(2) {i}: {}", errno());
            });
        }
        while started.load(SeqCst) < CALLS {
            std::thread::sleep(std::time::Duration::from_millis(1));
        }
        // Let them all block in their reads, holding their pins.
        std::thread::sleep(std::time::Duration::from_millis(300));
        // Every page but the calls' own (1,448 of 2,048), twice, through a limit of 1,024
        // pages: reclaim must take pages out while the calls hold their pins.
        let calls_own = |p: usize| p / 4 < CALLS && p % 2 == 1;
        let stolen_before = region.stats().vmstat.pgsteal;
        for round in 0..2 {
            for p in (0..region.len() / PAGE_SIZE).filter(|&p| !calls_own(p)) {
                if let Err(e) = unsafe { check(base as *const u8, p, 1) } {
                    panic!("round {round}, page {p}: {e}");
                }
            }
        }
        assert!(
            region.stats().vmstat.pgsteal > stolen_before,
            "reclaim took nothing out while the calls waited"
        );
        syscall_dispatch::enable_for_this_thread().unwrap();
        for (i, p) in pipes.iter().enumerate() {
            let n = unsafe { libc::write(p.w, from(i) as *const libc::c_void, 8) };
            assert_eq!(n, 8, "write(2) {i}: {}", errno());
        }
        syscall_dispatch::disable_for_this_thread();
    });
    for i in 0..CALLS {
        let got = unsafe { (at(i) as *const u64).read_volatile() };
        assert_eq!(got, i as u64 + 1_000, "call {i}");
    }
}

static PROGRAM_SIGBUS: std::sync::atomic::AtomicUsize = std::sync::atomic::AtomicUsize::new(0);

extern "C" fn program_sigbus(_: libc::c_int) {
    PROGRAM_SIGBUS.fetch_add(1, std::sync::atomic::Ordering::SeqCst);
}

/// A program that installs a SIGBUS handler of its own (a crash reporter) keeps getting
/// uswap's faults served: its handler is recorded, reported back to it, and called only
/// for SIGBUS signals that are not about a region.
#[test]
fn a_program_sigbus_handler_gets_only_what_is_not_a_fault_of_uswaps() {
    on_thread(|| {
        let region = swapped_out(MIB, true);
        unsafe {
            let mut act: libc::sigaction = std::mem::zeroed();
            act.sa_sigaction = program_sigbus as *const () as usize;
            assert_eq!(libc::sigaction(libc::SIGBUS, &act, std::ptr::null_mut()), 0);
            let mut seen: libc::sigaction = std::mem::zeroed();
            assert_eq!(
                libc::sigaction(libc::SIGBUS, std::ptr::null(), &mut seen),
                0
            );
            assert_eq!(seen.sa_sigaction, program_sigbus as *const () as usize);
        }
        for p in 0..16 {
            assert!(unsafe { check(region.as_ptr(), p, 1) }.is_ok());
        }
        assert_eq!(PROGRAM_SIGBUS.load(std::sync::atomic::Ordering::SeqCst), 0);
        unsafe { libc::raise(libc::SIGBUS) };
        assert_eq!(PROGRAM_SIGBUS.load(std::sync::atomic::Ordering::SeqCst), 1);
        syscall_dispatch::disable_for_this_thread();
    });
}

/// `sigaltstack` with dispatch on: the program sets, reads back and disables its alternate
/// stack as it would without it (the real call would fail with EPERM: uswap's handler runs
/// on the alternate stack), and a pselect6 with every signal in its mask returns.
#[test]
fn the_programs_alternate_stack_and_a_pselect_mask_behave_as_without_dispatch() {
    on_thread(|| {
        let _region = swapped_out(MIB, true);
        let mut mem = vec![0u8; 64 << 10];
        unsafe {
            let set = libc::stack_t {
                ss_sp: mem.as_mut_ptr().cast(),
                ss_flags: 0,
                ss_size: mem.len(),
            };
            let mut old: libc::stack_t = std::mem::zeroed();
            assert_eq!(libc::sigaltstack(&set, &mut old), 0, "{}", errno());
            let mut now: libc::stack_t = std::mem::zeroed();
            assert_eq!(libc::sigaltstack(std::ptr::null(), &mut now), 0);
            assert_eq!((now.ss_sp, now.ss_size), (set.ss_sp, set.ss_size));
            let off = libc::stack_t {
                ss_sp: std::ptr::null_mut(),
                ss_flags: libc::SS_DISABLE,
                ss_size: 0,
            };
            assert_eq!(libc::sigaltstack(&off, std::ptr::null_mut()), 0);
            libc::sigaltstack(std::ptr::null(), &mut now);
            assert_eq!(now.ss_flags & libc::SS_DISABLE, libc::SS_DISABLE);
            // A wait with every signal blocked for its duration.
            let mut all: libc::sigset_t = std::mem::zeroed();
            libc::sigfillset(&mut all);
            let timeout = libc::timespec {
                tv_sec: 0,
                tv_nsec: 1_000_000,
            };
            assert_eq!(
                libc::pselect(
                    0,
                    std::ptr::null_mut(),
                    std::ptr::null_mut(),
                    std::ptr::null_mut(),
                    &timeout,
                    &all
                ),
                0
            );
        }
        syscall_dispatch::disable_for_this_thread();
    });
}

/// sendmsg(2) and recvmsg(2) on a socket pair with the header, its iovec array and the
/// buffers all in swapped-out memory.
#[test]
fn a_message_whose_header_vector_and_buffers_are_swapped_out_goes_through_a_socket() {
    on_thread(|| {
        let region = swapped_out(2 * MIB, true);
        let base = region.as_ptr();
        let mut fds = [0; 2];
        let rc = unsafe { libc::socketpair(libc::AF_UNIX, libc::SOCK_DGRAM, 0, fds.as_mut_ptr()) };
        assert_eq!(rc, 0, "socketpair: {}", errno());
        let at = |page: usize| unsafe { base.add(page * PAGE_SIZE) };
        let message = |header: usize, iov: usize, pages: [usize; 2]| unsafe {
            let v = at(iov) as *mut libc::iovec;
            for (i, p) in pages.into_iter().enumerate() {
                *v.add(i) = libc::iovec {
                    iov_base: at(p).cast(),
                    iov_len: PAGE_SIZE,
                };
            }
            let m = at(header) as *mut libc::msghdr;
            *m = std::mem::zeroed();
            (*m).msg_iov = v;
            (*m).msg_iovlen = 2;
            m
        };
        let sent = message(10, 11, [20, 21]);
        let received = message(30, 31, [40, 41]);
        region.advise(0, region.len(), Advice::PageOut).unwrap();
        let n = unsafe { libc::sendmsg(fds[0], sent, 0) };
        assert_eq!(n, 2 * PAGE_SIZE as isize, "sendmsg: {}", errno());
        region.advise(0, region.len(), Advice::PageOut).unwrap();
        let n = unsafe { libc::recvmsg(fds[1], received, 0) };
        assert_eq!(n, 2 * PAGE_SIZE as isize, "recvmsg: {}", errno());
        for (from, to) in [(20usize, 40usize), (21, 41)] {
            let got = unsafe { std::slice::from_raw_parts(at(to), PAGE_SIZE) };
            assert!(
                check_slice(got, from, 1),
                "page {to} did not get page {from}'s data"
            );
        }
        syscall_dispatch::disable_for_this_thread();
        unsafe { libc::close(fds[0]) };
        unsafe { libc::close(fds[1]) };
    });
}
