//! `edgefleet-rules-bench` (`make bench-rules`): what EdgeRules cost and
//! how fast they act. It prints (and asserts nothing; see
//! docs/benchmarks.md):
//!
//! 1. **Evaluations.** The agent's rule engine in this process over a
//!    store on the real disk: `--rules` rules each watching every one of
//!    `--devices` devices, judged pass after pass on one thread; rule
//!    evaluations per second of that thread's CPU, and this process's
//!    resident memory before and after the rules and devices were loaded.
//! 2. **Report → action** against **the cloud round trip**, with the
//!    controller and one agent as processes on the real API server: a
//!    boiler (CoAP) reports over and under the rule's threshold and the
//!    time until the inlet valve (MQTT) is told is taken, `--cycles`
//!    times; then the same change of the valve made through the cloud
//!    (its Device's spec patched) and the time until the valve is told.

use std::sync::Arc;
use std::time::{Duration, Instant};

use clap::Parser;
use edgefleet_agent::rules::{Engine, RuleMetrics};
use edgefleet_agent::store::{Desired, DesiredDevice, HeldRule, Store};
use edgefleet_shared::api::{Device, Transport};
use edgefleet_shared::codec::DeviceReport;
use edgefleet_shared::{PropertyValue, ResourceKey, ResourceVersion, proto};
use edgefleet_tests::bench::{Report, quantiles};
use edgefleet_tests::rule_site::{Site, overheat_rule};
use kube::Api;
use kube::api::{Patch, PatchParams};

#[derive(Debug, Parser)]
#[command(
    name = "edgefleet-rules-bench",
    about = "Measure EdgeRule evaluation at the agent and report-to-action latency"
)]
struct Cli {
    /// Rules, each watching every device.
    #[arg(long, default_value_t = 100)]
    rules: usize,
    /// Devices at the agent.
    #[arg(long, default_value_t = 1000)]
    devices: usize,
    /// How long the evaluation phase runs.
    #[arg(long, default_value_t = 10)]
    seconds: u64,
    /// Report → action cycles (each an overheat and a cool-down).
    #[arg(long, default_value_t = 100)]
    cycles: usize,
    /// Cloud round trips (each a Device spec patch).
    #[arg(long, default_value_t = 30)]
    cloud_cycles: usize,
    /// Where the evaluation phase's store goes (a real disk).
    #[arg(long, default_value = "target/rules-bench")]
    dir: std::path::PathBuf,
}

const NS: &str = "bench";

fn main() -> anyhow::Result<()> {
    let cli = Cli::parse();
    let mut report = Report::default();
    report.line(&format!(
        "edgefleet-rules-bench: {} rules over {} devices; {} report->action cycles, {} cloud round trips",
        cli.rules, cli.devices, cli.cycles, cli.cloud_cycles
    ));
    // One thread: the evaluations per second are per core.
    tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()?
        .block_on(evaluations(&cli, &mut report))?;
    tokio::runtime::Builder::new_multi_thread()
        .worker_threads(2)
        .enable_all()
        .build()?
        .block_on(latency(&cli, &mut report))?;
    Ok(())
}

/// This process's resident memory, in MiB.
fn rss_mib() -> f64 {
    edgefleet_tests::process::memory_kib("self", "VmRSS").unwrap_or(0) as f64 / 1024.0
}

/// CPU time of the calling thread.
fn thread_cpu() -> Duration {
    std::fs::read_to_string("/proc/thread-self/schedstat")
        .ok()
        .and_then(|s| s.split_whitespace().next()?.parse().ok())
        .map(Duration::from_nanos)
        .unwrap_or_default()
}

async fn evaluations(cli: &Cli, report: &mut Report) -> anyhow::Result<()> {
    let _ = std::fs::remove_dir_all(&cli.dir);
    let store = Store::open(&cli.dir)?.store;
    let before = rss_mib();
    let names: Vec<String> = (0..cli.devices).map(|i| format!("t-{i:05}")).collect();
    let mut upserts: Vec<(ResourceKey, Desired)> = names
        .iter()
        .map(|name| {
            let device = DesiredDevice::new(
                ResourceVersion::new(format!("uid-{name}"), 1),
                "thermostat",
                Transport::Coap,
                Default::default(),
            );
            (ResourceKey::device(NS, name), device.into())
        })
        .collect();
    for r in 0..cli.rules {
        // Thresholds above every temperature reported: judged, never acting.
        let rule = proto::RuleDesired {
            namespace: NS.into(),
            name: format!("rule-{r:03}"),
            when: format!("reported.temperature > {}.0 && online", 100 + r),
            set: [(
                "mode".to_owned(),
                (&PropertyValue::String("off".into())).into(),
            )]
            .into(),
            restore: true,
            max_actions_per_minute: 60,
            watched: names
                .iter()
                .map(|n| proto::WatchedDevice {
                    name: n.clone(),
                    labels: [("site".to_owned(), "hq".to_owned())].into(),
                })
                .collect(),
            ..Default::default()
        };
        let key = ResourceKey::rule(NS, &rule.name);
        let held = HeldRule {
            version: ResourceVersion::new(format!("uid-{r}"), rule.digest()),
            rule,
        };
        upserts.push((key, Desired::Rule(Box::new(held))));
    }
    store.apply(&upserts, &[]).await?;
    // Only the store's and the engine's memory counts.
    drop(upserts);
    for (i, name) in names.iter().enumerate() {
        let r = DeviceReport {
            applied_generation: 1,
            properties: [(
                "temperature".to_owned(),
                PropertyValue::Float(20.0 + (i % 10) as f64),
            )]
            .into(),
            firmware_version: Some("1.0.0".into()),
            firmware_failure: None,
        };
        store.batch().report(&ResourceKey::device(NS, name), r, 0)?;
    }
    store.batch().commit().await?;
    let metrics = Arc::new(RuleMetrics::default());
    let mut engine = Engine::new(store.clone(), Arc::clone(&metrics));
    engine.reload().await?;
    let loaded = rss_mib();
    let cpu = thread_cpu();
    let start = Instant::now();
    let evaluated = metrics.evaluations.get();
    let mut passes = 0;
    while start.elapsed() < Duration::from_secs(cli.seconds) {
        engine.judge_all().await?;
        passes += 1;
    }
    let wall = start.elapsed();
    let cpu = thread_cpu().saturating_sub(cpu);
    let n = metrics.evaluations.get() - evaluated;
    report.line(&format!(
        "evaluations: {n} in {passes} passes over {:.1} s: {:.0}/s wall, {:.0} per CPU-s (one thread)",
        wall.as_secs_f64(),
        n as f64 / wall.as_secs_f64(),
        n as f64 / cpu.as_secs_f64().max(1e-9),
    ));
    report.line(&format!(
        "memory: RSS {before:.1} MiB with the store open, {loaded:.1} MiB with {} rules x {} devices loaded and compiled (+{:.1} MiB)",
        cli.rules,
        cli.devices,
        loaded - before
    ));
    Ok(())
}

async fn latency(cli: &Cli, report: &mut Report) -> anyhow::Result<()> {
    // Acting 2 x cycles times within minutes: past the default rate.
    let mut rule = overheat_rule(0);
    rule["maxActionsPerMinute"] = 6000.into();
    let mut site = Site::start("rules-bench", rule).await;
    site.valve_reports(true).await;
    let mut edge = Vec::with_capacity(cli.cycles * 2);
    for _ in 0..cli.cycles {
        for (temperature, open) in [(85.0, false), (60.0, true)] {
            let sent = Instant::now();
            site.boiler_reports(temperature).await;
            let told = site.valve_told().await;
            edge.push(sent.elapsed());
            anyhow::ensure!(
                told.properties.get("open") == Some(&PropertyValue::Bool(open)),
                "the valve was told {told:?}"
            );
        }
    }
    report.line(&format!(
        "report -> action at the device (agent alone): {}",
        quantiles(&mut edge)
    ));
    let devices: Api<Device> = Api::namespaced(site.client.clone(), &site.ns);
    let mut cloud = Vec::with_capacity(cli.cloud_cycles);
    for i in 0..cli.cloud_cycles {
        let open = i % 2 == 1;
        let sent = Instant::now();
        devices
            .patch(
                "inlet",
                &PatchParams::default(),
                &Patch::Merge(serde_json::json!({ "spec": { "desired": { "open": open } } })),
            )
            .await?;
        let told = site.valve_told().await;
        cloud.push(sent.elapsed());
        anyhow::ensure!(
            told.properties.get("open") == Some(&PropertyValue::Bool(open)),
            "the valve was told {told:?}"
        );
    }
    report.line(&format!(
        "the same change through the cloud (Device spec -> valve): {}",
        quantiles(&mut cloud)
    ));
    let (cloud_rss, agents) = site.stack.memory();
    report.line(&format!(
        "processes: controller RSS {:.1} MiB, agent RSS {:.1} MiB (one rule, two devices)",
        cloud_rss.unwrap_or(0) as f64 / 1048576.0,
        agents[0].unwrap_or(0) as f64 / 1048576.0
    ));
    site.stack.shutdown();
    Ok(())
}
