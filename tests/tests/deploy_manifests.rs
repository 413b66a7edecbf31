//! The manifests in `deploy/` against a real kube-apiserver: every document
//! an operator applies is accepted with strict field validation (a misspelt
//! field fails the test), the examples are valid Devices the simulator's
//! models understand, the controller's RBAC grants what the controller does
//! and nothing else (asked of the RBAC authorizer itself), the controller's
//! pod meets the `restricted` Pod Security level, and the pieces refer to
//! each other correctly (ports, names, environment variables the binaries
//! read), which no API server checks.
//!
//! `deploy/crds/` is not applied here: the harness installs the same CRDs and
//! policy from the Rust types, and `cloud/tests/crds.rs` keeps the file equal
//! to them.

use std::collections::{BTreeMap, BTreeSet};
use std::net::SocketAddr;
use std::path::Path;

use edgefleet_shared::api::{Device, Transport};
use edgefleet_sim::model::ModelKind;
use edgefleet_tests::manifests::{Manifest, apply, example_manifests, find, install_manifests};
use edgefleet_tests::{control_plane, eventually, test_namespace};
use k8s_openapi::api::apps::v1::{DaemonSet, Deployment};
use k8s_openapi::api::authorization::v1::{
    ResourceAttributes, SubjectAccessReview, SubjectAccessReviewSpec,
};
use k8s_openapi::api::core::v1::{
    Container, Namespace, Pod, PodTemplateSpec, Service, ServiceAccount,
};
use k8s_openapi::api::rbac::v1::{ClusterRole, ClusterRoleBinding, Role, RoleBinding};
use k8s_openapi::apimachinery::pkg::util::intstr::IntOrString;
use kube::api::{ObjectMeta, Patch, PatchParams, PostParams};
use kube::core::GroupVersionKind;
use kube::discovery::{self, Scope};
use kube::{Api, Client};
use serde_json::json;

/// The field manager these tests apply with.
const MANAGER: &str = "edgefleet-deploy-test";
/// Where Edgefleet's own workloads run.
const SYSTEM_NAMESPACE: &str = "edgefleet-system";
/// The controller's ServiceAccount, as the API server names its user.
const CLOUD_USER: &str = "system:serviceaccount:edgefleet-system:edgefleet-cloud";
/// The nodes the local demo runs agents for; the examples use these.
const DEMO_NODES: [&str; 3] = ["edge-1", "edge-2", "edge-3"];

fn strict() -> PatchParams {
    PatchParams::apply(MANAGER).validation_strict()
}

/// Applies every install manifest for real (server-side apply is idempotent,
/// so every test may call this), and fails listing every document the API
/// server refused.
async fn install(client: &Client) {
    let mut refused = Vec::new();
    for manifest in install_manifests() {
        if let Err(e) = apply(client, &manifest.object, &strict()).await {
            refused.push(format!(
                "{} ({} {}): {e}",
                manifest.origin,
                manifest.kind(),
                manifest.name()
            ));
        }
    }
    assert!(refused.is_empty(), "refused:\n{}", refused.join("\n"));
}

#[tokio::test]
async fn every_install_manifest_is_accepted_with_strict_validation() {
    let client = control_plane().client().await;
    let manifests = install_manifests();

    // Namespaced objects name their namespace, or `kubectl apply` would put
    // them into whatever namespace the operator's context happens to use.
    for manifest in &manifests {
        let gvk = GroupVersionKind::try_from(manifest.object.types.as_ref().unwrap()).unwrap();
        let (_, capabilities) = discovery::pinned_kind(&client, &gvk).await.unwrap();
        if capabilities.scope == Scope::Namespaced {
            assert_eq!(
                manifest.object.metadata.namespace.as_deref(),
                Some(SYSTEM_NAMESPACE),
                "{}: namespaced objects belong in {SYSTEM_NAMESPACE}",
                manifest.origin
            );
        }
    }
    let kinds: BTreeSet<&str> = manifests.iter().map(Manifest::kind).collect();
    for kind in [
        "Namespace",
        "ServiceAccount",
        "ClusterRole",
        "ClusterRoleBinding",
        "Role",
        "RoleBinding",
        "Deployment",
        "PodDisruptionBudget",
        "Service",
        "DaemonSet",
    ] {
        assert!(kinds.contains(kind), "no {kind} in deploy/: {kinds:?}");
    }

    install(&client).await;

    // They are really there, as written.
    let deployment: Deployment = Api::namespaced(client.clone(), SYSTEM_NAMESPACE)
        .get("edgefleet-cloud")
        .await
        .unwrap();
    assert_eq!(deployment.spec.unwrap().replicas, Some(3));
    let daemonset: DaemonSet = Api::namespaced(client.clone(), SYSTEM_NAMESPACE)
        .get("edgefleet-agent")
        .await
        .unwrap();
    let node_selector = daemonset.spec.unwrap().template.spec.unwrap().node_selector;
    assert_eq!(
        node_selector
            .unwrap_or_default()
            .get("edgefleet.io/edge")
            .map(String::as_str),
        Some("true")
    );
}

/// The check above is only worth something if a mistake fails it: a
/// misspelt field in a built-in kind and in a Device are refused.
#[tokio::test]
async fn a_misspelt_field_is_refused() {
    let client = control_plane().client().await;
    install(&client).await;
    let dry_run = strict().dry_run();

    let manifests = install_manifests();
    let deployment = &find(&manifests, "Deployment", "edgefleet-cloud").object;
    let mut typo = deployment.clone();
    typo.data["spec"]["template"]["spec"]["containers"][0]["imagePullPolicyy"] =
        json!("IfNotPresent");
    let err = apply(&client, &typo, &dry_run)
        .await
        .expect_err("a Deployment with a misspelt field was accepted");
    assert!(err.to_string().contains("imagePullPolicyy"), "{err}");
    apply(&client, deployment, &dry_run).await.unwrap();

    let ns = test_namespace(&client, "misspelt").await;
    let mut device = example_manifests()[0].object.clone();
    device.metadata.namespace = Some(ns.clone());
    let mut typo = device.clone();
    typo.data["spec"]["desird"] = json!({ "setpoint": 20 });
    let err = apply(&client, &typo, &dry_run)
        .await
        .expect_err("a Device with a misspelt field was accepted");
    assert!(err.to_string().contains("desird"), "{err}");
    apply(&client, &device, &dry_run).await.unwrap();
}

#[tokio::test]
async fn the_examples_are_devices_the_simulator_understands() {
    let client = control_plane().client().await;
    let ns = test_namespace(&client, "examples").await;
    let (examples, others): (Vec<Manifest>, Vec<Manifest>) = example_manifests()
        .into_iter()
        .partition(|m| m.kind() == "Device");
    let (rules, rollouts): (Vec<Manifest>, Vec<Manifest>) =
        others.into_iter().partition(|m| m.kind() == "EdgeRule");
    let picks_an_example =
        |selector: &k8s_openapi::apimachinery::pkg::apis::meta::v1::LabelSelector| {
            let selector = kube::core::Selector::try_from(selector.clone()).unwrap();
            examples.iter().any(|d| {
                let labels = d.object.metadata.labels.clone().unwrap_or_default();
                kube::core::SelectorExt::matches(&selector, &labels)
            })
        };

    // The rule examples: accepted with strict validation (the admission
    // policy included), a condition the controller and the agents compile,
    // and a selector that picks some of the example Devices.
    assert!(!rules.is_empty(), "no EdgeRule example");
    for rule in &rules {
        let mut object = rule.object.clone();
        object.metadata.namespace = Some(ns.clone());
        apply(&client, &object, &strict())
            .await
            .unwrap_or_else(|e| panic!("{}: refused: {e}", rule.origin));
        let spec: edgefleet_shared::api::EdgeRuleSpec =
            serde_json::from_value(rule.object.data["spec"].clone()).unwrap();
        edgefleet_shared::rule_when::When::compile(&spec.when)
            .unwrap_or_else(|e| panic!("{}: {e}", rule.origin));
        assert!(
            picks_an_example(&spec.selector),
            "{}: watches none of the example Devices",
            rule.origin
        );
        if let Some(target) = &spec.then.target {
            assert!(
                picks_an_example(target),
                "{}: its target is none of the example Devices",
                rule.origin
            );
        }
    }

    // The rollout examples: accepted with strict validation, a health
    // expression the controller compiles, and a selector that picks some of
    // the example Devices.
    assert!(!rollouts.is_empty(), "no FleetRollout example");
    for rollout in &rollouts {
        assert_eq!(rollout.kind(), "FleetRollout", "{}", rollout.origin);
        let mut object = rollout.object.clone();
        object.metadata.namespace = Some(ns.clone());
        apply(&client, &object, &strict())
            .await
            .unwrap_or_else(|e| panic!("{}: refused: {e}", rollout.origin));
        let spec: edgefleet_shared::api::FleetRolloutSpec =
            serde_json::from_value(rollout.object.data["spec"].clone()).unwrap();
        if let Some(health) = &spec.health {
            edgefleet_shared::health_gate::HealthGate::compile(&health.expression)
                .unwrap_or_else(|e| panic!("{}: {e}", rollout.origin));
        }
        assert!(
            picks_an_example(&spec.selector),
            "{}: selects none of the example Devices",
            rollout.origin
        );
    }

    for example in &examples {
        assert_eq!(example.kind(), "Device", "{}", example.origin);
        assert_eq!(
            example.object.metadata.namespace.as_deref(),
            Some("default"),
            "{}: the examples go to the default namespace",
            example.origin
        );
        let mut object = example.object.clone();
        object.metadata.namespace = Some(ns.clone());
        apply(&client, &object, &strict())
            .await
            .unwrap_or_else(|e| panic!("{}: refused: {e}", example.origin));
    }

    let api: Api<Device> = Api::namespaced(client, &ns);
    let mut transports = BTreeSet::new();
    let mut with_firmware_url = false;
    for example in &examples {
        let device = api.get(example.name()).await.unwrap();
        let spec = &device.spec;
        assert!(
            DEMO_NODES.contains(&spec.node.as_str()),
            "{}: node {} is not one of the demo's {DEMO_NODES:?}",
            example.origin,
            spec.node
        );
        let model: ModelKind = spec
            .model
            .parse()
            .unwrap_or_else(|e| panic!("{}: {e}", example.origin));
        // Only the model's writable properties: the rest would be ignored.
        let writable = model.default_desired();
        for property in spec.desired.keys() {
            assert!(
                writable.contains_key(property),
                "{}: a {model} does not take {property:?}; it takes {:?}",
                example.origin,
                writable.keys().collect::<Vec<_>>()
            );
        }
        transports.insert(format!("{:?}", spec.transport));
        if let Some(firmware) = &spec.firmware {
            with_firmware_url |= firmware.url.is_some() && firmware.sha256.is_some();
        }
    }
    assert_eq!(
        transports,
        BTreeSet::from([
            format!("{:?}", Transport::Coap),
            format!("{:?}", Transport::Mqtt)
        ]),
        "the examples show both transports"
    );
    assert!(
        with_firmware_url,
        "an example orders firmware by url and sha256"
    );
}

/// Asks the API server's authorizer whether the controller's ServiceAccount
/// may do `verb` on `resource` (`resource/subresource`), in `namespace` or
/// (with `None`) across all namespaces / on a cluster-scoped resource.
async fn cloud_may(
    client: &Client,
    verb: &str,
    group: &str,
    resource: &str,
    namespace: Option<&str>,
) -> bool {
    let (resource, subresource) = match resource.split_once('/') {
        Some((resource, sub)) => (resource, Some(sub.to_owned())),
        None => (resource, None),
    };
    cloud_may_do(
        client,
        ResourceAttributes {
            verb: Some(verb.to_owned()),
            group: Some(group.to_owned()),
            resource: Some(resource.to_owned()),
            subresource,
            namespace: namespace.map(str::to_owned),
            ..Default::default()
        },
    )
    .await
}

/// Whether the controller may `verb` the CSR signer `signer`.
async fn cloud_may_use_signer(client: &Client, verb: &str, signer: &str) -> bool {
    cloud_may_do(
        client,
        ResourceAttributes {
            verb: Some(verb.to_owned()),
            group: Some("certificates.k8s.io".to_owned()),
            resource: Some("signers".to_owned()),
            name: Some(signer.to_owned()),
            ..Default::default()
        },
    )
    .await
}

async fn cloud_may_do(client: &Client, attributes: ResourceAttributes) -> bool {
    let review = SubjectAccessReview {
        metadata: ObjectMeta::default(),
        spec: SubjectAccessReviewSpec {
            user: Some(CLOUD_USER.to_owned()),
            // The groups a ServiceAccount token carries.
            groups: Some(vec![
                "system:serviceaccounts".to_owned(),
                format!("system:serviceaccounts:{SYSTEM_NAMESPACE}"),
                "system:authenticated".to_owned(),
            ]),
            resource_attributes: Some(attributes),
            ..Default::default()
        },
        status: None,
    };
    Api::<SubjectAccessReview>::all(client.clone())
        .create(&PostParams::default(), &review)
        .await
        .expect("create a SubjectAccessReview")
        .status
        .expect("a SubjectAccessReview is answered")
        .allowed
}

#[tokio::test]
async fn the_controller_may_do_what_it_does_and_nothing_else() {
    let client = control_plane().client().await;
    install(&client).await;
    let some_ns = Some("team-a");
    let own_ns = Some(SYSTEM_NAMESPACE);

    // The RBAC authorizer learns of new bindings from a watch: wait for it.
    eventually("the controller's ClusterRoleBinding is in force", || {
        let client = &client;
        async move {
            cloud_may(client, "list", "edgefleet.io", "devices", None)
                .await
                .then_some(())
        }
    })
    .await;

    // (verb, API group, resource[/subresource], namespace) the controller needs.
    let needed = [
        // The Device reflector, across namespaces.
        ("list", "edgefleet.io", "devices", None),
        ("watch", "edgefleet.io", "devices", None),
        ("get", "edgefleet.io", "devices", some_ns),
        // The finalizer edgefleet.io/cleanup.
        ("update", "edgefleet.io", "devices", some_ns),
        ("patch", "edgefleet.io", "devices", some_ns),
        ("patch", "edgefleet.io", "devices/status", some_ns),
        ("get", "edgefleet.io", "edgenodes", None),
        ("list", "edgefleet.io", "edgenodes", None),
        ("watch", "edgefleet.io", "edgenodes", None),
        ("create", "edgefleet.io", "edgenodes", None),
        ("patch", "edgefleet.io", "edgenodes", None),
        ("patch", "edgefleet.io", "edgenodes/status", None),
        // The FleetRollout reconciler.
        ("list", "edgefleet.io", "fleetrollouts", None),
        ("watch", "edgefleet.io", "fleetrollouts", None),
        ("get", "edgefleet.io", "fleetrollouts", some_ns),
        // Its finalizer edgefleet.io/rollout.
        ("patch", "edgefleet.io", "fleetrollouts", some_ns),
        ("patch", "edgefleet.io", "fleetrollouts/status", some_ns),
        // The EdgeRule reconciler.
        ("list", "edgefleet.io", "edgerules", None),
        ("watch", "edgefleet.io", "edgerules", None),
        // Its finalizer edgefleet.io/rule.
        ("patch", "edgefleet.io", "edgerules", some_ns),
        ("patch", "edgefleet.io", "edgerules/status", some_ns),
        ("create", "", "events", some_ns),
        ("patch", "", "events", some_ns),
        ("create", "events.k8s.io", "events", some_ns),
        ("patch", "events.k8s.io", "events", some_ns),
        ("get", "coordination.k8s.io", "leases", own_ns),
        ("list", "coordination.k8s.io", "leases", own_ns),
        ("create", "coordination.k8s.io", "leases", own_ns),
        ("update", "coordination.k8s.io", "leases", own_ns),
        // Device keys: Secrets of type edgefleet.io/device-psk, listed and
        // watched with a field selector (RBAC cannot narrow a grant by
        // type; see docs/security.md, "Device keys").
        ("list", "", "secrets", None),
        ("watch", "", "secrets", None),
        // Agents' tokens.
        ("create", "authentication.k8s.io", "tokenreviews", None),
        // Agents' certificate requests: it answers and signs them.
        (
            "watch",
            "certificates.k8s.io",
            "certificatesigningrequests",
            None,
        ),
        (
            "patch",
            "certificates.k8s.io",
            "certificatesigningrequests/approval",
            None,
        ),
        (
            "patch",
            "certificates.k8s.io",
            "certificatesigningrequests/status",
            None,
        ),
    ];
    // Things it must not be able to do.
    let refused = [
        ("create", "edgefleet.io", "devices", some_ns),
        ("delete", "edgefleet.io", "devices", some_ns),
        ("deletecollection", "edgefleet.io", "devices", some_ns),
        ("update", "edgefleet.io", "devices/status", some_ns),
        ("delete", "edgefleet.io", "edgenodes", None),
        ("update", "edgefleet.io", "edgenodes", None),
        ("get", "edgefleet.io", "rollouts", some_ns),
        // Rollouts are people's to create and delete; the controller writes
        // their status and its finalizer.
        ("create", "edgefleet.io", "fleetrollouts", some_ns),
        ("update", "edgefleet.io", "fleetrollouts", some_ns),
        ("delete", "edgefleet.io", "fleetrollouts", some_ns),
        // Rules too.
        ("create", "edgefleet.io", "edgerules", some_ns),
        ("update", "edgefleet.io", "edgerules", some_ns),
        ("delete", "edgefleet.io", "edgerules", some_ns),
        ("delete", "events.k8s.io", "events", some_ns),
        ("list", "", "events", some_ns),
        // It reads Secrets only through its watch: no get, and no writes.
        ("get", "", "secrets", own_ns),
        ("create", "", "secrets", some_ns),
        ("update", "", "secrets", some_ns),
        ("list", "", "configmaps", None),
        ("create", "", "pods", own_ns),
        ("list", "", "nodes", None),
        // Leases only in its own namespace.
        (
            "update",
            "coordination.k8s.io",
            "leases",
            Some("kube-system"),
        ),
        ("delete", "coordination.k8s.io", "leases", own_ns),
        (
            "escalate",
            "rbac.authorization.k8s.io",
            "clusterroles",
            None,
        ),
        ("bind", "rbac.authorization.k8s.io", "clusterroles", None),
        ("impersonate", "", "serviceaccounts", None),
        // It checks agents' tokens; it never mints one.
        ("create", "", "serviceaccounts/token", own_ns),
        // It answers certificate requests; it makes none, and deletes none.
        (
            "create",
            "certificates.k8s.io",
            "certificatesigningrequests",
            None,
        ),
        (
            "delete",
            "certificates.k8s.io",
            "certificatesigningrequests",
            None,
        ),
    ];

    let mut wrong = Vec::new();
    for (verb, group, resource, namespace) in needed {
        if !cloud_may(&client, verb, group, resource, namespace).await {
            wrong.push(format!(
                "refused but needed: {verb} {group}/{resource} in {namespace:?}"
            ));
        }
    }
    for (verb, group, resource, namespace) in refused {
        if cloud_may(&client, verb, group, resource, namespace).await {
            wrong.push(format!(
                "allowed but not needed: {verb} {group}/{resource} in {namespace:?}"
            ));
        }
    }
    // It approves and signs for its own signer, and for no other (the
    // API server's client certificates least of all).
    let agent = edgefleet_cloud::agent_certs::SIGNER;
    let kube = "kubernetes.io/kube-apiserver-client";
    for (verb, signer, needed) in [
        ("approve", agent, true),
        ("sign", agent, true),
        ("approve", kube, false),
        ("sign", kube, false),
        (
            "approve",
            "kubernetes.io/kube-apiserver-client-kubelet",
            false,
        ),
    ] {
        if cloud_may_use_signer(&client, verb, signer).await != needed {
            wrong.push(format!(
                "{verb} for the signer {signer}: should be {needed}"
            ));
        }
    }
    assert!(wrong.is_empty(), "{}", wrong.join("\n"));
}

/// A Pod made from a workload's template, as its controller would make it.
fn pod_from(template: &PodTemplateSpec, name: &str, namespace: &str) -> Pod {
    let mut metadata = template.metadata.clone().unwrap_or_default();
    metadata.name = Some(name.to_owned());
    metadata.namespace = Some(namespace.to_owned());
    Pod {
        metadata,
        spec: template.spec.clone(),
        status: None,
    }
}

fn service_account(name: &str) -> ServiceAccount {
    ServiceAccount {
        metadata: ObjectMeta {
            name: Some(name.to_owned()),
            ..Default::default()
        },
        ..Default::default()
    }
}

/// No controllers run here, so nothing turns the Deployment and DaemonSet
/// into Pods; these dry-run creates of their Pods go through Pod validation
/// and Pod Security admission, which only Pods get.
#[tokio::test]
async fn the_controller_pod_meets_the_restricted_pod_security_level() {
    let client = control_plane().client().await;
    install(&client).await;
    let manifests = install_manifests();
    let cloud = find(&manifests, "Deployment", "edgefleet-cloud").typed::<Deployment>();
    let agent = find(&manifests, "DaemonSet", "edgefleet-agent").typed::<DaemonSet>();
    let cloud_template = cloud.spec.unwrap().template;
    let agent_template = agent.spec.unwrap().template;
    let dry_run = PostParams {
        dry_run: true,
        ..Default::default()
    };

    let ns = test_namespace(&client, "restricted").await;
    Api::<Namespace>::all(client.clone())
        .patch(
            &ns,
            &PatchParams::default(),
            &Patch::Merge(json!({
                "metadata": { "labels": { "pod-security.kubernetes.io/enforce": "restricted" } }
            })),
        )
        .await
        .unwrap();
    let accounts: Api<ServiceAccount> = Api::namespaced(client.clone(), &ns);
    for name in ["edgefleet-cloud", "edgefleet-agent"] {
        accounts
            .create(&PostParams::default(), &service_account(name))
            .await
            .unwrap();
    }
    let pods: Api<Pod> = Api::namespaced(client.clone(), &ns);

    // The agent needs the host's network and a hostPath: refused here. That
    // shows the level is enforced, so the controller's acceptance below
    // means something.
    let agent_pod = pod_from(&agent_template, "agent", &ns);
    let refusal = eventually("the restricted level is enforced", || {
        let (pods, agent_pod, dry_run) = (&pods, &agent_pod, &dry_run);
        async move {
            match pods.create(dry_run, agent_pod).await {
                Err(kube::Error::Api(status)) if status.message.contains("PodSecurity") => {
                    Some(status.message)
                }
                _ => None,
            }
        }
    })
    .await;
    assert!(refusal.contains("hostNetwork"), "{refusal}");

    pods.create(&dry_run, &pod_from(&cloud_template, "cloud", &ns))
        .await
        .unwrap_or_else(|e| panic!("the controller's pod is not `restricted`: {e}"));

    // In its own namespace the agent's pod is accepted.
    Api::<Pod>::namespaced(client, SYSTEM_NAMESPACE)
        .create(
            &dry_run,
            &pod_from(&agent_template, "agent", SYSTEM_NAMESPACE),
        )
        .await
        .unwrap_or_else(|e| panic!("the agent's pod is refused in {SYSTEM_NAMESPACE}: {e}"));
}

/// The environment variables a binary reads (`env = "…"` in its clap flags).
fn env_vars_read_by(main_rs: &str) -> BTreeSet<String> {
    let path = Path::new(env!("CARGO_MANIFEST_DIR"))
        .join("..")
        .join(main_rs);
    let source = std::fs::read_to_string(&path).expect("read a main.rs");
    source
        .split("env = \"")
        .skip(1)
        .filter_map(|rest| rest.split_once('"').map(|(name, _)| name.to_owned()))
        .collect()
}

fn container<'a>(template: &'a PodTemplateSpec, name: &str) -> &'a Container {
    template
        .spec
        .as_ref()
        .unwrap()
        .containers
        .iter()
        .find(|c| c.name == name)
        .unwrap_or_else(|| panic!("no container {name}"))
}

fn env_value<'a>(container: &'a Container, name: &str) -> &'a str {
    container
        .env
        .iter()
        .flatten()
        .find(|e| e.name == name)
        .and_then(|e| e.value.as_deref())
        .unwrap_or_else(|| panic!("{}: no value for {name}", container.name))
}

/// The container ports by name.
fn ports(container: &Container) -> BTreeMap<String, i32> {
    container
        .ports
        .iter()
        .flatten()
        .map(|p| (p.name.clone().unwrap_or_default(), p.container_port))
        .collect()
}

fn listen_port(container: &Container, variable: &str) -> i32 {
    let addr: SocketAddr = env_value(container, variable)
        .parse()
        .unwrap_or_else(|e| panic!("{variable}: {e}"));
    assert!(
        addr.ip().is_unspecified(),
        "{variable}={addr}: in a pod, listen on all addresses"
    );
    i32::from(addr.port())
}

fn probe_port(probe: Option<&k8s_openapi::api::core::v1::Probe>) -> Option<String> {
    match &probe?.http_get.as_ref()?.port {
        IntOrString::String(name) => Some(name.clone()),
        IntOrString::Int(port) => Some(port.to_string()),
    }
}

/// Checks what the API server cannot: that the pieces refer to each other.
#[test]
fn the_pieces_fit_together() {
    let manifests = install_manifests();
    let cloud = find(&manifests, "Deployment", "edgefleet-cloud").typed::<Deployment>();
    let service = find(&manifests, "Service", "edgefleet-cloud").typed::<Service>();
    let agent = find(&manifests, "DaemonSet", "edgefleet-agent").typed::<DaemonSet>();
    let binding =
        find(&manifests, "ClusterRoleBinding", "edgefleet-cloud").typed::<ClusterRoleBinding>();
    let lease_binding =
        find(&manifests, "RoleBinding", "edgefleet-cloud-leader-election").typed::<RoleBinding>();
    let cloud_template = cloud.spec.as_ref().unwrap().template.clone();
    let agent_template = agent.spec.as_ref().unwrap().template.clone();
    let cloud_container = container(&cloud_template, "cloud");
    let agent_container = container(&agent_template, "agent");

    // Every EDGEFLEET_* variable set is one the binary reads.
    for (c, main_rs) in [
        (cloud_container, "cloud/src/main.rs"),
        (agent_container, "edge-agent/src/main.rs"),
    ] {
        let known = env_vars_read_by(main_rs);
        assert!(
            !known.is_empty(),
            "{main_rs} reads no environment variables?"
        );
        for var in c.env.iter().flatten() {
            if var.name.starts_with("EDGEFLEET_") {
                assert!(
                    known.contains(&var.name),
                    "{}: {main_rs} does not read {}; it reads {known:?}",
                    c.name,
                    var.name
                );
            }
        }
    }

    // The controller listens on the ports it declares, and probes name them.
    let cloud_ports = ports(cloud_container);
    assert_eq!(
        Some(&listen_port(cloud_container, "EDGEFLEET_SYNC_ADDR")),
        cloud_ports.get("sync")
    );
    assert_eq!(
        Some(&listen_port(cloud_container, "EDGEFLEET_METRICS_ADDR")),
        cloud_ports.get("metrics")
    );
    for probe in [
        &cloud_container.readiness_probe,
        &cloud_container.liveness_probe,
    ] {
        let port = probe_port(probe.as_ref()).expect("an HTTP probe");
        assert!(
            cloud_ports.contains_key(&port),
            "the cloud's probes use port {port}"
        );
    }

    // The Service selects the controller's pods and reaches its ports.
    let service_spec = service.spec.as_ref().unwrap();
    let pod_labels = cloud_template
        .metadata
        .as_ref()
        .unwrap()
        .labels
        .clone()
        .unwrap_or_default();
    let selector = service_spec.selector.clone().unwrap_or_default();
    assert!(!selector.is_empty());
    for (key, value) in &selector {
        assert_eq!(
            pod_labels.get(key),
            Some(value),
            "the Service's selector misses the pods"
        );
    }

    // Three replicas, one down at a time at most, spread over machines,
    // each sharing the fleet (shards, its pod as replica id, its own
    // address for the agents it is sent).
    let cloud_spec = cloud.spec.as_ref().unwrap();
    assert_eq!(cloud_spec.replicas, Some(3));
    let budget = find(&manifests, "PodDisruptionBudget", "edgefleet-cloud")
        .typed::<k8s_openapi::api::policy::v1::PodDisruptionBudget>();
    let budget = budget.spec.unwrap();
    assert_eq!(budget.min_available, Some(IntOrString::Int(2)));
    let budget_selector = budget.selector.unwrap().match_labels.unwrap_or_default();
    assert!(!budget_selector.is_empty());
    for (key, value) in &budget_selector {
        assert_eq!(
            pod_labels.get(key),
            Some(value),
            "the budget misses the pods"
        );
    }
    let spread = cloud_template
        .spec
        .as_ref()
        .unwrap()
        .topology_spread_constraints
        .clone()
        .unwrap_or_default();
    assert!(
        spread
            .iter()
            .any(|c| c.topology_key == "kubernetes.io/hostname"
                && c.when_unsatisfiable == "DoNotSchedule"),
        "one replica per machine: {spread:?}"
    );
    let env: BTreeMap<String, String> = cloud_container
        .env
        .iter()
        .flatten()
        .map(|v| (v.name.clone(), v.value.clone().unwrap_or_default()))
        .collect();
    assert!(env.contains_key("EDGEFLEET_SHARDS"));
    assert!(env.contains_key("EDGEFLEET_REPLICA_ID"));
    assert_eq!(
        env.get("EDGEFLEET_ADVERTISE_URL").map(String::as_str),
        Some("https://$(POD_IP):7443")
    );
    let mut service_ports = BTreeMap::new();
    for port in service_spec.ports.iter().flatten() {
        let Some(IntOrString::String(target)) = &port.target_port else {
            panic!(
                "Service port {:?}: target the container port by name",
                port.name
            );
        };
        assert!(
            cloud_ports.contains_key(target),
            "the Service targets {target}"
        );
        service_ports.insert(port.name.clone().unwrap_or_default(), port.port);
    }

    // The agent dials that Service, over TLS.
    let expected_cloud = format!(
        "https://{}.{}.svc:{}",
        service.metadata.name.as_deref().unwrap(),
        service.metadata.namespace.as_deref().unwrap(),
        service_ports["sync"]
    );
    assert_eq!(
        env_value(agent_container, "EDGEFLEET_CLOUD"),
        expected_cloud
    );

    // The controller serves the certificate of the Secret edgefleet-sync-tls
    // and the agent checks it against the CA of the ConfigMap
    // edgefleet-sync-ca, each mounted where its variable points.
    let mounted_from = |template: &PodTemplateSpec, c: &Container, path: &str| {
        let mount = c
            .volume_mounts
            .iter()
            .flatten()
            .find(|m| path.starts_with(&m.mount_path))
            .unwrap_or_else(|| panic!("{}: nothing is mounted at {path}", c.name));
        let volume = template
            .spec
            .as_ref()
            .unwrap()
            .volumes
            .iter()
            .flatten()
            .find(|v| v.name == mount.name)
            .unwrap_or_else(|| panic!("no volume {}", mount.name));
        let secret = volume.secret.as_ref().and_then(|s| s.secret_name.clone());
        let config_map = volume.config_map.as_ref().map(|c| c.name.clone());
        (secret, config_map)
    };
    let tls_dir = env_value(cloud_container, "EDGEFLEET_TLS_DIR");
    assert_eq!(
        mounted_from(&cloud_template, cloud_container, tls_dir),
        (Some("edgefleet-sync-tls".to_owned()), None)
    );
    let ca_file = env_value(agent_container, "EDGEFLEET_CLOUD_CA_FILE");
    assert_eq!(
        mounted_from(&agent_template, agent_container, ca_file),
        (None, Some("edgefleet-sync-ca".to_owned()))
    );

    // The agent proves its node with the token the kubelet projects for
    // the audience the controller reviews, of the ServiceAccount the
    // controller accepts.
    let token_file = env_value(agent_container, "EDGEFLEET_TOKEN_FILE");
    let (dir, file) = token_file.rsplit_once('/').unwrap();
    let mount = agent_container
        .volume_mounts
        .iter()
        .flatten()
        .find(|m| m.mount_path == dir)
        .unwrap_or_else(|| panic!("nothing is mounted at {dir}"));
    let agent_spec = agent_template.spec.as_ref().unwrap();
    let projected = agent_spec
        .volumes
        .iter()
        .flatten()
        .find(|v| v.name == mount.name)
        .and_then(|v| v.projected.as_ref())
        .expect("the token's volume is projected");
    let token = projected
        .sources
        .iter()
        .flatten()
        .find_map(|s| s.service_account_token.as_ref())
        .expect("a serviceAccountToken source");
    assert_eq!(token.path, file);
    assert_eq!(
        token.audience.as_deref(),
        Some(edgefleet_cloud::agent_identity::AUDIENCE)
    );
    assert!(token.expiration_seconds.unwrap_or(3600) <= 3600);
    assert_eq!(
        env_value(cloud_container, "EDGEFLEET_AGENT_SERVICE_ACCOUNT"),
        format!(
            "{}/{}",
            agent.metadata.namespace.as_deref().unwrap(),
            agent_spec.service_account_name.as_deref().unwrap()
        )
    );
    assert_eq!(agent_spec.automount_service_account_token, Some(false));

    // The agent's node name comes from the downward API.
    let node = agent_container
        .env
        .iter()
        .flatten()
        .find(|e| e.name == "EDGEFLEET_NODE")
        .and_then(|e| e.value_from.as_ref()?.field_ref.as_ref())
        .map(|f| f.field_path.as_str());
    assert_eq!(node, Some("spec.nodeName"));

    // The agent listens where it says, on the node's network.
    assert_eq!(agent_spec.host_network, Some(true));
    assert_eq!(
        agent_spec.dns_policy.as_deref(),
        Some("ClusterFirstWithHostNet")
    );
    let agent_ports = ports(agent_container);
    assert_eq!(
        Some(&listen_port(agent_container, "EDGEFLEET_COAP_BIND")),
        agent_ports.get("coap")
    );
    assert_eq!(
        Some(&listen_port(agent_container, "EDGEFLEET_MQTT_LISTEN")),
        agent_ports.get("mqtt")
    );
    assert_eq!(
        Some(&listen_port(agent_container, "EDGEFLEET_METRICS_ADDR")),
        agent_ports.get("metrics")
    );
    for probe in [
        &agent_container.readiness_probe,
        &agent_container.liveness_probe,
    ] {
        let port = probe_port(probe.as_ref()).expect("an HTTP probe");
        assert!(
            agent_ports.contains_key(&port),
            "the agent's probes use port {port}"
        );
    }

    // Its store is on the node, where the agent keeps it.
    let data_dir = env_value(agent_container, "EDGEFLEET_DATA_DIR");
    let mount = agent_container
        .volume_mounts
        .iter()
        .flatten()
        .find(|m| m.mount_path == data_dir)
        .unwrap_or_else(|| panic!("nothing mounted at {data_dir}"));
    assert_ne!(mount.read_only, Some(true));
    let volume = agent_spec
        .volumes
        .iter()
        .flatten()
        .find(|v| v.name == mount.name)
        .unwrap();
    assert_eq!(
        volume.host_path.as_ref().map(|h| h.path.as_str()),
        Some("/var/lib/edgefleet"),
        "the store must outlive the pod"
    );

    // Both run hardened (the cloud is also checked against Pod Security).
    for (template, c) in [
        (&cloud_template, cloud_container),
        (&agent_template, agent_container),
    ] {
        let pod = template
            .spec
            .as_ref()
            .unwrap()
            .security_context
            .clone()
            .unwrap_or_default();
        let sc = c.security_context.clone().unwrap_or_default();
        let what = &c.name;
        assert_eq!(
            pod.run_as_non_root.or(sc.run_as_non_root),
            Some(true),
            "{what}: runAsNonRoot"
        );
        assert_eq!(
            sc.seccomp_profile.or(pod.seccomp_profile).map(|p| p.type_),
            Some("RuntimeDefault".to_owned()),
            "{what}: seccomp"
        );
        assert_eq!(
            sc.read_only_root_filesystem,
            Some(true),
            "{what}: readOnlyRootFilesystem"
        );
        assert_eq!(
            sc.allow_privilege_escalation,
            Some(false),
            "{what}: allowPrivilegeEscalation"
        );
        let caps = sc.capabilities.unwrap_or_default();
        assert_eq!(
            caps.drop,
            Some(vec!["ALL".to_owned()]),
            "{what}: drop ALL capabilities"
        );
        assert_eq!(caps.add, None, "{what}: no capabilities added");
        assert!(
            c.resources
                .as_ref()
                .is_some_and(|r| r.requests.is_some() && r.limits.is_some()),
            "{what}: requests and limits"
        );
    }

    // The controller runs as the ServiceAccount its bindings name.
    let account = cloud_template
        .spec
        .as_ref()
        .unwrap()
        .service_account_name
        .clone();
    for subjects in [&binding.subjects, &lease_binding.subjects] {
        let subjects = subjects.clone().unwrap_or_default();
        assert_eq!(subjects.len(), 1);
        assert_eq!(subjects[0].kind, "ServiceAccount");
        assert_eq!(Some(&subjects[0].name), account.as_ref());
        assert_eq!(subjects[0].namespace.as_deref(), Some(SYSTEM_NAMESPACE));
    }
    // The agent's pod has no API token: it never calls the Kubernetes API.
    assert_eq!(agent_spec.automount_service_account_token, Some(false));

    // No wildcard anywhere in the RBAC rules.
    let mut rules = Vec::new();
    for m in manifests.iter().filter(|m| m.kind() == "ClusterRole") {
        rules.extend(m.typed::<ClusterRole>().rules.unwrap_or_default());
    }
    for m in manifests.iter().filter(|m| m.kind() == "Role") {
        rules.extend(m.typed::<Role>().rules.unwrap_or_default());
    }
    assert!(!rules.is_empty());
    for rule in &rules {
        let words = rule
            .verbs
            .iter()
            .chain(rule.resources.iter().flatten())
            .chain(rule.api_groups.iter().flatten());
        for word in words {
            assert!(!word.contains('*'), "a wildcard in an RBAC rule: {rule:?}");
        }
        assert!(rule.non_resource_urls.is_none(), "{rule:?}");
    }
}
