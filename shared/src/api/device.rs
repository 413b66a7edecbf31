//! The Device resource: one device hanging off one edge node.

// Each `printcolumn(...)` repeats `type_ = ...`; clippy reads that as a
// duplicated attribute.
#![allow(clippy::duplicated_attributes)]

use std::collections::BTreeMap;

use k8s_openapi::apimachinery::pkg::apis::meta::v1::{Condition, Time};
#[allow(unused_imports)] // used by the KubeSchema derive's generated code
use kube::core::Rule;
use kube::{CustomResource, KubeSchema};
use serde::{Deserialize, Serialize};

use crate::api::schema;
use crate::property::PropertyValue;

/// What a device should be: the node it hangs off, how it talks, the property
/// values and firmware it should have. Owned by the cloud (people, rollouts).
#[derive(CustomResource, KubeSchema, Clone, Debug, PartialEq, Serialize, Deserialize)]
#[kube(
    group = "edgefleet.io",
    version = "v1alpha1",
    kind = "Device",
    namespaced,
    status = "DeviceStatus",
    shortname = "dev",
    category = "edgefleet",
    doc = "A device at the edge: desired state goes down to it, its reported state comes back.",
    printcolumn(
        name = "Node",
        type_ = "string",
        json_path = ".spec.node",
        description = "Edge node the device hangs off"
    ),
    printcolumn(name = "Model", type_ = "string", json_path = ".spec.model"),
    printcolumn(
        name = "Firmware",
        type_ = "string",
        json_path = ".status.firmwareVersion",
        description = "Firmware the device reports running"
    ),
    printcolumn(name = "Phase", type_ = "string", json_path = ".status.phase"),
    printcolumn(
        name = "Age",
        type_ = "date",
        json_path = ".metadata.creationTimestamp"
    ),
    printcolumn(
        name = "Transport",
        type_ = "string",
        json_path = ".spec.transport",
        priority = 1
    ),
    printcolumn(
        name = "Applied",
        type_ = "integer",
        json_path = ".status.appliedGeneration",
        priority = 1,
        description = "Generation the device applied"
    ),
    printcolumn(
        name = "Rollout",
        type_ = "string",
        json_path = ".status.rollout.name",
        priority = 1,
        description = "The FleetRollout that changed the device last"
    ),
    printcolumn(
        name = "Rollout-State",
        type_ = "string",
        json_path = ".status.rollout.state",
        priority = 1,
        description = "The device's state in that rollout"
    ),
    printcolumn(
        name = "Attempt",
        type_ = "integer",
        json_path = ".status.rollout.attempt",
        priority = 1,
        description = "Which attempt at that rollout's update"
    ),
    printcolumn(
        name = "Failure",
        type_ = "string",
        json_path = ".status.rollout.failure",
        priority = 1,
        description = "Why the last attempt failed"
    ),
    selectable = ".spec.node"
)]
#[serde(rename_all = "camelCase")]
pub struct DeviceSpec {
    /// The Kubernetes node name of the edge node whose agent serves this device.
    #[schemars(length(min = 1, max = 253), regex(pattern = schema::DNS_SUBDOMAIN))]
    pub node: String,
    /// The device model (for example `thermostat`); decides which properties
    /// the device understands.
    #[schemars(length(min = 1, max = 63), regex(pattern = schema::DNS_LABEL))]
    pub model: String,
    /// How the device talks to its agent.
    pub transport: Transport,
    /// Desired property values, by property name.
    #[serde(default, skip_serializing_if = "BTreeMap::is_empty")]
    #[schemars(schema_with = "schema::property_map")]
    pub desired: BTreeMap<String, PropertyValue>,
    /// The firmware the device should run.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub firmware: Option<FirmwareSpec>,
    /// A counter: raising it gives the spec a new generation though nothing
    /// else changed, so the device is sent its desired state again and
    /// tries it anew. A FleetRollout raises it to retry a failed install.
    #[serde(default, skip_serializing_if = "is_zero")]
    pub retry: u32,
}

fn is_zero(n: &u32) -> bool {
    *n == 0
}

/// The protocol a device speaks to its agent.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, Serialize, Deserialize, schemars::JsonSchema)]
#[serde(rename_all = "lowercase")]
pub enum Transport {
    /// Reports over CoAP (UDP); desired state over MQTT.
    Coap,
    /// Reports and desired state over MQTT.
    Mqtt,
}

/// Which firmware a device should run.
#[derive(KubeSchema, Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[x_kube(validation = Rule::new("!has(self.url) || has(self.sha256)").message("a firmware url needs a sha256, so the device can verify the image it downloads"))]
#[serde(rename_all = "camelCase")]
pub struct FirmwareSpec {
    /// Semantic version of the image, like `1.4.2`.
    #[schemars(length(max = 128))]
    #[x_kube(validation = Rule::new(concat!("self.matches('", crate::semver_pattern!(), "')")).message("firmware version must be a semantic version like 1.4.2 (MAJOR.MINOR.PATCH, no leading 'v')"))]
    pub version: String,
    /// Where the device downloads the image (http or https).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    #[schemars(length(max = 2048))]
    #[x_kube(validation = Rule::new("isURL(self) && url(self).getScheme() in ['http', 'https']").message("url must be an absolute http or https URL"))]
    pub url: Option<String>,
    /// SHA-256 of the image as 64 lowercase hex digits.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    #[schemars(regex(pattern = r"^[0-9a-f]{64}$"))]
    pub sha256: Option<String>,
}

/// What the edge says about a device. Written by the cloud controller from
/// what the agent delivers and the device reports.
#[derive(Clone, Debug, Default, PartialEq, Serialize, Deserialize, schemars::JsonSchema)]
#[serde(rename_all = "camelCase")]
pub struct DeviceStatus {
    /// The `metadata.generation` the controller has accepted.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub observed_generation: Option<i64>,
    /// The generation the agent has stored durably.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub delivered_generation: Option<i64>,
    /// The generation the device says it applied.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub applied_generation: Option<i64>,
    /// The latest property values the device reported.
    #[serde(default, skip_serializing_if = "BTreeMap::is_empty")]
    #[schemars(schema_with = "schema::property_map")]
    pub reported: BTreeMap<String, PropertyValue>,
    /// The firmware the device reports running.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub firmware_version: Option<String>,
    /// When the device was last heard from (coarse: not every report moves it).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub last_seen: Option<Time>,
    /// Delivered, Applied, Online, UpdateFailed.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    #[schemars(schema_with = "schema::conditions")]
    pub conditions: Vec<Condition>,
    /// A one-word summary for people.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub phase: Option<DevicePhase>,
    /// Where the report in `reported` came from: the agent's store and the
    /// report's uplink sequence number there. A report from the same store
    /// with a sequence number not above it is stale and never overwrites
    /// `reported` (a resend after a crash, a delayed copy).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub last_report: Option<ReportOrigin>,
    /// Where the device stands in the FleetRollout that selects it (the
    /// rollout's own status only counts devices).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub rollout: Option<DeviceRolloutStatus>,
    /// What EdgeRules acting at the edge set on top of the spec, as the
    /// agent last said: per property, the rule in force and any it
    /// outranked. Gone when the rules let go.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub overrides: Vec<DeviceOverride>,
}

/// A property an EdgeRule set on a device at the edge.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize, schemars::JsonSchema)]
#[serde(rename_all = "camelCase")]
pub struct DeviceOverride {
    /// The property.
    pub property: String,
    /// The EdgeRule (same namespace).
    pub rule: String,
    /// The value it set.
    #[schemars(schema_with = "schema::property_value")]
    pub value: PropertyValue,
    /// Since when.
    pub since: Time,
    /// Whether this is the value the device is told (false: a rule of
    /// higher priority, or of the same priority and a name sorting first,
    /// set the property too).
    pub in_force: bool,
}

/// A device's part in a FleetRollout.
#[derive(Clone, Debug, Default, PartialEq, Eq, Serialize, Deserialize, schemars::JsonSchema)]
#[serde(rename_all = "camelCase")]
pub struct DeviceRolloutStatus {
    /// The FleetRollout.
    pub name: String,
    /// Its `metadata.generation` the state was judged under.
    pub revision: i64,
    /// Pending, Updating, Baking, Succeeded, Failed, RolledBack,
    /// Unreachable or Skipped.
    pub state: String,
    /// Which attempt at the update this is (1 for the first; a failed
    /// install or a time-out is tried again as the rollout's
    /// `failurePolicy.retries` allows).
    #[serde(default, skip_serializing_if = "is_zero")]
    pub attempt: u32,
    /// Why its last attempt failed, if one did: InstallFailed, HealthFailed
    /// or TimedOut (with a later attempt under way or succeeded, why the
    /// one before it failed).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub failure: Option<String>,
}

/// Which report a status shows: sequence numbers count within one agent
/// store, and a rebuilt store has a new id.
#[derive(Clone, Debug, Default, PartialEq, Eq, Serialize, Deserialize, schemars::JsonSchema)]
pub struct ReportOrigin {
    /// The agent store's id.
    pub store: String,
    /// The report's uplink sequence number in that store.
    pub seq: u64,
}

impl ReportOrigin {
    /// Whether a report from `self` is older than (or the same as) what a
    /// status showing `shown` already has.
    pub fn is_stale_against(&self, shown: Option<&ReportOrigin>) -> bool {
        shown.is_some_and(|s| s.store == self.store && s.seq >= self.seq)
    }
}

/// Where a device stands, in one word.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, Serialize, Deserialize, schemars::JsonSchema)]
pub enum DevicePhase {
    /// Accepted; not yet stored by the agent.
    Pending,
    /// The agent holds the current generation; the device has not applied it yet.
    Delivered,
    /// The device applied the current generation.
    Applied,
    /// The device failed to apply an update.
    Failed,
    /// The device's edge node is not connected.
    Unreachable,
}

/// Condition types a Device carries.
pub mod condition {
    /// The agent holds the Device's current generation.
    pub const DELIVERED: &str = "Delivered";
    /// The device applied the Device's current generation.
    pub const APPLIED: &str = "Applied";
    /// The device is heard from.
    pub const ONLINE: &str = "Online";
    /// The last update failed on the device.
    pub const UPDATE_FAILED: &str = "UpdateFailed";
    /// The agent's health check of a rollout's generation: True once the
    /// device stayed healthy for the bake time, False when it was not,
    /// Unknown while baking or inconclusive.
    pub const HEALTHY: &str = "Healthy";
    /// `Healthy` reasons.
    pub const HEALTH_CHECK_PASSED: &str = "HealthCheckPassed";
    /// The expression said false.
    pub const HEALTH_CHECK_FAILED: &str = "HealthCheckFailed";
    /// The expression could not be judged.
    pub const HEALTH_CHECK_INCONCLUSIVE: &str = "HealthCheckInconclusive";
    /// Healthy so far, within the bake time.
    pub const BAKING: &str = "Baking";
    /// The device's agent put back what a rollout's generation replaced, on
    /// its own, while the cloud was unreachable (its `observedGeneration`
    /// is the generation rolled back).
    pub const ROLLED_BACK: &str = "RolledBack";
    /// `RolledBack` reason: the site crossed the rollout's failure
    /// threshold while offline.
    pub const SITE_THRESHOLD_CROSSED: &str = "SiteThresholdCrossed";
    /// Reason of `Applied` (False) while the device's agent holds its
    /// generation back: its site is at a rollout's limit, or the site's
    /// canary has not succeeded yet.
    pub const HELD_AT_SITE: &str = "HeldAtSite";
}
