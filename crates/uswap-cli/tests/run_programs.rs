//! Unmodified programs under `uswap run --memory M -- CMD…` (issue 8 §4): each one uses
//! several times M and must still get every byte back, with its exit status, signals and
//! stdin/stdout passed through.
//!
//! Every test named `…_under_uswap_run` or about pass-through needs the `run` subcommand
//! and fails until it exists (they say so: "uswap has no `run` subcommand yet"). The
//! `…_without_uswap` tests check the test programs themselves and need nothing but a C
//! compiler or Python.
//!
//! A program that is not installed is skipped with a `SKIPPED: <program> not installed`
//! line on stderr (`cargo test -- --nocapture` shows it); .ci/run installs redis and
//! stress-ng where apt is available. Every process a test starts is in a process group of
//! its own that a guard kills on the way out, panics included, and every file goes in a
//! temporary directory.
//!
//! Programs that fork without exec (fork_verify.c, python_fork.py, stress-ng's workers,
//! redis's BGSAVE) check that each child gets its parent's memory as it was, swapped pages
//! included, and that parent and child do not see each other's writes after.

mod common;

use common::preload_library_built;
use std::env;
use std::ffi::OsStr;
use std::fs::{self, File};
use std::io::{BufRead, BufReader, Read, Write};
use std::net::{TcpListener, TcpStream};
use std::os::unix::process::{CommandExt, ExitStatusExt};
use std::path::{Path, PathBuf};
use std::process::{Child, Command, ExitStatus, Output, Stdio};
use std::sync::{Mutex, MutexGuard};
use std::thread;
use std::time::{Duration, Instant};

use tempfile::TempDir;

/// The memory limit of the heavy tests; their programs use 3-4 times as much.
const MEMORY: &str = "64M";
const MEMORY_BYTES: u64 = 64 << 20;

/// How long one program may take before the test kills it and fails (the tests take a few
/// seconds each on an idle 2-vCPU machine; this leaves room for a busy one).
const PROGRAM_TIMEOUT: Duration = Duration::from_secs(180);

// ---- finding and building programs --------------------------------------------------

/// `name` on $PATH, like `command -v`.
fn which(name: &str) -> Option<PathBuf> {
    let path = env::var_os("PATH")?;
    env::split_paths(&path)
        .map(|dir| dir.join(name))
        .find(|p| fs::metadata(p).is_ok_and(|m| m.is_file()))
}

/// `name` on $PATH, or None after a visible SKIPPED line.
fn installed(name: &str) -> Option<PathBuf> {
    let found = which(name);
    if found.is_none() {
        eprintln!("SKIPPED: {name} not installed");
    }
    found
}

/// The real Python 3 interpreter. A launcher on $PATH (pyenv's shims are bash scripts) is
/// resolved to the binary it runs, so that `uswap run` starts Python itself and not a shell
/// that forks.
fn python3() -> Option<PathBuf> {
    let launcher = installed("python3")?;
    let out = Command::new(&launcher)
        .args(["-c", "import sys; print(sys.executable)"])
        .output()
        .expect("python3 runs");
    let exe = PathBuf::from(String::from_utf8_lossy(&out.stdout).trim());
    if !out.status.success() || !exe.is_file() {
        eprintln!(
            "SKIPPED: python3 not installed ({} does not run)",
            launcher.display()
        );
        return None;
    }
    Some(exe)
}

fn program_source(name: &str) -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR"))
        .join("tests/programs")
        .join(name)
}

/// Compiles tests/programs/NAME.c into `dir`, or returns None after a visible SKIPPED line
/// when there is no C compiler.
fn build_c_program(dir: &Path, name: &str) -> Option<PathBuf> {
    let Some(cc) = ["cc", "gcc", "clang"].into_iter().find_map(which) else {
        eprintln!("SKIPPED: no C compiler (cc, gcc or clang) installed");
        return None;
    };
    let exe = dir.join(name);
    let out = Command::new(&cc)
        .args(["-O2", "-pthread", "-o"])
        .arg(&exe)
        .arg(program_source(&format!("{name}.c")))
        .output()
        .expect("the C compiler runs");
    assert!(
        out.status.success(),
        "{} failed on {name}.c:\n{}",
        cc.display(),
        String::from_utf8_lossy(&out.stderr)
    );
    Some(exe)
}

fn build_malloc_stress(dir: &Path) -> Option<PathBuf> {
    build_c_program(dir, "malloc_stress")
}

// ---- running programs ---------------------------------------------------------------

/// The heavy tests run one at a time: on two CPUs, two of them at once would each take
/// twice as long.
fn heavy() -> MutexGuard<'static, ()> {
    static HEAVY: Mutex<()> = Mutex::new(());
    HEAVY
        .lock()
        .unwrap_or_else(|poisoned| poisoned.into_inner())
}

/// `uswap run [--memory M --swap-dir TMP/swap] -- PROGRAM`, with $TMPDIR in `tmp` too.
fn uswap_run(tmp: &Path, memory: Option<&str>, program: impl AsRef<OsStr>) -> Command {
    uswap_run_in("thread", tmp, memory, program)
}

/// [`uswap_run`] in fault mode `mode`.
fn uswap_run_in(
    mode: &str,
    tmp: &Path,
    memory: Option<&str>,
    program: impl AsRef<OsStr>,
) -> Command {
    uswap_run_with(mode, &[], tmp, memory, program)
}

/// [`uswap_run_in`] with more options for `uswap run`.
fn uswap_run_with(
    mode: &str,
    options: &[&str],
    tmp: &Path,
    memory: Option<&str>,
    program: impl AsRef<OsStr>,
) -> Command {
    preload_library_built();
    let mut cmd = Command::new(env!("CARGO_BIN_EXE_uswap"));
    cmd.args(["run", "--fault-mode", mode]).args(options);
    if let Some(memory) = memory {
        let swap_dir = tmp.join("swap");
        fs::create_dir_all(&swap_dir).expect("a swap directory");
        cmd.args(["--memory", memory, "--swap-dir"]).arg(swap_dir);
    }
    cmd.arg("--").arg(program).env("TMPDIR", tmp);
    cmd
}

/// A started process, in a process group of its own (so that whatever it starts goes with
/// it), killed with that group when dropped.
struct Running {
    child: Child,
    what: String,
    /// The highest RssAnon seen while waiting for it, in bytes.
    peak_anon: u64,
}

impl Running {
    fn start(mut cmd: Command, what: &str) -> Running {
        cmd.process_group(0);
        let child = cmd
            .spawn()
            .unwrap_or_else(|e| panic!("starting {what}: {e}"));
        Running {
            child,
            what: what.to_string(),
            peak_anon: 0,
        }
    }

    fn pid(&self) -> libc::pid_t {
        self.child.id() as libc::pid_t
    }

    /// Its exit status once it has exited; None while it runs.
    fn exited(&mut self) -> Option<ExitStatus> {
        self.child.try_wait().expect("waitpid")
    }

    /// Waits for it to exit, sampling its RssAnon; kills it and fails the test after
    /// `timeout`.
    fn wait(&mut self, timeout: Duration) -> ExitStatus {
        let start = Instant::now();
        loop {
            if let Some(status) = self.exited() {
                return status;
            }
            if let Some(anon) = uswap_core::stats::rss_anon_bytes(self.child.id()) {
                self.peak_anon = self.peak_anon.max(anon);
            }
            if start.elapsed() > timeout {
                self.kill_group();
                panic!("{} still running after {timeout:?}; killed", self.what);
            }
            thread::sleep(Duration::from_millis(20));
        }
    }

    fn kill_group(&mut self) {
        // SAFETY: plain system calls; the group is the one this process created.
        unsafe { libc::killpg(self.pid(), libc::SIGKILL) };
        let _ = self.child.wait();
    }
}

impl Drop for Running {
    fn drop(&mut self) {
        // Also when the leader has exited: a program it started may still be in the group.
        self.kill_group();
    }
}

/// Runs `cmd` to the end with `stdin` as its input and returns what it printed.
fn run(cmd: Command, stdin: &[u8], what: &str) -> Output {
    run_sampled(cmd, stdin, what).0
}

/// [`run`], and the highest RssAnon of the process (sampled every 20 ms) in MiB.
fn run_sampled(cmd: Command, stdin: &[u8], what: &str) -> (Output, u64) {
    run_watched(cmd, stdin, what, |_| {})
}

/// [`run_sampled`], calling `during` with the process's pid once it has started (while
/// its output is being read), before waiting for it.
fn run_watched(
    mut cmd: Command,
    stdin: &[u8],
    what: &str,
    during: impl FnOnce(libc::pid_t),
) -> (Output, u64) {
    cmd.stdin(Stdio::piped())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped());
    let mut running = Running::start(cmd, what);
    let mut input = running.child.stdin.take().unwrap();
    let stdin = stdin.to_vec();
    let writer = thread::spawn(move || {
        // The program may exit without reading it all.
        let _ = input.write_all(&stdin);
    });
    let stdout = read_in_thread(running.child.stdout.take().unwrap());
    let stderr = read_in_thread(running.child.stderr.take().unwrap());
    during(running.pid());
    let status = running.wait(PROGRAM_TIMEOUT);
    let _ = writer.join();
    let out = Output {
        status,
        stdout: stdout.join().unwrap(),
        stderr: stderr.join().unwrap(),
    };
    (out, running.peak_anon >> 20)
}

fn read_in_thread(mut from: impl Read + Send + 'static) -> thread::JoinHandle<Vec<u8>> {
    thread::spawn(move || {
        let mut buf = Vec::new();
        let _ = from.read_to_end(&mut buf);
        buf
    })
}

/// Fails with a clear message when uswap says it has no `run` subcommand.
fn check_run_exists(stderr: &str) {
    assert!(
        !(stderr.contains("unrecognized subcommand") && stderr.contains("run")),
        "uswap has no `run` subcommand yet (issue 8): this test needs it\n{stderr}"
    );
}

/// The program exited 0 and printed an `ok …` line; returns that line.
fn expect_ok(out: &Output, what: &str) -> String {
    let stdout = String::from_utf8_lossy(&out.stdout);
    let stderr = String::from_utf8_lossy(&out.stderr);
    check_run_exists(&stderr);
    let ok = stdout
        .lines()
        .find(|l| l.starts_with("ok "))
        .map(str::to_owned);
    match (out.status.success(), ok) {
        (true, Some(line)) => line,
        _ => panic!(
            "{what}: {} without an `ok` line\nstdout:\n{stdout}\nstderr:\n{stderr}",
            out.status
        ),
    }
}

fn describe(status: ExitStatus) -> String {
    match (status.code(), status.signal()) {
        (Some(code), _) => format!("exit status {code}"),
        (_, Some(sig)) => format!("signal {sig}"),
        _ => format!("{status}"),
    }
}

// ---- the test programs on their own ------------------------------------------------

#[test]
fn malloc_stress_checks_itself_without_uswap() {
    let tmp = TempDir::new().unwrap();
    let Some(exe) = build_malloc_stress(tmp.path()) else {
        return;
    };
    let mut cmd = Command::new(&exe);
    cmd.args(["2", "32M"]).env("TMPDIR", tmp.path());
    let first = expect_ok(&run(cmd, b"", "malloc_stress"), "malloc_stress");
    let verified: u64 = first["ok ".len()..].parse().expect("ok <bytes>");
    assert!(verified >= 32 << 20, "{first}");

    // The same arguments do the same work.
    let mut cmd = Command::new(&exe);
    cmd.args(["2", "32M"]).env("TMPDIR", tmp.path());
    assert_eq!(
        expect_ok(&run(cmd, b"", "malloc_stress"), "malloc_stress"),
        first
    );

    // A flipped byte is caught and reported.
    let mut cmd = Command::new(&exe);
    cmd.args(["2", "32M"])
        .env("TMPDIR", tmp.path())
        .env("MALLOC_STRESS_CORRUPT", "1");
    let out = run(cmd, b"", "malloc_stress (corrupted)");
    let stdout = String::from_utf8_lossy(&out.stdout);
    assert_eq!(out.status.code(), Some(1), "{stdout}");
    assert!(
        stdout.starts_with("mismatch thread 1 block ") && stdout.contains(" expected 0x"),
        "{stdout}"
    );
}

#[test]
fn python_alloc_checks_itself_without_uswap() {
    let Some(python) = python3() else {
        return;
    };
    let script = program_source("python_alloc.py");
    let mut cmd = Command::new(&python);
    cmd.arg(&script).arg("16M");
    let line = expect_ok(&run(cmd, b"", "python_alloc"), "python_alloc");
    assert!(line.contains(" chunks "), "{line}");

    let mut cmd = Command::new(&python);
    cmd.arg(&script).arg("16M").env("PYTHON_ALLOC_CORRUPT", "1");
    let out = run(cmd, b"", "python_alloc (corrupted)");
    let stdout = String::from_utf8_lossy(&out.stdout);
    assert_eq!(out.status.code(), Some(1), "{stdout}");
    assert!(stdout.starts_with("mismatch chunk "), "{stdout}");
}

// ---- programs under uswap run -------------------------------------------------------

#[test]
fn malloc_stress_under_uswap_run() {
    malloc_stress_does_its_native_work("thread");
}

/// malloc_stress under `uswap run` in fault mode `mode`: its output is the one it prints
/// without uswap.
fn malloc_stress_does_its_native_work(mode: &str) {
    let _heavy = heavy();
    let tmp = TempDir::new().unwrap();
    let Some(exe) = build_malloc_stress(tmp.path()) else {
        return;
    };
    let args = ["4", "256M"];
    let mut cmd = uswap_run_in(mode, tmp.path(), Some(MEMORY), &exe);
    cmd.args(args);
    let line = expect_ok(&run(cmd, b"", "uswap run malloc_stress"), "malloc_stress");

    // It did exactly the work it does on its own (the same seed, the same blocks).
    let mut cmd = Command::new(&exe);
    cmd.args(args).env("TMPDIR", tmp.path());
    let native = expect_ok(&run(cmd, b"", "malloc_stress"), "malloc_stress");
    assert_eq!(line, native);
}

/// Every allocation entry point uswap run interposes (aligned allocations,
/// malloc_usable_size, reallocarray, mmap/munmap/mremap/MAP_FIXED), its data verified after
/// four times the limit has pushed it out.
#[test]
fn allocation_api_under_uswap_run() {
    let _heavy = heavy();
    let tmp = TempDir::new().unwrap();
    let Some(exe) = build_c_program(tmp.path(), "alloc_api") else {
        return;
    };
    let mut cmd = uswap_run(tmp.path(), Some(MEMORY), &exe);
    cmd.arg("256");
    expect_ok(&run(cmd, b"", "uswap run alloc_api"), "alloc_api");
}

/// Memory grown the ways programs grow it stays under the limit: its resident anonymous
/// memory (RssAnon) at 4 times the limit is the limit plus uswap's metadata, where it once
/// grew past the limit (a `realloc` that moved a large block took it from uswap's own heap).
fn heap_stays_under_the_limit(way: &str) {
    let _heavy = heavy();
    let tmp = TempDir::new().unwrap();
    let Some(exe) = build_c_program(tmp.path(), "heap_limit") else {
        return;
    };
    let mut cmd = uswap_run_in("auto", tmp.path(), Some(MEMORY), &exe);
    cmd.args([way, "256"]);
    let line = expect_ok(&run(cmd, b"", "uswap run heap_limit"), "heap_limit");
    let peak: u64 = line
        .rsplit(' ')
        .next()
        .and_then(|n| n.parse().ok())
        .unwrap_or_else(|| panic!("heap_limit printed no peak: {line}"));
    // The page table, LRU and swap map of a 4 GiB region, touched where used, and the
    // libraries' own memory: a few MiB.
    let slack_mib = 16;
    assert!(
        peak <= (MEMORY_BYTES >> 20) + slack_mib,
        "{way}: peak RssAnon {peak} MiB under a {MEMORY} limit ({line})"
    );
}

#[test]
fn realloc_growth_stays_under_the_limit() {
    heap_stays_under_the_limit("realloc");
}

#[test]
fn realloc_moves_stay_under_the_limit() {
    heap_stays_under_the_limit("realloc2");
}

#[test]
fn mremap_growth_stays_under_the_limit() {
    heap_stays_under_the_limit("mremap");
}

/// A heap reserved `PROT_NONE` and committed by fixed mappings, as HotSpot and Go do: once
/// the kernel's memory, outside the limit.
#[test]
fn heap_committed_by_fixed_mappings_stays_under_the_limit() {
    heap_stays_under_the_limit("reserve");
}

/// A heap reserved `PROT_NONE` and committed by `mprotect`, as V8 does. Its committed part
/// ends inside fault-around windows; a window spanning two protections once made faults
/// retry forever.
#[test]
fn heap_committed_by_mprotect_stays_under_the_limit() {
    heap_stays_under_the_limit("mprotect");
}

// ---- runtimes' heaps: the JVM, Go, V8 --------------------------------------------------

/// A runtime's heap-churning program (tests/programs/HeapChurn.java, heap_churn_go,
/// heap_churn.js: an object graph 3-4 times the limit, churned, collected and checked)
/// printed `ok` and kept its resident anonymous memory at the limit plus `own_mib`: the
/// runtime's memory outside its heap and uswap's metadata. Unlimited, each holds more
/// than its graph (345 MiB for the JVM's 192 MiB).
fn runtime_heap_stays_under_the_limit(cmd: Command, what: &str, own_mib: u64) {
    let (out, peak) = run_sampled(cmd, b"", what);
    let line = expect_ok(&out, what);
    assert!(
        peak <= (MEMORY_BYTES >> 20) + own_mib,
        "{what}: peak RssAnon {peak} MiB under a {MEMORY} limit ({line})"
    );
}

/// HotSpot reserves its heap `PROT_NONE` and commits in it by fixed mappings, GC threads
/// touch it in parallel, and its null checks and safepoints are SIGSEGVs its own handler
/// must get. Its memory beside the heap (metaspace, code cache, GC data, stacks) measured
/// about 22 MiB.
fn java_heap_stays_under_the_limit(gc: &str) {
    let _heavy = heavy();
    let (Some(java), Some(javac)) = (installed("java"), installed("javac")) else {
        return;
    };
    let tmp = TempDir::new().unwrap();
    let classes = tmp.path().join("classes");
    let out = Command::new(javac)
        .arg("-d")
        .arg(&classes)
        .arg(program_source("HeapChurn.java"))
        .output()
        .expect("javac runs");
    assert!(out.status.success(), "javac: {out:?}");
    let mut cmd = uswap_run_in("auto", tmp.path(), Some(MEMORY), &java);
    // No hsperfdata file in /tmp.
    cmd.args([
        &format!("-XX:+Use{gc}GC"),
        "-XX:-UsePerfData",
        "-Xmx512m",
        "-cp",
    ]);
    cmd.arg(&classes).args(["HeapChurn", "192"]);
    runtime_heap_stays_under_the_limit(cmd, &format!("java {gc}"), 40);
}

#[test]
fn java_g1_heap_stays_under_the_limit() {
    java_heap_stays_under_the_limit("G1");
}

#[test]
fn java_parallel_gc_heap_stays_under_the_limit() {
    java_heap_stays_under_the_limit("Parallel");
}

/// tests/programs/heap_churn_go built with cgo (`cgo`) or static, into `dir`, with Go's
/// caches there too; None after a SKIPPED line without Go.
fn build_go_program(dir: &Path, cgo: bool) -> Option<PathBuf> {
    let go = installed("go")?;
    let exe = dir.join(if cgo {
        "heap_churn_cgo"
    } else {
        "heap_churn_static"
    });
    let out = Command::new(go)
        .args(["build", "-o"])
        .arg(&exe)
        .arg(".")
        .current_dir(program_source("heap_churn_go"))
        .env("CGO_ENABLED", if cgo { "1" } else { "0" })
        .env("GOCACHE", dir.join("gocache"))
        .env("GOPATH", dir.join("gopath"))
        .env("GOTOOLCHAIN", "local")
        .output()
        .expect("go build runs");
    assert!(out.status.success(), "go build: {out:?}");
    Some(exe)
}

/// Go's runtime reserves arenas and commits them by fixed mappings; built with cgo it maps
/// them through the C library and runs under the limit (in thread mode: its signal
/// handlers need its own signal stacks). A static build cannot be preloaded: the refusal
/// says why and what to do.
#[test]
fn go_heap_stays_under_the_limit_and_a_static_build_is_refused_with_the_fix() {
    let _heavy = heavy();
    let tmp = TempDir::new().unwrap();
    let Some(cgo) = build_go_program(tmp.path(), true) else {
        return;
    };
    let mut cmd = uswap_run_in("auto", tmp.path(), Some(MEMORY), &cgo);
    cmd.arg("192");
    runtime_heap_stays_under_the_limit(cmd, "go (cgo)", 24);

    let static_exe = build_go_program(tmp.path(), false).unwrap();
    let mut cmd = uswap_run_in("auto", tmp.path(), Some(MEMORY), &static_exe);
    cmd.arg("192");
    let out = run(cmd, b"", "go (static)");
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(
        !out.status.success()
            && stderr.contains("statically linked Go program")
            && stderr.contains("CGO_ENABLED=1")
            && stderr.contains("--backend kernel"),
        "{out:?}"
    );
}

/// V8 reserves a pointer-compression cage and commits pages in it with `mprotect`; node's
/// Buffers come from `malloc`. Half Buffers, half objects, at 4 times the limit.
#[test]
fn node_heap_stays_under_the_limit() {
    let _heavy = heavy();
    let Some(node) = installed("node") else {
        return;
    };
    let tmp = TempDir::new().unwrap();
    let mut cmd = uswap_run_in("auto", tmp.path(), Some(MEMORY), &node);
    cmd.arg("--max-old-space-size=2048")
        .arg(program_source("heap_churn.js"))
        .arg("256");
    runtime_heap_stays_under_the_limit(cmd, "node", 24);
}

/// Ranges given back with munmap and mapped again by other threads read as zeros while
/// reclaim moves pages out (a page moved out between the discard and the kernel's zap once
/// came back with its old data).
#[test]
fn unmapped_ranges_mapped_again_read_as_zeros() {
    let _heavy = heavy();
    let tmp = TempDir::new().unwrap();
    let Some(exe) = build_c_program(tmp.path(), "mmap_reuse") else {
        return;
    };
    let mut cmd = uswap_run(tmp.path(), Some("32M"), &exe);
    cmd.arg("4");
    expect_ok(&run(cmd, b"", "uswap run mmap_reuse"), "mmap_reuse");
}

/// Programs a program starts draw from the one limit, as processes of one cgroup do: two
/// children that each touch more than half of it hold, together, about the limit plus
/// their own overhead (each would hold nearly all of it with a limit of its own). Both
/// measure only once both have filled their memory: a child that ran alone (the other one
/// not started yet on a busy machine) may hold the whole limit then, rightly. With
/// `--stats-dir`, each leaves its counters when it exits, so a run's swapping can be
/// totalled after it ends (`uswap bench run` does): files named by their pids, and between
/// them they swapped out.
#[test]
fn programs_a_program_starts_share_its_limit() {
    let _heavy = heavy();
    let Some(python) = python3() else {
        return;
    };
    let tmp = TempDir::new().unwrap();
    let child = r#"
import sys
a = [bytes([i % 251]) * 4096 for i in range(56 * 256)]
assert all(x[0] == i % 251 for i, x in enumerate(a))
print("filled", flush=True)
sys.stdin.readline()
rss = [l for l in open("/proc/self/status") if l.startswith("VmRSS:")][0].split()[1]
print(rss)
"#;
    let parent = format!(
        "import subprocess, sys\n\
         ps = [subprocess.Popen([sys.executable, '-c', {child:?}], stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True) for _ in range(2)]\n\
         assert all(p.stdout.readline() == 'filled\\n' for p in ps)\n\
         for p in ps: p.stdin.write('measure\\n'); p.stdin.flush()\n\
         rss = [int(p.communicate()[0]) for p in ps]\n\
         assert all(p.returncode == 0 for p in ps)\n\
         print('ok', sum(rss), *[p.pid for p in ps], 'rss', rss)\n"
    );
    let stats = tmp.path().join("stats");
    let options = ["--stats-dir", stats.to_str().unwrap()];
    let mut cmd = uswap_run_with("thread", &options, tmp.path(), Some(MEMORY), &python);
    cmd.args(["-c", &parent]);
    let line = expect_ok(
        &run(cmd, b"", "uswap run python (two children)"),
        "children",
    );
    let total_kib: u64 = line.split_whitespace().nth(1).unwrap().parse().unwrap();
    // 64 MiB shared, plus per child the interpreter and uswap's own memory (about 20 MiB
    // measured; each child alone holds about 85 MiB, so a limit of its own would show as
    // about 170).
    let shared_bound = (MEMORY_BYTES >> 10) + 2 * 32 * 1024;
    assert!(
        total_kib < shared_bound,
        "{line}: more than one limit's worth resident"
    );
    let leftovers: Vec<_> = fs::read_dir(tmp.path().join("swap")).unwrap().collect();
    assert!(
        leftovers.is_empty(),
        "the tree's memory cgroup file is gone: {leftovers:?}"
    );
    let mut swapped_out = 0;
    for pid in line.split_whitespace().skip(2).take(2) {
        let path = stats.join(format!("{pid}.json"));
        let text = fs::read_to_string(&path)
            .unwrap_or_else(|e| panic!("child {pid} left no counters at {path:?}: {e}"));
        let snapshot: serde_json::Value = serde_json::from_str(&text).unwrap();
        assert_eq!(snapshot["pid"].to_string(), pid, "{text}");
        swapped_out += snapshot["stats"]["vmstat"]["pswpout"].as_u64().unwrap();
    }
    assert!(
        swapped_out > 0,
        "two children over one limit swapped nothing out"
    );
}

/// Memory the limit does not hold is shown and said: a program whose memory is in uswap
/// hears nothing; one that then holds 160 MiB in a private executable mapping (the
/// kernel's, as a JIT's code is) sees it as `outside` in `uswap stat` and is told once.
#[test]
fn memory_outside_the_limit_is_shown_and_said_once() {
    let _heavy = heavy();
    let Some(python) = python3() else {
        return;
    };
    let tmp = TempDir::new().unwrap();
    let runtime = tmp.path().join("run");
    let script = r#"
import mmap, sys, time
held = [bytes([i % 251]) * 4096 for i in range(40 * 256)]
time.sleep(11)
print("outside now", file=sys.stderr, flush=True)
m = mmap.mmap(-1, 160 << 20, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS,
              prot=mmap.PROT_READ | mmap.PROT_WRITE | mmap.PROT_EXEC)
for i in range(0, 160 << 20, 4096):
    m[i] = 1
time.sleep(12)
assert all(x[0] == i % 251 for i, x in enumerate(held))
print("ok held and outside")
"#;
    let mut cmd = uswap_run_in("auto", tmp.path(), Some(MEMORY), &python);
    cmd.args(["-c", script]).env("USWAP_RUNTIME_DIR", &runtime);
    let stat_outside = |pid: libc::pid_t| {
        thread::sleep(Duration::from_secs(16));
        let stat = Command::new(env!("CARGO_BIN_EXE_uswap"))
            .args(["stat", &pid.to_string()])
            .env("USWAP_RUNTIME_DIR", &runtime)
            .output()
            .unwrap();
        let block = String::from_utf8_lossy(&stat.stdout);
        let outside_mib: f64 = block
            .split("outside ")
            .nth(1)
            .and_then(|rest| rest.split(' ').next())
            .and_then(|n| n.parse().ok())
            .unwrap_or_else(|| panic!("uswap stat shows no outside figure:\n{block}{stat:?}"));
        assert!(
            (150.0..200.0).contains(&outside_mib),
            "160 MiB outside shown as {outside_mib}:\n{block}"
        );
    };
    let what = "uswap run python (memory outside)";
    let (out, _) = run_watched(cmd, b"", what, stat_outside);
    expect_ok(&out, "python (memory outside)");
    let stderr = String::from_utf8_lossy(&out.stderr);
    let said = stderr.match_indices("outside uswap and its limit").count();
    let after = stderr.split("outside now").nth(1).unwrap_or("");
    assert!(
        said == 1 && after.contains("outside uswap and its limit"),
        "said {said} times, and only after the memory went outside:\n{stderr}"
    );
}

#[test]
fn python_alloc_under_uswap_run() {
    let _heavy = heavy();
    let Some(python) = python3() else {
        return;
    };
    let tmp = TempDir::new().unwrap();
    let mut cmd = uswap_run(tmp.path(), Some(MEMORY), &python);
    cmd.arg(program_source("python_alloc.py")).arg("200M");
    let line = expect_ok(&run(cmd, b"", "uswap run python_alloc"), "python_alloc");
    let bytes: u64 = line
        .split_whitespace()
        .nth(3)
        .and_then(|b| b.parse().ok())
        .unwrap_or_else(|| panic!("ok <chunks> chunks <bytes> bytes: {line}"));
    assert!(bytes >= 3 * MEMORY_BYTES, "{line}");
}

#[test]
fn fork_verify_under_uswap_run() {
    let _heavy = heavy();
    let tmp = TempDir::new().unwrap();
    let Some(exe) = build_c_program(tmp.path(), "fork_verify") else {
        return;
    };
    let mut cmd = uswap_run(tmp.path(), Some(MEMORY), &exe);
    cmd.args(["2", "128M"]);
    let line = expect_ok(&run(cmd, b"", "uswap run fork_verify"), "fork_verify");
    assert_eq!(line, format!("ok 2 children {} bytes", 2 * MEMORY_BYTES));
}

/// A program's region is built when it first commits more than its start-up allowance (4
/// MiB at a 32 MiB limit) or starts a thread: what it wrote before (600 small blocks and a
/// block of a MiB) comes through the build, a fork before it (the child builds a region of
/// its own) and swapping, in both fault modes, and so do a page it only read (the zero
/// page) and one it lazily freed; before the build the program has no userfaultfd.
#[test]
fn memory_written_before_the_region_is_built_comes_through_under_uswap_run() {
    let _heavy = heavy();
    let tmp = TempDir::new().unwrap();
    let Some(exe) = build_c_program(tmp.path(), "late_region") else {
        return;
    };
    for (mode, trigger) in [("auto", None), ("thread", None), ("auto", Some("thread"))] {
        let mut cmd = uswap_run_in(mode, tmp.path(), Some("32M"), &exe);
        cmd.arg("96").args(trigger);
        let line = expect_ok(&run(cmd, b"", "uswap run late_region"), "late_region");
        let counts: Vec<u32> = line
            .split_whitespace()
            .filter_map(|w| w.parse().ok())
            .collect();
        assert!(
            line.starts_with("ok before") && counts.len() == 2,
            "{mode} {trigger:?}: ok before <n> userfaultfds after <m>: {line}"
        );
        assert_eq!(counts[0], 0, "{mode} {trigger:?}: no region before: {line}");
        assert!(counts[1] > 0, "{mode} {trigger:?}: a region after: {line}");
    }
}

/// `uswap stat` of a program that has not built its region (a `sleep`) says so, with the
/// way to have it from the start; with `--start-allowance 0` the same program answers.
#[test]
fn uswap_stat_tells_a_program_without_a_region_and_the_allowance_0_builds_one_at_start() {
    let tmp = TempDir::new().unwrap();
    let runtime = tmp.path().join("run");
    for (options, built) in [(&[][..], false), (&["--start-allowance", "0"][..], true)] {
        let mut cmd = uswap_run_with("auto", options, tmp.path(), Some(MEMORY), "sleep");
        cmd.arg("3").env("USWAP_RUNTIME_DIR", &runtime);
        let stat = |pid: libc::pid_t| {
            thread::sleep(Duration::from_millis(1500));
            let out = Command::new(env!("CARGO_BIN_EXE_uswap"))
                .args(["stat", &pid.to_string()])
                .env("USWAP_RUNTIME_DIR", &runtime)
                .output()
                .unwrap();
            let (stdout, stderr) = (
                String::from_utf8_lossy(&out.stdout),
                String::from_utf8_lossy(&out.stderr),
            );
            if built {
                assert!(
                    out.status.success() && stdout.contains("resident"),
                    "{options:?}: {stdout}{stderr}"
                );
            } else {
                assert!(
                    !out.status.success()
                        && stderr.contains("has not built its region yet")
                        && stderr.contains("--start-allowance 0"),
                    "{options:?}: {stdout}{stderr}"
                );
            }
        };
        let (out, _) = run_watched(cmd, b"", "uswap run sleep", stat);
        assert!(out.status.success(), "{options:?}: {out:?}");
    }
}

/// SIGBUS mode with syscall dispatch: the program's threads serve their own faults and
/// its system calls (a pipe, a temporary file, /dev/zero over its blocks) still read and
/// write its swapped-out memory; the result is the program's own, as in thread mode.
#[test]
fn malloc_stress_under_uswap_run_sigbus_mode() {
    malloc_stress_does_its_native_work("sigbus");
}

#[test]
fn malloc_stress_under_uswap_run_auto_mode() {
    malloc_stress_does_its_native_work("auto");
}

/// System calls between swapped-out heap blocks (pipes, sockets, vectors), and threads
/// cancelled while blocked in a call, direct or dispatched: `direct_calls.c` checks itself.
#[test]
fn system_calls_and_cancellation_under_uswap_run_auto_mode() {
    system_calls_and_cancellation_in("auto");
}

#[test]
fn system_calls_and_cancellation_under_uswap_run() {
    system_calls_and_cancellation_in("thread");
}

fn system_calls_and_cancellation_in(mode: &str) {
    let _heavy = heavy();
    let tmp = TempDir::new().unwrap();
    let Some(exe) = build_c_program(tmp.path(), "direct_calls") else {
        return;
    };
    let mut cmd = uswap_run_in(mode, tmp.path(), Some(MEMORY), &exe);
    cmd.args(["256", "2000"]);
    let line = expect_ok(&run(cmd, b"", "uswap run direct_calls"), "direct_calls");
    assert_eq!(line, "ok 4096 blocks");
}

/// SIGBUS mode with syscall dispatch under what a Python program does around its memory:
/// subprocesses (vfork), fork, threads, a signal timer, pipes over swapped-out objects.
#[test]
fn python_processes_threads_and_signals_under_uswap_run_sigbus_mode() {
    let _heavy = heavy();
    let Some(python) = python3() else {
        return;
    };
    let tmp = TempDir::new().unwrap();
    let script = r#"
import faulthandler, os, signal, subprocess, threading
faulthandler.enable()
a = [bytes([i % 251]) * 4096 for i in range(40000)]
ticks = []
signal.signal(signal.SIGALRM, lambda s, f: ticks.append(1))
signal.setitimer(signal.ITIMER_REAL, 0.002, 0.002)
r = subprocess.run(["sh", "-c", "echo out; echo err >&2; exit 3"], capture_output=True)
assert (r.returncode, r.stdout, r.stderr) == (3, b"out\n", b"err\n"), r
pid = os.fork()
if pid == 0:
    os._exit(0 if all(x[0] == i % 251 for i, x in enumerate(a)) else 1)
assert os.waitpid(pid, 0)[1] == 0
def work(k):
    b = [bytes([(i + k) % 13]) * 8192 for i in range(5000)]
    assert all(x[0] == (i + k) % 13 for i, x in enumerate(b))
ts = [threading.Thread(target=work, args=(k,)) for k in range(3)]
[t.start() for t in ts]
[t.join() for t in ts]
rd, wr = os.pipe()
for i in range(0, 40000, 97):
    os.write(wr, a[i])
    assert os.read(rd, 4096) == a[i]
signal.setitimer(signal.ITIMER_REAL, 0)
assert all(x[0] == i % 251 for i, x in enumerate(a))
print("ok", len(ticks) > 0)
"#;
    let mut cmd = uswap_run_in("sigbus", tmp.path(), Some(MEMORY), &python);
    cmd.args(["-c", script]);
    let line = expect_ok(&run(cmd, b"", "uswap run python (sigbus)"), "python");
    assert_eq!(line, "ok True");
}

/// SIGBUS mode: a process that ends inside a signal handler that interrupted a dispatched
/// call (a child forked in the handler calls `exit`, then the parent's SIGTERM handler
/// does, as PostgreSQL's processes do). The handler runs on uswap's alternate stack, which
/// the thread's exit once unmapped under it: both died of SIGSEGV.
#[test]
fn exit_inside_signal_handlers_under_uswap_run_sigbus_mode() {
    let _heavy = heavy();
    let tmp = TempDir::new().unwrap();
    let Some(exe) = build_c_program(tmp.path(), "handler_exit") else {
        return;
    };
    let mut cmd = uswap_run_in("sigbus", tmp.path(), Some(MEMORY), &exe);
    cmd.arg("192M");
    let line = expect_ok(&run(cmd, b"", "uswap run handler_exit"), "handler_exit");
    assert_eq!(line, format!("ok {} bytes", 3 * MEMORY_BYTES));
}

/// A fork made with the raw clone system call (no `pthread_atfork` handlers run): through
/// the C library's `syscall` in both modes, and by the program's own syscall instruction
/// under dispatch. Each child checks its parent's memory and writes its own. The children
/// died of SIGSEGV: their regions were gone.
#[test]
fn raw_clone_children_get_their_memory_under_uswap_run() {
    let _heavy = heavy();
    let tmp = TempDir::new().unwrap();
    let Some(exe) = build_c_program(tmp.path(), "raw_clone") else {
        return;
    };
    for (mode, how) in [("thread", None), ("auto", None), ("auto", Some("asm"))] {
        let mut cmd = uswap_run_in(mode, tmp.path(), Some(MEMORY), &exe);
        cmd.args(["128", "3"]).args(how);
        let what = format!("uswap run --fault-mode {mode} raw_clone {how:?}");
        let line = expect_ok(&run(cmd, b"", &what), "raw_clone");
        assert_eq!(line, "ok 3 children", "{what}");
    }
}

/// SIGBUS mode: a program whose handler needs the large alternate stack it set up (256 KiB
/// of a 1 MiB one, after a 512 KiB one). Its handlers ran on uswap's 64 KiB stack, whatever
/// the program asked for: SIGSEGV.
#[test]
fn a_handler_on_a_large_alternate_stack_under_uswap_run_sigbus_mode() {
    let _heavy = heavy();
    let tmp = TempDir::new().unwrap();
    let Some(exe) = build_c_program(tmp.path(), "big_altstack") else {
        return;
    };
    let mut cmd = uswap_run_in("sigbus", tmp.path(), Some(MEMORY), &exe);
    cmd.arg("20");
    let line = expect_ok(&run(cmd, b"", "uswap run big_altstack"), "big_altstack");
    assert_eq!(line, "ok 20 handlers");
}

/// SIGBUS mode: threads cancelled while they fault on memory past the limit (asynchronous
/// cancellation, as will-it-scale's workers) and while blocked in a dispatched read into
/// it (deferred). The cancellation signal once acted inside uswap's SIGBUS handler, whose
/// frame cannot unwind: the process aborted.
#[test]
fn cancelled_threads_under_uswap_run_sigbus_mode() {
    let _heavy = heavy();
    let tmp = TempDir::new().unwrap();
    let Some(exe) = build_c_program(tmp.path(), "cancel_workers") else {
        return;
    };
    let mut cmd = uswap_run_in("sigbus", tmp.path(), Some(MEMORY), &exe);
    cmd.args(["2", "96M"]);
    let line = expect_ok(&run(cmd, b"", "uswap run cancel_workers"), "cancel_workers");
    assert_eq!(line, "ok 2 workers");
}

#[test]
fn python_fork_under_uswap_run() {
    let _heavy = heavy();
    let Some(python) = python3() else {
        return;
    };
    let tmp = TempDir::new().unwrap();
    let mut cmd = uswap_run(tmp.path(), Some(MEMORY), python);
    cmd.arg(program_source("python_fork.py")).arg("96");
    let line = expect_ok(&run(cmd, b"", "uswap run python_fork.py"), "python_fork");
    assert_eq!(line, format!("ok 3 workers {} bytes", 96u64 << 20));
}

#[test]
fn stress_ng_vm_under_uswap_run() {
    let _heavy = heavy();
    let Some(stress_ng) = installed("stress-ng") else {
        return;
    };
    let tmp = TempDir::new().unwrap();
    let mut cmd = uswap_run(tmp.path(), Some(MEMORY), stress_ng);
    cmd.args(["--vm", "1", "--vm-bytes", "256M", "--vm-method", "all"])
        .args(["--verify", "-t", "5s", "--temp-path"])
        .arg(tmp.path())
        .current_dir(tmp.path());
    let out = run(cmd, b"", "uswap run stress-ng");
    let stderr = String::from_utf8_lossy(&out.stderr);
    check_run_exists(&stderr);
    assert!(
        out.status.success() && stderr.contains("successful run completed"),
        "stress-ng: {}\nstdout:\n{}\nstderr:\n{stderr}",
        describe(out.status),
        String::from_utf8_lossy(&out.stdout)
    );
}

// ---- redis ---------------------------------------------------------------------------

/// 200k keys of 1 KiB: about 250 MiB in redis, four times [`MEMORY`].
const REDIS_KEYS: u64 = 200_000;
const REDIS_VALUE: usize = 1024;
/// Commands sent before reading their replies.
const REDIS_BATCH: u64 = 256;

fn redis_key(i: u64) -> Vec<u8> {
    format!("key:{i:08}").into_bytes()
}

/// The value of key `i`: 1 KiB that differs from every other key's.
fn redis_value(i: u64) -> Vec<u8> {
    let mut state = i.wrapping_mul(0x9e37_79b9_7f4a_7c15) ^ 0x5eed;
    let mut v = Vec::with_capacity(REDIS_VALUE);
    while v.len() < REDIS_VALUE {
        // splitmix64
        state = state.wrapping_add(0x9e37_79b9_7f4a_7c15);
        let mut z = state;
        z = (z ^ (z >> 30)).wrapping_mul(0xbf58_476d_1ce4_e5b9);
        z = (z ^ (z >> 27)).wrapping_mul(0x94d0_49bb_1331_11eb);
        v.extend_from_slice(&(z ^ (z >> 31)).to_le_bytes());
    }
    v.truncate(REDIS_VALUE);
    v
}

/// One RESP reply.
#[derive(Debug, PartialEq, Eq)]
enum Reply {
    Status(String),
    Error(String),
    Int(i64),
    Bulk(Option<Vec<u8>>),
    Array(Option<Vec<Reply>>),
}

/// A RESP client over one connection, enough for these tests.
struct Redis {
    reader: BufReader<TcpStream>,
    writer: TcpStream,
}

impl Redis {
    fn connect(port: u16) -> std::io::Result<Redis> {
        let stream = TcpStream::connect(("127.0.0.1", port))?;
        stream.set_read_timeout(Some(Duration::from_secs(60)))?;
        stream.set_nodelay(true)?;
        Ok(Redis {
            reader: BufReader::with_capacity(1 << 16, stream.try_clone()?),
            writer: stream,
        })
    }

    /// Whether a server on `port` answers PING with PONG; any failure on the way (nothing
    /// listening yet, a reset, a server loading its dump answering -LOADING) is a no. A
    /// connection to the port from the same port (TCP's self-connect, possible while
    /// nothing listens on an ephemeral port) is a no too.
    fn answers_ping(port: u16) -> bool {
        let ping = || -> std::io::Result<bool> {
            let mut redis = Redis::connect(port)?;
            if redis.writer.local_addr()?.port() == port {
                return Ok(false);
            }
            redis.writer.write_all(b"*1\r\n$4\r\nPING\r\n")?;
            let mut line = String::new();
            redis.reader.read_line(&mut line)?;
            Ok(line == "+PONG\r\n")
        };
        ping().unwrap_or(false)
    }

    fn encode(buf: &mut Vec<u8>, args: &[&[u8]]) {
        buf.extend_from_slice(format!("*{}\r\n", args.len()).as_bytes());
        for a in args {
            buf.extend_from_slice(format!("${}\r\n", a.len()).as_bytes());
            buf.extend_from_slice(a);
            buf.extend_from_slice(b"\r\n");
        }
    }

    fn line(&mut self) -> String {
        let mut line = String::new();
        self.reader
            .read_line(&mut line)
            .expect("a reply from redis");
        assert!(
            line.ends_with("\r\n"),
            "a cut reply line from redis: {line:?}"
        );
        line.truncate(line.len() - 2);
        line
    }

    fn reply(&mut self) -> Reply {
        let line = self.line();
        let (kind, rest) = line.split_at(1);
        let number = || -> i64 { rest.parse().expect("a number in a RESP reply") };
        match kind {
            "+" => Reply::Status(rest.to_string()),
            "-" => Reply::Error(rest.to_string()),
            ":" => Reply::Int(number()),
            "$" if number() < 0 => Reply::Bulk(None),
            "$" => {
                let mut data = vec![0; number() as usize + 2];
                self.reader.read_exact(&mut data).expect("a bulk reply");
                assert_eq!(&data[data.len() - 2..], b"\r\n");
                data.truncate(data.len() - 2);
                Reply::Bulk(Some(data))
            }
            "*" if number() < 0 => Reply::Array(None),
            "*" => Reply::Array(Some((0..number()).map(|_| self.reply()).collect())),
            _ => panic!("not a RESP reply: {line:?}"),
        }
    }

    fn command(&mut self, args: &[&[u8]]) -> Reply {
        let mut buf = Vec::new();
        Self::encode(&mut buf, args);
        self.writer.write_all(&buf).expect("sending to redis");
        self.reply()
    }

    /// Sends the commands in batches and calls `check` with each one's index and reply.
    fn pipeline(
        &mut self,
        n: u64,
        mut command: impl FnMut(u64, &mut Vec<u8>),
        mut check: impl FnMut(u64, Reply),
    ) {
        let mut buf = Vec::new();
        let mut start = 0;
        while start < n {
            let end = (start + REDIS_BATCH).min(n);
            buf.clear();
            (start..end).for_each(|i| command(i, &mut buf));
            self.writer.write_all(&buf).expect("sending to redis");
            (start..end).for_each(|i| check(i, self.reply()));
            start = end;
        }
    }

    fn info_field(&mut self, section: &str, field: &str) -> String {
        let Reply::Bulk(Some(info)) = self.command(&[b"INFO", section.as_bytes()]) else {
            panic!("INFO {section} is not a bulk reply");
        };
        let info = String::from_utf8_lossy(&info).into_owned();
        info.lines()
            .find_map(|l| l.strip_prefix(&format!("{field}:")).map(str::to_owned))
            .unwrap_or_else(|| panic!("no {field} in INFO {section}:\n{info}"))
    }
}

fn free_port() -> u16 {
    TcpListener::bind(("127.0.0.1", 0))
        .and_then(|l| l.local_addr())
        .expect("a free local port")
        .port()
}

/// A redis-server (under `uswap run` or on its own) and where its log goes.
struct RedisServer {
    running: Running,
    port: u16,
    log: PathBuf,
}

impl RedisServer {
    /// Starts `cmd` (a redis-server command line, maybe behind `uswap run`) on a free port
    /// with its files in `dir` and waits until it answers PING.
    fn start(mut cmd: Command, dir: &Path, what: &str) -> RedisServer {
        let port = free_port();
        let log = dir.join(format!("redis-{port}.log"));
        let log_file = File::create(&log).expect("a redis log file");
        cmd.args(["--port", &port.to_string(), "--bind", "127.0.0.1"])
            .args(["--save", "", "--appendonly", "no", "--daemonize", "no"])
            .arg("--dir")
            .arg(dir)
            .stdin(Stdio::null())
            .stdout(log_file.try_clone().unwrap())
            .stderr(log_file);
        let mut server = RedisServer {
            running: Running::start(cmd, what),
            port,
            log,
        };
        server.wait_ready();
        server
    }

    fn log(&self) -> String {
        fs::read_to_string(&self.log).unwrap_or_default()
    }

    fn wait_ready(&mut self) {
        let start = Instant::now();
        loop {
            if let Some(status) = self.running.exited() {
                let log = self.log();
                check_run_exists(&log);
                panic!(
                    "{} exited ({}) before it answered:\n{log}",
                    self.running.what,
                    describe(status)
                );
            }
            if Redis::answers_ping(self.port) {
                return;
            }
            assert!(
                start.elapsed() < Duration::from_secs(60),
                "{} did not answer PING within 60 s:\n{}",
                self.running.what,
                self.log()
            );
            thread::sleep(Duration::from_millis(50));
        }
    }

    fn client(&self) -> Redis {
        Redis::connect(self.port).expect("connecting to redis")
    }

    /// SHUTDOWN NOSAVE, and the server (and `uswap run`) exits 0.
    fn shutdown(mut self) {
        let mut redis = self.client();
        let mut buf = Vec::new();
        Redis::encode(&mut buf, &[b"SHUTDOWN", b"NOSAVE"]);
        redis.writer.write_all(&buf).expect("sending SHUTDOWN");
        // No reply: the server closes the connection as it exits.
        let status = self.running.wait(Duration::from_secs(60));
        assert!(
            status.success(),
            "{} after SHUTDOWN: {}\n{}",
            self.running.what,
            describe(status),
            self.log()
        );
    }
}

/// SETs every key and checks each reply.
fn redis_load(redis: &mut Redis) {
    redis.pipeline(
        REDIS_KEYS,
        |i, buf| Redis::encode(buf, &[b"SET", &redis_key(i), &redis_value(i)]),
        |i, reply| assert_eq!(reply, Reply::Status("OK".into()), "SET key {i}"),
    );
}

/// GETs every key and compares it with what was SET.
fn redis_check(redis: &mut Redis) {
    let Reply::Int(size) = redis.command(&[b"DBSIZE"]) else {
        panic!("DBSIZE is not an integer");
    };
    assert_eq!(size as u64, REDIS_KEYS, "DBSIZE");
    redis.pipeline(
        REDIS_KEYS,
        |i, buf| Redis::encode(buf, &[b"GET", &redis_key(i)]),
        |i, reply| match reply {
            Reply::Bulk(Some(v)) if v == redis_value(i) => {}
            Reply::Bulk(Some(v)) => {
                let at = v.iter().zip(redis_value(i)).position(|(a, b)| *a != b);
                panic!(
                    "GET key:{i:08}: {} bytes, first difference at {at:?} (expected {REDIS_VALUE} bytes)",
                    v.len()
                );
            }
            other => panic!("GET key:{i:08}: {other:?}"),
        },
    );
}

/// redis-server under `uswap run --memory 64M`, or None after a SKIPPED line.
fn redis_under_uswap(tmp: &Path) -> Option<RedisServer> {
    redis_under_uswap_in("thread", tmp)
}

/// [`redis_under_uswap`] in fault mode `mode`.
fn redis_under_uswap_in(mode: &str, tmp: &Path) -> Option<RedisServer> {
    let redis_server = installed("redis-server")?;
    let data = tmp.join("data");
    fs::create_dir_all(&data).unwrap();
    let cmd = uswap_run_in(mode, tmp, Some(MEMORY), redis_server);
    Some(RedisServer::start(cmd, &data, "uswap run redis-server"))
}

#[test]
fn redis_under_uswap_run() {
    redis_holds_its_data("thread");
}

/// SIGBUS mode with syscall dispatch: redis reads requests into and writes replies from
/// swapped-out memory, and installs its own SIGBUS crash handler, which gets only the
/// signals that are not uswap's faults.
#[test]
fn redis_under_uswap_run_sigbus_mode() {
    redis_holds_its_data("sigbus");
}

#[test]
fn redis_under_uswap_run_auto_mode() {
    redis_holds_its_data("auto");
}

fn redis_holds_its_data(mode: &str) {
    let _heavy = heavy();
    let tmp = TempDir::new().unwrap();
    let Some(server) = redis_under_uswap_in(mode, tmp.path()) else {
        return;
    };
    let mut redis = server.client();
    redis_load(&mut redis);
    let used: u64 = redis.info_field("memory", "used_memory").parse().unwrap();
    assert!(
        used > 3 * MEMORY_BYTES,
        "redis holds {used} bytes, not more than 3 x {MEMORY}"
    );
    redis_check(&mut redis);
    server.shutdown();
}

#[test]
fn redis_bgsave_under_uswap_run() {
    let _heavy = heavy();
    let tmp = TempDir::new().unwrap();
    let Some(server) = redis_under_uswap(tmp.path()) else {
        return;
    };
    let mut redis = server.client();
    redis_load(&mut redis);
    let reply = redis.command(&[b"BGSAVE"]);
    assert!(
        matches!(&reply, Reply::Status(s) if s.starts_with("Background saving")),
        "BGSAVE: {reply:?}"
    );
    let start = Instant::now();
    while redis.info_field("persistence", "rdb_bgsave_in_progress") != "0" {
        assert!(
            start.elapsed() < PROGRAM_TIMEOUT,
            "BGSAVE still running:\n{}",
            server.log()
        );
        thread::sleep(Duration::from_millis(100));
    }
    assert_eq!(
        redis.info_field("persistence", "rdb_last_bgsave_status"),
        "ok",
        "{}",
        server.log()
    );
    drop(redis);
    server.shutdown();

    // A plain redis-server loads the dump: every key must be there.
    let data = tmp.path().join("data");
    assert!(data.join("dump.rdb").is_file(), "no dump.rdb after BGSAVE");
    let plain = RedisServer::start(
        Command::new(which("redis-server").unwrap()),
        &data,
        "redis-server on the dump",
    );
    redis_check(&mut plain.client());
    plain.shutdown();
}

// ---- PostgreSQL ----------------------------------------------------------------------

/// The newest PostgreSQL's programs (Debian's layout), or None after a SKIPPED line.
fn postgres_programs() -> Option<PathBuf> {
    let bin = fs::read_dir("/usr/lib/postgresql")
        .into_iter()
        .flatten()
        .filter_map(|e| Some(e.ok()?.path().join("bin")))
        .filter(|bin| bin.join("postgres").is_file())
        .max();
    if bin.is_none() {
        eprintln!("SKIPPED: postgresql not installed");
    }
    bin
}

/// The `postgres` user's uid and gid: PostgreSQL refuses to run as root.
fn postgres_user() -> Option<(u32, u32)> {
    // SAFETY: a lookup by a NUL-terminated name; the record is read at once.
    let pw = unsafe { libc::getpwnam(c"postgres".as_ptr()).as_ref() };
    if pw.is_none() {
        eprintln!("SKIPPED: no postgres user");
    }
    pw.map(|pw| (pw.pw_uid, pw.pw_gid))
}

/// `cmd` run as the `postgres` user, keeping CAP_SYS_PTRACE (what userfaultfd asks of a
/// user without access to /dev/userfaultfd).
fn as_postgres(setpriv: &Path, cmd: &Command) -> Command {
    let mut wrapped = Command::new(setpriv);
    wrapped
        .args(["--reuid=postgres", "--regid=postgres", "--init-groups"])
        .args(["--inh-caps=+sys_ptrace", "--ambient-caps=+sys_ptrace", "--"])
        .arg(cmd.get_program())
        .args(cmd.get_args());
    for (key, value) in cmd.get_envs() {
        match value {
            Some(value) => wrapped.env(key, value),
            None => wrapped.env_remove(key),
        };
    }
    wrapped
}

/// SIGBUS mode under PostgreSQL 15's process model: the postmaster forks its helper
/// processes inside signal handlers that interrupt its dispatched waits, and it and they
/// exit there. Every one of them died of SIGSEGV at exit while uswap's alternate stack was
/// unmapped under them. A table several times the limit is written and read back, and the
/// server stops cleanly.
#[test]
fn postgres_under_uswap_run_sigbus_mode() {
    let _heavy = heavy();
    let (Some(bin), Some(setpriv), Some((uid, gid))) =
        (postgres_programs(), installed("setpriv"), postgres_user())
    else {
        return;
    };
    // SAFETY: plain system call.
    if unsafe { libc::geteuid() } != 0 {
        eprintln!("SKIPPED: postgres under uswap run needs root (to become postgres)");
        return;
    }
    let tmp = TempDir::new().unwrap();
    let dir = tmp.path();
    let data = dir.join("data");
    let port = free_port().to_string();
    let mut server = uswap_run_in("sigbus", dir, Some(MEMORY), bin.join("postgres"));
    for path in [dir.to_path_buf(), dir.join("swap")] {
        std::os::unix::fs::chown(&path, Some(uid), Some(gid)).expect("chown to postgres");
    }
    let postgres = |program: &str| {
        let mut cmd = Command::new(bin.join(program));
        cmd.env("PGHOST", dir).env("PGPORT", &port);
        cmd
    };

    let mut initdb = postgres("initdb");
    initdb
        .arg("-D")
        .arg(&data)
        .args(["-A", "trust", "--no-sync"]);
    let out = run(as_postgres(&setpriv, &initdb), b"", "initdb");
    assert!(out.status.success(), "initdb: {out:?}");

    let log = dir.join("server.log");
    let log_file = File::create(&log).expect("a server log");
    server
        .arg("-D")
        .arg(&data)
        .arg("-k")
        .arg(dir)
        .args(["-p", &port, "-c", "listen_addresses="])
        .stdout(log_file.try_clone().unwrap())
        .stderr(log_file);
    let mut running = Running::start(as_postgres(&setpriv, &server), "uswap run postgres");
    let log_text = || fs::read_to_string(&log).unwrap_or_default();
    let start = Instant::now();
    while !postgres("pg_isready").output().unwrap().status.success() {
        assert!(
            running.exited().is_none(),
            "postgres exited:\n{}",
            log_text()
        );
        assert!(start.elapsed() < PROGRAM_TIMEOUT, "postgres never ready");
        thread::sleep(Duration::from_millis(100));
    }

    let mut psql = postgres("psql");
    // The backend sorts the table in its own memory (work_mem), several times the limit.
    psql.args(["-d", "postgres", "-v", "ON_ERROR_STOP=1", "-At", "-c"])
        .arg("create table t as select g, repeat(md5(g::text), 8) m from generate_series(1, 200000) g")
        .args(["-c", "set work_mem = '1GB'", "-c"])
        .arg("select count(*), sum(length(m)) from (select m from t order by m) s");
    let out = run(as_postgres(&setpriv, &psql), b"", "psql");
    assert!(
        out.status.success(),
        "psql: {out:?}\nserver log:\n{}",
        log_text()
    );
    let stdout = String::from_utf8_lossy(&out.stdout);
    assert_eq!(stdout.lines().last(), Some("200000|51200000"), "{stdout}");

    let mut stop = postgres("pg_ctl");
    stop.arg("-D").arg(&data).args(["stop", "-m", "fast"]);
    run(as_postgres(&setpriv, &stop), b"", "pg_ctl stop");
    let status = running.wait(PROGRAM_TIMEOUT);
    let text = log_text();
    assert!(
        status.success() && !text.contains("terminated by signal"),
        "postgres under uswap run: {}\nserver log:\n{text}",
        describe(status)
    );
}

// ---- pass-through --------------------------------------------------------------------

#[test]
fn exit_status_passes_through() {
    let tmp = TempDir::new().unwrap();
    for code in [7, 0] {
        let mut cmd = uswap_run(tmp.path(), None, "sh");
        cmd.args(["-c", &format!("exit {code}")]);
        let out = run(cmd, b"", "uswap run sh");
        check_run_exists(&String::from_utf8_lossy(&out.stderr));
        assert_eq!(
            out.status.code(),
            Some(code),
            "sh -c 'exit {code}': {}\n{}",
            describe(out.status),
            String::from_utf8_lossy(&out.stderr)
        );
    }
}

#[test]
fn sigterm_to_uswap_run_reaches_the_program() {
    let tmp = TempDir::new().unwrap();
    let flag = tmp.path().join("got-sigterm");
    // The trap notes the signal, then the shell dies of it. The loop runs builtins only
    // (dash runs traps between commands), so nothing forks.
    let script = r#"trap 'echo got > "$1"; trap - TERM; kill -TERM $$' TERM
echo ready
while :; do :; done"#;
    let mut cmd = uswap_run(tmp.path(), None, "sh");
    cmd.args(["-c", script, "sh"])
        .arg(&flag)
        .stdin(Stdio::null())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped());
    let mut running = Running::start(cmd, "uswap run sh");
    let stderr = read_in_thread(running.child.stderr.take().unwrap());
    let stdout = running.child.stdout.take().unwrap();
    let (tx, rx) = std::sync::mpsc::channel();
    thread::spawn(move || {
        let mut line = String::new();
        // A program that never says ready exits (and closes stdout) or is killed below.
        let _ = BufReader::new(stdout).read_line(&mut line);
        let _ = tx.send(line);
    });
    let line = rx.recv_timeout(Duration::from_secs(60)).unwrap_or_default();
    if line != "ready\n" {
        running.kill_group();
        let stderr = String::from_utf8_lossy(&stderr.join().unwrap()).into_owned();
        check_run_exists(&stderr);
        panic!("the program did not start: stdout {line:?}\nstderr:\n{stderr}");
    }

    // SAFETY: a signal to the process this test started.
    assert_eq!(unsafe { libc::kill(running.pid(), libc::SIGTERM) }, 0);
    let status = running.wait(Duration::from_secs(30));
    let stderr = String::from_utf8_lossy(&stderr.join().unwrap()).into_owned();
    assert_eq!(
        fs::read_to_string(&flag).ok().as_deref(),
        Some("got\n"),
        "the program's SIGTERM trap did not run; uswap run: {}\n{stderr}",
        describe(status)
    );
    assert!(
        status.code() == Some(128 + libc::SIGTERM) || status.signal() == Some(libc::SIGTERM),
        "uswap run should exit 143 or die of SIGTERM like its program: {}\n{stderr}",
        describe(status)
    );
}

#[test]
fn stdin_and_stdout_pass_through() {
    let tmp = TempDir::new().unwrap();
    let out = run(uswap_run(tmp.path(), None, "cat"), b"hi\n", "uswap run cat");
    check_run_exists(&String::from_utf8_lossy(&out.stderr));
    assert!(out.status.success(), "{}", describe(out.status));
    assert_eq!(out.stdout, b"hi\n");

    // More than a pipe holds, through cat's heap buffer, with a limit.
    let data: Vec<u8> = (0..8u32 << 20).map(|i| (i ^ (i >> 11)) as u8).collect();
    let out = run(
        uswap_run(tmp.path(), Some("16M"), "cat"),
        &data,
        "uswap run cat",
    );
    assert!(out.status.success(), "{}", describe(out.status));
    assert!(
        out.stdout == data,
        "cat gave back {} bytes, not the {} sent",
        out.stdout.len(),
        data.len()
    );
}

// ---- what swap leaves on the disk -------------------------------------------------------

/// A small ext4 file system in an image file, loop-mounted; unmounted when dropped (panics
/// included), and the image goes with its temporary directory.
struct ImageMount {
    image: PathBuf,
    dir: PathBuf,
    mounted: bool,
}

impl ImageMount {
    /// None after a visible SKIPPED line where this machine cannot make one (not root, no
    /// mkfs.ext4, no loop devices).
    fn new(tmp: &Path) -> Option<ImageMount> {
        // SAFETY: plain system call.
        if unsafe { libc::geteuid() } != 0 {
            eprintln!("SKIPPED: mounting a file system image needs root");
            return None;
        }
        let mkfs = installed("mkfs.ext4")?;
        let image = tmp.join("fs.img");
        File::create(&image)
            .and_then(|f| f.set_len(128 << 20))
            .expect("an image file");
        let made = Command::new(mkfs)
            .args(["-q", "-F", "-E", "nodiscard"])
            .arg(&image)
            .output()
            .expect("mkfs.ext4 runs");
        assert!(made.status.success(), "mkfs.ext4: {made:?}");
        let dir = tmp.join("mnt");
        fs::create_dir(&dir).unwrap();
        let mount = Command::new("mount")
            .args(["-o", "loop"])
            .arg(&image)
            .arg(&dir)
            .output()
            .expect("mount runs");
        if !mount.status.success() {
            eprintln!(
                "SKIPPED: cannot loop-mount an image here: {}",
                String::from_utf8_lossy(&mount.stderr).trim()
            );
            return None;
        }
        Some(ImageMount {
            image,
            dir,
            mounted: true,
        })
    }

    /// Unmounts it and returns the raw image.
    fn unmount_and_read(mut self) -> Vec<u8> {
        self.unmount();
        fs::read(&self.image).expect("the image reads")
    }

    fn unmount(&mut self) {
        if std::mem::take(&mut self.mounted) {
            let out = Command::new("umount").arg(&self.dir).output();
            if !out.is_ok_and(|o| o.status.success()) {
                let _ = Command::new("umount").arg("-l").arg(&self.dir).status();
            }
        }
    }
}

impl Drop for ImageMount {
    fn drop(&mut self) {
        self.unmount();
    }
}

/// A program's marked data, pushed to a swap file on a small ext4 file system mounted
/// without discard, is not on the file system's raw image after the program exits: the
/// slots were sealed with a key that died with the program. With `--swap-encryption off`
/// the same run leaves the marker there (the check can fail): deleting the swap file frees
/// its blocks but does not clear them. The compressed tier is off in both runs: the
/// markers compress, and with it on most would never reach the file (what it writes back
/// goes out sealed all the same).
#[test]
fn a_programs_swapped_data_is_not_on_the_raw_disk_after_it_exits() {
    const MARKER: &[u8; 16] = b"uSwApMaRkEr-7f3A";
    let _heavy = heavy();
    for encryption in ["on", "off"] {
        let tmp = TempDir::new().unwrap();
        let Some(exe) = build_c_program(tmp.path(), "marker_fill") else {
            return;
        };
        let Some(image) = ImageMount::new(tmp.path()) else {
            return;
        };
        preload_library_built();
        let mut cmd = Command::new(env!("CARGO_BIN_EXE_uswap"));
        cmd.args(["run", "--memory", "16M", "--ztier", "off"])
            .args(["--swap-encryption", encryption])
            .arg("--swap-dir")
            .arg(&image.dir)
            .arg("--")
            .arg(&exe)
            .arg("64")
            .env("TMPDIR", tmp.path());
        expect_ok(&run(cmd, b"", "uswap run marker_fill"), "marker_fill");
        let raw = image.unmount_and_read();
        let found = raw
            .chunks_exact(MARKER.len())
            .filter(|c| c == MARKER)
            .count();
        eprintln!("swap encryption {encryption}: {found} markers on the raw image after exit");
        match encryption {
            "on" => assert_eq!(found, 0, "marked data left on the disk with encryption on"),
            _ => assert!(
                found >= (32 << 20) / MARKER.len(),
                "only {found} markers left with encryption off: the check could not fail"
            ),
        }
    }
}

/// `setpriv` changes user keeping its capabilities, raises them again in its own thread
/// only (`capset`), then changes group: the C library's change of ids in every thread fails
/// in uswap's threads, which lost their capabilities with the user, and it aborted the
/// program with SIGABRT and no message. The call is refused with EPERM and a line that says
/// why, and `setpriv` fails as it does for any refused call: loudly, by exit status. A
/// program whose region is not built yet builds it before it changes ids (the user that
/// started it may use userfaultfd and the swap directory, the new one may not): the same.
#[test]
fn a_change_of_group_that_uswaps_threads_cannot_follow_is_refused_loudly() {
    let Some(setpriv) = installed("setpriv") else {
        return;
    };
    // SAFETY: plain system call.
    if unsafe { libc::geteuid() } != 0 {
        eprintln!("SKIPPED: changing user needs root");
        return;
    }
    for mode in ["thread", "sigbus"] {
        let tmp = TempDir::new().unwrap();
        let mut cmd = uswap_run_in(mode, tmp.path(), Some("64M"), &setpriv);
        cmd.args([
            "--reuid=65534",
            "--regid=65534",
            "--clear-groups",
            "--",
            "true",
        ]);
        let out = run(cmd, b"", "uswap run setpriv");
        let stderr = String::from_utf8_lossy(&out.stderr);
        assert!(
            out.status.code().is_some_and(|c| c != 0),
            "{mode}: setpriv must fail by exit status, not by a signal: {:?}\n{stderr}",
            out.status
        );
        assert!(
            stderr.contains("uswap: setresgid refused")
                && stderr.contains("setpriv … -- uswap run"),
            "{mode}: {stderr}"
        );
    }
}
