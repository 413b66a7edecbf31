//! A device's side of CoAP over DTLS 1.2 with its pre-shared key
//! (`TLS_PSK_WITH_AES_128_CCM_8`, PSK identity `<name>@<namespace>`).
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
//! from the agent since; and when the engine fails. The new session sends
//! again what was sent since the agent was last heard (the agent answers a
//! repeated message id from its memory and stores nothing twice). An agent
//! that restarted answers a record of a session it forgot with an
//! unprotected alert; the device takes that as the sign to handshake again
//! at once.

use std::collections::VecDeque;
use std::io;
use std::sync::Arc;
use std::time::{Duration, Instant};

use dimpl::crypto::Dtls12CipherSuite;
use dimpl::{Config, Dtls, Output, PskResolver};
use edgefleet_shared::dtls::FORGOTTEN_SESSION_ALERT;
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

/// How many messages sent since the agent was last heard are kept, to
/// send again in a new session.
const UNANSWERED: usize = 16;

/// The engine and what the task knows of it.
struct Engine {
    dtls: Dtls,
    next_timeout: Instant,
}

impl Engine {
    /// A new session, which sends `unanswered` once it is established (a
    /// new session means the old one went silent: what was sent in it may
    /// be lost, and waiting for the request's own retransmission can take
    /// many seconds; the agent drops a repeated message id).
    fn new(config: &Arc<Config>, unanswered: &VecDeque<Vec<u8>>) -> Engine {
        let now = Instant::now();
        let mut dtls = Dtls::new_12_psk(Arc::clone(config), now);
        dtls.set_active(true);
        for message in unanswered {
            // Before the handshake completes, the engine only queues.
            let _ = dtls.send_application_data(message);
        }
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
    let mut unanswered = VecDeque::new();
    let mut engine = Engine::new(&config, &unanswered);
    let mut last_heard: Option<Instant> = None;
    // Whether the engine's handshake completed.
    let mut connected = false;
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
                Output::Connected => connected = true,
                Output::ApplicationData(data) => {
                    // The answer (same message id) to a message sent.
                    if let Some(id) = data.get(2..4) {
                        unanswered.retain(|m| m.get(2..4) != Some(id));
                    }
                    if incoming.send(data.to_vec()).await.is_err() {
                        // Nobody reads any more: the client is gone.
                        return;
                    }
                }
                Output::CloseNotify => failed = true,
                _ => {}
            }
        }
        if failed {
            // Ended by the agent (a key that changed) or broken: begin anew.
            tracing::debug!("DTLS session ended; handshaking again");
            tokio::time::sleep(Duration::from_secs(1)).await;
            engine = Engine::new(&config, &unanswered);
            connected = false;
            continue;
        }
        tokio::select! {
            received = socket.recv(&mut buf) => match received {
                Ok(len) if connected && buf[..len] == FORGOTTEN_SESSION_ALERT => {
                    // The agent forgot the session (it restarted): begin a
                    // new one now. Unprotected, so only a hint: a forged one
                    // costs a handshake, and ends nothing by itself.
                    tracing::debug!("the agent has no session for this device; handshaking again");
                    engine = Engine::new(&config, &unanswered);
                    connected = false;
                }
                Ok(len) => {
                    let now = Instant::now();
                    let _ = engine.dtls.handle_timeout(now);
                    if engine.dtls.handle_packet(&buf[..len]).is_err() {
                        engine = Engine::new(&config, &unanswered);
                        connected = false;
                    } else {
                        last_heard = Some(now);
                    }
                }
                // ICMP errors (nothing listens yet); the timers retry.
                Err(e) => tracing::debug!(error = %e, "DTLS receive failed"),
            },
            command = commands.recv() => match command {
                Some(Command::Send(message)) => {
                    if unanswered.len() == UNANSWERED {
                        unanswered.pop_front();
                    }
                    unanswered.push_back(message);
                    let message = unanswered.back().expect("just pushed");
                    if engine.dtls.send_application_data(message).is_err() {
                        engine = Engine::new(&config, &unanswered);
                        connected = false;
                    }
                }
                Some(Command::Renew(since)) => {
                    if last_heard.is_none_or(|heard| heard < since) {
                        tracing::debug!("the agent went silent; renewing the DTLS session");
                        engine = Engine::new(&config, &unanswered);
                        connected = false;
                        last_heard = None;
                    }
                }
                None => return,
            },
            () = tokio::time::sleep_until(engine.next_timeout.into()) => {}
        }
    }
}
