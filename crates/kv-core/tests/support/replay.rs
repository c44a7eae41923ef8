//! Replaying a hybrid run (`fixtures/hybrid`) into an indexer and comparing its predictions
//! with the hits vLLM took: what `hybrid_vllm` and `hybrid_defaults` share.

use kv_core::{ApplyReport, TokenProcessorConfig};
use kv_core::{EngineHash, EngineHashes, Indexer, IndexerSettings, KvEvent, ModelSettings};

use super::HybridRun as Run;

/// The model every run is replayed as.
pub const MODEL: &str = "hybrid";
/// The pod every run is published by.
pub const POD: &str = "10.0.0.1:8000";

/// kv-indexer configured as the engine hashes: vLLM's seed and hash unit as `blockSize`.
pub fn processor_config(run: &Run) -> TokenProcessorConfig {
    TokenProcessorConfig {
        hash_seed: Some("12345".into()),
        block_size: run.unit,
        ..Default::default()
    }
}

/// An indexer replaying `run`: what it predicted for every probe, in tokens
/// (`matched_blocks x blockSize`), and every batch's report.
pub struct Replay {
    /// The indexer after the run.
    pub indexer: Indexer,
    /// Every probe's predicted hit, in tokens.
    pub predicted: Vec<u64>,
    /// What each batch did.
    pub reports: Vec<ApplyReport>,
}

/// Replays `run`'s batches (each event as `edit` makes it, `None`: dropped) into an indexer
/// of the model's `settings` and predicts every probe's hit in tokens.
pub fn replay(
    run: &Run,
    settings: ModelSettings,
    edit: impl Fn(&KvEvent) -> Option<KvEvent>,
) -> Replay {
    let unit = settings.token_processor.block_size as u64;
    let indexer = Indexer::new(IndexerSettings {
        default_model: settings,
        ..Default::default()
    })
    .expect("valid");
    let mut reports = Vec::new();
    for batch in &run.messages {
        let mut batch = batch.clone();
        batch.events = batch.events.iter().filter_map(&edit).collect();
        reports.push(indexer.apply_batch(MODEL, POD, &batch).expect("applies"));
    }
    let predicted = run
        .probes
        .iter()
        .map(|p| {
            let r = indexer
                .score_tokens(MODEL, &p.tokens, &[POD], None, None)
                .expect("model");
            u64::from(r.scores[0].matched_blocks) * unit
        })
        .collect();
    Replay {
        indexer,
        predicted,
        reports,
    }
}

/// The model's settings: kv-indexer keyed as the engine hashes ([`processor_config`]), its
/// hashes taken as `hashes` says.
pub fn settings_as(run: &Run, hashes: EngineHashes) -> ModelSettings {
    ModelSettings {
        token_processor: processor_config(run),
        engine_hashes: hashes,
        ..Default::default()
    }
}

/// The probes whose prediction is not vLLM's hit, described.
pub fn misses(run: &Run, predicted: &[u64]) -> Vec<String> {
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

/// Whether `e` is not a `BlockStored` of a group other than full attention (or MLA).
pub fn is_full_attention(e: &KvEvent) -> bool {
    match e {
        KvEvent::BlockStored(s) => matches!(
            s.kv_cache_spec_kind.as_deref(),
            None | Some("full_attention") | Some("mla_attention")
        ),
        _ => true,
    }
}

/// `e` as an engine that hashes otherwise publishes it (every hash it names moved to another
/// space): its keys must be translated from its tokens.
pub fn foreign(e: &KvEvent) -> KvEvent {
    let move_hash = |h: &mut EngineHash| *h = EngineHash::new(h.get() ^ 0x5A5A_0F0F_3C3C_9696);
    let mut e = e.clone();
    match &mut e {
        KvEvent::BlockStored(s) => {
            s.block_hashes.iter_mut().for_each(move_hash);
            s.parent_block_hash.as_mut().map(move_hash);
        }
        KvEvent::BlockRemoved(r) => r.block_hashes.iter_mut().for_each(move_hash),
        _ => {}
    }
    e
}
