//! Client certificates for agents that are not pods, through the real API
//! server's CertificateSigningRequest API with the controller's signer
//! (`edgefleet.io/agent`) answering: only an EdgeNode an operator created
//! with `spec.agentCredentials: ClientCertificate` gets one; every other
//! request is denied with its reason and counted, and gets no certificate.

use std::sync::Arc;
use std::time::Duration;

use edgefleet_cloud::agent_certs::{self, AgentCa, SIGNER};
use edgefleet_shared::api::EdgeNode;
use edgefleet_shared::telemetry::Outcomes;
use edgefleet_tests::{control_plane, eventually};
use k8s_openapi::ByteString;
use k8s_openapi::api::certificates::v1::{
    CertificateSigningRequest, CertificateSigningRequestSpec,
};
use kube::api::{ObjectMeta, PostParams};
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

/// Creates the CSR `name` for the subject `CN=cn` with `usages`.
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
        AgentCa::load(dir.path()).unwrap(),
        outcomes.clone(),
    ));

    let id = std::process::id();
    let host = format!("cert-host-{id}");
    let pod_node = format!("cert-pod-{id}");
    let edge_nodes: Api<EdgeNode> = Api::all(client.clone());
    for (name, spec) in [
        (&host, json!({ "agentCredentials": "ClientCertificate" })),
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
            format!("good-{id}"),
            cn(&host),
            vec!["client auth", "digital signature"],
        ),
        (format!("pod-{id}"), cn(&pod_node), vec!["client auth"]),
        (
            format!("missing-{id}"),
            cn(&format!("cert-none-{id}")),
            vec!["client auth"],
        ),
        (
            format!("server-{id}"),
            cn(&host),
            vec!["client auth", "server auth"],
        ),
        (
            format!("kubelet-{id}"),
            format!("system:node:{host}"),
            vec!["client auth"],
        ),
    ];
    for (name, cn, usages) in &cases {
        request(&client, name, cn, usages).await;
    }
    let mut answers = Vec::new();
    for (name, _, _) in &cases {
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
        "NotACertificateNode",
        "NoSuchEdgeNode",
        "UnsupportedUsages",
        "WrongSubject",
    ];
    for ((type_, reason, certificate), want) in answers[1..].iter().zip(expected) {
        assert_eq!((type_.as_str(), reason.as_str()), ("Denied", want));
        assert!(certificate.is_none(), "{want}: a certificate was issued");
        assert_eq!(outcomes.get(want), 1, "{want} counted");
    }
    assert_eq!(outcomes.get("issued"), 1);
    signer.abort();
}

fn pem_der(pem: &str) -> CertificateDer<'static> {
    use rustls::pki_types::pem::PemObject;
    CertificateDer::from_pem_slice(pem.as_bytes()).unwrap()
}
