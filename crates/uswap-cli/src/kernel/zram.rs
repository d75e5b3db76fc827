//! A zram device of our own for `--kernel-swap zram`: added through zram-control, sized,
//! turned into swap, and reset and removed afterwards.

use anyhow::{bail, Context, Result};
use serde::Serialize;
use std::fs;
use std::io;
use std::path::{Path, PathBuf};
use std::thread;
use std::time::Duration;

const CONTROL: &str = "/sys/class/zram-control";

/// The algorithm asked for when the kernel offers it: the fastest common one.
const PREFERRED_ALGORITHM: &str = "lz4";

/// A zram device this process added.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Zram {
    pub id: u32,
}

impl Zram {
    /// Adds a fresh device (`hot_add`). It is unconfigured: see [`Zram::configure`].
    pub fn add() -> Result<Zram> {
        let control = Path::new(CONTROL);
        if !control.exists() {
            bail!(
                "zram is not available on this machine ({CONTROL} is missing: the zram module \
                 is not loaded); load it with `modprobe zram`, or use --kernel-swap file"
            );
        }
        let text = fs::read_to_string(control.join("hot_add"))
            .with_context(|| format!("adding a zram device ({CONTROL}/hot_add)"))?;
        let id = text
            .trim()
            .parse()
            .with_context(|| format!("{CONTROL}/hot_add answered {text:?}, not a number"))?;
        Ok(Zram { id })
    }

    pub fn dev_path(&self) -> PathBuf {
        PathBuf::from(format!("/dev/zram{}", self.id))
    }

    fn sys(&self, file: &str) -> PathBuf {
        PathBuf::from(format!("/sys/block/zram{}/{file}", self.id))
    }

    fn read(&self, file: &str) -> Result<String> {
        let path = self.sys(file);
        fs::read_to_string(&path).with_context(|| format!("reading {}", path.display()))
    }

    fn write(&self, file: &str, value: &str) -> io::Result<()> {
        fs::write(self.sys(file), value)
    }

    /// Picks the compression algorithm and sets the size; returns the algorithm.
    pub fn configure(&self, bytes: u64) -> Result<String> {
        let (algorithm, change) = choose_algorithm(&self.read("comp_algorithm")?)
            .with_context(|| format!("no algorithm listed in {}", self.sys("").display()))?;
        if change {
            self.write("comp_algorithm", &algorithm)
                .with_context(|| format!("setting zram{} comp_algorithm", self.id))?;
        }
        self.write("disksize", &bytes.to_string())
            .with_context(|| format!("setting zram{} disksize to {bytes}", self.id))?;
        Ok(algorithm)
    }

    /// What the device saw since it was made; readable until it is reset.
    pub fn usage(&self) -> Result<ZramUsage> {
        parse_usage(&self.read("stat")?, &self.read("mm_stat")?)
            .with_context(|| format!("reading the statistics of zram{}", self.id))
    }

    /// Frees its memory (`reset`, which needs swap turned off) and removes it (`hot_remove`).
    pub fn remove(&self) -> Result<()> {
        let mut tries = 0;
        loop {
            match self.write("reset", "1") {
                Ok(()) => break,
                // Still held open for a moment after swapoff.
                Err(e) if e.raw_os_error() == Some(libc::EBUSY) && tries < 100 => {
                    tries += 1;
                    thread::sleep(Duration::from_millis(20));
                }
                Err(e) if e.kind() == io::ErrorKind::NotFound => return Ok(()),
                Err(e) => return Err(e).with_context(|| format!("resetting zram{}", self.id)),
            }
        }
        fs::write(Path::new(CONTROL).join("hot_remove"), self.id.to_string())
            .with_context(|| format!("removing zram{} ({CONTROL}/hot_remove)", self.id))
    }

    pub fn manual_removal(&self) -> String {
        format!(
            "swapoff {dev}; echo 1 > /sys/block/zram{id}/reset; echo {id} > {CONTROL}/hot_remove",
            dev = self.dev_path().display(),
            id = self.id
        )
    }
}

/// From a `comp_algorithm` listing such as `[lzo-rle] lzo lz4`: the algorithm to use and
/// whether it differs from the current (bracketed) one.
pub fn choose_algorithm(listing: &str) -> Option<(String, bool)> {
    let names: Vec<&str> = listing.split_whitespace().collect();
    let current = names
        .iter()
        .find(|n| n.starts_with('['))
        .map(|n| n.trim_matches(['[', ']']));
    if names
        .iter()
        .any(|n| n.trim_matches(['[', ']']) == PREFERRED_ALGORITHM)
    {
        let change = current != Some(PREFERRED_ALGORITHM);
        return Some((PREFERRED_ALGORITHM.to_string(), change));
    }
    current.map(|c| (c.to_string(), false))
}

/// What a zram device stored over its life, to show how compressible the swapped data was.
#[derive(Clone, Copy, Debug, Serialize, PartialEq, Eq)]
pub struct ZramUsage {
    /// Bytes written to the device (swap-outs).
    pub written_bytes: u64,
    /// The most memory the device used at once, compressed data and metadata.
    pub mem_used_max_bytes: u64,
    /// Pages that did not compress and were stored whole.
    pub incompressible_pages: u64,
}

impl ZramUsage {
    /// One line for the report.
    pub fn summary(&self) -> String {
        let written_pages = self.written_bytes / uswap_core::PAGE_SIZE as u64;
        format!(
            "zram: {} swapped out, at most {} of memory used; {} of {} pages did not compress",
            crate::report::size(self.written_bytes),
            crate::report::size(self.mem_used_max_bytes),
            crate::report::count(self.incompressible_pages),
            crate::report::count(written_pages)
        )
    }
}

/// Parses the block `stat` (field 7: sectors written) and `mm_stat` (field 5: mem_used_max,
/// field 9: huge_pages_since).
pub fn parse_usage(stat: &str, mm_stat: &str) -> Option<ZramUsage> {
    let field = |text: &str, i: usize| text.split_whitespace().nth(i)?.parse::<u64>().ok();
    Some(ZramUsage {
        written_bytes: field(stat, 6)? * 512,
        mem_used_max_bytes: field(mm_stat, 4)?,
        incompressible_pages: field(mm_stat, 8)?,
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn lz4_is_chosen_when_listed_else_the_current_algorithm_stays() {
        assert_eq!(
            choose_algorithm("[lzo-rle] lzo lz4 \n"),
            Some(("lz4".into(), true))
        );
        assert_eq!(
            choose_algorithm("lzo [lz4] zstd"),
            Some(("lz4".into(), false))
        );
        assert_eq!(choose_algorithm("lzo [zstd]"), Some(("zstd".into(), false)));
        assert_eq!(choose_algorithm(""), None);
    }

    #[test]
    fn usage_comes_from_stat_and_mm_stat() {
        let stat = "  100 0 800 5  2048 0 16384 7 0 9 12 0 0 0 0 0 0\n";
        let mm_stat = "  4096 2048 8192 0 12288 1 0 3 2040\n";
        assert_eq!(
            parse_usage(stat, mm_stat),
            Some(ZramUsage {
                written_bytes: 16384 * 512,
                mem_used_max_bytes: 12288,
                incompressible_pages: 2040
            })
        );
        assert_eq!(parse_usage("1 2", mm_stat), None);
    }
}
