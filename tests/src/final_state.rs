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

/// The events one device raised, from the final-state file.
#[derive(Clone, Debug, Default, PartialEq, Eq, serde::Deserialize)]
pub struct FinalEvents {
    /// Every event id it raised, in order.
    pub events: Vec<u64>,
    /// Those its agent had not confirmed when the simulator stopped.
    pub unconfirmed_events: Vec<u64>,
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
