//! A load run's stages, in order: the documents prepared; the publisher connected and the pods
//! served; the warm-up (every pod stores its first document); the checks and dumps of the
//! first document; the idle baseline; the load (publishing, churn, callers and, in soak mode,
//! the memory samples); what the daemon's counters say of it; the other replicas followed.

use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

use super::agree;
use super::args::LoadgenArgs;
use super::callers::score_calls;
use super::chat::check_daemon_tokens;
use super::churn::{self, ChurnCounters};
use super::documents::{prepare, request_body, Document};
use super::error::LoadgenError;
use super::http::{http_phase, pod_names, serve_pods};
use super::picks::{pick_phase, serve_pod_metrics};
use super::publisher::{publish_rounds, warm_up, Counters, Pods, Publisher};
use super::report::{ChurnReport, LoadgenReport, ScorePhase, SoakReport, SoakSample};
use super::scrape::{http_get, metric_sum};

/// Every call's latency (ns, sorted) and what the calls counted (matched blocks, picks, 2xx).
type Timed = (Vec<u64>, u64);

/// Runs the load against the daemon and returns what it measured (progress goes to stderr).
pub(super) async fn run(args: LoadgenArgs) -> Result<LoadgenReport, LoadgenError> {
    let docs = Arc::new(prepare_documents(&args)?);
    let names = pod_names(args.pods, args.serve_pods);
    let mut publisher = Publisher::connect(&args.zmq_endpoint).await?;
    if let Some(addr) = &args.pod_metrics {
        serve_pod_metrics(addr).await?;
    }
    if args.serve_pods.is_some() {
        serve_pods(&names, &args.model).await?;
    }
    // Let the subscription reach the PUB (ZeroMQ's slow joiner).
    tokio::time::sleep(Duration::from_millis(500)).await;
    let mut pods = Pods::new(&names, &args.model, args.translated_pods());
    warm_up(&mut publisher, &mut pods, &docs).await?;
    tokio::time::sleep(Duration::from_millis(500)).await;
    check_and_dump(&args, &docs[0], &names).await?;
    let baseline_started = Instant::now();
    let (idle, idle_matched) = score_phase(&args, &docs, &names, args.baseline).await?;
    let idle = ScorePhase::of(
        &idle,
        idle_matched,
        baseline_started.elapsed().as_secs_f64(),
    );
    let mut report = LoadgenReport::idle(&args, idle);
    if args.duration == 0 {
        // Warm-up only: every pod holds its first prompt (what --dump-request describes).
        return Ok(report);
    }
    let before = http_get(&args.metrics, "/metrics").await?;
    let mut replicas_before = Vec::new();
    for addr in &args.replica_metrics {
        replicas_before.push(http_get(addr, "/metrics").await?);
    }
    let loaded = under_load(&args, &docs, &names, publisher, pods).await?;
    report.fill(&args, &loaded, &before)?;
    let applied = metric_sum(&loaded.after, "kvindexer_blocks_applied_total")
        - metric_sum(&before, "kvindexer_blocks_applied_total");
    for (addr, before) in args.replica_metrics.iter().zip(&replicas_before) {
        let followed = agree::follow_replica(addr, before, applied, loaded.started).await?;
        report.replicas.push(followed);
    }
    for there in &args.agree_with {
        let within = Duration::from_secs(120);
        let compared = agree::compare(&args.grpc, there, within).await?;
        report.agreement.push(compared);
    }
    Ok(report)
}

/// Prepares the documents and says what they are.
fn prepare_documents(args: &LoadgenArgs) -> Result<Vec<Document>, LoadgenError> {
    let t = Instant::now();
    let docs = prepare(args)?;
    let tokens = |f: fn(usize, usize) -> usize| docs.iter().map(|d| d.tokens.len()).reduce(f);
    let kind = match args.chat_tokenizer {
        Some(_) => "chats",
        None => "prompts",
    };
    eprintln!(
        "prepared {} {kind} of {}-{} tokens in {:.1}s",
        docs.len(),
        tokens(usize::min).unwrap_or(0),
        tokens(usize::max).unwrap_or(0),
        t.elapsed().as_secs_f64()
    );
    Ok(docs)
}

/// With `--chat-tokenizer`, checks that the daemon tokenizes the first chat as this run did;
/// writes `--dump-request` and `--dump-body` for the prompt the first pod stored.
async fn check_and_dump(
    args: &LoadgenArgs,
    doc: &Document,
    pods: &[String],
) -> Result<(), LoadgenError> {
    let pod = &pods[0];
    if let Some(messages) = &doc.messages {
        let matched = check_daemon_tokens(args, (&doc.tokens, messages), pod).await?;
        eprintln!(
            "the daemon's tokens agree: {pod} matched {matched} blocks of document 0 as a chat"
        );
    }
    let write = |path: &std::path::Path, what: &str, text: Vec<u8>| {
        std::fs::write(path, text).map_err(|source| LoadgenError::Dump {
            path: path.display().to_string(),
            source,
        })?;
        eprintln!(
            "wrote {what} for the prompt {pod} stored to {}",
            path.display()
        );
        Ok::<_, LoadgenError>(())
    };
    if let Some(path) = &args.dump_request {
        let request = serde_json::json!({
            "model": args.model,
            "tokens": {"ids": doc.tokens},
            "pods": pods,
        });
        write(
            path,
            "a ScorePods request",
            request.to_string().into_bytes(),
        )?;
    }
    if let Some(path) = &args.dump_body {
        write(
            path,
            "an OpenAI request body",
            request_body(&args.model, doc).1,
        )?;
    }
    Ok(())
}

/// Calls for `seconds` as the flags say: the endpoint picker (`--ext-proc`), a gateway
/// (`--http`), or ScorePods.
async fn score_phase(
    args: &LoadgenArgs,
    docs: &Arc<Vec<Document>>,
    pods: &[String],
    seconds: u64,
) -> Result<Timed, LoadgenError> {
    if let Some(addr) = &args.ext_proc {
        return pick_phase(args, addr, docs, seconds).await;
    }
    if let Some(url) = &args.http {
        return http_phase(args, url, docs, seconds).await;
    }
    score_calls(args, docs, pods, seconds).await
}

/// What the load measured on this side.
struct Loaded {
    /// When the callers started.
    started: Instant,
    /// Seconds of load.
    elapsed: f64,
    /// The callers' timings.
    calls: Timed,
    /// Soak mode's samples of the daemon's gauges.
    samples: Vec<SoakSample>,
    /// What the steady pods sent.
    sent: Arc<Counters>,
    /// What the churning pods did (`--churn`).
    churn: Option<ChurnReport>,
    /// The daemon's `/metrics` page as the load stopped.
    after: String,
}

/// The load: the pods publish (and churn) while the callers call for `--duration`.
async fn under_load(
    args: &LoadgenArgs,
    docs: &Arc<Vec<Document>>,
    names: &[String],
    publisher: Publisher,
    pods: Pods,
) -> Result<Loaded, LoadgenError> {
    let sent = Arc::new(Counters::default());
    let stop = Arc::new(AtomicBool::new(false));
    let publish = tokio::spawn(publish_rounds(
        publisher,
        pods,
        docs.clone(),
        args.rate,
        stop.clone(),
        sent.clone(),
    ));
    let churn_counters = Arc::new(ChurnCounters::default());
    let churning = (args.churn > 0).then(|| {
        tokio::spawn(churn::run(
            args.zmq_endpoint.clone(),
            args.model.clone(),
            args.churn,
            docs.clone(),
            stop.clone(),
            churn_counters.clone(),
        ))
    });
    let started = Instant::now();
    let (calls, samples) = match args.soak_sample {
        0 => (
            score_phase(args, docs, names, args.duration).await?,
            Vec::new(),
        ),
        _ => calls_and_samples(args, docs, names, started).await?,
    };
    stop.store(true, Ordering::Relaxed);
    let elapsed = started.elapsed().as_secs_f64();
    let after = http_get(&args.metrics, "/metrics").await?;
    let joined = |e: tokio::task::JoinError| LoadgenError::Task(e.to_string());
    publish.await.map_err(joined)??;
    let churn = match churning {
        Some(churning) => {
            churning.await.map_err(joined)??;
            Some(churn_counters.report(elapsed))
        }
        None => None,
    };
    Ok(Loaded {
        started,
        elapsed,
        calls,
        samples,
        sent,
        churn,
        after,
    })
}

/// Soak mode: the callers call while the daemon's gauges are sampled every `--soak-sample`
/// seconds.
async fn calls_and_samples(
    args: &LoadgenArgs,
    docs: &Arc<Vec<Document>>,
    names: &[String],
    started: Instant,
) -> Result<(Timed, Vec<SoakSample>), LoadgenError> {
    let scoring = {
        let (args, docs, names) = (args.clone(), docs.clone(), names.to_vec());
        tokio::spawn(async move { score_phase(&args, &docs, &names, args.duration).await })
    };
    let mut samples = Vec::new();
    while started.elapsed() < Duration::from_secs(args.duration) {
        let page = http_get(&args.metrics, "/metrics").await?;
        samples.push(SoakSample::read(started.elapsed().as_secs_f64(), &page));
        let next = Duration::from_secs(args.soak_sample * samples.len() as u64);
        if let Some(wait) = next.checked_sub(started.elapsed()) {
            tokio::time::sleep(wait).await;
        }
    }
    let calls = scoring
        .await
        .map_err(|e| LoadgenError::Task(e.to_string()))??;
    Ok((calls, samples))
}

impl LoadgenReport {
    /// The report of a run so far: its settings and the idle baseline.
    fn idle(args: &LoadgenArgs, score_idle: ScorePhase) -> Self {
        Self {
            calls: match (&args.ext_proc, &args.http) {
                (Some(_), _) => "picks",
                (None, Some(_)) => "http",
                (None, None) => "ScorePods",
            },
            duration_s: 0.0,
            pods: args.pods,
            prompt_blocks: args.prompt_blocks,
            sent_messages_per_s: 0.0,
            sent_blocks_per_s: 0.0,
            applied_blocks_per_s: 0.0,
            applied_events_per_s: 0.0,
            sequence_gaps: 0.0,
            messages_lost: 0.0,
            score_idle,
            score_under_load: None,
            lookups: 0.0,
            lookup_hit_share: 0.0,
            soak: None,
            replicas: Vec::new(),
            churn: None,
            agreement: Vec::new(),
        }
    }

    /// Fills in what the load measured and what the daemon's counters say of it (its
    /// `/metrics` page `before` the load and after); fails when chats were asked and no
    /// lookup found a prefix (the run would measure nothing).
    fn fill(
        &mut self,
        args: &LoadgenArgs,
        loaded: &Loaded,
        before: &str,
    ) -> Result<(), LoadgenError> {
        let delta = |name: &str| metric_sum(&loaded.after, name) - metric_sum(before, name);
        let elapsed = loaded.elapsed;
        self.duration_s = elapsed;
        self.sent_messages_per_s = loaded.sent.messages.load(Ordering::Relaxed) as f64 / elapsed;
        self.sent_blocks_per_s = loaded.sent.blocks.load(Ordering::Relaxed) as f64 / elapsed;
        self.applied_blocks_per_s = delta("kvindexer_blocks_applied_total") / elapsed;
        self.applied_events_per_s = delta("kvindexer_events_received_total") / elapsed;
        self.sequence_gaps = delta("kvindexer_sequence_gaps_total");
        self.messages_lost = delta("kvindexer_messages_lost_total");
        let (latencies, matched) = &loaded.calls;
        self.score_under_load = Some(ScorePhase::of(latencies, *matched, elapsed));
        self.lookups = delta("kvcache_index_lookup_requests_total");
        self.lookup_hit_share = delta("kvcache_index_lookup_hits_total") / self.lookups.max(1.0);
        self.churn = loaded.churn.clone();
        if !loaded.samples.is_empty() {
            self.soak = Some(SoakReport::of(loaded.samples.clone()));
        }
        // Through a gateway without a picker (--http to a pod, or to Envoy alone) nothing looks
        // the index up; whatever asked it must have found prefixes.
        let asked = args.ext_proc.is_some() || self.lookups > 0.0;
        if args.chat_tokenizer.is_some() && asked && self.lookup_hit_share <= 0.0 {
            return Err(LoadgenError::NoPrefixMatches(format!(
                "the daemon made {} index lookups for {} picks and none found a prefix (does it \
                 have the tokenizer of {:?}, and the same blockSize and hashSeed?)",
                self.lookups,
                latencies.len(),
                args.model
            )));
        }
        Ok(())
    }
}
