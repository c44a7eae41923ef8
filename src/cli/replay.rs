//! `kv-indexer replay`: a request trace against one block-level prefix cache (see
//! `kv_indexer::replay` for the semantics).

use std::io::BufRead;
use std::path::PathBuf;

use anyhow::{bail, Context};
use clap::Args;

use kv_indexer::hashing::{RequestExtras, TokenProcessor, TokenProcessorConfig};
use kv_indexer::replay::{policy, replay, ReplayRequest};
use kv_indexer::workload::load_mooncake;

/// Flags of `kv-indexer replay`.
#[derive(Debug, Args)]
pub struct ReplayArgs {
    /// The trace: Mooncake JSONL (`hash_ids`) or token-id JSONL (`token_ids`), detected per file.
    #[arg(long)]
    pub trace: PathBuf,
    /// lru, lfu, fifo or s3fifo.
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

/// Reads a trace in either format.
pub fn load_trace(
    path: &std::path::Path,
    block_size: u64,
    seed: Option<String>,
) -> anyhow::Result<Vec<ReplayRequest>> {
    let first = std::io::BufReader::new(
        std::fs::File::open(path).with_context(|| format!("opening {}", path.display()))?,
    )
    .lines()
    .map_while(Result::ok)
    .find(|l| !l.trim().is_empty())
    .unwrap_or_default();
    let probe: serde_json::Value = serde_json::from_str(&first)
        .with_context(|| format!("{}: the first line is not JSON", path.display()))?;
    if probe.get("hash_ids").is_some() {
        return Ok(load_mooncake(path)?
            .into_iter()
            .map(|r| ReplayRequest {
                blocks: r.hash_ids,
                input_length: r.input_length,
            })
            .collect());
    }
    if probe.get("token_ids").is_none() {
        bail!(
            "{}: lines need hash_ids (Mooncake) or token_ids",
            path.display()
        );
    }
    let processor = TokenProcessor::new(&TokenProcessorConfig {
        hash_seed: seed,
        block_size: block_size as usize,
        ..Default::default()
    })?;
    let mut out = Vec::new();
    let file = std::fs::File::open(path)?;
    for (i, line) in std::io::BufReader::new(file).lines().enumerate() {
        let line = line?;
        if line.trim().is_empty() {
            continue;
        }
        let v: serde_json::Value =
            serde_json::from_str(&line).with_context(|| format!("{}:{}", path.display(), i + 1))?;
        let tokens: Vec<u32> = v["token_ids"]
            .as_array()
            .with_context(|| format!("{}:{}: token_ids missing", path.display(), i + 1))?
            .iter()
            .map(|t| {
                t.as_u64()
                    .and_then(|t| u32::try_from(t).ok())
                    .context("a token id is not a u32")
            })
            .collect::<anyhow::Result<_>>()?;
        out.push(ReplayRequest {
            blocks: processor.block_hashes(&tokens, &RequestExtras::default()),
            input_length: tokens.len() as u64,
        });
    }
    Ok(out)
}

/// Runs the replay and prints the result.
pub fn run(args: ReplayArgs) -> anyhow::Result<()> {
    if args.block_size == 0 {
        bail!("--block-size must be at least 1");
    }
    let requests = load_trace(&args.trace, args.block_size, args.seed.clone())?;
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
