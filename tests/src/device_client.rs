//! Devices played by a test over the real protocols: a CoAP client on its
//! own UDP socket, and the next MQTT message on a topic.

use std::net::SocketAddr;
use std::time::Duration;

use coap_lite::{CoapOption, MessageClass, MessageType, Packet, RequestType, ResponseType};
use tokio::net::UdpSocket;

use crate::PATIENCE;

/// A device's side of CoAP: one confirmable request, one response.
#[derive(Debug)]
pub struct CoapDevice {
    socket: UdpSocket,
    agent: SocketAddr,
    next_id: u16,
}

impl CoapDevice {
    /// A device socket talking to the agent's CoAP server at `agent`.
    pub async fn new(agent: SocketAddr) -> Self {
        CoapDevice {
            socket: UdpSocket::bind("127.0.0.1:0").await.unwrap(),
            agent,
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

    /// Sends `packet` until the agent answers (as a device retransmits); the answer.
    pub async fn exchange(&self, packet: &Packet) -> Packet {
        let bytes = packet.to_bytes().unwrap();
        let mut buf = vec![0u8; 2048];
        // Retransmit like a device would until the agent answers.
        for _ in 0..20 {
            self.socket.send_to(&bytes, self.agent).await.unwrap();
            if let Ok(Ok((len, _))) =
                tokio::time::timeout(Duration::from_millis(500), self.socket.recv_from(&mut buf))
                    .await
            {
                let response = Packet::from_bytes(&buf[..len]).unwrap();
                assert_eq!(response.header.message_id, packet.header.message_id);
                return response;
            }
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
