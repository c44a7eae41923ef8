//! `kv-indexer replay`: a request trace against one block-level prefix cache (see
//! `kv_lab::replay` for the semantics).

use std::path::PathBuf;

use anyhow::bail;
use clap::Args;

use kv_lab::replay::{load_requests, policy, replay};

/// Flags of `kv-indexer replay`.
#[derive(Debug, Args)]
pub struct ReplayArgs {
    /// The trace: Mooncake JSONL (`hash_ids`) or token-id JSONL (`token_ids`), detected per file.
    #[arg(long)]
    pub trace: PathBuf,
    /// lru, lfu, fifo, s3fifo (the published replay semantics: each queue kept to its share)
    /// or s3fifo-paper (Yang et al., SOSP'23, Algorithm 1).
    #[arg(long)]
    pub policy: String,
    /// Cache size in blocks.
    #[arg(long)]
    pub capacity_blocks: usize,
    /// Tokens per block (Mooncake: 512; token traces: the engine's block size, e.g. 16).
    #[arg(long, default_value_t = 512)]
    pub block_size: u64,
    /// S3-FIFO: the small queue's share of the capacity.
    #[arg(long, default_value_t = 0.1)]
    pub small_ratio: f64,
    /// S3-FIFO: the frequency counter's ceiling.
    #[arg(long, default_value_t = 3)]
    pub max_freq: u8,
    /// Token traces: PYTHONHASHSEED for block hashing (default: unset).
    #[arg(long)]
    pub seed: Option<String>,
    /// Print JSON.
    #[arg(long)]
    pub json: bool,
    /// Include per-request results in the JSON.
    #[arg(long)]
    pub per_request: bool,
}

/// Runs the replay and prints the result.
pub fn run(args: ReplayArgs) -> anyhow::Result<()> {
    if args.block_size == 0 {
        bail!("--block-size must be at least 1");
    }
    let requests = load_requests(&args.trace, args.block_size, args.seed.clone())?;
    let mut p = policy(
        &args.policy,
        args.capacity_blocks,
        args.small_ratio,
        args.max_freq,
    )?;
    let result = replay(
        &args.policy,
        p.as_mut(),
        args.capacity_blocks,
        args.block_size,
        &requests,
        args.per_request,
    );
    if args.json {
        println!("{}", serde_json::to_string_pretty(&result)?);
    } else {
        println!(
            "{} over {} requests, {} blocks of {} tokens: hit {} of {} prompt tokens ({:.2}%), {} blocks resident at the end",
            result.policy,
            result.requests,
            result.capacity_blocks,
            result.block_size,
            result.total_hit_tokens,
            result.total_prompt_tokens,
            100.0 * result.overall_hit_rate,
            result.final_cache_blocks
        );
    }
    Ok(())
}
