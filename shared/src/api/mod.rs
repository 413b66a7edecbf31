//! The Kubernetes API of Edgefleet: custom resources in group `edgefleet.io`.

pub mod device;
pub mod edge_node;
pub mod policy;
pub mod rollout;
pub mod rule;
pub mod schema;

pub use device::{
    Device, DevicePhase, DeviceSpec, DeviceStatus, FirmwareSpec, ReportOrigin, Transport,
};
pub use edge_node::{EdgeNode, EdgeNodeSpec, EdgeNodeStatus};
pub use rollout::{FleetRollout, FleetRolloutSpec, FleetRolloutStatus};
pub use rule::{EdgeRule, EdgeRuleSpec, EdgeRuleStatus};

use k8s_openapi::apiextensions_apiserver::pkg::apis::apiextensions::v1::CustomResourceDefinition;
use kube::CustomResourceExt;

/// The API group of every Edgefleet resource.
pub const GROUP: &str = "edgefleet.io";

/// Every custom resource definition Edgefleet installs, in a stable order.
pub fn crds() -> Vec<CustomResourceDefinition> {
    vec![
        Device::crd(),
        EdgeNode::crd(),
        FleetRollout::crd(),
        EdgeRule::crd(),
    ]
}
