//! The guard in front of the embedded broker: the site's MQTT port.
//!
//! Each device connection is read packet by packet (MQTT 3.1.1, framed and
//! parsed by rumqttc's codec). The CONNECT must name a Device whose key
//! this agent holds, with that key as password ([`acl::login`]); the guard
//! then opens the device's own connection to the broker on loopback,
//! logging it in with the guard's secret, and passes packets both ways.
//! Every PUBLISH and SUBSCRIBE from the device is checked first
//! ([`acl::publish`], [`acl::subscribe`]): a forbidden one ends the
//! connection before the broker sees it (MQTT 3.1.1 has no way to refuse a
//! PUBLISH), and is counted. A refused login gets its CONNACK code. When
//! the device's key is revoked or rotated, its connection ends within a
//! moment of the agent learning it.

use std::net::SocketAddr;
use std::sync::Arc;
use std::time::Duration;

use bytes::BytesMut;
use edgefleet_shared::credential;
use edgefleet_shared::telemetry::Outcomes;
use prometheus_client::metrics::gauge::Gauge;
use rumqttc::mqttbytes::{self, v4};
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::{TcpListener, TcpStream};

use super::acl::{self, Identity, Refusal};
use crate::store::Store;

/// How long a new connection has to send its CONNECT.
const CONNECT_TIMEOUT: Duration = Duration::from_secs(10);

/// The largest packet a device may send: a report or event at the broker's
/// payload limit, with its topic and headers.
const MAX_PACKET: usize = super::BROKER_MAX_PAYLOAD + 1024;

/// The guard's counters.
#[derive(Debug, Default)]
pub struct GuardMetrics {
    /// Logins by outcome: `accepted` or the refusal's label.
    pub logins: Outcomes,
    /// Connections ended by the guard after login, by reason: a refusal's
    /// label, `revoked`, `malformed`, or `second_connect`.
    pub ended: Outcomes,
    /// Device connections open now.
    pub open: Gauge,
}

/// What the guard needs.
#[derive(Clone)]
pub struct Guard {
    /// The agent's node.
    pub node: String,
    /// Where the device keys are.
    pub store: Store,
    /// The embedded broker, on loopback.
    pub broker: SocketAddr,
    /// The password the guard logs devices in with.
    pub broker_password: String,
    /// Its counters.
    pub metrics: Arc<GuardMetrics>,
}

impl std::fmt::Debug for Guard {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Guard")
            .field("node", &self.node)
            .field("broker", &self.broker)
            .finish_non_exhaustive()
    }
}

/// Serves device connections on `listener` until the process ends.
pub async fn serve(listener: TcpListener, guard: Guard) {
    loop {
        match listener.accept().await {
            Ok((stream, peer)) => {
                let guard = guard.clone();
                tokio::spawn(async move {
                    guard.metrics.open.inc();
                    if let Err(error) = connection(&guard, stream).await {
                        tracing::debug!(%peer, %error, "MQTT device connection ended");
                    }
                    guard.metrics.open.dec();
                });
            }
            Err(error) => {
                tracing::warn!(%error, "MQTT guard could not accept a connection");
                tokio::time::sleep(Duration::from_millis(100)).await;
            }
        }
    }
}

/// Why a connection ended.
#[derive(Debug, thiserror::Error)]
enum Ended {
    #[error("{0}")]
    Io(#[from] std::io::Error),
    #[error("malformed MQTT: {0:?}")]
    Malformed(mqttbytes::Error),
    #[error("the first packet was not a CONNECT")]
    NotConnect,
    #[error("login refused: {0}")]
    LoginRefused(Refusal),
    #[error("refused: {0}")]
    Refused(Refusal),
    #[error("a second CONNECT")]
    SecondConnect,
    #[error("the device's key was revoked or rotated")]
    Revoked,
    #[error("the device, or the broker, went silent during the login")]
    TimedOut,
    #[error("the broker did not answer the login with a CONNACK")]
    BrokerRefused,
}

/// Takes the first whole packet off `buf`: its bytes and the packet;
/// `None` while `buf` holds less than one packet. Pure, so it can be fuzzed.
pub fn split_packet(
    buf: &mut BytesMut,
) -> Result<Option<(bytes::Bytes, v4::Packet)>, mqttbytes::Error> {
    match mqttbytes::check(buf.iter(), MAX_PACKET) {
        Ok(header) => {
            let raw = buf.split_to(header.frame_length()).freeze();
            let packet = v4::Packet::read(&mut BytesMut::from(&raw[..]), MAX_PACKET)?;
            Ok(Some((raw, packet)))
        }
        Err(mqttbytes::Error::InsufficientBytes(_)) => Ok(None),
        Err(error) => Err(error),
    }
}

/// Whether a logged-in device may send `packet` on to the broker. A second
/// CONNECT is refused as `second_connect`.
pub fn may_forward(identity: &Identity, packet: &v4::Packet) -> Result<(), Refusal> {
    match packet {
        v4::Packet::Publish(p) => acl::publish(identity, &p.topic, p.retain),
        v4::Packet::Subscribe(s) => s
            .filters
            .iter()
            .try_for_each(|filter| acl::subscribe(identity, &filter.path)),
        v4::Packet::Connect(_) => Err(Refusal::SecondConnect),
        _ => Ok(()),
    }
}

/// Reads the next whole packet of `stream` into `buf`, and returns its
/// bytes and the packet; `None` at the end of the stream.
async fn next_packet(
    stream: &mut (impl AsyncReadExt + Unpin),
    buf: &mut BytesMut,
) -> Result<Option<(bytes::Bytes, v4::Packet)>, Ended> {
    loop {
        if let Some(packet) = split_packet(buf).map_err(Ended::Malformed)? {
            return Ok(Some(packet));
        }
        if stream.read_buf(buf).await? == 0 {
            return Ok(None);
        }
    }
}

async fn connection(guard: &Guard, mut device: TcpStream) -> Result<(), Ended> {
    device.set_nodelay(true)?;
    let mut buf = BytesMut::with_capacity(4096);
    let first = tokio::time::timeout(CONNECT_TIMEOUT, next_packet(&mut device, &mut buf))
        .await
        .map_err(|_| Ended::TimedOut)?;
    let Some((_, v4::Packet::Connect(mut connect))) = first? else {
        guard.metrics.logins.inc("not_connect");
        return Err(Ended::NotConnect);
    };
    let judged = acl::login(
        &guard.node,
        &connect.client_id,
        connect.login.as_ref(),
        connect.last_will.as_ref(),
        |device| guard.store.credential(device).ok().flatten(),
    );
    let identity = match judged {
        Ok(identity) => identity,
        Err(refusal) => {
            guard.metrics.logins.inc(refusal.label());
            tracing::warn!(client = %connect.client_id, %refusal, "MQTT login refused");
            let mut out = BytesMut::new();
            let connack = v4::ConnAck::new(refusal.connack(), false);
            connack.write(&mut out).map_err(Ended::Malformed)?;
            device.write_all(&out).await?;
            return Err(Ended::LoginRefused(refusal));
        }
    };
    guard.metrics.logins.inc("accepted");
    let password = connect
        .login
        .as_ref()
        .map(|l| l.password.clone())
        .unwrap_or_default();
    let mut broker = TcpStream::connect(guard.broker).await?;
    broker.set_nodelay(true)?;
    connect.login = Some(v4::Login::new(
        credential::login_name(&identity.device),
        guard.broker_password.clone(),
    ));
    let mut out = BytesMut::new();
    connect.write(&mut out).map_err(Ended::Malformed)?;
    broker.write_all(&out).await?;
    // The broker's CONNACK is awaited before anything else happens, also
    // when the device has gone meanwhile: rumqttd 0.20 leaves a stale
    // entry behind when a connection fails during its login, and the next
    // login under that client id then panics its listener
    // (bytebeamio/rumqtt#1062).
    let mut from_broker_buf = BytesMut::new();
    let connack = tokio::time::timeout(
        CONNECT_TIMEOUT,
        next_packet(&mut broker, &mut from_broker_buf),
    )
    .await
    .map_err(|_| Ended::TimedOut)??;
    let Some((raw, v4::Packet::ConnAck(_))) = connack else {
        return Err(Ended::BrokerRefused);
    };
    device.write_all(&raw).await?;
    device.write_all(&from_broker_buf).await?;
    let (mut from_broker, mut to_broker) = broker.into_split();
    let (mut from_device, mut to_device) = device.into_split();
    let downstream = tokio::io::copy(&mut from_broker, &mut to_device);
    let upstream = upstream(&identity, &mut from_device, &mut to_broker, buf);
    let revoked = revoked(guard, &identity, password);
    let result = tokio::select! {
        result = downstream => result.map(|_| ()).map_err(Ended::from),
        result = upstream => result,
        () = revoked => Err(Ended::Revoked),
    };
    match &result {
        Err(Ended::Refused(refusal)) => {
            guard.metrics.ended.inc(refusal.label());
            tracing::warn!(device = %identity.device, %refusal, "MQTT device cut off");
        }
        Err(Ended::Revoked) => {
            guard.metrics.ended.inc("revoked");
            tracing::info!(device = %identity.device, "MQTT device cut off: its key was revoked or rotated");
        }
        Err(Ended::Malformed(_)) => guard.metrics.ended.inc("malformed"),
        Err(Ended::SecondConnect) => guard.metrics.ended.inc("second_connect"),
        _ => {}
    }
    result
}

/// Passes the device's packets to the broker, each checked first.
async fn upstream(
    identity: &Identity,
    from_device: &mut (impl AsyncReadExt + Unpin),
    to_broker: &mut (impl AsyncWriteExt + Unpin),
    mut buf: BytesMut,
) -> Result<(), Ended> {
    while let Some((raw, packet)) = next_packet(from_device, &mut buf).await? {
        match may_forward(identity, &packet) {
            Ok(()) => {}
            Err(Refusal::SecondConnect) => return Err(Ended::SecondConnect),
            Err(refusal) => return Err(Ended::Refused(refusal)),
        }
        to_broker.write_all(&raw).await?;
    }
    Ok(())
}

/// Returns once the key the device logged in with is no longer its key.
async fn revoked(guard: &Guard, identity: &Identity, password: String) {
    let mut changes = guard.store.credential_watch(&identity.device);
    loop {
        let current = guard.store.credential(&identity.device).ok().flatten();
        if !current.is_some_and(|key| key.matches(password.as_bytes())) {
            return;
        }
        if changes.changed().await.is_err() {
            // The store is gone: the agent is stopping.
            std::future::pending::<()>().await;
        }
    }
}
