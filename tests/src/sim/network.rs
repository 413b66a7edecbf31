//! The simulated network: one connection per sync stream, each a pair of
//! FIFO queues.
//!
//! A gRPC stream runs over one HTTP/2 stream over TCP, so within a live
//! stream messages arrive in order, once. What the network does to the
//! protocol is therefore: cut a stream (losing a random tail of what was
//! still in flight each way), keep delivering an old stream's leftovers
//! after a new stream of the same agent opened (reordering across
//! sessions), delay anything (the scheduler picks what moves next), and —
//! a fault beyond TCP's, to prove idempotence — deliver a message twice.

use std::collections::{BTreeMap, VecDeque};

use edgefleet_shared::proto;
use rand::RngExt;
use rand_chacha::ChaCha8Rng;

/// One sync stream.
#[derive(Debug)]
pub struct Conn {
    /// Which agent dialled it (index into the world's agents).
    pub agent: usize,
    /// Agent to cloud, in order.
    pub up: VecDeque<proto::AgentMessage>,
    /// Cloud to agent, in order.
    pub down: VecDeque<proto::CloudMessage>,
    /// Cut: nothing more is sent; what is queued may still arrive.
    pub cut: bool,
    /// The cloud's session on it, once the Hello arrived.
    pub session: Option<u64>,
    /// The cloud noticed the end.
    pub cloud_done: bool,
    /// The agent noticed the end.
    pub agent_done: bool,
}

/// Every stream ever opened, by id.
#[derive(Debug, Default)]
pub struct Network {
    /// The streams.
    pub conns: BTreeMap<u64, Conn>,
    next: u64,
}

impl Network {
    /// An agent dials; returns the new stream's id.
    pub fn open(&mut self, agent: usize) -> u64 {
        self.next += 1;
        self.conns.insert(
            self.next,
            Conn {
                agent,
                up: VecDeque::new(),
                down: VecDeque::new(),
                cut: false,
                session: None,
                cloud_done: false,
                agent_done: false,
            },
        );
        self.next
    }

    /// Sends agent to cloud, unless the stream is cut.
    pub fn send_up(&mut self, conn: u64, message: proto::AgentMessage) {
        if let Some(c) = self.conns.get_mut(&conn).filter(|c| !c.cut) {
            c.up.push_back(message);
        }
    }

    /// Sends cloud to agent, unless the stream is cut.
    pub fn send_down(&mut self, conn: u64, message: proto::CloudMessage) {
        if let Some(c) = self.conns.get_mut(&conn).filter(|c| !c.cut) {
            c.down.push_back(message);
        }
    }

    /// Cuts a stream, losing a random tail of what is in flight each way.
    pub fn cut(&mut self, conn: u64, rng: &mut ChaCha8Rng) {
        if let Some(c) = self.conns.get_mut(&conn).filter(|c| !c.cut) {
            c.cut = true;
            let keep_up = rng.random_range(0..=c.up.len());
            c.up.truncate(keep_up);
            let keep_down = rng.random_range(0..=c.down.len());
            c.down.truncate(keep_down);
        }
    }

    /// Forgets streams both ends are done with.
    pub fn collect(&mut self) {
        self.conns.retain(|_, c| !(c.cloud_done && c.agent_done));
    }
}
