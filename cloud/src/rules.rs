//! The EdgeRule reconciler: judges each rule the way its agents will (its
//! `when` compiled, its selectors parsed) and shows the verdict as the
//! `Accepted` condition, with the compiler's message when it is refused;
//! counts the Devices it watches.
//!
//! An accepted rule goes into the index once per node it concerns, with its
//! selectors resolved to that node's Devices ([`node_bodies`]); the sync
//! streams send each agent the difference. A refused or deleted rule leaves
//! every node. The finalizer [`FINALIZER`] makes sure a deletion is seen.
//! Device changes re-run every rule, so a relabelled Device joins or leaves
//! the rules that select it.

use std::collections::{BTreeMap, BTreeSet, HashMap};
use std::sync::Arc;
use std::time::Duration;

use edgefleet_shared::api::rule::{EdgeRule, EdgeRuleSpec, EdgeRuleStatus};
use edgefleet_shared::api::{Device, EdgeNode};
use edgefleet_shared::model::{self, Misfit};
use edgefleet_shared::rule_when::When;
use edgefleet_shared::{ResourceKey, ResourceVersion, proto};
use futures::{Stream, StreamExt};
use k8s_openapi::apimachinery::pkg::apis::meta::v1::{Condition, LabelSelector, Time};
use k8s_openapi::jiff::Timestamp;
use kube::api::{Patch, PatchParams};
use kube::core::{Selector, SelectorExt};
use kube::runtime::controller::Action;
use kube::runtime::finalizer::{self, finalizer};
use kube::runtime::reflector::{ObjectRef, Store};
use kube::runtime::{Controller, watcher};
use kube::{Api, Client, Resource, ResourceExt};

use crate::events::{Events, Note};
use crate::index::{Index, Indexed};
use crate::status::StatusWriter;

/// The field manager of the rule reconciler's status writes.
pub const FIELD_MANAGER: &str = "edgefleet-rules";

/// The finalizer on every rule the controller has seen.
pub const FINALIZER: &str = "edgefleet.io/rule";

/// What the reconciler works with.
pub struct Context {
    // The singletons' client: it writes only while this replica leads.
    client: Client,
    fence: crate::leases::Fence,
    devices: Store<Device>,
    edge_nodes: Store<EdgeNode>,
    budget: StatusWriter,
    events: Events,
    index: Arc<Index>,
}

impl std::fmt::Debug for Context {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("rules::Context").finish_non_exhaustive()
    }
}

impl Context {
    /// The reconciler's context; `budget` paces its writes.
    pub fn new(
        fence: crate::leases::Fence,
        devices: Store<Device>,
        edge_nodes: Store<EdgeNode>,
        budget: StatusWriter,
        events: Events,
        index: Arc<Index>,
    ) -> Self {
        Context {
            client: fence.leader(),
            fence,
            devices,
            edge_nodes,
            budget,
            events,
            index,
        }
    }
}

/// Starts reconciling the EdgeRules of `api`; every item of
/// `device_changes` looks at all of them again. Returns once every rule
/// listed is in the index (so an agent connecting after this is not told
/// to drop its rules), with the reconciler to run until the process ends.
pub async fn start(
    api: Api<EdgeRule>,
    context: Arc<Context>,
    device_changes: impl Stream<Item = ()> + Send + 'static,
) -> anyhow::Result<impl Future<Output = ()> + Send + 'static> {
    let controller = Controller::new(api, watcher::Config::default());
    let rules = controller.store();
    // Every replica places rules in its index; the leader writes their
    // status and finalizer, and one that takes over looks at them all.
    let triggers = futures::stream::select(device_changes, context.fence.changes());
    let running = controller
        .reconcile_all_on(triggers)
        .run(reconcile, error_policy, Arc::clone(&context))
        .for_each(|result| async move {
            if let Err(error) = result {
                tracing::debug!(%error, "rule reconcile did not finish");
            }
        });
    let mut running = Box::pin(running);
    // The store fills only while the controller runs.
    tokio::select! {
        ready = rules.wait_until_ready() => ready?,
        () = &mut running => anyhow::bail!("the rule reconciler ended before it listed the rules"),
    }
    for rule in rules.state() {
        if rule.metadata.deletion_timestamp.is_none() {
            // A refused rule is judged (and shown) by its reconcile.
            let _ = context.distribute(&rule);
        }
    }
    Ok(running)
}

/// A failed write; the rule is looked at again shortly.
#[derive(Debug, thiserror::Error)]
#[error(transparent)]
pub struct Error(#[from] kube::Error);

fn error_policy(rule: Arc<EdgeRule>, error: &finalizer::Error<Error>, _: Arc<Context>) -> Action {
    tracing::warn!(rule = %rule.name_any(), %error, "rule reconcile failed; retrying");
    Action::requeue(Duration::from_secs(2))
}

/// Why a rule is refused: what a person must fix.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Refusal {
    /// The `Accepted` condition's reason.
    pub reason: &'static str,
    /// Its message.
    pub message: String,
}

/// The parsed selectors of an accepted rule.
#[derive(Debug)]
pub struct Judged {
    /// The properties `when` reads off `reported`.
    reads: BTreeSet<String>,
    devices: Selector,
    nodes: Option<Selector>,
    targets: Option<Selector>,
}

/// Judges `spec` as its agents will: its parsed selectors if they can run
/// it, else why not.
pub fn judge(spec: &EdgeRuleSpec) -> Result<Judged, Refusal> {
    let when = When::compile(&spec.when).map_err(|e| Refusal {
        reason: "InvalidExpression",
        message: e.to_string(),
    })?;
    let selector = |field: &str, s: &LabelSelector| {
        Selector::try_from(s.clone()).map_err(|e| Refusal {
            reason: "InvalidSelector",
            message: format!("{field}: {e}"),
        })
    };
    let targets = spec
        .then
        .target
        .as_ref()
        .map(|t| selector("spec.then.target", t))
        .transpose()?;
    Ok(Judged {
        reads: when.reads(),
        targets,
        devices: selector("spec.selector", &spec.selector)?,
        nodes: spec
            .node_selector
            .as_ref()
            .map(|s| selector("spec.nodeSelector", s))
            .transpose()?,
    })
}

async fn reconcile(
    rule: Arc<EdgeRule>,
    context: Arc<Context>,
) -> Result<Action, finalizer::Error<Error>> {
    if !context.fence.leads() {
        match rule.metadata.deletion_timestamp {
            Some(_) => context.index.unplace(&key_of(&rule)),
            None => drop(context.distribute(&rule)),
        }
        return Ok(Action::await_change());
    }
    let api: Api<EdgeRule> = Api::namespaced(
        context.client.clone(),
        &rule.namespace().unwrap_or_default(),
    );
    finalizer(&api, FINALIZER, rule, |event| async {
        match event {
            finalizer::Event::Apply(rule) => context.judge(rule).await,
            finalizer::Event::Cleanup(rule) => {
                context.index.unplace(&key_of(&rule));
                Ok(Action::await_change())
            }
        }
    })
    .await
}

fn key_of(rule: &EdgeRule) -> ResourceKey {
    ResourceKey::rule(rule.namespace().unwrap_or_default(), rule.name_any())
}

impl Context {
    /// Puts `rule` on the nodes it concerns, or takes it off them all if
    /// it is refused; how many Devices it watches.
    fn distribute(&self, rule: &EdgeRule) -> Result<u32, Refusal> {
        let key = key_of(rule);
        let devices = self.devices.state();
        let judged =
            match judge(&rule.spec).and_then(|j| has_target(rule, &j, &devices).map(|()| j)) {
                Ok(judged) => judged,
                Err(refusal) => {
                    self.index.unplace(&key);
                    return Err(refusal);
                }
            };
        let bodies = node_bodies(rule, &judged, &devices, |node| {
            self.edge_nodes
                .get(&ObjectRef::new(node))
                .map(|n| n.labels().clone())
        });
        if let Err(refusal) = fits_models(rule, &judged, &bodies, &devices) {
            self.index.unplace(&key);
            return Err(refusal);
        }
        let watched = bodies
            .values()
            .map(|b| match &b.body {
                proto::resource::Body::Rule(r) => r.watched.len(),
                proto::resource::Body::Device(_) | proto::resource::Body::Credential(_) => 0,
            })
            .sum::<usize>();
        self.index.place(&key, bodies);
        Ok(u32::try_from(watched).unwrap_or(u32::MAX))
    }

    async fn judge(&self, rule: Arc<EdgeRule>) -> Result<Action, Error> {
        let context = self;
        let current = rule.status.clone().unwrap_or_default();
        let mut status = EdgeRuleStatus {
            observed_generation: rule.metadata.generation,
            ..current.clone()
        };
        let accepted = match context.distribute(&rule) {
            Ok(devices) => {
                status.devices = devices;
                condition(true, "Valid", String::new(), rule.metadata.generation)
            }
            Err(refusal) => {
                status.devices = 0;
                condition(
                    false,
                    refusal.reason,
                    refusal.message,
                    rule.metadata.generation,
                )
            }
        };
        let was = current
            .conditions
            .iter()
            .find(|c| c.type_ == "Accepted")
            .cloned();
        crate::conditions::set(&mut status.conditions, accepted.clone());
        let outcome = outcome(&rule, &context.devices.state());
        status.last_acted_at = outcome.last_acted.or(status.last_acted_at);
        crate::conditions::set(
            &mut status.conditions,
            overridden(&outcome.outranked, rule.metadata.generation),
        );
        if status != current {
            let refused_now = accepted.status == "False"
                && was
                    .as_ref()
                    .is_none_or(|w| w.status != "False" || w.message != accepted.message);
            if refused_now {
                context.events.publish(
                    rule.object_ref(&()),
                    Note {
                        warning: true,
                        reason: "Invalid",
                        action: "Validate",
                        text: accepted.message.clone(),
                    },
                );
            }
            context.budget.spend().await;
            let api: Api<EdgeRule> = Api::namespaced(
                context.client.clone(),
                &rule.namespace().unwrap_or_default(),
            );
            let patch = serde_json::json!({
                "apiVersion": "edgefleet.io/v1alpha1",
                "kind": "EdgeRule",
                "status": status,
            });
            api.patch_status(
                &rule.name_any(),
                &PatchParams::apply(FIELD_MANAGER).force(),
                &Patch::Apply(&patch),
            )
            .await?;
        }
        Ok(Action::await_change())
    }
}

/// What each node's agent must hold of an accepted `rule`: its spec with
/// the devices of that node it watches (with their labels, for `when`) and
/// those its `then.target` selects, under a version that changes whenever
/// the body does. Nodes without a watched device get nothing.
pub fn node_bodies(
    rule: &EdgeRule,
    judged: &Judged,
    devices: &[Arc<Device>],
    node_labels: impl Fn(&str) -> Option<BTreeMap<String, String>>,
) -> BTreeMap<String, Indexed> {
    let namespace = rule.namespace().unwrap_or_default();
    let spec = &rule.spec;
    let ours: Vec<&Device> = devices
        .iter()
        .map(AsRef::as_ref)
        .filter(|d| d.namespace().as_deref() == Some(namespace.as_str()))
        .filter(|d| d.metadata.deletion_timestamp.is_none())
        .collect();
    let mut bodies: BTreeMap<String, proto::RuleDesired> = BTreeMap::new();
    for device in ours.iter().filter(|d| judged.devices.matches(d.labels())) {
        let node = &device.spec.node;
        if let Some(nodes) = &judged.nodes
            && !node_labels(node).is_some_and(|labels| nodes.matches(&labels))
        {
            continue;
        }
        let body = bodies
            .entry(node.clone())
            .or_insert_with(|| proto::RuleDesired {
                namespace: namespace.clone(),
                name: rule.name_any(),
                when: spec.when.clone(),
                for_seconds: spec.for_seconds,
                cooldown_seconds: spec.cooldown_seconds,
                set: spec
                    .then
                    .set
                    .iter()
                    .map(|(k, v)| (k.clone(), v.into()))
                    .collect(),
                set_on_targets: spec.then.target.is_some(),
                targets: Vec::new(),
                event: spec.then.event.as_ref().map(|e| proto::RuleEvent {
                    r#type: if e.warning {
                        proto::EventType::Warning
                    } else {
                        proto::EventType::Normal
                    } as i32,
                    reason: e.reason.clone(),
                    message: e.message.clone(),
                }),
                restore: spec.restore,
                priority: spec.priority,
                max_actions_per_minute: spec.max_actions_per_minute,
                watched: Vec::new(),
            });
        body.watched.push(proto::WatchedDevice {
            name: device.name_any(),
            labels: device.labels().clone(),
        });
    }
    if let Some(target) = &judged.targets {
        for device in ours.iter().filter(|d| target.matches(d.labels())) {
            if let Some(body) = bodies.get_mut(&device.spec.node) {
                body.targets.push(device.name_any());
            }
        }
    }
    let uid = rule.uid().unwrap_or_default();
    bodies
        .into_iter()
        .map(|(node, body)| {
            let version = ResourceVersion::new(uid.clone(), body.digest());
            let entry = Indexed {
                version,
                body: proto::resource::Body::Rule(body),
            };
            (node, entry)
        })
        .collect()
}

/// A `then.target` that selects no Device of the rule's namespace names no
/// device: refused, as the rule could never act.
fn has_target(rule: &EdgeRule, judged: &Judged, devices: &[Arc<Device>]) -> Result<(), Refusal> {
    let Some(target) = &judged.targets else {
        return Ok(());
    };
    let namespace = rule.namespace();
    let any = devices.iter().any(|d| {
        d.namespace() == namespace
            && d.metadata.deletion_timestamp.is_none()
            && target.matches(d.labels())
    });
    if any {
        Ok(())
    } else {
        Err(Refusal {
            reason: "NoTarget",
            message: format!(
                "spec.then.target selects no Device in namespace {}",
                namespace.unwrap_or_default()
            ),
        })
    }
}

/// A rule must read and set only what its Devices' models have: each
/// property `when` reads off `reported` must be one of every watched
/// Device's model, and each `then.set` a writable property, of its type,
/// of every Device it sets. Devices of a model Edgefleet does not know
/// ([`model::MODELS`]) are not checked.
fn fits_models(
    rule: &EdgeRule,
    judged: &Judged,
    bodies: &BTreeMap<String, Indexed>,
    devices: &[Arc<Device>],
) -> Result<(), Refusal> {
    let namespace = rule.namespace();
    let models: HashMap<String, &str> = devices
        .iter()
        .filter(|d| d.namespace() == namespace)
        .map(|d| (d.name_any(), d.spec.model.as_str()))
        .collect();
    let known = |name: &str| models.get(name).and_then(|m| model::find(m));
    for entry in bodies.values() {
        let proto::resource::Body::Rule(body) = &entry.body else {
            continue;
        };
        for watched in &body.watched {
            let Some(model) = known(&watched.name) else {
                continue;
            };
            if let Some(missing) = judged.reads.iter().find(|r| model.property(r).is_none()) {
                return Err(Refusal {
                    reason: "UnknownProperty",
                    message: format!(
                        "spec.when reads reported.{missing}, but it watches Device {} of model {}, which has no such property (it has {}); narrow spec.selector or fix the expression",
                        watched.name,
                        model.name,
                        model.names()
                    ),
                });
            }
        }
        let set_on = match body.set_on_targets {
            true => body.targets.clone(),
            false => body.watched.iter().map(|w| w.name.clone()).collect(),
        };
        for name in set_on {
            let Some(model) = known(&name) else {
                continue;
            };
            for (property, value) in &rule.spec.then.set {
                if let Err(misfit) = model.check_set(property, value) {
                    let reason = match misfit {
                        Misfit::Unknown { .. } => "UnknownProperty",
                        Misfit::ReadOnly { .. } => "ReadOnlyProperty",
                        Misfit::WrongType { .. } => "InvalidValue",
                    };
                    return Err(Refusal {
                        reason,
                        message: format!("spec.then.set.{property}: Device {name}: {misfit}"),
                    });
                }
            }
        }
    }
    Ok(())
}

/// What a rule did at the edge, as the Devices' statuses show it.
#[derive(Debug, Default, PartialEq)]
pub struct Outcome {
    /// When its oldest override in force started (the latest across
    /// devices).
    pub last_acted: Option<Time>,
    /// Where it set a property another rule outranked it on:
    /// (device, property, the rule in force).
    pub outranked: Vec<(String, String, String)>,
}

/// [`Outcome`] of `rule` over `devices`.
pub fn outcome(rule: &EdgeRule, devices: &[Arc<Device>]) -> Outcome {
    let name = rule.name_any();
    let namespace = rule.namespace();
    let mut out = Outcome::default();
    for device in devices.iter().filter(|d| d.namespace() == namespace) {
        let Some(status) = &device.status else {
            continue;
        };
        for o in status.overrides.iter().filter(|o| o.rule == name) {
            if out.last_acted.as_ref().is_none_or(|t| t.0 < o.since.0) {
                out.last_acted = Some(o.since.clone());
            }
            if o.in_force {
                continue;
            }
            let winner = status
                .overrides
                .iter()
                .find(|w| w.property == o.property && w.in_force)
                .map(|w| w.rule.clone())
                .unwrap_or_default();
            out.outranked
                .push((device.name_any(), o.property.clone(), winner));
        }
    }
    out
}

/// The `Overridden` condition: True while another rule's value is in
/// force where this rule set one too.
fn overridden(outranked: &[(String, String, String)], generation: Option<i64>) -> Condition {
    let mut condition = condition(false, "InForce", String::new(), generation);
    condition.type_ = "Overridden".into();
    if !outranked.is_empty() {
        condition.status = "True".into();
        condition.reason = "OutrankedByRule".into();
        let shown: Vec<String> = outranked
            .iter()
            .take(3)
            .map(|(device, property, winner)| {
                format!("{device}.{property}: EdgeRule {winner} is in force")
            })
            .collect();
        condition.message = format!(
            "another rule of higher priority (or equal priority and a name sorting first) set the same property: {}{}",
            shown.join("; "),
            if outranked.len() > 3 { "; …" } else { "" }
        );
    }
    condition
}

fn condition(accepted: bool, reason: &str, message: String, generation: Option<i64>) -> Condition {
    Condition {
        type_: "Accepted".into(),
        status: if accepted { "True" } else { "False" }.into(),
        reason: reason.into(),
        message,
        observed_generation: generation,
        last_transition_time: Time(Timestamp::now()),
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use edgefleet_shared::api::rule::RuleAction;

    fn spec(when: &str) -> EdgeRuleSpec {
        serde_json::from_value(serde_json::json!({
            "selector": { "matchLabels": { "model": "thermostat" } },
            "when": when,
            "then": { "set": { "open": false } },
        }))
        .unwrap()
    }

    #[test]
    fn a_rule_is_refused_for_what_its_agents_could_not_run() {
        assert!(judge(&spec("reported.temperature > 80.0")).is_ok());
        let refused = judge(&spec("reported.temperature >")).err().unwrap();
        assert_eq!(refused.reason, "InvalidExpression");
        assert!(refused.message.contains("does not compile"), "{refused:?}");
        let refused = judge(&spec("desired.open")).err().unwrap();
        assert!(refused.message.contains("\"desired\""), "{refused:?}");
        let mut bad = spec("online");
        bad.then = RuleAction {
            target: Some(LabelSelector {
                match_expressions: Some(vec![
                    k8s_openapi::apimachinery::pkg::apis::meta::v1::LabelSelectorRequirement {
                        key: "role".into(),
                        operator: "Near".into(),
                        values: None,
                    },
                ]),
                match_labels: None,
            }),
            ..bad.then
        };
        let refused = judge(&bad).err().unwrap();
        assert_eq!(refused.reason, "InvalidSelector");
        assert!(
            refused.message.starts_with("spec.then.target"),
            "{refused:?}"
        );
    }

    fn device(name: &str, node: &str, labels: &[(&str, &str)]) -> Arc<Device> {
        let mut d = crate::index::tests::device("plant", name, node, &format!("u-{name}"), 1);
        d.metadata.labels = Some(
            labels
                .iter()
                .map(|(k, v)| ((*k).to_owned(), (*v).to_owned()))
                .collect(),
        );
        Arc::new(d)
    }

    fn rule(spec: EdgeRuleSpec) -> EdgeRule {
        let mut rule = EdgeRule::new("overheat", spec);
        rule.metadata.namespace = Some("plant".into());
        rule.metadata.uid = Some("rule-uid".into());
        rule
    }

    fn rule_body(entry: &Indexed) -> &proto::RuleDesired {
        match &entry.body {
            proto::resource::Body::Rule(r) => r,
            _ => panic!("a rule's body"),
        }
    }

    #[test]
    fn each_node_gets_the_rule_resolved_to_its_own_devices() {
        let mut spec = spec("reported.temperature > 80.0");
        spec.then.target = Some(LabelSelector {
            match_labels: Some([("role".to_owned(), "valve".to_owned())].into()),
            match_expressions: None,
        });
        let rule = rule(spec);
        let devices = [
            device("t1", "edge-1", &[("model", "thermostat")]),
            device("t2", "edge-2", &[("model", "thermostat")]),
            device("v1", "edge-1", &[("role", "valve")]),
            device("v2", "edge-2", &[("role", "valve")]),
            device("v3", "edge-3", &[("role", "valve")]),
            device("m3", "edge-3", &[("model", "meter")]),
        ];
        let judged = judge(&rule.spec).unwrap();
        let bodies = node_bodies(&rule, &judged, &devices, |_| None);
        // edge-3 watches nothing: it gets nothing, valve or not.
        assert_eq!(bodies.keys().collect::<Vec<_>>(), ["edge-1", "edge-2"]);
        let one = rule_body(&bodies["edge-1"]);
        assert_eq!(one.watched.len(), 1);
        assert_eq!(one.watched[0].name, "t1");
        assert_eq!(one.watched[0].labels["model"], "thermostat");
        assert!(one.set_on_targets);
        assert_eq!(one.targets, ["v1"]);
        assert_eq!(rule_body(&bodies["edge-2"]).targets, ["v2"]);
        assert_eq!(bodies["edge-1"].version.uid, "rule-uid");

        // The same inputs give the same versions; a change of what a node
        // must do changes its version only.
        let again = node_bodies(&rule, &judged, &devices, |_| None);
        assert_eq!(again, bodies);
        let mut relabelled = devices.to_vec();
        relabelled[1] = device("t2", "edge-2", &[("model", "thermostat"), ("floor", "2")]);
        let changed = node_bodies(&rule, &judged, &relabelled, |_| None);
        assert_eq!(changed["edge-1"].version, bodies["edge-1"].version);
        assert_ne!(changed["edge-2"].version, bodies["edge-2"].version);
    }

    #[test]
    fn a_node_selector_limits_the_rule_to_the_nodes_it_selects() {
        let mut spec = spec("online");
        spec.node_selector = Some(LabelSelector {
            match_labels: Some([("site".to_owned(), "north".to_owned())].into()),
            match_expressions: None,
        });
        let rule = rule(spec);
        let devices = [
            device("t1", "edge-1", &[("model", "thermostat")]),
            device("t2", "edge-2", &[("model", "thermostat")]),
        ];
        let judged = judge(&rule.spec).unwrap();
        let bodies = node_bodies(&rule, &judged, &devices, |node| {
            Some(
                [(
                    "site".to_owned(),
                    if node == "edge-1" { "north" } else { "south" }.to_owned(),
                )]
                .into(),
            )
        });
        assert_eq!(bodies.keys().collect::<Vec<_>>(), ["edge-1"]);
        assert!(!rule_body(&bodies["edge-1"]).set_on_targets);
    }

    #[test]
    fn the_outranked_rule_and_the_time_it_last_acted_come_from_device_statuses() {
        use edgefleet_shared::api::device::{DeviceOverride, DeviceStatus};
        let at = |ms: i64| Time(Timestamp::from_millisecond(ms).unwrap());
        let over = |rule: &str, ms: i64, in_force: bool| DeviceOverride {
            property: "open".into(),
            rule: rule.into(),
            value: false.into(),
            since: at(ms),
            in_force,
        };
        let mut valve = (*device("inlet", "edge-1", &[])).clone();
        valve.status = Some(DeviceStatus {
            overrides: vec![over("overheat", 2_000, true), over("cool", 1_000, false)],
            ..DeviceStatus::default()
        });
        let mut other = (*device("outlet", "edge-1", &[])).clone();
        other.status = Some(DeviceStatus {
            overrides: vec![over("cool", 3_000, true)],
            ..DeviceStatus::default()
        });
        let devices = [Arc::new(valve), Arc::new(other)];
        let mut cool = rule(spec("online"));
        cool.metadata.name = Some("cool".into());
        let seen = outcome(&cool, &devices);
        assert_eq!(seen.last_acted, Some(at(3_000)));
        assert_eq!(
            seen.outranked,
            [("inlet".to_owned(), "open".to_owned(), "overheat".to_owned())]
        );
        let c = overridden(&seen.outranked, Some(1));
        assert_eq!(
            (c.status.as_str(), c.reason.as_str()),
            ("True", "OutrankedByRule")
        );
        assert!(
            c.message
                .contains("inlet.open: EdgeRule overheat is in force"),
            "{}",
            c.message
        );
        let winner = outcome(&rule(spec("online")), &devices);
        assert!(winner.outranked.is_empty());
        assert_eq!(overridden(&winner.outranked, Some(1)).status, "False");
    }

    #[test]
    fn a_rule_reading_or_setting_what_its_devices_models_lack_is_refused() {
        let of_model = |name: &str, model: &str, role: &str| {
            let mut d = (*device(name, "edge-1", &[("role", role)])).clone();
            d.spec.model = model.into();
            Arc::new(d)
        };
        let devices = [
            of_model("boiler", "thermostat", "boiler"),
            of_model("inlet", "valve", "valve"),
            of_model("gauge", "pressure-gauge", "boiler"),
        ];
        let check = |when: &str, set: serde_json::Value| {
            let rule = rule(
                serde_json::from_value(serde_json::json!({
                    "selector": { "matchLabels": { "role": "boiler" } },
                    "when": when,
                    "then": { "set": set, "target": { "matchLabels": { "role": "valve" } } },
                }))
                .unwrap(),
            );
            let judged = judge(&rule.spec).unwrap();
            let bodies = node_bodies(&rule, &judged, &devices, |_| None);
            fits_models(&rule, &judged, &bodies, &devices)
        };
        let open = serde_json::json!({ "open": false });
        // The gauge's model is unknown: it is not checked.
        assert_eq!(check("reported.temperature > 80.0", open.clone()), Ok(()));
        let refused = check("reported.temprature > 80.0", open.clone()).unwrap_err();
        assert_eq!(refused.reason, "UnknownProperty");
        assert!(
            refused
                .message
                .contains("reported.temprature, but it watches Device boiler of model thermostat"),
            "{refused:?}"
        );
        let refused = check("online", serde_json::json!({ "opened": false })).unwrap_err();
        assert_eq!(refused.reason, "UnknownProperty");
        assert!(
            refused
                .message
                .starts_with("spec.then.set.opened: Device inlet:"),
            "{refused:?}"
        );
        let refused = check("online", serde_json::json!({ "flow": 0.0 })).unwrap_err();
        assert_eq!(refused.reason, "ReadOnlyProperty");
        let refused = check("online", serde_json::json!({ "open": "no" })).unwrap_err();
        assert_eq!(refused.reason, "InvalidValue");
    }

    #[test]
    fn a_target_that_selects_no_device_is_refused() {
        let mut spec = spec("online");
        spec.then.target = Some(LabelSelector {
            match_labels: Some([("role".to_owned(), "valve".to_owned())].into()),
            match_expressions: None,
        });
        let rule = rule(spec);
        let judged = judge(&rule.spec).unwrap();
        let refused = has_target(&rule, &judged, &[device("t1", "edge-1", &[])]).unwrap_err();
        assert_eq!(refused.reason, "NoTarget");
        assert!(
            has_target(
                &rule,
                &judged,
                &[device("v1", "edge-1", &[("role", "valve")])]
            )
            .is_ok()
        );
    }
}
