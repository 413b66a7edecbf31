//! The live fleet view of `edgefleet-up`: per edge node, how many Devices
//! there are and how far each got (delivered, applied, online); and per
//! FleetRollout, its phase and its devices by state, overall and per site.

use std::collections::BTreeMap;
use std::fmt::Write;

use edgefleet_shared::api::device::condition;
use edgefleet_shared::api::rollout::{FleetRollout, StateCounts};
use edgefleet_shared::api::{Device, EdgeNode};

/// One node's line.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct NodeRow {
    /// Devices on the node.
    pub devices: usize,
    /// Devices whose current generation the agent stored.
    pub delivered: usize,
    /// Devices that applied their current generation.
    pub applied: usize,
    /// Devices whose Online condition is True.
    pub online: usize,
    /// Whether the node's agent is connected (from its EdgeNode).
    pub connected: Option<bool>,
}

/// Whether a Device's device applied exactly its current generation.
pub fn applied_current_generation(device: &Device) -> bool {
    device.status.as_ref().and_then(|s| s.applied_generation) == device.metadata.generation
}

/// The view: rows by node name.
pub fn summarize(devices: &[Device], nodes: &[EdgeNode]) -> BTreeMap<String, NodeRow> {
    let mut rows: BTreeMap<String, NodeRow> = BTreeMap::new();
    for node in nodes {
        let name = node.metadata.name.clone().unwrap_or_default();
        rows.entry(name).or_default().connected =
            Some(node.status.as_ref().is_some_and(|s| s.connected));
    }
    for device in devices {
        let row = rows.entry(device.spec.node.clone()).or_default();
        let generation = device.metadata.generation.unwrap_or_default();
        let status = device.status.clone().unwrap_or_default();
        row.devices += 1;
        row.delivered += usize::from(status.delivered_generation >= Some(generation));
        row.applied += usize::from(status.applied_generation >= Some(generation));
        row.online += usize::from(
            status
                .conditions
                .iter()
                .any(|c| c.type_ == condition::ONLINE && c.status == "True"),
        );
    }
    rows
}

/// The view as a table.
pub fn render(rows: &BTreeMap<String, NodeRow>) -> String {
    let mut out = format!(
        "{:<16} {:<10} {:>8} {:>10} {:>8} {:>8}\n",
        "NODE", "AGENT", "DEVICES", "DELIVERED", "APPLIED", "ONLINE"
    );
    let mut total = NodeRow::default();
    for (node, row) in rows {
        let agent = match row.connected {
            Some(true) => "connected",
            Some(false) => "offline",
            None => "never",
        };
        let _ = writeln!(
            out,
            "{node:<16} {agent:<10} {:>8} {:>10} {:>8} {:>8}",
            row.devices, row.delivered, row.applied, row.online
        );
        total.devices += row.devices;
        total.delivered += row.delivered;
        total.applied += row.applied;
        total.online += row.online;
    }
    let _ = writeln!(
        out,
        "{:<16} {:<10} {:>8} {:>10} {:>8} {:>8}",
        "total", "", total.devices, total.delivered, total.applied, total.online
    );
    out
}

/// The rollouts as a table: one line per rollout, then one per site.
pub fn render_rollouts(rollouts: &[FleetRollout]) -> String {
    let mut out = format!(
        "{:<20} {:<12} {:<10} {:<10} {:>6} {:>7} {:>8} {:>6} {:>5} {:>6} {:>10} {:>11}\n",
        "ROLLOUT",
        "PHASE",
        "WAVE",
        "SITE",
        "TOTAL",
        "PENDING",
        "UPDATING",
        "BAKING",
        "DONE",
        "FAILED",
        "ROLLEDBACK",
        "UNREACHABLE"
    );
    let line = |out: &mut String,
                name: &str,
                phase: &str,
                wave: &str,
                site: &str,
                c: &StateCounts| {
        let _ = writeln!(
            out,
            "{name:<20} {phase:<12} {wave:<10} {site:<10} {:>6} {:>7} {:>8} {:>6} {:>5} {:>6} {:>10} {:>11}",
            c.total,
            c.pending,
            c.updating,
            c.baking,
            c.succeeded,
            c.failed,
            c.rolled_back,
            c.unreachable
        );
    };
    for rollout in rollouts {
        let name = rollout.metadata.name.as_deref().unwrap_or_default();
        let status = rollout.status.clone().unwrap_or_default();
        let phase = status.phase.map(|p| format!("{p:?}")).unwrap_or_default();
        let wave = status.wave.clone().unwrap_or_default();
        line(&mut out, name, &phase, &wave, "(all)", &status.counts);
        for site in &status.sites {
            line(&mut out, "", "", "", &site.name, &site.counts);
        }
    }
    out
}

#[cfg(test)]
mod tests {
    use edgefleet_shared::api::{
        DeviceSpec, DeviceStatus, EdgeNodeSpec, EdgeNodeStatus, Transport,
    };
    use k8s_openapi::apimachinery::pkg::apis::meta::v1::{Condition, Time};

    use super::*;

    fn device(node: &str, generation: i64, delivered: i64, applied: i64, online: bool) -> Device {
        let mut d = Device::new(
            "d",
            DeviceSpec {
                node: node.into(),
                model: "thermostat".into(),
                transport: Transport::Coap,
                desired: Default::default(),
                firmware: None,
                retry: 0,
            },
        );
        d.metadata.generation = Some(generation);
        let conditions = online
            .then(|| Condition {
                type_: "Online".into(),
                status: "True".into(),
                reason: "Reporting".into(),
                message: String::new(),
                observed_generation: None,
                last_transition_time: Time(k8s_openapi::jiff::Timestamp::now()),
            })
            .into_iter()
            .collect();
        d.status = Some(DeviceStatus {
            delivered_generation: Some(delivered),
            applied_generation: Some(applied),
            conditions,
            ..Default::default()
        });
        d
    }

    #[test]
    fn rows_count_each_stage_against_the_current_generation() {
        let devices = [
            device("edge-1", 2, 2, 2, true),
            device("edge-1", 3, 3, 2, true), // delivered, not applied
            device("edge-1", 3, 2, 2, false), // neither
            device("edge-2", 1, 1, 1, true),
        ];
        let mut node = EdgeNode::new("edge-1", EdgeNodeSpec::default());
        node.status = Some(EdgeNodeStatus {
            connected: true,
            ..Default::default()
        });
        let rows = summarize(&devices, &[node]);
        assert_eq!(
            rows["edge-1"],
            NodeRow {
                devices: 3,
                delivered: 2,
                applied: 1,
                online: 2,
                connected: Some(true)
            }
        );
        assert_eq!(rows["edge-2"].connected, None);
        let mut rollout: FleetRollout = serde_json::from_value(serde_json::json!({
            "apiVersion": "edgefleet.io/v1alpha1", "kind": "FleetRollout",
            "metadata": { "name": "fw-2" },
            "spec": { "target": { "firmware": { "version": "2.0.0" } }, "selector": {} },
        }))
        .unwrap();
        rollout.status = Some(serde_json::from_value(serde_json::json!({
            "phase": "Progressing", "wave": "canary",
            "counts": { "total": 30, "pending": 27, "updating": 2, "succeeded": 1 },
            "sites": [{ "name": "site-1", "counts": { "total": 10, "pending": 9, "updating": 1 } }],
        }))
        .unwrap());
        let table = render_rollouts(&[rollout]);
        let lines: Vec<Vec<&str>> = table
            .lines()
            .map(|l| l.split_whitespace().collect())
            .collect();
        assert_eq!(
            lines[1],
            [
                "fw-2",
                "Progressing",
                "canary",
                "(all)",
                "30",
                "27",
                "2",
                "0",
                "1",
                "0",
                "0",
                "0"
            ]
        );
        assert_eq!(
            lines[2],
            ["site-1", "10", "9", "1", "0", "0", "0", "0", "0"]
        );
        let table = render(&rows);
        assert!(table.contains("total"), "{table}");
        assert!(
            table
                .lines()
                .any(|l| l.starts_with("edge-1") && l.contains("connected")),
            "{table}"
        );
    }
}
