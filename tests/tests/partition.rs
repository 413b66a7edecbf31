//! Network partitions between the cloud and an edge site, with real
//! processes and a real TCP proxy ([`FaultProxy`]) on the agent's sync
//! connection, while simulated devices keep reporting over CoAP.
//!
//! Twice — once with the link cut (connections closed), once with it turned
//! into a black hole (bytes silently dropped: only dead-peer detection can
//! notice) — the test waits until the cloud has ended the session and marked
//! the node unreachable, changes the fleet in the cloud (specs patched, a
//! Device deleted, one created), checks that the agent keeps serving its
//! devices from its store, heals the link and checks that the resync sends
//! only the difference. At the end every Device's status equals its simulated
//! device's last acknowledged report at its current generation.

use std::net::SocketAddr;
use std::time::Duration;

use coap_lite::{CoapOption, MessageClass, MessageType, Packet, RequestType, ResponseType};
use edgefleet_shared::api::device::condition as device_condition;
use edgefleet_shared::api::edge_node::condition as node_condition;
use edgefleet_shared::api::{Device, EdgeNode};
use edgefleet_tests::edge_events::wait_exactly_once;
use edgefleet_tests::fault::{FaultProxy, Mode};
use edgefleet_tests::final_state::{read_final_state, wait_converged};
use edgefleet_tests::fleet_view::applied_current_generation;
use edgefleet_tests::process::{http_get, metric};
use edgefleet_tests::stack::{Stack, StackSpec};
use edgefleet_tests::{control_plane, eventually, test_namespace};
use k8s_openapi::apimachinery::pkg::apis::meta::v1::Condition;
use kube::api::{Patch, PatchParams, PostParams};
use kube::{Api, ResourceExt};
use tokio::net::UdpSocket;

/// Simulated devices; the last two start without a Device and are created
/// during the partitions.
const SIMULATED: usize = 14;
const HEARTBEAT_SECONDS: u32 = 1;
const NODE_GRACE_SECONDS: u32 = 2;

fn name(i: usize) -> String {
    format!("dev-{i:05}")
}

struct World {
    stack: Stack,
    devices: Api<Device>,
    nodes: Api<EdgeNode>,
    node: String,
    ns: String,
}

impl World {
    fn proxy(&self) -> &FaultProxy {
        self.stack.agents[0]
            .proxy
            .as_ref()
            .expect("a proxied agent")
    }

    async fn cloud_metric(&self, sample: &str) -> f64 {
        let (_, body) = http_get(self.stack.cloud_metrics, "/metrics")
            .await
            .unwrap();
        metric(&body, sample)
    }

    async fn agent_metric(&self, sample: &str) -> f64 {
        let (_, body) = http_get(self.stack.agents[0].metrics, "/metrics")
            .await
            .unwrap();
        metric(&body, sample)
    }

    /// `Some` once the Devices are exactly `names` and each applied its
    /// current generation.
    async fn all_applied(&self, names: &[String]) -> Option<()> {
        let list = self.devices.list(&Default::default()).await.ok()?;
        let mut have: Vec<String> = list.items.iter().map(ResourceExt::name_any).collect();
        have.sort();
        let ok = have == names && list.items.iter().all(applied_current_generation);
        ok.then_some(())
    }

    /// The node's Ready condition.
    async fn ready(&self) -> Option<Condition> {
        let node = self.nodes.get_opt(&self.node).await.ok()??;
        find(&node.status?.conditions, node_condition::READY)
    }

    /// A CoAP `GET` of a device's desired state at the agent: the response
    /// code.
    async fn coap_desired(&self, device: &str) -> ResponseType {
        let path = format!("d/{}/{device}/desired", self.ns);
        coap_get(self.stack.agents[0].coap, &path).await
    }
}

fn find(conditions: &[Condition], type_: &str) -> Option<Condition> {
    conditions.iter().find(|c| c.type_ == type_).cloned()
}

fn online(device: &Device) -> Option<Condition> {
    find(
        &device.status.as_ref()?.conditions,
        device_condition::ONLINE,
    )
}

async fn coap_get(agent: SocketAddr, path: &str) -> ResponseType {
    let socket = UdpSocket::bind("127.0.0.1:0").await.unwrap();
    let mut packet = Packet::new();
    packet.header.set_version(1);
    packet.header.set_type(MessageType::Confirmable);
    packet.header.code = MessageClass::Request(RequestType::Get);
    packet.header.message_id = 7;
    packet.set_token(vec![7, 7]);
    for segment in path.split('/') {
        packet.add_option(CoapOption::UriPath, segment.as_bytes().to_vec());
    }
    let bytes = packet.to_bytes().unwrap();
    let mut buf = vec![0u8; 2048];
    for _ in 0..20 {
        socket.send_to(&bytes, agent).await.unwrap();
        if let Ok(Ok((len, _))) =
            tokio::time::timeout(Duration::from_millis(500), socket.recv_from(&mut buf)).await
        {
            match Packet::from_bytes(&buf[..len]).unwrap().header.code {
                MessageClass::Response(code) => return code,
                other => panic!("not a response: {other:?}"),
            }
        }
    }
    panic!("the agent never answered GET {path}");
}

/// One partition: `fault` applied, the cloud notices and marks the node
/// unreachable, the fleet changes in the cloud (three specs, `delete`
/// removed, `create` made), the agent goes on serving devices; then the link
/// heals and the resync brings exactly the difference.
async fn partition(world: &World, fault: Mode, round: usize, delete: &str, create: &Device) {
    let proxy = world.proxy();
    let silent_agents = "edgefleet_cloud_sync_silent_agents_total";
    let silent_cloud = "edgefleet_agent_sync_silent_cloud_total";
    let sent_metric = "edgefleet_cloud_sync_resources_sent_total";
    let stored_metric = "edgefleet_agent_coap_requests_total{outcome=\"stored\"}";
    let silent_agents_before = world.cloud_metric(silent_agents).await;
    let silent_cloud_before = world.agent_metric(silent_cloud).await;
    let sent_before = world.cloud_metric(sent_metric).await;

    match fault {
        Mode::Cut => proxy.cut(),
        Mode::BlackHole => proxy.black_hole(),
        Mode::Forward => unreachable!("not a fault"),
    }
    // The cloud ends the session: at once for a cut, through the heartbeat
    // rule for a black hole (no reset ever arrives).
    eventually("the cloud ended the agent's session", || async move {
        (world.cloud_metric("edgefleet_cloud_sync_streams").await == 0.0).then_some(())
    })
    .await;
    if fault == Mode::BlackHole {
        assert!(
            world.cloud_metric(silent_agents).await > silent_agents_before,
            "the cloud noticed the silent agent by its heartbeat rule"
        );
        eventually("the agent noticed the silent cloud", || async move {
            (world.agent_metric(silent_cloud).await > silent_cloud_before).then_some(())
        })
        .await;
    }

    // After the grace period the node and its Devices are unreachable.
    // (Ready turns Unknown with reason AgentDisconnected at once.)
    eventually(
        "the node is marked Ready=Unknown, reason NodeUnreachable",
        || async move {
            world
                .ready()
                .await
                .filter(|c| c.status == "Unknown" && c.reason == "NodeUnreachable")
        },
    )
    .await;
    eventually(
        "every Device of the node is Online=Unknown",
        || async move {
            let list = world.devices.list(&Default::default()).await.ok()?;
            list.items
                .iter()
                .all(|d| {
                    online(d)
                        .is_some_and(|c| c.status == "Unknown" && c.reason == "NodeUnreachable")
                })
                .then_some(())
        },
    )
    .await;

    // While apart: three specs change, one Device goes, one comes.
    let stored_at_cut = world.agent_metric(stored_metric).await;
    let changed = [1, 2, 3].map(|i| name(i + 5 * (round - 1)));
    for device in &changed {
        let patch = serde_json::json!({ "spec": { "desired": { "partition": round } } });
        world
            .devices
            .patch(device, &PatchParams::default(), &Patch::Merge(&patch))
            .await
            .unwrap();
    }
    world
        .devices
        .delete(delete, &Default::default())
        .await
        .unwrap();
    world
        .devices
        .create(&PostParams::default(), create)
        .await
        .unwrap();
    let create = &create.name_any();
    // The node is offline, so the deletion does not wait for the agent.
    eventually("the deleted Device is gone from the API", || async move {
        world
            .devices
            .get_opt(delete)
            .await
            .ok()?
            .is_none()
            .then_some(())
    })
    .await;

    // The site keeps working: devices' reports are stored and answered,
    // and wait in the outbox.
    eventually(
        "the agent keeps storing reports while apart",
        || async move {
            let stored = world.agent_metric(stored_metric).await;
            let outbox = world.agent_metric("edgefleet_agent_outbox_depth").await;
            (stored >= stored_at_cut + SIMULATED as f64 && outbox > 0.0).then_some(())
        },
    )
    .await;
    assert_eq!(
        world.coap_desired(delete).await,
        ResponseType::Content,
        "the agent still serves what it held"
    );
    assert_eq!(
        world.cloud_metric(sent_metric).await,
        sent_before,
        "nothing reached the agent while apart"
    );

    proxy.heal();
    eventually("the node is Ready again", || async move {
        world.ready().await.filter(|c| c.status == "True")
    })
    .await;
    eventually(
        "the deleted Device is gone from the agent and the new one arrived",
        || async move {
            let gone = world.coap_desired(delete).await == ResponseType::NotFound;
            let arrived = world.coap_desired(create).await == ResponseType::Content;
            (gone && arrived).then_some(())
        },
    )
    .await;
    eventually("no Device is unreachable any more", || async move {
        let list = world.devices.list(&Default::default()).await.ok()?;
        list.items
            .iter()
            .all(|d| online(d).is_none_or(|c| c.status != "Unknown"))
            .then_some(())
    })
    .await;
    assert_eq!(
        world.cloud_metric(sent_metric).await - sent_before,
        // The new Device's key Secret was applied with the fleet, so its
        // key arrives with it.
        (changed.len() + 2) as f64,
        "the resync sent only the changed Devices, the new one and its key"
    );
    assert_eq!(
        world.cloud_metric("edgefleet_cloud_sync_streams").await,
        1.0,
        "one session again"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_edge_site_keeps_working_through_partitions_and_resyncs_only_the_difference() {
    let cp = control_plane();
    let client = cp.client().await;
    let ns = test_namespace(&client, "partition").await;
    let dir = tempfile::tempdir().unwrap();
    let node = format!("edge-partition-{}", std::process::id());
    let spec = StackSpec {
        nodes: vec![node.clone()],
        namespace: ns.clone(),
        devices: SIMULATED,
        mqtt_every: 0,
        status_writes_per_second: 200,
        dir: dir.path().to_owned(),
        namespaced_controller: true,
        cloud_args: vec![
            format!("--heartbeat-seconds={HEARTBEAT_SECONDS}"),
            format!("--node-grace-seconds={NODE_GRACE_SECONDS}"),
        ],
        // Plain CoAP, so the test can ask the agent about a Device that is
        // gone (over DTLS, its key goes with it and there is no session to
        // ask in).
        agent_args: vec![
            format!("--cloud-heartbeat-seconds={HEARTBEAT_SECONDS}"),
            "--insecure-coap-plain".into(),
        ],
        sync_through_proxy: true,
    };
    let stack = Stack::start(spec, cp.kubeconfig()).await.unwrap();
    stack.apply_devices(&client).await.unwrap();
    let mut world = World {
        stack,
        devices: Api::namespaced(client.clone(), &ns),
        nodes: Api::all(client.clone()),
        node,
        ns: ns.clone(),
    };
    // The last two simulated devices start without a Device: each partition
    // creates one of them.
    let mut expected: Vec<String> = (0..SIMULATED).map(name).collect();
    let mut late = Vec::new();
    for i in [SIMULATED - 2, SIMULATED - 1] {
        let device = world.devices.get(&name(i)).await.unwrap();
        let mut again = Device::new(&name(i), device.spec.clone());
        again.metadata.namespace = Some(ns.clone());
        late.push(again);
        world
            .devices
            .delete(&name(i), &Default::default())
            .await
            .unwrap();
        expected.retain(|n| *n != name(i));
    }
    for device in &late {
        let devices = &world.devices;
        eventually("the late devices' Devices are gone", || async move {
            devices
                .get_opt(&device.name_any())
                .await
                .ok()?
                .is_none()
                .then_some(())
        })
        .await;
    }
    let final_state = dir.path().join("final.jsonl");
    world
        .stack
        .start_sim(&[
            "--insecure-coap-plain".into(),
            "--report-interval=300ms".into(),
            "--event-every=5".into(),
            format!("--final-state={}", final_state.display()),
        ])
        .unwrap();
    eventually("the fleet is applied", || world.all_applied(&expected)).await;
    let stats_before = world.proxy().stats();

    let rounds = [(Mode::Cut, 1, name(4)), (Mode::BlackHole, 2, name(5))];
    let mut deleted = Vec::new();
    for ((fault, round, delete), create) in rounds.into_iter().zip(late) {
        partition(&world, fault, round, &delete, &create).await;
        expected.retain(|n| *n != delete);
        deleted.push(delete);
        expected.push(create.name_any());
        expected.sort();
        eventually("every Device applied its current generation", || {
            world.all_applied(&expected)
        })
        .await;
    }
    let stats = world.proxy().stats();
    assert!(
        stats.refused > stats_before.refused,
        "the cut refused connections"
    );
    assert!(stats.bytes_dropped > 0, "the black hole dropped bytes");
    assert!(stats.forwarded_connections >= stats_before.forwarded_connections + 2);

    // The end: every Device shows its device's last acknowledged report.
    world.stack.check_running().unwrap();
    assert!(world.stack.stop_sim(), "the simulator stopped cleanly");
    let finals = read_final_state(&final_state).unwrap();
    if let Err(e) = wait_converged(
        &world.devices,
        &finals,
        expected.len(),
        edgefleet_tests::PATIENCE,
    )
    .await
    {
        panic!("(logs in {}) {e}", dir.keep().display());
    }
    let client = world.devices.clone().into_client();
    let ns = world.devices.namespace().unwrap().to_owned();
    let events = wait_exactly_once(
        &client,
        &ns,
        &final_state,
        &deleted,
        edgefleet_tests::PATIENCE,
    )
    .await;
    match events {
        Ok(events) => assert!(events > expected.len(), "only {events} events raised"),
        Err(e) => panic!("(logs in {}) {e}", dir.keep().display()),
    }
    assert_eq!(
        world.agent_metric("edgefleet_agent_devices").await,
        expected.len() as f64,
        "the agent holds exactly the Devices"
    );
    world.stack.shutdown();
}
