//! The FleetRollout reconciler: reads the members' states from the Device
//! reflector, takes a [`step`], changes Devices (or changes them back) and
//! writes the rollout's status.
//!
//! What it relies on:
//! - **No memory of its own.** Each member's state comes from its Device
//!   (the change and its record, see [`rollout_member`]); a controller
//!   killed mid-rollout resumes from the Devices.
//! - **No device changed twice.** A change is a merge patch conditional on
//!   the Device's `resourceVersion` as the step saw it: a step working from
//!   a stale view gets a conflict, never a second change. A change the
//!   reflector has not shown yet is taken from the patch's answer, so the
//!   next step counts it against the limits at once. The same holds for
//!   the rollout's own status: a reconcile that runs before the reflector
//!   shows the last status written (a Device change wakes it at once)
//!   works from that status, so why a rollback began is never forgotten.
//! - **One budget.** Device changes and status writes wait for the status
//!   writer's budget, so a rollout adds no burst of writes on top of it.
//! - **Membership**: the Devices of the rollout's namespace that match its
//!   selector (and whose node matches `nodeSelector`), each domain taken
//!   from the topology key on the Device or else on its EdgeNode. With
//!   `Snapshot`, only Devices created before the rollout started; with
//!   `Dynamic`, later ones join. A Device this rollout changed stays a
//!   member whatever its labels become.
//! - **Overlap**: a rollout waits (`Pending`, a condition naming the other)
//!   while an older unfinished rollout of the namespace selects one of its
//!   Devices. Older is by creation time, then name, so two rollouts never
//!   both wait or both go.
//! - **Deletion**: nothing is undone. Each Device keeps the spec it has and
//!   its record, which names the rollout it came from; see docs/rollouts.md.
//!   The finalizer [`FINALIZER`] is let go only by a reconcile that sees the
//!   deletion, so a rollout that is gone changes nothing more.

use std::collections::HashMap;
use std::sync::{Arc, Mutex, OnceLock};
use std::time::Duration;

use edgefleet_shared::ResourceKey;
use edgefleet_shared::api::device::DeviceRolloutStatus;
use edgefleet_shared::api::edge_node::condition as node_condition;
use edgefleet_shared::api::rollout::{FleetRollout, FleetRolloutStatus, Membership, RolloutPhase};
use edgefleet_shared::api::{Device, EdgeNode};
use edgefleet_shared::health_gate::HealthGate;
use edgefleet_shared::rollout_member::{self, record};
use edgefleet_shared::rollout_plan::MemberState;
use edgefleet_shared::rollout_step::{MemberInput, Step, WantedCondition, step};
use futures::{Stream, StreamExt};
use k8s_openapi::apimachinery::pkg::apis::meta::v1::{Condition, Time};
use k8s_openapi::jiff::Timestamp;
use kube::api::{Patch, PatchParams};
use kube::core::{Selector, SelectorExt};
use kube::runtime::controller::Action;
use kube::runtime::finalizer::{self, finalizer};
use kube::runtime::reflector::{ObjectRef, Store};
use kube::runtime::{Controller, watcher};
use kube::{Api, Client, Resource, ResourceExt};

use crate::agents::Agents;
use crate::events::{Events, Note};
use crate::status::{StatusChange, StatusWriter};

/// The field manager of every write the rollout reconciler makes.
pub const FIELD_MANAGER: &str = "edgefleet-rollout";

/// The finalizer on every rollout the controller has seen.
pub const FINALIZER: &str = "edgefleet.io/rollout";

/// How often a rollout that is moving is looked at again without a
/// Device change (bake times and time-outs pass without one).
pub const TICK: Duration = Duration::from_secs(2);

/// A Device changed by a patch the reflector may not show yet: the
/// resourceVersion the patch was made against, and the answer.
type Patched = (String, Arc<Device>);

/// The status last written to a rollout the reflector may not show yet:
/// the resourceVersion it was written against, and the status.
type Written = (String, FleetRolloutStatus);

/// What the reconciler works with.
pub struct Context {
    // The singletons' client: it writes only while this replica leads.
    client: Client,
    fence: crate::leases::Fence,
    devices: Store<Device>,
    edge_nodes: Store<EdgeNode>,
    agents: Arc<Agents>,
    budget: StatusWriter,
    events: Events,
    rollouts: OnceLock<Store<FleetRollout>>,
    patched: Mutex<HashMap<ObjectRef<Device>, Patched>>,
    written: Mutex<HashMap<ObjectRef<FleetRollout>, Written>>,
}

impl std::fmt::Debug for Context {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("rollout::Context").finish_non_exhaustive()
    }
}

impl Context {
    /// The reconciler's context; `budget` paces its writes.
    pub fn new(
        fence: crate::leases::Fence,
        devices: Store<Device>,
        edge_nodes: Store<EdgeNode>,
        agents: Arc<Agents>,
        budget: StatusWriter,
        events: Events,
    ) -> Self {
        Context {
            client: fence.leader(),
            fence,
            devices,
            edge_nodes,
            agents,
            budget,
            events,
            rollouts: OnceLock::new(),
            patched: Mutex::default(),
            written: Mutex::default(),
        }
    }
}

/// Reconciles the FleetRollouts of `api` until the process ends; every
/// item of `device_changes` looks at all of them again.
pub async fn run(
    api: Api<FleetRollout>,
    context: Arc<Context>,
    device_changes: impl Stream<Item = ()> + Send + 'static,
) {
    let controller = Controller::new(api, watcher::Config::default());
    let _ = context.rollouts.set(controller.store());
    // Only the leader moves rollouts; one that takes over looks at them all.
    let triggers = futures::stream::select(device_changes, context.fence.changes());
    controller
        .reconcile_all_on(triggers)
        .run(reconcile, error_policy, context)
        .for_each(|result| async move {
            if let Err(error) = result {
                tracing::debug!(%error, "rollout reconcile did not finish");
            }
        })
        .await;
}

/// A failed write; the rollout is looked at again shortly.
#[derive(Debug, thiserror::Error)]
#[error(transparent)]
pub struct Error(#[from] kube::Error);

fn error_policy(
    rollout: Arc<FleetRollout>,
    error: &finalizer::Error<Error>,
    _: Arc<Context>,
) -> Action {
    tracing::warn!(rollout = %rollout.name_any(), %error, "rollout reconcile failed; retrying");
    Action::requeue(Duration::from_secs(2))
}

/// The members of a rollout, in a stable order, with their Devices.
struct Members {
    devices: Vec<Arc<Device>>,
    inputs: Vec<MemberInput>,
}

/// Holds a finalizer on every rollout it has seen, so that once a deleted
/// rollout is gone the controller has stopped changing Devices for it: a
/// step already under way when it was deleted lands before the finalizer
/// is let go (reconciles of one rollout never run at once).
async fn reconcile(
    rollout: Arc<FleetRollout>,
    context: Arc<Context>,
) -> Result<Action, finalizer::Error<Error>> {
    if !context.fence.leads() {
        // The leader moves rollouts. What this replica remembers of its own
        // writes may be overtaken by then: start again from the API.
        context.patched.lock().expect("patched").clear();
        context.written.lock().expect("written").clear();
        return Ok(Action::await_change());
    }
    let api: Api<FleetRollout> = Api::namespaced(
        context.client.clone(),
        &rollout.namespace().unwrap_or_default(),
    );
    finalizer(&api, FINALIZER, rollout, |event| async {
        match event {
            finalizer::Event::Apply(rollout) => advance(rollout, context).await,
            // Deletion undoes nothing (docs/rollouts.md).
            finalizer::Event::Cleanup(rollout) => {
                let key = ObjectRef::from_obj(&*rollout);
                context.written.lock().expect("written").remove(&key);
                Ok(Action::await_change())
            }
        }
    })
    .await
}

async fn advance(rollout: Arc<FleetRollout>, context: Arc<Context>) -> Result<Action, Error> {
    let now = Timestamp::now();
    let current = context.current_status(&rollout);
    // A finished rollout is left alone until its spec changes (an abort of
    // a completed rollout still rolls it back); with Dynamic membership a
    // completed rollout goes on taking late joiners.
    let finished = matches!(
        current.phase,
        Some(RolloutPhase::Complete | RolloutPhase::RolledBack)
    ) && current.observed_generation == rollout.metadata.generation
        && (rollout.spec.membership == Membership::Snapshot
            || current.phase == Some(RolloutPhase::RolledBack));
    if finished {
        return Ok(Action::await_change());
    }
    let (mut status, action) = match context.plan(&rollout, now) {
        Err(refusal) => (refusal.status(&current), Action::await_change()),
        Ok(Planned::Waiting { other, shared }) => {
            let mut status = FleetRolloutStatus {
                phase: Some(RolloutPhase::Pending),
                ..current.clone()
            };
            let message = format!(
                "waits for FleetRollout {other}, which also selects {shared} of its devices"
            );
            set_conditions(
                &mut status,
                &[
                    wanted("Accepted", true, "Valid", String::new()),
                    wanted("Progressing", false, "WaitingForRollout", message),
                ],
            );
            (status, Action::requeue(Duration::from_secs(5)))
        }
        Ok(Planned::Run { members, step }) => {
            context.act(&rollout, &members, &step, now).await?;
            context.show_parts(&rollout, &members);
            let action = match step.phase {
                RolloutPhase::Progressing | RolloutPhase::RollingBack => Action::requeue(TICK),
                RolloutPhase::Paused | RolloutPhase::Pending => {
                    Action::requeue(Duration::from_secs(10))
                }
                _ => Action::requeue(Duration::from_secs(60)),
            };
            (status_of(&current, &step), action)
        }
    };
    status.observed_generation = rollout.metadata.generation;
    let running = !matches!(
        status.phase,
        None | Some(RolloutPhase::Pending | RolloutPhase::Invalid)
    );
    if status.started_at.is_none() && running {
        status.started_at = Some(Time(now));
    }
    if status != current {
        context.announce(&rollout, &current, &status);
        context.budget.spend().await;
        let api: Api<FleetRollout> = Api::namespaced(
            context.client.clone(),
            &rollout.namespace().unwrap_or_default(),
        );
        let patch = serde_json::json!({
            "apiVersion": "edgefleet.io/v1alpha1",
            "kind": "FleetRollout",
            "status": status,
        });
        api.patch_status(
            &rollout.name_any(),
            &PatchParams::apply(FIELD_MANAGER).force(),
            &Patch::Apply(&patch),
        )
        .await?;
        if let Some(version) = rollout.resource_version() {
            let mut written = context.written.lock().expect("written");
            written.insert(ObjectRef::from_obj(&*rollout), (version, status));
        }
    }
    Ok(action)
}

/// What a rollout can do now.
enum Planned {
    /// An older rollout holds some of its devices.
    Waiting { other: String, shared: usize },
    /// It runs this step.
    Run { members: Members, step: Box<Step> },
}

/// Why a rollout cannot run: what a person must fix.
struct Refusal {
    reason: &'static str,
    message: String,
}

impl Refusal {
    fn status(&self, current: &FleetRolloutStatus) -> FleetRolloutStatus {
        let mut status = FleetRolloutStatus {
            phase: Some(RolloutPhase::Invalid),
            ..current.clone()
        };
        set_conditions(
            &mut status,
            &[
                wanted("Accepted", false, self.reason, self.message.clone()),
                wanted("Progressing", false, self.reason, self.message.clone()),
            ],
        );
        status
    }
}

impl Context {
    fn plan(&self, rollout: &FleetRollout, now: Timestamp) -> Result<Planned, Refusal> {
        let spec = &rollout.spec;
        if let Some(health) = &spec.health {
            HealthGate::compile(&health.expression).map_err(|error| Refusal {
                reason: "InvalidHealthExpression",
                message: format!("spec.health.expression: {error}"),
            })?;
        }
        let members = self.members(rollout, now)?;
        if let Some(domain) = &spec.strategy.failure_domain
            && !members.inputs.is_empty()
            && members.inputs.iter().all(|m| m.domain.is_none())
        {
            return Err(Refusal {
                reason: "NoFailureDomain",
                message: format!(
                    "no selected Device, and no EdgeNode of one, has the label {:?} of spec.strategy.failureDomain.topologyKey",
                    domain.topology_key
                ),
            });
        }
        if let Some((other, shared)) = self.older_overlap(rollout, &members) {
            return Ok(Planned::Waiting { other, shared });
        }
        let step = Box::new(step(spec, &members.inputs));
        Ok(Planned::Run { members, step })
    }

    fn members(&self, rollout: &FleetRollout, now: Timestamp) -> Result<Members, Refusal> {
        let spec = &rollout.spec;
        let selector =
            |which: &str, s: &k8s_openapi::apimachinery::pkg::apis::meta::v1::LabelSelector| {
                Selector::try_from(s.clone()).map_err(|error| Refusal {
                    reason: "InvalidSelector",
                    message: format!("{which}: {error}"),
                })
            };
        let devices_selector = selector("spec.selector", &spec.selector)?;
        let nodes_selector = spec
            .node_selector
            .as_ref()
            .map(|s| selector("spec.nodeSelector", s))
            .transpose()?;
        let namespace = rollout.namespace().unwrap_or_default();
        let uid = rollout.uid().unwrap_or_default();
        let started = rollout.status.as_ref().and_then(|s| s.started_at.clone());
        let node = |name: &str| self.edge_nodes.get(&ObjectRef::new(name));
        let patched = self.patched.lock().expect("patched");
        let mut devices: Vec<Arc<Device>> = self
            .devices
            .state()
            .into_iter()
            .filter(|d| d.namespace().as_deref() == Some(namespace.as_str()))
            .filter(|d| d.metadata.deletion_timestamp.is_none())
            .map(|d| match patched.get(&ObjectRef::from_obj(&*d)) {
                Some((before, after)) if d.resource_version().as_ref() == Some(before) => {
                    Arc::clone(after)
                }
                _ => d,
            })
            .filter(|d| !self.taken_over(rollout, d))
            .filter(|d| {
                let ours = matches!(record(d), Some(Ok(r)) if r.uid == uid);
                let selected = devices_selector.matches(d.labels())
                    && nodes_selector
                        .as_ref()
                        .is_none_or(|s| node(&d.spec.node).is_some_and(|n| s.matches(n.labels())));
                let joined_in_time = match (&started, spec.membership) {
                    (Some(started), Membership::Snapshot) => d
                        .metadata
                        .creation_timestamp
                        .as_ref()
                        .is_none_or(|c| c.0 <= started.0),
                    _ => true,
                };
                ours || (selected && joined_in_time)
            })
            .collect();
        drop(patched);
        devices.sort_by_key(|d| d.name_any());
        let key = spec
            .strategy
            .failure_domain
            .as_ref()
            .map(|d| d.topology_key.as_str());
        let inputs = devices
            .iter()
            .map(|d| {
                let domain = key.and_then(|key| {
                    d.labels()
                        .get(key)
                        .cloned()
                        .or_else(|| node(&d.spec.node)?.labels().get(key).cloned())
                });
                let (state, class) = rollout_member::state(d, rollout, now);
                let ours = match record(d) {
                    Some(Ok(r)) if r.uid == uid && !r.rolled_back => Some(r),
                    _ => None,
                };
                let changed = ours.is_some();
                let retry = state == MemberState::Failed
                    && ours.as_ref().is_some_and(|r| {
                        rollout_member::retryable(class, r.attempt, spec.failure_policy.retries)
                    });
                let generation = d.metadata.generation.unwrap_or(0);
                let settled = d
                    .status
                    .as_ref()
                    .and_then(|s| s.applied_generation)
                    .is_some_and(|a| a >= generation);
                MemberInput {
                    domain,
                    state,
                    class,
                    changed,
                    settled,
                    away_ms: self.away_ms(&d.spec.node, now),
                    inconclusive: changed && rollout_member::inconclusive(d),
                    late: spec.membership == Membership::Dynamic
                        && started.as_ref().is_some_and(|s| {
                            d.metadata
                                .creation_timestamp
                                .as_ref()
                                .is_some_and(|c| c.0 > s.0)
                        }),
                    retry,
                }
            })
            .collect();
        Ok(Members { devices, inputs })
    }

    /// How long `node` has been without an agent; `None` while it has one.
    fn away_ms(&self, node: &str, now: Timestamp) -> Option<i64> {
        // Another replica's node: its EdgeNode says.
        if self.fence.serves(node) {
            if self.agents.is_connected(node) {
                return None;
            }
            if let Some(since) = self.agents.disconnected_since(node) {
                return Some(since.elapsed().as_millis() as i64);
            }
        }
        // Not seen since this process started: the EdgeNode says how it was.
        let edge_node = self.edge_nodes.get(&ObjectRef::new(node));
        let status = edge_node.as_ref().and_then(|n| n.status.as_ref());
        if status.is_some_and(|s| s.connected) {
            return None;
        }
        let since = status
            .and_then(|s| {
                s.conditions
                    .iter()
                    .find(|c| c.type_ == node_condition::READY)
            })
            .filter(|c| c.status != "True")
            .map_or(now, |c| c.last_transition_time.0);
        Some((now - since).get_milliseconds().max(0))
    }

    /// Whether `device` was changed by a newer rollout than `rollout` (one
    /// that waited for it): it is that rollout's now, and no longer a member
    /// here.
    fn taken_over(&self, rollout: &FleetRollout, device: &Device) -> bool {
        let Some(Ok(r)) = record(device) else {
            return false;
        };
        if Some(&r.uid) == rollout.metadata.uid.as_ref() || r.rolled_back {
            return false;
        }
        let Some(rollouts) = self.rollouts.get() else {
            return false;
        };
        rollouts
            .state()
            .iter()
            .find(|o| o.metadata.uid.as_ref() == Some(&r.uid))
            .is_some_and(|other| order(other) > order(rollout))
    }

    /// An older unfinished rollout of the namespace that selects one of
    /// `members`, and how many.
    fn older_overlap(&self, rollout: &FleetRollout, members: &Members) -> Option<(String, usize)> {
        let rollouts = self.rollouts.get()?;
        let mine = order(rollout);
        let mut older: Vec<Arc<FleetRollout>> = rollouts
            .state()
            .into_iter()
            .filter(|o| o.namespace() == rollout.namespace() && o.uid() != rollout.uid())
            .filter(|o| o.metadata.deletion_timestamp.is_none())
            .filter(|o| order(o) < mine)
            .filter(|o| {
                !matches!(
                    o.status.as_ref().and_then(|s| s.phase),
                    Some(RolloutPhase::Complete | RolloutPhase::RolledBack | RolloutPhase::Invalid)
                )
            })
            .collect();
        older.sort_by_key(|o| order(o));
        older.into_iter().find_map(|o| {
            let selector = Selector::try_from(o.spec.selector.clone()).ok()?;
            let shared = members
                .devices
                .iter()
                .filter(|d| selector.matches(d.labels()))
                .count();
            (shared > 0).then(|| (o.name_any(), shared))
        })
    }

    /// Changes the members the step starts and changes back those it rolls
    /// back, one budgeted, conditional patch each.
    /// The rollout's status: the one this controller wrote last while the
    /// reflector still shows the object it was written over, else the
    /// reflector's.
    fn current_status(&self, rollout: &FleetRollout) -> FleetRolloutStatus {
        let mut written = self.written.lock().expect("written");
        let key = ObjectRef::from_obj(rollout);
        match written.get(&key) {
            Some((before, status)) if rollout.resource_version().as_ref() == Some(before) => {
                status.clone()
            }
            _ => {
                written.remove(&key);
                rollout.status.clone().unwrap_or_default()
            }
        }
    }

    async fn act(
        &self,
        rollout: &FleetRollout,
        members: &Members,
        step: &Step,
        now: Timestamp,
    ) -> Result<(), Error> {
        let now_ms = now.as_millisecond();
        // A start is a member's first change, or a retry of a change that
        // failed.
        let starts = step.start.iter().zip(&step.pace).filter_map(|(&i, pace)| {
            let device = &members.devices[i];
            let input = &members.inputs[i];
            let patch = match (record(device), input.class) {
                (Some(Ok(r)), Some(class)) if input.retry => {
                    rollout_member::retry(device, &r, class, now_ms)
                }
                _ => rollout_member::change(device, rollout, pace.clone(), now_ms)?,
            };
            Some((i, patch))
        });
        let undos = step.roll_back.iter().filter_map(|&i| {
            let device = &members.devices[i];
            match record(device) {
                Some(Ok(r)) => Some((i, rollout_member::undo(&r))),
                _ => None,
            }
        });
        let patches: Vec<(usize, serde_json::Value)> = starts.chain(undos).collect();
        for (i, mut patch) in patches {
            let device = &members.devices[i];
            let Some(version) = device.resource_version() else {
                continue;
            };
            patch["metadata"]["resourceVersion"] = version.clone().into();
            self.budget.spend().await;
            let api: Api<Device> =
                Api::namespaced(self.client.clone(), &device.namespace().unwrap_or_default());
            match api
                .patch(
                    &device.name_any(),
                    &PatchParams {
                        field_manager: Some(FIELD_MANAGER.into()),
                        ..PatchParams::default()
                    },
                    &Patch::Merge(&patch),
                )
                .await
            {
                Ok(after) => {
                    self.patched
                        .lock()
                        .expect("patched")
                        .insert(ObjectRef::from_obj(&after), (version, Arc::new(after)));
                }
                // Changed since the step saw it: the next step judges again.
                Err(kube::Error::Api(e)) if e.code == 409 => {
                    tracing::debug!(device = %device.name_any(), "device changed meanwhile; judged again next step");
                }
                Err(error) => return Err(error.into()),
            }
        }
        // Forget what the reflector shows by now.
        let mut patched = self.patched.lock().expect("patched");
        patched.retain(|key, (before, _)| {
            self.devices
                .get(key)
                .is_some_and(|d| d.resource_version().as_ref() == Some(before))
        });
        Ok(())
    }

    /// Writes each member's part into its Device's status (through the
    /// status writer, so on the same budget and coalesced with reports),
    /// where it changed. Members still pending are left out: a rollout of
    /// thousands does not start with thousands of writes.
    fn show_parts(&self, rollout: &FleetRollout, members: &Members) {
        let revision = rollout.metadata.generation.unwrap_or(0);
        for (device, input) in members.devices.iter().zip(&members.inputs) {
            if input.state == MemberState::Pending {
                continue;
            }
            let ours = match record(device) {
                Some(Ok(r)) if rollout.uid().as_ref() == Some(&r.uid) => Some(r),
                _ => None,
            };
            let part = member_part(rollout.name_any(), revision, input, ours.as_ref());
            let shown = device.status.as_ref().and_then(|s| s.rollout.as_ref());
            if shown == Some(&part) {
                continue;
            }
            let key =
                ResourceKey::device(device.namespace().unwrap_or_default(), device.name_any());
            let uid = device.uid().unwrap_or_default();
            self.budget
                .submit(key, StatusChange::Rollout { uid, part }, None);
        }
    }

    /// Events for the transitions people care about.
    fn announce(&self, rollout: &FleetRollout, old: &FleetRolloutStatus, new: &FleetRolloutStatus) {
        let reference = rollout.object_ref(&());
        let publish = |warning: bool, reason: &'static str, text: String| {
            self.events.publish(
                reference.clone(),
                Note {
                    warning,
                    reason,
                    action: "Rollout",
                    text,
                },
            );
        };
        let message = |type_: &str| {
            new.conditions
                .iter()
                .find(|c| c.type_ == type_)
                .map(|c| c.message.clone())
                .unwrap_or_default()
        };
        if new.phase != old.phase {
            match new.phase {
                Some(RolloutPhase::Progressing) if old.phase.is_none() => {
                    publish(false, "Started", format!("{} devices", new.counts.total));
                }
                Some(RolloutPhase::Paused) => publish(true, "Paused", message("Paused")),
                Some(RolloutPhase::RollingBack) => {
                    publish(true, "RollingBack", message("RolledBack"));
                }
                Some(RolloutPhase::RolledBack) => {
                    publish(true, "RolledBack", message("RolledBack"))
                }
                Some(RolloutPhase::Complete) => publish(false, "Complete", message("Complete")),
                Some(RolloutPhase::Invalid) => publish(true, "Invalid", message("Accepted")),
                _ => {}
            }
        }
        if new.wave != old.wave
            && let Some(wave) = &new.wave
        {
            publish(false, "WaveStarted", format!("{wave} started"));
        }
    }
}

/// A member's part as its Device's status shows it; `record` is the
/// rollout's record on the Device, if it changed it.
fn member_part(
    name: String,
    revision: i64,
    m: &MemberInput,
    record: Option<&rollout_member::Record>,
) -> DeviceRolloutStatus {
    let state = match m.state {
        s if m.away_ms.is_some() && !s.done() => "Unreachable",
        MemberState::Pending => "Pending",
        MemberState::Updating => "Updating",
        MemberState::Baking => "Baking",
        MemberState::Succeeded => "Succeeded",
        MemberState::Failed => "Failed",
        MemberState::RolledBack => "RolledBack",
        MemberState::Skipped => "Skipped",
    };
    let failure = m.class.or_else(|| record?.last_failure);
    DeviceRolloutStatus {
        name,
        revision,
        state: state.to_owned(),
        attempt: record.map_or(0, |r| r.attempt),
        failure: failure.map(|c| format!("{c:?}")),
    }
}

/// Which of two rollouts is older: by creation time, then by name.
fn order(r: &FleetRollout) -> (Option<Timestamp>, String) {
    (
        r.metadata.creation_timestamp.clone().map(|t| t.0),
        r.name_any(),
    )
}

/// The status that shows `step`, keeping what `current` says of the rest.
fn status_of(current: &FleetRolloutStatus, step: &Step) -> FleetRolloutStatus {
    let mut status = FleetRolloutStatus {
        phase: Some(step.phase),
        wave: step.wave.clone(),
        counts: step.summary.overall.clone(),
        waves: step.summary.stages.clone(),
        sites: step.summary.sites.clone(),
        sites_not_listed: step.summary.sites_not_listed,
        ..current.clone()
    };
    let mut wanted = vec![wanted("Accepted", true, "Valid", String::new())];
    wanted.extend(step.conditions.iter().cloned());
    set_conditions(&mut status, &wanted);
    status
}

fn wanted(
    type_: &'static str,
    status: bool,
    reason: &'static str,
    message: String,
) -> WantedCondition {
    WantedCondition {
        type_,
        status,
        reason,
        message,
    }
}

fn set_conditions(status: &mut FleetRolloutStatus, wanted: &[WantedCondition]) {
    let now = Time(Timestamp::now());
    for w in wanted {
        // Why a rollback began (a threshold, an abort) stays its reason
        // after the failures that caused it were changed back.
        let began = status
            .conditions
            .iter()
            .any(|c| c.type_ == "RolledBack" && c.status == "True");
        if w.type_ == "RolledBack" && w.status && began {
            continue;
        }
        crate::conditions::set(
            &mut status.conditions,
            Condition {
                type_: w.type_.to_owned(),
                status: if w.status { "True" } else { "False" }.to_owned(),
                reason: w.reason.to_owned(),
                message: w.message.clone(),
                observed_generation: status.observed_generation,
                last_transition_time: now.clone(),
            },
        );
    }
}
