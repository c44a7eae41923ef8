//! One request's pick: its candidates (the pool's, else the model's live publishers, narrowed
//! by the subset hint),
//! their prefix scores through the daemon's scoring (tokenizer, chat template, LoRA and salt),
//! their load from the scraper, kv-core's [`pick`](kv_core::pick()), and the pick recorded as
//! a speculative entry.
//!
//! With prefill/decode roles in the pool the pick is among the candidates that decode, and
//! `split` decides whether a prefill pod is named too (`endpointPicker.pd`).
//!
//! Invariants: an outcome is exactly one of [`Outcome`]'s kinds, each counted by the caller;
//! a subset hint only narrows the pool (an endpoint it names that the pool does not hold is
//! never picked; nothing left is 503); a request scoring finds malformed is the client's error
//! (400), an overloaded tokenizer or a full picker sheds (429), and any other scoring failure
//! (a tokenizer that cannot load, a deadline) still picks, on load alone, counted as
//! `picked_without_prefix`.

use std::borrow::Cow;
use std::collections::{BTreeMap, HashMap};
use std::net::{IpAddr, SocketAddr};
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

use super::body::PickRequest;
use super::scrape::Scraper;
use crate::ingest::lifecycle::Presence;
use crate::ingest::Pods;
use crate::metrics::Metrics;
use crate::pool::{Pool, PoolEndpoint};
use crate::scoring::routing::RoutingRecord;
use crate::scoring::{ScoreRequest, Scores, Scoring, ScoringError};
use kv_core::{mix64, Candidate, Indexer, PickSettings, Role, SplitMix64, SplitRule};

/// How long scoring one request may take (tokenizing an 8,000-token chat included).
const SCORE_DEADLINE: Duration = Duration::from_secs(5);

/// A pick, as the gateway is told it.
#[derive(Debug, Clone, PartialEq)]
pub struct Decision {
    /// The endpoints, best first (`ip:port`): the pick, then at most
    /// `endpointPicker.fallbacks` fallbacks.
    pub endpoints: Vec<String>,
    /// Each endpoint's pod in the index and its rank (same order as `endpoints`).
    pub targets: Vec<(String, Option<u32>)>,
    /// The first endpoint's data-parallel rank, for a data-parallel pod.
    pub rank: Option<u32>,
    /// Whether the prefix score took part.
    pub with_prefix: bool,
    /// What the routing record needs should another endpoint serve (the prompt key).
    pub record: Option<(String, Vec<u8>)>,
    /// The prompt tokens the engine is predicted to reuse on each of `endpoints` (same order;
    /// empty when the prefix was not scored).
    pub predicted_tokens: Vec<u32>,
    /// The prefill pod's `ip:port` when the prefill is split off (`x-prefiller-host-port`).
    pub prefiller: Option<String>,
}

impl Decision {
    /// The tokens predicted cached on `endpoint`, if it is one of the answer's.
    pub fn predicted_on(&self, endpoint: &str) -> Option<u32> {
        let i = self.endpoints.iter().position(|e| e == endpoint)?;
        self.predicted_tokens.get(i).copied()
    }
}

/// What a request came to.
#[derive(Debug)]
pub enum Outcome {
    /// Picked.
    Picked(Decision),
    /// No candidate (503).
    NoCandidates(String),
    /// Shed (429).
    Shed(String),
    /// Not a request the picker can read (400).
    BadRequest(&'static str, String),
}

/// The picker's state shared by every stream.
pub struct Chooser {
    pub(super) scoring: Arc<Scoring>,
    pub(super) indexer: Arc<Indexer>,
    pub(super) pods: Pods,
    pub(super) scraper: Arc<Scraper>,
    pub(super) pool: Arc<Pool>,
    pub(super) metrics: Arc<Metrics>,
    pub(super) settings: PickSettings,
    /// Fallbacks listed after the pick (`endpointPicker.fallbacks`).
    pub(super) fallbacks: usize,
    /// LoRA adapter name -> its base model (vLLM serves an adapter as a model).
    pub(super) adapters: BTreeMap<String, String>,
    /// Picks so far, mixed with the process's seed into each pick's own tie-break stream
    /// (no lock shared by concurrent picks).
    pub(super) picks: AtomicU64,
    pub(super) seed: u64,
    /// When a prefill is split off (`endpointPicker.pd`).
    pub(super) pd: SplitRule,
}

/// The IP of an endpoint or a hint, parsed (`ip:port`, `[v6]:port`, or a bare IP), in its
/// canonical form (an IPv4-mapped IPv6 address as IPv4), so spellings of one address compare
/// equal; `None` when it is not an address.
fn ip_of(endpoint: &str) -> Option<IpAddr> {
    let ip = match endpoint.parse::<SocketAddr>() {
        Ok(addr) => addr.ip(),
        Err(_) => endpoint
            .trim_start_matches('[')
            .trim_end_matches(']')
            .parse::<IpAddr>()
            .ok()?,
    };
    Some(ip.to_canonical())
}

/// An endpoint's prefix score, rank and matched blocks.
pub(super) type Scored = (f64, Option<u32>, u32);

/// The prefix scores of one request: per pod, its score, best rank and matched blocks; per
/// pod, each rank's (for data-parallel endpoints).
#[derive(Default)]
pub(super) struct Prefix {
    by_pod: HashMap<String, (f64, Option<u32>, u32)>,
    by_rank: HashMap<String, Vec<(u32, f64, u32)>>,
    prompt_key: Vec<u8>,
    pub(super) block_size: u32,
    pub(super) scored: bool,
    /// The prompt's tokens, as the engine sees them.
    pub(super) prompt_tokens: u32,
}

impl Prefix {
    fn of(scores: Scores) -> Self {
        let result = &scores.result;
        let by_pod = result
            .named()
            .map(|(pod, s)| (pod.to_owned(), (s.score, s.rank, s.matched_blocks)))
            .collect();
        let mut by_rank: HashMap<String, Vec<(u32, f64, u32)>> = HashMap::new();
        for r in &result.ranks {
            if let Some(rank) = r.rank {
                by_rank
                    .entry(result.pod_name(r.pod).to_owned())
                    .or_default()
                    .push((rank, r.score, r.matched_blocks));
            }
        }
        Self {
            by_pod,
            by_rank,
            prompt_key: scores.prompt_key,
            block_size: u32::try_from(scores.block_size).unwrap_or(u32::MAX),
            scored: true,
            prompt_tokens: result.prompt_tokens,
        }
    }

    /// An endpoint's score, rank and matched blocks: its pod's (best rank), or for a
    /// data-parallel endpoint its rank's (the pod's best when that is its rank, which covers
    /// recorded routings; else the rank's own blocks).
    pub(super) fn of_endpoint(&self, e: &PoolEndpoint) -> (f64, Option<u32>, u32) {
        let pod = self.by_pod.get(&e.pod).copied();
        let Some(k) = e.rank else {
            return pod.unwrap_or_default();
        };
        match pod {
            Some((score, Some(best), blocks)) if best == k => (score, Some(k), blocks),
            _ => self
                .by_rank
                .get(&e.pod)
                .and_then(|ranks| ranks.iter().find(|r| r.0 == k))
                .map_or((0.0, Some(k), 0), |&(_, score, blocks)| {
                    (score, Some(k), blocks)
                }),
        }
    }
}

impl Chooser {
    /// The model to score and the adapter: the body's `model` when the index knows it, else the
    /// base model of the adapter of that name.
    fn resolve(&self, model: &str) -> (String, String) {
        if self.indexer.model(model).is_none() {
            if let Some(base) = self.adapters.get(model) {
                return (base.clone(), model.to_owned());
            }
        }
        (model.to_owned(), String::new())
    }

    /// The model's pods the index knows and ingestion has not seen leave.
    pub(super) fn live_pods(&self, model: &str) -> Vec<String> {
        let Some(state) = self.indexer.model(model) else {
            return Vec::new();
        };
        let presence = self.pods.presence();
        let directory = state.index().directory();
        let mut pods: Vec<String> = directory
            .pods()
            .filter(|(pod, _)| !matches!(presence.get(*pod), Some((Presence::Gone(_), _))))
            .map(|(pod, _)| pod.to_string())
            .collect();
        pods.sort_unstable();
        pods
    }

    /// Every pod the scraper should watch: each model's live pods.
    pub(super) fn all_live_pods(&self) -> Vec<Arc<str>> {
        let mut pods: Vec<Arc<str>> = self
            .indexer
            .models()
            .iter()
            .flat_map(|m| self.live_pods(m.name()))
            .map(Arc::from)
            .collect();
        pods.sort_unstable();
        pods.dedup();
        pods
    }

    /// What the scraper reads: the pool's Ready endpoints, else every live publisher.
    pub(super) fn scrape_targets(&self) -> Vec<Arc<str>> {
        let Some(targets) = self.pool.scrape_targets() else {
            let pods = self.all_live_pods();
            self.pool.forget_unscraped(&pods);
            return pods;
        };
        self.pool.note_publishers(
            &self
                .all_live_pods()
                .iter()
                .map(|p| p.to_string())
                .collect::<Vec<_>>(),
        );
        targets
    }

    /// The pool's candidates; without a pool, the model's live publishers (every live pod for
    /// a request without a model) whose metrics endpoint has not stopped answering.
    fn pool_of(&self, model: &str) -> Vec<PoolEndpoint> {
        let view = self.pool.view();
        if self.pool.is_pool() {
            return view.candidates.clone();
        }
        let pods: Vec<String> = match model.is_empty() {
            true => self.all_live_pods().iter().map(|p| p.to_string()).collect(),
            false => self.live_pods(model),
        };
        pods.into_iter()
            .filter(|p| !view.unreachable.contains(p))
            .map(PoolEndpoint::plain)
            .collect()
    }

    /// The candidates: the pool, narrowed by the subset hint; `Err` says why none is left
    /// when the hint named none of them.
    fn candidates(
        &self,
        model: &str,
        subset: Option<Vec<String>>,
    ) -> Result<Vec<PoolEndpoint>, String> {
        let pool = self.pool_of(model);
        let Some(hint) = subset else {
            return Ok(pool);
        };
        // As GIE's EPP matches it: by address, whatever port the hint names (a data-parallel
        // pod serves several); addresses compare parsed, so spellings of one IP match.
        let hinted: Vec<Option<IpAddr>> = hint.iter().map(|h| ip_of(h)).collect();
        let held = |p: &PoolEndpoint| ip_of(&p.address);
        let kept: Vec<PoolEndpoint> = pool
            .iter()
            .filter(|p| held(p).is_some_and(|ip| hinted.contains(&Some(ip))))
            .cloned()
            .collect();
        let outside = hinted
            .iter()
            .filter(|h| h.is_none() || !kept.iter().any(|p| held(p) == **h))
            .count();
        self.metrics.picker.subset_outside_pool(outside);
        match kept.is_empty() && !pool.is_empty() {
            true => Err(format!(
                "the gateway's subset hint ({}) names no candidate of the pool ({} candidates)",
                hint.join(","),
                pool.len()
            )),
            false => Ok(kept),
        }
    }

    /// Scores the prompt on `candidates`; an error the client or the load caused ends the
    /// request, any other picks on load alone.
    async fn prefix(
        &self,
        request: &mut Option<PickRequest>,
        model: &str,
        lora: String,
        candidates: &[PoolEndpoint],
    ) -> Result<Prefix, Outcome> {
        let Some(prompt) = request.as_mut().and_then(|r| r.prompt.take()) else {
            return Ok(Prefix::default());
        };
        if self.indexer.model(model).is_none() {
            return Ok(Prefix::default());
        }
        let mut pods: Vec<String> = candidates.iter().map(|c| c.pod.clone()).collect();
        pods.sort_unstable();
        pods.dedup();
        let req = ScoreRequest {
            model: model.to_owned(),
            prompt,
            lora,
            cache_salt: request
                .as_mut()
                .map(|r| std::mem::take(&mut r.cache_salt))
                .unwrap_or_default(),
            candidates: pods,
            every_rank: candidates.iter().any(|c| c.rank.is_some()),
        };
        let scored = self
            .scoring
            .score(req, Instant::now() + SCORE_DEADLINE)
            .await;
        match scored {
            Ok(scores) => Ok(Prefix::of(scores)),
            Err(ScoringError::Invalid(m)) => Err(Outcome::BadRequest("prompt", m)),
            Err(ScoringError::Overloaded(m)) => Err(Outcome::Shed(m)),
            Err(e) => {
                tracing::warn!(%model, error = %e, "cannot score the prompt; picking on load alone");
                Ok(Prefix::default())
            }
        }
    }

    /// Picks for `request` (`None`: a request without a body) among the pool, narrowed by
    /// `subset` (the subset hint).
    pub async fn choose(
        &self,
        mut request: Option<PickRequest>,
        subset: Option<Vec<String>>,
    ) -> Outcome {
        let (model, lora) = match &request {
            Some(r) => self.resolve(&r.model),
            None => (String::new(), String::new()),
        };
        let candidates = match self.candidates(&model, subset) {
            Ok(c) => c,
            Err(why) => return Outcome::NoCandidates(why),
        };
        if candidates.is_empty() {
            return Outcome::NoCandidates(match (self.pool.why_empty(), &request) {
                (Some(why), _) => why,
                (None, Some(r)) => format!("no ready endpoint serves model {:?}", r.model),
                (None, None) => "no ready endpoint".into(),
            });
        }
        let _permit = match self.scoring.admit() {
            Ok(p) => p,
            Err(e) => return Outcome::Shed(e.to_string()),
        };
        let prefix = match self.prefix(&mut request, &model, lora, &candidates).await {
            Ok(p) => p,
            Err(outcome) => return outcome,
        };
        self.decide(&model, &candidates, prefix)
    }

    /// kv-core's pick over `candidates` with their prefix and load: the candidates' indices,
    /// best first, and each candidate's score, rank and matched blocks.
    pub(super) fn rank(
        &self,
        candidates: &[PoolEndpoint],
        prefix: &Prefix,
    ) -> Result<(Vec<usize>, Vec<Scored>), String> {
        let scored: Vec<Scored> = candidates.iter().map(|c| prefix.of_endpoint(c)).collect();
        let list: Vec<Candidate> = candidates
            .iter()
            .zip(&scored)
            .map(|(c, &(score, rank, _))| Candidate {
                pod: c.address.clone(),
                rank,
                prefix_score: score,
                metrics: self.scraper.metrics_of(&c.address),
            })
            .collect();
        let n = self.picks.fetch_add(1, Ordering::Relaxed);
        let mut rng = SplitMix64::new(mix64(self.seed ^ n));
        // A sample is stale past the configured age, or past what a stretched interval allows.
        let settings = PickSettings {
            max_metrics_age: self.scraper.stale_after(),
            ..self.settings
        };
        let pick = kv_core::pick(&list, &settings, &mut rng).map_err(|e| e.to_string())?;
        self.metrics
            .picker
            .metrics_unusable(pick.stale, pick.missing);
        Ok((pick.order.iter().map(|r| r.candidate).collect(), scored))
    }

    /// The decode pick among the candidates that decode (all of them in a pool without P/D
    /// roles), then the prefill pod when the prefill is split off; the picks recorded.
    fn decide(&self, model: &str, candidates: &[PoolEndpoint], prefix: Prefix) -> Outcome {
        let decoders: Cow<[PoolEndpoint]> = match candidates.iter().all(|c| c.role == Role::Decode)
        {
            true => Cow::Borrowed(candidates),
            false => Cow::Owned(
                candidates
                    .iter()
                    .filter(|c| c.role.decodes())
                    .cloned()
                    .collect(),
            ),
        };
        if decoders.is_empty() {
            return Outcome::NoCandidates(
                "no candidate decodes (each one's llm-d.ai/role is prefill, encode, encode-prefill \
                 or unknown)"
                    .into(),
            );
        }
        let (order, scored) = match self.rank(&decoders, &prefix) {
            Ok(r) => r,
            Err(e) => return Outcome::NoCandidates(e),
        };
        let chosen: Vec<usize> = order.into_iter().take(1 + self.fallbacks).collect();
        let predicted_tokens: Vec<u32> = match prefix.scored {
            true => chosen
                .iter()
                .map(|&i| scored[i].2.saturating_mul(prefix.block_size))
                .collect(),
            false => Vec::new(),
        };
        let rank = chosen.first().and_then(|&i| scored[i].1);
        let prefill = chosen.first().and_then(|&i| {
            self.split(
                candidates,
                &prefix,
                &decoders[i],
                predicted_tokens.first().copied(),
            )
        });
        let record = (!prefix.prompt_key.is_empty()).then(|| (model.to_owned(), prefix.prompt_key));
        if let (Some((model, key)), Some(&first)) = (&record, chosen.first()) {
            self.record(model, &decoders[first].pod, rank, key);
            if let Some(p) = &prefill {
                self.record(model, &p.endpoint.pod, p.rank, key);
            }
        }
        Outcome::Picked(Decision {
            endpoints: chosen
                .iter()
                .map(|&i| decoders[i].address.clone())
                .collect(),
            targets: chosen
                .iter()
                .map(|&i| (decoders[i].pod.clone(), scored[i].1))
                .collect(),
            rank,
            with_prefix: prefix.scored,
            record,
            predicted_tokens,
            prefiller: prefill.map(|p| p.header),
        })
    }

    /// Records that `pod` got the prompt `key` names (a speculative entry until its events
    /// confirm it).
    pub fn record(&self, model: &str, pod: &str, rank: Option<u32>, key: &[u8]) {
        let result = self.scoring.record(RoutingRecord {
            model: model.to_owned(),
            pod: pod.to_owned(),
            prompt_key: key.to_vec(),
            rank,
            ..Default::default()
        });
        if let Err(e) = result {
            let kind = match e {
                ScoringError::Invalid(_) => "invalid",
                ScoringError::NotFound(_) => "not_found",
                _ => "other",
            };
            self.metrics.picker.not_recorded(kind);
            tracing::debug!(%pod, error = %e, "pick not recorded");
        }
    }
}

#[cfg(test)]
mod tests {
    use super::ip_of;

    #[test]
    fn spellings_of_one_address_compare_equal() {
        let long = ip_of("[0:0:0:0:0:0:0:1]:8000");
        assert!(long.is_some());
        assert_eq!(ip_of("[::1]:9000"), long, "the port aside");
        assert_eq!(ip_of("::1"), long, "a bare IP");
        assert_eq!(ip_of("[::ffff:10.0.0.7]:8000"), ip_of("10.0.0.7:8000"));
        assert_ne!(ip_of("10.0.0.7:8000"), ip_of("10.0.0.70:8000"));
        assert_eq!(ip_of("vllm-0.vllm:8000"), None, "a name is not an address");
    }
}
