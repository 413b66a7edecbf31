//! What the CoAP server refuses and how, over real UDP on loopback with a
//! real store on disk: pings answered with a Reset, unknown critical
//! options (4.02), payloads that say they are not CBOR (4.15), an Accept
//! the agent cannot give (4.06), refusals no larger than about twice the
//! request, and requests beyond the bound answered 5.03 with Max-Age —
//! each counted, and nothing refused ever stored.

use std::collections::BTreeMap;
use std::net::SocketAddr;
use std::time::Duration;

use coap_lite::{CoapOption, MessageClass, MessageType, Packet, RequestType, ResponseType};
use edgefleet_agent::coap::CoapSettings;
use edgefleet_shared::PropertyValue;
use edgefleet_shared::codec::{self, DeviceReport};
use tokio::net::UdpSocket;

mod common;
use common::{Agent, key, plain};

impl Agent {
    fn count(&self, outcome: &str) -> u64 {
        self.metrics.requests.get(outcome)
    }

    fn stored(&self) -> bool {
        self.store.latest_report(&key("t1")).unwrap().is_some()
    }
}

fn request(method: RequestType, path: &str, id: u16) -> Packet {
    let mut p = Packet::new();
    p.header.set_version(1);
    p.header.set_type(MessageType::Confirmable);
    p.header.code = MessageClass::Request(method);
    p.header.message_id = id;
    p.set_token(vec![id as u8, 7]);
    for segment in path.split('/') {
        p.add_option(CoapOption::UriPath, segment.as_bytes().to_vec());
    }
    p
}

fn report(id: u16) -> Packet {
    let mut p = request(RequestType::Post, "d/plant/t1/report", id);
    p.payload = codec::encode(&DeviceReport {
        applied_generation: 1,
        properties: BTreeMap::from([("temperature".to_owned(), PropertyValue::Float(20.5))]),
        firmware_version: None,
        firmware_failure: None,
    })
    .unwrap();
    p
}

/// Sends `bytes` and returns the datagram that answers them.
async fn exchange(socket: &UdpSocket, agent: SocketAddr, bytes: &[u8]) -> Vec<u8> {
    socket.send_to(bytes, agent).await.unwrap();
    let mut buf = vec![0u8; 2048];
    let (n, _) = tokio::time::timeout(Duration::from_secs(5), socket.recv_from(&mut buf))
        .await
        .expect("an answer")
        .unwrap();
    buf.truncate(n);
    buf
}

async fn client() -> UdpSocket {
    UdpSocket::bind("127.0.0.1:0").await.unwrap()
}

fn code(bytes: &[u8]) -> MessageClass {
    Packet::from_bytes(bytes).unwrap().header.code
}

#[tokio::test]
async fn a_ping_is_answered_with_a_reset_and_so_is_a_confirmable_response() {
    let agent = Agent::start(plain(), &["t1"]).await;
    let socket = client().await;
    // An empty confirmable message: version 1, CON, token length 0, 0.00.
    let answer = exchange(&socket, agent.addr, &[0x40, 0x00, 0x12, 0x34]).await;
    assert_eq!(
        answer,
        vec![0x70, 0x00, 0x12, 0x34],
        "a Reset of the same id"
    );
    let mut response = request(RequestType::Get, "x", 9);
    response.header.code = MessageClass::Response(ResponseType::Content);
    let answer = exchange(&socket, agent.addr, &response.to_bytes().unwrap()).await;
    let reset = Packet::from_bytes(&answer).unwrap();
    assert_eq!(reset.header.get_type(), MessageType::Reset);
    assert_eq!(reset.header.message_id, 9);
    assert_eq!((agent.count("ping"), agent.count("rejected")), (1, 1));
}

#[tokio::test]
async fn options_and_formats_the_agent_does_not_implement_are_refused_and_nothing_is_stored() {
    let agent = Agent::start(plain(), &["t1"]).await;
    let socket = client().await;
    // A conditional report (If-Match, critical): 4.02.
    let mut p = report(1);
    p.add_option(CoapOption::IfMatch, vec![1]);
    let answer = exchange(&socket, agent.addr, &p.to_bytes().unwrap()).await;
    assert_eq!(
        code(&answer),
        MessageClass::Response(ResponseType::BadOption)
    );
    // Block-wise (Block1, critical): 4.02.
    let mut p = report(2);
    p.add_option(CoapOption::Block1, vec![0x0e]);
    let answer = exchange(&socket, agent.addr, &p.to_bytes().unwrap()).await;
    assert_eq!(
        code(&answer),
        MessageClass::Response(ResponseType::BadOption)
    );
    // A report labelled text/plain is not CBOR, whatever its bytes: 4.15.
    let mut p = report(3);
    p.add_option(CoapOption::ContentFormat, vec![]);
    let answer = exchange(&socket, agent.addr, &p.to_bytes().unwrap()).await;
    assert_eq!(
        code(&answer),
        MessageClass::Response(ResponseType::UnsupportedContentFormat)
    );
    assert!(!agent.stored(), "nothing refused was stored");
    // Desired state only as CBOR: an Accept of JSON (50) is 4.06.
    let mut p = request(RequestType::Get, "d/plant/t1/desired", 4);
    p.add_option(CoapOption::Accept, vec![50]);
    let answer = exchange(&socket, agent.addr, &p.to_bytes().unwrap()).await;
    assert_eq!(
        code(&answer),
        MessageClass::Response(ResponseType::NotAcceptable)
    );
    // An unknown elective option and an explicit CBOR format are fine.
    let mut p = report(5);
    p.add_option(CoapOption::Unknown(2000), vec![1]);
    p.add_option(CoapOption::ContentFormat, vec![60]);
    let answer = exchange(&socket, agent.addr, &p.to_bytes().unwrap()).await;
    assert_eq!(code(&answer), MessageClass::Response(ResponseType::Changed));
    assert!(agent.stored());
    assert_eq!(agent.count("bad_option"), 2);
    assert_eq!(agent.count("unsupported_content_format"), 1);
    assert_eq!(agent.count("not_acceptable"), 1);
    assert_eq!(agent.count("stored"), 1);
}

#[tokio::test]
async fn a_refusal_is_no_larger_than_about_twice_its_request() {
    let agent = Agent::start(plain(), &["t1"]).await;
    let socket = client().await;
    for (path, method) in [
        ("x", RequestType::Get),
        ("d/plant/ghost/desired", RequestType::Get),
        ("d/plant/t1/report", RequestType::Put),
    ] {
        let mut p = request(method, path, 1);
        p.set_token(Vec::new());
        let bytes = p.to_bytes().unwrap();
        let answer = exchange(&socket, agent.addr, &bytes).await;
        let refusal = Packet::from_bytes(&answer).unwrap();
        assert!(
            matches!(refusal.header.code, MessageClass::Response(c) if c != ResponseType::Content),
            "{path}: {:?}",
            refusal.header.code
        );
        assert!(
            answer.len() <= 2 * bytes.len(),
            "{path}: {} bytes answer {} bytes",
            answer.len(),
            bytes.len()
        );
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn requests_beyond_the_bound_are_answered_5_03_with_max_age_and_succeed_later() {
    let agent = Agent::start(
        CoapSettings {
            max_requests_in_flight: 1,
            ..plain()
        },
        &["t1"],
    )
    .await;
    let socket = client().await;
    // A burst: each report waits for its durable write, so with one place
    // the others arriving meanwhile are turned away.
    const BURST: u16 = 64;
    for id in 0..BURST {
        socket
            .send_to(&report(id).to_bytes().unwrap(), agent.addr)
            .await
            .unwrap();
    }
    let mut answers = BTreeMap::new();
    let mut buf = vec![0u8; 2048];
    while answers.len() < BURST as usize {
        let (n, _) = tokio::time::timeout(Duration::from_secs(5), socket.recv_from(&mut buf))
            .await
            .expect("every request answered")
            .unwrap();
        let p = Packet::from_bytes(&buf[..n]).unwrap();
        answers.insert(p.header.message_id, p);
    }
    let busy: Vec<u16> = answers
        .iter()
        .filter(|(_, p)| p.header.code == MessageClass::Response(ResponseType::ServiceUnavailable))
        .map(|(id, _)| *id)
        .collect();
    assert!(!busy.is_empty(), "the burst was never over the bound");
    for id in &busy {
        let max_age = answers[id].get_option(CoapOption::MaxAge).unwrap();
        assert_eq!(max_age.front().unwrap(), &vec![1u8]);
    }
    let changed = answers
        .values()
        .filter(|p| p.header.code == MessageClass::Response(ResponseType::Changed))
        .count();
    assert_eq!(changed + busy.len(), BURST as usize);
    assert_eq!(agent.count("overloaded"), busy.len() as u64);
    // After Max-Age, the same reports (new message ids) go through.
    tokio::time::sleep(Duration::from_secs(1)).await;
    for id in &busy {
        let answer = exchange(&socket, agent.addr, &report(1000 + id).to_bytes().unwrap()).await;
        assert_eq!(code(&answer), MessageClass::Response(ResponseType::Changed));
    }
}
