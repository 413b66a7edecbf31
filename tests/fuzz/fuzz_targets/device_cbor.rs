//! Every CBOR message of the device wire format, decoded from anything; one
//! that decodes encodes again, and that encoding is stable (compared as
//! bytes: a float property may be NaN, which equals nothing).
#![no_main]

use edgefleet_shared::codec::{self, DesiredState, DeviceEvent, DeviceReport, EventAck};
use libfuzzer_sys::fuzz_target;

fn round_trip<T>(bytes: &[u8])
where
    T: codec::WireMessage,
{
    if let Ok(message) = codec::decode::<T>(bytes) {
        let encoded = codec::encode(&message).expect("a decoded message encodes");
        let again = codec::decode::<T>(&encoded).expect("and decodes");
        assert_eq!(codec::encode(&again).expect("and encodes"), encoded);
    }
}

fuzz_target!(|bytes: &[u8]| {
    round_trip::<DeviceReport>(bytes);
    round_trip::<DeviceEvent>(bytes);
    round_trip::<DesiredState>(bytes);
    round_trip::<EventAck>(bytes);
});
