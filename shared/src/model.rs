//! The device models Edgefleet knows: the properties each reports, their
//! types, and which of them a desired state may set.
//!
//! The controller checks what an EdgeRule reads and sets against the
//! models of the Devices it concerns; the simulator's models report
//! exactly these properties (a test there holds them to it). A Device of a
//! model not listed here is not checked.

use crate::PropertyValue;

/// The type of a property's values.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Kind {
    /// A number (an integer or a float).
    Number,
    /// `true` or `false`.
    Bool,
    /// One of the listed words.
    Word(&'static [&'static str]),
}

impl Kind {
    /// Whether `value` is of this type.
    pub fn admits(self, value: &PropertyValue) -> bool {
        match (self, value) {
            (Kind::Number, PropertyValue::Int(_)) => true,
            (Kind::Number, PropertyValue::Float(f)) => f.is_finite(),
            (Kind::Bool, PropertyValue::Bool(_)) => true,
            (Kind::Word(words), PropertyValue::String(s)) => words.contains(&s.as_str()),
            _ => false,
        }
    }
}

impl std::fmt::Display for Kind {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            Kind::Number => f.write_str("a number"),
            Kind::Bool => f.write_str("a bool"),
            Kind::Word(words) => write!(f, "one of {}", words.join(", ")),
        }
    }
}

/// One property of a model.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Property {
    /// Its name, in reports and desired states.
    pub name: &'static str,
    /// The type of its values.
    pub kind: Kind,
    /// Whether a desired state sets it (else the device only reports it).
    pub writable: bool,
}

/// A device model.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Model {
    /// Its name, as a Device's `spec.model` carries it.
    pub name: &'static str,
    /// Its properties.
    pub properties: &'static [Property],
}

impl Model {
    /// The property called `name`, if the model has it.
    pub fn property(&self, name: &str) -> Option<&'static Property> {
        self.properties.iter().find(|p| p.name == name)
    }

    /// The names of its properties, for messages.
    pub fn names(&self) -> String {
        let names: Vec<&str> = self.properties.iter().map(|p| p.name).collect();
        names.join(", ")
    }
}

const fn property(name: &'static str, kind: Kind, writable: bool) -> Property {
    Property {
        name,
        kind,
        writable,
    }
}

/// The thermostat's modes.
pub const THERMOSTAT_MODES: &[&str] = &["auto", "off"];

/// Every model Edgefleet knows.
pub const MODELS: &[Model] = &[
    Model {
        name: "thermostat",
        properties: &[
            property("temperature", Kind::Number, false),
            property("setpoint", Kind::Number, true),
            property("fan", Kind::Bool, false),
            property("mode", Kind::Word(THERMOSTAT_MODES), true),
        ],
    },
    Model {
        name: "valve",
        properties: &[
            property("open", Kind::Bool, true),
            property("flow", Kind::Number, false),
        ],
    },
    Model {
        name: "meter",
        properties: &[
            property("energy", Kind::Number, false),
            property("power", Kind::Number, false),
        ],
    },
];

/// The model called `name`, if Edgefleet knows it.
pub fn find(name: &str) -> Option<&'static Model> {
    MODELS.iter().find(|m| m.name == name)
}

/// Why a desired value does not fit a model.
#[derive(Debug, Clone, PartialEq, thiserror::Error)]
pub enum Misfit {
    /// The model has no such property.
    #[error("model {model} has no property {property:?} (it has {names})")]
    Unknown {
        /// The model.
        model: &'static str,
        /// The property asked for.
        property: String,
        /// What the model has.
        names: String,
    },
    /// The device only reports it.
    #[error("{property:?} of model {model} is read-only")]
    ReadOnly {
        /// The model.
        model: &'static str,
        /// The property.
        property: &'static str,
    },
    /// The value is of another type.
    #[error("{property:?} of model {model} takes {kind}, not {value}")]
    WrongType {
        /// The model.
        model: &'static str,
        /// The property.
        property: &'static str,
        /// What it takes.
        kind: Kind,
        /// The value given.
        value: PropertyValue,
    },
}

impl Model {
    /// Whether `value` may be set as the desired `property`.
    pub fn check_set(&self, property: &str, value: &PropertyValue) -> Result<(), Misfit> {
        let Some(p) = self.property(property) else {
            return Err(Misfit::Unknown {
                model: self.name,
                property: property.to_owned(),
                names: self.names(),
            });
        };
        if !p.writable {
            return Err(Misfit::ReadOnly {
                model: self.name,
                property: p.name,
            });
        }
        if !p.kind.admits(value) {
            return Err(Misfit::WrongType {
                model: self.name,
                property: p.name,
                kind: p.kind,
                value: value.clone(),
            });
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_desired_value_must_name_a_writable_property_of_its_type() {
        let valve = find("valve").unwrap();
        assert_eq!(valve.check_set("open", &PropertyValue::Bool(false)), Ok(()));
        assert!(matches!(
            valve.check_set("opened", &PropertyValue::Bool(false)),
            Err(Misfit::Unknown { .. })
        ));
        assert!(matches!(
            valve.check_set("flow", &PropertyValue::Float(1.0)),
            Err(Misfit::ReadOnly { .. })
        ));
        assert!(matches!(
            valve.check_set("open", &PropertyValue::String("yes".into())),
            Err(Misfit::WrongType { .. })
        ));
        let thermostat = find("thermostat").unwrap();
        assert_eq!(
            thermostat.check_set("setpoint", &PropertyValue::Int(21)),
            Ok(())
        );
        assert_eq!(
            thermostat.check_set("mode", &PropertyValue::String("off".into())),
            Ok(())
        );
        let wrong = thermostat
            .check_set("mode", &PropertyValue::String("turbo".into()))
            .unwrap_err();
        assert_eq!(
            wrong.to_string(),
            "\"mode\" of model thermostat takes one of auto, off, not \"turbo\""
        );
        assert_eq!(find("toaster"), None);
    }
}
