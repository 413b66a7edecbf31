//! The Edgefleet cloud controller.
//!
//! Data flows one way: the Device reflector feeds the [`index`] (desired
//! state by edge node); the [`sync`] server turns each node's slice into
//! updates for its agent and hands what agents report to the [`status`]
//! writer; [`run`] wires them. [`crds`] renders the API definitions.

#![forbid(unsafe_code)]

pub mod crds;
pub mod index;
pub mod run;
pub mod status;
pub mod sync;
