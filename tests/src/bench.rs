//! What the benchmark binaries share: their printed report and waiting for
//! a fleet to apply its specs.

use std::time::{Duration, Instant};

use anyhow::bail;
use edgefleet_shared::api::Device;
use kube::Api;

use crate::fleet_view::applied_current_generation;

/// Lines printed as they come and kept for `results.txt`.
#[derive(Debug, Default)]
pub struct Report {
    /// Everything printed so far.
    pub text: String,
}

impl Report {
    /// Prints `line` and keeps it.
    pub fn line(&mut self, line: &str) {
        println!("{line}");
        self.text.push_str(line);
        self.text.push('\n');
    }
}

/// p50, p99 and max of `samples`, in ms.
pub fn quantiles(samples: &mut [Duration]) -> String {
    if samples.is_empty() {
        return "no samples".into();
    }
    samples.sort();
    let at = |q: f64| {
        let i = ((samples.len() as f64 - 1.0) * q).round() as usize;
        samples[i].as_secs_f64() * 1000.0
    };
    format!(
        "p50 {:.2} ms  p99 {:.2} ms  max {:.2} ms  (n={})",
        at(0.5),
        at(0.99),
        at(1.0),
        samples.len()
    )
}

/// Polls until there are `count` Devices and each applied its current
/// generation; fails after `patience`.
pub async fn wait_all_applied(
    devices: &Api<Device>,
    count: usize,
    what: &str,
    patience: Duration,
) -> anyhow::Result<()> {
    let deadline = Instant::now() + patience;
    loop {
        let list = devices.list(&Default::default()).await?;
        let ready = list
            .items
            .iter()
            .filter(|d| applied_current_generation(d))
            .count();
        if list.items.len() == count && ready == count {
            return Ok(());
        }
        if Instant::now() > deadline {
            bail!(
                "{what}: only {ready} of {count} after {} s",
                patience.as_secs()
            );
        }
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
}
