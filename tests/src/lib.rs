//! Test harness: a real Kubernetes control plane for Edgefleet's tests.
//!
//! [`control_plane`] starts one upstream kube-apiserver with embedded etcd
//! (built by `tests/controlplane/build.sh`) the first time a test asks for it,
//! installs the Edgefleet CRDs and admission policy, and waits until they are
//! in force. Every
//! test then makes its own [`kube::Client`] (clients are tied to the tokio
//! runtime that made them, and each `#[tokio::test]` has its own) and its own
//! namespace with [`test_namespace`].
//!
//! Nothing outlives the test process: the control plane exits when its stdin
//! closes, which the kernel does for us however this process ends, panics and
//! `kill -9` included.

#![forbid(unsafe_code)]

pub mod agent_tokens;
pub mod bench;
pub mod certs;
pub mod device_client;
pub mod edge_events;
pub mod fault;
pub mod final_state;
pub mod fleet_view;
pub mod hollow;
pub mod manifests;
pub mod mosquitto;
pub mod node;
pub mod powercut_fs;
pub mod process;
pub mod rollout_timeline;
pub mod round_robin;
pub mod rule_site;
pub mod sim;
pub mod stack;

use std::io::{BufRead, BufReader, Read};
use std::path::{Path, PathBuf};
use std::process::{Child, ChildStdin, Command, Stdio};
use std::sync::atomic::{AtomicU32, Ordering};
use std::sync::{Mutex, OnceLock, mpsc};
use std::time::Duration;

use anyhow::{Context, anyhow, bail};
use edgefleet_shared::api::Device;
use k8s_openapi::api::admissionregistration::v1::{
    ValidatingAdmissionPolicy, ValidatingAdmissionPolicyBinding,
};
use k8s_openapi::api::core::v1::Namespace;
use k8s_openapi::apiextensions_apiserver::pkg::apis::apiextensions::v1::CustomResourceDefinition;
use kube::api::{DynamicObject, ObjectMeta, Patch, PatchParams, PostParams};
use kube::config::{KubeConfigOptions, Kubeconfig};
use kube::core::ApiResource;
use kube::runtime::wait::{await_condition, conditions};
use kube::{Api, Client, Config};

/// Field manager the harness applies CRDs with.
pub const FIELD_MANAGER: &str = "edgefleet-tests";

const START_TIMEOUT: Duration = Duration::from_secs(120);
const CRD_TIMEOUT: Duration = Duration::from_secs(60);

/// A running local control plane.
#[derive(Debug)]
pub struct ControlPlane {
    kubeconfig: PathBuf,
    data_dir: PathBuf,
    // Held only to keep the child's stdin open: dropping it (or this process
    // ending) tells the control plane to shut down.
    _stdin: Mutex<ChildStdin>,
    _child: Mutex<Child>,
}

impl ControlPlane {
    /// Path of a kubeconfig with cluster-admin rights on this control plane.
    pub fn kubeconfig(&self) -> &Path {
        &self.kubeconfig
    }

    /// Where etcd's data, the certificates and the control plane's log live.
    pub fn data_dir(&self) -> &Path {
        &self.data_dir
    }

    /// A new client for the calling test's tokio runtime.
    pub async fn client(&self) -> Client {
        client_from(&self.kubeconfig).await
    }
}

/// The control plane of this test process, started on first use.
///
/// Panics with the reason (and the tail of the control plane's log) if it
/// cannot be started: every test that needs it fails loudly, none is skipped.
pub fn control_plane() -> &'static ControlPlane {
    static CONTROL_PLANE: OnceLock<Result<ControlPlane, String>> = OnceLock::new();
    CONTROL_PLANE
        .get_or_init(|| start().map_err(|e| format!("{e:#}")))
        .as_ref()
        .unwrap_or_else(|e| panic!("local control plane unavailable: {e}"))
}

/// How long [`eventually`] waits.
pub const PATIENCE: Duration = Duration::from_secs(30);

/// Polls `check` until it returns `Some`, or panics after [`PATIENCE`]
/// naming what never happened.
pub async fn eventually<T, F, Fut>(what: &str, check: F) -> T
where
    F: FnMut() -> Fut,
    Fut: std::future::Future<Output = Option<T>>,
{
    eventually_within(PATIENCE, what, check).await
}

/// [`eventually`] with another patience, for what takes longer (a fleet
/// converging after a fault, a long outbox draining).
pub async fn eventually_within<T, F, Fut>(patience: Duration, what: &str, mut check: F) -> T
where
    F: FnMut() -> Fut,
    Fut: std::future::Future<Output = Option<T>>,
{
    let deadline = tokio::time::Instant::now() + patience;
    loop {
        if let Some(value) = check().await {
            return value;
        }
        assert!(
            tokio::time::Instant::now() < deadline,
            "timed out after {patience:?} waiting until {what}"
        );
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
}

/// The value of environment variable `name`, or `default` when it is unset
/// or does not parse (how the seeded tests take a seed to replay).
pub fn env_or<T: std::str::FromStr>(name: &str, default: T) -> T {
    std::env::var(name)
        .ok()
        .and_then(|s| s.parse().ok())
        .unwrap_or(default)
}

/// The one property of a [`numbered_report`].
pub const READING: &str = "reading";

/// A report at generation 1 whose one property, [`READING`], is `value`:
/// what tests and benchmarks send when only which report came last matters.
pub fn numbered_report(value: i64) -> edgefleet_shared::codec::DeviceReport {
    edgefleet_shared::codec::DeviceReport {
        applied_generation: 1,
        properties: [(
            READING.to_owned(),
            edgefleet_shared::PropertyValue::Int(value),
        )]
        .into(),
        firmware_version: None,
        firmware_failure: None,
    }
}

/// Creates a fresh namespace for one test and returns its name.
/// The settings of a controller run in the test's process on `listener`,
/// minding namespace `ns`: a status budget of 200 writes per second, 50
/// device Events per second, a 2 s node grace period, and a plaintext sync
/// link (TLS is `tls: Some(…)`).
pub fn in_process_controller(
    listener: tokio::net::TcpListener,
    ns: &str,
) -> edgefleet_cloud::run::Settings {
    edgefleet_cloud::run::Settings {
        sync_listener: listener,
        status_writes_per_second: std::num::NonZeroU32::new(200).expect("nonzero"),
        status_metrics: Default::default(),
        sync_metrics: Default::default(),
        event_metrics: Default::default(),
        device_events_per_second: std::num::NonZeroU32::new(50).expect("nonzero"),
        device_event_metrics: Default::default(),
        device_key_metrics: Default::default(),
        instance: Some("test".into()),
        namespace: Some(ns.to_owned()),
        node_grace_period: Duration::from_secs(2),
        heartbeat: Default::default(),
        tls: None,
        agent_auth: edgefleet_cloud::agent_identity::AuthSettings::TrustHello,
        limits: Default::default(),
        token_recheck: edgefleet_cloud::sync::TOKEN_RECHECK,
        agent_ca: None,
        replicas: None,
        lease_metrics: Default::default(),
    }
}

/// Creates the object `name` of `api` with nothing but its name, unless it
/// exists (also when another test made it meanwhile).
pub async fn ensure_exists<K>(api: &Api<K>, name: &str) -> anyhow::Result<()>
where
    K: kube::Resource + Default + Clone + std::fmt::Debug,
    K: serde::Serialize + serde::de::DeserializeOwned,
{
    if api.get_opt(name).await?.is_some() {
        return Ok(());
    }
    let mut object = K::default();
    object.meta_mut().name = Some(name.to_owned());
    match api.create(&kube::api::PostParams::default(), &object).await {
        Ok(_) => Ok(()),
        Err(kube::Error::Api(e)) if e.code == 409 => Ok(()),
        Err(e) => Err(e.into()),
    }
}

/// An in-process agent's sync settings for `node` dialing `cloud`:
/// plaintext, no token, default heartbeats; callers set what they test.
pub fn agent_sync_settings(cloud: String, node: &str) -> edgefleet_agent::sync::SyncSettings {
    edgefleet_agent::sync::SyncSettings {
        cloud,
        tls: None,
        token_file: None,
        node: node.to_owned(),
        agent_version: "test".into(),
        boot_id: format!("boot-{node}"),
        heartbeat: Default::default(),
        silent_cloud: Default::default(),
        refused_redirects: Default::default(),
        bytes: Default::default(),
        liveness: Default::default(),
    }
}

pub async fn test_namespace(client: &Client, hint: &str) -> String {
    static NEXT: AtomicU32 = AtomicU32::new(0);
    let sanitized: String = hint
        .chars()
        .map(|c| {
            if c.is_ascii_alphanumeric() {
                c.to_ascii_lowercase()
            } else {
                '-'
            }
        })
        .take(40)
        .collect();
    let name = format!(
        "{}-{}-{}",
        sanitized.trim_matches('-'),
        std::process::id(),
        NEXT.fetch_add(1, Ordering::Relaxed)
    );
    let ns = Namespace {
        metadata: ObjectMeta {
            name: Some(name.clone()),
            ..Default::default()
        },
        ..Default::default()
    };
    Api::<Namespace>::all(client.clone())
        .create(&PostParams::default(), &ns)
        .await
        .expect("create test namespace");
    name
}

fn start() -> anyhow::Result<ControlPlane> {
    let binary = control_plane_binary()?;
    let data_dir = fresh_data_dir()?;
    let (child, stdin, kubeconfig) = spawn(&binary, &data_dir, None)?;
    let control_plane = ControlPlane {
        kubeconfig,
        data_dir,
        _stdin: Mutex::new(stdin),
        _child: Mutex::new(child),
    };
    install_crds_blocking(&control_plane.kubeconfig)?;
    Ok(control_plane)
}

/// Starts the control plane on `data_dir` (on `port` if given) and waits
/// until it is ready: its process, its stdin and its kubeconfig.
fn spawn(
    binary: &Path,
    data_dir: &Path,
    port: Option<u16>,
) -> anyhow::Result<(Child, ChildStdin, PathBuf)> {
    let log_path = data_dir.join("controlplane.log");
    // Appended to, so a restart's log follows the earlier one's.
    let log = std::fs::OpenOptions::new()
        .create(true)
        .append(true)
        .open(&log_path)?;
    let mut command = Command::new(binary);
    command.arg("--data-dir").arg(data_dir);
    if let Some(port) = port {
        command.arg(format!("--port={port}"));
    }
    let mut child = command
        .stdin(Stdio::piped())
        .stdout(Stdio::piped())
        .stderr(log)
        .spawn()
        .with_context(|| format!("spawn {}", binary.display()))?;
    let stdin = child.stdin.take().expect("piped stdin");
    let stdout = child.stdout.take().expect("piped stdout");

    match wait_ready(stdout) {
        Ok(kubeconfig) => Ok((child, stdin, kubeconfig)),
        Err(e) => {
            let _ = child.kill();
            let _ = child.wait();
            Err(e.context(format!(
                "control plane stderr:\n{}\nkube-apiserver log:\n{}\n{}",
                tail(&log_path, 20),
                tail(&data_dir.join("logs/kube-apiserver.log"), 20),
                free_space(data_dir)
            )))
        }
    }
}

/// [`install_crds`] from a thread of its own: the caller may be inside a
/// tokio runtime, where blocking on another runtime panics.
fn install_crds_blocking(kubeconfig: &Path) -> anyhow::Result<()> {
    let kubeconfig = kubeconfig.to_owned();
    std::thread::spawn(move || {
        tokio::runtime::Builder::new_current_thread()
            .enable_all()
            .build()?
            .block_on(install_crds(&kubeconfig))
    })
    .join()
    .map_err(|_| anyhow!("CRD installation panicked"))?
}

/// A control plane of one test's own, which the test may stop (SIGTERM or
/// SIGKILL) and start again: on the same data dir (etcd's data and the
/// credentials survive) and the same address, so the kubeconfig, and every
/// client made from it, stays valid across restarts. Not shared: stopping
/// [`control_plane`] would fail the other tests of the process.
#[derive(Debug)]
pub struct RestartableControlPlane {
    binary: PathBuf,
    data_dir: PathBuf,
    port: u16,
    kubeconfig: PathBuf,
    // `None` while stopped. Dropping the stdin stops the control plane too.
    running: Option<(Child, ChildStdin)>,
    starts: u32,
}

impl RestartableControlPlane {
    /// Starts a new control plane on a free port, with the CRDs and the
    /// admission policy installed. Blocks for a few seconds.
    pub fn start() -> anyhow::Result<Self> {
        let binary = control_plane_binary()?;
        let data_dir = fresh_data_dir()?;
        let port = process::free_tcp_addr().port();
        let (child, stdin, kubeconfig) = spawn(&binary, &data_dir, Some(port))?;
        let control_plane = RestartableControlPlane {
            binary,
            data_dir,
            port,
            kubeconfig,
            running: Some((child, stdin)),
            starts: 1,
        };
        install_crds_blocking(&control_plane.kubeconfig)?;
        Ok(control_plane)
    }

    /// Path of a kubeconfig with cluster-admin rights; the same file, and
    /// valid, across restarts.
    pub fn kubeconfig(&self) -> &Path {
        &self.kubeconfig
    }

    /// Where etcd's data, the certificates and the logs live.
    pub fn data_dir(&self) -> &Path {
        &self.data_dir
    }

    /// How many times it was started.
    pub fn starts(&self) -> u32 {
        self.starts
    }

    /// A new client for the calling test's tokio runtime.
    pub async fn client(&self) -> Client {
        client_from(&self.kubeconfig).await
    }

    /// Sends `signal` (SIGTERM: a clean shutdown; SIGKILL: a crash) and
    /// waits until the process is gone. Blocks; a no-op when stopped.
    pub fn stop(&mut self, signal: nix::sys::signal::Signal) -> anyhow::Result<()> {
        let Some((mut child, stdin)) = self.running.take() else {
            return Ok(());
        };
        let pid = nix::unistd::Pid::from_raw(child.id() as i32);
        nix::sys::signal::kill(pid, signal).context("signal the control plane")?;
        // It exits within 5 s of SIGTERM (its own deadline); wait a bit more.
        let deadline = std::time::Instant::now() + Duration::from_secs(15);
        let exited = loop {
            if let Some(status) = child.try_wait()? {
                break Some(status);
            }
            if std::time::Instant::now() > deadline {
                break None;
            }
            std::thread::sleep(Duration::from_millis(50));
        };
        drop(stdin);
        if exited.is_none() {
            let _ = child.kill();
            let _ = child.wait();
            bail!("the control plane did not exit within 15 s of {signal}");
        }
        Ok(())
    }

    /// Starts it again on the same data dir and port; returns once it is
    /// ready. Blocks for a few seconds.
    pub fn restart(&mut self) -> anyhow::Result<()> {
        anyhow::ensure!(self.running.is_none(), "the control plane is running");
        let (child, stdin, kubeconfig) = spawn(&self.binary, &self.data_dir, Some(self.port))?;
        anyhow::ensure!(
            kubeconfig == self.kubeconfig,
            "the restarted control plane wrote its kubeconfig to {}",
            kubeconfig.display()
        );
        self.running = Some((child, stdin));
        self.starts += 1;
        Ok(())
    }
}

impl Drop for RestartableControlPlane {
    fn drop(&mut self) {
        if let Some((mut child, stdin)) = self.running.take() {
            drop(stdin);
            let _ = child.kill();
            let _ = child.wait();
        }
    }
}

/// A client with the rights of `kubeconfig`.
pub async fn client_from(kubeconfig: &Path) -> Client {
    let kubeconfig = Kubeconfig::read_from(kubeconfig).expect("read kubeconfig");
    let config = Config::from_custom_kubeconfig(kubeconfig, &KubeConfigOptions::default())
        .await
        .expect("load kubeconfig");
    Client::try_from(config).expect("build client")
}

/// A client of the test control plane acting as `user` in `groups` (the
/// admin's impersonation), with only the rights RBAC and the Node
/// authorizer give that user.
pub async fn impersonating(user: &str, groups: &[&str]) -> Client {
    let kubeconfig = Kubeconfig::read_from(control_plane().kubeconfig()).expect("read kubeconfig");
    let mut config = Config::from_custom_kubeconfig(kubeconfig, &KubeConfigOptions::default())
        .await
        .expect("load kubeconfig");
    config.auth_info.impersonate = Some(user.to_owned());
    config.auth_info.impersonate_groups = Some(groups.iter().map(|g| (*g).to_owned()).collect());
    Client::try_from(config).expect("build client")
}

/// The binary from `$EDGEFLEET_CONTROLPLANE_BIN`, or built (or found in the
/// build cache) by `tests/controlplane/build.sh`.
fn control_plane_binary() -> anyhow::Result<PathBuf> {
    if let Some(path) = std::env::var_os("EDGEFLEET_CONTROLPLANE_BIN") {
        return Ok(PathBuf::from(path));
    }
    let script = Path::new(env!("CARGO_MANIFEST_DIR")).join("controlplane/build.sh");
    let out = Command::new("bash")
        .arg(&script)
        .stderr(Stdio::inherit())
        .output()
        .with_context(|| format!("run {}", script.display()))?;
    if !out.status.success() {
        bail!("{} failed ({})", script.display(), out.status);
    }
    Ok(PathBuf::from(String::from_utf8(out.stdout)?.trim()))
}

/// A new data directory named after this process. Directories left by
/// earlier test processes that are gone are removed first.
fn fresh_data_dir() -> anyhow::Result<PathBuf> {
    let root = std::env::temp_dir().join("edgefleet-controlplane");
    std::fs::create_dir_all(&root)?;
    for entry in std::fs::read_dir(&root)?.flatten() {
        let name = entry.file_name();
        let pid = name.to_string_lossy().split('-').next().map(str::to_owned);
        if let Some(pid) = pid
            && !Path::new("/proc").join(&pid).exists()
        {
            let _ = std::fs::remove_dir_all(entry.path());
        }
    }
    let dir = root.join(format!(
        "{}-{}",
        std::process::id(),
        std::time::SystemTime::now()
            .duration_since(std::time::UNIX_EPOCH)?
            .as_nanos()
    ));
    std::fs::create_dir_all(&dir)?;
    Ok(dir)
}

/// Waits for the control plane's `READY <kubeconfig>` line.
fn wait_ready(stdout: impl Read + Send + 'static) -> anyhow::Result<PathBuf> {
    let (tx, rx) = mpsc::channel();
    std::thread::spawn(move || {
        let mut lines = BufReader::new(stdout).lines();
        let first = lines.next();
        let _ = tx.send(first);
        // Keep draining so the child never blocks on a full pipe.
        for _ in lines {}
    });
    match rx.recv_timeout(START_TIMEOUT) {
        Ok(Some(Ok(line))) => match line.strip_prefix("READY ") {
            Some(path) => Ok(PathBuf::from(path.trim())),
            None => bail!("control plane said {line:?} instead of READY"),
        },
        Ok(Some(Err(e))) => Err(e.into()),
        Ok(None) | Err(mpsc::RecvTimeoutError::Disconnected) => {
            bail!("control plane exited before it was ready")
        }
        Err(mpsc::RecvTimeoutError::Timeout) => {
            bail!("control plane not ready after {START_TIMEOUT:?}")
        }
    }
}

/// Applies the CRDs and the admission policies, and waits until they are
/// in force: the CRDs Established, each policy refusing a bad object.
pub async fn install_crds(kubeconfig: &Path) -> anyhow::Result<()> {
    let kubeconfig = Kubeconfig::read_from(kubeconfig)?;
    let config = Config::from_custom_kubeconfig(kubeconfig, &KubeConfigOptions::default()).await?;
    let client = Client::try_from(config)?;
    let params = PatchParams::apply(FIELD_MANAGER).force();

    let api: Api<CustomResourceDefinition> = Api::all(client.clone());
    for crd in edgefleet_shared::api::crds() {
        let name = crd.metadata.name.clone().expect("CRDs are named");
        api.patch(&name, &params, &Patch::Apply(&crd))
            .await
            .with_context(|| format!("apply CRD {name}"))?;
        tokio::time::timeout(
            CRD_TIMEOUT,
            await_condition(api.clone(), &name, conditions::is_crd_established()),
        )
        .await
        .with_context(|| format!("CRD {name} not Established after {CRD_TIMEOUT:?}"))??;
    }

    for (policy, binding) in edgefleet_shared::api::policy::policies() {
        let name = policy.metadata.name.clone().expect("policies are named");
        Api::<ValidatingAdmissionPolicy>::all(client.clone())
            .patch(&name, &params, &Patch::Apply(&policy))
            .await
            .with_context(|| format!("apply the admission policy {name}"))?;
        Api::<ValidatingAdmissionPolicyBinding>::all(client.clone())
            .patch(&name, &params, &Patch::Apply(&binding))
            .await
            .with_context(|| format!("bind the admission policy {name}"))?;
    }
    let device = ApiResource::erase::<Device>(&());
    let rollout = ApiResource::erase::<edgefleet_shared::api::FleetRollout>(&());
    let probes = [
        (
            device,
            serde_json::json!({
                "spec": { "node": "probe", "model": "probe", "transport": "coap", "desired": { "x": [1] } }
            }),
        ),
        (
            rollout,
            serde_json::json!({
                "spec": { "target": { "properties": { "x": [1] } }, "selector": {} }
            }),
        ),
        (
            ApiResource::erase::<edgefleet_shared::api::EdgeRule>(&()),
            serde_json::json!({
                "spec": { "selector": {}, "when": "online", "then": { "set": { "x": [1] } } }
            }),
        ),
    ];
    for (resource, bad) in probes {
        tokio::time::timeout(CRD_TIMEOUT, await_policy_enforced(&client, &resource, bad))
            .await
            .with_context(|| {
                format!(
                    "the {} admission policy not enforced after {CRD_TIMEOUT:?}",
                    resource.kind
                )
            })??;
    }
    Ok(())
}

/// Policies take effect asynchronously; probe with a dry-run create of an
/// object (`bad`, of `resource`) the policy must refuse until it does.
async fn await_policy_enforced(
    client: &Client,
    resource: &ApiResource,
    bad: serde_json::Value,
) -> anyhow::Result<()> {
    let api: Api<DynamicObject> = Api::namespaced_with(client.clone(), "default", resource);
    let probe = DynamicObject::new("policy-probe", resource).data(bad);
    let dry_run = PostParams {
        dry_run: true,
        ..Default::default()
    };
    loop {
        match api.create(&dry_run, &probe).await {
            Err(kube::Error::Api(status))
                if status.message.contains("ValidatingAdmissionPolicy") =>
            {
                return Ok(());
            }
            Ok(_) | Err(kube::Error::Api(_)) => {
                tokio::time::sleep(Duration::from_millis(200)).await
            }
            Err(e) => return Err(e.into()),
        }
    }
}

/// Checks that the API server refused a create (`result`) at admission,
/// `422`, with a message containing each of `words`: what a person needs
/// to mend `what` was wrong.
pub fn assert_refused<T: std::fmt::Debug>(
    result: Result<T, kube::Error>,
    what: &str,
    words: &[&str],
) {
    let err = result.expect_err(&format!("{what}: the API server accepted it"));
    let kube::Error::Api(status) = err else {
        panic!("{what}: expected an API refusal, got {err:?}");
    };
    eprintln!("{what}: {}", status.message);
    assert_eq!(status.code, 422, "{what}: {status:?}");
    for word in words {
        assert!(
            status.message.contains(word),
            "{what}: refusal lacks {word:?}: {}",
            status.message
        );
    }
}

/// "free space in DIR: N MiB" — empty logs above usually mean a full disk.
fn free_space(dir: &Path) -> String {
    match nix::sys::statvfs::statvfs(dir) {
        Ok(fs) => format!(
            "free space in {}: {} MiB",
            dir.display(),
            fs.blocks_available() * fs.fragment_size() / (1024 * 1024)
        ),
        Err(e) => format!("free space in {}: unknown ({e})", dir.display()),
    }
}

pub(crate) fn tail(path: &Path, lines: usize) -> String {
    let text = std::fs::read_to_string(path).unwrap_or_default();
    let all: Vec<&str> = text.lines().collect();
    all[all.len().saturating_sub(lines)..].join("\n")
}

/// Lists a resource as the Table kubectl prints: (column names, rows of cells).
pub async fn table(client: &Client, path: &str) -> (Vec<String>, Vec<Vec<serde_json::Value>>) {
    let req = http::Request::get(path)
        .header("Accept", "application/json;as=Table;v=v1;g=meta.k8s.io")
        .body(Vec::new())
        .unwrap();
    let table: serde_json::Value = client.request(req).await.unwrap();
    let columns = table["columnDefinitions"]
        .as_array()
        .unwrap()
        .iter()
        .map(|c| c["name"].as_str().unwrap().to_owned())
        .collect();
    let rows = table["rows"]
        .as_array()
        .unwrap()
        .iter()
        .map(|r| r["cells"].as_array().unwrap().clone())
        .collect();
    (columns, rows)
}

/// Creates a `K` named `name` in `ns` whose spec is `spec` as written
/// (untyped, so a test can send what the Rust type could not hold);
/// returns the object the API server stored, or its refusal.
pub async fn create_with_spec<K>(
    client: &Client,
    ns: &str,
    name: &str,
    spec: serde_json::Value,
) -> Result<serde_json::Value, kube::Error>
where
    K: kube::Resource<DynamicType = ()>,
{
    let resource = kube::core::ApiResource::erase::<K>(&());
    let api: Api<kube::api::DynamicObject> = Api::namespaced_with(client.clone(), ns, &resource);
    let object =
        kube::api::DynamicObject::new(name, &resource).data(serde_json::json!({ "spec": spec }));
    let created = api
        .create(&kube::api::PostParams::default(), &object)
        .await?;
    Ok(created.data)
}
