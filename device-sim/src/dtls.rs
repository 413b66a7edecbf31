//! A device's side of CoAP over DTLS 1.2 with its pre-shared key
//! (`TLS_PSK_WITH_AES_128_CCM_8`, PSK identity `<namespace>:<name>`).
//!
//! A [`DtlsLink`] owns a connected UDP socket and a task that drives the
//! sans-IO engine ([`dimpl`]): CoAP messages given to [`DtlsLink::send`]
//! leave as protected records, and the agent's messages come out of
//! [`DtlsLink::recv`]. Messages sent before the handshake completes wait in
//! the engine.
//!
//! An agent that restarted has forgotten the session and drops its
//! records, and says nothing (an unauthenticated alert would let anybody
//! end sessions). So the device starts a new handshake when it asks for one
//! ([`DtlsLink::renew`], after a request went unanswered) and nothing came
//! from the agent since; and when the engine fails.

use std::io;
use std::sync::Arc;
use std::time::{Duration, Instant};

use dimpl::crypto::Dtls12CipherSuite;
use dimpl::{Config, Dtls, Output, PskResolver};
use tokio::net::UdpSocket;
use tokio::sync::{Mutex, mpsc};
use tokio::task::AbortHandle;

/// The device's key, whatever identity the agent names.
struct OwnKey(Vec<u8>);

impl PskResolver for OwnKey {
    fn resolve(&self, _identity: &[u8]) -> Option<Vec<u8>> {
        Some(self.0.clone())
    }
}

enum Command {
    Send(Vec<u8>),
    /// Renew the session unless the agent was heard after this instant.
    Renew(Instant),
}

/// One device's DTLS session with its agent, renewed as needed.
#[derive(Debug)]
pub struct DtlsLink {
    commands: mpsc::Sender<Command>,
    incoming: Mutex<mpsc::Receiver<Vec<u8>>>,
    task: AbortHandle,
}

impl DtlsLink {
    /// Starts the session on `socket` (connected to the agent) as
    /// `identity` with `key`. Returns at once; the handshake runs in the
    /// background.
    pub fn start(socket: UdpSocket, identity: &str, key: &[u8]) -> DtlsLink {
        let config = Arc::new(
            Config::builder()
                .dtls12_cipher_suites(&[Dtls12CipherSuite::PSK_AES128_CCM_8])
                .dtls13_cipher_suites(&[])
                .with_psk_client(identity.as_bytes().to_vec(), Arc::new(OwnKey(key.to_vec())))
                .build()
                .expect("a PSK-only DTLS 1.2 configuration is valid"),
        );
        let (commands, rx) = mpsc::channel(64);
        let (tx, incoming) = mpsc::channel(64);
        let task = tokio::spawn(drive(socket, config, rx, tx));
        DtlsLink {
            commands,
            incoming: Mutex::new(incoming),
            task: task.abort_handle(),
        }
    }

    /// Sends one CoAP message.
    pub async fn send(&self, message: &[u8]) -> io::Result<()> {
        self.commands
            .send(Command::Send(message.to_vec()))
            .await
            .map_err(|_| io::Error::new(io::ErrorKind::BrokenPipe, "the DTLS link ended"))
    }

    /// The next CoAP message from the agent.
    pub async fn recv(&self) -> io::Result<Vec<u8>> {
        self.incoming
            .lock()
            .await
            .recv()
            .await
            .ok_or_else(|| io::Error::new(io::ErrorKind::BrokenPipe, "the DTLS link ended"))
    }

    /// Starts a new handshake unless the agent was heard after `since`.
    pub async fn renew(&self, since: Instant) {
        let _ = self.commands.send(Command::Renew(since)).await;
    }
}

impl Drop for DtlsLink {
    fn drop(&mut self) {
        self.task.abort();
    }
}

/// The engine and what the task knows of it.
struct Engine {
    dtls: Dtls,
    next_timeout: Instant,
}

impl Engine {
    fn new(config: &Arc<Config>) -> Engine {
        let now = Instant::now();
        let mut dtls = Dtls::new_12_psk(Arc::clone(config), now);
        dtls.set_active(true);
        Engine {
            dtls,
            next_timeout: now,
        }
    }
}

async fn drive(
    socket: UdpSocket,
    config: Arc<Config>,
    mut commands: mpsc::Receiver<Command>,
    incoming: mpsc::Sender<Vec<u8>>,
) {
    let mut engine = Engine::new(&config);
    let mut last_heard: Option<Instant> = None;
    let mut buf = vec![0u8; 65_536];
    let mut out = vec![0u8; 2_048];
    loop {
        // Drain the engine: records to send, messages to hand on.
        let mut failed = engine.dtls.handle_timeout(Instant::now()).is_err();
        while !failed {
            match engine.dtls.poll_output(&mut out) {
                Output::Packet(p) => {
                    if let Err(e) = socket.send(p).await {
                        tracing::debug!(error = %e, "DTLS send failed");
                    }
                }
                Output::BufferTooSmall { needed } => out.resize(needed, 0),
                Output::Timeout(at) => {
                    engine.next_timeout = at;
                    break;
                }
                // Nobody reads any more: the client is gone.
                Output::ApplicationData(data) if incoming.send(data.to_vec()).await.is_err() => {
                    return;
                }
                Output::CloseNotify => failed = true,
                _ => {}
            }
        }
        if failed {
            // Ended by the agent (a key that changed) or broken: begin anew.
            tracing::debug!("DTLS session ended; handshaking again");
            tokio::time::sleep(Duration::from_secs(1)).await;
            engine = Engine::new(&config);
            continue;
        }
        tokio::select! {
            received = socket.recv(&mut buf) => match received {
                Ok(len) => {
                    let now = Instant::now();
                    let _ = engine.dtls.handle_timeout(now);
                    if engine.dtls.handle_packet(&buf[..len]).is_err() {
                        engine = Engine::new(&config);
                    } else {
                        last_heard = Some(now);
                    }
                }
                // ICMP errors (nothing listens yet); the timers retry.
                Err(e) => tracing::debug!(error = %e, "DTLS receive failed"),
            },
            command = commands.recv() => match command {
                Some(Command::Send(message)) => {
                    if engine.dtls.send_application_data(&message).is_err() {
                        engine = Engine::new(&config);
                    }
                }
                Some(Command::Renew(since)) => {
                    if last_heard.is_none_or(|heard| heard < since) {
                        tracing::debug!("the agent went silent; renewing the DTLS session");
                        engine = Engine::new(&config);
                        last_heard = None;
                    }
                }
                None => return,
            },
            () = tokio::time::sleep_until(engine.next_timeout.into()) => {}
        }
    }
}
