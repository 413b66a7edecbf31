//! The Kubernetes Events that device events became, read back for checks.

use std::collections::BTreeMap;

use edgefleet_cloud::device_events::{CONTROLLER, EVENT_ID_ANNOTATION};
use k8s_openapi::api::events::v1::Event;
use kube::{Api, Client};

/// The device event ids that arrived in namespace `ns`, per Device name, in
/// the order they were listed (sorted), with repeats kept so a test can
/// tell "once" from "twice".
pub async fn device_event_ids(
    client: &Client,
    ns: &str,
) -> anyhow::Result<BTreeMap<String, Vec<u64>>> {
    let events: Api<Event> = Api::namespaced(client.clone(), ns);
    let mut ids: BTreeMap<String, Vec<u64>> = BTreeMap::new();
    for event in events.list(&Default::default()).await?.items {
        if event.reporting_controller.as_deref() != Some(CONTROLLER) {
            continue;
        }
        let Some(device) = event.regarding.as_ref().and_then(|r| r.name.clone()) else {
            continue;
        };
        let id = event
            .metadata
            .annotations
            .as_ref()
            .and_then(|a| a.get(EVENT_ID_ANNOTATION))
            .and_then(|id| id.parse().ok())
            .ok_or_else(|| anyhow::anyhow!("device Event {:?} has no id", event.metadata.name))?;
        ids.entry(device).or_default().push(id);
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
