//! Failures that must kill the faulting thread, checked from outside: each scenario runs in
//! a child process (this binary re-executed with `child NAME`), and the parent asserts how
//! the child died and what it said. A custom harness, since a dying child must not take
//! the test runner down with it.

mod common;

use std::io::Write;
use std::os::unix::process::ExitStatusExt;
use std::process::Command;
use uswap_core::{Advice, Config, FaultMode, Region, SwapLocation, PAGE_SIZE};

/// Writes a region out to a named swap file, scribbles over the file, then reads a page
/// from user space: the access must die with SIGBUS, never see wrong data.
fn corrupt_then_touch(mode: FaultMode) {
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("swap");
    let mut cfg = Config::new(1 << 20);
    cfg.fault_mode = mode;
    cfg.swap.location = SwapLocation::File(path.clone());
    let region = Region::new(1 << 20, cfg).unwrap();
    for p in 0..region.len() / PAGE_SIZE {
        unsafe { common::fill(region.as_ptr(), p, 1) };
    }
    region.advise(0, region.len(), Advice::PageOut).unwrap();
    let len = std::fs::metadata(&path).unwrap().len();
    std::fs::write(&path, vec![0x5Au8; len as usize]).unwrap();
    println!("corrupted");
    std::io::stdout().flush().unwrap();
    let word = unsafe { (region.as_ptr().add(PAGE_SIZE) as *const u64).read_volatile() };
    println!("read {word:#x} from a corrupted page");
}

fn child(name: &str) {
    match name {
        "corrupt-thread" => corrupt_then_touch(FaultMode::Thread),
        "corrupt-sigbus" => corrupt_then_touch(FaultMode::Sigbus),
        _ => panic!("unknown scenario {name}"),
    }
}

fn expect_sigbus(name: &str, stderr_has: &[&str]) -> Result<(), String> {
    let out = Command::new(std::env::current_exe().unwrap())
        .args(["child", name])
        .output()
        .map_err(|e| e.to_string())?;
    let (stdout, stderr) = (
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr),
    );
    if out.status.signal() != Some(libc::SIGBUS) {
        return Err(format!(
            "{name}: expected death by SIGBUS, got {:?}\nstdout: {stdout}\nstderr: {stderr}",
            out.status
        ));
    }
    if !stdout.contains("corrupted") || stdout.contains("read ") {
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

fn main() {
    let args: Vec<String> = std::env::args().collect();
    if args.get(1).map(String::as_str) == Some("child") {
        return child(&args[2]);
    }
    let filter = args.iter().skip(1).find(|a| !a.starts_with('-'));
    let scenarios = [
        (
            "corrupted_page_kills_the_user_access_thread_mode",
            "corrupt-thread",
        ),
        (
            "corrupted_page_kills_the_user_access_sigbus_mode",
            "corrupt-sigbus",
        ),
    ];
    let mut failed = 0;
    for (test, name) in scenarios {
        if filter.is_some_and(|f| !test.contains(f.as_str())) {
            continue;
        }
        match expect_sigbus(name, &["fails with SIGBUS", "checksum"]) {
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
