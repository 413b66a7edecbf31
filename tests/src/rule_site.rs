//! A site for EdgeRule tests and benchmarks: the controller and one agent
//! as processes (its sync link through a proxy), a boiler played over CoAP
//! and an inlet valve played over MQTT, and a rule between them.

use std::collections::BTreeMap;
use std::time::Duration;

use coap_lite::{RequestType, ResponseType};
use edgefleet_shared::api::{Device, DeviceSpec, EdgeRule, Transport};
use edgefleet_shared::codec::{self, DesiredState, DeviceReport};
use edgefleet_shared::{PropertyValue, ResourceKey, topics};
use kube::api::PostParams;
use kube::{Api, Client};
use serde_json::json;

use crate::device_client::{CoapDevice, code, give_key, mqtt_device, next_on};
use crate::edge_events::device_event_ids;
use crate::stack::{Stack, StackSpec};
use crate::{control_plane, create_with_spec, eventually, test_namespace};

/// The site's one edge node.
pub const NODE: &str = "edge-1";

/// A site with one agent whose sync link goes through a proxy, a boiler
/// (CoAP, played by the test) and an inlet valve (MQTT, played by the
/// test), and the rule "boiler over 80 °C closes the inlet".
#[allow(missing_debug_implementations)] // rumqttc's EventLoop has no Debug
pub struct Site {
    /// A client of the API server.
    pub client: Client,
    /// The namespace of the Devices and rules.
    pub ns: String,
    /// The controller and the agent.
    pub stack: Stack,
    /// The boiler's CoAP socket.
    pub boiler: CoapDevice,
    /// The valve's MQTT client and its event loop.
    pub valve: (rumqttc::AsyncClient, rumqttc::EventLoop),
    /// Where the valve is told its desired state.
    pub valve_topic: String,
    _dir: tempfile::TempDir,
}

impl Site {
    /// Starts the site with `rule` as EdgeRule `overheat`.
    pub async fn start(hint: &str, rule: serde_json::Value) -> Site {
        let cp = control_plane();
        let client: Client = cp.client().await;
        let ns = test_namespace(&client, hint).await;
        let dir = tempfile::tempdir().unwrap();
        let spec = StackSpec {
            nodes: vec![NODE.to_owned()],
            namespace: ns.clone(),
            devices: 0,
            status_writes_per_second: 100,
            dir: dir.path().to_owned(),
            namespaced_controller: true,
            sync_through_proxy: true,
            ..StackSpec::default()
        };
        let stack = Stack::start(spec, cp.kubeconfig()).await.unwrap();
        let devices: Api<Device> = Api::namespaced(client.clone(), &ns);
        for (name, model, transport, role, desired) in [
            (
                "boiler",
                "thermostat",
                Transport::Coap,
                "boiler",
                BTreeMap::new(),
            ),
            (
                "inlet",
                "valve",
                Transport::Mqtt,
                "inlet-valve",
                BTreeMap::from([("open".to_owned(), PropertyValue::Bool(true))]),
            ),
        ] {
            let mut device = Device::new(
                name,
                DeviceSpec {
                    node: NODE.to_owned(),
                    model: model.into(),
                    transport,
                    desired,
                    firmware: None,
                    retry: 0,
                },
            );
            device.metadata.labels = Some([("role".to_owned(), role.to_owned())].into());
            devices
                .create(&PostParams::default(), &device)
                .await
                .unwrap();
            give_key(&client, &ResourceKey::device(&ns, name)).await;
        }
        create_with_spec::<EdgeRule>(&client, &ns, "overheat", rule)
            .await
            .unwrap();
        eventually("the agent holds both devices and the rule", || async {
            let devices = stack.agent_metric(0, "edgefleet_agent_devices").await;
            let rules = stack.agent_metric(0, "edgefleet_agent_rules").await;
            (devices == 2.0 && rules == 1.0).then_some(())
        })
        .await;
        let agent = &stack.agents[0];
        let valve_key = ResourceKey::device(&ns, "inlet");
        let valve_topic = topics::desired(NODE, &valve_key);
        let (mqtt, events) = mqtt_device(agent.mqtt, &valve_key).await;
        mqtt.subscribe(&valve_topic, rumqttc::QoS::AtLeastOnce)
            .await
            .unwrap();
        let boiler = CoapDevice::new(agent.coap, &ResourceKey::device(&ns, "boiler")).await;
        let mut site = Site {
            client,
            ns,
            stack,
            boiler,
            valve: (mqtt, events),
            valve_topic,
            _dir: dir,
        };
        // The retained desired state: the spec's, open.
        let first = site.valve_told().await;
        assert_eq!(first.properties["open"], PropertyValue::Bool(true));
        assert_eq!(first.local, 0);
        site
    }

    /// The boiler reports `temperature` over CoAP; the agent has it
    /// durably when this returns.
    pub async fn boiler_reports(&mut self, temperature: f64) {
        let report = DeviceReport {
            applied_generation: 1,
            properties: BTreeMap::from([(
                "temperature".to_owned(),
                PropertyValue::Float(temperature),
            )]),
            firmware_version: Some("1.0.0".into()),
            firmware_failure: None,
        };
        let path = format!("d/{}/boiler/report", self.ns);
        let response = self
            .boiler
            .send(RequestType::Post, &path, codec::encode(&report).unwrap())
            .await;
        assert_eq!(code(&response), ResponseType::Changed);
    }

    /// The valve reports whether it is open, over MQTT; returns once the
    /// broker has it.
    pub async fn valve_reports(&mut self, open: bool) {
        let report = DeviceReport {
            applied_generation: 1,
            properties: BTreeMap::from([("open".to_owned(), PropertyValue::Bool(open))]),
            firmware_version: Some("1.0.0".into()),
            firmware_failure: None,
        };
        let topic = topics::report(NODE, &ResourceKey::device(&self.ns, "inlet"));
        self.valve
            .0
            .publish(
                topic,
                rumqttc::QoS::AtLeastOnce,
                false,
                codec::encode(&report).unwrap(),
            )
            .await
            .unwrap();
        let acked = async {
            loop {
                if let Ok(rumqttc::Event::Incoming(rumqttc::Packet::PubAck(_))) =
                    self.valve.1.poll().await
                {
                    return;
                }
            }
        };
        tokio::time::timeout(Duration::from_secs(10), acked)
            .await
            .expect("the broker acknowledged the valve's report");
    }

    /// The valve Device's status overrides: (rule, value, in force).
    pub async fn valve_overrides(&self) -> Vec<(String, PropertyValue, bool)> {
        let devices: Api<Device> = Api::namespaced(self.client.clone(), &self.ns);
        devices
            .get("inlet")
            .await
            .ok()
            .and_then(|d| d.status)
            .map(|s| {
                s.overrides
                    .into_iter()
                    .map(|o| (o.rule, o.value, o.in_force))
                    .collect()
            })
            .unwrap_or_default()
    }

    /// The next desired state the valve is told.
    pub async fn valve_told(&mut self) -> DesiredState {
        codec::decode(&next_on(&mut self.valve.1, &self.valve_topic).await).unwrap()
    }

    /// The Overheat events of the boiler in Kubernetes, as ids, repeats kept.
    pub async fn overheat_events(&self) -> Vec<(u64, u64)> {
        device_event_ids(&self.client, &self.ns)
            .await
            .unwrap()
            .remove("boiler")
            .unwrap_or_default()
    }
}

/// The rule: a boiler over 80 °C closes the inlet valve (priority 100,
/// restores, a Warning event `Overheat`).
pub fn overheat_rule(for_seconds: u32) -> serde_json::Value {
    json!({
        "selector": { "matchLabels": { "role": "boiler" } },
        "when": "reported.temperature > 80.0",
        "forSeconds": for_seconds,
        "priority": 100,
        "then": {
            "set": { "open": false },
            "target": { "matchLabels": { "role": "inlet-valve" } },
            "event": { "reason": "Overheat", "message": "closing the inlet", "warning": true },
        },
        "restore": true,
    })
}
