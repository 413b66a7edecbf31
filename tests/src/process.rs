//! Real processes for end-to-end tests: the workspace's binaries, started
//! with their own flags and killed when the test is done (or panics).

use std::collections::BTreeSet;
use std::net::{SocketAddr, TcpListener, UdpSocket};
use std::path::PathBuf;
use std::process::{Child, Command, Stdio};
use std::sync::Mutex;

use anyhow::{Context, bail};
use tokio::io::{AsyncReadExt, AsyncWriteExt};

/// Path of a workspace binary, built first if it is not there yet.
pub fn binary(name: &str) -> PathBuf {
    static BUILD: Mutex<()> = Mutex::new(());
    // Test binaries live in target/<profile>/deps; binaries one level up.
    let exe = std::env::current_exe().expect("current exe");
    let dir = exe.parent().and_then(|p| p.parent()).expect("target dir");
    let path = dir.join(name);
    let _guard = BUILD.lock().unwrap_or_else(|e| e.into_inner());
    if !path.exists() {
        let cargo = std::env::var("CARGO").unwrap_or_else(|_| "cargo".into());
        let status = Command::new(cargo)
            .args(["build", "--bin", name])
            .status()
            .expect("run cargo build");
        assert!(status.success(), "cargo build --bin {name} failed");
    }
    path
}

/// A free TCP port on loopback. Ports handed out once are never handed out
/// again in this process, so tests running in parallel cannot be given the
/// same port between one picking it and its process binding it.
pub fn free_tcp_addr() -> SocketAddr {
    unclaimed(|| {
        TcpListener::bind("127.0.0.1:0")
            .unwrap()
            .local_addr()
            .unwrap()
    })
}

/// A free UDP port on loopback, never handed out before in this process.
pub fn free_udp_addr() -> SocketAddr {
    unclaimed(|| {
        UdpSocket::bind("127.0.0.1:0")
            .unwrap()
            .local_addr()
            .unwrap()
    })
}

fn unclaimed(mut pick: impl FnMut() -> SocketAddr) -> SocketAddr {
    static CLAIMED: Mutex<BTreeSet<u16>> = Mutex::new(BTreeSet::new());
    let mut claimed = CLAIMED.lock().unwrap_or_else(|e| e.into_inner());
    loop {
        let addr = pick();
        if claimed.insert(addr.port()) {
            return addr;
        }
    }
}

/// A child process that is killed when dropped.
#[derive(Debug)]
pub struct Process {
    name: String,
    child: Child,
}

impl Process {
    /// Starts `binary` with `args` and `envs`; its output goes to the test's.
    pub fn start(binary: &str, args: &[String], envs: &[(&str, String)]) -> Process {
        let mut command = Command::new(self::binary(binary));
        command.args(args).stdin(Stdio::null());
        for (k, v) in envs {
            command.env(k, v);
        }
        let child = command
            .spawn()
            .unwrap_or_else(|e| panic!("start {binary}: {e}"));
        Process {
            name: binary.to_owned(),
            child,
        }
    }

    /// Starts a program that is not part of the workspace (a broker, say).
    pub fn start_path(program: &str, args: &[String]) -> Process {
        let child = Command::new(program)
            .args(args)
            .stdin(Stdio::null())
            .spawn()
            .unwrap_or_else(|e| panic!("start {program}: {e}"));
        Process {
            name: program.to_owned(),
            child,
        }
    }

    /// Sends SIGKILL and waits for the process to go.
    pub fn kill(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }

    /// Fails if the process has exited.
    pub fn assert_running(&mut self) {
        if let Ok(Some(status)) = self.child.try_wait() {
            panic!("{} exited: {status}", self.name);
        }
    }
}

impl Drop for Process {
    fn drop(&mut self) {
        self.kill();
    }
}

/// A plain HTTP/1.0 GET on loopback: (status code, body).
pub async fn http_get(addr: SocketAddr, path: &str) -> anyhow::Result<(u16, String)> {
    let mut stream = tokio::net::TcpStream::connect(addr)
        .await
        .with_context(|| format!("connect {addr}"))?;
    stream
        .write_all(format!("GET {path} HTTP/1.0\r\nHost: {addr}\r\n\r\n").as_bytes())
        .await?;
    let mut response = String::new();
    stream.read_to_string(&mut response).await?;
    let Some((head, body)) = response.split_once("\r\n\r\n") else {
        bail!("no HTTP response from {addr}{path}");
    };
    let code = head
        .split_whitespace()
        .nth(1)
        .and_then(|c| c.parse().ok())
        .with_context(|| format!("bad status line {head:?}"))?;
    Ok((code, body.to_owned()))
}

/// The value of one sample in a Prometheus text exposition, or 0 if absent.
pub fn metric(exposition: &str, sample: &str) -> f64 {
    exposition
        .lines()
        .find_map(|line| line.strip_prefix(sample)?.strip_prefix(' '))
        .and_then(|v| v.split_whitespace().next()?.parse().ok())
        .unwrap_or(0.0)
}
