//! Device keys, from Secrets to the agents (see
//! [`edgefleet_shared::credential`]).
//!
//! A key goes to the agent of its Device's node, as the resource
//! `credential/<namespace>/<device>`, when exactly one valid Secret claims
//! the Device. It leaves that agent when the Secret is deleted (revocation),
//! when the Device is deleted or moves to another node, or when a second
//! Secret claims the same Device (ambiguous: refused until one goes). A
//! rotated key is a new version and replaces the old one.
//!
//! [`Join`] is the pure part: what each Device's credential is, from what
//! was seen of Secrets and Devices. Each change touches one Device's entry.

use std::collections::{BTreeMap, BTreeSet, HashMap};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use edgefleet_shared::ResourceKey;
use edgefleet_shared::api::Device;
use edgefleet_shared::credential::{self, DEVICE_LABEL, PSK_KEY, Psk, SECRET_TYPE};
use edgefleet_shared::proto::{self, resource};
use edgefleet_shared::telemetry::Outcomes;
use futures::StreamExt;
use k8s_openapi::api::core::v1::Secret;
use kube::runtime::{WatchStreamExt, watcher};
use kube::{Api, Resource, ResourceExt};

use crate::events::{Events, Note};
use crate::index::{Index, Indexed};

/// One Secret's claim on a Device.
#[derive(Clone, Debug)]
struct Claim {
    device: ResourceKey,
    uid: String,
    psk: Result<Psk, String>,
}

/// What became of a device Secret.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Judgement {
    /// Its key is its Device's credential.
    Taken,
    /// It has no [`DEVICE_LABEL`]: it is for no device.
    Unlabelled,
    /// Its key is not a valid key, for this reason.
    Refused(String),
    /// These other Secrets claim the same Device, which gets no key.
    Ambiguous(Vec<String>),
}

impl Judgement {
    /// The counter label.
    pub fn label(&self) -> &'static str {
        match self {
            Judgement::Taken => "taken",
            Judgement::Unlabelled => "unlabelled",
            Judgement::Refused(_) => "refused",
            Judgement::Ambiguous(_) => "ambiguous",
        }
    }

    /// The Event about the Secret, for all but a key taken.
    fn note(&self) -> Option<Note> {
        let (reason, text) = match self {
            Judgement::Taken => return None,
            Judgement::Unlabelled => (
                "DeviceKeyUnlabelled",
                format!("no label {DEVICE_LABEL}=<device>: this key is for no device"),
            ),
            Judgement::Refused(why) => (
                "DeviceKeyRefused",
                format!("the key is not used: {why}; the device gets no key"),
            ),
            Judgement::Ambiguous(others) => (
                "DeviceKeyAmbiguous",
                format!(
                    "other key Secrets claim the same device ({}): it gets no key until only one does",
                    others.join(", ")
                ),
            ),
        };
        Some(Note {
            warning: true,
            reason,
            action: "Deliver",
            text,
        })
    }
}

/// What is known of device Secrets and of Devices' nodes.
#[derive(Debug, Default)]
pub struct Join {
    // By (namespace, Secret name).
    secrets: HashMap<(String, String), Claim>,
    // The Secrets claiming each Device.
    claims: HashMap<ResourceKey, BTreeSet<String>>,
    // The node of each Device.
    nodes: HashMap<ResourceKey, String>,
}

impl Join {
    /// Takes in a Secret; returns the Devices whose credential may have
    /// changed.
    pub fn secret_applied(&mut self, secret: &Secret) -> Vec<ResourceKey> {
        let namespace = secret.namespace().unwrap_or_default();
        let name = secret.name_any();
        let mut touched = self.secret_deleted(&namespace, &name);
        let Some(device) = secret.labels().get(DEVICE_LABEL) else {
            return touched;
        };
        let device = ResourceKey::device(&namespace, device);
        let psk = secret
            .data
            .as_ref()
            .and_then(|d| d.get(PSK_KEY))
            .ok_or_else(|| format!("it has no data key {PSK_KEY:?}"))
            .and_then(|b| Psk::new(b.0.clone()).map_err(|e| e.to_string()));
        self.claims
            .entry(device.clone())
            .or_default()
            .insert(name.clone());
        self.secrets.insert(
            (namespace, name),
            Claim {
                device: device.clone(),
                uid: secret.uid().unwrap_or_default(),
                psk,
            },
        );
        touched.push(device);
        touched
    }

    /// Forgets a Secret; returns the Device it claimed.
    pub fn secret_deleted(&mut self, namespace: &str, name: &str) -> Vec<ResourceKey> {
        let Some(claim) = self
            .secrets
            .remove(&(namespace.to_owned(), name.to_owned()))
        else {
            return Vec::new();
        };
        if let Some(names) = self.claims.get_mut(&claim.device) {
            names.remove(name);
            if names.is_empty() {
                self.claims.remove(&claim.device);
            }
        }
        vec![claim.device]
    }

    /// Takes in where a Device is (`None`: deleted or being deleted);
    /// returns whether that changed.
    pub fn device_on(&mut self, device: &ResourceKey, node: Option<&str>) -> bool {
        match node {
            Some(node) => {
                self.nodes
                    .insert(device.clone(), node.to_owned())
                    .as_deref()
                    != Some(node)
            }
            None => self.nodes.remove(device).is_some(),
        }
    }

    /// What became of Secret `namespace/name`, which was just applied.
    pub fn judge(&self, namespace: &str, name: &str) -> Judgement {
        let Some(claim) = self.secrets.get(&(namespace.to_owned(), name.to_owned())) else {
            return Judgement::Unlabelled;
        };
        if let Err(reason) = &claim.psk {
            return Judgement::Refused(reason.clone());
        }
        match self.claims.get(&claim.device) {
            Some(names) if names.len() > 1 => {
                Judgement::Ambiguous(names.iter().filter(|n| *n != name).cloned().collect())
            }
            _ => Judgement::Taken,
        }
    }

    /// Every Device a Secret claims or a node holds.
    fn known(&self) -> BTreeSet<ResourceKey> {
        self.claims
            .keys()
            .chain(self.nodes.keys())
            .cloned()
            .collect()
    }

    /// Where `device`'s credential goes now, with its body: on its node
    /// when exactly one valid Secret claims it; nowhere otherwise.
    pub fn placement(&self, device: &ResourceKey) -> BTreeMap<String, Indexed> {
        let (Some(node), Some(names)) = (self.nodes.get(device), self.claims.get(device)) else {
            return BTreeMap::new();
        };
        let [name] = names.iter().collect::<Vec<_>>()[..] else {
            tracing::warn!(device = %device, secrets = ?names, "more than one Secret claims this device; it gets no credential until one is deleted");
            return BTreeMap::new();
        };
        let claim = &self.secrets[&(device.namespace.clone(), name.clone())];
        let Ok(psk) = &claim.psk else {
            return BTreeMap::new();
        };
        let entry = Indexed {
            version: credential::version(&claim.uid, psk),
            body: resource::Body::Credential(proto::DeviceCredential {
                namespace: device.namespace.clone(),
                device: device.name.clone(),
                psk: psk.as_bytes().to_vec(),
            }),
        };
        BTreeMap::from([(node.clone(), entry)])
    }
}

/// A Secret's namespace and name.
type SecretName = (String, String);

/// The join, and the index it keeps current.
#[derive(Debug)]
pub struct Credentials {
    join: Mutex<Join>,
    index: Arc<Index>,
    // Where a Secret that gives no key is told of (not in unit tests).
    events: Option<Events>,
    judged: Outcomes,
    // What each Secret was last judged, at which resourceVersion: a relist
    // that changes nothing tells nothing again.
    told: Mutex<HashMap<SecretName, (Option<String>, Judgement)>>,
}

impl Credentials {
    /// Keeps `index` current.
    pub fn new(index: Arc<Index>) -> Self {
        Credentials {
            join: Mutex::new(Join::default()),
            index,
            events: None,
            judged: Outcomes::default(),
            told: Mutex::default(),
        }
    }

    /// Also publishes an Event about each Secret that gives no key, and
    /// counts every Secret taken in by its [`Judgement`] in `judged`.
    pub fn with_events(mut self, events: Events, judged: Outcomes) -> Self {
        self.events = Some(events);
        self.judged = judged;
        self
    }

    /// Counts, logs and tells (an Event) what became of `secret`, unless
    /// the same was told of the same version of it.
    fn tell(&self, join: &Join, secret: &Secret) {
        let (namespace, name) = (secret.namespace().unwrap_or_default(), secret.name_any());
        let judgement = join.judge(&namespace, &name);
        let judged = (secret.resource_version(), judgement.clone());
        let mut told = self.told.lock().expect("told lock");
        if told.get(&(namespace.clone(), name.clone())) == Some(&judged) {
            return;
        }
        told.insert((namespace.clone(), name.clone()), judged);
        self.judged.inc(judgement.label());
        let Some(note) = judgement.note() else {
            return;
        };
        tracing::warn!(%namespace, secret = %name, reason = note.reason, "{}", note.text);
        if let Some(events) = &self.events {
            events.publish(secret.object_ref(&()), note);
        }
    }

    /// Forgets what was told of Secrets not in `kept`.
    fn forget_told(&self, kept: impl Fn(&SecretName) -> bool) {
        self.told.lock().expect("told lock").retain(|k, _| kept(k));
    }

    fn place(&self, join: &Join, devices: impl IntoIterator<Item = ResourceKey>) {
        for device in devices {
            self.index
                .place(&credential::key_of(&device), join.placement(&device));
        }
    }

    /// A Device was created or changed.
    pub fn device_applied(&self, device: &Device) {
        let key = ResourceKey::device(device.namespace().unwrap_or_default(), device.name_any());
        let node = device
            .metadata
            .deletion_timestamp
            .is_none()
            .then_some(device.spec.node.as_str());
        let mut join = self.join.lock().expect("credentials lock");
        if join.device_on(&key, node) {
            self.place(&join, [key]);
        }
    }

    /// A Device was deleted.
    pub fn device_deleted(&self, key: &ResourceKey) {
        let mut join = self.join.lock().expect("credentials lock");
        if join.device_on(key, None) {
            self.place(&join, [key.clone()]);
        }
    }

    /// The Devices were listed anew: exactly these exist.
    pub fn devices_listed<'a>(&self, devices: impl IntoIterator<Item = &'a Device>) {
        let mut join = self.join.lock().expect("credentials lock");
        let before = join.known();
        join.nodes.clear();
        for device in devices
            .into_iter()
            .filter(|d| d.metadata.deletion_timestamp.is_none())
        {
            let key =
                ResourceKey::device(device.namespace().unwrap_or_default(), device.name_any());
            join.nodes.insert(key, device.spec.node.clone());
        }
        let all: BTreeSet<_> = before.union(&join.known()).cloned().collect();
        self.place(&join, all);
    }

    /// The Secrets were listed anew: exactly these exist.
    fn secrets_listed(&self, secrets: &[Secret]) {
        let mut join = self.join.lock().expect("credentials lock");
        let before = join.known();
        join.secrets.clear();
        join.claims.clear();
        for secret in secrets {
            join.secret_applied(secret);
        }
        let listed: BTreeSet<_> = secrets
            .iter()
            .map(|s| (s.namespace().unwrap_or_default(), s.name_any()))
            .collect();
        self.forget_told(|k| listed.contains(k));
        for secret in secrets {
            self.tell(&join, secret);
        }
        let all: BTreeSet<_> = before.union(&join.known()).cloned().collect();
        self.place(&join, all);
    }

    fn secret_applied(&self, secret: &Secret) {
        let mut join = self.join.lock().expect("credentials lock");
        let touched = join.secret_applied(secret);
        self.tell(&join, secret);
        self.place(&join, touched);
    }

    fn secret_deleted(&self, secret: &Secret) {
        let (namespace, name) = (secret.namespace().unwrap_or_default(), secret.name_any());
        self.forget_told(|k| k != &(namespace.clone(), name.clone()));
        let mut join = self.join.lock().expect("credentials lock");
        let touched = join.secret_deleted(&namespace, &name);
        self.place(&join, touched);
    }
}

/// How long the first list of device Secrets may take before the
/// controller gives up starting: long enough for a slow API server, short
/// enough that a missing grant is an error an operator sees.
pub const FIRST_LIST_PATIENCE: Duration = Duration::from_secs(60);

/// Watches the device Secrets of `api` into `credentials`. Returns once
/// they were listed (so no agent is told to drop a key because the
/// controller had not read it yet) with the task that goes on watching;
/// fails if they could not be listed within `patience` (most often: the
/// controller may not list Secrets).
pub async fn start(
    api: Api<Secret>,
    credentials: Arc<Credentials>,
    patience: Duration,
) -> anyhow::Result<impl std::future::Future<Output = ()> + Send + 'static> {
    let config = watcher::Config::default().fields(&format!("type={SECRET_TYPE}"));
    let mut events = Box::pin(watcher(api, config).backoff(crate::run::watch_backoff()));
    let mut relist = Vec::new();
    let mut last_error = None;
    let mut handle = move |event: Result<watcher::Event<Secret>, watcher::Error>,
                           last_error: &mut Option<String>|
          -> bool {
        match event {
            Ok(watcher::Event::Apply(secret)) => credentials.secret_applied(&secret),
            Ok(watcher::Event::Delete(secret)) => credentials.secret_deleted(&secret),
            Ok(watcher::Event::Init) => relist.clear(),
            Ok(watcher::Event::InitApply(secret)) => relist.push(secret),
            Ok(watcher::Event::InitDone) => {
                credentials.secrets_listed(&relist);
                relist.clear();
                return true;
            }
            Err(error) => {
                tracing::warn!(%error, "device Secret watch failed (is the controller allowed to list and watch Secrets?); retrying");
                *last_error = Some(error.to_string());
            }
        }
        false
    };
    let listed = tokio::time::timeout(patience, async {
        while let Some(event) = events.next().await {
            if handle(event, &mut last_error) {
                return true;
            }
        }
        false
    })
    .await;
    if listed != Ok(true) {
        anyhow::bail!(
            "could not list the device Secrets (type {SECRET_TYPE}) within {patience:?}: {}. \
             The controller's ClusterRole needs list and watch on secrets (deploy/cloud/rbac.yaml)",
            last_error
                .as_deref()
                .unwrap_or("no answer from the API server")
        );
    }
    Ok(async move {
        let mut ignored = None;
        while let Some(event) = events.next().await {
            handle(event, &mut ignored);
        }
    })
}

#[cfg(test)]
mod tests {
    use super::*;
    use k8s_openapi::ByteString;

    fn secret(name: &str, device: Option<&str>, psk: &[u8], uid: &str) -> Secret {
        let mut s = Secret {
            type_: Some(SECRET_TYPE.into()),
            data: Some(BTreeMap::from([(
                PSK_KEY.to_owned(),
                ByteString(psk.to_vec()),
            )])),
            ..Secret::default()
        };
        s.metadata.name = Some(name.into());
        s.metadata.namespace = Some("plant".into());
        s.metadata.uid = Some(uid.into());
        if let Some(device) = device {
            s.metadata.labels = Some(BTreeMap::from([(
                DEVICE_LABEL.to_owned(),
                device.to_owned(),
            )]));
        }
        s
    }

    fn psk_on(join: &Join, device: &ResourceKey) -> Option<(String, Vec<u8>)> {
        let placed = join.placement(device);
        let (node, entry) = placed.into_iter().next()?;
        let resource::Body::Credential(c) = entry.body else {
            panic!("not a credential")
        };
        Some((node, c.psk))
    }

    const KEY: &[u8] = b"0123456789abcdef";
    const ROTATED: &[u8] = b"fedcba9876543210";

    #[test]
    fn a_key_goes_to_its_devices_node_and_follows_it() {
        let mut join = Join::default();
        let t1 = ResourceKey::device("plant", "t1");
        assert_eq!(
            join.secret_applied(&secret("t1-psk", Some("t1"), KEY, "s1")),
            vec![t1.clone()]
        );
        assert_eq!(psk_on(&join, &t1), None, "no Device yet: nowhere");
        assert!(join.device_on(&t1, Some("edge-1")));
        assert_eq!(psk_on(&join, &t1), Some(("edge-1".into(), KEY.to_vec())));
        assert!(!join.device_on(&t1, Some("edge-1")), "unchanged");
        assert!(join.device_on(&t1, Some("edge-2")));
        assert_eq!(psk_on(&join, &t1), Some(("edge-2".into(), KEY.to_vec())));
        assert!(join.device_on(&t1, None));
        assert_eq!(psk_on(&join, &t1), None, "deleted Device: nowhere");
    }

    #[test]
    fn rotation_is_a_new_version_and_deletion_revokes() {
        let mut join = Join::default();
        let t1 = ResourceKey::device("plant", "t1");
        join.device_on(&t1, Some("edge-1"));
        join.secret_applied(&secret("t1-psk", Some("t1"), KEY, "s1"));
        let first = join.placement(&t1)["edge-1"].version.clone();
        join.secret_applied(&secret("t1-psk", Some("t1"), ROTATED, "s1"));
        let rotated = join.placement(&t1)["edge-1"].version.clone();
        assert_ne!(first, rotated);
        assert_eq!(psk_on(&join, &t1).unwrap().1, ROTATED);
        assert_eq!(join.secret_deleted("plant", "t1-psk"), vec![t1.clone()]);
        assert_eq!(psk_on(&join, &t1), None);
    }

    #[test]
    fn a_relabelled_secret_moves_its_key_to_the_other_device() {
        let mut join = Join::default();
        let (t1, t2) = (
            ResourceKey::device("plant", "t1"),
            ResourceKey::device("plant", "t2"),
        );
        join.device_on(&t1, Some("edge-1"));
        join.device_on(&t2, Some("edge-1"));
        join.secret_applied(&secret("k", Some("t1"), KEY, "s1"));
        let touched = join.secret_applied(&secret("k", Some("t2"), KEY, "s1"));
        assert_eq!(touched, vec![t1.clone(), t2.clone()]);
        assert_eq!(psk_on(&join, &t1), None);
        assert!(psk_on(&join, &t2).is_some());
    }

    #[test]
    fn invalid_unlabelled_and_ambiguous_secrets_give_no_credential() {
        let mut join = Join::default();
        let t1 = ResourceKey::device("plant", "t1");
        join.device_on(&t1, Some("edge-1"));
        assert!(
            join.secret_applied(&secret("none", None, KEY, "s0"))
                .is_empty()
        );
        join.secret_applied(&secret("short", Some("t1"), b"short", "s1"));
        assert_eq!(psk_on(&join, &t1), None, "too short");
        join.secret_deleted("plant", "short");
        join.secret_applied(&secret("a", Some("t1"), KEY, "s2"));
        assert!(psk_on(&join, &t1).is_some());
        join.secret_applied(&secret("b", Some("t1"), ROTATED, "s3"));
        assert_eq!(psk_on(&join, &t1), None, "two Secrets claim t1");
        join.secret_deleted("plant", "a");
        assert_eq!(psk_on(&join, &t1).unwrap().1, ROTATED);
    }

    #[test]
    fn a_relist_that_changes_nothing_counts_nothing_again() {
        let credentials = Credentials::new(Arc::new(Index::default()));
        let versioned = |name, device, psk, version: &str| {
            let mut s = secret(name, device, psk, name);
            s.metadata.resource_version = Some(version.into());
            s
        };
        let listed = [
            versioned("a", Some("t1"), KEY, "1"),
            versioned("short", Some("t2"), b"short", "2"),
        ];
        credentials.secrets_listed(&listed);
        credentials.secrets_listed(&listed);
        assert_eq!(credentials.judged.get("taken"), 1);
        assert_eq!(credentials.judged.get("refused"), 1);
        // A rotation is a new version: counted again. A Secret deleted and
        // created again is told of again.
        credentials.secret_applied(&versioned("a", Some("t1"), ROTATED, "3"));
        assert_eq!(credentials.judged.get("taken"), 2);
        credentials.secret_deleted(&listed[1]);
        credentials.secret_applied(&listed[1]);
        assert_eq!(credentials.judged.get("refused"), 2);
    }

    #[test]
    fn each_secret_is_judged_and_all_but_a_taken_key_say_why_in_an_event() {
        let mut join = Join::default();
        join.secret_applied(&secret("none", None, KEY, "s0"));
        join.secret_applied(&secret("short", Some("t1"), b"short", "s1"));
        join.secret_applied(&secret("a", Some("t2"), KEY, "s2"));
        assert_eq!(join.judge("plant", "none"), Judgement::Unlabelled);
        assert!(
            matches!(join.judge("plant", "short"), Judgement::Refused(r) if r.contains("5 bytes"))
        );
        assert_eq!(join.judge("plant", "a"), Judgement::Taken);
        assert_eq!(Judgement::Taken.note(), None);
        join.secret_applied(&secret("b", Some("t2"), ROTATED, "s3"));
        let judged = join.judge("plant", "b");
        assert_eq!(judged, Judgement::Ambiguous(vec!["a".into()]));
        let note = judged.note().unwrap();
        assert_eq!((note.warning, note.reason), (true, "DeviceKeyAmbiguous"));
        assert!(note.text.contains("same device (a)"), "{}", note.text);
        // The key itself is never in an Event.
        for name in ["none", "short", "b"] {
            let text = join.judge("plant", name).note().unwrap().text;
            assert!(!text.contains("0123456789"), "{text}");
        }
    }
}
