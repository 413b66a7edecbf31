//! Setting a status condition the Kubernetes way: the transition time moves
//! only when the condition's status does.

use k8s_openapi::apimachinery::pkg::apis::meta::v1::Condition;

/// Puts `wanted` into `conditions`, replacing the condition of its type.
/// If that condition already had the same status, its transition time stays.
pub fn set(conditions: &mut Vec<Condition>, wanted: Condition) {
    match conditions.iter_mut().find(|c| c.type_ == wanted.type_) {
        Some(c) if c.status == wanted.status => {
            c.reason = wanted.reason;
            c.message = wanted.message;
            c.observed_generation = wanted.observed_generation;
        }
        Some(c) => *c = wanted,
        None => conditions.push(wanted),
    }
}
