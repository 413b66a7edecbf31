//! The Device resources of a fleet, for `kubectl apply -f -`.
//!
//! Built from the shared API types, so they match the installed CRD; printed
//! as JSON documents separated by `---` (JSON is YAML).

use std::io::{self, Write};

use edgefleet_shared::api::{Device, DeviceSpec};

use crate::fleet::DeviceSlot;

/// The label every simulated Device carries (value `"true"`), so a
/// selector (`kubectl get dev -l edgefleet.io/simulated`, a rollout's)
/// can pick the simulated fleet.
pub const SIMULATED_LABEL: &str = "edgefleet.io/simulated";

/// The label with a simulated Device's model (`thermostat`, `valve`,
/// `meter`), for selectors such as an EdgeRule's.
pub const MODEL_LABEL: &str = "edgefleet.io/model";

/// The Device resource for one slot, with its model's default desired state.
pub fn device(namespace: &str, slot: &DeviceSlot) -> Device {
    let mut device = Device::new(
        &slot.name,
        DeviceSpec {
            node: slot.node.clone(),
            model: slot.model.as_str().to_owned(),
            transport: slot.transport,
            desired: slot.model.default_desired(),
            firmware: None,
            retry: 0,
        },
    );
    device.metadata.namespace = Some(namespace.to_owned());
    device.metadata.labels = Some(
        [
            (SIMULATED_LABEL.to_owned(), "true".to_owned()),
            (MODEL_LABEL.to_owned(), slot.model.as_str().to_owned()),
        ]
        .into(),
    );
    device
}

/// Writes one document per slot: `---`, then the Device as one JSON line.
pub fn write_devices<W: Write>(
    out: &mut W,
    namespace: &str,
    slots: &[DeviceSlot],
) -> io::Result<()> {
    for slot in slots {
        writeln!(out, "---")?;
        serde_json::to_writer(&mut *out, &device(namespace, slot))?;
        writeln!(out)?;
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use edgefleet_shared::api::Transport;
    use serde_json::json;

    use super::*;
    use crate::model::ModelKind;

    fn slot(index: usize, model: ModelKind, transport: Transport) -> DeviceSlot {
        DeviceSlot {
            index,
            name: format!("dev-{index:05}"),
            node: "edge-1".into(),
            model,
            transport,
        }
    }

    #[test]
    fn a_device_resource_has_the_slot_and_the_model_defaults() {
        let value = serde_json::to_value(device(
            "plant",
            &slot(0, ModelKind::Thermostat, Transport::Coap),
        ))
        .unwrap();
        assert_eq!(
            value,
            json!({
                "apiVersion": "edgefleet.io/v1alpha1",
                "kind": "Device",
                "metadata": {
                    "name": "dev-00000",
                    "namespace": "plant",
                    "labels": {
                        "edgefleet.io/simulated": "true",
                        "edgefleet.io/model": "thermostat",
                    },
                },
                "spec": {
                    "node": "edge-1",
                    "model": "thermostat",
                    "transport": "coap",
                    "desired": {"setpoint": 21.0, "mode": "auto"},
                }
            })
        );
    }

    #[test]
    fn documents_are_separated_and_each_is_json() {
        let slots = [
            slot(0, ModelKind::Valve, Transport::Mqtt),
            slot(1, ModelKind::Meter, Transport::Coap),
        ];
        let mut out = Vec::new();
        write_devices(&mut out, "default", &slots).unwrap();
        let text = String::from_utf8(out).unwrap();
        let docs: Vec<serde_json::Value> = text
            .split("---\n")
            .filter(|d| !d.is_empty())
            .map(|d| serde_json::from_str(d).unwrap())
            .collect();
        assert_eq!(docs.len(), 2);
        assert_eq!(docs[0]["spec"]["transport"], "mqtt");
        assert_eq!(docs[0]["spec"]["desired"], json!({"open": false}));
        assert_eq!(docs[1]["metadata"]["name"], "dev-00001");
        // A meter has nothing writable: no desired map at all.
        assert!(docs[1]["spec"].get("desired").is_none());
        // And what was printed reads back as a Device.
        let back: Device = serde_json::from_value(docs[1].clone()).unwrap();
        assert_eq!(back.spec.model, "meter");
    }
}
