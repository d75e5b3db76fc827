use uswap_core::{Config, Region, PAGE_SIZE};

#[test]
fn smoke_write_then_read_back_4x_limit() {
    let mut cfg = Config::new(1 << 20);
    if std::env::var("SIGBUS").is_ok() { cfg.fault_mode = uswap_core::FaultMode::Sigbus; }
    let r = Region::new(4 << 20, cfg).unwrap();
    let pages = r.len() / PAGE_SIZE;
    let base = r.as_ptr() as *mut u64;
    for p in 0..pages {
        unsafe { *base.add(p * 512) = p as u64 * 7 + 1; *base.add(p * 512 + 511) = !(p as u64) };
    }
    for p in 0..pages {
        unsafe {
            assert_eq!(*base.add(p * 512), p as u64 * 7 + 1, "page {p}");
            assert_eq!(*base.add(p * 512 + 511), !(p as u64), "page {p}");
        }
    }
    let s = r.stats();
    eprintln!("{:?}", s.vmstat);
    assert!(s.vmstat.pswpout > 0 && s.vmstat.pswpin > 0);
}
