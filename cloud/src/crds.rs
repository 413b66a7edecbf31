//! The `crds` command: Edgefleet's API definitions as one multi-document YAML
//! stream: the CRDs, then the admission policies that complete their checks.

use edgefleet_shared::api::{crds, policy};
use serde_json::to_value;

/// Renders every CRD and the admission policies with their bindings, one
/// YAML document each. `deploy/crds/edgefleet.yaml` holds this output; a test
/// keeps the two equal.
pub fn render() -> anyhow::Result<String> {
    let mut docs = crds().iter().map(to_value).collect::<Result<Vec<_>, _>>()?;
    for (policy, binding) in policy::policies() {
        docs.push(to_value(policy)?);
        docs.push(to_value(binding)?);
    }

    let mut out = String::new();
    for doc in docs {
        out.push_str("---\n");
        out.push_str(&serde_yaml_ng::to_string(&doc)?);
    }
    Ok(out)
}
