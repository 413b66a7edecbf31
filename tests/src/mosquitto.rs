//! Debian's Mosquitto on a loopback port, for the tests that need an
//! external MQTT broker; killed when dropped. Open to anyone, or with the
//! device logins and ACLs of the files an agent keeps
//! ([`Mosquitto::start_authenticated`]).

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
    /// With logins: the directory of the agent's files, and the file the
    /// process id goes to (for the agent's SIGHUP).
    auth: Option<(PathBuf, PathBuf)>,
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
        Mosquitto::start_conf(dir, "allow_anonymous true\n", extra_conf, None)
    }

    /// Mosquitto with device logins: it reads the password and ACL files
    /// an agent keeps when started with [`Mosquitto::agent_args`]. Until
    /// the agent writes them they are empty, and nobody gets in.
    pub fn start_authenticated(dir: &Path) -> Mosquitto {
        let auth = dir.join("auth");
        std::fs::create_dir_all(&auth).expect("create the auth directory");
        for file in ["passwd", "acl"] {
            std::fs::write(auth.join(file), "").expect("create an empty auth file");
        }
        let logins = format!(
            "allow_anonymous false\nuse_username_as_clientid true\n\
             password_file {0}/passwd\nacl_file {0}/acl\n",
            auth.display()
        );
        let pid_file = dir.join("mosquitto.pid");
        Mosquitto::start_conf(dir, &logins, "", Some((auth, pid_file)))
    }

    fn start_conf(
        dir: &Path,
        logins: &str,
        extra_conf: &str,
        auth: Option<(PathBuf, PathBuf)>,
    ) -> Mosquitto {
        let addr = free_tcp_addr();
        let conf = dir.join("mosquitto.conf");
        std::fs::write(
            &conf,
            format!(
                "listener {} {}\n{logins}persistence false\n{extra_conf}",
                addr.port(),
                addr.ip()
            ),
        )
        .expect("write mosquitto.conf");
        let mut mosquitto = Mosquitto {
            addr,
            conf,
            process: None,
            auth,
        };
        mosquitto.restart();
        mosquitto
    }

    /// The agent's flags that make it keep this Mosquitto's files (none
    /// when it is open to anyone).
    pub fn agent_args(&self) -> Vec<String> {
        let Some((dir, pid_file)) = &self.auth else {
            return Vec::new();
        };
        let group = nix::unistd::Group::from_name("mosquitto")
            .ok()
            .flatten()
            .expect("a group `mosquitto` (Debian's package `mosquitto`; .ci/run installs it)");
        vec![
            format!("--mosquitto-auth-dir={}", dir.display()),
            format!("--mosquitto-pid-file={}", pid_file.display()),
            format!("--mosquitto-files-gid={}", group.gid),
        ]
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
        let process = Process::start_path(program, &["-c".into(), self.conf.display().to_string()]);
        if let Some((_, pid_file)) = &self.auth {
            std::fs::write(pid_file, process.pid().to_string()).expect("write the pid file");
        }
        self.process = Some(process);
    }

    /// Waits until it accepts connections.
    pub async fn wait_listening(&self) {
        eventually("Mosquitto listens", || async {
            tokio::net::TcpStream::connect(self.addr).await.ok()
        })
        .await;
    }
}
