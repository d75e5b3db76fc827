//! The CPU the calling thread runs on, for per-CPU structures. A thread can migrate right
//! after asking, so the answer is a hint for spreading load, never a lock.

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
