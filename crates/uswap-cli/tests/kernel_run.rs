//! Programs under the kernel's swap (`uswap run --backend kernel`) and beside uswap
//! (`uswap bench run`), end to end: exit status and signals pass through, a program larger
//! than its memory gets every byte back, and nothing the run made (cgroup, swap) is left.
//!
//! They need root and a memory cgroup controller (v1, or v2 enabled for child groups);
//! without them each test prints a `SKIPPED: …` line on stderr (`cargo test -- --nocapture`
//! shows it) and passes. They run one at a time: a run reuses swap that is already on, so
//! two at once would share one swap file that the first to finish turns off.

mod common;

use common::preload_library_built;
use std::fs;
use std::os::unix::process::ExitStatusExt;
use std::path::{Path, PathBuf};
use std::process::{Command, Output, Stdio};
use std::sync::{Mutex, MutexGuard};
use std::thread;
use std::time::Duration;

use tempfile::TempDir;

const BIN: &str = env!("CARGO_BIN_EXE_uswap");

/// Whether this machine lets the kernel backend run; says why not on stderr.
fn kernel_backend_possible() -> bool {
    // SAFETY: geteuid has no preconditions.
    if unsafe { libc::geteuid() } != 0 {
        eprintln!("SKIPPED: the kernel backend needs root");
        return false;
    }
    let root = Path::new("/sys/fs/cgroup");
    let lists_memory = |file: &str| {
        fs::read_to_string(root.join(file))
            .is_ok_and(|text| text.split_whitespace().any(|c| c == "memory"))
    };
    let v1 = root.join("memory/memory.limit_in_bytes").exists();
    let v2 = lists_memory("cgroup.controllers") && lists_memory("cgroup.subtree_control");
    if !(v1 || v2) {
        eprintln!("SKIPPED: no memory cgroup controller (v1, or v2 enabled for child groups)");
        return false;
    }
    true
}

/// One kernel-backend test at a time (see the module's note).
fn one_at_a_time() -> MutexGuard<'static, ()> {
    static KERNEL: Mutex<()> = Mutex::new(());
    KERNEL
        .lock()
        .unwrap_or_else(|poisoned| poisoned.into_inner())
}

/// `uswap run --backend kernel --memory 64M` with its swap file in `tmp`, for `program`.
fn kernel_run(tmp: &Path, program: &[&str]) -> Command {
    let mut cmd = Command::new(BIN);
    cmd.args([
        "run",
        "--backend",
        "kernel",
        "--memory",
        "64M",
        "--swap-size",
        "512M",
    ])
    .arg("--swap-dir")
    .arg(tmp)
    .arg("--")
    .args(program);
    cmd
}

/// Asserts that the run of uswap process `pid` left no cgroup and no swap in `swap_dir`.
fn nothing_left(pid: u32, swap_dir: &Path) {
    let name = format!("uswap-kernel-{pid}");
    for group in [
        Path::new("/sys/fs/cgroup/memory").join(&name),
        Path::new("/sys/fs/cgroup").join(&name),
    ] {
        assert!(!group.exists(), "{} was left behind", group.display());
    }
    let swaps = fs::read_to_string("/proc/swaps").unwrap();
    let dir = swap_dir.to_string_lossy();
    assert!(!swaps.contains(dir.as_ref()), "swap left on:\n{swaps}");
    let left: Vec<_> = fs::read_dir(swap_dir)
        .unwrap()
        .map(|e| e.unwrap().file_name())
        .filter(|name| name.to_string_lossy().starts_with("uswap-kernel-swap-"))
        .collect();
    assert!(left.is_empty(), "swap files left behind: {left:?}");
}

/// Runs `cmd` to its end; returns uswap's pid and output.
fn finish(mut cmd: Command) -> (u32, Output) {
    let child = cmd
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .unwrap();
    let pid = child.id();
    (pid, child.wait_with_output().unwrap())
}

fn text(bytes: &[u8]) -> String {
    String::from_utf8_lossy(bytes).into_owned()
}

/// Compiles tests/programs/NAME.c into `dir`, or None after a SKIPPED line.
fn build_c_program(dir: &Path, name: &str) -> Option<PathBuf> {
    let exe = dir.join(name);
    let source = Path::new(env!("CARGO_MANIFEST_DIR")).join(format!("tests/programs/{name}.c"));
    match Command::new("cc")
        .args(["-O2", "-o"])
        .arg(&exe)
        .arg(source)
        .output()
    {
        Ok(out) => {
            assert!(out.status.success(), "cc {name}.c: {}", text(&out.stderr));
            Some(exe)
        }
        Err(e) => {
            eprintln!("SKIPPED: no C compiler (cc: {e})");
            None
        }
    }
}

#[test]
fn the_exit_status_passes_through_and_nothing_is_left() {
    if !kernel_backend_possible() {
        return;
    }
    let _one = one_at_a_time();
    let tmp = TempDir::new().unwrap();
    let (pid, out) = finish(kernel_run(tmp.path(), &["sh", "-c", "exit 7"]));
    assert_eq!(out.status.code(), Some(7), "{}", text(&out.stderr));
    nothing_left(pid, tmp.path());
}

#[test]
fn sigterm_is_passed_on_and_its_death_becomes_128_plus_15() {
    if !kernel_backend_possible() {
        return;
    }
    let _one = one_at_a_time();
    let tmp = TempDir::new().unwrap();
    let mut child = kernel_run(tmp.path(), &["sleep", "60"])
        .stderr(Stdio::piped())
        .spawn()
        .unwrap();
    let pid = child.id();
    // Until the program runs, a signal ends the setup instead (also with 128 + 15).
    thread::sleep(Duration::from_secs(2));
    // SAFETY: a plain kill of our own child.
    unsafe { libc::kill(pid as libc::pid_t, libc::SIGTERM) };
    let status = child.wait().unwrap();
    assert_eq!(
        (status.code(), status.signal()),
        (Some(128 + 15), None),
        "{status:?}"
    );
    nothing_left(pid, tmp.path());
}

#[test]
fn a_program_twice_its_memory_checks_clean_under_the_kernels_swap() {
    if !kernel_backend_possible() {
        return;
    }
    let _one = one_at_a_time();
    let tmp = TempDir::new().unwrap();
    let Some(program) = build_c_program(tmp.path(), "page_verify") else {
        return;
    };
    let program = program.to_string_lossy().into_owned();
    let (pid, out) = finish(kernel_run(tmp.path(), &[&program, "128M"]));
    assert!(
        out.status.success(),
        "{:?}\nstdout: {}\nstderr: {}",
        out.status,
        text(&out.stdout),
        text(&out.stderr)
    );
    assert!(text(&out.stdout).starts_with("ok 32768 pages 2 passes"));
    nothing_left(pid, tmp.path());
}

#[test]
fn bench_run_reports_every_run_as_json() {
    if !kernel_backend_possible() {
        return;
    }
    let _one = one_at_a_time();
    preload_library_built();
    let tmp = TempDir::new().unwrap();
    let mut cmd = Command::new(BIN);
    cmd.args(["bench", "run", "--rounds", "1", "--modes", "kernel,thread"])
        .args(["--memory", "64M", "--swap-size", "256M", "--json"])
        .arg("--swap-dir")
        .arg(tmp.path())
        .arg("--log-dir")
        .arg(tmp.path())
        .args(["--", "true"]);
    let (pid, out) = finish(cmd);
    assert!(out.status.success(), "{}", text(&out.stderr));
    let report: serde_json::Value = serde_json::from_slice(&out.stdout).expect("one JSON object");
    let runs = report["runs"].as_array().unwrap();
    assert_eq!(runs.len(), 2, "{report}");
    assert_eq!(
        (runs[0]["mode"].as_str(), runs[1]["mode"].as_str()),
        (Some("kernel"), Some("thread"))
    );
    for run in runs {
        assert_eq!(run["ok"], true, "{run}");
        assert!(run["wall_s"].as_f64().unwrap() > 0.0, "{run}");
        assert!(Path::new(run["log"].as_str().unwrap()).is_file(), "{run}");
    }
    assert!(runs[0]["cgroup_peak_bytes"].as_u64().is_some(), "{report}");
    assert_eq!(
        report["summary"][1]["round_speeds"]
            .as_array()
            .unwrap()
            .len(),
        1
    );
    nothing_left(pid, tmp.path());
}
