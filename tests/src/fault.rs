//! Network faults for tests: a TCP proxy on loopback that a test can cut,
//! turn into a black hole, and heal.
//!
//! - forwarding (the start, and after [`FaultProxy::heal`]): bytes pass both
//!   ways and are counted;
//! - [`FaultProxy::cut`]: every open connection is closed and new ones are
//!   accepted and closed at once — a link that fails loudly;
//! - [`FaultProxy::black_hole`]: connections stay open but every byte, both
//!   ways, is read and thrown away, and new connections are accepted but
//!   never forwarded — a link that drops packets silently, with no reset.
//!
//! In a black hole a side that closes is not told to the other side either
//! (no FIN or reset crosses it).
//!
//! A black hole loses bytes mid-stream (unlike TCP over a real lossy link,
//! which would retransmit them), so a connection that lost any is closed at
//! [`heal`](FaultProxy::heal), as are the ones accepted during the black
//! hole; connections that lost nothing go back to forwarding.

use std::net::SocketAddr;
use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};

use anyhow::{Context, ensure};
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::{TcpListener, TcpStream};
use tokio::sync::watch;
use tokio::task::JoinHandle;

/// What the proxy does with traffic.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Mode {
    /// Bytes pass.
    Forward,
    /// Connections are closed, new ones refused.
    Cut,
    /// Bytes are dropped silently, connections stay open.
    BlackHole,
}

/// What went through, as counted since the proxy started.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct ProxyStats {
    /// Connections accepted from clients (whatever happened to them).
    pub accepted: u64,
    /// Connections accepted and closed at once because the link was cut.
    pub refused: u64,
    /// Connections opened to the target.
    pub forwarded_connections: u64,
    /// Bytes forwarded client → target.
    pub bytes_up: u64,
    /// Bytes forwarded target → client.
    pub bytes_down: u64,
    /// Bytes read and thrown away in a black hole, both ways.
    pub bytes_dropped: u64,
}

#[derive(Debug, Default)]
struct Counters {
    accepted: AtomicU64,
    refused: AtomicU64,
    forwarded_connections: AtomicU64,
    bytes_up: AtomicU64,
    bytes_down: AtomicU64,
    bytes_dropped: AtomicU64,
}

/// A fault-injecting TCP proxy on loopback; stops when dropped.
#[derive(Debug)]
pub struct FaultProxy {
    addr: SocketAddr,
    mode: watch::Sender<Mode>,
    counters: Arc<Counters>,
    accept: JoinHandle<()>,
}

impl FaultProxy {
    /// Listens on a free loopback port and forwards to `target`, which must
    /// be on loopback too.
    pub async fn start(target: SocketAddr) -> anyhow::Result<FaultProxy> {
        ensure!(
            target.ip().is_loopback(),
            "the fault proxy only forwards to loopback, not {target}"
        );
        let listener = TcpListener::bind("127.0.0.1:0")
            .await
            .context("bind the fault proxy")?;
        let addr = listener.local_addr()?;
        let (mode, _) = watch::channel(Mode::Forward);
        let counters = Arc::new(Counters::default());
        let accept = tokio::spawn(accept_loop(
            listener,
            target,
            mode.clone(),
            Arc::clone(&counters),
        ));
        Ok(FaultProxy {
            addr,
            mode,
            counters,
            accept,
        })
    }

    /// Where clients connect.
    pub fn addr(&self) -> SocketAddr {
        self.addr
    }

    /// Closes every connection and refuses new ones until [`heal`](Self::heal).
    pub fn cut(&self) {
        self.set(Mode::Cut);
    }

    /// Drops all bytes silently, keeping connections open, until
    /// [`heal`](Self::heal).
    pub fn black_hole(&self) {
        self.set(Mode::BlackHole);
    }

    /// Forwards again.
    pub fn heal(&self) {
        self.set(Mode::Forward);
    }

    /// The counters so far.
    pub fn stats(&self) -> ProxyStats {
        let c = &self.counters;
        ProxyStats {
            accepted: c.accepted.load(Ordering::Relaxed),
            refused: c.refused.load(Ordering::Relaxed),
            forwarded_connections: c.forwarded_connections.load(Ordering::Relaxed),
            bytes_up: c.bytes_up.load(Ordering::Relaxed),
            bytes_down: c.bytes_down.load(Ordering::Relaxed),
            bytes_dropped: c.bytes_dropped.load(Ordering::Relaxed),
        }
    }

    fn set(&self, mode: Mode) {
        self.mode.send_replace(mode);
    }
}

impl Drop for FaultProxy {
    fn drop(&mut self) {
        self.accept.abort();
        // Open connections see the sender go and close.
    }
}

async fn accept_loop(
    listener: TcpListener,
    target: SocketAddr,
    mode: watch::Sender<Mode>,
    counters: Arc<Counters>,
) {
    loop {
        let Ok((client, _)) = listener.accept().await else {
            continue;
        };
        counters.accepted.fetch_add(1, Ordering::Relaxed);
        let mode = mode.subscribe();
        let counters = Arc::clone(&counters);
        let now = *mode.borrow();
        match now {
            Mode::Cut => {
                counters.refused.fetch_add(1, Ordering::Relaxed);
                drop(client);
            }
            Mode::BlackHole => {
                tokio::spawn(swallow(client, mode, counters));
            }
            Mode::Forward => {
                tokio::spawn(async move {
                    // Closing the client is all a failed dial can do.
                    let Ok(upstream) = TcpStream::connect(target).await else {
                        return;
                    };
                    counters
                        .forwarded_connections
                        .fetch_add(1, Ordering::Relaxed);
                    forward(client, upstream, mode, counters).await;
                });
            }
        }
    }
}

/// A connection accepted during a black hole: everything it sends is
/// dropped; it is closed when the black hole ends (either way).
async fn swallow(mut client: TcpStream, mut mode: watch::Receiver<Mode>, counters: Arc<Counters>) {
    let mut buf = vec![0u8; 16 * 1024];
    loop {
        tokio::select! {
            read = client.read(&mut buf) => match read {
                Ok(0) | Err(_) => return,
                Ok(n) => {
                    counters.bytes_dropped.fetch_add(n as u64, Ordering::Relaxed);
                }
            },
            changed = mode.changed() => {
                if changed.is_err() || *mode.borrow() != Mode::BlackHole {
                    return;
                }
            }
        }
    }
}

/// Pumps both ways until either side closes (while forwarding) or the mode
/// says otherwise.
async fn forward(
    client: TcpStream,
    upstream: TcpStream,
    mut mode: watch::Receiver<Mode>,
    counters: Arc<Counters>,
) {
    let (mut client_rx, mut client_tx) = client.into_split();
    let (mut upstream_rx, mut upstream_tx) = upstream.into_split();
    let mut up = vec![0u8; 16 * 1024];
    let mut down = vec![0u8; 16 * 1024];
    // Whether bytes (or a close) were dropped since the link last forwarded.
    let mut lost = false;
    // A side that closed during a black hole; the other is kept open.
    let (mut client_open, mut upstream_open) = (true, true);
    loop {
        let current = *mode.borrow_and_update();
        if current == Mode::Cut || !(client_open || upstream_open) {
            return;
        }
        let dropping = current == Mode::BlackHole;
        tokio::select! {
            read = client_rx.read(&mut up), if client_open => {
                match pass(read, &up, &mut upstream_tx, dropping, &counters.bytes_up, &counters).await {
                    Pass::Passed => {}
                    Pass::Dropped => lost = true,
                    Pass::ClosedWhileDropping => (client_open, lost) = (false, true),
                    Pass::End => return,
                }
            }
            read = upstream_rx.read(&mut down), if upstream_open => {
                match pass(read, &down, &mut client_tx, dropping, &counters.bytes_down, &counters).await {
                    Pass::Passed => {}
                    Pass::Dropped => lost = true,
                    Pass::ClosedWhileDropping => (upstream_open, lost) = (false, true),
                    Pass::End => return,
                }
            }
            changed = mode.changed() => {
                if changed.is_err() {
                    return;
                }
                // A stream with a gap in it cannot go on.
                if lost && *mode.borrow() == Mode::Forward {
                    return;
                }
            }
        }
    }
}

/// What became of one read from one side of a forwarded connection.
enum Pass {
    /// Written to the other side.
    Passed,
    /// Swallowed by the black hole.
    Dropped,
    /// The side closed during a black hole; the other is kept open.
    ClosedWhileDropping,
    /// The connection is over.
    End,
}

/// Forwards what one read returned to `to`, or drops it in a black hole,
/// counting either.
async fn pass(
    read: std::io::Result<usize>,
    buf: &[u8],
    to: &mut tokio::net::tcp::OwnedWriteHalf,
    dropping: bool,
    forwarded: &AtomicU64,
    counters: &Counters,
) -> Pass {
    let n = match read {
        Ok(0) | Err(_) if dropping => return Pass::ClosedWhileDropping,
        Ok(0) | Err(_) => return Pass::End,
        Ok(n) => n,
    };
    if dropping {
        counters
            .bytes_dropped
            .fetch_add(n as u64, Ordering::Relaxed);
        return Pass::Dropped;
    }
    if to.write_all(&buf[..n]).await.is_err() {
        return Pass::End;
    }
    forwarded.fetch_add(n as u64, Ordering::Relaxed);
    Pass::Passed
}

#[cfg(test)]
mod tests {
    use std::time::Duration;

    use super::*;

    /// An echo server that counts the connections it accepted.
    async fn echo_server() -> (SocketAddr, Arc<AtomicU64>) {
        let (addr, accepted, _) = echo_server_counting_closes().await;
        (addr, accepted)
    }

    /// An echo server that counts the connections it accepted and the ones
    /// whose client closed.
    async fn echo_server_counting_closes() -> (SocketAddr, Arc<AtomicU64>, Arc<AtomicU64>) {
        let listener = TcpListener::bind("127.0.0.1:0").await.unwrap();
        let addr = listener.local_addr().unwrap();
        let accepted = Arc::new(AtomicU64::new(0));
        let closed = Arc::new(AtomicU64::new(0));
        let (count, closes) = (Arc::clone(&accepted), Arc::clone(&closed));
        tokio::spawn(async move {
            loop {
                let (mut socket, _) = listener.accept().await.unwrap();
                count.fetch_add(1, Ordering::Relaxed);
                let closes = Arc::clone(&closes);
                tokio::spawn(async move {
                    let (mut rx, mut tx) = socket.split();
                    let _ = tokio::io::copy(&mut rx, &mut tx).await;
                    closes.fetch_add(1, Ordering::Relaxed);
                });
            }
        });
        (addr, accepted, closed)
    }

    /// Writes `message` and reads as many bytes back, if they come within
    /// `wait`.
    async fn round_trip(stream: &mut TcpStream, message: &[u8], wait: Duration) -> Option<Vec<u8>> {
        stream.write_all(message).await.ok()?;
        let mut back = vec![0u8; message.len()];
        match tokio::time::timeout(wait, stream.read_exact(&mut back)).await {
            Ok(Ok(_)) => Some(back),
            _ => None,
        }
    }

    /// Whether the proxy closed `stream` (EOF or reset) within a few seconds.
    async fn closed(stream: &mut TcpStream) -> bool {
        let mut buf = [0u8; 64];
        matches!(
            tokio::time::timeout(Duration::from_secs(5), stream.read(&mut buf)).await,
            Ok(Ok(0) | Err(_))
        )
    }

    const LONG: Duration = Duration::from_secs(5);
    const QUIET: Duration = Duration::from_millis(300);

    #[tokio::test]
    async fn it_forwards_and_counts_both_ways() {
        let (echo, echo_accepted) = echo_server().await;
        let proxy = FaultProxy::start(echo).await.unwrap();
        let mut stream = TcpStream::connect(proxy.addr()).await.unwrap();
        assert_eq!(
            round_trip(&mut stream, b"hello", LONG).await.as_deref(),
            Some(&b"hello"[..])
        );
        let stats = proxy.stats();
        assert_eq!(stats.accepted, 1);
        assert_eq!(stats.forwarded_connections, 1);
        assert_eq!((stats.bytes_up, stats.bytes_down), (5, 5));
        assert_eq!(stats.bytes_dropped, 0);
        assert_eq!(echo_accepted.load(Ordering::Relaxed), 1);
    }

    #[tokio::test]
    async fn a_cut_closes_connections_and_refuses_new_ones_until_healed() {
        let (echo, echo_accepted) = echo_server().await;
        let proxy = FaultProxy::start(echo).await.unwrap();
        let mut before = TcpStream::connect(proxy.addr()).await.unwrap();
        assert!(round_trip(&mut before, b"ping", LONG).await.is_some());

        proxy.cut();
        assert!(closed(&mut before).await, "the open connection is closed");
        let mut during = TcpStream::connect(proxy.addr()).await.unwrap();
        assert!(
            closed(&mut during).await,
            "a new connection is closed at once"
        );
        assert_eq!(proxy.stats().refused, 1);
        assert_eq!(
            echo_accepted.load(Ordering::Relaxed),
            1,
            "nothing reached the target"
        );

        proxy.heal();
        let mut after = TcpStream::connect(proxy.addr()).await.unwrap();
        assert_eq!(
            round_trip(&mut after, b"again", LONG).await.as_deref(),
            Some(&b"again"[..])
        );
        assert_eq!(proxy.stats().accepted, 3);
        assert_eq!(proxy.stats().forwarded_connections, 2);
    }

    #[tokio::test]
    async fn a_black_hole_drops_bytes_silently_and_keeps_connections_open() {
        let (echo, echo_accepted) = echo_server().await;
        let proxy = FaultProxy::start(echo).await.unwrap();
        let mut before = TcpStream::connect(proxy.addr()).await.unwrap();
        assert!(round_trip(&mut before, b"ping", LONG).await.is_some());
        let forwarded = proxy.stats();

        proxy.black_hole();
        // Let the connection's pump see the new mode before writing.
        tokio::time::sleep(Duration::from_millis(50)).await;
        assert_eq!(
            round_trip(&mut before, b"lost", QUIET).await,
            None,
            "no echo through a black hole"
        );
        let mut during = TcpStream::connect(proxy.addr()).await.unwrap();
        assert_eq!(round_trip(&mut during, b"void", QUIET).await, None);
        let stats = proxy.stats();
        assert_eq!(
            (stats.bytes_up, stats.bytes_down),
            (forwarded.bytes_up, forwarded.bytes_down)
        );
        assert_eq!(stats.bytes_dropped, 8, "both messages dropped");
        assert_eq!(stats.refused, 0, "connections are accepted, not refused");
        assert_eq!(
            echo_accepted.load(Ordering::Relaxed),
            1,
            "the new connection was never forwarded"
        );

        proxy.heal();
        // Both lost bytes: they are closed rather than resumed with a gap.
        assert!(closed(&mut before).await);
        assert!(closed(&mut during).await);
        let mut after = TcpStream::connect(proxy.addr()).await.unwrap();
        assert_eq!(
            round_trip(&mut after, b"back", LONG).await.as_deref(),
            Some(&b"back"[..])
        );
    }

    #[tokio::test]
    async fn a_close_does_not_cross_a_black_hole() {
        let (echo, _, echo_closed) = echo_server_counting_closes().await;
        let proxy = FaultProxy::start(echo).await.unwrap();
        let mut client = TcpStream::connect(proxy.addr()).await.unwrap();
        assert!(round_trip(&mut client, b"ping", LONG).await.is_some());
        proxy.black_hole();
        tokio::time::sleep(Duration::from_millis(50)).await;
        drop(client);
        tokio::time::sleep(QUIET).await;
        assert_eq!(
            echo_closed.load(Ordering::Relaxed),
            0,
            "the target was not told"
        );
        proxy.heal();
        eventually_true(|| echo_closed.load(Ordering::Relaxed) == 1).await;
    }

    /// Waits (a few seconds at most) until `check` holds.
    async fn eventually_true(check: impl Fn() -> bool) {
        for _ in 0..100 {
            if check() {
                return;
            }
            tokio::time::sleep(Duration::from_millis(50)).await;
        }
        panic!("never happened");
    }

    #[tokio::test]
    async fn a_connection_that_lost_nothing_resumes_after_a_black_hole() {
        let (echo, _) = echo_server().await;
        let proxy = FaultProxy::start(echo).await.unwrap();
        let mut idle = TcpStream::connect(proxy.addr()).await.unwrap();
        assert!(round_trip(&mut idle, b"one", LONG).await.is_some());
        proxy.black_hole();
        tokio::time::sleep(Duration::from_millis(50)).await;
        proxy.heal();
        tokio::time::sleep(Duration::from_millis(50)).await;
        assert_eq!(
            round_trip(&mut idle, b"two", LONG).await.as_deref(),
            Some(&b"two"[..])
        );
    }

    #[tokio::test]
    async fn it_only_forwards_to_loopback() {
        let remote: SocketAddr = "192.0.2.1:80".parse().unwrap();
        assert!(FaultProxy::start(remote).await.is_err());
    }
}
