//! What events do to the index: a batch applied in order under its engine's writer, an engine
//! cleared (its vLLM restarted), a pod removed (forgotten: blocks, engines, tallies), and a
//! snapshot's export and import. How a batch's blocks become keys (published hashes, or
//! translated from tokens) is `translate`'s.
//!
//! Invariants: a batch is one unit under one writer; the shared key budget is made room for
//! before a batch stores (evicting from the largest other model, never while holding this
//! model's writer); removing a pod leaves nothing of it behind (ids, directory entries,
//! KV-cache groups and layouts, hash-check tallies, speculative records, translation maps).

use std::collections::HashMap;
use std::sync::atomic::Ordering;
use std::sync::Arc;

use super::groups::{EngineGroups, Route};
use super::kinds::tier_of;
use super::lookahead::{self, Admission};
use super::translate::{aligned_keys, EngineKeys, Scratch};
use super::{EngineKeyState, Indexer, KeyMode, ModelState, SettingsError, TranslationReport};
use crate::events::{BlockRemoved, BlockStored, EventBatch, KvEvent};
use crate::index::{EngineId, EngineKey, IndexWriter, KeyBudget, Tier};
use crate::BlockHash;

/// What applying one batch did (for metrics and tests).
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct ApplyReport {
    /// BlockStored events applied.
    pub stored_events: u32,
    /// BlockRemoved events applied.
    pub removed_events: u32,
    /// AllBlocksCleared events applied.
    pub cleared_events: u32,
    /// Events of unknown types, skipped.
    pub unknown_events: u32,
    /// Events for KV-cache groups that are not indexed (a kind whose hit rule is not
    /// modelled, a group of a translated engine other than group 0), skipped.
    pub skipped_group_events: u32,
    /// The engine's KV-cache groups changed what scoring applies to it (a group seen for the
    /// first time, or wider).
    pub layout_changed: bool,
    /// Blocks (memberships) added.
    pub blocks_stored: u64,
    /// Memberships removed (by BlockRemoved or a clear).
    pub blocks_removed: u64,
    /// Stored runs whose parent the engine did not hold.
    pub orphan_runs: u32,
    /// Root runs whose recomputed block-0 hash equalled vLLM's.
    pub hash_matches: u32,
    /// Root runs whose recomputed block-0 hash differed.
    pub hash_mismatches: u32,
    /// This batch brought the pod's first mismatch: its diagnosis is now in
    /// [`ModelState::hash_check`] (the embedder decides how loudly to report it; the core does
    /// not log).
    pub first_mismatch: bool,
    /// The engine could not be registered (too many engines): nothing applied.
    pub engine_rejected: bool,
    /// BlockStored events of an engine whose block size cannot be translated, skipped.
    pub refused_events: u32,
    /// What translation did (engines whose hashes are not the index's keys).
    pub translation: TranslationReport,
    /// The model that gave its place to this batch's model (`max_models` reached): its
    /// blocks are gone, so whatever tracks its publishers should start them afresh.
    pub evicted_model: Option<Arc<str>>,
    /// The batch named a data-parallel rank out of range: nothing applied.
    pub rank_out_of_range: bool,
    /// Stored blocks of a batch that found its model evicted (`max_models`) every time it
    /// was admitted again: not applied.
    pub model_evicted_blocks: u64,
    /// This batch taught the model its lookahead length (vLLM's `num_hash_lookahead_tokens`):
    /// prompts are hashed with that many following tokens from now on.
    pub lookahead_learned: Option<u32>,
    /// Stored blocks of runs whose lookahead length is not the model's, refused (they are
    /// keyed in a space no prompt is hashed in).
    pub lookahead_mismatch_blocks: u64,
    /// The last refused run's lookahead length and the model's, `(run, model)`, for the log.
    pub lookahead_mismatch: Option<(u32, u32)>,
    /// Stored blocks of runs whose `lookahead_token_ids` are inconsistent (not one list per
    /// hash of one length, or not the run's own next tokens), refused.
    pub lookahead_malformed_blocks: u64,
}

impl ApplyReport {
    /// Blocks received and not indexed, and removals that found nothing, by a bounded reason
    /// (one metric family): every drop the batch caused, in one list.
    pub fn drops(&self) -> [(&'static str, u64); 9] {
        let t = &self.translation;
        [
            ("unknown_removal", u64::from(t.unknown_removals)),
            ("partial_block", u64::from(t.partial_blocks)),
            ("uncovered_hash", u64::from(t.uncovered_hashes)),
            ("unplaced_hash", u64::from(t.unplaced_hashes)),
            ("translation_full", u64::from(t.full_blocks)),
            ("model_evicted", self.model_evicted_blocks),
            ("rank_out_of_range", u64::from(self.rank_out_of_range)),
            ("lookahead_mismatch", self.lookahead_mismatch_blocks),
            ("lookahead_malformed", self.lookahead_malformed_blocks),
        ]
    }
}

/// How many times a batch whose model gave its place while the batch waited for it is
/// admitted again before its blocks are counted as dropped.
const ADMIT_TRIES: usize = 3;

/// What a snapshot's key state for one engine came to.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct KeysImported {
    /// Map entries restored.
    pub restored: usize,
    /// Map entries dropped because the key budget (`size`) had no room (the oldest first;
    /// their keys left the index with them).
    pub dropped: usize,
}

/// Gives a map's memory back once it is mostly empty (a fleet that shrank).
fn shrink_if_sparse<K: std::hash::Hash + Eq, V>(map: &mut HashMap<K, V>) {
    if map.capacity() > 64 && map.len() < map.capacity() / 4 {
        map.shrink_to_fit();
    }
}

/// Blocks a batch's `BlockStored` events carry.
fn stored_blocks(batch: &EventBatch) -> u64 {
    batch
        .events
        .iter()
        .map(|e| match e {
            KvEvent::BlockStored(s) => s.block_hashes.len() as u64,
            _ => 0,
        })
        .sum()
}

impl Indexer {
    /// Applies one decoded batch published by `pod` for `model`. The engine is
    /// `(pod, batch.data_parallel_rank)`.
    pub fn apply_batch(
        &self,
        model: &str,
        pod: &str,
        batch: &EventBatch,
    ) -> Result<ApplyReport, SettingsError> {
        self.apply_batch_when(model, pod, batch, std::time::Instant::now)
    }

    /// [`Indexer::apply_batch`] at a given instant: `now` is when the batch arrived, what a
    /// recorded routing it confirms measures its delay against (a simulation's own clock, or
    /// the wall clock).
    pub fn apply_batch_at(
        &self,
        model: &str,
        pod: &str,
        batch: &EventBatch,
        now: std::time::Instant,
    ) -> Result<ApplyReport, SettingsError> {
        self.apply_batch_when(model, pod, batch, move || now)
    }

    /// [`Indexer::apply_batch_at`] with the instant asked for only when a recorded routing
    /// needs it (a clock read per batch is not free: see [`coarse_millis`](super::coarse_millis)).
    fn apply_batch_when(
        &self,
        model: &str,
        pod: &str,
        batch: &EventBatch,
        now: impl FnOnce() -> std::time::Instant,
    ) -> Result<ApplyReport, SettingsError> {
        let mut report = ApplyReport::default();
        let rank = match batch.rank() {
            Ok(rank) => rank,
            Err(_) => {
                report.rank_out_of_range = true;
                return Ok(report);
            }
        };
        let key = EngineKey::new(pod, rank);
        let mut now = Some(now);
        for _ in 0..ADMIT_TRIES {
            let (state, evicted_model) = self.admit(model)?;
            if evicted_model.is_some() {
                report.evicted_model = evicted_model;
            }
            if self.apply_to(&state, &key, batch, &mut now, &mut report) {
                return Ok(report);
            }
            // The model gave its place while this batch was on its way: admit it again.
        }
        report.model_evicted_blocks = stored_blocks(batch);
        Ok(report)
    }

    /// Applies `batch` of engine `key` to `state`; false (nothing applied) when the model was
    /// evicted before its locks were taken.
    fn apply_to(
        &self,
        state: &ModelState,
        key: &EngineKey,
        batch: &EventBatch,
        now: &mut Option<impl FnOnce() -> std::time::Instant>,
        report: &mut ApplyReport,
    ) -> bool {
        self.make_room(state, batch);
        let mut groups = state.groups.lock();
        let mut engines = state.engine_keys.lock();
        if state.evicted.load(Ordering::Acquire) {
            return false;
        }
        state.last_write.store(self.clock(), Ordering::Relaxed);
        let (engines, scratch) = &mut *engines;
        let keys = engines.entry(key.clone()).or_default();
        let was = keys.mode;
        let changed = self.decide_mode(state, &key.pod, keys, batch, report);
        let mode = keys.mode;
        let unit = state.processor.block_size() as u32;
        // A translated engine's run with fewer hashes than blocks waits for the run of the same
        // step that names its blocks (`translate`'s order).
        let order = match mode {
            KeyMode::Translated => scratch.application_order(&batch.events),
            _ => None,
        };
        let mut run = EngineRun {
            state,
            budget: &self.budget,
            keys,
            groups: groups.entry(key.clone()).or_default(),
            scratch: &mut *scratch,
            report: &mut *report,
            mode,
            unit,
            speculating: !state.speculation.is_empty(),
            confirmed: Vec::new(),
            layout_changed: false,
        };
        let applied = state.index.write_engine(key, |w, engine| {
            if changed.is_some() && was == KeyMode::Undecided && mode != KeyMode::Aligned {
                // What was stored under the engine's own hashes is not keys.
                run.report.blocks_removed += w.clear_engine(engine) as u64;
                run.keys.clear(run.budget);
            }
            for at in 0..batch.events.len() {
                let event = &batch.events[order.as_ref().map_or(at, |o| o[at])];
                run.event(w, engine, event);
            }
            engine
        });
        let (confirmed, layout_changed, speculating) =
            (run.confirmed, run.layout_changed, run.speculating);
        if let Some(order) = order {
            scratch.give_back_order(order);
        }
        match applied {
            None => {
                report.engine_rejected = true;
                engines.remove(key);
                groups.remove(key);
            }
            Some(engine) if layout_changed => {
                report.layout_changed = true;
                let layout = groups.get(key).and_then(|g| g.published(unit));
                state.publish_layout(engine, layout);
            }
            Some(_) => {}
        }
        drop(groups);
        if speculating {
            let now = now.take().map_or_else(std::time::Instant::now, |f| f());
            confirm_speculation(state, &key.pod, batch, mode, confirmed, now);
        }
        self.totals
            .unknown_events
            .fetch_add(report.unknown_events as u64, Ordering::Relaxed);
        self.totals
            .skipped_group_events
            .fetch_add(report.skipped_group_events as u64, Ordering::Relaxed);
        true
    }

    /// Checks the batch's hashes while they may be taken as keys and decides an undecided
    /// engine's key mode (the first root run's verdict: block 0 recomputed equal to the
    /// published hash); returns the new mode when it changed.
    fn decide_mode(
        &self,
        state: &ModelState,
        pod: &Arc<str>,
        keys: &mut EngineKeys,
        batch: &EventBatch,
        report: &mut ApplyReport,
    ) -> Option<KeyMode> {
        let checks = if matches!(keys.mode, KeyMode::Undecided | KeyMode::Aligned) {
            self.check_hashes(state, batch)
        } else {
            Default::default()
        };
        let changed = keys.decide(
            state.engine_hashes,
            &state.processor,
            batch,
            checks.verdict(),
        );
        report.translation.mode_changed = changed;
        let mode = keys.mode;
        if mode != KeyMode::Aligned && keys.alignable.is_none() && keys.alignable_tries < 3 {
            // Whether the operator could set blockSize to score it aligned (a few root runs).
            if let Some(found) = self.alignable_block_size(state, batch) {
                keys.alignable_tries += 1;
                keys.alignable = found;
                report.translation.alignable = found;
            }
        }
        // A translated or refused engine's hashes are not taken as keys: not mismatches to
        // count or warn about (the diagnosis is kept, to say why).
        let counted = matches!(mode, KeyMode::Undecided | KeyMode::Aligned);
        self.record_checks(state, pod, batch, &checks, counted, report);
        changed
    }

    /// When the shared key budget cannot take `batch`'s new blocks, evicts that many from the
    /// model holding the most keys, if it is another one (this model evicts its own as it
    /// stores). Takes one other model's writer at a time, never while holding this one's.
    fn make_room(&self, state: &ModelState, batch: &EventBatch) {
        let incoming = stored_blocks(batch);
        let over = (self.budget.used() + incoming).saturating_sub(self.budget.limit());
        if over == 0 {
            return;
        }
        let largest = self
            .models
            .load()
            .values()
            .max_by_key(|m| m.index.key_count())
            .cloned();
        if let Some(other) = largest.filter(|m| m.name != state.name) {
            other.index.evict(over as usize);
        }
    }

    /// Forgets `pod` in `model` entirely: its blocks, its engines (ids and directory entries)
    /// and its per-pod tallies, so a fleet whose pods come and go under new names holds only
    /// the pods it has now. Returns memberships removed.
    pub fn remove_pod(&self, model: &str, pod: &str) -> usize {
        let Some(state) = self.model(model) else {
            return 0;
        };
        let directory = state.index.directory();
        let mut groups = state.groups.lock();
        let mut engines = state.engine_keys.lock();
        for &e in directory.engines_of(pod) {
            state.publish_layout(e, None);
            if let Some(key) = directory.key(e) {
                groups.remove(&key);
                if let Some(mut keys) = engines.0.remove(&key) {
                    keys.clear(&self.budget);
                }
            }
        }
        shrink_if_sparse(&mut groups);
        shrink_if_sparse(&mut engines.0);
        drop(engines);
        drop(groups);
        let mut checks = state.hash_checks.lock();
        checks.remove(pod);
        shrink_if_sparse(&mut checks);
        drop(checks);
        state.speculation.clear_pod(pod);
        state.index.remove_pod(pod)
    }

    /// Calls `f` with every model's engines and the blocks they hold, with their tiers (a
    /// snapshot's content), one engine at a time. Consistent only while nothing writes (the
    /// caller pauses its writers).
    pub fn export_each(&self, mut f: impl FnMut(&str, &EngineKey, &[(BlockHash, Tier)])) {
        let mut models: Vec<_> = self.models.load().values().cloned().collect();
        models.sort_by(|a, b| a.name.cmp(&b.name));
        for m in models {
            m.index.export_each(|key, blocks| f(&m.name, key, blocks));
        }
    }

    /// Calls `f` with every engine's key state that a snapshot must carry (decided engines:
    /// their mode, a translated engine's map, an aligned engine's second copies). Consistent
    /// only while nothing writes.
    pub fn export_keys_each(&self, mut f: impl FnMut(&str, &EngineKey, &EngineKeyState)) {
        let mut models: Vec<_> = self.models.load().values().cloned().collect();
        models.sort_by(|a, b| a.name.cmp(&b.name));
        for m in models {
            let groups = m.groups.lock();
            let engines = m.engine_keys.lock();
            let mut keys: Vec<_> = engines.0.iter().collect();
            keys.sort_by(|a, b| a.0.cmp(b.0));
            for (key, state) in keys {
                if state.mode != KeyMode::Undecided {
                    let mut exported = state.export();
                    if let Some(g) = groups.get(key) {
                        exported.groups = g.seen().to_vec();
                    }
                    f(&m.name, key, &exported);
                }
            }
        }
    }

    /// Restores an engine's key state from a snapshot (after its blocks were imported), in
    /// the order exported: when the key budget is short, the oldest map entries give their
    /// place and their keys leave the index (no key outlives its entry).
    pub fn import_keys(
        &self,
        model: &str,
        key: &EngineKey,
        state: EngineKeyState,
    ) -> Result<KeysImported, SettingsError> {
        let m = self.model_or_create(model)?;
        let unit = m.processor.block_size() as u32;
        let mut groups = m.groups.lock();
        let engine_groups = groups.entry(key.clone()).or_default();
        engine_groups.restore(&state.groups);
        let layout = engine_groups.published(unit);
        let mut engines = m.engine_keys.lock();
        let keys = engines.0.entry(key.clone()).or_default();
        let imported = m.index.write_engine(key, |w, engine| {
            m.publish_layout(engine, layout);
            let (restored, dropped) = keys.import(state, w, engine, &self.budget);
            KeysImported { restored, dropped }
        });
        Ok(imported.unwrap_or_default())
    }

    /// `pod` at rank `rank` holds `hashes` in `tier` (a snapshot being loaded). Returns the
    /// memberships added.
    pub fn import(
        &self,
        model: &str,
        key: &EngineKey,
        tier: Tier,
        hashes: &[BlockHash],
    ) -> Result<usize, SettingsError> {
        let state = self.model_or_create(model)?;
        Ok(state
            .index
            .write_engine(key, |w, e| w.store(e, tier, None, hashes).added)
            .unwrap_or(0))
    }

    /// Drops every block of every model (before a snapshot replaces the index). Returns
    /// memberships removed.
    pub fn clear_all(&self) -> usize {
        self.models
            .load()
            .values()
            .map(|state| self.clear_model(state))
            .sum()
    }

    /// Drops every block and engine-hash map of one model. Returns memberships removed.
    pub(super) fn clear_model(&self, state: &ModelState) -> usize {
        let mut engines = state.engine_keys.lock();
        for keys in engines.0.values_mut() {
            keys.clear(&self.budget);
        }
        engines.0.clear();
        drop(engines);
        let directory = state.index.directory();
        let mut removed = 0;
        for (pod, _) in directory.pods() {
            for &e in directory.engines_of(pod) {
                removed += state.index.write(e, |w| w.clear_engine(e));
            }
        }
        removed
    }

    /// Drops every block of one engine (`pod` at data-parallel rank `rank`): its vLLM process
    /// restarted. Returns memberships removed.
    pub fn clear_engine(&self, model: &str, pod: &str, rank: u32) -> usize {
        let Some(state) = self.model(model) else {
            return 0;
        };
        let key = EngineKey::new(pod, rank);
        // A restarted engine may hash differently now (and serve another layout): its mode
        // and groups are learned again.
        if let Some(mut keys) = state.engine_keys.lock().0.remove(&key) {
            keys.clear(&self.budget);
        }
        state.groups.lock().remove(&key);
        state
            .index
            .write_engine(&key, |w, e| {
                state.publish_layout(e, None);
                w.clear_engine(e)
            })
            .unwrap_or(0)
    }
}

/// One engine's batch being applied under its model's writer: what each event reads and
/// adds to.
struct EngineRun<'a> {
    state: &'a ModelState,
    budget: &'a KeyBudget,
    /// How the engine's hashes become keys.
    keys: &'a mut EngineKeys,
    /// The engine's KV-cache groups as its events showed them.
    groups: &'a mut EngineGroups,
    scratch: &'a mut Scratch,
    report: &'a mut ApplyReport,
    /// The engine's key mode for this batch.
    mode: KeyMode,
    /// The model's block size, tokens.
    unit: u32,
    /// Whether the model has speculative entries (then translated runs' keys are kept).
    speculating: bool,
    /// The keys of the translated runs stored, for the speculative entries to confirm.
    confirmed: Vec<Vec<BlockHash>>,
    /// Whether a group was seen for the first time, or wider.
    layout_changed: bool,
}

impl EngineRun<'_> {
    /// Applies one event of the batch to the engine.
    fn event(&mut self, w: &mut IndexWriter<'_>, engine: EngineId, event: &KvEvent) {
        match event {
            KvEvent::BlockStored(s) => self.stored(w, engine, s),
            KvEvent::BlockRemoved(r) => self.removed(w, engine, r),
            KvEvent::AllBlocksCleared => {
                self.report.blocks_removed += w.clear_engine(engine) as u64;
                self.keys.clear(self.budget);
                self.report.cleared_events += 1;
            }
            KvEvent::Unknown(_) => self.report.unknown_events += 1,
        }
    }

    /// A `BlockStored` run: admitted under the model's lookahead, routed to its group, stored
    /// as the engine's key mode says.
    fn stored(&mut self, w: &mut IndexWriter<'_>, engine: EngineId, s: &BlockStored) {
        let report = &mut *self.report;
        let blocks = s.block_hashes.len() as u64;
        match lookahead::admit(&self.state.lookahead, s) {
            Admission::Indexed(learned) => {
                report.lookahead_learned = learned.or(report.lookahead_learned);
            }
            Admission::Mismatch { run, model } => {
                report.lookahead_mismatch = Some((run, model));
                report.lookahead_mismatch_blocks += blocks;
                return;
            }
            Admission::Malformed => {
                report.lookahead_malformed_blocks += blocks;
                return;
            }
        }
        let (route, changed) = self.groups.stored(s, self.unit, self.state.model_groups);
        self.layout_changed |= changed;
        let Route::Group(group) = route else {
            report.skipped_group_events += 1;
            return;
        };
        report.stored_events += 1;
        match self.mode {
            KeyMode::Undecided | KeyMode::Aligned => {
                let tier = tier_of(s.medium.as_ref());
                let outcome = self
                    .keys
                    .store_published(w, engine, tier, s, group, self.scratch);
                report.blocks_stored += outcome.added as u64;
                report.orphan_runs += u32::from(outcome.orphan);
            }
            KeyMode::Translated => {
                let stored = self.keys.store_translated(
                    w,
                    engine,
                    (group, self.groups.seen()),
                    s,
                    self.state.hashing(),
                    self.budget,
                    self.scratch,
                    &mut report.translation,
                );
                match stored {
                    Ok(added) => {
                        report.blocks_stored += added as u64;
                        if self.speculating {
                            self.confirmed.push(self.scratch.keys().to_vec());
                        }
                    }
                    Err(why) => report.translation.untranslatable[why as usize] += 1,
                }
            }
            KeyMode::Refused { .. } => report.refused_events += 1,
        }
    }

    /// A `BlockRemoved` event, routed to its group, removed as the engine's key mode says.
    fn removed(&mut self, w: &mut IndexWriter<'_>, engine: EngineId, r: &BlockRemoved) {
        let Route::Group(group) = self.groups.removed(r.group_idx) else {
            self.report.skipped_group_events += 1;
            return;
        };
        self.report.removed_events += 1;
        self.report.blocks_removed += match self.mode {
            KeyMode::Undecided | KeyMode::Aligned => {
                self.keys
                    .remove_published(w, engine, r, group, self.scratch)
            }
            KeyMode::Translated => self.keys.remove_translated(
                w,
                engine,
                r,
                group,
                self.budget,
                self.scratch,
                &mut self.report.translation,
            ),
            KeyMode::Refused { .. } => 0,
        } as u64;
    }
}

/// Confirms `pod`'s speculative entries with the runs `batch` stored: their keys as
/// published, or (a translated engine) the keys translation gave them.
fn confirm_speculation(
    state: &ModelState,
    pod: &str,
    batch: &EventBatch,
    mode: KeyMode,
    mut confirmed: Vec<Vec<BlockHash>>,
    now: std::time::Instant,
) {
    if mode != KeyMode::Translated {
        // The hashes were taken as keys as published.
        confirmed = batch
            .events
            .iter()
            .filter_map(|e| match e {
                KvEvent::BlockStored(s) => Some(aligned_keys(&s.block_hashes).collect()),
                _ => None,
            })
            .collect();
    }
    let stored: Vec<&[BlockHash]> = confirmed.iter().map(Vec::as_slice).collect();
    state.speculation.confirm(pod, &stored, now);
}
