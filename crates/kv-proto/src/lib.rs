//! kv-indexer's gRPC types, generated at build time from the top-level `proto/`: one home for
//! the daemon's servers, the `score` command and loadgen's client.
//!
//! - [`kvindexer_v1`]: `proto/kvindexer/v1/kv_indexer.proto` (ScorePods, ListPods, ClearPod);
//! - [`indexer_v1`]: `proto/indexer/v1/indexer.proto` (llm-d's `GetPodScores`, unchanged);
//! - [`FILE_DESCRIPTOR_SET`]: both schemas encoded, for server reflection.

/// Generated code for `proto/kvindexer/v1/kv_indexer.proto`.
pub mod kvindexer_v1 {
    #![allow(missing_docs, clippy::all, clippy::pedantic)]
    tonic::include_proto!("kvindexer.v1");
}

/// Generated code for `proto/indexer/v1/indexer.proto`.
pub mod indexer_v1 {
    #![allow(missing_docs, clippy::all, clippy::pedantic)]
    tonic::include_proto!("indexer.v1");
}

/// Encoded descriptors of both schemas, for server reflection.
pub const FILE_DESCRIPTOR_SET: &[u8] = tonic::include_file_descriptor_set!("kv_indexer_descriptor");
