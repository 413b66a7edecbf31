//! Device logins and topic rules on the site's MQTT port, tried with
//! foreign clients (Debian's `mosquitto_pub` and `mosquitto_sub`) against
//! the guard in front of the embedded rumqttd, with the agent's MQTT side
//! and its store on a real disk: a device with its key reports and reads
//! its desired state; every forbidden login, publish and subscription is
//! refused and counted, and nothing of it reaches the store or the
//! devices; a revoked key cuts the device's connection.
//!
//! The same with Debian's Mosquitto as the external broker, configured by
//! the password and ACL files the agent keeps (`mqtt::mosquitto`): there
//! Mosquitto refuses, and the tests check what reaches the store and the
//! devices.

use std::collections::BTreeMap;
use std::net::SocketAddr;
use std::sync::Arc;
use std::time::Duration;

use edgefleet_agent::mqtt::broker::{BrokerSecrets, start_embedded_broker};
use edgefleet_agent::mqtt::guard::{self, Guard, GuardMetrics};
use edgefleet_agent::mqtt::mosquitto::AuthFiles;
use edgefleet_agent::mqtt::{self, BrokerAddress, MqttMetrics};
use edgefleet_agent::store::{Desired, DesiredDevice, HeldCredential, Store};
use edgefleet_shared::api::Transport;
use edgefleet_shared::codec::{self, DesiredState, DeviceReport};
use edgefleet_shared::credential::{self, Psk};
use edgefleet_shared::health::{Health, Probe};
use edgefleet_shared::telemetry::Outcomes;
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
    /// Where devices connect: the guard, or Mosquitto.
    devices: SocketAddr,
    broker: SocketAddr,
    store: Store,
    metrics: Arc<GuardMetrics>,
    mqtt: Arc<MqttMetrics>,
    dir: tempfile::TempDir,
    /// On Mosquitto rather than the guard: the process, and the counts of
    /// its files' rewrites.
    mosquitto: Option<(tokio::process::Child, Arc<Outcomes>)>,
}

/// A fresh store on a real disk holding t1 and t2 with their keys.
async fn store_with_t1_and_t2(dir: &std::path::Path) -> Store {
    let store = Store::open(&dir.join("store")).unwrap().store;
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
    store
}

impl Site {
    async fn start() -> Site {
        let dir = tempfile::tempdir().unwrap();
        let store = store_with_t1_and_t2(dir.path()).await;
        let secrets = BrokerSecrets::new(NODE);
        let broker = free_port();
        start_embedded_broker(broker, Some(secrets.clone())).unwrap();
        let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
        let metrics = Arc::new(GuardMetrics::default());
        let site = Site {
            devices: listener.local_addr().unwrap(),
            broker,
            store: store.clone(),
            metrics: Arc::clone(&metrics),
            mqtt: Arc::new(MqttMetrics::default()),
            dir,
            mosquitto: None,
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
        site.start_agent(secrets.agent_login()).await;
        site
    }

    /// The agent's MQTT side on its broker, logged in as `login`; returns
    /// once it is subscribed.
    async fn start_agent(&self, login: (String, String)) {
        let health = Health::default();
        let check = health.check("mqtt", Probe::Live, None);
        check.failing("starting");
        tokio::spawn(mqtt::run(
            BrokerAddress {
                host: self.broker.ip().to_string(),
                port: self.broker.port(),
                login: Some(login),
            },
            NODE.into(),
            self.store.clone(),
            Arc::clone(&self.mqtt),
            check,
        ));
        for _ in 0..200 {
            if health.status(Probe::Live).is_ok() {
                return;
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
    run("mosquitto_pub", args(site.devices.port(), login, &rest))
        .await
        .0
}

/// `mosquitto_sub` as `t1` for one message of `filter`.
async fn subscribe_t1(site: &Site, filter: &str) -> (bool, Vec<u8>) {
    let login = Some(("t1@plant", "t1@plant", T1_KEY));
    let rest = ["-t", filter, "-C", "1", "-W", "3", "-N"];
    run("mosquitto_sub", args(site.devices.port(), login, &rest)).await
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
            "t1@plant",
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
    assert!(!publish(&site, "t1@plant", T2_KEY, &topic, &report, &[]).await);
    assert_eq!(site.refused("wrong_key"), 1);
    assert!(!publish(&site, "t9@plant", T1_KEY, &topic, &report, &[]).await);
    assert_eq!(site.refused("no_key"), 1);
    // No login at all.
    let port = site.devices.port();
    let rest = ["-t", topic.as_str(), "-f", report.as_str()];
    assert!(!run("mosquitto_pub", args(port, None, &rest)).await.0);
    assert_eq!(site.refused("bad_user_name"), 1);
    // The agent's client id, with a device's own key.
    let agent_id = mqtt::broker::agent_client_id(NODE);
    let taken = Some((agent_id.as_str(), "t1@plant", T1_KEY));
    assert!(!run("mosquitto_pub", args(port, taken, &rest)).await.0);
    assert_eq!(site.refused("client_id_not_user_name"), 1);
    // Around the guard, straight to the broker: neither a device's key nor
    // the agent's client id gets in without the secrets made at start.
    for id in ["t1@plant", agent_id.as_str()] {
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
        async move { publish(site, "t1@plant", T1_KEY, &topic, report, extra).await }
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
    let login = Some(("t1@plant", "t1@plant", T1_KEY));
    let listen = args(
        site.devices.port(),
        login,
        &["-t", &filter, "-W", "15", "-N"],
    );
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

// On Mosquitto.

/// The numeric id of the group `mosquitto`, which Debian's Mosquitto runs
/// as after it starts as root: the agent gives its files to that group.
fn mosquitto_group() -> u32 {
    nix::unistd::Group::from_name("mosquitto")
        .ok()
        .flatten()
        .expect("a group `mosquitto` (Debian's package `mosquitto`; .ci/run installs it)")
        .gid
        .as_raw()
}

impl Site {
    /// Mosquitto on a loopback port, reading the files the agent keeps
    /// (written once before it starts, then kept by
    /// `mqtt::mosquitto::run`); the agent's MQTT side connects to it by
    /// [`Site::start_agent`] with the returned login.
    async fn start_mosquitto() -> (Site, (String, String)) {
        let dir = tempfile::tempdir().unwrap();
        let store = store_with_t1_and_t2(dir.path()).await;
        let auth = dir.path().join("auth");
        std::fs::create_dir(&auth).unwrap();
        let pid_file = dir.path().join("mosquitto.pid");
        let mut files = AuthFiles::new(NODE, &auth, &pid_file, Some(mosquitto_group()));
        let login = files.agent_login();
        assert!(files.write(&store.credentials().unwrap()).unwrap());
        let addr = free_port();
        let conf = dir.path().join("mosquitto.conf");
        std::fs::write(
            &conf,
            format!(
                "listener {} 127.0.0.1\nallow_anonymous false\nuse_username_as_clientid true\n\
                 password_file {auth}/passwd\nacl_file {auth}/acl\npersistence false\nlog_type error\n",
                addr.port(),
                auth = auth.display()
            ),
        )
        .unwrap();
        let program = ["/usr/sbin/mosquitto", "/usr/bin/mosquitto"]
            .into_iter()
            .find(|p| std::path::Path::new(p).exists())
            .expect("mosquitto is installed (Debian package `mosquitto`; .ci/run installs it)");
        let process = tokio::process::Command::new(program)
            .arg("-c")
            .arg(&conf)
            .kill_on_drop(true)
            .spawn()
            .unwrap();
        std::fs::write(&pid_file, process.id().unwrap().to_string()).unwrap();
        for _ in 0..200 {
            if tokio::net::TcpStream::connect(addr).await.is_ok() {
                break;
            }
            tokio::time::sleep(Duration::from_millis(50)).await;
        }
        let outcomes = Arc::new(Outcomes::default());
        tokio::spawn(mqtt::mosquitto::run(
            files,
            store.clone(),
            Arc::clone(&outcomes),
        ));
        let site = Site {
            devices: addr,
            broker: addr,
            store,
            metrics: Arc::new(GuardMetrics::default()),
            mqtt: Arc::new(MqttMetrics::default()),
            dir,
            mosquitto: Some((process, outcomes)),
        };
        (site, login)
    }

    /// How often the agent rewrote Mosquitto's files and had it read them.
    fn files_written(&self) -> u64 {
        self.mosquitto.as_ref().unwrap().1.get("written")
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn on_mosquitto_a_device_uses_its_own_topics_with_its_key_and_nothing_else() {
    let (site, login) = Site::start_mosquitto().await;
    site.start_agent(login).await;
    let (t1, t2) = (
        ResourceKey::device("plant", "t1"),
        ResourceKey::device("plant", "t2"),
    );
    let own_report = topics::report(NODE, &t1);
    let report = site.report_file(20.5);
    assert!(publish(&site, "t1@plant", T1_KEY, &own_report, &report, &[]).await);
    eventually("t1's report is stored", || {
        site.temperature_of("t1") == Some(PropertyValue::Float(20.5))
    })
    .await;

    // Logins: a wrong key, an unknown device, none, and the agent's user
    // name with a device's key are refused.
    assert!(!publish(&site, "t1@plant", T2_KEY, &own_report, &report, &[]).await);
    assert!(!publish(&site, "t9@plant", T1_KEY, &own_report, &report, &[]).await);
    let rest = ["-t", own_report.as_str(), "-f", report.as_str()];
    let port = site.devices.port();
    assert!(!run("mosquitto_pub", args(port, None, &rest)).await.0);
    let agent_id = mqtt::broker::agent_client_id(NODE);
    assert!(!publish(&site, &agent_id, T1_KEY, &own_report, &report, &[]).await);
    // The agent's client id with t1's login: Mosquitto gives the
    // connection t1's name instead, so the agent keeps its session.
    let taken = Some((agent_id.as_str(), "t1@plant", T1_KEY));
    assert!(run("mosquitto_pub", args(port, taken, &rest)).await.0);

    // Forbidden publishes: Mosquitto acknowledges and drops them (MQTT
    // 3.1.1 has no refusal for a PUBLISH).
    let forged = site.report_file(99.0);
    assert!(
        publish(
            &site,
            "t1@plant",
            T1_KEY,
            &topics::report(NODE, &t2),
            &forged,
            &[]
        )
        .await
    );
    for device in [&t1, &t2] {
        let desired = topics::desired(NODE, device);
        assert!(publish(&site, "t1@plant", T1_KEY, &desired, &forged, &["-r"]).await);
    }
    // A report of t1's own after them, to know they had their chance.
    let last = site.report_file(21.5);
    assert!(publish(&site, "t1@plant", T1_KEY, &own_report, &last, &[]).await);
    eventually("t1's last report is stored", || {
        site.temperature_of("t1") == Some(PropertyValue::Float(21.5))
    })
    .await;
    tokio::time::sleep(Duration::from_millis(300)).await;
    assert_eq!(site.temperature_of("t2"), None, "t1 reported for t2");
    assert_eq!(
        site.mqtt.reports.get("stored"),
        3,
        "20.5, the agent's id, 21.5"
    );
    for (name, key, setpoint) in [("t1@plant", T1_KEY, 21.0), ("t2@plant", T2_KEY, 19.0)] {
        let login = Some((name, name, key));
        let device = credential::device_of_login(name).unwrap();
        let rest = [
            "-t",
            &topics::desired(NODE, &device),
            "-C",
            "1",
            "-W",
            "3",
            "-N",
        ];
        let (ok, payload) = run("mosquitto_sub", args(port, login, &rest)).await;
        assert!(ok, "{name} reads its desired state");
        let desired: DesiredState =
            codec::decode(&payload).expect("the agent's CBOR, not t1's forgery");
        assert_eq!(
            desired.properties["setpoint"],
            PropertyValue::Float(setpoint)
        );
    }

    // Subscriptions: another device's desired state gives nothing, and
    // `#` gives t1 only its own topics.
    let (ok, payload) = subscribe_t1(&site, &topics::desired(NODE, &t2)).await;
    assert!(!ok && payload.is_empty(), "t1 read t2's desired state");
    let t1_login = Some(("t1@plant", "t1@plant", T1_KEY));
    let all = ["-t", "#", "-v", "-C", "3", "-W", "3"];
    let (_, seen) = run("mosquitto_sub", args(port, t1_login, &all)).await;
    let seen = String::from_utf8_lossy(&seen);
    assert!(seen.contains(&topics::desired(NODE, &t1)), "{seen}");
    assert!(!seen.contains("plant/t2"), "t1 saw t2's topics: {seen}");
    assert_eq!(site.files_written(), 0, "no key changed, no rewrite");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn on_mosquitto_a_retained_report_is_not_taken_again() {
    let (site, login) = Site::start_mosquitto().await;
    let t1 = ResourceKey::device("plant", "t1");
    let report = site.report_file(55.0);
    // Mosquitto's ACLs cannot refuse a retained message on t1's own topic:
    // it waits there for the agent, which refuses it as retained.
    assert!(
        publish(
            &site,
            "t1@plant",
            T1_KEY,
            &topics::report(NODE, &t1),
            &report,
            &["-r"]
        )
        .await
    );
    site.start_agent(login).await;
    eventually("the retained report is refused", || {
        site.mqtt.reports.get("retained") == 1
    })
    .await;
    assert_eq!(site.temperature_of("t1"), None);
    assert_eq!(site.mqtt.reports.get("stored"), 0);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn on_mosquitto_a_revoked_key_cuts_the_device_and_a_new_one_gets_in() {
    let (site, login) = Site::start_mosquitto().await;
    site.start_agent(login).await;
    let t1 = ResourceKey::device("plant", "t1");
    let port = site.devices.port();
    let filter = topics::event_ack(NODE, &t1);
    let t1_login = Some(("t1@plant", "t1@plant", T1_KEY));
    let listen = args(port, t1_login, &["-t", &filter, "-W", "15", "-N"]);
    let listening = tokio::spawn(run("mosquitto_sub", listen));
    tokio::time::sleep(Duration::from_millis(500)).await;
    let started = std::time::Instant::now();
    site.store
        .apply::<Desired>(&[], &[credential::key_of(&t1)])
        .await
        .unwrap();
    let (ok, _) = listening.await.unwrap();
    assert!(!ok, "mosquitto_sub is cut and its reconnect refused");
    assert!(
        started.elapsed() < Duration::from_secs(10),
        "cut at once, not at the -W 15 time-out"
    );
    assert_eq!(site.files_written(), 1);
    let report = site.report_file(20.0);
    let own_report = topics::report(NODE, &t1);
    assert!(!publish(&site, "t1@plant", T1_KEY, &own_report, &report, &[]).await);
    // A new key for t1: it gets in with that one only.
    const NEW_KEY: &str = "t1-new-0123456789abc";
    site.store.apply(&[key(&t1, NEW_KEY)], &[]).await.unwrap();
    eventually("the new key is written", || site.files_written() == 2).await;
    assert!(!publish(&site, "t1@plant", T1_KEY, &own_report, &report, &[]).await);
    assert!(publish(&site, "t1@plant", NEW_KEY, &own_report, &report, &[]).await);
    eventually("t1's report is stored", || {
        site.temperature_of("t1") == Some(PropertyValue::Float(20.0))
    })
    .await;
}
