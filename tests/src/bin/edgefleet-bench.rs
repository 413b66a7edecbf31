//! `edgefleet-bench` (`make bench`): measures the whole system on this
//! machine and prints figures (it asserts nothing; see docs/benchmarks.md).
//!
//! 1. Propagation: a spec change of every Device, until the simulated device
//!    has applied it (p50/p99), next to the API server's own floor: until a
//!    watch sees the change.
//! 2. Report → status: from the device applying (and reporting at once)
//!    until a watch sees `status.appliedGeneration` move.
//! 3. Report storm: every device reporting every second; status writes per
//!    second against the budget, next to the reports per second a
//!    write-per-report controller would write; then whether every Device's
//!    status ends at its device's last report.

use std::collections::{BTreeMap, HashMap};
use std::path::{Path, PathBuf};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use anyhow::{Context, bail};
use clap::Parser;
use edgefleet_shared::api::Device;
use edgefleet_shared::now_unix_ms;
use edgefleet_tests::bench::{Report, wait_all_applied};
use edgefleet_tests::control_plane;
use edgefleet_tests::final_state::{matches_final, read_final_state};
use edgefleet_tests::process::{http_get, metric};
use edgefleet_tests::stack::{Stack, StackSpec};
use futures::StreamExt;
use kube::api::{Patch, PatchParams};
use kube::runtime::{WatchStreamExt, watcher};
use kube::{Api, ResourceExt};

#[derive(Debug, Parser)]
#[command(name = "edgefleet-bench", about = "Measure Edgefleet end to end")]
struct Cli {
    /// Simulated devices.
    #[arg(long, default_value_t = 1000)]
    devices: usize,
    /// Edge nodes (one agent each).
    #[arg(long, default_value_t = 3)]
    nodes: usize,
    /// Rounds of "change every Device's spec".
    #[arg(long, default_value_t = 3)]
    rounds: u32,
    /// How long the report storm lasts, in seconds.
    #[arg(long, default_value_t = 60)]
    storm_seconds: u64,
    /// The cloud's status write budget (writes per second).
    #[arg(long, default_value_t = 50)]
    status_writes_per_second: u32,
    /// Where logs, stores and results go.
    #[arg(long, default_value = "/tmp/edgefleet-bench")]
    dir: PathBuf,
}

const NAMESPACE: &str = "bench";
const PATIENCE: Duration = Duration::from_secs(300);

/// When the bench's watch first saw each (device, generation) and each
/// (device, appliedGeneration), in Unix ms.
#[derive(Default)]
struct Seen {
    generation: HashMap<(String, i64), i64>,
    applied: HashMap<(String, i64), i64>,
}

#[tokio::main]
async fn main() -> anyhow::Result<()> {
    let cli = Cli::parse();
    let mut out = Report::default();
    out.line(&format!(
        "edgefleet-bench: {} devices on {} agents, status budget {}/s, {} CPUs",
        cli.devices,
        cli.nodes,
        cli.status_writes_per_second,
        std::thread::available_parallelism().map_or(0, |n| n.get())
    ));
    let kubeconfig =
        tokio::task::spawn_blocking(|| control_plane().kubeconfig().to_owned()).await?;
    let client = control_plane().client().await;
    if cli.dir.exists() {
        std::fs::remove_dir_all(&cli.dir)?;
    }
    let spec = StackSpec {
        nodes: (1..=cli.nodes).map(|i| format!("edge-{i}")).collect(),
        namespace: NAMESPACE.into(),
        devices: cli.devices,
        mqtt_every: 0,
        status_writes_per_second: cli.status_writes_per_second,
        dir: cli.dir.clone(),
        namespaced_controller: true,
        cloud_args: Vec::new(),
        agent_args: Vec::new(),
        sync_through_proxy: false,
    };
    let mut stack = Stack::start(spec, &kubeconfig).await?;
    let devices: Api<Device> = Api::namespaced(client.clone(), NAMESPACE);
    let seen = Arc::new(Mutex::new(Seen::default()));
    tokio::spawn(watch_devices(devices.clone(), Arc::clone(&seen)));

    // Cold start: apply the fleet, start the devices, wait for Applied.
    let started = Instant::now();
    stack.apply_devices(&client).await?;
    let applied_log = cli.dir.join("applied.jsonl");
    stack.start_sim(&[
        "--report-interval=10s".into(),
        format!("--applied-log={}", applied_log.display()),
    ])?;
    wait_all_applied(&devices, cli.devices, "every Device Applied", PATIENCE).await?;
    out.line(&format!(
        "cold start: {} Devices created and Applied in {:.1} s",
        cli.devices,
        started.elapsed().as_secs_f64()
    ));

    // 1 and 2: spec changes.
    let mut propagation = Vec::new();
    let mut floor = Vec::new();
    let mut to_status = Vec::new();
    for round in 1..=cli.rounds {
        let sent = change_every_spec(&devices, round).await?;
        let wanted: BTreeMap<String, i64> =
            sent.iter().map(|(n, (g, _))| (n.clone(), *g)).collect();
        let applied_at = wait_applied_log(&applied_log, NAMESPACE, &wanted).await?;
        wait_all_applied(
            &devices,
            cli.devices,
            "status shows the new generation applied",
            PATIENCE,
        )
        .await?;
        let seen = seen.lock().expect("seen");
        for (name, (generation, t0)) in &sent {
            let key = (name.clone(), *generation);
            let applied = applied_at[name];
            propagation.push(applied - t0);
            if let Some(watched) = seen.generation.get(&key) {
                floor.push(watched - t0);
            }
            if let Some(status) = seen.applied.get(&key) {
                to_status.push(status - applied);
            }
        }
        out.line(&format!(
            "round {round}: {} spec changes applied",
            sent.len()
        ));
    }
    out.line(&format!(
        "spec change -> device has it:      {}",
        percentiles(&mut propagation)
    ));
    out.line(&format!(
        "  baseline, spec change -> watch:  {}  (the API server's own floor)",
        percentiles(&mut floor)
    ));
    out.line(&format!(
        "device report -> status visible:   {}",
        percentiles(&mut to_status)
    ));

    // 3: the storm.
    stack.stop_sim();
    let final_state = cli.dir.join("final.jsonl");
    let writes_before = cloud_metric(&stack, "edgefleet_cloud_status_writes_total").await?;
    let uplink_before = cloud_metric(&stack, "edgefleet_cloud_sync_uplink_entries_total").await?;
    stack.start_sim(&[
        "--report-interval=1s".into(),
        format!("--final-state={}", final_state.display()),
    ])?;
    // Rates per window, divided by the window's measured length (a sample
    // takes a little longer than the 1 s sleep).
    let mut per_second = Vec::new();
    let mut last = writes_before;
    let mut last_at = Instant::now();
    let storm_start = last_at;
    for _ in 0..cli.storm_seconds {
        tokio::time::sleep(Duration::from_secs(1)).await;
        let now = cloud_metric(&stack, "edgefleet_cloud_status_writes_total").await?;
        let at = Instant::now();
        per_second.push((now - last) / at.duration_since(last_at).as_secs_f64());
        (last, last_at) = (now, at);
    }
    let storm_length = storm_start.elapsed().as_secs_f64();
    let uplink =
        cloud_metric(&stack, "edgefleet_cloud_sync_uplink_entries_total").await? - uplink_before;
    let storm_end = Instant::now();
    if !stack.stop_sim() {
        bail!("the simulator did not stop cleanly; no final state to compare");
    }
    let writes = last - writes_before;
    let seconds = storm_length;
    let max = per_second.iter().copied().fold(0.0, f64::max);
    out.line(&format!(
        "storm ({} s, every device reporting every second):",
        cli.storm_seconds
    ));
    out.line(&format!(
        "  reports reaching the cloud:      {:.0}/s  (= status writes/s of a write-per-report controller)",
        uplink / seconds
    ));
    out.line(&format!(
        "  status writes:                   {:.1}/s mean, {max:.1}/s in the busiest 1 s window (budget {}/s)",
        writes / seconds,
        cli.status_writes_per_second
    ));

    // Convergence: every Device's status ends at its device's last report.
    let finals = read_final_state(&final_state)?;
    let mismatched = loop {
        let list = devices.list(&Default::default()).await?;
        let wrong: Vec<String> = list
            .items
            .iter()
            .filter(|d| !matches_final(d, &finals))
            .map(ResourceExt::name_any)
            .collect();
        if wrong.is_empty() || storm_end.elapsed() > PATIENCE {
            break wrong;
        }
        tokio::time::sleep(Duration::from_millis(500)).await;
    };
    if mismatched.is_empty() {
        out.line(&format!(
            "  converged: all {} Devices' status equals their device's last report, {:.1} s after the storm",
            finals.len(),
            storm_end.elapsed().as_secs_f64()
        ));
    } else {
        out.line(&format!(
            "  NOT converged after {} s: {} Devices differ (first: {:?})",
            PATIENCE.as_secs(),
            mismatched.len(),
            &mismatched[..mismatched.len().min(5)]
        ));
    }
    let (cloud, agents) = stack.memory();
    let mib = |b: Option<u64>| b.map_or("?".into(), |b| format!("{:.0} MiB", b as f64 / 1048576.0));
    out.line(&format!(
        "memory (RSS): cloud {}, agents {}",
        mib(cloud),
        agents.into_iter().map(mib).collect::<Vec<_>>().join(", ")
    ));
    stack.shutdown();
    std::fs::write(cli.dir.join("results.txt"), &out.text)?;
    Ok(())
}

/// Records when the watch first saw each generation and applied generation.
async fn watch_devices(api: Api<Device>, seen: Arc<Mutex<Seen>>) {
    let stream = watcher(api, watcher::Config::default())
        .default_backoff()
        .applied_objects();
    futures::pin_mut!(stream);
    while let Some(Ok(device)) = stream.next().await {
        let at = now_unix_ms();
        let name = device.name_any();
        let mut seen = seen.lock().expect("seen");
        if let Some(g) = device.metadata.generation {
            seen.generation.entry((name.clone(), g)).or_insert(at);
        }
        if let Some(a) = device.status.as_ref().and_then(|s| s.applied_generation) {
            seen.applied.entry((name, a)).or_insert(at);
        }
    }
}

/// Sets `spec.desired.bench = round` on every Device, 16 at a time.
/// Returns, per Device, the new generation and when the change was sent.
async fn change_every_spec(
    devices: &Api<Device>,
    round: u32,
) -> anyhow::Result<BTreeMap<String, (i64, i64)>> {
    let names: Vec<String> = devices
        .list(&Default::default())
        .await?
        .items
        .iter()
        .map(ResourceExt::name_any)
        .collect();
    let patch = serde_json::json!({ "spec": { "desired": { "bench": round } } });
    let results: Vec<anyhow::Result<(String, (i64, i64))>> = futures::stream::iter(names)
        .map(|name| {
            let (devices, patch) = (devices.clone(), patch.clone());
            async move {
                let sent = now_unix_ms();
                let device = devices
                    .patch(&name, &PatchParams::default(), &Patch::Merge(&patch))
                    .await
                    .with_context(|| format!("patch {name}"))?;
                Ok((name, (device.metadata.generation.unwrap_or_default(), sent)))
            }
        })
        .buffer_unordered(16)
        .collect()
        .await;
    results.into_iter().collect()
}

/// Waits until the applied log has every wanted (device, generation);
/// returns when each was applied (Unix ms).
async fn wait_applied_log(
    log: &Path,
    namespace: &str,
    wanted: &BTreeMap<String, i64>,
) -> anyhow::Result<HashMap<String, i64>> {
    let deadline = Instant::now() + PATIENCE;
    loop {
        let mut found = HashMap::new();
        for line in std::fs::read_to_string(log)?.lines() {
            let entry: serde_json::Value = serde_json::from_str(line)?;
            let device = entry["device"].as_str().unwrap_or_default();
            let Some(name) = device
                .strip_prefix(namespace)
                .and_then(|d| d.strip_prefix('/'))
            else {
                continue;
            };
            if wanted.get(name) == entry["generation"].as_i64().as_ref() {
                found.insert(name.to_owned(), entry["at_ms"].as_i64().unwrap_or_default());
            }
        }
        if found.len() == wanted.len() {
            return Ok(found);
        }
        if Instant::now() > deadline {
            bail!(
                "after {} s only {} of {} devices applied their change",
                PATIENCE.as_secs(),
                found.len(),
                wanted.len()
            );
        }
        tokio::time::sleep(Duration::from_millis(200)).await;
    }
}

async fn cloud_metric(stack: &Stack, sample: &str) -> anyhow::Result<f64> {
    let (_, body) = http_get(stack.cloud_metrics, "/metrics").await?;
    Ok(metric(&body, sample))
}

/// "p50 X ms, p99 Y ms, max Z ms (n=N)".
fn percentiles(samples: &mut [i64]) -> String {
    if samples.is_empty() {
        return "no samples".into();
    }
    samples.sort_unstable();
    let at =
        |p: f64| samples[((p * samples.len() as f64).ceil() as usize).clamp(1, samples.len()) - 1];
    format!(
        "p50 {} ms, p99 {} ms, max {} ms (n={})",
        at(0.50),
        at(0.99),
        samples[samples.len() - 1],
        samples.len()
    )
}
