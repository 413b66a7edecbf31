//! The Edgefleet edge agent: runs on each edge node, keeps the node's desired
//! state and the devices' reports in a local store, and syncs with the cloud.
//!
//! Written so far: the [`store`], the [`sync`] client and the [`coap`] server
//! for device reports. The MQTT side (desired state to devices, reports from
//! MQTT devices) comes next.

#![forbid(unsafe_code)]

pub mod coap;
pub mod store;
pub mod sync;
