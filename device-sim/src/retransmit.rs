//! CoAP retransmission of confirmable messages (RFC 7252 §4.2), as pure
//! bookkeeping: no clock, no socket.
//!
//! The first timeout is drawn from `[ACK_TIMEOUT, ACK_TIMEOUT ×
//! ACK_RANDOM_FACTOR]`; each time it expires without an answer the message is
//! sent again and the timeout doubles, up to `MAX_RETRANSMIT` retransmissions.
//! When the timeout after the last retransmission expires, the exchange has
//! failed.

use std::time::Duration;

use rand::{Rng, RngExt};

/// The transmission parameters of RFC 7252 §4.8.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct RetransmitParams {
    /// The shortest first timeout.
    pub ack_timeout: Duration,
    /// The first timeout is at most `ack_timeout` times this (≥ 1).
    pub ack_random_factor: f64,
    /// How many times a message is sent again before giving up.
    pub max_retransmit: u32,
}

impl Default for RetransmitParams {
    /// RFC 7252's defaults: 2 s, 1.5, 4.
    fn default() -> Self {
        RetransmitParams {
            ack_timeout: Duration::from_secs(2),
            ack_random_factor: 1.5,
            max_retransmit: 4,
        }
    }
}

impl RetransmitParams {
    /// Starts the bookkeeping for a new message, drawing its first timeout.
    pub fn start<R: Rng + ?Sized>(&self, rng: &mut R) -> Retransmission {
        let factor = if self.ack_random_factor > 1.0 {
            rng.random_range(1.0..=self.ack_random_factor)
        } else {
            1.0
        };
        self.start_with_factor(factor)
    }

    /// Starts the bookkeeping with a chosen random factor (clamped to the
    /// allowed range).
    pub fn start_with_factor(&self, factor: f64) -> Retransmission {
        let factor = factor.clamp(1.0, self.ack_random_factor.max(1.0));
        Retransmission {
            timeout: self.ack_timeout.mul_f64(factor),
            retransmissions: 0,
            max_retransmit: self.max_retransmit,
        }
    }

    /// MAX_TRANSMIT_WAIT: the longest an exchange can take before it fails.
    pub fn max_transmit_wait(&self) -> Duration {
        self.ack_timeout
            .mul_f64(self.ack_random_factor.max(1.0))
            .mul_f64(2f64.powf(f64::from(self.max_retransmit) + 1.0) - 1.0)
    }
}

/// The retransmission state of one confirmable message.
#[derive(Clone, Debug, PartialEq)]
pub struct Retransmission {
    timeout: Duration,
    retransmissions: u32,
    max_retransmit: u32,
}

/// What to do when the current timeout expires.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum OnTimeout {
    /// Send the message again and wait this long.
    Retransmit(Duration),
    /// Give up: the exchange failed.
    GiveUp,
}

impl Retransmission {
    /// How long to wait for an answer to the latest transmission.
    pub fn timeout(&self) -> Duration {
        self.timeout
    }

    /// How many times the message has been sent again so far.
    pub fn retransmissions(&self) -> u32 {
        self.retransmissions
    }

    /// The current timeout expired without an answer.
    pub fn on_timeout(&mut self) -> OnTimeout {
        if self.retransmissions >= self.max_retransmit {
            return OnTimeout::GiveUp;
        }
        self.retransmissions += 1;
        self.timeout *= 2;
        OnTimeout::Retransmit(self.timeout)
    }
}

#[cfg(test)]
mod tests {
    use rand::SeedableRng;

    use super::*;
    use crate::model::SimRng;

    /// Every timeout of an exchange that is never answered.
    fn schedule(mut r: Retransmission) -> Vec<Duration> {
        let mut timeouts = vec![r.timeout()];
        while let OnTimeout::Retransmit(next) = r.on_timeout() {
            timeouts.push(next);
        }
        timeouts
    }

    #[test]
    fn the_default_schedule_doubles_four_times_then_gives_up() {
        let params = RetransmitParams::default();
        let secs = |s: &[u64]| {
            s.iter()
                .map(|&s| Duration::from_secs(s))
                .collect::<Vec<_>>()
        };
        assert_eq!(
            schedule(params.start_with_factor(1.0)),
            secs(&[2, 4, 8, 16, 32])
        );
        assert_eq!(
            schedule(params.start_with_factor(1.5)),
            secs(&[3, 6, 12, 24, 48])
        );
    }

    #[test]
    fn retransmissions_are_counted_and_giving_up_is_final() {
        let mut r = RetransmitParams::default().start_with_factor(1.0);
        for n in 1..=4 {
            assert!(matches!(r.on_timeout(), OnTimeout::Retransmit(_)));
            assert_eq!(r.retransmissions(), n);
        }
        assert_eq!(r.on_timeout(), OnTimeout::GiveUp);
        assert_eq!(r.on_timeout(), OnTimeout::GiveUp);
        assert_eq!(r.retransmissions(), 4);
    }

    #[test]
    fn the_first_timeout_is_drawn_within_the_random_factor() {
        let params = RetransmitParams::default();
        let mut rng = SimRng::seed_from_u64(1);
        let firsts: Vec<_> = (0..500).map(|_| params.start(&mut rng).timeout()).collect();
        assert!(
            firsts
                .iter()
                .all(|t| *t >= Duration::from_secs(2) && *t <= Duration::from_secs(3))
        );
        // Spread out, not stuck at one end.
        assert!(firsts.iter().any(|t| *t < Duration::from_millis(2250)));
        assert!(firsts.iter().any(|t| *t > Duration::from_millis(2750)));
    }

    #[test]
    fn factors_out_of_range_are_clamped() {
        let params = RetransmitParams::default();
        assert_eq!(params.start_with_factor(0.1).timeout(), params.ack_timeout);
        assert_eq!(
            params.start_with_factor(9.0).timeout(),
            Duration::from_secs(3)
        );
        let fixed = RetransmitParams {
            ack_random_factor: 1.0,
            ..params
        };
        assert_eq!(
            fixed.start(&mut SimRng::seed_from_u64(1)).timeout(),
            params.ack_timeout
        );
    }

    #[test]
    fn max_transmit_wait_matches_the_rfc() {
        // RFC 7252 §4.8.2: MAX_TRANSMIT_WAIT is 93 seconds.
        assert_eq!(
            RetransmitParams::default().max_transmit_wait(),
            Duration::from_secs(93)
        );
        let worst: Duration = schedule(RetransmitParams::default().start_with_factor(1.5))
            .into_iter()
            .sum();
        assert_eq!(worst, Duration::from_secs(93));
    }
}
