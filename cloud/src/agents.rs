//! Which agents are connected and which Devices each one holds.
//!
//! "Holds" means the agent said so in its Hello or acknowledged an Update
//! that carried the Device; an acknowledged removal ends it. The Device
//! reconciler asks this before it lets a deleted Device go, so that
//! `kubectl delete` returns once the edge has dropped the device.

use std::collections::{HashMap, HashSet};
use std::sync::Mutex;
use std::time::Instant;

use edgefleet_shared::ResourceKey;

/// The connected agents, by node name.
#[derive(Debug, Default)]
pub struct Agents {
    nodes: Mutex<HashMap<String, Held>>,
    // When each node's last session ended (while it has none).
    gone: Mutex<HashMap<String, Instant>>,
}

#[derive(Debug)]
struct Held {
    // A reconnecting agent may open its new stream before the old one is
    // noticed closed; only the newest session speaks for the node.
    session: u64,
    keys: HashSet<ResourceKey>,
}

impl Agents {
    /// A session for `node` started, its agent holding `held`.
    pub fn connected(&self, node: &str, session: u64, held: impl IntoIterator<Item = ResourceKey>) {
        let keys = held.into_iter().collect();
        self.lock().insert(node.to_owned(), Held { session, keys });
        self.gone.lock().expect("agents lock").remove(node);
    }

    /// The agent acknowledged an Update with these upserts and removals.
    pub fn acknowledged<'a>(
        &self,
        node: &str,
        session: u64,
        upserted: impl IntoIterator<Item = &'a ResourceKey>,
        removed: impl IntoIterator<Item = &'a ResourceKey>,
    ) {
        let mut nodes = self.lock();
        let Some(held) = nodes.get_mut(node).filter(|h| h.session == session) else {
            return;
        };
        held.keys.extend(upserted.into_iter().cloned());
        for key in removed {
            held.keys.remove(key);
        }
    }

    /// The session ended.
    pub fn disconnected(&self, node: &str, session: u64) {
        let mut nodes = self.lock();
        if nodes.get(node).is_some_and(|h| h.session == session) {
            nodes.remove(node);
            self.gone
                .lock()
                .expect("agents lock")
                .insert(node.to_owned(), Instant::now());
        }
    }

    /// Whether `node`'s agent holds `key`; `None` if no agent of the node is
    /// connected.
    pub fn holds(&self, node: &str, key: &ResourceKey) -> Option<bool> {
        self.lock().get(node).map(|h| h.keys.contains(key))
    }

    /// When the last session of `node` ended, if it has none now and had
    /// one since this process started.
    pub fn disconnected_since(&self, node: &str) -> Option<Instant> {
        self.gone.lock().expect("agents lock").get(node).copied()
    }

    /// Whether an agent of `node` is connected.
    pub fn is_connected(&self, node: &str) -> bool {
        self.lock().contains_key(node)
    }

    fn lock(&self) -> std::sync::MutexGuard<'_, HashMap<String, Held>> {
        self.nodes.lock().expect("agents lock")
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn key(name: &str) -> ResourceKey {
        ResourceKey::device("plant", name)
    }

    #[test]
    fn holdings_follow_hello_and_acknowledgements() {
        let agents = Agents::default();
        assert_eq!(agents.holds("edge-1", &key("a")), None);
        agents.connected("edge-1", 1, [key("a")]);
        assert_eq!(agents.holds("edge-1", &key("a")), Some(true));
        agents.acknowledged("edge-1", 1, &[key("b")], &[key("a")]);
        assert_eq!(agents.holds("edge-1", &key("a")), Some(false));
        assert_eq!(agents.holds("edge-1", &key("b")), Some(true));
        assert_eq!(agents.disconnected_since("edge-1"), None);
        agents.disconnected("edge-1", 1);
        assert_eq!(agents.holds("edge-1", &key("b")), None);
        assert!(agents.disconnected_since("edge-1").is_some());
        agents.connected("edge-1", 2, []);
        assert_eq!(agents.disconnected_since("edge-1"), None);
    }

    #[test]
    fn only_the_newest_session_speaks_for_a_node() {
        let agents = Agents::default();
        agents.connected("edge-1", 1, [key("a")]);
        agents.connected("edge-1", 2, [key("a")]);
        // The old session's late acknowledgement and its end change nothing.
        agents.acknowledged("edge-1", 1, &[], &[key("a")]);
        agents.disconnected("edge-1", 1);
        assert_eq!(agents.holds("edge-1", &key("a")), Some(true));
        agents.disconnected("edge-1", 2);
        assert!(!agents.is_connected("edge-1"));
    }
}
