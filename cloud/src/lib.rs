//! The Edgefleet cloud controller.
//!
//! Written so far: [`crds`] (the API definitions the `crds` command prints)
//! and [`index`] (desired state by edge node, and the difference an agent
//! must be sent). The reconcilers and the sync server come next.

#![forbid(unsafe_code)]

pub mod crds;
pub mod index;
