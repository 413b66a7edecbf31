//! TLS on the sync link, with the controller in process over real TCP and
//! a real kube-apiserver: an agent that trusts the controller's CA syncs; a
//! plaintext client and a client that trusts another CA are refused at the
//! handshake and counted; a renewed certificate (the files rewritten, as
//! cert-manager and the kubelet do with a Secret) is served to the next
//! connection while open sessions stay.

use std::sync::Arc;
use std::time::Duration;

use edgefleet_agent::store::Store;
use edgefleet_agent::sync::{self, CloudTls, SyncSettings};
use edgefleet_cloud::run::{Controller, Settings};
use edgefleet_cloud::tls::TlsSettings;
use edgefleet_shared::api::{Device, DeviceSpec, Transport};
use edgefleet_shared::{ResourceKey, proto};
use edgefleet_tests::certs::{self, LabCa};
use edgefleet_tests::{control_plane, eventually, in_process_controller, test_namespace};
use kube::Api;
use kube::api::PostParams;
use rustls::pki_types::ServerName;
use rustls::pki_types::pem::PemObject;

struct Site {
    ns: String,
    controller: Controller,
    lab: LabCa,
    dir: tempfile::TempDir,
}

impl Site {
    async fn start(hint: &str) -> Site {
        let client = control_plane().client().await;
        let ns = test_namespace(&client, hint).await;
        let dir = tempfile::tempdir().unwrap();
        let lab = certs::lab(&dir.path().join("tls")).unwrap();
        let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
        let controller = Controller::start(
            client,
            Settings {
                tls: Some(TlsSettings {
                    dir: lab.dir().to_owned(),
                    reload_every: Duration::from_millis(200),
                }),
                ..in_process_controller(listener, &ns)
            },
        )
        .await
        .unwrap();
        Site {
            ns,
            controller,
            lab,
            dir,
        }
    }

    /// An agent for `node` that checks the controller against `ca`.
    fn agent(&self, node: &str, ca: &LabCa) -> (Store, tokio::task::JoinHandle<()>) {
        let store = Store::open(&self.dir.path().join(node)).unwrap().store;
        let settings = SyncSettings {
            tls: Some(CloudTls {
                ca_file: ca.ca_file(),
                server_name: None,
                client_certificate: None,
            }),
            ..edgefleet_tests::agent_sync_settings(
                format!("https://{}", self.controller.sync_addr),
                node,
            )
        };
        (store.clone(), tokio::spawn(sync::run(settings, store)))
    }

    fn connections(&self, outcome: &str) -> u64 {
        self.controller.sync_metrics.connections.get(outcome)
    }

    /// The certificate the controller presents to a new connection (DER).
    async fn presented(&self) -> Vec<u8> {
        let mut roots = rustls::RootCertStore::empty();
        for cert in rustls::pki_types::CertificateDer::pem_file_iter(self.lab.ca_file()).unwrap() {
            roots.add(cert.unwrap()).unwrap();
        }
        let config = rustls::ClientConfig::builder_with_provider(Arc::new(
            rustls::crypto::ring::default_provider(),
        ))
        .with_safe_default_protocol_versions()
        .unwrap()
        .with_root_certificates(roots)
        .with_no_client_auth();
        let connector = tokio_rustls::TlsConnector::from(Arc::new(config));
        let tcp = tokio::net::TcpStream::connect(self.controller.sync_addr)
            .await
            .unwrap();
        let name = ServerName::try_from("localhost").unwrap();
        let tls = connector.connect(name, tcp).await.unwrap();
        let (_, session) = tls.get_ref();
        session.peer_certificates().unwrap()[0].as_ref().to_vec()
    }
}

fn node(hint: &str) -> String {
    format!("{hint}-{}", std::process::id())
}

#[tokio::test]
async fn an_agent_that_trusts_the_ca_syncs_and_plaintext_or_other_ca_clients_are_refused() {
    let site = Site::start("tls-sync").await;
    let edge = node("edge-tls");
    let (store, _agent) = site.agent(&edge, &site.lab);
    let devices: Api<Device> = Api::namespaced(control_plane().client().await, &site.ns);
    let spec = DeviceSpec {
        node: edge.clone(),
        model: "thermostat".into(),
        transport: Transport::Coap,
        desired: Default::default(),
        firmware: None,
        retry: 0,
    };
    devices
        .create(&PostParams::default(), &Device::new("t1", spec))
        .await
        .unwrap();
    eventually("the Device reached the agent over TLS", || async {
        store
            .desired(&ResourceKey::device(&site.ns, "t1"))
            .unwrap()
            .map(|_| ())
    })
    .await;
    assert!(site.connections("tls") >= 1);

    // A plaintext gRPC client: no session, a failed handshake counted.
    let failed = site.connections("handshake_failed");
    let plaintext = async {
        let mut client = proto::sync_client::SyncClient::connect(format!(
            "http://{}",
            site.controller.sync_addr
        ))
        .await?;
        client
            .stream(tokio_stream::iter(Vec::<proto::AgentMessage>::new()))
            .await
            .map(|_| ())
            .map_err(anyhow::Error::from)
    };
    assert!(plaintext.await.is_err(), "a plaintext client was served");
    eventually("the plaintext handshake is counted", || async {
        (site.connections("handshake_failed") > failed).then_some(())
    })
    .await;

    // An agent trusting another CA refuses the controller: it never holds a
    // session, and the controller counts the failed handshake.
    let other_ca = certs::lab(&site.dir.path().join("other-ca")).unwrap();
    let failed = site.connections("handshake_failed");
    let stranger = node("edge-stranger");
    let (_, _stranger_agent) = site.agent(&stranger, &other_ca);
    eventually("the untrusting agent's handshake is counted", || async {
        (site.connections("handshake_failed") > failed).then_some(())
    })
    .await;
    let streams = site.controller.sync_metrics.streams.get();
    assert_eq!(streams, 1, "only the trusting agent has a session");
}

#[tokio::test]
async fn a_renewed_certificate_is_served_to_new_connections_and_open_sessions_stay() {
    let site = Site::start("tls-renew").await;
    let (_store, _agent) = site.agent(&node("edge-renew"), &site.lab);
    eventually("the agent has a session", || async {
        (site.controller.sync_metrics.streams.get() == 1).then_some(())
    })
    .await;
    let hellos = site.connections("tls");
    let before = site.presented().await;
    let renewed = site.lab.issue().unwrap();
    assert_ne!(before, renewed);
    eventually(
        "a new connection is shown the renewed certificate",
        || async { (site.presented().await == renewed).then_some(()) },
    )
    .await;
    assert_eq!(site.controller.sync_metrics.tls_reloads.get("loaded"), 1);
    assert_eq!(site.controller.sync_metrics.tls_reloads.get("failed"), 0);
    // The agent kept its session: it made no new connection (only the
    // test's own probes did).
    tokio::time::sleep(Duration::from_millis(500)).await;
    assert_eq!(site.controller.sync_metrics.streams.get(), 1);
    let probes = site.connections("tls") - hellos;
    assert!(probes >= 2, "{probes}");
    let hello_outcomes: u64 = ["listed", "empty", "remembered", "recovered", "inventory"]
        .iter()
        .map(|o| site.controller.sync_metrics.hellos.get(o))
        .sum();
    assert_eq!(hello_outcomes, 1, "the agent said Hello again");
}
