//! The agent's MQTT side coming back to a backlog: 5,000 MQTT devices
//! reported while it was away, the site's Mosquitto queued their reports in
//! the agent's persistent session, and on reconnect the agent must store
//! every one while it publishes 5,000 desired states, with the client's
//! request queue (1,024) full.

use std::collections::BTreeMap;
use std::sync::Arc;
use std::time::Duration;

use edgefleet_agent::mqtt::{self, BrokerAddress, MqttMetrics};
use edgefleet_agent::store::{DesiredDevice, Store};
use edgefleet_shared::api::Transport;
use edgefleet_shared::codec;
use edgefleet_shared::{PropertyValue, ResourceKey, ResourceVersion, topics};
use edgefleet_tests::mosquitto::Mosquitto;
use edgefleet_tests::{eventually_within, numbered_report};
use rumqttc::{AsyncClient, Event, MqttOptions, Packet, QoS};

const NODE: &str = "edge-backlog";
const DEVICES: usize = 5_000;
/// Devices per MQTT connection, as device-sim groups them.
const PER_SESSION: usize = 50;

fn key(i: usize) -> ResourceKey {
    ResourceKey::device("plant", format!("d{i:04}"))
}

fn report(value: i64) -> Vec<u8> {
    codec::encode(&numbered_report(value)).unwrap()
}

fn start_agent(
    broker: &Mosquitto,
    store: &Store,
) -> (tokio::task::JoinHandle<()>, Arc<MqttMetrics>) {
    let metrics = Arc::new(MqttMetrics::default());
    let agent = tokio::spawn(mqtt::run(
        BrokerAddress {
            host: broker.addr.ip().to_string(),
            port: broker.addr.port(),
            login: None,
        },
        NODE.into(),
        store.clone(),
        Arc::clone(&metrics),
        Default::default(),
    ));
    (agent, metrics)
}

/// Publishes `value` as the report of every device in `devices`, from one
/// connection, and returns once the broker has acknowledged them all.
async fn report_all(broker: &Mosquitto, session: usize, devices: Vec<usize>, value: i64) {
    let mut options = MqttOptions::new(
        format!("devices-{session}"),
        broker.addr.ip().to_string(),
        broker.addr.port(),
    );
    options.set_keep_alive(Duration::from_secs(30));
    let (client, mut events) = AsyncClient::new(options, PER_SESSION * 2);
    let count = devices.len();
    for i in devices {
        client
            .publish(
                topics::report(NODE, &key(i)),
                QoS::AtLeastOnce,
                false,
                report(value),
            )
            .await
            .unwrap();
    }
    let mut acked = 0;
    while acked < count {
        match events.poll().await {
            Ok(Event::Incoming(Packet::PubAck(_))) => acked += 1,
            Ok(_) => {}
            Err(error) => panic!("device session {session}: {error}"),
        }
    }
    client.disconnect().await.ok();
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn five_thousand_devices_backlog_is_stored_while_the_agent_republishes_desired_state() {
    let dir = tempfile::tempdir().unwrap();
    // Queue everything for an offline persistent session and send it all
    // at once on reconnect, as a broker tuned for throughput does.
    let broker = Mosquitto::start_with(
        dir.path(),
        "max_queued_messages 0\nmax_inflight_messages 0\n",
    );
    broker.wait_listening().await;

    let store = Store::open(&dir.path().join("store")).unwrap().store;
    let devices: Vec<(ResourceKey, DesiredDevice)> = (0..DEVICES)
        .map(|i| {
            (
                key(i),
                DesiredDevice::new(
                    ResourceVersion::new(format!("uid-{i}"), 1),
                    "meter",
                    Transport::Mqtt,
                    BTreeMap::new(),
                ),
            )
        })
        .collect();
    for chunk in devices.chunks(500) {
        store.apply(chunk, &[]).await.unwrap();
    }

    // First connection: the agent's session and subscriptions exist.
    let (agent, metrics) = start_agent(&broker, &store);
    eventually_within(
        Duration::from_secs(60),
        "the agent stores a first report",
        || {
            let (broker, store) = (&broker, &store);
            async move {
                report_all(broker, 0, vec![0], 0).await;
                tokio::time::sleep(Duration::from_millis(200)).await;
                store.latest_report(&key(0)).unwrap().map(drop)
            }
        },
    )
    .await;
    assert_eq!(metrics.reports.get("stored"), 1);
    agent.abort();
    let _ = agent.await;

    // Away: every device reports; Mosquitto queues it all for the agent.
    let sessions: Vec<_> = (0..DEVICES / PER_SESSION)
        .map(|s| {
            let devices = (s * PER_SESSION..(s + 1) * PER_SESSION).collect();
            let broker = &broker;
            async move { report_all(broker, s + 1, devices, 1).await }
        })
        .collect();
    futures::future::join_all(sessions).await;

    // Back: 5,000 desired states go out while 5,000 reports come in.
    let (agent, metrics) = start_agent(&broker, &store);
    let missing = || {
        (0..DEVICES)
            .filter(|&i| {
                let latest = store.latest_report(&key(i)).unwrap();
                latest.map(|l| l.report.properties["reading"].clone())
                    != Some(PropertyValue::Int(1))
            })
            .count()
    };
    eventually_within(
        Duration::from_secs(180),
        "every backlogged report is stored",
        || async {
            let missing = missing();
            eprintln!("{missing} of {DEVICES} backlogged reports not stored yet");
            // The store shows a batch's writes before its flush; the
            // counter moves once the flush is done.
            let durable = metrics.reports.get("stored") >= DEVICES as u64;
            (missing == 0 && durable).then_some(())
        },
    )
    .await;
    // Every report came once and was stored, none refused or failed.
    assert_eq!(metrics.reports.get("stored"), DEVICES as u64);
    assert_eq!(metrics.reports.get("store_error"), 0);
    eventually_within(
        Duration::from_secs(60),
        "every desired state is published again",
        || async { (metrics.desired_published.get() >= DEVICES as u64).then_some(()) },
    )
    .await;
    agent.abort();
}
