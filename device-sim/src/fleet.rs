//! The fleet layout: which device is called what, hangs off which node, runs
//! which model and talks which transport.
//!
//! Both subcommands derive the fleet from the same [`FleetSpec`], so the
//! Device resources `edgefleet-sim devices` prints and the devices
//! `edgefleet-sim run` simulates always agree, as long as both get the same
//! flags (nodes in the same order).

use edgefleet_shared::api::Transport;

use crate::model::ModelKind;

/// The flags that decide the fleet.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct FleetSpec {
    /// Device names are `<prefix>-<index:05>`.
    pub prefix: String,
    /// How many devices.
    pub devices: usize,
    /// Node names; device `i` hangs off `nodes[i % nodes.len()]`.
    pub nodes: Vec<String>,
    /// Models; device `i` runs `models[i % models.len()]`.
    pub models: Vec<ModelKind>,
    /// Every `mqtt_every`-th device talks MQTT (0: none does).
    pub mqtt_every: usize,
}

/// One device of the fleet.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct DeviceSlot {
    /// Position in the fleet, from 0; seeds the device's randomness.
    pub index: usize,
    /// The Device's `metadata.name`.
    pub name: String,
    /// The node the device hangs off.
    pub node: String,
    /// What the device is.
    pub model: ModelKind,
    /// How the device reports.
    pub transport: Transport,
}

/// A fleet that cannot be laid out.
#[derive(Debug, thiserror::Error, PartialEq, Eq)]
pub enum LayoutError {
    /// No node to put devices on.
    #[error("the fleet needs at least one node")]
    NoNodes,
    /// No model to give devices.
    #[error("the fleet needs at least one model")]
    NoModels,
}

impl FleetSpec {
    /// Checks that every device can be placed.
    pub fn validate(&self) -> Result<(), LayoutError> {
        if self.nodes.is_empty() {
            return Err(LayoutError::NoNodes);
        }
        if self.models.is_empty() {
            return Err(LayoutError::NoModels);
        }
        Ok(())
    }

    /// Device `index` of the fleet.
    ///
    /// # Panics
    ///
    /// If the spec has no nodes or no models; see [`FleetSpec::validate`].
    pub fn slot(&self, index: usize) -> DeviceSlot {
        let mqtt = self.mqtt_every > 0 && index % self.mqtt_every == self.mqtt_every - 1;
        DeviceSlot {
            index,
            name: format!("{}-{index:05}", self.prefix),
            node: self.nodes[index % self.nodes.len()].clone(),
            model: self.models[index % self.models.len()],
            transport: if mqtt {
                Transport::Mqtt
            } else {
                Transport::Coap
            },
        }
    }

    /// Every device of the fleet, by index.
    pub fn layout(&self) -> Result<Vec<DeviceSlot>, LayoutError> {
        self.validate()?;
        Ok((0..self.devices).map(|i| self.slot(i)).collect())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn spec(devices: usize, mqtt_every: usize) -> FleetSpec {
        FleetSpec {
            prefix: "dev".into(),
            devices,
            nodes: vec!["edge-1".into(), "edge-2".into()],
            models: ModelKind::ALL.to_vec(),
            mqtt_every,
        }
    }

    #[test]
    fn devices_are_spread_round_robin() {
        let slots = spec(7, 0).layout().unwrap();
        assert_eq!(slots.len(), 7);
        let summary: Vec<_> = slots
            .iter()
            .map(|s| (s.index, s.name.as_str(), s.node.as_str(), s.model))
            .collect();
        use ModelKind::*;
        assert_eq!(
            summary,
            [
                (0, "dev-00000", "edge-1", Thermostat),
                (1, "dev-00001", "edge-2", Valve),
                (2, "dev-00002", "edge-1", Meter),
                (3, "dev-00003", "edge-2", Thermostat),
                (4, "dev-00004", "edge-1", Valve),
                (5, "dev-00005", "edge-2", Meter),
                (6, "dev-00006", "edge-1", Thermostat),
            ]
        );
    }

    #[test]
    fn every_kth_device_talks_mqtt() {
        let mqtt: Vec<_> = spec(10, 3)
            .layout()
            .unwrap()
            .into_iter()
            .filter(|s| s.transport == Transport::Mqtt)
            .map(|s| s.index)
            .collect();
        assert_eq!(mqtt, [2, 5, 8]);

        assert!(
            spec(10, 0)
                .layout()
                .unwrap()
                .iter()
                .all(|s| s.transport == Transport::Coap)
        );
        assert!(
            spec(4, 1)
                .layout()
                .unwrap()
                .iter()
                .all(|s| s.transport == Transport::Mqtt)
        );
    }

    #[test]
    fn names_keep_five_digits_and_grow_past_them() {
        let mut s = spec(0, 0);
        s.prefix = "t".into();
        assert_eq!(s.slot(42).name, "t-00042");
        assert_eq!(s.slot(123_456).name, "t-123456");
    }

    #[test]
    fn a_fleet_needs_nodes_and_models() {
        let mut s = spec(3, 0);
        s.nodes.clear();
        assert_eq!(s.layout(), Err(LayoutError::NoNodes));
        let mut s = spec(3, 0);
        s.models.clear();
        assert_eq!(s.layout(), Err(LayoutError::NoModels));
        assert_eq!(spec(0, 0).layout(), Ok(vec![]));
    }
}
