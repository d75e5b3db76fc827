//! The space's book of its pages, as the kernel's commit accounting keeps one per process:
//! every page is free, reserved (handed out but inaccessible: a `PROT_NONE` reservation a
//! language runtime commits later), lent (handed to the kernel: a file the program mapped
//! over part of its reservation, as the JVM maps its class data archive) or committed
//! (handed out and accessible, charged against the commit limit). Only committed pages
//! can hold data the program wrote in uswap memory, so keeping them within the commit
//! limit keeps the region's data within the swap it promised itself
//! (`Config::commit_limit`). Lent pages are never handed out again.
//!
//! Free, reserved and lent pages are kept as runs ([`runs`]); committed pages are the
//! rest.
//! Every change says what it would do first and changes nothing when it is refused.

use crate::runs::{self, Runs};

/// What a handed-out page is.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Use {
    /// Accessible, charged against the commit limit.
    Committed,
    /// Inaccessible (`PROT_NONE`), not charged.
    Reserved,
    /// The kernel's mapping, not uswap memory, not charged.
    Lent,
}

/// Why a change was refused.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Refusal {
    /// No free run is large enough.
    NoRoom,
    /// It would commit more than the commit limit.
    OverCommit,
    /// Part of the range is free (not handed out).
    NotHandedOut,
}

pub struct Book {
    free: Runs,
    reserved: Runs,
    lent: Runs,
    free_pages: usize,
    reserved_pages: usize,
    lent_pages: usize,
    pages: usize,
    commit_limit: usize,
}

impl Book {
    /// A book of `pages` free pages of which at most `commit_limit` may be committed.
    pub fn new(pages: usize, commit_limit: usize) -> Book {
        Book {
            free: Runs::from([(0, pages)]),
            reserved: Runs::new(),
            lent: Runs::new(),
            free_pages: pages,
            reserved_pages: 0,
            lent_pages: 0,
            pages,
            commit_limit,
        }
    }

    pub fn committed(&self) -> usize {
        self.pages - self.free_pages - self.reserved_pages - self.lent_pages
    }

    #[cfg(test)]
    fn reserved(&self) -> usize {
        self.reserved_pages
    }

    /// Hands out the first free run of `pages` starting at a multiple of `align` counted
    /// from page `base` (the page number of page 0 in the address space), for `use_`.
    pub fn alloc(
        &mut self,
        pages: usize,
        align: usize,
        base: usize,
        use_: Use,
    ) -> Result<usize, Refusal> {
        if use_ == Use::Committed {
            self.check_commit(pages)?;
        }
        let at = runs::alloc(&mut self.free, pages, align, base).ok_or(Refusal::NoRoom)?;
        self.free_pages -= pages;
        self.set_use(at, pages, use_);
        Ok(at)
    }

    /// Commits `[first, first + pages)` if all of it is free (a range grown in place).
    pub fn take(&mut self, first: usize, pages: usize) -> Result<(), Refusal> {
        if !runs::all_free(&self.free, first, pages) {
            return Err(Refusal::NoRoom);
        }
        self.check_commit(pages)?;
        runs::claim(&mut self.free, first, pages);
        self.free_pages -= pages;
        Ok(())
    }

    /// Makes `[first, first + pages)` `use_`, whatever each page was (a fixed mapping
    /// over it).
    pub fn map(&mut self, first: usize, pages: usize, use_: Use) -> Result<(), Refusal> {
        let free = runs::count(&self.free, first, pages);
        if use_ == Use::Committed {
            self.check_commit(free + self.uncharged(first, pages))?;
        }
        runs::claim(&mut self.free, first, pages);
        self.free_pages -= free;
        self.set_use(first, pages, use_);
        Ok(())
    }

    /// Makes `[first, first + pages)`, all of it handed out, `use_` (`mprotect`).
    pub fn protect(&mut self, first: usize, pages: usize, use_: Use) -> Result<(), Refusal> {
        if runs::count(&self.free, first, pages) > 0 {
            return Err(Refusal::NotHandedOut);
        }
        if use_ == Use::Committed {
            self.check_commit(self.uncharged(first, pages))?;
        }
        self.set_use(first, pages, use_);
        Ok(())
    }

    /// Frees `[first, first + pages)`; parts already free stay free, and lent parts stay
    /// lent (the address space is the kernel's for good).
    pub fn give_back(&mut self, first: usize, pages: usize) {
        let lent = runs::pieces(&self.lent, first, pages);
        let mut at = first;
        for (start, len) in lent.into_iter().chain([(first + pages, 0)]) {
            if start > at {
                let n = start - at;
                self.set_use(at, n, Use::Committed);
                self.free_pages += n - runs::count(&self.free, at, n);
                runs::give_back(&mut self.free, at, n);
            }
            at = start + len;
        }
    }

    /// Pages of `[first, first + pages)` that committing all of it would add: the free,
    /// reserved and lent ones.
    pub fn uncommitted(&self, first: usize, pages: usize) -> usize {
        runs::count(&self.free, first, pages) + self.uncharged(first, pages)
    }

    /// Every lent run, in order.
    pub fn lent_runs(&self) -> Vec<std::ops::Range<usize>> {
        self.lent.iter().map(|(&at, &len)| at..at + len).collect()
    }

    /// Every run of handed-out pages that are not lent (committed or reserved: those
    /// that may hold data the program wrote), in order.
    pub fn handed_out_runs(&self) -> Vec<std::ops::Range<usize>> {
        let mut runs = Vec::new();
        let mut at = 0;
        let gaps = self
            .free
            .iter()
            .chain(self.lent.iter())
            .map(|(&a, &l)| (a, l));
        let mut gaps: Vec<(usize, usize)> = gaps.collect();
        gaps.sort_unstable();
        for (start, len) in gaps.into_iter().chain([(self.pages, 0)]) {
            if start > at {
                runs.push(at..start);
            }
            at = at.max(start + len);
        }
        runs
    }

    /// The lent runs within `[first, first + pages)`.
    pub fn lent_in(&self, first: usize, pages: usize) -> Vec<(usize, usize)> {
        runs::pieces(&self.lent, first, pages)
    }

    #[cfg(test)]
    fn all_free(&self, first: usize, pages: usize) -> bool {
        runs::all_free(&self.free, first, pages)
    }

    /// Whether any page of `[first, first + pages)` is reserved.
    pub fn any_reserved(&self, first: usize, pages: usize) -> bool {
        runs::count(&self.reserved, first, pages) > 0
    }

    fn check_commit(&self, more: usize) -> Result<(), Refusal> {
        match self.committed() + more <= self.commit_limit {
            true => Ok(()),
            false => Err(Refusal::OverCommit),
        }
    }

    /// Handed-out pages of `[first, first + pages)` not charged now.
    fn uncharged(&self, first: usize, pages: usize) -> usize {
        runs::count(&self.reserved, first, pages) + runs::count(&self.lent, first, pages)
    }

    /// Makes handed-out pages of `[first, first + pages)` `use_` (counts kept right).
    fn set_use(&mut self, first: usize, pages: usize, use_: Use) {
        self.reserved_pages -= runs::count(&self.reserved, first, pages);
        runs::claim(&mut self.reserved, first, pages);
        self.lent_pages -= runs::count(&self.lent, first, pages);
        runs::claim(&mut self.lent, first, pages);
        let (set, count) = match use_ {
            Use::Committed => return,
            Use::Reserved => (&mut self.reserved, &mut self.reserved_pages),
            Use::Lent => (&mut self.lent, &mut self.lent_pages),
        };
        runs::give_back(set, first, pages);
        *count += pages;
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    /// What a commit over a range would add (charged before a region is built), and the
    /// runs a region built now takes over: handed out and not lent.
    #[test]
    fn a_commit_adds_the_free_reserved_and_lent_pages_and_the_runs_follow_the_uses() {
        let mut book = Book::new(100, 100);
        assert_eq!(book.alloc(10, 1, 0, Use::Committed), Ok(0));
        assert_eq!(book.alloc(10, 1, 0, Use::Reserved), Ok(10));
        assert_eq!(book.map(20, 5, Use::Lent), Ok(()));
        assert_eq!(book.map(40, 5, Use::Committed), Ok(()));
        assert_eq!(book.uncommitted(0, 10), 0, "committed already");
        assert_eq!(
            book.uncommitted(5, 20),
            15,
            "5 committed, 10 reserved, 5 lent"
        );
        assert_eq!(
            book.uncommitted(25, 30),
            25,
            "15 free, 5 committed, 10 free"
        );
        assert_eq!(book.lent_runs(), std::slice::from_ref(&(20..25)));
        assert_eq!(book.handed_out_runs(), [0..20, 40..45]);
    }

    #[test]
    fn reservations_are_not_charged_until_committed() {
        let mut book = Book::new(100, 10);
        let at = book.alloc(50, 1, 0, Use::Reserved).unwrap();
        assert_eq!((book.committed(), book.reserved()), (0, 50));
        assert_eq!(book.protect(at, 8, Use::Committed), Ok(()));
        assert_eq!(book.committed(), 8);
        assert_eq!(
            book.map(at + 8, 3, Use::Committed),
            Err(Refusal::OverCommit)
        );
        assert_eq!(book.committed(), 8, "a refused change changes nothing");
        assert_eq!(book.map(at, 4, Use::Reserved), Ok(()));
        assert_eq!(book.map(at + 8, 6, Use::Committed), Ok(()));
        assert_eq!((book.committed(), book.reserved()), (10, 40));
        assert_eq!(
            book.alloc(1, 1, 0, Use::Committed),
            Err(Refusal::OverCommit)
        );
        book.give_back(at, 50);
        assert_eq!((book.committed(), book.reserved()), (0, 0));
        assert!(book.all_free(0, 100));
    }

    #[test]
    fn lent_pages_are_never_handed_out_again() {
        let mut book = Book::new(10, 10);
        let at = book.alloc(10, 1, 0, Use::Reserved).unwrap();
        book.map(at + 2, 3, Use::Lent).unwrap();
        book.give_back(at, 10);
        assert_eq!(book.lent_in(0, 10), vec![(2, 3)]);
        assert_eq!(book.alloc(6, 1, 0, Use::Committed), Err(Refusal::NoRoom));
        assert_eq!(book.alloc(5, 1, 0, Use::Committed), Ok(5));
    }

    #[test]
    fn only_handed_out_pages_can_be_protected() {
        let mut book = Book::new(20, 20);
        let at = book.alloc(4, 1, 0, Use::Committed).unwrap();
        assert_eq!(
            book.protect(at, 5, Use::Reserved),
            Err(Refusal::NotHandedOut)
        );
        assert_eq!(book.reserved(), 0);
    }

    /// What the model says a page is.
    #[derive(Clone, Copy, Debug, PartialEq)]
    enum Page {
        Free,
        Handed(Use),
    }

    fn check(book: &Book, model: &[Page]) {
        let count = |p: Page| model.iter().filter(|&&m| m == p).count();
        assert_eq!(book.free_pages, count(Page::Free));
        assert_eq!(book.reserved(), count(Page::Handed(Use::Reserved)));
        assert_eq!(book.lent_pages, count(Page::Handed(Use::Lent)));
        assert_eq!(book.committed(), count(Page::Handed(Use::Committed)));
        for (i, &p) in model.iter().enumerate() {
            assert_eq!(book.all_free(i, 1), p == Page::Free, "page {i}");
            assert_eq!(
                book.any_reserved(i, 1),
                p == Page::Handed(Use::Reserved),
                "page {i}"
            );
        }
    }

    proptest! {
        /// Every operation, against a model of one state per page: the counts and the
        /// runs agree with the model, and the commit limit holds.
        #[test]
        fn the_book_matches_a_page_model(
            ops in proptest::collection::vec((0u8..5, 0u8..3, 0usize..56, 1usize..9), 1..80)
        ) {
            const PAGES: usize = 64;
            const LIMIT: usize = 24;
            let mut book = Book::new(PAGES, LIMIT);
            let mut model = [Page::Free; PAGES];
            for (op, kind, first, pages) in ops {
                let use_ = [Use::Committed, Use::Reserved, Use::Lent][kind as usize];
                let range = first..first + pages;
                let committed_after = |m: &[Page; PAGES], f: &dyn Fn(usize, Page) -> Page| {
                    (0..PAGES).filter(|&i| f(i, m[i]) == Page::Handed(Use::Committed)).count()
                };
                match op {
                    0 => {
                        let over = use_ == Use::Committed && book.committed() + pages > LIMIT;
                        let got = book.alloc(pages, 1, 0, use_);
                        let fits = (0..=PAGES - pages)
                            .find(|&a| model[a..a + pages].iter().all(|&p| p == Page::Free));
                        match (over, fits) {
                            (true, _) => prop_assert_eq!(got, Err(Refusal::OverCommit)),
                            (false, None) => prop_assert_eq!(got, Err(Refusal::NoRoom)),
                            (false, Some(a)) => {
                                prop_assert_eq!(got, Ok(a));
                                model[a..a + pages].fill(Page::Handed(use_));
                            }
                        }
                    }
                    1 => {
                        let after = committed_after(&model, &|i, p| {
                            if range.contains(&i) { Page::Handed(use_) } else { p }
                        });
                        let got = book.map(first, pages, use_);
                        if use_ == Use::Committed && after > LIMIT {
                            prop_assert_eq!(got, Err(Refusal::OverCommit));
                        } else {
                            prop_assert_eq!(got, Ok(()));
                            model[range].fill(Page::Handed(use_));
                        }
                    }
                    2 => {
                        let got = book.protect(first, pages, use_);
                        let after = committed_after(&model, &|i, p| {
                            if range.contains(&i) { Page::Handed(use_) } else { p }
                        });
                        if model[range.clone()].contains(&Page::Free) {
                            prop_assert_eq!(got, Err(Refusal::NotHandedOut));
                        } else if use_ == Use::Committed && after > LIMIT {
                            prop_assert_eq!(got, Err(Refusal::OverCommit));
                        } else {
                            prop_assert_eq!(got, Ok(()));
                            model[range].fill(Page::Handed(use_));
                        }
                    }
                    3 => {
                        let all_free = model[range.clone()].iter().all(|&p| p == Page::Free);
                        let over = book.committed() + pages > LIMIT;
                        let got = book.take(first, pages);
                        if !all_free {
                            prop_assert_eq!(got, Err(Refusal::NoRoom));
                        } else if over {
                            prop_assert_eq!(got, Err(Refusal::OverCommit));
                        } else {
                            prop_assert_eq!(got, Ok(()));
                            model[range].fill(Page::Handed(Use::Committed));
                        }
                    }
                    _ => {
                        book.give_back(first, pages);
                        for p in &mut model[range] {
                            if *p != Page::Handed(Use::Lent) {
                                *p = Page::Free;
                            }
                        }
                    }
                }
                check(&book, &model);
                prop_assert!(book.committed() <= LIMIT);
            }
        }
    }
}
