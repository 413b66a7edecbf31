//! The manifests under `deploy/` as Kubernetes objects, and server-side
//! apply of any of them (or of any object) where it belongs.

use std::path::{Path, PathBuf};

use kube::api::{DynamicObject, Patch, PatchParams};
use kube::core::GroupVersionKind;
use kube::discovery::{self, Scope};
use kube::{Api, Client};
use serde::Deserialize;
use serde::de::DeserializeOwned;
use serde_json::Value;

/// One YAML document of a file under `deploy/`.
#[derive(Clone, Debug)]
pub struct Manifest {
    /// `cloud/rbac.yaml#2`: the file under `deploy/` and the document's
    /// position in it, for messages.
    pub origin: String,
    /// The object.
    pub object: DynamicObject,
}

impl Manifest {
    pub fn kind(&self) -> &str {
        self.object
            .types
            .as_ref()
            .map(|t| t.kind.as_str())
            .unwrap_or_default()
    }

    pub fn name(&self) -> &str {
        self.object.metadata.name.as_deref().unwrap_or_default()
    }

    /// The document as a typed object.
    pub fn typed<K: DeserializeOwned>(&self) -> K {
        let value = serde_json::to_value(&self.object).expect("a manifest is JSON");
        serde_json::from_value(value)
            .unwrap_or_else(|e| panic!("{}: not a {}: {e}", self.origin, self.kind()))
    }
}

pub fn deploy_dir() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("../deploy")
}

/// Every `.yaml`/`.yml` file under `dir`, recursively, in a stable order,
/// leaving out the directories named in `skip` (relative to `deploy/`).
fn yaml_files(dir: &Path, skip: &[&str], out: &mut Vec<PathBuf>) {
    let mut entries: Vec<PathBuf> = std::fs::read_dir(dir)
        .unwrap_or_else(|e| panic!("read {}: {e}", dir.display()))
        .map(|entry| entry.expect("a directory entry").path())
        .collect();
    entries.sort();
    for path in entries {
        let relative = path.strip_prefix(deploy_dir()).unwrap_or(&path).to_owned();
        if skip.iter().any(|s| relative == Path::new(s)) {
            continue;
        }
        if path.is_dir() {
            yaml_files(&path, skip, out);
        } else if path
            .extension()
            .is_some_and(|ext| ext == "yaml" || ext == "yml")
        {
            out.push(path);
        }
    }
}

/// The documents of the files under `deploy/<dir>`, except `skip`.
pub fn manifests(dir: &str, skip: &[&str]) -> Vec<Manifest> {
    let mut files = Vec::new();
    yaml_files(&deploy_dir().join(dir), skip, &mut files);
    assert!(!files.is_empty(), "no manifests under deploy/{dir}");
    let mut manifests = Vec::new();
    for file in files {
        let text = std::fs::read_to_string(&file).expect("read a manifest");
        let relative = file
            .strip_prefix(deploy_dir())
            .unwrap()
            .display()
            .to_string();
        for (i, document) in serde_yaml_ng::Deserializer::from_str(&text).enumerate() {
            let origin = format!("{relative}#{}", i + 1);
            let value =
                Value::deserialize(document).unwrap_or_else(|e| panic!("{origin}: not YAML: {e}"));
            if value.is_null() {
                continue; // an empty document, e.g. only comments
            }
            let object: DynamicObject = serde_json::from_value(value)
                .unwrap_or_else(|e| panic!("{origin}: not a Kubernetes object: {e}"));
            assert!(object.types.is_some(), "{origin}: no apiVersion and kind");
            assert!(object.metadata.name.is_some(), "{origin}: no metadata.name");
            manifests.push(Manifest { origin, object });
        }
    }
    manifests
}

/// What an operator installs: everything under `deploy/` but the CRDs and
/// the examples, the Namespace first (as `kubectl apply` needs it).
pub fn install_manifests() -> Vec<Manifest> {
    let mut manifests = manifests(".", &["crds", "examples"]);
    manifests.sort_by_key(|m| m.kind() != "Namespace");
    manifests
}

pub fn example_manifests() -> Vec<Manifest> {
    manifests("examples", &[])
}

/// The one install manifest of this kind and name.
pub fn find<'a>(manifests: &'a [Manifest], kind: &str, name: &str) -> &'a Manifest {
    let found: Vec<&Manifest> = manifests
        .iter()
        .filter(|m| m.kind() == kind && m.name() == name)
        .collect();
    assert_eq!(
        found.len(),
        1,
        "expected one {kind} {name}, found {found:?}"
    );
    found[0]
}

/// Server-side applies `object` where it belongs: cluster-scoped, or in the
/// namespace it names.
pub async fn apply(
    client: &Client,
    object: &DynamicObject,
    params: &PatchParams,
) -> Result<DynamicObject, kube::Error> {
    let types = object.types.as_ref().expect("apiVersion and kind");
    let gvk = GroupVersionKind::try_from(types).expect("a well-formed apiVersion");
    let (resource, capabilities) = discovery::pinned_kind(client, &gvk).await?;
    let name = object.metadata.name.as_deref().expect("a name");
    let api: Api<DynamicObject> = match capabilities.scope {
        Scope::Cluster => Api::all_with(client.clone(), &resource),
        Scope::Namespaced => {
            let namespace = object
                .metadata
                .namespace
                .as_deref()
                .unwrap_or_else(|| panic!("{} {name} names no namespace", types.kind));
            Api::namespaced_with(client.clone(), namespace, &resource)
        }
    };
    api.patch(name, params, &Patch::Apply(object)).await
}
