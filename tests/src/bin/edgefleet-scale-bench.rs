//! `edgefleet-scale-bench` (`make bench-scale`): what the controller costs
//! as the fleet grows. For each size (Devices on nodes, say 10000:100) it
//! creates the Devices in a namespace of their own, runs the controller as
//! a process (release build) against the local API server, connects one
//! hollow agent per node ([`edgefleet_tests::hollow`]: real gRPC
//! connections, the agent's own session core, holdings in memory) and
//! prints (asserting nothing; see docs/benchmarks.md):
//!
//! - the controller's RSS with no Devices (the baseline, same run), with the
//!   Devices listed and reconciled, and with every agent connected and
//!   holding its slice: KiB per Device and per connected agent;
//! - a fleet-wide desired change (every Device's spec patched): from each
//!   patch to its agent holding the new generation, p50/p99, next to the
//!   API server's own floor in the same run (until a watch sees the patch);
//! - a controller restart (`kill -9`) with every agent connected: time
//!   until every agent has opened a new session and holds what it should,
//!   and how many the controller asked for a full inventory;
//! - with `--failover` (3 replicas sharing the fleet through shard Leases,
//!   behind a round-robin forwarder standing in for the Service): the
//!   `kill -9` of a replica, then of the leader, and the time until its
//!   shards are taken over and until every agent has re-homed.

use std::collections::HashMap;
use std::net::SocketAddr;
use std::path::{Path, PathBuf};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use anyhow::{Context, bail};
use clap::Parser;
use edgefleet_shared::api::{Device, DeviceSpec, Transport};
use edgefleet_shared::heartbeat::Heartbeat;
use edgefleet_shared::{PropertyValue, ResourceKey, now_unix_ms};
use edgefleet_tests::bench::{Report, quantiles};
use edgefleet_tests::control_plane;
use edgefleet_tests::hollow::HollowFleet;
use edgefleet_tests::process::{Process, free_tcp_addr, http_get, metric};
use edgefleet_tests::stack::ensure_namespace;
use futures::{StreamExt, TryStreamExt};
use kube::api::{DeleteParams, Patch, PatchParams, PostParams};
use kube::runtime::{WatchStreamExt, watcher};
use kube::{Api, Client, ResourceExt};

#[derive(Debug, Parser)]
#[command(
    name = "edgefleet-scale-bench",
    about = "Measure the controller as the fleet grows"
)]
struct Cli {
    /// Sizes to measure, as DEVICES:NODES, comma-separated (none if empty).
    #[arg(long, default_value = "1000:10,10000:100,100000:1000")]
    sizes: String,
    /// The controller's status write budget (writes per second).
    #[arg(long, default_value_t = 500)]
    status_writes_per_second: u32,
    /// API requests the bench makes at once (creates, patches).
    #[arg(long, default_value_t = 32)]
    concurrency: usize,
    /// Where logs and results go.
    #[arg(long, default_value = "/tmp/edgefleet-scale-bench")]
    dir: PathBuf,
    /// The failover phase's fleet, as DEVICES:NODES (none if empty).
    #[arg(long, default_value = "1000:100")]
    failover: String,
    /// Replicas in the failover phase.
    #[arg(long, default_value_t = 3)]
    replicas: usize,
    /// Their shard Leases' duration (seconds; the Deployment's is 15).
    #[arg(long, default_value_t = 15)]
    lease_seconds: u64,
}

/// Shards in the failover phase (the Deployment's number).
const SHARDS: u32 = 12;

/// How long any one phase may take before the bench gives up on it.
const PATIENCE: Duration = Duration::from_secs(1800);

/// The hollow agents' heartbeat (the controller's default).
const HEARTBEAT: Heartbeat = Heartbeat::DEFAULT;

#[derive(Clone, Copy, Debug)]
struct Size {
    devices: usize,
    nodes: usize,
}

fn sizes(text: &str) -> anyhow::Result<Vec<Size>> {
    text.split(',')
        .map(|size| {
            let (devices, nodes) = size
                .split_once(':')
                .with_context(|| format!("{size}: not DEVICES:NODES"))?;
            Ok(Size {
                devices: devices.trim().parse()?,
                nodes: nodes.trim().parse()?,
            })
        })
        .collect()
}

/// The controller as a process.
struct Cloud {
    process: Process,
    sync: SocketAddr,
    metrics: SocketAddr,
}

impl Cloud {
    /// Starts the controller on new ports.
    async fn start(
        namespace: &str,
        cli: &Cli,
        kubeconfig: &Path,
        log: &Path,
    ) -> anyhow::Result<Cloud> {
        Self::start_at(
            (free_tcp_addr(), free_tcp_addr()),
            namespace,
            cli,
            kubeconfig,
            log,
            &[],
        )
        .await
    }

    /// Starts the controller on the given sync and metrics addresses (a
    /// restart: the agents reconnect to the address they know).
    async fn start_at(
        (sync, metrics): (SocketAddr, SocketAddr),
        namespace: &str,
        cli: &Cli,
        kubeconfig: &Path,
        log: &Path,
        extra: &[String],
    ) -> anyhow::Result<Cloud> {
        let mut args = vec![
            "run".into(),
            format!("--sync-addr={sync}"),
            format!("--metrics-addr={metrics}"),
            format!("--namespace={namespace}"),
            format!(
                "--status-writes-per-second={}",
                cli.status_writes_per_second
            ),
            // Every hollow agent comes from 127.0.0.1 and names its node
            // (identity costs are edgefleet-auth-bench's subject).
            "--max-per-address=100000".into(),
            "--insecure-plaintext".into(),
            "--insecure-unauthenticated-agents".into(),
        ];
        args.extend(extra.iter().cloned());
        let env = [("KUBECONFIG", kubeconfig.display().to_string())];
        let process = Process::start_logged("edgefleet-cloud", &args, &env, Some(log))?;
        let cloud = Cloud {
            process,
            sync,
            metrics,
        };
        let deadline = Instant::now() + PATIENCE;
        while !matches!(http_get(metrics, "/readyz").await, Ok((200, _))) {
            anyhow::ensure!(Instant::now() < deadline, "the controller is not ready");
            tokio::time::sleep(Duration::from_millis(100)).await;
        }
        Ok(cloud)
    }

    fn url(&self) -> String {
        format!("http://{}", self.sync)
    }

    async fn metric(&self, sample: &str) -> f64 {
        let (_, body) = http_get(self.metrics, "/metrics").await.unwrap_or_default();
        metric(&body, sample)
    }

    fn rss(&self) -> u64 {
        self.process.rss_bytes().unwrap_or(0)
    }

    /// CPU seconds the process has used (user + system).
    fn cpu_seconds(&self) -> f64 {
        let stat = std::fs::read_to_string(format!("/proc/{}/stat", self.process.pid()))
            .unwrap_or_default();
        // Fields after the command name (which may hold spaces): utime and
        // stime are the 14th and 15th of the line.
        let after = stat.rsplit_once(')').map_or("", |(_, rest)| rest);
        let fields: Vec<&str> = after.split_whitespace().collect();
        let ticks = |i: usize| fields.get(i).and_then(|f| f.parse::<f64>().ok());
        (ticks(11).unwrap_or(0.0) + ticks(12).unwrap_or(0.0)) / 100.0
    }

    /// Waits until the status writer's backlog is empty and the process
    /// is idle (under 5 % of a core for 3 s): the state to measure memory
    /// in. Returns how long that took.
    async fn settle(&self, what: &str) -> anyhow::Result<Duration> {
        let started = Instant::now();
        let mut quiet = 0;
        let mut cpu = self.cpu_seconds();
        loop {
            tokio::time::sleep(Duration::from_secs(1)).await;
            let now = self.cpu_seconds();
            let backlog = self.metric("edgefleet_cloud_status_backlog").await;
            quiet = match backlog == 0.0 && now - cpu < 0.05 {
                true => quiet + 1,
                false => 0,
            };
            cpu = now;
            if quiet >= 3 {
                return Ok(started.elapsed());
            }
            if started.elapsed() > PATIENCE {
                bail!("{what}: the controller did not settle (status backlog {backlog})");
            }
        }
    }
}

fn kib(bytes: f64) -> String {
    format!("{:.1} KiB", bytes / 1024.0)
}

fn mib(bytes: u64) -> String {
    format!("{:.1} MiB", bytes as f64 / 1048576.0)
}

fn node_name(i: usize) -> String {
    format!("edge-{i:04}")
}

fn spec(node: String, level: i64) -> DeviceSpec {
    DeviceSpec {
        node,
        model: "thermostat".into(),
        transport: Transport::Coap,
        desired: [("setpoint".to_owned(), PropertyValue::Int(level))].into(),
        firmware: None,
        retry: 0,
    }
}

/// Creates `size.devices` Devices spread evenly over the nodes, with a
/// progress line every tenth.
async fn create_devices(
    api: &Api<Device>,
    size: Size,
    concurrency: usize,
    out: &mut Report,
) -> anyhow::Result<Duration> {
    let started = Instant::now();
    let done = Arc::new(std::sync::atomic::AtomicUsize::new(0));
    let tenth = (size.devices / 10).max(1);
    futures::stream::iter(0..size.devices)
        .map(|i| {
            let (api, done) = (api.clone(), Arc::clone(&done));
            async move {
                let device = Device::new(&format!("d-{i:06}"), spec(node_name(i % size.nodes), 0));
                match api.create(&PostParams::default(), &device).await {
                    Ok(_) => {}
                    Err(kube::Error::Api(status)) if status.code == 409 => {}
                    Err(e) => return Err(anyhow::Error::from(e)),
                }
                let n = done.fetch_add(1, std::sync::atomic::Ordering::Relaxed) + 1;
                if n % tenth == 0 {
                    println!(
                        "  created {n}/{} Devices ({:.0} s)",
                        size.devices,
                        started.elapsed().as_secs_f64()
                    );
                }
                Ok(())
            }
        })
        .buffer_unordered(concurrency)
        .try_collect::<Vec<()>>()
        .await?;
    out.line(&format!(
        "  {} Devices created in {:.1} s ({:.0}/s)",
        size.devices,
        started.elapsed().as_secs_f64(),
        size.devices as f64 / started.elapsed().as_secs_f64()
    ));
    Ok(started.elapsed())
}

/// Patches every Device's desired state to `level`; when each patch
/// returned (Unix ms), by Device, with the generation it made.
async fn change_every_spec(
    api: &Api<Device>,
    size: Size,
    level: i64,
    concurrency: usize,
) -> anyhow::Result<HashMap<String, (i64, i64)>> {
    let patch = serde_json::json!({ "spec": { "desired": { "setpoint": level } } });
    let done: Vec<(String, (i64, i64))> = futures::stream::iter(0..size.devices)
        .map(|i| {
            let (api, patch) = (api.clone(), patch.clone());
            async move {
                let name = format!("d-{i:06}");
                let sent = now_unix_ms();
                let patched = api
                    .patch(&name, &PatchParams::default(), &Patch::Merge(&patch))
                    .await?;
                let generation = patched.metadata.generation.unwrap_or_default();
                Ok::<_, anyhow::Error>((name, (generation, sent)))
            }
        })
        .buffer_unordered(concurrency)
        .try_collect()
        .await?;
    Ok(done.into_iter().collect())
}

/// Records when a watch of its own first saw each (Device, generation).
fn watch_generations(api: Api<Device>) -> Arc<Mutex<HashMap<(String, i64), i64>>> {
    let seen = Arc::new(Mutex::new(HashMap::new()));
    let into = Arc::clone(&seen);
    tokio::spawn(async move {
        let stream = watcher(api, watcher::Config::default())
            .default_backoff()
            .applied_objects();
        futures::pin_mut!(stream);
        while let Some(Ok(device)) = stream.next().await {
            let at = now_unix_ms();
            if let Some(generation) = device.metadata.generation {
                into.lock()
                    .expect("seen")
                    .entry((device.name_any(), generation))
                    .or_insert(at);
            }
        }
    });
    seen
}

/// Waits until `check` holds, polling every 200 ms; how long it took.
async fn wait_for(what: &str, mut check: impl FnMut() -> bool) -> anyhow::Result<Duration> {
    let started = Instant::now();
    while !check() {
        if started.elapsed() > PATIENCE {
            bail!("{what}: not within {} s", PATIENCE.as_secs());
        }
        tokio::time::sleep(Duration::from_millis(200)).await;
    }
    Ok(started.elapsed())
}

/// One row of the summary table.
struct Row {
    size: Size,
    baseline: u64,
    with_devices: u64,
    with_agents: u64,
    delivery: String,
    floor: String,
    resync: Duration,
    inventories: u64,
}

async fn measure(
    size: Size,
    cli: &Cli,
    client: &Client,
    kubeconfig: &Path,
    baseline: u64,
    out: &mut Report,
) -> anyhow::Result<Row> {
    let namespace = format!("scale-{}", size.devices);
    out.line(&format!(
        "size: {} Devices on {} nodes (namespace {namespace})",
        size.devices, size.nodes
    ));
    ensure_namespace(client, &namespace).await?;
    let api: Api<Device> = Api::namespaced(client.clone(), &namespace);
    create_devices(&api, size, cli.concurrency, out).await?;

    let log = cli.dir.join(format!("cloud-{}.log", size.devices));
    let started = Instant::now();
    let mut cloud = Cloud::start(&namespace, cli, kubeconfig, &log).await?;
    out.line(&format!(
        "  controller ready (first list in) after {:.1} s",
        started.elapsed().as_secs_f64()
    ));
    let settled = cloud.settle("Devices reconciled").await?;
    let with_devices = cloud.rss();
    out.line(&format!(
        "  reconciled and idle after {:.1} s more: RSS {} = {} per Device over the baseline",
        settled.as_secs_f64(),
        mib(with_devices),
        kib((with_devices as f64 - baseline as f64) / size.devices as f64)
    ));

    let nodes: Vec<String> = (0..size.nodes).map(node_name).collect();
    let fleet = HollowFleet::start(&cloud.url(), &nodes, HEARTBEAT);
    let served = wait_for("every agent holds its slice", || {
        fleet.open() == size.nodes && fleet.held() == size.devices
    })
    .await?;
    out.line(&format!(
        "  {} agents connected and holding all {} Devices after {:.1} s ({} inventories asked for)",
        size.nodes,
        size.devices,
        served.as_secs_f64(),
        fleet.counters().inventories()
    ));
    cloud.settle("deliveries recorded").await?;
    let with_agents = cloud.rss();
    out.line(&format!(
        "  RSS with every agent connected {} = {} per agent",
        mib(with_agents),
        kib((with_agents as f64 - with_devices as f64) / size.nodes as f64)
    ));

    // A fleet-wide desired change.
    let seen = watch_generations(api.clone());
    let started = Instant::now();
    let sent = change_every_spec(&api, size, 1, cli.concurrency).await?;
    let patched = started.elapsed();
    let generation = sent.values().map(|(g, _)| *g).min().unwrap_or(2);
    wait_for("every agent holds the change", || {
        fleet.held_at(generation) == size.devices
    })
    .await?;
    let arrivals = fleet.arrivals();
    let seen = seen.lock().expect("seen").clone();
    let (mut delivery, mut floor) = (Vec::new(), Vec::new());
    for (name, (generation, sent_at)) in &sent {
        let key = (ResourceKey::device(&namespace, name), *generation);
        if let Some(at) = arrivals.get(&key) {
            delivery.push(Duration::from_millis((at - sent_at).max(0) as u64));
        }
        if let Some(at) = seen.get(&(name.clone(), *generation)) {
            floor.push(Duration::from_millis((at - sent_at).max(0) as u64));
        }
    }
    let delivery = quantiles(&mut delivery);
    let floor = quantiles(&mut floor);
    out.line(&format!(
        "  fleet-wide change ({} patches in {:.1} s):",
        size.devices,
        patched.as_secs_f64()
    ));
    out.line(&format!("    patch -> agent holds it:  {delivery}"));
    out.line(&format!(
        "    baseline, patch -> watch: {floor}  (the API server's own floor)"
    ));

    // A controller restart with every agent connected.
    cloud.settle("the change recorded").await?;
    let inventories_before = fleet.counters().inventories();
    let sessions_before = fleet.counters().sessions();
    cloud.process.kill();
    let started = Instant::now();
    let log = cli.dir.join(format!("cloud-{}-restart.log", size.devices));
    let addresses = (cloud.sync, cloud.metrics);
    drop(cloud);
    cloud = Cloud::start_at(addresses, &namespace, cli, kubeconfig, &log, &[]).await?;
    wait_for("every agent resynced", || {
        fleet.counters().sessions() >= sessions_before + size.nodes as u64
            && fleet.open() == size.nodes
            && fleet.held_at(generation) == size.devices
    })
    .await?;
    let resync = started.elapsed();
    let inventories = fleet.counters().inventories() - inventories_before;
    let hellos =
        |outcome: &str| format!("edgefleet_cloud_sync_hellos_total{{outcome=\"{outcome}\"}}");
    out.line(&format!(
        "  controller kill -9 and restart: every agent resynced {:.1} s after the kill; {inventories} full inventories (Hellos: {} recovered, {} remembered, {} inventory)",
        resync.as_secs_f64(),
        cloud.metric(&hellos("recovered")).await,
        cloud.metric(&hellos("remembered")).await,
        cloud.metric(&hellos("inventory")).await,
    ));
    if let Some(error) = fleet.counters().last_error() {
        out.line(&format!(
            "  ({} hollow sessions ended by an error; the last: {error})",
            fleet.counters().session_errors()
        ));
    }
    fleet.stop().await;
    drop(cloud);
    // The namespace goes with its Devices (their finalizer's controller is
    // gone, so they are let go first).
    strip_finalizers(&api, size).await;
    let namespaces: Api<k8s_openapi::api::core::v1::Namespace> = Api::all(client.clone());
    let _ = namespaces
        .delete(&namespace, &DeleteParams::default())
        .await;
    Ok(Row {
        size,
        baseline,
        with_devices,
        with_agents,
        delivery,
        floor,
        resync,
        inventories,
    })
}

/// Removes the controller's finalizer from every Device, so deleting the
/// namespace does not wait for a controller that is no longer running.
async fn strip_finalizers(api: &Api<Device>, size: Size) {
    let patch = serde_json::json!({ "metadata": { "finalizers": null } });
    futures::stream::iter(0..size.devices)
        .map(|i| {
            let (api, patch) = (api.clone(), patch.clone());
            async move {
                let _ = api
                    .patch(
                        &format!("d-{i:06}"),
                        &PatchParams::default(),
                        &Patch::Merge(&patch),
                    )
                    .await;
            }
        })
        .buffer_unordered(32)
        .collect::<Vec<()>>()
        .await;
}

#[tokio::main]
async fn main() -> anyhow::Result<()> {
    let cli = Cli::parse();
    let sizes = match cli.sizes.is_empty() {
        true => Vec::new(),
        false => sizes(&cli.sizes)?,
    };
    let failovers = match cli.failover.is_empty() {
        true => Vec::new(),
        false => self::sizes(&cli.failover)?,
    };
    std::fs::create_dir_all(&cli.dir)?;
    let mut out = Report::default();
    out.line(&format!(
        "edgefleet-scale-bench: sizes {}, status budget {}/s, {} CPUs",
        cli.sizes,
        cli.status_writes_per_second,
        std::thread::available_parallelism().map_or(0, |n| n.get())
    ));
    let kubeconfig =
        tokio::task::spawn_blocking(|| control_plane().kubeconfig().to_owned()).await?;
    let client = control_plane().client().await;

    // The baseline: the controller with no Devices and no agents.
    ensure_namespace(&client, "scale-empty").await?;
    let cloud = Cloud::start(
        "scale-empty",
        &cli,
        &kubeconfig,
        &cli.dir.join("cloud-empty.log"),
    )
    .await?;
    cloud.settle("the empty controller").await?;
    let baseline = cloud.rss();
    drop(cloud);
    out.line(&format!(
        "baseline: the controller with no Devices and no agents, RSS {}",
        mib(baseline)
    ));

    let mut rows = Vec::new();
    for size in sizes {
        rows.push(measure(size, &cli, &client, &kubeconfig, baseline, &mut out).await?);
    }
    out.line("");
    out.line(
        "| Devices | nodes | RSS: Devices listed | per Device | RSS: agents connected | per agent | change -> agent holds it | API watch floor | restart: all resynced | full inventories |",
    );
    out.line("|---|---|---|---|---|---|---|---|---|---|");
    for row in &rows {
        out.line(&format!(
            "| {} | {} | {} | {} | {} | {} | {} | {} | {:.1} s | {} |",
            row.size.devices,
            row.size.nodes,
            mib(row.with_devices),
            kib((row.with_devices as f64 - row.baseline as f64) / row.size.devices as f64),
            mib(row.with_agents),
            kib((row.with_agents as f64 - row.with_devices as f64) / row.size.nodes as f64),
            row.delivery,
            row.floor,
            row.resync.as_secs_f64(),
            row.inventories,
        ));
    }
    for size in failovers {
        failover(size, &cli, &client, &kubeconfig, &mut out).await?;
    }
    std::fs::write(cli.dir.join("results.txt"), &out.text)?;
    Ok(())
}

/// Shards the live replicas of `clouds` hold together.
async fn shards_held(clouds: &[Option<Cloud>]) -> f64 {
    let mut held = 0.0;
    for cloud in clouds.iter().flatten() {
        held += cloud.metric("edgefleet_cloud_leases_shards_held").await;
    }
    held
}

/// The failover phase: `cli.replicas` replicas, one hollow agent per node
/// through a round-robin forwarder; a replica killed, then the leader.
async fn failover(
    size: Size,
    cli: &Cli,
    client: &Client,
    kubeconfig: &Path,
    out: &mut Report,
) -> anyhow::Result<()> {
    let namespace = format!("scale-failover-{}", size.devices);
    out.line(&format!(
        "failover: {} Devices on {} nodes, {} replicas, {SHARDS} shards, Leases of {} s",
        size.devices, size.nodes, cli.replicas, cli.lease_seconds
    ));
    ensure_namespace(client, &namespace).await?;
    let api: Api<Device> = Api::namespaced(client.clone(), &namespace);
    create_devices(&api, size, cli.concurrency, out).await?;
    let mut clouds = Vec::new();
    for i in 0..cli.replicas {
        let (sync, metrics) = (free_tcp_addr(), free_tcp_addr());
        let extra = [
            format!("--shards={SHARDS}"),
            format!("--replica-id=replica-{i}"),
            format!("--advertise-url=http://{sync}"),
            format!("--lease-namespace={namespace}"),
            format!("--lease-duration-seconds={}", cli.lease_seconds),
        ];
        let log = cli.dir.join(format!("failover-replica-{i}.log"));
        clouds.push(Some(
            Cloud::start_at((sync, metrics), &namespace, cli, kubeconfig, &log, &extra).await?,
        ));
    }
    let started = Instant::now();
    while shards_held(&clouds).await < f64::from(SHARDS) {
        anyhow::ensure!(
            started.elapsed() < PATIENCE,
            "the shards were never all held"
        );
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    let service = edgefleet_tests::round_robin::RoundRobin::start(
        clouds.iter().flatten().map(|c| c.sync).collect(),
    )
    .await?;
    let nodes: Vec<String> = (0..size.nodes).map(node_name).collect();
    let fleet = HollowFleet::start(&format!("http://{}", service.addr()), &nodes, HEARTBEAT);
    let served = wait_for("every agent holds its slice", || {
        fleet.open() == size.nodes && fleet.held() == size.devices
    })
    .await?;
    out.line(&format!(
        "  every agent connected and holding its slice after {:.1} s ({} redirects followed)",
        served.as_secs_f64(),
        fleet.counters().redirects()
    ));
    let leases: Api<k8s_openapi::api::coordination::v1::Lease> =
        Api::namespaced(client.clone(), &namespace);
    for victim in ["a replica", "the leader (shard 0's holder)"] {
        // The replicas first settle on their shares (and their agents on
        // them).
        let share = f64::from(SHARDS.div_ceil(clouds.iter().flatten().count() as u32));
        let started = Instant::now();
        loop {
            let mut balanced = true;
            for cloud in clouds.iter().flatten() {
                balanced &= cloud.metric("edgefleet_cloud_leases_shards_held").await == share;
            }
            if balanced && fleet.open() == size.nodes {
                break;
            }
            anyhow::ensure!(started.elapsed() < PATIENCE, "the replicas never balanced");
            tokio::time::sleep(Duration::from_millis(200)).await;
        }
        out.line(&format!(
            "  {} replicas hold {share} shards each ({:.1} s), every agent connected",
            clouds.iter().flatten().count(),
            started.elapsed().as_secs_f64()
        ));
        let index = match victim {
            "a replica" => {
                // The one that serves the most agents.
                let mut most = (0, -1.0);
                for (i, cloud) in clouds.iter().enumerate() {
                    if let Some(cloud) = cloud {
                        let streams = cloud.metric("edgefleet_cloud_sync_streams").await;
                        if streams > most.1 {
                            most = (i, streams);
                        }
                    }
                }
                most.0
            }
            _ => {
                let lease = leases.get("edgefleet-shard-0").await?;
                let holder = lease
                    .spec
                    .and_then(|s| s.holder_identity)
                    .unwrap_or_default();
                holder
                    .strip_prefix("replica-")
                    .and_then(|i| i.parse().ok())
                    .context("shard 0 has no holder")?
            }
        };
        let cloud = clouds[index].take().context("the victim is alive")?;
        let streams = cloud.metric("edgefleet_cloud_sync_streams").await;
        let held = cloud.metric("edgefleet_cloud_leases_shards_held").await;
        let redirects = fleet.counters().redirects();
        let mut process = cloud.process;
        process.kill();
        let killed = Instant::now();
        while shards_held(&clouds).await < f64::from(SHARDS) {
            anyhow::ensure!(
                killed.elapsed() < PATIENCE,
                "the shards were never taken over"
            );
            tokio::time::sleep(Duration::from_millis(100)).await;
        }
        let taken = killed.elapsed();
        wait_for("every agent re-homed", || fleet.open() == size.nodes).await?;
        let rehomed = killed.elapsed();
        out.line(&format!(
            "  kill -9 of {victim} (replica-{index}: {streams} agents, {held} shards): its shards taken over after {:.1} s, every agent re-homed after {:.1} s ({} redirects followed)",
            taken.as_secs_f64(),
            rehomed.as_secs_f64(),
            fleet.counters().redirects() - redirects
        ));
    }
    fleet.stop().await;
    drop(clouds);
    strip_finalizers(&api, size).await;
    let namespaces: Api<k8s_openapi::api::core::v1::Namespace> = Api::all(client.clone());
    let _ = namespaces
        .delete(&namespace, &DeleteParams::default())
        .await;
    Ok(())
}
