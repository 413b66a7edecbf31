//! A simulated agent: the production agent session core over a simulated
//! store whose unflushed writes a crash loses.

use std::collections::BTreeMap;

use edgefleet_agent::store::DesiredDevice;
use edgefleet_agent::sync::{Session, Step, session};
use edgefleet_shared::proto::{self, agent_message};
use edgefleet_shared::{ResourceKey, ResourceVersion};

use super::Sabotage;

/// What a store holds: desired state by key.
pub type Held = BTreeMap<ResourceKey, DesiredDevice>;

/// One edge agent.
#[derive(Debug)]
pub struct Agent {
    /// Its node.
    pub node: String,
    /// Running (else crashed, waiting to restart).
    pub up: bool,
    /// What survives a power cut.
    pub durable: Held,
    /// What the process sees: the durable state plus unflushed writes.
    pub current: Held,
    /// Its store's id.
    pub store_id: String,
    /// Its stream, if one is open.
    pub conn: Option<u64>,
    /// The session core of that stream.
    pub session: Session,
    /// A reply that waits for the flush of what it acknowledges. The
    /// production driver stores an Update before it reads the next message,
    /// so the simulated one reads nothing either while this is set.
    pub waiting: Option<agent_message::Kind>,
}

/// Something the agent did that breaks an invariant.
pub type Violation = String;

impl Agent {
    /// A new agent of `node` with an empty store.
    pub fn new(node: &str) -> Self {
        Agent {
            node: node.to_owned(),
            up: true,
            durable: Held::new(),
            current: Held::new(),
            store_id: format!("store-{node}"),
            conn: None,
            session: Session::default(),
            waiting: None,
        }
    }

    /// What the store holds, as versions.
    pub fn held(&self, durable: bool) -> BTreeMap<ResourceKey, ResourceVersion> {
        let held = if durable {
            &self.durable
        } else {
            &self.current
        };
        held.iter()
            .map(|(k, d)| (k.clone(), d.version.clone()))
            .collect()
    }

    /// The Hello of a new stream.
    pub fn hello(&self) -> proto::AgentMessage {
        let held = self.held(false);
        let hello = session::hello(&self.node, "sim", "boot", &self.store_id, held.iter());
        wrap(agent_message::Kind::Hello(hello))
    }

    /// Handles one message from the cloud; returns what to send at once.
    pub fn received(
        &mut self,
        message: proto::CloudMessage,
        sabotage: Option<Sabotage>,
    ) -> Result<Option<proto::AgentMessage>, Violation> {
        match self.session.received(message) {
            Step::Store {
                mut upserts,
                mut removals,
                reply,
            } => {
                let refused = matches!(reply, agent_message::Kind::Nack(_));
                if sabotage == Some(Sabotage::RefuseWholeUpdate) && refused {
                    upserts.clear();
                    removals.clear();
                }
                if sabotage == Some(Sabotage::KeepRemoved) {
                    removals.clear();
                }
                for (key, desired) in upserts {
                    if let Some(held) = self.current.get(&key)
                        && held.version.uid == desired.version.uid
                        && held.version.generation > desired.version.generation
                    {
                        return Err(format!(
                            "agent {} replaced {key} {} with the older {}",
                            self.node, held.version, desired.version
                        ));
                    }
                    self.current.insert(key, desired);
                }
                for key in removals {
                    self.current.remove(&key);
                }
                self.waiting = Some(reply);
                Ok(None)
            }
            Step::UplinkAcked { .. } | Step::Nothing => Ok(None),
            Step::ListHoldings => {
                let held: Vec<_> = self.held(false).into_iter().collect();
                Ok(Some(wrap(agent_message::Kind::Inventory(
                    session::inventory(&held),
                ))))
            }
        }
    }

    /// Whether there are writes a flush would make durable.
    pub fn unflushed(&self) -> bool {
        self.durable != self.current || self.waiting.is_some()
    }

    /// The store flushes; returns the reply that waited for it.
    pub fn flush(&mut self) -> Option<proto::AgentMessage> {
        self.durable = self.current.clone();
        self.waiting.take().map(wrap)
    }

    /// Power cut: everything not flushed is gone, the stream too.
    pub fn crash(&mut self) {
        self.up = false;
        self.current = self.durable.clone();
        self.waiting = None;
        self.conn = None;
        self.session = Session::default();
    }
}

fn wrap(kind: agent_message::Kind) -> proto::AgentMessage {
    proto::AgentMessage { kind: Some(kind) }
}
