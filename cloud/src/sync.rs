//! The sync server: one bidirectional stream per agent (`edgefleet.v1.Sync`).
//!
//! A session starts with the agent's Hello, answers it with the difference
//! between what the agent holds and its node's slice of the index, then sends
//! each later change as another difference. The Hello gives the holdings as a
//! digest: if it matches what this process saw the same store acknowledge
//! (see [`Agents`]), that is what the agent holds; otherwise (a restarted
//! controller, a lost Ack) the session asks for the list first. Reports go to the status writer;
//! an uplink sequence number is acknowledged only once every entry up to it is
//! durable in the API server. An agent silent for 3 heartbeat intervals
//! (see [`edgefleet_shared::heartbeat`]) has its session ended, counted and
//! logged.

use std::collections::{BTreeMap, BTreeSet, HashMap};
use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::Duration;

use edgefleet_shared::api::Device;
use edgefleet_shared::api::ReportOrigin;
use edgefleet_shared::heartbeat::{Heartbeat, PeerWatch};
use edgefleet_shared::holdings::HoldingsDigest;
use edgefleet_shared::proto::{self, agent_message, cloud_message, resource, uplink_entry};
use edgefleet_shared::telemetry::Outcomes;
use edgefleet_shared::{ResourceKey, ResourceVersion};
use kube::runtime::reflector;
use prometheus_client::metrics::counter::Counter;
use prometheus_client::metrics::gauge::Gauge;
use tokio::sync::{mpsc, watch};
use tokio_stream::wrappers::ReceiverStream;
use tonic::{Request, Response, Status, Streaming};

use crate::agents::{Agents, delivered_to};
use crate::device_events::{DeviceEvent, DeviceEvents, DroppedNotice};
use crate::edge_node::NodeStatus;
use crate::events::{Events, Note, device_reference};
use crate::index::{Index, NodeSlice, difference};
use crate::status::{Completion, StatusChange, StatusWriter};

/// Most resources in one Update, so one message stays small.
pub const MAX_RESOURCES_PER_UPDATE: usize = 256;

/// How often the cloud sends a heartbeat by default.
pub const HEARTBEAT_INTERVAL: Duration = Heartbeat::DEFAULT.interval;

/// Counters of the sync server.
#[derive(Debug, Default)]
pub struct SyncMetrics {
    /// Open agent streams.
    pub streams: Gauge,
    /// Updates sent.
    pub updates: Counter,
    /// Resources sent in Updates.
    pub resources_sent: Counter,
    /// Uplink entries received.
    pub uplink_entries: Counter,
    /// What was refused, by reason.
    pub refused: Outcomes,
    /// Nacks received.
    pub nacks: Counter,
    /// Hellos by how the agent's holdings became known: `listed` in the
    /// Hello, `empty`, `remembered` (the digest matched what this process
    /// saw acknowledged), `recovered` (it matched what the Devices' statuses
    /// say was delivered) or `inventory` (asked for the list).
    pub hellos: Outcomes,
    /// Sessions ended because the agent was silent for 3 heartbeat
    /// intervals (or sent no Hello within them).
    pub silent_agents: Counter,
}

impl SyncMetrics {
    /// Registers the counters with `registry`.
    pub fn register(&self, registry: &mut prometheus_client::registry::Registry) {
        registry.register("streams", "Open agent streams", self.streams.clone());
        registry.register("updates", "Updates sent to agents", self.updates.clone());
        registry.register(
            "resources_sent",
            "Resources sent in Updates",
            self.resources_sent.clone(),
        );
        registry.register(
            "uplink_entries",
            "Uplink entries received",
            self.uplink_entries.clone(),
        );
        self.refused
            .register(registry, "refused", "Agent input refused, by reason");
        registry.register("nacks", "Updates agents refused", self.nacks.clone());
        self.hellos.register(
            registry,
            "hellos",
            "Agent Hellos by how their holdings became known (listed, empty, remembered, recovered, inventory)",
        );
        registry.register(
            "silent_agents",
            "Agent sessions ended because the agent was silent for 3 heartbeat intervals",
            self.silent_agents.clone(),
        );
    }
}

/// The gRPC service.
#[derive(Clone)]
pub struct SyncService {
    client: kube::Client,
    index: Arc<Index>,
    devices: reflector::Store<Device>,
    status: StatusWriter,
    agents: Arc<Agents>,
    events: Events,
    device_events: DeviceEvents,
    metrics: Arc<SyncMetrics>,
    sessions: Arc<AtomicU64>,
    heartbeat: Heartbeat,
}

/// What the sync service works with.
#[derive(Clone)]
pub struct SyncParts {
    /// For EdgeNodes.
    pub client: kube::Client,
    /// The desired state by node.
    pub index: Arc<Index>,
    /// The Device reflector's store, for what their statuses say was
    /// delivered.
    pub devices: reflector::Store<Device>,
    /// Where reports go.
    pub status: StatusWriter,
    /// Which agents hold what.
    pub agents: Arc<Agents>,
    /// The controller's own Events.
    pub events: Events,
    /// Where device events go.
    pub device_events: DeviceEvents,
    /// The counters.
    pub metrics: Arc<SyncMetrics>,
}

impl SyncService {
    /// A service serving `parts.index`, writing reports through
    /// `parts.status`, device events through `parts.device_events` and
    /// EdgeNodes with `parts.client`, keeping `parts.agents` up to date.
    pub fn new(parts: SyncParts) -> Self {
        let SyncParts {
            client,
            index,
            devices,
            status,
            agents,
            events,
            device_events,
            metrics,
        } = parts;
        SyncService {
            client,
            index,
            devices,
            status,
            agents,
            events,
            device_events,
            metrics,
            sessions: Arc::default(),
            heartbeat: Heartbeat::default(),
        }
    }

    /// Sends heartbeats every `heartbeat.interval` and ends sessions whose
    /// agent is silent for 3 of them.
    pub fn with_heartbeat(self, heartbeat: Heartbeat) -> Self {
        SyncService { heartbeat, ..self }
    }
}

impl std::fmt::Debug for SyncParts {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("SyncParts").finish_non_exhaustive()
    }
}

impl std::fmt::Debug for SyncService {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("SyncService").finish_non_exhaustive()
    }
}

type Outbound = mpsc::Sender<Result<proto::CloudMessage, Status>>;

#[tonic::async_trait]
impl proto::sync_server::Sync for SyncService {
    type StreamStream = ReceiverStream<Result<proto::CloudMessage, Status>>;

    async fn stream(
        &self,
        request: Request<Streaming<proto::AgentMessage>>,
    ) -> Result<Response<Self::StreamStream>, Status> {
        let mut inbound = request.into_inner();
        let limit = self.heartbeat.silence_limit();
        let Ok(first) = tokio::time::timeout(limit, inbound.message()).await else {
            self.metrics.silent_agents.inc();
            tracing::warn!(
                ?limit,
                "an agent opened a stream but sent no Hello: ending it"
            );
            return Err(Status::deadline_exceeded("no Hello in time"));
        };
        let hello = match first? {
            Some(proto::AgentMessage {
                kind: Some(agent_message::Kind::Hello(hello)),
            }) => hello,
            _ => {
                self.metrics.refused.inc("no_hello");
                return Err(Status::invalid_argument(
                    "the first message must be a Hello",
                ));
            }
        };
        if !is_node_name(&hello.node) {
            self.metrics.refused.inc("bad_node_name");
            return Err(Status::invalid_argument(format!(
                "node name {:?} is not a Kubernetes node name",
                hello.node
            )));
        }
        let opening = if !hello.held.is_empty() {
            Opening::Listed(parse_held(&hello.held).map_err(|(reason, message)| {
                self.metrics.refused.inc(reason);
                Status::invalid_argument(format!("Hello from {}: {message}", hello.node))
            })?)
        } else if hello.held_count == 0 {
            Opening::Empty
        } else {
            let digest = HoldingsDigest::from_parts(&hello.held_digest, hello.held_count);
            if digest.is_none() {
                self.metrics.refused.inc("bad_held_digest");
                tracing::warn!(node = %hello.node, bytes = hello.held_digest.len(), "a Hello digest that is not 16 bytes: asking for the list instead");
            }
            Opening::Digest(digest)
        };
        tracing::info!(node = %hello.node, agent = %hello.agent_version, boot = %hello.boot_id, store = %hello.store_id, held = hello.held_count.max(hello.held.len() as u32), "agent connected");

        let mut node_status = NodeStatus::new(self.client.clone(), &hello.node);
        if let Err(error) = node_status
            .connected(&hello.agent_version, &hello.boot_id)
            .await
        {
            tracing::warn!(node = %hello.node, %error, "could not record the EdgeNode's connection");
        }
        let (tx, rx) = mpsc::channel(16);
        let session = Session {
            id: self.sessions.fetch_add(1, Ordering::Relaxed),
            agents: Arc::clone(&self.agents),
            devices: self.devices.clone(),
            events: self.events.clone(),
            device_events: self.device_events.clone(),
            store_id: hello.store_id,
            node_status,
            desired: self.index.subscribe(&hello.node),
            node: hello.node,
            sent: BTreeMap::new(),
            in_flight: HashMap::new(),
            next_nonce: 1,
            uplink: UplinkWatermark::default(),
            status: self.status.clone(),
            metrics: Arc::clone(&self.metrics),
            heartbeat: self.heartbeat,
        };
        tokio::spawn(session.run(opening, inbound, tx));
        Ok(Response::new(ReceiverStream::new(rx)))
    }
}

/// What a Hello says the agent holds.
enum Opening {
    /// Listed in full.
    Listed(BTreeMap<ResourceKey, ResourceVersion>),
    /// Nothing.
    Empty,
    /// Some resources, as a digest; `None` if the digest was malformed, so
    /// only a list will tell.
    Digest(Option<HoldingsDigest>),
}

/// The held resources of a Hello or an Inventory, or the refusal's counter
/// label and message.
fn parse_held(
    list: &[proto::HeldResource],
) -> Result<BTreeMap<ResourceKey, ResourceVersion>, (&'static str, String)> {
    list.iter()
        .map(|h| {
            let key: ResourceKey = h
                .key
                .parse()
                .map_err(|e| ("bad_held_key", format!("{e}")))?;
            let version = h
                .version
                .as_ref()
                .ok_or_else(|| ("bad_held_key", format!("{key} has no version")))?;
            Ok((key, version.into()))
        })
        .collect()
}

/// A Kubernetes node name: a DNS-1123 subdomain.
fn is_node_name(name: &str) -> bool {
    !name.is_empty()
        && name.len() <= 253
        && name.split('.').all(|label| {
            !label.is_empty()
                && label
                    .bytes()
                    .all(|b| b.is_ascii_lowercase() || b.is_ascii_digit() || b == b'-')
                && !label.starts_with('-')
                && !label.ends_with('-')
        })
}

struct Session {
    id: u64,
    agents: Arc<Agents>,
    devices: reflector::Store<Device>,
    events: Events,
    device_events: DeviceEvents,
    // The agent's store: its uplink sequence numbers count within it.
    store_id: String,
    node: String,
    node_status: NodeStatus,
    desired: watch::Receiver<NodeSlice>,
    // What the agent holds once every Update sent so far is applied.
    sent: BTreeMap<ResourceKey, ResourceVersion>,
    // What each unacknowledged Update carried, by nonce.
    in_flight: HashMap<String, InFlight>,
    next_nonce: u64,
    uplink: UplinkWatermark,
    status: StatusWriter,
    metrics: Arc<SyncMetrics>,
    heartbeat: Heartbeat,
}

impl Session {
    async fn run(
        mut self,
        opening: Opening,
        mut inbound: Streaming<proto::AgentMessage>,
        tx: Outbound,
    ) {
        self.metrics.streams.inc();
        let (done_tx, mut done_rx) = mpsc::unbounded_channel();
        let mut heartbeat = tokio::time::interval(self.heartbeat.interval);
        // Started when the Hello arrived.
        let watch = PeerWatch::new(self.heartbeat.silence_limit());
        let metrics = Arc::clone(&self.metrics);
        let node = self.node.clone();
        let silent = async {
            let silent = watch.silent().await;
            metrics.silent_agents.inc();
            tracing::warn!(
                %node,
                silent_for = ?silent,
                missed = edgefleet_shared::heartbeat::MISSED_HEARTBEATS,
                "heard nothing from the agent for 3 heartbeat intervals: ending its session"
            );
            Err::<(), _>(format!("agent silent for {silent:?}"))
        };
        let talk = async {
            let held = self
                .holdings(opening, &mut inbound, &tx, &done_tx, &watch)
                .await?;
            self.agents
                .connected(&self.node, self.id, &self.store_id, held.clone());
            self.sent = held;
            // Devices marked unreachable while the node was away are back (a
            // change that alters nothing costs no write).
            let devices: Vec<ResourceKey> = self.desired.borrow().keys().cloned().collect();
            for key in devices {
                self.status.submit(key, StatusChange::NodeReachable, None);
            }
            self.desired.mark_changed();
            loop {
                tokio::select! {
                    changed = self.desired.changed() => {
                        changed.map_err(|_| "index closed".to_owned())?;
                        self.send_difference(&tx).await?;
                    }
                    message = inbound.message() => match message {
                        Ok(Some(message)) => {
                            watch.heard();
                            self.handle(message, &done_tx).await?
                        }
                        Ok(None) => return Ok::<(), String>(()),
                        Err(status) => return Err(format!("stream error: {status}")),
                    },
                    Some(seq) = done_rx.recv() => {
                        if let Some(ack) = self.uplink.complete(seq) {
                            send(&tx, cloud_message::Kind::UplinkAck(proto::UplinkAck { seq: ack })).await?;
                        }
                    }
                    _ = heartbeat.tick() => {
                        let beat = proto::Heartbeat { sent_at_ms: edgefleet_shared::now_unix_ms(), ..Default::default() };
                        send(&tx, cloud_message::Kind::Heartbeat(beat)).await?;
                    }
                }
            }
        };
        let result: Result<(), String> = tokio::select! {
            ended = talk => ended,
            ended = silent => ended,
        };
        self.metrics.streams.dec();
        self.agents.disconnected(&self.node, self.id);
        if let Err(error) = self.node_status.disconnected().await {
            tracing::warn!(node = %self.node, %error, "could not record the EdgeNode's disconnection");
        }
        match result {
            Ok(()) => tracing::info!(node = %self.node, "agent disconnected"),
            Err(reason) => tracing::warn!(node = %self.node, %reason, "agent stream ended"),
        }
    }

    /// What the agent holds: listed in its Hello; or, for a digest, what
    /// this process saw that store acknowledge if the digest matches, or
    /// else the Inventory it asks for. Messages arriving meanwhile (the
    /// outbox, heartbeats) are handled as usual.
    async fn holdings(
        &mut self,
        opening: Opening,
        inbound: &mut Streaming<proto::AgentMessage>,
        tx: &Outbound,
        done: &mpsc::UnboundedSender<u64>,
        watch: &PeerWatch,
    ) -> Result<BTreeMap<ResourceKey, ResourceVersion>, String> {
        let digest = match opening {
            Opening::Listed(held) => {
                self.metrics.hellos.inc("listed");
                return Ok(held);
            }
            Opening::Empty => {
                self.metrics.hellos.inc("empty");
                return Ok(BTreeMap::new());
            }
            Opening::Digest(digest) => digest,
        };
        if let Some(digest) = digest {
            if let Some(held) = self.agents.remembered(&self.node, &self.store_id, &digest) {
                self.metrics.hellos.inc("remembered");
                return Ok(held);
            }
            let delivered = delivered_to(&self.node, self.devices.state().iter().map(|d| &**d));
            if HoldingsDigest::of(&delivered) == digest {
                self.metrics.hellos.inc("recovered");
                return Ok(delivered);
            }
        }
        self.metrics.hellos.inc("inventory");
        tracing::info!(node = %self.node, store = %self.store_id, "the agent's holdings are not what this controller remembers: asking for its inventory");
        send(
            tx,
            cloud_message::Kind::InventoryRequest(proto::InventoryRequest {}),
        )
        .await?;
        loop {
            let message = match inbound.message().await {
                Ok(Some(message)) => message,
                Ok(None) => return Err("the agent left before sending its inventory".into()),
                Err(status) => return Err(format!("stream error: {status}")),
            };
            watch.heard();
            match message.kind {
                Some(agent_message::Kind::Inventory(inventory)) => {
                    return parse_held(&inventory.held).map_err(|(reason, message)| {
                        self.metrics.refused.inc(reason);
                        format!("inventory: {message}")
                    });
                }
                kind => self.handle(proto::AgentMessage { kind }, done).await?,
            }
        }
    }

    async fn send_difference(&mut self, tx: &Outbound) -> Result<(), String> {
        let slice = self.desired.borrow_and_update().clone();
        let diff = difference(&slice, &self.sent);
        let mut removals = diff.removals.into_iter().peekable();
        let mut upserts = diff.upserts.into_iter().peekable();
        while upserts.peek().is_some() || removals.peek().is_some() {
            let nonce = self.next_nonce.to_string();
            self.next_nonce += 1;
            let mut update = proto::Update {
                nonce: nonce.clone(),
                ..Default::default()
            };
            let mut carried = InFlight::default();
            for key in removals.by_ref().take(MAX_RESOURCES_PER_UPDATE) {
                self.sent.remove(&key);
                update.removals.push(key.to_string());
                carried.removals.push(key);
            }
            let room = MAX_RESOURCES_PER_UPDATE.saturating_sub(update.removals.len());
            for (key, entry) in upserts.by_ref().take(room) {
                update.upserts.push(proto::Resource {
                    key: key.to_string(),
                    version: Some((&entry.version).into()),
                    body: Some(resource::Body::Device(entry.desired.clone())),
                });
                self.sent.insert(key.clone(), entry.version.clone());
                carried.upserts.push((key, entry.version.clone()));
            }
            self.metrics.updates.inc();
            self.metrics
                .resources_sent
                .inc_by(update.upserts.len() as u64);
            self.in_flight.insert(nonce, carried);
            send(tx, cloud_message::Kind::Update(update)).await?;
        }
        Ok(())
    }

    async fn handle(
        &mut self,
        message: proto::AgentMessage,
        done: &mpsc::UnboundedSender<u64>,
    ) -> Result<(), String> {
        match message.kind {
            Some(agent_message::Kind::Ack(ack)) => {
                let carried = self.in_flight.remove(&ack.nonce).unwrap_or_default();
                self.agents
                    .acknowledged(&self.node, self.id, &carried.upserts, &carried.removals);
                for (key, version) in carried.upserts {
                    let change = StatusChange::Delivered {
                        uid: version.uid,
                        generation: version.generation,
                    };
                    self.status.submit(key, change, None);
                }
            }
            Some(agent_message::Kind::Nack(nack)) => {
                self.metrics.nacks.inc();
                let carried = self.in_flight.remove(&nack.nonce).unwrap_or_default();
                for rejected in nack.rejected {
                    tracing::warn!(node = %self.node, key = %rejected.key, reason = %rejected.reason, "agent refused a resource");
                    let Some((key, version)) = carried
                        .upserts
                        .iter()
                        .find(|(k, _)| k.to_string() == rejected.key)
                    else {
                        continue;
                    };
                    self.events.publish(
                        device_reference(key, &version.uid),
                        Note {
                            warning: true,
                            reason: "RejectedByAgent",
                            action: "Deliver",
                            text: format!(
                                "the agent of node {} refused generation {}: {}",
                                self.node, version.generation, rejected.reason
                            ),
                        },
                    );
                    let change = StatusChange::Rejected {
                        uid: version.uid.clone(),
                        generation: version.generation,
                        reason: rejected.reason,
                    };
                    self.status.submit(key.clone(), change, None);
                }
            }
            Some(agent_message::Kind::Uplink(uplink)) => {
                if self.uplink.outstanding() + uplink.entries.len() > proto::UPLINK_WINDOW {
                    self.metrics.refused.inc("uplink_window_exceeded");
                    return Err(format!(
                        "the agent sent more than {} uplink entries without waiting for acknowledgements",
                        proto::UPLINK_WINDOW
                    ));
                }
                for entry in uplink.entries {
                    self.metrics.uplink_entries.inc();
                    self.uplink.received(entry.seq);
                    let completion = Completion {
                        seq: entry.seq,
                        notify: done.clone(),
                    };
                    match self.accept(entry) {
                        Ok(Accepted::Status(key, change)) => {
                            self.status.submit(key, change, Some(completion));
                        }
                        Ok(Accepted::Event(event)) => self.device_events.submit(event, completion),
                        Ok(Accepted::Dropped(notice)) => {
                            self.device_events.submit_dropped(notice, completion);
                        }
                        Err(reason) => {
                            // Refused for good: acknowledge it so the agent
                            // does not resend it forever.
                            self.metrics.refused.inc(reason);
                            let _ = done.send(completion.seq);
                        }
                    }
                }
            }
            Some(agent_message::Kind::Heartbeat(beat)) => {
                let figures = (
                    i64::from(beat.device_count),
                    beat.outbox_depth as i64,
                    beat.events_dropped as i64,
                );
                if let Err(error) = self
                    .node_status
                    .heartbeat(figures.0, figures.1, figures.2)
                    .await
                {
                    tracing::warn!(node = %self.node, %error, "could not record a heartbeat");
                }
            }
            Some(agent_message::Kind::Hello(_)) => return Err("a second Hello".into()),
            Some(agent_message::Kind::Inventory(_)) => {
                self.metrics.refused.inc("unasked_inventory")
            }
            None => self.metrics.refused.inc("empty_message"),
        }
        Ok(())
    }

    /// The uid of a Device on this node, or a refusal for a device that is
    /// not on it.
    fn device_uid(&self, key: &ResourceKey, seq: u64) -> Result<String, &'static str> {
        match self.desired.borrow().get(key) {
            Some(entry) => Ok(entry.version.uid.clone()),
            None => {
                tracing::warn!(node = %self.node, device = %key, seq, "uplink for a device that is not on this node");
                Err("unknown_device")
            }
        }
    }

    /// Checks one uplink entry: a report or event of a device of this node,
    /// or a notice of events dropped at the edge.
    fn accept(&self, entry: proto::UplinkEntry) -> Result<Accepted, &'static str> {
        let report = match entry.body {
            Some(uplink_entry::Body::Report(report)) => report,
            Some(uplink_entry::Body::Event(event)) => {
                let key: ResourceKey = event.device_key.parse().map_err(|_| "bad_device_key")?;
                let uid = self.device_uid(&key, entry.seq)?;
                if event.device_event_id == 0 || event.reason.is_empty() {
                    return Err("bad_event");
                }
                return Ok(Accepted::Event(DeviceEvent {
                    device: key,
                    uid,
                    node: self.node.clone(),
                    id: event.device_event_id,
                    warning: event.r#type() == proto::EventType::Warning,
                    reason: event.reason,
                    message: event.message,
                    at_ms: event.at_ms,
                }));
            }
            Some(uplink_entry::Body::EventsDropped(dropped)) => {
                return Ok(Accepted::Dropped(DroppedNotice {
                    node: self.node.clone(),
                    store_id: self.store_id.clone(),
                    seq: entry.seq,
                    count: dropped.count,
                    bound: dropped.bound,
                    first_at_ms: dropped.first_at_ms,
                    last_at_ms: dropped.last_at_ms,
                }));
            }
            None => return Err("empty_uplink"),
        };
        let key: ResourceKey = report.device_key.parse().map_err(|_| "bad_device_key")?;
        self.device_uid(&key, entry.seq)?;
        let properties = report
            .properties
            .iter()
            .map(|(k, v)| Ok((k.clone(), v.try_into()?)))
            .collect::<Result<_, edgefleet_shared::proto::MissingField>>()
            .map_err(|_| "bad_property")?;
        Ok(Accepted::Status(
            key,
            StatusChange::Reported {
                applied_generation: report.applied_generation,
                properties,
                firmware_version: (!report.firmware_version.is_empty())
                    .then_some(report.firmware_version),
                received_at_ms: report.received_at_ms,
                origin: (!self.store_id.is_empty()).then(|| ReportOrigin {
                    store: self.store_id.clone(),
                    seq: entry.seq,
                }),
            },
        ))
    }
}

/// An uplink entry, checked.
enum Accepted {
    /// A change of a Device's status.
    Status(ResourceKey, StatusChange),
    /// An event a device raised.
    Event(DeviceEvent),
    /// Events the agent dropped at its bound.
    Dropped(DroppedNotice),
}

/// What one Update carried.
#[derive(Debug, Default)]
struct InFlight {
    upserts: Vec<(ResourceKey, ResourceVersion)>,
    removals: Vec<ResourceKey>,
}

async fn send(tx: &Outbound, kind: cloud_message::Kind) -> Result<(), String> {
    tx.send(Ok(proto::CloudMessage { kind: Some(kind) }))
        .await
        .map_err(|_| "agent went away".to_owned())
}

/// Which uplink sequence number may be acknowledged: the highest one with
/// every entry at or below it durable.
#[derive(Debug, Default)]
pub struct UplinkWatermark {
    outstanding: BTreeSet<u64>,
    highest: u64,
    acked: u64,
}

impl UplinkWatermark {
    /// An entry arrived.
    pub fn received(&mut self, seq: u64) {
        if seq > self.acked {
            self.outstanding.insert(seq);
            self.highest = self.highest.max(seq);
        }
    }

    /// Entries received and not yet durable.
    pub fn outstanding(&self) -> usize {
        self.outstanding.len()
    }

    /// An entry is durable. Returns the new acknowledgement, if it moved.
    pub fn complete(&mut self, seq: u64) -> Option<u64> {
        self.outstanding.remove(&seq);
        let watermark = match self.outstanding.first() {
            Some(first) => first - 1,
            None => self.highest,
        };
        (watermark > self.acked).then(|| {
            self.acked = watermark;
            watermark
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_watermark_waits_for_the_oldest_outstanding_entry() {
        let mut w = UplinkWatermark::default();
        for seq in [3, 5, 8] {
            w.received(seq);
        }
        assert_eq!(w.complete(5), Some(2), "3 is still outstanding");
        assert_eq!(w.complete(8), None);
        assert_eq!(w.complete(3), Some(8));
        w.received(2); // a stale resend below the acknowledgement
        assert_eq!(w.complete(2), None);
        w.received(9);
        assert_eq!(w.complete(9), Some(9));
    }

    #[test]
    fn node_names_follow_kubernetes() {
        for ok in ["edge-1", "a", "site-a.line-2", "x1"] {
            assert!(is_node_name(ok), "{ok}");
        }
        for bad in [
            "",
            "Edge",
            "edge_1",
            "-edge",
            "edge-",
            "a..b",
            &"a".repeat(254),
        ] {
            assert!(!is_node_name(bad), "{bad}");
        }
    }
}
