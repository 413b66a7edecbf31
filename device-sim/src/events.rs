//! A device's events on their way to its agent: numbered by the device,
//! kept until the agent confirms them, resent until then.
//!
//! The agent stores each id once, so resending is always safe; the queue
//! only needs to know which ids the agent has confirmed (everything up to
//! the highest one it names).

use std::collections::VecDeque;

use edgefleet_shared::codec::DeviceEvent;

/// One device's events: those raised, and those not yet confirmed.
#[derive(Debug, Default)]
pub struct EventQueue {
    next_id: u64,
    pending: VecDeque<DeviceEvent>,
    raised: Vec<u64>,
    abandoned: Vec<u64>,
}

impl EventQueue {
    /// Raises a new event; returns its id.
    pub fn raise(&mut self, warning: bool, reason: &str, message: String) -> u64 {
        self.next_id += 1;
        let id = self.next_id;
        self.pending.push_back(DeviceEvent {
            id,
            warning,
            reason: reason.to_owned(),
            message,
        });
        self.raised.push(id);
        id
    }

    /// The oldest event not yet confirmed: the next to send.
    pub fn next(&self) -> Option<&DeviceEvent> {
        self.pending.front()
    }

    /// The agent holds every event up to `highest`.
    pub fn confirmed(&mut self, highest: u64) {
        while self.pending.front().is_some_and(|e| e.id <= highest) {
            self.pending.pop_front();
        }
    }

    /// The device's Device was deleted: its unconfirmed events can no longer
    /// be delivered (the agent refuses unknown devices) and are given up.
    pub fn abandon(&mut self) {
        self.abandoned.extend(self.pending.drain(..).map(|e| e.id));
    }

    /// The ids given up by [`EventQueue::abandon`].
    pub fn abandoned(&self) -> &[u64] {
        &self.abandoned
    }

    /// Every id raised so far, in order.
    pub fn raised(&self) -> &[u64] {
        &self.raised
    }

    /// The ids raised but not confirmed.
    pub fn unconfirmed(&self) -> Vec<u64> {
        self.pending.iter().map(|e| e.id).collect()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn events_are_numbered_from_one_and_leave_only_when_confirmed() {
        let mut q = EventQueue::default();
        for n in 1..=3 {
            assert_eq!(q.raise(false, "Tick", format!("tick {n}")), n);
        }
        assert_eq!(q.next().map(|e| e.id), Some(1));
        q.confirmed(0);
        assert_eq!(q.unconfirmed(), vec![1, 2, 3], "nothing confirmed yet");
        q.confirmed(2);
        assert_eq!(q.next().map(|e| e.id), Some(3));
        q.confirmed(1); // a late, older confirmation changes nothing
        assert_eq!(q.unconfirmed(), vec![3]);
        q.confirmed(3);
        assert_eq!(q.next(), None);
        assert_eq!(q.raised(), &[1, 2, 3]);
        q.raise(false, "Tick", "tick 4".into());
        q.abandon();
        assert_eq!((q.next(), q.abandoned()), (None, &[4][..]));
    }
}
