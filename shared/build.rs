//! Compiles the sync protocol with protox, a protobuf compiler written in Rust,
//! so a fresh machine needs no system `protoc` to build Edgefleet.

fn main() -> Result<(), Box<dyn std::error::Error>> {
    let proto = "proto/edgefleet/v1/sync.proto";
    println!("cargo:rerun-if-changed={proto}");
    let descriptors = protox::compile([proto], ["proto"])?;
    // Maps as BTreeMaps: encoding is deterministic, so a body's digest is
    // its version (RuleDesired).
    tonic_prost_build::configure()
        .btree_map(".")
        // A key must never reach a log: its Debug is written by hand.
        .skip_debug([".edgefleet.v1.DeviceCredential"])
        .build_client(true)
        .build_server(true)
        .compile_fds(descriptors)?;
    Ok(())
}
