//! `deploy/crds/` must be exactly what `edgefleet-cloud crds` prints, so the
//! manifests people apply are the ones the Rust types describe.

use std::process::Command;

#[test]
fn deploy_crds_match_the_generated_crds() {
    let out = Command::new(env!("CARGO_BIN_EXE_edgefleet-cloud"))
        .arg("crds")
        .output()
        .expect("run edgefleet-cloud crds");
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    let generated = String::from_utf8(out.stdout).unwrap();
    let path = concat!(env!("CARGO_MANIFEST_DIR"), "/../deploy/crds/edgefleet.yaml");
    let committed = std::fs::read_to_string(path).unwrap_or_default();
    assert!(
        generated == committed,
        "deploy/crds/edgefleet.yaml is stale; regenerate it with `make crds`"
    );
    for kind in [
        "kind: Device\n",
        "kind: EdgeNode\n",
        "kind: FleetRollout\n",
        "kind: ValidatingAdmissionPolicy\n",
        "kind: ValidatingAdmissionPolicyBinding\n",
    ] {
        assert!(generated.contains(kind), "{kind} missing from the CRDs");
    }
}
