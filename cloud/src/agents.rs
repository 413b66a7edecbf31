//! Which agents are connected, and what each one holds.
//!
//! "Holds" means the agent said so (in its Hello or Inventory) or
//! acknowledged an Update that carried the Device; an acknowledged removal
//! ends it. The Device reconciler asks this before it lets a deleted Device
//! go, so that `kubectl delete` returns once the edge has dropped the device.
//!
//! The holdings outlive the session, with the store they belong to: a
//! reconnecting agent whose Hello digest matches them is not asked to list
//! what it holds ([`Agents::remembered`]). A controller that has just
//! started remembers nothing, but the Devices' statuses say what was
//! delivered where ([`delivered_to`]); a digest that matches those needs no
//! list either.

use std::collections::{BTreeMap, HashMap};
use std::sync::Mutex;
use std::time::Instant;

use edgefleet_shared::api::Device;
use edgefleet_shared::holdings::HoldingsDigest;
use edgefleet_shared::{ResourceKey, ResourceVersion};
use kube::ResourceExt;
use tokio::sync::watch;

/// The agents this process has talked to, by node name.
#[derive(Debug, Default)]
pub struct Agents {
    nodes: Mutex<HashMap<String, NodeAgent>>,
    // The newest session of each node. Session ids grow, so the newest is
    // the highest; an older session still open ends when it sees a newer.
    newest: Mutex<HashMap<String, watch::Sender<u64>>>,
}

#[derive(Debug)]
struct NodeAgent {
    // The open session; a reconnecting agent may open its new stream before
    // the old one is noticed closed, and only the newest session speaks for
    // the node. `None` while disconnected.
    session: Option<u64>,
    // When the last session ended, while there is none.
    gone_since: Option<Instant>,
    // The store the holdings are in.
    store_id: String,
    held: BTreeMap<ResourceKey, ResourceVersion>,
}

impl Agents {
    /// A session of `node` opened (its Hello arrived): it speaks for the
    /// node from now on. Returns the node's newest session, which every
    /// session watches to end once a newer one has claimed its node.
    pub fn claim(&self, node: &str, session: u64) -> watch::Receiver<u64> {
        let mut newest = self.newest.lock().expect("agents lock");
        let sender = newest
            .entry(node.to_owned())
            .or_insert_with(|| watch::Sender::new(session));
        sender.send_if_modified(|newest| {
            let newer = session > *newest;
            *newest = (*newest).max(session);
            newer
        });
        sender.subscribe()
    }

    /// The newest session of `node`, if it had one.
    pub fn newest(&self, node: &str) -> Option<u64> {
        let newest = self.newest.lock().expect("agents lock");
        newest.get(node).map(|s| *s.borrow())
    }

    /// A session for `node` knows what its agent's store `store_id` holds:
    /// `held`. False if a newer session has claimed the node meanwhile;
    /// this one must end.
    pub fn connected(
        &self,
        node: &str,
        session: u64,
        store_id: &str,
        held: BTreeMap<ResourceKey, ResourceVersion>,
    ) -> bool {
        if self.newest(node).is_some_and(|newest| newest != session) {
            return false;
        }
        let agent = NodeAgent {
            session: Some(session),
            gone_since: None,
            store_id: store_id.to_owned(),
            held,
        };
        self.lock().insert(node.to_owned(), agent);
        true
    }

    /// The agent acknowledged an Update with these upserts and removals.
    pub fn acknowledged<'a>(
        &self,
        node: &str,
        session: u64,
        upserted: impl IntoIterator<Item = &'a (ResourceKey, ResourceVersion)>,
        removed: impl IntoIterator<Item = &'a ResourceKey>,
    ) {
        let mut nodes = self.lock();
        let Some(agent) = nodes.get_mut(node).filter(|a| a.session == Some(session)) else {
            return;
        };
        for (key, version) in upserted {
            agent.held.insert(key.clone(), version.clone());
        }
        for key in removed {
            agent.held.remove(key);
        }
    }

    /// The session ended; the holdings are kept for its next Hello.
    pub fn disconnected(&self, node: &str, session: u64) {
        if let Some(agent) = self
            .lock()
            .get_mut(node)
            .filter(|a| a.session == Some(session))
        {
            agent.session = None;
            agent.gone_since = Some(Instant::now());
        }
    }

    /// Forgets when the agents of the nodes `of` picks were last here, for
    /// those without a session now: this replica takes their shard back,
    /// and what it saw before the shard left it says nothing of how long
    /// they have been away since (another replica served them). Their
    /// EdgeNodes say, as after a restart. The holdings stay (the Hello's
    /// digest says whether they still match).
    pub fn forget_absence(&self, of: impl Fn(&str) -> bool) {
        for (node, agent) in self.lock().iter_mut() {
            if agent.session.is_none() && of(node) {
                agent.gone_since = None;
            }
        }
    }

    /// What `node`'s agent held when this process last heard from it, if
    /// that was in store `store_id` and matches `digest`: what a Hello with
    /// that digest holds.
    pub fn remembered(
        &self,
        node: &str,
        store_id: &str,
        digest: &HoldingsDigest,
    ) -> Option<BTreeMap<ResourceKey, ResourceVersion>> {
        let nodes = self.lock();
        let agent = nodes.get(node).filter(|a| a.store_id == store_id)?;
        (HoldingsDigest::of(&agent.held) == *digest).then(|| agent.held.clone())
    }

    /// Whether `node`'s agent holds `key`; `None` if no agent of the node is
    /// connected.
    pub fn holds(&self, node: &str, key: &ResourceKey) -> Option<bool> {
        self.lock()
            .get(node)
            .filter(|a| a.session.is_some())
            .map(|a| a.held.contains_key(key))
    }

    /// When the last session of `node` ended, if it has none now and had
    /// one since this process started.
    pub fn disconnected_since(&self, node: &str) -> Option<Instant> {
        self.lock().get(node).and_then(|a| a.gone_since)
    }

    /// Whether an agent of `node` is connected.
    pub fn is_connected(&self, node: &str) -> bool {
        self.lock().get(node).is_some_and(|a| a.session.is_some())
    }

    fn lock(&self) -> std::sync::MutexGuard<'_, HashMap<String, NodeAgent>> {
        self.nodes.lock().expect("agents lock")
    }
}

/// What `node`'s agent holds according to the Devices' statuses: every
/// Device on the node, deleted or not, with its delivered generation. It is
/// right unless a delivery or removal acknowledged just before a restart
/// had not reached status yet, or a Device moved between nodes; the Hello
/// digest tells.
pub fn delivered_to<'a>(
    node: &str,
    devices: impl IntoIterator<Item = &'a Device>,
) -> BTreeMap<ResourceKey, ResourceVersion> {
    devices
        .into_iter()
        .filter(|d| d.spec.node == node)
        .filter_map(|d| {
            let generation = d.status.as_ref()?.delivered_generation?;
            let key = ResourceKey::device(d.namespace()?, d.name_any());
            Some((key, ResourceVersion::new(d.uid()?, generation)))
        })
        .collect()
}

#[cfg(test)]
mod tests {
    use super::*;

    fn entry(name: &str, generation: i64) -> (ResourceKey, ResourceVersion) {
        (
            ResourceKey::device("plant", name),
            ResourceVersion::new(format!("uid-{name}"), generation),
        )
    }

    fn key(name: &str) -> ResourceKey {
        entry(name, 1).0
    }

    fn held(entries: &[(ResourceKey, ResourceVersion)]) -> BTreeMap<ResourceKey, ResourceVersion> {
        entries.iter().cloned().collect()
    }

    fn digest(entries: &[(ResourceKey, ResourceVersion)]) -> HoldingsDigest {
        HoldingsDigest::of(entries.iter().map(|(k, v)| (k, v)))
    }

    #[test]
    fn a_shard_taken_back_forgets_how_long_its_nodes_were_away_but_not_what_they_hold() {
        let agents = Agents::default();
        for (node, session) in [("edge-1", 1), ("edge-2", 2), ("edge-3", 3)] {
            agents.connected(node, session, "s", held(&[entry("a", 1)]));
        }
        agents.disconnected("edge-1", 1);
        agents.disconnected("edge-2", 2);
        agents.forget_absence(|node| node != "edge-2");
        // Taken back: no absence of its own; the EdgeNode says.
        assert_eq!(agents.disconnected_since("edge-1"), None);
        // Another shard's node keeps it; a connected one has none.
        assert!(agents.disconnected_since("edge-2").is_some());
        assert!(agents.is_connected("edge-3"));
        // The holdings stay for the next Hello.
        let remembered = agents.remembered("edge-1", "s", &digest(&[entry("a", 1)]));
        assert_eq!(remembered, Some(held(&[entry("a", 1)])));
    }

    #[test]
    fn holdings_follow_hello_and_acknowledgements() {
        let agents = Agents::default();
        assert_eq!(agents.holds("edge-1", &key("a")), None);
        agents.connected("edge-1", 1, "s1", held(&[entry("a", 1)]));
        assert_eq!(agents.holds("edge-1", &key("a")), Some(true));
        agents.acknowledged("edge-1", 1, &[entry("b", 1)], &[key("a")]);
        assert_eq!(agents.holds("edge-1", &key("a")), Some(false));
        assert_eq!(agents.holds("edge-1", &key("b")), Some(true));
        assert_eq!(agents.disconnected_since("edge-1"), None);
        agents.disconnected("edge-1", 1);
        assert_eq!(agents.holds("edge-1", &key("b")), None);
        assert!(agents.disconnected_since("edge-1").is_some());
        agents.connected("edge-1", 2, "s1", BTreeMap::new());
        assert_eq!(agents.disconnected_since("edge-1"), None);
    }

    #[test]
    fn only_the_newest_session_speaks_for_a_node() {
        let agents = Agents::default();
        agents.connected("edge-1", 1, "s1", held(&[entry("a", 1)]));
        agents.connected("edge-1", 2, "s1", held(&[entry("a", 1)]));
        // The old session's late acknowledgement and its end change nothing.
        agents.acknowledged("edge-1", 1, &[], &[key("a")]);
        agents.disconnected("edge-1", 1);
        assert_eq!(agents.holds("edge-1", &key("a")), Some(true));
        agents.disconnected("edge-1", 2);
        assert!(!agents.is_connected("edge-1"));
    }

    #[test]
    fn a_newer_session_supersedes_an_older_one() {
        let agents = Agents::default();
        let first = agents.claim("edge-1", 1);
        assert!(agents.connected("edge-1", 1, "s1", held(&[entry("a", 1)])));
        let second = agents.claim("edge-1", 2);
        assert_eq!(
            *first.borrow(),
            2,
            "the first session sees it is not the newest"
        );
        assert!(first.has_changed().unwrap());
        // The old session learning its holdings late does not take over.
        assert!(!agents.connected("edge-1", 1, "s1", BTreeMap::new()));
        assert!(agents.connected("edge-1", 2, "s1", held(&[entry("a", 1)])));
        // A late claim of an older session changes nothing.
        agents.claim("edge-1", 1);
        assert_eq!(*second.borrow(), 2);
        assert_eq!(agents.holds("edge-1", &key("a")), Some(true));
    }

    #[test]
    fn device_statuses_say_what_was_delivered_where() {
        use edgefleet_shared::api::DeviceStatus;
        let device = |name: &str, node: &str, delivered: Option<i64>| {
            let uid = format!("uid-{name}");
            let mut d = crate::index::tests::device("plant", name, node, &uid, 3);
            d.status = Some(DeviceStatus {
                delivered_generation: delivered,
                ..Default::default()
            });
            d
        };
        let devices = [
            device("a", "edge-1", Some(3)),
            device("b", "edge-1", None), // not delivered yet
            device("c", "edge-2", Some(1)),
        ];
        assert_eq!(
            delivered_to("edge-1", &devices),
            held(&[entry("a", 3)]),
            "only what was delivered to this node"
        );
    }

    #[test]
    fn holdings_are_remembered_for_the_same_store_and_digest_only() {
        let agents = Agents::default();
        agents.connected("edge-1", 1, "s1", held(&[entry("a", 1), entry("b", 1)]));
        agents.acknowledged("edge-1", 1, &[entry("b", 2)], &[key("a")]);
        agents.disconnected("edge-1", 1);
        let now = [entry("b", 2)];
        assert_eq!(
            agents.remembered("edge-1", "s1", &digest(&now)),
            Some(held(&now))
        );
        // An Update the agent applied but whose Ack was lost: it holds more
        // than the cloud saw acknowledged, so the digest differs.
        assert_eq!(
            agents.remembered("edge-1", "s1", &digest(&[entry("b", 3)])),
            None
        );
        // A rebuilt store, another node, a node never seen.
        assert_eq!(agents.remembered("edge-1", "s2", &digest(&now)), None);
        assert_eq!(agents.remembered("edge-2", "s1", &digest(&now)), None);
    }
}
