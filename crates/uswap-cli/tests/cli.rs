//! The `uswap` binary end to end: bad input is refused clearly, and a small benchmark runs
//! clean. (The kernel backend is not run here: it needs root and changes the machine.)

use std::process::{Command, Output};

fn uswap(args: &[&str]) -> Output {
    Command::new(env!("CARGO_BIN_EXE_uswap"))
        .args(args)
        .output()
        .expect("the uswap binary runs")
}

/// Runs `args`, expects failure, and returns stderr.
/// Runs a command that must succeed and print one JSON object, and parses it.
fn json_report(args: &[&str]) -> serde_json::Value {
    let out = uswap(args);
    let stdout = String::from_utf8_lossy(&out.stdout);
    assert!(
        out.status.success(),
        "stdout: {stdout}\nstderr: {}",
        String::from_utf8_lossy(&out.stderr)
    );
    serde_json::from_str(&stdout).expect("one JSON object")
}

fn refused(args: &[&str]) -> String {
    let out = uswap(args);
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
fn bad_choices_are_refused() {
    let err = refused(&["bench", "random", "--fault-mode", "fast"]);
    assert!(err.contains("fast") && err.contains("sigbus"), "{err}");
    let err = refused(&["bench", "random", "--backend", "zram"]);
    assert!(err.contains("zram") && err.contains("kernel"), "{err}");
    let err = refused(&["bench", "random", "--write-pct", "101"]);
    assert!(err.contains("--write-pct"), "{err}");
}

#[test]
fn a_small_random_run_is_verified_clean() {
    let r = json_report(&[
        "bench",
        "random",
        "--size",
        "8M",
        "--memory",
        "4M",
        "--seconds",
        "1",
        "--json",
    ]);
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
