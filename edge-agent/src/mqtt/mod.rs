//! The agent's MQTT side, on the site broker: desired state out as retained
//! messages, reports of MQTT devices in. See [`edgefleet_shared::topics`].
//!
//! The broker is an embedded rumqttd by default, so one agent runs alone; an
//! external broker (Mosquitto, EMQX) is used when its address is given.
//!
//! A report is acknowledged (PUBACK) only after it is durable in the store,
//! so a device whose report was lost with the agent sends it again. An event
//! is acknowledged the same way and, once durable, confirmed to the device on
//! its `event-ack` topic: the device resends it until that confirmation
//! arrives, and the agent stores each event id once. Whatever arrived
//! together is written in arrival order and made durable by one flush
//! (group commit), then acknowledged in that order.

pub mod acl;
pub mod broker;
pub mod guard;
pub mod mosquitto;

use std::sync::Arc;
use std::time::Duration;

use edgefleet_shared::codec::{self, CodecError, DeviceEvent, DeviceReport, EventAck};
use edgefleet_shared::health::Check;
use edgefleet_shared::telemetry::Outcomes;
use edgefleet_shared::{ResourceKey, topics};
use prometheus_client::metrics::counter::Counter;
use rumqttc::{
    AsyncClient, Event, EventLoop, MqttOptions, Packet, Publish, QoS, SubscribeFilter,
    SubscribeReasonCode,
};
use tokio::sync::{broadcast, mpsc, watch};

use crate::store::{Batch, EventOutcome, Store, StoreError};

/// The largest payload the embedded broker forwards. Reports over the device
/// wire format's limit still get through, so the agent can refuse and count
/// them; much larger ones the broker refuses itself.
pub const BROKER_MAX_PAYLOAD: usize = 16 * 1024;

/// The largest packet the agent's client accepts: above anything a broker
/// forwards, so an oversized report never costs the agent its connection.
const CLIENT_MAX_PACKET: usize = 64 * 1024;

/// Where the site broker is.
#[derive(Clone, Debug)]
pub struct BrokerAddress {
    /// Host name or address.
    pub host: String,
    /// TCP port.
    pub port: u16,
    /// The agent's user name and password there, if it needs one.
    pub login: Option<(String, String)>,
}

/// Counters of the MQTT side.
#[derive(Debug, Default)]
pub struct MqttMetrics {
    /// Reports received, by outcome (`stored` or the refusal reason).
    pub reports: Outcomes,
    /// Events received, by outcome (`stored`, `stored_dropped_oldest`,
    /// `duplicate` or the refusal reason).
    pub events: Outcomes,
    /// Desired states published (retained).
    pub desired_published: Counter,
    /// Retained desired states cleared for deleted devices.
    pub desired_cleared: Counter,
}

/// Reports and events written by one flush at most (group commit): a
/// reconnect's backlog of thousands costs a few flushes, not thousands.
pub const MAX_BATCH: usize = 512;

/// QoS 0 messages waiting to be stored beyond which further QoS 0 messages
/// are dropped. QoS 1 messages are never dropped: the broker sends no more
/// of them than its in-flight window before the agent acknowledges, and the
/// agent acknowledges only what is durable, so the broker bounds them.
const MAX_QUEUED_QOS0: usize = 10_000;

/// Connects to the broker and runs until the process ends: publishes every
/// device's desired state (again after each reconnect) and stores reports.
/// `check` says whether the broker connection is up.
pub async fn run(
    broker: BrokerAddress,
    node: String,
    store: Store,
    metrics: Arc<MqttMetrics>,
    check: Check,
) {
    run_with_batch(broker, node, store, metrics, check, MAX_BATCH).await
}

/// [`run`], storing at most `max_batch` messages per flush (1: one flush
/// per message, the baseline the ingest benchmark compares against).
pub async fn run_with_batch(
    broker: BrokerAddress,
    node: String,
    store: Store,
    metrics: Arc<MqttMetrics>,
    check: Check,
    max_batch: usize,
) {
    let mut options = MqttOptions::new(
        broker::agent_client_id(&node),
        broker.host.clone(),
        broker.port,
    );
    if let Some((user, password)) = &broker.login {
        options.set_credentials(user, password);
    }
    options
        .set_keep_alive(Duration::from_secs(20))
        // A persistent session under a client id fixed per node: while the
        // agent is down (crashed, restarting) an external broker keeps its
        // subscriptions and queues the devices' reports and events for it,
        // and redelivers whatever was delivered but not yet acknowledged
        // (acknowledged only once durable, see `set_manual_acks`).
        .set_clean_session(false)
        .set_manual_acks(true)
        .set_max_packet_size(CLIENT_MAX_PACKET, CLIENT_MAX_PACKET)
        .set_request_channel_capacity(1024);
    let (client, mut events) = AsyncClient::new(options, 1024);
    // Acknowledgements and event confirmations are small packets that a
    // device waits for: without TCP_NODELAY, Nagle's algorithm holds each
    // until the broker acknowledges the one before (~40 ms per confirmation
    // with delayed ACKs, measured by edgefleet-ingest-bench).
    let mut network = events.network_options();
    network.set_tcp_nodelay(true);
    events.set_network_options(network);
    let (subscribed_tx, subscribed) = watch::channel(false);
    let incoming = Incoming::default();
    let (incoming_tx, incoming_rx) = mpsc::unbounded_channel();

    let publisher = publish_desired(
        client.clone(),
        node.clone(),
        store.clone(),
        subscribed,
        Arc::clone(&metrics),
    );
    let receiver = store_incoming(
        client.clone(),
        node.clone(),
        store,
        (incoming_rx, incoming.clone()),
        Arc::clone(&metrics),
        max_batch.max(1),
    );
    let events = drive(
        events,
        client,
        node,
        subscribed_tx,
        (incoming_tx, incoming),
        check,
        metrics,
    );
    tokio::join!(publisher, receiver, events);
}

/// How many QoS 0 messages wait in the queue to the storing task.
#[derive(Clone, Debug, Default)]
struct Incoming {
    qos0: Arc<std::sync::atomic::AtomicUsize>,
}

/// Polls the connection; hands reports and events to [`store_incoming`]
/// and tells the publisher whether the broker holds the agent's
/// subscriptions (false from a connection's loss until the next SUBACK).
///
/// It never waits for anything but the connection: the client's request
/// queue (desired states, acknowledgements) is drained only here, so a
/// wait on the storing task, which itself waits on that queue to
/// acknowledge, would stop both for good.
async fn drive(
    mut events: EventLoop,
    client: AsyncClient,
    node: String,
    subscribed: watch::Sender<bool>,
    (queue, incoming): (mpsc::UnboundedSender<Publish>, Incoming),
    check: Check,
    metrics: Arc<MqttMetrics>,
) {
    use std::sync::atomic::Ordering;
    loop {
        match events.poll().await {
            Ok(Event::Incoming(Packet::ConnAck(_))) => {
                tracing::info!(%node, "connected to the site broker");
                // Healthy only once the broker acknowledged the
                // subscriptions: until then a device's report reaches no
                // subscriber.
                check.failing("connected to the site broker; subscribing to reports and events");
                // From a task: after an outage the request queue may be full
                // of desired states, and only this loop drains it, so
                // awaiting here would never end and try_subscribe would
                // fail, leaving the agent deaf to reports until the next
                // reconnect.
                let client = client.clone();
                let filters = [topics::reports_of(&node), topics::events_of(&node)]
                    .map(|filter| SubscribeFilter::new(filter, QoS::AtLeastOnce));
                tokio::spawn(async move {
                    if let Err(error) = client.subscribe_many(filters).await {
                        tracing::warn!(%error, "could not subscribe to reports and events");
                    }
                });
            }
            Ok(Event::Incoming(Packet::SubAck(ack))) => {
                let refused = ack
                    .return_codes
                    .iter()
                    .any(|c| matches!(c, SubscribeReasonCode::Failure));
                if refused {
                    tracing::error!(%node, "the site broker refused the subscription to reports and events");
                    check.failing("the site broker refused the subscription to reports and events");
                } else {
                    tracing::info!(%node, "subscribed to reports and events");
                    check.ok();
                    subscribed.send_replace(true);
                }
            }
            Ok(Event::Incoming(Packet::Publish(publish))) => {
                if publish.qos == QoS::AtMostOnce {
                    if incoming.qos0.load(Ordering::Relaxed) >= MAX_QUEUED_QOS0 {
                        metrics.reports.inc("dropped_qos0_overload");
                        continue;
                    }
                    incoming.qos0.fetch_add(1, Ordering::Relaxed);
                }
                if queue.send(publish).is_err() {
                    return;
                }
            }
            Ok(_) => {}
            Err(error) => {
                subscribed.send_replace(false);
                check.failing(format!("site broker: {error}"));
                tracing::warn!(%node, %error, "site broker connection lost; reconnecting");
                tokio::time::sleep(Duration::from_secs(1)).await;
            }
        }
    }
}

/// Stores reports and events in arrival order, as many as are waiting (up
/// to `max_batch`) per flush, and acknowledges them in that order once the
/// flush is done.
async fn store_incoming(
    client: AsyncClient,
    node: String,
    store: Store,
    (mut queue, incoming): (mpsc::UnboundedReceiver<Publish>, Incoming),
    metrics: Arc<MqttMetrics>,
    max_batch: usize,
) {
    use std::sync::atomic::Ordering;
    let mut waiting = Vec::with_capacity(max_batch);
    while queue.recv_many(&mut waiting, max_batch).await > 0 {
        let qos0 = waiting.iter().filter(|p| p.qos == QoS::AtMostOnce).count();
        incoming.qos0.fetch_sub(qos0, Ordering::Relaxed);

        let mut batch = store.batch();
        let written: Vec<_> = waiting
            .drain(..)
            .map(|publish| {
                let uplink = topics::parse_uplink(&node, &publish.topic);
                let written = write(&store, &mut batch, uplink.as_ref(), &publish);
                (publish, outcomes(&metrics, uplink.as_ref()), written)
            })
            .collect();
        if let Err(error) = batch.commit().await {
            // Nothing is acknowledged: the broker sends it all again.
            tracing::error!(%error, messages = written.len(), "could not make reports and events durable");
            for (_, counters, _) in &written {
                counters.inc("store_error");
            }
            continue;
        }
        for (publish, counters, written) in written {
            let label = match written {
                Ok(Stored::Report) => "stored",
                Ok(Stored::Event { key, outcome, ack }) => {
                    tracing::debug!(device = %key, outcome, highest = ack.id, boot = ack.boot, "event from MQTT");
                    let ack = codec::encode(&ack).expect("an ack encodes");
                    let topic = topics::event_ack(&node, &key);
                    if let Err(error) = client.publish(topic, QoS::AtLeastOnce, false, ack).await {
                        tracing::warn!(device = %key, %error, "could not confirm an event");
                    }
                    outcome
                }
                Err(Refusal::Store(error)) => {
                    // Not acknowledged: the device sends it again.
                    tracing::error!(topic = %publish.topic, %error, "could not store a message");
                    counters.inc("store_error");
                    continue;
                }
                Err(refusal) => {
                    tracing::debug!(topic = %publish.topic, ?refusal, "message refused");
                    refusal.label()
                }
            };
            counters.inc(label);
            // A refused message is acknowledged too: resending it cannot
            // help.
            if let Err(error) = client.ack(&publish).await {
                tracing::warn!(%error, "could not acknowledge a message");
            }
        }
    }
}

/// What a message became, once its batch is durable.
#[derive(Debug)]
enum Stored {
    Report,
    Event {
        key: ResourceKey,
        /// `stored`, `stored_dropped_oldest` or `duplicate`.
        outcome: &'static str,
        /// What the device is told: the highest event id stored in the
        /// event's boot.
        ack: EventAck,
    },
}

/// Writes one message, sent on the topic `uplink` parsed to, into `batch`.
fn write(
    store: &Store,
    batch: &mut Batch<'_>,
    uplink: Option<&(ResourceKey, topics::Uplink)>,
    publish: &Publish,
) -> Result<Stored, Refusal> {
    // Delivered retained: an old message the broker kept (a device left it
    // on its own topic, which an external broker's ACL cannot forbid), not
    // one sent now.
    if publish.retain {
        return Err(Refusal::Retained);
    }
    match uplink {
        Some((key, topics::Uplink::Event)) => {
            let (outcome, ack) = write_event(store, batch, key, publish)?;
            Ok(Stored::Event {
                key: key.clone(),
                outcome,
                ack,
            })
        }
        Some((key, topics::Uplink::Report)) => {
            write_report(store, batch, key, publish).map(|()| Stored::Report)
        }
        None => Err(Refusal::NotAReport),
    }
}

/// The counters a message counts in: events' or reports' (anything else
/// counts as a report refused).
fn outcomes<'m>(
    metrics: &'m MqttMetrics,
    uplink: Option<&(ResourceKey, topics::Uplink)>,
) -> &'m Outcomes {
    match uplink {
        Some((_, topics::Uplink::Event)) => &metrics.events,
        _ => &metrics.reports,
    }
}

#[derive(Debug)]
enum Refusal {
    NotAReport,
    Retained,
    UnknownDevice,
    Codec(CodecError),
    Store(StoreError),
}

impl Refusal {
    fn label(&self) -> &'static str {
        match self {
            Refusal::NotAReport => "not_a_report_topic",
            Refusal::Retained => "retained",
            Refusal::UnknownDevice => "unknown_device",
            Refusal::Codec(error) => error.metric_label(),
            Refusal::Store(_) => "store_error",
        }
    }
}

/// Writes one event; returns the outcome label and the acknowledgement for
/// the device (once the batch is durable).
fn write_event(
    store: &Store,
    batch: &mut Batch<'_>,
    key: &ResourceKey,
    publish: &Publish,
) -> Result<(&'static str, EventAck), Refusal> {
    let event: DeviceEvent = codec::decode(&publish.payload).map_err(Refusal::Codec)?;
    if store.desired(key).map_err(Refusal::Store)?.is_none() {
        return Err(Refusal::UnknownDevice);
    }
    let (id, boot) = (event.id, event.boot);
    let (outcome, id) = match batch
        .event(key, event, edgefleet_shared::now_unix_ms())
        .map_err(Refusal::Store)?
    {
        EventOutcome::Stored {
            dropped_oldest: false,
            ..
        } => ("stored", id),
        EventOutcome::Stored { .. } => ("stored_dropped_oldest", id),
        EventOutcome::Duplicate { highest } => ("duplicate", highest),
    };
    Ok((outcome, EventAck { id, boot }))
}

fn write_report(
    store: &Store,
    batch: &mut Batch<'_>,
    key: &ResourceKey,
    publish: &Publish,
) -> Result<(), Refusal> {
    let report: DeviceReport = codec::decode(&publish.payload).map_err(Refusal::Codec)?;
    if store.desired(key).map_err(Refusal::Store)?.is_none() {
        return Err(Refusal::UnknownDevice);
    }
    batch
        .report(key, report, edgefleet_shared::now_unix_ms())
        .map(drop)
        .map_err(Refusal::Store)
}

/// Publishes desired state as it changes, and all of it each time the broker
/// acknowledged the agent's subscriptions.
///
/// A desired state goes out only while the agent is subscribed to reports: a
/// device applies it and reports at once, and a report published before the
/// broker holds the agent's subscription reaches no one and is lost. (A
/// broker that kept the agent's session would have it, but a first
/// connection, or a broker that lost its sessions, would not.) What changes
/// meanwhile is published by the `publish_all` that follows the SUBACK.
/// Clearing a deleted device's topic makes no device report, so it is
/// queued at once.
async fn publish_desired(
    client: AsyncClient,
    node: String,
    store: Store,
    mut subscribed: watch::Receiver<bool>,
    metrics: Arc<MqttMetrics>,
) {
    let mut changes = store.watch_desired();
    loop {
        tokio::select! {
            changed = subscribed.changed() => {
                if changed.is_err() {
                    return;
                }
                if *subscribed.borrow_and_update() {
                    publish_all(&client, &node, &store, &metrics).await;
                }
            }
            change = changes.recv() => match change {
                Ok(change) => {
                    if *subscribed.borrow() {
                        for key in &change.upserted {
                            publish_one(&client, &node, &store, key, &metrics).await;
                        }
                    }
                    for key in &change.removed {
                        let cleared = client.publish(topics::desired(&node, key), QoS::AtLeastOnce, true, Vec::new()).await;
                        if cleared.is_ok() {
                            metrics.desired_cleared.inc();
                        }
                    }
                }
                Err(broadcast::error::RecvError::Lagged(_)) if *subscribed.borrow() => {
                    publish_all(&client, &node, &store, &metrics).await
                }
                Err(broadcast::error::RecvError::Lagged(_)) => {}
                Err(broadcast::error::RecvError::Closed) => return,
            },
        }
    }
}

async fn publish_all(client: &AsyncClient, node: &str, store: &Store, metrics: &MqttMetrics) {
    match store.devices() {
        Ok(devices) => {
            for (key, _) in devices {
                publish_one(client, node, store, &key, metrics).await;
            }
        }
        Err(error) => tracing::error!(%error, "cannot read desired state to publish"),
    }
}

async fn publish_one(
    client: &AsyncClient,
    node: &str,
    store: &Store,
    key: &ResourceKey,
    metrics: &MqttMetrics,
) {
    let device = match store.desired(key) {
        Ok(Some(device)) => device,
        Ok(None) => return,
        Err(error) => {
            tracing::error!(device = %key, %error, "cannot read desired state");
            return;
        }
    };
    match codec::encode(&device.to_wire()) {
        Ok(payload) => {
            if client
                .publish(topics::desired(node, key), QoS::AtLeastOnce, true, payload)
                .await
                .is_ok()
            {
                tracing::debug!(device = %key, generation = device.version.generation, "desired state queued for the broker");
                metrics.desired_published.inc();
            }
        }
        Err(error) => {
            tracing::error!(device = %key, %error, "desired state does not fit the device wire format")
        }
    }
}
