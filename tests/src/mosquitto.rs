//! Debian's Mosquitto on a loopback port, for the tests that need an
//! external MQTT broker; killed when dropped.

use std::net::SocketAddr;
use std::path::{Path, PathBuf};

use crate::eventually;
use crate::process::{Process, free_tcp_addr};

/// A Mosquitto process that can be killed and started again on the same
/// port.
#[derive(Debug)]
pub struct Mosquitto {
    /// Where it listens.
    pub addr: SocketAddr,
    conf: PathBuf,
    process: Option<Process>,
}

impl Mosquitto {
    /// Starts Mosquitto with its configuration in `dir`. No persistence: a
    /// restart forgets retained messages and sessions, so the agent must
    /// publish desired state again.
    pub fn start(dir: &Path) -> Mosquitto {
        Mosquitto::start_with(dir, "")
    }

    /// [`Mosquitto::start`] with more lines of configuration.
    pub fn start_with(dir: &Path, extra_conf: &str) -> Mosquitto {
        let addr = free_tcp_addr();
        let conf = dir.join("mosquitto.conf");
        std::fs::write(
            &conf,
            format!(
                "listener {} {}\nallow_anonymous true\npersistence false\n{extra_conf}",
                addr.port(),
                addr.ip()
            ),
        )
        .expect("write mosquitto.conf");
        let mut mosquitto = Mosquitto {
            addr,
            conf,
            process: None,
        };
        mosquitto.restart();
        mosquitto
    }

    /// Kills it with SIGKILL.
    pub fn kill(&mut self) {
        if let Some(mut process) = self.process.take() {
            process.kill();
        }
    }

    /// Starts it (again) with the same configuration.
    pub fn restart(&mut self) {
        let program = ["/usr/sbin/mosquitto", "/usr/bin/mosquitto"]
            .into_iter()
            .find(|p| Path::new(p).exists())
            .expect("mosquitto is installed (Debian package `mosquitto`; .ci/run installs it)");
        self.process = Some(Process::start_path(
            program,
            &["-c".into(), self.conf.display().to_string()],
        ));
    }

    /// Waits until it accepts connections.
    pub async fn wait_listening(&self) {
        eventually("Mosquitto listens", || async {
            tokio::net::TcpStream::connect(self.addr).await.ok()
        })
        .await;
    }
}
