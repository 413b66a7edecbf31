//! A device's health check during a rollout, as its agent runs it: after
//! the device applied the generation a rollout gave it (and runs the
//! firmware it was told to), every report is judged by the rollout's
//! [`HealthGate`]; the device must stay healthy for the bake time.
//!
//! Pure: the agent keeps the [`HealthState`] with the device's latest
//! report and sends it up with it, so the verdict survives an agent restart
//! and reaches the cloud exactly like the report (also after an offline
//! spell).

use serde::{Deserialize, Serialize};

use crate::codec::DeviceReport;
use crate::health_gate::{HealthGate, Verdict};

/// What the agent is told to check for a device: part of the device's
/// desired state, for the generation a rollout made.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct HealthCheck {
    /// The rollout (namespace-local name), for messages.
    pub rollout: String,
    /// The CEL expression.
    pub expression: String,
    /// How long the device must stay healthy.
    pub bake_seconds: u32,
}

/// Where a device's check stands.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub enum HealthStage {
    /// Healthy so far; the bake time is not over.
    Baking,
    /// Healthy for the whole bake time. Final for the generation.
    Passed,
    /// The expression said false. Final for the generation.
    Failed,
    /// The expression could not be judged (a property never reported, a
    /// type it cannot compare, an expression that does not compile here).
    Inconclusive,
}

/// A device's check, for one generation.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct HealthState {
    /// The generation checked.
    pub generation: i64,
    /// Where it stands.
    pub stage: HealthStage,
    /// Since when the device has been judged healthy without a break
    /// (Unix milliseconds).
    pub since_ms: i64,
    /// Why, for people.
    pub message: String,
}

impl HealthState {
    /// Whether nothing can change it any more.
    pub fn is_final(&self) -> bool {
        matches!(self.stage, HealthStage::Passed | HealthStage::Failed)
    }
}

/// The state after `report` of a device whose desired state is
/// `generation` with `check` and firmware `firmware` (if it orders one),
/// given the state before. `None` while there is nothing to check: no
/// check, or the device has not applied the generation (or runs another
/// firmware) yet.
pub fn next(
    previous: Option<&HealthState>,
    generation: i64,
    check: Option<(&HealthCheck, Result<&HealthGate, &str>)>,
    firmware: Option<&str>,
    report: &DeviceReport,
    now_ms: i64,
) -> Option<HealthState> {
    let (check, gate) = check?;
    let applied = report.applied_generation >= generation
        && firmware.is_none_or(|f| report.firmware_version.as_deref() == Some(f));
    if !applied {
        return None;
    }
    let previous = previous.filter(|p| p.generation == generation);
    if let Some(done) = previous.filter(|p| p.is_final()) {
        return Some(done.clone());
    }
    let state = |stage, since_ms, message: String| HealthState {
        generation,
        stage,
        since_ms,
        message,
    };
    let gate = match gate {
        Ok(gate) => gate,
        Err(error) => return Some(state(HealthStage::Inconclusive, now_ms, error.to_owned())),
    };
    match gate.judge(&report.properties, true) {
        Verdict::Fail => Some(state(
            HealthStage::Failed,
            now_ms,
            format!("{} is false", check.expression),
        )),
        Verdict::Inconclusive(why) => Some(state(HealthStage::Inconclusive, now_ms, why)),
        Verdict::Pass => {
            let since = previous
                .filter(|p| p.stage == HealthStage::Baking)
                .map_or(now_ms, |p| p.since_ms);
            let baked = now_ms - since >= i64::from(check.bake_seconds) * 1000;
            Some(match baked {
                true => state(
                    HealthStage::Passed,
                    since,
                    format!("healthy for {}s", check.bake_seconds),
                ),
                false => state(
                    HealthStage::Baking,
                    since,
                    format!("healthy so far; {}s to bake", check.bake_seconds),
                ),
            })
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::PropertyValue;

    fn check(bake_seconds: u32) -> HealthCheck {
        HealthCheck {
            rollout: "fw-2".into(),
            expression: "!('crashes' in reported)".into(),
            bake_seconds,
        }
    }

    fn report(generation: i64, firmware: &str, crashes: Option<i64>) -> DeviceReport {
        DeviceReport {
            applied_generation: generation,
            properties: crashes
                .map(|c| ("crashes".to_owned(), PropertyValue::Int(c)))
                .into_iter()
                .collect(),
            firmware_version: Some(firmware.into()),
            firmware_failure: None,
        }
    }

    #[test]
    fn a_device_bakes_then_passes_and_stays_passed() {
        let c = check(10);
        let gate = HealthGate::compile(&c.expression).unwrap();
        let with = Some((&c, Ok(&gate)));
        assert_eq!(
            next(None, 5, with, Some("2.0.0"), &report(4, "1.0.0", None), 0),
            None
        );
        assert_eq!(
            next(None, 5, with, Some("2.0.0"), &report(5, "1.0.0", None), 0),
            None,
            "still installing"
        );
        let baking = next(
            None,
            5,
            with,
            Some("2.0.0"),
            &report(5, "2.0.0", None),
            1_000,
        )
        .unwrap();
        assert_eq!(
            (baking.stage, baking.since_ms),
            (HealthStage::Baking, 1_000)
        );
        let still = next(
            Some(&baking),
            5,
            with,
            Some("2.0.0"),
            &report(5, "2.0.0", None),
            10_999,
        );
        assert_eq!(still.as_ref().unwrap().stage, HealthStage::Baking);
        let passed = next(
            still.as_ref(),
            5,
            with,
            Some("2.0.0"),
            &report(5, "2.0.0", None),
            11_000,
        )
        .unwrap();
        assert_eq!(passed.stage, HealthStage::Passed);
        let later = next(
            Some(&passed),
            5,
            with,
            Some("2.0.0"),
            &report(5, "2.0.0", Some(1)),
            20_000,
        );
        assert_eq!(later.unwrap().stage, HealthStage::Passed, "final");
    }

    #[test]
    fn an_unhealthy_report_fails_the_device_for_good() {
        let c = check(10);
        let gate = HealthGate::compile(&c.expression).unwrap();
        let with = Some((&c, Ok(&gate)));
        let baking = next(None, 5, with, None, &report(5, "2.0.0", None), 0).unwrap();
        let failed = next(
            Some(&baking),
            5,
            with,
            None,
            &report(5, "2.0.0", Some(1)),
            1_000,
        )
        .unwrap();
        assert_eq!(failed.stage, HealthStage::Failed);
        let after = next(
            Some(&failed),
            5,
            with,
            None,
            &report(5, "2.0.0", None),
            2_000,
        )
        .unwrap();
        assert_eq!(after.stage, HealthStage::Failed);
        // A new generation (a rollback) starts afresh.
        let rolled = next(
            Some(&failed),
            6,
            with,
            None,
            &report(6, "1.0.0", None),
            3_000,
        )
        .unwrap();
        assert_eq!(rolled.stage, HealthStage::Baking);
    }

    #[test]
    fn what_cannot_be_judged_is_inconclusive_and_restarts_the_bake() {
        let c = HealthCheck {
            expression: "reported.temperature < 80".into(),
            ..check(10)
        };
        let gate = HealthGate::compile(&c.expression).unwrap();
        let with = Some((&c, Ok(&gate)));
        let unsure = next(None, 5, with, None, &report(5, "2.0.0", None), 0).unwrap();
        assert_eq!(unsure.stage, HealthStage::Inconclusive);
        let broken = next(
            None,
            5,
            Some((&c, Err("does not compile"))),
            None,
            &report(5, "2.0.0", None),
            0,
        );
        assert_eq!(broken.unwrap().stage, HealthStage::Inconclusive);
        assert_eq!(
            next(None, 5, None, None, &report(5, "2.0.0", None), 0),
            None,
            "no check"
        );
    }
}
