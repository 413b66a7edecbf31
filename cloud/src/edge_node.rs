//! EdgeNode resources: created on an agent's first connect, their status
//! following the agent's stream and heartbeats.
//!
//! Writes are coarse: a heartbeat that changes nothing people look at moves
//! `lastHeartbeat` at most once per [`HEARTBEAT_RESOLUTION`].

use std::time::Duration;

use edgefleet_shared::api::edge_node::condition;
use edgefleet_shared::api::{EdgeNode, EdgeNodeSpec, EdgeNodeStatus};
use k8s_openapi::apimachinery::pkg::apis::meta::v1::{Condition, Time};
use k8s_openapi::jiff::Timestamp;
use kube::api::{Patch, PatchParams};
use kube::{Api, Client};

use crate::status::FIELD_MANAGER;

/// `lastHeartbeat` moves at most this often on its own.
pub const HEARTBEAT_RESOLUTION: Duration = Duration::from_secs(60);

/// EdgeNode writes in flight at once, for all nodes of this process. A
/// thousand agents connecting together (after a controller restart) would
/// otherwise make a thousand requests at once, each on a connection of its
/// own (HTTP/1.1) that then idles in the client's pool: memory here and a
/// file descriptor in the API server for each. The writes wait instead; a
/// session does not wait for them.
const WRITES_AT_ONCE: usize = 16;
static WRITES: tokio::sync::Semaphore = tokio::sync::Semaphore::const_new(WRITES_AT_ONCE);

/// What the cloud last wrote about one node, so it can skip idle writes.
#[derive(Debug)]
pub struct NodeStatus {
    api: Api<EdgeNode>,
    node: String,
    written: Option<EdgeNodeStatus>,
    // The agent's connection (version, boot id) until the EdgeNode says so:
    // a write that failed (the API server away) is made again at the next
    // heartbeat, not given up.
    unrecorded_connect: Option<(String, String)>,
}

impl NodeStatus {
    /// Status writes for `node`.
    pub fn new(client: Client, node: &str) -> Self {
        NodeStatus {
            api: Api::all(client),
            node: node.to_owned(),
            written: None,
            unrecorded_connect: None,
        }
    }

    /// The node.
    pub fn node(&self) -> &str {
        &self.node
    }

    /// The agent connected: make sure the EdgeNode exists and say so. If
    /// that fails, the next [`NodeStatus::heartbeat`] tries again.
    pub async fn connected(
        &mut self,
        agent_version: &str,
        boot_id: &str,
    ) -> Result<(), kube::Error> {
        self.unrecorded_connect = Some((agent_version.to_owned(), boot_id.to_owned()));
        self.record_connect().await
    }

    async fn record_connect(&mut self) -> Result<(), kube::Error> {
        let Some((agent_version, boot_id)) = self.unrecorded_connect.clone() else {
            return Ok(());
        };
        let node = EdgeNode::new(&self.node, EdgeNodeSpec::default());
        let permit = WRITES.acquire().await.expect("never closed");
        self.api
            .patch(
                &self.node,
                &PatchParams::apply(FIELD_MANAGER),
                &Patch::Apply(&node),
            )
            .await?;
        drop(permit);
        let now = Timestamp::now();
        let mut status = self.written.clone().unwrap_or_default();
        status.connected = true;
        status.agent_version = Some(agent_version);
        status.boot_id = Some(boot_id);
        status.last_heartbeat = Some(Time(now));
        set_ready(
            &mut status.conditions,
            "True",
            "AgentConnected",
            "the agent's sync stream is open",
            now,
        );
        self.write(status).await?;
        self.unrecorded_connect = None;
        Ok(())
    }

    /// A heartbeat arrived with these figures.
    pub async fn heartbeat(
        &mut self,
        device_count: i64,
        outbox_depth: i64,
        events_dropped: i64,
    ) -> Result<(), kube::Error> {
        self.record_connect().await?;
        let Some(written) = self.written.clone() else {
            return Ok(());
        };
        let now = Timestamp::now();
        let mut status = written.clone();
        status.device_count = Some(device_count);
        status.outbox_depth = Some(outbox_depth);
        status.events_dropped = Some(events_dropped);
        let figures_changed = status != written;
        let heartbeat_stale = written
            .last_heartbeat
            .as_ref()
            .is_none_or(|t| now.duration_since(t.0).unsigned_abs() >= HEARTBEAT_RESOLUTION);
        if !figures_changed && !heartbeat_stale {
            return Ok(());
        }
        status.last_heartbeat = Some(Time(now));
        self.write(status).await
    }

    /// The agent's stream ended.
    pub async fn disconnected(&mut self) -> Result<(), kube::Error> {
        let now = Timestamp::now();
        let mut status = self.written.clone().unwrap_or_default();
        status.connected = false;
        set_ready(
            &mut status.conditions,
            "Unknown",
            "AgentDisconnected",
            "the agent's sync stream closed",
            now,
        );
        self.write(status).await
    }

    async fn write(&mut self, status: EdgeNodeStatus) -> Result<(), kube::Error> {
        let patch = serde_json::json!({
            "apiVersion": "edgefleet.io/v1alpha1",
            "kind": "EdgeNode",
            "status": status,
        });
        let _permit = WRITES.acquire().await.expect("never closed");
        self.api
            .patch_status(
                &self.node,
                &PatchParams::apply(FIELD_MANAGER).force(),
                &Patch::Apply(&patch),
            )
            .await?;
        self.written = Some(status);
        Ok(())
    }
}

fn set_ready(
    conditions: &mut Vec<Condition>,
    status: &str,
    reason: &str,
    message: &str,
    now: Timestamp,
) {
    crate::conditions::set(conditions, ready(status, reason, message, now));
}

fn ready(status: &str, reason: &str, message: &str, now: Timestamp) -> Condition {
    Condition {
        type_: condition::READY.to_owned(),
        status: status.to_owned(),
        reason: reason.to_owned(),
        message: message.to_owned(),
        observed_generation: None,
        last_transition_time: Time(now),
    }
}
