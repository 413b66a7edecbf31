//! The embedded site broker (rumqttd) and who it lets in.
//!
//! rumqttd 0.20 can check a login, but has no hook for what a client may
//! publish or subscribe to. So with device authentication on, the broker
//! listens on loopback and takes two kinds of login only: the agent's own
//! (its client id and a secret made at start) and the guard's (a second
//! secret). Devices reach it through the guard ([`super::guard`]), which
//! checks each device's key and every packet against [`super::acl`] and
//! logs the device in with the guard's secret.

use std::collections::HashMap;
use std::net::SocketAddr;

use edgefleet_shared::credential::Psk;

/// The agent's client id on the site broker.
pub fn agent_client_id(node: &str) -> String {
    format!("edgefleet-agent-{node}")
}

/// The agent's user name on the embedded broker.
pub const AGENT_USER: &str = "edgefleet-agent";

/// The secrets the embedded broker takes, made afresh at each start.
#[derive(Clone, Debug)]
pub struct BrokerSecrets {
    agent_client_id: String,
    agent: Psk,
    guard: Psk,
}

impl BrokerSecrets {
    /// New random secrets for the agent of `node`.
    pub fn new(node: &str) -> Self {
        BrokerSecrets {
            agent_client_id: agent_client_id(node),
            agent: fresh_secret(),
            guard: fresh_secret(),
        }
    }

    /// The agent's login.
    pub fn agent_login(&self) -> (String, String) {
        (AGENT_USER.to_owned(), text(&self.agent))
    }

    /// The password the guard logs devices in with.
    pub fn guard_password(&self) -> String {
        text(&self.guard)
    }

    /// Whether the broker lets `client_id` in with `password`: the agent
    /// under its own client id, anyone else only through the guard.
    pub fn allows(&self, client_id: &str, password: &str) -> bool {
        let password = password.as_bytes();
        match client_id == self.agent_client_id {
            true => self.agent.matches(password),
            false => self.guard.matches(password),
        }
    }
}

/// A random secret made at start: the agent's password on a broker.
pub(super) fn fresh_secret() -> Psk {
    Psk::new(format!("{:032x}", rand::random::<u128>()).into_bytes())
        .expect("32 hex digits are a key")
}

/// A secret as the password text it is (keys are printable ASCII).
pub(super) fn text(psk: &Psk) -> String {
    String::from_utf8(psk.as_bytes().to_vec()).expect("keys are ASCII")
}

/// Starts an embedded rumqttd broker listening on `listen` (MQTT 3.1.1), in
/// threads of its own. With `secrets`, it takes only the agent and the
/// guard's connections; without, anyone (`--insecure-mqtt-anonymous-devices`).
pub fn start_embedded_broker(
    listen: SocketAddr,
    secrets: Option<BrokerSecrets>,
) -> std::io::Result<()> {
    let mut settings = rumqttd::ServerSettings {
        name: "edgefleet-site".into(),
        listen,
        tls: None,
        next_connection_delay_ms: 1,
        connections: rumqttd::ConnectionSettings {
            connection_timeout_ms: 60_000,
            max_payload_size: super::BROKER_MAX_PAYLOAD,
            max_inflight_count: 500,
            auth: None,
            external_auth: None,
            dynamic_filters: true,
        },
    };
    if let Some(secrets) = secrets {
        settings
            .connections
            .set_auth_handler(move |client_id, _user, password| {
                let allowed = secrets.allows(&client_id, &password);
                async move { allowed }
            });
    }
    let config = rumqttd::Config {
        id: 0,
        router: rumqttd::RouterConfig {
            max_connections: 10_010,
            max_outgoing_packet_count: 200,
            // The router keeps messages in a log per topic filter until
            // subscribers have them; small segments bound the broker's
            // memory on an edge box (the default would allow 1 GiB).
            max_segment_size: 1024 * 1024,
            max_segment_count: 4,
            custom_segment: None,
            initialized_filters: None,
            shared_subscriptions_strategy: Default::default(),
        },
        v4: Some(HashMap::from([("site".to_owned(), settings)])),
        v5: None,
        ws: None,
        cluster: None,
        console: None,
        bridge: None,
        prometheus: None,
        metrics: None,
    };
    // Fail now, with the address in the error, if the port is taken.
    drop(std::net::TcpListener::bind(listen)?);
    std::thread::Builder::new()
        .name("mqtt-broker".into())
        .spawn(move || {
            if let Err(error) = rumqttd::Broker::new(config).start() {
                tracing::error!(%error, "embedded MQTT broker stopped");
            }
        })?;
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn only_the_agent_uses_its_client_id_and_everyone_else_needs_the_guards_secret() {
        let secrets = BrokerSecrets::new("edge-1");
        let (_, agent) = secrets.agent_login();
        let guard = secrets.guard_password();
        assert_ne!(agent, guard);
        assert!(secrets.allows("edgefleet-agent-edge-1", &agent));
        assert!(!secrets.allows("edgefleet-agent-edge-1", &guard));
        assert!(secrets.allows("plant/t1", &guard));
        assert!(!secrets.allows("plant/t1", &agent));
        assert!(!secrets.allows("plant/t1", ""));
        assert_ne!(BrokerSecrets::new("edge-1").guard_password(), guard);
    }
}
