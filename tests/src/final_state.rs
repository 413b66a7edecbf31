//! The simulator's final state (`edgefleet-sim run --final-state`) against
//! Device status: did every Device end at its device's last report?

use std::collections::HashMap;
use std::path::Path;

use edgefleet_shared::PropertyValue;
use edgefleet_shared::api::Device;
use edgefleet_shared::codec::DeviceReport;
use kube::ResourceExt;

/// Each device's last acknowledged report, by Device name.
pub fn read_final_state(path: &Path) -> anyhow::Result<HashMap<String, DeviceReport>> {
    #[derive(serde::Deserialize)]
    struct Line {
        device: String,
        report: Option<DeviceReport>,
    }
    let mut finals = HashMap::new();
    for line in std::fs::read_to_string(path)?.lines() {
        let line: Line = serde_json::from_str(line)?;
        if let (Some(name), Some(report)) = (line.device.split('/').nth(1), line.report) {
            finals.insert(name.to_owned(), report);
        }
    }
    Ok(finals)
}

/// An event's identity: the device's (boot epoch, id).
pub type EventId = (u64, u64);

/// The events one device raised, from the final-state file.
#[derive(Clone, Debug, Default, PartialEq, Eq, serde::Deserialize)]
pub struct FinalEvents {
    /// Every event it raised, in order.
    pub events: Vec<EventId>,
    /// Those its agent had not confirmed when the simulator stopped.
    pub unconfirmed_events: Vec<EventId>,
    /// Those given up because the device's Device was deleted.
    #[serde(default)]
    pub abandoned_events: Vec<EventId>,
}

/// Each device's events, by Device name.
pub fn read_final_events(path: &Path) -> anyhow::Result<HashMap<String, FinalEvents>> {
    #[derive(serde::Deserialize)]
    struct Line {
        device: String,
        #[serde(flatten)]
        events: FinalEvents,
    }
    let mut finals = HashMap::new();
    for line in std::fs::read_to_string(path)?.lines() {
        let line: Line = serde_json::from_str(line)?;
        if let Some(name) = line.device.split('/').nth(1) {
            finals.insert(name.to_owned(), line.events);
        }
    }
    Ok(finals)
}

/// Whether a Device's status shows exactly its device's last report
/// (numbers compared by value: the API server turns 19.0 into 19).
pub fn matches_final(device: &Device, finals: &HashMap<String, DeviceReport>) -> bool {
    let Some(last) = finals.get(&device.name_any()) else {
        return false;
    };
    let Some(status) = device.status.as_ref() else {
        return false;
    };
    let same = |a: &PropertyValue, b: &PropertyValue| match (a.as_f64(), b.as_f64()) {
        (Some(x), Some(y)) => x == y,
        _ => a == b,
    };
    status.applied_generation == Some(last.applied_generation)
        && status.reported.len() == last.properties.len()
        && last
            .properties
            .iter()
            .all(|(k, v)| status.reported.get(k).is_some_and(|s| same(s, v)))
}

/// Waits until every Device in `devices` shows exactly its device's last
/// report (`finals`) and applied its current generation, and there are
/// `count` of them; fails after `patience` naming the ones that differ.
pub async fn wait_converged(
    devices: &kube::Api<Device>,
    finals: &HashMap<String, DeviceReport>,
    count: usize,
    patience: std::time::Duration,
) -> anyhow::Result<()> {
    let converged =
        |d: &Device| matches_final(d, finals) && crate::fleet_view::applied_current_generation(d);
    let deadline = tokio::time::Instant::now() + patience;
    loop {
        let list = devices.list(&Default::default()).await?;
        if list.items.len() == count && list.items.iter().all(converged) {
            return Ok(());
        }
        if tokio::time::Instant::now() > deadline {
            let wrong: Vec<String> = list
                .items
                .iter()
                .filter(|d| !converged(d))
                .map(|d| {
                    format!(
                        "{} (generation {:?}): status {:?}\n  last report {:?}",
                        d.name_any(),
                        d.metadata.generation,
                        d.status
                            .as_ref()
                            .map(|s| (&s.applied_generation, &s.reported, &s.phase)),
                        finals.get(&d.name_any())
                    )
                })
                .collect();
            anyhow::bail!(
                "{} of {} Devices (want {count}) never reached their device's last report at their current generation:\n{}",
                wrong.len(),
                list.items.len(),
                wrong.join("\n")
            );
        }
        tokio::time::sleep(std::time::Duration::from_millis(200)).await;
    }
}
