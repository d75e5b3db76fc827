//! The CPU the calling thread runs on, for per-CPU structures. A thread can migrate right
//! after asking, so the answer is a hint for spreading load, never a lock.

/// CPUs this process may run on (its affinity mask; the online CPUs when the kernel
/// cannot tell), for sizing per-CPU structures. Asked once per process, with one system
/// call: the standard library's `available_parallelism` also reads the process's cgroup
/// files for a CPU quota (0.1 ms, at the start of every process and fork child under
/// `uswap run`); [`usable`] does, where a quota matters. A later change of affinity is not
/// seen: any count serves to size per-CPU structures.
pub fn count() -> usize {
    static COUNT: std::sync::OnceLock<usize> = std::sync::OnceLock::new();
    *COUNT.get_or_init(|| {
        // SAFETY: a zeroed cpu_set_t is an empty set; the kernel fills it for this thread.
        let mut set: libc::cpu_set_t = unsafe { std::mem::zeroed() };
        let size = std::mem::size_of::<libc::cpu_set_t>();
        // SAFETY: `set` is writable for `size` bytes.
        match unsafe { libc::sched_getaffinity(0, size, &mut set) } {
            // SAFETY: counting the bits of a set the kernel filled.
            0 => (unsafe { libc::CPU_COUNT(&set) } as usize).max(1),
            // More CPUs than a cpu_set_t holds: those online.
            // SAFETY: sysconf has no preconditions.
            _ => (unsafe { libc::sysconf(libc::_SC_NPROCESSORS_ONLN) }).max(1) as usize,
        }
    })
}

/// CPUs this process can keep busy: [`count`] lowered to its cgroup's CPU quota, for
/// sizing thread pools (a container given two CPUs of a large machine gets two handlers,
/// not a quarter of the machine's). Reads the cgroup files, once per process.
pub fn usable() -> usize {
    static USABLE: std::sync::OnceLock<usize> = std::sync::OnceLock::new();
    *USABLE.get_or_init(|| std::thread::available_parallelism().map_or(1, |n| n.get().min(count())))
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
