//! vLLM 0.33's own KV-cache manager as ground truth for hybrid models: the batches its
//! publisher sent while it served a chat-like workload with evictions (full attention beside
//! sliding windows of 128 and 512 tokens in both group orders, Mamba in align mode at 576-token
//! blocks with and without 16-token partial hits, MLA beside sliding-window MLA at other block
//! sizes, full attention of 32-token blocks hashed in units of 16), replayed into the indexer;
//! every probe's predicted hit must be the tokens vLLM's `get_computed_blocks` reuses.
//! `tests/fixtures/hybrid/README.md` says how the fixtures were made (`generate.py`, vLLM's
//! code from PyPI) and what each rule is.
//!
//! The negative control replays the same batches without the groups that are not full
//! attention (what an index of the full-attention group alone predicts) and must miss.

mod support;

use kv_core::{Indexer, IndexerSettings, KvEvent, ModelSettings};
use kv_core::{RequestExtras, TokenProcessor, TokenProcessorConfig};
use support::{hybrid_runs as runs, HybridRun as Run};

const MODEL: &str = "hybrid";
const POD: &str = "10.0.0.1:8000";

/// Chunked local attention's chunk size is not in vLLM's events: refused, not predicted.
const REFUSED: &str = "full+chunked256-bs16";

/// kv-indexer configured as the engine hashes: vLLM's seed and hash unit as `blockSize`.
fn processor_config(run: &Run) -> TokenProcessorConfig {
    TokenProcessorConfig {
        hash_seed: Some("12345".into()),
        block_size: run.unit,
        ..Default::default()
    }
}

/// Replays `run`'s batches (each event through `keep`) and predicts every probe's hit in
/// tokens.
fn predict(run: &Run, keep: impl Fn(&KvEvent) -> bool) -> (Indexer, Vec<u64>) {
    let ix = Indexer::new(IndexerSettings {
        default_model: ModelSettings {
            token_processor: processor_config(run),
            ..Default::default()
        },
        ..Default::default()
    })
    .expect("valid");
    for batch in &run.messages {
        let mut batch = batch.clone();
        batch.events.retain(&keep);
        ix.apply_batch(MODEL, POD, &batch).expect("applies");
    }
    let hits = run
        .probes
        .iter()
        .map(|p| {
            let r = ix
                .score_tokens(MODEL, &p.tokens, &[POD], None, None)
                .expect("model");
            u64::from(r.scores[0].matched_blocks) * run.unit as u64
        })
        .collect();
    (ix, hits)
}

/// The probes whose prediction is not vLLM's hit, described.
fn misses(run: &Run, predicted: &[u64]) -> Vec<String> {
    run.probes
        .iter()
        .zip(predicted)
        .enumerate()
        .filter(|(_, (p, &got))| got != p.hit)
        .map(|(i, (p, got))| {
            format!(
                "probe {i} ({} tokens): predicted {got}, vLLM {} (full-only {})",
                p.tokens.len(),
                p.hit,
                p.full_only
            )
        })
        .collect()
}

fn is_full_attention(e: &KvEvent) -> bool {
    match e {
        KvEvent::BlockStored(s) => matches!(
            s.kv_cache_spec_kind.as_deref(),
            None | Some("full_attention") | Some("mla_attention")
        ),
        _ => true,
    }
}

#[test]
fn our_hashes_of_a_probe_are_vllms() {
    for run in runs() {
        let processor = TokenProcessor::new(&processor_config(&run)).expect("valid");
        let ours: Vec<u64> = processor
            .block_hashes(&run.probes[0].tokens, &RequestExtras::default())
            .iter()
            .map(|h| h.get())
            .collect();
        if run.lookahead > 0 {
            // Lookahead hashes cover the next tokens too: none equal.
            assert!(ours
                .iter()
                .zip(&run.first_probe_hashes)
                .all(|(a, b)| a != b));
            continue;
        }
        assert_eq!(ours, run.first_probe_hashes, "{}", run.name);
    }
}

#[test]
fn every_probes_predicted_hit_is_the_hit_vllm_takes() {
    let mut checked = 0;
    for run in runs() {
        if run.scenario == REFUSED {
            continue;
        }
        let (_, predicted) = predict(&run, |_| true);
        let missed = misses(&run, &predicted);
        assert!(missed.is_empty(), "{}: {:#?}", run.name, missed);
        checked += run.probes.len();
    }
    assert!(checked >= 50 * 24, "{checked} probes checked");
}

#[test]
fn negative_control_an_index_of_the_full_attention_group_alone_misses() {
    let mut missed_runs = 0;
    let mut differing_runs = 0;
    for run in runs() {
        if run.scenario == REFUSED || run.lookahead > 0 {
            continue;
        }
        let differs = run.probes.iter().any(|p| p.hit != p.full_only);
        let (_, predicted) = predict(&run, is_full_attention);
        let missed = misses(&run, &predicted);
        if differs {
            differing_runs += 1;
            if !missed.is_empty() {
                missed_runs += 1;
            }
        }
    }
    assert!(differing_runs >= 20, "{differing_runs}");
    assert_eq!(
        missed_runs, differing_runs,
        "full-attention-only prediction must miss wherever vLLM's hit is not the full group's"
    );
}

#[test]
fn a_group_whose_rule_events_cannot_show_is_refused_and_counted() {
    for run in runs().into_iter().filter(|r| r.scenario == REFUSED) {
        let (ix, _) = predict(&run, |_| true);
        assert!(ix.skipped_group_events() > 0, "{}", run.name);
    }
}
