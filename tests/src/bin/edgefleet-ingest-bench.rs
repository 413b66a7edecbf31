//! `edgefleet-ingest-bench` (`make bench-ingest`): how fast one agent takes
//! in what its devices send, durably, and what each acknowledgement waits.
//! Everything runs in this process on a store on the real disk; devices
//! talk to the agent over real UDP (CoAP) and through a real Mosquitto
//! (MQTT). It prints (and asserts nothing; see docs/benchmarks.md), per
//! phase:
//!
//! - acknowledged messages per second, and per second of the agent's CPU
//!   (this process's CPU time minus the device clients' threads; the broker
//!   is another process and not counted);
//! - the acknowledgement latency, p50 / p99 / max: for CoAP the response
//!   to a report, which the agent sends once the report is durable; for
//!   MQTT the `event-ack` to an event, which the agent publishes once the
//!   event is durable (a report's acknowledgement goes to the broker, which
//!   devices never see).
//!
//! The phases: CoAP reports with and without the syncs that make a flush
//! survive a power cut (what they cost), MQTT events with one flush per
//! message (the agent before group commit) against one flush per batch,
//! and MQTT events through the embedded broker with one connection per
//! device, without logins against behind the guard with each device's key
//! (what device authentication and topic checks cost; the broker's and the
//! guard's threads count as the agent's there).
//! Every device keeps one message outstanding, as the simulated devices do.

use std::collections::{BTreeMap, HashMap};
use std::net::SocketAddr;
use std::sync::Arc;
use std::time::{Duration, Instant};

use anyhow::Context;
use clap::Parser;
use edgefleet_agent::coap::{self, CoapMetrics, CoapSettings, Security};
use edgefleet_agent::mqtt::broker::{BrokerSecrets, start_embedded_broker};
use edgefleet_agent::mqtt::guard::{self, Guard};
use edgefleet_agent::mqtt::{self, BrokerAddress, MqttMetrics};
use edgefleet_agent::store::{Desired, DesiredDevice, HeldCredential, Store};
use edgefleet_shared::api::Transport;
use edgefleet_shared::codec::{self, DeviceEvent, EventAck};
use edgefleet_shared::credential::{self, Psk};
use edgefleet_shared::{ResourceKey, ResourceVersion, topics};
use edgefleet_sim::coap::{CoapClient, Request};
use edgefleet_sim::retransmit::RetransmitParams;
use edgefleet_tests::bench::Report;
use edgefleet_tests::mosquitto::Mosquitto;
use edgefleet_tests::numbered_report;
use edgefleet_tests::process::memory_kib;
use futures::{StreamExt, TryStreamExt};
use rumqttc::{AsyncClient, Event, MqttOptions, Packet, QoS};
use tokio::runtime::Runtime;

#[derive(Debug, Parser)]
#[command(
    name = "edgefleet-ingest-bench",
    about = "Measure an agent's durable ingest over CoAP and MQTT"
)]
struct Cli {
    /// Devices, each with one message outstanding.
    #[arg(long, default_value_t = 200)]
    devices: usize,
    /// How long each phase runs.
    #[arg(long, default_value_t = 10)]
    seconds: u64,
    /// Where the stores go (a real disk, not tmpfs, for honest flushes).
    #[arg(long, default_value = "target/ingest-bench")]
    dir: std::path::PathBuf,
    /// Run only the phases whose name contains this (say `DTLS`).
    #[arg(long)]
    only: Option<String>,
    /// CoAP: each device sends a report at most this often (milliseconds;
    /// 0: as soon as the last was acknowledged). An offered load of
    /// devices / interval, as a site's devices on a schedule make it.
    #[arg(long, default_value_t = 0)]
    interval_ms: u64,
}

const NAMESPACE: &str = "bench";
/// The name of the threads that run the device clients, whose CPU time is
/// not the agent's.
const CLIENT_THREADS: &str = "bench-devices";

fn key(i: usize) -> ResourceKey {
    ResourceKey::device(NAMESPACE, format!("d{i:05}"))
}

fn main() -> anyhow::Result<()> {
    let cli = Cli::parse();
    std::fs::create_dir_all(&cli.dir)?;
    // The agent's side runs on one worker thread, as on a small edge box;
    // the devices on threads of their own.
    let agent = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(1)
        .thread_name("bench-agent")
        .enable_all()
        .build()?;
    let devices = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(1)
        .thread_name(CLIENT_THREADS)
        .enable_all()
        .build()?;
    let mut report = Report::default();
    report.line(&format!(
        "ingest: {} devices, one message outstanding each{}, {} s per phase, stores in {}",
        cli.devices,
        match cli.interval_ms {
            0 => String::new(),
            ms => format!(" (CoAP: a report every {ms} ms at most)"),
        },
        cli.seconds,
        cli.dir.display()
    ));
    let phases: [(&str, Phase); 8] = [
        (
            "CoAP reports, plain, no power-cut syncs",
            Phase::Coap {
                sync: false,
                mode: CoapMode::Plain,
            },
        ),
        (
            "CoAP reports, plain, power-cut syncs",
            Phase::Coap {
                sync: true,
                mode: CoapMode::Plain,
            },
        ),
        (
            "CoAP reports over DTLS (today)",
            Phase::Coap {
                sync: true,
                mode: CoapMode::Dtls,
            },
        ),
        (
            "CoAP over DTLS, a new handshake per report",
            Phase::Coap {
                sync: true,
                mode: CoapMode::HandshakeEach,
            },
        ),
        (
            "MQTT events, one flush per message",
            Phase::Mqtt { max_batch: 1 },
        ),
        (
            "MQTT events, group commit (today)",
            Phase::Mqtt {
                max_batch: mqtt::MAX_BATCH,
            },
        ),
        (
            "MQTT events, embedded broker, no device login",
            Phase::Embedded { guard: false },
        ),
        (
            "MQTT events, embedded broker behind the guard",
            Phase::Embedded { guard: true },
        ),
    ];
    let broker_dir = tempfile::tempdir()?;
    // Errors only: its connection log would bury the figures. Without
    // set_tcp_nodelay, Nagle's algorithm holds each small packet the broker
    // forwards until the last one is acknowledged (~40 ms per hop with
    // delayed ACKs): the latency of a lone device would be the broker's.
    let broker = Mosquitto::start_with(broker_dir.path(), "log_type error\nset_tcp_nodelay true\n");
    for (n, (name, phase)) in phases.into_iter().enumerate() {
        if cli
            .only
            .as_ref()
            .is_some_and(|only| !name.contains(only.as_str()))
        {
            continue;
        }
        let dir = cli.dir.join(format!("phase-{n}"));
        let _ = std::fs::remove_dir_all(&dir);
        // The peak RSS of each phase on its own (Linux: "5" resets it).
        let _ = std::fs::write("/proc/self/clear_refs", "5");
        let figures = run_phase(&agent, &devices, &cli, &dir, &broker, phase)
            .with_context(|| format!("phase {name:?}"))?;
        report.line(&format!("{name:<48} {figures}"));
        if let Some(peak) = memory_kib("self", "VmHWM") {
            report.line(&format!(
                "{:<48} peak RSS {:.1} MiB (this process: the agent and its devices' clients)",
                "",
                peak as f64 / 1024.0
            ));
        }
        std::fs::remove_dir_all(&dir)?;
    }
    std::fs::write(cli.dir.join("results.txt"), &report.text)?;
    println!("(also in {})", cli.dir.join("results.txt").display());
    Ok(())
}

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum CoapMode {
    /// Plain CoAP (`--insecure-coap-plain`).
    Plain,
    /// CoAP over DTLS, one session per device for the whole phase.
    Dtls,
    /// CoAP over DTLS, a new session (a full handshake) for every report:
    /// what a handshake costs.
    HandshakeEach,
}

#[derive(Clone, Copy, Debug)]
enum Phase {
    Coap {
        sync: bool,
        mode: CoapMode,
    },
    Mqtt {
        max_batch: usize,
    },
    /// One connection per device to the embedded broker, behind the guard
    /// (each device logs in with its key) or not.
    Embedded {
        guard: bool,
    },
}

/// What one phase measured.
struct Figures {
    acked: usize,
    elapsed: Duration,
    agent_cpu: Duration,
    latencies: Vec<Duration>,
    failures: usize,
    /// Answered `5.03` (the agent's load shedding); each device waited the
    /// answer's Max-Age before its next report.
    refused: usize,
    /// How long the devices took to set up their sessions before the
    /// measured part (DTLS with one session per device).
    setup: Option<Duration>,
}

impl std::fmt::Display for Figures {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        let mut sorted = self.latencies.clone();
        sorted.sort();
        let pct = |p: f64| {
            sorted
                .get(((sorted.len() as f64 * p) as usize).min(sorted.len().saturating_sub(1)))
                .map_or(f64::NAN, |d| d.as_secs_f64() * 1e3)
        };
        let per_s = self.acked as f64 / self.elapsed.as_secs_f64();
        let per_cpu_s = self.acked as f64 / self.agent_cpu.as_secs_f64().max(1e-9);
        write!(
            f,
            "{per_s:>7.0} acked/s {per_cpu_s:>7.0} per agent CPU-s  ack p50 {:>6.2} ms  p99 {:>7.2} ms  max {:>7.2} ms  ({} acked, {} refused 5.03, {} failed)",
            pct(0.50),
            pct(0.99),
            sorted.last().map_or(f64::NAN, |d| d.as_secs_f64() * 1e3),
            self.acked,
            self.refused,
            self.failures
        )?;
        match self.setup {
            Some(setup) => write!(
                f,
                "  (sessions set up first in {:.2} s)",
                setup.as_secs_f64()
            ),
            None => Ok(()),
        }
    }
}

fn run_phase(
    agent: &Runtime,
    devices: &Runtime,
    cli: &Cli,
    dir: &std::path::Path,
    broker: &Mosquitto,
    phase: Phase,
) -> anyhow::Result<Figures> {
    let node = format!("ingest-{}", dir.file_name().unwrap().to_string_lossy());
    let transport = match phase {
        Phase::Coap { .. } => Transport::Coap,
        Phase::Mqtt { .. } | Phase::Embedded { .. } => Transport::Mqtt,
    };
    let store = agent.block_on(seed_store(dir, cli.devices, transport))?;
    let store = match phase {
        Phase::Coap { sync: false, .. } => store.without_power_cut_sync(),
        _ => store,
    };
    let until = Duration::from_secs(cli.seconds);
    let mut setup = None;
    let (served, results) = match phase {
        Phase::Coap { mode, .. } => {
            let socket = agent.block_on(tokio::net::UdpSocket::bind("127.0.0.1:0"))?;
            let addr = socket.local_addr()?;
            let settings = match mode {
                CoapMode::Plain => CoapSettings {
                    security: Security::InsecurePlain,
                    ..CoapSettings::default()
                },
                CoapMode::Dtls | CoapMode::HandshakeEach => {
                    agent.block_on(give_keys(&store))?;
                    CoapSettings::default()
                }
            };
            let served = agent
                .spawn(coap::serve_with(
                    socket,
                    store.clone(),
                    Arc::new(CoapMetrics::default()),
                    settings,
                ))
                .abort_handle();
            let cpu = Cpu::now()?;
            let (results, set_up) = devices.block_on(coap_devices(
                addr,
                cli.devices,
                until,
                Duration::from_millis(cli.interval_ms),
                mode,
            ));
            setup = set_up;
            (served, (results, cpu.since()?))
        }
        Phase::Mqtt { max_batch } => {
            let served = agent
                .spawn(mqtt::run_with_batch(
                    BrokerAddress {
                        host: broker.addr.ip().to_string(),
                        port: broker.addr.port(),
                        login: None,
                    },
                    node.clone(),
                    store.clone(),
                    Arc::new(MqttMetrics::default()),
                    Default::default(),
                    max_batch,
                ))
                .abort_handle();
            let sessions = devices.block_on(connect_sessions(
                broker.addr,
                &node,
                cli.devices,
                PER_SESSION,
                false,
            ))?;
            let cpu = Cpu::now()?;
            let results = devices.block_on(run_sessions(sessions, until));
            (served, (results, cpu.since()?))
        }
        Phase::Embedded { guard } => {
            let (address, device_port, served) = agent.block_on(embedded(&node, &store, guard))?;
            let served = [
                served,
                agent
                    .spawn(mqtt::run(
                        address,
                        node.clone(),
                        store.clone(),
                        Arc::new(MqttMetrics::default()),
                        Default::default(),
                    ))
                    .abort_handle(),
            ];
            let sessions =
                devices.block_on(connect_sessions(device_port, &node, cli.devices, 1, guard))?;
            let cpu = Cpu::now()?;
            let results = devices.block_on(run_sessions(sessions, until));
            for task in &served[1..] {
                task.abort();
            }
            (served[0].clone(), (results, cpu.since()?))
        }
    };
    served.abort();
    let ((tally, elapsed), agent_cpu) = results;
    Ok(Figures {
        acked: tally.latencies.len(),
        elapsed,
        agent_cpu,
        latencies: tally.latencies,
        failures: tally.failed,
        refused: tally.refused,
        setup,
    })
}

/// The key of device `i`.
fn device_key(i: usize) -> String {
    format!("bench-key-{i:05}-0123456789")
}

/// An embedded broker on a free port, behind the guard with every device's
/// key in `store` or not: the agent's broker address, the port devices
/// dial, and the guard's task (a task that ends at once without one).
async fn embedded(
    node: &str,
    store: &Store,
    guard: bool,
) -> anyhow::Result<(BrokerAddress, SocketAddr, tokio::task::AbortHandle)> {
    let free = std::net::TcpListener::bind("127.0.0.1:0")?.local_addr()?;
    let secrets = BrokerSecrets::new(node);
    start_embedded_broker(free, guard.then(|| secrets.clone()))?;
    // The broker starts in threads of its own: wait until it listens.
    let deadline = Instant::now() + Duration::from_secs(10);
    while tokio::net::TcpStream::connect(free).await.is_err() {
        anyhow::ensure!(
            Instant::now() < deadline,
            "the embedded broker never listened on {free}"
        );
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    if !guard {
        let address = BrokerAddress {
            host: free.ip().to_string(),
            port: free.port(),
            login: None,
        };
        return Ok((address, free, tokio::spawn(async {}).abort_handle()));
    }
    give_keys(store).await?;
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await?;
    let device_port = listener.local_addr()?;
    let served = tokio::spawn(guard::serve(
        listener,
        Guard {
            node: node.to_owned(),
            store: store.clone(),
            broker: free,
            broker_password: secrets.guard_password(),
            metrics: Arc::default(),
        },
    ));
    let address = BrokerAddress {
        host: free.ip().to_string(),
        port: free.port(),
        login: Some(secrets.agent_login()),
    };
    Ok((address, device_port, served.abort_handle()))
}

/// Gives every device of `store` its key.
async fn give_keys(store: &Store) -> anyhow::Result<()> {
    let keys: Vec<_> = store
        .devices()?
        .into_iter()
        .map(|(device, _)| {
            let i: usize = device.name[1..].parse().expect("d<number>");
            let psk = Psk::new(device_key(i).into_bytes()).expect("a key");
            let held = HeldCredential {
                version: credential::version("bench", &psk),
                psk,
            };
            (credential::key_of(&device), Desired::Credential(held))
        })
        .collect();
    for chunk in keys.chunks(500) {
        store.apply(chunk, &[]).await?;
    }
    Ok(())
}

/// A store in `dir` holding `count` devices.
async fn seed_store(
    dir: &std::path::Path,
    count: usize,
    transport: Transport,
) -> anyhow::Result<Store> {
    let store = Store::open(dir)?.store;
    let devices: Vec<_> = (0..count)
        .map(|i| {
            (
                key(i),
                DesiredDevice::new(
                    ResourceVersion::new(format!("uid-{i}"), 1),
                    "meter",
                    transport,
                    BTreeMap::new(),
                ),
            )
        })
        .collect();
    for chunk in devices.chunks(500) {
        store.apply(chunk, &[]).await?;
    }
    Ok(store)
}

/// What devices saw: acknowledgement latencies, exchanges that failed,
/// and requests the agent refused with `5.03`.
#[derive(Debug, Default)]
struct Tally {
    latencies: Vec<Duration>,
    failed: usize,
    refused: usize,
}

impl Tally {
    fn of(latencies: Vec<Duration>, failed: usize) -> Tally {
        Tally {
            latencies,
            failed,
            refused: 0,
        }
    }
}

/// What the devices saw, and the time it took.
type Results = (Tally, Duration);

/// `count` CoAP devices, each on its own socket (as constrained devices
/// are), each sending a new report as soon as the last was acknowledged
/// and `interval` after the last began, the first at an offset within
/// `interval` of its own; a device the agent refused with `5.03` waits
/// the answer's Max-Age first, as RFC 7252 asks.
/// With one DTLS session each, the devices first set their sessions up all
/// at once (as after an agent restart) with one report each, which is not
/// measured; how long that took comes back too.
async fn coap_devices(
    agent: SocketAddr,
    count: usize,
    until: Duration,
    interval: Duration,
    mode: CoapMode,
) -> (Results, Option<Duration>) {
    let begun = Instant::now();
    let ready = Arc::new(tokio::sync::Barrier::new(count + 1));
    let tasks: Vec<_> = (0..count)
        .map(|i| {
            let ready = Arc::clone(&ready);
            tokio::spawn(async move {
                let open = || async {
                    let client = match mode {
                        CoapMode::Plain => CoapClient::connect(agent, 1, 1).await,
                        CoapMode::Dtls | CoapMode::HandshakeEach => {
                            CoapClient::connect_dtls(agent, &key(i), device_key(i).as_bytes(), 1, 1)
                                .await
                        }
                    };
                    client.expect("a socket")
                };
                let mut client = open().await;
                let mut tally = Tally::default();
                let mut value = 0;
                let retransmit = RetransmitParams::default().start_with_factor(1.0);
                if mode == CoapMode::Dtls {
                    loop {
                        value += 1;
                        let payload =
                            codec::encode(&numbered_report(value)).expect("a report encodes");
                        let request = Request::report(NAMESPACE, &key(i).name, payload);
                        let exchange = client.request(&request, retransmit.clone()).await;
                        match exchange.result {
                            Ok(response) if response.is_success() => break,
                            Ok(response) if let Some(wait) = response.retry_after() => {
                                tokio::time::sleep(wait).await;
                            }
                            _ => {}
                        }
                    }
                }
                ready.wait().await;
                let started = Instant::now();
                let mut next = started + interval.mul_f64(i as f64 / count as f64);
                while started.elapsed() < until {
                    tokio::time::sleep_until(next.into()).await;
                    next = Instant::now().max(next + interval);
                    if mode == CoapMode::HandshakeEach && value > 0 {
                        client = open().await;
                    }
                    value += 1;
                    let payload = codec::encode(&numbered_report(value)).expect("a report encodes");
                    let request = Request::report(NAMESPACE, &key(i).name, payload);
                    let sent = Instant::now();
                    let exchange = client.request(&request, retransmit.clone()).await;
                    match exchange.result {
                        Ok(response) if response.is_success() => {
                            tally.latencies.push(sent.elapsed());
                        }
                        Ok(response) if let Some(wait) = response.retry_after() => {
                            tally.refused += 1;
                            next = next.max(Instant::now() + wait);
                        }
                        _ => tally.failed += 1,
                    }
                }
                tally
            })
        })
        .collect();
    ready.wait().await;
    let setup = (mode == CoapMode::Dtls).then(|| begun.elapsed());
    (collect(tasks, Instant::now()).await, setup)
}

async fn collect(tasks: Vec<tokio::task::JoinHandle<Tally>>, started: Instant) -> Results {
    let mut all = Tally::default();
    for task in tasks {
        let tally = task.await.expect("a device task");
        all.latencies.extend(tally.latencies);
        all.failed += tally.failed;
        all.refused += tally.refused;
    }
    (all, started.elapsed())
}

/// Devices per MQTT connection, as device-sim groups them.
const PER_SESSION: usize = 50;

/// `count` MQTT devices, `per_session` to a connection (logged in with the
/// device's key, when one device has a connection of its own and `login`),
/// connected and subscribed, each with one event confirmed (so setup is not
/// measured).
async fn connect_sessions(
    broker: SocketAddr,
    node: &str,
    count: usize,
    per_session: usize,
    login: bool,
) -> anyhow::Result<Vec<Session>> {
    // Connected a few at a time: a connection nobody polls sends no
    // keep-alive, and the broker drops it after 1.5 keep-alive intervals.
    let connects = (0..count)
        .step_by(per_session)
        .enumerate()
        .map(|(n, first)| {
            let devices: Vec<usize> = (first..(first + per_session).min(count)).collect();
            let (client_id, login) = match devices[..] {
                [i] => (
                    credential::login_name(&key(i)),
                    login.then(|| (credential::login_name(&key(i)), device_key(i))),
                ),
                _ => (format!("{node}-devices-{n}"), None),
            };
            Session::connect(broker, node, client_id, login, devices)
        });
    futures::stream::iter(connects)
        .buffer_unordered(32)
        .try_collect()
        .await
}

/// Every device of `sessions` sends a new event as soon as the last was
/// confirmed on its `event-ack` topic, for `until`.
async fn run_sessions(sessions: Vec<Session>, until: Duration) -> Results {
    let started = Instant::now();
    let tasks: Vec<_> = sessions
        .into_iter()
        .map(|session| tokio::spawn(session.run(started, until)))
        .collect();
    collect(tasks, started).await
}

/// One MQTT connection carrying some devices' events.
struct Session {
    client: AsyncClient,
    events: rumqttc::EventLoop,
    node: String,
    devices: Vec<usize>,
    /// A device's slot by its `event-ack` topic.
    slots: HashMap<String, usize>,
    /// The next event id per device (the first was sent at connect).
    next_id: Vec<u64>,
    /// When each device's outstanding event was sent.
    sent: Vec<Instant>,
}

impl Session {
    async fn connect(
        broker: SocketAddr,
        node: &str,
        client_id: String,
        login: Option<(String, String)>,
        devices: Vec<usize>,
    ) -> anyhow::Result<Session> {
        let mut options = MqttOptions::new(client_id, broker.ip().to_string(), broker.port());
        options.set_keep_alive(Duration::from_secs(30));
        if let Some((user, password)) = login {
            options.set_credentials(user, password);
        }
        let (client, mut events) = AsyncClient::new(options, devices.len() * 4 + 4);
        let mut network = events.network_options();
        network.set_tcp_nodelay(true);
        events.set_network_options(network);
        for &i in &devices {
            client
                .subscribe(topics::event_ack(node, &key(i)), QoS::AtLeastOnce)
                .await?;
        }
        let mut session = Session {
            client,
            events,
            node: node.to_owned(),
            slots: devices
                .iter()
                .enumerate()
                .map(|(slot, &i)| (topics::event_ack(node, &key(i)), slot))
                .collect(),
            next_id: vec![1; devices.len()],
            sent: vec![Instant::now(); devices.len()],
            devices,
        };
        // One event per device, confirmed, before the clock starts; resent
        // every second, as devices do, since the agent may not have
        // subscribed yet.
        let mut unconfirmed: Vec<usize> = (0..session.devices.len()).collect();
        while !unconfirmed.is_empty() {
            for &slot in &unconfirmed {
                session.send(slot).await?;
            }
            let resend = Instant::now() + Duration::from_secs(1);
            while !unconfirmed.is_empty()
                && let Ok(polled) = tokio::time::timeout_at(resend.into(), session.poll()).await
            {
                if let Some((slot, _)) = polled? {
                    unconfirmed.retain(|&s| s != slot);
                }
            }
        }
        Ok(session)
    }

    /// Sends device `slot`'s next event.
    async fn send(&mut self, slot: usize) -> anyhow::Result<()> {
        let id = self.next_id[slot];
        let event = DeviceEvent {
            id,
            boot: 0,
            warning: false,
            reason: "Reading".into(),
            message: format!("event {id}"),
        };
        self.sent[slot] = Instant::now();
        self.client
            .publish(
                topics::event(&self.node, &key(self.devices[slot])),
                QoS::AtLeastOnce,
                false,
                codec::encode(&event)?,
            )
            .await?;
        Ok(())
    }

    /// Polls the connection; returns the slot of a device whose
    /// outstanding event was confirmed, with its latency.
    async fn poll(&mut self) -> anyhow::Result<Option<(usize, Duration)>> {
        let Event::Incoming(Packet::Publish(publish)) = self.events.poll().await? else {
            return Ok(None);
        };
        let ack: EventAck = codec::decode(&publish.payload)?;
        let Some(&slot) = self.slots.get(publish.topic.as_str()) else {
            return Ok(None);
        };
        if ack.id < self.next_id[slot] {
            return Ok(None);
        }
        self.next_id[slot] = ack.id + 1;
        Ok(Some((slot, self.sent[slot].elapsed())))
    }

    async fn run(mut self, started: Instant, until: Duration) -> Tally {
        let mut latencies = Vec::new();
        for slot in 0..self.devices.len() {
            if self.send(slot).await.is_err() {
                return Tally::of(latencies, 1);
            }
        }
        while started.elapsed() < until {
            match self.poll().await {
                Ok(Some((slot, latency))) => {
                    latencies.push(latency);
                    if self.send(slot).await.is_err() {
                        return Tally::of(latencies, 1);
                    }
                }
                Ok(None) => {}
                Err(error) => {
                    eprintln!("a device connection failed: {error:#}");
                    return Tally::of(latencies, 1);
                }
            }
        }
        Tally::of(latencies, 0)
    }
}

/// CPU time of the agent's threads: every thread of this process but the
/// main one and the device clients', by thread id.
struct Cpu(HashMap<String, Duration>);

impl Cpu {
    fn now() -> anyhow::Result<Cpu> {
        let main = std::process::id().to_string();
        let mut threads = HashMap::new();
        for task in std::fs::read_dir("/proc/self/task")? {
            let task = task?;
            let tid = task.file_name().to_string_lossy().into_owned();
            let comm = std::fs::read_to_string(task.path().join("comm")).unwrap_or_default();
            if tid == main || CLIENT_THREADS.starts_with(comm.trim()) {
                continue;
            }
            // The first field: nanoseconds spent on a CPU.
            let on_cpu = std::fs::read_to_string(task.path().join("schedstat"))
                .ok()
                .and_then(|s| s.split_whitespace().next()?.parse().ok());
            if let Some(ns) = on_cpu {
                threads.insert(tid, Duration::from_nanos(ns));
            }
        }
        Ok(Cpu(threads))
    }

    /// The agent's CPU time since `self` (a thread that ended in between
    /// is not counted; the agent's threads live through a phase).
    fn since(self) -> anyhow::Result<Duration> {
        let now = Cpu::now()?;
        Ok(now
            .0
            .iter()
            .map(|(tid, t)| t.saturating_sub(self.0.get(tid).copied().unwrap_or_default()))
            .sum())
    }
}
