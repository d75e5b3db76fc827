//! Formatting results: human-readable tables and JSON.

use anyhow::{Context, Result};
use serde::Serialize;
use std::io::{IsTerminal, Write};
use std::time::{Duration, Instant};
use uswap_core::{Latency, VmStatSnapshot};

/// Prints one pretty JSON object on stdout (an error, not a panic, if stdout is closed).
pub fn json<T: Serialize>(value: &T) -> Result<()> {
    let mut out = std::io::stdout().lock();
    serde_json::to_writer_pretty(&mut out, value)?;
    writeln!(out).context("writing the report")?;
    Ok(())
}

/// Bytes in binary units: `512 MiB`, `1.5 GiB`.
pub fn size(bytes: u64) -> String {
    const UNITS: [&str; 5] = ["B", "KiB", "MiB", "GiB", "TiB"];
    let mut v = bytes as f64;
    let mut unit = 0;
    while v >= 1024.0 && unit < UNITS.len() - 1 {
        v /= 1024.0;
        unit += 1;
    }
    if v.fract() == 0.0 {
        format!("{v} {}", UNITS[unit])
    } else {
        format!("{v:.1} {}", UNITS[unit])
    }
}

/// An integer with thousands separators: `1,234,567`.
pub fn count(n: u64) -> String {
    let digits = n.to_string();
    let groups: Vec<&str> = digits
        .as_bytes()
        .rchunks(3)
        .rev()
        .map(|g| std::str::from_utf8(g).expect("digits are ASCII"))
        .collect();
    groups.join(",")
}

/// Pages per second as MB/s (10^6 bytes, as the seed benchmarks report).
pub fn mb_per_s(pages: u64, seconds: f64) -> f64 {
    pages as f64 * uswap_core::PAGE_SIZE as f64 / seconds / 1e6
}

/// The compressed tier in one line: what it holds, and what it did.
pub fn ztier(z: &uswap_core::ZtierStats) -> String {
    format!(
        "holds {} pages ({} same-filled) in {} (limit {}, raised {} lowered {} times; \
         {:.2} page bytes per pool byte); stored {} ({} clean), loaded {}, written back {}, \
         dropped clean {}, rejected {} (+{} untried); compress {:.0} ms, decompress {:.0} ms",
        count(z.stored_pages),
        count(z.same_filled_pages),
        size(z.pool_bytes),
        size(z.limit_bytes),
        z.limit_raised,
        z.limit_lowered,
        z.compression_ratio,
        count(z.stores),
        count(z.stored_clean),
        count(z.loads),
        count(z.written_back),
        count(z.dropped_clean),
        count(z.reject_compress_poor + z.reject_alloc_fail),
        count(z.skipped_poor),
        z.store_ms,
        z.load_ms,
    )
}

pub fn access_latency(l: &Latency) -> String {
    format!(
        "p50 {:.1}  p90 {:.1}  p99 {:.1}  p99.9 {:.1}  max {:.1} µs  (mean {:.1})",
        l.p50_us, l.p90_us, l.p99_us, l.p999_us, l.max_us, l.mean_us
    )
}

/// The process's CPU time and context switches over an interval, per access and per
/// swap-in: the like-for-like cost of a fault under uswap and under the kernel.
pub fn cpu_use(c: &crate::workload::cpu::CpuUse, accesses: u64, swap_ins: u64) -> String {
    format!(
        "cpu user {:.2} s  system {:.2} s  ({:.1} µs per access)   context switches: \
         voluntary {} ({:.2} per swap-in)  involuntary {}",
        c.user_s,
        c.system_s,
        c.cpu_s() * 1e6 / accesses.max(1) as f64,
        count(c.voluntary_switches),
        c.voluntary_switches as f64 / swap_ins.max(1) as f64,
        count(c.involuntary_switches)
    )
}

/// Named counters on one line, in name order.
pub fn named_counters(counters: &std::collections::BTreeMap<String, u64>) {
    let fields: Vec<String> = counters
        .iter()
        .map(|(name, v)| format!("{name} {}", count(*v)))
        .collect();
    println!("  {}", fields.join("   "));
}

/// A lock statistics table, one row per lock class (the content of /proc/lock_stat).
pub fn lockstat(classes: &[uswap_core::LockClass]) {
    println!(
        "  {:<14} {:>6} {:>14} {:>12} {:>9} {:>12} {:>11}",
        "lock class", "locks", "acquisitions", "contended", "% cont.", "wait total", "wait max"
    );
    for c in classes {
        let s = &c.stat;
        println!(
            "  {:<14} {:>6} {:>14} {:>12} {:>8.2}% {:>9.1} ms {:>8.1} µs",
            c.name,
            c.locks,
            count(s.acquisitions),
            count(s.contended),
            100.0 * s.contention_ratio(),
            s.wait_ns_total as f64 / 1e6,
            s.wait_ns_max as f64 / 1e3
        );
    }
}

/// Where the time of faults and reclaim went, one row per phase.
pub fn breakdown(phases: &[uswap_core::PhaseSummary]) {
    println!(
        "  {:<18} {:>10} {:>9} {:>9} {:>9} {:>11}",
        "phase", "count", "mean µs", "p50", "p99", "total ms"
    );
    for p in phases {
        println!(
            "  {:<18} {:>10} {:>9.1} {:>9.1} {:>9.1} {:>11.1}",
            p.phase,
            count(p.count),
            p.mean_ns / 1e3,
            p.p50_ns as f64 / 1e3,
            p.p99_ns as f64 / 1e3,
            p.total_ms
        );
    }
}

/// Lock statistics over an interval: `after` less `before`, class by class.
pub fn lockstat_since(
    after: &[uswap_core::LockClass],
    before: &[uswap_core::LockClass],
) -> Vec<uswap_core::LockClass> {
    after
        .iter()
        .map(|a| match before.iter().find(|b| b.name == a.name) {
            Some(b) => a.since(b),
            None => a.clone(),
        })
        .collect()
}

/// A table of the library's fault service times, one row per fault kind.
pub fn service_times(rows: &[(&str, &Latency)]) {
    println!(
        "  {:<12} {:>10} {:>9} {:>9} {:>9} {:>9} {:>10}",
        "fault kind", "count", "mean µs", "p50", "p90", "p99", "max"
    );
    for (name, l) in rows {
        println!(
            "  {:<12} {:>10} {:>9.1} {:>9.1} {:>9.1} {:>9.1} {:>10.1}",
            name,
            count(l.count),
            l.mean_us,
            l.p50_us,
            l.p90_us,
            l.p99_us,
            l.max_us
        );
    }
}

/// The counters that moved, four to a line.
pub fn vmstat(v: &VmStatSnapshot) {
    let moved: Vec<String> = v
        .fields()
        .into_iter()
        .filter(|&(_, n)| n != 0)
        .map(|(name, n)| format!("{name} {}", count(n)))
        .collect();
    if moved.is_empty() {
        println!("  (no events)");
    }
    for line in moved.chunks(4) {
        println!("  {}", line.join("   "));
    }
}

/// A progress line on stderr, redrawn at most twice a second, and only on a terminal.
pub struct Progress {
    label: &'static str,
    on: bool,
    drawn: Option<Instant>,
}

impl Progress {
    const EVERY: Duration = Duration::from_millis(500);

    pub fn new(label: &'static str) -> Progress {
        Progress {
            label,
            on: std::io::stderr().is_terminal(),
            drawn: None,
        }
    }

    pub fn update(&mut self, done: u64, total: u64) {
        let recent = self.drawn.is_some_and(|t| t.elapsed() < Self::EVERY);
        if !self.on || (recent && done < total) {
            return;
        }
        eprint!(
            "\r{}: {} of {} pages",
            self.label,
            count(done),
            count(total)
        );
        self.drawn = Some(Instant::now());
    }

    /// Ends the line, if one was drawn.
    pub fn finish(&mut self) {
        if self.drawn.take().is_some() {
            eprintln!();
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn numbers_read_well() {
        assert_eq!(size(512 << 20), "512 MiB");
        assert_eq!(size(3 << 29), "1.5 GiB");
        assert_eq!(size(100), "100 B");
        assert_eq!(count(0), "0");
        assert_eq!(count(1234567), "1,234,567");
        assert_eq!(count(123456), "123,456");
        assert!((mb_per_s(1000, 2.0) - 2.048).abs() < 1e-9);
    }
}
