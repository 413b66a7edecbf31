//! The EdgeNode resource: one edge site's agent, as the cloud sees it.

// Each `printcolumn(...)` repeats `type_ = ...`; clippy reads that as a
// duplicated attribute.
#![allow(clippy::duplicated_attributes)]

use k8s_openapi::apimachinery::pkg::apis::meta::v1::{Condition, Time};
use kube::CustomResource;
use serde::{Deserialize, Serialize};

use crate::api::schema;

/// An edge node. Its name is the Kubernetes node name (or, for a host that
/// is not a Kubernetes node, a name an operator chose); its labels (site,
/// line, region) are the failure domains rollouts limit by. The cloud
/// creates it on the first connect of an agent that proved it runs on that
/// node; an operator creates it for a host that is not a node.
#[derive(
    CustomResource, Clone, Debug, Default, PartialEq, Serialize, Deserialize, schemars::JsonSchema,
)]
#[kube(
    group = "edgefleet.io",
    version = "v1alpha1",
    kind = "EdgeNode",
    status = "EdgeNodeStatus",
    shortname = "en",
    category = "edgefleet",
    doc = "An edge node running the Edgefleet agent.",
    printcolumn(
        name = "Ready",
        type_ = "string",
        json_path = r#".status.conditions[?(@.type=="Ready")].status"#
    ),
    printcolumn(name = "Agent", type_ = "string", json_path = ".status.agentVersion"),
    printcolumn(name = "Devices", type_ = "integer", json_path = ".status.deviceCount"),
    printcolumn(
        name = "Outbox",
        type_ = "integer",
        json_path = ".status.outboxDepth",
        description = "Uplink entries waiting at the edge"
    ),
    printcolumn(
        name = "Heartbeat",
        type_ = "date",
        json_path = ".status.lastHeartbeat"
    ),
    printcolumn(
        name = "Age",
        type_ = "date",
        json_path = ".metadata.creationTimestamp"
    )
)]
#[serde(rename_all = "camelCase")]
pub struct EdgeNodeSpec {
    /// How the node's agent proves who it is. Left out (the cloud never
    /// sets it): the token of a pod on that Kubernetes node. `ClientCertificate`,
    /// which only an operator sets, lets the node's agent get a client
    /// certificate through the CertificateSigningRequest API (signer
    /// `edgefleet.io/agent`): for a host at a site that is not a
    /// Kubernetes node.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub agent_credentials: Option<AgentCredentials>,
    /// Who may ask for this node's client certificate: the Kubernetes user
    /// names a CertificateSigningRequest's `spec.username` must be one of
    /// (the host's bootstrap identity, e.g.
    /// `system:serviceaccount:edge-hosts:gw-7` or `system:bootstrap:<id>`).
    /// A request from anyone else is denied, whatever it names; with no
    /// requester, nobody gets a certificate for this node.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub certificate_requesters: Vec<String>,
    /// Revokes this node's client certificates issued before this time: the
    /// sync server refuses them and the sessions on them end within a
    /// minute. The host asks for a new one (as one of
    /// `certificateRequesters`) and is served again.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub certificates_revoked_before: Option<Time>,
}

/// The CertificateSigningRequest signer of agents' client certificates.
pub const AGENT_SIGNER: &str = "edgefleet.io/agent";

/// An agent's certificate names its node as the subject's common name:
/// this, followed by the EdgeNode's name.
pub const AGENT_COMMON_NAME_PREFIX: &str = "edgefleet:agent:";

/// How an agent proves which node it serves.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize, schemars::JsonSchema)]
pub enum AgentCredentials {
    /// A client certificate of the signer `edgefleet.io/agent`, for this
    /// EdgeNode's name.
    ClientCertificate,
}

/// What the cloud knows about an edge node's agent.
#[derive(Clone, Debug, Default, PartialEq, Serialize, Deserialize, schemars::JsonSchema)]
#[serde(rename_all = "camelCase")]
pub struct EdgeNodeStatus {
    /// Whether the agent's sync stream is open.
    #[serde(default)]
    pub connected: bool,
    /// When the agent was last heard from (coarse).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub last_heartbeat: Option<Time>,
    /// The agent's version.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub agent_version: Option<String>,
    /// Changes each time the agent starts.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub boot_id: Option<String>,
    /// Devices the agent holds.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    #[schemars(schema_with = "schema::count")]
    pub device_count: Option<i64>,
    /// Uplink entries waiting in the agent's outbox.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    #[schemars(schema_with = "schema::count")]
    pub outbox_depth: Option<i64>,
    /// Events the agent dropped at its storage bound.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    #[schemars(schema_with = "schema::count")]
    pub events_dropped: Option<i64>,
    /// Ready.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    #[schemars(schema_with = "schema::conditions")]
    pub conditions: Vec<Condition>,
}

/// Condition types an EdgeNode carries.
pub mod condition {
    /// The agent is connected and heartbeating.
    pub const READY: &str = "Ready";
}
