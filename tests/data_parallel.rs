//! Data-parallel ranks over real sockets: vLLM-shaped batches carrying `data_parallel_rank`
//! (as vLLM's publisher fills it in, 0 without data parallelism) into a bind-mode daemon, then
//! the rank each face reports:
//!
//! - ScorePods names the rank a data-parallel pod's score comes from (the best; a prefix
//!   split across ranks scores the larger part, with its rank), no rank for a pod without data
//!   parallelism, and with `every_rank` each (pod, rank) apart;
//! - GetPodScores, read through a client generated from llm-d's own `indexer.proto` (vendored
//!   in `proto/vendor/llm-d`), lists a data-parallel pod per rank with the rank set and a pod
//!   without data parallelism once with the rank absent;
//! - RecordRouting with a rank makes that rank (and no other) hold the prompt speculatively.

mod support;

use std::time::Duration;

use kv_core::{BlockHash, RequestExtras, TokenProcessor, TokenProcessorConfig};
use kv_indexer::daemon::{self, RunningDaemon};
use kv_proto::kvindexer_v1::{
    score_pods_request::Input, RecordRoutingRequest, ScorePodsRequest, TokenIds,
};
use kv_proto::llmd_upstream;
use zeromq::SocketSend;

const MODEL: &str = "dp/model";
const SEED: &str = "12345";

fn processor() -> TokenProcessor {
    TokenProcessor::new(&TokenProcessorConfig {
        hash_seed: Some(SEED.into()),
        block_size: 16,
        ..Default::default()
    })
    .expect("processor")
}

/// A prompt of `blocks` blocks of distinct token ids (scored by ids).
fn prompt(seed: u32, blocks: usize) -> Vec<u32> {
    (0..blocks * 16)
        .map(|i| 100 + seed * 10_000 + i as u32)
        .collect()
}

/// Sends, as `pod`'s rank `rank`, a store of the first `blocks` blocks of `tokens` until the
/// daemon holds them (the first message of each publisher, past ZeroMQ's slow joiner).
async fn store(
    p: &mut zeromq::PubSocket,
    d: &RunningDaemon,
    pod: &str,
    rank: i64,
    tokens: &[u32],
    blocks: usize,
) {
    let hashes = processor().block_hashes(&tokens[..blocks * 16], &RequestExtras::default());
    let last = *hashes.last().expect("a block");
    for _ in 0..200 {
        p.send(support::pods::ranked_message(MODEL, pod, rank, 0, &hashes))
            .await
            .expect("send");
        tokio::time::sleep(Duration::from_millis(20)).await;
        if held_at(d, pod, rank as u32, last) {
            return;
        }
    }
    panic!("{pod} rank {rank} never stored");
}

fn held_at(d: &RunningDaemon, pod: &str, rank: u32, hash: BlockHash) -> bool {
    let Some(model) = d.indexer.model(MODEL) else {
        return false;
    };
    let Some(engine) = model.index().directory().engine(pod, rank) else {
        return false;
    };
    model.index().lookup(hash).iter().any(|(e, _)| *e == engine)
}

async fn score(
    d: &RunningDaemon,
    tokens: &[u32],
    every_rank: bool,
) -> kv_proto::kvindexer_v1::ScorePodsResponse {
    support::client(d)
        .await
        .score_pods(ScorePodsRequest {
            model: MODEL.into(),
            input: Some(Input::Tokens(TokenIds {
                ids: tokens.to_vec(),
            })),
            every_rank,
            ..Default::default()
        })
        .await
        .expect("ScorePods")
        .into_inner()
}

/// (matched blocks, rank) of `pod` in a ScorePods answer.
fn entry(r: &kv_proto::kvindexer_v1::ScorePodsResponse, pod: &str) -> (u32, Option<u32>) {
    let s = r.scores.iter().find(|s| s.pod == pod).expect("listed");
    (s.matched_blocks, s.data_parallel_rank)
}

/// The daemon (its tokenizer: the project's tiny word-level one), and the text-prompt token
/// ids `text` encodes to, as ScorePods and GetPodScores encode a prompt.
async fn start() -> (RunningDaemon, tempdir::Dir, String, Vec<u32>) {
    let dir = tempdir::Dir::new("dp-tokenizer");
    let vocab = support::tiny_tokenizer(&dir.0);
    let words: Vec<&String> = vocab
        .iter()
        .filter(|w| !w.starts_with(['<', '[']))
        .take(20)
        .collect();
    let text = (0..100)
        .map(|i| words[i % words.len()].as_str())
        .collect::<Vec<_>>()
        .join(" ");
    let tokenizer = kv_tokenize::LoadedTokenizer::from_files(MODEL, &dir.0.join("tokenizer.json"))
        .expect("loads");
    let ids = tokenizer.encode_prompt(&text).expect("encodes").ids;
    let mut c = support::loopback_config();
    c.indexer_config.token_processor_config.hash_seed = Some(SEED.into());
    c.server.enable_record_routing = true;
    c.models.insert(
        MODEL.into(),
        kv_indexer::config::ModelConfig {
            tokenizer: Some(dir.0.join("tokenizer.json").display().to_string()),
            ..Default::default()
        },
    );
    (
        daemon::start(c).await.expect("daemon starts"),
        dir,
        text,
        ids,
    )
}

/// A temporary folder removed when dropped.
mod tempdir {
    pub struct Dir(pub std::path::PathBuf);
    impl Dir {
        pub fn new(name: &str) -> Self {
            Self(super::support::temp_dir(name))
        }
    }
    impl Drop for Dir {
        fn drop(&mut self) {
            let _ = std::fs::remove_dir_all(&self.0);
        }
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn each_face_names_the_rank_that_holds_the_prefix() {
    let (d, _dir, text, tokens) = start().await;
    let mut p = support::pods::connect(&d).await;
    let x = prompt(1, 12);
    // Pod A (data-parallel): rank 1 holds 8 blocks of X; rank 0 holds another prompt.
    store(&mut p, &d, "10.8.0.1:8000", 0, &prompt(9, 4), 4).await;
    store(&mut p, &d, "10.8.0.1:8000", 1, &x, 8).await;
    // Pod B (no data parallelism: vLLM still sends rank 0): 4 blocks of X.
    store(&mut p, &d, "10.8.0.2:8000", 0, &x, 4).await;
    // Pod C: the prefix split across ranks, 5 blocks on rank 0 and 10 on rank 1.
    store(&mut p, &d, "10.8.0.3:8000", 0, &x, 5).await;
    store(&mut p, &d, "10.8.0.3:8000", 1, &x, 10).await;

    let r = score(&d, &x, false).await;
    assert_eq!(entry(&r, "10.8.0.1:8000"), (8, Some(1)), "{r:?}");
    assert_eq!(entry(&r, "10.8.0.2:8000"), (4, None), "no rank: {r:?}");
    assert_eq!(entry(&r, "10.8.0.3:8000"), (10, Some(1)), "the larger part");
    assert!(r.rank_scores.is_empty(), "only asked for");

    let r = score(&d, &x, true).await;
    let mut ranks: Vec<(String, Option<u32>, u32)> = r
        .rank_scores
        .iter()
        .map(|s| (s.pod.clone(), s.data_parallel_rank, s.matched_blocks))
        .collect();
    ranks.sort();
    assert_eq!(
        ranks,
        [
            ("10.8.0.1:8000".to_owned(), Some(1), 8),
            ("10.8.0.2:8000".to_owned(), None, 4),
            ("10.8.0.3:8000".to_owned(), Some(0), 5),
            ("10.8.0.3:8000".to_owned(), Some(1), 10),
        ]
    );

    // GetPodScores through llm-d's own generated client (a text prompt in).
    assert!(
        tokens.len() >= 4 * 16,
        "the text makes {} tokens",
        tokens.len()
    );
    store(&mut p, &d, "10.8.0.4:8000", 0, &tokens, 2).await;
    store(&mut p, &d, "10.8.0.4:8000", 1, &tokens, 4).await;
    store(&mut p, &d, "10.8.0.5:8000", 0, &tokens, 3).await;
    let mut llmd = llmd_upstream::indexer_service_client::IndexerServiceClient::connect(format!(
        "http://{}",
        d.grpc_addr
    ))
    .await
    .expect("llm-d client connects");
    let answer = llmd
        .get_pod_scores(llmd_upstream::GetPodScoresRequest {
            prompt: text,
            model_name: MODEL.into(),
            pod_identifiers: vec!["10.8.0.4:8000".into(), "10.8.0.5:8000".into()],
        })
        .await
        .expect("GetPodScores")
        .into_inner();
    let mut got: Vec<(String, Option<i32>, f64)> = answer
        .scores
        .iter()
        .map(|s| (s.pod.clone(), s.data_parallel_rank, s.score))
        .collect();
    got.sort_by(|a, b| (&a.0, a.1).cmp(&(&b.0, b.1)));
    assert_eq!(
        got,
        [
            ("10.8.0.4:8000".to_owned(), Some(0), 2.0),
            ("10.8.0.4:8000".to_owned(), Some(1), 4.0),
            ("10.8.0.5:8000".to_owned(), None, 3.0),
        ],
        "one entry per (pod, rank) for a data-parallel pod, one without a rank otherwise"
    );

    // RecordRouting pinned to rank 0 of pod A: rank 0 holds the new prompt speculatively.
    let fresh = prompt(3, 6);
    let recorded = support::client(&d)
        .await
        .record_routing(RecordRoutingRequest {
            model: MODEL.into(),
            tokens: Some(TokenIds { ids: fresh.clone() }),
            pod: "10.8.0.1:8000".into(),
            data_parallel_rank: Some(0),
            ..Default::default()
        })
        .await
        .expect("RecordRouting")
        .into_inner();
    assert_eq!(recorded.blocks, 6);
    // Asked with one more token: vLLM recomputes a prompt's last token, so a prompt of exactly
    // the 6 recorded blocks would reuse 5 of them.
    let mut asked = fresh.clone();
    asked.push(7);
    let r = score(&d, &asked, false).await;
    let a = r
        .scores
        .iter()
        .find(|s| s.pod == "10.8.0.1:8000")
        .expect("listed");
    assert_eq!(
        (a.matched_blocks, a.speculative_blocks, a.data_parallel_rank),
        (6, 6, Some(0)),
        "the recorded rank is the one to pin"
    );
    let exact = score(&d, &fresh, false).await;
    let a = exact.scores.iter().find(|s| s.pod == "10.8.0.1:8000");
    assert_eq!(
        a.map(|a| a.matched_blocks),
        Some(5),
        "the last token recomputed"
    );
    d.shutdown().await;
}
