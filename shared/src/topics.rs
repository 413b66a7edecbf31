//! The MQTT topic layout between an agent and its site's devices.
//!
//! ```text
//! edgefleet/<node>/<namespace>/<name>/desired   agent → device, retained, CBOR DesiredState
//! edgefleet/<node>/<namespace>/<name>/report    device → agent, CBOR DeviceReport
//! ```
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

/// The filter an agent subscribes to for every report of its node.
pub fn reports_of(node: &str) -> String {
    format!("{ROOT}/{node}/+/+/report")
}

/// The device a report topic of `node` is about, or `None` for any other
/// topic.
pub fn parse_report(node: &str, topic: &str) -> Option<ResourceKey> {
    let mut parts = topic.split('/');
    let (Some(ROOT), Some(n), Some(namespace), Some(name), Some("report"), None) = (
        parts.next(),
        parts.next(),
        parts.next(),
        parts.next(),
        parts.next(),
        parts.next(),
    ) else {
        return None;
    };
    (n == node && !namespace.is_empty() && !name.is_empty())
        .then(|| ResourceKey::device(namespace, name))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn report_topics_round_trip() {
        let key = ResourceKey::device("plant", "t1");
        assert_eq!(report("edge-1", &key), "edgefleet/edge-1/plant/t1/report");
        assert_eq!(
            parse_report("edge-1", &report("edge-1", &key)),
            Some(key.clone())
        );
        assert_eq!(desired("edge-1", &key), "edgefleet/edge-1/plant/t1/desired");
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
            assert_eq!(parse_report("edge-1", topic), None, "{topic}");
        }
    }
}
