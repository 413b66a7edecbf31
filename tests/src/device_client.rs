//! Devices played by a test over the real protocols: a CoAP client on its
//! own UDP socket with its DTLS session, an MQTT login with the device's own key, and the next
//! MQTT message on a topic.

use std::net::SocketAddr;
use std::time::{Duration, Instant};

use coap_lite::{CoapOption, MessageClass, MessageType, Packet, RequestType, ResponseType};
use edgefleet_shared::ResourceKey;
use edgefleet_shared::credential::{self, Psk};
use edgefleet_sim::coap::connected_socket;
use edgefleet_sim::dtls::DtlsLink;
use edgefleet_sim::keys::{self, FleetKey};
use edgefleet_sim::manifest;
use k8s_openapi::api::core::v1::Secret;
use kube::api::{Api, PostParams};

use crate::PATIENCE;

/// A device's side of CoAP over DTLS with its [`test_key`]: one
/// confirmable request, one response.
#[derive(Debug)]
pub struct CoapDevice {
    link: DtlsLink,
    next_id: u16,
}

impl CoapDevice {
    /// `device`, on a socket of its own, talking to the agent's CoAP server
    /// at `agent`.
    pub async fn new(agent: SocketAddr, device: &ResourceKey) -> Self {
        let socket = connected_socket(agent).await.unwrap();
        let key = test_key(device);
        CoapDevice {
            link: DtlsLink::start(socket, &credential::login_name(device), key.as_bytes()),
            next_id: 1,
        }
    }

    /// A confirmable request with a fresh message id and token.
    pub fn request(&mut self, method: RequestType, path: &str, payload: Vec<u8>) -> Packet {
        let mut packet = Packet::new();
        packet.header.set_version(1);
        packet.header.set_type(MessageType::Confirmable);
        packet.header.code = MessageClass::Request(method);
        packet.header.message_id = self.next_id;
        self.next_id += 1;
        packet.set_token(self.next_id.to_be_bytes().to_vec());
        for segment in path.split('/') {
            packet.add_option(CoapOption::UriPath, segment.as_bytes().to_vec());
        }
        packet.payload = payload;
        packet
    }

    /// Sends `packet` until the agent answers (as a device retransmits,
    /// handshaking again while its key is on its way); the answer.
    pub async fn exchange(&self, packet: &Packet) -> Packet {
        let bytes = packet.to_bytes().unwrap();
        for _ in 0..40 {
            let sent = Instant::now();
            self.link.send(&bytes).await.unwrap();
            let deadline = tokio::time::Instant::now() + Duration::from_millis(500);
            while let Ok(Ok(answer)) = tokio::time::timeout_at(deadline, self.link.recv()).await {
                let response = Packet::from_bytes(&answer).unwrap();
                // An answer to an earlier retransmission is skipped.
                if response.header.message_id == packet.header.message_id {
                    return response;
                }
            }
            self.link.renew(sent).await;
        }
        panic!("the agent never answered");
    }

    /// A request and its answer.
    pub async fn send(&mut self, method: RequestType, path: &str, payload: Vec<u8>) -> Packet {
        let packet = self.request(method, path, payload);
        self.exchange(&packet).await
    }
}

/// The response code of `packet`.
pub fn code(packet: &Packet) -> ResponseType {
    match packet.header.code {
        MessageClass::Response(code) => code,
        other => panic!("not a response: {other:?}"),
    }
}

/// The key a test gives Device `device`: the one `edgefleet-sim devices`
/// would with the fleet key `test`.
pub fn test_key(device: &ResourceKey) -> Psk {
    keys::device_key(&FleetKey("test".into()), device)
}

/// Creates the Secret with `device`'s [`test_key`], as an operator would
/// provision it.
pub async fn give_key(client: &kube::Client, device: &ResourceKey) {
    let secrets: Api<Secret> = Api::namespaced(client.clone(), &device.namespace);
    let secret = manifest::key_secret(device, &test_key(device));
    secrets
        .create(&PostParams::default(), &secret)
        .await
        .unwrap_or_else(|e| panic!("create the key Secret of {device}: {e}"));
}

/// Options for an MQTT client playing `device` on the broker at `broker`:
/// client id and user `<name>@<namespace>`, its [`test_key`] as password.
pub fn mqtt_login(broker: SocketAddr, device: &ResourceKey) -> rumqttc::MqttOptions {
    let host = broker.ip().to_string();
    edgefleet_sim::mqtt::login(device, &test_key(device), &host, broker.port())
}

/// An MQTT client playing `device`, connected: it tries again while the
/// broker refuses the login (the key may still be on its way to the agent).
pub async fn mqtt_device(
    broker: SocketAddr,
    device: &ResourceKey,
) -> (rumqttc::AsyncClient, rumqttc::EventLoop) {
    let connect = async {
        loop {
            let (client, mut events) = rumqttc::AsyncClient::new(mqtt_login(broker, device), 64);
            loop {
                match events.poll().await {
                    Ok(rumqttc::Event::Incoming(rumqttc::Packet::ConnAck(_))) => {
                        return (client, events);
                    }
                    Ok(_) => {}
                    Err(_) => break,
                }
            }
            tokio::time::sleep(Duration::from_millis(100)).await;
        }
    };
    tokio::time::timeout(PATIENCE, connect)
        .await
        .unwrap_or_else(|_| panic!("{device} could not log in to the broker at {broker}"))
}

/// The next message on `topic`.
pub async fn next_on(events: &mut rumqttc::EventLoop, topic: &str) -> Vec<u8> {
    let wait = async {
        loop {
            match events.poll().await {
                Ok(rumqttc::Event::Incoming(rumqttc::Packet::Publish(p))) if p.topic == topic => {
                    return p.payload.to_vec();
                }
                Ok(_) => {}
                Err(_) => tokio::time::sleep(Duration::from_millis(100)).await,
            }
        }
    };
    tokio::time::timeout(PATIENCE, wait)
        .await
        .unwrap_or_else(|_| panic!("nothing arrived on {topic}"))
}
