//! The FleetRollout API against a real kube-apiserver: a valid rollout is
//! accepted with its defaults filled in, invalid ones are refused at
//! admission with messages a person can act on, and `kubectl get` shows
//! the columns people look for.

use edgefleet_shared::api::FleetRollout;
use edgefleet_tests::{assert_refused, control_plane, create_with_spec, table, test_namespace};
use kube::{Api, Client};
use serde_json::{Value, json};

async fn create(client: &Client, ns: &str, name: &str, spec: Value) -> Result<Value, kube::Error> {
    create_with_spec::<FleetRollout>(client, ns, name, spec).await
}

/// A firmware rollout over the thermostats, ten at a time per site.
fn valid_spec() -> Value {
    json!({
        "target": {
            "firmware": {
                "version": "2.0.0",
                "url": "https://firmware.example/thermostat-2.0.0.bin",
                "sha256": "0123456789abcdef".repeat(4),
            },
        },
        "selector": {
            "matchLabels": { "model": "thermostat" },
            "matchExpressions": [{ "key": "tier", "operator": "NotIn", "values": ["lab"] }],
        },
        "strategy": {
            "canary": "5%",
            "waves": ["25%", 60],
            "maxUnavailable": 50,
            "failureDomain": { "topologyKey": "edgefleet.io/site", "maxUnavailable": "10%" },
        },
        "health": { "expression": "online && reported.temperature < 80.0", "bakeSeconds": 120 },
        "failurePolicy": {
            "thresholds": [
                { "scope": "Site", "percent": 30, "minSample": 3, "classes": ["HealthFailed"] },
                { "scope": "Overall", "percent": 5 },
            ],
            "action": "Rollback",
            "rollbackScope": "Wave",
        },
        "offline": { "waitUpToSeconds": 600, "then": "Skip" },
    })
}

#[tokio::test]
async fn a_valid_rollout_is_accepted_with_its_defaults_filled_in() {
    let client = control_plane().client().await;
    let ns = test_namespace(&client, "rollout-valid").await;
    let full = create(&client, &ns, "full", valid_spec()).await.unwrap();
    assert_eq!(full["spec"]["strategy"]["waves"], json!(["25%", 60]));
    // A site's canary defaults to one device; a threshold's sample to 5.
    assert_eq!(
        full["spec"]["strategy"]["failureDomain"]["canary"],
        json!(1)
    );
    assert_eq!(
        full["spec"]["failurePolicy"]["thresholds"][1]["minSample"],
        json!(5)
    );
    assert_eq!(full["spec"]["health"]["timeoutSeconds"], json!(1800));

    // The least a rollout says: what, and which devices.
    let least = json!({
        "target": { "properties": { "setpoint": 19.5 } },
        "selector": { "matchLabels": { "model": "thermostat" } },
    });
    let read = create(&client, &ns, "least", least).await.unwrap();
    let spec = &read["spec"];
    assert_eq!(spec["membership"], json!("Snapshot"));
    assert_eq!(spec["strategy"]["canary"], json!(1));
    assert_eq!(spec["strategy"]["maxUnavailable"], json!("10%"));
    assert_eq!(spec["failurePolicy"]["action"], json!("Pause"));
    assert_eq!(
        spec["failurePolicy"]["thresholds"],
        json!([{ "scope": "Wave", "percent": 20, "minSample": 5 }])
    );
    assert_eq!(
        spec["offline"],
        json!({ "waitUpToSeconds": 3600, "then": "Defer" })
    );
    assert_eq!(spec["paused"], json!(false));
    assert_eq!(spec["abort"], json!(false));
    // The Rust types read what the API server stored.
    let typed: Api<FleetRollout> = Api::namespaced(client.clone(), &ns);
    let rollout = typed.get("least").await.unwrap();
    assert_eq!(rollout.spec.failure_policy.thresholds[0].min_sample, 5);
}

#[tokio::test]
async fn invalid_rollouts_are_refused_with_actionable_messages() {
    let client = control_plane().client().await;
    let ns = test_namespace(&client, "rollout-invalid").await;

    // (what is wrong, how to break a valid spec, words the refusal must contain)
    type Breaker = fn(&mut Value);
    let cases: Vec<(&str, Breaker, Vec<&str>)> = vec![
        (
            "a percentage over 100",
            |s| s["strategy"]["maxUnavailable"] = json!("150%"),
            vec!["spec.strategy.maxUnavailable", "percentage from 0% to 100%"],
        ),
        (
            "a negative count",
            |s| s["strategy"]["canary"] = json!(-2),
            vec!["spec.strategy.canary", "a count (0 or more)"],
        ),
        (
            "a share that is neither",
            |s| s["strategy"]["failureDomain"]["maxUnavailable"] = json!("ten"),
            vec!["spec.strategy.failureDomain.maxUnavailable", "like 10%"],
        ),
        (
            "a wave over 100%",
            |s| s["strategy"]["waves"] = json!(["50%", "101%"]),
            vec!["spec.strategy.waves", "percentage from 0% to 100%"],
        ),
        (
            "a firmware version that is not semver",
            |s| s["target"]["firmware"]["version"] = json!("2.0"),
            vec!["spec.target.firmware.version", "semantic version"],
        ),
        (
            "a target that changes nothing",
            |s| s["target"] = json!({}),
            vec![
                "spec.target",
                "changes the firmware, some properties, or both",
            ],
        ),
        (
            "a selector operator that does not exist",
            |s| s["selector"]["matchExpressions"][0]["operator"] = json!("Equals"),
            vec!["spec.selector", "operators are In and NotIn"],
        ),
        (
            "In without values",
            |s| {
                s["selector"]["matchExpressions"] = json!([{ "key": "tier", "operator": "In" }]);
            },
            vec!["spec.selector", "with values"],
        ),
        (
            "a threshold over 100 percent",
            |s| s["failurePolicy"]["thresholds"][0]["percent"] = json!(101),
            vec!["spec.failurePolicy.thresholds[0].percent"],
        ),
        (
            "an unknown failure class",
            |s| s["failurePolicy"]["thresholds"][0]["classes"] = json!(["Exploded"]),
            vec![
                "spec.failurePolicy.thresholds[0].classes[0]",
                "Unsupported value",
            ],
        ),
        (
            "an unknown offline action",
            |s| s["offline"]["then"] = json!("Wait"),
            vec!["spec.offline.then", "\"Defer\"", "\"Skip\""],
        ),
        (
            "an empty health expression",
            |s| s["health"]["expression"] = json!(""),
            vec!["spec.health.expression"],
        ),
        (
            "a rollout without a selector",
            |s| {
                s.as_object_mut().unwrap().remove("selector");
            },
            vec!["spec.selector", "Required value"],
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
    // The spec every case broke is itself accepted.
    create(&client, &ns, "good", valid_spec()).await.unwrap();
}

#[tokio::test]
async fn kubectl_get_fleetrollouts_shows_phase_wave_counts_and_age() {
    let client = control_plane().client().await;
    let ns = test_namespace(&client, "rollout-columns").await;
    create(&client, &ns, "fw-2", valid_spec()).await.unwrap();
    let (columns, rows) = table(
        &client,
        &format!("/apis/edgefleet.io/v1alpha1/namespaces/{ns}/fleetrollouts"),
    )
    .await;
    assert_eq!(
        columns,
        [
            "Name",
            "Phase",
            "Wave",
            "Updated",
            "Total",
            "Failed",
            "Unreachable",
            "Age",
            "Firmware"
        ]
    );
    let row = &rows[0];
    assert_eq!(row[0], json!("fw-2"));
    assert_eq!(row[8], json!("2.0.0"));
}
