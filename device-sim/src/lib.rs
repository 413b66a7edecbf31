//! Edgefleet's device simulator: thousands of simulated devices in one
//! process, reporting to their edge agents over CoAP or MQTT and applying the
//! desired states the agents publish over MQTT.
//!
//! The pure parts (what the fleet looks like, what each model does, CoAP
//! retransmission bookkeeping, the counters) are separate from the I/O
//! (the CoAP client, the MQTT sessions, the device tasks):
//!
//! - [`fleet`]: names, nodes, models and transports of the devices;
//! - [`model`]: the device models; [`device`]: one device without I/O;
//!   [`firmware`]: install times, failures and bad versions;
//! - [`manifest`]: the Device resources of a fleet and their key Secrets;
//!   [`keys`]: the devices' keys, derived from one fleet key;
//! - [`retransmit`]: RFC 7252 retransmission schedule;
//! - [`coap`]: the shared CoAP client; [`mqtt`]: each device's MQTT session;
//! - [`applied_log`]: the latency log; [`summary`]: counters;
//! - [`run()`]: the simulation itself, configured by [`RunConfig`].

#![forbid(unsafe_code)]

pub mod applied_log;
pub mod coap;
pub mod config;
pub mod device;
pub mod dtls;
pub mod events;
pub mod firmware;
pub mod fleet;
pub mod keys;
pub mod manifest;
pub mod model;
pub mod mqtt;
pub mod retransmit;
mod run;
pub mod summary;

pub use config::{NodeEndpoint, RunConfig};
pub use run::run;
pub use summary::Summary;
