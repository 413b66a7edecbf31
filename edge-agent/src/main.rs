//! `edgefleet-agent`: runs on each edge node. Its runtime (store, sync
//! client, CoAP and MQTT) is not written yet; today the binary only answers
//! `--help` and `--version` so packaging and deployment can be built around it.

#![forbid(unsafe_code)]

use clap::Parser;

#[derive(Debug, Parser)]
#[command(
    name = "edgefleet-agent",
    version,
    about = "Edgefleet edge agent (runtime not implemented yet)"
)]
struct Cli {}

fn main() {
    let _ = Cli::parse();
    eprintln!("edgefleet-agent: the agent runtime is not implemented yet");
    std::process::exit(2);
}
