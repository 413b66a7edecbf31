//! The Device resources of a fleet and the Secrets with their keys, for
//! `kubectl apply -f -`.
//!
//! Built from the shared API types, so they match the installed CRD; printed
//! as JSON documents separated by `---` (JSON is YAML).

use std::io::{self, Write};

use edgefleet_shared::ResourceKey;
use edgefleet_shared::api::{Device, DeviceSpec};
use edgefleet_shared::credential::{self, Psk};
use k8s_openapi::ByteString;
use k8s_openapi::api::core::v1::Secret;
use k8s_openapi::apimachinery::pkg::apis::meta::v1::ObjectMeta;

use crate::fleet::DeviceSlot;
use crate::keys;

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

/// The Secret with `device`'s key `psk`: named `<device>-psk`, of the
/// device-key type, labelled with the Device's name.
pub fn key_secret(device: &ResourceKey, psk: &Psk) -> Secret {
    Secret {
        metadata: ObjectMeta {
            name: Some(format!("{}-psk", device.name)),
            namespace: Some(device.namespace.clone()),
            labels: Some(
                [
                    (credential::DEVICE_LABEL.to_owned(), device.name.clone()),
                    (SIMULATED_LABEL.to_owned(), "true".to_owned()),
                ]
                .into(),
            ),
            ..ObjectMeta::default()
        },
        type_: Some(credential::SECRET_TYPE.to_owned()),
        data: Some(
            [(
                credential::PSK_KEY.to_owned(),
                ByteString(psk.as_bytes().to_vec()),
            )]
            .into(),
        ),
        ..Secret::default()
    }
}

/// Writes the documents of each slot, each as `---` and one JSON line: the
/// Device, then the Secret with its key (derived from `fleet_key`).
pub fn write_devices<W: Write>(
    out: &mut W,
    namespace: &str,
    slots: &[DeviceSlot],
    fleet_key: &keys::FleetKey,
) -> io::Result<()> {
    for slot in slots {
        let key = ResourceKey::device(namespace, &slot.name);
        let secret = key_secret(&key, &keys::device_key(fleet_key, &key));
        writeln!(out, "---")?;
        serde_json::to_writer(&mut *out, &device(namespace, slot))?;
        writeln!(out, "\n---")?;
        serde_json::to_writer(&mut *out, &secret)?;
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
        write_devices(&mut out, "default", &slots, &lab()).unwrap();
        let docs = documents(out);
        assert_eq!(docs.len(), 4);
        assert_eq!(docs[0]["spec"]["transport"], "mqtt");
        assert_eq!(docs[0]["spec"]["desired"], json!({"open": false}));
        assert_eq!(docs[2]["metadata"]["name"], "dev-00001");
        // A meter has nothing writable: no desired map at all.
        assert!(docs[2]["spec"].get("desired").is_none());
        // And what was printed reads back as a Device.
        let back: Device = serde_json::from_value(docs[2].clone()).unwrap();
        assert_eq!(back.spec.model, "meter");
    }

    fn lab() -> keys::FleetKey {
        keys::FleetKey("lab".into())
    }

    /// The JSON documents of `written`.
    fn documents(written: Vec<u8>) -> Vec<serde_json::Value> {
        String::from_utf8(written)
            .unwrap()
            .split("---\n")
            .filter(|d| !d.is_empty())
            .map(|d| serde_json::from_str(d).unwrap())
            .collect()
    }

    #[test]
    fn each_device_is_followed_by_the_secret_with_its_key() {
        let slots = [slot(7, ModelKind::Valve, Transport::Mqtt)];
        let mut out = Vec::new();
        write_devices(&mut out, "plant", &slots, &lab()).unwrap();
        let docs = documents(out);
        assert_eq!(docs.len(), 2);
        assert_eq!(docs[0]["kind"], "Device");
        let secret: Secret = serde_json::from_value(docs[1].clone()).unwrap();
        assert_eq!(docs[1]["kind"], "Secret");
        assert_eq!(docs[1]["apiVersion"], "v1");
        assert_eq!(secret.type_.as_deref(), Some(credential::SECRET_TYPE));
        assert_eq!(secret.metadata.namespace.as_deref(), Some("plant"));
        assert_eq!(
            secret.metadata.labels.unwrap()[credential::DEVICE_LABEL],
            "dev-00007"
        );
        // The key is the one `run` derives, and a key the agent takes.
        let device = ResourceKey::device("plant", "dev-00007");
        let psk = &secret.data.unwrap()[credential::PSK_KEY].0;
        assert_eq!(psk, keys::device_key(&lab(), &device).as_bytes());
        assert!(Psk::new(psk.clone()).is_ok());
    }
}
