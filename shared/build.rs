//! Compiles the sync protocol with protox, a protobuf compiler written in Rust,
//! so a fresh machine needs no system `protoc` to build Edgefleet.

fn main() -> Result<(), Box<dyn std::error::Error>> {
    let proto = "proto/edgefleet/v1/sync.proto";
    println!("cargo:rerun-if-changed={proto}");
    let descriptors = protox::compile([proto], ["proto"])?;
    tonic_prost_build::configure()
        .build_client(true)
        .build_server(true)
        .compile_fds(descriptors)?;
    Ok(())
}
