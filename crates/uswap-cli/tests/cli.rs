//! The `uswap` binary end to end: bad input is refused clearly, and a small benchmark runs
//! clean. (The kernel backend is not run here: it needs root and changes the machine;
//! tests/kernel_run.rs runs it.)

use std::os::unix::fs::{DirBuilderExt, PermissionsExt};
use std::os::unix::process::CommandExt;
use std::path::Path;
use std::process::{Child, Command, Output, Stdio};
use std::time::{Duration, Instant};

const BIN: &str = env!("CARGO_BIN_EXE_uswap");

/// `uswap` with its control sockets in a temporary directory (`bench random` serves one),
/// so nothing is left in /tmp.
fn uswap(args: &[&str]) -> Output {
    in_runtime(tempfile::tempdir().unwrap().path(), args)
}

/// Runs a command that must succeed and print one JSON object, and parses it.
fn json_report(args: &[&str]) -> serde_json::Value {
    json_of(args, uswap(args))
}

fn json_of(args: &[&str], out: Output) -> serde_json::Value {
    serde_json::from_str(&stdout_of(args, out)).expect("one JSON object")
}

/// The output of a command that must succeed.
fn stdout_of(args: &[&str], out: Output) -> String {
    let stdout = String::from_utf8_lossy(&out.stdout).into_owned();
    assert!(
        out.status.success(),
        "{args:?}\nstdout: {stdout}\nstderr: {}",
        String::from_utf8_lossy(&out.stderr)
    );
    stdout
}

/// Runs `args`, expects failure, and returns stderr.
fn refused(args: &[&str]) -> String {
    refusal_of(args, uswap(args))
}

fn refusal_of(args: &[&str], out: Output) -> String {
    let stderr = String::from_utf8_lossy(&out.stderr).into_owned();
    assert!(
        !out.status.success(),
        "{args:?} should fail; stderr: {stderr}"
    );
    stderr
}

#[test]
fn a_zero_size_is_refused() {
    let err = refused(&["bench", "random", "--size", "0"]);
    assert!(
        err.contains("--size") && err.contains("greater than 0"),
        "{err}"
    );
}

#[test]
fn a_size_with_an_unknown_suffix_is_refused() {
    let err = refused(&["bench", "random", "--memory", "12X"]);
    assert!(
        err.contains("--memory") && err.contains("12X") && err.contains("suffix"),
        "{err}"
    );
}

#[test]
fn zero_threads_are_refused() {
    let err = refused(&["bench", "random", "--threads", "0"]);
    assert!(err.contains("--threads") && err.contains('0'), "{err}");
}

#[test]
fn a_missing_swap_directory_is_refused() {
    let err = refused(&["bench", "random", "--swap-dir", "/nonexistent/dir"]);
    assert!(
        err.contains("/nonexistent/dir") && err.contains("No such file"),
        "{err}"
    );
}

#[test]
fn a_bad_library_setting_names_the_setting() {
    let err = refused(&["bench", "fault", "--handlers", "0", "--seconds", "0.1"]);
    assert!(
        err.contains("handler threads") && err.contains('0'),
        "{err}"
    );
}

#[test]
fn uswap_only_options_and_a_repeated_mode_are_refused_before_anything_runs() {
    let err = refused(&[
        "run",
        "--backend",
        "kernel",
        "--fault-mode",
        "thread",
        "--vm-size",
        "1G",
        "--",
        "true",
    ]);
    assert!(
        err.contains("--vm-size, --fault-mode") && err.contains("--backend kernel"),
        "{err}"
    );
    let err = refused(&[
        "bench",
        "run",
        "--memory",
        "64M",
        "--modes",
        "thread,thread",
        "--",
        "true",
    ]);
    assert!(err.contains("thread twice"), "{err}");
    let err = refused(&[
        "bench", "run", "--memory", "64M", "--modes", "zram", "--", "true",
    ]);
    assert!(err.contains("zram") && err.contains("kernel"), "{err}");
}

#[test]
fn bad_choices_are_refused() {
    let err = refused(&["bench", "random", "--fault-mode", "fast"]);
    assert!(err.contains("fast") && err.contains("sigbus"), "{err}");
    let err = refused(&["bench", "random", "--backend", "zram"]);
    assert!(err.contains("zram") && err.contains("kernel"), "{err}");
    let err = refused(&["bench", "random", "--write-pct", "101"]);
    assert!(err.contains("--write-pct"), "{err}");
}

/// A second of `bench random` over 8 MiB in 4 MiB.
const SMALL_RANDOM_RUN: [&str; 8] = [
    "bench",
    "random",
    "--size",
    "8M",
    "--memory",
    "4M",
    "--seconds",
    "1",
];

#[test]
fn a_small_random_run_is_verified_clean() {
    let r = json_report(&[&SMALL_RANDOM_RUN[..], &["--json"]].concat());
    assert_eq!(r["verify_errors"], 0, "{r}");
    assert!(r["accesses"].as_u64().unwrap() > 0, "{r}");
    assert_eq!(r["backend"], "uswap");
    // The region was twice the memory: the run must really have swapped.
    assert!(r["uswap"]["vmstat"]["pswpin"].as_u64().unwrap() > 0, "{r}");
}

#[test]
fn swapback_refuses_bad_readahead_settings_before_setting_anything_up() {
    let err = refused(&["bench", "swapback", "--page-cluster", "9"]);
    assert!(err.contains("--page-cluster") && err.contains('9'), "{err}");
    let err = refused(&["bench", "swapback", "--readahead", "sideways"]);
    assert!(err.contains("sideways") && err.contains("scaling"), "{err}");
    // Refused before the kernel backend makes its cgroup or swap.
    let err = refused(&[
        "bench",
        "swapback",
        "--backend",
        "kernel",
        "--readahead",
        "fixed",
    ]);
    assert!(
        err.contains("fixed") && err.contains("--backend uswap"),
        "{err}"
    );
    let err = refused(&[
        "bench",
        "swapback",
        "--backend",
        "kernel",
        "--readahead",
        "none",
        "--page-cluster",
        "2",
    ]);
    assert!(err.contains("page-cluster 0"), "{err}");
}

#[test]
fn swapback_refuses_a_set_that_fits_in_memory() {
    let err = refused(&["bench", "swapback", "--size", "64M", "--memory", "64M"]);
    assert!(err.contains("--memory") && err.contains("nothing"), "{err}");
    let err = refused(&["bench", "swapback", "--mode", "off"]);
    assert!(err.contains("touch") && err.contains("swapoff"), "{err}");
}

#[test]
fn a_small_probe_run_swaps_and_reports_like_ping() {
    let r = json_report(&[
        "bench",
        "probe",
        "--size",
        "8M",
        "--memory",
        "4M",
        "--hot",
        "64K",
        "--interval-us",
        "200",
        "--seconds",
        "1",
        "--json",
    ]);
    assert_eq!(
        (&r["bench"], &r["hot"]),
        (&"probe".into(), &(64 << 10).into())
    );
    assert_eq!(r["verify_errors"], 0, "{r}");
    let rtt = &r["rtt"];
    let probes = rtt["probes"].as_u64().unwrap();
    // One probe every 200 µs for about a second, at most.
    let most = (r["measured_s"].as_f64().unwrap() / 200e-6) as u64 + 1;
    assert!((1..=most).contains(&probes), "{r}");
    let us = |k: &str| rtt[k].as_f64().unwrap();
    assert!(
        us("min_us") <= us("avg_us") && us("avg_us") <= us("max_us"),
        "{r}"
    );
    assert!(
        us("p50_us") <= us("p99_us") && us("p99_us") <= us("p999_us"),
        "{r}"
    );
    assert!(r["writes"].as_u64().unwrap() > 0, "{r}");
    // The thrashed set was twice the memory and every access a write: pages went out.
    assert!(r["uswap"]["vmstat"]["pswpout"].as_u64().unwrap() > 0, "{r}");
}

#[test]
fn probe_refuses_a_hot_set_that_would_not_stay_resident() {
    let err = refused(&["bench", "probe", "--hot", "200M", "--memory", "256M"]);
    assert!(
        err.contains("--hot") && err.contains("half of --memory"),
        "{err}"
    );
}

/// `uswap` with its control sockets in `runtime`.
fn in_runtime(runtime: &Path, args: &[&str]) -> Output {
    Command::new(BIN)
        .args(args)
        .env("USWAP_RUNTIME_DIR", runtime)
        .output()
        .expect("the uswap binary runs")
}

/// Whoever answers at a process's socket path must be that process: a socket another
/// process serves there (a user who made the directory first) gets nothing sent to it, and
/// the error says whose it is and what to do.
#[test]
fn a_control_socket_served_by_another_process_is_refused() {
    let tmp = tempfile::tempdir().unwrap();
    let runtime = tmp.path().join("run");
    std::fs::create_dir(&runtime).unwrap();
    let mut target = Command::new("sleep").arg("30").spawn().unwrap();
    let pid = target.id().to_string();
    let listener =
        std::os::unix::net::UnixListener::bind(runtime.join(format!("{pid}.sock"))).unwrap();
    let impostor = std::thread::spawn(move || {
        let (mut conn, _) = listener.accept().unwrap();
        conn.set_read_timeout(Some(Duration::from_millis(500)))
            .unwrap();
        let mut got = Vec::new();
        let _ = std::io::Read::read_to_end(&mut conn, &mut got);
        let _ = std::io::Write::write_all(&mut conn, b"{\"knobs\":{}}\n");
        got
    });
    let args = ["ctl", &pid, "memory=1G"];
    let err = refusal_of(&args, in_runtime(&runtime, &args));
    let me = std::process::id().to_string();
    assert!(
        err.contains(&format!("is not process {pid}'s")) && err.contains(&me),
        "{err}"
    );
    assert!(impostor.join().unwrap().is_empty(), "nothing was sent");
    target.kill().unwrap();
    target.wait().unwrap();
}

/// A swap directory in RAM saves no memory: the benchmark says so before it runs.
#[test]
fn a_swap_dir_in_ram_is_warned_about() {
    let shm = Path::new("/dev/shm");
    if !uswap_core::Backing::of_path(shm).is_ok_and(|b| b.in_memory()) {
        eprintln!("skipped: /dev/shm is not in memory here");
        return;
    }
    let dir = tempfile::tempdir_in(shm).unwrap();
    let out = Command::new(BIN)
        .args(SMALL_RANDOM_RUN)
        .arg("--swap-dir")
        .arg(dir.path())
        .output()
        .unwrap();
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(
        out.status.success() && stderr.contains("saves no memory"),
        "{stderr}"
    );
}

/// Waits for `socket` to appear while `bench` runs.
fn wait_for_socket(socket: &Path, bench: &mut Child) {
    let start = Instant::now();
    while !socket.exists() {
        if let Some(status) = bench.try_wait().unwrap() {
            panic!("the benchmark ended ({status}) before its control socket appeared");
        }
        assert!(
            start.elapsed() < Duration::from_secs(30),
            "no control socket"
        );
        std::thread::sleep(Duration::from_millis(20));
    }
}

#[test]
fn a_running_benchmark_is_watched_and_tuned_through_its_control_socket() {
    let tmp = tempfile::tempdir().unwrap();
    let runtime = tmp.path().join("run");
    let mut bench = Command::new(BIN)
        .args(["bench", "random", "--size", "8M", "--memory", "4M"])
        .args(["--seconds", "8", "--json"])
        .env("USWAP_RUNTIME_DIR", &runtime)
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .unwrap();
    let pid = bench.id().to_string();
    let socket = runtime.join(format!("{pid}.sock"));
    wait_for_socket(&socket, &mut bench);

    let args = ["stat", &pid, "--json"];
    let stat = json_of(&args, in_runtime(&runtime, &args));
    assert_eq!(stat["pid"].to_string(), pid);
    assert_eq!(stat["knobs"]["memory"], 4 << 20);
    assert!(
        stat["stats"]["vmstat"]["pgfault"].as_u64().unwrap() > 0,
        "{stat}"
    );
    let args = ["stat", &pid];
    let block = stdout_of(&args, in_runtime(&runtime, &args));
    assert!(
        block.contains("resident") && block.contains("major"),
        "{block}"
    );

    let args = ["ctl", &pid, "page-cluster=2"];
    assert!(stdout_of(&args, in_runtime(&runtime, &args)).contains("page-cluster=2"));
    let args = ["ctl", &pid];
    let knobs = stdout_of(&args, in_runtime(&runtime, &args));
    assert!(
        knobs.contains("page-cluster=2") && knobs.contains("memory=4M"),
        "{knobs}"
    );
    let args = ["ctl", &pid, "swappiness=60"];
    let err = refusal_of(&args, in_runtime(&runtime, &args));
    for name in ["swappiness", "memory", "swap_ra_policy", "page-cluster"] {
        assert!(err.contains(name), "{err}");
    }
    refused_to_another_user(tmp.path(), &runtime, &pid);

    let out = bench.wait_with_output().unwrap();
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    assert!(!socket.exists(), "the socket goes with the benchmark");
}

/// With `$XDG_RUNTIME_DIR` set (and no `USWAP_RUNTIME_DIR`), the socket is in
/// `$XDG_RUNTIME_DIR/uswap`, and `uswap stat` run without it finds it there through the
/// target's environment, past a socket another process serves where its own
/// `USWAP_RUNTIME_DIR` points.
#[test]
fn the_socket_is_in_the_users_runtime_dir_and_stat_finds_it_there() {
    let tmp = tempfile::tempdir().unwrap();
    let xdg = tmp.path().join("xdg");
    std::fs::DirBuilder::new().mode(0o700).create(&xdg).unwrap();
    let own = tmp.path().join("own");
    std::fs::DirBuilder::new().mode(0o700).create(&own).unwrap();
    let mut bench = Command::new(BIN)
        .args(["bench", "random", "--size", "8M", "--memory", "4M"])
        .args(["--seconds", "4", "--json"])
        .env_remove("USWAP_RUNTIME_DIR")
        .env("XDG_RUNTIME_DIR", &xdg)
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .unwrap();
    let pid = bench.id().to_string();
    let socket = xdg.join("uswap").join(format!("{pid}.sock"));
    wait_for_socket(&socket, &mut bench);
    let _impostor =
        std::os::unix::net::UnixListener::bind(own.join(format!("{pid}.sock"))).unwrap();
    let args = ["stat", &pid, "--json"];
    let out = Command::new(BIN)
        .args(args)
        .env("USWAP_RUNTIME_DIR", &own)
        .env_remove("XDG_RUNTIME_DIR")
        .output()
        .unwrap();
    let stat = json_of(&args, out);
    assert_eq!(stat["pid"].to_string(), pid);
    let out = bench.wait_with_output().unwrap();
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    assert!(!socket.exists(), "the socket goes with the benchmark");
}

/// As root, checks that `uswap stat` and `uswap ctl` run as nobody (uid 65534) get nothing
/// from the benchmark `pid` (a copy of the binary in `tmp` lets them run it).
fn refused_to_another_user(tmp: &Path, runtime: &Path, pid: &str) {
    // SAFETY: geteuid has no preconditions.
    if unsafe { libc::geteuid() } != 0 {
        eprintln!("SKIPPED the other-user check: needs root");
        return;
    }
    std::fs::set_permissions(tmp, std::fs::Permissions::from_mode(0o755)).unwrap();
    let bin = tmp.join("uswap");
    std::fs::copy(BIN, &bin).unwrap();
    for args in [
        vec!["stat", pid, "--json"],
        vec!["ctl", pid, "page-cluster=0"],
    ] {
        let mut cmd = Command::new(&bin);
        cmd.args(&args)
            .env("USWAP_RUNTIME_DIR", runtime)
            .current_dir("/");
        // SAFETY: only system calls between fork and exec.
        unsafe {
            cmd.pre_exec(|| {
                if libc::setgroups(0, std::ptr::null()) != 0
                    || libc::setgid(65534) != 0
                    || libc::setuid(65534) != 0
                {
                    return Err(std::io::Error::last_os_error());
                }
                Ok(())
            })
        };
        let out = cmd.output().unwrap();
        let err = refusal_of(&args, out.clone());
        assert!(err.contains("permission denied"), "{err}");
        assert!(out.stdout.is_empty(), "{args:?} printed something");
    }
}

#[test]
fn stat_of_a_process_not_under_uswap_says_so() {
    let tmp = tempfile::tempdir().unwrap();
    let err = refusal_of(&["stat", "1"], in_runtime(tmp.path(), &["stat", "1"]));
    assert!(
        err.contains("process 1 is not running under uswap"),
        "{err}"
    );
    let err = refused(&["ctl", "5000000"]);
    assert!(err.contains("no process 5000000"), "{err}");
}
