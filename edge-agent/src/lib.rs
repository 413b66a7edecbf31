//! The Edgefleet edge agent: runs on each edge node, keeps the node's desired
//! state and the devices' reports in a local store, and syncs with the cloud.
//!
//! Written so far: the [`store`] and the [`sync`] client. The CoAP server and
//! the MQTT side come next.

#![forbid(unsafe_code)]

pub mod store;
pub mod sync;
