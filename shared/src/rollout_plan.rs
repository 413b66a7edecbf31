//! How a rollout proceeds, without I/O: which devices are in which stage,
//! and which may start updating now without breaking a limit.
//!
//! The cloud runs this over the whole rollout; an agent runs it over its
//! site's part (one failure domain) while the cloud is away. Both only feed
//! it what they know — each member's state and whether it can be reached —
//! and carry out what it answers, so the rules live in one place and are
//! proven here, by a property test that plays rollouts to the end.
//!
//! The rules:
//! - Members are ordered once, round-robin across failure domains (so every
//!   stage touches every domain in proportion), and cut into stages: the
//!   canary, then the waves (cumulative shares, a last wave of 100 %
//!   implied).
//! - A stage opens once every member of the stages before it that can be
//!   reached is done; an unreachable member never holds a stage back, and
//!   starts whenever it is reachable again, in whatever stage is open.
//! - In each domain the first members (its canary) go first; the rest of
//!   that domain waits until they all succeeded.
//! - Members being updated (updating or baking) never exceed
//!   `maxUnavailable`, overall nor in any domain.

use std::collections::BTreeMap;

use k8s_openapi::apimachinery::pkg::util::intstr::IntOrString;

use crate::api::rollout::{MAX_LISTED_SITES, RolloutStrategy, SiteCounts, StateCounts};

/// Where one member of a rollout stands.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum MemberState {
    /// Not started.
    Pending,
    /// Sent the update; not reporting the target yet.
    Updating,
    /// Reporting the target; in the bake time.
    Baking,
    /// Updated and healthy.
    Succeeded,
    /// Failed (install, health or time-out).
    Failed,
    /// Put back to what it had before.
    RolledBack,
    /// Left out (offline too long).
    Skipped,
}

impl MemberState {
    /// Counts against `maxUnavailable`: being updated (updating or
    /// baking). A failed member does not: if it did, failures below every
    /// threshold would use up the limit for good and stall the rollout
    /// (the property test found this with a limit of 1); the failure
    /// thresholds are what stop a rollout for failures.
    pub fn unavailable(self) -> bool {
        matches!(self, MemberState::Updating | MemberState::Baking)
    }

    /// Nothing more will happen to it in this rollout.
    pub fn done(self) -> bool {
        matches!(
            self,
            MemberState::Succeeded
                | MemberState::Failed
                | MemberState::RolledBack
                | MemberState::Skipped
        )
    }
}

/// How a member counts in a rollout's status: its state, or `Unreachable`
/// while its node is away and nothing final has happened to it.
fn count(counts: &mut StateCounts, m: &Member) {
    counts.total += 1;
    let slot = match m.state {
        _ if !m.reachable && !m.state.done() => &mut counts.unreachable,
        MemberState::Pending => &mut counts.pending,
        MemberState::Updating => &mut counts.updating,
        MemberState::Baking => &mut counts.baking,
        MemberState::Succeeded => &mut counts.succeeded,
        MemberState::Failed => &mut counts.failed,
        MemberState::RolledBack => &mut counts.rolled_back,
        MemberState::Skipped => &mut counts.skipped,
    };
    *slot += 1;
}

/// A rollout's members counted by state, as its status shows them.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct Summary {
    /// Over the whole rollout.
    pub overall: StateCounts,
    /// Per stage, the canary first.
    pub stages: Vec<StateCounts>,
    /// Per failure domain, at most [`MAX_LISTED_SITES`]: those with the
    /// most failed and unreachable members first, then by name.
    pub sites: Vec<SiteCounts>,
    /// Failure domains left out of `sites`.
    pub sites_not_listed: u32,
}

/// One member as the planner sees it.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Member {
    /// Its failure domain (the topology label's value), if the rollout has
    /// failure domains.
    pub domain: Option<String>,
    /// Where it stands.
    pub state: MemberState,
    /// Whether its node can be reached now.
    pub reachable: bool,
    /// It joined after the rollout started (Dynamic membership): it goes
    /// into the last stage, after everyone else, and is no site's canary.
    pub late: bool,
}

/// Which way a percentage of members is rounded.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Rounding {
    /// Up: stage sizes, canaries.
    Up,
    /// Down: limits.
    Down,
}

/// `share` of `of` members: a count as it is (at most `of`), a percentage
/// rounded as asked. `None` for a share that is neither.
pub fn resolve(share: &IntOrString, of: usize, rounding: Rounding) -> Option<usize> {
    match share {
        IntOrString::Int(n) => usize::try_from(*n).ok().map(|n| n.min(of)),
        IntOrString::String(s) => {
            let percent: usize = s.strip_suffix('%')?.parse().ok()?;
            if percent > 100 {
                return None;
            }
            let scaled = percent * of;
            Some(match rounding {
                Rounding::Up => scaled.div_ceil(100),
                Rounding::Down => scaled / 100,
            })
        }
    }
}

/// The most unavailable members a limit allows among `of`: rounded down, as
/// Kubernetes does, but at least 1 while there is anyone, so a rollout can
/// always move.
fn limit(share: &IntOrString, of: usize) -> usize {
    resolve(share, of, Rounding::Down)
        .unwrap_or(0)
        .max(usize::from(of > 0))
}

/// A rollout's plan: the order of its members, their stages, and its limits.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Plan {
    /// The member indices in plan order: round-robin across domains.
    pub order: Vec<usize>,
    /// Each member's stage (0: the canary), by member index.
    pub stage: Vec<usize>,
    /// How many stages there are.
    pub stages: usize,
    /// Whether each member is in its domain's canary, by member index.
    pub domain_canary: Vec<bool>,
    /// The most unavailable members overall.
    pub max_unavailable: usize,
    /// The most unavailable members per domain.
    pub domain_max_unavailable: BTreeMap<Option<String>, usize>,
}

impl Plan {
    /// Plans a rollout of `members` (in a stable order, like by name) under
    /// `strategy`. `None` if a share in it cannot be resolved (admission
    /// refuses those).
    pub fn new(strategy: &RolloutStrategy, members: &[Member]) -> Option<Plan> {
        let n = members.len();
        // Round-robin across domains, each domain in the given order.
        let mut by_domain: BTreeMap<Option<String>, Vec<usize>> = BTreeMap::new();
        for (i, m) in members.iter().enumerate() {
            by_domain.entry(m.domain.clone()).or_default().push(i);
        }
        let mut order = Vec::with_capacity(n);
        let on_time = |v: &Vec<usize>| -> Vec<usize> {
            v.iter().copied().filter(|&i| !members[i].late).collect()
        };
        let mut columns: Vec<std::vec::IntoIter<usize>> =
            by_domain.values().map(|v| on_time(v).into_iter()).collect();
        let early = members.iter().filter(|m| !m.late).count();
        while order.len() < early {
            for column in &mut columns {
                order.extend(column.next());
            }
        }
        // Late joiners last, in the given order.
        order.extend((0..n).filter(|&i| members[i].late));
        // Stage boundaries, cumulative, rising; the canary first and a
        // last stage of everyone.
        let mut bounds = vec![resolve(&strategy.canary, n, Rounding::Up)?];
        for wave in &strategy.waves {
            let bound = resolve(wave, n, Rounding::Up)?;
            if bound > *bounds.last().expect("the canary") {
                bounds.push(bound);
            }
        }
        if *bounds.last().expect("the canary") < n || bounds.len() == 1 {
            bounds.push(n);
        }
        let mut stage = vec![0; n];
        for (position, &member) in order.iter().enumerate() {
            stage[member] = match members[member].late {
                true => bounds.len() - 1,
                false => bounds.iter().position(|&b| position < b).unwrap_or(0),
            };
        }
        // Each domain's canary: its first members in that order.
        let mut domain_canary = vec![false; n];
        let mut domain_max_unavailable = BTreeMap::new();
        let domain = strategy.failure_domain.as_ref();
        for (name, indices) in &by_domain {
            let size = indices.len();
            let canary = match domain {
                Some(d) => resolve(&d.canary, size, Rounding::Up)?,
                None => 0,
            };
            for &i in on_time(indices).iter().take(canary) {
                domain_canary[i] = true;
            }
            let max = match domain {
                Some(d) => limit(&d.max_unavailable, size),
                None => size,
            };
            domain_max_unavailable.insert(name.clone(), max);
        }
        Some(Plan {
            order,
            stage,
            stages: bounds.len(),
            domain_canary,
            max_unavailable: limit(&strategy.max_unavailable, n),
            domain_max_unavailable,
        })
    }

    /// The stage open now: the first one with a reachable member not done
    /// (every stage before it is done as far as can be reached).
    pub fn open_stage(&self, members: &[Member]) -> usize {
        (0..self.stages)
            .find(|&s| {
                members
                    .iter()
                    .zip(&self.stage)
                    .any(|(m, &stage)| stage == s && m.reachable && !m.state.done())
            })
            .unwrap_or(self.stages)
    }

    /// Counts `members` by state overall, per stage and per domain (domains
    /// only if the members have any).
    pub fn summary(&self, members: &[Member]) -> Summary {
        let mut summary = Summary {
            stages: vec![StateCounts::default(); self.stages],
            ..Summary::default()
        };
        let mut sites: BTreeMap<&str, StateCounts> = BTreeMap::new();
        for (i, m) in members.iter().enumerate() {
            count(&mut summary.overall, m);
            count(&mut summary.stages[self.stage[i]], m);
            if let Some(domain) = &m.domain {
                count(sites.entry(domain).or_default(), m);
            }
        }
        let mut sites: Vec<SiteCounts> = sites
            .into_iter()
            .map(|(name, counts)| SiteCounts {
                name: name.to_owned(),
                counts,
            })
            .collect();
        // Stable: equal trouble keeps the name order.
        sites.sort_by_key(|s| std::cmp::Reverse(s.counts.failed + s.counts.unreachable));
        summary.sites_not_listed = sites.len().saturating_sub(MAX_LISTED_SITES) as u32;
        sites.truncate(MAX_LISTED_SITES);
        summary.sites = sites;
        summary
    }

    /// The members that may start updating now, by index, in plan order
    /// (so a tight overall limit is shared by the domains in turn), given
    /// where every member stands.
    pub fn to_start(&self, members: &[Member]) -> Vec<usize> {
        let open = self.open_stage(members);
        let mut unavailable = members.iter().filter(|m| m.state.unavailable()).count();
        let mut domain_unavailable: BTreeMap<&Option<String>, usize> = BTreeMap::new();
        let mut canary_waiting: BTreeMap<&Option<String>, bool> = BTreeMap::new();
        for (i, m) in members.iter().enumerate() {
            if m.state.unavailable() {
                *domain_unavailable.entry(&m.domain).or_default() += 1;
            }
            if self.domain_canary[i] && m.state != MemberState::Succeeded {
                canary_waiting.insert(&m.domain, true);
            }
        }
        let mut start = Vec::new();
        for &i in &self.order {
            let m = &members[i];
            if unavailable >= self.max_unavailable {
                break;
            }
            let eligible = m.state == MemberState::Pending
                && m.reachable
                && self.stage[i] <= open
                && (self.domain_canary[i] || !canary_waiting.contains_key(&m.domain));
            let used = domain_unavailable.entry(&m.domain).or_default();
            if eligible && *used < self.domain_max_unavailable[&m.domain] {
                *used += 1;
                unavailable += 1;
                start.push(i);
            }
        }
        start
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::api::rollout::FailureDomain;
    use proptest::prelude::*;

    fn share(s: &str) -> IntOrString {
        match s.parse::<i32>() {
            Ok(n) => IntOrString::Int(n),
            Err(_) => IntOrString::String(s.to_owned()),
        }
    }

    fn members(sites: &[usize]) -> Vec<Member> {
        sites
            .iter()
            .enumerate()
            .flat_map(|(site, &n)| {
                (0..n).map(move |_| Member {
                    domain: Some(format!("site-{site}")),
                    state: MemberState::Pending,
                    reachable: true,
                    late: false,
                })
            })
            .collect()
    }

    fn strategy(
        canary: &str,
        waves: &[&str],
        max: &str,
        site: Option<(&str, &str)>,
    ) -> RolloutStrategy {
        RolloutStrategy {
            canary: share(canary),
            waves: waves.iter().map(|w| share(w)).collect(),
            max_unavailable: share(max),
            failure_domain: site.map(|(max, canary)| FailureDomain {
                topology_key: "edgefleet.io/site".into(),
                max_unavailable: share(max),
                canary: share(canary),
            }),
        }
    }

    #[test]
    fn shares_resolve_as_counts_or_rounded_percentages() {
        assert_eq!(
            resolve(&share("5"), 3, Rounding::Up),
            Some(3),
            "a count is capped"
        );
        assert_eq!(resolve(&share("10%"), 15, Rounding::Up), Some(2));
        assert_eq!(resolve(&share("10%"), 15, Rounding::Down), Some(1));
        assert_eq!(resolve(&share("101%"), 15, Rounding::Up), None);
        assert_eq!(resolve(&share("ten"), 15, Rounding::Up), None);
        assert_eq!(limit(&share("10%"), 5), 1, "a limit lets one through");
        assert_eq!(limit(&share("0%"), 0), 0);
    }

    #[test]
    fn late_joiners_go_last_into_the_last_stage_and_are_no_canary() {
        let mut ms = members(&[3, 3]);
        ms[0].late = true;
        ms[3].late = true;
        let plan = Plan::new(&strategy("1", &["50%"], "100%", Some(("100%", "1"))), &ms).unwrap();
        assert_eq!(plan.stage[0], plan.stages - 1);
        assert_eq!(plan.stage[3], plan.stages - 1);
        assert_eq!(&plan.order[4..], &[0, 3], "after everyone else");
        assert!(!plan.domain_canary[0] && !plan.domain_canary[3]);
        assert!(
            plan.domain_canary[1] && plan.domain_canary[4],
            "the first on time"
        );
    }

    #[test]
    fn stages_are_the_canary_then_the_waves_spread_over_the_sites() {
        let ms = members(&[4, 4]);
        let plan = Plan::new(&strategy("2", &["50%"], "100%", None), &ms).unwrap();
        assert_eq!(plan.stages, 3);
        // Round-robin over the two sites: one canary from each.
        assert_eq!(plan.stage, [0, 1, 2, 2, 0, 1, 2, 2]);
    }

    #[test]
    fn the_canary_goes_alone_and_the_next_stage_waits_for_it() {
        let mut ms = members(&[10]);
        let plan = Plan::new(&strategy("1", &[], "3", None), &ms).unwrap();
        assert_eq!(plan.to_start(&ms), [0]);
        ms[0].state = MemberState::Updating;
        assert!(
            plan.to_start(&ms).is_empty(),
            "the rest waits for the canary"
        );
        ms[0].state = MemberState::Succeeded;
        assert_eq!(plan.to_start(&ms), [1, 2, 3], "then three at a time");
    }

    #[test]
    fn an_unreachable_member_holds_back_no_stage_and_starts_when_back() {
        let mut ms = members(&[4]);
        let plan = Plan::new(&strategy("1", &[], "4", None), &ms).unwrap();
        // The canary's node is away: stage 0 is done as far as can be
        // reached, so stage 1 opens.
        ms[0].reachable = false;
        assert_eq!(plan.open_stage(&ms), 1);
        assert_eq!(plan.to_start(&ms), [1, 2, 3]);
        ms[0].reachable = true;
        ms[1].state = MemberState::Succeeded;
        assert!(
            plan.to_start(&ms).contains(&0),
            "back, it starts in the open stage"
        );
    }

    /// When the overall limit is the tighter one, the sites share it in
    /// plan order (one from each in turn), not the first sites first.
    #[test]
    fn a_tight_overall_limit_is_shared_by_the_sites_in_turn() {
        let ms = members(&[10, 10, 10]);
        let plan = Plan::new(&strategy("0", &[], "3", Some(("50%", "0"))), &ms).unwrap();
        assert_eq!(plan.to_start(&ms), [0, 10, 20]);
    }

    #[test]
    fn each_site_starts_with_its_canary_and_keeps_within_its_limit() {
        let mut ms = members(&[10, 10]);
        let plan = Plan::new(&strategy("0", &[], "100%", Some(("20%", "1"))), &ms).unwrap();
        assert_eq!(plan.to_start(&ms), [0, 10], "one canary per site");
        ms[0].state = MemberState::Succeeded;
        ms[10].state = MemberState::Baking;
        assert_eq!(
            plan.to_start(&ms),
            [1, 2],
            "site 0 goes on, two at a time; site 1 waits"
        );
    }

    /// The worked example of docs/rollouts.md.
    #[test]
    fn the_worked_example_of_the_docs() {
        let mut ms = members(&[100; 10]);
        let strat = strategy("1%", &["10%", "50%"], "10%", Some(("10%", "1")));
        let plan = Plan::new(&strat, &ms).unwrap();
        let sizes: Vec<usize> = (0..plan.stages)
            .map(|s| plan.stage.iter().filter(|&&x| x == s).count())
            .collect();
        assert_eq!(sizes, [10, 90, 400, 500]);
        let per_site = |started: &[usize], ms: &[Member]| -> Vec<usize> {
            (0..10)
                .map(|site| {
                    let name = Some(format!("site-{site}"));
                    started.iter().filter(|&&i| ms[i].domain == name).count()
                })
                .collect()
        };
        let finish = |started: &[usize], ms: &mut [Member]| {
            for &i in started {
                ms[i].state = MemberState::Succeeded;
            }
        };
        let canary = plan.to_start(&ms);
        assert_eq!(per_site(&canary, &ms), [1; 10]);
        assert!(
            canary
                .iter()
                .all(|&i| plan.domain_canary[i] && plan.stage[i] == 0)
        );
        finish(&canary, &mut ms);
        let wave_1 = plan.to_start(&ms);
        assert_eq!(per_site(&wave_1, &ms), [9; 10]);
        finish(&wave_1, &mut ms);
        let wave_2 = plan.to_start(&ms);
        assert_eq!(per_site(&wave_2, &ms), [10; 10], "10 per site, 100 overall");
        assert!(wave_2.iter().all(|&i| plan.stage[i] == 2));
    }

    #[test]
    fn the_summary_counts_each_member_once_and_lists_troubled_sites_first() {
        let mut ms = members(&[3, 2, 2]);
        ms[0].state = MemberState::Succeeded;
        ms[1].state = MemberState::Updating;
        ms[1].reachable = false; // unreachable while updating
        ms[2].state = MemberState::Failed;
        ms[2].reachable = false; // failed is final: counts as failed
        ms[5].state = MemberState::Failed;
        let plan = Plan::new(&strategy("1", &["50%"], "2", Some(("1", "0"))), &ms).unwrap();
        let summary = plan.summary(&ms);
        let o = &summary.overall;
        assert_eq!(
            (o.total, o.succeeded, o.unreachable, o.failed, o.pending),
            (7, 1, 1, 2, 3)
        );
        let stage_total: u32 = summary.stages.iter().map(|s| s.total).sum();
        assert_eq!(stage_total, 7);
        let names: Vec<&str> = summary.sites.iter().map(|s| s.name.as_str()).collect();
        assert_eq!(
            names,
            ["site-0", "site-2", "site-1"],
            "two in trouble, one, none"
        );
        assert_eq!(summary.sites_not_listed, 0);

        let many = members(&vec![1; MAX_LISTED_SITES + 7]);
        let plan = Plan::new(&strategy("1", &[], "1", Some(("1", "0"))), &many).unwrap();
        let summary = plan.summary(&many);
        assert_eq!(summary.sites.len(), MAX_LISTED_SITES);
        assert_eq!(summary.sites_not_listed, 7);
        assert_eq!(summary.overall.total as usize, MAX_LISTED_SITES + 7);
    }

    /// Plays rollouts to the end, one random event at a time, and checks
    /// at every moment what the plan promises.
    fn play(
        sites: Vec<usize>,
        strat: RolloutStrategy,
        seed: Vec<(u8, u8)>,
    ) -> Result<(), TestCaseError> {
        let mut ms = members(&sites);
        let plan = Plan::new(&strat, &ms).unwrap();
        let mut events = seed.into_iter().cycle();
        for step in 0..10_000 {
            let start = plan.to_start(&ms);
            for &i in &start {
                // Stages in order: every reachable member of an earlier
                // stage is done.
                let behind = ms.iter().enumerate().find(|(j, m)| {
                    plan.stage[*j] < plan.stage[i] && m.reachable && !m.state.done()
                });
                prop_assert!(
                    behind.is_none(),
                    "member {i} (stage {}) started before {behind:?}",
                    plan.stage[i]
                );
            }
            for i in start {
                ms[i].state = MemberState::Updating;
            }
            let unavailable = ms.iter().filter(|m| m.state.unavailable()).count();
            prop_assert!(
                unavailable <= plan.max_unavailable,
                "{unavailable} unavailable over {}",
                plan.max_unavailable
            );
            for (domain, max) in &plan.domain_max_unavailable {
                let n = ms
                    .iter()
                    .filter(|m| &m.domain == domain && m.state.unavailable())
                    .count();
                prop_assert!(n <= *max, "{domain:?}: {n} unavailable over {max}");
            }
            // A member outside its domain's canary never starts before the
            // canary succeeded.
            for (i, m) in ms.iter().enumerate() {
                if m.state != MemberState::Pending && !plan.domain_canary[i] {
                    let canary_ok = ms.iter().enumerate().all(|(j, c)| {
                        !plan.domain_canary[j]
                            || c.domain != m.domain
                            || c.state == MemberState::Succeeded
                    });
                    prop_assert!(
                        canary_ok,
                        "member {i} started before its site's canary succeeded"
                    );
                }
            }
            let o = plan.summary(&ms).overall;
            let states = o.pending
                + o.updating
                + o.baking
                + o.succeeded
                + o.failed
                + o.rolled_back
                + o.unreachable
                + o.skipped;
            prop_assert_eq!(states, o.total, "every member counts once: {:?}", o);
            if ms.iter().all(|m| m.state.done()) {
                return Ok(());
            }
            // One thing happens: an update moves on (or fails), or a
            // member's node goes away or comes back.
            let (what, pick) = events.next().unwrap();
            let i = pick as usize % ms.len();
            let m = &mut ms[i];
            match (what % 8, m.state) {
                (0..=4, MemberState::Updating) => m.state = MemberState::Baking,
                (0..=4, MemberState::Baking) => m.state = MemberState::Succeeded,
                (5, MemberState::Updating | MemberState::Baking) if !plan.domain_canary[i] => {
                    m.state = MemberState::Failed
                }
                (6, _) => m.reachable = !m.reachable,
                (7, _) => m.reachable = true,
                _ => {}
            }
            // Every third step the oldest update in flight moves on, so
            // every play ends.
            if step % 3 == 0
                && let Some(busy) = ms
                    .iter_mut()
                    .find(|m| matches!(m.state, MemberState::Updating | MemberState::Baking))
            {
                busy.state = MemberState::Succeeded;
            }
            if ms.iter().all(|m| m.state.done() || !m.reachable) {
                for m in &mut ms {
                    m.reachable = true;
                }
            }
        }
        Err(TestCaseError::fail(format!(
            "the rollout never ended: {ms:?}"
        )))
    }

    proptest! {
        #[test]
        fn no_limit_is_ever_exceeded_and_every_rollout_ends(
            sites in prop::collection::vec(1usize..12, 1..5),
            canary in prop_oneof![Just("0"), Just("1"), Just("10%")],
            max in prop_oneof![Just("1"), Just("3"), Just("10%"), Just("50%")],
            site_max in prop_oneof![Just("1"), Just("10%"), Just("30%")],
            site_canary in prop_oneof![Just("0"), Just("1"), Just("20%")],
            with_sites in any::<bool>(),
            seed in prop::collection::vec((any::<u8>(), any::<u8>()), 1..64),
        ) {
            let strat = strategy(
                canary,
                &["30%", "60%"],
                max,
                with_sites.then_some((site_max, site_canary)),
            );
            play(sites, strat, seed)?;
        }
    }
}
