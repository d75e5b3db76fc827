//! The control socket: live statistics and run-time knobs of a running uswap process, for
//! `uswap stat` and `uswap ctl` (what `/proc/vmstat` and the sysfs/sysctl knobs are for the
//! kernel's swap).
//!
//! # Where, and who may use it
//!
//! One socket per process: `<dir>/<pid>.sock`, where `<dir>` is, by the server's
//! environment when it starts:
//!
//! - `$USWAP_RUNTIME_DIR` when set;
//! - else `$XDG_RUNTIME_DIR/uswap`, when `$XDG_RUNTIME_DIR` is an absolute path to a
//!   directory of the server's effective uid that no one else may enter (`/run/user/<uid>`
//!   under systemd; it goes when the user's last session ends, and the socket with it);
//! - else `/tmp/uswap-<uid>` (`uid`: the server's effective uid).
//!
//! A client tries its own `$USWAP_RUNTIME_DIR`, then (when it runs as the target's owner)
//! the directory its own environment gives, then the one the target's environment gives
//! (`/proc/<pid>/environ`, readable by the owner and root unless the target is not
//! dumpable; taken only when absolute and a directory the owner owns), then
//! `/tmp/uswap-<uid>` with the uid of `/proc/<pid>`'s owner: root's `uswap stat` finds any
//! user's process. It asks the first server that is the target itself: each is checked by
//! its peer credentials (`SO_PEERCRED`: the target's pid, running as its owner) before
//! anything is sent.
//!
//! The server creates `<dir>` with mode 0700 and refuses one that is not a directory of its
//! own (checked with lstat, so a symbolic link is refused) or that lets group or others in:
//! in a shared `/tmp` another user could otherwise create the directory first and read or
//! replace the socket. The socket itself is 0600, and every connection is checked once more
//! by its peer credentials: only the server's effective uid and root are served; anyone
//! else gets an error reply and nothing else. Dropping the [`ControlServer`] removes the
//! socket.
//!
//! # Protocol
//!
//! A client connects, writes one request as one line of JSON, reads one reply line, and the
//! server closes the connection (one request per connection, so a client that watches
//! cannot keep others waiting). Connections are served one at a time.
//!
//! - `{"cmd":"stat"}` → `{"pid":P,"size":BYTES,"page_size":4096,"knobs":{...},
//!   "stats":{...},"breakdown":[...]}`: `stats` is [`Region::stats`] (vmstat counters,
//!   fault service times by kind, resident and swap pages, I/O, swap cache, readahead,
//!   charge stocks, lock statistics); `breakdown` (present with `Config::breakdown`) the
//!   time per phase since the region was made.
//! - `{"cmd":"get"}` → `{"knobs":{"memory":BYTES,"page-cluster":N,"swap_ra_policy":NAME}}`.
//! - `{"cmd":"set","key":KEY,"value":VALUE}` → `{"ok":true}`. VALUE is a JSON string or
//!   number.
//! - Anything that fails → `{"error":"what went wrong"}`.
//!
//! # Knobs
//!
//! Named as the kernel names its own where it has one:
//!
//! - `memory`: the memory limit (`memory.max` of a cgroup), bytes or a size such as `512M`.
//!   Like a write to `memory.max`, lowering it reclaims before the reply comes (for at most
//!   [`RECLAIM_WAIT`]; kswapd goes on after that).
//! - `swap_ra_policy`: the readahead policy (seed 002's sysfs knob): `none`, `fixed`,
//!   `scaling`, `vma`, or `auto` (read back as the policy it chose for the device).
//! - `page-cluster`: log2 of the largest readahead window, 0 to 8 (`vm.page-cluster`).
//! - `references`: how aging sees use, `faults` or `written`; read only (a region's
//!   userfaultfd features are chosen when it is made).
//!
//! Everything else a region is configured with is fixed when it is made.

use crate::config::{parse_size, LruPolicy, Readahead, ReadaheadPolicy, ZtierSize};
use crate::error::{Error, Result};
use crate::region::Region;
use crate::PAGE_SIZE;
use serde_json::{json, Value};
use std::ffi::OsString;
use std::io::{self, BufRead, BufReader, ErrorKind, Read, Write};
use std::os::fd::{AsRawFd, FromRawFd, OwnedFd};
use std::os::unix::ffi::{OsStrExt, OsStringExt};
use std::os::unix::fs::{DirBuilderExt, FileTypeExt, MetadataExt, PermissionsExt};
use std::os::unix::net::{UnixListener, UnixStream};
use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::thread::JoinHandle;
use std::time::{Duration, Instant};

/// The environment variable that moves the socket directory.
pub const RUNTIME_DIR_VAR: &str = "USWAP_RUNTIME_DIR";

/// The user's runtime directory (XDG Base Directory); the socket directory is `uswap` in it.
const XDG_RUNTIME_DIR_VAR: &str = "XDG_RUNTIME_DIR";

/// How long a `memory` request that lowers the limit waits for reclaim to reach it.
pub const RECLAIM_WAIT: Duration = Duration::from_secs(5);

/// How long the server waits for a request line or for its reply to be taken: a client that
/// stalls must not hold the thread (nor the drop of the server) for long.
const SERVER_IO_TIMEOUT: Duration = Duration::from_secs(2);

/// How long a client waits for a reply: longer than a `memory` request may take.
const CLIENT_TIMEOUT: Duration = Duration::from_secs(30);

/// The longest request line the server reads.
const MAX_REQUEST: u64 = 4096;

/// The control socket this process would serve as process `pid` of effective uid `uid`,
/// by this process's environment (see the module documentation).
pub fn socket_path(pid: u32, uid: u32) -> PathBuf {
    runtime_dir(|name| std::env::var_os(name), uid).join(format!("{pid}.sock"))
}

/// The socket directory of a process of uid `uid` whose environment is `env`.
/// `$XDG_RUNTIME_DIR` counts only when it is an absolute path to a directory of the uid's
/// own that no one else may enter, as the XDG specification requires of it: a process can
/// carry another user's (`su` without `-`, `sudo -E`), and one that was removed (the last
/// session of its user ended) must not leave the process without a socket.
fn runtime_dir(env: impl Fn(&str) -> Option<OsString>, uid: u32) -> PathBuf {
    if let Some(dir) = env_path(&env, RUNTIME_DIR_VAR) {
        dir
    } else if let Some(xdg) = env_path(&env, XDG_RUNTIME_DIR_VAR).filter(|d| private_dir(d, uid)) {
        xdg.join("uswap")
    } else {
        fallback_dir(uid)
    }
}

/// The value of variable `name` when it is set and not empty.
fn env_path(env: impl Fn(&str) -> Option<OsString>, name: &str) -> Option<PathBuf> {
    env(name).filter(|v| !v.is_empty()).map(PathBuf::from)
}

/// Whether `dir` is an absolute path to a directory (not a symbolic link) of uid `uid` with
/// no permissions for group or others.
fn private_dir(dir: &Path, uid: u32) -> bool {
    dir.is_absolute()
        && std::fs::symlink_metadata(dir).is_ok_and(|meta| {
            meta.file_type().is_dir() && meta.uid() == uid && meta.mode() & 0o077 == 0
        })
}

/// The socket directory of a process of uid `uid` with neither variable usable.
fn fallback_dir(uid: u32) -> PathBuf {
    PathBuf::from(format!("/tmp/uswap-{uid}"))
}

/// The directories a client looks in for the socket of process `pid` of uid `owner`, in
/// order: its own `$USWAP_RUNTIME_DIR`; when it runs as the owner, the directory its own
/// environment gives (a server started in the same session chose the same); the directory
/// the target's environment gives; the fallback. The target's environment is read only if
/// the earlier places had nothing, and it is a path the target chose: it is taken only
/// when absolute, free of control characters, and a directory the owner owns.
fn candidate_dirs(pid: u32, owner: u32) -> impl Iterator<Item = PathBuf> {
    // SAFETY: geteuid has no preconditions.
    let euid = unsafe { libc::geteuid() };
    let own_explicit = env_path(|name| std::env::var_os(name), RUNTIME_DIR_VAR);
    let own_session = (euid == owner).then(|| runtime_dir(|name| std::env::var_os(name), owner));
    let targets = move || {
        let environ = std::fs::read(format!("/proc/{pid}/environ")).ok()?;
        let dir = runtime_dir(|name| environ_get(&environ, name), owner);
        let plain =
            dir.is_absolute() && !dir.as_os_str().as_bytes().iter().any(u8::is_ascii_control);
        let owned = std::fs::symlink_metadata(&dir)
            .is_ok_and(|m| m.file_type().is_dir() && m.uid() == owner);
        (plain && owned).then_some(dir)
    };
    own_explicit
        .into_iter()
        .chain(own_session)
        .chain(std::iter::once_with(targets).flatten())
        .chain(std::iter::once(fallback_dir(owner)))
}

/// The value of `name` in a NUL-separated environment block.
fn environ_get(environ: &[u8], name: &str) -> Option<OsString> {
    environ.split(|&b| b == 0).find_map(|entry| {
        let value = entry.strip_prefix(name.as_bytes())?.strip_prefix(b"=")?;
        Some(OsString::from_vec(value.to_vec()))
    })
}

/// Serves statistics and knobs of one region on the process's control socket, from a
/// thread of its own, until dropped.
pub struct ControlServer {
    path: PathBuf,
    /// The write end of a pipe the thread polls: closing it stops the thread.
    stop: Option<OwnedFd>,
    thread: Option<JoinHandle<()>>,
}

impl ControlServer {
    /// Binds `<dir>/<pid>.sock` (see the module documentation) and starts serving `region`.
    /// A stale socket of an earlier process with this pid is replaced; one this process
    /// serves already is an error (one control socket per process).
    pub fn start(region: Arc<Region>) -> Result<ControlServer> {
        Self::start_with_watch(region, None)
    }

    /// [`ControlServer::start`], with `watch` run on the server's thread between requests:
    /// a process's other periodic look needs no thread of its own.
    pub fn start_with_watch(region: Arc<Region>, watch: Option<Watch>) -> Result<ControlServer> {
        // SAFETY: geteuid has no preconditions.
        let euid = unsafe { libc::geteuid() };
        let path = socket_path(std::process::id(), euid);
        let dir = path.parent().unwrap_or(Path::new("/"));
        prepare_dir(dir, euid)?;
        let listener = bind(&path)?;
        let (stop_rx, stop_tx) = pipe()?;
        let server = Server {
            region,
            listener,
            stop: stop_rx,
            euid,
            dir: dir.to_path_buf(),
            watch,
        };
        match crate::signals::spawn_quiet("uswap-control", move || server.run()) {
            Ok(thread) => Ok(ControlServer {
                path,
                stop: Some(stop_tx),
                thread: Some(thread),
            }),
            Err(source) => {
                let _ = std::fs::remove_file(&path);
                Err(Error::Os {
                    op: "starting the control socket's thread",
                    source,
                })
            }
        }
    }

    /// Where the socket is.
    pub fn path(&self) -> &Path {
        &self.path
    }
}

impl Drop for ControlServer {
    fn drop(&mut self) {
        // The read end then polls as hung up, and the thread returns.
        drop(self.stop.take());
        if let Some(thread) = self.thread.take() {
            let _ = thread.join();
        }
        let _ = std::fs::remove_file(&self.path);
    }
}

/// Creates the socket directory if it is missing and checks that it is private.
fn prepare_dir(dir: &Path, euid: u32) -> Result<()> {
    let refuse = |why: String| Error::ControlDir {
        dir: dir.to_path_buf(),
        why,
    };
    match std::fs::DirBuilder::new().mode(0o700).create(dir) {
        Ok(()) => {}
        Err(e) if e.kind() == ErrorKind::AlreadyExists => {}
        Err(e) => return Err(refuse(format!("it cannot be created: {e}"))),
    }
    let meta = std::fs::symlink_metadata(dir).map_err(|e| refuse(e.to_string()))?;
    let mode = meta.mode() & 0o7777;
    if !meta.file_type().is_dir() {
        Err(refuse(
            "it is not a directory (a symbolic link or a file)".into(),
        ))
    } else if meta.uid() != euid {
        Err(refuse(format!(
            "it belongs to uid {}, not to this process's uid {euid}",
            meta.uid()
        )))
    } else if mode & 0o077 != 0 {
        Err(refuse(format!(
            "its mode {mode:04o} lets other users in (it must be 0700)"
        )))
    } else {
        Ok(())
    }
}

/// Binds the socket at `path` with mode 0600, replacing a stale one.
fn bind(path: &Path) -> Result<UnixListener> {
    let refuse = |why: String| Error::ControlSocket {
        path: path.to_path_buf(),
        why,
    };
    remove_stale(path)?;
    let listener = UnixListener::bind(path).map_err(|e| refuse(e.to_string()))?;
    // bind creates the file by the umask; the directory keeps others out already, and 0600
    // keeps them out should someone loosen it.
    let private = std::fs::set_permissions(path, std::fs::Permissions::from_mode(0o600))
        .and_then(|()| listener.set_nonblocking(true));
    if let Err(e) = private {
        let _ = std::fs::remove_file(path);
        return Err(refuse(e.to_string()));
    }
    Ok(listener)
}

/// Removes a socket left at `path` by an earlier process with this pid (nobody accepts on
/// it). Anything else there is an error.
fn remove_stale(path: &Path) -> Result<()> {
    let refuse = |why: String| Error::ControlSocket {
        path: path.to_path_buf(),
        why,
    };
    match std::fs::symlink_metadata(path) {
        Err(e) if e.kind() == ErrorKind::NotFound => Ok(()),
        Err(e) => Err(refuse(e.to_string())),
        Ok(meta) if !meta.file_type().is_socket() => {
            Err(refuse("something that is not a socket is there".into()))
        }
        Ok(_) if UnixStream::connect(path).is_ok() => Err(refuse(
            "this process serves one there already (one control socket per process)".into(),
        )),
        Ok(_) => std::fs::remove_file(path).map_err(|e| refuse(e.to_string())),
    }
}

/// Removes the sockets of processes that are gone without removing theirs: children of
/// fork end with `_exit` (redis's BGSAVE, Python's multiprocessing), which skips exit
/// handlers. A socket stays if its process exists or anyone accepts on it. Only in a
/// directory of this process's own euid: a client may have looked in one another user
/// chose.
fn remove_dead(dir: &Path) {
    // SAFETY: geteuid has no preconditions.
    let euid = unsafe { libc::geteuid() };
    let own =
        std::fs::symlink_metadata(dir).is_ok_and(|m| m.file_type().is_dir() && m.uid() == euid);
    if !own {
        return;
    }
    let Ok(entries) = std::fs::read_dir(dir) else {
        return;
    };
    for entry in entries.flatten() {
        let path = entry.path();
        let Some(pid) = path
            .file_name()
            .and_then(|n| n.to_str())
            .and_then(|n| n.strip_suffix(".sock"))
            .and_then(|n| n.parse::<libc::pid_t>().ok())
        else {
            continue;
        };
        // SAFETY: signal 0 only checks that the process exists.
        let gone = unsafe { libc::kill(pid, 0) } != 0
            && std::io::Error::last_os_error().raw_os_error() == Some(libc::ESRCH);
        let is_socket = entry.file_type().is_ok_and(|t| t.is_socket());
        if gone && is_socket && UnixStream::connect(&path).is_err() {
            let _ = std::fs::remove_file(&path);
        }
    }
}

/// A pipe, both ends close-on-exec: (read end, write end).
fn pipe() -> Result<(OwnedFd, OwnedFd)> {
    let mut fds = [0; 2];
    // SAFETY: pipe2 fills the two descriptors, which are then owned here alone.
    unsafe {
        if libc::pipe2(fds.as_mut_ptr(), libc::O_CLOEXEC) != 0 {
            return Err(Error::os("pipe2"));
        }
        Ok((OwnedFd::from_raw_fd(fds[0]), OwnedFd::from_raw_fd(fds[1])))
    }
}

/// What the server thread owns.
struct Server {
    region: Arc<Region>,
    listener: UnixListener,
    stop: OwnedFd,
    euid: u32,
    /// The socket's directory.
    dir: PathBuf,
    watch: Option<Watch>,
}

/// A look the control socket's thread takes every `every` (the first after `every`) until
/// it returns true.
pub struct Watch {
    pub every: Duration,
    pub look: Box<dyn FnMut() -> bool + Send>,
}

impl Server {
    fn run(mut self) {
        // On the server's thread, not in `start`: a process's start (every command of a
        // shell under `uswap run`) does not wait for it.
        remove_dead(&self.dir);
        let mut next_look = self.watch.as_ref().map(|w| Instant::now() + w.every);
        while self.wait_for_client(&mut next_look) {
            match self.listener.accept() {
                Ok((stream, _)) => self.serve(&stream),
                // The client left between poll and accept.
                Err(e) if e.kind() == ErrorKind::WouldBlock => {}
                // Out of descriptors, say: the listener stays readable, so pause rather
                // than spin.
                Err(_) => std::thread::sleep(Duration::from_millis(100)),
            }
        }
    }

    /// Waits until a client connects (true) or the server is stopped (false), taking the
    /// watch's look when `next_look` comes (`None` once it has said what it had to).
    fn wait_for_client(&mut self, next_look: &mut Option<Instant>) -> bool {
        let mut fds = [self.listener.as_raw_fd(), self.stop.as_raw_fd()].map(|fd| libc::pollfd {
            fd,
            events: libc::POLLIN,
            revents: 0,
        });
        loop {
            let timeout = next_look.map_or(-1, |at| {
                at.saturating_duration_since(Instant::now())
                    .as_millis()
                    .min(i32::MAX as u128) as i32
            });
            // SAFETY: two valid pollfd entries.
            let r = unsafe { libc::poll(fds.as_mut_ptr(), 2, timeout) };
            if r < 0 && io::Error::last_os_error().kind() == ErrorKind::Interrupted {
                continue;
            }
            if r == 0 {
                if let (Some(at), Some(watch)) = (next_look.as_mut(), self.watch.as_mut()) {
                    *at = Instant::now() + watch.every;
                    if (watch.look)() {
                        *next_look = None;
                    }
                }
                continue;
            }
            // The stop pipe hung up, or poll or the listener failed: serving ends.
            return r > 0 && fds[1].revents == 0 && fds[0].revents == libc::POLLIN;
        }
    }

    fn serve(&self, stream: &UnixStream) {
        let reply = match peer_cred(stream).map(|c| c.uid) {
            Ok(uid) if uid == self.euid || uid == 0 => self.answer(stream),
            Ok(uid) => {
                // The request is taken and dropped unread before the refusal, so the
                // client's write never meets a closed socket and the refusal reaches it.
                let _ = read_line(stream, SERVER_IO_TIMEOUT);
                error(format!(
                    "permission denied: uid {uid} may not use the control socket of a process \
                     of uid {}",
                    self.euid
                ))
            }
            Err(e) => error(format!("cannot check who is asking: {e}")),
        };
        let _ = write_line(stream, &reply);
    }

    fn answer(&self, stream: &UnixStream) -> Value {
        match read_line(stream, SERVER_IO_TIMEOUT) {
            // A panic inside uswap must not end the thread: the client gets an error.
            Ok(request) => std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| {
                handle(&self.region, &request)
            }))
            .unwrap_or_else(|_| error("the request failed inside uswap (a bug)")),
            Err(e) => error(format!("bad request: {e}")),
        }
    }
}

/// The process at the other end of a connected socket, as it was when it connected (a
/// server: when it listened): `SO_PEERCRED`.
fn peer_cred(stream: &UnixStream) -> io::Result<libc::ucred> {
    let mut cred = libc::ucred {
        pid: 0,
        uid: 0,
        gid: 0,
    };
    let mut len = std::mem::size_of::<libc::ucred>() as libc::socklen_t;
    // SAFETY: cred and len describe a ucred the call fills.
    let r = unsafe {
        libc::getsockopt(
            stream.as_raw_fd(),
            libc::SOL_SOCKET,
            libc::SO_PEERCRED,
            (&mut cred as *mut libc::ucred).cast(),
            &mut len,
        )
    };
    if r != 0 {
        return Err(io::Error::last_os_error());
    }
    Ok(cred)
}

/// Reads one line of JSON (at most [`MAX_REQUEST`] bytes for a request).
fn read_line(stream: &UnixStream, timeout: Duration) -> io::Result<Value> {
    stream.set_read_timeout(Some(timeout))?;
    let mut line = String::new();
    BufReader::new(stream.take(MAX_REQUEST)).read_line(&mut line)?;
    if !line.ends_with('\n') {
        return Err(io::Error::new(
            ErrorKind::InvalidData,
            format!(
                "no complete line (a request is one line of JSON, at most {MAX_REQUEST} bytes)"
            ),
        ));
    }
    serde_json::from_str(&line).map_err(|e| io::Error::new(ErrorKind::InvalidData, e))
}

fn write_line(stream: &UnixStream, value: &Value) -> io::Result<()> {
    stream.set_write_timeout(Some(SERVER_IO_TIMEOUT))?;
    let mut line = value.to_string();
    line.push('\n');
    (&*stream).write_all(line.as_bytes())
}

fn error(message: impl Into<String>) -> Value {
    json!({ "error": message.into() })
}

/// Answers one request.
fn handle(region: &Region, request: &Value) -> Value {
    match request.get("cmd").and_then(Value::as_str) {
        Some("stat") => snapshot(region),
        Some("get") => json!({ "knobs": knobs(region) }),
        Some("set") => match set(region, request) {
            Ok(()) => json!({ "ok": true }),
            Err(why) => error(why),
        },
        Some(other) => error(format!("unknown command {other:?}: use stat, get or set")),
        None => error("a request is a JSON object with a \"cmd\": stat, get or set"),
    }
}

/// The `stat` reply: pid, size, knobs, [`Region::stats`] and the phase times.
pub fn snapshot(region: &Region) -> Value {
    let stats = match serde_json::to_value(region.stats()) {
        Ok(stats) => stats,
        Err(e) => return error(format!("the statistics could not be encoded: {e}")),
    };
    let mut snapshot = json!({
        "pid": std::process::id(),
        "size": region.len(),
        "page_size": PAGE_SIZE,
        "knobs": knobs(region),
        "stats": stats,
    });
    if let Some(times) = region.phase_times() {
        snapshot["breakdown"] = serde_json::to_value(times.summary()).unwrap_or(Value::Null);
    }
    snapshot
}

/// A knob: its name, how to read it, how to set it from text.
struct Knob {
    name: &'static str,
    get: fn(&Region) -> Value,
    set: fn(&Region, &str) -> Result<()>,
}

const KNOBS: [Knob; 7] = [
    Knob {
        name: "memory",
        get: |r| r.memory_limit().into(),
        set: set_memory,
    },
    Knob {
        name: "swap_ra_policy",
        get: |r| r.readahead().policy.name().into(),
        set: |r, text| {
            let policy = text.parse::<ReadaheadPolicy>()?;
            r.set_readahead(Readahead {
                policy,
                ..r.readahead()
            })
        },
    },
    Knob {
        name: "page-cluster",
        get: |r| r.readahead().page_cluster.into(),
        set: |r, text| {
            let page_cluster = text.parse::<u8>().map_err(|_| {
                Error::invalid("page-cluster", format!("{text:?}: use a number, 0 to 8"))
            })?;
            r.set_readahead(Readahead {
                page_cluster,
                ..r.readahead()
            })
        },
    },
    Knob {
        name: "lru_policy",
        get: |r| r.lru_policy().name().into(),
        set: |r, text| {
            r.set_lru_policy(text.parse::<LruPolicy>()?);
            Ok(())
        },
    },
    Knob {
        name: "references",
        get: |r| r.references().name().into(),
        set: |r, text| {
            if text == r.references().name() {
                return Ok(());
            }
            Err(Error::invalid(
                "references",
                format!(
                    "{text:?}: fixed at {} when the program started (the userfaultfd's \
                     features are chosen then); start it again with --references",
                    r.references().name()
                ),
            ))
        },
    },
    Knob {
        name: "ztier",
        get: |r| on_off(r.swap_device().ztier_stats().enabled).into(),
        set: |r, text| {
            let on = match text {
                "on" => true,
                "off" => false,
                _ => return Err(Error::invalid("ztier", format!("{text:?}: use on or off"))),
            };
            r.swap_device().set_ztier(on);
            Ok(())
        },
    },
    Knob {
        name: "ztier_size",
        get: |r| r.swap_device().ztier_size().to_string().into(),
        set: |r, text| {
            r.swap_device().set_ztier_size(text.parse::<ZtierSize>()?);
            Ok(())
        },
    },
];

fn on_off(on: bool) -> &'static str {
    match on {
        true => "on",
        false => "off",
    }
}

fn knobs(region: &Region) -> Value {
    KNOBS
        .iter()
        .map(|k| (k.name.to_string(), (k.get)(region)))
        .collect::<serde_json::Map<_, _>>()
        .into()
}

fn set(region: &Region, request: &Value) -> std::result::Result<(), String> {
    let key = request.get("key").and_then(Value::as_str).unwrap_or("");
    let names = || KNOBS.map(|k| k.name).join(", ");
    let knob = KNOBS
        .iter()
        .find(|k| k.name == key)
        .ok_or_else(|| format!("unknown knob {key:?}: the knobs are {}", names()))?;
    // The command line sends text; a JSON number is as good.
    let text = match request.get("value") {
        Some(Value::String(s)) => s.clone(),
        Some(Value::Number(n)) => n.to_string(),
        _ => return Err(format!("{key}: give the value as a JSON string or number")),
    };
    (knob.set)(region, &text).map_err(|e| format!("{key}={text}: {e}"))
}

/// Sets the memory limit and, when that leaves too much resident, waits a while for reclaim
/// to bring it under.
fn set_memory(region: &Region, text: &str) -> Result<()> {
    region.set_memory_limit(parse_size(text)?)?;
    let limit = region.memory_limit() / PAGE_SIZE as u64;
    let deadline = Instant::now() + RECLAIM_WAIT;
    while region.resident_pages() > limit && Instant::now() < deadline {
        std::thread::sleep(Duration::from_millis(10));
    }
    Ok(())
}

/// Sends `request` to the control socket of process `pid` and returns the reply. An error
/// reply is an error ([`Error::ControlRefused`]), as are a missing process, a process
/// without a control socket and a socket of another user, each its own [`Error`]. A
/// request that finds no server removes the sockets of processes that are gone from the
/// directories it looked in (the next server's start does too).
pub fn request(pid: u32, request: &Value) -> Result<Value> {
    let owner = process_owner(pid).inspect_err(|_| {
        // SAFETY: no arguments.
        let mine = socket_path(pid, unsafe { libc::geteuid() });
        if let Some(dir) = mine.parent() {
            remove_dead(dir);
        }
    })?;
    let mut looked = Vec::new();
    let mut refusal = None;
    let mut genuine = None;
    for dir in candidate_dirs(pid, owner) {
        let path = dir.join(format!("{pid}.sock"));
        if looked.contains(&path) {
            continue;
        }
        looked.push(path.clone());
        match connect_genuine(&path, pid, owner) {
            Ok(Some(stream)) => {
                genuine = Some(stream);
                break;
            }
            Ok(None) => {}
            // Nothing was sent: a later place may hold the real server.
            Err(e) => {
                refusal.get_or_insert(e);
            }
        }
    }
    let Some(stream) = genuine else {
        for dir in looked.iter().filter_map(|path| path.parent()) {
            remove_dead(dir);
        }
        if refusal.is_none() && loaded_preload(pid) {
            let rss_anon_bytes = crate::stats::rss_anon_bytes(pid).unwrap_or(0);
            return Err(Error::RegionNotBuilt {
                pid,
                rss_anon_bytes,
            });
        }
        return Err(refusal.unwrap_or(Error::NotUnderUswap {
            pid,
            places: looked,
        }));
    };
    let reply = exchange(&stream, request).map_err(|source| Error::Os {
        op: "talking to the control socket",
        source,
    })?;
    match reply.get("error") {
        Some(message) => Err(Error::ControlRefused {
            pid,
            message: message.as_str().unwrap_or("(no message)").to_string(),
        }),
        None => Ok(reply),
    }
}

/// Whether process `pid` has `uswap run`'s preload library mapped: one without a control
/// socket then has not built its region yet.
fn loaded_preload(pid: u32) -> bool {
    std::fs::read_to_string(format!("/proc/{pid}/maps"))
        .is_ok_and(|maps| maps.contains("libuswap_preload"))
}

/// Connects to the socket at `path` if the server there is process `pid` itself, running
/// as `owner` (whoever made the directory first could answer at the path): `None` when
/// there is no socket or nobody accepts on it (its process is gone and the pid reused).
fn connect_genuine(path: &Path, pid: u32, owner: u32) -> Result<Option<UnixStream>> {
    let stream = match UnixStream::connect(path) {
        Ok(stream) => stream,
        Err(e) if matches!(e.kind(), ErrorKind::NotFound | ErrorKind::ConnectionRefused) => {
            return Ok(None)
        }
        Err(e) if e.kind() == ErrorKind::PermissionDenied => {
            let path = path.to_path_buf();
            return Err(Error::ControlDenied { pid, path });
        }
        Err(source) => {
            let op = "connecting to the control socket";
            return Err(Error::Os { op, source });
        }
    };
    let libc::ucred {
        pid: server_pid,
        uid: server_uid,
        ..
    } = peer_cred(&stream).map_err(|source| Error::Os {
        op: "reading the control socket's peer credentials",
        source,
    })?;
    // A server in another PID namespace shows as pid 0: then its user must do.
    let pid_differs = server_pid != 0 && server_pid != pid as i32;
    if pid_differs || server_uid != owner {
        return Err(Error::ControlImpostor {
            pid,
            path: path.to_path_buf(),
            server_pid,
            server_uid,
        });
    }
    Ok(Some(stream))
}

/// The effective uid of process `pid`: the owner of its `/proc` directory.
fn process_owner(pid: u32) -> Result<u32> {
    match std::fs::metadata(format!("/proc/{pid}")) {
        Ok(meta) => Ok(meta.uid()),
        Err(e) if e.kind() == ErrorKind::NotFound => Err(Error::NoSuchProcess { pid }),
        Err(source) => Err(Error::Os {
            op: "looking up the process",
            source,
        }),
    }
}

fn exchange(stream: &UnixStream, request: &Value) -> io::Result<Value> {
    stream.set_write_timeout(Some(CLIENT_TIMEOUT))?;
    let mut line = request.to_string();
    line.push('\n');
    (&*stream).write_all(line.as_bytes())?;
    let mut reply = String::new();
    stream.set_read_timeout(Some(CLIENT_TIMEOUT))?;
    BufReader::new(stream).read_line(&mut reply)?;
    if reply.is_empty() {
        return Err(io::Error::new(
            ErrorKind::UnexpectedEof,
            "the server closed the connection without a reply",
        ));
    }
    serde_json::from_str(&reply).map_err(|e| io::Error::new(ErrorKind::InvalidData, e))
}

#[cfg(all(test, not(loom)))]
mod tests {
    use super::*;

    /// `USWAP_RUNTIME_DIR` wins, then `XDG_RUNTIME_DIR`'s `uswap` subdirectory when it is a
    /// private directory of the uid, then `/tmp/uswap-UID`; empty values count as unset,
    /// and a name that only starts like a variable's is not it.
    #[test]
    fn the_socket_directory_follows_the_environment_in_order() {
        // SAFETY: geteuid has no preconditions.
        let uid = unsafe { libc::geteuid() };
        let xdg = tempfile::tempdir().unwrap();
        std::fs::set_permissions(xdg.path(), std::fs::Permissions::from_mode(0o700)).unwrap();
        let open = tempfile::tempdir().unwrap();
        std::fs::set_permissions(open.path(), std::fs::Permissions::from_mode(0o755)).unwrap();
        let entry = |name: &str, dir: &Path| format!("{name}={}\0", dir.display()).into_bytes();
        let dir_of = |environ: &[u8]| runtime_dir(|name| environ_get(environ, name), uid);
        let fallback = PathBuf::from(format!("/tmp/uswap-{uid}"));

        let both = [
            entry("XDG_RUNTIME_DIR", xdg.path()),
            b"USWAP_RUNTIME_DIR=/srv/u\0".to_vec(),
        ];
        assert_eq!(dir_of(&both.concat()), Path::new("/srv/u"));
        let xdg_only = [b"HOME=/h\0".to_vec(), entry("XDG_RUNTIME_DIR", xdg.path())];
        assert_eq!(dir_of(&xdg_only.concat()), xdg.path().join("uswap"));
        for unusable in [
            entry("XDG_RUNTIME_DIR", open.path()),
            entry("XDG_RUNTIME_DIR", &xdg.path().join("missing")),
            entry("XDG_RUNTIME_DIR", Path::new("relative")),
            entry("XDG_RUNTIME_DIRX", xdg.path()),
            b"USWAP_RUNTIME_DIR=\0XDG_RUNTIME_DIR=\0".to_vec(),
            Vec::new(),
        ] {
            assert_eq!(
                dir_of(&unusable),
                fallback,
                "{}",
                String::from_utf8_lossy(&unusable)
            );
        }
        // Another uid's directory is not this one's runtime directory.
        let other = runtime_dir(|name| environ_get(&xdg_only.concat(), name), uid + 1);
        assert_eq!(other, PathBuf::from(format!("/tmp/uswap-{}", uid + 1)));
    }
}
