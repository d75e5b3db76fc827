//! What a fork child inherits of one region: which pages the kernel gave it mapped (shared
//! copy-on-write with the parent), which it borrows (read from a slot or staging frame the
//! parent, or an earlier ancestor, lent it: `mm/lender.rs`), which the parent wrote to
//! which slot of the child's swap device (the others that were not mapped), and which
//! were lost. `fork.rs` writes it in the parent; the child's region is built from it
//! (`assembly.rs`).

use crate::mm::lender::Lender;
use crate::mm::Mm;
use crate::swapfile::SlotId;
use crate::PAGE_SIZE;
use std::ops::Range;

/// What a fork child needs to build one region again.
#[derive(Default)]
pub(crate) struct RegionImage {
    /// Runs of pages mapped in the parent at the fork (active, in address order): the
    /// kernel maps them in the child too, copy-on-write.
    pub(crate) mapped: Vec<Range<u32>>,
    /// Pages lazily freed in the parent and mapped (the kernel may still drop them).
    pub(crate) lazyfree: Vec<u32>,
    /// Pages that were not mapped (inactive or swapped out), and the slot of the child's
    /// device each was written to.
    pub(crate) pages: Vec<(u32, SlotId)>,
    /// Pages whose data is lost (poisoned in the parent, or unreadable): their accesses
    /// fail in the child too.
    pub(crate) poisoned: Vec<u32>,
    /// Pages that were not mapped whose data is lent, not copied: (page, lender in
    /// `lenders`, slot or frame there).
    pub(crate) borrowed: Vec<(u32, u32, u32)>,
    /// What those pages are read from: the parent's swap device and staging area, and
    /// what an ancestor lent the parent that it passes on.
    pub(crate) lenders: Vec<Lender>,
}

impl RegionImage {
    /// Records a page mapped in the parent.
    pub(crate) fn add_mapped(&mut self, page: usize) {
        let page = page as u32;
        match self.mapped.last_mut() {
            Some(run) if run.end == page => run.end += 1,
            _ => self.mapped.push(page..page + 1),
        }
    }

    /// Gives the pages of a newly built child region their inherited states; pages outside
    /// `owned` (sorted runs) are not the child's: the parent had unmapped them, or the
    /// kernel did not give them.
    ///
    /// The kernel's page tables decide between a mapped page and a copy: a page the parent
    /// had mapped that is not here was discarded just before the fork (zeros), and a page
    /// that was copied (or whose slot is shared) but is mapped here was brought back in the
    /// parent between the copy and the fork (the mapped one is the newer).
    pub(crate) fn apply(&self, mm: &Mm, owned: &[Range<usize>]) {
        let in_owned = |p: usize| {
            let i = owned.partition_point(|r| r.end <= p);
            owned.get(i).is_some_and(|r| r.contains(&p))
        };
        let mapped: Vec<usize> = self
            .mapped
            .iter()
            .flat_map(|r| r.start as usize..r.end as usize)
            .filter(|&p| in_owned(p))
            .collect();
        let mut copied: Vec<(usize, SlotId)> = Vec::with_capacity(self.pages.len());
        for &(page, slot) in &self.pages {
            if in_owned(page as usize) {
                copied.push((page as usize, slot));
            } else {
                mm.swap().free_slot(slot);
            }
        }
        copied.sort_unstable_by_key(|&(page, _)| page);
        let mut shared = Vec::with_capacity(mapped.len());
        for (page, here) in mapped.iter().zip(present(mm, &mapped, true)) {
            if here {
                shared.push(*page);
            }
        }
        let copied_pages: Vec<usize> = copied.iter().map(|&(p, _)| p).collect();
        for (&(page, slot), here) in copied.iter().zip(present(mm, &copied_pages, false)) {
            if here {
                mm.swap().free_slot(slot);
                shared.push(page);
            } else {
                mm.inherited(&mut mm.pages().lock(page), slot);
            }
        }
        let mut lent: Vec<(usize, u32, u32)> = self
            .borrowed
            .iter()
            .map(|&(page, lender, at)| (page as usize, lender, at))
            .filter(|&(page, ..)| in_owned(page))
            .collect();
        lent.sort_unstable_by_key(|&(page, ..)| page);
        let lent_pages: Vec<usize> = lent.iter().map(|&(p, ..)| p).collect();
        let mut kept = vec![Vec::new(); mm.lenders().len()];
        for (&(page, lender, at), here) in lent.iter().zip(present(mm, &lent_pages, false)) {
            if here {
                shared.push(page);
            } else {
                mm.inherited_borrowed(&mut mm.pages().lock(page), lender, at);
                kept[lender as usize].push(at);
            }
        }
        // A staging area lent keeps only the frames borrowed here.
        for (lender, mut frames) in mm.lenders().iter().zip(kept) {
            frames.sort_unstable();
            lender.keep_only(&frames);
        }
        shared.sort_unstable();
        share(mm, &shared);
        for &page in &self.lazyfree {
            if in_owned(page as usize) {
                mm.adopt_mapped(&mut mm.pages().lock(page as usize), true);
            }
        }
        for &page in &self.poisoned {
            mm.poisoned(&mut mm.pages().lock(page as usize));
        }
        // The gaps between the runs (which are in address order) were unmapped.
        mm.unmap_outside(owned);
    }
}

/// Whether each of `pages` (sorted) is mapped here, from pagemap, a read per 64 pages;
/// `unknown` where pagemap cannot be read.
fn present(mm: &Mm, pages: &[usize], unknown: bool) -> Vec<bool> {
    let mut entries = [Default::default(); 64];
    let mut out = Vec::with_capacity(pages.len());
    let mut i = 0;
    while i < pages.len() {
        let first = pages[i];
        let n = entries.len().min(mm.pages().len() - first);
        let known = mm.pagemap_entries(first, &mut entries[..n]);
        while i < pages.len() && pages[i] < first + n {
            out.push(if known {
                entries[pages[i] - first].present
            } else {
                unknown
            });
            i += 1;
        }
    }
    out
}

/// The pages (sorted, owned, mapped here) the kernel shares with the parent: shared, and
/// write-protected so that the first write to each is seen, before the child runs any of
/// the program's code. Where the kernel offers no write protection they are this
/// process's own from the start.
pub(crate) fn share(mm: &Mm, pages: &[usize]) {
    let shares = mm.caps().write_protect;
    for &page in pages {
        let mut lock = mm.pages().lock(page);
        if shares {
            mm.shared(&mut lock);
        } else {
            mm.adopt_mapped(&mut lock, false);
        }
    }
    if !shares {
        return;
    }
    let mut i = 0;
    while i < pages.len() {
        let start = pages[i];
        while i + 1 < pages.len() && pages[i + 1] == pages[i] + 1 {
            i += 1;
        }
        let len = (pages[i] + 1 - start) * PAGE_SIZE;
        if let Err(e) = mm.uffd().write_protect(mm.page_addr(start), len, true) {
            fork_child_failed(&e);
        }
        i += 1;
    }
}

/// A shared page that could not be write-protected would be written without being
/// charged or seen: the child stops, as for any copy it could not have.
fn fork_child_failed(e: &std::io::Error) -> ! {
    let msg = format!(
        "uswap: process {} cannot write-protect the pages it shares with its parent \
         ({e}); it is stopped with status 125\n",
        std::process::id()
    );
    // SAFETY: writing a buffer to stderr, then ending the process.
    unsafe {
        libc::write(2, msg.as_ptr().cast(), msg.len());
        libc::_exit(125)
    }
}
