//! A rollout's timeline as the API server saw it: every change of every
//! member Device, in the order of one watch, and the checks made at each
//! moment — not on samples — that no limit was exceeded and no stage or site
//! canary was jumped.
//!
//! A member is *unavailable* from the moment its Device carries the
//! rollout's change until its status says it applied it (and, with a
//! health gate, for the bake time): what the controller counts against
//! `maxUnavailable`. The states come from [`rollout_member::state`], the
//! same rules the controller uses, so the recorder and the controller can
//! only disagree about what they see, never about what it means.

use std::collections::{BTreeMap, BTreeSet};
use std::sync::{Arc, Mutex};

use edgefleet_shared::api::Device;
use edgefleet_shared::api::rollout::FleetRollout;
use edgefleet_shared::rollout_member;
use edgefleet_shared::rollout_plan::{Member, MemberState, Plan};
use futures::StreamExt;
use k8s_openapi::jiff::Timestamp;
use kube::runtime::watcher;
use kube::{Api, ResourceExt};

/// What the recorder checks each moment against.
#[derive(Clone, Debug, Default)]
pub struct Expectations {
    /// Each member's site.
    pub site: BTreeMap<String, String>,
    /// Each member's stage, from the plan.
    pub stage: BTreeMap<String, usize>,
    /// The sites' canaries.
    pub site_canaries: BTreeSet<String>,
    /// Members whose node is cut off during the test (the stage rule does
    /// not wait for them).
    pub unreachable: BTreeSet<String>,
}

impl Expectations {
    /// The expectations of `rollout` over `members` (name and site), planned
    /// as the controller plans: by name, interleaved by site.
    pub fn plan(rollout: &FleetRollout, members: &BTreeMap<String, String>) -> Expectations {
        let names: Vec<&String> = members.keys().collect();
        let view: Vec<Member> = members
            .values()
            .map(|site| Member {
                domain: Some(site.clone()),
                state: MemberState::Pending,
                reachable: true,
                late: false,
            })
            .collect();
        let plan = Plan::new(&rollout.spec.strategy, &view).expect("a valid strategy");
        Expectations {
            site: members.clone(),
            stage: names
                .iter()
                .zip(&plan.stage)
                .map(|(n, &s)| ((*n).clone(), s))
                .collect(),
            site_canaries: names
                .iter()
                .zip(&plan.domain_canary)
                .filter(|(_, c)| **c)
                .map(|(n, _)| (*n).clone())
                .collect(),
            unreachable: BTreeSet::new(),
        }
    }
}

/// What the recorder found.
#[derive(Clone, Debug, Default)]
pub struct Timeline {
    /// Moments seen: writes to member Devices (watch events after the
    /// first list), by anyone — the rollout's changes, status writes.
    pub moments: usize,
    /// The most members unavailable at once, overall.
    pub max_unavailable: usize,
    /// ... and per site.
    pub max_unavailable_by_site: BTreeMap<String, usize>,
    /// Members in the order they were first changed.
    pub changed: Vec<String>,
    /// Members in the order they were first seen rolled back.
    pub rolled_back: Vec<String>,
    /// Members in the order they were first seen failed.
    pub failed: Vec<String>,
    /// Rule breaches, described.
    pub violations: Vec<String>,
    /// Each member's latest state.
    pub states: BTreeMap<String, MemberState>,
    /// Members changed more than once by the rollout (two records of the
    /// same attempt with different times): what a controller restarting
    /// mid-rollout must never do.
    pub changed_twice: Vec<String>,
    /// Each member's attempts seen (1 unless retried).
    pub attempts: BTreeMap<String, u32>,
    // The time of each attempt at a member's change, from its record.
    changed_at: BTreeMap<(String, u32), i64>,
}

/// Records the timeline of `rollout` (as created, with its uid) over the
/// Devices of `api`, until dropped or [`Recorder::finish`]ed.
#[derive(Debug)]
pub struct Recorder {
    timeline: Arc<Mutex<Timeline>>,
    task: tokio::task::JoinHandle<()>,
}

impl Recorder {
    /// Starts watching.
    pub fn start(api: Api<Device>, rollout: FleetRollout, expect: Expectations) -> Recorder {
        let timeline = Arc::new(Mutex::new(Timeline::default()));
        let shared = Arc::clone(&timeline);
        let task = tokio::spawn(async move {
            let events = watcher(api, watcher::Config::default());
            futures::pin_mut!(events);
            while let Some(event) = events.next().await {
                let (device, listed) = match event {
                    Ok(watcher::Event::Apply(d)) => (d, false),
                    Ok(watcher::Event::InitApply(d)) => (d, true),
                    _ => continue,
                };
                let name = device.name_any();
                if !expect.site.contains_key(&name) {
                    continue;
                }
                let mut t = shared.lock().expect("timeline");
                if !listed {
                    t.moments += 1;
                }
                observe(&mut t, &device, &name, &rollout, &expect);
            }
        });
        Recorder { timeline, task }
    }

    /// The timeline so far.
    pub fn timeline(&self) -> Timeline {
        self.timeline.lock().expect("timeline").clone()
    }

    /// Stops watching; the timeline.
    pub fn finish(self) -> Timeline {
        self.task.abort();
        self.timeline()
    }
}

fn observe(
    t: &mut Timeline,
    device: &Device,
    name: &str,
    rollout: &FleetRollout,
    expect: &Expectations,
) {
    // Only this device changed at this moment: the others keep their
    // states (no state here moves by time alone but a time-out).
    let state = rollout_member::state(device, rollout, Timestamp::now()).0;
    t.states.insert(name.to_owned(), state);
    let ours = rollout_member::record(device)
        .and_then(Result::ok)
        .filter(|r| Some(&r.uid) == rollout.metadata.uid.as_ref());
    if let Some(r) = &ours {
        let first = *t
            .changed_at
            .entry((name.to_owned(), r.attempt))
            .or_insert(r.changed_at_ms);
        let attempts = t.attempts.entry(name.to_owned()).or_default();
        *attempts = (*attempts).max(r.attempt);
        if first != r.changed_at_ms && !t.changed_twice.iter().any(|n| n == name) {
            t.changed_twice.push(name.to_owned());
        }
        if !t.changed.iter().any(|n| n == name) {
            t.changed.push(name.to_owned());
            check_order(t, name, expect);
        }
    }
    if state == MemberState::RolledBack && !t.rolled_back.iter().any(|n| n == name) {
        t.rolled_back.push(name.to_owned());
    }
    if state == MemberState::Failed && !t.failed.iter().any(|n| n == name) {
        t.failed.push(name.to_owned());
    }
    let mut by_site: BTreeMap<&str, usize> = BTreeMap::new();
    let mut total = 0;
    for (n, s) in &t.states {
        if s.unavailable() {
            total += 1;
            *by_site.entry(expect.site[n].as_str()).or_default() += 1;
        }
    }
    t.max_unavailable = t.max_unavailable.max(total);
    let by_site: Vec<(String, usize)> = by_site
        .into_iter()
        .map(|(s, n)| (s.to_owned(), n))
        .collect();
    for (site, n) in by_site {
        let max = t.max_unavailable_by_site.entry(site).or_default();
        *max = (*max).max(n);
    }
}

/// At the moment `name` is first changed: every reachable member of an
/// earlier stage is done, and its site's canaries have succeeded unless it
/// is one.
fn check_order(t: &mut Timeline, name: &str, expect: &Expectations) {
    let stage = expect.stage[name];
    let mut found = Vec::new();
    for (other, s) in &t.states {
        if expect.stage[other] < stage && !s.done() && !expect.unreachable.contains(other) {
            found.push(format!(
                "{name} (stage {stage}) changed while {other} of stage {} was {s:?}",
                expect.stage[other]
            ));
        }
        let same_site = expect.site[other] == expect.site[name];
        if same_site
            && !expect.site_canaries.contains(name)
            && expect.site_canaries.contains(other)
            && *s != MemberState::Succeeded
            && !expect.unreachable.contains(other)
        {
            found.push(format!(
                "{name} changed while {other}, the canary of site {}, was {s:?}",
                expect.site[name]
            ));
        }
    }
    t.violations.extend(found);
}
