//! kv-indexer: a global index of which vLLM pods hold which KV-cache blocks, fed by vLLM's
//! ZMQ KV events, answering "which pod already holds this prompt's prefix?".
//!
//! Layout, following the data:
//! - [`events`]: decode the msgpack `KVEventBatch` a vLLM publisher sends;
//! - [`hashing`]: recompute vLLM's `sha256_cbor` block hashes from token ids;
//! - [`index`]: the block -> (engine, tier) index and the prefix-scoring walk;
//! - [`workload`]: request traces and the index benchmark built from them;
//! - [`indexer`]: per-model indexes and token processors, batch application, hash-mismatch
//!   detection, pod scores: the API the daemon's transports call;
//! - [`ingest`]: ZMQ subscribers, sequence tracking, replay, per-pod ordered workers;
//! - [`server`]: gRPC (ScorePods, admin, llm-d compatibility, health, reflection) and HTTP
//!   (metrics, probes);
//! - [`config`], [`metrics`], [`daemon`]: the YAML schema, the Prometheus registry, and the
//!   wiring with ordered start-up and graceful shutdown.
//!
//! Errors: each module has its own `thiserror` enum; `anyhow` appears only in the binary.

pub mod config;
pub mod daemon;
pub mod events;
pub mod hashing;
pub mod index;
pub mod indexer;
pub mod ingest;
pub mod metrics;
pub mod replay;
pub mod server;
pub mod simulate;
pub mod tokenize;
pub mod workload;
