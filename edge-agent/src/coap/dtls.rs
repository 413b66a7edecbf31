//! CoAP over DTLS 1.2 with pre-shared keys (RFC 7252 §9.1.3.1), the
//! agent's side: one UDP socket, a DTLS session per device endpoint.
//!
//! The PSK identity is the device's login name `<name>@<namespace>` (as on
//! MQTT) and its key is the device's key from the store, delivered by the
//! cloud over the sync link. Only `TLS_PSK_WITH_AES_128_CCM_8` is offered.
//! A session's identity is its device: [`Sessions::device_of`] gives it to
//! the CoAP handler, which refuses a request for any other device.
//!
//! [`Sessions`] drives the sans-IO DTLS engine ([`dimpl`]); it holds no
//! socket. Every call returns the datagrams to send, so the server sends
//! them after releasing its lock.
//!
//! Bounds, each counted in `edgefleet_agent_coap_dtls_total{outcome}`:
//! - a ClientHello is first answered with a cookie (HelloVerifyRequest,
//!   RFC 6347 §4.2.1), and the handshake counts against `max_handshakes`
//!   only once the peer returns it, which proves it receives at the
//!   address it sends from. Handshakes waiting for their cookie are few
//!   and short-lived: at most 4 × `max_handshakes` (a new one beyond
//!   pushes out the oldest: `hello_evicted`), each for 2 s
//!   (`hello_expired`). So ClientHellos from forged addresses cannot hold
//!   the handshake slots devices need;
//! - at most `max_handshakes` handshakes past the cookie at once (one
//!   beyond is dropped before its ServerHello: `refused_busy`; the device
//!   tries again), each given `handshake_timeout`;
//! - at most `max_sessions` sessions; a new one beyond evicts the least
//!   recently heard (`evicted`);
//! - a device whose key changes or goes loses its sessions at the next
//!   [`Sessions::tick`] (`revoked`): the device must handshake again, with
//!   the key it has now;
//! - a protected record from an endpoint without a session (the agent
//!   restarted and forgot it) is answered with an unprotected alert
//!   ([`FORGOTTEN_SESSION_ALERT`]), which devices may take as a hint to
//!   handshake again (`no_session`);
//! - a ClientHello from an endpoint that has a session starts a second
//!   handshake beside it (a device rebooted on the same port); the old
//!   session is replaced only when the new handshake completes
//!   (`replaced`), so a forged ClientHello cannot end a session.
//!   Records that fail to decrypt are dropped by the engine without ending
//!   the session (RFC 6347 §4.1.2.7).

use std::collections::HashMap;
use std::net::SocketAddr;
use std::panic::AssertUnwindSafe;
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use dimpl::crypto::Dtls12CipherSuite;
use dimpl::{Config, Dtls, Output, PskResolver};
use edgefleet_shared::ResourceKey;
use edgefleet_shared::credential::{self, Psk};
use edgefleet_shared::dtls::FORGOTTEN_SESSION_ALERT;
use edgefleet_shared::telemetry::Outcomes;
use prometheus_client::metrics::gauge::Gauge;
use prometheus_client::registry::Registry;
use tokio::sync::watch;

use crate::store::Store;

/// The IANA port for CoAP over DTLS (RFC 7252 §12.7).
pub const COAPS_PORT: u16 = 5684;

/// The DTLS bounds.
#[derive(Clone, Debug)]
pub struct DtlsSettings {
    /// Sessions held at once.
    pub max_sessions: usize,
    /// Handshakes in progress at once.
    pub max_handshakes: usize,
    /// How long a handshake may take.
    pub handshake_timeout: Duration,
    /// The largest datagram sent (records are fragmented to fit).
    pub mtu: usize,
}

impl Default for DtlsSettings {
    fn default() -> Self {
        DtlsSettings {
            max_sessions: 10_000,
            max_handshakes: 256,
            handshake_timeout: Duration::from_secs(10),
            mtu: 1_152,
        }
    }
}

/// Handshakes waiting for their cookie, per handshake allowed past it
/// (`max_handshakes`), before the oldest waiting one goes.
const HELLOS_PER_HANDSHAKE: usize = 4;

/// How long a handshake may wait for its cookie: a device on the site
/// returns it within a round trip.
const HELLO_LIFETIME: Duration = Duration::from_secs(2);

/// The DTLS counters.
#[derive(Debug, Default)]
pub struct DtlsMetrics {
    /// Session events: `established`, `handshake_failed`,
    /// `handshake_restarted` (the device began a new one), `refused_busy`
    /// (a handshake past its cookie beyond `max_handshakes`),
    /// `hello_evicted` and `hello_expired` (a handshake that did not return
    /// its cookie: pushed out by newer ones, or not back within 2 s),
    /// `evicted`, `revoked`, `replaced`, `closed` (by the device), `failed`
    /// (a fatal error on an established session), `not_dtls` (a datagram
    /// that is no DTLS record), `no_session` (a datagram that is not a
    /// ClientHello from an endpoint without a session).
    pub events: Outcomes,
    /// Sessions established now.
    pub sessions: Gauge,
}

impl DtlsMetrics {
    /// Registers the counters in `registry`.
    pub fn register(&self, registry: &mut Registry) {
        self.events
            .register(registry, "coap_dtls", "CoAP DTLS session events");
        registry.register(
            "coap_dtls_sessions",
            "CoAP DTLS sessions established now",
            self.sessions.clone(),
        );
    }
}

/// Looks a device's key up by its PSK identity, and remembers which device
/// it gave a key for: that is the session's device once the handshake
/// proves the peer holds the key. One serves every session (building a
/// `dimpl::Config` self-tests the crypto provider, milliseconds of
/// elliptic-curve work): sessions are driven one at a time, so a lookup
/// belongs to the engine call that made it ([`KeyLookup::during`]).
struct KeyLookup {
    store: AssertUnwindSafe<Store>,
    given: Mutex<Option<(ResourceKey, Psk)>>,
}

impl KeyLookup {
    /// Runs `call` on `session`'s engine; a key looked up during it is the
    /// session's.
    fn during<R>(&self, session: &mut Session, call: impl FnOnce(&mut Dtls) -> R) -> R {
        self.given.lock().expect("key lookup").take();
        let result = call(&mut session.dtls);
        if let Some(given) = self.given.lock().expect("key lookup").take() {
            session.looked_up = Some(given);
        }
        result
    }
}

impl PskResolver for KeyLookup {
    fn resolve(&self, identity: &[u8]) -> Option<Vec<u8>> {
        let device = credential::device_of_login(std::str::from_utf8(identity).ok()?)?;
        let psk = self.store.credential(&device).ok().flatten()?;
        let bytes = psk.as_bytes().to_vec();
        *self.given.lock().expect("key lookup") = Some((device, psk));
        Some(bytes)
    }
}

/// One DTLS session (or handshake) with an endpoint.
struct Session {
    dtls: Dtls,
    /// The random of the ClientHello that began it: the second
    /// ClientHello (with the cookie) repeats it; a new handshake does not.
    random: [u8; 32],
    /// When its first ClientHello came.
    begun: Instant,
    /// Whether the peer returned the cookie (the engine answered with a
    /// ServerHello): it receives at the address it sends from. Until then
    /// the session costs little and counts against no handshake bound.
    cookie_returned: bool,
    /// The device and key the handshake looked up, until it completes.
    looked_up: Option<(ResourceKey, Psk)>,
    /// Set when the handshake completed: the device, its key then, and a
    /// watch on that key.
    device: Option<(ResourceKey, Psk, watch::Receiver<()>)>,
    next_timeout: Option<Instant>,
    last_heard: Instant,
}

/// What the engine produced for one session.
#[derive(Default)]
struct Drained {
    packets: Vec<Vec<u8>>,
    data: Vec<Vec<u8>>,
    connected: bool,
    closed: bool,
}

impl Session {
    fn new(config: Arc<Config>, random: [u8; 32], now: Instant) -> Session {
        Session {
            dtls: Dtls::new_12_psk(config, now),
            random,
            begun: now,
            cookie_returned: false,
            looked_up: None,
            device: None,
            next_timeout: None,
            last_heard: now,
        }
    }

    /// Drains the engine's output until it names its next timer.
    fn drain(&mut self, buf: &mut Vec<u8>) -> Drained {
        let mut out = Drained::default();
        loop {
            match self.dtls.poll_output(buf) {
                Output::Packet(p) => out.packets.push(p.to_vec()),
                Output::BufferTooSmall { needed } => buf.resize(needed, 0),
                Output::Timeout(at) => {
                    self.next_timeout = Some(at);
                    return out;
                }
                Output::Connected => out.connected = true,
                Output::ApplicationData(data) => out.data.push(data.to_vec()),
                Output::CloseNotify => out.closed = true,
                _ => {}
            }
        }
    }
}

/// Both slots of an endpoint: its session, and a handshake that will
/// replace it.
#[derive(Default)]
struct Endpoint {
    current: Option<Session>,
    pending: Option<Session>,
}

/// What one datagram came to.
#[derive(Debug, Default)]
pub struct Received {
    /// Records to send back to the endpoint.
    pub send: Vec<Vec<u8>>,
    /// CoAP messages the endpoint's device sent.
    pub messages: Vec<Vec<u8>>,
    /// The device of the endpoint's session, if it has one.
    pub device: Option<ResourceKey>,
}

/// Every DTLS session of the server.
pub struct Sessions {
    store: Store,
    settings: DtlsSettings,
    config: Arc<Config>,
    lookup: Arc<KeyLookup>,
    metrics: Arc<DtlsMetrics>,
    endpoints: HashMap<SocketAddr, Endpoint>,
    buf: Vec<u8>,
}

impl std::fmt::Debug for Sessions {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Sessions")
            .field("endpoints", &self.endpoints.len())
            .finish_non_exhaustive()
    }
}

/// The record's content type and epoch, if `datagram` starts with a DTLS
/// 1.x record header.
fn record_header(datagram: &[u8]) -> Option<(u8, u16)> {
    if datagram.len() < 13 || datagram[1] != 0xfe {
        return None;
    }
    Some((datagram[0], u16::from_be_bytes([datagram[3], datagram[4]])))
}

const HANDSHAKE: u8 = 22;

/// The random of the ClientHello `datagram` starts with (a handshake
/// record of epoch 0 whose message type is 1, unfragmented or its first
/// fragment).
fn client_hello_random(datagram: &[u8]) -> Option<[u8; 32]> {
    if record_header(datagram) != Some((HANDSHAKE, 0)) || datagram.get(13) != Some(&1) {
        return None;
    }
    // Record header 13, handshake header 12, client_version 2.
    datagram.get(27..59)?.try_into().ok()
}

impl Sessions {
    /// No sessions yet.
    pub fn new(store: Store, settings: DtlsSettings, metrics: Arc<DtlsMetrics>) -> Sessions {
        let lookup = Arc::new(KeyLookup {
            store: AssertUnwindSafe(store.clone()),
            given: Mutex::new(None),
        });
        Sessions {
            store,
            config: Self::config(&settings, Arc::clone(&lookup)),
            lookup,
            settings,
            metrics,
            endpoints: HashMap::new(),
            buf: vec![0; 2_048],
        }
    }

    fn config(settings: &DtlsSettings, lookup: Arc<KeyLookup>) -> Arc<Config> {
        let config = Config::builder()
            .mtu(settings.mtu)
            .handshake_timeout(settings.handshake_timeout)
            .dtls12_cipher_suites(&[Dtls12CipherSuite::PSK_AES128_CCM_8])
            .dtls13_cipher_suites(&[])
            .with_psk_server(None, lookup)
            .build()
            .expect("a PSK-only DTLS 1.2 configuration is valid");
        Arc::new(config)
    }

    /// Handshakes under way past the cookie exchange.
    fn handshakes(&self) -> usize {
        let counts = |s: &Session| s.device.is_none() && s.cookie_returned;
        self.endpoints
            .values()
            .map(|e| {
                usize::from(e.pending.as_ref().is_some_and(counts))
                    + usize::from(e.current.as_ref().is_some_and(counts))
            })
            .sum()
    }

    /// Handshakes waiting for their cookie, as (endpoint, whether it is the
    /// pending slot, when it began).
    fn hellos(&self) -> Vec<(SocketAddr, bool, Instant)> {
        let mut hellos = Vec::new();
        for (peer, e) in &self.endpoints {
            for (pending, slot) in [(true, &e.pending), (false, &e.current)] {
                if let Some(s) = slot.as_ref().filter(|s| !s.cookie_returned) {
                    hellos.push((*peer, pending, s.begun));
                }
            }
        }
        hellos
    }

    /// Makes room for one more handshake waiting for its cookie: beyond
    /// [`HELLOS_PER_HANDSHAKE`] × `max_handshakes` of them, the oldest goes
    /// (a flood of ClientHellos from forged addresses pushes out its own,
    /// while a device's returns its cookie within a round trip).
    fn make_room_for_a_hello(&mut self) {
        let hellos = self.hellos();
        let bound = self
            .settings
            .max_handshakes
            .saturating_mul(HELLOS_PER_HANDSHAKE);
        if hellos.len() < bound {
            return;
        }
        if let Some((peer, pending, _)) = hellos.into_iter().min_by_key(|(_, _, begun)| *begun) {
            self.drop_slot(peer, pending);
            self.metrics.events.inc("hello_evicted");
        }
    }

    /// Drops the pending or current session of `peer`.
    fn drop_slot(&mut self, peer: SocketAddr, pending: bool) {
        if let Some(endpoint) = self.endpoints.get_mut(&peer) {
            match pending {
                true => endpoint.pending = None,
                false => endpoint.current = endpoint.pending.take(),
            }
            if endpoint.current.is_none() {
                self.endpoints.remove(&peer);
            }
        }
    }

    fn established(&self) -> usize {
        self.endpoints
            .values()
            .filter(|e| e.current.as_ref().is_some_and(|s| s.device.is_some()))
            .count()
    }

    /// The device of `peer`'s session, once its handshake completed.
    pub fn device_of(&self, peer: SocketAddr) -> Option<&ResourceKey> {
        self.endpoints
            .get(&peer)?
            .current
            .as_ref()?
            .device
            .as_ref()
            .map(|(device, _, _)| device)
    }

    /// Sessions established now.
    pub fn len(&self) -> usize {
        self.established()
    }

    /// Whether none is established.
    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }

    /// Takes one datagram from `peer`.
    pub fn receive(&mut self, peer: SocketAddr, datagram: &[u8], now: Instant) -> Received {
        let mut received = Received::default();
        if record_header(datagram).is_none() {
            self.metrics.events.inc("not_dtls");
            return received;
        }
        let endpoints_before = self.endpoints.len();
        let device_before = self.device_of(peer).cloned();
        let hello = client_hello_random(datagram);
        if let (Some(random), Some(endpoint)) = (hello, self.endpoints.get_mut(&peer)) {
            // A handshake the device gave up on (it began again, with a new
            // random) is dropped; its second ClientHello, with the cookie,
            // repeats the random and goes on with it.
            let restarted = |s: &Session| s.device.is_none() && s.random != random;
            if endpoint.pending.as_ref().is_some_and(restarted) {
                endpoint.pending = None;
                self.metrics.events.inc("handshake_restarted");
            }
            if endpoint.current.as_ref().is_some_and(restarted) {
                endpoint.current = endpoint.pending.take();
                self.metrics.events.inc("handshake_restarted");
            }
            if endpoint.current.is_none() {
                self.endpoints.remove(&peer);
            }
        }
        let known = self.endpoints.contains_key(&peer);
        // A ClientHello starts a handshake unless one is under way: beside
        // the endpoint's session, if it has one.
        let under_way = self.endpoints.get(&peer).is_some_and(|e| {
            e.pending.is_some() || e.current.as_ref().is_some_and(|s| s.device.is_none())
        });
        if let Some(random) = hello.filter(|_| !under_way) {
            self.make_room_for_a_hello();
            let session = Session::new(Arc::clone(&self.config), random, now);
            let endpoint = self.endpoints.entry(peer).or_default();
            match endpoint.current {
                Some(_) => endpoint.pending = Some(session),
                None => endpoint.current = Some(session),
            }
        } else if !known {
            self.metrics.events.inc("no_session");
            // A protected record from an endpoint without a session: most
            // likely a device whose session this agent forgot (it
            // restarted). An unprotected alert tells it to handshake again
            // at once instead of after its next request times out. It is 15
            // bytes and answers only records at least as long, so it
            // reflects nothing larger than what came; and it cannot end a
            // session: a device takes it only as a hint to begin a new one.
            if datagram.len() >= FORGOTTEN_SESSION_ALERT.len()
                && record_header(datagram).is_some_and(|(_, epoch)| epoch > 0)
            {
                received.send.push(FORGOTTEN_SESSION_ALERT.to_vec());
            }
            return received;
        }
        let epoch0 = record_header(datagram).is_some_and(|(_, epoch)| epoch == 0);
        // Only a ClientHello can bring a handshake past its cookie.
        let busy = hello.is_some() && self.handshakes() >= self.settings.max_handshakes;
        let endpoint = self.endpoints.get_mut(&peer).expect("an endpoint");
        // Epoch-0 records belong to the replacing handshake, if there is
        // one; protected records may belong to either (the replacing
        // handshake's Finished, or the session's data): each engine drops
        // what it cannot decrypt.
        let to_pending = endpoint.pending.is_some();
        let to_current = !(to_pending && epoch0);
        let mut replace = false;
        if to_pending {
            let pending = endpoint.pending.as_mut().expect("pending");
            match self::feed(pending, &self.lookup, datagram, now, &mut self.buf, busy) {
                Ok(drained) => {
                    received.send.extend(drained.packets);
                    if drained.connected {
                        replace = true;
                    }
                }
                Err(fed) => {
                    endpoint.pending = None;
                    self.metrics.events.inc(fed.label("handshake_failed"));
                }
            }
        }
        if replace {
            let mut pending = endpoint.pending.take().expect("pending");
            if !self::establish(&mut pending, &self.store) {
                self.metrics.events.inc("handshake_failed");
            } else {
                endpoint.current = Some(pending);
                self.metrics.events.inc("replaced");
            }
        } else if to_current && let Some(current) = endpoint.current.as_mut() {
            let was_established = current.device.is_some();
            match self::feed(current, &self.lookup, datagram, now, &mut self.buf, busy) {
                Ok(drained) => {
                    received.send.extend(drained.packets);
                    if drained.connected && !self::establish(current, &self.store) {
                        endpoint.current = None;
                        self.metrics.events.inc("handshake_failed");
                    } else if drained.connected {
                        self.metrics.events.inc("established");
                    }
                    if drained.closed {
                        endpoint.current = None;
                        self.metrics.events.inc("closed");
                    }
                    received.messages = drained.data;
                }
                Err(fed) => {
                    endpoint.current = None;
                    self.metrics.events.inc(fed.label(if was_established {
                        "failed"
                    } else {
                        "handshake_failed"
                    }));
                }
            }
        }
        if endpoint.current.is_none() {
            endpoint.current = endpoint.pending.take();
        }
        if endpoint.current.is_none() {
            self.endpoints.remove(&peer);
        }
        received.device = self.device_of(peer).cloned();
        if received.device.is_none() {
            // Nothing is handled before the handshake completes.
            received.messages.clear();
        }
        if self.endpoints.len() != endpoints_before || received.device != device_before {
            // A session began, ended or changed hands: only then count
            // (counting walks every endpoint).
            self.evict_over_cap(peer);
            self.metrics.sessions.set(self.established() as i64);
        }
        received
    }

    /// Beyond `max_sessions`: ends the least recently heard session other
    /// than `keep`'s.
    fn evict_over_cap(&mut self, keep: SocketAddr) {
        if self.established() <= self.settings.max_sessions {
            return;
        }
        let oldest = self
            .endpoints
            .iter()
            .filter(|(peer, e)| {
                **peer != keep && e.current.as_ref().is_some_and(|s| s.device.is_some())
            })
            .min_by_key(|(_, e)| e.current.as_ref().map(|s| s.last_heard))
            .map(|(peer, _)| *peer);
        if let Some(peer) = oldest {
            self.endpoints.remove(&peer);
            self.metrics.events.inc("evicted");
        }
    }

    /// Protects `message` for `peer`'s session: the records to send, or
    /// `None` when the endpoint has no session (it went).
    pub fn send(&mut self, peer: SocketAddr, message: &[u8]) -> Option<Vec<Vec<u8>>> {
        let endpoint = self.endpoints.get_mut(&peer)?;
        let session = endpoint.current.as_mut().filter(|s| s.device.is_some())?;
        if session.dtls.send_application_data(message).is_err() {
            endpoint.current = endpoint.pending.take();
            self.metrics.events.inc("failed");
            return None;
        }
        Some(session.drain(&mut self.buf).packets)
    }

    /// Runs the engines' timers (retransmitted flights, handshake
    /// deadlines) and ends the sessions whose device's key changed or went.
    /// Returns the records to send.
    pub fn tick(&mut self, now: Instant) -> Vec<(SocketAddr, Vec<u8>)> {
        let mut send = Vec::new();
        let mut gone = Vec::new();
        for (peer, endpoint) in &mut self.endpoints {
            for slot in [&mut endpoint.pending, &mut endpoint.current] {
                let Some(session) = slot.as_mut() else {
                    continue;
                };
                if let Some((device, psk, watch)) = session.device.as_mut()
                    && watch.has_changed().unwrap_or(true)
                {
                    watch.mark_unchanged();
                    let now_key = self.store.credential(device).ok().flatten();
                    if !now_key.is_some_and(|k| k.matches(psk.as_bytes())) {
                        tracing::info!(%device, %peer, "device key changed or revoked; DTLS session ended");
                        let _ = session.dtls.close();
                        send.extend(
                            session
                                .drain(&mut self.buf)
                                .packets
                                .into_iter()
                                .map(|p| (*peer, p)),
                        );
                        *slot = None;
                        self.metrics.events.inc("revoked");
                        continue;
                    }
                }
                if !session.cookie_returned && now.duration_since(session.begun) > HELLO_LIFETIME {
                    *slot = None;
                    self.metrics.events.inc("hello_expired");
                    continue;
                }
                if session.next_timeout.is_none_or(|at| at > now) {
                    continue;
                }
                let handshaking = session.device.is_none();
                if self
                    .lookup
                    .during(session, |d| d.handle_timeout(now))
                    .is_err()
                {
                    *slot = None;
                    self.metrics.events.inc(if handshaking {
                        "handshake_failed"
                    } else {
                        "failed"
                    });
                    continue;
                }
                let drained = session.drain(&mut self.buf);
                send.extend(drained.packets.into_iter().map(|p| (*peer, p)));
            }
            if endpoint.current.is_none() {
                endpoint.current = endpoint.pending.take();
            }
            if endpoint.current.is_none() {
                gone.push(*peer);
            }
        }
        for peer in gone {
            self.endpoints.remove(&peer);
        }
        self.metrics.sessions.set(self.established() as i64);
        send
    }
}

/// Feeds one datagram to a session's engine.
/// Why a session's engine is dropped after a datagram.
enum Unfed {
    /// The engine failed.
    Failed,
    /// The handshake came past its cookie while `max_handshakes` are under
    /// way: it goes, and its ServerHello is not sent.
    Busy,
}

impl Unfed {
    fn label(&self, failed: &'static str) -> &'static str {
        match self {
            Unfed::Failed => failed,
            Unfed::Busy => "refused_busy",
        }
    }
}

/// Whether `packet` begins with a ServerHello: the engine's answer to a
/// ClientHello that returned its cookie.
fn is_server_hello(packet: &[u8]) -> bool {
    record_header(packet) == Some((HANDSHAKE, 0)) && packet.get(13) == Some(&2)
}

/// Feeds one datagram to a session's engine; `busy` when no further
/// handshake may come past its cookie.
fn feed(
    session: &mut Session,
    lookup: &KeyLookup,
    datagram: &[u8],
    now: Instant,
    buf: &mut Vec<u8>,
    busy: bool,
) -> Result<Drained, Unfed> {
    lookup
        .during(session, |d| d.handle_timeout(now))
        .map_err(|_| Unfed::Failed)?;
    lookup
        .during(session, |d| d.handle_packet(datagram))
        .map_err(|_| Unfed::Failed)?;
    session.last_heard = now;
    let drained = session.drain(buf);
    if !session.cookie_returned && drained.packets.iter().any(|p| is_server_hello(p)) {
        if busy {
            return Err(Unfed::Busy);
        }
        session.cookie_returned = true;
    }
    Ok(drained)
}

/// Completes a session whose handshake finished: its device is the one the
/// key was looked up for (the handshake proved the peer holds that key).
fn establish(session: &mut Session, store: &Store) -> bool {
    let given = session.looked_up.take();
    match given {
        Some((device, psk)) => {
            let watch = store.credential_watch(&device);
            // The key may have changed since the handshake looked it up,
            // before the watch existed.
            let still = store.credential(&device).ok().flatten();
            if !still.is_some_and(|k| k.matches(psk.as_bytes())) {
                return false;
            }
            tracing::debug!(%device, "DTLS session established");
            session.device = Some((device, psk, watch));
            true
        }
        None => false,
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::store::{Desired, HeldCredential};

    const KEY: &[u8] = b"t1-key-0123456789abcdef";

    struct Fixed(Vec<u8>);

    impl PskResolver for Fixed {
        fn resolve(&self, _identity: &[u8]) -> Option<Vec<u8>> {
            Some(self.0.clone())
        }
    }

    /// A device's engine, driven in memory.
    fn client(identity: &str, key: &[u8]) -> Dtls {
        let config = Config::builder()
            .dtls12_cipher_suites(&[Dtls12CipherSuite::PSK_AES128_CCM_8])
            .dtls13_cipher_suites(&[])
            .with_psk_client(identity.as_bytes().to_vec(), Arc::new(Fixed(key.to_vec())))
            .build()
            .unwrap();
        let mut dtls = Dtls::new_12_psk(Arc::new(config), Instant::now());
        dtls.set_active(true);
        dtls
    }

    /// Everything `dtls` has to send, and the messages it received.
    fn output(dtls: &mut Dtls) -> (Vec<Vec<u8>>, Vec<Vec<u8>>) {
        let (mut packets, mut data) = (Vec::new(), Vec::new());
        let mut buf = vec![0; 4096];
        loop {
            match dtls.poll_output(&mut buf) {
                Output::Packet(p) => packets.push(p.to_vec()),
                Output::ApplicationData(d) => data.push(d.to_vec()),
                Output::Timeout(_) => return (packets, data),
                _ => {}
            }
        }
    }

    /// Runs the handshake of `dtls` from `peer` to its end.
    fn handshake(sessions: &mut Sessions, peer: SocketAddr, dtls: &mut Dtls) {
        dtls.handle_timeout(Instant::now()).unwrap();
        for _ in 0..10 {
            let (packets, _) = output(dtls);
            for packet in packets {
                for back in sessions.receive(peer, &packet, Instant::now()).send {
                    dtls.handle_packet(&back).unwrap();
                }
            }
        }
    }

    /// What the agent makes of `message` sent by `dtls` from `peer`.
    fn send(
        sessions: &mut Sessions,
        peer: SocketAddr,
        dtls: &mut Dtls,
        message: &[u8],
    ) -> Received {
        dtls.send_application_data(message).unwrap();
        let (packets, _) = output(dtls);
        let mut received = Received::default();
        for packet in packets {
            let r = sessions.receive(peer, &packet, Instant::now());
            received.messages.extend(r.messages);
            received.device = r.device;
        }
        received
    }

    /// Sends `dtls`'s ClientHello from `peer`, returns the cookie, and
    /// gives back what the agent answered to the ClientHello with it.
    fn past_the_cookie(sessions: &mut Sessions, peer: SocketAddr, dtls: &mut Dtls) -> Vec<Vec<u8>> {
        dtls.handle_timeout(Instant::now()).unwrap();
        let hello = output(dtls).0.remove(0);
        let verify = sessions.receive(peer, &hello, Instant::now()).send;
        assert_eq!(verify.len(), 1, "a HelloVerifyRequest");
        dtls.handle_packet(&verify[0]).unwrap();
        let hello = output(dtls).0.remove(0);
        sessions.receive(peer, &hello, Instant::now()).send
    }

    /// A ClientHello as a flood from forged addresses sends it: one
    /// device's, with a random of its own.
    fn forged_hello(template: &[u8], n: u32) -> Vec<u8> {
        let mut hello = template.to_vec();
        hello[27..31].copy_from_slice(&n.to_be_bytes());
        hello
    }

    async fn sessions(settings: DtlsSettings) -> (Sessions, Arc<DtlsMetrics>, tempfile::TempDir) {
        let dir = tempfile::tempdir().unwrap();
        let store = Store::open(&dir.path().join("store")).unwrap().store;
        let psk = Psk::new(KEY.to_vec()).unwrap();
        let held = Desired::Credential(HeldCredential {
            version: credential::version("uid", &psk),
            psk,
        });
        let device = ResourceKey::device("plant", "t1");
        store
            .apply(&[(credential::key_of(&device), held)], &[])
            .await
            .unwrap();
        let metrics = Arc::new(DtlsMetrics::default());
        (
            Sessions::new(store, settings, Arc::clone(&metrics)),
            metrics,
            dir,
        )
    }

    fn peer(port: u16) -> SocketAddr {
        SocketAddr::from(([127, 0, 0, 1], port))
    }

    #[tokio::test]
    async fn forged_records_and_hellos_from_a_devices_address_leave_its_session_working() {
        let (mut sessions, metrics, _dir) = sessions(DtlsSettings::default()).await;
        let mut device = client("t1@plant", KEY);
        handshake(&mut sessions, peer(1), &mut device);
        let t1 = ResourceKey::device("plant", "t1");
        assert_eq!(sessions.device_of(peer(1)), Some(&t1));

        // A record of epoch 1 that does not decrypt, then a ClientHello, as
        // a host that puts the device's address on its datagrams sends.
        let mut forged = vec![23, 0xfe, 0xfd, 0, 1, 0, 0, 0, 0, 0, 9, 0, 24];
        forged.extend([0x55; 24]);
        assert!(
            sessions
                .receive(peer(1), &forged, Instant::now())
                .messages
                .is_empty()
        );
        let mut impostor = client("t1@plant", b"not-the-key-0123456789");
        impostor.handle_timeout(Instant::now()).unwrap();
        for hello in output(&mut impostor).0 {
            sessions.receive(peer(1), &hello, Instant::now());
        }

        let received = send(&mut sessions, peer(1), &mut device, b"still here");
        assert_eq!(received.messages, vec![b"still here".to_vec()]);
        assert_eq!(received.device, Some(t1));
        assert_eq!(metrics.events.get("failed"), 0);
        assert_eq!(metrics.events.get("replaced"), 0);
        assert_eq!(sessions.len(), 1);
    }

    #[tokio::test]
    async fn interleaved_handshakes_each_get_the_device_whose_key_they_proved() {
        let (mut sessions, metrics, _dir) = sessions(DtlsSettings::default()).await;
        const T2_KEY: &[u8] = b"t2-key-0123456789abcdef";
        let t2 = ResourceKey::device("plant", "t2");
        let psk = Psk::new(T2_KEY.to_vec()).unwrap();
        let held = Desired::Credential(HeldCredential {
            version: credential::version("uid2", &psk),
            psk,
        });
        sessions
            .store
            .apply(&[(credential::key_of(&t2), held)], &[])
            .await
            .unwrap();
        // t1, an impostor claiming t2 with another key (its key is looked
        // up, then its Finished fails), and t2: one flight of each in turn,
        // so each lookup happens between the others'.
        let mut devices = [
            (peer(1), client("t1@plant", KEY)),
            (peer(2), client("t2@plant", b"not-t2s-key-0123456789")),
            (peer(3), client("t2@plant", T2_KEY)),
        ];
        for (_, dtls) in &mut devices {
            dtls.handle_timeout(Instant::now()).unwrap();
        }
        for _ in 0..10 {
            // Each device's datagrams of this flight, dealt out in turn.
            let flights: Vec<Vec<Vec<u8>>> = devices.iter_mut().map(|(_, d)| output(d).0).collect();
            let longest = flights.iter().map(Vec::len).max().unwrap_or(0);
            for n in 0..longest {
                for ((peer, dtls), flight) in devices.iter_mut().zip(&flights) {
                    let Some(packet) = flight.get(n) else {
                        continue;
                    };
                    for back in sessions.receive(*peer, packet, Instant::now()).send {
                        let _ = dtls.handle_packet(&back);
                    }
                }
            }
        }
        assert_eq!(
            sessions.device_of(peer(1)),
            Some(&ResourceKey::device("plant", "t1"))
        );
        assert_eq!(sessions.device_of(peer(2)), None);
        assert_eq!(sessions.device_of(peer(3)), Some(&t2));
        assert_eq!(metrics.events.get("established"), 2);
    }

    #[tokio::test]
    async fn clienthellos_from_forged_addresses_do_not_hold_the_handshake_slots() {
        let settings = DtlsSettings {
            max_handshakes: 4,
            ..DtlsSettings::default()
        };
        let (mut sessions, metrics, _dir) = sessions(settings).await;
        let mut template = client("t9@plant", KEY);
        template.handle_timeout(Instant::now()).unwrap();
        let template = output(&mut template).0.remove(0);
        // 100 ClientHellos from as many addresses that never return their
        // cookie: each is answered, and only the newest 16 (4 × 4) wait.
        let begun = Instant::now();
        for n in 0..100 {
            let port = 20_000 + u16::try_from(n).unwrap();
            let answer = sessions.receive(peer(port), &forged_hello(&template, n), begun);
            assert_eq!(answer.send.len(), 1, "a HelloVerifyRequest");
        }
        assert_eq!(sessions.hellos().len(), 16);
        assert_eq!(metrics.events.get("hello_evicted"), 84);
        assert_eq!(sessions.handshakes(), 0);
        // A device amid the flood gets its session at once.
        let mut device = client("t1@plant", KEY);
        handshake(&mut sessions, peer(1), &mut device);
        assert_eq!(
            sessions.device_of(peer(1)),
            Some(&ResourceKey::device("plant", "t1"))
        );
        // Its ClientHello pushed out one more; the rest expire.
        assert_eq!(metrics.events.get("hello_evicted"), 85);
        sessions.tick(begun + HELLO_LIFETIME + Duration::from_millis(1));
        assert_eq!(sessions.hellos().len(), 0);
        assert_eq!(metrics.events.get("hello_expired"), 15);
    }

    #[tokio::test]
    async fn a_forgotten_session_is_told_with_an_alert_no_larger_than_its_record() {
        let (mut sessions, metrics, _dir) = sessions(DtlsSettings::default()).await;
        let record = |len: usize| {
            let mut r = vec![23, 0xfe, 0xfd, 0, 1, 0, 0, 0, 0, 0, 9];
            r.extend(u16::try_from(len - 13).unwrap().to_be_bytes());
            r.resize(len, 0x55);
            r
        };
        for len in [13, 14] {
            let answer = sessions.receive(peer(7), &record(len), Instant::now());
            assert!(answer.send.is_empty(), "a {len}-byte record gets nothing");
        }
        for len in [15, 40] {
            let answer = sessions.receive(peer(7), &record(len), Instant::now());
            assert_eq!(answer.send, vec![FORGOTTEN_SESSION_ALERT.to_vec()], "{len}");
        }
        assert_eq!(metrics.events.get("no_session"), 4);
        assert_eq!(sessions.len(), 0, "and no session is made of it");
    }

    #[tokio::test]
    async fn a_device_that_begins_its_handshake_again_is_not_held_up_by_the_first() {
        let (mut sessions, metrics, _dir) = sessions(DtlsSettings::default()).await;
        // The first ClientHello reaches the agent; the device gives up on
        // it (its answer was lost) and begins again with a new engine.
        let mut given_up = client("t1@plant", KEY);
        given_up.handle_timeout(Instant::now()).unwrap();
        let hello = output(&mut given_up).0.remove(0);
        sessions.receive(peer(1), &hello, Instant::now());

        let mut again = client("t1@plant", KEY);
        handshake(&mut sessions, peer(1), &mut again);
        assert_eq!(metrics.events.get("handshake_restarted"), 1);
        assert_eq!(metrics.events.get("established"), 1);
        let received = send(&mut sessions, peer(1), &mut again, b"report");
        assert_eq!(received.messages, vec![b"report".to_vec()]);
    }

    #[tokio::test]
    async fn handshakes_beyond_the_bound_are_dropped_and_sessions_beyond_it_evict_the_oldest() {
        let settings_again = || DtlsSettings {
            max_sessions: 2,
            max_handshakes: 1,
            ..DtlsSettings::default()
        };
        let (mut sessions, metrics, _dir) = sessions(settings_again()).await;

        // One handshake past its cookie: a second one gets its cookie but
        // goes when it returns it, before any ServerHello.
        let mut first = client("t1@plant", KEY);
        assert!(
            past_the_cookie(&mut sessions, peer(1), &mut first)
                .iter()
                .any(|p| is_server_hello(p))
        );
        let mut second = client("t1@plant", KEY);
        assert!(past_the_cookie(&mut sessions, peer(2), &mut second).is_empty());
        assert_eq!(metrics.events.get("refused_busy"), 1);
        assert_eq!(sessions.handshakes(), 1);

        // Three devices one after the other: the least recently heard goes.
        let (mut sessions, metrics, _dir) = self::sessions(settings_again()).await;
        let mut devices: Vec<_> = (10..13).map(|_| client("t1@plant", KEY)).collect();
        handshake(&mut sessions, peer(10), &mut devices[0]);
        handshake(&mut sessions, peer(11), &mut devices[1]);
        send(&mut sessions, peer(10), &mut devices[0], b"heard");
        handshake(&mut sessions, peer(12), &mut devices[2]);
        assert_eq!(metrics.events.get("evicted"), 1);
        assert!(sessions.device_of(peer(11)).is_none());
        assert!(sessions.device_of(peer(10)).is_some());
        assert!(sessions.device_of(peer(12)).is_some());
    }
}
