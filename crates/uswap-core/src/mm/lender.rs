//! Where a fork child's borrowed pages are: pages that were not mapped in the parent at the
//! fork, and that the child reads, when it first needs them, from what the parent lent it
//! rather than from a copy made during the fork (`fork.rs`).
//!
//! - **A swap device's slot**: a page swapped out (or inactive and clean, its slot a copy
//!   of it). The child's copy of the parent's device structures is as they were at the
//!   fork; its file stays open in the child, and the parent holds the slot until the
//!   fork's family is done (`swapfile/swap_map.rs`). A page the compressed pool held is
//!   read from the child's copy of the pool, whose memory the kernel shares
//!   copy-on-write.
//! - **A staging frame**: an inactive, dirty page, parked in the parent's staging area.
//!   The fork lets the kernel share the staging mapping with the child, copy-on-write,
//!   with each lent page locked until the child exists, so its frame cannot change; the
//!   child reads the frame from its copy of that mapping, and lets go of it (MADV_DONTNEED
//!   on its copy) once the page is its own.
//!
//! A lender a grandchild needs is passed on: it is the same address in every descendant.

use crate::swapfile::{ReadError, SwapDevice};
use crate::PAGE_SIZE;
use std::ops::Range;
use std::sync::Arc;

/// What a fork child's borrowed pages are read from.
#[derive(Clone)]
pub(crate) enum Lender {
    /// Slots of an ancestor's swap device: its file, or its compressed pool as at the fork.
    Device(Arc<SwapDevice>),
    /// Frames of an ancestor's staging area: the child's copy-on-write copy of that
    /// mapping, at `base`, `len` bytes.
    Staging { base: usize, len: usize },
}

impl Lender {
    /// Whether two lenders are the same device or area.
    pub(crate) fn same(&self, other: &Lender) -> bool {
        match (self, other) {
            (Lender::Device(a), Lender::Device(b)) => Arc::ptr_eq(a, b),
            (Lender::Staging { base: a, .. }, Lender::Staging { base: b, .. }) => a == b,
            _ => false,
        }
    }

    /// Reads borrowed page `at` (a slot or a frame) into `dst` and checks it (a frame is
    /// memory, with no check to make). `in_signal` as [`SwapDevice::read_shared`].
    ///
    /// # Safety
    /// `dst` must be valid for writing 4096 bytes, and page-aligned.
    pub(crate) unsafe fn read(
        &self,
        at: u32,
        dst: *mut u8,
        in_signal: Option<bool>,
    ) -> Result<(), ReadError> {
        match self {
            Lender::Device(device) => device.read_shared(at, dst, in_signal),
            Lender::Staging { base, .. } => {
                let src = (base + at as usize * PAGE_SIZE) as *const u8;
                std::ptr::copy_nonoverlapping(src, dst, PAGE_SIZE);
                Ok(())
            }
        }
    }

    /// The page borrowed at `at` is no longer needed here: a frame's copy is given back
    /// to the kernel (the parent's frame is not touched). One system call, safe in a
    /// signal handler.
    pub(crate) fn let_go(&self, at: u32) {
        if let Lender::Staging { base, .. } = self {
            let addr = (base + at as usize * PAGE_SIZE) as u64;
            crate::sud::raw_syscall(
                libc::SYS_madvise,
                [addr, PAGE_SIZE as u64, libc::MADV_DONTNEED as u64, 0, 0, 0],
            );
        }
    }

    /// In a fork child that got a staging area's copy: gives back every frame of it but
    /// `kept` (sorted), or all of it when `kept` is empty. The parent's staging area holds
    /// frames it lent to no one (clean pages, freed frames not yet emptied).
    pub(crate) fn keep_only(&self, kept: &[u32]) {
        let Lender::Staging { base, len } = *self else {
            return;
        };
        let frames = (len / PAGE_SIZE) as u32;
        let mut gaps: Vec<Range<u32>> = Vec::new();
        let mut next = 0;
        for &frame in kept.iter().chain(std::iter::once(&frames)) {
            if frame > next {
                gaps.push(next..frame);
            }
            next = frame + 1;
        }
        for gap in gaps {
            let addr = (base + gap.start as usize * PAGE_SIZE) as u64;
            let bytes = (gap.len() * PAGE_SIZE) as u64;
            crate::sud::raw_syscall(
                libc::SYS_madvise,
                [addr, bytes, libc::MADV_DONTNEED as u64, 0, 0, 0],
            );
        }
    }
}
