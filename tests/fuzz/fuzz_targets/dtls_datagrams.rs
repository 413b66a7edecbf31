//! Datagrams on the agent's CoAP-over-DTLS port, from four endpoints, into
//! one long-lived session table (`coap::dtls::Sessions`, the agent's own,
//! over a store on disk): its record pre-parsing, the engine's record and
//! handshake parsing, the cookie exchange, the bounds and the timers.
//! Nothing may panic, and nothing reaches the CoAP handler from an
//! endpoint without an established session.
//!
//! An input is a run of chunks: a selector byte (bits 0–1 the endpoint;
//! bits 2–6 how many 100 ms ticks pass first), a two-byte length, then the
//! datagram. The seeds are ClientHellos of Debian's libcoap clients.
#![no_main]

use std::net::SocketAddr;
use std::sync::{Arc, Mutex, OnceLock};
use std::time::{Duration, Instant};

use edgefleet_agent::coap::dtls::{DtlsMetrics, DtlsSettings, Sessions};
use edgefleet_agent::store::Store;
use libfuzzer_sys::fuzz_target;

struct Table {
    sessions: Sessions,
    now: Instant,
}

fn table() -> &'static Mutex<Table> {
    static TABLE: OnceLock<Mutex<Table>> = OnceLock::new();
    TABLE.get_or_init(|| {
        let dir = std::env::temp_dir().join(format!("edgefleet-fuzz-dtls-{}", std::process::id()));
        let store = Store::open(&dir).expect("a store").store;
        let settings = DtlsSettings {
            max_sessions: 8,
            max_handshakes: 2,
            ..DtlsSettings::default()
        };
        Mutex::new(Table {
            sessions: Sessions::new(store, settings, Arc::new(DtlsMetrics::default())),
            now: Instant::now(),
        })
    })
}

fuzz_target!(|input: &[u8]| {
    let mut table = table().lock().unwrap_or_else(|e| e.into_inner());
    let mut rest = input;
    while let [selector, hi, lo, tail @ ..] = rest {
        let len = usize::from(u16::from_be_bytes([*hi, *lo])).min(tail.len());
        let (datagram, after) = tail.split_at(len);
        rest = after;
        let ticks = u32::from((selector >> 2) & 0x1f);
        if ticks > 0 {
            table.now += Duration::from_millis(100) * ticks;
            let now = table.now;
            table.sessions.tick(now);
        }
        let peer = SocketAddr::from(([127, 0, 0, 1], 40_000 + u16::from(selector & 3)));
        let now = table.now;
        let received = table.sessions.receive(peer, datagram, now);
        if received.device.is_none() {
            assert!(received.messages.is_empty(), "a message without a session");
        }
    }
});
