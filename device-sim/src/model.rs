//! Device models: what a simulated device of each kind does with its
//! properties.
//!
//! A model is pure state: [`DeviceModel::apply`] adopts desired values,
//! [`DeviceModel::step`] advances the physics by some time, drawing noise from
//! the random generator it is given, and [`DeviceModel::properties`] is the
//! snapshot a report carries. Given the same generator seed and the same calls,
//! a model walks the same trajectory.

use std::collections::BTreeMap;
use std::fmt;
use std::str::FromStr;
use std::time::Duration;

use edgefleet_shared::PropertyValue;
use rand::RngExt;
use rand_chacha::ChaCha8Rng;

/// Property values by name, as desired states and reports carry them.
pub type Properties = BTreeMap<String, PropertyValue>;

/// The random generator every simulated device draws from.
pub type SimRng = ChaCha8Rng;

/// The kinds of device the simulator knows.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum ModelKind {
    /// A room thermostat: the temperature follows a writable setpoint.
    Thermostat,
    /// A water valve: writable `open`, measured `flow`.
    Valve,
    /// An energy meter: read-only `power` and an ever-increasing `energy`.
    Meter,
}

impl ModelKind {
    /// Every model, in the order the CLI lists them.
    pub const ALL: [ModelKind; 3] = [ModelKind::Thermostat, ModelKind::Valve, ModelKind::Meter];

    /// The model's name, as a Device's `spec.model` carries it.
    pub fn as_str(self) -> &'static str {
        match self {
            ModelKind::Thermostat => "thermostat",
            ModelKind::Valve => "valve",
            ModelKind::Meter => "meter",
        }
    }

    /// The desired properties a new Device of this model starts with.
    pub fn default_desired(self) -> Properties {
        match self {
            ModelKind::Thermostat => Properties::from([
                ("setpoint".to_owned(), Thermostat::DEFAULT_SETPOINT.into()),
                ("mode".to_owned(), Mode::Auto.as_str().into()),
            ]),
            ModelKind::Valve => Properties::from([("open".to_owned(), false.into())]),
            ModelKind::Meter => Properties::new(),
        }
    }

    /// A device of this model in a starting state drawn from `rng`.
    pub fn instantiate(self, rng: &mut SimRng) -> Box<dyn DeviceModel> {
        match self {
            ModelKind::Thermostat => Box::new(Thermostat::new(rng)),
            ModelKind::Valve => Box::new(Valve::new(rng)),
            ModelKind::Meter => Box::new(Meter::new(rng)),
        }
    }
}

impl fmt::Display for ModelKind {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.as_str())
    }
}

/// A model name the simulator does not know.
#[derive(Debug, thiserror::Error, PartialEq, Eq)]
#[error("unknown model {0:?}; known models: thermostat, valve, meter")]
pub struct UnknownModel(String);

impl FromStr for ModelKind {
    type Err = UnknownModel;

    fn from_str(s: &str) -> Result<Self, Self::Err> {
        ModelKind::ALL
            .into_iter()
            .find(|kind| kind.as_str() == s)
            .ok_or_else(|| UnknownModel(s.to_owned()))
    }
}

/// The behaviour of one kind of device.
pub trait DeviceModel: Send + Sync + fmt::Debug {
    /// Adopts the writable properties this model knows from `desired`;
    /// anything else (unknown names, read-only properties, values of the wrong
    /// type) is ignored.
    fn apply(&mut self, desired: &Properties);

    /// Advances the simulation by `dt`.
    fn step(&mut self, dt: Duration, rng: &mut SimRng);

    /// The current value of every property the model has.
    fn properties(&self) -> Properties;
}

/// Rounds to two decimals, so reports read like a real sensor's.
fn centi(x: f64) -> f64 {
    (x * 100.0).round() / 100.0
}

/// Uniform noise in `[-amplitude, amplitude]` scaled like a random walk over
/// `dt` (by its square root, capped at one minute so a long gap stays sane).
fn noise(rng: &mut SimRng, amplitude: f64, dt: Duration) -> f64 {
    let scale = dt.as_secs_f64().min(60.0).sqrt();
    if scale == 0.0 {
        return 0.0;
    }
    rng.random_range(-amplitude..=amplitude) * scale
}

/// A finite number from a desired value, whether it arrived as an integer or
/// a float (the Kubernetes API turns `19.0` into `19`).
fn finite_number(value: Option<&PropertyValue>) -> Option<f64> {
    value
        .and_then(PropertyValue::as_f64)
        .filter(|x| x.is_finite())
}

/// What a thermostat does.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Mode {
    /// Drive the temperature toward the setpoint.
    Auto,
    /// Do nothing: the room drifts to its ambient temperature.
    Off,
}

impl Mode {
    fn as_str(self) -> &'static str {
        match self {
            Mode::Auto => "auto",
            Mode::Off => "off",
        }
    }

    fn parse(s: &str) -> Option<Self> {
        match s {
            "auto" => Some(Mode::Auto),
            "off" => Some(Mode::Off),
            _ => None,
        }
    }
}

/// A room thermostat.
///
/// Properties: `temperature` (float, read-only) relaxes toward the target
/// with a time constant of [`Thermostat::TIME_CONSTANT`] plus noise;
/// `setpoint` (float, writable, default 21.0); `mode` (string, writable:
/// `auto` targets the setpoint, `off` lets the room drift to its ambient
/// temperature); `fan` (bool, read-only) runs while in `auto` and more than
/// half a degree from the setpoint.
#[derive(Clone, Debug, PartialEq)]
pub struct Thermostat {
    temperature: f64,
    setpoint: f64,
    ambient: f64,
    mode: Mode,
}

impl Thermostat {
    /// The setpoint before any desired state says otherwise.
    pub const DEFAULT_SETPOINT: f64 = 21.0;
    /// How fast the temperature approaches its target (e-folding time).
    pub const TIME_CONSTANT: Duration = Duration::from_secs(60);
    /// How far from the setpoint the fan starts, in degrees.
    pub const FAN_BAND: f64 = 0.5;
    /// Noise amplitude, in degrees per square-root second.
    const NOISE: f64 = 0.02;

    /// A thermostat in a room at an ambient temperature drawn from `rng`.
    pub fn new(rng: &mut SimRng) -> Self {
        let ambient = rng.random_range(15.0..25.0);
        Thermostat {
            temperature: ambient,
            setpoint: Self::DEFAULT_SETPOINT,
            ambient,
            mode: Mode::Auto,
        }
    }

    /// The temperature, unrounded.
    pub fn temperature(&self) -> f64 {
        self.temperature
    }

    fn fan(&self) -> bool {
        self.mode == Mode::Auto && (self.temperature - self.setpoint).abs() > Self::FAN_BAND
    }
}

impl DeviceModel for Thermostat {
    fn apply(&mut self, desired: &Properties) {
        if let Some(setpoint) = finite_number(desired.get("setpoint")) {
            self.setpoint = setpoint;
        }
        if let Some(PropertyValue::String(mode)) = desired.get("mode")
            && let Some(mode) = Mode::parse(mode)
        {
            self.mode = mode;
        }
    }

    fn step(&mut self, dt: Duration, rng: &mut SimRng) {
        let target = match self.mode {
            Mode::Auto => self.setpoint,
            Mode::Off => self.ambient,
        };
        let approach = 1.0 - (-dt.as_secs_f64() / Self::TIME_CONSTANT.as_secs_f64()).exp();
        self.temperature += (target - self.temperature) * approach + noise(rng, Self::NOISE, dt);
    }

    fn properties(&self) -> Properties {
        Properties::from([
            ("temperature".to_owned(), centi(self.temperature).into()),
            ("setpoint".to_owned(), self.setpoint.into()),
            ("fan".to_owned(), self.fan().into()),
            ("mode".to_owned(), self.mode.as_str().into()),
        ])
    }
}

/// A water valve.
///
/// Properties: `open` (bool, writable, default closed); `flow` (float,
/// read-only, litres per minute): zero when closed, the valve's nominal flow
/// (drawn per device) with a little noise when open.
#[derive(Clone, Debug, PartialEq)]
pub struct Valve {
    open: bool,
    nominal_flow: f64,
    flow: f64,
}

impl Valve {
    /// Relative noise on the flow of an open valve.
    const NOISE: f64 = 0.03;

    /// A closed valve with a nominal flow drawn from `rng`.
    pub fn new(rng: &mut SimRng) -> Self {
        Valve {
            open: false,
            nominal_flow: rng.random_range(8.0..15.0),
            flow: 0.0,
        }
    }
}

impl DeviceModel for Valve {
    fn apply(&mut self, desired: &Properties) {
        if let Some(PropertyValue::Bool(open)) = desired.get("open") {
            self.open = *open;
            self.flow = if self.open { self.nominal_flow } else { 0.0 };
        }
    }

    fn step(&mut self, _dt: Duration, rng: &mut SimRng) {
        self.flow = if self.open {
            self.nominal_flow * (1.0 + rng.random_range(-Self::NOISE..=Self::NOISE))
        } else {
            0.0
        };
    }

    fn properties(&self) -> Properties {
        Properties::from([
            ("open".to_owned(), self.open.into()),
            ("flow".to_owned(), centi(self.flow).into()),
        ])
    }
}

/// An energy meter.
///
/// Properties (both read-only): `power` (float, kW) wanders around a base
/// load drawn per device and never goes negative; `energy` (float, kWh)
/// integrates it, so it never decreases.
#[derive(Clone, Debug, PartialEq)]
pub struct Meter {
    energy: f64,
    power: f64,
    base_load: f64,
}

impl Meter {
    /// Noise on the power, in kW per square-root second.
    const NOISE: f64 = 0.05;
    /// How strongly the power is pulled back to the base load, per second.
    const PULL: f64 = 0.05;

    /// A meter with a reading and a base load drawn from `rng`.
    pub fn new(rng: &mut SimRng) -> Self {
        let base_load = rng.random_range(0.5..3.0);
        Meter {
            energy: rng.random_range(100.0..5000.0_f64).round(),
            power: base_load,
            base_load,
        }
    }

    /// The meter reading, unrounded.
    pub fn energy(&self) -> f64 {
        self.energy
    }
}

impl DeviceModel for Meter {
    fn apply(&mut self, _desired: &Properties) {}

    fn step(&mut self, dt: Duration, rng: &mut SimRng) {
        self.energy += self.power * dt.as_secs_f64() / 3600.0;
        let pull = (Self::PULL * dt.as_secs_f64()).min(1.0);
        self.power += (self.base_load - self.power) * pull + noise(rng, Self::NOISE, dt);
        self.power = self.power.max(0.0);
    }

    fn properties(&self) -> Properties {
        Properties::from([
            ("energy".to_owned(), centi(self.energy).into()),
            ("power".to_owned(), centi(self.power).into()),
        ])
    }
}

#[cfg(test)]
mod tests {
    use rand::SeedableRng;

    use super::*;

    fn rng(seed: u64) -> SimRng {
        SimRng::seed_from_u64(seed)
    }

    fn props(pairs: &[(&str, PropertyValue)]) -> Properties {
        pairs
            .iter()
            .map(|(k, v)| ((*k).to_owned(), v.clone()))
            .collect()
    }

    /// A value of `kind` unlike `now`.
    fn another(kind: edgefleet_shared::model::Kind, now: &PropertyValue) -> PropertyValue {
        use edgefleet_shared::model::Kind;
        match (kind, now) {
            (Kind::Number, v) => PropertyValue::Float(v.as_f64().unwrap_or(0.0) + 7.0),
            (Kind::Bool, PropertyValue::Bool(b)) => PropertyValue::Bool(!b),
            (Kind::Word(words), v) => words
                .iter()
                .map(|w| PropertyValue::String((*w).to_owned()))
                .find(|w| w != v)
                .expect("a second word"),
            (kind, v) => panic!("{v:?} is not {kind}"),
        }
    }

    #[test]
    fn each_model_reports_and_takes_what_the_shared_catalog_says() {
        for kind in ModelKind::ALL {
            let catalog = edgefleet_shared::model::find(kind.as_str()).expect("in the catalog");
            let mut rng = rng(3);
            let mut model = kind.instantiate(&mut rng);
            model.step(Duration::from_secs(1), &mut rng);
            let before = model.properties();
            let names: Vec<&str> = before.keys().map(String::as_str).collect();
            let mut listed: Vec<&str> = catalog.properties.iter().map(|p| p.name).collect();
            listed.sort_unstable();
            assert_eq!(names, listed, "{kind}");
            for p in catalog.properties {
                let now = &model.properties()[p.name];
                assert!(p.kind.admits(now), "{kind}.{}: {now:?}", p.name);
                let new = another(p.kind, now);
                model.apply(&Properties::from([(p.name.to_owned(), new.clone())]));
                let after = &model.properties()[p.name];
                match p.writable {
                    true => assert_eq!(after, &new, "{kind}.{} is writable", p.name),
                    false => assert_eq!(after, now, "{kind}.{} is read-only", p.name),
                }
            }
            for name in kind.default_desired().keys() {
                assert!(
                    catalog.property(name).is_some_and(|p| p.writable),
                    "{kind}.{name}"
                );
            }
        }
    }

    /// The reported snapshots of `kind` over `steps` steps of one second.
    fn trajectory(kind: ModelKind, seed: u64, steps: usize) -> Vec<Properties> {
        let mut rng = rng(seed);
        let mut model = kind.instantiate(&mut rng);
        model.apply(&kind.default_desired());
        (0..steps)
            .map(|_| {
                model.step(Duration::from_secs(1), &mut rng);
                model.properties()
            })
            .collect()
    }

    #[test]
    fn model_names_round_trip() {
        for kind in ModelKind::ALL {
            assert_eq!(kind.as_str().parse::<ModelKind>(), Ok(kind));
            assert_eq!(kind.to_string(), kind.as_str());
        }
        assert!("toaster".parse::<ModelKind>().is_err());
    }

    #[test]
    fn same_seed_same_trajectory_other_seed_other_trajectory() {
        for kind in ModelKind::ALL {
            assert_eq!(trajectory(kind, 7, 50), trajectory(kind, 7, 50), "{kind}");
        }
        // The valve's flow only moves while open, so compare the noisy ones.
        for kind in [ModelKind::Thermostat, ModelKind::Meter] {
            assert_ne!(trajectory(kind, 7, 50), trajectory(kind, 8, 50), "{kind}");
        }
    }

    #[test]
    fn defaults_are_what_the_model_reports_after_applying_them() {
        for kind in ModelKind::ALL {
            let mut model = kind.instantiate(&mut rng(1));
            model.apply(&kind.default_desired());
            let reported = model.properties();
            for (name, value) in kind.default_desired() {
                assert_eq!(reported.get(&name), Some(&value), "{kind}.{name}");
            }
        }
    }

    #[test]
    fn thermostat_converges_to_the_setpoint_and_stops_the_fan() {
        let mut rng = rng(3);
        let mut t = Thermostat::new(&mut rng);
        t.apply(&props(&[("setpoint", PropertyValue::Float(30.0))]));
        t.step(Duration::ZERO, &mut rng);
        assert_eq!(t.properties()["fan"], PropertyValue::Bool(true));
        for _ in 0..600 {
            t.step(Duration::from_secs(1), &mut rng);
        }
        assert!((t.temperature() - 30.0).abs() < 0.5, "{}", t.temperature());
        assert_eq!(t.properties()["fan"], PropertyValue::Bool(false));
        assert_eq!(t.properties()["setpoint"], PropertyValue::Float(30.0));
    }

    #[test]
    fn thermostat_takes_integer_setpoints_and_ignores_bad_values() {
        let mut t = Thermostat::new(&mut rng(1));
        t.apply(&props(&[("setpoint", PropertyValue::Int(19))]));
        assert_eq!(t.properties()["setpoint"], PropertyValue::Float(19.0));

        t.apply(&props(&[
            ("setpoint", PropertyValue::String("warm".into())),
            ("mode", PropertyValue::String("turbo".into())),
            ("temperature", PropertyValue::Float(99.0)),
            ("fan", PropertyValue::Bool(true)),
        ]));
        let p = t.properties();
        assert_eq!(p["setpoint"], PropertyValue::Float(19.0));
        assert_eq!(p["mode"], PropertyValue::String("auto".into()));
        assert_ne!(p["temperature"], PropertyValue::Float(99.0));
        assert_eq!(
            p.keys().collect::<Vec<_>>(),
            ["fan", "mode", "setpoint", "temperature"]
        );
    }

    #[test]
    fn thermostat_turned_off_drifts_to_ambient_with_the_fan_off() {
        let mut rng = rng(5);
        let mut t = Thermostat::new(&mut rng);
        let ambient = t.temperature();
        t.apply(&props(&[("setpoint", PropertyValue::Float(ambient + 8.0))]));
        for _ in 0..600 {
            t.step(Duration::from_secs(1), &mut rng);
        }
        assert!(t.temperature() > ambient + 7.0);

        t.apply(&props(&[("mode", PropertyValue::String("off".into()))]));
        for _ in 0..600 {
            t.step(Duration::from_secs(1), &mut rng);
        }
        assert!((t.temperature() - ambient).abs() < 0.5);
        assert_eq!(t.properties()["fan"], PropertyValue::Bool(false));
        assert_eq!(t.properties()["mode"], PropertyValue::String("off".into()));
    }

    #[test]
    fn valve_flows_only_when_open() {
        let mut rng = rng(2);
        let mut v = Valve::new(&mut rng);
        assert_eq!(v.properties()["flow"], PropertyValue::Float(0.0));

        v.apply(&props(&[("open", PropertyValue::Bool(true))]));
        let flow = v.properties()["flow"].as_f64().unwrap();
        assert!(flow > 5.0, "{flow}");
        v.step(Duration::from_secs(10), &mut rng);
        assert!(v.properties()["flow"].as_f64().unwrap() > 5.0);

        v.apply(&props(&[("open", PropertyValue::Bool(false))]));
        assert_eq!(v.properties()["flow"], PropertyValue::Float(0.0));
        v.step(Duration::from_secs(10), &mut rng);
        assert_eq!(v.properties()["flow"], PropertyValue::Float(0.0));
        assert_eq!(v.properties()["open"], PropertyValue::Bool(false));
    }

    #[test]
    fn meter_energy_never_decreases_and_power_stays_positive() {
        let mut rng = rng(4);
        let mut m = Meter::new(&mut rng);
        let start = m.energy();
        let mut last = start;
        for _ in 0..2000 {
            m.step(Duration::from_secs(5), &mut rng);
            assert!(m.energy() >= last);
            assert!(m.properties()["power"].as_f64().unwrap() >= 0.0);
            last = m.energy();
        }
        assert!(last > start, "energy did not grow: {start} -> {last}");
    }

    #[test]
    fn a_zero_step_adds_no_noise() {
        let mut rng = rng(9);
        let mut m = Meter::new(&mut rng);
        let before = m.properties();
        m.step(Duration::ZERO, &mut rng);
        assert_eq!(m.properties(), before);
    }
}
