//! kv-core: the I/O-free heart of kv-indexer.
//!
//! - [`hashing`]: vLLM's `sha256_cbor` block hashes, byte for byte;
//! - [`events`]: the msgpack `KVEventBatch` a vLLM publisher sends, decoded (and the one encoder
//!   of vLLM-shaped payloads that loadgen, the lab and the tests share);
//! - [`index`]: the block -> (engine, tier) index and the prefix-scoring walk;
//! - [`indexer`]: per-model indexes and token processors, batch application, hash-mismatch
//!   detection and pod scores: what a transport (the daemon, a gateway, a benchmark) calls.
//!
//! No async runtime, no sockets, no metrics registry: counters are returned or read, and the
//! embedding program exports them.

mod block_hash;
pub mod events;
pub mod hashing;
pub mod index;
pub mod indexer;
pub mod mix;

pub use block_hash::BlockHash;
