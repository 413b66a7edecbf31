//! The Edgefleet cloud controller.
//!
//! Data flows one way: the Device reflector feeds the [`index`] (desired
//! state by edge node); the [`sync`] server turns each node's slice into
//! updates for its agent and hands what agents report to the [`status`]
//! writer, and keeps each agent's [`edge_node`] resource up to date; [`run`]
//! wires them. [`crds`] renders the API definitions.

#![forbid(unsafe_code)]

pub mod conditions;
pub mod crds;
pub mod edge_node;
pub mod index;
pub mod run;
pub mod status;
pub mod sync;
