//! Who an agent is, from Kubernetes: the node its ServiceAccount token is
//! bound to.
//!
//! An agent runs as a pod of the DaemonSet, whose kubelet projects a token
//! for the audience [`AUDIENCE`] into it. The agent sends the token with
//! every connection (`authorization: Bearer …`); the controller asks the API
//! server about it (a TokenReview) and takes the node from the token's pod
//! binding: the `authentication.kubernetes.io/node-name` extra that tokens
//! of a pod carry (Kubernetes 1.30 on; see docs/security.md). The token must
//! be for [`AUDIENCE`] and belong to the agents' ServiceAccount: any pod can
//! have a token of any audience projected, but only pods that run as that
//! account speak for their node. Deleting the pod invalidates its token.
//!
//! Verdicts are cached for [`REVIEW_TTL`], keyed by the token's SHA-256, so
//! a reconnecting fleet costs one review per agent; a deleted pod's token
//! is refused at the latest that long after. At most [`MAX_REVIEWS`] reviews
//! run at once and the rest wait their turn up to [`REVIEW_WAIT`]: a flood
//! of made-up tokens reaches the API server at that pace, not all at once.

use std::sync::Arc;
use std::time::Duration;

use k8s_openapi::api::authentication::v1::{TokenReview, TokenReviewSpec, TokenReviewStatus};
use kube::Api;
use kube::api::PostParams;
use prometheus_client::metrics::counter::Counter;
use sha2::{Digest, Sha256};
use tokio::sync::Semaphore;

/// The audience agents' tokens are for.
pub const AUDIENCE: &str = "edgefleet";

/// The extra of a pod-bound token that names the pod's node.
pub const NODE_NAME_EXTRA: &str = "authentication.kubernetes.io/node-name";

/// How long a verdict about a token is reused.
pub const REVIEW_TTL: Duration = Duration::from_secs(10);

/// Token reviews in flight at most.
pub const MAX_REVIEWS: usize = 32;

/// How long a connection waits for its turn to be reviewed before it is
/// refused as busy (a reconnect storm queues; the queue is bounded by the
/// open streams, see `sync::admission`).
pub const REVIEW_WAIT: Duration = Duration::from_secs(10);

/// Longest bearer token taken (projected tokens are about 1 KiB).
pub const MAX_TOKEN_BYTES: usize = 8 * 1024;

/// How agents are to prove which node they are.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum AuthSettings {
    /// By a token of the ServiceAccount `namespace`/`name`.
    ServiceAccount {
        /// Its namespace.
        namespace: String,
        /// Its name.
        name: String,
    },
    /// Not at all (`--insecure-unauthenticated-agents`).
    TrustHello,
}

impl std::str::FromStr for AuthSettings {
    type Err = String;

    /// `<namespace>/<name>`.
    fn from_str(text: &str) -> Result<Self, String> {
        match text.split_once('/') {
            Some((namespace, name)) if !namespace.is_empty() && !name.is_empty() => {
                Ok(AuthSettings::ServiceAccount {
                    namespace: namespace.to_owned(),
                    name: name.to_owned(),
                })
            }
            _ => Err(format!("{text:?} is not <namespace>/<name>")),
        }
    }
}

/// How agents prove which node they are.
#[derive(Clone, Debug)]
pub enum AgentAuth {
    /// By a ServiceAccount token, reviewed by the API server.
    Tokens(Arc<TokenReviews>),
    /// Not at all: the node a Hello names is believed. Local demos and
    /// protocol tests only.
    TrustHello,
}

impl AgentAuth {
    /// The check `settings` asks for, reviewing with `client` and counting
    /// the reviews in `reviews`.
    pub fn new(settings: &AuthSettings, client: kube::Client, reviews: Counter) -> Self {
        match settings {
            AuthSettings::ServiceAccount { namespace, name } => AgentAuth::Tokens(Arc::new(
                TokenReviews::new(client, namespace, name, reviews),
            )),
            AuthSettings::TrustHello => AgentAuth::TrustHello,
        }
    }
}

/// Why an agent was not let in.
#[derive(Clone, Debug, PartialEq, Eq, thiserror::Error)]
pub enum Refusal {
    #[error("no bearer token: the agent must send its ServiceAccount token (--token-file)")]
    NoToken,
    #[error("the authorization header is not a bearer token of at most {MAX_TOKEN_BYTES} bytes")]
    Malformed,
    #[error("the API server did not accept the token: {0}")]
    Invalid(String),
    #[error("the token is not for the audience {AUDIENCE}")]
    WrongAudience,
    #[error("the token is {0}'s, not the agents' ServiceAccount's")]
    WrongServiceAccount(String),
    #[error("the token is not bound to a pod on a node")]
    NotBoundToNode,
    #[error("too many token reviews in flight; try again")]
    Busy,
}

impl Refusal {
    /// The `outcome` label it is counted under.
    pub fn label(&self) -> &'static str {
        match self {
            Refusal::NoToken => "no_token",
            Refusal::Malformed => "malformed_token",
            Refusal::Invalid(_) => "invalid_token",
            Refusal::WrongAudience => "wrong_audience",
            Refusal::WrongServiceAccount(_) => "wrong_service_account",
            Refusal::NotBoundToNode => "not_bound_to_node",
            Refusal::Busy => "busy",
        }
    }

    /// What the agent is told.
    pub fn status(&self) -> tonic::Status {
        match self {
            Refusal::Busy => tonic::Status::unavailable(self.to_string()),
            _ => tonic::Status::unauthenticated(self.to_string()),
        }
    }
}

/// The bearer token of an `authorization` header value.
pub fn bearer(header: Option<&[u8]>) -> Result<&str, Refusal> {
    let header = header.ok_or(Refusal::NoToken)?;
    if header.len() > MAX_TOKEN_BYTES + 7 {
        return Err(Refusal::Malformed);
    }
    let text = std::str::from_utf8(header).map_err(|_| Refusal::Malformed)?;
    let token = text
        .strip_prefix("Bearer ")
        .ok_or(Refusal::Malformed)?
        .trim();
    match token.is_empty() {
        true => Err(Refusal::Malformed),
        false => Ok(token),
    }
}

/// The node of a reviewed token: authenticated, for [`AUDIENCE`], of
/// `account` (`system:serviceaccount:<namespace>:<name>`), bound to a pod
/// on a node.
pub fn node_of(status: &TokenReviewStatus, account: &str) -> Result<String, Refusal> {
    if status.authenticated != Some(true) {
        let why = status
            .error
            .clone()
            .unwrap_or_else(|| "not authenticated".into());
        return Err(Refusal::Invalid(why));
    }
    if !status.audiences.iter().flatten().any(|a| a == AUDIENCE) {
        return Err(Refusal::WrongAudience);
    }
    let user = status.user.as_ref().ok_or(Refusal::NotBoundToNode)?;
    let name = user.username.as_deref().unwrap_or_default();
    if name != account {
        return Err(Refusal::WrongServiceAccount(name.to_owned()));
    }
    let nodes = user
        .extra
        .as_ref()
        .and_then(|extra| extra.get(NODE_NAME_EXTRA));
    match nodes.map(Vec::as_slice) {
        Some([node]) if !node.is_empty() => Ok(node.clone()),
        _ => Err(Refusal::NotBoundToNode),
    }
}

/// Reviews agents' tokens with the API server, caching verdicts.
pub struct TokenReviews {
    api: Api<TokenReview>,
    account: String,
    verdicts: moka::future::Cache<[u8; 32], Result<String, Refusal>>,
    in_flight: Semaphore,
    reviews: Counter,
}

impl std::fmt::Debug for TokenReviews {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("TokenReviews")
            .field("account", &self.account)
            .finish_non_exhaustive()
    }
}

/// A TokenReview that could not be made.
#[derive(Debug, thiserror::Error)]
#[error("token review failed: {0}")]
pub struct ReviewFailed(#[from] kube::Error);

impl TokenReviews {
    /// Reviews with `client`, taking only tokens of the ServiceAccount
    /// `namespace`/`name`; `reviews` counts the calls to the API server.
    pub fn new(client: kube::Client, namespace: &str, name: &str, reviews: Counter) -> Self {
        TokenReviews {
            api: Api::all(client),
            account: format!("system:serviceaccount:{namespace}:{name}"),
            verdicts: moka::future::Cache::builder()
                .max_capacity(100_000)
                .time_to_live(REVIEW_TTL)
                .build(),
            in_flight: Semaphore::new(MAX_REVIEWS),
            reviews,
        }
    }

    /// The node `token` speaks for. `Err(Ok(refusal))` for a token that is
    /// refused, `Err(Err(_))` when the API server could not be asked.
    pub async fn node(&self, token: &str) -> Result<Result<String, Refusal>, Arc<ReviewFailed>> {
        let key: [u8; 32] = Sha256::digest(token.as_bytes()).into();
        if let Some(verdict) = self.verdicts.get(&key).await {
            return Ok(verdict);
        }
        let Ok(Ok(_permit)) = tokio::time::timeout(REVIEW_WAIT, self.in_flight.acquire()).await
        else {
            return Ok(Err(Refusal::Busy));
        };
        // Concurrent connections with the same token share one review.
        self.verdicts
            .try_get_with(key, async {
                self.reviews.inc();
                let review = TokenReview {
                    spec: TokenReviewSpec {
                        token: token.to_owned(),
                        audiences: Some(vec![AUDIENCE.to_owned()]),
                    },
                    ..Default::default()
                };
                let reviewed = self.api.create(&PostParams::default(), &review).await?;
                let status = reviewed.status.unwrap_or_default();
                Ok(node_of(&status, &self.account))
            })
            .await
    }
}

impl TokenReviews {
    /// Reviews `token` again every `every` while a session of `node` runs;
    /// returns why once it is refused (a deleted pod, an expired token).
    /// A review that cannot be made, or has to wait, is no verdict.
    pub async fn revoked(&self, token: &str, node: &str, every: Duration) -> Refusal {
        loop {
            tokio::time::sleep(every).await;
            match self.node(token).await {
                Ok(Ok(reviewed)) if reviewed == node => {}
                Ok(Ok(other)) => {
                    return Refusal::Invalid(format!("the token now names node {other}"));
                }
                Ok(Err(Refusal::Busy)) | Err(_) => {}
                Ok(Err(refusal)) => return refusal,
            }
        }
    }
}

/// A stream's proof of its node, kept to check again while its session
/// runs.
#[derive(Clone, Debug)]
pub struct Authenticated {
    /// The node the agent proved.
    pub node: String,
    /// How it proved it.
    pub proof: Proof,
}

/// How an agent proved its node.
#[derive(Clone, Debug)]
pub enum Proof {
    /// A pod's token, reviewed again while the session runs.
    Token {
        /// The token.
        token: String,
        /// Who reviews it.
        reviews: Arc<TokenReviews>,
    },
    /// A client certificate of the signer `edgefleet.io/agent`, for an
    /// EdgeNode that takes certificates: checked at every connect and again
    /// while the session runs, which ends when the certificate expires.
    Certificate {
        /// The certificate: its node, when it was issued and expires.
        certificate: crate::agent_certs::Presented,
        /// Where its EdgeNode is read again.
        edge_nodes: Box<kube::Api<edgefleet_shared::api::EdgeNode>>,
    },
}

#[cfg(test)]
mod tests {
    use super::*;
    use k8s_openapi::api::authentication::v1::UserInfo;
    use std::collections::BTreeMap;

    const ACCOUNT: &str = "system:serviceaccount:edgefleet-system:edgefleet-agent";

    fn reviewed(username: &str, audience: &str, node: Option<&str>) -> TokenReviewStatus {
        let mut extra = BTreeMap::new();
        if let Some(node) = node {
            extra.insert(NODE_NAME_EXTRA.to_owned(), vec![node.to_owned()]);
        }
        TokenReviewStatus {
            authenticated: Some(true),
            audiences: Some(vec![audience.to_owned()]),
            user: Some(UserInfo {
                username: Some(username.to_owned()),
                extra: Some(extra),
                ..Default::default()
            }),
            error: None,
        }
    }

    #[test]
    fn the_node_comes_from_the_pod_binding_of_the_agents_account() {
        let ok = reviewed(ACCOUNT, AUDIENCE, Some("edge-1"));
        assert_eq!(node_of(&ok, ACCOUNT), Ok("edge-1".to_owned()));
    }

    #[test]
    fn tokens_of_other_accounts_audiences_or_without_a_node_are_refused() {
        let other = "system:serviceaccount:default:default";
        assert_eq!(
            node_of(&reviewed(other, AUDIENCE, Some("edge-1")), ACCOUNT),
            Err(Refusal::WrongServiceAccount(other.to_owned()))
        );
        assert_eq!(
            node_of(
                &reviewed(ACCOUNT, "https://kubernetes.default.svc", Some("edge-1")),
                ACCOUNT
            ),
            Err(Refusal::WrongAudience)
        );
        assert_eq!(
            node_of(&reviewed(ACCOUNT, AUDIENCE, None), ACCOUNT),
            Err(Refusal::NotBoundToNode)
        );
        let refused = TokenReviewStatus {
            authenticated: Some(false),
            error: Some("token has been invalidated".into()),
            ..reviewed(ACCOUNT, AUDIENCE, Some("edge-1"))
        };
        assert_eq!(
            node_of(&refused, ACCOUNT),
            Err(Refusal::Invalid("token has been invalidated".into()))
        );
    }

    #[test]
    fn only_a_bearer_token_of_bounded_size_is_read() {
        assert_eq!(bearer(Some(b"Bearer abc.def")), Ok("abc.def"));
        assert_eq!(bearer(None), Err(Refusal::NoToken));
        assert_eq!(bearer(Some(b"Basic abc")), Err(Refusal::Malformed));
        assert_eq!(bearer(Some(b"Bearer  ")), Err(Refusal::Malformed));
        let huge = format!("Bearer {}", "a".repeat(MAX_TOKEN_BYTES + 1));
        assert_eq!(bearer(Some(huge.as_bytes())), Err(Refusal::Malformed));
        assert_eq!(bearer(Some(b"Bearer \xff")), Err(Refusal::Malformed));
    }
}
