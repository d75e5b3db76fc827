//! `uswap run -- CMD ARGS…`: runs an unmodified, dynamically linked program with its heap
//! and private anonymous mappings in uswap memory, limited to `--memory` resident.
//!
//! The command becomes the program (`exec`): its process ID, standard streams, signals and
//! exit status are the program's own. What makes its memory uswap's is the preload library
//! (`libuswap_preload.so`, built beside the `uswap` binary) and the settings it reads from
//! the environment. With `--backend kernel` the program runs instead as a child in a memory
//! cgroup under the kernel's swap, which is removed after it.

use crate::args::Backend;
use crate::args::{nonzero_size, size, CoreArgs, KernelArgs};
use crate::kernel::tunables::Tunable;
use crate::kernel::{self, program, KernelSwap};
use anyhow::{bail, Context, Result};
use clap::Args;
use std::ffi::OsString;
use std::os::unix::fs::PermissionsExt;
use std::os::unix::process::CommandExt;
use std::path::{Path, PathBuf};
use std::process::ExitCode;
use uswap_core::memcg::MemCgroup;
use uswap_core::run::{Settings, ENV};

/// The preload library's file name, beside the `uswap` binary.
const PRELOAD: &str = "libuswap_preload.so";

/// Address space beyond --vm-size for reservations, by default: a JVM reserves its
/// maximum heap and a 1 GiB class space, V8 a 4 GiB pointer-compression cage. It costs
/// page table entries only where committed.
const RESERVATIONS: u64 = 64 << 30;

#[derive(Args, Debug)]
pub struct RunArgs {
    /// Resident memory the program may use [default: half of the machine's memory, at most
    /// 128 GiB]
    #[arg(long, value_name = "SIZE", value_parser = nonzero_size)]
    pub memory: Option<u64>,

    /// Anonymous memory the program may hold in all, resident and swapped [default: memory
    /// plus --swap-size when that is set, else memory plus 3 × memory (at least 4G, at most
    /// 64G and 90% of the swap directory's free space)]
    #[arg(long, value_name = "SIZE", value_parser = nonzero_size)]
    pub vm_size: Option<u64>,

    /// Address space for the program's memory: --vm-size of it committed (accessible) at
    /// most, the rest for reservations (PROT_NONE) that the JVM, V8 and Go reserve for
    /// their heaps and commit as they grow [default: --vm-size plus 64G]
    #[arg(long, value_name = "SIZE", value_parser = nonzero_size)]
    pub address_space: Option<u64>,

    /// Memory the program (and each program it starts) may commit before uswap builds its
    /// region, its userfaultfds, threads, swap file and control socket: a shell's short
    /// commands run without them, held in the limit all the same; `uswap stat` answers
    /// once it is built. 0 builds it at the start [default: 8M, at most an eighth of
    /// --memory]
    #[arg(long, value_name = "SIZE", value_parser = size)]
    pub start_allowance: Option<u64>,

    /// A directory (made if missing) where each program of the tree, when it exits,
    /// leaves its counters as PID.json (what `uswap stat PID --json` shows): swap-ins,
    /// swap-outs and faults of the whole run once it has ended. None is left by a program
    /// that execs another, dies of a signal or ends with `_exit` (Go's `os.Exit`, Python's
    /// `os._exit`), nor by one that never built its region (it swapped nothing). Programs
    /// running as other users need the directory writable to them
    #[arg(long, value_name = "DIR")]
    pub stats_dir: Option<PathBuf>,

    /// Whose swap: `uswap`, or `kernel` (root): the program as a child in a memory cgroup
    /// limited to --memory, with the kernel's swap (--kernel-swap) of --swap-size [default:
    /// as for --vm-size] in --swap-dir, all removed after it; its exit status is passed on
    /// (128 + N for death by signal N), and so are SIGINT, SIGTERM and SIGHUP sent to uswap
    #[arg(long, value_enum, default_value_t = Backend::Uswap)]
    pub backend: Backend,

    #[command(flatten)]
    pub core: CoreArgs,

    #[command(flatten)]
    pub kernel: KernelArgs,

    /// The program and its arguments
    #[arg(required = true, trailing_var_arg = true, value_name = "CMD")]
    pub command: Vec<OsString>,
}

pub fn run(args: &RunArgs) -> Result<ExitCode> {
    let memory = match args.memory {
        Some(m) => m,
        None => half_of_ram()?,
    };
    if args.backend == Backend::Kernel {
        return run_under_kernel(args, memory);
    }
    let mut config = args.core.config(memory)?;
    if args.core.fault_mode.is_none() {
        // The library's default is thread mode; a program run whole gets auto.
        config.fault_mode = uswap_core::FaultMode::Auto;
    }
    let vm_size = match args.vm_size {
        Some(size) => size,
        None => {
            memory
                + config
                    .swap
                    .size
                    .unwrap_or(default_swap(memory, &args.core.swap_dir()))
        }
    };
    uswap_core::probe()?;
    let preload = preload_library()?;
    let program = find_program(&args.command[0])?;
    check_preloadable(&program)?;
    // One limit for the program and every program it execs, as a cgroup's memory.max.
    let (_memcg, memcg) = MemCgroup::create_shared(config.limit_pages(), &args.core.swap_dir())?;
    let settings = Settings {
        config,
        vm_size,
        address_space: args
            .address_space
            .unwrap_or(vm_size.saturating_add(RESERVATIONS)),
        memcg: Some(memcg),
        start_allowance: args.start_allowance,
        stats_dir: stats_dir(args.stats_dir.as_deref())?,
    };
    let mut preloads = preload.into_os_string();
    if let Some(old) = std::env::var_os("LD_PRELOAD").filter(|v| !v.is_empty()) {
        preloads.push(":");
        preloads.push(old);
    }
    let memcg_file = settings.memcg.clone();
    let err = std::process::Command::new(&program)
        .arg0(&args.command[0])
        .args(&args.command[1..])
        .env("LD_PRELOAD", preloads)
        .env(ENV, settings.to_env())
        .exec();
    if let Some(file) = memcg_file {
        let _ = std::fs::remove_file(file);
    }
    Err(err).with_context(|| format!("cannot run {}", program.display()))
}

/// `--stats-dir`, made if missing, as an absolute path (the program may change directory).
fn stats_dir(dir: Option<&Path>) -> Result<Option<PathBuf>> {
    let Some(dir) = dir else {
        return Ok(None);
    };
    let made = std::fs::create_dir_all(dir)
        .and_then(|()| dir.canonicalize())
        .with_context(|| format!("--stats-dir {}: cannot make the directory", dir.display()))?;
    if made.to_str().is_none() {
        bail!(
            "--stats-dir {}: the path is not UTF-8, which the programs' settings must be: \
             use another directory",
            made.display()
        );
    }
    Ok(Some(made))
}

/// `--backend kernel`: the program as a child in a memory cgroup under the kernel's swap;
/// returns its exit status once everything made for it is gone.
fn run_under_kernel(args: &RunArgs, memory: u64) -> Result<ExitCode> {
    let mut uswap_only = args.core.uswap_only_options();
    if args.address_space.is_some() {
        uswap_only.insert(0, "--address-space");
    }
    if args.vm_size.is_some() {
        uswap_only.insert(0, "--vm-size");
    }
    if args.start_allowance.is_some() {
        uswap_only.insert(0, "--start-allowance");
    }
    if args.stats_dir.is_some() {
        uswap_only.insert(0, "--stats-dir");
    }
    if !uswap_only.is_empty() {
        bail!(
            "{} set uswap's own behaviour and mean nothing with --backend kernel: leave them \
             out (--swap-dir, --swap-size, --readahead and --page-cluster apply to both)",
            uswap_only.join(", ")
        );
    }
    let setup = kernel_setup(
        memory,
        args.core.swap_dir(),
        args.core.swap_size,
        args.kernel.kernel_swap,
        args.kernel.tunables(&args.core, memory)?,
    );
    let mut command = std::process::Command::new(&args.command[0]);
    command.args(&args.command[1..]);
    let (done, _) = kernel::run_program(&setup, command)?;
    Ok(ExitCode::from(program::exit_code(done.finished.status)))
}

/// What a program under the kernel's swap needs: a cgroup limited to `memory`, and swap of
/// `swap_size` (default: as much as `uswap run` would have) of `kind`, the swap already on
/// or a swap file in `swap_dir` for `file`.
pub fn kernel_setup(
    memory: u64,
    swap_dir: PathBuf,
    swap_size: Option<u64>,
    kind: KernelSwap,
    tunables: Vec<(Tunable, String)>,
) -> kernel::Setup {
    kernel::Setup {
        memory_limit: Some(memory),
        swap: Some(kernel::SwapPlan {
            kind,
            bytes: swap_size.unwrap_or_else(|| default_swap(memory, &swap_dir)),
            dir: swap_dir,
            own: false,
        }),
        tunables,
    }
}

/// Swap space when none is set: three times the memory, at least 4 GiB, at most 64 GiB and
/// what the swap directory's file system has free.
fn default_swap(memory: u64, swap_dir: &Path) -> u64 {
    let free = free_space(swap_dir).map_or(u64::MAX, |f| f / 10 * 9);
    (memory.saturating_mul(3))
        .clamp(4 << 30, 64 << 30)
        .min(free)
}

fn free_space(dir: &Path) -> Option<u64> {
    use std::os::unix::ffi::OsStrExt;
    let path = std::ffi::CString::new(dir.as_os_str().as_bytes()).ok()?;
    // SAFETY: a NUL-terminated path and a statvfs to fill.
    let mut st: libc::statvfs = unsafe { std::mem::zeroed() };
    (unsafe { libc::statvfs(path.as_ptr(), &mut st) } == 0)
        .then(|| st.f_bavail as u64 * st.f_frsize as u64)
}

fn half_of_ram() -> Result<u64> {
    // SAFETY: sysconf has no preconditions.
    let (pages, size) = unsafe {
        (
            libc::sysconf(libc::_SC_PHYS_PAGES),
            libc::sysconf(libc::_SC_PAGESIZE),
        )
    };
    if pages <= 0 || size <= 0 {
        bail!("cannot tell the machine's memory size; give --memory");
    }
    Ok((pages as u64 * size as u64 / 2).min(uswap_core::MAX_MEMORY))
}

/// The preload library beside this binary.
pub fn preload_library() -> Result<PathBuf> {
    let exe = std::env::current_exe().context("cannot find the uswap binary's own path")?;
    let lib = exe.with_file_name(PRELOAD);
    if lib.to_string_lossy().contains([' ', '\t', ':']) {
        bail!(
            "the preload library's path {} has a space or a colon, which LD_PRELOAD cannot \
             carry (the loader would skip it and run the program unlimited); build uswap in \
             a directory without them",
            lib.display()
        );
    }
    if !lib.is_file() {
        bail!(
            "the preload library {} is missing: build the whole workspace (`cargo build \
             --release` at its root), which builds it beside the uswap binary",
            lib.display()
        );
    }
    Ok(lib)
}

/// `name` as `execvp` would find it.
fn find_program(name: &OsString) -> Result<PathBuf> {
    let path = Path::new(name);
    if path.components().count() > 1 {
        return Ok(path.to_path_buf());
    }
    let dirs = std::env::var_os("PATH").unwrap_or_else(|| "/usr/bin:/bin".into());
    std::env::split_paths(&dirs)
        .map(|d| d.join(path))
        .find(|p| is_executable(p))
        .with_context(|| format!("{}: command not found", path.display()))
}

fn is_executable(path: &Path) -> bool {
    std::fs::metadata(path).is_ok_and(|m| m.is_file() && m.permissions().mode() & 0o111 != 0)
}

/// Refuses what the dynamic loader would run without the preload library: a set-user-ID
/// or set-group-ID program, a static one, or one of another ELF class or machine. A script
/// is judged by its interpreter (`#!` lines nest at most 4 deep, as the kernel allows).
fn check_preloadable(program: &Path) -> Result<()> {
    check_preloadable_at(program, 0)
}

fn check_preloadable_at(program: &Path, depth: u32) -> Result<()> {
    let meta =
        std::fs::metadata(program).with_context(|| format!("cannot run {}", program.display()))?;
    if meta.permissions().mode() & (libc::S_ISUID | libc::S_ISGID) != 0 {
        bail!(
            "{} is set-user-ID or set-group-ID: the dynamic loader ignores LD_PRELOAD for it, \
             so its memory cannot be put in uswap; run a copy without those bits",
            program.display()
        );
    }
    let head = read_head(program)?;
    if let Some(interpreter) = script_interpreter(&head) {
        if depth >= 4 {
            bail!("{}: too many nested #! interpreters", program.display());
        }
        return check_preloadable_at(&interpreter, depth + 1);
    }
    if is_foreign_elf(&head) {
        bail!(
            "{} is not a 64-bit program for this machine: the preload library cannot be \
             loaded into it",
            program.display()
        );
    }
    if is_static_elf(&head) && carries_go_build_id(&head) {
        bail!(
            "{} is a statically linked Go program: it loads no preload library, and Go's \
             runtime makes its own system calls for memory, so uswap cannot hold its heap. \
             Build it linked against the C library (CGO_ENABLED=1 go build \
             -ldflags=-linkmode=external), whose runtime then maps memory through it, or \
             run it under the kernel's swap: uswap run --backend kernel",
            program.display()
        );
    }
    if is_static_elf(&head) {
        bail!(
            "{} is statically linked: it loads no preload library, so its memory cannot be \
             put in uswap; run a dynamically linked build of it",
            program.display()
        );
    }
    Ok(())
}

fn read_head(program: &Path) -> Result<Vec<u8>> {
    use std::io::Read;
    let mut head = Vec::new();
    std::fs::File::open(program)
        .and_then(|f| f.take(64 * 1024).read_to_end(&mut head))
        .with_context(|| format!("cannot read {}", program.display()))?;
    Ok(head)
}

/// The interpreter named on a `#!` line.
fn script_interpreter(head: &[u8]) -> Option<PathBuf> {
    let line = head.strip_prefix(b"#!")?.split(|&b| b == b'\n').next()?;
    let text = String::from_utf8_lossy(line);
    text.split_whitespace().next().map(PathBuf::from)
}

/// Whether `head` starts an ELF file of another class or machine than this binary's.
fn is_foreign_elf(head: &[u8]) -> bool {
    #[cfg(target_arch = "x86_64")]
    const MACHINE: u16 = 62; // EM_X86_64
    #[cfg(target_arch = "aarch64")]
    const MACHINE: u16 = 183; // EM_AARCH64
    if head.len() < 20 || &head[..4] != b"\x7fELF" {
        return false;
    }
    head[4] != 2 || head[5] != 1 || u16::from_le_bytes([head[18], head[19]]) != MACHINE
}

/// Whether `head` starts a 64-bit little-endian ELF executable with no program
/// interpreter (PT_INTERP): one the kernel starts without the dynamic loader.
fn is_static_elf(head: &[u8]) -> bool {
    const PT_INTERP: u32 = 3;
    if head.len() < 64 || &head[..4] != b"\x7fELF" || head[4] != 2 || head[5] != 1 {
        return false;
    }
    let u16_at = |o: usize| u16::from_le_bytes([head[o], head[o + 1]]) as usize;
    let phoff = u64::from_le_bytes(head[32..40].try_into().unwrap()) as usize;
    let (phentsize, phnum) = (u16_at(54), u16_at(56));
    let types: Vec<u32> = (0..phnum)
        .map(|i| phoff + i * phentsize)
        .filter(|&o| o + 4 <= head.len())
        .map(|o| u32::from_le_bytes(head[o..o + 4].try_into().unwrap()))
        .collect();
    // A static PIE has no interpreter either: static for this purpose too.
    !types.is_empty() && !types.contains(&PT_INTERP)
}

/// Whether `head` holds a Go build ID note (`.note.go.buildid`: name "Go\0\0", type 4),
/// which Go's linker puts near the start of every ELF program it makes.
fn carries_go_build_id(head: &[u8]) -> bool {
    head.windows(16).any(|w| {
        w[..4] == 4u32.to_le_bytes() && w[8..12] == 4u32.to_le_bytes() && &w[12..] == b"Go\0\0"
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_dynamic_program_is_accepted_and_a_script_is_judged_by_its_interpreter() {
        assert!(!is_static_elf(&read_head(Path::new("/bin/sh")).unwrap()));
        assert_eq!(
            script_interpreter(b"#!/bin/sh -e\necho hi\n"),
            Some(PathBuf::from("/bin/sh"))
        );
        assert_eq!(script_interpreter(b"\x7fELF"), None);
    }

    #[test]
    fn an_elf_of_another_class_or_machine_is_foreign() {
        let ours = read_head(Path::new("/bin/sh")).unwrap();
        assert!(!is_foreign_elf(&ours));
        let mut elf32 = ours.clone();
        elf32[4] = 1;
        assert!(is_foreign_elf(&elf32));
        let mut other_machine = ours;
        other_machine[18] = 40; // EM_ARM
        assert!(is_foreign_elf(&other_machine));
        assert!(!is_foreign_elf(b"#!/bin/sh\n"));
    }

    #[test]
    fn an_elf_without_an_interpreter_is_static() {
        // A minimal ELF64 header with one PT_LOAD program header and no PT_INTERP.
        let mut elf = vec![0u8; 64 + 56];
        elf[..6].copy_from_slice(b"\x7fELF\x02\x01");
        elf[32..40].copy_from_slice(&64u64.to_le_bytes());
        elf[54..56].copy_from_slice(&56u16.to_le_bytes());
        elf[56..58].copy_from_slice(&1u16.to_le_bytes());
        elf[64..68].copy_from_slice(&1u32.to_le_bytes());
        assert!(is_static_elf(&elf));
        elf[64..68].copy_from_slice(&3u32.to_le_bytes());
        assert!(!is_static_elf(&elf));
    }
}
