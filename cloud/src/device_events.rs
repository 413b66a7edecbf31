//! Events that devices raised at the edge (update results, faults), turned
//! into Kubernetes Events: exactly once each, in spite of resends.
//!
//! Unlike the controller's own Events ([`crate::events`], best effort), these
//! are the devices' record and are never dropped here: an agent resends an
//! event until the cloud acknowledges its sequence number, and the cloud
//! acknowledges it only once the Event exists. Exactly-once comes from the
//! name: it is derived from the Device's uid and the device's own event id,
//! so a resend after a crash or a reconnect is refused by the API server
//! with `409 AlreadyExists` and counted as a duplicate, never shown twice.
//!
//! Event drops at the edge's bound arrive as one notice per burst and become
//! a Warning Event on the EdgeNode, named by the agent's store and the
//! notice's sequence number, so it is exactly once too.
//!
//! Creates are paced by their own rate limit (`--device-events-per-second`)
//! and retried with backoff while the API server fails. They wait in one
//! queue per node, served in turn ([`FairQueue`]): a site coming back with a
//! backlog of thousands of events does not hold back another site's next
//! event behind all of them. Each queue is bounded by the uplink window (an
//! agent has at most that many entries unacknowledged).

use std::collections::{BTreeMap, HashMap, VecDeque};
use std::num::NonZeroU32;
use std::sync::Arc;
use std::time::Duration;

use backon::{BackoffBuilder, ExponentialBuilder};
use edgefleet_shared::ResourceKey;
use governor::{DefaultDirectRateLimiter, Quota, RateLimiter};
use k8s_openapi::api::core::v1::ObjectReference;
use k8s_openapi::api::events::v1::Event;
use k8s_openapi::apimachinery::pkg::apis::meta::v1::{MicroTime, ObjectMeta};
use k8s_openapi::jiff::Timestamp;
use kube::api::PostParams;
use kube::{Api, Client};
use prometheus_client::metrics::counter::Counter;
use tokio::sync::Semaphore;

use crate::events::resource_reference;
use crate::status::Completion;

/// The `reportingController` of Events raised by devices.
pub const CONTROLLER: &str = "edgefleet.io/edge-agent";

/// The annotation carrying the device's own event id.
pub const EVENT_ID_ANNOTATION: &str = "edgefleet.io/device-event-id";

/// The annotation with the device's boot epoch of the event, when the
/// device sends one (ids count from 1 in every boot).
pub const EVENT_BOOT_ANNOTATION: &str = "edgefleet.io/device-boot";

/// Creates on their way at once.
pub const CONCURRENT_CREATES: usize = 4;

/// Where Events about cluster-scoped objects (EdgeNodes) go.
const CLUSTER_EVENTS_NAMESPACE: &str = "default";

/// An event a device raised, as the sync stream delivered it.
#[derive(Clone, Debug, PartialEq)]
pub struct DeviceEvent {
    /// The device.
    pub device: ResourceKey,
    /// The Device's uid, as the cloud knows it.
    pub uid: String,
    /// The node whose agent stored it.
    pub node: String,
    /// The device's own id of the event, within `boot`.
    pub id: u64,
    /// The device's boot epoch (0: the device sends none).
    pub boot: u64,
    /// Warning rather than Normal.
    pub warning: bool,
    /// CamelCase reason.
    pub reason: String,
    /// For people.
    pub message: String,
    /// When the agent received it (Unix milliseconds).
    pub at_ms: i64,
}

/// Events an agent dropped at its outbox bound.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct DroppedNotice {
    /// The node.
    pub node: String,
    /// The agent's store id.
    pub store_id: String,
    /// The notice's uplink sequence number in that store.
    pub seq: u64,
    /// How many events were dropped.
    pub count: u64,
    /// The bound in force.
    pub bound: u64,
    /// When the first and last were dropped (Unix milliseconds).
    pub first_at_ms: i64,
    /// When the last was dropped.
    pub last_at_ms: i64,
}

/// Counters of device Events.
#[derive(Clone, Debug, Default)]
pub struct DeviceEventMetrics {
    /// Events created.
    pub created: Counter,
    /// Resends refused as already there (409).
    pub duplicates: Counter,
    /// Creates that failed and were retried.
    pub retries: Counter,
    /// Events refused for good (invalid, or their namespace is gone).
    pub refused: Counter,
    /// Events agents reported dropped at their outbox bound.
    pub dropped_at_edge: Counter,
}

impl DeviceEventMetrics {
    /// Registers the counters with `registry`.
    pub fn register(&self, registry: &mut prometheus_client::registry::Registry) {
        registry.register(
            "created",
            "Kubernetes Events created for device events",
            self.created.clone(),
        );
        registry.register(
            "duplicates",
            "Device events resent and found already created",
            self.duplicates.clone(),
        );
        registry.register(
            "retries",
            "Device event creates that failed and were retried",
            self.retries.clone(),
        );
        registry.register(
            "refused",
            "Device events the API server refused for good",
            self.refused.clone(),
        );
        registry.register(
            "dropped_at_edge",
            "Device events agents dropped at their outbox bound",
            self.dropped_at_edge.clone(),
        );
    }
}

/// Items waiting per node, taken one node at a time in turn: each node
/// with something waiting gets the next turn after every other such node.
#[derive(Debug)]
pub struct FairQueue<T> {
    waiting: HashMap<String, VecDeque<T>>,
    /// The nodes with something waiting, in the order of their turns.
    turns: VecDeque<String>,
}

impl<T> Default for FairQueue<T> {
    fn default() -> Self {
        FairQueue {
            waiting: HashMap::new(),
            turns: VecDeque::new(),
        }
    }
}

impl<T> FairQueue<T> {
    /// Queues `item` behind `node`'s others.
    pub fn push(&mut self, node: &str, item: T) {
        let queue = self.waiting.entry(node.to_owned()).or_default();
        if queue.is_empty() {
            self.turns.push_back(node.to_owned());
        }
        queue.push_back(item);
    }

    /// The oldest item of the node whose turn it is.
    pub fn pop(&mut self) -> Option<T> {
        let node = self.turns.pop_front()?;
        let queue = self.waiting.get_mut(&node)?;
        let item = queue.pop_front();
        if queue.is_empty() {
            self.waiting.remove(&node);
        } else {
            self.turns.push_back(node);
        }
        item
    }

    /// Items waiting, over all nodes.
    pub fn len(&self) -> usize {
        self.waiting.values().map(VecDeque::len).sum()
    }

    /// Whether nothing waits.
    pub fn is_empty(&self) -> bool {
        self.turns.is_empty()
    }
}

/// An Event to create, in its namespace, and whom to tell once it exists.
type Job = (String, Event, Completion);

/// Creates device Events. Cheap to clone.
#[derive(Clone)]
pub struct DeviceEvents {
    client: Client,
    limiter: Arc<DefaultDirectRateLimiter>,
    queue: Arc<std::sync::Mutex<FairQueue<Job>>>,
    /// One permit per job in the queue.
    queued: Arc<Semaphore>,
    metrics: DeviceEventMetrics,
}

impl std::fmt::Debug for DeviceEvents {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("DeviceEvents").finish_non_exhaustive()
    }
}

impl DeviceEvents {
    /// Creates at most `per_second` Events per second, with
    /// [`CONCURRENT_CREATES`] workers (spawned here, on the current Tokio
    /// runtime; they end with it).
    pub fn new(client: Client, per_second: NonZeroU32, metrics: DeviceEventMetrics) -> Self {
        let events = DeviceEvents {
            client,
            limiter: Arc::new(RateLimiter::direct(Quota::per_second(per_second))),
            queue: Arc::default(),
            queued: Arc::new(Semaphore::new(0)),
            metrics,
        };
        for _ in 0..CONCURRENT_CREATES {
            tokio::spawn(events.clone().work());
        }
        events
    }

    /// Creates the Event of `event` in the background; `done` is told once
    /// it exists (or can never exist).
    pub fn submit(&self, event: DeviceEvent, done: Completion) {
        let (namespace, object) = device_event(&event);
        self.enqueue(&event.node, (namespace, object, done));
    }

    /// Creates the Warning Event of a drop notice in the background.
    pub fn submit_dropped(&self, notice: DroppedNotice, done: Completion) {
        self.metrics.dropped_at_edge.inc_by(notice.count);
        tracing::warn!(node = %notice.node, count = notice.count, bound = notice.bound, "an agent dropped device events at its outbox bound");
        let job = (
            CLUSTER_EVENTS_NAMESPACE.to_owned(),
            dropped_event(&notice),
            done,
        );
        self.enqueue(&notice.node, job);
    }

    fn enqueue(&self, node: &str, job: Job) {
        self.queue.lock().expect("event queue").push(node, job);
        self.queued.add_permits(1);
    }

    /// One worker: creates the queued Events, a node at a time in turn.
    async fn work(self) {
        loop {
            let Ok(permit) = self.queued.acquire().await else {
                return;
            };
            permit.forget();
            let job = self.queue.lock().expect("event queue").pop();
            let Some((namespace, object, done)) = job else {
                continue;
            };
            self.create(&namespace, &object).await;
            let _ = done.notify.send(done.seq);
        }
    }

    /// Creates `object` until it exists or is refused for good.
    async fn create(&self, namespace: &str, object: &Event) {
        let api: Api<Event> = Api::namespaced(self.client.clone(), namespace);
        let mut delays = ExponentialBuilder::default()
            .with_min_delay(Duration::from_millis(200))
            .with_max_delay(Duration::from_secs(10))
            .with_jitter()
            .without_max_times()
            .build();
        let name = object.metadata.name.as_deref().unwrap_or_default();
        loop {
            self.limiter.until_ready().await;
            match api.create(&PostParams::default(), object).await {
                Ok(_) => {
                    self.metrics.created.inc();
                    return;
                }
                Err(kube::Error::Api(status)) if status.code == 409 => {
                    tracing::debug!(%namespace, %name, "device event already created");
                    self.metrics.duplicates.inc();
                    return;
                }
                Err(kube::Error::Api(status)) if matches!(status.code, 400 | 403 | 404 | 422) => {
                    tracing::warn!(%namespace, %name, reason = %status.message, "device event refused");
                    self.metrics.refused.inc();
                    return;
                }
                Err(error) => {
                    tracing::warn!(%namespace, %name, %error, "could not create a device event; will retry");
                    self.metrics.retries.inc();
                    let delay = delays.next().unwrap_or(Duration::from_secs(10));
                    tokio::time::sleep(delay).await;
                }
            }
        }
    }
}

/// The Kubernetes Event of a device event, in the Device's namespace.
/// Pure, so naming is tested without an API server.
pub fn device_event(event: &DeviceEvent) -> (String, Event) {
    let uid8: String = event.uid.chars().filter(|c| *c != '-').take(8).collect();
    // Ids start again in every boot: a boot epoch is part of the name.
    let boot = match event.boot {
        0 => String::new(),
        boot => format!("{boot:016x}."),
    };
    let name = format!("{}.{uid8}.{boot}{}", short(&event.device.name), event.id);
    let mut annotations: BTreeMap<String, String> = [
        (EVENT_ID_ANNOTATION.to_owned(), event.id.to_string()),
        ("edgefleet.io/node".to_owned(), event.node.clone()),
    ]
    .into();
    if event.boot != 0 {
        annotations.insert(EVENT_BOOT_ANNOTATION.to_owned(), event.boot.to_string());
    }
    let object = Event {
        metadata: ObjectMeta {
            name: Some(name),
            namespace: Some(event.device.namespace.clone()),
            annotations: Some(annotations),
            ..ObjectMeta::default()
        },
        event_time: Some(micro_time(event.at_ms)),
        reporting_controller: Some(CONTROLLER.to_owned()),
        reporting_instance: Some(event.node.clone()),
        action: Some("Report".to_owned()),
        reason: Some(event.reason.clone()),
        note: Some(event.message.clone()),
        type_: Some(kind(event.warning)),
        regarding: Some(resource_reference(&event.device, &event.uid)),
        ..Event::default()
    };
    (event.device.namespace.clone(), object)
}

/// The Warning Event of a drop notice, about the EdgeNode.
pub fn dropped_event(notice: &DroppedNotice) -> Event {
    let store8: String = notice.store_id.chars().take(8).collect();
    Event {
        metadata: ObjectMeta {
            name: Some(format!(
                "{}.dropped.{store8}.{}",
                short(&notice.node),
                notice.seq
            )),
            namespace: Some(CLUSTER_EVENTS_NAMESPACE.to_owned()),
            ..ObjectMeta::default()
        },
        event_time: Some(micro_time(notice.last_at_ms)),
        reporting_controller: Some(CONTROLLER.to_owned()),
        reporting_instance: Some(notice.node.clone()),
        action: Some("Queue".to_owned()),
        reason: Some("DeviceEventsDropped".to_owned()),
        note: Some(format!(
            "the agent's outbox held its bound of {} device events while the cloud was unreachable; \
             the {} oldest were dropped (raise --outbox-max-events to keep more)",
            notice.bound, notice.count
        )),
        type_: Some(kind(true)),
        regarding: Some(ObjectReference {
            api_version: Some("edgefleet.io/v1alpha1".to_owned()),
            kind: Some("EdgeNode".to_owned()),
            name: Some(notice.node.clone()),
            ..ObjectReference::default()
        }),
        ..Event::default()
    }
}

fn kind(warning: bool) -> String {
    if warning { "Warning" } else { "Normal" }.to_owned()
}

fn micro_time(ms: i64) -> MicroTime {
    MicroTime(Timestamp::from_millisecond(ms).unwrap_or_else(|_| Timestamp::now()))
}

/// A name part short enough that the Event's name stays a valid object name.
fn short(name: &str) -> &str {
    const MAX: usize = 200;
    if name.len() <= MAX {
        return name;
    }
    name[..MAX].trim_end_matches(['-', '.'])
}

#[cfg(test)]
mod tests {
    use super::*;

    fn event(id: u64) -> DeviceEvent {
        DeviceEvent {
            device: ResourceKey::device("plant", "t1"),
            uid: "6f0c1e2a-0000-4000-8000-000000000001".into(),
            node: "edge-1".into(),
            id,
            boot: 0,
            warning: false,
            reason: "FirmwareInstalled".into(),
            message: "firmware 2.0.0 installed".into(),
            at_ms: 1_700_000_000_123,
        }
    }

    #[test]
    fn an_event_is_named_by_device_uid_and_id() {
        let (namespace, object) = device_event(&event(7));
        assert_eq!(namespace, "plant");
        assert_eq!(object.metadata.name.as_deref(), Some("t1.6f0c1e2a.7"));
        // The same event resent has the same name; another id another one.
        assert_eq!(
            device_event(&event(7)).1.metadata.name,
            object.metadata.name
        );
        assert_ne!(
            device_event(&event(8)).1.metadata.name,
            object.metadata.name
        );
        let recreated = DeviceEvent {
            uid: "0a1b2c3d-0000".into(),
            ..event(7)
        };
        assert_ne!(
            device_event(&recreated).1.metadata.name,
            object.metadata.name
        );
        // A device that rebooted counts from 1 again under a new epoch:
        // the same id in another boot is another event.
        let rebooted = |boot| DeviceEvent { boot, ..event(7) };
        let after_reboot = device_event(&rebooted(0x2a)).1.metadata;
        assert_eq!(
            after_reboot.name.as_deref(),
            Some("t1.6f0c1e2a.000000000000002a.7")
        );
        assert_ne!(
            after_reboot.name,
            device_event(&rebooted(0x2b)).1.metadata.name
        );
        assert_eq!(
            after_reboot
                .annotations
                .as_ref()
                .and_then(|a| a.get(EVENT_BOOT_ANNOTATION))
                .map(String::as_str),
            Some("42")
        );
        assert_eq!(object.type_.as_deref(), Some("Normal"));
        assert_eq!(object.reason.as_deref(), Some("FirmwareInstalled"));
        assert_eq!(
            object.regarding.and_then(|r| r.uid).as_deref(),
            Some("6f0c1e2a-0000-4000-8000-000000000001")
        );
    }

    #[test]
    fn the_queue_serves_nodes_in_turn_and_each_node_in_order() {
        let mut queue = FairQueue::default();
        for n in 1..=100 {
            queue.push("busy", ("busy", n));
        }
        queue.push("quiet", ("quiet", 1));
        queue.push("other", ("other", 1));
        queue.push("quiet", ("quiet", 2));
        assert_eq!(queue.len(), 103);
        let first: Vec<_> = (0..6).map_while(|_| queue.pop()).collect();
        assert_eq!(
            first,
            [
                ("busy", 1),
                ("quiet", 1),
                ("other", 1),
                ("busy", 2),
                ("quiet", 2),
                ("busy", 3)
            ]
        );
        // A node that comes back after its queue ran empty queues behind
        // those waiting.
        queue.push("quiet", ("quiet", 3));
        assert_eq!(queue.pop(), Some(("busy", 4)));
        assert_eq!(queue.pop(), Some(("quiet", 3)));
        let rest: Vec<_> = std::iter::from_fn(|| queue.pop()).collect();
        assert_eq!(rest, (5..=100).map(|n| ("busy", n)).collect::<Vec<_>>());
        assert!(queue.is_empty());
    }

    #[test]
    fn long_device_names_keep_event_names_valid() {
        let long = DeviceEvent {
            device: ResourceKey::device("plant", format!("{}-x", "a".repeat(199))),
            ..event(1)
        };
        let name = device_event(&long).1.metadata.name.unwrap();
        assert!(name.len() <= 253, "{}", name.len());
        assert!(!name.contains("-."), "{name}");
    }

    #[test]
    fn a_drop_notice_is_a_warning_on_the_edge_node() {
        let notice = DroppedNotice {
            node: "edge-1".into(),
            store_id: "0123456789abcdef".into(),
            seq: 42,
            count: 3,
            bound: 10,
            first_at_ms: 1,
            last_at_ms: 2,
        };
        let object = dropped_event(&notice);
        assert_eq!(
            object.metadata.name.as_deref(),
            Some("edge-1.dropped.01234567.42")
        );
        assert_eq!(object.type_.as_deref(), Some("Warning"));
        assert!(object.note.unwrap().contains("3 oldest"));
        assert_eq!(
            object.regarding.and_then(|r| r.kind).as_deref(),
            Some("EdgeNode")
        );
    }
}
