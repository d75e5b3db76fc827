//! The LRU lists of one region ([mm/swap.c], `lruvec`): active, inactive and probation,
//! circular doubly linked lists over page numbers, each with a sentinel node, under the LRU
//! lock (the kernel's `lru_lock`). Heads are the most recently added; reclaim takes from
//! the tails. Which mapped list a page joins is the replacement policy's choice
//! (`workingset.rs`). Lock order: `lockdep.rs`.
//!
//! The lock has three modes (`Config::lru_lock`, seed 001):
//! - `mutex` and `spin`: every operation takes the lock exclusively (a sleeping mutex, or a
//!   spinlock whose waiters never sleep).
//! - `rwlock`: a two-mode lock. Adding one page at the head and removing one page take it
//!   **shared** and use SMP-safe list operations, so several threads work on the lists at
//!   once; isolating a batch from the tail, adding at the tail and walking take it
//!   **exclusive**.
//!
//! # SMP-safe list operations
//!
//! Each node (pages and sentinels) carries a lock bit beside its list number. A shared-mode
//! operation locks the nodes whose links it changes, always with try-locks and, when one
//! fails, by letting go of everything and trying again, so it never waits while holding a
//! node lock and cannot deadlock:
//! - remove `x`: lock `x`, then its `prev` and `next` (stable once `x` is locked: changing
//!   them needs `x`), relink them, clear `x`.
//! - add `x` at the head of list `L`: lock `x`, the sentinel `S` of `L` and `S.next`,
//!   link `x` between them.
//!
//! Two removals of adjacent nodes, or a removal beside an add, contend for the node they
//! share; one goes first. Exclusive-mode operations run with no shared one in flight, so
//! they change links with plain (relaxed) stores and set no node locks. The walker checks
//! links, list numbers and lengths.
//!
//! # Per-CPU batches (seed 003, the kernel's `cpu_fbatches`)
//!
//! With `Config::lru_batch` above 1, the adds of single pages that faults make
//! ([`Lru::cache_add`]: a page mapped, activated, or read ahead to the tail) wait in a
//! per-CPU batch and are linked together under one exclusive lock when the batch fills
//! ([`Lru::drain_all`] empties every CPU's, for reclaim and the walker: the
//! `lru_add_drain_all` analogue). A waiting page is on no list; its node says
//! "pending for list L". The page-lock holder marks it pending (a CAS, since a drain may
//! link it at the same time) and `remove` unmarks it under the LRU lock; a drain links
//! only pages still pending for the entry's list, with a CAS from pending to linked, so
//! a page removed or re-added meanwhile is skipped (its newer entry, if any, links it).
//! Each batch has a mutex, so another CPU can drain it; lock order: batch, then LRU.

use crate::config::LruLockMode;
use crate::lockdep::Rank;
use crate::lockstat::{LockClass, StatMutex, StatRwLock, StatSpin};
use crate::page::{Kind, PageLock, PageTable};
use crate::sync::{zeroed_slice, AtomicUsize, XorU32};
use crossbeam_utils::CachePadded;
use std::sync::atomic::Ordering::{AcqRel, Acquire, Relaxed, Release};

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum LruList {
    /// Mapped pages that have shown use (or all mapped pages, under `two-list`).
    Active = 0,
    /// Unmapped pages in staging frames: a touch promotes them, reclaim takes their tail.
    Inactive = 1,
    /// Mapped pages on trial (`s3fifo`): new pages that have not shown use yet, aged
    /// before the active list.
    Probation = 2,
}

impl LruList {
    /// Whether a page of `kind` may be on this list: mapped pages (lazily freed ones too)
    /// on the active or the probation list, parked ones on the inactive list, pages not in
    /// memory on none.
    pub fn holds(self, kind: Kind) -> bool {
        match kind {
            Kind::Active | Kind::Lazyfree => matches!(self, LruList::Active | LruList::Probation),
            Kind::Inactive => self == LruList::Inactive,
            _ => false,
        }
    }
}

pub const LISTS: [LruList; 3] = [LruList::Active, LruList::Inactive, LruList::Probation];

/// The list number of a node on no list.
const OFF_LIST: u32 = 0xff;
/// Added to a list number: the page waits in a per-CPU batch to be added to that list.
const PENDING: u32 = 0x10;

fn is_pending(state: u32) -> bool {
    state & !0xf == PENDING
}
/// The node lock bit, beside the list number in `Node::state`.
const LOCKED: u32 = 1 << 8;
/// The link of a node on no list.
const NIL: u32 = u32::MAX;

/// A page's list node; all-zero memory reads as off every list, unlinked.
struct Node {
    prev: XorU32<NIL>,
    next: XorU32<NIL>,
    /// List number (`OFF_LIST`: none) and `LOCKED`.
    state: XorU32<OFF_LIST>,
}

enum LruLock {
    Mutex(StatMutex<()>),
    Spin(StatSpin),
    TwoMode(StatRwLock),
}

/// A held LRU lock; `smp` when it is shared and the SMP-safe operations must be used.
struct Held<'a> {
    _guard: Guard<'a>,
    smp: bool,
}

#[allow(dead_code)] // the guards are held for their Drop
enum Guard<'a> {
    Mutex(crate::lockstat::StatGuard<'a, ()>),
    Spin(crate::lockstat::SpinGuard<'a>),
    Shared(crate::lockdep::Ranked<crate::sync::RwLockReadGuard<'a, ()>>),
    Exclusive(crate::lockdep::Ranked<crate::sync::RwLockWriteGuard<'a, ()>>),
}

pub struct Lru {
    /// Pages `0..pages`, then the sentinel of each list.
    nodes: Box<[Node]>,
    pages: u32,
    lens: [AtomicUsize; LISTS.len()],
    lock: LruLock,
    /// Per-CPU batches of single-page adds (none: every add is immediate).
    batches: Box<[CachePadded<StatMutex<Vec<Pending>>>]>,
    batch_size: usize,
}

/// A page waiting in a per-CPU batch: the list it goes to, at the head or the tail.
#[derive(Clone, Copy)]
struct Pending {
    page: u32,
    list: LruList,
    tail: bool,
}

impl Lru {
    /// Lists for `pages` pages; with `batch` above 1, `cpus` per-CPU batches of that size.
    pub fn new(pages: usize, mode: LruLockMode, batch: usize, cpus: usize) -> Self {
        let pages = pages as u32;
        // Page nodes come from zeroed memory (off every list, touched only when used); a
        // sentinel starts as an empty circle, linked to itself.
        let nodes: Box<[Node]> = zeroed_slice(pages as usize + LISTS.len(), || Node {
            prev: XorU32::new(NIL),
            next: XorU32::new(NIL),
            state: XorU32::new(OFF_LIST),
        });
        for i in pages..pages + LISTS.len() as u32 {
            let sentinel = &nodes[i as usize];
            sentinel.prev.store(i, Relaxed);
            sentinel.next.store(i, Relaxed);
            sentinel.state.store(i - pages, Relaxed);
        }
        Lru {
            nodes,
            pages,
            lens: LISTS.map(|_| AtomicUsize::new(0)),
            lock: match mode {
                LruLockMode::Mutex => LruLock::Mutex(StatMutex::new(Rank::Lru, ())),
                LruLockMode::Spin => LruLock::Spin(StatSpin::new(Rank::Lru)),
                LruLockMode::RwLock => LruLock::TwoMode(StatRwLock::new(Rank::Lru)),
            },
            batches: (0..if batch > 1 { cpus.max(1) } else { 0 })
                .map(|_| {
                    CachePadded::new(StatMutex::new(Rank::LruBatch, Vec::with_capacity(batch)))
                })
                .collect(),
            batch_size: batch,
        }
    }

    /// The lock for an operation that needs the whole list.
    fn exclusive(&self) -> Held<'_> {
        let guard = match &self.lock {
            LruLock::Mutex(m) => Guard::Mutex(m.lock()),
            LruLock::Spin(s) => Guard::Spin(s.lock()),
            LruLock::TwoMode(rw) => Guard::Exclusive(rw.exclusive()),
        };
        Held {
            _guard: guard,
            smp: false,
        }
    }

    /// The lock for a single-page add or remove: shared in `rwlock` mode.
    fn shared(&self) -> Held<'_> {
        match &self.lock {
            LruLock::TwoMode(rw) => Held {
                _guard: Guard::Shared(rw.shared()),
                smp: true,
            },
            _ => self.exclusive(),
        }
    }

    /// Puts pages at the head of `list`, taking them off any list they are on.
    pub fn add(&self, list: LruList, pages: impl IntoIterator<Item = usize>) {
        let held = self.shared();
        for p in pages {
            let p = p as u32;
            let was_pending = self.forget_pending(p);
            if held.smp {
                if !was_pending && self.list_number(p) != OFF_LIST {
                    self.smp_unlink(p);
                }
                self.smp_add_head(list, p);
            } else {
                self.unlink(p);
                self.link_after(self.sentinel(list), p, list);
            }
        }
    }

    /// Puts pages at the tail of `list` (first to be taken), off any list they are on.
    pub fn add_tail(&self, list: LruList, pages: impl IntoIterator<Item = usize>) {
        let _held = self.exclusive();
        for p in pages {
            let p = p as u32;
            self.forget_pending(p);
            self.unlink(p);
            let tail = self.nodes[self.sentinel(list) as usize].prev.load(Relaxed);
            self.link_after(tail, p, list);
        }
    }

    /// Adds one page (its page lock held) at the head, or the tail, of `list`, through this
    /// CPU's batch when batches are on.
    pub fn cache_add(&self, list: LruList, page: usize, tail: bool) {
        let Some(batch) = self.local_batch() else {
            return if tail {
                self.add_tail(list, [page])
            } else {
                self.add(list, [page])
            };
        };
        let node = &self.nodes[page].state;
        loop {
            let s = node.load(Acquire);
            if s == OFF_LIST || is_pending(s) {
                let want = PENDING | list as u32;
                if node.compare_exchange(s, want, AcqRel, Acquire).is_ok() {
                    break;
                }
            } else {
                self.remove(page);
            }
        }
        let mut pending = batch.lock();
        pending.push(Pending {
            page: page as u32,
            list,
            tail,
        });
        if pending.len() >= self.batch_size {
            self.link_pending(&mut pending);
        }
    }

    fn local_batch(&self) -> Option<&StatMutex<Vec<Pending>>> {
        match self.batches.len() {
            0 => None,
            n => Some(&self.batches[crate::cpu::current() % n]),
        }
    }

    /// Links every CPU's waiting pages (reclaim and the walker need the lists whole).
    pub fn drain_all(&self) {
        for batch in self.batches.iter() {
            let mut pending = batch.lock();
            if !pending.is_empty() {
                self.link_pending(&mut pending);
            }
        }
    }

    /// Takes a page (its page lock and the LRU lock held) out of the batch it waits in, if
    /// it does. A drain needs the LRU lock exclusive, so nothing else changes its node.
    fn forget_pending(&self, page: u32) -> bool {
        let node = &self.nodes[page as usize].state;
        let s = node.load(Acquire);
        if !is_pending(s) {
            return false;
        }
        let taken = node.compare_exchange(s, OFF_LIST, AcqRel, Relaxed);
        debug_assert!(taken.is_ok(), "a pending page changed under the LRU lock");
        true
    }

    /// Links the pages of one batch (its lock held) that still wait for the entry's list.
    fn link_pending(&self, pending: &mut Vec<Pending>) {
        let _held = self.exclusive();
        for p in pending.drain(..) {
            let node = &self.nodes[p.page as usize].state;
            let want = PENDING | p.list as u32;
            if node
                .compare_exchange(want, p.list as u32, AcqRel, Relaxed)
                .is_err()
            {
                continue; // removed, or waiting again in a newer entry
            }
            let at = if p.tail {
                self.nodes[self.sentinel(p.list) as usize]
                    .prev
                    .load(Relaxed)
            } else {
                self.sentinel(p.list)
            };
            self.link_after(at, p.page, p.list);
        }
    }

    pub fn remove(&self, page: usize) {
        let page = page as u32;
        let held = self.shared();
        if self.forget_pending(page) {
            return;
        }
        if held.smp {
            if self.list_number(page) != OFF_LIST {
                self.smp_unlink(page);
            }
        } else {
            self.unlink(page);
        }
    }

    pub fn len(&self, list: LruList) -> usize {
        self.lens[list as usize].load(Relaxed)
    }

    /// The list `page` is on, or waits in a batch to be added to, if any.
    pub fn list_of(&self, page: usize) -> Option<LruList> {
        let number = self.list_number(page as u32);
        LISTS
            .into_iter()
            .find(|&l| number == l as u32 || number == PENDING | l as u32)
    }

    /// The statistics of the per-CPU batch locks.
    pub fn batch_lockstat(&self) -> LockClass {
        LockClass::sum("lru_batch", self.batches.iter().map(|b| &**b))
    }

    /// The statistics of the LRU lock.
    pub fn lockstat(&self) -> LockClass {
        match &self.lock {
            LruLock::Mutex(m) => LockClass::sum("lru", [m]),
            LruLock::Spin(s) => LockClass::sum("lru", [s]),
            LruLock::TwoMode(rw) => LockClass::sum("lru", [rw]),
        }
    }

    /// Every page of `list`, head to tail, with the list's links, list numbers and length
    /// checked (for the invariant walker).
    pub fn members(&self, list: LruList) -> Result<Vec<u32>, String> {
        let _held = self.exclusive();
        let sentinel = self.sentinel(list);
        let (mut members, mut prev) = (Vec::new(), sentinel);
        let mut at = self.nodes[sentinel as usize].next.load(Relaxed);
        while at != sentinel {
            if at >= self.pages || members.len() > self.pages as usize {
                return Err(format!("{list:?} list: bad link {prev} -> {at}"));
            }
            let node = &self.nodes[at as usize];
            if node.prev.load(Relaxed) != prev {
                return Err(format!(
                    "{list:?} list: page {at}'s back link is not {prev}"
                ));
            }
            if node.state.load(Relaxed) != list as u32 {
                return Err(format!(
                    "{list:?} list: page {at} has list state {:#x}",
                    node.state.load(Relaxed)
                ));
            }
            members.push(at);
            prev = at;
            at = node.next.load(Relaxed);
        }
        if self.nodes[sentinel as usize].prev.load(Relaxed) != prev {
            return Err(format!("{list:?} list: the tail is not {prev}"));
        }
        if members.len() != self.len(list) {
            return Err(format!(
                "{list:?} list: {} members but length {}",
                members.len(),
                self.len(list)
            ));
        }
        Ok(members)
    }

    /// Takes up to `max` pages from the tail of `list` whose page lock is free, locked and off
    /// the list, into `out`. Pages whose lock is held (a fault in progress) are rotated to
    /// the head.
    pub fn isolate<'t>(
        &self,
        pages: &'t PageTable,
        list: LruList,
        max: usize,
        out: &mut Vec<PageLock<'t>>,
    ) {
        let _held = self.exclusive();
        let sentinel = self.sentinel(list);
        let mut budget = self.len(list);
        let wanted = out.len() + max;
        while out.len() < wanted && budget > 0 {
            budget -= 1;
            let page = self.nodes[sentinel as usize].prev.load(Relaxed);
            // Lock first: a busy page's node must never read "off list" here, or its lock
            // holder, in `cache_add` (no LRU lock), could mark it pending meanwhile.
            match pages.try_lock(page as usize) {
                Some(lock) => {
                    self.unlink(page);
                    out.push(lock);
                }
                None => self.rotate_to_head(page, list),
            }
        }
    }

    /// Moves `page` (on `list`) to its head, its list number untouched (exclusive mode).
    fn rotate_to_head(&self, page: u32, list: LruList) {
        let sentinel = self.sentinel(list);
        let node = &self.nodes[page as usize];
        let (prev, next) = (node.prev.load(Relaxed), node.next.load(Relaxed));
        self.nodes[prev as usize].next.store(next, Relaxed);
        self.nodes[next as usize].prev.store(prev, Relaxed);
        let first = self.nodes[sentinel as usize].next.load(Relaxed);
        node.prev.store(sentinel, Relaxed);
        node.next.store(first, Relaxed);
        self.nodes[sentinel as usize].next.store(page, Relaxed);
        self.nodes[first as usize].prev.store(page, Relaxed);
    }

    /// Whether `page` waits in a per-CPU batch (for the walker, after a drain with every
    /// page lock held: none may).
    pub fn is_pending(&self, page: usize) -> bool {
        is_pending(self.list_number(page as u32))
    }

    fn sentinel(&self, list: LruList) -> u32 {
        self.pages + list as u32
    }

    fn list_number(&self, node: u32) -> u32 {
        self.nodes[node as usize].state.load(Acquire) & !LOCKED
    }

    // Exclusive-mode operations: no shared one is in flight, no node lock is set.

    /// Links `x` (on no list) after node `at` of `list`.
    fn link_after(&self, at: u32, x: u32, list: LruList) {
        let next = self.nodes[at as usize].next.load(Relaxed);
        let node = &self.nodes[x as usize];
        node.prev.store(at, Relaxed);
        node.next.store(next, Relaxed);
        node.state.store(list as u32, Relaxed);
        self.nodes[at as usize].next.store(x, Relaxed);
        self.nodes[next as usize].prev.store(x, Relaxed);
        self.lens[list as usize].fetch_add(1, Relaxed);
    }

    /// Takes `x` off its list, if it is on one.
    fn unlink(&self, x: u32) {
        let node = &self.nodes[x as usize];
        let list = node.state.load(Relaxed);
        if list == OFF_LIST {
            return;
        }
        let (prev, next) = (node.prev.load(Relaxed), node.next.load(Relaxed));
        self.nodes[prev as usize].next.store(next, Relaxed);
        self.nodes[next as usize].prev.store(prev, Relaxed);
        node.prev.store(NIL, Relaxed);
        node.next.store(NIL, Relaxed);
        node.state.store(OFF_LIST, Relaxed);
        self.lens[list as usize].fetch_sub(1, Relaxed);
    }

    // Shared-mode (SMP-safe) operations: see the module comment.

    fn try_lock_node(&self, i: u32) -> bool {
        let state = &self.nodes[i as usize].state;
        let s = state.load(Relaxed);
        s & LOCKED == 0
            && state
                .compare_exchange(s, s | LOCKED, Acquire, Relaxed)
                .is_ok()
    }

    fn unlock_node(&self, i: u32) {
        self.nodes[i as usize].state.fetch_and(!LOCKED, Release);
    }

    /// Locks `nodes` in order with try-locks; on a failure lets go of those it took.
    fn try_lock_all(&self, nodes: &[u32]) -> bool {
        for (taken, &n) in nodes.iter().enumerate() {
            if !self.try_lock_node(n) {
                nodes[..taken]
                    .iter()
                    .rev()
                    .for_each(|&m| self.unlock_node(m));
                return false;
            }
        }
        true
    }

    /// Takes `x` (on a list, its page lock held by the caller) off its list.
    fn smp_unlink(&self, x: u32) {
        let node = &self.nodes[x as usize];
        let mut round = 0;
        loop {
            if self.try_lock_node(x) {
                // Stable now: changing x's neighbours' links to x needs x's lock.
                let (prev, next) = (node.prev.load(Relaxed), node.next.load(Relaxed));
                let others: &[u32] = if prev == next { &[prev] } else { &[prev, next] };
                if self.try_lock_all(others) {
                    self.nodes[prev as usize].next.store(next, Relaxed);
                    self.nodes[next as usize].prev.store(prev, Relaxed);
                    node.prev.store(NIL, Relaxed);
                    node.next.store(NIL, Relaxed);
                    let list = node.state.load(Relaxed) & !LOCKED;
                    self.lens[list as usize].fetch_sub(1, Relaxed);
                    others.iter().rev().for_each(|&m| self.unlock_node(m));
                    node.state.store(OFF_LIST, Release);
                    return;
                }
                self.unlock_node(x);
            }
            crate::sync::backoff(round);
            round += 1;
        }
    }

    /// Links `x` (on no list, its page lock held by the caller) at the head of `list`.
    fn smp_add_head(&self, list: LruList, x: u32) {
        let sentinel = self.sentinel(list);
        let node = &self.nodes[x as usize];
        let mut round = 0;
        loop {
            if self.try_lock_all(&[x, sentinel]) {
                // The sentinel's next is stable now; an empty list's is the sentinel.
                let first = self.nodes[sentinel as usize].next.load(Relaxed);
                if first == sentinel || self.try_lock_node(first) {
                    node.prev.store(sentinel, Relaxed);
                    node.next.store(first, Relaxed);
                    self.nodes[first as usize].prev.store(x, Relaxed);
                    self.nodes[sentinel as usize].next.store(x, Relaxed);
                    self.lens[list as usize].fetch_add(1, Relaxed);
                    if first != sentinel {
                        self.unlock_node(first);
                    }
                    self.unlock_node(sentinel);
                    node.state.store(list as u32, Release);
                    return;
                }
                self.unlock_node(sentinel);
                self.unlock_node(x);
            }
            crate::sync::backoff(round);
            round += 1;
        }
    }
}

#[cfg(all(test, not(loom)))]
mod tests {
    use super::*;
    use crate::config::LruLockMode;

    fn isolate(lru: &Lru, t: &PageTable, list: LruList, max: usize) -> Vec<usize> {
        let mut out = Vec::new();
        lru.isolate(t, list, max, &mut out);
        out.iter().map(|l| l.page()).collect()
    }

    #[test]
    fn isolation_takes_oldest_first_and_skips_locked_pages() {
        for mode in LruLockMode::ALL {
            let t = PageTable::new(8);
            let lru = Lru::new(8, *mode, 1, 1);
            lru.add(LruList::Active, [0, 1, 2, 3]);
            lru.add(LruList::Inactive, [4, 5]);
            let held = t.lock(1);
            assert_eq!(isolate(&lru, &t, LruList::Active, 2), vec![0, 2]);
            drop(held);
            assert_eq!(lru.len(LruList::Active), 2);
            assert_eq!(lru.members(LruList::Active).unwrap(), vec![1, 3]);
            assert_eq!(isolate(&lru, &t, LruList::Active, 9), vec![3, 1]);
            assert_eq!(isolate(&lru, &t, LruList::Inactive, 9), vec![4, 5]);
        }
    }

    /// A fault activating an inactive page (its page lock held, the page still on the
    /// inactive list) batches it for the active list while reclaim isolates the inactive
    /// tail and finds the page locked: the page must end on the active list, never be left
    /// on the inactive one (found in review: isolation used to unlink and relink a busy
    /// page, and a `cache_add` in between was overwritten).
    #[test]
    fn an_activation_racing_isolation_ends_on_the_active_list() {
        for mode in LruLockMode::ALL {
            let t = PageTable::new(2);
            let lru = Lru::new(2, *mode, 4, 1);
            let stop = std::sync::atomic::AtomicBool::new(false);
            let mut wrong = 0;
            std::thread::scope(|s| {
                s.spawn(|| {
                    let mut got = Vec::new();
                    while !stop.load(Relaxed) {
                        lru.isolate(&t, LruList::Inactive, 2, &mut got);
                        got.clear();
                    }
                });
                for _ in 0..50_000 {
                    let lock = t.lock(0);
                    lru.add(LruList::Inactive, [0]);
                    (0..20).for_each(|_| std::hint::spin_loop());
                    lru.cache_add(LruList::Active, 0, false);
                    drop(lock);
                    lru.drain_all();
                    let lock = t.lock(0);
                    wrong += (lru.list_of(0) != Some(LruList::Active)) as u32;
                    lru.remove(0);
                    drop(lock);
                }
                stop.store(true, Relaxed);
            });
            assert_eq!(
                wrong, 0,
                "{mode}: an activated page was left on the inactive list"
            );
        }
    }

    #[test]
    fn batched_adds_wait_until_the_batch_fills_or_is_drained() {
        for mode in LruLockMode::ALL {
            let lru = Lru::new(8, *mode, 3, 1);
            lru.add(LruList::Inactive, [5]);
            lru.cache_add(LruList::Active, 0, false);
            lru.cache_add(LruList::Active, 1, false);
            // Waiting: on no list yet, but known to be going to the active one.
            assert_eq!(lru.len(LruList::Active), 0);
            assert_eq!(lru.list_of(0), Some(LruList::Active));
            // A page removed while it waits is never linked.
            lru.remove(1);
            assert_eq!(lru.list_of(1), None);
            // A page on a list leaves it at once; the third add fills the batch.
            lru.cache_add(LruList::Inactive, 5, true);
            assert_eq!(lru.members(LruList::Active).unwrap(), vec![0]);
            assert_eq!(lru.members(LruList::Inactive).unwrap(), vec![5]);
            // The tail flag: page 2 goes behind 5, page 3 in front.
            lru.cache_add(LruList::Inactive, 2, true);
            lru.cache_add(LruList::Inactive, 3, false);
            // A direct add of a waiting page takes it out of the batch.
            lru.add(LruList::Active, [3]);
            lru.drain_all();
            assert_eq!(lru.members(LruList::Inactive).unwrap(), vec![5, 2]);
            assert_eq!(lru.members(LruList::Active).unwrap(), vec![3, 0]);
            assert_eq!(lru.batch_lockstat().locks, 1);
        }
    }

    #[test]
    fn moving_and_removing_keep_lengths_right() {
        for mode in LruLockMode::ALL {
            let t = PageTable::new(6);
            let lru = Lru::new(6, *mode, 1, 1);
            lru.add(LruList::Inactive, 0..6);
            lru.add(LruList::Active, [2, 4]);
            lru.remove(5);
            lru.remove(5);
            assert_eq!(lru.list_of(5), None);
            assert_eq!(lru.list_of(2), Some(LruList::Active));
            assert_eq!(lru.len(LruList::Inactive), 3);
            assert_eq!(lru.len(LruList::Active), 2);
            assert_eq!(isolate(&lru, &t, LruList::Inactive, 9), vec![0, 1, 3]);
            assert_eq!(isolate(&lru, &t, LruList::Active, 9), vec![2, 4]);
            lru.add_tail(LruList::Active, [5]);
            lru.add(LruList::Active, [0]);
            assert_eq!(lru.members(LruList::Active).unwrap(), vec![0, 5]);
        }
    }

    #[test]
    fn stress_concurrent_adds_moves_and_isolation_lose_no_page() {
        for mode in LruLockMode::ALL {
            const PAGES: usize = 512;
            let t = PageTable::new(PAGES);
            let lru = Lru::new(PAGES, *mode, 1, 1);
            lru.add(LruList::Active, 0..PAGES);
            std::thread::scope(|s| {
                for id in 0..4 {
                    let (t, lru) = (&t, &lru);
                    s.spawn(move || {
                        let mut got = Vec::new();
                        for round in 0..2000 {
                            let (from, to) = if (round + id) % 2 == 0 {
                                (LruList::Active, LruList::Inactive)
                            } else {
                                (LruList::Inactive, LruList::Active)
                            };
                            lru.isolate(t, from, 8, &mut got);
                            let back: Vec<usize> = got.drain(..).map(|l| l.page()).collect();
                            lru.add(to, back);
                        }
                    });
                }
            });
            let mut all = isolate(&lru, &t, LruList::Active, PAGES);
            all.extend(isolate(&lru, &t, LruList::Inactive, PAGES));
            all.sort_unstable();
            assert_eq!(all, (0..PAGES).collect::<Vec<_>>(), "{mode}");
        }
    }

    /// Single-page adds and removes (shared in rwlock mode) on all three lists race with
    /// isolation (exclusive) from the active and probation lists; the walker checks links,
    /// list numbers and lengths at the end. With per-CPU batches (4 pages, 2 CPUs) as well
    /// as without, and a thread draining every batch from outside meanwhile (the remote
    /// drain).
    #[test]
    fn stress_single_page_moves_against_isolation_keep_the_lists_whole() {
        for (mode, batch) in LruLockMode::ALL.iter().flat_map(|m| [(m, 1), (m, 4)]) {
            const PAGES: usize = 256;
            let t = PageTable::new(PAGES);
            let lru = Lru::new(PAGES, *mode, batch, 2);
            lru.add(LruList::Active, 0..PAGES);
            std::thread::scope(|s| {
                for id in 0..3usize {
                    let (t, lru) = (&t, &lru);
                    s.spawn(move || {
                        for round in 0..20_000usize {
                            let page = (round * 7 + id * 85) % PAGES;
                            // As the fault path does: with the page lock held.
                            let Some(lock) = t.try_lock(page) else {
                                continue;
                            };
                            match round % 7 {
                                0 => lru.remove(lock.page()),
                                1 => lru.add(LruList::Inactive, [lock.page()]),
                                2 => lru.add(LruList::Active, [lock.page()]),
                                3 => lru.cache_add(LruList::Active, lock.page(), false),
                                4 => lru.cache_add(LruList::Probation, lock.page(), false),
                                5 => lru.add(LruList::Probation, [lock.page()]),
                                _ => lru.cache_add(LruList::Inactive, lock.page(), true),
                            }
                        }
                    });
                }
                s.spawn(|| {
                    let mut got = Vec::new();
                    for round in 0..2_000 {
                        let from = [LruList::Active, LruList::Probation][round % 2];
                        lru.isolate(&t, from, 8, &mut got);
                        // As reclaim does: the isolated pages stay locked while they move.
                        lru.add(LruList::Inactive, got.iter().map(|l| l.page()));
                        got.clear();
                        if round % 8 == 0 {
                            lru.drain_all();
                        }
                    }
                });
            });
            lru.drain_all();
            let lists: Vec<Vec<u32>> = LISTS.map(|l| lru.members(l).unwrap()).into();
            for p in 0..PAGES as u32 {
                let on = lists.iter().filter(|m| m.contains(&p)).count();
                let want = lru.list_of(p as usize).is_some() as usize;
                assert_eq!(on, want, "{mode}, batch {batch}: page {p}");
            }
        }
    }
}

/// Model check of the lock order: a fault holds a page lock and then takes the LRU lock,
/// reclaim holds the LRU lock and only try-locks pages. No interleaving may deadlock or lose
/// the page. `RUSTFLAGS="--cfg loom" cargo test -p uswap-core --lib --release lru::loom`.
#[cfg(all(test, loom))]
mod loom_tests {
    use super::*;
    use crate::config::LruLockMode;
    use std::sync::Arc;

    fn isolate<'t>(lru: &Lru, t: &'t PageTable, list: LruList) -> Vec<PageLock<'t>> {
        let mut out = Vec::new();
        lru.isolate(t, list, 2, &mut out);
        out
    }

    /// Per-CPU batches (2 pages, one CPU): a fault adds two pages, the second add linking
    /// the batch, while another fault moves page 0 and a third thread drains the batch from
    /// outside. Each page must end on exactly one list.
    #[test]
    fn batched_adds_against_a_remote_drain_lose_no_page() {
        for mode in LruLockMode::ALL {
            model(move || {
                let pages = Arc::new(PageTable::new(2));
                let lru = Arc::new(Lru::new(2, *mode, 2, 1));
                let fault = fault_adding(&pages, &lru, LruList::Active);
                let mover = {
                    let (pages, lru) = (pages.clone(), lru.clone());
                    loom::thread::spawn(move || {
                        let lock = pages.lock(0);
                        lru.remove(lock.page());
                        lru.cache_add(LruList::Inactive, lock.page(), true);
                    })
                };
                lru.drain_all();
                fault.join().unwrap();
                mover.join().unwrap();
                each_page_on_one_list(&lru, *mode);
            });
        }
    }

    /// The probation list (`s3fifo`) through per-CPU batches (2 pages, one CPU): a fault
    /// adds two new pages on probation, the second add linking the batch; aging drains,
    /// isolates the probation tail and parks it inactive; a promotion moves page 0 to the
    /// active list. Each page must end on exactly one of the three lists.
    #[test]
    fn probation_adds_aging_and_a_promotion_lose_no_page() {
        for mode in LruLockMode::ALL {
            model(move || {
                let pages = Arc::new(PageTable::new(2));
                let lru = Arc::new(Lru::new(2, *mode, 2, 1));
                let fault = fault_adding(&pages, &lru, LruList::Probation);
                let promotion = {
                    let (pages, lru) = (pages.clone(), lru.clone());
                    loom::thread::spawn(move || {
                        let lock = pages.lock(0);
                        lru.cache_add(LruList::Active, lock.page(), false);
                    })
                };
                lru.drain_all();
                let isolated = isolate(&lru, &pages, LruList::Probation);
                lru.add(LruList::Inactive, pages_of(&isolated));
                drop(isolated);
                fault.join().unwrap();
                promotion.join().unwrap();
                each_page_on_one_list(&lru, *mode);
            });
        }
    }

    /// A fault adding pages 0 and 1 to `list`, each with its page lock held, through a
    /// per-CPU batch of 2 (the second add links the batch).
    fn fault_adding(
        pages: &Arc<PageTable>,
        lru: &Arc<Lru>,
        list: LruList,
    ) -> loom::thread::JoinHandle<()> {
        let (pages, lru) = (pages.clone(), lru.clone());
        loom::thread::spawn(move || {
            for p in 0..2 {
                let lock = pages.lock(p);
                lru.cache_add(list, lock.page(), false);
            }
        })
    }

    /// After a drain, pages 0 and 1 are each on exactly one of the lists.
    fn each_page_on_one_list(lru: &Lru, mode: LruLockMode) {
        lru.drain_all();
        let lists: Vec<Vec<u32>> = LISTS.map(|l| lru.members(l).unwrap()).into();
        for p in 0..2u32 {
            let on = lists.iter().filter(|m| m.contains(&p)).count();
            assert_eq!(on, 1, "{mode}: page {p} on {on} lists");
        }
    }

    fn pages_of(locks: &[PageLock<'_>]) -> Vec<usize> {
        locks.iter().map(|l| l.page()).collect()
    }

    fn model(f: impl Fn() + Sync + Send + 'static) {
        let mut builder = loom::model::Builder::new();
        builder.preemption_bound = Some(2);
        builder.max_branches = 100_000;
        builder.check(f);
    }

    /// The lock order: a fault holds a page lock and then takes the LRU lock, reclaim holds
    /// the LRU lock and only try-locks pages. No interleaving may deadlock or lose the page.
    #[test]
    fn fault_and_reclaim_never_deadlock_or_lose_a_page() {
        for mode in LruLockMode::ALL {
            model(move || {
                let pages = Arc::new(PageTable::new(2));
                let lru = Arc::new(Lru::new(2, *mode, 1, 1));
                lru.add(LruList::Active, [0, 1]);
                let fault = {
                    let (pages, lru) = (pages.clone(), lru.clone());
                    loom::thread::spawn(move || {
                        let lock = pages.lock(0);
                        lru.add(LruList::Active, [lock.page()]);
                    })
                };
                // As reclaim does: the isolated pages stay locked while they move.
                let isolated = isolate(&lru, &pages, LruList::Active);
                lru.add(LruList::Inactive, pages_of(&isolated));
                drop(isolated);
                fault.join().unwrap();
                let mut all = pages_of(&isolate(&lru, &pages, LruList::Active));
                all.extend(pages_of(&isolate(&lru, &pages, LruList::Inactive)));
                all.sort_unstable();
                assert_eq!(all, vec![0, 1], "{mode}: every page on exactly one list");
            });
        }
    }

    /// The SMP-safe operations (rwlock mode, shared): `ops` run at once, each on its own
    /// page, on the list [2, 1, 0]; `want` is the list after.
    fn shared_ops(ops: &'static [(usize, Option<LruList>)], want: &'static [u32]) {
        model(move || {
            let pages = Arc::new(PageTable::new(4));
            let lru = Arc::new(Lru::new(4, LruLockMode::RwLock, 1, 1));
            lru.add(LruList::Active, [0, 1, 2]);
            let threads: Vec<_> = ops
                .iter()
                .copied()
                .map(|(page, add)| {
                    let (pages, lru) = (pages.clone(), lru.clone());
                    loom::thread::spawn(move || {
                        let lock = pages.lock(page);
                        match add {
                            Some(list) => lru.add(list, [lock.page()]),
                            None => lru.remove(lock.page()),
                        }
                    })
                })
                .collect();
            threads.into_iter().for_each(|t| t.join().unwrap());
            assert_eq!(lru.members(LruList::Active).unwrap(), want);
        });
    }

    #[test]
    fn shared_removes_of_adjacent_pages_keep_the_list_whole() {
        shared_ops(&[(1, None), (2, None)], &[0]);
    }

    #[test]
    fn a_shared_add_at_the_head_beside_a_remove_of_the_first_page_keeps_the_list_whole() {
        shared_ops(&[(2, None), (3, Some(LruList::Active))], &[3, 1, 0]);
    }

    #[test]
    fn a_shared_move_between_lists_beside_a_remove_keeps_both_whole() {
        shared_ops(&[(1, Some(LruList::Inactive)), (0, None)], &[2]);
    }

    /// Shared single-page moves against an exclusive isolation.
    #[test]
    fn shared_moves_and_exclusive_isolation_lose_no_page() {
        model(|| {
            let pages = Arc::new(PageTable::new(3));
            let lru = Arc::new(Lru::new(3, LruLockMode::RwLock, 1, 1));
            lru.add(LruList::Active, [0, 1, 2]);
            let mover = {
                let (pages, lru) = (pages.clone(), lru.clone());
                loom::thread::spawn(move || {
                    let lock = pages.lock(1);
                    lru.add(LruList::Inactive, [lock.page()]);
                })
            };
            let isolated = isolate(&lru, &pages, LruList::Active);
            lru.add(LruList::Inactive, pages_of(&isolated));
            drop(isolated);
            mover.join().unwrap();
            let mut all: Vec<u32> = lru.members(LruList::Active).unwrap();
            all.extend(lru.members(LruList::Inactive).unwrap());
            all.sort_unstable();
            assert_eq!(all, vec![0, 1, 2]);
        });
    }
}
