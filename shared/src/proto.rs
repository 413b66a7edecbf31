//! The sync protocol (`edgefleet.v1`), generated from `proto/edgefleet/v1/sync.proto`,
//! and the conversions between its messages and the shared value types.

#[allow(missing_docs, clippy::all, clippy::pedantic)]
mod generated {
    tonic::include_proto!("edgefleet.v1");
}

pub use generated::*;

/// Most uplink entries an agent has sent and not yet seen acknowledged. An
/// agent waits for UplinkAcks before sending more; the cloud ends the
/// session of an agent that has more outstanding, so what one agent makes
/// the cloud hold (status changes, Events waiting for the API server) is
/// bounded however large its outbox.
pub const UPLINK_WINDOW: usize = 2048;

/// The largest sync message either end sends or accepts (bytes of
/// protobuf). A bigger one is refused from its length prefix, before its
/// body is buffered: the stream ends with `OUT_OF_RANGE`.
pub const MAX_MESSAGE_BYTES: usize = 4 * 1024 * 1024;

/// The metadata key of a refusal (`UNAVAILABLE`) that names, as a URL,
/// the controller replica serving the agent's node: the agent connects
/// there next (keeping the TLS name of its configured endpoint).
pub const REDIRECT_METADATA: &str = "edgefleet-redirect";

/// The metadata key of a refusal (`UNAVAILABLE`) that says, in
/// milliseconds, when to try again: the node's shard is between replicas
/// (its holder went away and no other has taken it yet), so the agent tries
/// again soon instead of backing off as from an unreachable cloud.
pub const RETRY_AFTER_METADATA: &str = "edgefleet-retry-after-ms";

/// Where Updates and Inventory parts are cut: at most this many bytes of
/// entries each (one entry larger than it goes alone), so a node with many
/// Devices or large desired states never needs a message near
/// [`MAX_MESSAGE_BYTES`].
pub const MAX_BATCH_BYTES: usize = 1024 * 1024;

/// Splits `items` into batches of at most [`MAX_BATCH_BYTES`] by
/// `bytes` (an item larger than that makes a batch of its own); an empty
/// `items` gives one empty batch.
pub fn batches_by_bytes<T>(items: Vec<T>, bytes: impl Fn(&T) -> usize) -> Vec<Vec<T>> {
    let mut batches = vec![Vec::new()];
    let mut size = 0;
    for item in items {
        let len = bytes(&item);
        if size + len > MAX_BATCH_BYTES && batches.last().is_some_and(|b| !b.is_empty()) {
            batches.push(Vec::new());
            size = 0;
        }
        size += len;
        batches.last_mut().expect("never empty").push(item);
    }
    batches
}

/// Most entries of one flow an agent has in flight: half the window each,
/// so reports always have room while events wait, and together they stay
/// within [`UPLINK_WINDOW`].
pub const FLOW_WINDOW: usize = UPLINK_WINDOW / 2;

/// The two uplink flows, acknowledged apart (see [`UplinkAck`]): status
/// never waits behind a backlog of events.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub enum Flow {
    /// Reports: status writes.
    Reports,
    /// Events and notices of events dropped.
    Events,
}

impl Flow {
    /// Both flows, reports first (what an agent sends first).
    pub const ALL: [Flow; 2] = [Flow::Reports, Flow::Events];

    /// The flow an uplink entry belongs to.
    pub fn of(body: &uplink_entry::Body) -> Flow {
        match body {
            uplink_entry::Body::Report(_) => Flow::Reports,
            uplink_entry::Body::Event(_) | uplink_entry::Body::EventsDropped(_) => Flow::Events,
        }
    }
}

impl UplinkAck {
    /// Up to where entries of `flow` are acknowledged: its own mark, or
    /// the mark of both flows, whichever is further.
    pub fn of(&self, flow: Flow) -> u64 {
        self.seq.max(match flow {
            Flow::Reports => self.reports_seq,
            Flow::Events => self.events_seq,
        })
    }
}

impl RuleDesired {
    /// The version's second half for this body: the first 63 bits of
    /// SHA-256 over its encoding, which is deterministic (the protocol's
    /// maps are ordered), so equal bodies have equal digests.
    pub fn digest(&self) -> i64 {
        use prost::Message;
        crate::ResourceVersion::content_digest(&self.encode_to_vec())
    }
}

use crate::property::PropertyValue as Value;
use crate::version::ResourceVersion as Version;

impl From<&Value> for PropertyValue {
    fn from(v: &Value) -> Self {
        let kind = match v {
            Value::Bool(b) => property_value::Kind::BoolValue(*b),
            Value::Int(i) => property_value::Kind::IntValue(*i),
            Value::Float(f) => property_value::Kind::FloatValue(*f),
            Value::String(s) => property_value::Kind::StringValue(s.clone()),
        };
        PropertyValue { kind: Some(kind) }
    }
}

impl TryFrom<&PropertyValue> for Value {
    type Error = MissingField;

    fn try_from(v: &PropertyValue) -> Result<Self, Self::Error> {
        Ok(
            match v.kind.as_ref().ok_or(MissingField("PropertyValue.kind"))? {
                property_value::Kind::BoolValue(b) => Value::Bool(*b),
                property_value::Kind::IntValue(i) => Value::Int(*i),
                property_value::Kind::FloatValue(f) => Value::Float(*f),
                property_value::Kind::StringValue(s) => Value::String(s.clone()),
            },
        )
    }
}

impl From<&Version> for ResourceVersion {
    fn from(v: &Version) -> Self {
        ResourceVersion {
            uid: v.uid.clone(),
            generation: v.generation,
        }
    }
}

impl From<&ResourceVersion> for Version {
    fn from(v: &ResourceVersion) -> Self {
        Version::new(v.uid.clone(), v.generation)
    }
}

/// A protocol message lacks a field it must carry.
#[derive(Debug, thiserror::Error, PartialEq, Eq)]
#[error("protocol message lacks {0}")]
pub struct MissingField(pub &'static str);

#[cfg(test)]
mod tests {
    use super::*;
    use prost::Message;

    #[test]
    fn property_values_survive_the_wire() {
        for v in [
            Value::Bool(false),
            Value::Int(-7),
            Value::Float(0.5),
            Value::String("on".into()),
        ] {
            let bytes = PropertyValue::from(&v).encode_to_vec();
            let back = PropertyValue::decode(bytes.as_slice()).unwrap();
            assert_eq!(Value::try_from(&back).unwrap(), v);
        }
    }

    #[test]
    fn batches_are_cut_by_bytes_and_keep_every_item_in_order() {
        let third = MAX_BATCH_BYTES / 3;
        let sizes = vec![third, third, third, third, MAX_BATCH_BYTES * 2, 1, 1];
        let batches = batches_by_bytes(sizes.clone(), |len| *len);
        assert_eq!(
            batches,
            vec![
                vec![third, third, third],
                vec![third],
                vec![MAX_BATCH_BYTES * 2],
                vec![1, 1]
            ]
        );
        assert_eq!(batches.concat(), sizes);
        assert_eq!(
            batches_by_bytes(Vec::<usize>::new(), |l| *l),
            vec![Vec::<usize>::new()]
        );
    }

    #[test]
    fn an_empty_property_value_is_an_error() {
        assert_eq!(
            Value::try_from(&PropertyValue { kind: None }),
            Err(MissingField("PropertyValue.kind"))
        );
    }

    #[test]
    fn hello_carries_held_versions() {
        let hello = AgentMessage {
            kind: Some(agent_message::Kind::Hello(Hello {
                node: "edge-1".into(),
                agent_version: "0.1.0".into(),
                boot_id: "b".into(),
                held: vec![HeldResource {
                    key: "device/ns/d1".into(),
                    version: Some((&Version::new("u1", 3)).into()),
                }],
                store_id: "s1".into(),
                held_digest: vec![7; 16],
                held_count: 1,
                uplink_flows: true,
            })),
        };
        let back = AgentMessage::decode(hello.encode_to_vec().as_slice()).unwrap();
        assert_eq!(back, hello);
    }
}

mod site {
    //! Conversions of a site's part in a rollout.
    use std::collections::BTreeMap;

    use super::{EdgeRollback, Firmware, HeldAtEdge, SitePacing, SiteRollback};
    use crate::api::device::FirmwareSpec;
    use crate::api::rollout::FailureClass;
    use crate::rollout_member::{Previous, SiteThreshold};
    use crate::site_rollback as pure;

    fn class_name(c: FailureClass) -> &'static str {
        match c {
            FailureClass::InstallFailed => "InstallFailed",
            FailureClass::HealthFailed => "HealthFailed",
            FailureClass::TimedOut => "TimedOut",
        }
    }

    fn class_of(name: &str) -> Result<FailureClass, String> {
        [
            FailureClass::InstallFailed,
            FailureClass::HealthFailed,
            FailureClass::TimedOut,
        ]
        .into_iter()
        .find(|c| class_name(*c) == name)
        .ok_or_else(|| format!("unknown failure class {name:?}"))
    }

    impl From<&crate::site_pacing::SitePacing> for SitePacing {
        fn from(s: &crate::site_pacing::SitePacing) -> Self {
            SitePacing {
                rollout: s.rollout.clone(),
                rollout_uid: s.rollout_uid.clone(),
                site: s.pace.site.clone(),
                limit: s.pace.limit,
                canary: s.pace.canary,
                timeout_seconds: s.pace.timeout_seconds,
            }
        }
    }

    impl TryFrom<&SitePacing> for crate::site_pacing::SitePacing {
        type Error = String;

        fn try_from(s: &SitePacing) -> Result<Self, String> {
            if s.limit == 0 {
                return Err(format!("site {:?} has a limit of 0", s.site));
            }
            Ok(crate::site_pacing::SitePacing {
                rollout: s.rollout.clone(),
                rollout_uid: s.rollout_uid.clone(),
                pace: crate::site_pacing::SitePace {
                    site: s.site.clone(),
                    limit: s.limit,
                    canary: s.canary,
                    timeout_seconds: s.timeout_seconds,
                },
            })
        }
    }

    impl From<&pure::SiteRollback> for SiteRollback {
        fn from(s: &pure::SiteRollback) -> Self {
            let previous = &s.previous;
            SiteRollback {
                rollout: s.rollout.clone(),
                rollout_uid: s.rollout_uid.clone(),
                percent: u32::from(s.threshold.percent),
                min_sample: s.threshold.min_sample,
                classes: s
                    .threshold
                    .classes
                    .iter()
                    .map(|c| class_name(*c).into())
                    .collect(),
                whole_site: s.threshold.whole_site,
                firmware_changed: previous.firmware_changed,
                previous_firmware: previous.firmware.as_ref().map(|f| Firmware {
                    version: f.version.clone(),
                    url: f.url.clone().unwrap_or_default(),
                    sha256: f.sha256.clone().unwrap_or_default(),
                }),
                previous_properties: previous
                    .properties
                    .iter()
                    .filter_map(|(k, v)| Some((k.clone(), v.as_ref()?.into())))
                    .collect(),
                previous_unset: previous
                    .properties
                    .iter()
                    .filter(|(_, v)| v.is_none())
                    .map(|(k, _)| k.clone())
                    .collect(),
            }
        }
    }

    impl TryFrom<&SiteRollback> for pure::SiteRollback {
        type Error = String;

        fn try_from(s: &SiteRollback) -> Result<Self, String> {
            let percent = u8::try_from(s.percent)
                .ok()
                .filter(|p| *p <= 100)
                .ok_or_else(|| format!("site rollback percent {} is over 100", s.percent))?;
            let mut properties = BTreeMap::new();
            for (name, value) in &s.previous_properties {
                let value = crate::PropertyValue::try_from(value).map_err(|e| e.to_string())?;
                properties.insert(name.clone(), Some(value));
            }
            for name in &s.previous_unset {
                properties.insert(name.clone(), None);
            }
            Ok(pure::SiteRollback {
                rollout: s.rollout.clone(),
                rollout_uid: s.rollout_uid.clone(),
                threshold: SiteThreshold {
                    percent,
                    min_sample: s.min_sample,
                    classes: s
                        .classes
                        .iter()
                        .map(|c| class_of(c))
                        .collect::<Result<_, _>>()?,
                    whole_site: s.whole_site,
                },
                previous: Previous {
                    firmware_changed: s.firmware_changed,
                    firmware: s.previous_firmware.as_ref().map(|f| FirmwareSpec {
                        version: f.version.clone(),
                        url: (!f.url.is_empty()).then(|| f.url.clone()),
                        sha256: (!f.sha256.is_empty()).then(|| f.sha256.clone()),
                    }),
                    properties,
                },
            })
        }
    }

    impl From<&pure::EdgeRollback> for EdgeRollback {
        fn from(r: &pure::EdgeRollback) -> Self {
            EdgeRollback {
                rollout: r.rollout.clone(),
                generation: r.generation,
                at_ms: r.at_ms,
                message: r.message.clone(),
            }
        }
    }

    impl From<EdgeRollback> for pure::EdgeRollback {
        fn from(r: EdgeRollback) -> Self {
            pure::EdgeRollback {
                rollout: r.rollout,
                generation: r.generation,
                at_ms: r.at_ms,
                message: r.message,
            }
        }
    }

    impl From<crate::site_pacing::HeldAtEdge> for HeldAtEdge {
        fn from(h: crate::site_pacing::HeldAtEdge) -> Self {
            HeldAtEdge {
                rollout: h.rollout,
                generation: h.generation,
                since_ms: h.since_ms,
                message: h.message,
            }
        }
    }

    impl From<HeldAtEdge> for crate::site_pacing::HeldAtEdge {
        fn from(h: HeldAtEdge) -> Self {
            crate::site_pacing::HeldAtEdge {
                rollout: h.rollout,
                generation: h.generation,
                since_ms: h.since_ms,
                message: h.message,
            }
        }
    }

    #[cfg(test)]
    mod tests {
        use super::*;
        use crate::PropertyValue;

        #[test]
        fn a_site_rollback_survives_the_wire() {
            let plan = pure::SiteRollback {
                rollout: "fw-2".into(),
                rollout_uid: "u-1".into(),
                threshold: SiteThreshold {
                    percent: 40,
                    min_sample: 3,
                    classes: vec![FailureClass::HealthFailed, FailureClass::TimedOut],
                    whole_site: true,
                },
                previous: Previous {
                    firmware_changed: true,
                    firmware: Some(FirmwareSpec {
                        version: "1.0.0".into(),
                        url: Some("https://fw/1".into()),
                        sha256: None,
                    }),
                    properties: BTreeMap::from([
                        ("setpoint".to_owned(), Some(PropertyValue::Float(21.0))),
                        ("mode".to_owned(), None),
                    ]),
                },
            };
            let wire = SiteRollback::from(&plan);
            assert_eq!(pure::SiteRollback::try_from(&wire).unwrap(), plan);
            let mut bad = wire.clone();
            bad.percent = 101;
            assert!(pure::SiteRollback::try_from(&bad).is_err());
            let mut bad = wire;
            bad.classes.push("Cosmic".into());
            assert!(pure::SiteRollback::try_from(&bad).is_err());
        }

        #[test]
        fn a_site_pacing_survives_the_wire() {
            let pacing = crate::site_pacing::SitePacing {
                rollout: "fw-2".into(),
                rollout_uid: "u-1".into(),
                pace: crate::site_pacing::SitePace {
                    site: "plant-a".into(),
                    limit: 2,
                    canary: true,
                    timeout_seconds: 900,
                },
            };
            let wire = SitePacing::from(&pacing);
            assert_eq!(
                crate::site_pacing::SitePacing::try_from(&wire).unwrap(),
                pacing
            );
            let bad = SitePacing { limit: 0, ..wire };
            assert!(crate::site_pacing::SitePacing::try_from(&bad).is_err());
        }
    }
}
