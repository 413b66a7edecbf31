//! How firmware behaves in the simulation: how long an install takes, how
//! often it fails (per version, optionally per model) and which versions
//! are *bad* — they install fine and then degrade the device, which only a
//! health gate can notice.

use std::str::FromStr;
use std::time::Duration;

use crate::config::{ParseError, parse_duration};
use crate::model::ModelKind;

/// The property a device on bad firmware reports: how many times it has
/// crashed since the install (absent on good firmware).
pub const CRASHES: &str = "crashes";

/// A bad firmware's device crashes once per this long.
pub const CRASH_EVERY: Duration = Duration::from_secs(2);

/// The firmware rules of a simulation.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct FirmwareBehaviour {
    /// How long an install (download, install, reboot) takes: at least and
    /// at most.
    pub install_time: (Duration, Duration),
    /// Installs that fail, and how often.
    pub failures: Vec<InstallFailure>,
    /// Versions that install fine and then make the device crash.
    pub bad: Vec<String>,
}

impl Default for FirmwareBehaviour {
    fn default() -> Self {
        FirmwareBehaviour {
            install_time: (Duration::from_secs(1), Duration::from_secs(3)),
            failures: Vec::new(),
            bad: Vec::new(),
        }
    }
}

impl FirmwareBehaviour {
    /// The chance (percent) that installing `version` on a `model` fails:
    /// the first rule that names the version (and the model, if it says
    /// one).
    pub fn failure_percent(&self, model: ModelKind, version: &str) -> u8 {
        self.failures
            .iter()
            .find(|f| f.version == version && f.model.is_none_or(|m| m == model))
            .map_or(0, |f| f.percent)
    }

    /// Whether `version` is bad.
    pub fn is_bad(&self, version: &str) -> bool {
        self.bad.iter().any(|b| b == version)
    }
}

/// `[MODEL/]VERSION=PERCENT`: installing VERSION (on MODEL) fails with
/// this chance.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct InstallFailure {
    /// Only this model, or all.
    pub model: Option<ModelKind>,
    /// The version.
    pub version: String,
    /// The chance, 0 to 100.
    pub percent: u8,
}

impl FromStr for InstallFailure {
    type Err = ParseError;

    fn from_str(s: &str) -> Result<Self, Self::Err> {
        let bad = |why: &str| ParseError(format!("{s:?}: {why}; expected [MODEL/]VERSION=PERCENT"));
        let (what, percent) = s.split_once('=').ok_or_else(|| bad("no '='"))?;
        let percent: u8 = percent
            .trim_end_matches('%')
            .parse()
            .ok()
            .filter(|p| *p <= 100)
            .ok_or_else(|| bad("the percentage is not 0 to 100"))?;
        let (model, version) = match what.split_once('/') {
            Some((model, version)) => {
                let model = ModelKind::ALL
                    .into_iter()
                    .find(|m| m.as_str() == model)
                    .ok_or_else(|| bad("unknown model"))?;
                (Some(model), version)
            }
            None => (None, what),
        };
        if version.is_empty() {
            return Err(bad("no version"));
        }
        Ok(InstallFailure {
            model,
            version: version.to_owned(),
            percent,
        })
    }
}

/// `MIN..MAX` durations (`5s..20s`), or one duration for both.
pub fn parse_duration_range(s: &str) -> Result<(Duration, Duration), ParseError> {
    let (min, max) = match s.split_once("..") {
        Some((min, max)) => (parse_duration(min)?, parse_duration(max)?),
        None => {
            let d = parse_duration(s)?;
            (d, d)
        }
    };
    if min > max {
        return Err(ParseError(format!(
            "{s:?}: the least is more than the most"
        )));
    }
    Ok((min, max))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn failure_rules_name_a_version_and_maybe_a_model() {
        let rules = FirmwareBehaviour {
            failures: vec![
                "valve/2.0.0=100".parse().unwrap(),
                "2.0.0=10%".parse().unwrap(),
            ],
            ..FirmwareBehaviour::default()
        };
        assert_eq!(rules.failure_percent(ModelKind::Valve, "2.0.0"), 100);
        assert_eq!(rules.failure_percent(ModelKind::Meter, "2.0.0"), 10);
        assert_eq!(rules.failure_percent(ModelKind::Meter, "3.0.0"), 0);
        assert!("2.0.0=101".parse::<InstallFailure>().is_err());
        assert!("toaster/2.0.0=1".parse::<InstallFailure>().is_err());
        assert!("2.0.0".parse::<InstallFailure>().is_err());
    }

    #[test]
    fn ranges_are_two_durations_or_one() {
        assert_eq!(
            parse_duration_range("5s..20s").unwrap(),
            (Duration::from_secs(5), Duration::from_secs(20))
        );
        assert_eq!(
            parse_duration_range("300ms").unwrap(),
            (Duration::from_millis(300), Duration::from_millis(300))
        );
        assert!(parse_duration_range("3s..1s").is_err());
    }
}
