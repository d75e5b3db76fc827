//! vmstat-style event counters and fault service-time histograms.

use crate::lockdep::Rank;
use crate::lockstat::{LockClass, StatMutex};
use hdrhistogram::Histogram;
use serde::Serialize;
use std::sync::atomic::{AtomicU64, Ordering::Relaxed};
use std::time::Duration;

macro_rules! vmstat {
    ($($(#[$doc:meta])* $name:ident,)*) => {
        /// The events counted, one per counter, named as the counters are (the kernel's
        /// `vm_event_item`, in lower case).
        #[allow(non_camel_case_types)]
        #[derive(Clone, Copy, Debug, PartialEq, Eq)]
        pub(crate) enum VmEvent { $($(#[$doc])* $name,)* }

        const EVENTS: usize = [$(VmEvent::$name,)*].len();

        /// Live counters, one per [`VmEvent`], bumped only through [`VmStat::count`].
        ///
        /// An event is counted when it has happened, with two exceptions, both taken back
        /// ([`VmStat::uncount`]) when the fault does not map its page after all: a fault's
        /// own counters (`pgzerofill`, `pgactivate`, `pgmajfault`) are counted just before
        /// the fill that maps its page, because the fill wakes the faulting thread and a
        /// program that reads the counters after its access must find that access counted;
        /// and `pswpin` counts a read only for a fault that goes on to map it (one that
        /// backs out reads the page again when it retries).
        pub struct VmStat { counters: [AtomicU64; EVENTS] }

        impl Default for VmStat {
            fn default() -> VmStat {
                VmStat { counters: [const { AtomicU64::new(0) }; EVENTS] }
            }
        }

        /// A copy of the counters at one moment.
        #[derive(Clone, Copy, Debug, Default, Serialize, serde::Deserialize, PartialEq, Eq)]
        pub struct VmStatSnapshot { $($(#[$doc])* pub $name: u64,)* }

        impl VmStat {
            /// Counts `n` events of one kind (a relaxed add); returns the count before.
            pub(crate) fn count(&self, event: VmEvent, n: u64) -> u64 {
                self.counters[event as usize].fetch_add(n, Relaxed)
            }

            /// Takes back `n` events counted ahead of a fill that failed (see [`VmStat`]).
            pub(crate) fn uncount(&self, event: VmEvent, n: u64) {
                self.counters[event as usize].fetch_sub(n, Relaxed);
            }

            /// The events of one kind so far.
            pub(crate) fn get(&self, event: VmEvent) -> u64 {
                self.counters[event as usize].load(Relaxed)
            }

            pub fn snapshot(&self) -> VmStatSnapshot {
                VmStatSnapshot { $($name: self.get(VmEvent::$name),)* }
            }
        }

        impl VmStatSnapshot {
            /// Counter-wise difference `self - earlier`.
            pub fn since(&self, earlier: &VmStatSnapshot) -> VmStatSnapshot {
                VmStatSnapshot { $($name: self.$name.wrapping_sub(earlier.$name),)* }
            }

            /// `(name, value)` pairs in declaration order, for printing.
            pub fn fields(&self) -> Vec<(&'static str, u64)> {
                vec![$((stringify!($name), self.$name),)*]
            }
        }
    };
}

vmstat! {
    /// Faults handled (every kind).
    pgfault,
    /// Faults that had to read from the swap device.
    pgmajfault,
    /// Pages read from the swap device.
    pswpin,
    /// Pages written to the swap device.
    pswpout,
    /// Pages read by swap-in readahead (also counted in `pswpin`).
    swap_ra,
    /// Readahead pages used before reclaim dropped them.
    swap_ra_hit,
    /// First-touch pages zero-filled (fault-around included).
    pgzerofill,
    /// Inactive pages looked at by reclaim.
    pgscan,
    /// Pages reclaimed (their memory given back).
    pgsteal,
    /// Pages promoted from the inactive to the active list (re-referenced).
    pgactivate,
    /// Pages moved from the active to the inactive list (unmapped, data kept).
    pgdeactivate,
    /// Swap-ins a fault asked for (not readahead) of pages evicted from this region before
    /// (they had a shadow).
    workingset_refault,
    /// Of those, pages evicted within the working set (refault distance no longer than the
    /// mapped lists, active and probation), which went straight to the active list.
    workingset_activate,
    /// Active pages aging passed over once because they had faulted back from the inactive
    /// list since it last took them (second chance, the kernel's referenced check).
    pgreferenced,
    /// Of those, pages seen in use by their written bits (`References::Written`), without
    /// a fault: aging found them written since it last looked.
    pgreferenced_written,
    /// Runs of pages whose written bits could not be read (`PAGEMAP_SCAN` failed): aged as
    /// if they had none.
    written_scan_failed,
    /// Reclaimed clean pages that kept a valid swap copy: dropped without I/O.
    pgclean_dropped,
    /// Reclaimed pages found all zero: dropped, refilled with zeros on next touch.
    pgzero_dropped,
    /// Background reclaimer wake-ups.
    kswapd_wake,
    /// Reclaim passes run by a faulting thread because the budget was exhausted.
    direct_reclaim,
    /// Swap-ins that failed their check (tag or checksum) against what was written.
    verify_errors,
    /// Failed swap reads or writes.
    io_errors,
    /// Write-outs that found no free swap slot.
    swap_full,
    /// Accesses failed loudly (SIGBUS or poisoned page) because data could not be served.
    failed_faults,
    /// Times reclaim could not unmap a page the program had mlocked or mprotected.
    pgskip_unmovable,
    /// Times aging left a page mapped because a system call had pinned it (SIGBUS mode
    /// with syscall dispatch: the call reads or writes it).
    pgskip_pinned,
    /// System calls of dispatching threads that read or wrote region memory, whose buffers
    /// were brought in and pinned for the call (SIGBUS mode, `syscall_dispatch`).
    syscall_pins,
    /// Faults the SIGBUS handler could not resolve itself and handed to its region's
    /// service thread (direct reclaim, a window past its batch, an error to report).
    sigbus_handovers,
    /// Faults on pages uswap had mapped that were gone (failed loudly, never looped).
    unexplained_faults,
    /// Pages the program discarded (MADV_DONTNEED/MADV_FREE): zeros from then on.
    pgdiscard,
    /// Of those, pages that were mapped: kept charged until a fault or reclaim shows
    /// whether the kernel zapped them (`Kind::Lazyfree`).
    pglazyfree,
    /// Lazily freed pages that reclaim found zapped and freed without moving anything.
    pglazyfreed,
    /// Pages the program unmapped.
    pgunmap,
    /// Pages that followed an mremap to a new place in the region.
    pgremap,
    /// Faults on memory that left the region (mremap grew or moved it out), handed back to
    /// the kernel.
    foreign_faults,
    /// Faults or events whose handling panicked (each failed loudly).
    handler_panics,
    /// Swapped-in pages mapped over the memory limit because neither memory nor a swap
    /// slot could be had for them (their data has nowhere else to go).
    overdraft,
    /// Pages a fork child got mapped copy-on-write from its parent (in the child), shared
    /// and not charged to it until they become its own.
    fork_shared,
    /// Pages a fork wrote to the child's swap device (in the parent): those that were not
    /// mapped (inactive or swapped out), which the kernel cannot share.
    fork_copied,
    /// Pages that were not mapped at a fork and that it lent to the child instead of
    /// copying them (in the parent): their slots of this process's swap device (file or
    /// compressed pool), or their staging frames.
    fork_lent,
    /// Shared pages that became this process's own at their first write here (the
    /// kernel's copy-on-write break).
    cow_break,
    /// Shared pages that became this process's own because the other process no longer
    /// maps them (it wrote, reclaimed or unmapped its copy, or exited).
    cow_alone,
    /// Pages reclaim copied to take them out of the region because a fork relative still
    /// mapped them (UFFDIO_MOVE moves only pages mapped once).
    cow_reclaim,
    /// Pages a fork child read from a slot an ancestor lent and did not change, which
    /// aging then dropped without a write (in the child): borrowed again.
    borrowed_dropped,
}

/// What a handled fault was, for the service-time histograms.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum FaultKind {
    /// First touch: zero-fill (with fault-around).
    FirstTouch,
    /// Page found on the inactive list (data still in memory): no disk.
    Minor,
    /// Page read from the swap device.
    Major,
}

/// Percentiles of a latency histogram of nanoseconds, in microseconds.
#[derive(Clone, Copy, Debug, Default, Serialize, serde::Deserialize)]
pub struct Latency {
    pub count: u64,
    pub mean_us: f64,
    pub p50_us: f64,
    pub p90_us: f64,
    pub p99_us: f64,
    pub p999_us: f64,
    pub max_us: f64,
}

impl Latency {
    pub fn of(h: &Histogram<u64>) -> Self {
        let us = |ns: u64| ns as f64 / 1000.0;
        Latency {
            count: h.len(),
            mean_us: h.mean() / 1000.0,
            p50_us: us(h.value_at_quantile(0.50)),
            p90_us: us(h.value_at_quantile(0.90)),
            p99_us: us(h.value_at_quantile(0.99)),
            p999_us: us(h.value_at_quantile(0.999)),
            max_us: us(h.max()),
        }
    }
}

/// Fault service times (from the moment uswap sees the fault until it is resolved), split by
/// kind. Sharded so concurrent handlers rarely meet on one lock.
pub struct FaultLatency {
    shards: Vec<StatMutex<[Histogram<u32>; 3]>>,
}

/// Most shards: one per CPU up to this many (each costs about 43 KB of histograms, zeroed
/// by every process under `uswap run` and every child of fork when its region is made).
const MAX_SHARDS: usize = 16;

/// Longest fault service time told apart: 10 s (a longer one counts as 10 s).
const SERVICE_MAX_NS: u64 = 10_000_000_000;

/// A histogram of a region's fault service times: nanoseconds, 1 ns to 10 s, at 2
/// significant digits (each value within 1%), with 32-bit counts (a count stops at 4
/// billion). Each is 14 KB, a sixteenth of [`new_histogram`]'s size: the shards'
/// histograms are zeroed page by page at every start of a process and of a fork child
/// under `uswap run`, and were a third of the page faults of a shell's short command at
/// 3 digits and 64-bit counts.
fn new_service_histogram() -> Histogram<u32> {
    Histogram::new_with_bounds(1, SERVICE_MAX_NS, 2).expect("static histogram bounds are valid")
}

/// A histogram of nanoseconds: 1 ns to 100 s at 3 significant digits.
pub fn new_histogram() -> Histogram<u64> {
    Histogram::new_with_bounds(1, 100_000_000_000, 3).expect("static histogram bounds are valid")
}

/// Records a duration into a histogram of nanoseconds (any precision).
pub fn record(h: &mut Histogram<u64>, took: Duration) {
    h.saturating_record((took.as_nanos() as u64).max(1));
}

impl Default for FaultLatency {
    fn default() -> Self {
        FaultLatency {
            shards: (0..crate::cpu::configured().clamp(1, MAX_SHARDS))
                .map(|_| {
                    StatMutex::new(
                        Rank::Latency,
                        [
                            new_service_histogram(),
                            new_service_histogram(),
                            new_service_histogram(),
                        ],
                    )
                })
                .collect(),
        }
    }
}

impl FaultLatency {
    pub fn record(&self, kind: FaultKind, took: Duration) {
        let shard = crate::cpu::current() % self.shards.len();
        let ns = (took.as_nanos() as u64).clamp(1, SERVICE_MAX_NS);
        self.shards[shard].lock()[kind as usize].saturating_record(ns);
    }

    /// The statistics of the shards' locks (`latency`).
    pub(crate) fn lockstat(&self) -> LockClass {
        LockClass::sum("latency", self.shards.iter())
    }

    pub fn merged(&self, kind: FaultKind) -> Histogram<u64> {
        let mut all = Histogram::<u64>::new_with_bounds(1, SERVICE_MAX_NS, 2)
            .expect("static histogram bounds are valid");
        for shard in &self.shards {
            // Bucket by bucket: the bounds are the same, so each count lands in its bucket.
            for bucket in shard.lock()[kind as usize].iter_recorded() {
                all.saturating_record_n(bucket.value_iterated_to(), bucket.count_at_value().into());
            }
        }
        all
    }
}

/// Everything a region reports: counters and fault service times.
#[derive(Clone, Debug, Serialize)]
pub struct Stats {
    pub vmstat: VmStatSnapshot,
    pub first_touch: Latency,
    pub minor: Latency,
    pub major: Latency,
    /// Pages resident now (active + inactive).
    pub resident_pages: u64,
    /// Swap slots in use now.
    pub swap_used_pages: u64,
    /// Pages mapped copy-on-write with the process that made them (a fork's), counted
    /// there and not in `resident_pages`.
    #[serde(default)]
    pub shared_pages: u64,
    /// Slots of the swap device that fork children hold: they read those pages from it
    /// (the device's; shared by the regions on it).
    #[serde(default)]
    pub fork_lent_slots: u64,
    /// Pages whose data is in a slot or frame a fork ancestor lent this process: not read
    /// yet, or read and unchanged since (`PageState::borrowed`).
    #[serde(default)]
    pub borrowed_pages: u64,
    /// Memory uswap keeps for the region outside its limit (page table, LRU links,
    /// shadows).
    pub metadata_bytes: u64,
    /// The LRU policy in force and the length of each list, in pages.
    #[serde(default)]
    pub lru: LruStats,
    /// The swap device's I/O counters (retries, re-reads, errors; shared by the regions on
    /// the device).
    pub io: crate::swapfile::IoStats,
    /// The swap device's swap cache counters (shared by the regions on the device).
    pub swap_cache: crate::swapfile::swap_state::SwapCacheStats,
    /// The swap-in readahead in force.
    pub readahead: crate::config::Readahead,
    /// What the per-CPU charge stocks saved (with `Config::pcp`).
    pub charge_stock: crate::budget::StockStats,
    /// Lock statistics of the region's locks and its swap device's, one line per lock class.
    pub lockstat: Vec<crate::lockstat::LockClass>,
    /// The compressed tier in front of the swap file (its device's).
    #[serde(default)]
    pub ztier: crate::swapfile::ZtierStats,
}

/// The LRU lists of a region (`/proc/meminfo`'s `Active(anon)` and `Inactive(anon)`), in
/// pages; pages waiting in per-CPU batches are on none yet.
#[derive(Clone, Copy, Debug, Default, Serialize, serde::Deserialize, PartialEq, Eq)]
pub struct LruStats {
    pub policy: crate::config::LruPolicy,
    /// Mapped pages that have shown use (all mapped pages under `two-list`).
    pub active: u64,
    /// Unmapped pages in staging frames.
    pub inactive: u64,
    /// Mapped pages on trial (`s3fifo`).
    pub probation: u64,
}

/// A process's resident anonymous memory (`RssAnon` in /proc/PID/status): the kernel's
/// count, whoever holds it (uswap's resident pages, its metadata and staging frames, and
/// what stays outside its limit). None when it cannot be read.
pub fn rss_anon_bytes(pid: u32) -> Option<u64> {
    rss_anon_of(&std::fs::read_to_string(format!("/proc/{pid}/status")).ok()?)
}

fn rss_anon_of(status: &str) -> Option<u64> {
    let line = status.lines().find(|l| l.starts_with("RssAnon:"))?;
    let kib: u64 = line.split_whitespace().nth(1)?.parse().ok()?;
    Some(kib << 10)
}

#[cfg(all(test, not(loom)))]
mod tests {
    use super::*;

    #[test]
    fn service_times_merge_across_shards_within_one_percent_and_stop_at_ten_seconds() {
        let latency = FaultLatency::default();
        // From several threads, so more than one shard is written where there are CPUs.
        std::thread::scope(|s| {
            for _ in 0..4 {
                s.spawn(|| {
                    for _ in 0..250 {
                        latency.record(FaultKind::Minor, Duration::from_micros(5));
                    }
                });
            }
        });
        latency.record(FaultKind::Minor, Duration::from_millis(2));
        latency.record(FaultKind::Minor, Duration::from_secs(20));
        latency.record(FaultKind::Major, Duration::from_micros(80));
        let minor = Latency::of(&latency.merged(FaultKind::Minor));
        assert_eq!(minor.count, 1002);
        assert!((minor.p50_us - 5.0).abs() <= 0.05, "{minor:?}");
        assert!(
            (minor.max_us - 10_000_000.0).abs() <= 100_000.0,
            "{minor:?}"
        );
        let major = Latency::of(&latency.merged(FaultKind::Major));
        assert_eq!(major.count, 1);
        assert!((major.p50_us - 80.0).abs() <= 0.8, "{major:?}");
        assert_eq!(latency.merged(FaultKind::FirstTouch).len(), 0);
    }

    #[test]
    fn rss_anon_is_read_from_the_status_file() {
        let status = "VmRSS:\t  10240 kB\nRssAnon:\t    4096 kB\nRssFile:\t 6144 kB\n";
        assert_eq!(rss_anon_of(status), Some(4 << 20));
        assert_eq!(rss_anon_of("VmRSS: 1 kB\n"), None);
        assert!(rss_anon_bytes(std::process::id()).is_some_and(|b| b > 0));
        assert_eq!(rss_anon_bytes(u32::MAX), None);
    }

    #[test]
    fn snapshot_difference_and_fields() {
        let v = VmStat::default();
        assert_eq!(v.count(VmEvent::pswpin, 3), 0);
        let a = v.snapshot();
        assert_eq!(v.count(VmEvent::pswpin, 4), 3, "the count before");
        v.count(VmEvent::pgfault, 1);
        v.count(VmEvent::pgfault, 2);
        v.uncount(VmEvent::pgfault, 2);
        let d = v.snapshot().since(&a);
        assert_eq!((d.pswpin, d.pgfault, d.pswpout), (4, 1, 0));
        assert!(d.fields().contains(&("pswpin", 4)));
    }

    #[test]
    fn latency_percentiles_come_from_recorded_values() {
        let l = FaultLatency::default();
        for us in 1..=1000u64 {
            l.record(FaultKind::Major, Duration::from_micros(us));
        }
        let m = Latency::of(&l.merged(FaultKind::Major));
        assert_eq!(m.count, 1000);
        // Two significant digits: within 1% of the value.
        let near = |got: f64, want: f64| (got - want).abs() <= want / 100.0;
        assert!(near(m.p50_us, 500.0), "{m:?}");
        assert!(near(m.p999_us, 999.0), "{m:?}");
        assert!(near(m.max_us, 1000.0), "{m:?}");
        assert_eq!(Latency::of(&l.merged(FaultKind::Minor)).count, 0);
    }
}
