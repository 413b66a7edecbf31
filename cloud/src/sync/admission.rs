//! What a client gets before it has proved who it is, and how much of it.
//!
//! - Connections: at most [`Limits::max_connections`] in all and
//!   [`Limits::max_per_address`] from one peer address; beyond, a new one is
//!   closed at once, before TLS.
//! - A connection that has not opened an authenticated stream within
//!   [`Limits::authenticate_within`] is closed: an idle or unauthenticated
//!   connection holds its buffers that long at most.
//! - Streams: at most [`Limits::max_streams`] in all and
//!   [`Limits::max_per_address`] from one address (HTTP/2 lets 4 run on one
//!   connection, see `run.rs`); beyond, a stream is refused
//!   (`RESOURCE_EXHAUSTED`) before its token is reviewed.
//!
//! Every refusal is counted. Edge sites behind one NAT share an address:
//! raise `--max-per-address` for a site with more agents than that.

use std::collections::HashMap;
use std::io;
use std::net::{IpAddr, SocketAddr};
use std::pin::Pin;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex};
use std::task::{Context, Poll};
use std::time::Duration;

use edgefleet_shared::telemetry::Outcomes;
use tokio::io::{AsyncRead, AsyncWrite, ReadBuf};
use tokio::net::TcpStream;
use tokio::time::Sleep;
use tonic::transport::server::Connected;

/// The bounds.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Limits {
    /// Open connections in all.
    pub max_connections: usize,
    /// Open connections, and open streams, from one peer address.
    pub max_per_address: usize,
    /// Open streams in all.
    pub max_streams: usize,
    /// How long a connection may go without an authenticated stream.
    pub authenticate_within: Duration,
}

impl Default for Limits {
    fn default() -> Self {
        Limits {
            max_connections: 20_000,
            max_per_address: 64,
            max_streams: 20_000,
            authenticate_within: Duration::from_secs(10),
        }
    }
}

/// Counts of what is open, in all and by address.
#[derive(Debug, Default)]
struct Open {
    total: usize,
    by_address: HashMap<IpAddr, usize>,
}

impl Open {
    /// Takes a place for `address` if both bounds allow, else names the
    /// bound that refused.
    fn take(
        &mut self,
        address: IpAddr,
        max_total: usize,
        max_per_address: usize,
    ) -> Result<(), Bound> {
        let count = self.by_address.entry(address).or_default();
        if *count >= max_per_address {
            return Err(Bound::PerAddress);
        }
        if self.total >= max_total {
            if *count == 0 {
                self.by_address.remove(&address);
            }
            return Err(Bound::Total);
        }
        *count += 1;
        self.total += 1;
        Ok(())
    }

    fn give_back(&mut self, address: IpAddr) {
        self.total -= 1;
        if let Some(count) = self.by_address.get_mut(&address) {
            *count -= 1;
            if *count == 0 {
                self.by_address.remove(&address);
            }
        }
    }
}

/// Which bound refused.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Bound {
    /// The one over all peers.
    Total,
    /// The one per peer address.
    PerAddress,
}

/// The sync server's bounds and what is open against them.
#[derive(Debug)]
pub struct Admission {
    limits: Limits,
    connections: Mutex<Open>,
    streams: Mutex<Open>,
    counted: Outcomes,
}

impl Admission {
    /// Bounds `limits`; connections are counted by outcome in `counted`
    /// (`too_many_connections`, `too_many_from_address`,
    /// `unauthenticated_timeout`).
    pub fn new(limits: Limits, counted: Outcomes) -> Arc<Self> {
        Arc::new(Admission {
            limits,
            connections: Mutex::default(),
            streams: Mutex::default(),
            counted,
        })
    }

    /// `stream` with its place among the open connections, or `None` (it
    /// is dropped, so closed) when a bound refuses it.
    pub fn admit(self: &Arc<Self>, stream: TcpStream) -> Option<Guarded<TcpStream>> {
        let remote = stream.peer_addr().ok()?;
        let taken = self.connections.lock().expect("not poisoned").take(
            remote.ip(),
            self.limits.max_connections,
            self.limits.max_per_address,
        );
        if let Err(bound) = taken {
            let label = match bound {
                Bound::Total => "too_many_connections",
                Bound::PerAddress => "too_many_from_address",
            };
            self.counted.inc(label);
            tracing::debug!(%remote, label, "sync connection refused");
            return None;
        }
        Some(Guarded {
            io: stream,
            deadline: Box::pin(tokio::time::sleep(self.limits.authenticate_within)),
            info: Peer {
                remote,
                authenticated: Arc::default(),
            },
            _place: Place {
                admission: Arc::clone(self),
                address: remote.ip(),
                streams: false,
            },
        })
    }

    /// A place for one stream from `remote`, or the bound that refused it.
    pub fn stream(self: &Arc<Self>, remote: IpAddr) -> Result<Place, Bound> {
        self.streams.lock().expect("not poisoned").take(
            remote,
            self.limits.max_streams,
            self.limits.max_per_address,
        )?;
        Ok(Place {
            admission: Arc::clone(self),
            address: remote,
            streams: true,
        })
    }
}

/// A place among the open connections or streams, given back on drop.
#[derive(Debug)]
pub struct Place {
    admission: Arc<Admission>,
    address: IpAddr,
    streams: bool,
}

impl Drop for Place {
    fn drop(&mut self) {
        let open = match self.streams {
            true => &self.admission.streams,
            false => &self.admission.connections,
        };
        open.lock().expect("not poisoned").give_back(self.address);
    }
}

/// Who is at the other end of a connection, as a stream's request sees it.
#[derive(Clone, Debug)]
pub struct Peer {
    /// The peer's address.
    pub remote: SocketAddr,
    authenticated: Arc<AtomicBool>,
}

impl Peer {
    /// The connection carried an authenticated stream: it may stay.
    pub fn authenticated(&self) {
        self.authenticated.store(true, Ordering::Relaxed);
    }

    /// The peer of a request on a guarded connection, plaintext or TLS.
    pub fn of<T>(request: &tonic::Request<T>) -> Option<&Peer> {
        let extensions = request.extensions();
        extensions.get::<Peer>().or_else(|| {
            extensions
                .get::<tonic::transport::server::TlsConnectInfo<Peer>>()
                .map(|tls| tls.get_ref())
        })
    }
}

/// An admitted connection: closed (reads fail) when it carried no
/// authenticated stream in time; gives its place back when dropped.
#[derive(Debug)]
pub struct Guarded<IO> {
    io: IO,
    deadline: Pin<Box<Sleep>>,
    info: Peer,
    _place: Place,
}

impl<IO> Guarded<IO> {
    /// The peer's address.
    pub fn remote(&self) -> SocketAddr {
        self.info.remote
    }
}

impl<IO: AsyncRead + Unpin> AsyncRead for Guarded<IO> {
    fn poll_read(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        buf: &mut ReadBuf<'_>,
    ) -> Poll<io::Result<()>> {
        let this = &mut *self;
        if !this.info.authenticated.load(Ordering::Relaxed)
            && this.deadline.as_mut().poll(cx).is_ready()
        {
            this._place.admission.counted.inc("unauthenticated_timeout");
            tracing::debug!(remote = %this.info.remote, "sync connection closed: no authenticated stream in time");
            return Poll::Ready(Err(io::Error::new(
                io::ErrorKind::TimedOut,
                "no authenticated stream in time",
            )));
        }
        Pin::new(&mut this.io).poll_read(cx, buf)
    }
}

impl<IO: AsyncWrite + Unpin> AsyncWrite for Guarded<IO> {
    fn poll_write(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        buf: &[u8],
    ) -> Poll<io::Result<usize>> {
        Pin::new(&mut self.io).poll_write(cx, buf)
    }

    fn poll_flush(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<io::Result<()>> {
        Pin::new(&mut self.io).poll_flush(cx)
    }

    fn poll_shutdown(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<io::Result<()>> {
        Pin::new(&mut self.io).poll_shutdown(cx)
    }

    fn poll_write_vectored(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        bufs: &[io::IoSlice<'_>],
    ) -> Poll<io::Result<usize>> {
        Pin::new(&mut self.io).poll_write_vectored(cx, bufs)
    }

    fn is_write_vectored(&self) -> bool {
        self.io.is_write_vectored()
    }
}

impl<IO> Connected for Guarded<IO> {
    type ConnectInfo = Peer;

    fn connect_info(&self) -> Peer {
        self.info.clone()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn places_are_bounded_in_all_and_per_address_and_given_back() {
        let (a, b, c): (IpAddr, IpAddr, IpAddr) = (
            "10.0.0.1".parse().unwrap(),
            "10.0.0.2".parse().unwrap(),
            "10.0.0.3".parse().unwrap(),
        );
        let mut open = Open::default();
        assert_eq!(open.take(a, 3, 2), Ok(()));
        assert_eq!(open.take(a, 3, 2), Ok(()));
        assert_eq!(open.take(a, 3, 2), Err(Bound::PerAddress));
        assert_eq!(open.take(b, 3, 2), Ok(()));
        assert_eq!(open.take(c, 3, 2), Err(Bound::Total));
        open.give_back(a);
        assert_eq!(open.take(c, 3, 2), Ok(()));
        for address in [a, b, c] {
            open.give_back(address);
        }
        assert_eq!(open.total, 0);
        assert!(open.by_address.is_empty(), "{:?}", open.by_address);
    }

    #[tokio::test]
    async fn a_stream_place_is_given_back_when_dropped() {
        let admission = Admission::new(
            Limits {
                max_streams: 1,
                ..Limits::default()
            },
            Outcomes::default(),
        );
        let peer: IpAddr = "192.0.2.7".parse().unwrap();
        let place = admission.stream(peer).unwrap();
        assert_eq!(admission.stream(peer).unwrap_err(), Bound::Total);
        drop(place);
        assert!(admission.stream(peer).is_ok());
    }
}
