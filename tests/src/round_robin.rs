//! A stand-in for a Kubernetes Service in front of controller replicas: a
//! TCP forwarder on loopback that sends each new connection to the next
//! target in turn, skipping targets that refuse the connection (a killed
//! replica), as kube-proxy does once the endpoint is gone.

use std::net::SocketAddr;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};

use tokio::net::{TcpListener, TcpStream};
use tokio::task::JoinHandle;

/// The forwarder; stops accepting when dropped.
#[derive(Debug)]
pub struct RoundRobin {
    addr: SocketAddr,
    targets: Arc<Mutex<Vec<SocketAddr>>>,
    accept: JoinHandle<()>,
}

impl RoundRobin {
    /// Listens on a free loopback port in front of `targets`.
    pub async fn start(targets: Vec<SocketAddr>) -> anyhow::Result<RoundRobin> {
        let listener = TcpListener::bind("127.0.0.1:0").await?;
        let addr = listener.local_addr()?;
        let targets = Arc::new(Mutex::new(targets));
        let next = Arc::new(AtomicUsize::new(0));
        let accept = tokio::spawn({
            let targets = Arc::clone(&targets);
            async move {
                while let Ok((mut client, _)) = listener.accept().await {
                    let candidates = targets.lock().expect("targets").clone();
                    let start = next.fetch_add(1, Ordering::Relaxed);
                    tokio::spawn(async move {
                        for i in 0..candidates.len() {
                            let target = candidates[(start + i) % candidates.len()];
                            if let Ok(mut upstream) = TcpStream::connect(target).await {
                                let _ = upstream.set_nodelay(true);
                                let _ = client.set_nodelay(true);
                                let _ =
                                    tokio::io::copy_bidirectional(&mut client, &mut upstream).await;
                                return;
                            }
                        }
                    });
                }
            }
        });
        Ok(RoundRobin {
            addr,
            targets,
            accept,
        })
    }

    /// Where clients connect.
    pub fn addr(&self) -> SocketAddr {
        self.addr
    }

    /// Adds a target (a replica scaled up).
    pub fn add(&self, target: SocketAddr) {
        self.targets.lock().expect("targets").push(target);
    }
}

impl Drop for RoundRobin {
    fn drop(&mut self) {
        self.accept.abort();
    }
}
