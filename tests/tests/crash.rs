//! Crash safety with real processes: the agent is killed with SIGKILL at
//! seeded random moments (100 times by default) while simulated devices
//! report and raise events over CoAP and specs change, and restarted on the
//! same store. At the end every Device's status equals its device's last
//! acknowledged report, at the Device's latest generation, and every event
//! the devices raised is a Kubernetes Event exactly once: no accepted report,
//! event or desired state was lost or repeated.
//!
//! The seed is printed; `EDGEFLEET_CRASH_SEED=N` replays a run and
//! `EDGEFLEET_CRASH_KILLS=N` sets the number of kills.

use std::path::Path;
use std::time::Duration;

use edgefleet_shared::api::Device;
use edgefleet_tests::edge_events::wait_exactly_once;
use edgefleet_tests::final_state::{read_final_state, wait_converged};
use edgefleet_tests::fleet_view::applied_current_generation;
use edgefleet_tests::process::{http_get, metric};
use edgefleet_tests::stack::{Stack, StackSpec};
use edgefleet_tests::{control_plane, eventually, test_namespace};
use kube::Api;
use kube::api::{Patch, PatchParams};
use rand::{RngExt, SeedableRng};
use rand_chacha::ChaCha8Rng;

const DEVICES: usize = 24;

/// A fleet of CoAP devices on one node in a fresh namespace: controller,
/// agent and simulator running, every device Applied.
struct Fleet {
    stack: Stack,
    devices: Api<Device>,
    dir: tempfile::TempDir,
}

impl Fleet {
    /// `sim_args` gets the fleet's directory (for files the simulator writes).
    async fn start(hint: &str, count: usize, sim_args: impl FnOnce(&Path) -> Vec<String>) -> Fleet {
        let cp = control_plane();
        let client = cp.client().await;
        let ns = test_namespace(&client, hint).await;
        let dir = tempfile::tempdir().unwrap();
        let spec = StackSpec {
            nodes: vec![format!("edge-{hint}-{}", std::process::id())],
            namespace: ns.clone(),
            devices: count,
            mqtt_every: 0,
            status_writes_per_second: 200,
            dir: dir.path().to_owned(),
            namespaced_controller: true,
            cloud_args: Vec::new(),
            agent_args: Vec::new(),
            sync_through_proxy: false,
        };
        let mut stack = Stack::start(spec, cp.kubeconfig()).await.unwrap();
        stack.apply_devices(&client).await.unwrap();
        stack.start_sim(&sim_args(dir.path())).unwrap();
        let devices: Api<Device> = Api::namespaced(client, &ns);
        eventually("every device applied its desired state", || {
            all_applied(&devices, count)
        })
        .await;
        Fleet {
            stack,
            devices,
            dir,
        }
    }
}

/// `Some` once there are `count` Devices and each applied its generation.
async fn all_applied(devices: &Api<Device>, count: usize) -> Option<()> {
    let list = devices.list(&Default::default()).await.ok()?;
    let applied = list.items.iter().all(applied_current_generation);
    (list.items.len() == count && applied).then_some(())
}
const KILLS: u32 = 100;

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_agent_killed_100_times_loses_and_repeats_no_report_event_or_desired_state() {
    let seed: u64 = edgefleet_tests::env_or("EDGEFLEET_CRASH_SEED", 7);
    let kills: u32 = edgefleet_tests::env_or("EDGEFLEET_CRASH_KILLS", KILLS);
    eprintln!("crash test seed: {seed} (EDGEFLEET_CRASH_SEED), {kills} kills");
    let mut rng = ChaCha8Rng::seed_from_u64(seed);

    let Fleet {
        mut stack,
        devices,
        dir,
    } = Fleet::start("crash", DEVICES, |dir| {
        vec![
            "--report-interval=300ms".into(),
            // Every device raises an event about every second, besides its
            // update results.
            "--event-every=3".into(),
            format!("--final-state={}", dir.join("final.jsonl").display()),
        ]
    })
    .await;
    let final_state = dir.path().join("final.jsonl");
    let all_applied = || all_applied(&devices, DEVICES);

    for kill in 1..=kills {
        tokio::time::sleep(Duration::from_millis(rng.random_range(50..800))).await;
        // Every other round a spec changes just before the kill, so kills
        // also land while an update is being stored and applied.
        if kill % 2 == 0 {
            let name = format!("dev-{:05}", rng.random_range(0..DEVICES));
            let patch = serde_json::json!({ "spec": { "desired": { "round": kill } } });
            devices
                .patch(&name, &PatchParams::default(), &Patch::Merge(&patch))
                .await
                .unwrap();
        }
        stack.kill_and_restart_agent(0, kill).await.unwrap();
    }
    // Every desired state, including the ones stored just before a kill,
    // reaches its device, and the device's report of it reaches status.
    eventually(
        "every device applied its latest generation after the kills",
        all_applied,
    )
    .await;
    stack.check_running().unwrap();
    assert!(stack.stop_sim(), "the simulator stopped cleanly");

    let finals = read_final_state(&final_state).unwrap();
    assert_eq!(finals.len(), DEVICES, "every device acknowledged a report");
    // And every Device ends at its device's last acknowledged report.
    if let Err(e) = wait_converged(&devices, &finals, DEVICES, edgefleet_tests::PATIENCE).await {
        panic!("seed {seed} (logs in {}): {e}", dir.keep().display());
    }

    // Every event raised is confirmed by the agent, and is an Event exactly
    // once: none lost to a kill, none repeated by a resend.
    let client = devices.clone().into_client();
    let ns = devices.namespace().unwrap().to_owned();
    let total =
        match wait_exactly_once(&client, &ns, &final_state, &[], edgefleet_tests::PATIENCE).await {
            Ok(total) => total,
            Err(e) => panic!("seed {seed} (logs in {}): {e}", dir.keep().display()),
        };
    assert!(
        total > DEVICES * 5,
        "only {total} events raised: the test exercised too little"
    );
    eprintln!("{total} events raised, each arrived exactly once");
    stack.shutdown();
}

/// The controller killed with SIGKILL while Devices change and one is
/// deleted: the agent reconnects to the new controller, which sends only the
/// difference (the changed Devices, the removal), not everything again.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_killed_controller_is_replaced_and_resync_is_only_the_difference() {
    const FLEET: usize = 12;
    let Fleet {
        mut stack,
        devices,
        dir: _dir,
    } = Fleet::start("crash-cloud", FLEET, |_| {
        vec!["--report-interval=500ms".into()]
    })
    .await;

    // The controller dies; meanwhile two Devices change and one is deleted
    // (its finalizer holds it until a controller lets it go).
    stack
        .kill_and_restart_cloud_after(|| async {
            for name in ["dev-00001", "dev-00002"] {
                let patch = serde_json::json!({ "spec": { "desired": { "while": "away" } } });
                devices
                    .patch(name, &PatchParams::default(), &Patch::Merge(&patch))
                    .await
                    .unwrap();
            }
            devices
                .delete("dev-00003", &Default::default())
                .await
                .unwrap();
        })
        .await
        .unwrap();

    eventually(
        "the changes reach their devices through the new controller",
        || all_applied(&devices, FLEET - 1),
    )
    .await;
    let (_, body) = http_get(stack.cloud_metrics, "/metrics").await.unwrap();
    assert_eq!(
        metric(&body, "edgefleet_cloud_sync_streams"),
        1.0,
        "the agent reconnected"
    );
    assert_eq!(
        metric(&body, "edgefleet_cloud_sync_resources_sent_total"),
        2.0,
        "the new controller sent only the two changed Devices:\n{body}"
    );
    stack.shutdown();
}
