//! `uswap info`: what this kernel offers uswap, and what the default swap directory is.

use anyhow::{Context, Result};
use serde::Serialize;
use std::path::PathBuf;
use uswap_core::swapfile::{guard_bytes_per_slot, sealing_speed, Backing, SwapDevice};
use uswap_core::{IoMode, SwapConfig, SwapEncryption, SwapLocation, PAGE_SIZE};

/// The default swap directory ($TMPDIR), as a swap device opened there sees it.
#[derive(Serialize)]
struct SwapDir {
    path: PathBuf,
    /// The file system, or `None` when no swap file could be created there.
    backing: Option<Backing>,
    /// Whether swap there lives in RAM (tmpfs, ramfs).
    in_memory: Option<bool>,
    direct_io: Option<bool>,
    io_mode: Option<IoMode>,
    free_bytes: Option<u64>,
    /// Why no swap file could be created there.
    error: Option<String>,
}

impl SwapDir {
    fn probe(path: PathBuf) -> SwapDir {
        let cfg = SwapConfig {
            location: SwapLocation::TempIn(path.clone()),
            ..SwapConfig::default()
        };
        match SwapDevice::open(&cfg) {
            Ok(dev) => SwapDir {
                path,
                backing: Some(dev.backing()),
                in_memory: Some(dev.backing().in_memory()),
                direct_io: Some(dev.direct_io()),
                io_mode: Some(dev.io_mode()),
                free_bytes: Some(dev.capacity_pages() * PAGE_SIZE as u64),
                error: None,
            },
            Err(e) => SwapDir {
                path,
                backing: None,
                in_memory: None,
                direct_io: None,
                io_mode: None,
                free_bytes: None,
                error: Some(e.to_string()),
            },
        }
    }
}

impl std::fmt::Display for SwapDir {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "swap directory: {}", self.path.display())?;
        if let Some(e) = &self.error {
            return write!(f, " (unusable: {e})");
        }
        if let (Some(backing), Some(direct), Some(io), Some(free)) =
            (self.backing, self.direct_io, self.io_mode, self.free_bytes)
        {
            let io = match io {
                IoMode::Uring => "io_uring",
                IoMode::Pread if backing.in_memory() => "pread (auto: the file is in memory)",
                IoMode::Pread | IoMode::Auto => "pread",
            };
            write!(
                f,
                "\n  file system: {backing}\n  direct I/O: {}, I/O: {io}, free: {}",
                if direct { "yes" } else { "no (buffered)" },
                crate::report::size(free)
            )?;
            if backing.in_memory() {
                write!(
                    f,
                    "\n  warning: swapping here saves no memory; point --swap-dir (or TMPDIR) \
                     at a disk"
                )?;
            }
        }
        Ok(())
    }
}

/// Memory uswap keeps outside a region's memory limit, per GiB.
#[derive(Serialize)]
struct Metadata {
    /// Per GiB of region: the page table word, LRU links and shadow of each page.
    per_gib_of_region: u64,
    /// Per GiB of swap written: the seal of each slot (encryption on, the default).
    per_gib_of_swap: u64,
    /// Per GiB of swap written with `--swap-encryption off`: the checksum of each slot.
    per_gib_of_plain_swap: u64,
}

impl Metadata {
    fn estimate() -> Metadata {
        let pages_per_gib = (1u64 << 30) / PAGE_SIZE as u64;
        let guard = |e| pages_per_gib * guard_bytes_per_slot(e);
        Metadata {
            per_gib_of_region: uswap_core::metadata_bytes(pages_per_gib),
            per_gib_of_swap: guard(SwapEncryption::On),
            per_gib_of_plain_swap: guard(SwapEncryption::Off),
        }
    }
}

impl std::fmt::Display for Metadata {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(
            f,
            "memory outside the limit: {} per GiB of region (page table, LRU, shadows), {} per \
             GiB of swap written (seals; {} with --swap-encryption off)",
            crate::report::size(self.per_gib_of_region),
            crate::report::size(self.per_gib_of_swap),
            crate::report::size(self.per_gib_of_plain_swap)
        )
    }
}

/// The cipher that seals swap here, and one core's speed with it.
#[derive(Serialize)]
struct Encryption {
    cipher: &'static str,
    seal_bytes_per_s: f64,
    open_bytes_per_s: f64,
}

impl Encryption {
    /// Seals and opens 64 MiB of pages (a few tens of ms).
    fn measure() -> Result<Encryption> {
        let (cipher, seal, open) =
            sealing_speed(16_384).context("drawing a key for swap encryption")?;
        Ok(Encryption {
            cipher,
            seal_bytes_per_s: seal,
            open_bytes_per_s: open,
        })
    }
}

impl std::fmt::Display for Encryption {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(
            f,
            "swap encryption (on by default): {}, one core seals {:.2} GB/s and opens {:.2} GB/s",
            self.cipher,
            self.seal_bytes_per_s / 1e9,
            self.open_bytes_per_s / 1e9
        )
    }
}

#[derive(Serialize)]
struct Info {
    #[serde(flatten)]
    probe: uswap_core::Probe,
    swap_dir: SwapDir,
    encryption: Encryption,
    metadata: Metadata,
}

pub fn run(json: bool) -> Result<()> {
    let probe = uswap_core::probe().context("probing the kernel for userfaultfd support")?;
    let swap_dir = SwapDir::probe(std::env::temp_dir());
    let encryption = Encryption::measure()?;
    let metadata = Metadata::estimate();
    if json {
        crate::report::json(&Info {
            probe,
            swap_dir,
            encryption,
            metadata,
        })
    } else {
        println!("{probe}");
        println!("{swap_dir}");
        println!("{encryption}");
        println!("{metadata}");
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn metadata_estimate_counts_page_words_lru_links_and_seals() {
        let m = Metadata::estimate();
        assert_eq!(m.per_gib_of_region, 262_144 * 24);
        assert_eq!(
            (m.per_gib_of_swap, m.per_gib_of_plain_swap),
            (6 << 20, 2 << 20)
        );
        assert!(m.to_string().contains("6 MiB per GiB of region"), "{m}");
    }

    #[test]
    fn a_swap_dir_in_ram_is_flagged() {
        let shm = PathBuf::from("/dev/shm");
        if Backing::of_path(&shm).ok() != Some(Backing::Tmpfs) {
            eprintln!("skipped: /dev/shm is not tmpfs here");
            return;
        }
        let dir = SwapDir::probe(shm);
        assert_eq!(dir.in_memory, Some(true));
        let text = dir.to_string();
        assert!(
            text.contains("tmpfs (swap in RAM counts against the same memory)")
                && text.contains("warning: swapping here saves no memory"),
            "{text}"
        );
    }

    #[test]
    fn a_swap_dir_on_disk_shows_its_file_system_and_space() {
        let tmp = tempfile::tempdir().unwrap();
        let dir = SwapDir::probe(tmp.path().into());
        let backing = dir.backing.expect("a usable directory");
        let text = dir.to_string();
        assert!(
            text.contains(&format!("file system: {backing}")) && text.contains("free: "),
            "{text}"
        );
        assert_eq!(text.contains("warning"), backing.in_memory(), "{text}");
        assert_eq!(std::fs::read_dir(tmp.path()).unwrap().count(), 0);
    }

    #[test]
    fn an_unusable_swap_dir_is_reported_not_fatal() {
        let dir = SwapDir::probe("/nonexistent/uswap-dir".into());
        assert!(dir.backing.is_none());
        let text = dir.to_string();
        assert!(
            text.contains("/nonexistent/uswap-dir") && text.contains("unusable"),
            "{text}"
        );
    }
}
