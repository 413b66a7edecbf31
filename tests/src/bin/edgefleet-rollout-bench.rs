//! `edgefleet-rollout-bench` (`make bench-rollout`): a firmware rollout over
//! a fleet of sites on this machine, with real processes, and its figures
//! (it asserts nothing; see docs/benchmarks.md):
//!
//! - wall time from creating the FleetRollout to `Complete`, next to the
//!   least time the same limits allow with the mean install time and no
//!   overhead at all;
//! - writes to Devices (all writers: the rollout's changes, status writes)
//!   per device updated, from a watch;
//! - the most devices unavailable at once in each site, from the timeline
//!   of every Device change (`rollout_timeline`), next to the site limit.

use std::collections::BTreeMap;
use std::path::PathBuf;
use std::time::{Duration, Instant};

use clap::Parser;
use edgefleet_shared::api::rollout::{FleetRollout, RolloutPhase};
use edgefleet_shared::api::{Device, EdgeNode};
use edgefleet_sim::firmware::parse_duration_range;
use edgefleet_tests::bench::{Report, wait_all_applied};
use edgefleet_tests::control_plane;
use edgefleet_tests::rollout_timeline::{Expectations, Recorder};
use edgefleet_tests::stack::{Stack, StackSpec};
use kube::api::{Patch, PatchParams, PostParams};
use kube::{Api, ResourceExt};
use serde_json::json;

#[derive(Debug, Parser)]
#[command(
    name = "edgefleet-rollout-bench",
    about = "Measure a fleet rollout end to end"
)]
struct Cli {
    /// Simulated devices.
    #[arg(long, default_value_t = 1000)]
    devices: usize,
    /// Sites (one edge node and agent each).
    #[arg(long, default_value_t = 10)]
    sites: usize,
    /// Devices being updated at once per site, as a percentage of the site.
    #[arg(long, default_value_t = 10)]
    site_percent: u32,
    /// How long an install takes (`MIN..MAX`, drawn per device).
    #[arg(long, default_value = "5s..20s", value_parser = parse_duration_range)]
    install_time: (Duration, Duration),
    /// The cloud's status write budget (writes per second).
    #[arg(long, default_value_t = 50)]
    status_writes_per_second: u32,
    /// Where logs, stores and results go.
    #[arg(long, default_value = "/tmp/edgefleet-rollout-bench")]
    dir: PathBuf,
}

const NAMESPACE: &str = "rollout-bench";
const SITE: &str = "edgefleet.io/site";
const PATIENCE: Duration = Duration::from_secs(300);

#[tokio::main]
async fn main() -> anyhow::Result<()> {
    let cli = Cli::parse();
    let mut out = Report::default();
    let (min, max) = cli.install_time;
    out.line(&format!(
        "edgefleet-rollout-bench: {} devices over {} sites, {}% per site at once, installs {:?}..{:?}, {} CPUs",
        cli.devices,
        cli.sites,
        cli.site_percent,
        min,
        max,
        std::thread::available_parallelism().map_or(0, |n| n.get())
    ));
    let kubeconfig =
        tokio::task::spawn_blocking(|| control_plane().kubeconfig().to_owned()).await?;
    let client = control_plane().client().await;
    if cli.dir.exists() {
        std::fs::remove_dir_all(&cli.dir)?;
    }
    let nodes: Vec<String> = (0..cli.sites).map(|i| format!("site-{i}")).collect();
    let spec = StackSpec {
        nodes: nodes.clone(),
        namespace: NAMESPACE.into(),
        devices: cli.devices,
        mqtt_every: 4,
        status_writes_per_second: cli.status_writes_per_second,
        dir: cli.dir.clone(),
        namespaced_controller: true,
        cloud_args: Vec::new(),
        agent_args: Vec::new(),
        sync_through_proxy: false,
    };
    let mut stack = Stack::start(spec, &kubeconfig).await?;
    let devices: Api<Device> = Api::namespaced(client.clone(), NAMESPACE);
    stack.apply_devices(&client).await?;
    // Steady readings: a report changes status only when the rollout
    // changed something, so the writes counted are the rollout's.
    stack.start_sim(&[
        "--report-interval=30s".into(),
        "--changing-percent=0".into(),
        format!(
            "--install-time={}s..{}s",
            min.as_secs_f64(),
            max.as_secs_f64()
        ),
    ])?;
    wait_all_applied(&devices, cli.devices, "every Device Applied", PATIENCE).await?;
    let edge_nodes: Api<EdgeNode> = Api::all(client.clone());
    for node in &nodes {
        let labels = json!({ "metadata": { "labels": { SITE: node } } });
        edge_nodes
            .patch(node, &PatchParams::default(), &Patch::Merge(&labels))
            .await?;
    }
    let listed = devices.list(&Default::default()).await?;
    let site_of: BTreeMap<String, String> = listed
        .items
        .iter()
        .map(|d| (d.name_any(), d.spec.node.clone()))
        .collect();

    let rollout: FleetRollout = serde_json::from_value(json!({
        "apiVersion": "edgefleet.io/v1alpha1",
        "kind": "FleetRollout",
        "metadata": { "name": "fw-2", "namespace": NAMESPACE },
        "spec": {
            "target": { "firmware": { "version": "2.0.0" } },
            "selector": {},
            "strategy": {
                "canary": "1%",
                "waves": ["10%", "50%"],
                "maxUnavailable": "100%",
                "failureDomain": {
                    "topologyKey": SITE,
                    "maxUnavailable": format!("{}%", cli.site_percent),
                    "canary": 1,
                },
            },
        },
    }))?;
    let rollouts: Api<FleetRollout> = Api::namespaced(client.clone(), NAMESPACE);
    let started = Instant::now();
    let created = rollouts.create(&PostParams::default(), &rollout).await?;
    let expect = Expectations::plan(&created, &site_of);
    let recorder = Recorder::start(devices.clone(), created.clone(), expect.clone());
    let mut last_line = Instant::now();
    loop {
        let r = rollouts.get("fw-2").await?;
        let status = r.status.unwrap_or_default();
        if last_line.elapsed() >= Duration::from_secs(10) {
            let c = &status.counts;
            eprintln!(
                "  {:>4.0} s: {} ({}) updated {}/{}, updating {}, failed {}",
                started.elapsed().as_secs_f64(),
                status.phase.map(|p| format!("{p:?}")).unwrap_or_default(),
                status.wave.unwrap_or_default(),
                c.succeeded,
                c.total,
                c.updating + c.baking,
                c.failed
            );
            last_line = Instant::now();
        }
        if status.phase == Some(RolloutPhase::Complete) {
            break;
        }
        anyhow::ensure!(
            started.elapsed() < Duration::from_secs(1800),
            "the rollout did not complete in 30 minutes"
        );
        tokio::time::sleep(Duration::from_millis(200)).await;
    }
    let wall = started.elapsed().as_secs_f64();
    let timeline = recorder.finish();

    // What a schedule without any overhead takes with these limits: each
    // stage waits for the one before it, and in each stage a site updates
    // `limit` devices at a time; so the stage takes as many install times as
    // its busiest site needs rounds. Every install the mean gives the lower
    // figure, every install the longest the upper one.
    let per_site = cli.devices.div_ceil(cli.sites);
    let limit = ((per_site as u32 * cli.site_percent) / 100).max(1) as usize;
    let mut in_stage: BTreeMap<(usize, &str), usize> = BTreeMap::new();
    for (name, stage) in &expect.stage {
        *in_stage
            .entry((*stage, expect.site[name].as_str()))
            .or_default() += 1;
    }
    let mut busiest: BTreeMap<usize, usize> = BTreeMap::new();
    for ((stage, _), n) in &in_stage {
        let rounds = busiest.entry(*stage).or_default();
        *rounds = (*rounds).max(n.div_ceil(limit));
    }
    let rounds: usize = busiest.values().sum();
    let mean = (min.as_secs_f64() + max.as_secs_f64()) / 2.0;
    let (least, most) = (mean * rounds as f64, max.as_secs_f64() * rounds as f64);
    out.line(&format!(
        "rollout wall time: {wall:.1} s; a schedule without overhead: {least:.1} s (every install {mean:.1} s) to {most:.1} s (every install {:.1} s): {rounds} install times (rounds per stage {:?}, {limit} per site at once); {:.2}x the lower figure",
        max.as_secs_f64(),
        busiest.values().collect::<Vec<_>>(),
        wall / least
    ));
    out.line(&format!(
        "writes to Devices during the rollout: {} ({:.1} per device updated; all writers, devices with steady readings)",
        timeline.moments,
        timeline.moments as f64 / cli.devices as f64
    ));
    let highest = timeline
        .max_unavailable_by_site
        .values()
        .max()
        .copied()
        .unwrap_or(0);
    out.line(&format!(
        "most devices unavailable at once per site: {highest} (limit {limit}); by site {:?}; overall {}",
        timeline.max_unavailable_by_site, timeline.max_unavailable
    ));
    out.line(&format!(
        "order violations: {}; devices changed twice: {}",
        timeline.violations.len(),
        timeline.changed_twice.len()
    ));
    std::fs::write(cli.dir.join("results.txt"), &out.text)?;
    stack.shutdown();
    Ok(())
}
