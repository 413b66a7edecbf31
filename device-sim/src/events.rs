//! A device's events on their way to its agent: numbered by the device,
//! kept until the agent confirms them, resent until then.
//!
//! The agent stores each id once per boot epoch, so resending is always
//! safe; the queue only needs to know which ids the agent has confirmed
//! (everything of a boot up to the highest id it names). A reboot starts a
//! new epoch and counts ids from 1 again, as a device without persistent
//! memory does; events raised before it keep their epoch and id.

use std::collections::VecDeque;

use edgefleet_shared::codec::{DeviceEvent, EventAck};

/// An event's identity: (boot epoch, id).
pub type EventId = (u64, u64);

/// One device's events: those raised, and those not yet confirmed.
#[derive(Debug)]
pub struct EventQueue {
    boot: u64,
    next_id: u64,
    pending: VecDeque<DeviceEvent>,
    raised: Vec<EventId>,
    abandoned: Vec<EventId>,
}

impl EventQueue {
    /// A queue for a device booted with epoch `boot`.
    pub fn new(boot: u64) -> Self {
        EventQueue {
            boot,
            next_id: 0,
            pending: VecDeque::new(),
            raised: Vec::new(),
            abandoned: Vec::new(),
        }
    }

    /// The device rebooted with epoch `boot`: ids count from 1 again.
    pub fn reboot(&mut self, boot: u64) {
        self.boot = boot;
        self.next_id = 0;
    }

    /// Raises a new event; returns its identity.
    pub fn raise(&mut self, warning: bool, reason: &str, message: String) -> EventId {
        self.next_id += 1;
        let id = (self.boot, self.next_id);
        self.pending.push_back(DeviceEvent {
            id: id.1,
            boot: id.0,
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

    /// The agent holds every event of `ack.boot` up to `ack.id`.
    pub fn confirmed(&mut self, ack: &EventAck) {
        while self
            .pending
            .front()
            .is_some_and(|e| e.boot == ack.boot && e.id <= ack.id)
        {
            self.pending.pop_front();
        }
    }

    /// The device's Device was deleted: its unconfirmed events can no longer
    /// be delivered (the agent refuses unknown devices) and are given up.
    pub fn abandon(&mut self) {
        self.abandoned
            .extend(self.pending.drain(..).map(|e| (e.boot, e.id)));
    }

    /// The events given up by [`EventQueue::abandon`].
    pub fn abandoned(&self) -> &[EventId] {
        &self.abandoned
    }

    /// Every event raised so far, in order.
    pub fn raised(&self) -> &[EventId] {
        &self.raised
    }

    /// The events raised but not confirmed.
    pub fn unconfirmed(&self) -> Vec<EventId> {
        self.pending.iter().map(|e| (e.boot, e.id)).collect()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn ack(boot: u64, id: u64) -> EventAck {
        EventAck { id, boot }
    }

    #[test]
    fn events_are_numbered_from_one_and_leave_only_when_confirmed() {
        let mut q = EventQueue::new(7);
        for n in 1..=3 {
            assert_eq!(q.raise(false, "Tick", format!("tick {n}")), (7, n));
        }
        assert_eq!(q.next().map(|e| (e.boot, e.id)), Some((7, 1)));
        q.confirmed(&ack(7, 0));
        assert_eq!(
            q.unconfirmed(),
            vec![(7, 1), (7, 2), (7, 3)],
            "nothing confirmed yet"
        );
        q.confirmed(&ack(7, 2));
        assert_eq!(q.next().map(|e| e.id), Some(3));
        q.confirmed(&ack(7, 1)); // a late, older confirmation changes nothing
        q.confirmed(&ack(8, 9)); // nor one about another boot
        assert_eq!(q.unconfirmed(), vec![(7, 3)]);
        q.confirmed(&ack(7, 3));
        assert_eq!(q.next(), None);
        assert_eq!(q.raised(), &[(7, 1), (7, 2), (7, 3)]);
        q.raise(false, "Tick", "tick 4".into());
        q.abandon();
        assert_eq!((q.next(), q.abandoned()), (None, &[(7, 4)][..]));
    }

    #[test]
    fn a_reboot_counts_from_one_under_a_new_epoch_and_keeps_what_is_pending() {
        let mut q = EventQueue::new(1);
        q.raise(false, "Tick", "before".into());
        q.reboot(2);
        assert_eq!(q.raise(false, "FirmwareInstalled", "after".into()), (2, 1));
        // The event of the old boot still goes first, under its own epoch.
        assert_eq!(q.next().map(|e| (e.boot, e.id)), Some((1, 1)));
        q.confirmed(&ack(1, 1));
        assert_eq!(q.next().map(|e| (e.boot, e.id)), Some((2, 1)));
        q.confirmed(&ack(2, 1));
        assert_eq!(q.next(), None);
    }
}
