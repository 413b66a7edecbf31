//! CoAP Observe (RFC 7641) on a device's desired state: who observes which
//! device, and what each of them must be sent. No I/O here: the server in
//! [`super`] feeds requests, acknowledgements, resets, changes and the clock
//! in, and sends the datagrams that come out.
//!
//! # Design
//!
//! - **Entries.** An observer is a client endpoint and a token on one device
//!   (RFC 7641 §4.1). A second `GET` with `Observe: 0` and the same endpoint
//!   and token renews the entry instead of adding one; a `GET` with
//!   `Observe: 1`, or without Observe, removes it.
//! - **Sequence numbers.** One 24-bit counter for the whole registry. Each
//!   event (a registration, or a change of one device's state) takes the next
//!   value, so the numbers every observation sees strictly increase, modulo
//!   2^24 (§4.4 lets clients compare them in a window of 2^23 or 128 s). One
//!   value per event, not per datagram, keeps the counter far from wrapping
//!   within 128 s.
//! - **Transmission.** Every [`ObserveSettings::confirmable_every`]-th
//!   notification to an observer is confirmable (by default every one: a
//!   desired state changes at the pace of people editing Devices, and a
//!   lost non-confirmable one would leave the device on a stale state until
//!   the next change), and so is the first one after
//!   [`ObserveSettings::confirmable_interval`] (24 h) without a sign of life
//!   from it (registration or acknowledgement): §4.5 requires a confirmable
//!   notification at least every 24 hours, so an observer that went away
//!   without a reset does not stay forever. A confirmable
//!   notification is retransmitted like any CoAP message (RFC 7252 §4.2:
//!   `ACK_TIMEOUT` times a factor in [1, 1.5), doubling, `MAX_RETRANSMIT`
//!   times); if the last one is not acknowledged either, the observer is
//!   removed (§4.5). An observer has at most one confirmable notification in
//!   flight: a newer notification replaces it, goes out confirmable too and
//!   keeps its retransmission counter and deadline (§4.5.2), so a client
//!   that is gone is still dropped on time. Only an acknowledgement of the
//!   notification in flight confirms it: one of a notification it replaced
//!   shows the client is alive, but the newer state goes on being sent. The
//!   acknowledgement itself needs no answer.
//! - **Reset.** A reset matching one of the last few notifications sent to an
//!   observer, confirmable or not, removes it (§3.6).
//! - **Removal.** When the device leaves the node, each observer gets one
//!   non-confirmable `4.04` without Observe and is removed (§3.2, §4.2). It is
//!   not retransmitted: a client that misses it learns it with its next
//!   request.
//! - **Bounds.** At most [`ObserveSettings::max_observers_per_device`]
//!   entries per device: a registration beyond it evicts the device's least
//!   recently heard observer (a device that rebooted registers from a new
//!   port; its old entry will never acknowledge again, and refusing the new
//!   one would leave the device without notifications). At most
//!   [`ObserveSettings::max_observers`] in all; beyond it a registration is
//!   [`Registration::Refused`] and the server answers the `GET` without
//!   Observe, which tells the client it is not observing (§4.1). Each entry keeps at most [`RECENT_PER_OBSERVER`] message ids.
//! - **Not durable.** Entries live in memory: after an agent restart clients
//!   register again (at the latest when the last notification's Max-Age has
//!   passed, §3.3.1).
//!
//! Not done: the rate limit of §4.5.1 (one non-confirmable notification per
//! round trip, or per 3 s without an estimate). Desired state changes at the
//! pace of people editing Devices, far below it.

use std::collections::{HashMap, VecDeque};
use std::net::SocketAddr;
use std::time::{Duration, Instant};

use coap_lite::{ContentFormat, MessageClass, MessageType, Packet, ResponseType};
use edgefleet_shared::ResourceKey;

/// Observe option values are 24 bits wide (RFC 7641 §4.4).
pub const SEQUENCE_MODULUS: u32 = 1 << 24;

/// Message ids remembered per observer, to match a late reset or
/// acknowledgement to it.
pub const RECENT_PER_OBSERVER: usize = 4;

/// Bounds and transmission parameters of the registry.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct ObserveSettings {
    /// Observers in all.
    pub max_observers: usize,
    /// Observers of one device.
    pub max_observers_per_device: usize,
    /// Every how many notifications to an observer one is confirmable.
    pub confirmable_every: u32,
    /// Longest time without a sign of life from an observer before the next
    /// notification to it is confirmable.
    pub confirmable_interval: Duration,
    /// RFC 7252's ACK_TIMEOUT: the first retransmission timeout (before the
    /// random factor).
    pub ack_timeout: Duration,
    /// RFC 7252's MAX_RETRANSMIT.
    pub max_retransmit: u32,
}

impl Default for ObserveSettings {
    fn default() -> Self {
        ObserveSettings {
            max_observers: 10_000,
            max_observers_per_device: 8,
            confirmable_every: 1,
            confirmable_interval: Duration::from_secs(24 * 60 * 60),
            ack_timeout: Duration::from_secs(2),
            max_retransmit: 4,
        }
    }
}

/// What became of a registration.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Registration {
    /// A new observer; the response carries this Observe value.
    Added {
        /// The Observe value of the response.
        sequence: u32,
    },
    /// The same endpoint and token again: the entry is kept, the response
    /// carries this Observe value.
    Renewed {
        /// The Observe value of the response.
        sequence: u32,
    },
    /// A new observer, in the place of the device's least recently heard
    /// one (the device was at its cap); the response carries this Observe
    /// value.
    Replaced {
        /// The Observe value of the response.
        sequence: u32,
    },
    /// Over a bound: the response goes without Observe.
    Refused,
}

/// What a notification says.
#[derive(Clone, Copy, Debug)]
pub enum Content<'a> {
    /// `2.05` with the device's new desired state (CBOR).
    State(&'a [u8]),
    /// `4.04`: the device is no longer served here; ends every observation.
    Gone,
}

/// How a datagram goes out, for the metrics.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Kind {
    /// A non-confirmable notification.
    NonConfirmable,
    /// A confirmable notification, sent for the first time.
    Confirmable,
    /// A confirmable notification sent again.
    Retransmission,
    /// The last notification of a removed device.
    Gone,
}

/// A datagram to send.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Outgoing {
    /// To whom.
    pub peer: SocketAddr,
    /// The encoded CoAP message.
    pub bytes: Vec<u8>,
    /// What it is.
    pub kind: Kind,
}

/// What the clock brought.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Due {
    /// Send a confirmable notification again.
    Retransmit(Outgoing),
    /// The last retransmission went unacknowledged: the observer was removed.
    TimedOut {
        /// The device it observed.
        device: ResourceKey,
        /// Its endpoint.
        peer: SocketAddr,
    },
}

type Token = Vec<u8>;

#[derive(Clone, Debug, PartialEq, Eq, Hash)]
struct ObserverId {
    peer: SocketAddr,
    token: Token,
}

#[derive(Debug)]
struct Observer {
    // Notifications sent since the last confirmable one (or the registration).
    since_confirmable: u32,
    // The last sign of life: registration, renewal or acknowledgement.
    last_heard: Instant,
    in_flight: Option<InFlight>,
    recent: VecDeque<u16>,
}

#[derive(Debug)]
struct InFlight {
    // Its message id: only an acknowledgement of this id confirms it.
    message_id: u16,
    // The encoded notification, sent again as it is.
    bytes: Vec<u8>,
    retransmissions: u32,
    timeout: Duration,
    next_at: Instant,
}

/// The observers of every device.
#[derive(Debug)]
pub struct Observers {
    settings: ObserveSettings,
    by_device: HashMap<ResourceKey, HashMap<ObserverId, Observer>>,
    // Recent notification message ids, to find the observer a reset or an
    // acknowledgement is about.
    by_message: HashMap<(SocketAddr, u16), (ResourceKey, Token)>,
    len: usize,
    sequence: u32,
    message_id: u16,
}

impl Observers {
    /// An empty registry. `seed` picks the first sequence number and message
    /// id, so a restarted agent does not repeat the last run's ids at once.
    pub fn new(settings: ObserveSettings, seed: u32) -> Self {
        Observers {
            settings,
            by_device: HashMap::new(),
            by_message: HashMap::new(),
            len: 0,
            sequence: seed % SEQUENCE_MODULUS,
            message_id: seed as u16,
        }
    }

    /// The settings in force.
    pub fn settings(&self) -> &ObserveSettings {
        &self.settings
    }

    /// Observers in all.
    pub fn len(&self) -> usize {
        self.len
    }

    /// Whether nobody observes anything.
    pub fn is_empty(&self) -> bool {
        self.len == 0
    }

    /// Observers of `device`.
    pub fn observers_of(&self, device: &ResourceKey) -> usize {
        self.by_device.get(device).map_or(0, HashMap::len)
    }

    /// Whether `peer` observes `device` with `token`.
    pub fn is_observing(&self, device: &ResourceKey, peer: SocketAddr, token: &[u8]) -> bool {
        self.by_device.get(device).is_some_and(|observers| {
            observers.contains_key(&ObserverId {
                peer,
                token: token.to_vec(),
            })
        })
    }

    /// Devices with at least one observer.
    pub fn observed_devices(&self) -> Vec<ResourceKey> {
        self.by_device.keys().cloned().collect()
    }

    /// A `GET` with `Observe: 0` from `peer` with `token` on `device`.
    pub fn register(
        &mut self,
        device: &ResourceKey,
        peer: SocketAddr,
        token: &[u8],
        now: Instant,
    ) -> Registration {
        let id = ObserverId {
            peer,
            token: token.to_vec(),
        };
        if let Some(observer) = self
            .by_device
            .get_mut(device)
            .and_then(|observers| observers.get_mut(&id))
        {
            observer.last_heard = now;
            return Registration::Renewed {
                sequence: self.next_sequence(),
            };
        }
        let mut evicted = false;
        if self.observers_of(device) >= self.settings.max_observers_per_device {
            // The device's least recently heard observer makes room: most
            // likely the same device from before a reboot (another port),
            // which will never acknowledge again.
            let stalest = self.by_device.get(device).and_then(|observers| {
                observers
                    .iter()
                    .min_by_key(|(_, o)| o.last_heard)
                    .map(|(id, _)| id.clone())
            });
            let Some(stalest) = stalest else {
                return Registration::Refused;
            };
            self.remove(device, &stalest);
            evicted = true;
        }
        if self.len >= self.settings.max_observers {
            return Registration::Refused;
        }
        self.by_device.entry(device.clone()).or_default().insert(
            id,
            Observer {
                since_confirmable: 0,
                last_heard: now,
                in_flight: None,
                recent: VecDeque::with_capacity(RECENT_PER_OBSERVER),
            },
        );
        self.len += 1;
        let sequence = self.next_sequence();
        match evicted {
            true => Registration::Replaced { sequence },
            false => Registration::Added { sequence },
        }
    }

    /// A `GET` with `Observe: 1` (or none) from `peer` with `token` on
    /// `device`, or a response to it that is not `2.xx`. Returns whether an
    /// entry was removed.
    pub fn deregister(&mut self, device: &ResourceKey, peer: SocketAddr, token: &[u8]) -> bool {
        self.remove(
            device,
            &ObserverId {
                peer,
                token: token.to_vec(),
            },
        )
        .is_some()
    }

    /// The datagrams that tell every observer of `device` about `content`.
    /// [`Content::Gone`] also removes them all.
    pub fn notify(
        &mut self,
        device: &ResourceKey,
        content: Content<'_>,
        now: Instant,
    ) -> Vec<Outgoing> {
        if self.observers_of(device) == 0 {
            return Vec::new();
        }
        match content {
            Content::State(payload) => self.notify_state(device, payload, now),
            Content::Gone => self.notify_gone(device),
        }
    }

    fn notify_state(
        &mut self,
        device: &ResourceKey,
        payload: &[u8],
        now: Instant,
    ) -> Vec<Outgoing> {
        let sequence = self.next_sequence();
        let ids: Vec<ObserverId> = self.by_device[device].keys().cloned().collect();
        let mut out = Vec::with_capacity(ids.len());
        for id in ids {
            let message_id = self.next_message_id();
            let settings = &self.settings;
            let Some(observer) = self
                .by_device
                .get_mut(device)
                .and_then(|observers| observers.get_mut(&id))
            else {
                continue;
            };
            let confirmable = observer.in_flight.is_some()
                || observer.since_confirmable + 1 >= settings.confirmable_every
                || now.saturating_duration_since(observer.last_heard)
                    >= settings.confirmable_interval;
            let Some(bytes) =
                encode_notification(&id.token, message_id, confirmable, Some(sequence), payload)
            else {
                tracing::error!(device = %device, "a notification does not encode");
                continue;
            };
            if confirmable {
                observer.since_confirmable = 0;
                observer.in_flight = Some(match observer.in_flight.take() {
                    // §4.5.2: the new notification takes over the old one's
                    // retransmission state.
                    Some(old) => InFlight {
                        message_id,
                        bytes: bytes.clone(),
                        ..old
                    },
                    None => {
                        let timeout = initial_timeout(settings.ack_timeout, message_id);
                        InFlight {
                            message_id,
                            bytes: bytes.clone(),
                            retransmissions: 0,
                            timeout,
                            next_at: now + timeout,
                        }
                    }
                });
            } else {
                observer.since_confirmable += 1;
            }
            if observer.recent.len() == RECENT_PER_OBSERVER
                && let Some(old) = observer.recent.pop_front()
                && self.by_message.get(&(id.peer, old)) == Some(&(device.clone(), id.token.clone()))
            {
                self.by_message.remove(&(id.peer, old));
            }
            observer.recent.push_back(message_id);
            self.by_message
                .insert((id.peer, message_id), (device.clone(), id.token.clone()));
            out.push(Outgoing {
                peer: id.peer,
                bytes,
                kind: if confirmable {
                    Kind::Confirmable
                } else {
                    Kind::NonConfirmable
                },
            });
        }
        out
    }

    fn notify_gone(&mut self, device: &ResourceKey) -> Vec<Outgoing> {
        let ids: Vec<ObserverId> = self.by_device[device].keys().cloned().collect();
        let mut out = Vec::with_capacity(ids.len());
        for id in ids {
            self.remove(device, &id);
            let message_id = self.next_message_id();
            if let Some(bytes) = encode_gone(&id.token, message_id, device) {
                out.push(Outgoing {
                    peer: id.peer,
                    bytes,
                    kind: Kind::Gone,
                });
            }
        }
        out
    }

    /// An acknowledgement from `peer`: if it answers a confirmable
    /// notification, the observer is alive. Returns whether it did.
    pub fn acknowledged(&mut self, peer: SocketAddr, message_id: u16, now: Instant) -> bool {
        let Some((device, token)) = self.by_message.get(&(peer, message_id)) else {
            return false;
        };
        let id = ObserverId {
            peer,
            token: token.clone(),
        };
        let Some(observer) = self
            .by_device
            .get_mut(device)
            .and_then(|observers| observers.get_mut(&id))
        else {
            return false;
        };
        observer.last_heard = now;
        // An acknowledgement of an earlier notification that was replaced in
        // flight shows the client is there, but not that it has the newer
        // state: that one goes on until its own acknowledgement.
        if observer
            .in_flight
            .as_ref()
            .is_some_and(|f| f.message_id == message_id)
        {
            observer.in_flight = None;
            return true;
        }
        false
    }

    /// A reset from `peer`: if it rejects a recent notification, the
    /// observer is removed. Returns the device it observed.
    pub fn reset(&mut self, peer: SocketAddr, message_id: u16) -> Option<ResourceKey> {
        let (device, token) = self.by_message.get(&(peer, message_id))?.clone();
        self.remove(&device, &ObserverId { peer, token })
            .map(|_| device)
    }

    /// When [`Observers::due`] next has something to do.
    pub fn next_deadline(&self) -> Option<Instant> {
        self.by_device
            .values()
            .flat_map(HashMap::values)
            .filter_map(|observer| observer.in_flight.as_ref().map(|f| f.next_at))
            .min()
    }

    /// Retransmissions that are due, and observers whose confirmable
    /// notification went unacknowledged to the end (removed here).
    pub fn due(&mut self, now: Instant) -> Vec<Due> {
        let mut out = Vec::new();
        let mut timed_out = Vec::new();
        for (device, observers) in &mut self.by_device {
            for (id, observer) in observers.iter_mut() {
                let Some(flight) = observer.in_flight.as_mut() else {
                    continue;
                };
                if flight.next_at > now {
                    continue;
                }
                if flight.retransmissions >= self.settings.max_retransmit {
                    timed_out.push((device.clone(), id.clone()));
                    continue;
                }
                flight.retransmissions += 1;
                flight.timeout *= 2;
                flight.next_at = now + flight.timeout;
                out.push(Due::Retransmit(Outgoing {
                    peer: id.peer,
                    bytes: flight.bytes.clone(),
                    kind: Kind::Retransmission,
                }));
            }
        }
        for (device, id) in timed_out {
            self.remove(&device, &id);
            out.push(Due::TimedOut {
                device,
                peer: id.peer,
            });
        }
        out
    }

    fn remove(&mut self, device: &ResourceKey, id: &ObserverId) -> Option<Observer> {
        let observers = self.by_device.get_mut(device)?;
        let observer = observers.remove(id)?;
        if observers.is_empty() {
            self.by_device.remove(device);
        }
        self.len -= 1;
        for message_id in &observer.recent {
            let key = (id.peer, *message_id);
            if self
                .by_message
                .get(&key)
                .is_some_and(|(d, t)| d == device && *t == id.token)
            {
                self.by_message.remove(&key);
            }
        }
        Some(observer)
    }

    fn next_sequence(&mut self) -> u32 {
        let sequence = self.sequence;
        self.sequence = (sequence + 1) % SEQUENCE_MODULUS;
        sequence
    }

    fn next_message_id(&mut self) -> u16 {
        let id = self.message_id;
        self.message_id = id.wrapping_add(1);
        id
    }
}

/// RFC 7252 §4.2: the first timeout is ACK_TIMEOUT times a random factor
/// in [1, ACK_RANDOM_FACTOR = 1.5). The low bits of the (sequential) message
/// id spread it well enough without a random number generator.
fn initial_timeout(ack_timeout: Duration, message_id: u16) -> Duration {
    ack_timeout + ack_timeout.mul_f64(f64::from(message_id % 256) / 512.0)
}

fn encode_notification(
    token: &[u8],
    message_id: u16,
    confirmable: bool,
    sequence: Option<u32>,
    payload: &[u8],
) -> Option<Vec<u8>> {
    let mut packet = notification(token, message_id, confirmable, ResponseType::Content);
    if let Some(sequence) = sequence {
        packet.set_observe_value(sequence);
    }
    packet.set_content_format(ContentFormat::ApplicationCBOR);
    packet.payload = payload.to_vec();
    packet.to_bytes().ok()
}

fn encode_gone(token: &[u8], message_id: u16, device: &ResourceKey) -> Option<Vec<u8>> {
    let mut packet = notification(token, message_id, false, ResponseType::NotFound);
    packet.set_content_format(ContentFormat::TextPlain);
    packet.payload = format!("{device} is no longer a device of this node").into_bytes();
    packet.to_bytes().ok()
}

fn notification(token: &[u8], message_id: u16, confirmable: bool, code: ResponseType) -> Packet {
    let mut packet = Packet::new();
    packet.header.set_version(1);
    packet.header.set_type(if confirmable {
        MessageType::Confirmable
    } else {
        MessageType::NonConfirmable
    });
    packet.header.message_id = message_id;
    packet.header.code = MessageClass::Response(code);
    packet.set_token(token.to_vec());
    packet
}

#[cfg(test)]
mod tests {
    use super::*;

    fn peer(port: u16) -> SocketAddr {
        SocketAddr::from(([127, 0, 0, 1], port))
    }

    fn key(name: &str) -> ResourceKey {
        ResourceKey::device("plant", name)
    }

    fn decode(out: &Outgoing) -> Packet {
        Packet::from_bytes(&out.bytes).unwrap()
    }

    fn observe(packet: &Packet) -> Option<u32> {
        packet.get_observe_value().map(Result::unwrap)
    }

    fn sequence(registration: Registration) -> u32 {
        match registration {
            Registration::Added { sequence }
            | Registration::Renewed { sequence }
            | Registration::Replaced { sequence } => sequence,
            Registration::Refused => panic!("refused"),
        }
    }

    #[test]
    fn a_registration_is_notified_with_its_token_and_a_larger_number() {
        let now = Instant::now();
        let mut observers = Observers::new(ObserveSettings::default(), 100);
        let registered = observers.register(&key("a"), peer(1), b"tok", now);
        assert_eq!(registered, Registration::Added { sequence: 100 });
        assert_eq!(observers.len(), 1);
        assert!(observers.is_observing(&key("a"), peer(1), b"tok"));
        assert!(!observers.is_observing(&key("a"), peer(1), b"other"));
        assert!(!observers.is_observing(&key("b"), peer(1), b"tok"));

        let out = observers.notify(&key("a"), Content::State(b"\xa0"), now);
        assert_eq!(out.len(), 1);
        assert_eq!(out[0].peer, peer(1));
        // By default a change of desired state is confirmable.
        assert_eq!(out[0].kind, Kind::Confirmable);
        let packet = decode(&out[0]);
        assert_eq!(packet.get_token(), b"tok");
        assert_eq!(packet.header.get_type(), MessageType::Confirmable);
        assert_eq!(
            packet.header.code,
            MessageClass::Response(ResponseType::Content)
        );
        assert_eq!(packet.payload, b"\xa0");
        assert_eq!(observe(&packet), Some(101));
        assert_eq!(
            packet.get_content_format(),
            Some(ContentFormat::ApplicationCBOR)
        );

        // Nobody else is told, and other devices' changes go to nobody.
        assert!(
            observers
                .notify(&key("b"), Content::State(b"\xa0"), now)
                .is_empty()
        );
        let again = observers.notify(&key("a"), Content::State(b"\xa1"), now);
        let next = decode(&again[0]);
        assert_eq!(observe(&next), Some(102));
        assert_ne!(next.header.message_id, packet.header.message_id);
    }

    #[test]
    fn the_same_endpoint_and_token_renew_one_entry() {
        let now = Instant::now();
        let mut observers = Observers::new(ObserveSettings::default(), 0);
        let first = sequence(observers.register(&key("a"), peer(1), b"t", now));
        let renewed = observers.register(&key("a"), peer(1), b"t", now);
        assert_eq!(
            renewed,
            Registration::Renewed {
                sequence: first + 1
            }
        );
        assert_eq!(observers.len(), 1);
        // Another token, or another port, is another observer.
        observers.register(&key("a"), peer(1), b"u", now);
        observers.register(&key("a"), peer(2), b"t", now);
        assert_eq!(observers.observers_of(&key("a")), 3);
        assert_eq!(
            observers.notify(&key("a"), Content::State(b""), now).len(),
            3
        );
    }

    #[test]
    fn deregistration_removes_only_that_entry() {
        let now = Instant::now();
        let mut observers = Observers::new(ObserveSettings::default(), 0);
        observers.register(&key("a"), peer(1), b"t", now);
        observers.register(&key("a"), peer(2), b"t", now);
        observers.register(&key("b"), peer(1), b"t", now);
        assert!(observers.deregister(&key("a"), peer(1), b"t"));
        assert!(!observers.deregister(&key("a"), peer(1), b"t"));
        assert!(!observers.deregister(&key("c"), peer(1), b"t"));
        assert_eq!(observers.len(), 2);
        let out = observers.notify(&key("a"), Content::State(b""), now);
        assert_eq!(out.iter().map(|o| o.peer).collect::<Vec<_>>(), [peer(2)]);
        assert!(observers.deregister(&key("a"), peer(2), b"t"));
        assert_eq!(observers.observed_devices(), vec![key("b")]);
    }

    #[test]
    fn a_device_at_its_cap_evicts_its_least_recently_heard_observer() {
        let start = Instant::now();
        let settings = ObserveSettings {
            max_observers_per_device: 2,
            ..ObserveSettings::default()
        };
        let mut observers = Observers::new(settings, 0);
        observers.register(&key("a"), peer(1), b"t", start);
        observers.register(&key("a"), peer(2), b"t", start + Duration::from_secs(1));
        // peer 1 is heard again (it renews): peer 2 is now the stalest.
        observers.register(&key("a"), peer(1), b"t", start + Duration::from_secs(2));
        assert!(matches!(
            observers.register(&key("a"), peer(3), b"t", start + Duration::from_secs(3)),
            Registration::Replaced { .. }
        ));
        assert_eq!(observers.observers_of(&key("a")), 2);
        assert!(observers.is_observing(&key("a"), peer(1), b"t"));
        assert!(!observers.is_observing(&key("a"), peer(2), b"t"));
        assert!(observers.is_observing(&key("a"), peer(3), b"t"));
        assert_eq!(observers.len(), 2);
    }

    #[test]
    fn bounds_refuse_new_observers_but_not_renewals() {
        let now = Instant::now();
        let settings = ObserveSettings {
            max_observers: 3,
            max_observers_per_device: 2,
            ..ObserveSettings::default()
        };
        let mut observers = Observers::new(settings, 0);
        assert!(matches!(
            observers.register(&key("a"), peer(1), b"t", now),
            Registration::Added { .. }
        ));
        assert!(matches!(
            observers.register(&key("a"), peer(2), b"t", now),
            Registration::Added { .. }
        ));
        // Per device: the stalest makes room (see the test above).
        assert!(matches!(
            observers.register(&key("a"), peer(3), b"t", now),
            Registration::Replaced { .. }
        ));
        assert!(matches!(
            observers.register(&key("a"), peer(3), b"t", now),
            Registration::Renewed { .. }
        ));
        assert!(matches!(
            observers.register(&key("b"), peer(3), b"t", now),
            Registration::Added { .. }
        ));
        // In all.
        assert_eq!(
            observers.register(&key("c"), peer(4), b"t", now),
            Registration::Refused
        );
        assert_eq!(observers.len(), 3);
        // A free place can be taken again.
        observers.deregister(&key("b"), peer(3), b"t");
        assert!(matches!(
            observers.register(&key("c"), peer(4), b"t", now),
            Registration::Added { .. }
        ));
    }

    #[test]
    fn sequence_numbers_are_24_bits_and_wrap() {
        let now = Instant::now();
        let mut observers = Observers::new(ObserveSettings::default(), SEQUENCE_MODULUS - 2);
        assert_eq!(
            sequence(observers.register(&key("a"), peer(1), b"t", now)),
            SEQUENCE_MODULUS - 2
        );
        let numbers: Vec<u32> = (0..3)
            .map(|_| {
                let out = observers.notify(&key("a"), Content::State(b""), now);
                observe(&decode(&out[0])).unwrap()
            })
            .collect();
        assert_eq!(numbers, vec![SEQUENCE_MODULUS - 1, 0, 1]);
        // One number per change, shared by the change's observers.
        observers.register(&key("a"), peer(2), b"t", now);
        let out = observers.notify(&key("a"), Content::State(b""), now);
        let numbers: Vec<_> = out.iter().map(|o| observe(&decode(o))).collect();
        assert_eq!(numbers, vec![Some(3), Some(3)]);
    }

    #[test]
    fn a_removed_device_gets_a_4_04_without_observe_and_loses_its_observers() {
        let now = Instant::now();
        let mut observers = Observers::new(ObserveSettings::default(), 0);
        observers.register(&key("a"), peer(1), b"t1", now);
        observers.register(&key("a"), peer(2), b"t2", now);
        observers.register(&key("b"), peer(1), b"t3", now);
        let mut out = observers.notify(&key("a"), Content::Gone, now);
        out.sort_by_key(|o| o.peer);
        assert_eq!(out.len(), 2);
        for (o, token) in out.iter().zip([b"t1", b"t2"]) {
            let packet = decode(o);
            assert_eq!(o.kind, Kind::Gone);
            assert_eq!(
                packet.header.code,
                MessageClass::Response(ResponseType::NotFound)
            );
            assert_eq!(packet.header.get_type(), MessageType::NonConfirmable);
            assert_eq!(packet.get_token(), token);
            assert_eq!(observe(&packet), None);
        }
        assert_eq!(observers.observers_of(&key("a")), 0);
        assert_eq!(observers.len(), 1);
        assert!(observers.notify(&key("a"), Content::Gone, now).is_empty());
    }

    #[test]
    fn a_reset_of_a_recent_notification_removes_the_observer() {
        let now = Instant::now();
        let mut observers = Observers::new(ObserveSettings::default(), 0);
        observers.register(&key("a"), peer(1), b"t", now);
        observers.register(&key("a"), peer(2), b"t", now);
        let first = observers.notify(&key("a"), Content::State(b""), now);
        let mid = |out: &[Outgoing], p| {
            decode(out.iter().find(|o| o.peer == p).unwrap())
                .header
                .message_id
        };
        let first_mid = mid(&first, peer(1));
        // A reset from another endpoint with that id is about something else.
        assert_eq!(observers.reset(peer(3), first_mid), None);
        observers.notify(&key("a"), Content::State(b""), now);
        // The older notification's id still matches.
        assert_eq!(observers.reset(peer(1), first_mid), Some(key("a")));
        assert_eq!(observers.reset(peer(1), first_mid), None);
        assert!(!observers.is_observing(&key("a"), peer(1), b"t"));
        assert!(observers.is_observing(&key("a"), peer(2), b"t"));
    }

    #[test]
    fn message_ids_are_remembered_within_a_bound() {
        let now = Instant::now();
        let mut observers = Observers::new(ObserveSettings::default(), 0);
        observers.register(&key("a"), peer(1), b"t", now);
        let first = observers.notify(&key("a"), Content::State(b""), now);
        let first_mid = decode(&first[0]).header.message_id;
        for _ in 0..RECENT_PER_OBSERVER {
            observers.notify(&key("a"), Content::State(b""), now);
        }
        assert_eq!(observers.by_message.len(), RECENT_PER_OBSERVER);
        assert_eq!(observers.reset(peer(1), first_mid), None);
        observers.deregister(&key("a"), peer(1), b"t");
        assert!(observers.by_message.is_empty());
    }

    #[test]
    fn every_nth_notification_is_confirmable_and_its_ack_is_accepted() {
        let now = Instant::now();
        let settings = ObserveSettings {
            confirmable_every: 3,
            ..ObserveSettings::default()
        };
        let mut observers = Observers::new(settings, 0);
        observers.register(&key("a"), peer(1), b"t", now);
        let mut kinds = Vec::new();
        for _ in 0..6 {
            let out = observers.notify(&key("a"), Content::State(b""), now);
            let packet = decode(&out[0]);
            kinds.push(out[0].kind);
            if out[0].kind == Kind::Confirmable {
                assert_eq!(packet.header.get_type(), MessageType::Confirmable);
                assert_eq!(observers.next_deadline().map(|d| d > now), Some(true));
                assert!(observers.acknowledged(peer(1), packet.header.message_id, now));
                assert_eq!(observers.next_deadline(), None);
            }
        }
        use Kind::{Confirmable as C, NonConfirmable as N};
        assert_eq!(kinds, [N, N, C, N, N, C]);
        // An acknowledgement of a non-confirmable id, or a repeated one, changes nothing.
        assert!(!observers.acknowledged(peer(1), 9999, now));
    }

    #[test]
    fn a_day_without_a_sign_of_life_makes_the_next_notification_confirmable() {
        let start = Instant::now();
        let settings = ObserveSettings {
            confirmable_every: 1_000,
            ..ObserveSettings::default()
        };
        let mut observers = Observers::new(settings, 0);
        observers.register(&key("a"), peer(1), b"t", start);
        let out = observers.notify(
            &key("a"),
            Content::State(b""),
            start + Duration::from_secs(3600),
        );
        assert_eq!(out[0].kind, Kind::NonConfirmable);
        let day = start + Duration::from_secs(24 * 3600);
        let out = observers.notify(&key("a"), Content::State(b""), day);
        assert_eq!(out[0].kind, Kind::Confirmable);
        observers.acknowledged(peer(1), decode(&out[0]).header.message_id, day);
        let out = observers.notify(&key("a"), Content::State(b""), day + Duration::from_secs(1));
        assert_eq!(out[0].kind, Kind::NonConfirmable);
    }

    #[test]
    fn an_unacknowledged_confirmable_notification_is_retransmitted_then_the_observer_dropped() {
        let start = Instant::now();
        let settings = ObserveSettings {
            confirmable_every: 1,
            ..ObserveSettings::default()
        };
        let (ack_timeout, max_retransmit) = (settings.ack_timeout, settings.max_retransmit);
        let mut observers = Observers::new(settings, 0);
        observers.register(&key("a"), peer(1), b"t", start);
        let sent = observers.notify(&key("a"), Content::State(b"x"), start);
        assert_eq!(sent[0].kind, Kind::Confirmable);

        let mut now = start;
        let mut retransmissions = 0;
        let mut waits = Vec::new();
        loop {
            let deadline = observers.next_deadline().expect("something in flight");
            waits.push(deadline - now);
            now = deadline;
            assert!(observers.due(now - Duration::from_millis(1)).is_empty());
            match observers.due(now).as_slice() {
                [Due::Retransmit(o)] => {
                    assert_eq!(
                        o.bytes, sent[0].bytes,
                        "a retransmission is the same message"
                    );
                    assert_eq!(o.kind, Kind::Retransmission);
                    retransmissions += 1;
                }
                [Due::TimedOut { device, peer: p }] => {
                    assert_eq!((device, *p), (&key("a"), peer(1)));
                    break;
                }
                other => panic!("{other:?}"),
            }
        }
        assert_eq!(retransmissions, max_retransmit);
        assert!(observers.is_empty());
        assert_eq!(observers.next_deadline(), None);
        // Timeouts double, starting within [ACK_TIMEOUT, 1.5 ACK_TIMEOUT).
        assert!(waits[0] >= ack_timeout && waits[0] < ack_timeout.mul_f64(1.5));
        for pair in waits.windows(2) {
            assert_eq!(pair[1], pair[0] * 2);
        }
        // The whole window stays under RFC 7252's MAX_TRANSMIT_WAIT (93 s).
        assert!(now - start < Duration::from_secs(93), "{:?}", now - start);
    }

    #[test]
    fn a_newer_notification_takes_over_the_one_in_flight() {
        let start = Instant::now();
        let settings = ObserveSettings {
            confirmable_every: 1_000,
            confirmable_interval: Duration::from_secs(10),
            ..ObserveSettings::default()
        };
        let mut observers = Observers::new(settings, 0);
        observers.register(&key("a"), peer(1), b"t", start);
        let later = start + Duration::from_secs(10);
        let first = observers.notify(&key("a"), Content::State(b"1"), later);
        assert_eq!(first[0].kind, Kind::Confirmable);
        let deadline = observers.next_deadline().unwrap();
        // Not yet acknowledged: the next one is confirmable too, and keeps the deadline.
        let second = observers.notify(
            &key("a"),
            Content::State(b"2"),
            later + Duration::from_millis(10),
        );
        assert_eq!(second[0].kind, Kind::Confirmable);
        assert_eq!(observers.next_deadline(), Some(deadline));
        match observers.due(deadline).as_slice() {
            [Due::Retransmit(o)] => assert_eq!(o.bytes, second[0].bytes),
            other => panic!("{other:?}"),
        }
        // An acknowledgement of the first one shows the client is alive but
        // does not confirm the second: it goes on until its own.
        let first_mid = decode(&first[0]).header.message_id;
        assert!(!observers.acknowledged(peer(1), first_mid, deadline));
        assert!(observers.next_deadline().is_some());
        let second_mid = decode(&second[0]).header.message_id;
        assert!(observers.acknowledged(peer(1), second_mid, deadline));
        assert_eq!(observers.next_deadline(), None);
        assert!(
            observers
                .due(deadline + Duration::from_secs(600))
                .is_empty()
        );
        assert_eq!(observers.len(), 1);
    }
}
