//! Helpers shared by the daemon's integration tests: the vLLM fixtures (kept with kv-core, in
//! `crates/kv-core/tests/fixtures`), a seeded PRNG (kv-core's SplitMix64, so random tests are
//! reproducible from the seed they print), the tiny tokenizer, `../shared` lookups.
#![allow(dead_code)]

use serde_json::Value;

#[path = "../../crates/kv-core/tests/support/mod.rs"]
mod core;
pub mod dns;
pub mod envoy;
pub mod kube_api;
pub mod picker;
pub mod pod_http;
pub mod pods;
pub mod pool;
pub mod prometheus;
pub mod redis;
pub mod replica;
pub mod tls;
#[allow(unused_imports)]
pub use core::{
    budget_scenario, captured_payload, engine_scenarios, fixture, hashes, hybrid_default_runs,
    hybrid_runs, past, u32s, unhex, BudgetScenario, EngineScenario, HybridRun, Rng,
};

/// Writes a small word-level tokenizer (made here, so tests run on a fresh clone) and a
/// `tokenizer_config.json` with a chat template into `dir`. Returns its vocabulary.
pub fn tiny_tokenizer(dir: &std::path::Path) -> Vec<String> {
    use std::collections::HashMap;
    use tokenizers::models::wordlevel::WordLevel;
    use tokenizers::pre_tokenizers::whitespace::Whitespace;
    use tokenizers::processors::template::TemplateProcessing;
    std::fs::create_dir_all(dir).expect("tokenizer dir");
    let mut words: Vec<String> = ["[UNK]", "<s>", "<|user|>", "<|assistant|>", "<|end|>"]
        .iter()
        .map(|s| s.to_string())
        .collect();
    for w in "the quick brown fox jumps over lazy dog a cache prefix shared system prompt is long and \
              every request starts with it so routing matters . , ! ? you are helpful assistant answer \
              question about kubernetes pods nodes memory pressure what should i do first"
        .split_whitespace()
    {
        if !words.iter().any(|x| x == w) {
            words.push(w.to_string());
        }
    }
    let vocab: HashMap<String, u32> = words
        .iter()
        .enumerate()
        .map(|(i, w)| (w.clone(), i as u32))
        .collect();
    let model = WordLevel::builder()
        .vocab(vocab.into_iter().collect())
        .unk_token("[UNK]".into())
        .build()
        .expect("word-level model");
    let mut tokenizer = tokenizers::Tokenizer::new(model);
    tokenizer.with_pre_tokenizer(Some(Whitespace {}));
    // Like Llama-3: the completion prompt gets a BOS from the post-processor.
    tokenizer.with_post_processor(Some(
        TemplateProcessing::builder()
            .try_single("<s> $A")
            .expect("template")
            .special_tokens(vec![("<s>", 1)])
            .build()
            .expect("post-processor"),
    ));
    tokenizer
        .save(dir.join("tokenizer.json"), false)
        .expect("tokenizer.json written");
    let config = serde_json::json!({
        "bos_token": "<s>",
        "eos_token": {"content": "<|end|>"},
        "chat_template": "{{ bos_token }}{% for m in messages %}<|{{ m.role }}|> {{ m.content | trim }} <|end|> {% endfor %}{% if add_generation_prompt %}<|assistant|>{% endif %}",
    });
    std::fs::write(dir.join("tokenizer_config.json"), config.to_string()).expect("config written");
    words
}

/// A unique temporary directory for a test.
pub fn temp_dir(name: &str) -> std::path::PathBuf {
    let dir = std::env::temp_dir().join(format!(
        "kv-indexer-{name}-{}-{}",
        std::process::id(),
        std::time::SystemTime::now()
            .duration_since(std::time::UNIX_EPOCH)
            .map_or(0, |d| d.as_nanos())
    ));
    std::fs::create_dir_all(&dir).expect("temp dir");
    dir
}

/// `../shared/<rel>` when `marker` is in it. Otherwise `None`, after telling the person running
/// the tests that the caller was skipped and why; under CI (`CI=true`), which has `../shared`,
/// its absence is a failure instead.
///
/// The notice is written to the process's stderr directly: the test harness captures
/// `eprintln!` of passing tests, and a skip must not be silent.
pub fn shared(rel: &str, marker: &str, what: &str) -> Option<std::path::PathBuf> {
    use std::io::Write;
    let dir = std::path::PathBuf::from(env!("CARGO_MANIFEST_DIR"))
        .join("../shared")
        .join(rel);
    if dir.join(marker).is_file() {
        return Some(dir);
    }
    if std::env::var("CI").as_deref() == Ok("true") {
        panic!("CI must provide {}", dir.display());
    }
    let _ = writeln!(
        std::io::stderr().lock(),
        "SKIPPED {}: {} not found ({what} live in ../shared beside the project; CI runs this test)",
        std::thread::current().name().unwrap_or("a test"),
        dir.display()
    );
    None
}

/// `../shared/traces/mooncake`, or `None` after saying why the caller is skipped.
pub fn shared_traces() -> Option<std::path::PathBuf> {
    shared("traces/mooncake", "stats.json", "the Mooncake traces")
}

/// `../shared/tokenizers/<name>`, or `None` after saying why the caller is skipped.
pub fn shared_tokenizer(name: &str) -> Option<std::path::PathBuf> {
    shared(
        &format!("tokenizers/{name}"),
        "tokenizer.json",
        "the real tokenizers",
    )
}

/// `../shared/tokenizers/<name>` and its `samples.json` (text, ids and a chat as the reference
/// implementation encodes them), or `None` after saying why the caller is skipped.
pub fn shared_samples(name: &str) -> Option<(std::path::PathBuf, Value)> {
    let dir = shared_tokenizer(name)?;
    let text = std::fs::read_to_string(dir.join("samples.json")).expect("samples.json");
    let samples = serde_json::from_str(&text).expect("samples.json is JSON");
    Some((dir, samples))
}

/// Runs `kv-indexer ARGS --json`, requires success and returns the parsed output.
pub fn kv_indexer_json<S: AsRef<std::ffi::OsStr>>(args: &[S]) -> Value {
    let out = std::process::Command::new(env!("CARGO_BIN_EXE_kv-indexer"))
        .args(args)
        .arg("--json")
        .output()
        .expect("run kv-indexer");
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    serde_json::from_slice(&out.stdout).expect("JSON output")
}

/// A configuration whose listeners are all on loopback with ephemeral ports (gRPC, metrics,
/// the ZMQ bind endpoint), otherwise the defaults.
pub fn loopback_config() -> kv_indexer::config::Config {
    let mut c = kv_indexer::config::Config::default();
    c.server.grpc_addr = "127.0.0.1:0".into();
    c.server.metrics_addr = "127.0.0.1:0".into();
    c.kv_events_config.zmq_endpoint = "tcp://127.0.0.1:0".into();
    c
}

/// The value of the first sample on a metrics page whose line starts with `name_and_labels`
/// (0 when there is none).
pub fn metric(page: &str, name_and_labels: &str) -> f64 {
    page.lines()
        .find(|l| l.starts_with(name_and_labels))
        .and_then(|l| l.rsplit(' ').next())
        .and_then(|v| v.parse().ok())
        .unwrap_or(0.0)
}

/// Blocks of `tokens` that `pod` holds, by `ScorePods` over gRPC (0 while `model` is unknown).
pub async fn matched_blocks(
    client: &mut kv_proto::kvindexer_v1::kv_indexer_client::KvIndexerClient<
        tonic::transport::Channel,
    >,
    model: &str,
    tokens: &[u32],
    pod: &str,
) -> u32 {
    use kv_proto::kvindexer_v1::{score_pods_request::Input, ScorePodsRequest, TokenIds};
    let r = client
        .score_pods(ScorePodsRequest {
            model: model.into(),
            input: Some(Input::Tokens(TokenIds {
                ids: tokens.to_vec(),
            })),
            pods: vec![pod.into()],
            ..Default::default()
        })
        .await;
    match r {
        Ok(r) => r
            .into_inner()
            .scores
            .first()
            .map_or(0, |s| s.matched_blocks),
        Err(s) if s.code() == tonic::Code::NotFound => 0, // model not seen yet
        Err(s) => panic!("ScorePods failed: {s}"),
    }
}

/// A gRPC client of a daemon started in the test.
pub async fn client(
    d: &kv_indexer::daemon::RunningDaemon,
) -> kv_proto::kvindexer_v1::kv_indexer_client::KvIndexerClient<tonic::transport::Channel> {
    kv_proto::kvindexer_v1::kv_indexer_client::KvIndexerClient::connect(format!(
        "http://{}",
        d.grpc_addr
    ))
    .await
    .expect("gRPC connects")
}

/// A ROUTER bound on loopback to stand for vLLM's replay socket, and the daemon's
/// `replayEndpointTemplate` that reaches it (`tcp://{ip}:<its port>`).
pub async fn replay_router() -> (zeromq::RouterSocket, String) {
    use zeromq::Socket;
    let mut router = zeromq::RouterSocket::new();
    let endpoint = router
        .bind("tcp://127.0.0.1:0")
        .await
        .expect("ROUTER binds")
        .to_string();
    let port = endpoint.rsplit(':').next().expect("port").to_owned();
    (router, format!("tcp://{{ip}}:{port}"))
}

/// `GET path` on a loopback port (HTTP/1.0: the body is neither chunked nor kept alive), given
/// 10 s: status and body, `None` when nothing answers.
pub async fn http_get(port: u16, path: &str) -> Option<(u16, String)> {
    use tokio::io::{AsyncReadExt, AsyncWriteExt};
    let mut s = tokio::net::TcpStream::connect(("127.0.0.1", port))
        .await
        .ok()?;
    let request = format!("GET {path} HTTP/1.0\r\nHost: 127.0.0.1\r\n\r\n");
    s.write_all(request.as_bytes()).await.ok()?;
    let mut response = String::new();
    tokio::time::timeout(
        std::time::Duration::from_secs(10),
        s.read_to_string(&mut response),
    )
    .await
    .ok()?
    .ok()?;
    let (head, body) = response.split_once("\r\n\r\n")?;
    let code = head.split_whitespace().nth(1)?.parse().ok()?;
    Some((code, body.to_owned()))
}

/// The simulator tests' small workload (`tests/simulate.rs`, `tests/simulate_hybrid.rs`): 24
/// system prompts x 5 questions (2,000 + 200 tokens, 50 out), 4 req/s, each prompt once.
pub fn small_shared_prefix_spec() -> kv_lab::simulate::workloads::SharedPrefix {
    use kv_lab::simulate::workloads::{Sampling, SharedPrefix};
    SharedPrefix {
        groups: 24,
        prompts_per_group: 5,
        system_tokens: 2_000,
        question_tokens: 200,
        output_tokens: 50,
        rate_per_s: 4.0,
        sampling: Sampling::EachOnce,
        duration_s: 0.0,
        burst: 1,
    }
}
