//! The EdgeRule reconciler: judges each rule the way its agents will (its
//! `when` compiled, its selectors parsed) and shows the verdict as the
//! `Accepted` condition, with the compiler's message when it is refused;
//! counts the Devices it watches. Rules are distributed to the agents and
//! evaluated there (see docs/rules.md for what is built).

use std::sync::Arc;
use std::time::Duration;

use edgefleet_shared::api::rule::{EdgeRule, EdgeRuleSpec, EdgeRuleStatus};
use edgefleet_shared::api::{Device, EdgeNode};
use edgefleet_shared::rule_when::When;
use futures::{Stream, StreamExt};
use k8s_openapi::apimachinery::pkg::apis::meta::v1::{Condition, LabelSelector, Time};
use k8s_openapi::jiff::Timestamp;
use kube::api::{Patch, PatchParams};
use kube::core::{Selector, SelectorExt};
use kube::runtime::controller::Action;
use kube::runtime::reflector::{ObjectRef, Store};
use kube::runtime::{Controller, watcher};
use kube::{Api, Client, Resource, ResourceExt};

use crate::events::{Events, Note};
use crate::status::StatusWriter;

/// The field manager of the rule reconciler's status writes.
pub const FIELD_MANAGER: &str = "edgefleet-rules";

/// What the reconciler works with.
pub struct Context {
    client: Client,
    devices: Store<Device>,
    edge_nodes: Store<EdgeNode>,
    budget: StatusWriter,
    events: Events,
}

impl std::fmt::Debug for Context {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("rules::Context").finish_non_exhaustive()
    }
}

impl Context {
    /// The reconciler's context; `budget` paces its writes.
    pub fn new(
        client: Client,
        devices: Store<Device>,
        edge_nodes: Store<EdgeNode>,
        budget: StatusWriter,
        events: Events,
    ) -> Self {
        Context {
            client,
            devices,
            edge_nodes,
            budget,
            events,
        }
    }
}

/// Reconciles the EdgeRules of `api` until the process ends; every item of
/// `device_changes` looks at all of them again (their device counts).
pub async fn run(
    api: Api<EdgeRule>,
    context: Arc<Context>,
    device_changes: impl Stream<Item = ()> + Send + 'static,
) {
    Controller::new(api, watcher::Config::default())
        .reconcile_all_on(device_changes)
        .run(reconcile, error_policy, context)
        .for_each(|result| async move {
            if let Err(error) = result {
                tracing::debug!(%error, "rule reconcile did not finish");
            }
        })
        .await;
}

/// A failed write; the rule is looked at again shortly.
#[derive(Debug, thiserror::Error)]
#[error(transparent)]
pub struct Error(#[from] kube::Error);

fn error_policy(rule: Arc<EdgeRule>, error: &Error, _: Arc<Context>) -> Action {
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
    devices: Selector,
    nodes: Option<Selector>,
}

/// Judges `spec` as its agents will: its parsed selectors if they can run
/// it, else why not.
pub fn judge(spec: &EdgeRuleSpec) -> Result<Judged, Refusal> {
    When::compile(&spec.when).map_err(|e| Refusal {
        reason: "InvalidExpression",
        message: e.to_string(),
    })?;
    let selector = |field: &str, s: &LabelSelector| {
        Selector::try_from(s.clone()).map_err(|e| Refusal {
            reason: "InvalidSelector",
            message: format!("{field}: {e}"),
        })
    };
    if let Some(target) = &spec.then.target {
        selector("spec.then.target", target)?;
    }
    Ok(Judged {
        devices: selector("spec.selector", &spec.selector)?,
        nodes: spec
            .node_selector
            .as_ref()
            .map(|s| selector("spec.nodeSelector", s))
            .transpose()?,
    })
}

async fn reconcile(rule: Arc<EdgeRule>, context: Arc<Context>) -> Result<Action, Error> {
    if rule.metadata.deletion_timestamp.is_some() {
        return Ok(Action::await_change());
    }
    let current = rule.status.clone().unwrap_or_default();
    let mut status = EdgeRuleStatus {
        observed_generation: rule.metadata.generation,
        ..current.clone()
    };
    let accepted = match judge(&rule.spec) {
        Ok(judged) => {
            status.devices = context.watched(&rule, &judged);
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

impl Context {
    /// How many Devices of the rule's namespace it watches.
    fn watched(&self, rule: &EdgeRule, judged: &Judged) -> u32 {
        let namespace = rule.namespace().unwrap_or_default();
        let count = self
            .devices
            .state()
            .iter()
            .filter(|d| d.namespace().as_deref() == Some(namespace.as_str()))
            .filter(|d| d.metadata.deletion_timestamp.is_none())
            .filter(|d| judged.devices.matches(d.labels()))
            .filter(|d| {
                judged.nodes.as_ref().is_none_or(|s| {
                    self.edge_nodes
                        .get(&ObjectRef::new(&d.spec.node))
                        .is_some_and(|n| s.matches(n.labels()))
                })
            })
            .count();
        u32::try_from(count).unwrap_or(u32::MAX)
    }
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
}
