//! One simulated device, without any I/O: a model plus what every device
//! has — the generation it applied, desired properties its model does not
//! know (reported back as given), and firmware.
//!
//! Time is passed in explicitly as the time since the simulation started, so
//! the device can be driven by a test as well as by the runtime.

use std::time::Duration;

use std::sync::Arc;

use edgefleet_shared::codec::{DesiredState, DeviceReport, FirmwareFailure};
use rand::{RngExt, SeedableRng};

use crate::firmware::{CRASH_EVERY, CRASHES, FirmwareBehaviour};
use crate::model::{DeviceModel, ModelKind, Properties, SimRng};

/// The firmware every device runs before it is told otherwise.
pub const FACTORY_FIRMWARE: &str = "1.0.0";

/// What a device draws random numbers for. Each purpose is its own stream,
/// so for instance network jitter never changes a model's trajectory.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Purpose {
    /// The model's physics and the firmware install times.
    Model = 0,
    /// Report schedule and CoAP retransmission timeouts.
    Network = 1,
}

/// The generator of device `index` in a simulation seeded with `seed`.
pub fn device_rng(seed: u64, index: usize, purpose: Purpose) -> SimRng {
    let mut key = [0u8; 32];
    key[..8].copy_from_slice(&seed.to_le_bytes());
    key[8] = purpose as u8;
    let mut rng = SimRng::from_seed(key);
    rng.set_stream(index as u64);
    rng
}

/// What [`SimDevice::apply`] did.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Applied {
    /// A new generation was applied.
    New,
    /// This generation was applied already (a retained message seen again);
    /// nothing changed.
    Again,
}

#[derive(Clone, Debug, PartialEq)]
struct Install {
    version: String,
    done_at: Duration,
}

/// A simulated device.
#[derive(Debug)]
pub struct SimDevice {
    model: Box<dyn DeviceModel>,
    rng: SimRng,
    applied_generation: i64,
    // The agent's override revision applied with it.
    applied_local: u64,
    unknown: Properties,
    kind: ModelKind,
    firmware: String,
    install: Option<Install>,
    firmware_rules: Arc<FirmwareBehaviour>,
    // The last install failed: reported until the next order.
    failure: Option<FirmwareFailure>,
    // Since when the device runs a bad firmware.
    bad_since: Option<Duration>,
    clock: Duration,
    // A steady device's readings do not drift: it reports the same values
    // until a desired state changes them.
    steady: bool,
}

impl SimDevice {
    /// Device `index` of a simulation seeded with `seed`, at time zero.
    pub fn new(kind: ModelKind, seed: u64, index: usize) -> Self {
        let mut rng = device_rng(seed, index, Purpose::Model);
        let mut model = kind.instantiate(&mut rng);
        model.apply(&kind.default_desired());
        SimDevice {
            model,
            rng,
            applied_generation: 0,
            applied_local: 0,
            unknown: Properties::new(),
            kind,
            firmware: FACTORY_FIRMWARE.to_owned(),
            install: None,
            firmware_rules: Arc::new(FirmwareBehaviour::default()),
            failure: None,
            bad_since: None,
            clock: Duration::ZERO,
            steady: false,
        }
    }

    /// The same device, with readings that never drift if `steady`.
    pub fn with_steady(mut self, steady: bool) -> Self {
        self.steady = steady;
        self
    }

    /// The same device, with these firmware rules.
    pub fn with_firmware_rules(mut self, rules: Arc<FirmwareBehaviour>) -> Self {
        self.firmware_rules = rules;
        self
    }

    /// The generation of the last desired state applied (0: none).
    pub fn applied_generation(&self) -> i64 {
        self.applied_generation
    }

    /// The firmware the device runs.
    pub fn firmware_version(&self) -> &str {
        &self.firmware
    }

    /// When the firmware install under way completes, if one is.
    pub fn install_due(&self) -> Option<Duration> {
        self.install.as_ref().map(|i| i.done_at)
    }

    /// Applies a desired state at time `now`.
    ///
    /// Any generation other than the one applied last is applied, older ones
    /// too: a Device deleted and created again starts over at generation 1.
    /// So is the same generation under another override revision (`local`,
    /// an EdgeRule acting at the agent).
    /// A firmware order for a version the device neither runs nor installs
    /// starts an install, which takes the rules' install time and may fail
    /// (the device keeps its firmware and reports the failure until the next
    /// order); a desired state without one cancels an install under way.
    pub fn apply(&mut self, desired: &DesiredState, now: Duration) -> Applied {
        self.advance(now);
        if (desired.generation, desired.local) == (self.applied_generation, self.applied_local) {
            return Applied::Again;
        }
        self.model.apply(&desired.properties);
        let known = self.model.properties();
        self.unknown = desired
            .properties
            .iter()
            .filter(|(name, _)| !known.contains_key(*name))
            .map(|(name, value)| (name.clone(), value.clone()))
            .collect();
        self.applied_generation = desired.generation;
        self.applied_local = desired.local;

        self.failure = None;
        match &desired.firmware {
            None => self.install = None,
            Some(order) if order.version == self.firmware => self.install = None,
            Some(order)
                if self
                    .install
                    .as_ref()
                    .is_some_and(|i| i.version == order.version) => {}
            Some(order) => {
                let (min, max) = self.firmware_rules.install_time;
                let took = self.rng.random_range(min.as_secs_f64()..=max.as_secs_f64());
                self.install = Some(Install {
                    version: order.version.clone(),
                    done_at: now + Duration::from_secs_f64(took),
                });
            }
        }
        Applied::New
    }

    /// Forgets the desired state: the Device was deleted. The model keeps
    /// its physical state.
    pub fn forget(&mut self) {
        self.applied_generation = 0;
        self.applied_local = 0;
        self.unknown.clear();
        self.install = None;
        self.failure = None;
    }

    /// Advances the simulation to `now` (an earlier time is ignored).
    /// Returns whether a firmware install completed on the way.
    pub fn advance(&mut self, now: Duration) -> bool {
        if let Some(dt) = now.checked_sub(self.clock) {
            if !self.steady {
                self.model.step(dt, &mut self.rng);
            }
            self.clock = now;
        }
        match self.install.take() {
            Some(install) if install.done_at <= self.clock => {
                let chance = self
                    .firmware_rules
                    .failure_percent(self.kind, &install.version);
                if self.rng.random_range(0..100u8) < chance {
                    self.failure = Some(FirmwareFailure {
                        reason: format!("the image of {} failed verification", install.version),
                        version: install.version,
                    });
                    return false;
                }
                self.bad_since = self
                    .firmware_rules
                    .is_bad(&install.version)
                    .then_some(install.done_at);
                self.firmware = install.version;
                true
            }
            pending => {
                self.install = pending;
                false
            }
        }
    }

    /// The report describing the device as of the last advance.
    pub fn report(&self) -> DeviceReport {
        let mut properties = self.unknown.clone();
        properties.extend(self.model.properties());
        if let Some(since) = self.bad_since {
            let crashes = 1 + (self.clock.saturating_sub(since).as_secs() / CRASH_EVERY.as_secs());
            properties.insert(CRASHES.to_owned(), (crashes as i64).into());
        }
        DeviceReport {
            applied_generation: self.applied_generation,
            properties,
            firmware_version: Some(self.firmware.clone()),
            firmware_failure: self.failure.clone(),
        }
    }
}

#[cfg(test)]
mod tests {
    use edgefleet_shared::PropertyValue;
    use edgefleet_shared::codec::FirmwareOrder;

    use super::*;

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

    fn with_firmware(mut d: DesiredState, version: &str) -> DesiredState {
        d.firmware = Some(FirmwareOrder {
            version: version.into(),
            url: None,
            sha256: None,
        });
        d
    }

    fn secs(s: f64) -> Duration {
        Duration::from_secs_f64(s)
    }

    #[test]
    fn a_new_device_reports_factory_state() {
        let device = SimDevice::new(ModelKind::Thermostat, 1, 0);
        let report = device.report();
        assert_eq!(report.applied_generation, 0);
        assert_eq!(report.firmware_version.as_deref(), Some(FACTORY_FIRMWARE));
        assert_eq!(
            report.properties.get("setpoint"),
            Some(&PropertyValue::Float(21.0))
        );
    }

    #[test]
    fn same_seed_and_index_same_reports() {
        let run = |seed, index| {
            let mut device = SimDevice::new(ModelKind::Meter, seed, index);
            (1..=20)
                .map(|t| {
                    device.advance(secs(t as f64 * 10.0));
                    device.report()
                })
                .collect::<Vec<_>>()
        };
        assert_eq!(run(1, 3), run(1, 3));
        assert_ne!(run(1, 3), run(1, 4));
        assert_ne!(run(1, 3), run(2, 3));
    }

    #[test]
    fn streams_are_independent_per_purpose() {
        let mut model = device_rng(1, 0, Purpose::Model);
        let mut network = device_rng(1, 0, Purpose::Network);
        assert_ne!(model.random::<u64>(), network.random::<u64>());
    }

    #[test]
    fn applying_adopts_known_and_echoes_unknown_properties() {
        let mut device = SimDevice::new(ModelKind::Thermostat, 1, 0);
        let d = desired(
            3,
            &[
                ("setpoint", PropertyValue::Int(25)),
                ("label", PropertyValue::String("lobby".into())),
                ("temperature", PropertyValue::Float(99.0)),
            ],
        );
        assert_eq!(device.apply(&d, secs(1.0)), Applied::New);
        let report = device.report();
        assert_eq!(report.applied_generation, 3);
        assert_eq!(report.properties["setpoint"], PropertyValue::Float(25.0));
        assert_eq!(
            report.properties["label"],
            PropertyValue::String("lobby".into())
        );
        assert_ne!(report.properties["temperature"], PropertyValue::Float(99.0));

        // The next generation no longer has the unknown property.
        device.apply(&desired(4, &[]), secs(2.0));
        assert!(!device.report().properties.contains_key("label"));
        assert_eq!(device.applied_generation(), 4);
    }

    #[test]
    fn the_same_generation_is_applied_once() {
        let mut device = SimDevice::new(ModelKind::Thermostat, 1, 0);
        let d = desired(2, &[("setpoint", PropertyValue::Float(18.0))]);
        assert_eq!(device.apply(&d, secs(0.0)), Applied::New);
        let changed = desired(2, &[("setpoint", PropertyValue::Float(30.0))]);
        assert_eq!(device.apply(&changed, secs(1.0)), Applied::Again);
        assert_eq!(
            device.report().properties["setpoint"],
            PropertyValue::Float(18.0)
        );
    }

    #[test]
    fn a_steady_device_reports_the_same_until_told_otherwise() {
        let mut d = SimDevice::new(ModelKind::Thermostat, 1, 0).with_steady(true);
        d.advance(secs(1.0));
        let first = d.report();
        d.advance(secs(600.0));
        assert_eq!(d.report(), first);
        d.apply(
            &desired(1, &[("setpoint", PropertyValue::Float(25.0))]),
            secs(601.0),
        );
        assert_ne!(d.report(), first);
        let mut drifting = SimDevice::new(ModelKind::Thermostat, 1, 0);
        drifting.advance(secs(1.0));
        let before = drifting.report();
        drifting.advance(secs(600.0));
        assert_ne!(
            drifting.report(),
            before,
            "a device that is not steady drifts"
        );
    }

    #[test]
    fn a_deleted_device_starts_over() {
        let mut device = SimDevice::new(ModelKind::Valve, 1, 0);
        device.apply(
            &desired(5, &[("open", true.into()), ("tag", PropertyValue::Int(1))]),
            secs(0.0),
        );
        device.forget();
        let report = device.report();
        assert_eq!(report.applied_generation, 0);
        assert!(!report.properties.contains_key("tag"));
        // Re-created: generation 1 again, lower than before, still applied.
        assert_eq!(device.apply(&desired(1, &[]), secs(1.0)), Applied::New);
        assert_eq!(device.applied_generation(), 1);
    }

    #[test]
    fn a_failed_install_keeps_the_firmware_and_is_reported_until_the_next_order() {
        let rules = FirmwareBehaviour {
            failures: vec!["meter/2.0.0=100".parse().unwrap()],
            ..FirmwareBehaviour::default()
        };
        let mut device =
            SimDevice::new(ModelKind::Meter, 1, 0).with_firmware_rules(Arc::new(rules));
        device.apply(&with_firmware(desired(2, &[]), "2.0.0"), secs(0.0));
        assert!(!device.advance(secs(10.0)), "nothing installed");
        let report = device.report();
        assert_eq!(report.firmware_version.as_deref(), Some(FACTORY_FIRMWARE));
        assert_eq!(report.applied_generation, 2);
        assert_eq!(
            report.firmware_failure.map(|f| f.version).as_deref(),
            Some("2.0.0")
        );
        device.apply(&desired(3, &[]), secs(11.0));
        assert_eq!(
            device.report().firmware_failure,
            None,
            "a new order clears it"
        );
    }

    #[test]
    fn a_bad_firmware_installs_and_then_the_device_crashes() {
        let rules = FirmwareBehaviour {
            bad: vec!["2.0.0".into()],
            ..FirmwareBehaviour::default()
        };
        let mut device =
            SimDevice::new(ModelKind::Thermostat, 1, 0).with_firmware_rules(Arc::new(rules));
        assert!(!device.report().properties.contains_key(CRASHES));
        device.apply(&with_firmware(desired(2, &[]), "2.0.0"), secs(0.0));
        let due = device.install_due().unwrap();
        assert!(device.advance(due));
        assert_eq!(device.firmware_version(), "2.0.0");
        let crashes = |d: &SimDevice| d.report().properties.get(CRASHES).cloned();
        assert_eq!(crashes(&device), Some(PropertyValue::Int(1)));
        device.advance(due + CRASH_EVERY * 3);
        assert_eq!(crashes(&device), Some(PropertyValue::Int(4)));
    }

    #[test]
    fn firmware_installs_after_a_seeded_delay() {
        let mut device = SimDevice::new(ModelKind::Meter, 1, 0);
        let d = with_firmware(desired(2, &[]), "2.0.0");
        device.apply(&d, secs(10.0));
        let due = device.install_due().expect("install started");
        assert!(due >= secs(11.0) && due <= secs(13.0), "{due:?}");

        assert!(!device.advance(due - secs(0.1)));
        assert_eq!(device.firmware_version(), FACTORY_FIRMWARE);
        assert_eq!(device.report().applied_generation, 2);

        assert!(device.advance(due));
        assert_eq!(device.firmware_version(), "2.0.0");
        assert_eq!(device.report().firmware_version.as_deref(), Some("2.0.0"));
        assert_eq!(device.install_due(), None);

        // Asking for the running version starts nothing.
        device.apply(&with_firmware(desired(3, &[]), "2.0.0"), secs(20.0));
        assert_eq!(device.install_due(), None);

        // Same seed, same install time.
        let mut twin = SimDevice::new(ModelKind::Meter, 1, 0);
        twin.apply(&d, secs(10.0));
        assert_eq!(twin.install_due(), Some(due));
    }

    #[test]
    fn a_new_generation_without_firmware_cancels_the_install() {
        let mut device = SimDevice::new(ModelKind::Valve, 1, 0);
        device.apply(&with_firmware(desired(1, &[]), "1.1.0"), secs(0.0));
        let due = device.install_due().unwrap();
        // Re-ordering the same version keeps the install under way.
        device.apply(&with_firmware(desired(2, &[]), "1.1.0"), secs(0.5));
        assert_eq!(device.install_due(), Some(due));

        device.apply(&desired(3, &[]), secs(0.6));
        assert_eq!(device.install_due(), None);
        assert!(!device.advance(secs(10.0)));
        assert_eq!(device.firmware_version(), FACTORY_FIRMWARE);
    }
}
