//! Runs of pages (the space's free pages, its reserved ones), as a map from a run's first
//! page to its length, with no two runs overlapping or touching (touching runs are merged).
//!
//! Giving back is idempotent and may overlap runs already free, as `munmap` of a range
//! that is partly unmapped already is; taking back removes whatever part is free.

use std::collections::BTreeMap;

pub type Runs = BTreeMap<usize, usize>;

/// The first run that holds `pages` pages starting at a multiple of `align` counted from
/// page `base` (the page number of page 0 in the address space); the start taken, which
/// is removed from the runs.
pub fn alloc(runs: &mut Runs, pages: usize, align: usize, base: usize) -> Option<usize> {
    let at = runs.iter().find_map(|(&run, &len)| {
        let at = (base + run).next_multiple_of(align) - base;
        (at + pages <= run + len).then_some(at)
    })?;
    claim(runs, at, pages);
    Some(at)
}

/// Whether all of `[first, first + pages)` is free.
pub fn all_free(runs: &Runs, first: usize, pages: usize) -> bool {
    runs.range(..=first)
        .next_back()
        .is_some_and(|(&run, &len)| first + pages <= run + len)
}

/// How many pages of `[first, first + pages)` are in the runs.
pub fn count(runs: &Runs, first: usize, pages: usize) -> usize {
    let end = first + pages;
    overlapping(runs, first, end)
        .map(|(run, len)| (run + len).min(end) - run.max(first))
        .sum()
}

/// The parts of `[first, first + pages)` in the runs, as (first page, pages), in order.
pub fn pieces(runs: &Runs, first: usize, pages: usize) -> Vec<(usize, usize)> {
    let end = first + pages;
    let mut found: Vec<(usize, usize)> = overlapping(runs, first, end)
        .map(|(run, len)| (run.max(first), (run + len).min(end) - run.max(first)))
        .collect();
    found.reverse();
    found
}

/// Removes from the runs whatever part of `[first, first + pages)` is free.
pub fn claim(runs: &mut Runs, first: usize, pages: usize) {
    let end = first + pages;
    let touched: Vec<(usize, usize)> = overlapping(runs, first, end).collect();
    for (run, len) in touched {
        runs.remove(&run);
        if run < first {
            runs.insert(run, first - run);
        }
        if run + len > end {
            runs.insert(end, run + len - end);
        }
    }
}

/// Adds `[first, first + pages)` to the runs, merged with every run it overlaps or touches.
pub fn give_back(runs: &mut Runs, first: usize, pages: usize) {
    let (mut lo, mut hi) = (first, first + pages);
    // Runs that overlap or touch: those starting at or before `hi` and ending at or after `lo`.
    let merged: Vec<(usize, usize)> = runs
        .range(..=hi)
        .rev()
        .take_while(|&(&run, &len)| run + len >= lo)
        .map(|(&run, &len)| (run, len))
        .collect();
    for (run, len) in merged {
        runs.remove(&run);
        lo = lo.min(run);
        hi = hi.max(run + len);
    }
    runs.insert(lo, hi - lo);
}

/// Runs overlapping `[first, end)`.
fn overlapping(runs: &Runs, first: usize, end: usize) -> impl Iterator<Item = (usize, usize)> + '_ {
    runs.range(..end)
        .rev()
        .take_while(move |&(&run, &len)| run + len > first)
        .map(|(&run, &len)| (run, len))
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    #[test]
    fn giving_back_merges_with_neighbours_and_overlaps() {
        let mut runs = Runs::from([(0, 2), (10, 2)]);
        give_back(&mut runs, 2, 3);
        assert_eq!(runs, Runs::from([(0, 5), (10, 2)]));
        give_back(&mut runs, 1, 12); // overlaps both, as munmap of a partly unmapped range
        assert_eq!(runs, Runs::from([(0, 13)]));
        give_back(&mut runs, 3, 2); // already free: nothing changes
        assert_eq!(runs, Runs::from([(0, 13)]));
    }

    #[test]
    fn claiming_removes_only_the_free_part() {
        let mut runs = Runs::from([(0, 4), (8, 4)]);
        claim(&mut runs, 2, 8);
        assert_eq!(runs, Runs::from([(0, 2), (10, 2)]));
        assert!(all_free(&runs, 10, 2) && !all_free(&runs, 9, 2));
    }

    #[test]
    fn allocation_is_first_fit_and_aligned_in_the_address_space() {
        let mut runs = Runs::from([(1, 3), (5, 40)]);
        // Page 0 of the space is page 3 of the address space: 16-page alignment lands on
        // space page 13.
        assert_eq!(alloc(&mut runs, 8, 16, 3), Some(13));
        assert_eq!(alloc(&mut runs, 2, 1, 3), Some(1));
        assert_eq!(runs, Runs::from([(3, 1), (5, 8), (21, 24)]));
        assert_eq!(alloc(&mut runs, 100, 1, 3), None);
    }

    /// A model: one bit per page. Every operation leaves the runs equal to the model's free
    /// pages, merged (no two runs overlap or touch).
    fn check(runs: &Runs, free: &[bool]) {
        let mut expected = Runs::new();
        let mut p = 0;
        while p < free.len() {
            if free[p] {
                let start = p;
                while p < free.len() && free[p] {
                    p += 1;
                }
                expected.insert(start, p - start);
            } else {
                p += 1;
            }
        }
        assert_eq!(runs, &expected);
    }

    proptest! {
        #[test]
        fn runs_match_a_page_bitmap(ops in proptest::collection::vec((0u8..3, 0usize..60, 1usize..12), 1..80)) {
            const PAGES: usize = 72;
            let mut runs = Runs::from([(0, PAGES)]);
            let mut free = vec![true; PAGES];
            for (op, first, pages) in ops {
                match op {
                    0 => {
                        give_back(&mut runs, first, pages);
                        free[first..first + pages].iter_mut().for_each(|f| *f = true);
                    }
                    1 => {
                        claim(&mut runs, first, pages);
                        free[first..first + pages].iter_mut().for_each(|f| *f = false);
                    }
                    _ => {
                        let want = (0..=PAGES - pages).find(|&a| free[a..a + pages].iter().all(|&f| f));
                        let got = alloc(&mut runs, pages, 1, 0);
                        prop_assert_eq!(got, want);
                        if let Some(a) = got {
                            free[a..a + pages].iter_mut().for_each(|f| *f = false);
                        }
                    }
                }
                check(&runs, &free);
                let (first, pages) = (first.min(PAGES - 1), pages.min(PAGES - first.min(PAGES - 1)));
                let counted = free[first..first + pages].iter().filter(|&&f| f).count();
                prop_assert_eq!(count(&runs, first, pages), counted);
                let listed: Vec<usize> = pieces(&runs, first, pages)
                    .into_iter()
                    .flat_map(|(at, n)| at..at + n)
                    .collect();
                let expected: Vec<usize> = (first..first + pages).filter(|&p| free[p]).collect();
                prop_assert_eq!(listed, expected);
            }
        }
    }
}
