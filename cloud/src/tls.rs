//! TLS on the sync link: the controller's certificate, taken from a
//! directory in the layout cert-manager writes into a Secret (`tls.crt`:
//! the chain, `tls.key`: its key), and taken again whenever the files
//! change, so a renewed certificate is served without a restart. Sessions
//! already open keep the certificate they were made with.
//!
//! Connections are accepted here, not by tonic: each handshake runs on its
//! own task under a time limit, at most [`MAX_HANDSHAKES`] at once, so a
//! slow or silent client holds back nobody and costs a bounded amount.
//! Every connection is counted by outcome in
//! `edgefleet_cloud_sync_connections_total{outcome}`.

use std::io;
use std::path::{Path, PathBuf};
use std::sync::{Arc, RwLock};
use std::time::Duration;

use edgefleet_shared::telemetry::Outcomes;
use futures::{Stream, StreamExt};
use rustls::crypto::CryptoProvider;
use rustls::pki_types::pem::PemObject;
use rustls::pki_types::{CertificateDer, PrivateKeyDer};
use rustls::server::{ClientHello, ResolvesServerCert, WebPkiClientVerifier};
use rustls::sign::CertifiedKey;
use tokio::net::TcpStream;
use tokio::sync::{Semaphore, mpsc};
use tokio_rustls::TlsAcceptor;
use tokio_rustls::server::TlsStream;

use crate::sync::admission::Guarded;

/// Most TLS handshakes under way at once; connections beyond are closed at
/// once and counted (`too_many_handshakes`).
pub const MAX_HANDSHAKES: usize = 256;

/// How long a client has to finish its handshake.
pub const HANDSHAKE_TIMEOUT: Duration = Duration::from_secs(10);

/// Where the certificate is, and how often to look for a new one.
#[derive(Clone, Debug)]
pub struct TlsSettings {
    /// The directory holding `tls.crt` and `tls.key`.
    pub dir: PathBuf,
    /// How often the files are read again.
    pub reload_every: Duration,
}

/// Why the certificate could not be taken.
#[derive(Debug, thiserror::Error)]
pub enum TlsError {
    /// A file could not be read.
    #[error("read {path}: {source}")]
    Read {
        /// The file.
        path: PathBuf,
        /// Why.
        source: io::Error,
    },
    /// A file holds no usable PEM.
    #[error("{path}: {what}")]
    Pem {
        /// The file.
        path: PathBuf,
        /// What is wrong.
        what: String,
    },
    /// rustls refused the key or the configuration.
    #[error("{0}")]
    Rustls(#[from] rustls::Error),
}

/// The files of a directory in cert-manager's layout.
fn files(dir: &Path) -> (PathBuf, PathBuf) {
    (dir.join("tls.crt"), dir.join("tls.key"))
}

fn read(path: &Path) -> Result<Vec<u8>, TlsError> {
    std::fs::read(path).map_err(|source| TlsError::Read {
        path: path.to_owned(),
        source,
    })
}

/// The certificate chain and key in `cert` and `key` (PEM).
fn certified(
    provider: &CryptoProvider,
    cert: (&Path, &[u8]),
    key: (&Path, &[u8]),
) -> Result<CertifiedKey, TlsError> {
    let pem = |path: &Path, what: String| TlsError::Pem {
        path: path.to_owned(),
        what,
    };
    let chain: Vec<CertificateDer<'static>> = CertificateDer::pem_slice_iter(cert.1)
        .collect::<Result<_, _>>()
        .map_err(|e| pem(cert.0, e.to_string()))?;
    if chain.is_empty() {
        return Err(pem(cert.0, "no CERTIFICATE in it".into()));
    }
    let private = PrivateKeyDer::from_pem_slice(key.1).map_err(|e| pem(key.0, e.to_string()))?;
    let signing = provider.key_provider.load_private_key(private)?;
    let certified = CertifiedKey::new(chain, signing);
    certified.keys_match()?;
    Ok(certified)
}

/// The certificate being served, swapped when the files change.
#[derive(Debug)]
pub struct Certificate {
    current: RwLock<Arc<CertifiedKey>>,
    /// The bytes it was made from, to notice a change.
    loaded: RwLock<(Vec<u8>, Vec<u8>)>,
    provider: Arc<CryptoProvider>,
    dir: PathBuf,
}

impl ResolvesServerCert for Certificate {
    fn resolve(&self, _hello: ClientHello<'_>) -> Option<Arc<CertifiedKey>> {
        Some(Arc::clone(&self.current.read().expect("certificate lock")))
    }
}

impl Certificate {
    /// Reads the certificate in `dir`.
    pub fn load(dir: &Path) -> Result<Arc<Self>, TlsError> {
        let provider = Arc::new(rustls::crypto::ring::default_provider());
        let (cert_path, key_path) = files(dir);
        let (cert, key) = (read(&cert_path)?, read(&key_path)?);
        let certified = certified(&provider, (&cert_path, &cert), (&key_path, &key))?;
        Ok(Arc::new(Certificate {
            current: RwLock::new(Arc::new(certified)),
            loaded: RwLock::new((cert, key)),
            provider,
            dir: dir.to_owned(),
        }))
    }

    /// Reads the files again; takes them if they changed. Whether it did.
    pub fn reload(&self) -> Result<bool, TlsError> {
        let (cert_path, key_path) = files(&self.dir);
        let (cert, key) = (read(&cert_path)?, read(&key_path)?);
        {
            let loaded = self.loaded.read().expect("certificate lock");
            if loaded.0 == cert && loaded.1 == key {
                return Ok(false);
            }
        }
        let certified = certified(&self.provider, (&cert_path, &cert), (&key_path, &key))?;
        *self.current.write().expect("certificate lock") = Arc::new(certified);
        *self.loaded.write().expect("certificate lock") = (cert, key);
        Ok(true)
    }

    /// The rustls configuration that serves this certificate to gRPC
    /// clients (HTTP/2 only). With `client_ca` (PEM), a client may present
    /// a certificate, which must then chain to it (agents that are not
    /// pods); one that presents none goes on to prove itself with a token.
    pub fn server_config(
        self: &Arc<Self>,
        client_ca: Option<&str>,
    ) -> Result<rustls::ServerConfig, TlsError> {
        let builder = rustls::ServerConfig::builder_with_provider(Arc::clone(&self.provider))
            .with_safe_default_protocol_versions()?;
        let builder = match client_ca {
            None => builder.with_no_client_auth(),
            Some(pem) => {
                let mut roots = rustls::RootCertStore::empty();
                for cert in CertificateDer::pem_slice_iter(pem.as_bytes()) {
                    let cert = cert.map_err(|e| TlsError::Pem {
                        path: "--agent-ca-dir/tls.crt".into(),
                        what: e.to_string(),
                    })?;
                    roots.add(cert)?;
                }
                let verifier = WebPkiClientVerifier::builder_with_provider(
                    Arc::new(roots),
                    Arc::clone(&self.provider),
                )
                .allow_unauthenticated()
                .build()
                .map_err(|e| TlsError::Pem {
                    path: "--agent-ca-dir/tls.crt".into(),
                    what: e.to_string(),
                })?;
                builder.with_client_cert_verifier(verifier)
            }
        };
        let mut config =
            builder.with_cert_resolver(Arc::clone(self) as Arc<dyn ResolvesServerCert>);
        config.alpn_protocols = vec![b"h2".to_vec()];
        Ok(config)
    }

    /// Looks for new files every `every` until the process ends; a change
    /// that does not load is logged and counted, and the old certificate
    /// stays.
    pub async fn keep_reloading(self: Arc<Self>, every: Duration, reloads: Outcomes) {
        let mut tick = tokio::time::interval(every);
        tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
        tick.tick().await;
        loop {
            tick.tick().await;
            match self.reload() {
                Ok(false) => {}
                Ok(true) => {
                    reloads.inc("loaded");
                    tracing::info!(dir = %self.dir.display(), "sync TLS certificate reloaded");
                }
                Err(error) => {
                    reloads.inc("failed");
                    tracing::warn!(%error, "sync TLS certificate changed but could not be loaded; serving the previous one");
                }
            }
        }
    }
}

/// The TLS connections made over the TCP connections of `tcp`, in the
/// order their handshakes end. Failed handshakes are counted in
/// `connections` and left out.
pub fn accept<S>(
    tcp: S,
    acceptor: TlsAcceptor,
    connections: Outcomes,
) -> impl Stream<Item = Result<TlsStream<Guarded<TcpStream>>, io::Error>>
where
    S: Stream<Item = Guarded<TcpStream>> + Send + 'static,
{
    let (tx, rx) = mpsc::channel(64);
    tokio::spawn(async move {
        let handshakes = Arc::new(Semaphore::new(MAX_HANDSHAKES));
        let mut tcp = std::pin::pin!(tcp);
        while let Some(stream) = tcp.next().await {
            let Ok(permit) = Arc::clone(&handshakes).try_acquire_owned() else {
                connections.inc("too_many_handshakes");
                continue;
            };
            let (acceptor, tx, connections) = (acceptor.clone(), tx.clone(), connections.clone());
            tokio::spawn(async move {
                let peer = stream.remote();
                let shaken = tokio::time::timeout(HANDSHAKE_TIMEOUT, acceptor.accept(stream)).await;
                drop(permit);
                match shaken {
                    Ok(Ok(tls)) => {
                        connections.inc("tls");
                        let _ = tx.send(Ok(tls)).await;
                    }
                    Ok(Err(error)) => {
                        connections.inc("handshake_failed");
                        tracing::info!(?peer, %error, "sync connection refused: TLS handshake failed");
                    }
                    Err(_) => {
                        connections.inc("handshake_timeout");
                        tracing::info!(
                            ?peer,
                            "sync connection refused: no TLS handshake within {HANDSHAKE_TIMEOUT:?}"
                        );
                    }
                }
            });
        }
    });
    tokio_stream::wrappers::ReceiverStream::new(rx)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn write_pair(dir: &Path, name: &str) -> Vec<u8> {
        let key = rcgen::KeyPair::generate().unwrap();
        let cert = rcgen::CertificateParams::new(vec![name.to_owned()])
            .unwrap()
            .self_signed(&key)
            .unwrap();
        std::fs::write(dir.join("tls.crt"), cert.pem()).unwrap();
        std::fs::write(dir.join("tls.key"), key.serialize_pem()).unwrap();
        cert.der().to_vec()
    }

    fn served(cert: &Certificate) -> Vec<u8> {
        let current = cert.current.read().unwrap();
        current.cert[0].as_ref().to_vec()
    }

    #[test]
    fn a_changed_certificate_is_taken_and_a_broken_one_is_not() {
        let dir = tempfile::tempdir().unwrap();
        let first = write_pair(dir.path(), "one.example");
        let cert = Certificate::load(dir.path()).unwrap();
        assert_eq!(served(&cert), first);
        assert!(!cert.reload().unwrap(), "nothing changed");
        let second = write_pair(dir.path(), "two.example");
        assert!(cert.reload().unwrap());
        assert_eq!(served(&cert), second);
        // A key that is not the certificate's: refused, the old one stays.
        let other = rcgen::KeyPair::generate().unwrap();
        std::fs::write(dir.path().join("tls.key"), other.serialize_pem()).unwrap();
        assert!(matches!(cert.reload(), Err(TlsError::Rustls(_))));
        assert_eq!(served(&cert), second);
        std::fs::write(dir.path().join("tls.crt"), "not PEM").unwrap();
        assert!(matches!(cert.reload(), Err(TlsError::Pem { .. })));
        let missing = Certificate::load(&dir.path().join("nowhere")).unwrap_err();
        assert!(missing.to_string().contains("tls.crt"), "{missing}");
    }
}
