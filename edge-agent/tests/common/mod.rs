//! The agent's CoAP server on a loopback port over a fresh store on a real
//! disk: the harness of the CoAP tests.
#![allow(dead_code)] // each test crate uses its own part of it

use std::collections::BTreeMap;
use std::net::SocketAddr;
use std::sync::Arc;

use edgefleet_agent::coap::{self, CoapMetrics, CoapSettings, Security};
use edgefleet_agent::store::{DesiredDevice, Store};
use edgefleet_shared::api::Transport;
use edgefleet_shared::{PropertyValue, ResourceKey, ResourceVersion};
use tokio::net::UdpSocket;

/// A CoAP thermostat's desired state at `generation`.
pub fn thermostat(generation: i64, setpoint: f64) -> DesiredDevice {
    DesiredDevice::new(
        ResourceVersion::new("uid", generation),
        "thermostat",
        Transport::Coap,
        BTreeMap::from([("setpoint".to_owned(), PropertyValue::Float(setpoint))]),
    )
}

/// The device `name` of the namespace `plant`.
pub fn key(name: &str) -> ResourceKey {
    ResourceKey::device("plant", name)
}

/// The default settings, but plain CoAP: the protocol tests speak it
/// without DTLS.
pub fn plain() -> CoapSettings {
    CoapSettings {
        security: Security::InsecurePlain,
        ..CoapSettings::default()
    }
}

/// The server, its store and its counters.
pub struct Agent {
    pub addr: SocketAddr,
    pub store: Store,
    pub metrics: Arc<CoapMetrics>,
    server: tokio::task::JoinHandle<std::io::Result<()>>,
    _dir: tempfile::TempDir,
}

impl Agent {
    /// The server with `settings`, its store holding a thermostat at
    /// generation 1 for each of `devices`.
    pub async fn start(settings: CoapSettings, devices: &[&str]) -> Agent {
        let dir = tempfile::tempdir().unwrap();
        let opened = Store::open(&dir.path().join("store")).unwrap();
        assert!(opened.moved_aside.is_none());
        let store = opened.store;
        let upserts: Vec<_> = devices
            .iter()
            .map(|name| (key(name), thermostat(1, 20.0)))
            .collect();
        store.apply(&upserts, &[]).await.unwrap();
        let socket = UdpSocket::bind("127.0.0.1:0").await.unwrap();
        let addr = socket.local_addr().unwrap();
        let metrics = Arc::new(CoapMetrics::default());
        let server = tokio::spawn(coap::serve_with(
            socket,
            store.clone(),
            Arc::clone(&metrics),
            settings,
        ));
        Agent {
            addr,
            store,
            metrics,
            server,
            _dir: dir,
        }
    }
}

impl Drop for Agent {
    fn drop(&mut self) {
        self.server.abort();
    }
}
