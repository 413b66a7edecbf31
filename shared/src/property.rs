//! Property values: the scalar a device property may hold.

use std::fmt;

use serde::{Deserialize, Serialize};

/// The value of one device property (desired or reported).
///
/// Four scalar types and nothing else: nested structures belong in their own
/// properties, which keeps the CBOR on the device side small and lets a rule
/// compare any two values without a schema.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
#[serde(untagged)]
pub enum PropertyValue {
    /// `true` or `false`.
    Bool(bool),
    /// A signed 64-bit integer.
    Int(i64),
    /// A 64-bit float.
    Float(f64),
    /// A UTF-8 string.
    String(String),
}

impl PropertyValue {
    /// The name of this value's type, as error messages show it.
    pub fn type_name(&self) -> &'static str {
        match self {
            PropertyValue::Bool(_) => "bool",
            PropertyValue::Int(_) => "integer",
            PropertyValue::Float(_) => "float",
            PropertyValue::String(_) => "string",
        }
    }

    /// The value as a float, for numeric comparisons across integer and float.
    pub fn as_f64(&self) -> Option<f64> {
        match self {
            PropertyValue::Int(i) => Some(*i as f64),
            PropertyValue::Float(f) => Some(*f),
            _ => None,
        }
    }
}

impl fmt::Display for PropertyValue {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            PropertyValue::Bool(b) => write!(f, "{b}"),
            PropertyValue::Int(i) => write!(f, "{i}"),
            PropertyValue::Float(x) => write!(f, "{x}"),
            PropertyValue::String(s) => write!(f, "{s:?}"),
        }
    }
}

impl From<bool> for PropertyValue {
    fn from(v: bool) -> Self {
        PropertyValue::Bool(v)
    }
}

impl From<i64> for PropertyValue {
    fn from(v: i64) -> Self {
        PropertyValue::Int(v)
    }
}

impl From<f64> for PropertyValue {
    fn from(v: f64) -> Self {
        PropertyValue::Float(v)
    }
}

impl From<&str> for PropertyValue {
    fn from(v: &str) -> Self {
        PropertyValue::String(v.to_owned())
    }
}

impl From<String> for PropertyValue {
    fn from(v: String) -> Self {
        PropertyValue::String(v)
    }
}

/// A property's value in the schema of a custom resource.
///
/// Structural schemas cannot say "one of four scalar types" (a `type` inside
/// `anyOf` is forbidden), so the node keeps unknown fields and the enclosing map
/// carries a CEL rule that refuses anything that is not a scalar; see
/// [`crate::api::schema`].
impl schemars::JsonSchema for PropertyValue {
    fn schema_name() -> std::borrow::Cow<'static, str> {
        "PropertyValue".into()
    }

    fn inline_schema() -> bool {
        true
    }

    fn json_schema(_: &mut schemars::SchemaGenerator) -> schemars::Schema {
        schemars::json_schema!({
            "description": "A scalar: bool, integer, float or string.",
            "x-kubernetes-preserve-unknown-fields": true
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn json_keeps_integers_and_floats_apart() {
        let v: Vec<PropertyValue> = serde_json::from_str(r#"[true, 21, 21.5, "auto"]"#).unwrap();
        assert_eq!(
            v,
            vec![
                PropertyValue::Bool(true),
                PropertyValue::Int(21),
                PropertyValue::Float(21.5),
                PropertyValue::String("auto".into()),
            ]
        );
        assert_eq!(
            serde_json::to_string(&v).unwrap(),
            r#"[true,21,21.5,"auto"]"#
        );
    }

    #[test]
    fn json_refuses_structures() {
        assert!(serde_json::from_str::<PropertyValue>(r#"{"a": 1}"#).is_err());
        assert!(serde_json::from_str::<PropertyValue>("[1]").is_err());
        assert!(serde_json::from_str::<PropertyValue>("null").is_err());
    }

    #[test]
    fn numeric_view_covers_both_number_types() {
        assert_eq!(PropertyValue::Int(3).as_f64(), Some(3.0));
        assert_eq!(PropertyValue::Float(2.5).as_f64(), Some(2.5));
        assert_eq!(PropertyValue::Bool(true).as_f64(), None);
    }
}
