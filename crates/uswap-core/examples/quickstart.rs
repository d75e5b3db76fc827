//! The README's library example: `cargo run --release -p uswap-core --example quickstart`.

use uswap_core::{parse_size, Config, Region};

fn main() -> uswap_core::Result<()> {
    // 4 GiB of memory that keeps at most 1 GiB resident; the rest goes to an unlinked
    // swap file in $TMPDIR.
    let region = Region::new(parse_size("4G")?, Config::new(parse_size("1G")?))?;
    let data = unsafe { std::slice::from_raw_parts_mut(region.as_ptr(), region.len()) };
    for (i, byte) in data.iter_mut().enumerate().step_by(4096) {
        *byte = (i / 4096) as u8 | 1;
    }
    let stats = region.stats();
    println!(
        "swapped out {} pages, {} MiB resident",
        stats.vmstat.pswpout,
        stats.resident_pages / 256
    );
    Ok(())
}
