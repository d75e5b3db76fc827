//! The memory cgroup of a process tree: one limit that every region of the tree charges
//! against, as a cgroup's `memory.max` covers all its processes (`uswap run`, whose
//! programs and the programs they `exec` all draw from the limit given on its command
//! line). A region made on its own (the library API) gets a private group of one.
//!
//! A shared group lives in a small file `uswap run` makes in the swap directory, which every
//! member maps by name (named, because programs that close every descriptor before they
//! exec would cut an inherited one). Each region charges a member slot of its own, so its
//! own usage stays exact, and the tree's usage is the sum of the slots: a charge counts the
//! others and then moves only its own counter, so two members racing for the last pages may
//! overshoot by what they asked for at once (a stock's batch at most), as per-CPU charge
//! stocks let a memcg overshoot. A member that dies without leaving (killed) still holds
//! its pages' worth in its slot; when the group runs short, slots whose process is gone are
//! reaped. A process that `exec`s keeps its pid: the program it becomes frees the slots of
//! its previous image when it starts (`forget_previous_image`).

use crate::sync::{AtomicU32, AtomicU64};
use std::sync::atomic::Ordering::{AcqRel, Acquire, Relaxed, Release};

/// Member slots of a group: processes of one tree using uswap at once (a process that
/// holds only its start-up allowance takes one too).
#[cfg(not(loom))]
pub const MEMBERS: usize = 256;
#[cfg(loom)]
pub const MEMBERS: usize = 2;

/// A member slot's pid while a reaper clears it: neither free nor anyone's.
const REAPING: u32 = u32::MAX;

/// The group's state, laid out the same in every member's mapping.
#[repr(C)]
struct Group {
    /// The limit, in pages.
    limit: AtomicU64,
    /// Slots ever used (a bound for the sums).
    used: AtomicU32,
    members: [Member; MEMBERS],
}

#[repr(C)]
struct Member {
    /// The member's process id; 0 for a free slot.
    pid: AtomicU32,
    /// Pages the member has charged.
    charged: AtomicU64,
}

enum Backing {
    Private(Box<Group>),
    /// Mapped from the file at the path, shared with the other members.
    #[cfg(not(loom))]
    Shared(*const Group, std::path::PathBuf),
}

/// A memory cgroup: a limit and the members charging against it.
pub struct MemCgroup {
    backing: Backing,
}

// SAFETY: the shared mapping holds only atomics and lives as long as the group.
unsafe impl Send for MemCgroup {}
unsafe impl Sync for MemCgroup {}

impl std::fmt::Debug for MemCgroup {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(
            f,
            "MemCgroup(limit {} pages, usage {} pages)",
            self.limit(),
            self.usage()
        )
    }
}

fn new_group(limit: u64) -> Group {
    Group {
        limit: AtomicU64::new(limit),
        used: AtomicU32::new(0),
        members: std::array::from_fn(|_| Member {
            pid: AtomicU32::new(0),
            charged: AtomicU64::new(0),
        }),
    }
}

impl MemCgroup {
    /// A group of one region, with a limit of `limit` pages.
    pub fn private(limit: u64) -> MemCgroup {
        MemCgroup {
            backing: Backing::Private(Box::new(new_group(limit))),
        }
    }

    fn group(&self) -> &Group {
        match &self.backing {
            Backing::Private(g) => g,
            // SAFETY: mapped for as long as self lives.
            #[cfg(not(loom))]
            Backing::Shared(g, _) => unsafe { &**g },
        }
    }

    pub fn is_shared(&self) -> bool {
        !matches!(self.backing, Backing::Private(_))
    }

    pub fn limit(&self) -> u64 {
        self.group().limit.load(Relaxed)
    }

    pub fn set_limit(&self, pages: u64) {
        self.group().limit.store(pages, Relaxed);
    }

    /// Pages charged by every member.
    pub fn usage(&self) -> u64 {
        self.others(usize::MAX)
    }

    /// Pages charged by every member but `slot`.
    pub fn others(&self, slot: usize) -> u64 {
        let g = self.group();
        let used = (g.used.load(Acquire) as usize).min(MEMBERS);
        (0..used)
            .filter(|&i| i != slot)
            .map(|i| g.members[i].charged.load(Relaxed))
            .sum()
    }

    /// The counter of member `slot`.
    pub fn charged(&self, slot: usize) -> &AtomicU64 {
        &self.group().members[slot].charged
    }

    /// Takes a free member slot for a region of this process, reaping the slots of dead
    /// members if none is free. `None` when all are taken.
    pub fn join(&self) -> Option<usize> {
        let g = self.group();
        let pid = std::process::id();
        for round in 0..2 {
            for (i, m) in g.members.iter().enumerate() {
                if m.pid.compare_exchange(0, pid, AcqRel, Relaxed).is_ok() {
                    m.charged.store(0, Relaxed);
                    g.used.fetch_max(i as u32 + 1, Release);
                    return Some(i);
                }
            }
            if round == 0 && !self.reap_dead() {
                break;
            }
        }
        None
    }

    /// Takes a member slot charged with `pages` for this process (`uswap run`'s program
    /// before its region is built charges what it commits), if they fit under the limit.
    /// `None` when no slot is free or they do not fit.
    pub fn join_holding(&self, pages: u64) -> Option<usize> {
        let slot = self.join()?;
        if self.set_charge(slot, pages) {
            return Some(slot);
        }
        self.leave(slot);
        None
    }

    /// Makes member `slot`'s charge `pages`, if that fits under the limit (reaping dead
    /// members' slots when it does not); false, with the charge unchanged, when it does
    /// not fit.
    pub fn set_charge(&self, slot: usize, pages: u64) -> bool {
        for round in 0..2 {
            if self.others(slot) + pages <= self.limit() {
                self.charged(slot).store(pages, Relaxed);
                return true;
            }
            if round == 0 && !self.reap_dead() {
                break;
            }
        }
        false
    }

    /// Frees the slots this process id holds: a process that `exec`ed keeps its pid, and
    /// what its previous program charged went with that program's memory. Called once
    /// when a program starts, before its region joins.
    pub fn forget_previous_image(&self) {
        let pid = std::process::id();
        for m in &self.group().members {
            if m.pid.load(Acquire) == pid {
                m.charged.store(0, Relaxed);
                m.pid.store(0, Release);
            }
        }
    }

    /// Gives member `slot` up with what it charged (its region is gone).
    pub fn leave(&self, slot: usize) {
        let m = &self.group().members[slot];
        m.charged.store(0, Relaxed);
        m.pid.store(0, Release);
    }

    /// Takes a member slot for process `pid` holding `pages`, as another process's region
    /// would (for tests of what reads the group).
    #[cfg(test)]
    pub(crate) fn join_as(&self, pid: u32, pages: u64) -> usize {
        let slot = self.join().expect("a free member slot");
        self.group().members[slot].pid.store(pid, Relaxed);
        self.charged(slot).store(pages, Relaxed);
        slot
    }

    /// Whether member `slot` is free.
    #[cfg(all(test, not(loom)))]
    pub(crate) fn is_free(&self, slot: usize) -> bool {
        self.group().members[slot].pid.load(Relaxed) == 0
    }

    /// Frees the slots of members whose process is gone; true if there were any. A slot
    /// is claimed for reaping first, so that two reapers that found the same dead member
    /// cannot clear the charges of a process that joined the slot in between.
    pub fn reap_dead(&self) -> bool {
        let mut reaped = false;
        for m in &self.group().members {
            let pid = m.pid.load(Acquire);
            if pid == 0 || pid == REAPING || process_alive(pid) {
                continue;
            }
            if m.pid
                .compare_exchange(pid, REAPING, AcqRel, Relaxed)
                .is_ok()
            {
                m.charged.store(0, Relaxed);
                m.pid.store(0, Release);
                reaped = true;
            }
        }
        reaped
    }
}

#[cfg(not(loom))]
fn process_alive(pid: u32) -> bool {
    // Not a process id (a free slot, or `REAPING`): kill would take it for a group.
    if pid == 0 || pid > i32::MAX as u32 {
        return false;
    }
    // SAFETY: signal 0 only checks that the process exists.
    let alive = unsafe { libc::kill(pid as libc::pid_t, 0) } == 0;
    alive || std::io::Error::last_os_error().raw_os_error() != Some(libc::ESRCH)
}

/// The one process id the loom model takes for a process that is gone.
#[cfg(loom)]
const LOOM_DEAD: u32 = 1 << 30;

#[cfg(loom)]
fn process_alive(pid: u32) -> bool {
    pid != LOOM_DEAD
}

#[cfg(not(loom))]
mod shared {
    use super::*;
    use crate::error::{Error, Result};
    use std::ffi::CString;
    use std::os::unix::ffi::OsStrExt;
    use std::os::unix::fs::MetadataExt;
    use std::path::{Path, PathBuf};

    const SIZE: usize = std::mem::size_of::<Group>();

    fn c_path(path: &Path) -> Result<CString> {
        CString::new(path.as_os_str().as_bytes())
            .map_err(|_| Error::invalid("memory cgroup file", "a path with a NUL byte"))
    }

    /// Maps the group file open at `fd` (closed after).
    fn map(fd: libc::c_int) -> Result<*const Group> {
        let prot = libc::PROT_READ | libc::PROT_WRITE;
        // SAFETY: mapping a file of at least SIZE bytes, shared; the mapping outlives fd.
        let p = unsafe { libc::mmap(std::ptr::null_mut(), SIZE, prot, libc::MAP_SHARED, fd, 0) };
        // SAFETY: closing our own descriptor.
        unsafe { libc::close(fd) };
        if p == libc::MAP_FAILED {
            return Err(Error::os("mmap of the tree's memory cgroup"));
        }
        Ok(p as *const Group)
    }

    impl MemCgroup {
        /// A new group for a process tree, with a limit of `limit` pages, in a new file
        /// (mode 0600) in `dir` that its processes open by name: a descriptor would not
        /// survive the programs that close every descriptor before they exec. The file
        /// goes when the last member leaves (see [`MemCgroup::last_one_out`]).
        pub fn create_shared(limit: u64, dir: &Path) -> Result<(MemCgroup, PathBuf)> {
            reap_leftovers(dir);
            let (fd, path) = create_unpredictable(dir)?;
            // SAFETY: sizing our own new file.
            if unsafe { libc::ftruncate(fd, SIZE as libc::off_t) } != 0 {
                let e = Error::os("ftruncate");
                // SAFETY: closing our own descriptor.
                unsafe { libc::close(fd) };
                let _ = std::fs::remove_file(&path);
                return Err(e);
            }
            let group = map(fd)?;
            // SAFETY: the new file reads as zeros: every member free, usage 0.
            unsafe { (*group).limit.store(limit, Relaxed) };
            let cg = MemCgroup {
                backing: Backing::Shared(group, path.clone()),
            };
            Ok((cg, path))
        }

        /// The group in the file at `path`, which must be this user's own.
        pub fn open_shared(path: &Path) -> Result<MemCgroup> {
            // Non-blocking: a lease another user holds on the file fails the open at once.
            let flags = libc::O_RDWR | libc::O_NOFOLLOW | libc::O_CLOEXEC | libc::O_NONBLOCK;
            // SAFETY: a NUL-terminated path.
            let fd = unsafe { libc::open(c_path(path)?.as_ptr(), flags) };
            if fd < 0 {
                return Err(Error::os("opening the tree's memory cgroup file"));
            }
            // SAFETY: fstat of our descriptor into a zeroed stat.
            let mut st: libc::stat = unsafe { std::mem::zeroed() };
            let ok = unsafe { libc::fstat(fd, &mut st) } == 0
                && st.st_size as usize == SIZE
                // SAFETY: geteuid has no preconditions.
                && st.st_uid == unsafe { libc::geteuid() };
            if !ok {
                // SAFETY: closing our own descriptor.
                unsafe { libc::close(fd) };
                return Err(Error::invalid(
                    "tree memory cgroup",
                    format!(
                        "{} is not a memory cgroup file of this user",
                        path.display()
                    ),
                ));
            }
            Ok(MemCgroup {
                backing: Backing::Shared(map(fd)?, path.to_path_buf()),
            })
        }

        /// Removes the group's file if no other member is alive: called by a process of
        /// the tree on its way out (its own slot is reaped later, or never needed again).
        pub fn last_one_out(&self) {
            let Backing::Shared(_, path) = &self.backing else {
                return;
            };
            let me = std::process::id();
            let others = self.group().members.iter().any(|m| {
                let pid = m.pid.load(Acquire);
                pid != 0 && pid != me && process_alive(pid)
            });
            if !others {
                let _ = std::fs::remove_file(path);
            }
        }
    }

    /// Group files are named this, the PID of the `uswap run` that made them and a random
    /// part: `uswap-memcg-PID-RANDOM`.
    const FILE_PREFIX: &str = "uswap-memcg-";

    /// Creates a new group file in `dir`, mode 0600, under a name no other user can guess:
    /// the directory is often a shared one (`/var/tmp`), where a predictable name could be
    /// taken first and refuse the run. A name that exists all the same is drawn again.
    fn create_unpredictable(dir: &Path) -> Result<(libc::c_int, PathBuf)> {
        const TRIES: usize = 8;
        let flags =
            libc::O_RDWR | libc::O_CREAT | libc::O_EXCL | libc::O_NOFOLLOW | libc::O_CLOEXEC;
        let mut last = None;
        for _ in 0..TRIES {
            let mut random = [0u8; 8];
            getrandom::fill(&mut random).map_err(|e| {
                Error::invalid("tree memory cgroup", format!("no random name: {e}"))
            })?;
            let name = format!(
                "{FILE_PREFIX}{}-{:016x}",
                std::process::id(),
                u64::from_ne_bytes(random)
            );
            let path = dir.join(name);
            // SAFETY: a NUL-terminated path; a new file only (O_EXCL).
            let fd = unsafe { libc::open(c_path(&path)?.as_ptr(), flags, 0o600) };
            if fd >= 0 {
                return Ok((fd, path));
            }
            let e = std::io::Error::last_os_error();
            if e.kind() != std::io::ErrorKind::AlreadyExists {
                return Err(Error::Os {
                    op: "creating the tree's memory cgroup file",
                    source: std::io::Error::new(e.kind(), format!("{}: {e}", path.display())),
                });
            }
            last = Some(path);
        }
        Err(Error::invalid(
            "tree memory cgroup",
            format!(
                "{TRIES} random names in {} were taken (the last {}): something creates files \
                 there as fast as they are named; use a swap directory of your own \
                 (--swap-dir)",
                dir.display(),
                last.map(|p| p.display().to_string()).unwrap_or_default()
            ),
        ))
    }

    /// The PID of the process that made the group file `name`, if it is one.
    fn file_maker(name: &str) -> Option<u32> {
        let rest = name.strip_prefix(FILE_PREFIX)?;
        rest.split_once('-')
            .map_or(rest, |(pid, _)| pid)
            .parse()
            .ok()
    }

    /// Removes this user's group files in `dir` that no live process uses: a tree whose
    /// last process was killed, or left without running its exit handlers (Go's and node's
    /// `exit` end the process directly), leaves its file behind. A file is kept while the
    /// process that made it lives (its members may not have joined yet) or any member does;
    /// one named after this process is a dead process's whose PID came round again.
    fn reap_leftovers(dir: &Path) {
        let Ok(entries) = std::fs::read_dir(dir) else {
            return;
        };
        let me = std::process::id();
        for entry in entries.flatten() {
            let name = entry.file_name();
            let Some(maker) = name.to_str().and_then(file_maker) else {
                continue;
            };
            if maker != me && process_alive(maker) {
                continue;
            }
            // Only this user's group files (open_shared checks owner and size, and does
            // not wait on a lease another user holds).
            let path = entry.path();
            let Ok(seen) = std::fs::symlink_metadata(&path) else {
                continue;
            };
            let Ok(cg) = MemCgroup::open_shared(&path) else {
                continue;
            };
            let alive = cg.group().members.iter().any(|m| {
                let pid = m.pid.load(Acquire);
                pid != 0 && pid != me && process_alive(pid)
            });
            // A new tree may have made the file again meanwhile (its maker got the PID).
            let same = std::fs::symlink_metadata(&path).is_ok_and(|now| now.ino() == seen.ino());
            let maker_back = maker != me && process_alive(maker);
            if !alive && same && !maker_back {
                let _ = std::fs::remove_file(&path);
            }
        }
    }

    impl Drop for MemCgroup {
        fn drop(&mut self) {
            if let Backing::Shared(g, _) = &self.backing {
                // SAFETY: unmapping our mapping of the group.
                unsafe { libc::munmap(*g as *mut _, SIZE) };
            }
        }
    }
}

#[cfg(all(test, not(loom)))]
mod tests {
    use super::*;

    /// A charge set outright (a program before its region is built) fits under the limit
    /// beside the others or is refused unchanged; a dead member's pages are reaped for it.
    #[test]
    fn a_set_charge_fits_under_the_limit_or_changes_nothing() {
        let dir = tempfile::tempdir().unwrap();
        let (cg, _) = MemCgroup::create_shared(10, dir.path()).unwrap();
        let other = cg.join_holding(4).expect("4 of 10 pages fit");
        let slot = cg.join_holding(6).expect("6 more fit");
        assert!(cg.join_holding(1).is_none(), "a full group takes no more");
        assert!(!cg.set_charge(slot, 7), "7 beside 4 pass 10");
        assert_eq!(
            cg.charged(slot).load(Relaxed),
            6,
            "a refused charge changes nothing"
        );
        assert!(cg.set_charge(slot, 2));
        assert_eq!(cg.usage(), 6);
        let mut child = std::process::Command::new("true").spawn().unwrap();
        let dead = child.id();
        child.wait().unwrap();
        cg.group().members[other].pid.store(dead, Relaxed);
        assert!(
            cg.set_charge(slot, 10),
            "the dead member's 4 pages were reaped"
        );
        assert!(cg.is_free(other));
    }

    #[test]
    fn the_last_process_out_removes_the_file_and_others_keep_it() {
        let dir = tempfile::tempdir().unwrap();
        let (cg, path) = MemCgroup::create_shared(10, dir.path()).unwrap();
        let slot = cg.join().unwrap();
        let mut child = std::process::Command::new("sleep")
            .arg("5")
            .spawn()
            .unwrap();
        let other = cg.join().unwrap();
        cg.group().members[other].pid.store(child.id(), Relaxed);
        cg.last_one_out();
        assert!(path.exists(), "another member is alive");
        child.kill().unwrap();
        child.wait().unwrap();
        cg.last_one_out();
        assert!(!path.exists(), "the last one out removes the file");
        cg.leave(slot);
    }

    /// A group file left by a tree that died without its exit handlers is removed by the
    /// next tree made in the directory; one whose maker lives stays.
    #[test]
    fn a_dead_trees_file_is_removed_by_the_next_one() {
        let dir = tempfile::tempdir().unwrap();
        let name = |pid: u32| {
            dir.path()
                .join(format!("uswap-memcg-{pid}-00000000deadbeef"))
        };
        let mut child = std::process::Command::new("true").spawn().unwrap();
        let dead = child.id();
        child.wait().unwrap();
        // Files of both name forms: `uswap-memcg-PID` is what earlier versions made.
        let older = dir.path().join(format!("uswap-memcg-{dead}"));
        for dead_file in [name(dead), older.clone()] {
            let (cg, path) = MemCgroup::create_shared(100, dir.path()).unwrap();
            drop(cg);
            std::fs::rename(&path, dead_file).unwrap();
        }
        let (cg, path) = MemCgroup::create_shared(100, dir.path()).unwrap();
        drop(cg);
        // Made by a live process (init): kept.
        std::fs::rename(&path, name(1)).unwrap();
        let (_ours, ours) = MemCgroup::create_shared(100, dir.path()).unwrap();
        assert!(!name(dead).exists(), "the dead tree's file is gone");
        assert!(
            !older.exists(),
            "the dead tree's file of the older name is gone"
        );
        assert!(name(1).exists() && ours.exists());
    }

    /// Names in a shared directory cannot be taken first: another user who creates
    /// `uswap-memcg-PID` (or any name a PID predicts) refuses nothing, and two trees made by
    /// one process get two files.
    #[test]
    fn a_group_files_name_cannot_be_guessed_and_taken_first() {
        let dir = tempfile::tempdir().unwrap();
        let me = std::process::id();
        let squatted = dir.path().join(format!("uswap-memcg-{me}"));
        std::fs::write(&squatted, b"taken").unwrap();
        let (_a, a) = MemCgroup::create_shared(10, dir.path()).unwrap();
        let (_b, b) = MemCgroup::create_shared(10, dir.path()).unwrap();
        assert_ne!(a, b);
        for path in [&a, &b] {
            let name = path.file_name().unwrap().to_str().unwrap();
            let random = name.strip_prefix(&format!("uswap-memcg-{me}-"));
            assert!(random.is_some_and(|r| r.len() == 16), "{name}");
        }
        assert_eq!(std::fs::read(&squatted).unwrap(), b"taken", "not touched");
    }

    #[test]
    fn a_file_of_the_wrong_size_or_owner_is_refused() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("not-a-group");
        std::fs::write(&path, b"short").unwrap();
        let err = MemCgroup::open_shared(&path).unwrap_err();
        assert!(
            err.to_string().contains("not a memory cgroup file"),
            "{err}"
        );
        assert!(MemCgroup::open_shared(&dir.path().join("missing")).is_err());
    }
}

/// Model check of reaping: `RUSTFLAGS="--cfg loom" cargo test -p uswap-core --lib --release memcg::loom`.
#[cfg(all(test, loom))]
mod loom_tests {
    use super::*;
    use loom::sync::Arc;

    /// Two reapers find the same dead member, one of them a new process that then joins
    /// its slot: its charges survive the other reaper, which looked before it joined.
    #[test]
    fn a_slot_reaped_twice_keeps_the_charges_of_whoever_joined_it_between() {
        loom::model(|| {
            let cg = Arc::new(MemCgroup::private(10));
            let dead = cg.join_as(LOOM_DEAD, 5);
            // The other slot is taken: the newcomer finds no free slot, reaps, and can
            // only have the dead one's.
            cg.join_as(std::process::id(), 0);
            let reaper = {
                let cg = cg.clone();
                loom::thread::spawn(move || {
                    cg.reap_dead();
                })
            };
            let newcomer = {
                let cg = cg.clone();
                loom::thread::spawn(move || {
                    let slot = cg.join()?;
                    cg.charged(slot).fetch_add(3, Relaxed);
                    Some(slot)
                })
            };
            reaper.join().unwrap();
            if let Some(slot) = newcomer.join().unwrap() {
                assert_eq!(slot, dead);
                assert_eq!(cg.usage(), 3, "the newcomer's charges are all there");
            }
        });
    }
}
