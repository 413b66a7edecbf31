//! `edgefleet-agent`: runs on each edge node.

#![forbid(unsafe_code)]

use std::net::SocketAddr;
use std::path::PathBuf;
use std::sync::Arc;
use std::time::Duration;

use anyhow::Context;
use clap::Parser;
use edgefleet_agent::coap::dtls::{COAPS_PORT, DtlsSettings};
use edgefleet_agent::coap::observe::ObserveSettings;
use edgefleet_agent::coap::{self, CoapMetrics, Security};
use edgefleet_agent::mqtt::{self, BrokerAddress, MqttMetrics};
use edgefleet_agent::store::Store;
use edgefleet_agent::sync::{self, SyncSettings};
use edgefleet_shared::health::{Health, Probe};
use edgefleet_shared::telemetry::{self, Readiness};
use prometheus_client::metrics::gauge::Gauge;
use prometheus_client::registry::Registry;

/// How often the store's health probe writes and flushes.
const STORE_PROBE_EVERY: Duration = Duration::from_secs(5);

#[derive(Debug, Parser)]
#[command(name = "edgefleet-agent", version, about = "Edgefleet edge agent")]
struct Cli {
    /// This node's Kubernetes name: the agent's identity towards the cloud.
    #[arg(long, env = "EDGEFLEET_NODE")]
    node: String,
    /// The cloud controller's sync endpoint (`https://`; `http://` only
    /// with --insecure-plaintext).
    #[arg(
        long,
        env = "EDGEFLEET_CLOUD",
        default_value = "https://127.0.0.1:7443"
    )]
    cloud: String,
    /// The CA bundle (PEM) the cloud's certificate must chain to, like the
    /// `ca.crt` cert-manager writes; read again on every connect.
    #[arg(long, env = "EDGEFLEET_CLOUD_CA_FILE")]
    cloud_ca_file: Option<PathBuf>,
    /// The name the cloud's certificate must carry, when it is not the
    /// host of --cloud.
    #[arg(long, env = "EDGEFLEET_CLOUD_SERVER_NAME")]
    cloud_server_name: Option<String>,
    /// Talk to the cloud without TLS (an `http://` --cloud): anyone on the
    /// network can read and forge the sync link. For local demos only.
    #[arg(long, env = "EDGEFLEET_INSECURE_PLAINTEXT")]
    insecure_plaintext: bool,
    /// The agent's ServiceAccount token (audience `edgefleet`), which the
    /// kubelet projects into the pod and renews; read on every connect
    /// and sent to the cloud, which takes the node from it.
    #[arg(long, env = "EDGEFLEET_TOKEN_FILE")]
    token_file: Option<PathBuf>,
    /// For an agent that is not a pod: its client certificate (PEM), of
    /// the signer `edgefleet.io/agent` for this node (see
    /// `edgefleet-agent-csr`); read on every connect. Needs
    /// --client-key-file.
    #[arg(long, env = "EDGEFLEET_CLIENT_CERT_FILE", requires = "client_key_file")]
    client_cert_file: Option<PathBuf>,
    /// The private key of --client-cert-file (PEM).
    #[arg(long, env = "EDGEFLEET_CLIENT_KEY_FILE", requires = "client_cert_file")]
    client_key_file: Option<PathBuf>,
    /// Where the agent keeps its store.
    #[arg(long, env = "EDGEFLEET_DATA_DIR", default_value = "/var/lib/edgefleet")]
    data_dir: PathBuf,
    /// UDP address of the CoAP server for devices: CoAP over DTLS (default
    /// 127.0.0.1:5684), or plain CoAP with --insecure-coap-plain (default
    /// 127.0.0.1:5683).
    #[arg(long, env = "EDGEFLEET_COAP_BIND")]
    coap_bind: Option<SocketAddr>,
    /// Serve plain CoAP: anyone on the network may send reports and events
    /// for any device of the node and read its desired state (labs only).
    /// Without it, devices use CoAP over DTLS with their own key (PSK
    /// identity `<name>@<namespace>`) and may act only for themselves.
    #[arg(long, env = "EDGEFLEET_INSECURE_COAP_PLAIN")]
    insecure_coap_plain: bool,
    /// At most this many DTLS sessions; a new one beyond ends the least
    /// recently heard.
    #[arg(long, env = "EDGEFLEET_COAP_MAX_DTLS_SESSIONS", default_value_t = DtlsSettings::default().max_sessions)]
    coap_max_dtls_sessions: usize,
    /// At most this many DTLS handshakes at once past the cookie exchange;
    /// one beyond is dropped (the device retries). Handshakes still
    /// waiting for their cookie are bounded at 4 times this, the oldest
    /// pushed out.
    #[arg(long, env = "EDGEFLEET_COAP_MAX_DTLS_HANDSHAKES", default_value_t = DtlsSettings::default().max_handshakes)]
    coap_max_dtls_handshakes: usize,
    /// At most this many CoAP observers (RFC 7641) in all; beyond it a
    /// `GET` with Observe is answered without registering.
    #[arg(long, env = "EDGEFLEET_COAP_MAX_OBSERVERS", default_value_t = ObserveSettings::default().max_observers)]
    coap_max_observers: usize,
    /// At most this many CoAP observers of one device.
    #[arg(long, env = "EDGEFLEET_COAP_MAX_OBSERVERS_PER_DEVICE", default_value_t = ObserveSettings::default().max_observers_per_device)]
    coap_max_observers_per_device: usize,
    /// At most this many CoAP requests handled at once; beyond, a request
    /// is answered `5.03` with `Max-Age: 1` (counted as `overloaded`).
    #[arg(long, env = "EDGEFLEET_COAP_MAX_REQUESTS_IN_FLIGHT", default_value_t = coap::MAX_REQUESTS_IN_FLIGHT)]
    coap_max_requests_in_flight: usize,
    /// An external site broker (`mqtt://host:port`, e.g. Mosquitto). Without
    /// it the agent runs an embedded broker on --mqtt-listen.
    #[arg(long, env = "EDGEFLEET_MQTT_URL")]
    mqtt_url: Option<url::Url>,
    /// Where the embedded broker listens (unused with --mqtt-url).
    #[arg(long, env = "EDGEFLEET_MQTT_LISTEN", default_value = "127.0.0.1:1883")]
    mqtt_listen: SocketAddr,
    /// Let anyone on --mqtt-listen use the embedded broker without a login
    /// and publish or subscribe to any topic, the agent's own included (labs
    /// only). Without it, a guard on --mqtt-listen logs each device in with
    /// its own key and lets it use only its own topics, and the broker
    /// itself listens on loopback.
    #[arg(
        long,
        env = "EDGEFLEET_INSECURE_MQTT_ANONYMOUS_DEVICES",
        conflicts_with = "mqtt_url"
    )]
    insecure_mqtt_anonymous_devices: bool,
    /// With --mqtt-url, a Mosquitto: the directory where the agent keeps
    /// Mosquitto's password file (`passwd`) and ACL file (`acl`) equal to
    /// the device keys it holds, each device limited to its own topics; the
    /// agent logs in with a password of its own made at start. Mosquitto
    /// reads them (`password_file`, `acl_file`, with `allow_anonymous
    /// false` and `use_username_as_clientid true`) and is sent SIGHUP on
    /// each change. Without it, logins and topic rules are the external
    /// broker's business.
    #[arg(long, env = "EDGEFLEET_MOSQUITTO_AUTH_DIR", requires_all = ["mqtt_url", "mosquitto_pid_file"])]
    mosquitto_auth_dir: Option<PathBuf>,
    /// The file holding Mosquitto's process id (it is sent SIGHUP when the
    /// files of --mosquitto-auth-dir change).
    #[arg(
        long,
        env = "EDGEFLEET_MOSQUITTO_PID_FILE",
        requires = "mosquitto_auth_dir"
    )]
    mosquitto_pid_file: Option<PathBuf>,
    /// The group (numeric id) given the files of --mosquitto-auth-dir
    /// (mode 0640), for a Mosquitto that runs as another user.
    #[arg(
        long,
        env = "EDGEFLEET_MOSQUITTO_FILES_GID",
        requires = "mosquitto_auth_dir"
    )]
    mosquitto_files_gid: Option<u32>,
    /// At most this many device events wait in the outbox for the cloud.
    /// At the bound the oldest event is dropped for the new one; drops are
    /// counted (`edgefleet_agent_events_dropped_total`) and reported to the
    /// cloud as soon as it is reachable.
    #[arg(long, env = "EDGEFLEET_OUTBOX_MAX_EVENTS", default_value_t = edgefleet_agent::store::DEFAULT_MAX_EVENTS)]
    outbox_max_events: u64,
    /// Address of /metrics and /healthz.
    #[arg(long, env = "EDGEFLEET_METRICS_ADDR", default_value = "127.0.0.1:9464")]
    metrics_addr: SocketAddr,
    /// Seconds between heartbeats on the sync stream; a cloud silent for 3
    /// of them is taken for gone and the agent reconnects. Use the cloud's
    /// `--heartbeat-seconds`.
    #[arg(
        long,
        env = "EDGEFLEET_CLOUD_HEARTBEAT_SECONDS",
        default_value_t = 10.0
    )]
    cloud_heartbeat_seconds: f64,
}

#[tokio::main]
async fn main() -> anyhow::Result<()> {
    telemetry::init_logging();
    let cli = Cli::parse();
    // Before anything starts: a plaintext link only when asked by name.
    let tls = cloud_tls(&cli)?;

    // A store that is out of reach (held by another agent, permission
    // denied, disk full) stops the agent with a message saying what to do;
    // only a corrupt one is moved aside.
    let opened = Store::open(&cli.data_dir.join("store")).with_context(|| {
        format!(
            "the agent cannot start without its store in {}",
            cli.data_dir.display()
        )
    })?;
    let mut registry = Registry::with_prefix("edgefleet_agent");
    let store_rebuilt = prometheus_client::metrics::counter::Counter::<u64>::default();
    registry.register(
        "store_rebuilds",
        "Stores moved aside because they were corrupt",
        store_rebuilt.clone(),
    );
    let store_lost = prometheus_client::metrics::counter::Counter::<u64>::default();
    registry.register(
        "store_entries_lost",
        "Stored entries dropped at start because they could not be read",
        store_lost.clone(),
    );
    let salvage = &opened.salvage;
    if let Some((aside, reason)) = &opened.moved_aside {
        store_rebuilt.inc();
        tracing::error!(
            moved_to = %aside.display(),
            %reason,
            salvaged_entries = salvage.entries,
            salvaged_event_ids = salvage.event_ids,
            lost = salvage.lost.len(),
            "the store is corrupt; it was moved aside, what could be read of its outbox is in the new one, and desired state is rebuilt from the cloud"
        );
    }
    for lost in &salvage.lost {
        tracing::error!(%lost, "unreadable in the store, and lost");
    }
    store_lost.inc_by(salvage.lost.len() as u64);
    let store = opened.store.with_max_events(cli.outbox_max_events);

    let coap_metrics = Arc::new(CoapMetrics::default());
    coap_metrics.register(&mut registry);
    let outbox_depth = Gauge::<i64>::default();
    registry.register(
        "outbox_depth",
        "Uplink entries waiting for the cloud's acknowledgement",
        outbox_depth.clone(),
    );
    let devices = Gauge::<i64>::default();
    registry.register("devices", "Devices the agent holds", devices.clone());
    let rules = Gauge::<i64>::default();
    registry.register("rules", "EdgeRules the agent holds", rules.clone());
    let last_seq = Gauge::<i64>::default();
    registry.register(
        "uplink_last_seq",
        "The highest uplink sequence number handed out (the cloud has everything up to it once the outbox is empty)",
        last_seq.clone(),
    );
    let oldest_pending = Gauge::<i64>::default();
    registry.register(
        "outbox_oldest_seq",
        "The sequence number of the oldest uplink entry not yet acknowledged (0: none)",
        oldest_pending.clone(),
    );
    let events_queued = Gauge::<i64>::default();
    registry.register(
        "outbox_events",
        "Device events waiting in the outbox (bounded by --outbox-max-events)",
        events_queued.clone(),
    );
    // A gauge over the store's lifetime total, which survives restarts.
    let events_dropped = Gauge::<i64>::default();
    registry.register(
        "events_dropped_total",
        "Device events dropped at the outbox bound over the store's life",
        events_dropped.clone(),
    );

    let mqtt_metrics = Arc::new(MqttMetrics::default());
    mqtt_metrics
        .reports
        .register(&mut registry, "mqtt_reports", "MQTT reports by outcome");
    mqtt_metrics
        .events
        .register(&mut registry, "mqtt_events", "MQTT events by outcome");
    registry.register(
        "mqtt_desired_published",
        "Desired states published retained",
        mqtt_metrics.desired_published.clone(),
    );
    registry.register(
        "mqtt_desired_cleared",
        "Retained desired states cleared for deleted devices",
        mqtt_metrics.desired_cleared.clone(),
    );
    let (mut broker, guarded) = broker_address(&cli)?;
    let mosquitto_files = Arc::new(edgefleet_shared::telemetry::Outcomes::default());
    mosquitto_files.register(
        &mut registry,
        "mqtt_mosquitto_files",
        "Rewrites of Mosquitto's password and ACL files by outcome (written, write_failed, reload_failed)",
    );
    let files = match (&cli.mosquitto_auth_dir, &cli.mosquitto_pid_file) {
        (Some(dir), Some(pid_file)) => {
            let files =
                mqtt::mosquitto::AuthFiles::new(&cli.node, dir, pid_file, cli.mosquitto_files_gid);
            broker.login = Some(files.agent_login());
            tracing::info!(dir = %dir.display(), "Mosquitto's password and ACL files kept by the agent");
            Some(files)
        }
        _ => None,
    };
    let mosquitto = async {
        match files {
            Some(files) => mqtt::mosquitto::run(files, store.clone(), mosquitto_files).await,
            None => std::future::pending().await,
        }
    };
    let guard_metrics = Arc::new(mqtt::guard::GuardMetrics::default());
    guard_metrics.logins.register(
        &mut registry,
        "mqtt_guard_logins",
        "MQTT device logins at the guard by outcome (accepted or why refused)",
    );
    guard_metrics.ended.register(
        &mut registry,
        "mqtt_guard_ended",
        "MQTT device connections the guard ended after login, by reason",
    );
    registry.register(
        "mqtt_guard_connections",
        "MQTT device connections open through the guard",
        guard_metrics.open.clone(),
    );
    let guard = async {
        match guarded {
            Some((listener, broker, broker_password)) => {
                let guard = mqtt::guard::Guard {
                    node: cli.node.clone(),
                    store: store.clone(),
                    broker,
                    broker_password,
                    metrics: guard_metrics,
                };
                mqtt::guard::serve(listener, guard).await
            }
            None => std::future::pending().await,
        }
    };

    let coap_bind = cli.coap_bind.unwrap_or_else(|| {
        let port = if cli.insecure_coap_plain {
            5683
        } else {
            COAPS_PORT
        };
        SocketAddr::from(([127, 0, 0, 1], port))
    });
    if cli.insecure_coap_plain {
        tracing::warn!(coap = %coap_bind, "--insecure-coap-plain: anyone who can reach the CoAP port may report for, and read the desired state of, any device of this node");
    }
    let coap_socket = tokio::net::UdpSocket::bind(coap_bind)
        .await
        .with_context(|| format!("bind CoAP on {coap_bind}"))?;
    let metrics_listener = tokio::net::TcpListener::bind(cli.metrics_addr)
        .await
        .with_context(|| format!("bind metrics on {}", cli.metrics_addr))?;
    tracing::info!(node = %cli.node, coap = %coap_bind, dtls = !cli.insecure_coap_plain, metrics = %cli.metrics_addr, cloud = %cli.cloud, "agent starting");

    let readiness = Readiness::default();
    readiness.set(true);
    let health = Health::default();
    // The store must make writes durable; a probe every few seconds that
    // hangs shows as a stall.
    let store_check = health.check("store", Probe::Live, Some(STORE_PROBE_EVERY * 6));
    // An embedded broker that is gone takes a restart; an external one is
    // somebody else's: the agent is then only not ready.
    let mqtt_probe = match cli.mqtt_url {
        Some(_) => Probe::Ready,
        None => Probe::Live,
    };
    let mqtt_check = health.check("mqtt", mqtt_probe, None);
    // Not healthy (embedded broker) or not ready (external one) until the
    // broker acknowledged the subscriptions to reports and events: a
    // report sent before that reaches no subscriber.
    mqtt_check.failing("not subscribed at the site broker yet");
    let heartbeat = Duration::try_from_secs_f64(cli.cloud_heartbeat_seconds)
        .ok()
        .filter(|d| !d.is_zero())
        .context("--cloud-heartbeat-seconds must be a positive number")?;
    let silent_cloud = prometheus_client::metrics::counter::Counter::<u64>::default();
    registry.register(
        "sync_silent_cloud",
        "Sync sessions ended because the cloud was silent for 3 heartbeat intervals",
        silent_cloud.clone(),
    );
    let refused_redirects = prometheus_client::metrics::counter::Counter::<u64>::default();
    registry.register(
        "sync_redirects_refused",
        "Redirects to another controller replica not followed (not https with TLS configured, or not a URL)",
        refused_redirects.clone(),
    );
    let sync_bytes = edgefleet_agent::sync::MessageBytes::default();
    sync_bytes.register(&mut registry);
    let settings = SyncSettings {
        cloud: cli.cloud.clone(),
        tls,
        token_file: cli.token_file.clone(),
        node: cli.node.clone(),
        agent_version: env!("CARGO_PKG_VERSION").to_owned(),
        boot_id: boot_id(),
        heartbeat: edgefleet_shared::heartbeat::Heartbeat::every(heartbeat),
        silent_cloud,
        refused_redirects,
        bytes: sync_bytes,
        liveness: health.check(
            "sync",
            Probe::Live,
            Some(sync::stall_limit(
                edgefleet_shared::heartbeat::Heartbeat::every(heartbeat),
            )),
        ),
    };
    let site_rollbacks = prometheus_client::metrics::counter::Counter::<u64>::default();
    registry.register(
        "site_rollbacks",
        "Devices this agent rolled back on its own: their site crossed a rollout's failure threshold while the cloud was unreachable",
        site_rollbacks.clone(),
    );
    let pacing = edgefleet_agent::site_pacing::Metrics::default();
    registry.register(
        "site_pacing_released",
        "Rollout generations this agent held back and then released: their site had a place",
        pacing.released.clone(),
    );
    registry.register(
        "site_pacing_held",
        "Rollout generations this agent holds back now: their site is at its limit, or its canary has not succeeded",
        pacing.held.clone(),
    );
    let rule_metrics = Arc::new(edgefleet_agent::rules::RuleMetrics::default());
    rule_metrics.register(&mut registry);
    let gauges = {
        let store = store.clone();
        async move {
            let mut tick = tokio::time::interval(Duration::from_millis(500));
            let mut probed = tokio::time::Instant::now();
            loop {
                tick.tick().await;
                if probed.elapsed() >= STORE_PROBE_EVERY {
                    probed = tokio::time::Instant::now();
                    match store.probe().await {
                        Ok(()) => store_check.ok(),
                        Err(error) => {
                            tracing::error!(%error, "the store cannot make writes durable");
                            store_check.failing(error);
                        }
                    }
                }
                outbox_depth.set(store.outbox_depth() as i64);
                devices.set(store.device_count() as i64);
                rules.set(store.rule_count() as i64);
                events_queued.set(store.events_queued() as i64);
                last_seq.set(store.last_seq().map(|n| n as i64).unwrap_or(-1));
                oldest_pending.set(match store.oldest_pending_seq() {
                    Ok(seq) => seq.map_or(0, |n| n as i64),
                    Err(_) => -1,
                });
                events_dropped.set(store.events_dropped_total().map(|n| n as i64).unwrap_or(-1));
            }
        }
    };
    let coap_settings = coap::CoapSettings {
        observe: ObserveSettings {
            max_observers: cli.coap_max_observers,
            max_observers_per_device: cli.coap_max_observers_per_device,
            ..ObserveSettings::default()
        },
        max_requests_in_flight: cli.coap_max_requests_in_flight.max(1),
        security: if cli.insecure_coap_plain {
            Security::InsecurePlain
        } else {
            Security::Dtls(DtlsSettings {
                max_sessions: cli.coap_max_dtls_sessions.max(1),
                max_handshakes: cli.coap_max_dtls_handshakes.max(1),
                ..DtlsSettings::default()
            })
        },
    };
    tokio::select! {
        served = coap::serve_with(coap_socket, store.clone(), coap_metrics, coap_settings) => served.context("CoAP server")?,
        served = telemetry::serve(metrics_listener, registry, readiness, health) => served.context("metrics server")?,
        () = sync::run(settings, store.clone()) => {}
        () = mqtt::run(broker, cli.node.clone(), store.clone(), mqtt_metrics, mqtt_check) => {}
        () = gauges => {}
        () = guard => {}
        () = mosquitto => {}
        () = edgefleet_agent::site_rollback::run(store.clone(), site_rollbacks) => {}
        () = edgefleet_agent::site_pacing::run(store.clone(), pacing) => {}
        () = edgefleet_agent::rules::run(store.clone(), rule_metrics) => {}
        _ = shutdown_signal() => tracing::info!("shutting down"),
    }
    Ok(())
}

/// A guard's listener, the embedded broker behind it, and the password the
/// guard logs devices in with.
type Guarded = (tokio::net::TcpListener, SocketAddr, String);

/// The broker to use: the external one given, or an embedded one started
/// now (behind a guard, unless --insecure-mqtt-anonymous-devices).
fn broker_address(cli: &Cli) -> anyhow::Result<(BrokerAddress, Option<Guarded>)> {
    if cli.mqtt_url.is_none() && !cli.insecure_mqtt_anonymous_devices {
        let secrets = mqtt::broker::BrokerSecrets::new(&cli.node);
        // The broker on a free loopback port; the guard takes --mqtt-listen.
        let internal = std::net::TcpListener::bind("127.0.0.1:0")?.local_addr()?;
        mqtt::broker::start_embedded_broker(internal, Some(secrets.clone()))
            .with_context(|| format!("start the embedded MQTT broker on {internal}"))?;
        let listener = std::net::TcpListener::bind(cli.mqtt_listen)
            .with_context(|| format!("bind the MQTT guard on {}", cli.mqtt_listen))?;
        listener.set_nonblocking(true)?;
        let listener = tokio::net::TcpListener::from_std(listener)?;
        tracing::info!(listen = %cli.mqtt_listen, broker = %internal, "embedded MQTT broker started behind the device guard");
        let broker = BrokerAddress {
            host: internal.ip().to_string(),
            port: internal.port(),
            login: Some(secrets.agent_login()),
        };
        return Ok((broker, Some((listener, internal, secrets.guard_password()))));
    }
    Ok((plain_broker_address(cli)?, None))
}

/// The external broker given, or an embedded one without device logins.
fn plain_broker_address(cli: &Cli) -> anyhow::Result<BrokerAddress> {
    match &cli.mqtt_url {
        Some(url) => {
            anyhow::ensure!(
                url.scheme() == "mqtt",
                "--mqtt-url must be mqtt://host:port, not {url}"
            );
            let host = url.host_str().context("--mqtt-url has no host")?.to_owned();
            Ok(BrokerAddress {
                host,
                port: url.port().unwrap_or(1883),
                login: None,
            })
        }
        None => {
            mqtt::broker::start_embedded_broker(cli.mqtt_listen, None).with_context(|| {
                format!("start the embedded MQTT broker on {}", cli.mqtt_listen)
            })?;
            tracing::warn!(listen = %cli.mqtt_listen, "embedded MQTT broker started without device logins (--insecure-mqtt-anonymous-devices): anyone who reaches it can read and forge any device's messages");
            // Listening on every address (in a pod): dial it on loopback.
            let ip = match cli.mqtt_listen.ip() {
                ip if ip.is_unspecified() && ip.is_ipv4() => std::net::Ipv4Addr::LOCALHOST.into(),
                ip if ip.is_unspecified() => std::net::Ipv6Addr::LOCALHOST.into(),
                ip => ip,
            };
            Ok(BrokerAddress {
                host: ip.to_string(),
                port: cli.mqtt_listen.port(),
                login: None,
            })
        }
    }
}

/// A fresh id for this start of the agent.
fn boot_id() -> String {
    let nanos = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map(|d| d.as_nanos())
        .unwrap_or_default();
    format!("{:x}-{:x}", nanos, std::process::id())
}

async fn shutdown_signal() -> std::io::Result<()> {
    let mut term = tokio::signal::unix::signal(tokio::signal::unix::SignalKind::terminate())?;
    tokio::select! {
        r = tokio::signal::ctrl_c() => r,
        _ = term.recv() => Ok(()),
    }
}

/// How the cloud's certificate is checked, from the flags: TLS unless
/// plaintext is asked for by name, and then the URL must say `http://`.
fn cloud_tls(cli: &Cli) -> anyhow::Result<Option<edgefleet_agent::sync::CloudTls>> {
    let plaintext_url = cli.cloud.starts_with("http://");
    match (cli.insecure_plaintext, plaintext_url) {
        (true, true) => {
            tracing::warn!(cloud = %cli.cloud, "talking to the cloud in PLAINTEXT: anyone on the network can read and forge the sync link; for local demos only");
            Ok(None)
        }
        (true, false) => anyhow::bail!(
            "--insecure-plaintext needs an http:// --cloud (it is {})",
            cli.cloud
        ),
        (false, true) => anyhow::bail!(
            "--cloud {} is plaintext: use https:// with --cloud-ca-file, or pass --insecure-plaintext (local demos only)",
            cli.cloud
        ),
        (false, false) => {
            let ca_file = cli.cloud_ca_file.clone().context(
                "--cloud-ca-file is needed to check the cloud's certificate (the ca.crt of its Secret)",
            )?;
            let client_certificate = match (&cli.client_cert_file, &cli.client_key_file) {
                (Some(cert_file), Some(key_file)) => {
                    Some(edgefleet_agent::sync::ClientCertificate {
                        cert_file: cert_file.clone(),
                        key_file: key_file.clone(),
                    })
                }
                _ => None,
            };
            Ok(Some(edgefleet_agent::sync::CloudTls {
                ca_file,
                server_name: cli.cloud_server_name.clone(),
                client_certificate,
            }))
        }
    }
}
