//! Device logins and topic rules on the site's MQTT port, tried with
//! foreign clients (Debian's `mosquitto_pub` and `mosquitto_sub`) against
//! the guard in front of the embedded rumqttd, with the agent's MQTT side
//! and its store on a real disk: a device with its key reports and reads
//! its desired state; every forbidden login, publish and subscription is
//! refused and counted, and nothing of it reaches the store or the
//! devices; a revoked key cuts the device's connection.

use std::collections::BTreeMap;
use std::net::SocketAddr;
use std::sync::Arc;
use std::time::Duration;

use edgefleet_agent::mqtt::broker::{BrokerSecrets, start_embedded_broker};
use edgefleet_agent::mqtt::guard::{self, Guard, GuardMetrics};
use edgefleet_agent::mqtt::{self, BrokerAddress, MqttMetrics};
use edgefleet_agent::store::{Desired, DesiredDevice, HeldCredential, Store};
use edgefleet_shared::api::Transport;
use edgefleet_shared::codec::{self, DesiredState, DeviceReport};
use edgefleet_shared::credential::{self, Psk};
use edgefleet_shared::health::{Health, Probe};
use edgefleet_shared::{PropertyValue, ResourceKey, ResourceVersion, topics};

const NODE: &str = "edge-guard";
const T1_KEY: &str = "t1-0123456789abcdef";
const T2_KEY: &str = "t2-0123456789abcdef";

fn free_port() -> SocketAddr {
    std::net::TcpListener::bind("127.0.0.1:0")
        .unwrap()
        .local_addr()
        .unwrap()
}

fn thermostat(setpoint: f64) -> Desired {
    DesiredDevice::new(
        ResourceVersion::new("uid", 1),
        "thermostat",
        Transport::Mqtt,
        BTreeMap::from([("setpoint".to_owned(), PropertyValue::Float(setpoint))]),
    )
    .into()
}

fn key(device: &ResourceKey, psk: &str) -> (ResourceKey, Desired) {
    let psk = Psk::new(psk.as_bytes().to_vec()).unwrap();
    (
        credential::key_of(device),
        Desired::Credential(HeldCredential {
            version: credential::version("secret-uid", &psk),
            psk,
        }),
    )
}

/// The agent's MQTT side: the broker on loopback, the guard in front.
struct Site {
    guard: SocketAddr,
    broker: SocketAddr,
    store: Store,
    metrics: Arc<GuardMetrics>,
    mqtt: Arc<MqttMetrics>,
    dir: tempfile::TempDir,
}

impl Site {
    async fn start() -> Site {
        let dir = tempfile::tempdir().unwrap();
        let store = Store::open(&dir.path().join("store")).unwrap().store;
        let (t1, t2) = (
            ResourceKey::device("plant", "t1"),
            ResourceKey::device("plant", "t2"),
        );
        store
            .apply(
                &[
                    (t1.clone(), thermostat(21.0)),
                    (t2.clone(), thermostat(19.0)),
                    key(&t1, T1_KEY),
                    key(&t2, T2_KEY),
                ],
                &[],
            )
            .await
            .unwrap();
        let secrets = BrokerSecrets::new(NODE);
        let broker = free_port();
        start_embedded_broker(broker, Some(secrets.clone())).unwrap();
        let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
        let metrics = Arc::new(GuardMetrics::default());
        let site = Site {
            guard: listener.local_addr().unwrap(),
            broker,
            store: store.clone(),
            metrics: Arc::clone(&metrics),
            mqtt: Arc::new(MqttMetrics::default()),
            dir,
        };
        tokio::spawn(guard::serve(
            listener,
            Guard {
                node: NODE.into(),
                store: store.clone(),
                broker,
                broker_password: secrets.guard_password(),
                metrics,
            },
        ));
        let health = Health::default();
        let check = health.check("mqtt", Probe::Live, None);
        check.failing("starting");
        tokio::spawn(mqtt::run(
            BrokerAddress {
                host: broker.ip().to_string(),
                port: broker.port(),
                login: Some(secrets.agent_login()),
            },
            NODE.into(),
            store,
            Arc::clone(&site.mqtt),
            check,
        ));
        for _ in 0..200 {
            if health.status(Probe::Live).is_ok() {
                return site;
            }
            tokio::time::sleep(Duration::from_millis(50)).await;
        }
        panic!("the agent never subscribed at its broker (was its login refused?)");
    }

    fn refused(&self, label: &str) -> u64 {
        self.metrics.logins.get(label)
    }

    fn ended(&self, label: &str) -> u64 {
        self.metrics.ended.get(label)
    }

    fn report_file(&self, temperature: f64) -> String {
        let path = self.dir.path().join(format!("report-{temperature}.cbor"));
        let report = DeviceReport {
            applied_generation: 1,
            properties: BTreeMap::from([(
                "temperature".to_owned(),
                PropertyValue::Float(temperature),
            )]),
            firmware_version: None,
            firmware_failure: None,
        };
        std::fs::write(&path, codec::encode(&report).unwrap()).unwrap();
        path.to_string_lossy().into_owned()
    }

    fn temperature_of(&self, name: &str) -> Option<PropertyValue> {
        let latest = self
            .store
            .latest_report(&ResourceKey::device("plant", name))
            .unwrap()?;
        latest.report.properties.get("temperature").cloned()
    }
}

/// Runs a mosquitto client; whether it exited 0, and what it printed.
async fn run(bin: &str, args: Vec<String>) -> (bool, Vec<u8>) {
    let child = tokio::process::Command::new(bin)
        .args(&args)
        .kill_on_drop(true)
        .output();
    let output = tokio::time::timeout(Duration::from_secs(20), child)
        .await
        .unwrap_or_else(|_| panic!("{bin} {args:?} did not finish"))
        .unwrap_or_else(|e| panic!("{bin}: {e} (is Debian's mosquitto-clients installed?)"));
    if !output.status.success() {
        // What the client says, for whoever reads a failure.
        eprintln!(
            "{bin} {}: {}",
            args.join(" "),
            String::from_utf8_lossy(&output.stderr).trim()
        );
    }
    (output.status.success(), output.stdout)
}

/// A mosquitto client's arguments for `port`, QoS 1, MQTT 3.1.1, logging
/// in as (client id, user name, password) if given, then `rest`.
fn args(port: u16, login: Option<(&str, &str, &str)>, rest: &[&str]) -> Vec<String> {
    let mut args = format!("-h 127.0.0.1 -p {port} -V mqttv311 -q 1");
    if let Some((id, user, password)) = login {
        args += &format!(" -i {id} -u {user} -P {password}");
    }
    let mut args: Vec<String> = args.split(' ').map(str::to_owned).collect();
    args.extend(rest.iter().map(|s| (*s).to_owned()));
    args
}

/// `mosquitto_pub` of `file` to `topic` as device `user` with `password`.
async fn publish(
    site: &Site,
    user: &str,
    password: &str,
    topic: &str,
    file: &str,
    extra: &[&str],
) -> bool {
    let mut rest = vec!["-t", topic, "-f", file];
    rest.extend(extra);
    let login = Some((user, user, password));
    run("mosquitto_pub", args(site.guard.port(), login, &rest))
        .await
        .0
}

/// `mosquitto_sub` as `t1` for one message of `filter`.
async fn subscribe_t1(site: &Site, filter: &str) -> (bool, Vec<u8>) {
    let login = Some(("plant:t1", "plant:t1", T1_KEY));
    let rest = ["-t", filter, "-C", "1", "-W", "3", "-N"];
    run("mosquitto_sub", args(site.guard.port(), login, &rest)).await
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

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_device_reports_and_reads_its_own_state_with_its_key() {
    let site = Site::start().await;
    let t1 = ResourceKey::device("plant", "t1");
    let report = site.report_file(20.5);
    assert!(
        publish(
            &site,
            "plant:t1",
            T1_KEY,
            &topics::report(NODE, &t1),
            &report,
            &[]
        )
        .await
    );
    eventually("t1's report is stored", || {
        site.temperature_of("t1") == Some(PropertyValue::Float(20.5))
    })
    .await;
    let (ok, payload) = subscribe_t1(&site, &topics::desired(NODE, &t1)).await;
    assert!(ok, "t1 reads its own retained desired state");
    let desired: DesiredState = codec::decode(&payload).unwrap();
    assert_eq!(desired.properties["setpoint"], PropertyValue::Float(21.0));
    assert_eq!(site.refused("accepted"), 2);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn logins_without_the_devices_key_are_refused_and_counted() {
    let site = Site::start().await;
    let t1 = ResourceKey::device("plant", "t1");
    let topic = topics::report(NODE, &t1);
    let report = site.report_file(30.0);
    assert!(!publish(&site, "plant:t1", T2_KEY, &topic, &report, &[]).await);
    assert_eq!(site.refused("wrong_key"), 1);
    assert!(!publish(&site, "plant:t9", T1_KEY, &topic, &report, &[]).await);
    assert_eq!(site.refused("no_key"), 1);
    // No login at all.
    let port = site.guard.port();
    let rest = ["-t", topic.as_str(), "-f", report.as_str()];
    assert!(!run("mosquitto_pub", args(port, None, &rest)).await.0);
    assert_eq!(site.refused("bad_user_name"), 1);
    // The agent's client id, with a device's own key.
    let agent_id = mqtt::broker::agent_client_id(NODE);
    let taken = Some((agent_id.as_str(), "plant:t1", T1_KEY));
    assert!(!run("mosquitto_pub", args(port, taken, &rest)).await.0);
    assert_eq!(site.refused("client_id_not_user_name"), 1);
    // Around the guard, straight to the broker: neither a device's key nor
    // the agent's client id gets in without the secrets made at start.
    for id in ["plant:t1", agent_id.as_str()] {
        let direct = args(site.broker.port(), Some((id, id, T1_KEY)), &rest);
        assert!(
            !run("mosquitto_pub", direct).await.0,
            "{id} straight to the broker"
        );
    }
    tokio::time::sleep(Duration::from_millis(300)).await;
    assert_eq!(
        site.temperature_of("t1"),
        None,
        "nothing refused was stored"
    );
    assert_eq!(site.refused("accepted"), 0);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_device_may_not_publish_or_subscribe_beyond_its_own_topics() {
    let site = Site::start().await;
    let (t1, t2) = (
        ResourceKey::device("plant", "t1"),
        ResourceKey::device("plant", "t2"),
    );
    let report = site.report_file(99.0);
    let as_t1 = |topic: String, extra: &'static [&'static str]| {
        let (site, report) = (&site, &report);
        async move { publish(site, "plant:t1", T1_KEY, &topic, report, extra).await }
    };
    assert!(
        !as_t1(topics::report(NODE, &t2), &[]).await,
        "another's report"
    );
    assert!(
        !as_t1(topics::report(NODE, &t1), &["-r"]).await,
        "its own, retained"
    );
    // Desired state, its own and another's, retained as the agent does.
    assert!(!as_t1(topics::desired(NODE, &t1), &["-r"]).await);
    assert!(!as_t1(topics::desired(NODE, &t2), &["-r"]).await);
    assert_eq!(site.ended("publish_not_allowed"), 3);
    assert_eq!(site.ended("retained"), 1);
    // Another device's desired state, and wildcards: each subscription
    // ends the connection (mosquitto_sub connects again and again until
    // its -W time-out, and is cut each time).
    for filter in [
        topics::desired(NODE, &t2),
        format!("edgefleet/{NODE}/plant/+/desired"),
        "#".to_owned(),
    ] {
        let before = site.ended("subscribe_not_allowed");
        let (ok, payload) = subscribe_t1(&site, &filter).await;
        assert!(!ok && payload.is_empty(), "{filter} refused");
        assert!(
            site.ended("subscribe_not_allowed") > before,
            "{filter} counted"
        );
    }
    // Nothing refused reached the broker: no report stored, and t1's
    // retained desired state is still the agent's.
    tokio::time::sleep(Duration::from_millis(300)).await;
    assert_eq!(site.temperature_of("t1"), None);
    assert_eq!(site.temperature_of("t2"), None);
    let (ok, payload) = subscribe_t1(&site, &topics::desired(NODE, &t1)).await;
    assert!(ok);
    let desired: DesiredState = codec::decode(&payload).expect("the agent's CBOR, not the forgery");
    assert_eq!(desired.properties["setpoint"], PropertyValue::Float(21.0));
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_revoked_key_cuts_the_devices_connection_and_keeps_it_out() {
    let site = Site::start().await;
    let t1 = ResourceKey::device("plant", "t1");
    let filter = topics::event_ack(NODE, &t1);
    let login = Some(("plant:t1", "plant:t1", T1_KEY));
    let listen = args(site.guard.port(), login, &["-t", &filter, "-W", "15", "-N"]);
    let listening = tokio::spawn(run("mosquitto_sub", listen));
    eventually("t1 is connected", || site.metrics.open.get() == 1).await;
    let started = std::time::Instant::now();
    site.store
        .apply::<Desired>(&[], &[credential::key_of(&t1)])
        .await
        .unwrap();
    eventually("t1's connection is cut", || site.ended("revoked") == 1).await;
    let (ok, _) = listening.await.unwrap();
    assert!(
        !ok,
        "mosquitto_sub ends with an error: its reconnect is refused"
    );
    assert!(
        started.elapsed() < Duration::from_secs(10),
        "cut at once, not at the -W 15 time-out"
    );
    assert!(site.refused("no_key") >= 1, "the reconnect was refused");
    // The guard counts a connection closed once its task has ended.
    eventually("no connection is open", || site.metrics.open.get() == 0).await;
}
