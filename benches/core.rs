//! `cargo bench --bench core`: the core engine's figures, each beside a baseline measured in
//! the same run (these machines are noisy; ratios are what to compare).
//!
//! - hashing: vLLM block hashes per second (block size 16) vs raw SHA-256 over inputs of the
//!   same size (the floor: CBOR encoding is all we add), and through the digest memo (hits,
//!   misses);
//! - decoding: blocks per second from vLLM-shaped payloads (map form 0.24+, array form <= 0.23)
//!   vs rmp-serde decoding the same bytes into a generic value;
//! - index: the Mooncake conversation trace driven on one thread (see `kv_lab::index_bench`):
//!   block-ops/s, apply blocks/s, query p50/p99, bytes per (block, pod) membership, vs kv-core's
//!   reference index (a per-block map walked block by block).
//!
//! The trace is read from `../shared/traces/mooncake/conversation_trace.jsonl` or
//! `$KV_INDEXER_TRACE`; without it the index part says so and is skipped.

use std::hint::black_box;
use std::time::Instant;

use kv_core::EngineHash;
use kv_core::{
    decode_batch, encode_batch_as, BlockRemoved, BlockStored, EventBatch, KvEvent, Medium, WireForm,
};
use kv_core::{DigestMemo, HashScratch, RequestExtras, TokenProcessor, TokenProcessorConfig};
use kv_lab::alloc::{live_heap_bytes, CountingAllocator};
use kv_lab::index_bench::{
    apply_in_lanes, drive, median, IndexBackend, IndexWorkload, KvIndexerBackend, ReferenceBackend,
    WorkloadShape,
};
use kv_lab::trace::load_mooncake;
use sha2::{Digest, Sha256};

#[global_allocator]
static GLOBAL: CountingAllocator = CountingAllocator::SYSTEM;

fn rng_tokens(n: usize, seed: u64) -> Vec<u32> {
    let mut x = seed;
    (0..n)
        .map(|_| {
            x = x
                .wrapping_mul(6364136223846793005)
                .wrapping_add(1442695040888963407);
            ((x >> 33) % 151_000) as u32
        })
        .collect()
}

/// Best-of-`rounds` seconds for `f`.
fn best_of(rounds: usize, mut f: impl FnMut()) -> f64 {
    (0..rounds)
        .map(|_| {
            let t = Instant::now();
            f();
            t.elapsed().as_secs_f64()
        })
        .fold(f64::INFINITY, f64::min)
}

fn bench_hashing() {
    let processor = TokenProcessor::new(&TokenProcessorConfig {
        hash_seed: Some("12345".into()),
        ..Default::default()
    })
    .expect("valid");
    let tokens = rng_tokens(16 * 4096, 1);
    let blocks = tokens.len() / 16;
    let mut scratch = HashScratch::default();
    let mut out = Vec::new();
    let extras = RequestExtras::default();
    let mut input_bytes = 0usize;
    processor.for_each_unit(&tokens, &extras, &mut scratch, |_, input, _| {
        input_bytes += input.len()
    });
    let ours = best_of(7, || {
        out.clear();
        processor.block_hashes_into(black_box(&tokens), &extras, &mut scratch, &mut out);
        black_box(&out);
    });
    let avg = input_bytes / blocks;
    let buf = vec![0x5au8; avg];
    let raw = best_of(7, || {
        for _ in 0..blocks {
            black_box(Sha256::digest(black_box(&buf)));
        }
    });
    println!("## Hashing (block size 16, {blocks} blocks, avg CBOR input {avg} B)");
    println!(
        "SHA-NI: {}",
        if std::arch::is_x86_feature_detected!("sha") {
            "yes"
        } else {
            "no"
        }
    );
    println!("| what | blocks/s | ratio |");
    println!("|---|---:|---:|");
    println!(
        "| raw SHA-256 of {avg} B (floor) | {:.2}M | 1.00 |",
        blocks as f64 / raw / 1e6
    );
    println!(
        "| kv-indexer sha256_cbor | {:.2}M | {:.2} |",
        blocks as f64 / ours / 1e6,
        raw / ours
    );
    // Through the daemon's default digest memo: the same prompt again (every block a hit),
    // and prompts never seen (the first token changes each round: every block a miss, looked
    // up and then written).
    let memo = DigestMemo::new(16, 16 << 20);
    let mut hash_via_memo = |tokens: &[u32]| {
        out.clear();
        processor.block_hashes_memo_into(black_box(tokens), &extras, &memo, &mut scratch, &mut out);
        black_box(&out);
    };
    hash_via_memo(&tokens);
    let hit = best_of(7, || hash_via_memo(&tokens));
    let mut unseen = tokens.clone();
    let miss = best_of(7, || {
        unseen[0] += 1;
        hash_via_memo(&unseen)
    });
    for (what, secs) in [
        ("digest memo, prompt seen before (all hits)", hit),
        ("digest memo, prompt never seen (all misses)", miss),
    ] {
        println!(
            "| {what} | {:.2}M | {:.2} |",
            blocks as f64 / secs / 1e6,
            raw / secs
        );
    }
    println!();
}

/// 200 vLLM-shaped batches in both wire forms (kv-core's encoder): 4 `BlockStored` runs of 32
/// blocks with their tokens, as vLLM 0.33 fills every field of a plain request, and 5
/// single-hash `BlockRemoved` events.
fn payloads() -> (Vec<Vec<u8>>, Vec<Vec<u8>>, usize) {
    let mut map_form = Vec::new();
    let mut array_form = Vec::new();
    let mut blocks = 0;
    let mut h = 0x1234_5678_9abc_def0u64;
    let mut next_hash = || {
        h = h.wrapping_mul(6364136223846793005).wrapping_add(1);
        EngineHash::new(h)
    };
    for batch in 0..200 {
        let mut events = Vec::new();
        for e in 0..9 {
            let stored = e < 4;
            let n = if stored { 32 } else { 1 };
            let hashes: Vec<EngineHash> = (0..n).map(|_| next_hash()).collect();
            blocks += n;
            if stored {
                let parent = next_hash();
                events.push(KvEvent::BlockStored(Box::new(BlockStored {
                    block_hashes: hashes,
                    parent_block_hash: Some(parent),
                    token_ids: rng_tokens(n * 16, parent.get()),
                    block_size: 16,
                    medium: Some(Medium::Gpu),
                    extra_keys: Some(vec![None; n]),
                    group_idx: Some(0),
                    kv_cache_spec_kind: Some("full_attention".into()),
                    ..Default::default()
                })));
            } else {
                events.push(KvEvent::BlockRemoved(BlockRemoved {
                    block_hashes: hashes,
                    medium: Some(Medium::Gpu),
                    group_idx: Some(0),
                    ..Default::default()
                }));
            }
        }
        let batch = EventBatch {
            ts: 1_700_000_000.0 + batch as f64,
            events,
            data_parallel_rank: Some(0),
        };
        map_form.push(encode_batch_as(&batch, WireForm::Map));
        array_form.push(encode_batch_as(&batch, WireForm::Array));
    }
    (map_form, array_form, blocks)
}

fn bench_decoding() {
    let (map_form, array_form, blocks) = payloads();
    for p in map_form.iter().chain(&array_form) {
        assert!(decode_batch(p).is_ok(), "bench payloads must be valid");
    }
    println!("## Decoding (200 batches x 4 BlockStored of 32 blocks + 5 BlockRemoved)");
    println!("| form | decoder | blocks/s | MB/s | ratio |");
    println!("|---|---|---:|---:|---:|");
    for (form, payloads) in [
        ("map (vLLM >= 0.24)", &map_form),
        ("array (vLLM <= 0.23)", &array_form),
    ] {
        let bytes: usize = payloads.iter().map(Vec::len).sum();
        let generic = best_of(7, || {
            for p in payloads {
                black_box(rmp_serde::from_slice::<rmpv::Value>(black_box(p)).ok());
            }
        });
        let ours = best_of(7, || {
            for p in payloads {
                black_box(decode_batch(black_box(p)).ok());
            }
        });
        for (name, t) in [("rmp-serde -> rmpv::Value", generic), ("kv-indexer", ours)] {
            println!(
                "| {form} | {name} | {:.1}M | {:.0} | {:.2} |",
                blocks as f64 / t / 1e6,
                bytes as f64 / t / 1e6,
                generic / t
            );
        }
    }
    println!();
}

fn bench_index() {
    let path = std::env::var("KV_INDEXER_TRACE").unwrap_or_else(|_| {
        format!(
            "{}/../shared/traces/mooncake/conversation_trace.jsonl",
            env!("CARGO_MANIFEST_DIR")
        )
    });
    let requests = match load_mooncake(std::path::Path::new(&path)) {
        Ok(r) => r,
        Err(e) => {
            println!(
                "## Index: SKIPPED: the Mooncake trace is not readable ({e}); set KV_INDEXER_TRACE"
            );
            return;
        }
    };
    let t = Instant::now();
    let shape = WorkloadShape::default();
    let workload = IndexWorkload::simulate(&requests, shape);
    let (_, s, r) = workload.totals();
    println!(
        "## Index: Mooncake conversation trace ({}; built in {:.1}s)",
        workload.summary(),
        t.elapsed().as_secs_f64()
    );
    println!("| backend | block-ops/s | apply blocks/s | query p50 | query p99 | bytes/membership | ratio (ops/s) |");
    println!("|---|---:|---:|---:|---:|---:|---:|");
    let mut reports = Vec::new();
    let backends: Vec<Box<dyn Fn() -> Box<dyn IndexBackend>>> = vec![
        Box::new(|| Box::new(ReferenceBackend::default())),
        Box::new(move || Box::new(KvIndexerBackend::new(shape.pods))),
    ];
    // KV_BENCH_ONLY_OURS=1 skips the baseline (for profiling).
    let skip = usize::from(std::env::var_os("KV_BENCH_ONLY_OURS").is_some());
    for make in backends.iter().skip(skip) {
        let before = live_heap_bytes();
        let mut backend = make();
        let report = drive(&workload, backend.as_mut());
        if std::env::var("KV_DEBUG").is_ok() {
            let mut kv = KvIndexerBackend::new(shape.pods);
            drive(&workload, &mut kv);
            eprintln!("{:?}", kv.index().stats());
            eprintln!("{} bytes", kv.index().memory_bytes());
            eprintln!(
                "{}: walked blocks {} query s {:.3} => {:.2} ns/block; apply s {:.3}",
                report.backend,
                report.checksum,
                report.query_seconds,
                report.query_seconds * 1e9 / report.checksum as f64,
                report.apply_seconds
            );
        }
        let bytes = live_heap_bytes().saturating_sub(before);
        drop(backend);
        reports.push((report, bytes));
    }
    let base = reports[0].0.block_ops_per_sec();
    let checksum = reports[0].0.checksum;
    for (rep, bytes) in &reports {
        assert_eq!(
            rep.checksum, checksum,
            "{} disagrees with the baseline",
            rep.backend
        );
        println!(
            "| {} | {:.1}M | {:.1}M | {:.2} us | {:.2} us | {:.1} | {:.2} |",
            rep.backend,
            rep.block_ops_per_sec() / 1e6,
            (s + r) as f64 / rep.apply_seconds / 1e6,
            rep.query_percentile_us(50.0),
            rep.query_percentile_us(99.0),
            *bytes as f64 / workload.final_memberships as f64,
            rep.block_ops_per_sec() / base
        );
    }
    println!();
    writer_lanes(&workload, shape.pods);
}

/// Writer lanes: the replay's stores and removals (no queries) applied by one or two threads
/// to an index of one or two lanes; three rounds, medians.
fn writer_lanes(workload: &IndexWorkload, pods: u32) {
    println!("## Writer lanes ({pods} pods, apply only, medians of 3 rounds)");
    println!("| lanes | threads | apply blocks/s | vs 1 lane, 1 thread | busiest thread's share |");
    println!("|---:|---:|---:|---:|---:|");
    let configs = [(1, 1), (1, 2), (2, 1), (2, 2)];
    {
        let mut rounds: Vec<Vec<f64>> = vec![Vec::new(); configs.len()];
        let mut shares = vec![0.0; configs.len()];
        for _ in 0..3 {
            for (k, &(lanes, threads)) in configs.iter().enumerate() {
                let run = apply_in_lanes(workload, pods, lanes, threads);
                rounds[k].push(run.apply_blocks_per_sec);
                shares[k] = run.busiest_share;
            }
        }
        let base = median(&rounds[0]);
        for (k, &(lanes, threads)) in configs.iter().enumerate() {
            let m = median(&rounds[k]);
            println!(
                "| {lanes} | {threads} | {:.1}M | {:.2} | {:.2} |",
                m / 1e6,
                m / base,
                shares[k]
            );
        }
    }
    println!();
}

fn main() {
    // `cargo bench` passes `--bench`; a filter argument picks one part.
    let filter: Vec<String> = std::env::args()
        .skip(1)
        .filter(|a| !a.starts_with("--"))
        .collect();
    let wants = |part: &str| filter.is_empty() || filter.iter().any(|f| part.contains(f.as_str()));
    if wants("hashing") {
        bench_hashing();
    }
    if wants("decoding") {
        bench_decoding();
    }
    if wants("index") {
        bench_index();
    }
}
