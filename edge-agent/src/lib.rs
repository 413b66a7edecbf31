//! The Edgefleet edge agent: runs on each edge node, keeps the node's desired
//! state and the devices' reports in a local store, and syncs with the cloud.
//!
//! Written so far: [`store`]. The sync client, the CoAP server and the MQTT
//! side come next.

#![forbid(unsafe_code)]

pub mod store;
