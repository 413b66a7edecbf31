//! The admission policy that completes the Device schema.
//!
//! Some rules cannot live in a CRD schema: a property value may be any of four
//! scalar types, which a structural schema cannot say and CRD validation rules
//! cannot type-check. A ValidatingAdmissionPolicy evaluates CEL on the object
//! as it is, so it checks those rules and names the offending property.

use k8s_openapi::api::admissionregistration::v1::{
    ValidatingAdmissionPolicy, ValidatingAdmissionPolicyBinding,
};
use serde_json::json;

use crate::api::schema::PROPERTY_NAME;
use crate::codec::MAX_PROPERTY_NAME;

/// Name of the policy and of its binding.
pub const DEVICE_POLICY: &str = "devices.edgefleet.io";

/// The policy that checks a Device's desired property names and values.
pub fn device_policy() -> ValidatingAdmissionPolicy {
    let bad_name = format!("!k.matches('{PROPERTY_NAME}') || size(k) > {MAX_PROPERTY_NAME}");
    serde_json::from_value(json!({
        "apiVersion": "admissionregistration.k8s.io/v1",
        "kind": "ValidatingAdmissionPolicy",
        "metadata": { "name": DEVICE_POLICY },
        "spec": {
            "failurePolicy": "Fail",
            "matchConstraints": {
                "resourceRules": [{
                    "apiGroups": ["edgefleet.io"],
                    "apiVersions": ["v1alpha1"],
                    "operations": ["CREATE", "UPDATE"],
                    "resources": ["devices"],
                }],
            },
            "variables": [
                {
                    "name": "props",
                    "expression": "has(object.spec.desired) ? object.spec.desired : {}",
                },
                {
                    "name": "badNames",
                    "expression": format!("variables.props.filter(k, {bad_name})"),
                },
                {
                    "name": "badValues",
                    "expression": "variables.props.filter(k, !(type(variables.props[k]) == bool || type(variables.props[k]) == int || type(variables.props[k]) == double || type(variables.props[k]) == string))",
                },
            ],
            "validations": [
                {
                    "expression": "size(variables.badNames) == 0",
                    "reason": "Invalid",
                    "message": format!("spec.desired: property names start with a letter, contain only letters, digits and '_', and are at most {MAX_PROPERTY_NAME} characters"),
                    "messageExpression": format!("'spec.desired: property names start with a letter, contain only letters, digits and _, and are at most {MAX_PROPERTY_NAME} characters; refused: ' + variables.badNames.join(', ')"),
                },
                {
                    "expression": "size(variables.badValues) == 0",
                    "reason": "Invalid",
                    "message": "spec.desired: property values must be a bool, an integer, a float or a string (not a list, an object or null)",
                    "messageExpression": "'spec.desired.' + variables.badValues[0] + ': property values must be a bool, an integer, a float or a string (not a list, an object or null)'",
                },
            ],
        },
    }))
    .expect("the device policy matches the admissionregistration/v1 types")
}

/// Binds [`device_policy`] to every namespace, refusing what it denies.
pub fn device_policy_binding() -> ValidatingAdmissionPolicyBinding {
    serde_json::from_value(json!({
        "apiVersion": "admissionregistration.k8s.io/v1",
        "kind": "ValidatingAdmissionPolicyBinding",
        "metadata": { "name": DEVICE_POLICY },
        "spec": {
            "policyName": DEVICE_POLICY,
            "validationActions": ["Deny"],
        },
    }))
    .expect("the device policy binding matches the admissionregistration/v1 types")
}
