//! Errors a caller can act on: each message says what was wrong and what to do.

use std::path::PathBuf;

#[derive(Debug, thiserror::Error)]
pub enum Error {
    #[error("invalid {what}: {why}")]
    InvalidConfig { what: &'static str, why: String },

    #[error(
        "userfaultfd is not permitted for this process ({cause}). Fixes: run as root \
         (or with CAP_SYS_PTRACE), give the user read/write access to /dev/userfaultfd, \
         or set `sysctl vm.unprivileged_userfaultfd=1`"
    )]
    UffdNotPermitted { cause: String },

    #[error("userfaultfd is not available: {0}")]
    UffdUnavailable(String),

    #[error("this kernel ({kernel}) lacks a userfaultfd feature uswap needs: {feature}")]
    UnsupportedFeature {
        kernel: String,
        feature: &'static str,
    },

    #[error(
        "this kernel uses {kernel}-byte pages; uswap is built for 4096-byte pages only. Run \
         on a kernel with 4 KiB pages (x86-64 always has them; on arm64 choose a 4K kernel)"
    )]
    UnsupportedPageSize { kernel: usize },

    #[error(
        "cannot create the swap file in {dir}: {source}. Point --swap-dir (or TMPDIR) at a \
         writable directory on a local file system"
    )]
    SwapCreate {
        dir: PathBuf,
        source: std::io::Error,
    },

    #[error(
        "the swap file {path} already exists (or is a symbolic link): uswap creates its swap \
         file itself and never writes over one. Remove {path} if it is a leftover nothing \
         uses, or name a path that does not exist (or give a swap directory instead)"
    )]
    SwapFileExists { path: PathBuf },

    #[error(
        "region of {region} bytes does not fit: memory limit {memory} + swap space {swap} \
         bytes is smaller. Raise the memory limit or the swap size, or use a smaller region"
    )]
    RegionTooLarge { region: u64, memory: u64, swap: u64 },

    #[error(
        "the shared swap device is full: this region needs {needed} pages of swap beyond its \
         memory limit, but only {free} of the device's {capacity} pages are not promised to \
         other regions. Drop a region, give this one more memory, or use a larger swap device"
    )]
    SwapExhausted {
        needed: u64,
        free: u64,
        capacity: u64,
    },

    #[error(
        "cannot use {dir} for uswap's control socket: {why}. It may have been made by another \
         user to intercept the socket: remove it, or set USWAP_RUNTIME_DIR to a directory of \
         your own with mode 0700"
    )]
    ControlDir { dir: PathBuf, why: String },

    #[error("cannot serve uswap's control socket at {path}: {why}")]
    ControlSocket { path: PathBuf, why: String },

    #[error("no process {pid}")]
    NoSuchProcess { pid: u32 },

    #[error(
        "process {pid} is not running under uswap: no control socket answered for it at {} \
         (a program whose environment no longer says where its socket is: set \
         USWAP_RUNTIME_DIR to the directory)",
        either_of(.places)
    )]
    NotUnderUswap { pid: u32, places: Vec<PathBuf> },

    #[error(
        "process {pid} runs under uswap run but has not built its region yet: it has \
         committed no more than its start-up allowance (--start-allowance, by default 8 MiB \
         or an eighth of the limit) and started no thread, so none of its memory is swapped \
         ({} KiB of anonymous memory resident; what it committed is charged to the tree's \
         limit); its statistics and knobs come with its region (run with \
         --start-allowance 0 to have it from the start)",
        rss_anon_bytes / 1024
    )]
    RegionNotBuilt { pid: u32, rss_anon_bytes: u64 },

    #[error(
        "permission denied: the control socket of process {pid} ({path}) belongs to another \
         user; only its owner or root may read its statistics or change its knobs"
    )]
    ControlDenied { pid: u32, path: PathBuf },

    #[error("process {pid} refused the request: {message}")]
    ControlRefused { pid: u32, message: String },

    #[error(
        "the control socket {path:?} is not process {pid}'s: it is served by process \
         {server_pid} of uid {server_uid}; nothing was sent. Another user may have made the \
         directory first: remove it, or set USWAP_RUNTIME_DIR to a directory of your own, for \
         both uswap run and uswap stat/ctl"
    )]
    ControlImpostor {
        pid: u32,
        path: PathBuf,
        server_pid: i32,
        server_uid: u32,
    },

    #[error("{op} failed: {source}")]
    Os {
        op: &'static str,
        source: std::io::Error,
    },
}

impl Error {
    pub(crate) fn os(op: &'static str) -> Self {
        Error::Os {
            op,
            source: std::io::Error::last_os_error(),
        }
    }

    pub(crate) fn invalid(what: &'static str, why: impl Into<String>) -> Self {
        Error::InvalidConfig {
            what,
            why: why.into(),
        }
    }
}

pub type Result<T> = std::result::Result<T, Error>;

/// Paths for a message, quoted (a path may hold any byte), joined by "or".
fn either_of(paths: &[PathBuf]) -> String {
    let quoted: Vec<String> = paths.iter().map(|p| format!("{p:?}")).collect();
    quoted.join(" or ")
}
