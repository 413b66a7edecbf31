//! Bytes from a device on the MQTT guard's port: split into packets as the
//! guard does, the first judged as a login, the others as what a logged-in
//! device may send; and every topic seen parsed as an uplink topic.
#![no_main]

use bytes::BytesMut;
use edgefleet_agent::mqtt::acl;
use edgefleet_agent::mqtt::guard::{may_forward, split_packet};
use edgefleet_shared::credential::Psk;
use edgefleet_shared::topics;
use libfuzzer_sys::fuzz_target;
use rumqttc::mqttbytes::v4::Packet;

const NODE: &str = "edge-1";

fuzz_target!(|bytes: &[u8]| {
    let mut buf = BytesMut::from(bytes);
    let mut identity = None;
    while let Ok(Some((_, packet))) = split_packet(&mut buf) {
        match (&identity, &packet) {
            (None, Packet::Connect(connect)) => {
                let judged = acl::login(
                    NODE,
                    &connect.client_id,
                    connect.login.as_ref(),
                    connect.last_will.as_ref(),
                    // Every device's key is its login name, padded.
                    |device| Psk::new(format!("{:0<16}", device.name).into_bytes()).ok(),
                );
                match judged {
                    Ok(who) => identity = Some(who),
                    Err(_) => return,
                }
            }
            (None, _) => return,
            (Some(who), packet) => {
                if let Packet::Publish(publish) = packet {
                    let parsed = topics::parse_uplink(NODE, &publish.topic);
                    // Whatever the guard forwards is the device's own topic.
                    if may_forward(who, packet).is_ok() {
                        let (device, _) = parsed.expect("a forwarded publish is an uplink");
                        assert_eq!(&device, &who.device);
                    }
                }
                if may_forward(who, packet).is_err() {
                    return;
                }
            }
        }
    }
});
