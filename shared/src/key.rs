//! Resource keys: how the sync protocol and the edge store name a resource.

use std::fmt;
use std::str::FromStr;

/// The kinds of resource that travel to the edge.
#[derive(Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub enum ResourceKind {
    /// A [`crate::api::Device`].
    Device,
    /// A [`crate::api::rule::EdgeRule`], as one node's agent needs it.
    Rule,
    /// A device's pre-shared key (see [`crate::credential`]), named like
    /// its Device.
    Credential,
}

impl ResourceKind {
    fn as_str(self) -> &'static str {
        match self {
            ResourceKind::Device => "device",
            ResourceKind::Rule => "rule",
            ResourceKind::Credential => "credential",
        }
    }
}

/// A namespaced resource's key, written `<kind>/<namespace>/<name>`
/// (for example `device/plant-a/thermostat-17`).
#[derive(Clone, Debug, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub struct ResourceKey {
    /// What kind of resource this is.
    pub kind: ResourceKind,
    /// Its namespace.
    pub namespace: String,
    /// Its name.
    pub name: String,
}

impl ResourceKey {
    /// The key of a Device.
    pub fn device(namespace: impl Into<String>, name: impl Into<String>) -> Self {
        ResourceKey {
            kind: ResourceKind::Device,
            namespace: namespace.into(),
            name: name.into(),
        }
    }

    /// The key of an EdgeRule.
    pub fn rule(namespace: impl Into<String>, name: impl Into<String>) -> Self {
        ResourceKey {
            kind: ResourceKind::Rule,
            namespace: namespace.into(),
            name: name.into(),
        }
    }

    /// The key of the credential of the Device `name`.
    pub fn credential(namespace: impl Into<String>, name: impl Into<String>) -> Self {
        ResourceKey {
            kind: ResourceKind::Credential,
            namespace: namespace.into(),
            name: name.into(),
        }
    }

    /// Whether this is a Device's key.
    pub fn is_device(&self) -> bool {
        self.kind == ResourceKind::Device
    }
}

impl fmt::Display for ResourceKey {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{}/{}/{}", self.kind.as_str(), self.namespace, self.name)
    }
}

/// A string that is not `<kind>/<namespace>/<name>` with a known kind.
#[derive(Debug, thiserror::Error, PartialEq, Eq)]
#[error("{0:?} is not a resource key of the form <device|rule|credential>/<namespace>/<name>")]
pub struct ResourceKeyError(String);

impl FromStr for ResourceKey {
    type Err = ResourceKeyError;

    fn from_str(s: &str) -> Result<Self, Self::Err> {
        let err = || ResourceKeyError(s.to_owned());
        let mut parts = s.split('/');
        let (Some(kind), Some(namespace), Some(name), None) =
            (parts.next(), parts.next(), parts.next(), parts.next())
        else {
            return Err(err());
        };
        if namespace.is_empty() || name.is_empty() {
            return Err(err());
        }
        let kind = match kind {
            "device" => ResourceKind::Device,
            "rule" => ResourceKind::Rule,
            "credential" => ResourceKind::Credential,
            _ => return Err(err()),
        };
        Ok(ResourceKey {
            kind,
            namespace: namespace.to_owned(),
            name: name.to_owned(),
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn keys_round_trip_through_text() {
        let key = ResourceKey::device("plant-a", "thermostat-17");
        assert_eq!(key.to_string(), "device/plant-a/thermostat-17");
        assert_eq!(
            "device/plant-a/thermostat-17".parse::<ResourceKey>(),
            Ok(key)
        );
        let rule = ResourceKey::rule("plant-a", "overheat");
        assert_eq!(rule.to_string(), "rule/plant-a/overheat");
        assert_eq!("rule/plant-a/overheat".parse::<ResourceKey>(), Ok(rule));
        let credential = ResourceKey::credential("plant-a", "thermostat-17");
        assert_eq!(credential.to_string(), "credential/plant-a/thermostat-17");
        assert_eq!(
            "credential/plant-a/thermostat-17".parse::<ResourceKey>(),
            Ok(credential)
        );
    }

    #[test]
    fn malformed_keys_are_refused() {
        for bad in [
            "",
            "device",
            "device/ns",
            "device//x",
            "device/ns/",
            "pump/ns/x",
            "device/a/b/c",
        ] {
            assert!(bad.parse::<ResourceKey>().is_err(), "accepted {bad:?}");
        }
    }
}
