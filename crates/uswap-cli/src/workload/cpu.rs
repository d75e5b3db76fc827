//! What the whole process spent over an interval (getrusage): CPU time and context
//! switches, counted the same way under uswap (program, fault handlers, kswapd) and under
//! the kernel's swap (the program; its memory cgroup reclaims in the faulting thread).

use serde::{Deserialize, Serialize};

#[derive(Clone, Copy, Debug, Default, Serialize, Deserialize, PartialEq)]
pub struct CpuUse {
    pub user_s: f64,
    pub system_s: f64,
    /// Sleeps: waiting for I/O, a fault handler, a lock.
    pub voluntary_switches: u64,
    /// Preemptions.
    pub involuntary_switches: u64,
    /// Faults the kernel served with I/O (its swap-ins; uswap's own show in its counters).
    #[serde(default)]
    pub major_faults: u64,
}

impl CpuUse {
    /// The process's use so far (all threads).
    pub fn now() -> CpuUse {
        // SAFETY: getrusage fills the struct it is given; RUSAGE_SELF cannot fail.
        let mut u: libc::rusage = unsafe { std::mem::zeroed() };
        unsafe { libc::getrusage(libc::RUSAGE_SELF, &mut u) };
        let secs = |t: libc::timeval| t.tv_sec as f64 + t.tv_usec as f64 / 1e6;
        CpuUse {
            user_s: secs(u.ru_utime),
            system_s: secs(u.ru_stime),
            voluntary_switches: u.ru_nvcsw as u64,
            involuntary_switches: u.ru_nivcsw as u64,
            major_faults: u.ru_majflt as u64,
        }
    }

    pub fn since(&self, earlier: &CpuUse) -> CpuUse {
        CpuUse {
            user_s: self.user_s - earlier.user_s,
            system_s: self.system_s - earlier.system_s,
            voluntary_switches: self.voluntary_switches - earlier.voluntary_switches,
            involuntary_switches: self.involuntary_switches - earlier.involuntary_switches,
            major_faults: self.major_faults - earlier.major_faults,
        }
    }

    pub fn cpu_s(&self) -> f64 {
        self.user_s + self.system_s
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn busy_work_shows_as_cpu_time_and_a_sleep_as_a_switch() {
        let before = CpuUse::now();
        // Spins until 20 ms of CPU time show (on a loaded machine that takes longer than
        // 20 ms of wall time); a CpuUse that did not count it would spin to the deadline.
        let deadline = std::time::Instant::now() + std::time::Duration::from_secs(10);
        let mut x = 0u64;
        while CpuUse::now().since(&before).cpu_s() < 0.02 && std::time::Instant::now() < deadline {
            for _ in 0..10_000 {
                x = std::hint::black_box(x.wrapping_add(1));
            }
        }
        std::thread::sleep(std::time::Duration::from_millis(2));
        let used = CpuUse::now().since(&before);
        assert!(used.cpu_s() >= 0.02, "{used:?}");
        assert!(used.voluntary_switches >= 1, "{used:?}");
    }
}
