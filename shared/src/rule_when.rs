//! An EdgeRule's `when`: a CEL expression over one device, compiled once
//! (by the controller to accept or refuse the rule, and by the agent that
//! evaluates it on every report).
//!
//! The expression sees `reported` (the device's latest reported
//! properties, a map), `online`, `firmware` (the version it runs, `""` if
//! it never said) and `labels` (its Device's labels, a map). It holds when
//! it is `true`, is clear when it is `false`, and is unknown when it cannot
//! be judged (a property never reported, a type it cannot compare): an
//! unknown condition neither starts nor ends what the rule does.

use std::collections::{BTreeMap, BTreeSet, HashMap};

use cel::{Context, ExecutionError, Program, Value};

use crate::PropertyValue;
use crate::health_gate::{HealthGateError, cel_value, compile_over};

/// The names a `when` may use.
pub const NAMES: [&str; 4] = ["reported", "online", "firmware", "labels"];

/// A compiled `when`.
pub struct When {
    source: String,
    program: Program,
}

impl std::fmt::Debug for When {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_tuple("When").field(&self.source).finish()
    }
}

/// Why a `when` is refused.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum WhenError {
    /// It does not parse.
    #[error("spec.when does not compile: {0}")]
    Syntax(String),
    /// It names something a rule cannot see.
    #[error(
        "spec.when uses {0:?}; it may use only `reported` (the device's reported properties), `online`, `firmware` and `labels`"
    )]
    UnknownName(String),
}

/// What is known of one device when its rule is evaluated.
#[derive(Clone, Copy, Debug)]
pub struct Facts<'a> {
    /// Its latest reported properties.
    pub reported: &'a BTreeMap<String, PropertyValue>,
    /// Whether it is heard from.
    pub online: bool,
    /// The firmware it runs, if it said.
    pub firmware: Option<&'a str>,
    /// Its Device's labels.
    pub labels: &'a BTreeMap<String, String>,
}

/// What a `when` says of a device.
#[derive(Debug, Clone, PartialEq)]
pub enum Judged {
    /// The condition holds.
    Holds,
    /// It does not.
    Clear,
    /// It cannot be judged, and why.
    Unknown(String),
}

impl When {
    /// Compiles `source`, refusing syntax errors and unknown names.
    pub fn compile(source: &str) -> Result<Self, WhenError> {
        let program = compile_over(source, &NAMES).map_err(|e| match e {
            HealthGateError::Syntax(m) => WhenError::Syntax(m),
            HealthGateError::UnknownName(n) => WhenError::UnknownName(n),
        })?;
        Ok(When {
            source: source.to_owned(),
            program,
        })
    }

    /// The expression as written.
    pub fn source(&self) -> &str {
        &self.source
    }

    /// The reported properties the expression reads by name
    /// (`reported.x`, `reported['x']`, `has(reported.x)`), sorted.
    pub fn reads(&self) -> BTreeSet<String> {
        crate::cel_names::names(self.program.expression(), "reported").fields
    }

    /// Judges one device.
    pub fn judge(&self, facts: Facts<'_>) -> Judged {
        let reported: HashMap<String, Value> = facts
            .reported
            .iter()
            .map(|(name, value)| (name.clone(), cel_value(value)))
            .collect();
        let labels: HashMap<String, Value> = facts
            .labels
            .iter()
            .map(|(name, value)| (name.clone(), Value::from(value.as_str())))
            .collect();
        let mut context = Context::default();
        context.add_variable_from_value("reported", reported);
        context.add_variable_from_value("online", facts.online);
        context.add_variable_from_value("firmware", facts.firmware.unwrap_or_default());
        context.add_variable_from_value("labels", labels);
        match self.program.execute(&context) {
            Ok(Value::Bool(true)) => Judged::Holds,
            Ok(Value::Bool(false)) => Judged::Clear,
            Ok(other) => Judged::Unknown(format!("gave {other:?}, not true or false")),
            Err(ExecutionError::NoSuchKey(name)) => {
                Judged::Unknown(format!("the device has not reported {name}"))
            }
            Err(e) => Judged::Unknown(e.to_string()),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_condition_holds_clears_or_cannot_be_judged() {
        let when =
            When::compile("reported.temperature > 80.0 && labels.zone == 'boiler' && online")
                .unwrap();
        let labels = BTreeMap::from([("zone".to_owned(), "boiler".to_owned())]);
        let hot = BTreeMap::from([("temperature".to_owned(), PropertyValue::Float(91.0))]);
        let cool = BTreeMap::from([("temperature".to_owned(), PropertyValue::Float(40.0))]);
        let facts = |reported, online| Facts {
            reported,
            online,
            firmware: Some("1.0.0"),
            labels: &labels,
        };
        assert_eq!(when.judge(facts(&hot, true)), Judged::Holds);
        assert_eq!(when.judge(facts(&cool, true)), Judged::Clear);
        assert_eq!(when.judge(facts(&hot, false)), Judged::Clear);
        let nothing = BTreeMap::new();
        assert!(matches!(
            when.judge(facts(&nothing, true)),
            Judged::Unknown(m) if m.contains("temperature")
        ));
        let firmware = When::compile("firmware.startsWith('2.')").unwrap();
        assert_eq!(firmware.judge(facts(&hot, true)), Judged::Clear);
    }

    #[test]
    fn a_condition_may_use_comprehensions_and_says_what_it_reads() {
        let when =
            When::compile("[70.0, 80.0].exists(t, reported.temperature > t) && has(reported.fan)")
                .unwrap();
        let reads: Vec<String> = when.reads().into_iter().collect();
        assert_eq!(reads, ["fan", "temperature"]);
    }

    #[test]
    fn what_a_rule_cannot_see_is_refused_with_the_names_it_may_use() {
        let err = When::compile("spec.desired.open == true").unwrap_err();
        assert_eq!(err, WhenError::UnknownName("spec".into()));
        assert!(err.to_string().contains("`labels`"), "{err}");
        assert!(matches!(
            When::compile("reported.temperature >").unwrap_err(),
            WhenError::Syntax(_)
        ));
    }
}
