//! Active and inactive LRU lists of one region ([mm/swap.c], `lruvec`): intrusive lists
//! over page numbers under one lock (the kernel's `lru_lock`). Heads are the most recently
//! added; reclaim takes from the tails. Lock order: see `page.rs`.

use crate::list::{Link, Links, ListHead};
use crate::lockstat::{LockClass, StatMutex};
use crate::page::{PageLock, PageTable};
use crate::sync::MutexGuard;

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum LruList {
    Active = 0,
    Inactive = 1,
}

const OFF_LIST: u8 = u8::MAX;

#[derive(Clone, Copy)]
struct Node {
    link: Link,
    list: u8,
}

struct Nodes(Vec<Node>);

impl Links for Nodes {
    fn link(&mut self, i: u32) -> &mut Link {
        &mut self.0[i as usize].link
    }
}

struct Lists {
    nodes: Nodes,
    heads: [ListHead; 2],
}

pub struct Lru {
    lists: StatMutex<Lists>,
}

impl Lists {
    fn unlink(&mut self, page: u32) {
        let list = self.nodes.0[page as usize].list;
        if list != OFF_LIST {
            self.heads[list as usize].remove(&mut self.nodes, page);
            self.nodes.0[page as usize].list = OFF_LIST;
        }
    }

    fn push_head(&mut self, list: LruList, page: u32) {
        self.unlink(page);
        self.heads[list as usize].push_front(&mut self.nodes, page);
        self.nodes.0[page as usize].list = list as u8;
    }

    fn push_tail(&mut self, list: LruList, page: u32) {
        self.unlink(page);
        self.heads[list as usize].push_back(&mut self.nodes, page);
        self.nodes.0[page as usize].list = list as u8;
    }
}

impl Lru {
    pub fn new(pages: usize) -> Self {
        let off = Node {
            link: Link::UNLINKED,
            list: OFF_LIST,
        };
        Lru {
            lists: StatMutex::new(Lists {
                nodes: Nodes(vec![off; pages]),
                heads: [ListHead::EMPTY; 2],
            }),
        }
    }

    fn lock(&self) -> MutexGuard<'_, Lists> {
        self.lists.lock()
    }

    /// The statistics of the list lock.
    pub fn lockstat(&self) -> LockClass {
        LockClass::sum("lru", [&self.lists])
    }

    /// Puts pages at the head of `list`, taking them off any list they are on.
    pub fn add(&self, list: LruList, pages: impl IntoIterator<Item = usize>) {
        let mut l = self.lock();
        for p in pages {
            l.push_head(list, p as u32);
        }
    }

    /// Puts pages at the tail of `list` (first to be taken), off any list they are on.
    pub fn add_tail(&self, list: LruList, pages: impl IntoIterator<Item = usize>) {
        let mut l = self.lock();
        for p in pages {
            l.push_tail(list, p as u32);
        }
    }

    pub fn remove(&self, page: usize) {
        self.lock().unlink(page as u32);
    }

    pub fn len(&self, list: LruList) -> usize {
        self.lock().heads[list as usize].len
    }

    /// The list `page` is on, if any.
    pub fn list_of(&self, page: usize) -> Option<LruList> {
        match self.lock().nodes.0[page].list {
            0 => Some(LruList::Active),
            1 => Some(LruList::Inactive),
            _ => None,
        }
    }

    /// Every page of `list`, head to tail, with the list's links checked (for the
    /// invariant walker).
    pub fn members(&self, list: LruList) -> Result<Vec<u32>, String> {
        let mut l = self.lock();
        let head = l.heads[list as usize];
        head.walk(&mut l.nodes)
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
        let mut l = self.lock();
        let mut budget = l.heads[list as usize].len;
        let wanted = out.len() + max;
        while out.len() < wanted && budget > 0 {
            budget -= 1;
            let page = l.heads[list as usize].tail;
            match pages.try_lock(page as usize) {
                Some(lock) => {
                    l.unlink(page);
                    out.push(lock);
                }
                None => l.push_head(list, page),
            }
        }
    }
}

#[cfg(all(test, not(loom)))]
mod tests {
    use super::*;

    fn isolate(lru: &Lru, t: &PageTable, list: LruList, max: usize) -> Vec<usize> {
        let mut out = Vec::new();
        lru.isolate(t, list, max, &mut out);
        out.iter().map(|l| l.page()).collect()
    }

    #[test]
    fn isolation_takes_oldest_first_and_skips_locked_pages() {
        let t = PageTable::new(8);
        let lru = Lru::new(8);
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

    #[test]
    fn moving_and_removing_keep_lengths_right() {
        let t = PageTable::new(6);
        let lru = Lru::new(6);
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
    }

    #[test]
    fn stress_concurrent_adds_moves_and_isolation_lose_no_page() {
        const PAGES: usize = 512;
        let t = PageTable::new(PAGES);
        let lru = Lru::new(PAGES);
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
        assert_eq!(all, (0..PAGES).collect::<Vec<_>>());
    }
}

/// Model check of the lock order: a fault holds a page lock and then takes the LRU lock,
/// reclaim holds the LRU lock and only try-locks pages. No interleaving may deadlock or lose
/// the page. `RUSTFLAGS="--cfg loom" cargo test -p uswap-core --lib --release lru::loom`.
#[cfg(all(test, loom))]
mod loom_tests {
    use super::*;
    use std::sync::Arc;

    fn isolate(lru: &Lru, t: &PageTable, list: LruList) -> Vec<usize> {
        let mut out = Vec::new();
        lru.isolate(t, list, 2, &mut out);
        out.iter().map(|l| l.page()).collect()
    }

    #[test]
    fn fault_and_reclaim_never_deadlock_or_lose_a_page() {
        loom::model(|| {
            let pages = Arc::new(PageTable::new(2));
            let lru = Arc::new(Lru::new(2));
            lru.add(LruList::Active, [0, 1]);
            let fault = {
                let (pages, lru) = (pages.clone(), lru.clone());
                loom::thread::spawn(move || {
                    let lock = pages.lock(0);
                    lru.add(LruList::Active, [lock.page()]);
                })
            };
            let isolated = isolate(&lru, &pages, LruList::Active);
            lru.add(LruList::Inactive, isolated.iter().copied());
            fault.join().unwrap();
            let mut all = isolate(&lru, &pages, LruList::Active);
            all.extend(isolate(&lru, &pages, LruList::Inactive));
            all.sort_unstable();
            assert_eq!(all, vec![0, 1], "every page on exactly one list");
        });
    }
}
