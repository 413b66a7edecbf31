//! Wiring: the Device reflector feeds the index and the status writer, and
//! the sync server serves agents once the first list is in.

use std::net::SocketAddr;
use std::num::NonZeroU32;
use std::sync::Arc;

use edgefleet_shared::ResourceKey;
use edgefleet_shared::api::Device;
use edgefleet_shared::proto::sync_server::SyncServer;
use futures::StreamExt;
use kube::runtime::reflector;
use kube::runtime::{WatchStreamExt, watcher};
use kube::{Api, Client, ResourceExt};
use tokio::net::TcpListener;
use tokio::task::JoinSet;

use crate::index::Index;
use crate::status::{StatusMetrics, StatusWriter};
use crate::sync::{SyncMetrics, SyncService};

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
        let index = Arc::new(Index::default());
        let (devices, writer) = reflector::store::<Device>();
        let status = StatusWriter::new(
            client.clone(),
            devices.clone(),
            settings.status_writes_per_second,
            settings.status_metrics,
        );
        let mut tasks = JoinSet::new();

        tasks.spawn(feed_index(
            client.clone(),
            writer,
            Arc::clone(&index),
            status.clone(),
        ));
        tasks.spawn(status.clone().run());
        devices.wait_until_ready().await?;

        let sync_addr = settings.sync_listener.local_addr()?;
        let sync_metrics = settings.sync_metrics;
        let service = SyncService::new(client, index, status.clone(), Arc::clone(&sync_metrics));
        let incoming = tonic::transport::server::TcpIncoming::from(settings.sync_listener);
        tasks.spawn(async move {
            let served = tonic::transport::Server::builder()
                .http2_keepalive_interval(Some(std::time::Duration::from_secs(20)))
                .add_service(SyncServer::new(service))
                .serve_with_incoming(incoming)
                .await;
            if let Err(error) = served {
                tracing::error!(%error, "sync server stopped");
            }
        });
        tracing::info!(%sync_addr, "sync server listening");
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

/// Keeps the index equal to the Devices in the API server.
async fn feed_index(
    client: Client,
    writer: reflector::store::Writer<Device>,
    index: Arc<Index>,
    status: StatusWriter,
) {
    let mut relist = Vec::new();
    let events = watcher(Api::<Device>::all(client), watcher::Config::default())
        .default_backoff()
        .reflect(writer);
    futures::pin_mut!(events);
    while let Some(event) = events.next().await {
        match event {
            Ok(watcher::Event::Apply(device)) => index.upsert(&device),
            Ok(watcher::Event::Delete(device)) => {
                let key =
                    ResourceKey::device(device.namespace().unwrap_or_default(), device.name_any());
                index.remove(&key);
                status.forget(&key);
            }
            Ok(watcher::Event::Init) => relist.clear(),
            Ok(watcher::Event::InitApply(device)) => relist.push(device),
            Ok(watcher::Event::InitDone) => {
                index.replace_all(&relist);
                relist.clear();
            }
            Err(error) => tracing::warn!(%error, "Device watch failed; retrying"),
        }
    }
}
