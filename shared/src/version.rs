//! Versions: of a resource as the sync protocol tracks it, and of firmware.

use std::cmp::Ordering;
use std::fmt;
use std::str::FromStr;

use serde::{Deserialize, Serialize};

/// The version of one resource the agent holds: its `metadata.uid` and
/// `metadata.generation`.
///
/// The uid matters because a resource deleted and created again under the same
/// name starts at generation 1 again: such versions are *not comparable*, and
/// the newer object simply replaces the older one.
#[derive(Clone, Debug, PartialEq, Eq, Hash, Serialize, Deserialize)]
pub struct ResourceVersion {
    /// `metadata.uid` of the resource.
    pub uid: String,
    /// `metadata.generation` of the resource; it changes only when the spec does.
    pub generation: i64,
}

impl ResourceVersion {
    /// A version from its parts.
    pub fn new(uid: impl Into<String>, generation: i64) -> Self {
        ResourceVersion {
            uid: uid.into(),
            generation,
        }
    }

    /// A second half for a resource whose generation is its content (a
    /// rule's body, a device key): the first 63 bits of SHA-256 over
    /// `content`, so equal contents have equal versions and a change makes
    /// a new one.
    pub fn content_digest(content: &[u8]) -> i64 {
        use sha2::{Digest, Sha256};
        let hash = Sha256::digest(content);
        let mut first = [0; 8];
        first.copy_from_slice(&hash[..8]);
        i64::from_be_bytes(first) & i64::MAX
    }

    /// Whether an agent holding `held` must be sent `self`: true unless `held`
    /// is the same object at the same or a later generation.
    pub fn is_newer_than(&self, held: &ResourceVersion) -> bool {
        !matches!(
            self.partial_cmp(held),
            Some(Ordering::Less | Ordering::Equal)
        )
    }
}

impl PartialOrd for ResourceVersion {
    /// Ordered by generation within one uid; different uids do not compare.
    fn partial_cmp(&self, other: &Self) -> Option<Ordering> {
        (self.uid == other.uid).then(|| self.generation.cmp(&other.generation))
    }
}

impl fmt::Display for ResourceVersion {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{}@{}", self.uid, self.generation)
    }
}

/// A firmware version: semantic versioning (`MAJOR.MINOR.PATCH`, optional
/// pre-release and build metadata), so "newer" means the same to the cloud,
/// the agent and the device.
#[derive(Clone, Debug, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub struct FirmwareVersion(semver::Version);

/// A firmware version string that is not semantic versioning.
#[derive(Debug, thiserror::Error)]
#[error("firmware version {input:?} is not a semantic version like 1.4.2: {reason}")]
pub struct FirmwareVersionError {
    input: String,
    reason: semver::Error,
}

/// The semantic-versioning pattern as a literal, for use in `concat!`.
/// Written without backslashes so it can sit inside a CEL string literal.
#[macro_export]
#[doc(hidden)]
macro_rules! semver_pattern {
    () => {
        "^(0|[1-9][0-9]*)[.](0|[1-9][0-9]*)[.](0|[1-9][0-9]*)(-[0-9A-Za-z-]+([.][0-9A-Za-z-]+)*)?([+][0-9A-Za-z-]+([.][0-9A-Za-z-]+)*)?$"
    };
}

impl FirmwareVersion {
    /// The regular expression the Device schema checks a firmware version
    /// against: semantic versioning 2.0, the form the `semver` crate parses.
    pub const PATTERN: &'static str = semver_pattern!();
}

impl FromStr for FirmwareVersion {
    type Err = FirmwareVersionError;

    fn from_str(s: &str) -> Result<Self, Self::Err> {
        semver::Version::parse(s)
            .map(FirmwareVersion)
            .map_err(|reason| FirmwareVersionError {
                input: s.to_owned(),
                reason,
            })
    }
}

impl fmt::Display for FirmwareVersion {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        self.0.fmt(f)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn generations_order_within_one_uid() {
        let v1 = ResourceVersion::new("a", 1);
        let v2 = ResourceVersion::new("a", 2);
        assert!(v1 < v2);
        assert!(v2.is_newer_than(&v1));
        assert!(!v1.is_newer_than(&v2));
        assert!(!v2.is_newer_than(&v2.clone()));
    }

    #[test]
    fn a_recreated_resource_is_always_sent() {
        let old = ResourceVersion::new("old-uid", 7);
        let recreated = ResourceVersion::new("new-uid", 1);
        assert_eq!(old.partial_cmp(&recreated), None);
        assert!(recreated.is_newer_than(&old));
        assert!(old.is_newer_than(&recreated));
    }

    #[test]
    fn firmware_versions_order_by_semver() {
        let parse = |s: &str| s.parse::<FirmwareVersion>().unwrap();
        assert!(parse("1.10.0") > parse("1.9.3"));
        assert!(parse("2.0.0-rc.1") < parse("2.0.0"));
        assert_eq!(parse("1.2.3+build.5").to_string(), "1.2.3+build.5");
    }

    #[test]
    fn firmware_version_errors_name_the_input() {
        for bad in ["1.2", "v1.2.3", "1.2.x", "", "01.2.3"] {
            let err = bad.parse::<FirmwareVersion>().unwrap_err();
            assert!(err.to_string().contains(&format!("{bad:?}")), "{err}");
        }
    }

    #[test]
    fn schema_pattern_agrees_with_the_parser() {
        // The pattern is what the API server enforces; the parser is what the
        // cloud and agent use. They must accept the same strings.
        let re = |s: &str| pattern_matches(FirmwareVersion::PATTERN, s);
        for s in ["1.2.3", "0.0.1", "10.20.30-rc.1+b.7", "1.0.0-alpha-1"] {
            assert!(re(s), "pattern refused {s}");
            assert!(s.parse::<FirmwareVersion>().is_ok(), "parser refused {s}");
        }
        for s in ["1.2", "v1.2.3", "1.2.3.4", "01.2.3", "1.2.3-", "1.2.3+"] {
            assert!(!re(s), "pattern accepted {s}");
            assert!(s.parse::<FirmwareVersion>().is_err(), "parser accepted {s}");
        }
    }

    /// The API server evaluates the pattern with Go's RE2; the `regex` crate
    /// implements the same syntax.
    fn pattern_matches(pattern: &str, s: &str) -> bool {
        regex::Regex::new(pattern).unwrap().is_match(s)
    }
}
