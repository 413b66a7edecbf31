//! A site's own part in a rollout's failure policy: what the agent of an
//! edge node is told with each generation a rollout made, and how it
//! judges its site when the cloud cannot.
//!
//! While the cloud is connected it counts failures and rolls back. While
//! it is not, the agent counts the failures of its own devices against the
//! rollout's per-site threshold and, once it is crossed, puts back what the
//! rollout replaced on its own: the device is sent the previous firmware
//! and properties under the generation before the rollout's (a generation
//! the device did not apply last, so it applies it). The agent keeps an
//! [`EdgeRollback`] with the device's desired state and sends it up with
//! the device's reports; the cloud shows it as the Device's `RolledBack`
//! condition and changes the Device's spec back, which ends the local
//! override with a newer generation.
//!
//! Pure: the agent's store supplies the reports and verdicts.

use serde::{Deserialize, Serialize};

use crate::api::rollout::FailureClass;
use crate::codec::{DesiredState, DeviceReport, FirmwareOrder};
use crate::health_check::{HealthStage, HealthState};
use crate::rollout_member::{Previous, SiteThreshold};
use crate::rollout_step::crossed;

/// What a Device's agent is told with the generation a rollout made, if
/// the rollout rolls back when a site crosses a failure threshold.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
#[serde(rename_all = "camelCase")]
pub struct SiteRollback {
    /// The FleetRollout's name.
    pub rollout: String,
    /// Its uid: the members of one rollout at a site are judged together.
    pub rollout_uid: String,
    /// When the site goes back, and which of its devices.
    pub threshold: SiteThreshold,
    /// What the rollout replaced on this device.
    pub previous: Previous,
}

/// What the agent did to one device on its own: kept with the device's
/// desired state, and sent up with its reports until the cloud changes
/// the Device.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "camelCase")]
pub struct EdgeRollback {
    /// The FleetRollout's name.
    pub rollout: String,
    /// The generation the rollout made, which was rolled back.
    pub generation: i64,
    /// When (Unix milliseconds).
    pub at_ms: i64,
    /// Why, for people.
    pub message: String,
}

/// Where one member's update stands at the edge.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Outcome {
    /// Not reported applied yet, or still baking.
    Open,
    /// Applied, and healthy for the bake time if there is a health check.
    Succeeded,
    /// Failed.
    Failed(FailureClass),
    /// Rolled back by the agent already.
    RolledBack,
}

/// The outcome of the update to `generation` (with `firmware`, if it
/// orders one) judged on the device's latest report and health verdict.
/// A device that has a health check succeeds only once the check passed.
/// (A time-out needs the cloud's clock of the change: it is judged there.)
pub fn outcome(
    generation: i64,
    firmware: Option<&str>,
    has_health_check: bool,
    report: Option<&DeviceReport>,
    health: Option<&HealthState>,
) -> Outcome {
    let Some(report) = report.filter(|r| r.applied_generation == generation) else {
        return Outcome::Open;
    };
    if report.firmware_failure.is_some() {
        return Outcome::Failed(FailureClass::InstallFailed);
    }
    if has_health_check {
        return match health
            .filter(|h| h.generation == generation)
            .map(|h| h.stage)
        {
            Some(HealthStage::Failed) => Outcome::Failed(FailureClass::HealthFailed),
            Some(HealthStage::Passed) => Outcome::Succeeded,
            _ => Outcome::Open,
        };
    }
    let runs_it = firmware.is_none_or(|f| report.firmware_version.as_deref() == Some(f));
    match runs_it {
        true => Outcome::Succeeded,
        false => Outcome::Open,
    }
}

/// A site that crossed its threshold: the members to roll back now, and
/// why.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Verdict {
    /// Indices into the outcomes judged.
    pub roll_back: Vec<usize>,
    /// For people.
    pub message: String,
}

/// Judges the members of one rollout at one site. Members rolled back
/// already count as failed (each was, or its site crossed the threshold);
/// `None` while the threshold holds or nothing is left to roll back.
pub fn judge(plan: &SiteRollback, outcomes: &[Outcome]) -> Option<Verdict> {
    let t = &plan.threshold;
    let counts = |c: &FailureClass| t.classes.is_empty() || t.classes.contains(c);
    let (mut sample, mut failed) = (0u32, 0u32);
    for o in outcomes {
        match o {
            Outcome::Open => {}
            Outcome::Succeeded => sample += 1,
            Outcome::Failed(c) => {
                sample += 1;
                failed += u32::from(counts(c));
            }
            Outcome::RolledBack => {
                sample += 1;
                failed += 1;
            }
        }
    }
    if !crossed(failed, sample, t.percent, t.min_sample) {
        return None;
    }
    let roll_back: Vec<usize> = outcomes
        .iter()
        .enumerate()
        .filter(|(_, o)| match o {
            Outcome::RolledBack => false,
            Outcome::Failed(_) => true,
            Outcome::Open | Outcome::Succeeded => t.whole_site,
        })
        .map(|(i, _)| i)
        .collect();
    if roll_back.is_empty() {
        return None;
    }
    Some(Verdict {
        roll_back,
        message: format!(
            "rollout {}: {failed} of {sample} finished devices at this site failed (threshold {}%, minimum sample {}); rolled back by the site's agent while the cloud was unreachable",
            plan.rollout, t.percent, t.min_sample
        ),
    })
}

/// What a device rolled back at the edge is told: `current` with what the
/// rollout replaced put back, under the generation before the rollout's.
pub fn put_back(current: &DesiredState, previous: &Previous) -> DesiredState {
    let mut state = current.clone();
    state.generation = (current.generation - 1).max(1);
    if previous.firmware_changed {
        state.firmware = previous.firmware.as_ref().map(|f| FirmwareOrder {
            version: f.version.clone(),
            url: f.url.clone(),
            sha256: f.sha256.clone(),
        });
    }
    for (name, before) in &previous.properties {
        match before {
            Some(value) => state.properties.insert(name.clone(), value.clone()),
            None => state.properties.remove(name),
        };
    }
    state
}

#[cfg(test)]
mod tests {
    use std::collections::BTreeMap;

    use super::*;
    use crate::PropertyValue;
    use crate::api::device::FirmwareSpec;
    use crate::codec::FirmwareFailure;

    fn plan(whole_site: bool) -> SiteRollback {
        SiteRollback {
            rollout: "fw-2".into(),
            rollout_uid: "u".into(),
            threshold: SiteThreshold {
                percent: 50,
                min_sample: 2,
                classes: vec![FailureClass::HealthFailed],
                whole_site,
            },
            previous: Previous::default(),
        }
    }

    fn report(generation: i64, firmware: &str) -> DeviceReport {
        DeviceReport {
            applied_generation: generation,
            properties: BTreeMap::new(),
            firmware_version: Some(firmware.into()),
            firmware_failure: None,
        }
    }

    fn health(generation: i64, stage: HealthStage) -> HealthState {
        HealthState {
            generation,
            stage,
            since_ms: 0,
            message: String::new(),
        }
    }

    #[test]
    fn an_update_is_judged_on_the_report_of_its_generation_and_the_agents_verdict() {
        let fw = Some("2.0.0");
        assert_eq!(outcome(4, fw, false, None, None), Outcome::Open);
        assert_eq!(
            outcome(4, fw, false, Some(&report(3, "1.0.0")), None),
            Outcome::Open
        );
        assert_eq!(
            outcome(4, fw, false, Some(&report(4, "1.0.0")), None),
            Outcome::Open,
            "applied but still installing"
        );
        assert_eq!(
            outcome(4, fw, false, Some(&report(4, "2.0.0")), None),
            Outcome::Succeeded
        );
        let mut failed = report(4, "1.0.0");
        failed.firmware_failure = Some(FirmwareFailure {
            version: "2.0.0".into(),
            reason: "checksum".into(),
        });
        assert_eq!(
            outcome(4, fw, true, Some(&failed), None),
            Outcome::Failed(FailureClass::InstallFailed)
        );
        let running = report(4, "2.0.0");
        let check = |h: HealthState| outcome(4, fw, true, Some(&running), Some(&h));
        assert_eq!(check(health(4, HealthStage::Baking)), Outcome::Open);
        assert_eq!(check(health(4, HealthStage::Passed)), Outcome::Succeeded);
        assert_eq!(
            check(health(4, HealthStage::Failed)),
            Outcome::Failed(FailureClass::HealthFailed)
        );
        assert_eq!(
            check(health(3, HealthStage::Failed)),
            Outcome::Open,
            "a verdict on another generation says nothing"
        );
    }

    #[test]
    fn a_site_is_rolled_back_once_enough_of_its_finished_devices_failed() {
        let failed = Outcome::Failed(FailureClass::HealthFailed);
        let plan = plan(false);
        assert_eq!(judge(&plan, &[failed, Outcome::Open, Outcome::Open]), None);
        assert_eq!(
            judge(
                &plan,
                &[
                    failed,
                    Outcome::Succeeded,
                    Outcome::Succeeded,
                    Outcome::Open
                ]
            ),
            None,
            "1 of 3 is under 50%"
        );
        let v = judge(&plan, &[failed, Outcome::Succeeded, Outcome::Open]).unwrap();
        assert_eq!(v.roll_back, vec![0], "only the failed one");
        assert!(v.message.contains("1 of 2"), "{}", v.message);
        let v = judge(
            &self::plan(true),
            &[failed, Outcome::Succeeded, Outcome::Open],
        )
        .unwrap();
        assert_eq!(v.roll_back, vec![0, 1, 2], "the whole site");
        // Failures of a class the threshold does not count.
        let install = Outcome::Failed(FailureClass::InstallFailed);
        assert_eq!(judge(&plan, &[install, install]), None);
        // What was rolled back counts; a later failure is rolled back too.
        let v = judge(&plan, &[Outcome::RolledBack, Outcome::Succeeded, failed]).unwrap();
        assert_eq!(v.roll_back, vec![2]);
        assert_eq!(
            judge(&plan, &[Outcome::RolledBack, Outcome::RolledBack]),
            None,
            "nothing left"
        );
    }

    #[test]
    fn putting_back_restores_what_the_rollout_replaced_under_the_generation_before() {
        let current = DesiredState {
            generation: 5,
            properties: BTreeMap::from([
                ("setpoint".to_owned(), PropertyValue::Float(19.5)),
                ("mode".to_owned(), PropertyValue::String("eco".into())),
                ("fan".to_owned(), PropertyValue::Bool(true)),
            ]),
            firmware: Some(FirmwareOrder {
                version: "2.0.0".into(),
                url: Some("https://fw/2".into()),
                sha256: None,
            }),
            local: 0,
        };
        let previous = Previous {
            firmware_changed: true,
            firmware: Some(FirmwareSpec {
                version: "1.0.0".into(),
                url: None,
                sha256: None,
            }),
            properties: BTreeMap::from([
                ("setpoint".to_owned(), Some(PropertyValue::Float(21.0))),
                ("mode".to_owned(), None),
            ]),
        };
        let back = put_back(&current, &previous);
        assert_eq!(back.generation, 4);
        assert_eq!(back.firmware.unwrap().version, "1.0.0");
        assert_eq!(
            back.properties,
            BTreeMap::from([
                ("setpoint".to_owned(), PropertyValue::Float(21.0)),
                ("fan".to_owned(), PropertyValue::Bool(true)),
            ])
        );
        let untouched = put_back(&current, &Previous::default());
        assert_eq!(untouched.firmware, current.firmware);
        assert_eq!(untouched.properties, current.properties);
    }
}
