//! The kernel's swap for the kernel backend: what is on, a swap file of our own, and the
//! swap tools.

use super::zram::Zram;
use anyhow::{bail, Context, Result};
use std::ffi::{CString, OsStr};
use std::fs::{self, OpenOptions};
use std::io::{self, Write};
use std::os::fd::AsRawFd;
use std::os::unix::ffi::OsStrExt;
use std::os::unix::fs::OpenOptionsExt;
use std::path::{Path, PathBuf};
use std::process::Command;

/// One line of `/proc/swaps`.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ActiveSwap {
    pub name: String,
    pub size_kib: u64,
    pub used_kib: u64,
    pub priority: i32,
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
                priority: f.get(4)?.parse().ok()?,
            })
        })
        .collect()
}

pub fn active() -> Result<Vec<ActiveSwap>> {
    let text = fs::read_to_string("/proc/swaps").context("reading /proc/swaps")?;
    Ok(parse_proc_swaps(&text))
}

/// Whether a swap that is on lies on a rotating disk: while one does, the kernel reads
/// ahead by slot for all swap whatever `vma_ra_enabled` says (`nr_rotate_swap`). `None`
/// when that cannot be told for some swap and none is known to be rotational.
pub fn any_is_rotational() -> Option<bool> {
    let mut unknown = false;
    for swap in active().ok()? {
        let file = fs::File::open(&swap.name).ok();
        match file.and_then(|f| uswap_core::Backing::rotational(&f)) {
            Some(true) => return Some(true),
            Some(false) => {}
            None => unknown = true,
        }
    }
    (!unknown).then_some(false)
}

fn is_active(path: &Path) -> Result<bool> {
    Ok(active()?.iter().any(|s| Path::new(&s.name) == path))
}

/// A priority above every swap in `active` (none needed when nothing is on), so the kernel
/// fills a new device before any other.
pub fn priority_above(active: &[ActiveSwap]) -> Option<i32> {
    let highest = active.iter().map(|s| s.priority).max()?;
    Some(highest.saturating_add(1).clamp(0, MAX_PRIORITY))
}

/// The highest priority `swapon -p` takes.
const MAX_PRIORITY: i32 = 32767;

/// Swap this run made, to be turned off and removed afterwards.
#[derive(Debug)]
pub enum OwnSwap {
    File(PathBuf),
    Zram(Zram),
}

impl OwnSwap {
    /// What `swapon`/`swapoff` are given.
    pub fn path(&self) -> PathBuf {
        match self {
            OwnSwap::File(path) => path.clone(),
            OwnSwap::Zram(z) => z.dev_path(),
        }
    }

    /// Turns it off if it is on, then deletes it.
    pub fn remove(&self) -> Result<()> {
        let path = self.path();
        if is_active(&path)? {
            turn_off(&path)?;
        }
        match self {
            OwnSwap::File(path) => match fs::remove_file(path) {
                Err(e) if e.kind() != io::ErrorKind::NotFound => {
                    Err(e).with_context(|| format!("removing swap file {}", path.display()))
                }
                _ => Ok(()),
            },
            OwnSwap::Zram(z) => z.remove(),
        }
    }

    /// How to undo it by hand, for a warning when [`OwnSwap::remove`] failed.
    pub fn manual_removal(&self) -> String {
        match self {
            OwnSwap::File(path) => format!("swapoff {0}; rm {0}", path.display()),
            OwnSwap::Zram(z) => z.manual_removal(),
        }
    }
}

/// Where the swap file for process `pid` goes: named after it and a random part, so that
/// another user of a shared directory cannot take the name first and refuse the run.
pub fn file_path(dir: &Path, pid: u32) -> PathBuf {
    // Without the system's random numbers (never seen on Linux) the clock still varies it.
    let random = getrandom::u64().unwrap_or_else(|_| {
        let now = std::time::SystemTime::now().duration_since(std::time::UNIX_EPOCH);
        now.map_or(0, |d| d.as_nanos() as u64)
    });
    dir.join(format!("uswap-kernel-swap-{pid}-{random:016x}"))
}

/// Creates a swap file of `bytes` at `path` (which must not exist) and turns it on.
pub fn create_file_and_enable(path: &Path, bytes: u64) -> Result<()> {
    allocate(path, bytes).with_context(|| format!("creating swap file {}", path.display()))?;
    format_and_enable(path, None)
}

/// Runs `mkswap` on `path`, then `swapon` (with `priority` if given).
pub fn format_and_enable(path: &Path, priority: Option<i32>) -> Result<()> {
    run_tool("mkswap", &[path.as_os_str()])?;
    match priority {
        Some(p) => run_tool(
            "swapon",
            &["-p".as_ref(), p.to_string().as_ref(), path.as_ref()],
        ),
        None => run_tool("swapon", &[path.as_os_str()]),
    }
}

/// swapoff(2) on `path`: returns once every page on it is back in memory.
pub fn turn_off(path: &Path) -> Result<()> {
    let c_path = CString::new(path.as_os_str().as_bytes()).context("a path with a NUL byte")?;
    // SAFETY: a valid NUL-terminated path.
    if unsafe { libc::swapoff(c_path.as_ptr()) } != 0 {
        return Err(io::Error::last_os_error())
            .with_context(|| format!("swapoff {}", path.display()));
    }
    Ok(())
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

/// Runs mkswap/swapon with `args`, from /usr/sbin or /sbin when PATH lacks them.
fn run_tool(tool: &str, args: &[&OsStr]) -> Result<()> {
    let program = ["/usr/sbin", "/sbin"]
        .iter()
        .map(|dir| Path::new(dir).join(tool))
        .find(|p| p.exists())
        .unwrap_or_else(|| PathBuf::from(tool));
    let out = Command::new(&program)
        .args(args)
        .output()
        .with_context(|| format!("running {}", program.display()))?;
    if !out.status.success() {
        let shown: Vec<_> = args.iter().map(|a| a.to_string_lossy()).collect();
        bail!(
            "`{} {}` failed ({}): {}",
            program.display(),
            shown.join(" "),
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
                    /swapfile                               file\t1024\t\t0\t\t-2\n\
                    /tmp/swap file                          file\tbad\n";
        assert_eq!(
            parse_proc_swaps(text),
            vec![
                ActiveSwap {
                    name: "/dev/zram0".into(),
                    size_kib: 4194300,
                    used_kib: 1024,
                    priority: 100
                },
                ActiveSwap {
                    name: "/swapfile".into(),
                    size_kib: 1024,
                    used_kib: 0,
                    priority: -2
                }
            ]
        );
        assert!(parse_proc_swaps("Filename\tType\tSize\tUsed\tPriority\n").is_empty());
    }

    #[test]
    fn a_new_device_goes_above_every_active_one() {
        let on = |priority| ActiveSwap {
            name: "x".into(),
            size_kib: 1,
            used_kib: 0,
            priority,
        };
        assert_eq!(priority_above(&[]), None);
        assert_eq!(priority_above(&[on(-2), on(-3)]), Some(0));
        assert_eq!(priority_above(&[on(-2), on(100)]), Some(101));
        assert_eq!(priority_above(&[on(MAX_PRIORITY)]), Some(MAX_PRIORITY));
    }

    #[test]
    fn the_swap_file_is_named_after_the_process_unguessably_and_allocated_without_holes() {
        let dir = tempfile::tempdir().unwrap();
        let path = file_path(dir.path(), 42);
        let name = path.file_name().unwrap().to_str().unwrap();
        let random = name.strip_prefix("uswap-kernel-swap-42-");
        assert!(random.is_some_and(|r| r.len() == 16), "{name}");
        assert_ne!(path, file_path(dir.path(), 42), "a name cannot be guessed");
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
