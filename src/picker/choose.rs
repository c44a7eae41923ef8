//! One request's pick: its candidates (the subset hint, else the model's live pods), their
//! prefix scores through `ScorePods`' own path (tokenizer, chat template, LoRA and salt), their
//! load from the scraper, kv-core's [`pick`](kv_core::pick()), and the pick recorded as a
//! speculative entry through `RecordRouting`'s path.
//!
//! Invariants: an outcome is exactly one of [`Outcome`]'s kinds, each counted by the caller;
//! a request the score path finds malformed is the client's error (400), an overloaded
//! tokenizer or a full picker sheds (429), and any other scoring failure (a tokenizer that
//! cannot load, a deadline) still picks, on load alone, counted as `picked_without_prefix`.

use std::collections::{BTreeMap, HashMap};
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

use tonic::Code;

use super::body::OpenAiRequest;
use super::scrape::Scraper;
use crate::ingest::lifecycle::Presence;
use crate::ingest::Pods;
use crate::metrics::Metrics;
use crate::server::grpc::ScoreService;
use kv_core::{mix64, Candidate, Indexer, PickSettings, SplitMix64};
use kv_proto::kvindexer_v1;

/// How long scoring one request may take (tokenizing an 8,000-token chat included).
const SCORE_DEADLINE: Duration = Duration::from_secs(5);

/// Endpoints listed in the answer at most: the pick and its ordered fallbacks.
pub const MAX_ENDPOINTS: usize = 4;

/// A pick, as the gateway is told it.
#[derive(Debug, Clone, PartialEq)]
pub struct Decision {
    /// The endpoints, best first (`ip:port`).
    pub endpoints: Vec<String>,
    /// The first endpoint's data-parallel rank, for a data-parallel pod.
    pub rank: Option<u32>,
    /// Whether the prefix score took part.
    pub with_prefix: bool,
    /// What the routing record needs should another endpoint serve (the prompt key).
    pub record: Option<(String, Vec<u8>)>,
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
    pub(super) svc: Arc<ScoreService>,
    pub(super) indexer: Arc<Indexer>,
    pub(super) pods: Pods,
    pub(super) scraper: Arc<Scraper>,
    pub(super) metrics: Arc<Metrics>,
    pub(super) settings: PickSettings,
    /// LoRA adapter name -> its base model (vLLM serves an adapter as a model).
    pub(super) adapters: BTreeMap<String, String>,
    /// Picks so far, mixed with the process's seed into each pick's own tie-break stream
    /// (no lock shared by concurrent picks).
    pub(super) picks: AtomicU64,
    pub(super) seed: u64,
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
        self.indexer
            .models()
            .iter()
            .flat_map(|m| self.live_pods(m.name()))
            .map(Arc::from)
            .collect()
    }

    /// Picks for `request` (`None`: a request without a body) among `subset` (the subset hint)
    /// or the model's live pods.
    pub async fn choose(
        &self,
        request: Option<OpenAiRequest>,
        subset: Option<Vec<String>>,
    ) -> Outcome {
        let (model, lora) = match &request {
            Some(r) => self.resolve(&r.model),
            None => (String::new(), String::new()),
        };
        let candidates = match subset {
            Some(hint) => {
                self.scraper.hint(&hint);
                hint
            }
            None if model.is_empty() => {
                self.all_live_pods().iter().map(|p| p.to_string()).collect()
            }
            None => self.live_pods(&model),
        };
        if candidates.is_empty() {
            return Outcome::NoCandidates(match &request {
                Some(r) => format!("no ready endpoint serves model {:?}", r.model),
                None => "no ready endpoint".into(),
            });
        }
        let _permit = match self.svc.admit() {
            Ok(p) => p,
            Err(s) => return Outcome::Shed(s.message().to_owned()),
        };
        let mut prefix: HashMap<String, (f64, Option<u32>)> = HashMap::new();
        let mut prompt_key = Vec::new();
        let mut with_prefix = false;
        if let Some(r) = request.filter(|_| self.indexer.model(&model).is_some()) {
            let scored = self
                .svc
                .score(
                    kvindexer_v1::ScorePodsRequest {
                        model: model.clone(),
                        input: Some(r.input),
                        pods: candidates.clone(),
                        lora_name: lora,
                        cache_salt: r.cache_salt,
                        every_rank: false,
                    },
                    Instant::now() + SCORE_DEADLINE,
                )
                .await;
            match scored {
                Ok(resp) => {
                    with_prefix = true;
                    prompt_key = resp.prompt_key;
                    for s in resp.scores {
                        prefix.insert(s.pod, (s.score, s.data_parallel_rank));
                    }
                }
                Err(s) if s.code() == Code::InvalidArgument => {
                    return Outcome::BadRequest("prompt", s.message().to_owned())
                }
                Err(s) if s.code() == Code::ResourceExhausted => {
                    return Outcome::Shed(s.message().to_owned())
                }
                Err(s) => {
                    tracing::warn!(model = %model, code = ?s.code(), error = %s.message(), "cannot score the prompt; picking on load alone");
                }
            }
        }
        let list: Vec<Candidate> = candidates
            .iter()
            .map(|pod| {
                let (score, rank) = prefix.get(pod).copied().unwrap_or((0.0, None));
                Candidate {
                    pod: pod.clone(),
                    rank,
                    prefix_score: score,
                    metrics: self.scraper.metrics_of(pod),
                }
            })
            .collect();
        let n = self.picks.fetch_add(1, Ordering::Relaxed);
        let mut rng = SplitMix64::new(mix64(self.seed ^ n));
        let pick = kv_core::pick(&list, &self.settings, &mut rng);
        let pick = match pick {
            Ok(p) => p,
            Err(e) => return Outcome::NoCandidates(e.to_string()),
        };
        self.metrics
            .picker
            .metrics_unusable(pick.stale, pick.missing);
        let endpoints: Vec<String> = pick
            .order
            .iter()
            .take(MAX_ENDPOINTS)
            .map(|r| list[r.candidate].pod.clone())
            .collect();
        let rank = pick.best().and_then(|i| list[i].rank);
        let record = (!prompt_key.is_empty()).then(|| (model.clone(), prompt_key));
        if let (Some((model, key)), Some(first)) = (&record, endpoints.first()) {
            self.record(model, first, rank, key);
        }
        Outcome::Picked(Decision {
            endpoints,
            rank,
            with_prefix,
            record,
        })
    }

    /// Records that `pod` got the prompt `key` names (a speculative entry until its events
    /// confirm it).
    pub fn record(&self, model: &str, pod: &str, rank: Option<u32>, key: &[u8]) {
        let result = self.svc.record(kvindexer_v1::RecordRoutingRequest {
            model: model.to_owned(),
            pod: pod.to_owned(),
            prompt_key: key.to_vec(),
            data_parallel_rank: rank,
            ..Default::default()
        });
        if let Err(s) = result {
            self.metrics.picker.not_recorded(&format!("{:?}", s.code()));
            tracing::debug!(%pod, code = ?s.code(), error = %s.message(), "pick not recorded");
        }
    }
}
