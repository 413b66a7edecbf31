//! The EdgeRules at this agent: compiled once when they arrive, judged on
//! every durable report of a device they watch (and every second while a
//! `for` window runs), with or without the cloud.
//!
//! A decision ([`edgefleet_shared::rule_engine::step`]) is written to the
//! store in one transaction with its overrides and its event
//! ([`Store::decide`]) before any device is told; the device publishers
//! then tell the targets at once (MQTT retained, CoAP Observe), and the
//! event goes up through the outbox like a device's own. A rule that
//! leaves the agent ends its overrides.
//!
//! Not kept across a restart: the per-rule rate window (a restarted agent
//! may act up to `maxActionsPerMinute` times again within that minute).
//! `online` is true when judged: rules are judged on reports.

use std::collections::{BTreeMap, BTreeSet, HashMap, VecDeque};
use std::time::Duration;

use edgefleet_shared::rule_engine::{self, Decision as Step, Refusal, Timing};
use edgefleet_shared::rule_when::{Facts, When};
use edgefleet_shared::{PropertyValue, ResourceKey, ResourceVersion, proto};
use prometheus_client::encoding::EncodeLabelSet;
use prometheus_client::metrics::counter::Counter;
use prometheus_client::metrics::family::Family;
use prometheus_client::registry::Registry;
use tokio::sync::broadcast::error::RecvError;

use crate::store::rules::{Decision, OverrideChange, RuleEventOut};
use crate::store::{LatestReport, Store, StoreError};

/// How often rules holding inside a `for` window are judged again, so
/// they act when it ends without waiting for the next report.
const WINDOW_TICK: Duration = Duration::from_secs(1);

/// The rule engine's counters.
#[derive(Debug, Default)]
pub struct RuleMetrics {
    /// Conditions judged.
    pub evaluations: Counter,
    /// Decisions made durable, by kind (act, restore, refused).
    pub decisions: Family<DecisionLabel, Counter>,
}

/// The kind of a decision.
#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
pub struct DecisionLabel {
    /// act, restore, rate_limited, chain_too_deep.
    pub decision: &'static str,
}

impl RuleMetrics {
    /// Registers the counters.
    pub fn register(&self, registry: &mut Registry) {
        registry.register(
            "rule_evaluations",
            "EdgeRule conditions judged",
            self.evaluations.clone(),
        );
        registry.register(
            "rule_decisions",
            "EdgeRule decisions made durable, by kind (act, restore, rate_limited, chain_too_deep)",
            self.decisions.clone(),
        );
    }
}

/// One rule, compiled.
struct Compiled {
    version: ResourceVersion,
    rule: proto::RuleDesired,
    when: When,
    timing: Timing,
    set: BTreeMap<String, PropertyValue>,
    // Watched device name → its labels.
    watched: HashMap<String, BTreeMap<String, String>>,
}

/// The rules and what they did lately.
pub struct Engine {
    store: Store,
    rules: BTreeMap<ResourceKey, Compiled>,
    // When each rule acted in the last minute, oldest first.
    acted: HashMap<ResourceKey, VecDeque<i64>>,
    // (rule, device) pairs inside a `for` window, judged every tick.
    pending: BTreeSet<(ResourceKey, String)>,
    metrics: std::sync::Arc<RuleMetrics>,
}

impl std::fmt::Debug for Engine {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Engine")
            .field("rules", &self.rules.keys().collect::<Vec<_>>())
            .finish_non_exhaustive()
    }
}

/// Runs the rules of `store` until the process ends.
pub async fn run(store: Store, metrics: std::sync::Arc<RuleMetrics>) {
    let mut reports = store.watch_reports();
    let changed = store.rules_changed();
    let mut engine = Engine::new(store, metrics);
    let mut tick = tokio::time::interval(WINDOW_TICK);
    tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
    if let Err(error) = engine.reload().await {
        tracing::error!(%error, "cannot read the rules");
    }
    loop {
        let result = tokio::select! {
            report = reports.recv() => match report {
                Ok(device) => engine.judge_device(&device).await,
                Err(RecvError::Lagged(_)) => engine.judge_all().await,
                Err(RecvError::Closed) => return,
            },
            () = changed.notified() => engine.reload().await,
            _ = tick.tick() => engine.judge_pending().await,
        };
        if let Err(error) = result {
            tracing::error!(%error, "rule engine: store failed");
        }
    }
}

impl Engine {
    /// An engine over `store`'s rules (none loaded yet).
    pub fn new(store: Store, metrics: std::sync::Arc<RuleMetrics>) -> Self {
        Engine {
            store,
            rules: BTreeMap::new(),
            acted: HashMap::new(),
            pending: BTreeSet::new(),
            metrics,
        }
    }

    /// Compiles the rules the store holds (those it already has compiled
    /// at the same version are kept), ends what rules that left did, and
    /// judges every watched device.
    pub async fn reload(&mut self) -> Result<(), StoreError> {
        let held = self.store.rules()?;
        let mut rules = BTreeMap::new();
        for (key, held) in held {
            if let Some(compiled) = self.rules.remove(&key)
                && compiled.version == held.version
            {
                rules.insert(key, compiled);
                continue;
            }
            match compile(held.version, held.rule) {
                Ok(compiled) => {
                    rules.insert(key, compiled);
                }
                // Refused when it arrived; a store from an older agent
                // could still hold one.
                Err(error) => tracing::warn!(rule = %key, %error, "rule does not compile; not run"),
            }
        }
        self.rules = rules;
        for gone in self.store.rules_with_state()? {
            let still = self.rules.get(&gone);
            if still.is_none() {
                let changed = self.store.forget_rule(&gone).await?;
                tracing::info!(rule = %gone, devices = changed.len(), "rule left this agent; its overrides ended");
                self.acted.remove(&gone);
            }
        }
        self.pending
            .retain(|(rule, _)| self.rules.contains_key(rule));
        self.judge_all().await
    }

    /// Judges every rule for every device it watches.
    pub async fn judge_all(&mut self) -> Result<(), StoreError> {
        let devices: BTreeSet<ResourceKey> = self
            .rules
            .iter()
            .flat_map(|(key, c)| {
                c.watched
                    .keys()
                    .map(|d| ResourceKey::device(&key.namespace, d))
            })
            .collect();
        for device in devices {
            self.judge_device(&device).await?;
        }
        Ok(())
    }

    /// Judges the pairs inside a `for` window, so they act when it ends
    /// even if no report comes.
    pub async fn judge_pending(&mut self) -> Result<(), StoreError> {
        let pending: Vec<(ResourceKey, String)> = self.pending.iter().cloned().collect();
        for (rule, device) in pending {
            self.judge_pair(&rule, &device).await?;
        }
        Ok(())
    }

    /// Judges every rule that watches `device`, reading its report once.
    pub async fn judge_device(&mut self, device: &ResourceKey) -> Result<(), StoreError> {
        let rules: Vec<ResourceKey> = self
            .rules
            .iter()
            .filter(|(key, c)| {
                key.namespace == device.namespace && c.watched.contains_key(&device.name)
            })
            .map(|(key, _)| key.clone())
            .collect();
        if rules.is_empty() {
            return Ok(());
        }
        let Some(latest) = self.store.latest_report(device)? else {
            return Ok(());
        };
        let mut depth = self.depth_on(device)?;
        for rule in rules {
            let changed = self.judge(&rule, device, &latest, depth).await?;
            // A rule that changed this very device deepens the chain for
            // the rules after it.
            if changed.contains(device) {
                depth = self.depth_on(device)?;
            }
        }
        Ok(())
    }

    /// One rule for one device, reading what it needs.
    async fn judge_pair(&mut self, rule: &ResourceKey, device: &str) -> Result<(), StoreError> {
        let device = ResourceKey::device(&rule.namespace, device);
        let Some(latest) = self.store.latest_report(&device)? else {
            return Ok(());
        };
        let depth = self.depth_on(&device)?;
        self.judge(rule, &device, &latest, depth).await?;
        Ok(())
    }

    /// How deep in a chain of rules a decision on `device`'s report is:
    /// one deeper than the last rule change to what it is told.
    fn depth_on(&self, device: &ResourceKey) -> Result<u32, StoreError> {
        let chain = self.store.desired(device)?.map_or(0, |d| d.chain);
        Ok(chain.saturating_add(1))
    }

    /// One rule for one device, on its latest report, at `depth` in a
    /// chain of rules; returns the devices whose desired state the
    /// decision changed.
    async fn judge(
        &mut self,
        key: &ResourceKey,
        device_key: &ResourceKey,
        latest: &LatestReport,
        depth: u32,
    ) -> Result<Vec<ResourceKey>, StoreError> {
        let Some(rule) = self.rules.get(key) else {
            return Ok(Vec::new());
        };
        let device = device_key.name.as_str();
        let no_labels = BTreeMap::new();
        let judged = rule.when.judge(Facts {
            reported: &latest.report.properties,
            online: true,
            firmware: latest.report.firmware_version.as_deref(),
            labels: rule.watched.get(device).unwrap_or(&no_labels),
        });
        self.metrics.evaluations.inc();
        let state = self.store.rule_state(key, device)?;
        let now = edgefleet_shared::now_unix_ms();
        let acted = self.acted.entry(key.clone()).or_default();
        while acted.front().is_some_and(|t| now - t >= 60_000) {
            acted.pop_front();
        }
        let (watch, step) = rule_engine::step(
            &rule.timing,
            &state.watch,
            &judged,
            now,
            u32::try_from(acted.len()).unwrap_or(u32::MAX),
            depth,
        );
        let pair = (key.clone(), device.to_owned());
        if watch.holding_since_ms.is_some() && !watch.active {
            self.pending.insert(pair);
        } else {
            self.pending.remove(&pair);
        }
        if step.is_none() && watch == state.watch {
            return Ok(Vec::new());
        }
        let name = &rule.rule.name;
        let (overrides, event, label) = match &step {
            None => (OverrideChange::Keep, None, None),
            Some(Step::Act) => {
                acted.push_back(now);
                let overrides = if rule.set.is_empty() {
                    OverrideChange::Keep
                } else {
                    OverrideChange::Set {
                        targets: if rule.rule.set_on_targets {
                            rule.rule.targets.clone()
                        } else {
                            vec![device.to_owned()]
                        },
                        set: rule.set.clone(),
                        priority: rule.rule.priority,
                    }
                };
                let event = rule.rule.event.as_ref().map(|e| RuleEventOut {
                    warning: e.r#type == proto::EventType::Warning as i32,
                    reason: e.reason.clone(),
                    message: if e.message.is_empty() {
                        format!("EdgeRule {name} acted")
                    } else {
                        format!("EdgeRule {name}: {}", e.message)
                    },
                });
                (overrides, event, Some("act"))
            }
            Some(Step::Restore) => (OverrideChange::End, None, Some("restore")),
            Some(Step::Refused(refusal)) => {
                let (label, why) = match refusal {
                    Refusal::RateLimited => (
                        "rate_limited",
                        format!(
                            "it acted {} times in the last minute at this node (maxActionsPerMinute)",
                            rule.timing.max_per_minute
                        ),
                    ),
                    Refusal::ChainTooDeep => (
                        "chain_too_deep",
                        format!(
                            "the chain of rules that led here is {depth} deep; at most {} may follow one another",
                            rule_engine::MAX_CHAIN_DEPTH
                        ),
                    ),
                };
                let event = RuleEventOut {
                    warning: true,
                    reason: "RuleRefused".into(),
                    message: format!("EdgeRule {name} would act but is refused: {why}"),
                };
                (OverrideChange::Keep, Some(event), Some(label))
            }
        };
        let decision = Decision {
            rule: key.clone(),
            device: device_key.clone(),
            watch,
            overrides,
            event,
            at_ms: now,
            depth,
        };
        let changed = self.store.decide(&decision).await?;
        if let Some(label) = label {
            self.metrics
                .decisions
                .get_or_create(&DecisionLabel { decision: label })
                .inc();
            tracing::info!(rule = %key, device, decision = label, told = changed.len(), "rule decided");
        }
        Ok(changed)
    }
}

/// A rule as the engine runs it, or why it cannot.
fn compile(version: ResourceVersion, mut rule: proto::RuleDesired) -> Result<Compiled, String> {
    let when = When::compile(&rule.when).map_err(|e| e.to_string())?;
    let set = rule
        .set
        .iter()
        .map(|(k, v)| Ok((k.clone(), PropertyValue::try_from(v)?)))
        .collect::<Result<BTreeMap<_, _>, proto::MissingField>>()
        .map_err(|e| e.to_string())?;
    let timing = Timing {
        for_ms: i64::from(rule.for_seconds) * 1000,
        cooldown_ms: i64::from(rule.cooldown_seconds) * 1000,
        restore: rule.restore,
        max_per_minute: rule.max_actions_per_minute.max(1),
    };
    // Kept once, as a map (a rule may watch thousands of devices).
    let watched = std::mem::take(&mut rule.watched)
        .into_iter()
        .map(|w| (w.name, w.labels))
        .collect();
    Ok(Compiled {
        version,
        rule,
        when,
        timing,
        set,
        watched,
    })
}
