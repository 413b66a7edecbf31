//! Kubernetes Events about Devices, for `kubectl describe` and
//! `kubectl events`.
//!
//! Events mark steps of a Device's pipeline that happen once per generation
//! (accepted, applied, refused by the agent, removed), never per report, so
//! their rate follows spec changes, not telemetry. Like client-go's event
//! spam filter, they are best effort: beyond [`EVENTS_PER_SECOND`] (after a
//! burst of [`EVENT_BURST`]) an Event is dropped and counted, so a change of
//! a whole fleet does not add thousands of writes to the API server's load. A step that repeats
//! within minutes becomes one Event with a growing `series.count` (the
//! recorder's aggregation), so notes do not name generations: those are in
//! the Device's status. Publishing runs in its own
//! task: a slow API server delays an Event, not a status write or a sync
//! stream.

use edgefleet_shared::ResourceKey;
use edgefleet_shared::key::ResourceKind;
use k8s_openapi::api::core::v1::ObjectReference;
use kube::runtime::events::{Event, EventType, Recorder, Reporter};
use std::num::NonZeroU32;

use governor::{DefaultDirectRateLimiter, Quota, RateLimiter};
use prometheus_client::metrics::counter::Counter;

/// Events published per second at most, after a burst.
pub const EVENTS_PER_SECOND: NonZeroU32 = NonZeroU32::new(10).unwrap();

/// Events that may go at once after a quiet spell.
pub const EVENT_BURST: NonZeroU32 = NonZeroU32::new(50).unwrap();

/// The `reportingController` of every Event.
pub const CONTROLLER: &str = "edgefleet.io/cloud";

/// Publishes Events. Cheap to clone.
#[derive(Clone)]
pub struct Events {
    recorder: Recorder,
    limiter: std::sync::Arc<DefaultDirectRateLimiter>,
    metrics: EventMetrics,
}

impl std::fmt::Debug for Events {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Events").finish_non_exhaustive()
    }
}

/// Counters of published Events.
#[derive(Clone, Debug, Default)]
pub struct EventMetrics {
    /// Events published.
    pub published: Counter,
    /// Events the API server refused or did not answer.
    pub failed: Counter,
    /// Events dropped by the rate limit.
    pub dropped: Counter,
}

impl EventMetrics {
    /// Registers the counters with `registry`.
    pub fn register(&self, registry: &mut prometheus_client::registry::Registry) {
        registry.register("published", "Events published", self.published.clone());
        registry.register(
            "failed",
            "Events that could not be published",
            self.failed.clone(),
        );
        registry.register(
            "dropped",
            "Events dropped by the rate limit",
            self.dropped.clone(),
        );
    }
}

/// How an Event reads: normal or a warning, a PascalCase reason, a note.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Note {
    /// A warning, or a normal step.
    pub warning: bool,
    /// Why (PascalCase), shown as `Reason`.
    pub reason: &'static str,
    /// What was done (PascalCase).
    pub action: &'static str,
    /// The sentence people read.
    pub text: String,
}

impl Events {
    /// Events reported by `instance` (the pod or host name).
    pub fn new(client: kube::Client, instance: Option<String>, metrics: EventMetrics) -> Self {
        let reporter = Reporter {
            controller: CONTROLLER.to_owned(),
            instance,
        };
        let quota = Quota::per_second(EVENTS_PER_SECOND).allow_burst(EVENT_BURST);
        Events {
            recorder: Recorder::new(client, reporter),
            limiter: std::sync::Arc::new(RateLimiter::direct(quota)),
            metrics,
        }
    }

    /// Publishes `note` about the object `regarding`, in the background.
    pub fn publish(&self, regarding: ObjectReference, note: Note) {
        if self.limiter.check().is_err() {
            self.metrics.dropped.inc();
            return;
        }
        let events = self.clone();
        tokio::spawn(async move {
            let event = Event {
                type_: if note.warning {
                    EventType::Warning
                } else {
                    EventType::Normal
                },
                reason: note.reason.to_owned(),
                note: Some(note.text),
                action: note.action.to_owned(),
                secondary: None,
            };
            match events.recorder.publish(&event, &regarding).await {
                Ok(()) => {
                    events.metrics.published.inc();
                }
                Err(error) => {
                    events.metrics.failed.inc();
                    tracing::warn!(object = ?regarding.name, reason = note.reason, %error, "could not publish an Event");
                }
            }
        });
    }
}

/// A reference to the Device or EdgeRule `key` with `uid`, for an Event about it.
pub fn resource_reference(key: &ResourceKey, uid: &str) -> ObjectReference {
    ObjectReference {
        api_version: Some("edgefleet.io/v1alpha1".to_owned()),
        kind: Some(
            match key.kind {
                // A credential is named like its Device; the Event is
                // about the Device (the uid is the Secret's, so left out).
                ResourceKind::Device | ResourceKind::Credential => "Device",
                ResourceKind::Rule => "EdgeRule",
            }
            .to_owned(),
        ),
        namespace: Some(key.namespace.clone()),
        name: Some(key.name.clone()),
        uid: (key.kind != ResourceKind::Credential).then(|| uid.to_owned()),
        ..ObjectReference::default()
    }
}
