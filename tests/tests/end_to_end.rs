//! The whole report path with real processes: `edgefleet-cloud run` against
//! the real API server, `edgefleet-agent` with its store on disk, and a
//! device played by this test over real UDP CoAP.

use std::collections::BTreeMap;
use std::net::SocketAddr;
use std::time::Duration;

use coap_lite::{CoapOption, MessageClass, MessageType, Packet, RequestType, ResponseType};
use edgefleet_shared::PropertyValue;
use edgefleet_shared::api::{Device, DevicePhase, DeviceSpec, Transport};
use edgefleet_shared::codec::{self, DesiredState, DeviceReport};
use edgefleet_tests::process::{Process, free_tcp_addr, free_udp_addr, http_get, metric};
use edgefleet_tests::{control_plane, test_namespace};
use kube::Api;
use kube::api::PostParams;
use tokio::net::UdpSocket;

const PATIENCE: Duration = Duration::from_secs(30);

async fn eventually<T, F, Fut>(what: &str, mut check: F) -> T
where
    F: FnMut() -> Fut,
    Fut: std::future::Future<Output = Option<T>>,
{
    let deadline = tokio::time::Instant::now() + PATIENCE;
    loop {
        if let Some(value) = check().await {
            return value;
        }
        assert!(
            tokio::time::Instant::now() < deadline,
            "timed out waiting until {what}"
        );
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
}

/// A device's side of CoAP: one confirmable request, one response.
struct CoapDevice {
    socket: UdpSocket,
    agent: SocketAddr,
    next_id: u16,
}

impl CoapDevice {
    async fn new(agent: SocketAddr) -> Self {
        CoapDevice {
            socket: UdpSocket::bind("127.0.0.1:0").await.unwrap(),
            agent,
            next_id: 1,
        }
    }

    fn request(&mut self, method: RequestType, path: &str, payload: Vec<u8>) -> Packet {
        let mut packet = Packet::new();
        packet.header.set_version(1);
        packet.header.set_type(MessageType::Confirmable);
        packet.header.code = MessageClass::Request(method);
        packet.header.message_id = self.next_id;
        self.next_id += 1;
        packet.set_token(self.next_id.to_be_bytes().to_vec());
        for segment in path.split('/') {
            packet.add_option(CoapOption::UriPath, segment.as_bytes().to_vec());
        }
        packet.payload = payload;
        packet
    }

    async fn exchange(&self, packet: &Packet) -> Packet {
        let bytes = packet.to_bytes().unwrap();
        let mut buf = vec![0u8; 2048];
        // Retransmit like a device would until the agent answers.
        for _ in 0..20 {
            self.socket.send_to(&bytes, self.agent).await.unwrap();
            if let Ok(Ok((len, _))) =
                tokio::time::timeout(Duration::from_millis(500), self.socket.recv_from(&mut buf))
                    .await
            {
                let response = Packet::from_bytes(&buf[..len]).unwrap();
                assert_eq!(response.header.message_id, packet.header.message_id);
                return response;
            }
        }
        panic!("the agent never answered");
    }

    async fn send(&mut self, method: RequestType, path: &str, payload: Vec<u8>) -> Packet {
        let packet = self.request(method, path, payload);
        self.exchange(&packet).await
    }
}

fn code(packet: &Packet) -> ResponseType {
    match packet.header.code {
        MessageClass::Response(code) => code,
        other => panic!("not a response: {other:?}"),
    }
}

#[tokio::test]
async fn a_device_report_over_coap_reaches_device_status_and_bad_input_is_refused() {
    let cp = control_plane();
    let client = cp.client().await;
    let ns = test_namespace(&client, "e2e-coap").await;
    let node = format!("edge-e2e-{}", std::process::id());
    let tmp = tempfile::tempdir().unwrap();

    let (sync, cloud_metrics) = (free_tcp_addr(), free_tcp_addr());
    let _cloud = Process::start(
        "edgefleet-cloud",
        &[
            "run".into(),
            "--sync-addr".into(),
            sync.to_string(),
            "--metrics-addr".into(),
            cloud_metrics.to_string(),
        ],
        &[("KUBECONFIG", cp.kubeconfig().display().to_string())],
    );
    eventually("the controller is ready", || async {
        matches!(http_get(cloud_metrics, "/readyz").await, Ok((200, _))).then_some(())
    })
    .await;

    let (coap, agent_metrics) = (free_udp_addr(), free_tcp_addr());
    let mut agent = Process::start(
        "edgefleet-agent",
        &[
            format!("--node={node}"),
            format!("--cloud=http://{sync}"),
            format!("--data-dir={}", tmp.path().display()),
            format!("--coap-bind={coap}"),
            format!("--metrics-addr={agent_metrics}"),
        ],
        &[],
    );

    let devices: Api<Device> = Api::namespaced(client.clone(), &ns);
    let spec = DeviceSpec {
        node: node.clone(),
        model: "thermostat".into(),
        transport: Transport::Coap,
        desired: BTreeMap::from([("setpoint".to_owned(), PropertyValue::Float(21.5))]),
        firmware: None,
    };
    devices
        .create(&PostParams::default(), &Device::new("t1", spec))
        .await
        .unwrap();
    eventually("the Device is Delivered", || async {
        let s = devices.get("t1").await.ok()?.status?;
        (s.phase == Some(DevicePhase::Delivered)).then_some(())
    })
    .await;

    // The device reads its desired state over CoAP...
    let mut device = CoapDevice::new(coap).await;
    let path = format!("d/{ns}/t1");
    let response = device
        .send(RequestType::Get, &format!("{path}/desired"), vec![])
        .await;
    assert_eq!(code(&response), ResponseType::Content);
    let desired: DesiredState = codec::decode(&response.payload).unwrap();
    assert_eq!(desired.generation, 1);
    assert_eq!(desired.properties["setpoint"], PropertyValue::Float(21.5));

    // ...applies it and reports; the report is in status once Applied.
    let report = DeviceReport {
        applied_generation: desired.generation,
        properties: BTreeMap::from([
            ("setpoint".to_owned(), PropertyValue::Float(21.5)),
            ("temperature".to_owned(), PropertyValue::Float(19.75)),
        ]),
        firmware_version: Some("1.2.0".into()),
    };
    let response = device
        .send(
            RequestType::Post,
            &format!("{path}/report"),
            codec::encode(&report).unwrap(),
        )
        .await;
    assert_eq!(code(&response), ResponseType::Changed);
    let status = eventually("the Device is Applied with the report", || async {
        let s = devices.get("t1").await.ok()?.status?;
        (s.phase == Some(DevicePhase::Applied)).then_some(s)
    })
    .await;
    assert_eq!(status.reported, report.properties);
    assert_eq!(status.firmware_version.as_deref(), Some("1.2.0"));

    // A retransmission of the same confirmable report is answered again but stored once.
    let retransmitted = device.request(
        RequestType::Post,
        &format!("{path}/report"),
        codec::encode(&report).unwrap(),
    );
    assert_eq!(
        code(&device.exchange(&retransmitted).await),
        ResponseType::Changed
    );
    assert_eq!(
        code(&device.exchange(&retransmitted).await),
        ResponseType::Changed
    );

    // Bad input: each refused with its code, and counted.
    let malformed = device
        .send(
            RequestType::Post,
            &format!("{path}/report"),
            vec![0xff, 0x00, 0x13],
        )
        .await;
    assert_eq!(code(&malformed), ResponseType::BadRequest);
    let unknown = device
        .send(
            RequestType::Post,
            &format!("d/{ns}/nobody/report"),
            codec::encode(&report).unwrap(),
        )
        .await;
    assert_eq!(code(&unknown), ResponseType::NotFound);
    let oversized = device
        .send(
            RequestType::Post,
            &format!("{path}/report"),
            vec![0xa0; codec::MAX_MESSAGE_BYTES + 200],
        )
        .await;
    assert_eq!(code(&oversized), ResponseType::RequestEntityTooLarge);
    let wrong_method = device
        .send(RequestType::Delete, &format!("{path}/report"), vec![])
        .await;
    assert_eq!(code(&wrong_method), ResponseType::MethodNotAllowed);

    // The agent kept serving: a new report still goes all the way up.
    let mut newer = report.clone();
    newer
        .properties
        .insert("temperature".into(), PropertyValue::Float(22.5));
    let response = device
        .send(
            RequestType::Post,
            &format!("{path}/report"),
            codec::encode(&newer).unwrap(),
        )
        .await;
    assert_eq!(code(&response), ResponseType::Changed);
    eventually("status shows the newer report", || async {
        let s = devices.get("t1").await.ok()?.status?;
        (s.reported.get("temperature") == Some(&PropertyValue::Float(22.5))).then_some(())
    })
    .await;
    agent.assert_running();

    let (_, metrics) = http_get(agent_metrics, "/metrics").await.unwrap();
    let count = |outcome: &str| {
        metric(
            &metrics,
            &format!("edgefleet_agent_coap_requests_total{{outcome=\"{outcome}\"}}"),
        )
    };
    assert_eq!(count("stored"), 3.0, "{metrics}");
    assert!(count("duplicate") >= 1.0, "{metrics}");
    assert_eq!(count("malformed"), 1.0, "{metrics}");
    assert_eq!(count("unknown_device"), 1.0, "{metrics}");
    assert_eq!(count("too_large"), 1.0, "{metrics}");
    assert_eq!(count("method_not_allowed"), 1.0, "{metrics}");
    // Gauges refresh once a second.
    eventually(
        "the agent's gauges show the device and an empty outbox",
        || async {
            let (_, m) = http_get(agent_metrics, "/metrics").await.ok()?;
            (metric(&m, "edgefleet_agent_devices") == 1.0
                && metric(&m, "edgefleet_agent_outbox_depth") == 0.0)
                .then_some(())
        },
    )
    .await;
}
