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
    /// Uniform random reads and writes on a region larger than memory, every read verified
    /// (pmbench-like)
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
}

fn run(cli: Cli) -> Result<()> {
    match cli.command {
        Command::Info { json } => info::run(json),
        Command::Bench { bench } => match bench {
            Bench::Random(a) => bench::random::run(&a),
            Bench::Fault(a) => bench::fault::run(&a),
            Bench::Refault(a) => bench::refault::run(&a),
            Bench::Swapback(a) => bench::swapback::run(&a),
            Bench::Probe(a) => bench::probe::run(&a),
        },
        Command::Run(a) => run::run(&a),
        Command::Stat(a) => stat::run(&a),
        Command::Ctl(a) => ctl::run(&a),
        Command::KernelChild { spec } => kernel::child::main(&spec),
    }
}

fn main() -> ExitCode {
    // Output piped into `head` ends the program quietly, as for other command-line tools,
    // instead of a panic in println!. Everything the benchmarks set up is torn down before
    // they print their reports.
    // SAFETY: restoring the default disposition of SIGPIPE, before any thread starts.
    unsafe { libc::signal(libc::SIGPIPE, libc::SIG_DFL) };
    match run(Cli::parse()) {
        Ok(()) => ExitCode::SUCCESS,
        Err(e) => {
            eprintln!("error: {e:#}");
            ExitCode::FAILURE
        }
    }
}
