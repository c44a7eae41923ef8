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
//!   candidate.
//!
//! It reports messages and blocks sent, blocks and events the daemon applied (from its
//! `/metrics`, before and after), sequence gaps, and ScorePods latency under load beside the
//! same call measured on an idle daemon first (the baseline, same run).

use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

use anyhow::{bail, Context};
use bytes::Bytes;
use clap::Args;
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use zeromq::{PubSocket, Socket, SocketSend, ZmqMessage};

use kv_indexer::hashing::{RequestExtras, TokenProcessor, TokenProcessorConfig};
use kv_indexer::server::grpc::kvindexer_v1::{
    kv_indexer_client::KvIndexerClient, score_pods_request::Input, ScorePodsRequest, TokenIds,
};

/// Flags of `kv-indexer loadgen`.
#[derive(Debug, Args)]
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
    /// Seconds of idle ScorePods calls first (the latency baseline).
    #[arg(long, default_value_t = 2)]
    pub baseline: u64,
    /// Print JSON instead of text.
    #[arg(long)]
    pub json: bool,
    /// Write a ScorePods request (grpcurl's JSON) for the prompt the first pod stored.
    #[arg(long)]
    pub dump_request: Option<std::path::PathBuf>,
}

/// A prepared prompt: tokens, block hashes, and its payloads.
struct Document {
    tokens: Vec<u32>,
    store: Vec<(Bytes, u64)>,
    remove: Vec<(Bytes, u64)>,
}

fn write_str(out: &mut Vec<u8>, s: &str) {
    rmp::encode::write_str(out, s).ok();
}

/// `[ts, events, 0]` with `events` already encoded.
fn batch(events: &[Vec<u8>]) -> Vec<u8> {
    let mut out = Vec::new();
    rmp::encode::write_array_len(&mut out, 3).ok();
    rmp::encode::write_f64(&mut out, 1.7e9).ok();
    rmp::encode::write_array_len(&mut out, events.len() as u32).ok();
    for e in events {
        out.extend_from_slice(e);
    }
    rmp::encode::write_uint(&mut out, 0).ok();
    out
}

fn block_stored(hashes: &[u64], parent: Option<u64>, tokens: &[u32], block_size: usize) -> Vec<u8> {
    let mut m = Vec::new();
    rmp::encode::write_map_len(&mut m, 11).ok();
    write_str(&mut m, "type");
    write_str(&mut m, "BlockStored");
    write_str(&mut m, "block_hashes");
    rmp::encode::write_array_len(&mut m, hashes.len() as u32).ok();
    for &h in hashes {
        rmp::encode::write_uint(&mut m, h).ok();
    }
    write_str(&mut m, "parent_block_hash");
    match parent {
        Some(p) => rmp::encode::write_uint(&mut m, p).map(|_| ()).ok(),
        None => rmp::encode::write_nil(&mut m).ok(),
    };
    write_str(&mut m, "token_ids");
    rmp::encode::write_array_len(&mut m, tokens.len() as u32).ok();
    for &t in tokens {
        rmp::encode::write_uint(&mut m, t as u64).ok();
    }
    write_str(&mut m, "block_size");
    rmp::encode::write_uint(&mut m, block_size as u64).ok();
    write_str(&mut m, "lora_id");
    rmp::encode::write_nil(&mut m).ok();
    write_str(&mut m, "medium");
    write_str(&mut m, "GPU");
    write_str(&mut m, "lora_name");
    rmp::encode::write_nil(&mut m).ok();
    write_str(&mut m, "extra_keys");
    rmp::encode::write_array_len(&mut m, hashes.len() as u32).ok();
    for _ in hashes {
        rmp::encode::write_nil(&mut m).ok();
    }
    write_str(&mut m, "group_idx");
    rmp::encode::write_uint(&mut m, 0).ok();
    write_str(&mut m, "kv_cache_spec_kind");
    write_str(&mut m, "full_attention");
    m
}

fn block_removed(hash: u64) -> Vec<u8> {
    let mut m = Vec::new();
    rmp::encode::write_map_len(&mut m, 4).ok();
    write_str(&mut m, "type");
    write_str(&mut m, "BlockRemoved");
    write_str(&mut m, "block_hashes");
    rmp::encode::write_array_len(&mut m, 1).ok();
    rmp::encode::write_uint(&mut m, hash).ok();
    write_str(&mut m, "medium");
    write_str(&mut m, "GPU");
    write_str(&mut m, "group_idx");
    rmp::encode::write_uint(&mut m, 0).ok();
    m
}

/// Runs per 32-block `BlockStored`, 4 runs per message; evictions 128 per message.
const RUN_BLOCKS: usize = 32;
const RUNS_PER_MESSAGE: usize = 4;

fn prepare(args: &LoadgenArgs) -> anyhow::Result<Vec<Document>> {
    let processor = TokenProcessor::new(&TokenProcessorConfig {
        hash_seed: args.seed.clone(),
        block_size: args.block_size,
        ..Default::default()
    })?;
    let mut x = 0x2545_F491_4F6C_DD1Du64;
    let mut docs = Vec::with_capacity(args.documents);
    for _ in 0..args.documents {
        let tokens: Vec<u32> = (0..args.prompt_blocks * args.block_size)
            .map(|_| {
                x ^= x << 13;
                x ^= x >> 7;
                x ^= x << 17;
                (x % 150_000) as u32
            })
            .collect();
        let hashes = processor.block_hashes(&tokens, &RequestExtras::default());
        let mut runs = Vec::new();
        for (r, chunk) in hashes.chunks(RUN_BLOCKS).enumerate() {
            let start = r * RUN_BLOCKS;
            let parent = start.checked_sub(1).map(|p| hashes[p]);
            let toks = &tokens[start * args.block_size..(start + chunk.len()) * args.block_size];
            runs.push((
                block_stored(chunk, parent, toks, args.block_size),
                chunk.len() as u64,
            ));
        }
        let store = runs
            .chunks(RUNS_PER_MESSAGE)
            .map(|group| {
                let events: Vec<Vec<u8>> = group.iter().map(|(e, _)| e.clone()).collect();
                let blocks = group.iter().map(|(_, n)| n).sum();
                (Bytes::from(batch(&events)), blocks)
            })
            .collect();
        // vLLM evicts the leaf end first: remove in reverse.
        let removals: Vec<Vec<u8>> = hashes.iter().rev().map(|&h| block_removed(h)).collect();
        let remove = removals
            .chunks(RUN_BLOCKS * RUNS_PER_MESSAGE)
            .map(|group| (Bytes::from(batch(group)), group.len() as u64))
            .collect();
        docs.push(Document {
            tokens,
            store,
            remove,
        });
    }
    Ok(docs)
}

async fn http_get(addr: &str, path: &str) -> anyhow::Result<String> {
    let mut s = tokio::net::TcpStream::connect(addr)
        .await
        .with_context(|| format!("connecting to the metrics port {addr}"))?;
    s.write_all(
        format!("GET {path} HTTP/1.1\r\nHost: {addr}\r\nConnection: close\r\n\r\n").as_bytes(),
    )
    .await?;
    let mut body = String::new();
    s.read_to_string(&mut body).await?;
    Ok(body)
}

/// Sum of every sample of `name` (all label sets).
fn metric_sum(page: &str, name: &str) -> f64 {
    page.lines()
        .filter(|l| {
            l.strip_prefix(name)
                .is_some_and(|rest| rest.starts_with('{') || rest.starts_with(' '))
        })
        .filter_map(|l| l.rsplit(' ').next().and_then(|v| v.parse::<f64>().ok()))
        .sum()
}

#[derive(Default)]
struct Counters {
    messages: AtomicU64,
    blocks: AtomicU64,
}

fn percentile(sorted: &[u64], p: f64) -> f64 {
    if sorted.is_empty() {
        return 0.0;
    }
    let rank = ((p / 100.0) * sorted.len() as f64).ceil() as usize;
    sorted[rank.clamp(1, sorted.len()) - 1] as f64 / 1e3
}

async fn score_loop(
    mut client: KvIndexerClient<tonic::transport::Channel>,
    docs: Arc<Vec<Document>>,
    model: String,
    pods: Vec<String>,
    stop: Arc<AtomicBool>,
    offset: usize,
) -> anyhow::Result<(Vec<u64>, u64)> {
    let mut latencies = Vec::new();
    let mut matched = 0u64;
    let mut i = offset;
    while !stop.load(Ordering::Relaxed) {
        let doc = &docs[i % docs.len()];
        i += 1;
        let req = ScorePodsRequest {
            model: model.clone(),
            input: Some(Input::Tokens(TokenIds {
                ids: doc.tokens.clone(),
            })),
            pods: pods.clone(),
            ..Default::default()
        };
        let t = Instant::now();
        let resp = client.score_pods(req).await;
        latencies.push(t.elapsed().as_nanos() as u64);
        match resp {
            Ok(r) => {
                matched += r
                    .into_inner()
                    .scores
                    .first()
                    .map_or(0, |s| s.matched_blocks as u64)
            }
            Err(s) if s.code() == tonic::Code::NotFound => {}
            Err(s) => bail!("ScorePods failed: {s}"),
        }
    }
    Ok((latencies, matched))
}

async fn score_phase(
    args: &LoadgenArgs,
    docs: &Arc<Vec<Document>>,
    pods: &[String],
    seconds: u64,
) -> anyhow::Result<(Vec<u64>, u64)> {
    let stop = Arc::new(AtomicBool::new(false));
    let mut tasks = Vec::new();
    for c in 0..args.score_concurrency {
        let channel = tonic::transport::Endpoint::from_shared(args.grpc.clone())?
            .tcp_nodelay(true)
            .initial_stream_window_size(Some(1 << 20))
            .initial_connection_window_size(Some(4 << 20))
            .connect()
            .await
            .with_context(|| format!("connecting to gRPC {}", args.grpc))?;
        let client = KvIndexerClient::new(channel);
        tasks.push(tokio::spawn(score_loop(
            client,
            docs.clone(),
            args.model.clone(),
            pods.to_vec(),
            stop.clone(),
            c * 7,
        )));
    }
    tokio::time::sleep(Duration::from_secs(seconds)).await;
    stop.store(true, Ordering::Relaxed);
    let mut all = Vec::new();
    let mut matched = 0;
    for t in tasks {
        let (l, m) = t.await??;
        all.extend(l);
        matched += m;
    }
    all.sort_unstable();
    Ok((all, matched))
}

/// Runs the load and prints the report.
pub fn run(args: LoadgenArgs) -> anyhow::Result<()> {
    if args.pods == 0 || args.documents < 3 || args.prompt_blocks == 0 {
        bail!("--pods must be >= 1, --documents >= 3, --prompt-blocks >= 1");
    }
    let runtime = tokio::runtime::Builder::new_multi_thread()
        .enable_all()
        .build()?;
    runtime.block_on(run_async(args))
}

async fn run_async(args: LoadgenArgs) -> anyhow::Result<()> {
    let t = Instant::now();
    let docs = Arc::new(prepare(&args)?);
    eprintln!(
        "prepared {} prompts of {} blocks in {:.1}s",
        docs.len(),
        args.prompt_blocks,
        t.elapsed().as_secs_f64()
    );
    let pods: Vec<String> = (0..args.pods)
        .map(|p| format!("10.200.{}.{}:8000", p / 250, p % 250))
        .collect();
    let topics: Vec<Bytes> = pods
        .iter()
        .map(|p| Bytes::from(format!("kv@{p}@{}", args.model)))
        .collect();
    let mut publisher = PubSocket::new();
    publisher
        .connect(&args.zmq_endpoint)
        .await
        .with_context(|| {
            format!(
                "connecting to the daemon's ZMQ endpoint {}",
                args.zmq_endpoint
            )
        })?;
    // Let the subscription reach the PUB (ZeroMQ's slow joiner).
    tokio::time::sleep(Duration::from_millis(500)).await;

    // Warm-up: every pod stores its first document; then the idle baseline.
    let mut seqs = vec![0u64; pods.len()];
    for (p, topic) in topics.iter().enumerate() {
        for (payload, _) in &docs[p % docs.len()].store {
            send(&mut publisher, topic, &mut seqs[p], payload).await?;
        }
    }
    tokio::time::sleep(Duration::from_millis(500)).await;
    if let Some(path) = &args.dump_request {
        let request = serde_json::json!({
            "model": args.model,
            "tokens": {"ids": docs[0].tokens},
            "pods": pods,
        });
        std::fs::write(path, serde_json::to_string(&request)?)
            .with_context(|| format!("writing {}", path.display()))?;
        eprintln!(
            "wrote a ScorePods request for the prompt {} stored to {}",
            pods[0],
            path.display()
        );
    }
    let (idle, idle_matched) = score_phase(&args, &docs, &pods, args.baseline).await?;

    if args.duration == 0 {
        // Warm-up only: every pod holds its first prompt (what --dump-request describes).
        println!(
            "warm-up only: {} pods stored one prompt each; ScorePods idle {} calls, p50 {:.1} us, p99 {:.1} us",
            args.pods,
            idle.len(),
            percentile(&idle, 50.0),
            percentile(&idle, 99.0)
        );
        let _ = idle_matched;
        return Ok(());
    }
    let before = http_get(&args.metrics, "/metrics").await?;
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
                    let doc = &docs[(p + round) % n];
                    let old = &docs[(p + round + n - 2) % n];
                    for (payload, blocks) in doc.store.iter().chain(&old.remove) {
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
                        send(&mut publisher, topic, &mut seqs[p], payload).await?;
                        sent += blocks;
                        counters.messages.fetch_add(1, Ordering::Relaxed);
                        counters.blocks.fetch_add(*blocks, Ordering::Relaxed);
                    }
                }
                round += 1;
            }
            Ok::<_, anyhow::Error>(())
        })
    };
    let started = Instant::now();
    let (loaded, loaded_matched) = score_phase(&args, &docs, &pods, args.duration).await?;
    stop.store(true, Ordering::Relaxed);
    let elapsed = started.elapsed().as_secs_f64();
    let after = http_get(&args.metrics, "/metrics").await?;
    publish.await??;

    let delta = |name: &str| metric_sum(&after, name) - metric_sum(&before, name);
    let applied_blocks = delta("kvindexer_blocks_applied_total");
    let applied_events = delta("kvindexer_events_received_total");
    let gaps = delta("kvindexer_sequence_gaps_total");
    let lost = delta("kvindexer_messages_lost_total");
    let sent_blocks = counters.blocks.load(Ordering::Relaxed) as f64;
    let sent_messages = counters.messages.load(Ordering::Relaxed) as f64;
    let report = serde_json::json!({
        "duration_s": elapsed,
        "pods": args.pods,
        "prompt_blocks": args.prompt_blocks,
        "sent_messages_per_s": sent_messages / elapsed,
        "sent_blocks_per_s": sent_blocks / elapsed,
        "applied_blocks_per_s": applied_blocks / elapsed,
        "applied_events_per_s": applied_events / elapsed,
        "sequence_gaps": gaps,
        "messages_lost": lost,
        "score_idle": {"calls": idle.len(), "p50_us": percentile(&idle, 50.0), "p99_us": percentile(&idle, 99.0), "avg_matched_blocks": idle_matched as f64 / idle.len().max(1) as f64},
        "score_under_load": {"calls": loaded.len(), "calls_per_s": loaded.len() as f64 / elapsed, "p50_us": percentile(&loaded, 50.0), "p99_us": percentile(&loaded, 99.0), "max_us": percentile(&loaded, 100.0), "avg_matched_blocks": loaded_matched as f64 / loaded.len().max(1) as f64},
    });
    if args.json {
        println!("{}", serde_json::to_string_pretty(&report)?);
        return Ok(());
    }
    println!(
        "load: {} pods, prompts of {} blocks, {:.1}s",
        args.pods, args.prompt_blocks, elapsed
    );
    println!(
        "sent:    {:>10.0} msgs/s  {:>12.0} blocks/s",
        sent_messages / elapsed,
        sent_blocks / elapsed
    );
    println!(
        "applied: {:>10.0} events/s {:>12.0} blocks/s  (gaps {gaps}, lost messages {lost})",
        applied_events / elapsed,
        applied_blocks / elapsed
    );
    println!(
        "ScorePods idle:       {:>7} calls  p50 {:>8.1} us  p99 {:>8.1} us",
        idle.len(),
        percentile(&idle, 50.0),
        percentile(&idle, 99.0)
    );
    println!(
        "ScorePods under load: {:>7} calls  p50 {:>8.1} us  p99 {:>8.1} us  (p99 ratio to idle {:.2})",
        loaded.len(),
        percentile(&loaded, 50.0),
        percentile(&loaded, 99.0),
        percentile(&loaded, 99.0) / percentile(&idle, 99.0).max(1e-9)
    );
    Ok(())
}

async fn send(
    publisher: &mut PubSocket,
    topic: &Bytes,
    seq: &mut u64,
    payload: &Bytes,
) -> anyhow::Result<()> {
    let msg = ZmqMessage::try_from(vec![
        topic.clone(),
        Bytes::copy_from_slice(&seq.to_be_bytes()),
        payload.clone(),
    ])
    .map_err(|_| anyhow::anyhow!("empty message"))?;
    *seq += 1;
    publisher.send(msg).await.context("ZMQ send")?;
    Ok(())
}
