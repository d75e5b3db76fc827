//! The CPU the calling thread runs on, for per-CPU structures. A thread can migrate right
//! after asking, so the answer is a hint for spreading load, never a lock.

/// CPUs this process may run on (1 when the kernel cannot tell), for sizing per-CPU
/// structures. Asked once per process: the standard library's answer reads the process's
/// cgroup files each time (eight system calls), and a region's start asked a dozen times,
/// in every process and fork child under `uswap run`. A later change of affinity or CPU
/// quota is not seen: the count only sizes per-CPU structures, which any count serves.
pub fn count() -> usize {
    static COUNT: std::sync::OnceLock<usize> = std::sync::OnceLock::new();
    *COUNT.get_or_init(|| std::thread::available_parallelism().map_or(1, |n| n.get()))
}

/// CPUs the machine has (not only those this process may use): the range of CPU numbers
/// `current` returns, for structures indexed by it.
pub fn configured() -> usize {
    // SAFETY: sysconf has no preconditions.
    let n = unsafe { libc::sysconf(libc::_SC_NPROCESSORS_CONF) };
    if n > 0 {
        n as usize
    } else {
        count()
    }
}

/// Current CPU number (0 when the kernel cannot tell).
pub fn current() -> usize {
    // SAFETY: sched_getcpu has no preconditions.
    let cpu = unsafe { libc::sched_getcpu() };
    if cpu < 0 {
        0
    } else {
        cpu as usize
    }
}
