//! What a simulation run needs to know, and the parsers for the command-line
//! forms of its values.

use std::path::PathBuf;
use std::str::FromStr;
use std::time::Duration;

use crate::fleet::FleetSpec;
use crate::retransmit::RetransmitParams;

/// Everything [`crate::run`] needs.
#[derive(Clone, Debug)]
pub struct RunConfig {
    /// The fleet; its node names must each have an endpoint.
    pub fleet: FleetSpec,
    /// The namespace of every Device.
    pub namespace: String,
    /// Where each node's agent and broker are.
    pub endpoints: Vec<NodeEndpoint>,
    /// Each device's key (its MQTT password) is derived from this; see
    /// [`crate::keys`].
    pub fleet_key: crate::keys::FleetKey,
    /// Plain CoAP, one socket per node, for agents started with
    /// `--insecure-coap-plain`; otherwise each CoAP device has its own
    /// socket and DTLS session, with its key.
    pub insecure_coap_plain: bool,
    /// Seeds every device's randomness.
    pub seed: u64,
    /// How often each device reports when nothing happens.
    pub report_interval: Duration,
    /// How often to print the summary line to stderr (`None`: only at the end).
    pub summary_interval: Option<Duration>,
    /// Where to append a JSON line per applied desired state.
    pub applied_log: Option<PathBuf>,
    /// Where to write, at exit, each device's last report the agent
    /// acknowledged (one JSON line per device).
    pub final_state: Option<PathBuf>,
    /// CoAP retransmission parameters.
    pub retransmit: RetransmitParams,
    /// Each device raises a `SelfCheck` event every this many reports (0:
    /// only update results).
    pub event_every: u32,
    /// The percentage of devices whose readings drift (those with `index %
    /// 100` below it); the others report the same values until a desired
    /// state changes them.
    pub changing_percent: u8,
    /// Install times, failures and bad versions.
    pub firmware: std::sync::Arc<crate::firmware::FirmwareBehaviour>,
}

/// Where a node's agent serves CoAP and its MQTT broker listens, written
/// `NAME=COAP_HOST:PORT,MQTT_HOST:PORT`.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct NodeEndpoint {
    /// The node name.
    pub name: String,
    /// The agent's CoAP address (`host:port`; resolved when the run starts).
    pub coap: String,
    /// The MQTT broker's host.
    pub mqtt_host: String,
    /// The MQTT broker's port.
    pub mqtt_port: u16,
}

/// A malformed command-line value.
#[derive(Debug, thiserror::Error, PartialEq, Eq)]
#[error("{0}")]
pub struct ParseError(pub(crate) String);

impl FromStr for NodeEndpoint {
    type Err = ParseError;

    fn from_str(s: &str) -> Result<Self, Self::Err> {
        let bad = |why: &str| {
            ParseError(format!(
                "{s:?}: {why}; expected NAME=COAP_HOST:PORT,MQTT_HOST:PORT"
            ))
        };
        let (name, addrs) = s.split_once('=').ok_or_else(|| bad("no '='"))?;
        let (coap, mqtt) = addrs.split_once(',').ok_or_else(|| bad("no ','"))?;
        if name.is_empty() {
            return Err(bad("empty node name"));
        }
        split_host_port(coap).ok_or_else(|| bad("bad CoAP address"))?;
        let (mqtt_host, mqtt_port) =
            split_host_port(mqtt).ok_or_else(|| bad("bad MQTT address"))?;
        Ok(NodeEndpoint {
            name: name.to_owned(),
            coap: coap.to_owned(),
            mqtt_host: mqtt_host.to_owned(),
            mqtt_port,
        })
    }
}

/// Splits `host:port` (`[v6]:port` too), the brackets dropped.
fn split_host_port(s: &str) -> Option<(&str, u16)> {
    let (host, port) = s.rsplit_once(':')?;
    let host = host
        .strip_prefix('[')
        .and_then(|h| h.strip_suffix(']'))
        .unwrap_or(host);
    let port = port.parse().ok()?;
    (!host.is_empty()).then_some((host, port))
}

/// The node name of a `--node` value for the `devices` subcommand: `NAME`,
/// or the name part of `NAME=...` so one `EDGEFLEET_SIM_NODE` serves both
/// subcommands.
pub fn node_name(s: &str) -> Result<String, ParseError> {
    let name = s.split_once('=').map_or(s, |(name, _)| name);
    if name.is_empty() {
        Err(ParseError(format!("{s:?}: empty node name")))
    } else {
        Ok(name.to_owned())
    }
}

/// Parses a duration like `10s`, `250ms`, `1.5s`, `2m` or `1h`; a bare
/// number is seconds.
pub fn parse_duration(s: &str) -> Result<Duration, ParseError> {
    let bad = || ParseError(format!("{s:?} is not a duration like 10s, 250ms, 2m or 1h"));
    let s = s.trim();
    let split = s
        .find(|c: char| !(c.is_ascii_digit() || c == '.'))
        .unwrap_or(s.len());
    let (number, unit) = s.split_at(split);
    let number: f64 = number.parse().map_err(|_| bad())?;
    let seconds = match unit.trim() {
        "ms" => number / 1000.0,
        "" | "s" => number,
        "m" | "min" => number * 60.0,
        "h" => number * 3600.0,
        _ => return Err(bad()),
    };
    Duration::try_from_secs_f64(seconds).map_err(|_| bad())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn node_endpoints_parse() {
        let e: NodeEndpoint = "edge-1=127.0.0.1:5683,127.0.0.1:1883".parse().unwrap();
        assert_eq!(
            e,
            NodeEndpoint {
                name: "edge-1".into(),
                coap: "127.0.0.1:5683".into(),
                mqtt_host: "127.0.0.1".into(),
                mqtt_port: 1883,
            }
        );
        let e: NodeEndpoint = "n=agent.local:5683,[::1]:1884".parse().unwrap();
        assert_eq!(
            (e.coap.as_str(), e.mqtt_host.as_str(), e.mqtt_port),
            ("agent.local:5683", "::1", 1884)
        );
    }

    #[test]
    fn malformed_node_endpoints_are_refused() {
        for bad in [
            "edge-1",
            "edge-1=127.0.0.1:5683",
            "=127.0.0.1:5683,127.0.0.1:1883",
            "edge-1=127.0.0.1,127.0.0.1:1883",
            "edge-1=127.0.0.1:5683,127.0.0.1:mqtt",
            "edge-1=127.0.0.1:5683,:1883",
        ] {
            assert!(bad.parse::<NodeEndpoint>().is_err(), "{bad}");
        }
    }

    #[test]
    fn node_names_accept_both_forms() {
        assert_eq!(node_name("edge-1").unwrap(), "edge-1");
        assert_eq!(
            node_name("edge-1=127.0.0.1:5683,127.0.0.1:1883").unwrap(),
            "edge-1"
        );
        assert!(node_name("=x").is_err());
    }

    #[test]
    fn durations_parse() {
        let ms = Duration::from_millis;
        assert_eq!(parse_duration("10s").unwrap(), ms(10_000));
        assert_eq!(parse_duration("250ms").unwrap(), ms(250));
        assert_eq!(parse_duration("1.5s").unwrap(), ms(1500));
        assert_eq!(parse_duration("2m").unwrap(), ms(120_000));
        assert_eq!(parse_duration("1h").unwrap(), ms(3_600_000));
        assert_eq!(parse_duration("3").unwrap(), ms(3000));
        for bad in ["", "s", "10x", "-1s", "1.2.3s", "ten"] {
            assert!(parse_duration(bad).is_err(), "{bad}");
        }
    }
}
