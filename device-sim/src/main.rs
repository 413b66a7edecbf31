//! `edgefleet-sim`: simulated devices. The simulation is not written yet;
//! today the binary only answers `--help` and `--version`.

#![forbid(unsafe_code)]

use clap::Parser;

#[derive(Debug, Parser)]
#[command(
    name = "edgefleet-sim",
    version,
    about = "Edgefleet device simulator (simulation not implemented yet)"
)]
struct Cli {}

fn main() {
    let _ = Cli::parse();
    eprintln!("edgefleet-sim: the simulator is not implemented yet");
    std::process::exit(2);
}
