//! A page that cannot be read back correctly fails loudly: never zeros, never a wrong page.

mod common;

use std::io::{Seek, SeekFrom, Write};
use uswap_core::{Advice, Config, Region, SwapLocation, PAGE_SIZE};

#[test]
fn corrupted_swap_slot_fails_the_access_and_is_counted() {
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("swap");
    let mut cfg = Config::new(1 << 20);
    cfg.swap.location = SwapLocation::File(path.clone());
    let region = Region::new(1 << 20, cfg).unwrap();
    let pages = region.len() / PAGE_SIZE;
    for p in 0..pages {
        unsafe { common::fill(region.as_ptr(), p, 1) };
    }
    region.advise(0, region.len(), Advice::PageOut).unwrap();
    assert_eq!(region.stats().vmstat.pswpout, pages as u64);

    // Someone scribbles over the swap file behind uswap's back (through its descriptor:
    // the file was unlinked as soon as it was open).
    let mut f = common::open_deleted(&path);
    let len = f.metadata().unwrap().len();
    f.seek(SeekFrom::Start(0)).unwrap();
    f.write_all(&vec![0xA5u8; len as usize]).unwrap();
    f.sync_all().unwrap();

    // A kernel access (write(2) from the page) must fail with EFAULT, not copy garbage.
    let mut fds = [0; 2];
    assert_eq!(unsafe { libc::pipe(fds.as_mut_ptr()) }, 0);
    let n = unsafe { libc::write(fds[1], region.as_ptr().add(2 * PAGE_SIZE).cast(), PAGE_SIZE) };
    let err = std::io::Error::last_os_error();
    assert_eq!(n, -1, "a corrupted page must not be served");
    assert_eq!(err.raw_os_error(), Some(libc::EFAULT), "{err}");
    let s = region.stats().vmstat;
    assert_eq!(s.verify_errors, 1);
    assert_eq!(s.failed_faults, 1);
    // It stays failed: the page is poisoned, not silently refilled.
    let n = unsafe { libc::write(fds[1], region.as_ptr().add(2 * PAGE_SIZE).cast(), PAGE_SIZE) };
    assert_eq!(n, -1);
    assert_eq!(
        region.stats().vmstat.verify_errors,
        1,
        "no second read of a lost page"
    );
    unsafe { libc::close(fds[0]) };
    unsafe { libc::close(fds[1]) };
}
