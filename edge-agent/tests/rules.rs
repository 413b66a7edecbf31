//! The agent's rule engine over a real store on disk, driven report by
//! report: the `for` window and the cooldown, restore, two rules on one
//! property (priority, then name), the per-rule rate limit, a chain of
//! rules stopped at its depth bound, and a rule that leaves ending its
//! overrides. Every decision is read back from the store (overrides,
//! events in the outbox), as the device publishers and the uplink see it.

use std::collections::BTreeMap;
use std::sync::Arc;
use std::time::Duration;

use edgefleet_agent::rules::{Engine, RuleMetrics};
use edgefleet_agent::store::{Desired, DesiredDevice, Flow, HeldRule, PendingUplink, Store};
use edgefleet_shared::api::Transport;
use edgefleet_shared::codec::DeviceReport;
use edgefleet_shared::rule_engine::MAX_CHAIN_DEPTH;
use edgefleet_shared::{PropertyValue, ResourceKey, ResourceVersion, proto};

const NS: &str = "plant";

fn device(name: &str) -> (ResourceKey, Desired) {
    let desired = DesiredDevice::new(
        ResourceVersion::new(format!("uid-{name}"), 1),
        "valve",
        Transport::Mqtt,
        BTreeMap::from([("open".to_owned(), PropertyValue::Bool(true))]),
    );
    (ResourceKey::device(NS, name), desired.into())
}

/// A rule watching `watched`, setting `set` on `targets` (or on the watched
/// device itself when `targets` is empty) when `when` holds.
fn rule(
    name: &str,
    when: &str,
    watched: &[&str],
    targets: &[&str],
    set: &[(&str, PropertyValue)],
) -> proto::RuleDesired {
    proto::RuleDesired {
        namespace: NS.into(),
        name: name.into(),
        when: when.into(),
        set: set
            .iter()
            .map(|(k, v)| ((*k).to_owned(), v.into()))
            .collect(),
        set_on_targets: !targets.is_empty(),
        targets: targets.iter().map(|t| (*t).to_owned()).collect(),
        event: Some(proto::RuleEvent {
            r#type: proto::EventType::Warning as i32,
            reason: "Acted".into(),
            message: String::new(),
        }),
        restore: true,
        max_actions_per_minute: 60,
        watched: watched
            .iter()
            .map(|w| proto::WatchedDevice {
                name: (*w).to_owned(),
                labels: BTreeMap::new(),
            })
            .collect(),
        ..Default::default()
    }
}

fn held(rule: proto::RuleDesired) -> (ResourceKey, Desired) {
    let key = ResourceKey::rule(NS, &rule.name);
    let held = HeldRule {
        version: ResourceVersion::new(format!("uid-{}", rule.name), rule.digest()),
        rule,
    };
    (key, Desired::Rule(Box::new(held)))
}

struct Site {
    store: Store,
    engine: Engine,
    metrics: Arc<RuleMetrics>,
    _dir: tempfile::TempDir,
}

impl Site {
    async fn new(devices: &[&str], rules: Vec<proto::RuleDesired>) -> Site {
        let dir = tempfile::tempdir().unwrap();
        let store = Store::open(&dir.path().join("store")).unwrap().store;
        let mut upserts: Vec<(ResourceKey, Desired)> = devices.iter().map(|d| device(d)).collect();
        upserts.extend(rules.into_iter().map(held));
        store.apply(&upserts, &[]).await.unwrap();
        let metrics = Arc::new(RuleMetrics::default());
        let mut engine = Engine::new(store.clone(), Arc::clone(&metrics));
        engine.reload().await.unwrap();
        Site {
            store,
            engine,
            metrics,
            _dir: dir,
        }
    }

    /// `name` reports `x`; the engine judges it.
    async fn report(&mut self, name: &str, x: i64) {
        let key = ResourceKey::device(NS, name);
        let report = DeviceReport {
            applied_generation: 1,
            properties: BTreeMap::from([("x".to_owned(), PropertyValue::Int(x))]),
            firmware_version: None,
            firmware_failure: None,
        };
        self.store
            .record_report(&key, report, edgefleet_shared::now_unix_ms())
            .await
            .unwrap();
        self.engine.judge_device(&key).await.unwrap();
    }

    /// What `name` is told now: (open, override revision).
    fn told(&self, name: &str, property: &str) -> (Option<PropertyValue>, u64) {
        let desired = self
            .store
            .desired(&ResourceKey::device(NS, name))
            .unwrap()
            .unwrap();
        let wire = desired.to_wire();
        (wire.properties.get(property).cloned(), wire.local)
    }

    /// The rule events in the outbox: (device, reason, message).
    fn events(&self) -> Vec<(String, String, String)> {
        self.store
            .pending(Flow::Events, 0, 10_000)
            .unwrap()
            .into_iter()
            .filter_map(|(_, p)| match p {
                PendingUplink::Event { device, stored } => {
                    Some((device.name, stored.event.reason, stored.event.message))
                }
                _ => None,
            })
            .collect()
    }

    /// The `RuleRefused` events in the outbox: (device, reason, message).
    fn refusals(&self) -> Vec<(String, String, String)> {
        let mut events = self.events();
        events.retain(|(_, reason, _)| reason == "RuleRefused");
        events
    }

    fn decisions(&self, kind: &'static str) -> u64 {
        self.metrics
            .decisions
            .get_or_create(&edgefleet_agent::rules::DecisionLabel { decision: kind })
            .get()
    }
}

/// A rule `name` that closes the inlet while `when` holds for the boiler.
fn closes_inlet(name: &str, when: &str) -> proto::RuleDesired {
    rule(
        name,
        when,
        &["boiler"],
        &["inlet"],
        &[("open", false.into())],
    )
}

const CLOSED: Option<PropertyValue> = Some(PropertyValue::Bool(false));
const OPEN: Option<PropertyValue> = Some(PropertyValue::Bool(true));

#[tokio::test]
async fn a_rule_waits_out_its_for_window_and_restores_when_the_condition_clears() {
    let mut r = closes_inlet("hot", "reported.x > 80");
    r.for_seconds = 1;
    let mut site = Site::new(&["boiler", "inlet"], vec![r]).await;
    site.report("boiler", 85).await;
    assert_eq!(
        site.told("inlet", "open"),
        (OPEN, 0),
        "acted before the window ended"
    );
    // Held on: the window's end is noticed without another report.
    tokio::time::sleep(Duration::from_millis(1100)).await;
    site.engine.judge_pending().await.unwrap();
    assert_eq!(site.told("inlet", "open"), (CLOSED, 1));
    assert_eq!(site.events().len(), 1);
    // A blip under the threshold restores; holding again restarts the window.
    site.report("boiler", 70).await;
    assert_eq!(site.told("inlet", "open"), (OPEN, 2));
    site.report("boiler", 90).await;
    assert_eq!(site.told("inlet", "open"), (OPEN, 2));
    assert_eq!(site.decisions("act"), 1);
    assert_eq!(site.decisions("restore"), 1);
}

#[tokio::test]
async fn after_acting_a_rule_waits_its_cooldown_before_acting_again() {
    let mut r = closes_inlet("hot", "reported.x > 80");
    r.cooldown_seconds = 1;
    let mut site = Site::new(&["boiler", "inlet"], vec![r]).await;
    site.report("boiler", 85).await;
    assert_eq!(site.told("inlet", "open"), (CLOSED, 1));
    site.report("boiler", 70).await;
    assert_eq!(site.told("inlet", "open"), (OPEN, 2));
    site.report("boiler", 85).await;
    assert_eq!(
        site.told("inlet", "open"),
        (OPEN, 2),
        "acted inside the cooldown"
    );
    tokio::time::sleep(Duration::from_millis(1100)).await;
    site.engine.judge_pending().await.unwrap();
    assert_eq!(site.told("inlet", "open"), (CLOSED, 3));
    assert_eq!(site.events().len(), 2);
}

#[tokio::test]
async fn of_two_rules_on_one_property_the_higher_priority_wins_then_the_name() {
    let mut close = closes_inlet("close", "reported.x > 80");
    close.priority = 10;
    let mut open = rule(
        "open",
        "reported.x > 50",
        &["boiler"],
        &["inlet"],
        &[("open", true.into())],
    );
    open.priority = 5;
    // Same priority as `open`: `a-shut` sorts first and wins that tie.
    let mut tie = closes_inlet("a-shut", "reported.x > 60");
    tie.priority = 5;
    let mut site = Site::new(&["boiler", "inlet"], vec![close, open, tie]).await;

    site.report("boiler", 55).await; // only `open`: open (the spec's value too)
    assert_eq!(site.told("inlet", "open").0, OPEN);
    site.report("boiler", 65).await; // `open` and `a-shut` at 5: the name decides
    assert_eq!(site.told("inlet", "open").0, CLOSED);
    site.report("boiler", 85).await; // all three: `close` at 10
    assert_eq!(site.told("inlet", "open").0, CLOSED);
    let desired = site
        .store
        .desired(&ResourceKey::device(NS, "inlet"))
        .unwrap()
        .unwrap();
    let (_, conflicts) =
        edgefleet_shared::rule_engine::effective(&desired.properties, &desired.overrides);
    let mut losers: Vec<&str> = conflicts.iter().map(|c| c.loser.as_str()).collect();
    losers.sort();
    assert_eq!(losers, ["a-shut", "open"]);
    assert!(conflicts.iter().all(|c| c.winner == "close"));
    // Cooling restores each in turn: back to the spec.
    site.report("boiler", 20).await;
    assert_eq!(site.told("inlet", "open").0, OPEN);
    assert!(
        site.store
            .desired(&ResourceKey::device(NS, "inlet"))
            .unwrap()
            .unwrap()
            .overrides
            .is_empty()
    );
}

#[tokio::test]
async fn a_rule_over_its_rate_is_refused_once_per_spell_with_an_event() {
    let mut r = closes_inlet("hot", "reported.x > 80");
    r.max_actions_per_minute = 2;
    let mut site = Site::new(&["boiler", "inlet"], vec![r]).await;
    for _ in 0..2 {
        site.report("boiler", 85).await;
        site.report("boiler", 70).await;
    }
    site.report("boiler", 85).await;
    site.report("boiler", 86).await;
    assert_eq!(site.told("inlet", "open"), (OPEN, 4), "acted past its rate");
    assert_eq!(site.decisions("act"), 2);
    assert_eq!(
        site.decisions("rate_limited"),
        1,
        "refused once for the spell"
    );
    let refused = site.refusals();
    assert_eq!(refused.len(), 1);
    assert!(refused[0].2.contains("maxActionsPerMinute"), "{refused:?}");
}

#[tokio::test]
async fn a_chain_of_rules_stops_at_its_depth_bound() {
    // Rule i watches d{i} and sets x = 1 on d{i+1}; each device reports
    // what it is told, which makes the next rule act.
    let n = MAX_CHAIN_DEPTH as usize + 2;
    let names: Vec<String> = (0..=n).map(|i| format!("d{i}")).collect();
    let rules: Vec<proto::RuleDesired> = (0..n)
        .map(|i| {
            rule(
                &format!("r{i}"),
                "reported.x > 0",
                &[&names[i]],
                &[&names[i + 1]],
                &[("x", PropertyValue::Int(1))],
            )
        })
        .collect();
    let refs: Vec<&str> = names.iter().map(String::as_str).collect();
    let mut site = Site::new(&refs, rules).await;
    site.report("d0", 1).await;
    for name in &names[1..] {
        if site.told(name, "x").0 == Some(PropertyValue::Int(1)) {
            site.report(name, 1).await;
        }
    }
    let reached: Vec<&String> = names
        .iter()
        .filter(|d| site.told(d, "x").0.is_some())
        .collect();
    assert_eq!(reached.len(), MAX_CHAIN_DEPTH as usize, "{reached:?}");
    assert_eq!(site.decisions("chain_too_deep"), 1);
    let refused = site.refusals();
    assert_eq!(refused.len(), 1);
    assert!(refused[0].2.contains("deep"), "{refused:?}");
}

#[tokio::test]
async fn a_rule_that_leaves_the_agent_ends_its_overrides() {
    let r = rule(
        "hot",
        "reported.x > 80",
        &["boiler"],
        &[],
        &[("open", false.into())],
    );
    let key = ResourceKey::rule(NS, "hot");
    let mut site = Site::new(&["boiler"], vec![r]).await;
    site.report("boiler", 85).await;
    assert_eq!(site.told("boiler", "open"), (CLOSED, 1));
    site.store
        .apply::<DesiredDevice>(&[], std::slice::from_ref(&key))
        .await
        .unwrap();
    site.engine.reload().await.unwrap();
    assert_eq!(site.told("boiler", "open"), (OPEN, 2));
    assert!(site.store.rules_with_state().unwrap().is_empty());
}

#[tokio::test]
async fn two_rules_setting_and_restoring_each_others_device_stop_at_the_depth_bound() {
    // a runs at x = 1 on its own, b at 0. While a is at 1, ab puts b at 1;
    // while b is at 1, ba puts a at 0. Each restores when its condition
    // clears, which lets the other device go back: a loop that would go
    // on for ever. Restores are links of the chain too, so it stops.
    let x = |v: i64| [("x", PropertyValue::Int(v))];
    let rules = vec![
        rule("ab", "reported.x > 0", &["a"], &["b"], &x(1)),
        rule("ba", "reported.x > 0", &["b"], &["a"], &x(0)),
    ];
    let mut site = Site::new(&["a", "b"], rules).await;
    let x_of = |told: Option<PropertyValue>, natural: i64| match told {
        Some(PropertyValue::Int(v)) => v,
        _ => natural,
    };
    for _ in 0..20 {
        let a = x_of(site.told("a", "x").0, 1);
        site.report("a", a).await;
        let b = x_of(site.told("b", "x").0, 0);
        site.report("b", b).await;
    }
    // Acts at depths 1, 2, 5, 6; restores at 3, 4, 7, 8; the act at 9 is
    // refused, once.
    assert_eq!(site.decisions("act"), 4);
    assert_eq!(site.decisions("restore"), 4);
    assert_eq!(site.decisions("chain_too_deep"), 1);
    let refused = site.refusals();
    assert_eq!(refused.len(), 1, "{refused:?}");
    assert!(
        refused[0].0 == "a"
            && refused[0].2.contains("EdgeRule ab")
            && refused[0].2.contains("9 deep"),
        "{refused:?}"
    );
    // The loop is over: neither device is told anything by a rule.
    assert_eq!(site.told("a", "x").0, None);
    assert_eq!(site.told("b", "x").0, None);
    // A new generation of a (a person's change) starts its chains again;
    // without one, the next spell of ab is refused too.
    site.report("a", 0).await;
    site.report("a", 1).await;
    assert_eq!(site.decisions("chain_too_deep"), 2);
    let again = DesiredDevice::new(
        ResourceVersion::new("uid-a", 2),
        "valve",
        Transport::Mqtt,
        BTreeMap::new(),
    );
    let a = ResourceKey::device(NS, "a");
    site.store.apply(&[(a, again)], &[]).await.unwrap();
    site.report("a", 0).await;
    site.report("a", 1).await;
    assert_eq!(site.decisions("act"), 5, "acts at depth 1 again");
    assert_eq!(site.told("b", "x").0, Some(PropertyValue::Int(1)));
}
