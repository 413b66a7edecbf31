//! How an agent runs its EdgeRules, without I/O: when a rule acts for a
//! device and when it lets go ([`step`]), and what a device is told when
//! several rules set its properties ([`effective`]).
//!
//! The agent keeps one [`Watch`] per rule and watched device with the
//! device's latest report, judges the rule's `when` on every report, and
//! writes what [`step`] returns durably before it acts. These functions
//! only decide; the clock and the counts are the caller's.

use std::collections::BTreeMap;

use serde::{Deserialize, Serialize};

use crate::PropertyValue;
use crate::rule_when::Judged;

/// How deep a chain of rules may go. A decision on a device's report is
/// one level deeper than the last change a rule made to what that device
/// is told (setting an override or ending one: a restore that lets a
/// device go back is as much a cause as the set), and a device a person
/// gave a new generation starts again at 0. Deeper decisions are refused,
/// so rules that keep setting and restoring each other's devices stop.
pub const MAX_CHAIN_DEPTH: u32 = 8;

/// What [`step`] needs of a rule.
#[derive(Clone, Debug, PartialEq)]
pub struct Timing {
    /// How long `when` must hold (ms).
    pub for_ms: i64,
    /// How long after acting for a device the rule waits before it may
    /// act for it again (ms).
    pub cooldown_ms: i64,
    /// Whether its overrides end when `when` clears.
    pub restore: bool,
    /// Most actions per minute at this node.
    pub max_per_minute: u32,
}

/// Where one rule stands for one watched device. Kept durably by the
/// agent, with the device.
#[derive(Clone, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "camelCase")]
pub struct Watch {
    /// Since when `when` has held without a break (Unix ms).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub holding_since_ms: Option<i64>,
    /// The rule acted and has not let go.
    #[serde(default)]
    pub active: bool,
    /// When it last acted for this device (Unix ms).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub last_acted_ms: Option<i64>,
    /// It was refused (rate or depth) during the present spell of `when`:
    /// a refusal is reported once per spell, not on every report.
    #[serde(default)]
    pub refused: bool,
}

/// What a rule does for a device, decided by [`step`].
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Decision {
    /// Act now: set the properties and/or raise the event.
    Act,
    /// Let go: end the overrides the rule set for this device.
    Restore,
    /// It would act, but is refused.
    Refused(Refusal),
}

/// Why a rule that would act does not.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Refusal {
    /// It acted `max_per_minute` times in the last minute at this node.
    RateLimited,
    /// The chain of rules that led here is deeper than [`MAX_CHAIN_DEPTH`].
    ChainTooDeep,
}

/// One step of `rule` for one device, on a report judged `judged` at
/// `now_ms`. `acted_last_minute` is how many times the rule acted at this
/// node in the minute before; `depth` is the depth this action would
/// have. Returns the new watch and what to do, if anything.
pub fn step(
    rule: &Timing,
    watch: &Watch,
    judged: &Judged,
    now_ms: i64,
    acted_last_minute: u32,
    depth: u32,
) -> (Watch, Option<Decision>) {
    let mut next = watch.clone();
    match judged {
        // Neither starts nor ends anything: a device that stops reporting
        // a property keeps the rule where it was.
        Judged::Unknown(_) => (next, None),
        Judged::Clear => {
            next.holding_since_ms = None;
            next.refused = false;
            let decision = (watch.active && rule.restore).then_some(Decision::Restore);
            next.active = false;
            (next, decision)
        }
        Judged::Holds => {
            let since = *next.holding_since_ms.get_or_insert(now_ms);
            let held_long_enough = now_ms - since >= rule.for_ms;
            let cooled = watch
                .last_acted_ms
                .is_none_or(|t| now_ms - t >= rule.cooldown_ms);
            if watch.active || !held_long_enough || !cooled {
                return (next, None);
            }
            let refusal = if depth > MAX_CHAIN_DEPTH {
                Some(Refusal::ChainTooDeep)
            } else if acted_last_minute >= rule.max_per_minute {
                Some(Refusal::RateLimited)
            } else {
                None
            };
            match refusal {
                Some(_) if watch.refused => (next, None),
                Some(r) => {
                    next.refused = true;
                    (next, Some(Decision::Refused(r)))
                }
                None => {
                    next.active = true;
                    next.refused = false;
                    next.last_acted_ms = Some(now_ms);
                    (next, Some(Decision::Act))
                }
            }
        }
    }
}

/// A property a rule set on a device, in force.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
#[serde(rename_all = "camelCase")]
pub struct Override {
    /// The rule's name.
    pub rule: String,
    /// Its priority.
    pub priority: i32,
    /// The value set.
    pub value: PropertyValue,
    /// Since when (Unix ms).
    pub since_ms: i64,
    /// The watched device whose report made the rule act: a rule acting
    /// for two devices on one target holds two overrides, and each ends
    /// with its own device's condition.
    #[serde(default)]
    pub cause: String,
}

/// A rule whose override lost to another's on the same property.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Conflict {
    /// The property.
    pub property: String,
    /// The rule that lost.
    pub loser: String,
    /// The rule that won.
    pub winner: String,
}

/// What a device is told: `spec` with, per property, the override of the
/// highest priority on top (on a tie, the rule whose name sorts first),
/// and the rules that lost.
pub fn effective(
    spec: &BTreeMap<String, PropertyValue>,
    overrides: &BTreeMap<String, Vec<Override>>,
) -> (BTreeMap<String, PropertyValue>, Vec<Conflict>) {
    let mut desired = spec.clone();
    let mut conflicts = Vec::new();
    for (property, candidates) in overrides {
        let Some(winner) = candidates.iter().min_by(|a, b| {
            b.priority
                .cmp(&a.priority)
                .then_with(|| a.rule.cmp(&b.rule))
        }) else {
            continue;
        };
        desired.insert(property.clone(), winner.value.clone());
        conflicts.extend(
            candidates
                .iter()
                .filter(|o| o.rule != winner.rule)
                .map(|o| Conflict {
                    property: property.clone(),
                    loser: o.rule.clone(),
                    winner: winner.rule.clone(),
                }),
        );
    }
    (desired, conflicts)
}

/// The overrides of a device as people are shown them: one per property
/// and rule (a rule acting for two watched devices shows the earlier), each
/// with whether it is the one in force, by [`effective`]'s order.
pub fn shown(overrides: &BTreeMap<String, Vec<Override>>) -> Vec<(String, Override, bool)> {
    let mut out = Vec::new();
    for (property, candidates) in overrides {
        let winner = candidates.iter().min_by(|a, b| {
            b.priority
                .cmp(&a.priority)
                .then_with(|| a.rule.cmp(&b.rule))
        });
        let mut by_rule: BTreeMap<&str, &Override> = BTreeMap::new();
        for o in candidates {
            let kept = by_rule.entry(o.rule.as_str()).or_insert(o);
            if o.since_ms < kept.since_ms {
                *kept = o;
            }
        }
        for (rule, o) in by_rule {
            let in_force = winner.is_some_and(|w| w.rule == rule);
            out.push((property.clone(), o.clone(), in_force));
        }
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    fn timing(for_ms: i64, cooldown_ms: i64, restore: bool) -> Timing {
        Timing {
            for_ms,
            cooldown_ms,
            restore,
            max_per_minute: 10,
        }
    }

    /// Runs `judged` at the given times through one rule; returns the
    /// decisions with their times.
    fn run(rule: &Timing, reports: &[(i64, Judged)]) -> Vec<(i64, Decision)> {
        let mut watch = Watch::default();
        let mut out = Vec::new();
        for (at, judged) in reports {
            let (next, decision) = step(rule, &watch, judged, *at, 0, 1);
            watch = next;
            out.extend(decision.map(|d| (*at, d)));
        }
        out
    }

    #[test]
    fn a_rule_acts_once_its_condition_held_for_long_enough_and_lets_go_when_it_clears() {
        let rule = timing(30_000, 0, true);
        let decisions = run(
            &rule,
            &[
                (0, Judged::Holds),
                (10_000, Judged::Holds),
                (29_999, Judged::Holds),
                (30_000, Judged::Holds),
                (40_000, Judged::Holds),
                (50_000, Judged::Clear),
                (60_000, Judged::Clear),
            ],
        );
        assert_eq!(
            decisions,
            [(30_000, Decision::Act), (50_000, Decision::Restore)]
        );
    }

    #[test]
    fn a_break_in_the_condition_starts_the_hysteresis_again() {
        let rule = timing(30_000, 0, true);
        let decisions = run(
            &rule,
            &[
                (0, Judged::Holds),
                (20_000, Judged::Clear),
                (25_000, Judged::Holds),
                (50_000, Judged::Holds),
                (55_000, Judged::Holds),
            ],
        );
        assert_eq!(decisions, [(55_000, Decision::Act)]);
    }

    #[test]
    fn an_unknown_judgement_neither_starts_nor_ends_anything() {
        let rule = timing(0, 0, true);
        let unknown = || Judged::Unknown("no temperature".into());
        let decisions = run(
            &rule,
            &[
                (0, unknown()),
                (1, Judged::Holds),
                (2, unknown()),
                (3, Judged::Clear),
            ],
        );
        assert_eq!(decisions, [(1, Decision::Act), (3, Decision::Restore)]);
    }

    #[test]
    fn cooldown_keeps_a_rule_from_acting_again_too_soon_and_without_restore_nothing_is_undone() {
        let rule = timing(0, 60_000, false);
        let decisions = run(
            &rule,
            &[
                (0, Judged::Holds),
                (10_000, Judged::Clear),
                (20_000, Judged::Holds),
                (59_999, Judged::Holds),
                (60_000, Judged::Holds),
            ],
        );
        assert_eq!(decisions, [(0, Decision::Act), (60_000, Decision::Act)]);
    }

    #[test]
    fn refusals_are_reported_once_per_spell() {
        let rule = Timing {
            max_per_minute: 2,
            ..timing(0, 0, true)
        };
        let watch = Watch::default();
        let (watch, decision) = step(&rule, &watch, &Judged::Holds, 0, 2, 1);
        assert_eq!(decision, Some(Decision::Refused(Refusal::RateLimited)));
        let (watch, decision) = step(&rule, &watch, &Judged::Holds, 1, 2, 1);
        assert_eq!(decision, None, "said once");
        // Room again: it acts.
        let (watch, decision) = step(&rule, &watch, &Judged::Holds, 2, 1, 1);
        assert_eq!(decision, Some(Decision::Act));
        assert!(watch.active && !watch.refused);
        let (_, decision) = step(
            &rule,
            &Watch::default(),
            &Judged::Holds,
            0,
            0,
            MAX_CHAIN_DEPTH + 1,
        );
        assert_eq!(decision, Some(Decision::Refused(Refusal::ChainTooDeep)));
    }

    #[test]
    fn each_rule_is_shown_once_per_property_with_the_one_in_force() {
        let mut a1 = set("a", 5, false);
        a1.since_ms = 20;
        let mut a2 = set("a", 5, false);
        a2.since_ms = 10;
        let overrides = BTreeMap::from([("open".to_owned(), vec![a1, set("b", 9, true), a2])]);
        let shown = shown(&overrides);
        let summary: Vec<(&str, i64, bool)> = shown
            .iter()
            .map(|(_, o, in_force)| (o.rule.as_str(), o.since_ms, *in_force))
            .collect();
        assert_eq!(summary, [("a", 10, false), ("b", 0, true)]);
    }

    fn set(rule: &str, priority: i32, value: bool) -> Override {
        Override {
            rule: rule.into(),
            priority,
            value: PropertyValue::Bool(value),
            since_ms: 0,
            cause: String::new(),
        }
    }

    #[test]
    fn the_highest_priority_wins_and_a_tie_goes_to_the_name_that_sorts_first() {
        let spec = BTreeMap::from([
            ("open".to_owned(), PropertyValue::Bool(true)),
            ("mode".to_owned(), PropertyValue::String("auto".into())),
        ]);
        let overrides = BTreeMap::from([(
            "open".to_owned(),
            vec![set("b-flood", 10, true), set("a-overheat", 100, false)],
        )]);
        let (desired, conflicts) = effective(&spec, &overrides);
        assert_eq!(desired["open"], PropertyValue::Bool(false));
        assert_eq!(desired["mode"], spec["mode"], "untouched");
        assert_eq!(
            conflicts,
            [Conflict {
                property: "open".into(),
                loser: "b-flood".into(),
                winner: "a-overheat".into(),
            }]
        );
        let tie = BTreeMap::from([(
            "open".to_owned(),
            vec![set("z-rule", 5, true), set("m-rule", 5, false)],
        )]);
        let (desired, conflicts) = effective(&spec, &tie);
        assert_eq!(
            desired["open"],
            PropertyValue::Bool(false),
            "m-rule sorts first"
        );
        assert_eq!(conflicts[0].loser, "z-rule");
        // No overrides: the spec as it is.
        assert_eq!(
            effective(&spec, &BTreeMap::new()),
            (spec.clone(), Vec::new())
        );
    }
}
