//! A few maximal prompts cannot starve short ones (over real sockets, the project's word-level
//! tokenizer): eight concurrent 1 MB prompts run in the large-prompt lane while short prompts
//! (about 1,000 tokens each, all different) keep being answered about as fast as without them
//! (p99 within 3x the p99 of the same loop alone, earlier in the test, plus 100 ms).

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

    let short_prompts = |first_seed: u64| {
        let score = &score;
        let vocab = &vocab;
        async move {
            let mut latencies = Vec::new();
            for i in 0..60u64 {
                let text = prompt(vocab, 1_000, first_seed + i);
                let t = Instant::now();
                score(text).await.expect("a short prompt is answered");
                latencies.push(t.elapsed());
            }
            latencies.sort();
            latencies
        }
    };
    // The baseline: the same short prompts' loop alone (other prompts: none is cached).
    let alone = short_prompts(10_000).await;

    let mut huge = prompt(&vocab, max_bytes / 6, 1);
    huge.truncate(max_bytes - 16);
    let big: Vec<_> = (0..8)
        .map(|i| {
            let text = format!("{i} {huge}");
            let (request, t) = (score(text), Instant::now());
            tokio::spawn(async move { request.await.map(|_| t.elapsed()) })
        })
        .collect();
    tokio::time::sleep(Duration::from_millis(100)).await;
    let latencies = short_prompts(100).await;
    let mut big_times = Vec::new();
    for b in big {
        if let Ok(t) = b.await.expect("task") {
            big_times.push(t);
        }
    }
    let finished_big = big_times.len();
    big_times.sort();
    let figures = |l: &[Duration]| (l[l.len() / 2], l[l.len() * 99 / 100 - 1]);
    let ((alone_p50, alone_p99), (p50, p99)) = (figures(&alone), figures(&latencies));
    eprintln!("short prompts alone: p50 {alone_p50:?}, p99 {alone_p99:?}; beside 8 maximal ones: p50 {p50:?}, p99 {p99:?}; maximal answered {finished_big}/8 in {big_times:?}");
    assert_eq!(finished_big, 8, "the maximal prompts are served too");
    // Not slowed by the maximal prompts, against the same loop alone (same daemon, machine
    // and moment): they run in a lane of their own, one after another, so what is left is
    // their load on the two cores. Debug build on a busy machine, 2026-11-26: alone p99 34 ms,
    // beside them 36 ms. In the lane (one thread of the pool's eight) a maximal prompt took
    // 1.0-1.7 s, answered 2.7 s to 12.2 s after they were sent. A build without the lane puts
    // them on all eight threads at once, and a short prompt waits until one of them ends:
    // seconds. The bound, 3x the baseline p99 plus 100 ms, passes the measured ratio (1.1x;
    // 1.9x on 2026-11-27 with other builds running) and fails a wait for a fraction of one
    // maximal prompt (it was 10x + 250 ms); a 2x slowdown of the pool is for cargo bench
    // --bench text to find (docs/testing.md).
    let bound = alone_p99 * 3 + Duration::from_millis(100);
    assert!(
        p99 <= bound,
        "short prompts waited behind maximal ones: p99 {p99:?}, {alone_p99:?} alone (bound {bound:?})"
    );
    d.shutdown().await;
}
