//! The site's own part in a rollout's failure policy: while the cloud is
//! unreachable, the agent counts the failures of its devices' updates
//! against the rollout's per-site threshold and, once it is crossed, rolls
//! them back itself (see [`edgefleet_shared::site_rollback`] for the
//! rules). What it did stays in the store and goes up with the devices'
//! reports when the link returns.
//!
//! While the cloud is connected the cloud judges (it sees every site and
//! the time-outs); the agent acts only after the link has been down for
//! [`OFFLINE_GRACE`], so a reconnect is not mistaken for an outage.

use std::collections::BTreeMap;
use std::time::Duration;

use edgefleet_shared::site_rollback::{self, Outcome, SiteRollback};
use edgefleet_shared::{ResourceKey, ResourceVersion};
use prometheus_client::metrics::counter::Counter;

use crate::store::{Store, StoreError};

/// How long the link must have been down before the agent judges alone.
pub const OFFLINE_GRACE: Duration = Duration::from_secs(3);

/// A burst of reports is judged once: the agent waits this long after
/// being woken.
const SETTLE: Duration = Duration::from_millis(200);

/// Judges the site whenever a report of a device under a plan comes or
/// the link goes down, and rolls back what a crossed threshold says.
/// `rolled_back` counts the devices rolled back.
pub async fn run(store: Store, rolled_back: Counter) {
    let wake = store.site_watch();
    loop {
        wake.notified().await;
        tokio::time::sleep(SETTLE).await;
        let Some(down_since) = store.link_down_since() else {
            continue;
        };
        let down_for = edgefleet_shared::now_unix_ms() - down_since;
        let grace = OFFLINE_GRACE.as_millis() as i64;
        if down_for < grace {
            // Judge again once the grace is over.
            let wake = wake.clone();
            tokio::spawn(async move {
                tokio::time::sleep(Duration::from_millis((grace - down_for) as u64)).await;
                wake.notify_one();
            });
            continue;
        }
        match judge_and_roll_back(&store).await {
            Ok(0) => {}
            Ok(n) => {
                rolled_back.inc_by(n as u64);
            }
            Err(error) => {
                tracing::error!(%error, "could not judge the site's rollouts; judged again at the next report");
            }
        }
    }
}

/// One rollout's members at this site.
#[derive(Default)]
struct Members {
    plan: Option<SiteRollback>,
    keys: Vec<(ResourceKey, ResourceVersion)>,
    outcomes: Vec<Outcome>,
}

/// Judges every rollout with a plan at this site and rolls back where a
/// threshold is crossed; returns how many devices were rolled back.
pub async fn judge_and_roll_back(store: &Store) -> Result<usize, StoreError> {
    let mut rollouts: BTreeMap<String, Members> = BTreeMap::new();
    for (key, device) in store.devices()? {
        let Some(plan) = device.site_rollback.clone() else {
            continue;
        };
        let outcome = match device.rolled_back_at_edge {
            Some(_) => Outcome::RolledBack,
            None => {
                let latest = store.latest_report(&key)?;
                site_rollback::outcome(
                    device.version.generation,
                    device.firmware.as_ref().map(|f| f.version.as_str()),
                    device.health_check.is_some(),
                    latest.as_ref().map(|l| &l.report),
                    latest.as_ref().and_then(|l| l.health.as_ref()),
                )
            }
        };
        let members = rollouts.entry(plan.rollout_uid.clone()).or_default();
        members.keys.push((key, device.version.clone()));
        members.outcomes.push(outcome);
        members.plan.get_or_insert(plan);
    }
    let mut total = 0;
    for members in rollouts.values() {
        let Some(plan) = &members.plan else { continue };
        let Some(verdict) = site_rollback::judge(plan, &members.outcomes) else {
            continue;
        };
        let chosen: Vec<(ResourceKey, ResourceVersion)> = verdict
            .roll_back
            .iter()
            .map(|&i| members.keys[i].clone())
            .collect();
        let done = store.roll_back_at_edge(&chosen, &verdict.message).await?;
        tracing::warn!(
            rollout = %plan.rollout,
            devices = done.len(),
            message = %verdict.message,
            "the site crossed the rollout's failure threshold while the cloud is unreachable; rolled back on the agent's own authority"
        );
        total += done.len();
    }
    Ok(total)
}
