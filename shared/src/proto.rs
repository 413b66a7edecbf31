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
