//! `cargo bench --bench text`: ScorePods with text in, server side, on the real Qwen3 tokenizer
//! (`../shared/tokenizers/qwen3`; skipped with a message when absent).
//!
//! For prompts of about 1k, 8k and 32k tokens, in the same run:
//! - **raw**: `tokenizers` encoding the text (with special tokens) directly: the baseline;
//! - **cold**: the server path with no reuse: tokenizer pool, prefix-store miss (tokenize and
//!   store), vLLM block hashing, index walk over 8 pods holding the prompt;
//! - **warm**: the same path for a prompt sharing its first 90% with an earlier one (prefix
//!   store hit: the cached tokens are used, the tail is not tokenized).

use std::path::PathBuf;
use std::sync::Arc;
use std::time::{Duration, Instant};

use kv_core::{BlockStored, EngineHash, EventBatch, KvEvent};
use kv_core::{Indexer, IndexerSettings, ModelSettings};
use kv_tokenize::{LoadedTokenizer, SourceSettings};
use kv_tokenize::{TokenizerService, TokenizerSettings};

const MODEL: &str = "Qwen/Qwen3-8B";

fn percentile(sorted: &[f64], p: f64) -> f64 {
    let rank = ((p / 100.0) * sorted.len() as f64).ceil() as usize;
    sorted[rank.clamp(1, sorted.len()) - 1]
}

/// Text of about `tokens` tokens: numbered paragraphs of varied English, prefixed by `head`.
fn text(tok: &LoadedTokenizer, head: &str, tokens: usize) -> String {
    let sentences = [
        "Prefix caching lets a serving engine reuse the attention keys and values of a prompt it has seen before.",
        "Routing a request to the pod that already holds its prefix turns a long prefill into a short one.",
        "The gateway asks the indexer which pods hold the first blocks of the prompt, then weighs load.",
        "Operators watch hit rates, time to first token and the memory the cache occupies on every node.",
    ];
    let mut out = String::from(head);
    let mut i = 0;
    while tok.encode(&out, false).map_or(0, |e| e.ids.len()) < tokens {
        for _ in 0..8 {
            out.push_str(&format!(" ({i}) {}", sentences[i % sentences.len()]));
            i += 1;
        }
    }
    out
}

fn main() {
    let dir = PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("../shared/tokenizers/qwen3");
    if !dir.join("tokenizer.json").is_file() {
        println!("## Text in: SKIPPED: {} not found", dir.display());
        return;
    }
    let runtime = tokio::runtime::Builder::new_multi_thread()
        .enable_all()
        .build()
        .expect("runtime");
    runtime.block_on(run(dir));
}

async fn run(dir: PathBuf) {
    let tok = LoadedTokenizer::from_files(MODEL, &dir.join("tokenizer.json")).expect("loads");
    let service = TokenizerService::new(
        TokenizerSettings {
            sources: SourceSettings {
                explicit: [(MODEL.to_owned(), dir.display().to_string())].into(),
                cache_dir: std::env::temp_dir(),
                hf_token: None,
                hf_endpoint: None,
                offline: true,
            },
            workers: 2,
            queue_size: 64,
            prefix_cache_size: 500_000,
            prefix_store_bytes: u64::MAX,
            large_prompt_bytes: 32 << 10,
            prefix_block_chars: 256,
            min_prefix_overlap_ratio: 0.8,
        },
        Arc::new(kv_tokenize::NoObserver),
    );
    let indexer = Indexer::new(IndexerSettings {
        default_model: ModelSettings::default(),
        ..Default::default()
    })
    .expect("valid");
    let processor = indexer
        .model_or_create(MODEL)
        .expect("model")
        .processor()
        .clone();
    let far = || Instant::now() + Duration::from_secs(60);

    println!("## Text in (Qwen3), server side: pool + prefix store + hashing + index walk");
    println!("| prompt | path | p50 | p99 | tokens/s | ratio to raw p50 |");
    println!("|---|---|---:|---:|---:|---:|");
    for (target, iterations) in [(1_000usize, 200usize), (8_000, 60), (32_000, 20)] {
        // The prompt 8 pods hold, so the walk goes the whole way.
        let base = text(&tok, "Shared system prompt.", target);
        let base_ids = tok.encode_prompt(&base).expect("encodes").ids;
        let hashes = processor.block_hashes(&base_ids, &Default::default());
        for p in 0..8 {
            let batch = EventBatch {
                ts: 0.0,
                events: vec![KvEvent::BlockStored(Box::new(BlockStored {
                    block_hashes: hashes.iter().map(|&k| EngineHash::aligned(k)).collect(),
                    block_size: 16,
                    ..Default::default()
                }))],
                data_parallel_rank: None,
            };
            indexer
                .apply_batch(MODEL, &format!("pod-{p}"), &batch)
                .expect("applies");
        }
        let n_tokens = base_ids.len() as f64;
        let mut raw = Vec::new();
        let mut cold = Vec::new();
        let mut warm = Vec::new();
        for i in 0..iterations {
            // Raw baseline: a fresh text of the same size.
            let fresh = text(&tok, &format!("Request {i} for {target}."), target);
            let t = Instant::now();
            std::hint::black_box(tok.encode_prompt(&fresh).expect("encodes"));
            raw.push(t.elapsed().as_secs_f64());
            // Cold: the same fresh text through the server path (a store miss).
            let t = Instant::now();
            let ids = service
                .encode_prompt(MODEL, fresh.clone(), far())
                .await
                .expect("tokenizes");
            assert!(!ids.from_prefix_store);
            std::hint::black_box(
                indexer
                    .score_tokens(MODEL, &ids.ids, kv_core::ALL_PODS, None, None)
                    .expect("scores"),
            );
            cold.push(t.elapsed().as_secs_f64());
            // Warm: shares its first 90% with the text just tokenized.
            let cut = fresh
                .char_indices()
                .nth(fresh.chars().count() * 9 / 10)
                .map_or(0, |(b, _)| b);
            let similar = format!("{} and a different ending number {i}.", &fresh[..cut]);
            let t = Instant::now();
            let ids = service
                .encode_prompt(MODEL, similar, far())
                .await
                .expect("tokenizes");
            assert!(ids.from_prefix_store, "a 90% shared prefix hits the store");
            std::hint::black_box(
                indexer
                    .score_tokens(MODEL, &ids.ids, kv_core::ALL_PODS, None, None)
                    .expect("scores"),
            );
            warm.push(t.elapsed().as_secs_f64());
        }
        for v in [&mut raw, &mut cold, &mut warm] {
            v.sort_by(f64::total_cmp);
        }
        let raw_p50 = percentile(&raw, 50.0);
        for (name, v) in [
            ("raw tokenizer", &raw),
            ("cold", &cold),
            ("warm (90% shared)", &warm),
        ] {
            println!(
                "| {}k tokens | {name} | {:.3} ms | {:.3} ms | {:.2}M | {:.2} |",
                (n_tokens / 1000.0).round(),
                percentile(v, 50.0) * 1e3,
                percentile(v, 99.0) * 1e3,
                n_tokens / percentile(v, 50.0) / 1e6,
                percentile(v, 50.0) / raw_p50
            );
        }
    }
    let _ = Arc::strong_count(&service);
}
