//! The simulated controller: the production cloud session core and agent
//! registry, over a watch view of the simulated API server that may lag
//! it, with status writes and Events that wait their turn (in any order,
//! as the status writer's and the Event workers' concurrency allows), may
//! fail and be retried, and die with the process.

use std::collections::{BTreeMap, BTreeSet};

use edgefleet_cloud::agents::Agents;
use edgefleet_cloud::sync::{Accepted, Effect, Opening, Session};
use edgefleet_shared::ResourceKey;
use edgefleet_shared::proto::{self, agent_message};

use super::api::Api;
use super::network::Network;

/// The controller process.
#[derive(Debug)]
pub struct Controller {
    /// Running.
    pub up: bool,
    /// The agent registry (lost with the process).
    pub agents: Agents,
    /// What the controller's watch has seen of the API server.
    pub view: Api,
    /// Sessions by stream id: the session id and its core.
    pub sessions: BTreeMap<u64, (u64, Session)>,
    next_session: u64,
    // The store each session's agent said it has.
    store_ids: BTreeMap<u64, String>,
    /// Status writes `Delivered` queued, not yet made.
    pub pending_status: Vec<(ResourceKey, String, i64)>,
    /// Every refusal ever recorded (Kubernetes Events outlive the process).
    pub refusals: BTreeSet<(ResourceKey, String)>,
    /// Uplink entries accepted and not yet durable: the stream and session
    /// they came on, their sequence number, what to write.
    pub pending_uplink: Vec<(u64, u64, u64, Accepted)>,
}

impl Controller {
    /// A controller that starts with a fresh view of `api`.
    pub fn new(api: &Api) -> Self {
        Controller {
            up: true,
            agents: Agents::default(),
            view: api.clone(),
            sessions: BTreeMap::new(),
            next_session: 0,
            store_ids: BTreeMap::new(),
            pending_status: Vec::new(),
            refusals: BTreeSet::new(),
            pending_uplink: Vec::new(),
        }
    }

    /// The process dies: sessions, registry and queued writes are gone.
    pub fn crash(&mut self, net: &mut Network, rng: &mut rand_chacha::ChaCha8Rng) {
        self.up = false;
        for (conn, _) in std::mem::take(&mut self.sessions) {
            net.cut(conn, rng);
            if let Some(c) = net.conns.get_mut(&conn) {
                c.cloud_done = true;
            }
        }
        // Streams whose Hello had not arrived die too.
        for (_, c) in net.conns.iter_mut() {
            c.cut = true;
            c.up.clear();
            c.cloud_done = true;
        }
        self.agents = Agents::default();
        self.pending_status.clear();
        self.pending_uplink.clear();
    }

    /// Starts again and relists.
    pub fn restart(&mut self, api: &Api) {
        let refusals = std::mem::take(&mut self.refusals);
        *self = Controller::new(api);
        self.refusals = refusals;
    }

    /// The watch delivers: the view catches up with `api`, and every
    /// session sees its node's slice.
    pub fn watch(&mut self, api: &Api, net: &mut Network) {
        self.view = api.clone();
        let conns: Vec<u64> = self.sessions.keys().copied().collect();
        for conn in conns {
            let (_, session) = self.sessions.get_mut(&conn).expect("listed");
            let slice = self.view.slice(session.node());
            let effects = session.slice_changed(slice);
            self.carry_out(conn, effects, net);
        }
    }

    /// A message from the agent on stream `conn` arrives. Returns false
    /// if the session ended (the stream is to be cut).
    pub fn received(&mut self, conn: u64, message: proto::AgentMessage, net: &mut Network) -> bool {
        if !self.sessions.contains_key(&conn) {
            return match message.kind {
                Some(agent_message::Kind::Hello(hello)) => self.open(conn, hello, net),
                // A stream whose session already ended: nobody reads it.
                _ => true,
            };
        }
        let (_, session) = self.sessions.get_mut(&conn).expect("checked");
        match session.received(message) {
            Ok(effects) => self.carry_out(conn, effects, net),
            Err(_) => false,
        }
    }

    fn open(&mut self, conn: u64, hello: proto::Hello, net: &mut Network) -> bool {
        let Ok(opening) = Opening::of(&hello) else {
            return false;
        };
        self.next_session += 1;
        let id = self.next_session;
        let _newest = self.agents.claim(&hello.node, id);
        let (known, _) = opening.known(
            |digest| self.agents.remembered(&hello.node, &hello.store_id, digest),
            || self.view.delivered_to(&hello.node),
        );
        let slice = self.view.slice(&hello.node);
        let (mut session, effects) = Session::open(&hello.node, &hello.store_id, slice, known);
        session.set_uplink_flows(hello.uplink_flows);
        self.sessions.insert(conn, (id, session));
        if let Some(c) = net.conns.get_mut(&conn) {
            c.session = Some(id);
        }
        self.store_ids.insert(id, hello.store_id);
        self.carry_out(conn, effects, net)
    }

    /// Makes the pending uplink entry `i` durable in `api`, and tells its
    /// session, if that is still open.
    pub fn write_uplink(
        &mut self,
        i: usize,
        api: &mut Api,
        net: &mut Network,
    ) -> Result<(), String> {
        let (conn, id, seq, entry) = self.pending_uplink.remove(i);
        match entry {
            Accepted::Status(key, change) => api.write_status(&key, change)?,
            Accepted::Event(event) => api.create_event(&event)?,
            Accepted::Dropped(_) => {}
        }
        let Some((current, session)) = self.sessions.get_mut(&conn) else {
            return Ok(());
        };
        if *current == id {
            let effects = session.uplink_durable(seq).into_iter().collect();
            self.carry_out(conn, effects, net);
        }
        Ok(())
    }

    /// Sessions a newer session of their node has superseded.
    pub fn superseded(&self) -> Vec<u64> {
        self.sessions
            .iter()
            .filter(|(_, (id, session))| self.agents.newest(session.node()) != Some(*id))
            .map(|(conn, _)| *conn)
            .collect()
    }

    /// The session on `conn` ended.
    pub fn end(&mut self, conn: u64) {
        if let Some((id, session)) = self.sessions.remove(&conn) {
            self.agents.disconnected(session.node(), id);
        }
    }

    fn carry_out(&mut self, conn: u64, effects: Vec<Effect>, net: &mut Network) -> bool {
        let Some((id, session)) = self.sessions.get(&conn) else {
            return false;
        };
        let (id, node) = (*id, session.node().to_owned());
        for effect in effects {
            match effect {
                Effect::Send(kind) => net.send_down(conn, proto::CloudMessage { kind: Some(kind) }),
                Effect::Live(held) => {
                    let store_id = self.store_ids.get(&id).cloned().unwrap_or_default();
                    if !self.agents.connected(&node, id, &store_id, held) {
                        return false;
                    }
                }
                Effect::Stored { upserts, removals } => {
                    self.agents.acknowledged(&node, id, &upserts, &removals);
                    for (key, version) in upserts {
                        self.pending_status
                            .push((key, version.uid, version.generation));
                    }
                }
                Effect::Holds(held) => {
                    for (key, version) in held {
                        self.pending_status
                            .push((key, version.uid, version.generation));
                    }
                }
                Effect::Refused { key, version, .. } => {
                    self.refusals.insert((key, version.to_string()));
                }
                Effect::Uplink { seq, entry } => self.pending_uplink.push((conn, id, seq, *entry)),
                Effect::Counted(_) | Effect::Figures { .. } => {}
            }
        }
        true
    }
}
