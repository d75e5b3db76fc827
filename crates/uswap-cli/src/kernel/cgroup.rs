//! A memory cgroup for the kernel-backend child: v1 or v2, whichever has the memory
//! controller on this machine; its limit, and what it saw.

use anyhow::{bail, Context, Result};
use std::collections::BTreeMap;
use std::fs;
use std::io;
use std::os::fd::{FromRawFd, OwnedFd};
use std::path::{Path, PathBuf};
use std::thread;
use std::time::Duration;

/// Where the memory controller is mounted and which interface it speaks.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Hierarchy {
    /// cgroup v1: its own `memory` hierarchy with `memory.limit_in_bytes`.
    V1(PathBuf),
    /// cgroup v2: the unified hierarchy with `memory` among its controllers.
    V2(PathBuf),
}

impl Hierarchy {
    /// Finds the memory controller under `root` (normally `/sys/fs/cgroup`), preferring v1.
    pub fn detect(root: &Path) -> Result<Hierarchy> {
        let v1 = root.join("memory");
        if v1.join("memory.limit_in_bytes").exists() {
            return Ok(Hierarchy::V1(v1));
        }
        let controllers = fs::read_to_string(root.join("cgroup.controllers")).unwrap_or_default();
        if controllers.split_whitespace().any(|c| c == "memory") {
            let enabled =
                fs::read_to_string(root.join("cgroup.subtree_control")).unwrap_or_default();
            if !enabled.split_whitespace().any(|c| c == "memory") {
                bail!(
                    "the cgroup v2 memory controller is not enabled for child groups of {}: \
                     enable it with `echo +memory > {}`",
                    root.display(),
                    root.join("cgroup.subtree_control").display()
                );
            }
            return Ok(Hierarchy::V2(root.to_path_buf()));
        }
        bail!(
            "no memory cgroup controller found under {} (neither a v1 `memory` hierarchy nor \
             v2 with `memory` in cgroup.controllers)",
            root.display()
        )
    }

    pub fn group_path(&self, name: &str) -> PathBuf {
        match self {
            Hierarchy::V1(dir) | Hierarchy::V2(dir) => dir.join(name),
        }
    }

    /// The control files to write, in order, for a memory limit (`None`: no limit) with
    /// swapping allowed.
    pub fn settings(&self, limit: Option<u64>) -> Vec<(&'static str, String)> {
        let swap = match self {
            // memory.memsw.* is left alone: unlimited unless the machine set it.
            Hierarchy::V1(_) => ("memory.swappiness", "60".to_string()),
            Hierarchy::V2(_) => ("memory.swap.max", "max".to_string()),
        };
        vec![swap, self.limit(limit)]
    }

    /// The control file and value for a memory limit (`None`: no limit).
    pub fn limit(&self, limit: Option<u64>) -> (&'static str, String) {
        match self {
            Hierarchy::V1(_) => (
                "memory.limit_in_bytes",
                limit.map_or("-1".to_string(), |b| b.to_string()),
            ),
            Hierarchy::V2(_) => (
                "memory.max",
                limit.map_or("max".to_string(), |b| b.to_string()),
            ),
        }
    }

    /// The control file with the most memory the group has used at once.
    fn peak_file(&self) -> &'static str {
        match self {
            Hierarchy::V1(_) => "memory.max_usage_in_bytes",
            Hierarchy::V2(_) => "memory.peak",
        }
    }
}

/// A cgroup this program created; [`Cgroup::remove`] deletes it.
#[derive(Debug)]
pub struct Cgroup {
    path: PathBuf,
    hierarchy: Hierarchy,
}

impl Cgroup {
    /// Creates `name` under the hierarchy and applies the limit. On failure nothing is left.
    pub fn create(h: &Hierarchy, name: &str, limit: Option<u64>) -> Result<Cgroup> {
        let path = h.group_path(name);
        fs::create_dir(&path).with_context(|| format!("creating cgroup {}", path.display()))?;
        let group = Cgroup {
            path,
            hierarchy: h.clone(),
        };
        for (file, value) in h.settings(limit) {
            if let Err(e) = group.write(file, &value) {
                // Best effort: the error that matters is the one being returned.
                let _ = group.remove();
                return Err(e);
            }
        }
        Ok(group)
    }

    pub fn path(&self) -> &Path {
        &self.path
    }

    /// Changes the memory limit (`None`: no limit).
    pub fn set_limit(&self, limit: Option<u64>) -> Result<()> {
        let (file, value) = self.hierarchy.limit(limit);
        self.write(file, &value)
    }

    /// The most memory the group has used at once (anonymous, page cache and kernel memory).
    pub fn peak(&self) -> Result<u64> {
        let text = self.read(self.hierarchy.peak_file())?;
        text.trim()
            .parse()
            .with_context(|| format!("{} reads {text:?}", self.hierarchy.peak_file()))
    }

    /// The counters of `memory.stat` (v2 has `pswpin` and `pswpout` there; v1 does not).
    pub fn stat(&self) -> Result<BTreeMap<String, u64>> {
        let text = self.read("memory.stat")?;
        Ok(text
            .lines()
            .filter_map(|line| {
                let (name, value) = line.split_once(' ')?;
                Some((name.to_string(), value.trim().parse().ok()?))
            })
            .collect())
    }

    /// Moves process `pid` (and only it) into the group.
    pub fn add_process(&self, pid: u32) -> Result<()> {
        self.write("cgroup.procs", &pid.to_string())
    }

    fn read(&self, file: &str) -> Result<String> {
        let path = self.path.join(file);
        fs::read_to_string(&path).with_context(|| format!("reading {}", path.display()))
    }

    fn write(&self, file: &str, value: &str) -> Result<()> {
        let path = self.path.join(file);
        fs::write(&path, value).with_context(|| format!("writing {value} to {}", path.display()))
    }

    /// Ends every process still in the group (a daemon the command left behind, or one
    /// still exiting): SIGTERM first, SIGKILL to what is left after `grace` (on cgroup v2
    /// also through `cgroup.kill`, which reaches nested groups), and waits until the group
    /// is empty, `within` at most. A process is signalled through a pidfd, and only if its
    /// pid is still listed once the pidfd is open, so a pid reused meanwhile by a process
    /// outside the group is never signalled. Returns how many processes it signalled.
    pub fn kill_all(&self, grace: Duration, within: Duration) -> io::Result<usize> {
        let start = std::time::Instant::now();
        let mut signalled = std::collections::BTreeSet::new();
        loop {
            let Some(listed) = self.members()? else {
                return Ok(signalled.len());
            };
            if listed.is_empty() {
                return Ok(signalled.len());
            }
            if start.elapsed() >= within {
                return Err(io::Error::new(
                    io::ErrorKind::TimedOut,
                    format!("processes {listed:?} are still in the group"),
                ));
            }
            let hard = start.elapsed() >= grace;
            if hard {
                // Best effort: v1 has no such file.
                let _ = fs::write(self.path.join("cgroup.kill"), "1");
            }
            let opened: Vec<(i32, OwnedFd)> = listed
                .iter()
                .filter(|pid| hard || !signalled.contains(*pid))
                .filter_map(|&pid| Some((pid, pidfd_open(pid)?)))
                .collect();
            let still = self.members()?.unwrap_or_default();
            let signal = if hard { libc::SIGKILL } else { libc::SIGTERM };
            for (pid, fd) in opened {
                if still.contains(&pid) && pidfd_send_signal(&fd, signal) {
                    signalled.insert(pid);
                }
            }
            thread::sleep(Duration::from_millis(20));
        }
    }

    /// The processes in the group (`None`: the group is gone).
    fn members(&self) -> io::Result<Option<Vec<i32>>> {
        match fs::read_to_string(self.path.join("cgroup.procs")) {
            Err(e) if e.kind() == io::ErrorKind::NotFound => Ok(None),
            Err(e) => Err(e),
            // A process outside this pid namespace is listed as 0.
            Ok(text) => Ok(Some(
                text.lines()
                    .filter_map(|l| l.trim().parse().ok())
                    .filter(|&pid: &i32| pid > 0)
                    .collect(),
            )),
        }
    }

    /// Removes the group. Its processes must have exited; the kernel may still be finishing
    /// that for a moment (EBUSY), so this retries briefly.
    pub fn remove(&self) -> io::Result<()> {
        let mut tries = 0;
        loop {
            match fs::remove_dir(&self.path) {
                Err(e) if e.raw_os_error() == Some(libc::EBUSY) && tries < 100 => {
                    tries += 1;
                    thread::sleep(Duration::from_millis(20));
                }
                Err(e) if e.kind() == io::ErrorKind::NotFound => return Ok(()),
                other => return other,
            }
        }
    }
}

/// A pidfd for process `pid`, if it exists.
fn pidfd_open(pid: i32) -> Option<OwnedFd> {
    // SAFETY: a plain system call; a descriptor it returns is ours alone.
    let fd = unsafe { libc::syscall(libc::SYS_pidfd_open, pid, 0) };
    // SAFETY: as above.
    (fd >= 0).then(|| unsafe { OwnedFd::from_raw_fd(fd as i32) })
}

/// Sends `signal` to the process of `pidfd`: false if it has exited.
fn pidfd_send_signal(pidfd: &OwnedFd, signal: i32) -> bool {
    use std::os::fd::AsRawFd;
    // SAFETY: a plain system call on a descriptor we own, with no siginfo.
    let rc = unsafe {
        libc::syscall(
            libc::SYS_pidfd_send_signal,
            pidfd.as_raw_fd(),
            signal,
            std::ptr::null::<libc::siginfo_t>(),
            0,
        )
    };
    rc == 0
}

#[cfg(test)]
mod tests {
    use super::*;

    fn tree(files: &[(&str, &str)]) -> tempfile::TempDir {
        let root = tempfile::tempdir().unwrap();
        for (path, content) in files {
            let p = root.path().join(path);
            fs::create_dir_all(p.parent().unwrap()).unwrap();
            fs::write(p, content).unwrap();
        }
        root
    }

    #[test]
    fn v1_memory_hierarchy_is_preferred() {
        let root = tree(&[
            ("memory/memory.limit_in_bytes", "9223372036854771712\n"),
            ("cgroup.controllers", "cpu io memory\n"),
            ("cgroup.subtree_control", "memory\n"),
        ]);
        let h = Hierarchy::detect(root.path()).unwrap();
        assert_eq!(h, Hierarchy::V1(root.path().join("memory")));
        assert_eq!(h.group_path("g"), root.path().join("memory/g"));
    }

    #[test]
    fn v2_needs_memory_in_controllers_and_subtree_control() {
        let root = tree(&[
            ("cgroup.controllers", "cpu io memory\n"),
            ("cgroup.subtree_control", "cpu memory\n"),
        ]);
        assert_eq!(
            Hierarchy::detect(root.path()).unwrap(),
            Hierarchy::V2(root.path().to_path_buf())
        );

        let root = tree(&[
            ("cgroup.controllers", "cpu io memory\n"),
            ("cgroup.subtree_control", "cpu\n"),
        ]);
        let err = Hierarchy::detect(root.path()).unwrap_err().to_string();
        assert!(err.contains("+memory"), "{err}");

        // Like this machine's unified hierarchy: mounted, but no controllers.
        let root = tree(&[("cgroup.controllers", "")]);
        let err = Hierarchy::detect(root.path()).unwrap_err().to_string();
        assert!(err.contains("no memory cgroup controller"), "{err}");
    }

    #[test]
    fn settings_set_the_limit_and_allow_swap() {
        let v1 = Hierarchy::V1("/x".into());
        assert_eq!(
            v1.settings(Some(4096)),
            vec![
                ("memory.swappiness", "60".into()),
                ("memory.limit_in_bytes", "4096".into())
            ]
        );
        assert_eq!(v1.settings(None)[1], ("memory.limit_in_bytes", "-1".into()));
        let v2 = Hierarchy::V2("/x".into());
        assert_eq!(
            v2.settings(Some(4096)),
            vec![
                ("memory.swap.max", "max".into()),
                ("memory.max", "4096".into())
            ]
        );
        assert_eq!(v2.settings(None)[1], ("memory.max", "max".into()));
    }

    #[test]
    fn create_writes_the_settings_into_the_new_group() {
        let root = tree(&[("memory/memory.limit_in_bytes", "0")]);
        let h = Hierarchy::detect(root.path()).unwrap();
        let g = Cgroup::create(&h, "uswap-kernel-1", Some(1 << 20)).unwrap();
        let read = |f: &str| fs::read_to_string(g.path().join(f)).unwrap();
        assert_eq!(read("memory.limit_in_bytes"), "1048576");
        g.set_limit(None).unwrap();
        assert_eq!(read("memory.limit_in_bytes"), "-1");
        g.add_process(1234).unwrap();
        assert_eq!(read("cgroup.procs"), "1234");
        fs::write(g.path().join("memory.max_usage_in_bytes"), "8192\n").unwrap();
        assert_eq!(g.peak().unwrap(), 8192);
        fs::write(g.path().join("memory.stat"), "cache 4096\npgmajfault 3\n").unwrap();
        let stat = g.stat().unwrap();
        assert_eq!((stat["cache"], stat["pgmajfault"]), (4096, 3));
        assert!(
            Cgroup::create(&h, "uswap-kernel-1", None).is_err(),
            "an existing group is not reused"
        );
    }

    /// A shell running `cmd`, put in a stand-in group (`tree`) that forgets it once it has
    /// exited, as the kernel's does, once it has printed a line; joins with how it ended.
    fn member(g: &Cgroup, cmd: &str) -> thread::JoinHandle<std::process::ExitStatus> {
        use std::io::BufRead;
        let mut child = std::process::Command::new("sh")
            .args(["-c", cmd])
            .stdout(std::process::Stdio::piped())
            .spawn()
            .unwrap();
        let mut ready = String::new();
        io::BufReader::new(child.stdout.take().unwrap())
            .read_line(&mut ready)
            .unwrap();
        g.add_process(child.id()).unwrap();
        let procs = g.path().join("cgroup.procs");
        thread::spawn(move || {
            let status = child.wait().unwrap();
            fs::write(procs, "").unwrap();
            status
        })
    }

    #[test]
    fn kill_all_ends_what_the_command_left_in_the_group_and_waits_for_it() {
        use std::os::unix::process::ExitStatusExt;
        let root = tree(&[("memory/memory.limit_in_bytes", "0")]);
        let h = Hierarchy::detect(root.path()).unwrap();
        let g = Cgroup::create(&h, "uswap-kernel-2", None).unwrap();
        fs::write(g.path().join("cgroup.procs"), "").unwrap();
        let (grace, within) = (Duration::from_millis(300), Duration::from_secs(10));
        assert_eq!(g.kill_all(grace, within).unwrap(), 0);
        // SIGTERM is enough for a process that does not ignore it.
        let left = member(&g, "echo ready; exec sleep 60");
        assert_eq!(g.kill_all(grace, within).unwrap(), 1);
        assert_eq!(left.join().unwrap().signal(), Some(libc::SIGTERM));
        // One that ignores it gets SIGKILL after the grace period.
        let stubborn = member(&g, "trap '' TERM; echo ready; exec sleep 60");
        let begun = std::time::Instant::now();
        assert_eq!(g.kill_all(grace, within).unwrap(), 1);
        assert_eq!(stubborn.join().unwrap().signal(), Some(libc::SIGKILL));
        assert!(begun.elapsed() >= grace);
    }

    #[test]
    fn kill_all_says_which_processes_stay_past_its_time() {
        let root = tree(&[("memory/memory.limit_in_bytes", "0")]);
        let h = Hierarchy::detect(root.path()).unwrap();
        let g = Cgroup::create(&h, "uswap-kernel-3", None).unwrap();
        // A pid above the kernel's largest (no process: never signalled) and the 0 of a
        // process outside this pid namespace (never signalled: kill(0) is the caller's
        // own process group).
        fs::write(g.path().join("cgroup.procs"), "0\n99999999\n").unwrap();
        let e = g
            .kill_all(Duration::ZERO, Duration::from_millis(100))
            .unwrap_err();
        assert_eq!(e.kind(), io::ErrorKind::TimedOut);
        assert!(e.to_string().contains("[99999999]"), "{e}");
    }
}
