//! `uswap info`: what this kernel offers uswap.

use anyhow::{Context, Result};

pub fn run(json: bool) -> Result<()> {
    let probe = uswap_core::probe().context("probing the kernel for userfaultfd support")?;
    if json {
        crate::report::json(&probe)
    } else {
        println!("{probe}");
        Ok(())
    }
}
