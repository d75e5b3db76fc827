//! The program's resident anonymous memory that uswap does not hold: its threads' stacks,
//! private copies of file pages, memory from before uswap loaded, uswap's own metadata and
//! whatever a program asks the kernel for in ways uswap does not serve. The limit does not
//! hold it, so when it is most of the program's memory after start-up, `uswap run` says so
//! once, rather than let a user believe the limit holds the program.

use std::sync::Arc;
use std::time::Duration;
use uswap_core::control::Watch;
use uswap_core::{Region, PAGE_SIZE};

/// When the first look is taken (start-up is over), and how often after it.
const EVERY: Duration = Duration::from_secs(10);

/// Less than this outside is never worth a word: a small program's stacks and libraries.
const FLOOR: u64 = 64 << 20;

/// The look, every [`EVERY`] until it has said it once, which the control socket's thread
/// takes between requests.
pub fn watch(region: Arc<Region>, program: String) -> Watch {
    Watch {
        every: EVERY,
        look: Box::new(move || {
            verdict(&region, &program)
                .inspect(|msg| crate::sys::warn(msg))
                .is_some()
        }),
    }
}

fn verdict(region: &Region, program: &str) -> Option<String> {
    let pid = std::process::id();
    let anon = uswap_core::stats::rss_anon_bytes(pid)?;
    let held = region.held_pages() * PAGE_SIZE as u64;
    let outside = anon.saturating_sub(held);
    (outside >= FLOOR && outside * 2 > anon).then(|| {
        format!(
            "uswap run: {} MiB of {program}'s {} MiB of resident anonymous memory is outside \
             uswap and its limit (uswap holds {} MiB); `uswap stat {pid}` shows it. See \
             README, \"What stays outside the limit\".\n",
            outside >> 20,
            anon >> 20,
            held >> 20
        )
    })
}
