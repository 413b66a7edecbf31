//! Client certificates for agents that are not pods, through the Kubernetes
//! CertificateSigningRequest API: the controller is the signer
//! [`SIGNER`], like the kube-controller-manager is for a kubelet's TLS
//! bootstrap.
//!
//! An agent on a plain host (no kubelet, so no projected token) creates a
//! CSR with its own key, the subject `CN=edgefleet:agent:<node>` and the
//! usage `client auth`. The controller approves it only if an operator
//! created the EdgeNode `<node>` with `spec.agentCredentials:
//! ClientCertificate` (the controller never sets that field, and creates
//! EdgeNodes only for agents that proved their node with a token), and
//! otherwise denies it with a reason a person can act on. It then signs
//! every approved request of its signer that it would have approved
//! itself — whoever approved it — with the CA from `--agent-ca-dir`: a
//! client-auth-only certificate for that name, for at most
//! [`MAX_VALIDITY`] (or the shorter `expirationSeconds` asked for).
//!
//! What is checked is pure ([`read`], [`admit`]) and tested without an API
//! server; [`run`] is the controller around it.

use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::time::{Duration, SystemTime};

use edgefleet_shared::api::EdgeNode;
use edgefleet_shared::api::edge_node::AgentCredentials;
use futures::StreamExt;
use k8s_openapi::ByteString;
use k8s_openapi::api::certificates::v1::{
    CertificateSigningRequest, CertificateSigningRequestSpec,
};
use kube::api::{Patch, PatchParams};
use kube::runtime::controller::{Action, Controller};
use kube::runtime::watcher;
use kube::{Api, Client, ResourceExt};
use rcgen::{
    CertificateParams, CertificateSigningRequestParams, DistinguishedName, DnType, DnValue,
    ExtendedKeyUsagePurpose, IsCa, Issuer, KeyPair, KeyUsagePurpose, SerialNumber,
};
use serde_json::json;

use crate::status::FIELD_MANAGER;
use crate::sync::is_node_name;
use edgefleet_shared::telemetry::Outcomes;

pub use edgefleet_shared::api::edge_node::{
    AGENT_COMMON_NAME_PREFIX as COMMON_NAME_PREFIX, AGENT_SIGNER as SIGNER,
};

/// The longest a certificate is valid; an agent renews well before.
pub const MAX_VALIDITY: Duration = Duration::from_secs(30 * 24 * 3600);

/// The usages a request may ask for; `client auth` it must.
const ALLOWED_USAGES: [&str; 3] = ["client auth", "digital signature", "key encipherment"];

/// Why a request is denied: the reason (a CSR condition's reason) and a
/// message for people.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Denial {
    /// PascalCase, as conditions have it; also the counter's label.
    pub reason: &'static str,
    /// What is wrong and what to do.
    pub message: String,
}

fn deny(reason: &'static str, message: String) -> Denial {
    Denial { reason, message }
}

/// A request this signer could sign: the node it names and its key.
#[derive(Debug)]
pub struct Request {
    /// The EdgeNode's name.
    pub node: String,
    parsed: CertificateSigningRequestParams,
}

/// Reads a CSR of this signer: its usages, its PEM request (whose
/// signature must verify), a subject of exactly `CN=edgefleet:agent:<node>`
/// and nothing a client certificate must not carry (other names, CA).
pub fn read(spec: &CertificateSigningRequestSpec) -> Result<Request, Denial> {
    let usages = spec.usages.as_deref().unwrap_or_default();
    if !usages.iter().any(|u| u == "client auth")
        || usages.iter().any(|u| !ALLOWED_USAGES.contains(&u.as_str()))
    {
        return Err(deny(
            "UnsupportedUsages",
            format!(
                "usages must include \"client auth\" and be among {ALLOWED_USAGES:?}; asked for {usages:?}"
            ),
        ));
    }
    let pem = std::str::from_utf8(&spec.request.0)
        .map_err(|_| deny("InvalidRequest", "the request is not PEM text".into()))?;
    let parsed = CertificateSigningRequestParams::from_pem(pem).map_err(|error| {
        deny(
            "InvalidRequest",
            format!("the request could not be read or its signature is wrong: {error}"),
        )
    })?;
    let names: Vec<(&DnType, &DnValue)> = parsed.params.distinguished_name.iter().collect();
    let common_name = match names.as_slice() {
        [(DnType::CommonName, value)] => dn_text(value),
        _ => None,
    };
    let node = common_name
        .as_deref()
        .and_then(|cn| cn.strip_prefix(COMMON_NAME_PREFIX))
        .filter(|node| is_node_name(node))
        .ok_or_else(|| {
            deny(
                "WrongSubject",
                format!(
                    "the subject must be exactly CN={COMMON_NAME_PREFIX}<EdgeNode name>; it is {:?}",
                    names
                ),
            )
        })?
        .to_owned();
    if !parsed.params.subject_alt_names.is_empty() {
        return Err(deny(
            "UnexpectedNames",
            "an agent's client certificate carries no subject alternative names".into(),
        ));
    }
    if matches!(parsed.params.is_ca, IsCa::Ca(_)) {
        return Err(deny(
            "CaRequested",
            "an agent's certificate cannot be a CA".into(),
        ));
    }
    Ok(Request { node, parsed })
}

fn dn_text(value: &DnValue) -> Option<String> {
    match value {
        DnValue::Utf8String(s) => Some(s.clone()),
        DnValue::PrintableString(s) => Some(s.as_str().to_owned()),
        _ => None,
    }
}

/// How long before its signing a certificate's validity starts (for hosts
/// whose clock is a little behind). A certificate's `notBefore` plus this
/// is when it was issued.
const BACKDATE: Duration = Duration::from_secs(60);

/// What the sync server reads of a client certificate of this signer.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Presented {
    /// The node its subject names: the common name after
    /// [`COMMON_NAME_PREFIX`].
    pub node: String,
    /// When it was signed.
    pub issued_at: SystemTime,
    /// When it stops being valid.
    pub not_after: SystemTime,
}

/// Reads a client certificate of this signer. (The sync server calls it
/// only on a certificate its TLS handshake verified against the agents'
/// CA, which issues nothing else.)
pub fn presented(certificate: &rustls::pki_types::CertificateDer<'_>) -> Option<Presented> {
    let (_, parsed) = x509_parser::parse_x509_certificate(certificate).ok()?;
    let mut names = parsed.subject().iter_common_name();
    let cn = names.next()?.as_str().ok()?;
    if names.next().is_some() {
        return None;
    }
    let node = cn
        .strip_prefix(COMMON_NAME_PREFIX)
        .filter(|node| is_node_name(node))?
        .to_owned();
    let at = |t: x509_parser::time::ASN1Time| {
        u64::try_from(t.timestamp())
            .ok()
            .map(|s| SystemTime::UNIX_EPOCH + Duration::from_secs(s))
    };
    let validity = parsed.validity();
    Some(Presented {
        node,
        issued_at: at(validity.not_before)? + BACKDATE,
        not_after: at(validity.not_after)?,
    })
}

/// Whether a session may run on `certificate` at `now`: its EdgeNode
/// takes certificates, has not revoked it, and it has not expired (the
/// TLS handshake checked that once; a connection outlives it).
pub fn admit_certificate(
    certificate: &Presented,
    edge_node: Option<&EdgeNode>,
    now: SystemTime,
) -> Result<(), Denial> {
    admit(&certificate.node, edge_node)?;
    if certificate.not_after <= now {
        return Err(deny(
            "CertificateExpired",
            format!(
                "the client certificate of {} expired; the host asks for a new one",
                certificate.node
            ),
        ));
    }
    let revoked_before = edge_node
        .and_then(|e| e.spec.certificates_revoked_before.as_ref())
        .map(|t| SystemTime::from(t.0));
    if revoked_before.is_some_and(|cut| certificate.issued_at < cut) {
        return Err(deny(
            "CertificateRevoked",
            format!(
                "EdgeNode {} revoked the certificates issued before its spec.certificatesRevokedBefore; the host asks for a new one",
                certificate.node
            ),
        ));
    }
    Ok(())
}

/// While a session runs on `certificate`: reads its EdgeNode every
/// `every` and returns why the session must end once the EdgeNode no
/// longer takes certificates (or is gone) or revoked this one, or the
/// certificate expired. A read that fails is no verdict.
pub async fn withdrawn(
    edge_nodes: &Api<EdgeNode>,
    certificate: &Presented,
    every: Duration,
) -> String {
    let node = &certificate.node;
    let left = certificate
        .not_after
        .duration_since(SystemTime::now())
        .unwrap_or_default();
    let expiry = tokio::time::sleep(left);
    tokio::pin!(expiry);
    loop {
        tokio::select! {
            () = &mut expiry => return "its client certificate expired".into(),
            () = tokio::time::sleep(every) => {}
        }
        match edge_nodes.get_opt(node).await {
            Ok(edge_node) => {
                if let Err(denial) =
                    admit_certificate(certificate, edge_node.as_ref(), SystemTime::now())
                {
                    return denial.message;
                }
            }
            Err(error) => {
                tracing::debug!(%node, %error, "could not read the EdgeNode of a certificate session")
            }
        }
    }
}

/// Whether `node` may have a client certificate: an operator created its
/// EdgeNode for one.
pub fn admit(node: &str, edge_node: Option<&EdgeNode>) -> Result<(), Denial> {
    let Some(edge_node) = edge_node else {
        return Err(deny(
            "NoSuchEdgeNode",
            format!(
                "there is no EdgeNode {node}; an operator creates it, with spec.agentCredentials: ClientCertificate, before its agent asks for a certificate"
            ),
        ));
    };
    if edge_node.spec.agent_credentials != Some(AgentCredentials::ClientCertificate) {
        return Err(deny(
            "NotACertificateNode",
            format!(
                "EdgeNode {node} does not have spec.agentCredentials: ClientCertificate; its agent proves its node with a pod's token"
            ),
        ));
    }
    Ok(())
}

/// Whether `requester` (a CSR's `spec.username`, which the API server
/// sets to whoever created it) may have a certificate for `node`: its
/// EdgeNode takes certificates and names that user among
/// `spec.certificateRequesters`. Whoever else may create CSRs (every
/// kubelet, every bootstrap token) gets nothing for this node.
pub fn admit_request(
    node: &str,
    edge_node: Option<&EdgeNode>,
    requester: Option<&str>,
) -> Result<(), Denial> {
    admit(node, edge_node)?;
    let allowed = edge_node.map_or(&[][..], |e| &e.spec.certificate_requesters[..]);
    match requester {
        Some(user) if allowed.iter().any(|a| a == user) => Ok(()),
        _ => Err(deny(
            "RequesterNotAllowed",
            format!(
                "{} may not ask for a certificate of EdgeNode {node}; its spec.certificateRequesters names {allowed:?}",
                requester.map_or_else(
                    || "a request without a user name".to_owned(),
                    |u| format!("user {u:?}")
                ),
            ),
        )),
    }
}

/// The CA that signs agents' certificates.
#[derive(Debug)]
pub struct AgentCa {
    issuer: Issuer<'static, KeyPair>,
    /// Its certificate (PEM): what the sync server trusts agents by.
    pub certificate_pem: String,
}

/// Why the CA could not be loaded or a certificate made.
#[derive(Debug, thiserror::Error)]
pub enum CaError {
    /// A file could not be read.
    #[error("read {path}: {source}")]
    Read {
        /// The file.
        path: PathBuf,
        /// Why.
        source: std::io::Error,
    },
    /// rcgen refused.
    #[error("{0}")]
    Certificate(#[from] rcgen::Error),
}

impl AgentCa {
    /// The CA in `dir`: `tls.crt` and `tls.key`, the layout of the Secret
    /// cert-manager writes for a CA Certificate.
    pub fn load(dir: &Path) -> Result<AgentCa, CaError> {
        let read = |name: &str| {
            let path = dir.join(name);
            std::fs::read_to_string(&path).map_err(|source| CaError::Read { path, source })
        };
        let certificate_pem = read("tls.crt")?;
        let key = KeyPair::from_pem(&read("tls.key")?)?;
        let issuer = Issuer::from_ca_cert_pem(&certificate_pem, key)?;
        Ok(AgentCa {
            issuer,
            certificate_pem,
        })
    }

    /// A client certificate (PEM) for `request`'s node and key, valid from
    /// a minute ago for `validity`.
    pub fn issue(&self, request: &Request, validity: Duration) -> Result<String, CaError> {
        let mut params = CertificateParams::default();
        let mut name = DistinguishedName::new();
        name.push(
            DnType::CommonName,
            format!("{COMMON_NAME_PREFIX}{}", request.node),
        );
        params.distinguished_name = name;
        let now = time::OffsetDateTime::now_utc();
        params.not_before = now - BACKDATE;
        params.not_after = now + validity;
        params.is_ca = IsCa::ExplicitNoCa;
        params.key_usages = vec![KeyUsagePurpose::DigitalSignature];
        params.extended_key_usages = vec![ExtendedKeyUsagePurpose::ClientAuth];
        params.serial_number = Some(SerialNumber::from_slice(&rand::random::<[u8; 16]>()));
        let signed = CertificateSigningRequestParams {
            params,
            public_key: request.parsed.public_key.clone(),
        }
        .signed_by(&self.issuer)?;
        Ok(signed.pem())
    }
}

/// How long a certificate for `spec` is valid: what it asks for, at most
/// [`MAX_VALIDITY`].
fn validity(spec: &CertificateSigningRequestSpec) -> Duration {
    spec.expiration_seconds
        .and_then(|s| u64::try_from(s).ok())
        .map_or(MAX_VALIDITY, |s| Duration::from_secs(s).min(MAX_VALIDITY))
}

struct Context {
    csrs: Api<CertificateSigningRequest>,
    edge_nodes: Api<EdgeNode>,
    ca: Arc<AgentCa>,
    outcomes: Outcomes,
}

/// Approves or denies, and signs, the CSRs of [`SIGNER`] until the watch
/// ends. `outcomes` counts `issued` and each denial's reason.
pub async fn run(client: Client, ca: Arc<AgentCa>, outcomes: Outcomes) {
    let csrs: Api<CertificateSigningRequest> = Api::all(client.clone());
    let context = Arc::new(Context {
        csrs: csrs.clone(),
        edge_nodes: Api::all(client),
        ca,
        outcomes,
    });
    let config = watcher::Config::default().fields(&format!("spec.signerName={SIGNER}"));
    Controller::new(csrs, config)
        .run(reconcile, error_policy, context)
        .for_each(|result| async move {
            if let Err(error) = result {
                tracing::debug!(%error, "certificate request not settled; tried again");
            }
        })
        .await;
}

fn error_policy(_: Arc<CertificateSigningRequest>, error: &kube::Error, _: Arc<Context>) -> Action {
    tracing::warn!(%error, "could not answer a certificate request; trying again in 5 s");
    Action::requeue(Duration::from_secs(5))
}

/// Whether `csr` has a condition of `type_` that holds.
fn has(csr: &CertificateSigningRequest, type_: &str) -> bool {
    csr.status
        .as_ref()
        .and_then(|s| s.conditions.as_ref())
        .is_some_and(|c| c.iter().any(|c| c.type_ == type_ && c.status == "True"))
}

async fn reconcile(
    csr: Arc<CertificateSigningRequest>,
    context: Arc<Context>,
) -> Result<Action, kube::Error> {
    let issued = csr
        .status
        .as_ref()
        .is_some_and(|s| s.certificate.as_ref().is_some_and(|c| !c.0.is_empty()));
    if csr.spec.signer_name != SIGNER || issued || has(&csr, "Denied") || has(&csr, "Failed") {
        return Ok(Action::await_change());
    }
    let name = csr.name_any();
    // This signer approves only requests of a node's requesters, so an
    // approved request it has not signed yet was approved by a person
    // (who holds `approve` on this signer): it is signed for whoever asked,
    // while the node takes certificates.
    let approved = has(&csr, "Approved");
    let verdict = match read(&csr.spec) {
        Ok(request) => {
            let edge_node = context.edge_nodes.get_opt(&request.node).await?;
            match approved {
                true => admit(&request.node, edge_node.as_ref()),
                false => admit_request(
                    &request.node,
                    edge_node.as_ref(),
                    csr.spec.username.as_deref(),
                ),
            }
            .map(|()| request)
        }
        Err(denial) => Err(denial),
    };
    let params = PatchParams::apply(FIELD_MANAGER);
    let request = match verdict {
        Err(denial) if approved => {
            // A person approved what this signer will not sign.
            tracing::warn!(csr = %name, reason = denial.reason, message = %denial.message, "an approved certificate request is not signed");
            set_condition(&context, &name, "Failed", &denial, false).await?;
            context.outcomes.inc(denial.reason);
            return Ok(Action::await_change());
        }
        Err(denial) => {
            tracing::warn!(csr = %name, reason = denial.reason, message = %denial.message, "certificate request denied");
            set_condition(&context, &name, "Denied", &denial, true).await?;
            context.outcomes.inc(denial.reason);
            return Ok(Action::await_change());
        }
        Ok(request) => request,
    };
    if !approved {
        let approval = Denial {
            reason: "EdgeNodeTakesCertificates",
            message: format!(
                "EdgeNode {} takes client certificates and names {:?} among its spec.certificateRequesters",
                request.node,
                csr.spec.username.as_deref().unwrap_or_default(),
            ),
        };
        set_condition(&context, &name, "Approved", &approval, true).await?;
    }
    let pem = match context.ca.issue(&request, validity(&csr.spec)) {
        Ok(pem) => pem,
        Err(error) => {
            tracing::error!(csr = %name, %error, "could not sign a certificate request");
            return Ok(Action::requeue(Duration::from_secs(30)));
        }
    };
    let status = json!({ "status": { "certificate": ByteString(pem.into_bytes()) } });
    context
        .csrs
        .patch_status(&name, &params, &Patch::Merge(&status))
        .await?;
    context.outcomes.inc("issued");
    tracing::info!(csr = %name, node = %request.node, "issued an agent's client certificate");
    Ok(Action::await_change())
}

/// Sets a condition on a CSR: `Approved` or `Denied` through the approval
/// subresource, `Failed` through status.
async fn set_condition(
    context: &Context,
    name: &str,
    type_: &str,
    why: &Denial,
    approval: bool,
) -> Result<(), kube::Error> {
    let now =
        k8s_openapi::apimachinery::pkg::apis::meta::v1::Time(k8s_openapi::jiff::Timestamp::now());
    let patch = json!({ "status": { "conditions": [{
        "type": type_,
        "status": "True",
        "reason": why.reason,
        "message": why.message,
        "lastUpdateTime": now,
    }] } });
    let params = PatchParams::default();
    match approval {
        true => {
            context
                .csrs
                .patch_approval(name, &params, &Patch::Merge(&patch))
                .await?
        }
        false => {
            context
                .csrs
                .patch_status(name, &params, &Patch::Merge(&patch))
                .await?
        }
    };
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;
    use edgefleet_shared::api::EdgeNodeSpec;
    use k8s_openapi::apimachinery::pkg::apis::meta::v1::Time;

    /// A CSR spec for `cn` with `usages`, and its key.
    fn request(cn: &str, usages: &[&str], sans: &[&str]) -> CertificateSigningRequestSpec {
        let key = KeyPair::generate().unwrap();
        let mut params =
            CertificateParams::new(sans.iter().map(|s| (*s).to_owned()).collect::<Vec<_>>())
                .unwrap();
        let mut name = DistinguishedName::new();
        name.push(DnType::CommonName, cn);
        params.distinguished_name = name;
        let csr = params.serialize_request(&key).unwrap();
        CertificateSigningRequestSpec {
            request: ByteString(csr.pem().unwrap().into_bytes()),
            signer_name: SIGNER.into(),
            usages: Some(usages.iter().map(|u| (*u).to_owned()).collect()),
            ..Default::default()
        }
    }

    fn reason(result: Result<Request, Denial>) -> &'static str {
        result.map(|_| "accepted").unwrap_or_else(|d| d.reason)
    }

    #[test]
    fn a_request_names_its_node_in_the_subject_asks_for_client_auth_and_nothing_more() {
        let ok = read(&request(
            "edgefleet:agent:site-7",
            &["client auth", "digital signature"],
            &[],
        ));
        assert_eq!(ok.unwrap().node, "site-7");
        for (spec, expected) in [
            (
                request(
                    "edgefleet:agent:site-7",
                    &["server auth", "client auth"],
                    &[],
                ),
                "UnsupportedUsages",
            ),
            (
                request("edgefleet:agent:site-7", &["digital signature"], &[]),
                "UnsupportedUsages",
            ),
            (
                request("system:node:site-7", &["client auth"], &[]),
                "WrongSubject",
            ),
            (
                request("edgefleet:agent:", &["client auth"], &[]),
                "WrongSubject",
            ),
            (
                request("edgefleet:agent:Site_7", &["client auth"], &[]),
                "WrongSubject",
            ),
            (
                request(
                    "edgefleet:agent:site-7",
                    &["client auth"],
                    &["cloud.example"],
                ),
                "UnexpectedNames",
            ),
        ] {
            assert_eq!(reason(read(&spec)), expected);
        }
        let mut garbled = request("edgefleet:agent:site-7", &["client auth"], &[]);
        // A character of the base64 body (not a line end).
        garbled.request.0[120] ^= 1;
        assert_eq!(reason(read(&garbled)), "InvalidRequest");
    }

    #[test]
    fn only_an_edge_node_an_operator_made_for_certificates_gets_one() {
        let mut node = EdgeNode::new("site-7", EdgeNodeSpec::default());
        assert_eq!(admit("site-7", None).unwrap_err().reason, "NoSuchEdgeNode");
        assert_eq!(
            admit("site-7", Some(&node)).unwrap_err().reason,
            "NotACertificateNode"
        );
        node.spec.agent_credentials = Some(AgentCredentials::ClientCertificate);
        assert_eq!(admit("site-7", Some(&node)), Ok(()));
    }

    #[test]
    fn only_a_requester_the_edge_node_names_gets_its_certificate() {
        let mut node = EdgeNode::new("site-7", EdgeNodeSpec::default());
        node.spec.agent_credentials = Some(AgentCredentials::ClientCertificate);
        let gw = "system:serviceaccount:edge-hosts:gw-7";
        // Nobody named: nobody gets one.
        assert_eq!(
            admit_request("site-7", Some(&node), Some(gw))
                .unwrap_err()
                .reason,
            "RequesterNotAllowed"
        );
        node.spec.certificate_requesters = vec![gw.into()];
        assert_eq!(admit_request("site-7", Some(&node), Some(gw)), Ok(()));
        // Another node's kubelet, a request without a user.
        for requester in [Some("system:node:site-8"), None] {
            let denial = admit_request("site-7", Some(&node), requester).unwrap_err();
            assert_eq!(denial.reason, "RequesterNotAllowed");
            assert!(denial.message.contains(gw), "{}", denial.message);
        }
        // The node must still take certificates.
        node.spec.agent_credentials = None;
        assert_eq!(
            admit_request("site-7", Some(&node), Some(gw))
                .unwrap_err()
                .reason,
            "NotACertificateNode"
        );
    }

    #[test]
    fn a_certificate_serves_until_it_expires_or_its_edge_node_revokes_it() {
        let ca_key = KeyPair::generate().unwrap();
        let mut ca_params = CertificateParams::default();
        ca_params.is_ca = IsCa::Ca(rcgen::BasicConstraints::Unconstrained);
        let ca_cert = ca_params.self_signed(&ca_key).unwrap();
        let ca = AgentCa {
            issuer: Issuer::from_ca_cert_pem(&ca_cert.pem(), ca_key).unwrap(),
            certificate_pem: ca_cert.pem(),
        };
        let spec = request("edgefleet:agent:site-7", &["client auth"], &[]);
        let pem = ca
            .issue(&read(&spec).unwrap(), Duration::from_secs(3600))
            .unwrap();
        use rustls::pki_types::pem::PemObject;
        let der = rustls::pki_types::CertificateDer::from_pem_slice(pem.as_bytes()).unwrap();
        let presented = presented(&der).unwrap();
        assert_eq!(presented.node, "site-7");
        let now = SystemTime::now();
        let issued_ago = now.duration_since(presented.issued_at).unwrap();
        assert!(issued_ago < Duration::from_secs(2), "{issued_ago:?}");

        let mut node = EdgeNode::new("site-7", EdgeNodeSpec::default());
        node.spec.agent_credentials = Some(AgentCredentials::ClientCertificate);
        assert_eq!(admit_certificate(&presented, Some(&node), now), Ok(()));
        let reason = |node: &EdgeNode, at: SystemTime| {
            admit_certificate(&presented, Some(node), at)
                .map(|()| "admitted")
                .unwrap_or_else(|d| d.reason)
        };
        // Expired: refused at stream open, whatever the connection's age.
        assert_eq!(
            reason(&node, now + Duration::from_secs(3601)),
            "CertificateExpired"
        );
        // Revoked: every certificate issued before the time, not one after.
        let time = |t: SystemTime| Time(k8s_openapi::jiff::Timestamp::try_from(t).unwrap());
        node.spec.certificates_revoked_before = Some(time(now + Duration::from_secs(2)));
        assert_eq!(reason(&node, now), "CertificateRevoked");
        node.spec.certificates_revoked_before = Some(time(now - Duration::from_secs(2)));
        assert_eq!(reason(&node, now), "admitted");
        node.spec.agent_credentials = None;
        assert_eq!(reason(&node, now), "NotACertificateNode");
    }

    #[test]
    fn an_issued_certificate_is_for_client_auth_only_and_lives_as_long_as_asked_at_most_a_month() {
        let mut spec = request("edgefleet:agent:site-7", &["client auth"], &[]);
        assert_eq!(validity(&spec), MAX_VALIDITY);
        spec.expiration_seconds = Some(3600);
        assert_eq!(validity(&spec), Duration::from_secs(3600));
        spec.expiration_seconds = Some(i32::MAX);
        assert_eq!(validity(&spec), MAX_VALIDITY);
    }
}
