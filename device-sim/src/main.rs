//! `edgefleet-sim`: simulated devices for Edgefleet.
//!
//! - `edgefleet-sim devices`: print the fleet's Device resources, for
//!   `kubectl apply -f -`;
//! - `edgefleet-sim run`: simulate the same fleet against running agents.
//!
//! Give both subcommands the same fleet flags (nodes in the same order) and
//! the simulated devices are exactly the Devices applied.

#![forbid(unsafe_code)]

use std::future::Future;
use std::io::{self, Write};
use std::path::PathBuf;
use std::time::Duration;

use anyhow::{Context, bail};
use clap::{Args, Parser, Subcommand};
use edgefleet_sim::config::{node_name, parse_duration};
use edgefleet_sim::firmware::{FirmwareBehaviour, InstallFailure, parse_duration_range};
use edgefleet_sim::fleet::FleetSpec;
use edgefleet_sim::model::ModelKind;
use edgefleet_sim::retransmit::RetransmitParams;
use edgefleet_sim::{NodeEndpoint, RunConfig, keys, manifest};
use tokio::signal::unix::{SignalKind, signal};

#[derive(Debug, Parser)]
#[command(name = "edgefleet-sim", version, about = "Edgefleet device simulator")]
struct Cli {
    #[command(subcommand)]
    command: Command,
}

#[derive(Debug, Subcommand)]
enum Command {
    /// Print the fleet's Device resources and their key Secrets as YAML
    /// documents (one JSON object each), for `kubectl apply -f -`.
    Devices(DevicesArgs),
    /// Simulate the fleet: report to the agents, apply their desired states.
    Run(RunArgs),
}

/// The flags that decide the fleet, shared by both subcommands.
#[derive(Debug, Args)]
struct FleetArgs {
    /// Namespace of the Devices.
    #[arg(long, env = "EDGEFLEET_SIM_NAMESPACE", default_value = "default")]
    namespace: String,
    /// How many devices.
    #[arg(long, env = "EDGEFLEET_SIM_DEVICES", default_value_t = 300)]
    devices: usize,
    /// Device models, assigned round-robin.
    #[arg(
        long,
        env = "EDGEFLEET_SIM_MODELS",
        value_delimiter = ',',
        default_value = "thermostat,valve,meter"
    )]
    models: Vec<ModelKind>,
    /// Every K-th device (K-1, 2K-1, …) talks MQTT instead of CoAP; 0: none.
    #[arg(long, env = "EDGEFLEET_SIM_MQTT_EVERY", default_value_t = 0)]
    mqtt_every: usize,
    /// Device names are PREFIX-00000, PREFIX-00001, …
    #[arg(long, env = "EDGEFLEET_SIM_PREFIX", default_value = "dev")]
    prefix: String,
    /// Seeds the simulation (the Device resources do not depend on it).
    #[arg(long, env = "EDGEFLEET_SIM_SEED", default_value_t = 1)]
    seed: u64,
    /// Each device's key (the Secrets `devices` prints, the MQTT password
    /// `run` logs in with) is derived from this. Anyone who knows it knows
    /// every simulated device's key: set your own outside a lab.
    #[arg(long, env = "EDGEFLEET_SIM_FLEET_KEY", default_value = keys::LAB_FLEET_KEY, hide_default_value = true)]
    fleet_key: String,
}

impl FleetArgs {
    fn spec(&self, nodes: Vec<String>) -> FleetSpec {
        FleetSpec {
            prefix: self.prefix.clone(),
            devices: self.devices,
            nodes,
            models: self.models.clone(),
            mqtt_every: self.mqtt_every,
        }
    }
}

#[derive(Debug, Args)]
struct DevicesArgs {
    #[command(flatten)]
    fleet: FleetArgs,
    /// A node to put devices on, round-robin (repeat for more). `NAME=...`
    /// is accepted too, so one EDGEFLEET_SIM_NODE serves both subcommands.
    #[arg(
        long = "node",
        env = "EDGEFLEET_SIM_NODE",
        value_delimiter = ' ',
        required = true,
        value_parser = node_name
    )]
    nodes: Vec<String>,
}

#[derive(Debug, Args)]
struct RunArgs {
    #[command(flatten)]
    fleet: FleetArgs,
    /// A node and its endpoints, NAME=COAP_HOST:PORT,MQTT_HOST:PORT (repeat
    /// for more; space-separated in the environment variable).
    #[arg(
        long = "node",
        env = "EDGEFLEET_SIM_NODE",
        value_delimiter = ' ',
        required = true
    )]
    nodes: Vec<NodeEndpoint>,
    /// How often each device reports; first reports are spread over it.
    #[arg(long, env = "EDGEFLEET_SIM_REPORT_INTERVAL", default_value = "10s", value_parser = parse_duration)]
    report_interval: Duration,
    /// How often to print the summary line to stderr (0: only at the end).
    #[arg(long, env = "EDGEFLEET_SIM_SUMMARY_INTERVAL", default_value = "5s", value_parser = parse_duration)]
    summary_interval: Duration,
    /// Append a JSON line per applied desired state to this file.
    #[arg(long, env = "EDGEFLEET_SIM_APPLIED_LOG")]
    applied_log: Option<PathBuf>,
    /// At exit, write each device's last acknowledged report to this file
    /// (one JSON line per device), to compare with Device status.
    #[arg(long, env = "EDGEFLEET_SIM_FINAL_STATE")]
    final_state: Option<PathBuf>,
    /// Stop after this long (default: run until Ctrl-C or SIGTERM).
    #[arg(long, env = "EDGEFLEET_SIM_DURATION", value_parser = parse_duration)]
    duration: Option<Duration>,
    /// Each device also raises a `SelfCheck` event every this many reports
    /// (0: devices raise only update results: ConfigApplied,
    /// FirmwareInstalled).
    #[arg(long, env = "EDGEFLEET_SIM_EVENT_EVERY", default_value_t = 0)]
    event_every: u32,
    /// The percentage of devices whose readings drift over time (devices
    /// 0..P of every hundred); the others are steady and report the same
    /// values until a desired state changes them.
    #[arg(long, env = "EDGEFLEET_SIM_CHANGING_PERCENT", default_value_t = 100, value_parser = clap::value_parser!(u8).range(0..=100))]
    changing_percent: u8,
    /// How long a firmware install (download, install, reboot) takes:
    /// `MIN..MAX`, drawn per install.
    #[arg(long, env = "EDGEFLEET_SIM_INSTALL_TIME", default_value = "1s..3s", value_parser = parse_duration_range)]
    install_time: (Duration, Duration),
    /// `[MODEL/]VERSION=PERCENT`: installing VERSION (on MODEL) fails this
    /// often; the device keeps its firmware and reports the failure.
    /// Repeatable; the first rule that matches counts.
    #[arg(
        long = "install-failure",
        env = "EDGEFLEET_SIM_INSTALL_FAILURES",
        value_delimiter = ','
    )]
    install_failures: Vec<InstallFailure>,
    /// A firmware VERSION that installs fine and then makes the device
    /// crash (it reports a growing `crashes` property). Repeatable.
    #[arg(
        long = "bad-firmware",
        env = "EDGEFLEET_SIM_BAD_FIRMWARE",
        value_delimiter = ','
    )]
    bad_firmware: Vec<String>,
    /// Talk plain CoAP to agents started with `--insecure-coap-plain`
    /// (labs). Without it, each CoAP device uses CoAP over DTLS with its key.
    #[arg(long, env = "EDGEFLEET_SIM_INSECURE_COAP_PLAIN")]
    insecure_coap_plain: bool,
    /// CoAP ACK_TIMEOUT: the shortest wait before a retransmission.
    #[arg(long, env = "EDGEFLEET_SIM_COAP_ACK_TIMEOUT", default_value = "2s", value_parser = parse_duration)]
    coap_ack_timeout: Duration,
}

#[tokio::main]
async fn main() -> anyhow::Result<()> {
    match Cli::parse().command {
        Command::Devices(args) => print_devices(&args),
        Command::Run(args) => simulate(args).await,
    }
}

fn print_devices(args: &DevicesArgs) -> anyhow::Result<()> {
    let slots = args.fleet.spec(args.nodes.clone()).layout()?;
    let mut out = io::BufWriter::new(io::stdout().lock());
    let written = manifest::write_devices(
        &mut out,
        &args.fleet.namespace,
        &slots,
        &keys::FleetKey(args.fleet.fleet_key.clone()),
    )
    .and_then(|()| out.flush());
    match written {
        // The reader went away (`| head`): not our problem.
        Err(e) if e.kind() == io::ErrorKind::BrokenPipe => Ok(()),
        other => other.context("writing the Device resources and their Secrets"),
    }
}

async fn simulate(args: RunArgs) -> anyhow::Result<()> {
    edgefleet_shared::telemetry::init_logging();
    if args.report_interval.is_zero() {
        bail!("--report-interval must be more than zero");
    }
    let nodes = args.nodes.iter().map(|n| n.name.clone()).collect();
    let config = RunConfig {
        fleet: args.fleet.spec(nodes),
        namespace: args.fleet.namespace.clone(),
        fleet_key: keys::FleetKey(args.fleet.fleet_key.clone()),
        insecure_coap_plain: args.insecure_coap_plain,
        endpoints: args.nodes,
        seed: args.fleet.seed,
        report_interval: args.report_interval,
        summary_interval: (!args.summary_interval.is_zero()).then_some(args.summary_interval),
        applied_log: args.applied_log,
        final_state: args.final_state,
        retransmit: RetransmitParams {
            ack_timeout: args.coap_ack_timeout,
            ..RetransmitParams::default()
        },
        event_every: args.event_every,
        changing_percent: args.changing_percent,
        firmware: std::sync::Arc::new(FirmwareBehaviour {
            install_time: args.install_time,
            failures: args.install_failures,
            bad: args.bad_firmware,
        }),
    };
    let shutdown = shutdown_signal(args.duration)?;
    let summary = edgefleet_sim::run(config, shutdown).await?;
    eprintln!("edgefleet-sim: final: {summary}");
    Ok(())
}

/// Resolves on Ctrl-C, SIGTERM, or once `duration` has passed.
fn shutdown_signal(duration: Option<Duration>) -> anyhow::Result<impl Future<Output = ()>> {
    let mut terminate =
        signal(SignalKind::terminate()).context("installing the SIGTERM handler")?;
    Ok(async move {
        let elapsed = async {
            match duration {
                Some(duration) => tokio::time::sleep(duration).await,
                None => std::future::pending().await,
            }
        };
        tokio::select! {
            _ = tokio::signal::ctrl_c() => tracing::info!("interrupted; stopping"),
            _ = terminate.recv() => tracing::info!("terminated; stopping"),
            () = elapsed => tracing::info!("duration elapsed; stopping"),
        }
    })
}
