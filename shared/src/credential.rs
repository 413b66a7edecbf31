//! Device credentials: one pre-shared key per device, kept in a Kubernetes
//! Secret of type [`SECRET_TYPE`] labelled [`DEVICE_LABEL`]`=<device name>`
//! in the Device's namespace, under the data key [`PSK_KEY`].
//!
//! The controller sends each key only to the agent of the device's node,
//! over the authenticated sync link (as a resource of its own, so rotating
//! the Secret reaches the agent without a new Device generation), and takes
//! it back when the Secret goes: that is revocation. The same key is the
//! device's DTLS pre-shared key (CoAP) and its MQTT password, so it is
//! printable ASCII — what `coap-client -k` and `mosquitto_pub -P` take.

use std::fmt;

use subtle::ConstantTimeEq;

use crate::{ResourceKey, ResourceVersion};

/// The type of a Secret that holds a device's key.
pub const SECRET_TYPE: &str = "edgefleet.io/device-psk";
/// The label that names the Device (in the Secret's namespace) a key is for.
pub const DEVICE_LABEL: &str = "edgefleet.io/device";
/// The data key of the key in the Secret.
pub const PSK_KEY: &str = "psk";
/// The shortest key taken (bytes): 128 bits of printable characters.
pub const MIN_PSK_BYTES: usize = 16;
/// The longest key taken (bytes), as DTLS PSK implementations allow.
pub const MAX_PSK_BYTES: usize = 64;

/// A device's pre-shared key. Its `Debug` never shows it.
#[derive(Clone, PartialEq, Eq)]
pub struct Psk(Vec<u8>);

/// Why a key is not taken.
#[derive(Debug, thiserror::Error, PartialEq, Eq)]
pub enum PskError {
    /// Too short or too long.
    #[error("the key is {0} bytes; it must be {MIN_PSK_BYTES} to {MAX_PSK_BYTES}")]
    Length(usize),
    /// Not printable ASCII.
    #[error("the key must be printable ASCII without spaces (byte {0} is not)")]
    NotPrintable(usize),
}

impl Psk {
    /// `bytes` as a key, if it is one.
    pub fn new(bytes: Vec<u8>) -> Result<Psk, PskError> {
        if !(MIN_PSK_BYTES..=MAX_PSK_BYTES).contains(&bytes.len()) {
            return Err(PskError::Length(bytes.len()));
        }
        if let Some(at) = bytes.iter().position(|b| !b.is_ascii_graphic()) {
            return Err(PskError::NotPrintable(at));
        }
        Ok(Psk(bytes))
    }

    /// The key's bytes.
    pub fn as_bytes(&self) -> &[u8] {
        &self.0
    }

    /// Whether `candidate` is this key, in time that does not depend on
    /// where they differ.
    pub fn matches(&self, candidate: &[u8]) -> bool {
        self.0.ct_eq(candidate).into()
    }

    /// The second half of the key's resource version: the first 63 bits of
    /// SHA-256 over the key, so a rotated key is a new version. (Only the
    /// cloud and the agent see versions; a digest of a 128-bit random key
    /// gives nothing away.)
    pub fn digest(&self) -> i64 {
        ResourceVersion::content_digest(&self.0)
    }
}

impl fmt::Debug for Psk {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "Psk(<{} bytes>)", self.0.len())
    }
}

/// The version of the credential held in Secret `secret_uid` as `psk`.
pub fn version(secret_uid: &str, psk: &Psk) -> ResourceVersion {
    ResourceVersion::new(secret_uid, psk.digest())
}

/// The login name of `device`, `<name>@<namespace>`: its MQTT user name
/// and client id, and its DTLS PSK identity. Neither part of it may hold an
/// `@`, so the split is unambiguous. Not `/`, which some brokers (rumqttd)
/// refuse in client ids, nor `:`, which Mosquitto's password file cannot
/// hold in a user name.
pub fn login_name(device: &ResourceKey) -> String {
    format!("{}@{}", device.name, device.namespace)
}

/// The Device a login names, from its login name `<name>@<namespace>`:
/// both parts Kubernetes names (lowercase letters, digits, `-` and `.`).
pub fn device_of_login(login: &str) -> Option<ResourceKey> {
    let (name, namespace) = login.split_once('@')?;
    let label = |s: &str| {
        !s.is_empty()
            && s.len() <= 253
            && s.bytes()
                .all(|b| b.is_ascii_lowercase() || b.is_ascii_digit() || b == b'-' || b == b'.')
    };
    (label(namespace) && label(name)).then(|| ResourceKey::device(namespace, name))
}

/// The key of the credential of the Device `device` (a device key).
pub fn key_of(device: &ResourceKey) -> ResourceKey {
    ResourceKey::credential(&device.namespace, &device.name)
}

impl fmt::Debug for crate::proto::DeviceCredential {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("DeviceCredential")
            .field("namespace", &self.namespace)
            .field("device", &self.device)
            .field("psk", &format_args!("<{} bytes>", self.psk.len()))
            .finish()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn keys_are_printable_and_of_a_dtls_length() {
        assert!(Psk::new(b"0123456789abcdef".to_vec()).is_ok());
        assert_eq!(Psk::new(b"short".to_vec()), Err(PskError::Length(5)));
        assert_eq!(Psk::new(vec![b'a'; 65]), Err(PskError::Length(65)));
        assert_eq!(
            Psk::new(b"0123456789abcde\n".to_vec()),
            Err(PskError::NotPrintable(15))
        );
        assert_eq!(
            Psk::new(b"0123456789 abcdef".to_vec()),
            Err(PskError::NotPrintable(10))
        );
    }

    #[test]
    fn a_key_never_shows_in_debug_and_matches_only_itself() {
        let psk = Psk::new(b"s3cret-s3cret-s3cret".to_vec()).unwrap();
        assert_eq!(format!("{psk:?}"), "Psk(<20 bytes>)");
        let wire = crate::proto::DeviceCredential {
            namespace: "plant".into(),
            device: "t1".into(),
            psk: psk.as_bytes().to_vec(),
        };
        assert!(!format!("{wire:?}").contains("s3cret"), "{wire:?}");
        assert!(psk.matches(b"s3cret-s3cret-s3cret"));
        assert!(!psk.matches(b"s3cret-s3cret-s3creT"));
        assert!(!psk.matches(b"s3cret-s3cret-s3cret-"));
        assert!(!psk.matches(b""));
    }

    #[test]
    fn a_rotated_key_is_a_new_version() {
        let a = Psk::new(b"aaaaaaaaaaaaaaaa".to_vec()).unwrap();
        let b = Psk::new(b"aaaaaaaaaaaaaaab".to_vec()).unwrap();
        assert_eq!(version("u", &a), version("u", &a.clone()));
        assert_ne!(version("u", &a), version("u", &b));
        assert_ne!(version("u", &a), version("v", &a));
    }
}
