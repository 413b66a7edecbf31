//! `edgefleet-agent-csr`: the key and the certificate request of an agent
//! that is not a pod (a host at a site), for the controller's signer
//! `edgefleet.io/agent`.
//!
//! It writes a new private key to `<dir>/tls.key` (readable by its owner
//! only) and prints a CertificateSigningRequest (JSON) for `kubectl create
//! -f -`. The controller approves it only for an EdgeNode an operator
//! created with `spec.agentCredentials: ClientCertificate`; the issued
//! certificate goes to `<dir>/tls.crt`, and the agent runs with
//! `--client-cert-file <dir>/tls.crt --client-key-file <dir>/tls.key`.
//! The host holds no Kubernetes credential: whoever submits the request
//! does, with the right to create CSRs.

use std::io::Write;
use std::os::unix::fs::OpenOptionsExt;
use std::path::PathBuf;

use anyhow::Context;
use clap::Parser;
use edgefleet_shared::api::edge_node::{AGENT_COMMON_NAME_PREFIX, AGENT_SIGNER};
use k8s_openapi::ByteString;
use k8s_openapi::api::certificates::v1::{
    CertificateSigningRequest, CertificateSigningRequestSpec,
};
use k8s_openapi::apimachinery::pkg::apis::meta::v1::ObjectMeta;
use rcgen::{CertificateParams, DistinguishedName, DnType, KeyPair};

#[derive(Debug, Parser)]
#[command(
    name = "edgefleet-agent-csr",
    version,
    about = "Make an agent's key and print its CertificateSigningRequest for kubectl"
)]
struct Cli {
    /// The EdgeNode this agent serves (created by an operator with
    /// spec.agentCredentials: ClientCertificate).
    #[arg(long)]
    node: String,
    /// Where the key goes (tls.key); the certificate belongs next to it.
    #[arg(long)]
    dir: PathBuf,
    /// How long the certificate should be valid (the controller gives at
    /// most 30 days; Kubernetes asks for at least 600 s).
    #[arg(long, default_value_t = 30 * 24 * 3600)]
    expiration_seconds: i32,
}

fn main() -> anyhow::Result<()> {
    let cli = Cli::parse();
    let key = KeyPair::generate().context("make a key")?;
    let mut params = CertificateParams::default();
    let mut subject = DistinguishedName::new();
    subject.push(
        DnType::CommonName,
        format!("{AGENT_COMMON_NAME_PREFIX}{}", cli.node),
    );
    params.distinguished_name = subject;
    let request = params.serialize_request(&key).context("make the request")?;
    let key_path = cli.dir.join("tls.key");
    std::fs::create_dir_all(&cli.dir).with_context(|| format!("create {}", cli.dir.display()))?;
    std::fs::OpenOptions::new()
        .write(true)
        .create(true)
        .truncate(true)
        .mode(0o600)
        .open(&key_path)
        .and_then(|mut f| f.write_all(key.serialize_pem().as_bytes()))
        .with_context(|| format!("write {}", key_path.display()))?;
    let name = format!(
        "edgefleet-agent-{}-{}",
        cli.node,
        std::time::SystemTime::now()
            .duration_since(std::time::UNIX_EPOCH)
            .unwrap_or_default()
            .as_secs()
    );
    let csr = CertificateSigningRequest {
        metadata: ObjectMeta {
            name: Some(name.clone()),
            ..Default::default()
        },
        spec: CertificateSigningRequestSpec {
            request: ByteString(request.pem().context("encode the request")?.into_bytes()),
            signer_name: AGENT_SIGNER.to_owned(),
            usages: Some(vec!["client auth".into(), "digital signature".into()]),
            expiration_seconds: Some(cli.expiration_seconds),
            ..Default::default()
        },
        status: None,
    };
    println!("{}", serde_json::to_string_pretty(&csr)?);
    eprintln!(
        "wrote {key}; submit the request with `kubectl create -f -`, then once it is issued:\n  kubectl get csr {name} -o jsonpath='{{.status.certificate}}' | base64 -d > {crt}",
        key = key_path.display(),
        crt = cli.dir.join("tls.crt").display(),
    );
    Ok(())
}
