//! The simulator's counters and the one-line summary printed from them.
//!
//! Every report ends one way: acknowledged (CoAP 2.xx or MQTT PUBACK),
//! refused (a CoAP error code, counted by code) or failed (no answer after
//! every retransmission, or it could not be sent at all). Reports still in
//! flight are in `sent` only.

use std::collections::BTreeMap;
use std::fmt;
use std::sync::Mutex;
use std::sync::atomic::{AtomicU64, Ordering};

/// Live counters, shared by every task of a simulation.
#[derive(Debug, Default)]
pub struct Stats {
    devices: AtomicU64,
    reports_sent: AtomicU64,
    reports_acknowledged: AtomicU64,
    reports_failed: AtomicU64,
    retransmissions: AtomicU64,
    desired_applied: AtomicU64,
    desired_deleted: AtomicU64,
    desired_malformed: AtomicU64,
    refused: Mutex<BTreeMap<String, u64>>,
}

fn bump(counter: &AtomicU64, by: u64) {
    counter.fetch_add(by, Ordering::Relaxed);
}

impl Stats {
    /// `n` more devices are simulated.
    pub fn add_devices(&self, n: u64) {
        bump(&self.devices, n);
    }

    /// A report was sent (for CoAP: its first transmission).
    pub fn report_sent(&self) {
        bump(&self.reports_sent, 1);
    }

    /// A report was acknowledged.
    pub fn report_acknowledged(&self) {
        bump(&self.reports_acknowledged, 1);
    }

    /// A report got no answer, or could not be sent.
    pub fn report_failed(&self) {
        bump(&self.reports_failed, 1);
    }

    /// A report was refused with a CoAP error code such as `4.04`.
    pub fn report_refused(&self, code: &str) {
        let mut refused = self.refused.lock().expect("refusal counters");
        *refused.entry(code.to_owned()).or_default() += 1;
    }

    /// `n` CoAP retransmissions happened.
    pub fn retransmitted(&self, n: u64) {
        bump(&self.retransmissions, n);
    }

    /// A device applied a new desired state.
    pub fn desired_applied(&self) {
        bump(&self.desired_applied, 1);
    }

    /// A device's desired state was cleared (the Device was deleted).
    pub fn desired_deleted(&self) {
        bump(&self.desired_deleted, 1);
    }

    /// A desired state could not be decoded.
    pub fn desired_malformed(&self) {
        bump(&self.desired_malformed, 1);
    }

    /// The counters as of now.
    pub fn snapshot(&self) -> Summary {
        let get = |c: &AtomicU64| c.load(Ordering::Relaxed);
        Summary {
            devices: get(&self.devices),
            reports_sent: get(&self.reports_sent),
            reports_acknowledged: get(&self.reports_acknowledged),
            reports_failed: get(&self.reports_failed),
            retransmissions: get(&self.retransmissions),
            desired_applied: get(&self.desired_applied),
            desired_deleted: get(&self.desired_deleted),
            desired_malformed: get(&self.desired_malformed),
            refused: self.refused.lock().expect("refusal counters").clone(),
        }
    }
}

/// A snapshot of the counters.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct Summary {
    /// Devices simulated.
    pub devices: u64,
    /// Reports sent.
    pub reports_sent: u64,
    /// Reports acknowledged.
    pub reports_acknowledged: u64,
    /// Reports that got no answer or could not be sent.
    pub reports_failed: u64,
    /// CoAP retransmissions.
    pub retransmissions: u64,
    /// New desired states applied.
    pub desired_applied: u64,
    /// Desired states cleared because the Device was deleted.
    pub desired_deleted: u64,
    /// Desired states that could not be decoded.
    pub desired_malformed: u64,
    /// Refused reports by CoAP response code (`"4.04"` …).
    pub refused: BTreeMap<String, u64>,
}

impl Summary {
    /// Refused reports, whatever the code.
    pub fn reports_refused(&self) -> u64 {
        self.refused.values().sum()
    }
}

impl fmt::Display for Summary {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(
            f,
            "devices={} reports: sent={} acknowledged={} failed={} retransmitted={} refused=",
            self.devices,
            self.reports_sent,
            self.reports_acknowledged,
            self.reports_failed,
            self.retransmissions,
        )?;
        if self.refused.is_empty() {
            f.write_str("0")?;
        } else {
            let by_code: Vec<_> = self
                .refused
                .iter()
                .map(|(code, n)| format!("{code}:{n}"))
                .collect();
            write!(f, "{{{}}}", by_code.join(","))?;
        }
        write!(
            f,
            " desired: applied={} deleted={} malformed={}",
            self.desired_applied, self.desired_deleted, self.desired_malformed
        )
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn counters_add_up_in_the_snapshot() {
        let stats = Stats::default();
        stats.add_devices(3);
        for _ in 0..4 {
            stats.report_sent();
        }
        stats.report_acknowledged();
        stats.report_failed();
        stats.report_refused("4.04");
        stats.report_refused("4.04");
        stats.report_refused("4.13");
        stats.retransmitted(5);
        stats.desired_applied();
        stats.desired_deleted();
        stats.desired_malformed();

        let s = stats.snapshot();
        assert_eq!(
            s,
            Summary {
                devices: 3,
                reports_sent: 4,
                reports_acknowledged: 1,
                reports_failed: 1,
                retransmissions: 5,
                desired_applied: 1,
                desired_deleted: 1,
                desired_malformed: 1,
                refused: BTreeMap::from([("4.04".into(), 2), ("4.13".into(), 1)]),
            }
        );
        assert_eq!(s.reports_refused(), 3);
    }

    #[test]
    fn the_summary_line_names_every_counter() {
        let mut s = Summary {
            devices: 300,
            reports_sent: 1200,
            reports_acknowledged: 1190,
            reports_failed: 2,
            retransmissions: 15,
            desired_applied: 300,
            ..Summary::default()
        };
        assert_eq!(
            s.to_string(),
            "devices=300 reports: sent=1200 acknowledged=1190 failed=2 retransmitted=15 \
             refused=0 desired: applied=300 deleted=0 malformed=0"
        );
        s.refused = BTreeMap::from([("4.00".into(), 1), ("4.04".into(), 7)]);
        assert!(s.to_string().contains(" refused={4.00:1,4.04:7} "), "{s}");
    }
}
