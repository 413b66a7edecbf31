//! The site's own pacing of a rollout: a generation a rollout made arrives
//! held (the store keeps the device on what it was told before), and this
//! task releases it once the site has a place for it, by the rules of
//! [`edgefleet_shared::site_pacing`]. It runs whether the cloud is there or
//! not: what the site was sent goes on starting while the link is down,
//! within the site's limit and behind its canary — until the agent rolls
//! the rollout back on its own (see [`crate::site_rollback`]), which stops
//! it at this site.

use std::collections::{BTreeMap, BTreeSet};
use std::time::Duration;

use edgefleet_shared::site_pacing::{self, Pace, SitePacing};
use edgefleet_shared::site_rollback::{self, Outcome};
use edgefleet_shared::{ResourceKey, ResourceVersion};
use prometheus_client::metrics::counter::Counter;
use prometheus_client::metrics::gauge::Gauge;

use crate::store::{Store, StoreError};

/// A burst of arrivals or reports is judged once: the pacer waits this
/// long after being woken.
const SETTLE: Duration = Duration::from_millis(50);

/// What the pacer shows: generations released, and held now.
#[derive(Clone, Debug, Default)]
pub struct Metrics {
    /// Generations released to their devices.
    pub released: Counter,
    /// Generations held back now.
    pub held: Gauge,
}

/// What one pass did.
#[derive(Debug, Default, PartialEq, Eq)]
pub struct Pass {
    /// The devices released.
    pub released: Vec<ResourceKey>,
    /// Generations still held.
    pub held: usize,
    /// When a device that takes a place reaches its time-out while
    /// another waits (Unix ms): the next pass is due then at the latest.
    pub next_due_ms: Option<i64>,
}

/// Releases what fits whenever a paced generation arrives, a paced device
/// reports while something is held, or a place's time-out runs out.
pub async fn run(store: Store, metrics: Metrics) {
    let wake = store.pace_watch();
    // A pass at once: generations held before a restart wake nothing else
    // (reports wake the pacer only once it has counted what is held).
    let mut due: Option<i64> = Some(edgefleet_shared::now_unix_ms());
    loop {
        match due {
            Some(at) => {
                let wait = (at - edgefleet_shared::now_unix_ms()).max(0) as u64;
                tokio::select! {
                    () = wake.notified() => {}
                    () = tokio::time::sleep(Duration::from_millis(wait)) => {}
                }
            }
            None => wake.notified().await,
        }
        tokio::time::sleep(SETTLE).await;
        match pace(&store).await {
            Ok(pass) => {
                store.set_held_generations(pass.held);
                metrics.released.inc_by(pass.released.len() as u64);
                metrics.held.set(pass.held as i64);
                if !pass.released.is_empty() {
                    tracing::info!(
                        devices = pass.released.len(),
                        still_held = pass.held,
                        "released held rollout generations: their site has a place"
                    );
                }
                due = pass.next_due_ms;
            }
            Err(error) => {
                tracing::error!(%error, "could not pace the site's rollouts; paced again at the next report");
                due = None;
            }
        }
    }
}

/// One rollout's devices of one site at this agent, in name order.
#[derive(Default)]
struct Site {
    limit: u32,
    keys: Vec<(ResourceKey, ResourceVersion)>,
    members: Vec<(bool, Pace)>,
    due_ms: Vec<Option<i64>>,
}

/// Judges every paced rollout and site at this agent and releases what
/// fits.
pub async fn pace(store: &Store) -> Result<Pass, StoreError> {
    let now = edgefleet_shared::now_unix_ms();
    let mut sites: BTreeMap<(String, String), Site> = BTreeMap::new();
    let mut stopped = BTreeSet::new();
    for (key, device) in store.devices()? {
        let Some(SitePacing {
            rollout_uid, pace, ..
        }) = device.site_pacing.clone()
        else {
            continue;
        };
        if device.rolled_back_at_edge.is_some() {
            stopped.insert(rollout_uid.clone());
        }
        let (state, due) = match (&device.held_at_edge, &device.rolled_back_at_edge) {
            (_, Some(_)) => (Pace::Finished, None),
            (Some(_), None) => (Pace::Held, None),
            (None, None) => {
                let latest = store.latest_report(&key)?;
                let outcome = site_rollback::outcome(
                    device.version.generation,
                    device.firmware.as_ref().map(|f| f.version.as_str()),
                    device.health_check.is_some(),
                    latest.as_ref().map(|l| &l.report),
                    latest.as_ref().and_then(|l| l.health.as_ref()),
                );
                match device.released_at_ms {
                    // Paced before this agent kept the time (an older
                    // store): it takes no place.
                    None => (Pace::Finished, None),
                    Some(at) => {
                        let state = site_pacing::pace_of(outcome, &pace, at, now);
                        let due = (outcome == Outcome::Open)
                            .then(|| at + i64::from(pace.timeout_seconds) * 1000);
                        (state, due)
                    }
                }
            }
        };
        let site = sites.entry((rollout_uid, pace.site.clone())).or_default();
        site.limit = match site.keys.is_empty() {
            true => pace.limit,
            false => site.limit.min(pace.limit),
        };
        site.keys.push((key, device.version.clone()));
        site.members.push((pace.canary, state));
        site.due_ms.push(due.filter(|_| state == Pace::Updating));
    }
    let mut release = Vec::new();
    let mut pass = Pass::default();
    for ((rollout_uid, _), site) in &sites {
        // A rollout this agent rolled back on its own stops here: nothing
        // more of it starts until the cloud has its say.
        let chosen = match stopped.contains(rollout_uid) {
            true => Vec::new(),
            false => site_pacing::release(site.limit, &site.members),
        };
        let held = site
            .members
            .iter()
            .filter(|(_, p)| *p == Pace::Held)
            .count();
        pass.held += held - chosen.len();
        if held > chosen.len() {
            // A place frees at the latest when a device in it times out.
            let due = site.due_ms.iter().flatten().min().copied();
            pass.next_due_ms = match (pass.next_due_ms, due) {
                (Some(a), Some(b)) => Some(a.min(b)),
                (a, b) => a.or(b),
            };
        }
        release.extend(chosen.into_iter().map(|i| site.keys[i].clone()));
    }
    if !release.is_empty() {
        pass.released = store.release_held(&release).await?;
    }
    Ok(pass)
}
