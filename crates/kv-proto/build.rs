//! Compiles the gRPC schemas in the top-level `proto/` with a protoc binary shipped by the
//! `protoc-bin-vendored` crate, so building needs nothing but cargo.

use std::path::PathBuf;

fn main() -> Result<(), Box<dyn std::error::Error>> {
    let root = PathBuf::from(std::env::var("CARGO_MANIFEST_DIR")?).join("../../proto");
    let out = PathBuf::from(std::env::var("OUT_DIR")?);
    let mut config = prost_build::Config::new();
    config.protoc_executable(protoc_bin_vendored::protoc_bin_path()?);
    // Token id lists are encoded and decoded by hand (src/token_ids.rs: the same wire bytes,
    // without prost's per-byte varint path).
    config.extern_path(".kvindexer.v1.TokenIds", "crate::token_ids::TokenIds");
    tonic_prost_build::configure()
        .file_descriptor_set_path(out.join("kv_indexer_descriptor.bin"))
        .compile_with_config(
            config,
            &[
                root.join("kvindexer/v1/kv_indexer.proto"),
                root.join("indexer/v1/indexer.proto"),
            ],
            std::slice::from_ref(&root),
        )?;
    // llm-d's own schema, for tests that read our answers through llm-d's generated client
    // (its package is ours too, so it is generated into a folder of its own).
    let upstream = out.join("llmd_upstream");
    std::fs::create_dir_all(&upstream)?;
    let mut config = prost_build::Config::new();
    config.protoc_executable(protoc_bin_vendored::protoc_bin_path()?);
    tonic_prost_build::configure()
        .build_server(false)
        .out_dir(&upstream)
        .compile_with_config(
            config,
            &[root.join("vendor/llm-d/indexer.proto")],
            &[root.join("vendor/llm-d")],
        )?;
    println!("cargo:rerun-if-changed={}", root.display());
    Ok(())
}
