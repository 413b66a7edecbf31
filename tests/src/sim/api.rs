//! The simulated API server: Devices with uid, generation, node and a
//! status changed by the controller's own rules (`next_status`), the
//! devices' Events by name, and the churn a fleet update causes — creates,
//! spec changes, deletes, delete-and-recreate under the same name, moves
//! between nodes, specs the agent refuses.

use std::collections::{BTreeMap, BTreeSet};
use std::sync::Arc;

use edgefleet_cloud::device_events::DeviceEvent;
use edgefleet_cloud::index::{Indexed, NodeSlice};
use edgefleet_cloud::status::{StatusChange, next_status};
use edgefleet_cloud::sync::Holdings;
use edgefleet_shared::api::{Device, DeviceSpec, DeviceStatus, Transport};
use edgefleet_shared::{PropertyValue, ResourceKey, ResourceVersion, proto};
use k8s_openapi::jiff::Timestamp;
use rand::RngExt;
use rand_chacha::ChaCha8Rng;

/// The namespace of every simulated Device.
const NAMESPACE: &str = "sim";

/// One Device as the API server stores it.
#[derive(Clone, Debug, PartialEq)]
pub struct SimDevice {
    /// `metadata.uid`.
    pub uid: String,
    /// `metadata.generation`.
    pub generation: i64,
    /// `spec.node`.
    pub node: String,
    /// False for a spec the agent must refuse (the simulator sends it with
    /// no transport, which no agent accepts).
    pub valid: bool,
    /// Its status.
    pub status: DeviceStatus,
}

impl SimDevice {
    /// Its version as the sync protocol tracks it.
    pub fn version(&self) -> ResourceVersion {
        ResourceVersion::new(self.uid.clone(), self.generation)
    }
}

/// The Devices, by key, and the devices' Events.
#[derive(Clone, Debug, Default)]
pub struct Api {
    /// Every Device.
    pub devices: BTreeMap<ResourceKey, SimDevice>,
    /// Device Events by name: their message.
    pub events: BTreeMap<String, String>,
    /// Devices (by uid) that ever moved to another node: what their old
    /// node had not sent up yet is refused there, by design.
    pub moved: BTreeSet<String>,
    next_uid: u64,
}

/// A change the simulator made, for the trace.
pub type Churn = String;

impl Api {
    /// A Device as kube-rs would read it, for the controller's own
    /// conversions.
    fn device(key: &ResourceKey, d: &SimDevice) -> Device {
        let mut device = Device::new(
            &key.name,
            DeviceSpec {
                node: d.node.clone(),
                model: "thermostat".into(),
                transport: Transport::Coap,
                desired: BTreeMap::new(),
                firmware: None,
                retry: 0,
            },
        );
        device.metadata.namespace = Some(key.namespace.clone());
        device.metadata.uid = Some(d.uid.clone());
        device.metadata.generation = Some(d.generation);
        device.status = Some(d.status.clone());
        device
    }

    /// What the controller's index holds for `node`, built by the
    /// controller's own conversion.
    pub fn slice(&self, node: &str) -> NodeSlice {
        self.devices
            .iter()
            .filter(|(_, d)| d.node == node)
            .filter_map(|(key, d)| {
                let (key, mut entry) = Indexed::from_device(&Self::device(key, d))?;
                if !d.valid
                    && let proto::resource::Body::Device(desired) = &mut entry.body
                {
                    desired.transport = proto::Transport::Unspecified as i32;
                }
                Some((key, Arc::new(entry)))
            })
            .collect()
    }

    /// What the Devices' statuses say was delivered to `node`, by the
    /// controller's own reading of them.
    pub fn delivered_to(&self, node: &str) -> Holdings {
        let devices: Vec<Device> = self
            .devices
            .iter()
            .map(|(k, d)| Self::device(k, d))
            .collect();
        edgefleet_cloud::agents::delivered_to(node, &devices)
    }

    /// A status write of `change`, by the controller's rules: it changes
    /// only the object it is about (a recreated Device is another object),
    /// never moves a generation back, and never shows an older report of
    /// a store over a newer one. A status that then shows a report about
    /// another object is a violation.
    pub fn write_status(&mut self, key: &ResourceKey, change: StatusChange) -> Result<(), String> {
        let Some(d) = self.devices.get_mut(key) else {
            return Ok(());
        };
        d.status = next_status(
            &d.status,
            &[change],
            &d.uid,
            d.generation,
            Timestamp::UNIX_EPOCH,
        );
        match d.status.reported.get("about") {
            Some(PropertyValue::String(about)) if *about != d.uid => Err(format!(
                "the status of {key} ({}) shows a report about {about}",
                d.uid
            )),
            _ => Ok(()),
        }
    }

    /// Creates a device's Event, named as the controller names it; a name
    /// that exists already is a resend (409 AlreadyExists), which must
    /// carry the same event.
    pub fn create_event(&mut self, event: &DeviceEvent) -> Result<(), String> {
        let (_, object) = edgefleet_cloud::device_events::device_event(event);
        let name = object.metadata.name.unwrap_or_default();
        let note = object.note.unwrap_or_default();
        match self.events.get(&name) {
            None => {
                self.events.insert(name, note);
                Ok(())
            }
            Some(existing) if *existing == note => Ok(()),
            Some(existing) => Err(format!(
                "Event {name} holds {existing:?}, so {note:?} was never shown"
            )),
        }
    }

    /// The name of the Event of a device's event.
    pub fn event_name(key: &ResourceKey, uid: &str, boot: u64, id: u64) -> String {
        let event = DeviceEvent {
            device: key.clone(),
            uid: uid.to_owned(),
            node: String::new(),
            id,
            boot,
            warning: false,
            reason: "SelfCheck".into(),
            message: String::new(),
            at_ms: 0,
        };
        let (_, object) = edgefleet_cloud::device_events::device_event(&event);
        object.metadata.name.unwrap_or_default()
    }

    fn new_uid(&mut self) -> String {
        self.next_uid += 1;
        format!("uid-{}", self.next_uid)
    }

    /// One random change among `names` Device names and `nodes`.
    pub fn churn(&mut self, rng: &mut ChaCha8Rng, names: usize, nodes: &[String]) -> Churn {
        let key = ResourceKey::device(NAMESPACE, format!("d{}", rng.random_range(0..names)));
        let node = nodes[rng.random_range(0..nodes.len())].clone();
        // Most specs are valid; a few are refused by the agent.
        let valid = rng.random_bool(0.9);
        let Some(existing) = self.devices.get(&key).cloned() else {
            let uid = self.new_uid();
            let device = SimDevice {
                uid,
                generation: 1,
                node,
                valid,
                status: DeviceStatus::default(),
            };
            let text = format!(
                "create {key} {} on {} valid={valid}",
                device.version(),
                device.node
            );
            self.devices.insert(key, device);
            return text;
        };
        match rng.random_range(0..10) {
            0..=3 => {
                let d = self.devices.get_mut(&key).expect("exists");
                d.generation += 1;
                d.valid = valid;
                format!("update {key} to {} valid={valid}", d.version())
            }
            4..=5 => {
                self.devices.remove(&key);
                format!("delete {key} ({})", existing.version())
            }
            6..=7 => {
                let uid = self.new_uid();
                let device = SimDevice {
                    uid,
                    generation: 1,
                    node: if rng.random_bool(0.5) {
                        existing.node.clone()
                    } else {
                        node
                    },
                    valid,
                    status: DeviceStatus::default(),
                };
                let text = format!(
                    "recreate {key} ({} -> {}) on {}",
                    existing.version(),
                    device.version(),
                    device.node
                );
                self.devices.insert(key, device);
                text
            }
            _ => {
                let d = self.devices.get_mut(&key).expect("exists");
                // Moving a Device changes its spec: a new generation.
                d.generation += 1;
                d.node = node;
                self.moved.insert(d.uid.clone());
                format!("move {key} to {} at {}", d.node, d.version())
            }
        }
    }
}
