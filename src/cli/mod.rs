//! Subcommands of the `kv-indexer` binary (the only place `anyhow` is used). The lab's commands
//! (`loadgen`, `replay`, `simulate`) are thin fronts over `kv-lab`, built with the default
//! feature `lab`.

pub mod hash;
#[cfg(feature = "lab")]
pub mod loadgen;
#[cfg(feature = "lab")]
pub mod replay;
pub mod score;
pub mod serve;
#[cfg(feature = "lab")]
pub mod simulate;
