//! Client certificates for agents that are not pods, through the real API
//! server's CertificateSigningRequest API with the controller's signer
//! (`edgefleet.io/agent`) answering: only an EdgeNode an operator created
//! with `spec.agentCredentials: ClientCertificate` gets one, and only for a
//! requester it names in `spec.certificateRequesters`; every other request
//! (another node's kubelet included) is denied with its reason and counted,
//! and gets no certificate. A certificate the EdgeNode revokes ends its
//! session; the host gets a new one and is served again.

use std::sync::Arc;
use std::time::Duration;

use edgefleet_agent::store::Store;
use edgefleet_agent::sync::{self, ClientCertificate, CloudTls, SyncSettings};
use edgefleet_cloud::agent_certs::{self, AgentCa, SIGNER};
use edgefleet_cloud::agent_identity::AuthSettings;
use edgefleet_cloud::run::{Controller, Settings};
use edgefleet_cloud::tls::TlsSettings;
use edgefleet_shared::ResourceKey;
use edgefleet_shared::api::{Device, DeviceSpec, EdgeNode, Transport};
use edgefleet_shared::telemetry::Outcomes;
use edgefleet_tests::agent_tokens::ACCOUNT;
use edgefleet_tests::{
    agent_sync_settings, certs, control_plane, eventually, impersonating, in_process_controller,
    process, test_namespace,
};
use k8s_openapi::ByteString;
use k8s_openapi::api::certificates::v1::{
    CertificateSigningRequest, CertificateSigningRequestSpec,
};
use k8s_openapi::api::rbac::v1::ClusterRoleBinding;
use kube::api::{ObjectMeta, Patch, PatchParams, PostParams};
use kube::{Api, Client};
use rcgen::{
    BasicConstraints, CertificateParams, DistinguishedName, DnType, IsCa, KeyPair, KeyUsagePurpose,
};
use rustls::pki_types::{CertificateDer, UnixTime};
use rustls::server::WebPkiClientVerifier;
use serde_json::json;

/// A CA in `dir` as cert-manager writes one (`tls.crt`, `tls.key`); its
/// certificate (PEM).
fn make_ca(dir: &std::path::Path) -> String {
    let key = KeyPair::generate().unwrap();
    let mut params = CertificateParams::default();
    params.distinguished_name = DistinguishedName::new();
    params
        .distinguished_name
        .push(DnType::CommonName, "edgefleet agents (test)");
    params.is_ca = IsCa::Ca(BasicConstraints::Unconstrained);
    params.key_usages = vec![KeyUsagePurpose::KeyCertSign, KeyUsagePurpose::CrlSign];
    let cert = params.self_signed(&key).unwrap();
    std::fs::write(dir.join("tls.crt"), cert.pem()).unwrap();
    std::fs::write(dir.join("tls.key"), key.serialize_pem()).unwrap();
    cert.pem()
}

/// A host's bootstrap identity: a user who may create CSRs (the built-in
/// `system:node-bootstrapper` role, as a bootstrap token has) and a client
/// acting as it.
async fn bootstrap_identity(admin: &Client, user: &str) -> Client {
    let binding: ClusterRoleBinding = serde_json::from_value(json!({
        "metadata": { "name": user.replace(':', "-") },
        "roleRef": {
            "apiGroup": "rbac.authorization.k8s.io",
            "kind": "ClusterRole",
            "name": "system:node-bootstrapper",
        },
        "subjects": [{ "apiGroup": "rbac.authorization.k8s.io", "kind": "User", "name": user }],
    }))
    .unwrap();
    Api::<ClusterRoleBinding>::all(admin.clone())
        .create(&PostParams::default(), &binding)
        .await
        .unwrap();
    impersonating(user, &["system:authenticated"]).await
}

/// Creates the CSR `name` for the subject `CN=cn` with `usages`, as
/// `client`'s user.
async fn request(client: &Client, name: &str, cn: &str, usages: &[&str]) {
    let key = KeyPair::generate().unwrap();
    let mut params = CertificateParams::default();
    params.distinguished_name = DistinguishedName::new();
    params.distinguished_name.push(DnType::CommonName, cn);
    let csr = params.serialize_request(&key).unwrap();
    let object = CertificateSigningRequest {
        metadata: ObjectMeta {
            name: Some(name.to_owned()),
            ..Default::default()
        },
        spec: CertificateSigningRequestSpec {
            request: ByteString(csr.pem().unwrap().into_bytes()),
            signer_name: SIGNER.to_owned(),
            usages: Some(usages.iter().map(|u| (*u).to_owned()).collect()),
            expiration_seconds: Some(3600),
            ..Default::default()
        },
        status: None,
    };
    Api::<CertificateSigningRequest>::all(client.clone())
        .create(&PostParams::default(), &object)
        .await
        .unwrap();
}

/// The CSR `name` once it is decided: its decision's type and reason, and
/// its certificate (PEM) if one was issued.
async fn decided(client: &Client, name: &str) -> (String, String, Option<String>) {
    let csrs: Api<CertificateSigningRequest> = Api::all(client.clone());
    eventually(
        &format!("the certificate request {name} is answered"),
        || async {
            let csr = csrs.get(name).await.ok()?;
            let status = csr.status?;
            let condition = status.conditions?.into_iter().next()?;
            let certificate = status
                .certificate
                .map(|c| String::from_utf8(c.0).expect("PEM"));
            // Approved requests are answered once signed.
            if condition.type_ == "Approved" && certificate.is_none() {
                return None;
            }
            Some((
                condition.type_,
                condition.reason.unwrap_or_default(),
                certificate,
            ))
        },
    )
    .await
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn only_an_edge_node_an_operator_made_for_certificates_gets_a_client_certificate() {
    let client = control_plane().client().await;
    let dir = tempfile::tempdir().unwrap();
    let ca_pem = make_ca(dir.path());
    let outcomes = Outcomes::default();
    let signer = tokio::spawn(agent_certs::run(
        client.clone(),
        std::sync::Arc::new(AgentCa::load(dir.path()).unwrap()),
        outcomes.clone(),
    ));

    let id = std::process::id();
    let host = format!("cert-host-{id}");
    let pod_node = format!("cert-pod-{id}");
    let requester = format!("system:serviceaccount:edge-hosts:gw-{id}");
    let host_client = bootstrap_identity(&client, &requester).await;
    // Another edge node's kubelet: it may create CSRs (the Node authorizer
    // lets it, to rotate its own certificate), and it was stolen.
    let kubelet = impersonating(
        &format!("system:node:{pod_node}"),
        &["system:nodes", "system:authenticated"],
    )
    .await;
    let edge_nodes: Api<EdgeNode> = Api::all(client.clone());
    for (name, spec) in [
        (
            &host,
            json!({ "agentCredentials": "ClientCertificate", "certificateRequesters": [requester] }),
        ),
        (&pod_node, json!({})),
    ] {
        let node: EdgeNode = serde_json::from_value(json!({
            "apiVersion": "edgefleet.io/v1alpha1",
            "kind": "EdgeNode",
            "metadata": { "name": name },
            "spec": spec,
        }))
        .unwrap();
        edge_nodes
            .create(&PostParams::default(), &node)
            .await
            .unwrap();
    }

    let cn = |node: &str| format!("{}{node}", agent_certs::COMMON_NAME_PREFIX);
    let cases = [
        (
            &host_client,
            format!("good-{id}"),
            cn(&host),
            vec!["client auth", "digital signature"],
        ),
        (
            &kubelet,
            format!("stolen-{id}"),
            cn(&host),
            vec!["client auth"],
        ),
        (
            &client,
            format!("admin-{id}"),
            cn(&host),
            vec!["client auth"],
        ),
        (
            &host_client,
            format!("pod-{id}"),
            cn(&pod_node),
            vec!["client auth"],
        ),
        (
            &host_client,
            format!("missing-{id}"),
            cn(&format!("cert-none-{id}")),
            vec!["client auth"],
        ),
        (
            &host_client,
            format!("server-{id}"),
            cn(&host),
            vec!["client auth", "server auth"],
        ),
        (
            &host_client,
            format!("kubelet-{id}"),
            format!("system:node:{host}"),
            vec!["client auth"],
        ),
    ];
    for (as_user, name, cn, usages) in &cases {
        request(as_user, name, cn, usages).await;
    }
    let mut answers = Vec::new();
    for (_, name, _, _) in &cases {
        answers.push(decided(&client, name).await);
    }

    // The operator's EdgeNode: approved and signed.
    let (type_, reason, certificate) = &answers[0];
    assert_eq!(
        (type_.as_str(), reason.as_str()),
        ("Approved", "EdgeNodeTakesCertificates")
    );
    let pem = certificate.as_deref().expect("a certificate");
    // A client certificate for that node, from the CA, for the hour asked.
    let (_, parsed) = x509_parser::pem::parse_x509_pem(pem.as_bytes()).unwrap();
    let issued = parsed.parse_x509().unwrap();
    let names: Vec<&str> = issued
        .subject()
        .iter_attributes()
        .map(|a| a.as_str().unwrap())
        .collect();
    assert_eq!(names, [cn(&host)], "the subject is the CN alone");
    let usages = issued.extended_key_usage().unwrap().unwrap().value;
    assert!(usages.client_auth && !usages.server_auth && !usages.any);
    assert!(!issued.is_ca());
    let lifetime =
        issued.validity().not_after.timestamp() - time::OffsetDateTime::now_utc().unix_timestamp();
    assert!((3000..=3600).contains(&lifetime), "valid for {lifetime} s");
    // What a rustls server trusting the CA makes of it: accepted now,
    // refused once expired.
    let mut roots = rustls::RootCertStore::empty();
    roots.add(pem_der(&ca_pem)).unwrap();
    let verifier = WebPkiClientVerifier::builder_with_provider(
        Arc::new(roots),
        Arc::new(rustls::crypto::ring::default_provider()),
    )
    .build()
    .unwrap();
    let leaf = pem_der(pem);
    verifier
        .verify_client_cert(&leaf, &[], UnixTime::now())
        .expect("the CA's client certificate is accepted");
    let later = UnixTime::since_unix_epoch(
        std::time::SystemTime::now()
            .duration_since(std::time::UNIX_EPOCH)
            .unwrap()
            + Duration::from_secs(7200),
    );
    assert!(verifier.verify_client_cert(&leaf, &[], later).is_err());

    // Every other request: denied, with why, and no certificate.
    let expected = [
        "RequesterNotAllowed",
        "RequesterNotAllowed",
        "NotACertificateNode",
        "NoSuchEdgeNode",
        "UnsupportedUsages",
        "WrongSubject",
    ];
    for ((type_, reason, certificate), want) in answers[1..].iter().zip(expected) {
        assert_eq!((type_.as_str(), reason.as_str()), ("Denied", want));
        assert!(certificate.is_none(), "{want}: a certificate was issued");
    }
    for (want, times) in [
        ("RequesterNotAllowed", 2),
        ("NotACertificateNode", 1),
        ("NoSuchEdgeNode", 1),
        ("UnsupportedUsages", 1),
        ("WrongSubject", 1),
    ] {
        assert_eq!(outcomes.get(want), times, "{want} counted");
    }
    assert_eq!(outcomes.get("issued"), 1);
    signer.abort();
}

fn pem_der(pem: &str) -> CertificateDer<'static> {
    use rustls::pki_types::pem::PemObject;
    CertificateDer::from_pem_slice(pem.as_bytes()).unwrap()
}

/// The whole way for a host that is not a pod: `edgefleet-agent-csr` makes
/// its key and request, the controller signs it, and the agent, with no
/// token, is served its node over TLS with that certificate. The same
/// certificate naming another node is refused; once the operator takes
/// `agentCredentials` off the EdgeNode, its running session ends and its
/// next connect is refused; a session also ends when the certificate expires.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_agent_with_a_signed_certificate_is_served_its_node_and_nothing_else() {
    let client = control_plane().client().await;
    let ns = test_namespace(&client, "agent-cert").await;
    let dir = tempfile::tempdir().unwrap();
    let lab = certs::lab(&dir.path().join("sync")).unwrap();
    let ca_dir = dir.path().join("agent-ca");
    std::fs::create_dir_all(&ca_dir).unwrap();
    make_ca(&ca_dir);
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let controller = Controller::start(
        client.clone(),
        Settings {
            tls: Some(TlsSettings {
                dir: lab.dir().to_owned(),
                reload_every: Duration::from_secs(60),
            }),
            agent_ca: Some(AgentCa::load(&ca_dir).unwrap()),
            // Agents without a certificate need a pod's token.
            agent_auth: AuthSettings::ServiceAccount {
                namespace: ns.clone(),
                name: ACCOUNT.into(),
            },
            // A running certificate session's EdgeNode is read again every
            // second (a minute by default).
            token_recheck: Duration::from_secs(1),
            ..in_process_controller(listener, &ns)
        },
    )
    .await
    .unwrap();
    let authentications = |outcome: &str| controller.sync_metrics.authentications.get(outcome);

    let node = format!("cert-site-{}", std::process::id());
    let requester = format!("system:serviceaccount:edge-hosts:{node}");
    let host_client = bootstrap_identity(&client, &requester).await;
    let edge_nodes: Api<EdgeNode> = Api::all(client.clone());
    let registered: EdgeNode = serde_json::from_value(json!({
        "apiVersion": "edgefleet.io/v1alpha1",
        "kind": "EdgeNode",
        "metadata": { "name": node },
        "spec": { "agentCredentials": "ClientCertificate", "certificateRequesters": [requester] },
    }))
    .unwrap();
    edge_nodes
        .create(&PostParams::default(), &registered)
        .await
        .unwrap();

    // The host makes its key and request and submits it with its
    // bootstrap identity.
    let host_dir = dir.path().join("host");
    let certify = || async {
        let made = std::process::Command::new(process::binary("edgefleet-agent-csr"))
            .args(["--node", &node, "--expiration-seconds", "3600", "--dir"])
            .arg(&host_dir)
            .output()
            .unwrap();
        assert!(
            made.status.success(),
            "{}",
            String::from_utf8_lossy(&made.stderr)
        );
        let csr: CertificateSigningRequest = serde_json::from_slice(&made.stdout).unwrap();
        let name = csr.metadata.name.clone().unwrap();
        Api::<CertificateSigningRequest>::all(host_client.clone())
            .create(&PostParams::default(), &csr)
            .await
            .unwrap();
        let (type_, _, certificate) = decided(&client, &name).await;
        assert_eq!(type_, "Approved");
        certificate.unwrap()
    };
    let certificate = certify().await;
    let key_mode = std::fs::metadata(host_dir.join("tls.key"))
        .unwrap()
        .permissions();
    assert_eq!(
        std::os::unix::fs::PermissionsExt::mode(&key_mode) & 0o077,
        0,
        "the key is its owner's alone"
    );
    let presented = agent_certs::presented(&pem_der(&certificate)).unwrap();
    let lifetime = presented
        .not_after
        .duration_since(std::time::SystemTime::now())
        .unwrap();
    assert!(
        lifetime <= Duration::from_secs(3600) && lifetime > Duration::from_secs(3500),
        "{lifetime:?}"
    );
    std::fs::write(host_dir.join("tls.crt"), certificate).unwrap();

    // The agent with it, and no token, holds its node's Device.
    let devices: Api<Device> = Api::namespaced(client.clone(), &ns);
    devices
        .create(
            &PostParams::default(),
            &Device::new(
                "meter-1",
                DeviceSpec {
                    node: node.clone(),
                    model: "meter".into(),
                    transport: Transport::Coap,
                    desired: Default::default(),
                    firmware: None,
                    retry: 0,
                },
            ),
        )
        .await
        .unwrap();
    let agent = |node: &str, store: &Store| {
        let settings = SyncSettings {
            tls: Some(CloudTls {
                ca_file: lab.ca_file(),
                server_name: None,
                client_certificate: Some(ClientCertificate {
                    cert_file: host_dir.join("tls.crt"),
                    key_file: host_dir.join("tls.key"),
                }),
            }),
            ..agent_sync_settings(format!("https://{}", controller.sync_addr), node)
        };
        tokio::spawn(sync::run(settings, store.clone()))
    };
    let store = Store::open(&dir.path().join("store")).unwrap().store;
    let running = agent(&node, &store);
    let key = ResourceKey::device(&ns, "meter-1");
    eventually("the agent holds its Device", || async {
        store.desired(&key).unwrap().map(|_| ())
    })
    .await;
    assert!(authentications("certificate") >= 1);

    // Naming another node with it: refused.
    let other_store = Store::open(&dir.path().join("other")).unwrap().store;
    let other = agent(&format!("cert-other-{}", std::process::id()), &other_store);
    eventually("a Hello naming another node is refused", || async {
        (authentications("node_mismatch") >= 1).then_some(())
    })
    .await;
    other.abort();

    // The operator revokes the certificates issued so far (the host's
    // box was stolen, or its key copied): the running session ends, the
    // agent's next connect is refused, and a new certificate the host asks
    // for is served.
    assert_eq!(authentications("revoked"), 0);
    let cut = k8s_openapi::jiff::Timestamp::now();
    edge_nodes
        .patch(
            &node,
            &PatchParams::default(),
            &Patch::Merge(json!({ "spec": { "certificatesRevokedBefore": cut } })),
        )
        .await
        .unwrap();
    eventually("the revoked certificate's session ends", || async {
        (authentications("revoked") >= 1).then_some(())
    })
    .await;
    eventually("the revoked certificate is refused", || async {
        (authentications("certificate_revoked") >= 1).then_some(())
    })
    .await;
    // (The cut has a second's precision.)
    tokio::time::sleep(Duration::from_millis(1100)).await;
    let served = authentications("certificate");
    std::fs::write(host_dir.join("tls.crt"), certify().await).unwrap();
    eventually("the host's new certificate is served", || async {
        (authentications("certificate") > served).then_some(())
    })
    .await;

    // The operator takes certificates away from the node: the running
    // session ends, and the agent's next connect is refused.
    let revoked = authentications("revoked");
    edge_nodes
        .patch(
            &node,
            &PatchParams::default(),
            &Patch::Merge(json!({ "spec": { "agentCredentials": null } })),
        )
        .await
        .unwrap();
    eventually("the running certificate session ends", || async {
        (authentications("revoked") > revoked).then_some(())
    })
    .await;
    eventually(
        "the certificate of a node that no longer takes them is refused",
        || async { (authentications("certificate_not_allowed") >= 1).then_some(()) },
    )
    .await;
    running.abort();

    // A session also ends when its certificate expires, whatever the
    // EdgeNode says.
    edge_nodes
        .patch(
            &node,
            &PatchParams::default(),
            &Patch::Merge(json!({ "spec": { "agentCredentials": "ClientCertificate" } })),
        )
        .await
        .unwrap();
    let expiring = agent_certs::Presented {
        not_after: std::time::SystemTime::now() + Duration::from_secs(1),
        ..presented
    };
    let reason = tokio::time::timeout(
        Duration::from_secs(10),
        agent_certs::withdrawn(&edge_nodes, &expiring, Duration::from_secs(3600)),
    )
    .await
    .expect("the session outlived its certificate");
    assert!(reason.contains("expired"), "{reason}");
}
