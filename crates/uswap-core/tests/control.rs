//! The control socket end to end, in this process: statistics that move, knobs that take
//! effect, errors for bad requests, a private socket that goes with its server, and other
//! users kept out.

mod common;

use serde_json::{json, Value};
use std::os::unix::fs::{MetadataExt, PermissionsExt};
use std::os::unix::process::CommandExt;
use std::path::{Path, PathBuf};
use std::sync::{Arc, Mutex, MutexGuard};
use uswap_core::control::{self, ControlServer, RUNTIME_DIR_VAR};
use uswap_core::{Config, Error, LruPolicy, Readahead, ReadaheadPolicy, Region, PAGE_SIZE};

const MIB: u64 = 1 << 20;

/// A process has one control socket, and the tests point its directory elsewhere: they run
/// one at a time.
static SERIAL: Mutex<()> = Mutex::new(());

/// A private runtime directory (made by the server, inside a temporary one) for one test.
struct Runtime {
    _serial: MutexGuard<'static, ()>,
    tmp: tempfile::TempDir,
}

impl Runtime {
    fn new() -> Runtime {
        let serial = SERIAL.lock().unwrap_or_else(|e| e.into_inner());
        let tmp = tempfile::tempdir().unwrap();
        // Every test that reads the variable holds SERIAL.
        std::env::set_var(RUNTIME_DIR_VAR, tmp.path().join("run"));
        Runtime {
            _serial: serial,
            tmp,
        }
    }

    fn dir(&self) -> PathBuf {
        self.tmp.path().join("run")
    }
}

fn pid() -> u32 {
    std::process::id()
}

fn served(size: u64, memory: u64) -> (Arc<Region>, ControlServer) {
    let region = Arc::new(Region::new(size, Config::new(memory)).unwrap());
    let server = ControlServer::start(region.clone()).unwrap();
    (region, server)
}

fn stat() -> Value {
    control::request(pid(), &json!({"cmd": "stat"})).unwrap()
}

fn set(key: &str, value: Value) -> Result<Value, Error> {
    control::request(pid(), &json!({"cmd": "set", "key": key, "value": value}))
}

fn counter(snapshot: &Value, name: &str) -> u64 {
    snapshot["stats"]["vmstat"][name]
        .as_u64()
        .unwrap_or_else(|| panic!("no counter {name}: {snapshot}"))
}

fn fill(region: &Region, pages: std::ops::Range<usize>, version: u32) {
    for p in pages {
        unsafe { common::fill(region.as_ptr(), p, version) };
    }
}

#[test]
fn stat_reports_counters_that_move() {
    let _rt = Runtime::new();
    let (region, _server) = served(8 * MIB, 2 * MIB);
    let before = stat();
    assert_eq!(before["pid"], pid());
    assert_eq!(before["size"], 8 * MIB);
    assert_eq!(before["knobs"]["memory"], 2 * MIB);
    assert_eq!(counter(&before, "pswpout"), 0);
    // Four times the limit: pages must go out.
    let pages = region.len() / PAGE_SIZE;
    fill(&region, 0..pages, 1);
    let after = stat();
    assert!(counter(&after, "pgfault") > counter(&before, "pgfault"));
    assert!(counter(&after, "pswpout") > 0, "{after}");
    assert!(counter(&after, "pgsteal") > 0, "{after}");
    let stats = &after["stats"];
    assert!(
        stats["first_touch"]["count"].as_u64().unwrap() > 0,
        "{after}"
    );
    assert!(stats["resident_pages"].as_u64().unwrap() <= 2 * MIB / PAGE_SIZE as u64);
    assert!(stats["swap_used_pages"].as_u64().unwrap() > 0, "{after}");
    assert!(after.get("breakdown").is_none(), "breakdown is off");
}

#[test]
fn the_memory_limit_goes_down_and_up_and_data_survives() {
    let _rt = Runtime::new();
    let (region, _server) = served(16 * MIB, 8 * MIB);
    let pages = region.len() / PAGE_SIZE;
    fill(&region, 0..pages / 2, 1);
    assert!(region.resident_pages() > (2 * MIB / PAGE_SIZE as u64));
    assert_eq!(set("memory", json!("2M")).unwrap(), json!({"ok": true}));
    // Lowering reclaims before the reply, as a write to memory.max does.
    assert!(region.resident_pages() <= 2 * MIB / PAGE_SIZE as u64);
    assert_eq!(region.memory_limit(), 2 * MIB);
    set("memory", json!(12 * MIB)).unwrap();
    let knobs = control::request(pid(), &json!({"cmd": "get"})).unwrap();
    assert_eq!(knobs["knobs"]["memory"], 12 * MIB);
    assert_eq!(region.memory_limit(), 12 * MIB);
    for p in 0..pages / 2 {
        unsafe { common::check(region.as_ptr(), p, 1) }.unwrap();
    }
    region.check_invariants().unwrap();
}

#[test]
fn readahead_knobs_switch_the_running_region() {
    let _rt = Runtime::new();
    let (region, _server) = served(4 * MIB, 2 * MIB);
    set("page-cluster", json!(2)).unwrap();
    set("swap_ra_policy", json!("fixed")).unwrap();
    let want = Readahead {
        policy: ReadaheadPolicy::Fixed,
        page_cluster: 2,
    };
    assert_eq!(region.readahead(), want);
    set("page-cluster", json!("5")).unwrap();
    assert_eq!(region.readahead().page_cluster, 5);
    let knobs = control::request(pid(), &json!({"cmd": "get"})).unwrap();
    assert_eq!(
        knobs["knobs"],
        json!({"memory": 2 * MIB, "swap_ra_policy": "fixed", "page-cluster": 5,
               "lru_policy": "s3fifo", "references": "faults", "ztier": "on",
               "ztier_size": "auto"})
    );
    assert_eq!(stat()["stats"]["readahead"]["policy"], "fixed");
}

#[test]
fn the_lru_policy_switches_the_running_region_and_data_survives() {
    let _rt = Runtime::new();
    let (region, _server) = served(8 * MIB, 2 * MIB);
    let pages = region.len() / PAGE_SIZE;
    fill(&region, 0..pages, 1);
    assert_eq!(region.lru_policy(), LruPolicy::S3fifo, "the default");
    let done = set("lru_policy", json!("two-list")).unwrap();
    assert_eq!(done, json!({"ok": true}));
    assert_eq!(region.lru_policy(), LruPolicy::TwoList);
    let now = stat();
    assert_eq!(now["knobs"]["lru_policy"], "two-list");
    assert_eq!(now["stats"]["lru"]["policy"], "two-list");
    fill(&region, 0..pages, 2);
    set("lru_policy", json!("s3fifo")).unwrap();
    for p in 0..pages {
        unsafe { common::check(region.as_ptr(), p, 2) }.unwrap();
    }
    assert!(counter(&stat(), "workingset_refault") > 0);
    let refused = refusal(json!({"cmd": "set", "key": "lru_policy", "value": "lfu"}));
    assert!(
        refused.contains("s3fifo") && refused.contains("two-list"),
        "{refused}"
    );
    assert_eq!(region.lru_policy(), LruPolicy::S3fifo);
    region.check_invariants().unwrap();
}

/// The message of a refused request.
fn refusal(request: Value) -> String {
    match control::request(pid(), &request) {
        Err(Error::ControlRefused { message, .. }) => message,
        other => panic!("{request} should be refused, got {other:?}"),
    }
}

#[test]
fn bad_requests_get_error_replies_and_change_nothing() {
    let _rt = Runtime::new();
    let (region, server) = served(4 * MIB, 2 * MIB);
    let before = region.readahead();
    let unknown = refusal(json!({"cmd": "set", "key": "swappiness", "value": 60}));
    for name in ["swappiness", "memory", "swap_ra_policy", "page-cluster"] {
        assert!(unknown.contains(name), "{unknown}");
    }
    let bad = [
        ("page-cluster", json!(9), "0 to 8"),
        ("page-cluster", json!("many"), "many"),
        ("swap_ra_policy", json!("sideways"), "scaling"),
        ("memory", json!("12X"), "suffix"),
        ("memory", json!(1), "too small"),
        ("memory", json!(true), "string or number"),
    ];
    for (key, value, says) in bad {
        let msg = refusal(json!({"cmd": "set", "key": key, "value": value}));
        assert!(
            msg.contains(key) && msg.contains(says),
            "{key}={value}: {msg}"
        );
    }
    assert!(refusal(json!({"cmd": "reboot"})).contains("stat, get or set"));
    assert!(refusal(json!(["stat"])).contains("cmd"));
    // Not JSON at all, and no line end: the server answers and goes on serving.
    for raw in ["stat\n", "{\"cmd\":\"stat\"}"] {
        let reply = raw_exchange(server.path(), raw);
        assert!(reply.contains("bad request"), "{raw:?}: {reply}");
    }
    assert_eq!(region.readahead(), before);
    assert_eq!(region.memory_limit(), 2 * MIB);
    assert!(stat()["stats"].is_object());
}

/// Writes `raw`, half-closes, and returns the reply line.
fn raw_exchange(path: &Path, raw: &str) -> String {
    use std::io::{Read, Write};
    let mut s = std::os::unix::net::UnixStream::connect(path).unwrap();
    s.write_all(raw.as_bytes()).unwrap();
    s.shutdown(std::net::Shutdown::Write).unwrap();
    let mut reply = String::new();
    s.read_to_string(&mut reply).unwrap();
    reply
}

fn mode(path: &Path) -> u32 {
    std::fs::symlink_metadata(path).unwrap().mode() & 0o7777
}

#[test]
fn the_socket_is_private_and_goes_with_its_server() {
    let rt = Runtime::new();
    let (region, server) = served(4 * MIB, 2 * MIB);
    // The runtime directory is set, so the uid does not matter.
    let path = control::socket_path(pid(), 0);
    assert_eq!(server.path(), path);
    assert_eq!(path, rt.dir().join(format!("{}.sock", pid())));
    assert_eq!(mode(&rt.dir()), 0o700);
    assert_eq!(mode(&path), 0o600);
    assert!(
        matches!(
            ControlServer::start(region.clone()),
            Err(Error::ControlSocket { .. })
        ),
        "one control socket per process"
    );
    drop(server);
    assert!(!path.exists());
    assert!(matches!(
        control::request(pid(), &json!({"cmd": "stat"})),
        Err(Error::NotUnderUswap { .. })
    ));
    // A socket left by an earlier process with this pid is replaced.
    drop(std::os::unix::net::UnixListener::bind(&path).unwrap());
    let _server = ControlServer::start(region).unwrap();
    assert!(stat()["stats"].is_object());
}

#[test]
fn a_directory_others_could_control_is_refused() {
    let rt = Runtime::new();
    let region = Arc::new(Region::new(4 * MIB, Config::new(2 * MIB)).unwrap());
    let refused = |why: &str| match ControlServer::start(region.clone()) {
        Err(e @ Error::ControlDir { .. }) => assert!(e.to_string().contains(why), "{e}"),
        Err(e) => panic!("refused for another reason: {e}"),
        Ok(_) => panic!("{} was accepted ({why})", rt.dir().display()),
    };
    std::fs::create_dir(rt.dir()).unwrap();
    std::fs::set_permissions(rt.dir(), std::fs::Permissions::from_mode(0o755)).unwrap();
    refused("0755");
    std::fs::remove_dir(rt.dir()).unwrap();
    let elsewhere = rt.tmp.path().join("elsewhere");
    std::fs::create_dir(&elsewhere).unwrap();
    std::os::unix::fs::symlink(&elsewhere, rt.dir()).unwrap();
    refused("symbolic link");
    assert!(std::fs::read_dir(&elsewhere).unwrap().next().is_none());
}

#[test]
fn a_missing_process_and_one_without_uswap_are_told_apart() {
    let _rt = Runtime::new();
    // Above the kernel's largest pid (4194304).
    assert!(matches!(
        control::request(5_000_000, &json!({"cmd": "stat"})),
        Err(Error::NoSuchProcess { pid: 5_000_000 })
    ));
    let err = control::request(1, &json!({"cmd": "stat"})).unwrap_err();
    assert!(matches!(err, Error::NotUnderUswap { pid: 1, .. }), "{err}");
    assert!(err.to_string().contains("not running under uswap"), "{err}");
}

/// Sends `request` to `socket` as uid and gid 65534 (nobody), with the system's Python;
/// returns what the client printed.
fn ask_as_nobody(socket: &Path, request: &Value) -> String {
    let client = r#"
import socket, sys
s = socket.socket(socket.AF_UNIX)
try:
    s.connect(sys.argv[1])
except PermissionError:
    print("connect: permission denied")
    sys.exit(0)
s.sendall(sys.argv[2].encode() + b"\n")
print(s.makefile().readline().strip())
"#;
    let mut cmd = std::process::Command::new(PYTHON);
    cmd.args(["-I", "-c", client])
        .arg(socket)
        .arg(request.to_string())
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
    let out = cmd.output().expect("the client runs");
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    String::from_utf8_lossy(&out.stdout).trim().to_string()
}

const PYTHON: &str = "/usr/bin/python3";

#[test]
fn another_user_can_neither_reach_the_socket_nor_be_served() {
    // SAFETY: geteuid has no preconditions.
    if unsafe { libc::geteuid() } != 0 || !Path::new(PYTHON).exists() {
        eprintln!("SKIPPED: needs root (to run a client as another user) and {PYTHON}");
        return;
    }
    let rt = Runtime::new();
    let (region, server) = served(4 * MIB, 2 * MIB);
    let readahead = region.readahead();
    let stat_request = json!({"cmd": "stat"});
    let set_request = json!({"cmd": "set", "key": "page-cluster", "value": 0});
    assert_eq!(
        ask_as_nobody(server.path(), &stat_request),
        "connect: permission denied"
    );
    // Were the directory and socket opened up, the peer credentials still keep them out.
    for dir in [rt.tmp.path(), &rt.dir()] {
        std::fs::set_permissions(dir, std::fs::Permissions::from_mode(0o755)).unwrap();
    }
    std::fs::set_permissions(server.path(), std::fs::Permissions::from_mode(0o666)).unwrap();
    for request in [stat_request, set_request] {
        let reply: Value = serde_json::from_str(&ask_as_nobody(server.path(), &request)).unwrap();
        let msg = reply["error"].as_str().unwrap_or_default();
        assert!(msg.contains("permission denied"), "{reply}");
        assert!(reply.get("stats").is_none(), "{reply}");
    }
    assert_eq!(region.readahead(), readahead, "nothing changed");
    assert!(stat()["stats"].is_object(), "the owner is still served");
}

/// `uswap stat` of a process that is gone, or of one that never ran under uswap, removes
/// the sockets dead processes left (a SIGKILL, a failed start), as a new server does.
#[test]
fn a_request_that_finds_no_server_removes_dead_processes_sockets() {
    let rt = Runtime::new();
    std::fs::create_dir(rt.dir()).unwrap();
    std::fs::set_permissions(rt.dir(), std::fs::Permissions::from_mode(0o700)).unwrap();
    let dead = |n: usize| -> Vec<std::path::PathBuf> {
        (0..n)
            .map(|_| {
                let mut child = std::process::Command::new("true").spawn().unwrap();
                let pid = child.id();
                child.wait().unwrap();
                let left = rt.dir().join(format!("{pid}.sock"));
                drop(std::os::unix::net::UnixListener::bind(&left).unwrap());
                left
            })
            .collect()
    };
    let left = dead(2);
    let gone: u32 = left[0]
        .file_stem()
        .unwrap()
        .to_str()
        .unwrap()
        .parse()
        .unwrap();
    let e = control::request(gone, &json!({"cmd": "stat"})).unwrap_err();
    assert!(left.iter().all(|p| !p.exists()), "{e}: leftovers removed");
    let left = dead(1);
    let e = control::request(1, &json!({"cmd": "stat"})).unwrap_err();
    assert!(matches!(e, Error::NotUnderUswap { .. }), "{e}");
    assert!(!left[0].exists(), "{e}: leftovers removed");
}

#[test]
fn sockets_of_processes_that_are_gone_are_removed() {
    let rt = Runtime::new();
    let (region, server) = served(4 * MIB, 2 * MIB);
    drop(server);
    // A child that ended with _exit left its socket; a live process's socket stays, as
    // does a file that is not a socket.
    let mut child = std::process::Command::new("true").spawn().unwrap();
    let dead = child.id();
    child.wait().unwrap();
    let left = rt.dir().join(format!("{dead}.sock"));
    drop(std::os::unix::net::UnixListener::bind(&left).unwrap());
    let live = rt.dir().join("1.sock");
    drop(std::os::unix::net::UnixListener::bind(&live).unwrap());
    let other = rt.dir().join(format!("{}.sock", dead + 1_000_000));
    std::fs::write(&other, b"").unwrap();
    let _server = ControlServer::start(region).unwrap();
    // The server's thread sweeps, once, as it starts.
    let deadline = std::time::Instant::now() + std::time::Duration::from_secs(5);
    while left.exists() && std::time::Instant::now() < deadline {
        std::thread::sleep(std::time::Duration::from_millis(5));
    }
    assert!(!left.exists(), "the dead process's socket is gone");
    assert!(live.exists(), "pid 1 is alive: its socket stays");
    assert!(other.exists(), "not a socket: left alone");
}

#[test]
fn the_servers_thread_takes_the_watchs_looks_until_one_says_done_and_answers_between() {
    let _rt = Runtime::new();
    let region = Arc::new(Region::new(4 * MIB, Config::new(2 * MIB)).unwrap());
    let looks = Arc::new(std::sync::atomic::AtomicU32::new(0));
    let counted = looks.clone();
    let watch = control::Watch {
        every: std::time::Duration::from_millis(20),
        look: Box::new(move || counted.fetch_add(1, std::sync::atomic::Ordering::SeqCst) + 1 == 3),
    };
    let _server = ControlServer::start_with_watch(region, Some(watch)).unwrap();
    assert!(
        stat()["stats"]["vmstat"].is_object(),
        "answers before the looks"
    );
    std::thread::sleep(std::time::Duration::from_millis(400));
    assert_eq!(
        looks.load(std::sync::atomic::Ordering::SeqCst),
        3,
        "looks stop at the one that says done"
    );
    assert!(
        stat()["stats"]["vmstat"].is_object(),
        "and answers after them"
    );
}
