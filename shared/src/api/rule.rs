//! The EdgeRule resource: a decision made at the edge. A rule watches the
//! Devices a selector picks; when its CEL condition over what a device
//! reports has held for a while, the device's agent sets desired
//! properties — on that device or on devices of the same node — and/or
//! raises an event, without a round trip to the cloud, also while the
//! cloud is unreachable.
//!
//! This file is the API. What admission can check is checked here (schema
//! and CEL rules on the CRD) and by the admission policy
//! [`crate::api::policy::rule_policy`]: a rule does something, the
//! properties it sets are valid, its numbers are in range, its selectors
//! use known operators, an event's reason is CamelCase. What it cannot (a condition that does not compile, or that
//! uses a name a rule cannot see) the controller refuses with the
//! `Accepted` condition and the compiler's message.

// Each `printcolumn(...)` repeats `type_ = ...`; clippy reads that as a
// duplicated attribute.
#![allow(clippy::duplicated_attributes)]

use std::collections::BTreeMap;

use k8s_openapi::apimachinery::pkg::apis::meta::v1::{Condition, LabelSelector, Time};
#[allow(unused_imports)] // used by the KubeSchema derive's generated code
use kube::core::Rule;
use kube::{CustomResource, KubeSchema};
use serde::{Deserialize, Serialize};

use crate::api::schema;
use crate::property::PropertyValue;

/// A decision made by the agents at the edge: when a condition over what a
/// device reports holds, set desired properties and/or raise an event.
#[derive(CustomResource, KubeSchema, Clone, Debug, PartialEq, Serialize, Deserialize)]
#[kube(
    group = "edgefleet.io",
    version = "v1alpha1",
    kind = "EdgeRule",
    namespaced,
    status = "EdgeRuleStatus",
    shortname = "erule",
    category = "edgefleet",
    doc = "A decision the agents make at the edge, online or offline: when a condition over a device's reports holds, set desired properties or raise an event.",
    printcolumn(
        name = "Accepted",
        type_ = "string",
        json_path = ".status.conditions[?(@.type==\"Accepted\")].status"
    ),
    printcolumn(name = "Priority", type_ = "integer", json_path = ".spec.priority"),
    printcolumn(
        name = "Devices",
        type_ = "integer",
        json_path = ".status.devices",
        description = "Devices the rule watches"
    ),
    printcolumn(
        name = "Age",
        type_ = "date",
        json_path = ".metadata.creationTimestamp"
    ),
    printcolumn(
        name = "When",
        type_ = "string",
        json_path = ".spec.when",
        priority = 1
    )
)]
#[serde(rename_all = "camelCase")]
pub struct EdgeRuleSpec {
    /// Which Devices of the rule's namespace it watches.
    #[x_kube(validation = Rule::new("!has(self.matchExpressions) || self.matchExpressions.all(e, e.operator in ['In', 'NotIn', 'Exists', 'DoesNotExist'] && ((e.operator in ['In', 'NotIn']) == (has(e.values) && size(e.values) > 0)))").message("operators are In and NotIn (with values), Exists and DoesNotExist (without)"))]
    pub selector: LabelSelector,
    /// Only Devices whose EdgeNode these labels select.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    #[x_kube(validation = Rule::new("!has(self.matchExpressions) || self.matchExpressions.all(e, e.operator in ['In', 'NotIn', 'Exists', 'DoesNotExist'] && ((e.operator in ['In', 'NotIn']) == (has(e.values) && size(e.values) > 0)))").message("operators are In and NotIn (with values), Exists and DoesNotExist (without)"))]
    pub node_selector: Option<LabelSelector>,
    /// A CEL expression over one watched device, true when the rule should
    /// act: `reported.<name>` (its latest reported properties), `online`,
    /// `firmware` (the version it runs, `""` if unknown) and
    /// `labels.<name>` (its Device's labels). For example
    /// `reported.temperature > 80.0`.
    #[schemars(length(min = 1, max = 4096))]
    pub when: String,
    /// How long `when` must hold without a break before the rule acts.
    #[serde(default)]
    #[schemars(range(max = 86400))]
    pub for_seconds: u32,
    /// After acting for a device, the rule does not act for it again for
    /// this long.
    #[serde(default)]
    #[schemars(range(max = 86400))]
    pub cooldown_seconds: u32,
    /// What the rule does.
    pub then: RuleAction,
    /// Whether the properties set go back to the Device's spec when `when`
    /// no longer holds (otherwise they stay until the spec changes).
    #[serde(default = "default_restore")]
    pub restore: bool,
    /// Of two rules setting the same property of the same device, the one
    /// with the higher priority wins; on a tie, the one whose name sorts
    /// first.
    #[serde(default)]
    #[schemars(range(min = -1000, max = 1000))]
    pub priority: i32,
    /// The most times the rule may act per minute at one node; more are
    /// refused and counted.
    #[serde(default = "default_max_per_minute")]
    #[schemars(range(min = 1, max = 6000))]
    pub max_actions_per_minute: u32,
}

fn default_restore() -> bool {
    true
}

fn default_max_per_minute() -> u32 {
    60
}

/// What a rule does when it acts.
#[derive(KubeSchema, Clone, Debug, Default, PartialEq, Serialize, Deserialize)]
#[serde(rename_all = "camelCase")]
pub struct RuleAction {
    /// Desired property values to set, over the Device's spec.
    #[serde(default, skip_serializing_if = "BTreeMap::is_empty")]
    #[schemars(schema_with = "schema::property_map")]
    pub set: BTreeMap<String, PropertyValue>,
    /// Set them on the Devices of the watched device's node that these
    /// labels select, instead of on the watched device itself.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub target: Option<LabelSelector>,
    /// An event to raise on the watched device.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub event: Option<RuleEvent>,
}

/// An event a rule raises: a Kubernetes Event on the watched Device.
#[derive(KubeSchema, Clone, Debug, PartialEq, Serialize, Deserialize)]
#[serde(rename_all = "camelCase")]
pub struct RuleEvent {
    /// A reason in CamelCase, like `Overheat`.
    #[schemars(length(min = 1, max = 64), regex(pattern = r"^[A-Z][A-Za-z0-9]*$"))]
    pub reason: String,
    /// For people.
    #[serde(default)]
    #[schemars(length(max = 512))]
    pub message: String,
    /// A Warning event rather than a Normal one.
    #[serde(default)]
    pub warning: bool,
}

/// Where a rule stands.
#[derive(Clone, Debug, Default, PartialEq, Serialize, Deserialize, schemars::JsonSchema)]
#[serde(rename_all = "camelCase")]
pub struct EdgeRuleStatus {
    /// The `metadata.generation` the controller judged.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub observed_generation: Option<i64>,
    /// Devices the rule watches.
    #[serde(default)]
    pub devices: u32,
    /// When the rule last acted, at any node, as far as the cloud heard.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub last_acted_at: Option<Time>,
    /// Accepted (False: the reason it is refused).
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    #[schemars(schema_with = "schema::conditions")]
    pub conditions: Vec<Condition>,
}
