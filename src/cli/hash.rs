//! `kv-indexer hash`: prints the block hashes kv-indexer computes for a token list, so an
//! operator can compare them with what vLLM publishes (the first thing to check when every
//! score is 0).

use anyhow::{bail, Context};
use clap::Args;
use serde::Serialize;

use kv_core::{
    event_hash, ExtraKeysFormat, LoraAdapter, RequestExtras, TokenProcessor, TokenProcessorConfig,
};

/// Flags of `kv-indexer hash`.
#[derive(Debug, Args)]
pub struct HashArgs {
    /// Token ids, comma-separated (e.g. `--tokens 1,2,3`).
    #[arg(long, value_delimiter = ',', required = true, num_args = 1..)]
    pub tokens: Vec<String>,
    /// PYTHONHASHSEED of the vLLM processes. Default: $PYTHONHASHSEED, else vLLM's default
    /// ("vllm-none-hash", vLLM >= 0.29).
    #[arg(long)]
    pub seed: Option<String>,
    /// vLLM's --block-size.
    #[arg(long, default_value_t = 16)]
    pub block_size: usize,
    /// Hash unit for hybrid models (divides --block-size).
    #[arg(long)]
    pub hash_block_size: Option<usize>,
    /// LoRA adapter name.
    #[arg(long)]
    pub lora_name: Option<String>,
    /// LoRA adapter path (hashed by vLLM >= 0.31).
    #[arg(long)]
    pub lora_path: Option<String>,
    /// cache_salt of the request.
    #[arg(long)]
    pub cache_salt: Option<String>,
    /// Tokens after each block that its hash covers: vLLM >= 0.33's
    /// `num_hash_lookahead_tokens` (1 with an EAGLE drafter, the draft-token count with
    /// multi-module MTP; what its events' `lookahead_token_ids` lists hold). The last blocks
    /// without that many tokens after them are not hashed.
    #[arg(long, default_value_t = 0)]
    pub lookahead: usize,
    /// Extra-keys encoding: `tagged` (vLLM >= 0.31) or `untagged` (0.14-0.30).
    #[arg(long, default_value = "tagged")]
    pub extra_keys_format: String,
    /// Print JSON instead of a table.
    #[arg(long)]
    pub json: bool,
}

#[derive(Serialize)]
struct BlockOut {
    index: usize,
    hash: String,
    event_hash: u64,
}

#[derive(Serialize)]
struct HashOut {
    none_hash: String,
    blocks: Vec<BlockOut>,
}

fn hex(bytes: &[u8]) -> String {
    bytes.iter().map(|b| format!("{b:02x}")).collect()
}

/// Runs the subcommand, writing to stdout.
pub fn run(args: HashArgs) -> anyhow::Result<()> {
    let tokens = args
        .tokens
        .iter()
        .filter(|t| !t.trim().is_empty())
        .map(|t| {
            t.trim()
                .parse::<u32>()
                .with_context(|| format!("token {t:?} is not an unsigned 32-bit integer"))
        })
        .collect::<anyhow::Result<Vec<u32>>>()?;
    let format = match args.extra_keys_format.as_str() {
        "tagged" => ExtraKeysFormat::Tagged,
        "untagged" => ExtraKeysFormat::Untagged,
        other => bail!("--extra-keys-format must be tagged or untagged, not {other:?}"),
    };
    let seed = args.seed.or_else(|| std::env::var("PYTHONHASHSEED").ok());
    let processor = TokenProcessor::new(&TokenProcessorConfig {
        hash_seed: seed.clone(),
        block_size: args.block_size,
        hash_block_size: args.hash_block_size,
        extra_keys_format: format,
    })?;
    let lora = match (args.lora_name, args.lora_path) {
        (Some(name), path) => {
            if path.is_none() && format == ExtraKeysFormat::Tagged {
                bail!("--lora-path is required with --lora-name: vLLM >= 0.31 hashes the adapter path (or pass --extra-keys-format untagged)");
            }
            Some(LoraAdapter {
                name,
                path: path.unwrap_or_default(),
            })
        }
        (None, Some(_)) => bail!("--lora-path needs --lora-name"),
        (None, None) => None,
    };
    let extras = RequestExtras {
        lora,
        multimodal: Vec::new(),
        cache_salt: args.cache_salt,
    };
    let out = HashOut {
        none_hash: hex(processor.none_hash()),
        blocks: processor
            .block_digests_lookahead(&tokens, args.lookahead, &extras)
            .iter()
            .enumerate()
            .map(|(index, d)| BlockOut {
                index,
                hash: hex(d),
                event_hash: event_hash(d).get(),
            })
            .collect(),
    };
    if args.json {
        println!("{}", serde_json::to_string_pretty(&out)?);
        return Ok(());
    }
    let seed_shown = seed.map_or("unset (vllm-none-hash)".to_owned(), |s| format!("{s:?}"));
    println!("seed:       {seed_shown}");
    println!("block size: {}", processor.block_size());
    println!("none_hash:  {}", out.none_hash);
    println!(
        "tokens:     {} ({} full blocks, {} tokens not hashed)",
        tokens.len(),
        out.blocks.len(),
        tokens.len() - out.blocks.len() * processor.block_size()
    );
    println!(
        "{:>5}  {:<64}  {:>20}",
        "block", "sha256_cbor digest", "event hash (u64)"
    );
    for b in &out.blocks {
        println!("{:>5}  {}  {:>20}", b.index, b.hash, b.event_hash);
    }
    Ok(())
}
