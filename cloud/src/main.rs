//! `edgefleet-cloud`: the cloud side of Edgefleet.

#![forbid(unsafe_code)]

use clap::{Parser, Subcommand};

#[derive(Debug, Parser)]
#[command(
    name = "edgefleet-cloud",
    version,
    about = "Edgefleet cloud controller"
)]
struct Cli {
    #[command(subcommand)]
    command: Command,
}

#[derive(Debug, Subcommand)]
enum Command {
    /// Print Edgefleet's CustomResourceDefinitions, and the admission policy
    /// that completes their validation, as YAML
    /// (`edgefleet-cloud crds | kubectl apply --server-side -f -`).
    Crds,
}

fn main() -> anyhow::Result<()> {
    match Cli::parse().command {
        Command::Crds => print!("{}", edgefleet_cloud::crds::render()?),
    }
    Ok(())
}
