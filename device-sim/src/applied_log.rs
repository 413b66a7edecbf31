//! The applied log: one JSON line per desired state a device applied,
//! `{"device":"<ns>/<name>","generation":N,"at_ms":<unix ms>}`, for measuring
//! propagation latency from outside.
//!
//! Devices hand entries to one writer thread through a channel, so a slow
//! disk never stalls a device; the writer flushes whenever it has caught up,
//! so a reader tailing the file sees each line promptly.

use std::fs::{File, OpenOptions};
use std::io::{self, BufWriter, Write};
use std::path::Path;
use std::time::{SystemTime, UNIX_EPOCH};

use serde::Serialize;
use tokio::sync::mpsc;
use tokio::task::JoinHandle;

/// One line of the log.
#[derive(Clone, Debug, PartialEq, Eq, Serialize)]
pub struct AppliedEntry {
    /// `<namespace>/<name>`.
    pub device: String,
    /// The generation applied.
    pub generation: i64,
    /// When, in milliseconds since the Unix epoch.
    pub at_ms: u64,
}

impl AppliedEntry {
    /// An entry stamped with the current time.
    pub fn now(device: String, generation: i64) -> Self {
        let at_ms = SystemTime::now()
            .duration_since(UNIX_EPOCH)
            .map_or(0, |d| u64::try_from(d.as_millis()).unwrap_or(u64::MAX));
        AppliedEntry {
            device,
            generation,
            at_ms,
        }
    }

    /// The entry as a JSON line (newline included).
    pub fn to_line(&self) -> String {
        let mut line = serde_json::to_string(self).expect("an entry always serializes");
        line.push('\n');
        line
    }
}

/// The sending side: cheap to clone, one per device.
#[derive(Clone, Debug)]
pub struct AppliedLog {
    tx: mpsc::UnboundedSender<AppliedEntry>,
}

impl AppliedLog {
    /// Opens `path` for appending (creating it) and starts the writer. The
    /// writer ends, flushing everything, once every [`AppliedLog`] is dropped.
    pub fn open(path: &Path) -> io::Result<(Self, JoinHandle<io::Result<()>>)> {
        let file = OpenOptions::new().create(true).append(true).open(path)?;
        let (tx, rx) = mpsc::unbounded_channel();
        let writer = tokio::task::spawn_blocking(move || write_entries(file, rx));
        Ok((AppliedLog { tx }, writer))
    }

    /// Records an entry.
    pub fn record(&self, entry: AppliedEntry) {
        // Fails only once the writer died of an I/O error, reported by it.
        let _ = self.tx.send(entry);
    }
}

fn write_entries(file: File, mut rx: mpsc::UnboundedReceiver<AppliedEntry>) -> io::Result<()> {
    let mut out = BufWriter::new(file);
    while let Some(entry) = rx.blocking_recv() {
        out.write_all(entry.to_line().as_bytes())?;
        if rx.is_empty() {
            out.flush()?;
        }
    }
    out.flush()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn an_entry_is_one_json_line() {
        let entry = AppliedEntry {
            device: "plant/t-1".into(),
            generation: 3,
            at_ms: 1_700_000_000_123,
        };
        assert_eq!(
            entry.to_line(),
            "{\"device\":\"plant/t-1\",\"generation\":3,\"at_ms\":1700000000123}\n"
        );
    }

    #[test]
    fn entries_are_stamped_with_the_wall_clock() {
        let before = SystemTime::now()
            .duration_since(UNIX_EPOCH)
            .unwrap()
            .as_millis() as u64;
        let entry = AppliedEntry::now("a/b".into(), 1);
        assert!(entry.at_ms >= before && entry.at_ms < before + 60_000);
    }

    #[tokio::test]
    async fn the_writer_appends_and_flushes_every_entry() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("applied.jsonl");
        std::fs::write(&path, "earlier\n").unwrap();

        let (log, writer) = AppliedLog::open(&path).unwrap();
        log.record(AppliedEntry {
            device: "a/b".into(),
            generation: 1,
            at_ms: 5,
        });
        log.clone().record(AppliedEntry {
            device: "a/c".into(),
            generation: 2,
            at_ms: 6,
        });
        drop(log);
        writer.await.unwrap().unwrap();

        let text = std::fs::read_to_string(&path).unwrap();
        assert_eq!(
            text,
            "earlier\n\
             {\"device\":\"a/b\",\"generation\":1,\"at_ms\":5}\n\
             {\"device\":\"a/c\",\"generation\":2,\"at_ms\":6}\n"
        );
    }
}
