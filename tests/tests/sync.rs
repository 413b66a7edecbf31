//! Cloud ↔ agent sync against the real API server, over real gRPC on
//! loopback TCP, with the agent's store on a real disk. The controller and
//! the agent's sync client run in this process; the device side is played by
//! writing reports into the agent's store, as its CoAP server will.

use std::collections::BTreeMap;
use std::num::NonZeroU32;
use std::time::Duration;

use edgefleet_agent::store::Store;
use edgefleet_agent::sync;
use edgefleet_cloud::run::{Controller, Settings};
use edgefleet_shared::api::{Device, DevicePhase, DeviceSpec, EdgeNode, Transport};
use edgefleet_shared::codec::{DeviceEvent, DeviceReport};
use edgefleet_shared::{PropertyValue, ResourceKey, proto};
use edgefleet_tests::{
    control_plane, edge_events, eventually, eventually_within, in_process_controller,
    test_namespace,
};
use kube::api::{DeleteParams, Patch, PatchParams, PostParams};
use kube::{Api, Client};
use serde_json::json;

/// The controllers' grace period for absent agents.
const NODE_GRACE: Duration = Duration::from_secs(2);

/// A controller serving the Devices of namespace `ns` (tests run side by
/// side on one API server; each controller minds its own namespace).
async fn start_controller(client: &Client, ns: &str) -> Controller {
    start_controller_with(client, ns, 200).await
}

/// [`start_controller`], creating at most `device_events_per_second`
/// device Events per second.
async fn start_controller_with(
    client: &Client,
    ns: &str,
    device_events_per_second: u32,
) -> Controller {
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    // The sync protocol itself, in plaintext; TLS is tests/tests/sync_tls.rs.
    Controller::start(
        client.clone(),
        Settings {
            device_events_per_second: NonZeroU32::new(device_events_per_second).unwrap(),
            node_grace_period: NODE_GRACE,
            ..in_process_controller(listener, ns)
        },
    )
    .await
    .unwrap()
}

/// One test's world: a controller minding a fresh namespace, and the store
/// (on disk) of the agent for one node.
struct Setup {
    client: Client,
    ns: String,
    controller: Controller,
    store: Store,
    node: String,
    _dir: tempfile::TempDir,
}

impl Setup {
    /// Namespace `sync-<hint>`, node `edge-<hint>-<pid>`.
    async fn new(hint: &str) -> Setup {
        let client = control_plane().client().await;
        let ns = test_namespace(&client, &format!("sync-{hint}")).await;
        let controller = start_controller(&client, &ns).await;
        let dir = tempfile::tempdir().unwrap();
        let store = Store::open(&dir.path().join("store")).unwrap().store;
        Setup {
            node: node_name(&format!("edge-{hint}")),
            client,
            ns,
            controller,
            store,
            _dir: dir,
        }
    }
}

fn start_agent(controller: &Controller, node: &str, store: &Store) -> tokio::task::JoinHandle<()> {
    let settings =
        edgefleet_tests::agent_sync_settings(format!("http://{}", controller.sync_addr), node);
    tokio::spawn(sync::run(settings, store.clone()))
}

fn thermostat(node: &str, setpoint: f64) -> DeviceSpec {
    DeviceSpec {
        node: node.into(),
        model: "thermostat".into(),
        transport: Transport::Coap,
        desired: BTreeMap::from([("setpoint".to_owned(), PropertyValue::Float(setpoint))]),
        firmware: None,
        retry: 0,
    }
}

/// Creates Device `name`, a thermostat on `node`.
async fn create_thermostat(devices: &Api<Device>, name: &str, node: &str, setpoint: f64) {
    devices
        .create(
            &PostParams::default(),
            &Device::new(name, thermostat(node, setpoint)),
        )
        .await
        .unwrap();
}

/// Waits until every Device's status shows its generation delivered.
async fn every_delivery_shown(devices: &Api<Device>) {
    eventually("status shows every delivery", || async {
        let list = devices.list(&Default::default()).await.ok()?;
        list.items
            .iter()
            .all(|d| {
                let delivered = d.status.as_ref().and_then(|s| s.delivered_generation);
                delivered.is_some() && delivered == d.metadata.generation
            })
            .then_some(())
    })
    .await;
}

fn node_name(hint: &str) -> String {
    format!("{hint}-{}", std::process::id())
}

#[tokio::test]
async fn a_device_reaches_its_agent_and_its_report_reaches_status() {
    let Setup {
        client,
        ns,
        controller,
        store,
        node,
        _dir,
    } = Setup::new("pipeline").await;
    let _agent = start_agent(&controller, &node, &store);

    let devices: Api<Device> = Api::namespaced(client.clone(), &ns);
    create_thermostat(&devices, "t1", &node, 21.5).await;
    let key = ResourceKey::device(&ns, "t1");

    // accepted → delivered: the agent stored it, and status says so.
    let stored = eventually("the agent stores the Device", || async {
        store.desired(&key).unwrap()
    })
    .await;
    assert_eq!(stored.version.generation, 1);
    assert_eq!(stored.properties["setpoint"], PropertyValue::Float(21.5));
    eventually("status shows Delivered", || async {
        let d = devices.get("t1").await.unwrap();
        let s = d.status?;
        (s.delivered_generation == Some(1) && s.phase == Some(DevicePhase::Delivered)).then_some(())
    })
    .await;

    // delivered → applied: the device's report comes back into status.
    let report = DeviceReport {
        applied_generation: 1,
        properties: BTreeMap::from([
            ("setpoint".to_owned(), PropertyValue::Float(21.5)),
            ("temperature".to_owned(), PropertyValue::Float(20.25)),
        ]),
        firmware_version: Some("1.0.3".into()),
        firmware_failure: None,
    };
    store
        .record_report(&key, report.clone(), 1_700_000_000_000)
        .await
        .unwrap();
    let status = eventually("status shows the report", || async {
        let s = devices.get("t1").await.unwrap().status?;
        (s.phase == Some(DevicePhase::Applied)).then_some(s)
    })
    .await;
    assert_eq!(status.applied_generation, Some(1));
    assert_eq!(status.reported, report.properties);
    assert_eq!(status.firmware_version.as_deref(), Some("1.0.3"));
    eventually("the outbox drains after the UplinkAck", || async {
        (store.outbox_depth() == 0).then_some(())
    })
    .await;

    // A spec change arrives as generation 2; a deletion removes it.
    let patch = json!({ "spec": { "desired": { "setpoint": 19.0 } } });
    devices
        .patch("t1", &PatchParams::default(), &Patch::Merge(&patch))
        .await
        .unwrap();
    let stored = eventually("the agent stores generation 2", || async {
        store
            .desired(&key)
            .unwrap()
            .filter(|d| d.version.generation == 2)
    })
    .await;
    // The API server keeps JSON numbers, not their Rust types: 19.0 comes
    // back as 19. Numeric properties compare by value.
    assert_eq!(stored.properties["setpoint"].as_f64(), Some(19.0));
    devices
        .delete("t1", &DeleteParams::default())
        .await
        .unwrap();
    eventually("the agent drops the deleted Device", || async {
        store.desired(&key).unwrap().is_none().then_some(())
    })
    .await;
}

#[tokio::test]
async fn a_reconnecting_agent_is_sent_only_the_difference() {
    let Setup {
        client,
        ns,
        controller,
        store,
        node,
        _dir,
    } = Setup::new("resync").await;
    let devices: Api<Device> = Api::namespaced(client.clone(), &ns);
    for name in ["a", "b", "c", "d"] {
        create_thermostat(&devices, name, &node, 20.0).await;
    }

    let agent = start_agent(&controller, &node, &store);
    eventually("the agent holds all four", || async {
        (store.held().unwrap().len() == 4).then_some(())
    })
    .await;
    let edge_nodes: Api<EdgeNode> = Api::all(client.clone());
    let ready = |n: &EdgeNode| {
        let status = n.status.clone().unwrap_or_default();
        let ready = status
            .conditions
            .iter()
            .find(|c| c.type_ == "Ready")
            .map(|c| c.status.clone());
        (status.connected, ready)
    };
    eventually("the EdgeNode was created and is Ready", || async {
        let n = edge_nodes.get(&node).await.ok()?;
        (ready(&n) == (true, Some("True".into()))).then_some(())
    })
    .await;
    agent.abort();
    let _ = agent.await;
    eventually("the EdgeNode shows the agent gone", || async {
        let n = edge_nodes.get(&node).await.ok()?;
        (ready(&n) == (false, Some("Unknown".into()))).then_some(())
    })
    .await;
    let sent_before = controller.sync_metrics.resources_sent.get();

    // While the agent is away: one changed, one deleted, one added.
    let patch = json!({ "spec": { "desired": { "setpoint": 23.0 } } });
    devices
        .patch("b", &PatchParams::default(), &Patch::Merge(&patch))
        .await
        .unwrap();
    devices.delete("c", &DeleteParams::default()).await.unwrap();
    create_thermostat(&devices, "e", &node, 20.0).await;
    // Let the controller's index see all three before the agent returns.
    tokio::time::sleep(Duration::from_millis(500)).await;

    let agent = start_agent(&controller, &node, &store);
    eventually("the agent holds exactly a, b@2, d, e", || async {
        let held: Vec<(String, i64)> = store
            .held()
            .unwrap()
            .into_iter()
            .map(|(k, v)| (k.name, v.generation))
            .collect();
        let want = [("a", 1), ("b", 2), ("d", 1), ("e", 1)].map(|(n, g)| (n.to_owned(), g));
        (held == want).then_some(())
    })
    .await;
    let resent = controller.sync_metrics.resources_sent.get() - sent_before;
    assert_eq!(resent, 2, "only b (changed) and e (new) are sent again");
    let n = edge_nodes.get(&node).await.unwrap();
    assert_eq!(ready(&n), (true, Some("True".into())));
    assert_eq!(n.status.unwrap().agent_version.as_deref(), Some("test"));
    // The Hellos said what the store holds as a digest; this controller saw
    // the store acknowledge what it holds, so it never asked for a list.
    let hellos = &controller.sync_metrics.hellos;
    assert_eq!(hellos.get("empty"), 1, "the first Hello: an empty store");
    assert!(
        hellos.get("remembered") >= 1,
        "the reconnect: the digest matched"
    );
    assert_eq!(hellos.get("inventory"), 0);

    // A new controller remembers nothing, but the Devices' statuses say
    // what was delivered: the digest matches them, so no list is needed,
    // and only what changed meanwhile is sent.
    every_delivery_shown(&devices).await;
    agent.abort();
    let _ = agent.await;
    drop(controller);
    let patch = json!({ "spec": { "desired": { "setpoint": 24.0 } } });
    devices
        .patch("d", &PatchParams::default(), &Patch::Merge(&patch))
        .await
        .unwrap();
    let controller = start_controller(&client, &ns).await;
    let _agent = start_agent(&controller, &node, &store);
    let d = ResourceKey::device(&ns, "d");
    eventually("the agent holds d@2", || async {
        store
            .desired(&d)
            .unwrap()
            .filter(|d| d.version.generation == 2)
    })
    .await;
    assert!(controller.sync_metrics.hellos.get("recovered") >= 1);
    assert_eq!(controller.sync_metrics.hellos.get("remembered"), 0);
    assert_eq!(controller.sync_metrics.hellos.get("inventory"), 0);
    assert_eq!(
        controller.sync_metrics.resources_sent.get(),
        1,
        "only d (changed) is sent"
    );
    assert_eq!(store.held().unwrap().len(), 4);
}

#[tokio::test]
async fn a_report_for_a_device_of_another_node_is_refused_and_counted() {
    let Setup {
        client,
        ns,
        controller,
        store,
        node,
        _dir,
    } = Setup::new("foreign").await;
    let devices: Api<Device> = Api::namespaced(client.clone(), &ns);
    devices
        .create(
            &PostParams::default(),
            &Device::new("theirs", thermostat(&node_name("edge-other"), 20.0)),
        )
        .await
        .unwrap();
    let _agent = start_agent(&controller, &node, &store);

    // This agent claims a report for a device that hangs off another node.
    let report = DeviceReport {
        applied_generation: 1,
        properties: BTreeMap::from([("temperature".to_owned(), PropertyValue::Float(99.0))]),
        firmware_version: None,
        firmware_failure: None,
    };
    store
        .record_report(&ResourceKey::device(&ns, "theirs"), report, 1)
        .await
        .unwrap();

    let refused = || controller.sync_metrics.refused.get("unknown_device");
    eventually("the cloud counts the refusal", || async {
        (refused() >= 1).then_some(())
    })
    .await;
    // Refused for good, so acknowledged and dropped at the edge, not resent forever.
    eventually("the outbox drains", || async {
        (store.outbox_depth() == 0).then_some(())
    })
    .await;
    let theirs = devices.get("theirs").await.unwrap();
    assert!(
        theirs.status.as_ref().is_none_or(|s| s.reported.is_empty()),
        "a foreign report reached status: {:?}",
        theirs.status
    );
}

/// The event ids of `device` among `ids` (its events have no boot epoch).
fn ids_of(ids: &BTreeMap<String, Vec<(u64, u64)>>, device: &str) -> Vec<u64> {
    ids.get(device)
        .into_iter()
        .flatten()
        .map(|&(boot, id)| {
            assert_eq!(boot, 0, "{ids:?}");
            id
        })
        .collect()
}

fn event(id: u64) -> DeviceEvent {
    DeviceEvent {
        id,
        boot: 0,
        warning: id.is_multiple_of(2),
        reason: "SelfCheck".into(),
        message: format!("self check {id}"),
    }
}

/// Device Events are created a node at a time in turn: a site that comes
/// back with a backlog of events does not hold back another site's event
/// behind all of it (with one queue for all, the quiet site's event waited
/// for the whole backlog).
#[tokio::test]
async fn one_sites_event_backlog_does_not_hold_back_another_sites_events() {
    const BACKLOG: u64 = 300;
    let client = control_plane().client().await;
    let ns = test_namespace(&client, "sync-fair").await;
    // 300 Events take 15 s at this rate.
    let controller = start_controller_with(&client, &ns, 20).await;
    let devices: Api<Device> = Api::namespaced(client.clone(), &ns);
    let (busy, quiet) = (node_name("edge-busy"), node_name("edge-quiet"));
    create_thermostat(&devices, "busy", &busy, 20.0).await;
    create_thermostat(&devices, "quiet", &quiet, 20.0).await;
    let dir = tempfile::tempdir().unwrap();
    let busy_store = Store::open(&dir.path().join("busy")).unwrap().store;
    let quiet_store = Store::open(&dir.path().join("quiet")).unwrap().store;
    for id in 1..=BACKLOG {
        busy_store
            .record_event(
                &ResourceKey::device(&ns, "busy"),
                event(id),
                1_700_000_000_000,
            )
            .await
            .unwrap();
    }
    quiet_store
        .record_event(
            &ResourceKey::device(&ns, "quiet"),
            event(1),
            1_700_000_000_000,
        )
        .await
        .unwrap();
    let created = |name: &'static str| {
        let (client, ns) = (client.clone(), ns.clone());
        async move {
            let ids = edge_events::device_event_ids(&client, &ns).await.ok()?;
            Some(ids.get(name).map_or(0, Vec::len))
        }
    };

    let _busy = start_agent(&controller, &busy, &busy_store);
    eventually("the busy site's backlog is being created", || async {
        (created("busy").await? >= 10).then_some(())
    })
    .await;
    let _quiet = start_agent(&controller, &quiet, &quiet_store);
    eventually("the quiet site's event is created", || async {
        (created("quiet").await? == 1).then_some(())
    })
    .await;
    let busy_done = created("busy").await.unwrap();
    assert!(
        busy_done < BACKLOG as usize / 2,
        "the quiet site's event waited for {busy_done} of the busy site's {BACKLOG}"
    );
    eventually("the busy site's backlog is all created", || async {
        (created("busy").await? == BACKLOG as usize).then_some(())
    })
    .await;
}

/// Reports and events are two flows acknowledged apart: a report made while
/// a backlog of events is still being created reaches status at once, and
/// leaves the agent's outbox at once. (With one window and one watermark
/// for both, the report waited for room behind 2,048 events in flight, and
/// its acknowledgement for every event before it.)
#[tokio::test]
async fn a_report_reaches_status_without_waiting_behind_an_event_backlog() {
    const BACKLOG: u64 = proto::UPLINK_WINDOW as u64 + 452;
    let client = control_plane().client().await;
    let ns = test_namespace(&client, "sync-flows").await;
    // The backlog takes 50 s to create at this rate.
    let controller = start_controller_with(&client, &ns, 50).await;
    let devices: Api<Device> = Api::namespaced(client.clone(), &ns);
    let node = node_name("edge-flows");
    create_thermostat(&devices, "t1", &node, 20.0).await;
    let key = ResourceKey::device(&ns, "t1");
    let dir = tempfile::tempdir().unwrap();
    let store = Store::open(&dir.path().join("store")).unwrap().store;
    for id in 1..=BACKLOG {
        store
            .record_event(&key, event(id), 1_700_000_000_000)
            .await
            .unwrap();
    }
    let created = || {
        let (client, ns) = (client.clone(), ns.clone());
        async move {
            let ids = edge_events::device_event_ids(&client, &ns).await.ok()?;
            Some(ids.get("t1").map_or(0, Vec::len))
        }
    };
    let _agent = start_agent(&controller, &node, &store);
    eventually("the backlog is being created", || async {
        (created().await? >= 10).then_some(())
    })
    .await;

    let report = DeviceReport {
        applied_generation: 1,
        properties: BTreeMap::from([("temperature".to_owned(), PropertyValue::Float(19.5))]),
        firmware_version: None,
        firmware_failure: None,
    };
    store
        .record_report(&key, report.clone(), edgefleet_shared::now_unix_ms())
        .await
        .unwrap();
    eventually("status shows the report", || async {
        let s = devices.get("t1").await.unwrap().status?;
        (s.reported == report.properties).then_some(())
    })
    .await;
    let created_by_then = created().await.unwrap();
    assert!(
        created_by_then < 300,
        "the report reached status only after {created_by_then} of the {BACKLOG} events"
    );
    eventually("the report leaves the outbox", || async {
        (store.reports_queued() == 0).then_some(())
    })
    .await;
    let waiting = store.events_queued();
    assert!(
        waiting > BACKLOG - 300,
        "the report was acknowledged only when {waiting} of {BACKLOG} events were left"
    );
}

#[tokio::test]
async fn device_events_become_kubernetes_events_once_each_and_drops_are_reported() {
    let Setup {
        client,
        ns,
        controller,
        store,
        node,
        _dir,
    } = Setup::new("events").await;
    let devices: Api<Device> = Api::namespaced(client.clone(), &ns);
    create_thermostat(&devices, "t1", &node, 20.0).await;
    let key = ResourceKey::device(&ns, "t1");

    // Offline, with room for 4 events: 6 arrive, the 2 oldest are dropped.
    let store = store.with_max_events(4);
    for id in 1..=6 {
        store
            .record_event(&key, event(id), 1_700_000_000_000 + id as i64)
            .await
            .unwrap();
    }
    assert_eq!(store.events_dropped_total().unwrap(), 2);
    let agent = start_agent(&controller, &node, &store);
    eventually("the outbox drains", || async {
        (store.outbox_depth() == 0).then_some(())
    })
    .await;
    let ids = edge_events::device_event_ids(&client, &ns).await.unwrap();
    assert_eq!(ids_of(&ids, "t1"), [3, 4, 5, 6], "{ids:?}");
    let notices = edge_events::dropped_notices(&client, &node).await.unwrap();
    assert_eq!(notices.len(), 1, "{notices:?}");
    assert!(
        notices[0].contains("bound of 4") && notices[0].contains("2 oldest"),
        "{notices:?}"
    );

    // The store is lost and rebuilt; the device resends what it never saw
    // confirmed (5 and 6) and one new event. The cloud creates only the new one.
    agent.abort();
    let dir = tempfile::tempdir().unwrap();
    let rebuilt = Store::open(&dir.path().join("store")).unwrap().store;
    for id in [5, 6, 7] {
        rebuilt
            .record_event(&key, event(id), 1_700_000_001_000)
            .await
            .unwrap();
    }
    let _agent = start_agent(&controller, &node, &rebuilt);
    eventually("the rebuilt store's outbox drains", || async {
        (rebuilt.outbox_depth() == 0).then_some(())
    })
    .await;
    let ids = edge_events::device_event_ids(&client, &ns).await.unwrap();
    assert_eq!(ids_of(&ids, "t1"), [3, 4, 5, 6, 7], "{ids:?}");
}

#[tokio::test]
async fn an_outbox_larger_than_the_uplink_window_drains_and_an_agent_ignoring_the_window_is_cut_off()
 {
    let Setup {
        client,
        ns,
        controller,
        store,
        node,
        _dir,
    } = Setup::new("window").await;
    let devices: Api<Device> = Api::namespaced(client.clone(), &ns);
    create_thermostat(&devices, "t1", &node, 20.0).await;
    let key = ResourceKey::device(&ns, "t1");

    // More events queued offline than one window holds: the agent sends a
    // window, waits for acknowledgements, sends more.
    let count = proto::UPLINK_WINDOW as u64 + 300;
    for id in 1..=count {
        store
            .record_event(&key, event(id), 1_700_000_000_000 + id as i64)
            .await
            .unwrap();
    }
    let _agent = start_agent(&controller, &node, &store);
    eventually_within(Duration::from_secs(120), "the outbox drains", || async {
        (store.outbox_depth() == 0).then_some(())
    })
    .await;
    let refused = || {
        controller
            .sync_metrics
            .refused
            .get("uplink_window_exceeded")
    };
    assert_eq!(refused(), 0);
    let ids = edge_events::device_event_ids(&client, &ns).await.unwrap();
    assert_eq!(ids_of(&ids, "t1"), (1..=count).collect::<Vec<_>>());

    // A peer that does not wait is cut off and counted; the controller
    // stays up for everyone else.
    let hello = proto::Hello {
        node: node_name("edge-greedy"),
        agent_version: "raw".into(),
        boot_id: "b".into(),
        store_id: "store-greedy".into(),
        ..Default::default()
    };
    let mut greedy = RawAgent::connect(&controller, hello).await;
    let entries = (1..=proto::UPLINK_WINDOW as u64 + 1)
        .map(|seq| proto::UplinkEntry {
            seq,
            body: Some(proto::uplink_entry::Body::Event(proto::Event {
                device_key: key.to_string(),
                reason: "SelfCheck".into(),
                device_event_id: count + seq,
                ..Default::default()
            })),
        })
        .collect();
    greedy
        .send(proto::agent_message::Kind::Uplink(proto::Uplink {
            entries,
        }))
        .await;
    let ended = tokio::time::timeout(edgefleet_tests::PATIENCE, async {
        loop {
            match greedy.inbound.message().await {
                Ok(Some(_)) => continue,
                Ok(None) | Err(_) => return,
            }
        }
    })
    .await;
    assert!(ended.is_ok(), "the greedy stream was not ended");
    assert_eq!(refused(), 1);
    let ids = edge_events::device_event_ids(&client, &ns).await.unwrap();
    assert_eq!(
        ids["t1"].len() as u64,
        count,
        "nothing of the refused batch was created"
    );
}

#[tokio::test]
async fn a_hello_digest_that_matches_nothing_known_is_answered_by_asking_for_the_list() {
    let Setup {
        client,
        ns,
        controller,
        node,
        ..
    } = Setup::new("inventory").await;
    let devices: Api<Device> = Api::namespaced(client.clone(), &ns);
    for name in ["a", "b"] {
        create_thermostat(&devices, name, &node, 20.0).await;
    }
    let uid = |d: &Device| d.metadata.uid.clone().unwrap();
    let a = devices.get("a").await.unwrap();
    // The agent holds a as it is, and "ghost", which the cloud never had.
    let held = [
        proto::HeldResource {
            key: ResourceKey::device(&ns, "a").to_string(),
            version: Some((&edgefleet_shared::ResourceVersion::new(uid(&a), 1)).into()),
        },
        proto::HeldResource {
            key: ResourceKey::device(&ns, "ghost").to_string(),
            version: Some((&edgefleet_shared::ResourceVersion::new("gone", 4)).into()),
        },
    ];
    // A digest that matches nothing, then one that is not even 16 bytes
    // (refused and counted, but the list still tells).
    for (round, digest) in [vec![0xab; 16], vec![0xab; 3]].into_iter().enumerate() {
        let hello = proto::Hello {
            node: node.clone(),
            agent_version: "raw".into(),
            boot_id: "b".into(),
            store_id: "store-inventory".into(),
            held_digest: digest,
            held_count: 2,
            ..Default::default()
        };
        let mut agent = RawAgent::connect(&controller, hello).await;
        let first = agent.next().await;
        assert!(
            matches!(
                first,
                Some(proto::cloud_message::Kind::InventoryRequest(
                    proto::InventoryRequest { parts: true }
                ))
            ),
            "{first:?}"
        );
        // In two parts.
        let (head, tail) = held.split_at(1);
        for (part, more) in [(head, true), (tail, false)] {
            agent
                .send(proto::agent_message::Kind::Inventory(proto::Inventory {
                    held: part.to_vec(),
                    more,
                }))
                .await;
        }
        let update = loop {
            match agent.next().await {
                Some(proto::cloud_message::Kind::Update(update)) => break update,
                Some(proto::cloud_message::Kind::Heartbeat(_)) => continue,
                other => panic!("expected the difference, got {other:?}"),
            }
        };
        let upserts: Vec<&str> = update.upserts.iter().map(|r| r.key.as_str()).collect();
        assert_eq!(upserts, [ResourceKey::device(&ns, "b").to_string()]);
        assert_eq!(
            update.removals,
            [ResourceKey::device(&ns, "ghost").to_string()]
        );
        assert_eq!(
            controller.sync_metrics.hellos.get("inventory"),
            round as u64 + 1
        );
    }
    assert_eq!(controller.sync_metrics.refused.get("bad_held_digest"), 1);
}

#[tokio::test]
async fn a_newer_session_of_a_node_ends_the_older_one() {
    let Setup {
        client,
        ns,
        controller,
        node,
        ..
    } = Setup::new("superseded").await;
    let devices: Api<Device> = Api::namespaced(client.clone(), &ns);
    create_thermostat(&devices, "a", &node, 20.0).await;
    let hello = proto::Hello {
        node: node.clone(),
        agent_version: "raw".into(),
        boot_id: "b".into(),
        store_id: "store-superseded".into(),
        ..Default::default()
    };
    // The first Update waits for the controller's reflector to show the
    // Device; a heartbeat may come first (its interval ticks at once).
    let mut old = RawAgent::connect(&controller, hello.clone()).await;
    assert!(matches!(
        old.next_skipping_heartbeats().await,
        Some(proto::cloud_message::Kind::Update(_))
    ));
    // The agent reconnected before the cloud noticed its old stream gone.
    let mut new = RawAgent::connect(&controller, hello).await;
    assert!(matches!(
        new.next_skipping_heartbeats().await,
        Some(proto::cloud_message::Kind::Update(_))
    ));
    let ended = tokio::time::timeout(edgefleet_tests::PATIENCE, async {
        while let Some(message) = old.inbound.message().await.ok().flatten() {
            assert!(
                matches!(message.kind, Some(proto::cloud_message::Kind::Heartbeat(_))),
                "the superseded session sent {message:?}"
            );
        }
    })
    .await;
    assert!(ended.is_ok(), "the older session was never closed");
    // The newer one goes on.
    create_thermostat(&devices, "b", &node, 21.0).await;
    loop {
        match new.next().await {
            Some(proto::cloud_message::Kind::Update(update)) => {
                assert_eq!(
                    update.upserts[0].key,
                    ResourceKey::device(&ns, "b").to_string()
                );
                break;
            }
            Some(proto::cloud_message::Kind::Heartbeat(_)) => continue,
            other => panic!("expected b, got {other:?}"),
        }
    }
}

#[tokio::test]
async fn a_report_about_a_deleted_device_never_lands_on_the_one_recreated_under_its_name() {
    let Setup {
        client,
        ns,
        controller,
        node,
        ..
    } = Setup::new("recreate").await;
    let devices: Api<Device> = Api::namespaced(client.clone(), &ns);
    create_thermostat(&devices, "a", &node, 20.0).await;
    let key = ResourceKey::device(&ns, "a");
    let old_uid = devices.get("a").await.unwrap().metadata.uid.unwrap();
    let hello = proto::Hello {
        node: node.clone(),
        agent_version: "raw".into(),
        boot_id: "b".into(),
        store_id: "store-recreate".into(),
        ..Default::default()
    };
    let mut agent = RawAgent::connect(&controller, hello).await;
    agent.ack_updates_until(|u| !u.upserts.is_empty()).await;

    // Deleted (the agent acknowledges the removal, so the finalizer goes)
    // and created again under the same name: another object.
    devices.delete("a", &Default::default()).await.unwrap();
    agent
        .ack_updates_until(|u| u.removals.contains(&key.to_string()))
        .await;
    edgefleet_tests::eventually_within(edgefleet_tests::PATIENCE, "a is gone", || async {
        devices.get_opt("a").await.unwrap().is_none().then_some(())
    })
    .await;
    create_thermostat(&devices, "a", &node, 20.0).await;
    let new_uid = devices.get("a").await.unwrap().metadata.uid.unwrap();
    assert_ne!(old_uid, new_uid);
    agent
        .ack_updates_until(|u| {
            u.upserts
                .iter()
                .any(|r| r.version.as_ref().is_some_and(|v| v.uid == new_uid))
        })
        .await;

    // A report the old object's device made, arriving late.
    agent.send(report_about(&key, &old_uid, 1, 99.0)).await;
    agent.until_uplink_ack(1).await;
    let shown = devices.get("a").await.unwrap();
    let reported = shown.status.as_ref().map(|s| s.reported.clone());
    assert!(
        reported.as_ref().is_none_or(|r| r.is_empty()),
        "the recreated Device shows the old one's report: {reported:?}"
    );
    assert_eq!(controller.status.metrics().other_object.get(), 1);

    // Its own reports land.
    agent.send(report_about(&key, &new_uid, 2, 21.0)).await;
    agent.until_uplink_ack(2).await;
    let shown = devices.get("a").await.unwrap();
    assert_eq!(
        shown
            .status
            .unwrap()
            .reported
            .get("temperature")
            .and_then(PropertyValue::as_f64),
        Some(21.0)
    );
}

/// A sync stream driven by hand, to send what a real agent never would.
struct RawAgent {
    tx: tokio::sync::mpsc::Sender<proto::AgentMessage>,
    inbound: tonic::Streaming<proto::CloudMessage>,
}

impl RawAgent {
    async fn connect(controller: &Controller, hello: proto::Hello) -> RawAgent {
        let mut client =
            proto::sync_client::SyncClient::connect(format!("http://{}", controller.sync_addr))
                .await
                .unwrap();
        let (tx, rx) = tokio::sync::mpsc::channel(16);
        tx.send(agent_message(proto::agent_message::Kind::Hello(hello)))
            .await
            .unwrap();
        let inbound = client
            .stream(tokio_stream::wrappers::ReceiverStream::new(rx))
            .await
            .unwrap()
            .into_inner();
        RawAgent { tx, inbound }
    }

    async fn send(&self, kind: proto::agent_message::Kind) {
        self.tx.send(agent_message(kind)).await.unwrap();
    }

    /// The next message from the cloud; `None` once the stream ended.
    async fn next(&mut self) -> Option<proto::cloud_message::Kind> {
        tokio::time::timeout(edgefleet_tests::PATIENCE, self.inbound.message())
            .await
            .expect("the cloud said nothing")
            .ok()
            .flatten()
            .and_then(|m| m.kind)
    }

    /// The next message from the cloud that is not a Heartbeat.
    async fn next_skipping_heartbeats(&mut self) -> Option<proto::cloud_message::Kind> {
        loop {
            match self.next().await {
                Some(proto::cloud_message::Kind::Heartbeat(_)) => continue,
                other => return other,
            }
        }
    }

    /// Acks every Update until one for which `done` holds.
    async fn ack_updates_until(&mut self, mut done: impl FnMut(&proto::Update) -> bool) {
        let wait = async {
            loop {
                let message = self.inbound.message().await.unwrap().expect("stream open");
                if let Some(proto::cloud_message::Kind::Update(update)) = message.kind {
                    let ack = proto::Ack {
                        nonce: update.nonce.clone(),
                    };
                    self.send(proto::agent_message::Kind::Ack(ack)).await;
                    if done(&update) {
                        return;
                    }
                }
            }
        };
        tokio::time::timeout(edgefleet_tests::PATIENCE, wait)
            .await
            .expect("the awaited Update never came");
    }

    /// Acks every Update and returns once an UplinkAck reaches `seq`.
    async fn until_uplink_ack(&mut self, seq: u64) {
        let wait = async {
            loop {
                let message = self.inbound.message().await.unwrap().expect("stream open");
                match message.kind {
                    Some(proto::cloud_message::Kind::Update(update)) => {
                        let ack = proto::Ack {
                            nonce: update.nonce,
                        };
                        self.send(proto::agent_message::Kind::Ack(ack)).await;
                    }
                    Some(proto::cloud_message::Kind::UplinkAck(ack)) if ack.seq >= seq => return,
                    _ => {}
                }
            }
        };
        tokio::time::timeout(edgefleet_tests::PATIENCE, wait)
            .await
            .unwrap_or_else(|_| panic!("no UplinkAck up to {seq}"));
    }
}

fn agent_message(kind: proto::agent_message::Kind) -> proto::AgentMessage {
    proto::AgentMessage { kind: Some(kind) }
}

fn uplink_report(key: &ResourceKey, seq: u64, temperature: f64) -> proto::agent_message::Kind {
    report_about(key, "", seq, temperature)
}

/// A report of the Device with uid `uid` (empty: not said).
fn report_about(
    key: &ResourceKey,
    uid: &str,
    seq: u64,
    temperature: f64,
) -> proto::agent_message::Kind {
    let report = proto::Report {
        device_uid: uid.to_owned(),
        device_key: key.to_string(),
        applied_generation: 1,
        properties: [(
            "temperature".to_owned(),
            (&PropertyValue::Float(temperature)).into(),
        )]
        .into(),
        firmware_version: String::new(),
        firmware_failure: None,
        health: None,
        edge_rollback: None,
        held_at_edge: None,
        overrides: Vec::new(),
        received_at_ms: 1_700_000_000_000,
    };
    proto::agent_message::Kind::Uplink(proto::Uplink {
        entries: vec![proto::UplinkEntry {
            seq,
            body: Some(proto::uplink_entry::Body::Report(report)),
        }],
    })
}

#[tokio::test]
async fn a_stale_report_never_overwrites_a_newer_one_even_after_a_controller_restart() {
    let Setup {
        client,
        ns,
        controller,
        node,
        ..
    } = Setup::new("stale").await;
    let devices: Api<Device> = Api::namespaced(client.clone(), &ns);
    create_thermostat(&devices, "t1", &node, 20.0).await;
    let key = ResourceKey::device(&ns, "t1");
    let hello = proto::Hello {
        node: node.clone(),
        agent_version: "raw".into(),
        boot_id: "b1".into(),
        store_id: "store-x".into(),
        ..Default::default()
    };
    let temperature = |d: &Device| {
        d.status
            .as_ref()
            .and_then(|s| s.reported.get("temperature"))
            .and_then(PropertyValue::as_f64)
    };

    let mut agent = RawAgent::connect(&controller, hello.clone()).await;
    agent.send(uplink_report(&key, 10, 21.0)).await;
    agent.until_uplink_ack(10).await;
    let shown = devices.get("t1").await.unwrap();
    assert_eq!(temperature(&shown), Some(21.0));
    let origin = shown.status.unwrap().last_report.unwrap();
    assert_eq!((origin.store.as_str(), origin.seq), ("store-x", 10));

    // A new controller, which knows the status only from the API server.
    drop(agent);
    drop(controller);
    let controller = start_controller(&client, &ns).await;
    let mut agent = RawAgent::connect(&controller, hello).await;
    // seq 5 from the same store is older than what status shows: ignored
    // (and acknowledged, so the agent does not resend it forever).
    agent.send(uplink_report(&key, 5, 5.0)).await;
    agent.until_uplink_ack(5).await;
    assert_eq!(temperature(&devices.get("t1").await.unwrap()), Some(21.0));
    // A newer one goes through.
    agent.send(uplink_report(&key, 11, 22.0)).await;
    agent.until_uplink_ack(11).await;
    assert_eq!(temperature(&devices.get("t1").await.unwrap()), Some(22.0));
}

/// The Events about Device `name` as (reason, note, count), oldest first.
async fn event_reasons(client: &Client, ns: &str, name: &str) -> Vec<(String, String, i32)> {
    use k8s_openapi::api::events::v1::Event;
    let events: Api<Event> = Api::namespaced(client.clone(), ns);
    let mut list: Vec<Event> = events
        .list(&Default::default())
        .await
        .unwrap()
        .items
        .into_iter()
        .filter(|e| e.regarding.as_ref().and_then(|r| r.name.as_deref()) == Some(name))
        .collect();
    list.sort_by_key(|e| e.metadata.creation_timestamp.clone());
    list.into_iter()
        .map(|e| {
            let count = e.series.as_ref().map_or(1, |s| s.count);
            (
                e.reason.unwrap_or_default(),
                e.note.unwrap_or_default(),
                count,
            )
        })
        .collect()
}

#[tokio::test]
async fn the_reconciler_accepts_generations_and_holds_a_deletion_until_the_edge_dropped_it() {
    let Setup {
        client,
        ns,
        controller,
        store,
        node,
        _dir,
    } = Setup::new("reconcile").await;
    let _agent = start_agent(&controller, &node, &store);
    // The Device must find the node's agent connected; otherwise the
    // controller rightly warns NodeNotFound.
    let edge_nodes: Api<EdgeNode> = Api::all(client.clone());
    eventually("the agent is connected", || async {
        let n = edge_nodes.get(&node).await.ok()?;
        n.status?.connected.then_some(())
    })
    .await;
    let devices: Api<Device> = Api::namespaced(client.clone(), &ns);
    let key = ResourceKey::device(&ns, "t1");

    create_thermostat(&devices, "t1", &node, 20.0).await;
    let device = eventually("the finalizer and observedGeneration 1", || async {
        let d = devices.get("t1").await.unwrap();
        let observed = d.status.as_ref()?.observed_generation;
        (observed == Some(1)).then_some(d)
    })
    .await;
    assert_eq!(
        device.metadata.finalizers,
        Some(vec!["edgefleet.io/cleanup".to_owned()])
    );

    let patch = json!({ "spec": { "desired": { "setpoint": 22.5 } } });
    devices
        .patch("t1", &PatchParams::default(), &Patch::Merge(&patch))
        .await
        .unwrap();
    eventually("observedGeneration 2", || async {
        let s = devices.get("t1").await.unwrap().status?;
        (s.observed_generation == Some(2)).then_some(())
    })
    .await;
    eventually("the device is Delivered at generation 2", || async {
        let s = devices.get("t1").await.unwrap().status?;
        (s.delivered_generation == Some(2) && s.phase == Some(DevicePhase::Delivered)).then_some(())
    })
    .await;
    // Both generations were announced: one Event, seen twice.
    let reasons = eventually("the Accepted Event seen twice", || async {
        let reasons = event_reasons(&client, &ns, "t1").await;
        let accepted: i32 = reasons
            .iter()
            .filter(|(r, _, _)| r == "Accepted")
            .map(|(_, _, count)| count)
            .sum();
        (accepted == 2).then_some(reasons)
    })
    .await;
    assert!(
        reasons
            .iter()
            .any(|(r, note, _)| r == "Accepted" && note.contains(&node)),
        "{reasons:?}"
    );
    assert!(
        !reasons.iter().any(|(r, _, _)| r == "NodeNotFound"),
        "the node's agent is connected: {reasons:?}"
    );

    // The Device is gone from the API server only once the agent dropped it.
    devices
        .delete("t1", &DeleteParams::default())
        .await
        .unwrap();
    eventually("the Device is gone", || async {
        devices.get_opt("t1").await.unwrap().is_none().then_some(())
    })
    .await;
    assert!(
        store.desired(&key).unwrap().is_none(),
        "the finalizer was removed before the agent dropped the device"
    );
    let reasons = eventually("a Removed Event", || async {
        let reasons = event_reasons(&client, &ns, "t1").await;
        reasons
            .iter()
            .any(|(r, _, _)| r == "Removed")
            .then_some(reasons)
    })
    .await;
    assert!(
        reasons
            .iter()
            .any(|(r, note, _)| r == "Removed" && note.contains("dropped")),
        "{reasons:?}"
    );

    // A Device for a node no agent ever served: a warning, and its deletion
    // does not wait for anyone.
    let nowhere = node_name("edge-nowhere");
    devices
        .create(
            &PostParams::default(),
            &Device::new("lost", thermostat(&nowhere, 20.0)),
        )
        .await
        .unwrap();
    eventually("a NodeNotFound warning", || async {
        let reasons = event_reasons(&client, &ns, "lost").await;
        reasons
            .iter()
            .any(|(r, note, _)| r == "NodeNotFound" && note.contains(&nowhere))
            .then_some(())
    })
    .await;
    eventually("the finalizer is on", || async {
        let d = devices.get("lost").await.unwrap();
        d.metadata.finalizers.is_some().then_some(())
    })
    .await;
    devices
        .delete("lost", &DeleteParams::default())
        .await
        .unwrap();
    eventually("the Device is gone", || async {
        devices
            .get_opt("lost")
            .await
            .unwrap()
            .is_none()
            .then_some(())
    })
    .await;
}

#[tokio::test]
async fn an_absent_agent_makes_its_node_and_devices_unreachable_until_it_returns() {
    let Setup {
        client,
        ns,
        controller,
        store,
        node,
        _dir,
    } = Setup::new("absent").await;
    let agent = start_agent(&controller, &node, &store);
    let devices: Api<Device> = Api::namespaced(client.clone(), &ns);
    let nodes: Api<EdgeNode> = Api::all(client.clone());
    let key = ResourceKey::device(&ns, "t1");
    create_thermostat(&devices, "t1", &node, 20.0).await;
    eventually("the agent stores the Device", || async {
        store.desired(&key).unwrap()
    })
    .await;
    let report = DeviceReport {
        applied_generation: 1,
        properties: BTreeMap::from([("setpoint".to_owned(), PropertyValue::Float(20.0))]),
        firmware_version: None,
        firmware_failure: None,
    };
    store
        .record_report(&key, report, 1_700_000_000_000)
        .await
        .unwrap();
    eventually("the device is Applied", || async {
        let s = devices.get("t1").await.unwrap().status?;
        (s.phase == Some(DevicePhase::Applied)).then_some(())
    })
    .await;

    let condition = |conditions: &[k8s_openapi::apimachinery::pkg::apis::meta::v1::Condition],
                     kind: &str| {
        conditions
            .iter()
            .find(|c| c.type_ == kind)
            .map(|c| (c.status.clone(), c.reason.clone()))
    };
    let gone_at = std::time::Instant::now();
    agent.abort();
    eventually("the EdgeNode is Ready=Unknown, NodeUnreachable", || async {
        let status = nodes.get(&node).await.unwrap().status?;
        (condition(&status.conditions, "Ready")
            == Some(("Unknown".into(), "NodeUnreachable".into())))
        .then_some(())
    })
    .await;
    assert!(
        gone_at.elapsed() >= NODE_GRACE,
        "marked unreachable before the grace period ended"
    );
    eventually("the Device is Online=Unknown, NodeUnreachable", || async {
        let s = devices.get("t1").await.unwrap().status?;
        (condition(&s.conditions, "Online") == Some(("Unknown".into(), "NodeUnreachable".into()))
            && s.phase == Some(DevicePhase::Unreachable))
        .then_some(())
    })
    .await;

    let _agent = start_agent(&controller, &node, &store);
    eventually("the EdgeNode is Ready again", || async {
        let status = nodes.get(&node).await.unwrap().status?;
        (condition(&status.conditions, "Ready").map(|c| c.0) == Some("True".into())).then_some(())
    })
    .await;
    eventually("the Device is Online and Applied again", || async {
        let s = devices.get("t1").await.unwrap().status?;
        (condition(&s.conditions, "Online").map(|c| c.0) == Some("True".into())
            && s.phase == Some(DevicePhase::Applied))
        .then_some(())
    })
    .await;
}

#[tokio::test]
async fn a_message_over_the_size_limit_is_refused_and_counted_and_others_are_served() {
    let setup = Setup::new("oversized").await;
    let mut client =
        proto::sync_client::SyncClient::connect(format!("http://{}", setup.controller.sync_addr))
            .await
            .unwrap();
    // A Hello of 100 MiB (the limit is 4 MiB): refused from its length
    // prefix, before the controller reads its body.
    let hello = proto::Hello {
        node: "x".repeat(100 * 1024 * 1024),
        ..Default::default()
    };
    let message = agent_message(proto::agent_message::Kind::Hello(hello));
    let answer = match client.stream(tokio_stream::iter([message])).await {
        Err(status) => Err(status),
        Ok(response) => response.into_inner().message().await,
    };
    assert!(answer.is_err(), "an oversized Hello was taken: {answer:?}");
    eventually("the oversized message is counted", || async {
        let n = setup.controller.sync_metrics.refused.get("oversized");
        (n == 1).then_some(())
    })
    .await;
    // The controller goes on serving agents.
    let _agent = start_agent(&setup.controller, &setup.node, &setup.store);
    eventually("a real agent has a session", || async {
        (setup.controller.sync_metrics.streams.get() == 1).then_some(())
    })
    .await;
}

/// The Secret that holds the key of Device `device`.
fn device_secret(name: &str, device: &str, psk: &[u8]) -> k8s_openapi::api::core::v1::Secret {
    use edgefleet_shared::credential::{DEVICE_LABEL, PSK_KEY, SECRET_TYPE};
    let mut secret = k8s_openapi::api::core::v1::Secret {
        type_: Some(SECRET_TYPE.into()),
        data: Some(BTreeMap::from([(
            PSK_KEY.to_owned(),
            k8s_openapi::ByteString(psk.to_vec()),
        )])),
        ..Default::default()
    };
    secret.metadata.name = Some(name.into());
    secret.metadata.labels = Some(BTreeMap::from([(
        DEVICE_LABEL.to_owned(),
        device.to_owned(),
    )]));
    secret
}

#[tokio::test]
async fn device_keys_reach_their_agent_and_rotation_and_revocation_follow_also_after_an_absence() {
    let Setup {
        client,
        ns,
        controller,
        store,
        node,
        _dir,
    } = Setup::new("keys").await;
    let devices: Api<Device> = Api::namespaced(client.clone(), &ns);
    let secrets: Api<k8s_openapi::api::core::v1::Secret> = Api::namespaced(client.clone(), &ns);
    let post = PostParams::default();
    for name in ["t1", "t2", "t3"] {
        create_thermostat(&devices, name, &node, 20.0).await;
    }
    secrets
        .create(
            &post,
            &device_secret("t1-key", "t1", b"t1-0123456789abcdef"),
        )
        .await
        .unwrap();
    secrets
        .create(
            &post,
            &device_secret("t2-key", "t2", b"t2-0123456789abcdef"),
        )
        .await
        .unwrap();
    // Too short: refused by the controller, so t3 has no key.
    secrets
        .create(&post, &device_secret("t3-key", "t3", b"short"))
        .await
        .unwrap();
    // A Secret of another type is not a device key, whatever its label.
    let mut opaque = device_secret("t3-opaque", "t3", b"t3-0123456789abcdef");
    opaque.type_ = Some("Opaque".into());
    secrets.create(&post, &opaque).await.unwrap();

    let (t1, t2, t3) = (
        ResourceKey::device(&ns, "t1"),
        ResourceKey::device(&ns, "t2"),
        ResourceKey::device(&ns, "t3"),
    );
    let key_of = |device: &ResourceKey| {
        store
            .credential(device)
            .unwrap()
            .map(|psk| psk.as_bytes().to_vec())
    };
    let agent = start_agent(&controller, &node, &store);
    eventually("t1 and t2 have their keys at the agent", || async {
        (key_of(&t1).as_deref() == Some(b"t1-0123456789abcdef".as_slice())
            && key_of(&t2).as_deref() == Some(b"t2-0123456789abcdef".as_slice()))
        .then_some(())
    })
    .await;
    assert_eq!(
        key_of(&t3),
        None,
        "an invalid key and an Opaque Secret give none"
    );
    assert_eq!(store.credential_count(), 2);
    // The operator is told why on the Secret, without the key.
    eventually("the short key's Secret has a warning Event", || async {
        event_reasons(&client, &ns, "t3-key")
            .await
            .iter()
            .any(|(reason, note, _)| {
                reason == "DeviceKeyRefused" && note.contains("5 bytes") && !note.contains("short")
            })
            .then_some(())
    })
    .await;

    // Rotation: the Secret's new key replaces the old one.
    let rotated = device_secret("t1-key", "t1", b"t1-rotated-rotated-rotated");
    secrets
        .patch("t1-key", &PatchParams::default(), &Patch::Merge(&rotated))
        .await
        .unwrap();
    let started = std::time::Instant::now();
    eventually("t1's rotated key reaches the agent", || async {
        (key_of(&t1).as_deref() == Some(b"t1-rotated-rotated-rotated".as_slice())).then_some(())
    })
    .await;
    // Revocation: deleting the Secret takes the key away.
    secrets
        .delete("t2-key", &DeleteParams::default())
        .await
        .unwrap();
    eventually("t2's key is gone from the agent", || async {
        key_of(&t2).is_none().then_some(())
    })
    .await;
    println!(
        "rotation and revocation reached the agent in {:?}",
        started.elapsed()
    );

    // While the agent is away: t1's key is revoked and t3 gets a valid one.
    agent.abort();
    let _ = agent.await;
    secrets
        .delete("t1-key", &DeleteParams::default())
        .await
        .unwrap();
    secrets
        .delete("t3-key", &DeleteParams::default())
        .await
        .unwrap();
    secrets
        .create(
            &post,
            &device_secret("t3-key", "t3", b"t3-0123456789abcdef"),
        )
        .await
        .unwrap();
    tokio::time::sleep(Duration::from_millis(500)).await;
    let agent = start_agent(&controller, &node, &store);
    eventually(
        "at the resync, t1 loses its key and t3 gets one",
        || async {
            (key_of(&t1).is_none()
                && key_of(&t3).as_deref() == Some(b"t3-0123456789abcdef".as_slice()))
            .then_some(())
        },
    )
    .await;

    // A deleted Device's key leaves with it; a second Secret claiming a
    // device makes its key ambiguous, so it has none until one goes.
    devices
        .delete("t3", &DeleteParams::default())
        .await
        .unwrap();
    eventually("t3's key leaves with its Device", || async {
        key_of(&t3).is_none().then_some(())
    })
    .await;
    create_thermostat(&devices, "t4", &node, 20.0).await;
    let t4 = ResourceKey::device(&ns, "t4");
    secrets
        .create(&post, &device_secret("t4-a", "t4", b"t4-aaaaaaaaaaaaaaaa"))
        .await
        .unwrap();
    eventually("t4 has its key", || async { key_of(&t4).map(|_| ()) }).await;
    secrets
        .create(&post, &device_secret("t4-b", "t4", b"t4-bbbbbbbbbbbbbbbb"))
        .await
        .unwrap();
    eventually("two Secrets claim t4: no key", || async {
        key_of(&t4).is_none().then_some(())
    })
    .await;
    eventually(
        "the second claim has a warning Event naming the first",
        || async {
            event_reasons(&client, &ns, "t4-b")
                .await
                .iter()
                .any(|(reason, note, _)| reason == "DeviceKeyAmbiguous" && note.contains("t4-a"))
                .then_some(())
        },
    )
    .await;
    secrets
        .delete("t4-a", &DeleteParams::default())
        .await
        .unwrap();
    eventually("one claim left: t4 has that key", || async {
        (key_of(&t4).as_deref() == Some(b"t4-bbbbbbbbbbbbbbbb".as_slice())).then_some(())
    })
    .await;

    // A new controller recovers what the agent holds, keys included,
    // without asking for its inventory.
    every_delivery_shown(&devices).await;
    agent.abort();
    let _ = agent.await;
    drop(controller);
    let controller = start_controller(&client, &ns).await;
    let _agent = start_agent(&controller, &node, &store);
    eventually("the agent is back", || async {
        (controller.sync_metrics.hellos.get("recovered") >= 1).then_some(())
    })
    .await;
    assert_eq!(controller.sync_metrics.hellos.get("inventory"), 0);
    assert_eq!(store.credential_count(), 1, "only t4's key is held");
}

#[tokio::test]
async fn without_the_grant_to_list_secrets_the_controller_does_not_start_and_names_the_grant() {
    let cp = control_plane();
    let kubeconfig = kube::config::Kubeconfig::read_from(cp.kubeconfig()).unwrap();
    let mut config = kube::Config::from_custom_kubeconfig(kubeconfig, &Default::default())
        .await
        .unwrap();
    // A service account nobody granted anything.
    config.auth_info.impersonate = Some("system:serviceaccount:default:no-grants".into());
    let client = Client::try_from(config).unwrap();
    let credentials = std::sync::Arc::new(edgefleet_cloud::credentials::Credentials::new(
        std::sync::Arc::new(edgefleet_cloud::index::Index::default()),
    ));
    let started =
        edgefleet_cloud::credentials::start(Api::all(client), credentials, Duration::from_secs(3))
            .await;
    let message = format!("{:#}", started.err().expect("start must fail"));
    assert!(
        message.contains("needs list and watch on secrets") && message.contains("forbidden"),
        "{message}"
    );
}
