//! EdgeRules reaching the agents, against a real kube-apiserver, the
//! controller and two agents as processes: each rule goes to the agents of
//! the nodes whose Devices it watches and nowhere else, follows Device
//! labels, is sent by difference, survives an agent's `kill -9` in its
//! sled store and a controller restart without being sent again, and
//! leaves every agent when it is refused or deleted.

use std::time::Duration;

use edgefleet_shared::api::{Device, EdgeRule};
use edgefleet_tests::process::{http_get, metric};
use edgefleet_tests::stack::{Stack, StackSpec};
use edgefleet_tests::{control_plane, create_with_spec, eventually, test_namespace};
use kube::api::{Patch, PatchParams};
use kube::{Api, Client, ResourceExt};
use serde_json::json;

const NODES: [&str; 2] = ["edge-1", "edge-2"];

async fn agent_metric(stack: &Stack, agent: usize, name: &str) -> f64 {
    let body = http_get(stack.agents[agent].metrics, "/metrics")
        .await
        .map(|(_, body)| body)
        .unwrap_or_default();
    metric(&body, name)
}

async fn cloud_metric(stack: &Stack, name: &str) -> f64 {
    let body = http_get(stack.cloud_metrics, "/metrics")
        .await
        .map(|(_, body)| body)
        .unwrap_or_default();
    metric(&body, name)
}

/// Waits until the agents hold `want[i]` rules each.
async fn rules_held(stack: &Stack, want: [f64; 2]) {
    eventually(&format!("the agents hold {want:?} rules"), || async {
        let mut held = [0.0; 2];
        for (i, h) in held.iter_mut().enumerate() {
            *h = agent_metric(stack, i, "edgefleet_agent_rules").await;
        }
        (held == want).then_some(())
    })
    .await;
}

async fn label(devices: &Api<Device>, name: &str, value: Option<&str>) {
    devices
        .patch(
            name,
            &PatchParams::default(),
            &Patch::Merge(json!({ "metadata": { "labels": { "role": value } } })),
        )
        .await
        .unwrap();
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn rules_reach_only_the_agents_of_their_devices_by_difference_and_leave_when_deleted() {
    let cp = control_plane();
    let client: Client = cp.client().await;
    let ns = test_namespace(&client, "rule-dist").await;
    let dir = tempfile::tempdir().unwrap();
    let spec = StackSpec {
        nodes: NODES.iter().map(|n| (*n).to_owned()).collect(),
        namespace: ns.clone(),
        devices: 4,
        mqtt_every: 0,
        status_writes_per_second: 100,
        dir: dir.path().to_owned(),
        namespaced_controller: true,
        cloud_args: Vec::new(),
        agent_args: Vec::new(),
        sync_through_proxy: false,
    };
    let mut stack = Stack::start(spec, cp.kubeconfig()).await.unwrap();
    stack.apply_devices(&client).await.unwrap();
    let devices: Api<Device> = Api::namespaced(client.clone(), &ns);
    let all = devices.list(&Default::default()).await.unwrap().items;
    let on = |node: &str| -> Vec<String> {
        all.iter()
            .filter(|d| d.spec.node == node)
            .map(ResourceExt::name_any)
            .collect()
    };
    let (first, second) = (on(NODES[0]), on(NODES[1]));
    assert!(!first.is_empty() && !second.is_empty());
    label(&devices, &first[0], Some("boiler")).await;

    let rules: Api<EdgeRule> = Api::namespaced(client.clone(), &ns);
    create_with_spec::<EdgeRule>(
        &client,
        &ns,
        "overheat",
        json!({
            "selector": { "matchLabels": { "role": "boiler" } },
            "when": "reported.temperature > 80.0",
            "then": { "event": { "reason": "Overheat" } },
        }),
    )
    .await
    .unwrap();
    // Only edge-1 has a boiler.
    rules_held(&stack, [1.0, 0.0]).await;
    let rule = rules.get("overheat").await.unwrap();
    assert!(
        rule.finalizers().iter().any(|f| f == "edgefleet.io/rule"),
        "the controller holds its finalizer: {:?}",
        rule.finalizers()
    );
    eventually("the rule counts its device", || async {
        let r = rules.get("overheat").await.ok()?;
        (r.status?.devices == 1).then_some(())
    })
    .await;

    // A boiler on edge-2: the rule follows the label.
    label(&devices, &second[0], Some("boiler")).await;
    rules_held(&stack, [1.0, 1.0]).await;

    // An agent killed with -9 keeps its rule in sled; back, it is sent
    // nothing it already holds.
    let sent_before = cloud_metric(&stack, "edgefleet_cloud_sync_resources_sent_total").await;
    stack.kill_and_restart_agent(1, 1).await.unwrap();
    rules_held(&stack, [1.0, 1.0]).await;
    tokio::time::sleep(Duration::from_secs(2)).await;
    assert_eq!(
        cloud_metric(&stack, "edgefleet_cloud_sync_resources_sent_total").await,
        sent_before,
        "an agent back from kill -9 was sent what it held"
    );

    // A restarted controller has the rules in its index before any agent
    // connects: nothing is removed and nothing sent again.
    stack
        .kill_and_restart_cloud_after(|| async {})
        .await
        .unwrap();
    eventually("both agents are connected again", || async {
        let n = cloud_metric(&stack, "edgefleet_cloud_sync_streams").await;
        (n == 2.0).then_some(())
    })
    .await;
    tokio::time::sleep(Duration::from_secs(2)).await;
    assert_eq!(
        cloud_metric(&stack, "edgefleet_cloud_sync_resources_sent_total").await,
        0.0,
        "the restarted controller sent what the agents held"
    );
    rules_held(&stack, [1.0, 1.0]).await;

    // A change of the rule reaches both agents, one resource each.
    rules
        .patch(
            "overheat",
            &PatchParams::default(),
            &Patch::Merge(json!({ "spec": { "when": "reported.temperature > 90.0" } })),
        )
        .await
        .unwrap();
    eventually("the changed rule was sent to both agents", || async {
        let sent = cloud_metric(&stack, "edgefleet_cloud_sync_resources_sent_total").await;
        (sent == 2.0).then_some(())
    })
    .await;

    // Refused by the controller: it leaves the agents.
    rules
        .patch(
            "overheat",
            &PatchParams::default(),
            &Patch::Merge(json!({ "spec": { "when": "reported.temperature >" } })),
        )
        .await
        .unwrap();
    rules_held(&stack, [0.0, 0.0]).await;
    rules
        .patch(
            "overheat",
            &PatchParams::default(),
            &Patch::Merge(json!({ "spec": { "when": "reported.temperature > 90.0" } })),
        )
        .await
        .unwrap();
    rules_held(&stack, [1.0, 1.0]).await;

    // Deleted: gone from every agent, and the object goes once the
    // controller let its finalizer go.
    rules.delete("overheat", &Default::default()).await.unwrap();
    rules_held(&stack, [0.0, 0.0]).await;
    eventually("the rule is gone", || async {
        rules
            .get_opt("overheat")
            .await
            .unwrap()
            .is_none()
            .then_some(())
    })
    .await;
    stack.shutdown();
}
