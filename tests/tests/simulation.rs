//! The sync protocol under a deterministic simulation (see
//! `edgefleet_tests::sim`): thousands of seeded runs of churn, cuts,
//! duplicates and crashes, each checked for convergence.
//!
//! `EDGEFLEET_SIM_SEEDS=N` sets how many seeds run (10,000 by default);
//! `EDGEFLEET_SIM_SEED=S` replays one seed and prints its trace.

use std::time::Instant;

use edgefleet_tests::sim::{self, Config, Sabotage};

fn env_u64(name: &str) -> Option<u64> {
    std::env::var(name).ok().and_then(|v| v.parse().ok())
}

#[test]
fn every_seed_converges_under_churn_cuts_duplicates_and_crashes() {
    let config = Config::default();
    if let Some(seed) = env_u64("EDGEFLEET_SIM_SEED") {
        match sim::run(seed, &config, true) {
            Ok(stats) => println!("seed {seed}: converged, {stats:?}"),
            Err(failure) => {
                for line in &failure.trace {
                    println!("{line}");
                }
                panic!("seed {seed}: {}", failure.violation);
            }
        }
        return;
    }
    let seeds = env_u64("EDGEFLEET_SIM_SEEDS").unwrap_or(10_000);
    let started = Instant::now();
    let mut failures = Vec::new();
    let mut total = sim::Stats::default();
    for seed in 0..seeds {
        match sim::run(seed, &config, false) {
            Ok(stats) => {
                total.steps += stats.steps;
                total.messages += stats.messages;
                total.churn += stats.churn;
                total.reports += stats.reports;
                total.events += stats.events;
                total.cuts += stats.cuts;
                total.agent_crashes += stats.agent_crashes;
                total.controller_crashes += stats.controller_crashes;
            }
            Err(failure) => failures.push(failure),
        }
    }
    let elapsed = started.elapsed();
    println!(
        "simulation: {seeds} seeds in {:.1} s ({:.0} seeds/s): {} actions, {} messages, {} fleet changes, {} reports, {} events, {} cuts, {} agent crashes, {} controller crashes",
        elapsed.as_secs_f64(),
        seeds as f64 / elapsed.as_secs_f64(),
        total.steps,
        total.messages,
        total.churn,
        total.reports,
        total.events,
        total.cuts,
        total.agent_crashes,
        total.controller_crashes,
    );
    for failure in failures.iter().take(10) {
        println!(
            "seed {} failed: {} (replay: EDGEFLEET_SIM_SEED={} cargo test -p edgefleet-tests --test simulation -- --nocapture)",
            failure.seed, failure.violation, failure.seed
        );
    }
    assert!(
        failures.is_empty(),
        "{} of {seeds} seeds broke an invariant; the first: seed {}: {}",
        failures.len(),
        failures[0].seed,
        failures[0].violation
    );
}

/// The checks are not vacuous: an agent with a known kind of bug (each one
/// a defect the agent had) fails them within a few hundred seeds.
#[test]
fn the_simulator_catches_agents_with_the_bugs_of_old() {
    for sabotage in [
        Sabotage::RefuseWholeUpdate,
        Sabotage::KeepRemoved,
        Sabotage::IgnoreBootEpochs,
        Sabotage::ReportsByName,
        Sabotage::OneMarkForBothFlows,
        Sabotage::SendBeforeDurable,
    ] {
        let config = Config {
            sabotage: Some(sabotage),
            ..Config::default()
        };
        let caught = (0..500).find_map(|seed| sim::run(seed, &config, false).err());
        let failure = caught.unwrap_or_else(|| panic!("{sabotage:?} went unnoticed for 500 seeds"));
        println!("{sabotage:?}: seed {} {}", failure.seed, failure.violation);
    }
}
