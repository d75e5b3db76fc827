//! The kernel's swap settings a run may change: readahead (`vm.page-cluster`, VMA
//! readahead) and zswap (on, its compressor and its pool's limit).

use anyhow::{bail, Context, Result};
use serde::Serialize;
use std::fs;
use std::path::Path;
use uswap_core::{Compressor, ReadaheadPolicy};

/// A machine-wide setting the kernel backend may change for a run (and restores after it).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Tunable {
    /// log2 of the most pages one swap-in reads.
    PageCluster,
    /// VMA-based readahead (`true`) or the cluster-based, hit-scaled one (`false`).
    VmaReadahead,
    /// zswap's compressor (a crypto API name).
    ZswapCompressor,
    /// zswap's pool limit, in percent of the machine's memory.
    ZswapMaxPoolPercent,
    /// Whether zswap stores pages (`Y`/`N`).
    ZswapEnabled,
}

impl Tunable {
    /// The settings every report shows (zswap's only when a run sets them).
    pub const ALL: [Tunable; 2] = [Tunable::PageCluster, Tunable::VmaReadahead];

    pub fn path(self) -> &'static str {
        match self {
            Tunable::PageCluster => "/proc/sys/vm/page-cluster",
            Tunable::VmaReadahead => "/sys/kernel/mm/swap/vma_ra_enabled",
            Tunable::ZswapCompressor => "/sys/module/zswap/parameters/compressor",
            Tunable::ZswapMaxPoolPercent => "/sys/module/zswap/parameters/max_pool_percent",
            Tunable::ZswapEnabled => "/sys/module/zswap/parameters/enabled",
        }
    }

    pub fn name(self) -> &'static str {
        match self {
            Tunable::PageCluster => "vm.page-cluster",
            Tunable::VmaReadahead => "vma_ra_enabled",
            Tunable::ZswapCompressor => "zswap.compressor",
            Tunable::ZswapMaxPoolPercent => "zswap.max_pool_percent",
            Tunable::ZswapEnabled => "zswap.enabled",
        }
    }

    pub fn read(self) -> Result<String> {
        let text = fs::read_to_string(self.path())
            .with_context(|| format!("reading {} ({})", self.name(), self.path()))?;
        Ok(text.trim().to_string())
    }

    pub fn write(self, value: &str) -> Result<()> {
        fs::write(self.path(), value)
            .with_context(|| format!("setting {} to {value} ({})", self.name(), self.path()))
    }
}

/// A setting as it was during the run, for the report.
#[derive(Clone, Debug, Serialize, PartialEq, Eq)]
pub struct TunableState {
    pub name: &'static str,
    pub value: String,
    /// The value before the run, when the run changed it (restored afterwards).
    #[serde(skip_serializing_if = "Option::is_none")]
    pub previous: Option<String>,
}

impl std::fmt::Display for TunableState {
    fn fmt(&self, f: &mut std::fmt::Formatter) -> std::fmt::Result {
        write!(f, "{} {}", self.name, self.value)?;
        match &self.previous {
            Some(old) => write!(f, " (set; was {old})"),
            None => write!(f, " (as found)"),
        }
    }
}

/// The settings that give the kernel a readahead `policy` and `page_cluster`; what is not
/// given is left as it is. The kernel has no `fixed` policy, and `none` is page-cluster 0.
pub fn for_readahead(
    policy: Option<ReadaheadPolicy>,
    page_cluster: Option<u8>,
) -> Result<Vec<(Tunable, String)>> {
    let mut settings = Vec::new();
    match policy {
        None => {}
        Some(ReadaheadPolicy::Fixed) => bail!(
            "--readahead fixed does not exist in the kernel (the seed's fixed-window policy \
             was never merged): use --backend uswap for it, or vma, scaling or none"
        ),
        Some(ReadaheadPolicy::None) => {
            if page_cluster.is_some_and(|pc| pc != 0) {
                bail!(
                    "--readahead none is page-cluster 0 in the kernel: leave out \
                     --page-cluster or give 0"
                );
            }
            return Ok(vec![(Tunable::PageCluster, "0".to_string())]);
        }
        // The kernel's default, which it follows only while no rotational swap is on:
        // `auto` there is `vma` set.
        Some(ReadaheadPolicy::Vma | ReadaheadPolicy::Auto) => {
            settings.push((Tunable::VmaReadahead, "true".to_string()))
        }
        Some(ReadaheadPolicy::Scaling) => {
            settings.push((Tunable::VmaReadahead, "false".to_string()))
        }
    }
    if let Some(pc) = page_cluster {
        settings.push((Tunable::PageCluster, pc.to_string()));
    }
    Ok(settings)
}

/// The settings that turn the kernel's zswap on for a run, in the order they are set (the
/// pool and compressor first): the compressor `wanted` if this kernel has it, else
/// `lzo-rle` (the kernel's default family; this machine's kernel has no lz4 or zstd), and
/// a pool limit of `pool_bytes` as a whole share of the machine's memory (the kernel's
/// limit is machine-wide), at least 1%; with `None` (uswap's `auto`) the kernel's own
/// limit stays, its pool growing as its reclaim takes it.
pub fn for_zswap(wanted: Compressor, pool_bytes: Option<u64>) -> Result<Vec<(Tunable, String)>> {
    if !Path::new(Tunable::ZswapEnabled.path()).exists() {
        bail!(
            "--kernel-swap zswap: this kernel has no zswap ({} is missing)",
            Tunable::ZswapEnabled.path()
        );
    }
    let crypto = fs::read_to_string("/proc/crypto").context("reading /proc/crypto")?;
    let name = match wanted {
        Compressor::Lz4 => "lz4",
        Compressor::Zstd(_) => "zstd",
    };
    let compressor = match has_algorithm(&crypto, name) {
        true => name,
        false => "lzo-rle",
    };
    let mut settings = vec![(Tunable::ZswapCompressor, compressor.to_string())];
    if let Some(bytes) = pool_bytes {
        let total = fs::read_to_string("/proc/meminfo").context("reading /proc/meminfo")?;
        let percent = pool_percent(
            bytes,
            mem_total(&total).context("no MemTotal in /proc/meminfo")?,
        );
        settings.push((Tunable::ZswapMaxPoolPercent, percent.to_string()));
    }
    settings.push((Tunable::ZswapEnabled, "Y".to_string()));
    Ok(settings)
}

fn has_algorithm(crypto: &str, name: &str) -> bool {
    crypto
        .lines()
        .filter_map(|l| l.strip_prefix("name"))
        .any(|l| l.trim_start().trim_start_matches(':').trim() == name)
}

fn mem_total(meminfo: &str) -> Option<u64> {
    let line = meminfo.lines().find(|l| l.starts_with("MemTotal:"))?;
    Some(line.split_whitespace().nth(1)?.parse::<u64>().ok()? << 10)
}

/// `pool_bytes` as the nearest whole percent of `total`, at least 1.
fn pool_percent(pool_bytes: u64, total: u64) -> u64 {
    ((pool_bytes * 100 + total / 2) / total.max(1)).max(1)
}

/// The readahead in effect from the two settings' values and whether a rotational swap is
/// on (the kernel's vma readahead is off for all swap while one is: `nr_rotate_swap`), as
/// `--readahead` names it.
pub fn describe(page_cluster: &str, vma_ra_enabled: &str, rotational: Option<bool>) -> String {
    match (page_cluster, vma_ra_enabled, rotational) {
        ("0", _, _) => "none, page-cluster 0".to_string(),
        (_, "true" | "1", Some(true)) => format!(
            "scaling, page-cluster {page_cluster} (vma_ra_enabled, but a rotational swap is on)"
        ),
        (_, "true" | "1", _) => format!("vma, page-cluster {page_cluster}"),
        _ => format!("scaling, page-cluster {page_cluster}"),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn zswap_gets_a_compressor_this_kernel_has_and_a_whole_percent_pool() {
        let crypto = "name         : lzo-rle\ndriver       : lzo-rle-scomp\nname         : lz4\n";
        assert!(has_algorithm(crypto, "lz4"));
        assert!(!has_algorithm(crypto, "zstd"));
        assert!(!has_algorithm(crypto, "lzo"));
        assert_eq!(
            mem_total("MemTotal:       24576000 kB\nMemFree: 1 kB\n"),
            Some(24576000 << 10)
        );
        let gib = 1u64 << 30;
        assert_eq!(pool_percent(gib / 5, 24 * gib), 1, "at least 1%");
        assert_eq!(pool_percent(6 * gib, 24 * gib), 25);
        assert_eq!(pool_percent(gib / 2, 4 * gib), 13);
    }

    fn set(policy: Option<ReadaheadPolicy>, pc: Option<u8>) -> Result<Vec<(Tunable, String)>> {
        for_readahead(policy, pc)
    }

    #[test]
    fn policies_map_to_the_kernels_settings() {
        assert!(set(None, None).unwrap().is_empty());
        assert_eq!(
            set(None, Some(5)).unwrap(),
            vec![(Tunable::PageCluster, "5".into())]
        );
        assert_eq!(
            set(Some(ReadaheadPolicy::Vma), Some(2)).unwrap(),
            vec![
                (Tunable::VmaReadahead, "true".into()),
                (Tunable::PageCluster, "2".into())
            ]
        );
        assert_eq!(
            set(Some(ReadaheadPolicy::Scaling), None).unwrap(),
            vec![(Tunable::VmaReadahead, "false".into())]
        );
        assert_eq!(
            set(Some(ReadaheadPolicy::Auto), None).unwrap(),
            vec![(Tunable::VmaReadahead, "true".into())],
            "the kernel's default, which it applies by device itself"
        );
        assert_eq!(
            set(Some(ReadaheadPolicy::None), Some(0)).unwrap(),
            vec![(Tunable::PageCluster, "0".into())]
        );
    }

    #[test]
    fn fixed_and_a_contradiction_are_refused() {
        let err = set(Some(ReadaheadPolicy::Fixed), None).unwrap_err();
        assert!(err.to_string().contains("never merged"), "{err}");
        let err = set(Some(ReadaheadPolicy::None), Some(3)).unwrap_err();
        assert!(err.to_string().contains("page-cluster 0"), "{err}");
    }

    #[test]
    fn the_policy_in_effect_is_named() {
        assert_eq!(describe("3", "true", Some(false)), "vma, page-cluster 3");
        assert_eq!(describe("3", "true", None), "vma, page-cluster 3");
        assert!(describe("3", "true", Some(true)).starts_with("scaling, page-cluster 3 (vma_ra"));
        assert_eq!(
            describe("3", "false", Some(false)),
            "scaling, page-cluster 3"
        );
        assert_eq!(describe("0", "true", Some(true)), "none, page-cluster 0");
    }

    #[test]
    fn a_state_says_whether_it_was_changed() {
        let s = TunableState {
            name: "vm.page-cluster",
            value: "0".into(),
            previous: Some("3".into()),
        };
        assert_eq!(s.to_string(), "vm.page-cluster 0 (set; was 3)");
    }
}
