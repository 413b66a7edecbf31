//! A real Kubernetes node for tests: containerd and runc from Debian's
//! packages, and a kubelet, kube-scheduler and kube-controller-manager built
//! from the same Kubernetes release as the test API server
//! (`tests/node/build.sh`). Pods really run: their images come from local
//! OCI archives ([`Node::import`]; nothing is pulled from a registry), and
//! the pod sandbox is upstream's `pause`, built from its source.
//!
//! Everything the node keeps (containerd's root and state, the kubelet's
//! root, the logs) is under one fixed directory, [`Node::dir`], so a run
//! first clears what a crashed run left behind, and the logs of the last
//! run stay there to read. The machine runs cgroup v1 and no systemd: the
//! kubelet uses the cgroupfs driver and is told not to refuse cgroup v1.

use std::path::{Path, PathBuf};
use std::process::Command;
use std::time::Duration;

use anyhow::{Context, bail};
use k8s_openapi::api::core::v1::Node as NodeObject;
use kube::{Api, Client};

use crate::process::{Process, free_tcp_addr};

/// The pod sandbox image every pod of the node starts with.
pub const SANDBOX_IMAGE: (&str, &str) = ("edgefleet.test/pause", "3.10");

/// The node's address: on the loopback interface, so traffic to the node
/// stays on this machine, but not in 127.0.0.0/8, which the kubelet refuses
/// as a node IP. From TEST-NET-1 (RFC 5737), which is never routed.
pub const NODE_IP: &str = "192.0.2.10";

/// How long the node may take to register and become Ready.
const READY_TIMEOUT: Duration = Duration::from_secs(120);

/// The directory of kubelet, kube-scheduler, kube-controller-manager and
/// pause, built (or found in the cache) by `tests/node/build.sh`.
pub fn binaries() -> anyhow::Result<PathBuf> {
    let script = Path::new(env!("CARGO_MANIFEST_DIR")).join("node/build.sh");
    let out = Command::new("bash")
        .arg(&script)
        .stderr(std::process::Stdio::inherit())
        .output()
        .with_context(|| format!("run {}", script.display()))?;
    if !out.status.success() {
        bail!("{} failed ({})", script.display(), out.status);
    }
    Ok(PathBuf::from(String::from_utf8(out.stdout)?.trim()))
}

/// Builds an OCI image archive with `deploy/image/build.sh` (see there for
/// `files`).
pub fn build_image(
    archive: &Path,
    (name, tag): (&str, &str),
    user: &str,
    entrypoint: &str,
    files: &[String],
) -> anyhow::Result<()> {
    let script = repo_root().join("deploy/image/build.sh");
    let status = Command::new("bash")
        .arg(&script)
        .arg(archive)
        .args([name, tag, user, entrypoint])
        .args(files)
        .status()
        .with_context(|| format!("run {}", script.display()))?;
    anyhow::ensure!(status.success(), "building the image {name}:{tag} failed");
    Ok(())
}

/// The workspace's root directory.
pub fn repo_root() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR"))
        .parent()
        .expect("tests/ has a parent")
        .to_owned()
}

/// A running node: containerd, the kubelet, and the scheduler and
/// controller-manager that give DaemonSets their pods. Stopped (its
/// containers killed, its mounts undone) when dropped.
#[derive(Debug)]
pub struct Node {
    name: String,
    dir: PathBuf,
    // Stopped in this order: first what creates pods, last containerd.
    processes: Vec<Process>,
}

impl Node {
    /// Where everything of the node lives.
    pub fn dir() -> PathBuf {
        std::env::temp_dir().join("edgefleet-node")
    }

    /// Starts a node called `name` against the API server of `kubeconfig`
    /// (whose credentials all of its parts use) and waits until it is
    /// Ready. Blocks: the first call on a machine builds the binaries.
    pub async fn start(kubeconfig: &Path, name: &str) -> anyhow::Result<Node> {
        let dir = Self::dir();
        clean(&dir);
        std::fs::create_dir_all(dir.join("logs"))?;
        address_on_loopback(true)?;
        let bins = tokio::task::spawn_blocking(binaries).await??;
        let mut node = Node {
            name: name.to_owned(),
            dir: dir.clone(),
            processes: Vec::new(),
        };
        let containerd = node.start_containerd()?;
        node.processes.push(containerd);
        node.wait_for_containerd().await?;

        let pause = dir.join("pause.oci.tar");
        let pause_bin = bins.join("pause");
        build_image(
            &pause,
            SANDBOX_IMAGE,
            "65535",
            "/pause",
            &[format!("{}=/pause", pause_bin.display())],
        )?;
        node.import(&pause, SANDBOX_IMAGE.0)?;

        let kubeconfig = kubeconfig.display().to_string();
        let kubelet = node.start_kubelet(&bins, &kubeconfig)?;
        node.processes.insert(0, kubelet);
        for (program, port) in [
            ("kube-scheduler", free_tcp_addr()),
            ("kube-controller-manager", free_tcp_addr()),
        ] {
            let mut args = vec![
                format!("--kubeconfig={kubeconfig}"),
                format!("--authentication-kubeconfig={kubeconfig}"),
                format!("--authorization-kubeconfig={kubeconfig}"),
                "--leader-elect=false".into(),
                "--bind-address=127.0.0.1".into(),
                format!("--secure-port={}", port.port()),
            ];
            if program == "kube-controller-manager" {
                // DaemonSets get their pods; nodes that stop reporting are
                // tainted as a real cluster does.
                args.push("--controllers=daemonset,nodelifecycle".into());
            }
            let process = node.spawn(&bins.join(program), program, &args)?;
            node.processes.insert(0, process);
        }
        let client = crate::client_from(Path::new(&kubeconfig)).await;
        node.wait_ready(&client).await?;
        Ok(node)
    }

    /// The kubelet's root directory (pods' volumes are under `pods/`).
    pub fn kubelet_dir(&self) -> PathBuf {
        self.dir.join("kubelet")
    }

    /// A file of a pod's volume as the kubelet wrote it on the node.
    pub fn pod_volume_file(&self, pod_uid: &str, kind: &str, volume: &str, file: &str) -> PathBuf {
        self.kubelet_dir()
            .join("pods")
            .join(pod_uid)
            .join("volumes")
            .join(format!("kubernetes.io~{kind}"))
            .join(volume)
            .join(file)
    }

    /// Loads the OCI archive `archive` into the node's image store as
    /// `base_name:<its tag>`, where the kubelet finds it.
    pub fn import(&self, archive: &Path, base_name: &str) -> anyhow::Result<()> {
        self.ctr(&[
            "images",
            "import",
            "--base-name",
            base_name,
            &archive.display().to_string(),
        ])
        .map(|_| ())
    }

    /// The host pid of the running container `container_id` (a pod status's
    /// `containerID` without its `containerd://`).
    pub fn container_pid(&self, container_id: &str) -> anyhow::Result<u32> {
        let tasks = self.ctr(&["tasks", "ls"])?;
        tasks
            .lines()
            .find_map(|line| {
                let mut fields = line.split_whitespace();
                (fields.next()? == container_id).then(|| fields.next()?.parse().ok())?
            })
            .with_context(|| format!("no task for container {container_id} in\n{tasks}"))
    }

    /// The last lines of a part's log (`containerd`, `kubelet`, ...).
    pub fn log_tail(&self, part: &str) -> String {
        crate::tail(&self.dir.join("logs").join(format!("{part}.log")), 30)
    }

    fn ctr(&self, args: &[&str]) -> anyhow::Result<String> {
        let out = Command::new("ctr")
            .arg("--address")
            .arg(self.socket())
            .args(["--namespace", "k8s.io"])
            .args(args)
            .output()
            .context("run ctr (Debian package containerd)")?;
        if !out.status.success() {
            bail!(
                "ctr {}: {}",
                args.join(" "),
                String::from_utf8_lossy(&out.stderr)
            );
        }
        Ok(String::from_utf8(out.stdout)?)
    }

    fn socket(&self) -> PathBuf {
        self.dir.join("containerd.sock")
    }

    fn spawn(&self, program: &Path, name: &str, args: &[String]) -> anyhow::Result<Process> {
        let log = self.dir.join("logs").join(format!("{name}.log"));
        Process::spawn_logged(program, name, args, &[], Some(&log))
    }

    fn start_containerd(&self) -> anyhow::Result<Process> {
        let dir = &self.dir;
        let cni = dir.join("cni");
        std::fs::create_dir_all(&cni)?;
        // Only host-network pods run here, which never call CNI; a
        // loopback-only network lets containerd report the network ready.
        std::fs::write(
            cni.join("10-loopback.conflist"),
            r#"{"cniVersion":"1.0.0","name":"edgefleet-test","plugins":[{"type":"loopback"}]}"#,
        )?;
        let config = format!(
            r#"version = 2
root = "{root}"
state = "{state}"
[grpc]
  address = "{socket}"
[plugins."io.containerd.internal.v1.opt"]
  path = "{opt}"
[plugins."io.containerd.grpc.v1.cri"]
  sandbox_image = "{sandbox}:{sandbox_tag}"
  # Without CAP_SYS_RESOURCE (this machine's root lacks it) runc cannot
  # give the sandbox the kubelet's negative OOM score; keep it at ours.
  restrict_oom_score_adj = true
  [plugins."io.containerd.grpc.v1.cri".cni]
    bin_dir = "/usr/lib/cni"
    conf_dir = "{cni}"
"#,
            root = dir.join("containerd/root").display(),
            state = dir.join("containerd/state").display(),
            socket = self.socket().display(),
            opt = dir.join("containerd/opt").display(),
            sandbox = SANDBOX_IMAGE.0,
            sandbox_tag = SANDBOX_IMAGE.1,
            cni = cni.display(),
        );
        let path = dir.join("containerd.toml");
        std::fs::write(&path, config)?;
        self.spawn(
            Path::new("containerd"),
            "containerd",
            &[format!("--config={}", path.display())],
        )
    }

    async fn wait_for_containerd(&self) -> anyhow::Result<()> {
        for _ in 0..100 {
            if self.ctr(&["version"]).is_ok() {
                return Ok(());
            }
            tokio::time::sleep(Duration::from_millis(100)).await;
        }
        bail!(
            "containerd did not answer within 10 s:\n{}",
            self.log_tail("containerd")
        )
    }

    fn start_kubelet(&self, bins: &Path, kubeconfig: &str) -> anyhow::Result<Process> {
        let port = free_tcp_addr().port();
        let healthz = free_tcp_addr().port();
        let config = format!(
            r#"apiVersion: kubelet.config.k8s.io/v1beta1
kind: KubeletConfiguration
address: 127.0.0.1
port: {port}
readOnlyPort: 0
healthzBindAddress: 127.0.0.1
healthzPort: {healthz}
authentication:
  anonymous: {{enabled: false}}
  webhook: {{enabled: false}}
authorization: {{mode: AlwaysAllow}}
containerRuntimeEndpoint: unix://{socket}
cgroupDriver: cgroupfs
failCgroupV1: false
failSwapOn: false
podLogsDir: {logs}
resolvConf: /etc/resolv.conf
syncFrequency: 5s
imageGCHighThresholdPercent: 100
imageGCLowThresholdPercent: 99
evictionHard:
  memory.available: 50Mi
  nodefs.available: 1%
  imagefs.available: 1%
  nodefs.inodesFree: 1%
"#,
            socket = self.socket().display(),
            logs = self.dir.join("pod-logs").display(),
        );
        let path = self.dir.join("kubelet.yaml");
        std::fs::write(&path, config)?;
        self.spawn(
            &bins.join("kubelet"),
            "kubelet",
            &[
                format!("--config={}", path.display()),
                format!("--kubeconfig={kubeconfig}"),
                format!("--root-dir={}", self.kubelet_dir().display()),
                format!("--cert-dir={}", self.dir.join("kubelet-pki").display()),
                format!("--hostname-override={}", self.name),
                format!("--node-ip={NODE_IP}"),
                "--v=2".into(),
            ],
        )
    }

    async fn wait_ready(&mut self, client: &Client) -> anyhow::Result<()> {
        let nodes: Api<NodeObject> = Api::all(client.clone());
        let deadline = tokio::time::Instant::now() + READY_TIMEOUT;
        loop {
            let exited = self
                .processes
                .iter_mut()
                .find_map(|p| p.check_running().err());
            if let Some(e) = exited {
                bail!("{e:#}\nkubelet log:\n{}", self.log_tail("kubelet"));
            }
            let node = nodes.get_opt(&self.name).await?;
            let ready = node
                .as_ref()
                .and_then(|n| n.status.as_ref()?.conditions.as_ref())
                .is_some_and(|c| c.iter().any(|c| c.type_ == "Ready" && c.status == "True"));
            if ready {
                return Ok(());
            }
            if tokio::time::Instant::now() > deadline {
                bail!(
                    "node {} not Ready within {READY_TIMEOUT:?}: {:?}\nkubelet log:\n{}",
                    self.name,
                    node.and_then(|n| n.status?.conditions),
                    self.log_tail("kubelet")
                );
            }
            tokio::time::sleep(Duration::from_millis(500)).await;
        }
    }
}

impl Drop for Node {
    fn drop(&mut self) {
        for process in &mut self.processes {
            process.kill();
        }
        stop_leftovers(&self.dir);
        let _ = address_on_loopback(false);
    }
}

/// Adds [`NODE_IP`] to the loopback interface (unless it is there), or
/// removes it.
fn address_on_loopback(present: bool) -> anyhow::Result<()> {
    let address = format!("{NODE_IP}/32");
    let shown = Command::new("ip")
        .args(["-4", "-o", "addr", "show", "dev", "lo"])
        .output()
        .context("run ip (Debian package iproute2)")?;
    let there = String::from_utf8_lossy(&shown.stdout).contains(&address);
    if there == present {
        return Ok(());
    }
    let verb = if present { "add" } else { "del" };
    let status = Command::new("ip")
        .args(["addr", verb, &address, "dev", "lo"])
        .status()?;
    anyhow::ensure!(status.success(), "ip addr {verb} {address} dev lo failed");
    Ok(())
}

/// Clears what an earlier run left in `dir`: its processes, mounts and
/// files.
fn clean(dir: &Path) {
    stop_leftovers(dir);
    let _ = std::fs::remove_dir_all(dir);
}

/// Kills the containers of pods (every process in the kubelet's pod
/// cgroups) and every process started with `dir` in its command line
/// (containerd, its shims, the kubelet), then undoes the mounts under
/// `dir`, deepest first.
fn stop_leftovers(dir: &Path) {
    for root in [
        "/sys/fs/cgroup/pids/kubepods",
        "/sys/fs/cgroup/unified/kubepods",
    ] {
        kill_cgroup_tree(Path::new(root));
    }
    let marker = dir.display().to_string();
    let me = std::process::id();
    if let Ok(entries) = std::fs::read_dir("/proc") {
        for entry in entries.flatten() {
            let Some(pid) = entry
                .file_name()
                .to_str()
                .and_then(|p| p.parse::<u32>().ok())
            else {
                continue;
            };
            let cmdline = std::fs::read(entry.path().join("cmdline")).unwrap_or_default();
            if pid != me && String::from_utf8_lossy(&cmdline).contains(&marker) {
                kill(pid);
            }
        }
    }
    let mountinfo = std::fs::read_to_string("/proc/self/mountinfo").unwrap_or_default();
    let mut mounts: Vec<&str> = mountinfo
        .lines()
        .filter_map(|l| l.split(' ').nth(4))
        .filter(|m| Path::new(m).starts_with(dir))
        .collect();
    mounts.sort_by_key(|m| std::cmp::Reverse(m.len()));
    for mount in mounts {
        let _ = nix::mount::umount2(mount, nix::mount::MntFlags::MNT_DETACH);
    }
}

fn kill_cgroup_tree(dir: &Path) {
    if let Ok(procs) = std::fs::read_to_string(dir.join("cgroup.procs")) {
        for pid in procs.lines().filter_map(|p| p.parse().ok()) {
            kill(pid);
        }
    }
    if let Ok(entries) = std::fs::read_dir(dir) {
        for entry in entries.flatten() {
            if entry.file_type().is_ok_and(|t| t.is_dir()) {
                kill_cgroup_tree(&entry.path());
            }
        }
    }
}

fn kill(pid: u32) {
    let _ = nix::sys::signal::kill(
        nix::unistd::Pid::from_raw(pid as i32),
        nix::sys::signal::Signal::SIGKILL,
    );
}
