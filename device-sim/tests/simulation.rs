//! The simulator end to end, in one process: an embedded MQTT broker
//! (rumqttd) and a small CoAP responder stand in for the edge node.

use std::collections::HashMap;
use std::future::Future;
use std::net::{Ipv4Addr, SocketAddr, TcpListener, TcpStream};
use std::path::Path;
use std::time::Duration;

use coap_lite::{CoapOption, MessageClass, MessageType, Packet, ResponseType};
use edgefleet_shared::codec::{self, DesiredState, DeviceEvent, DeviceReport, EventAck};
use edgefleet_shared::{PropertyValue, ResourceKey, topics};
use edgefleet_sim::fleet::FleetSpec;
use edgefleet_sim::keys::FleetKey;
use edgefleet_sim::model::ModelKind;
use edgefleet_sim::retransmit::RetransmitParams;
use edgefleet_sim::{NodeEndpoint, RunConfig};
use rumqttc::{AsyncClient, Event, MqttOptions, Packet as MqttPacket, QoS};
use rumqttd::{Broker, Config, ConnectionSettings, RouterConfig, ServerSettings};
use tokio::net::UdpSocket;
use tokio::sync::{mpsc, oneshot};
use tokio::time::{Instant, sleep, timeout};

const NODE: &str = "edge-1";
const NAMESPACE: &str = "default";

fn free_tcp_port() -> u16 {
    TcpListener::bind((Ipv4Addr::LOCALHOST, 0))
        .unwrap()
        .local_addr()
        .unwrap()
        .port()
}

/// Starts an MQTT broker on a free port of 127.0.0.1 and waits until it
/// accepts connections.
async fn start_broker() -> u16 {
    let port = free_tcp_port();
    let server = ServerSettings {
        name: "v4-1".into(),
        listen: (Ipv4Addr::LOCALHOST, port).into(),
        tls: None,
        next_connection_delay_ms: 1,
        connections: ConnectionSettings {
            connection_timeout_ms: 5_000,
            max_payload_size: 20_480,
            max_inflight_count: 100,
            auth: None,
            external_auth: None,
            dynamic_filters: true,
        },
    };
    let config = Config {
        router: RouterConfig {
            max_connections: 1_000,
            max_outgoing_packet_count: 200,
            max_segment_size: 1 << 20,
            max_segment_count: 10,
            ..RouterConfig::default()
        },
        v4: Some(HashMap::from([("1".to_owned(), server)])),
        ..Config::default()
    };
    std::thread::spawn(move || Broker::new(config).start().expect("the broker runs"));
    for _ in 0..100 {
        if TcpStream::connect((Ipv4Addr::LOCALHOST, port)).is_ok() {
            return port;
        }
        sleep(Duration::from_millis(50)).await;
    }
    panic!("the broker did not start listening on port {port}");
}

/// A CoAP stand-in for the agent: answers every request with a piggybacked
/// 2.04 and hands over (Uri-Path, report).
async fn start_coap_responder() -> (
    SocketAddr,
    mpsc::UnboundedReceiver<(Vec<String>, DeviceReport)>,
) {
    let socket = UdpSocket::bind((Ipv4Addr::LOCALHOST, 0)).await.unwrap();
    let addr = socket.local_addr().unwrap();
    let (tx, rx) = mpsc::unbounded_channel();
    tokio::spawn(async move {
        let mut buf = vec![0u8; 65_536];
        loop {
            let (len, peer) = socket.recv_from(&mut buf).await.unwrap();
            let request = Packet::from_bytes(&buf[..len]).expect("the simulator sends CoAP");
            assert_eq!(request.header.get_type(), MessageType::Confirmable);
            let path: Vec<String> = request
                .get_option(CoapOption::UriPath)
                .map(|segments| {
                    segments
                        .iter()
                        .map(|s| String::from_utf8(s.clone()).unwrap())
                        .collect()
                })
                .unwrap_or_default();
            let mut ack = Packet::new();
            if path.last().is_some_and(|p| p == "events") {
                // Events are confirmed like the agent does; only reports are
                // handed to the test.
                let event: DeviceEvent = codec::decode(&request.payload).expect("a CBOR event");
                ack.payload = codec::encode(&EventAck {
                    id: event.id,
                    boot: event.boot,
                })
                .unwrap();
            } else {
                let report = codec::decode(&request.payload).expect("a CBOR DeviceReport");
                let _ = tx.send((path, report));
            }
            ack.header.set_type(MessageType::Acknowledgement);
            ack.header.code = MessageClass::Response(ResponseType::Changed);
            ack.header.message_id = request.header.message_id;
            ack.set_token(request.get_token().to_vec());
            socket
                .send_to(&ack.to_bytes().unwrap(), peer)
                .await
                .unwrap();
        }
    });
    (addr, rx)
}

/// A test client on the broker: publishes desired states like the agent and
/// hands over every publish it receives and every PUBACK.
struct TestMqtt {
    client: AsyncClient,
    events: mpsc::UnboundedReceiver<MqttPacket>,
}

impl TestMqtt {
    async fn connect(port: u16) -> Self {
        let (client, mut eventloop) =
            AsyncClient::new(MqttOptions::new("test-agent", "127.0.0.1", port), 64);
        let (tx, events) = mpsc::unbounded_channel();
        tokio::spawn(async move {
            loop {
                match eventloop.poll().await {
                    Ok(Event::Incoming(packet)) => {
                        if tx.send(packet).is_err() {
                            break;
                        }
                    }
                    Ok(_) => {}
                    Err(_) => sleep(Duration::from_millis(100)).await,
                }
            }
        });
        TestMqtt { client, events }
    }

    async fn next_matching<T>(&mut self, mut f: impl FnMut(MqttPacket) -> Option<T>) -> T {
        loop {
            let packet = self.events.recv().await.expect("the test client runs");
            if let Some(found) = f(packet) {
                return found;
            }
        }
    }

    async fn subscribe(&mut self, filter: &str) {
        self.client
            .subscribe(filter, QoS::AtLeastOnce)
            .await
            .unwrap();
        self.next_matching(|p| matches!(p, MqttPacket::SubAck(_)).then_some(()))
            .await;
    }

    /// Publishes a retained desired state and waits until the broker has it.
    async fn publish_desired(&mut self, device: &str, desired: &DesiredState) {
        let topic = topics::desired(NODE, &ResourceKey::device(NAMESPACE, device));
        self.client
            .publish(
                topic,
                QoS::AtLeastOnce,
                true,
                codec::encode(desired).unwrap(),
            )
            .await
            .unwrap();
        self.next_matching(|p| matches!(p, MqttPacket::PubAck(_)).then_some(()))
            .await;
    }
}

/// A simulation of `devices` thermostats on one node.
fn config(
    devices: usize,
    mqtt_every: usize,
    report_interval: Duration,
    coap: SocketAddr,
    mqtt_port: u16,
) -> RunConfig {
    RunConfig {
        fleet: FleetSpec {
            prefix: "dev".into(),
            devices,
            nodes: vec![NODE.into()],
            models: vec![ModelKind::Thermostat],
            mqtt_every,
        },
        namespace: NAMESPACE.into(),
        fleet_key: FleetKey("test".into()),
        insecure_coap_plain: true,
        endpoints: vec![NodeEndpoint {
            name: NODE.into(),
            coap: coap.to_string(),
            mqtt_host: "127.0.0.1".into(),
            mqtt_port,
        }],
        seed: 1,
        report_interval,
        summary_interval: None,
        applied_log: None,
        final_state: None,
        retransmit: RetransmitParams::default(),
        event_every: 0,
        changing_percent: 100,
        firmware: Default::default(),
    }
}

/// Awaits `f` for at most `seconds`.
async fn within<T>(seconds: u64, what: &str, f: impl Future<Output = T>) -> T {
    timeout(Duration::from_secs(seconds), f)
        .await
        .unwrap_or_else(|_| panic!("{what}: not within {seconds} s"))
}

fn desired(generation: i64, props: &[(&str, PropertyValue)]) -> DesiredState {
    DesiredState {
        generation,
        properties: props
            .iter()
            .map(|(k, v)| ((*k).to_owned(), v.clone()))
            .collect(),
        firmware: None,
        local: 0,
    }
}

/// Waits until the applied log has a line for `device` at `generation`.
async fn applied_line(path: &Path, device: &str, generation: i64) -> serde_json::Value {
    loop {
        let text = std::fs::read_to_string(path).unwrap_or_default();
        let found = text
            .lines()
            .map(|line| serde_json::from_str::<serde_json::Value>(line).unwrap())
            .find(|entry| entry["device"] == device && entry["generation"] == generation);
        if let Some(entry) = found {
            return entry;
        }
        sleep(Duration::from_millis(50)).await;
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn devices_apply_desired_states_and_report_over_coap_and_mqtt() {
    timeout(Duration::from_secs(30), scenario())
        .await
        .expect("the scenario finishes in time");
}

async fn scenario() {
    let broker_port = start_broker().await;
    let (coap_addr, mut coap_reports) = start_coap_responder().await;
    let mut agent = TestMqtt::connect(broker_port).await;
    agent
        .subscribe(&format!("{}/{NODE}/{NAMESPACE}/+/report", topics::ROOT))
        .await;

    // Retained before the simulator starts: it must get it on subscribing.
    // The setpoint arrives as an integer, the way the Kubernetes API sends 25.0.
    agent
        .publish_desired(
            "dev-00000",
            &desired(
                1,
                &[
                    ("setpoint", PropertyValue::Int(25)),
                    ("label", PropertyValue::String("lobby".into())),
                ],
            ),
        )
        .await;

    let dir = tempfile::tempdir().unwrap();
    let log = dir.path().join("applied.jsonl");
    // dev-00000 reports over CoAP, dev-00001 over MQTT. The interval is far
    // longer than the test: every report awaited below is one sent at once
    // because a desired state was applied.
    let mut config = config(2, 2, Duration::from_secs(60), coap_addr, broker_port);
    config.applied_log = Some(log.clone());
    let final_state = dir.path().join("final.jsonl");
    config.final_state = Some(final_state.clone());
    let (stop, stopped) = oneshot::channel::<()>();
    let sim = tokio::spawn(edgefleet_sim::run(config, async {
        let _ = stopped.await;
    }));

    let report = within(3, "the CoAP report of generation 1", async {
        loop {
            let (path, report) = coap_reports.recv().await.unwrap();
            assert_eq!(
                path,
                ["d", NAMESPACE, "dev-00000", "report"],
                "only dev-00000 talks CoAP"
            );
            if report.applied_generation == 1 {
                break report;
            }
            assert_eq!(report.applied_generation, 0);
        }
    })
    .await;
    assert_eq!(report.properties["setpoint"], PropertyValue::Float(25.0));
    assert_eq!(
        report.properties["label"],
        PropertyValue::String("lobby".into())
    );
    assert!(report.properties["temperature"].as_f64().is_some());
    assert_eq!(report.firmware_version.as_deref(), Some("1.0.0"));
    let entry = within(3, "the applied-log line", async {
        applied_line(&log, "default/dev-00000", 1).await
    })
    .await;
    assert!(entry["at_ms"].as_u64().unwrap() > 1_600_000_000_000);

    // The MQTT device gets a desired state while running and reports it on
    // its report topic.
    agent
        .publish_desired(
            "dev-00001",
            &desired(2, &[("setpoint", PropertyValue::Float(18.5))]),
        )
        .await;
    let report_topic = topics::report(NODE, &ResourceKey::device(NAMESPACE, "dev-00001"));
    let report: DeviceReport = within(
        3,
        "the MQTT report of generation 2",
        agent.next_matching(|packet| match packet {
            MqttPacket::Publish(p) => {
                assert_eq!(p.topic, report_topic, "only dev-00001 talks MQTT");
                let report: DeviceReport = codec::decode(&p.payload).unwrap();
                (report.applied_generation == 2).then_some(report)
            }
            _ => None,
        }),
    )
    .await;
    assert_eq!(report.properties["setpoint"], PropertyValue::Float(18.5));
    within(3, "the applied-log line", async {
        applied_line(&log, "default/dev-00001", 2).await
    })
    .await;

    stop.send(()).unwrap();
    let summary = sim.await.unwrap().unwrap();
    assert_eq!(summary.devices, 2);
    assert_eq!(summary.desired_applied, 2);
    assert!(summary.reports_acknowledged >= 2, "{summary}");
    assert_eq!(summary.reports_failed, 0, "{summary}");
    assert_eq!(summary.reports_refused(), 0, "{summary}");
    assert_eq!(summary.desired_malformed, 0, "{summary}");

    // The final state names each device's last acknowledged report.
    let finals: Vec<serde_json::Value> = std::fs::read_to_string(&final_state)
        .unwrap()
        .lines()
        .map(|l| serde_json::from_str(l).unwrap())
        .collect();
    assert_eq!(finals.len(), 2, "{finals:?}");
    assert_eq!(finals[0]["device"], "default/dev-00000");
    assert_eq!(finals[0]["report"]["g"], 1, "{finals:?}");
    assert_eq!(finals[1]["device"], "default/dev-00001");
    assert_eq!(finals[1]["report"]["g"], 2, "{finals:?}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn devices_report_at_the_interval_until_their_device_is_deleted() {
    timeout(Duration::from_secs(30), periodic_scenario())
        .await
        .expect("the scenario finishes in time");
}

async fn periodic_scenario() {
    let broker_port = start_broker().await;
    let (coap_addr, mut coap_reports) = start_coap_responder().await;
    let mut agent = TestMqtt::connect(broker_port).await;
    let interval = Duration::from_millis(200);
    let (stop, stopped) = oneshot::channel::<()>();
    let sim = tokio::spawn(edgefleet_sim::run(
        config(1, 0, interval, coap_addr, broker_port),
        async {
            let _ = stopped.await;
        },
    ));

    // With nothing to apply, the device reports generation 0 at the interval.
    let mut arrivals = Vec::new();
    for _ in 0..4 {
        let (_, report) = within(3, "a periodic report", coap_reports.recv())
            .await
            .unwrap();
        assert_eq!(report.applied_generation, 0);
        arrivals.push(Instant::now());
    }
    for pair in arrivals.windows(2) {
        let gap = pair[1] - pair[0];
        assert!(
            gap >= interval.mul_f64(0.75) && gap <= interval * 3,
            "{gap:?} between reports"
        );
    }

    agent.publish_desired("dev-00000", &desired(1, &[])).await;
    within(3, "the report of generation 1", async {
        while coap_reports.recv().await.unwrap().1.applied_generation != 1 {}
    })
    .await;

    // An empty retained message: the Device was deleted; the device goes quiet.
    let topic = topics::desired(NODE, &ResourceKey::device(NAMESPACE, "dev-00000"));
    agent
        .client
        .publish(topic, QoS::AtLeastOnce, true, Vec::new())
        .await
        .unwrap();
    sleep(interval * 2).await;
    while coap_reports.try_recv().is_ok() {}
    sleep(interval * 4).await;
    assert!(
        coap_reports.try_recv().is_err(),
        "a deleted device kept reporting"
    );

    stop.send(()).unwrap();
    let summary = sim.await.unwrap().unwrap();
    assert_eq!(summary.desired_applied, 1, "{summary}");
    assert_eq!(summary.desired_deleted, 1, "{summary}");
    assert!(summary.reports_acknowledged >= 5, "{summary}");
}

/// Many devices on one node, each with a connection of its own: every
/// device gets the desired state retained before it started.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn every_device_of_a_large_node_gets_its_retained_desired_state() {
    const DEVICES: usize = 250;
    let broker_port = start_broker().await;
    let (coap_addr, _coap_reports) = start_coap_responder().await;
    let mut agent = TestMqtt::connect(broker_port).await;
    for i in 0..DEVICES {
        agent
            .publish_desired(
                &format!("dev-{i:05}"),
                &desired(1, &[("setpoint", PropertyValue::Float(20.0))]),
            )
            .await;
    }
    let dir = tempfile::tempdir().unwrap();
    let log = dir.path().join("applied.jsonl");
    let mut config = config(DEVICES, 0, Duration::from_secs(60), coap_addr, broker_port);
    config.applied_log = Some(log.clone());
    let (stop, stopped) = oneshot::channel::<()>();
    let sim = tokio::spawn(edgefleet_sim::run(config, async {
        let _ = stopped.await;
    }));
    within(
        20,
        "every device applied its retained desired state",
        async {
            loop {
                let applied = std::fs::read_to_string(&log)
                    .unwrap_or_default()
                    .lines()
                    .count();
                if applied == DEVICES {
                    break;
                }
                sleep(Duration::from_millis(100)).await;
            }
        },
    )
    .await;
    stop.send(()).unwrap();
    let summary = sim.await.unwrap().unwrap();
    assert_eq!(summary.desired_applied, DEVICES as u64, "{summary}");
}
