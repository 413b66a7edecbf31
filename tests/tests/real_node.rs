//! The agent deployed the way operators deploy it, on a real node: a kubelet
//! with containerd and runc runs the agent's DaemonSet from `deploy/` as it
//! is (only the cloud's address is set for this cluster), with the agent's
//! image built from the release binary and loaded like at a site without a
//! registry. The controller runs in the test process with TLS, and takes
//! agents only with a token of their pod.
//!
//! What it shows: the DaemonSet lands only on the node labelled
//! `edgefleet.io/edge=true`; the agent runs as non-root on a read-only root
//! filesystem, with the host's network and the hostPath store; its probes
//! pass; it proves its node with the token the kubelet projected; simulated
//! devices talking to the node's address get their desired state and reach
//! `Applied`. Then the pod is deleted: its token is refused from then on,
//! the DaemonSet brings a new pod, and that pod resumes from the same store
//! and serves the devices' next desired state.
//!
//! Slow (it builds the kubelet once per machine and the release agent), so it
//! is a test target of its own, run by `make test` like the others.

use std::os::unix::fs::MetadataExt;
use std::path::Path;
use std::time::Duration;

use edgefleet_agent::store::Store;
use edgefleet_agent::sync::{self, CloudTls, SyncError, SyncSettings};
use edgefleet_cloud::agent_identity::{AuthSettings, REVIEW_TTL};
use edgefleet_cloud::run::{Controller, Settings};
use edgefleet_cloud::tls::TlsSettings;
use edgefleet_shared::api::{Device, DevicePhase, EdgeNode};
use edgefleet_tests::manifests::{Manifest, apply, find, install_manifests, manifests};
use edgefleet_tests::node::{Node, build_image, repo_root};
use edgefleet_tests::process::Process;
use edgefleet_tests::stack::apply_sim_devices;
use edgefleet_tests::{
    FIELD_MANAGER, certs, control_plane, eventually_within, in_process_controller, test_namespace,
};
use k8s_openapi::api::apps::v1::DaemonSet;
use k8s_openapi::api::core::v1::{ConfigMap, Container, Node as NodeObject, Pod};
use kube::api::{DeleteParams, ListParams, ObjectMeta, Patch, PatchParams};
use kube::{Api, Client};
use serde_json::json;

const NODE: &str = "edgefleet-real-node";
const SYSTEM_NAMESPACE: &str = "edgefleet-system";
const AGENT: &str = "edgefleet-agent";
/// The DaemonSet's hostPath for the store.
const STORE_DIR: &str = "/var/lib/edgefleet";
/// The agent's user in the DaemonSet.
const AGENT_UID: u32 = 65532;
const DEVICES: usize = 4;
/// Pulling nothing, a pod starts in seconds; the first start on a machine
/// also waits for the kubelet's first sync.
const POD_PATIENCE: Duration = Duration::from_secs(120);

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_agent_daemonset_runs_on_a_real_node_proves_its_node_and_resumes_from_its_store() {
    let control_plane = control_plane();
    let client = control_plane.client().await;
    let work = tempfile::tempdir().unwrap();

    // The images, built here and loaded as at a site without a registry.
    let install = install_manifests();
    let daemonset: DaemonSet = find(&install, "DaemonSet", AGENT).typed();
    let agent_container = container(&daemonset, "agent", false);
    let init_container = container(&daemonset, "own-data-dir", true);
    let agent_image = work.path().join("agent.oci.tar");
    let (name, tag) = image_ref(&agent_container);
    let (archive, name, tag) = (agent_image.clone(), name.to_owned(), tag.to_owned());
    tokio::task::spawn_blocking(move || build_agent_image(&archive, (&name, &tag)))
        .await
        .unwrap();
    // The init container's busybox, from Debian's busybox-static (its
    // applets need no PATH): only `sh`, `stat`, `chmod` and `chown` are used.
    let busybox = work.path().join("busybox.oci.tar");
    build_image(
        &busybox,
        image_ref(&init_container),
        "0",
        "/bin/sh",
        &["/bin/busybox=/bin/sh".into()],
    )
    .unwrap();

    // A fresh node; its store directory starts empty.
    match std::fs::remove_dir_all(STORE_DIR) {
        Ok(()) => {}
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => {}
        Err(e) => panic!("clear {STORE_DIR}: {e}"),
    }
    let node = Node::start(control_plane.kubeconfig(), NODE).await.unwrap();
    node.import(&agent_image, image_ref(&agent_container).0)
        .unwrap();
    node.import(&busybox, image_ref(&init_container).0).unwrap();

    // The controller: TLS from a lab CA, agents proven by their pod's token.
    let ns = test_namespace(&client, "real-node").await;
    let lab = certs::lab(&work.path().join("tls")).unwrap();
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let controller = Controller::start(
        client.clone(),
        Settings {
            tls: Some(TlsSettings {
                dir: lab.dir().to_owned(),
                reload_every: Duration::from_secs(1),
            }),
            agent_auth: AuthSettings::ServiceAccount {
                namespace: SYSTEM_NAMESPACE.into(),
                name: AGENT.into(),
            },
            ..in_process_controller(listener, &ns)
        },
    )
    .await
    .unwrap();
    let cloud = format!("https://{}", controller.sync_addr);

    // The install: the Namespace and the agent's manifests as they are,
    // with this cluster's cloud address, and the CA ConfigMap.
    apply_all(&client, &[find(&install, "Namespace", SYSTEM_NAMESPACE)]).await;
    let agent_manifests = manifests("agent", &[]);
    let account = find(&agent_manifests, "ServiceAccount", AGENT);
    apply_all(&client, &[account]).await;
    let ca = std::fs::read_to_string(lab.ca_file()).unwrap();
    let configmaps: Api<ConfigMap> = Api::namespaced(client.clone(), SYSTEM_NAMESPACE);
    let ca_map = ConfigMap {
        metadata: ObjectMeta {
            name: Some("edgefleet-sync-ca".into()),
            ..Default::default()
        },
        data: Some([("ca.crt".to_owned(), ca)].into()),
        ..Default::default()
    };
    configmaps
        .patch(
            "edgefleet-sync-ca",
            &PatchParams::apply(FIELD_MANAGER),
            &Patch::Apply(&ca_map),
        )
        .await
        .unwrap();
    let daemonsets: Api<DaemonSet> = Api::namespaced(client.clone(), SYSTEM_NAMESPACE);
    let mut daemonset = daemonset;
    set_env(&mut daemonset, "EDGEFLEET_CLOUD", &cloud);
    daemonsets
        .patch(
            AGENT,
            &PatchParams::apply(FIELD_MANAGER),
            &Patch::Apply(&daemonset),
        )
        .await
        .unwrap();

    // The node is not labelled yet: the DaemonSet wants no pod anywhere.
    let status = eventually_within(POD_PATIENCE, "the DaemonSet controller saw it", || async {
        let ds = daemonsets.get(AGENT).await.ok()?;
        let status = ds.status?;
        (status.observed_generation == ds.metadata.generation).then_some(status)
    })
    .await;
    assert_eq!(status.desired_number_scheduled, 0, "{status:?}");
    let pods: Api<Pod> = Api::namespaced(client.clone(), SYSTEM_NAMESPACE);
    let selector = ListParams::default().labels("app.kubernetes.io/name=edgefleet-agent");
    assert!(pods.list(&selector).await.unwrap().items.is_empty());

    // Labelled as an edge node, it gets the agent.
    let nodes: Api<NodeObject> = Api::all(client.clone());
    nodes
        .patch(
            NODE,
            &PatchParams::default(),
            &Patch::Merge(json!({"metadata": {"labels": {"edgefleet.io/edge": "true"}}})),
        )
        .await
        .unwrap();
    let pod = ready_pod(&pods, &selector, None, &node).await;
    assert_eq!(pod_node(&pod), NODE);

    // Non-root, read-only root filesystem, the store on the host.
    let pid = node.container_pid(&agent_container_id(&pod)).unwrap();
    let uids = proc_field(pid, "status", "Uid:");
    assert_eq!(
        uids,
        format!("{AGENT_UID}\t{AGENT_UID}\t{AGENT_UID}\t{AGENT_UID}"),
        "the agent's uids"
    );
    assert!(
        root_mount_options(pid).split(',').any(|o| o == "ro"),
        "the agent's root filesystem is writable: {}",
        root_mount_options(pid)
    );
    let store_dir = std::fs::metadata(STORE_DIR).unwrap();
    assert_eq!(
        (store_dir.uid(), store_dir.gid()),
        (AGENT_UID, AGENT_UID),
        "the init container hands the hostPath to the agent"
    );
    assert!(Path::new(STORE_DIR).join("store").is_dir());

    // It proved its node with the projected token: an EdgeNode for it.
    eventually_within(POD_PATIENCE, "the agent is authenticated", || async {
        (controller.sync_metrics.authentications.get("token") >= 1).then_some(())
    })
    .await;
    let edge_nodes: Api<EdgeNode> = Api::all(client.clone());
    assert!(edge_nodes.get_opt(NODE).await.unwrap().is_some());

    // Devices talk to the node's address and reach Applied.
    let address = node_address(&nodes).await;
    let devices: Api<Device> = Api::namespaced(client.clone(), &ns);
    let applied = apply_sim_devices(
        &client,
        &ns,
        &[
            format!("--namespace={ns}"),
            format!("--devices={DEVICES}"),
            "--mqtt-every=2".into(),
            "--models=thermostat".into(),
            format!("--node={NODE}"),
        ],
    )
    .await
    .unwrap();
    assert_eq!(applied, DEVICES);
    let mut sim = Process::start_logged(
        "edgefleet-sim",
        &[
            "run".into(),
            format!("--namespace={ns}"),
            format!("--devices={DEVICES}"),
            "--mqtt-every=2".into(),
            "--models=thermostat".into(),
            format!(
                "--node={NODE}={address}:{},{address}:{}",
                host_port(&agent_container, "coap"),
                host_port(&agent_container, "mqtt")
            ),
            "--report-interval=2s".into(),
        ],
        &[],
        Some(&work.path().join("sim.log")),
    )
    .unwrap();
    all_applied(&devices, "every Device is Applied through the agent's pod").await;

    // The pod is deleted. The DaemonSet brings a new one, which resumes
    // from the same store: its Hello's store and holdings are the ones the
    // controller saw acknowledged.
    let old_token = std::fs::read_to_string(node.pod_volume_file(
        pod_uid(&pod),
        "projected",
        "identity",
        "token",
    ))
    .unwrap();
    let remembered = controller.sync_metrics.hellos.get("remembered");
    pods.delete(pod_name(&pod), &DeleteParams::default())
        .await
        .unwrap();
    let deleted_at = tokio::time::Instant::now();
    let next = ready_pod(&pods, &selector, Some(pod_uid(&pod)), &node).await;
    assert_eq!(pod_node(&next), NODE);
    eventually_within(
        POD_PATIENCE,
        "the new pod resumes from the store",
        || async { (controller.sync_metrics.hellos.get("remembered") > remembered).then_some(()) },
    )
    .await;

    // The deleted pod's token is refused (once the cached review expired).
    tokio::time::sleep_until(deleted_at + REVIEW_TTL + Duration::from_secs(1)).await;
    let invalid = controller.sync_metrics.authentications.get("invalid_token");
    let refused = replay_token(&cloud, &lab.ca_file(), &old_token, work.path()).await;
    assert!(
        matches!(&refused, SyncError::Stream(s) if s.code() == tonic::Code::Unauthenticated),
        "the deleted pod's token was not refused: {refused}"
    );
    assert_eq!(
        controller.sync_metrics.authentications.get("invalid_token"),
        invalid + 1
    );

    // The new pod serves the devices' next desired state.
    for device in devices.list(&ListParams::default()).await.unwrap() {
        let name = device.metadata.name.clone().unwrap();
        let patched = devices
            .patch(
                &name,
                &PatchParams::default(),
                &Patch::Merge(json!({"spec": {"desired": {"setpoint": 17.25}}})),
            )
            .await
            .unwrap();
        assert!(patched.metadata.generation > device.metadata.generation);
    }
    all_applied(
        &devices,
        "every Device's next generation is Applied by the new pod",
    )
    .await;
    sim.assert_running();
    drop(sim);
    drop(controller);
    drop(node);
}

/// Builds the agent's image from the release binary with `make image`.
fn build_agent_image(archive: &Path, (name, tag): (&str, &str)) {
    let status = std::process::Command::new("make")
        .arg("-C")
        .arg(repo_root())
        .arg("-s")
        .arg("image")
        .arg(format!("AGENT_IMAGE={name}"))
        .arg(format!("AGENT_TAG={tag}"))
        .arg(format!("IMAGE_OUT={}", archive.display()))
        .status()
        .expect("run make image");
    assert!(status.success(), "make image failed");
}

async fn apply_all(client: &Client, manifests: &[&Manifest]) {
    for manifest in manifests {
        apply(client, &manifest.object, &PatchParams::apply(FIELD_MANAGER))
            .await
            .unwrap_or_else(|e| panic!("apply {}: {e}", manifest.origin));
    }
}

fn container(daemonset: &DaemonSet, name: &str, init: bool) -> Container {
    let spec = daemonset
        .spec
        .as_ref()
        .and_then(|s| s.template.spec.as_ref())
        .expect("a pod template");
    let list = if init {
        spec.init_containers.clone().unwrap_or_default()
    } else {
        spec.containers.clone()
    };
    list.into_iter()
        .find(|c| c.name == name)
        .unwrap_or_else(|| panic!("no container {name} in the DaemonSet"))
}

/// `registry/name:tag` as (`registry/name`, `tag`).
fn image_ref(container: &Container) -> (&str, &str) {
    let image = container.image.as_deref().expect("an image");
    image.rsplit_once(':').expect("an image with a tag")
}

fn set_env(daemonset: &mut DaemonSet, name: &str, value: &str) {
    let spec = daemonset
        .spec
        .as_mut()
        .and_then(|s| s.template.spec.as_mut())
        .expect("a pod template");
    let agent = spec
        .containers
        .iter_mut()
        .find(|c| c.name == "agent")
        .expect("the agent container");
    let var = agent
        .env
        .iter_mut()
        .flatten()
        .find(|v| v.name == name)
        .unwrap_or_else(|| panic!("the agent container sets no {name}"));
    var.value = Some(value.to_owned());
}

fn host_port(container: &Container, name: &str) -> i32 {
    container
        .ports
        .iter()
        .flatten()
        .find(|p| p.name.as_deref() == Some(name))
        .and_then(|p| p.host_port)
        .unwrap_or_else(|| panic!("no host port {name}"))
}

/// The Ready pod of the DaemonSet on the node, other than `not`; fails
/// with the kubelet's log if none comes.
async fn ready_pod(pods: &Api<Pod>, selector: &ListParams, not: Option<&str>, node: &Node) -> Pod {
    let deadline = tokio::time::Instant::now() + POD_PATIENCE;
    loop {
        let list = pods.list(selector).await.unwrap();
        let ready = list.items.iter().find(|p| {
            Some(pod_uid(p)) != not
                && p.metadata.deletion_timestamp.is_none()
                && p.status
                    .as_ref()
                    .and_then(|s| s.conditions.as_ref())
                    .is_some_and(|c| c.iter().any(|c| c.type_ == "Ready" && c.status == "True"))
        });
        if let Some(pod) = ready {
            let restarts: i32 = pod
                .status
                .as_ref()
                .and_then(|s| s.container_statuses.as_ref())
                .map(|c| c.iter().map(|c| c.restart_count).sum())
                .unwrap_or_default();
            assert_eq!(restarts, 0, "the agent restarted: {pod:?}");
            return pod.clone();
        }
        assert!(
            tokio::time::Instant::now() < deadline,
            "no Ready agent pod within {POD_PATIENCE:?}: {:?}\nkubelet log:\n{}",
            list.items.iter().map(|p| &p.status).collect::<Vec<_>>(),
            node.log_tail("kubelet")
        );
        tokio::time::sleep(Duration::from_millis(500)).await;
    }
}

fn pod_uid(pod: &Pod) -> &str {
    pod.metadata.uid.as_deref().expect("a uid")
}

fn pod_name(pod: &Pod) -> &str {
    pod.metadata.name.as_deref().expect("a name")
}

fn pod_node(pod: &Pod) -> &str {
    pod.spec
        .as_ref()
        .and_then(|s| s.node_name.as_deref())
        .unwrap_or_default()
}

fn agent_container_id(pod: &Pod) -> String {
    let status = pod
        .status
        .as_ref()
        .and_then(|s| s.container_statuses.as_ref())
        .and_then(|c| c.iter().find(|c| c.name == "agent"))
        .expect("the agent's container status");
    let id = status.container_id.as_deref().expect("a container id");
    id.strip_prefix("containerd://").unwrap_or(id).to_owned()
}

/// The value of a `Field:` line of `/proc/<pid>/<file>`.
fn proc_field(pid: u32, file: &str, field: &str) -> String {
    let text = std::fs::read_to_string(format!("/proc/{pid}/{file}")).unwrap();
    text.lines()
        .find_map(|l| l.strip_prefix(field))
        .unwrap_or_else(|| panic!("no {field} in /proc/{pid}/{file}"))
        .trim()
        .to_owned()
}

/// The mount options of the process's root filesystem, as it sees it.
fn root_mount_options(pid: u32) -> String {
    let text = std::fs::read_to_string(format!("/proc/{pid}/mountinfo")).unwrap();
    text.lines()
        .map(|l| l.split(' ').collect::<Vec<_>>())
        .find(|f| f.get(4) == Some(&"/"))
        .and_then(|f| f.get(5).map(|o| o.to_string()))
        .expect("a root mount")
}

/// The node's InternalIP, as the kubelet reports it.
async fn node_address(nodes: &Api<NodeObject>) -> String {
    let node = nodes.get(NODE).await.unwrap();
    node.status
        .and_then(|s| s.addresses)
        .into_iter()
        .flatten()
        .find(|a| a.type_ == "InternalIP")
        .map(|a| a.address)
        .expect("the node reports its InternalIP")
}

async fn all_applied(devices: &Api<Device>, what: &str) {
    eventually_within(POD_PATIENCE, what, || async {
        let list = devices.list(&ListParams::default()).await.ok()?;
        let applied = list
            .items
            .iter()
            .filter(|d| {
                d.status.as_ref().is_some_and(|s| {
                    s.phase == Some(DevicePhase::Applied)
                        && s.applied_generation == d.metadata.generation
                })
            })
            .count();
        (list.items.len() == DEVICES && applied == DEVICES).then_some(())
    })
    .await;
}

/// One sync session as NODE with `token`, as anyone holding it could try:
/// what ended it.
async fn replay_token(cloud: &str, ca_file: &Path, token: &str, dir: &Path) -> SyncError {
    let token_file = dir.join("old-token");
    std::fs::write(&token_file, token).unwrap();
    let store = Store::open(&dir.join("replay-store")).unwrap().store;
    let settings = SyncSettings {
        tls: Some(CloudTls {
            ca_file: ca_file.to_owned(),
            server_name: None,
            client_certificate: None,
        }),
        token_file: Some(token_file),
        ..edgefleet_tests::agent_sync_settings(cloud.to_owned(), NODE)
    };
    let mut opened = false;
    match tokio::time::timeout(
        Duration::from_secs(30),
        sync::session(&settings, &store, &mut opened),
    )
    .await
    {
        Ok(Err(error)) => error,
        Ok(Ok(())) => panic!("the cloud served a session for the deleted pod's token"),
        Err(_) => panic!("the session with the deleted pod's token was neither refused nor ended"),
    }
}
