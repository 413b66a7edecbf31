//! The CoAP server for constrained devices, on UDP.
//!
//! Resources, per device:
//! - `POST d/<namespace>/<name>/report` with a CBOR [`DeviceReport`]:
//!   `2.04 Changed` once the report is durable in the store;
//! - `GET d/<namespace>/<name>/desired`: `2.05 Content` with the CBOR
//!   [`DesiredState`](edgefleet_shared::codec::DesiredState).
//!
//! Refusals carry the right code and a short text: `4.00` malformed,
//! `4.04` unknown device or resource, `4.05` wrong method, `4.13` too large
//! (with Size1 giving the limit). Each is counted by reason.
//!
//! A confirmable request retransmitted with the same message id is answered
//! from [`RecentExchanges`] and not processed twice.

pub mod observe;

use std::collections::{HashMap, VecDeque};
use std::net::SocketAddr;
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use coap_lite::{
    CoapOption, ContentFormat, MessageClass, MessageType, Packet, RequestType, ResponseType,
};
use edgefleet_shared::ResourceKey;
use edgefleet_shared::codec::{self, CodecError, DeviceReport};
use edgefleet_shared::telemetry::Outcomes;
use tokio::net::UdpSocket;

use crate::store::Store;

/// RFC 7252's EXCHANGE_LIFETIME: how long a message id may be retransmitted.
pub const EXCHANGE_LIFETIME: Duration = Duration::from_secs(247);

/// How many recent exchanges are remembered for de-duplication.
pub const RECENT_EXCHANGES: usize = 16_384;

/// What a request is for.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Route {
    /// A device's report.
    Report(ResourceKey),
    /// A device's desired state.
    Desired(ResourceKey),
}

/// Maps a Uri-Path to a resource.
pub fn route(path: &[String]) -> Option<Route> {
    match path {
        [d, namespace, name, resource] if d == "d" && !namespace.is_empty() && !name.is_empty() => {
            let key = ResourceKey::device(namespace, name);
            match resource.as_str() {
                "report" => Some(Route::Report(key)),
                "desired" => Some(Route::Desired(key)),
                _ => None,
            }
        }
        _ => None,
    }
}

/// Responses to recent exchanges, by peer and message id.
#[derive(Debug, Default)]
pub struct RecentExchanges {
    // `None` while the first copy of the request is still being handled.
    responses: HashMap<(SocketAddr, u16), Option<Vec<u8>>>,
    order: VecDeque<(Instant, (SocketAddr, u16))>,
}

/// What to do with an incoming message id.
#[derive(Debug, PartialEq, Eq)]
pub enum Exchange {
    /// First time: handle it.
    New,
    /// Seen and answered: send this again.
    Answered(Vec<u8>),
    /// Seen and still being handled: drop this copy.
    InProgress,
}

impl RecentExchanges {
    /// Looks up (and, if new, records) an exchange.
    pub fn begin(&mut self, peer: SocketAddr, message_id: u16, now: Instant) -> Exchange {
        self.expire(now);
        match self.responses.get(&(peer, message_id)) {
            Some(Some(response)) => Exchange::Answered(response.clone()),
            Some(None) => Exchange::InProgress,
            None => {
                self.responses.insert((peer, message_id), None);
                self.order.push_back((now, (peer, message_id)));
                Exchange::New
            }
        }
    }

    /// Records the response to an exchange.
    pub fn answer(&mut self, peer: SocketAddr, message_id: u16, response: Vec<u8>) {
        if let Some(slot) = self.responses.get_mut(&(peer, message_id)) {
            *slot = Some(response);
        }
    }

    fn expire(&mut self, now: Instant) {
        while let Some((at, key)) = self.order.front().copied() {
            let expired = now.duration_since(at) >= EXCHANGE_LIFETIME;
            if !expired && self.order.len() < RECENT_EXCHANGES {
                break;
            }
            self.order.pop_front();
            self.responses.remove(&key);
        }
    }

    /// Exchanges remembered.
    pub fn len(&self) -> usize {
        self.responses.len()
    }

    /// Whether none is remembered.
    pub fn is_empty(&self) -> bool {
        self.responses.is_empty()
    }
}

/// The CoAP server's counters.
#[derive(Debug, Default)]
pub struct CoapMetrics {
    /// Requests by outcome (`stored`, `content`, `duplicate`, or the refusal reason).
    pub requests: Outcomes,
}

/// Serves CoAP on `socket` until the process ends.
pub async fn serve(
    socket: UdpSocket,
    store: Store,
    metrics: Arc<CoapMetrics>,
) -> std::io::Result<()> {
    let socket = Arc::new(socket);
    let exchanges = Arc::new(Mutex::new(RecentExchanges::default()));
    // Big enough for any UDP datagram, so an oversized payload is measured
    // (and refused) rather than silently cut.
    let mut buf = vec![0u8; 65_536];
    loop {
        let (len, peer) = socket.recv_from(&mut buf).await?;
        let Ok(packet) = Packet::from_bytes(&buf[..len]) else {
            metrics.requests.inc("not_coap");
            continue;
        };
        if !matches!(packet.header.code, MessageClass::Request(_)) {
            // Acks and resets from devices need no answer.
            continue;
        }
        let confirmable = packet.header.get_type() == MessageType::Confirmable;
        let message_id = packet.header.message_id;
        if confirmable {
            let seen = exchanges
                .lock()
                .expect("exchanges")
                .begin(peer, message_id, Instant::now());
            match seen {
                Exchange::New => {}
                Exchange::Answered(response) => {
                    metrics.requests.inc("duplicate");
                    let _ = socket.send_to(&response, peer).await;
                    continue;
                }
                Exchange::InProgress => {
                    metrics.requests.inc("duplicate");
                    continue;
                }
            }
        }
        // Each request in its own task, so one device's durable write does
        // not hold up the next datagram and flushes can batch.
        let (socket, store, metrics, exchanges) = (
            Arc::clone(&socket),
            store.clone(),
            Arc::clone(&metrics),
            Arc::clone(&exchanges),
        );
        tokio::spawn(async move {
            let (outcome, response) = handle(&packet, &store).await;
            metrics.requests.inc(outcome);
            let Ok(bytes) = response.to_bytes() else {
                return;
            };
            if confirmable {
                exchanges
                    .lock()
                    .expect("exchanges")
                    .answer(peer, message_id, bytes.clone());
            }
            let _ = socket.send_to(&bytes, peer).await;
        });
    }
}

/// Handles one request; returns the outcome label and the response.
async fn handle(request: &Packet, store: &Store) -> (&'static str, Packet) {
    let path = request
        .get_option(CoapOption::UriPath)
        .map(|segments| {
            segments
                .iter()
                .map(|s| String::from_utf8_lossy(s).into_owned())
                .collect::<Vec<_>>()
        })
        .unwrap_or_default();
    let Some(route) = route(&path) else {
        return refuse(
            request,
            "unknown_resource",
            ResponseType::NotFound,
            "no such resource; use d/<namespace>/<name>/report or /desired".into(),
        );
    };
    let method = match request.header.code {
        MessageClass::Request(method) => method,
        _ => RequestType::UnKnown,
    };
    match (route, method) {
        (Route::Report(key), RequestType::Post) => report(request, store, &key).await,
        (Route::Desired(key), RequestType::Get) => desired(request, store, &key),
        _ => refuse(
            request,
            "method_not_allowed",
            ResponseType::MethodNotAllowed,
            "reports are POSTed, desired state is read with GET".into(),
        ),
    }
}

async fn report(request: &Packet, store: &Store, key: &ResourceKey) -> (&'static str, Packet) {
    let report = match codec::decode::<DeviceReport>(&request.payload) {
        Ok(report) => report,
        Err(error) => return refuse_codec(request, error),
    };
    if let Err(refusal) = known_device(request, store, key) {
        return refusal;
    }
    match store
        .record_report(key, report, edgefleet_shared::now_unix_ms())
        .await
    {
        Ok(_) => ("stored", reply(request, ResponseType::Changed)),
        Err(error) => {
            tracing::error!(device = %key, %error, "could not store a report");
            refuse(
                request,
                "store_error",
                ResponseType::InternalServerError,
                "report not stored".into(),
            )
        }
    }
}

fn desired(request: &Packet, store: &Store, key: &ResourceKey) -> (&'static str, Packet) {
    let device = match known_device(request, store, key) {
        Ok(device) => device,
        Err(refusal) => return refusal,
    };
    match codec::encode(&device.to_wire()) {
        Ok(payload) => {
            let mut response = reply(request, ResponseType::Content);
            response.set_content_format(ContentFormat::ApplicationCBOR);
            response.payload = payload;
            ("content", response)
        }
        Err(error) => refuse(
            request,
            "desired_too_large",
            ResponseType::InternalServerError,
            error.to_string(),
        ),
    }
}

/// The device's desired state, or the refusal for a device this node does
/// not serve.
fn known_device(
    request: &Packet,
    store: &Store,
    key: &ResourceKey,
) -> Result<crate::store::DesiredDevice, (&'static str, Packet)> {
    match store.desired(key) {
        Ok(Some(device)) => Ok(device),
        Ok(None) => Err(refuse(
            request,
            "unknown_device",
            ResponseType::NotFound,
            format!("{key} is not a device of this node"),
        )),
        Err(error) => Err(refuse(
            request,
            "store_error",
            ResponseType::InternalServerError,
            error.to_string(),
        )),
    }
}

fn refuse_codec(request: &Packet, error: CodecError) -> (&'static str, Packet) {
    let (code, outcome) = match &error {
        CodecError::TooLarge { .. } => (ResponseType::RequestEntityTooLarge, "too_large"),
        CodecError::Truncated { .. } => (ResponseType::BadRequest, "truncated"),
        CodecError::Malformed(_) => (ResponseType::BadRequest, "malformed"),
        CodecError::Invalid(_) => (ResponseType::BadRequest, "invalid"),
    };
    let (outcome, mut response) = refuse(request, outcome, code, error.to_string());
    if let CodecError::TooLarge { limit, .. } = error {
        response.add_option(CoapOption::Size1, (limit as u32).to_be_bytes().to_vec());
    }
    (outcome, response)
}

fn refuse(
    request: &Packet,
    outcome: &'static str,
    code: ResponseType,
    text: String,
) -> (&'static str, Packet) {
    let mut response = reply(request, code);
    response.set_content_format(ContentFormat::TextPlain);
    response.payload = text.into_bytes();
    (outcome, response)
}

/// A response to `request`: piggybacked on the Ack for a confirmable one.
fn reply(request: &Packet, code: ResponseType) -> Packet {
    let mut response = Packet::new();
    response.header.set_version(1);
    response.header.set_type(match request.header.get_type() {
        MessageType::Confirmable => MessageType::Acknowledgement,
        _ => MessageType::NonConfirmable,
    });
    response.header.message_id = request.header.message_id;
    response.header.code = MessageClass::Response(code);
    response.set_token(request.get_token().to_vec());
    response
}

#[cfg(test)]
mod tests {
    use super::*;

    fn path(p: &str) -> Vec<String> {
        p.split('/').map(str::to_owned).collect()
    }

    #[test]
    fn routes_name_the_device_and_the_resource() {
        assert_eq!(
            route(&path("d/plant/t1/report")),
            Some(Route::Report(ResourceKey::device("plant", "t1")))
        );
        assert_eq!(
            route(&path("d/plant/t1/desired")),
            Some(Route::Desired(ResourceKey::device("plant", "t1")))
        );
        for bad in [
            "d/plant/t1",
            "d/plant/t1/firmware",
            "x/plant/t1/report",
            "d//t1/report",
            "d/plant/t1/report/x",
        ] {
            assert_eq!(route(&path(bad)), None, "{bad}");
        }
    }

    #[test]
    fn a_retransmission_is_answered_from_the_cache() {
        let peer: SocketAddr = "127.0.0.1:5683".parse().unwrap();
        let other: SocketAddr = "127.0.0.1:5684".parse().unwrap();
        let now = Instant::now();
        let mut recent = RecentExchanges::default();
        assert_eq!(recent.begin(peer, 7, now), Exchange::New);
        assert_eq!(recent.begin(peer, 7, now), Exchange::InProgress);
        recent.answer(peer, 7, vec![1, 2, 3]);
        assert_eq!(
            recent.begin(peer, 7, now),
            Exchange::Answered(vec![1, 2, 3])
        );
        // The same id from another peer is another exchange.
        assert_eq!(recent.begin(other, 7, now), Exchange::New);
        // After the exchange lifetime the id may be reused.
        assert_eq!(
            recent.begin(peer, 7, now + EXCHANGE_LIFETIME),
            Exchange::New
        );
    }

    #[test]
    fn the_cache_is_bounded() {
        let peer: SocketAddr = "127.0.0.1:5683".parse().unwrap();
        let now = Instant::now();
        let mut recent = RecentExchanges::default();
        for id in 0..(RECENT_EXCHANGES + 100) {
            recent.begin(peer, id as u16, now);
        }
        assert!(recent.len() <= RECENT_EXCHANGES, "{}", recent.len());
    }
}
