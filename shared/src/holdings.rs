//! A digest of what an agent holds, so a reconnecting agent's Hello can say
//! "I hold exactly what you last saw me acknowledge" in a few bytes instead
//! of listing every resource.
//!
//! The digest is a set hash: the wrapping sum of a 128-bit hash (the first 16
//! bytes of SHA-256) of every `(key, uid, generation)` held. A sum does not
//! depend on order, so the cloud's map and the agent's store, sorted
//! differently, agree; and it can be kept up to date one entry at a time.
//! The count travels with it. Both sides compute it with this one function,
//! so a cloud and an agent of the same protocol version always agree.

use sha2::{Digest, Sha256};

use crate::{ResourceKey, ResourceVersion};

/// The digest of a set of held resources.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct HoldingsDigest {
    sum: u128,
    count: u32,
}

impl HoldingsDigest {
    /// The digest of `held`.
    pub fn of<'a>(held: impl IntoIterator<Item = (&'a ResourceKey, &'a ResourceVersion)>) -> Self {
        let mut digest = HoldingsDigest::default();
        for (key, version) in held {
            digest.add(key, version);
        }
        digest
    }

    /// Adds one held resource.
    pub fn add(&mut self, key: &ResourceKey, version: &ResourceVersion) {
        self.sum = self.sum.wrapping_add(entry_hash(key, version));
        self.count += 1;
    }

    /// How many resources it covers.
    pub fn count(&self) -> u32 {
        self.count
    }

    /// The 16 bytes the Hello carries (the count travels separately).
    pub fn to_bytes(&self) -> Vec<u8> {
        self.sum.to_be_bytes().to_vec()
    }

    /// A digest from the Hello's bytes and count; `None` if the bytes are
    /// not 16 long.
    pub fn from_parts(bytes: &[u8], count: u32) -> Option<Self> {
        let sum = u128::from_be_bytes(bytes.try_into().ok()?);
        Some(HoldingsDigest { sum, count })
    }
}

fn entry_hash(key: &ResourceKey, version: &ResourceVersion) -> u128 {
    let mut hasher = Sha256::new();
    // Lengths first, so no two different entries feed the same bytes.
    for part in [key.to_string().as_bytes(), version.uid.as_bytes()] {
        hasher.update((part.len() as u64).to_be_bytes());
        hasher.update(part);
    }
    hasher.update(version.generation.to_be_bytes());
    let hash = hasher.finalize();
    u128::from_be_bytes(hash[..16].try_into().expect("SHA-256 is 32 bytes"))
}

#[cfg(test)]
mod tests {
    use super::*;

    fn entry(name: &str, uid: &str, generation: i64) -> (ResourceKey, ResourceVersion) {
        (
            ResourceKey::device("plant", name),
            ResourceVersion::new(uid, generation),
        )
    }

    fn digest(entries: &[(ResourceKey, ResourceVersion)]) -> HoldingsDigest {
        HoldingsDigest::of(entries.iter().map(|(k, v)| (k, v)))
    }

    #[test]
    fn order_does_not_matter_and_bytes_round_trip() {
        let a = entry("a", "u1", 1);
        let b = entry("b", "u2", 3);
        let forward = digest(&[a.clone(), b.clone()]);
        assert_eq!(forward, digest(&[b, a]));
        assert_eq!(forward.count(), 2);
        let bytes = forward.to_bytes();
        assert_eq!(bytes.len(), 16);
        assert_eq!(HoldingsDigest::from_parts(&bytes, 2), Some(forward));
        assert_eq!(HoldingsDigest::from_parts(&bytes[..15], 2), None);
    }

    #[test]
    fn any_change_of_key_uid_or_generation_changes_it() {
        let base = digest(&[entry("a", "u1", 1), entry("b", "u2", 3)]);
        for changed in [
            [entry("a", "u1", 2), entry("b", "u2", 3)],
            [entry("a", "u9", 1), entry("b", "u2", 3)],
            [entry("c", "u1", 1), entry("b", "u2", 3)],
        ] {
            assert_ne!(digest(&changed), base, "{changed:?}");
        }
        assert_ne!(digest(&[entry("a", "u1", 1)]), base);
        assert_eq!(digest(&[]), HoldingsDigest::default());
    }

    #[test]
    fn field_boundaries_are_not_ambiguous() {
        // The same bytes split differently between key and uid.
        let one = (
            ResourceKey::device("plant", "ab"),
            ResourceVersion::new("c", 1),
        );
        let other = (
            ResourceKey::device("plant", "a"),
            ResourceVersion::new("bc", 1),
        );
        assert_ne!(digest(&[one]), digest(&[other]));
    }
}
