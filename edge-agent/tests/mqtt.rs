//! The agent's MQTT side against a real broker (the embedded rumqttd on a
//! loopback port): desired state is published retained and follows the
//! store, a deleted device's retained state is cleared, a device that
//! connects late gets its state at once, and reports are stored or refused.

use std::collections::BTreeMap;
use std::sync::Arc;
use std::time::Duration;

use edgefleet_agent::mqtt::{self, BrokerAddress, MqttMetrics};
use edgefleet_agent::store::{DesiredDevice, Store};
use edgefleet_shared::api::Transport;
use edgefleet_shared::codec::{self, DesiredState, DeviceReport};
use edgefleet_shared::{PropertyValue, ResourceKey, ResourceVersion, topics};
use rumqttc::{AsyncClient, Event, EventLoop, MqttOptions, Packet, QoS};

const NODE: &str = "edge-mqtt";

fn device(generation: i64, setpoint: f64) -> DesiredDevice {
    DesiredDevice::new(
        ResourceVersion::new("uid", generation),
        "thermostat",
        Transport::Mqtt,
        BTreeMap::from([("setpoint".to_owned(), PropertyValue::Float(setpoint))]),
    )
}

async fn test_client(port: u16, id: &str) -> (AsyncClient, EventLoop) {
    let mut options = MqttOptions::new(id, "127.0.0.1", port);
    options.set_keep_alive(Duration::from_secs(5));
    let (client, events) = AsyncClient::new(options, 64);
    (client, events)
}

/// The next publish on `topic`, skipping other traffic.
async fn next_publish(events: &mut EventLoop, topic: &str) -> Vec<u8> {
    let wait = async {
        loop {
            if let Event::Incoming(Packet::Publish(p)) =
                events.poll().await.expect("broker connection")
                && p.topic == topic
            {
                return p.payload.to_vec();
            }
        }
    };
    tokio::time::timeout(Duration::from_secs(10), wait)
        .await
        .unwrap_or_else(|_| panic!("nothing published on {topic}"))
}

async fn eventually(what: &str, check: impl Fn() -> bool) {
    for _ in 0..200 {
        if check() {
            return;
        }
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    panic!("timed out waiting until {what}");
}

#[tokio::test]
async fn desired_state_is_published_retained_and_reports_are_stored() {
    let port = std::net::TcpListener::bind("127.0.0.1:0")
        .unwrap()
        .local_addr()
        .unwrap()
        .port();
    mqtt::broker::start_embedded_broker(format!("127.0.0.1:{port}").parse().unwrap(), None)
        .unwrap();

    let tmp = tempfile::tempdir().unwrap();
    let store = Store::open(&tmp.path().join("store")).unwrap().store;
    let (a, b) = (
        ResourceKey::device("plant", "a"),
        ResourceKey::device("plant", "b"),
    );
    store
        .apply(
            &[(a.clone(), device(1, 20.0)), (b.clone(), device(1, 18.0))],
            &[],
        )
        .await
        .unwrap();

    let (device_client, mut device_events) = test_client(port, "device-a").await;
    device_client
        .subscribe(
            format!("edgefleet/{NODE}/plant/+/desired"),
            QoS::AtLeastOnce,
        )
        .await
        .unwrap();

    let metrics = Arc::new(MqttMetrics::default());
    let broker = BrokerAddress {
        host: "127.0.0.1".into(),
        port,
        login: None,
    };
    tokio::spawn(mqtt::run(
        broker,
        NODE.into(),
        store.clone(),
        Arc::clone(&metrics),
        Default::default(),
    ));

    // Published on connect...
    let first: DesiredState =
        codec::decode(&next_publish(&mut device_events, &topics::desired(NODE, &a)).await).unwrap();
    assert_eq!(first.generation, 1);
    // ...and again whenever the store changes.
    store
        .apply(&[(a.clone(), device(2, 22.5))], &[])
        .await
        .unwrap();
    let second: DesiredState =
        codec::decode(&next_publish(&mut device_events, &topics::desired(NODE, &a)).await).unwrap();
    assert_eq!(second.generation, 2);
    assert_eq!(second.properties["setpoint"], PropertyValue::Float(22.5));

    // A deleted device's retained state is cleared with an empty message.
    store
        .apply::<DesiredDevice>(&[], std::slice::from_ref(&b))
        .await
        .unwrap();
    assert!(
        next_publish(&mut device_events, &topics::desired(NODE, &b))
            .await
            .is_empty()
    );

    // A device that connects now gets its latest state at once (retained).
    let (late, mut late_events) = test_client(port, "device-a-late").await;
    late.subscribe(topics::desired(NODE, &a), QoS::AtLeastOnce)
        .await
        .unwrap();
    let retained: DesiredState =
        codec::decode(&next_publish(&mut late_events, &topics::desired(NODE, &a)).await).unwrap();
    assert_eq!(retained.generation, 2);

    // Reports: stored when valid, refused and counted otherwise.
    let report = DeviceReport {
        applied_generation: 2,
        properties: BTreeMap::from([("temperature".to_owned(), PropertyValue::Float(22.0))]),
        firmware_version: None,
        firmware_failure: None,
    };
    let publish = |topic: String, payload: Vec<u8>| {
        let client = device_client.clone();
        async move {
            client
                .publish(topic, QoS::AtLeastOnce, false, payload)
                .await
                .unwrap()
        }
    };
    publish(topics::report(NODE, &a), codec::encode(&report).unwrap()).await;
    publish(topics::report(NODE, &a), vec![0xff, 0x01]).await;
    publish(
        topics::report(NODE, &ResourceKey::device("plant", "ghost")),
        codec::encode(&report).unwrap(),
    )
    .await;
    publish(
        topics::report(NODE, &a),
        vec![0xa0; codec::MAX_MESSAGE_BYTES + 10],
    )
    .await;
    let pump = tokio::spawn(async move {
        loop {
            if device_events.poll().await.is_err() {
                tokio::time::sleep(Duration::from_millis(100)).await;
            }
        }
    });

    eventually("the report is stored", || {
        store.latest_report(&a).unwrap().is_some()
    })
    .await;
    assert_eq!(store.latest_report(&a).unwrap().unwrap().report, report);
    eventually("the refusals are counted", || {
        metrics.reports.get("malformed") == 1
            && metrics.reports.get("unknown_device") == 1
            && metrics.reports.get("too_large") == 1
    })
    .await;
    assert_eq!(metrics.reports.get("stored"), 1);
    assert_eq!(
        store.outbox_depth(),
        1,
        "only the valid report waits for the cloud"
    );
    pump.abort();
}
