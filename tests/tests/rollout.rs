//! Fleet rollouts end to end: the controller, one agent per site and the
//! simulated devices as real processes against a real API server. Each
//! test records the rollout's timeline from a Device watch and checks
//! every moment of it (`edgefleet_tests::rollout_timeline`).

use std::collections::BTreeMap;
use std::time::Duration;

use edgefleet_shared::api::rollout::{FleetRollout, RolloutPhase};
use edgefleet_shared::api::{Device, EdgeNode};
use edgefleet_tests::rollout_timeline::{Expectations, Recorder, Timeline};
use edgefleet_tests::stack::{Stack, StackSpec};
use edgefleet_tests::{control_plane, eventually, eventually_within, test_namespace};
use kube::api::{Patch, PatchParams, PostParams};
use kube::{Api, ResourceExt};
use serde_json::{Value, json};

/// The label of a site on its EdgeNode.
const SITE: &str = "edgefleet.io/site";

/// Sites (one agent each) with their simulated devices, every device
/// applied, each EdgeNode labelled with its site.
struct Sites {
    stack: Stack,
    ns: String,
    devices: Api<Device>,
    rollouts: Api<FleetRollout>,
    /// Each device's site.
    site_of: BTreeMap<String, String>,
    _dir: tempfile::TempDir,
}

impl Sites {
    async fn start(hint: &str, sites: usize, devices: usize, sim_args: &[&str]) -> Sites {
        let cp = control_plane();
        let client = cp.client().await;
        let ns = test_namespace(&client, hint).await;
        let dir = tempfile::tempdir().unwrap();
        let nodes: Vec<String> = (0..sites)
            .map(|i| format!("{hint}-{i}-{}", std::process::id()))
            .collect();
        let spec = StackSpec {
            nodes: nodes.clone(),
            namespace: ns.clone(),
            devices,
            mqtt_every: 3,
            status_writes_per_second: 200,
            dir: dir.path().to_owned(),
            namespaced_controller: true,
            cloud_args: Vec::new(),
            agent_args: Vec::new(),
            sync_through_proxy: false,
        };
        let mut stack = Stack::start(spec, cp.kubeconfig()).await.unwrap();
        stack.apply_devices(&client).await.unwrap();
        let sim_args: Vec<String> = ["--report-interval=1s"]
            .iter()
            .chain(sim_args)
            .map(|s| (*s).to_owned())
            .collect();
        stack.start_sim(&sim_args).unwrap();
        let devices_api: Api<Device> = Api::namespaced(client.clone(), &ns);
        let listed = eventually("every device applied its desired state", || async {
            let list = devices_api.list(&Default::default()).await.ok()?;
            let applied = list
                .items
                .iter()
                .all(edgefleet_tests::fleet_view::applied_current_generation);
            (list.items.len() == devices && applied).then_some(list.items)
        })
        .await;
        let edge_nodes: Api<EdgeNode> = Api::all(client.clone());
        for (i, node) in nodes.iter().enumerate() {
            let labels = json!({ "metadata": { "labels": { SITE: format!("site-{i}") } } });
            eventually("the EdgeNode exists", || async {
                edge_nodes
                    .patch(node, &PatchParams::default(), &Patch::Merge(&labels))
                    .await
                    .ok()
            })
            .await;
        }
        let site_of = listed
            .iter()
            .map(|d| {
                let i = nodes.iter().position(|n| *n == d.spec.node).unwrap();
                (d.name_any(), format!("site-{i}"))
            })
            .collect();
        Sites {
            stack,
            rollouts: Api::namespaced(client.clone(), &ns),
            ns,
            devices: devices_api,
            site_of,
            _dir: dir,
        }
    }

    /// Creates a rollout with `spec` and starts recording its timeline.
    async fn roll_out(&self, name: &str, spec: Value) -> (FleetRollout, Recorder) {
        let rollout: FleetRollout = serde_json::from_value(json!({
            "apiVersion": "edgefleet.io/v1alpha1",
            "kind": "FleetRollout",
            "metadata": { "name": name, "namespace": self.ns },
            "spec": spec,
        }))
        .unwrap();
        let created = self
            .rollouts
            .create(&PostParams::default(), &rollout)
            .await
            .unwrap();
        let expect = Expectations::plan(&created, &self.site_of);
        let recorder = Recorder::start(self.devices.clone(), created.clone(), expect);
        (created, recorder)
    }

    /// Waits until the rollout's status shows `phase`; returns it.
    async fn wait_for_phase(
        &self,
        name: &str,
        phase: RolloutPhase,
        patience: Duration,
    ) -> FleetRollout {
        eventually_within(
            patience,
            &format!("rollout {name} is {phase:?}"),
            || async {
                let r = self.rollouts.get(name).await.ok()?;
                (r.status.as_ref()?.phase == Some(phase)).then_some(r)
            },
        )
        .await
    }

    /// Every device's firmware as it reports it.
    async fn firmware(&self) -> BTreeMap<String, Option<String>> {
        let list = self.devices.list(&Default::default()).await.unwrap();
        list.items
            .iter()
            .map(|d| {
                let version = d.status.as_ref().and_then(|s| s.firmware_version.clone());
                (d.name_any(), version)
            })
            .collect()
    }
}

fn firmware_target(version: &str) -> Value {
    json!({
        "firmware": {
            "version": version,
            "url": format!("https://firmware.example/sim-{version}.bin"),
            "sha256": "ab".repeat(32),
        }
    })
}

/// No limit exceeded at any moment, no stage or site canary jumped.
fn assert_limits(t: &Timeline, overall: usize, per_site: usize) {
    assert!(t.violations.is_empty(), "order broken: {:#?}", t.violations);
    assert!(
        t.max_unavailable <= overall,
        "{} devices unavailable at once, limit {overall}",
        t.max_unavailable
    );
    for (site, max) in &t.max_unavailable_by_site {
        assert!(
            *max <= per_site,
            "{max} unavailable at once in {site}, limit {per_site}"
        );
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_rollout_goes_canary_then_waves_within_its_limits_at_every_moment() {
    let sites = Sites::start("fro-waves", 3, 30, &[]).await;
    let (_, recorder) = sites
        .roll_out(
            "fw-2",
            json!({
                "target": firmware_target("2.0.0"),
                "selector": {},
                "strategy": {
                    "canary": 1,
                    "waves": ["50%"],
                    "maxUnavailable": 4,
                    "failureDomain": { "topologyKey": SITE, "maxUnavailable": 2, "canary": 1 },
                },
            }),
        )
        .await;
    let done = sites
        .wait_for_phase("fw-2", RolloutPhase::Complete, Duration::from_secs(180))
        .await;
    let timeline = recorder.finish();
    eprintln!(
        "{} moments, at most {} unavailable ({:?} per site); changed in order {:?}",
        timeline.moments,
        timeline.max_unavailable,
        timeline.max_unavailable_by_site,
        timeline.changed
    );
    assert_limits(&timeline, 4, 2);
    assert_eq!(timeline.changed.len(), 30, "every device changed once");
    // The limits were reached, not just respected: 2 at once in each site.
    assert!(
        timeline.max_unavailable_by_site.values().all(|&m| m == 2),
        "{:?}",
        timeline.max_unavailable_by_site
    );
    let status = done.status.unwrap();
    assert_eq!((status.counts.total, status.counts.succeeded), (30, 30));
    assert_eq!(status.waves.len(), 3, "canary, 50 %, the rest");
    assert_eq!(status.sites.len(), 3);
    let firmware = sites.firmware().await;
    assert!(
        firmware.values().all(|v| v.as_deref() == Some("2.0.0")),
        "{firmware:?}"
    );
    sites.stack.shutdown();
}
