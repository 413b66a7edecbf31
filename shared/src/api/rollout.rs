//! The FleetRollout resource: a firmware or configuration change rolled out
//! to many Devices in stages — a canary, then waves — within limits on how
//! many devices are down at once, overall and per site, with a health gate
//! the agents evaluate at the edge and a policy for failures and for sites
//! that are offline.
//!
//! This file is the API. What admission can check is checked here (schema
//! and CEL rules on the CRD): shares are a count or a percentage of at most
//! 100 %, versions are semantic versions, a rollout changes something,
//! selectors use known operators. What it cannot (a health expression that
//! does not compile, a failure domain key that no Device or EdgeNode
//! carries) the controller refuses with a condition.

// Each `printcolumn(...)` repeats `type_ = ...`; clippy reads that as a
// duplicated attribute.
#![allow(clippy::duplicated_attributes)]

use std::collections::BTreeMap;

use k8s_openapi::apimachinery::pkg::apis::meta::v1::{Condition, LabelSelector};
use k8s_openapi::apimachinery::pkg::util::intstr::IntOrString;
#[allow(unused_imports)] // used by the KubeSchema derive's generated code
use kube::core::Rule;
use kube::{CustomResource, KubeSchema};
use serde::{Deserialize, Serialize};

use crate::api::device::FirmwareSpec;
use crate::api::schema;
use crate::property::PropertyValue;

/// A CEL rule for a share (`IntOrString`): a count of at least 0, or a
/// percentage from 0 % to 100 %.
macro_rules! share_rule {
    () => {
        "type(self) == int ? self >= 0 : self.matches('^(100|[1-9]?[0-9])%$')"
    };
}

/// The message of [`share_rule`].
const SHARE_MESSAGE: &str = "a count (0 or more) or a percentage from 0% to 100%, like 10%";

/// A firmware or configuration change rolled out to the Devices a selector
/// picks, in stages.
#[derive(CustomResource, KubeSchema, Clone, Debug, PartialEq, Serialize, Deserialize)]
#[kube(
    group = "edgefleet.io",
    version = "v1alpha1",
    kind = "FleetRollout",
    namespaced,
    status = "FleetRolloutStatus",
    shortname = "fro",
    category = "edgefleet",
    doc = "A firmware or configuration change rolled out to many Devices in stages, within limits per site.",
    printcolumn(name = "Phase", type_ = "string", json_path = ".status.phase"),
    printcolumn(
        name = "Wave",
        type_ = "string",
        json_path = ".status.wave",
        description = "The wave in progress"
    ),
    printcolumn(
        name = "Updated",
        type_ = "integer",
        json_path = ".status.counts.succeeded",
        description = "Devices updated and healthy"
    ),
    printcolumn(name = "Total", type_ = "integer", json_path = ".status.counts.total"),
    printcolumn(
        name = "Failed",
        type_ = "integer",
        json_path = ".status.counts.failed"
    ),
    printcolumn(
        name = "Unreachable",
        type_ = "integer",
        json_path = ".status.counts.unreachable"
    ),
    printcolumn(
        name = "Age",
        type_ = "date",
        json_path = ".metadata.creationTimestamp"
    ),
    printcolumn(
        name = "Firmware",
        type_ = "string",
        json_path = ".spec.target.firmware.version",
        priority = 1
    )
)]
#[serde(rename_all = "camelCase")]
pub struct FleetRolloutSpec {
    /// What the selected Devices should end up with.
    pub target: RolloutTarget,
    /// Which Devices of the rollout's namespace take part.
    #[x_kube(validation = Rule::new("!has(self.matchExpressions) || self.matchExpressions.all(e, e.operator in ['In', 'NotIn', 'Exists', 'DoesNotExist'] && ((e.operator in ['In', 'NotIn']) == (has(e.values) && size(e.values) > 0)))").message("operators are In and NotIn (with values), Exists and DoesNotExist (without)"))]
    pub selector: LabelSelector,
    /// Only Devices whose EdgeNode these labels select take part.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    #[x_kube(validation = Rule::new("!has(self.matchExpressions) || self.matchExpressions.all(e, e.operator in ['In', 'NotIn', 'Exists', 'DoesNotExist'] && ((e.operator in ['In', 'NotIn']) == (has(e.values) && size(e.values) > 0)))").message("operators are In and NotIn (with values), Exists and DoesNotExist (without)"))]
    pub node_selector: Option<LabelSelector>,
    /// Whether the Devices are chosen once, when the rollout starts
    /// (`Snapshot`), or a Device selected later joins the last wave
    /// (`Dynamic`).
    #[serde(default)]
    pub membership: Membership,
    /// How fast: the canary, the waves and the limits on devices down.
    #[serde(default)]
    pub strategy: RolloutStrategy,
    /// What a device must show, for how long, after its update before it
    /// counts as updated. Without it, reporting the target counts.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub health: Option<HealthGate>,
    /// When failures stop the rollout, and what then happens.
    #[serde(default)]
    pub failure_policy: FailurePolicy,
    /// What happens to Devices whose node is unreachable.
    #[serde(default)]
    pub offline: OfflinePolicy,
    /// Start no new device updates while true; updates under way finish.
    #[serde(default)]
    pub paused: bool,
    /// Stop the rollout for good and act as `failurePolicy.action` says.
    #[serde(default)]
    pub abort: bool,
}

/// What a rollout changes: firmware, desired properties, or both (the
/// admission policy [`crate::api::policy::rollout_policy`] refuses a target
/// that changes nothing, and checks the properties as a Device's).
#[derive(KubeSchema, Clone, Debug, Default, PartialEq, Serialize, Deserialize)]
#[serde(rename_all = "camelCase")]
pub struct RolloutTarget {
    /// The firmware every selected Device should run.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub firmware: Option<FirmwareSpec>,
    /// Desired property values to set on every selected Device (other
    /// properties are left as they are).
    #[serde(default, skip_serializing_if = "BTreeMap::is_empty")]
    #[schemars(schema_with = "schema::property_map")]
    pub properties: BTreeMap<String, PropertyValue>,
}

/// How a rollout's membership is settled.
#[derive(
    Clone, Copy, Debug, Default, PartialEq, Eq, Serialize, Deserialize, schemars::JsonSchema,
)]
pub enum Membership {
    /// The Devices selected when the rollout starts, and no others.
    #[default]
    Snapshot,
    /// Devices selected later join the last wave.
    Dynamic,
}

/// The stages of a rollout and the limits on devices down at once.
#[derive(KubeSchema, Clone, Debug, PartialEq, Serialize, Deserialize)]
#[serde(rename_all = "camelCase")]
pub struct RolloutStrategy {
    /// Devices updated first, on their own; the waves start once they are
    /// all updated and healthy.
    #[x_kube(validation = Rule::new(share_rule!()).message(SHARE_MESSAGE))]
    #[serde(default = "default_canary")]
    pub canary: IntOrString,
    /// After the canary, the share of the rollout's Devices updated by the
    /// end of each wave, rising; a last wave of 100% is implied. A wave
    /// that comes to no more devices than the one before it (a small
    /// fleet, or shares out of order) adds nothing.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    #[schemars(schema_with = "waves")]
    pub waves: Vec<IntOrString>,
    /// Most Devices of the rollout being updated (updating or baking) at
    /// any moment.
    #[x_kube(validation = Rule::new(share_rule!()).message(SHARE_MESSAGE))]
    #[serde(default = "default_max_unavailable")]
    pub max_unavailable: IntOrString,
    /// Limits per failure domain (a site), if any.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub failure_domain: Option<FailureDomain>,
}

impl Default for RolloutStrategy {
    fn default() -> Self {
        RolloutStrategy {
            canary: default_canary(),
            waves: Vec::new(),
            max_unavailable: default_max_unavailable(),
            failure_domain: None,
        }
    }
}

/// Schema of `waves`: at most 20 shares, each checked on its own (a rule
/// over the whole list costs more than the API server allows).
fn waves(_: &mut schemars::SchemaGenerator) -> schemars::Schema {
    schemars::json_schema!({
        "type": "array",
        "maxItems": 20,
        "items": {
            "x-kubernetes-int-or-string": true,
            "maxLength": 12,
            "x-kubernetes-validations": [{ "rule": share_rule!(), "message": SHARE_MESSAGE }],
        },
    })
}

fn default_canary() -> IntOrString {
    IntOrString::Int(1)
}

fn default_max_unavailable() -> IntOrString {
    IntOrString::String("10%".into())
}

/// A failure domain: Devices grouped by a label (of the Device, or else of
/// its EdgeNode), each group with a canary and a limit of its own.
#[derive(KubeSchema, Clone, Debug, PartialEq, Serialize, Deserialize)]
#[serde(rename_all = "camelCase")]
pub struct FailureDomain {
    /// The label whose value names a Device's domain, like
    /// `edgefleet.io/site`.
    #[schemars(length(min = 1, max = 317))]
    pub topology_key: String,
    /// Most Devices of one domain being updated (updating or baking) at
    /// any moment.
    #[x_kube(validation = Rule::new(share_rule!()).message(SHARE_MESSAGE))]
    pub max_unavailable: IntOrString,
    /// Devices of each domain updated first; the rest of that domain waits
    /// until they are updated and healthy.
    #[x_kube(validation = Rule::new(share_rule!()).message(SHARE_MESSAGE))]
    #[serde(default = "default_canary")]
    pub canary: IntOrString,
}

/// What an updated device must show before it counts as updated, judged
/// by its agent, at the edge.
#[derive(KubeSchema, Clone, Debug, PartialEq, Serialize, Deserialize)]
#[serde(rename_all = "camelCase")]
pub struct HealthGate {
    /// A CEL expression over the device's reported properties
    /// (`reported.<name>`) and `online`, true when it is healthy, like
    /// `online && reported.temperature < 80.0`.
    #[schemars(length(min = 1, max = 1024))]
    pub expression: String,
    /// How long a device must stay healthy after reporting the target.
    #[serde(default = "default_bake_seconds")]
    #[schemars(range(max = 86_400))]
    pub bake_seconds: u32,
    /// How long a device may take from its update to reporting the target
    /// before it counts as timed out.
    #[serde(default = "default_update_timeout_seconds")]
    #[schemars(range(min = 1, max = 604_800))]
    pub timeout_seconds: u32,
}

fn default_bake_seconds() -> u32 {
    300
}

fn default_update_timeout_seconds() -> u32 {
    1800
}

/// When failures stop a rollout, and what then happens.
#[derive(KubeSchema, Clone, Debug, PartialEq, Serialize, Deserialize)]
#[serde(rename_all = "camelCase")]
pub struct FailurePolicy {
    /// Failure thresholds; crossing any one stops the rollout.
    #[serde(default = "default_thresholds")]
    #[schemars(length(max = 16))]
    pub thresholds: Vec<FailureThreshold>,
    /// What stopping does.
    #[serde(default)]
    pub action: FailureAction,
    /// What a rollback rolls back.
    #[serde(default)]
    pub rollback_scope: RollbackScope,
    /// How many more times a device's update is tried after it failed to
    /// install or timed out, before it counts as failed. A device that
    /// installed the update and failed the health gate is not retried.
    /// Each retry takes a place within `maxUnavailable` like a first
    /// attempt.
    #[serde(default, skip_serializing_if = "is_zero")]
    #[schemars(range(max = 10))]
    pub retries: u32,
}

impl Default for FailurePolicy {
    fn default() -> Self {
        FailurePolicy {
            thresholds: default_thresholds(),
            action: FailureAction::default(),
            rollback_scope: RollbackScope::default(),
            retries: 0,
        }
    }
}

fn default_thresholds() -> Vec<FailureThreshold> {
    vec![FailureThreshold {
        scope: ThresholdScope::Wave,
        percent: 20,
        min_sample: 5,
        classes: Vec::new(),
    }]
}

/// Too many failures in one scope.
#[derive(KubeSchema, Clone, Debug, PartialEq, Serialize, Deserialize)]
#[serde(rename_all = "camelCase")]
pub struct FailureThreshold {
    /// Where failures are counted.
    pub scope: ThresholdScope,
    /// Crossed when more than this percentage of the scope's finished
    /// devices failed.
    #[schemars(range(max = 100))]
    pub percent: u8,
    /// Not judged before this many of the scope's devices finished.
    #[serde(default = "default_min_sample")]
    #[schemars(range(min = 1))]
    pub min_sample: u32,
    /// Which failures count; all of them when empty.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub classes: Vec<FailureClass>,
}

fn default_min_sample() -> u32 {
    5
}

/// Where a failure threshold counts.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize, schemars::JsonSchema)]
pub enum ThresholdScope {
    /// Each wave (the canary is a wave).
    Wave,
    /// Each failure domain; judged by the site's agent too, so it holds
    /// while the site is offline.
    Site,
    /// The whole rollout.
    Overall,
}

/// Why a device's update failed.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize, schemars::JsonSchema)]
pub enum FailureClass {
    /// The device could not install the update.
    InstallFailed,
    /// The device reported the target but failed the health gate.
    HealthFailed,
    /// The device did not report the target in time.
    TimedOut,
}

/// What a crossed threshold (or `abort`) does.
#[derive(
    Clone, Copy, Debug, Default, PartialEq, Eq, Serialize, Deserialize, schemars::JsonSchema,
)]
pub enum FailureAction {
    /// Start no new updates until a person resumes (clears `paused`).
    #[default]
    Pause,
    /// Put back the firmware and properties each Device had before.
    Rollback,
}

/// What a rollback puts back.
#[derive(
    Clone, Copy, Debug, Default, PartialEq, Eq, Serialize, Deserialize, schemars::JsonSchema,
)]
pub enum RollbackScope {
    /// The devices that failed.
    #[default]
    Failed,
    /// Every device of the wave in which the threshold was crossed.
    Wave,
    /// Every device the rollout updated.
    All,
}

/// What happens to Devices whose node is unreachable: they are counted as
/// `Unreachable`, never as failed.
#[derive(KubeSchema, Clone, Debug, PartialEq, Serialize, Deserialize)]
#[serde(rename_all = "camelCase")]
pub struct OfflinePolicy {
    /// How long a wave waits for its unreachable Devices; the wave goes
    /// on with the reachable ones meanwhile.
    #[serde(default = "default_wait_up_to_seconds")]
    #[schemars(range(max = 2_592_000))]
    pub wait_up_to_seconds: u32,
    /// What happens to a Device still unreachable after that.
    #[serde(default)]
    pub then: OfflineAction,
}

impl Default for OfflinePolicy {
    fn default() -> Self {
        OfflinePolicy {
            wait_up_to_seconds: default_wait_up_to_seconds(),
            then: OfflineAction::default(),
        }
    }
}

fn default_wait_up_to_seconds() -> u32 {
    3600
}

/// What happens to a Device still unreachable when the wait is over.
#[derive(
    Clone, Copy, Debug, Default, PartialEq, Eq, Serialize, Deserialize, schemars::JsonSchema,
)]
pub enum OfflineAction {
    /// It is updated when its node comes back, after the last wave.
    #[default]
    Defer,
    /// It is left out (`Skipped`).
    Skip,
}

/// Where a rollout stands. Per-device state lives in each Device's status,
/// never here: an object with thousands of devices in it would outgrow
/// what etcd stores.
#[derive(Clone, Debug, Default, PartialEq, Serialize, Deserialize, schemars::JsonSchema)]
#[serde(rename_all = "camelCase")]
pub struct FleetRolloutStatus {
    /// The `metadata.generation` the controller acted on.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub observed_generation: Option<i64>,
    /// A one-word summary.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub phase: Option<RolloutPhase>,
    /// The stage in progress: `canary`, `wave 1/3`, `wave 2/3`, ….
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub wave: Option<String>,
    /// When the rollout started (left `Pending`). With `Snapshot`
    /// membership, the Devices created by then are its members.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub started_at: Option<k8s_openapi::apimachinery::pkg::apis::meta::v1::Time>,
    /// Devices by state, over the whole rollout.
    #[serde(default)]
    pub counts: StateCounts,
    /// Devices by state in each stage, the canary first.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    #[schemars(length(max = 21))]
    pub waves: Vec<StateCounts>,
    /// Devices by state in each failure domain, at most
    /// [`MAX_LISTED_SITES`] of them (those with failures and unreachable
    /// devices first).
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    #[schemars(length(max = 100))]
    pub sites: Vec<SiteCounts>,
    /// Failure domains not listed in `sites`.
    #[serde(default, skip_serializing_if = "is_zero")]
    pub sites_not_listed: u32,
    /// Progressing, Paused, Degraded, Complete, RolledBack.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    #[schemars(schema_with = "schema::conditions")]
    pub conditions: Vec<Condition>,
}

fn is_zero(n: &u32) -> bool {
    *n == 0
}

/// The most failure domains a rollout's status lists.
pub const MAX_LISTED_SITES: usize = 100;

/// Where a rollout stands, in one word.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize, schemars::JsonSchema)]
pub enum RolloutPhase {
    /// Accepted; no device updated yet.
    Pending,
    /// Updating devices.
    Progressing,
    /// Paused by a person or by a crossed threshold.
    Paused,
    /// Putting back what it changed.
    RollingBack,
    /// Every device updated, skipped or deferred past the last wave.
    Complete,
    /// Rolled back.
    RolledBack,
    /// The spec cannot be carried out (see the conditions).
    Invalid,
}

/// How many devices are in each state.
#[derive(Clone, Debug, Default, PartialEq, Eq, Serialize, Deserialize, schemars::JsonSchema)]
#[serde(rename_all = "camelCase")]
pub struct StateCounts {
    /// All of them.
    #[serde(default)]
    pub total: u32,
    /// Not started.
    #[serde(default)]
    pub pending: u32,
    /// Sent the update; not reporting the target yet.
    #[serde(default)]
    pub updating: u32,
    /// Reporting the target; in the bake time.
    #[serde(default)]
    pub baking: u32,
    /// Updated and healthy.
    #[serde(default)]
    pub succeeded: u32,
    /// Failed (install, health or time-out).
    #[serde(default)]
    pub failed: u32,
    /// Put back to what they had before.
    #[serde(default)]
    pub rolled_back: u32,
    /// Their node is unreachable.
    #[serde(default)]
    pub unreachable: u32,
    /// Left out after the offline wait.
    #[serde(default)]
    pub skipped: u32,
}

/// One failure domain's devices by state.
#[derive(Clone, Debug, Default, PartialEq, Eq, Serialize, Deserialize, schemars::JsonSchema)]
#[serde(rename_all = "camelCase")]
pub struct SiteCounts {
    /// The domain: the topology label's value.
    pub name: String,
    /// Its devices by state.
    pub counts: StateCounts,
}
