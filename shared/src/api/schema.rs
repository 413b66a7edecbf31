//! Schema pieces shared by the custom resources: what the derive macros
//! cannot say on their own.

use schemars::{Schema, SchemaGenerator, json_schema};

/// Pattern of a DNS-1123 subdomain: what Kubernetes allows as a node name.
pub const DNS_SUBDOMAIN: &str =
    r"^[a-z0-9]([-a-z0-9]*[a-z0-9])?(\.[a-z0-9]([-a-z0-9]*[a-z0-9])?)*$";

/// Pattern of a DNS-1123 label: lowercase letters, digits and dashes.
pub const DNS_LABEL: &str = r"^[a-z0-9]([-a-z0-9]*[a-z0-9])?$";

/// Pattern of a property name: a letter, then letters, digits or `_`.
pub const PROPERTY_NAME: &str = r"^[A-Za-z][A-Za-z0-9_]*$";

/// The most properties a Device may declare (desired or reported).
pub const MAX_PROPERTIES: i64 = crate::codec::MAX_PROPERTIES as i64;

/// Schema of a property map (`spec.desired`, `status.reported`).
///
/// A structural schema cannot give a value four possible types (no `type`
/// inside `anyOf`), and CEL rules cannot be attached to a map whose values are
/// untyped. So the values keep unknown fields here, and the admission policy
/// in [`crate::api::policy`] refuses names and values that are not allowed,
/// naming the offending property.
pub fn property_map(_: &mut SchemaGenerator) -> Schema {
    json_schema!({
        "type": "object",
        "maxProperties": MAX_PROPERTIES,
        "additionalProperties": {
            "x-kubernetes-preserve-unknown-fields": true
        }
    })
}

/// Schema of one property value (see [`property_map`]).
pub fn property_value(_: &mut SchemaGenerator) -> Schema {
    json_schema!({ "x-kubernetes-preserve-unknown-fields": true })
}

/// Schema of a `conditions` list: merged by `type` under server-side apply,
/// so the cloud and the agent's reporter can each own their own conditions.
pub fn conditions(generator: &mut SchemaGenerator) -> Schema {
    let mut schema =
        generator.subschema_for::<Vec<k8s_openapi::apimachinery::pkg::apis::meta::v1::Condition>>();
    schema.insert("x-kubernetes-list-type".into(), "map".into());
    schema.insert(
        "x-kubernetes-list-map-keys".into(),
        serde_json::json!(["type"]),
    );
    schema
}

/// Schema of a count: a non-negative integer.
pub fn count(_: &mut SchemaGenerator) -> Schema {
    json_schema!({ "type": "integer", "format": "int64", "minimum": 0 })
}
