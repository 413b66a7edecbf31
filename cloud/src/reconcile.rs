//! The Device reconciler (a kube-runtime `Controller`).
//!
//! What it owns:
//! - `status.observedGeneration`: a new generation is accepted, announced
//!   with an `Accepted` Event (and a `NodeNotFound` warning when no agent of
//!   the Device's node has ever connected), and written through the status
//!   writer, so it counts against the same budget as everything else;
//! - the finalizer [`FINALIZER`]: a deleted Device is let go once its node's
//!   agent has acknowledged the removal, so `kubectl delete` returns when
//!   the edge has dropped the device. If the node is not connected the
//!   removal reaches it on reconnect (the Hello difference), so nothing is
//!   waited for; an agent that does not acknowledge within
//!   [`REMOVAL_TIMEOUT`] gets a `RemovalUnconfirmed` warning and the Device
//!   goes anyway: a deletion never hangs on a broken edge.
//!
//! Desired state itself does not pass through here: the sync server reads it
//! from the index, which a reflector keeps current.

use std::collections::HashMap;
use std::convert::Infallible;
use std::sync::{Arc, Mutex};
use std::time::Duration;

use edgefleet_shared::ResourceKey;
use edgefleet_shared::api::{Device, EdgeNode};
use futures::StreamExt;
use k8s_openapi::jiff::Timestamp;
use kube::runtime::Controller;
use kube::runtime::controller::{Action, Config};
use kube::runtime::finalizer::{self, Event, finalizer};
use kube::runtime::reflector::{ObjectRef, ReflectHandle, Store};
use kube::{Api, Resource, ResourceExt};

use crate::agents::Agents;
use crate::events::{Events, Note};
use crate::leases::Fence;
use crate::status::{StatusChange, StatusWriter};

/// The finalizer on every Device the controller has seen.
pub const FINALIZER: &str = "edgefleet.io/cleanup";

/// Devices reconciled at once. Each may make a request of its own (adding
/// the finalizer), and kube's client opens a connection per request in
/// flight: unbounded, the first list of 100,000 Devices opened connections
/// until the API server ran out of file descriptors and died.
const CONCURRENCY: u16 = 64;

/// How long a deleted Device waits for a connected agent to drop it.
pub const REMOVAL_TIMEOUT: Duration = Duration::from_secs(30);

/// What the reconciler works with.
pub struct Context {
    // Writes about a Device go through its node's shard client; Devices of
    // nodes another replica serves are left to it.
    fence: Fence,
    status: StatusWriter,
    events: Events,
    agents: Arc<Agents>,
    edge_nodes: Store<EdgeNode>,
    // The generation last announced per Device (uid, generation), so a
    // reconcile triggered by our own status write does not announce again.
    announced: Mutex<HashMap<ResourceKey, (String, i64)>>,
}

impl std::fmt::Debug for Context {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Context").finish_non_exhaustive()
    }
}

impl Context {
    /// The reconciler's context.
    pub fn new(
        fence: Fence,
        status: StatusWriter,
        events: Events,
        agents: Arc<Agents>,
        edge_nodes: Store<EdgeNode>,
    ) -> Self {
        Context {
            fence,
            status,
            events,
            agents,
            edge_nodes,
            announced: Mutex::default(),
        }
    }
}

/// Reconciles Devices until the process ends. The Devices come from the
/// controller's one Device reflector (`devices`, its store, and `changes`,
/// what it applies): the reconciler keeps no cache and no watch of its own.
pub async fn run(context: Arc<Context>, changes: ReflectHandle<Device>, devices: Store<Device>) {
    // A shard taken over: its Devices are looked at again.
    let moved = context.fence.changes();
    Controller::for_shared_stream(changes, devices)
        .reconcile_all_on(moved)
        .with_config(Config::default().concurrency(CONCURRENCY))
        .run(reconcile, error_policy, context)
        .for_each(|result| async move {
            if let Err(error) = result {
                tracing::debug!(%error, "reconcile did not finish");
            }
        })
        .await;
}

async fn reconcile(
    device: Arc<Device>,
    context: Arc<Context>,
) -> Result<Action, finalizer::Error<Infallible>> {
    if !context.fence.serves(&device.spec.node) {
        return Ok(Action::await_change());
    }
    let namespace = device.namespace().unwrap_or_default();
    let client = context.fence.node(&device.spec.node);
    let api = Api::<Device>::namespaced(client, &namespace);
    finalizer(&api, FINALIZER, device, |event| async {
        Ok(match event {
            Event::Apply(device) => context.accept(&device),
            Event::Cleanup(device) => context.clean_up(&device).await,
        })
    })
    .await
}

fn error_policy(
    device: Arc<Device>,
    error: &finalizer::Error<Infallible>,
    _: Arc<Context>,
) -> Action {
    tracing::warn!(device = %device.name_any(), %error, "reconcile failed; retrying");
    Action::requeue(Duration::from_secs(5))
}

impl Context {
    fn accept(&self, device: &Device) -> Action {
        let key = key_of(device);
        let uid = device.uid().unwrap_or_default();
        let generation = device.metadata.generation.unwrap_or_default();
        let observed = device.status.as_ref().and_then(|s| s.observed_generation);
        if observed.is_some_and(|o| o >= generation) {
            return Action::await_change();
        }
        let new = self
            .announced
            .lock()
            .expect("announced")
            .insert(key.clone(), (uid, generation))
            .is_none_or(|(_, g)| g != generation);
        if !new {
            return Action::await_change();
        }
        self.status
            .submit(key, StatusChange::Observed { generation }, None);
        let node = &device.spec.node;
        let reference = device.object_ref(&());
        self.events.publish(
            reference.clone(),
            Note {
                warning: false,
                reason: "Accepted",
                action: "Reconcile",
                text: format!("spec accepted for node {node}"),
            },
        );
        if self.edge_nodes.get(&ObjectRef::new(node)).is_none() {
            self.events.publish(
                reference,
                Note {
                    warning: true,
                    reason: "NodeNotFound",
                    action: "Reconcile",
                    text: format!(
                        "no agent of node {node} has connected yet; the device gets its state when one does"
                    ),
                },
            );
        }
        Action::await_change()
    }

    async fn clean_up(&self, device: &Device) -> Action {
        let key = key_of(device);
        let node = &device.spec.node;
        let deleted_at = device
            .metadata
            .deletion_timestamp
            .as_ref()
            .map_or_else(Timestamp::now, |t| t.0);
        let deadline = deleted_at + REMOVAL_TIMEOUT;
        let outcome = loop {
            match self.agents.holds(node, &key) {
                None => break Removal::NotConnected,
                Some(false) => break Removal::Acknowledged,
                Some(true) if Timestamp::now() >= deadline => break Removal::TimedOut,
                Some(true) => tokio::time::sleep(Duration::from_millis(100)).await,
            }
        };
        self.announced.lock().expect("announced").remove(&key);
        self.events
            .publish(device.object_ref(&()), outcome.note(node));
        Action::await_change()
    }
}

/// How the removal of a deleted Device from its edge ended.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Removal {
    Acknowledged,
    NotConnected,
    TimedOut,
}

impl Removal {
    fn note(self, node: &str) -> Note {
        match self {
            Removal::Acknowledged => Note {
                warning: false,
                reason: "Removed",
                action: "Delete",
                text: format!("the agent of node {node} dropped the device"),
            },
            Removal::NotConnected => Note {
                warning: false,
                reason: "Removed",
                action: "Delete",
                text: format!(
                    "node {node} is not connected; its agent drops the device when it reconnects"
                ),
            },
            Removal::TimedOut => Note {
                warning: true,
                reason: "RemovalUnconfirmed",
                action: "Delete",
                text: format!(
                    "the agent of node {node} did not confirm the removal within {}s; it is dropped at the next resync",
                    REMOVAL_TIMEOUT.as_secs()
                ),
            },
        }
    }
}

fn key_of(device: &Device) -> ResourceKey {
    ResourceKey::device(device.namespace().unwrap_or_default(), device.name_any())
}
