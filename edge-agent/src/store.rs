//! The agent's durable state, in sled: what the cloud wants (desired), what
//! devices last said (reported), what must still go up (outbox), and meta.
//!
//! Durable points are explicit: every write that is answered to somebody (an
//! Ack to the cloud, a success code to a device) is flushed first. A store
//! that fails to open is moved aside and a new one is started; the cloud
//! resends desired state on the next Hello.

use std::collections::BTreeMap;
use std::path::{Path, PathBuf};
use std::sync::Arc;

use edgefleet_shared::api::Transport;
use edgefleet_shared::codec::{DesiredState, DeviceReport, FirmwareOrder};
use edgefleet_shared::{PropertyValue, ResourceKey, ResourceVersion};
use serde::{Deserialize, Serialize, de::DeserializeOwned};
use sled::Transactional;
use sled::transaction::{ConflictableTransactionError, TransactionError};
use tokio::sync::{Notify, broadcast};

/// Bumped when the layout of stored values changes; a store with another
/// version is moved aside and rebuilt from the cloud.
const SCHEMA_VERSION: u32 = 1;

const META_SCHEMA: &[u8] = b"schema_version";
const META_NEXT_SEQ: &[u8] = b"next_seq";

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
}

impl DesiredDevice {
    /// What the device itself is told: the device wire format's message.
    pub fn to_wire(&self) -> DesiredState {
        DesiredState {
            generation: self.version.generation,
            properties: self.properties.clone(),
            firmware: self.firmware.clone(),
        }
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
    /// What the device said.
    pub report: DeviceReport,
}

/// One outbox entry, as stored: reports are compacted per device, so the
/// entry only names the device and the report itself sits in `reported`.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
enum OutboxEntry {
    Report { device: String },
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
}

/// Why the store failed.
#[derive(Debug, thiserror::Error)]
pub enum StoreError {
    /// sled failed.
    #[error("store: {0}")]
    Sled(#[from] sled::Error),
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

/// The agent's store.
#[derive(Clone, Debug)]
pub struct Store {
    // Woken whenever an entry joins the outbox, so the uplink needs no polling.
    outbox_changed: Arc<Notify>,
    // Every durable change of desired state, for the device-side publishers.
    desired_changes: broadcast::Sender<DesiredChange>,
    flusher: GroupFlush,
    db: sled::Db,
    desired: sled::Tree,
    reported: sled::Tree,
    outbox: sled::Tree,
    meta: sled::Tree,
}

/// A store just opened, and whether an unusable one had to be moved aside.
#[derive(Debug)]
pub struct Opened {
    /// The store.
    pub store: Store,
    /// Where the unusable store was moved, if it was.
    pub moved_aside: Option<(PathBuf, String)>,
}

impl Store {
    /// Opens the store in `dir`, creating it if needed. A store that does
    /// not open, or was written by another schema version, is renamed to
    /// `<dir>.broken-<unix seconds>` and a new one is created in its place.
    pub fn open(dir: &Path) -> Result<Opened, StoreError> {
        match Self::open_existing(dir) {
            Ok(store) => Ok(Opened {
                store,
                moved_aside: None,
            }),
            Err(reason) => {
                let stamp = std::time::SystemTime::now()
                    .duration_since(std::time::UNIX_EPOCH)
                    .map(|d| d.as_secs())
                    .unwrap_or_default();
                let aside = PathBuf::from(format!("{}.broken-{stamp}", dir.display()));
                std::fs::rename(dir, &aside).map_err(|source| StoreError::MoveAside {
                    path: dir.to_owned(),
                    source,
                })?;
                let store = Self::open_existing(dir).map_err(|_| StoreError::Corrupt {
                    key: dir.display().to_string(),
                    reason: "a fresh store does not open either".into(),
                })?;
                Ok(Opened {
                    store,
                    moved_aside: Some((aside, reason)),
                })
            }
        }
    }

    fn open_existing(dir: &Path) -> Result<Store, String> {
        let db = sled::Config::new()
            .path(dir)
            // sled's default page cache is 1 GiB; an edge box has less, and
            // a store of desired and latest states is small.
            .cache_capacity(CACHE_BYTES)
            .open()
            .map_err(|e| e.to_string())?;
        let tree = |name: &str| db.open_tree(name).map_err(|e| e.to_string());
        let store = Store {
            outbox_changed: Arc::new(Notify::new()),
            desired_changes: broadcast::Sender::new(DESIRED_CHANGES_BUFFER),
            flusher: GroupFlush::start(db.clone()),
            desired: tree("desired")?,
            reported: tree("reported")?,
            outbox: tree("outbox")?,
            meta: tree("meta")?,
            db,
        };
        match store.meta.get(META_SCHEMA).map_err(|e| e.to_string())? {
            None if store.db.is_empty() && store.is_empty() => {
                store
                    .meta
                    .insert(META_SCHEMA, &SCHEMA_VERSION.to_be_bytes())
                    .map_err(|e| e.to_string())?;
                store.db.flush().map_err(|e| e.to_string())?;
            }
            Some(v) if v.as_ref() == SCHEMA_VERSION.to_be_bytes() => {}
            Some(v) => return Err(format!("schema version {v:?}, expected {SCHEMA_VERSION}")),
            None => return Err("no schema version".into()),
        }
        Ok(store)
    }

    fn is_empty(&self) -> bool {
        self.desired.is_empty()
            && self.reported.is_empty()
            && self.outbox.is_empty()
            && self.meta.is_empty()
    }

    /// Every resource the agent holds, with its version: the Hello's content.
    pub fn held(&self) -> Result<Vec<(ResourceKey, ResourceVersion)>, StoreError> {
        self.devices()
            .map(|devices| devices.into_iter().map(|(k, d)| (k, d.version)).collect())
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
    pub async fn apply(
        &self,
        upserts: &[(ResourceKey, DesiredDevice)],
        removals: &[ResourceKey],
    ) -> Result<(), StoreError> {
        let mut batch = sled::Batch::default();
        for (key, device) in upserts {
            batch.insert(key.to_string().as_bytes(), encode(device));
        }
        for key in removals {
            batch.remove(key.to_string().as_bytes());
        }
        self.desired.apply_batch(batch)?;
        self.flusher.flush().await?;
        // Nobody listening is fine: publishers read the store when they start.
        let _ = self.desired_changes.send(DesiredChange {
            upserted: upserts.iter().map(|(k, _)| k.clone()).collect(),
            removed: removals.to_vec(),
        });
        Ok(())
    }

    /// Durable changes of desired state from now on. A receiver that falls
    /// more than [`DESIRED_CHANGES_BUFFER`] changes behind gets `Lagged` and
    /// should re-read [`Store::devices`].
    pub fn watch_desired(&self) -> broadcast::Receiver<DesiredChange> {
        self.desired_changes.subscribe()
    }

    /// Records a device's report durably and queues it for the cloud.
    /// Reports are compacted: a newer report of the same device replaces the
    /// older one in the outbox, and takes a new sequence number.
    pub async fn record_report(
        &self,
        device: &ResourceKey,
        report: DeviceReport,
        received_at_ms: i64,
    ) -> Result<u64, StoreError> {
        let key = device.to_string();
        let entry = encode(&OutboxEntry::Report {
            device: key.clone(),
        });
        let result =
            (&self.reported, &self.outbox, &self.meta).transaction(|(reported, outbox, meta)| {
                let seq = meta.get(META_NEXT_SEQ)?.map(|v| u64_from(&v)).unwrap_or(1);
                meta.insert(META_NEXT_SEQ, &(seq + 1).to_be_bytes())?;
                if let Some(previous) = reported.get(key.as_bytes())? {
                    let previous: LatestReport = decode(key.as_bytes(), &previous)
                        .map_err(ConflictableTransactionError::Abort)?;
                    outbox.remove(&previous.seq.to_be_bytes())?;
                }
                let latest = LatestReport {
                    seq,
                    received_at_ms,
                    report: report.clone(),
                };
                reported.insert(key.as_bytes(), encode(&latest))?;
                outbox.insert(&seq.to_be_bytes(), entry.clone())?;
                Ok(seq)
            });
        let seq = result.map_err(|e| match e {
            TransactionError::Abort(e) => e,
            TransactionError::Storage(e) => StoreError::Sled(e),
        })?;
        self.flusher.flush().await?;
        self.outbox_changed.notify_one();
        Ok(seq)
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

    /// Up to `max` outbox entries after sequence number `after`, in order.
    pub fn pending_uplink(
        &self,
        after: u64,
        max: usize,
    ) -> Result<Vec<(u64, PendingUplink)>, StoreError> {
        let mut out = Vec::new();
        for item in self.outbox.range((after + 1).to_be_bytes()..).take(max) {
            let (k, v) = item?;
            let seq = u64_from(&k);
            let OutboxEntry::Report { device } = decode(&k, &v)?;
            let key = parse_key(device.as_bytes())?;
            let latest = self
                .latest_report(&key)?
                .ok_or_else(|| StoreError::Corrupt {
                    key: device.clone(),
                    reason: format!("outbox entry {seq} names a device with no report"),
                })?;
            out.push((
                seq,
                PendingUplink::Report {
                    device: key,
                    latest,
                },
            ));
        }
        Ok(out)
    }

    /// The cloud has made everything up to `seq` durable: drop it from the
    /// outbox. Returns how many entries were removed.
    pub async fn acknowledge_uplink(&self, seq: u64) -> Result<usize, StoreError> {
        let mut batch = sled::Batch::default();
        let mut removed = 0;
        for item in self.outbox.range(..=seq.to_be_bytes()) {
            let (k, _) = item?;
            batch.remove(k);
            removed += 1;
        }
        self.outbox.apply_batch(batch)?;
        self.flusher.flush().await?;
        Ok(removed)
    }

    /// Entries waiting in the outbox.
    pub fn outbox_depth(&self) -> usize {
        self.outbox.len()
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
    fn start(db: sled::Db) -> Self {
        let (requests, waiting) = std::sync::mpsc::channel::<FlushRequest>();
        std::thread::Builder::new()
            .name("store-flush".into())
            .spawn(move || {
                while let Ok(first) = waiting.recv() {
                    let mut batch = vec![first];
                    batch.extend(waiting.try_iter());
                    let result = batch[0].0.flush().map(drop);
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
