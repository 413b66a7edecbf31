//! The simulated devices' keys, derived from one fleet key.
//!
//! `edgefleet-sim devices` prints each device's key in a Secret and
//! `edgefleet-sim run` derives the same key to log in with, so the two
//! agree without a key file between them, as long as both get the same
//! `--fleet-key`. Whoever knows the fleet key knows every device's key:
//! right for a simulated fleet, wrong for a real one, whose keys should be
//! random and each kept only in its Secret and on its device.

use std::fmt;

use edgefleet_shared::ResourceKey;
use edgefleet_shared::credential::Psk;
use sha2::{Digest, Sha256};

/// The fleet key when none is given: fine for a lab on one machine.
pub const LAB_FLEET_KEY: &str = "edgefleet-sim-lab";

/// The secret every simulated device's key is derived from. Its `Debug`
/// does not show it.
#[derive(Clone, PartialEq, Eq)]
pub struct FleetKey(pub String);

impl fmt::Debug for FleetKey {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str("FleetKey(<hidden>)")
    }
}

/// The key of `device`: the first 128 bits of SHA-256 over the fleet key,
/// the namespace and the name (each ended by a 0 byte), as 32 hex digits.
pub fn device_key(fleet_key: &FleetKey, device: &ResourceKey) -> Psk {
    let mut hash = Sha256::new();
    for part in [&fleet_key.0, &device.namespace, &device.name] {
        hash.update(part.as_bytes());
        hash.update([0]);
    }
    let hex: String = hash.finalize()[..16]
        .iter()
        .map(|b| format!("{b:02x}"))
        .collect();
    Psk::new(hex.into_bytes()).expect("32 hex digits are a valid key")
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn keys_differ_by_device_namespace_and_fleet_key_and_are_stable() {
        let a = ResourceKey::device("plant", "dev-00001");
        let fleet = |k: &str| FleetKey(k.to_owned());
        let key = device_key(&fleet("k"), &a);
        assert_eq!(key.as_bytes().len(), 32);
        assert!(key.as_bytes().iter().all(u8::is_ascii_hexdigit));
        assert_eq!(key, device_key(&fleet("k"), &a));
        for other in [
            device_key(&fleet("k"), &ResourceKey::device("plant", "dev-00002")),
            device_key(&fleet("k"), &ResourceKey::device("plant2", "dev-00001")),
            device_key(&fleet("k2"), &a),
            // The separators keep the parts apart.
            device_key(&fleet("k"), &ResourceKey::device("plantd", "ev-00001")),
        ] {
            assert_ne!(other, key);
        }
        assert_eq!(format!("{:?}", fleet("k")), "FleetKey(<hidden>)");
    }
}
