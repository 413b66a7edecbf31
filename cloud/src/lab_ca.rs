//! A certificate authority for labs and tests: a CA and the controller's
//! certificate it issues, written in the layout cert-manager gives a
//! Secret (`ca.crt`, `tls.crt`, `tls.key` in one directory), so the same
//! files serve `--tls-dir` here and `kubectl create secret` in a cluster.
//! Production uses cert-manager (or any CA); see deploy/README.md.

use std::path::{Path, PathBuf};

use rcgen::{BasicConstraints, CertificateParams, CertifiedIssuer, DnType, IsCa, KeyPair};

/// A CA kept in memory, and the directory it writes to.
#[derive(Debug)]
pub struct LabCa {
    dir: PathBuf,
    names: Vec<String>,
    ca: CertifiedIssuer<'static, KeyPair>,
}

/// Why the files could not be made.
#[derive(Debug, thiserror::Error)]
pub enum LabCaError {
    /// rcgen refused.
    #[error("make a certificate: {0}")]
    Certificate(#[from] rcgen::Error),
    /// The directory could not be written.
    #[error("write {path}: {source}")]
    Write {
        /// The file.
        path: PathBuf,
        /// Why.
        source: std::io::Error,
    },
}

fn write(path: PathBuf, content: String) -> Result<(), LabCaError> {
    std::fs::write(&path, content).map_err(|source| LabCaError::Write { path, source })
}

impl LabCa {
    /// A new CA in `dir` (`ca.crt`), and a controller certificate for
    /// `names` (DNS names or IP addresses) it issued.
    pub fn new(dir: &Path, names: &[String]) -> Result<LabCa, LabCaError> {
        std::fs::create_dir_all(dir).map_err(|source| LabCaError::Write {
            path: dir.to_owned(),
            source,
        })?;
        let mut params = CertificateParams::new(Vec::<String>::new())?;
        params.is_ca = IsCa::Ca(BasicConstraints::Unconstrained);
        params
            .distinguished_name
            .push(DnType::CommonName, "Edgefleet lab CA");
        let ca = CertifiedIssuer::self_signed(params, KeyPair::generate()?)?;
        write(dir.join("ca.crt"), ca.pem())?;
        let lab = LabCa {
            dir: dir.to_owned(),
            names: names.to_vec(),
            ca,
        };
        lab.issue()?;
        Ok(lab)
    }

    /// Issues a new controller certificate (a new key too) over the old
    /// one; its DER.
    pub fn issue(&self) -> Result<Vec<u8>, LabCaError> {
        let key = KeyPair::generate()?;
        let mut params = CertificateParams::new(self.names.clone())?;
        params
            .distinguished_name
            .push(DnType::CommonName, "edgefleet-cloud");
        let cert = params.signed_by(&key, &self.ca)?;
        // The key first: a reader between the two writes sees a pair that
        // does not match and keeps the old one.
        write(self.dir.join("tls.key"), key.serialize_pem())?;
        write(self.dir.join("tls.crt"), cert.pem())?;
        Ok(cert.der().to_vec())
    }

    /// The directory.
    pub fn dir(&self) -> &Path {
        &self.dir
    }

    /// The CA bundle agents check the controller against.
    pub fn ca_file(&self) -> PathBuf {
        self.dir.join("ca.crt")
    }
}

#[cfg(test)]
mod tests {
    use std::sync::Arc;

    use rustls::client::WebPkiServerVerifier;
    use rustls::client::danger::ServerCertVerifier;
    use rustls::pki_types::pem::PemObject;
    use rustls::pki_types::{CertificateDer, ServerName, UnixTime};

    use super::*;

    /// Whether the certificate in `dir` verifies for `name` against its CA.
    fn verifies(dir: &Path, name: &str) -> Result<(), rustls::Error> {
        let mut roots = rustls::RootCertStore::empty();
        roots
            .add(CertificateDer::from_pem_file(dir.join("ca.crt")).unwrap())
            .unwrap();
        let provider = Arc::new(rustls::crypto::ring::default_provider());
        let verifier = WebPkiServerVerifier::builder_with_provider(Arc::new(roots), provider)
            .build()
            .unwrap();
        let leaf = CertificateDer::from_pem_file(dir.join("tls.crt")).unwrap();
        let name = ServerName::try_from(name.to_owned()).unwrap();
        verifier
            .verify_server_cert(&leaf, &[], &name, &[], UnixTime::now())
            .map(|_| ())
    }

    #[test]
    fn the_lab_certificate_is_served_and_verifies_for_its_names_only() {
        let dir = tempfile::tempdir().unwrap();
        let names = [
            "edgefleet-cloud.edgefleet-system.svc".into(),
            "127.0.0.1".into(),
        ];
        let lab = LabCa::new(dir.path(), &names).unwrap();
        crate::tls::Certificate::load(lab.dir()).unwrap();
        verifies(dir.path(), "edgefleet-cloud.edgefleet-system.svc").unwrap();
        verifies(dir.path(), "127.0.0.1").unwrap();
        assert!(verifies(dir.path(), "evil.example").is_err());
        // A second CA's certificate does not verify against the first CA.
        let other = tempfile::tempdir().unwrap();
        LabCa::new(other.path(), &names).unwrap();
        std::fs::copy(other.path().join("tls.crt"), dir.path().join("tls.crt")).unwrap();
        assert!(verifies(dir.path(), "127.0.0.1").is_err());
    }
}
