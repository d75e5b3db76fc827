//! A memory cgroup for the kernel-backend child: v1 or v2, whichever has the memory
//! controller on this machine; its limit, and what it saw.

use anyhow::{bail, Context, Result};
use std::collections::BTreeMap;
use std::fs;
use std::io;
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

    /// Kills every process still in the group (a daemon the command left behind, or a
    /// process still exiting) and waits, up to `within`, until none is left. Returns how
    /// many it killed.
    pub fn kill_all(&self, within: Duration) -> io::Result<usize> {
        let deadline = std::time::Instant::now() + within;
        let mut killed = std::collections::BTreeSet::new();
        loop {
            let procs = match fs::read_to_string(self.path.join("cgroup.procs")) {
                Err(e) if e.kind() == io::ErrorKind::NotFound => return Ok(killed.len()),
                other => other?,
            };
            let pids: Vec<i32> = procs
                .lines()
                .filter_map(|l| l.trim().parse().ok())
                .collect();
            if pids.is_empty() {
                return Ok(killed.len());
            }
            if std::time::Instant::now() >= deadline {
                return Err(io::Error::new(
                    io::ErrorKind::TimedOut,
                    format!("processes {pids:?} are still in the group"),
                ));
            }
            for pid in pids {
                // SAFETY: a plain system call; a pid that exited meanwhile gets ESRCH.
                if unsafe { libc::kill(pid, libc::SIGKILL) } == 0 {
                    killed.insert(pid);
                }
            }
            thread::sleep(Duration::from_millis(20));
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

    #[test]
    fn kill_all_kills_what_the_command_left_in_the_group_and_waits_for_it() {
        use std::os::unix::process::ExitStatusExt;
        let root = tree(&[("memory/memory.limit_in_bytes", "0")]);
        let h = Hierarchy::detect(root.path()).unwrap();
        let g = Cgroup::create(&h, "uswap-kernel-2", None).unwrap();
        fs::write(g.path().join("cgroup.procs"), "").unwrap();
        assert_eq!(g.kill_all(Duration::from_secs(1)).unwrap(), 0);
        let mut left = std::process::Command::new("sleep")
            .arg("60")
            .spawn()
            .unwrap();
        g.add_process(left.id()).unwrap();
        // This stand-in group forgets a process once it has exited, as the kernel's does.
        let procs = g.path().join("cgroup.procs");
        let reaper = thread::spawn(move || {
            let status = left.wait().unwrap();
            fs::write(procs, "").unwrap();
            status
        });
        assert_eq!(g.kill_all(Duration::from_secs(10)).unwrap(), 1);
        assert_eq!(reaper.join().unwrap().signal(), Some(libc::SIGKILL));
    }

    #[test]
    fn kill_all_says_which_processes_stay_past_its_time() {
        let root = tree(&[("memory/memory.limit_in_bytes", "0")]);
        let h = Hierarchy::detect(root.path()).unwrap();
        let g = Cgroup::create(&h, "uswap-kernel-3", None).unwrap();
        // A pid above the kernel's largest: kill finds no such process, the group keeps it.
        fs::write(g.path().join("cgroup.procs"), "99999999\n").unwrap();
        let e = g.kill_all(Duration::from_millis(100)).unwrap_err();
        assert_eq!(e.kind(), io::ErrorKind::TimedOut);
        assert!(e.to_string().contains("99999999"), "{e}");
    }
}
