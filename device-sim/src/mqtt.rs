//! Each device's MQTT session.
//!
//! Every device has a connection of its own, logged in as itself (client
//! id and user `<name>@<namespace>`, its key as password), as a site whose
//! broker checks device logins and topics requires. The session subscribes
//! to the device's retained desired topic (QoS 1), and for an MQTT device
//! to its event-ack topic, and hands each message to the device through a
//! [`watch`] channel: a device only ever needs the latest desired state,
//! and a watch channel never blocks the session, however slow the device.
//! Devices whose transport is MQTT publish their reports through their
//! session's client; their PUBACKs are counted here.

use std::collections::HashMap;
use std::sync::Arc;
use std::time::Duration;

use edgefleet_shared::ResourceKey;
use edgefleet_shared::codec::{self, CodecError, DesiredState, EventAck};
use edgefleet_shared::credential::{self, Psk};
use rumqttc::{AsyncClient, Event, EventLoop, MqttOptions, Outgoing, Packet, QoS};
use tokio::sync::watch;

use crate::summary::Stats;

/// How long to wait before reconnecting to the broker.
const RECONNECT_DELAY: Duration = Duration::from_secs(1);

/// Requests (publishes, subscribes) queued for the event loop at most: a
/// device has one report and one event in flight at a time.
const REQUEST_QUEUE: usize = 16;

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

/// `device`'s client for the broker at `host:port`, logged in with `key`,
/// and the event loop that must be driven (see [`drive`]) for it to do
/// anything.
pub fn connect(device: &ResourceKey, key: &Psk, host: &str, port: u16) -> (AsyncClient, EventLoop) {
    AsyncClient::new(login(device, key, host, port), REQUEST_QUEUE)
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
/// connection, routes desired states to devices, counts PUBACKs, reconnects
/// after errors. Disconnects politely on the way out.
pub async fn drive(
    mut eventloop: EventLoop,
    client: AsyncClient,
    routes: Routes,
    stats: Arc<Stats>,
    mut stop: watch::Receiver<bool>,
) {
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
            Ok(Event::Incoming(Packet::PubAck(_))) => stats.report_acknowledged(),
            Ok(_) => {}
            Err(e) => {
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
