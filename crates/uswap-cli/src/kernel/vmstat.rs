//! The kernel's swap counters: /proc/vmstat and the process's own major faults.

use anyhow::{Context, Result};
use serde::{Deserialize, Serialize};
use std::collections::BTreeMap;

/// The /proc/vmstat counters of LRU movement (machine-wide): pages activated and
/// deactivated, active pages scanned, pages rotated to the inactive tail when their
/// write-back ended, anonymous pages scanned and reclaimed.
pub const LRU: [&str; 6] = [
    "pgactivate",
    "pgdeactivate",
    "pgrefill",
    "pgrotated",
    "pgscan_anon",
    "pgsteal_anon",
];

/// The /proc/vmstat counters of the swap fault path and of reclaim (machine-wide): what
/// the kernel offers where uswap has a phase breakdown.
pub const FAULT_PATH: [&str; 15] = [
    "pgfault",
    "pgmajfault",
    "swap_ra",
    "swap_ra_hit",
    "pgscan_direct",
    "pgscan_kswapd",
    "pgsteal_direct",
    "pgsteal_kswapd",
    "allocstall_movable",
    "pgactivate",
    "pgdeactivate",
    "workingset_refault_anon",
    "zswpin",
    "zswpout",
    "zswpwb",
];

/// /proc/vmstat counters by name.
pub type Named = BTreeMap<String, u64>;

/// Pages swapped in and out machine-wide, and the reading process's major faults.
#[derive(Clone, Copy, Debug, Default, Serialize, Deserialize, PartialEq, Eq)]
pub struct SwapCounters {
    pub pswpin: u64,
    pub pswpout: u64,
    /// Faults of this process that waited for a read (getrusage), not the machine's: other
    /// programs' file reads would swamp them.
    pub pgmajfault: u64,
}

impl SwapCounters {
    pub fn since(&self, earlier: &SwapCounters) -> SwapCounters {
        SwapCounters {
            pswpin: self.pswpin.saturating_sub(earlier.pswpin),
            pswpout: self.pswpout.saturating_sub(earlier.pswpout),
            pgmajfault: self.pgmajfault.saturating_sub(earlier.pgmajfault),
        }
    }
}

/// The swap counters of /proc/vmstat (`pgmajfault` is left 0).
pub fn parse(text: &str) -> SwapCounters {
    let mut s = SwapCounters::default();
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

pub fn read() -> Result<SwapCounters> {
    Ok(SwapCounters {
        pgmajfault: own_major_faults()?,
        ..parse(&proc_vmstat()?)
    })
}

/// The counters of `names` that /proc/vmstat text has (a kernel may lack some).
pub fn parse_named(text: &str, names: &[&str]) -> Named {
    text.lines()
        .filter_map(|line| {
            let (name, value) = line.split_once(' ')?;
            let value = value.trim().parse().ok()?;
            names.contains(&name).then(|| (name.to_string(), value))
        })
        .collect()
}

pub fn read_named(names: &[&str]) -> Result<Named> {
    Ok(parse_named(&proc_vmstat()?, names))
}

/// Named counters over an interval: `after` less `before`, for those read both times.
pub fn named_since(after: &Named, before: &Named) -> Named {
    after
        .iter()
        .filter_map(|(name, a)| Some((name.clone(), a.saturating_sub(*before.get(name)?))))
        .collect()
}

fn proc_vmstat() -> Result<String> {
    std::fs::read_to_string("/proc/vmstat").context("reading /proc/vmstat")
}

fn own_major_faults() -> Result<u64> {
    // SAFETY: getrusage fills the struct it is given.
    let mut usage: libc::rusage = unsafe { std::mem::zeroed() };
    if unsafe { libc::getrusage(libc::RUSAGE_SELF, &mut usage) } != 0 {
        return Err(std::io::Error::last_os_error()).context("getrusage");
    }
    Ok(usage.ru_majflt as u64)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn swap_counters_are_picked_out() {
        let s = parse("nr_free_pages 100\npswpin 7\npswpout 11\npgmajfault 5\n");
        assert_eq!(
            s,
            SwapCounters {
                pswpin: 7,
                pswpout: 11,
                pgmajfault: 0
            }
        );
        let later = SwapCounters {
            pswpin: 10,
            pswpout: 11,
            pgmajfault: 4,
        };
        assert_eq!(
            later.since(&s),
            SwapCounters {
                pswpin: 3,
                pswpout: 0,
                pgmajfault: 4
            }
        );
    }

    #[test]
    fn named_counters_are_picked_out_and_subtracted() {
        let text = "pgactivate 10\npgdeactivate 20\npgrotated 5\npgrotated_x 9\n";
        let before = parse_named(text, &LRU);
        assert_eq!(before.len(), 3, "{before:?}");
        assert_eq!(before["pgrotated"], 5);
        let after = parse_named("pgactivate 15\npgdeactivate 20\npgrefill 3\n", &LRU);
        let moved = named_since(&after, &before);
        assert_eq!(
            moved.into_iter().collect::<Vec<_>>(),
            [
                ("pgactivate".to_string(), 5),
                ("pgdeactivate".to_string(), 0)
            ]
        );
    }

    #[test]
    fn reading_works_here() {
        read().unwrap();
        assert!(read_named(&LRU).unwrap().contains_key("pgactivate"));
    }
}
