//! EdgeRules at the edge, against a real kube-apiserver, the controller and
//! agents as processes:
//! - distribution: each rule goes to the agents of the nodes whose Devices
//!   it watches and nowhere else, follows Device labels, is sent by
//!   difference, survives an agent's `kill -9` in its sled store and a
//!   controller restart without being sent again, and leaves every agent
//!   when it is refused or deleted;
//! - action: devices played by the test over real CoAP (a boiler
//!   reporting) and MQTT (an inlet valve told what to do): the agent acts
//!   on a report at once, online and cut off from the cloud, restores when
//!   the condition clears, keeps its override across `kill -9`, and each
//!   decision's Event reaches Kubernetes exactly once.

use std::time::{Duration, Instant};

use edgefleet_shared::api::{Device, EdgeRule};
use edgefleet_shared::{PropertyValue, ResourceKey};
use edgefleet_tests::device_client::mqtt_device;
use edgefleet_tests::process::{http_get, metric};
use edgefleet_tests::rule_site::{Site, overheat_rule};
use edgefleet_tests::stack::{Stack, StackSpec};
use edgefleet_tests::{
    control_plane, create_with_spec, eventually, eventually_within, test_namespace,
};
use kube::api::{Patch, PatchParams};
use kube::{Api, Client, ResourceExt};
use serde_json::json;

const NODES: [&str; 2] = ["edge-1", "edge-2"];

async fn agent_metric(stack: &Stack, agent: usize, name: &str) -> f64 {
    stack.agent_metric(agent, name).await
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

/// The Kubernetes Events of `ns` with `reason`: (the object's name, note).
async fn events_of(client: &Client, ns: &str, reason: &str) -> Vec<(String, String)> {
    let events: Api<k8s_openapi::api::events::v1::Event> = Api::namespaced(client.clone(), ns);
    events
        .list(&Default::default())
        .await
        .unwrap()
        .items
        .into_iter()
        .filter(|e| e.reason.as_deref() == Some(reason))
        .map(|e| {
            let on = e.regarding.and_then(|r| r.name).unwrap_or_default();
            (on, e.note.unwrap_or_default())
        })
        .collect()
}

/// A controller and one agent (on edge-1) in a fresh namespace with
/// `devices` of the simulator's Devices applied: its models in turn, a
/// thermostat, a valve, a meter, a thermostat…
async fn one_simulated_site(prefix: &str, devices: usize) -> SimulatedSite {
    let cp = control_plane();
    let client: Client = cp.client().await;
    let ns = test_namespace(&client, prefix).await;
    let dir = tempfile::tempdir().unwrap();
    let spec = StackSpec {
        nodes: vec![NODES[0].to_owned()],
        namespace: ns.clone(),
        devices,
        status_writes_per_second: 100,
        dir: dir.path().to_owned(),
        namespaced_controller: true,
        ..StackSpec::default()
    };
    let stack = Stack::start(spec, cp.kubeconfig()).await.unwrap();
    stack.apply_devices(&client).await.unwrap();
    let devices = Api::namespaced(client.clone(), &ns);
    SimulatedSite {
        client,
        ns,
        stack,
        devices,
        _dir: dir,
    }
}

struct SimulatedSite {
    client: Client,
    ns: String,
    stack: Stack,
    devices: Api<Device>,
    _dir: tempfile::TempDir,
}

/// The cloud sets thermostat `name`'s desired setpoint.
async fn set_setpoint(devices: &Api<Device>, name: &str, setpoint: f64) {
    devices
        .patch(
            name,
            &PatchParams::default(),
            &Patch::Merge(json!({ "spec": { "desired": { "setpoint": setpoint } } })),
        )
        .await
        .unwrap();
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
        status_writes_per_second: 100,
        dir: dir.path().to_owned(),
        namespaced_controller: true,
        ..StackSpec::default()
    };
    let mut stack = Stack::start(spec, cp.kubeconfig()).await.unwrap();
    stack.apply_devices(&client).await.unwrap();
    let devices: Api<Device> = Api::namespaced(client.clone(), &ns);
    let all = devices.list(&Default::default()).await.unwrap().items;
    // The thermostats of a node: the rule reads their temperature.
    let on = |node: &str| -> Vec<String> {
        all.iter()
            .filter(|d| d.spec.node == node && d.spec.model == "thermostat")
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

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_rule_acts_at_the_edge_online_and_cut_off_and_each_decision_goes_up_once() {
    let mut site = Site::start("rule-act", overheat_rule(0)).await;

    // Online: an overheating report closes the valve at once, through the
    // agent alone; cooling down opens it again.
    site.boiler_reports(85.0).await;
    let reported = Instant::now();
    let closed = site.valve_told().await;
    let took = reported.elapsed();
    assert_eq!(closed.properties["open"], PropertyValue::Bool(false));
    assert_eq!((closed.generation, closed.local), (1, 1));
    eprintln!("report -> valve told: {took:?}");
    site.boiler_reports(60.0).await;
    let opened = site.valve_told().await;
    assert_eq!(opened.properties["open"], PropertyValue::Bool(true));
    assert_eq!(opened.local, 2);
    eventually("the first decision's Event is in Kubernetes", || async {
        (site.overheat_events().await.len() == 1).then_some(())
    })
    .await;

    // Cut off from the cloud: the agent still acts, and the Event waits.
    site.stack.agents[0].proxy.as_ref().unwrap().cut();
    site.boiler_reports(90.0).await;
    let closed = site.valve_told().await;
    assert_eq!(closed.properties["open"], PropertyValue::Bool(false));
    assert_eq!(closed.local, 3);
    tokio::time::sleep(Duration::from_secs(2)).await;
    assert_eq!(
        site.overheat_events().await.len(),
        1,
        "an Event crossed a cut link"
    );

    // Killed with -9 while the override is in force: it comes back with it.
    site.stack.kill_and_restart_agent(0, 1).await.unwrap();
    let (mqtt, events) = mqtt_device(
        site.stack.agents[0].mqtt,
        &ResourceKey::device(&site.ns, "inlet"),
    )
    .await;
    mqtt.subscribe(&site.valve_topic, rumqttc::QoS::AtLeastOnce)
        .await
        .unwrap();
    site.valve = (mqtt, events);
    let retained = site.valve_told().await;
    assert_eq!(retained.properties["open"], PropertyValue::Bool(false));
    assert_eq!(retained.local, 3);

    // Back online: the offline decision's Event arrives, once.
    site.stack.agents[0].proxy.as_ref().unwrap().heal();
    eventually("the offline decision's Event is in Kubernetes", || async {
        (site.overheat_events().await.len() == 2).then_some(())
    })
    .await;
    tokio::time::sleep(Duration::from_secs(3)).await;
    let ids = site.overheat_events().await;
    let mut distinct = ids.clone();
    distinct.dedup();
    assert_eq!(ids.len(), 2, "{ids:?}");
    assert_eq!(distinct, ids, "an Event twice: {ids:?}");
    site.stack.shutdown();
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn overrides_show_in_status_the_outranked_rule_says_so_and_rules_changed_or_deleted_offline_apply_at_resync()
 {
    let mut site = Site::start("rule-status", overheat_rule(0)).await;
    site.valve_reports(true).await;
    // A second rule on the same property, of lower priority.
    create_with_spec::<EdgeRule>(
        &site.client,
        &site.ns,
        "cool",
        json!({
            "selector": { "matchLabels": { "role": "boiler" } },
            "when": "reported.temperature > 50.0",
            "then": {
                "set": { "open": true },
                "target": { "matchLabels": { "role": "inlet-valve" } },
            },
        }),
    )
    .await
    .unwrap();
    rules_held_one(&site.stack, 2.0).await;

    site.boiler_reports(85.0).await;
    let closed = site.valve_told().await;
    assert_eq!(closed.properties["open"], PropertyValue::Bool(false));
    let mut shown = eventually("the valve's status shows both overrides", || async {
        let o = site.valve_overrides().await;
        (o.len() == 2).then_some(o)
    })
    .await;
    shown.sort_by(|a, b| a.0.cmp(&b.0));
    assert_eq!(
        shown,
        [
            ("cool".to_owned(), PropertyValue::Bool(true), false),
            ("overheat".to_owned(), PropertyValue::Bool(false), true),
        ]
    );
    let rules: Api<EdgeRule> = Api::namespaced(site.client.clone(), &site.ns);
    let overridden = |name: &'static str| {
        let rules = rules.clone();
        async move {
            let status = rules.get(name).await.ok()?.status?;
            let c = status
                .conditions
                .into_iter()
                .find(|c| c.type_ == "Overridden")?;
            Some((c.status, c.message, status.last_acted_at.is_some()))
        }
    };
    let (_, message, _) = eventually("cool says it is outranked", || async {
        overridden("cool").await.filter(|(s, _, _)| s == "True")
    })
    .await;
    assert!(
        message.contains("inlet.open: EdgeRule overheat is in force"),
        "{message}"
    );
    // Its status is written on its own schedule: wait for the time it acted.
    let (status, _, _) = eventually("overheat shows when it acted", || async {
        overridden("overheat").await.filter(|(_, _, acted)| *acted)
    })
    .await;
    assert_eq!(status, "False", "overheat is in force, not overridden");

    // Changed while the site is cut off: the agent goes on with the rule it
    // has (over 80 closes), and takes the new one (over 95) at resync.
    site.stack.agents[0].proxy.as_ref().unwrap().cut();
    rules
        .patch(
            "overheat",
            &PatchParams::default(),
            &Patch::Merge(json!({ "spec": { "when": "reported.temperature > 95.0" } })),
        )
        .await
        .unwrap();
    site.boiler_reports(40.0).await;
    assert_eq!(
        site.valve_told().await.properties["open"],
        PropertyValue::Bool(true)
    );
    site.boiler_reports(90.0).await;
    assert_eq!(
        site.valve_told().await.properties["open"],
        PropertyValue::Bool(false),
        "cut off, the agent did not act on the rule it holds"
    );
    site.stack.agents[0].proxy.as_ref().unwrap().heal();
    // At 90 the new rule does not hold: overheat lets go, cool is in force.
    let told = site.valve_told().await;
    assert_eq!(told.properties["open"], PropertyValue::Bool(true));
    eventually("the valve's status shows cool alone in force", || async {
        let o = site.valve_overrides().await;
        (o == [("cool".to_owned(), PropertyValue::Bool(true), true)]).then_some(())
    })
    .await;

    // Deleted while the site is cut off: the agent keeps it until resync,
    // then ends its override.
    site.stack.agents[0].proxy.as_ref().unwrap().cut();
    rules.delete("cool", &Default::default()).await.unwrap();
    tokio::time::sleep(Duration::from_secs(2)).await;
    assert_eq!(
        site.stack.agent_metric(0, "edgefleet_agent_rules").await,
        2.0
    );
    site.stack.agents[0].proxy.as_ref().unwrap().heal();
    rules_held_one(&site.stack, 1.0).await;
    eventually("the valve's status shows no override", || async {
        site.valve_overrides().await.is_empty().then_some(())
    })
    .await;
    site.stack.shutdown();
}

/// Waits until the first agent holds `want` rules.
async fn rules_held_one(stack: &Stack, want: f64) {
    eventually(&format!("the agent holds {want} rules"), || async {
        (agent_metric(stack, 0, "edgefleet_agent_rules").await == want).then_some(())
    })
    .await;
}

/// The simulator's devices (a thermostat and a valve on one node, over real
/// CoAP), a rule with a `for` window, and the agent killed with -9 inside
/// the window: the decision is made once, the simulated valve applies the
/// override and reports it, and its Event reaches Kubernetes once.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_rule_acts_on_simulated_devices_across_a_kill_9_inside_its_for_window() {
    // A thermostat, a valve, a meter.
    let SimulatedSite {
        client,
        ns,
        mut stack,
        devices,
        _dir,
    } = one_simulated_site("rule-sim", 3).await;
    let model = |m: &str| json!({ "matchLabels": { "edgefleet.io/model": m } });
    create_with_spec::<EdgeRule>(
        &client,
        &ns,
        "hot-opens-valve",
        json!({
            "selector": model("thermostat"),
            "when": "reported.setpoint > 30.0",
            "forSeconds": 6,
            "then": {
                "set": { "open": true },
                "target": model("valve"),
                "event": { "reason": "Hot" },
            },
        }),
    )
    .await
    .unwrap();
    rules_held_one(&stack, 1.0).await;
    stack.start_sim(&["--report-interval=1s".into()]).unwrap();
    let all = devices.list(&Default::default()).await.unwrap().items;
    let named = |m: &str| {
        all.iter()
            .find(|d| d.spec.model == m)
            .map(ResourceExt::name_any)
            .unwrap()
    };
    let (thermostat, valve) = (named("thermostat"), named("valve"));
    let valve_open = |devices: Api<Device>, valve: String| async move {
        devices
            .get(&valve)
            .await
            .ok()?
            .status?
            .reported
            .get("open")
            .cloned()
    };
    eventually("the valve reports it is closed", || {
        let (d, v) = (devices.clone(), valve.clone());
        async move { (valve_open(d, v).await? == PropertyValue::Bool(false)).then_some(()) }
    })
    .await;

    // The cloud raises the thermostat's setpoint; once its report of it
    // is in, the rule's window runs.
    set_setpoint(&devices, &thermostat, 35.0).await;
    eventually("the thermostat reports the new setpoint", || async {
        let s = devices.get(&thermostat).await.ok()?.status?;
        // JSON keeps no difference between 35.0 and 35.
        let setpoint = match s.reported.get("setpoint")? {
            PropertyValue::Float(f) => *f,
            PropertyValue::Int(i) => *i as f64,
            _ => return None,
        };
        (setpoint == 35.0).then_some(())
    })
    .await;
    assert_eq!(
        agent_metric(
            &stack,
            0,
            "edgefleet_agent_rule_decisions_total{decision=\"act\"}"
        )
        .await,
        0.0,
        "acted inside its window"
    );
    stack.kill_and_restart_agent(0, 1).await.unwrap();

    eventually(
        "the simulated valve applied the override and reports it open",
        || {
            let (d, v) = (devices.clone(), valve.clone());
            async move { (valve_open(d, v).await? == PropertyValue::Bool(true)).then_some(()) }
        },
    )
    .await;
    let status = devices.get(&valve).await.unwrap().status.unwrap();
    assert_eq!(status.overrides.len(), 1, "{:?}", status.overrides);
    assert_eq!(status.overrides[0].rule, "hot-opens-valve");
    assert_eq!(
        agent_metric(
            &stack,
            0,
            "edgefleet_agent_rule_decisions_total{decision=\"act\"}"
        )
        .await,
        1.0
    );
    // The simulated devices raise events of their own; the rule's is Hot.
    let hot = || async {
        let hot = events_of(&client, &ns, "Hot").await;
        hot.iter().filter(|(on, _)| *on == thermostat).count()
    };
    eventually("the decision's Event reached Kubernetes", || async {
        (hot().await == 1).then_some(())
    })
    .await;
    tokio::time::sleep(Duration::from_secs(2)).await;
    assert_eq!(hot().await, 1, "the decision's Event twice");
    stack.shutdown();
}

/// Two simulated thermostats (real CoAP and MQTT through the agent) whose
/// rules set each other's setpoint and restore it: a loop the chain bound
/// stops after eight links, with one refusal, counted and sent up as a
/// Kubernetes Event; then both run on their spec again.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn rules_setting_each_others_thermostat_stop_at_the_chain_bound() {
    // A thermostat, a valve, a meter and a second thermostat.
    let SimulatedSite {
        client,
        ns,
        mut stack,
        devices,
        _dir,
    } = one_simulated_site("rule-loop", 4).await;
    let thermostats: Vec<String> = devices
        .list(&Default::default())
        .await
        .unwrap()
        .items
        .iter()
        .filter(|d| d.spec.model == "thermostat")
        .map(ResourceExt::name_any)
        .collect();
    let [first, second] = <[String; 2]>::try_from(thermostats).unwrap();
    label(&devices, &first, Some("first")).await;
    label(&devices, &second, Some("second")).await;
    // The first runs warm (28), the second at the default (21).
    set_setpoint(&devices, &first, 28.0).await;
    let role = |r: &str| json!({ "matchLabels": { "role": r } });
    for (name, watches, target, setpoint) in [
        ("first-warms-second", "first", "second", 30.0),
        ("second-cools-first", "second", "first", 20.0),
    ] {
        create_with_spec::<EdgeRule>(
            &client,
            &ns,
            name,
            json!({
                "selector": role(watches),
                "when": "reported.setpoint > 25.0",
                "then": { "set": { "setpoint": setpoint }, "target": role(target) },
                "restore": true,
            }),
        )
        .await
        .unwrap();
    }
    rules_held_one(&stack, 2.0).await;
    stack.start_sim(&["--report-interval=1s".into()]).unwrap();

    let decisions = |kind: &'static str| {
        let stack = &stack;
        async move {
            let name = format!("edgefleet_agent_rule_decisions_total{{decision=\"{kind}\"}}");
            agent_metric(stack, 0, &name).await
        }
    };
    eventually_within(
        Duration::from_secs(90),
        "the loop reached the chain bound",
        || async { (decisions("chain_too_deep").await == 1.0).then_some(()) },
    )
    .await;
    let refused = || events_of(&client, &ns, "RuleRefused");
    let seen = eventually("the refusal reached Kubernetes", || async {
        let seen = refused().await;
        (!seen.is_empty()).then_some(seen)
    })
    .await;
    assert_eq!(seen.len(), 1, "{seen:?}");
    assert_eq!(seen[0].0, first, "{seen:?}");
    assert!(
        seen[0].1.contains("EdgeRule first-warms-second") && seen[0].1.contains("9 deep"),
        "{seen:?}"
    );
    // Both back on their spec, told nothing by a rule, and it stays so.
    let setpoint = |name: String| {
        let devices = devices.clone();
        async move {
            let status = devices.get(&name).await.ok()?.status?;
            let value = status.reported.get("setpoint")?.as_f64()?;
            status.overrides.is_empty().then_some(value)
        }
    };
    eventually("both thermostats run on their spec", || async {
        let both = (
            setpoint(first.clone()).await?,
            setpoint(second.clone()).await?,
        );
        (both == (28.0, 21.0)).then_some(())
    })
    .await;
    tokio::time::sleep(Duration::from_secs(3)).await;
    assert_eq!(
        (
            decisions("act").await,
            decisions("restore").await,
            decisions("chain_too_deep").await
        ),
        (4.0, 4.0, 1.0),
        "acts at depths 1, 2, 5, 6, restores at 3, 4, 7, 8, the act at 9 refused"
    );
    assert_eq!(refused().await.len(), 1, "the refusal twice");
    stack.shutdown();
}
