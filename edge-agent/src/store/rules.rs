//! What the store keeps for the EdgeRules acting at this agent: where each
//! rule stands for each device it watches (`rule_watches`), the overrides
//! it set (in the target devices' [`DesiredDevice`] records) and the events
//! it raised (in the events outbox). One decision is one transaction,
//! flushed before any device is told: a decision is never half made, and a
//! restart finds every override it must keep telling.

use std::collections::BTreeMap;
use std::sync::atomic::Ordering;

use edgefleet_shared::codec::DeviceEvent;
use edgefleet_shared::rule_engine::{Override, Watch};
use edgefleet_shared::{PropertyValue, ResourceKey};
use serde::{Deserialize, Serialize};
use sled::Transactional;
use sled::transaction::{ConflictableTransactionError, TransactionalTree};
use tokio::sync::{Notify, broadcast};

use super::{
    DesiredChange, DesiredDevice, OutboxEntry, Store, StoreError, StoredEvent, decode, drop_event,
    encode, from_transaction, take_seq,
};

/// Where one rule stands for one device it watches, as kept.
#[derive(Clone, Debug, Default, PartialEq, Serialize, Deserialize)]
#[serde(rename_all = "camelCase")]
pub struct RuleState {
    /// The rule engine's state.
    pub watch: Watch,
    /// The devices (names, in the rule's namespace) its override for this
    /// device is on, while it is.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub targets: Vec<String>,
}

/// An event a rule raises, on the device it acted for.
#[derive(Clone, Debug, PartialEq)]
pub struct RuleEventOut {
    /// Warning rather than Normal.
    pub warning: bool,
    /// CamelCase.
    pub reason: String,
    /// For people.
    pub message: String,
}

/// What a decision does to the rule's overrides for the device.
#[derive(Clone, Debug, PartialEq)]
pub enum OverrideChange {
    /// Nothing.
    Keep,
    /// Sets `set` on `targets` (replacing what it set before for this
    /// device).
    Set {
        /// Device names in the rule's namespace.
        targets: Vec<String>,
        /// The properties.
        set: BTreeMap<String, PropertyValue>,
        /// The rule's priority.
        priority: i32,
    },
    /// Ends what it set for this device.
    End,
}

/// One decision of one rule for one watched device.
#[derive(Clone, Debug, PartialEq)]
pub struct Decision {
    /// The rule (`rule/<ns>/<name>`).
    pub rule: ResourceKey,
    /// The watched device.
    pub device: ResourceKey,
    /// The rule engine's state after the decision.
    pub watch: Watch,
    /// What happens to its overrides.
    pub overrides: OverrideChange,
    /// The event it raises, if any.
    pub event: Option<RuleEventOut>,
    /// When (Unix ms).
    pub at_ms: i64,
    /// How deep in a chain of rules it is (see
    /// [`edgefleet_shared::rule_engine::MAX_CHAIN_DEPTH`]): each device
    /// whose desired state it changes takes this as its `chain`.
    pub depth: u32,
}

fn watch_key(rule: &ResourceKey, device: &str) -> Vec<u8> {
    let mut key = rule_prefix(rule);
    key.extend_from_slice(device.as_bytes());
    key
}

fn rule_prefix(rule: &ResourceKey) -> Vec<u8> {
    let mut key = rule.to_string().into_bytes();
    key.push(0);
    key
}

/// Takes `rule`'s overrides caused by `cause` off `device`, then puts
/// `set` on it if given; bumps the override revision, and marks the
/// device with the decision's chain depth, if what the device is told
/// changed. Returns whether it did.
fn reset_overrides(
    device: &mut DesiredDevice,
    rule: &str,
    cause: &str,
    set: Option<(&BTreeMap<String, PropertyValue>, i32, i64)>,
    depth: u32,
) -> bool {
    let before = device.to_wire();
    for overrides in device.overrides.values_mut() {
        overrides.retain(|o| !(o.rule == rule && o.cause == cause));
    }
    device.overrides.retain(|_, o| !o.is_empty());
    if let Some((set, priority, at_ms)) = set {
        for (property, value) in set {
            device
                .overrides
                .entry(property.clone())
                .or_default()
                .push(Override {
                    rule: rule.to_owned(),
                    priority,
                    value: value.clone(),
                    since_ms: at_ms,
                    cause: cause.to_owned(),
                });
        }
    }
    let changed = device.to_wire().properties != before.properties;
    if changed {
        device.local += 1;
        device.chain = depth;
    }
    changed
}

impl Store {
    /// Where `rule` stands for `device` (a device it never judged: the
    /// start).
    pub fn rule_state(&self, rule: &ResourceKey, device: &str) -> Result<RuleState, StoreError> {
        let key = watch_key(rule, device);
        Ok(match self.rule_watches.get(&key)? {
            Some(v) => decode(&key, &v)?,
            None => RuleState::default(),
        })
    }

    /// Every device whose report became durable, as it does (a receiver
    /// that lags learns it from `RecvError::Lagged` and should look at
    /// every device).
    pub fn watch_reports(&self) -> broadcast::Receiver<ResourceKey> {
        self.reports.subscribe()
    }

    /// Woken whenever the rules held change.
    pub fn rules_changed(&self) -> std::sync::Arc<Notify> {
        std::sync::Arc::clone(&self.rules_changed)
    }

    /// The events a rule raises go up under this boot epoch, their ids the
    /// outbox's sequence numbers: names that never collide with the
    /// device's own events, and another epoch for a rebuilt store.
    fn rule_event_boot(&self) -> u64 {
        u64::from_str_radix(self.store_id.get(..16).unwrap_or("1"), 16).unwrap_or(1) | 1
    }

    /// Makes `decision` durable in one transaction: the rule's state, its
    /// overrides on the target devices and its event. Then tells the
    /// device publishers of every device whose desired state changed, and
    /// returns them.
    pub async fn decide(&self, decision: &Decision) -> Result<Vec<ResourceKey>, StoreError> {
        let (changed, touched, seq) = self.decide_locked(decision)?;
        self.overrides_changed(&touched, changed, seq.is_some())
            .await
    }

    /// After overrides changed on `touched`: each device's latest report
    /// goes up again with the overrides it has now (so its status shows
    /// them), everything is made durable, then the uplink (if anything was
    /// `queued`) and the device publishers (of `changed`) are told.
    async fn overrides_changed(
        &self,
        touched: &[ResourceKey],
        changed: Vec<ResourceKey>,
        mut queued: bool,
    ) -> Result<Vec<ResourceKey>, StoreError> {
        for device in touched {
            if let Some(latest) = self.latest_report(device)? {
                queued |= self
                    .write_report(device, latest.report, latest.received_at_ms)?
                    .1;
            }
        }
        self.flusher.flush().await?;
        if queued {
            self.outbox_changed.notify_one();
        }
        if !changed.is_empty() {
            let _ = self.desired_changes.send(DesiredChange {
                upserted: changed.clone(),
                removed: Vec::new(),
            });
        }
        Ok(changed)
    }

    /// The transaction of [`Store::decide`], under the outbox lock: the
    /// devices whose desired state changed, those whose overrides did, and
    /// the event's sequence number.
    #[allow(clippy::type_complexity)]
    fn decide_locked(
        &self,
        decision: &Decision,
    ) -> Result<(Vec<ResourceKey>, Vec<ResourceKey>, Option<u64>), StoreError> {
        let namespace = &decision.rule.namespace;
        let rule_name = decision.rule.name.as_str();
        let cause = decision.device.name.as_str();
        let key = watch_key(&decision.rule, cause);
        let uid = self.held_uid(&decision.device)?;
        let boot = self.rule_event_boot();
        let bound = self.max_events;
        let mut outbox_state = self.lock_outbox();
        let (reserved, victim) = match &decision.event {
            Some(_) => {
                let victim = if outbox_state.events >= self.max_events {
                    self.oldest_event()?
                } else {
                    None
                };
                (Some(self.reserve_seqs(&mut outbox_state, 1)?), victim)
            }
            None => (None, None),
        };
        let trees = (
            &self.desired,
            &self.rule_watches,
            &self.events_out,
            &self.meta,
        );
        let result = trees.transaction(|(desired, watches, outbox, meta)| {
            let before: RuleState = match watches.get(&key)? {
                Some(v) => decode(&key, &v).map_err(ConflictableTransactionError::Abort)?,
                None => RuleState::default(),
            };
            let mut after = RuleState {
                watch: decision.watch.clone(),
                targets: before.targets.clone(),
            };
            let mut changed = Vec::new();
            let mut touched = Vec::new();
            let mut touch = |name: &str,
                             set: Option<(&BTreeMap<String, PropertyValue>, i32, i64)>|
             -> sled::transaction::ConflictableTransactionResult<
                (),
                StoreError,
            > {
                let target = ResourceKey::device(namespace, name);
                let k = target.to_string();
                let Some(held) = desired.get(k.as_bytes())? else {
                    return Ok(());
                };
                let mut device: DesiredDevice =
                    decode(k.as_bytes(), &held).map_err(ConflictableTransactionError::Abort)?;
                let before = device.overrides.clone();
                if reset_overrides(&mut device, rule_name, cause, set, decision.depth) {
                    changed.push(target.clone());
                }
                if device.overrides != before {
                    touched.push(target);
                }
                desired.insert(k.as_bytes(), encode(&device))?;
                Ok(())
            };
            match &decision.overrides {
                OverrideChange::Keep => {}
                OverrideChange::End => {
                    for name in &before.targets {
                        touch(name, None)?;
                    }
                    after.targets.clear();
                }
                OverrideChange::Set {
                    targets,
                    set,
                    priority,
                } => {
                    for name in before.targets.iter().filter(|n| !targets.contains(n)) {
                        touch(name, None)?;
                    }
                    for name in targets {
                        touch(name, Some((set, *priority, decision.at_ms)))?;
                    }
                    after.targets = targets.clone();
                }
            }
            if after == RuleState::default() {
                watches.remove(key.as_slice())?;
            } else {
                watches.insert(key.as_slice(), encode(&after))?;
            }
            let mut seq = None;
            if let (Some(event), Some(reserved)) = (&decision.event, reserved) {
                let n = take_seq(meta, reserved)?;
                let entry = OutboxEntry::Event(StoredEvent {
                    device: decision.device.to_string(),
                    at_ms: decision.at_ms,
                    uid: uid.clone(),
                    event: DeviceEvent {
                        id: n,
                        boot,
                        warning: event.warning,
                        reason: event.reason.clone(),
                        message: event.message.clone(),
                    },
                });
                outbox.insert(&n.to_be_bytes(), encode(&entry))?;
                if let Some(victim) = victim {
                    drop_event(outbox, meta, victim, decision.at_ms, bound)?;
                }
                seq = Some(n);
            }
            Ok((changed, touched, seq))
        });
        let (changed, touched, seq) = result.map_err(from_transaction)?;
        if let Some(seq) = seq {
            self.seqs.written.fetch_max(seq, Ordering::SeqCst);
            if victim.is_none() {
                outbox_state.events += 1;
            }
        }
        Ok((changed, touched, seq))
    }

    /// Ends everything `rule` did at this agent (it was deleted, refused,
    /// or no longer concerns this node): its state for every device and
    /// its overrides. Returns the devices whose desired state changed.
    pub async fn forget_rule(&self, rule: &ResourceKey) -> Result<Vec<ResourceKey>, StoreError> {
        let prefix = rule_prefix(rule);
        let states: Vec<(sled::IVec, RuleState)> = self
            .rule_watches
            .scan_prefix(&prefix)
            .map(|item| {
                let (k, v) = item?;
                let state = decode(&k, &v)?;
                Ok((k, state))
            })
            .collect::<Result<_, StoreError>>()?;
        if states.is_empty() {
            return Ok(Vec::new());
        }
        let namespace = &rule.namespace;
        let result = (&self.desired, &self.rule_watches).transaction(|(desired, watches)| {
            let mut changed = Vec::new();
            for (k, state) in &states {
                watches.remove(k)?;
                let cause = String::from_utf8_lossy(&k[prefix.len()..]).into_owned();
                for name in &state.targets {
                    let target = ResourceKey::device(namespace, name);
                    if forget_on(desired, &target, &rule.name, &cause)?
                        && !changed.contains(&target)
                    {
                        changed.push(target);
                    }
                }
            }
            Ok(changed)
        });
        let changed = result.map_err(from_transaction)?;
        let touched: Vec<ResourceKey> = states
            .iter()
            .flat_map(|(_, s)| &s.targets)
            .map(|name| ResourceKey::device(namespace, name))
            .collect();
        self.overrides_changed(&touched, changed, false).await
    }

    /// Every rule with a state kept for some device.
    pub fn rules_with_state(&self) -> Result<Vec<ResourceKey>, StoreError> {
        let mut rules: Vec<ResourceKey> = Vec::new();
        for item in self.rule_watches.iter() {
            let (k, _) = item?;
            let end = k.iter().position(|b| *b == 0).unwrap_or(k.len());
            let rule: ResourceKey = super::parse_key(&k[..end])?;
            if rules.last() != Some(&rule) {
                rules.push(rule);
            }
        }
        Ok(rules)
    }
}

fn forget_on(
    desired: &TransactionalTree,
    target: &ResourceKey,
    rule: &str,
    cause: &str,
) -> sled::transaction::ConflictableTransactionResult<bool, StoreError> {
    let k = target.to_string();
    let Some(held) = desired.get(k.as_bytes())? else {
        return Ok(false);
    };
    let mut device: DesiredDevice =
        decode(k.as_bytes(), &held).map_err(ConflictableTransactionError::Abort)?;
    // A rule leaving is the cloud's doing: what follows starts a chain.
    let changed = reset_overrides(&mut device, rule, cause, None, 0);
    desired.insert(k.as_bytes(), encode(&device))?;
    Ok(changed)
}
