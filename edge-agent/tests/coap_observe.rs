//! CoAP Observe (RFC 7641) on a device's desired state, over real UDP on
//! loopback with a real store on disk: observers are notified of each change
//! with a newer Observe number until they deregister or reset, a removed
//! device ends its observations with `4.04`, unacknowledged confirmable
//! notifications drop the observer, and the bounds hold.

use std::collections::VecDeque;
use std::net::SocketAddr;
use std::time::Duration;

use coap_lite::{CoapOption, MessageClass, MessageType, Packet, RequestType, ResponseType};
use edgefleet_agent::coap::CoapSettings;
use edgefleet_agent::coap::observe::{ObserveSettings, SEQUENCE_MODULUS};
use edgefleet_agent::store::DesiredDevice;
use edgefleet_shared::PropertyValue;
use edgefleet_shared::codec::{self, DesiredState};
use tokio::net::UdpSocket;

/// How long a test waits to be sure nothing comes.
const QUIET: Duration = Duration::from_millis(300);

mod common;
use common::{Agent, key, plain, thermostat};

fn observing(observe: ObserveSettings) -> CoapSettings {
    CoapSettings { observe, ..plain() }
}

impl Agent {
    async fn set(&self, name: &str, generation: i64, setpoint: f64) {
        self.store
            .apply(&[(key(name), thermostat(generation, setpoint))], &[])
            .await
            .unwrap();
    }

    async fn remove(&self, name: &str) {
        self.store
            .apply::<DesiredDevice>(&[], &[key(name)])
            .await
            .unwrap();
    }

    async fn eventually_observers(&self, n: i64) {
        for _ in 0..500 {
            if self.metrics.observers.get() == n {
                return;
            }
            tokio::time::sleep(Duration::from_millis(10)).await;
        }
        panic!("{} observers, expected {n}", self.metrics.observers.get());
    }
}

/// A device's side: requests, and the notifications that come in between.
struct Client {
    socket: UdpSocket,
    agent: SocketAddr,
    next_id: u16,
    token: Vec<u8>,
    unsolicited: VecDeque<Packet>,
}

impl Client {
    async fn new(agent: &Agent, token: &[u8]) -> Client {
        Client {
            socket: UdpSocket::bind("127.0.0.1:0").await.unwrap(),
            agent: agent.addr,
            next_id: 1,
            token: token.to_vec(),
            unsolicited: VecDeque::new(),
        }
    }

    /// A confirmable GET of `name`'s desired state, with `observe` if given;
    /// returns the piggybacked response.
    async fn get(&mut self, name: &str, observe: Option<u32>) -> Packet {
        let mut request = Packet::new();
        request.header.set_version(1);
        request.header.set_type(MessageType::Confirmable);
        request.header.code = MessageClass::Request(RequestType::Get);
        request.header.message_id = self.next_id;
        self.next_id += 1;
        request.set_token(self.token.clone());
        for segment in ["d", "plant", name, "desired"] {
            request.add_option(CoapOption::UriPath, segment.as_bytes().to_vec());
        }
        if let Some(observe) = observe {
            request.set_observe_value(observe);
        }
        let bytes = request.to_bytes().unwrap();
        for _ in 0..10 {
            self.socket.send_to(&bytes, self.agent).await.unwrap();
            let deadline = tokio::time::Instant::now() + Duration::from_millis(500);
            while let Some(packet) = self.receive_until(deadline).await {
                if packet.header.get_type() == MessageType::Acknowledgement
                    && packet.header.message_id == request.header.message_id
                {
                    assert_eq!(packet.get_token(), self.token.as_slice());
                    return packet;
                }
                self.unsolicited.push_back(packet);
            }
        }
        panic!("the agent never answered");
    }

    async fn receive_until(&self, deadline: tokio::time::Instant) -> Option<Packet> {
        let mut buf = vec![0u8; 2048];
        let (len, from) = tokio::time::timeout_at(deadline, self.socket.recv_from(&mut buf))
            .await
            .ok()?
            .unwrap();
        assert_eq!(from, self.agent);
        Some(Packet::from_bytes(&buf[..len]).unwrap())
    }

    /// The next datagram from the agent within `wait`, if any.
    async fn next(&mut self, wait: Duration) -> Option<Packet> {
        if let Some(packet) = self.unsolicited.pop_front() {
            return Some(packet);
        }
        self.receive_until(tokio::time::Instant::now() + wait).await
    }

    async fn notification(&mut self) -> Packet {
        self.next(Duration::from_secs(5))
            .await
            .expect("a notification within 5 s")
    }

    async fn nothing_more(&mut self) {
        if let Some(packet) = self.next(QUIET).await {
            panic!("expected nothing, got {packet:?}");
        }
    }

    /// An empty message (ACK or RST) answering `message_id`.
    async fn answer(&self, kind: MessageType, message_id: u16) {
        let mut packet = Packet::new();
        packet.header.set_version(1);
        packet.header.set_type(kind);
        packet.header.code = MessageClass::Empty;
        packet.header.message_id = message_id;
        self.socket
            .send_to(&packet.to_bytes().unwrap(), self.agent)
            .await
            .unwrap();
    }
}

fn code(packet: &Packet) -> ResponseType {
    match packet.header.code {
        MessageClass::Response(code) => code,
        other => panic!("not a response: {other:?}"),
    }
}

fn observe(packet: &Packet) -> Option<u32> {
    packet.get_observe_value().map(|v| v.unwrap())
}

/// RFC 7641 §3.4: whether Observe value `v2` is newer than `v1`.
fn newer(v1: u32, v2: u32) -> bool {
    const HALF: u32 = SEQUENCE_MODULUS / 2;
    (v1 < v2 && v2 - v1 < HALF) || (v1 > v2 && v1 - v2 > HALF)
}

fn setpoint_of(packet: &Packet) -> (i64, PropertyValue) {
    let state: DesiredState = codec::decode(&packet.payload).unwrap();
    (state.generation, state.properties["setpoint"].clone())
}

#[tokio::test]
async fn an_observer_is_notified_of_each_change_until_it_deregisters() {
    let agent = Agent::start(plain(), &["t1", "t2"]).await;
    let mut device = Client::new(&agent, b"obs1").await;

    let registered = device.get("t1", Some(0)).await;
    assert_eq!(code(&registered), ResponseType::Content);
    assert_eq!(setpoint_of(&registered), (1, PropertyValue::Float(20.0)));
    let mut last = observe(&registered).expect("the registration's response carries Observe");
    assert!(last < SEQUENCE_MODULUS);
    assert_eq!(agent.metrics.observers.get(), 1);
    assert_eq!(agent.metrics.requests.get("observe_registered"), 1);

    let mut message_ids = vec![registered.header.message_id];
    for (generation, setpoint) in [(2, 21.5), (3, 19.0)] {
        agent.set("t1", generation, setpoint).await;
        let notification = device.notification().await;
        assert_eq!(code(&notification), ResponseType::Content);
        assert_eq!(notification.get_token(), b"obs1");
        // A change of desired state is confirmable: a lost one is sent again.
        assert_eq!(notification.header.get_type(), MessageType::Confirmable);
        device
            .answer(MessageType::Acknowledgement, notification.header.message_id)
            .await;
        assert_eq!(
            setpoint_of(&notification),
            (generation, PropertyValue::Float(setpoint))
        );
        let number = observe(&notification).expect("a notification carries Observe");
        assert!(newer(last, number), "{number} is not newer than {last}");
        last = number;
        assert!(!message_ids.contains(&notification.header.message_id));
        message_ids.push(notification.header.message_id);
    }
    // Another device's change is not this observer's business.
    agent.set("t2", 2, 30.0).await;
    device.nothing_more().await;
    assert_eq!(agent.metrics.notifications.get("con"), 2);
    assert_eq!(agent.metrics.notifications.get("retransmission"), 0);

    let deregistered = device.get("t1", Some(1)).await;
    assert_eq!(code(&deregistered), ResponseType::Content);
    assert_eq!(observe(&deregistered), None);
    assert_eq!(setpoint_of(&deregistered), (3, PropertyValue::Float(19.0)));
    assert_eq!(agent.metrics.observers.get(), 0);
    assert_eq!(agent.metrics.observe.get("deregistered"), 1);
    agent.set("t1", 4, 22.0).await;
    device.nothing_more().await;
}

#[tokio::test]
async fn a_plain_get_with_the_observations_token_ends_it() {
    let agent = Agent::start(plain(), &["t1"]).await;
    let mut device = Client::new(&agent, b"obs2").await;
    let mut other = Client::new(&agent, b"obs3").await;
    assert!(observe(&device.get("t1", Some(0)).await).is_some());
    assert!(observe(&other.get("t1", Some(0)).await).is_some());
    assert_eq!(agent.metrics.observers.get(), 2);

    let plain = device.get("t1", None).await;
    assert_eq!(code(&plain), ResponseType::Content);
    assert_eq!(observe(&plain), None);
    assert_eq!(agent.metrics.observers.get(), 1);

    agent.set("t1", 2, 25.0).await;
    let notification = other.notification().await;
    assert_eq!(setpoint_of(&notification), (2, PropertyValue::Float(25.0)));
    device.nothing_more().await;
}

#[tokio::test]
async fn a_removed_device_ends_its_observations_with_4_04() {
    let agent = Agent::start(plain(), &["t1"]).await;
    let mut device = Client::new(&agent, b"gone").await;
    assert!(observe(&device.get("t1", Some(0)).await).is_some());

    agent.remove("t1").await;
    let notification = device.notification().await;
    assert_eq!(code(&notification), ResponseType::NotFound);
    assert_eq!(notification.get_token(), b"gone");
    assert_eq!(observe(&notification), None);
    assert_eq!(agent.metrics.observers.get(), 0);
    assert_eq!(agent.metrics.observe.get("device_removed"), 1);
    assert_eq!(agent.metrics.notifications.get("gone"), 1);

    // Back on the node: the old observation stays over.
    agent.set("t1", 2, 20.0).await;
    device.nothing_more().await;
}

#[tokio::test]
async fn an_unknown_device_is_refused_and_not_observed() {
    let agent = Agent::start(plain(), &["t1"]).await;
    let mut device = Client::new(&agent, b"nope").await;
    let refused = device.get("t9", Some(0)).await;
    assert_eq!(code(&refused), ResponseType::NotFound);
    assert_eq!(observe(&refused), None);
    assert_eq!(agent.metrics.observers.get(), 0);
    assert_eq!(agent.metrics.requests.get("unknown_device"), 1);

    agent.set("t9", 1, 20.0).await;
    device.nothing_more().await;
}

#[tokio::test]
async fn a_reset_of_a_notification_removes_the_observer() {
    let agent = Agent::start(plain(), &["t1"]).await;
    let mut device = Client::new(&agent, b"rst").await;
    let mut stays = Client::new(&agent, b"stays").await;
    assert!(observe(&device.get("t1", Some(0)).await).is_some());
    assert!(observe(&stays.get("t1", Some(0)).await).is_some());

    agent.set("t1", 2, 21.0).await;
    let notification = device.notification().await;
    stays.notification().await;
    device
        .answer(MessageType::Reset, notification.header.message_id)
        .await;
    agent.eventually_observers(1).await;
    assert_eq!(agent.metrics.observe.get("reset"), 1);

    agent.set("t1", 3, 22.0).await;
    let kept = stays.notification().await;
    assert_eq!(setpoint_of(&kept), (3, PropertyValue::Float(22.0)));
    device.nothing_more().await;
}

#[tokio::test]
async fn confirmable_notifications_are_acknowledged_or_the_observer_is_dropped() {
    let settings = ObserveSettings {
        confirmable_every: 1,
        ack_timeout: Duration::from_millis(200),
        max_retransmit: 2,
        ..ObserveSettings::default()
    };
    let agent = Agent::start(observing(settings), &["t1"]).await;
    let mut device = Client::new(&agent, b"con").await;
    assert!(observe(&device.get("t1", Some(0)).await).is_some());

    // Acknowledged: no retransmission, and the observer stays.
    agent.set("t1", 2, 21.0).await;
    let acked = device.notification().await;
    assert_eq!(acked.header.get_type(), MessageType::Confirmable);
    assert_eq!(setpoint_of(&acked), (2, PropertyValue::Float(21.0)));
    device
        .answer(MessageType::Acknowledgement, acked.header.message_id)
        .await;
    device.nothing_more().await;
    assert_eq!(agent.metrics.notifications.get("retransmission"), 0);

    // Ignored: sent again max_retransmit times, then the observer is dropped.
    agent.set("t1", 3, 22.0).await;
    let first = device.notification().await;
    assert_eq!(first.header.get_type(), MessageType::Confirmable);
    assert_ne!(first.header.message_id, acked.header.message_id);
    for _ in 0..2 {
        let again = device.notification().await;
        assert_eq!(again.header.message_id, first.header.message_id);
        assert_eq!(again.payload, first.payload);
    }
    agent.eventually_observers(0).await;
    assert_eq!(agent.metrics.observe.get("timed_out"), 1);
    assert_eq!(agent.metrics.notifications.get("retransmission"), 2);
    agent.set("t1", 4, 23.0).await;
    device.nothing_more().await;
}

#[tokio::test]
async fn a_device_at_its_cap_takes_the_newest_observer_and_beyond_the_total_one_is_refused() {
    let settings = ObserveSettings {
        max_observers: 2,
        max_observers_per_device: 1,
        ..ObserveSettings::default()
    };
    let agent = Agent::start(observing(settings), &["t1", "t2", "t3"]).await;
    let mut first = Client::new(&agent, b"one").await;
    let mut second = Client::new(&agent, b"two").await;
    let mut third = Client::new(&agent, b"three").await;

    assert!(observe(&first.get("t1", Some(0)).await).is_some());
    // The device's bound: the newer observer (a device back from a reboot
    // on another port) takes the place of the least recently heard one.
    let taken = second.get("t1", Some(0)).await;
    assert_eq!(code(&taken), ResponseType::Content);
    assert!(observe(&taken).is_some());
    assert_eq!(agent.metrics.observe.get("evicted"), 1);
    assert!(observe(&second.get("t2", Some(0)).await).is_some());
    // The total bound: answered, with the state, but not observed.
    let refused = third.get("t3", Some(0)).await;
    assert_eq!(code(&refused), ResponseType::Content);
    assert_eq!(observe(&refused), None);
    assert_eq!(setpoint_of(&refused), (1, PropertyValue::Float(20.0)));
    assert_eq!(agent.metrics.requests.get("observe_refused"), 1);
    assert_eq!(agent.metrics.observers.get(), 2);

    agent.set("t1", 2, 24.0).await;
    agent.set("t3", 2, 24.0).await;
    assert_eq!(
        setpoint_of(&second.notification().await),
        (2, PropertyValue::Float(24.0))
    );
    first.nothing_more().await;
    third.nothing_more().await;
}
