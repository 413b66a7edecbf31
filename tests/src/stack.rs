//! The whole system on one machine, as real processes: the cloud
//! controller, one agent (with its embedded MQTT broker) per edge node, and
//! the device simulator, against a Kubernetes API server. `edgefleet-up`
//! runs it for people; `edgefleet-bench` measures it.

use std::net::SocketAddr;
use std::path::{Path, PathBuf};
use std::time::Duration;

use anyhow::{Context, bail};
use edgefleet_shared::api::Device;
use futures::{StreamExt, TryStreamExt};
use k8s_openapi::api::core::v1::{Namespace, Secret};
use kube::api::{Patch, PatchParams};
use kube::{Api, Client};

use crate::agent_tokens::{self, AgentPod};
use crate::certs::{self, LabCa};
use crate::fault::FaultProxy;
use crate::process::{Process, binary, free_tcp_addr, free_udp_addr, http_get};
use crate::round_robin::RoundRobin;

/// Field manager of the Devices the stack applies.
pub const FIELD_MANAGER: &str = "edgefleet-up";

/// What to run.
#[derive(Clone, Debug, Default)]
pub struct StackSpec {
    /// Edge node names; one agent each.
    pub nodes: Vec<String>,
    /// Namespace of the simulated fleet.
    pub namespace: String,
    /// How many simulated devices.
    pub devices: usize,
    /// Every K-th device talks MQTT (0: none).
    pub mqtt_every: usize,
    /// The cloud's status write budget.
    pub status_writes_per_second: u32,
    /// Where logs and agent stores go.
    pub dir: PathBuf,
    /// Limit the controller to the fleet's namespace (tests running side by
    /// side on one API server), or let it serve all namespaces.
    pub namespaced_controller: bool,
    /// More flags for the controller (`edgefleet-cloud run`).
    pub cloud_args: Vec<String>,
    /// More flags for every agent.
    pub agent_args: Vec<String>,
    /// Route each agent's sync connection through a [`FaultProxy`] of its
    /// own ([`Agent::proxy`]), so a test can cut it.
    pub sync_through_proxy: bool,
}

/// One edge node's agent and where it listens.
#[derive(Debug)]
pub struct Agent {
    /// The node name.
    pub node: String,
    /// CoAP (UDP).
    pub coap: SocketAddr,
    /// Its MQTT broker: the embedded one, or the external one it uses.
    pub mqtt: SocketAddr,
    /// `/metrics` and `/healthz`.
    pub metrics: SocketAddr,
    /// The proxy its sync connection goes through, with
    /// [`StackSpec::sync_through_proxy`].
    pub proxy: Option<FaultProxy>,
    args: Vec<String>,
    process: Process,
}

/// The running processes.
#[derive(Debug)]
pub struct Stack {
    /// What runs.
    pub spec: StackSpec,
    /// The controller's `/metrics`.
    pub cloud_metrics: SocketAddr,
    /// The agents.
    pub agents: Vec<Agent>,
    /// The sync link's lab CA and the controller's certificate.
    pub tls: LabCa,
    cloud_args: Vec<String>,
    kubeconfig: PathBuf,
    /// The controller, or its replicas (the first is `cloud_metrics`'s).
    clouds: Vec<Replica>,
    /// In front of the replicas, when there are several.
    service: Option<RoundRobin>,
    sim: Option<Process>,
}

/// One controller replica of a [`Stack`].
#[derive(Debug)]
pub struct Replica {
    /// Its name among the replicas (`--replica-id`).
    pub id: String,
    /// Its `/metrics`.
    pub metrics: SocketAddr,
    /// Its own sync address (agents reach it through the stack's service).
    pub sync: SocketAddr,
    process: Process,
}

/// How many shards a replicated stack's fleet is cut into.
pub const SHARDS: u32 = 6;

/// The shard Leases of a replicated stack last this long (seconds).
pub const LEASE_SECONDS: u64 = 3;

impl Stack {
    /// Starts the controller (with `kubeconfig`) and the agents, and waits
    /// until each answers on its health endpoint.
    pub async fn start(spec: StackSpec, kubeconfig: &Path) -> anyhow::Result<Stack> {
        Self::launch(spec, kubeconfig, None, 0).await
    }

    /// [`Stack::start`] with `replicas` (1 or more) controller replicas sharing the
    /// fleet through [`SHARDS`] shard Leases (in the fleet's namespace,
    /// lasting [`LEASE_SECONDS`]), behind a round-robin forwarder the
    /// agents dial, as they would a Service. Returns once every shard is
    /// held and every agent answers.
    pub async fn start_replicated(
        spec: StackSpec,
        kubeconfig: &Path,
        replicas: usize,
    ) -> anyhow::Result<Stack> {
        Self::launch(spec, kubeconfig, None, replicas).await
    }

    /// [`Stack::start`], with the agents on an external MQTT broker at
    /// `broker` (say Mosquitto) instead of each running its embedded one.
    pub async fn start_with_broker(
        spec: StackSpec,
        kubeconfig: &Path,
        broker: Option<SocketAddr>,
    ) -> anyhow::Result<Stack> {
        Self::launch(spec, kubeconfig, broker, 0).await
    }

    async fn launch(
        spec: StackSpec,
        kubeconfig: &Path,
        broker: Option<SocketAddr>,
        replicas: usize,
    ) -> anyhow::Result<Stack> {
        std::fs::create_dir_all(&spec.dir)?;
        for name in ["edgefleet-cloud", "edgefleet-agent", "edgefleet-sim"] {
            binary(name);
        }
        let (sync, cloud_metrics) = (free_tcp_addr(), free_tcp_addr());
        let tls = certs::lab(&spec.dir.join("tls"))?;
        // Each agent proves its node with the token of a pod on it.
        let client = crate::client_from(kubeconfig).await;
        ensure_namespace(&client, &spec.namespace).await?;
        let mut token_files = Vec::new();
        for node in &spec.nodes {
            let pod = AgentPod::on(&client, &spec.namespace, node).await?;
            let file = spec.dir.join(format!("{node}.token"));
            pod.write_token(&file)?;
            token_files.push(file);
        }
        let mut cloud_args = vec![
            "run".into(),
            format!("--sync-addr={sync}"),
            format!("--metrics-addr={cloud_metrics}"),
            format!(
                "--status-writes-per-second={}",
                spec.status_writes_per_second
            ),
        ];
        cloud_args.extend(certs::cloud_args(&tls));
        cloud_args.extend(agent_tokens::cloud_args(&spec.namespace));
        if spec.namespaced_controller {
            cloud_args.push(format!("--namespace={}", spec.namespace));
        }
        cloud_args.extend(spec.cloud_args.iter().cloned());
        let mut clouds = Vec::new();
        // 0: one controller without shards; n: n replicas sharing them
        // (1: a lone replica, which others may join).
        let (sync, service) = match replicas {
            0 => {
                let process = start_cloud(&spec.dir, &cloud_args, kubeconfig, 0)?;
                wait_http(cloud_metrics, "/readyz", "the cloud controller").await?;
                clouds.push(Replica {
                    id: "cloud".into(),
                    metrics: cloud_metrics,
                    sync,
                    process,
                });
                (sync, None)
            }
            n => {
                for i in 0..n {
                    let (sync, metrics) = match i {
                        0 => (sync, cloud_metrics),
                        _ => (free_tcp_addr(), free_tcp_addr()),
                    };
                    clouds.push(start_replica(
                        &spec,
                        &cloud_args,
                        kubeconfig,
                        i,
                        sync,
                        metrics,
                    )?);
                }
                for replica in &clouds {
                    wait_http(replica.metrics, "/readyz", &replica.id).await?;
                }
                wait_all_shards_held(&clouds).await?;
                let service = RoundRobin::start(clouds.iter().map(|r| r.sync).collect()).await?;
                (service.addr(), Some(service))
            }
        };

        let mut agents = Vec::new();
        for (node, token_file) in spec.nodes.iter().zip(token_files) {
            let (coap, metrics) = (free_udp_addr(), free_tcp_addr());
            let mqtt = broker.unwrap_or_else(free_tcp_addr);
            let proxy = match spec.sync_through_proxy {
                true => Some(FaultProxy::start(sync).await?),
                false => None,
            };
            let cloud = proxy.as_ref().map_or(sync, FaultProxy::addr);
            let mut args = vec![format!("--node={node}")];
            args.extend(certs::agent_args(&tls, cloud));
            args.extend([
                format!("--token-file={}", token_file.display()),
                format!("--data-dir={}", spec.dir.join(node).display()),
                format!("--coap-bind={coap}"),
                format!("--metrics-addr={metrics}"),
            ]);
            args.push(match broker {
                Some(broker) => format!("--mqtt-url=mqtt://{broker}"),
                None => format!("--mqtt-listen={mqtt}"),
            });
            args.extend(spec.agent_args.iter().cloned());
            let process = start_agent(&spec.dir, node, &args, 0)?;
            agents.push(Agent {
                node: node.clone(),
                coap,
                mqtt,
                metrics,
                proxy,
                args,
                process,
            });
        }
        for agent in &agents {
            wait_http(
                agent.metrics,
                "/healthz",
                &format!("the agent of {}", agent.node),
            )
            .await?;
        }
        Ok(Stack {
            spec,
            cloud_metrics,
            agents,
            tls,
            cloud_args,
            kubeconfig: kubeconfig.to_owned(),
            clouds,
            service,
            sim: None,
        })
    }

    /// The flags that decide the simulated fleet, the same for
    /// `edgefleet-sim devices` and `edgefleet-sim run`.
    pub fn fleet_args(&self) -> Vec<String> {
        vec![
            format!("--namespace={}", self.spec.namespace),
            format!("--devices={}", self.spec.devices),
            format!("--mqtt-every={}", self.spec.mqtt_every),
        ]
    }

    /// Creates the fleet's namespace if needed and applies its Devices
    /// (server-side apply, 16 at a time). Returns how many.
    pub async fn apply_devices(&self, client: &Client) -> anyhow::Result<usize> {
        let mut flags = self.fleet_args();
        flags.extend(self.spec.nodes.iter().map(|node| format!("--node={node}")));
        apply_sim_devices(client, &self.spec.namespace, &flags).await
    }

    /// Starts the simulator against the agents, with `extra` flags; its log
    /// goes to `sim.log`.
    pub fn start_sim(&mut self, extra: &[String]) -> anyhow::Result<()> {
        let mut args = vec!["run".to_owned()];
        args.extend(self.fleet_args());
        for agent in &self.agents {
            args.push(format!(
                "--node={}={},{}",
                agent.node, agent.coap, agent.mqtt
            ));
        }
        args.extend_from_slice(extra);
        self.sim = Some(Process::start_logged(
            "edgefleet-sim",
            &args,
            &[],
            Some(&self.spec.dir.join("sim.log")),
        )?);
        Ok(())
    }

    /// Stops the simulator (SIGTERM; it writes its final state and exits).
    pub fn stop_sim(&mut self) -> bool {
        self.sim
            .take()
            .is_some_and(|mut sim| sim.stop(Duration::from_secs(15)))
    }

    /// Fails if a process of the stack has exited.
    pub fn check_running(&mut self) -> anyhow::Result<()> {
        let mut all: Vec<&mut Process> = self.clouds.iter_mut().map(|c| &mut c.process).collect();
        all.extend(self.agents.iter_mut().map(|a| &mut a.process));
        all.extend(self.sim.as_mut());
        for process in all {
            process.check_running()?;
        }
        Ok(())
    }

    /// Kills agent `index` with SIGKILL and starts it again with the same
    /// flags, store and ports; returns once it answers `/healthz`.
    pub async fn kill_and_restart_agent(
        &mut self,
        index: usize,
        restart: u32,
    ) -> anyhow::Result<()> {
        self.kill_agent(index);
        self.start_agent_again(index, restart).await
    }

    /// Kills agent `index` with SIGKILL and leaves it down.
    pub fn kill_agent(&mut self, index: usize) {
        self.agents[index].process.kill();
    }

    /// Starts agent `index` again (after [`Stack::kill_agent`]) with the
    /// same flags, store and ports; `restart` numbers its log file. Returns
    /// once it answers `/healthz`.
    pub async fn start_agent_again(&mut self, index: usize, restart: u32) -> anyhow::Result<()> {
        let agent = &mut self.agents[index];
        agent.process = start_agent(&self.spec.dir, &agent.node, &agent.args, restart)?;
        wait_http(
            agent.metrics,
            "/healthz",
            &format!("the restarted agent of {}", agent.node),
        )
        .await
    }

    /// Where agent `index` keeps its data (its store is `store/` inside).
    pub fn agent_data_dir(&self, index: usize) -> PathBuf {
        self.spec.dir.join(&self.agents[index].node)
    }

    /// Stops agent `index`, deletes its data and starts it again on an
    /// empty store (a new edge box, or a store lost to the disk); returns
    /// once it answers `/healthz`.
    pub async fn restart_agent_with_empty_store(&mut self, index: usize) -> anyhow::Result<()> {
        let dir = self.agent_data_dir(index);
        let agent = &mut self.agents[index];
        agent.process.stop(Duration::from_secs(10));
        std::fs::remove_dir_all(&dir)?;
        agent.process = start_agent(&self.spec.dir, &agent.node, &agent.args, 1000)?;
        wait_http(
            agent.metrics,
            "/healthz",
            &format!("the agent of {} on an empty store", agent.node),
        )
        .await
    }

    /// Kills the controller with SIGKILL, runs `meanwhile` while it is
    /// down, then starts it again with the same flags; returns once it is
    /// ready.
    pub async fn kill_and_restart_cloud_after<F, Fut>(&mut self, meanwhile: F) -> anyhow::Result<()>
    where
        F: FnOnce() -> Fut,
        Fut: std::future::Future<Output = ()>,
    {
        self.clouds[0].process.kill();
        meanwhile().await;
        self.clouds[0].process =
            start_cloud(&self.spec.dir, &self.cloud_args, &self.kubeconfig, 1)?;
        wait_http(
            self.cloud_metrics,
            "/readyz",
            "the restarted cloud controller",
        )
        .await
    }

    /// The value of `sample` (a metric name with its labels) on agent
    /// `index`'s `/metrics`; 0 when absent or unreachable.
    pub async fn agent_metric(&self, index: usize, sample: &str) -> f64 {
        let body = crate::process::http_get(self.agents[index].metrics, "/metrics")
            .await
            .map(|(_, body)| body)
            .unwrap_or_default();
        crate::process::metric(&body, sample)
    }

    /// Resident memory of the controller and of each agent, in bytes.
    pub fn memory(&self) -> (Option<u64>, Vec<Option<u64>>) {
        (
            self.clouds[0].process.rss_bytes(),
            self.agents.iter().map(|a| a.process.rss_bytes()).collect(),
        )
    }

    /// Stops everything: the simulator, then the agents, then the cloud.
    pub fn shutdown(mut self) {
        self.stop_sim();
        for agent in &mut self.agents {
            agent.process.stop(Duration::from_secs(10));
        }
        for cloud in &mut self.clouds {
            cloud.process.stop(Duration::from_secs(10));
        }
    }

    /// The controller replicas.
    pub fn replicas(&self) -> &[Replica] {
        &self.clouds
    }

    /// Kills replica `index` with SIGKILL (it stays down; the service
    /// skips it).
    pub fn kill_replica(&mut self, index: usize) {
        self.clouds[index].process.kill();
    }

    /// Freezes replica `index` (SIGSTOP) or lets it go on (SIGCONT).
    pub fn freeze_replica(&mut self, index: usize, frozen: bool) -> anyhow::Result<()> {
        use nix::sys::signal::Signal;
        let signal = if frozen {
            Signal::SIGSTOP
        } else {
            Signal::SIGCONT
        };
        self.clouds[index].process.signal(signal)
    }

    /// Starts one more replica behind the service; returns once it is
    /// ready (not once it holds shards).
    pub async fn add_replica(&mut self) -> anyhow::Result<()> {
        let service = self.service.as_ref().context("a replicated stack")?;
        let (sync, metrics) = (free_tcp_addr(), free_tcp_addr());
        let index = self.clouds.len();
        let replica = start_replica(
            &self.spec,
            &self.cloud_args,
            &self.kubeconfig,
            index,
            sync,
            metrics,
        )?;
        wait_http(metrics, "/readyz", &replica.id).await?;
        service.add(sync);
        self.clouds.push(replica);
        Ok(())
    }

    /// The value of `sample` on replica `index`'s `/metrics`; 0 when
    /// absent or unreachable.
    pub async fn replica_metric(&self, index: usize, sample: &str) -> f64 {
        let body = crate::process::http_get(self.clouds[index].metrics, "/metrics")
            .await
            .map(|(_, body)| body)
            .unwrap_or_default();
        crate::process::metric(&body, sample)
    }
}

/// Starts replica `index` of a replicated stack on its own ports.
fn start_replica(
    spec: &StackSpec,
    cloud_args: &[String],
    kubeconfig: &Path,
    index: usize,
    sync: SocketAddr,
    metrics: SocketAddr,
) -> anyhow::Result<Replica> {
    let id = format!("replica-{index}");
    let mut args: Vec<String> = cloud_args
        .iter()
        .filter(|a| !a.starts_with("--sync-addr=") && !a.starts_with("--metrics-addr="))
        .cloned()
        .collect();
    args.extend([
        format!("--sync-addr={sync}"),
        format!("--metrics-addr={metrics}"),
        format!("--shards={SHARDS}"),
        format!("--replica-id={id}"),
        format!("--instance={id}"),
        format!("--advertise-url=https://{sync}"),
        format!("--lease-namespace={}", spec.namespace),
        format!("--lease-duration-seconds={LEASE_SECONDS}"),
    ]);
    let env = [("KUBECONFIG", kubeconfig.display().to_string())];
    let log = spec.dir.join(format!("{id}.log"));
    let process = Process::start_logged("edgefleet-cloud", &args, &env, Some(&log))?;
    Ok(Replica {
        id,
        metrics,
        sync,
        process,
    })
}

/// Waits until the replicas together hold every shard.
async fn wait_all_shards_held(clouds: &[Replica]) -> anyhow::Result<()> {
    let deadline = tokio::time::Instant::now() + Duration::from_secs(60);
    loop {
        let mut held = 0.0;
        for replica in clouds {
            let body = http_get(replica.metrics, "/metrics")
                .await
                .map(|(_, body)| body)
                .unwrap_or_default();
            held += crate::process::metric(&body, "edgefleet_cloud_leases_shards_held");
        }
        if held >= f64::from(SHARDS) {
            return Ok(());
        }
        if tokio::time::Instant::now() > deadline {
            bail!("the replicas hold {held} of {SHARDS} shards after 60 s");
        }
        tokio::time::sleep(Duration::from_millis(200)).await;
    }
}

/// Starts the controller; its log is `cloud.log` (`cloud-<restart>.log` for
/// a restart).
fn start_cloud(
    dir: &Path,
    args: &[String],
    kubeconfig: &Path,
    restart: u32,
) -> anyhow::Result<Process> {
    let log = match restart {
        0 => dir.join("cloud.log"),
        n => dir.join(format!("cloud-{n}.log")),
    };
    let env = [("KUBECONFIG", kubeconfig.display().to_string())];
    Process::start_logged("edgefleet-cloud", args, &env, Some(&log))
}

/// Starts an agent; its log is `agent-<node>.log` (`…-<restart>.log` for
/// a restart).
fn start_agent(dir: &Path, node: &str, args: &[String], restart: u32) -> anyhow::Result<Process> {
    let log = match restart {
        0 => dir.join(format!("agent-{node}.log")),
        n => dir.join(format!("agent-{node}-{n}.log")),
    };
    Process::start_logged("edgefleet-agent", args, &[], Some(&log))
}

/// What `edgefleet-sim devices` prints: the Devices and their key Secrets.
#[derive(Debug)]
pub struct SimManifests {
    /// The Device resources.
    pub devices: Vec<Device>,
    /// The Secrets with the devices' keys.
    pub secrets: Vec<Secret>,
}

/// Runs `edgefleet-sim devices` with `flags` (which name the namespace,
/// the fleet and its nodes) and reads what it prints.
pub fn sim_manifests(flags: &[String]) -> anyhow::Result<SimManifests> {
    let out = std::process::Command::new(binary("edgefleet-sim"))
        .arg("devices")
        .args(flags)
        .output()
        .context("run edgefleet-sim devices")?;
    if !out.status.success() {
        bail!(
            "edgefleet-sim devices failed: {}",
            String::from_utf8_lossy(&out.stderr)
        );
    }
    let mut manifests = SimManifests {
        devices: Vec::new(),
        secrets: Vec::new(),
    };
    for line in String::from_utf8(out.stdout)?.lines() {
        if !line.starts_with('{') {
            continue;
        }
        let document: serde_json::Value = serde_json::from_str(line)?;
        match document["kind"].as_str() {
            Some("Device") => manifests.devices.push(serde_json::from_value(document)?),
            Some("Secret") => manifests.secrets.push(serde_json::from_value(document)?),
            other => bail!("edgefleet-sim devices printed a {other:?}"),
        }
    }
    Ok(manifests)
}

/// Creates `namespace` if needed and applies the Devices and key Secrets
/// `edgefleet-sim devices` prints with `flags` (which name that namespace,
/// the fleet and its nodes): server-side apply, 16 at a time. Returns how
/// many Devices.
pub async fn apply_sim_devices(
    client: &Client,
    namespace: &str,
    flags: &[String],
) -> anyhow::Result<usize> {
    ensure_namespace(client, namespace).await?;
    let SimManifests { devices, secrets } = sim_manifests(flags)?;
    let applied = devices.len();
    // Keys first, so a device's key is at its agent about when its Device is.
    apply_all(&Api::namespaced(client.clone(), namespace), secrets).await?;
    apply_all(&Api::namespaced(client.clone(), namespace), devices).await?;
    Ok(applied)
}

/// Applies every object (server-side, 16 at a time).
async fn apply_all<K>(api: &Api<K>, objects: Vec<K>) -> anyhow::Result<()>
where
    K: kube::Resource + Clone + serde::Serialize + serde::de::DeserializeOwned + std::fmt::Debug,
{
    let params = PatchParams::apply(FIELD_MANAGER).force();
    futures::stream::iter(objects)
        .map(|object| {
            let (api, params) = (api.clone(), params.clone());
            async move {
                let name = object.meta().name.clone().unwrap_or_default();
                api.patch(&name, &params, &Patch::Apply(&object))
                    .await
                    .with_context(|| format!("apply {name}"))
            }
        })
        .buffer_unordered(16)
        .try_for_each(|_| async { Ok(()) })
        .await
}

/// Creates `namespace` unless it exists.
pub async fn ensure_namespace(client: &Client, namespace: &str) -> anyhow::Result<()> {
    crate::ensure_exists(&Api::<Namespace>::all(client.clone()), namespace).await
}

async fn wait_http(addr: SocketAddr, path: &str, what: &str) -> anyhow::Result<()> {
    let deadline = tokio::time::Instant::now() + Duration::from_secs(60);
    loop {
        if let Ok((200, _)) = http_get(addr, path).await {
            return Ok(());
        }
        if tokio::time::Instant::now() > deadline {
            bail!("{what} did not answer {path} on {addr} within 60 s");
        }
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
}
