//! Several controller replicas sharing the fleet through shard Leases, with
//! real processes behind a round-robin forwarder (the Service):
//!
//! - `kill -9` of the replica serving an agent, then of the one holding
//!   the singletons' shard: the agents re-home, writes resume, and every
//!   Device ends at its device's last acknowledged report with every event
//!   an Event exactly once;
//! - a replica frozen (SIGSTOP) past its Leases and let go again writes
//!   nothing stale: it drops what it had queued (counted as fenced), and no
//!   Device's report ever goes back;
//! - a replica added takes its share, and only the agents of the shards
//!   that moved reconnect;
//! - a replica that takes a shard back does not believe the shard's nodes
//!   have been away since it last served them: a rollout's Pending members
//!   there are not skipped by the offline policy;
//! - a shard Lease edited to send agents to an `http://` address does not
//!   take a TLS agent there: no byte reaches that address, the redirect is
//!   counted as refused, and the agent is served by the right replica.

use std::collections::HashMap;
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use edgefleet_cloud::shards::shard_of;
use edgefleet_shared::api::Device;
use edgefleet_tests::edge_events::wait_exactly_once;
use edgefleet_tests::final_state::{read_final_state, wait_converged};
use edgefleet_tests::fleet_view::applied_current_generation;
use edgefleet_tests::process::{http_get, metric};
use edgefleet_tests::stack::{LEASE_SECONDS, SHARDS, Stack, StackSpec};
use edgefleet_tests::{control_plane, eventually, eventually_within, test_namespace};
use futures::StreamExt;
use k8s_openapi::api::coordination::v1::Lease;
use kube::api::{Patch, PatchParams};
use kube::runtime::{WatchStreamExt, watcher};
use kube::{Api, ResourceExt};

/// `count` node names of this test, each in a shard of its own, so the
/// agents spread over the replicas.
fn nodes_in_distinct_shards(hint: &str, count: usize) -> Vec<String> {
    let mut taken = Vec::new();
    let mut nodes = Vec::new();
    for k in 0.. {
        let name = format!("edge-{hint}-{}-{k}", std::process::id());
        let shard = shard_of(&name, SHARDS);
        if !taken.contains(&shard) {
            taken.push(shard);
            nodes.push(name);
        }
        if nodes.len() == count {
            break;
        }
    }
    nodes
}

/// A replicated fleet: controller replicas, an agent per node, the
/// simulator reporting and raising events; every Device applied.
struct Fleet {
    stack: Stack,
    devices: Api<Device>,
    leases: Api<Lease>,
    dir: tempfile::TempDir,
    count: usize,
}

impl Fleet {
    async fn start(
        hint: &str,
        replicas: usize,
        nodes: usize,
        devices: usize,
        budget: u32,
    ) -> Fleet {
        let cp = control_plane();
        let client = cp.client().await;
        let ns = test_namespace(&client, hint).await;
        let dir = tempfile::tempdir().unwrap();
        let spec = StackSpec {
            nodes: nodes_in_distinct_shards(hint, nodes),
            namespace: ns.clone(),
            devices,
            mqtt_every: 0,
            status_writes_per_second: budget,
            dir: dir.path().to_owned(),
            namespaced_controller: true,
            // A frozen replica's sessions end within seconds.
            cloud_args: vec!["--heartbeat-seconds=1".into()],
            agent_args: vec!["--cloud-heartbeat-seconds=1".into()],
            sync_through_proxy: false,
        };
        let mut stack = Stack::start_replicated(spec, cp.kubeconfig(), replicas)
            .await
            .unwrap();
        stack.apply_devices(&client).await.unwrap();
        let final_state = dir.path().join("final.jsonl");
        stack
            .start_sim(&[
                "--report-interval=300ms".into(),
                "--event-every=3".into(),
                format!("--final-state={}", final_state.display()),
            ])
            .unwrap();
        let fleet = Fleet {
            stack,
            devices: Api::namespaced(client.clone(), &ns),
            leases: Api::namespaced(client, &ns),
            dir,
            count: devices,
        };
        fleet
            .wait_applied("every device applied its desired state")
            .await;
        fleet
    }

    async fn wait_applied(&self, what: &str) {
        eventually_within(Duration::from_secs(60), what, || async {
            let list = self.devices.list(&Default::default()).await.ok()?;
            let applied = list.items.iter().all(applied_current_generation);
            (list.items.len() == self.count && applied).then_some(())
        })
        .await;
    }

    /// The index of the replica holding `shard`'s Lease now.
    async fn holder_of_shard(&self, shard: u32) -> Option<usize> {
        let lease = self
            .leases
            .get(&format!("edgefleet-shard-{shard}"))
            .await
            .ok()?;
        let holder = lease.spec?.holder_identity?;
        self.stack.replicas().iter().position(|r| r.id == holder)
    }

    /// The index of the replica serving `node` now.
    async fn holder_of(&self, node: &str) -> Option<usize> {
        self.holder_of_shard(shard_of(node, SHARDS)).await
    }

    /// Agents connected to the replicas of `alive`, together.
    async fn streams(&self, alive: &[usize]) -> f64 {
        let mut total = 0.0;
        for &i in alive {
            total += self
                .stack
                .replica_metric(i, "edgefleet_cloud_sync_streams")
                .await;
        }
        total
    }

    /// Changes the spec of Device `index` (on node `index % nodes`).
    async fn change_spec(&self, index: usize, round: u32) {
        let patch = serde_json::json!({ "spec": { "desired": { "round": round } } });
        self.devices
            .patch(
                &format!("dev-{index:05}"),
                &PatchParams::default(),
                &Patch::Merge(&patch),
            )
            .await
            .unwrap();
    }

    /// Stops the simulator and checks the end: every Device at its
    /// device's last acknowledged report, every event an Event once.
    async fn check_nothing_lost_or_repeated(mut self) {
        assert!(self.stack.stop_sim(), "the simulator stopped cleanly");
        let final_state = self.dir.path().join("final.jsonl");
        let finals = read_final_state(&final_state).unwrap();
        assert_eq!(
            finals.len(),
            self.count,
            "every device acknowledged a report"
        );
        let patience = Duration::from_secs(60);
        if let Err(e) = wait_converged(&self.devices, &finals, self.count, patience).await {
            panic!("logs in {}: {e}", self.dir.keep().display());
        }
        let client = self.devices.clone().into_client();
        let ns = self.devices.namespace().unwrap().to_owned();
        match wait_exactly_once(&client, &ns, &final_state, &[], patience).await {
            Ok(total) => {
                assert!(
                    total > self.count,
                    "only {total} events: too little exercised"
                );
                eprintln!("{total} events raised, each an Event exactly once");
            }
            Err(e) => panic!("logs in {}: {e}", self.dir.keep().display()),
        }
        self.stack.shutdown();
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn killed_replicas_hand_their_agents_over_and_nothing_is_lost_or_repeated() {
    let nodes = 3;
    let fleet = Fleet::start("replica-kill", 3, nodes, 18, 200).await;
    let node0 = fleet.stack.agents[0].node.clone();
    let mut alive: Vec<usize> = (0..3).collect();

    // The replica serving node 0 dies.
    let victim = fleet
        .holder_of(&node0)
        .await
        .expect("node 0's shard is held");
    let mut fleet = fleet;
    fleet.stack.kill_replica(victim);
    alive.retain(|&i| i != victim);
    let killed = Instant::now();
    eventually_within(Duration::from_secs(30), "every agent re-homed", || async {
        let holder = fleet.holder_of(&node0).await?;
        (alive.contains(&holder) && fleet.streams(&alive).await == nodes as f64).then_some(())
    })
    .await;
    eprintln!(
        "agents re-homed {:?} after replica-{victim} was killed (Leases of {LEASE_SECONDS} s)",
        killed.elapsed()
    );
    // Writes for node 0 resume: a new spec is delivered, applied, reported.
    fleet.change_spec(0, 1).await;
    fleet
        .wait_applied("node 0's new spec applied through its new replica")
        .await;

    // Then the replica holding the singletons' shard dies.
    let leader = fleet.holder_of_shard(0).await.expect("shard 0 is held");
    assert!(alive.contains(&leader), "shard 0 is held by a live replica");
    fleet.stack.kill_replica(leader);
    alive.retain(|&i| i != leader);
    let killed = Instant::now();
    eventually_within(
        Duration::from_secs(30),
        "every agent on the last replica",
        || async {
            let last = alive[0];
            for shard in 0..SHARDS {
                if fleet.holder_of_shard(shard).await != Some(last) {
                    return None;
                }
            }
            (fleet.streams(&alive).await == nodes as f64).then_some(())
        },
    )
    .await;
    eprintln!(
        "the last replica holds every shard {:?} after the leader was killed",
        killed.elapsed()
    );
    for index in 0..nodes {
        fleet.change_spec(index, 2).await;
    }
    fleet
        .wait_applied("every node's new spec applied through the last replica")
        .await;
    fleet.check_nothing_lost_or_repeated().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_replica_frozen_past_its_leases_writes_nothing_stale_when_it_wakes() {
    let nodes = 2;
    // A small write budget keeps changes queued in the writers, so the
    // frozen replica has some when it wakes.
    let mut fleet = Fleet::start("replica-freeze", 2, nodes, 12, 8).await;
    let node0 = fleet.stack.agents[0].node.clone();
    let victim = fleet
        .holder_of(&node0)
        .await
        .expect("node 0's shard is held");
    let other = 1 - victim;

    // Every report each Device shows, in order, from now on.
    let shown: Arc<Mutex<HashMap<String, Vec<u64>>>> = Arc::default();
    let watch = tokio::spawn({
        let (devices, shown) = (fleet.devices.clone(), Arc::clone(&shown));
        async move {
            let events = watcher(devices, watcher::Config::default()).applied_objects();
            futures::pin_mut!(events);
            while let Some(Ok(device)) = events.next().await {
                if let Some(origin) = device.status.as_ref().and_then(|s| s.last_report.clone()) {
                    let mut shown = shown.lock().unwrap();
                    let seqs = shown.entry(device.name_any()).or_default();
                    if seqs.last() != Some(&origin.seq) {
                        seqs.push(origin.seq);
                    }
                }
            }
        }
    });

    fleet.stack.freeze_replica(victim, true).unwrap();
    eventually_within(
        Duration::from_secs(30),
        "the other replica serves every agent",
        || async {
            let holder = fleet.holder_of(&node0).await?;
            (holder == other && fleet.streams(&[other]).await == nodes as f64).then_some(())
        },
    )
    .await;
    // Reports of node 0 keep landing through the other replica.
    let writes = |fleet: &Fleet, i: usize| {
        let metrics = fleet.stack.replicas()[i].metrics;
        async move {
            let (_, body) = http_get(metrics, "/metrics").await.unwrap_or_default();
            (
                metric(&body, "edgefleet_cloud_status_writes_total"),
                metric(&body, "edgefleet_cloud_status_fenced_total"),
            )
        }
    };
    let (before, _) = writes(&fleet, other).await;
    eventually("the other replica writes node 0's reports", || async {
        (writes(&fleet, other).await.0 > before + 10.0).then_some(())
    })
    .await;

    fleet.stack.freeze_replica(victim, false).unwrap();
    eventually(
        "the woken replica drops what it had queued, unwritten",
        || async { (writes(&fleet, victim).await.1 > 0.0).then_some(()) },
    )
    .await;
    // It may take shards back for its share; what it writes then is new.
    tokio::time::sleep(Duration::from_secs(2 * LEASE_SECONDS)).await;
    fleet.change_spec(0, 1).await;
    fleet
        .wait_applied("a new spec applied after the wake-up")
        .await;
    watch.abort();

    let shown = shown.lock().unwrap().clone();
    assert_eq!(shown.len(), 12, "every Device showed reports");
    for (device, seqs) in &shown {
        assert!(
            seqs.windows(2).all(|w| w[0] < w[1]),
            "{device}'s report went back (a stale write): {seqs:?}"
        );
    }
    fleet.check_nothing_lost_or_repeated().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_added_replica_takes_its_share_and_only_the_moved_agents_reconnect() {
    let nodes = 4;
    let mut fleet = Fleet::start("replica-add", 2, nodes, 8, 200).await;
    let names: Vec<String> = fleet.stack.agents.iter().map(|a| a.node.clone()).collect();
    let sessions = |fleet: &Fleet| {
        let metrics: Vec<_> = fleet.stack.replicas().iter().map(|r| r.metrics).collect();
        async move {
            let mut total = 0.0;
            for m in metrics {
                let (_, body) = http_get(m, "/metrics").await.unwrap_or_default();
                total += body
                    .lines()
                    .filter(|l| l.starts_with("edgefleet_cloud_sync_hellos_total{"))
                    .filter_map(|l| l.rsplit(' ').next()?.parse::<f64>().ok())
                    .sum::<f64>();
            }
            total
        }
    };
    let mut before = Vec::new();
    for node in &names {
        before.push(fleet.holder_of(node).await.expect("held"));
    }
    let opened = sessions(&fleet).await;

    fleet.stack.add_replica().await.unwrap();
    let share = SHARDS.div_ceil(3);
    eventually_within(
        Duration::from_secs(30),
        "each of 3 replicas holds its share",
        || async {
            let mut held = [0u32; 3];
            for shard in 0..SHARDS {
                held[fleet.holder_of_shard(shard).await?] += 1;
            }
            let balanced = held.iter().all(|&h| h == share);
            (balanced && fleet.streams(&[0, 1, 2]).await == nodes as f64).then_some(())
        },
    )
    .await;
    let mut moved = 0;
    for (node, was) in names.iter().zip(&before) {
        if fleet.holder_of(node).await != Some(*was) {
            moved += 1;
        }
    }
    let reconnected = sessions(&fleet).await - opened;
    eprintln!("{moved} of {nodes} agents moved to the new replica; {reconnected} sessions opened");
    assert_eq!(
        reconnected, moved as f64,
        "only the agents whose shard moved opened a new session"
    );
    fleet.change_spec(0, 1).await;
    fleet
        .wait_applied("a new spec applied after the move")
        .await;
    fleet.check_nothing_lost_or_repeated().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_lease_edited_to_redirect_agents_to_plaintext_gets_no_token_and_no_connection() {
    let mut fleet = Fleet::start("replica-redirect", 2, 1, 2, 200).await;
    let node = fleet.stack.agents[0].node.clone();
    let shard = shard_of(&node, SHARDS);

    // Whoever may update Leases sets the sync URL of the node's shard to a
    // plaintext listener of theirs, which records what reaches it.
    let trap = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let trap_url = format!("http://{}", trap.local_addr().unwrap());
    let caught: Arc<Mutex<Vec<u8>>> = Arc::default();
    let connections = Arc::new(std::sync::atomic::AtomicUsize::new(0));
    let listening = tokio::spawn({
        let (caught, connections) = (Arc::clone(&caught), Arc::clone(&connections));
        async move {
            while let Ok((mut socket, _)) = trap.accept().await {
                connections.fetch_add(1, std::sync::atomic::Ordering::SeqCst);
                let caught = Arc::clone(&caught);
                tokio::spawn(async move {
                    let mut buf = [0u8; 4096];
                    while let Ok(n @ 1..) =
                        tokio::io::AsyncReadExt::read(&mut socket, &mut buf).await
                    {
                        caught.lock().unwrap().extend_from_slice(&buf[..n]);
                    }
                });
            }
        }
    });
    // The holder writes its own URL back only when it takes the shard
    // again: keep the edit in place.
    let editing = tokio::spawn({
        let (leases, url) = (fleet.leases.clone(), trap_url.clone());
        async move {
            let name = format!("edgefleet-shard-{shard}");
            let patch = serde_json::json!({
                "metadata": { "annotations": { "edgefleet.io/sync-url": url } }
            });
            loop {
                let edited = leases.get(&name).await.ok().is_some_and(|lease| {
                    lease.annotations().get("edgefleet.io/sync-url") == Some(&url)
                });
                if !edited {
                    let _ = leases
                        .patch(&name, &PatchParams::default(), &Patch::Merge(&patch))
                        .await;
                }
                tokio::time::sleep(Duration::from_millis(300)).await;
            }
        }
    });
    let refused = "edgefleet_agent_sync_redirects_refused_total";
    // The agent restarts (its pod is updated, its node reboots) and
    // reaches the replica that does not hold its shard through the
    // Service, which sends it to the edited URL.
    let mut restarts = 0;
    while fleet.stack.agent_metric(0, refused).await < 1.0 {
        restarts += 1;
        assert!(
            restarts <= 10,
            "the agent never met the replica that sends it to the edited URL"
        );
        tokio::time::sleep(Duration::from_secs(1)).await;
        fleet
            .stack
            .kill_and_restart_agent(0, restarts)
            .await
            .unwrap();
        let _ = tokio::time::timeout(
            Duration::from_secs(5),
            eventually("the agent refuses the redirect", || async {
                (fleet.stack.agent_metric(0, refused).await >= 1.0).then_some(())
            }),
        )
        .await;
    }
    editing.abort();
    let seen = String::from_utf8_lossy(&caught.lock().unwrap()).into_owned();
    assert!(
        !seen.to_ascii_lowercase().contains("authorization"),
        "the agent's token went to the plaintext address: {seen:?}"
    );
    assert_eq!(
        connections.load(std::sync::atomic::Ordering::SeqCst),
        0,
        "the agent connected to the plaintext address"
    );
    listening.abort();

    // Left alone, the Lease names the holder again and the agent is served.
    fleet.change_spec(0, 1).await;
    fleet
        .wait_applied("the node's new spec applied after the edits stopped")
        .await;
    fleet.check_nothing_lost_or_repeated().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_replica_taking_a_shard_back_does_not_skip_its_nodes_as_long_gone() {
    use edgefleet_shared::api::EdgeNode;
    use edgefleet_shared::api::rollout::FleetRollout;
    // Replica A alone holds every shard and serves every agent.
    let mut fleet = Fleet::start("replica-retake", 1, SHARDS as usize, 12, 200).await;
    let client = fleet.devices.clone().into_client();
    let ns = fleet.devices.namespace().unwrap().to_owned();
    // B joins: A gives it its share, and the sessions of those nodes end at A.
    fleet.stack.add_replica().await.unwrap();
    eventually_within(
        Duration::from_secs(30),
        "A and B hold 3 shards each",
        || async {
            let mut held = [0u32; 2];
            for shard in 0..SHARDS {
                held[fleet.holder_of_shard(shard).await?] += 1;
            }
            (held == [3, 3] && fleet.streams(&[0, 1]).await == SHARDS as f64).then_some(())
        },
    )
    .await;
    let mut target = None;
    for agent in &fleet.stack.agents {
        if fleet.holder_of(&agent.node).await == Some(1) {
            target = Some(agent.node.clone());
            break;
        }
    }
    let target = target.expect("B serves a node");
    let label = format!("retake-{}", std::process::id());
    Api::<EdgeNode>::all(client.clone())
        .patch(
            &target,
            &PatchParams::default(),
            &Patch::Merge(serde_json::json!({
                "metadata": { "labels": { "edgefleet.io/retake": label } }
            })),
        )
        .await
        .unwrap();
    // Longer than the rollout waits for an unreachable node.
    tokio::time::sleep(Duration::from_secs(6)).await;

    // A rollout of the target node's two devices: the canary bakes for
    // ten minutes, the other device waits for it, Pending.
    let rollouts: Api<FleetRollout> = Api::namespaced(client, &ns);
    let rollout: FleetRollout = serde_json::from_value(serde_json::json!({
        "apiVersion": "edgefleet.io/v1alpha1",
        "kind": "FleetRollout",
        "metadata": { "name": "retake", "namespace": ns },
        "spec": {
            "target": { "firmware": { "version": "2.0.0" } },
            "selector": {},
            "nodeSelector": { "matchLabels": { "edgefleet.io/retake": label } },
            "strategy": { "canary": 1, "waves": ["100%"] },
            "health": { "expression": "online", "bakeSeconds": 600 },
            "offline": { "waitUpToSeconds": 5, "then": "Skip" },
        },
    }))
    .unwrap();
    rollouts
        .create(&Default::default(), &rollout)
        .await
        .unwrap();
    let counts = || async {
        let status = rollouts.get("retake").await.ok()?.status?;
        Some(status.counts)
    };
    eventually_within(
        Duration::from_secs(30),
        "the canary is under way and the other device waits",
        || async {
            let c = counts().await?;
            (c.total == 2 && c.pending == 1 && c.updating + c.baking == 1).then_some(())
        },
    )
    .await;

    // Every status the rollout shows from now on.
    let shown: Arc<Mutex<Vec<(u32, u32)>>> = Arc::default();
    let watch = tokio::spawn({
        let (rollouts, shown) = (rollouts.clone(), Arc::clone(&shown));
        async move {
            let events = watcher(rollouts, watcher::Config::default()).applied_objects();
            futures::pin_mut!(events);
            while let Some(Ok(rollout)) = events.next().await {
                if let Some(status) = rollout.status {
                    let c = status.counts;
                    shown.lock().unwrap().push((c.pending, c.skipped));
                }
            }
        }
    });

    // B dies: A takes its shards back while their agents come over.
    fleet.stack.kill_replica(1);
    eventually_within(
        Duration::from_secs(30),
        "A holds every shard and serves every agent",
        || async {
            for shard in 0..SHARDS {
                if fleet.holder_of_shard(shard).await != Some(0) {
                    return None;
                }
            }
            (fleet.streams(&[0]).await == SHARDS as f64).then_some(())
        },
    )
    .await;
    // The rollout is stepped every 2 s: a few steps on A.
    tokio::time::sleep(Duration::from_secs(6)).await;
    watch.abort();
    let shown = shown.lock().unwrap().clone();
    assert!(!shown.is_empty(), "the watch saw the rollout");
    assert!(
        shown
            .iter()
            .all(|&(pending, skipped)| pending == 1 && skipped == 0),
        "A skipped the target node's waiting device as if its node had been away since A last served it: {shown:?}"
    );
    let c = counts().await.unwrap();
    assert_eq!((c.pending, c.skipped), (1, 0), "{c:?}");
    rollouts
        .delete("retake", &Default::default())
        .await
        .unwrap();
    fleet.check_nothing_lost_or_repeated().await;
}
