//! A site's own pacing of a rollout: the agent of an edge node holds back a
//! generation a rollout made until its site has a place for it.
//!
//! The controller decides which devices start, within the overall limit,
//! the stages and each site's limit and canary. It writes each change with
//! the site's part of the plan ([`SitePace`]: the site, its limit, whether
//! the device is in the site's canary, the time-out). The agent enforces
//! that part itself on the devices it serves: a new generation of a paced
//! change starts *held* — the device is still told what it was told before
//! — and is released once fewer than `limit` of the rollout's devices of
//! that site at this agent are being updated, and, for a device outside the
//! site's canary, once every canary device of the site succeeded as the
//! agent judges it (applied, and healthy for the bake time if there is a
//! health gate). So a site never has more devices down than its limit,
//! whatever it is sent (two controllers that both think they lead, a stale
//! view), and what it holds goes on starting while the cloud is away.
//!
//! A released device stops counting once it succeeded, failed, was rolled
//! back, or its time-out ran out (the cloud counts it `TimedOut` then and
//! may start another: the edge must free the place too).
//!
//! Pure: the agent's store supplies where each device stands.

use serde::{Deserialize, Serialize};

/// A site's part of a rollout's plan, as the change of one device records
/// it.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "camelCase")]
pub struct SitePace {
    /// The site (the value of the rollout's failure-domain label).
    pub site: String,
    /// The most devices of the site updating at once.
    pub limit: u32,
    /// Whether this device is in the site's canary.
    #[serde(default, skip_serializing_if = "std::ops::Not::not")]
    pub canary: bool,
    /// How long after its start a device stops counting against the
    /// limit, however it stands (the time-out the cloud judges, bake
    /// included).
    pub timeout_seconds: u32,
}

/// What an agent is told with the generation a paced change made.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "camelCase")]
pub struct SitePacing {
    /// The FleetRollout's name.
    pub rollout: String,
    /// Its uid: devices of one rollout uid and site are paced together.
    pub rollout_uid: String,
    /// The site's part.
    pub pace: SitePace,
}

/// A generation the agent holds back: kept with the device's desired
/// state, and sent up with its reports, so the Device shows why it waits.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "camelCase")]
pub struct HeldAtEdge {
    /// The FleetRollout's name.
    pub rollout: String,
    /// The generation held.
    pub generation: i64,
    /// Since when (Unix milliseconds).
    pub since_ms: i64,
    /// Why, for people.
    pub message: String,
}

impl HeldAtEdge {
    /// The mark of `generation`, held under `pacing` from `now_ms`.
    pub fn new(pacing: &SitePacing, generation: i64, now_ms: i64) -> HeldAtEdge {
        let pace = &pacing.pace;
        let canary = match pace.canary {
            true => "",
            false => ", after the site's canary succeeded",
        };
        HeldAtEdge {
            rollout: pacing.rollout.clone(),
            generation,
            since_ms: now_ms,
            message: format!(
                "held by the agent until site {} has a place for it (at most {} updating at once{canary})",
                pace.site, pace.limit
            ),
        }
    }
}

/// Where one paced device stands at the agent.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Pace {
    /// Its generation is held back: the device has not been told.
    Held,
    /// Released, and neither finished nor past its time-out: takes a place.
    Updating,
    /// Applied, and healthy for the bake time if there is a health gate.
    Succeeded,
    /// Failed, rolled back, or past its time-out: takes no place, and is
    /// not a canary that succeeded.
    Finished,
}

/// Which of `members` — the devices of one rollout and site at this agent,
/// each with whether it is in the site's canary and where it stands — to
/// release now, by index, taken in the order given, under `limit`.
pub fn release(limit: u32, members: &[(bool, Pace)]) -> Vec<usize> {
    let mut updating = members.iter().filter(|(_, p)| *p == Pace::Updating).count();
    let canary_waiting = members
        .iter()
        .any(|(canary, p)| *canary && *p != Pace::Succeeded);
    let mut out = Vec::new();
    for (i, (canary, pace)) in members.iter().enumerate() {
        if updating >= limit as usize {
            break;
        }
        if *pace == Pace::Held && (*canary || !canary_waiting) {
            updating += 1;
            out.push(i);
        }
    }
    out
}

/// Where a released device stands: `outcome` of its update (see
/// [`crate::site_rollback::outcome`]), released at `released_at_ms`, under
/// `pace`, at `now_ms`.
pub fn pace_of(
    outcome: crate::site_rollback::Outcome,
    pace: &SitePace,
    released_at_ms: i64,
    now_ms: i64,
) -> Pace {
    use crate::site_rollback::Outcome;
    match outcome {
        Outcome::Succeeded => Pace::Succeeded,
        Outcome::Failed(_) | Outcome::RolledBack => Pace::Finished,
        Outcome::Open if now_ms - released_at_ms >= i64::from(pace.timeout_seconds) * 1000 => {
            Pace::Finished
        }
        Outcome::Open => Pace::Updating,
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::api::rollout::FailureClass;
    use crate::site_rollback::Outcome;
    use proptest::prelude::*;

    #[test]
    fn releases_up_to_the_limit_in_order() {
        let held = (false, Pace::Held);
        assert_eq!(release(2, &[held, held, held]), vec![0, 1]);
        assert_eq!(release(2, &[(false, Pace::Updating), held, held]), vec![1]);
        assert_eq!(
            release(1, &[(false, Pace::Updating), held]),
            Vec::<usize>::new()
        );
        // Finished and succeeded devices free their place.
        assert_eq!(
            release(
                1,
                &[(false, Pace::Finished), (false, Pace::Succeeded), held]
            ),
            vec![2]
        );
    }

    #[test]
    fn the_site_canary_goes_first_and_must_succeed() {
        // The canary is released before earlier non-canaries.
        assert_eq!(
            release(3, &[(false, Pace::Held), (true, Pace::Held)]),
            vec![1]
        );
        // While it updates, nobody else starts, though there is room.
        assert_eq!(
            release(3, &[(false, Pace::Held), (true, Pace::Updating)]),
            Vec::<usize>::new()
        );
        // A failed canary holds the rest (the cloud pauses or rolls back).
        assert_eq!(
            release(3, &[(false, Pace::Held), (true, Pace::Finished)]),
            Vec::<usize>::new()
        );
        assert_eq!(
            release(3, &[(false, Pace::Held), (true, Pace::Succeeded)]),
            vec![0]
        );
    }

    #[test]
    fn a_silent_device_stops_counting_at_its_time_out() {
        let pace = SitePace {
            site: "a".into(),
            limit: 1,
            canary: false,
            timeout_seconds: 60,
        };
        assert_eq!(pace_of(Outcome::Open, &pace, 0, 59_999), Pace::Updating);
        assert_eq!(pace_of(Outcome::Open, &pace, 0, 60_000), Pace::Finished);
        assert_eq!(pace_of(Outcome::Succeeded, &pace, 0, 1), Pace::Succeeded);
        let failed = Outcome::Failed(FailureClass::InstallFailed);
        assert_eq!(pace_of(failed, &pace, 0, 1), Pace::Finished);
    }

    fn pace() -> impl Strategy<Value = Pace> {
        prop_oneof![
            Just(Pace::Held),
            Just(Pace::Updating),
            Just(Pace::Succeeded),
            Just(Pace::Finished),
        ]
    }

    proptest! {
        /// Whatever the site stands at, releasing never takes it over its
        /// limit (unless it was over already, when nothing is released),
        /// never releases a non-canary while a canary has not succeeded,
        /// and releases only held devices.
        #[test]
        fn never_over_the_limit(
            limit in 1u32..5,
            members in proptest::collection::vec((any::<bool>(), pace()), 0..20),
        ) {
            let out = release(limit, &members);
            let updating = members.iter().filter(|(_, p)| *p == Pace::Updating).count();
            prop_assert!(out.is_empty() || updating + out.len() <= limit as usize);
            let canary_waiting = members.iter().any(|(c, p)| *c && *p != Pace::Succeeded);
            for &i in &out {
                prop_assert_eq!(members[i].1, Pace::Held);
                prop_assert!(members[i].0 || !canary_waiting);
            }
            // Work-conserving: if a place is left, no eligible device waits.
            if updating + out.len() < limit as usize {
                let eligible = members
                    .iter()
                    .filter(|(c, p)| *p == Pace::Held && (*c || !canary_waiting))
                    .count();
                prop_assert_eq!(out.len(), eligible);
            }
        }
    }
}
