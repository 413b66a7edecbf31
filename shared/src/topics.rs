//! The MQTT topic layout between an agent and its site's devices.
//!
//! ```text
//! edgefleet/<node>/<namespace>/<name>/desired   agent → device, retained, CBOR DesiredState
//! edgefleet/<node>/<namespace>/<name>/report    device → agent, CBOR DeviceReport
//! edgefleet/<node>/<namespace>/<name>/event     device → agent, CBOR DeviceEvent
//! edgefleet/<node>/<namespace>/<name>/event-ack agent → device, CBOR EventAck
//! ```
//!
//! An event is resent by the device until its `event-ack` arrives: the
//! broker's PUBACK only says the broker has it, not that the agent stored it.
//!
//! The desired topic is retained, so a device that (re)connects gets its
//! state at once; a Device that is deleted gets an empty retained message,
//! which clears it. The node is part of the topic so that several nodes can
//! share one broker.

use crate::key::ResourceKey;

/// The first level of every Edgefleet topic.
pub const ROOT: &str = "edgefleet";

/// Where the agent publishes a device's desired state (retained).
pub fn desired(node: &str, device: &ResourceKey) -> String {
    format!("{ROOT}/{node}/{}/{}/desired", device.namespace, device.name)
}

/// Where a device publishes its reports.
pub fn report(node: &str, device: &ResourceKey) -> String {
    format!("{ROOT}/{node}/{}/{}/report", device.namespace, device.name)
}

/// Where a device publishes its events.
pub fn event(node: &str, device: &ResourceKey) -> String {
    format!("{ROOT}/{node}/{}/{}/event", device.namespace, device.name)
}

/// Where the agent acknowledges a device's stored events.
pub fn event_ack(node: &str, device: &ResourceKey) -> String {
    format!(
        "{ROOT}/{node}/{}/{}/event-ack",
        device.namespace, device.name
    )
}

/// The filter an agent subscribes to for every report of its node.
pub fn reports_of(node: &str) -> String {
    format!("{ROOT}/{node}/+/+/report")
}

/// The filter an agent subscribes to for every event of its node.
pub fn events_of(node: &str) -> String {
    format!("{ROOT}/{node}/+/+/event")
}

/// What a device sends its agent over MQTT.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Uplink {
    /// A report (`…/report`).
    Report,
    /// An event (`…/event`).
    Event,
}

/// The device and kind of a device → agent topic of `node`, or `None` for
/// any other topic.
pub fn parse_uplink(node: &str, topic: &str) -> Option<(ResourceKey, Uplink)> {
    let mut parts = topic.split('/');
    let (Some(ROOT), Some(n), Some(namespace), Some(name), Some(kind), None) = (
        parts.next(),
        parts.next(),
        parts.next(),
        parts.next(),
        parts.next(),
        parts.next(),
    ) else {
        return None;
    };
    let kind = match kind {
        "report" => Uplink::Report,
        "event" => Uplink::Event,
        _ => return None,
    };
    (n == node && !namespace.is_empty() && !name.is_empty())
        .then(|| (ResourceKey::device(namespace, name), kind))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn report_topics_round_trip() {
        let key = ResourceKey::device("plant", "t1");
        assert_eq!(report("edge-1", &key), "edgefleet/edge-1/plant/t1/report");
        assert_eq!(
            parse_uplink("edge-1", &report("edge-1", &key)),
            Some((key.clone(), Uplink::Report))
        );
        assert_eq!(desired("edge-1", &key), "edgefleet/edge-1/plant/t1/desired");
    }

    #[test]
    fn event_topics_are_told_from_report_topics() {
        let key = ResourceKey::device("plant", "t1");
        assert_eq!(
            parse_uplink("edge-1", &event("edge-1", &key)),
            Some((key.clone(), Uplink::Event))
        );
        assert_eq!(
            parse_uplink("edge-1", &report("edge-1", &key)),
            Some((key.clone(), Uplink::Report))
        );
        for topic in [
            event_ack("edge-1", &key),
            event("edge-2", &key),
            "edgefleet/edge-1/plant/event".to_owned(),
            "edgefleet/edge-1/plant/t1/event/x".to_owned(),
        ] {
            assert_eq!(parse_uplink("edge-1", &topic), None, "{topic}");
        }
    }

    #[test]
    fn other_topics_are_not_reports() {
        for topic in [
            "edgefleet/edge-2/plant/t1/report",
            "edgefleet/edge-1/plant/t1/desired",
            "edgefleet/edge-1/plant/report",
            "edgefleet/edge-1//t1/report",
            "other/edge-1/plant/t1/report",
            "edgefleet/edge-1/plant/t1/report/x",
        ] {
            assert_eq!(parse_uplink("edge-1", topic), None, "{topic}");
        }
    }
}
