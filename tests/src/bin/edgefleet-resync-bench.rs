//! `edgefleet-resync-bench` (`make bench-resync`): one agent with 1,000
//! devices is cut off from the cloud for "30 minutes" of traffic (compressed
//! in time), then reconnected. It prints (and asserts nothing; see
//! docs/benchmarks.md):
//!
//! - the agent's memory (RSS) and store size on disk while offline, next to
//!   the same figures before the cut;
//! - the time from the link coming back to the agent's reconnect, and from
//!   the reconnect to full convergence: every uplink entry queued while
//!   offline acknowledged by the cloud (durable in the API server) and every
//!   Device at its latest generation applied;
//! - the bytes on the sync connection during that resync, against a full
//!   resend measured in the same run: the same agent restarted on an empty
//!   store, which must be sent every Device and send every device's report;
//!   both as all the traffic until convergence and as the resync messages
//!   alone (without the reports devices made after the reconnect);
//! - the same after the controller is killed and restarted while the same
//!   Devices change again: the new controller asks for the agent's list.
//!
//! By default nothing is compressed: devices report every 10 s and the agent
//! is cut off for 30 minutes (`--offline-seconds` shortens it; the outbox
//! holds one entry per changed device however long the outage, so a shorter
//! one changes the reports processed offline, not what resync sends).
//! Compressing the report interval instead would also multiply the steady
//! load after reconnect, which is not what an outage does.
//! `--changed-percent` (10) of the devices drift and have their spec changed
//! while the link is down; the others are steady.

use std::path::{Path, PathBuf};
use std::time::{Duration, Instant};

use anyhow::{Context, bail};
use clap::Parser;
use edgefleet_shared::api::{Device, DevicePhase};
use edgefleet_tests::bench::{Report, wait_all_applied};
use edgefleet_tests::control_plane;
use edgefleet_tests::fault::ProxyStats;
use edgefleet_tests::process::{http_get, metric};
use edgefleet_tests::stack::{Stack, StackSpec};
use kube::Api;
use kube::api::{Patch, PatchParams};

#[derive(Debug, Parser)]
#[command(
    name = "edgefleet-resync-bench",
    about = "Measure an edge site's resync after an outage"
)]
struct Cli {
    /// Simulated devices, all on one agent.
    #[arg(long, default_value_t = 1000)]
    devices: usize,
    /// How often each device reports.
    #[arg(long, default_value_t = 10)]
    report_seconds: u64,
    /// How long the agent is cut off.
    #[arg(long, default_value_t = 1800)]
    offline_seconds: u64,
    /// Devices (percent) that drift and get a new spec while offline.
    #[arg(long, default_value_t = 10)]
    changed_percent: u8,
    /// The cloud's status write budget (writes per second).
    #[arg(long, default_value_t = 50)]
    status_writes_per_second: u32,
    /// Where logs, stores and results go.
    #[arg(long, default_value = "/tmp/edgefleet-resync-bench")]
    dir: PathBuf,
}

const NAMESPACE: &str = "resync-bench";
const NODE: &str = "edge-1";
const PATIENCE: Duration = Duration::from_secs(300);

#[tokio::main]
async fn main() -> anyhow::Result<()> {
    let cli = Cli::parse();
    let mut out = Report::default();
    out.line(&format!(
        "edgefleet-resync-bench: {} devices on 1 agent reporting every {} s, {} s offline ({} reports per device), {}% changed, status budget {}/s, {} CPUs",
        cli.devices,
        cli.report_seconds,
        cli.offline_seconds,
        cli.offline_seconds / cli.report_seconds.max(1),
        cli.changed_percent,
        cli.status_writes_per_second,
        std::thread::available_parallelism().map_or(0, |n| n.get())
    ));
    let kubeconfig =
        tokio::task::spawn_blocking(|| control_plane().kubeconfig().to_owned()).await?;
    let client = control_plane().client().await;
    if cli.dir.exists() {
        std::fs::remove_dir_all(&cli.dir)?;
    }
    std::fs::create_dir_all(&cli.dir)?;
    let spec = StackSpec {
        nodes: vec![NODE.to_owned()],
        namespace: NAMESPACE.into(),
        devices: cli.devices,
        mqtt_every: 0,
        status_writes_per_second: cli.status_writes_per_second,
        dir: cli.dir.clone(),
        namespaced_controller: true,
        cloud_args: vec![],
        agent_args: vec![],
        sync_through_proxy: true,
    };
    let mut stack = Stack::start(spec, &kubeconfig).await?;
    let devices: Api<Device> = Api::namespaced(client.clone(), NAMESPACE);
    stack.apply_devices(&client).await?;
    stack.start_sim(&[
        format!("--report-interval={}s", cli.report_seconds),
        format!("--changing-percent={}", cli.changed_percent),
    ])?;
    wait_all_applied(&devices, cli.devices, "cold start", PATIENCE).await?;
    // Let the first reports and their status writes settle.
    wait_outbox_acked(&stack, 0, "the first reports").await?;
    let (rss_online, disk_online) = agent_footprint(&stack);

    // Cut off. Meanwhile the changing devices drift and get a new spec.
    let proxy = stack.agents[0].proxy.as_ref().context("no proxy")?;
    proxy.cut();
    let cut_at = Instant::now();
    let changed: Vec<String> = (0..cli.devices)
        .filter(|i| i % 100 < usize::from(cli.changed_percent))
        .map(|i| format!("dev-{i:05}"))
        .collect();
    let patch = serde_json::json!({ "spec": { "desired": { "setpoint": 23.5 } } });
    for name in &changed {
        devices
            .patch(name, &PatchParams::default(), &Patch::Merge(&patch))
            .await
            .with_context(|| format!("patch {name}"))?;
    }
    let (mut rss_max, mut disk_max) = (0u64, 0u64);
    while cut_at.elapsed() < Duration::from_secs(cli.offline_seconds) {
        let (rss, disk) = agent_footprint(&stack);
        rss_max = rss_max.max(rss);
        disk_max = disk_max.max(disk);
        tokio::time::sleep(Duration::from_secs(2)).await;
    }
    let depth = agent_metric(&stack, "edgefleet_agent_outbox_depth").await?;
    let queued_up_to = agent_metric(&stack, "edgefleet_agent_uplink_last_seq").await? as u64;

    // Back: until everything queued offline is durable in the API server
    // and every Device applied its latest spec.
    let before = stack.agents[0].proxy.as_ref().context("no proxy")?.stats();
    let messages_before = MessageBytes::read(&stack).await?;
    stack.agents[0].proxy.as_ref().context("no proxy")?.heal();
    let healed_at = Instant::now();
    let reconnected_at = wait_reconnect(&stack, before).await?;
    wait_outbox_acked(&stack, queued_up_to, "the offline backlog").await?;
    wait_all_applied(&devices, cli.devices, "after reconnect", PATIENCE).await?;
    let converged_at = Instant::now();
    let resync = bytes_since(&stack, before);
    let resync_messages = MessageBytes::read(&stack).await?.minus(&messages_before);
    let online_at = wait_all_online(&devices).await?;

    // The controller killed (-9) while the same Devices change again: the
    // new one remembers nothing, so it asks the agent for its list.
    let messages_before_restart = MessageBytes::read(&stack).await?;
    let before_restart = stack.agents[0].proxy.as_ref().context("no proxy")?.stats();
    let patch_again = serde_json::json!({ "spec": { "desired": { "setpoint": 24.5 } } });
    let restart_started = Instant::now();
    stack
        .kill_and_restart_cloud_after(|| async {
            for name in &changed {
                if let Err(error) = devices
                    .patch(name, &PatchParams::default(), &Patch::Merge(&patch_again))
                    .await
                {
                    eprintln!("patch {name}: {error}");
                }
            }
        })
        .await?;
    let restart_reconnected_at = wait_reconnect(&stack, before_restart).await?;
    wait_all_applied(
        &devices,
        cli.devices,
        "after the controller restart",
        PATIENCE,
    )
    .await?;
    let restart_converged_at = Instant::now();
    let restart_messages = MessageBytes::read(&stack)
        .await?
        .minus(&messages_before_restart);

    // The same agent on an empty store: everything is sent again.
    let before_full = stack.agents[0].proxy.as_ref().context("no proxy")?.stats();
    let full_started = Instant::now();
    stack.restart_agent_with_empty_store(0).await?;
    wait_agent_holds(&stack, cli.devices).await?;
    // Every device's next report is new to the empty store.
    tokio::time::sleep(Duration::from_secs(cli.report_seconds + 1)).await;
    let last = agent_metric(&stack, "edgefleet_agent_uplink_last_seq").await? as u64;
    wait_outbox_acked(&stack, last, "the full resend").await?;
    let full = bytes_since(&stack, before_full);
    // The restarted agent's counters start at zero.
    let full_messages = MessageBytes::read(&stack).await?;
    let full_took = full_started.elapsed();
    stack.shutdown();

    let mib = |b: u64| format!("{:.1} MiB", b as f64 / 1048576.0);
    let kib = |b: u64| format!("{:.1} KiB", b as f64 / 1024.0);
    out.line(&format!(
        "offline: {} Devices changed in the cloud, {} devices drifting; outbox at reconnect {depth:.0} entries (up to seq {queued_up_to})",
        changed.len(),
        changed.len()
    ));
    out.line(&format!(
        "agent while offline: RSS max {} (online {}), store on disk max {} (online {})",
        mib(rss_max),
        mib(rss_online),
        mib(disk_max),
        mib(disk_online)
    ));
    out.line(&format!(
        "link back -> agent reconnected: {:.1} s (its retry backoff)",
        (reconnected_at - healed_at).as_secs_f64()
    ));
    out.line(&format!(
        "reconnect -> converged: {:.1} s (backlog durable in the API server, every Device applied its latest spec)",
        (converged_at - reconnected_at).as_secs_f64()
    ));
    out.line(&format!(
        "reconnect -> every Device Online again: {:.1} s (one status write per Device, at the budget, after the data)",
        (online_at - reconnected_at).as_secs_f64()
    ));
    out.line(&format!(
        "bytes on the sync connection from reconnect to convergence: {} up, {} down, {} total = {:.1}% of a full resend (an empty store until it holds every Device and every device reported: {} up, {} down, {} total, {:.1} s)",
        kib(resync.bytes_up),
        kib(resync.bytes_down),
        kib(resync.total()),
        100.0 * resync.total() as f64 / full.total().max(1) as f64,
        kib(full.bytes_up),
        kib(full.bytes_down),
        kib(full.total()),
        full_took.as_secs_f64()
    ));
    out.line(&format!(
        "resync bytes (protobuf: Hello, inventory, the difference sent down, the backlog sent up, acknowledgements): {} = {:.1}% of a full resend ({}: every Device sent down, every device's report sent up)",
        kib(resync_messages.resync() as u64),
        100.0 * resync_messages.resync() / full_messages.full_resend().max(1.0),
        kib(full_messages.full_resend() as u64),
    ));
    out.line(&format!(
        "  by message (protobuf bytes): resync {}",
        resync_messages.describe()
    ));
    out.line(&format!(
        "                               full resend {}",
        full_messages.describe()
    ));
    out.line(&format!(
        "controller killed and restarted, {} Devices changed meanwhile: agent reconnected {:.1} s after the kill, converged {:.1} s later; resync bytes {} = {:.1}% of a full resend",
        changed.len(),
        (restart_reconnected_at - restart_started).as_secs_f64(),
        (restart_converged_at - restart_reconnected_at).as_secs_f64(),
        kib(restart_messages.resync() as u64),
        100.0 * restart_messages.resync() / full_messages.full_resend().max(1.0),
    ));
    out.line(&format!(
        "  by message (protobuf bytes): {}",
        restart_messages.describe()
    ));
    std::fs::write(cli.dir.join("results.txt"), &out.text)?;
    Ok(())
}

/// The agent's `edgefleet_agent_sync_message_bytes_total` by kind.
struct MessageBytes(Vec<(&'static str, f64)>);

impl MessageBytes {
    const KINDS: [(&'static str, &'static str); 9] = [
        ("sent", "hello"),
        ("received", "inventory_request"),
        ("sent", "inventory"),
        ("received", "update"),
        ("sent", "ack"),
        ("sent", "uplink_backlog"),
        ("received", "uplink_ack"),
        ("sent", "uplink"),
        ("sent", "heartbeat"),
    ];

    fn get(&self, kind: &str) -> f64 {
        self.0
            .iter()
            .find(|(k, _)| *k == kind)
            .map_or(0.0, |(_, bytes)| *bytes)
    }

    /// What resynchronising costs: everything but the reports made after
    /// the reconnect (`uplink`), which go up with or without an outage, and
    /// heartbeats.
    fn resync(&self) -> f64 {
        self.0
            .iter()
            .filter(|(kind, _)| !matches!(*kind, "uplink" | "heartbeat"))
            .map(|(_, bytes)| bytes)
            .sum()
    }

    /// What a full resend costs: every Device down and every device's
    /// report up, with the messages around them (all but heartbeats).
    fn full_resend(&self) -> f64 {
        self.resync() + self.get("uplink")
    }

    async fn read(stack: &Stack) -> anyhow::Result<MessageBytes> {
        let (_, body) = http_get(stack.agents[0].metrics, "/metrics").await?;
        Ok(MessageBytes(
            Self::KINDS
                .iter()
                .map(|(direction, kind)| {
                    let sample = format!(
                        "edgefleet_agent_sync_message_bytes_total{{direction=\"{direction}\",message=\"{kind}\"}}"
                    );
                    (*kind, metric(&body, &sample))
                })
                .collect(),
        ))
    }

    fn minus(&self, before: &MessageBytes) -> MessageBytes {
        MessageBytes(
            self.0
                .iter()
                .zip(&before.0)
                .map(|((kind, now), (_, then))| (*kind, now - then))
                .collect(),
        )
    }

    fn describe(&self) -> String {
        self.0
            .iter()
            .map(|(kind, bytes)| format!("{kind} {:.1} KiB", bytes / 1024.0))
            .collect::<Vec<_>>()
            .join(", ")
    }
}

/// Bytes through the sync proxy.
struct Bytes {
    bytes_up: u64,
    bytes_down: u64,
}

impl Bytes {
    fn total(&self) -> u64 {
        self.bytes_up + self.bytes_down
    }
}

fn bytes_since(stack: &Stack, before: ProxyStats) -> Bytes {
    let now = stack.agents[0].proxy.as_ref().expect("proxy").stats();
    Bytes {
        bytes_up: now.bytes_up - before.bytes_up,
        bytes_down: now.bytes_down - before.bytes_down,
    }
}

/// The agent's RSS and its store's size on disk, in bytes.
fn agent_footprint(stack: &Stack) -> (u64, u64) {
    let (_, agents) = stack.memory();
    let rss = agents.first().copied().flatten().unwrap_or_default();
    (rss, dir_size(&stack.agent_data_dir(0)))
}

fn dir_size(dir: &Path) -> u64 {
    let Ok(entries) = std::fs::read_dir(dir) else {
        return 0;
    };
    entries
        .flatten()
        .map(|e| match e.metadata() {
            Ok(m) if m.is_dir() => dir_size(&e.path()),
            Ok(m) => m.len(),
            Err(_) => 0,
        })
        .sum()
}

async fn agent_metric(stack: &Stack, sample: &str) -> anyhow::Result<f64> {
    let (_, body) = http_get(stack.agents[0].metrics, "/metrics").await?;
    Ok(metric(&body, sample))
}

/// Waits until the proxy forwards a new connection to the cloud.
async fn wait_reconnect(stack: &Stack, before: ProxyStats) -> anyhow::Result<Instant> {
    let deadline = Instant::now() + PATIENCE;
    loop {
        let now = stack.agents[0].proxy.as_ref().expect("proxy").stats();
        if now.forwarded_connections > before.forwarded_connections {
            return Ok(Instant::now());
        }
        if Instant::now() > deadline {
            bail!("the agent did not reconnect");
        }
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
}

/// Waits until every outbox entry up to `seq` is acknowledged (the oldest
/// one left, if any, is newer).
async fn wait_outbox_acked(stack: &Stack, seq: u64, what: &str) -> anyhow::Result<()> {
    let deadline = Instant::now() + PATIENCE;
    loop {
        let oldest = agent_metric(stack, "edgefleet_agent_outbox_oldest_seq").await? as u64;
        if oldest == 0 || oldest > seq {
            return Ok(());
        }
        if Instant::now() > deadline {
            bail!("{what}: entry {oldest} still waits for the cloud");
        }
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
}

/// Waits until no Device shows its node unreachable.
async fn wait_all_online(devices: &Api<Device>) -> anyhow::Result<Instant> {
    let deadline = Instant::now() + PATIENCE;
    loop {
        let list = devices.list(&Default::default()).await?;
        let unreachable = list
            .items
            .iter()
            .filter(|d| {
                d.status
                    .as_ref()
                    .is_some_and(|s| s.phase == Some(DevicePhase::Unreachable))
            })
            .count();
        if unreachable == 0 {
            return Ok(Instant::now());
        }
        if Instant::now() > deadline {
            bail!("{unreachable} Devices still unreachable");
        }
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
}

async fn wait_agent_holds(stack: &Stack, count: usize) -> anyhow::Result<()> {
    let deadline = Instant::now() + PATIENCE;
    loop {
        if agent_metric(stack, "edgefleet_agent_devices").await.ok() == Some(count as f64) {
            return Ok(());
        }
        if Instant::now() > deadline {
            bail!("the agent never held all {count} devices again");
        }
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
}
