//! Helpers shared by the integration tests: page patterns that identify page and version.
#![allow(dead_code)]

use uswap_core::PAGE_SIZE;

pub const WORDS: usize = PAGE_SIZE / 8;

/// The value of word `i` of page `page` at `version`; word 0 carries page and version.
pub fn word(page: usize, version: u32, i: usize) -> u64 {
    if i == 0 {
        return ((page as u64) << 32) | version as u64;
    }
    let mut x = ((page as u64) << 24) ^ ((version as u64) << 12) ^ i as u64;
    x = (x ^ (x >> 30)).wrapping_mul(0xbf58_476d_1ce4_e5b9);
    x = (x ^ (x >> 27)).wrapping_mul(0x94d0_49bb_1331_11eb);
    x ^ (x >> 31)
}

/// Fills a whole page with its pattern.
///
/// # Safety
/// `base` must be a region start and `page` inside it.
pub unsafe fn fill(base: *mut u8, page: usize, version: u32) {
    let p = base.add(page * PAGE_SIZE) as *mut u64;
    for i in 0..WORDS {
        p.add(i).write_volatile(word(page, version, i));
    }
}

/// Checks a whole page; returns the first mismatching word.
///
/// # Safety
/// As for [`fill`].
pub unsafe fn check(base: *const u8, page: usize, version: u32) -> Result<(), String> {
    let p = base.add(page * PAGE_SIZE) as *const u64;
    for i in 0..WORDS {
        let got = p.add(i).read_volatile();
        let want = word(page, version, i);
        if got != want {
            return Err(format!(
                "page {page} v{version} word {i}: got {got:#x}, want {want:#x}"
            ));
        }
    }
    Ok(())
}

pub fn check_slice(data: &[u8], page: usize, version: u32) -> bool {
    data.chunks_exact(8)
        .enumerate()
        .all(|(i, w)| u64::from_ne_bytes(w.try_into().unwrap()) == word(page, version, i))
}

/// Opens again, for writing, the file this process has open that was at `path` before it
/// was unlinked (named swap files are unlinked as soon as they are open).
pub fn open_deleted(path: &std::path::Path) -> std::fs::File {
    let wanted = format!("{} (deleted)", path.display());
    for entry in std::fs::read_dir("/proc/self/fd").unwrap() {
        let fd = entry.unwrap().path();
        if std::fs::read_link(&fd).is_ok_and(|target| target.as_os_str() == wanted.as_str()) {
            return std::fs::File::options().write(true).open(fd).unwrap();
        }
    }
    panic!("no open file was {}", path.display());
}

/// An alternate signal stack of `size` bytes for the calling thread while it lives, the old
/// one given back after (Rust's runtime gives each thread a small one, 8 KiB, where the
/// SIGBUS handler reads lone pages and leaves readahead to its service thread).
#[allow(dead_code)] // not every test binary uses it
pub struct AltStack {
    base: *mut libc::c_void,
    size: usize,
    old: libc::stack_t,
}

/// What an [`AltStack`] is filled with before use.
#[allow(dead_code)]
const PATTERN: u8 = 0xa5;

#[allow(dead_code)]
impl AltStack {
    pub fn new(size: usize) -> AltStack {
        unsafe {
            let base = libc::mmap(
                std::ptr::null_mut(),
                size,
                libc::PROT_READ | libc::PROT_WRITE,
                libc::MAP_PRIVATE | libc::MAP_ANONYMOUS | libc::MAP_STACK,
                -1,
                0,
            );
            assert_ne!(base, libc::MAP_FAILED);
            // A pattern the handler's frames overwrite, zeros included, for `used`.
            std::ptr::write_bytes(base.cast::<u8>(), PATTERN, size);
            let new = libc::stack_t {
                ss_sp: base,
                ss_flags: 0,
                ss_size: size,
            };
            let mut old: libc::stack_t = std::mem::zeroed();
            assert_eq!(libc::sigaltstack(&new, &mut old), 0);
            AltStack { base, size, old }
        }
    }

    /// Bytes of the stack ever written (below the lowest byte that still holds the
    /// pattern it was filled with; stacks grow down).
    pub fn used(&self) -> usize {
        let bytes = unsafe { std::slice::from_raw_parts(self.base as *const u8, self.size) };
        self.size
            - bytes
                .iter()
                .position(|&b| b != PATTERN)
                .unwrap_or(self.size)
    }
}

impl Drop for AltStack {
    fn drop(&mut self) {
        unsafe {
            assert_eq!(libc::sigaltstack(&self.old, std::ptr::null_mut()), 0);
            libc::munmap(self.base, self.size);
        }
    }
}
