//! The kernel's swap for the kernel backend: reuse swap that is on, or make a swap file.

use anyhow::{bail, Context, Result};
use std::fs::{self, OpenOptions};
use std::io::{self, Write};
use std::os::fd::AsRawFd;
use std::os::unix::fs::OpenOptionsExt;
use std::path::{Path, PathBuf};
use std::process::Command;

/// One line of `/proc/swaps`.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ActiveSwap {
    pub name: String,
    pub size_kib: u64,
    pub used_kib: u64,
}

pub fn parse_proc_swaps(text: &str) -> Vec<ActiveSwap> {
    text.lines()
        .skip(1)
        .filter_map(|line| {
            let f: Vec<&str> = line.split_whitespace().collect();
            Some(ActiveSwap {
                name: f.first()?.to_string(),
                size_kib: f.get(2)?.parse().ok()?,
                used_kib: f.get(3)?.parse().ok()?,
            })
        })
        .collect()
}

pub fn active() -> Result<Vec<ActiveSwap>> {
    let text = fs::read_to_string("/proc/swaps").context("reading /proc/swaps")?;
    Ok(parse_proc_swaps(&text))
}

/// Where the swap file for process `pid` goes.
pub fn file_path(dir: &Path, pid: u32) -> PathBuf {
    dir.join(format!("uswap-kernel-swap-{pid}"))
}

/// Creates a swap file of `bytes` at `path` (which must not exist) and turns it on.
pub fn create_and_enable(path: &Path, bytes: u64) -> Result<()> {
    allocate(path, bytes).with_context(|| format!("creating swap file {}", path.display()))?;
    run_tool("mkswap", path)?;
    run_tool("swapon", path)
}

/// Turns the swap file off (if it is on) and removes it.
pub fn disable_and_remove(path: &Path) -> Result<()> {
    let on = active()?.iter().any(|s| Path::new(&s.name) == path);
    if on {
        run_tool("swapoff", path)?;
    }
    match fs::remove_file(path) {
        Err(e) if e.kind() != io::ErrorKind::NotFound => {
            Err(e).with_context(|| format!("removing swap file {}", path.display()))
        }
        _ => Ok(()),
    }
}

/// A file of real blocks (swap files must have no holes), mode 0600.
fn allocate(path: &Path, bytes: u64) -> io::Result<()> {
    let mut file = OpenOptions::new()
        .write(true)
        .create_new(true)
        .mode(0o600)
        .open(path)?;
    // SAFETY: plain fallocate on a file descriptor we own.
    let r = unsafe { libc::fallocate(file.as_raw_fd(), 0, 0, bytes as libc::off_t) };
    if r == 0 {
        return Ok(());
    }
    let e = io::Error::last_os_error();
    if e.raw_os_error() != Some(libc::EOPNOTSUPP) {
        return Err(e);
    }
    // File systems without fallocate: write zeros.
    let zeros = vec![0u8; 1 << 20];
    let mut left = bytes;
    while left > 0 {
        let n = left.min(zeros.len() as u64) as usize;
        file.write_all(&zeros[..n])?;
        left -= n as u64;
    }
    file.sync_all()
}

/// Runs mkswap/swapon/swapoff on `path`, from /usr/sbin or /sbin when PATH lacks them.
fn run_tool(tool: &str, path: &Path) -> Result<()> {
    let program = ["/usr/sbin", "/sbin"]
        .iter()
        .map(|dir| Path::new(dir).join(tool))
        .find(|p| p.exists())
        .unwrap_or_else(|| PathBuf::from(tool));
    let out = Command::new(&program)
        .arg(path)
        .output()
        .with_context(|| format!("running {}", program.display()))?;
    if !out.status.success() {
        bail!(
            "`{} {}` failed ({}): {}",
            program.display(),
            path.display(),
            out.status,
            String::from_utf8_lossy(&out.stderr).trim()
        );
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn proc_swaps_lines_are_parsed_and_the_header_skipped() {
        let text = "Filename\t\t\t\tType\t\tSize\t\tUsed\t\tPriority\n\
                    /dev/zram0                              partition\t4194300\t\t1024\t\t100\n\
                    /tmp/swap file                          file\tbad\n";
        assert_eq!(
            parse_proc_swaps(text),
            vec![ActiveSwap {
                name: "/dev/zram0".into(),
                size_kib: 4194300,
                used_kib: 1024
            }]
        );
        assert!(parse_proc_swaps("Filename\tType\tSize\tUsed\tPriority\n").is_empty());
    }

    #[test]
    fn the_swap_file_is_named_after_the_process_and_allocated_without_holes() {
        let dir = tempfile::tempdir().unwrap();
        let path = file_path(dir.path(), 42);
        assert_eq!(path, dir.path().join("uswap-kernel-swap-42"));
        allocate(&path, 1 << 20).unwrap();
        let meta = fs::metadata(&path).unwrap();
        assert_eq!(meta.len(), 1 << 20);
        use std::os::unix::fs::{MetadataExt, PermissionsExt};
        assert_eq!(meta.permissions().mode() & 0o777, 0o600);
        assert!(meta.blocks() * 512 >= 1 << 20);
        assert!(
            allocate(&path, 4096).is_err(),
            "an existing file is never overwritten"
        );
    }
}
