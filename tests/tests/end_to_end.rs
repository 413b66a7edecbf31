//! The whole hierarchy with real processes: `edgefleet-cloud run` against
//! the real API server, `edgefleet-agent` with its store on disk and its
//! site broker (embedded rumqttd, or Debian's Mosquitto started here), and
//! devices played by this test over real UDP CoAP and MQTT.

use std::collections::BTreeMap;
use std::net::SocketAddr;

use coap_lite::{RequestType, ResponseType};
use edgefleet_cloud::device_events::EVENT_BOOT_ANNOTATION;
use edgefleet_shared::api::{Device, DevicePhase, DeviceSpec, Transport};
use edgefleet_shared::codec::{self, DesiredState, DeviceReport};
use edgefleet_shared::{PropertyValue, ResourceKey, topics};
use edgefleet_tests::agent_tokens::{self, AgentPod};
use edgefleet_tests::certs;
use edgefleet_tests::device_client::{CoapDevice, code, give_key, mqtt_device, next_on};
use edgefleet_tests::mosquitto::Mosquitto;
use edgefleet_tests::process::{Process, free_tcp_addr, free_udp_addr, http_get, metric};
use edgefleet_tests::stack::sim_manifests;
use edgefleet_tests::{control_plane, eventually, test_namespace};
use kube::Api;
use kube::api::PostParams;

/// How the agent reaches its site broker.
enum Broker {
    /// The agent's embedded rumqttd, on this port.
    Embedded(SocketAddr),
    /// An external broker (Mosquitto) the test started, and the agent's
    /// flags for it.
    External(SocketAddr, Vec<String>),
}

impl Broker {
    fn addr(&self) -> SocketAddr {
        match self {
            Broker::Embedded(a) | Broker::External(a, _) => *a,
        }
    }
}

/// The controller and one agent as real processes, and a namespace.
struct Site {
    client: kube::Client,
    ns: String,
    node: String,
    coap: SocketAddr,
    agent_metrics: SocketAddr,
    cloud_metrics: SocketAddr,
    broker: Broker,
    agent: Process,
    _cloud: Process,
    _data: tempfile::TempDir,
}

impl Site {
    async fn start(hint: &str, broker: Broker) -> Site {
        let cp = control_plane();
        let client = cp.client().await;
        let ns = test_namespace(&client, hint).await;
        let node = format!("edge-{hint}-{}", std::process::id());
        let data = tempfile::tempdir().unwrap();

        let (sync, cloud_metrics) = (free_tcp_addr(), free_tcp_addr());
        let tls = certs::lab(&data.path().join("tls")).unwrap();
        let mut cloud_args = vec![
            "run".into(),
            format!("--sync-addr={sync}"),
            format!("--metrics-addr={cloud_metrics}"),
            format!("--namespace={ns}"),
        ];
        cloud_args.extend(certs::cloud_args(&tls));
        cloud_args.extend(agent_tokens::cloud_args(&ns));
        let cloud = Process::start(
            "edgefleet-cloud",
            &cloud_args,
            &[("KUBECONFIG", cp.kubeconfig().display().to_string())],
        );
        eventually("the controller is ready", || async {
            matches!(http_get(cloud_metrics, "/readyz").await, Ok((200, _))).then_some(())
        })
        .await;

        let (coap, agent_metrics) = (free_udp_addr(), free_tcp_addr());
        let mqtt = match &broker {
            Broker::Embedded(listen) => vec![format!("--mqtt-listen={listen}")],
            Broker::External(addr, args) => {
                let mut mqtt = vec![format!("--mqtt-url=mqtt://{addr}")];
                mqtt.extend(args.iter().cloned());
                mqtt
            }
        };
        let token_file = data.path().join("token");
        AgentPod::on(&client, &ns, &node)
            .await
            .unwrap()
            .write_token(&token_file)
            .unwrap();
        let mut agent_args = vec![format!("--node={node}")];
        agent_args.extend(certs::agent_args(&tls, sync));
        agent_args.extend([
            format!("--token-file={}", token_file.display()),
            format!("--data-dir={}", data.path().display()),
            format!("--coap-bind={coap}"),
            format!("--metrics-addr={agent_metrics}"),
        ]);
        agent_args.extend(mqtt);
        let agent = Process::start("edgefleet-agent", &agent_args, &[]);
        eventually("the agent is up", || async {
            matches!(http_get(agent_metrics, "/healthz").await, Ok((200, _))).then_some(())
        })
        .await;
        Site {
            client,
            ns,
            node,
            coap,
            agent_metrics,
            cloud_metrics,
            broker,
            agent,
            _cloud: cloud,
            _data: data,
        }
    }

    fn devices(&self) -> Api<Device> {
        Api::namespaced(self.client.clone(), &self.ns)
    }

    async fn create(&self, name: &str, transport: Transport) {
        let spec = DeviceSpec {
            node: self.node.clone(),
            model: "thermostat".into(),
            transport,
            desired: BTreeMap::from([("setpoint".to_owned(), PropertyValue::Float(21.5))]),
            firmware: None,
            retry: 0,
        };
        self.devices()
            .create(&PostParams::default(), &Device::new(name, spec))
            .await
            .unwrap();
        give_key(&self.client, &ResourceKey::device(&self.ns, name)).await;
    }

    async fn wait_for_phase(
        &self,
        name: &str,
        phase: DevicePhase,
    ) -> edgefleet_shared::api::DeviceStatus {
        let devices = self.devices();
        eventually(&format!("{name} is {phase:?}"), || async {
            let s = devices.get(name).await.ok()?.status?;
            (s.phase == Some(phase)).then_some(s)
        })
        .await
    }

    /// An MQTT client playing a device, logged in with its key and
    /// subscribed to its desired topic.
    async fn mqtt_device(&self, name: &str) -> (rumqttc::AsyncClient, rumqttc::EventLoop, String) {
        let key = ResourceKey::device(&self.ns, name);
        let (client, events) = mqtt_device(self.broker.addr(), &key).await;
        let topic = topics::desired(&self.node, &key);
        client
            .subscribe(&topic, rumqttc::QoS::AtLeastOnce)
            .await
            .unwrap();
        (client, events, topic)
    }
}

#[tokio::test]
async fn a_device_report_over_coap_reaches_device_status_and_bad_input_is_refused() {
    let mut site = Site::start("e2e-coap", Broker::Embedded(free_tcp_addr())).await;
    let (ns, coap, agent_metrics) = (site.ns.clone(), site.coap, site.agent_metrics);
    let devices = site.devices();
    site.create("t1", Transport::Coap).await;
    site.wait_for_phase("t1", DevicePhase::Delivered).await;

    // Desired state is also on the embedded broker, retained.
    let (_mqtt, mut mqtt_events, desired_topic) = site.mqtt_device("t1").await;
    let retained: DesiredState =
        codec::decode(&next_on(&mut mqtt_events, &desired_topic).await).unwrap();
    assert_eq!(retained.generation, 1);

    // The device reads its desired state over CoAP...
    let mut device = CoapDevice::new(coap, &ResourceKey::device(&ns, "t1")).await;
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
        firmware_failure: None,
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
    // Its DTLS session is t1's: another device's resources are not its.
    let other = device
        .send(
            RequestType::Post,
            &format!("d/{ns}/nobody/report"),
            codec::encode(&report).unwrap(),
        )
        .await;
    assert_eq!(code(&other), ResponseType::Forbidden);
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
    site.agent.assert_running();

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
    assert_eq!(count("forbidden"), 1.0, "{metrics}");
    assert_eq!(
        metric(
            &metrics,
            "edgefleet_agent_coap_dtls_total{outcome=\"established\"}"
        ),
        1.0,
        "{metrics}"
    );
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

    // The agent proved its node with its pod's token, over TLS.
    let (_, metrics) = http_get(site.cloud_metrics, "/metrics").await.unwrap();
    let sync = |name: &str, outcome: &str| {
        metric(
            &metrics,
            &format!("edgefleet_cloud_sync_{name}_total{{outcome=\"{outcome}\"}}"),
        )
    };
    assert!(sync("authentications", "token") >= 1.0, "{metrics}");
    assert!(sync("connections", "tls") >= 1.0, "{metrics}");
    assert_eq!(sync("authentications", "trusted_hello"), 0.0, "{metrics}");
}

#[tokio::test]
async fn with_mosquitto_an_mqtt_device_gets_desired_state_and_its_reports_reach_status() {
    let broker_dir = tempfile::tempdir().unwrap();
    // With the logins and ACLs of the files the agent keeps.
    let mosquitto = Mosquitto::start_authenticated(broker_dir.path());
    mosquitto.wait_listening().await;
    let broker = mosquitto.addr;
    let site = Site::start(
        "e2e-mosquitto",
        Broker::External(broker, mosquitto.agent_args()),
    )
    .await;
    let devices = site.devices();
    let key = ResourceKey::device(&site.ns, "m1");
    site.create("m1", Transport::Mqtt).await;
    site.wait_for_phase("m1", DevicePhase::Delivered).await;

    // The device gets its retained desired state on connect...
    let (device, mut events, desired_topic) = site.mqtt_device("m1").await;
    let desired: DesiredState = codec::decode(&next_on(&mut events, &desired_topic).await).unwrap();
    assert_eq!(desired.generation, 1);

    // ...applies it and reports over MQTT; status shows it.
    let report = DeviceReport {
        applied_generation: desired.generation,
        properties: BTreeMap::from([("temperature".to_owned(), PropertyValue::Float(18.5))]),
        firmware_version: Some("2.0.1".into()),
        firmware_failure: None,
    };
    device
        .publish(
            topics::report(&site.node, &key),
            rumqttc::QoS::AtLeastOnce,
            false,
            codec::encode(&report).unwrap(),
        )
        .await
        .unwrap();
    let pump = async {
        loop {
            let _ = events.poll().await;
        }
    };
    let status = tokio::select! {
        s = site.wait_for_phase("m1", DevicePhase::Applied) => s,
        () = pump => unreachable!(),
    };
    assert_eq!(status.reported, report.properties);
    assert_eq!(status.firmware_version.as_deref(), Some("2.0.1"));

    // Mosquitto takes only the logins the agent wrote into its files: the
    // agent's own and m1's key (written at start and when m1's key came).
    let wrong = edgefleet_shared::credential::Psk::new(b"not-m1s-key-0123456789".to_vec()).unwrap();
    let host = broker.ip().to_string();
    let options = edgefleet_sim::mqtt::login(&key, &wrong, &host, broker.port());
    let (_client, mut refused) = rumqttc::AsyncClient::new(options, 8);
    let answer = refused.poll().await;
    assert!(
        matches!(answer, Err(rumqttc::ConnectionError::ConnectionRefused(_))),
        "a wrong key: {answer:?}"
    );
    let (_, metrics) = http_get(site.agent_metrics, "/metrics").await.unwrap();
    let written = metric(
        &metrics,
        "edgefleet_agent_mqtt_mosquitto_files_total{outcome=\"written\"}",
    );
    assert!(written >= 2.0, "{metrics}");

    // A spec change reaches the device as generation 2.
    let patch = serde_json::json!({ "spec": { "desired": { "setpoint": 17.5 } } });
    devices
        .patch(
            "m1",
            &kube::api::PatchParams::default(),
            &kube::api::Patch::Merge(&patch),
        )
        .await
        .unwrap();
    let update: DesiredState = loop {
        let d: DesiredState = codec::decode(&next_on(&mut events, &desired_topic).await).unwrap();
        if d.generation == 2 {
            break d;
        }
    };
    assert_eq!(update.properties["setpoint"].as_f64(), Some(17.5));

    // Deleting the Device clears its retained topic.
    devices.delete("m1", &Default::default()).await.unwrap();
    loop {
        if next_on(&mut events, &desired_topic).await.is_empty() {
            break;
        }
    }
}

#[tokio::test]
async fn simulated_devices_apply_their_desired_state_and_report_it_back() {
    let mqtt = free_tcp_addr();
    let site = Site::start("e2e-sim", Broker::Embedded(mqtt)).await;
    let devices = site.devices();

    // The simulator prints the Device resources of its fleet layout, so the
    // resources and the simulated devices agree: 6 devices, every third on MQTT.
    let fleet = [
        "--namespace".to_owned(),
        site.ns.clone(),
        "--devices=6".into(),
        "--mqtt-every=3".into(),
    ];
    let mut listing = fleet.to_vec();
    listing.push(format!("--node={}", site.node));
    let manifests = sim_manifests(&listing).unwrap();
    assert_eq!(manifests.devices.len(), 6);
    assert_eq!(
        manifests
            .devices
            .iter()
            .filter(|d| d.spec.transport == Transport::Mqtt)
            .count(),
        2
    );
    // Each with its key, which the simulator logs in with.
    assert_eq!(manifests.secrets.len(), 6);
    let secrets: Api<k8s_openapi::api::core::v1::Secret> =
        Api::namespaced(site.client.clone(), &site.ns);
    for secret in &manifests.secrets {
        secrets
            .create(&PostParams::default(), secret)
            .await
            .unwrap();
    }
    for device in &manifests.devices {
        devices
            .create(&PostParams::default(), device)
            .await
            .unwrap();
    }

    let applied_log = site._data.path().join("applied.jsonl");
    let mut args = vec!["run".to_owned()];
    args.extend(fleet);
    args.extend([
        format!("--node={}={},{}", site.node, site.coap, mqtt),
        "--report-interval=2s".into(),
        format!("--applied-log={}", applied_log.display()),
    ]);
    let _sim = Process::start("edgefleet-sim", &args, &[]);

    let all_applied = || async {
        let list = devices.list(&Default::default()).await.ok()?;
        let applied = list.items.iter().all(|d| {
            let s = d.status.clone().unwrap_or_default();
            s.phase == Some(DevicePhase::Applied) && s.applied_generation == d.metadata.generation
        });
        (list.items.len() == 6 && applied).then_some(list)
    };
    let list = eventually(
        "every simulated device has applied its desired state",
        all_applied,
    )
    .await;
    let thermostat = list
        .items
        .iter()
        .find(|d| d.spec.model == "thermostat")
        .unwrap();
    let name = thermostat.metadata.name.clone().unwrap();

    // A new setpoint travels down, is applied, and comes back in status.
    let patch = serde_json::json!({ "spec": { "desired": { "setpoint": 24.5 } } });
    devices
        .patch(
            &name,
            &kube::api::PatchParams::default(),
            &kube::api::Patch::Merge(&patch),
        )
        .await
        .unwrap();
    eventually(
        "the thermostat applied generation 2 and reports the new setpoint",
        || async {
            let s = devices.get(&name).await.ok()?.status?;
            let setpoint = s.reported.get("setpoint").and_then(PropertyValue::as_f64);
            (s.applied_generation == Some(2) && setpoint == Some(24.5)).then_some(())
        },
    )
    .await;
    // Every simulated device came in through the guard with its own key
    // (the agent's default). (A login may also have been refused: a device
    // that connected before its key reached the agent tries again.)
    let (_, metrics) = http_get(site.agent_metrics, "/metrics").await.unwrap();
    let accepted = metric(
        &metrics,
        "edgefleet_agent_mqtt_guard_logins_total{outcome=\"accepted\"}",
    );
    assert!(accepted >= 6.0, "{accepted} logins accepted");
    let log = std::fs::read_to_string(&applied_log).unwrap();
    assert!(
        log.lines()
            .any(|l| l.contains(&format!("/{name}\"")) && l.contains("\"generation\":2")),
        "the applied log lacks {name} at generation 2:\n{log}"
    );

    // A firmware install reboots every device (one CoAP, one MQTT): it
    // counts its event ids from 1 again under a new boot epoch, and its
    // FirmwareInstalled event still becomes a Kubernetes Event (with "the
    // highest id seen" alone the agent took it for a resend and dropped it).
    let installed: Vec<String> = list
        .items
        .iter()
        .filter(|d| d.spec.model != "thermostat")
        .map(|d| (d.spec.transport, d.metadata.name.clone().unwrap()))
        .fold(
            Vec::new(),
            |mut picked: Vec<(Transport, String)>, (transport, name)| {
                if !picked.iter().any(|(t, _)| *t == transport) {
                    picked.push((transport, name));
                }
                picked
            },
        )
        .into_iter()
        .map(|(_, name)| name)
        .collect();
    assert_eq!(installed.len(), 2, "one CoAP and one MQTT device");
    let firmware = serde_json::json!({ "spec": { "firmware": {
        "version": "9.0.0",
        "url": "https://firmware.example/9.0.0.bin",
        "sha256": "9f86d081884c7d659a2feaa0c55ad015a3bf4f1b2b0b822cd15d6c15b0f00a08",
    } } });
    for name in &installed {
        devices
            .patch(
                name,
                &kube::api::PatchParams::default(),
                &kube::api::Patch::Merge(&firmware),
            )
            .await
            .unwrap();
    }
    let events: Api<k8s_openapi::api::events::v1::Event> =
        Api::namespaced(site.client.clone(), &site.ns);
    let list_events = || async {
        let list = events.list(&Default::default()).await.ok()?;
        let installed_events: Vec<(String, String)> = list
            .items
            .iter()
            .filter(|e| e.reason.as_deref() == Some("FirmwareInstalled"))
            .filter_map(|e| {
                let name = e.regarding.as_ref()?.name.clone()?;
                let boot = e
                    .metadata
                    .annotations
                    .as_ref()?
                    .get(EVENT_BOOT_ANNOTATION)?;
                Some((name, boot.clone()))
            })
            .collect();
        installed
            .iter()
            .all(|name| installed_events.iter().any(|(n, _)| n == name))
            .then_some(installed_events)
    };
    let installed_events = eventually(
        "each rebooted device's FirmwareInstalled event (id 1 of a new boot) is a Kubernetes Event",
        list_events,
    )
    .await;
    let ids = edgefleet_tests::edge_events::device_event_ids(&site.client, &site.ns)
        .await
        .unwrap();
    for name in &installed {
        let boots: std::collections::BTreeSet<u64> =
            ids[name].iter().map(|(boot, _)| *boot).collect();
        assert!(
            boots.len() >= 2 && ids[name].iter().filter(|(_, id)| *id == 1).count() >= 2,
            "{name}: events of two boots, each from id 1: {:?} ({installed_events:?})",
            ids[name]
        );
    }
}
