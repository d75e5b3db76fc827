//! The resident budget ([mm/page_alloc.c]'s free-page count against the watermarks): the
//! region's resident pages (active + inactive + being filled) against its memory limit. A
//! lock-free counter; `vmscan` decides what to do when it runs short.

use crate::sync::AtomicU64;
use std::sync::atomic::Ordering::Relaxed;

pub struct Budget {
    limit: AtomicU64,
    resident: AtomicU64,
}

impl Budget {
    pub fn new(limit: u64) -> Self {
        Budget {
            limit: AtomicU64::new(limit),
            resident: AtomicU64::new(0),
        }
    }

    /// Charges up to `want` pages; returns how many were granted (0 when the budget is spent).
    pub fn try_charge(&self, want: u64) -> u64 {
        let mut cur = self.resident.load(Relaxed);
        loop {
            let got = want.min(self.limit().saturating_sub(cur));
            if got == 0 {
                return 0;
            }
            match self
                .resident
                .compare_exchange_weak(cur, cur + got, Relaxed, Relaxed)
            {
                Ok(_) => return got,
                Err(now) => cur = now,
            }
        }
    }

    /// Charges pages past the limit: for data that has nowhere else to go (see
    /// `FaultPath::swap_in`). Reclaim brings the budget back under the limit.
    pub fn overdraw(&self, pages: u64) {
        self.resident.fetch_add(pages, Relaxed);
    }

    pub fn uncharge(&self, pages: u64) {
        let before = self.resident.fetch_sub(pages, Relaxed);
        debug_assert!(before >= pages, "uncharging more pages than are resident");
    }

    pub fn resident(&self) -> u64 {
        self.resident.load(Relaxed)
    }

    /// Free pages under the limit (0 while overdrawn).
    pub fn free(&self) -> u64 {
        self.limit().saturating_sub(self.resident())
    }

    pub fn limit(&self) -> u64 {
        self.limit.load(Relaxed)
    }

    /// A new limit. Lowering it leaves pages over the limit resident until reclaim takes
    /// the budget under it.
    pub fn set_limit(&self, pages: u64) {
        self.limit.store(pages, Relaxed);
    }
}

#[cfg(all(test, not(loom)))]
mod tests {
    use super::*;

    #[test]
    fn budget_grants_at_most_the_limit() {
        let b = Budget::new(10);
        assert_eq!(b.try_charge(4), 4);
        assert_eq!(b.try_charge(8), 6);
        assert_eq!(b.try_charge(1), 0);
        b.uncharge(3);
        assert_eq!((b.resident(), b.free()), (7, 3));
    }

    #[test]
    fn stress_concurrent_charges_never_exceed_the_limit() {
        let b = Budget::new(1000);
        std::thread::scope(|s| {
            for _ in 0..4 {
                s.spawn(|| {
                    for _ in 0..50_000 {
                        let got = b.try_charge(3);
                        assert!(b.resident() <= 1000);
                        b.uncharge(got);
                    }
                });
            }
        });
        assert_eq!(b.resident(), 0);
    }
}

/// Model check of the budget: `RUSTFLAGS="--cfg loom" cargo test -p uswap-core --lib --release budget::loom`.
#[cfg(all(test, loom))]
mod loom_tests {
    use super::*;

    #[test]
    fn concurrent_charges_never_exceed_the_limit_and_all_come_back() {
        loom::model(|| {
            let b = std::sync::Arc::new(Budget::new(3));
            let threads: Vec<_> = (0..2)
                .map(|_| {
                    let b = b.clone();
                    loom::thread::spawn(move || {
                        let got = b.try_charge(2);
                        assert!(b.resident() <= 3);
                        got
                    })
                })
                .collect();
            let granted: Vec<u64> = threads.into_iter().map(|t| t.join().unwrap()).collect();
            assert_eq!(
                granted.iter().sum::<u64>(),
                3,
                "{granted:?}: all of the limit, no more"
            );
            b.uncharge(3);
            assert_eq!(b.resident(), 0);
        });
    }
}
