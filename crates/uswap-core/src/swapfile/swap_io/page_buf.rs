//! Page buffers for swap I/O: one page, aligned to a page so `O_DIRECT` takes it.

use crate::PAGE_SIZE;

#[repr(C, align(4096))]
pub(super) struct AlignedPage(pub(super) [u8; PAGE_SIZE]);

/// An owned, zeroed, 4096-byte-aligned buffer of one page (for `O_DIRECT`).
pub struct PageBuf(Box<AlignedPage>);

impl PageBuf {
    pub fn new() -> PageBuf {
        PageBuf(Box::new(AlignedPage([0; PAGE_SIZE])))
    }

    /// A buffer holding a copy of the page at `src`, not cleared first.
    ///
    /// # Safety
    /// `src` must be valid for reading 4096 bytes.
    pub unsafe fn copy_of(src: *const u8) -> PageBuf {
        let mut page = Box::<AlignedPage>::new_uninit();
        std::ptr::copy_nonoverlapping(src, page.as_mut_ptr().cast::<u8>(), PAGE_SIZE);
        // SAFETY: every byte was just written.
        PageBuf(page.assume_init())
    }

    pub fn as_ptr(&self) -> *const u8 {
        self.0 .0.as_ptr()
    }

    pub fn as_mut_ptr(&mut self) -> *mut u8 {
        self.0 .0.as_mut_ptr()
    }

    pub fn as_slice(&self) -> &[u8] {
        &self.0 .0
    }

    pub fn as_mut_slice(&mut self) -> &mut [u8] {
        &mut self.0 .0
    }
}

impl Default for PageBuf {
    fn default() -> Self {
        PageBuf::new()
    }
}
