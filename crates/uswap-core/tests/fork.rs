//! fork without exec: a child gets its parent's region memory as it was at the fork,
//! swapped, inactive and resident pages alike, and the two go their own ways after.

mod common;

use common::{check, fill};
use std::io::Write;
use std::sync::atomic::{AtomicBool, Ordering::Relaxed};
use std::sync::Arc;
use uswap_core::{
    Advice, Config, FaultMode, LruPolicy, Readahead, ReadaheadPolicy, References, Region, PAGE_SIZE,
};

const MIB: usize = 1 << 20;

/// One test at a time: a fork copies or lends every region of the process, so a test's
/// counts would include other tests' forks.
fn serial() -> std::sync::MutexGuard<'static, ()> {
    static SERIAL: std::sync::Mutex<()> = std::sync::Mutex::new(());
    SERIAL.lock().unwrap_or_else(|e| e.into_inner())
}

/// Forks; the child runs `child` and exits with its result (0 for Ok, else 1 after
/// printing the error); the parent waits and returns the child's wait status.
fn in_child(child: impl FnOnce() -> Result<(), String>) -> i32 {
    // SAFETY: the child runs `child` and `_exit`s; it never returns into the test harness.
    let pid = unsafe { libc::fork() };
    assert!(pid >= 0, "fork: {}", std::io::Error::last_os_error());
    if pid == 0 {
        let code = match std::panic::catch_unwind(std::panic::AssertUnwindSafe(child)) {
            Ok(Ok(())) => 0,
            Ok(Err(e)) => {
                // Straight to the descriptor: `eprintln!` would go to the harness's
                // capture buffer, which the child's `_exit` throws away.
                let _ = writeln!(std::io::stderr(), "child: {e}");
                1
            }
            Err(_) => 2,
        };
        // SAFETY: ends the child without running the harness's exit handlers.
        unsafe { libc::_exit(code) };
    }
    // A child that hangs fails the test instead of hanging it.
    let deadline = std::time::Instant::now() + std::time::Duration::from_secs(120);
    let mut status = 0;
    while unsafe { libc::waitpid(pid, &mut status, libc::WNOHANG) } == 0 {
        if std::time::Instant::now() > deadline {
            unsafe { libc::kill(pid, libc::SIGKILL) };
            unsafe { libc::waitpid(pid, &mut status, 0) };
            panic!("the child {pid} hung");
        }
        std::thread::sleep(std::time::Duration::from_millis(10));
    }
    status
}

fn exited_ok(status: i32) -> bool {
    libc::WIFEXITED(status) && libc::WEXITSTATUS(status) == 0
}

/// Pages of `region` in versions by page: `versions[p]` is what page `p` holds (0: zeros).
fn check_all(region: &Region, versions: &[u32]) -> Result<(), String> {
    for (page, &v) in versions.iter().enumerate() {
        if v == 0 {
            let p = unsafe { region.as_ptr().add(page * PAGE_SIZE) } as *const u64;
            if (0..PAGE_SIZE / 8).any(|i| unsafe { p.add(i).read_volatile() } != 0) {
                return Err(format!("page {page} should read as zeros"));
            }
        } else {
            unsafe { check(region.as_ptr(), page, v) }?;
        }
    }
    Ok(())
}

/// A region with every kind of page: swapped (paged out), inactive (cold), resident,
/// discarded, lazily freed and written again, and untouched.
fn mixed_region(mode: FaultMode) -> (Region, Vec<u32>) {
    mixed_region_with(|cfg| cfg.fault_mode = mode)
}

/// [`mixed_region`] in thread mode, with `change` made to its configuration.
fn mixed_region_with(change: impl FnOnce(&mut Config)) -> (Region, Vec<u32>) {
    let mut cfg = Config::new(2 * MIB as u64);
    change(&mut cfg);
    let region = Region::new(8 * MIB as u64, cfg).unwrap();
    let pages = region.len() / PAGE_SIZE;
    let mut versions = vec![0u32; pages];
    // Three quarters written: more than the limit, so much of it is swapped already.
    for (page, v) in versions.iter_mut().enumerate().take(pages * 3 / 4) {
        *v = 1;
        unsafe { fill(region.as_ptr(), page, 1) };
    }
    region.advise(0, 64 * PAGE_SIZE, Advice::PageOut).unwrap();
    region
        .advise(64 * PAGE_SIZE, 64 * PAGE_SIZE, Advice::Cold)
        .unwrap();
    let base = region.as_ptr();
    unsafe {
        libc::madvise(
            base.add(200 * PAGE_SIZE).cast(),
            16 * PAGE_SIZE,
            libc::MADV_DONTNEED,
        );
        libc::madvise(
            base.add(300 * PAGE_SIZE).cast(),
            16 * PAGE_SIZE,
            libc::MADV_FREE,
        );
    }
    versions[200..216].fill(0);
    for (page, v) in versions.iter_mut().enumerate().take(308).skip(300) {
        unsafe { fill(base, page, 2) };
        *v = 2;
    }
    // 308..316: MADV_FREE'd and not written again: old data or zeros, both allowed.
    for page in (pages - 64..pages).step_by(3) {
        unsafe { fill(base, page, 3) };
        versions[page] = 3;
    }
    (region, versions)
}

/// The pages whose contents are not fixed (lazily freed, not written since).
fn settled(mut versions: Vec<u32>, region: &Region) -> Vec<u32> {
    // Give the lazily freed pages a definite value before comparing.
    for (page, v) in versions.iter_mut().enumerate().take(316).skip(308) {
        unsafe { fill(region.as_ptr(), page, 4) };
        *v = 4;
    }
    versions
}

/// A 4 MiB region with a 1 MiB limit, every page written (version 1); and its pages.
fn filled_region() -> (Region, usize) {
    let region = Region::new(4 * MIB as u64, Config::new(MIB as u64)).unwrap();
    let pages = region.len() / PAGE_SIZE;
    for page in 0..pages {
        unsafe { fill(region.as_ptr(), page, 1) };
    }
    (region, pages)
}

/// In a fork child of a [`mixed_region`]: writes `version` to every page (twice the limit),
/// reads every page back, and checks the invariants and that no more than the limit (and
/// a little) stayed resident.
fn rewrite_within_limit(region: &Region, version: u32) -> Result<(), String> {
    let pages = region.len() / PAGE_SIZE;
    for page in 0..pages {
        unsafe { fill(region.as_ptr(), page, version) };
    }
    for page in 0..pages {
        unsafe { check(region.as_ptr(), page, version) }?;
    }
    region.check_invariants()?;
    let resident = region.stats().resident_pages;
    if resident * PAGE_SIZE as u64 > 2 * MIB as u64 + 64 * PAGE_SIZE as u64 {
        return Err(format!(
            "the child keeps {resident} pages resident, over its limit"
        ));
    }
    Ok(())
}

#[test]
fn a_child_gets_the_memory_as_it_was_and_each_goes_its_own_way() {
    let _serial = serial();
    child_gets_the_memory_as_it_was(FaultMode::Thread);
}

#[test]
fn a_sigbus_mode_child_gets_the_memory_as_it_was_and_each_goes_its_own_way() {
    let _serial = serial();
    child_gets_the_memory_as_it_was(FaultMode::Sigbus);
}

fn child_gets_the_memory_as_it_was(mode: FaultMode) {
    let (region, versions) = mixed_region(mode);
    let versions = settled(versions, &region);
    let before = region.stats();
    assert!(before.swap_used_pages > 0, "some pages are out on swap");
    let status = in_child(|| {
        // What was mapped is shared, not copied: not charged here, and write-protected
        // (the walker checks that) so the child's first write to each is seen.
        let shared = region.stats();
        if shared.vmstat.fork_shared == 0 || shared.shared_pages != shared.vmstat.fork_shared {
            return Err(format!(
                "{} pages shared at the fork, {} shared now",
                shared.vmstat.fork_shared, shared.shared_pages
            ));
        }
        // What was not mapped is borrowed, not copied: the 64 pages paged out (their
        // slots) and the 64 made cold (their staging frames) at least.
        if shared.borrowed_pages < 128 {
            return Err(format!("{} pages borrowed", shared.borrowed_pages));
        }
        region.check_invariants()?;
        check_all(&region, &versions)?;
        // The child's writes go to its own memory and swap: twice its limit.
        rewrite_within_limit(&region, 7)?;
        // A page read from a lent slot stays borrowed until it is written.
        if region.stats().borrowed_pages != 0 {
            return Err("pages still borrowed after every page was written".into());
        }
        let stats = region.stats();
        if stats.shared_pages != 0 || stats.vmstat.cow_break == 0 {
            return Err(format!(
                "after writing every page the child still shares {} ({} copy-on-write \
                 breaks)",
                stats.shared_pages, stats.vmstat.cow_break
            ));
        }
        Ok(())
    });
    assert!(exited_ok(status), "child status {status:#x}");
    let copied = region.stats().vmstat.fork_copied - before.vmstat.fork_copied;
    assert_eq!(copied, 0, "pages copied at the fork");
    // The parent's memory is as it was, whatever the child wrote.
    check_all(&region, &versions).unwrap();
    region.check_invariants().unwrap();
}

/// With written bits, write protection serves aging alone, so no page is shared: a child
/// makes what was mapped at the fork its own (charged here), and still gets the memory
/// as it was; each goes its own way, within its limit.
#[test]
fn a_child_of_a_region_with_written_bits_gets_the_memory_as_it_was() {
    let _serial = serial();
    let (region, versions) = mixed_region_with(|cfg| cfg.references = References::Written);
    let versions = settled(versions, &region);
    let status = in_child(|| {
        if region.references() != References::Written {
            return Err("the child's region was rebuilt without written bits".into());
        }
        let stats = region.stats();
        if stats.shared_pages != 0 {
            return Err(format!("{} pages shared", stats.shared_pages));
        }
        region.check_invariants()?;
        check_all(&region, &versions)?;
        rewrite_within_limit(&region, 7)
    });
    assert!(exited_ok(status), "child status {status:#x}");
    check_all(&region, &versions).unwrap();
    region.check_invariants().unwrap();
}

/// A pipe whose read end waits at most `secs` for a line.
struct Line {
    read: std::fs::File,
    write: std::fs::File,
}

impl Line {
    fn new() -> Line {
        use std::os::fd::FromRawFd;
        let mut fds = [0; 2];
        assert_eq!(unsafe { libc::pipe2(fds.as_mut_ptr(), libc::O_CLOEXEC) }, 0);
        // SAFETY: both descriptors are new and ours.
        unsafe {
            Line {
                read: std::fs::File::from_raw_fd(fds[0]),
                write: std::fs::File::from_raw_fd(fds[1]),
            }
        }
    }

    fn say(&self, what: &str) {
        use std::io::Write;
        let _ = (&self.write).write_all(format!("{what}\n").as_bytes());
    }

    /// The next line, or an error after `secs` seconds of silence.
    fn hear(&self, secs: i32) -> Result<String, String> {
        use std::io::Read;
        use std::os::fd::AsRawFd;
        let mut got = Vec::new();
        loop {
            let mut pfd = libc::pollfd {
                fd: self.read.as_raw_fd(),
                events: libc::POLLIN,
                revents: 0,
            };
            if unsafe { libc::poll(&mut pfd, 1, secs * 1000) } != 1 {
                return Err(format!("nothing said in {secs} s"));
            }
            let mut byte = [0u8];
            if (&self.read).read(&mut byte).map_err(|e| e.to_string())? == 0 {
                return Err("the other side closed without a word".into());
            }
            if byte[0] == b'\n' {
                return Ok(String::from_utf8_lossy(&got).into_owned());
            }
            got.push(byte[0]);
        }
    }
}

#[test]
fn parent_and_child_each_see_only_their_own_writes_after_the_fork() {
    let _serial = serial();
    each_sees_only_its_own_writes(mixed_region(FaultMode::Thread));
}

/// The same with written bits, where the parent's pages are write-protected for aging
/// alone when it copies those the child still maps to page them out.
#[test]
fn with_written_bits_parent_and_child_each_see_only_their_own_writes() {
    let _serial = serial();
    each_sees_only_its_own_writes(mixed_region_with(|cfg| {
        cfg.references = References::Written
    }));
}

fn each_sees_only_its_own_writes((region, versions): (Region, Vec<u32>)) {
    let versions = settled(versions, &region);
    let pages = versions.len();
    let (go, done) = (Line::new(), Line::new());
    // The child waits while the parent rewrites all of it (twice its limit), then checks
    // that it still has the memory as it was at the fork and rewrites it in turn.
    let pid = unsafe { libc::fork() };
    assert!(pid >= 0);
    if pid == 0 {
        let result = go.hear(60).and_then(|_| {
            check_all(&region, &versions)?;
            for page in 0..pages {
                unsafe { fill(region.as_ptr(), page, 21) };
            }
            (0..pages).try_for_each(|page| unsafe { check(region.as_ptr(), page, 21) })?;
            region.check_invariants()
        });
        done.say(&result.err().unwrap_or_else(|| "ok".into()));
        unsafe { libc::_exit(0) };
    }
    // Pages the child still maps too are copied to be moved out (the kernel's move takes
    // only pages mapped once).
    let before = region.stats().vmstat.cow_reclaim;
    region.advise(0, region.len(), Advice::PageOut).unwrap();
    let copied = region.stats().vmstat.cow_reclaim - before;
    for page in 0..pages {
        unsafe { fill(region.as_ptr(), page, 20) };
    }
    go.say("go");
    let heard = done.hear(60);
    let mut status = 0;
    unsafe { libc::waitpid(pid, &mut status, 0) };
    assert_eq!(heard, Ok("ok".into()));
    assert!(copied > 0, "no shared page was copied to be paged out");
    for page in 0..pages {
        unsafe { check(region.as_ptr(), page, 20) }.unwrap();
    }
    region.check_invariants().unwrap();
}

#[test]
fn a_child_carries_on_when_its_parent_is_killed_and_claims_what_it_shared() {
    let _serial = serial();
    let (region, versions) = mixed_region(FaultMode::Thread);
    let versions = settled(versions, &region);
    let pages = versions.len();
    let (go, done) = (Line::new(), Line::new());
    // The middle process forks the grandchild and is killed (SIGKILL) at once. This
    // process then rewrites every page, so the grandchild is the last to map what it
    // inherited: it checks all of it, and its shared pages become its own (charged).
    let status = in_child(|| {
        let middle = unsafe { libc::getpid() };
        let pid = unsafe { libc::fork() };
        if pid == 0 {
            let result = go.hear(60).and_then(|_| {
                if unsafe { libc::getppid() } == middle {
                    return Err("the middle process is still there".into());
                }
                check_all(&region, &versions)?;
                let deadline = std::time::Instant::now() + std::time::Duration::from_secs(10);
                while region.stats().shared_pages > 0 {
                    if std::time::Instant::now() > deadline {
                        return Err(format!(
                            "{} pages still shared 10 s after the others let go",
                            region.stats().shared_pages
                        ));
                    }
                    std::thread::sleep(std::time::Duration::from_millis(50));
                }
                if region.stats().vmstat.cow_alone == 0 {
                    return Err("no shared page was claimed as left alone".into());
                }
                region.check_invariants()
            });
            done.say(&result.err().unwrap_or_else(|| "ok".into()));
            unsafe { libc::_exit(0) };
        }
        unsafe { libc::kill(libc::getpid(), libc::SIGKILL) };
        unreachable!("killed");
    });
    assert!(
        libc::WIFSIGNALED(status),
        "the middle process was killed: {status:#x}"
    );
    for page in 0..pages {
        unsafe { fill(region.as_ptr(), page, 30) };
    }
    go.say("go");
    assert_eq!(done.hear(60), Ok("ok".into()));
    (0..pages).for_each(|page| unsafe { check(region.as_ptr(), page, 30) }.unwrap());
    region.check_invariants().unwrap();
}

#[test]
fn a_child_killed_while_it_writes_takes_nothing_of_the_parents_memory() {
    let _serial = serial();
    let (region, versions) = mixed_region(FaultMode::Thread);
    let versions = settled(versions, &region);
    let pages = versions.len();
    let started = Line::new();
    // The child rewrites everything, over and over (breaking copy-on-write and swapping),
    // until it is killed with SIGKILL.
    let pid = unsafe { libc::fork() };
    assert!(pid >= 0);
    if pid == 0 {
        started.say("writing");
        for round in 40u32.. {
            for page in 0..pages {
                unsafe { fill(region.as_ptr(), page, round) };
            }
        }
        unsafe { libc::_exit(0) };
    }
    assert_eq!(started.hear(60), Ok("writing".into()));
    std::thread::sleep(std::time::Duration::from_millis(300));
    unsafe { libc::kill(pid, libc::SIGKILL) };
    let mut status = 0;
    unsafe { libc::waitpid(pid, &mut status, 0) };
    assert!(
        libc::WIFSIGNALED(status),
        "the child was killed: {status:#x}"
    );
    check_all(&region, &versions).unwrap();
    region.check_invariants().unwrap();
}

#[test]
fn fifty_forks_of_a_half_swapped_region_each_see_their_moment() {
    let _serial = serial();
    let (region, pages) = filled_region();
    for round in 0..50u32 {
        // The parent moves on between forks: a stripe rewritten each round.
        let version = round + 2;
        for page in (round as usize % 7..pages).step_by(7) {
            unsafe { fill(region.as_ptr(), page, version) };
        }
        let expect = |page: usize| -> u32 {
            (0..=round)
                .rev()
                .find(|&r| page >= r as usize % 7 && (page - r as usize % 7).is_multiple_of(7))
                .map_or(1, |r| r + 2)
        };
        let status = in_child(|| {
            (0..pages)
                .step_by(13)
                .try_for_each(|page| unsafe { check(region.as_ptr(), page, expect(page)) })
        });
        assert!(exited_ok(status), "round {round}: child status {status:#x}");
    }
    region.check_invariants().unwrap();
}

#[test]
fn a_grandchild_gets_the_memory_of_its_parent() {
    let _serial = serial();
    let (region, versions) = mixed_region(FaultMode::Thread);
    let versions = settled(versions, &region);
    let status = in_child(|| {
        // The child changes some pages, then forks in turn.
        for page in (0..versions.len()).step_by(5) {
            unsafe { fill(region.as_ptr(), page, 9) };
        }
        let mut mine = versions.clone();
        for v in mine.iter_mut().step_by(5) {
            *v = 9;
        }
        let grandchild = in_child(|| check_all(&region, &mine));
        if !exited_ok(grandchild) {
            return Err(format!("grandchild status {grandchild:#x}"));
        }
        check_all(&region, &mine)
    });
    assert!(exited_ok(status), "child status {status:#x}");
    check_all(&region, &versions).unwrap();
}

#[test]
fn a_child_keeps_the_policies_its_parent_switched_to() {
    let _serial = serial();
    let (region, _pages) = filled_region();
    let switched = Readahead {
        policy: ReadaheadPolicy::Fixed,
        page_cluster: 2,
    };
    region.set_readahead(switched).unwrap();
    let lru = match region.lru_policy() {
        LruPolicy::S3fifo => LruPolicy::TwoList,
        LruPolicy::TwoList => LruPolicy::S3fifo,
    };
    region.set_lru_policy(lru);
    let status = in_child(|| {
        let (readahead, policy) = (region.readahead(), region.lru_policy());
        if readahead != switched || policy != lru {
            return Err(format!("the child has {readahead:?} and {policy:?}"));
        }
        Ok(())
    });
    assert!(exited_ok(status), "child status {status:#x}");
}

#[test]
fn regions_sharing_a_swap_device_are_all_copied() {
    let _serial = serial();
    let cfg = Config::new(MIB as u64);
    let swap = uswap_core::swapfile::SwapDevice::open(&cfg.swap).unwrap();
    let a = Region::with_swap(4 * MIB as u64, cfg.clone(), swap.clone()).unwrap();
    let b = Region::with_swap(4 * MIB as u64, cfg, swap).unwrap();
    let pages = a.len() / PAGE_SIZE;
    for page in 0..pages {
        unsafe { fill(a.as_ptr(), page, 1) };
        unsafe { fill(b.as_ptr(), page, 2) };
    }
    let status = in_child(|| {
        for page in 0..pages {
            unsafe { check(a.as_ptr(), page, 1) }?;
            unsafe { check(b.as_ptr(), page, 2) }?;
        }
        Ok(())
    });
    assert!(exited_ok(status), "child status {status:#x}");
}

#[test]
fn forks_while_other_threads_fault_and_reclaim() {
    let _serial = serial();
    let (region, versions) = mixed_region(FaultMode::Thread);
    let versions = settled(versions, &region);
    let region = Arc::new(region);
    // Pages this thread churns: the rest is left as `versions` says.
    let hot = versions.len() * 3 / 4 - 128..versions.len() * 3 / 4;
    let stop = Arc::new(AtomicBool::new(false));
    let churn = {
        let (region, stop, hot) = (region.clone(), stop.clone(), hot.clone());
        std::thread::spawn(move || {
            let mut v = 10;
            while !stop.load(Relaxed) {
                for page in hot.clone() {
                    unsafe { fill(region.as_ptr(), page, v) };
                }
                region
                    .advise(
                        hot.start * PAGE_SIZE,
                        hot.len() * PAGE_SIZE,
                        Advice::PageOut,
                    )
                    .unwrap();
                v += 1;
            }
        })
    };
    for _ in 0..5 {
        let status = in_child(|| {
            let settled = versions
                .iter()
                .enumerate()
                .filter(|(p, _)| !hot.contains(p))
                .map(|(p, &v)| (p, v));
            for (page, v) in settled {
                if v != 0 {
                    unsafe { check(region.as_ptr(), page, v) }?;
                }
            }
            region.check_invariants()
        });
        assert!(exited_ok(status), "child status {status:#x}");
    }
    stop.store(true, Relaxed);
    churn.join().unwrap();
    region.check_invariants().unwrap();
}

#[test]
fn a_hole_the_parent_unmapped_stays_a_hole_in_the_child() {
    let _serial = serial();
    let (region, pages) = filled_region();
    let hole = 100..200;
    let base = region.as_ptr();
    let rc = unsafe {
        libc::munmap(
            base.add(hole.start * PAGE_SIZE).cast(),
            hole.len() * PAGE_SIZE,
        )
    };
    assert_eq!(rc, 0);
    let status = in_child(|| {
        for page in (0..pages).filter(|p| !hole.contains(p)) {
            unsafe { check(region.as_ptr(), page, 1) }?;
        }
        // Nothing of the region is in the hole: no mapping there is registered with a
        // userfaultfd. (The child's own allocations since the fork may have taken the
        // space: whether they do depends on the address-space layout.)
        let hole_start = base as usize + hole.start * PAGE_SIZE;
        let hole_end = base as usize + hole.end * PAGE_SIZE;
        if !uffd_vmas().any(|(start, end)| start <= base as usize && end > base as usize) {
            return Err("the region's first page is not in a registered mapping".into());
        }
        if let Some(vma) = uffd_vmas().find(|&(start, end)| start < hole_end && end > hole_start) {
            return Err(format!(
                "the hole is covered by a registered mapping {vma:x?}"
            ));
        }
        region.check_invariants()
    });
    assert!(exited_ok(status), "child status {status:#x}");
    region.check_invariants().unwrap();
}

/// The permissions `/proc/self/maps` shows for the mapping holding `addr`.
fn perms_at(addr: usize) -> Option<String> {
    let maps = std::fs::read_to_string("/proc/self/maps").ok()?;
    maps.lines().find_map(|line| {
        let (range, rest) = line.split_once(' ')?;
        let (a, b) = range.split_once('-')?;
        let (a, b) = (
            usize::from_str_radix(a, 16).ok()?,
            usize::from_str_radix(b, 16).ok()?,
        );
        (a..b).contains(&addr).then(|| rest[..4].to_string())
    })
}

#[test]
fn a_child_keeps_the_protections_the_parent_gave_its_pages() {
    let _serial = serial();
    let (region, pages) = filled_region();
    let ro = unsafe { region.as_ptr().add(300 * PAGE_SIZE) };
    assert_eq!(
        unsafe { libc::mprotect(ro.cast(), 16 * PAGE_SIZE, libc::PROT_READ) },
        0
    );
    let status = in_child(|| {
        for page in 0..pages {
            unsafe { check(region.as_ptr(), page, 1) }?;
        }
        match perms_at(ro as usize).as_deref() {
            Some("r--p") => {}
            other => return Err(format!("read-only pages are {other:?} in the child")),
        }
        match perms_at(ro as usize + 16 * PAGE_SIZE).as_deref() {
            Some("rw-p") => Ok(()),
            other => Err(format!("the pages after are {other:?} in the child")),
        }
    });
    assert!(exited_ok(status), "child status {status:#x}");
    unsafe {
        libc::mprotect(
            ro.cast(),
            16 * PAGE_SIZE,
            libc::PROT_READ | libc::PROT_WRITE,
        )
    };
}

/// The address ranges of this process's mappings registered with a userfaultfd for
/// missing pages (VmFlags `um` in /proc/self/smaps).
fn uffd_vmas() -> impl Iterator<Item = (usize, usize)> {
    let smaps = std::fs::read_to_string("/proc/self/smaps").expect("read /proc/self/smaps");
    let mut range = None;
    let mut found = Vec::new();
    for line in smaps.lines() {
        if let Some(flags) = line.strip_prefix("VmFlags:") {
            if let Some(r) = range
                .take()
                .filter(|_| flags.split_whitespace().any(|f| f == "um"))
            {
                found.push(r);
            }
        } else if let Some((start, end)) = line
            .split_whitespace()
            .next()
            .and_then(|r| r.split_once('-'))
            .and_then(|(a, b)| {
                Some((
                    usize::from_str_radix(a, 16).ok()?,
                    usize::from_str_radix(b, 16).ok()?,
                ))
            })
        {
            range = Some((start, end));
        }
    }
    found.into_iter()
}

/// A library user who kept a handle to the parent's swap device across fork: in the
/// child its reads and writes are refused with an error that says why (the descriptor is
/// closed there and its number may name another file; the key and write generations are
/// the parent's), and the parent's device is untouched.
#[test]
fn a_handle_to_the_parents_swap_device_refuses_io_in_a_fork_child() {
    let _serial = serial();
    let (region, pages) = filled_region();
    // A region's device, and one a library user opened and no region uses.
    let device = region.swap_device().clone();
    let standalone = uswap_core::swapfile::SwapDevice::open(&Config::new(MIB as u64).swap).unwrap();
    let status = in_child(|| {
        let layout = std::alloc::Layout::from_size_align(PAGE_SIZE, PAGE_SIZE).unwrap();
        // SAFETY: a non-zero size.
        let buf = unsafe { std::alloc::alloc_zeroed(layout) };
        for dev in [&device, &standalone] {
            // SAFETY: one page-aligned page, ours until the end of this closure.
            let written = unsafe { dev.write_pages(&[(0, buf)]) };
            match &written[0] {
                Err(e) if e.to_string().contains("fork child") => {}
                other => return Err(format!("a write through the parent's device: {other:?}")),
            }
        }
        // SAFETY: as above.
        match unsafe { device.read_page(0, buf) } {
            Err(e) if e.to_string().contains("fork child") => {}
            other => return Err(format!("a read through the parent's device: {other:?}")),
        }
        // SAFETY: as above.
        if unsafe { device.read_page_in_place(0, buf, true) } {
            return Err("a signal-handler read through the parent's device succeeded".into());
        }
        // The child's own region still works: its memory came through its own device.
        for page in 0..pages {
            unsafe { check(region.as_ptr(), page, 1) }?;
        }
        Ok(())
    });
    assert!(exited_ok(status), "child status {status:#x}");
    for page in 0..pages {
        unsafe { check(region.as_ptr(), page, 1) }.unwrap();
    }
    region.check_invariants().unwrap();
    // The parent's own handles still work.
    let slot = standalone.alloc_slot().unwrap();
    let page = vec![7u8; 2 * PAGE_SIZE];
    let at = page.as_ptr().align_offset(PAGE_SIZE);
    // SAFETY: one page-aligned page inside `page`.
    let written = unsafe { standalone.write_pages(&[(slot, page[at..].as_ptr())]) };
    assert!(written[0].is_ok(), "{:?}", written[0]);
}

/// Waits up to 10 s for `done`; false if it never held.
fn eventually(mut done: impl FnMut() -> bool) -> bool {
    let deadline = std::time::Instant::now() + std::time::Duration::from_secs(10);
    while !done() {
        if std::time::Instant::now() > deadline {
            return false;
        }
        std::thread::sleep(std::time::Duration::from_millis(20));
    }
    true
}

/// Swapped pages stay in the parent's swap file at a fork: the child reads them from
/// there (they are not copied), the parent does not reuse their slots while the child may
/// still read them (it rewrites everything twice meanwhile), and it gets them back once
/// the child has exited.
#[test]
fn swapped_pages_are_lent_to_the_child_and_their_slots_come_back_when_it_is_done() {
    let _serial = serial();
    for mode in [FaultMode::Thread, FaultMode::Sigbus] {
        let mut cfg = Config::new(MIB as u64);
        cfg.fault_mode = mode;
        let region = Region::new(4 * MIB as u64, cfg).unwrap();
        let pages = region.len() / PAGE_SIZE;
        for page in 0..pages {
            unsafe { fill(region.as_ptr(), page, 1) };
        }
        region.advise(0, region.len(), Advice::PageOut).unwrap();
        let swapped = region.stats().swap_used_pages;
        assert!(
            swapped as usize > pages / 2,
            "{mode:?}: {swapped} pages swapped"
        );
        let (go, done) = (Line::new(), Line::new());
        let before = region.stats().vmstat;
        let pid = unsafe { libc::fork() };
        assert!(pid >= 0);
        if pid == 0 {
            let result = go.hear(60).and_then(|_| {
                let inherited = region.stats().borrowed_pages;
                if inherited == 0 {
                    return Err("no page reads from its parent's slot".into());
                }
                (0..pages).try_for_each(|page| unsafe { check(region.as_ptr(), page, 1) })?;
                region.check_invariants()?;
                Ok(inherited)
            });
            done.say(&match result {
                Ok(n) => format!("ok {n}"),
                Err(e) => e,
            });
            // Lingers until told, so the parent sees its slots held meanwhile.
            let _ = go.hear(60);
            unsafe { libc::_exit(0) };
        }
        let after = region.stats().vmstat;
        let lent = after.fork_lent - before.fork_lent;
        let copied = after.fork_copied - before.fork_copied;
        assert!(
            lent as usize > pages / 2,
            "{mode:?}: {lent} lent, {copied} copied"
        );
        let held = region.swap_device().fork_shared_slots();
        assert_eq!(held, lent, "{mode:?}: slots held for the child");
        // Twice over, every page rewritten and pushed out: lent slots are not reused.
        for round in 2..4 {
            for page in 0..pages {
                unsafe { fill(region.as_ptr(), page, round) };
            }
            region.advise(0, region.len(), Advice::PageOut).unwrap();
        }
        assert_eq!(region.swap_device().fork_shared_slots(), held);
        go.say("go");
        let heard = done.hear(60);
        go.say("exit");
        let mut status = 0;
        unsafe { libc::waitpid(pid, &mut status, 0) };
        assert_eq!(heard, Ok(format!("ok {lent}")), "{mode:?}");
        assert!(exited_ok(status), "{mode:?}: child status {status:#x}");
        // kswapd looks at the child's lifeline every 100 ms at least.
        let device = region.swap_device();
        assert!(
            eventually(|| device.fork_shared_slots() == 0
                && device.used_pages() == region.stats().swap_used_pages),
            "{mode:?}: {} slots still held, {} used for {} of the region's",
            device.fork_shared_slots(),
            device.used_pages(),
            region.stats().swap_used_pages
        );
        (0..pages).for_each(|page| unsafe { check(region.as_ptr(), page, 3) }.unwrap());
        region.check_invariants().unwrap();
    }
}

/// A child that calls `exec` at once gives its parent's slots back with it (the lifeline
/// is closed on exec), and one killed with SIGKILL gives them back too.
#[test]
fn a_child_that_execs_or_is_killed_gives_the_lent_slots_back() {
    let _serial = serial();
    let (region, pages) = filled_region();
    region.advise(0, region.len(), Advice::PageOut).unwrap();
    let device = region.swap_device();
    let true_path = std::ffi::CString::new("/bin/true").unwrap();
    let argv = [true_path.as_ptr(), std::ptr::null()];
    let pid = unsafe { libc::fork() };
    if pid == 0 {
        unsafe { libc::execv(true_path.as_ptr(), argv.as_ptr()) };
        unsafe { libc::_exit(127) };
    }
    assert!(device.fork_shared_slots() > 0, "slots lent to the child");
    let mut status = 0;
    unsafe { libc::waitpid(pid, &mut status, 0) };
    assert!(exited_ok(status), "child status {status:#x}");
    assert!(
        eventually(|| device.fork_shared_slots() == 0),
        "slots still held after exec"
    );
    let pid = unsafe { libc::fork() };
    if pid == 0 {
        unsafe { libc::pause() };
        unsafe { libc::_exit(0) };
    }
    assert!(
        device.fork_shared_slots() > 0,
        "slots lent to the second child"
    );
    unsafe { libc::kill(pid, libc::SIGKILL) };
    unsafe { libc::waitpid(pid, &mut status, 0) };
    assert!(
        eventually(|| device.fork_shared_slots() == 0),
        "slots still held after kill"
    );
    (0..pages).for_each(|page| unsafe { check(region.as_ptr(), page, 1) }.unwrap());
    region.check_invariants().unwrap();
}

/// Three generations: the grandchild reads pages from its grandparent's swap file (lent
/// to its parent, which passed them on), after its parent exited.
#[test]
fn a_grandchild_reads_the_slots_its_grandparent_lent_after_its_parent_exits() {
    let _serial = serial();
    let (region, pages) = filled_region();
    region.advise(0, region.len(), Advice::PageOut).unwrap();
    let done = Line::new();
    let status = in_child(|| {
        // The child reads nothing, so its pages are all in the grandparent's slots.
        let pid = unsafe { libc::fork() };
        if pid == 0 {
            std::thread::sleep(std::time::Duration::from_millis(200));
            let result = (|| {
                if unsafe { libc::getppid() } != 1 && region.stats().borrowed_pages == 0 {
                    return Err("the grandchild reads nothing from an ancestor".into());
                }
                (0..pages).try_for_each(|page| unsafe { check(region.as_ptr(), page, 1) })?;
                region.check_invariants()
            })();
            done.say(&result.err().unwrap_or_else(|| "ok".into()));
            unsafe { libc::_exit(0) };
        }
        Ok(())
    });
    assert!(exited_ok(status), "child status {status:#x}");
    // Meanwhile the grandparent writes everything again.
    for page in 0..pages {
        unsafe { fill(region.as_ptr(), page, 2) };
    }
    region.advise(0, region.len(), Advice::PageOut).unwrap();
    assert_eq!(done.hear(60), Ok("ok".into()));
    let device = region.swap_device();
    assert!(
        eventually(|| device.fork_shared_slots() == 0),
        "slots still held"
    );
    (0..pages).for_each(|page| unsafe { check(region.as_ptr(), page, 2) }.unwrap());
}

/// A child reads what its parent lent and maps it clean against the lent slot: aging drops
/// such a page without writing it (a `BGSAVE` child reads everything once, and wrote it all
/// to its own swap before); a page read a second time, or written, is the child's own.
#[test]
fn a_child_drops_lent_pages_it_read_without_writing_them() {
    let _serial = serial();
    for mode in [FaultMode::Thread, FaultMode::Sigbus] {
        let mut cfg = Config::new(MIB as u64);
        cfg.fault_mode = mode;
        let region = Region::new(4 * MIB as u64, cfg).unwrap();
        let pages = region.len() / PAGE_SIZE;
        for page in 0..pages {
            unsafe { fill(region.as_ptr(), page, 1) };
        }
        region.advise(0, region.len(), Advice::PageOut).unwrap();
        let status = in_child(|| {
            let at_fork = region.stats().borrowed_pages;
            if (at_fork as usize) < pages / 2 {
                return Err(format!("{at_fork} pages borrowed of {pages}"));
            }
            // Read, then written at once: a write fault on a page mapped clean against
            // the lender's slot; the write must survive aging.
            for page in pages - 16..pages {
                unsafe { check(region.as_ptr(), page, 1) }?;
                unsafe { fill(region.as_ptr(), page, 5) };
            }
            region
                .advise((pages - 16) * PAGE_SIZE, 16 * PAGE_SIZE, Advice::PageOut)
                .map_err(|e| e.to_string())?;
            (pages - 16..pages).try_for_each(|page| unsafe { check(region.as_ptr(), page, 5) })?;
            let pages = pages - 16;
            let (before, borrowed) = (region.stats().vmstat, region.stats().borrowed_pages);
            if borrowed != at_fork - 16 {
                return Err(format!("{borrowed} of {at_fork} borrowed after 16 writes"));
            }
            // Four times the limit, read once: aging drops most of it again.
            (0..pages).try_for_each(|page| unsafe { check(region.as_ptr(), page, 1) })?;
            let after = region.stats().vmstat;
            let dropped = after.borrowed_dropped - before.borrowed_dropped;
            let written = after.pswpout - before.pswpout;
            if (dropped as usize) < pages / 2 || written != 0 {
                return Err(format!("{dropped} read pages dropped, {written} written"));
            }
            if region.stats().borrowed_pages != borrowed {
                return Err("a page read and not written stopped being borrowed".into());
            }
            region.check_invariants()?;
            // Written, a page is the child's own; read again, one dropped before stays
            // borrowed and is dropped again without a write, as often as aging comes round.
            // (The handler thread counts a swap-in after the fill has woken the reader.)
            for page in 0..8 {
                unsafe { fill(region.as_ptr(), page, 2) };
            }
            let borrowed_now = || region.stats().borrowed_pages;
            if !eventually(|| borrowed_now() == borrowed - 8) {
                let still = borrowed_now();
                return Err(format!("{still} of {borrowed} borrowed after 8 writes"));
            }
            let before = region.stats().vmstat;
            (8..pages).try_for_each(|page| unsafe { check(region.as_ptr(), page, 1) })?;
            let after = region.stats().vmstat;
            let dropped = after.borrowed_dropped - before.borrowed_dropped;
            // At most the 8 pages just written go out.
            let written = after.pswpout - before.pswpout;
            if (dropped as usize) < pages / 2 || written > 8 {
                return Err(format!("second read: {dropped} dropped, {written} written"));
            }
            if borrowed_now() != borrowed - 8 {
                let still = borrowed_now();
                return Err(format!(
                    "{still} borrowed after a second read, not {}",
                    borrowed - 8
                ));
            }
            (0..8).try_for_each(|page| unsafe { check(region.as_ptr(), page, 2) })?;
            region.check_invariants()?;
            // Swapoff makes every page the child's own, read or not.
            region
                .set_memory_limit(8 * MIB as u64)
                .map_err(|e| e.to_string())?;
            region.swapoff(&mut |_, _| {}).map_err(|e| e.to_string())?;
            if region.stats().borrowed_pages != 0 {
                return Err(format!(
                    "{} borrowed after swapoff",
                    region.stats().borrowed_pages
                ));
            }
            (8..pages).try_for_each(|page| unsafe { check(region.as_ptr(), page, 1) })?;
            region.check_invariants()
        });
        assert!(exited_ok(status), "{mode:?}: child status {status:#x}");
        (0..pages).for_each(|page| unsafe { check(region.as_ptr(), page, 1) }.unwrap());
        region.check_invariants().unwrap();
    }
}
