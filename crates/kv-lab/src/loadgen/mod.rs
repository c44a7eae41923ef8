//! `kv-indexer loadgen`: drives a running daemon the way a busy fleet would and reports what it
//! sustained.
//!
//! Before the clock starts it prepares `documents` prompts of `prompt_blocks` blocks, hashes
//! them with the daemon's settings (so the daemon's hash checks pass) and encodes vLLM-shaped
//! payloads (map form, as vLLM >= 0.24 sends): `BlockStored` runs of 32 blocks with their token
//! ids, and `BlockRemoved` events of one hash each, as vLLM evicts. Then, for `duration`:
//! - one task publishes over ZMQ at full speed: round `r`, pod `p` stores document
//!   `(p + r) % documents` and evicts the one it stored two rounds before, so the index stays
//!   bounded while every pod keeps churning;
//! - `score_concurrency` tasks call ScorePods with a document's tokens and every pod as a
//!   candidate, or, with `--ext-proc`, ask the daemon's endpoint picker as Envoy would.
//!
//! With `--chat-tokenizer`, the prompts are chats sharing a few long system prompts, rendered
//! and tokenized with the daemon's own code, and the picker is asked with chat bodies.
//!
//! It reports messages and blocks sent, blocks and events the daemon applied (from its
//! `/metrics`, before and after), sequence gaps, and ScorePods latency under load beside the
//! same call measured on an idle daemon first (the baseline, same run). With
//! `--replica-metrics`, it also waits for the other replicas of a replicated deployment to
//! apply the same blocks through the shared log, and reports their end-to-end rate.

use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

use bytes::Bytes;
use clap::Args;

mod agree;
mod callers;
mod chat;
mod churn;
mod error;
mod http;
mod picks;
mod report;

pub use agree::AgreementReport;
use callers::score_phase;
pub use error::LoadgenError;
use report::metric_sum;
pub use report::{ChurnReport, LoadgenReport, ReplicaReport, ScorePhase, SoakReport, SoakSample};
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use zeromq::{PubSocket, Socket, SocketSend, ZmqMessage};

use kv_core::EngineHash;
use kv_core::{encode_batch, BlockRemoved, BlockStored, EventBatch, KvEvent, Medium};
use kv_core::{RequestExtras, TokenProcessor, TokenProcessorConfig};

/// Flags of `kv-indexer loadgen` (its settings).
#[derive(Debug, Clone, Args)]
pub struct LoadgenArgs {
    /// The daemon's ZMQ bind endpoint (the load generator's PUB connects to it).
    #[arg(long, default_value = "tcp://127.0.0.1:5557")]
    pub zmq_endpoint: String,
    /// The daemon's gRPC address.
    #[arg(long, default_value = "http://127.0.0.1:50051")]
    pub grpc: String,
    /// The daemon's metrics address (host:port).
    #[arg(long, default_value = "127.0.0.1:9090")]
    pub metrics: String,
    /// Model name in topics and requests.
    #[arg(long, default_value = "loadgen/model")]
    pub model: String,
    /// Simulated pods.
    #[arg(long, default_value_t = 64)]
    pub pods: u32,
    /// Distinct prompts.
    #[arg(long, default_value_t = 64)]
    pub documents: usize,
    /// Blocks per prompt (ScorePods depth).
    #[arg(long, default_value_t = 500)]
    pub prompt_blocks: usize,
    /// Must equal the daemon's blockSize.
    #[arg(long, default_value_t = 16)]
    pub block_size: usize,
    /// Must equal the daemon's hashSeed (default: unset, vLLM's "vllm-none-hash").
    #[arg(long)]
    pub seed: Option<String>,
    /// Seconds of load.
    #[arg(long, default_value_t = 10)]
    pub duration: u64,
    /// Concurrent ScorePods callers.
    #[arg(long, default_value_t = 4)]
    pub score_concurrency: usize,
    /// Target event rate, blocks per second (stores and removals together). The PUB drops what
    /// the daemon cannot take (as vLLM's would past its high-water mark), so the sustained rate
    /// is the highest one without sequence gaps.
    #[arg(long, default_value_t = 1_200_000)]
    pub rate: u64,
    /// Send the prompt's token ids packed (`token_ids_le`, little-endian u32 bytes) instead
    /// of the varint list (`tokens`): the form a gateway should send (docs/benchmarks.md).
    #[arg(long)]
    pub packed_tokens: bool,
    /// Seconds of idle ScorePods calls first (the latency baseline).
    #[arg(long, default_value_t = 2)]
    pub baseline: u64,
    /// Ask the daemon's endpoint picker (Envoy ext_proc, e.g. `http://127.0.0.1:9002`) instead of
    /// calling ScorePods: each call is one request's ext_proc stream (FULL_DUPLEX_STREAMED, the
    /// prompt's token ids as a completions body, or a chat with `--chat-tokenizer`), timed to
    /// the pick.
    #[arg(long)]
    pub ext_proc: Option<String>,
    /// With `--ext-proc`: chat prompts instead of token ids. DIR is a HuggingFace tokenizer
    /// folder (`tokenizer.json`, `tokenizer_config.json` with the chat template), the one the
    /// daemon has for `--model`. Each prompt is a `/v1/chat/completions` body: one of 4 long
    /// system prompts (a quarter of the prompt, shared by a quarter of the documents), then
    /// user and assistant turns up to about `--prompt-blocks` blocks once rendered. The pods
    /// publish the blocks of the chat as rendered and tokenized here, with the daemon's own
    /// code (so the picker finds them). The run fails if ScorePods, asked for the first chat
    /// before the load, does not match every block its pod stored, or if no pick found a
    /// prefix.
    #[arg(long, value_name = "DIR")]
    pub chat_tokenizer: Option<std::path::PathBuf>,
    /// Make every simulated pod a real HTTP endpoint on this port: pod `p` is named and served
    /// at `127.0.0.<10+p>:PORT` (at most 240 pods), with vLLM's `/metrics` page and a short
    /// completion for any POST (header `x-served-by`), so a gateway can route to it.
    #[arg(long, value_name = "PORT")]
    pub serve_pods: Option<u16>,
    /// Send the documents as OpenAI requests to URL (a gateway, e.g. `http://127.0.0.1:8081`,
    /// or a pod straight) instead of calling ScorePods, timed to the whole response.
    #[arg(long, value_name = "URL", conflicts_with = "ext_proc")]
    pub http: Option<String>,
    /// Write the OpenAI request body (JSON) for the prompt the first pod stored, for `curl -d`.
    #[arg(long, value_name = "FILE")]
    pub dump_body: Option<std::path::PathBuf>,
    /// Keep the pods serving (`--serve-pods`) this many seconds after the run.
    #[arg(long, default_value_t = 0)]
    pub linger: u64,
    /// Serve every simulated pod's vLLM metrics page at `http://ADDR/<pod>/metrics` (loopback),
    /// for the picker's scraper (`endpointPicker.metricsUrlTemplate:
    /// "http://ADDR/{pod}/metrics"`).
    #[arg(long)]
    pub pod_metrics: Option<String>,
    /// Print JSON instead of text.
    #[arg(long)]
    pub json: bool,
    /// Write a ScorePods request (grpcurl's JSON) for the prompt the first pod stored.
    #[arg(long)]
    pub dump_request: Option<std::path::PathBuf>,
    /// Soak mode: sample the daemon's memory every this many seconds during the load (0: off)
    /// and report whether anything grew after the first half (run with `--duration` of hours).
    #[arg(long, default_value_t = 0)]
    pub soak_sample: u64,
    /// Other replicas of a replicated deployment (their metrics address, host:port;
    /// repeatable): after the load, wait until each has applied what the daemon under load
    /// applied (through the shared log) and report the rate it got there at.
    #[arg(long = "replica-metrics")]
    pub replica_metrics: Vec<String>,
    /// Share of the pods (the first ones) whose engines hash differently from the daemon: they
    /// publish the same tokens under vLLM's `sha256_cbor` hashes with another seed (`--seed`
    /// followed by `-translated`), so the daemon translates them from their token ids. 0: every
    /// pod aligned.
    #[arg(long, default_value_t = 0.0)]
    pub translated_share: f64,
    /// Pods joining (each on a PUB socket of its own, storing one prompt) and leaving a second
    /// later, per second, beside the steady pods: a soak of a churning fleet (0: none).
    #[arg(long, default_value_t = 0)]
    pub churn: u32,
    /// Other replicas' gRPC addresses (repeatable): after the load, wait (up to 120 s) until
    /// each holds what the daemon under load holds, per (model, pod, rank), and report it.
    #[arg(long = "agree-with")]
    pub agree_with: Vec<String>,
}

/// A prepared prompt: tokens, block hashes, and its payloads.
struct Document {
    tokens: Vec<u32>,
    /// The chat the tokens were rendered from (with `--chat-tokenizer`).
    messages: Option<Vec<kv_tokenize::ChatMessage>>,
    store: Vec<Payload>,
    remove: Vec<Payload>,
    /// The same prompt from an engine that hashes differently (with `--translated-share`).
    translated: Option<Payloads>,
}

/// A message payload and the blocks it carries.
type Payload = (Bytes, u64);

/// Payloads of a prompt's stores, and of its removals.
type Payloads = (Vec<Payload>, Vec<Payload>);

impl Document {
    /// The stores and removals pod-kind `translated` publishes.
    fn payloads(&self, translated: bool) -> (&[Payload], &[Payload]) {
        match (&self.translated, translated) {
            (Some((store, remove)), true) => (store, remove),
            _ => (&self.store, &self.remove),
        }
    }
}

/// Encodes a prompt's runs (32 blocks, 4 per message) and its removals (leaf first).
fn encode_document(hashes: &[EngineHash], tokens: &[u32], block_size: usize) -> Payloads {
    let mut runs = Vec::new();
    for (r, chunk) in hashes.chunks(RUN_BLOCKS).enumerate() {
        let start = r * RUN_BLOCKS;
        let parent = start.checked_sub(1).map(|p| hashes[p]);
        let toks = &tokens[start * block_size..(start + chunk.len()) * block_size];
        runs.push((
            block_stored(chunk, parent, toks, block_size),
            chunk.len() as u64,
        ));
    }
    let store = runs
        .chunks(RUNS_PER_MESSAGE)
        .map(|group| {
            let events: Vec<KvEvent> = group.iter().map(|(e, _)| e.clone()).collect();
            let blocks = group.iter().map(|(_, n)| n).sum();
            (Bytes::from(batch(events)), blocks)
        })
        .collect();
    // vLLM evicts the leaf end first: remove in reverse.
    let removals: Vec<KvEvent> = hashes.iter().rev().map(|&h| block_removed(h)).collect();
    let remove = removals
        .chunks(RUN_BLOCKS * RUNS_PER_MESSAGE)
        .map(|group| (Bytes::from(batch(group.to_vec())), group.len() as u64))
        .collect();
    (store, remove)
}

/// `BlockStored` of a run, as vLLM 0.33 sends it for a plain full-attention request.
fn block_stored(
    hashes: &[EngineHash],
    parent: Option<EngineHash>,
    tokens: &[u32],
    block_size: usize,
) -> KvEvent {
    KvEvent::BlockStored(Box::new(BlockStored {
        block_hashes: hashes.to_vec(),
        parent_block_hash: parent,
        token_ids: tokens.to_vec(),
        block_size: block_size as u32,
        medium: Some(Medium::Gpu),
        extra_keys: Some(vec![None; hashes.len()]),
        group_idx: Some(0),
        kv_cache_spec_kind: Some("full_attention".into()),
        ..Default::default()
    }))
}

/// `BlockRemoved` of one hash (vLLM sends one event per evicted block).
fn block_removed(hash: EngineHash) -> KvEvent {
    KvEvent::BlockRemoved(BlockRemoved {
        block_hashes: vec![hash],
        medium: Some(Medium::Gpu),
        group_idx: Some(0),
        ..Default::default()
    })
}

/// `[ts, events, 0]`, map form.
fn batch(events: Vec<KvEvent>) -> Vec<u8> {
    encode_batch(&EventBatch {
        ts: 1.7e9,
        events,
        data_parallel_rank: Some(0),
    })
}

/// Runs per 32-block `BlockStored`, 4 runs per message; evictions 128 per message.
const RUN_BLOCKS: usize = 32;
const RUNS_PER_MESSAGE: usize = 4;

fn prepare(args: &LoadgenArgs) -> Result<Vec<Document>, LoadgenError> {
    let processor = TokenProcessor::new(&TokenProcessorConfig {
        hash_seed: args.seed.clone(),
        block_size: args.block_size,
        ..Default::default()
    })?;
    // Translated pods' engines: the same algorithm and block size, another seed.
    let other_seed = (args.translated_share > 0.0)
        .then(|| {
            TokenProcessor::new(&TokenProcessorConfig {
                hash_seed: Some(format!(
                    "{}-translated",
                    args.seed.as_deref().unwrap_or_default()
                )),
                block_size: args.block_size,
                ..Default::default()
            })
        })
        .transpose()?;
    let mut x = 0x2545_F491_4F6C_DD1Du64;
    let mut docs = Vec::with_capacity(args.documents);
    let target_tokens = args.prompt_blocks * args.block_size;
    let mut chats = match &args.chat_tokenizer {
        Some(dir) => Some(chat::ChatMaker::new(dir, &args.model, target_tokens)?),
        None => None,
    };
    for d in 0..args.documents {
        let (tokens, messages) = match chats.as_mut() {
            Some(chats) => {
                let chat = chats.document(d)?;
                (chat.tokens, Some(chat.messages))
            }
            None => {
                let tokens = (0..target_tokens)
                    .map(|_| {
                        x ^= x << 13;
                        x ^= x >> 7;
                        x ^= x << 17;
                        (x % 150_000) as u32
                    })
                    .collect();
                (tokens, None)
            }
        };
        // Aligned pods' engines publish the index's keys as their hashes.
        let keys = processor.block_hashes(&tokens, &RequestExtras::default());
        let hashes: Vec<EngineHash> = keys.iter().map(|&k| EngineHash::aligned(k)).collect();
        let (store, remove) = encode_document(&hashes, &tokens, args.block_size);
        let translated = other_seed.as_ref().map(|other| {
            // Another seed's hashes: what that engine publishes, not the index's keys.
            let theirs: Vec<EngineHash> = other
                .block_hashes(&tokens, &RequestExtras::default())
                .iter()
                .map(|h| EngineHash::new(h.get()))
                .collect();
            encode_document(&theirs, &tokens, args.block_size)
        });
        docs.push(Document {
            tokens,
            messages,
            store,
            remove,
            translated,
        });
    }
    Ok(docs)
}

async fn http_get(addr: &str, path: &str) -> Result<String, LoadgenError> {
    let failed = |source| LoadgenError::Metrics {
        addr: addr.to_owned(),
        source,
    };
    let mut s = tokio::net::TcpStream::connect(addr).await.map_err(failed)?;
    s.write_all(
        format!("GET {path} HTTP/1.1\r\nHost: {addr}\r\nConnection: close\r\n\r\n").as_bytes(),
    )
    .await
    .map_err(failed)?;
    let mut body = String::new();
    s.read_to_string(&mut body).await.map_err(failed)?;
    Ok(body)
}

#[derive(Default)]
struct Counters {
    messages: AtomicU64,
    blocks: AtomicU64,
}

/// Runs the load on its own runtime and returns what it measured (progress goes to stderr).
pub fn run(args: LoadgenArgs) -> Result<LoadgenReport, LoadgenError> {
    if args.pods == 0 || args.documents < 3 || args.prompt_blocks == 0 {
        return Err(LoadgenError::InvalidArgs(
            "--pods must be >= 1, --documents >= 3, --prompt-blocks >= 1",
        ));
    }
    if args.chat_tokenizer.is_some() && args.ext_proc.is_none() && args.http.is_none() {
        return Err(LoadgenError::InvalidArgs(
            "--chat-tokenizer needs --ext-proc or --http",
        ));
    }
    if args.serve_pods.is_some() && args.pods > http::MAX_SERVED_PODS {
        return Err(LoadgenError::InvalidArgs(
            "--serve-pods serves at most 240 pods",
        ));
    }
    if !(0.0..=1.0).contains(&args.translated_share) {
        return Err(LoadgenError::InvalidArgs(
            "--translated-share must be between 0 and 1",
        ));
    }
    let runtime = tokio::runtime::Builder::new_multi_thread()
        .enable_all()
        .build()
        .map_err(LoadgenError::Runtime)?;
    let linger = (args.serve_pods.is_some() && args.linger > 0).then_some(args.linger);
    runtime.block_on(async move {
        let report = run_async(args).await;
        if let Some(seconds) = linger {
            eprintln!("the pods keep serving for {seconds}s (--linger)");
            tokio::time::sleep(Duration::from_secs(seconds)).await;
        }
        report
    })
}

async fn run_async(args: LoadgenArgs) -> Result<LoadgenReport, LoadgenError> {
    let t = Instant::now();
    let docs = Arc::new(prepare(&args)?);
    let tokens = |f: fn(usize, usize) -> usize| docs.iter().map(|d| d.tokens.len()).reduce(f);
    eprintln!(
        "prepared {} {} of {}-{} tokens in {:.1}s",
        docs.len(),
        if args.chat_tokenizer.is_some() {
            "chats"
        } else {
            "prompts"
        },
        tokens(usize::min).unwrap_or(0),
        tokens(usize::max).unwrap_or(0),
        t.elapsed().as_secs_f64()
    );
    let pods = http::pod_names(args.pods, args.serve_pods);
    let topics: Vec<Bytes> = pods
        .iter()
        .map(|p| Bytes::from(format!("kv@{p}@{}", args.model)))
        .collect();
    let mut publisher = Publisher {
        socket: PubSocket::new(),
        endpoint: args.zmq_endpoint.clone(),
    };
    publisher
        .socket
        .connect(&args.zmq_endpoint)
        .await
        .map_err(|source| publisher.error(source))?;
    if let Some(addr) = &args.pod_metrics {
        picks::serve_pod_metrics(addr).await?;
    }
    if args.serve_pods.is_some() {
        http::serve_pods(&pods, &args.model).await?;
    }
    // Let the subscription reach the PUB (ZeroMQ's slow joiner).
    tokio::time::sleep(Duration::from_millis(500)).await;

    // Warm-up: every pod stores its first document; then the idle baseline.
    let mut seqs = vec![0u64; pods.len()];
    let translated_pods = (args.translated_share * pods.len() as f64) as usize;
    for (p, topic) in topics.iter().enumerate() {
        for (payload, _) in docs[p % docs.len()].payloads(p < translated_pods).0 {
            publisher.send(topic, &mut seqs[p], payload).await?;
        }
    }
    tokio::time::sleep(Duration::from_millis(500)).await;
    if args.chat_tokenizer.is_some() {
        let matched = chat::check_daemon_tokens(&args, &docs[0], &pods[0]).await?;
        eprintln!(
            "the daemon's tokens agree: {} matched {matched} blocks of document 0 as a chat",
            pods[0]
        );
    }
    if let Some(path) = &args.dump_request {
        let request = serde_json::json!({
            "model": args.model,
            "tokens": {"ids": docs[0].tokens},
            "pods": pods,
        });
        std::fs::write(path, request.to_string()).map_err(|source| LoadgenError::Dump {
            path: path.display().to_string(),
            source,
        })?;
        eprintln!(
            "wrote a ScorePods request for the prompt {} stored to {}",
            pods[0],
            path.display()
        );
    }
    if let Some(path) = &args.dump_body {
        let body = http::request_body(&args.model, &docs[0]).1;
        std::fs::write(path, body).map_err(|source| LoadgenError::Dump {
            path: path.display().to_string(),
            source,
        })?;
        eprintln!(
            "wrote an OpenAI request body for the prompt {} stored to {}",
            pods[0],
            path.display()
        );
    }
    let baseline_started = Instant::now();
    let (idle, idle_matched) = score_phase(&args, &docs, &pods, args.baseline).await?;
    let score_idle = ScorePhase::of(
        &idle,
        idle_matched,
        baseline_started.elapsed().as_secs_f64(),
    );
    let mut report = LoadgenReport {
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
    };
    if args.duration == 0 {
        // Warm-up only: every pod holds its first prompt (what --dump-request describes).
        return Ok(report);
    }
    let before = http_get(&args.metrics, "/metrics").await?;
    let mut replicas_before = Vec::new();
    for addr in &args.replica_metrics {
        replicas_before.push(http_get(addr, "/metrics").await?);
    }
    let counters = Arc::new(Counters::default());
    let stop = Arc::new(AtomicBool::new(false));
    let publish = {
        let docs = docs.clone();
        let counters = counters.clone();
        let stop = stop.clone();
        let topics = topics.clone();
        let rate = args.rate.max(1) as f64;
        tokio::spawn(async move {
            let n = docs.len();
            let mut round = 1usize;
            let start = Instant::now();
            let mut sent = 0u64;
            'rounds: while !stop.load(Ordering::Relaxed) {
                for (p, topic) in topics.iter().enumerate() {
                    let translated = p < translated_pods;
                    let doc = docs[(p + round) % n].payloads(translated).0;
                    let old = docs[(p + round + n - 2) % n].payloads(translated).1;
                    for (payload, blocks) in doc.iter().chain(old) {
                        // Pace to the target rate; yield so the PUB's writer task runs.
                        let due = Duration::from_secs_f64(sent as f64 / rate);
                        if let Some(wait) = due.checked_sub(start.elapsed()) {
                            tokio::time::sleep(wait).await;
                        } else {
                            tokio::task::yield_now().await;
                        }
                        if stop.load(Ordering::Relaxed) {
                            break 'rounds;
                        }
                        publisher.send(topic, &mut seqs[p], payload).await?;
                        sent += blocks;
                        counters.messages.fetch_add(1, Ordering::Relaxed);
                        counters.blocks.fetch_add(*blocks, Ordering::Relaxed);
                    }
                }
                round += 1;
            }
            Ok::<_, LoadgenError>(())
        })
    };
    let churn_counters = Arc::new(churn::ChurnCounters::default());
    let churning = (args.churn > 0).then(|| {
        let run = churn::run(
            args.zmq_endpoint.clone(),
            args.model.clone(),
            args.churn,
            docs.clone(),
            stop.clone(),
            churn_counters.clone(),
        );
        tokio::spawn(run)
    });
    let started = Instant::now();
    let (loaded, loaded_matched, samples) = if args.soak_sample > 0 {
        let scoring = {
            let (args, docs, pods) = (args.clone(), docs.clone(), pods.clone());
            tokio::spawn(async move { score_phase(&args, &docs, &pods, args.duration).await })
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
        let (loaded, matched) = scoring
            .await
            .map_err(|e| LoadgenError::Task(e.to_string()))??;
        (loaded, matched, samples)
    } else {
        let (loaded, matched) = score_phase(&args, &docs, &pods, args.duration).await?;
        (loaded, matched, Vec::new())
    };
    stop.store(true, Ordering::Relaxed);
    let elapsed = started.elapsed().as_secs_f64();
    let after = http_get(&args.metrics, "/metrics").await?;
    publish
        .await
        .map_err(|e| LoadgenError::Task(e.to_string()))??;
    if let Some(churning) = churning {
        churning
            .await
            .map_err(|e| LoadgenError::Task(e.to_string()))??;
        report.churn = Some(ChurnReport::of(&churn_counters, elapsed));
    }

    let delta = |name: &str| metric_sum(&after, name) - metric_sum(&before, name);
    report.duration_s = elapsed;
    report.sent_messages_per_s = counters.messages.load(Ordering::Relaxed) as f64 / elapsed;
    report.sent_blocks_per_s = counters.blocks.load(Ordering::Relaxed) as f64 / elapsed;
    report.applied_blocks_per_s = delta("kvindexer_blocks_applied_total") / elapsed;
    report.applied_events_per_s = delta("kvindexer_events_received_total") / elapsed;
    report.sequence_gaps = delta("kvindexer_sequence_gaps_total");
    report.messages_lost = delta("kvindexer_messages_lost_total");
    report.score_under_load = Some(ScorePhase::of(&loaded, loaded_matched, elapsed));
    report.lookups = delta("kvcache_index_lookup_requests_total");
    report.lookup_hit_share = delta("kvcache_index_lookup_hits_total") / report.lookups.max(1.0);
    // Through a gateway without a picker (--http to a pod, or to Envoy alone) nothing looks
    // the index up; whatever asked it must have found prefixes.
    let asked = args.ext_proc.is_some() || report.lookups > 0.0;
    if args.chat_tokenizer.is_some() && asked && report.lookup_hit_share <= 0.0 {
        return Err(LoadgenError::NoPrefixMatches(format!(
            "the daemon made {} index lookups for {} picks and none found a prefix (does it \
             have the tokenizer of {:?}, and the same blockSize and hashSeed?)",
            report.lookups,
            loaded.len(),
            args.model
        )));
    }
    if !samples.is_empty() {
        report.soak = Some(SoakReport::of(samples));
    }
    let applied = delta("kvindexer_blocks_applied_total");
    for (addr, before) in args.replica_metrics.iter().zip(&replicas_before) {
        report
            .replicas
            .push(agree::follow_replica(addr, before, applied, started).await?);
    }
    for there in &args.agree_with {
        let within = Duration::from_secs(120);
        let compared = agree::compare(&args.grpc, there, within).await?;
        report.agreement.push(compared);
    }
    Ok(report)
}

/// The PUB socket the simulated pods publish through.
struct Publisher {
    socket: PubSocket,
    endpoint: String,
}

impl Publisher {
    fn error(&self, source: zeromq::ZmqError) -> LoadgenError {
        LoadgenError::Zmq {
            endpoint: self.endpoint.clone(),
            source,
        }
    }

    /// Sends `[topic, seq, payload]` and advances the publisher's sequence.
    async fn send(
        &mut self,
        topic: &Bytes,
        seq: &mut u64,
        payload: &Bytes,
    ) -> Result<(), LoadgenError> {
        let frames = vec![
            topic.clone(),
            Bytes::copy_from_slice(&seq.to_be_bytes()),
            payload.clone(),
        ];
        // Three frames are never empty, the only case `try_from` refuses.
        let Ok(msg) = ZmqMessage::try_from(frames) else {
            return Err(LoadgenError::Task("empty ZMQ message".into()));
        };
        *seq += 1;
        self.socket
            .send(msg)
            .await
            .map_err(|source| self.error(source))
    }
}
