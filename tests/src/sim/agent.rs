//! A simulated agent: the production agent session core over a simulated
//! store whose unflushed writes a crash loses.
//!
//! The store keeps what the real one keeps for the protocol: desired state,
//! each device's latest report, the two outbox flows (reports, events) in
//! one sequence space, and the event ids each device used per boot. Like
//! the real one, it hands out sequence numbers that never repeat (the real
//! store reserves them on disk), sends only entries at or below its durable
//! mark, answers a device only once what it said is durable, and forgets a
//! device's reports and event ids when the device leaves or its Device is
//! replaced.

use std::collections::BTreeMap;

use edgefleet_agent::store::{Desired, DesiredDevice, LatestReport, PendingUplink, StoredEvent};
use edgefleet_agent::sync::{Session, Step, UPLINK_BATCH, session};
use edgefleet_shared::codec::{DeviceEvent, DeviceReport};
use edgefleet_shared::proto::{self, Flow, agent_message};
use edgefleet_shared::{PropertyValue, ResourceKey, ResourceVersion};

use super::Sabotage;

/// What a store holds: desired state by key.
pub type Held = BTreeMap<ResourceKey, DesiredDevice>;

/// Everything in a store: what survives a power cut, or what the process
/// sees.
#[derive(Clone, Debug, Default, PartialEq)]
pub struct Disk {
    /// Desired state.
    pub desired: Held,
    /// The latest report of each device.
    pub latest: BTreeMap<ResourceKey, LatestReport>,
    /// The reports flow: which device's latest report each entry carries.
    pub reports: BTreeMap<u64, ResourceKey>,
    /// The events flow.
    pub events: BTreeMap<u64, StoredEvent>,
    /// The highest event id stored per device and boot.
    pub event_ids: BTreeMap<ResourceKey, BTreeMap<u64, u64>>,
}

/// An event a device raised and the agent answered as stored: it must
/// reach the cloud.
#[derive(Clone, Debug, PartialEq, Eq, PartialOrd, Ord)]
pub struct Answered {
    /// The agent's node.
    pub node: String,
    /// The device.
    pub key: ResourceKey,
    /// The Device object the agent held for it (and stored it as about,
    /// unless it is a resend).
    pub uid: String,
    /// The device's boot epoch.
    pub boot: u64,
    /// The device's id of the event in that boot.
    pub id: u64,
    /// Its content (unique: it names the node, device, boot and id).
    pub message: String,
    /// Recognised as a resend of an event stored before, so not stored
    /// again: the earlier copy, under whichever object it was stored as
    /// about, must reach the cloud.
    pub resend: bool,
}

/// One edge agent.
#[derive(Debug)]
pub struct Agent {
    /// Its node.
    pub node: String,
    /// Running (else crashed, waiting to restart).
    pub up: bool,
    /// What survives a power cut.
    pub durable: Disk,
    /// What the process sees: the durable state plus unflushed writes.
    pub current: Disk,
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
    /// Events devices sent that are answered once the next flush is done.
    pub unanswered: Vec<Answered>,
    // The next sequence number (never handed out twice, crash or not).
    next_seq: u64,
    // Every entry up to this one is on disk.
    durable_seq: u64,
}

/// Something the agent did that breaks an invariant.
pub type Violation = String;

impl Agent {
    /// A new agent of `node` with an empty store.
    pub fn new(node: &str) -> Self {
        Agent {
            node: node.to_owned(),
            up: true,
            durable: Disk::default(),
            current: Disk::default(),
            store_id: format!("store-{node}"),
            conn: None,
            session: Session::default(),
            waiting: None,
            unanswered: Vec::new(),
            next_seq: 1,
            durable_seq: 0,
        }
    }

    /// What the store holds, as versions.
    pub fn held(&self, durable: bool) -> BTreeMap<ResourceKey, ResourceVersion> {
        let held = if durable {
            &self.durable.desired
        } else {
            &self.current.desired
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
    ) -> Result<Vec<proto::AgentMessage>, Violation> {
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
                    // The simulated API server has Devices only.
                    let Desired::Device(desired) = desired else {
                        return Err(format!("agent {} was sent {key}, not a Device", self.node));
                    };
                    if let Some(held) = self.current.desired.get(&key) {
                        if held.version.uid == desired.version.uid
                            && held.version.generation > desired.version.generation
                        {
                            return Err(format!(
                                "agent {} replaced {key} {} with the older {}",
                                self.node, held.version, desired.version
                            ));
                        }
                        if held.version.uid != desired.version.uid
                            && sabotage != Some(Sabotage::ReportsByName)
                        {
                            self.forget(&key);
                        }
                    }
                    self.current.desired.insert(key, *desired);
                }
                for key in removals {
                    self.current.desired.remove(&key);
                    self.forget(&key);
                }
                self.waiting = Some(reply);
                Ok(Vec::new())
            }
            Step::UplinkAcked {
                mut reports,
                mut events,
            } => {
                if sabotage == Some(Sabotage::OneMarkForBothFlows) {
                    reports = reports.max(events);
                    events = reports;
                }
                let out = &mut self.current;
                out.reports.retain(|seq, _| *seq > reports);
                out.events.retain(|seq, _| *seq > events);
                Ok(Vec::new())
            }
            Step::Nothing => Ok(Vec::new()),
            Step::ListHoldings { parts } => {
                let held: Vec<_> = self.held(false).into_iter().collect();
                Ok(session::inventory(&held, parts)
                    .into_iter()
                    .map(|part| wrap(agent_message::Kind::Inventory(part)))
                    .collect())
            }
        }
    }

    /// A device that left the node, or whose Device was replaced, starts
    /// afresh: its latest report and event ids are about an object gone.
    fn forget(&mut self, key: &ResourceKey) {
        if let Some(latest) = self.current.latest.remove(key) {
            self.current.reports.remove(&latest.seq);
        }
        self.current.event_ids.remove(key);
    }

    fn take_seq(&mut self) -> u64 {
        let seq = self.next_seq;
        self.next_seq += 1;
        seq
    }

    /// Device `key` reports; `marker` makes the report unique. The report
    /// says which object it is about (the uid the agent holds now), so a
    /// status can be checked against it. Returns false for a device the
    /// agent does not hold (the real agent refuses those).
    pub fn report(&mut self, key: &ResourceKey, marker: i64) -> bool {
        let Some(held) = self.current.desired.get(key) else {
            return false;
        };
        let version = held.version.clone();
        let seq = self.take_seq();
        if let Some(previous) = self.current.latest.get(key) {
            self.current.reports.remove(&previous.seq);
        }
        let report = DeviceReport {
            applied_generation: version.generation,
            properties: BTreeMap::from([
                (
                    "about".to_owned(),
                    PropertyValue::String(version.uid.clone()),
                ),
                ("n".to_owned(), PropertyValue::Int(marker)),
            ]),
            firmware_version: None,
            firmware_failure: None,
        };
        let latest = LatestReport {
            seq,
            received_at_ms: marker,
            queued_at_ms: marker,
            uid: version.uid,
            report,
            health: None,
            edge_rollback: None,
            held_at_edge: None,
            overrides: BTreeMap::new(),
        };
        self.current.latest.insert(key.clone(), latest);
        self.current.reports.insert(seq, key.clone());
        true
    }

    /// Device `key` raises event `id` of `boot` (or sends it again). It is
    /// stored unless the device sent that id of that boot before, and
    /// answered once the next flush is done. Returns false for a device
    /// the agent does not hold.
    pub fn event(
        &mut self,
        key: &ResourceKey,
        boot: u64,
        id: u64,
        sabotage: Option<Sabotage>,
    ) -> bool {
        let Some(held) = self.current.desired.get(key) else {
            return false;
        };
        let uid = held.version.uid.clone();
        let message = format!("{} {key} boot {boot} event {id}", self.node);
        let ids = self.current.event_ids.entry(key.clone()).or_default();
        let highest = if sabotage == Some(Sabotage::IgnoreBootEpochs) {
            ids.values().copied().max()
        } else {
            ids.get(&boot).copied()
        };
        let new = highest.is_none_or(|h| id > h);
        if new {
            ids.insert(boot, id);
            let seq = self.take_seq();
            let stored = StoredEvent {
                device: key.to_string(),
                at_ms: 0,
                uid: uid.clone(),
                event: DeviceEvent {
                    id,
                    boot,
                    warning: false,
                    reason: "SelfCheck".into(),
                    message: message.clone(),
                },
            };
            self.current.events.insert(seq, stored);
        }
        self.unanswered.push(Answered {
            node: self.node.clone(),
            key: key.clone(),
            uid,
            boot,
            id,
            message,
            resend: !new,
        });
        true
    }

    /// Whether there are writes a flush would make durable.
    pub fn unflushed(&self) -> bool {
        self.durable != self.current
            || self.waiting.is_some()
            || !self.unanswered.is_empty()
            || self.durable_seq + 1 < self.next_seq
    }

    /// The store flushes; returns the reply that waited for it and the
    /// events now answered to their devices.
    pub fn flush(&mut self) -> (Option<proto::AgentMessage>, Vec<Answered>) {
        self.durable = self.current.clone();
        self.durable_seq = self.next_seq - 1;
        let answered = std::mem::take(&mut self.unanswered);
        (self.waiting.take().map(wrap), answered)
    }

    /// What the production driver sends after every turn: durable outbox
    /// entries not sent yet in this session, reports first, as far as each
    /// flow's window allows.
    pub fn uplink(&mut self, sabotage: Option<Sabotage>) -> Vec<proto::AgentMessage> {
        let mut messages = Vec::new();
        if self.conn.is_none() || self.waiting.is_some() {
            return messages;
        }
        let durable_seq = if sabotage == Some(Sabotage::SendBeforeDurable) {
            self.next_seq - 1
        } else {
            self.durable_seq
        };
        for flow in Flow::ALL {
            loop {
                let (after, room) = self.session.next_batch(flow, UPLINK_BATCH);
                if after >= durable_seq {
                    break;
                }
                let batch: Vec<(u64, PendingUplink)> = match flow {
                    Flow::Reports => self
                        .current
                        .reports
                        .range(after + 1..=durable_seq)
                        .take(room)
                        .map(|(seq, key)| {
                            let mut latest = self.current.latest[key].clone();
                            if sabotage == Some(Sabotage::ReportsByName)
                                && let Some(held) = self.current.desired.get(key)
                            {
                                latest.uid = held.version.uid.clone();
                            }
                            let device = key.clone();
                            (*seq, PendingUplink::Report { device, latest })
                        })
                        .collect(),
                    Flow::Events => self
                        .current
                        .events
                        .range(after + 1..=durable_seq)
                        .take(room)
                        .map(|(seq, stored)| {
                            let device = stored.device.parse().expect("stored keys parse");
                            let stored = stored.clone();
                            (*seq, PendingUplink::Event { device, stored })
                        })
                        .collect(),
                };
                if batch.is_empty() {
                    break;
                }
                let uplink = self.session.uplink(batch);
                messages.push(wrap(agent_message::Kind::Uplink(uplink)));
            }
        }
        messages
    }

    /// Power cut: everything not flushed is gone, the stream too.
    pub fn crash(&mut self) {
        self.up = false;
        self.current = self.durable.clone();
        self.waiting = None;
        self.unanswered.clear();
        self.conn = None;
        self.session = Session::default();
    }
}

fn wrap(kind: agent_message::Kind) -> proto::AgentMessage {
    proto::AgentMessage { kind: Some(kind) }
}
