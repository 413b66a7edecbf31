//! The CoAP server for constrained devices, on UDP: over DTLS with each
//! device's pre-shared key by default ([`dtls`]), where a session may act
//! only for its own device (`4.03 Forbidden` otherwise, outcome
//! `forbidden`); plain CoAP only with [`Security::InsecurePlain`].
//!
//! Resources, per device:
//! - `POST d/<namespace>/<name>/report` with a CBOR [`DeviceReport`]:
//!   `2.04 Changed` once the report is durable in the store;
//! - `POST d/<namespace>/<name>/events` with a CBOR [`DeviceEvent`]:
//!   `2.04 Changed` with a CBOR [`EventAck`] once the event is durable in
//!   the store; an event id the device sent before is answered the same way
//!   and not stored twice (outcome `event_duplicate`);
//! - `GET d/<namespace>/<name>/desired`: `2.05 Content` with the CBOR
//!   [`DesiredState`](edgefleet_shared::codec::DesiredState). It is
//!   observable (RFC 7641): with `Observe: 0` the requester (its endpoint and
//!   token) is registered and the response carries an Observe number; each
//!   later change of the device's desired state is notified as a `2.05` with
//!   a larger number, and the device's removal from the node as a `4.04`
//!   that ends the observation. `Observe: 1`, a `GET` without Observe with
//!   the same token, or a Reset of a notification ends it too. Over the
//!   bounds the `GET` is answered without Observe (outcome
//!   `observe_refused`). See [`observe`] for the design.
//!
//! Refusals carry the right code and a short text, never longer than the
//! request (see [`checks`]): `4.00` malformed, `4.02` a critical option
//! the agent does not implement, `4.04` unknown device or resource, `4.05`
//! wrong method, `4.06` an Accept other than CBOR, `4.13` too large (with
//! Size1 giving the limit), `4.15` a payload that says it is not CBOR. Each
//! is counted by reason. At most [`MAX_REQUESTS_IN_FLIGHT`] requests are
//! handled at once; beyond, a request is answered `5.03` with `Max-Age: 1`
//! (outcome `overloaded`; `--coap-max-requests-in-flight`). An empty confirmable message (a CoAP ping) is
//! answered with a Reset, as is any other confirmable message that is not
//! a request (outcome `ping`, `rejected`).
//!
//! A confirmable request retransmitted with the same message id is answered
//! from [`RecentExchanges`] and not processed twice.

pub mod checks;
pub mod dtls;
pub mod observe;

use std::collections::{HashMap, VecDeque};
use std::net::SocketAddr;
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use coap_lite::{
    CoapOption, ContentFormat, MessageClass, MessageType, ObserveOption, Packet, RequestType,
    ResponseType,
};
use edgefleet_shared::ResourceKey;
use edgefleet_shared::codec::{self, CodecError, DeviceEvent, DeviceReport, EventAck};
use edgefleet_shared::telemetry::Outcomes;
use prometheus_client::metrics::gauge::Gauge;
use prometheus_client::registry::Registry;
use tokio::net::UdpSocket;
use tokio::sync::{Notify, broadcast};

use self::dtls::{DtlsMetrics, DtlsSettings, Sessions};
use self::observe::{Content, Due, Kind, ObserveSettings, Observers, Outgoing, Registration};
use crate::store::{DesiredChange, EventOutcome, Store};

/// RFC 7252's EXCHANGE_LIFETIME: how long a message id may be retransmitted.
pub const EXCHANGE_LIFETIME: Duration = Duration::from_secs(247);

/// How many recent exchanges are remembered for de-duplication.
pub const RECENT_EXCHANGES: usize = 16_384;

/// How many requests are handled at once by default (each waits for a
/// durable write at most); beyond, `5.03 Service Unavailable` with
/// `Max-Age: 1`.
pub const MAX_REQUESTS_IN_FLIGHT: usize = 512;

/// How devices reach the server.
#[derive(Clone, Debug)]
pub enum Security {
    /// CoAP over DTLS with each device's pre-shared key; a device may only
    /// act for itself (see [`dtls`]).
    Dtls(DtlsSettings),
    /// Plain CoAP: anyone on the network may act for any device. For labs.
    InsecurePlain,
}

/// The CoAP server's bounds.
#[derive(Clone, Debug)]
pub struct CoapSettings {
    /// Observers (RFC 7641).
    pub observe: ObserveSettings,
    /// Requests handled at once.
    pub max_requests_in_flight: usize,
    /// DTLS, or plain CoAP.
    pub security: Security,
}

impl Default for CoapSettings {
    fn default() -> Self {
        CoapSettings {
            observe: ObserveSettings::default(),
            max_requests_in_flight: MAX_REQUESTS_IN_FLIGHT,
            security: Security::Dtls(DtlsSettings::default()),
        }
    }
}

/// What a request is for.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Route {
    /// A device's report.
    Report(ResourceKey),
    /// A device's events.
    Events(ResourceKey),
    /// A device's desired state.
    Desired(ResourceKey),
}

impl Route {
    /// The device the resource belongs to.
    pub fn device(&self) -> &ResourceKey {
        match self {
            Route::Report(key) | Route::Events(key) | Route::Desired(key) => key,
        }
    }
}

/// Maps a Uri-Path to a resource.
pub fn route(path: &[String]) -> Option<Route> {
    match path {
        [d, namespace, name, resource] if d == "d" && !namespace.is_empty() && !name.is_empty() => {
            let key = ResourceKey::device(namespace, name);
            match resource.as_str() {
                "report" => Some(Route::Report(key)),
                "events" => Some(Route::Events(key)),
                "desired" => Some(Route::Desired(key)),
                _ => None,
            }
        }
        _ => None,
    }
}

/// Responses to recent exchanges, by peer and message id.
#[derive(Debug, Default)]
pub struct RecentExchanges {
    // `None` while the first copy of the request is still being handled.
    responses: HashMap<(SocketAddr, u16), Option<Vec<u8>>>,
    order: VecDeque<(Instant, (SocketAddr, u16))>,
}

/// What to do with an incoming message id.
#[derive(Debug, PartialEq, Eq)]
pub enum Exchange {
    /// First time: handle it.
    New,
    /// Seen and answered: send this again.
    Answered(Vec<u8>),
    /// Seen and still being handled: drop this copy.
    InProgress,
}

impl RecentExchanges {
    /// Looks up (and, if new, records) an exchange.
    pub fn begin(&mut self, peer: SocketAddr, message_id: u16, now: Instant) -> Exchange {
        self.expire(now);
        match self.responses.get(&(peer, message_id)) {
            Some(Some(response)) => Exchange::Answered(response.clone()),
            Some(None) => Exchange::InProgress,
            None => {
                self.responses.insert((peer, message_id), None);
                self.order.push_back((now, (peer, message_id)));
                Exchange::New
            }
        }
    }

    /// Records the response to an exchange.
    pub fn answer(&mut self, peer: SocketAddr, message_id: u16, response: Vec<u8>) {
        if let Some(slot) = self.responses.get_mut(&(peer, message_id)) {
            *slot = Some(response);
        }
    }

    fn expire(&mut self, now: Instant) {
        while let Some((at, key)) = self.order.front().copied() {
            let expired = now.duration_since(at) >= EXCHANGE_LIFETIME;
            if !expired && self.order.len() < RECENT_EXCHANGES {
                break;
            }
            self.order.pop_front();
            self.responses.remove(&key);
        }
    }

    /// Exchanges remembered.
    pub fn len(&self) -> usize {
        self.responses.len()
    }

    /// Whether none is remembered.
    pub fn is_empty(&self) -> bool {
        self.responses.is_empty()
    }
}

/// The CoAP server's counters.
#[derive(Debug, Default)]
pub struct CoapMetrics {
    /// Requests by outcome (`stored`, `content`, `observe_registered`,
    /// `observe_refused`, `duplicate`, or the refusal reason).
    pub requests: Outcomes,
    /// Observers added and removed, by event: `registered`, `renewed`,
    /// `refused`, `evicted` (the least recently heard one at a device's
    /// cap), `deregistered`, `reset`, `timed_out`, `device_removed`.
    pub observe: Outcomes,
    /// Notifications sent, by kind: `non`, `con`, `retransmission`, `gone`.
    pub notifications: Outcomes,
    /// Observers registered now.
    pub observers: Gauge,
    /// DTLS sessions.
    pub dtls: Arc<DtlsMetrics>,
}

impl CoapMetrics {
    /// Registers every CoAP counter in `registry`.
    pub fn register(&self, registry: &mut Registry) {
        self.requests
            .register(registry, "coap_requests", "CoAP requests by outcome");
        self.observe.register(
            registry,
            "coap_observe",
            "CoAP observers added and removed, by event",
        );
        self.notifications.register(
            registry,
            "coap_notifications",
            "CoAP Observe notifications sent, by kind",
        );
        registry.register(
            "coap_observers",
            "CoAP observers registered now",
            self.observers.clone(),
        );
        self.dtls.register(registry);
    }
}

/// What the server shares between its tasks.
#[derive(Debug)]
struct Shared {
    socket: UdpSocket,
    // The DTLS sessions; `None` for plain CoAP.
    sessions: Option<Mutex<Sessions>>,
    store: Store,
    metrics: Arc<CoapMetrics>,
    exchanges: Mutex<RecentExchanges>,
    observers: Mutex<Observers>,
    // Woken when a confirmable notification goes out, so the retransmission
    // timer looks at the new deadline.
    in_flight: Notify,
    // A permit per request being handled.
    requests: Arc<tokio::sync::Semaphore>,
}

impl Shared {
    fn observers(&self) -> std::sync::MutexGuard<'_, Observers> {
        self.observers.lock().expect("observers")
    }

    fn count_observers(&self, observers: &Observers) {
        self.metrics.observers.set(observers.len() as i64);
    }

    /// Sends one CoAP message to `peer`, through its DTLS session if the
    /// server speaks DTLS (and nothing if that session is gone).
    async fn send_to(&self, message: &[u8], peer: SocketAddr) {
        let records = match &self.sessions {
            None => {
                self.send_datagram(message, peer).await;
                return;
            }
            Some(sessions) => sessions.lock().expect("sessions").send(peer, message),
        };
        match records {
            Some(records) => {
                for record in records {
                    self.send_datagram(&record, peer).await;
                }
            }
            None => self.metrics.dtls.events.inc("no_session"),
        }
    }

    /// Sends `response` to `peer`, and remembers it as the answer to a
    /// confirmable request, so a retransmission gets it again.
    async fn answer(
        &self,
        response: &Packet,
        peer: SocketAddr,
        message_id: u16,
        confirmable: bool,
    ) {
        let Ok(bytes) = response.to_bytes() else {
            return;
        };
        if confirmable {
            self.exchanges
                .lock()
                .expect("exchanges")
                .answer(peer, message_id, bytes.clone());
        }
        self.send_to(&bytes, peer).await;
    }

    async fn send_datagram(&self, datagram: &[u8], peer: SocketAddr) {
        if let Err(error) = self.socket.send_to(datagram, peer).await {
            tracing::debug!(%peer, %error, "could not send a datagram");
        }
    }

    async fn send(&self, outgoing: &[Outgoing]) {
        for out in outgoing {
            self.metrics.notifications.inc(match out.kind {
                Kind::NonConfirmable => "non",
                Kind::Confirmable => "con",
                Kind::Retransmission => "retransmission",
                Kind::Gone => "gone",
            });
            self.send_to(&out.bytes, out.peer).await;
        }
        if outgoing.iter().any(|o| o.kind == Kind::Confirmable) {
            self.in_flight.notify_one();
        }
    }
}

/// Serves CoAP on `socket` until the process ends.
pub async fn serve_with(
    socket: UdpSocket,
    store: Store,
    metrics: Arc<CoapMetrics>,
    settings: CoapSettings,
) -> std::io::Result<()> {
    // Subscribed before the first request, so no change after a
    // registration can be missed.
    let changes = store.watch_desired();
    let seed = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map(|d| d.subsec_nanos() ^ d.as_secs() as u32)
        .unwrap_or_default();
    let sessions = match settings.security {
        Security::Dtls(dtls) => Some(Mutex::new(Sessions::new(
            store.clone(),
            dtls,
            Arc::clone(&metrics.dtls),
        ))),
        Security::InsecurePlain => None,
    };
    let shared = Arc::new(Shared {
        socket,
        sessions,
        store,
        metrics,
        exchanges: Mutex::new(RecentExchanges::default()),
        observers: Mutex::new(Observers::new(settings.observe, seed)),
        in_flight: Notify::new(),
        requests: Arc::new(tokio::sync::Semaphore::new(settings.max_requests_in_flight)),
    });
    tokio::select! {
        served = receive(Arc::clone(&shared)) => served,
        () = notify_changes(Arc::clone(&shared), changes) => Ok(()),
        () = retransmit(Arc::clone(&shared)) => Ok(()),
        () = dtls_timers(Arc::clone(&shared)) => Ok(()),
    }
}

/// Runs the DTLS engines' timers and revocations (nothing for plain CoAP).
async fn dtls_timers(shared: Arc<Shared>) {
    let Some(sessions) = &shared.sessions else {
        return std::future::pending().await;
    };
    let mut tick = tokio::time::interval(Duration::from_millis(100));
    tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
    loop {
        tick.tick().await;
        let send = sessions.lock().expect("sessions").tick(Instant::now());
        for (peer, record) in send {
            shared.send_datagram(&record, peer).await;
        }
    }
}

/// Receives datagrams: requests, and acknowledgements and resets of
/// notifications.
async fn receive(shared: Arc<Shared>) -> std::io::Result<()> {
    // Big enough for any UDP datagram, so an oversized payload is measured
    // (and refused) rather than silently cut.
    let mut buf = vec![0u8; 65_536];
    loop {
        let (len, peer) = shared.socket.recv_from(&mut buf).await?;
        let Some(sessions) = &shared.sessions else {
            on_message(&shared, &buf[..len], peer, None).await;
            continue;
        };
        let received =
            sessions
                .lock()
                .expect("sessions")
                .receive(peer, &buf[..len], Instant::now());
        for record in &received.send {
            shared.send_datagram(record, peer).await;
        }
        for message in &received.messages {
            on_message(&shared, message, peer, received.device.as_ref()).await;
        }
    }
}

/// Takes one CoAP message from `peer`; `device` is the device of its DTLS
/// session (`None` for plain CoAP, where nobody is authenticated).
async fn on_message(
    shared: &Arc<Shared>,
    message: &[u8],
    peer: SocketAddr,
    device: Option<&ResourceKey>,
) {
    let Ok(packet) = Packet::from_bytes(message) else {
        shared.metrics.requests.inc("not_coap");
        return;
    };
    let message_id = packet.header.message_id;
    match packet.header.get_type() {
        MessageType::Reset => {
            let mut observers = shared.observers();
            if let Some(device) = observers.reset(peer, message_id) {
                tracing::debug!(%device, %peer, "observer reset a notification");
                shared.metrics.observe.inc("reset");
                shared.count_observers(&observers);
            }
            return;
        }
        MessageType::Acknowledgement => {
            // Acknowledges a confirmable notification, or nothing of ours.
            shared
                .observers()
                .acknowledged(peer, message_id, Instant::now());
            return;
        }
        MessageType::Confirmable if !matches!(packet.header.code, MessageClass::Request(_)) => {
            // A ping (empty), or a message this server cannot process:
            // rejected with a Reset (RFC 7252 §4.2, §4.3).
            let ping = packet.header.code == MessageClass::Empty;
            shared
                .metrics
                .requests
                .inc(if ping { "ping" } else { "rejected" });
            shared.send_to(&reset(message_id), peer).await;
            return;
        }
        _ if !matches!(packet.header.code, MessageClass::Request(_)) => return,
        _ => {}
    }
    let confirmable = packet.header.get_type() == MessageType::Confirmable;
    if confirmable {
        let seen =
            shared
                .exchanges
                .lock()
                .expect("exchanges")
                .begin(peer, message_id, Instant::now());
        match seen {
            Exchange::New => {}
            Exchange::Answered(response) => {
                shared.metrics.requests.inc("duplicate");
                shared.send_to(&response, peer).await;
                return;
            }
            Exchange::InProgress => {
                shared.metrics.requests.inc("duplicate");
                return;
            }
        }
    }
    // Each request in its own task, so one device's durable write does
    // not hold up the next datagram and flushes can batch; as many at
    // once as there are permits.
    let Ok(permit) = Arc::clone(&shared.requests).try_acquire_owned() else {
        shared.metrics.requests.inc("overloaded");
        let mut response = reply(&packet, ResponseType::ServiceUnavailable);
        response.add_option(CoapOption::MaxAge, vec![1]);
        shared
            .answer(&response, peer, message_id, confirmable)
            .await;
        return;
    };
    let shared = Arc::clone(shared);
    let device = device.cloned();
    tokio::spawn(async move {
        let (outcome, response) = handle(&packet, peer, device.as_ref(), &shared).await;
        // Handled: the place is free before the answer leaves, so a
        // device that sends its next request on the answer finds it.
        drop(permit);
        shared.metrics.requests.inc(outcome);
        shared
            .answer(&response, peer, message_id, confirmable)
            .await;
    });
}

/// Tells observers about every durable change of desired state.
async fn notify_changes(shared: Arc<Shared>, mut changes: broadcast::Receiver<DesiredChange>) {
    loop {
        let devices = match changes.recv().await {
            Ok(change) => change.upserted.into_iter().chain(change.removed).collect(),
            // Missed changes: tell every observer the state as it is now.
            Err(broadcast::error::RecvError::Lagged(_)) => shared.observers().observed_devices(),
            Err(broadcast::error::RecvError::Closed) => return,
        };
        for device in devices {
            notify_device(&shared, &device).await;
        }
    }
}

/// Sends the observers of `device` its current desired state, or `4.04` if
/// it is no longer here.
async fn notify_device(shared: &Shared, device: &ResourceKey) {
    if shared.observers().observers_of(device) == 0 {
        return;
    }
    let payload = match shared.store.desired(device) {
        Ok(Some(desired)) => match codec::encode(&desired.to_wire()) {
            Ok(payload) => Some(payload),
            Err(error) => {
                tracing::error!(%device, %error, "desired state does not fit the device wire format");
                return;
            }
        },
        Ok(None) => None,
        Err(error) => {
            tracing::error!(%device, %error, "cannot read desired state to notify");
            return;
        }
    };
    let outgoing = {
        let mut observers = shared.observers();
        let outgoing = match &payload {
            Some(payload) => observers.notify(device, Content::State(payload), Instant::now()),
            None => {
                let gone = observers.notify(device, Content::Gone, Instant::now());
                for _ in &gone {
                    shared.metrics.observe.inc("device_removed");
                }
                gone
            }
        };
        shared.count_observers(&observers);
        outgoing
    };
    shared.send(&outgoing).await;
}

/// Retransmits confirmable notifications until acknowledged, and drops the
/// observers that never acknowledge.
async fn retransmit(shared: Arc<Shared>) {
    loop {
        let deadline = shared.observers().next_deadline();
        match deadline {
            Some(deadline) => tokio::select! {
                () = tokio::time::sleep_until(deadline.into()) => {}
                () = shared.in_flight.notified() => continue,
            },
            None => {
                shared.in_flight.notified().await;
                continue;
            }
        }
        let mut outgoing = Vec::new();
        {
            let mut observers = shared.observers();
            for due in observers.due(Instant::now()) {
                match due {
                    Due::Retransmit(out) => outgoing.push(out),
                    Due::TimedOut { device, peer } => {
                        tracing::debug!(%device, %peer, "observer never acknowledged; removed");
                        shared.metrics.observe.inc("timed_out");
                    }
                }
            }
            shared.count_observers(&observers);
        }
        shared.send(&outgoing).await;
    }
}

/// A request's Uri-Path segments (not UTF-8 is replaced, and then matches
/// no route).
pub fn path_of(request: &Packet) -> Vec<String> {
    request
        .get_option(CoapOption::UriPath)
        .map(|segments| {
            segments
                .iter()
                .map(|s| String::from_utf8_lossy(s).into_owned())
                .collect::<Vec<_>>()
        })
        .unwrap_or_default()
}

/// Handles one request; returns the outcome label and the response.
/// `device` is the requester's authenticated device (`None` for plain
/// CoAP): it may only act for itself.
async fn handle(
    request: &Packet,
    peer: SocketAddr,
    device: Option<&ResourceKey>,
    shared: &Shared,
) -> (&'static str, Packet) {
    let path = path_of(request);
    let route = route(&path);
    let method = match request.header.code {
        MessageClass::Request(method) => method,
        _ => RequestType::UnKnown,
    };
    let (reads_payload, answers_with_payload) = match (&route, method) {
        (Some(Route::Report(_)), RequestType::Post) => (true, false),
        (Some(Route::Events(_)), RequestType::Post) => (true, true),
        (Some(Route::Desired(_)), RequestType::Get) => (false, true),
        _ => (false, false),
    };
    if let Err(refusal) = checks::check(request, reads_payload, answers_with_payload) {
        return refuse(request, refusal.outcome, refusal.code, refusal.text);
    }
    let Some(route) = route else {
        return refuse(
            request,
            "unknown_resource",
            ResponseType::NotFound,
            "no such resource; use d/<namespace>/<name>/report, /events or /desired".into(),
        );
    };
    if let Some(device) = device
        && route.device() != device
    {
        return refuse(
            request,
            "forbidden",
            ResponseType::Forbidden,
            "a device may only use its own resources".into(),
        );
    }
    match (route, method) {
        (Route::Report(key), RequestType::Post) => report(request, &shared.store, &key).await,
        (Route::Events(key), RequestType::Post) => event(request, &shared.store, &key).await,
        (Route::Desired(key), RequestType::Get) => desired(request, peer, shared, &key),
        _ => refuse(
            request,
            "method_not_allowed",
            ResponseType::MethodNotAllowed,
            "reports and events are POSTed, desired state is read with GET".into(),
        ),
    }
}

async fn report(request: &Packet, store: &Store, key: &ResourceKey) -> (&'static str, Packet) {
    let report = match codec::decode::<DeviceReport>(&request.payload) {
        Ok(report) => report,
        Err(error) => return refuse_codec(request, error),
    };
    if let Err(refusal) = known_device(request, store, key) {
        return refusal;
    }
    match store
        .record_report(key, report, edgefleet_shared::now_unix_ms())
        .await
    {
        Ok(_) => ("stored", reply(request, ResponseType::Changed)),
        Err(error) => {
            tracing::error!(device = %key, %error, "could not store a report");
            refuse(
                request,
                "store_error",
                ResponseType::InternalServerError,
                "report not stored".into(),
            )
        }
    }
}

async fn event(request: &Packet, store: &Store, key: &ResourceKey) -> (&'static str, Packet) {
    let event = match codec::decode::<DeviceEvent>(&request.payload) {
        Ok(event) => event,
        Err(error) => return refuse_codec(request, error),
    };
    if let Err(refusal) = known_device(request, store, key) {
        return refusal;
    }
    let (id, boot) = (event.id, event.boot);
    let (outcome, highest) = match store
        .record_event(key, event, edgefleet_shared::now_unix_ms())
        .await
    {
        Ok(EventOutcome::Stored {
            dropped_oldest: false,
            ..
        }) => ("event_stored", id),
        Ok(EventOutcome::Stored { .. }) => ("event_stored_dropped_oldest", id),
        Ok(EventOutcome::Duplicate { highest }) => ("event_duplicate", highest),
        Err(error) => {
            tracing::error!(device = %key, %error, "could not store an event");
            return refuse(
                request,
                "store_error",
                ResponseType::InternalServerError,
                "event not stored".into(),
            );
        }
    };
    let mut response = reply(request, ResponseType::Changed);
    response.set_content_format(ContentFormat::ApplicationCBOR);
    response.payload =
        codec::encode(&EventAck { id: highest, boot }).expect("an ack always encodes");
    (outcome, response)
}

fn desired(
    request: &Packet,
    peer: SocketAddr,
    shared: &Shared,
    key: &ResourceKey,
) -> (&'static str, Packet) {
    let token = request.get_token();
    let register = observe_option(request) == Some(ObserveOption::Register);
    let mut device = match known_device(request, &shared.store, key) {
        Ok(device) => device,
        Err(refusal) => {
            // A response other than 2.xx ends an observation (RFC 7641 §4.1).
            deregister(shared, key, peer, token);
            return refusal;
        }
    };
    let (mut outcome, mut sequence) = ("content", None);
    if register {
        let mut observers = shared.observers();
        match observers.register(key, peer, token, Instant::now()) {
            Registration::Added { sequence: s } => {
                shared.metrics.observe.inc("registered");
                (outcome, sequence) = ("observe_registered", Some(s));
            }
            Registration::Replaced { sequence: s } => {
                shared.metrics.observe.inc("evicted");
                shared.metrics.observe.inc("registered");
                (outcome, sequence) = ("observe_registered", Some(s));
            }
            Registration::Renewed { sequence: s } => {
                shared.metrics.observe.inc("renewed");
                (outcome, sequence) = ("observe_registered", Some(s));
            }
            Registration::Refused => {
                shared.metrics.observe.inc("refused");
                outcome = "observe_refused";
            }
        }
        shared.count_observers(&observers);
    } else {
        // Observe: 1, or a plain GET with the token of an observation.
        deregister(shared, key, peer, token);
    }
    if sequence.is_some() {
        // Read again now that the observer is registered: a change applied
        // in between is either in this response or notified after it.
        device = match known_device(request, &shared.store, key) {
            Ok(device) => device,
            Err(refusal) => {
                deregister(shared, key, peer, token);
                return refusal;
            }
        };
    }
    match codec::encode(&device.to_wire()) {
        Ok(payload) => {
            let mut response = reply(request, ResponseType::Content);
            if let Some(sequence) = sequence {
                response.set_observe_value(sequence);
            }
            response.set_content_format(ContentFormat::ApplicationCBOR);
            response.payload = payload;
            (outcome, response)
        }
        Err(error) => {
            deregister(shared, key, peer, token);
            refuse(
                request,
                "desired_too_large",
                ResponseType::InternalServerError,
                error.to_string(),
            )
        }
    }
}

/// The Observe option of a request, if it holds one of the two values a
/// request may carry (RFC 7641 §2).
fn observe_option(request: &Packet) -> Option<ObserveOption> {
    let value = request.get_observe_value()?.ok()?;
    ObserveOption::try_from(usize::try_from(value).ok()?).ok()
}

fn deregister(shared: &Shared, key: &ResourceKey, peer: SocketAddr, token: &[u8]) {
    let mut observers = shared.observers();
    if observers.deregister(key, peer, token) {
        shared.metrics.observe.inc("deregistered");
        shared.count_observers(&observers);
    }
}

/// The device's desired state, or the refusal for a device this node does
/// not serve.
fn known_device(
    request: &Packet,
    store: &Store,
    key: &ResourceKey,
) -> Result<crate::store::DesiredDevice, (&'static str, Packet)> {
    match store.desired(key) {
        Ok(Some(device)) => Ok(device),
        Ok(None) => Err(refuse(
            request,
            "unknown_device",
            ResponseType::NotFound,
            format!("{key} is not a device of this node"),
        )),
        Err(error) => Err(refuse(
            request,
            "store_error",
            ResponseType::InternalServerError,
            error.to_string(),
        )),
    }
}

fn refuse_codec(request: &Packet, error: CodecError) -> (&'static str, Packet) {
    let (code, outcome) = match &error {
        CodecError::TooLarge { .. } => (ResponseType::RequestEntityTooLarge, "too_large"),
        CodecError::Truncated { .. } => (ResponseType::BadRequest, "truncated"),
        CodecError::Malformed(_) => (ResponseType::BadRequest, "malformed"),
        CodecError::Invalid(_) => (ResponseType::BadRequest, "invalid"),
    };
    let (outcome, mut response) = refuse(request, outcome, code, error.to_string());
    if let CodecError::TooLarge { limit, .. } = error {
        response.add_option(CoapOption::Size1, (limit as u32).to_be_bytes().to_vec());
    }
    (outcome, response)
}

fn refuse(
    request: &Packet,
    outcome: &'static str,
    code: ResponseType,
    text: String,
) -> (&'static str, Packet) {
    let mut response = reply(request, code);
    response.set_content_format(ContentFormat::TextPlain);
    let budget = request.to_bytes().map_or(0, |b| b.len());
    response.payload = checks::short(text, budget).into_bytes();
    (outcome, response)
}

/// A Reset of message `message_id`: an empty message, no token.
fn reset(message_id: u16) -> Vec<u8> {
    let mut packet = Packet::new();
    packet.header.set_version(1);
    packet.header.set_type(MessageType::Reset);
    packet.header.code = MessageClass::Empty;
    packet.header.message_id = message_id;
    packet.to_bytes().expect("an empty message encodes")
}

/// A response to `request`: piggybacked on the Ack for a confirmable one.
fn reply(request: &Packet, code: ResponseType) -> Packet {
    let mut response = Packet::new();
    response.header.set_version(1);
    response.header.set_type(match request.header.get_type() {
        MessageType::Confirmable => MessageType::Acknowledgement,
        _ => MessageType::NonConfirmable,
    });
    response.header.message_id = request.header.message_id;
    response.header.code = MessageClass::Response(code);
    response.set_token(request.get_token().to_vec());
    response
}

#[cfg(test)]
mod tests {
    use super::*;

    fn path(p: &str) -> Vec<String> {
        p.split('/').map(str::to_owned).collect()
    }

    #[test]
    fn routes_name_the_device_and_the_resource() {
        assert_eq!(
            route(&path("d/plant/t1/report")),
            Some(Route::Report(ResourceKey::device("plant", "t1")))
        );
        assert_eq!(
            route(&path("d/plant/t1/desired")),
            Some(Route::Desired(ResourceKey::device("plant", "t1")))
        );
        for bad in [
            "d/plant/t1",
            "d/plant/t1/firmware",
            "x/plant/t1/report",
            "d//t1/report",
            "d/plant/t1/report/x",
        ] {
            assert_eq!(route(&path(bad)), None, "{bad}");
        }
    }

    #[test]
    fn a_retransmission_is_answered_from_the_cache() {
        let peer: SocketAddr = "127.0.0.1:5683".parse().unwrap();
        let other: SocketAddr = "127.0.0.1:5684".parse().unwrap();
        let now = Instant::now();
        let mut recent = RecentExchanges::default();
        assert_eq!(recent.begin(peer, 7, now), Exchange::New);
        assert_eq!(recent.begin(peer, 7, now), Exchange::InProgress);
        recent.answer(peer, 7, vec![1, 2, 3]);
        assert_eq!(
            recent.begin(peer, 7, now),
            Exchange::Answered(vec![1, 2, 3])
        );
        // The same id from another peer is another exchange.
        assert_eq!(recent.begin(other, 7, now), Exchange::New);
        // After the exchange lifetime the id may be reused.
        assert_eq!(
            recent.begin(peer, 7, now + EXCHANGE_LIFETIME),
            Exchange::New
        );
    }

    #[test]
    fn the_cache_is_bounded() {
        let peer: SocketAddr = "127.0.0.1:5683".parse().unwrap();
        let now = Instant::now();
        let mut recent = RecentExchanges::default();
        for id in 0..(RECENT_EXCHANGES + 100) {
            recent.begin(peer, id as u16, now);
        }
        assert!(recent.len() <= RECENT_EXCHANGES, "{}", recent.len());
    }
}
