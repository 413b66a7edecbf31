//! The per-node index of desired state.
//!
//! Fed by the Device reflector (Devices) and the rule reconciler (each
//! EdgeRule as one node's agent needs it), read by one sync stream per
//! connected agent.
//! Each node's slice sits behind a `tokio::sync::watch` channel: a subscriber
//! always sees the latest slice, never a queue of changes, so a slow agent
//! costs memory for one slice, not for a backlog. A stream turns "what the
//! agent has been sent" and "the latest slice" into an Update with
//! [`difference`].

use std::collections::{BTreeMap, BTreeSet, HashMap};
use std::sync::{Arc, Mutex};

use edgefleet_shared::api::{Device, Transport};
use edgefleet_shared::key::ResourceKind;
use edgefleet_shared::proto::{self, resource};
use edgefleet_shared::{ResourceKey, ResourceVersion};
use kube::ResourceExt;
use tokio::sync::watch;

/// One resource as its agent needs it.
#[derive(Clone, Debug, PartialEq)]
pub struct Indexed {
    /// A Device's uid and generation; a rule's uid and body digest.
    pub version: ResourceVersion,
    /// The resource as the sync protocol carries it.
    pub body: resource::Body,
}

impl Indexed {
    /// Builds the entry for a Device read from the API server; `None` for a
    /// Device being deleted (its agent must drop it) and for an object
    /// without uid or generation (never the case for a stored object).
    pub fn from_device(device: &Device) -> Option<(ResourceKey, Self)> {
        if device.metadata.deletion_timestamp.is_some() {
            return None;
        }
        let uid = device.uid()?;
        let generation = device.metadata.generation?;
        let namespace = device.namespace()?;
        let key = ResourceKey::device(&namespace, device.name_any());
        let spec = &device.spec;
        let desired = proto::DeviceDesired {
            namespace,
            name: device.name_any(),
            model: spec.model.clone(),
            transport: match spec.transport {
                Transport::Coap => proto::Transport::Coap,
                Transport::Mqtt => proto::Transport::Mqtt,
            } as i32,
            properties: spec
                .desired
                .iter()
                .map(|(k, v)| (k.clone(), v.into()))
                .collect(),
            firmware: spec.firmware.as_ref().map(|f| proto::Firmware {
                version: f.version.clone(),
                url: f.url.clone().unwrap_or_default(),
                sha256: f.sha256.clone().unwrap_or_default(),
            }),
            health_check: edgefleet_shared::rollout_member::health_check(device).map(|h| {
                proto::HealthCheck {
                    rollout: h.rollout,
                    expression: h.expression,
                    bake_seconds: h.bake_seconds,
                }
            }),
            site_rollback: edgefleet_shared::rollout_member::site_rollback(device)
                .map(|s| proto::SiteRollback::from(&s)),
            site_pacing: edgefleet_shared::rollout_member::site_pacing(device)
                .map(|s| proto::SitePacing::from(&s)),
        };
        Some((
            key,
            Indexed {
                version: ResourceVersion::new(uid, generation),
                body: resource::Body::Device(desired),
            },
        ))
    }
}

/// Everything one node's agent should hold.
///
/// A persistent map: a clone (one per session, at every change) shares
/// the whole tree, a change copies only the path to its key, and two
/// versions are compared ([`imbl::OrdMap::diff`]) by skipping the subtrees
/// they share, so a session's work per change is proportional to the
/// change, not to the node's size.
pub type NodeSlice = imbl::OrdMap<ResourceKey, Arc<Indexed>>;

/// Desired state by edge node.
#[derive(Debug, Default)]
pub struct Index {
    inner: Mutex<Inner>,
}

#[derive(Debug, Default)]
struct Inner {
    nodes: HashMap<String, watch::Sender<NodeSlice>>,
    // Where each device sits, so a Device moved to another node leaves the old one.
    node_of: HashMap<ResourceKey, String>,
    // The nodes each rule or credential is on.
    placed: HashMap<ResourceKey, BTreeSet<String>>,
}

impl Inner {
    fn node(&mut self, node: &str) -> &watch::Sender<NodeSlice> {
        self.nodes
            .entry(node.to_owned())
            .or_insert_with(|| watch::Sender::new(NodeSlice::new()))
    }

    fn remove(&mut self, key: &ResourceKey) {
        if let Some(node) = self.node_of.remove(key) {
            self.node(&node)
                .send_if_modified(|slice| slice.remove(key).is_some());
        }
    }
}

impl Index {
    /// Adds or replaces a Device. Subscribers are woken only if what the
    /// agent would be sent changed (a new uid or generation).
    pub fn upsert(&self, device: &Device) {
        let Some((key, entry)) = Indexed::from_device(device) else {
            if device.metadata.deletion_timestamp.is_some() {
                self.remove(&ResourceKey::device(
                    device.namespace().unwrap_or_default(),
                    device.name_any(),
                ));
            }
            return;
        };
        let node = device.spec.node.clone();
        let mut inner = self.inner.lock().expect("index lock");
        if inner.node_of.get(&key).is_some_and(|n| *n != node) {
            inner.remove(&key);
        }
        inner.node_of.insert(key.clone(), node.clone());
        inner.node(&node).send_if_modified(|slice| {
            if slice.get(&key).is_some_and(|e| e.version == entry.version) {
                return false;
            }
            slice.insert(key, Arc::new(entry));
            true
        });
    }

    /// Removes a Device.
    pub fn remove(&self, key: &ResourceKey) {
        self.inner.lock().expect("index lock").remove(key);
    }

    /// Replaces the whole index, as after a reflector relist: Devices that
    /// are gone are removed.
    pub fn replace_all<'a>(&self, devices: impl IntoIterator<Item = &'a Device>) {
        let devices: Vec<&Device> = devices.into_iter().collect();
        let keep: std::collections::HashSet<ResourceKey> = devices
            .iter()
            .filter_map(|d| Indexed::from_device(d).map(|(k, _)| k))
            .collect();
        let stale: Vec<ResourceKey> = {
            let inner = self.inner.lock().expect("index lock");
            inner
                .node_of
                .keys()
                .filter(|k| !keep.contains(*k))
                .cloned()
                .collect()
        };
        for key in &stale {
            self.remove(key);
        }
        for device in devices {
            self.upsert(device);
        }
    }

    /// Puts `key` (a rule or a credential) on exactly the nodes of
    /// `bodies`, each with its body; subscribers are woken where a body's
    /// version changed.
    pub fn place(&self, key: &ResourceKey, bodies: BTreeMap<String, Indexed>) {
        let mut inner = self.inner.lock().expect("index lock");
        let before = inner.placed.remove(key).unwrap_or_default();
        for node in before.iter().filter(|n| !bodies.contains_key(*n)) {
            inner
                .node(node)
                .send_if_modified(|slice| slice.remove(key).is_some());
        }
        let nodes = bodies.keys().cloned().collect();
        for (node, entry) in bodies {
            inner.node(&node).send_if_modified(|slice| {
                if slice.get(key).is_some_and(|e| e.version == entry.version) {
                    return false;
                }
                slice.insert(key.clone(), Arc::new(entry));
                true
            });
        }
        inner.placed.insert(key.clone(), nodes);
    }

    /// Takes `key` (a rule or a credential) off every node.
    pub fn unplace(&self, key: &ResourceKey) {
        self.place(key, BTreeMap::new());
        self.inner.lock().expect("index lock").placed.remove(key);
    }

    /// The Devices of `node` now.
    pub fn devices_of(&self, node: &str) -> Vec<ResourceKey> {
        let inner = self.inner.lock().expect("index lock");
        inner
            .nodes
            .get(node)
            .map(|slice| {
                slice
                    .borrow()
                    .keys()
                    .filter(|k| k.is_device())
                    .cloned()
                    .collect()
            })
            .unwrap_or_default()
    }

    /// The latest slice of `node`, and every change after it.
    pub fn subscribe(&self, node: &str) -> watch::Receiver<NodeSlice> {
        self.inner
            .lock()
            .expect("index lock")
            .node(node)
            .subscribe()
    }
}

/// What an agent must be sent so it holds exactly `desired`.
#[derive(Debug, Default, PartialEq)]
pub struct Difference {
    /// Resources the agent lacks or holds in another version.
    pub upserts: Vec<(ResourceKey, Arc<Indexed>)>,
    /// Resources the agent holds that it should not.
    pub removals: Vec<ResourceKey>,
}

impl Difference {
    /// Nothing to send.
    pub fn is_empty(&self) -> bool {
        self.upserts.is_empty() && self.removals.is_empty()
    }
}

/// The difference between what an agent holds and what it should hold.
///
/// A held Device with the same uid and the same or a later generation is
/// not resent; one with another uid (deleted and created again) is. A rule
/// or credential is resent whenever its version differs: the version is a
/// digest, not a count.
pub fn difference(
    desired: &NodeSlice,
    held: &BTreeMap<ResourceKey, ResourceVersion>,
) -> Difference {
    let gone = held.keys().filter(|key| !desired.contains_key(*key));
    difference_at(desired, held, desired.keys().chain(gone))
}

/// [`difference`] looked at only for `keys` (those that may differ), in
/// the order given.
pub fn difference_at<'a>(
    desired: &NodeSlice,
    held: &BTreeMap<ResourceKey, ResourceVersion>,
    keys: impl IntoIterator<Item = &'a ResourceKey>,
) -> Difference {
    let mut diff = Difference::default();
    for key in keys {
        match (desired.get(key), held.get(key)) {
            (Some(entry), held) if must_send(key, entry, held) => {
                diff.upserts.push((key.clone(), Arc::clone(entry)));
            }
            (None, Some(_)) => diff.removals.push(key.clone()),
            _ => {}
        }
    }
    diff
}

/// Whether an agent holding `held` of `key` must be sent `entry`.
fn must_send(key: &ResourceKey, entry: &Indexed, held: Option<&ResourceVersion>) -> bool {
    held.is_none_or(|h| match key.kind {
        ResourceKind::Device => entry.version.is_newer_than(h),
        ResourceKind::Rule | ResourceKind::Credential => entry.version != *h,
    })
}

#[cfg(test)]
pub(crate) mod tests {
    use super::*;
    use edgefleet_shared::api::DeviceSpec;
    use proptest::prelude::*;

    /// A thermostat Device as the API server would return it.
    pub(crate) fn device(ns: &str, name: &str, node: &str, uid: &str, generation: i64) -> Device {
        let mut d = Device::new(
            name,
            DeviceSpec {
                node: node.into(),
                model: "thermostat".into(),
                transport: Transport::Coap,
                desired: Default::default(),
                firmware: None,
                retry: 0,
            },
        );
        d.metadata.namespace = Some(ns.into());
        d.metadata.uid = Some(uid.into());
        d.metadata.generation = Some(generation);
        d
    }

    fn versions(slice: &NodeSlice) -> BTreeMap<ResourceKey, ResourceVersion> {
        slice
            .iter()
            .map(|(k, e)| (k.clone(), e.version.clone()))
            .collect()
    }

    #[test]
    fn a_new_agent_gets_everything_and_an_up_to_date_agent_nothing() {
        let index = Index::default();
        index.upsert(&device("ns", "a", "edge-1", "ua", 1));
        index.upsert(&device("ns", "b", "edge-1", "ub", 3));
        let slice = index.subscribe("edge-1").borrow().clone();
        assert_eq!(difference(&slice, &BTreeMap::new()).upserts.len(), 2);
        assert!(difference(&slice, &versions(&slice)).is_empty());
    }

    #[test]
    fn only_changed_and_removed_resources_are_sent() {
        let index = Index::default();
        for (name, uid) in [("a", "ua"), ("b", "ub"), ("c", "uc")] {
            index.upsert(&device("ns", name, "edge-1", uid, 1));
        }
        let held = versions(&index.subscribe("edge-1").borrow());
        index.upsert(&device("ns", "b", "edge-1", "ub", 2)); // changed
        index.remove(&ResourceKey::device("ns", "c")); // deleted while away
        index.upsert(&device("ns", "d", "edge-1", "ud", 1)); // new
        let diff = difference(&index.subscribe("edge-1").borrow(), &held);
        let upserted: Vec<String> = diff.upserts.iter().map(|(k, _)| k.name.clone()).collect();
        assert_eq!(upserted, ["b", "d"]);
        assert_eq!(diff.removals, [ResourceKey::device("ns", "c")]);
    }

    #[test]
    fn a_device_moved_to_another_node_leaves_the_old_one() {
        let index = Index::default();
        index.upsert(&device("ns", "a", "edge-1", "ua", 1));
        let mut old = index.subscribe("edge-1");
        let new = index.subscribe("edge-2");
        index.upsert(&device("ns", "a", "edge-2", "ua", 2));
        assert!(old.has_changed().unwrap());
        assert!(old.borrow_and_update().is_empty());
        assert_eq!(new.borrow().len(), 1);
    }

    #[test]
    fn subscribers_are_not_woken_when_nothing_they_need_changed() {
        let index = Index::default();
        index.upsert(&device("ns", "a", "edge-1", "ua", 1));
        let mut rx = index.subscribe("edge-1");
        rx.borrow_and_update();
        // Same uid and generation: a status or label change on the Device.
        index.upsert(&device("ns", "a", "edge-1", "ua", 1));
        assert!(!rx.has_changed().unwrap());
        index.upsert(&device("ns", "a", "edge-1", "ua", 2));
        assert!(rx.has_changed().unwrap());
    }

    #[test]
    fn a_device_being_deleted_leaves_its_node() {
        let index = Index::default();
        index.upsert(&device("ns", "a", "edge-1", "ua", 1));
        index.upsert(&device("ns", "b", "edge-1", "ub", 1));
        let mut deleting = device("ns", "a", "edge-1", "ua", 1);
        deleting.metadata.deletion_timestamp =
            Some(k8s_openapi::apimachinery::pkg::apis::meta::v1::Time(
                k8s_openapi::jiff::Timestamp::now(),
            ));
        index.upsert(&deleting);
        let slice = index.subscribe("edge-1").borrow().clone();
        assert_eq!(
            slice.keys().map(|k| k.name.as_str()).collect::<Vec<_>>(),
            ["b"]
        );
        // A relist that still lists it (finalizer pending) does not bring it back.
        index.replace_all([&deleting, &device("ns", "b", "edge-1", "ub", 1)]);
        assert_eq!(index.subscribe("edge-1").borrow().len(), 1);
    }

    #[test]
    fn a_relist_removes_devices_that_are_gone() {
        let index = Index::default();
        index.upsert(&device("ns", "a", "edge-1", "ua", 1));
        index.upsert(&device("ns", "b", "edge-1", "ub", 1));
        index.replace_all([&device("ns", "b", "edge-1", "ub", 1)]);
        let slice = index.subscribe("edge-1").borrow().clone();
        assert_eq!(
            slice.keys().map(|k| k.name.as_str()).collect::<Vec<_>>(),
            ["b"]
        );
    }

    #[test]
    fn a_recreated_device_is_resent_even_at_a_lower_generation() {
        let index = Index::default();
        index.upsert(&device("ns", "a", "edge-1", "new-uid", 1));
        let held = BTreeMap::from([(
            ResourceKey::device("ns", "a"),
            ResourceVersion::new("old-uid", 9),
        )]);
        let diff = difference(&index.subscribe("edge-1").borrow(), &held);
        assert_eq!(diff.upserts.len(), 1);
        assert!(diff.removals.is_empty());
    }

    fn rule_entry(digest: i64) -> Indexed {
        Indexed {
            version: ResourceVersion::new("rule-uid", digest),
            body: resource::Body::Rule(proto::RuleDesired::default()),
        }
    }

    #[test]
    fn a_rule_sits_on_exactly_the_nodes_it_is_put_on() {
        let index = Index::default();
        index.upsert(&device("ns", "a", "edge-1", "ua", 1));
        let key = ResourceKey::rule("ns", "overheat");
        index.place(
            &key,
            BTreeMap::from([
                ("edge-1".into(), rule_entry(1)),
                ("edge-2".into(), rule_entry(1)),
            ]),
        );
        let mut one = index.subscribe("edge-1");
        let mut two = index.subscribe("edge-2");
        one.borrow_and_update();
        two.borrow_and_update();
        assert!(one.borrow().contains_key(&key) && two.borrow().contains_key(&key));
        // Only the devices count as a node's devices.
        assert_eq!(index.devices_of("edge-1"), [ResourceKey::device("ns", "a")]);

        // edge-1's body changes, edge-2 leaves: edge-1 is woken with the new
        // version, edge-2 loses the rule, and neither is woken for nothing.
        index.place(&key, BTreeMap::from([("edge-1".into(), rule_entry(2))]));
        assert!(one.has_changed().unwrap() && two.has_changed().unwrap());
        assert_eq!(one.borrow_and_update()[&key].version.generation, 2);
        assert!(!two.borrow_and_update().contains_key(&key));
        index.place(&key, BTreeMap::from([("edge-1".into(), rule_entry(2))]));
        assert!(!one.has_changed().unwrap());

        index.unplace(&key);
        assert!(!one.borrow_and_update().contains_key(&key));
        assert_eq!(one.borrow().len(), 1);
    }

    #[test]
    fn a_rule_is_resent_when_its_digest_differs_either_way() {
        let index = Index::default();
        let key = ResourceKey::rule("ns", "overheat");
        index.place(&key, BTreeMap::from([("edge-1".into(), rule_entry(5))]));
        let slice = index.subscribe("edge-1").borrow().clone();
        for held in [1, 9] {
            let held = BTreeMap::from([(key.clone(), ResourceVersion::new("rule-uid", held))]);
            assert_eq!(difference(&slice, &held).upserts.len(), 1, "held {held:?}");
        }
        let held = BTreeMap::from([(key.clone(), ResourceVersion::new("rule-uid", 5))]);
        assert!(difference(&slice, &held).is_empty());
    }

    proptest! {
        /// Applying the difference to what the agent holds yields exactly
        /// what it should hold, and nothing already current is resent.
        #[test]
        fn applying_the_difference_converges(
            desired in proptest::collection::btree_map(0u8..40, (0u8..3, 1i64..5), 0..30),
            held in proptest::collection::btree_map(0u8..40, (0u8..3, 1i64..5), 0..30),
        ) {
            let key = |n: &u8| ResourceKey::device("ns", format!("d{n}"));
            let slice: NodeSlice = desired.iter().map(|(n, (u, g))| {
                let entry = Indexed {
                    version: ResourceVersion::new(format!("u{u}"), *g),
                    body: resource::Body::Device(proto::DeviceDesired::default()),
                };
                (key(n), Arc::new(entry))
            }).collect();
            let mut held: BTreeMap<ResourceKey, ResourceVersion> = held.iter()
                .map(|(n, (u, g))| (key(n), ResourceVersion::new(format!("u{u}"), *g)))
                .collect();
            let before = held.clone();

            let diff = difference(&slice, &held);
            for (k, e) in &diff.upserts {
                prop_assert!(before.get(k) != Some(&e.version), "resent {k} at the version it holds");
                held.insert(k.clone(), e.version.clone());
            }
            for k in &diff.removals {
                held.remove(k);
            }
            // Same keys; each held version is the desired one or a later
            // generation of the same object.
            prop_assert_eq!(held.keys().collect::<Vec<_>>(), slice.keys().collect::<Vec<_>>());
            for (k, e) in &slice {
                prop_assert!(!e.version.is_newer_than(&held[k]));
            }
            prop_assert!(difference(&slice, &held).is_empty());
        }
    }
}
