//! The kernel's swap counters from /proc/vmstat.

use anyhow::{Context, Result};
use serde::{Deserialize, Serialize};

/// Pages swapped in and out, machine-wide.
#[derive(Clone, Copy, Debug, Default, Serialize, Deserialize, PartialEq, Eq)]
pub struct SwapPages {
    pub pswpin: u64,
    pub pswpout: u64,
}

impl SwapPages {
    pub fn since(&self, earlier: &SwapPages) -> SwapPages {
        SwapPages {
            pswpin: self.pswpin.saturating_sub(earlier.pswpin),
            pswpout: self.pswpout.saturating_sub(earlier.pswpout),
        }
    }
}

pub fn parse(text: &str) -> SwapPages {
    let mut s = SwapPages::default();
    for line in text.lines() {
        let mut f = line.split_whitespace();
        let (Some(name), Some(Ok(value))) = (f.next(), f.next().map(str::parse)) else {
            continue;
        };
        match name {
            "pswpin" => s.pswpin = value,
            "pswpout" => s.pswpout = value,
            _ => {}
        }
    }
    s
}

pub fn read() -> Result<SwapPages> {
    let text = std::fs::read_to_string("/proc/vmstat").context("reading /proc/vmstat")?;
    Ok(parse(&text))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn swap_counters_are_picked_out() {
        let s = parse("nr_free_pages 100\npswpin 7\npswpout 11\npgfault 5\n");
        assert_eq!(
            s,
            SwapPages {
                pswpin: 7,
                pswpout: 11
            }
        );
        let later = SwapPages {
            pswpin: 10,
            pswpout: 11,
        };
        assert_eq!(
            later.since(&s),
            SwapPages {
                pswpin: 3,
                pswpout: 0
            }
        );
    }
}
