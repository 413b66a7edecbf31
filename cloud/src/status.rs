//! Device status writes, on a budget.
//!
//! Writing every report into status is how peers overload their API servers.
//! Here every change goes through one writer that
//! - coalesces per device: while a device waits for its turn, newer changes
//!   merge into the one pending write;
//! - writes only when a field people care about changed (reported values,
//!   generations, firmware, phase, conditions; `lastSeen` at most once per
//!   [`LAST_SEEN_RESOLUTION`]);
//! - paces writes with a global rate limit;
//! - never lets a stale report overwrite a newer one: each report names its
//!   origin (agent store, uplink sequence number) and the status keeps the
//!   origin of the report it shows (`lastReport`), so a resend or a delayed
//!   copy is ignored, across controller restarts too. `lastReport` alone
//!   never causes a write: it is persisted with the next write that is due
//!   anyway, and kept in memory until then.
//!
//! Each change can carry a completion: the sync session acknowledges an
//! uplink sequence number to its agent only once the write that carries it
//! succeeded (or turned out unnecessary).

use std::collections::{BTreeMap, HashMap, HashSet, VecDeque};
use std::num::NonZeroU32;
use std::sync::{Arc, Mutex};
use std::time::Duration;

use edgefleet_shared::api::device::condition;
use edgefleet_shared::api::{Device, DevicePhase, DeviceStatus, ReportOrigin};
use edgefleet_shared::{PropertyValue, ResourceKey};
use governor::{DefaultDirectRateLimiter, Quota, RateLimiter};
use k8s_openapi::apimachinery::pkg::apis::meta::v1::{Condition, Time};
use k8s_openapi::jiff::Timestamp;
use kube::Api;
use kube::api::{Patch, PatchParams};
use kube::runtime::reflector::{ObjectRef, Store};
use tokio::sync::{Notify, mpsc};

use crate::events::{Events, Note, resource_reference};
use crate::leases::Fence;

/// Status writes on their way at once (each for another device).
pub const CONCURRENT_WRITES: usize = 8;

/// The field manager of every status write the controller makes.
pub const FIELD_MANAGER: &str = "edgefleet-cloud";

/// While both kinds wait, one write in this many goes to a change of
/// reachability only, so a node's `Online` flips are never starved by data.
pub const REACHABILITY_SHARE: u32 = 4;

/// `lastSeen` moves at most this often; on its own it never causes a write
/// sooner.
pub const LAST_SEEN_RESOLUTION: Duration = Duration::from_secs(60);

/// The reason of `UpdateFailed` when the device says its firmware did not
/// install.
pub const INSTALL_FAILED: &str = "InstallFailed";

/// A change to one Device's status.
#[derive(Clone, Debug, PartialEq)]
pub enum StatusChange {
    /// The agent stored this generation durably.
    Delivered {
        /// The Device's uid the agent stored (a recreated Device has another).
        uid: String,
        /// The generation the agent stored.
        generation: i64,
    },
    /// The device reported.
    Reported {
        /// The Device's uid the report is about: it changes only that
        /// object's status, never a Device recreated under the same name.
        uid: String,
        /// Generation the device says it applied.
        applied_generation: i64,
        /// Its property values.
        properties: BTreeMap<String, PropertyValue>,
        /// Firmware it runs, if it said.
        firmware_version: Option<String>,
        /// The applied generation's firmware did not install.
        firmware_failure: Option<edgefleet_shared::codec::FirmwareFailure>,
        /// The agent's health check of the applied generation.
        health: Option<edgefleet_shared::health_check::HealthState>,
        /// The agent rolled the device back on its own (boxed: rare, and
        /// it would make every change larger).
        edge_rollback: Option<Box<edgefleet_shared::site_rollback::EdgeRollback>>,
        /// The agent holds the device's generation back (boxed, like
        /// `edge_rollback`).
        held_at_edge: Option<Box<edgefleet_shared::site_pacing::HeldAtEdge>>,
        /// What EdgeRules at the agent set on the device.
        overrides: Vec<edgefleet_shared::api::device::DeviceOverride>,
        /// When the agent received the report (Unix milliseconds).
        received_at_ms: i64,
        /// Where it came from; `None` from an agent that does not say.
        origin: Option<ReportOrigin>,
    },
    /// The controller accepted this generation of the spec.
    Observed {
        /// The generation accepted.
        generation: i64,
    },
    /// The Device's edge node has had no agent for the grace period.
    NodeUnreachable {
        /// The node.
        node: String,
    },
    /// The Device's edge node has an agent again.
    NodeReachable,
    /// The device's part in a FleetRollout changed.
    Rollout {
        /// The Device's uid the rollout judged.
        uid: String,
        /// Its part.
        part: edgefleet_shared::api::device::DeviceRolloutStatus,
    },
    /// The agent refused to store this generation.
    Rejected {
        /// The Device's uid the agent was sent.
        uid: String,
        /// The generation it refused.
        generation: i64,
        /// The agent's reason.
        reason: String,
    },
}

/// Told when the change with this uplink sequence number is durable (or
/// needs no write).
#[derive(Clone, Debug)]
pub struct Completion {
    /// The uplink sequence number the change came with.
    pub seq: u64,
    /// Where to say so.
    pub notify: mpsc::UnboundedSender<u64>,
}

/// Counters of what the writer did. Cloning shares the counters.
#[derive(Clone, Debug, Default)]
pub struct StatusMetrics {
    /// Status writes made.
    pub writes: prometheus_client::metrics::counter::Counter,
    /// Changes that needed no write: nothing people care about changed.
    pub skipped: prometheus_client::metrics::counter::Counter,
    /// Changes merged into a write already pending for the same device.
    pub coalesced: prometheus_client::metrics::counter::Counter,
    /// Writes that failed and were retried.
    pub failures: prometheus_client::metrics::counter::Counter,
    /// Changes for Devices that no longer exist.
    pub gone: prometheus_client::metrics::counter::Counter,
    /// Reports older than the one the status shows, ignored.
    pub stale: prometheus_client::metrics::counter::Counter,
    /// Reports about another object than the Device now under that name
    /// (deleted and created again), ignored.
    pub other_object: prometheus_client::metrics::counter::Counter,
    /// Writes the API server refused for good (400, 413, 422: another
    /// object by now, or a status the schema refuses), dropped.
    pub refused: prometheus_client::metrics::counter::Counter,
    /// Changes dropped unwritten because this replica no longer serves the
    /// Device's node (its shard moved): the agent sends them again to the
    /// replica that does.
    pub fenced: prometheus_client::metrics::counter::Counter,
    /// Devices with a status change not yet written (waiting or being
    /// written): the writer's backlog against its budget.
    pub backlog: prometheus_client::metrics::gauge::Gauge,
}

impl StatusMetrics {
    /// Registers the counters with `registry`.
    pub fn register(&self, registry: &mut prometheus_client::registry::Registry) {
        registry.register("writes", "Device status writes made", self.writes.clone());
        registry.register(
            "skipped",
            "Status changes that needed no write",
            self.skipped.clone(),
        );
        registry.register(
            "coalesced",
            "Status changes merged into a pending write",
            self.coalesced.clone(),
        );
        registry.register(
            "failures",
            "Status writes that failed and were retried",
            self.failures.clone(),
        );
        registry.register(
            "gone",
            "Status changes for Devices that no longer exist",
            self.gone.clone(),
        );
        registry.register(
            "stale",
            "Reports older than the one the status shows, ignored",
            self.stale.clone(),
        );
        registry.register(
            "other_object",
            "Reports about a Device since deleted and created again under the same name, ignored",
            self.other_object.clone(),
        );
        registry.register(
            "refused",
            "Status writes the API server refused for good (400, 413, 422), dropped",
            self.refused.clone(),
        );
        registry.register(
            "fenced",
            "Status changes dropped unwritten because another replica serves the node now",
            self.fenced.clone(),
        );
        registry.register(
            "backlog",
            "Devices with a status change not yet written",
            self.backlog.clone(),
        );
    }
}

#[derive(Debug, Default)]
struct Pending {
    changes: Vec<StatusChange>,
    completions: Vec<Completion>,
    // Carries more than a node's reachability (see State::urgent).
    urgent: bool,
}

#[derive(Debug, Default)]
struct State {
    // Devices with changes waiting, oldest first; may hold a key twice or a
    // key without pending changes (skipped when popped).
    queue: VecDeque<ResourceKey>,
    // The same for devices whose changes carry data (a report, a delivery,
    // a generation): written before those that only change reachability,
    // so after an outage the node's fleet-wide `Online` flip does not hold
    // back what changed while it was away. A device may be in both queues.
    urgent: VecDeque<ResourceKey>,
    pending: HashMap<ResourceKey, Pending>,
    // Devices with a write on its way: never two writes for one device at
    // once, so they cannot land out of order.
    writing: HashSet<ResourceKey>,
    // Data writes made in a row while reachability changes may wait.
    urgent_streak: u32,
    // The status as this manager last wrote it, with the uid of the object
    // it was written to: the base of the next write to that same object.
    written: HashMap<ResourceKey, (String, DeviceStatus)>,
}

/// The status writer. Cheap to clone; one [`StatusWriter::run`] task does
/// the writing.
#[derive(Clone, Debug)]
pub struct StatusWriter {
    inner: Arc<Inner>,
}

struct Inner {
    // Writes about a Device go through the client of its node's shard.
    fence: Fence,
    devices: Store<Device>,
    state: Mutex<State>,
    wake: Notify,
    limiter: DefaultDirectRateLimiter,
    metrics: StatusMetrics,
    events: Events,
    // Which nodes have an agent now: reachability is judged at write time.
    agents: std::sync::OnceLock<Arc<crate::agents::Agents>>,
}

impl std::fmt::Debug for Inner {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("StatusWriter").finish_non_exhaustive()
    }
}

impl StatusWriter {
    /// A writer that makes at most `writes_per_second` status writes, reading
    /// Devices' current state from the reflector `devices`.
    pub fn new(
        fence: Fence,
        devices: Store<Device>,
        writes_per_second: NonZeroU32,
        metrics: StatusMetrics,
        events: Events,
    ) -> Self {
        StatusWriter {
            inner: Arc::new(Inner {
                fence,
                devices,
                state: Mutex::default(),
                wake: Notify::new(),
                // No burst: writes are spread evenly over each second, so
                // no second sees more than the budget after a quiet spell.
                limiter: RateLimiter::direct(
                    Quota::per_second(writes_per_second).allow_burst(NonZeroU32::MIN),
                ),
                metrics,
                events,
                agents: std::sync::OnceLock::new(),
            }),
        }
    }

    /// Judges a node's reachability by `agents` when a write is made, not
    /// when the change was queued: an `Unreachable` queued just before the
    /// node's agent came back is written as reachable.
    pub fn judge_reachability_by(&self, agents: Arc<crate::agents::Agents>) {
        let _ = self.inner.agents.set(agents);
    }

    /// Waits for a write of the budget. Other writers of the controller
    /// (the rollout reconciler) spend the same budget as status writes.
    pub async fn spend(&self) {
        self.inner.limiter.until_ready().await;
    }

    /// The writer's counters.
    pub fn metrics(&self) -> &StatusMetrics {
        &self.inner.metrics
    }

    /// Queues a change; `completion` is told once it is durable.
    pub fn submit(
        &self,
        device: ResourceKey,
        change: StatusChange,
        completion: Option<Completion>,
    ) {
        let mut state = self.inner.state.lock().expect("status state");
        let State {
            queue,
            urgent,
            pending,
            ..
        } = &mut *state;
        let is_urgent = !matches!(
            change,
            StatusChange::NodeReachable | StatusChange::NodeUnreachable { .. }
        );
        let entry = pending.entry(device.clone()).or_default();
        if entry.changes.is_empty() {
            entry.urgent = is_urgent;
            match is_urgent {
                true => urgent.push_back(device),
                false => queue.push_back(device),
            }
        } else {
            self.inner.metrics.coalesced.inc();
            if is_urgent && !entry.urgent {
                entry.urgent = true;
                urgent.push_back(device);
            }
        }
        entry.changes.push(change);
        entry.completions.extend(completion);
        drop(state);
        self.inner.wake.notify_one();
    }

    /// Writes until the process ends: up to [`CONCURRENT_WRITES`] at once
    /// (for different devices), all paced by the one rate limit.
    pub async fn run(self) {
        let mut writes = tokio::task::JoinSet::new();
        loop {
            self.count_backlog();
            while writes.len() < CONCURRENT_WRITES {
                let Some((key, pending)) = self.next_write() else {
                    break;
                };
                let writer = self.clone();
                writes.spawn(async move {
                    let result = writer.write(&key, pending).await;
                    if result.is_err() {
                        tokio::time::sleep(Duration::from_millis(500)).await;
                    }
                    (key, result)
                });
            }
            tokio::select! {
                Some(done) = writes.join_next(), if !writes.is_empty() => {
                    let (key, result) = done.expect("a status write panicked");
                    if let Err(pending) = result {
                        // Back in line; newer changes merge into it.
                        self.inner.metrics.failures.inc();
                        self.requeue(key.clone(), pending);
                    }
                    self.write_done(&key);
                }
                () = self.inner.wake.notified() => {}
            }
        }
    }

    fn count_backlog(&self) {
        let state = self.inner.state.lock().expect("status state");
        let in_flight_only = state
            .writing
            .iter()
            .filter(|key| !state.pending.contains_key(*key))
            .count();
        let backlog = state.pending.len() + in_flight_only;
        drop(state);
        self.inner.metrics.backlog.set(backlog as i64);
    }

    /// The oldest device with changes and no write on its way, urgent ones
    /// first.
    fn next_write(&self) -> Option<(ResourceKey, Pending)> {
        let mut state = self.inner.state.lock().expect("status state");
        let State {
            queue,
            urgent,
            pending,
            writing,
            urgent_streak,
            ..
        } = &mut *state;
        // Reachability gets its share even while data fills the budget.
        if *urgent_streak + 1 >= REACHABILITY_SHARE
            && let Some(next) = pop_ready(queue, pending, writing)
        {
            *urgent_streak = 0;
            return Some(next);
        }
        if let Some(next) = pop_ready(urgent, pending, writing) {
            *urgent_streak += 1;
            return Some(next);
        }
        *urgent_streak = 0;
        pop_ready(queue, pending, writing)
    }

    /// A write of `key` is done: its next changes may go.
    fn write_done(&self, key: &ResourceKey) {
        let mut state = self.inner.state.lock().expect("status state");
        state.writing.remove(key);
        let waiting = state.pending.contains_key(key);
        drop(state);
        if waiting {
            self.inner.wake.notify_one();
        }
    }

    fn requeue(&self, key: ResourceKey, mut pending: Pending) {
        let mut state = self.inner.state.lock().expect("status state");
        let State {
            queue,
            urgent,
            pending: all,
            ..
        } = &mut *state;
        match all.get_mut(&key) {
            Some(newer) => {
                if pending.urgent && !newer.urgent {
                    urgent.push_back(key.clone());
                }
                pending.urgent |= newer.urgent;
                pending.changes.append(&mut newer.changes);
                pending.completions.append(&mut newer.completions);
                *newer = pending;
            }
            None => {
                match pending.urgent {
                    true => urgent.push_back(key.clone()),
                    false => queue.push_back(key.clone()),
                }
                all.insert(key, pending);
            }
        }
    }

    async fn write(&self, key: &ResourceKey, pending: Pending) -> Result<(), Pending> {
        let object = ObjectRef::<Device>::new(&key.name).within(&key.namespace);
        let Some(device) = self.inner.devices.get(&object) else {
            self.inner.metrics.gone.inc();
            complete(&pending.completions);
            return Ok(());
        };
        let uid = device.metadata.uid.clone().unwrap_or_default();
        let node = device.spec.node.clone();
        if !self.inner.fence.serves(&node) {
            self.write_elsewhere(key, &device, &uid, &pending).await;
            return Ok(());
        }
        let mut base = {
            let state = self.inner.state.lock().expect("status state");
            state
                .written
                .get(key)
                .filter(|(written_to, _)| *written_to == uid)
                .map(|(_, status)| status.clone())
                .unwrap_or_else(|| device.status.clone().unwrap_or_default())
        };
        if !self.inner.fence.leads() {
            // The leader writes the rollout part; the latest seen is kept.
            base.rollout = device.status.as_ref().and_then(|s| s.rollout.clone());
        }
        let now = Timestamp::now();
        // The reconciler may have seen a generation this reflector has not
        // caught up with yet; the status is about the newest.
        let generation = pending
            .changes
            .iter()
            .filter_map(|c| match c {
                StatusChange::Observed { generation } => Some(*generation),
                _ => None,
            })
            .fold(device.metadata.generation.unwrap_or_default(), i64::max);
        let other_object = pending
            .changes
            .iter()
            .filter(|c| matches!(c, StatusChange::Reported { uid: about, .. } if *about != uid))
            .count();
        self.inner.metrics.other_object.inc_by(other_object as u64);
        let changes = match self.inner.agents.get() {
            Some(agents) => reachability_now(&pending.changes, |node| agents.is_connected(node)),
            None => pending.changes.clone(),
        };
        let stale = count_stale(&base, &changes);
        self.inner.metrics.stale.inc_by(stale);
        let next = next_status(&base, &changes, &uid, generation, now);
        if !needs_write(&base, &next) {
            self.inner.metrics.skipped.inc();
            if next != base {
                // Only the report's origin moved: remember it for the guard.
                let mut state = self.inner.state.lock().expect("status state");
                state.written.insert(key.clone(), (uid, next));
            }
            complete(&pending.completions);
            return Ok(());
        }

        self.inner.limiter.until_ready().await;
        let api: Api<Device> = Api::namespaced(self.inner.fence.node(&node), &key.namespace);
        // The uid is a precondition (a JSON Patch `test`; server-side apply
        // ignores `metadata.uid`): if the Device was deleted and created
        // again since the reflector saw it, the write is refused instead of
        // landing on the new object.
        let patch = status_patch(&uid, &next);
        let params = PatchParams {
            field_manager: Some(FIELD_MANAGER.to_owned()),
            ..Default::default()
        };
        match api
            .patch_status(&key.name, &params, &Patch::Json::<()>(patch))
            .await
        {
            Ok(_) => {
                self.inner.metrics.writes.inc();
                let applied =
                    |s: &DeviceStatus| s.applied_generation.is_some_and(|a| a >= generation);
                if applied(&next) && !applied(&base) {
                    self.inner.events.publish(
                        resource_reference(key, &uid),
                        Note {
                            warning: false,
                            reason: "Applied",
                            action: "Report",
                            text: "the device applied the current spec".to_owned(),
                        },
                    );
                }
                self.inner
                    .state
                    .lock()
                    .expect("status state")
                    .written
                    .insert(key.clone(), (uid, next));
                complete(&pending.completions);
                Ok(())
            }
            // A write that can never succeed: another object by now (the
            // uid test fails), or a status the schema refuses. Retrying it
            // forever would hold the device's later changes back.
            Err(kube::Error::Api(status)) if matches!(status.code, 400 | 413 | 422) => {
                self.inner.metrics.refused.inc();
                tracing::warn!(device = %key, %uid, code = status.code, message = %status.message, "status write refused by the API server; dropped");
                self.inner
                    .state
                    .lock()
                    .expect("status state")
                    .written
                    .remove(key);
                complete(&pending.completions);
                Ok(())
            }
            Err(kube::Error::Api(status)) if status.code == 404 => {
                self.inner.metrics.gone.inc();
                self.inner
                    .state
                    .lock()
                    .expect("status state")
                    .written
                    .remove(key);
                complete(&pending.completions);
                Ok(())
            }
            Err(error) => {
                tracing::warn!(device = %key, %error, "status write failed; will retry");
                Err(pending)
            }
        }
    }

    /// Changes about a Device whose node another replica serves now: they
    /// are dropped uncompleted (its agent sends them again to that
    /// replica), except a rollout part while this replica leads, which is
    /// written alone (the leader runs the rollouts).
    async fn write_elsewhere(
        &self,
        key: &ResourceKey,
        device: &Device,
        uid: &str,
        pending: &Pending,
    ) {
        let part = pending
            .changes
            .iter()
            .rev()
            .find_map(|change| match change {
                StatusChange::Rollout { uid: about, part } if about == uid => Some(part),
                _ => None,
            });
        let shown = device.status.as_ref().and_then(|s| s.rollout.as_ref());
        let Some(part) = part.filter(|p| Some(*p) != shown && self.inner.fence.leads()) else {
            self.inner.metrics.fenced.inc();
            return;
        };
        self.inner.limiter.until_ready().await;
        let api: Api<Device> = Api::namespaced(self.inner.fence.leader(), &key.namespace);
        let patch: json_patch::Patch = serde_json::from_value(serde_json::json!([
            { "op": "test", "path": "/metadata/uid", "value": uid },
            { "op": "add", "path": "/status/rollout", "value": part },
        ]))
        .expect("a test and an add are a JSON Patch");
        let params = PatchParams {
            field_manager: Some(FIELD_MANAGER.to_owned()),
            ..Default::default()
        };
        match api
            .patch_status(&key.name, &params, &Patch::Json::<()>(patch))
            .await
        {
            Ok(_) => {
                self.inner.metrics.writes.inc();
            }
            // The rollout shows it again at its next step if it is not
            // shown by then.
            Err(error) => {
                self.inner.metrics.failures.inc();
                tracing::debug!(device = %key, %error, "rollout part not written");
            }
        }
    }

    /// Forgets the Devices of the nodes `moved` says, as after taking over
    /// their shard: another replica may have written them meanwhile.
    pub fn forget_nodes(&self, moved: impl Fn(&str) -> bool) {
        let devices = &self.inner.devices;
        self.inner
            .state
            .lock()
            .expect("status state")
            .written
            .retain(|key, _| {
                let object = ObjectRef::<Device>::new(&key.name).within(&key.namespace);
                devices.get(&object).is_some_and(|d| !moved(&d.spec.node))
            });
    }

    /// Forgets every Device, as after a relist: the next write of each
    /// starts from the status the reflector shows.
    pub fn forget_all(&self) {
        self.inner
            .state
            .lock()
            .expect("status state")
            .written
            .clear();
    }

    /// Forgets a deleted Device.
    pub fn forget(&self, key: &ResourceKey) {
        self.inner
            .state
            .lock()
            .expect("status state")
            .written
            .remove(key);
    }
}

/// `changes` with each node's reachability as it is now: a node found
/// unreachable earlier whose agent `is_connected` again is reachable.
pub fn reachability_now(
    changes: &[StatusChange],
    is_connected: impl Fn(&str) -> bool,
) -> Vec<StatusChange> {
    changes
        .iter()
        .map(|change| match change {
            StatusChange::NodeUnreachable { node } if is_connected(node) => {
                StatusChange::NodeReachable
            }
            other => other.clone(),
        })
        .collect()
}

/// The patch that sets `status` on the object with `uid`, and on no other.
fn status_patch(uid: &str, status: &DeviceStatus) -> json_patch::Patch {
    serde_json::from_value(serde_json::json!([
        { "op": "test", "path": "/metadata/uid", "value": uid },
        { "op": "add", "path": "/status", "value": status },
    ]))
    .expect("a test and an add are a JSON Patch")
}

/// Takes the first device of `queue` with changes pending and no write on
/// its way; devices with a write on its way keep their place.
fn pop_ready(
    queue: &mut VecDeque<ResourceKey>,
    pending: &mut HashMap<ResourceKey, Pending>,
    writing: &mut HashSet<ResourceKey>,
) -> Option<(ResourceKey, Pending)> {
    let mut busy = Vec::new();
    let next = loop {
        let Some(key) = queue.pop_front() else {
            break None;
        };
        if writing.contains(&key) {
            busy.push(key);
            continue;
        }
        if let Some(changes) = pending.remove(&key) {
            writing.insert(key.clone());
            break Some((key, changes));
        }
    };
    // Their turn comes when their write is done.
    for key in busy.into_iter().rev() {
        queue.push_front(key);
    }
    next
}

fn complete(completions: &[Completion]) {
    for c in completions {
        // A session that ended no longer needs to know.
        let _ = c.notify.send(c.seq);
    }
}

/// The status after `changes`, for a Device at `generation` with `uid`.
/// Pure, so the rules of what changes when are tested without an API server.
pub fn next_status(
    base: &DeviceStatus,
    changes: &[StatusChange],
    uid: &str,
    generation: i64,
    now: Timestamp,
) -> DeviceStatus {
    let mut next = base.clone();
    let mut reported = false;
    let mut held: Option<(i64, String)> = None;
    for change in changes {
        match change {
            StatusChange::Delivered {
                uid: stored,
                generation: g,
            } => {
                if stored == uid && next.delivered_generation.is_none_or(|d| d < *g) {
                    next.delivered_generation = Some(*g);
                }
                // A later generation stored means the refusal is over.
                if let Some(failed) = next.conditions.iter_mut().find(|c| {
                    c.type_ == condition::UPDATE_FAILED
                        && c.status == "True"
                        && c.observed_generation.is_some_and(|f| f <= *g)
                }) && stored == uid
                {
                    failed.status = "False".to_owned();
                    failed.reason = "Delivered".to_owned();
                    failed.message = format!("the agent stored generation {g}");
                    failed.last_transition_time = Time(now);
                }
            }
            StatusChange::NodeUnreachable { node } => {
                reported = false;
                crate::conditions::set(
                    &mut next.conditions,
                    Condition {
                        type_: condition::ONLINE.to_owned(),
                        status: "Unknown".to_owned(),
                        reason: NODE_UNREACHABLE.to_owned(),
                        message: format!("no agent of node {node} is connected"),
                        observed_generation: Some(generation),
                        last_transition_time: Time(now),
                    },
                );
            }
            StatusChange::NodeReachable => {
                if is_unreachable(&next) {
                    set_condition(
                        &mut next.conditions,
                        condition::ONLINE,
                        true,
                        "NodeReconnected",
                        "the node's agent is connected again",
                        generation,
                        now,
                    );
                }
            }
            StatusChange::Observed { generation: g } => {
                if next.observed_generation.is_none_or(|o| o < *g) {
                    next.observed_generation = Some(*g);
                }
            }
            StatusChange::Rollout { uid: judged, part } => {
                if judged == uid {
                    next.rollout = Some(part.clone());
                }
            }
            StatusChange::Rejected {
                uid: sent,
                generation: g,
                reason,
            } => {
                if sent == uid {
                    set_condition(
                        &mut next.conditions,
                        condition::UPDATE_FAILED,
                        true,
                        "RejectedByAgent",
                        reason,
                        *g,
                        now,
                    );
                }
            }
            StatusChange::Reported {
                uid: about,
                applied_generation,
                properties,
                firmware_version,
                firmware_failure,
                health,
                edge_rollback,
                held_at_edge,
                overrides,
                received_at_ms,
                origin,
            } => {
                if about != uid {
                    continue;
                }
                if let Some(origin) = origin {
                    if origin.is_stale_against(next.last_report.as_ref()) {
                        continue;
                    }
                    next.last_report = Some(origin.clone());
                }
                reported = true;
                held = held_at_edge
                    .as_ref()
                    .map(|h| (h.generation, h.message.clone()));
                if let Some(failure) = firmware_failure {
                    set_condition(
                        &mut next.conditions,
                        condition::UPDATE_FAILED,
                        true,
                        INSTALL_FAILED,
                        &format!(
                            "firmware {} did not install: {}",
                            failure.version, failure.reason
                        ),
                        *applied_generation,
                        now,
                    );
                }
                if let Some(h) = health {
                    set_health(&mut next.conditions, h, now);
                }
                if let Some(r) = edge_rollback {
                    set_condition(
                        &mut next.conditions,
                        condition::ROLLED_BACK,
                        true,
                        condition::SITE_THRESHOLD_CROSSED,
                        &r.message,
                        r.generation,
                        now,
                    );
                }
                next.applied_generation = Some(*applied_generation);
                next.reported = properties.clone();
                next.overrides = overrides.clone();
                if firmware_version.is_some() {
                    next.firmware_version = firmware_version.clone();
                }
                let seen = Timestamp::from_millisecond(*received_at_ms).unwrap_or(now);
                let stale = next.last_seen.as_ref().is_none_or(|t| {
                    seen.duration_since(t.0).unsigned_abs() >= LAST_SEEN_RESOLUTION
                });
                if stale {
                    next.last_seen = Some(Time(seen));
                }
            }
        }
    }

    let delivered = next.delivered_generation.is_some_and(|d| d >= generation);
    let applied = next.applied_generation.is_some_and(|a| a >= generation);
    // Why the device has not applied it yet, if its agent holds it back:
    // said by the latest report, or kept from the status until one comes.
    let held = match reported {
        true => held.filter(|(g, _)| *g == generation).map(|(_, m)| m),
        false => next
            .conditions
            .iter()
            .find(|c| {
                c.type_ == condition::APPLIED
                    && c.reason == condition::HELD_AT_SITE
                    && c.observed_generation == Some(generation)
            })
            .map(|c| c.message.clone()),
    };
    let failed = next.conditions.iter().any(|c| {
        c.type_ == condition::UPDATE_FAILED
            && c.status == "True"
            && c.observed_generation == Some(generation)
    });
    next.phase = Some(if is_unreachable(&next) {
        DevicePhase::Unreachable
    } else if applied {
        DevicePhase::Applied
    } else if failed {
        DevicePhase::Failed
    } else if delivered {
        DevicePhase::Delivered
    } else {
        DevicePhase::Pending
    });
    set_condition(
        &mut next.conditions,
        condition::DELIVERED,
        delivered,
        if delivered {
            "StoredAtEdge"
        } else {
            "NotYetDelivered"
        },
        &format!(
            "the agent holds generation {}",
            next.delivered_generation.unwrap_or(0)
        ),
        generation,
        now,
    );
    let shown_applied = format!(
        "the device applied generation {}",
        next.applied_generation.unwrap_or(0)
    );
    let (reason, message) = match (applied, &held) {
        (true, _) => ("DeviceApplied", shown_applied.as_str()),
        (false, Some(why)) => (condition::HELD_AT_SITE, why.as_str()),
        (false, None) => ("NotYetApplied", shown_applied.as_str()),
    };
    set_condition(
        &mut next.conditions,
        condition::APPLIED,
        applied,
        reason,
        message,
        generation,
        now,
    );
    if reported {
        set_condition(
            &mut next.conditions,
            condition::ONLINE,
            true,
            "Reporting",
            "the device reports",
            generation,
            now,
        );
    }
    next
}

/// Whether `next` differs from `base` in a field people care about: a new
/// report origin alone waits for the next write that is due anyway.
pub fn needs_write(base: &DeviceStatus, next: &DeviceStatus) -> bool {
    let mut same_origin = next.clone();
    same_origin.last_report = base.last_report.clone();
    same_origin != *base
}

/// How many reports among `changes` are stale against `base` and each
/// other (what [`next_status`] will skip).
fn count_stale(base: &DeviceStatus, changes: &[StatusChange]) -> u64 {
    let mut shown = base.last_report.clone();
    let mut stale = 0;
    for change in changes {
        if let StatusChange::Reported {
            origin: Some(origin),
            ..
        } = change
        {
            if origin.is_stale_against(shown.as_ref()) {
                stale += 1;
            } else {
                shown = Some(origin.clone());
            }
        }
    }
    stale
}

/// The reason of `Online=Unknown` when a Device's node has no agent.
pub const NODE_UNREACHABLE: &str = "NodeUnreachable";

fn is_unreachable(status: &DeviceStatus) -> bool {
    status
        .conditions
        .iter()
        .any(|c| c.type_ == condition::ONLINE && c.status == "Unknown")
}

/// Shows the agent's health check as the `Healthy` condition of the
/// generation it checked.
fn set_health(
    conditions: &mut Vec<Condition>,
    h: &edgefleet_shared::health_check::HealthState,
    now: Timestamp,
) {
    use edgefleet_shared::health_check::HealthStage;
    let (status, reason) = match h.stage {
        HealthStage::Passed => ("True", condition::HEALTH_CHECK_PASSED),
        HealthStage::Failed => ("False", condition::HEALTH_CHECK_FAILED),
        HealthStage::Inconclusive => ("Unknown", condition::HEALTH_CHECK_INCONCLUSIVE),
        HealthStage::Baking => ("Unknown", condition::BAKING),
    };
    crate::conditions::set(
        conditions,
        Condition {
            type_: condition::HEALTHY.to_owned(),
            status: status.to_owned(),
            reason: reason.to_owned(),
            message: h.message.clone(),
            observed_generation: Some(h.generation),
            last_transition_time: Time(now),
        },
    );
}

fn set_condition(
    conditions: &mut Vec<Condition>,
    type_: &str,
    value: bool,
    reason: &str,
    message: &str,
    generation: i64,
    now: Timestamp,
) {
    let status = if value { "True" } else { "False" };
    let wanted = Condition {
        type_: type_.to_owned(),
        status: status.to_owned(),
        reason: reason.to_owned(),
        message: message.to_owned(),
        observed_generation: Some(generation),
        last_transition_time: Time(now),
    };
    crate::conditions::set(conditions, wanted);
}

#[cfg(test)]
mod tests {
    use super::*;
    use kube::Client;

    fn at(ms: i64) -> Timestamp {
        Timestamp::from_millisecond(ms).unwrap()
    }

    fn report(applied: i64, temperature: f64, ms: i64) -> StatusChange {
        StatusChange::Reported {
            uid: "u".into(),
            applied_generation: applied,
            properties: BTreeMap::from([(
                "temperature".to_owned(),
                PropertyValue::Float(temperature),
            )]),
            firmware_version: Some("1.0.0".into()),
            firmware_failure: None,
            health: None,
            edge_rollback: None,
            held_at_edge: None,
            overrides: Vec::new(),
            received_at_ms: ms,
            origin: None,
        }
    }

    #[test]
    fn a_firmware_that_did_not_install_fails_the_generation_the_device_applied() {
        let mut failed = report(4, 20.0, 1_000);
        if let StatusChange::Reported {
            firmware_failure, ..
        } = &mut failed
        {
            *firmware_failure = Some(edgefleet_shared::codec::FirmwareFailure {
                version: "2.0.0".into(),
                reason: "checksum mismatch".into(),
            });
        }
        let next = next_status(&DeviceStatus::default(), &[failed], "u", 4, at(1_000));
        let c = next
            .conditions
            .iter()
            .find(|c| c.type_ == condition::UPDATE_FAILED)
            .expect("UpdateFailed");
        assert_eq!(
            (c.status.as_str(), c.reason.as_str(), c.observed_generation),
            ("True", INSTALL_FAILED, Some(4))
        );
        assert_eq!(
            c.message,
            "firmware 2.0.0 did not install: checksum mismatch"
        );
        let plain = next_status(
            &DeviceStatus::default(),
            &[report(4, 20.0, 1_000)],
            "u",
            4,
            at(1_000),
        );
        assert!(
            !plain
                .conditions
                .iter()
                .any(|c| c.type_ == condition::UPDATE_FAILED),
            "a report without a failure fails nothing"
        );
    }

    #[test]
    fn a_rollback_by_the_agent_shows_as_rolled_back_for_the_generation_it_undid() {
        // The device runs generation 4's predecessor again, under 3.
        let mut back = report(3, 20.0, 2_000);
        if let StatusChange::Reported { edge_rollback, .. } = &mut back {
            *edge_rollback = Some(Box::new(edgefleet_shared::site_rollback::EdgeRollback {
                rollout: "fw-2".into(),
                generation: 4,
                at_ms: 1_500,
                message: "2 of 2 failed".into(),
            }));
        }
        let next = next_status(&DeviceStatus::default(), &[back], "u", 4, at(2_000));
        let c = next
            .conditions
            .iter()
            .find(|c| c.type_ == condition::ROLLED_BACK)
            .expect("RolledBack");
        assert_eq!(
            (
                c.status.as_str(),
                c.reason.as_str(),
                c.observed_generation,
                c.message.as_str()
            ),
            (
                "True",
                condition::SITE_THRESHOLD_CROSSED,
                Some(4),
                "2 of 2 failed"
            )
        );
        assert_eq!(next.applied_generation, Some(3));
    }

    fn report_from(store: &str, seq: u64, temperature: f64) -> StatusChange {
        let StatusChange::Reported {
            applied_generation,
            properties,
            firmware_version,
            received_at_ms,
            ..
        } = report(1, temperature, 1_000)
        else {
            unreachable!()
        };
        StatusChange::Reported {
            uid: "u".into(),
            applied_generation,
            properties,
            firmware_version,
            firmware_failure: None,
            health: None,
            edge_rollback: None,
            held_at_edge: None,
            overrides: Vec::new(),
            received_at_ms,
            origin: Some(ReportOrigin {
                store: store.into(),
                seq,
            }),
        }
    }

    #[tokio::test]
    async fn data_is_written_before_reachability_flips() {
        // A client that is never used: nothing here reaches a server.
        let config = kube::Config::new("http://127.0.0.1:9".parse().unwrap());
        let client = Client::try_from(config).unwrap();
        let (devices, _writer) = kube::runtime::reflector::store::<Device>();
        let events = Events::new(client.clone(), None, Default::default());
        let writer = StatusWriter::new(
            Fence::single(client),
            devices,
            NonZeroU32::new(50).unwrap(),
            StatusMetrics::default(),
            events,
        );
        let key = |n: &str| ResourceKey::device("plant", n);
        // A node comes back: every device flips Online; then two report.
        for n in ["a", "b", "c", "d"] {
            writer.submit(key(n), StatusChange::NodeReachable, None);
        }
        writer.submit(key("c"), report(1, 20.0, 1), None);
        writer.submit(key("e"), report(1, 21.0, 1), None);
        let order: Vec<String> = std::iter::from_fn(|| writer.next_write())
            .map(|(k, pending)| {
                let kinds = pending.changes.len();
                format!("{}:{kinds}", k.name)
            })
            .collect();
        // c's flip rides along with its report; the rest keep their order.
        assert_eq!(order, ["c:2", "e:1", "a:1", "b:1", "d:1"]);
    }

    #[tokio::test]
    async fn reachability_gets_its_share_while_data_fills_the_budget() {
        let config = kube::Config::new("http://127.0.0.1:9".parse().unwrap());
        let client = Client::try_from(config).unwrap();
        let (devices, _writer) = kube::runtime::reflector::store::<Device>();
        let events = Events::new(client.clone(), None, Default::default());
        let writer = StatusWriter::new(
            Fence::single(client),
            devices,
            NonZeroU32::new(50).unwrap(),
            StatusMetrics::default(),
            events,
        );
        let key = |n: String| ResourceKey::device("plant", n);
        for n in ["r1", "r2"] {
            writer.submit(key(n.into()), StatusChange::NodeReachable, None);
        }
        for n in 0..10 {
            writer.submit(key(format!("d{n}")), report(1, 20.0, 1), None);
        }
        let order: Vec<String> = std::iter::from_fn(|| writer.next_write())
            .map(|(k, _)| k.name)
            .collect();
        assert_eq!(
            order,
            [
                "d0", "d1", "d2", "r1", "d3", "d4", "d5", "r2", "d6", "d7", "d8", "d9"
            ]
        );
    }

    #[test]
    fn an_unreachable_node_whose_agent_is_back_is_written_reachable() {
        let changes = [
            StatusChange::NodeUnreachable {
                node: "edge-1".into(),
            },
            StatusChange::NodeUnreachable {
                node: "edge-2".into(),
            },
        ];
        let now = reachability_now(&changes, |node| node == "edge-1");
        assert_eq!(
            now,
            [
                StatusChange::NodeReachable,
                StatusChange::NodeUnreachable {
                    node: "edge-2".into()
                }
            ]
        );
    }

    #[test]
    fn a_stale_report_never_overwrites_a_newer_one() {
        let s1 = next_status(
            &DeviceStatus::default(),
            &[report_from("a", 10, 21.0)],
            "u",
            1,
            at(1),
        );
        assert_eq!(
            s1.last_report,
            Some(ReportOrigin {
                store: "a".into(),
                seq: 10
            })
        );
        // A resend of seq 10 and an older seq 7 from the same store: ignored.
        for stale in [report_from("a", 10, 5.0), report_from("a", 7, 5.0)] {
            assert_eq!(count_stale(&s1, std::slice::from_ref(&stale)), 1);
            assert_eq!(next_status(&s1, &[stale], "u", 1, at(2)), s1);
        }
        // A newer seq wins; so does any seq from another (rebuilt) store.
        let s2 = next_status(&s1, &[report_from("a", 11, 22.0)], "u", 1, at(3));
        assert_eq!(s2.reported["temperature"], PropertyValue::Float(22.0));
        let s3 = next_status(&s2, &[report_from("b", 1, 23.0)], "u", 1, at(4));
        assert_eq!(s3.reported["temperature"], PropertyValue::Float(23.0));
        // Within one batch too: the newest seq decides, whatever the order.
        let batch = [report_from("a", 12, 24.0), report_from("a", 11, 5.0)];
        assert_eq!(count_stale(&s2, &batch), 1);
        let s4 = next_status(&s2, &batch, "u", 1, at(5));
        assert_eq!(s4.reported["temperature"], PropertyValue::Float(24.0));
    }

    #[test]
    fn a_new_report_origin_alone_causes_no_write() {
        let s1 = next_status(
            &DeviceStatus::default(),
            &[report_from("a", 1, 21.0)],
            "u",
            1,
            at(1),
        );
        let same_values = next_status(&s1, &[report_from("a", 2, 21.0)], "u", 1, at(2));
        assert_ne!(same_values, s1, "the origin moved");
        assert!(!needs_write(&s1, &same_values));
        let new_values = next_status(&s1, &[report_from("a", 3, 25.0)], "u", 1, at(3));
        assert!(needs_write(&s1, &new_values));
    }

    #[test]
    fn a_generation_held_at_the_edge_says_so_until_the_device_applies_it() {
        let held = |report: StatusChange, generation: i64| match report {
            StatusChange::Reported {
                uid,
                applied_generation,
                properties,
                firmware_version,
                received_at_ms,
                ..
            } => StatusChange::Reported {
                uid,
                applied_generation,
                properties,
                firmware_version,
                firmware_failure: None,
                health: None,
                edge_rollback: None,
                held_at_edge: Some(Box::new(edgefleet_shared::site_pacing::HeldAtEdge {
                    rollout: "fw-2".into(),
                    generation,
                    since_ms: 0,
                    message: "held by the agent until site north has a place".into(),
                })),
                overrides: Vec::new(),
                received_at_ms,
                origin: None,
            },
            _ => unreachable!(),
        };
        let applied = |s: &DeviceStatus| {
            let c = s.conditions.iter().find(|c| c.type_ == "Applied").unwrap();
            (c.status.clone(), c.reason.clone())
        };
        // Generation 2 is held: the device still runs 1.
        let s1 = next_status(
            &DeviceStatus::default(),
            &[held(report(1, 20.0, 1), 2)],
            "u",
            2,
            at(1),
        );
        assert_eq!(
            applied(&s1),
            ("False".into(), condition::HELD_AT_SITE.into())
        );
        // A change without a report keeps the reason; a hold of another
        // generation does not count.
        let delivered = StatusChange::Delivered {
            uid: "u".into(),
            generation: 2,
        };
        let s2 = next_status(&s1, &[delivered], "u", 2, at(2));
        assert_eq!(applied(&s2).1, condition::HELD_AT_SITE);
        let s3 = next_status(&s2, &[held(report(1, 20.0, 3), 1)], "u", 2, at(3));
        assert_eq!(applied(&s3), ("False".into(), "NotYetApplied".into()));
        // Released, and applied.
        let s4 = next_status(&s1, &[report(1, 20.0, 4)], "u", 2, at(4));
        assert_eq!(applied(&s4), ("False".into(), "NotYetApplied".into()));
        let s5 = next_status(&s4, &[report(2, 20.0, 5)], "u", 2, at(5));
        assert_eq!(applied(&s5), ("True".into(), "DeviceApplied".into()));
    }

    #[test]
    fn the_pipeline_moves_pending_delivered_applied() {
        let s0 = next_status(&DeviceStatus::default(), &[], "u", 2, at(0));
        assert_eq!(s0.phase, Some(DevicePhase::Pending));
        let s1 = next_status(
            &s0,
            &[StatusChange::Delivered {
                uid: "u".into(),
                generation: 2,
            }],
            "u",
            2,
            at(1),
        );
        assert_eq!(s1.phase, Some(DevicePhase::Delivered));
        assert_eq!(s1.delivered_generation, Some(2));
        let s2 = next_status(&s1, &[report(2, 20.0, 2)], "u", 2, at(2));
        assert_eq!(s2.phase, Some(DevicePhase::Applied));
        let applied = s2.conditions.iter().find(|c| c.type_ == "Applied").unwrap();
        assert_eq!(applied.status, "True");
        assert_eq!(applied.observed_generation, Some(2));
    }

    #[test]
    fn an_unreachable_node_makes_its_devices_online_unknown_until_it_is_back() {
        let applied = next_status(
            &DeviceStatus::default(),
            &[report(1, 20.0, 1)],
            "u",
            1,
            at(1),
        );
        let gone = StatusChange::NodeUnreachable {
            node: "edge-1".into(),
        };
        let s1 = next_status(&applied, std::slice::from_ref(&gone), "u", 1, at(2));
        assert_eq!(s1.phase, Some(DevicePhase::Unreachable));
        let online = |s: &DeviceStatus| {
            let c = s.conditions.iter().find(|c| c.type_ == "Online").unwrap();
            (c.status.clone(), c.reason.clone())
        };
        assert_eq!(online(&s1), ("Unknown".into(), "NodeUnreachable".into()));
        // Unreachable again: nothing to write.
        assert_eq!(next_status(&s1, &[gone], "u", 1, at(3)), s1);
        // Other changes keep it unreachable.
        let s2 = next_status(
            &s1,
            &[StatusChange::Observed { generation: 1 }],
            "u",
            1,
            at(4),
        );
        assert_eq!(s2.phase, Some(DevicePhase::Unreachable));

        let s3 = next_status(&s2, &[StatusChange::NodeReachable], "u", 1, at(5));
        assert_eq!(s3.phase, Some(DevicePhase::Applied));
        assert_eq!(online(&s3), ("True".into(), "NodeReconnected".into()));
        // Reachable while reachable: nothing to write.
        assert_eq!(
            next_status(&s3, &[StatusChange::NodeReachable], "u", 1, at(6)),
            s3
        );
    }

    #[test]
    fn observed_generation_only_moves_forward() {
        let s = next_status(
            &DeviceStatus::default(),
            &[
                StatusChange::Observed { generation: 3 },
                StatusChange::Observed { generation: 2 },
            ],
            "u",
            3,
            at(0),
        );
        assert_eq!(s.observed_generation, Some(3));
    }

    #[test]
    fn a_refusal_fails_the_generation_until_a_later_one_is_stored() {
        let rejected = |g: i64| StatusChange::Rejected {
            uid: "u".into(),
            generation: g,
            reason: "property fan: not a bool".into(),
        };
        let s1 = next_status(&DeviceStatus::default(), &[rejected(2)], "u", 2, at(0));
        assert_eq!(s1.phase, Some(DevicePhase::Failed));
        let failed = s1
            .conditions
            .iter()
            .find(|c| c.type_ == "UpdateFailed")
            .unwrap();
        assert_eq!(
            (failed.status.as_str(), failed.reason.as_str()),
            ("True", "RejectedByAgent")
        );
        assert_eq!(failed.message, "property fan: not a bool");

        // A refusal of another uid (a recreated Device) does not count.
        let other = next_status(
            &DeviceStatus::default(),
            &[StatusChange::Rejected {
                uid: "old".into(),
                generation: 2,
                reason: "x".into(),
            }],
            "u",
            2,
            at(0),
        );
        assert_eq!(other.phase, Some(DevicePhase::Pending));

        // Generation 3 is stored: the failure is over.
        let s2 = next_status(
            &s1,
            &[StatusChange::Delivered {
                uid: "u".into(),
                generation: 3,
            }],
            "u",
            3,
            at(1),
        );
        assert_eq!(s2.phase, Some(DevicePhase::Delivered));
        let failed = s2
            .conditions
            .iter()
            .find(|c| c.type_ == "UpdateFailed")
            .unwrap();
        assert_eq!(failed.status, "False");
    }

    #[test]
    fn a_delivery_of_a_deleted_and_recreated_device_does_not_count() {
        let s = next_status(
            &DeviceStatus::default(),
            &[StatusChange::Delivered {
                uid: "old".into(),
                generation: 5,
            }],
            "new",
            1,
            at(0),
        );
        assert_eq!(s.delivered_generation, None);
    }

    #[test]
    fn a_repeated_report_within_the_resolution_changes_nothing() {
        let s1 = next_status(
            &DeviceStatus::default(),
            &[report(1, 20.0, 1_000)],
            "u",
            1,
            at(1_000),
        );
        let s2 = next_status(&s1, &[report(1, 20.0, 30_000)], "u", 1, at(30_000));
        assert_eq!(s1, s2, "no field people care about changed");
        let s3 = next_status(&s1, &[report(1, 20.0, 61_000)], "u", 1, at(61_000));
        assert_ne!(
            s1.last_seen, s3.last_seen,
            "lastSeen moves after the resolution"
        );
        let s4 = next_status(&s1, &[report(1, 20.5, 2_000)], "u", 1, at(2_000));
        assert_ne!(s1, s4, "a new value is written at once");
    }

    #[test]
    fn coalesced_reports_end_at_the_latest() {
        let s = next_status(
            &DeviceStatus::default(),
            &[report(1, 20.0, 1), report(1, 21.0, 2), report(2, 22.0, 3)],
            "u",
            2,
            at(3),
        );
        assert_eq!(s.reported["temperature"], PropertyValue::Float(22.0));
        assert_eq!(s.applied_generation, Some(2));
    }

    #[test]
    fn a_condition_keeps_its_transition_time_while_unchanged() {
        let s1 = next_status(
            &DeviceStatus::default(),
            &[report(1, 20.0, 1)],
            "u",
            1,
            at(1_000),
        );
        let s2 = next_status(&s1, &[report(1, 21.0, 5_000)], "u", 1, at(5_000));
        let t = |s: &DeviceStatus| {
            s.conditions
                .iter()
                .find(|c| c.type_ == "Applied")
                .unwrap()
                .last_transition_time
                .clone()
        };
        assert_eq!(t(&s1), t(&s2));
    }
}
