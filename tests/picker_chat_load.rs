//! `kv-indexer loadgen --ext-proc --chat-tokenizer` (the picker benchmark's chat mode) against
//! an in-process daemon with the real Qwen3 tokenizer: the load generator renders and
//! tokenizes its chats as the daemon does, its pods publish those blocks, and the picks it
//! sends as `/v1/chat/completions` bodies find them in the index. A benchmark whose prompts
//! never match the published blocks would measure nothing.
//!
//! Without `../shared/tokenizers/qwen3` this test prints SKIPPED; under CI (`CI=true`) a
//! missing directory is a failure.

mod support;

use std::path::{Path, PathBuf};
use std::process::Command;

use kv_indexer::config::Config;
use support::picker::{Fleet, BLOCK, MODEL};

/// Runs `kv-indexer loadgen` in chat mode against `fleet`'s daemon; its output.
async fn chat_load(fleet: &Fleet, dir: PathBuf, pod_metrics: &str) -> std::process::Output {
    let d = &fleet.daemon;
    let zmq = d.zmq_endpoint.clone().expect("bind mode");
    let picker = d.picker_addr.expect("the picker is on");
    let args: Vec<String> = [
        "loadgen",
        "--zmq-endpoint",
        &zmq,
        "--grpc",
        &format!("http://{}", d.grpc_addr),
        "--metrics",
        &d.metrics_addr.to_string(),
        "--ext-proc",
        &format!("http://{picker}"),
        "--pod-metrics",
        pod_metrics,
        "--model",
        MODEL,
        "--seed",
        "12345",
        "--block-size",
        &BLOCK.to_string(),
        "--pods",
        "4",
        "--documents",
        "8",
        "--prompt-blocks",
        "64",
        "--rate",
        "20000",
        "--duration",
        "2",
        "--baseline",
        "1",
        "--score-concurrency",
        "2",
        "--json",
    ]
    .iter()
    .map(|s| s.to_string())
    .collect();
    let bin = env!("CARGO_BIN_EXE_kv-indexer");
    tokio::task::spawn_blocking(move || {
        Command::new(bin)
            .args(&args)
            .arg("--chat-tokenizer")
            .arg(&dir)
            .output()
            .expect("loadgen runs")
    })
    .await
    .expect("joins")
}

/// A free loopback port for the load generator's pod metrics pages, and the daemon's picker
/// config scraping it.
fn config(tokenizer: Option<&Path>) -> (Config, String) {
    let pod_metrics = {
        let l = std::net::TcpListener::bind("127.0.0.1:0").expect("binds");
        l.local_addr().expect("addr").to_string()
    };
    let mut c = support::picker::config(tokenizer);
    c.endpoint_picker.metrics_url_template = format!("http://{pod_metrics}/{{pod}}/metrics");
    (c, pod_metrics)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn chat_picks_find_the_prefixes_the_pods_published() {
    let Some(dir) = support::shared_tokenizer("qwen3") else {
        return;
    };
    let (c, pod_metrics) = config(Some(&dir));
    let fleet = Fleet::start(c).await;
    let out = chat_load(&fleet, dir, &pod_metrics).await;
    let stderr = String::from_utf8_lossy(&out.stderr);
    eprintln!("{stderr}");
    assert!(out.status.success(), "{stderr}");
    // 64 blocks of 16 tokens: the rendered chats pass 1,024 tokens by less than a turn (120
    // words).
    let sizes: Vec<usize> = stderr
        .split("prepared 8 chats of ")
        .nth(1)
        .and_then(|rest| rest.split(' ').next())
        .map(|range| range.split('-').filter_map(|n| n.parse().ok()).collect())
        .unwrap_or_default();
    assert!(
        sizes.len() == 2 && sizes[0] >= 1024 && sizes[1] < 1024 + 300,
        "{stderr}"
    );
    // The daemon, asked to score the first chat, matched every block the load generator's pod
    // published for it: the same token ids over the whole prompt.
    assert!(stderr.contains("the daemon's tokens agree"), "{stderr}");
    let report: serde_json::Value = serde_json::from_slice(&out.stdout).expect("JSON report");
    eprintln!("{report}");
    assert_eq!(report["calls"], "picks", "{report}");
    let loaded = &report["score_under_load"];
    assert!(loaded["calls"].as_u64().unwrap_or(0) > 0, "{report}");
    // With --ext-proc, the share of requests answered with a pick.
    assert!(
        loaded["avg_matched_blocks"].as_f64().unwrap_or(0.0) > 0.9,
        "{report}"
    );
    // The picks' index walks found the chats' prefixes (the system prompts at least).
    assert!(report["lookups"].as_f64().unwrap_or(0.0) > 0.0, "{report}");
    assert!(
        report["lookup_hit_share"].as_f64().unwrap_or(0.0) > 0.5,
        "{report}"
    );
    let page = fleet.daemon.metrics_text();
    assert!(
        support::metric(
            &page,
            "kvindexer_score_latency_seconds_count{input=\"chat\"}"
        ) > 0.0,
        "the picks were not scored as chats"
    );
    assert!(
        support::metric(&page, "kvindexer_picker_picks_total{outcome=\"picked\"}") > 0.0,
        "{}",
        support::picker::picks_lines(&page)
    );
    fleet.daemon.shutdown().await;
}

/// The negative control: a daemon without the model's tokenizer would pick on load alone; the
/// load generator's check before the clock starts says so and fails the run instead of
/// reporting figures that measured nothing.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_daemon_that_cannot_tokenize_the_chats_fails_the_run() {
    let Some(dir) = support::shared_tokenizer("qwen3") else {
        return;
    };
    let (c, pod_metrics) = config(None);
    let fleet = Fleet::start(c).await;
    let out = chat_load(&fleet, dir, &pod_metrics).await;
    let stderr = String::from_utf8_lossy(&out.stderr);
    eprintln!("{stderr}");
    assert!(!out.status.success(), "{stderr}");
    assert!(stderr.contains("no prefix matched"), "{stderr}");
    fleet.daemon.shutdown().await;
}
