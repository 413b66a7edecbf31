//! The sync link's TLS in tests: a lab CA and the controller's certificate
//! ([`LabCa`]) in a directory, and the flags that use it.

use std::net::SocketAddr;
use std::path::Path;

pub use edgefleet_cloud::lab_ca::LabCa;

/// A lab CA whose controller certificate names `localhost` and
/// `127.0.0.1`.
pub fn lab(dir: &Path) -> anyhow::Result<LabCa> {
    Ok(LabCa::new(dir, &["localhost".into(), "127.0.0.1".into()])?)
}

/// The controller's flags to serve the certificate of `lab`.
pub fn cloud_args(lab: &LabCa) -> Vec<String> {
    vec![format!("--tls-dir={}", lab.dir().display())]
}

/// An agent's flags to reach the controller at `sync` over TLS, trusting
/// `lab`.
pub fn agent_args(lab: &LabCa, sync: SocketAddr) -> Vec<String> {
    vec![
        format!("--cloud=https://{sync}"),
        format!("--cloud-ca-file={}", lab.ca_file().display()),
    ]
}
