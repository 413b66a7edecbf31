//! Agents' identities in tests: what the kubelet gives a pod of the agents'
//! DaemonSet, made by hand. A Pod of the agents' ServiceAccount is created
//! on a node (no kubelet runs it: the API server only needs the object),
//! and a token bound to it is requested for the audience `edgefleet`, as
//! the kubelet requests the projected one. The controller reviews such a
//! token exactly as one from a real node.

use std::path::Path;
use std::time::Duration;

use anyhow::Context;

use k8s_openapi::api::authentication::v1::{BoundObjectReference, TokenRequest, TokenRequestSpec};
use k8s_openapi::api::core::v1::{Container, Pod, PodSpec, ServiceAccount};
use kube::api::{DeleteParams, ObjectMeta, PostParams};
use kube::{Api, Client};

/// The agents' ServiceAccount in each test namespace.
pub const ACCOUNT: &str = "edgefleet-agent";

/// The audience agents' tokens are for.
pub const AUDIENCE: &str = edgefleet_cloud::agent_identity::AUDIENCE;

/// How long the tokens last: a day, so a long `edgefleet-up` keeps its
/// agents (the kubelet would renew them; nobody does here).
const EXPIRY_SECONDS: i64 = 24 * 3600;

/// The controller's flag that takes tokens of `namespace`'s agents'
/// ServiceAccount.
pub fn cloud_args(namespace: &str) -> Vec<String> {
    vec![format!("--agent-service-account={namespace}/{ACCOUNT}")]
}

/// A pod of the agents' ServiceAccount on a node, and its token.
#[derive(Debug, Clone)]
pub struct AgentPod {
    /// The pod's name.
    pub name: String,
    /// Its namespace.
    pub namespace: String,
    /// A token bound to it, for [`AUDIENCE`].
    pub token: String,
}

impl AgentPod {
    /// Creates the ServiceAccount `account` in `namespace` unless it
    /// exists, a pod of it on `node`, and a token bound to the pod for
    /// `audience`.
    pub async fn create(
        client: &Client,
        namespace: &str,
        account: &str,
        node: &str,
        audience: &str,
    ) -> anyhow::Result<AgentPod> {
        ensure_account(client, namespace, account).await?;
        let pods: Api<Pod> = Api::namespaced(client.clone(), namespace);
        let pod = Pod {
            metadata: ObjectMeta {
                generate_name: Some(format!("{account}-{node}-")),
                ..Default::default()
            },
            spec: Some(PodSpec {
                node_name: Some(node.to_owned()),
                service_account_name: Some(account.to_owned()),
                automount_service_account_token: Some(false),
                containers: vec![Container {
                    name: "agent".into(),
                    image: Some("edgefleet-agent:test".into()),
                    ..Default::default()
                }],
                ..Default::default()
            }),
            ..Default::default()
        };
        let pod = pods.create(&PostParams::default(), &pod).await?;
        let (name, uid) = (pod.metadata.name.unwrap(), pod.metadata.uid.unwrap());
        let bound = BoundObjectReference {
            kind: Some("Pod".into()),
            api_version: Some("v1".into()),
            name: Some(name.clone()),
            uid: Some(uid),
        };
        let token = request_token(client, namespace, account, Some(bound), audience).await?;
        Ok(AgentPod {
            name,
            namespace: namespace.to_owned(),
            token,
        })
    }

    /// [`AgentPod::create`] for the agents' ServiceAccount and audience.
    pub async fn on(client: &Client, namespace: &str, node: &str) -> anyhow::Result<AgentPod> {
        Self::create(client, namespace, ACCOUNT, node, AUDIENCE).await
    }

    /// Writes the token where an agent reads it (`--token-file`).
    pub fn write_token(&self, path: &Path) -> anyhow::Result<()> {
        if let Some(dir) = path.parent() {
            std::fs::create_dir_all(dir)?;
        }
        std::fs::write(path, &self.token)?;
        Ok(())
    }

    /// Deletes the pod at once (no kubelet would confirm a graceful
    /// deletion), which invalidates its tokens.
    pub async fn delete(&self, client: &Client) -> anyhow::Result<()> {
        let pods: Api<Pod> = Api::namespaced(client.clone(), &self.namespace);
        pods.delete(&self.name, &DeleteParams::default().grace_period(0))
            .await?;
        Ok(())
    }
}

/// A token of `account` for `audience`, bound to `bound` (or to nothing).
pub async fn token(
    client: &Client,
    namespace: &str,
    account: &str,
    bound: Option<BoundObjectReference>,
    audience: &str,
) -> anyhow::Result<String> {
    ensure_account(client, namespace, account).await?;
    request_token(client, namespace, account, bound, audience).await
}

/// [`token`] of an account that exists.
async fn request_token(
    client: &Client,
    namespace: &str,
    account: &str,
    bound: Option<BoundObjectReference>,
    audience: &str,
) -> anyhow::Result<String> {
    let accounts: Api<ServiceAccount> = Api::namespaced(client.clone(), namespace);
    let request = TokenRequest {
        spec: Some(TokenRequestSpec {
            audiences: Some(vec![audience.to_owned()]),
            bound_object_ref: bound,
            expiration_seconds: Some(EXPIRY_SECONDS),
        }),
        ..Default::default()
    };
    let issued = accounts
        .create_token_request(account, &PostParams::default(), &request)
        .await?;
    issued
        .status
        .and_then(|s| s.token)
        .context("the TokenRequest came back without a token")
}

async fn ensure_account(client: &Client, namespace: &str, account: &str) -> anyhow::Result<()> {
    let accounts: Api<ServiceAccount> = Api::namespaced(client.clone(), namespace);
    crate::ensure_exists(&accounts, account).await
}

/// `token` (one the API server issued) with its validity moved `earlier`
/// into the past and signed again with the API server's own ServiceAccount
/// signing key (`sa_key_pem`, SEC1 P-256, as the test control plane keeps
/// it): everything in it is as issued but the times, so with `earlier` past
/// its lifetime it is an expired token, and with zero a valid one.
pub fn resigned(token: &str, sa_key_pem: &str, earlier: Duration) -> anyhow::Result<String> {
    use jsonwebtoken::{Algorithm, EncodingKey, Header};
    use p256::pkcs8::EncodePrivateKey;
    let issued = jsonwebtoken::dangerous::insecure_decode::<serde_json::Value>(token)?;
    let mut claims = issued.claims;
    for claim in ["iat", "nbf", "exp"] {
        let at = claims[claim]
            .as_u64()
            .with_context(|| format!("the token has no {claim}"))?;
        claims[claim] = at.saturating_sub(earlier.as_secs()).into();
    }
    let key = p256::SecretKey::from_sec1_pem(sa_key_pem).context("a SEC1 P-256 key")?;
    let pkcs8 = key.to_pkcs8_der().context("the key as PKCS#8")?;
    let mut header = Header::new(Algorithm::ES256);
    header.kid = issued.header.kid;
    Ok(jsonwebtoken::encode(
        &header,
        &claims,
        &EncodingKey::from_ec_der(pkcs8.as_bytes()),
    )?)
}
