//! Keys from tokens: every engine's blocks are indexed under one key space, vLLM's
//! `sha256_cbor` with the configured seed and block size, whatever the engine publishes.
//!
//! An engine is **aligned** when its published hashes ([`EngineHash`]) are those keys
//! ([`BlockHash`]; vLLM with `--prefix-caching-hash-algo sha256_cbor`, the same
//! `PYTHONHASHSEED` and block size): its hashes are taken as keys as they come
//! ([`aligned_keys`], the one place), no extra memory. Otherwise it is **translated**: each
//! `BlockStored` run's keys are computed from its `token_ids`, chained on the key of its parent
//! (found through the engine's map), and the map keeps, per engine hash, what it stands for
//! (the chained digest the next run continues, and its key), for
//! `BlockRemoved` and for the runs that follow. Which one an engine is, is decided from its own
//! events: the first run from the prompt's root with tokens whose block 0 can be recomputed
//! (equal: aligned; different: translated), or at once when its block size is not ours. A
//! setting may force either mode.
//!
//! Invariants:
//! - an engine block of `k * blockSize` tokens stands for one key, that of the unit it ends on,
//!   as an aligned engine of that block size publishes it (vLLM 0.24+), so the engine is
//!   scored in whole engine blocks by its layout; each KV-cache group's blocks are mapped
//!   apart (by the engine hash in the group's space) and stored in the group's key space;
//!   a block size that is not a multiple of ours is refused for that engine (counted, never
//!   guessed), as is a partial chunk (it never makes a key);
//! - each published hash is paired with its own block: the i-th with the i-th when a run has
//!   a hash for every block its `token_ids` cover; otherwise (vLLM leaves null and masked
//!   blocks out, the sliding window's and Mamba's) by `place`, from the engine's map (a
//!   block's digest is the same in every group) and vLLM's rules, the run applied after the
//!   run of its step that names its blocks (`order`); a hash nothing places is skipped and
//!   counted (`unplaced_hash`), never guessed;
//! - a run that cannot be translated (its parent unknown, a LoRA whose path is not configured,
//!   multimodal keys, no tokens and unknown hashes) is skipped and counted, never guessed;
//! - copies are counted: an engine that stores the same block twice in one tier holds it
//!   until both are removed (vLLM keeps two physical blocks with one hash and announces each
//!   removal). Aligned engines pay for this only while a block has a second copy;
//! - everything here is dropped with the engine (`AllBlocksCleared`, a restart, a pod
//!   forgotten); map entries take keys from the shared budget (`size`) and give them back;
//! - a key is stored only together with the map entry that removes it: when the budget is
//!   spent, the engine's oldest entry gives its place and its keys leave the index with it (the
//!   newest blocks win), else the index evicts by its policy; what still finds no room is not
//!   stored (counted, [`Untranslatable::Full`]). The map may hold entries whose keys the index
//!   evicted, never keys without an entry;
//! - the state is built by one path: [`EngineKeys`] applying events (from a socket, the shared
//!   log or a replay), or restoring what it exported (a snapshot), in the map's order.

use std::collections::HashMap;

mod map;
mod order;
mod place;
mod tokens;
mod types;

use map::TranslationMap;
use tokens::block_digests;
pub(super) use tokens::run_extras;
pub use types::{
    EngineHashes, EngineKeyState, KeyMode, KeyNotes, TranslatedBlock, TranslationReport,
    Untranslatable,
};

use super::adapters::ModelHashing;
use super::kinds::{full_attention_kind, tier_of};
use crate::events::{BlockRemoved, BlockStored, EventBatch, KvEvent};
use crate::hashing::{BlockDigest, HashScratch, TokenProcessor};
use crate::index::{EngineId, IndexWriter, KeyBudget, Tier};
use crate::{BlockHash, EngineHash};

/// One engine's hash state (see the module docs).
#[derive(Debug, Default)]
pub(super) struct EngineKeys {
    pub(super) mode: KeyMode,
    /// Translated engines: engine hash -> what it stands for, oldest first.
    map: TranslationMap,
    /// Aligned (and undecided) engines: copies beyond the first, by (key, tier).
    copies: HashMap<(BlockHash, Tier), u32>,
    /// Published hashes skipped because no block could be paired with them for certain
    /// (`ListPods`), since the engine was first seen or last cleared.
    unplaced: u64,
    /// The block size at which the engine's hashes are the index's keys (same seed and
    /// algorithm, another block size), once a root run showed it.
    pub(super) alignable: Option<u32>,
    /// Root runs checked for [`EngineKeys::alignable`] (a few, then no more).
    pub(super) alignable_tries: u8,
}

/// What making room for new map entries works with: the shared budget, the fence (entries
/// made from this stamp on are the caller's own and never give their place) and the count of
/// entries that gave theirs.
struct Room<'a> {
    budget: &'a KeyBudget,
    fence: u64,
    evicted: &'a mut u32,
}

/// Per-model scratch for one batch (reused; no allocation per block once grown).
#[derive(Default)]
pub(super) struct Scratch {
    keys: Vec<BlockHash>,
    digests: Vec<BlockDigest>,
    hashing: HashScratch,
    /// A run's tokens with its lookahead tokens after them.
    tokens: Vec<u32>,
    /// A sparse run's hashes: their blocks where the map knows them, then as placed.
    anchors: Vec<Option<u32>>,
    placed: Vec<Option<u32>>,
    /// The run's (hash, block) pairs, in chain order.
    pairs: Vec<(u32, u32)>,
    /// A batch's application order, and the moves it is made of (`order`).
    order: Vec<usize>,
    moves: Vec<(usize, usize)>,
}

impl Scratch {
    /// The keys of the run translated last.
    pub(super) fn keys(&self) -> &[BlockHash] {
        &self.keys
    }

    /// The order a translated engine's `events` are applied in (positions), when it is not
    /// theirs: a run with fewer hashes than blocks after the run that names them (`order`).
    /// Taken out of the scratch (give it back with [`Scratch::give_back_order`]).
    pub(super) fn application_order(&mut self, events: &[KvEvent]) -> Option<Vec<usize>> {
        let mut order = std::mem::take(&mut self.order);
        if order::application_order(events, &mut order, &mut self.moves) {
            Some(order)
        } else {
            self.order = order;
            None
        }
    }

    /// Returns the vector [`Scratch::application_order`] lent.
    pub(super) fn give_back_order(&mut self, order: Vec<usize>) {
        self.order = order;
    }
}

impl EngineKeys {
    /// Map entries (what they cost, in keys of the shared budget).
    pub(super) fn translated_blocks(&self) -> usize {
        self.map.len()
    }

    /// What `ListPods` says of the engine beside its mode.
    pub(super) fn notes(&self) -> KeyNotes {
        KeyNotes {
            unplaced_hashes: self.unplaced,
            alignable_block_size: self.alignable,
        }
    }

    /// The state a snapshot carries.
    pub(super) fn export(&self) -> EngineKeyState {
        EngineKeyState {
            mode: self.mode,
            translated: self
                .map
                .in_order()
                .map(|(engine_hash, t)| TranslatedBlock {
                    engine_hash,
                    group: t.group(),
                    tip: t.tip,
                    earlier: t.earlier.to_vec(),
                    copies: t.copies,
                })
                .collect(),
            copies: self
                .copies
                .iter()
                .map(|(&(hash, tier), &n)| (hash, tier, n))
                .collect(),
            groups: Vec::new(),
        }
    }

    /// Restores a snapshot's state (replacing this one) after its blocks were imported:
    /// entries in the order exported, each taking a key of the budget as a store's would, so
    /// when the budget is short the oldest give their place and their keys leave the index
    /// (a key never outlives its entry). Returns (entries restored, entries dropped).
    pub(super) fn import(
        &mut self,
        state: EngineKeyState,
        w: &mut IndexWriter<'_>,
        engine: EngineId,
        budget: &KeyBudget,
    ) -> (usize, usize) {
        self.clear(budget);
        self.mode = state.mode;
        let mut evicted = 0;
        let mut dropped = 0;
        for t in state.translated {
            // Every entry restored before this one is older: any may give its place.
            let mut room = Room {
                budget,
                fence: u64::MAX,
                evicted: &mut evicted,
            };
            let group = t.group.min(crate::hit::MAX_GROUPS as u32 - 1);
            if self.reserve(w, engine, &mut room) {
                self.map
                    .insert(t.engine_hash, group, t.tip, t.earlier.into(), t.copies);
            } else {
                // No room at all: its keys, imported with the blocks, go too.
                remove_held(w, engine, &t.copies, &t.earlier, &t.tip, group);
                dropped += 1;
            }
        }
        dropped += evicted as usize;
        self.copies = state
            .copies
            .into_iter()
            .map(|(hash, tier, n)| ((hash, tier), n))
            .collect();
        (self.map.len(), dropped)
    }

    /// Drops everything (the engine's cache is gone), giving the map's keys back.
    pub(super) fn clear(&mut self, budget: &KeyBudget) {
        budget.give_back(self.map.len() as u64);
        self.map = TranslationMap::default();
        self.copies = HashMap::new();
        self.unplaced = 0;
    }

    /// Takes a key of the budget for a new map entry, making room as [`EngineKeys::make_room`]
    /// does (the index's policy last). False when nothing can make room.
    fn reserve(&mut self, w: &mut IndexWriter<'_>, engine: EngineId, room: &mut Room<'_>) -> bool {
        loop {
            if room.budget.take() {
                return true;
            }
            if !self.make_room(w, engine, room, 1, true) {
                return false;
            }
        }
    }

    /// Frees `need` keys of the budget: the engine's oldest entries made before the fence
    /// give their place first (their keys leave the index with them), then, with
    /// `or_index`, the index evicts by its policy. False when `need` keys are not free.
    fn make_room(
        &mut self,
        w: &mut IndexWriter<'_>,
        engine: EngineId,
        room: &mut Room<'_>,
        need: u64,
        or_index: bool,
    ) -> bool {
        let free = |b: &KeyBudget| b.limit().saturating_sub(b.used());
        while free(room.budget) < need {
            if let Some((_, oldest)) = self.map.pop_oldest_before(room.fence) {
                let group = oldest.group();
                remove_held(
                    w,
                    engine,
                    &oldest.copies,
                    &oldest.earlier,
                    &oldest.tip,
                    group,
                );
                room.budget.give_back(1);
                *room.evicted += 1;
            } else if !or_index || w.evict((need - free(room.budget)) as usize) == 0 {
                return false;
            }
        }
        true
    }

    /// Decides the mode from `batch` when it can; returns the new mode when it changed.
    /// `root_verdict` is the hash check's verdict on the batch's first root run (`Some(true)`:
    /// block 0 recomputed equal to the published hash).
    pub(super) fn decide(
        &mut self,
        setting: EngineHashes,
        processor: &TokenProcessor,
        batch: &EventBatch,
        root_verdict: Option<bool>,
    ) -> Option<KeyMode> {
        if !matches!(self.mode, KeyMode::Undecided) {
            return None;
        }
        let ours = processor.block_size() as u32;
        let stored = batch.events.iter().find_map(|e| match e {
            KvEvent::BlockStored(s) if full_attention_kind(s.kv_cache_spec_kind.as_deref()) => {
                Some(s)
            }
            _ => None,
        })?;
        let engine = stored.block_size;
        let next = if setting == EngineHashes::Aligned {
            KeyMode::Aligned
        } else if engine == 0 || !engine.is_multiple_of(ours) {
            KeyMode::Refused { engine, ours }
        } else if setting == EngineHashes::Translated {
            KeyMode::Translated
        } else if engine != ours {
            // A block of k units is aligned when it publishes the key of its last unit (vLLM
            // 0.24+ views a hybrid model's wider groups so); otherwise it is translated at once.
            match root_verdict {
                Some(true) => KeyMode::Aligned,
                _ => KeyMode::Translated,
            }
        } else {
            match root_verdict? {
                true => KeyMode::Aligned,
                false => KeyMode::Translated,
            }
        };
        self.mode = next;
        Some(next)
    }

    /// A `BlockStored` run of an aligned (or undecided) engine: stored as published, a second
    /// copy counted.
    pub(super) fn store_published(
        &mut self,
        w: &mut IndexWriter<'_>,
        engine: EngineId,
        tier: Tier,
        s: &BlockStored,
        group: u32,
        scratch: &mut Scratch,
    ) -> crate::index::StoreOutcome {
        let copies = &mut self.copies;
        scratch.keys.clear();
        scratch
            .keys
            .extend(aligned_keys(&s.block_hashes).map(|k| k.in_group(group)));
        w.store_each(
            engine,
            tier,
            s.parent_block_hash
                .map(|p| BlockHash::aligned(p).in_group(group)),
            &scratch.keys,
            |hash, added| {
                if !added {
                    *copies.entry((hash, tier)).or_insert(0) += 1;
                } else if !copies.is_empty() {
                    // A membership dropped by eviction and stored again starts at one copy.
                    copies.remove(&(hash, tier));
                }
            },
        )
    }

    /// A `BlockRemoved` of an aligned engine: a block with a second copy loses the copy, the
    /// others leave the index. Returns memberships removed.
    pub(super) fn remove_published(
        &mut self,
        w: &mut IndexWriter<'_>,
        engine: EngineId,
        r: &BlockRemoved,
        group: u32,
        scratch: &mut Scratch,
    ) -> usize {
        let tier = tier_of(r.medium.as_ref());
        scratch.keys.clear();
        let keys = aligned_keys(&r.block_hashes).map(|k| k.in_group(group));
        if self.copies.is_empty() {
            scratch.keys.extend(keys);
            return w.remove(engine, tier, &scratch.keys);
        }
        for hash in keys {
            match self.copies.get_mut(&(hash, tier)) {
                Some(n) => {
                    *n -= 1;
                    if *n == 0 {
                        self.copies.remove(&(hash, tier));
                    }
                }
                None => scratch.keys.push(hash),
            }
        }
        w.remove(engine, tier, &scratch.keys)
    }

    /// A `BlockStored` run of a translated engine in KV-cache group `group`: its keys computed
    /// from its tokens (or found in the map), stored in the group's key space, and mapped.
    /// The run's parent is looked up in its own group first, then in the engine's other
    /// groups (`groups`, as its events showed them): a sliding-window or Mamba group often
    /// lacks the block its run continues, which another group holds, and a block's digest is
    /// the same in every group. A run with fewer hashes than its tokens cover blocks has each
    /// hash paired with its own block (`place`); a hash no evidence places is skipped and
    /// counted. Returns memberships added, or why not.
    #[allow(clippy::too_many_arguments)]
    pub(super) fn store_translated(
        &mut self,
        w: &mut IndexWriter<'_>,
        engine: EngineId,
        (group, groups): (u32, &[(u32, crate::GroupSpec)]),
        s: &BlockStored,
        model: ModelHashing<'_>,
        budget: &KeyBudget,
        scratch: &mut Scratch,
        report: &mut TranslationReport,
    ) -> Result<usize, Untranslatable> {
        let processor = model.processor;
        let tier = tier_of(s.medium.as_ref());
        let ours = processor.block_size();
        let per_block = s.block_size as usize;
        if per_block == 0 || !per_block.is_multiple_of(ours) {
            // A partial page (SGLang's last page of a node) never makes a key.
            report.partial_blocks = report
                .partial_blocks
                .saturating_add(s.block_hashes.len() as u32);
            return Ok(0);
        }
        let k = per_block / ours;
        let covered = s.token_ids.len() / per_block;
        let blocks = s.block_hashes.len().min(covered);
        if blocks == 0 {
            return self.store_known(w, engine, tier, s, group, scratch);
        }
        report.uncovered_hashes = report
            .uncovered_hashes
            .saturating_add((s.block_hashes.len() - blocks) as u32);
        let parent_key = s.parent_block_hash.map(|p| {
            let others = groups.iter().map(|&(g, _)| g).filter(|&g| g != group);
            std::iter::once(group)
                .chain(others)
                .find_map(|g| self.map.get(&p.in_group(g)))
                .map(|t| (t.tip, crate::hashing::event_hash(&t.tip).in_group(group)))
        });
        let (parent_digest, parent_key) = match parent_key {
            None => (*processor.none_hash(), None),
            Some(Some((tip, key))) => (tip, Some(key)),
            Some(None) => return Err(Untranslatable::UnknownParent),
        };
        let extras = run_extras(s, s.parent_block_hash.is_none(), blocks, model)?;
        // Every block the tokens cover when hashes are fewer (to pair them), else the hashes'.
        let sparse = blocks < covered;
        let hashed = if sparse { covered } else { blocks };
        block_digests(processor, s, (&parent_digest, hashed, k), &extras, scratch);
        scratch.pairs.clear();
        if sparse {
            let unplaced = self.pair_sparse(s, (group, groups), scratch);
            report.unplaced_hashes = report.unplaced_hashes.saturating_add(unplaced);
            report.unplaced_runs += u32::from(unplaced > 0);
            self.unplaced += u64::from(unplaced);
        } else {
            scratch.pairs.extend((0..blocks as u32).map(|j| (j, j)));
        }
        let mapped = self.map_pairs(w, engine, (tier, group), s, budget, scratch, report);
        // The parent's keys may have left with its entry just now: the run is then stored as
        // an orphan (held by hash, scored once its chain is back), as any run whose parent the
        // engine does not hold.
        let keys = &mut scratch.keys;
        keys.clear();
        keys.extend(scratch.pairs[..mapped].iter().map(|&(_, b)| {
            crate::hashing::event_hash(&scratch.digests[b as usize]).in_group(group)
        }));
        let outcome = w.store(engine, tier, parent_key, keys);
        report.translated_runs += 1;
        Ok(outcome.added)
    }

    /// Pairs a sparse run's hashes with its blocks (`scratch.digests`, one per block its
    /// tokens cover) into `scratch.pairs`; returns the hashes left unplaced.
    fn pair_sparse(
        &self,
        s: &BlockStored,
        groups: (u32, &[(u32, crate::GroupSpec)]),
        scratch: &mut Scratch,
    ) -> u32 {
        let hashes = &s.block_hashes;
        let known = place::anchors(
            &self.map,
            groups,
            hashes,
            &scratch.digests,
            &mut scratch.anchors,
        );
        if !known {
            return hashes.len() as u32;
        }
        let rule = place::Rule::of(s.kv_cache_spec_kind.as_deref());
        place::place(
            scratch.digests.len(),
            &scratch.anchors,
            rule,
            &mut scratch.placed,
        );
        let placed = scratch.placed.iter().enumerate();
        scratch
            .pairs
            .extend(placed.filter_map(|(j, b)| b.map(|b| (j as u32, b))));
        (hashes.len() - scratch.pairs.len()) as u32
    }

    /// Makes (or counts a copy of) the map entry of each of `scratch.pairs`' hashes, room made
    /// first; returns how many pairs are mapped (a hash that finds no room for its entry is
    /// not stored, nor are the ones after it; counted).
    #[allow(clippy::too_many_arguments)]
    fn map_pairs(
        &mut self,
        w: &mut IndexWriter<'_>,
        engine: EngineId,
        (tier, group): (Tier, u32),
        s: &BlockStored,
        budget: &KeyBudget,
        scratch: &Scratch,
        report: &mut TranslationReport,
    ) -> usize {
        // Room first, for the entries and keys the run adds: the engine's oldest entries give
        // their place (the newest blocks win; left to the index's policy, the run's own new
        // keys could be what it evicts while old entries kept their share of the budget).
        let slot = tier as usize;
        let mut room = Room {
            budget,
            fence: self.map.next_stamp(),
            evicted: &mut report.evicted_entries,
        };
        let pairs = &scratch.pairs;
        let new_entries = pairs
            .iter()
            .filter(|&&(j, _)| {
                self.map
                    .get(&s.block_hashes[j as usize].in_group(group))
                    .is_none()
            })
            .count();
        // A block already mapped brings no entry and (unless the index evicted it) no new
        // key: only new blocks need room, an entry and a key each.
        let need = (new_entries * 2) as u64;
        self.make_room(w, engine, &mut room, need, false);
        let mut mapped = 0;
        for (n, &(j, b)) in pairs.iter().enumerate() {
            let hash = s.block_hashes[j as usize].in_group(group);
            if let Some(t) = self.map.get_mut(&hash) {
                t.copies[slot] = t.copies[slot].saturating_add(1);
            } else if self.reserve(w, engine, &mut room) {
                let mut copies = [0u16; 4];
                copies[slot] = 1;
                let digest = scratch.digests[b as usize];
                self.map.insert(hash, group, digest, Box::new([]), copies);
            } else {
                break;
            }
            mapped = n + 1;
        }
        if mapped < pairs.len() {
            report.untranslatable[Untranslatable::Full as usize] += 1;
            report.full_blocks = report
                .full_blocks
                .saturating_add((pairs.len() - mapped) as u32);
        }
        mapped
    }

    /// A run without tokens (an offload tier's event): its hashes resolved through the map.
    fn store_known(
        &mut self,
        w: &mut IndexWriter<'_>,
        engine: EngineId,
        tier: Tier,
        s: &BlockStored,
        group: u32,
        scratch: &mut Scratch,
    ) -> Result<usize, Untranslatable> {
        scratch.keys.clear();
        let slot = tier as usize;
        for hash in &s.block_hashes {
            let Some(t) = self.map.get_mut(&hash.in_group(group)) else {
                return Err(Untranslatable::NoTokens);
            };
            t.copies[slot] = t.copies[slot].saturating_add(1);
            t.keys(&mut scratch.keys);
        }
        Ok(w.store(engine, tier, None, &scratch.keys).added)
    }

    /// A `BlockRemoved` of a translated engine's group `group`: each hash's keys leave the
    /// tier once its last copy there is removed; the entry goes once no tier holds it.
    /// Returns memberships removed.
    #[allow(clippy::too_many_arguments)]
    pub(super) fn remove_translated(
        &mut self,
        w: &mut IndexWriter<'_>,
        engine: EngineId,
        r: &BlockRemoved,
        group: u32,
        budget: &KeyBudget,
        scratch: &mut Scratch,
        report: &mut TranslationReport,
    ) -> usize {
        let tier = tier_of(r.medium.as_ref());
        let slot = tier as usize;
        scratch.keys.clear();
        for hash in &r.block_hashes {
            let hash = hash.in_group(group);
            let Some(t) = self.map.get_mut(&hash) else {
                report.unknown_removals += 1;
                continue;
            };
            if t.copies[slot] == 0 {
                // A removal from a tier the engine did not hold the block in.
                report.unknown_removals += 1;
                continue;
            }
            t.copies[slot] -= 1;
            if t.copies[slot] > 0 {
                continue;
            }
            t.keys(&mut scratch.keys);
            if t.copies == [0; 4] {
                self.map.remove(&hash);
                budget.give_back(1);
            }
        }
        w.remove(engine, tier, &scratch.keys)
    }
}

/// An aligned (or undecided) engine's published hashes taken as the index's keys: the one
/// place an engine's hashes become keys without translation ([`BlockHash::aligned`]). An
/// undecided engine's are taken so meanwhile; if its events then show it translated, what was
/// stored under them is cleared.
pub(super) fn aligned_keys(hashes: &[EngineHash]) -> impl Iterator<Item = BlockHash> + '_ {
    hashes.iter().map(|&hash| BlockHash::aligned(hash))
}

/// Removes one engine block's keys (`earlier`, then the tip's, in `group`'s space) from every
/// tier `copies` says the engine holds it in (no allocation: group 0's two parts go in two
/// removals, another group's keys one by one).
fn remove_held(
    w: &mut IndexWriter<'_>,
    engine: EngineId,
    copies: &[u16; 4],
    earlier: &[BlockHash],
    tip: &BlockDigest,
    group: u32,
) {
    let last = [crate::hashing::event_hash(tip).in_group(group)];
    for tier in [Tier::Gpu, Tier::Cpu, Tier::Storage, Tier::Other] {
        if copies[tier as usize] > 0 {
            if group == 0 {
                if !earlier.is_empty() {
                    w.remove(engine, tier, earlier);
                }
            } else {
                for key in earlier {
                    w.remove(engine, tier, &[key.in_group(group)]);
                }
            }
            w.remove(engine, tier, &last);
        }
    }
}
