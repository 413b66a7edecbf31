//! `edgefleet-cloud`: the cloud side of Edgefleet.

#![forbid(unsafe_code)]

use std::net::SocketAddr;
use std::num::NonZeroU32;

use anyhow::Context;
use clap::{Parser, Subcommand};
use edgefleet_cloud::agent_identity::AuthSettings;
use edgefleet_cloud::run::{Controller, Settings};
use edgefleet_cloud::sync::admission::Limits;
use edgefleet_shared::telemetry::{self, Readiness};
use prometheus_client::registry::Registry;

#[derive(Debug, Parser)]
#[command(
    name = "edgefleet-cloud",
    version,
    about = "Edgefleet cloud controller"
)]
struct Cli {
    #[command(subcommand)]
    command: Command,
}

#[derive(Debug, Subcommand)]
enum Command {
    /// Print Edgefleet's CustomResourceDefinitions, and the admission policy
    /// that completes their validation, as YAML
    /// (`edgefleet-cloud crds | kubectl apply --server-side -f -`).
    Crds,
    /// Run the controller: watch Devices, serve agents, write status.
    /// Uses $KUBECONFIG, ~/.kube/config or the in-cluster service account.
    Run(Box<RunArgs>),
    /// Write a lab CA and a sync certificate it issued (`ca.crt`,
    /// `tls.crt`, `tls.key`) into a directory, and print the kubectl
    /// commands that load them. For labs: production uses cert-manager.
    LabCerts(LabCertsArgs),
}

#[derive(Debug, clap::Args)]
struct LabCertsArgs {
    /// Where the files go.
    #[arg(long)]
    dir: std::path::PathBuf,
    /// The names the certificate carries (DNS names or IP addresses): the
    /// ones agents dial.
    #[arg(
        long = "name",
        default_values = ["edgefleet-cloud.edgefleet-system.svc", "localhost", "127.0.0.1"]
    )]
    names: Vec<String>,
}

#[derive(Debug, clap::Args)]
struct RunArgs {
    /// Where agents connect (gRPC).
    #[arg(long, env = "EDGEFLEET_SYNC_ADDR", default_value = "127.0.0.1:7443")]
    sync_addr: SocketAddr,
    /// Address of /metrics, /healthz and /readyz.
    #[arg(long, env = "EDGEFLEET_METRICS_ADDR", default_value = "127.0.0.1:9090")]
    metrics_addr: SocketAddr,
    /// The status write budget: most Device status writes per second.
    #[arg(long, env = "EDGEFLEET_STATUS_WRITES_PER_SECOND", default_value = "50")]
    status_writes_per_second: NonZeroU32,
    /// Most Kubernetes Events per second created for events devices raise
    /// (update results, faults). They are never dropped: beyond the budget
    /// they wait at the edge.
    #[arg(long, env = "EDGEFLEET_DEVICE_EVENTS_PER_SECOND", default_value = "50")]
    device_events_per_second: NonZeroU32,
    /// Who this replica is in the Events it publishes (in a cluster: the
    /// pod name, from the downward API).
    #[arg(long, env = "EDGEFLEET_INSTANCE")]
    instance: Option<String>,
    /// Serve only the Devices of this namespace (default: all namespaces).
    #[arg(long, env = "EDGEFLEET_NAMESPACE")]
    namespace: Option<String>,
    /// How long a node may be without an agent before it and its Devices
    /// are marked unreachable (seconds).
    #[arg(long, env = "EDGEFLEET_NODE_GRACE_SECONDS", default_value_t = 40)]
    node_grace_seconds: u64,
    /// Seconds between heartbeats on the sync streams; an agent silent for
    /// 3 of them has its session ended. Agents should use the same value
    /// (`--cloud-heartbeat-seconds`).
    #[arg(long, env = "EDGEFLEET_HEARTBEAT_SECONDS", default_value_t = 10.0)]
    heartbeat_seconds: f64,
    /// The directory of the sync server's certificate, in the layout
    /// cert-manager writes into a Secret (`tls.crt`, `tls.key`); read
    /// again when the files change.
    #[arg(long, env = "EDGEFLEET_TLS_DIR")]
    tls_dir: Option<std::path::PathBuf>,
    /// Serve the sync link without TLS: anyone on the network can read it
    /// and forge it. For local demos only.
    #[arg(long, env = "EDGEFLEET_INSECURE_PLAINTEXT", conflicts_with = "tls_dir")]
    insecure_plaintext: bool,
    /// The ServiceAccount (`<namespace>/<name>`) whose tokens agents
    /// present: the agents' DaemonSet runs as it. A token must be of it,
    /// for the audience `edgefleet` and bound to a pod on the node the
    /// agent names.
    #[arg(
        long,
        env = "EDGEFLEET_AGENT_SERVICE_ACCOUNT",
        default_value = "edgefleet-system/edgefleet-agent"
    )]
    agent_service_account: AuthSettings,
    /// The CA that signs client certificates for agents that are not pods
    /// (signer `edgefleet.io/agent`), as cert-manager writes a CA's Secret
    /// (`tls.crt`, `tls.key`). The controller then approves the requests
    /// of EdgeNodes an operator created with `spec.agentCredentials:
    /// ClientCertificate`, denies the others, and signs. Without it those
    /// requests wait.
    #[arg(long, env = "EDGEFLEET_AGENT_CA_DIR")]
    agent_ca_dir: Option<std::path::PathBuf>,
    /// Believe the node an agent names, with no token: anyone who reaches
    /// the sync port can speak for any node. For local demos only.
    #[arg(long, env = "EDGEFLEET_INSECURE_UNAUTHENTICATED_AGENTS")]
    insecure_unauthenticated_agents: bool,
    /// Most sync connections open at once, and most streams (one per
    /// agent); beyond, new ones are refused and counted.
    #[arg(long, env = "EDGEFLEET_MAX_CONNECTIONS", default_value_t = Limits::default().max_connections)]
    max_connections: usize,
    /// Most sync connections, and most streams, from one address. Agents
    /// of a site behind one NAT share its address: raise it for a site
    /// with more agents than this.
    #[arg(long, env = "EDGEFLEET_MAX_PER_ADDRESS", default_value_t = Limits::default().max_per_address)]
    max_per_address: usize,
    /// Share the fleet with other replicas: it is cut into this many
    /// shards by edge node, each held by one replica through a Lease
    /// (every replica must use the same number). Without it this replica
    /// serves every node alone.
    #[arg(long, env = "EDGEFLEET_SHARDS", value_parser = clap::value_parser!(u32).range(1..=1024), requires = "advertise_url")]
    shards: Option<u32>,
    /// The sync URL agents are sent to for the shards this replica holds
    /// (in a cluster: `https://<pod IP>:7443`; the agents keep checking the
    /// certificate against the name they were configured with).
    #[arg(long, env = "EDGEFLEET_ADVERTISE_URL")]
    advertise_url: Option<String>,
    /// This replica's name among the others (in a cluster: the pod name).
    /// Default: --instance, else the host name.
    #[arg(long, env = "EDGEFLEET_REPLICA_ID")]
    replica_id: Option<String>,
    /// The namespace of the shard Leases.
    #[arg(
        long,
        env = "EDGEFLEET_LEASE_NAMESPACE",
        default_value = "edgefleet-system"
    )]
    lease_namespace: String,
    /// The name the shard Leases start with: replicas of one controller
    /// share it.
    #[arg(long, env = "EDGEFLEET_LEASE_SET", default_value = "edgefleet")]
    lease_set: String,
    /// How long a shard Lease lasts unrenewed (seconds): after a replica
    /// dies or freezes its shards move within about this long, and it
    /// writes nothing after 90% of it.
    #[arg(long, env = "EDGEFLEET_LEASE_DURATION_SECONDS", default_value_t = 15, value_parser = clap::value_parser!(u64).range(2..=300))]
    lease_duration_seconds: u64,
}

fn main() -> anyhow::Result<()> {
    match Cli::parse().command {
        Command::Crds => print!("{}", edgefleet_cloud::crds::render()?),
        Command::Run(args) => tokio::runtime::Runtime::new()?.block_on(run(*args))?,
        Command::LabCerts(args) => {
            edgefleet_cloud::lab_ca::LabCa::new(&args.dir, &args.names)?;
            let dir = args.dir.display();
            println!(
                "# A lab CA and a sync certificate for {names} are in {dir}. Load them:\n\
                 kubectl -n edgefleet-system create secret generic edgefleet-sync-tls \\\n  \
                 --from-file={dir}/tls.crt --from-file={dir}/tls.key --from-file={dir}/ca.crt\n\
                 kubectl -n edgefleet-system create configmap edgefleet-sync-ca --from-file={dir}/ca.crt",
                names = args.names.join(", ")
            );
        }
    }
    Ok(())
}

async fn run(args: RunArgs) -> anyhow::Result<()> {
    telemetry::init_logging();
    if args.tls_dir.is_none() && !args.insecure_plaintext {
        anyhow::bail!(
            "the sync link needs a certificate: --tls-dir DIR (tls.crt and tls.key, as cert-manager writes them; `make certs` makes a lab one), or --insecure-plaintext for a local demo"
        );
    }
    if let Some(url) = &args.advertise_url {
        edgefleet_cloud::leases::check_advertise_url(url, args.tls_dir.is_some())
            .map_err(anyhow::Error::msg)?;
    }
    let agent_ca = args
        .agent_ca_dir
        .as_deref()
        .map(edgefleet_cloud::agent_certs::AgentCa::load)
        .transpose()
        .context("--agent-ca-dir: the CA that signs agents' certificates")?;
    let client = kube::Client::try_default()
        .await
        .context("no Kubernetes API: set KUBECONFIG or run in a cluster")?;
    let readiness = Readiness::default();
    let metrics_listener = tokio::net::TcpListener::bind(args.metrics_addr)
        .await
        .with_context(|| format!("bind metrics on {}", args.metrics_addr))?;
    let sync_listener = tokio::net::TcpListener::bind(args.sync_addr)
        .await
        .with_context(|| format!("bind the sync server on {}", args.sync_addr))?;

    // The operator endpoints answer (not ready) while the first list runs.
    let mut registry = Registry::with_prefix("edgefleet_cloud");
    let status_metrics = edgefleet_cloud::status::StatusMetrics::default();
    let sync_metrics = std::sync::Arc::new(edgefleet_cloud::sync::SyncMetrics::default());
    status_metrics.register(registry.sub_registry_with_prefix("status"));
    sync_metrics.register(registry.sub_registry_with_prefix("sync"));
    let event_metrics = edgefleet_cloud::events::EventMetrics::default();
    event_metrics.register(registry.sub_registry_with_prefix("events"));
    let device_event_metrics = edgefleet_cloud::device_events::DeviceEventMetrics::default();
    device_event_metrics.register(registry.sub_registry_with_prefix("device_events"));
    let device_key_metrics = telemetry::Outcomes::default();
    device_key_metrics.register(
        &mut registry,
        "device_keys",
        "Device key Secrets taken in, by outcome (taken, refused, unlabelled, ambiguous)",
    );
    let lease_metrics = edgefleet_cloud::leases::LeaseMetrics::default();
    lease_metrics.register(registry.sub_registry_with_prefix("leases"));
    let replicas = match args.shards {
        None => None,
        Some(shards) => {
            let replica = args
                .replica_id
                .clone()
                .or_else(|| args.instance.clone())
                .or_else(|| std::env::var("HOSTNAME").ok())
                .context("--shards needs --replica-id (or --instance, or $HOSTNAME)")?;
            Some(edgefleet_cloud::run::Replicas {
                shards,
                leases: edgefleet_cloud::leases::LeaseSettings {
                    namespace: args.lease_namespace.clone(),
                    set: args.lease_set.clone(),
                    replica,
                    serve_at: args.advertise_url.clone().unwrap_or_default(),
                    duration: std::time::Duration::from_secs(args.lease_duration_seconds),
                },
            })
        }
    };
    let endpoints = tokio::spawn(telemetry::serve(
        metrics_listener,
        registry,
        readiness.clone(),
        edgefleet_shared::health::Health::default(),
    ));

    let heartbeat = std::time::Duration::try_from_secs_f64(args.heartbeat_seconds)
        .ok()
        .filter(|d| !d.is_zero())
        .context("--heartbeat-seconds must be a positive number")?;
    let settings = Settings {
        heartbeat: edgefleet_shared::heartbeat::Heartbeat::every(heartbeat),
        sync_listener,
        status_writes_per_second: args.status_writes_per_second,
        status_metrics,
        sync_metrics,
        event_metrics,
        device_events_per_second: args.device_events_per_second,
        device_event_metrics,
        device_key_metrics,
        instance: args.instance,
        namespace: args.namespace,
        node_grace_period: std::time::Duration::from_secs(args.node_grace_seconds),
        tls: args.tls_dir.map(|dir| edgefleet_cloud::tls::TlsSettings {
            dir,
            reload_every: std::time::Duration::from_secs(2),
        }),
        token_recheck: edgefleet_cloud::sync::TOKEN_RECHECK,
        agent_ca,
        replicas,
        lease_metrics,
        limits: Limits {
            max_connections: args.max_connections,
            max_streams: args.max_connections,
            max_per_address: args.max_per_address,
            ..Limits::default()
        },
        agent_auth: match args.insecure_unauthenticated_agents {
            true => AuthSettings::TrustHello,
            false => args.agent_service_account,
        },
    };
    let controller = Controller::start(client, settings).await?;
    readiness.set(true);
    tracing::info!(sync = %controller.sync_addr, metrics = %args.metrics_addr, "controller ready");

    let mut term = tokio::signal::unix::signal(tokio::signal::unix::SignalKind::terminate())?;
    tokio::select! {
        r = controller.wait() => r,
        r = endpoints => r?.context("metrics server"),
        _ = tokio::signal::ctrl_c() => Ok(()),
        _ = term.recv() => Ok(()),
    }
}
