//! `uswap`: benchmarks and tools for user-space swap.

mod args;
mod bench;
mod ctl;
mod info;
mod kernel;
mod report;
mod run;
mod stat;
mod workload;

use anyhow::Result;
use clap::{Parser, Subcommand};
use std::process::ExitCode;

#[derive(Parser)]
#[command(
    name = "uswap",
    version,
    about = "User-space swap on userfaultfd: benchmarks and tools"
)]
struct Cli {
    #[command(subcommand)]
    command: Command,
}

#[derive(Subcommand)]
enum Command {
    /// Show the kernel version and the userfaultfd features uswap can use
    Info {
        /// Print JSON
        #[arg(long)]
        json: bool,
    },
    /// Run a benchmark (uswap, or the kernel's own swap with --backend kernel)
    Bench {
        #[command(subcommand)]
        bench: Bench,
    },
    /// Run a program with its memory in uswap: at most --memory resident, the rest swapped
    /// (or under the kernel's swap in a memory cgroup, with --backend kernel)
    Run(run::RunArgs),
    /// Counters and fault latency of a program running under uswap, once or every few
    /// seconds (like vmstat)
    Stat(stat::StatArgs),
    /// Show or change the run-time knobs of a program running under uswap (memory limit,
    /// swap_ra_policy, page-cluster)
    Ctl(ctl::CtlArgs),
    /// Internal: the child process of `--backend kernel`
    #[command(name = kernel::child::SUBCOMMAND, hide = true)]
    KernelChild { spec: String },
}

#[derive(Subcommand)]
enum Bench {
    /// Random reads and writes (uniform, or skewed with --distribution) on a region larger
    /// than memory, every read verified (pmbench-like)
    Random(bench::random::RandomArgs),
    /// First-touch faults per second on fresh regions (will-it-scale page_fault1-like)
    Fault(bench::fault::FaultArgs),
    /// Cost per page of first-touch, minor and major faults (uswap only)
    Refault(bench::refault::RefaultArgs),
    /// Time to bring a half-swapped-out set back: touching every page, or swapoff
    Swapback(bench::swapback::SwapbackArgs),
    /// Latency of one access to a small hot set while threads thrash a set larger than
    /// memory with writes, reported like ping (seed 003's experiment)
    Probe(bench::probe::ProbeArgs),
    /// A program (CMD ARGS…) under the kernel's swap and under `uswap run`, in interleaved
    /// rounds: wall and CPU time, peak memory, faults, swap, exit status, and the ratios
    Run(bench::run::BenchRunArgs),
}

/// Runs the command; returns the exit status (a program's own for those that run one).
fn run(cli: Cli) -> Result<ExitCode> {
    let done = match cli.command {
        Command::Info { json } => info::run(json),
        Command::Bench { bench } => match bench {
            Bench::Random(a) => bench::random::run(&a),
            Bench::Fault(a) => bench::fault::run(&a),
            Bench::Refault(a) => bench::refault::run(&a),
            Bench::Swapback(a) => bench::swapback::run(&a),
            Bench::Probe(a) => bench::probe::run(&a),
            Bench::Run(a) => return bench::run::run(&a),
        },
        Command::Run(a) => return run::run(&a),
        Command::Stat(a) => stat::run(&a),
        Command::Ctl(a) => ctl::run(&a),
        Command::KernelChild { spec } => kernel::child::main(&spec),
    };
    done.map(|()| ExitCode::SUCCESS)
}

fn main() -> ExitCode {
    // Output piped into `head` ends the program quietly, as for other command-line tools,
    // instead of a panic in println!. Everything the benchmarks set up is torn down before
    // they print their reports.
    // SAFETY: restoring the default disposition of SIGPIPE, before any thread starts.
    unsafe { libc::signal(libc::SIGPIPE, libc::SIG_DFL) };
    match run(Cli::parse()) {
        Ok(code) => code,
        Err(e) => {
            eprintln!("error: {e:#}");
            ExitCode::FAILURE
        }
    }
}
