//! `edgefleet-auth-bench` (`make bench-auth`): what TLS and node identity
//! cost on the sync link. The controller runs as a process against the
//! local API server, once with TLS and token reviews and once in plaintext
//! believing Hellos (the baseline, same run). It prints (and asserts
//! nothing; see docs/benchmarks.md):
//!
//! - connection setup: sequential TLS handshakes against sequential TCP
//!   connects to the same controller;
//! - a reconnect storm: `--agents` hollow agents (real gRPC connections,
//!   each with the token of a pod on its own node) connect at once; the
//!   time until every one is served (its first message from the cloud),
//!   TokenReviews made, and the controller's memory per connected agent;
//!   then all reconnect again within the review cache's life;
//! - bulk delivery: one node with `--devices` Devices, from the stream's
//!   opening to the last Update received.

use std::net::SocketAddr;
use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::time::{Duration, Instant};

use anyhow::Context;
use clap::Parser;
use edgefleet_shared::api::{Device, DeviceSpec, Transport};
use edgefleet_shared::proto;
use edgefleet_tests::agent_tokens::{self, AgentPod};
use edgefleet_tests::bench::{Report, quantiles};
use edgefleet_tests::certs::{self, LabCa};
use edgefleet_tests::control_plane;
use edgefleet_tests::process::{Process, free_tcp_addr, http_get, metric};
use edgefleet_tests::stack::ensure_namespace;
use futures::{StreamExt, TryStreamExt};
use kube::api::PostParams;
use kube::{Api, Client};

#[derive(Debug, Parser)]
#[command(
    name = "edgefleet-auth-bench",
    about = "Measure what TLS and node identity cost"
)]
struct Cli {
    /// Hollow agents in the reconnect storm.
    #[arg(long, default_value_t = 1000)]
    agents: usize,
    /// Sequential connections timed for setup cost.
    #[arg(long, default_value_t = 500)]
    handshakes: usize,
    /// Devices on the node of the bulk delivery.
    #[arg(long, default_value_t = 2000)]
    devices: usize,
    /// Where logs and results go.
    #[arg(long, default_value = "/tmp/edgefleet-auth-bench")]
    dir: PathBuf,
}

const NAMESPACE: &str = "auth-bench";
const BULK_NODE: &str = "bulk-node";

/// One way to run the controller.
#[derive(Clone, Copy, Debug, PartialEq)]
enum Mode {
    Tls,
    Plaintext,
}

struct Cloud {
    process: Process,
    sync: SocketAddr,
    metrics: SocketAddr,
    mode: Mode,
}

impl Cloud {
    async fn start(
        mode: Mode,
        lab: &LabCa,
        dir: &Path,
        kubeconfig: &Path,
    ) -> anyhow::Result<Cloud> {
        let (sync, metrics) = (free_tcp_addr(), free_tcp_addr());
        let mut args = vec![
            "run".into(),
            format!("--sync-addr={sync}"),
            format!("--metrics-addr={metrics}"),
            format!("--namespace={NAMESPACE}"),
            // Every hollow agent comes from 127.0.0.1.
            "--max-per-address=100000".into(),
        ];
        match mode {
            Mode::Tls => {
                args.extend(certs::cloud_args(lab));
                args.extend(agent_tokens::cloud_args(NAMESPACE));
            }
            Mode::Plaintext => {
                args.push("--insecure-plaintext".into());
                args.push("--insecure-unauthenticated-agents".into());
            }
        }
        let log = dir.join(format!("cloud-{mode:?}.log"));
        let env = [("KUBECONFIG", kubeconfig.display().to_string())];
        let process = Process::start_logged("edgefleet-cloud", &args, &env, Some(&log))?;
        let deadline = Instant::now() + Duration::from_secs(120);
        while !matches!(http_get(metrics, "/readyz").await, Ok((200, _))) {
            anyhow::ensure!(Instant::now() < deadline, "the controller is not ready");
            tokio::time::sleep(Duration::from_millis(100)).await;
        }
        Ok(Cloud {
            process,
            sync,
            metrics,
            mode,
        })
    }

    async fn metric(&self, sample: &str) -> f64 {
        let (_, body) = http_get(self.metrics, "/metrics").await.unwrap_or_default();
        metric(&body, sample)
    }

    async fn reviews(&self) -> f64 {
        self.metric("edgefleet_cloud_sync_token_reviews_total")
            .await
    }

    fn rss_mib(&self) -> f64 {
        self.process.rss_bytes().unwrap_or(0) as f64 / 1048576.0
    }

    /// A channel of its own (one connection) to the sync server.
    async fn channel(&self, lab: &LabCa) -> anyhow::Result<tonic::transport::Channel> {
        let endpoint = match self.mode {
            Mode::Tls => tonic::transport::Endpoint::from_shared(format!("https://{}", self.sync))?
                .tls_config(tonic::transport::ClientTlsConfig::new().ca_certificate(
                    tonic::transport::Certificate::from_pem(std::fs::read(lab.ca_file())?),
                ))?,
            Mode::Plaintext => {
                tonic::transport::Endpoint::from_shared(format!("http://{}", self.sync))?
            }
        };
        Ok(endpoint
            .connect_timeout(Duration::from_secs(60))
            .connect()
            .await?)
    }
}

/// A hollow agent's session: the stream open, with whatever the cloud sends.
struct Hollow {
    tx: tokio::sync::mpsc::Sender<proto::AgentMessage>,
    inbound: tonic::Streaming<proto::CloudMessage>,
}

/// Opens a session for `node` with `token` and waits for the cloud's first
/// message. The Hello's digest matches nothing, so the cloud answers at
/// once (it asks for the list).
async fn open(cloud: &Cloud, lab: &LabCa, node: &str, token: &str) -> anyhow::Result<Hollow> {
    let channel = cloud.channel(lab).await?;
    let mut client = proto::sync_client::SyncClient::new(channel)
        .max_decoding_message_size(proto::MAX_MESSAGE_BYTES);
    let hello = proto::Hello {
        node: node.to_owned(),
        agent_version: "hollow".into(),
        boot_id: "b".into(),
        store_id: format!("store-{node}"),
        held_digest: vec![0xab; 16],
        held_count: 1,
        uplink_flows: true,
        ..Default::default()
    };
    let (tx, rx) = tokio::sync::mpsc::channel(4);
    tx.send(proto::AgentMessage {
        kind: Some(proto::agent_message::Kind::Hello(hello)),
    })
    .await?;
    let mut request = tonic::Request::new(tokio_stream::wrappers::ReceiverStream::new(rx));
    if cloud.mode == Mode::Tls {
        request
            .metadata_mut()
            .insert("authorization", format!("Bearer {token}").parse()?);
    }
    let mut inbound = client.stream(request).await?.into_inner();
    let first = inbound
        .message()
        .await?
        .context("the stream ended at once")?;
    anyhow::ensure!(
        matches!(
            first.kind,
            Some(proto::cloud_message::Kind::InventoryRequest(_))
        ),
        "the cloud's first message is {first:?}, not an InventoryRequest"
    );
    Ok(Hollow { tx, inbound })
}

/// Sequential TCP connects and (with TLS) TLS handshakes.
async fn setup_cost(cloud: &Cloud, lab: &LabCa, n: usize, out: &mut Report) -> anyhow::Result<()> {
    let mut tcp = Vec::with_capacity(n);
    for _ in 0..n {
        let started = Instant::now();
        let stream = tokio::net::TcpStream::connect(cloud.sync).await?;
        tcp.push(started.elapsed());
        drop(stream);
    }
    out.line(&format!(
        "  TCP connect:              {}",
        quantiles(&mut tcp)
    ));
    if cloud.mode != Mode::Tls {
        return Ok(());
    }
    let mut roots = rustls::RootCertStore::empty();
    for cert in
        <rustls::pki_types::CertificateDer<'_> as rustls::pki_types::pem::PemObject>::pem_file_iter(
            lab.ca_file(),
        )?
    {
        roots.add(cert?)?;
    }
    let mut config = rustls::ClientConfig::builder_with_provider(Arc::new(
        rustls::crypto::ring::default_provider(),
    ))
    .with_safe_default_protocol_versions()?
    .with_root_certificates(roots)
    .with_no_client_auth();
    config.alpn_protocols = vec![b"h2".to_vec()];
    let connector = tokio_rustls::TlsConnector::from(Arc::new(config));
    let mut tls = Vec::with_capacity(n);
    for _ in 0..n {
        let started = Instant::now();
        let stream = tokio::net::TcpStream::connect(cloud.sync).await?;
        let name = rustls::pki_types::ServerName::try_from("127.0.0.1")?;
        let session = connector.connect(name, stream).await?;
        tls.push(started.elapsed());
        drop(session);
    }
    out.line(&format!(
        "  TCP connect + TLS 1.3:    {}",
        quantiles(&mut tls)
    ));
    Ok(())
}

/// Waits 200 ms, doubling with each attempt up to 3.2 s.
async fn retry_delay(attempt: u32, error: &anyhow::Error) {
    if attempt == 1 {
        eprintln!("retrying after: {error:#}");
    }
    let delay = Duration::from_millis(200) * 2u32.pow(attempt.min(5) - 1);
    tokio::time::sleep(delay).await;
}

/// Every agent connects at once; returns their sessions.
async fn storm(
    cloud: &Cloud,
    lab: &LabCa,
    pods: &[(String, AgentPod)],
    what: &str,
    out: &mut Report,
) -> anyhow::Result<Vec<Hollow>> {
    let reviews = cloud.reviews().await;
    let rss = cloud.rss_mib();
    let started = Instant::now();
    let retries = std::sync::atomic::AtomicUsize::new(0);
    let retries = &retries;
    let results: Vec<(Duration, Hollow)> = futures::stream::iter(pods)
        .map(|(node, pod)| async move {
            // As an agent does: try again after a while (a connection the
            // kernel dropped in the rush, a review refused as busy).
            let mut attempts = 0;
            loop {
                match open(cloud, lab, node, &pod.token).await {
                    Ok(hollow) => return anyhow::Ok((started.elapsed(), hollow)),
                    Err(error) if attempts < 20 => {
                        attempts += 1;
                        retries.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
                        retry_delay(attempts, &error).await;
                    }
                    Err(error) => return Err(error),
                }
            }
        })
        .buffer_unordered(pods.len())
        .try_collect()
        .await?;
    let took = started.elapsed();
    let retries = retries.load(std::sync::atomic::Ordering::Relaxed);
    let (mut served, sessions): (Vec<Duration>, Vec<Hollow>) = results.into_iter().unzip();
    tokio::time::sleep(Duration::from_secs(1)).await;
    let rss_after = cloud.rss_mib();
    out.line(&format!(
        "  {what}: {} agents served in {took:.2?} ({retries} attempts retried); each served after {}",
        sessions.len(),
        quantiles(&mut served)
    ));
    out.line(&format!(
        "    TokenReviews: {}; controller RSS {rss:.1} → {rss_after:.1} MiB ({:.1} KiB per agent)",
        cloud.reviews().await - reviews,
        (rss_after - rss) * 1024.0 / sessions.len() as f64
    ));
    Ok(sessions)
}

/// From the stream's opening to the last of `devices` resources received.
async fn bulk(
    cloud: &Cloud,
    lab: &LabCa,
    pod: &AgentPod,
    devices: usize,
    out: &mut Report,
) -> anyhow::Result<()> {
    let started = Instant::now();
    let mut hollow = open(cloud, lab, BULK_NODE, &pod.token).await?;
    // It asked for the list: nothing is held.
    let inventory = proto::agent_message::Kind::Inventory(proto::Inventory::default());
    hollow
        .tx
        .send(proto::AgentMessage {
            kind: Some(inventory),
        })
        .await?;
    let (mut received, mut bytes, mut updates) = (0, 0, 0);
    while received < devices {
        let message = hollow
            .inbound
            .message()
            .await?
            .context("the stream ended")?;
        if let Some(proto::cloud_message::Kind::Update(update)) = &message.kind {
            received += update.upserts.len();
            updates += 1;
            bytes += prost::Message::encoded_len(&message);
        }
    }
    let took = started.elapsed();
    out.line(&format!(
        "  bulk delivery: {received} Devices in {updates} Updates ({:.1} KiB) in {took:.2?}: {:.0} Devices/s",
        bytes as f64 / 1024.0,
        received as f64 / took.as_secs_f64()
    ));
    Ok(())
}

async fn create_bulk_devices(client: &Client, devices: usize) -> anyhow::Result<()> {
    let api: Api<Device> = Api::namespaced(client.clone(), NAMESPACE);
    futures::stream::iter(0..devices)
        .map(|i| {
            let api = api.clone();
            async move {
                let spec = DeviceSpec {
                    node: BULK_NODE.into(),
                    model: "thermostat".into(),
                    transport: Transport::Coap,
                    desired: [(
                        "setpoint".to_owned(),
                        edgefleet_shared::PropertyValue::Float(20.0),
                    )]
                    .into(),
                    firmware: None,
                    retry: 0,
                };
                let device = Device::new(&format!("bulk-{i:05}"), spec);
                match api.create(&PostParams::default(), &device).await {
                    Ok(_) => Ok(()),
                    Err(kube::Error::Api(status)) if status.code == 409 => Ok(()),
                    Err(e) => Err(anyhow::Error::from(e)),
                }
            }
        })
        .buffer_unordered(16)
        .try_collect::<Vec<()>>()
        .await?;
    Ok(())
}

#[tokio::main]
async fn main() -> anyhow::Result<()> {
    let cli = Cli::parse();
    std::fs::create_dir_all(&cli.dir)?;
    let mut out = Report::default();
    out.line(&format!(
        "edgefleet-auth-bench: {} hollow agents, {} sequential connections, {} Devices in bulk, {} CPUs",
        cli.agents,
        cli.handshakes,
        cli.devices,
        std::thread::available_parallelism().map_or(0, |n| n.get())
    ));
    let cp = control_plane();
    let client = cp.client().await;
    ensure_namespace(&client, NAMESPACE).await?;
    let lab = certs::lab(&cli.dir.join("tls"))?;

    let started = Instant::now();
    let pods: Vec<(String, AgentPod)> = futures::stream::iter(0..cli.agents)
        .map(|i| {
            let client = client.clone();
            async move {
                let node = format!("hollow-{i:05}");
                let pod = AgentPod::on(&client, NAMESPACE, &node).await?;
                anyhow::Ok((node, pod))
            }
        })
        .buffer_unordered(16)
        .try_collect()
        .await?;
    let bulk_pod = AgentPod::on(&client, NAMESPACE, BULK_NODE).await?;
    create_bulk_devices(&client, cli.devices).await?;
    out.line(&format!(
        "setup: {} pods with tokens and {} Devices in {:.1?}",
        pods.len() + 1,
        cli.devices,
        started.elapsed()
    ));

    for mode in [Mode::Plaintext, Mode::Tls] {
        let cloud = Cloud::start(mode, &lab, &cli.dir, cp.kubeconfig()).await?;
        out.line(&format!(
            "{}:",
            match mode {
                Mode::Tls => "TLS, tokens reviewed",
                Mode::Plaintext => "baseline: plaintext, Hellos believed",
            }
        ));
        setup_cost(&cloud, &lab, cli.handshakes, &mut out).await?;
        let sessions = storm(&cloud, &lab, &pods, "storm", &mut out).await?;
        drop(sessions);
        let sessions = storm(&cloud, &lab, &pods, "again at once", &mut out).await?;
        drop(sessions);
        bulk(&cloud, &lab, &bulk_pod, cli.devices, &mut out).await?;
        let mut process = cloud.process;
        process.stop(Duration::from_secs(10));
    }
    std::fs::write(cli.dir.join("results.txt"), &out.text)?;
    Ok(())
}
