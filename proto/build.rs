//! Generates the Rust code for every .proto under `proto/` with protox (a pure-Rust
//! protobuf compiler) so that building needs no `protoc` on the machine.

use std::{env, error::Error, fs, path::PathBuf};

const PROTO_ROOT: &str = "proto";

/// Files of the packaged protocols; their descriptors are also embedded (for the
/// proto3 JSON mapping of the Connect layer).
const PACKAGED: &[&str] =
    &["runner/v1/messages.proto", "runner/v1/services.proto", "ping/v1/messages.proto", "ping/v1/services.proto", "facade/v1/facade.proto"];

/// The SPIFFE Workload API has no protobuf package (its gRPC paths are
/// `/SpiffeWorkloadAPI/...`), so it is generated on its own into `workload.rs`.
const WORKLOAD: &str = "spiffe/workload/workload.proto";

/// SPIRE server's registration-entry API (vendored from spire-api-sdk, see
/// `proto/spire/README.md`), generated into `spire/` with its own include file so
/// its packages stay apart from the packaged protocols' descriptors.
const SPIRE_ENTRY: &str = "spire/api/server/entry/v1/entry.proto";

fn main() -> Result<(), Box<dyn Error>> {
    let out_dir = PathBuf::from(env::var("OUT_DIR")?);
    println!("cargo:rerun-if-changed={PROTO_ROOT}");

    let fds = protox::compile(PACKAGED, [PROTO_ROOT])?;
    fs::write(out_dir.join("descriptor.bin"), prost::Message::encode_to_vec(&fds))?;
    let mut config = prost_build::Config::new();
    config.enable_type_names();
    tonic_prost_build::configure().include_file("packages.rs").compile_fds_with_config(fds, config)?;

    let workload_dir = out_dir.join("workload");
    fs::create_dir_all(&workload_dir)?;
    let fds = protox::compile([WORKLOAD], [PROTO_ROOT])?;
    tonic_prost_build::configure().out_dir(&workload_dir).compile_fds(fds)?;

    let spire_dir = out_dir.join("spire");
    fs::create_dir_all(&spire_dir)?;
    let fds = protox::compile([SPIRE_ENTRY], [PROTO_ROOT])?;
    tonic_prost_build::configure().build_server(false).out_dir(&spire_dir).include_file("spire.rs").compile_fds(fds)?;
    Ok(())
}
