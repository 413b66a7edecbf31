//! The sync client: dials the cloud, says what the store holds (a digest,
//! and the list when the cloud asks for it), applies
//! updates durably before acknowledging them, and sends the outbox up.
//!
//! The connection is retried forever with exponential backoff and jitter; the
//! store keeps the agent working in between. A cloud that goes silent (a
//! link that drops packets without a reset) is noticed by the heartbeat rule
//! of [`edgefleet_shared::heartbeat`]: nothing heard for 3 intervals ends the
//! session, which is counted and logged; HTTP/2 PINGs and TCP keepalive back
//! it up.

use std::collections::{BTreeMap, VecDeque};
use std::time::Duration;

use backon::{BackoffBuilder, ExponentialBuilder};
use edgefleet_shared::api::Transport;
use edgefleet_shared::codec::FirmwareOrder;
use edgefleet_shared::heartbeat::{Heartbeat, PeerWatch};
use edgefleet_shared::holdings::HoldingsDigest;
use edgefleet_shared::proto::{self, agent_message, cloud_message, resource, uplink_entry};
use edgefleet_shared::{PropertyValue, ResourceKey};
use prometheus_client::metrics::counter::Counter;
use prometheus_client::metrics::family::Family;
use tokio::sync::mpsc;
use tokio_stream::StreamExt;
use tokio_stream::wrappers::ReceiverStream;

use crate::store::{DesiredDevice, PendingUplink, Store, StoreError};

/// Most outbox entries in one Uplink message.
pub const UPLINK_BATCH: usize = 256;

/// How often the agent sends a heartbeat by default.
pub const HEARTBEAT_INTERVAL: Duration = Heartbeat::DEFAULT.interval;

/// Who this agent is and where the cloud is.
#[derive(Clone, Debug)]
pub struct SyncSettings {
    /// The cloud's sync endpoint, like `http://127.0.0.1:7443`.
    pub cloud: String,
    /// This node's Kubernetes name.
    pub node: String,
    /// This agent's version.
    pub agent_version: String,
    /// Changes on every start.
    pub boot_id: String,
    /// How often heartbeats go out; 3 intervals without a word from the
    /// cloud end a session.
    pub heartbeat: Heartbeat,
    /// Sessions ended because the cloud was silent.
    pub silent_cloud: Counter,
    /// Protobuf bytes of the messages sent and received, by message kind.
    pub bytes: MessageBytes,
}

/// Protobuf bytes on the sync stream by direction and message kind
/// (`hello`, `update`, `uplink`, …), as the messages encode: what a resync
/// costs, without the HTTP/2 framing around it. Uplink entries that were
/// already queued when the session opened count as `uplink_backlog`, the
/// rest as `uplink`.
#[derive(Clone, Debug, Default)]
pub struct MessageBytes(Family<Vec<(String, String)>, Counter>);

impl MessageBytes {
    fn add(&self, direction: &str, kind: &str, bytes: usize) {
        self.0
            .get_or_create(&vec![
                ("direction".to_owned(), direction.to_owned()),
                ("message".to_owned(), kind.to_owned()),
            ])
            .inc_by(bytes as u64);
    }

    /// Registers the counters as `sync_message_bytes`.
    pub fn register(&self, registry: &mut prometheus_client::registry::Registry) {
        registry.register(
            "sync_message_bytes",
            "Protobuf bytes of sync messages, by direction (sent, received) and message kind",
            self.0.clone(),
        );
    }

    /// Counts a sent message; uplink entries up to `backlog_up_to` were
    /// queued before the session opened.
    fn sent(&self, message: &proto::AgentMessage, backlog_up_to: u64) {
        let total = prost::Message::encoded_len(message);
        let kind = match &message.kind {
            Some(agent_message::Kind::Hello(_)) => "hello",
            Some(agent_message::Kind::Ack(_)) => "ack",
            Some(agent_message::Kind::Nack(_)) => "nack",
            Some(agent_message::Kind::Uplink(uplink)) => {
                let backlog: usize = uplink
                    .entries
                    .iter()
                    .filter(|e| e.seq <= backlog_up_to)
                    .map(|e| prost::encoding::message::encoded_len(1, e))
                    .sum();
                if backlog > 0 {
                    self.add("sent", "uplink_backlog", backlog);
                }
                self.add("sent", "uplink", total - backlog);
                return;
            }
            Some(agent_message::Kind::Heartbeat(_)) => "heartbeat",
            Some(agent_message::Kind::Inventory(_)) => "inventory",
            None => "empty",
        };
        self.add("sent", kind, total);
    }

    fn received(&self, message: &proto::CloudMessage) {
        let kind = match &message.kind {
            Some(cloud_message::Kind::Update(_)) => "update",
            Some(cloud_message::Kind::UplinkAck(_)) => "uplink_ack",
            Some(cloud_message::Kind::Heartbeat(_)) => "heartbeat",
            Some(cloud_message::Kind::InventoryRequest(_)) => "inventory_request",
            None => "empty",
        };
        self.add("received", kind, prost::Message::encoded_len(message));
    }
}

/// Why a session ended.
#[derive(Debug, thiserror::Error)]
pub enum SyncError {
    /// Could not connect.
    #[error("connect to {endpoint}: {source}")]
    Connect {
        /// Where.
        endpoint: String,
        /// Why.
        source: tonic::transport::Error,
    },
    /// The cloud refused or broke the stream.
    #[error("sync stream: {0}")]
    Stream(#[from] tonic::Status),
    /// The store failed.
    #[error(transparent)]
    Store(#[from] StoreError),
    /// The outgoing half closed.
    #[error("sync stream closed")]
    Closed,
    /// Nothing heard from the cloud for 3 heartbeat intervals.
    #[error("heard nothing from the cloud for {0:?}")]
    Silent(Duration),
}

/// Runs sync sessions until the process ends, reconnecting after each.
pub async fn run(settings: SyncSettings, store: Store) {
    let backoff = || {
        ExponentialBuilder::default()
            .with_min_delay(Duration::from_millis(200))
            .with_max_delay(Duration::from_secs(15))
            .with_jitter()
            .without_max_times()
            .build()
    };
    let mut delays = backoff();
    loop {
        let mut opened = false;
        match session(&settings, &store, &mut opened).await {
            Ok(()) => tracing::info!(cloud = %settings.cloud, "cloud closed the sync stream"),
            Err(error) => tracing::warn!(cloud = %settings.cloud, %error, "sync session ended"),
        }
        // After a session that got its stream open, start the backoff over.
        if opened {
            delays = backoff();
        }
        let delay = delays.next().unwrap_or(Duration::from_secs(15));
        tokio::time::sleep(delay).await;
    }
}

/// One session: Hello, then updates in and the outbox out until the stream
/// ends, or until the cloud has been silent for 3 heartbeat intervals
/// (counting from the start of the connection attempt). `opened` is set once
/// the stream is open.
pub async fn session(
    settings: &SyncSettings,
    store: &Store,
    opened: &mut bool,
) -> Result<(), SyncError> {
    let watch = PeerWatch::new(settings.heartbeat.silence_limit());
    tokio::select! {
        ended = talk(settings, store, &watch, opened) => ended,
        silent = watch.silent() => {
            settings.silent_cloud.inc();
            tracing::warn!(
                node = %settings.node,
                cloud = %settings.cloud,
                silent_for = ?silent,
                missed = edgefleet_shared::heartbeat::MISSED_HEARTBEATS,
                "heard nothing from the cloud for 3 heartbeat intervals: ending the sync session"
            );
            Err(SyncError::Silent(silent))
        }
    }
}

/// The cloud's endpoint with the connection-level timeouts: connect, HTTP/2
/// PING and TCP keepalive, derived from the heartbeat interval.
fn endpoint(settings: &SyncSettings) -> Result<tonic::transport::Endpoint, SyncError> {
    let beat = settings.heartbeat;
    let endpoint =
        tonic::transport::Endpoint::from_shared(settings.cloud.clone()).map_err(|source| {
            SyncError::Connect {
                endpoint: settings.cloud.clone(),
                source,
            }
        })?;
    Ok(endpoint
        .connect_timeout(beat.silence_limit())
        .http2_keep_alive_interval(beat.keepalive_interval())
        .keep_alive_timeout(beat.keepalive_timeout())
        .keep_alive_while_idle(true)
        .tcp_keepalive(Some(beat.tcp_keepalive())))
}

async fn talk(
    settings: &SyncSettings,
    store: &Store,
    watch: &PeerWatch,
    opened: &mut bool,
) -> Result<(), SyncError> {
    let channel = endpoint(settings)?
        .connect()
        .await
        .map_err(|source| SyncError::Connect {
            endpoint: settings.cloud.clone(),
            source,
        })?;
    let mut client = proto::sync_client::SyncClient::new(channel);
    let (tx, rx) = mpsc::channel(16);
    // What the store holds goes as a digest; the cloud asks for the list
    // if the digest is not what it remembers.
    let digest = HoldingsDigest::of(store.held()?.iter().map(|(k, v)| (k, v)));
    let hello = proto::Hello {
        node: settings.node.clone(),
        agent_version: settings.agent_version.clone(),
        boot_id: settings.boot_id.clone(),
        held: Vec::new(),
        store_id: store.store_id().to_owned(),
        held_digest: digest.to_bytes(),
        held_count: digest.count(),
    };
    send(&tx, agent_message::Kind::Hello(hello)).await?;
    let bytes = settings.bytes.clone();
    let backlog_up_to = store.last_seq()?;
    let outgoing = ReceiverStream::new(rx).map(move |message| {
        bytes.sent(&message, backlog_up_to);
        message
    });
    let mut inbound = client.stream(outgoing).await?.into_inner();
    watch.heard();
    *opened = true;
    tracing::info!(cloud = %settings.cloud, node = %settings.node, "sync stream open");
    let _link = LinkUp::new(store);

    // What this session sent and the cloud has not acknowledged yet; a new
    // session resends whatever is still unacknowledged.
    let mut in_flight = InFlight::default();
    let mut heartbeat = tokio::time::interval(settings.heartbeat.interval);
    loop {
        send_outbox(store, &tx, &mut in_flight).await?;
        tokio::select! {
            message = inbound.message() => {
                let Some(message) = message? else { return Ok(()) };
                watch.heard();
                settings.bytes.received(&message);
                match message.kind {
                    Some(cloud_message::Kind::Update(update)) => apply_update(store, &tx, update).await?,
                    Some(cloud_message::Kind::UplinkAck(ack)) => {
                        store.acknowledge_uplink(ack.seq).await?;
                        in_flight.acknowledged(ack.seq);
                    }
                    Some(cloud_message::Kind::InventoryRequest(_)) => {
                        let held = store
                            .held()?
                            .into_iter()
                            .map(|(key, version)| proto::HeldResource {
                                key: key.to_string(),
                                version: Some((&version).into()),
                            })
                            .collect();
                        tracing::info!(cloud = %settings.cloud, "the cloud asked what this agent holds");
                        send(&tx, agent_message::Kind::Inventory(proto::Inventory { held })).await?;
                    }
                    Some(cloud_message::Kind::Heartbeat(_)) | None => {}
                }
            }
            _ = store.outbox_grew() => {}
            _ = heartbeat.tick() => {
                let beat = proto::Heartbeat {
                    sent_at_ms: edgefleet_shared::now_unix_ms(),
                    outbox_depth: store.outbox_depth() as u64,
                    events_dropped: store.events_dropped_total()?,
                    device_count: store.device_count() as u32,
                };
                send(&tx, agent_message::Kind::Heartbeat(beat)).await?;
            }
        }
    }
}

/// Marks the store's link up while a session is open.
struct LinkUp(Store);

impl LinkUp {
    fn new(store: &Store) -> Self {
        store.set_link(Some(edgefleet_shared::now_unix_ms()));
        LinkUp(store.clone())
    }
}

impl Drop for LinkUp {
    fn drop(&mut self) {
        self.0.set_link(None);
    }
}

/// Stores an update durably, then acknowledges it; refuses it whole if any
/// resource in it is invalid.
async fn apply_update(
    store: &Store,
    tx: &mpsc::Sender<proto::AgentMessage>,
    update: proto::Update,
) -> Result<(), SyncError> {
    let mut upserts = Vec::with_capacity(update.upserts.len());
    let mut rejected = Vec::new();
    for resource in update.upserts {
        match desired_device(&resource) {
            Ok(entry) => upserts.push(entry),
            Err(reason) => rejected.push(proto::RejectedResource {
                key: resource.key,
                reason,
            }),
        }
    }
    let mut removals = Vec::with_capacity(update.removals.len());
    for key in &update.removals {
        match key.parse::<ResourceKey>() {
            Ok(key) => removals.push(key),
            Err(e) => rejected.push(proto::RejectedResource {
                key: key.clone(),
                reason: e.to_string(),
            }),
        }
    }
    if !rejected.is_empty() {
        tracing::warn!(nonce = %update.nonce, rejected = rejected.len(), "refusing an update");
        let nack = proto::Nack {
            nonce: update.nonce,
            rejected,
        };
        return send(tx, agent_message::Kind::Nack(nack)).await;
    }
    store.apply(&upserts, &removals).await?;
    tracing::debug!(nonce = %update.nonce, upserts = upserts.len(), removals = removals.len(), "update stored");
    send(
        tx,
        agent_message::Kind::Ack(proto::Ack {
            nonce: update.nonce,
        }),
    )
    .await
}

/// A resource of an Update as the store keeps it.
fn desired_device(resource: &proto::Resource) -> Result<(ResourceKey, DesiredDevice), String> {
    let key: ResourceKey = resource
        .key
        .parse()
        .map_err(|e: edgefleet_shared::key::ResourceKeyError| e.to_string())?;
    let version = resource.version.as_ref().ok_or("no version")?;
    let Some(resource::Body::Device(device)) = &resource.body else {
        return Err("no device body".into());
    };
    let transport = match proto::Transport::try_from(device.transport) {
        Ok(proto::Transport::Coap) => Transport::Coap,
        Ok(proto::Transport::Mqtt) => Transport::Mqtt,
        _ => return Err(format!("unknown transport {}", device.transport)),
    };
    let properties = device
        .properties
        .iter()
        .map(|(k, v)| Ok((k.clone(), PropertyValue::try_from(v)?)))
        .collect::<Result<BTreeMap<_, _>, proto::MissingField>>()
        .map_err(|e| e.to_string())?;
    let firmware = device.firmware.as_ref().map(|f| FirmwareOrder {
        version: f.version.clone(),
        url: (!f.url.is_empty()).then(|| f.url.clone()),
        sha256: (!f.sha256.is_empty()).then(|| f.sha256.clone()),
    });
    Ok((
        key,
        DesiredDevice {
            version: version.into(),
            model: device.model.clone(),
            transport,
            properties,
            firmware,
        },
    ))
}

/// The uplink entries sent in this session and not yet acknowledged, at
/// most [`proto::UPLINK_WINDOW`].
#[derive(Debug, Default)]
struct InFlight {
    seqs: VecDeque<u64>,
    sent_up_to: u64,
}

impl InFlight {
    /// How many more entries may go now.
    fn room(&self) -> usize {
        proto::UPLINK_WINDOW.saturating_sub(self.seqs.len())
    }

    fn sent(&mut self, seqs: impl IntoIterator<Item = u64>) {
        for seq in seqs {
            self.seqs.push_back(seq);
            self.sent_up_to = seq;
        }
    }

    fn acknowledged(&mut self, up_to: u64) {
        while self.seqs.front().is_some_and(|seq| *seq <= up_to) {
            self.seqs.pop_front();
        }
    }
}

/// Sends outbox entries not sent yet in this session, in batches, as long
/// as the window has room; events dropped at the bound since the last call
/// go up as an entry of their own.
async fn send_outbox(
    store: &Store,
    tx: &mpsc::Sender<proto::AgentMessage>,
    in_flight: &mut InFlight,
) -> Result<(), SyncError> {
    if let Some(seq) = store.seal_dropped().await? {
        tracing::warn!(
            seq,
            "events were dropped at the outbox bound; telling the cloud"
        );
    }
    loop {
        let room = in_flight.room().min(UPLINK_BATCH);
        if room == 0 {
            return Ok(());
        }
        let batch = store.pending_uplink(in_flight.sent_up_to, room)?;
        if batch.is_empty() {
            return Ok(());
        }
        in_flight.sent(batch.iter().map(|(seq, _)| *seq));
        let entries = batch
            .into_iter()
            .map(|(seq, pending)| proto::UplinkEntry {
                seq,
                body: Some(uplink_body(pending)),
            })
            .collect();
        send(tx, agent_message::Kind::Uplink(proto::Uplink { entries })).await?;
    }
}

/// An outbox entry as the sync protocol carries it.
fn uplink_body(pending: PendingUplink) -> uplink_entry::Body {
    match pending {
        PendingUplink::Report { device, latest } => uplink_entry::Body::Report(proto::Report {
            device_key: device.to_string(),
            applied_generation: latest.report.applied_generation,
            properties: latest
                .report
                .properties
                .iter()
                .map(|(k, v)| (k.clone(), v.into()))
                .collect(),
            firmware_version: latest.report.firmware_version.unwrap_or_default(),
            received_at_ms: latest.received_at_ms,
        }),
        PendingUplink::Event { device, stored } => uplink_entry::Body::Event(proto::Event {
            device_key: device.to_string(),
            r#type: if stored.event.warning {
                proto::EventType::Warning
            } else {
                proto::EventType::Normal
            }
            .into(),
            reason: stored.event.reason,
            message: stored.event.message,
            at_ms: stored.at_ms,
            device_event_id: stored.event.id,
        }),
        PendingUplink::EventsDropped(dropped) => {
            uplink_entry::Body::EventsDropped(proto::EventsDropped {
                count: dropped.count,
                first_at_ms: dropped.first_at_ms,
                last_at_ms: dropped.last_at_ms,
                bound: dropped.bound,
            })
        }
    }
}

async fn send(
    tx: &mpsc::Sender<proto::AgentMessage>,
    kind: agent_message::Kind,
) -> Result<(), SyncError> {
    tx.send(proto::AgentMessage { kind: Some(kind) })
        .await
        .map_err(|_| SyncError::Closed)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_window_closes_when_full_and_opens_with_acknowledgements() {
        let mut in_flight = InFlight::default();
        assert_eq!(in_flight.room(), proto::UPLINK_WINDOW);
        // Sequence numbers have gaps where reports were compacted.
        in_flight.sent((1..=proto::UPLINK_WINDOW as u64).map(|n| n * 2));
        assert_eq!(in_flight.room(), 0);
        assert_eq!(in_flight.sent_up_to, proto::UPLINK_WINDOW as u64 * 2);
        in_flight.acknowledged(9); // covers 2, 4, 6, 8
        assert_eq!(in_flight.room(), 4);
        in_flight.acknowledged(9); // a repeated acknowledgement frees nothing
        assert_eq!(in_flight.room(), 4);
        in_flight.acknowledged(u64::MAX);
        assert_eq!(in_flight.room(), proto::UPLINK_WINDOW);
    }
}
