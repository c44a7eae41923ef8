//! What a gateway asks: pod scores for a prompt given as tokens (hashed here, with the model's
//! settings) or as block hashes, and the prompt's block hashes themselves.
//!
//! Invariants: reads take no lock (the index walk is lock-free; the scratch is per thread);
//! once a thread and a reused [`ScoreResult`] have seen their largest prompt and fleet, a score
//! allocates nothing; pods are listed best first (ties by matched blocks, then name), each
//! candidate once, candidates the index never heard of with 0; a score is the hit vLLM takes:
//! never past a prompt's `num_tokens - 1` tokens (the token form), in whole engine blocks, and
//! for engines with KV-cache groups by their rule ([`super::layout_score`]).
//!
//! A score's stages: the candidates' engines; the index walk (and the layouts' rule); each
//! pod's best engine; the speculative walk (recorded routings); the listing (`list`).

use std::sync::Arc;

use thiserror::Error;

mod list;

use super::groups::Layouts;
use super::layout_score::{recorded_hit_tokens, LayoutAsk, LayoutScratch};
use super::scored::{PodRef, PodScore, RankScore};
use super::{Indexer, ModelState};
use crate::hashing::{HashScratch, RequestExtras};
use crate::index::{DenseView, EngineDirectory, EngineId, EngineScore, TierWeights, NO_POD};
use crate::marks::RoundMarks;
use crate::BlockHash;
use list::{ListScratch, Standing};

/// Why a score request failed.
#[derive(Debug, Error, PartialEq, Eq)]
pub enum ScoreError {
    /// The model is neither configured nor seen in any event.
    #[error("unknown model {0:?}: not configured and no KV events received for it")]
    UnknownModel(String),
    /// vLLM >= 0.31 hashes the adapter path, which must be configured.
    #[error("LoRA adapter {0:?} has no path configured (vLLM >= 0.31 hashes the adapter path; add it to loraAdapters)")]
    UnknownLora(String),
}

/// The answer to a score request.
#[derive(Debug, Clone, Default)]
pub struct ScoreResult {
    /// One entry per candidate (every known pod when none are given), best first.
    pub scores: Vec<PodScore>,
    /// Full blocks in the prompt.
    pub total_blocks: u32,
    /// Prompt tokens.
    pub prompt_tokens: u32,
    /// The engine directory the pods were scored against (names of [`PodRef::Known`]).
    directory: Option<Arc<EngineDirectory>>,
    /// Names of [`PodRef::Unknown`] candidates.
    unknown: Vec<Box<str>>,
    /// The speculative entries' directory (names of [`PodRef::Speculative`]).
    speculative: Option<Arc<EngineDirectory>>,
    /// With [`ScoreResult::with_ranks`]: every (pod, rank) of the candidates that holds part
    /// of the prompt (real blocks), best first; otherwise empty.
    pub ranks: Vec<RankScore>,
    want_ranks: bool,
}

impl ScoreResult {
    /// A result that also lists every (pod, rank) holding part of the prompt
    /// ([`ScoreResult::ranks`]).
    pub fn with_ranks() -> Self {
        Self {
            want_ranks: true,
            ..Self::default()
        }
    }

    /// The name of a scored pod, as named in the events' topic (or connect-mode config).
    pub fn pod(&self, score: &PodScore) -> &str {
        self.pod_name(score.pod)
    }

    /// The name of a pod handle of this result.
    pub fn pod_name(&self, pod: PodRef) -> &str {
        match pod {
            PodRef::Known(p) => self
                .directory
                .as_ref()
                .and_then(|d| d.pod(p))
                .map_or("", |name| name),
            PodRef::Unknown(i) => self.unknown.get(i as usize).map_or("", |n| n),
            PodRef::Speculative(p) => self
                .speculative
                .as_ref()
                .and_then(|d| d.pod(p))
                .map_or("", |name| name),
        }
    }

    /// The directory the pods were scored against: [`PodRef::Known`] indexes its pods (an
    /// embedder can keep its own per-pod data by that index while the directory is the same).
    pub fn directory(&self) -> Option<&Arc<EngineDirectory>> {
        self.directory.as_ref()
    }

    /// `(pod name, score)` pairs, best first.
    pub fn named(&self) -> impl Iterator<Item = (&str, &PodScore)> {
        self.scores.iter().map(move |s| (self.pod(s), s))
    }
}

/// What the speculative walk of one score call asks about.
struct SpecAsk<'a> {
    /// The prompt's keys...
    hashes: &'a [BlockHash],
    /// ...of which the first `walked` are below vLLM's cap.
    walked: usize,
    /// vLLM's cap in tokens (`None`: the prompt's tokens are unknown).
    max_tokens: Option<u64>,
    /// The model's published layouts.
    layouts: &'a Layouts,
}

/// A pod's best engine so far: (score, matched blocks, speculative blocks, rank).
type Best = (f64, u32, u32, u32);

/// The candidate list that means "every pod the model knows" (an empty list, typed).
pub const ALL_PODS: &[&str] = &[];

/// Per-thread working memory of the pod aggregation (reused by every score).
#[derive(Default)]
struct PodScratch {
    /// The candidates' engine ids.
    candidates: Vec<EngineId>,
    /// Each candidate's pod index, in the caller's order (`NO_POD`: unknown to the index).
    candidate_pods: Vec<u32>,
    /// The index's per-engine result.
    engines: Vec<EngineScore>,
    /// The pods holding the prompt's first block in this call...
    holding: RoundMarks,
    /// ...and, per pod index, its best engine's (score, matched blocks, rank), then with its
    /// speculative blocks added.
    best: Vec<Best>,
    /// The candidates' speculative engine ids.
    spec_candidates: Vec<EngineId>,
    /// The speculative walk's per-engine result.
    spec_engines: Vec<EngineScore>,
    /// Pods known only by their speculative entries that hold the prompt's first block...
    spec_holding: RoundMarks,
    /// ...and, per speculative pod index, how many blocks.
    spec_len: Vec<u32>,
    /// What scoring engines by their layouts works with.
    layouts: LayoutScratch,
    /// What the listing works with.
    list: ListScratch,
}

impl PodScratch {
    /// Each pod's best engine (its DP ranks'), by pod index, from the walk's engines; with
    /// [`ScoreResult::with_ranks`], every (pod, rank) holding part of the prompt too.
    fn best_per_pod(&mut self, dense: &DenseView, pod_slots: usize, out: &mut ScoreResult) {
        self.holding.next_round();
        if self.best.len() < pod_slots {
            self.best.resize(pod_slots, (0.0, 0, 0, 0));
        }
        out.ranks.clear();
        for e in &self.engines {
            let Some(p) = dense.pod_of(e.engine) else {
                continue;
            };
            let rank = dense.rank_of(e.engine);
            let slot = &mut self.best[p as usize];
            // The best rank; among equals, the lowest.
            let better = (e.score, e.matched_blocks, std::cmp::Reverse(rank))
                > (slot.0, slot.1, std::cmp::Reverse(slot.3));
            if self.holding.mark(p as usize) || better {
                *slot = (e.score, e.matched_blocks, 0, rank);
            }
            if out.want_ranks && e.matched_blocks > 0 {
                out.ranks.push(RankScore {
                    pod: PodRef::Known(p),
                    rank: dense.is_parallel(p).then_some(rank),
                    score: e.score,
                    matched_blocks: e.matched_blocks,
                });
            }
        }
    }
}

impl Indexer {
    /// Scores `pods` (every known pod of the model when empty) for a prompt given as tokens.
    pub fn score_tokens<S: AsRef<str>>(
        &self,
        model: &str,
        tokens: &[u32],
        pods: &[S],
        lora_name: Option<&str>,
        cache_salt: Option<&str>,
    ) -> Result<ScoreResult, ScoreError> {
        let mut result = ScoreResult::default();
        self.score_tokens_into(model, tokens, pods, lora_name, cache_salt, &mut result)?;
        Ok(result)
    }

    /// [`Indexer::score_tokens`] into a result the caller reuses: once the thread and `out`
    /// have seen their largest prompt and fleet, a call allocates nothing (a candidate the
    /// index has never heard of costs its name).
    pub fn score_tokens_into<S: AsRef<str>>(
        &self,
        model: &str,
        tokens: &[u32],
        pods: &[S],
        lora_name: Option<&str>,
        cache_salt: Option<&str>,
        out: &mut ScoreResult,
    ) -> Result<(), ScoreError> {
        let state = self
            .model(model)
            .ok_or_else(|| ScoreError::UnknownModel(model.to_owned()))?;
        let extras = self.request_extras(&state, lora_name, cache_salt)?;
        thread_local! {
            static HASHING: std::cell::RefCell<(HashScratch, Vec<BlockHash>)> =
                std::cell::RefCell::new((HashScratch::default(), Vec::new()));
        }
        HASHING.with(|cell| {
            let mut fresh = Default::default();
            let mut borrowed = cell.try_borrow_mut();
            let (scratch, hashes) = match borrowed.as_deref_mut() {
                Ok(pair) => pair,
                Err(_) => &mut fresh,
            };
            hashes.clear();
            state.hashes_into(tokens, &extras, scratch, hashes);
            // vLLM recomputes at least the last token.
            let max_tokens = (tokens.len() as u64).saturating_sub(1);
            self.score_hashes_in(&state, hashes, Some(max_tokens), pods, out);
        });
        out.prompt_tokens = tokens.len() as u32;
        Ok(())
    }

    /// The prompt's block hashes as `model`'s vLLM computes them (what [`Indexer::score_hashes`]
    /// and [`Indexer::record_routing`] take).
    pub fn block_hashes(
        &self,
        model: &str,
        tokens: &[u32],
        lora_name: Option<&str>,
        cache_salt: Option<&str>,
    ) -> Result<Vec<BlockHash>, ScoreError> {
        let state = self
            .model(model)
            .ok_or_else(|| ScoreError::UnknownModel(model.to_owned()))?;
        let extras = self.request_extras(&state, lora_name, cache_salt)?;
        let mut hashes = Vec::with_capacity(tokens.len() / state.processor.block_size().max(1));
        state.hashes_into(tokens, &extras, &mut HashScratch::default(), &mut hashes);
        Ok(hashes)
    }

    /// Scores pods for a prompt given as its block hashes (event form).
    pub fn score_hashes<S: AsRef<str>>(
        &self,
        model: &str,
        hashes: &[BlockHash],
        pods: &[S],
    ) -> Result<ScoreResult, ScoreError> {
        let mut result = ScoreResult::default();
        self.score_hashes_into(model, hashes, pods, &mut result)?;
        Ok(result)
    }

    /// [`Indexer::score_hashes`] into a result the caller reuses (see
    /// [`Indexer::score_tokens_into`]).
    pub fn score_hashes_into<S: AsRef<str>>(
        &self,
        model: &str,
        hashes: &[BlockHash],
        pods: &[S],
        out: &mut ScoreResult,
    ) -> Result<(), ScoreError> {
        let state = self
            .model(model)
            .ok_or_else(|| ScoreError::UnknownModel(model.to_owned()))?;
        self.score_hashes_in(&state, hashes, None, pods, out);
        out.prompt_tokens = 0;
        Ok(())
    }

    /// [`Indexer::score_hashes_into`] for the hashes of a prompt of `prompt_tokens` tokens
    /// (from [`Indexer::block_hashes`]): as [`Indexer::score_tokens_into`] scores, vLLM
    /// recomputes at least the prompt's last token, so a prompt of whole blocks held whole
    /// scores one block short of them.
    pub fn score_prompt_hashes_into<S: AsRef<str>>(
        &self,
        model: &str,
        hashes: &[BlockHash],
        prompt_tokens: usize,
        pods: &[S],
        out: &mut ScoreResult,
    ) -> Result<(), ScoreError> {
        let state = self
            .model(model)
            .ok_or_else(|| ScoreError::UnknownModel(model.to_owned()))?;
        let max_tokens = (prompt_tokens as u64).saturating_sub(1);
        self.score_hashes_in(&state, hashes, Some(max_tokens), pods, out);
        out.prompt_tokens = u32::try_from(prompt_tokens).unwrap_or(u32::MAX);
        Ok(())
    }

    fn request_extras(
        &self,
        state: &ModelState,
        lora_name: Option<&str>,
        cache_salt: Option<&str>,
    ) -> Result<RequestExtras, ScoreError> {
        let lora = match lora_name.filter(|n| !n.is_empty()) {
            None => None,
            Some(name) => Some(
                state
                    .lora_adapter(name)
                    .ok_or_else(|| ScoreError::UnknownLora(name.to_owned()))?,
            ),
        };
        Ok(RequestExtras {
            lora,
            multimodal: Vec::new(),
            cache_salt: cache_salt.filter(|s| !s.is_empty()).map(str::to_owned),
        })
    }

    /// Scores into `out`: the index walk over the candidates' engines, then one entry per
    /// pod (its best engine, for DP ranks), best first (ties by matched blocks, then name).
    fn score_hashes_in<S: AsRef<str>>(
        &self,
        state: &ModelState,
        hashes: &[BlockHash],
        max_tokens: Option<u64>,
        pods: &[S],
        out: &mut ScoreResult,
    ) {
        thread_local! {
            static SCRATCH: std::cell::RefCell<PodScratch> = Default::default();
        }
        SCRATCH.with(|cell| {
            let mut fresh = PodScratch::default();
            let mut borrowed = cell.try_borrow_mut();
            let scratch = match borrowed.as_deref_mut() {
                Ok(s) => s,
                Err(_) => &mut fresh,
            };
            self.score_pods(state, hashes, max_tokens, pods, scratch, out);
        });
        out.total_blocks = hashes.len() as u32;
    }

    fn score_pods<S: AsRef<str>>(
        &self,
        state: &ModelState,
        hashes: &[BlockHash],
        max_tokens: Option<u64>,
        pods: &[S],
        s: &mut PodScratch,
        out: &mut ScoreResult,
    ) {
        let directory = state.index.directory();
        out.scores.clear();
        out.unknown.clear();
        s.candidates.clear();
        s.candidate_pods.clear();
        for pod in pods {
            let (p, ids) = directory.pod_entry(pod.as_ref()).unwrap_or((NO_POD, &[]));
            s.candidates.extend_from_slice(ids);
            s.candidate_pods.push(p);
        }
        let restrict = (!pods.is_empty()).then_some(s.candidates.as_slice());
        // vLLM reuses at most `num_tokens - 1` tokens: a plain engine's walk stops there.
        let unit = state.processor.block_size().max(1) as u64;
        let walked = max_tokens.map_or(hashes.len(), |m| hashes.len().min((m / unit) as usize));
        state.index.score_engines(
            &hashes[..walked],
            restrict,
            &self.settings.weights,
            &mut s.engines,
        );
        let layouts = state.layouts.load();
        if !layouts.is_empty() {
            let ask = LayoutAsk {
                state,
                layouts: &layouts,
                hashes,
                max_tokens,
                candidates: restrict,
                weights: &self.settings.weights,
            };
            ask.score(&mut s.engines, &mut s.layouts);
        }
        s.best_per_pod(directory.dense(), directory.pod_slots(), out);
        let speculative = self.score_speculative(
            state,
            &directory,
            SpecAsk {
                hashes,
                walked,
                max_tokens,
                layouts: &layouts,
            },
            pods,
            s,
        );
        let standing = Standing {
            directory: &directory,
            dense: directory.dense(),
            speculative: speculative.as_deref(),
            holding: &s.holding,
            best: &s.best,
            spec_holding: &s.spec_holding,
            spec_len: &s.spec_len,
            weight: self.settings.speculation.weight,
        };
        list::list(&standing, pods, &s.candidate_pods, &mut s.list, out);
        out.ranks.sort_by(|a, b| {
            b.score
                .total_cmp(&a.score)
                .then(b.matched_blocks.cmp(&a.matched_blocks))
        });
        out.directory = Some(directory);
        out.speculative = speculative;
    }

    /// The speculative walk (only while the model has speculative entries): a pod whose
    /// recorded routings reach further than its real hit scores the difference at the
    /// speculative weight. Pods the index knows get it in `s.best`; pods known only by their
    /// records, in `s.spec_len` by speculative pod index. Returns the speculative directory.
    ///
    /// A recorded prompt counts as the hit the engine will take once it has run it: the
    /// walk stops at vLLM's `num_tokens - 1` cap like the real walk, and an engine with a
    /// layout (hybrid groups, engine blocks of several keys) is credited its rule's hit over
    /// the recorded prefix's whole blocks ([`recorded_hit_tokens`]), never the keys inside a
    /// block.
    fn score_speculative<S: AsRef<str>>(
        &self,
        state: &ModelState,
        directory: &EngineDirectory,
        ask: SpecAsk<'_>,
        pods: &[S],
        s: &mut PodScratch,
    ) -> Option<Arc<EngineDirectory>> {
        let SpecAsk {
            hashes,
            walked,
            max_tokens,
            layouts,
        } = ask;
        s.spec_holding.next_round();
        if state.speculation.is_empty() {
            return None;
        }
        let index = state.speculation.index();
        let sdir = index.directory();
        s.spec_candidates.clear();
        for pod in pods {
            s.spec_candidates
                .extend_from_slice(sdir.engines_of(pod.as_ref()));
        }
        let restrict = (!pods.is_empty()).then_some(s.spec_candidates.as_slice());
        // Every speculative block weighs the same; the weight is applied below.
        index.score_engines(
            &hashes[..walked],
            restrict,
            &TierWeights([1.0; 4]),
            &mut s.spec_engines,
        );
        let unit = state.processor.block_size().max(1) as u64;
        let max_tokens = max_tokens.unwrap_or(hashes.len() as u64 * unit);
        if s.spec_len.len() < sdir.pod_slots() {
            s.spec_len.resize(sdir.pod_slots(), 0);
        }
        let weight = self.settings.speculation.weight;
        for e in &s.spec_engines {
            let Some(sp) = sdir.pod_of(e.engine) else {
                continue;
            };
            let Some(name) = sdir.pod(sp) else {
                continue;
            };
            let mut n = e.matched_blocks;
            match directory.pod_index(name) {
                Some(p) => {
                    let rank = sdir.dense().rank_of(e.engine);
                    // The pod's engine is looked up by name only when some engine of the
                    // model has a layout (most fleets: none).
                    let layout = (!layouts.is_empty())
                        .then(|| directory.engine(name, rank))
                        .flatten()
                        .and_then(|r| layouts.get(&r));
                    if let Some(l) = layout {
                        let hit =
                            recorded_hit_tokens(&l.layout, hashes.len(), max_tokens, n as usize);
                        n = (hit / unit) as u32;
                    }
                    let slot = &mut s.best[p as usize];
                    if s.holding.mark(p as usize) {
                        *slot = (0.0, 0, 0, 0);
                    }
                    if n > slot.1 {
                        // The recorded routing reaches further: its rank is the one to pin.
                        let extra = n - slot.1;
                        *slot = (slot.0 + weight * extra as f64, n, extra, rank);
                    }
                }
                None => {
                    s.spec_holding.mark(sp as usize);
                    s.spec_len[sp as usize] = n;
                }
            }
        }
        Some(sdir)
    }
}
