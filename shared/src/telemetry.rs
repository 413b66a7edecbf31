//! What every Edgefleet process serves for operators: `/metrics`
//! (Prometheus text format), `/healthz` (the process works; see
//! [`crate::health`]) and `/readyz` (it does its job), and the log setup.

use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};

use axum::Router;
use axum::extract::State;
use axum::http::{StatusCode, header};
use axum::response::IntoResponse;
use axum::routing::get;
use prometheus_client::metrics::counter::Counter;
use prometheus_client::metrics::family::Family;
use prometheus_client::registry::Registry;
use tokio::net::TcpListener;

use crate::health::{Health, Probe};

/// A counter per outcome, labelled `outcome` (`stored`, `malformed`, …):
/// how Edgefleet counts what it did with each input, refusals included.
#[derive(Clone, Debug, Default)]
pub struct Outcomes(Family<Vec<(String, String)>, Counter>);

impl Outcomes {
    /// Counts one input that ended with `outcome`.
    pub fn inc(&self, outcome: &str) {
        self.counter(outcome).inc();
    }

    /// How many inputs ended with `outcome`.
    pub fn get(&self, outcome: &str) -> u64 {
        self.counter(outcome).get()
    }

    fn counter(&self, outcome: &str) -> Counter {
        self.0
            .get_or_create(&vec![("outcome".to_owned(), outcome.to_owned())])
            .clone()
    }

    /// Registers the counters as `name` in `registry`.
    pub fn register(&self, registry: &mut Registry, name: &str, help: &str) {
        registry.register(name, help, self.0.clone());
    }
}

/// Whether the process is ready; flipped by the process once it is.
#[derive(Clone, Debug, Default)]
pub struct Readiness(Arc<AtomicBool>);

impl Readiness {
    /// Marks the process ready (or not).
    pub fn set(&self, ready: bool) {
        self.0.store(ready, Ordering::Relaxed);
    }

    /// Whether it is ready.
    pub fn get(&self) -> bool {
        self.0.load(Ordering::Relaxed)
    }
}

#[derive(Clone)]
struct Shared {
    registry: Arc<Registry>,
    readiness: Readiness,
    health: Health,
}

/// Serves the operator endpoints on `listener` until the process ends:
/// `/healthz` answers from the live parts of `health`, `/readyz` from
/// `readiness` and every part of `health`.
pub async fn serve(
    listener: TcpListener,
    registry: Registry,
    readiness: Readiness,
    health: Health,
) -> std::io::Result<()> {
    let shared = Shared {
        registry: Arc::new(registry),
        readiness,
        health,
    };
    let app = Router::new()
        .route("/metrics", get(metrics))
        .route("/healthz", get(healthz))
        .route("/readyz", get(readyz))
        .with_state(shared);
    axum::serve(listener, app).await
}

async fn metrics(State(shared): State<Shared>) -> impl IntoResponse {
    let mut body = String::new();
    match prometheus_client::encoding::text::encode(&mut body, &shared.registry) {
        Ok(()) => (
            StatusCode::OK,
            [(
                header::CONTENT_TYPE,
                "application/openmetrics-text; version=1.0.0; charset=utf-8",
            )],
            body,
        ),
        Err(_) => (
            StatusCode::INTERNAL_SERVER_ERROR,
            [(header::CONTENT_TYPE, "text/plain")],
            "metrics encoding failed\n".to_owned(),
        ),
    }
}

async fn healthz(State(shared): State<Shared>) -> (StatusCode, String) {
    answer(shared.health.status(Probe::Live), "ok")
}

async fn readyz(State(shared): State<Shared>) -> (StatusCode, String) {
    if !shared.readiness.get() {
        return (StatusCode::SERVICE_UNAVAILABLE, "not ready\n".to_owned());
    }
    answer(shared.health.status(Probe::Ready), "ready")
}

/// 200 and `fine`, or 503 and one line per failing part.
fn answer(status: Result<(), Vec<String>>, fine: &str) -> (StatusCode, String) {
    match status {
        Ok(()) => (StatusCode::OK, format!("{fine}\n")),
        Err(failing) => (
            StatusCode::SERVICE_UNAVAILABLE,
            failing.iter().map(|f| format!("{f}\n")).collect(),
        ),
    }
}

/// Structured logs to stderr, filtered by `RUST_LOG` (default: `info`, with
/// the embedded broker's per-connection chatter at `warn`). Colours only on
/// a terminal: a container's log file or a journal gets plain text.
pub fn init_logging() {
    let filter = tracing_subscriber::EnvFilter::try_from_default_env()
        .unwrap_or_else(|_| tracing_subscriber::EnvFilter::new("info,rumqttd=warn"));
    tracing_subscriber::fmt()
        .with_env_filter(filter)
        .with_ansi(std::io::IsTerminal::is_terminal(&std::io::stderr()))
        .with_writer(std::io::stderr)
        .init();
}
