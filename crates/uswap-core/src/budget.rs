//! The resident budget ([mm/page_alloc.c]'s free-page count against the watermarks): the
//! region's resident pages (active + inactive + being filled) against its memory limit. A
//! lock-free counter (the region's member slot of its memory cgroup, `memcg.rs`, whose
//! limit may cover a whole process tree), with a per-CPU stock of pages charged ahead in
//! front of it (on with `Config::pcp`); `vmscan` decides what to do when it runs short.

use crate::memcg::MemCgroup;
use crate::sync::AtomicU64;
use crossbeam_utils::CachePadded;
use serde::Serialize;
use std::sync::atomic::Ordering::Relaxed;
use std::sync::Arc;
use std::time::Instant;

/// One CPU's stock of pages charged ahead, and its counters (kept per CPU, so counting
/// shares no line either).
#[derive(Default)]
struct Stock {
    pages: AtomicU64,
    /// Charges served from the stock alone.
    hits: AtomicU64,
    /// Charges and uncharges that had to touch the shared counter.
    shared: AtomicU64,
}

/// What the per-CPU stocks did, summed over CPUs.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Serialize)]
pub struct StockStats {
    /// Charges served from a CPU's stock, touching no shared counter.
    pub stock_hits: u64,
    /// Charges and uncharges by a stock that touched the shared counter (refills and
    /// returns; 0 with stocks off, where every charge and uncharge does).
    pub shared_updates: u64,
    /// Times every stock was drained back because the budget ran short.
    pub drains: u64,
}

pub struct Budget {
    /// The limit, and the counters of every region under it.
    cg: Arc<MemCgroup>,
    /// This region's member slot: its counter holds the pages charged, the resident ones
    /// and those held in per-CPU stocks.
    member: usize,
    /// Per-CPU stocks (the memcg charge stock): a charge served from its CPU's stock
    /// touches no shared counter. Empty when stocks are off.
    stocks: Box<[CachePadded<Stock>]>,
    /// Pages a stock is refilled with, and twice what it may keep.
    batch: u64,
    drains: AtomicU64,
    /// When dead members may be looked for next ([`Budget::reap_dead_members`]), in
    /// milliseconds since `born`.
    next_reap_ms: AtomicU64,
    born: Instant,
}

/// How often reclaim looks for members of the tree that died holding charges: each look
/// is a system call per member.
const REAP_EVERY_MS: u64 = 100;

/// Pages a stock takes at a time (the kernel's memcg stock takes 64).
const STOCK_BATCH: u64 = 32;

impl Budget {
    /// A budget of `limit` pages, with a stock for each of `cpus` CPUs (0: none). Stocks
    /// hold at most a sixteenth of the limit in all, so a small limit gets small stocks.
    pub fn new(limit: u64, cpus: usize) -> Self {
        Self::in_group(Arc::new(MemCgroup::private(limit)), cpus)
            .expect("a private group has room for its one member")
    }

    /// A budget charged against `cg`'s limit, as one of its members; `None` when the group
    /// has no member slot left.
    pub fn in_group(cg: Arc<MemCgroup>, cpus: usize) -> Option<Self> {
        let member = cg.join()?;
        let limit = cg.limit();
        let batch = match cpus {
            0 => 0,
            n => STOCK_BATCH.min(limit / 32 / n as u64),
        };
        let cpus = if batch == 0 { 0 } else { cpus };
        Some(Budget {
            cg,
            member,
            stocks: (0..cpus)
                .map(|_| CachePadded::new(Stock::default()))
                .collect(),
            batch,
            drains: AtomicU64::new(0),
            next_reap_ms: AtomicU64::new(0),
            born: Instant::now(),
        })
    }

    /// This region's counter.
    fn charged(&self) -> &AtomicU64 {
        self.cg.charged(self.member)
    }

    /// Charges up to `want` pages; returns how many were granted (0 when the budget is
    /// spent). Served from this CPU's stock when it holds enough.
    pub fn try_charge(&self, want: u64) -> u64 {
        match self.stocks.is_empty() {
            true => self.charge_shared(want),
            false => self.try_charge_on(crate::cpu::current(), want),
        }
    }

    fn try_charge_on(&self, cpu: usize, want: u64) -> u64 {
        let Some(stock) = self.stock(cpu) else {
            return self.charge_shared(want);
        };
        let taken = take_up_to(&stock.pages, want);
        if taken == want {
            stock.hits.fetch_add(1, Relaxed);
            return want;
        }
        stock.shared.fetch_add(1, Relaxed);
        let need = want - taken;
        let got = self.charge_shared(need + self.batch);
        if got >= need {
            stock.pages.fetch_add(got - need, Relaxed);
            return want;
        }
        // Short: every stock gives its pages back, and the rest of the limit is tried.
        self.drain_stocks();
        taken + got + self.charge_shared(need - got)
    }

    /// Charges the shared counter alone: up to `want` pages. In a group shared by a
    /// process tree, slots of members that died are reaped whenever it comes up short, not
    /// only when nothing is left: a process that lives on the few pages reclaim frees for it
    /// would otherwise never give a dead member's charges back (a redis-server started
    /// after another exited thrashed with nothing resident, 229 MiB of a 256 MiB group
    /// held by the dead one).
    fn charge_shared(&self, want: u64) -> u64 {
        let got = self.charge_member(want);
        if got < want && self.cg.is_shared() && self.cg.reap_dead() {
            return got + self.charge_member(want - got);
        }
        got
    }

    /// Gives back the charges of tree members whose process is gone (killed, or ended
    /// by `_exit`, which runs no exit hook), at most once per [`REAP_EVERY_MS`]: for
    /// reclaim, before it frees this region's pages to make room. A charge that comes up
    /// short reaps too, but a region that lives on what its own reclaim frees never does,
    /// and would keep a dead member's share from the tree for ever. True when some came
    /// back.
    pub fn reap_dead_members(&self) -> bool {
        if !self.cg.is_shared() {
            return false;
        }
        let now = self.born.elapsed().as_millis() as u64;
        let next = self.next_reap_ms.load(Relaxed);
        let due = now >= next
            && self
                .next_reap_ms
                .compare_exchange(next, now + REAP_EVERY_MS, Relaxed, Relaxed)
                .is_ok();
        due && self.cg.reap_dead()
    }

    fn charge_member(&self, want: u64) -> u64 {
        let charged = self.charged();
        let mut cur = charged.load(Relaxed);
        loop {
            let others = self.cg.others(self.member);
            let got = want.min(self.limit().saturating_sub(others + cur));
            if got == 0 {
                return 0;
            }
            match charged.compare_exchange_weak(cur, cur + got, Relaxed, Relaxed) {
                Ok(_) => return got,
                Err(now) => cur = now,
            }
        }
    }

    /// Charges pages past the limit: for data that has nowhere else to go (see
    /// `FaultPath::swap_in`). Reclaim brings the budget back under the limit.
    pub fn overdraw(&self, pages: u64) {
        self.charged().fetch_add(pages, Relaxed);
    }

    /// Gives pages back, to this CPU's stock while it holds less than twice a batch.
    pub fn uncharge(&self, pages: u64) {
        // The CPU is asked for only when there are stocks (a vDSO call per page otherwise).
        let cpu = if self.stocks.is_empty() {
            0
        } else {
            crate::cpu::current()
        };
        self.uncharge_on(cpu, pages);
    }

    fn uncharge_on(&self, cpu: usize, pages: u64) {
        let Some(stock) = self.stock(cpu) else {
            let before = self.charged().fetch_sub(pages, Relaxed);
            debug_assert!(before >= pages, "uncharging more pages than are resident");
            return;
        };
        let held = stock.pages.fetch_add(pages, Relaxed) + pages;
        if held > 2 * self.batch {
            let back = take_up_to(&stock.pages, held - self.batch);
            if back > 0 {
                stock.shared.fetch_add(1, Relaxed);
                self.charged().fetch_sub(back, Relaxed);
            }
        }
    }

    /// Returns every stocked page to the shared counter.
    pub fn drain_stocks(&self) {
        if self.stocks.is_empty() {
            return;
        }
        self.drains.fetch_add(1, Relaxed);
        for stock in self.stocks.iter() {
            let pages = stock.pages.swap(0, Relaxed);
            if pages > 0 {
                self.charged().fetch_sub(pages, Relaxed);
            }
        }
    }

    fn stock(&self, cpu: usize) -> Option<&Stock> {
        match self.stocks.len() {
            0 => None,
            n => Some(&self.stocks[cpu % n]),
        }
    }

    /// Pages resident: charged and not in a stock. Exact when nothing charges meanwhile.
    pub fn resident(&self) -> u64 {
        let stocked: u64 = self.stocks.iter().map(|s| s.pages.load(Relaxed)).sum();
        self.charged().load(Relaxed).saturating_sub(stocked)
    }

    /// Pages the other processes of the tree have charged (0 in a group of one).
    pub fn held_by_others(&self) -> u64 {
        self.cg.others(self.member)
    }

    /// Free pages under the limit (0 while overdrawn). Stocked pages count as used, as
    /// the kernel's memcg counts its stocks: at most a sixteenth of the limit.
    /// In a group shared by a process tree, what every member charged counts.
    pub fn free(&self) -> u64 {
        self.limit().saturating_sub(self.cg.usage())
    }

    pub fn limit(&self) -> u64 {
        self.cg.limit()
    }

    /// A new limit (for the whole group). Lowering it leaves pages over the limit resident
    /// until reclaim takes the budget under it.
    pub fn set_limit(&self, pages: u64) {
        self.cg.set_limit(pages);
    }

    pub fn stock_stats(&self) -> StockStats {
        let sum = |f: fn(&Stock) -> &AtomicU64| -> u64 {
            self.stocks.iter().map(|s| f(s).load(Relaxed)).sum()
        };
        StockStats {
            stock_hits: sum(|s| &s.hits),
            shared_updates: sum(|s| &s.shared),
            drains: self.drains.load(Relaxed),
        }
    }
}

impl Drop for Budget {
    fn drop(&mut self) {
        self.cg.leave(self.member);
    }
}

/// Takes up to `want` from `counter` (never below zero); returns what it took.
fn take_up_to(counter: &AtomicU64, want: u64) -> u64 {
    let mut cur = counter.load(Relaxed);
    loop {
        let take = want.min(cur);
        if take == 0 {
            return 0;
        }
        match counter.compare_exchange_weak(cur, cur - take, Relaxed, Relaxed) {
            Ok(_) => return take,
            Err(now) => cur = now,
        }
    }
}

#[cfg(all(test, not(loom)))]
mod tests {
    use super::*;
    use crate::memcg::MemCgroup;
    use std::sync::Arc;

    #[test]
    fn budget_grants_at_most_the_limit() {
        let b = Budget::new(10, 0);
        assert_eq!(b.try_charge(4), 4);
        assert_eq!(b.try_charge(8), 6);
        assert_eq!(b.try_charge(1), 0);
        b.uncharge(3);
        assert_eq!((b.resident(), b.free()), (7, 3));
    }

    #[test]
    fn a_stock_serves_charges_and_touches_the_shared_counter_once_per_batch() {
        let b = Budget::new(100_000, 2);
        for _ in 0..320 {
            assert_eq!(b.try_charge_on(0, 1), 1);
        }
        assert_eq!(b.resident(), 320);
        let s = b.stock_stats();
        assert_eq!(s.stock_hits + s.shared_updates, 320);
        assert!(s.shared_updates <= 10, "{s:?}");
        for _ in 0..320 {
            b.uncharge_on(1, 1);
        }
        assert_eq!(b.resident(), 0);
        assert!(
            b.free() >= 100_000 - 2 * 2 * STOCK_BATCH,
            "stocks hold little"
        );
        b.drain_stocks();
        assert_eq!(b.free(), 100_000);
    }

    #[test]
    fn a_short_budget_takes_back_every_stock_before_it_refuses() {
        let b = Budget::new(1024, 2);
        assert_eq!(b.try_charge_on(0, 1), 1, "CPU 0 stocks a batch beside it");
        let mut granted = 0;
        loop {
            match b.try_charge_on(1, 5) {
                0 => break,
                n => granted += n,
            }
        }
        assert_eq!(granted, 1023, "the whole limit, CPU 0's stock included");
        assert_eq!(b.resident(), 1024);
        assert!(b.stock_stats().drains > 0);
    }

    #[test]
    fn small_limits_get_no_stock() {
        assert_eq!(Budget::new(32, 2).stocks.len(), 0);
        assert!(Budget::new(1 << 20, 2).batch > 0);
    }

    #[test]
    fn stress_stocked_charges_never_exceed_the_limit_and_all_come_back() {
        let b = Budget::new(4096, 4);
        std::thread::scope(|s| {
            for t in 0..4usize {
                let b = &b;
                s.spawn(move || {
                    for i in 0..50_000usize {
                        let cpu = (t + i / 1000) % 4;
                        let got = b.try_charge_on(cpu, 1 + (i % 7) as u64);
                        assert!(b.charged().load(Relaxed) <= 4096);
                        b.uncharge_on((cpu + 1) % 4, got);
                    }
                });
            }
        });
        assert_eq!(b.resident(), 0);
        b.drain_stocks();
        assert_eq!(b.charged().load(Relaxed), 0);
    }

    #[test]
    fn stress_concurrent_charges_never_exceed_the_limit() {
        let b = Budget::new(1000, 0);
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

    #[test]
    fn members_of_one_group_share_its_limit_and_leave_with_their_charges() {
        let dir = tempfile::tempdir().unwrap();
        let (cg, path) = MemCgroup::create_shared(100, dir.path()).unwrap();
        let cg = Arc::new(cg);
        let a = Budget::in_group(cg.clone(), 0).unwrap();
        let b = Budget::in_group(cg.clone(), 0).unwrap();
        assert_eq!(a.try_charge(70), 70);
        assert_eq!(b.try_charge(70), 30, "the other member holds 70 of 100");
        assert_eq!((a.resident(), b.resident(), a.free()), (70, 30, 0));
        // A second mapping of the file (another process's) sees the same group.
        let other = MemCgroup::open_shared(&path).unwrap();
        assert_eq!((other.limit(), other.usage()), (100, 100));
        other.set_limit(120);
        assert_eq!(b.try_charge(70), 20, "a raised limit is everyone's");
        drop(a);
        assert_eq!(cg.usage(), 50, "a member leaves with its charges");
        assert_eq!(b.try_charge(100), 70);
    }

    /// A tree's group of 10 pages in which a member that died holds `pages`: the group,
    /// the dead member's slot, and a live member's budget (`dir` keeps the group's file).
    fn group_with_a_dead_member(
        dir: &tempfile::TempDir,
        pages: u64,
    ) -> (Arc<MemCgroup>, usize, Budget) {
        let (cg, _) = MemCgroup::create_shared(10, dir.path()).unwrap();
        let cg = Arc::new(cg);
        let mut child = std::process::Command::new("true").spawn().unwrap();
        let dead = child.id();
        child.wait().unwrap();
        let slot = cg.join_as(dead, pages);
        let b = Budget::in_group(cg.clone(), 0).unwrap();
        (cg, slot, b)
    }

    #[test]
    fn a_dead_members_charges_are_reaped_when_the_group_runs_short() {
        let dir = tempfile::tempdir().unwrap();
        let (cg, slot, b) = group_with_a_dead_member(&dir, 10);
        assert_eq!(b.try_charge(4), 4, "the dead member's 10 pages were reaped");
        assert!(cg.is_free(slot));
    }

    #[test]
    fn a_dead_members_charges_are_reaped_when_a_charge_comes_up_short() {
        // Two pages are left: a charge of four gets all four, not two.
        let dir = tempfile::tempdir().unwrap();
        let (cg, slot, b) = group_with_a_dead_member(&dir, 8);
        assert_eq!(b.try_charge(4), 4, "the dead member's 8 pages were reaped");
        assert!(cg.is_free(slot));
    }

    #[test]
    fn a_program_that_execs_drops_what_its_previous_image_charged() {
        let cg = Arc::new(MemCgroup::private(10));
        let old = Budget::in_group(cg.clone(), 0).unwrap();
        assert_eq!(old.try_charge(10), 10);
        std::mem::forget(old); // exec: the old image never leaves
        cg.forget_previous_image();
        let new = Budget::in_group(cg.clone(), 0).unwrap();
        assert_eq!(new.try_charge(10), 10);
    }
}

/// Model check of the budget: `RUSTFLAGS="--cfg loom" cargo test -p uswap-core --lib --release budget::loom`.
#[cfg(all(test, loom))]
mod loom_tests {
    use super::*;

    #[test]
    fn concurrent_charges_never_exceed_the_limit_and_all_come_back() {
        loom::model(|| {
            let b = std::sync::Arc::new(Budget::new(3, 0));
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

    #[test]
    fn stocked_charges_on_two_cpus_never_exceed_the_limit_and_all_come_back() {
        loom::model(|| {
            // A limit of 64 on 2 CPUs gives batches of one page.
            let b = std::sync::Arc::new(Budget::new(64, 2));
            let threads: Vec<_> = (0..2)
                .map(|cpu| {
                    let b = b.clone();
                    loom::thread::spawn(move || {
                        let got = b.try_charge_on(cpu, 2);
                        assert!(b.charged().load(Relaxed) <= 64);
                        b.uncharge_on(1 - cpu, got);
                        got
                    })
                })
                .collect();
            for t in threads {
                assert_eq!(t.join().unwrap(), 2);
            }
            assert_eq!(b.resident(), 0);
            b.drain_stocks();
            assert_eq!(b.charged().load(Relaxed), 0);
        });
    }
}
