//! A CoAP client: one UDP socket to an agent, plain or with one device's
//! DTLS session ([`crate::dtls`]).
//!
//! Every request is confirmable. One receive task reads every datagram from
//! the agent and hands each answer to the request waiting for it, found by
//! message id (and checked against the token); a request not answered in
//! time is sent again on the [`crate::retransmit`] schedule.
//!
//! Only piggybacked responses (the answer inside the ACK, as the Edgefleet
//! agent sends them) are understood; an empty ACK announcing a separate
//! response is ignored, so such a request ends up retransmitted and failed.

use std::collections::HashMap;
use std::io;
use std::net::{Ipv4Addr, Ipv6Addr, SocketAddr};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use coap_lite::{CoapOption, ContentFormat, MessageClass, MessageType, Packet, RequestType};
use edgefleet_shared::ResourceKey;
use edgefleet_shared::credential;
use tokio::net::UdpSocket;
use tokio::sync::oneshot;
use tokio::task::AbortHandle;

use crate::dtls::DtlsLink;
use crate::retransmit::{OnTimeout, Retransmission};

/// The token of every request: 4 bytes, unique per client until it wraps.
pub type Token = [u8; 4];

/// A request to send, before it gets a message id and token.
#[derive(Clone, Debug, PartialEq)]
pub struct Request {
    /// The method.
    pub method: RequestType,
    /// Uri-Path segments.
    pub path: Vec<String>,
    /// CBOR payload (may be empty).
    pub payload: Vec<u8>,
}

impl Request {
    /// `POST d/<namespace>/<name>/report` carrying a CBOR report.
    pub fn report(namespace: &str, name: &str, payload: Vec<u8>) -> Self {
        Request {
            method: RequestType::Post,
            path: ["d", namespace, name, "report"].map(str::to_owned).to_vec(),
            payload,
        }
    }

    /// `POST d/<namespace>/<name>/events` carrying a CBOR event.
    pub fn event(namespace: &str, name: &str, payload: Vec<u8>) -> Self {
        Request {
            method: RequestType::Post,
            path: ["d", namespace, name, "events"].map(str::to_owned).to_vec(),
            payload,
        }
    }

    /// The confirmable message for this request.
    pub fn to_packet(&self, message_id: u16, token: Token) -> Packet {
        let mut packet = Packet::new();
        packet.header.set_type(MessageType::Confirmable);
        packet.header.code = MessageClass::Request(self.method);
        packet.header.message_id = message_id;
        packet.set_token(token.to_vec());
        for segment in &self.path {
            packet.add_option(CoapOption::UriPath, segment.as_bytes().to_vec());
        }
        if !self.payload.is_empty() {
            packet.set_content_format(ContentFormat::ApplicationCBOR);
            packet.payload = self.payload.clone();
        }
        packet
    }
}

/// The agent's answer to a request.
#[derive(Clone, Debug, PartialEq)]
pub struct Response {
    /// The response code (`2.04`, `4.04`, …).
    pub code: MessageClass,
    /// The payload (a CBOR document or a diagnostic text).
    pub payload: Vec<u8>,
    /// The Max-Age option, in seconds, if the answer had one.
    pub max_age: Option<u32>,
}

/// Max-Age when the option is absent (RFC 7252, 5.10.5).
const DEFAULT_MAX_AGE: u32 = 60;

impl Response {
    /// Whether the code is a success (2.xx).
    pub fn is_success(&self) -> bool {
        u8::from(self.code) >> 5 == 2
    }

    /// For `5.03 Service Unavailable`, how long to wait before asking
    /// again: its Max-Age (RFC 7252, 5.9.3.4); `None` for any other answer.
    pub fn retry_after(&self) -> Option<Duration> {
        (self.code == MessageClass::Response(coap_lite::ResponseType::ServiceUnavailable))
            .then(|| Duration::from_secs(self.max_age.unwrap_or(DEFAULT_MAX_AGE).into()))
    }
}

/// Why an exchange ended without a response.
#[derive(Debug, thiserror::Error, PartialEq, Eq)]
pub enum ExchangeError {
    /// No answer after every retransmission.
    #[error("no answer after {0} retransmissions")]
    Timeout(u32),
    /// The agent answered with a Reset.
    #[error("the agent reset the exchange")]
    Reset,
    /// All 65,536 message ids are waiting for answers.
    #[error("every message id is in use")]
    Busy,
    /// The request could not be encoded.
    #[error("cannot encode the request: {0}")]
    Encode(String),
    /// The client shut down.
    #[error("the client shut down")]
    Closed,
}

/// How an exchange went.
#[derive(Debug, PartialEq)]
pub struct Exchange {
    /// How many times the request was sent again.
    pub retransmissions: u32,
    /// The response, or why there is none.
    pub result: Result<Response, ExchangeError>,
}

/// What the receive task hands a waiting request.
#[derive(Debug, PartialEq)]
enum Answer {
    Response(Response),
    Reset,
}

#[derive(Debug)]
struct Waiter {
    token: Token,
    tx: oneshot::Sender<Answer>,
}

/// The requests waiting for an answer, by message id.
#[derive(Debug)]
struct Pending {
    next_id: u16,
    next_token: u32,
    waiting: HashMap<u16, Waiter>,
}

impl Pending {
    fn new(first_id: u16, first_token: u32) -> Self {
        Pending {
            next_id: first_id,
            next_token: first_token,
            waiting: HashMap::new(),
        }
    }

    /// Registers a request: the next free message id, and a fresh token.
    fn begin(&mut self, tx: oneshot::Sender<Answer>) -> Option<(u16, Token)> {
        if self.waiting.len() > usize::from(u16::MAX) {
            return None;
        }
        while self.waiting.contains_key(&self.next_id) {
            self.next_id = self.next_id.wrapping_add(1);
        }
        let id = self.next_id;
        let token = self.next_token.to_be_bytes();
        self.next_id = self.next_id.wrapping_add(1);
        self.next_token = self.next_token.wrapping_add(1);
        self.waiting.insert(id, Waiter { token, tx });
        Some((id, token))
    }

    /// The waiter for an answer to `id`; `token` is `None` for a Reset, which
    /// carries none. An answer whose token does not match is stale (an
    /// earlier use of the id) and leaves the waiter in place.
    fn answer(&mut self, id: u16, token: Option<&[u8]>) -> Option<oneshot::Sender<Answer>> {
        let waiter = self.waiting.get(&id)?;
        if token.is_some_and(|t| t != waiter.token) {
            return None;
        }
        self.waiting.remove(&id).map(|w| w.tx)
    }

    /// Stops waiting for `id` if it still belongs to `token`.
    fn abandon(&mut self, id: u16, token: Token) {
        if self.waiting.get(&id).is_some_and(|w| w.token == token) {
            self.waiting.remove(&id);
        }
    }
}

/// Removes a request from [`Pending`] however its future ends, so an
/// exchange cancelled at shutdown does not hold its message id.
struct PendingGuard<'a> {
    pending: &'a Mutex<Pending>,
    id: u16,
    token: Token,
}

impl Drop for PendingGuard<'_> {
    fn drop(&mut self) {
        if let Ok(mut pending) = self.pending.lock() {
            pending.abandon(self.id, self.token);
        }
    }
}

/// How a client's messages travel.
#[derive(Debug)]
pub enum Link {
    /// Plain CoAP on a connected UDP socket (for agents started with
    /// `--insecure-coap-plain`).
    Plain(UdpSocket),
    /// CoAP over DTLS with the device's key.
    Dtls(DtlsLink),
}

impl Link {
    /// Sends one CoAP message.
    pub async fn send(&self, message: &[u8]) -> io::Result<()> {
        match self {
            Link::Plain(socket) => socket.send(message).await.map(drop),
            Link::Dtls(link) => link.send(message).await,
        }
    }

    /// The next CoAP message from the agent.
    pub async fn recv(&self, buf: &mut [u8]) -> io::Result<Vec<u8>> {
        match self {
            Link::Plain(socket) => socket.recv(buf).await.map(|len| buf[..len].to_vec()),
            Link::Dtls(link) => link.recv().await,
        }
    }
}

/// A UDP socket on an ephemeral port, connected to `agent`.
pub async fn connected_socket(agent: SocketAddr) -> io::Result<UdpSocket> {
    let local: SocketAddr = match agent {
        SocketAddr::V4(_) => (Ipv4Addr::UNSPECIFIED, 0).into(),
        SocketAddr::V6(_) => (Ipv6Addr::UNSPECIFIED, 0).into(),
    };
    let socket = UdpSocket::bind(local).await?;
    socket.connect(agent).await?;
    Ok(socket)
}

/// A CoAP client for one agent: its link (a connected UDP socket, plain or
/// with a device's DTLS session) and its receive task.
#[derive(Debug)]
pub struct CoapClient {
    link: Arc<Link>,
    pending: Arc<Mutex<Pending>>,
    receiver: AbortHandle,
}

impl CoapClient {
    /// Binds an ephemeral port, connects it to `agent` and starts the receive
    /// task, for plain CoAP. Message ids count up from `first_id`, tokens
    /// from `first_token`.
    pub async fn connect(agent: SocketAddr, first_id: u16, first_token: u32) -> io::Result<Self> {
        let socket = connected_socket(agent).await?;
        Ok(Self::over(Link::Plain(socket), first_id, first_token))
    }

    /// As [`CoapClient::connect`], over DTLS as `device` with `key`.
    pub async fn connect_dtls(
        agent: SocketAddr,
        device: &ResourceKey,
        key: &[u8],
        first_id: u16,
        first_token: u32,
    ) -> io::Result<Self> {
        let socket = connected_socket(agent).await?;
        Ok(Self::dtls(socket, device, key, first_id, first_token))
    }

    /// As [`CoapClient::connect_dtls`], on `socket` (connected to the
    /// agent).
    pub fn dtls(
        socket: UdpSocket,
        device: &ResourceKey,
        key: &[u8],
        first_id: u16,
        first_token: u32,
    ) -> Self {
        let link = DtlsLink::start(socket, &credential::login_name(device), key);
        Self::over(Link::Dtls(link), first_id, first_token)
    }

    fn over(link: Link, first_id: u16, first_token: u32) -> Self {
        let link = Arc::new(link);
        let pending = Arc::new(Mutex::new(Pending::new(first_id, first_token)));
        let receiver = tokio::spawn(receive(Arc::clone(&link), Arc::clone(&pending)));
        CoapClient {
            link,
            pending,
            receiver: receiver.abort_handle(),
        }
    }

    /// Sends `request` as a confirmable message, retransmitting it on the
    /// schedule of `retransmission`, and waits for the answer.
    pub async fn request(&self, request: &Request, mut retransmission: Retransmission) -> Exchange {
        let done = |retransmission: &Retransmission, result| Exchange {
            retransmissions: retransmission.retransmissions(),
            result,
        };
        let (tx, mut rx) = oneshot::channel();
        let Some((id, token)) = self.pending.lock().expect("pending exchanges").begin(tx) else {
            return done(&retransmission, Err(ExchangeError::Busy));
        };
        let _guard = PendingGuard {
            pending: &self.pending,
            id,
            token,
        };
        let bytes = match request.to_packet(id, token).to_bytes() {
            Ok(bytes) => bytes,
            Err(e) => return done(&retransmission, Err(ExchangeError::Encode(e.to_string()))),
        };
        let mut wait = retransmission.timeout();
        loop {
            let sent = Instant::now();
            if let Err(e) = self.link.send(&bytes).await {
                // Typically an ICMP error from an earlier datagram (the agent
                // is not listening yet); the retransmission schedule covers it.
                tracing::debug!(error = %e, message_id = id, "CoAP send failed");
            }
            match tokio::time::timeout(wait, &mut rx).await {
                Ok(Ok(Answer::Response(response))) => return done(&retransmission, Ok(response)),
                Ok(Ok(Answer::Reset)) => return done(&retransmission, Err(ExchangeError::Reset)),
                Ok(Err(_)) => return done(&retransmission, Err(ExchangeError::Closed)),
                Err(_) => match retransmission.on_timeout() {
                    OnTimeout::Retransmit(next) => {
                        // Nothing heard since this transmission: the agent
                        // may have lost the session (it restarted).
                        if let Link::Dtls(link) = self.link.as_ref() {
                            link.renew(sent).await;
                        }
                        wait = next;
                    }
                    OnTimeout::GiveUp => {
                        let err = ExchangeError::Timeout(retransmission.retransmissions());
                        return done(&retransmission, Err(err));
                    }
                },
            }
        }
    }
}

impl Drop for CoapClient {
    fn drop(&mut self) {
        self.receiver.abort();
    }
}

/// Reads every datagram from the agent and hands answers to their requests.
async fn receive(link: Arc<Link>, pending: Arc<Mutex<Pending>>) {
    // Big enough for any datagram, so nothing is silently cut.
    let mut buf = vec![0u8; 65_536];
    loop {
        let message = match link.recv(&mut buf).await {
            Ok(message) => message,
            Err(e) if e.kind() == io::ErrorKind::BrokenPipe => return,
            Err(e) => {
                // A connected UDP socket reports ICMP errors here (nothing
                // listens at the agent's address yet); keep receiving.
                tracing::debug!(error = %e, "CoAP receive failed");
                if e.kind() != io::ErrorKind::ConnectionRefused {
                    tokio::time::sleep(Duration::from_millis(10)).await;
                }
                continue;
            }
        };
        let Ok(packet) = Packet::from_bytes(&message) else {
            tracing::debug!(len = message.len(), "ignoring a datagram that is not CoAP");
            continue;
        };
        let id = packet.header.message_id;
        match (packet.header.get_type(), packet.header.code) {
            (MessageType::Acknowledgement, MessageClass::Response(_)) => {
                let waiter = pending
                    .lock()
                    .expect("pending exchanges")
                    .answer(id, Some(packet.get_token()));
                if let Some(tx) = waiter {
                    let max_age = packet
                        .get_first_option(CoapOption::MaxAge)
                        .filter(|value| value.len() <= 4)
                        .map(|value| value.iter().fold(0, |n, b| n << 8 | u32::from(*b)));
                    let _ = tx.send(Answer::Response(Response {
                        code: packet.header.code,
                        payload: packet.payload,
                        max_age,
                    }));
                }
            }
            (MessageType::Reset, _) => {
                if let Some(tx) = pending.lock().expect("pending exchanges").answer(id, None) {
                    let _ = tx.send(Answer::Reset);
                }
            }
            (MessageType::Confirmable, _) => {
                // Nothing is expected from the agent unasked: reject it.
                let mut reset = Packet::new();
                reset.header.set_type(MessageType::Reset);
                reset.header.code = MessageClass::Empty;
                reset.header.message_id = id;
                if let Ok(bytes) = reset.to_bytes() {
                    let _ = link.send(&bytes).await;
                }
            }
            (kind, code) => {
                tracing::debug!(?kind, %code, message_id = id, "ignoring an unexpected CoAP message");
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use coap_lite::ResponseType;

    use super::*;

    #[test]
    fn a_report_request_is_a_confirmable_cbor_post_to_the_device_path() {
        let request = Request::report("plant", "t-1", vec![0xa1, 0x61, 0x67, 0x01]);
        let packet = request.to_packet(0x1234, [1, 2, 3, 4]);
        let parsed = Packet::from_bytes(&packet.to_bytes().unwrap()).unwrap();

        assert_eq!(parsed.header.get_type(), MessageType::Confirmable);
        assert_eq!(parsed.header.code, MessageClass::Request(RequestType::Post));
        assert_eq!(parsed.header.message_id, 0x1234);
        assert_eq!(parsed.get_token(), [1, 2, 3, 4]);
        let path: Vec<_> = parsed
            .get_option(CoapOption::UriPath)
            .unwrap()
            .iter()
            .map(|s| String::from_utf8(s.clone()).unwrap())
            .collect();
        assert_eq!(path, ["d", "plant", "t-1", "report"]);
        assert_eq!(
            parsed.get_content_format(),
            Some(ContentFormat::ApplicationCBOR)
        );
        assert_eq!(parsed.payload, [0xa1, 0x61, 0x67, 0x01]);

        let empty = Request::report("plant", "t-1", vec![]).to_packet(1, [0; 4]);
        assert_eq!(empty.get_content_format(), None);
    }

    #[test]
    fn success_is_the_2_xx_class() {
        let response = |code| Response {
            code: MessageClass::Response(code),
            payload: vec![],
            max_age: None,
        };
        assert!(response(ResponseType::Changed).is_success());
        assert!(response(ResponseType::Content).is_success());
        assert!(!response(ResponseType::NotFound).is_success());
        assert!(!response(ResponseType::InternalServerError).is_success());
    }

    #[test]
    fn service_unavailable_says_when_to_ask_again() {
        let response = |code, max_age| Response {
            code: MessageClass::Response(code),
            payload: vec![],
            max_age,
        };
        assert_eq!(
            response(ResponseType::ServiceUnavailable, Some(1)).retry_after(),
            Some(Duration::from_secs(1))
        );
        assert_eq!(
            response(ResponseType::ServiceUnavailable, None).retry_after(),
            Some(Duration::from_secs(60))
        );
        assert_eq!(response(ResponseType::Changed, Some(1)).retry_after(), None);
        assert_eq!(response(ResponseType::NotFound, None).retry_after(), None);
    }

    #[test]
    fn ids_and_tokens_are_handed_out_in_order_and_wrap() {
        let mut pending = Pending::new(u16::MAX, 7);
        let (a, _) = oneshot::channel();
        let (b, _) = oneshot::channel();
        assert_eq!(pending.begin(a), Some((u16::MAX, 7u32.to_be_bytes())));
        assert_eq!(pending.begin(b), Some((0, 8u32.to_be_bytes())));
    }

    #[test]
    fn an_id_still_waiting_is_skipped() {
        let mut pending = Pending::new(5, 0);
        let (tx, _rx) = oneshot::channel();
        let (first, _) = pending.begin(tx).unwrap();
        assert_eq!(first, 5);
        // Wrap all the way round: the next allocation that would hit 5 skips it.
        pending.next_id = 5;
        let (tx, _rx2) = oneshot::channel();
        assert_eq!(pending.begin(tx).unwrap().0, 6);
    }

    #[test]
    fn answers_go_to_the_matching_waiter_only() {
        let mut pending = Pending::new(100, 0);
        let (tx, mut rx) = oneshot::channel();
        let (id, token) = pending.begin(tx).unwrap();

        // Wrong id, wrong token: not ours.
        assert!(pending.answer(id + 1, Some(&token)).is_none());
        assert!(pending.answer(id, Some(&[9, 9, 9, 9])).is_none());
        assert_eq!(pending.waiting.len(), 1);

        let waiter = pending.answer(id, Some(&token)).expect("matching answer");
        waiter.send(Answer::Reset).unwrap();
        assert_eq!(rx.try_recv(), Ok(Answer::Reset));
        // Answered once; a duplicate ACK finds nobody.
        assert!(pending.answer(id, Some(&token)).is_none());
    }

    #[test]
    fn a_reset_matches_by_id_alone() {
        let mut pending = Pending::new(1, 0);
        let (tx, _rx) = oneshot::channel();
        let (id, _) = pending.begin(tx).unwrap();
        assert!(pending.answer(id, None).is_some());
    }

    #[test]
    fn abandoning_frees_the_id_unless_it_was_reused() {
        let mut pending = Pending::new(1, 0);
        let (tx, _rx) = oneshot::channel();
        let (id, token) = pending.begin(tx).unwrap();
        pending.abandon(id, [0xff; 4]);
        assert_eq!(pending.waiting.len(), 1);
        pending.abandon(id, token);
        assert!(pending.waiting.is_empty());
    }
}
