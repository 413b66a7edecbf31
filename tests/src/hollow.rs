//! Hollow agents: many edge nodes' sync sessions in one process, so the
//! controller can be measured at 1,000 nodes without 1,000 agent processes.
//!
//! Each hollow agent is one node: its own gRPC connection (a TCP connection
//! of its own to the controller), its own store id, and what it holds kept
//! in memory instead of sled. It runs the production agent's session core
//! (`edgefleet_agent::sync::Session`): the Hello with its holdings digest,
//! Updates judged and acknowledged, inventories on request, heartbeats, and
//! a reconnect with backoff when the stream ends. What it does not have is
//! devices: nothing reaches a device, and it sends no uplink.
//!
//! What it records for benchmarks: when each (Device, generation) first
//! reached its agent, how many sessions each agent opened, and how many
//! times the controller asked for a full inventory.

use std::collections::{BTreeMap, HashMap};
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use edgefleet_agent::store::Desired;
use edgefleet_agent::sync::{Session, Step, session};
use edgefleet_shared::heartbeat::Heartbeat;
use edgefleet_shared::proto::{self, agent_message};
use edgefleet_shared::{ResourceKey, ResourceVersion, now_unix_ms};
use tokio::sync::mpsc;
use tokio::task::JoinSet;
use tokio_stream::wrappers::ReceiverStream;

/// When each (Device, generation) first reached its agent, in Unix ms.
pub type Arrivals = HashMap<(ResourceKey, i64), i64>;

/// What all hollow agents of a fleet count together.
#[derive(Debug, Default)]
pub struct Counters {
    /// Sync streams opened (the first of each agent included).
    sessions: AtomicU64,
    /// Inventories the controller asked for.
    inventories: AtomicU64,
    /// Updates stored and acknowledged.
    updates: AtomicU64,
    /// Sessions that ended with an error (refused, cut, closed).
    session_errors: AtomicU64,
    /// Refusals that named the replica serving the node (followed).
    redirects: AtomicU64,
    /// The last of those errors.
    last_error: Mutex<Option<String>>,
}

impl Counters {
    fn get(counter: &AtomicU64) -> u64 {
        counter.load(Ordering::Relaxed)
    }

    /// Sync streams opened so far.
    pub fn sessions(&self) -> u64 {
        Self::get(&self.sessions)
    }

    /// Inventories asked for so far.
    pub fn inventories(&self) -> u64 {
        Self::get(&self.inventories)
    }

    /// Updates acknowledged so far.
    pub fn updates(&self) -> u64 {
        Self::get(&self.updates)
    }

    /// Sessions ended by an error so far.
    pub fn session_errors(&self) -> u64 {
        Self::get(&self.session_errors)
    }

    /// Redirects to another controller replica followed so far.
    pub fn redirects(&self) -> u64 {
        Self::get(&self.redirects)
    }

    /// The last session error, with its node.
    pub fn last_error(&self) -> Option<String> {
        self.last_error.lock().expect("last error").clone()
    }
}

/// One hollow agent's state, shared with its task.
#[derive(Debug)]
struct Agent {
    node: String,
    store_id: String,
    held: Mutex<BTreeMap<ResourceKey, ResourceVersion>>,
    open: AtomicBool,
}

/// Hollow agents, one per node, each syncing with the controller at
/// `cloud` until dropped.
#[derive(Debug)]
pub struct HollowFleet {
    agents: Vec<Arc<Agent>>,
    arrivals: Arc<Mutex<Arrivals>>,
    counters: Arc<Counters>,
    tasks: JoinSet<()>,
}

impl HollowFleet {
    /// Starts an agent for each of `nodes` against the plaintext sync
    /// server at `cloud` (`http://host:port`), which must believe the node
    /// a Hello names (`--insecure-unauthenticated-agents`).
    pub fn start(cloud: &str, nodes: &[String], heartbeat: Heartbeat) -> HollowFleet {
        let arrivals = Arc::new(Mutex::new(Arrivals::new()));
        let counters = Arc::new(Counters::default());
        let mut tasks = JoinSet::new();
        let agents: Vec<Arc<Agent>> = nodes
            .iter()
            .map(|node| {
                Arc::new(Agent {
                    node: node.clone(),
                    store_id: format!("hollow-{node}-{:016x}", rand::random::<u64>()),
                    held: Mutex::default(),
                    open: AtomicBool::new(false),
                })
            })
            .collect();
        for agent in &agents {
            tasks.spawn(run(
                cloud.to_owned(),
                heartbeat,
                Arc::clone(agent),
                Arc::clone(&arrivals),
                Arc::clone(&counters),
            ));
        }
        HollowFleet {
            agents,
            arrivals,
            counters,
            tasks,
        }
    }

    /// The fleet's counters.
    pub fn counters(&self) -> &Counters {
        &self.counters
    }

    /// How many agents have a sync stream open now.
    pub fn open(&self) -> usize {
        self.agents
            .iter()
            .filter(|a| a.open.load(Ordering::Relaxed))
            .count()
    }

    /// How many resources the agents hold in all.
    pub fn held(&self) -> usize {
        self.agents
            .iter()
            .map(|a| a.held.lock().expect("held").len())
            .sum()
    }

    /// How many Devices the agents hold at `generation` or later.
    pub fn held_at(&self, generation: i64) -> usize {
        self.agents
            .iter()
            .map(|a| {
                a.held
                    .lock()
                    .expect("held")
                    .values()
                    .filter(|v| v.generation >= generation)
                    .count()
            })
            .sum()
    }

    /// When each (Device, generation) first reached its agent.
    pub fn arrivals(&self) -> Arrivals {
        self.arrivals.lock().expect("arrivals").clone()
    }

    /// Stops every agent.
    pub async fn stop(mut self) {
        self.tasks.shutdown().await;
    }
}

/// Syncs `agent` until its task is aborted, reconnecting with backoff as
/// the real agent does (200 ms doubling to 5 s, with jitter).
async fn run(
    cloud: String,
    heartbeat: Heartbeat,
    agent: Arc<Agent>,
    arrivals: Arc<Mutex<Arrivals>>,
    counters: Arc<Counters>,
) {
    let mut delay = Duration::from_millis(200);
    let mut redirect: Option<String> = None;
    // A replica sent to that could not be reached (as the real agent).
    let mut unreachable: Option<String> = None;
    loop {
        let target = redirect.take();
        let here = target.clone().unwrap_or_else(|| cloud.clone());
        let opened = talk(&here, heartbeat, &agent, &arrivals, &counters).await;
        if agent.open.load(Ordering::Relaxed) || opened.is_ok() {
            unreachable = None;
        } else if target.is_some() {
            unreachable = target;
        }
        agent.open.store(false, Ordering::Relaxed);
        // A replica that does not serve the node says which one does, or
        // when to try again (its shard is moving), as for the real agent.
        let refusal = opened
            .as_ref()
            .err()
            .and_then(|error| error.downcast_ref::<tonic::Status>());
        let says = |key: &str| {
            let value = refusal?.metadata().get(key)?;
            Some(value.to_str().ok()?.to_owned())
        };
        redirect = says(proto::REDIRECT_METADATA);
        if redirect.is_some() && redirect == unreachable {
            // Sent again to the replica that could not be reached.
            redirect = None;
            tokio::time::sleep(Duration::from_millis(1000)).await;
            delay = Duration::from_millis(200);
            continue;
        }
        if redirect.is_some() {
            counters.redirects.fetch_add(1, Ordering::Relaxed);
            tokio::time::sleep(Duration::from_millis(20)).await;
            continue;
        }
        if let Some(ms) = says(proto::RETRY_AFTER_METADATA).and_then(|ms| ms.parse::<u64>().ok()) {
            let jitter = rand::random::<f64>() / 2.0;
            tokio::time::sleep(Duration::from_millis(ms).mul_f64(1.0 + jitter)).await;
            delay = Duration::from_millis(200);
            continue;
        }
        if let Err(error) = opened {
            counters.session_errors.fetch_add(1, Ordering::Relaxed);
            *counters.last_error.lock().expect("last error") =
                Some(format!("{}: {error:#}", agent.node));
        } else {
            delay = Duration::from_millis(200);
        }
        let jitter = rand::random::<f64>() * delay.as_secs_f64();
        tokio::time::sleep(Duration::from_secs_f64(delay.as_secs_f64() + jitter)).await;
        delay = (delay * 2).min(Duration::from_secs(5));
    }
}

/// One sync session: `Ok` when the controller closed it after it opened.
async fn talk(
    cloud: &str,
    heartbeat: Heartbeat,
    agent: &Agent,
    arrivals: &Mutex<Arrivals>,
    counters: &Counters,
) -> anyhow::Result<()> {
    let channel = tonic::transport::Endpoint::from_shared(cloud.to_owned())?
        .connect_timeout(Duration::from_secs(10))
        .connect()
        .await?;
    let mut client = proto::sync_client::SyncClient::new(channel)
        .max_decoding_message_size(proto::MAX_MESSAGE_BYTES)
        .max_encoding_message_size(proto::MAX_MESSAGE_BYTES);
    let (tx, rx) = mpsc::channel(16);
    let hello = {
        let held = agent.held.lock().expect("held");
        session::hello(
            &agent.node,
            "hollow",
            "hollow",
            &agent.store_id,
            held.iter(),
        )
    };
    send(&tx, agent_message::Kind::Hello(hello)).await?;
    let mut inbound = client
        .stream(tonic::Request::new(ReceiverStream::new(rx)))
        .await?
        .into_inner();
    agent.open.store(true, Ordering::Relaxed);
    counters.sessions.fetch_add(1, Ordering::Relaxed);
    let mut core = Session::default();
    let mut beat = tokio::time::interval(heartbeat.interval);
    loop {
        tokio::select! {
            message = inbound.message() => {
                let Some(message) = message? else { return Ok(()) };
                match core.received(message) {
                    Step::Store { upserts, removals, reply } => {
                        store(agent, arrivals, upserts, &removals);
                        counters.updates.fetch_add(1, Ordering::Relaxed);
                        send(&tx, reply).await?;
                    }
                    Step::ListHoldings { parts } => {
                        counters.inventories.fetch_add(1, Ordering::Relaxed);
                        let held: Vec<_> = agent
                            .held
                            .lock()
                            .expect("held")
                            .iter()
                            .map(|(k, v)| (k.clone(), v.clone()))
                            .collect();
                        for part in session::inventory(&held, parts) {
                            send(&tx, agent_message::Kind::Inventory(part)).await?;
                        }
                    }
                    Step::UplinkAcked { .. } | Step::Nothing => {}
                }
            }
            _ = beat.tick() => {
                let device_count = agent.held.lock().expect("held").len() as u32;
                let beat = proto::Heartbeat {
                    sent_at_ms: now_unix_ms(),
                    outbox_depth: 0,
                    events_dropped: 0,
                    device_count,
                };
                send(&tx, agent_message::Kind::Heartbeat(beat)).await?;
            }
        }
    }
}

/// What the real agent's store does with an Update, in memory.
fn store(
    agent: &Agent,
    arrivals: &Mutex<Arrivals>,
    upserts: Vec<(ResourceKey, Desired)>,
    removals: &[ResourceKey],
) {
    let now = now_unix_ms();
    let mut held = agent.held.lock().expect("held");
    let mut arrived = arrivals.lock().expect("arrivals");
    for (key, desired) in upserts {
        let version = match desired {
            Desired::Device(device) => {
                arrived
                    .entry((key.clone(), device.version.generation))
                    .or_insert(now);
                device.version
            }
            Desired::Rule(rule) => rule.version,
            Desired::Credential(credential) => credential.version,
        };
        held.insert(key, version);
    }
    for key in removals {
        held.remove(key);
    }
}

async fn send(
    tx: &mpsc::Sender<proto::AgentMessage>,
    kind: agent_message::Kind,
) -> anyhow::Result<()> {
    tx.send(proto::AgentMessage { kind: Some(kind) })
        .await
        .map_err(|_| anyhow::anyhow!("the sync stream closed"))
}
