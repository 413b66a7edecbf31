//! Dead-peer detection on the sync stream, the same on both sides.
//!
//! Cloud and agent each send a Heartbeat every [`Heartbeat::interval`]. A
//! session that hears nothing at all from its peer (no Heartbeat, no other
//! message) for [`MISSED_HEARTBEATS`] intervals ends, so a link that
//! silently drops packets is noticed without waiting for TCP to give up.
//! HTTP/2 PINGs and TCP keepalive run underneath as a backstop (and keep NAT
//! mappings open); they are set to notice a dead link a little later than
//! the heartbeat rule, so the rule, with its log line and counter, is what
//! normally ends a silent session.
//!
//! Both sides judge the peer by their own interval: configure the same
//! interval on the cloud and its agents.

use std::sync::{Arc, Mutex};
use std::time::Duration;

use tokio::time::Instant;

/// How many heartbeat intervals of silence end a session.
pub const MISSED_HEARTBEATS: u32 = 3;

/// The heartbeat interval and the timeouts derived from it.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Heartbeat {
    /// How often a heartbeat is sent.
    pub interval: Duration,
}

impl Heartbeat {
    /// The default: every 10 s, so a silent peer is noticed after 30 s.
    pub const DEFAULT: Heartbeat = Heartbeat {
        interval: Duration::from_secs(10),
    };

    /// A heartbeat every `interval` (at least 1 ms).
    pub fn every(interval: Duration) -> Heartbeat {
        Heartbeat {
            interval: interval.max(Duration::from_millis(1)),
        }
    }

    /// How long a peer may be silent before its session ends.
    pub fn silence_limit(&self) -> Duration {
        self.interval * MISSED_HEARTBEATS
    }

    /// HTTP/2 PING interval: a PING after this long without a frame.
    pub fn keepalive_interval(&self) -> Duration {
        self.interval * 2
    }

    /// How long an HTTP/2 PING may go unanswered before the connection is
    /// closed. With [`keepalive_interval`](Self::keepalive_interval) this
    /// ends a dead connection after 4 intervals: after the heartbeat rule.
    pub fn keepalive_timeout(&self) -> Duration {
        self.interval * 2
    }

    /// Idle time before TCP keepalive probes start.
    pub fn tcp_keepalive(&self) -> Duration {
        self.interval * 2
    }
}

impl Default for Heartbeat {
    fn default() -> Self {
        Heartbeat::DEFAULT
    }
}

/// When the peer was last heard from, against a limit. Pure bookkeeping;
/// [`PeerWatch`] turns it into a future.
#[derive(Clone, Copy, Debug)]
pub struct Silence {
    limit: Duration,
    last_heard: Instant,
}

impl Silence {
    /// A peer heard from at `now` (the session's start counts as hearing).
    pub fn new(limit: Duration, now: Instant) -> Silence {
        Silence {
            limit,
            last_heard: now,
        }
    }

    /// Something arrived from the peer at `now`.
    pub fn heard(&mut self, now: Instant) {
        self.last_heard = self.last_heard.max(now);
    }

    /// When the peer will have been silent too long, unless heard before.
    pub fn deadline(&self) -> Instant {
        self.last_heard + self.limit
    }

    /// How long the peer has been silent at `now`, if that is the limit or
    /// more.
    pub fn exceeded(&self, now: Instant) -> Option<Duration> {
        let silent = now.saturating_duration_since(self.last_heard);
        (silent >= self.limit).then_some(silent)
    }
}

/// A [`Silence`] shared between the task that reads the stream (calling
/// [`heard`](Self::heard)) and the one that waits for [`silent`](Self::silent).
#[derive(Clone, Debug)]
pub struct PeerWatch(Arc<Mutex<Silence>>);

impl PeerWatch {
    /// Starts watching now, with `limit`.
    pub fn new(limit: Duration) -> PeerWatch {
        PeerWatch(Arc::new(Mutex::new(Silence::new(limit, Instant::now()))))
    }

    /// Something arrived from the peer.
    pub fn heard(&self) {
        self.lock().heard(Instant::now());
    }

    /// Resolves once the peer has been silent for the limit; returns for how
    /// long.
    pub async fn silent(&self) -> Duration {
        loop {
            let deadline = self.lock().deadline();
            tokio::time::sleep_until(deadline).await;
            if let Some(silent) = self.lock().exceeded(Instant::now()) {
                return silent;
            }
        }
    }

    fn lock(&self) -> std::sync::MutexGuard<'_, Silence> {
        self.0.lock().unwrap_or_else(|e| e.into_inner())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const S: Duration = Duration::from_secs(1);

    #[test]
    fn the_default_notices_a_silent_peer_after_30_seconds_and_keepalive_later() {
        let beat = Heartbeat::default();
        assert_eq!(beat.silence_limit(), Duration::from_secs(30));
        assert!(
            beat.keepalive_interval() + beat.keepalive_timeout() > beat.silence_limit(),
            "the HTTP/2 backstop comes after the heartbeat rule"
        );
        assert_eq!(
            Heartbeat::every(Duration::ZERO).interval,
            Duration::from_millis(1)
        );
    }

    #[test]
    fn a_peer_is_silent_after_three_intervals_without_a_message() {
        let start = Instant::now();
        let silence = Silence::new(Heartbeat::every(S).silence_limit(), start);
        assert_eq!(silence.deadline(), start + 3 * S);
        assert_eq!(silence.exceeded(start + 2 * S), None);
        assert_eq!(silence.exceeded(start + 3 * S), Some(3 * S));
        assert_eq!(silence.exceeded(start + 5 * S), Some(5 * S));
    }

    #[test]
    fn hearing_the_peer_moves_the_deadline_and_never_back() {
        let start = Instant::now();
        let mut silence = Silence::new(3 * S, start);
        silence.heard(start + 2 * S);
        assert_eq!(silence.exceeded(start + 4 * S), None, "heard at 2 s");
        assert_eq!(silence.deadline(), start + 5 * S);
        // A late-noticed older message does not move it back.
        silence.heard(start + S);
        assert_eq!(silence.deadline(), start + 5 * S);
        assert_eq!(silence.exceeded(start + 5 * S), Some(3 * S));
        // Before the start (a clock read early) counts as the start.
        assert_eq!(silence.exceeded(start), None);
    }

    #[tokio::test]
    async fn the_watch_resolves_only_after_the_limit_since_the_last_message() {
        let limit = Duration::from_millis(200);
        let watch = PeerWatch::new(limit);
        let started = Instant::now();
        tokio::time::sleep(Duration::from_millis(100)).await;
        watch.heard();
        let heard_at = Instant::now();
        let silent = watch.silent().await;
        assert!(silent >= limit, "{silent:?}");
        assert!(
            heard_at.elapsed() >= limit,
            "not before the limit after the last message"
        );
        assert!(started.elapsed() >= limit + Duration::from_millis(100));
    }
}
