//! A deterministic simulation of the sync protocol.
//!
//! One seeded scheduler drives one controller and several agents through
//! the very state machines production runs (`edgefleet_cloud::sync::Session`,
//! `edgefleet_agent::sync::Session`, the controller's agent registry, index
//! conversions, status rules and Event names), over a simulated network,
//! API server and disk. At each step it picks one enabled action at random:
//! deliver a message, flush an agent's store, let the controller's watch
//! catch up, make a queued status write or Event (or fail it), change the
//! fleet (create, update, delete, delete-and-recreate, move, a spec the
//! agent refuses), let a device report, raise an event, send an event
//! again or reboot (its event ids start over), cut a stream, duplicate a
//! message, crash an agent (losing what it had not flushed) or the
//! controller (losing its memory and queued writes), restart either.
//!
//! After the faulty phase the world quiesces (no more faults or churn;
//! everything restarts and every message is delivered) and the invariants
//! are checked; one is checked at every step. A failing seed replays
//! exactly: `EDGEFLEET_SIM_SEED=<seed>` runs it alone and prints its trace.
//!
//! Invariants:
//! - no agent ever replaces a version of a Device with an older generation
//!   of the same object (checked at every store write);
//! - after quiescence every agent holds exactly its node's Devices at their
//!   latest uid and generation, except a spec it refused, which it never
//!   holds and which the controller recorded as refused;
//! - nothing deleted or moved away is still held;
//! - every Device's status says its latest generation was delivered;
//! - a Device's status only ever shows a report about that object (checked
//!   at every write);
//! - newest report wins: a Device's status shows the latest report its
//!   agent holds for it;
//! - every event an agent answered as stored reaches the cloud as an Event
//!   of its own (its name holds that event, never another);
//! - every outbox drains.
//!
//! A device's reports and events that its node had not sent up when its
//! Device was deleted, replaced or moved away are refused by design; the
//! last three invariants hold for Devices that stayed where they were.

mod agent;
mod api;
mod controller;
mod network;

use std::collections::{BTreeMap, BTreeSet};

use edgefleet_cloud::status::StatusChange;
use edgefleet_shared::ResourceKey;
use rand::{RngExt, SeedableRng};
use rand_chacha::ChaCha8Rng;

use agent::{Agent, Answered};
use api::Api;
use controller::Controller;
use network::Network;

/// The size of a simulated world.
#[derive(Clone, Debug)]
pub struct Config {
    /// Edge nodes, one agent each.
    pub nodes: usize,
    /// Device names the churn picks from (few, so names are reused).
    pub names: usize,
    /// Steps of the faulty phase.
    pub steps: usize,
    /// A deliberate bug in the simulated agent, to prove the checks catch
    /// its kind.
    pub sabotage: Option<Sabotage>,
}

impl Default for Config {
    fn default() -> Self {
        Config {
            nodes: 3,
            names: 8,
            steps: 400,
            sabotage: None,
        }
    }
}

/// Bugs the simulated agent can be given on purpose.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Sabotage {
    /// Refuses a whole Update when one resource in it is invalid (the
    /// agent's behaviour before refusals became per resource).
    RefuseWholeUpdate,
    /// Ignores removals.
    KeepRemoved,
    /// Recognises a resent event by its id alone, not by boot and id, so
    /// a device's events after a reboot are taken for resends (the
    /// agent's behaviour before boot epochs).
    IgnoreBootEpochs,
    /// Keys reports by name: keeps a device's report when its Device is
    /// replaced and sends it as about the uid held at sending (the
    /// agent's behaviour before reports carried their uid).
    ReportsByName,
    /// Takes the further of the two flows' acknowledgements for both,
    /// dropping entries the cloud has not made durable.
    OneMarkForBothFlows,
    /// Sends outbox entries before they are durable (the agent's
    /// behaviour before its durable mark): the cloud may show what a crash
    /// then takes back.
    SendBeforeDurable,
}

/// What one run did.
#[derive(Clone, Debug, Default)]
pub struct Stats {
    /// Actions taken, the quiescence included.
    pub steps: u64,
    /// Messages delivered.
    pub messages: u64,
    /// Fleet changes.
    pub churn: u64,
    /// Streams cut.
    pub cuts: u64,
    /// Agent crashes.
    pub agent_crashes: u64,
    /// Controller crashes.
    pub controller_crashes: u64,
    /// Reports devices made.
    pub reports: u64,
    /// Events devices raised or sent again.
    pub events: u64,
}

/// A run that broke an invariant.
#[derive(Clone, Debug)]
pub struct Failure {
    /// The seed that replays it.
    pub seed: u64,
    /// What broke.
    pub violation: String,
    /// The actions taken, when tracing.
    pub trace: Vec<String>,
}

/// Most actions the quiescence may take before it counts as a livelock.
const QUIESCENCE_BOUND: u64 = 50_000;

/// Runs one seed; `trace` keeps a line per action.
pub fn run(seed: u64, config: &Config, trace: bool) -> Result<Stats, Failure> {
    let mut world = World::new(seed, config, trace);
    let result = world.play();
    result
        .map(|()| world.stats.clone())
        .map_err(|violation| Failure {
            seed,
            violation,
            trace: world.trace.take().unwrap_or_default(),
        })
}

#[derive(Clone, Copy, Debug)]
enum Action {
    DeliverUp(u64),
    DeliverDown(u64),
    Duplicate(u64),
    CloudNotices(u64),
    AgentNotices(u64),
    Connect(usize),
    Flush(usize),
    CrashAgent(usize),
    RestartAgent(usize),
    CrashController,
    RestartController,
    Watch,
    WriteStatus,
    WriteUplink,
    DeviceSays(usize),
    Churn,
    Cut(u64),
}

/// A device as the simulator plays it, keeping the device contract: its
/// boot epoch, its next event id in that boot, and the events it raised
/// that the agent has not confirmed, oldest first. A device sends the
/// oldest of those until it is confirmed, and raises a new one only when
/// none is left.
#[derive(Debug, Default)]
struct Life {
    boot: u64,
    next_id: u64,
    unconfirmed: std::collections::VecDeque<(u64, u64)>,
}

struct World {
    rng: ChaCha8Rng,
    config: Config,
    nodes: Vec<String>,
    api: Api,
    // The API server's state as the controller's watch last saw it.
    api_revision: u64,
    view_revision: u64,
    ctl: Controller,
    agents: Vec<Agent>,
    net: Network,
    stats: Stats,
    trace: Option<Vec<String>>,
    // Devices by agent and key.
    lives: BTreeMap<(usize, ResourceKey), Life>,
    // Events agents answered as stored.
    answered: BTreeSet<Answered>,
    // Makes every report unique.
    reports_made: i64,
    // Boot epochs handed out: each boot of each device has its own, as
    // random 64-bit epochs do.
    boots: u64,
    // In the faulty phase.
    faulty: bool,
}

impl World {
    fn new(seed: u64, config: &Config, trace: bool) -> Self {
        let nodes: Vec<String> = (0..config.nodes).map(|n| format!("edge-{n}")).collect();
        let api = Api::default();
        World {
            rng: ChaCha8Rng::seed_from_u64(seed),
            config: config.clone(),
            ctl: Controller::new(&api),
            agents: nodes.iter().map(|n| Agent::new(n)).collect(),
            nodes,
            api,
            api_revision: 0,
            view_revision: 0,
            net: Network::default(),
            stats: Stats::default(),
            trace: trace.then(Vec::new),
            lives: BTreeMap::new(),
            answered: BTreeSet::new(),
            reports_made: 0,
            boots: 0,
            faulty: false,
        }
    }

    fn play(&mut self) -> Result<(), String> {
        self.faulty = true;
        for _ in 0..self.config.steps {
            let actions = self.enabled(true);
            self.take(&actions)?;
        }
        self.faulty = false;
        self.note("-- quiescence".into());
        if !self.ctl.up {
            self.act(Action::RestartController)?;
        }
        for agent in 0..self.agents.len() {
            if !self.agents[agent].up {
                self.act(Action::RestartAgent(agent))?;
            }
        }
        let mut steps = 0;
        loop {
            let actions = self.enabled(false);
            if actions.is_empty() {
                break;
            }
            self.take(&actions)?;
            steps += 1;
            if steps > QUIESCENCE_BOUND {
                return Err(format!(
                    "no quiescence after {QUIESCENCE_BOUND} actions without faults (a livelock)"
                ));
            }
        }
        self.check_converged()
    }

    fn note(&mut self, line: String) {
        if let Some(trace) = &mut self.trace {
            trace.push(line);
        }
    }

    /// The actions possible now, with weights; faults and churn only if
    /// `faulty`.
    fn enabled(&self, faulty: bool) -> Vec<(Action, u32)> {
        let mut actions = Vec::new();
        for (&id, conn) in &self.net.conns {
            if self.ctl.up && !conn.cloud_done {
                if !conn.up.is_empty() {
                    actions.push((Action::DeliverUp(id), 40));
                } else if conn.cut {
                    actions.push((Action::CloudNotices(id), 5));
                }
            }
            let agent = &self.agents[conn.agent];
            if agent.up && agent.conn == Some(id) && agent.waiting.is_none() {
                if !conn.down.is_empty() {
                    actions.push((Action::DeliverDown(id), 40));
                } else if conn.cut {
                    actions.push((Action::AgentNotices(id), 5));
                }
            }
            if faulty && !conn.cut {
                actions.push((Action::Cut(id), 1));
                if !conn.up.is_empty() || !conn.down.is_empty() {
                    actions.push((Action::Duplicate(id), 1));
                }
            }
        }
        for (i, agent) in self.agents.iter().enumerate() {
            if agent.up {
                if agent.conn.is_none() && self.ctl.up {
                    actions.push((Action::Connect(i), 5));
                }
                if agent.unflushed() {
                    actions.push((Action::Flush(i), 15));
                }
                if faulty {
                    actions.push((Action::CrashAgent(i), 1));
                    if !agent.current.desired.is_empty() {
                        actions.push((Action::DeviceSays(i), 5));
                    }
                }
            } else {
                actions.push((Action::RestartAgent(i), 5));
            }
        }
        if self.ctl.up {
            if self.view_revision != self.api_revision {
                actions.push((Action::Watch, 10));
            }
            if !self.ctl.pending_status.is_empty() {
                actions.push((Action::WriteStatus, 10));
            }
            if !self.ctl.pending_uplink.is_empty() {
                actions.push((Action::WriteUplink, 15));
            }
            if faulty {
                actions.push((Action::CrashController, 1));
            }
        } else {
            actions.push((Action::RestartController, 5));
        }
        if faulty {
            actions.push((Action::Churn, 12));
        }
        actions
    }

    fn take(&mut self, actions: &[(Action, u32)]) -> Result<(), String> {
        let total: u32 = actions.iter().map(|(_, w)| w).sum();
        let mut pick = self.rng.random_range(0..total);
        for (action, weight) in actions {
            if pick < *weight {
                return self.act(*action);
            }
            pick -= weight;
        }
        unreachable!("the pick is below the total weight")
    }

    fn act(&mut self, action: Action) -> Result<(), String> {
        self.stats.steps += 1;
        if self.trace.is_some() {
            self.note(format!("{action:?}"));
        }
        match action {
            Action::DeliverUp(id) => {
                self.stats.messages += 1;
                let conn = self.net.conns.get_mut(&id).expect("enabled");
                let message = conn.up.pop_front().expect("enabled");
                if self.trace.is_some() {
                    self.note(format!("  up {id}: {}", brief_up(&message)));
                }
                if !self.ctl.received(id, message, &mut self.net) {
                    self.end_cloud_side(id);
                }
            }
            Action::DeliverDown(id) => {
                self.stats.messages += 1;
                let conn = self.net.conns.get_mut(&id).expect("enabled");
                let agent = conn.agent;
                let message = conn.down.pop_front().expect("enabled");
                if self.trace.is_some() {
                    self.note(format!("  down {id}: {}", brief_down(&message)));
                }
                let sabotage = self.config.sabotage;
                for reply in self.agents[agent].received(message, sabotage)? {
                    self.net.send_up(id, reply);
                }
                self.send_outbox(agent);
            }
            Action::Duplicate(id) => {
                let conn = self.net.conns.get_mut(&id).expect("enabled");
                if let Some(first) = conn.up.front().cloned() {
                    conn.up.push_front(first);
                } else if let Some(first) = conn.down.front().cloned() {
                    conn.down.push_front(first);
                }
            }
            Action::CloudNotices(id) => self.end_cloud_side(id),
            Action::AgentNotices(id) => {
                let conn = self.net.conns.get_mut(&id).expect("enabled");
                conn.agent_done = true;
                let agent = conn.agent;
                self.agents[agent].conn = None;
            }
            Action::Connect(agent) => {
                let id = self.net.open(agent);
                let hello = self.agents[agent].hello();
                let a = &mut self.agents[agent];
                a.conn = Some(id);
                a.session = Default::default();
                self.net.send_up(id, hello);
                self.send_outbox(agent);
            }
            Action::Flush(agent) => {
                let (reply, answered) = self.agents[agent].flush();
                for a in answered {
                    // The answer reaches the device, or is lost on the way
                    // (the device sends the event again).
                    if let Some(life) = self.lives.get_mut(&(agent, a.key.clone()))
                        && self.rng.random_bool(0.8)
                    {
                        life.unconfirmed
                            .retain(|(boot, id)| !(*boot == a.boot && *id <= a.id));
                    }
                    self.answered.insert(a);
                }
                if let Some(reply) = reply
                    && let Some(id) = self.agents[agent].conn
                {
                    self.net.send_up(id, reply);
                }
                self.send_outbox(agent);
            }
            Action::CrashAgent(agent) => {
                self.stats.agent_crashes += 1;
                if let Some(id) = self.agents[agent].conn {
                    self.net.cut(id, &mut self.rng);
                    if let Some(conn) = self.net.conns.get_mut(&id) {
                        conn.agent_done = true;
                        conn.down.clear();
                    }
                }
                self.agents[agent].crash();
            }
            Action::RestartAgent(agent) => self.agents[agent].up = true,
            Action::CrashController => {
                self.stats.controller_crashes += 1;
                self.ctl.crash(&mut self.net, &mut self.rng);
            }
            Action::RestartController => {
                self.ctl.restart(&self.api);
                self.view_revision = self.api_revision;
            }
            Action::Watch => {
                self.ctl.watch(&self.api, &mut self.net);
                self.view_revision = self.api_revision;
            }
            Action::WriteStatus => {
                let i = self.rng.random_range(0..self.ctl.pending_status.len());
                let (key, uid, generation) = self.ctl.pending_status.remove(i);
                self.api
                    .write_status(&key, StatusChange::Delivered { uid, generation })?;
                self.api_revision += 1;
            }
            Action::WriteUplink => {
                let i = self.rng.random_range(0..self.ctl.pending_uplink.len());
                // While faults are on, the API server fails one write in
                // ten; the writer tries again later.
                if self.faulty && self.rng.random_bool(0.1) {
                    self.note("  the API server fails the write".into());
                } else {
                    self.ctl.write_uplink(i, &mut self.api, &mut self.net)?;
                    self.api_revision += 1;
                }
            }
            Action::DeviceSays(agent) => self.device_says(agent),
            Action::Churn => {
                self.stats.churn += 1;
                let nodes = self.nodes.clone();
                let change = self.api.churn(&mut self.rng, self.config.names, &nodes);
                self.api_revision += 1;
                self.note(format!("  {change}"));
            }
            Action::Cut(id) => {
                self.stats.cuts += 1;
                self.net.cut(id, &mut self.rng);
            }
        }
        // A session whose node has a newer one ends (the production driver
        // watches the registry for this).
        for id in self.ctl.superseded() {
            self.note(format!("  superseded {id}"));
            self.end_cloud_side(id);
        }
        self.net.collect();
        Ok(())
    }

    /// What the agent's driver does after every turn: send what the
    /// outbox has for this session.
    fn send_outbox(&mut self, agent: usize) {
        let a = &mut self.agents[agent];
        if !a.up {
            return;
        }
        let Some(id) = a.conn else { return };
        for message in a.uplink(self.config.sabotage) {
            self.net.send_up(id, message);
        }
    }

    /// A device of `agent`'s node reports, raises an event, sends one
    /// again, or reboots.
    fn device_says(&mut self, agent: usize) {
        let keys: Vec<ResourceKey> = self.agents[agent].current.desired.keys().cloned().collect();
        let key = keys[self.rng.random_range(0..keys.len())].clone();
        let life = self.lives.entry((agent, key.clone())).or_insert_with(|| {
            self.boots += 1;
            Life {
                boot: self.boots,
                next_id: 1,
                unconfirmed: Default::default(),
            }
        });
        let sabotage = self.config.sabotage;
        let what = match self.rng.random_range(0..20) {
            0..=8 => {
                self.reports_made += 1;
                self.stats.reports += 1;
                self.agents[agent].report(&key, self.reports_made);
                format!("report {}", self.reports_made)
            }
            9..=17 => {
                self.stats.events += 1;
                if let Some((boot, id)) = life.unconfirmed.front().copied() {
                    self.agents[agent].event(&key, boot, id, sabotage);
                    format!("event {boot}/{id} again")
                } else {
                    let (boot, id) = (life.boot, life.next_id);
                    life.next_id += 1;
                    life.unconfirmed.push_back((boot, id));
                    self.agents[agent].event(&key, boot, id, sabotage);
                    format!("event {boot}/{id}")
                }
            }
            _ => {
                self.boots += 1;
                life.boot = self.boots;
                life.next_id = 1;
                format!("reboot into boot {}", life.boot)
            }
        };
        self.note(format!("  {key} on {}: {what}", self.nodes[agent]));
    }

    /// The controller ends its side of stream `id` (or notices its end).
    fn end_cloud_side(&mut self, id: u64) {
        self.ctl.end(id);
        self.net.cut(id, &mut self.rng);
        if let Some(conn) = self.net.conns.get_mut(&id) {
            conn.cloud_done = true;
            conn.up.clear();
        }
    }

    fn check_converged(&self) -> Result<(), String> {
        for agent in &self.agents {
            if agent.durable != agent.current {
                return Err(format!("agent {} has unflushed writes", agent.node));
            }
            let held = agent.held(true);
            for (key, version) in &held {
                match self.api.devices.get(key) {
                    None => {
                        return Err(format!(
                            "agent {} holds {key} {version}, which was deleted",
                            agent.node
                        ));
                    }
                    Some(d) if d.node != agent.node => {
                        return Err(format!(
                            "agent {} holds {key} {version}, which moved to {}",
                            agent.node, d.node
                        ));
                    }
                    Some(_) => {}
                }
            }
            for (key, d) in self
                .api
                .devices
                .iter()
                .filter(|(_, d)| d.node == agent.node)
            {
                let latest = d.version();
                let holds = held.get(key);
                if d.valid && holds != Some(&latest) {
                    return Err(format!(
                        "agent {} holds {key} at {holds:?}, not its latest {latest}",
                        agent.node
                    ));
                }
                if !d.valid {
                    if holds == Some(&latest) {
                        return Err(format!(
                            "agent {} holds {key} {latest}, a spec it must refuse",
                            agent.node
                        ));
                    }
                    if !self
                        .ctl
                        .refusals
                        .contains(&(key.clone(), latest.to_string()))
                    {
                        return Err(format!(
                            "the refusal of {key} {latest} by {} was never recorded",
                            agent.node
                        ));
                    }
                }
                let delivered = d.status.delivered_generation;
                if d.valid && delivered != Some(d.generation) {
                    return Err(format!(
                        "{key} {latest} is held by {} but its status says delivered {delivered:?}",
                        agent.node
                    ));
                }
            }
            if !agent.current.reports.is_empty() || !agent.current.events.is_empty() {
                return Err(format!(
                    "the outbox of {} still holds reports {:?} and events {:?}",
                    agent.node,
                    agent.current.reports.keys().collect::<Vec<_>>(),
                    agent.current.events.keys().collect::<Vec<_>>()
                ));
            }
            for (key, latest) in &agent.current.latest {
                if !self.stayed(key, &latest.uid, &agent.node) {
                    continue;
                }
                let shown = self.api.devices[key].status.reported.get("n");
                let made = latest.report.properties.get("n");
                if shown != made {
                    return Err(format!(
                        "the status of {key} shows report {shown:?}, not the latest {made:?} of {}",
                        agent.node
                    ));
                }
            }
        }
        for answered in &self.answered {
            let Answered {
                node,
                key,
                uid,
                boot,
                id,
                message,
                resend,
            } = answered;
            if !self.stayed(key, uid, node) {
                continue;
            }
            if *resend {
                if !self.api.events.values().any(|m| m == message) {
                    return Err(format!(
                        "{node} answered {message:?} as a resend, but it is in no Event"
                    ));
                }
                continue;
            }
            let name = Api::event_name(key, uid, *boot, *id);
            if self.api.events.get(&name) != Some(message) {
                return Err(format!(
                    "{node} answered {message:?} ({uid}) as stored, but Event {name} holds {:?}",
                    self.api.events.get(&name)
                ));
            }
        }
        Ok(())
    }

    /// Whether Device `key` is still object `uid` on `node`, and never
    /// moved: what its agent said about it must have reached its status
    /// and Events.
    fn stayed(&self, key: &ResourceKey, uid: &str, node: &str) -> bool {
        self.api
            .devices
            .get(key)
            .is_some_and(|d| d.uid == uid && d.node == node && !self.api.moved.contains(uid))
    }
}

fn brief_up(message: &edgefleet_shared::proto::AgentMessage) -> String {
    use edgefleet_shared::proto::agent_message::Kind;
    match &message.kind {
        Some(Kind::Hello(h)) => format!("Hello {} held {}", h.node, h.held_count),
        Some(Kind::Ack(a)) => format!("Ack {}", a.nonce),
        Some(Kind::Nack(n)) => format!(
            "Nack {} {:?}",
            n.nonce,
            n.rejected.iter().map(|r| &r.key).collect::<Vec<_>>()
        ),
        Some(Kind::Inventory(i)) => format!("Inventory of {}", i.held.len()),
        other => format!("{other:?}"),
    }
}

fn brief_down(message: &edgefleet_shared::proto::CloudMessage) -> String {
    use edgefleet_shared::proto::cloud_message::Kind;
    match &message.kind {
        Some(Kind::Update(u)) => format!(
            "Update {} upserts {:?} removals {:?}",
            u.nonce,
            u.upserts
                .iter()
                .map(|r| format!(
                    "{}@{}",
                    r.key,
                    r.version.as_ref().map(|v| v.generation).unwrap_or(-1)
                ))
                .collect::<Vec<_>>(),
            u.removals
        ),
        other => format!("{other:?}"),
    }
}
