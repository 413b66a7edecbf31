//! The external-broker path: Mosquitto's password file and ACL file, made
//! from the device keys the agent holds, so that Mosquitto enforces what
//! the guard enforces in front of the embedded broker (see [`super::acl`]).
//!
//! Mosquitto (2.0) runs with these lines in its listener's configuration
//! (docs/security.md has the whole recipe):
//!
//! ```text
//! allow_anonymous false
//! use_username_as_clientid true
//! password_file <dir>/passwd
//! acl_file <dir>/acl
//! ```
//!
//! `use_username_as_clientid` makes each client's id its user name, so no
//! device can take the agent's client id. The agent logs in under that id
//! with a password it makes at each start. It writes both files before it
//! connects and again whenever a key arrives, changes or goes, then sends
//! Mosquitto `SIGHUP`: Mosquitto reads them again and disconnects the
//! clients whose login no longer holds.
//!
//! What the files cannot say: Mosquitto's ACLs do not tell a retained
//! publish from another, so a device can leave a retained message on its
//! own report or event topic. The agent refuses uplinks that reach it
//! retained (see [`super::run`]), so such a message is never taken twice.

use std::collections::HashMap;
use std::fmt::Write as _;
use std::io::Write as _;
use std::os::unix::fs::OpenOptionsExt as _;
use std::path::{Path, PathBuf};

use base64::Engine as _;
use base64::engine::general_purpose::STANDARD;
use edgefleet_shared::credential::{self, Psk};
use edgefleet_shared::telemetry::Outcomes;
use edgefleet_shared::{ResourceKey, topics};
use sha2::Sha512;

use super::acl;
use super::broker::{self, agent_client_id};
use crate::store::Store;

/// PBKDF2 rounds of a `$7$` hash: what `mosquitto_passwd` makes. The keys
/// are random (128 bits and more), so more rounds would protect nothing
/// and cost every login.
const ROUNDS: u32 = 101;
/// Salt bytes, as `mosquitto_passwd` makes.
const SALT_BYTES: usize = 12;
/// The password file's name in the directory.
pub const PASSWORD_FILE: &str = "passwd";
/// The ACL file's name in the directory.
pub const ACL_FILE: &str = "acl";

/// `password` hashed as Mosquitto's `$7$` (PBKDF2-HMAC-SHA512) with `salt`.
pub fn hash(password: &[u8], salt: &[u8; SALT_BYTES]) -> String {
    let mut digest = [0u8; 64];
    pbkdf2::pbkdf2_hmac::<Sha512>(password, salt, ROUNDS, &mut digest);
    format!(
        "$7${ROUNDS}${}${}",
        STANDARD.encode(salt),
        STANDARD.encode(digest)
    )
}

/// The ACL file of `node`: the agent may do anything under the node's
/// topics; each device may publish its own `report` and `event` and read
/// its own `desired` and `event-ack`, and nothing else.
pub fn acl_file<'d>(node: &str, devices: impl IntoIterator<Item = &'d ResourceKey>) -> String {
    let mut acl = format!(
        "# Made by edgefleet-agent for node {node}; rewritten when a device key changes.\n\
         user {}\ntopic readwrite {}/{node}/#\n",
        agent_client_id(node),
        topics::ROOT
    );
    for device in devices {
        let _ = writeln!(acl, "\nuser {}", credential::login_name(device));
        for topic in acl::publishes(node, device) {
            let _ = writeln!(acl, "topic write {topic}");
        }
        for topic in acl::subscriptions(node, device) {
            let _ = writeln!(acl, "topic read {topic}");
        }
    }
    acl
}

/// The two files of one node, kept in a directory Mosquitto reads.
#[derive(Debug)]
pub struct AuthFiles {
    node: String,
    dir: PathBuf,
    pid_file: PathBuf,
    group: Option<u32>,
    agent: Psk,
    // Each user's key and its hash: an unchanged key keeps its line, so an
    // unchanged set of keys leaves the files (and Mosquitto) alone.
    hashes: HashMap<String, (Psk, String)>,
    written: Option<(String, String)>,
}

impl AuthFiles {
    /// The files of `node` in `dir`, for the Mosquitto whose process id is
    /// in `pid_file`; readable by `group` if given (mode 0640).
    pub fn new(node: &str, dir: &Path, pid_file: &Path, group: Option<u32>) -> AuthFiles {
        AuthFiles {
            node: node.to_owned(),
            dir: dir.to_owned(),
            pid_file: pid_file.to_owned(),
            group,
            agent: broker::fresh_secret(),
            hashes: HashMap::new(),
            written: None,
        }
    }

    /// The agent's user name (its client id) and password.
    pub fn agent_login(&self) -> (String, String) {
        (agent_client_id(&self.node), broker::text(&self.agent))
    }

    /// Writes the files for `keys` if what they say changed; whether they
    /// did.
    pub fn write(&mut self, keys: &[(ResourceKey, Psk)]) -> std::io::Result<bool> {
        let users = std::iter::once((agent_client_id(&self.node), &self.agent))
            .chain(keys.iter().map(|(d, k)| (credential::login_name(d), k)));
        let mut passwords = String::new();
        let mut hashes = HashMap::with_capacity(keys.len() + 1);
        for (user, key) in users {
            let line = match self.hashes.remove(&user) {
                Some((held, line)) if held == *key => line,
                _ => hash(key.as_bytes(), &rand::random()),
            };
            let _ = writeln!(passwords, "{user}:{line}");
            hashes.insert(user, (key.clone(), line));
        }
        self.hashes = hashes;
        let acl = acl_file(&self.node, keys.iter().map(|(d, _)| d));
        let files = (passwords, acl);
        if self.written.as_ref() == Some(&files) {
            return Ok(false);
        }
        self.replace(PASSWORD_FILE, &files.0)?;
        self.replace(ACL_FILE, &files.1)?;
        self.written = Some(files);
        Ok(true)
    }

    /// Replaces the file `name` with `contents` at once (a rename), so
    /// Mosquitto never reads half of one.
    fn replace(&self, name: &str, contents: &str) -> std::io::Result<()> {
        let path = self.dir.join(name);
        let partial = self.dir.join(format!(".{name}.partial"));
        let mut file = std::fs::OpenOptions::new()
            .write(true)
            .create(true)
            .truncate(true)
            .mode(0o640)
            .open(&partial)?;
        file.write_all(contents.as_bytes())?;
        file.sync_all()?;
        if let Some(group) = self.group {
            std::os::unix::fs::fchown(&file, None, Some(group))?;
        }
        std::fs::rename(&partial, &path)
    }

    /// Tells Mosquitto to read the files again (`SIGHUP`).
    pub fn reload(&self) -> Result<(), String> {
        let text = std::fs::read_to_string(&self.pid_file)
            .map_err(|e| format!("read {}: {e}", self.pid_file.display()))?;
        let pid: i32 = text
            .trim()
            .parse()
            .map_err(|_| format!("{} holds no process id", self.pid_file.display()))?;
        let pid = nix::unistd::Pid::from_raw(pid);
        nix::sys::signal::kill(pid, nix::sys::signal::Signal::SIGHUP)
            .map_err(|e| format!("SIGHUP to Mosquitto ({pid}): {e}"))
    }
}

/// Keeps the files equal to the keys in `store` and Mosquitto reading
/// them, until the process ends. `outcomes` counts each rewrite:
/// `written`, `write_failed` or `reload_failed` (retried at the next
/// change, and every 10 s while failing).
pub async fn run(mut files: AuthFiles, store: Store, outcomes: std::sync::Arc<Outcomes>) {
    let mut changes = store.any_credential_watch();
    let mut pending_reload = false;
    loop {
        changes.mark_unchanged();
        let keys = match store.credentials() {
            Ok(keys) => keys,
            Err(e) => {
                tracing::error!(error = %e, "read the device keys for Mosquitto");
                outcomes.inc("write_failed");
                Vec::new()
            }
        };
        // Hashing thousands of keys takes a while: not on the runtime.
        let (back, written) = tokio::task::spawn_blocking(move || {
            let written = files.write(&keys);
            (files, written)
        })
        .await
        .expect("the file writer does not panic");
        files = back;
        let mut retry = false;
        match written {
            Ok(changed) => pending_reload |= changed,
            Err(e) => {
                tracing::error!(error = %e, dir = %files.dir.display(), "write Mosquitto's password and ACL files");
                outcomes.inc("write_failed");
                retry = true;
            }
        }
        if pending_reload {
            match files.reload() {
                Ok(()) => {
                    outcomes.inc("written");
                    pending_reload = false;
                }
                Err(e) => {
                    tracing::warn!(error = %e, "Mosquitto was not told to read its files again");
                    outcomes.inc("reload_failed");
                    retry = true;
                }
            }
        }
        let wait = async {
            match retry {
                true => tokio::time::sleep(std::time::Duration::from_secs(10)).await,
                false => std::future::pending().await,
            }
        };
        tokio::select! {
            changed = changes.changed() => if changed.is_err() { return },
            () = wait => {}
        }
    }
}

#[cfg(test)]
mod tests {
    use std::os::unix::fs::MetadataExt as _;

    use super::*;

    /// A line `mosquitto_passwd -b pw t1@plant 0123456789abcdef` made
    /// (Debian's Mosquitto 2.0.11).
    const MADE_BY_MOSQUITTO: &str = "t1@plant:$7$101$WHLIAvnrVgDWQEwg$kMEKNUiEmzjHum0f9NfECBm4eVhz7fj613tXU2/KC0HxoTEq8RdISBQlsPwFTECdOwciOYY7imFTkzlaXtqwQQ==";

    fn psk(text: &str) -> Psk {
        Psk::new(text.as_bytes().to_vec()).unwrap()
    }

    #[test]
    fn hashes_are_mosquittos_own() {
        let (_, line) = MADE_BY_MOSQUITTO.split_once(':').unwrap();
        let salt64 = line.split('$').nth(3).unwrap();
        let salt: [u8; SALT_BYTES] = STANDARD.decode(salt64).unwrap().try_into().unwrap();
        assert_eq!(hash(b"0123456789abcdef", &salt), line);
        assert_ne!(hash(b"0123456789abcdeX", &salt), line);
    }

    #[test]
    fn the_acl_gives_each_device_its_own_topics_only() {
        let t1 = ResourceKey::device("plant", "t1");
        let acl = acl_file("edge-1", [&t1]);
        let blocks: Vec<&str> = acl.split("\n\n").collect();
        assert_eq!(blocks.len(), 2);
        assert!(
            blocks[0].ends_with("user edgefleet-agent-edge-1\ntopic readwrite edgefleet/edge-1/#"),
            "{acl}"
        );
        assert_eq!(
            blocks[1],
            "user t1@plant\n\
             topic write edgefleet/edge-1/plant/t1/report\n\
             topic write edgefleet/edge-1/plant/t1/event\n\
             topic read edgefleet/edge-1/plant/t1/desired\n\
             topic read edgefleet/edge-1/plant/t1/event-ack\n"
        );
    }

    #[test]
    fn files_change_only_when_the_keys_do() {
        let dir = tempfile::tempdir().unwrap();
        let gid = std::fs::metadata(dir.path()).unwrap().gid();
        let mut files = AuthFiles::new("edge-1", dir.path(), &dir.path().join("pid"), Some(gid));
        let t1 = ResourceKey::device("plant", "t1");
        let t2 = ResourceKey::device("plant", "t2");
        let keys = vec![(t1.clone(), psk("t1-0123456789abcdef"))];
        assert!(files.write(&keys).unwrap());
        let read = |name| std::fs::read_to_string(dir.path().join(name)).unwrap();
        let passwd = read(PASSWORD_FILE);
        let users: Vec<&str> = passwd
            .lines()
            .map(|l| l.split(':').next().unwrap())
            .collect();
        assert_eq!(users, ["edgefleet-agent-edge-1", "t1@plant"]);
        let meta = std::fs::metadata(dir.path().join(PASSWORD_FILE)).unwrap();
        assert_eq!(meta.mode() & 0o777, 0o640);
        assert_eq!(meta.gid(), gid);
        // The same keys: nothing rewritten, the same salts kept.
        assert!(!files.write(&keys).unwrap());
        assert_eq!(read(PASSWORD_FILE), passwd);
        // A new device, then a rotated key, then a revoked one.
        let both = vec![keys[0].clone(), (t2.clone(), psk("t2-0123456789abcdef"))];
        assert!(files.write(&both).unwrap());
        assert!(
            read(PASSWORD_FILE).starts_with(&passwd),
            "t1 keeps its line"
        );
        assert!(read(ACL_FILE).contains("user t2@plant"));
        let rotated = vec![(t1, psk("t1-fedcba9876543210")), both[1].clone()];
        assert!(files.write(&rotated).unwrap());
        let t1_line = |text: String| text.lines().nth(1).unwrap().to_owned();
        assert_ne!(t1_line(read(PASSWORD_FILE)), t1_line(passwd));
        assert!(files.write(&rotated[1..]).unwrap());
        assert!(!read(PASSWORD_FILE).contains("t1@plant"));
        assert!(!read(ACL_FILE).contains("t1@plant"));
    }

    #[test]
    fn a_missing_or_empty_pid_file_is_an_error_not_a_signal() {
        let dir = tempfile::tempdir().unwrap();
        let pid_file = dir.path().join("pid");
        let files = AuthFiles::new("edge-1", dir.path(), &pid_file, None);
        assert!(files.reload().unwrap_err().contains("read"));
        std::fs::write(&pid_file, "\n").unwrap();
        assert!(files.reload().unwrap_err().contains("no process id"));
    }
}
