//! Compiles the gRPC schemas in `proto/` with a protoc binary shipped by the
//! `protoc-bin-vendored` crate, so building needs nothing but cargo.

fn main() -> Result<(), Box<dyn std::error::Error>> {
    let protoc = protoc_bin_vendored::protoc_bin_path()?;
    // SAFETY (of intent): build scripts are single-threaded; PROTOC is read by prost-build.
    unsafe { std::env::set_var("PROTOC", protoc) };
    let out = std::path::PathBuf::from(std::env::var("OUT_DIR")?);
    tonic_prost_build::configure()
        .file_descriptor_set_path(out.join("kv_indexer_descriptor.bin"))
        .compile_protos(
            &[
                "proto/kvindexer/v1/kv_indexer.proto",
                "proto/indexer/v1/indexer.proto",
            ],
            &["proto"],
        )?;
    println!("cargo:rerun-if-changed=proto");
    Ok(())
}
