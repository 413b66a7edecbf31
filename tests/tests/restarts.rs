//! Restarts of what the system depends on, with real processes: the
//! Kubernetes API server (a control plane of the test's own, stopped and
//! started again on the same data and address) and the site's MQTT broker
//! (Mosquitto killed and started again on the same port; the embedded broker
//! restarted with its agent). Devices keep reporting and specs change
//! throughout. Every test ends with an exact comparison: each Device's status
//! equals its simulated device's last acknowledged report, at the Device's
//! current generation.

use std::net::SocketAddr;
use std::path::{Path, PathBuf};
use std::time::Duration;

use edgefleet_shared::api::{Device, EdgeNode};
use edgefleet_tests::edge_events::wait_exactly_once;
use edgefleet_tests::final_state::{read_final_state, wait_converged};
use edgefleet_tests::fleet_view::applied_current_generation;
use edgefleet_tests::mosquitto::Mosquitto;
use edgefleet_tests::stack::{Stack, StackSpec};
use edgefleet_tests::{
    PATIENCE, RestartableControlPlane, eventually, eventually_within, test_namespace,
};
use kube::api::{Patch, PatchParams};
use kube::{Api, Client};
use nix::sys::signal::Signal;

/// How long the API server stays down.
const API_OUTAGE: Duration = Duration::from_secs(10);

/// How long to wait for the fleet to converge after a fault (watch backoff
/// after a 10 s outage alone can take ~15 s).
const RECOVERY: Duration = Duration::from_secs(60);

fn spec(hint: &str, namespace: &str, devices: usize, mqtt_every: usize, dir: &Path) -> StackSpec {
    StackSpec {
        nodes: vec![format!("edge-{hint}-{}", std::process::id())],
        namespace: namespace.to_owned(),
        devices,
        mqtt_every,
        status_writes_per_second: 200,
        dir: dir.to_owned(),
        namespaced_controller: true,
        ..StackSpec::default()
    }
}

fn sim_args(dir: &Path) -> Vec<String> {
    vec![
        "--report-interval=300ms".into(),
        "--event-every=5".into(),
        format!("--final-state={}", final_state(dir).display()),
    ]
}

fn final_state(dir: &Path) -> PathBuf {
    dir.join("final.jsonl")
}

/// `Some` once there are `count` Devices and each applied its generation.
async fn all_applied(devices: &Api<Device>, count: usize) -> Option<()> {
    let list = devices.list(&Default::default()).await.ok()?;
    let applied = list.items.iter().all(applied_current_generation);
    (list.items.len() == count && applied).then_some(())
}

/// Changes the desired state of the Devices `names`, retrying each patch
/// until the API server takes it (it may have just come back).
async fn change_specs(devices: &Api<Device>, names: impl IntoIterator<Item = usize>, round: u32) {
    for i in names {
        let name = format!("dev-{i:05}");
        let patch = serde_json::json!({ "spec": { "desired": { "round": round } } });
        eventually(&format!("{name} takes round {round}"), || async {
            devices
                .patch(&name, &PatchParams::default(), &Patch::Merge(&patch))
                .await
                .ok()
        })
        .await;
    }
}

/// The end of every test: once every Device applied its current
/// generation, the simulator stops, and then every Device's status must
/// equal its device's last acknowledged report. Keeps the logs on failure.
async fn converge_exactly(
    stack: &mut Stack,
    devices: &Api<Device>,
    count: usize,
    dir: tempfile::TempDir,
) {
    let applied = tokio::time::timeout(RECOVERY, async {
        while all_applied(devices, count).await.is_none() {
            tokio::time::sleep(Duration::from_millis(200)).await;
        }
    })
    .await;
    if applied.is_err() {
        let list = devices.list(&Default::default()).await.unwrap();
        let behind: Vec<String> = list
            .items
            .iter()
            .filter(|d| !applied_current_generation(d))
            .map(|d| {
                format!(
                    "{} generation {:?}, applied {:?}",
                    d.metadata.name.clone().unwrap_or_default(),
                    d.metadata.generation,
                    d.status.as_ref().and_then(|s| s.applied_generation)
                )
            })
            .collect();
        panic!(
            "{} of {count} Devices did not apply their current generation within {RECOVERY:?} (logs in {}):\n{}",
            behind.len(),
            dir.keep().display(),
            behind.join("\n")
        );
    }
    stack.check_running().unwrap();
    assert!(stack.stop_sim(), "the simulator stopped cleanly");

    let finals = read_final_state(&final_state(dir.path())).unwrap();
    assert_eq!(finals.len(), count, "every device acknowledged a report");
    if let Err(e) = wait_converged(devices, &finals, count, PATIENCE).await {
        panic!("(logs in {}) {e}", dir.keep().display());
    }
    let events = wait_exactly_once(
        &devices.clone().into_client(),
        devices.namespace().unwrap(),
        &final_state(dir.path()),
        &[],
        PATIENCE,
    )
    .await;
    match events {
        Ok(events) => assert!(events >= count, "only {events} events raised"),
        Err(e) => panic!("(logs in {}) {e}", dir.keep().display()),
    }
}

async fn edge_node_boot_id(client: &Client, node: &str) -> Option<String> {
    let node = Api::<EdgeNode>::all(client.clone())
        .get_opt(node)
        .await
        .ok()??;
    node.status?.boot_id
}

/// Blocking work (starting and stopping the control plane) off the
/// runtime's threads.
async fn blocking<T: Send + 'static>(f: impl FnOnce() -> T + Send + 'static) -> T {
    tokio::task::spawn_blocking(f).await.unwrap()
}

/// The API server goes away twice while CoAP devices report: once stopped
/// cleanly (SIGTERM), once killed (SIGKILL) with the agent restarted while
/// it is gone. The agent keeps acknowledging devices from its store; the
/// controller's status and EdgeNode writes fail and are retried, its watches
/// resume, and specs changed after each return reach the devices.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_api_server_restarted_twice_loses_no_report_and_no_spec() {
    const DEVICES: usize = 20;
    let mut cp = blocking(|| RestartableControlPlane::start().unwrap()).await;
    let client = cp.client().await;
    let ns = test_namespace(&client, "restart-api").await;
    let dir = tempfile::tempdir().unwrap();
    let spec = spec("api", &ns, DEVICES, 0, dir.path());
    let node = spec.nodes[0].clone();
    let mut stack = Stack::start(spec, cp.kubeconfig()).await.unwrap();
    stack.apply_devices(&client).await.unwrap();
    stack.start_sim(&sim_args(dir.path())).unwrap();
    let devices: Api<Device> = Api::namespaced(client.clone(), &ns);
    eventually_within(RECOVERY, "every device applied its desired state", || {
        all_applied(&devices, DEVICES)
    })
    .await;
    let first_boot = eventually("the EdgeNode names the agent's boot", || {
        edge_node_boot_id(&client, &node)
    })
    .await;

    for (round, signal) in [(1, Signal::SIGTERM), (2, Signal::SIGKILL)] {
        cp = blocking(move || {
            cp.stop(signal).unwrap();
            cp
        })
        .await;
        if signal == Signal::SIGKILL {
            // The agent reconnects while the API server is away: the
            // controller cannot record it in the EdgeNode yet.
            stack.kill_and_restart_agent(0, 1).await.unwrap();
        }
        // Devices keep reporting to the agent all along.
        tokio::time::sleep(API_OUTAGE).await;
        stack.check_running().unwrap();
        cp = blocking(move || {
            cp.restart().unwrap();
            cp
        })
        .await;
        change_specs(&devices, (0..DEVICES).step_by(3), round).await;
    }
    assert_eq!(cp.starts(), 3);

    converge_exactly(&mut stack, &devices, DEVICES, dir).await;
    // The agent's reconnect during the outage reached the EdgeNode later.
    let boot = eventually("the EdgeNode names the restarted agent's boot", || async {
        edge_node_boot_id(&client, &node)
            .await
            .filter(|boot| *boot != first_boot)
    })
    .await;
    assert_ne!(boot, first_boot);
    stack.shutdown();
}

/// MQTT devices report through Mosquitto, which is killed twice and started
/// again on the same port, with specs changed before, during and after each
/// outage: the agent's and the simulator's clients reconnect and subscribe
/// again, and the agent publishes desired state again for the broker that
/// forgot it.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_restarted_mosquitto_loses_no_spec_and_the_last_reports_arrive() {
    const DEVICES: usize = 20;
    let dir = tempfile::tempdir().unwrap();
    let mut mosquitto = Mosquitto::start(dir.path());
    mosquitto.wait_listening().await;
    let cp = edgefleet_tests::control_plane();
    let client = cp.client().await;
    let ns = test_namespace(&client, "restart-mosquitto").await;
    let spec = spec("mosq", &ns, DEVICES, 1, dir.path());
    let mut stack = Stack::start_with_broker(spec, cp.kubeconfig(), Some(mosquitto.addr))
        .await
        .unwrap();
    stack.apply_devices(&client).await.unwrap();
    stack.start_sim(&sim_args(dir.path())).unwrap();
    let devices: Api<Device> = Api::namespaced(client.clone(), &ns);
    eventually_within(RECOVERY, "every device applied its desired state", || {
        all_applied(&devices, DEVICES)
    })
    .await;

    let endpoint = stack.agents[0].metrics;
    let probe = |path: &'static str| async move {
        edgefleet_tests::process::http_get(endpoint, path)
            .await
            .map(|(code, _)| code)
            .ok()
    };
    assert_eq!(probe("/readyz").await, Some(200));
    for round in 1..=2u32 {
        change_specs(&devices, (0..DEVICES).step_by(4), round * 10).await;
        mosquitto.kill();
        // An external broker that is away makes the agent not ready, not
        // unhealthy: restarting the agent would not bring it back.
        eventually_within(
            RECOVERY,
            "the agent is not ready without its broker",
            || async { (probe("/readyz").await == Some(503)).then_some(()) },
        )
        .await;
        assert_eq!(probe("/healthz").await, Some(200));
        // Reaches the agent over gRPC while it has no broker.
        change_specs(&devices, (1..DEVICES).step_by(4), round * 10 + 1).await;
        tokio::time::sleep(Duration::from_secs(2)).await;
        mosquitto.restart();
        mosquitto.wait_listening().await;
        eventually_within(RECOVERY, "the agent is ready again", || async {
            (probe("/readyz").await == Some(200)).then_some(())
        })
        .await;
        change_specs(&devices, (2..DEVICES).step_by(4), round * 10 + 2).await;
    }

    converge_exactly(&mut stack, &devices, DEVICES, dir).await;
    stack.shutdown();
    mosquitto.kill();
}

/// The same with the embedded broker: restarting the agent (SIGKILL)
/// restarts the broker inside it, which forgets every session and retained
/// message; the simulator's MQTT clients reconnect to the new one.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_restarted_embedded_broker_loses_no_spec_and_the_last_reports_arrive() {
    const DEVICES: usize = 20;
    let cp = edgefleet_tests::control_plane();
    let client = cp.client().await;
    let ns = test_namespace(&client, "restart-embedded").await;
    let dir = tempfile::tempdir().unwrap();
    let spec = spec("emb", &ns, DEVICES, 1, dir.path());
    let mut stack = Stack::start(spec, cp.kubeconfig()).await.unwrap();
    stack.apply_devices(&client).await.unwrap();
    stack.start_sim(&sim_args(dir.path())).unwrap();
    let devices: Api<Device> = Api::namespaced(client.clone(), &ns);
    eventually_within(RECOVERY, "every device applied its desired state", || {
        all_applied(&devices, DEVICES)
    })
    .await;

    for round in 1..=2u32 {
        change_specs(&devices, (0..DEVICES).step_by(3), round * 10).await;
        stack.kill_and_restart_agent(0, round).await.unwrap();
        tokio::time::sleep(Duration::from_secs(2)).await;
        change_specs(&devices, (1..DEVICES).step_by(3), round * 10 + 1).await;
    }

    converge_exactly(&mut stack, &devices, DEVICES, dir).await;
    stack.shutdown();
}

/// A report published to Mosquitto while the agent is down (killed, not
/// yet restarted) is kept by the broker in the agent's persistent session
/// and stored by the agent when it is back: the broker's PUBACK to the
/// device is not a promise the agent breaks by crashing.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_report_published_while_the_agent_is_down_reaches_status_through_mosquitto() {
    let dir = tempfile::tempdir().unwrap();
    let mut mosquitto = Mosquitto::start(dir.path());
    mosquitto.wait_listening().await;
    let cp = edgefleet_tests::control_plane();
    let client = cp.client().await;
    let ns = test_namespace(&client, "restart-session").await;
    let spec = spec("sess", &ns, 1, 1, dir.path());
    let node = spec.nodes[0].clone();
    let mut stack = Stack::start_with_broker(spec, cp.kubeconfig(), Some(mosquitto.addr))
        .await
        .unwrap();
    stack.apply_devices(&client).await.unwrap();
    let devices: Api<Device> = Api::namespaced(client.clone(), &ns);
    let name = devices.list(&Default::default()).await.unwrap().items[0]
        .metadata
        .name
        .clone()
        .unwrap();
    let key = edgefleet_shared::ResourceKey::device(&ns, &name);
    let temperature = |d: &Device| {
        d.status
            .as_ref()
            .and_then(|s| s.reported.get("temperature"))
            .and_then(edgefleet_shared::PropertyValue::as_f64)
    };
    let shows = |value: f64| {
        let devices = devices.clone();
        let name = name.clone();
        move || {
            let (devices, name) = (devices.clone(), name.clone());
            async move {
                let d = devices.get(&name).await.ok()?;
                (temperature(&d) == Some(value)).then_some(())
            }
        }
    };

    let device = FakeMqttDevice::connect(mosquitto.addr).await;
    // The agent subscribes right after its broker connection is up, which
    // can be after its health endpoint answers: a report published before
    // that reaches no subscriber (Mosquitto keeps none for later), so the
    // first one is sent again until status shows it. The report this test
    // is about comes later, once the agent's session has its subscriptions.
    let first = shows(1.0);
    eventually_within(RECOVERY, "status shows the first report", || {
        let (device, node, key, first) = (&device, &node, &key, &first);
        async move {
            if first().await.is_some() {
                return Some(());
            }
            device.report(node, key, 1.0).await;
            tokio::time::sleep(Duration::from_millis(500)).await;
            first().await
        }
    })
    .await;

    stack.kill_agent(0);
    device.report(&node, &key, 2.0).await;
    stack.start_agent_again(0, 1).await.unwrap();
    eventually_within(
        RECOVERY,
        "status shows the report published while the agent was down",
        shows(2.0),
    )
    .await;
    stack.shutdown();
    mosquitto.kill();
}

/// An MQTT device played by the test: publishes a report and returns once
/// the broker acknowledged it.
struct FakeMqttDevice {
    client: rumqttc::AsyncClient,
    acked: tokio::sync::Mutex<tokio::sync::mpsc::Receiver<()>>,
}

impl FakeMqttDevice {
    async fn connect(broker: SocketAddr) -> FakeMqttDevice {
        let options = rumqttc::MqttOptions::new(
            format!("fake-device-{}", std::process::id()),
            broker.ip().to_string(),
            broker.port(),
        );
        let (client, mut events) = rumqttc::AsyncClient::new(options, 16);
        let (tx, rx) = tokio::sync::mpsc::channel(16);
        tokio::spawn(async move {
            loop {
                match events.poll().await {
                    Ok(rumqttc::Event::Incoming(rumqttc::Packet::PubAck(_))) => {
                        let _ = tx.send(()).await;
                    }
                    Ok(_) => {}
                    Err(_) => tokio::time::sleep(Duration::from_millis(200)).await,
                }
            }
        });
        FakeMqttDevice {
            client,
            acked: tokio::sync::Mutex::new(rx),
        }
    }

    async fn report(&self, node: &str, key: &edgefleet_shared::ResourceKey, temperature: f64) {
        let report = edgefleet_shared::codec::DeviceReport {
            applied_generation: 1,
            properties: [(
                "temperature".to_owned(),
                edgefleet_shared::PropertyValue::Float(temperature),
            )]
            .into(),
            firmware_version: None,
            firmware_failure: None,
        };
        let payload = edgefleet_shared::codec::encode(&report).unwrap();
        self.client
            .publish(
                edgefleet_shared::topics::report(node, key),
                rumqttc::QoS::AtLeastOnce,
                false,
                payload,
            )
            .await
            .unwrap();
        tokio::time::timeout(PATIENCE, self.acked.lock().await.recv())
            .await
            .expect("the broker acknowledged the report");
    }
}
