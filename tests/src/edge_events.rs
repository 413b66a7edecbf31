//! The Kubernetes Events that device events became, read back for checks.

use std::collections::BTreeMap;

use edgefleet_cloud::device_events::{CONTROLLER, EVENT_BOOT_ANNOTATION, EVENT_ID_ANNOTATION};

use crate::final_state::EventId;
use k8s_openapi::api::events::v1::Event;
use kube::{Api, Client};

/// The device events that arrived in namespace `ns` as (boot epoch, id),
/// per Device name, sorted, with repeats kept so a test can tell "once"
/// from "twice".
pub async fn device_event_ids(
    client: &Client,
    ns: &str,
) -> anyhow::Result<BTreeMap<String, Vec<EventId>>> {
    let events: Api<Event> = Api::namespaced(client.clone(), ns);
    let mut ids: BTreeMap<String, Vec<EventId>> = BTreeMap::new();
    for event in events.list(&Default::default()).await?.items {
        if event.reporting_controller.as_deref() != Some(CONTROLLER) {
            continue;
        }
        let Some(device) = event.regarding.as_ref().and_then(|r| r.name.clone()) else {
            continue;
        };
        let annotation = |name| {
            event
                .metadata
                .annotations
                .as_ref()
                .and_then(|a| a.get(name))
                .map(|v| v.parse::<u64>())
        };
        let id = annotation(EVENT_ID_ANNOTATION)
            .and_then(Result::ok)
            .ok_or_else(|| anyhow::anyhow!("device Event {:?} has no id", event.metadata.name))?;
        let boot = annotation(EVENT_BOOT_ANNOTATION)
            .transpose()
            .map_err(|e| anyhow::anyhow!("device Event {:?}: boot {e}", event.metadata.name))?
            .unwrap_or(0);
        ids.entry(device).or_default().push((boot, id));
    }
    for list in ids.values_mut() {
        list.sort_unstable();
    }
    Ok(ids)
}

/// The Warning Events about EdgeNode `node` saying device events were
/// dropped at its agent's bound: their notes.
pub async fn dropped_notices(client: &Client, node: &str) -> anyhow::Result<Vec<String>> {
    let events: Api<Event> = Api::namespaced(client.clone(), "default");
    Ok(events
        .list(&Default::default())
        .await?
        .items
        .into_iter()
        .filter(|e| {
            e.reason.as_deref() == Some("DeviceEventsDropped")
                && e.regarding.as_ref().and_then(|r| r.name.as_deref()) == Some(node)
        })
        .filter_map(|e| e.note)
        .collect())
}

/// Waits until every event the simulator raised (its final-state file) is
/// a Kubernetes Event in `ns` exactly once, and fails if one was never
/// confirmed to its device, is missing or is there twice. Devices in
/// `deleted` are left out: the events of a deleted Device that had not
/// reached the cloud are refused there (`unknown_device`). Returns how many
/// events were raised.
pub async fn wait_exactly_once(
    client: &Client,
    ns: &str,
    final_state: &std::path::Path,
    deleted: &[String],
    patience: std::time::Duration,
) -> anyhow::Result<usize> {
    let mut raised = crate::final_state::read_final_events(final_state)?;
    raised.retain(|name, _| !deleted.contains(name));
    let unconfirmed: Vec<String> = raised
        .iter()
        .filter(|(_, e)| !e.unconfirmed_events.is_empty())
        .map(|(name, e)| format!("{name}: {:?}", e.unconfirmed_events))
        .collect();
    anyhow::ensure!(
        unconfirmed.is_empty(),
        "events never confirmed by the agent: {}",
        unconfirmed.join(", ")
    );
    let expected: BTreeMap<String, Vec<EventId>> = raised
        .into_iter()
        .filter(|(_, e)| !e.events.is_empty())
        .map(|(name, mut e)| {
            e.events.sort_unstable();
            (name, e.events)
        })
        .collect();
    let total = expected.values().map(Vec::len).sum();
    let deadline = tokio::time::Instant::now() + patience;
    loop {
        let mut arrived = device_event_ids(client, ns).await?;
        arrived.retain(|name, _| !deleted.contains(name));
        if arrived == expected {
            return Ok(total);
        }
        if tokio::time::Instant::now() > deadline {
            let mut names: Vec<&String> = expected.keys().chain(arrived.keys()).collect();
            names.sort();
            names.dedup();
            let wrong: Vec<String> = names
                .into_iter()
                .filter(|name| expected.get(*name) != arrived.get(*name))
                .map(|name| {
                    format!(
                        "{name}: raised {:?}, arrived {:?}",
                        expected.get(name),
                        arrived.get(name)
                    )
                })
                .collect();
            anyhow::bail!("events lost or repeated:\n{}", wrong.join("\n"));
        }
        tokio::time::sleep(std::time::Duration::from_millis(500)).await;
    }
}
