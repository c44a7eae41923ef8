//! kv-indexer: a global index of which vLLM pods hold which KV-cache blocks, fed by vLLM's
//! ZMQ KV events, answering "which pod already holds this prompt's prefix?".
//!
//! Layout, following the data:
//! - [`events`]: decode the msgpack `KVEventBatch` a vLLM publisher sends;
//! - [`hashing`]: recompute vLLM's `sha256_cbor` block hashes from token ids;
//! - [`index`]: the block -> (engine, tier) index and the prefix-scoring walk;
//! - [`workload`]: request traces and the index benchmark built from them;
//! - [`indexer`]: per-model indexes and token processors, batch application, hash-mismatch
//!   detection, pod scores: the API the daemon's transports call.
//!
//! Errors: each module has its own `thiserror` enum; `anyhow` appears only in the binary.

pub mod events;
pub mod hashing;
pub mod index;
pub mod indexer;
pub mod workload;
