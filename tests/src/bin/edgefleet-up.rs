//! `edgefleet-up` (`make up`): the whole system on this machine — a local
//! Kubernetes control plane (or the cluster `$KUBECONFIG` names), the CRDs,
//! the cloud controller, three agents with their embedded brokers, the
//! examples of `deploy/examples/` and ~300 simulated devices — with a live
//! fleet view until Ctrl-C, then a clean shutdown. After a while it rolls
//! out a new firmware to the simulated devices, site by site (each agent's
//! node is a site), and the view shows the rollout progress per site.

use std::io::{IsTerminal, Write};
use std::path::{Path, PathBuf};
use std::time::Duration;

use anyhow::Context;
use clap::Parser;
use edgefleet_shared::api::rollout::FleetRollout;
use edgefleet_shared::api::{Device, EdgeNode, EdgeRule};
use edgefleet_sim::manifest::{MODEL_LABEL, SIMULATED_LABEL};
use edgefleet_tests::stack::{FIELD_MANAGER, Stack, StackSpec, ensure_namespace};
use edgefleet_tests::{control_plane, fleet_view, install_crds};
use kube::api::{Patch, PatchParams};
use kube::config::{KubeConfigOptions, Kubeconfig};
use kube::{Api, Client, Config};
use tokio::signal::unix::{SignalKind, signal};

#[derive(Debug, Parser)]
#[command(
    name = "edgefleet-up",
    about = "Run Edgefleet on this machine with simulated devices"
)]
struct Cli {
    /// How many simulated devices.
    #[arg(long, default_value_t = 300)]
    devices: usize,
    /// How many edge nodes (agents), named edge-1, edge-2, …
    #[arg(long, default_value_t = 3)]
    nodes: usize,
    /// Namespace of the simulated Devices.
    #[arg(long, default_value = "default")]
    namespace: String,
    /// Every K-th simulated device talks MQTT (0: none).
    #[arg(long, default_value_t = 10)]
    mqtt_every: usize,
    /// How often each simulated device reports.
    #[arg(long, default_value = "10s")]
    report_interval: String,
    /// The cloud's status write budget (writes per second).
    #[arg(long, default_value_t = 50)]
    status_writes_per_second: u32,
    /// Start a demonstration FleetRollout (firmware 1.1.0 to the simulated
    /// devices, site by site) this many seconds after the devices start;
    /// 0: none.
    #[arg(long, default_value_t = 30)]
    rollout_after_seconds: u64,
    /// Where logs and agent stores go.
    #[arg(long, default_value = "/tmp/edgefleet-up")]
    dir: PathBuf,
}

#[tokio::main]
async fn main() -> anyhow::Result<()> {
    let cli = Cli::parse();
    let kubeconfig = match std::env::var_os("KUBECONFIG") {
        Some(path) => {
            let path = PathBuf::from(path);
            say(&format!(
                "using the cluster of $KUBECONFIG ({}); installing the CRDs",
                path.display()
            ));
            install_crds(&path).await.context("install the CRDs")?;
            path
        }
        None => {
            say("starting the local control plane (the first run builds it: about 6 minutes)");
            let path =
                tokio::task::spawn_blocking(|| control_plane().kubeconfig().to_owned()).await?;
            say("control plane ready, CRDs installed");
            path
        }
    };
    let client = client(&kubeconfig).await?;

    if cli.dir.exists() {
        std::fs::remove_dir_all(&cli.dir)
            .with_context(|| format!("clear {}", cli.dir.display()))?;
    }
    let spec = StackSpec {
        nodes: (1..=cli.nodes).map(|i| format!("edge-{i}")).collect(),
        namespace: cli.namespace.clone(),
        devices: cli.devices,
        mqtt_every: cli.mqtt_every,
        status_writes_per_second: cli.status_writes_per_second,
        dir: cli.dir.clone(),
        namespaced_controller: false,
        cloud_args: Vec::new(),
        agent_args: Vec::new(),
        sync_through_proxy: false,
    };
    say(&format!(
        "starting the cloud controller and {} agents",
        cli.nodes
    ));
    let mut stack = Stack::start(spec, &kubeconfig).await?;
    let (examples, rules) = apply_examples(&client, &examples_dir()).await?;
    say(&format!(
        "applied {examples} example Devices and {rules} example EdgeRules from deploy/examples/ (no simulated device behind them: the Devices stay Delivered, the rules never act)"
    ));
    let applied = stack.apply_devices(&client).await?;
    say(&format!(
        "applied {applied} simulated Devices in namespace {}",
        cli.namespace
    ));
    stack.start_sim(&[format!("--report-interval={}", cli.report_interval)])?;
    match start_rule(&client, &cli.namespace).await {
        Ok(()) => say(&format!(
            "applied EdgeRule {DEMO_RULE}: a thermostat over 22 °C for 10 s opens the valves of its node until it cools (decided by the agents)"
        )),
        Err(error) => say(&format!(
            "could not apply the demonstration rule: {error:#}"
        )),
    }

    println!();
    println!("Point kubectl at it:");
    println!("  export KUBECONFIG={}", kubeconfig.display());
    println!(
        "  kubectl get devices -A            # or: kubectl get dev -n {} -o wide",
        cli.namespace
    );
    println!("  kubectl get edgenodes");
    if cli.rollout_after_seconds > 0 {
        println!(
            "  kubectl get fro -n {}              # the demonstration rollout, from {} s on",
            cli.namespace, cli.rollout_after_seconds
        );
    }
    println!(
        "  kubectl get erule -n {}            # the demonstration rule; kubectl describe device dev-00001 -n {} shows its overrides",
        cli.namespace, cli.namespace
    );
    println!("  kubectl describe device dev-00000 -n {}", cli.namespace);
    println!("Logs: {}/*.log", cli.dir.display());
    println!("Ctrl-C stops everything.");
    println!();

    let rollout = (cli.rollout_after_seconds > 0).then(|| {
        (
            tokio::time::Instant::now() + Duration::from_secs(cli.rollout_after_seconds),
            cli.namespace.clone(),
        )
    });
    let result = watch_fleet(&client, &mut stack, rollout).await;
    say("stopping the simulator, the agents and the controller");
    stack.shutdown();
    say("stopped");
    result
}

/// Prints the fleet view every 2 s until Ctrl-C or SIGTERM; starts the
/// demonstration rollout at the time given, in the namespace given.
async fn watch_fleet(
    client: &Client,
    stack: &mut Stack,
    mut rollout: Option<(tokio::time::Instant, String)>,
) -> anyhow::Result<()> {
    let mut terminate = signal(SignalKind::terminate())?;
    let devices: Api<Device> = Api::all(client.clone());
    let nodes: Api<EdgeNode> = Api::all(client.clone());
    let rollouts: Api<FleetRollout> = Api::all(client.clone());
    let tty = std::io::stdout().is_terminal();
    let mut ticks = tokio::time::interval(Duration::from_secs(2));
    loop {
        tokio::select! {
            _ = tokio::signal::ctrl_c() => return Ok(()),
            _ = terminate.recv() => return Ok(()),
            _ = ticks.tick() => {}
        }
        stack.check_running()?;
        if let Some((at, namespace)) = &rollout
            && tokio::time::Instant::now() >= *at
        {
            let nodes: Vec<String> = stack.agents.iter().map(|a| a.node.clone()).collect();
            match start_rollout(client, namespace, &nodes).await {
                Ok(()) => say(&format!(
                    "started FleetRollout {DEMO_ROLLOUT} in {namespace}: firmware {DEMO_FIRMWARE}, one device per site first, then at most 10% of a site at a time"
                )),
                Err(error) => say(&format!(
                    "could not start the demonstration rollout: {error:#}"
                )),
            }
            rollout = None;
        }
        let (Ok(devices), Ok(nodes), Ok(rollouts)) = (
            devices.list(&Default::default()).await,
            nodes.list(&Default::default()).await,
            rollouts.list(&Default::default()).await,
        ) else {
            say("the API server did not answer; retrying");
            continue;
        };
        let mut table = fleet_view::render(&fleet_view::summarize(&devices.items, &nodes.items));
        if !rollouts.items.is_empty() {
            table.push('\n');
            table.push_str(&fleet_view::render_rollouts(&rollouts.items));
        }
        let overrides: Vec<&str> = devices
            .items
            .iter()
            .filter_map(|d| d.status.as_ref())
            .flat_map(|s| s.overrides.iter().filter(|o| o.in_force))
            .map(|o| o.rule.as_str())
            .collect();
        table.push_str(&format!(
            "\nEdgeRule overrides in force at the edge: {}\n",
            overrides.len()
        ));
        let mut out = std::io::stdout().lock();
        if tty {
            // Redraw in place: cursor up over the previous table.
            write!(out, "\x1b[{}F\x1b[J", table.lines().count() + 1)?;
        }
        writeln!(out, "{}", chrono_free_now())?;
        write!(out, "{table}")?;
        out.flush()?;
    }
}

/// The demonstration rollout's name and target.
const DEMO_ROLLOUT: &str = "sim-firmware-1-1";
const DEMO_FIRMWARE: &str = "1.1.0";

/// Labels each node as a site of its own and starts the demonstration
/// rollout over the simulated Devices of `namespace`.
async fn start_rollout(client: &Client, namespace: &str, nodes: &[String]) -> anyhow::Result<()> {
    let edge_nodes: Api<EdgeNode> = Api::all(client.clone());
    for (i, node) in nodes.iter().enumerate() {
        let labels =
            serde_json::json!({ "metadata": { "labels": { SITE: format!("site-{}", i + 1) } } });
        edge_nodes
            .patch(node, &PatchParams::default(), &Patch::Merge(&labels))
            .await
            .with_context(|| format!("label EdgeNode {node} with its site"))?;
    }
    let rollout: FleetRollout = serde_json::from_value(serde_json::json!({
        "apiVersion": "edgefleet.io/v1alpha1",
        "kind": "FleetRollout",
        "metadata": { "name": DEMO_ROLLOUT, "namespace": namespace },
        "spec": {
            "target": { "firmware": {
                "version": DEMO_FIRMWARE,
                "url": format!("https://firmware.example.com/sim-{DEMO_FIRMWARE}.bin"),
                "sha256": "5d".repeat(32),
            } },
            "selector": { "matchLabels": { SIMULATED_LABEL: "true" } },
            "strategy": {
                "canary": 1,
                "waves": ["25%", "50%"],
                "maxUnavailable": "10%",
                "failureDomain": { "topologyKey": SITE, "maxUnavailable": "10%", "canary": 1 },
            },
            "health": { "expression": "online", "bakeSeconds": 20 },
            "failurePolicy": {
                "thresholds": [{ "scope": "Site", "percent": 30, "minSample": 3 }],
                "action": "Rollback",
                "rollbackScope": "Failed",
            },
        },
    }))?;
    Api::<FleetRollout>::namespaced(client.clone(), namespace)
        .patch(
            DEMO_ROLLOUT,
            &PatchParams::apply(FIELD_MANAGER).force(),
            &Patch::Apply(&rollout),
        )
        .await
        .context("apply the FleetRollout")?;
    Ok(())
}

/// The demonstration rule's name.
const DEMO_RULE: &str = "warm-opens-valves";

/// Applies the demonstration EdgeRule over the simulated Devices of
/// `namespace`: thermostats drift around their setpoint, so it acts and
/// lets go now and then.
async fn start_rule(client: &Client, namespace: &str) -> anyhow::Result<()> {
    let model = |m: &str| serde_json::json!({ "matchLabels": { MODEL_LABEL: m } });
    let rule: EdgeRule = serde_json::from_value(serde_json::json!({
        "apiVersion": "edgefleet.io/v1alpha1",
        "kind": "EdgeRule",
        "metadata": { "name": DEMO_RULE, "namespace": namespace },
        "spec": {
            "selector": model("thermostat"),
            "when": "reported.temperature > 22.0",
            "forSeconds": 10,
            "cooldownSeconds": 60,
            "then": {
                "set": { "open": true },
                "target": model("valve"),
                "event": { "reason": "Warm", "message": "opening the cooling valves of this node" },
            },
            "restore": true,
        },
    }))?;
    Api::<EdgeRule>::namespaced(client.clone(), namespace)
        .patch(
            DEMO_RULE,
            &PatchParams::apply(FIELD_MANAGER).force(),
            &Patch::Apply(&rule),
        )
        .await
        .context("apply the EdgeRule")?;
    Ok(())
}

/// Applies every Device of `dir`'s YAML files (server-side apply).
/// Applies the Devices and EdgeRules of the examples in `dir`: how many of
/// each.
async fn apply_examples(client: &Client, dir: &Path) -> anyhow::Result<(usize, usize)> {
    let (mut devices, mut rules) = (0, 0);
    let Ok(entries) = std::fs::read_dir(dir) else {
        return Ok((0, 0));
    };
    let mut files: Vec<PathBuf> = entries.flatten().map(|e| e.path()).collect();
    files.sort();
    let params = PatchParams::apply(FIELD_MANAGER).force();
    for file in files
        .iter()
        .filter(|f| f.extension().is_some_and(|e| e == "yaml" || e == "yml"))
    {
        let text = std::fs::read_to_string(file)?;
        for document in serde_yaml_ng::Deserializer::from_str(&text) {
            let value: serde_json::Value = serde::Deserialize::deserialize(document)
                .with_context(|| format!("read {}", file.display()))?;
            let kind = value
                .get("kind")
                .and_then(|k| k.as_str())
                .unwrap_or_default();
            let namespace = value["metadata"]["namespace"]
                .as_str()
                .unwrap_or("default")
                .to_owned();
            let name = value["metadata"]["name"].as_str().unwrap_or_default();
            let what = format!("apply {kind} {namespace}/{name} from {}", file.display());
            if kind != "Device" && kind != "EdgeRule" {
                continue;
            }
            ensure_namespace(client, &namespace).await?;
            let apply = Patch::Apply(&value);
            if kind == "Device" {
                let api = Api::<Device>::namespaced(client.clone(), &namespace);
                api.patch(name, &params, &apply).await.context(what)?;
                devices += 1;
            } else {
                let api = Api::<EdgeRule>::namespaced(client.clone(), &namespace);
                api.patch(name, &params, &apply).await.context(what)?;
                rules += 1;
            }
        }
    }
    Ok((devices, rules))
}

/// The label naming an edge node's site.
const SITE: &str = "edgefleet.io/site";

fn examples_dir() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("../deploy/examples")
}

async fn client(kubeconfig: &Path) -> anyhow::Result<Client> {
    let kubeconfig = Kubeconfig::read_from(kubeconfig)?;
    let config = Config::from_custom_kubeconfig(kubeconfig, &KubeConfigOptions::default()).await?;
    Ok(Client::try_from(config)?)
}

fn say(line: &str) {
    eprintln!("edgefleet-up: {line}");
}

fn chrono_free_now() -> String {
    k8s_openapi::jiff::Timestamp::now()
        .strftime("%H:%M:%S UTC")
        .to_string()
}
