//! Active and inactive LRU lists of one region, as intrusive doubly linked lists over page
//! numbers under one lock (the kernel's `lru_lock`). Heads are the most recently added;
//! reclaim takes from the tails.

use crate::page::{PageLock, PageTable};
use crate::sync::{Mutex, MutexGuard};

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum LruList {
    Active = 0,
    Inactive = 1,
}

const NIL: u32 = u32::MAX;
const OFF_LIST: u8 = u8::MAX;

#[derive(Clone, Copy)]
struct Link {
    prev: u32,
    next: u32,
    list: u8,
}

struct Lists {
    links: Vec<Link>,
    head: [u32; 2],
    tail: [u32; 2],
    len: [usize; 2],
}

pub struct Lru {
    lists: Mutex<Lists>,
}

impl Lists {
    fn unlink(&mut self, page: u32) {
        let Link { prev, next, list } = self.links[page as usize];
        if list == OFF_LIST {
            return;
        }
        let l = list as usize;
        match prev {
            NIL => self.head[l] = next,
            p => self.links[p as usize].next = next,
        }
        match next {
            NIL => self.tail[l] = prev,
            n => self.links[n as usize].prev = prev,
        }
        self.len[l] -= 1;
        self.links[page as usize] = Link {
            prev: NIL,
            next: NIL,
            list: OFF_LIST,
        };
    }

    fn push_head(&mut self, list: LruList, page: u32) {
        self.unlink(page);
        let l = list as usize;
        let old = self.head[l];
        self.links[page as usize] = Link {
            prev: NIL,
            next: old,
            list: l as u8,
        };
        match old {
            NIL => self.tail[l] = page,
            o => self.links[o as usize].prev = page,
        }
        self.head[l] = page;
        self.len[l] += 1;
    }
}

impl Lru {
    pub fn new(pages: usize) -> Self {
        Lru {
            lists: Mutex::new(Lists {
                links: vec![
                    Link {
                        prev: NIL,
                        next: NIL,
                        list: OFF_LIST
                    };
                    pages
                ],
                head: [NIL; 2],
                tail: [NIL; 2],
                len: [0; 2],
            }),
        }
    }

    fn lock(&self) -> MutexGuard<'_, Lists> {
        self.lists.lock().unwrap_or_else(|e| e.into_inner())
    }

    /// Puts pages at the head of `list`, taking them off any list they are on.
    pub fn add(&self, list: LruList, pages: impl IntoIterator<Item = usize>) {
        let mut l = self.lock();
        for p in pages {
            l.push_head(list, p as u32);
        }
    }

    pub fn remove(&self, page: usize) {
        self.lock().unlink(page as u32);
    }

    pub fn len(&self, list: LruList) -> usize {
        self.lock().len[list as usize]
    }

    /// Takes up to `max` pages from the tail of `list` whose page lock is free, locked and off
    /// the list. Pages whose lock is held (a fault in progress) are rotated to the head.
    pub fn isolate<'t>(
        &self,
        pages: &'t PageTable,
        list: LruList,
        max: usize,
    ) -> Vec<PageLock<'t>> {
        let mut l = self.lock();
        let mut taken = Vec::with_capacity(max.min(l.len[list as usize]));
        let mut budget = l.len[list as usize];
        while taken.len() < max && budget > 0 {
            budget -= 1;
            let page = l.tail[list as usize];
            if page == NIL {
                break;
            }
            match pages.try_lock(page as usize) {
                Some(lock) => {
                    l.unlink(page);
                    taken.push(lock);
                }
                None => l.push_head(list, page),
            }
        }
        taken
    }
}

#[cfg(all(test, not(loom)))]
mod tests {
    use super::*;

    fn drain(lru: &Lru, t: &PageTable, list: LruList) -> Vec<usize> {
        lru.isolate(t, list, usize::MAX)
            .iter()
            .map(|l| l.page())
            .collect()
    }

    #[test]
    fn isolation_takes_oldest_first_and_skips_locked_pages() {
        let t = PageTable::new(8);
        let lru = Lru::new(8);
        lru.add(LruList::Active, [0, 1, 2, 3]);
        lru.add(LruList::Inactive, [4, 5]);
        let held = t.lock(1);
        let got: Vec<usize> = lru
            .isolate(&t, LruList::Active, 2)
            .iter()
            .map(|l| l.page())
            .collect();
        assert_eq!(got, vec![0, 2]);
        drop(held);
        assert_eq!(lru.len(LruList::Active), 2);
        assert_eq!(drain(&lru, &t, LruList::Active), vec![3, 1]);
        assert_eq!(drain(&lru, &t, LruList::Inactive), vec![4, 5]);
    }

    #[test]
    fn moving_and_removing_keep_lengths_right() {
        let t = PageTable::new(6);
        let lru = Lru::new(6);
        lru.add(LruList::Inactive, 0..6);
        lru.add(LruList::Active, [2, 4]);
        lru.remove(5);
        lru.remove(5);
        assert_eq!(lru.len(LruList::Inactive), 3);
        assert_eq!(lru.len(LruList::Active), 2);
        assert_eq!(drain(&lru, &t, LruList::Inactive), vec![0, 1, 3]);
        assert_eq!(drain(&lru, &t, LruList::Active), vec![2, 4]);
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
                    for round in 0..2000 {
                        let list = if (round + id) % 2 == 0 {
                            LruList::Active
                        } else {
                            LruList::Inactive
                        };
                        let got = lru.isolate(t, list, 8);
                        let back: Vec<usize> = got.iter().map(|l| l.page()).collect();
                        drop(got);
                        let other = if list == LruList::Active {
                            LruList::Inactive
                        } else {
                            LruList::Active
                        };
                        lru.add(other, back);
                    }
                });
            }
        });
        let mut all = drain(&lru, &t, LruList::Active);
        all.extend(drain(&lru, &t, LruList::Inactive));
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
            let isolated: Vec<usize> = lru
                .isolate(&pages, LruList::Active, 2)
                .iter()
                .map(|l| l.page())
                .collect();
            lru.add(LruList::Inactive, isolated.iter().copied());
            fault.join().unwrap();
            let mut all: Vec<usize> = lru
                .isolate(&pages, LruList::Active, 2)
                .iter()
                .map(|l| l.page())
                .collect();
            all.extend(
                lru.isolate(&pages, LruList::Inactive, 2)
                    .iter()
                    .map(|l| l.page()),
            );
            all.sort_unstable();
            assert_eq!(all, vec![0, 1], "every page on exactly one list");
        });
    }
}
