//! The agent's side of a sync session as a state machine, without I/O.
//!
//! The tonic driver ([`super`]) hands it what the cloud sends and carries
//! out the [`Step`] it answers with: store desired state durably and only
//! then reply, drop acknowledged entries from the outbox, list what the
//! store holds. The deterministic simulator (`edgefleet_tests::sim`) runs
//! the same machine against a simulated store and network.
//!
//! An Update is judged resource by resource: the valid ones are stored and
//! the reply is an Ack, or a Nack naming only the resources refused —
//! everything else in that Update is stored all the same.

use std::collections::{BTreeMap, VecDeque};

use edgefleet_shared::api::Transport;
use edgefleet_shared::codec::FirmwareOrder;
use edgefleet_shared::credential::Psk;
use edgefleet_shared::health_check::{HealthCheck, HealthStage};
use edgefleet_shared::holdings::HoldingsDigest;
use edgefleet_shared::key::ResourceKind;
use edgefleet_shared::proto::{self, Flow, agent_message, cloud_message, resource, uplink_entry};
use edgefleet_shared::{PropertyValue, ResourceKey, ResourceVersion};
use prost::Message;

use crate::store::{Desired, DesiredDevice, HeldCredential, HeldRule, PendingUplink};

/// What the driver is to do with a message from the cloud.
#[derive(Clone, Debug, PartialEq)]
pub enum Step {
    /// Store these upserts and removals durably, then send `reply`.
    Store {
        /// Desired state and rules to store.
        upserts: Vec<(ResourceKey, Desired)>,
        /// Keys to remove.
        removals: Vec<ResourceKey>,
        /// The Ack, or the Nack naming what was refused.
        reply: agent_message::Kind,
    },
    /// The cloud made the reports up to `reports` and the events up to
    /// `events` durable: drop them from the outbox.
    UplinkAcked {
        /// Reports acknowledged up to this sequence number.
        reports: u64,
        /// Events acknowledged up to this sequence number.
        events: u64,
    },
    /// The cloud asks what the store holds: send [`inventory`], in parts
    /// if it allows them.
    ListHoldings {
        /// Whether the cloud takes the list in parts.
        parts: bool,
    },
    /// Nothing to do (a heartbeat).
    Nothing,
}

/// The agent's side of one session: the uplink window of each flow.
#[derive(Debug, Default)]
pub struct Session {
    reports: InFlight,
    events: InFlight,
}

impl Session {
    /// What to do with a message from the cloud.
    pub fn received(&mut self, message: proto::CloudMessage) -> Step {
        match message.kind {
            Some(cloud_message::Kind::Update(update)) => plan_update(update),
            Some(cloud_message::Kind::UplinkAck(ack)) => {
                let (reports, events) = (ack.of(Flow::Reports), ack.of(Flow::Events));
                self.reports.acknowledged(reports);
                self.events.acknowledged(events);
                Step::UplinkAcked { reports, events }
            }
            Some(cloud_message::Kind::InventoryRequest(request)) => Step::ListHoldings {
                parts: request.parts,
            },
            Some(cloud_message::Kind::Heartbeat(_)) | None => Step::Nothing,
        }
    }

    /// Where the next uplink batch of `flow` starts (entries after this
    /// sequence number) and how many entries it may hold.
    pub fn next_batch(&self, flow: Flow, max: usize) -> (u64, usize) {
        let in_flight = self.in_flight(flow);
        (in_flight.sent_up_to(), in_flight.room().min(max))
    }

    fn in_flight(&self, flow: Flow) -> &InFlight {
        match flow {
            Flow::Reports => &self.reports,
            Flow::Events => &self.events,
        }
    }

    /// The Uplink message for a batch read from the outbox; the entries
    /// count as in flight (each in its flow) from now on.
    pub fn uplink(&mut self, batch: Vec<(u64, PendingUplink)>) -> proto::Uplink {
        for (seq, pending) in &batch {
            match pending.flow() {
                Flow::Reports => self.reports.sent([*seq]),
                Flow::Events => self.events.sent([*seq]),
            }
        }
        proto::Uplink {
            entries: batch
                .into_iter()
                .map(|(seq, pending)| proto::UplinkEntry {
                    seq,
                    body: Some(uplink_body(pending)),
                })
                .collect(),
        }
    }
}

/// The Hello of an agent whose store `store_id` holds `held`: the
/// holdings go as a digest, and the cloud asks for the list if needed.
pub fn hello<'a>(
    node: &str,
    agent_version: &str,
    boot_id: &str,
    store_id: &str,
    held: impl IntoIterator<Item = (&'a ResourceKey, &'a ResourceVersion)>,
) -> proto::Hello {
    let digest = HoldingsDigest::of(held);
    proto::Hello {
        node: node.to_owned(),
        agent_version: agent_version.to_owned(),
        boot_id: boot_id.to_owned(),
        held: Vec::new(),
        store_id: store_id.to_owned(),
        held_digest: digest.to_bytes(),
        held_count: digest.count(),
        uplink_flows: true,
    }
}

/// The answer to an InventoryRequest: in parts of at most
/// [`proto::MAX_BATCH_BYTES`] when the cloud allows `parts`, else whole.
pub fn inventory(held: &[(ResourceKey, ResourceVersion)], parts: bool) -> Vec<proto::Inventory> {
    let held: Vec<proto::HeldResource> = held
        .iter()
        .map(|(key, version)| proto::HeldResource {
            key: key.to_string(),
            version: Some(version.into()),
        })
        .collect();
    if !parts {
        return vec![proto::Inventory { held, more: false }];
    }
    let batches = proto::batches_by_bytes(held, |h| h.encoded_len() + 4);
    let last = batches.len() - 1;
    batches
        .into_iter()
        .enumerate()
        .map(|(i, held)| proto::Inventory {
            held,
            more: i < last,
        })
        .collect()
}

/// Judges an Update resource by resource: what to store, and the reply to
/// send once it is durable.
pub fn plan_update(update: proto::Update) -> Step {
    let mut upserts = Vec::with_capacity(update.upserts.len());
    let mut rejected = Vec::new();
    for resource in update.upserts {
        match desired(&resource) {
            Ok(entry) => upserts.push(entry),
            Err(reason) => rejected.push(proto::RejectedResource {
                key: resource.key,
                reason,
            }),
        }
    }
    let mut removals = Vec::with_capacity(update.removals.len());
    for key in update.removals {
        match key.parse::<ResourceKey>() {
            Ok(parsed) => removals.push(parsed),
            Err(e) => rejected.push(proto::RejectedResource {
                key,
                reason: e.to_string(),
            }),
        }
    }
    let reply = if rejected.is_empty() {
        agent_message::Kind::Ack(proto::Ack {
            nonce: update.nonce,
        })
    } else {
        agent_message::Kind::Nack(proto::Nack {
            nonce: update.nonce,
            rejected,
        })
    };
    Step::Store {
        upserts,
        removals,
        reply,
    }
}

/// A resource of an Update as the store keeps it, or why it is refused.
fn desired(resource: &proto::Resource) -> Result<(ResourceKey, Desired), String> {
    let key: ResourceKey = resource
        .key
        .parse()
        .map_err(|e: edgefleet_shared::key::ResourceKeyError| e.to_string())?;
    let version: ResourceVersion = resource.version.as_ref().ok_or("no version")?.into();
    match (&key.kind, &resource.body) {
        (ResourceKind::Device, Some(resource::Body::Device(device))) => {
            Ok((key, desired_device(version, device)?.into()))
        }
        (ResourceKind::Rule, Some(resource::Body::Rule(rule))) => {
            Ok((key, Desired::Rule(Box::new(held_rule(version, rule)?))))
        }
        (ResourceKind::Credential, Some(resource::Body::Credential(c))) => {
            if (c.namespace.as_str(), c.device.as_str()) != (&key.namespace, &key.name) {
                return Err(format!(
                    "{key} carries the key of device {}/{}",
                    c.namespace, c.device
                ));
            }
            let psk = Psk::new(c.psk.clone()).map_err(|e| format!("{key}: {e}"))?;
            Ok((key, Desired::Credential(HeldCredential { version, psk })))
        }
        _ => Err(format!("{key} has no body of its kind")),
    }
}

/// A rule as the store keeps it: one whose `when` compiles, whose values
/// are values and whose event is an event; else why not.
fn held_rule(version: ResourceVersion, rule: &proto::RuleDesired) -> Result<HeldRule, String> {
    edgefleet_shared::rule_when::When::compile(&rule.when).map_err(|e| e.to_string())?;
    for (property, value) in &rule.set {
        PropertyValue::try_from(value).map_err(|e| format!("then.set.{property}: {e}"))?;
    }
    if let Some(event) = &rule.event
        && !matches!(
            proto::EventType::try_from(event.r#type),
            Ok(proto::EventType::Normal | proto::EventType::Warning)
        )
    {
        return Err(format!("unknown event type {}", event.r#type));
    }
    Ok(HeldRule {
        version,
        rule: rule.clone(),
    })
}

/// A Device's desired state as the store keeps it, or why it is refused.
fn desired_device(
    version: ResourceVersion,
    device: &proto::DeviceDesired,
) -> Result<DesiredDevice, String> {
    let transport = match proto::Transport::try_from(device.transport) {
        Ok(proto::Transport::Coap) => Transport::Coap,
        Ok(proto::Transport::Mqtt) => Transport::Mqtt,
        _ => return Err(format!("unknown transport {}", device.transport)),
    };
    let properties = device
        .properties
        .iter()
        .map(|(k, v)| Ok((k.clone(), PropertyValue::try_from(v)?)))
        .collect::<Result<BTreeMap<_, _>, proto::MissingField>>()
        .map_err(|e| e.to_string())?;
    let firmware = device.firmware.as_ref().map(|f| FirmwareOrder {
        version: f.version.clone(),
        url: (!f.url.is_empty()).then(|| f.url.clone()),
        sha256: (!f.sha256.is_empty()).then(|| f.sha256.clone()),
    });
    // A health check the agent could not run is refused now, with the
    // compiler's reason, not discovered at the device's first report.
    let health_check = match &device.health_check {
        Some(h) => {
            edgefleet_shared::health_gate::HealthGate::compile(&h.expression)
                .map_err(|e| format!("rollout {}: {e}", h.rollout))?;
            Some(HealthCheck {
                rollout: h.rollout.clone(),
                expression: h.expression.clone(),
                bake_seconds: h.bake_seconds,
            })
        }
        None => None,
    };
    let site_rollback = device
        .site_rollback
        .as_ref()
        .map(edgefleet_shared::site_rollback::SiteRollback::try_from)
        .transpose()?;
    let site_pacing = device
        .site_pacing
        .as_ref()
        .map(edgefleet_shared::site_pacing::SitePacing::try_from)
        .transpose()?;
    let desired = DesiredDevice {
        version,
        model: device.model.clone(),
        transport,
        properties,
        firmware,
        health_check,
        site_rollback,
        site_pacing,
        held_at_edge: None,
        released_at_ms: None,
        rolled_back_at_edge: None,
        overrides: BTreeMap::new(),
        local: 0,
        chain: 0,
    };
    // What the device cannot be sent is refused now, so the Device shows
    // it, not kept to fail at every delivery.
    edgefleet_shared::codec::encode(&desired.to_wire())
        .map_err(|e| format!("the desired state cannot be sent to the device: {e}"))?;
    Ok(desired)
}

/// The uplink entries of one flow sent in this session and not yet
/// acknowledged, at most [`proto::FLOW_WINDOW`].
#[derive(Debug, Default)]
pub struct InFlight {
    seqs: VecDeque<u64>,
    sent_up_to: u64,
}

impl InFlight {
    /// The highest sequence number sent in this session (0: none).
    pub fn sent_up_to(&self) -> u64 {
        self.sent_up_to
    }

    /// How many more entries may go now.
    pub fn room(&self) -> usize {
        proto::FLOW_WINDOW.saturating_sub(self.seqs.len())
    }

    pub fn sent(&mut self, seqs: impl IntoIterator<Item = u64>) {
        for seq in seqs {
            self.seqs.push_back(seq);
            self.sent_up_to = seq;
        }
    }

    pub fn acknowledged(&mut self, up_to: u64) {
        while self.seqs.front().is_some_and(|seq| *seq <= up_to) {
            self.seqs.pop_front();
        }
    }
}

/// An outbox entry as the sync protocol carries it.
pub fn uplink_body(pending: PendingUplink) -> uplink_entry::Body {
    match pending {
        PendingUplink::Report { device, latest } => uplink_entry::Body::Report(proto::Report {
            device_key: device.to_string(),
            applied_generation: latest.report.applied_generation,
            properties: latest
                .report
                .properties
                .iter()
                .map(|(k, v)| (k.clone(), v.into()))
                .collect(),
            firmware_failure: latest
                .report
                .firmware_failure
                .map(|f| proto::FirmwareFailure {
                    version: f.version,
                    reason: f.reason,
                }),
            health: latest.health.map(|h| proto::HealthVerdict {
                generation: h.generation,
                stage: match h.stage {
                    HealthStage::Baking => proto::HealthStage::Baking,
                    HealthStage::Passed => proto::HealthStage::Passed,
                    HealthStage::Failed => proto::HealthStage::Failed,
                    HealthStage::Inconclusive => proto::HealthStage::Inconclusive,
                } as i32,
                since_ms: h.since_ms,
                message: h.message,
            }),
            edge_rollback: latest.edge_rollback.as_ref().map(proto::EdgeRollback::from),
            held_at_edge: latest.held_at_edge.map(|h| proto::HeldAtEdge::from(*h)),
            overrides: edgefleet_shared::rule_engine::shown(&latest.overrides)
                .into_iter()
                .map(|(property, o, in_force)| proto::RuleOverride {
                    property,
                    rule: o.rule,
                    value: Some((&o.value).into()),
                    since_ms: o.since_ms,
                    in_force,
                })
                .collect(),
            firmware_version: latest.report.firmware_version.unwrap_or_default(),
            received_at_ms: latest.received_at_ms,
            device_uid: latest.uid,
        }),
        PendingUplink::Event { device, stored } => uplink_entry::Body::Event(proto::Event {
            device_key: device.to_string(),
            r#type: if stored.event.warning {
                proto::EventType::Warning
            } else {
                proto::EventType::Normal
            }
            .into(),
            reason: stored.event.reason,
            message: stored.event.message,
            at_ms: stored.at_ms,
            device_event_id: stored.event.id,
            device_boot: stored.event.boot,
            device_uid: stored.uid,
        }),
        PendingUplink::EventsDropped(dropped) => {
            uplink_entry::Body::EventsDropped(proto::EventsDropped {
                count: dropped.count,
                first_at_ms: dropped.first_at_ms,
                last_at_ms: dropped.last_at_ms,
                bound: dropped.bound,
            })
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn resource(name: &str, transport: proto::Transport) -> proto::Resource {
        proto::Resource {
            key: ResourceKey::device("plant", name).to_string(),
            version: Some((&ResourceVersion::new(format!("uid-{name}"), 1)).into()),
            body: Some(resource::Body::Device(proto::DeviceDesired {
                namespace: "plant".into(),
                name: name.into(),
                model: "thermostat".into(),
                transport: transport as i32,
                ..Default::default()
            })),
        }
    }

    #[test]
    fn a_large_inventory_goes_in_parts_when_the_cloud_allows_them() {
        // 20,000 resources with long names: about 2.5 MiB listed.
        let held: Vec<(ResourceKey, ResourceVersion)> = (0..20_000)
            .map(|i| {
                let name = format!("device-with-a-rather-long-name-{i:08}");
                (
                    ResourceKey::device("plant-floor-3", &name),
                    ResourceVersion::new(format!("0f3a2b6c-1d4e-4f5a-8b9c-{i:012}"), 1),
                )
            })
            .collect();
        let parts = inventory(&held, true);
        assert!(parts.len() >= 2, "{} parts", parts.len());
        for (i, part) in parts.iter().enumerate() {
            assert!(part.encoded_len() <= proto::MAX_BATCH_BYTES, "part {i}");
            assert_eq!(part.more, i + 1 < parts.len(), "part {i}");
        }
        let listed: Vec<String> = parts
            .iter()
            .flat_map(|p| p.held.iter().map(|h| h.key.clone()))
            .collect();
        let expected: Vec<String> = held.iter().map(|(k, _)| k.to_string()).collect();
        assert_eq!(listed, expected);

        // A cloud that reads one Inventory gets one.
        let whole = inventory(&held, false);
        assert_eq!(whole.len(), 1);
        assert!(!whole[0].more);
        assert_eq!(whole[0].held.len(), held.len());
        // Nothing held: one empty, last part.
        assert_eq!(inventory(&[], true), [proto::Inventory::default()]);
    }

    #[test]
    fn one_invalid_resource_is_refused_alone_and_the_rest_is_stored() {
        let update = proto::Update {
            nonce: "7".into(),
            upserts: vec![
                resource("a", proto::Transport::Coap),
                resource("bad", proto::Transport::Unspecified),
                resource("c", proto::Transport::Mqtt),
            ],
            removals: vec![ResourceKey::device("plant", "gone").to_string()],
        };
        let Step::Store {
            upserts,
            removals,
            reply,
        } = plan_update(update)
        else {
            panic!("an Update is stored");
        };
        let stored: Vec<String> = upserts.iter().map(|(k, _)| k.to_string()).collect();
        assert_eq!(stored, ["device/plant/a", "device/plant/c"]);
        assert_eq!(removals, [ResourceKey::device("plant", "gone")]);
        let agent_message::Kind::Nack(nack) = reply else {
            panic!("a refusal is a Nack");
        };
        assert_eq!(nack.nonce, "7");
        assert_eq!(nack.rejected.len(), 1);
        assert_eq!(nack.rejected[0].key, "device/plant/bad");
    }

    #[test]
    fn a_rule_the_agent_cannot_compile_is_refused_with_the_reason() {
        let rule = |when: &str| proto::Resource {
            key: ResourceKey::rule("plant", "overheat").to_string(),
            version: Some((&ResourceVersion::new("rule-uid", 7)).into()),
            body: Some(resource::Body::Rule(proto::RuleDesired {
                namespace: "plant".into(),
                name: "overheat".into(),
                when: when.into(),
                ..Default::default()
            })),
        };
        let (key, held) = desired(&rule("reported.temperature > 80.0")).unwrap();
        assert_eq!(key, ResourceKey::rule("plant", "overheat"));
        assert!(matches!(held, Desired::Rule(_)));
        let reason = desired(&rule("reported.temperature >")).unwrap_err();
        assert!(reason.contains("does not compile"), "{reason}");
        // A body that is not of its key's kind.
        let mut crossed = rule("online");
        crossed.key = ResourceKey::device("plant", "overheat").to_string();
        assert!(
            desired(&crossed)
                .unwrap_err()
                .contains("no body of its kind")
        );
    }

    #[test]
    fn a_desired_state_too_large_for_a_device_message_is_refused() {
        let mut big = resource("big", proto::Transport::Coap);
        if let Some(resource::Body::Device(d)) = &mut big.body {
            d.properties.insert(
                "label".into(),
                (&PropertyValue::String("x".repeat(edgefleet_shared::codec::MAX_MESSAGE_BYTES)))
                    .into(),
            );
        }
        let reason = desired(&big).unwrap_err();
        assert!(reason.contains("cannot be sent to the device"), "{reason}");
        assert!(desired(&resource("small", proto::Transport::Coap)).is_ok());
    }

    #[test]
    fn the_window_closes_when_full_and_opens_with_acknowledgements() {
        let mut in_flight = InFlight::default();
        assert_eq!(in_flight.room(), proto::FLOW_WINDOW);
        // Sequence numbers have gaps where reports were compacted.
        in_flight.sent((1..=proto::FLOW_WINDOW as u64).map(|n| n * 2));
        assert_eq!(in_flight.room(), 0);
        assert_eq!(in_flight.sent_up_to, proto::FLOW_WINDOW as u64 * 2);
        in_flight.acknowledged(9); // covers 2, 4, 6, 8
        assert_eq!(in_flight.room(), 4);
        in_flight.acknowledged(9); // a repeated acknowledgement frees nothing
        assert_eq!(in_flight.room(), 4);
        in_flight.acknowledged(u64::MAX);
        assert_eq!(in_flight.room(), proto::FLOW_WINDOW);
    }

    fn event(seq: u64) -> (u64, PendingUplink) {
        let stored = crate::store::StoredEvent {
            device: "device/plant/a".into(),
            at_ms: 0,
            uid: "uid-a".into(),
            event: edgefleet_shared::codec::DeviceEvent {
                id: seq,
                boot: 0,
                warning: false,
                reason: "SelfCheck".into(),
                message: String::new(),
            },
        };
        let device = ResourceKey::device("plant", "a");
        (seq, PendingUplink::Event { device, stored })
    }

    fn report(seq: u64) -> (u64, PendingUplink) {
        let latest = crate::store::LatestReport {
            seq,
            received_at_ms: 0,
            queued_at_ms: 0,
            uid: "uid-a".into(),
            report: edgefleet_shared::codec::DeviceReport {
                applied_generation: 1,
                properties: BTreeMap::new(),
                firmware_version: None,
                firmware_failure: None,
            },
            health: None,
            edge_rollback: None,
            held_at_edge: None,
            overrides: BTreeMap::new(),
        };
        let device = ResourceKey::device("plant", "a");
        (seq, PendingUplink::Report { device, latest })
    }

    fn ack(seq: u64, reports_seq: u64, events_seq: u64) -> proto::CloudMessage {
        proto::CloudMessage {
            kind: Some(cloud_message::Kind::UplinkAck(proto::UplinkAck {
                seq,
                reports_seq,
                events_seq,
            })),
        }
    }

    #[test]
    fn a_full_window_of_events_leaves_the_reports_window_open() {
        let mut session = Session::default();
        let events = (1..=proto::FLOW_WINDOW as u64).map(event).collect();
        session.uplink(events);
        assert_eq!(session.next_batch(Flow::Events, 256).1, 0);
        let after = proto::FLOW_WINDOW as u64;
        assert_eq!(session.next_batch(Flow::Reports, 256), (0, 256));
        session.uplink(vec![report(after + 1)]);
        // The cloud made the report durable, none of the events.
        let step = session.received(ack(0, after + 1, 0));
        assert_eq!(
            step,
            Step::UplinkAcked {
                reports: after + 1,
                events: 0
            }
        );
        assert_eq!(session.next_batch(Flow::Reports, 256), (after + 1, 256));
        assert_eq!(session.next_batch(Flow::Events, 256).1, 0);
        // A cloud that knows no flows acknowledges both up to one point.
        let step = session.received(ack(10, 0, 0));
        assert_eq!(
            step,
            Step::UplinkAcked {
                reports: 10,
                events: 10
            }
        );
        assert_eq!(session.next_batch(Flow::Events, 256).1, 10);
    }
}
