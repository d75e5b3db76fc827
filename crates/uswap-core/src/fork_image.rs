//! What a fork child inherits of one region: which page went to which slot of the child's
//! swap device, and which pages were lost. `fork.rs` writes it in the parent; the child's
//! region is built from it (`assembly.rs`), every page with data `Swapped` there.

use crate::mm::Mm;
use crate::swapfile::SlotId;
use std::ops::Range;

/// What a fork child needs to build one region again.
#[derive(Default)]
pub(crate) struct RegionImage {
    /// Pages with data, and the slot of the child's device each was written to.
    pub(crate) pages: Vec<(u32, SlotId)>,
    /// Pages whose data is lost (poisoned in the parent, or unreadable): their accesses
    /// fail in the child too.
    pub(crate) poisoned: Vec<u32>,
}

impl RegionImage {
    /// Gives the pages of a newly built child region their inherited states; pages outside
    /// `owned` were unmapped by the parent.
    pub(crate) fn apply(&self, mm: &Mm, owned: &[Range<usize>]) {
        // The runs are sorted and do not overlap.
        let in_owned = |p: usize| {
            let i = owned.partition_point(|r| r.end <= p);
            owned.get(i).is_some_and(|r| r.contains(&p))
        };
        for &(page, slot) in &self.pages {
            let page = page as usize;
            if in_owned(page) {
                mm.inherited(&mut mm.pages().lock(page), slot);
            } else {
                mm.swap().free_slot(slot);
            }
        }
        for &page in &self.poisoned {
            mm.poisoned(&mut mm.pages().lock(page as usize));
        }
        // The gaps between the runs (which are in address order) were unmapped.
        let mut next = 0;
        let ends = owned.iter().map(|r| (r.start, r.end));
        for (start, end) in ends.chain(std::iter::once((mm.pages().len(), 0))) {
            for page in next..start {
                mm.unmap_page(&mut mm.pages().lock(page));
            }
            next = end;
        }
    }
}
