//! The device wire format: CBOR messages between devices and their agent.
//!
//! Everything a device sends or receives goes through [`encode`] and
//! [`decode`], so the size limit, the error types and the CBOR library sit in
//! this one module. Field names are short because they cross constrained
//! links on every report.

use std::collections::BTreeMap;

use serde::{Deserialize, Serialize, de::DeserializeOwned};

use crate::property::PropertyValue;

/// The default limit for one message: a report must fit one CoAP datagram
/// without block-wise transfer on a 1280-byte IPv6 MTU.
pub const MAX_MESSAGE_BYTES: usize = 1024;

/// The most properties one message may carry.
pub const MAX_PROPERTIES: usize = 64;

/// The longest property name, in bytes.
pub const MAX_PROPERTY_NAME: usize = 63;

/// Device → agent: the device's current state.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct DeviceReport {
    /// The generation of the desired state the device last applied (0: none yet).
    #[serde(rename = "g")]
    pub applied_generation: i64,
    /// The device's properties as it sees them now.
    #[serde(rename = "p", default)]
    pub properties: BTreeMap<String, PropertyValue>,
    /// The firmware the device runs.
    #[serde(rename = "fw", default, skip_serializing_if = "Option::is_none")]
    pub firmware_version: Option<String>,
    /// The firmware of the applied desired state did not install: the
    /// device runs `firmware_version` still and does not retry. Like the
    /// Update Result of LwM2M's Firmware Update object, it stays in the
    /// device's reports until another order.
    #[serde(rename = "ff", default, skip_serializing_if = "Option::is_none")]
    pub firmware_failure: Option<FirmwareFailure>,
}

/// A firmware install that failed.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct FirmwareFailure {
    /// The version that did not install.
    #[serde(rename = "v")]
    pub version: String,
    /// Why, for people.
    #[serde(rename = "r")]
    pub reason: String,
}

/// The longest firmware failure reason, in bytes.
pub const MAX_FAILURE_REASON: usize = 256;

/// Agent → device: what the device should look like.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct DesiredState {
    /// The Device's `metadata.generation` this state comes from; the device
    /// echoes it in its next report once applied.
    #[serde(rename = "g")]
    pub generation: i64,
    /// Desired property values.
    #[serde(rename = "p", default)]
    pub properties: BTreeMap<String, PropertyValue>,
    /// The firmware the device should run, if the Device asks for one.
    #[serde(rename = "fw", default, skip_serializing_if = "Option::is_none")]
    pub firmware: Option<FirmwareOrder>,
    /// The agent's revision of its local overrides (EdgeRules acting at
    /// the edge) on top of `generation`; 0 (absent) when none ever
    /// applied. A device applies any (generation, local) pair other than
    /// the one it applied last.
    #[serde(rename = "l", default, skip_serializing_if = "is_zero")]
    pub local: u64,
}

/// Which firmware to run and where to get it.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct FirmwareOrder {
    /// Semantic version of the image.
    #[serde(rename = "v")]
    pub version: String,
    /// Where the image can be downloaded.
    #[serde(rename = "u", default, skip_serializing_if = "Option::is_none")]
    pub url: Option<String>,
    /// SHA-256 of the image, lowercase hex.
    #[serde(rename = "h", default, skip_serializing_if = "Option::is_none")]
    pub sha256: Option<String>,
}

/// The longest event reason, in bytes (a Kubernetes Event's reason is short).
pub const MAX_EVENT_REASON: usize = 64;

/// The longest event message, in bytes.
pub const MAX_EVENT_MESSAGE: usize = 512;

/// Device → agent: something that happened on the device (an update result,
/// a fault). Unlike reports, events are never compacted: each one reaches the
/// cloud once, in order.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct DeviceEvent {
    /// Assigned by the device, strictly increasing per device and boot,
    /// starting at 1. The agent keeps the highest it stored per boot, so a
    /// resend of an event it already holds is acknowledged and not stored
    /// twice. That needs the device to send its events in order: the
    /// oldest it has not seen acknowledged, again until it is, and a later
    /// one only after that (a later id stored first would make the agent
    /// take the earlier one for a resend).
    #[serde(rename = "id")]
    pub id: u64,
    /// The device's boot epoch: a number the device picks at every boot
    /// that differs from its earlier boots' (a random 64-bit number, or a
    /// counter kept in persistent memory). A device that loses its event
    /// counter (a reboot without persistent memory, replaced hardware)
    /// starts its ids from 1 again under a new epoch, and the agent takes
    /// them as new events instead of resends. 0 (absent) for a device that
    /// keeps its counter for good.
    #[serde(rename = "b", default, skip_serializing_if = "is_zero")]
    pub boot: u64,
    /// A warning rather than a normal event.
    #[serde(rename = "w", default)]
    pub warning: bool,
    /// A machine-readable reason in CamelCase, like `FirmwareInstalled`.
    #[serde(rename = "r")]
    pub reason: String,
    /// A sentence for people.
    #[serde(rename = "m", default)]
    pub message: String,
}

/// Agent → device (MQTT): every event of the device up to `id` is stored.
/// Over CoAP the response to the POST says the same.
#[derive(Clone, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct EventAck {
    /// The highest event id the agent holds for the device in `boot`.
    #[serde(rename = "id")]
    pub id: u64,
    /// The boot epoch of the event acknowledged.
    #[serde(rename = "b", default, skip_serializing_if = "is_zero")]
    pub boot: u64,
}

fn is_zero(n: &u64) -> bool {
    *n == 0
}

/// Agent → device: a one-off order (reboot, identify, …).
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct Command {
    /// Identifies the command so the device can de-duplicate a resend.
    #[serde(rename = "id")]
    pub id: u64,
    /// What to do.
    #[serde(rename = "n")]
    pub name: String,
    /// Arguments.
    #[serde(rename = "a", default)]
    pub args: BTreeMap<String, PropertyValue>,
}

/// Why a message was refused. Each variant maps to a distinct refusal code on
/// the device protocols and a distinct label on the refusal counters.
#[derive(Debug, thiserror::Error)]
pub enum CodecError {
    /// The message is larger than the limit; it was not parsed.
    #[error("message of {size} bytes is over the {limit}-byte limit")]
    TooLarge {
        /// Size of the message.
        size: usize,
        /// The limit in force.
        limit: usize,
    },
    /// The message ends in the middle of a CBOR item.
    #[error("message is truncated: CBOR ends early at byte {offset}")]
    Truncated {
        /// Where the input ran out.
        offset: usize,
    },
    /// The bytes are not CBOR, or not the CBOR of this message type.
    #[error("malformed message: {0}")]
    Malformed(String),
    /// Well-formed CBOR whose content breaks a rule of the format.
    #[error("invalid message: {0}")]
    Invalid(String),
}

impl CodecError {
    /// A short, stable label for metrics.
    pub fn metric_label(&self) -> &'static str {
        match self {
            CodecError::TooLarge { .. } => "too_large",
            CodecError::Truncated { .. } => "truncated",
            CodecError::Malformed(_) => "malformed",
            CodecError::Invalid(_) => "invalid",
        }
    }
}

/// A message of the device wire format.
pub trait WireMessage: Serialize + DeserializeOwned {
    /// Checks the rules that types alone cannot express.
    fn validate(&self) -> Result<(), CodecError>;
}

impl WireMessage for DeviceReport {
    fn validate(&self) -> Result<(), CodecError> {
        if self.applied_generation < 0 {
            return Err(CodecError::Invalid(format!(
                "applied generation {} is negative",
                self.applied_generation
            )));
        }
        if let Some(f) = &self.firmware_failure
            && (f.version.is_empty() || f.version.len() > 64 || f.reason.len() > MAX_FAILURE_REASON)
        {
            return Err(CodecError::Invalid(format!(
                "firmware failure: a version of 1 to 64 bytes and a reason of at most {MAX_FAILURE_REASON} bytes"
            )));
        }
        validate_properties(&self.properties)
    }
}

impl WireMessage for DesiredState {
    fn validate(&self) -> Result<(), CodecError> {
        if self.generation < 1 {
            return Err(CodecError::Invalid(format!(
                "generation {} is not positive",
                self.generation
            )));
        }
        validate_properties(&self.properties)
    }
}

impl WireMessage for Command {
    fn validate(&self) -> Result<(), CodecError> {
        if self.name.is_empty() {
            return Err(CodecError::Invalid("command name is empty".into()));
        }
        validate_properties(&self.args)
    }
}

impl WireMessage for DeviceEvent {
    fn validate(&self) -> Result<(), CodecError> {
        if self.id == 0 {
            return Err(CodecError::Invalid("event id 0; ids start at 1".into()));
        }
        let camel = self.reason.len() <= MAX_EVENT_REASON
            && self.reason.starts_with(|c: char| c.is_ascii_uppercase())
            && self.reason.bytes().all(|b| b.is_ascii_alphanumeric());
        if !camel {
            return Err(CodecError::Invalid(format!(
                "event reason {:?} must be CamelCase ASCII of at most {MAX_EVENT_REASON} bytes",
                self.reason
            )));
        }
        if self.message.len() > MAX_EVENT_MESSAGE {
            return Err(CodecError::Invalid(format!(
                "event message of {} bytes, at most {MAX_EVENT_MESSAGE} allowed",
                self.message.len()
            )));
        }
        Ok(())
    }
}

impl WireMessage for EventAck {
    fn validate(&self) -> Result<(), CodecError> {
        Ok(())
    }
}

fn validate_properties(props: &BTreeMap<String, PropertyValue>) -> Result<(), CodecError> {
    if props.len() > MAX_PROPERTIES {
        return Err(CodecError::Invalid(format!(
            "{} properties, at most {MAX_PROPERTIES} allowed",
            props.len()
        )));
    }
    match props
        .keys()
        .find(|k| k.is_empty() || k.len() > MAX_PROPERTY_NAME)
    {
        Some(k) => Err(CodecError::Invalid(format!(
            "property name {k:?} must be 1 to {MAX_PROPERTY_NAME} bytes"
        ))),
        None => Ok(()),
    }
}

/// Encodes a message, refusing one that would exceed [`MAX_MESSAGE_BYTES`].
pub fn encode<T: WireMessage>(msg: &T) -> Result<Vec<u8>, CodecError> {
    encode_with_limit(msg, MAX_MESSAGE_BYTES)
}

/// Encodes a message, refusing one over `limit` bytes.
pub fn encode_with_limit<T: WireMessage>(msg: &T, limit: usize) -> Result<Vec<u8>, CodecError> {
    msg.validate()?;
    let bytes = serde_cbor::to_vec(msg).map_err(|e| CodecError::Malformed(e.to_string()))?;
    check_size(bytes.len(), limit)?;
    Ok(bytes)
}

/// Decodes a message of at most [`MAX_MESSAGE_BYTES`].
pub fn decode<T: WireMessage>(bytes: &[u8]) -> Result<T, CodecError> {
    decode_with_limit(bytes, MAX_MESSAGE_BYTES)
}

/// Decodes a message of at most `limit` bytes. The size is checked before any
/// parsing, so an oversized message costs nothing but its length.
pub fn decode_with_limit<T: WireMessage>(bytes: &[u8], limit: usize) -> Result<T, CodecError> {
    check_size(bytes.len(), limit)?;
    let msg: T = serde_cbor::from_slice(bytes).map_err(|e| {
        if e.is_eof() {
            CodecError::Truncated {
                offset: e.offset() as usize,
            }
        } else {
            CodecError::Malformed(e.to_string())
        }
    })?;
    msg.validate()?;
    Ok(msg)
}

fn check_size(size: usize, limit: usize) -> Result<(), CodecError> {
    if size > limit {
        Err(CodecError::TooLarge { size, limit })
    } else {
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    fn thermostat_report() -> DeviceReport {
        DeviceReport {
            applied_generation: 4,
            properties: BTreeMap::from([
                ("fan".to_owned(), PropertyValue::Bool(true)),
                ("mode".to_owned(), PropertyValue::String("auto".into())),
                ("rpm".to_owned(), PropertyValue::Int(1200)),
                ("temperature".to_owned(), PropertyValue::Float(21.25)),
            ]),
            firmware_version: Some("1.4.2".into()),
            firmware_failure: None,
        }
    }

    #[test]
    fn report_round_trips() {
        let report = thermostat_report();
        let bytes = encode(&report).unwrap();
        assert_eq!(decode::<DeviceReport>(&bytes).unwrap(), report);
    }

    #[test]
    fn desired_state_and_command_round_trip() {
        let desired = DesiredState {
            generation: 3,
            properties: BTreeMap::from([("setpoint".to_owned(), PropertyValue::Float(19.5))]),
            firmware: Some(FirmwareOrder {
                version: "2.0.0".into(),
                url: Some("https://fw.example/t-2.0.0.bin".into()),
                sha256: Some("ab".repeat(32)),
            }),
            local: 2,
        };
        assert_eq!(
            decode::<DesiredState>(&encode(&desired).unwrap()).unwrap(),
            desired
        );
        let cmd = Command {
            id: 9,
            name: "reboot".into(),
            args: BTreeMap::new(),
        };
        assert_eq!(decode::<Command>(&encode(&cmd).unwrap()).unwrap(), cmd);
    }

    #[test]
    fn events_round_trip_and_break_no_rule() {
        let event = DeviceEvent {
            id: 7,
            boot: 0,
            warning: true,
            reason: "FirmwareFailed".into(),
            message: "checksum mismatch".into(),
        };
        assert_eq!(
            decode::<DeviceEvent>(&encode(&event).unwrap()).unwrap(),
            event
        );
        let rebooted = DeviceEvent {
            boot: u64::MAX,
            ..event.clone()
        };
        assert_eq!(
            decode::<DeviceEvent>(&encode(&rebooted).unwrap()).unwrap(),
            rebooted
        );
        // A device without boot epochs sends none, and is read as boot 0.
        assert_eq!(
            encode(&event).unwrap().len() + 11,
            encode(&rebooted).unwrap().len()
        );
        for ack in [EventAck { id: 7, boot: 0 }, EventAck { id: 7, boot: 9 }] {
            assert_eq!(decode::<EventAck>(&encode(&ack).unwrap()).unwrap(), ack);
        }
        for bad in [
            DeviceEvent {
                id: 0,
                ..event.clone()
            },
            DeviceEvent {
                reason: String::new(),
                ..event.clone()
            },
            DeviceEvent {
                reason: "lowerCase".into(),
                ..event.clone()
            },
            DeviceEvent {
                reason: "Has Space".into(),
                ..event.clone()
            },
            DeviceEvent {
                reason: "A".repeat(MAX_EVENT_REASON + 1),
                ..event.clone()
            },
            DeviceEvent {
                message: "x".repeat(MAX_EVENT_MESSAGE + 1),
                ..event.clone()
            },
        ] {
            let bytes = serde_cbor::to_vec(&bad).unwrap();
            assert!(
                matches!(decode::<DeviceEvent>(&bytes), Err(CodecError::Invalid(_))),
                "{bad:?}"
            );
        }
    }

    #[test]
    fn every_truncation_is_refused_as_truncated() {
        let bytes = encode(&thermostat_report()).unwrap();
        for cut in 0..bytes.len() {
            match decode::<DeviceReport>(&bytes[..cut]) {
                Err(CodecError::Truncated { .. }) => {}
                other => panic!("cut at {cut}: expected Truncated, got {other:?}"),
            }
        }
    }

    #[test]
    fn trailing_garbage_is_refused() {
        let mut bytes = encode(&thermostat_report()).unwrap();
        bytes.push(0x00);
        assert!(matches!(
            decode::<DeviceReport>(&bytes),
            Err(CodecError::Malformed(_))
        ));
    }

    #[test]
    fn mistyped_fields_are_refused() {
        // {"g": "four"}: generation as a string.
        let bytes = serde_cbor::to_vec(&serde_cbor::Value::Map(BTreeMap::from([(
            serde_cbor::Value::Text("g".into()),
            serde_cbor::Value::Text("four".into()),
        )])))
        .unwrap();
        let err = decode::<DeviceReport>(&bytes).unwrap_err();
        assert!(matches!(err, CodecError::Malformed(_)), "{err:?}");

        // A property whose value is a nested map.
        let nested = serde_cbor::Value::Map(BTreeMap::from([
            (
                serde_cbor::Value::Text("g".into()),
                serde_cbor::Value::Integer(1),
            ),
            (
                serde_cbor::Value::Text("p".into()),
                serde_cbor::Value::Map(BTreeMap::from([(
                    serde_cbor::Value::Text("fan".into()),
                    serde_cbor::Value::Map(BTreeMap::new()),
                )])),
            ),
        ]));
        let err = decode::<DeviceReport>(&serde_cbor::to_vec(&nested).unwrap()).unwrap_err();
        assert!(matches!(err, CodecError::Malformed(_)), "{err:?}");
    }

    #[test]
    fn bytes_that_are_not_cbor_are_refused() {
        let err = decode::<DeviceReport>(&[0xff, 0xff, 0xff]).unwrap_err();
        assert_eq!(err.metric_label(), "malformed");
    }

    #[test]
    fn oversized_messages_are_refused_before_parsing() {
        let junk = vec![0xffu8; MAX_MESSAGE_BYTES + 1];
        match decode::<DeviceReport>(&junk) {
            Err(CodecError::TooLarge { size, limit }) => {
                assert_eq!((size, limit), (MAX_MESSAGE_BYTES + 1, MAX_MESSAGE_BYTES));
            }
            other => panic!("expected TooLarge, got {other:?}"),
        }
    }

    #[test]
    fn encoding_refuses_what_decoding_would_refuse() {
        let mut report = thermostat_report();
        report.properties.insert(
            "blob".into(),
            PropertyValue::String("x".repeat(MAX_MESSAGE_BYTES)),
        );
        assert!(matches!(encode(&report), Err(CodecError::TooLarge { .. })));

        let mut report = thermostat_report();
        report
            .properties
            .insert(String::new(), PropertyValue::Int(1));
        assert!(matches!(encode(&report), Err(CodecError::Invalid(_))));
    }

    #[test]
    fn content_rules_are_checked_on_decode() {
        let mut report = thermostat_report();
        report.applied_generation = -1;
        let bytes = serde_cbor::to_vec(&report).unwrap();
        assert_eq!(
            decode::<DeviceReport>(&bytes).unwrap_err().metric_label(),
            "invalid"
        );

        let too_many: BTreeMap<_, _> = (0..=MAX_PROPERTIES)
            .map(|i| (format!("p{i}"), PropertyValue::Bool(true)))
            .collect();
        let report = DeviceReport {
            applied_generation: 0,
            properties: too_many,
            firmware_version: None,
            firmware_failure: None,
        };
        let bytes = serde_cbor::to_vec(&report).unwrap();
        assert!(matches!(
            decode_with_limit::<DeviceReport>(&bytes, 1 << 20),
            Err(CodecError::Invalid(_))
        ));
    }

    fn property_value() -> impl Strategy<Value = PropertyValue> {
        prop_oneof![
            any::<bool>().prop_map(PropertyValue::Bool),
            any::<i64>().prop_map(PropertyValue::Int),
            // NaN never equals itself; every other float must survive.
            any::<f64>()
                .prop_filter("NaN", |f| !f.is_nan())
                .prop_map(PropertyValue::Float),
            "[ -~]{0,24}".prop_map(PropertyValue::String),
        ]
    }

    proptest! {
        #[test]
        fn any_valid_report_round_trips(
            generation in 0i64..i64::MAX,
            props in proptest::collection::btree_map("[a-z][a-z0-9_]{0,15}", property_value(), 0..12),
            fw in proptest::option::of("[0-9]{1,3}\\.[0-9]{1,3}\\.[0-9]{1,3}"),
        ) {
            let report = DeviceReport { applied_generation: generation, properties: props, firmware_version: fw, firmware_failure: None };
            let bytes = encode(&report).unwrap();
            prop_assert_eq!(decode::<DeviceReport>(&bytes).unwrap(), report);
        }

        #[test]
        fn arbitrary_bytes_never_panic_the_decoder(bytes in proptest::collection::vec(any::<u8>(), 0..256)) {
            // Refused or accepted, but always an answer.
            let _ = decode::<DeviceReport>(&bytes);
            let _ = decode::<DesiredState>(&bytes);
            let _ = decode::<Command>(&bytes);
        }
    }
}
