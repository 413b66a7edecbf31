//! What unauthenticated clients can make the controller hold, with the
//! controller as a process serving TLS, a real kube-apiserver and 10,000
//! real connections over loopback: connections beyond the bound per
//! address and in all are closed at once and counted; the rest are closed
//! once they went the authentication deadline without an authenticated
//! stream; memory stays within a small amount per connection; and an agent
//! with its pod's token is served afterwards.
//!
//! The connections come from 157 loopback addresses (127.0.1.x), 64 each,
//! as from many hosts; those that failed in the rush are retried one at a
//! time from 127.0.2.x until the bound in all is reached.

use std::net::{IpAddr, SocketAddr};
use std::sync::Arc;
use std::time::{Duration, Instant};

use edgefleet_tests::agent_tokens::{self, AgentPod};
use edgefleet_tests::certs;
use edgefleet_tests::process::{Process, free_tcp_addr, http_get, metric};
use edgefleet_tests::{agent_sync_settings, control_plane, eventually_within, test_namespace};
use rustls::pki_types::ServerName;
use rustls::pki_types::pem::PemObject;
use tokio::net::TcpSocket;

const CONNECTIONS: usize = 10_000;
const PER_ADDRESS: usize = 64;
const ADDRESSES: usize = 157;

async fn sync_metric(metrics: SocketAddr, name: &str, outcome: &str) -> f64 {
    let (_, body) = http_get(metrics, "/metrics").await.unwrap_or_default();
    metric(
        &body,
        &format!("edgefleet_cloud_sync_{name}_total{{outcome=\"{outcome}\"}}"),
    )
}

/// A TLS connection from `from`, handshaken and then idle; `None` when the
/// controller closed it.
async fn idle_tls(
    from: IpAddr,
    to: SocketAddr,
    connector: tokio_rustls::TlsConnector,
) -> Option<tokio_rustls::client::TlsStream<tokio::net::TcpStream>> {
    let socket = TcpSocket::new_v4().ok()?;
    socket.bind(SocketAddr::new(from, 0)).ok()?;
    let tcp = socket.connect(to).await.ok()?;
    let name = ServerName::try_from("127.0.0.1").unwrap();
    tokio::time::timeout(Duration::from_secs(30), connector.connect(name, tcp))
        .await
        .ok()?
        .ok()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn ten_thousand_unauthenticated_connections_are_bounded_then_closed_and_agents_still_get_in()
{
    let cp = control_plane();
    let client = cp.client().await;
    let ns = test_namespace(&client, "limits").await;
    let dir = tempfile::tempdir().unwrap();
    let lab = certs::lab(&dir.path().join("tls")).unwrap();
    let (sync, metrics) = (free_tcp_addr(), free_tcp_addr());
    let mut args = vec![
        "run".into(),
        format!("--sync-addr={sync}"),
        format!("--metrics-addr={metrics}"),
        format!("--namespace={ns}"),
        format!("--max-connections={CONNECTIONS}"),
        format!("--max-per-address={PER_ADDRESS}"),
    ];
    args.extend(certs::cloud_args(&lab));
    args.extend(agent_tokens::cloud_args(&ns));
    let log = dir.path().join("cloud.log");
    let mut cloud = Process::start_logged(
        "edgefleet-cloud",
        &args,
        &[("KUBECONFIG", cp.kubeconfig().display().to_string())],
        Some(&log),
    )
    .unwrap();
    eventually_within(
        Duration::from_secs(60),
        "the controller is ready",
        || async { matches!(http_get(metrics, "/readyz").await, Ok((200, _))).then_some(()) },
    )
    .await;
    let rss_before = cloud.rss_bytes().unwrap();

    let roots = {
        let mut roots = rustls::RootCertStore::empty();
        for cert in rustls::pki_types::CertificateDer::pem_file_iter(lab.ca_file()).unwrap() {
            roots.add(cert.unwrap()).unwrap();
        }
        roots
    };
    let mut config = rustls::ClientConfig::builder_with_provider(Arc::new(
        rustls::crypto::ring::default_provider(),
    ))
    .with_safe_default_protocol_versions()
    .unwrap()
    .with_root_certificates(roots)
    .with_no_client_auth();
    config.alpn_protocols = vec![b"h2".to_vec()];
    let connector = tokio_rustls::TlsConnector::from(Arc::new(config));

    // One address: 64 connections, and the 65th is closed at once.
    let first: IpAddr = "127.0.1.1".parse().unwrap();
    let mut held = Vec::new();
    for _ in 0..PER_ADDRESS {
        let connection = idle_tls(first, sync, connector.clone()).await;
        held.push(connection.expect("a connection within the bound"));
    }
    let extra = idle_tls(first, sync, connector.clone()).await;
    assert!(
        extra.is_none(),
        "a 65th connection from one address was let in"
    );

    // 156 more addresses × 64: 10,048 in all, 48 over the bound in all.
    let started = Instant::now();
    let mut tasks = tokio::task::JoinSet::new();
    let limit = Arc::new(tokio::sync::Semaphore::new(128));
    for i in PER_ADDRESS..ADDRESSES * PER_ADDRESS {
        let from: IpAddr = format!("127.0.1.{}", 1 + i / PER_ADDRESS).parse().unwrap();
        let (connector, limit) = (connector.clone(), Arc::clone(&limit));
        tasks.spawn(async move {
            let _permit = limit.acquire_owned().await.unwrap();
            idle_tls(from, sync, connector).await
        });
    }
    while let Some(done) = tasks.join_next().await {
        held.extend(done.unwrap());
    }
    // In the rush some attempts fail without meeting the bound in all (a
    // handshake beyond the 256 at once, a full accept queue): fill up to
    // the bound one at a time, from further addresses, as agents retry.
    let mut next = 0;
    while held.len() < CONNECTIONS && next < 10 * PER_ADDRESS {
        let from: IpAddr = format!("127.0.2.{}", 1 + next / PER_ADDRESS)
            .parse()
            .unwrap();
        held.extend(idle_tls(from, sync, connector.clone()).await);
        next += 1;
    }
    let opened_in = started.elapsed();
    cloud.assert_running();
    assert_eq!(held.len(), CONNECTIONS);
    // The server counts a handshake once the client's Finished is in, a
    // moment after the client is done.
    eventually_within(
        Duration::from_secs(30),
        "the controller counted every handshake",
        || async {
            (sync_metric(metrics, "connections", "tls").await as usize >= CONNECTIONS).then_some(())
        },
    )
    .await;
    // At the bound, one more is closed at once and counted.
    let over_before = sync_metric(metrics, "connections", "too_many_connections").await;
    let beyond = idle_tls("127.0.3.1".parse().unwrap(), sync, connector.clone()).await;
    assert!(
        beyond.is_none(),
        "a connection beyond the bound in all was let in"
    );
    eventually_within(
        Duration::from_secs(10),
        "the refusal is counted",
        || async {
            (sync_metric(metrics, "connections", "too_many_connections").await == over_before + 1.0)
                .then_some(())
        },
    )
    .await;
    let rss_held = cloud.rss_bytes().unwrap();
    let tls = sync_metric(metrics, "connections", "tls").await;
    let over_total = sync_metric(metrics, "connections", "too_many_connections").await;
    let over_address = sync_metric(metrics, "connections", "too_many_from_address").await;
    let per_connection = (rss_held.saturating_sub(rss_before)) as f64 / tls.max(1.0);
    println!(
        "{} TLS connections held (opened in {opened_in:.1?}); refused: {over_total} over the bound in all, {over_address} over the bound per address; controller RSS {:.1} MiB → {:.1} MiB: {:.1} KiB per held connection",
        held.len(),
        rss_before as f64 / 1048576.0,
        rss_held as f64 / 1048576.0,
        per_connection / 1024.0
    );
    assert_eq!(tls as usize, CONNECTIONS);
    assert!(over_total >= 1.0);
    assert_eq!(over_address, 1.0);
    // What an unauthenticated connection costs: its socket, TLS state and
    // HTTP/2 connection, nothing it can grow.
    assert!(
        per_connection < 64.0 * 1024.0,
        "{:.1} KiB per unauthenticated connection",
        per_connection / 1024.0
    );

    // None of them authenticates: every one is closed at the deadline.
    eventually_within(
        Duration::from_secs(60),
        "every unauthenticated connection is closed",
        || async {
            (sync_metric(metrics, "connections", "unauthenticated_timeout").await as usize
                >= CONNECTIONS)
                .then_some(())
        },
    )
    .await;
    drop(held);

    // An agent with its pod's token is served.
    let node = format!("edge-limits-{}", std::process::id());
    let pod = AgentPod::on(&client, &ns, &node).await.unwrap();
    let token_file = dir.path().join("token");
    pod.write_token(&token_file).unwrap();
    let store = edgefleet_agent::store::Store::open(&dir.path().join("store"))
        .unwrap()
        .store;
    let settings = edgefleet_agent::sync::SyncSettings {
        tls: Some(edgefleet_agent::sync::CloudTls {
            ca_file: lab.ca_file(),
            server_name: None,
            client_certificate: None,
        }),
        token_file: Some(token_file),
        ..agent_sync_settings(format!("https://{sync}"), &node)
    };
    let agent = tokio::spawn(edgefleet_agent::sync::run(settings, store));
    eventually_within(Duration::from_secs(60), "the agent is served", || async {
        (sync_metric(metrics, "authentications", "token").await >= 1.0).then_some(())
    })
    .await;
    agent.abort();
    cloud.assert_running();
}
