//! Edgefleet's shared contracts: what the cloud controller, the edge agent and
//! the device simulator must agree on.
//!
//! - [`api`]: the custom resources (Device, EdgeNode, FleetRollout,
//!   EdgeRule) and their schemas;
//! - [`proto`]: the sync protocol between cloud and agent (gRPC);
//! - [`codec`]: the CBOR wire format between agent and devices, and
//!   [`topics`]: the MQTT topics it travels on;
//! - [`version`], [`property`], [`key`]: the small value types all of them use;
//! - [`telemetry`]: the operator endpoints and log setup every process shares;
//! - [`heartbeat`]: dead-peer detection on the sync stream;
//! - [`holdings`]: the digest of what an agent holds, for a short Hello.

#![forbid(unsafe_code)]
#![deny(missing_docs)]

pub mod api;
mod cel_names;
pub mod codec;
pub mod credential;
pub mod dtls;
pub mod health;
pub mod health_check;
pub mod health_gate;
pub mod heartbeat;
pub mod holdings;
pub mod key;
pub mod model;
pub mod property;
pub mod proto;
pub mod rollout_member;
pub mod rollout_plan;
pub mod rollout_step;
pub mod rule_engine;
pub mod rule_when;
pub mod site_pacing;
pub mod site_rollback;
pub mod telemetry;
pub mod topics;
pub mod version;

pub use key::{ResourceKey, ResourceKind};
pub use property::PropertyValue;
pub use version::{FirmwareVersion, ResourceVersion};

/// The wall clock in Unix milliseconds, as the protocols carry time.
pub fn now_unix_ms() -> i64 {
    std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map(|d| d.as_millis() as i64)
        .unwrap_or_default()
}
