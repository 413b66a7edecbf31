//! The agent's durable state, in sled: what the cloud wants (desired, and
//! the EdgeRules in `rules`), what devices last said (reported), what must
//! still go up (the outbox), the highest event id each device sent in each
//! of its recent boots (event_ids), where each rule stands for each device
//! it watches (`rule_watches`, see [`rules`]), and meta.
//!
//! The outbox holds two flows (see [`Flow`]), each a tree keyed by sequence
//! number, numbered from one sequence: reports (`report_outbox`) and events
//! (`outbox`). They go up and are acknowledged apart, so a backlog of
//! events never holds back status. Both are bounded: reports are compacted
//! to the latest per device, and events are kept in order up to a bound; at
//! the bound the oldest event makes room for the new one, and the drop is
//! counted and sent up as an [`PendingUplink::EventsDropped`] entry when the
//! link is there.
//!
//! Durable points are explicit: every write that is answered to somebody (an
//! Ack to the cloud, a success code to a device) is flushed first, and only
//! outbox entries known to be on disk go up: an entry the cloud saw and
//! acknowledged must not vanish in a power cut. Sequence numbers are
//! reserved on disk in blocks before they are handed out, and a restart
//! starts above the last block, so one handed out just before a crash is
//! never handed out again for other content.
//!
//! Only a store proven corrupt (sled says so, another schema version,
//! unreadable meta) is moved aside and a new one started: what can still be
//! read of its outbox goes into the new one, and the cloud resends desired
//! state on the next Hello. One unreadable outbox entry is dropped, not the
//! store. A store that is merely out of reach (held by another agent,
//! permission denied, disk full) is left as it is and the error says what to
//! do.

use std::collections::{BTreeMap, HashMap};
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use edgefleet_shared::api::Transport;
use edgefleet_shared::codec::{DesiredState, DeviceEvent, DeviceReport, FirmwareOrder};
use edgefleet_shared::credential::Psk;
use edgefleet_shared::health_check::{self, HealthCheck, HealthState};
use edgefleet_shared::health_gate::HealthGate;
use edgefleet_shared::key::ResourceKind;
pub use edgefleet_shared::proto::Flow;
use edgefleet_shared::rule_engine::{self, Override};
use edgefleet_shared::site_pacing::{HeldAtEdge, SitePacing};
use edgefleet_shared::site_rollback::{self, EdgeRollback, SiteRollback};
use edgefleet_shared::{PropertyValue, ResourceKey, ResourceVersion, proto};
use serde::{Deserialize, Serialize, de::DeserializeOwned};
use sled::Transactional;
use sled::transaction::{
    ConflictableTransactionError, ConflictableTransactionResult, TransactionError,
    TransactionalTree,
};
use tokio::sync::{Notify, broadcast};

pub mod rules;

/// Bumped when the layout of stored values changes; a store with another
/// version is moved aside and rebuilt from the cloud.
const SCHEMA_VERSION: u32 = 1;

const META_SCHEMA: &[u8] = b"schema_version";
const META_NEXT_SEQ: &[u8] = b"next_seq";
/// Sequence numbers below this are reserved: may have been handed out.
const META_SEQ_RESERVED: &[u8] = b"seq_reserved";
const META_STORE_ID: &[u8] = b"store_id";
// Written by the health probe; read by nobody.
const META_PROBE: &[u8] = b"probe";
const META_DROPPED_TOTAL: &[u8] = b"events_dropped_total";
const META_DROPPED_UNREPORTED: &[u8] = b"events_dropped_unreported";

/// Sequence numbers are reserved on disk this many at a time: one flush per
/// block, and a restart skips what is left of the last one.
pub const SEQ_BLOCK: u64 = 1024;

/// The default bound of events in the outbox (`--outbox-max-events`).
pub const DEFAULT_MAX_EVENTS: u64 = 50_000;

/// What the agent keeps of one Device's desired state.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct DesiredDevice {
    /// uid and generation of the Device this state comes from.
    pub version: ResourceVersion,
    /// The device model.
    pub model: String,
    /// How the device talks to the agent.
    pub transport: Transport,
    /// Desired property values.
    pub properties: BTreeMap<String, PropertyValue>,
    /// Desired firmware, if any.
    pub firmware: Option<FirmwareOrder>,
    /// The rollout health check of this generation, if any.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub health_check: Option<HealthCheck>,
    /// What to put back if the site crosses the rollout's failure
    /// threshold while the cloud is away, if the rollout says.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub site_rollback: Option<SiteRollback>,
    /// The site's part of the plan of the rollout that made this
    /// generation, if the agent paces it (see [`crate::site_pacing`]).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub site_pacing: Option<SitePacing>,
    /// Set while the agent holds this generation back: the device is told
    /// what it was told before.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub held_at_edge: Option<Held>,
    /// When a paced generation was released to the device (Unix ms).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub released_at_ms: Option<i64>,
    /// Set once this agent rolled the device back on its own; lasts until
    /// the cloud sends another generation.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub rolled_back_at_edge: Option<RolledBackAtEdge>,
    /// What EdgeRules acting at this agent set, by property: a layer on
    /// top of `properties`, kept across generations of the same Device.
    #[serde(default, skip_serializing_if = "BTreeMap::is_empty")]
    pub overrides: BTreeMap<String, Vec<Override>>,
    /// The revision of what the overrides make of the desired state (the
    /// device message's `local`): it grows whenever that changes.
    #[serde(default, skip_serializing_if = "is_zero")]
    pub local: u64,
    /// How deep in a chain of rules the last rule change to what the
    /// device is told was (0: none in this generation); a rule acting on
    /// the device's reports is one deeper.
    #[serde(default, skip_serializing_if = "is_zero")]
    pub chain: u32,
}

/// How a generation from the cloud arrives when the agent paces it: held,
/// with what the device was told `before` (the pacer releases it when the
/// site has a place), unless it is the generation held already (a resync
/// sends it again) or there is nothing before it to keep the device on.
fn pace_arrival(device: &mut DesiredDevice, before: Option<&DesiredDevice>, now_ms: i64) {
    let Some(pacing) = &device.site_pacing else {
        return;
    };
    let before = before.filter(|b| b.version.uid == device.version.uid);
    match before {
        Some(b) if b.version == device.version => {
            device.held_at_edge = b.held_at_edge.clone();
            device.released_at_ms = b.released_at_ms;
        }
        Some(b) => {
            let state = match &b.held_at_edge {
                Some(held) => held.state.clone(),
                None => b.to_wire(),
            };
            device.held_at_edge = Some(Held {
                mark: HeldAtEdge::new(pacing, device.version.generation, now_ms),
                state,
            });
        }
        None => device.released_at_ms = Some(now_ms),
    }
}

fn is_zero<N: Default + PartialEq>(n: &N) -> bool {
    *n == N::default()
}

/// A device the agent rolled back on its own: what it did, and what the
/// device is told instead of the held generation.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct RolledBackAtEdge {
    /// What it did, for the cloud.
    pub mark: EdgeRollback,
    /// The desired state put back.
    pub state: DesiredState,
}

/// A generation held back: why, and what the device is told meanwhile.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct Held {
    /// Why, for the cloud.
    pub mark: HeldAtEdge,
    /// What the device was told before the held generation came.
    pub state: DesiredState,
}

impl DesiredDevice {
    /// A device of `model` told `properties`, with nothing else: no
    /// firmware, no rollout, no rule's override.
    pub fn new(
        version: ResourceVersion,
        model: impl Into<String>,
        transport: Transport,
        properties: BTreeMap<String, PropertyValue>,
    ) -> Self {
        DesiredDevice {
            version,
            model: model.into(),
            transport,
            properties,
            firmware: None,
            health_check: None,
            site_rollback: None,
            site_pacing: None,
            held_at_edge: None,
            released_at_ms: None,
            rolled_back_at_edge: None,
            overrides: BTreeMap::new(),
            local: 0,
            chain: 0,
        }
    }

    /// What the device itself is told: the device wire format's message
    /// (what was put back, if the agent rolled the device back).
    pub fn to_wire(&self) -> DesiredState {
        if let Some(back) = &self.rolled_back_at_edge {
            return back.state.clone();
        }
        if let Some(held) = &self.held_at_edge {
            return held.state.clone();
        }
        DesiredState {
            generation: self.version.generation,
            properties: rule_engine::effective(&self.properties, &self.overrides).0,
            firmware: self.firmware.clone(),
            local: self.local,
        }
    }
}

/// An EdgeRule as this node's agent holds it (see `proto::RuleDesired`).
#[derive(Clone, Debug, PartialEq)]
pub struct HeldRule {
    /// The rule's uid and body digest.
    pub version: ResourceVersion,
    /// The rule, resolved to this node's devices.
    pub rule: proto::RuleDesired,
}

/// A resource kept as the protocol's own encoding of it.
fn encode_resource(
    key: &ResourceKey,
    version: &ResourceVersion,
    body: proto::resource::Body,
) -> Vec<u8> {
    use prost::Message;
    proto::Resource {
        key: key.to_string(),
        version: Some(version.into()),
        body: Some(body),
    }
    .encode_to_vec()
}

/// A resource kept by [`encode_resource`], decoded by `kind` (`None`: not
/// of its kind).
fn decode_resource<T>(
    key: &[u8],
    bytes: &[u8],
    kind: &str,
    of_kind: impl FnOnce(ResourceVersion, proto::resource::Body) -> Option<T>,
) -> Result<T, StoreError> {
    use prost::Message;
    let corrupt = |reason: String| StoreError::Corrupt {
        key: String::from_utf8_lossy(key).into_owned(),
        reason,
    };
    let resource = proto::Resource::decode(bytes).map_err(|e| corrupt(e.to_string()))?;
    match (resource.version, resource.body) {
        (Some(version), Some(body)) => of_kind((&version).into(), body),
        _ => None,
    }
    .ok_or_else(|| corrupt(format!("not a {kind}")))
}

impl HeldRule {
    fn encode(&self, key: &ResourceKey) -> Vec<u8> {
        encode_resource(
            key,
            &self.version,
            proto::resource::Body::Rule(self.rule.clone()),
        )
    }

    fn decode(key: &[u8], bytes: &[u8]) -> Result<Self, StoreError> {
        decode_resource(key, bytes, "rule", |version, body| match body {
            proto::resource::Body::Rule(rule) => Some(HeldRule { version, rule }),
            _ => None,
        })
    }
}

/// A device's key as its agent holds it (see
/// [`edgefleet_shared::credential`]).
#[derive(Clone, Debug, PartialEq)]
pub struct HeldCredential {
    /// The Secret's uid and the key's digest.
    pub version: ResourceVersion,
    /// The key.
    pub psk: Psk,
}

impl HeldCredential {
    fn encode(&self, key: &ResourceKey) -> Vec<u8> {
        let body = proto::resource::Body::Credential(proto::DeviceCredential {
            namespace: key.namespace.clone(),
            device: key.name.clone(),
            psk: self.psk.as_bytes().to_vec(),
        });
        encode_resource(key, &self.version, body)
    }

    fn decode(key: &[u8], bytes: &[u8]) -> Result<Self, StoreError> {
        decode_resource(
            key,
            bytes,
            "device credential",
            |version, body| match body {
                proto::resource::Body::Credential(c) => Some(HeldCredential {
                    version,
                    psk: Psk::new(c.psk).ok()?,
                }),
                _ => None,
            },
        )
    }
}

/// A resource of an update, as the store keeps it.
#[derive(Clone, Debug, PartialEq)]
pub enum Desired {
    /// A Device's desired state.
    Device(Box<DesiredDevice>),
    /// An EdgeRule.
    Rule(Box<HeldRule>),
    /// A device's key.
    Credential(HeldCredential),
}

impl From<DesiredDevice> for Desired {
    fn from(device: DesiredDevice) -> Self {
        Desired::Device(Box::new(device))
    }
}

/// Desired state that changed durably.
#[derive(Clone, Debug, PartialEq)]
pub struct DesiredChange {
    /// Devices added or changed.
    pub upserted: Vec<ResourceKey>,
    /// Devices removed.
    pub removed: Vec<ResourceKey>,
}

/// How many desired-state changes a slow watcher may fall behind.
pub const DESIRED_CHANGES_BUFFER: usize = 1024;

/// The latest report of one device, with the outbox sequence number it went
/// up under.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct LatestReport {
    /// Sequence number of the outbox entry that carries this report.
    pub seq: u64,
    /// When the agent received it (Unix milliseconds).
    pub received_at_ms: i64,
    /// When this content joined the outbox (Unix milliseconds); the same
    /// content heard again later only moves `received_at_ms`.
    #[serde(default)]
    pub queued_at_ms: i64,
    /// The uid of the Device the agent held for this device when the
    /// report came (empty if it held none): the object the report is
    /// about, so a report never lands on a Device recreated since.
    #[serde(default)]
    pub uid: String,
    /// What the device said.
    pub report: DeviceReport,
    /// The health check of the generation it applied, judged on this
    /// report, if its desired state has one.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub health: Option<HealthState>,
    /// The agent rolled the device back on its own, if it did.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub edge_rollback: Option<EdgeRollback>,
    /// The agent holds back the device's current generation, if it does
    /// (boxed: rare, and reports are many).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub held_at_edge: Option<Box<HeldAtEdge>>,
    /// The overrides of rules on the device when the report was stored.
    #[serde(default, skip_serializing_if = "BTreeMap::is_empty")]
    pub overrides: BTreeMap<String, Vec<Override>>,
}

/// While the cloud is connected, an unchanged report goes up again after
/// this long, so the cloud's `lastSeen` keeps moving for a steady device.
/// While it is not, unchanged reports never queue, and the clock restarts
/// when the link comes back: a resync carries only what changed (the
/// reconnect itself tells the cloud the node's devices are reachable).
pub const UNCHANGED_REPORT_KEEPALIVE_MS: i64 = 60_000;

/// One outbox entry, as stored: reports are compacted per device, so the
/// entry only names the device and the report itself sits in `reported`;
/// events and drop notices are stored whole.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
enum OutboxEntry {
    Report { device: String },
    Event(StoredEvent),
    EventsDropped(Dropped),
}

/// An event as the outbox keeps it.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct StoredEvent {
    /// The device's key.
    pub device: String,
    /// When the agent received it (Unix milliseconds).
    pub at_ms: i64,
    /// The uid of the Device the agent held for this device when the
    /// event came (empty if it held none).
    #[serde(default)]
    pub uid: String,
    /// What the device said.
    pub event: DeviceEvent,
}

/// How many boots of a device the store remembers the highest event id of.
/// A resend can only come from a boot before the current one if the device
/// kept the event across the reboot; a device that reboots four times
/// before such a resend arrives has it stored twice.
pub const BOOTS_REMEMBERED: usize = 4;

/// A device's highest stored event id in each of its last boots (see
/// [`DeviceEvent::boot`]), the latest boot last. On disk: 16 bytes per boot
/// (epoch, highest id; big-endian); a store from before boot epochs holds 8
/// bytes, the highest id of boot 0.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
struct EventIds(Vec<(u64, u64)>);

impl EventIds {
    fn decode(v: &[u8]) -> Option<Self> {
        if v.len() == 8 {
            return Some(EventIds(vec![(0, u64_from(v))]));
        }
        if !v.len().is_multiple_of(16) {
            return None;
        }
        Some(EventIds(
            v.chunks_exact(16)
                .map(|c| (u64_from(&c[..8]), u64_from(&c[8..])))
                .collect(),
        ))
    }

    fn encode(&self) -> Vec<u8> {
        self.0
            .iter()
            .flat_map(|(boot, id)| boot.to_be_bytes().into_iter().chain(id.to_be_bytes()))
            .collect()
    }

    /// The highest id stored in `boot` (0: none).
    fn highest(&self, boot: u64) -> u64 {
        self.0
            .iter()
            .find(|(b, _)| *b == boot)
            .map_or(0, |(_, id)| *id)
    }

    /// `id` of `boot` is stored: `boot` becomes the latest, and the oldest
    /// boot is forgotten beyond [`BOOTS_REMEMBERED`].
    fn record(&mut self, boot: u64, id: u64) {
        self.0.retain(|(b, _)| *b != boot);
        self.0.push((boot, id));
        if self.0.len() > BOOTS_REMEMBERED {
            self.0.remove(0);
        }
    }
}

/// Events dropped at the bound, not yet reported to the cloud.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct Dropped {
    /// How many.
    pub count: u64,
    /// When the first was dropped (Unix milliseconds).
    pub first_at_ms: i64,
    /// When the last was dropped (Unix milliseconds).
    pub last_at_ms: i64,
    /// The bound in force then.
    pub bound: u64,
}

/// An entry waiting to go up, with what it carries.
#[derive(Clone, Debug, PartialEq)]
pub enum PendingUplink {
    /// The latest report of a device.
    Report {
        /// Which device.
        device: ResourceKey,
        /// Its latest report.
        latest: LatestReport,
    },
    /// An event of a device.
    Event {
        /// Which device.
        device: ResourceKey,
        /// The event.
        stored: StoredEvent,
    },
    /// Events dropped at the bound.
    EventsDropped(Dropped),
}

impl PendingUplink {
    /// The flow it goes up in.
    pub fn flow(&self) -> Flow {
        match self {
            PendingUplink::Report { .. } => Flow::Reports,
            PendingUplink::Event { .. } | PendingUplink::EventsDropped(_) => Flow::Events,
        }
    }
}

/// What became of an event a device sent.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum EventOutcome {
    /// Stored durably under this outbox sequence number.
    Stored {
        /// Its sequence number.
        seq: u64,
        /// The outbox held its bound of events: the oldest was dropped.
        dropped_oldest: bool,
    },
    /// The device sent this id (or a later one) before: nothing was stored,
    /// and what was stored before is durable.
    Duplicate {
        /// The highest id stored for the device.
        highest: u64,
    },
}

/// Why the store failed.
#[derive(Debug, thiserror::Error)]
pub enum StoreError {
    /// sled failed.
    #[error("store: {0}")]
    Sled(#[from] sled::Error),
    // The messages below leave the cause to `source()`, so a report of
    // the chain (anyhow's, in main) does not print it twice.
    /// Another process holds the store's lock: most likely another agent.
    #[error(
        "another agent holds the store at {dir}: stop it, or give this agent a --data-dir of its own"
    )]
    Locked {
        /// The store's directory.
        dir: PathBuf,
        /// sled's report.
        source: std::io::Error,
    },
    /// The agent may not read or write the store's files.
    #[error(
        "permission denied on {dir}: the agent's user must be able to read and write it; the store was left as it is"
    )]
    PermissionDenied {
        /// The store's directory.
        dir: PathBuf,
        /// The file system's answer.
        source: std::io::Error,
    },
    /// The disk of the store is full.
    #[error("no space left on the disk of {dir}: free some; the store was left as it is")]
    NoSpace {
        /// The store's directory.
        dir: PathBuf,
        /// The file system's answer.
        source: std::io::Error,
    },
    /// The store does not open for another reason that does not prove it
    /// corrupt (e.g. a file where its directory should be).
    #[error("cannot open the store at {dir}; it was left as it is")]
    Unavailable {
        /// The store's directory.
        dir: PathBuf,
        /// sled's report.
        source: sled::Error,
    },
    /// A stored value does not decode.
    #[error("store: value under {key:?} is unreadable: {reason}")]
    Corrupt {
        /// Where.
        key: String,
        /// Why.
        reason: String,
    },
    /// Moving a broken store aside failed.
    #[error("store: cannot move the broken store at {path} aside: {source}")]
    MoveAside {
        /// The store's directory.
        path: PathBuf,
        /// The file system's answer.
        source: std::io::Error,
    },
}

/// The most memory sled's page cache may use.
pub const CACHE_BYTES: u64 = 64 * 1024 * 1024;

/// How long a held lock is retried before the store is taken to be held by
/// another agent: sled releases its file lock lazily once the last handle
/// is gone (spacejam/sled#1234), and an agent that just exited may still
/// hold it for a moment.
const LOCK_PATIENCE: Duration = Duration::from_secs(2);

/// Why an existing store did not open.
enum OpenError {
    /// The store is provably unusable: it may be moved aside. `db` is the
    /// database when sled could open it, to salvage from.
    Corrupt {
        reason: String,
        db: Option<sled::Db>,
    },
    /// Anything else: the store may well be fine, so it is left alone.
    Unavailable(StoreError),
}

impl OpenError {
    /// sled's corruption is proof; any other failure is not.
    fn from_sled(dir: &Path, db: Option<&sled::Db>, e: sled::Error) -> Self {
        match e {
            sled::Error::Corruption { .. } => OpenError::Corrupt {
                reason: format!("sled: {e}"),
                db: db.cloned(),
            },
            e => OpenError::Unavailable(unavailable(dir, e)),
        }
    }
}

/// What a failure of sled that is not corruption tells the operator.
fn unavailable(dir: &Path, e: sled::Error) -> StoreError {
    let dir = dir.to_owned();
    match e {
        // sled reports a held lock as an `Other` error that says so.
        sled::Error::Io(source)
            if source.kind() == std::io::ErrorKind::WouldBlock
                || source.to_string().contains("could not acquire lock") =>
        {
            StoreError::Locked { dir, source }
        }
        sled::Error::Io(source) if source.kind() == std::io::ErrorKind::PermissionDenied => {
            StoreError::PermissionDenied { dir, source }
        }
        sled::Error::Io(source) if source.kind() == std::io::ErrorKind::StorageFull => {
            StoreError::NoSpace { dir, source }
        }
        source => StoreError::Unavailable { dir, source },
    }
}

/// The agent's store.
#[derive(Clone, Debug)]
pub struct Store {
    // Every write that takes sequence numbers or removes outbox entries
    // holds this lock, so sequence numbers are committed in order and the
    // event count and the bound check agree with what is stored.
    outbox_lock: Arc<std::sync::Mutex<OutboxState>>,
    // How far sequence numbers are written and durable.
    seqs: Arc<SeqMarks>,
    // Synced after every flush, so what is acknowledged survives a power cut.
    files: Arc<SledFiles>,
    max_events: u64,
    store_id: String,
    // Since when a sync session is open (Unix ms), or 0 while none is (see
    // UNCHANGED_REPORT_KEEPALIVE_MS).
    link_up_since: Arc<std::sync::atomic::AtomicI64>,
    // Woken whenever an entry joins the outbox, so the uplink needs no polling.
    outbox_changed: Arc<Notify>,
    // Since when no sync session is open (Unix ms), or 0 while one is.
    link_down_since: Arc<std::sync::atomic::AtomicI64>,
    // Woken by a report of a device under a site rollback plan, and when
    // the link goes down (see crate::site_rollback).
    site_watch: Arc<Notify>,
    // Woken by a paced generation's arrival, and by a report of a paced
    // device while generations are held (see crate::site_pacing).
    pace_watch: Arc<Notify>,
    // How many generations the pacer's last pass left held: while none
    // is, a report cannot free a place anyone waits for.
    held_generations: Arc<std::sync::atomic::AtomicUsize>,
    // Every durable change of desired state, for the device-side publishers.
    desired_changes: broadcast::Sender<DesiredChange>,
    // Every device whose report became durable, for the rule engine.
    reports: broadcast::Sender<ResourceKey>,
    // Woken when the rules held change.
    rules_changed: Arc<Notify>,
    // By credential key: told when that device's key arrives, changes or
    // goes. Only devices someone watches (a logged-in MQTT connection) have
    // an entry, and only a changed key's watchers are told.
    credential_watchers: Arc<Mutex<HashMap<ResourceKey, tokio::sync::watch::Sender<()>>>>,
    // Told when any device's key arrives, changes or goes.
    any_credential: Arc<tokio::sync::watch::Sender<()>>,
    flusher: GroupFlush,
    db: sled::Db,
    desired: sled::Tree,
    // Rules by key (see HeldRule).
    rules: sled::Tree,
    // Device keys by credential key (see edgefleet_shared::credential).
    credentials: sled::Tree,
    // Where each rule stands for each device it watches (see rules).
    rule_watches: sled::Tree,
    reported: sled::Tree,
    // The reports flow of the outbox: device names by sequence number.
    reports_out: sled::Tree,
    // The events flow of the outbox: events and drop notices.
    events_out: sled::Tree,
    event_ids: sled::Tree,
    meta: sled::Tree,
    // Rollout health expressions, compiled once each.
    health_gates: Arc<std::sync::Mutex<HashMap<String, CompiledGate>>>,
}

/// A health expression compiled, or why it does not compile.
type CompiledGate = Arc<Result<HealthGate, String>>;

/// Health expressions kept compiled; past this many the cache starts over
/// (rollouts at one site at a time are few).
const HEALTH_GATES_CACHED: usize = 64;

/// The trees of the two outbox flows. The events flow keeps the name the
/// single outbox had, so a store from before flows opens with its events
/// in place; its reports move (see [`Store::open_existing`]).
const REPORTS_TREE: &str = "report_outbox";
const EVENTS_TREE: &str = "outbox";

/// What the writers of the outbox share, under [`Store::outbox_lock`].
#[derive(Debug, Default)]
struct OutboxState {
    /// Events in the outbox.
    events: u64,
    /// The first sequence number not reserved on disk yet.
    reserved: u64,
}

/// How far sequence numbers are written and durable.
#[derive(Debug, Default)]
struct SeqMarks {
    /// The highest sequence number whose write has committed (it may not be
    /// on disk yet). Writes commit in sequence order (under the outbox
    /// lock), so every entry up to it is committed.
    written: AtomicU64,
    /// The highest sequence number known to be on disk: a flush that
    /// started after its write committed has completed. Only entries up to
    /// it go up.
    durable: AtomicU64,
}

impl SeqMarks {
    /// Flushes `db` and syncs its `files`, then moves the durable mark up
    /// to what was written before the flush started.
    fn flush(&self, db: &sled::Db, files: &SledFiles) -> Result<(), sled::Error> {
        let covered = self.written.load(Ordering::SeqCst);
        db.flush()?;
        files.sync()?;
        self.durable.fetch_max(covered, Ordering::SeqCst);
        Ok(())
    }
}

/// What must be synced after a sled flush for it to survive a power cut.
///
/// sled 0.34 writes its log with `pwrite` and `sync_file_range`, which
/// pushes the pages to the device but neither flushes the device's cache
/// nor writes the file's metadata (a log that grew is cut back to its old
/// size); its own `fsync` of the log runs every 500 ms from a background
/// thread, so a power cut inside that window loses writes that were
/// already acknowledged. So every flush is followed by an `fdatasync` of
/// the log.
///
/// Names are made durable once, at open: sled creates its files and
/// writes its snapshot (`snap.*`, renamed into place) only while opening,
/// never syncing the directory, so the open syncs the store's directory
/// and its parent. A running store names nothing new: the only other files
/// sled 0.34 creates are blobs (`blobs/`), for an item over a quarter of a
/// 512 KiB segment, which the store's small values never make. The test
/// `a_running_store_writes_into_its_log_and_names_no_new_file` checks that
/// assumption, so a flush skips the directory fsync it would otherwise
/// need (which cost a lone writer about a fifth of its rate).
#[derive(Debug)]
struct SledFiles {
    /// The log, `<store>/db`.
    log: std::fs::File,
    /// Off only for the benchmark that measures what the syncs cost.
    enabled: std::sync::atomic::AtomicBool,
}

impl SledFiles {
    /// Opens the log of the sled database in `dir` (which sled has just
    /// opened) and makes the directories' entries durable: the store
    /// directory in its parent, sled's files and snapshot in the store
    /// directory.
    fn open(dir: &Path) -> std::io::Result<Self> {
        let files = SledFiles {
            log: std::fs::File::open(dir.join("db"))?,
            enabled: true.into(),
        };
        std::fs::File::open(dir.join("conf"))?.sync_all()?;
        std::fs::File::open(dir.join("blobs"))?.sync_all()?;
        std::fs::File::open(dir)?.sync_all()?;
        if let Some(parent) = dir.parent().filter(|p| !p.as_os_str().is_empty()) {
            std::fs::File::open(parent)?.sync_all()?;
        }
        Ok(files)
    }

    fn sync(&self) -> std::io::Result<()> {
        if self.enabled.load(Ordering::Relaxed) {
            self.log.sync_data()?;
        }
        Ok(())
    }
}

/// A store just opened, whether a corrupt one had to be moved aside, and
/// what of its contents was carried over or lost.
#[derive(Debug)]
pub struct Opened {
    /// The store.
    pub store: Store,
    /// Where the corrupt store was moved, and why, if it was.
    pub moved_aside: Option<(PathBuf, String)>,
    /// What was salvaged and what was lost.
    pub salvage: Salvage,
}

/// What opening the store carried over from a store moved aside, and what
/// it could not read and dropped (from a store moved aside, or from the
/// store it kept).
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct Salvage {
    /// Outbox entries carried into the new store, in their order, under new
    /// sequence numbers (with the reports they carry).
    pub entries: usize,
    /// Devices whose highest event id was carried over, so their resends
    /// are still recognised.
    pub event_ids: usize,
    /// What could not be read and is gone, each naming where and why.
    pub lost: Vec<String>,
}

/// What could be read out of a corrupt store before it is moved aside.
#[derive(Default)]
struct Rescued {
    /// Outbox entries in order, with what they carry.
    entries: Vec<PendingUplink>,
    /// The highest event id per device.
    event_ids: Vec<(sled::IVec, EventIds)>,
    lost: Vec<String>,
}

impl Rescued {
    /// Reads every outbox entry, report and event id that still decodes;
    /// reading stops at the first failure of sled in a tree.
    fn from(db: &sled::Db) -> Self {
        let mut rescued = Rescued::default();
        let mut entries = Vec::new();
        for name in [REPORTS_TREE, EVENTS_TREE] {
            match (db.open_tree(name), db.open_tree("reported")) {
                (Ok(outbox), Ok(reported)) => {
                    for item in outbox.iter() {
                        let (k, v) = match item {
                            Ok(kv) => kv,
                            Err(e) => {
                                rescued.lost.push(format!("the rest of {name}: {e}"));
                                break;
                            }
                        };
                        match read_entry(&reported, &k, &v) {
                            Ok(entry) => entries.push(entry),
                            Err(e) => rescued.lost.push(what_is_lost(e)),
                        }
                    }
                }
                (Err(e), _) | (_, Err(e)) => rescued.lost.push(format!("{name}: {e}")),
            }
        }
        // Both flows, in the order they were written.
        entries.sort_by_key(|(seq, _)| *seq);
        rescued.entries = entries.into_iter().map(|(_, pending)| pending).collect();
        // Drops not sealed into an entry yet go up as one, after the rest.
        if let Ok(Some(v)) = db
            .open_tree("meta")
            .and_then(|m| m.get(META_DROPPED_UNREPORTED))
        {
            match decode(META_DROPPED_UNREPORTED, &v) {
                Ok(dropped) => rescued.entries.push(PendingUplink::EventsDropped(dropped)),
                Err(e) => rescued.lost.push(what_is_lost(e)),
            }
        }
        match db.open_tree("event_ids") {
            Ok(ids) => {
                for item in ids.iter() {
                    match item {
                        Ok((k, v)) => match EventIds::decode(&v) {
                            Some(ids) => rescued.event_ids.push((k, ids)),
                            None => rescued.lost.push(format!(
                                "the highest event ids of {}: {} bytes",
                                String::from_utf8_lossy(&k),
                                v.len()
                            )),
                        },
                        Err(e) => {
                            rescued.lost.push(format!("the rest of the event ids: {e}"));
                            break;
                        }
                    }
                }
            }
            Err(e) => rescued.lost.push(format!("the event ids: {e}")),
        }
        rescued
    }
}

impl Store {
    /// Opens the store in `dir`, creating it if needed.
    ///
    /// A store proven corrupt (sled reports corruption, another schema
    /// version, unreadable meta) is renamed to `<dir>.broken-<unix seconds>`
    /// and a new one is created in its place. Any other failure (held by
    /// another agent, permission denied, disk full, not a directory) is
    /// returned as it is, and nothing is moved; a held lock is retried for
    /// 2 s first.
    ///
    /// Before a corrupt store is moved, every outbox entry that still
    /// decodes (with the report it carries) and the devices' highest event
    /// ids are read out of it, and written into the new store in the same
    /// order under new sequence numbers, so they still go up. An outbox
    /// entry that does not decode is dropped and the store kept. Both are
    /// told in [`Opened::salvage`].
    pub fn open(dir: &Path) -> Result<Opened, StoreError> {
        match Self::open_patiently(dir) {
            Ok((store, lost)) => Ok(Opened {
                store,
                moved_aside: None,
                salvage: Salvage {
                    lost,
                    ..Salvage::default()
                },
            }),
            Err(OpenError::Unavailable(e)) => Err(e),
            Err(OpenError::Corrupt { reason, db }) => {
                let rescued = match &db {
                    Some(db) => Rescued::from(db),
                    None => Rescued {
                        lost: vec!["the whole outbox: sled cannot read the store".into()],
                        ..Rescued::default()
                    },
                };
                // The rename does not need the old database closed, but
                // nothing reads it any more.
                drop(db);
                let stamp = std::time::SystemTime::now()
                    .duration_since(std::time::UNIX_EPOCH)
                    .map(|d| d.as_secs())
                    .unwrap_or_default();
                let aside = PathBuf::from(format!("{}.broken-{stamp}", dir.display()));
                std::fs::rename(dir, &aside).map_err(|source| StoreError::MoveAside {
                    path: dir.to_owned(),
                    source,
                })?;
                let (store, _) = Self::open_existing(dir).map_err(|e| match e {
                    OpenError::Unavailable(e) => e,
                    OpenError::Corrupt { reason, .. } => StoreError::Corrupt {
                        key: dir.display().to_string(),
                        reason: format!("a fresh store does not open either: {reason}"),
                    },
                })?;
                let salvage = store.take_in(rescued)?;
                Ok(Opened {
                    store,
                    moved_aside: Some((aside, reason)),
                    salvage,
                })
            }
        }
    }

    /// [`Store::open_existing`], retrying a held lock for a while (see
    /// [`LOCK_PATIENCE`]).
    fn open_patiently(dir: &Path) -> Result<(Store, Vec<String>), OpenError> {
        let deadline = Instant::now() + LOCK_PATIENCE;
        loop {
            match Self::open_existing(dir) {
                Err(OpenError::Unavailable(StoreError::Locked { .. }))
                    if Instant::now() < deadline =>
                {
                    std::thread::sleep(Duration::from_millis(50));
                }
                opened => return opened,
            }
        }
    }

    /// Opens the store in `dir` as it is; returns it with what was dropped
    /// from it as unreadable.
    fn open_existing(dir: &Path) -> Result<(Store, Vec<String>), OpenError> {
        let db = sled::Config::new()
            .path(dir)
            // sled's default page cache is 1 GiB; an edge box has less, and
            // a store of desired and latest states is small.
            .cache_capacity(CACHE_BYTES)
            .open()
            .map_err(|e| OpenError::from_sled(dir, None, e))?;
        // For the errors: the database to salvage from, if it comes to that.
        let handle = db.clone();
        let failed = |e: sled::Error| OpenError::from_sled(dir, Some(&handle), e);
        let corrupt = |reason: String| OpenError::Corrupt {
            reason,
            db: Some(handle.clone()),
        };
        let tree = |name: &str| db.open_tree(name).map_err(failed);
        let files = SledFiles::open(dir)
            .map(Arc::new)
            .map_err(|e| OpenError::Unavailable(unavailable(dir, e.into())))?;
        let seqs = Arc::new(SeqMarks::default());
        let mut store = Store {
            outbox_lock: Arc::default(),
            seqs: seqs.clone(),
            files: files.clone(),
            max_events: DEFAULT_MAX_EVENTS,
            store_id: String::new(),
            link_up_since: Arc::default(),
            outbox_changed: Arc::new(Notify::new()),
            link_down_since: Arc::new(edgefleet_shared::now_unix_ms().into()),
            site_watch: Arc::new(Notify::new()),
            pace_watch: Arc::new(Notify::new()),
            held_generations: Arc::new(std::sync::atomic::AtomicUsize::new(0)),
            desired_changes: broadcast::Sender::new(DESIRED_CHANGES_BUFFER),
            reports: broadcast::Sender::new(DESIRED_CHANGES_BUFFER),
            rules_changed: Arc::new(Notify::new()),
            credential_watchers: Arc::default(),
            any_credential: Arc::new(tokio::sync::watch::Sender::new(())),
            flusher: GroupFlush::start(db.clone(), seqs, files),
            desired: tree("desired")?,
            rules: tree("rules")?,
            credentials: tree("credentials")?,
            rule_watches: tree("rule_watches")?,
            reported: tree("reported")?,
            reports_out: tree(REPORTS_TREE)?,
            events_out: tree(EVENTS_TREE)?,
            event_ids: tree("event_ids")?,
            meta: tree("meta")?,
            db,
            health_gates: Arc::default(),
        };
        match store.meta.get(META_SCHEMA).map_err(failed)? {
            None if store.db.is_empty() && store.is_empty() => {
                store
                    .meta
                    .insert(META_SCHEMA, &SCHEMA_VERSION.to_be_bytes())
                    .map_err(failed)?;
                // Made durable with the store id below.
            }
            Some(v) if v.as_ref() == SCHEMA_VERSION.to_be_bytes() => {}
            Some(v) => {
                return Err(corrupt(format!(
                    "schema version {v:?} in {}, expected {SCHEMA_VERSION}",
                    dir.display()
                )));
            }
            None => {
                return Err(corrupt(format!(
                    "no schema version in {}, which is not empty",
                    dir.display()
                )));
            }
        }
        for key in [META_NEXT_SEQ, META_SEQ_RESERVED, META_DROPPED_TOTAL] {
            if let Some(v) = store.meta.get(key).map_err(failed)?
                && v.len() != 8
            {
                return Err(corrupt(format!(
                    "meta {:?} in {} is {} bytes, not 8",
                    String::from_utf8_lossy(key),
                    dir.display(),
                    v.len()
                )));
            }
        }
        if let Some(v) = store.meta.get(META_DROPPED_UNREPORTED).map_err(failed)?
            && let Err(e) = decode::<Dropped>(META_DROPPED_UNREPORTED, &v)
        {
            return Err(corrupt(format!("{e} in {}", dir.display())));
        }
        store.store_id = match store.meta.get(META_STORE_ID).map_err(failed)? {
            Some(id) => String::from_utf8_lossy(&id).into_owned(),
            // A new store, or one from before ids existed.
            None => {
                let id = new_store_id();
                store
                    .meta
                    .insert(META_STORE_ID, id.as_bytes())
                    .map_err(failed)?;
                // Made durable with the reservation below.
                id
            }
        };
        // One value that does not decode is not a corrupt store: the
        // entry could never be sent, so it is dropped and the loss told.
        // Latest reports first, as report entries carry them.
        let reported = store.reported.clone();
        let dropped = drop_unreadable(&store.reported, |k, v| {
            decode::<LatestReport>(k, v).map_err(|e| match e {
                StoreError::Corrupt { key, reason } => StoreError::Corrupt {
                    key: format!("the latest report of {key}"),
                    reason,
                },
                e => e,
            })
        })
        .and_then(|mut lost| {
            for tree in [&store.reports_out, &store.events_out] {
                lost.extend(drop_unreadable(tree, |k, v| read_entry(&reported, k, v))?);
            }
            Ok(lost)
        })
        .and_then(|lost| store.move_reports_to_their_flow().map(|()| lost));
        let lost = match dropped {
            Ok(lost) => lost,
            Err(StoreError::Sled(e)) => return Err(failed(e)),
            Err(e) => return Err(OpenError::Unavailable(e)),
        };
        let mut events = 0;
        for item in store.events_out.iter() {
            let (k, v) = item.map_err(failed)?;
            if let Ok(OutboxEntry::Event(_)) = decode(&k, &v) {
                events += 1;
            }
        }
        // Sequence numbers of the last reserved block may have been handed
        // out and lost in a crash: start above all of them, in a new block.
        let seq_mark = |key| {
            let value = store.meta.get(key).map_err(failed)?;
            Ok::<_, OpenError>(value.map(|v| u64_from(&v)))
        };
        let next = seq_mark(META_NEXT_SEQ)?
            .unwrap_or(1)
            .max(seq_mark(META_SEQ_RESERVED)?.unwrap_or(0));
        let reserved = next + SEQ_BLOCK;
        store
            .meta
            .insert(META_NEXT_SEQ, &next.to_be_bytes())
            .map_err(failed)?;
        store
            .meta
            .insert(META_SEQ_RESERVED, &reserved.to_be_bytes())
            .map_err(failed)?;
        // One flush for the reservation, a new store's id and schema,
        // entries dropped as unreadable and reports moved to their flow.
        store.seqs.flush(&store.db, &store.files).map_err(failed)?;
        *store.lock_outbox() = OutboxState { events, reserved };
        // Everything in the store when it opens is on disk.
        store.seqs.written.store(next - 1, Ordering::SeqCst);
        store.seqs.durable.store(next - 1, Ordering::SeqCst);
        Ok((store, lost))
    }

    /// Writes what was rescued from a corrupt store into this new one, in
    /// the same order under fresh sequence numbers, durably.
    fn take_in(&self, rescued: Rescued) -> Result<Salvage, StoreError> {
        let Rescued {
            entries,
            event_ids,
            lost,
        } = rescued;
        let mut outbox_state = self.lock_outbox();
        let reserved = self.reserve_seqs(&mut outbox_state, entries.len() as u64)?;
        let trees = (
            &self.reports_out,
            &self.events_out,
            &self.reported,
            &self.event_ids,
            &self.meta,
        );
        let result = trees.transaction(|(reports_out, events_out, reported, ids, meta)| {
            let mut last = 0;
            for pending in &entries {
                let seq = take_seq(meta, reserved)?;
                let (out, entry) = match pending {
                    PendingUplink::Report { device, latest } => {
                        let key = device.to_string();
                        let latest = LatestReport {
                            seq,
                            ..latest.clone()
                        };
                        reported.insert(key.as_bytes(), encode(&latest))?;
                        (reports_out, OutboxEntry::Report { device: key })
                    }
                    PendingUplink::Event { stored, .. } => {
                        (events_out, OutboxEntry::Event(stored.clone()))
                    }
                    PendingUplink::EventsDropped(dropped) => {
                        (events_out, OutboxEntry::EventsDropped(*dropped))
                    }
                };
                out.insert(&seq.to_be_bytes(), encode(&entry))?;
                last = seq;
            }
            for (device, highest) in &event_ids {
                ids.insert(device, highest.encode())?;
            }
            Ok(last)
        });
        let last = result.map_err(from_transaction)?;
        self.seqs.written.fetch_max(last, Ordering::SeqCst);
        self.seqs.flush(&self.db, &self.files)?;
        outbox_state.events += entries
            .iter()
            .filter(|e| matches!(e, PendingUplink::Event { .. }))
            .count() as u64;
        Ok(Salvage {
            entries: entries.len(),
            event_ids: event_ids.len(),
            lost,
        })
    }

    /// Makes sure `n` sequence numbers are reserved on disk before they are
    /// handed out, so a restart after a crash starts above them; returns
    /// the first one not reserved. Called under the outbox lock. Reserving
    /// waits for the disk, once per [`SEQ_BLOCK`] numbers.
    fn reserve_seqs(&self, outbox: &mut OutboxState, n: u64) -> Result<u64, StoreError> {
        let next = self.meta.get(META_NEXT_SEQ)?.map_or(1, |v| u64_from(&v));
        if next + n > outbox.reserved {
            let reserved = next + n.max(SEQ_BLOCK);
            self.meta
                .insert(META_SEQ_RESERVED, &reserved.to_be_bytes())?;
            self.seqs.flush(&self.db, &self.files)?;
            outbox.reserved = reserved;
        }
        Ok(outbox.reserved)
    }

    /// Takes the outbox lock (see [`Store::outbox_lock`]).
    fn lock_outbox(&self) -> std::sync::MutexGuard<'_, OutboxState> {
        self.outbox_lock.lock().expect("outbox lock")
    }

    fn is_empty(&self) -> bool {
        self.desired.is_empty()
            && self.rules.is_empty()
            && self.rule_watches.is_empty()
            && self.reported.is_empty()
            && self.reports_out.is_empty()
            && self.events_out.is_empty()
            && self.event_ids.is_empty()
            && self.meta.is_empty()
    }

    /// The same store with at most `max_events` events in the outbox (at
    /// least 1).
    pub fn with_max_events(mut self, max_events: u64) -> Self {
        self.max_events = max_events.max(1);
        self
    }

    /// Names this store for good: a rebuilt store has another id, and
    /// sequence numbers count within one store.
    pub fn store_id(&self) -> &str {
        &self.store_id
    }

    /// Every resource the agent holds, with its version: the Hello's content.
    pub fn held(&self) -> Result<Vec<(ResourceKey, ResourceVersion)>, StoreError> {
        let devices = self.devices()?.into_iter().map(|(k, d)| (k, d.version));
        let rules = self.rules()?.into_iter().map(|(k, r)| (k, r.version));
        let credentials = self
            .credentials
            .iter()
            .map(|item| {
                let (k, v) = item?;
                Ok((parse_key(&k)?, HeldCredential::decode(&k, &v)?.version))
            })
            .collect::<Result<Vec<_>, StoreError>>()?;
        Ok(devices.chain(rules).chain(credentials).collect())
    }

    /// The key of `device` (a Device's key), if the agent holds one.
    pub fn credential(&self, device: &ResourceKey) -> Result<Option<Psk>, StoreError> {
        let k = edgefleet_shared::credential::key_of(device).to_string();
        self.credentials
            .get(k.as_bytes())?
            .map(|v| HeldCredential::decode(k.as_bytes(), &v).map(|c| c.psk))
            .transpose()
    }

    /// Changes whenever `device`'s key arrives, changes or goes (and not
    /// when another device's does).
    pub fn credential_watch(&self, device: &ResourceKey) -> tokio::sync::watch::Receiver<()> {
        let mut watchers = self.credential_watchers.lock().expect("watchers lock");
        watchers
            .entry(edgefleet_shared::credential::key_of(device))
            .or_insert_with(|| tokio::sync::watch::Sender::new(()))
            .subscribe()
    }

    /// Changes whenever any device's key arrives, changes or goes.
    pub fn any_credential_watch(&self) -> tokio::sync::watch::Receiver<()> {
        self.any_credential.subscribe()
    }

    /// Every device key the agent holds, by Device, in key order.
    pub fn credentials(&self) -> Result<Vec<(ResourceKey, Psk)>, StoreError> {
        self.credentials
            .iter()
            .map(|item| {
                let (k, v) = item?;
                let key = parse_key(&k)?;
                let psk = HeldCredential::decode(&k, &v)?.psk;
                Ok((ResourceKey::device(&key.namespace, &key.name), psk))
            })
            .collect()
    }

    /// Tells the watchers of each of `keys` (credential keys).
    fn credentials_changed<'k>(&self, keys: impl IntoIterator<Item = &'k ResourceKey>) {
        let mut watchers = self.credential_watchers.lock().expect("watchers lock");
        let mut any = false;
        for key in keys {
            any = true;
            // Nobody left watching (the connections ended): forget it.
            if watchers.get(key).is_some_and(|tx| tx.send(()).is_err()) {
                watchers.remove(key);
            }
        }
        if any {
            self.any_credential.send_replace(());
        }
    }

    /// How many device keys the agent holds.
    pub fn credential_count(&self) -> usize {
        self.credentials.len()
    }

    /// Every rule the agent holds, in key order.
    pub fn rules(&self) -> Result<Vec<(ResourceKey, HeldRule)>, StoreError> {
        self.rules
            .iter()
            .map(|item| {
                let (k, v) = item?;
                Ok((parse_key(&k)?, HeldRule::decode(&k, &v)?))
            })
            .collect()
    }

    /// How many rules the agent holds.
    pub fn rule_count(&self) -> usize {
        self.rules.len()
    }

    /// How many devices the agent holds (counts keys, decodes nothing).
    pub fn device_count(&self) -> usize {
        self.desired.len()
    }

    /// Every device the agent holds, in key order.
    pub fn devices(&self) -> Result<Vec<(ResourceKey, DesiredDevice)>, StoreError> {
        self.desired
            .iter()
            .map(|item| {
                let (k, v) = item?;
                Ok((parse_key(&k)?, decode(&k, &v)?))
            })
            .collect()
    }

    /// The desired state of one device.
    pub fn desired(&self, key: &ResourceKey) -> Result<Option<DesiredDevice>, StoreError> {
        let k = key.to_string();
        self.desired
            .get(k.as_bytes())?
            .map(|v| decode(k.as_bytes(), &v))
            .transpose()
    }

    /// Applies an update from the cloud atomically and makes it durable.
    /// Only after this returns may the update be acknowledged.
    pub async fn apply<D: Clone + Into<Desired>>(
        &self,
        upserts: &[(ResourceKey, D)],
        removals: &[ResourceKey],
    ) -> Result<(), StoreError> {
        // A device that leaves the node, or whose Device is replaced by
        // another object under the same name, starts afresh: its latest
        // report (and that report's outbox entry) and the event ids it
        // used are about the object that is gone.
        let mut leaving: Vec<String> = removals
            .iter()
            .filter(|k| k.is_device())
            .map(|k| k.to_string())
            .collect();
        let upserts_keys: Vec<&ResourceKey> = upserts.iter().map(|(k, _)| k).collect();
        let mut devices = Vec::new();
        let mut rules = Vec::new();
        let mut credentials = Vec::new();
        for (key, desired) in upserts {
            match desired.clone().into() {
                Desired::Device(device) => {
                    if self
                        .desired(key)?
                        .is_some_and(|held| held.version.uid != device.version.uid)
                    {
                        leaving.push(key.to_string());
                    }
                    devices.push((key.to_string(), *device));
                }
                Desired::Rule(rule) => rules.push((key.to_string(), rule.encode(key))),
                Desired::Credential(c) => credentials.push((key.to_string(), c.encode(key))),
            }
        }
        let upserts = devices;
        let now = edgefleet_shared::now_unix_ms();
        let paced = upserts.iter().any(|(_, d)| d.site_pacing.is_some());
        // Entries leave the outbox: the outbox's writers take turns.
        let outbox_state = self.lock_outbox();
        let trees = (
            &self.desired,
            &self.rules,
            &self.credentials,
            &self.reported,
            &self.reports_out,
            &self.event_ids,
        );
        // Devices whose new generation arrives held: what they are told
        // does not change, so the publishers are not told either.
        let held_now = std::cell::RefCell::new(std::collections::HashSet::new());
        let result = trees.transaction(
            |(desired, held_rules, keys, reported, reports_out, event_ids)| {
                held_now.borrow_mut().clear();
                for (key, device) in &upserts {
                    // Overrides of rules at this agent stay on the same
                    // object (read here, where no rule decision can slip in
                    // between).
                    let mut device = device.clone();
                    let before = match desired.get(key.as_bytes())? {
                        Some(bytes) => Some(
                            decode::<DesiredDevice>(key.as_bytes(), &bytes)
                                .map_err(ConflictableTransactionError::Abort)?,
                        ),
                        None => None,
                    };
                    pace_arrival(&mut device, before.as_ref(), now);
                    if device.held_at_edge.is_some() {
                        held_now.borrow_mut().insert(key.clone());
                    }
                    if let Some(held) = before {
                        if held.version.uid == device.version.uid {
                            device.overrides = held.overrides;
                            device.local = held.local;
                        }
                        // A new generation is a person's change: chains
                        // of rules start again from it.
                        if held.version == device.version {
                            device.chain = held.chain;
                        }
                    }
                    desired.insert(key.as_bytes(), encode(&device))?;
                }
                for (key, rule) in &rules {
                    held_rules.insert(key.as_bytes(), rule.as_slice())?;
                }
                for (key, credential) in &credentials {
                    keys.insert(key.as_bytes(), credential.as_slice())?;
                }
                for key in removals {
                    let key_bytes = key.to_string();
                    match key.kind {
                        ResourceKind::Device => desired.remove(key_bytes.as_bytes())?,
                        ResourceKind::Rule => held_rules.remove(key_bytes.as_bytes())?,
                        ResourceKind::Credential => keys.remove(key_bytes.as_bytes())?,
                    };
                }
                for key in &leaving {
                    if let Some(bytes) = reported.remove(key.as_bytes())? {
                        let previous: LatestReport = decode(key.as_bytes(), &bytes)
                            .map_err(ConflictableTransactionError::Abort)?;
                        reports_out.remove(&previous.seq.to_be_bytes())?;
                    }
                    event_ids.remove(key.as_bytes())?;
                }
                Ok(())
            },
        );
        result.map_err(from_transaction)?;
        drop(outbox_state);
        self.flusher.flush().await?;
        self.credentials_changed(
            upserts_keys
                .iter()
                .copied()
                .chain(removals)
                .filter(|k| k.kind == ResourceKind::Credential),
        );
        if !rules.is_empty() || removals.iter().any(|k| k.kind == ResourceKind::Rule) {
            self.rules_changed.notify_one();
        }
        if paced {
            self.pace_watch.notify_one();
        }
        // Nobody listening is fine: publishers read the store when they start.
        let held_now = held_now.into_inner();
        let _ = self.desired_changes.send(DesiredChange {
            upserted: upserts
                .iter()
                .filter(|(k, _)| !held_now.contains(k))
                .map(|(k, _)| k.parse().expect("keys were ResourceKeys"))
                .collect(),
            removed: removals.iter().filter(|k| k.is_device()).cloned().collect(),
        });
        Ok(())
    }

    /// Writes and flushes a small value, to learn whether the store can
    /// still make writes durable (for `/healthz`).
    pub async fn probe(&self) -> Result<(), StoreError> {
        let now = edgefleet_shared::now_unix_ms();
        self.meta.insert(META_PROBE, &now.to_be_bytes())?;
        self.flusher.flush().await?;
        Ok(())
    }

    /// The uid of the Device held for `device`, or empty.
    fn held_uid(&self, device: &ResourceKey) -> Result<String, StoreError> {
        Ok(self
            .desired(device)?
            .map(|d| d.version.uid)
            .unwrap_or_default())
    }

    /// Durable changes of desired state from now on. A receiver that falls
    /// more than [`DESIRED_CHANGES_BUFFER`] changes behind gets `Lagged` and
    /// should re-read [`Store::devices`].
    pub fn watch_desired(&self) -> broadcast::Receiver<DesiredChange> {
        self.desired_changes.subscribe()
    }

    /// Tells the store since when a sync session is open (Unix ms), or
    /// that none is (`None`).
    pub fn set_link(&self, up_since_ms: Option<i64>) {
        self.link_up_since
            .store(up_since_ms.unwrap_or(0), Ordering::Relaxed);
        match up_since_ms {
            Some(_) => self.link_down_since.store(0, Ordering::Relaxed),
            None => {
                let now = edgefleet_shared::now_unix_ms();
                let _ = self.link_down_since.compare_exchange(
                    0,
                    now,
                    Ordering::Relaxed,
                    Ordering::Relaxed,
                );
                self.site_watch.notify_one();
            }
        }
    }

    /// Since when no sync session is open (Unix ms); `None` while one is.
    pub fn link_down_since(&self) -> Option<i64> {
        Some(self.link_down_since.load(Ordering::Relaxed)).filter(|t| *t > 0)
    }

    /// Woken by a report of a device under a site rollback plan, and when
    /// the link goes down.
    pub fn site_watch(&self) -> Arc<Notify> {
        Arc::clone(&self.site_watch)
    }

    /// Woken by a paced generation's arrival, and by a report of a paced
    /// device while [`Store::set_held_generations`] says some are held.
    pub fn pace_watch(&self) -> Arc<Notify> {
        Arc::clone(&self.pace_watch)
    }

    /// How many generations the pacer left held: reports wake it only
    /// while this is not zero.
    pub fn set_held_generations(&self, held: usize) {
        self.held_generations.store(held, Ordering::Relaxed);
    }

    /// Releases the held generations of `devices` to them: each is told
    /// its current desired state, and its latest report goes up again
    /// without the hold. Skips devices not held or changed meanwhile;
    /// returns those released.
    pub async fn release_held(
        &self,
        devices: &[(ResourceKey, ResourceVersion)],
    ) -> Result<Vec<ResourceKey>, StoreError> {
        let now = edgefleet_shared::now_unix_ms();
        self.act_at_edge(devices, |device| {
            device.held_at_edge.take()?;
            device.released_at_ms = Some(now);
            Some(())
        })
        .await
    }

    /// Rolls `devices` back on the agent's own authority, with `message`:
    /// each is told what its rollout replaced (see
    /// [`site_rollback::put_back`]), the stored state says so, and its
    /// latest report goes up again carrying the mark. Skips devices
    /// without a plan, rolled back already, or changed meanwhile; returns
    /// those rolled back.
    pub async fn roll_back_at_edge(
        &self,
        devices: &[(ResourceKey, ResourceVersion)],
        message: &str,
    ) -> Result<Vec<ResourceKey>, StoreError> {
        let now = edgefleet_shared::now_unix_ms();
        self.act_at_edge(devices, |device| {
            let plan = device.site_rollback.as_ref()?;
            if device.rolled_back_at_edge.is_some() {
                return None;
            }
            device.rolled_back_at_edge = Some(RolledBackAtEdge {
                mark: EdgeRollback {
                    rollout: plan.rollout.clone(),
                    generation: device.version.generation,
                    at_ms: now,
                    message: message.to_owned(),
                },
                state: site_rollback::put_back(&device.to_wire(), &plan.previous),
            });
            Some(())
        })
        .await
    }

    /// Changes what `devices` are told on the agent's own authority:
    /// `act` changes a device's stored state (`None`: not this one). Each
    /// is changed only at the version given and over what was read (a
    /// cloud update in between wins), its latest report goes up again
    /// (it carries what the agent did), and the publishers are told.
    /// Returns the devices changed.
    async fn act_at_edge(
        &self,
        devices: &[(ResourceKey, ResourceVersion)],
        mut act: impl FnMut(&mut DesiredDevice) -> Option<()>,
    ) -> Result<Vec<ResourceKey>, StoreError> {
        let mut done = Vec::new();
        for (key, version) in devices {
            let k = key.to_string();
            let Some(old) = self.desired.get(k.as_bytes())? else {
                continue;
            };
            let mut device: DesiredDevice = decode(k.as_bytes(), &old)?;
            if device.version != *version || act(&mut device).is_none() {
                continue;
            }
            let swapped =
                self.desired
                    .compare_and_swap(k.as_bytes(), Some(old), Some(encode(&device)))?;
            if swapped.is_err() {
                continue;
            }
            if let Some(latest) = self.latest_report(key)? {
                self.write_report(key, latest.report, latest.received_at_ms)?;
            }
            done.push(key.clone());
        }
        if done.is_empty() {
            return Ok(done);
        }
        self.flusher.flush().await?;
        self.outbox_changed.notify_one();
        let _ = self.desired_changes.send(DesiredChange {
            upserted: done.clone(),
            removed: Vec::new(),
        });
        Ok(done)
    }

    /// Records a device's report durably and queues it for the cloud;
    /// returns the sequence number its content goes up under.
    ///
    /// Reports are compacted: a newer report of the same device replaces the
    /// older one in the outbox, and takes a new sequence number. A report
    /// with the same content as the device's latest is not queued again
    /// (only when it was heard is kept), except as a keepalive while the
    /// cloud is connected (see [`UNCHANGED_REPORT_KEEPALIVE_MS`]).
    pub async fn record_report(
        &self,
        device: &ResourceKey,
        report: DeviceReport,
        received_at_ms: i64,
    ) -> Result<u64, StoreError> {
        let mut batch = self.batch();
        let seq = batch.report(device, report, received_at_ms)?;
        // Also for unchanged content: it may be another caller's write that
        // is not on disk yet, and the device is about to be told it is.
        batch.commit().await?;
        Ok(seq)
    }

    /// Turns off the syncs after each flush that make it survive a power
    /// cut (see [`SledFiles`]), which leaves what sled alone does. Only for
    /// the benchmark that measures what they cost.
    #[doc(hidden)]
    pub fn without_power_cut_sync(self) -> Self {
        self.files.enabled.store(false, Ordering::Relaxed);
        self
    }

    /// A batch of reports and events written in order and made durable by
    /// one flush ([`Batch::commit`]): how a source that hands the agent
    /// many messages at once (the MQTT connection) pays one flush for all.
    pub fn batch(&self) -> Batch<'_> {
        Batch {
            store: self,
            queued: false,
            reported: Vec::new(),
        }
    }

    /// [`Store::record_report`] without waiting for the disk: the entry is
    /// written but not durable, so it does not go up yet. Only for tests of
    /// that.
    #[doc(hidden)]
    pub fn record_report_unflushed(
        &self,
        device: &ResourceKey,
        report: DeviceReport,
        received_at_ms: i64,
    ) -> Result<u64, StoreError> {
        self.write_report(device, report, received_at_ms)
            .map(|(seq, _)| seq)
    }

    /// The compiled health expression `source` (or why it does not compile).
    fn health_gate(&self, source: &str) -> CompiledGate {
        let mut gates = self.health_gates.lock().expect("health gates");
        if let Some(gate) = gates.get(source) {
            return Arc::clone(gate);
        }
        if gates.len() >= HEALTH_GATES_CACHED {
            gates.clear();
        }
        let gate = Arc::new(HealthGate::compile(source).map_err(|e| e.to_string()));
        gates.insert(source.to_owned(), Arc::clone(&gate));
        gate
    }

    /// Writes a report (not durably yet); returns its sequence number and
    /// whether it joined the outbox.
    fn write_report(
        &self,
        device: &ResourceKey,
        report: DeviceReport,
        received_at_ms: i64,
    ) -> Result<(u64, bool), StoreError> {
        let key = device.to_string();
        // Read once: the uid the report is about and the health check.
        let desired = self.desired(device)?;
        let uid = desired
            .as_ref()
            .map(|d| d.version.uid.clone())
            .unwrap_or_default();
        let edge_rollback = desired
            .as_ref()
            .and_then(|d| Some(d.rolled_back_at_edge.as_ref()?.mark.clone()));
        let held_at_edge = desired
            .as_ref()
            .filter(|d| d.rolled_back_at_edge.is_none())
            .and_then(|d| Some(Box::new(d.held_at_edge.as_ref()?.mark.clone())));
        if desired.as_ref().is_some_and(|d| d.site_pacing.is_some())
            && self.held_generations.load(Ordering::Relaxed) > 0
        {
            self.pace_watch.notify_one();
        }
        let overrides = desired
            .as_ref()
            .map(|d| d.overrides.clone())
            .unwrap_or_default();
        if desired
            .as_ref()
            .is_some_and(|d| d.site_rollback.is_some() && d.rolled_back_at_edge.is_none())
        {
            self.site_watch.notify_one();
        }
        let entry = encode(&OutboxEntry::Report {
            device: key.clone(),
        });
        let link_up_since = self.link_up_since.load(Ordering::Relaxed);
        let mut outbox_state = self.lock_outbox();
        let reserved = self.reserve_seqs(&mut outbox_state, 1)?;
        let result = (&self.reported, &self.reports_out, &self.meta).transaction(
            |(reported, outbox, meta)| {
                let previous = match reported.get(key.as_bytes())? {
                    Some(bytes) => Some(
                        decode::<LatestReport>(key.as_bytes(), &bytes)
                            .map_err(ConflictableTransactionError::Abort)?,
                    ),
                    None => None,
                };
                let health = desired.as_ref().and_then(|d| {
                    if d.rolled_back_at_edge.is_some() {
                        return None;
                    }
                    let check = d.health_check.as_ref()?;
                    let gate = self.health_gate(&check.expression);
                    health_check::next(
                        previous.as_ref().and_then(|p| p.health.as_ref()),
                        d.version.generation,
                        Some((check, gate.as_ref().as_ref().map_err(String::as_str))),
                        d.firmware.as_ref().map(|f| f.version.as_str()),
                        &report,
                        received_at_ms,
                    )
                });
                if let Some(previous) = previous.as_ref().filter(|p| {
                    p.report == report
                        && p.uid == uid
                        && p.health == health
                        && p.edge_rollback == edge_rollback
                        && p.held_at_edge == held_at_edge
                        && p.overrides == overrides
                }) {
                    let keepalive_due = link_up_since > 0
                        && received_at_ms - previous.queued_at_ms.max(link_up_since)
                            >= UNCHANGED_REPORT_KEEPALIVE_MS;
                    if !keepalive_due {
                        let heard = LatestReport {
                            received_at_ms,
                            ..previous.clone()
                        };
                        reported.insert(key.as_bytes(), encode(&heard))?;
                        return Ok((previous.seq, false));
                    }
                }
                let seq = take_seq(meta, reserved)?;
                if let Some(previous) = &previous {
                    outbox.remove(&previous.seq.to_be_bytes())?;
                }
                let latest = LatestReport {
                    seq,
                    received_at_ms,
                    queued_at_ms: received_at_ms,
                    uid: uid.clone(),
                    report: report.clone(),
                    health,
                    edge_rollback: edge_rollback.clone(),
                    held_at_edge: held_at_edge.clone(),
                    overrides: overrides.clone(),
                };
                reported.insert(key.as_bytes(), encode(&latest))?;
                outbox.insert(&seq.to_be_bytes(), entry.clone())?;
                Ok((seq, true))
            },
        );
        let (seq, queued) = result.map_err(from_transaction)?;
        if queued {
            self.seqs.written.fetch_max(seq, Ordering::SeqCst);
        }
        Ok((seq, queued))
    }

    /// Records a device's event durably and queues it for the cloud, unless
    /// the device sent this id before. At the bound the oldest event in the
    /// outbox is dropped to make room, and the drop is counted.
    pub async fn record_event(
        &self,
        device: &ResourceKey,
        event: DeviceEvent,
        received_at_ms: i64,
    ) -> Result<EventOutcome, StoreError> {
        let mut batch = self.batch();
        let outcome = batch.event(device, event, received_at_ms)?;
        // A duplicate is answered as stored: make sure the first copy is.
        batch.commit().await?;
        Ok(outcome)
    }

    /// Writes an event (not durably yet) unless the device sent this id
    /// before.
    fn write_event(
        &self,
        device: &ResourceKey,
        event: DeviceEvent,
        received_at_ms: i64,
    ) -> Result<EventOutcome, StoreError> {
        let key = device.to_string();
        let uid = self.held_uid(device)?;
        let outcome = {
            let mut outbox_state = self.lock_outbox();
            let mut ids = match self.event_ids.get(key.as_bytes())? {
                Some(v) => EventIds::decode(&v).ok_or_else(|| StoreError::Corrupt {
                    key: format!("the highest event ids of {key}"),
                    reason: format!("{} bytes", v.len()),
                })?,
                None => EventIds::default(),
            };
            let highest = ids.highest(event.boot);
            if event.id <= highest {
                EventOutcome::Duplicate { highest }
            } else {
                let victim = if outbox_state.events >= self.max_events {
                    self.oldest_event()?
                } else {
                    None
                };
                let entry = encode(&OutboxEntry::Event(StoredEvent {
                    device: key.clone(),
                    at_ms: received_at_ms,
                    uid: uid.clone(),
                    event: event.clone(),
                }));
                let bound = self.max_events;
                let reserved = self.reserve_seqs(&mut outbox_state, 1)?;
                ids.record(event.boot, event.id);
                let ids = ids.encode();
                let result = (&self.events_out, &self.event_ids, &self.meta).transaction(
                    |(outbox, event_ids, meta)| {
                        let seq = take_seq(meta, reserved)?;
                        outbox.insert(&seq.to_be_bytes(), entry.clone())?;
                        event_ids.insert(key.as_bytes(), ids.as_slice())?;
                        if let Some(victim) = victim {
                            drop_event(outbox, meta, victim, received_at_ms, bound)?;
                        }
                        Ok(seq)
                    },
                );
                let seq = result.map_err(from_transaction)?;
                self.seqs.written.fetch_max(seq, Ordering::SeqCst);
                if victim.is_none() {
                    outbox_state.events += 1;
                }
                EventOutcome::Stored {
                    seq,
                    dropped_oldest: victim.is_some(),
                }
            }
        };
        Ok(outcome)
    }

    /// The sequence number of the oldest event in the outbox.
    fn oldest_event(&self) -> Result<Option<u64>, StoreError> {
        for item in self.events_out.iter() {
            let (k, v) = item?;
            if let OutboxEntry::Event(_) = decode(&k, &v)? {
                return Ok(Some(u64_from(&k)));
            }
        }
        Ok(None)
    }

    /// Turns the drops not yet reported into an outbox entry, so they go up
    /// in order with the events. Returns its sequence number, if there
    /// were drops.
    pub async fn seal_dropped(&self) -> Result<Option<u64>, StoreError> {
        if !self.meta.contains_key(META_DROPPED_UNREPORTED)? {
            return Ok(None);
        }
        let sealed = {
            let mut outbox_state = self.lock_outbox();
            let reserved = self.reserve_seqs(&mut outbox_state, 1)?;
            let result = (&self.events_out, &self.meta).transaction(|(outbox, meta)| {
                let Some(dropped) = meta.remove(META_DROPPED_UNREPORTED)? else {
                    return Ok(None);
                };
                let dropped: Dropped = decode(META_DROPPED_UNREPORTED, &dropped)
                    .map_err(ConflictableTransactionError::Abort)?;
                let seq = take_seq(meta, reserved)?;
                outbox.insert(
                    &seq.to_be_bytes(),
                    encode(&OutboxEntry::EventsDropped(dropped)),
                )?;
                Ok(Some(seq))
            });
            let sealed = result.map_err(from_transaction)?;
            if let Some(seq) = sealed {
                self.seqs.written.fetch_max(seq, Ordering::SeqCst);
            }
            sealed
        };
        self.flusher.flush().await?;
        Ok(sealed)
    }

    /// Events dropped at the bound over the store's life.
    pub fn events_dropped_total(&self) -> Result<u64, StoreError> {
        Ok(self
            .meta
            .get(META_DROPPED_TOTAL)?
            .map(|v| u64_from(&v))
            .unwrap_or(0))
    }

    /// Events waiting in the outbox.
    pub fn events_queued(&self) -> u64 {
        self.lock_outbox().events
    }

    /// Resolves once an entry has joined the outbox since the last call.
    pub async fn outbox_grew(&self) {
        self.outbox_changed.notified().await;
    }

    /// The latest report of a device, if it ever reported.
    pub fn latest_report(&self, device: &ResourceKey) -> Result<Option<LatestReport>, StoreError> {
        let k = device.to_string();
        self.reported
            .get(k.as_bytes())?
            .map(|v| decode(k.as_bytes(), &v))
            .transpose()
    }

    /// Up to `max` entries of `flow` after sequence number `after`, in
    /// order, that are on disk: one only written may still be lost in a
    /// crash, and must not reach the cloud before it cannot be.
    pub fn pending(
        &self,
        flow: Flow,
        after: u64,
        max: usize,
    ) -> Result<Vec<(u64, PendingUplink)>, StoreError> {
        let durable = self.seqs.durable.load(Ordering::SeqCst);
        if after >= durable {
            return Ok(Vec::new());
        }
        self.flow_tree(flow)
            .range((after + 1).to_be_bytes()..=durable.to_be_bytes())
            .take(max)
            .map(|item| {
                let (k, v) = item?;
                read_entry(&self.reported, &k, &v)
            })
            .collect()
    }

    /// Up to `max` entries of both flows after `after`, in the order they
    /// were written (see [`Store::pending`]): the whole outbox, as a
    /// test or a tool looks at it.
    pub fn pending_uplink(
        &self,
        after: u64,
        max: usize,
    ) -> Result<Vec<(u64, PendingUplink)>, StoreError> {
        let mut both = self.pending(Flow::Reports, after, max)?;
        both.extend(self.pending(Flow::Events, after, max)?);
        both.sort_by_key(|(seq, _)| *seq);
        both.truncate(max);
        Ok(both)
    }

    /// The cloud has made the reports up to `reports` and the events up to
    /// `events` durable: drop them from the outbox. Returns how many
    /// entries were removed.
    pub async fn acknowledge_uplink(&self, reports: u64, events: u64) -> Result<usize, StoreError> {
        let removed = {
            let mut outbox_state = self.lock_outbox();
            let (mut removed, mut removed_events) = (0, 0);
            for (tree, up_to) in [(&self.reports_out, reports), (&self.events_out, events)] {
                let mut batch = sled::Batch::default();
                for item in tree.range(..=up_to.to_be_bytes()) {
                    let (k, v) = item?;
                    if let OutboxEntry::Event(_) = decode(&k, &v)? {
                        removed_events += 1;
                    }
                    batch.remove(k);
                    removed += 1;
                }
                tree.apply_batch(batch)?;
            }
            outbox_state.events = outbox_state.events.saturating_sub(removed_events);
            removed
        };
        self.flusher.flush().await?;
        Ok(removed)
    }

    /// The highest uplink sequence number handed out so far, or skipped at
    /// a restart (0: none).
    pub fn last_seq(&self) -> Result<u64, StoreError> {
        Ok(self
            .meta
            .get(META_NEXT_SEQ)?
            .map_or(0, |v| u64_from(&v).saturating_sub(1)))
    }

    /// The sequence number of the oldest entry waiting in the outbox.
    pub fn oldest_pending_seq(&self) -> Result<Option<u64>, StoreError> {
        let first =
            |tree: &sled::Tree| Ok::<_, StoreError>(tree.first()?.map(|(k, _)| u64_from(&k)));
        Ok([first(&self.reports_out)?, first(&self.events_out)?]
            .into_iter()
            .flatten()
            .min())
    }

    /// Entries waiting in the outbox, both flows.
    pub fn outbox_depth(&self) -> usize {
        self.reports_out.len() + self.events_out.len()
    }

    /// Reports waiting in the outbox.
    pub fn reports_queued(&self) -> usize {
        self.reports_out.len()
    }

    fn flow_tree(&self, flow: Flow) -> &sled::Tree {
        match flow {
            Flow::Reports => &self.reports_out,
            Flow::Events => &self.events_out,
        }
    }

    /// A store from before flows kept report entries among the events:
    /// moves them, under the same sequence numbers, to the reports flow.
    /// Not durable by itself (opening flushes after it).
    fn move_reports_to_their_flow(&self) -> Result<(), StoreError> {
        let mut reports = Vec::new();
        for item in self.events_out.iter() {
            let (k, v) = item?;
            if let Ok(OutboxEntry::Report { .. }) = decode(&k, &v) {
                reports.push((k, v));
            }
        }
        if reports.is_empty() {
            return Ok(());
        }
        let result = (&self.events_out, &self.reports_out).transaction(
            |(events, out)| -> ConflictableTransactionResult<(), StoreError> {
                for (k, v) in &reports {
                    events.remove(k)?;
                    out.insert(k, v)?;
                }
                Ok(())
            },
        );
        result.map_err(from_transaction)?;
        tracing::info!(
            reports = reports.len(),
            "moved the outbox's reports to a flow of their own"
        );
        Ok(())
    }
}

/// Reports and events written in order, durable together once
/// [`Batch::commit`] returns (see [`Store::batch`]). Nothing written in a
/// batch goes up to the cloud, nor may be acknowledged to a device, before
/// the commit.
#[derive(Debug)]
pub struct Batch<'a> {
    store: &'a Store,
    queued: bool,
    reported: Vec<ResourceKey>,
}

impl Batch<'_> {
    /// Writes a report (see [`Store::record_report`]); returns the
    /// sequence number its content goes up under.
    pub fn report(
        &mut self,
        device: &ResourceKey,
        report: DeviceReport,
        received_at_ms: i64,
    ) -> Result<u64, StoreError> {
        let (seq, queued) = self.store.write_report(device, report, received_at_ms)?;
        self.queued |= queued;
        self.reported.push(device.clone());
        Ok(seq)
    }

    /// Writes an event (see [`Store::record_event`]).
    pub fn event(
        &mut self,
        device: &ResourceKey,
        event: DeviceEvent,
        received_at_ms: i64,
    ) -> Result<EventOutcome, StoreError> {
        let outcome = self.store.write_event(device, event, received_at_ms)?;
        self.queued |= matches!(outcome, EventOutcome::Stored { .. });
        Ok(outcome)
    }

    /// Makes everything written so far durable (and whatever other callers
    /// wrote before it), then lets the uplink know.
    pub async fn commit(self) -> Result<(), StoreError> {
        self.store.flusher.flush().await?;
        if self.queued {
            self.store.outbox_changed.notify_one();
        }
        for device in self.reported {
            // Nobody listening is fine: the rule engine reads the store.
            let _ = self.store.reports.send(device);
        }
        Ok(())
    }
}

/// Makes writes durable, many callers at a time: one thread runs sled's
/// blocking `flush`, and every caller waiting when a flush starts is
/// answered by it (group commit), so a burst of reports costs a few fsyncs,
/// not one each.
///
/// This replaces `Db::flush_async`, which deadlocks when called
/// concurrently in sled 0.34 (spacejam/sled#1308, #1241) — what a CoAP
/// server answering many devices at once does.
#[derive(Clone, Debug)]
struct GroupFlush {
    db: sled::Db,
    requests: std::sync::mpsc::Sender<FlushRequest>,
}

/// A caller waiting for durability, with a handle on the database. The
/// thread holds no handle between flushes, so dropping the last `Store`
/// closes the database at once (a reopen right after does not find it
/// locked).
type FlushRequest = (
    sled::Db,
    tokio::sync::oneshot::Sender<Result<(), sled::Error>>,
);

impl GroupFlush {
    /// Starts the flushing thread; it ends once every handle is dropped.
    /// Each flush moves `seqs`' durable mark.
    fn start(db: sled::Db, seqs: Arc<SeqMarks>, files: Arc<SledFiles>) -> Self {
        let (requests, waiting) = std::sync::mpsc::channel::<FlushRequest>();
        std::thread::Builder::new()
            .name("store-flush".into())
            .spawn(move || {
                while let Ok(first) = waiting.recv() {
                    let mut batch = vec![first];
                    batch.extend(waiting.try_iter());
                    let result = seqs.flush(&batch[0].0, &files);
                    let waiters: Vec<_> = batch.into_iter().map(|(_, waiter)| waiter).collect();
                    for waiter in waiters {
                        let _ = waiter.send(result.clone());
                    }
                }
            })
            .expect("spawn the store's flush thread");
        GroupFlush { db, requests }
    }

    /// Resolves once everything written before the call is on disk.
    async fn flush(&self) -> Result<(), sled::Error> {
        let gone = || sled::Error::ReportableBug("the flush thread is gone".into());
        let (tx, rx) = tokio::sync::oneshot::channel();
        self.requests
            .send((self.db.clone(), tx))
            .map_err(|_| gone())?;
        rx.await.map_err(|_| gone())?
    }
}

/// Hands out the next uplink sequence number, within a transaction on the
/// meta tree; it must be below `reserved` (see [`Store::reserve_seqs`]).
/// Drops the event at `victim` to make room at the outbox's `bound`, and
/// counts the drop (the total, and the notice still to send up).
fn drop_event(
    outbox: &TransactionalTree,
    meta: &TransactionalTree,
    victim: u64,
    at_ms: i64,
    bound: u64,
) -> ConflictableTransactionResult<(), StoreError> {
    outbox.remove(&victim.to_be_bytes())?;
    let total = meta
        .get(META_DROPPED_TOTAL)?
        .map(|v| u64_from(&v))
        .unwrap_or(0);
    meta.insert(META_DROPPED_TOTAL, &(total + 1).to_be_bytes())?;
    let mut dropped: Dropped = match meta.get(META_DROPPED_UNREPORTED)? {
        Some(v) => {
            decode(META_DROPPED_UNREPORTED, &v).map_err(ConflictableTransactionError::Abort)?
        }
        None => Dropped {
            first_at_ms: at_ms,
            ..Dropped::default()
        },
    };
    dropped.count += 1;
    dropped.last_at_ms = at_ms;
    dropped.bound = bound;
    meta.insert(META_DROPPED_UNREPORTED, encode(&dropped))?;
    Ok(())
}

fn take_seq(
    meta: &TransactionalTree,
    reserved: u64,
) -> ConflictableTransactionResult<u64, StoreError> {
    let seq = meta.get(META_NEXT_SEQ)?.map(|v| u64_from(&v)).unwrap_or(1);
    if seq >= reserved {
        // Callers reserve first, under the outbox lock.
        return Err(ConflictableTransactionError::Abort(StoreError::Sled(
            sled::Error::ReportableBug(format!(
                "sequence number {seq} is not reserved (reserved below {reserved})"
            )),
        )));
    }
    meta.insert(META_NEXT_SEQ, &(seq + 1).to_be_bytes())?;
    Ok(seq)
}

/// Reads one outbox entry with what it carries (a report entry, the
/// device's latest report). A value that does not decode is `Corrupt`,
/// naming the entry.
fn read_entry(
    reported: &sled::Tree,
    k: &[u8],
    v: &[u8],
) -> Result<(u64, PendingUplink), StoreError> {
    let name = || match <[u8; 8]>::try_from(k) {
        Ok(seq) => format!("outbox entry {}", u64::from_be_bytes(seq)),
        Err(_) => format!("outbox entry {:?}", String::from_utf8_lossy(k)),
    };
    let unreadable = |reason: String| StoreError::Corrupt {
        key: name(),
        reason,
    };
    let seq = <[u8; 8]>::try_from(k)
        .map(u64::from_be_bytes)
        .map_err(|_| unreadable(format!("a key of {} bytes, not 8", k.len())))?;
    let device = |name: &str| {
        name.parse::<ResourceKey>()
            .map_err(|e| unreadable(format!("device {name:?}: {e}")))
    };
    let entry: OutboxEntry = serde_cbor::from_slice(v).map_err(|e| unreadable(e.to_string()))?;
    let pending = match entry {
        OutboxEntry::Report { device: name } => {
            let device = device(&name)?;
            let latest = reported
                .get(name.as_bytes())?
                .ok_or_else(|| unreadable(format!("{name} has no report")))?;
            let latest = serde_cbor::from_slice(&latest)
                .map_err(|e| unreadable(format!("the report of {name}: {e}")))?;
            PendingUplink::Report { device, latest }
        }
        OutboxEntry::Event(stored) => PendingUplink::Event {
            device: device(&stored.device)?,
            stored,
        },
        OutboxEntry::EventsDropped(dropped) => PendingUplink::EventsDropped(dropped),
    };
    Ok((seq, pending))
}

/// Removes the values of `tree` that `read` finds unreadable (`Corrupt`),
/// and returns what was removed, and why.
fn drop_unreadable<T>(
    tree: &sled::Tree,
    read: impl Fn(&[u8], &[u8]) -> Result<T, StoreError>,
) -> Result<Vec<String>, StoreError> {
    let (mut lost, mut unreadable) = (Vec::new(), sled::Batch::default());
    for item in tree.iter() {
        let (k, v) = item?;
        match read(&k, &v) {
            Ok(_) => {}
            Err(e @ StoreError::Corrupt { .. }) => {
                lost.push(what_is_lost(e));
                unreadable.remove(k);
            }
            Err(e) => return Err(e),
        }
    }
    tree.apply_batch(unreadable)?;
    Ok(lost)
}

/// A loss, as [`Salvage::lost`] tells it.
fn what_is_lost(e: StoreError) -> String {
    match e {
        StoreError::Corrupt { key, reason } => format!("{key}: {reason}"),
        e => e.to_string(),
    }
}

fn from_transaction(e: TransactionError<StoreError>) -> StoreError {
    match e {
        TransactionError::Abort(e) => e,
        TransactionError::Storage(e) => StoreError::Sled(e),
    }
}

/// 128 random bits, hex: a store's id.
fn new_store_id() -> String {
    format!("{:032x}", rand::random::<u128>())
}

fn encode<T: Serialize>(value: &T) -> Vec<u8> {
    serde_cbor::to_vec(value).expect("stored types always serialize")
}

fn decode<T: DeserializeOwned>(key: &[u8], bytes: &[u8]) -> Result<T, StoreError> {
    serde_cbor::from_slice(bytes).map_err(|e| StoreError::Corrupt {
        key: String::from_utf8_lossy(key).into_owned(),
        reason: e.to_string(),
    })
}

fn parse_key(bytes: &[u8]) -> Result<ResourceKey, StoreError> {
    let text = String::from_utf8_lossy(bytes);
    text.parse().map_err(
        |e: edgefleet_shared::key::ResourceKeyError| StoreError::Corrupt {
            key: text.into_owned(),
            reason: e.to_string(),
        },
    )
}

fn u64_from(bytes: &[u8]) -> u64 {
    let mut buf = [0u8; 8];
    buf.copy_from_slice(&bytes[..8]);
    u64::from_be_bytes(buf)
}
