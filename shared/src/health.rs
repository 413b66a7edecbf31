//! What `/healthz` and `/readyz` say: each part of a process that can fail
//! on its own (the store, the sync loop, the site broker) reports through a
//! [`Check`] whether it works, and the endpoints answer from all of them.
//!
//! - A *live* part failing turns `/healthz` to 503: restarting the process
//!   is what helps (the store cannot write, a loop stopped).
//! - A *ready* part failing turns only `/readyz` to 503: the process is
//!   fine but cannot do its job right now (the site broker is away).
//!
//! A part may also be given a stall limit: without a sign of life for that
//! long it counts as failing, which catches a loop that hangs rather than
//! errs.

use std::collections::BTreeMap;
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

/// Which endpoint a failing part turns to 503.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Probe {
    /// `/healthz` and `/readyz`.
    Live,
    /// `/readyz` only.
    Ready,
}

#[derive(Debug)]
struct Part {
    probe: Probe,
    stall_after: Option<Duration>,
    last_sign: Instant,
    failing: Option<String>,
}

/// The parts of one process. Cheap to clone.
#[derive(Clone, Debug, Default)]
pub struct Health {
    parts: Arc<Mutex<BTreeMap<&'static str, Part>>>,
}

impl Health {
    /// Registers part `name`, working until it says otherwise (or, with a
    /// stall limit, until it is silent for longer than that).
    pub fn check(&self, name: &'static str, probe: Probe, stall_after: Option<Duration>) -> Check {
        self.lock().insert(
            name,
            Part {
                probe,
                stall_after,
                last_sign: Instant::now(),
                failing: None,
            },
        );
        Check {
            health: Some(self.clone()),
            name,
        }
    }

    /// `Ok`, or what fails among the parts that `probe` looks at.
    pub fn status(&self, probe: Probe) -> Result<(), Vec<String>> {
        let now = Instant::now();
        let failing: Vec<String> = self
            .lock()
            .iter()
            .filter(|(_, part)| probe == Probe::Ready || part.probe == Probe::Live)
            .filter_map(|(name, part)| {
                if let Some(why) = &part.failing {
                    return Some(format!("{name}: {why}"));
                }
                let silent = now.duration_since(part.last_sign);
                part.stall_after
                    .filter(|limit| silent > *limit)
                    .map(|_| format!("{name}: no sign of life for {silent:?}"))
            })
            .collect();
        if failing.is_empty() {
            Ok(())
        } else {
            Err(failing)
        }
    }

    fn lock(&self) -> std::sync::MutexGuard<'_, BTreeMap<&'static str, Part>> {
        self.parts.lock().expect("health lock")
    }
}

/// One part's report. A default `Check` reports nowhere (for code run
/// outside a process that serves the endpoints, such as tests).
#[derive(Clone, Debug, Default)]
pub struct Check {
    health: Option<Health>,
    name: &'static str,
}

impl Check {
    /// The part works (and is alive now).
    pub fn ok(&self) {
        self.update(|part| {
            part.failing = None;
        });
    }

    /// The part is alive, whether or not it works: for a loop that says
    /// it still turns without judging what it does.
    pub fn alive(&self) {
        self.update(|_| {});
    }

    /// The part does not work, and why.
    pub fn failing(&self, why: impl std::fmt::Display) {
        let why = why.to_string();
        self.update(move |part| part.failing = Some(why));
    }

    fn update(&self, change: impl FnOnce(&mut Part)) {
        let Some(health) = &self.health else { return };
        if let Some(part) = health.lock().get_mut(self.name) {
            part.last_sign = Instant::now();
            change(part);
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_failing_live_part_fails_both_probes_and_a_ready_part_only_readiness() {
        let health = Health::default();
        let store = health.check("store", Probe::Live, None);
        let broker = health.check("mqtt", Probe::Ready, None);
        assert_eq!(health.status(Probe::Live), Ok(()));
        assert_eq!(health.status(Probe::Ready), Ok(()));

        broker.failing("connection refused");
        assert_eq!(health.status(Probe::Live), Ok(()));
        assert_eq!(
            health.status(Probe::Ready),
            Err(vec!["mqtt: connection refused".to_owned()])
        );

        store.failing("no space left on device");
        assert_eq!(
            health.status(Probe::Live),
            Err(vec!["store: no space left on device".to_owned()])
        );
        broker.ok();
        store.ok();
        assert_eq!(health.status(Probe::Ready), Ok(()));
    }

    #[test]
    fn a_part_silent_past_its_stall_limit_fails() {
        let health = Health::default();
        let sync = health.check("sync", Probe::Live, Some(Duration::from_millis(20)));
        assert_eq!(health.status(Probe::Live), Ok(()));
        std::thread::sleep(Duration::from_millis(40));
        let failing = health.status(Probe::Live).unwrap_err();
        assert!(
            failing[0].starts_with("sync: no sign of life"),
            "{failing:?}"
        );
        sync.alive();
        assert_eq!(health.status(Probe::Live), Ok(()));
        // A check that reports nowhere does nothing.
        Check::default().failing("ignored");
        assert_eq!(health.status(Probe::Live), Ok(()));
    }
}
