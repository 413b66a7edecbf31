//! Each device's MQTT session.
//!
//! Every device has a connection of its own, logged in as itself (client
//! id and user `<name>@<namespace>`, its key as password), as a site whose
//! broker checks device logins and topics requires. The session subscribes
//! to the device's retained desired topic (QoS 1), and for an MQTT device
//! to its event-ack topic, and hands each message to the device through a
//! [`watch`] channel: a device only ever needs the latest desired state,
//! and a watch channel never blocks the session, however slow the device.
//! Devices whose transport is MQTT publish their reports and events
//! through their session's [`Publisher`], one at a time: a publish counts
//! as delivered only on the broker's PUBACK. (rumqttc drops a clean
//! session's unacknowledged publishes, and its queued requests, when it
//! reconnects, so handing a publish to the client proves nothing.)

use std::collections::HashMap;
use std::sync::Arc;
use std::time::Duration;

use edgefleet_shared::ResourceKey;
use edgefleet_shared::codec::{self, CodecError, DesiredState, EventAck};
use edgefleet_shared::credential::{self, Psk};
use rumqttc::{AsyncClient, ClientError, Event, EventLoop, MqttOptions, Outgoing, Packet, QoS};
use tokio::sync::{Mutex, oneshot, watch};

use crate::summary::Stats;

/// How long to wait before reconnecting to the broker.
const RECONNECT_DELAY: Duration = Duration::from_secs(1);

/// Requests (publishes, subscribes) queued for the event loop at most: a
/// device has one publish in flight at a time.
const REQUEST_QUEUE: usize = 16;

/// How long a publish waits for its PUBACK on a connection that stays up.
const PUBACK_TIMEOUT: Duration = Duration::from_secs(10);

/// Why a publish was not delivered.
#[derive(Debug, thiserror::Error)]
pub enum PublishError {
    #[error("the MQTT client refused the publish: {0}")]
    Client(#[from] ClientError),
    #[error("the connection failed before the broker acknowledged the publish")]
    ConnectionLost,
    #[error("no PUBACK within {PUBACK_TIMEOUT:?}")]
    Timeout,
    #[error("the session is closing")]
    Closed,
}

/// The session's publish awaiting its PUBACK: bound to its packet id when
/// the event loop sends it.
struct Waiter {
    pkid: Option<u16>,
    done: oneshot::Sender<bool>,
}

/// What a session's [`Publisher`] and its [`drive`] loop share.
#[derive(Default)]
struct Outstanding {
    /// Held for a publish's whole round trip: one publish at a time, so a
    /// PUBACK can only be for it.
    slot: Mutex<()>,
    waiter: std::sync::Mutex<Option<Waiter>>,
}

impl Outstanding {
    fn waiter(&self) -> std::sync::MutexGuard<'_, Option<Waiter>> {
        self.waiter.lock().expect("not poisoned")
    }

    /// A publish is about to be handed to the client: the receiver learns
    /// whether the broker acknowledged it.
    fn begin(&self) -> oneshot::Receiver<bool> {
        let (done, delivered) = oneshot::channel();
        *self.waiter() = Some(Waiter { pkid: None, done });
        delivered
    }

    /// The event loop sent the publish in flight as packet `pkid`.
    fn sent(&self, pkid: u16) {
        if let Some(waiter) = self.waiter().as_mut() {
            waiter.pkid = Some(pkid);
        }
    }

    /// The broker acknowledged packet `pkid`.
    fn acknowledged(&self, pkid: u16) {
        let mut waiter = self.waiter();
        if waiter.as_ref().is_some_and(|w| w.pkid == Some(pkid))
            && let Some(waiter) = waiter.take()
        {
            let _ = waiter.done.send(true);
        }
    }

    /// The connection failed: the publish in flight is lost.
    fn lost(&self) {
        if let Some(waiter) = self.waiter().take() {
            let _ = waiter.done.send(false);
        }
    }

    /// The publish in flight is settled, whichever way.
    fn end(&self) {
        self.waiter().take();
    }
}

/// Publishes a device's messages at QoS 1, one at a time, each until the
/// broker acknowledged it.
#[derive(Clone)]
pub struct Publisher {
    client: AsyncClient,
    outstanding: Arc<Outstanding>,
}

impl std::fmt::Debug for Publisher {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Publisher").finish_non_exhaustive()
    }
}

impl Publisher {
    /// Publishes `payload` on `topic`; `Ok` once the broker acknowledged it.
    pub async fn publish(&self, topic: &str, payload: Vec<u8>) -> Result<(), PublishError> {
        let _slot = self.outstanding.slot.lock().await;
        let delivered = self.outstanding.begin();
        let handed = self
            .client
            .publish(topic, QoS::AtLeastOnce, false, payload)
            .await;
        let outcome = match handed {
            Ok(()) => tokio::time::timeout(PUBACK_TIMEOUT, delivered).await,
            Err(e) => {
                self.outstanding.end();
                return Err(e.into());
            }
        };
        // Whatever happened, the next publish starts afresh.
        self.outstanding.end();
        match outcome {
            Ok(Ok(true)) => Ok(()),
            Ok(Ok(false)) => Err(PublishError::ConnectionLost),
            Ok(Err(_)) => Err(PublishError::Closed),
            Err(_) => Err(PublishError::Timeout),
        }
    }
}

/// What a device is told through its desired topic.
#[derive(Clone, Debug, PartialEq)]
pub enum Inbox {
    /// Its desired state.
    Desired(DesiredState),
    /// Its Device was deleted (an empty retained message).
    Deleted,
}

impl Inbox {
    /// Decodes the payload of a desired-state message.
    pub fn decode(payload: &[u8]) -> Result<Self, CodecError> {
        if payload.is_empty() {
            Ok(Inbox::Deleted)
        } else {
            codec::decode(payload).map(Inbox::Desired)
        }
    }
}

/// Where the session delivers a topic's messages.
#[derive(Debug)]
pub enum Route {
    /// A device's desired topic: to its inbox.
    Desired(watch::Sender<Option<Inbox>>),
    /// A device's event-ack topic: the latest confirmation (the highest
    /// event id the agent holds in a boot).
    EventAck(watch::Sender<EventAck>),
}

/// Where the session delivers each topic it subscribes to.
pub type Routes = HashMap<String, Route>;

/// `device`'s publisher for the broker at `host:port`, logged in with
/// `key`, and the session that must be driven (see [`drive`]) for it to do
/// anything.
pub fn connect(device: &ResourceKey, key: &Psk, host: &str, port: u16) -> (Publisher, Session) {
    let (client, eventloop) = AsyncClient::new(login(device, key, host, port), REQUEST_QUEUE);
    let outstanding = Arc::<Outstanding>::default();
    let publisher = Publisher {
        client: client.clone(),
        outstanding: Arc::clone(&outstanding),
    };
    let session = Session {
        eventloop,
        client,
        outstanding,
    };
    (publisher, session)
}

/// A device's MQTT connection, to be driven by [`drive`].
pub struct Session {
    eventloop: EventLoop,
    client: AsyncClient,
    outstanding: Arc<Outstanding>,
}

impl std::fmt::Debug for Session {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Session").finish_non_exhaustive()
    }
}

/// The MQTT options of `device` logging in with `key` at `host:port`:
/// client id and user `<name>@<namespace>`, the key as password.
pub fn login(device: &ResourceKey, key: &Psk, host: &str, port: u16) -> MqttOptions {
    let name = credential::login_name(device);
    let mut options = MqttOptions::new(&name, host, port);
    options
        .set_keep_alive(Duration::from_secs(30))
        .set_clean_session(true)
        .set_credentials(name, String::from_utf8_lossy(key.as_bytes()));
    options
}

/// Drives the session until `stop` turns true: (re)subscribes on every
/// connection, routes desired states to devices, settles the publish in
/// flight on its PUBACK (or on the connection's failure), reconnects after
/// errors. Disconnects politely on the way out.
pub async fn drive(
    session: Session,
    routes: Routes,
    stats: Arc<Stats>,
    mut stop: watch::Receiver<bool>,
) {
    let Session {
        mut eventloop,
        client,
        outstanding,
    } = session;
    let mut connected = false;
    // Whether the next connection error starts an outage worth a warning.
    let mut healthy = true;
    loop {
        let event = tokio::select! {
            _ = stop.wait_for(|stop| *stop) => break,
            event = eventloop.poll() => event,
        };
        match event {
            Ok(Event::Incoming(Packet::ConnAck(_))) => {
                connected = true;
                healthy = true;
                tracing::debug!(topics = routes.len(), "MQTT connected, subscribing");
                // Through a task: the request queue may be full of reports,
                // and only this loop drains it.
                let client = client.clone();
                let filters: Vec<_> = routes
                    .keys()
                    .map(|topic| rumqttc::SubscribeFilter::new(topic.clone(), QoS::AtLeastOnce))
                    .collect();
                tokio::spawn(async move {
                    if let Err(e) = client.subscribe_many(filters).await {
                        tracing::warn!(error = %e, "MQTT subscribe failed");
                    }
                });
            }
            Ok(Event::Incoming(Packet::Publish(publish))) => {
                tracing::debug!(topic = %publish.topic, bytes = publish.payload.len(), retained = publish.retain, "message received");
                let inbox = match routes.get(&publish.topic) {
                    Some(Route::Desired(inbox)) => inbox,
                    Some(Route::EventAck(acks)) => {
                        match codec::decode::<EventAck>(&publish.payload) {
                            Ok(ack) => {
                                acks.send_if_modified(|latest| {
                                    let newer = ack.boot != latest.boot || ack.id > latest.id;
                                    if newer {
                                        *latest = ack;
                                    }
                                    newer
                                });
                            }
                            Err(e) => {
                                tracing::warn!(topic = %publish.topic, error = %e, "malformed event ack")
                            }
                        }
                        continue;
                    }
                    // A device of this node and namespace that this
                    // simulation does not run.
                    None => continue,
                };
                match Inbox::decode(&publish.payload) {
                    Ok(message) => {
                        inbox.send_replace(Some(message));
                    }
                    Err(e) => {
                        stats.desired_malformed();
                        tracing::warn!(topic = %publish.topic, error = %e, "malformed desired state");
                    }
                }
            }
            Ok(Event::Outgoing(Outgoing::Publish(pkid))) => outstanding.sent(pkid),
            Ok(Event::Incoming(Packet::PubAck(ack))) => outstanding.acknowledged(ack.pkid),
            Ok(_) => {}
            Err(e) => {
                // The session is clean: the next connection drops what this
                // one left unacknowledged. And the events the event loop
                // still holds from this connection (other than messages
                // received) must not settle a later publish.
                outstanding.lost();
                eventloop
                    .state
                    .events
                    .retain(|event| matches!(event, Event::Incoming(Packet::Publish(_))));
                if healthy {
                    tracing::warn!(error = %e, "MQTT connection failed; retrying every second");
                } else {
                    tracing::debug!(error = %e, "MQTT connection failed again");
                }
                connected = false;
                healthy = false;
                tokio::select! {
                    _ = stop.wait_for(|stop| *stop) => break,
                    () = tokio::time::sleep(RECONNECT_DELAY) => {}
                }
            }
        }
    }
    if connected {
        disconnect(&mut eventloop, &client).await;
    }
}

/// Sends DISCONNECT and drives the event loop until it is out (or a second
/// has passed).
async fn disconnect(eventloop: &mut EventLoop, client: &AsyncClient) {
    if client.try_disconnect().is_err() {
        return;
    }
    let flushed = async {
        loop {
            match eventloop.poll().await {
                Ok(Event::Outgoing(Outgoing::Disconnect)) | Err(_) => break,
                Ok(_) => {}
            }
        }
    };
    let _ = tokio::time::timeout(Duration::from_secs(1), flushed).await;
}

#[cfg(test)]
mod tests {
    use edgefleet_shared::codec::encode;

    use super::*;

    #[test]
    fn an_empty_payload_means_deleted() {
        assert_eq!(Inbox::decode(&[]).unwrap(), Inbox::Deleted);

        let desired = DesiredState {
            generation: 2,
            properties: Default::default(),
            firmware: None,
            local: 0,
        };
        assert_eq!(
            Inbox::decode(&encode(&desired).unwrap()).unwrap(),
            Inbox::Desired(desired)
        );
        assert!(Inbox::decode(&[0xff, 0x00]).is_err());
    }
}
