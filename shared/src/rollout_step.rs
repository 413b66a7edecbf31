//! One step of a rollout, decided from its members alone: which devices to
//! change now, which to change back, and what the rollout's status says.
//!
//! Pure, so the rules — stages and limits (through [`Plan`]), failure
//! thresholds, the actions they trigger, `paused`, `abort` and the offline
//! policy — are tested without an API server, and the same step can run
//! wherever the members are known. Nothing here remembers anything: every
//! decision is taken again from the members' states at every step, so a
//! controller that restarts mid-rollout goes on where the Devices say it is.
//! The one fact a step must not forget — that a rollback began — is written
//! on the Devices themselves (their record says "rolled back"), so it is
//! derived like the rest.

use std::collections::BTreeSet;

use crate::api::rollout::{
    FailureAction, FailureClass, FleetRolloutSpec, OfflineAction, RollbackScope, RolloutPhase,
    ThresholdScope,
};
use crate::rollout_member::timeout_seconds;
use crate::rollout_plan::{Member, MemberState, Plan, Summary};
use crate::site_pacing::SitePace;

/// What a step knows of one member.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct MemberInput {
    /// Its failure domain (site).
    pub domain: Option<String>,
    /// Its state, from the Device ([`crate::rollout_member::state`]).
    pub state: MemberState,
    /// Why it failed, if it did.
    pub class: Option<FailureClass>,
    /// Whether this rollout changed it and has not changed it back (the
    /// Device carries this rollout's record, not marked rolled back).
    pub changed: bool,
    /// Whether the device applied its current spec (for a rolled-back
    /// member: it runs what it had before).
    pub settled: bool,
    /// How long its node has been unreachable (milliseconds), `None` while
    /// it is reachable.
    pub away_ms: Option<i64>,
    /// Its agent could not judge its health (the rollout pauses).
    pub inconclusive: bool,
    /// It joined after the rollout started (Dynamic membership).
    pub late: bool,
    /// It failed, and is to be tried again
    /// ([`crate::rollout_member::retryable`]): the plan sees it pending,
    /// so a retry waits for a place within the limits like a first start.
    pub retry: bool,
}

/// A condition as a step wants it; the caller keeps transition times.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct WantedCondition {
    /// `Progressing`, `Paused`, `Degraded`, `Complete` or `RolledBack`.
    pub type_: &'static str,
    /// Whether it holds.
    pub status: bool,
    /// Why (PascalCase).
    pub reason: &'static str,
    /// For people.
    pub message: String,
}

/// A failure threshold that was crossed.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Breach {
    /// Where: `overall`, `wave 2`, `site plant-a`.
    pub scope: String,
    /// Failed members counted (of the threshold's classes).
    pub failed: u32,
    /// Members with an outcome (succeeded or failed) in that scope.
    pub sample: u32,
    /// The threshold.
    pub percent: u8,
}

impl std::fmt::Display for Breach {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(
            f,
            "{} of {} devices failed in {} (threshold {}%)",
            self.failed, self.sample, self.scope, self.percent
        )
    }
}

/// What to do now.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Step {
    /// Members to change now (indices into the input), in plan order.
    pub start: Vec<usize>,
    /// For each member in `start`, its site's part of the plan, which its
    /// agent enforces too (`None` without failure domains, or for a member
    /// with no site).
    pub pace: Vec<Option<SitePace>>,
    /// Members to change back now.
    pub roll_back: Vec<usize>,
    /// The phase.
    pub phase: RolloutPhase,
    /// The stage in progress, for people: `canary`, `wave 2/3`.
    pub wave: Option<String>,
    /// Counts overall, per stage, per site.
    pub summary: Summary,
    /// The threshold crossed, if one is.
    pub breach: Option<Breach>,
    /// The conditions.
    pub conditions: Vec<WantedCondition>,
}

/// Decides the step of a rollout with `spec` over `members` (in a stable
/// order: the plan interleaves them by domain in this order).
pub fn step(spec: &FleetRolloutSpec, members: &[MemberInput]) -> Step {
    let view: Vec<Member> = members.iter().map(|m| view(spec, m)).collect();
    let Some(plan) = Plan::new(&spec.strategy, &view) else {
        // The schema admits only shares the planner resolves; an object
        // written past it is shown as invalid, and nothing moves.
        return Step {
            start: Vec::new(),
            pace: Vec::new(),
            roll_back: Vec::new(),
            phase: RolloutPhase::Invalid,
            wave: None,
            summary: Summary::default(),
            breach: None,
            conditions: vec![progressing(
                false,
                "InvalidStrategy",
                "the strategy has a share that is not a count or a percentage".into(),
            )],
        };
    };
    let summary = plan.summary(&view);
    let classes: Vec<Option<FailureClass>> = members.iter().map(|m| m.class).collect();
    let breach = judge(spec, &plan, &view, &classes);
    let rolled_back = view.iter().any(|m| m.state == MemberState::RolledBack);
    let rolling_back = spec.abort
        || rolled_back
        || (breach.is_some() && spec.failure_policy.action == FailureAction::Rollback);
    let open = plan.open_stage(&view);
    let wave = (open < plan.stages).then(|| stage_name(open, plan.stages));
    let mut step = Step {
        start: Vec::new(),
        pace: Vec::new(),
        roll_back: Vec::new(),
        phase: RolloutPhase::Progressing,
        wave,
        summary,
        breach,
        conditions: Vec::new(),
    };
    let degraded = match &step.breach {
        Some(b) => degraded(true, "FailureThreshold", b.to_string()),
        None if step.summary.overall.failed > 0 => degraded(
            false,
            "FailuresBelowThreshold",
            format!(
                "{} devices failed, below every threshold",
                step.summary.overall.failed
            ),
        ),
        None => degraded(false, "NoFailures", "no device failed".into()),
    };
    if rolling_back {
        step.roll_back = roll_back_set(spec, &plan, &view, members, open);
        let unsettled = members
            .iter()
            .zip(&view)
            .any(|(m, v)| v.state == MemberState::RolledBack && !m.settled);
        let at_edge = members
            .iter()
            .zip(&view)
            .filter(|(m, v)| m.changed && v.state == MemberState::RolledBack)
            .count();
        let why = if spec.abort {
            ("Aborted", "aborted by spec.abort".to_owned())
        } else if at_edge > 0 {
            (
                "RolledBackAtEdge",
                format!(
                    "the agents of a site that crossed its failure threshold while the cloud was unreachable rolled back {at_edge} devices on their own (see the Devices' RolledBack condition)"
                ),
            )
        } else {
            match &step.breach {
                Some(b) => ("FailureThreshold", b.to_string()),
                // The cause is gone with the change: the caller keeps the
                // reason it showed when the rollback began.
                None => ("RolledBack", "a rollback began earlier".to_owned()),
            }
        };
        let done = step.roll_back.is_empty() && !unsettled;
        step.phase = match done {
            true => RolloutPhase::RolledBack,
            false => RolloutPhase::RollingBack,
        };
        step.wave = None;
        step.conditions = vec![
            progressing(false, why.0, why.1.clone()),
            paused(false, "NotPaused", String::new()),
            degraded.clone(),
            complete(false, "RolledBack", "the rollout was rolled back".into()),
            WantedCondition {
                type_: "RolledBack",
                status: true,
                reason: why.0,
                message: why.1,
            },
        ];
        return step;
    }
    let not_rolled_back = WantedCondition {
        type_: "RolledBack",
        status: false,
        reason: "NotRolledBack",
        message: String::new(),
    };
    if view.is_empty() {
        step.phase = RolloutPhase::Pending;
        step.conditions = vec![
            progressing(false, "NoDevices", "no Device matches the selector".into()),
            paused(false, "NotPaused", String::new()),
            degraded,
            complete(false, "NoDevices", "no Device matches the selector".into()),
            not_rolled_back,
        ];
        return step;
    }
    let unsure = members.iter().filter(|m| m.inconclusive).count();
    let pause = if spec.paused {
        Some(("PausedBySpec", "spec.paused is set".to_owned()))
    } else if let Some(b) = &step.breach {
        Some((
            "FailureThreshold",
            format!("{b}; change the thresholds to go on, or abort"),
        ))
    } else {
        (unsure > 0).then(|| {
            (
                "HealthInconclusive",
                format!(
                    "the health check of {unsure} devices is inconclusive (see their Healthy condition); fix the expression or the devices, or abort"
                ),
            )
        })
    };
    if let Some((reason, message)) = pause {
        step.phase = RolloutPhase::Paused;
        step.conditions = vec![
            progressing(false, reason, message.clone()),
            paused(true, reason, message),
            degraded,
            complete(false, "Paused", String::new()),
            not_rolled_back,
        ];
        return step;
    }
    let finished = view.iter().all(|m| m.state.done());
    if finished {
        step.phase = RolloutPhase::Complete;
        step.wave = None;
        let c = &step.summary.overall;
        let message = format!(
            "{} updated, {} failed, {} skipped of {}",
            c.succeeded, c.failed, c.skipped, c.total
        );
        step.conditions = vec![
            progressing(false, "Complete", message.clone()),
            paused(false, "NotPaused", String::new()),
            degraded,
            complete(true, "AllDevicesDone", message),
            not_rolled_back,
        ];
        return step;
    }
    step.start = plan.to_start(&view);
    step.pace = step
        .start
        .iter()
        .map(|&i| site_pace(spec, &plan, &view, i))
        .collect();
    let waiting = view
        .iter()
        .filter(|m| !m.reachable && !m.state.done())
        .count();
    let (reason, message) = match step.wave.as_deref() {
        None => (
            "WaitingForUnreachable",
            format!("{waiting} devices wait for their node to come back"),
        ),
        Some(wave) => ("Progressing", format!("{wave} in progress")),
    };
    step.conditions = vec![
        progressing(true, reason, message),
        paused(false, "NotPaused", String::new()),
        degraded,
        complete(false, "Progressing", String::new()),
        not_rolled_back,
    ];
    step
}

/// The member as the planner sees it: the offline policy applied.
fn view(spec: &FleetRolloutSpec, m: &MemberInput) -> Member {
    let reachable = m.away_ms.is_none();
    let mut state = m.state;
    if m.retry && state == MemberState::Failed && reachable {
        state = MemberState::Pending;
    }
    // Not heard from because its node is away is not a failure.
    if !reachable && m.class == Some(FailureClass::TimedOut) {
        state = MemberState::Updating;
    }
    let waited_out = m
        .away_ms
        .is_some_and(|away| away >= i64::from(spec.offline.wait_up_to_seconds) * 1000);
    if waited_out && spec.offline.then == OfflineAction::Skip && state == MemberState::Pending {
        state = MemberState::Skipped;
    }
    Member {
        domain: m.domain.clone(),
        state,
        reachable,
        late: m.late,
    }
}

/// The first threshold crossed, in the order of the spec.
fn judge(
    spec: &FleetRolloutSpec,
    plan: &Plan,
    view: &[Member],
    classes: &[Option<FailureClass>],
) -> Option<Breach> {
    for t in &spec.failure_policy.thresholds {
        let counts = |i: usize| {
            let outcome = matches!(view[i].state, MemberState::Succeeded | MemberState::Failed);
            let failed = view[i].state == MemberState::Failed
                && (t.classes.is_empty() || classes[i].is_some_and(|c| t.classes.contains(&c)));
            (outcome, failed)
        };
        let groups: Vec<(String, Vec<usize>)> = match t.scope {
            ThresholdScope::Overall => vec![("overall".into(), (0..view.len()).collect())],
            ThresholdScope::Wave => (0..plan.stages)
                .map(|s| {
                    let name = stage_name(s, plan.stages);
                    (
                        name,
                        (0..view.len()).filter(|&i| plan.stage[i] == s).collect(),
                    )
                })
                .collect(),
            ThresholdScope::Site => {
                let sites: BTreeSet<&String> =
                    view.iter().filter_map(|m| m.domain.as_ref()).collect();
                sites
                    .into_iter()
                    .map(|site| {
                        let of = (0..view.len())
                            .filter(|&i| view[i].domain.as_ref() == Some(site))
                            .collect();
                        (format!("site {site}"), of)
                    })
                    .collect()
            }
        };
        for (scope, of) in groups {
            let (sample, failed) = of.iter().fold((0u32, 0u32), |(s, f), &i| {
                let (outcome, failed) = counts(i);
                (s + u32::from(outcome), f + u32::from(failed))
            });
            if crossed(failed, sample, t.percent, t.min_sample) {
                return Some(Breach {
                    scope,
                    failed,
                    sample,
                    percent: t.percent,
                });
            }
        }
    }
    None
}

/// Member `i`'s site's part of `plan`, if the rollout has failure domains
/// and the member a site.
fn site_pace(spec: &FleetRolloutSpec, plan: &Plan, view: &[Member], i: usize) -> Option<SitePace> {
    spec.strategy.failure_domain.as_ref()?;
    let site = view[i].domain.clone()?;
    let limit = plan.domain_max_unavailable[&view[i].domain];
    Some(SitePace {
        site,
        limit: u32::try_from(limit).unwrap_or(u32::MAX),
        canary: plan.domain_canary[i],
        timeout_seconds: timeout_seconds(spec),
    })
}

/// Whether `failed` of `sample` finished devices cross a threshold of
/// `percent` with `min_sample`: at least that share failed, and the sample
/// is large enough to judge.
pub fn crossed(failed: u32, sample: u32, percent: u8, min_sample: u32) -> bool {
    sample >= min_sample
        && failed > 0
        && u64::from(failed) * 100 >= u64::from(percent) * u64::from(sample)
}

/// The members to change back: of those this rollout changed, the failed
/// ones, those of the waves where something failed or was rolled back (or
/// the wave in progress, on abort), or all, per `rollbackScope`.
fn roll_back_set(
    spec: &FleetRolloutSpec,
    plan: &Plan,
    view: &[Member],
    members: &[MemberInput],
    open: usize,
) -> Vec<usize> {
    let scope = spec.failure_policy.rollback_scope;
    let mut waves: BTreeSet<usize> = (0..view.len())
        .filter(|&i| matches!(view[i].state, MemberState::Failed | MemberState::RolledBack))
        .map(|i| plan.stage[i])
        .collect();
    if spec.abort && open < plan.stages {
        waves.insert(open);
    }
    (0..view.len())
        .filter(|&i| members[i].changed)
        .filter(|&i| match scope {
            // Changed and rolled back: its agent rolled it back on its own
            // (the Device's spec follows).
            // A failure awaiting its retry is a failure here.
            RollbackScope::Failed => {
                matches!(view[i].state, MemberState::Failed | MemberState::RolledBack)
                    || members[i].state == MemberState::Failed
            }
            RollbackScope::Wave => waves.contains(&plan.stage[i]),
            RollbackScope::All => true,
        })
        .collect()
}

/// A stage's name for people: `canary`, then `wave 1/N`.
pub fn stage_name(stage: usize, stages: usize) -> String {
    match stage {
        0 => "canary".into(),
        s => format!("wave {s}/{}", stages - 1),
    }
}

fn progressing(status: bool, reason: &'static str, message: String) -> WantedCondition {
    WantedCondition {
        type_: "Progressing",
        status,
        reason,
        message,
    }
}

fn paused(status: bool, reason: &'static str, message: String) -> WantedCondition {
    WantedCondition {
        type_: "Paused",
        status,
        reason,
        message,
    }
}

fn degraded(status: bool, reason: &'static str, message: String) -> WantedCondition {
    WantedCondition {
        type_: "Degraded",
        status,
        reason,
        message,
    }
}

fn complete(status: bool, reason: &'static str, message: String) -> WantedCondition {
    WantedCondition {
        type_: "Complete",
        status,
        reason,
        message,
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::api::rollout::{
        FailureDomain, FailurePolicy, FailureThreshold, OfflinePolicy, RolloutStrategy,
        RolloutTarget,
    };
    use k8s_openapi::apimachinery::pkg::apis::meta::v1::LabelSelector;
    use k8s_openapi::apimachinery::pkg::util::intstr::IntOrString;

    fn spec() -> FleetRolloutSpec {
        FleetRolloutSpec {
            target: RolloutTarget::default(),
            selector: LabelSelector::default(),
            node_selector: None,
            membership: Default::default(),
            strategy: RolloutStrategy {
                canary: IntOrString::Int(1),
                waves: vec![IntOrString::String("50%".into())],
                max_unavailable: IntOrString::Int(2),
                failure_domain: Some(FailureDomain {
                    topology_key: "site".into(),
                    max_unavailable: IntOrString::Int(2),
                    canary: IntOrString::Int(0),
                }),
            },
            health: None,
            failure_policy: FailurePolicy {
                thresholds: vec![FailureThreshold {
                    scope: ThresholdScope::Overall,
                    percent: 50,
                    min_sample: 2,
                    classes: Vec::new(),
                }],
                action: FailureAction::Pause,
                rollback_scope: RollbackScope::Failed,
                retries: 0,
            },
            offline: OfflinePolicy::default(),
            paused: false,
            abort: false,
        }
    }

    fn pending(n: usize) -> Vec<MemberInput> {
        (0..n)
            .map(|i| MemberInput {
                domain: Some(format!("s{}", i % 2)),
                state: MemberState::Pending,
                class: None,
                changed: false,
                settled: true,
                away_ms: None,
                inconclusive: false,
                late: false,
                retry: false,
            })
            .collect()
    }

    fn set(m: &mut MemberInput, state: MemberState, class: Option<FailureClass>) {
        m.state = state;
        m.class = class;
        m.changed = !matches!(state, MemberState::Pending | MemberState::RolledBack);
        m.settled = !matches!(state, MemberState::Updating);
    }

    fn condition(step: &Step, type_: &str) -> (bool, &'static str) {
        let c = step.conditions.iter().find(|c| c.type_ == type_).unwrap();
        (c.status, c.reason)
    }

    #[test]
    fn every_start_carries_its_sites_part_of_the_plan() {
        let mut spec = spec();
        let domain = spec.strategy.failure_domain.as_mut().unwrap();
        domain.canary = IntOrString::Int(1);
        // 8 members, 4 per site: at most 1 of each site at once.
        domain.max_unavailable = IntOrString::String("25%".into());
        let first = step(&spec, &pending(8));
        assert_eq!(first.start, [0]);
        let pace = first.pace[0].clone().expect("a site's part");
        assert_eq!(pace.site, "s0");
        assert_eq!((pace.limit, pace.canary), (1, true));
        assert_eq!(
            pace.timeout_seconds,
            crate::rollout_member::DEFAULT_TIMEOUT_SECONDS
        );
        let mut ms = pending(8);
        for m in ms.iter_mut().take(2) {
            set(m, MemberState::Succeeded, None);
        }
        let later = step(&spec, &ms);
        assert_eq!(later.start.len(), later.pace.len());
        assert!(
            later
                .pace
                .iter()
                .all(|p| p.as_ref().is_some_and(|p| !p.canary && p.limit == 1))
        );
        // Without failure domains nothing is paced at the site.
        spec.strategy.failure_domain = None;
        let plain = step(&spec, &pending(8));
        assert!(!plain.start.is_empty() && plain.pace.iter().all(Option::is_none));
    }

    #[test]
    fn a_rollout_starts_its_canary_then_goes_wave_by_wave_to_complete() {
        let mut ms = pending(8);
        let first = step(&spec(), &ms);
        assert_eq!(first.phase, RolloutPhase::Progressing);
        assert_eq!(first.wave.as_deref(), Some("canary"));
        assert_eq!(first.start, [0]);
        set(&mut ms[0], MemberState::Succeeded, None);
        let second = step(&spec(), &ms);
        assert_eq!(second.wave.as_deref(), Some("wave 1/2"));
        assert_eq!(second.start.len(), 2, "two at a time");
        for m in &mut ms {
            set(m, MemberState::Succeeded, None);
        }
        let last = step(&spec(), &ms);
        assert_eq!(last.phase, RolloutPhase::Complete);
        assert_eq!(condition(&last, "Complete"), (true, "AllDevicesDone"));
        assert!(last.start.is_empty());
    }

    #[test]
    fn a_failure_to_retry_waits_for_a_place_holds_its_stage_and_is_no_failure_yet() {
        let mut ms = pending(8);
        // The canary failed to install and has attempts left.
        set(
            &mut ms[0],
            MemberState::Failed,
            Some(FailureClass::InstallFailed),
        );
        ms[0].retry = true;
        let again = step(&spec(), &ms);
        assert_eq!(again.start, [0], "tried again");
        assert_eq!(again.wave.as_deref(), Some("canary"), "the wave waits");
        assert_eq!(again.summary.overall.failed, 0);
        assert_eq!(again.summary.overall.pending, 8);
        assert_eq!(again.breach, None);
        // At the limit (two updating in its site) it waits like a start.
        let mut s = spec();
        s.strategy.max_unavailable = IntOrString::Int(4);
        set(&mut ms[2], MemberState::Updating, None);
        set(&mut ms[4], MemberState::Updating, None);
        let full = step(&s, &ms);
        assert!(
            !full.start.contains(&0),
            "site s0 is full: {:?}",
            full.start
        );
        // Out of attempts, it is a failure like any other.
        ms[0].retry = false;
        let failed = step(&s, &ms);
        assert_eq!(failed.summary.overall.failed, 1);
        assert!(!failed.start.contains(&0));
    }

    #[test]
    fn a_rollback_of_the_failed_takes_a_failure_awaiting_its_retry() {
        let mut s = spec();
        s.abort = true;
        let mut ms = pending(8);
        set(&mut ms[0], MemberState::Succeeded, None);
        set(
            &mut ms[1],
            MemberState::Failed,
            Some(FailureClass::TimedOut),
        );
        ms[1].retry = true;
        let aborted = step(&s, &ms);
        assert_eq!(aborted.roll_back, [1]);
        assert!(aborted.start.is_empty());
    }

    #[test]
    fn an_inconclusive_health_check_pauses_the_rollout() {
        let mut ms = pending(4);
        set(&mut ms[0], MemberState::Baking, None);
        ms[0].inconclusive = true;
        let unsure = step(&spec(), &ms);
        assert_eq!(unsure.phase, RolloutPhase::Paused);
        assert!(unsure.start.is_empty());
        assert_eq!(condition(&unsure, "Paused"), (true, "HealthInconclusive"));
    }

    #[test]
    fn paused_starts_nothing_and_says_why() {
        let mut s = spec();
        s.paused = true;
        let paused = step(&s, &pending(4));
        assert_eq!(paused.phase, RolloutPhase::Paused);
        assert!(paused.start.is_empty());
        assert_eq!(condition(&paused, "Paused"), (true, "PausedBySpec"));
    }

    #[test]
    fn a_threshold_counts_only_once_the_sample_is_large_enough() {
        let mut ms = pending(8);
        set(
            &mut ms[0],
            MemberState::Failed,
            Some(FailureClass::InstallFailed),
        );
        let one = step(&spec(), &ms);
        assert_eq!(
            one.breach, None,
            "1 outcome is below the minimum sample of 2"
        );
        assert_eq!(
            condition(&one, "Degraded"),
            (false, "FailuresBelowThreshold")
        );
        set(&mut ms[1], MemberState::Succeeded, None);
        let two = step(&spec(), &ms);
        assert_eq!(
            two.breach.as_ref().map(ToString::to_string).as_deref(),
            Some("1 of 2 devices failed in overall (threshold 50%)")
        );
        assert_eq!(two.phase, RolloutPhase::Paused);
        assert!(two.start.is_empty());
        assert_eq!(condition(&two, "Degraded"), (true, "FailureThreshold"));
    }

    #[test]
    fn a_threshold_of_other_classes_ignores_a_failure() {
        let mut s = spec();
        s.failure_policy.thresholds[0].classes = vec![FailureClass::HealthFailed];
        let mut ms = pending(8);
        set(
            &mut ms[0],
            MemberState::Failed,
            Some(FailureClass::InstallFailed),
        );
        set(&mut ms[1], MemberState::Succeeded, None);
        assert_eq!(step(&s, &ms).breach, None);
    }

    #[test]
    fn devices_their_agent_rolled_back_are_changed_back_and_stop_the_rollout() {
        let mut s = spec();
        s.failure_policy.action = FailureAction::Rollback;
        let mut ms = pending(8);
        set(&mut ms[0], MemberState::Succeeded, None);
        set(&mut ms[1], MemberState::Succeeded, None);
        // The agent of site s1 rolled member 1 back while the cloud was
        // away: its record still says changed.
        ms[1].state = MemberState::RolledBack;
        let step = step(&s, &ms);
        assert_eq!(step.phase, RolloutPhase::RollingBack);
        assert_eq!(
            step.roll_back,
            [1],
            "scope Failed takes it, its spec follows"
        );
        assert!(step.start.is_empty());
        assert_eq!(condition(&step, "RolledBack"), (true, "RolledBackAtEdge"));
    }

    #[test]
    fn rollback_of_the_failed_changes_them_back_and_the_rollout_never_goes_on() {
        let mut s = spec();
        s.failure_policy.action = FailureAction::Rollback;
        let mut ms = pending(8);
        set(&mut ms[0], MemberState::Succeeded, None);
        set(
            &mut ms[1],
            MemberState::Failed,
            Some(FailureClass::HealthFailed),
        );
        set(&mut ms[2], MemberState::Updating, None);
        let breach = step(&s, &ms);
        assert_eq!(breach.phase, RolloutPhase::RollingBack);
        assert_eq!(breach.roll_back, [1]);
        assert!(breach.start.is_empty());
        // Changed back: no failure is left, yet the rollout stays stopped.
        set(&mut ms[1], MemberState::RolledBack, None);
        ms[1].settled = false;
        let after = step(&s, &ms);
        assert_eq!(after.breach, None);
        assert_eq!(
            after.phase,
            RolloutPhase::RollingBack,
            "waits for the device"
        );
        assert!(after.start.is_empty() && after.roll_back.is_empty());
        ms[1].settled = true;
        let done = step(&s, &ms);
        assert_eq!(done.phase, RolloutPhase::RolledBack);
        assert_eq!(condition(&done, "RolledBack"), (true, "RolledBack"));
    }

    #[test]
    fn rollback_scopes_take_the_failed_the_wave_or_all() {
        let mut s = spec();
        s.failure_policy.action = FailureAction::Rollback;
        s.failure_policy.thresholds[0].percent = 30;
        let mut ms = pending(8);
        // Stage of each member: [0, 1, 1, 1, 2, 2, 2, 2] by the interleaved order.
        set(&mut ms[0], MemberState::Succeeded, None);
        set(
            &mut ms[1],
            MemberState::Failed,
            Some(FailureClass::TimedOut),
        );
        set(&mut ms[2], MemberState::Succeeded, None);
        set(&mut ms[4], MemberState::Updating, None);
        for (scope, expected) in [
            (RollbackScope::Failed, vec![1]),
            (RollbackScope::Wave, vec![1, 2]),
            (RollbackScope::All, vec![0, 1, 2, 4]),
        ] {
            s.failure_policy.rollback_scope = scope;
            let plan = Plan::new(
                &s.strategy,
                &ms.iter().map(|m| view(&s, m)).collect::<Vec<_>>(),
            )
            .unwrap();
            assert_eq!(plan.stage, [0, 1, 1, 1, 2, 2, 2, 2]);
            assert_eq!(step(&s, &ms).roll_back, expected, "{scope:?}");
        }
    }

    #[test]
    fn abort_rolls_back_the_wave_in_progress_per_policy() {
        let mut s = spec();
        s.abort = true;
        s.failure_policy.rollback_scope = RollbackScope::Wave;
        let mut ms = pending(8);
        set(&mut ms[0], MemberState::Succeeded, None);
        set(&mut ms[1], MemberState::Updating, None);
        let aborted = step(&s, &ms);
        assert_eq!(aborted.roll_back, [1], "the canary, done, keeps the change");
        assert_eq!(condition(&aborted, "RolledBack"), (true, "Aborted"));
        assert!(aborted.start.is_empty());
    }

    #[test]
    fn an_unreachable_member_is_never_failed_and_is_skipped_only_when_told() {
        let mut s = spec();
        let mut ms = pending(4);
        set(
            &mut ms[0],
            MemberState::Failed,
            Some(FailureClass::TimedOut),
        );
        ms[0].away_ms = Some(10_000);
        ms[1].away_ms = Some(4_000_000);
        let away = step(&s, &ms);
        assert_eq!(away.summary.overall.failed, 0);
        assert_eq!(away.summary.overall.unreachable, 2);
        s.offline.then = OfflineAction::Skip;
        let skipped = step(&s, &ms);
        assert_eq!(skipped.summary.overall.skipped, 1, "away past waitUpTo");
        assert_eq!(skipped.summary.overall.unreachable, 1);
    }

    #[test]
    fn a_rollout_with_only_unreachable_members_left_says_it_waits_for_them() {
        let mut ms = pending(2);
        set(&mut ms[0], MemberState::Succeeded, None);
        ms[1].away_ms = Some(1);
        let waiting = step(&spec(), &ms);
        assert_eq!(waiting.phase, RolloutPhase::Progressing);
        assert_eq!(
            condition(&waiting, "Progressing"),
            (true, "WaitingForUnreachable")
        );
    }
}
