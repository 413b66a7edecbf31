//! Real processes for end-to-end tests: the workspace's binaries, started
//! with their own flags and killed when the test is done (or panics).

use std::collections::BTreeSet;
use std::net::{SocketAddr, TcpListener, UdpSocket};
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::sync::Mutex;

use anyhow::{Context, bail};
use tokio::io::{AsyncReadExt, AsyncWriteExt};

/// Path of a workspace binary of the caller's build profile, brought up to
/// date by cargo once per test process (a test run of one package alone
/// would otherwise start another package's stale binary).
pub fn binary(name: &str) -> PathBuf {
    static BUILT: Mutex<BTreeSet<String>> = Mutex::new(BTreeSet::new());
    // Test binaries live in target/<profile>/deps, binaries (this one too,
    // when a binary calls) in target/<profile>.
    let exe = std::env::current_exe().expect("current exe");
    let mut dir = exe.parent().expect("target dir");
    if dir.ends_with("deps") {
        dir = dir.parent().expect("target dir");
    }
    let path = dir.join(name);
    let mut built = BUILT.lock().unwrap_or_else(|e| e.into_inner());
    if !built.contains(name) {
        let cargo = std::env::var("CARGO").unwrap_or_else(|_| "cargo".into());
        let mut build = Command::new(cargo);
        build.args(["build", "--quiet", "--workspace", "--bin", name]);
        if dir.ends_with("release") {
            build.arg("--release");
        }
        let status = build.status().expect("run cargo build");
        assert!(status.success(), "cargo build --bin {name} failed");
        built.insert(name.to_owned());
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
        Self::start_logged(binary, args, envs, None)
            .unwrap_or_else(|e| panic!("start {binary}: {e:#}"))
    }

    /// Starts `binary`; its output goes to `log` if given (else to ours).
    pub fn start_logged(
        binary: &str,
        args: &[String],
        envs: &[(&str, String)],
        log: Option<&Path>,
    ) -> anyhow::Result<Process> {
        Self::spawn_logged(&self::binary(binary), binary, args, envs, log)
    }

    /// Starts the program at `path`, called `name` in errors; its output
    /// goes to `log` if given (else to ours).
    pub fn spawn_logged(
        path: &Path,
        name: &str,
        args: &[String],
        envs: &[(&str, String)],
        log: Option<&Path>,
    ) -> anyhow::Result<Process> {
        let mut command = Command::new(path);
        command.args(args).stdin(Stdio::null());
        for (k, v) in envs {
            command.env(k, v);
        }
        if let Some(log) = log {
            let file =
                std::fs::File::create(log).with_context(|| format!("create {}", log.display()))?;
            command.stdout(file.try_clone()?).stderr(file);
        }
        let child = command
            .spawn()
            .with_context(|| format!("start {}", path.display()))?;
        Ok(Process {
            name: name.to_owned(),
            child,
        })
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

    /// Asks the process to stop (SIGTERM) and waits up to `grace` for it;
    /// then kills it. Returns whether it exited on its own, successfully.
    pub fn stop(&mut self, grace: std::time::Duration) -> bool {
        if let Ok(Some(status)) = self.child.try_wait() {
            return status.success();
        }
        let pid = nix::unistd::Pid::from_raw(self.child.id() as i32);
        let _ = nix::sys::signal::kill(pid, nix::sys::signal::Signal::SIGTERM);
        let deadline = std::time::Instant::now() + grace;
        while std::time::Instant::now() < deadline {
            if let Ok(Some(status)) = self.child.try_wait() {
                return status.success();
            }
            std::thread::sleep(std::time::Duration::from_millis(50));
        }
        self.kill();
        false
    }

    /// Its process id.
    pub fn pid(&self) -> u32 {
        self.child.id()
    }

    /// The resident memory of the process in bytes (Linux `VmRSS`).
    pub fn rss_bytes(&self) -> Option<u64> {
        memory_kib(&self.child.id().to_string(), "VmRSS").map(|kib| kib * 1024)
    }

    /// Sends `signal` (say SIGSTOP to freeze it, SIGCONT to let it go on).
    pub fn signal(&self, signal: nix::sys::signal::Signal) -> anyhow::Result<()> {
        let pid = nix::unistd::Pid::from_raw(i32::try_from(self.child.id())?);
        nix::sys::signal::kill(pid, signal)?;
        Ok(())
    }

    /// Sends SIGKILL and waits for the process to go.
    pub fn kill(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }

    /// An error naming the process if it has exited.
    pub fn check_running(&mut self) -> anyhow::Result<()> {
        match self.child.try_wait() {
            Ok(Some(status)) => bail!("{} exited: {status}", self.name),
            _ => Ok(()),
        }
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

/// A memory figure (in KiB) of process `pid` (or `"self"`) from Linux's
/// `/proc/<pid>/status`: `field` is, say, `VmRSS` (resident now) or `VmHWM`
/// (the peak resident since start, or since `5` was written to
/// `/proc/<pid>/clear_refs`).
pub fn memory_kib(pid: &str, field: &str) -> Option<u64> {
    let status = std::fs::read_to_string(format!("/proc/{pid}/status")).ok()?;
    status
        .lines()
        .find_map(|l| l.strip_prefix(field)?.strip_prefix(':'))?
        .split_whitespace()
        .next()?
        .parse()
        .ok()
}
