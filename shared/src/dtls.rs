//! What the agent and devices agree on about CoAP over DTLS beyond the RFCs.

/// The agent's answer to a protected record from an endpoint it has no
/// session with (it restarted and forgot it): an unprotected fatal
/// `unexpected_message` alert, epoch 0, sequence 0. A device takes it as a
/// hint to handshake again at once; being unprotected, it ends nothing by
/// itself (a forged one costs the device a handshake).
pub const FORGOTTEN_SESSION_ALERT: [u8; 15] = [21, 0xfe, 0xfd, 0, 0, 0, 0, 0, 0, 0, 0, 0, 2, 2, 10];
