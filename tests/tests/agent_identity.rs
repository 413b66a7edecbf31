//! Node identity from Kubernetes, with the controller in process over real
//! gRPC and a real kube-apiserver that issues and reviews the tokens: an
//! agent is served only with a token of the agents' ServiceAccount bound to
//! a pod on the node its Hello names. Every other caller is refused and
//! counted, and gets no EdgeNode. An expired token is refused; a deleted
//! pod's token stops working; the agent reads its token file again on every
//! connect.

use std::time::Duration;

use edgefleet_agent::store::Store;
use edgefleet_agent::sync::{self, SyncSettings};
use edgefleet_cloud::agent_identity::{AuthSettings, REVIEW_TTL};
use edgefleet_cloud::run::{Controller, Settings};
use edgefleet_shared::api::{Device, DeviceSpec, EdgeNode, Transport};
use edgefleet_shared::{ResourceKey, proto};
use edgefleet_tests::agent_tokens::{self, ACCOUNT, AUDIENCE, AgentPod, token};
use edgefleet_tests::{
    agent_sync_settings, control_plane, eventually, in_process_controller, test_namespace,
};
use k8s_openapi::api::authentication::v1::BoundObjectReference;
use kube::api::PostParams;
use kube::{Api, Client};

struct Site {
    client: Client,
    ns: String,
    controller: Controller,
}

impl Site {
    async fn start(hint: &str) -> Site {
        Self::start_with(hint, edgefleet_cloud::sync::TOKEN_RECHECK).await
    }

    /// With running sessions' tokens reviewed again every `token_recheck`.
    async fn start_with(hint: &str, token_recheck: Duration) -> Site {
        let client = control_plane().client().await;
        let ns = test_namespace(&client, hint).await;
        let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
        let controller = Controller::start(
            client.clone(),
            Settings {
                agent_auth: AuthSettings::ServiceAccount {
                    namespace: ns.clone(),
                    name: ACCOUNT.into(),
                },
                token_recheck,
                ..in_process_controller(listener, &ns)
            },
        )
        .await
        .unwrap();
        Site {
            client,
            ns,
            controller,
        }
    }

    /// Opens a stream with `token` and a Hello naming `node`; the first
    /// message the cloud sends, or the refusal.
    async fn open(
        &self,
        token: Option<&str>,
        node: &str,
    ) -> Result<proto::CloudMessage, tonic::Status> {
        self.session(token, node).await.map(|(first, _)| first)
    }

    /// [`Site::open`], keeping the stream open.
    async fn session(
        &self,
        token: Option<&str>,
        node: &str,
    ) -> Result<(proto::CloudMessage, tonic::Streaming<proto::CloudMessage>), tonic::Status> {
        let mut client = proto::sync_client::SyncClient::connect(format!(
            "http://{}",
            self.controller.sync_addr
        ))
        .await
        .unwrap();
        let hello = proto::Hello {
            node: node.to_owned(),
            agent_version: "raw".into(),
            boot_id: "b".into(),
            store_id: format!("store-{node}"),
            ..Default::default()
        };
        let first = proto::AgentMessage {
            kind: Some(proto::agent_message::Kind::Hello(hello)),
        };
        // The stream stays open while the caller reads.
        let (tx, rx) = tokio::sync::mpsc::channel(1);
        tx.send(first).await.unwrap();
        std::mem::forget(tx);
        let mut request = tonic::Request::new(tokio_stream::wrappers::ReceiverStream::new(rx));
        if let Some(token) = token {
            request
                .metadata_mut()
                .insert("authorization", format!("Bearer {token}").parse().unwrap());
        }
        let mut inbound = client.stream(request).await?.into_inner();
        let first = tokio::time::timeout(edgefleet_tests::PATIENCE, inbound.message())
            .await
            .expect("the cloud said nothing")?;
        Ok((first.expect("the stream ended at once"), inbound))
    }

    fn authentications(&self, outcome: &str) -> u64 {
        self.controller.sync_metrics.authentications.get(outcome)
    }

    async fn edge_node_exists(&self, node: &str) -> bool {
        let nodes: Api<EdgeNode> = Api::all(self.client.clone());
        nodes.get_opt(node).await.unwrap().is_some()
    }
}

fn node_name(hint: &str) -> String {
    format!("{hint}-{}", std::process::id())
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_agent_is_served_only_for_the_node_its_pods_token_names() {
    let site = Site::start("identity").await;
    let (node, other) = (node_name("edge-id-a"), node_name("edge-id-b"));
    let pod = AgentPod::on(&site.client, &site.ns, &node).await.unwrap();

    site.open(Some(&pod.token), &node)
        .await
        .expect("its own node is served");
    assert_eq!(site.authentications("token"), 1);

    // The same token naming another node: refused, and that node gets no
    // EdgeNode.
    let refused = site.open(Some(&pod.token), &other).await.unwrap_err();
    assert_eq!(refused.code(), tonic::Code::PermissionDenied, "{refused:?}");
    assert!(refused.message().contains(&node), "{refused:?}");
    assert_eq!(site.authentications("node_mismatch"), 1);
    assert!(site.edge_node_exists(&node).await);
    assert!(!site.edge_node_exists(&other).await);

    // Reconnects within the cache's life cost no more reviews.
    for _ in 0..5 {
        site.open(Some(&pod.token), &node).await.unwrap();
    }
    assert_eq!(site.controller.sync_metrics.token_reviews.get(), 1);
    assert_eq!(site.authentications("token"), 7);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn tokens_that_do_not_prove_a_node_are_refused_and_counted() {
    let site = Site::start("identity-refusals").await;
    let node = node_name("edge-id-r");
    let client = &site.client;
    // A pod on the node, but of another ServiceAccount (any pod can have a
    // token for any audience projected).
    let stranger = AgentPod::create(client, &site.ns, "stranger", &node, AUDIENCE)
        .await
        .unwrap();
    // A pod of the agents' account, its token for the API server's
    // audience.
    let wrong_audience = AgentPod::create(
        client,
        &site.ns,
        ACCOUNT,
        &node,
        "https://kubernetes.default.svc.cluster.local",
    )
    .await
    .unwrap();
    // A token of the agents' account, bound to no pod.
    let unbound = token(client, &site.ns, ACCOUNT, None, AUDIENCE)
        .await
        .unwrap();
    // A token bound to a Secret, not a pod: it names no node either.
    let secret = k8s_openapi::api::core::v1::Secret {
        metadata: kube::api::ObjectMeta {
            name: Some("agent-bound".into()),
            ..Default::default()
        },
        ..Default::default()
    };
    let secret = Api::namespaced(client.clone(), &site.ns)
        .create(&PostParams::default(), &secret)
        .await
        .unwrap();
    let secret_bound = token(
        client,
        &site.ns,
        ACCOUNT,
        Some(BoundObjectReference {
            kind: Some("Secret".into()),
            api_version: Some("v1".into()),
            name: secret.metadata.name.clone(),
            uid: secret.metadata.uid.clone(),
        }),
        AUDIENCE,
    )
    .await
    .unwrap();

    let cases: [(Option<&str>, tonic::Code, &str); 6] = [
        (None, tonic::Code::Unauthenticated, "no_token"),
        (
            Some("not-a-jwt"),
            tonic::Code::Unauthenticated,
            "invalid_token",
        ),
        (
            Some(&stranger.token),
            tonic::Code::Unauthenticated,
            "wrong_service_account",
        ),
        (
            Some(&wrong_audience.token),
            tonic::Code::Unauthenticated,
            "invalid_token",
        ),
        (
            Some(&unbound),
            tonic::Code::Unauthenticated,
            "not_bound_to_node",
        ),
        (
            Some(&secret_bound),
            tonic::Code::Unauthenticated,
            "not_bound_to_node",
        ),
    ];
    for (token, code, outcome) in cases {
        let before = site.authentications(outcome);
        let refused = site.open(token, &node).await.unwrap_err();
        assert_eq!(refused.code(), code, "{outcome}: {refused:?}");
        assert_eq!(site.authentications(outcome), before + 1, "{outcome}");
    }
    assert_eq!(site.authentications("token"), 0);
    assert!(!site.edge_node_exists(&node).await);
    // A header that is no bearer token never reaches the API server.
    let reviews = site.controller.sync_metrics.token_reviews.get();
    let mut client =
        proto::sync_client::SyncClient::connect(format!("http://{}", site.controller.sync_addr))
            .await
            .unwrap();
    let mut request = tonic::Request::new(tokio_stream::iter(Vec::<proto::AgentMessage>::new()));
    request
        .metadata_mut()
        .insert("authorization", "Basic YWdlbnQ6cGFzcw==".parse().unwrap());
    let refused = client.stream(request).await.unwrap_err();
    assert_eq!(refused.code(), tonic::Code::Unauthenticated);
    assert_eq!(site.authentications("malformed_token"), 1);
    assert_eq!(site.controller.sync_metrics.token_reviews.get(), reviews);
}

/// A token the API server issued, but expired, is refused and counted. The
/// same token signed again within its lifetime is served, so what refuses
/// the other is its expiry.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_expired_token_is_refused_and_counted() {
    let site = Site::start("identity-expired").await;
    let node = node_name("edge-id-expired");
    let pod = AgentPod::on(&site.client, &site.ns, &node).await.unwrap();
    let key = std::fs::read_to_string(control_plane().data_dir().join("pki/sa.key")).unwrap();
    let same = agent_tokens::resigned(&pod.token, &key, Duration::ZERO).unwrap();
    site.open(Some(&same), &node)
        .await
        .expect("the token signed again within its lifetime is served");
    // Its day-long lifetime ended a day ago.
    let expired =
        agent_tokens::resigned(&pod.token, &key, Duration::from_secs(2 * 24 * 3600)).unwrap();
    let before = site.authentications("invalid_token");
    let refused = site.open(Some(&expired), &node).await.unwrap_err();
    assert_eq!(refused.code(), tonic::Code::Unauthenticated, "{refused:?}");
    assert!(refused.message().contains("expired"), "{refused:?}");
    assert_eq!(site.authentications("invalid_token"), before + 1);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_deleted_pods_token_stops_working_and_the_next_pods_token_is_read_from_the_file() {
    let site = Site::start("identity-pod-gone").await;
    let node = node_name("edge-id-gone");
    let dir = tempfile::tempdir().unwrap();
    let token_file = dir.path().join("token");

    // The agent starts with a token that is not its node's: it is refused
    // and keeps trying.
    let first = AgentPod::on(&site.client, &site.ns, &node).await.unwrap();
    let elsewhere = AgentPod::on(&site.client, &site.ns, &node_name("edge-id-else"))
        .await
        .unwrap();
    elsewhere.write_token(&token_file).unwrap();
    let store = Store::open(&dir.path().join("store")).unwrap().store;
    let settings = SyncSettings {
        token_file: Some(token_file.clone()),
        ..agent_sync_settings(format!("http://{}", site.controller.sync_addr), &node)
    };
    let agent = tokio::spawn(sync::run(settings, store.clone()));
    eventually("the agent with another node's token is refused", || async {
        (site.authentications("node_mismatch") >= 1).then_some(())
    })
    .await;

    // Its own pod's token lands in the file (as the kubelet writes it): the
    // next connect is served, and a Device of the node reaches the store.
    first.write_token(&token_file).unwrap();
    let devices: Api<Device> = Api::namespaced(site.client.clone(), &site.ns);
    let device = Device::new(
        "t1",
        DeviceSpec {
            node: node.clone(),
            model: "thermostat".into(),
            transport: Transport::Coap,
            desired: Default::default(),
            firmware: None,
            retry: 0,
        },
    );
    devices
        .create(&PostParams::default(), &device)
        .await
        .unwrap();
    let key = ResourceKey::device(&site.ns, "t1");
    eventually("the agent holds its Device", || async {
        store.desired(&key).unwrap().map(|_| ())
    })
    .await;
    agent.abort();

    // The pod is deleted: its token is refused once the cached verdict
    // expired, whoever presents it.
    first.delete(&site.client).await.unwrap();
    let deleted_at = std::time::Instant::now();
    let refused = eventually("the deleted pod's token is refused", || async {
        site.open(Some(&first.token), &node).await.err()
    })
    .await;
    assert_eq!(refused.code(), tonic::Code::Unauthenticated, "{refused:?}");
    assert!(
        deleted_at.elapsed() < REVIEW_TTL + Duration::from_secs(10),
        "refused only after {:?}",
        deleted_at.elapsed()
    );
    assert!(site.authentications("invalid_token") >= 1);

    // The DaemonSet's next pod on the node has a token that works.
    let next = AgentPod::on(&site.client, &site.ns, &node).await.unwrap();
    site.open(Some(&next.token), &node)
        .await
        .expect("the new pod's token is served");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_running_session_ends_once_its_pods_token_no_longer_holds() {
    let recheck = Duration::from_secs(1);
    let site = Site::start_with("identity-revoked", recheck).await;
    let node = node_name("edge-id-revoked");
    let pod = AgentPod::on(&site.client, &site.ns, &node).await.unwrap();
    let (_, mut stream) = site.session(Some(&pod.token), &node).await.unwrap();

    // While the pod exists the session stays (heartbeats keep coming).
    tokio::time::sleep(3 * recheck).await;
    assert_eq!(site.authentications("revoked"), 0);

    pod.delete(&site.client).await.unwrap();
    let deleted_at = std::time::Instant::now();
    let ended = tokio::time::timeout(Duration::from_secs(60), async {
        loop {
            match stream.message().await {
                Ok(Some(_)) => continue,
                other => return other,
            }
        }
    })
    .await
    .expect("the session outlived its pod by a minute");
    println!(
        "the session ended {:?} after its pod was deleted: {ended:?}",
        deleted_at.elapsed()
    );
    assert!(
        deleted_at.elapsed() < REVIEW_TTL + recheck + Duration::from_secs(10),
        "ended only after {:?}",
        deleted_at.elapsed()
    );
    assert_eq!(site.authentications("revoked"), 1);
}
