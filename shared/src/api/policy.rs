//! The admission policies that complete the Device, FleetRollout and
//! EdgeRule schemas.
//!
//! Some rules cannot live in a CRD schema: a property value may be any of four
//! scalar types, which a structural schema cannot say and CRD validation rules
//! cannot type-check (nor even see: a rule cannot name such a map). A
//! ValidatingAdmissionPolicy evaluates CEL on the object as it is, so it
//! checks those rules and names the offending property.

use k8s_openapi::api::admissionregistration::v1::{
    ValidatingAdmissionPolicy, ValidatingAdmissionPolicyBinding,
};
use serde_json::json;

use crate::api::schema::PROPERTY_NAME;
use crate::codec::MAX_PROPERTY_NAME;

/// Name of the Device policy and of its binding.
pub const DEVICE_POLICY: &str = "devices.edgefleet.io";

/// Name of the FleetRollout policy and of its binding.
pub const ROLLOUT_POLICY: &str = "fleetrollouts.edgefleet.io";

/// Name of the EdgeRule policy and of its binding.
pub const RULE_POLICY: &str = "edgerules.edgefleet.io";

/// Every admission policy Edgefleet installs, each with its binding.
pub fn policies() -> Vec<(ValidatingAdmissionPolicy, ValidatingAdmissionPolicyBinding)> {
    [device_policy(), rollout_policy(), rule_policy()]
        .into_iter()
        .map(|policy| {
            let name = policy.metadata.name.clone().expect("policies are named");
            (policy, binding(&name))
        })
        .collect()
}

/// The policy that checks a Device's desired property names and values.
pub fn device_policy() -> ValidatingAdmissionPolicy {
    property_policy(
        DEVICE_POLICY,
        "devices",
        "spec.desired",
        "has(object.spec.desired) ? object.spec.desired : {}",
        Vec::new(),
    )
}

/// The policy that checks a FleetRollout's target: its property names and
/// values (as a Device's), and that it changes something.
pub fn rollout_policy() -> ValidatingAdmissionPolicy {
    property_policy(
        ROLLOUT_POLICY,
        "fleetrollouts",
        "spec.target.properties",
        "has(object.spec.target.properties) ? object.spec.target.properties : {}",
        vec![json!({
            "expression": "has(object.spec.target.firmware) || size(variables.props) > 0",
            "reason": "Invalid",
            "message": "spec.target: a rollout changes the firmware, some properties, or both",
        })],
    )
}

/// The policy that checks an EdgeRule's `then`: the properties it sets
/// (as a Device's), that it does something, and that a target comes with
/// properties to set.
pub fn rule_policy() -> ValidatingAdmissionPolicy {
    property_policy(
        RULE_POLICY,
        "edgerules",
        "spec.then.set",
        "has(object.spec.then.set) ? object.spec.then.set : {}",
        vec![
            json!({
                "expression": "has(object.spec.then.event) || size(variables.props) > 0",
                "reason": "Invalid",
                "message": "spec.then: then must set a property or raise an event",
            }),
            json!({
                "expression": "!has(object.spec.then.target) || size(variables.props) > 0",
                "reason": "Invalid",
                "message": "spec.then.target names the devices whose properties are set; it needs spec.then.set",
            }),
        ],
    )
}

/// A policy on `resource` that checks the property map at `field` (read by
/// the CEL expression `props`) the way the Device schema cannot: names
/// that are property names, values that are scalars. `more` are further
/// validations.
fn property_policy(
    name: &str,
    resource: &str,
    field: &str,
    props: &str,
    more: Vec<serde_json::Value>,
) -> ValidatingAdmissionPolicy {
    let bad_name = format!("!k.matches('{PROPERTY_NAME}') || size(k) > {MAX_PROPERTY_NAME}");
    let mut validations = vec![
        json!({
            "expression": "size(variables.badNames) == 0",
            "reason": "Invalid",
            "message": format!("{field}: property names start with a letter, contain only letters, digits and '_', and are at most {MAX_PROPERTY_NAME} characters"),
            "messageExpression": format!("'{field}: property names start with a letter, contain only letters, digits and _, and are at most {MAX_PROPERTY_NAME} characters; refused: ' + variables.badNames.join(', ')"),
        }),
        json!({
            "expression": "size(variables.badValues) == 0",
            "reason": "Invalid",
            "message": format!("{field}: property values must be a bool, an integer, a float or a string (not a list, an object or null)"),
            "messageExpression": format!("'{field}.' + variables.badValues[0] + ': property values must be a bool, an integer, a float or a string (not a list, an object or null)'"),
        }),
    ];
    validations.extend(more);
    serde_json::from_value(json!({
        "apiVersion": "admissionregistration.k8s.io/v1",
        "kind": "ValidatingAdmissionPolicy",
        "metadata": { "name": name },
        "spec": {
            "failurePolicy": "Fail",
            "matchConstraints": {
                "resourceRules": [{
                    "apiGroups": ["edgefleet.io"],
                    "apiVersions": ["v1alpha1"],
                    "operations": ["CREATE", "UPDATE"],
                    "resources": [resource],
                }],
            },
            "variables": [
                { "name": "props", "expression": props },
                {
                    "name": "badNames",
                    "expression": format!("variables.props.filter(k, {bad_name})"),
                },
                {
                    "name": "badValues",
                    "expression": "variables.props.filter(k, !(type(variables.props[k]) == bool || type(variables.props[k]) == int || type(variables.props[k]) == double || type(variables.props[k]) == string))",
                },
            ],
            "validations": validations,
        },
    }))
    .expect("the policy matches the admissionregistration/v1 types")
}

/// Binds the policy `name` to every namespace, refusing what it denies.
fn binding(name: &str) -> ValidatingAdmissionPolicyBinding {
    serde_json::from_value(json!({
        "apiVersion": "admissionregistration.k8s.io/v1",
        "kind": "ValidatingAdmissionPolicyBinding",
        "metadata": { "name": name },
        "spec": {
            "policyName": name,
            "validationActions": ["Deny"],
        },
    }))
    .expect("the policy binding matches the admissionregistration/v1 types")
}
