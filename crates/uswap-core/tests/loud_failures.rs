//! Failures that must kill the faulting thread, checked from outside: each scenario runs in
//! a child process (this binary re-executed with `child NAME`), and the parent asserts how
//! the child died and what it said. A custom harness, since a dying child must not take
//! the test runner down with it.

mod common;

use std::io::Write;
use std::os::unix::process::ExitStatusExt;
use std::process::Command;
use uswap_core::{Advice, Config, FaultMode, Region, SwapLocation, PAGE_SIZE};

/// Writes a region out to a named swap file in `dir` (the parent's temporary directory:
/// this process dies, and would leave one of its own behind), scribbles over the file,
/// then reads a page from user space: the access must die with SIGBUS, never see wrong
/// data.
fn corrupt_then_touch(mode: FaultMode, dir: &str) {
    let path = std::path::Path::new(dir).join("swap");
    let mut cfg = Config::new(1 << 20);
    cfg.fault_mode = mode;
    cfg.swap.location = SwapLocation::File(path.clone());
    let region = Region::new(1 << 20, cfg).unwrap();
    for p in 0..region.len() / PAGE_SIZE {
        unsafe { common::fill(region.as_ptr(), p, 1) };
    }
    region.advise(0, region.len(), Advice::PageOut).unwrap();
    // The swap file was unlinked as soon as it was open; reach it through its descriptor.
    let file = common::open_deleted(&path);
    let len = file.metadata().unwrap().len();
    std::os::unix::fs::FileExt::write_all_at(&file, &vec![0x5Au8; len as usize], 0).unwrap();
    file.sync_all().unwrap();
    println!("corrupted");
    std::io::stdout().flush().unwrap();
    let word = unsafe { (region.as_ptr().add(PAGE_SIZE) as *const u64).read_volatile() };
    println!("read {word:#x} from a corrupted page");
}

/// The swap file's file system fills up behind uswap's back (another file takes the space
/// a growing swap file was counting on). In a private mount namespace, on a small tmpfs
/// that vanishes with the child. Pages already swapped must all read back; only when a new
/// page finds neither memory nor swap does the access die, loudly.
fn disk_fills_up(dir: &str) {
    const MIB: usize = 1 << 20;
    let c = |s: &str| std::ffi::CString::new(s).unwrap();
    unsafe {
        assert_eq!(
            libc::unshare(libc::CLONE_NEWNS),
            0,
            "unshare: {}",
            std::io::Error::last_os_error()
        );
        let none = std::ptr::null();
        assert_eq!(
            libc::mount(
                none,
                c("/").as_ptr(),
                none,
                libc::MS_REC | libc::MS_PRIVATE,
                std::ptr::null()
            ),
            0
        );
        let rc = libc::mount(
            c("tmpfs").as_ptr(),
            c(dir).as_ptr(),
            c("tmpfs").as_ptr(),
            0,
            c("size=160m").as_ptr().cast(),
        );
        assert_eq!(rc, 0, "mount tmpfs: {}", std::io::Error::last_os_error());
    }
    let mut cfg = Config::new(MIB as u64);
    cfg.swap.location = SwapLocation::TempIn(dir.into());
    // One page per fault, so the loop below notices the failed write-out while free
    // memory remains.
    cfg.fault_around = 1;
    let region = Region::new(100 * MIB as u64, cfg).unwrap();
    let pages = region.len() / PAGE_SIZE;
    let mut written = 0;
    // The swap file grows by 64 MiB once these pages go out; then the rest of the file
    // system is taken.
    while written < 32 * MIB / PAGE_SIZE {
        unsafe { common::fill(region.as_ptr(), written, 1) };
        written += 1;
    }
    std::fs::write(format!("{dir}/filler"), vec![1u8; 90 * MIB]).unwrap();
    while region.vmstat().swap_full == 0 {
        assert!(written < pages, "the swap file never ran out of space");
        unsafe { common::fill(region.as_ptr(), written, 1) };
        written += 1;
    }
    for p in 0..written {
        unsafe { common::check(region.as_ptr(), p, 1) }.unwrap();
    }
    println!("verified {written} pages after the swap file system filled up");
    std::io::stdout().flush().unwrap();
    while written < pages {
        unsafe { common::fill(region.as_ptr(), written, 1) };
        written += 1;
    }
    println!("wrote {written} pages with no swap space");
}

/// Without permission for userfaultfd the error names the cause and the fixes. Runs as the
/// unprivileged user `nobody` (the test itself runs as root).
fn unprivileged() {
    unsafe {
        assert_eq!(libc::setgroups(0, std::ptr::null()), 0);
        assert_eq!(libc::setgid(65534), 0);
        assert_eq!(libc::setuid(65534), 0);
    }
    let unprivileged_ok = std::fs::read_to_string("/proc/sys/vm/unprivileged_userfaultfd")
        .is_ok_and(|s| s.trim() == "1");
    match Region::new(1 << 20, Config::new(1 << 20)) {
        Err(e) => println!("error: {e}"),
        Ok(_) if unprivileged_ok => {
            println!("error: skipped, vm.unprivileged_userfaultfd=1 permits it")
        }
        Ok(_) => panic!("an unprivileged process got a userfaultfd"),
    }
}

/// A 2 MiB region in `mode`, every page written and paged out, with `arm` done to it
/// (a fault injected) and "armed" printed: what follows must fail loudly.
fn armed_paged_out(mode: FaultMode, arm: impl FnOnce(&Region)) -> Region {
    let mut cfg = Config::new(1 << 20);
    cfg.fault_mode = mode;
    let region = Region::new(2 << 20, cfg).unwrap();
    for p in 0..region.len() / PAGE_SIZE {
        unsafe { common::fill(region.as_ptr(), p, 1) };
    }
    region.advise(0, region.len(), Advice::PageOut).unwrap();
    arm(&region);
    println!("armed");
    std::io::stdout().flush().unwrap();
    region
}

/// A bug inside uswap (a panic while resolving a fault) fails that access loudly.
fn handler_panics(mode: FaultMode) {
    let region = armed_paged_out(mode, Region::inject_handler_panic);
    let word = unsafe { (region.as_ptr().add(3 * PAGE_SIZE) as *const u64).read_volatile() };
    println!("read {word:#x} through a panicking handler");
}

/// The program makes every page it has read-only, then needs more: nothing can be
/// reclaimed (reclaim cannot move pages out of a read-only range), and the failure says why.
fn unmovable() {
    let mut cfg = Config::new(1 << 20);
    cfg.fault_around = 1;
    let region = Region::new(4 << 20, cfg).unwrap();
    for p in 0..240 {
        unsafe { common::fill(region.as_ptr(), p, 1) };
    }
    let rc = unsafe { libc::mprotect(region.as_ptr().cast(), region.len(), libc::PROT_READ) };
    assert_eq!(rc, 0, "mprotect: {}", std::io::Error::last_os_error());
    println!("protected");
    std::io::stdout().flush().unwrap();
    let mut sum = 0u64;
    for p in 240..region.len() / PAGE_SIZE {
        sum += unsafe { (region.as_ptr().add(p * PAGE_SIZE) as *const u64).read_volatile() };
    }
    println!("read {} pages ({sum})", region.len() / PAGE_SIZE);
}

/// The region's userfaultfd cannot be read (an injected EIO): the process stops with a
/// message (SIGABRT) instead of leaving the fault, or the `madvise` whose event it is,
/// asleep in the kernel for ever (before: the handler thread stopped without a word).
fn uffd_read_error(mode: FaultMode) {
    let region = armed_paged_out(mode, Region::inject_uffd_read_error);
    // Thread mode reads the fault; SIGBUS mode's service thread reads the discard's event.
    let word = unsafe { (region.as_ptr().add(3 * PAGE_SIZE) as *const u64).read_volatile() };
    let rc = unsafe { libc::madvise(region.as_ptr().cast(), PAGE_SIZE, libc::MADV_DONTNEED) };
    println!("read {word:#x} and discarded ({rc}) past an unreadable userfaultfd");
}

/// A mapped page vanishes without uswap being told: the access fails loudly.
fn lost_page(mode: FaultMode) {
    let mut cfg = Config::new(1 << 20);
    cfg.fault_mode = mode;
    let region = Region::new(1 << 20, cfg).unwrap();
    unsafe { common::fill(region.as_ptr(), 5, 1) };
    region.simulate_lost_page(5 * PAGE_SIZE);
    println!("lost");
    std::io::stdout().flush().unwrap();
    let word = unsafe { (region.as_ptr().add(5 * PAGE_SIZE) as *const u64).read_volatile() };
    println!("read {word:#x} from a lost page");
}

/// Another library replaces uswap's SIGBUS handler: uswap says so, takes it back, and the
/// region goes on working.
fn sigbus_replaced() {
    extern "C" fn other(_: libc::c_int) {}
    let mut cfg = Config::new(1 << 20);
    cfg.fault_mode = FaultMode::Sigbus;
    let region = Region::new(4 << 20, cfg).unwrap();
    unsafe { libc::signal(libc::SIGBUS, other as *const () as libc::sighandler_t) };
    // The service thread looks once a second, the first time a second after its start.
    std::thread::sleep(std::time::Duration::from_millis(2500));
    for p in 0..region.len() / PAGE_SIZE {
        unsafe { common::fill(region.as_ptr(), p, 1) };
    }
    for p in 0..region.len() / PAGE_SIZE {
        unsafe { common::check(region.as_ptr(), p, 1) }.unwrap();
    }
    println!("verified");
}

fn child(name: &str, arg: Option<&String>) {
    // As in a C program: no SIGBUS handler. (Rust's own, for stack overflows, swallows the
    // first SIGBUS a thread is sent and lets the access retry.)
    unsafe { libc::signal(libc::SIGBUS, libc::SIG_DFL) };
    match name {
        "corrupt-thread" => corrupt_then_touch(FaultMode::Thread, arg.expect("a directory")),
        "corrupt-sigbus" => corrupt_then_touch(FaultMode::Sigbus, arg.expect("a directory")),
        "disk-fills-up" => disk_fills_up(arg.expect("a directory")),
        "unprivileged" => unprivileged(),
        "panic-thread" => handler_panics(FaultMode::Thread),
        "panic-sigbus" => handler_panics(FaultMode::Sigbus),
        "unmovable" => unmovable(),
        "lost-thread" => lost_page(FaultMode::Thread),
        "lost-sigbus" => lost_page(FaultMode::Sigbus),
        "sigbus-replaced" => sigbus_replaced(),
        "uffd-read-thread" => uffd_read_error(FaultMode::Thread),
        "uffd-read-sigbus" => uffd_read_error(FaultMode::Sigbus),
        _ => panic!("unknown scenario {name}"),
    }
}

fn expect_sigbus(name: &str, stdout_has: &str, stderr_has: &[&str]) -> Result<(), String> {
    expect_death(name, libc::SIGBUS, stdout_has, stderr_has)
}

/// The child scenario `name` dies of `signal` after printing `stdout_has`, never having
/// read or written the memory, with every one of `stderr_has` on stderr.
fn expect_death(
    name: &str,
    signal: i32,
    stdout_has: &str,
    stderr_has: &[&str],
) -> Result<(), String> {
    let dir = tempfile::tempdir().map_err(|e| e.to_string())?;
    let out = Command::new(std::env::current_exe().unwrap())
        .args(["child", name, dir.path().to_str().unwrap()])
        .output()
        .map_err(|e| e.to_string())?;
    let (stdout, stderr) = (
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr),
    );
    if out.status.signal() != Some(signal) {
        return Err(format!(
            "{name}: expected death by signal {signal}, got {:?}\nstdout: {stdout}\nstderr: \
             {stderr}",
            out.status
        ));
    }
    if !stdout.contains(stdout_has) || stdout.contains("read ") || stdout.contains("wrote ") {
        return Err(format!(
            "{name}: the access must fail, not return data: {stdout}"
        ));
    }
    for needle in stderr_has {
        if !stderr.contains(needle) {
            return Err(format!("{name}: stderr lacks {needle:?}: {stderr}"));
        }
    }
    Ok(())
}

fn expect_success(name: &str, stdout_has: &str, stderr_has: &str) -> Result<(), String> {
    let out = Command::new(std::env::current_exe().unwrap())
        .args(["child", name])
        .output()
        .map_err(|e| e.to_string())?;
    let (stdout, stderr) = (
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr),
    );
    if out.status.success() && stdout.contains(stdout_has) && stderr.contains(stderr_has) {
        return Ok(());
    }
    Err(format!(
        "{name}: status {:?}\nstdout: {stdout}\nstderr: {stderr}",
        out.status
    ))
}

fn expect_permission_error() -> Result<(), String> {
    let out = Command::new(std::env::current_exe().unwrap())
        .args(["child", "unprivileged"])
        .env("TMPDIR", "/tmp")
        .output()
        .map_err(|e| e.to_string())?;
    let stdout = String::from_utf8_lossy(&out.stdout);
    let wanted = [
        "not permitted",
        "root",
        "/dev/userfaultfd",
        "vm.unprivileged_userfaultfd",
    ];
    if out.status.success()
        && (stdout.contains("skipped") || wanted.iter().all(|w| stdout.contains(w)))
    {
        return Ok(());
    }
    Err(format!(
        "status {:?}\nstdout: {stdout}\nstderr: {}",
        out.status,
        String::from_utf8_lossy(&out.stderr)
    ))
}

fn main() {
    let args: Vec<String> = std::env::args().collect();
    if args.get(1).map(String::as_str) == Some("child") {
        return child(&args[2], args.get(3));
    }
    let filter = args.iter().skip(1).find(|a| !a.starts_with('-'));
    let corrupt: &[&str] = &["fails with SIGBUS", "failed authentication"];
    let full: &[&str] = &["fails with SIGBUS", "out of memory", "swap"];
    let panicked: &[&str] = &["panicked", "injected fault-handler panic"];
    let lost: &[&str] = &["fails with SIGBUS", "is gone"];
    let locked: &[&str] = &["fails with SIGBUS", "out of memory", "mprotected"];
    let scenarios = [
        (
            "corrupted_page_kills_the_user_access_thread_mode",
            "corrupt-thread",
            "corrupted",
            corrupt,
        ),
        (
            "corrupted_page_kills_the_user_access_sigbus_mode",
            "corrupt-sigbus",
            "corrupted",
            corrupt,
        ),
        (
            "full_swap_file_system_keeps_swapped_pages_and_fails_new_ones_loudly",
            "disk-fills-up",
            "verified",
            full,
        ),
        (
            "a_panicking_handler_fails_its_fault_loudly_thread_mode",
            "panic-thread",
            "armed",
            panicked,
        ),
        (
            "a_panicking_handler_fails_its_fault_loudly_sigbus_mode",
            "panic-sigbus",
            "armed",
            panicked,
        ),
        (
            "a_page_lost_behind_uswaps_back_fails_loudly_thread_mode",
            "lost-thread",
            "lost",
            lost,
        ),
        (
            "a_page_lost_behind_uswaps_back_fails_loudly_sigbus_mode",
            "lost-sigbus",
            "lost",
            lost,
        ),
        (
            "nothing_reclaimable_fails_loudly_and_says_why",
            "unmovable",
            "protected",
            locked,
        ),
    ];
    let mut failed = 0;
    if filter.is_none_or(|f| "userfaultfd_not_permitted_names_cause_and_fixes".contains(f.as_str()))
    {
        match expect_permission_error() {
            Ok(()) => println!("test userfaultfd_not_permitted_names_cause_and_fixes ... ok"),
            Err(e) => {
                println!("test userfaultfd_not_permitted_names_cause_and_fixes ... FAILED\n{e}");
                failed += 1;
            }
        }
    }
    let test = "a_replaced_sigbus_handler_is_reported_and_taken_back";
    if filter.is_none_or(|f| test.contains(f.as_str())) {
        match expect_success("sigbus-replaced", "verified", "replaced uswap's") {
            Ok(()) => println!("test {test} ... ok"),
            Err(e) => {
                println!("test {test} ... FAILED\n{e}");
                failed += 1;
            }
        }
    }
    let unreadable: &[&str] = &["fatal: reading the userfaultfd", "rather than hang"];
    for (test, name) in [
        (
            "an_unreadable_userfaultfd_stops_the_process_loudly_thread_mode",
            "uffd-read-thread",
        ),
        (
            "an_unreadable_userfaultfd_stops_the_process_loudly_sigbus_mode",
            "uffd-read-sigbus",
        ),
    ] {
        if filter.is_some_and(|f| !test.contains(f.as_str())) {
            continue;
        }
        match expect_death(name, libc::SIGABRT, "armed", unreadable) {
            Ok(()) => println!("test {test} ... ok"),
            Err(e) => {
                println!("test {test} ... FAILED\n{e}");
                failed += 1;
            }
        }
    }
    for (test, name, stdout_has, stderr_has) in scenarios {
        if filter.is_some_and(|f| !test.contains(f.as_str())) {
            continue;
        }
        match expect_sigbus(name, stdout_has, stderr_has) {
            Ok(()) => println!("test {test} ... ok"),
            Err(e) => {
                println!("test {test} ... FAILED\n{e}");
                failed += 1;
            }
        }
    }
    if failed > 0 {
        std::process::exit(1);
    }
}
