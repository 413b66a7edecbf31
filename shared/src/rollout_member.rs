//! One Device's part in a rollout, without I/O: the change a rollout makes
//! to it, the record of what that change replaced, the undo, and the state
//! the Device is in as far as the rollout is concerned.
//!
//! The change and its record travel in one JSON merge patch: the spec gets
//! the target, and the annotation [`RECORD_ANNOTATION`] gets what the spec
//! had before. So a controller that dies between two writes can never have
//! changed a Device without knowing how to put it back, and a rollback
//! needs nothing but the Device.

use std::collections::BTreeMap;

use k8s_openapi::jiff::Timestamp;
use serde::{Deserialize, Serialize};
use serde_json::{Value, json};

use crate::PropertyValue;
use crate::api::device::{Device, DeviceSpec, FirmwareSpec, condition};
use crate::api::rollout::{
    FailureAction, FailureClass, FleetRollout, FleetRolloutSpec, RollbackScope, RolloutTarget,
    ThresholdScope,
};
use crate::health_check::HealthCheck;
use crate::rollout_plan::MemberState;
use crate::site_pacing::{SitePace, SitePacing};
use crate::site_rollback::SiteRollback;

/// The annotation of a Device that a rollout changed: a [`Record`] as JSON.
pub const RECORD_ANNOTATION: &str = "edgefleet.io/rollout";

/// How long a device may take to report the target when the rollout sets
/// no time-out (that of a health gate's default).
pub const DEFAULT_TIMEOUT_SECONDS: u32 = 1800;

/// Which rollout changed a Device, when, and what it replaced.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
#[serde(rename_all = "camelCase")]
pub struct Record {
    /// The FleetRollout's name.
    pub rollout: String,
    /// Its uid: a rollout deleted and created again is another one.
    pub uid: String,
    /// When the change was made (Unix milliseconds).
    pub changed_at_ms: i64,
    /// The generation the change made (the Device's generation before it,
    /// plus one: the change is conditional on that version).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub generation: Option<i64>,
    /// What the device's agent checks after the change.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub health: Option<HealthCheck>,
    /// The rollout's per-site failure threshold, if it rolls back on it:
    /// the device's agent judges its site by it while the cloud is away.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub site: Option<SiteThreshold>,
    /// The site's part of the plan, which the device's agent enforces
    /// too (see [`crate::site_pacing`]).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub pace: Option<SitePace>,
    /// What the change replaced.
    pub previous: Previous,
    /// Which attempt at the change this is: 1, then one more for each
    /// retry (see [`retry`]).
    #[serde(default = "first_attempt")]
    pub attempt: u32,
    /// Why the attempt before this one failed, if there was one.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub last_failure: Option<FailureClass>,
    /// The change was undone.
    #[serde(default, skip_serializing_if = "std::ops::Not::not")]
    pub rolled_back: bool,
}

fn first_attempt() -> u32 {
    1
}

/// A rollout's per-site failure threshold, as its records carry it.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "camelCase")]
pub struct SiteThreshold {
    /// See [`crate::api::rollout::FailureThreshold::percent`].
    pub percent: u8,
    /// See [`crate::api::rollout::FailureThreshold::min_sample`].
    pub min_sample: u32,
    /// See [`crate::api::rollout::FailureThreshold::classes`].
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub classes: Vec<FailureClass>,
    /// The rollback takes every device the rollout changed, not only the
    /// failed ones.
    #[serde(default)]
    pub whole_site: bool,
}

impl SiteThreshold {
    /// The first per-site threshold of `rollout`, if crossing it rolls
    /// back.
    pub fn of(rollout: &FleetRollout) -> Option<SiteThreshold> {
        let policy = &rollout.spec.failure_policy;
        if policy.action != FailureAction::Rollback {
            return None;
        }
        let t = policy
            .thresholds
            .iter()
            .find(|t| t.scope == ThresholdScope::Site)?;
        Some(SiteThreshold {
            percent: t.percent,
            min_sample: t.min_sample,
            classes: t.classes.clone(),
            whole_site: policy.rollback_scope != RollbackScope::Failed,
        })
    }
}

/// The part of a Device's spec a rollout replaced.
#[derive(Clone, Debug, Default, PartialEq, Serialize, Deserialize)]
#[serde(rename_all = "camelCase")]
pub struct Previous {
    /// Whether the rollout changed the firmware; `firmware` is then what
    /// was there (`None`: no firmware was set). Two fields, because JSON
    /// has one `null` for both "not changed" and "there was none".
    #[serde(default, skip_serializing_if = "std::ops::Not::not")]
    pub firmware_changed: bool,
    /// The firmware before.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub firmware: Option<FirmwareSpec>,
    /// The values before of the properties the rollout set (`None`: the
    /// property was not set).
    #[serde(default, skip_serializing_if = "BTreeMap::is_empty")]
    pub properties: BTreeMap<String, Option<PropertyValue>>,
}

/// The record on `device`, if any; an annotation that does not parse is
/// an error (someone edited it by hand).
pub fn record(device: &Device) -> Option<Result<Record, serde_json::Error>> {
    let text = device
        .metadata
        .annotations
        .as_ref()?
        .get(RECORD_ANNOTATION)?;
    Some(serde_json::from_str(text))
}

/// Whether the agent's health check of `device`'s current generation is
/// inconclusive: the rollout pauses on it.
pub fn inconclusive(device: &Device) -> bool {
    let generation = device.metadata.generation;
    device.status.as_ref().is_some_and(|s| {
        s.conditions.iter().any(|c| {
            c.type_ == condition::HEALTHY
                && c.reason == condition::HEALTH_CHECK_INCONCLUSIVE
                && c.observed_generation == generation
        })
    })
}

/// The record of the rollout whose change made `device`'s current
/// generation, unless that change was changed back.
fn current_record(device: &Device) -> Option<Record> {
    let record = record(device)?.ok()?;
    let current = record.generation.is_some() && record.generation == device.metadata.generation;
    (current && !record.rolled_back).then_some(record)
}

/// The health check a Device's agent runs for its current generation: the
/// one of the rollout whose change made that generation, unless it was
/// changed back.
pub fn health_check(device: &Device) -> Option<HealthCheck> {
    let record = current_record(device)?;
    record.health
}

/// What `device`'s agent is to put back on its own if its site crosses
/// the rollout's failure threshold while the cloud is away: for the
/// generation a rollout with a per-site rollback made, unless it was
/// changed back.
pub fn site_rollback(device: &Device) -> Option<SiteRollback> {
    let record = current_record(device)?;
    Some(SiteRollback {
        threshold: record.site?,
        rollout: record.rollout,
        rollout_uid: record.uid,
        previous: record.previous,
    })
}

/// How `device`'s agent paces the generation a rollout made at its site,
/// unless it was changed back.
pub fn site_pacing(device: &Device) -> Option<SitePacing> {
    let record = current_record(device)?;
    Some(SitePacing {
        pace: record.pace?,
        rollout: record.rollout,
        rollout_uid: record.uid,
    })
}

/// How long a member of a rollout with `spec` may take from its change to
/// an outcome before it counts as timed out, the bake time included.
pub fn timeout_seconds(spec: &FleetRolloutSpec) -> u32 {
    match &spec.health {
        Some(h) => h.timeout_seconds.saturating_add(h.bake_seconds),
        None => DEFAULT_TIMEOUT_SECONDS,
    }
}

/// Whether `device`'s agent rolled back the generation `record` made, on
/// its own (the Device's `RolledBack` condition of that generation).
fn rolled_back_at_edge(device: &Device, record: &Record) -> bool {
    device.status.as_ref().is_some_and(|s| {
        s.conditions.iter().any(|c| {
            c.type_ == condition::ROLLED_BACK
                && c.status == "True"
                && record.generation.is_some()
                && c.observed_generation == record.generation
        })
    })
}

/// Whether `spec` carries the target.
pub fn carries(spec: &DeviceSpec, target: &RolloutTarget) -> bool {
    target
        .firmware
        .as_ref()
        .is_none_or(|f| spec.firmware.as_ref() == Some(f))
        && target
            .properties
            .iter()
            .all(|(name, value)| spec.desired.get(name) == Some(value))
}

/// Whether the device reports running its current spec: it applied the
/// current generation, and runs the target firmware if there is one.
fn applied(device: &Device, target: &RolloutTarget) -> bool {
    let Some(status) = &device.status else {
        return false;
    };
    let generation = device.metadata.generation.unwrap_or(0);
    status.applied_generation.is_some_and(|a| a >= generation)
        && target
            .firmware
            .as_ref()
            .is_none_or(|f| status.firmware_version.as_deref() == Some(f.version.as_str()))
}

/// The merge patch that gives `device` the target of `rollout` and records
/// what it replaced, and `pace`, the site's part of the plan. `None` if the
/// Device carries the target already.
pub fn change(
    device: &Device,
    rollout: &FleetRollout,
    pace: Option<SitePace>,
    now_ms: i64,
) -> Option<Value> {
    let target = &rollout.spec.target;
    if carries(&device.spec, target) {
        return None;
    }
    let previous = Previous {
        firmware_changed: target.firmware.is_some(),
        firmware: device
            .spec
            .firmware
            .clone()
            .filter(|_| target.firmware.is_some()),
        properties: target
            .properties
            .keys()
            .map(|name| (name.clone(), device.spec.desired.get(name).cloned()))
            .collect(),
    };
    let record = Record {
        rollout: rollout.metadata.name.clone().unwrap_or_default(),
        uid: rollout.metadata.uid.clone().unwrap_or_default(),
        changed_at_ms: now_ms,
        generation: device.metadata.generation.map(|g| g + 1),
        health: rollout.spec.health.as_ref().map(|h| HealthCheck {
            rollout: rollout.metadata.name.clone().unwrap_or_default(),
            expression: h.expression.clone(),
            bake_seconds: h.bake_seconds,
        }),
        site: SiteThreshold::of(rollout),
        pace,
        previous,
        attempt: 1,
        last_failure: None,
        rolled_back: false,
    };
    let mut spec = json!({});
    if let Some(firmware) = &target.firmware {
        spec["firmware"] = firmware_patch(Some(firmware));
    }
    if !target.properties.is_empty() {
        spec["desired"] = json!(target.properties);
    }
    Some(json!({
        "metadata": { "annotations": { RECORD_ANNOTATION: serde_json::to_string(&record).expect("records serialize") } },
        "spec": spec,
    }))
}

/// Whether a member that failed for `class` on attempt `attempt` is tried
/// again under a failure policy allowing `retries`: an install that failed
/// or timed out is, a device that failed the health gate is not (it runs
/// the update, and it is the update that is unhealthy).
pub fn retryable(class: Option<FailureClass>, attempt: u32, retries: u32) -> bool {
    matches!(
        class,
        Some(FailureClass::InstallFailed | FailureClass::TimedOut)
    ) && attempt <= retries
}

/// The merge patch that has `device`, changed by the rollout `record`
/// describes and failed for `class`, try again: its spec's `retry`
/// counter is raised (a new generation, so its agent sends the same
/// desired state again and the device installs anew), and the record
/// counts the attempt, keeps why the last one failed and starts the
/// time-out over. What the change replaced stays as it was.
pub fn retry(device: &Device, record: &Record, class: FailureClass, now_ms: i64) -> Value {
    let again = Record {
        changed_at_ms: now_ms,
        generation: device.metadata.generation.map(|g| g + 1),
        attempt: record.attempt + 1,
        last_failure: Some(class),
        ..record.clone()
    };
    json!({
        "metadata": { "annotations": { RECORD_ANNOTATION: serde_json::to_string(&again).expect("records serialize") } },
        "spec": { "retry": device.spec.retry + 1 },
    })
}

/// The merge patch that puts back what `record` says a rollout replaced,
/// and marks the record rolled back.
pub fn undo(record: &Record) -> Value {
    let mut spec = json!({});
    if record.previous.firmware_changed {
        // `null` removes the firmware the rollout added.
        spec["firmware"] = firmware_patch(record.previous.firmware.as_ref());
    }
    if !record.previous.properties.is_empty() {
        spec["desired"] = json!(record.previous.properties);
    }
    let undone = Record {
        rolled_back: true,
        ..record.clone()
    };
    json!({
        "metadata": { "annotations": { RECORD_ANNOTATION: serde_json::to_string(&undone).expect("records serialize") } },
        "spec": spec,
    })
}

/// `firmware` as a merge patch replacing whatever firmware there is: a
/// field it lacks is `null`, so no url or digest of the old image stays
/// behind next to a new version.
fn firmware_patch(firmware: Option<&FirmwareSpec>) -> Value {
    match firmware {
        None => Value::Null,
        Some(f) => json!({ "version": f.version, "url": f.url, "sha256": f.sha256 }),
    }
}

/// Where `device` stands in `rollout` at `now`, and why it failed if it
/// did. A Device the rollout never changed is `Pending`, or `Succeeded` at
/// once if it runs the target already; one another rollout changed is
/// `Pending` for this one.
///
/// After a change: `RolledBack` once it was changed back (by the
/// controller, or by its agent on its own: see [`crate::site_rollback`]);
/// `Failed` (install failed) once the device says its
/// update failed; `Failed` (timed out) if it has not reported the target
/// within the time-out; `Updating` until then. Once it reports the target:
/// `Succeeded` without a health gate; with one, what its agent's check says
/// (the `Healthy` condition of this generation): `Baking` until the agent
/// passes it (`Succeeded`) or fails it (`Failed`, health), or `Failed`
/// (timed out) without a verdict by the time-out plus the bake time.
pub fn state(
    device: &Device,
    rollout: &FleetRollout,
    now: Timestamp,
) -> (MemberState, Option<FailureClass>) {
    let target = &rollout.spec.target;
    let mine = match record(device) {
        Some(Ok(r)) => Some(r).filter(|r| Some(&r.uid) == rollout.metadata.uid.as_ref()),
        Some(Err(_)) | None => None,
    };
    let Some(record) = mine else {
        let done = carries(&device.spec, target) && applied(device, target);
        let state = if done {
            MemberState::Succeeded
        } else {
            MemberState::Pending
        };
        return (state, None);
    };
    if record.rolled_back || rolled_back_at_edge(device, &record) {
        return (MemberState::RolledBack, None);
    }
    let generation = device.metadata.generation.unwrap_or(0);
    let conditions = device
        .status
        .as_ref()
        .map(|s| s.conditions.as_slice())
        .unwrap_or_default();
    let current = |type_: &str| {
        conditions.iter().find(|c| {
            c.type_ == type_ && c.status == "True" && c.observed_generation == Some(generation)
        })
    };
    if current(condition::UPDATE_FAILED).is_some() {
        return (MemberState::Failed, Some(FailureClass::InstallFailed));
    }
    let health = rollout.spec.health.as_ref();
    let timeout_ms =
        i64::from(health.map_or(DEFAULT_TIMEOUT_SECONDS, |h| h.timeout_seconds)) * 1000;
    if applied(device, target) {
        let Some(health) = health else {
            return (MemberState::Succeeded, None);
        };
        // The agent's verdict on this generation.
        let verdict = conditions
            .iter()
            .find(|c| c.type_ == condition::HEALTHY && c.observed_generation == Some(generation));
        return match verdict.map(|c| c.status.as_str()) {
            Some("True") => (MemberState::Succeeded, None),
            Some("False") => (MemberState::Failed, Some(FailureClass::HealthFailed)),
            // No verdict long past the bake time: the device went silent.
            _ if now.as_millisecond() - record.changed_at_ms
                > timeout_ms + i64::from(health.bake_seconds) * 1000 =>
            {
                (MemberState::Failed, Some(FailureClass::TimedOut))
            }
            _ => (MemberState::Baking, None),
        };
    }
    if now.as_millisecond() - record.changed_at_ms > timeout_ms {
        return (MemberState::Failed, Some(FailureClass::TimedOut));
    }
    (MemberState::Updating, None)
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::api::device::{DeviceStatus, Transport};
    use crate::api::rollout::{FleetRolloutSpec, HealthGate};
    use k8s_openapi::apimachinery::pkg::apis::meta::v1::{Condition, LabelSelector, Time};

    fn firmware(version: &str) -> FirmwareSpec {
        FirmwareSpec {
            version: version.into(),
            url: None,
            sha256: None,
        }
    }

    fn device() -> Device {
        let mut d = Device::new(
            "t1",
            DeviceSpec {
                node: "edge-1".into(),
                model: "thermostat".into(),
                transport: Transport::Coap,
                desired: BTreeMap::from([("setpoint".to_owned(), PropertyValue::Float(21.0))]),
                firmware: Some(firmware("1.0.0")),
                retry: 0,
            },
        );
        d.metadata.generation = Some(3);
        d.status = Some(DeviceStatus {
            applied_generation: Some(3),
            firmware_version: Some("1.0.0".into()),
            ..Default::default()
        });
        d
    }

    fn rollout(bake_seconds: u32) -> FleetRollout {
        let mut r = FleetRollout::new(
            "fw-2",
            FleetRolloutSpec {
                target: RolloutTarget {
                    firmware: Some(firmware("2.0.0")),
                    properties: BTreeMap::from([
                        ("setpoint".to_owned(), PropertyValue::Float(19.5)),
                        ("mode".to_owned(), PropertyValue::String("eco".into())),
                    ]),
                },
                selector: LabelSelector::default(),
                node_selector: None,
                membership: Default::default(),
                strategy: Default::default(),
                health: Some(HealthGate {
                    expression: "online".into(),
                    bake_seconds,
                    timeout_seconds: 600,
                }),
                failure_policy: Default::default(),
                offline: Default::default(),
                paused: false,
                abort: false,
            },
        );
        r.metadata.uid = Some("rollout-uid".into());
        r
    }

    /// Applies a JSON merge patch to a Device, as the API server would.
    fn patched(device: &Device, patch: &Value) -> Device {
        let mut doc = serde_json::to_value(device).unwrap();
        json_merge(&mut doc, patch);
        serde_json::from_value(doc).unwrap()
    }

    fn json_merge(doc: &mut Value, patch: &Value) {
        match (doc, patch) {
            (Value::Object(d), Value::Object(p)) => {
                for (k, v) in p {
                    if v.is_null() {
                        d.remove(k);
                    } else {
                        json_merge(d.entry(k.clone()).or_insert(Value::Null), v);
                    }
                }
            }
            (doc, patch) => *doc = patch.clone(),
        }
    }

    fn at(ms: i64) -> Timestamp {
        Timestamp::from_millisecond(ms).unwrap()
    }

    /// The device reports running generation `g` with `fw`, applied at `ms`.
    fn reports(device: &mut Device, g: i64, fw: &str, ms: i64) {
        let status = device.status.get_or_insert_default();
        status.applied_generation = Some(g);
        status.firmware_version = Some(fw.into());
        status.conditions = vec![Condition {
            type_: condition::APPLIED.into(),
            status: "True".into(),
            reason: "DeviceApplied".into(),
            message: String::new(),
            observed_generation: Some(g),
            last_transition_time: Time(at(ms)),
        }];
    }

    #[test]
    fn a_change_and_its_undo_put_the_spec_back_exactly() {
        let before = device();
        let r = rollout(60);
        let patch = change(&before, &r, None, 1_000).unwrap();
        let after = patched(&before, &patch);
        assert!(carries(&after.spec, &r.spec.target));
        let rec = record(&after).unwrap().unwrap();
        assert!(rec.previous.firmware_changed);
        assert_eq!(rec.previous.firmware, Some(firmware("1.0.0")));
        assert_eq!(
            rec.previous.properties,
            BTreeMap::from([
                ("mode".to_owned(), None),
                ("setpoint".to_owned(), Some(PropertyValue::Float(21.0))),
            ])
        );
        assert_eq!(
            change(&after, &r, None, 2_000),
            None,
            "it carries the target"
        );
        let undone = patched(&after, &undo(&rec));
        assert_eq!(
            undone.spec, before.spec,
            "mode removed, setpoint and firmware back"
        );
        assert!(record(&undone).unwrap().unwrap().rolled_back);
    }

    /// A merge patch merges objects: a target without a url must not leave
    /// the old image's url and digest next to the new version.
    #[test]
    fn no_url_or_digest_of_the_old_firmware_stays_behind() {
        let mut before = device();
        before.spec.firmware = Some(FirmwareSpec {
            version: "1.0.0".into(),
            url: Some("https://firmware.example/1.0.0.bin".into()),
            sha256: Some("0".repeat(64)),
        });
        let r = rollout(60);
        let after = patched(&before, &change(&before, &r, None, 1).unwrap());
        assert_eq!(after.spec.firmware, Some(firmware("2.0.0")));
        let rec = record(&after).unwrap().unwrap();
        let undone = patched(&after, &undo(&rec));
        assert_eq!(undone.spec.firmware, before.spec.firmware);
        // A device that had no firmware set gets none back.
        let mut bare = device();
        bare.spec.firmware = None;
        let after = patched(&bare, &change(&bare, &r, None, 1).unwrap());
        let undone = patched(&after, &undo(&record(&after).unwrap().unwrap()));
        assert_eq!(undone.spec.firmware, None);
    }

    #[test]
    fn a_device_moves_from_pending_to_succeeded_through_updating_and_baking() {
        let r = rollout(60);
        let mut d = device();
        assert_eq!(state(&d, &r, at(0)), (MemberState::Pending, None));
        d = patched(&d, &change(&d, &r, None, 1_000).unwrap());
        d.metadata.generation = Some(4);
        assert_eq!(state(&d, &r, at(2_000)), (MemberState::Updating, None));
        reports(&mut d, 4, "2.0.0", 5_000);
        assert_eq!(state(&d, &r, at(6_000)), (MemberState::Baking, None));
        assert_eq!(
            state(&d, &r, at(65_000)),
            (MemberState::Baking, None),
            "the bake time is the agent's to count"
        );
        healthy(&mut d, 4, "Unknown", condition::HEALTH_CHECK_INCONCLUSIVE);
        assert!(inconclusive(&d));
        assert_eq!(state(&d, &r, at(66_000)), (MemberState::Baking, None));
        healthy(&mut d, 3, "True", condition::HEALTH_CHECK_PASSED);
        assert_eq!(
            state(&d, &r, at(66_000)),
            (MemberState::Baking, None),
            "a verdict on another generation"
        );
        healthy(&mut d, 4, "True", condition::HEALTH_CHECK_PASSED);
        assert_eq!(state(&d, &r, at(66_000)), (MemberState::Succeeded, None));
        healthy(&mut d, 4, "False", condition::HEALTH_CHECK_FAILED);
        assert_eq!(
            state(&d, &r, at(66_000)),
            (MemberState::Failed, Some(FailureClass::HealthFailed))
        );
    }

    #[test]
    fn without_a_health_gate_reporting_the_target_is_success_and_a_silent_baker_times_out() {
        let mut r = rollout(60);
        r.spec.health = None;
        let mut d = device();
        d = patched(&d, &change(&d, &r, None, 1_000).unwrap());
        d.metadata.generation = Some(4);
        reports(&mut d, 4, "2.0.0", 5_000);
        assert_eq!(state(&d, &r, at(5_000)), (MemberState::Succeeded, None));
        let r = rollout(60);
        assert_eq!(
            state(&d, &r, at(1_000 + 600_000 + 60_001)),
            (MemberState::Failed, Some(FailureClass::TimedOut))
        );
    }

    /// The agent's check of generation `g` says `status` for `reason`.
    fn healthy(device: &mut Device, g: i64, status: &str, reason: &str) {
        let conditions = &mut device.status.get_or_insert_default().conditions;
        conditions.retain(|c| c.type_ != condition::HEALTHY);
        conditions.push(Condition {
            type_: condition::HEALTHY.into(),
            status: status.into(),
            reason: reason.into(),
            message: String::new(),
            observed_generation: Some(g),
            last_transition_time: Time(at(0)),
        });
    }

    #[test]
    fn silence_past_the_time_out_and_an_install_failure_are_failures_of_their_class() {
        let r = rollout(0);
        let mut d = device();
        d = patched(&d, &change(&d, &r, None, 1_000).unwrap());
        d.metadata.generation = Some(4);
        assert_eq!(
            state(&d, &r, at(1_000 + 600_001)),
            (MemberState::Failed, Some(FailureClass::TimedOut))
        );
        fail_install(&mut d, 4);
        assert_eq!(
            state(&d, &r, at(4_000)),
            (MemberState::Failed, Some(FailureClass::InstallFailed))
        );
    }

    #[test]
    fn a_retry_gives_a_new_generation_a_fresh_time_out_and_keeps_what_to_put_back() {
        let before = device();
        let r = rollout(0);
        let mut d = patched(&before, &change(&before, &r, None, 1_000).unwrap());
        d.metadata.generation = Some(4);
        fail_install(&mut d, 4);
        assert_eq!(
            state(&d, &r, at(2_000)),
            (MemberState::Failed, Some(FailureClass::InstallFailed))
        );
        let first = record(&d).unwrap().unwrap();
        assert_eq!(first.attempt, 1);
        assert!(retryable(
            Some(FailureClass::InstallFailed),
            first.attempt,
            1
        ));
        assert!(!retryable(
            Some(FailureClass::InstallFailed),
            first.attempt,
            0
        ));
        assert!(!retryable(
            Some(FailureClass::HealthFailed),
            first.attempt,
            5
        ));

        let again = patched(&d, &retry(&d, &first, FailureClass::InstallFailed, 700_000));
        assert_eq!(again.spec.retry, 1, "a spec change: a new generation");
        let mut again = again;
        again.metadata.generation = Some(5);
        let second = record(&again).unwrap().unwrap();
        assert_eq!(second.attempt, 2);
        assert_eq!(second.generation, Some(5));
        assert_eq!(second.last_failure, Some(FailureClass::InstallFailed));
        assert_eq!(second.previous, first.previous);
        // The failure of generation 4 is the past; the time-out counts anew
        // (a first attempt's would have run out at 601,000).
        assert_eq!(
            state(&again, &r, at(800_000)),
            (MemberState::Updating, None)
        );
        assert!(!retryable(Some(FailureClass::TimedOut), second.attempt, 1));
        // Undone, the spec is what it was but for the counter.
        let undone = patched(&again, &undo(&second));
        assert_eq!(
            DeviceSpec {
                retry: 0,
                ..undone.spec
            },
            before.spec
        );
    }

    fn fail_install(device: &mut Device, g: i64) {
        device.status.get_or_insert_default().conditions = vec![Condition {
            type_: condition::UPDATE_FAILED.into(),
            status: "True".into(),
            reason: "InstallFailed".into(),
            message: String::new(),
            observed_generation: Some(g),
            last_transition_time: Time(at(1_500)),
        }];
    }

    #[test]
    fn a_device_at_the_target_already_is_done_and_another_rollouts_device_waits() {
        let r = rollout(60);
        let mut d = device();
        d.spec.firmware = Some(firmware("2.0.0"));
        d.spec
            .desired
            .insert("setpoint".into(), PropertyValue::Float(19.5));
        d.spec
            .desired
            .insert("mode".into(), PropertyValue::String("eco".into()));
        reports(&mut d, 3, "2.0.0", 0);
        assert_eq!(state(&d, &r, at(1)), (MemberState::Succeeded, None));

        let mut other = rollout(60);
        other.metadata.uid = Some("another".into());
        let d = patched(&device(), &change(&device(), &other, None, 1_000).unwrap());
        assert_eq!(state(&d, &r, at(2_000)), (MemberState::Pending, None));
    }
}
