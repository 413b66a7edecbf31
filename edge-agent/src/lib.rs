//! The Edgefleet edge agent: runs on each edge node, keeps the node's desired
//! state and the devices' reports in a local store, and syncs with the cloud.
//!
//! - [`store`]: desired state, latest reports and the outbox, in sled;
//! - [`sync`]: the client of the cloud's sync stream;
//! - [`coap`]: the CoAP server devices report to and read (or observe)
//!   their desired state from;
//! - [`mqtt`]: desired state out and MQTT devices' reports in, on the site
//!   broker (embedded by default);
//! - [`site_pacing`]: a rollout's per-site limit and canary, enforced by
//!   the agent on the generations it holds back;
//! - [`site_rollback`]: a rollout's per-site failure threshold, judged and
//!   acted on by the agent while the cloud is unreachable;
//! - [`rules`]: the EdgeRules the cloud sent, judged on every report and
//!   acted on at once, with or without the cloud.

#![forbid(unsafe_code)]

pub mod coap;
pub mod mqtt;
pub mod rules;
pub mod site_pacing;
pub mod site_rollback;
pub mod store;
pub mod sync;
