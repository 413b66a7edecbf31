//! The agent's store on a real disk: what it promises survives a reopen,
//! reports compact per device, the outbox drains only on acknowledgement,
//! only durable entries go up, sequence numbers are never reused, a corrupt
//! store is moved aside with its outbox salvaged, and a store that is merely
//! out of reach (locked, not a directory) is left alone with a clear error.

use std::collections::BTreeMap;
use std::time::Duration;

use edgefleet_agent::store::{
    BOOTS_REMEMBERED, Desired, DesiredDevice, Dropped, EventOutcome, Flow, HeldRule, PendingUplink,
    SEQ_BLOCK, Store, StoreError,
};
use edgefleet_shared::api::Transport;
use edgefleet_shared::codec::{DeviceEvent, DeviceReport};
use edgefleet_shared::{PropertyValue, ResourceKey, ResourceVersion};

fn thermostat(uid: &str, generation: i64, setpoint: f64) -> DesiredDevice {
    DesiredDevice::new(
        ResourceVersion::new(uid, generation),
        "thermostat",
        Transport::Coap,
        BTreeMap::from([("setpoint".to_owned(), PropertyValue::Float(setpoint))]),
    )
}

fn report(generation: i64, temperature: f64) -> DeviceReport {
    DeviceReport {
        applied_generation: generation,
        properties: BTreeMap::from([("temperature".to_owned(), PropertyValue::Float(temperature))]),
        firmware_version: Some("1.0.0".into()),
        firmware_failure: None,
    }
}

fn open(dir: &std::path::Path) -> Store {
    let opened = Store::open(dir).unwrap();
    assert!(opened.moved_aside.is_none(), "{:?}", opened.moved_aside);
    opened.store
}

#[tokio::test]
async fn rules_are_held_beside_devices_survive_a_reopen_and_leave_alone() {
    let tmp = tempfile::tempdir().unwrap();
    let dir = tmp.path().join("store");
    let device = ResourceKey::device("plant", "a");
    let rule = ResourceKey::rule("plant", "overheat");
    let held_rule = HeldRule {
        version: ResourceVersion::new("rule-uid", 4242),
        rule: edgefleet_shared::proto::RuleDesired {
            namespace: "plant".into(),
            name: "overheat".into(),
            when: "reported.temperature > 80.0".into(),
            ..Default::default()
        },
    };
    {
        let store = open(&dir);
        let mut changes = store.watch_desired();
        store
            .apply(
                &[
                    (device.clone(), Desired::from(thermostat("ua", 1, 20.0))),
                    (rule.clone(), Desired::Rule(Box::new(held_rule.clone()))),
                ],
                &[],
            )
            .await
            .unwrap();
        // The device publishers hear of the device only.
        assert_eq!(changes.recv().await.unwrap().upserted, vec![device.clone()]);
    }
    let store = open(&dir);
    assert_eq!(store.rules().unwrap(), [(rule.clone(), held_rule.clone())]);
    assert_eq!(store.device_count(), 1);
    assert_eq!(store.rule_count(), 1);
    let held: BTreeMap<_, _> = store.held().unwrap().into_iter().collect();
    assert_eq!(held[&rule], held_rule.version);
    assert_eq!(held[&device], ResourceVersion::new("ua", 1));

    // Removing the rule leaves the device, its report included.
    store
        .record_report(&device, report(1, 21.0), 1_000)
        .await
        .unwrap();
    store
        .apply::<DesiredDevice>(&[], std::slice::from_ref(&rule))
        .await
        .unwrap();
    assert_eq!(store.rule_count(), 0);
    assert!(store.desired(&device).unwrap().is_some());
    assert!(store.latest_report(&device).unwrap().is_some());
}

#[tokio::test]
async fn desired_state_survives_a_reopen_and_removals_apply() {
    let tmp = tempfile::tempdir().unwrap();
    let dir = tmp.path().join("store");
    let a = ResourceKey::device("plant", "a");
    let b = ResourceKey::device("plant", "b");
    {
        let store = open(&dir);
        store
            .apply(
                &[
                    (a.clone(), thermostat("ua", 1, 20.0)),
                    (b.clone(), thermostat("ub", 4, 18.0)),
                ],
                &[],
            )
            .await
            .unwrap();
        store
            .apply(
                &[(a.clone(), thermostat("ua", 2, 21.0))],
                std::slice::from_ref(&b),
            )
            .await
            .unwrap();
    }
    let store = open(&dir);
    assert_eq!(
        store.held().unwrap(),
        vec![(a.clone(), ResourceVersion::new("ua", 2))]
    );
    assert_eq!(store.desired(&a).unwrap(), Some(thermostat("ua", 2, 21.0)));
    assert_eq!(store.desired(&b).unwrap(), None);
    assert_eq!(store.device_count(), 1);
}

#[tokio::test]
async fn reports_compact_to_the_latest_per_device() {
    let tmp = tempfile::tempdir().unwrap();
    let store = open(&tmp.path().join("store"));
    let a = ResourceKey::device("plant", "a");
    let b = ResourceKey::device("plant", "b");

    let s1 = store.record_report(&a, report(1, 20.0), 1).await.unwrap();
    let s2 = store.record_report(&b, report(1, 30.0), 2).await.unwrap();
    let s3 = store.record_report(&a, report(2, 20.5), 3).await.unwrap();
    assert!(
        s1 < s2 && s2 < s3,
        "sequence numbers must increase: {s1} {s2} {s3}"
    );

    let pending = store.pending_uplink(0, 100).unwrap();
    assert_eq!(store.outbox_depth(), 2);
    let seqs: Vec<u64> = pending.iter().map(|(s, _)| *s).collect();
    assert_eq!(seqs, vec![s2, s3], "a's first report was compacted away");
    let PendingUplink::Report { device, latest } = &pending[1].1 else {
        panic!("a report, not {:?}", pending[1].1);
    };
    assert_eq!(device, &a);
    assert_eq!(latest.report, report(2, 20.5));
    assert_eq!(latest.received_at_ms, 3);
}

fn self_check(id: u64) -> DeviceEvent {
    DeviceEvent {
        id,
        boot: 0,
        warning: false,
        reason: "SelfCheck".into(),
        message: format!("self check {id}"),
    }
}

/// Reports and events are two flows: each is read and acknowledged on its
/// own, so acknowledging the reports leaves every event where it was (and
/// the other way round), and the sequence numbers still count through both.
#[tokio::test]
async fn reports_and_events_are_read_and_acknowledged_apart() {
    let tmp = tempfile::tempdir().unwrap();
    let store = open(&tmp.path().join("store"));
    let a = ResourceKey::device("plant", "a");
    let mut events = Vec::new();
    let mut reports = Vec::new();
    for i in 1..=3 {
        let EventOutcome::Stored { seq, .. } =
            store.record_event(&a, self_check(i), 1).await.unwrap()
        else {
            panic!("a new event is stored");
        };
        events.push(seq);
        let b = ResourceKey::device("plant", format!("b{i}"));
        reports.push(store.record_report(&b, report(1, 20.0), 1).await.unwrap());
    }
    let seqs = |pending: Vec<(u64, PendingUplink)>| -> Vec<u64> {
        pending.into_iter().map(|(seq, _)| seq).collect()
    };
    assert_eq!(seqs(store.pending(Flow::Reports, 0, 10).unwrap()), reports);
    assert_eq!(seqs(store.pending(Flow::Events, 0, 10).unwrap()), events);
    let mut both = [events.clone(), reports.clone()].concat();
    both.sort();
    assert_eq!(seqs(store.pending_uplink(0, 10).unwrap()), both);

    // Every report acknowledged, no event: the events stay.
    assert_eq!(store.acknowledge_uplink(reports[2], 0).await.unwrap(), 3);
    assert_eq!(store.reports_queued(), 0);
    assert_eq!(store.events_queued(), 3);
    assert_eq!(seqs(store.pending(Flow::Events, 0, 10).unwrap()), events);
    // The events flow's own mark removes events only.
    let c = ResourceKey::device("plant", "c");
    let late = store.record_report(&c, report(1, 20.0), 2).await.unwrap();
    assert_eq!(store.acknowledge_uplink(0, late).await.unwrap(), 3);
    assert_eq!(store.events_queued(), 0);
    assert_eq!(seqs(store.pending(Flow::Reports, 0, 10).unwrap()), [late]);
}

/// A store from before flows kept its reports among the events (in the
/// tree that is now the events flow): opening it moves them to the reports
/// flow under the same sequence numbers, and nothing is lost.
#[tokio::test]
async fn a_store_from_before_flows_opens_with_its_reports_in_their_flow() {
    let tmp = tempfile::tempdir().unwrap();
    let dir = tmp.path().join("store");
    let a = ResourceKey::device("plant", "a");
    let before;
    {
        let store = open(&dir);
        store.record_event(&a, self_check(1), 1).await.unwrap();
        store.record_report(&a, report(1, 20.0), 1).await.unwrap();
        store.record_event(&a, self_check(2), 1).await.unwrap();
        before = store.pending_uplink(0, 10).unwrap();
    }
    {
        // The layout of an older agent: one tree for both.
        let db = sled::open(&dir).unwrap();
        let (old, reports) = (
            db.open_tree("outbox").unwrap(),
            db.open_tree("report_outbox").unwrap(),
        );
        for item in reports.iter() {
            let (k, v) = item.unwrap();
            old.insert(k.clone(), v).unwrap();
            reports.remove(k).unwrap();
        }
        db.flush().unwrap();
    }
    let store = open(&dir);
    assert_eq!(store.pending_uplink(0, 10).unwrap(), before);
    assert_eq!(store.reports_queued(), 1);
    assert_eq!(store.events_queued(), 2);
    let report_seq = before[1].0;
    assert_eq!(
        store.pending(Flow::Reports, 0, 10).unwrap(),
        [before[1].clone()],
        "the report is in its flow under seq {report_seq}"
    );
}

#[tokio::test]
async fn the_outbox_drains_only_up_to_the_acknowledged_seq() {
    let tmp = tempfile::tempdir().unwrap();
    let dir = tmp.path().join("store");
    let last;
    {
        let store = open(&dir);
        let mut seqs = Vec::new();
        for i in 0..5 {
            let key = ResourceKey::device("plant", format!("d{i}"));
            seqs.push(
                store
                    .record_report(&key, report(1, i as f64), i)
                    .await
                    .unwrap(),
            );
        }
        assert_eq!(store.acknowledge_uplink(seqs[2], seqs[2]).await.unwrap(), 3);
        let left: Vec<u64> = store
            .pending_uplink(0, 100)
            .unwrap()
            .iter()
            .map(|(s, _)| *s)
            .collect();
        assert_eq!(left, seqs[3..].to_vec());
        // Batches page through what is left.
        let page = store.pending_uplink(seqs[3], 1).unwrap();
        assert_eq!(page.len(), 1);
        assert_eq!(page[0].0, seqs[4]);
        last = seqs[4];
    }
    // After a restart the outbox is still there and sequence numbers never go back.
    let store = open(&dir);
    assert_eq!(store.outbox_depth(), 2);
    let next = store
        .record_report(&ResourceKey::device("plant", "d9"), report(1, 9.0), 9)
        .await
        .unwrap();
    assert!(
        next > last,
        "seq {next} reused after restart (last was {last})"
    );
}

#[tokio::test]
async fn an_unreadable_store_is_moved_aside_and_replaced() {
    let tmp = tempfile::tempdir().unwrap();
    let dir = tmp.path().join("store");
    std::fs::create_dir_all(&dir).unwrap();
    std::fs::write(dir.join("conf"), b"this is not a sled config").unwrap();
    std::fs::write(dir.join("db"), vec![0xa5; 4096]).unwrap();

    let opened = Store::open(&dir).unwrap();
    let (aside, reason) = opened.moved_aside.expect("the broken store is moved aside");
    assert!(aside.exists(), "{}", aside.display());
    assert!(!reason.is_empty());
    // sled cannot read it at all: nothing to salvage, and that is said.
    assert_eq!(opened.salvage.entries, 0);
    assert!(!opened.salvage.lost.is_empty(), "{:?}", opened.salvage);
    // The new store works.
    let key = ResourceKey::device("plant", "a");
    opened
        .store
        .apply(&[(key.clone(), thermostat("u", 1, 20.0))], &[])
        .await
        .unwrap();
    assert!(opened.store.desired(&key).unwrap().is_some());
}

/// Hundreds of devices reporting at once: every durable write completes
/// (sled's own `flush_async` deadlocks under this load) and every report is
/// there after a reopen.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn concurrent_reports_all_become_durable() {
    let tmp = tempfile::tempdir().unwrap();
    let dir = tmp.path().join("store");
    let store = open(&dir);
    let mut writes = tokio::task::JoinSet::new();
    for i in 0..300 {
        let store = store.clone();
        writes.spawn(async move {
            let key = ResourceKey::device("plant", format!("d{i}"));
            store.record_report(&key, report(1, f64::from(i)), 1).await
        });
    }
    let all = tokio::time::timeout(std::time::Duration::from_secs(60), async {
        let mut seqs = Vec::new();
        while let Some(seq) = writes.join_next().await {
            seqs.push(seq.unwrap().unwrap());
        }
        seqs
    })
    .await
    .expect("every concurrent report became durable within 60 s");
    assert_eq!(all.len(), 300);
    drop(store);

    let store = open(&dir);
    assert_eq!(store.outbox_depth(), 300);
    let latest = store
        .latest_report(&ResourceKey::device("plant", "d299"))
        .unwrap()
        .unwrap();
    assert_eq!(
        latest.report.properties["temperature"],
        PropertyValue::Float(299.0)
    );
}

fn event(id: u64, reason: &str) -> DeviceEvent {
    booted_event(0, id, reason)
}

fn booted_event(boot: u64, id: u64, reason: &str) -> DeviceEvent {
    DeviceEvent {
        id,
        boot,
        warning: false,
        reason: reason.into(),
        message: format!("event {id}"),
    }
}

/// The events of the outbox, as (device, id) in outbox order.
fn pending_events(store: &Store) -> Vec<(String, u64)> {
    store
        .pending_uplink(0, usize::MAX)
        .unwrap()
        .into_iter()
        .filter_map(|(_, pending)| match pending {
            PendingUplink::Event { device, stored } => Some((device.name, stored.event.id)),
            _ => None,
        })
        .collect()
}

#[tokio::test]
async fn events_stay_in_order_once_each_and_survive_a_reopen() {
    let tmp = tempfile::tempdir().unwrap();
    let dir = tmp.path().join("store");
    let a = ResourceKey::device("plant", "a");
    let b = ResourceKey::device("plant", "b");
    let id;
    {
        let store = open(&dir);
        id = store.store_id().to_owned();
        for (key, n) in [(&a, 1), (&b, 1), (&a, 2), (&a, 3), (&b, 2)] {
            let outcome = store.record_event(key, event(n, "Tick"), 1).await.unwrap();
            assert!(
                matches!(
                    outcome,
                    EventOutcome::Stored {
                        dropped_oldest: false,
                        ..
                    }
                ),
                "{outcome:?}"
            );
        }
        // A resend of an event already stored, and an older one.
        for n in [3, 1] {
            assert_eq!(
                store.record_event(&a, event(n, "Tick"), 2).await.unwrap(),
                EventOutcome::Duplicate { highest: 3 }
            );
        }
        // Reports in between do not disturb events.
        store.record_report(&a, report(1, 20.0), 3).await.unwrap();
        assert_eq!(store.events_queued(), 5);
    }
    let store = open(&dir);
    assert_eq!(store.store_id(), id, "the store keeps its id");
    assert_eq!(store.events_queued(), 5, "counted again at open");
    assert_eq!(
        pending_events(&store),
        [("a", 1), ("b", 1), ("a", 2), ("a", 3), ("b", 2)]
            .map(|(d, n)| (d.to_owned(), n))
            .to_vec()
    );
    assert_eq!(
        store.record_event(&b, event(2, "Tick"), 4).await.unwrap(),
        EventOutcome::Duplicate { highest: 2 },
        "event ids are remembered across a reopen"
    );
    // Acknowledging the first three entries leaves the rest, in order.
    let third = store.pending_uplink(0, 3).unwrap()[2].0;
    store.acknowledge_uplink(third, third).await.unwrap();
    assert_eq!(store.events_queued(), 2);
    assert_eq!(
        pending_events(&store),
        vec![("a".to_owned(), 3), ("b".to_owned(), 2)]
    );
}

/// A device that reboots without persistent memory counts its event ids
/// from 1 again under a new boot epoch: those are new events, not resends
/// (with "highest id seen" alone, every one of them was taken for a
/// duplicate and lost), while a resend from the boot before is still one.
#[tokio::test]
async fn events_after_a_reboot_count_from_one_and_are_stored() {
    let tmp = tempfile::tempdir().unwrap();
    let dir = tmp.path().join("store");
    let a = ResourceKey::device("plant", "a");
    let stored = |outcome: EventOutcome| matches!(outcome, EventOutcome::Stored { .. });
    {
        let store = open(&dir);
        for n in 1..=3 {
            let outcome = store
                .record_event(&a, booted_event(11, n, "Tick"), 1)
                .await
                .unwrap();
            assert!(stored(outcome), "{outcome:?}");
        }
        for n in 1..=2 {
            let outcome = store
                .record_event(&a, booted_event(22, n, "FirmwareInstalled"), 2)
                .await
                .unwrap();
            assert!(stored(outcome), "boot 22 event {n}: {outcome:?}");
        }
        // A late resend of the boot before is recognised.
        assert_eq!(
            store
                .record_event(&a, booted_event(11, 3, "Tick"), 3)
                .await
                .unwrap(),
            EventOutcome::Duplicate { highest: 3 }
        );
    }
    // Across a reopen too, and both boots' ids are known.
    let store = open(&dir);
    assert_eq!(
        store
            .record_event(&a, booted_event(22, 2, "FirmwareInstalled"), 4)
            .await
            .unwrap(),
        EventOutcome::Duplicate { highest: 2 }
    );
    let ids: Vec<(u64, u64)> = store
        .pending_uplink(0, usize::MAX)
        .unwrap()
        .into_iter()
        .filter_map(|(_, pending)| match pending {
            PendingUplink::Event { stored, .. } => Some((stored.event.boot, stored.event.id)),
            _ => None,
        })
        .collect();
    assert_eq!(ids, [(11, 1), (11, 2), (11, 3), (22, 1), (22, 2)]);
    // The oldest boots are forgotten beyond BOOTS_REMEMBERED: the store
    // holds a few numbers per device, however often it reboots.
    for boot in 100..100 + BOOTS_REMEMBERED as u64 {
        let outcome = store
            .record_event(&a, booted_event(boot, 1, "Tick"), 5)
            .await
            .unwrap();
        assert!(stored(outcome), "{outcome:?}");
    }
    assert!(
        stored(
            store
                .record_event(&a, booted_event(11, 3, "Tick"), 6)
                .await
                .unwrap()
        ),
        "boot 11 is no longer remembered"
    );
    assert_eq!(
        store
            .record_event(
                &a,
                booted_event(100 + BOOTS_REMEMBERED as u64 - 1, 1, "Tick"),
                7
            )
            .await
            .unwrap(),
        EventOutcome::Duplicate { highest: 1 }
    );
}

#[tokio::test]
async fn at_the_bound_the_oldest_event_is_dropped_counted_and_reported_once() {
    let tmp = tempfile::tempdir().unwrap();
    let store = open(&tmp.path().join("store")).with_max_events(3);
    let a = ResourceKey::device("plant", "a");
    for n in 1..=3 {
        store.record_event(&a, event(n, "Tick"), 10).await.unwrap();
    }
    assert_eq!(
        store.seal_dropped().await.unwrap(),
        None,
        "nothing dropped yet"
    );
    for (n, at) in [(4, 20), (5, 30)] {
        let outcome = store.record_event(&a, event(n, "Tick"), at).await.unwrap();
        assert!(
            matches!(
                outcome,
                EventOutcome::Stored {
                    dropped_oldest: true,
                    ..
                }
            ),
            "{outcome:?}"
        );
    }
    assert_eq!(store.events_queued(), 3);
    assert_eq!(store.events_dropped_total().unwrap(), 2);
    assert_eq!(
        pending_events(&store),
        vec![
            ("a".to_owned(), 3),
            ("a".to_owned(), 4),
            ("a".to_owned(), 5)
        ],
        "the oldest went first"
    );
    // The drops become one entry after everything stored so far.
    let sealed = store
        .seal_dropped()
        .await
        .unwrap()
        .expect("drops to report");
    assert_eq!(store.seal_dropped().await.unwrap(), None, "sealed once");
    let (last_seq, last) = store.pending_uplink(0, usize::MAX).unwrap().pop().unwrap();
    assert_eq!(last_seq, sealed);
    assert_eq!(
        last,
        PendingUplink::EventsDropped(Dropped {
            count: 2,
            first_at_ms: 20,
            last_at_ms: 30,
            bound: 3,
        })
    );
    // Once acknowledged the notice is gone; the lifetime total stays.
    store.acknowledge_uplink(sealed, sealed).await.unwrap();
    assert_eq!(store.outbox_depth(), 0);
    assert_eq!(store.events_queued(), 0);
    assert_eq!(store.events_dropped_total().unwrap(), 2);
}

#[tokio::test]
async fn an_unchanged_report_queues_again_only_as_a_keepalive_while_connected() {
    use edgefleet_agent::store::UNCHANGED_REPORT_KEEPALIVE_MS as KEEPALIVE;
    let tmp = tempfile::tempdir().unwrap();
    let store = open(&tmp.path().join("store"));
    let a = ResourceKey::device("plant", "a");
    let first = store
        .record_report(&a, report(1, 20.0), 1_000)
        .await
        .unwrap();
    store.acknowledge_uplink(first, first).await.unwrap();

    // Offline: the same content, however late, queues nothing; it is heard.
    let later = 1_000 + 10 * KEEPALIVE;
    assert_eq!(
        store
            .record_report(&a, report(1, 20.0), later)
            .await
            .unwrap(),
        first
    );
    assert_eq!(store.outbox_depth(), 0);
    let latest = store.latest_report(&a).unwrap().unwrap();
    assert_eq!((latest.received_at_ms, latest.queued_at_ms), (later, 1_000));

    // Connected again: the keepalive clock starts at the reconnect, so the
    // outage does not make every steady device due at once.
    let up = later + 1;
    store.set_link(Some(up));
    let soon = up + KEEPALIVE - 1;
    assert_eq!(
        store
            .record_report(&a, report(1, 20.0), soon)
            .await
            .unwrap(),
        first
    );
    assert_eq!(store.outbox_depth(), 0, "not due yet");
    let due = store
        .record_report(&a, report(1, 20.0), up + KEEPALIVE)
        .await
        .unwrap();
    assert!(due > first);
    assert_eq!(store.outbox_depth(), 1);
    // The next keepalive is a full interval after that one.
    let next = up + 2 * KEEPALIVE - 1;
    assert_eq!(
        store
            .record_report(&a, report(1, 20.0), next)
            .await
            .unwrap(),
        due
    );

    // A change always queues, connected or not.
    store.set_link(None);
    let changed = store
        .record_report(&a, report(1, 20.5), next + 1)
        .await
        .unwrap();
    assert!(changed > due);
    assert_eq!(store.outbox_depth(), 1, "compacted to the latest");
}

#[tokio::test]
async fn reports_and_events_name_the_object_they_are_about_and_start_afresh_when_it_is_replaced() {
    let tmp = tempfile::tempdir().unwrap();
    let store = open(&tmp.path().join("store"));
    let a = ResourceKey::device("plant", "a");
    store
        .apply(&[(a.clone(), thermostat("old", 3, 20.0))], &[])
        .await
        .unwrap();
    store.record_report(&a, report(3, 21.0), 1).await.unwrap();
    store
        .record_event(&a, event(7, "SelfCheck"), 1)
        .await
        .unwrap();
    let pending = store.pending_uplink(0, 10).unwrap();
    assert!(matches!(&pending[0].1, PendingUplink::Report { latest, .. } if latest.uid == "old"));
    assert!(matches!(&pending[1].1, PendingUplink::Event { stored, .. } if stored.uid == "old"));

    // The Device is deleted and created again under the same name: the old
    // object's report leaves the outbox (its event stays: it happened),
    // and the device's event ids start afresh.
    store
        .apply(&[(a.clone(), thermostat("new", 1, 20.0))], &[])
        .await
        .unwrap();
    assert!(store.latest_report(&a).unwrap().is_none());
    let pending = store.pending_uplink(0, 10).unwrap();
    assert_eq!(pending.len(), 1);
    assert!(matches!(&pending[0].1, PendingUplink::Event { .. }));
    assert!(matches!(
        store.record_event(&a, event(1, "Booted"), 2).await.unwrap(),
        EventOutcome::Stored { .. }
    ));
    // The same content reported again is news for the new object.
    store.record_report(&a, report(3, 21.0), 3).await.unwrap();
    let latest = store.latest_report(&a).unwrap().unwrap();
    assert_eq!(latest.uid, "new");

    // Removed from the node: its report state goes too.
    store
        .apply::<DesiredDevice>(&[], std::slice::from_ref(&a))
        .await
        .unwrap();
    assert!(store.latest_report(&a).unwrap().is_none());
}

/// What sits next to the store's directory (a store moved aside shows up
/// here as `store.broken-<stamp>`).
fn beside(dir: &std::path::Path) -> Vec<String> {
    let mut names: Vec<String> = std::fs::read_dir(dir.parent().unwrap())
        .unwrap()
        .map(|e| e.unwrap().file_name().to_string_lossy().into_owned())
        .collect();
    names.sort();
    names
}

/// Changes a closed store behind the agent's back, as a bad disk or another
/// version of the agent would.
fn tamper(dir: &std::path::Path, change: impl FnOnce(&sled::Db)) {
    // The store's flush thread may hold the lock a moment after the last
    // handle is dropped (seen once under load): wait for it, boundedly.
    let mut tries = 0;
    let db = loop {
        match sled::open(dir) {
            Ok(db) => break db,
            Err(error) if tries < 50 => {
                tries += 1;
                eprintln!("store still held ({error}); trying again");
                std::thread::sleep(std::time::Duration::from_millis(100));
            }
            Err(error) => panic!("the closed store stays held: {error}"),
        }
    };
    change(&db);
    db.flush().unwrap();
}

#[tokio::test]
async fn a_store_another_agent_holds_is_left_alone_with_a_clear_error() {
    let tmp = tempfile::tempdir().unwrap();
    let dir = tmp.path().join("store");
    let a = ResourceKey::device("plant", "a");
    let first = open(&dir);
    let seq = first.record_report(&a, report(1, 20.0), 1).await.unwrap();

    let err = Store::open(&dir).expect_err("a store another agent holds must not open");
    assert!(
        matches!(&err, StoreError::Locked { dir: d, .. } if d == &dir),
        "{err:?}"
    );
    assert!(
        err.to_string().contains(&format!(
            "another agent holds the store at {}",
            dir.display()
        )),
        "{err}"
    );
    assert_eq!(beside(&dir), ["store"], "nothing was moved aside");

    // The holder goes on, and what it stored is there for the next agent.
    let id = first.store_id().to_owned();
    drop(first);
    let store = open(&dir);
    assert_eq!(store.store_id(), id);
    assert_eq!(store.pending_uplink(0, 10).unwrap()[0].0, seq);
}

#[tokio::test]
async fn a_file_where_the_store_should_be_is_an_error_not_a_rebuild() {
    let tmp = tempfile::tempdir().unwrap();
    let dir = tmp.path().join("store");
    std::fs::write(&dir, b"not a directory").unwrap();

    let err = Store::open(&dir).expect_err("a file is not a store");
    assert!(
        matches!(&err, StoreError::Unavailable { dir: d, .. } if d == &dir),
        "{err:?}"
    );
    assert!(
        err.to_string().contains(&dir.display().to_string()),
        "{err}"
    );
    assert_eq!(beside(&dir), ["store"], "nothing was moved aside");
    assert_eq!(std::fs::read(&dir).unwrap(), b"not a directory");
}

#[tokio::test]
async fn a_store_of_another_schema_is_moved_aside_and_its_outbox_salvaged() {
    let tmp = tempfile::tempdir().unwrap();
    let dir = tmp.path().join("store");
    let a = ResourceKey::device("plant", "a");
    let b = ResourceKey::device("plant", "b");
    let (old_id, old_pending) = {
        let store = open(&dir);
        store.record_report(&a, report(1, 20.0), 1).await.unwrap();
        store.record_event(&a, event(1, "Tick"), 2).await.unwrap();
        store.record_report(&b, report(1, 30.0), 3).await.unwrap();
        store.record_event(&a, event(2, "Tock"), 4).await.unwrap();
        (
            store.store_id().to_owned(),
            store.pending_uplink(0, usize::MAX).unwrap(),
        )
    };
    assert_eq!(old_pending.len(), 4);
    tamper(&dir, |db| {
        let meta = db.open_tree("meta").unwrap();
        meta.insert("schema_version", &99u32.to_be_bytes()).unwrap();
    });

    let opened = Store::open(&dir).unwrap();
    let (aside, reason) = opened.moved_aside.expect("moved aside");
    assert!(aside.exists(), "{}", aside.display());
    assert!(reason.contains("schema"), "{reason}");

    // The new store is another store, and sends the same content in the
    // same order under its own sequence numbers.
    let store = opened.store;
    assert_ne!(store.store_id(), old_id);
    let pending = store.pending_uplink(0, usize::MAX).unwrap();
    let seqs: Vec<u64> = pending.iter().map(|(s, _)| *s).collect();
    assert!(seqs.windows(2).all(|w| w[0] < w[1]), "{seqs:?}");
    let content = |entries: &[(u64, PendingUplink)]| -> Vec<PendingUplink> {
        entries
            .iter()
            .map(|(_, p)| match p {
                PendingUplink::Report { device, latest } => PendingUplink::Report {
                    device: device.clone(),
                    latest: edgefleet_agent::store::LatestReport {
                        seq: 0,
                        ..latest.clone()
                    },
                },
                other => other.clone(),
            })
            .collect()
    };
    assert_eq!(content(&pending), content(&old_pending));
    // A report points at its own outbox entry in the new store.
    let PendingUplink::Report { latest, .. } = &pending[0].1 else {
        panic!("{:?}", pending[0]);
    };
    assert_eq!(latest.seq, seqs[0]);
    assert_eq!(store.events_queued(), 2);
    assert_eq!(opened.salvage.entries, 4, "{:?}", opened.salvage);
    assert_eq!(opened.salvage.event_ids, 1, "{:?}", opened.salvage);
    assert!(opened.salvage.lost.is_empty(), "{:?}", opened.salvage);
    // Event ids came along: a resend is still a duplicate.
    assert_eq!(
        store.record_event(&a, event(2, "Tock"), 5).await.unwrap(),
        EventOutcome::Duplicate { highest: 2 }
    );
    // And all of it is in the new store for good.
    drop(store);
    let store = open(&dir);
    assert_eq!(
        content(&store.pending_uplink(0, usize::MAX).unwrap()),
        content(&old_pending)
    );
}

#[tokio::test]
async fn one_unreadable_outbox_value_is_dropped_and_the_store_kept() {
    let tmp = tempfile::tempdir().unwrap();
    let dir = tmp.path().join("store");
    let a = ResourceKey::device("plant", "a");
    let b = ResourceKey::device("plant", "b");
    let (id, broken) = {
        let store = open(&dir);
        store.record_report(&a, report(1, 20.0), 1).await.unwrap();
        let EventOutcome::Stored { seq, .. } =
            store.record_event(&a, event(1, "Tick"), 2).await.unwrap()
        else {
            panic!("stored")
        };
        store.record_report(&b, report(1, 30.0), 3).await.unwrap();
        (store.store_id().to_owned(), seq)
    };
    tamper(&dir, |db| {
        let outbox = db.open_tree("outbox").unwrap();
        outbox
            .insert(broken.to_be_bytes(), &b"\xff\xfe not cbor"[..])
            .unwrap();
    });

    let opened = Store::open(&dir).unwrap();
    assert!(opened.moved_aside.is_none(), "{:?}", opened.moved_aside);
    assert_eq!(beside(&dir), ["store"]);
    assert_eq!(opened.salvage.lost.len(), 1, "{:?}", opened.salvage);
    assert!(
        opened.salvage.lost[0].starts_with(&format!("outbox entry {broken}: ")),
        "the loss names the entry: {:?}",
        opened.salvage.lost
    );
    let store = opened.store;
    assert_eq!(store.store_id(), id, "the same store");
    let devices: Vec<String> = store
        .pending_uplink(0, usize::MAX)
        .unwrap()
        .into_iter()
        .map(|(_, p)| match p {
            PendingUplink::Report { device, .. } => device.name,
            other => panic!("only reports are left, not {other:?}"),
        })
        .collect();
    assert_eq!(devices, ["a", "b"]);
    assert_eq!(store.outbox_depth(), 2, "the unreadable entry is gone");
    assert_eq!(store.events_queued(), 0);
    // Acknowledging past it works.
    let last = store.last_seq().unwrap();
    assert_eq!(store.acknowledge_uplink(last, last).await.unwrap(), 2);
}

#[tokio::test]
async fn only_durable_entries_go_up() {
    let tmp = tempfile::tempdir().unwrap();
    let store = open(&tmp.path().join("store"));
    let durable = store
        .record_report(&ResourceKey::device("plant", "a"), report(1, 20.0), 1)
        .await
        .unwrap();
    let written = store
        .record_report_unflushed(&ResourceKey::device("plant", "b"), report(1, 30.0), 2)
        .unwrap();
    assert!(written > durable);
    assert_eq!(store.outbox_depth(), 2, "it is in the outbox");
    let seqs = |store: &Store| -> Vec<u64> {
        store
            .pending_uplink(0, usize::MAX)
            .unwrap()
            .into_iter()
            .map(|(s, _)| s)
            .collect()
    };
    assert_eq!(seqs(&store), [durable], "but not durable, so not sent");
    // The next flush covers it.
    let third = store
        .record_report(&ResourceKey::device("plant", "c"), report(1, 40.0), 3)
        .await
        .unwrap();
    assert_eq!(seqs(&store), [durable, written, third]);
}

#[tokio::test]
async fn sequence_numbers_handed_out_before_a_restart_are_never_reused() {
    let tmp = tempfile::tempdir().unwrap();
    let dir = tmp.path().join("store");
    let (first, handed_out) = {
        let store = open(&dir);
        let first = store
            .record_report(&ResourceKey::device("plant", "a"), report(1, 20.0), 1)
            .await
            .unwrap();
        // Handed out but never flushed by the store: after a power cut these
        // may be gone from disk while the seqs were seen (by a device).
        let mut handed_out = first;
        for name in ["b", "c"] {
            handed_out = store
                .record_report_unflushed(&ResourceKey::device("plant", name), report(1, 1.0), 2)
                .unwrap();
        }
        (first, handed_out)
    };
    let store = open(&dir);
    let next = store
        .record_report(&ResourceKey::device("plant", "d"), report(1, 9.0), 9)
        .await
        .unwrap();
    assert!(next > handed_out, "seq {next} after {handed_out}");
    // The whole block reserved before the restart is skipped: whatever was
    // handed out from it without reaching the disk is never handed out again.
    assert!(
        next >= first + SEQ_BLOCK,
        "seq {next} is inside the block of {first} (block of {SEQ_BLOCK})"
    );
    assert!(store.last_seq().unwrap() >= next);

    // Running past a block reserves the next one on the way.
    let mut handed_out = next;
    for i in 0..=SEQ_BLOCK {
        let seq = store
            .record_report_unflushed(
                &ResourceKey::device("plant", format!("e{i}")),
                report(1, 1.0),
                3,
            )
            .unwrap();
        assert!(seq > handed_out);
        handed_out = seq;
    }
    drop(store);
    let store = open(&dir);
    let after = store
        .record_report(&ResourceKey::device("plant", "f"), report(1, 9.0), 9)
        .await
        .unwrap();
    assert!(after > handed_out, "seq {after} after {handed_out}");
}

fn names(dir: &std::path::Path) -> std::collections::BTreeSet<String> {
    std::fs::read_dir(dir)
        .unwrap()
        .map(|e| e.unwrap().file_name().to_string_lossy().into_owned())
        .collect()
}

/// A flush syncs the log alone, not the store's directory: what it wrote
/// must then reach the disk without any new name. sled 0.34 names files
/// only when it opens (its snapshot, made durable by the open) and for a
/// value over a quarter of a segment (`blobs/`), which the store never
/// writes. If a sled upgrade changes that, this fails, and the flush must
/// sync the directories again.
#[tokio::test]
async fn a_running_store_writes_into_its_log_and_names_no_new_file() {
    let tmp = tempfile::tempdir().unwrap();
    let dir = tmp.path().join("store");
    let store = open(&dir);
    let opened = names(&dir);
    let a = ResourceKey::device("plant", "a");
    store
        .apply(&[(a.clone(), thermostat("ua", 1, 20.0))], &[])
        .await
        .unwrap();
    // Far more than any tree node holds, in batches as MQTT writes them.
    for n in 0..100u64 {
        let mut batch = store.batch();
        for i in 1..=200 {
            let id = n * 200 + i;
            let event = DeviceEvent {
                message: "m".repeat(500),
                ..self_check(id)
            };
            batch.event(&a, event, 1).unwrap();
            let device = ResourceKey::device("plant", format!("d{}", id % 1000));
            batch.report(&device, report(1, id as f64), 1).unwrap();
        }
        batch.commit().await.unwrap();
    }
    let last = store.last_seq().unwrap();
    assert_eq!(store.acknowledge_uplink(last, last).await.unwrap(), 21_000);
    assert_eq!(names(&dir), opened, "new names in the store's directory");
    assert!(names(&dir.join("blobs")).is_empty(), "sled wrote blobs");
}

#[tokio::test]
async fn the_agent_judges_a_rollouts_health_check_on_each_report_and_keeps_the_verdict() {
    use edgefleet_shared::health_check::{HealthCheck, HealthStage};
    let tmp = tempfile::tempdir().unwrap();
    let store = open(&tmp.path().join("store"));
    let a = ResourceKey::device("plant", "a");
    let mut desired = thermostat("ua", 2, 21.0);
    desired.health_check = Some(HealthCheck {
        rollout: "fw-2".into(),
        expression: "reported.temperature < 30.0".into(),
        bake_seconds: 10,
    });
    store.apply(&[(a.clone(), desired)], &[]).await.unwrap();
    let stage = |store: &Store| {
        store
            .latest_report(&a)
            .unwrap()
            .and_then(|l| l.health)
            .map(|h| (h.generation, h.stage))
    };
    store
        .record_report(&a, report(1, 20.0), 1_000)
        .await
        .unwrap();
    assert_eq!(stage(&store), None, "generation 2 not applied yet");
    store
        .record_report(&a, report(2, 20.0), 2_000)
        .await
        .unwrap();
    assert_eq!(stage(&store), Some((2, HealthStage::Baking)));
    store
        .record_report(&a, report(2, 21.0), 12_000)
        .await
        .unwrap();
    assert_eq!(stage(&store), Some((2, HealthStage::Passed)));
    // Passed is final for the generation, and a reopened store keeps it.
    store
        .record_report(&a, report(2, 45.0), 13_000)
        .await
        .unwrap();
    assert_eq!(stage(&store), Some((2, HealthStage::Passed)));
    drop(store);
    let store = open(&tmp.path().join("store"));
    assert_eq!(stage(&store), Some((2, HealthStage::Passed)));
    // The verdict goes up with the report.
    let pending = store.pending_uplink(0, 10).unwrap();
    let went_up = pending.iter().any(|(_, p)| {
        matches!(p, PendingUplink::Report { latest, .. } if latest.health.as_ref().is_some_and(|h| h.stage == HealthStage::Passed))
    });
    assert!(went_up, "{pending:?}");
}

#[tokio::test]
async fn a_site_past_its_threshold_is_rolled_back_by_the_agent_and_its_reports_say_so() {
    use edgefleet_agent::site_rollback::judge_and_roll_back;
    use edgefleet_shared::api::device::FirmwareSpec;
    use edgefleet_shared::codec::{FirmwareFailure, FirmwareOrder};
    use edgefleet_shared::rollout_member::{Previous, SiteThreshold};
    use edgefleet_shared::site_rollback::SiteRollback;
    let tmp = tempfile::tempdir().unwrap();
    let store = open(&tmp.path().join("store"));
    // Generation 5 of each device is a rollout's: firmware 2.0.0 and a
    // setpoint of 19.5 over 1.0.0 and 21.0.
    let updated = |uid: &str| {
        let mut d = thermostat(uid, 5, 19.5);
        d.firmware = Some(FirmwareOrder {
            version: "2.0.0".into(),
            url: None,
            sha256: None,
        });
        d.site_rollback = Some(SiteRollback {
            rollout: "fw-2".into(),
            rollout_uid: "r-1".into(),
            threshold: SiteThreshold {
                percent: 50,
                min_sample: 2,
                classes: Vec::new(),
                whole_site: true,
            },
            previous: Previous {
                firmware_changed: true,
                firmware: Some(FirmwareSpec {
                    version: "1.0.0".into(),
                    url: None,
                    sha256: None,
                }),
                properties: BTreeMap::from([(
                    "setpoint".to_owned(),
                    Some(PropertyValue::Float(21.0)),
                )]),
            },
        });
        d
    };
    let keys: Vec<ResourceKey> = ["a", "b", "c"]
        .iter()
        .map(|n| ResourceKey::device("plant", *n))
        .collect();
    let devices: Vec<(ResourceKey, DesiredDevice)> = keys
        .iter()
        .map(|k| (k.clone(), updated(&format!("u-{k}"))))
        .collect();
    store.apply(&devices, &[]).await.unwrap();
    let failed = |at: i64| {
        let mut r = report(5, 20.0);
        r.firmware_failure = Some(FirmwareFailure {
            version: "2.0.0".into(),
            reason: "checksum".into(),
        });
        store.record_report(&keys[0], r, at)
    };
    failed(1_000).await.unwrap();
    assert_eq!(
        judge_and_roll_back(&store).await.unwrap(),
        0,
        "one finished is below the minimum sample"
    );
    let mut ok = report(5, 20.0);
    ok.firmware_version = Some("2.0.0".into());
    store.record_report(&keys[1], ok, 1_100).await.unwrap();
    assert_eq!(
        judge_and_roll_back(&store).await.unwrap(),
        3,
        "1 of 2 failed: 50%, the whole site goes back"
    );
    assert_eq!(judge_and_roll_back(&store).await.unwrap(), 0, "once");
    for key in &keys {
        let held = store.desired(key).unwrap().unwrap();
        assert_eq!(held.version.generation, 5, "the held version stays");
        let told = held.to_wire();
        assert_eq!(told.generation, 4);
        assert_eq!(told.firmware.unwrap().version, "1.0.0");
        assert_eq!(
            told.properties["setpoint"],
            PropertyValue::Float(21.0),
            "{key}"
        );
    }
    // The reports go up again carrying what was done; a device that never
    // reported gets it with its first report.
    let marked: Vec<String> = store
        .pending_uplink(0, 10)
        .unwrap()
        .into_iter()
        .filter_map(|(_, p)| match p {
            PendingUplink::Report { device, latest } => {
                let mark = latest.edge_rollback?;
                assert_eq!((mark.rollout.as_str(), mark.generation), ("fw-2", 5));
                assert!(mark.message.contains("1 of 2"), "{}", mark.message);
                Some(device.to_string())
            }
            _ => None,
        })
        .collect();
    assert_eq!(marked, vec![keys[0].to_string(), keys[1].to_string()]);
    store
        .record_report(&keys[2], report(4, 20.0), 1_200)
        .await
        .unwrap();
    assert!(
        store
            .latest_report(&keys[2])
            .unwrap()
            .unwrap()
            .edge_rollback
            .is_some()
    );
    // A reopened store keeps it; the cloud's next generation ends it.
    drop(store);
    let store = open(&tmp.path().join("store"));
    assert_eq!(
        store
            .desired(&keys[0])
            .unwrap()
            .unwrap()
            .to_wire()
            .generation,
        4
    );
    let mut back = thermostat("u-device/plant/a", 6, 21.0);
    back.firmware = Some(FirmwareOrder {
        version: "1.0.0".into(),
        url: None,
        sha256: None,
    });
    store.apply(&[(keys[0].clone(), back)], &[]).await.unwrap();
    let held = store.desired(&keys[0]).unwrap().unwrap();
    assert!(held.rolled_back_at_edge.is_none());
    assert_eq!(held.to_wire().generation, 6);
}

#[tokio::test]
async fn a_site_at_its_limit_holds_the_rest_and_releases_them_as_devices_finish() {
    use edgefleet_agent::site_pacing::pace;
    use edgefleet_shared::codec::{FirmwareFailure, FirmwareOrder};
    use edgefleet_shared::site_pacing::{SitePace, SitePacing};
    let tmp = tempfile::tempdir().unwrap();
    let store = open(&tmp.path().join("store"));
    let names = ["a", "b", "c", "d"];
    let keys: Vec<ResourceKey> = names
        .iter()
        .map(|n| ResourceKey::device("plant", *n))
        .collect();
    let firmware = |v: &str| FirmwareOrder {
        version: v.into(),
        url: None,
        sha256: None,
    };
    // Generation 4: what every device runs.
    let before: Vec<(ResourceKey, DesiredDevice)> = keys
        .iter()
        .map(|k| {
            let mut d = thermostat(&format!("u-{k}"), 4, 21.0);
            d.firmware = Some(firmware("1.0.0"));
            (k.clone(), d)
        })
        .collect();
    store.apply(&before, &[]).await.unwrap();
    // Generation 5, a rollout's: site north, 2 at a time, c its canary.
    let rollout: Vec<(ResourceKey, DesiredDevice)> = keys
        .iter()
        .zip(names)
        .map(|(k, name)| {
            let mut d = thermostat(&format!("u-{k}"), 5, 21.0);
            d.firmware = Some(firmware("2.0.0"));
            d.site_pacing = Some(SitePacing {
                rollout: "fw-2".into(),
                rollout_uid: "r-1".into(),
                pace: SitePace {
                    site: "north".into(),
                    limit: 2,
                    canary: name == "c",
                    timeout_seconds: 600,
                },
            });
            (k.clone(), d)
        })
        .collect();
    let mut changes = store.watch_desired();
    store.apply(&rollout, &[]).await.unwrap();
    let change = changes.try_recv().unwrap();
    assert!(
        change.upserted.is_empty(),
        "held: nothing new for the publishers to send"
    );
    let told = |i: usize| store.desired(&keys[i]).unwrap().unwrap().to_wire();
    for (i, name) in names.iter().enumerate() {
        assert_eq!(told(i).generation, 4, "{name} arrives held");
        assert_eq!(told(i).firmware.unwrap().version, "1.0.0");
    }
    // The canary goes first, alone.
    let pass = pace(&store).await.unwrap();
    assert_eq!(pass.released, vec![keys[2].clone()]);
    assert_eq!(pass.held, 3);
    assert_eq!(changes.try_recv().unwrap().upserted, vec![keys[2].clone()]);
    assert_eq!(told(2).generation, 5);
    assert_eq!(told(2).firmware.unwrap().version, "2.0.0");
    assert!(pace(&store).await.unwrap().released.is_empty(), "once");
    // A held device's report says it is held, and why.
    store
        .record_report(&keys[0], report(4, 20.0), 1_000)
        .await
        .unwrap();
    let mark = store.latest_report(&keys[0]).unwrap().unwrap().held_at_edge;
    let mark = mark.expect("the report carries the hold");
    assert_eq!((mark.rollout.as_str(), mark.generation), ("fw-2", 5));
    assert!(mark.message.contains("site north"), "{}", mark.message);
    // A resync that sends generation 5 again changes nothing, and the store
    // keeps all of it across a reopen.
    store.apply(&rollout, &[]).await.unwrap();
    drop(store);
    let store = open(&tmp.path().join("store"));
    let told = |i: usize| store.desired(&keys[i]).unwrap().unwrap().to_wire();
    assert_eq!(
        (0..4).map(|i| told(i).generation).collect::<Vec<_>>(),
        vec![4, 4, 5, 4]
    );
    // The canary succeeds: two places, taken in name order.
    let mut ok = report(5, 20.0);
    ok.firmware_version = Some("2.0.0".into());
    store.record_report(&keys[2], ok, 2_000).await.unwrap();
    let pass = pace(&store).await.unwrap();
    assert_eq!(pass.released, vec![keys[0].clone(), keys[1].clone()]);
    assert_eq!(pass.held, 1);
    assert!(
        store
            .latest_report(&keys[0])
            .unwrap()
            .unwrap()
            .held_at_edge
            .is_none(),
        "the report went up again without the hold"
    );
    // Full while a and b update; a's install fails, which frees its place.
    assert!(pace(&store).await.unwrap().released.is_empty());
    let mut failed = report(5, 20.0);
    failed.firmware_failure = Some(FirmwareFailure {
        version: "2.0.0".into(),
        reason: "checksum".into(),
    });
    store.record_report(&keys[0], failed, 3_000).await.unwrap();
    let pass = pace(&store).await.unwrap();
    assert_eq!(pass.released, vec![keys[3].clone()]);
    assert_eq!(pass.held, 0);
    assert_eq!(told(3).generation, 5);
    // With nothing held, reports of paced devices do not wake the pacer
    // (a fleet keeps reporting long after its rollout); while something
    // is held, they do.
    let wake = store.pace_watch();
    let woken = || tokio::time::timeout(Duration::ZERO, wake.notified());
    let _ = woken().await;
    store.set_held_generations(pass.held);
    store
        .record_report(&keys[1], report(5, 20.0), 4_000)
        .await
        .unwrap();
    assert!(woken().await.is_err(), "nothing held: not woken");
    store.set_held_generations(1);
    store
        .record_report(&keys[1], report(5, 20.0), 5_000)
        .await
        .unwrap();
    assert!(woken().await.is_ok(), "something held: woken");
}

#[tokio::test]
async fn generations_held_before_a_restart_are_released_by_the_pacer_without_a_report() {
    use edgefleet_agent::site_pacing::{Metrics, run};
    use edgefleet_shared::site_pacing::{SitePace, SitePacing};
    let tmp = tempfile::tempdir().unwrap();
    let key = ResourceKey::device("plant", "a");
    let store = open(&tmp.path().join("store"));
    store
        .apply(&[(key.clone(), thermostat("u-a", 1, 21.0))], &[])
        .await
        .unwrap();
    let mut paced = thermostat("u-a", 2, 19.0);
    paced.site_pacing = Some(SitePacing {
        rollout: "cfg".into(),
        rollout_uid: "r-1".into(),
        pace: SitePace {
            site: "north".into(),
            limit: 1,
            canary: false,
            timeout_seconds: 600,
        },
    });
    store.apply(&[(key.clone(), paced)], &[]).await.unwrap();
    drop(store);
    let store = open(&tmp.path().join("store"));
    let told = || store.desired(&key).unwrap().unwrap().to_wire().generation;
    assert_eq!(told(), 1, "held across the restart");
    let metrics = Metrics::default();
    let pacer = tokio::spawn(run(store.clone(), metrics.clone()));
    // The pass counts what it released after the store has it: wait for both.
    for _ in 0..500 {
        if told() == 2 && metrics.released.get() == 1 {
            break;
        }
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
    pacer.abort();
    assert_eq!(told(), 2, "released by the pacer's first pass");
    assert_eq!(metrics.released.get(), 1);
}

#[tokio::test]
async fn a_rollout_rolled_back_at_the_edge_releases_nothing_more() {
    use edgefleet_agent::site_pacing::pace;
    use edgefleet_shared::rollout_member::{Previous, SiteThreshold};
    use edgefleet_shared::site_pacing::{SitePace, SitePacing};
    use edgefleet_shared::site_rollback::SiteRollback;
    let tmp = tempfile::tempdir().unwrap();
    let store = open(&tmp.path().join("store"));
    let keys = [
        ResourceKey::device("plant", "a"),
        ResourceKey::device("plant", "b"),
    ];
    let at = |generation: i64, setpoint: f64| -> Vec<(ResourceKey, DesiredDevice)> {
        keys.iter()
            .map(|k| {
                (
                    k.clone(),
                    thermostat(&format!("u-{k}"), generation, setpoint),
                )
            })
            .collect()
    };
    store.apply(&at(1, 21.0), &[]).await.unwrap();
    let mut rollout = at(2, 19.0);
    for (_, d) in &mut rollout {
        d.site_pacing = Some(SitePacing {
            rollout: "cfg".into(),
            rollout_uid: "r-1".into(),
            pace: SitePace {
                site: "north".into(),
                limit: 1,
                canary: false,
                timeout_seconds: 600,
            },
        });
        d.site_rollback = Some(SiteRollback {
            rollout: "cfg".into(),
            rollout_uid: "r-1".into(),
            threshold: SiteThreshold {
                percent: 50,
                min_sample: 1,
                classes: Vec::new(),
                whole_site: false,
            },
            previous: Previous {
                properties: BTreeMap::from([(
                    "setpoint".to_owned(),
                    Some(PropertyValue::Float(21.0)),
                )]),
                ..Previous::default()
            },
        });
    }
    store.apply(&rollout, &[]).await.unwrap();
    assert_eq!(pace(&store).await.unwrap().released, vec![keys[0].clone()]);
    // The agent rolls a back on its own (its site crossed the threshold
    // while offline): b is not started, though a's place is free.
    let a = store.desired(&keys[0]).unwrap().unwrap();
    let done = store
        .roll_back_at_edge(&[(keys[0].clone(), a.version)], "crossed")
        .await
        .unwrap();
    assert_eq!(done.len(), 1);
    let pass = pace(&store).await.unwrap();
    assert!(pass.released.is_empty(), "{pass:?}");
    assert_eq!(pass.held, 1);
    assert_eq!(
        store
            .desired(&keys[1])
            .unwrap()
            .unwrap()
            .to_wire()
            .generation,
        1
    );
}

#[tokio::test]
async fn a_generation_without_pacing_is_never_held() {
    let tmp = tempfile::tempdir().unwrap();
    let store = open(&tmp.path().join("store"));
    let key = ResourceKey::device("plant", "a");
    store
        .apply(&[(key.clone(), thermostat("u-a", 1, 21.0))], &[])
        .await
        .unwrap();
    store
        .apply(&[(key.clone(), thermostat("u-a", 2, 19.0))], &[])
        .await
        .unwrap();
    assert_eq!(
        store.desired(&key).unwrap().unwrap().to_wire().generation,
        2
    );
    let pass = edgefleet_agent::site_pacing::pace(&store).await.unwrap();
    assert_eq!(pass, Default::default());
}

#[tokio::test]
async fn a_key_watch_is_told_of_its_own_devices_key_changes_only() {
    use edgefleet_agent::store::HeldCredential;
    use edgefleet_shared::credential::{self, Psk};
    let tmp = tempfile::tempdir().unwrap();
    let store = open(&tmp.path().join("store"));
    let (t1, t2) = (
        ResourceKey::device("plant", "t1"),
        ResourceKey::device("plant", "t2"),
    );
    // Gives `device` the key `psk`, or takes its key away.
    let key = |device: &ResourceKey, psk: Option<&str>| {
        let key = credential::key_of(device);
        let store = store.clone();
        let psk = psk.map(|p| Psk::new(p.as_bytes().to_vec()).unwrap());
        async move {
            match psk {
                Some(psk) => {
                    let held = Desired::Credential(HeldCredential {
                        version: credential::version("secret-uid", &psk),
                        psk,
                    });
                    store.apply(&[(key, held)], &[]).await.unwrap();
                }
                None => store.apply::<Desired>(&[], &[key]).await.unwrap(),
            }
        }
    };
    let mut watch = store.credential_watch(&t1);

    // Another device's key arrives, rotates and goes: t1's watch is quiet.
    for psk in [
        Some("t2-0123456789abcdef"),
        Some("t2-rotated-0123456"),
        None,
    ] {
        key(&t2, psk).await;
    }
    assert!(!watch.has_changed().unwrap());

    // Its own key arriving, rotating and going each tell it.
    for psk in [
        Some("t1-0123456789abcdef"),
        Some("t1-rotated-0123456"),
        None,
    ] {
        key(&t1, psk).await;
        assert!(watch.has_changed().unwrap(), "{psk:?}");
        watch.mark_unchanged();
    }
}
