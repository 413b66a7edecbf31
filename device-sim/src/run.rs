//! The simulation at run time: one task per device and its MQTT session,
//! and per node one CoAP client (one UDP socket).
//!
//! A device task owns its [`SimDevice`]. It wakes up when a desired state
//! arrives (applies it and reports at once), when its report is due (every
//! report interval, the first one spread over the interval), when a firmware
//! install completes (reports the new version at once) and when its report in
//! flight finishes. It keeps at most one report in flight: a report due
//! meanwhile is sent, with the then-current state, once the previous one is
//! done.
//!
//! A device also raises events: `ConfigApplied` for each new generation,
//! `FirmwareInstalled` when an install completes, and `SelfCheck` every
//! `event_every` reports if asked. They go up one at a time, oldest first,
//! and are resent until the agent confirms them (see [`EventQueue`]).

use std::collections::HashSet;
use std::future::Future;
use std::pin::Pin;
use std::sync::Arc;
use std::time::Duration;

use anyhow::{Context, bail};
use edgefleet_shared::ResourceKey;
use edgefleet_shared::api::Transport;
use edgefleet_shared::codec::{self, DesiredState, DeviceEvent, DeviceReport, EventAck};
use edgefleet_shared::topics;
use rand::RngExt;
use tokio::sync::watch;
use tokio::task::JoinSet;
use tokio::time::Instant;

use crate::applied_log::{AppliedEntry, AppliedLog};
use crate::coap::{CoapClient, ExchangeError, Request};
use crate::config::{NodeEndpoint, RunConfig};
use crate::device::{Applied, Purpose, SimDevice, device_rng};
use crate::events::{EventId, EventQueue};
use crate::fleet::DeviceSlot;
use crate::keys;
use crate::model::SimRng;
use crate::mqtt::{self, Inbox, PublishError, Publisher, Route, Routes};
use crate::retransmit::RetransmitParams;
use crate::summary::{Stats, Summary};

/// A report on its way; resolves once it is acknowledged (`true`), refused
/// or failed.
type InFlight = Pin<Box<dyn Future<Output = bool> + Send>>;

/// An event on its way; resolves with the highest event id the agent
/// confirmed, or `None` if it did not answer.
type EventFlight = Pin<Box<dyn Future<Output = Option<EventAck>> + Send>>;

/// How long a device waits for the agent's confirmation of an MQTT event
/// before sending it again, and after a failed attempt over CoAP.
const EVENT_RETRY: Duration = Duration::from_secs(3);

/// How long one attempt to deliver an event over CoAP may take. CoAP's own
/// retransmissions back off to tens of seconds; an agent that restarted
/// meanwhile is better asked again at once (it stores each id once).
const EVENT_ATTEMPT: Duration = Duration::from_secs(6);

/// How long a stopping device waits for its report in flight: long enough
/// for two retransmissions (2–3 s, then 4–6 s), as a report whose answer
/// was lost to an agent restart needs one in a new DTLS session.
const STOP_GRACE: Duration = Duration::from_secs(12);

/// One line of the final-state file: a device's last report the agent
/// acknowledged (for MQTT devices: the last one handed to the session).
#[derive(Debug, serde::Serialize)]
struct FinalState {
    device: String,
    report: Option<DeviceReport>,
    /// Every event the device raised, as (boot epoch, id).
    events: Vec<EventId>,
    /// Those the agent had not confirmed when the simulation stopped.
    unconfirmed_events: Vec<EventId>,
    /// Those given up unconfirmed because the device's Device was deleted.
    abandoned_events: Vec<EventId>,
}

/// A boot epoch for a device that boots now: random, so it differs from
/// the device's earlier boots (also those of an earlier run of the
/// simulator, whose ids count from 1 as well). Never 0, which means none.
fn new_boot() -> u64 {
    rand::random::<u64>().max(1)
}

/// Runs the simulation until `shutdown` resolves, then stops every device
/// and returns the final counters.
///
/// Periodic summaries go to stderr if `config.summary_interval` is set.
pub async fn run(config: RunConfig, shutdown: impl Future<Output = ()>) -> anyhow::Result<Summary> {
    let slots = config.fleet.layout()?;
    validate(&config)?;

    let stats = Arc::new(Stats::default());
    let (stop_tx, stop_rx) = watch::channel(false);
    // MQTT sessions stop after every device: a stopping device still sends
    // its report and events in flight through them.
    let (sessions_stop_tx, sessions_stop_rx) = watch::channel(false);
    let (applied_log, log_writer) = match &config.applied_log {
        Some(path) => {
            let (log, writer) = AppliedLog::open(path)
                .with_context(|| format!("opening the applied log {}", path.display()))?;
            (Some(log), Some(writer))
        }
        None => (None, None),
    };
    let start = Instant::now();
    let mut tasks: JoinSet<Option<FinalState>> = JoinSet::new();

    for endpoint in &config.endpoints {
        let node_slots: Vec<_> = slots.iter().filter(|s| s.node == endpoint.name).collect();
        let node = NodeContext {
            config: &config,
            endpoint,
            start,
            stats: &stats,
            applied_log: applied_log.as_ref(),
            stop: &stop_rx,
            sessions_stop: &sessions_stop_rx,
        };
        node.spawn(&node_slots, &mut tasks).await?;
        stats.add_devices(node_slots.len() as u64);
    }
    tracing::info!(
        devices = slots.len(),
        nodes = config.endpoints.len(),
        "simulation running"
    );
    if let Some(every) = config.summary_interval {
        let summaries = print_summaries(every, Arc::clone(&stats), stop_rx.clone());
        tasks.spawn(async move {
            summaries.await;
            None
        });
    }

    shutdown.await;
    stop_tx.send_replace(true);
    let mut finals = Vec::new();
    while let Some(result) = tasks.join_next().await {
        match result {
            Ok(Some(state)) => {
                finals.push(state);
                if finals.len() == slots.len() {
                    sessions_stop_tx.send_replace(true);
                }
            }
            Ok(None) => {}
            Err(e) if e.is_panic() => std::panic::resume_unwind(e.into_panic()),
            Err(_) => {}
        }
    }
    if let Some(path) = &config.final_state {
        finals.sort_by(|a, b| a.device.cmp(&b.device));
        let mut text = String::new();
        for state in &finals {
            text.push_str(&serde_json::to_string(state)?);
            text.push('\n');
        }
        std::fs::write(path, text)
            .with_context(|| format!("writing the final state {}", path.display()))?;
    }
    drop(applied_log);
    if let Some(writer) = log_writer {
        writer
            .await
            .context("the applied-log writer panicked")?
            .context("writing the applied log")?;
    }
    Ok(stats.snapshot())
}

/// Every node of the fleet needs exactly one endpoint, and devices need
/// time between reports.
fn validate(config: &RunConfig) -> anyhow::Result<()> {
    if config.report_interval.is_zero() {
        bail!("the report interval must be more than zero");
    }
    let mut names = HashSet::new();
    for endpoint in &config.endpoints {
        if !names.insert(endpoint.name.as_str()) {
            bail!("node {} is given twice", endpoint.name);
        }
    }
    for node in &config.fleet.nodes {
        if !names.contains(node.as_str()) {
            bail!("node {node} has no endpoint (NAME=COAP_ADDR,MQTT_HOST:PORT)");
        }
    }
    Ok(())
}

/// What the devices of one node share.
struct NodeContext<'a> {
    config: &'a RunConfig,
    endpoint: &'a NodeEndpoint,
    start: Instant,
    stats: &'a Arc<Stats>,
    applied_log: Option<&'a AppliedLog>,
    stop: &'a watch::Receiver<bool>,
    sessions_stop: &'a watch::Receiver<bool>,
}

impl NodeContext<'_> {
    /// Opens the node's CoAP sockets and spawns its devices, each with its
    /// own MQTT session: with DTLS a socket and session per CoAP device,
    /// otherwise one plain socket for all.
    async fn spawn(
        &self,
        slots: &[&DeviceSlot],
        tasks: &mut JoinSet<Option<FinalState>>,
    ) -> anyhow::Result<()> {
        let node = &self.endpoint.name;
        let agent = tokio::net::lookup_host(&self.endpoint.coap)
            .await
            .ok()
            .and_then(|mut addrs| addrs.next())
            .with_context(|| format!("cannot resolve {} (CoAP of {node})", self.endpoint.coap))?;
        // Random first message id and token, so a restarted simulator does
        // not repeat ids the agent still remembers.
        let shared = match self.config.insecure_coap_plain {
            true => Some(Arc::new(
                CoapClient::connect(agent, rand::random(), rand::random())
                    .await
                    .with_context(|| format!("opening a UDP socket to {agent}"))?,
            )),
            false => None,
        };
        for slot in slots {
            let coap = match (&shared, slot.transport) {
                (Some(shared), _) => Some(Arc::clone(shared)),
                (None, Transport::Coap) => {
                    let key = ResourceKey::device(&self.config.namespace, &slot.name);
                    let psk = keys::device_key(&self.config.fleet_key, &key);
                    let client = CoapClient::connect_dtls(
                        agent,
                        &key,
                        psk.as_bytes(),
                        rand::random(),
                        rand::random(),
                    )
                    .await
                    .with_context(|| format!("opening a UDP socket to {agent}"))?;
                    Some(Arc::new(client))
                }
                (None, Transport::Mqtt) => None,
            };
            self.spawn_device(slot, coap, tasks);
        }
        Ok(())
    }

    /// Spawns a device and its MQTT session, logged in with its key.
    fn spawn_device(
        &self,
        slot: &DeviceSlot,
        coap: Option<Arc<CoapClient>>,
        tasks: &mut JoinSet<Option<FinalState>>,
    ) {
        let node = &self.endpoint.name;
        let key = ResourceKey::device(&self.config.namespace, &slot.name);
        let (publisher, session) = mqtt::connect(
            &key,
            &keys::device_key(&self.config.fleet_key, &key),
            &self.endpoint.mqtt_host,
            self.endpoint.mqtt_port,
        );

        let mut routes = Routes::new();
        let (inbox_tx, inbox) = watch::channel(None);
        routes.insert(topics::desired(node, &key), Route::Desired(inbox_tx));
        let (acks_tx, acks) = watch::channel(EventAck::default());
        if slot.transport == Transport::Mqtt {
            routes.insert(topics::event_ack(node, &key), Route::EventAck(acks_tx));
        }
        let reporter = match (slot.transport, coap) {
            (Transport::Coap, Some(client)) => Reporter::Coap {
                client,
                namespace: key.namespace.clone(),
                name: key.name.clone(),
                params: self.config.retransmit,
            },
            (Transport::Coap, None) => unreachable!("spawn opens a CoAP client per CoAP device"),
            (Transport::Mqtt, _) => Reporter::Mqtt {
                publisher,
                topic: topics::report(node, &key),
                event_topic: topics::event(node, &key),
                acks,
            },
        };
        let device = DeviceTask {
            id: format!("{}/{}", key.namespace, key.name),
            device: SimDevice::new(slot.model, self.config.seed, slot.index)
                .with_steady(slot.index % 100 >= usize::from(self.config.changing_percent))
                .with_firmware_rules(Arc::clone(&self.config.firmware)),
            net_rng: device_rng(self.config.seed, slot.index, Purpose::Network),
            inbox,
            reporter,
            report_interval: self.config.report_interval,
            event_every: self.config.event_every,
            events: EventQueue::new(new_boot()),
            start: self.start,
            stats: Arc::clone(self.stats),
            applied_log: self.applied_log.cloned(),
            stop: self.stop.clone(),
        };
        tasks.spawn(device.run());
        let session = mqtt::drive(
            session,
            routes,
            Arc::clone(self.stats),
            self.sessions_stop.clone(),
        );
        tasks.spawn(async move {
            session.await;
            None
        });
    }
}

/// How a device sends its reports.
enum Reporter {
    /// CoAP POST to the node's agent.
    Coap {
        client: Arc<CoapClient>,
        namespace: String,
        name: String,
        params: RetransmitParams,
    },
    /// MQTT publish (QoS 1) to the device's report or event topic; events
    /// are confirmed on the device's event-ack topic (`acks`).
    Mqtt {
        publisher: Publisher,
        topic: String,
        event_topic: String,
        acks: watch::Receiver<EventAck>,
    },
}

impl Reporter {
    /// Starts sending `payload`; the future counts how it ended.
    fn send(&self, payload: Vec<u8>, rng: &mut SimRng, stats: Arc<Stats>) -> InFlight {
        stats.report_sent();
        match self {
            Reporter::Coap {
                client,
                namespace,
                name,
                params,
            } => {
                let request = Request::report(namespace, name, payload);
                let retransmission = params.start(rng);
                let client = Arc::clone(client);
                Box::pin(async move {
                    let exchange = client.request(&request, retransmission).await;
                    stats.retransmitted(exchange.retransmissions.into());
                    match exchange.result {
                        Ok(response) if response.is_success() => {
                            stats.report_acknowledged();
                            return true;
                        }
                        Ok(response) => {
                            let code = response.code.to_string();
                            tracing::debug!(path = ?request.path, %code, "report refused");
                            stats.report_refused(&code);
                        }
                        // Shutting down: the report is neither here nor there.
                        Err(ExchangeError::Closed) => {}
                        Err(e) => {
                            tracing::debug!(path = ?request.path, error = %e, "report failed");
                            stats.report_failed();
                        }
                    }
                    false
                })
            }
            Reporter::Mqtt {
                publisher, topic, ..
            } => {
                let (publisher, topic) = (publisher.clone(), topic.clone());
                Box::pin(async move {
                    match publisher.publish(&topic, payload).await {
                        Ok(()) => {
                            stats.report_acknowledged();
                            true
                        }
                        // Shutting down: as with CoAP, neither here nor there.
                        Err(PublishError::Closed) => false,
                        Err(e) => {
                            tracing::debug!(%topic, error = %e, "report publish failed");
                            stats.report_failed();
                            false
                        }
                    }
                })
            }
        }
    }
}

impl Reporter {
    /// Starts sending `event`; the future resolves with the agent's
    /// confirmation.
    fn send_event(&self, event: &DeviceEvent, rng: &mut SimRng) -> EventFlight {
        let payload = match codec::encode(event) {
            Ok(payload) => payload,
            Err(e) => {
                // Raised by this program: a bug, not a network failure.
                panic!("event {event:?} does not encode: {e}");
            }
        };
        let (id, boot) = (event.id, event.boot);
        match self {
            Reporter::Coap {
                client,
                namespace,
                name,
                params,
            } => {
                let request = Request::event(namespace, name, payload);
                let retransmission = params.start(rng);
                let client = Arc::clone(client);
                Box::pin(async move {
                    let attempt = client.request(&request, retransmission);
                    let Ok(exchange) = tokio::time::timeout(EVENT_ATTEMPT, attempt).await else {
                        return None;
                    };
                    match exchange.result {
                        Ok(response) if response.is_success() => {
                            codec::decode::<EventAck>(&response.payload).ok()
                        }
                        Ok(response) => {
                            tracing::debug!(path = ?request.path, code = %response.code, "event refused");
                            None
                        }
                        Err(_) => None,
                    }
                })
            }
            Reporter::Mqtt {
                publisher,
                event_topic,
                acks,
                ..
            } => {
                let (publisher, topic, mut acks) =
                    (publisher.clone(), event_topic.clone(), acks.clone());
                Box::pin(async move {
                    if let Err(e) = publisher.publish(&topic, payload).await {
                        tracing::debug!(%topic, error = %e, "event publish failed");
                        return None;
                    }
                    let confirmed = tokio::time::timeout(
                        EVENT_RETRY,
                        acks.wait_for(|a| a.boot == boot && a.id >= id),
                    )
                    .await;
                    match confirmed {
                        Ok(Ok(ack)) => Some(ack.clone()),
                        _ => None,
                    }
                })
            }
        }
    }
}

/// Why a device task woke up.
enum Wake {
    /// The simulation is stopping.
    Stop,
    /// A message arrived in the inbox.
    Inbox,
    /// The periodic report is due.
    ReportDue,
    /// A firmware install completes.
    InstallDue,
    /// The report in flight finished (acknowledged or not).
    ReportDone(bool),
    /// The event in flight finished: the confirmation, if any.
    EventDone(Option<EventAck>),
    /// Time to try the unconfirmed events again.
    EventRetry,
}

/// One simulated device at run time.
struct DeviceTask {
    /// `<namespace>/<name>`.
    id: String,
    device: SimDevice,
    net_rng: SimRng,
    inbox: watch::Receiver<Option<Inbox>>,
    reporter: Reporter,
    report_interval: Duration,
    /// Raise a `SelfCheck` event every this many reports (0: never).
    event_every: u32,
    events: EventQueue,
    start: Instant,
    stats: Arc<Stats>,
    applied_log: Option<AppliedLog>,
    stop: watch::Receiver<bool>,
}

impl DeviceTask {
    /// Runs until stopped; returns the device's final state.
    async fn run(mut self) -> Option<FinalState> {
        let first = self
            .report_interval
            .mul_f64(self.net_rng.random_range(0.0..1.0));
        // `None` while the Device is deleted: no periodic reports.
        let mut next_report = Some(self.start + first);
        let mut in_flight: Option<(InFlight, DeviceReport)> = None;
        let mut acknowledged: Option<DeviceReport> = None;
        let mut report_due = false;
        let mut event_in_flight: Option<EventFlight> = None;
        let mut event_retry_at: Option<Instant> = None;
        let mut firmware = self.device.firmware_version().to_owned();
        let mut reports = 0u64;
        loop {
            let install_due = self.device.install_due().map(|at| self.start + at);
            let wake = tokio::select! {
                _ = self.stop.wait_for(|stop| *stop) => Wake::Stop,
                changed = self.inbox.changed() => match changed {
                    Ok(()) => Wake::Inbox,
                    // The node's session is gone: the simulation is ending.
                    Err(_) => Wake::Stop,
                },
                () = sleep_until(next_report) => Wake::ReportDue,
                () = sleep_until(install_due) => Wake::InstallDue,
                ok = async { in_flight.as_mut().expect("guarded by the precondition").0.as_mut().await },
                    if in_flight.is_some() => Wake::ReportDone(ok),
                confirmed = async { event_in_flight.as_mut().expect("guarded by the precondition").as_mut().await },
                    if event_in_flight.is_some() => Wake::EventDone(confirmed),
                () = sleep_until(event_retry_at) => Wake::EventRetry,
            };
            match wake {
                Wake::Stop => {
                    // Let the report in flight finish, so the final state is
                    // what the agent last stored.
                    if let Some((report, sent)) = in_flight.take()
                        && tokio::time::timeout(STOP_GRACE, report).await == Ok(true)
                    {
                        acknowledged = Some(sent);
                    }
                    // And the events still unconfirmed, for as long: asked
                    // afresh, not by waiting out an attempt that may be in
                    // a long retransmission wait.
                    drop(event_in_flight.take());
                    let drain = async {
                        while let Some(event) = self.events.next() {
                            match self.reporter.send_event(event, &mut self.net_rng).await {
                                Some(ack) => self.events.confirmed(&ack),
                                None => tokio::time::sleep(Duration::from_millis(200)).await,
                            }
                        }
                    };
                    let _ = tokio::time::timeout(STOP_GRACE, drain).await;
                    break;
                }
                Wake::Inbox => {
                    let message = self.inbox.borrow_and_update().clone();
                    match message {
                        Some(Inbox::Desired(desired)) => {
                            if self.apply(&desired) == Applied::New {
                                report_due = true;
                            }
                            next_report
                                .get_or_insert_with(|| Instant::now() + self.report_interval);
                        }
                        Some(Inbox::Deleted) => {
                            self.device.forget();
                            self.events.abandon();
                            event_retry_at = None;
                            self.stats.desired_deleted();
                            next_report = None;
                            report_due = false;
                        }
                        None => {}
                    }
                }
                Wake::ReportDue => {
                    report_due = true;
                    next_report = Some(Instant::now() + self.report_interval);
                }
                Wake::InstallDue => {
                    self.device.advance(self.start.elapsed());
                    report_due = true;
                }
                Wake::ReportDone(ok) => {
                    if let Some((_, sent)) = in_flight.take()
                        && ok
                    {
                        acknowledged = Some(sent);
                    }
                }
                Wake::EventDone(confirmed) => {
                    event_in_flight = None;
                    match confirmed {
                        Some(ack) => self.events.confirmed(&ack),
                        None => event_retry_at = Some(Instant::now() + EVENT_RETRY),
                    }
                }
                Wake::EventRetry => event_retry_at = None,
            }
            if report_due && in_flight.is_none() {
                report_due = false;
                in_flight = self.report();
                next_report = next_report.map(|_| Instant::now() + self.report_interval);
                reports += 1;
                if self.event_every > 0 && reports.is_multiple_of(u64::from(self.event_every)) {
                    let n = reports / u64::from(self.event_every);
                    self.events
                        .raise(false, "SelfCheck", format!("self check {n} passed"));
                }
            }
            if self.device.firmware_version() != firmware {
                firmware = self.device.firmware_version().to_owned();
                // A firmware install reboots the device, which keeps no
                // event counter: a new epoch, ids from 1.
                self.events.reboot(new_boot());
                self.events.raise(
                    false,
                    "FirmwareInstalled",
                    format!("firmware {firmware} installed"),
                );
            }
            if event_in_flight.is_none()
                && event_retry_at.is_none()
                && let Some(event) = self.events.next()
            {
                event_in_flight = Some(self.reporter.send_event(event, &mut self.net_rng));
            }
        }
        Some(FinalState {
            device: self.id.clone(),
            report: acknowledged,
            events: self.events.raised().to_vec(),
            unconfirmed_events: self.events.unconfirmed(),
            abandoned_events: self.events.abandoned().to_vec(),
        })
    }

    /// Applies a desired state, counting and logging a new one.
    fn apply(&mut self, desired: &DesiredState) -> Applied {
        let applied = self.device.apply(desired, self.start.elapsed());
        if applied == Applied::New {
            self.events.raise(
                false,
                "ConfigApplied",
                format!("applied generation {}", desired.generation),
            );
            self.stats.desired_applied();
            if let Some(log) = &self.applied_log {
                log.record(AppliedEntry::now(self.id.clone(), desired.generation));
            }
        }
        applied
    }

    /// Starts a report of the current state.
    fn report(&mut self) -> Option<(InFlight, DeviceReport)> {
        self.device.advance(self.start.elapsed());
        let report = self.device.report();
        match codec::encode(&report) {
            Ok(payload) => Some((
                self.reporter
                    .send(payload, &mut self.net_rng, Arc::clone(&self.stats)),
                report,
            )),
            Err(e) => {
                tracing::warn!(device = %self.id, error = %e, "cannot encode the report");
                self.stats.report_sent();
                self.stats.report_failed();
                None
            }
        }
    }
}

/// Sleeps until `deadline`, or forever if there is none.
async fn sleep_until(deadline: Option<Instant>) {
    match deadline {
        Some(deadline) => tokio::time::sleep_until(deadline).await,
        None => std::future::pending().await,
    }
}

/// Prints the summary line to stderr every `every` until stopped.
async fn print_summaries(every: Duration, stats: Arc<Stats>, mut stop: watch::Receiver<bool>) {
    let mut ticks = tokio::time::interval_at(Instant::now() + every, every);
    ticks.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
    loop {
        tokio::select! {
            _ = stop.wait_for(|stop| *stop) => break,
            _ = ticks.tick() => eprintln!("edgefleet-sim: {}", stats.snapshot()),
        }
    }
}
