//! A rollout's health gate: a CEL expression over what a device reports,
//! judged where the device is (by its agent), so a site keeps judging while
//! the cloud is away.
//!
//! The expression sees two names: `reported`, the device's latest reported
//! properties (a map: `reported.temperature`, `'rssi' in reported`), and
//! `online`, whether the device is heard from. A device is healthy when the
//! expression is `true`, unhealthy when it is `false`, and the verdict is
//! inconclusive when the expression cannot be judged yet — a property it
//! reads was never reported, or a value has a type the expression cannot
//! compare — so a rollout waits (pauses) instead of failing devices on a
//! mistake in the expression or a device that has not said enough.
//!
//! Compiling checks what can be checked without a device: the syntax, and
//! that the expression names nothing but `reported` and `online`. The
//! controller compiles every rollout's expression and refuses one that does
//! not compile, with the compiler's message.

use std::collections::{BTreeMap, HashMap};

use cel::{Context, ExecutionError, Program, Value};

use crate::PropertyValue;

/// The names an expression may use.
pub const NAMES: [&str; 2] = ["reported", "online"];

/// A compiled health expression.
pub struct HealthGate {
    source: String,
    program: Program,
}

impl std::fmt::Debug for HealthGate {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_tuple("HealthGate").field(&self.source).finish()
    }
}

/// Why an expression is refused.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum HealthGateError {
    /// It does not parse.
    #[error("the health expression does not compile: {0}")]
    Syntax(String),
    /// It names something other than `reported` and `online`.
    #[error(
        "the health expression uses {0:?}; it may use only `reported` (the device's reported properties) and `online`"
    )]
    UnknownName(String),
}

/// What a health expression says of a device.
#[derive(Debug, Clone, PartialEq)]
pub enum Verdict {
    /// Healthy.
    Pass,
    /// Unhealthy.
    Fail,
    /// Cannot be judged yet, and why.
    Inconclusive(String),
}

/// Compiles a CEL expression that may use only `names`: the program, or
/// the syntax error, or the first other name it uses.
pub(crate) fn compile_over(source: &str, names: &[&str]) -> Result<Program, HealthGateError> {
    let program = Program::compile(source).map_err(|e| HealthGateError::Syntax(e.to_string()))?;
    let used = crate::cel_names::names(program.expression(), "");
    if let Some(unknown) = used.free.into_iter().find(|n| !names.contains(&n.as_str())) {
        return Err(HealthGateError::UnknownName(unknown));
    }
    Ok(program)
}

impl HealthGate {
    /// Compiles `source`, refusing syntax errors and unknown names.
    pub fn compile(source: &str) -> Result<Self, HealthGateError> {
        let program = compile_over(source, &NAMES)?;
        Ok(HealthGate {
            source: source.to_owned(),
            program,
        })
    }

    /// The expression as written.
    pub fn source(&self) -> &str {
        &self.source
    }

    /// Judges a device that reported `reported` and is `online` or not.
    pub fn judge(&self, reported: &BTreeMap<String, PropertyValue>, online: bool) -> Verdict {
        let properties: HashMap<String, Value> = reported
            .iter()
            .map(|(name, value)| (name.clone(), cel_value(value)))
            .collect();
        let mut context = Context::default();
        context.add_variable_from_value("reported", properties);
        context.add_variable_from_value("online", online);
        match self.program.execute(&context) {
            Ok(Value::Bool(true)) => Verdict::Pass,
            Ok(Value::Bool(false)) => Verdict::Fail,
            Ok(other) => {
                Verdict::Inconclusive(format!("the expression gave {other:?}, not true or false"))
            }
            Err(ExecutionError::NoSuchKey(name)) => {
                Verdict::Inconclusive(format!("the device has not reported {name}"))
            }
            Err(e) => Verdict::Inconclusive(e.to_string()),
        }
    }
}

pub(crate) fn cel_value(value: &PropertyValue) -> Value {
    match value {
        PropertyValue::Bool(b) => Value::Bool(*b),
        PropertyValue::Int(i) => Value::Int(*i),
        PropertyValue::Float(f) => Value::Float(*f),
        PropertyValue::String(s) => Value::from(s.as_str()),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn reported(pairs: &[(&str, PropertyValue)]) -> BTreeMap<String, PropertyValue> {
        pairs
            .iter()
            .map(|(k, v)| ((*k).to_owned(), v.clone()))
            .collect()
    }

    #[test]
    fn a_device_passes_fails_or_cannot_be_judged_yet() {
        let gate = HealthGate::compile("online && reported.temperature < 80").unwrap();
        let warm = reported(&[("temperature", PropertyValue::Float(20.5))]);
        let hot = reported(&[("temperature", PropertyValue::Int(95))]);
        assert_eq!(gate.judge(&warm, true), Verdict::Pass);
        assert_eq!(gate.judge(&hot, true), Verdict::Fail);
        assert_eq!(
            gate.judge(&warm, false),
            Verdict::Fail,
            "offline is unhealthy"
        );
        assert_eq!(
            gate.judge(&BTreeMap::new(), true),
            Verdict::Inconclusive("the device has not reported temperature".into())
        );
        let odd = reported(&[("temperature", PropertyValue::String("n/a".into()))]);
        assert!(matches!(gate.judge(&odd, true), Verdict::Inconclusive(_)));
    }

    #[test]
    fn an_expression_that_is_not_a_condition_is_inconclusive() {
        let gate = HealthGate::compile("reported.temperature").unwrap();
        let warm = reported(&[("temperature", PropertyValue::Float(20.5))]);
        assert!(
            matches!(gate.judge(&warm, true), Verdict::Inconclusive(m) if m.contains("not true or false"))
        );
    }

    #[test]
    fn presence_and_strings_can_be_tested() {
        let gate =
            HealthGate::compile("!('fault' in reported) || reported.fault == 'none'").unwrap();
        assert_eq!(gate.judge(&BTreeMap::new(), true), Verdict::Pass);
        let fault = reported(&[("fault", PropertyValue::String("overheat".into()))]);
        assert_eq!(gate.judge(&fault, true), Verdict::Fail);
    }

    #[test]
    fn syntax_errors_and_unknown_names_are_refused_with_a_reason() {
        let err = HealthGate::compile("online &&& reported.x").unwrap_err();
        assert!(
            matches!(&err, HealthGateError::Syntax(m) if m.contains("1:")),
            "{err}"
        );
        let err = HealthGate::compile("temperature < 80").unwrap_err();
        assert_eq!(err, HealthGateError::UnknownName("temperature".into()));
        assert!(err.to_string().contains("only `reported`"));
    }
}
