//! Who may do what on the site's MQTT broker: the pure rules the guard in
//! front of the embedded broker applies to each device's packets (see
//! [`super::guard`]).
//!
//! A device logs in with its Device's login name `<name>@<namespace>` as
//! both client id and user name (see
//! [`edgefleet_shared::credential::login_name`]), and its key as password.
//! Once in, it may publish only its own `report` and `event` topics, never
//! retained, and subscribe only to its own `desired` and `event-ack` topics
//! (no wildcards). Everything else is refused. Only the
//! agent, which reaches the broker without the guard, publishes `desired`.

use edgefleet_shared::credential::{self, Psk};
use edgefleet_shared::{ResourceKey, topics};
use rumqttc::{ConnectReturnCode, LastWill, Login};

/// Why a connection or a packet is refused; also the counter's label.
#[derive(Clone, Debug, PartialEq, Eq, thiserror::Error)]
pub enum Refusal {
    /// No user name, or one that is not `<name>@<namespace>`.
    #[error("the user name must be the Device's <name>@<namespace>")]
    BadUserName,
    /// The client id is not the user name.
    #[error("the client id must be the user name")]
    ClientIdNotUserName,
    /// A device this agent holds no key for (unknown, or revoked).
    #[error("no key is held for this device")]
    NoKey,
    /// The password is not the device's key.
    #[error("wrong key")]
    WrongKey,
    /// A topic the device may not publish to.
    #[error("publishing to {0:?} is not allowed")]
    PublishNotAllowed(String),
    /// A retained message.
    #[error("retained messages from devices are refused")]
    Retained,
    /// A topic filter the device may not subscribe to.
    #[error("subscribing to {0:?} is not allowed")]
    SubscribeNotAllowed(String),
    /// A CONNECT on a connection already logged in.
    #[error("a second CONNECT")]
    SecondConnect,
}

impl Refusal {
    /// The label of the guard's refusal counter.
    pub fn label(&self) -> &'static str {
        match self {
            Refusal::BadUserName => "bad_user_name",
            Refusal::ClientIdNotUserName => "client_id_not_user_name",
            Refusal::NoKey => "no_key",
            Refusal::WrongKey => "wrong_key",
            Refusal::PublishNotAllowed(_) => "publish_not_allowed",
            Refusal::Retained => "retained",
            Refusal::SubscribeNotAllowed(_) => "subscribe_not_allowed",
            Refusal::SecondConnect => "second_connect",
        }
    }

    /// The CONNACK code of a refused login.
    pub fn connack(&self) -> ConnectReturnCode {
        match self {
            Refusal::BadUserName | Refusal::NoKey | Refusal::WrongKey => {
                ConnectReturnCode::BadUserNamePassword
            }
            Refusal::ClientIdNotUserName => ConnectReturnCode::BadClientId,
            _ => ConnectReturnCode::NotAuthorized,
        }
    }
}

/// A logged-in device of `node`.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Identity {
    /// The agent's node (the topics' second level).
    pub node: String,
    /// The Device.
    pub device: ResourceKey,
}

/// Judges a login: the Device it names, if `key_of` holds its key and the
/// password is that key.
pub fn login(
    node: &str,
    client_id: &str,
    login: Option<&Login>,
    will: Option<&LastWill>,
    key_of: impl FnOnce(&ResourceKey) -> Option<Psk>,
) -> Result<Identity, Refusal> {
    let login = login.ok_or(Refusal::BadUserName)?;
    let device = credential::device_of_login(&login.username).ok_or(Refusal::BadUserName)?;
    if client_id != login.username {
        return Err(Refusal::ClientIdNotUserName);
    }
    let key = key_of(&device).ok_or(Refusal::NoKey)?;
    if !key.matches(login.password.as_bytes()) {
        return Err(Refusal::WrongKey);
    }
    let identity = Identity {
        node: node.to_owned(),
        device,
    };
    if let Some(will) = will {
        publish(&identity, &will.topic, will.retain)?;
    }
    Ok(identity)
}

/// The topics `device` of `node` may publish to: its own reports and
/// events (also what Mosquitto's ACL file says, see [`super::mosquitto`]).
pub fn publishes(node: &str, device: &ResourceKey) -> [String; 2] {
    [topics::report(node, device), topics::event(node, device)]
}

/// The topics `device` of `node` may subscribe to: its own desired state
/// and event acknowledgements, no wildcards.
pub fn subscriptions(node: &str, device: &ResourceKey) -> [String; 2] {
    [
        topics::desired(node, device),
        topics::event_ack(node, device),
    ]
}

/// Judges a publish by `identity` to `topic`.
pub fn publish(identity: &Identity, topic: &str, retain: bool) -> Result<(), Refusal> {
    let own = publishes(&identity.node, &identity.device);
    if !own.iter().any(|t| t == topic) {
        return Err(Refusal::PublishNotAllowed(topic.to_owned()));
    }
    if retain {
        return Err(Refusal::Retained);
    }
    Ok(())
}

/// Judges a subscription by `identity` to `filter`.
pub fn subscribe(identity: &Identity, filter: &str) -> Result<(), Refusal> {
    let own = subscriptions(&identity.node, &identity.device);
    match own.iter().any(|t| t == filter) {
        true => Ok(()),
        false => Err(Refusal::SubscribeNotAllowed(filter.to_owned())),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const KEY: &[u8] = b"0123456789abcdef";

    fn key_of(device: &ResourceKey) -> Option<Psk> {
        (device == &ResourceKey::device("plant", "t1")).then(|| Psk::new(KEY.to_vec()).unwrap())
    }

    fn log_in(client_id: &str, user: &str, password: &[u8]) -> Result<Identity, Refusal> {
        let login = Login::new(user, String::from_utf8_lossy(password));
        super::login("edge-1", client_id, Some(&login), None, key_of)
    }

    fn t1() -> Identity {
        log_in("t1@plant", "t1@plant", KEY).unwrap()
    }

    #[test]
    fn a_device_logs_in_with_its_name_and_key_only() {
        assert_eq!(t1().device, ResourceKey::device("plant", "t1"));
        assert_eq!(
            log_in("t1@plant", "t1@plant", b"0123456789abcdeX"),
            Err(Refusal::WrongKey)
        );
        assert_eq!(log_in("t2@plant", "t2@plant", KEY), Err(Refusal::NoKey));
        assert_eq!(
            log_in("edgefleet-agent-edge-1", "t1@plant", KEY),
            Err(Refusal::ClientIdNotUserName)
        );
        for user in [
            "",
            "t1",
            "plant/",
            "/t1",
            "Plant/t1",
            "plant/t1/x",
            "plant/+",
            "plant/#",
            "plant:t1",
            "t1@",
            "@plant",
            "T1@plant",
            "t1@plant@x",
        ] {
            assert_eq!(
                log_in(user, user, KEY),
                Err(Refusal::BadUserName),
                "{user:?}"
            );
        }
        assert_eq!(
            super::login("edge-1", "t1@plant", None, None, key_of),
            Err(Refusal::BadUserName)
        );
    }

    #[test]
    fn a_device_publishes_only_its_own_reports_and_events_unretained() {
        let me = t1();
        let other = ResourceKey::device("plant", "t2");
        let mine = ResourceKey::device("plant", "t1");
        assert_eq!(
            publish(&me, &topics::report("edge-1", &mine), false),
            Ok(())
        );
        assert_eq!(publish(&me, &topics::event("edge-1", &mine), false), Ok(()));
        assert_eq!(
            publish(&me, &topics::report("edge-1", &mine), true),
            Err(Refusal::Retained)
        );
        for topic in [
            topics::desired("edge-1", &mine),
            topics::event_ack("edge-1", &mine),
            topics::report("edge-1", &other),
            topics::report("edge-2", &mine),
            "edgefleet/edge-1/plant/+/report".to_owned(),
            "anything".to_owned(),
        ] {
            assert_eq!(
                publish(&me, &topic, false),
                Err(Refusal::PublishNotAllowed(topic.clone()))
            );
        }
    }

    #[test]
    fn a_device_subscribes_only_to_its_own_desired_state_and_acks() {
        let me = t1();
        let mine = ResourceKey::device("plant", "t1");
        let other = ResourceKey::device("plant", "t2");
        assert_eq!(subscribe(&me, &topics::desired("edge-1", &mine)), Ok(()));
        assert_eq!(subscribe(&me, &topics::event_ack("edge-1", &mine)), Ok(()));
        for filter in [
            topics::desired("edge-1", &other),
            topics::report("edge-1", &mine),
            "edgefleet/edge-1/plant/+/desired".to_owned(),
            "edgefleet/#".to_owned(),
            "#".to_owned(),
        ] {
            assert_eq!(
                subscribe(&me, &filter),
                Err(Refusal::SubscribeNotAllowed(filter.clone()))
            );
        }
    }

    #[test]
    fn a_will_must_be_a_publish_the_device_may_make() {
        let login = Login::new("t1@plant", String::from_utf8_lossy(KEY));
        let mine = ResourceKey::device("plant", "t1");
        let will =
            |topic: String, retain| LastWill::new(topic, "gone", rumqttc::QoS::AtLeastOnce, retain);
        let judge =
            |w: &LastWill| super::login("edge-1", "t1@plant", Some(&login), Some(w), key_of);
        assert!(judge(&will(topics::event("edge-1", &mine), false)).is_ok());
        assert_eq!(
            judge(&will(topics::desired("edge-1", &mine), true)),
            Err(Refusal::PublishNotAllowed(topics::desired("edge-1", &mine)))
        );
        assert_eq!(
            judge(&will(topics::report("edge-1", &mine), true)),
            Err(Refusal::Retained)
        );
    }
}
