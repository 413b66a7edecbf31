//! Keeps this replica's shard Leases (`coordination.k8s.io/v1`).
//!
//! Every round (a quarter of the lease duration) the keeper renews its own
//! membership Lease, lists the shard set's Leases, counts the live
//! replicas, and renews, takes or gives back shards so each replica holds
//! its fair share ([`crate::shards::plan`]). Every change of a Lease is a
//! replace carrying the `resourceVersion` it was read at, so two replicas
//! never both take a shard: the API server's optimistic concurrency is the
//! arbiter. A Lease counts as run out once it has been seen unchanged for
//! a whole lease duration on this replica's clock (as client-go judges
//! it), so clocks of different replicas need not agree.

use std::collections::HashMap;
use std::sync::Arc;
use std::time::{Duration, Instant};

use k8s_openapi::api::coordination::v1::{Lease, LeaseSpec};
use k8s_openapi::apimachinery::pkg::apis::meta::v1::{MicroTime, ObjectMeta};
use k8s_openapi::jiff::Timestamp;
use kube::api::{ListParams, PostParams};
use kube::{Api, Client, ResourceExt};

use crate::shards::{Seen, Shards, Step, plan, valid_until};

/// The label every Lease of the shard set carries.
pub const SET_LABEL: &str = "edgefleet.io/shard-set";
/// `shard` or `replica`.
const ROLE_LABEL: &str = "edgefleet.io/lease-role";
/// Where the holder of a shard serves agents (its sync URL).
pub const SERVED_AT: &str = "edgefleet.io/sync-url";

/// How this replica takes part.
#[derive(Debug, Clone)]
pub struct LeaseSettings {
    /// Where the Leases live.
    pub namespace: String,
    /// The shard set's name: every replica of one controller uses the same.
    pub set: String,
    /// This replica's name (the pod's), unique among the live replicas.
    pub replica: String,
    /// The sync URL agents are sent to for this replica's shards.
    pub serve_at: String,
    /// How long a Lease lasts without renewal.
    pub duration: Duration,
}

/// Whether `url` may be advertised to agents as this replica's sync URL:
/// an absolute URL with a host, `https` when the sync link is TLS (an
/// agent configured for TLS would refuse anything else, and must).
pub fn check_advertise_url(url: &str, tls: bool) -> Result<(), String> {
    let uri: http::Uri = url
        .parse()
        .map_err(|error| format!("--advertise-url {url:?} is not a URL: {error}"))?;
    let scheme = uri.scheme_str().map(str::to_ascii_lowercase);
    match (scheme.as_deref(), uri.host(), tls) {
        (_, None, _) => Err(format!("--advertise-url {url:?} names no host")),
        (Some("https"), Some(_), true) | (Some("http"), Some(_), false) => Ok(()),
        (_, _, true) => Err(format!(
            "--advertise-url {url:?} is not https, and the sync link is TLS: agents would be sent to plaintext (they refuse to go)"
        )),
        (_, _, false) => Err(format!(
            "--advertise-url {url:?} is not http, and the sync link is plaintext (--insecure-plaintext)"
        )),
    }
}

impl LeaseSettings {
    fn shard_lease(&self, shard: u32) -> String {
        format!("{}-shard-{shard}", self.set)
    }
    fn member_lease(&self) -> String {
        format!("{}-replica-{}", self.set, self.replica)
    }
}

/// Counters of what the keeper did.
#[derive(Debug, Clone, Default)]
pub struct LeaseMetrics {
    /// Lease operations as `op_result`: `acquire`, `renew` or `release`,
    /// then `ok`, `conflict` or `error`.
    pub operations: edgefleet_shared::telemetry::Outcomes,
    /// Shards held now.
    pub held: prometheus_client::metrics::gauge::Gauge,
    /// Live replicas seen in the last round.
    pub replicas: prometheus_client::metrics::gauge::Gauge,
}

impl LeaseMetrics {
    /// Registers the counters.
    pub fn register(&self, registry: &mut prometheus_client::registry::Registry) {
        self.operations.register(
            registry,
            "operations",
            "Shard Lease operations by outcome (op_result: acquire_ok, renew_conflict, …)",
        );
        registry.register(
            "shards_held",
            "Shards this replica holds",
            self.held.clone(),
        );
        registry.register(
            "replicas_live",
            "Live controller replicas seen",
            self.replicas.clone(),
        );
    }
}

/// What the keeper remembers of a Lease: the version it last saw and when
/// it first saw that version.
struct Observed {
    version: String,
    since: Instant,
}

/// Keeps the Leases until the process ends. `acquired` runs after each
/// shard taken (the status writer forgets what it wrote: another replica
/// may have written since).
pub async fn keep(
    client: Client,
    settings: LeaseSettings,
    shards: Arc<Shards>,
    metrics: LeaseMetrics,
    acquired: impl Fn(u32) + Send + 'static,
) {
    let api: Api<Lease> = Api::namespaced(client, &settings.namespace);
    let mut observed: HashMap<String, Observed> = HashMap::new();
    let mut round = tokio::time::interval(settings.duration / 4);
    round.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
    let mut rotation = crc32fast::hash(settings.replica.as_bytes()) as usize;
    loop {
        round.tick().await;
        shards.expire();
        metrics.held.set(shards.held().len() as i64);
        if let Err(error) = keep_member(&api, &settings).await {
            tracing::warn!(%error, "could not renew this replica's membership Lease");
        }
        let leases = match api
            .list(&ListParams::default().labels(&format!("{SET_LABEL}={}", settings.set)))
            .await
        {
            Ok(list) => list.items,
            Err(error) => {
                tracing::warn!(%error, "could not list the shard Leases; the held ones run out unless renewed");
                continue;
            }
        };
        let now = Instant::now();
        observed.retain(|name, _| leases.iter().any(|l| l.name_any() == *name));
        for lease in &leases {
            let version = lease.resource_version().unwrap_or_default();
            let entry = observed.entry(lease.name_any()).or_insert(Observed {
                version: version.clone(),
                since: now,
            });
            if entry.version != version {
                *entry = Observed {
                    version,
                    since: now,
                };
            }
        }
        let live = |lease: &Lease| {
            let holder = holder(lease);
            holder == Some(settings.replica.as_str())
                || (holder.is_some()
                    && observed
                        .get(&lease.name_any())
                        .is_some_and(|o| now.duration_since(o.since) < settings.duration))
        };
        let role = |lease: &Lease, role: &str| {
            lease.labels().get(ROLE_LABEL).map(String::as_str) == Some(role)
        };
        let replicas = 1 + leases
            .iter()
            .filter(|l| role(l, "replica") && holder(l) != Some(settings.replica.as_str()))
            .filter(|l| live(l))
            .count() as u32;
        metrics.replicas.set(i64::from(replicas));
        let by_name: HashMap<String, &Lease> = leases
            .iter()
            .filter(|l| role(l, "shard"))
            .map(|l| (l.name_any(), l))
            .collect();
        let seen: Vec<Seen> = (0..shards.count())
            .map(|shard| {
                let Some(lease) = by_name.get(&settings.shard_lease(shard)) else {
                    shards.set_served_at(shard, None);
                    return Seen::Free;
                };
                let theirs = live(lease) && holder(lease) != Some(settings.replica.as_str());
                shards.set_served_at(
                    shard,
                    theirs
                        .then(|| lease.annotations().get(SERVED_AT).cloned())
                        .flatten(),
                );
                match holder(lease) {
                    Some(h) if h == settings.replica => Seen::Mine,
                    _ if theirs => Seen::Theirs,
                    _ => Seen::Free,
                }
            })
            .collect();
        rotation = rotation.wrapping_add(1);
        for step in plan(&seen, replicas, rotation % seen.len().max(1)) {
            let (op, shard) = match step {
                Step::Renew(s) => ("renew", s),
                Step::Acquire(s) => ("acquire", s),
                Step::Release(s) => ("release", s),
            };
            let current = by_name.get(&settings.shard_lease(shard)).copied();
            if op == "release" {
                // Stop writing before the Lease says so.
                shards.set(shard, None);
            }
            let sent = Instant::now();
            let result = write_shard(&api, &settings, shard, current, step).await;
            let label = match &result {
                Ok(()) => "ok",
                Err(kube::Error::Api(status)) if status.code == 409 => "conflict",
                Err(_) => "error",
            };
            metrics.operations.inc(&format!("{op}_{label}"));
            match (step, result) {
                (Step::Renew(_) | Step::Acquire(_), Ok(())) => {
                    if !shards.holds(shard) {
                        tracing::info!(shard, replica = %settings.replica, "took shard");
                        // Before the first write may start: what this
                        // replica remembers of the shard is from before
                        // another one held it.
                        acquired(shard);
                    }
                    shards.set(shard, Some(valid_until(sent, settings.duration)));
                }
                (Step::Renew(_), Err(kube::Error::Api(status))) if status.code == 409 => {
                    tracing::warn!(shard, "another replica took the shard");
                    shards.set(shard, None);
                }
                (Step::Release(_), Ok(())) => {
                    tracing::info!(shard, "gave the shard back for a replica with fewer")
                }
                (_, Err(error)) if label == "error" => {
                    tracing::warn!(shard, op, %error, "shard Lease operation failed")
                }
                _ => {}
            }
        }
        metrics.held.set(shards.held().len() as i64);
    }
}

fn holder(lease: &Lease) -> Option<&str> {
    lease
        .spec
        .as_ref()
        .and_then(|s| s.holder_identity.as_deref())
        .filter(|h| !h.is_empty())
}

fn labels(settings: &LeaseSettings, role: &str) -> std::collections::BTreeMap<String, String> {
    [
        (SET_LABEL.to_owned(), settings.set.clone()),
        (ROLE_LABEL.to_owned(), role.to_owned()),
    ]
    .into()
}

/// Renews (or creates) this replica's membership Lease, by which the
/// others count it.
async fn keep_member(api: &Api<Lease>, settings: &LeaseSettings) -> Result<(), kube::Error> {
    let name = settings.member_lease();
    let now = MicroTime(Timestamp::now());
    let spec = LeaseSpec {
        holder_identity: Some(settings.replica.clone()),
        lease_duration_seconds: Some(settings.duration.as_secs().max(1) as i32),
        renew_time: Some(now.clone()),
        ..LeaseSpec::default()
    };
    match api.get_opt(&name).await? {
        Some(mut lease) => {
            lease.spec = Some(spec);
            api.replace(&name, &PostParams::default(), &lease).await?;
        }
        None => {
            let lease = Lease {
                metadata: ObjectMeta {
                    name: Some(name),
                    labels: Some(labels(settings, "replica")),
                    ..ObjectMeta::default()
                },
                spec: Some(LeaseSpec {
                    acquire_time: Some(now),
                    ..spec
                }),
            };
            api.create(&PostParams::default(), &lease).await?;
        }
    }
    Ok(())
}

/// One step on a shard's Lease, as read at `current` (its
/// `resourceVersion` is the precondition).
async fn write_shard(
    api: &Api<Lease>,
    settings: &LeaseSettings,
    shard: u32,
    current: Option<&Lease>,
    step: Step,
) -> Result<(), kube::Error> {
    let name = settings.shard_lease(shard);
    let now = MicroTime(Timestamp::now());
    let Some(current) = current else {
        // Nobody ever held it: the first replica to create it holds it.
        let lease = Lease {
            metadata: ObjectMeta {
                name: Some(name),
                labels: Some(labels(settings, "shard")),
                annotations: Some([(SERVED_AT.to_owned(), settings.serve_at.clone())].into()),
                ..ObjectMeta::default()
            },
            spec: Some(LeaseSpec {
                holder_identity: Some(settings.replica.clone()),
                lease_duration_seconds: Some(settings.duration.as_secs().max(1) as i32),
                acquire_time: Some(now.clone()),
                renew_time: Some(now),
                lease_transitions: Some(0),
                ..LeaseSpec::default()
            }),
        };
        return match step {
            Step::Release(_) => Ok(()),
            _ => api.create(&PostParams::default(), &lease).await.map(drop),
        };
    };
    let mut lease = current.clone();
    let spec = lease.spec.get_or_insert_with(LeaseSpec::default);
    match step {
        Step::Renew(_) => spec.renew_time = Some(now),
        Step::Acquire(_) => {
            spec.holder_identity = Some(settings.replica.clone());
            spec.lease_duration_seconds = Some(settings.duration.as_secs().max(1) as i32);
            spec.acquire_time = Some(now.clone());
            spec.renew_time = Some(now);
            spec.lease_transitions = Some(spec.lease_transitions.unwrap_or(0) + 1);
            lease
                .metadata
                .annotations
                .get_or_insert_with(Default::default)
                .insert(SERVED_AT.to_owned(), settings.serve_at.clone());
        }
        Step::Release(_) => {
            spec.holder_identity = None;
            spec.renew_time = Some(now);
        }
    }
    api.replace(&name, &PostParams::default(), &lease)
        .await
        .map(drop)
}

/// A write refused because this replica does not hold the shard it is
/// about (any more).
#[derive(Debug, thiserror::Error)]
#[error("fenced: this replica does not hold the shard Lease this write is about")]
pub struct Fenced;

/// `client`, but every request other than a read (GET: lists and watches)
/// fails with [`Fenced`] unless `allowed()` holds at the moment it is
/// sent: the parts that write for a shard (or for the singletons) use it,
/// so no code path can write after the Lease ran out.
pub fn fenced(client: Client, allowed: impl Fn() -> bool + Send + Sync + 'static) -> Client {
    let allowed = Arc::new(allowed);
    let service = tower::service_fn(move |request: http::Request<kube::client::Body>| {
        let (client, allowed) = (client.clone(), Arc::clone(&allowed));
        async move {
            if request.method() != http::Method::GET && !allowed() {
                return Err(tower::BoxError::from(Fenced));
            }
            client.send(request).await.map_err(tower::BoxError::from)
        }
    });
    Client::new(service, "default")
}

/// The clients the parts that write use: one per shard, each fenced by
/// that shard's Lease, and one fenced by the singletons' (shard 0). A lone
/// replica's are all the plain client.
#[derive(Clone)]
pub struct Fence {
    shards: Arc<Shards>,
    by_shard: Arc<Vec<Client>>,
    leader: Client,
}

impl std::fmt::Debug for Fence {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Fence")
            .field("shards", &self.shards.count())
            .finish_non_exhaustive()
    }
}

impl Fence {
    /// The clients of `shards`, built on `client`.
    pub fn new(client: Client, shards: Arc<Shards>) -> Self {
        if !shards.is_shared() {
            return Fence {
                by_shard: Arc::new(vec![client.clone()]),
                leader: client,
                shards,
            };
        }
        let by_shard = (0..shards.count())
            .map(|shard| {
                let shards = Arc::clone(&shards);
                fenced(client.clone(), move || shards.holds(shard))
            })
            .collect();
        let leader = fenced(client, {
            let shards = Arc::clone(&shards);
            move || shards.leads()
        });
        Fence {
            shards,
            by_shard: Arc::new(by_shard),
            leader,
        }
    }

    /// A lone replica's: everything is its own.
    pub fn single(client: Client) -> Self {
        Fence::new(client, Arc::new(Shards::single()))
    }

    /// What this replica holds.
    pub fn shards(&self) -> &Arc<Shards> {
        &self.shards
    }

    /// Whether this replica serves `node` now.
    pub fn serves(&self, node: &str) -> bool {
        self.shards.serves(node)
    }

    /// Whether this replica runs the singletons now.
    pub fn leads(&self) -> bool {
        self.shards.leads()
    }

    /// The client for writes about `node`.
    pub fn node(&self, node: &str) -> Client {
        self.by_shard[self.shards.of(node) as usize].clone()
    }

    /// The client for the singletons' writes.
    pub fn leader(&self) -> Client {
        self.leader.clone()
    }

    /// A stream that yields whenever a shard is taken or lost, for the
    /// reconcilers that must look again at what they now own.
    pub fn changes(&self) -> impl futures::Stream<Item = ()> + Send + 'static {
        futures::stream::unfold(self.shards.subscribe(), |mut changes| async move {
            changes.changed().await.ok()?;
            Some(((), changes))
        })
    }
}

/// Runs `task` while this replica leads (holds shard 0), and stops it as
/// soon as it does not: for the singletons that act on their own (signing
/// agents' certificates), besides their writes going through
/// [`Fence::leader`].
pub async fn while_leading<F, Fut>(fence: Fence, task: F)
where
    F: Fn() -> Fut,
    Fut: std::future::Future<Output = ()> + Send + 'static,
{
    // The shards' sender lives as long as `fence`: `changed` never fails.
    let mut changes = fence.shards().subscribe();
    let wait = Duration::from_secs(1);
    loop {
        // A shard's time also runs out without a change being told.
        while !fence.leads() {
            let _ = tokio::time::timeout(wait, changes.changed()).await;
        }
        let mut running = tokio::spawn(task());
        loop {
            tokio::select! {
                _ = tokio::time::timeout(wait, changes.changed()) => {
                    if !fence.leads() {
                        break;
                    }
                }
                _ = &mut running => {
                    // It ended on its own: started again after a pause.
                    tokio::time::sleep(wait).await;
                    break;
                }
            }
        }
        running.abort();
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_tls_replica_advertises_only_https() {
        assert_eq!(check_advertise_url("https://10.0.0.7:7443", true), Ok(()));
        assert_eq!(check_advertise_url("http://10.0.0.7:7443", false), Ok(()));
        for (url, tls) in [
            ("http://10.0.0.7:7443", true),
            ("10.0.0.7:7443", true),
            ("https://10.0.0.7:7443", false),
            ("https:///", true),
            ("not a url", true),
        ] {
            assert!(check_advertise_url(url, tls).is_err(), "{url} tls={tls}");
        }
    }

    /// A client of a server that is not there: a request that gets past
    /// the fence fails to connect.
    fn nowhere() -> Client {
        let config = kube::Config::new("http://127.0.0.1:9".parse().unwrap());
        Client::try_from(config).unwrap()
    }

    fn is_fenced(error: &kube::Error) -> bool {
        matches!(error, kube::Error::Service(e) if e.downcast_ref::<Fenced>().is_some())
    }

    #[tokio::test]
    async fn a_fenced_client_refuses_writes_but_not_reads_unless_allowed() {
        let allowed = Arc::new(std::sync::atomic::AtomicBool::new(false));
        let client = fenced(nowhere(), {
            let allowed = Arc::clone(&allowed);
            move || allowed.load(std::sync::atomic::Ordering::SeqCst)
        });
        let leases: Api<Lease> = Api::namespaced(client, "ns");
        let write = leases
            .create(&PostParams::default(), &Lease::default())
            .await;
        assert!(
            is_fenced(&write.unwrap_err()),
            "a write is refused by the fence"
        );
        let read = leases.get("x").await;
        assert!(!is_fenced(&read.unwrap_err()), "a read goes to the server");
        allowed.store(true, std::sync::atomic::Ordering::SeqCst);
        let write = leases
            .create(&PostParams::default(), &Lease::default())
            .await;
        assert!(
            !is_fenced(&write.unwrap_err()),
            "an allowed write goes to the server"
        );
    }

    #[tokio::test]
    async fn a_lone_replica_is_never_fenced() {
        let fence = Fence::single(nowhere());
        assert!(fence.serves("any-node") && fence.leads());
        let shared = Fence::new(nowhere(), Arc::new(Shards::shared(4)));
        assert!(!shared.serves("any-node") && !shared.leads());
    }
}
