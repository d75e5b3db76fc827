//! What the integration tests that run `uswap run` share.

use std::path::Path;
use std::process::Command;

/// Builds the preload library beside the `uswap` binary (once per test binary, and in
/// every run, so a stale one is never used): `cargo test` builds the binary but not the
/// workspace's cdylib (`cargo build` does).
pub fn preload_library_built() {
    static BUILT: std::sync::Once = std::sync::Once::new();
    BUILT.call_once(|| {
        let uswap = Path::new(env!("CARGO_BIN_EXE_uswap"));
        let profile = match uswap.parent().and_then(|d| d.file_name()) {
            Some(dir) if dir == "release" => "release",
            _ => "test",
        };
        let status = Command::new(env!("CARGO"))
            .args(["build", "-p", "uswap-preload", "--profile", profile])
            .status()
            .expect("cargo runs");
        assert!(status.success(), "building the preload library failed");
    });
}
