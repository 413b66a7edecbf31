//! Absent agents: after a grace period without an agent, an EdgeNode turns
//! `Ready=Unknown` and each of its Devices `Online=Unknown`, both with
//! reason `NodeUnreachable`; when an agent connects again its Devices turn
//! back (the sync session submits `NodeReachable`, the EdgeNode is marked
//! connected).
//!
//! A node counts as gone from the moment its last stream ended here, or,
//! for nodes no agent has connected to since this controller started, from
//! its EdgeNode's `lastHeartbeat` (coarse: up to
//! [`HEARTBEAT_RESOLUTION`] old even
//! while connected, so that much more grace is given). Device changes go
//! through the status writer, so a site going dark costs its Devices'
//! writes within the budget.

use std::collections::HashSet;
use std::sync::Arc;
use std::time::Duration;

use edgefleet_shared::api::EdgeNode;
use edgefleet_shared::api::edge_node::condition;
use k8s_openapi::apimachinery::pkg::apis::meta::v1::{Condition, Time};
use k8s_openapi::jiff::Timestamp;
use kube::api::{Patch, PatchParams};
use kube::runtime::reflector::Store;
use kube::{Api, ResourceExt};

use crate::agents::Agents;
use crate::edge_node::HEARTBEAT_RESOLUTION;
use crate::index::Index;
use crate::status::{FIELD_MANAGER, NODE_UNREACHABLE, StatusChange, StatusWriter};

/// What the watch over nodes needs.
pub struct Liveness {
    /// The EdgeNodes, written through the client of each node's shard;
    /// only the nodes this replica serves are judged.
    pub fence: crate::leases::Fence,
    /// The EdgeNode reflector.
    pub edge_nodes: Store<EdgeNode>,
    /// Which agents are connected.
    pub agents: Arc<Agents>,
    /// Which Devices each node has.
    pub index: Arc<Index>,
    /// Where Device changes go.
    pub status: StatusWriter,
    /// How long a node may be without an agent before it is unreachable.
    pub grace: Duration,
}

impl std::fmt::Debug for Liveness {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Liveness")
            .field("grace", &self.grace)
            .finish_non_exhaustive()
    }
}

impl Liveness {
    /// Checks every node a few times per grace period, until the process
    /// ends.
    pub async fn run(self) {
        let mut marked: HashSet<String> = HashSet::new();
        let mut ticks = tokio::time::interval((self.grace / 4).max(Duration::from_millis(250)));
        ticks.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
        loop {
            ticks.tick().await;
            for node in self.edge_nodes.state() {
                let name = node.name_any();
                if !self.fence.serves(&name) {
                    marked.remove(&name);
                    continue;
                }
                if self.agents.is_connected(&name) {
                    marked.remove(&name);
                    continue;
                }
                let devices = self.index.devices_of(&name);
                // A controller limited to a namespace judges only the nodes
                // it serves: those with its Devices, or that it served.
                if devices.is_empty() && self.agents.disconnected_since(&name).is_none() {
                    continue;
                }
                if marked.contains(&name) || !self.gone_too_long(&node) {
                    continue;
                }
                let api: Api<EdgeNode> = Api::all(self.fence.node(&name));
                match mark_unreachable(&api, &node, self.grace).await {
                    Ok(()) => {
                        tracing::warn!(node = %name, grace = ?self.grace, "no agent within the grace period: node unreachable");
                        for key in devices {
                            let change = StatusChange::NodeUnreachable { node: name.clone() };
                            self.status.submit(key, change, None);
                        }
                        marked.insert(name);
                    }
                    Err(error) => {
                        tracing::warn!(node = %name, %error, "could not mark the node unreachable; will retry");
                    }
                }
            }
        }
    }

    fn gone_too_long(&self, node: &EdgeNode) -> bool {
        if let Some(since) = self.agents.disconnected_since(&node.name_any()) {
            return since.elapsed() >= self.grace;
        }
        let status = node.status.clone().unwrap_or_default();
        let already = status
            .conditions
            .iter()
            .any(|c| c.type_ == condition::READY && c.reason == NODE_UNREACHABLE);
        if already {
            // Marked by an earlier controller; nothing to add.
            return false;
        }
        match status.last_heartbeat {
            Some(Time(at)) => {
                let age = Timestamp::now().duration_since(at);
                age.unsigned_abs() >= self.grace + HEARTBEAT_RESOLUTION
            }
            None => true,
        }
    }
}

/// Writes `Ready=Unknown`, reason `NodeUnreachable`, keeping the rest of
/// the status this manager owns.
async fn mark_unreachable(
    api: &Api<EdgeNode>,
    node: &EdgeNode,
    grace: Duration,
) -> Result<(), kube::Error> {
    let mut status = node.status.clone().unwrap_or_default();
    status.connected = false;
    crate::conditions::set(
        &mut status.conditions,
        Condition {
            type_: condition::READY.to_owned(),
            status: "Unknown".to_owned(),
            reason: NODE_UNREACHABLE.to_owned(),
            message: format!("no agent has been connected for {}s", grace.as_secs()),
            observed_generation: None,
            last_transition_time: Time(Timestamp::now()),
        },
    );
    let patch = serde_json::json!({
        "apiVersion": "edgefleet.io/v1alpha1",
        "kind": "EdgeNode",
        "status": status,
    });
    api.patch_status(
        &node.name_any(),
        &PatchParams::apply(FIELD_MANAGER).force(),
        &Patch::Apply(&patch),
    )
    .await
    .map(drop)
}
