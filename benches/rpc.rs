//! `cargo bench --bench rpc`: where a ScorePods call's time goes, each stage measured on its own
//! in the same run, against an in-process daemon (default configuration, release build).
//!
//! The scenario is loadgen's (`kv-indexer loadgen`): one model, 64 pods each holding the same
//! 500-block prompt (8,000 tokens, block size 16), the request naming all 64 pods, one caller
//! on its own thread and runtime (a gateway's client), the daemon on a two-worker runtime.
//! Stages, 2,000 calls each, three rounds, medians of each round's p50 and p99:
//! - **rpc floor**: ScorePods for a one-block prompt and one pod: tonic, h2, loopback TCP and
//!   the task hops, with almost no payload or work;
//! - **rpc full**: the loadgen request (token ids as a varint list, `tokens`);
//! - **rpc full, packed**: the same ids as `token_ids_le` (little-endian u32 bytes);
//! - in process, no transport: the client's request encoding, the server's decoding, hashing
//!   the 500 blocks, the index walk with 64 candidates (`score_hashes`), the whole server-side
//!   work (`score_tokens`: hashing and walk), the response's encoding; the request encoded
//!   into a `BytesMut` as tonic's encoder does (byte by byte through `BufMut`), and the packed
//!   request's encoding and decoding;
//! - hashing three ways: SHA-256 alone, through the digest memo for the prompt seen before
//!   (what the calls above do), and through the memo for prompts never seen (every block a
//!   miss, written to the memo); and the packed call against a second daemon with the memo off.

use std::time::{Duration, Instant};

use kv_core::{BlockStored, EngineHash, EventBatch, KvEvent};
use kv_lab::index_bench::median;
use kv_proto::kvindexer_v1::kv_indexer_client::KvIndexerClient;
use kv_proto::kvindexer_v1::score_pods_request::Input;
use kv_proto::kvindexer_v1::{ScorePodsRequest, ScorePodsResponse, TokenIds};
use prost::Message;

const MODEL: &str = "bench/model";
const PODS: usize = 64;
const BLOCKS: usize = 500;
const CALLS: usize = 2_000;
const ROUNDS: usize = 3;

fn percentile(sorted: &[f64], p: f64) -> f64 {
    let rank = ((p / 100.0) * sorted.len() as f64).ceil() as usize;
    sorted[rank.clamp(1, sorted.len()) - 1]
}

/// One stage's rounds: per round (p50, p99) in microseconds.
#[derive(Default)]
struct Stage {
    p50: Vec<f64>,
    p99: Vec<f64>,
}

impl Stage {
    fn round(&mut self, mut us: Vec<f64>) {
        us.sort_by(f64::total_cmp);
        self.p50.push(percentile(&us, 50.0));
        self.p99.push(percentile(&us, 99.0));
    }

    fn time(&mut self, mut f: impl FnMut()) {
        let mut us = Vec::with_capacity(CALLS);
        for _ in 0..CALLS {
            let t = Instant::now();
            f();
            us.push(t.elapsed().as_secs_f64() * 1e6);
        }
        self.round(us);
    }
}

fn tokens() -> Vec<u32> {
    let mut x = 0x1234_5678u64;
    (0..BLOCKS * 16)
        .map(|_| {
            x = x
                .wrapping_mul(6364136223846793005)
                .wrapping_add(1442695040888963407);
            (x >> 40) as u32 % 150_000
        })
        .collect()
}

fn request(tokens: &[u32], pods: &[String]) -> ScorePodsRequest {
    ScorePodsRequest {
        model: MODEL.into(),
        input: Some(Input::Tokens(TokenIds {
            ids: tokens.to_vec(),
        })),
        pods: pods.to_vec(),
        ..Default::default()
    }
}

/// Calls ScorePods `CALLS` times from a thread and runtime of its own (the gateway's side).
fn rpc_round(endpoint: &str, req: &ScorePodsRequest) -> Vec<f64> {
    let endpoint = endpoint.to_owned();
    let req = req.clone();
    std::thread::spawn(move || {
        let rt = tokio::runtime::Builder::new_current_thread()
            .enable_all()
            .build()
            .expect("client runtime");
        rt.block_on(async move {
            let channel = tonic::transport::Endpoint::from_shared(endpoint)
                .expect("endpoint")
                .tcp_nodelay(true)
                .connect()
                .await
                .expect("connects");
            let mut client = KvIndexerClient::new(channel);
            let mut us = Vec::with_capacity(CALLS);
            for i in 0..CALLS + 200 {
                let t = Instant::now();
                let resp = client.score_pods(req.clone()).await.expect("scores");
                let dt = t.elapsed().as_secs_f64() * 1e6;
                assert!(!resp.into_inner().scores.is_empty());
                if i >= 200 {
                    us.push(dt);
                }
            }
            us
        })
    })
    .join()
    .expect("client thread")
}

/// A daemon (default configuration; `memo` overrides `scoring.digestMemoBytes`) whose index
/// has every pod holding the prompt: the walk visits all 500 blocks for all 64 candidates.
fn start(
    runtime: &tokio::runtime::Runtime,
    tokens: &[u32],
    pods: &[String],
    memo: Option<usize>,
) -> (
    String,
    std::sync::Arc<kv_core::Indexer>,
    kv_indexer::daemon::RunningDaemon,
) {
    let (endpoint, indexer, daemon) = runtime.block_on(async {
        let mut config = kv_indexer::config::Config::default();
        config.server.grpc_addr = "127.0.0.1:0".into();
        config.server.metrics_addr = "127.0.0.1:0".into();
        config.kv_events_config.zmq_endpoint = "tcp://127.0.0.1:0".into();
        if let Some(bytes) = memo {
            config.scoring.digest_memo_bytes = bytes;
        }
        let d = kv_indexer::daemon::start(config)
            .await
            .expect("daemon starts");
        (format!("http://{}", d.grpc_addr), d.indexer.clone(), d)
    });
    let empty = EventBatch {
        ts: 0.0,
        events: Vec::new(),
        data_parallel_rank: None,
    };
    indexer
        .apply_batch(MODEL, "pod-0", &empty)
        .expect("model admitted");
    let hashes = indexer
        .block_hashes(MODEL, tokens, None, None)
        .expect("model known");
    assert_eq!(hashes.len(), BLOCKS);
    for pod in pods {
        let batch = EventBatch {
            ts: 0.0,
            events: vec![KvEvent::BlockStored(Box::new(BlockStored {
                block_hashes: hashes.iter().map(|&k| EngineHash::aligned(k)).collect(),
                block_size: 16,
                ..Default::default()
            }))],
            data_parallel_rank: None,
        };
        indexer.apply_batch(MODEL, pod, &batch).expect("applies");
    }
    (endpoint, indexer, daemon)
}

fn main() {
    let runtime = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(2)
        .enable_all()
        .build()
        .expect("runtime");
    let tokens = tokens();
    let pods: Vec<String> = (0..PODS).map(|p| format!("pod-{p}")).collect();
    // The default daemon (digest memo on), and one with the memo off: the same run's baseline.
    let (endpoint, indexer, daemon) = start(&runtime, &tokens, &pods, None);
    let (endpoint_no_memo, _, daemon_no_memo) = start(&runtime, &tokens, &pods, Some(0));
    let hashes = indexer
        .block_hashes(MODEL, &tokens, None, None)
        .expect("model known");
    let processor = indexer.model(MODEL).expect("known").processor().clone();
    let mut scratch = kv_core::HashScratch::default();
    let mut sha_out = Vec::with_capacity(BLOCKS);
    // Prompts never seen before: the first token counts up, so every block's parent is new.
    let mut unseen = tokens.clone();
    let full = request(&tokens, &pods);
    let floor = request(&tokens[..16], &pods[..1]);
    let full_bytes = full.encode_to_vec();
    let packed = ScorePodsRequest {
        input: Some(Input::TokenIdsLe(kv_proto::token_ids_le::encode(&tokens))),
        ..full.clone()
    };
    let packed_bytes = packed.encode_to_vec();
    let response = ScorePodsResponse {
        scores: indexer
            .score_tokens(MODEL, &tokens, &pods, None, None)
            .expect("scores")
            .named()
            .map(|(pod, s)| kv_proto::kvindexer_v1::PodScore {
                pod: pod.to_owned(),
                score: s.score,
                matched_blocks: s.matched_blocks,
                speculative_blocks: s.speculative_blocks,
                data_parallel_rank: s.rank,
            })
            .collect(),
        ..Default::default()
    };
    assert_eq!(response.scores.len(), PODS);
    // By tokens a score stops at the prompt's `num_tokens - 1` tokens (vLLM's reuse bound):
    // every pod is credited all blocks but the last.
    let credited = (tokens.len() - 1) / 16;
    assert!(response
        .scores
        .iter()
        .all(|s| s.matched_blocks as usize == credited));

    let names = [
        "rpc floor (1 block, 1 pod)",
        "rpc full (500 blocks, 64 pods)",
        "encode request (client)",
        "decode request (server)",
        "hash 500 blocks (digest memo, prompt seen before)",
        "index walk, 64 candidates",
        "score_tokens (hash + walk)",
        "encode response",
        "rpc full, packed token ids (token_ids_le)",
        "encode request into a BytesMut (tonic's buffer)",
        "encode packed request (client)",
        "decode packed request and unpack ids (server)",
        "hash 500 blocks (SHA-256 only, no memo)",
        "hash 500 blocks (digest memo, prompt never seen)",
        "rpc full, packed, digest memo off",
    ];
    let mut stages: Vec<Stage> = names.iter().map(|_| Stage::default()).collect();
    for _ in 0..ROUNDS {
        stages[0].round(rpc_round(&endpoint, &floor));
        stages[1].round(rpc_round(&endpoint, &full));
        stages[2].time(|| {
            std::hint::black_box(full.encode_to_vec());
        });
        stages[3].time(|| {
            std::hint::black_box(ScorePodsRequest::decode(full_bytes.as_slice()).expect("decodes"));
        });
        stages[4].time(|| {
            std::hint::black_box(
                indexer
                    .block_hashes(MODEL, &tokens, None, None)
                    .expect("ok"),
            );
        });
        stages[5].time(|| {
            std::hint::black_box(indexer.score_hashes(MODEL, &hashes, &pods).expect("ok"));
        });
        stages[6].time(|| {
            std::hint::black_box(
                indexer
                    .score_tokens(MODEL, &tokens, &pods, None, None)
                    .expect("ok"),
            );
        });
        stages[7].time(|| {
            std::hint::black_box(response.encode_to_vec());
        });
        stages[8].round(rpc_round(&endpoint, &packed));
        stages[9].time(|| {
            let mut buf = bytes::BytesMut::with_capacity(8 << 10);
            full.encode(&mut buf).expect("fits");
            std::hint::black_box(buf);
        });
        stages[10].time(|| {
            std::hint::black_box(packed.encode_to_vec());
        });
        stages[11].time(|| {
            let req = ScorePodsRequest::decode(packed_bytes.as_slice()).expect("decodes");
            let Some(Input::TokenIdsLe(ids)) = req.input else {
                unreachable!("the packed request")
            };
            std::hint::black_box(kv_proto::token_ids_le::decode(&ids));
        });
        stages[12].time(|| {
            sha_out.clear();
            processor.block_hashes_into(
                &tokens,
                &kv_core::RequestExtras::default(),
                &mut scratch,
                &mut sha_out,
            );
            std::hint::black_box(&sha_out);
        });
        stages[13].time(|| {
            unseen[0] = unseen[0].wrapping_add(1);
            std::hint::black_box(
                indexer
                    .block_hashes(MODEL, &unseen, None, None)
                    .expect("ok"),
            );
        });
        stages[14].round(rpc_round(&endpoint_no_memo, &packed));
    }
    println!(
        "ScorePods breakdown: {PODS} pods x {BLOCKS}-block prompt ({} request bytes; packed {}), {CALLS} calls x {ROUNDS} rounds, medians",
        full_bytes.len(),
        packed_bytes.len()
    );
    println!("| stage | p50 us | p99 us |");
    println!("|---|---:|---:|");
    for (name, s) in names.iter().zip(&stages) {
        println!("| {name} | {:.1} | {:.1} |", median(&s.p50), median(&s.p99));
    }
    let rpc = median(&stages[1].p50);
    let floor = median(&stages[0].p50);
    let work = median(&stages[6].p50);
    let proto = median(&stages[2].p50) + median(&stages[3].p50) + median(&stages[7].p50);
    println!(
        "p50 split: transport floor {floor:.0} us, server work {work:.0} us, protobuf {proto:.0} us, \
         unexplained (payload over the wire, copies, task hops) {:.0} us, of {rpc:.0} us",
        rpc - floor - work - proto
    );
    runtime.block_on(async {
        daemon.shutdown().await;
        daemon_no_memo.shutdown().await;
        tokio::time::sleep(Duration::from_millis(10)).await;
    });
}
