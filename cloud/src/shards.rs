//! Which edge nodes this replica serves.
//!
//! The fleet is cut into a fixed number of shards by edge node (a stable
//! hash of the node's name); each shard has a Kubernetes Lease, and the
//! replica holding a shard's Lease serves its nodes' agents and makes every
//! write about them ([`crate::leases`] keeps the Leases). Shard 0's holder
//! also runs the singletons (the rollout, rule and Device reconcilers).
//!
//! Writes are fenced by time: a shard counts as held only until the moment
//! its last successful renewal was sent plus the lease duration, less a
//! margin. Another replica takes a shard over only once it has seen the
//! Lease unchanged for a whole lease duration, which starts after that
//! renewal landed, so a replica that was paused or cut off stops writing
//! before anyone else starts. This module is the bookkeeping, without I/O.

use std::sync::Mutex;
use std::time::{Duration, Instant};

/// The shard of an edge node among `count`: CRC-32 of its name, so every
/// replica (and every version) agrees.
pub fn shard_of(node: &str, count: u32) -> u32 {
    crc32fast::hash(node.as_bytes()) % count.max(1)
}

/// What this replica holds, shared by every part that writes.
#[derive(Debug)]
pub struct Shards {
    count: u32,
    /// `None`: a single replica, which owns everything.
    held: Option<Mutex<Held>>,
    changed: tokio::sync::watch::Sender<u64>,
}

#[derive(Debug, Default)]
struct Held {
    /// Until when each shard may be written for, by shard.
    until: Vec<Option<Instant>>,
    /// Where the holder of each shard serves agents, when known.
    served_at: Vec<Option<String>>,
}

impl Shards {
    /// A lone replica: every node is its own, always.
    pub fn single() -> Self {
        Shards {
            count: 1,
            held: None,
            changed: tokio::sync::watch::Sender::new(0),
        }
    }

    /// A replica among others, holding nothing yet, of `count` shards.
    pub fn shared(count: u32) -> Self {
        let count = count.max(1);
        Shards {
            count,
            held: Some(Mutex::new(Held {
                until: vec![None; count as usize],
                served_at: vec![None; count as usize],
            })),
            changed: tokio::sync::watch::Sender::new(0),
        }
    }

    /// How many shards the fleet is cut into.
    pub fn count(&self) -> u32 {
        self.count
    }

    /// Whether the fleet is shared between replicas.
    pub fn is_shared(&self) -> bool {
        self.held.is_some()
    }

    /// The shard of `node`.
    pub fn of(&self, node: &str) -> u32 {
        shard_of(node, self.count)
    }

    /// Whether this replica may write for shard `shard` now.
    pub fn holds(&self, shard: u32) -> bool {
        self.holds_at(shard, Instant::now())
    }

    fn holds_at(&self, shard: u32, now: Instant) -> bool {
        let Some(held) = &self.held else {
            return true;
        };
        let held = held.lock().expect("shards");
        held.until
            .get(shard as usize)
            .copied()
            .flatten()
            .is_some_and(|until| now < until)
    }

    /// Whether this replica serves `node` and may write about it now.
    pub fn serves(&self, node: &str) -> bool {
        self.holds(self.of(node))
    }

    /// Whether this replica runs the singletons now (it holds shard 0).
    pub fn leads(&self) -> bool {
        self.holds(0)
    }

    /// The shards this replica holds now.
    pub fn held(&self) -> Vec<u32> {
        let now = Instant::now();
        (0..self.count).filter(|s| self.holds_at(*s, now)).collect()
    }

    /// Where the replica serving `node` takes agents, if another one does
    /// and it said where.
    pub fn served_at(&self, node: &str) -> Option<String> {
        let held = self.held.as_ref()?.lock().expect("shards");
        held.served_at
            .get(self.of(node) as usize)
            .cloned()
            .flatten()
    }

    /// Told (a counter moves) whenever a shard is taken, given up or
    /// lets its time run out.
    pub fn subscribe(&self) -> tokio::sync::watch::Receiver<u64> {
        self.changed.subscribe()
    }

    /// Shard `shard` may be written for until `until` (`None`: not at all).
    pub(crate) fn set(&self, shard: u32, until: Option<Instant>) {
        let Some(held) = &self.held else { return };
        let was = self.holds(shard);
        if let Some(slot) = held.lock().expect("shards").until.get_mut(shard as usize) {
            *slot = until;
        }
        if was != self.holds(shard) {
            self.changed.send_modify(|n| *n += 1);
        }
    }

    /// Where the current holder of `shard` serves agents.
    pub(crate) fn set_served_at(&self, shard: u32, at: Option<String>) {
        let Some(held) = &self.held else { return };
        if let Some(slot) = held
            .lock()
            .expect("shards")
            .served_at
            .get_mut(shard as usize)
        {
            *slot = at;
        }
    }

    /// Forgets the shards whose time ran out, telling subscribers; called
    /// often by the lease keeper, so sessions end soon after.
    pub(crate) fn expire(&self) {
        let Some(held) = &self.held else { return };
        let now = Instant::now();
        let mut expired = false;
        for slot in held.lock().expect("shards").until.iter_mut() {
            if slot.is_some_and(|until| until <= now) {
                *slot = None;
                expired = true;
            }
        }
        if expired {
            self.changed.send_modify(|n| *n += 1);
        }
    }
}

/// What the lease keeper sees of one shard's Lease.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Seen {
    /// Held by this replica.
    Mine,
    /// Held by another replica that renewed it within a lease duration.
    Theirs,
    /// Held by nobody, or by a replica that let it run out.
    Free,
}

/// What to do with one shard this round.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Step {
    /// Renew the Lease this replica holds.
    Renew(u32),
    /// Take a free Lease.
    Acquire(u32),
    /// Give a Lease back (this replica holds more than its share).
    Release(u32),
}

/// A replica's fair share: the shards divided by the live replicas,
/// rounded up.
pub fn fair_share(shards: u32, replicas: u32) -> u32 {
    shards.div_ceil(replicas.max(1))
}

/// This round's steps: renew what is held up to the fair share, give back
/// the rest (the highest shards first, so shard 0, the singletons, moves
/// least), and take free shards up to the share. `first_free` rotates
/// where the search for free shards starts, so replicas starting together
/// do not all race for the same ones.
pub fn plan(seen: &[Seen], replicas: u32, first_free: usize) -> Vec<Step> {
    let share = fair_share(seen.len() as u32, replicas) as usize;
    let mine: Vec<u32> = (0..seen.len() as u32)
        .filter(|s| seen[*s as usize] == Seen::Mine)
        .collect();
    let mut steps: Vec<Step> = Vec::new();
    for (i, shard) in mine.iter().enumerate() {
        steps.push(match i < share {
            true => Step::Renew(*shard),
            false => Step::Release(*shard),
        });
    }
    let missing = share.saturating_sub(mine.len());
    let n = seen.len();
    steps.extend(
        (0..n)
            .map(|i| (first_free + i) % n.max(1))
            .filter(|s| seen[*s] == Seen::Free)
            .take(missing)
            .map(|s| Step::Acquire(s as u32)),
    );
    steps
}

/// Until when a Lease renewed by a request sent at `sent` may be written
/// for: the lease duration, less a tenth for clocks that run at different
/// rates.
pub fn valid_until(sent: Instant, lease: Duration) -> Instant {
    sent + lease - lease / 10
}

#[cfg(test)]
mod tests {
    use super::*;
    use Seen::{Free, Mine, Theirs};

    #[test]
    fn a_node_always_lands_on_the_same_shard() {
        assert_eq!(shard_of("edge-1", 12), shard_of("edge-1", 12));
        let spread: std::collections::HashSet<u32> = (0..200)
            .map(|i| shard_of(&format!("edge-{i}"), 12))
            .collect();
        assert_eq!(spread.len(), 12, "200 nodes cover every one of 12 shards");
        assert_eq!(shard_of("anything", 1), 0);
    }

    #[test]
    fn a_lone_replica_takes_every_free_shard() {
        let steps = plan(&[Free, Free, Free, Free], 1, 0);
        assert_eq!(
            steps,
            [0, 1, 2, 3].map(Step::Acquire).to_vec(),
            "one replica's share is the whole fleet"
        );
    }

    #[test]
    fn a_replica_joining_makes_the_holder_give_back_its_highest_shards() {
        let steps = plan(&[Mine, Mine, Mine, Mine], 2, 0);
        assert_eq!(
            steps,
            vec![
                Step::Renew(0),
                Step::Renew(1),
                Step::Release(2),
                Step::Release(3)
            ]
        );
    }

    #[test]
    fn shards_of_a_dead_replica_are_taken_up_to_the_share_only() {
        // Three replicas, six shards; the third died, its two ran out.
        let seen = [Mine, Mine, Theirs, Theirs, Free, Free];
        assert_eq!(
            plan(&seen, 2, 0),
            vec![Step::Renew(0), Step::Renew(1), Step::Acquire(4)]
        );
        assert_eq!(
            plan(&seen, 2, 5),
            vec![Step::Renew(0), Step::Renew(1), Step::Acquire(5)],
            "the search for free shards starts where told"
        );
        assert_eq!(fair_share(6, 3), 2);
        assert_eq!(fair_share(7, 3), 3);
        assert_eq!(fair_share(6, 0), 6);
    }

    #[test]
    fn a_shard_is_held_until_its_time_runs_out_and_no_longer() {
        let shards = Shards::shared(4);
        let mut told = shards.subscribe();
        assert!(!shards.serves("edge-1"), "a new replica holds nothing");
        let shard = shards.of("edge-1");
        let now = Instant::now();
        shards.set(shard, Some(now + Duration::from_secs(60)));
        assert!(shards.serves("edge-1"));
        assert!(told.has_changed().unwrap());
        told.borrow_and_update();
        assert_eq!(shards.held(), vec![shard]);
        assert!(!shards.holds_at(shard, now + Duration::from_secs(61)));
        shards.set(shard, Some(now));
        assert!(!shards.serves("edge-1"), "its time ran out");
        assert!(told.has_changed().unwrap(), "losing a shard is told");
        shards.expire();
        assert_eq!(shards.held(), Vec::<u32>::new());
    }

    #[test]
    fn a_lone_replica_serves_everything() {
        let shards = Shards::single();
        assert!(shards.serves("edge-1") && shards.leads());
        assert_eq!(shards.served_at("edge-1"), None);
    }

    #[test]
    fn the_fence_closes_before_another_replica_may_take_over() {
        let lease = Duration::from_secs(15);
        let sent = Instant::now();
        // Another replica sees the renewal no earlier than it was sent and
        // waits a whole lease duration after that.
        assert!(valid_until(sent, lease) < sent + lease);
    }
}
