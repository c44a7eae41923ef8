//! Subcommands of the `kv-indexer` binary (the only place `anyhow` is used).

pub mod hash;
pub mod loadgen;
pub mod replay;
pub mod score;
pub mod serve;
pub mod simulate;
