//! kv-lab: the evidence behind kv-indexer, outside the daemon.
//!
//! - [`replay`]: one block-level prefix cache (LRU, LFU, FIFO, S3-FIFO) replaying a request
//!   trace, with exact hit statistics;
//! - [`simulate`]: routing policies compared on simulated vLLM pods, the real index in the loop;
//! - [`trace`]: request traces (Mooncake, token ids), read once for the whole lab;
//! - [`index_bench`]: the index benchmark built from a trace, and the driver that measures any
//!   index on it ([`alloc`] counts the heap it holds);
//! - [`lru`]: the lab's one LRU;
//! - `loadgen` (feature `loadgen`): vLLM-shaped load against a running daemon over ZMQ and gRPC.

pub mod alloc;
pub mod index_bench;
#[cfg(feature = "loadgen")]
pub mod loadgen;
pub mod lru;
pub mod replay;
pub mod simulate;
pub mod trace;
