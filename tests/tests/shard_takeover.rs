//! A replica taking a shard, in process against the real API server: what
//! it remembers of the shard from before another replica held it is
//! forgotten before it may write for the shard (review 2026-12-07,
//! finding 11).

use std::sync::{Arc, Mutex};
use std::time::Duration;

use edgefleet_cloud::leases::{self, LeaseMetrics, LeaseSettings};
use edgefleet_cloud::shards::Shards;
use edgefleet_tests::{control_plane, eventually, test_namespace};

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_taken_shard_is_written_for_only_after_the_replica_forgot_it() {
    let client = control_plane().client().await;
    let ns = test_namespace(&client, "shard-take").await;
    let shards = Arc::new(Shards::shared(4));
    // Whether the shard was already writable when the replica was told to
    // forget what it remembered of it.
    let told: Arc<Mutex<Vec<(u32, bool)>>> = Arc::default();
    let keeper = tokio::spawn(leases::keep(
        client,
        LeaseSettings {
            namespace: ns,
            set: "takeover".into(),
            replica: "replica-a".into(),
            serve_at: "https://127.0.0.1:7443".into(),
            duration: Duration::from_secs(3),
        },
        Arc::clone(&shards),
        LeaseMetrics::default(),
        {
            let (told, shards) = (Arc::clone(&told), Arc::clone(&shards));
            move |shard| told.lock().unwrap().push((shard, shards.holds(shard)))
        },
    ));
    eventually("the lone replica holds every shard", || async {
        (shards.held().len() == 4).then_some(())
    })
    .await;
    keeper.abort();
    let mut told = told.lock().unwrap().clone();
    told.sort();
    assert_eq!(
        told,
        [(0, false), (1, false), (2, false), (3, false)],
        "each shard forgotten once, before it was writable"
    );
}
