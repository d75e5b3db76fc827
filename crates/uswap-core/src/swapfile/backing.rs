//! What a swap file is stored on. Swap on tmpfs or ramfs is swap in RAM: every page swapped
//! out still takes memory, from the same machine or cgroup the region was limiting.

use std::fs::{self, File};
use std::io;
use std::os::fd::AsRawFd;
use std::os::unix::fs::{FileTypeExt, MetadataExt};
use std::path::Path;

const TMPFS_MAGIC: i64 = 0x0102_1994;
const RAMFS_MAGIC: i64 = 0x8584_58f6;

/// The kind of file system behind a swap file or directory (from `statfs` `f_type`).
#[derive(Clone, Copy, Debug, PartialEq, Eq, serde::Serialize)]
#[serde(rename_all = "lowercase")]
pub enum Backing {
    /// tmpfs: memory (which may itself be swapped by the kernel, if it has swap).
    Tmpfs,
    /// ramfs: memory that is never reclaimed.
    Ramfs,
    /// Any other file system, by its magic number.
    Other { fs_type: i64 },
}

impl Backing {
    /// The file system of a directory (or file).
    pub fn of_path(path: &Path) -> io::Result<Backing> {
        File::open(path).and_then(|f| Backing::of_file(&f))
    }

    /// The file system of an open file.
    pub fn of_file(file: &File) -> io::Result<Backing> {
        let mut st = std::mem::MaybeUninit::<libc::statfs>::uninit();
        // SAFETY: fstatfs fills `st` when it returns 0.
        if unsafe { libc::fstatfs(file.as_raw_fd(), st.as_mut_ptr()) } != 0 {
            return Err(io::Error::last_os_error());
        }
        // SAFETY: initialised by the successful call above.
        #[allow(clippy::unnecessary_cast)] // f_type is narrower on some targets
        let fs_type = unsafe { st.assume_init() }.f_type as i64 & 0xffff_ffff;
        Ok(match fs_type {
            TMPFS_MAGIC => Backing::Tmpfs,
            RAMFS_MAGIC => Backing::Ramfs,
            fs_type => Backing::Other { fs_type },
        })
    }

    /// Whether `file` (a file, or a block device itself) lies on a rotating disk, by its
    /// device's `queue/rotational` (its disk's, for a partition): what the kernel reads at
    /// swapon to choose between its two readaheads. `None` where the file system has no
    /// block device of its own to ask (tmpfs, overlayfs, btrfs's anonymous devices, NFS)
    /// or sysfs is not mounted.
    pub fn rotational(file: &File) -> Option<bool> {
        let meta = file.metadata().ok()?;
        rotational_device(match meta.file_type().is_block_device() {
            true => meta.rdev(),
            false => meta.dev(),
        })
    }

    /// Whether the swap file would live in RAM, so swapping to it saves no memory.
    pub fn in_memory(&self) -> bool {
        matches!(self, Backing::Tmpfs | Backing::Ramfs)
    }

    /// The file system's name where uswap knows it.
    pub fn name(&self) -> &'static str {
        match self {
            Backing::Tmpfs => "tmpfs",
            Backing::Ramfs => "ramfs",
            Backing::Other { fs_type } => match fs_type {
                0xef53 => "ext4",
                0x5846_5342 => "xfs",
                0x9123_683e => "btrfs",
                0xf2f5_2010 => "f2fs",
                0x2fc1_2fc1 => "zfs",
                0x794c_7630 => "overlayfs",
                0x6969 => "nfs",
                0x6573_5546 => "fuse",
                _ => "unknown file system",
            },
        }
    }
}

/// [`Backing::rotational`] of block device `dev`.
fn rotational_device(dev: libc::dev_t) -> Option<bool> {
    let (major, minor) = (libc::major(dev), libc::minor(dev));
    if major == 0 {
        return None; // an anonymous device: no block device behind it
    }
    let device = Path::new("/sys/dev/block").join(format!("{major}:{minor}"));
    ["queue/rotational", "../queue/rotational"]
        .iter()
        .find_map(|flag| fs::read_to_string(device.join(flag)).ok())
        .map(|flag| flag.trim() == "1")
}

impl std::fmt::Display for Backing {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            Backing::Tmpfs | Backing::Ramfs => write!(
                f,
                "{} (swap in RAM counts against the same memory)",
                self.name()
            ),
            Backing::Other { fs_type } => write!(f, "{} (type {fs_type:#x})", self.name()),
        }
    }
}

#[cfg(all(test, not(loom)))]
mod tests {
    use super::*;

    /// Every disk and partition sysfs lists, with its `dev` number and the flag of its
    /// disk's queue: (name, device, rotational).
    fn listed_devices() -> Vec<(String, libc::dev_t, bool)> {
        let number = |dir: &Path| -> Option<libc::dev_t> {
            let text = fs::read_to_string(dir.join("dev")).ok()?;
            let (major, minor) = text.trim().split_once(':')?;
            Some(libc::makedev(major.parse().ok()?, minor.parse().ok()?))
        };
        let mut found = Vec::new();
        for disk in fs::read_dir("/sys/block").into_iter().flatten().flatten() {
            let Ok(flag) = fs::read_to_string(disk.path().join("queue/rotational")) else {
                continue;
            };
            let rotational = flag.trim() == "1";
            let parts = fs::read_dir(disk.path()).into_iter().flatten().flatten();
            let parts = parts.filter(|p| p.path().join("partition").exists());
            for dir in std::iter::once(disk.path()).chain(parts.map(|p| p.path())) {
                if let Some(dev) = number(&dir) {
                    let name = dir.file_name().unwrap().to_string_lossy().into_owned();
                    found.push((name, dev, rotational));
                }
            }
        }
        found
    }

    #[test]
    fn disks_and_their_partitions_are_rotational_as_their_queue_says() {
        let devices = listed_devices();
        if devices.is_empty() {
            eprintln!("skipped: sysfs lists no block devices here");
            return;
        }
        for (name, dev, rotational) in devices {
            assert_eq!(rotational_device(dev), Some(rotational), "{name}");
        }
        assert_eq!(rotational_device(libc::makedev(0, 42)), None, "anonymous");
        assert_eq!(
            rotational_device(libc::makedev(4095, 4095)),
            None,
            "unlisted"
        );
    }

    #[test]
    fn a_file_on_a_file_system_without_a_block_device_is_unknown() {
        // procfs, like tmpfs and overlayfs, sits on an anonymous device.
        let file = File::open("/proc/self/status").unwrap();
        assert_eq!(Backing::rotational(&file), None);
    }
}
