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

use std::time::Duration;

use backon::{BackoffBuilder, ExponentialBuilder};
use edgefleet_shared::health::Check;
use edgefleet_shared::heartbeat::{Heartbeat, PeerWatch};
use edgefleet_shared::proto::{self, agent_message, cloud_message};
use prometheus_client::metrics::counter::Counter;
use prometheus_client::metrics::family::Family;
use tokio::sync::mpsc;
use tokio_stream::StreamExt;
use tokio_stream::wrappers::ReceiverStream;

use crate::store::{Store, StoreError};

mod redirect;
pub mod session;

use redirect::{Advice, Redirects, redirected};

pub use session::{Session, Step};

/// Most outbox entries in one Uplink message.
pub const UPLINK_BATCH: usize = 256;

/// The longest the sync loop may go without turning: a connection attempt
/// and the Hello (each bounded by the silence limit) and the longest
/// backoff, with room to spare.
pub fn stall_limit(heartbeat: Heartbeat) -> Duration {
    heartbeat.silence_limit() * 2 + Duration::from_secs(30)
}

/// How often the agent sends a heartbeat by default.
pub const HEARTBEAT_INTERVAL: Duration = Heartbeat::DEFAULT.interval;

/// Who this agent is and where the cloud is.
#[derive(Clone, Debug)]
pub struct SyncSettings {
    /// The cloud's sync endpoint, like `https://cloud.example:7443`
    /// (`http://` only for plaintext).
    pub cloud: String,
    /// How the cloud's certificate is checked (`None`: plaintext).
    pub tls: Option<CloudTls>,
    /// The ServiceAccount token that proves this node, read on every
    /// connect (the kubelet renews it); `None` sends none.
    pub token_file: Option<std::path::PathBuf>,
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
    /// Redirects not followed (to plaintext with TLS configured, or not a
    /// URL).
    pub refused_redirects: Counter,
    /// Protobuf bytes of the messages sent and received, by message kind.
    pub bytes: MessageBytes,
    /// Told whenever the sync loop turns (between attempts, at every
    /// heartbeat), so a loop that hangs shows on `/healthz`.
    pub liveness: Check,
}

/// How the agent checks the cloud's certificate.
#[derive(Clone, Debug)]
pub struct CloudTls {
    /// The CA bundle (PEM) the certificate must chain to; read again on
    /// every connect, so a rotated bundle is taken without a restart.
    pub ca_file: std::path::PathBuf,
    /// The name the certificate must carry, when it is not the URL's host.
    pub server_name: Option<String>,
    /// The agent's own client certificate and key (PEM files), for an agent
    /// that is not a pod and proves its node with a certificate of the
    /// signer `edgefleet.io/agent`; read again on every connect, so a
    /// renewed certificate is taken without a restart.
    pub client_certificate: Option<ClientCertificate>,
}

/// Where an agent's client certificate and key are.
#[derive(Clone, Debug)]
pub struct ClientCertificate {
    /// The certificate (PEM).
    pub cert_file: std::path::PathBuf,
    /// Its private key (PEM).
    pub key_file: std::path::PathBuf,
}

impl CloudTls {
    /// The tonic TLS configuration, with the files as they are now.
    fn config(&self) -> std::io::Result<tonic::transport::ClientTlsConfig> {
        let ca = std::fs::read(&self.ca_file)?;
        let mut config = tonic::transport::ClientTlsConfig::new()
            .ca_certificate(tonic::transport::Certificate::from_pem(ca));
        if let Some(own) = &self.client_certificate {
            let cert = std::fs::read(&own.cert_file)?;
            let key = std::fs::read(&own.key_file)?;
            config = config.identity(tonic::transport::Identity::from_pem(cert, key));
        }
        Ok(match &self.server_name {
            Some(name) => config.domain_name(name.clone()),
            None => config,
        })
    }
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
    /// Could not connect (a refused TLS certificate says why here).
    #[error("connect to {endpoint}: {}", causes(source))]
    Connect {
        /// Where.
        endpoint: String,
        /// Why.
        source: tonic::transport::Error,
    },
    /// The CA bundle to check the cloud's certificate cannot be read.
    #[error("read the cloud's CA bundle {path}: {source}")]
    CaBundle {
        /// The file.
        path: std::path::PathBuf,
        /// Why.
        source: std::io::Error,
    },
    /// The token file cannot be read, or is no token.
    #[error("read the token {path}: {reason}")]
    Token {
        /// The file.
        path: std::path::PathBuf,
        /// Why.
        reason: String,
    },
    /// TLS is configured and the URL is not `https`: tonic would talk
    /// plaintext to it.
    #[error("{endpoint} is not https, and TLS is configured: not connecting in plaintext")]
    Plaintext {
        /// Where.
        endpoint: String,
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

/// The `authorization` header of the token in `path`, as it is now.
fn bearer(path: &std::path::Path) -> Result<tonic::metadata::AsciiMetadataValue, SyncError> {
    let failed = |reason: String| SyncError::Token {
        path: path.to_owned(),
        reason,
    };
    let token = std::fs::read_to_string(path).map_err(|e| failed(e.to_string()))?;
    let token = token.trim();
    if token.is_empty() {
        return Err(failed("the file is empty".into()));
    }
    format!("Bearer {token}")
        .parse()
        .map_err(|_| failed("not a token: it has characters a header cannot carry".into()))
}

/// `error` and its causes, `: `-separated (tonic's own message is only
/// "transport error"; the TLS verdict is a cause).
fn causes(error: &dyn std::error::Error) -> String {
    let mut text = error.to_string();
    let mut next = error.source();
    while let Some(cause) = next {
        text.push_str(": ");
        text.push_str(&cause.to_string());
        next = cause.source();
    }
    text
}

/// Runs sync sessions until the process ends, reconnecting after each. A
/// replica that does not serve this node refuses with where to go
/// ([`proto::REDIRECT_METADATA`]): the next attempt goes there at once, and
/// back to `settings.cloud` if that fails. One that says when to try again
/// ([`proto::RETRY_AFTER_METADATA`]: the node's shard is moving) is tried
/// again then, without growing the backoff.
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
    let mut redirect: Option<String> = None;
    let mut redirects = Redirects::default();
    let tls = settings.tls.is_some();
    loop {
        settings.liveness.alive();
        let mut opened = false;
        let target = redirect.take();
        let here = match &target {
            Some(url) => redirected(&settings, url.clone()),
            None => settings.clone(),
        };
        let ended = session(&here, &store, &mut opened).await;
        match &ended {
            Ok(()) => tracing::info!(cloud = %here.cloud, "cloud closed the sync stream"),
            Err(error) => tracing::warn!(cloud = %here.cloud, %error, "sync session ended"),
        }
        // After a session that got its stream open, start the backoff over.
        if opened {
            delays = backoff();
        }
        let delay = match redirects.after(target, opened, ended.as_ref().err(), tls) {
            Advice::GoTo(url) => {
                tracing::info!(to = %url, "another controller replica serves this node: going there");
                redirect = Some(url);
                Duration::from_millis(20)
            }
            Advice::RetryAfter(after) => {
                tracing::info!(
                    ?after,
                    "this node's shard is moving between controller replicas: trying again soon"
                );
                after.mul_f64(1.0 + rand::random::<f64>() / 2.0)
            }
            Advice::Refused { url, why } => {
                settings.refused_redirects.inc();
                tracing::warn!(to = %url, why, "a redirect to another controller replica was not followed");
                delays.next().unwrap_or(Duration::from_secs(15))
            }
            Advice::Backoff => delays.next().unwrap_or(Duration::from_secs(15)),
        };
        settings.liveness.alive();
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
    let endpoint = match &settings.tls {
        // tonic would connect in plaintext, TLS configuration or not.
        Some(_) if endpoint.uri().scheme_str() != Some("https") => {
            return Err(SyncError::Plaintext {
                endpoint: settings.cloud.clone(),
            });
        }
        Some(tls) => {
            let config = tls.config().map_err(|source| SyncError::CaBundle {
                path: tls.ca_file.clone(),
                source,
            })?;
            endpoint
                .tls_config(config)
                .map_err(|source| SyncError::Connect {
                    endpoint: settings.cloud.clone(),
                    source,
                })?
        }
        None => endpoint,
    };
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
    let mut client = proto::sync_client::SyncClient::new(channel)
        .max_decoding_message_size(proto::MAX_MESSAGE_BYTES)
        .max_encoding_message_size(proto::MAX_MESSAGE_BYTES);
    let (tx, rx) = mpsc::channel(16);
    // What the store holds goes as a digest; the cloud asks for the list
    // if the digest is not what it remembers.
    let held = store.held()?;
    let hello = session::hello(
        &settings.node,
        &settings.agent_version,
        &settings.boot_id,
        store.store_id(),
        held.iter().map(|(k, v)| (k, v)),
    );
    send(&tx, agent_message::Kind::Hello(hello)).await?;
    let bytes = settings.bytes.clone();
    let backlog_up_to = store.last_seq()?;
    let outgoing = ReceiverStream::new(rx).map(move |message| {
        bytes.sent(&message, backlog_up_to);
        message
    });
    let mut request = tonic::Request::new(outgoing);
    if let Some(path) = &settings.token_file {
        request
            .metadata_mut()
            .insert("authorization", bearer(path)?);
    }
    let mut inbound = client.stream(request).await?.into_inner();
    watch.heard();
    *opened = true;
    tracing::info!(cloud = %settings.cloud, node = %settings.node, "sync stream open");
    let _link = LinkUp::new(store);

    // What this session sent and the cloud has not acknowledged yet; a new
    // session resends whatever is still unacknowledged.
    let mut core = Session::default();
    let mut heartbeat = tokio::time::interval(settings.heartbeat.interval);
    loop {
        send_outbox(store, &tx, &mut core).await?;
        tokio::select! {
            message = inbound.message() => {
                let Some(message) = message? else { return Ok(()) };
                watch.heard();
                settings.bytes.received(&message);
                match core.received(message) {
                    Step::Store { upserts, removals, reply } => {
                        store.apply(&upserts, &removals).await?;
                        if let agent_message::Kind::Nack(nack) = &reply {
                            for refused in &nack.rejected {
                                tracing::warn!(key = %refused.key, reason = %refused.reason, "refusing a resource of an update");
                            }
                        }
                        tracing::debug!(upserts = upserts.len(), removals = removals.len(), "update stored");
                        send(&tx, reply).await?;
                    }
                    Step::UplinkAcked { reports, events } => {
                        store.acknowledge_uplink(reports, events).await?;
                    }
                    Step::ListHoldings { parts } => {
                        tracing::info!(cloud = %settings.cloud, "the cloud asked what this agent holds");
                        for part in session::inventory(&store.held()?, parts) {
                            send(&tx, agent_message::Kind::Inventory(part)).await?;
                        }
                    }
                    Step::Nothing => {}
                }
            }
            _ = store.outbox_grew() => {}
            _ = heartbeat.tick() => {
                settings.liveness.alive();
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

/// Sends outbox entries not sent yet in this session, in batches, as long
/// as each flow's window has room, reports first; events dropped at the
/// bound since the last call go up as an entry of their own.
async fn send_outbox(
    store: &Store,
    tx: &mpsc::Sender<proto::AgentMessage>,
    core: &mut Session,
) -> Result<(), SyncError> {
    if let Some(seq) = store.seal_dropped().await? {
        tracing::warn!(
            seq,
            "events were dropped at the outbox bound; telling the cloud"
        );
    }
    for flow in proto::Flow::ALL {
        loop {
            let (after, room) = core.next_batch(flow, UPLINK_BATCH);
            if room == 0 {
                break;
            }
            let batch = store.pending(flow, after, room)?;
            if batch.is_empty() {
                break;
            }
            let uplink = core.uplink(batch);
            send(tx, agent_message::Kind::Uplink(uplink)).await?;
        }
    }
    Ok(())
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
pub(crate) mod tests {
    use super::*;

    pub(crate) fn settings(cloud: &str) -> SyncSettings {
        SyncSettings {
            cloud: cloud.into(),
            tls: Some(CloudTls {
                ca_file: "ca.crt".into(),
                server_name: None,
                client_certificate: None,
            }),
            token_file: None,
            node: "edge-1".into(),
            agent_version: "test".into(),
            boot_id: "boot".into(),
            heartbeat: Heartbeat::default(),
            silent_cloud: Counter::default(),
            refused_redirects: Counter::default(),
            bytes: MessageBytes::default(),
            liveness: Check::default(),
        }
    }
}
