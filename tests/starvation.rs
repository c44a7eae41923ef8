//! A few maximal prompts cannot starve short ones (over real sockets, the project's word-level
//! tokenizer): eight concurrent 1 MB prompts run in the large-prompt lane while short prompts
//! (about 1,000 tokens each, all different) keep being answered within 50 ms, p99.

mod support;

use std::time::{Duration, Instant};

use kv_indexer::config::ModelConfig;
use kv_indexer::daemon;
use kv_proto::kvindexer_v1::{
    kv_indexer_client::KvIndexerClient, score_pods_request::Input, ScorePodsRequest,
};

const MODEL: &str = "tiny/model";

/// `words` words of the tiny vocabulary, varied by `seed` so no two prompts share a prefix.
fn prompt(vocab: &[String], words: usize, seed: u64) -> String {
    let mut rng = support::Rng::new(seed);
    let usable: Vec<&String> = vocab
        .iter()
        .filter(|w| !w.starts_with(['<', '[']))
        .collect();
    let mut out = String::with_capacity(words * 8);
    for _ in 0..words {
        out.push_str(usable[rng.below(usable.len() as u64) as usize]);
        out.push(' ');
    }
    out
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn short_prompts_are_answered_while_maximal_ones_are_tokenized() {
    let dir = support::temp_dir("starvation-tokenizer");
    let vocab = support::tiny_tokenizer(&dir);
    let mut c = support::loopback_config();
    c.models.insert(
        MODEL.into(),
        ModelConfig {
            tokenizer: Some(dir.join("tokenizer.json").display().to_string()),
            ..Default::default()
        },
    );
    let max_bytes = c.server.max_prompt_bytes;
    let d = daemon::start(c).await.expect("daemon starts");
    let url = format!("http://{}", d.grpc_addr);
    let score = |text: String| {
        let url = url.clone();
        async move {
            let mut grpc = KvIndexerClient::connect(url).await.expect("gRPC");
            let mut request = tonic::Request::new(ScorePodsRequest {
                model: MODEL.into(),
                input: Some(Input::Prompt(text)),
                ..Default::default()
            });
            // The maximal prompts queue one behind another: give them all the time they need
            // (the server's default deadline is 10 s), so what is measured is the short ones.
            request.set_timeout(Duration::from_secs(120));
            grpc.score_pods(request).await
        }
    };
    // Warm the tokenizer (loading is not what is measured).
    score(prompt(&vocab, 10, 0)).await.expect("warm-up");

    let mut huge = prompt(&vocab, max_bytes / 6, 1);
    huge.truncate(max_bytes - 16);
    let big: Vec<_> = (0..8)
        .map(|i| {
            let text = format!("{i} {huge}");
            tokio::spawn(score(text))
        })
        .collect();
    tokio::time::sleep(Duration::from_millis(100)).await;
    let mut latencies = Vec::new();
    for i in 0..60u64 {
        let text = prompt(&vocab, 1_000, 100 + i);
        let t = Instant::now();
        score(text).await.expect("a short prompt is answered");
        latencies.push(t.elapsed());
    }
    let mut finished_big = 0;
    for b in big {
        if b.await.expect("task").is_ok() {
            finished_big += 1;
        }
    }
    latencies.sort();
    let p99 = latencies[latencies.len() * 99 / 100 - 1];
    let p50 = latencies[latencies.len() / 2];
    eprintln!("short prompts beside 8 maximal ones: p50 {p50:?}, p99 {p99:?}; maximal answered {finished_big}/8");
    assert_eq!(finished_big, 8, "the maximal prompts are served too");
    assert!(
        p99 <= Duration::from_millis(50),
        "short prompts waited behind maximal ones: p99 {p99:?}"
    );
    d.shutdown().await;
}
