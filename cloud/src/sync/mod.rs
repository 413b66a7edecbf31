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

use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::Duration;

use edgefleet_shared::ResourceKey;
use edgefleet_shared::api::Device;
use edgefleet_shared::heartbeat::{Heartbeat, PeerWatch};
use edgefleet_shared::key::ResourceKind;
use edgefleet_shared::proto::{self, agent_message, cloud_message};
use edgefleet_shared::telemetry::Outcomes;
use kube::runtime::reflector::{self, ObjectRef};
use prometheus_client::metrics::counter::Counter;
use prometheus_client::metrics::gauge::Gauge;
use tokio::sync::{mpsc, watch};
use tokio_stream::wrappers::ReceiverStream;
use tonic::metadata::MetadataMap;
use tonic::{Request, Response, Status, Streaming};

use crate::agent_identity::{self, AgentAuth, Authenticated, Proof};
use crate::agents::{Agents, delivered_to};
use crate::device_events::DeviceEvents;
use crate::edge_node::NodeStatus;
use crate::events::{Events, Note, resource_reference};
use crate::index::{Index, NodeSlice};
use crate::leases::Fence;
use crate::status::{Completion, StatusChange, StatusWriter};
use admission::{Admission, Bound, Peer, Place};

pub mod admission;
pub mod session;

pub use session::{
    Accepted, Effect, Holdings, MAX_RESOURCES_PER_UPDATE, Opening, Session, SessionError,
    UplinkMarks, UplinkWatermark,
};

/// How often a running session's token is reviewed again by default
/// (answered from the review cache within its life).
pub const TOKEN_RECHECK: Duration = Duration::from_secs(60);

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
    /// Connections by outcome: `tls` (handshake done), `plaintext`,
    /// `handshake_failed`, `handshake_timeout`, `too_many_handshakes`.
    pub connections: Outcomes,
    /// Certificate files that changed, by outcome (`loaded`, `failed`).
    pub tls_reloads: Outcomes,
    /// Streams by how the agent proved its node: `token`, `trusted_hello`
    /// (no check, `--insecure-unauthenticated-agents`), or why it was
    /// refused (`no_token`, `invalid_token`, `wrong_service_account`,
    /// `node_mismatch`, `review_failed`, …).
    pub authentications: Outcomes,
    /// TokenReviews sent to the API server.
    pub token_reviews: Counter,
    /// CertificateSigningRequests of the signer `edgefleet.io/agent` by
    /// outcome: `issued`, or why one was denied (`NoSuchEdgeNode`,
    /// `NotACertificateNode`, `WrongSubject`, …).
    pub agent_certificates: Outcomes,
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
        self.connections.register(
            registry,
            "connections",
            "Sync connections by outcome (tls, plaintext, handshake_failed, handshake_timeout, too_many_handshakes)",
        );
        self.tls_reloads.register(
            registry,
            "tls_reloads",
            "Changes of the certificate files by outcome (loaded, failed)",
        );
        self.authentications.register(
            registry,
            "authentications",
            "Agent streams by how the agent proved its node (token, trusted_hello) or why it was refused",
        );
        registry.register(
            "token_reviews",
            "TokenReviews sent to the API server",
            self.token_reviews.clone(),
        );
        self.agent_certificates.register(
            registry,
            "agent_certificates",
            "Agents' certificate requests (signer edgefleet.io/agent) by outcome (issued, or why denied)",
        );
    }
}

/// The gRPC service.
#[derive(Clone)]
pub struct SyncService {
    client: kube::Client,
    fence: Fence,
    index: Arc<Index>,
    devices: reflector::Store<Device>,
    status: StatusWriter,
    agents: Arc<Agents>,
    events: Events,
    device_events: DeviceEvents,
    metrics: Arc<SyncMetrics>,
    auth: AgentAuth,
    admission: Arc<Admission>,
    token_recheck: Duration,
    sessions: Arc<AtomicU64>,
    heartbeat: Heartbeat,
}

/// What the sync service works with.
#[derive(Clone)]
pub struct SyncParts {
    /// For EdgeNodes.
    pub client: kube::Client,
    /// Which nodes this replica serves, and the clients that write for them.
    pub fence: Fence,
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
    /// How agents prove their node.
    pub auth: AgentAuth,
    /// Bounds on connections and streams.
    pub admission: Arc<Admission>,
}

impl SyncService {
    /// A service serving `parts.index`, writing reports through
    /// `parts.status`, device events through `parts.device_events` and
    /// EdgeNodes with `parts.client`, keeping `parts.agents` up to date.
    pub fn new(parts: SyncParts) -> Self {
        let SyncParts {
            client,
            fence,
            index,
            devices,
            status,
            agents,
            events,
            device_events,
            metrics,
            auth,
            admission,
        } = parts;
        SyncService {
            client,
            fence,
            index,
            devices,
            status,
            agents,
            events,
            device_events,
            metrics,
            auth,
            admission,
            token_recheck: TOKEN_RECHECK,
            sessions: Arc::default(),
            heartbeat: Heartbeat::default(),
        }
    }

    /// Reviews the token of each running session again every `every`
    /// (default [`TOKEN_RECHECK`]).
    pub fn with_token_recheck(self, every: Duration) -> Self {
        SyncService {
            token_recheck: every,
            ..self
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

/// Counts a message refused for its size (over
/// [`proto::MAX_MESSAGE_BYTES`]) as `refused{outcome="oversized"}`.
fn count_oversized(metrics: &SyncMetrics, status: &Status) {
    if status.code() == tonic::Code::OutOfRange {
        metrics.refused.inc("oversized");
        tracing::info!(%status, "an agent's message was refused for its size");
    }
}

#[tonic::async_trait]
impl proto::sync_server::Sync for SyncService {
    type StreamStream = ReceiverStream<Result<proto::CloudMessage, Status>>;

    async fn stream(
        &self,
        request: Request<Streaming<proto::AgentMessage>>,
    ) -> Result<Response<Self::StreamStream>, Status> {
        // A place among the open streams before anything else is read.
        let peer = Peer::of(&request).cloned();
        let place = self.place_for(peer.as_ref())?;
        // A client certificate rustls verified against the agents' CA.
        let certificate = request
            .extensions()
            .get::<tonic::transport::server::TlsConnectInfo<Peer>>()
            .and_then(|tls| tls.peer_certs())
            .and_then(|chain| chain.first().cloned());
        let authenticated = match certificate {
            Some(certificate) => Some(self.authenticate_certificate(&certificate).await?),
            None => self.authenticate(request.metadata()).await?,
        };
        if let Some(peer) = &peer {
            peer.authenticated();
        }
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
        let hello = match first.inspect_err(|s| count_oversized(&self.metrics, s))? {
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
        if let Some(Authenticated { node, .. }) = &authenticated
            && *node != hello.node
        {
            self.metrics.authentications.inc("node_mismatch");
            tracing::warn!(authenticated = %node, claimed = %hello.node, "an agent claimed another node than it proved: refused");
            return Err(Status::permission_denied(format!(
                "the credentials are of node {node}, the Hello names {}",
                hello.node
            )));
        }
        if !self.fence.serves(&hello.node) {
            self.metrics.refused.inc("elsewhere");
            return Err(elsewhere(
                &hello.node,
                self.fence.shards().served_at(&hello.node),
            ));
        }
        let opening = Opening::of(&hello).map_err(|error| {
            self.metrics.refused.inc(error.label());
            Status::invalid_argument(format!("Hello from {}: {error}", hello.node))
        })?;
        if opening == Opening::Digest(None) {
            self.metrics.refused.inc("bad_held_digest");
            tracing::warn!(node = %hello.node, bytes = hello.held_digest.len(), "a Hello digest that is not 16 bytes: asking for the list instead");
        }
        tracing::info!(node = %hello.node, agent = %hello.agent_version, boot = %hello.boot_id, store = %hello.store_id, held = hello.held_count.max(hello.held.len() as u32), "agent connected");

        let node_status = NodeStatus::new(self.fence.node(&hello.node), &hello.node);
        let (tx, rx) = mpsc::channel(16);
        let session = Driver {
            id: self.sessions.fetch_add(1, Ordering::Relaxed),
            agents: Arc::clone(&self.agents),
            devices: self.devices.clone(),
            events: self.events.clone(),
            device_events: self.device_events.clone(),
            store_id: hello.store_id.clone(),
            desired: self.index.subscribe(&hello.node),
            node: hello.node.clone(),
            status: self.status.clone(),
            metrics: Arc::clone(&self.metrics),
            heartbeat: self.heartbeat,
            _place: place,
            identity: authenticated,
            token_recheck: self.token_recheck,
            fence: self.fence.clone(),
        };
        tokio::spawn(session.run(opening, hello, inbound, tx, node_status));
        Ok(Response::new(ReceiverStream::new(rx)))
    }
}

impl SyncService {
    /// A place among the open streams for a stream from `peer` (`None`
    /// when the connection was not admitted here, as in unit tests).
    fn place_for(&self, peer: Option<&Peer>) -> Result<Option<Place>, Status> {
        let Some(peer) = peer else {
            return Ok(None);
        };
        let place = self.admission.stream(peer.remote.ip()).map_err(|bound| {
            let label = match bound {
                Bound::Total => "too_many_streams",
                Bound::PerAddress => "too_many_streams_from_address",
            };
            self.metrics.refused.inc(label);
            tracing::info!(remote = %peer.remote, label, "sync stream refused");
            Status::resource_exhausted(format!("{label}: try again later"))
        })?;
        Ok(Some(place))
    }

    /// The node of a client certificate the TLS handshake verified against
    /// the agents' CA, if its EdgeNode (still) takes certificates; counted
    /// by outcome.
    async fn authenticate_certificate(
        &self,
        certificate: &rustls::pki_types::CertificateDer<'_>,
    ) -> Result<Authenticated, Status> {
        let refuse = |label: &'static str, message: String| {
            self.metrics.authentications.inc(label);
            tracing::warn!(label, %message, "an agent's certificate was refused");
            Status::permission_denied(message)
        };
        let Some(presented) = crate::agent_certs::presented(certificate) else {
            return Err(refuse(
                "certificate_without_node",
                format!(
                    "the client certificate's subject is not CN={}<node>",
                    crate::agent_certs::COMMON_NAME_PREFIX
                ),
            ));
        };
        let node = presented.node.clone();
        let edge_nodes: kube::Api<edgefleet_shared::api::EdgeNode> =
            kube::Api::all(self.client.clone());
        let edge_node = edge_nodes.get_opt(&node).await.map_err(|error| {
            self.metrics.authentications.inc("review_failed");
            tracing::warn!(%error, "could not read the EdgeNode of an agent's certificate");
            Status::unavailable(format!("could not check EdgeNode {node}"))
        })?;
        // The handshake checked the validity period, but a connection
        // outlives it: every stream is checked again.
        if let Err(denial) = crate::agent_certs::admit_certificate(
            &presented,
            edge_node.as_ref(),
            std::time::SystemTime::now(),
        ) {
            let label = match denial.reason {
                "CertificateExpired" => "certificate_expired",
                "CertificateRevoked" => "certificate_revoked",
                _ => "certificate_not_allowed",
            };
            return Err(refuse(label, denial.message));
        }
        self.metrics.authentications.inc("certificate");
        Ok(Authenticated {
            node,
            proof: Proof::Certificate {
                certificate: presented,
                edge_nodes: Box::new(edge_nodes),
            },
        })
    }

    /// The node the stream's token is bound to (`None` when Hellos are
    /// believed), counted by outcome.
    async fn authenticate(&self, metadata: &MetadataMap) -> Result<Option<Authenticated>, Status> {
        let reviews = match &self.auth {
            AgentAuth::TrustHello => {
                self.metrics.authentications.inc("trusted_hello");
                return Ok(None);
            }
            AgentAuth::Tokens(reviews) => reviews,
        };
        let header = metadata.get("authorization").map(|value| value.as_bytes());
        let verdict = match agent_identity::bearer(header) {
            Err(refusal) => Err(refusal),
            Ok(token) => reviews
                .node(token)
                .await
                .map_err(|failed| {
                    self.metrics.authentications.inc("review_failed");
                    tracing::warn!(%failed, "could not review an agent's token");
                    Status::unavailable(failed.to_string())
                })?
                .map(|node| Authenticated {
                    node,
                    proof: Proof::Token {
                        token: token.to_owned(),
                        reviews: Arc::clone(reviews),
                    },
                }),
        };
        match verdict {
            Ok(authenticated) => {
                self.metrics.authentications.inc("token");
                Ok(Some(authenticated))
            }
            Err(refusal) => {
                self.metrics.authentications.inc(refusal.label());
                tracing::warn!(%refusal, "an agent was refused");
                Err(refusal.status())
            }
        }
    }
}

/// A Kubernetes node name: a DNS-1123 subdomain.
pub(crate) fn is_node_name(name: &str) -> bool {
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

/// Drives one [`Session`] over a tonic stream: feeds it the agent's
/// messages, the node's slice and uplink completions, and carries out its
/// effects. Kubernetes writes never wait inside this loop: status and
/// Events are queued, and the EdgeNode has a task of its own.
struct Driver {
    id: u64,
    agents: Arc<Agents>,
    devices: reflector::Store<Device>,
    events: Events,
    device_events: DeviceEvents,
    store_id: String,
    node: String,
    desired: watch::Receiver<NodeSlice>,
    status: StatusWriter,
    metrics: Arc<SyncMetrics>,
    heartbeat: Heartbeat,
    // Its place among the open streams, given back when it ends.
    _place: Option<Place>,
    // The token it was let in with, reviewed again every `token_recheck`.
    identity: Option<Authenticated>,
    token_recheck: Duration,
    // Ends the session once another replica serves the node.
    fence: Fence,
}

/// The refusal of a session for a node another replica serves: `unavailable`
/// (the agent retries), with where to go in [`proto::REDIRECT_METADATA`]
/// when the serving replica said, or else when to try again in
/// [`proto::RETRY_AFTER_METADATA`] (the shard is between replicas).
fn elsewhere(node: &str, served_at: Option<String>) -> Status {
    let mut status = Status::unavailable(format!(
        "node {node} is served by another replica of the controller"
    ));
    match served_at.and_then(|url| url.parse().ok()) {
        Some(url) => {
            status.metadata_mut().insert(proto::REDIRECT_METADATA, url);
        }
        None => {
            let after = RETRY_WHILE_MOVING.as_millis().to_string();
            if let Ok(after) = after.parse() {
                status
                    .metadata_mut()
                    .insert(proto::RETRY_AFTER_METADATA, after);
            }
        }
    }
    status
}

/// How soon an agent whose shard is between replicas tries again.
const RETRY_WHILE_MOVING: Duration = Duration::from_secs(1);

/// Why a driven session ended.
#[derive(Debug, thiserror::Error)]
enum Ended {
    #[error(transparent)]
    Protocol(#[from] SessionError),
    #[error("stream error: {0}")]
    Stream(Status),
    #[error("the agent went away")]
    AgentGone,
    #[error("a newer session of the same node took over")]
    Superseded,
    #[error("the index closed")]
    IndexClosed,
    #[error("agent silent for {0:?}")]
    Silent(Duration),
    #[error("its credentials no longer hold: {0}")]
    Revoked(String),
    #[error("another replica serves the node now")]
    Moved,
}

impl Driver {
    async fn run(
        mut self,
        opening: Opening,
        hello: proto::Hello,
        mut inbound: Streaming<proto::AgentMessage>,
        tx: Outbound,
        node_status: NodeStatus,
    ) {
        self.metrics.streams.inc();
        // Only the newest session of a node speaks for it; an older one
        // still open (its agent's reconnect crossed it) ends now.
        let mut newest = self.agents.claim(&self.node, self.id);
        let figures = EdgeNodeFigures::start(
            node_status,
            self.id,
            newest.clone(),
            &hello.agent_version,
            &hello.boot_id,
        );
        let (done_tx, mut done_rx) = mpsc::unbounded_channel();
        let mut heartbeat = tokio::time::interval(self.heartbeat.interval);
        // Started when the Hello arrived.
        let watch = PeerWatch::new(self.heartbeat.silence_limit());
        let known = self.known_holdings(opening);
        let slice = self.desired.borrow_and_update().clone();
        let (mut session, effects) = Session::open(&self.node, &self.store_id, slice, known);
        session.set_uplink_flows(hello.uplink_flows);
        let (metrics, node) = (Arc::clone(&self.metrics), self.node.clone());
        // A deleted pod's token ends its session too.
        let (identity, recheck) = (self.identity.take(), self.token_recheck);
        let fence = self.fence.clone();
        let talk = async {
            self.carry_out(effects, &tx, &done_tx, &figures).await?;
            loop {
                tokio::select! {
                    changed = self.desired.changed() => {
                        changed.map_err(|_| Ended::IndexClosed)?;
                        let slice = self.desired.borrow_and_update().clone();
                        let effects = session.slice_changed(slice);
                        self.carry_out(effects, &tx, &done_tx, &figures).await?;
                    }
                    message = inbound.message() => {
                        let message = message
                            .inspect_err(|s| count_oversized(&metrics, s))
                            .map_err(Ended::Stream)?
                            .ok_or(Ended::AgentGone)?;
                        watch.heard();
                        // An uplink entry about a Device that just arrived
                        // in the slice is judged against the latest slice.
                        if self.desired.has_changed().unwrap_or(false) {
                            let slice = self.desired.borrow_and_update().clone();
                            let effects = session.slice_changed(slice);
                            self.carry_out(effects, &tx, &done_tx, &figures).await?;
                        }
                        self.count(&message);
                        let effects = session.received(message)?;
                        self.carry_out(effects, &tx, &done_tx, &figures).await?;
                    }
                    Some(seq) = done_rx.recv() => {
                        let effects = session.uplink_durable(seq).into_iter().collect();
                        self.carry_out(effects, &tx, &done_tx, &figures).await?;
                    }
                    _ = newest.changed() => {
                        if *newest.borrow_and_update() != self.id {
                            return Err(Ended::Superseded);
                        }
                    }
                    _ = heartbeat.tick() => {
                        let beat = proto::Heartbeat { sent_at_ms: edgefleet_shared::now_unix_ms(), ..Default::default() };
                        send(&tx, cloud_message::Kind::Heartbeat(beat)).await?;
                    }
                }
            }
        };
        let silent = async {
            let silent = watch.silent().await;
            metrics.silent_agents.inc();
            tracing::warn!(
                %node,
                silent_for = ?silent,
                missed = edgefleet_shared::heartbeat::MISSED_HEARTBEATS,
                "heard nothing from the agent for 3 heartbeat intervals: ending its session"
            );
            Err::<(), _>(Ended::Silent(silent))
        };
        let revoked = async {
            let reason = match &identity {
                None => return std::future::pending().await,
                Some(Authenticated {
                    node,
                    proof: Proof::Token { token, reviews },
                }) => reviews.revoked(token, node, recheck).await.to_string(),
                Some(Authenticated {
                    proof:
                        Proof::Certificate {
                            certificate,
                            edge_nodes,
                        },
                    ..
                }) => crate::agent_certs::withdrawn(edge_nodes, certificate, recheck).await,
            };
            metrics.authentications.inc("revoked");
            Err::<(), _>(Ended::Revoked(reason))
        };
        let moved = async {
            let mut changes = fence.shards().subscribe();
            // The shard's time also runs out without a change being told
            // (a paused process): look at least every second.
            while fence.serves(&node) {
                let _ = tokio::time::timeout(Duration::from_secs(1), changes.changed()).await;
            }
            Err::<(), _>(Ended::Moved)
        };
        let result: Result<(), Ended> = tokio::select! {
            ended = talk => ended,
            ended = silent => ended,
            ended = revoked => ended,
            ended = moved => ended,
        };
        if let Err(Ended::Moved) = &result {
            // Told where to go; what it sent and was not acknowledged it
            // sends again there.
            let refusal = elsewhere(&self.node, self.fence.shards().served_at(&self.node));
            let _ = tx.try_send(Err(refusal));
        }
        self.metrics.streams.dec();
        self.agents.disconnected(&self.node, self.id);
        // Dropping the figures' sender ends the EdgeNode task, which
        // records the disconnection if no newer session took over.
        drop(figures);
        match result {
            Ok(()) | Err(Ended::AgentGone) => {
                tracing::info!(node = %self.node, "agent disconnected")
            }
            Err(Ended::Protocol(error)) => {
                self.metrics.refused.inc(error.label());
                tracing::warn!(node = %self.node, %error, "agent stream ended");
            }
            Err(reason) => tracing::warn!(node = %self.node, %reason, "agent stream ended"),
        }
    }

    /// What the Hello says the agent holds, if it can be told without a
    /// list: listed, empty, or a digest that matches what this process saw
    /// that store acknowledge or what the Devices' statuses say was
    /// delivered (with the node's rules and device keys as they are now).
    fn known_holdings(&self, opening: Opening) -> Option<Holdings> {
        let (known, how) = opening.known(
            |digest| self.agents.remembered(&self.node, &self.store_id, digest),
            || {
                // Devices as their statuses say; rules and device keys as
                // the index has them now (if the agent holds other
                // versions, the digest will not match and it is asked).
                // Only this node's Devices are looked at, so a Hello costs
                // the node's size, not the fleet's.
                let slice = self.desired.borrow();
                let (devices, others): (Vec<_>, Vec<_>) =
                    slice.iter().partition(|(key, _)| key.is_device());
                let devices: Vec<Arc<Device>> = devices
                    .into_iter()
                    .filter_map(|(key, _)| {
                        self.devices
                            .get(&ObjectRef::new(&key.name).within(&key.namespace))
                    })
                    .collect();
                let mut delivered = delivered_to(&self.node, devices.iter().map(|d| &**d));
                delivered.extend(
                    others
                        .into_iter()
                        .map(|(key, entry)| (key.clone(), entry.version.clone())),
                );
                delivered
            },
        );
        self.metrics.hellos.inc(how);
        if known.is_none() {
            tracing::info!(node = %self.node, store = %self.store_id, "the agent's holdings are not what this controller remembers: asking for its inventory");
        }
        known
    }

    fn count(&self, message: &proto::AgentMessage) {
        match &message.kind {
            Some(agent_message::Kind::Nack(_)) => {
                self.metrics.nacks.inc();
            }
            Some(agent_message::Kind::Uplink(uplink)) => {
                self.metrics
                    .uplink_entries
                    .inc_by(uplink.entries.len() as u64);
            }
            _ => {}
        }
    }

    async fn carry_out(
        &self,
        effects: Vec<Effect>,
        tx: &Outbound,
        done: &mpsc::UnboundedSender<u64>,
        figures: &EdgeNodeFigures,
    ) -> Result<(), Ended> {
        for effect in effects {
            match effect {
                Effect::Send(message) => {
                    if let cloud_message::Kind::Update(update) = &message {
                        self.metrics.updates.inc();
                        self.metrics
                            .resources_sent
                            .inc_by(update.upserts.len() as u64);
                    }
                    send(tx, message).await?;
                }
                Effect::Live(held) => {
                    if !self
                        .agents
                        .connected(&self.node, self.id, &self.store_id, held)
                    {
                        return Err(Ended::Superseded);
                    }
                    // Devices marked unreachable while the node was away
                    // are back (a change that alters nothing costs no write).
                    let devices: Vec<ResourceKey> = self
                        .desired
                        .borrow()
                        .keys()
                        .filter(|k| k.is_device())
                        .cloned()
                        .collect();
                    for key in devices {
                        self.status.submit(key, StatusChange::NodeReachable, None);
                    }
                }
                Effect::Stored { upserts, removals } => {
                    self.agents
                        .acknowledged(&self.node, self.id, &upserts, &removals);
                    // A rule's delivery is no Device's status.
                    for (key, version) in upserts.into_iter().filter(|(k, _)| k.is_device()) {
                        let change = StatusChange::Delivered {
                            uid: version.uid,
                            generation: version.generation,
                        };
                        self.status.submit(key, change, None);
                    }
                }
                Effect::Holds(held) => {
                    for (key, version) in held.into_iter().filter(|(k, _)| k.is_device()) {
                        let change = StatusChange::Delivered {
                            uid: version.uid,
                            generation: version.generation,
                        };
                        self.status.submit(key, change, None);
                    }
                }
                Effect::Refused {
                    key,
                    version,
                    reason,
                } => {
                    tracing::warn!(node = %self.node, %key, %version, %reason, "agent refused a resource");
                    let what = match key.kind {
                        ResourceKind::Device => format!("generation {}", version.generation),
                        ResourceKind::Rule => "the rule".to_owned(),
                        ResourceKind::Credential => "its credential".to_owned(),
                    };
                    self.events.publish(
                        resource_reference(&key, &version.uid),
                        Note {
                            warning: true,
                            reason: "RejectedByAgent",
                            action: "Deliver",
                            text: format!(
                                "the agent of node {} refused {what}: {reason}",
                                self.node
                            ),
                        },
                    );
                    if !key.is_device() {
                        continue;
                    }
                    let change = StatusChange::Rejected {
                        uid: version.uid,
                        generation: version.generation,
                        reason,
                    };
                    self.status.submit(key, change, None);
                }
                Effect::Uplink { seq, entry } => {
                    let completion = Completion {
                        seq,
                        notify: done.clone(),
                    };
                    match *entry {
                        Accepted::Status(key, change) => {
                            self.status.submit(key, change, Some(completion))
                        }
                        Accepted::Event(event) => self.device_events.submit(event, completion),
                        Accepted::Dropped(notice) => {
                            self.device_events.submit_dropped(notice, completion)
                        }
                    }
                }
                Effect::Counted(label) => self.metrics.refused.inc(label),
                Effect::Figures {
                    devices,
                    outbox,
                    events_dropped,
                } => figures.send((devices, outbox, events_dropped)),
            }
        }
        Ok(())
    }
}

/// The EdgeNode of one session, written by a task of its own so a slow API
/// server never stalls the sync stream: it records the connection, then
/// the latest heartbeat figures (older ones are skipped, not queued), then
/// the disconnection once the session drops this. It writes only while its
/// session is the node's newest.
struct EdgeNodeFigures(watch::Sender<(i64, i64, i64)>);

impl EdgeNodeFigures {
    fn start(
        mut node_status: NodeStatus,
        session: u64,
        newest: watch::Receiver<u64>,
        agent_version: &str,
        boot_id: &str,
    ) -> Self {
        let (tx, mut rx) = watch::channel((0, 0, 0));
        let (agent_version, boot_id) = (agent_version.to_owned(), boot_id.to_owned());
        let current = move || *newest.borrow() == session;
        tokio::spawn(async move {
            let node = node_status.node().to_owned();
            if current()
                && let Err(error) = node_status.connected(&agent_version, &boot_id).await
            {
                tracing::warn!(%node, %error, "could not record the EdgeNode's connection");
            }
            while rx.changed().await.is_ok() {
                let (devices, outbox, dropped) = *rx.borrow_and_update();
                if !current() {
                    return;
                }
                if let Err(error) = node_status.heartbeat(devices, outbox, dropped).await {
                    tracing::warn!(%node, %error, "could not record a heartbeat");
                }
            }
            if current()
                && let Err(error) = node_status.disconnected().await
            {
                tracing::warn!(%node, %error, "could not record the EdgeNode's disconnection");
            }
        });
        EdgeNodeFigures(tx)
    }

    fn send(&self, figures: (i64, i64, i64)) {
        self.0.send_replace(figures);
    }
}

async fn send(tx: &Outbound, kind: cloud_message::Kind) -> Result<(), Ended> {
    tx.send(Ok(proto::CloudMessage { kind: Some(kind) }))
        .await
        .map_err(|_| Ended::AgentGone)
}

#[cfg(test)]
mod tests {
    use super::*;

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
