//! What `uswap run` hands the preload library in the program's environment: the settings
//! of the program's region, as JSON in [`ENV`], with the file of the tree's memory
//! cgroup. Children the program starts with `exec` inherit both and are set up the same
//! way, charging the same limit.

use crate::{Config, Error, Result};

/// The environment variable carrying [`Settings`].
pub const ENV: &str = "USWAP_RUN";

#[derive(Clone, Debug, serde::Serialize, serde::Deserialize)]
pub struct Settings {
    pub config: Config,
    /// Bytes of the program's heap and private mappings, resident and swapped together,
    /// that may be committed at once (the region's commit limit).
    pub vm_size: u64,
    /// Bytes of address space for the program's memory, at least `vm_size`: the rest holds
    /// reservations (`PROT_NONE`) that a program commits later, as the JVM, V8 and Go
    /// reserve their heaps. The region is this large; at most `vm_size` of it is committed
    /// at once. 0: `vm_size`.
    #[serde(default)]
    pub address_space: u64,
    /// The file of the tree's memory cgroup (`MemCgroup::create_shared`): every program of
    /// the tree charges the one limit.
    pub memcg: Option<std::path::PathBuf>,
    /// Bytes a program may commit before its region is built (its userfaultfds, threads,
    /// swap file and control socket); it is built at once at 0, or when the tree's limit
    /// has no room for the allowance. `None`: [`default_start_allowance`].
    #[serde(default)]
    pub start_allowance: Option<u64>,
    /// Where each program of the tree leaves, when it exits, its region's counters as
    /// `PID.json` (the `stat` reply of its control socket): totals for the tree once it
    /// has ended, when no control socket answers any more.
    #[serde(default)]
    pub stats_dir: Option<std::path::PathBuf>,
}

/// The start-up allowance of a program whose memory limit is `limit` bytes: 8 MiB (a
/// shell's command, a script's helper, a compiler's driver), at most an eighth of the
/// limit so that a small limit stays mostly uswap's; whole pages.
pub fn default_start_allowance(limit: u64) -> u64 {
    (8u64 << 20).min(limit / 8) & !(crate::PAGE_SIZE as u64 - 1)
}

impl Settings {
    /// The settings in `text` (the value of [`ENV`]).
    pub fn parse(text: &str) -> Result<Settings> {
        serde_json::from_str(text)
            .map_err(|e| Error::invalid("uswap run settings", format!("{ENV} is malformed: {e}")))
    }

    pub fn to_env(&self) -> String {
        serde_json::to_string(self).expect("settings always serialize")
    }
}
