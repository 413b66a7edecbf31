//! The Edgefleet cloud controller.
//!
//! Data flows one way: the Device reflector feeds the [`index`] (desired
//! state by edge node); the [`sync`] server turns each node's slice into
//! updates for its agent and hands what agents report to the [`status`]
//! writer, and keeps each agent's [`edge_node`] resource and the registry of
//! connected [`agents`] up to date. The Device [`reconcile`]r accepts
//! generations (`observedGeneration`) and holds a finalizer until the edge
//! dropped a deleted Device; steps people should see become Kubernetes
//! [`events`]. The [`rollout`] reconciler runs FleetRollouts over the
//! Devices. The [`rules`] reconciler accepts or refuses EdgeRules.
//! [`liveness`] marks nodes without an agent unreachable after
//! a grace period. [`shards`] and [`leases`] share the fleet between
//! replicas by edge node. [`tls`] secures the sync link. [`run`] wires them.
//! [`crds`] renders the API definitions.

#![forbid(unsafe_code)]

pub mod agent_certs;
pub mod agent_identity;
pub mod agents;
pub mod conditions;
pub mod crds;
pub mod credentials;
pub mod device_events;
pub mod edge_node;
pub mod events;
pub mod index;
pub mod lab_ca;
pub mod leases;
pub mod liveness;
pub mod reconcile;
pub mod rollout;
pub mod rules;
pub mod run;
pub mod shards;
pub mod status;
pub mod sync;
pub mod tls;
