//! Wiring: the Device reflector feeds the index and the status writer, the
//! Device reconciler runs beside it, and the sync server serves agents once
//! the first list is in.

use std::net::SocketAddr;
use std::num::NonZeroU32;
use std::sync::Arc;

use edgefleet_shared::ResourceKey;
use edgefleet_shared::api::rollout::FleetRollout;
use edgefleet_shared::api::rule::EdgeRule;
use edgefleet_shared::api::{Device, EdgeNode};
use edgefleet_shared::heartbeat::Heartbeat;
use edgefleet_shared::proto::sync_server::SyncServer;
use futures::{Stream, StreamExt};
use k8s_openapi::api::core::v1::Secret;
use kube::runtime::reflector;
use kube::runtime::utils::ResetTimerBackoff;
use kube::runtime::{WatchStreamExt, watcher};
use kube::{Api, Client, ResourceExt};
use tokio::net::TcpListener;
use tokio::task::JoinSet;

use crate::agents::Agents;
use crate::credentials::Credentials;
use crate::device_events::{DeviceEventMetrics, DeviceEvents};
use crate::events::{EventMetrics, Events};
use crate::index::Index;
use crate::leases::{Fence, LeaseMetrics, LeaseSettings};
use crate::reconcile::{self, Context};
use crate::shards::{Shards, shard_of};
use crate::status::{StatusMetrics, StatusWriter};
use crate::sync::admission::Admission;
use crate::sync::{SyncMetrics, SyncParts, SyncService};

/// What the controller needs to start.
#[derive(Debug)]
pub struct Settings {
    /// Where agents connect.
    pub sync_listener: TcpListener,
    /// The status write budget.
    pub status_writes_per_second: NonZeroU32,
    /// The status writer's counters.
    pub status_metrics: StatusMetrics,
    /// The sync server's counters.
    pub sync_metrics: Arc<SyncMetrics>,
    /// Counters of published Events.
    pub event_metrics: EventMetrics,
    /// The budget of Events created for device events.
    pub device_events_per_second: NonZeroU32,
    /// Counters of device events.
    pub device_event_metrics: DeviceEventMetrics,
    /// Device key Secrets taken in, by what became of them (`taken`,
    /// `refused`, `unlabelled`, `ambiguous`).
    pub device_key_metrics: edgefleet_shared::telemetry::Outcomes,
    /// Who publishes Events (the pod or host name), shown in them.
    pub instance: Option<String>,
    /// Serve only the Devices of this namespace (all namespaces if `None`).
    pub namespace: Option<String>,
    /// How long a node may be without an agent before it and its Devices
    /// are marked unreachable.
    pub node_grace_period: std::time::Duration,
    /// Heartbeats on the sync streams: how often they go out, and (3 of
    /// them) how long an agent may be silent before its session ends.
    pub heartbeat: Heartbeat,
    /// TLS on the sync link; `None` serves plaintext (local demos only).
    pub tls: Option<crate::tls::TlsSettings>,
    /// How agents prove their node.
    pub agent_auth: crate::agent_identity::AuthSettings,
    /// Bounds on connections and streams.
    pub limits: crate::sync::admission::Limits,
    /// How often a running session's token is reviewed again.
    pub token_recheck: std::time::Duration,
    /// The CA that signs agents' client certificates (signer
    /// `edgefleet.io/agent`); without it, nothing answers those requests.
    pub agent_ca: Option<crate::agent_certs::AgentCa>,
    /// Share the fleet with other replicas through shard Leases; `None`:
    /// this replica is the only one and serves every node.
    pub replicas: Option<Replicas>,
    /// Counters of the shard Leases.
    pub lease_metrics: LeaseMetrics,
}

/// How replicas share the fleet.
#[derive(Debug, Clone)]
pub struct Replicas {
    /// Where the Leases are, who this replica is, where it serves agents.
    pub leases: LeaseSettings,
    /// How many shards the fleet is cut into (the same on every replica).
    pub shards: u32,
}

/// A running controller.
#[derive(Debug)]
pub struct Controller {
    /// Where agents connect.
    pub sync_addr: SocketAddr,
    /// The status writer, for its counters.
    pub status: StatusWriter,
    /// The sync server's counters.
    pub sync_metrics: Arc<SyncMetrics>,
    tasks: JoinSet<()>,
}

impl Controller {
    /// Starts the controller's tasks; returns once the Device reflector has
    /// listed every Device and the sync server accepts agents. An agent that
    /// connected earlier would be told to drop what it holds.
    pub async fn start(client: Client, settings: Settings) -> anyhow::Result<Controller> {
        let devices_api = match &settings.namespace {
            Some(namespace) => Api::<Device>::namespaced(client.clone(), namespace),
            None => Api::<Device>::all(client.clone()),
        };
        let index = Arc::new(Index::default());
        let agents = Arc::new(Agents::default());
        let shards = Arc::new(match &settings.replicas {
            Some(replicas) => Shards::shared(replicas.shards),
            None => Shards::single(),
        });
        let fence = Fence::new(client.clone(), Arc::clone(&shards));
        let events = Events::new(client.clone(), settings.instance, settings.event_metrics);
        // The one Device cache: the index, the status writer, the rollout
        // and rule reconcilers read it, and the Device reconciler is fed
        // from it (no second watch, no second copy).
        let (devices, writer) = reflector::store_shared::<Device>(RECONCILE_QUEUE);
        let reconcile_changes = writer.subscribe().expect("a shared store");
        let status = StatusWriter::new(
            fence.clone(),
            devices.clone(),
            settings.status_writes_per_second,
            settings.status_metrics,
            events.clone(),
        );
        status.judge_reachability_by(Arc::clone(&agents));
        let mut tasks = JoinSet::new();
        if let Some(replicas) = settings.replicas {
            let writer = status.clone();
            let count = shards.count();
            let agents = Arc::clone(&agents);
            tasks.spawn(crate::leases::keep(
                client.clone(),
                replicas.leases,
                Arc::clone(&shards),
                settings.lease_metrics,
                move |shard| {
                    let ours = |node: &str| shard_of(node, count) == shard;
                    // Another replica may have written the shard's Devices,
                    // and served its agents since this one last did.
                    writer.forget_nodes(ours);
                    agents.forget_absence(ours);
                },
            ));
        }

        let (edge_nodes, edge_node_writer) = reflector::store::<EdgeNode>();
        let edge_node_events = watcher(
            Api::<EdgeNode>::all(client.clone()),
            watcher::Config::default(),
        )
        .backoff(watch_backoff())
        .reflect(edge_node_writer);
        tasks.spawn(edge_node_events.for_each(|event| async move {
            if let Err(error) = event {
                tracing::warn!(%error, "EdgeNode watch failed; retrying");
            }
        }));

        let (device_changed, device_changes) = tokio::sync::watch::channel(());
        let (indexed, mut index_ready) = tokio::sync::watch::channel(false);
        let credentials = Arc::new(
            crate::credentials::Credentials::new(Arc::clone(&index))
                .with_events(events.clone(), settings.device_key_metrics.clone()),
        );
        tasks.spawn(feed_index(
            devices_api.clone(),
            writer,
            Arc::clone(&index),
            Arc::clone(&credentials),
            status.clone(),
            device_changed,
            indexed,
        ));
        tasks.spawn(status.clone().run());
        devices.wait_until_ready().await?;
        edge_nodes.wait_until_ready().await?;
        let liveness = crate::liveness::Liveness {
            fence: fence.clone(),
            edge_nodes: edge_nodes.clone(),
            agents: Arc::clone(&agents),
            index: Arc::clone(&index),
            status: status.clone(),
            grace: settings.node_grace_period,
        };
        tasks.spawn(liveness.run());
        let rollouts = crate::rollout::Context::new(
            fence.clone(),
            devices.clone(),
            edge_nodes.clone(),
            Arc::clone(&agents),
            status.clone(),
            events.clone(),
        );
        let rollouts_api = match &settings.namespace {
            Some(namespace) => Api::<FleetRollout>::namespaced(client.clone(), namespace),
            None => Api::<FleetRollout>::all(client.clone()),
        };
        let rules = crate::rules::Context::new(
            fence.clone(),
            devices.clone(),
            edge_nodes.clone(),
            status.clone(),
            events.clone(),
            Arc::clone(&index),
        );
        let rules_api = match &settings.namespace {
            Some(namespace) => Api::<EdgeRule>::namespaced(client.clone(), namespace),
            None => Api::<EdgeRule>::all(client.clone()),
        };
        // Before the sync server starts: an agent is never told to drop
        // its rules because the controller had not read them yet.
        let rules = crate::rules::start(
            rules_api,
            Arc::new(rules),
            throttled(device_changes.clone(), RULES_TRIGGER_PERIOD),
        )
        .await?;
        tasks.spawn(rules);
        // Likewise for device keys: an agent is never told to drop one
        // because the controller had not read its Secret yet.
        let secrets_api = match &settings.namespace {
            Some(namespace) => Api::<Secret>::namespaced(client.clone(), namespace),
            None => Api::<Secret>::all(client.clone()),
        };
        let credentials = crate::credentials::start(
            secrets_api,
            credentials,
            crate::credentials::FIRST_LIST_PATIENCE,
        )
        .await?;
        tasks.spawn(credentials);
        tasks.spawn(crate::rollout::run(
            rollouts_api,
            Arc::new(rollouts),
            throttled(device_changes, ROLLOUT_TRIGGER_PERIOD),
        ));
        let context = Context::new(
            fence.clone(),
            status.clone(),
            events.clone(),
            Arc::clone(&agents),
            edge_nodes,
        );
        tasks.spawn(reconcile::run(
            Arc::new(context),
            reconcile_changes,
            devices.clone(),
        ));

        // The store is ready a moment before the index holds what it
        // listed (the reflector first hands the list to the reconciler,
        // started above); a Hello judged against a partial index would ask
        // the agent for its whole inventory.
        index_ready.wait_for(|ready| *ready).await?;
        let sync_addr = settings.sync_listener.local_addr()?;
        let sync_metrics = settings.sync_metrics;
        let agent_ca_pem = settings
            .agent_ca
            .as_ref()
            .map(|ca| ca.certificate_pem.clone());
        match settings.agent_ca {
            Some(ca) => {
                let (ca, outcomes) = (Arc::new(ca), sync_metrics.agent_certificates.clone());
                let client = fence.leader();
                tasks.spawn(crate::leases::while_leading(fence.clone(), move || {
                    crate::agent_certs::run(client.clone(), Arc::clone(&ca), outcomes.clone())
                }));
            }
            None => tracing::info!(
                signer = crate::agent_certs::SIGNER,
                "no --agent-ca-dir: agents' certificate requests are left unanswered"
            ),
        }
        let device_events = DeviceEvents::new(
            client.clone(),
            settings.device_events_per_second,
            settings.device_event_metrics,
        );
        let beat = settings.heartbeat;
        if settings.agent_auth == crate::agent_identity::AuthSettings::TrustHello {
            tracing::warn!(
                "agents are NOT AUTHENTICATED: the node a Hello names is believed, so anyone who reaches the sync port can speak for any node; for local demos only"
            );
        }
        let auth = crate::agent_identity::AgentAuth::new(
            &settings.agent_auth,
            client.clone(),
            sync_metrics.token_reviews.clone(),
        );
        let admission = Admission::new(settings.limits, sync_metrics.connections.clone());
        let service = SyncService::new(SyncParts {
            auth,
            admission: Arc::clone(&admission),
            client,
            fence,
            index,
            devices,
            status: status.clone(),
            agents,
            events,
            device_events,
            metrics: Arc::clone(&sync_metrics),
        })
        .with_heartbeat(beat)
        .with_token_recheck(settings.token_recheck);
        // Dead connections close below the heartbeat rule too: HTTP/2 PINGs
        // and TCP keepalive (set on the incoming connections: tonic ignores
        // the builder's TCP settings with serve_with_incoming).
        let incoming = tonic::transport::server::TcpIncoming::from(settings.sync_listener)
            .with_nodelay(Some(true))
            .with_keepalive(Some(beat.tcp_keepalive()))
            .with_keepalive_interval(Some(beat.interval));
        // What a connection may make the server hold before any of it is
        // authenticated: 4 streams (an agent needs one), 16 KiB of headers
        // (a token is about 1 KiB), 256 KiB of unread data per stream and
        // 1 MiB per connection.
        let server = tonic::transport::Server::builder()
            .http2_keepalive_interval(Some(beat.keepalive_interval()))
            .http2_keepalive_timeout(Some(beat.keepalive_timeout()))
            .max_concurrent_streams(4)
            .http2_max_header_list_size(16 * 1024)
            .initial_stream_window_size(256 * 1024)
            .initial_connection_window_size(1024 * 1024)
            .add_service(
                SyncServer::new(service)
                    .max_decoding_message_size(edgefleet_shared::proto::MAX_MESSAGE_BYTES)
                    .max_encoding_message_size(edgefleet_shared::proto::MAX_MESSAGE_BYTES),
            );
        let connections = sync_metrics.connections.clone();
        let incoming = incoming.filter_map(move |accepted| {
            let admitted = match accepted {
                Ok(stream) => admission.admit(stream),
                Err(error) => {
                    tracing::debug!(%error, "accepting a sync connection failed");
                    None
                }
            };
            std::future::ready(admitted)
        });
        match &settings.tls {
            Some(tls) => {
                let certificate = crate::tls::Certificate::load(&tls.dir)?;
                let config = certificate.server_config(agent_ca_pem.as_deref())?;
                tasks.spawn(
                    Arc::clone(&certificate)
                        .keep_reloading(tls.reload_every, sync_metrics.tls_reloads.clone()),
                );
                let acceptor = tokio_rustls::TlsAcceptor::from(Arc::new(config));
                let incoming = crate::tls::accept(incoming, acceptor, connections);
                tasks.spawn(serve(server, incoming));
                tracing::info!(%sync_addr, cert = %tls.dir.display(), "sync server listening (TLS)");
            }
            None => {
                let incoming = incoming.map(move |stream| {
                    connections.inc("plaintext");
                    Ok::<_, std::io::Error>(stream)
                });
                tasks.spawn(serve(server, incoming));
                tracing::warn!(%sync_addr, "sync server listening in PLAINTEXT: anyone on the network can read and forge the sync link; for local demos only");
            }
        }
        Ok(Controller {
            sync_addr,
            status,
            sync_metrics,
            tasks,
        })
    }

    /// Waits until a task ends, which only happens on a fatal error.
    pub async fn wait(mut self) -> anyhow::Result<()> {
        self.tasks.join_next().await;
        anyhow::bail!("a controller task ended")
    }
}

/// How the controller's watches retry: kube-runtime's default backs off to
/// 30 s, so after an API server outage the controller could notice spec
/// changes half a minute late. These watches feed every agent, so they
/// retry within 5 s (one list and watch per retry is cheap for the API
/// server next to that delay).
/// Serves the sync service over the connections of `incoming` (TLS or
/// plaintext) until the process ends.
async fn serve<I, IO, IE>(server: tonic::transport::server::Router, incoming: I)
where
    I: Stream<Item = Result<IO, IE>> + Send + 'static,
    IO: tokio::io::AsyncRead
        + tokio::io::AsyncWrite
        + tonic::transport::server::Connected
        + Unpin
        + Send
        + 'static,
    IE: Into<Box<dyn std::error::Error + Send + Sync>>,
{
    if let Err(error) = server.serve_with_incoming(incoming).await {
        tracing::error!(%error, "sync server stopped");
    }
}

pub(crate) fn watch_backoff() -> ResetTimerBackoff<watcher::ExponentialBackoff> {
    let retries = backon::ExponentialBuilder::default()
        .with_min_delay(std::time::Duration::from_millis(200))
        .with_max_delay(std::time::Duration::from_secs(5))
        .with_jitter()
        .without_max_times();
    ResetTimerBackoff::new(retries.into(), std::time::Duration::from_secs(60))
}

/// How many changed Devices the reflector hands the Device reconciler
/// before it waits for the reconciler to take them (the reconciler only
/// queues them, so it waits briefly, even for a relist of 100,000).
const RECONCILE_QUEUE: usize = 1024;

/// Rules count the Devices they watch again at most this often while
/// Devices change.
const RULES_TRIGGER_PERIOD: std::time::Duration = std::time::Duration::from_secs(5);

/// Rollouts look at their Devices again at most this often while Devices
/// change (and every [`crate::rollout::TICK`] while they move anyway).
pub const ROLLOUT_TRIGGER_PERIOD: std::time::Duration = std::time::Duration::from_millis(250);

/// Keeps the index equal to the Devices in the API server, tells
/// `changed` whenever a Device changes, and `indexed` once the first list
/// is in the index.
async fn feed_index(
    api: Api<Device>,
    writer: reflector::store::Writer<Device>,
    index: Arc<Index>,
    credentials: Arc<Credentials>,
    status: StatusWriter,
    changed: tokio::sync::watch::Sender<()>,
    indexed: tokio::sync::watch::Sender<bool>,
) {
    // At InitDone the store holds exactly what was listed (the reflector
    // swaps it in before it yields the event): read the list from there
    // rather than keep a second copy of every Device while it arrives.
    let listed = writer.as_reader();
    let events = watcher(api, watcher::Config::default())
        .backoff(watch_backoff())
        .modify(strip_unused)
        .reflect_shared(writer);
    futures::pin_mut!(events);
    while let Some(event) = events.next().await {
        if matches!(
            event,
            Ok(watcher::Event::Apply(_) | watcher::Event::Delete(_) | watcher::Event::InitDone)
        ) {
            changed.send_replace(());
        }
        match event {
            Ok(watcher::Event::Apply(device)) => {
                index.upsert(&device);
                credentials.device_applied(&device);
            }
            Ok(watcher::Event::Delete(device)) => {
                let key =
                    ResourceKey::device(device.namespace().unwrap_or_default(), device.name_any());
                index.remove(&key);
                credentials.device_deleted(&key);
                status.forget(&key);
            }
            Ok(watcher::Event::Init | watcher::Event::InitApply(_)) => {}
            Ok(watcher::Event::InitDone) => {
                let relist = listed.state();
                index.replace_all(relist.iter().map(|device| &**device));
                indexed.send_replace(true);
                credentials.devices_listed(relist.iter().map(|device| &**device));
                // What the writer remembers may be about objects deleted
                // while the watch was away: start from what was listed.
                status.forget_all();
            }
            Err(error) => tracing::warn!(%error, "Device watch failed; retrying"),
        }
    }
}

/// The annotation `kubectl apply` keeps a whole copy of the object in.
const LAST_APPLIED: &str = "kubectl.kubernetes.io/last-applied-configuration";

/// Drops what no part of the controller reads before a Device is cached:
/// `managedFields` (often larger than the Device itself) and the copy of
/// the object `kubectl apply` keeps in an annotation.
pub(crate) fn strip_unused(device: &mut Device) {
    device.metadata.managed_fields = None;
    if let Some(annotations) = device.metadata.annotations.as_mut() {
        annotations.remove(LAST_APPLIED);
    }
}

/// A stream that yields at most every `every` while `changes` move: the
/// trigger of the rollout and rule reconcilers, fed by the Device watch.
fn throttled(
    changes: tokio::sync::watch::Receiver<()>,
    every: std::time::Duration,
) -> impl futures::Stream<Item = ()> + Send + 'static {
    futures::stream::unfold(changes, move |mut changes| async move {
        changes.changed().await.ok()?;
        tokio::time::sleep(every).await;
        changes.borrow_and_update();
        Some(((), changes))
    })
}

#[cfg(test)]
mod tests {
    use super::*;
    use k8s_openapi::apimachinery::pkg::apis::meta::v1::ManagedFieldsEntry;

    #[test]
    fn the_cache_drops_managed_fields_and_the_applied_copy_only() {
        let mut device = crate::index::tests::device("ns", "a", "edge-1", "ua", 1);
        device.metadata.managed_fields = Some(vec![ManagedFieldsEntry {
            manager: Some("kubectl".into()),
            ..ManagedFieldsEntry::default()
        }]);
        device.metadata.annotations = Some(
            [
                (
                    LAST_APPLIED.to_owned(),
                    "{\"a whole\": \"copy\"}".to_owned(),
                ),
                ("team".to_owned(), "line-3".to_owned()),
            ]
            .into(),
        );
        let spec = device.spec.clone();
        strip_unused(&mut device);
        assert_eq!(device.metadata.managed_fields, None);
        assert_eq!(
            device.metadata.annotations,
            Some([("team".to_owned(), "line-3".to_owned())].into())
        );
        assert_eq!(device.spec, spec);
        assert_eq!(device.metadata.uid.as_deref(), Some("ua"));
    }
}
