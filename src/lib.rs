//! kv-indexer, the daemon: subscribes to vLLM's ZMQ KV events, keeps the index of kv-core
//! current, and answers `ScorePods` over gRPC.
//!
//! Layout, following the data:
//! - [`ingest`]: ZMQ sockets (bind and connect), the per-publisher sequence state machine, gap
//!   fill from vLLM's replay socket, per-pod ordered workers applying batches to the indexer;
//! - [`replication`]: several replicas sharing one index through Redis (a shared event log,
//!   snapshots, warm restarts), off by default; it implements ingestion's shared-log port, so
//!   it depends on ingestion and never the reverse;
//! - [`scoring`]: scoring as a service of the daemon (a prompt in, each pod's prefix score out;
//!   routing records), in the daemon's own types and error kinds;
//! - [`server`]: gRPC (ScorePods, admin, llm-d compatibility, health, reflection) and HTTP
//!   (metrics, probes), each RPC mapped onto [`scoring`];
//! - [`picker`]: the endpoint picker of an `InferencePool` (Envoy ext_proc, GIE's protocol), off
//!   by default, scoring through [`scoring`] and kv-core's pick;
//! - [`pool`]: the picker's candidates: an `InferencePool`'s Ready pods (the Kubernetes API), a
//!   static list or DNS discovery's answers, kept healthy by kv-core's membership rule;
//! - [`config`], [`metrics`], [`daemon`]: the YAML schema, the Prometheus registry (attached to
//!   the index and the tokenizer from the outside), and the wiring with ordered start-up and
//!   graceful shutdown; `warn_budget`: how many warning lines input can cause; `heap`: freed
//!   memory handed back to the OS after a backlog drains.
//!
//! What it builds on: `kv-core` (hashing, events, the index and the indexer facade),
//! `kv-tokenize` (prompts in) and `kv-proto` (the gRPC types).
//!
//! Errors: each module has its own `thiserror` enum; `anyhow` appears only in the binary.

pub mod config;
pub mod daemon;
mod heap;
mod ingest;
mod metrics;
mod picker;
pub mod pool;
pub mod replication;
mod scoring;
mod server;
mod warn_budget;

/// Topic and endpoint grammar (public for the fuzz targets and tools).
pub use ingest::topic;
/// The process's resident memory (public for the benchmarks and tests that run a daemon in
/// their own process).
pub use metrics::resident_memory_bytes;
/// The endpoint picker's readers of what clients and pods send: request bodies and response
/// usage (public for the fuzz targets).
pub use picker::{body as picker_body, usage as picker_usage};
