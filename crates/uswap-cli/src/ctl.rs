//! `uswap ctl PID [KEY=VALUE...]`: shows or changes the run-time knobs of a program running
//! under uswap, through its control socket.

use anyhow::{bail, Context, Result};
use clap::Args;
use serde_json::{json, Map, Value};
use uswap_core::control;

#[derive(Args, Debug)]
pub struct CtlArgs {
    /// The process: a program running under uswap (such as `uswap bench random`)
    pub pid: u32,

    /// Knobs to set, in order: memory=SIZE (the memory limit; lowering it reclaims),
    /// swap_ra_policy=none|fixed|scaling|vma|auto, page-cluster=0..8. Without any, the knobs and
    /// their values are printed
    #[arg(value_name = "KEY=VALUE")]
    pub settings: Vec<String>,
}

pub fn run(a: &CtlArgs) -> Result<()> {
    let knobs = get(a.pid)?;
    // Every setting is checked before the first is made.
    let settings = a
        .settings
        .iter()
        .map(|s| setting(s, &knobs))
        .collect::<Result<Vec<_>>>()?;
    for (key, value) in settings {
        control::request(a.pid, &json!({"cmd": "set", "key": key, "value": value}))
            .with_context(|| format!("setting {key}={value}"))?;
    }
    for (key, value) in &get(a.pid)? {
        println!("{key}={}", shown(key, value));
    }
    Ok(())
}

/// The knobs the process has, with their values.
fn get(pid: u32) -> Result<Map<String, Value>> {
    match control::request(pid, &json!({"cmd": "get"}))?.get("knobs") {
        Some(Value::Object(knobs)) => Ok(knobs.clone()),
        _ => bail!("process {pid} sent no knobs"),
    }
}

/// `KEY=VALUE`, with a key the process knows.
fn setting<'a>(text: &'a str, knobs: &Map<String, Value>) -> Result<(&'a str, &'a str)> {
    let names = || knobs.keys().cloned().collect::<Vec<_>>().join(", ");
    let Some((key, value)) = text.split_once('=') else {
        bail!("{text:?}: use KEY=VALUE, with KEY one of {}", names());
    };
    if !knobs.contains_key(key) {
        bail!("unknown knob {key:?}: the knobs are {}", names());
    }
    Ok((key, value))
}

/// A value as `ctl` takes it back: the memory limit as a size when it is a whole number of
/// KiB, MiB, GiB or TiB.
fn shown(key: &str, value: &Value) -> String {
    match (key, value) {
        ("memory", Value::Number(n)) => n.as_u64().map_or(n.to_string(), exact_size),
        (_, Value::String(s)) => s.clone(),
        _ => value.to_string(),
    }
}

fn exact_size(bytes: u64) -> String {
    [("T", 40), ("G", 30), ("M", 20), ("K", 10)]
        .iter()
        .find(|&&(_, shift)| bytes != 0 && bytes.is_multiple_of(1 << shift))
        .map_or(bytes.to_string(), |(unit, shift)| {
            format!("{}{unit}", bytes >> shift)
        })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn sizes_are_shown_as_they_can_be_given_back() {
        assert_eq!(exact_size(4 << 20), "4M");
        assert_eq!(exact_size(3 << 30), "3G");
        assert_eq!(exact_size(1536 << 10), "1536K");
        assert_eq!(exact_size(4097), "4097");
        assert_eq!(exact_size(0), "0");
        for bytes in [4u64 << 20, 1536 << 10, 4097] {
            assert_eq!(uswap_core::parse_size(&exact_size(bytes)).unwrap(), bytes);
        }
        assert_eq!(shown("page-cluster", &json!(3)), "3");
        assert_eq!(shown("swap_ra_policy", &json!("vma")), "vma");
    }

    #[test]
    fn settings_need_a_known_key_and_an_equals_sign() {
        let knobs = json!({"memory": 1, "page-cluster": 3});
        let knobs = knobs.as_object().unwrap();
        assert_eq!(
            setting("page-cluster=2", knobs).unwrap(),
            ("page-cluster", "2")
        );
        let err = setting("swappiness=60", knobs).unwrap_err().to_string();
        assert!(err.contains("swappiness") && err.contains("memory, page-cluster"));
        assert!(setting("memory", knobs)
            .unwrap_err()
            .to_string()
            .contains("KEY=VALUE"));
    }
}
