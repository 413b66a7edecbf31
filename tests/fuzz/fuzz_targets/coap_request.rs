//! A datagram on the agent's CoAP port: parsed, checked and routed as the
//! server does before anything touches the store, and its payload decoded
//! as the route's message.
#![no_main]

use coap_lite::Packet;
use edgefleet_agent::coap::{Route, checks, path_of, route};
use edgefleet_shared::codec::{self, DeviceEvent, DeviceReport};
use libfuzzer_sys::fuzz_target;

fuzz_target!(|datagram: &[u8]| {
    let Ok(request) = Packet::from_bytes(datagram) else {
        return;
    };
    let _ = checks::unrecognized_critical(&request);
    for (reads, answers) in [(true, false), (false, true), (true, true)] {
        if let Err(refusal) = checks::check(&request, reads, answers) {
            // A refusal's text is cut to the request's size.
            let text = checks::short(refusal.text, datagram.len());
            assert!(text.len() <= datagram.len());
        }
    }
    match route(&path_of(&request)) {
        Some(Route::Report(_)) => {
            let _ = codec::decode::<DeviceReport>(&request.payload);
        }
        Some(Route::Events(_)) => {
            let _ = codec::decode::<DeviceEvent>(&request.payload);
        }
        Some(Route::Desired(_)) | None => {}
    }
});
