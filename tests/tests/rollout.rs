//! Fleet rollouts end to end: the controller, one agent per site and the
//! simulated devices as real processes against a real API server. Each
//! test records the rollout's timeline from a Device watch and checks
//! every moment of it (`edgefleet_tests::rollout_timeline`).

use std::collections::BTreeMap;
use std::time::Duration;

use edgefleet_shared::api::device::condition;
use edgefleet_shared::api::rollout::{FleetRollout, RolloutPhase};
use edgefleet_shared::api::{Device, EdgeNode};
use edgefleet_shared::rollout_member;
use edgefleet_tests::rollout_timeline::{Expectations, Recorder, Timeline};
use edgefleet_tests::stack::{Stack, StackSpec};
use edgefleet_tests::{control_plane, eventually, eventually_within, test_namespace};
use kube::api::{Patch, PatchParams, PostParams};
use kube::{Api, ResourceExt};
use serde_json::{Value, json};

/// The label of a site on its EdgeNode.
const SITE: &str = "edgefleet.io/site";

/// The firmware the simulated devices run at first.
const FACTORY: &str = edgefleet_sim::device::FACTORY_FIRMWARE;

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
            // Each agent's sync link through a proxy a test can cut.
            sync_through_proxy: true,
        };
        let mut stack = Stack::start(spec, cp.kubeconfig()).await.unwrap();
        stack.apply_devices(&client).await.unwrap();
        let devices_api: Api<Device> = Api::namespaced(client.clone(), &ns);
        // Every device runs the factory firmware; its Device says so, so a
        // rollback has a version to go back to.
        let factory = json!({ "spec": { "firmware": { "version": FACTORY } } });
        for d in devices_api.list(&Default::default()).await.unwrap() {
            devices_api
                .patch(
                    &d.name_any(),
                    &PatchParams::default(),
                    &Patch::Merge(&factory),
                )
                .await
                .unwrap();
        }
        let mut defaults = vec!["--report-interval=500ms"];
        if !sim_args.iter().any(|a| a.starts_with("--install-time")) {
            defaults.push("--install-time=300ms..800ms");
        }
        let sim_args: Vec<String> = defaults
            .iter()
            .chain(sim_args)
            .map(|s| (*s).to_owned())
            .collect();
        stack.start_sim(&sim_args).unwrap();
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
        self.roll_out_cutting(name, spec, &[]).await
    }

    /// [`Sites::roll_out`], where the sites `cut` will be cut off during the
    /// test (the stage order does not wait for their devices).
    async fn roll_out_cutting(
        &self,
        name: &str,
        spec: Value,
        cut: &[&str],
    ) -> (FleetRollout, Recorder) {
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
        let mut expect = Expectations::plan(&created, &self.site_of);
        expect.unreachable = self
            .site_of
            .iter()
            .filter(|(_, site)| cut.contains(&site.as_str()))
            .map(|(name, _)| name.clone())
            .collect();
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
        let deadline = tokio::time::Instant::now() + patience;
        loop {
            let r = self.rollouts.get(name).await.unwrap();
            if r.status.as_ref().and_then(|s| s.phase) == Some(phase) {
                return r;
            }
            if tokio::time::Instant::now() >= deadline {
                let devices = self.devices.list(&Default::default()).await.unwrap();
                for d in devices {
                    eprintln!(
                        "{}: generation {:?}, spec firmware {:?}, record {:?}, status {:?}",
                        d.name_any(),
                        d.metadata.generation,
                        d.spec.firmware.as_ref().map(|f| &f.version),
                        d.annotations()
                            .get(edgefleet_shared::rollout_member::RECORD_ANNOTATION),
                        d.status
                    );
                }
                panic!(
                    "rollout {name} is not {phase:?} after {patience:?}; its status: {:#?}",
                    r.status
                );
            }
            tokio::time::sleep(Duration::from_millis(100)).await;
        }
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
                // Judged by each agent: healthy for a second after the install.
                "health": { "expression": "online && !('crashes' in reported)", "bakeSeconds": 1 },
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
    // Each device passed its agent's health check of the rollout's change.
    for d in sites.devices.list(&Default::default()).await.unwrap() {
        let healthy = d.status.as_ref().and_then(|s| {
            s.conditions.iter().find(|c| {
                c.type_ == condition::HEALTHY && c.observed_generation == d.metadata.generation
            })
        });
        assert_eq!(
            healthy.map(|c| (c.status.as_str(), c.reason.as_str())),
            Some(("True", condition::HEALTH_CHECK_PASSED)),
            "{}",
            d.name_any()
        );
    }
    // And each Device's status shows its part, for `kubectl get devices -o wide`.
    eventually("every Device shows it succeeded in fw-2", || async {
        let list = sites.devices.list(&Default::default()).await.ok()?;
        list.items
            .iter()
            .all(|d| {
                let part = d.status.as_ref().and_then(|s| s.rollout.as_ref());
                part.is_some_and(|p| {
                    p.name == "fw-2" && p.state == "Succeeded" && p.failure.is_none()
                })
            })
            .then_some(())
    })
    .await;
    sites.stack.shutdown();
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_bad_firmware_is_caught_by_the_health_gate_at_the_edge_and_rolled_back() {
    let sites = Sites::start("fro-health", 2, 12, &["--bad-firmware=2.0.0"]).await;
    let (_, recorder) = sites
        .roll_out(
            "fw-2",
            json!({
                "target": firmware_target("2.0.0"),
                "selector": {},
                "strategy": { "canary": 2, "maxUnavailable": 2 },
                "health": { "expression": "!('crashes' in reported)", "bakeSeconds": 3 },
                "failurePolicy": {
                    "thresholds": [{
                        "scope": "Overall", "percent": 50, "minSample": 2, "classes": ["HealthFailed"],
                    }],
                    "action": "Rollback",
                    "rollbackScope": "All",
                },
            }),
        )
        .await;
    let done = sites
        .wait_for_phase("fw-2", RolloutPhase::RolledBack, Duration::from_secs(90))
        .await;
    let timeline = recorder.finish();
    assert_limits(&timeline, 2, 2);
    let (_, reason, message) = condition(&done, "RolledBack");
    assert_eq!(reason, "FailureThreshold", "{message}");
    assert_eq!(timeline.changed.len(), 2, "stopped at the canary");
    assert!(!timeline.failed.is_empty());
    for name in &timeline.failed {
        let d = sites.devices.get(name).await.unwrap();
        let failed = d.status.as_ref().unwrap().conditions.iter().any(|c| {
            c.type_ == condition::HEALTHY
                && c.status == "False"
                && c.reason == condition::HEALTH_CHECK_FAILED
        });
        assert!(
            failed,
            "{name} failed without the agent's verdict: {:?}",
            d.status
        );
    }
    // Back on the good firmware; no device crashes any more.
    eventually(
        "every device runs and reports the previous firmware, healthy",
        || async {
            let list = sites.devices.list(&Default::default()).await.ok()?;
            list.items
                .iter()
                .all(|d| {
                    let status = d.status.as_ref();
                    d.spec.firmware.as_ref().map(|f| f.version.as_str()) == Some(FACTORY)
                        && status.and_then(|s| s.firmware_version.as_deref()) == Some(FACTORY)
                        && status.is_some_and(|s| {
                            !s.reported.contains_key(edgefleet_sim::firmware::CRASHES)
                        })
                })
                .then_some(())
        },
    )
    .await;
    sites.stack.shutdown();
}

/// Each Device's spec firmware and the firmware its device reports.
async fn spec_and_reported(
    devices: &Api<Device>,
) -> BTreeMap<String, (Option<String>, Option<String>)> {
    let list = devices.list(&Default::default()).await.unwrap();
    list.items
        .iter()
        .map(|d| {
            let spec = d.spec.firmware.as_ref().map(|f| f.version.clone());
            let reported = d.status.as_ref().and_then(|s| s.firmware_version.clone());
            (d.name_any(), (spec, reported))
        })
        .collect()
}

/// Waits until every Device's spec and its device are on the factory
/// firmware again.
async fn all_back_on_factory_firmware(devices: &Api<Device>) {
    eventually("every device reports the previous firmware", || async {
        let firmware = spec_and_reported(devices).await;
        firmware
            .values()
            .all(|(spec, reported)| {
                spec.as_deref() == Some(FACTORY) && reported.as_deref() == Some(FACTORY)
            })
            .then_some(())
    })
    .await;
}

/// The condition `type_` of `rollout` (status, reason, message); it must
/// have one.
fn condition<'a>(rollout: &'a FleetRollout, type_: &str) -> (&'a str, &'a str, &'a str) {
    condition_opt(rollout, type_).unwrap_or_else(|| panic!("no {type_} condition"))
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn install_failures_under_the_thresholds_let_the_rollout_complete_with_them_counted() {
    // About one install in five fails (seeded: the same devices every run).
    let sites = Sites::start("fro-fail", 2, 20, &["--install-failure=2.0.0=20"]).await;
    let (_, recorder) = sites
        .roll_out(
            "fw-2",
            json!({
                "target": firmware_target("2.0.0"),
                "selector": {},
                "strategy": { "canary": 2, "maxUnavailable": 4 },
                "failurePolicy": {
                    "thresholds": [{ "scope": "Overall", "percent": 60, "minSample": 5 }],
                    "action": "Rollback",
                    "rollbackScope": "All",
                },
            }),
        )
        .await;
    let done = sites
        .wait_for_phase("fw-2", RolloutPhase::Complete, Duration::from_secs(120))
        .await;
    let timeline = recorder.finish();
    assert_limits(&timeline, 4, 4);
    let failed = timeline.failed.len();
    assert!(failed > 0, "the test needs some failures; none happened");
    let status = done.status.as_ref().unwrap();
    assert_eq!(status.counts.failed as usize, failed, "{status:?}");
    assert_eq!(status.counts.succeeded as usize, 20 - failed);
    let (degraded, reason, _) = condition(&done, "Degraded");
    assert_eq!((degraded, reason), ("False", "FailuresBelowThreshold"));
    // Their Devices say so, and why.
    eventually("the failed Devices show their failure", || async {
        for name in &timeline.failed {
            let d = sites.devices.get(name).await.ok()?;
            let part = d.status?.rollout?;
            (part.state == "Failed" && part.failure.as_deref() == Some("InstallFailed"))
                .then_some(())?;
        }
        Some(())
    })
    .await;
    // The failed ones run what they ran, the others the target.
    let firmware = spec_and_reported(&sites.devices).await;
    for (name, (_, reported)) in &firmware {
        let expected = match timeline.failed.contains(name) {
            true => FACTORY,
            false => "2.0.0",
        };
        assert_eq!(reported.as_deref(), Some(expected), "{name}");
    }
    sites.stack.shutdown();
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn failed_installs_are_retried_within_the_limits_and_each_device_shows_its_attempt() {
    // Half the installs fail; each device may try five times.
    let sites = Sites::start("fro-retry", 2, 12, &["--install-failure=2.0.0=50"]).await;
    let (_, recorder) = sites
        .roll_out(
            "fw-2",
            json!({
                "target": firmware_target("2.0.0"),
                "selector": {},
                "strategy": {
                    "canary": 1,
                    "maxUnavailable": 4,
                    "failureDomain": { "topologyKey": SITE, "maxUnavailable": 2, "canary": 1 },
                },
                // Never judged: what happens to each device is the point.
                "failurePolicy": {
                    "thresholds": [{ "scope": "Overall", "percent": 100, "minSample": 1000 }],
                    "retries": 4,
                },
            }),
        )
        .await;
    let done = sites
        .wait_for_phase("fw-2", RolloutPhase::Complete, Duration::from_secs(180))
        .await;
    let timeline = recorder.finish();
    // Retries take places like first attempts, and no attempt was made twice.
    assert_limits(&timeline, 4, 2);
    assert!(
        timeline.changed_twice.is_empty(),
        "{:?}",
        timeline.changed_twice
    );
    let retried = timeline.attempts.values().filter(|&&a| a > 1).count();
    assert!(retried > 0, "no install failed: the test needs some");

    let status = done.status.as_ref().unwrap();
    let mut failed = 0;
    let parts = eventually("every Device shows its last attempt", || async {
        let list = sites.devices.list(&Default::default()).await.ok()?;
        let parts: Vec<(Device, _)> = list
            .items
            .into_iter()
            .map(|d| {
                let part = d.status.as_ref().and_then(|s| s.rollout.clone());
                (d, part)
            })
            .collect();
        parts
            .iter()
            .all(|(d, p)| {
                p.as_ref().is_some_and(|p| {
                    Some(&p.attempt) == timeline.attempts.get(&d.name_any())
                        && matches!(p.state.as_str(), "Succeeded" | "Failed")
                })
            })
            .then_some(parts)
    })
    .await;
    for (device, part) in &parts {
        let name = device.name_any();
        let part = part.as_ref().unwrap();
        // One new generation per retry: the spec's counter says how many.
        assert_eq!(device.spec.retry, part.attempt - 1, "{name}");
        let reported = device.status.as_ref().unwrap().firmware_version.clone();
        match part.state.as_str() {
            "Succeeded" => {
                assert_eq!(reported.as_deref(), Some("2.0.0"), "{name}");
                let expected = (part.attempt > 1).then_some("InstallFailed");
                assert_eq!(
                    part.failure.as_deref(),
                    expected,
                    "{name}: why attempt {} came",
                    part.attempt
                );
            }
            _ => {
                failed += 1;
                assert_eq!(part.attempt, 5, "{name} failed before its last attempt");
                assert_eq!(part.failure.as_deref(), Some("InstallFailed"), "{name}");
                assert_eq!(reported.as_deref(), Some(FACTORY), "{name}");
            }
        }
    }
    assert_eq!(status.counts.failed, failed, "{status:?}");
    assert_eq!(status.counts.succeeded, 12 - failed, "{status:?}");
    sites.stack.shutdown();
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn crossing_a_failure_threshold_rolls_every_changed_device_back() {
    let sites = Sites::start("fro-rollback", 2, 16, &["--install-failure=2.0.0=50"]).await;
    let (_, recorder) = sites
        .roll_out(
            "fw-2",
            json!({
                "target": firmware_target("2.0.0"),
                "selector": {},
                "strategy": { "canary": 2, "maxUnavailable": 4 },
                "failurePolicy": {
                    "thresholds": [{ "scope": "Overall", "percent": 25, "minSample": 4 }],
                    "action": "Rollback",
                    "rollbackScope": "All",
                },
            }),
        )
        .await;
    let done = sites
        .wait_for_phase("fw-2", RolloutPhase::RolledBack, Duration::from_secs(120))
        .await;
    let timeline = recorder.finish();
    assert_limits(&timeline, 4, 4);
    assert!(
        timeline.changed.len() < 16,
        "the rollout stopped at the threshold, yet changed every device"
    );
    let (rolled_back, reason, message) = condition(&done, "RolledBack");
    assert_eq!(
        (rolled_back, reason),
        ("True", "FailureThreshold"),
        "{message}"
    );
    let mut changed = timeline.changed.clone();
    changed.sort();
    let mut back = timeline.rolled_back.clone();
    back.sort();
    assert_eq!(back, changed, "every changed device was changed back");
    // Back on the previous firmware: in the spec and as the devices say.
    all_back_on_factory_firmware(&sites.devices).await;
    sites.stack.shutdown();
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_paused_rollout_waits_a_resumed_one_goes_on_and_an_aborted_one_rolls_back() {
    let sites = Sites::start("fro-control", 2, 12, &["--install-time=2s..3s"]).await;
    let spec = json!({
        "target": firmware_target("2.0.0"),
        "selector": {},
        "strategy": { "canary": 1, "maxUnavailable": 2 },
        "failurePolicy": { "rollbackScope": "All" },
        "paused": true,
    });
    let (_, recorder) = sites.roll_out("fw-2", spec).await;
    let paused = sites
        .wait_for_phase("fw-2", RolloutPhase::Paused, Duration::from_secs(30))
        .await;
    assert_eq!(condition(&paused, "Paused").1, "PausedBySpec");
    tokio::time::sleep(Duration::from_secs(3)).await;
    assert!(
        recorder.timeline().changed.is_empty(),
        "paused, yet devices changed"
    );

    let resume = json!({ "spec": { "paused": false } });
    sites
        .rollouts
        .patch("fw-2", &PatchParams::default(), &Patch::Merge(&resume))
        .await
        .unwrap();
    eventually_within(Duration::from_secs(60), "three devices updated", || async {
        let r = sites.rollouts.get("fw-2").await.ok()?;
        (r.status?.counts.succeeded >= 3).then_some(())
    })
    .await;
    let abort = json!({ "spec": { "abort": true } });
    sites
        .rollouts
        .patch("fw-2", &PatchParams::default(), &Patch::Merge(&abort))
        .await
        .unwrap();
    let done = sites
        .wait_for_phase("fw-2", RolloutPhase::RolledBack, Duration::from_secs(60))
        .await;
    assert_eq!(condition(&done, "RolledBack").1, "Aborted");
    let timeline = recorder.finish();
    assert_limits(&timeline, 2, 2);
    assert!(timeline.changed.len() < 12, "aborted mid-way");
    all_back_on_factory_firmware(&sites.devices).await;
    sites.stack.shutdown();
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn of_two_rollouts_over_the_same_devices_the_later_waits_for_the_earlier() {
    let sites = Sites::start("fro-overlap", 2, 8, &[]).await;
    let spec = |version: &str| {
        json!({
            "target": firmware_target(version),
            "selector": {},
            "strategy": { "canary": 1, "maxUnavailable": 2 },
        })
    };
    let (_, first) = sites.roll_out("fw-2", spec("2.0.0")).await;
    // Created within the same second: the order is by name then.
    tokio::time::sleep(Duration::from_millis(1100)).await;
    let (_, second) = sites.roll_out("fw-3", spec("3.0.0")).await;
    let waiting = sites
        .wait_for_phase("fw-3", RolloutPhase::Pending, Duration::from_secs(30))
        .await;
    let (_, reason, message) = condition(&waiting, "Progressing");
    assert_eq!(reason, "WaitingForRollout");
    assert!(message.contains("fw-2"), "{message}");
    // Whenever the later one is looked at before the earlier completes, it
    // still waits: it never starts a device early.
    let watch = async {
        loop {
            let earlier = sites.rollouts.get("fw-2").await.unwrap();
            let later = sites.rollouts.get("fw-3").await.unwrap();
            if earlier.status.as_ref().and_then(|s| s.phase) == Some(RolloutPhase::Complete) {
                break;
            }
            let phase = later.status.as_ref().and_then(|s| s.phase);
            assert_eq!(
                phase,
                Some(RolloutPhase::Pending),
                "fw-3 moved while fw-2 ran"
            );
            tokio::time::sleep(Duration::from_millis(200)).await;
        }
    };
    tokio::time::timeout(Duration::from_secs(120), watch)
        .await
        .expect("fw-2 completes");
    assert!(second.timeline().changed.is_empty() || first.timeline().changed.len() == 8);
    sites
        .wait_for_phase("fw-3", RolloutPhase::Complete, Duration::from_secs(120))
        .await;
    let (a, b) = (first.finish(), second.finish());
    assert_eq!((a.changed.len(), b.changed.len()), (8, 8));
    let firmware = spec_and_reported(&sites.devices).await;
    assert!(
        firmware
            .values()
            .all(|(_, r)| r.as_deref() == Some("3.0.0")),
        "{firmware:?}"
    );
    sites.stack.shutdown();
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_controller_killed_mid_rollout_resumes_without_changing_a_device_twice() {
    let mut sites = Sites::start("fro-kill", 2, 16, &["--install-time=1s..2s"]).await;
    let (_, recorder) = sites
        .roll_out(
            "fw-2",
            json!({
                "target": firmware_target("2.0.0"),
                "selector": {},
                "strategy": {
                    "canary": 1,
                    "maxUnavailable": 3,
                    "failureDomain": { "topologyKey": SITE, "maxUnavailable": 2 },
                },
            }),
        )
        .await;
    eventually_within(Duration::from_secs(60), "some devices updated", || async {
        let r = sites.rollouts.get("fw-2").await.ok()?;
        (r.status?.counts.succeeded >= 4).then_some(())
    })
    .await;
    sites
        .stack
        .kill_and_restart_cloud_after(|| tokio::time::sleep(Duration::from_secs(2)))
        .await
        .unwrap();
    sites
        .wait_for_phase("fw-2", RolloutPhase::Complete, Duration::from_secs(120))
        .await;
    let timeline = recorder.finish();
    assert_limits(&timeline, 3, 2);
    assert_eq!(timeline.changed_twice, Vec::<String>::new());
    assert_eq!(timeline.changed.len(), 16);
    sites.stack.shutdown();
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_rollout_deleted_mid_way_leaves_each_device_as_it_was_and_changes_nothing_more() {
    let sites = Sites::start("fro-delete", 2, 12, &["--install-time=2s..3s"]).await;
    let (rollout, recorder) = sites
        .roll_out(
            "fw-2",
            json!({
                "target": firmware_target("2.0.0"),
                "selector": {},
                "strategy": { "canary": 1, "maxUnavailable": 2 },
            }),
        )
        .await;
    eventually_within(Duration::from_secs(60), "some devices updated", || async {
        let r = sites.rollouts.get("fw-2").await.ok()?;
        (r.status?.counts.succeeded >= 2).then_some(())
    })
    .await;
    sites
        .rollouts
        .delete("fw-2", &Default::default())
        .await
        .unwrap();
    // Read from the API server, not from a watch that may lag a change
    // made just before the rollout went.
    let changed_by = |devices: Vec<Device>| -> Vec<String> {
        devices
            .iter()
            .filter(|d| {
                rollout_member::record(d)
                    .and_then(Result::ok)
                    .is_some_and(|r| Some(&r.uid) == rollout.metadata.uid.as_ref())
            })
            .map(ResourceExt::name_any)
            .collect()
    };
    eventually("the rollout is gone", || async {
        sites
            .rollouts
            .get_opt("fw-2")
            .await
            .unwrap()
            .is_none()
            .then_some(())
    })
    .await;
    let at_deletion = changed_by(sites.devices.list(&Default::default()).await.unwrap().items);
    tokio::time::sleep(Duration::from_secs(4)).await;
    let later = changed_by(sites.devices.list(&Default::default()).await.unwrap().items);
    let timeline = recorder.finish();
    assert_eq!(later, at_deletion, "devices changed after the deletion");
    assert!(at_deletion.len() >= 2 && at_deletion.len() < 12);
    let mut recorded = timeline.changed.clone();
    recorded.sort();
    assert_eq!(recorded, at_deletion, "the watch saw the same changes");
    // Changed devices keep the target (and their record); the others their
    // spec. Every device settles on its spec.
    eventually("every device runs its spec's firmware", || async {
        let firmware = spec_and_reported(&sites.devices).await;
        firmware
            .iter()
            .all(|(name, (spec, reported))| {
                let expected = if timeline.changed.contains(name) {
                    "2.0.0"
                } else {
                    FACTORY
                };
                spec.as_deref() == Some(expected) && reported.as_deref() == Some(expected)
            })
            .then_some(())
    })
    .await;
    sites.stack.shutdown();
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_site_cut_off_mid_rollout_is_unreachable_not_failed_and_finishes_when_back() {
    let sites = Sites::start("fro-cut", 3, 18, &["--install-time=1s..2s"]).await;
    let (_, recorder) = sites
        .roll_out_cutting(
            "fw-2",
            json!({
                "target": firmware_target("2.0.0"),
                "selector": {},
                "strategy": {
                    "canary": 3,
                    "maxUnavailable": 3,
                    "failureDomain": { "topologyKey": SITE, "maxUnavailable": 1 },
                },
            }),
            &["site-2"],
        )
        .await;
    // Cut site 2 once its canary has started.
    eventually("a device of site 2 changed", || async {
        let t = recorder.timeline();
        t.changed
            .iter()
            .any(|n| sites.site_of[n] == "site-2")
            .then_some(())
    })
    .await;
    let proxy = sites.stack.agents[2].proxy.as_ref().unwrap();
    proxy.cut();
    let waiting = eventually_within(
        Duration::from_secs(90),
        "the reachable sites are done",
        || async {
            let r = sites.rollouts.get("fw-2").await.ok()?;
            let (_, reason, _) = condition_opt(&r, "Progressing")?;
            (reason == "WaitingForUnreachable").then_some(r)
        },
    )
    .await;
    let counts = &waiting.status.as_ref().unwrap().counts;
    assert_eq!(counts.failed, 0, "unreachable is not failed: {counts:?}");
    assert_eq!(counts.succeeded + counts.unreachable, 18, "{counts:?}");
    assert!(counts.unreachable >= 5, "site 2's devices wait: {counts:?}");
    let site2 = waiting
        .status
        .as_ref()
        .unwrap()
        .sites
        .iter()
        .find(|s| s.name == "site-2")
        .unwrap();
    assert_eq!(
        site2.counts.unreachable, counts.unreachable,
        "all of them in site 2"
    );
    proxy.heal();
    let done = sites
        .wait_for_phase("fw-2", RolloutPhase::Complete, Duration::from_secs(90))
        .await;
    assert_eq!(done.status.unwrap().counts.succeeded, 18);
    let timeline = recorder.finish();
    assert_limits(&timeline, 3, 1);
    assert!(timeline.failed.is_empty());
    let firmware = sites.firmware().await;
    assert!(
        firmware.values().all(|v| v.as_deref() == Some("2.0.0")),
        "{firmware:?}"
    );
    sites.stack.shutdown();
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_site_cut_off_past_its_failure_threshold_is_rolled_back_by_its_agent_and_the_cloud_learns_at_resync()
 {
    let logs = tempfile::tempdir().unwrap();
    let applied_log = logs.path().join("applied.jsonl");
    // Installs slow enough that the site is cut off before any device
    // reports the new firmware: only its agent sees the failures.
    let sites = Sites::start(
        "fro-edge",
        1,
        4,
        &[
            "--bad-firmware=2.0.0",
            "--install-time=8s..9s",
            &format!("--applied-log={}", applied_log.display()),
        ],
    )
    .await;
    let (_, recorder) = sites
        .roll_out_cutting(
            "fw-2",
            json!({
                "target": firmware_target("2.0.0"),
                "selector": {},
                "strategy": {
                    "canary": 0,
                    "maxUnavailable": 4,
                    "failureDomain": { "topologyKey": SITE, "maxUnavailable": 4, "canary": 0 },
                },
                "health": { "expression": "!('crashes' in reported)", "bakeSeconds": 60 },
                "failurePolicy": {
                    "thresholds": [{
                        "scope": "Site", "percent": 50, "minSample": 2, "classes": ["HealthFailed"],
                    }],
                    "action": "Rollback",
                    "rollbackScope": "All",
                },
            }),
            &["site-0"],
        )
        .await;
    // Every device's update is stored at the edge; then the site goes dark.
    let generations: BTreeMap<String, i64> =
        eventually("the agent holds every device's update", || async {
            let list = sites.devices.list(&Default::default()).await.ok()?;
            let held = list.items.iter().all(|d| {
                let generation = d.metadata.generation;
                let ours = matches!(edgefleet_shared::rollout_member::record(d),
                    Some(Ok(r)) if r.generation == generation);
                ours && d.status.as_ref().and_then(|s| s.delivered_generation) == generation
            });
            held.then(|| {
                list.items
                    .iter()
                    .map(|d| (d.name_any(), d.metadata.generation.unwrap()))
                    .collect()
            })
        })
        .await;
    let agent = &sites.stack.agents[0];
    agent.proxy.as_ref().unwrap().cut();

    // Offline, the agent sees the health checks fail and rolls the site
    // back: each device applies the generation before the rollout's.
    eventually_within(
        Duration::from_secs(60),
        "the agent rolled back all four",
        || async {
            let (_, body) = edgefleet_tests::process::http_get(agent.metrics, "/metrics")
                .await
                .ok()?;
            let n = edgefleet_tests::process::metric(&body, "edgefleet_agent_site_rollbacks_total");
            (n == 4.0).then_some(())
        },
    )
    .await;
    eventually(
        "every device applied the generation before the rollout's",
        || async {
            let log = std::fs::read_to_string(&applied_log).ok()?;
            let entries: Vec<(String, i64)> = log
                .lines()
                .filter_map(|l| {
                    let v: Value = serde_json::from_str(l).ok()?;
                    let device = v["device"].as_str()?.rsplit('/').next()?.to_owned();
                    Some((device, v["generation"].as_i64()?))
                })
                .collect();
            generations
                .iter()
                .all(|(name, g)| {
                    let new = entries.iter().position(|e| e == &(name.clone(), *g));
                    let back = entries.iter().rposition(|e| e == &(name.clone(), g - 1));
                    matches!((new, back), (Some(n), Some(b)) if b > n)
                })
                .then_some(())
        },
    )
    .await;
    // The cloud cannot know yet.
    let r = sites.rollouts.get("fw-2").await.unwrap();
    assert_ne!(
        r.status.as_ref().and_then(|s| s.phase),
        Some(RolloutPhase::RolledBack),
        "{:?}",
        r.status
    );
    for d in sites.devices.list(&Default::default()).await.unwrap() {
        assert_eq!(
            d.spec.firmware.as_ref().map(|f| f.version.as_str()),
            Some("2.0.0")
        );
    }

    // Back online: the cloud learns what the agent did and follows.
    agent.proxy.as_ref().unwrap().heal();
    let done = sites
        .wait_for_phase("fw-2", RolloutPhase::RolledBack, Duration::from_secs(60))
        .await;
    let (_, reason, message) = condition(&done, "RolledBack");
    assert_eq!(reason, "RolledBackAtEdge", "{message}");
    for (name, g) in &generations {
        let d = sites.devices.get(name).await.unwrap();
        let c = d
            .status
            .as_ref()
            .and_then(|s| {
                s.conditions
                    .iter()
                    .find(|c| c.type_ == condition::ROLLED_BACK)
            })
            .unwrap_or_else(|| panic!("{name} has no RolledBack condition: {:?}", d.status));
        assert_eq!(
            (c.status.as_str(), c.reason.as_str(), c.observed_generation),
            ("True", condition::SITE_THRESHOLD_CROSSED, Some(*g)),
            "{name}"
        );
        assert!(
            c.message.contains("while the cloud was unreachable"),
            "{}",
            c.message
        );
    }
    all_back_on_factory_firmware(&sites.devices).await;
    let counts = sites
        .rollouts
        .get("fw-2")
        .await
        .unwrap()
        .status
        .unwrap()
        .counts;
    assert_eq!(counts.rolled_back, 4, "{counts:?}");
    let timeline = recorder.finish();
    assert_limits(&timeline, 4, 4);
    sites.stack.shutdown();
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_agent_refusing_one_devices_update_does_not_hold_back_the_others() {
    let sites = Sites::start("fro-refuse", 2, 6, &[]).await;
    // One device already carries a long desired property: with the
    // rollout's note its desired state no longer fits a device message
    // (1024 bytes), and its agent refuses it.
    let crowded = sites.site_of.keys().next().unwrap().clone();
    let label = json!({ "spec": { "desired": { "label": "l".repeat(500) } } });
    let d = sites
        .devices
        .patch(&crowded, &PatchParams::default(), &Patch::Merge(&label))
        .await
        .unwrap();
    let generation = d.metadata.generation;
    eventually("the crowded device applied its label", || async {
        let d = sites.devices.get(&crowded).await.ok()?;
        (d.status?.applied_generation == generation).then_some(())
    })
    .await;
    let mut target = firmware_target("2.0.0");
    target["properties"] = json!({ "note": "n".repeat(600) });
    let (_, recorder) = sites
        .roll_out(
            "fw-2",
            json!({
                "target": target,
                "selector": {},
                "strategy": { "canary": 1, "maxUnavailable": 2 },
            }),
        )
        .await;
    let done = sites
        .wait_for_phase("fw-2", RolloutPhase::Complete, Duration::from_secs(90))
        .await;
    let counts = done.status.as_ref().unwrap().counts.clone();
    assert_eq!((counts.succeeded, counts.failed), (5, 1), "{counts:?}");
    let timeline = recorder.finish();
    assert_limits(&timeline, 2, 2);
    assert_eq!(timeline.failed, vec![crowded.clone()]);
    // The refusal is on the Device, which keeps what it ran.
    let d = sites.devices.get(&crowded).await.unwrap();
    let status = d.status.as_ref().unwrap();
    let refused = status
        .conditions
        .iter()
        .find(|c| c.type_ == condition::UPDATE_FAILED && c.status == "True")
        .unwrap_or_else(|| panic!("no UpdateFailed: {status:?}"));
    assert_eq!(refused.reason, "RejectedByAgent", "{refused:?}");
    assert!(
        refused.message.contains("cannot be sent to the device"),
        "{}",
        refused.message
    );
    assert_eq!(status.firmware_version.as_deref(), Some(FACTORY));
    let firmware = sites.firmware().await;
    let updated = firmware
        .iter()
        .filter(|(name, v)| **name != crowded && v.as_deref() == Some("2.0.0"))
        .count();
    assert_eq!(updated, 5, "{firmware:?}");
    sites.stack.shutdown();
}

fn condition_opt<'a>(
    rollout: &'a FleetRollout,
    type_: &str,
) -> Option<(&'a str, &'a str, &'a str)> {
    let c = rollout
        .status
        .as_ref()?
        .conditions
        .iter()
        .find(|c| c.type_ == type_)?;
    Some((c.status.as_str(), c.reason.as_str(), c.message.as_str()))
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn what_admission_cannot_check_the_controller_refuses_with_a_condition() {
    let sites = Sites::start("fro-invalid", 1, 2, &[]).await;
    let target = firmware_target("2.0.0");
    let (_, bad_expression) = sites
        .roll_out(
            "bad-expression",
            json!({
                "target": target,
                "selector": {},
                "health": { "expression": "reported.temperature <" },
            }),
        )
        .await;
    let (_, no_domain) = sites
        .roll_out(
            "no-domain",
            json!({
                "target": target,
                "selector": {},
                "strategy": {
                    "failureDomain": { "topologyKey": "example.com/no-such-label", "maxUnavailable": 1 },
                },
            }),
        )
        .await;
    for (name, reason, words) in [
        (
            "bad-expression",
            "InvalidHealthExpression",
            "does not compile",
        ),
        ("no-domain", "NoFailureDomain", "example.com/no-such-label"),
    ] {
        let invalid = sites
            .wait_for_phase(name, RolloutPhase::Invalid, Duration::from_secs(30))
            .await;
        let (accepted, why, message) = condition(&invalid, "Accepted");
        assert_eq!((accepted, why), ("False", reason), "{name}: {message}");
        assert!(message.contains(words), "{name}: {message}");
    }
    tokio::time::sleep(Duration::from_secs(2)).await;
    assert!(bad_expression.finish().changed.is_empty());
    assert!(
        no_domain.finish().changed.is_empty(),
        "an invalid rollout changes nothing"
    );
    sites.stack.shutdown();
}

/// A site sent more than its limit at once — as a controller with a stale
/// view, or a second one that thinks it leads, would — holds the rest back
/// at its agent and starts them one place at a time, canary first, and goes
/// on doing so while it is cut off from the cloud.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_site_sent_more_than_its_limit_paces_itself_at_the_edge_also_while_cut_off() {
    use edgefleet_shared::rollout_member::{Previous, RECORD_ANNOTATION, Record};
    use edgefleet_shared::site_pacing::SitePace;
    const INSTALL_MIN_MS: u64 = 2_000;
    let logs = tempfile::tempdir().unwrap();
    let applied_log = logs.path().join("applied.jsonl");
    let sites = Sites::start(
        "pace",
        1,
        4,
        &[
            "--install-time=2s..2500ms",
            &format!("--applied-log={}", applied_log.display()),
        ],
    )
    .await;
    let mut names: Vec<String> = sites.site_of.keys().cloned().collect();
    names.sort();
    // All four changed at once, each recorded with the site's part of the
    // plan: one at a time, the last device the site's canary. The canary
    // is changed first, as a controller does: the agent gates the rest on
    // the canaries it holds, so a canary sent after the others would come
    // too late to go first.
    let canary = names.last().unwrap().clone();
    names.rotate_right(1);
    let mut generations = BTreeMap::new();
    for name in &names {
        let d = sites.devices.get(name).await.unwrap();
        let generation = d.metadata.generation.unwrap() + 1;
        let record = Record {
            rollout: "by-hand".into(),
            uid: "not-a-rollout".into(),
            changed_at_ms: edgefleet_shared::now_unix_ms(),
            generation: Some(generation),
            health: None,
            site: None,
            pace: Some(SitePace {
                site: "site-0".into(),
                limit: 1,
                canary: *name == canary,
                timeout_seconds: 600,
            }),
            previous: Previous::default(),
            attempt: 1,
            last_failure: None,
            rolled_back: false,
        };
        let patch = json!({
            "metadata": {
                "annotations": { RECORD_ANNOTATION: serde_json::to_string(&record).unwrap() },
            },
            "spec": { "firmware": { "version": "2.0.0" } },
        });
        sites
            .devices
            .patch(name, &PatchParams::default(), &Patch::Merge(&patch))
            .await
            .unwrap();
        generations.insert(name.clone(), generation);
    }
    // The agent stores every one; the cloud shows the held ones as held.
    eventually("every update stored, and three shown held", || async {
        let list = sites.devices.list(&Default::default()).await.ok()?;
        let delivered = list.items.iter().all(|d| {
            d.status.as_ref().and_then(|s| s.delivered_generation) == d.metadata.generation
        });
        let held = list
            .items
            .iter()
            .filter(|d| {
                d.status.as_ref().is_some_and(|s| {
                    s.conditions.iter().any(|c| {
                        c.type_ == condition::APPLIED
                            && c.reason == condition::HELD_AT_SITE
                            && c.observed_generation == d.metadata.generation
                    })
                })
            })
            .count();
        (delivered && held >= 2).then_some(())
    })
    .await;
    let agent = &sites.stack.agents[0];
    let metric = |name: &'static str| async move {
        let (_, body) = edgefleet_tests::process::http_get(agent.metrics, "/metrics")
            .await
            .ok()?;
        Some(edgefleet_tests::process::metric(&body, name))
    };
    // Cut off, the site goes on by itself: every device released.
    agent.proxy.as_ref().unwrap().cut();
    eventually_within(
        Duration::from_secs(60),
        "the agent released all four while cut off",
        || async {
            let released = metric("edgefleet_agent_site_pacing_released_total").await?;
            let held = metric("edgefleet_agent_site_pacing_held").await?;
            (released == 4.0 && held == 0.0).then_some(())
        },
    )
    .await;
    // One at a time, the canary first: each device applied the new
    // generation at least one install time after the one before it.
    let applied: Vec<(String, u64)> = eventually("all four applied it", || async {
        let log = std::fs::read_to_string(&applied_log).ok()?;
        let mut entries: Vec<(String, u64)> = log
            .lines()
            .filter_map(|l| {
                let v: Value = serde_json::from_str(l).ok()?;
                let device = v["device"].as_str()?.rsplit('/').next()?.to_owned();
                let new = generations.get(&device) == Some(&v["generation"].as_i64()?);
                new.then_some((device, v["at_ms"].as_u64()?))
            })
            .collect();
        entries.sort_by_key(|(_, at)| *at);
        (entries.len() == 4).then_some(entries)
    })
    .await;
    assert_eq!(applied[0].0, canary, "{applied:?}");
    for pair in applied.windows(2) {
        assert!(
            pair[1].1 - pair[0].1 >= INSTALL_MIN_MS,
            "two devices were updating at once: {applied:?}"
        );
    }
    // Back online, the cloud sees every device on the new firmware.
    agent.proxy.as_ref().unwrap().heal();
    eventually("every Device applied, none held", || async {
        let list = sites.devices.list(&Default::default()).await.ok()?;
        list.items
            .iter()
            .all(|d| {
                let s = d.status.as_ref();
                let on_it = s.and_then(|s| s.firmware_version.as_deref()) == Some("2.0.0");
                let applied = s.is_some_and(|s| {
                    s.conditions.iter().any(|c| {
                        c.type_ == condition::APPLIED
                            && c.status == "True"
                            && c.observed_generation == d.metadata.generation
                    })
                });
                on_it && applied
            })
            .then_some(())
    })
    .await;
    sites.stack.shutdown();
}
