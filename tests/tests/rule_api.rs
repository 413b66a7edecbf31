//! The EdgeRule API against a real kube-apiserver: a valid rule is accepted
//! with its defaults filled in, invalid ones are refused at admission with
//! messages a person can act on, `kubectl get` shows the columns people
//! look for, and the controller (a real process) refuses with the
//! `Accepted` condition what admission cannot check.

use std::time::Duration;

use edgefleet_shared::api::EdgeRule;
use edgefleet_tests::stack::{Stack, StackSpec};
use edgefleet_tests::{
    assert_refused, control_plane, create_with_spec, eventually_within, table, test_namespace,
};
use kube::{Api, Client};
use serde_json::{Value, json};

async fn create(client: &Client, ns: &str, name: &str, spec: Value) -> Result<Value, kube::Error> {
    create_with_spec::<EdgeRule>(client, ns, name, spec).await
}

/// A thermostat over 80 °C for 30 s closes the inlet valves of its node.
fn valid_spec() -> Value {
    json!({
        "selector": { "matchLabels": { "model": "thermostat" } },
        "when": "reported.temperature > 80.0",
        "forSeconds": 30,
        "cooldownSeconds": 300,
        "then": {
            "set": { "open": false },
            "target": { "matchLabels": { "role": "inlet-valve" } },
            "event": { "reason": "Overheat", "message": "closing the inlet valves", "warning": true },
        },
        "priority": 100,
    })
}

#[tokio::test]
async fn a_valid_rule_is_accepted_with_its_defaults_filled_in() {
    let client = control_plane().client().await;
    let ns = test_namespace(&client, "rule-valid").await;
    let full = create(&client, &ns, "overheat", valid_spec())
        .await
        .unwrap();
    assert_eq!(full["spec"]["restore"], json!(true));
    assert_eq!(full["spec"]["maxActionsPerMinute"], json!(60));
    // The least a rule says: which devices, when, and one thing to do.
    let least = json!({
        "selector": {},
        "when": "online == false",
        "then": { "event": { "reason": "Silent" } },
    });
    let read = create(&client, &ns, "least", least).await.unwrap();
    assert_eq!(read["spec"]["forSeconds"], json!(0));
    assert_eq!(read["spec"]["priority"], json!(0));
}

#[tokio::test]
async fn invalid_rules_are_refused_with_actionable_messages() {
    let client = control_plane().client().await;
    let ns = test_namespace(&client, "rule-invalid").await;
    type Breaker = fn(&mut Value);
    let cases: Vec<(&str, Breaker, Vec<&str>)> = vec![
        (
            "a rule that does nothing",
            |s| s["then"] = json!({}),
            vec!["spec.then", "then must set a property or raise an event"],
        ),
        (
            "a target without properties to set",
            |s| {
                s["then"]["set"] = json!({});
            },
            vec![
                "spec",
                "then.target names the devices whose properties are set",
            ],
        ),
        (
            "an empty condition",
            |s| s["when"] = json!(""),
            vec!["spec.when"],
        ),
        (
            "a hysteresis over a day",
            |s| s["forSeconds"] = json!(86_401),
            vec!["spec.forSeconds"],
        ),
        (
            "a priority out of range",
            |s| s["priority"] = json!(5000),
            vec!["spec.priority"],
        ),
        (
            "no rate at all",
            |s| s["maxActionsPerMinute"] = json!(0),
            vec!["spec.maxActionsPerMinute"],
        ),
        (
            "an event reason that is not CamelCase",
            |s| s["then"]["event"]["reason"] = json!("over heat"),
            vec!["spec.then.event.reason"],
        ),
        (
            "a selector operator that does not exist",
            |s| {
                s["selector"] =
                    json!({ "matchExpressions": [{ "key": "zone", "operator": "Near" }] });
            },
            vec!["spec.selector", "operators are In and NotIn"],
        ),
        (
            "a property value that is not a scalar",
            |s| s["then"]["set"]["open"] = json!({ "nested": true }),
            vec!["spec.then.set.open"],
        ),
    ];
    for (i, (what, break_it, expected)) in cases.into_iter().enumerate() {
        let mut spec = valid_spec();
        break_it(&mut spec);
        assert_refused(
            create(&client, &ns, &format!("bad-{i}"), spec).await,
            what,
            &expected,
        );
    }
    create(&client, &ns, "good", valid_spec()).await.unwrap();
}

#[tokio::test]
async fn kubectl_get_edgerules_shows_accepted_priority_devices_and_age() {
    let client = control_plane().client().await;
    let ns = test_namespace(&client, "rule-columns").await;
    create(&client, &ns, "overheat", valid_spec())
        .await
        .unwrap();
    let (columns, rows) = table(
        &client,
        &format!("/apis/edgefleet.io/v1alpha1/namespaces/{ns}/edgerules"),
    )
    .await;
    assert_eq!(
        columns,
        ["Name", "Accepted", "Priority", "Devices", "Age", "When"]
    );
    let row = &rows[0];
    assert_eq!(row[0], json!("overheat"));
    assert_eq!(row[2], json!(100));
    assert_eq!(row[5], json!("reported.temperature > 80.0"));
}

#[tokio::test]
async fn the_controller_accepts_what_its_agents_can_run_and_refuses_the_rest_with_a_reason() {
    let cp = control_plane();
    let client = cp.client().await;
    let ns = test_namespace(&client, "rule-ctl").await;
    let dir = tempfile::tempdir().unwrap();
    let node = format!("rule-ctl-{}", std::process::id());
    let spec = StackSpec {
        nodes: vec![node],
        namespace: ns.clone(),
        devices: 6,
        mqtt_every: 0,
        status_writes_per_second: 100,
        dir: dir.path().to_owned(),
        namespaced_controller: true,
        cloud_args: Vec::new(),
        agent_args: Vec::new(),
        sync_through_proxy: false,
    };
    let stack = Stack::start(spec, cp.kubeconfig()).await.unwrap();
    stack.apply_devices(&client).await.unwrap();
    let rules: Api<EdgeRule> = Api::namespaced(client.clone(), &ns);
    let accepted = |name: &'static str| {
        let rules = rules.clone();
        async move {
            let rule = rules.get(name).await.ok()?;
            let status = rule.status?;
            let c = status.conditions.iter().find(|c| c.type_ == "Accepted")?;
            (status.observed_generation == rule.metadata.generation).then(|| {
                (
                    c.status.clone(),
                    c.reason.clone(),
                    c.message.clone(),
                    status.devices,
                )
            })
        }
    };
    // The six simulated Devices: two each of thermostat, valve and meter.
    let mut good = valid_spec();
    good["selector"] = json!({ "matchLabels": { "edgefleet.io/model": "thermostat" } });
    good["then"]["target"] = json!({ "matchLabels": { "edgefleet.io/model": "valve" } });
    create(&client, &ns, "good", good.clone()).await.unwrap();
    let (status, reason, _, devices) =
        eventually_within(Duration::from_secs(30), "the good rule judged", || {
            accepted("good")
        })
        .await;
    assert_eq!((status.as_str(), reason.as_str()), ("True", "Valid"));
    assert_eq!(devices, 2, "it watches the two simulated thermostats");

    // Properties the models do not have: read off a valve or a meter, or
    // set where the valve only reports.
    let mut misread = good.clone();
    misread["selector"] = json!({ "matchLabels": { "edgefleet.io/simulated": "true" } });
    create(&client, &ns, "misread", misread).await.unwrap();
    let (status, reason, message, _) = eventually_within(
        Duration::from_secs(30),
        "the misreading rule judged",
        || accepted("misread"),
    )
    .await;
    assert_eq!(
        (status.as_str(), reason.as_str()),
        ("False", "UnknownProperty")
    );
    assert!(
        message.contains("spec.when reads reported.temperature")
            && (message.contains("of model valve") || message.contains("of model meter")),
        "{message}"
    );
    let mut misset = good;
    misset["then"]["set"] = json!({ "flow": 0.0 });
    create(&client, &ns, "misset", misset).await.unwrap();
    let (status, reason, message, _) = eventually_within(
        Duration::from_secs(30),
        "the missetting rule judged",
        || accepted("misset"),
    )
    .await;
    assert_eq!(
        (status.as_str(), reason.as_str()),
        ("False", "ReadOnlyProperty")
    );
    assert!(
        message.contains("spec.then.set.flow") && message.contains("read-only"),
        "{message}"
    );

    let mut broken = valid_spec();
    broken["when"] = json!("reported.temperature >");
    create(&client, &ns, "broken", broken).await.unwrap();
    let (status, reason, message, _) =
        eventually_within(Duration::from_secs(30), "the broken rule judged", || {
            accepted("broken")
        })
        .await;
    assert_eq!(
        (status.as_str(), reason.as_str()),
        ("False", "InvalidExpression")
    );
    assert!(message.contains("spec.when does not compile"), "{message}");

    // valid_spec's target (role=inlet-valve) selects none of them.
    create(&client, &ns, "aimless", valid_spec()).await.unwrap();
    let (status, reason, message, _) =
        eventually_within(Duration::from_secs(30), "the aimless rule judged", || {
            accepted("aimless")
        })
        .await;
    assert_eq!((status.as_str(), reason.as_str()), ("False", "NoTarget"));
    assert!(
        message.contains("spec.then.target selects no Device"),
        "{message}"
    );

    let mut blind = valid_spec();
    blind["when"] = json!("desired.open == true");
    create(&client, &ns, "blind", blind).await.unwrap();
    let (status, _, message, _) = eventually_within(
        Duration::from_secs(30),
        "the rule naming desired judged",
        || accepted("blind"),
    )
    .await;
    assert_eq!(status, "False");
    assert!(
        message.contains("\"desired\"") && message.contains("`reported`"),
        "{message}"
    );
    stack.shutdown();
}
