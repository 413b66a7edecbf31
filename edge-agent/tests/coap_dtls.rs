//! CoAP over DTLS with each device's key, over real UDP on loopback with a
//! real store on disk, the simulator's DTLS client playing the device: a
//! device acts only for itself, a wrong key or plain CoAP gets no session
//! and no answer, a revoked key ends the session, a device that comes back
//! on the same port gets a new session, and Observe notifications travel
//! in the session.

use std::time::Duration;

use coap_lite::{CoapOption, MessageClass, MessageType, Packet, RequestType, ResponseType};
use edgefleet_agent::store::{Desired, HeldCredential};
use edgefleet_shared::codec::{self, DeviceReport};
use edgefleet_shared::credential::{self, Psk};
use edgefleet_sim::coap::{CoapClient, ExchangeError, Request, connected_socket};
use edgefleet_sim::dtls::DtlsLink;
use edgefleet_sim::retransmit::RetransmitParams;
use tokio::net::UdpSocket;

mod common;
use common::{Agent, key, thermostat};

const T1_KEY: &str = "t1-key-0123456789abcdef";
const T2_KEY: &str = "t2-key-0123456789abcdef";

fn held(psk: &str) -> Desired {
    let psk = Psk::new(psk.as_bytes().to_vec()).unwrap();
    Desired::Credential(HeldCredential {
        version: credential::version("secret-uid", &psk),
        psk,
    })
}

/// The agent with DTLS (the default), devices t1 and t2 and their keys.
async fn agent() -> Agent {
    let agent = Agent::start(Default::default(), &["t1", "t2"]).await;
    agent
        .store
        .apply(
            &[
                (credential::key_of(&key("t1")), held(T1_KEY)),
                (credential::key_of(&key("t2")), held(T2_KEY)),
            ],
            &[],
        )
        .await
        .unwrap();
    agent
}

/// Quick retransmissions: 0.5 s, 1 s, 2 s.
fn quick() -> RetransmitParams {
    RetransmitParams {
        ack_timeout: Duration::from_millis(500),
        ack_random_factor: 1.0,
        max_retransmit: 2,
    }
}

fn report_of(device: &str) -> Request {
    let payload = codec::encode(&DeviceReport {
        applied_generation: 1,
        properties: Default::default(),
        firmware_version: None,
        firmware_failure: None,
    })
    .unwrap();
    Request::report("plant", device, payload)
}

async fn post(client: &CoapClient, request: &Request) -> Result<MessageClass, ExchangeError> {
    let exchange = client
        .request(request, quick().start_with_factor(1.0))
        .await;
    exchange.result.map(|response| response.code)
}

async fn device(agent: &Agent, name: &str, psk: &str) -> CoapClient {
    CoapClient::connect_dtls(agent.addr, &key(name), psk.as_bytes(), 1, 1)
        .await
        .unwrap()
}

fn changed() -> MessageClass {
    MessageClass::Response(ResponseType::Changed)
}

async fn eventually(what: &str, mut check: impl FnMut() -> bool) {
    for _ in 0..100 {
        if check() {
            return;
        }
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    panic!("{what}: not within 5 s");
}

#[tokio::test]
async fn a_device_reports_for_itself_and_is_forbidden_to_report_for_another() {
    let agent = agent().await;
    let t1 = device(&agent, "t1", T1_KEY).await;

    assert_eq!(post(&t1, &report_of("t1")).await, Ok(changed()));
    assert!(agent.store.latest_report(&key("t1")).unwrap().is_some());

    assert_eq!(
        post(&t1, &report_of("t2")).await,
        Ok(MessageClass::Response(ResponseType::Forbidden))
    );
    assert!(agent.store.latest_report(&key("t2")).unwrap().is_none());
    assert_eq!(agent.metrics.requests.get("forbidden"), 1);
    assert_eq!(agent.metrics.dtls.events.get("established"), 1);
    assert_eq!(agent.metrics.dtls.sessions.get(), 1);
}

#[tokio::test]
async fn a_wrong_key_gets_no_session_and_nothing_is_stored() {
    let agent = agent().await;
    let impostor = device(&agent, "t1", T2_KEY).await;

    assert!(matches!(
        post(&impostor, &report_of("t1")).await,
        Err(ExchangeError::Timeout(_))
    ));
    assert!(agent.store.latest_report(&key("t1")).unwrap().is_none());
    assert!(agent.metrics.dtls.events.get("handshake_failed") >= 1);
    assert_eq!(agent.metrics.dtls.events.get("established"), 0);

    // A device the agent has no key for: the same.
    let stranger = device(&agent, "t9", T1_KEY).await;
    assert!(post(&stranger, &report_of("t9")).await.is_err());
    assert_eq!(agent.metrics.dtls.events.get("established"), 0);
}

#[tokio::test]
async fn plain_coap_on_the_dtls_port_gets_no_answer() {
    let agent = agent().await;
    let plain = CoapClient::connect(agent.addr, 1, 1).await.unwrap();

    assert!(matches!(
        post(&plain, &report_of("t1")).await,
        Err(ExchangeError::Timeout(_))
    ));
    assert!(agent.store.latest_report(&key("t1")).unwrap().is_none());
    // The request and its two retransmissions.
    assert_eq!(agent.metrics.dtls.events.get("not_dtls"), 3);
}

#[tokio::test]
async fn a_revoked_key_ends_the_session_and_a_rotated_one_takes_over() {
    let agent = agent().await;
    let t1 = device(&agent, "t1", T1_KEY).await;
    assert_eq!(post(&t1, &report_of("t1")).await, Ok(changed()));

    agent
        .store
        .apply::<Desired>(&[], &[credential::key_of(&key("t1"))])
        .await
        .unwrap();
    eventually("the session ends", || {
        agent.metrics.dtls.events.get("revoked") == 1 && agent.metrics.dtls.sessions.get() == 0
    })
    .await;
    assert!(post(&t1, &report_of("t1")).await.is_err());

    // A new key: the old one opens nothing, the new one does.
    const ROTATED: &str = "t1-rotated-0123456789ab";
    agent
        .store
        .apply(&[(credential::key_of(&key("t1")), held(ROTATED))], &[])
        .await
        .unwrap();
    let old = device(&agent, "t1", T1_KEY).await;
    assert!(post(&old, &report_of("t1")).await.is_err());
    let new = device(&agent, "t1", ROTATED).await;
    assert_eq!(post(&new, &report_of("t1")).await, Ok(changed()));
}

#[tokio::test]
async fn a_device_back_on_the_same_port_gets_a_new_session() {
    let agent = agent().await;
    let socket = connected_socket(agent.addr).await.unwrap();
    let port = socket.local_addr().unwrap();
    let before = CoapClient::dtls(socket, &key("t1"), T1_KEY.as_bytes(), 1, 1);
    assert_eq!(post(&before, &report_of("t1")).await, Ok(changed()));
    drop(before);

    // Rebooted: same address and port, no memory of the session. (The old
    // socket closes once its tasks see they are aborted.)
    let mut socket = UdpSocket::bind(port).await;
    for _ in 0..50 {
        if socket.is_ok() {
            break;
        }
        tokio::time::sleep(Duration::from_millis(20)).await;
        socket = UdpSocket::bind(port).await;
    }
    let socket = socket.unwrap();
    socket.connect(agent.addr).await.unwrap();
    let after = CoapClient::dtls(socket, &key("t1"), T1_KEY.as_bytes(), 100, 100);
    assert_eq!(post(&after, &report_of("t1")).await, Ok(changed()));
    assert_eq!(agent.metrics.dtls.events.get("replaced"), 1);
    assert_eq!(agent.metrics.dtls.sessions.get(), 1);
}

fn observe_desired(device: &str) -> Packet {
    let mut p = Packet::new();
    p.header.set_version(1);
    p.header.set_type(MessageType::Confirmable);
    p.header.code = MessageClass::Request(RequestType::Get);
    p.header.message_id = 7;
    p.set_token(vec![7, 7]);
    p.set_observe_value(0);
    for segment in ["d", "plant", device, "desired"] {
        p.add_option(CoapOption::UriPath, segment.as_bytes().to_vec());
    }
    p
}

async fn next(link: &DtlsLink) -> Packet {
    let bytes = tokio::time::timeout(Duration::from_secs(5), link.recv())
        .await
        .expect("a message within 5 s")
        .unwrap();
    Packet::from_bytes(&bytes).unwrap()
}

#[tokio::test]
async fn observe_notifications_travel_in_the_session() {
    let agent = agent().await;
    let socket = connected_socket(agent.addr).await.unwrap();
    let link = DtlsLink::start(socket, "t1@plant", T1_KEY.as_bytes());

    link.send(&observe_desired("t1").to_bytes().unwrap())
        .await
        .unwrap();
    let registered = next(&link).await;
    assert_eq!(
        registered.header.code,
        MessageClass::Response(ResponseType::Content)
    );
    assert!(registered.get_observe_value().is_some());

    agent
        .store
        .apply(&[(key("t1"), thermostat(2, 23.0))], &[])
        .await
        .unwrap();
    let notification = next(&link).await;
    assert_eq!(notification.get_token(), [7, 7]);
    let desired: codec::DesiredState = codec::decode(&notification.payload).unwrap();
    assert_eq!(desired.generation, 2);

    // Another device's desired state is not for t1 to read.
    let mut other = observe_desired("t2");
    other.header.message_id = 8;
    link.send(&other.to_bytes().unwrap()).await.unwrap();
    assert_eq!(
        next(&link).await.header.code,
        MessageClass::Response(ResponseType::Forbidden)
    );
}

/// libcoap's `coap-client` (Debian's `libcoap3-bin`, built with `flavour`
/// OpenSSL or GnuTLS) as the device: `-u` is the PSK identity, `-k` the
/// key. It exits 0 even when the handshake fails, so the test judges by
/// what the agent stored and counted, and by what the client printed.
async fn coap_client(flavour: &str, args: &[&str]) -> std::process::Output {
    let program = format!("coap-client-{flavour}");
    let mut command = std::process::Command::new(&program);
    command.args(["-B", "5"]).args(args);
    let out = tokio::task::spawn_blocking(move || command.output())
        .await
        .unwrap()
        .unwrap_or_else(|e| panic!("run {program} (apt-get install libcoap3-bin): {e}"));
    eprintln!(
        "{program} {args:?}: stderr {:?}",
        String::from_utf8_lossy(&out.stderr)
    );
    out
}

async fn a_foreign_client_interoperates(flavour: &str) {
    let agent = agent().await;
    let dir = tempfile::tempdir().unwrap();
    let report = dir.path().join("report.cbor");
    std::fs::write(
        &report,
        codec::encode(&DeviceReport {
            applied_generation: 1,
            properties: Default::default(),
            firmware_version: Some("9.9.9".into()),
            firmware_failure: None,
        })
        .unwrap(),
    )
    .unwrap();
    let report = report.to_str().unwrap();
    let url = |device: &str, resource: &str| {
        format!("coaps://{}/d/plant/{device}/{resource}", agent.addr)
    };

    // Its own report: stored.
    let own = url("t1", "report");
    let post = ["-m", "post", "-t", "60", "-f", report, "-u", "t1@plant"];
    let args = [&post[..], &["-k", T1_KEY, own.as_str()]].concat();
    coap_client(flavour, &args).await;
    let stored = agent.store.latest_report(&key("t1")).unwrap();
    assert_eq!(
        stored.and_then(|r| r.report.firmware_version).as_deref(),
        Some("9.9.9"),
        "{flavour}: the report of t1 is stored"
    );

    // Its desired state, in CBOR, written to a file.
    let desired = url("t1", "desired");
    let received = dir.path().join("desired.cbor");
    let received_at = received.to_str().unwrap();
    let get = ["-o", received_at, "-u", "t1@plant", "-k", T1_KEY, &desired];
    coap_client(flavour, &get).await;
    let state: codec::DesiredState = codec::decode(&std::fs::read(&received).unwrap()).unwrap();
    assert_eq!(state.generation, 1);

    // Another device's report: 4.03, not stored.
    let other = url("t2", "report");
    let args = [&post[..], &["-k", T1_KEY, other.as_str()]].concat();
    let out = coap_client(flavour, &args).await;
    assert!(String::from_utf8_lossy(&out.stderr).contains("4.03"));
    assert!(agent.store.latest_report(&key("t2")).unwrap().is_none());
    assert_eq!(agent.metrics.requests.get("forbidden"), 1);

    // The wrong key: no session, nothing stored.
    let failed = agent.metrics.dtls.events.get("handshake_failed");
    let args = [&post[..], &["-k", T2_KEY, other.as_str()]].concat();
    coap_client(flavour, &args).await;
    assert!(agent.store.latest_report(&key("t2")).unwrap().is_none());
    assert_eq!(
        agent.metrics.dtls.events.get("handshake_failed"),
        failed + 1
    );
    assert_eq!(agent.metrics.dtls.events.get("established"), 3);
}

#[tokio::test]
async fn libcoap_with_openssl_interoperates() {
    a_foreign_client_interoperates("openssl").await;
}

#[tokio::test]
async fn libcoap_with_gnutls_interoperates() {
    a_foreign_client_interoperates("gnutls").await;
}
