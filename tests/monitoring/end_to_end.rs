//! End to end: the daemon, and a replica whose Redis is down, scraped every second by a real
//! Prometheus that evaluates the shipped rules every second (a copy with every `for:` at 0s,
//! so an alert shows at once; the shipped file is unchanged). A driver publishes over a real
//! ZMQ socket, round after round, a pod for each condition an alert watches that one machine
//! can reach, and calls ScorePods, RecordRouting and the endpoint picker (its pool a static list
//! of a live pod and a dead address), until each of those alerts is pending or
//! firing; then every dashboard query, its variables substituted, must evaluate and return
//! series. Replication lag, dropped appends, old snapshots and slow reads cannot be caused here
//! on purpose: their unit tests (promtool) fire them.

use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

use bytes::Bytes;
use envoy_types::pb::envoy::service::ext_proc::v3::external_processor_client::ExternalProcessorClient;
use kv_core::{
    encode_batch, mix64, BlockHash, BlockStored, EngineHash, EngineHashes, EventBatch, KvEvent,
    Medium,
};
use kv_indexer::config::{Config, ConfigDuration, ModelConfig};
use kv_indexer::daemon::{self, RunningDaemon};
use kv_proto::kvindexer_v1::kv_indexer_client::KvIndexerClient;
use kv_proto::kvindexer_v1::{
    score_pods_request::Input, RecordRoutingRequest, ScorePodsRequest, TokenIds,
};
use serde_json::Value;
use tonic::transport::Channel;
use zeromq::{SocketSend, ZmqMessage};

use crate::support;
use support::pods::{payload_message, ranked_message, stored_message};
use support::prometheus::PrometheusServer;

/// The `namespace` label the scrape adds, as Kubernetes service discovery would.
const NAMESPACE: &str = "kvtest";
/// The model most pods publish for (`engineHashes: auto`).
const MODEL: &str = "mon/model";
/// A model configured with `engineHashes: aligned`: mismatched hashes are counted.
const ALIGNED: &str = "mon/aligned";
const MISMATCH: &str = "10.3.0.1:8000";
const REFUSED: &str = "10.3.0.2:8000";
const GAPPER: &str = "10.3.0.3:8000";
const RANKER: &str = "10.3.0.4:8000";
const EVICTOR: &str = "10.3.0.5:8000";
const TRANSLATED: &str = "10.3.0.6:8000";
const FLOODER: &str = "10.3.0.7:8000";
const GARBAGE: &str = "10.3.0.8:8000";

/// Waits for the alerts, then for the dashboard's queries: limits for a busy machine (each
/// is usually met in seconds).
const ALERTS_WITHIN: Duration = Duration::from_secs(45);
const QUERIES_WITHIN: Duration = Duration::from_secs(20);

fn config() -> Config {
    let mut c = support::loopback_config();
    // 200 new blocks a round fill 1,000 keys within a few rounds: evictions under size.
    c.indexer_config.kv_block_index_config.in_memory_config.size = 1_000;
    // The smallest share: the flooder's bursts pass it.
    c.kv_events_config.queue_bytes_per_pod = 64 << 10;
    c.server.enable_record_routing = true;
    let aligned = ModelConfig {
        engine_hashes: Some(EngineHashes::Aligned),
        ..Default::default()
    };
    c.models.insert(ALIGNED.into(), aligned);
    c
}

/// A replica whose Redis never answers (nothing listens on its port).
fn replica_config() -> Config {
    let mut c = support::loopback_config();
    c.replication.enabled = true;
    c.replication.redis_url = format!("redis://127.0.0.1:{}", support::redis::free_port());
    c.replication.replica_id = "replica-without-redis".into();
    c.replication.startup_timeout = ConfigDuration(Duration::from_secs(1));
    c
}

/// The shipped rules with every `for:` at 0s.
fn rules_firing_at_once() -> String {
    let text = super::read("deploy/monitoring/kv-indexer-rules.yaml");
    let mut rules: serde_yaml::Value = serde_yaml::from_str(&text).expect("rules are YAML");
    let groups = rules["groups"].as_sequence_mut().expect("groups");
    for group in groups {
        for rule in group["rules"].as_sequence_mut().expect("rules") {
            rule["for"] = "0s".into();
        }
    }
    serde_yaml::to_string(&rules).expect("YAML")
}

fn hash(kind: u64, round: u64, i: u64) -> BlockHash {
    BlockHash::new(mix64(kind << 56 ^ round << 20 ^ i))
}

/// What a test engine publishes for `hashes`: the same values (whether they are the keys of
/// the tokens they come with is what the daemon finds out).
fn published(hashes: &[BlockHash]) -> Vec<EngineHash> {
    hashes.iter().map(|&k| EngineHash::aligned(k)).collect()
}

/// One `BlockStored` run from the prompt's start with `tokens` (GPU, rank 0).
fn root_run(hashes: Vec<BlockHash>, tokens: Vec<u32>, block_size: u32) -> Vec<u8> {
    let stored = BlockStored {
        block_hashes: published(&hashes),
        token_ids: tokens,
        block_size,
        medium: Some(Medium::Gpu),
        ..Default::default()
    };
    encode_batch(&EventBatch {
        ts: 1.7e9,
        events: vec![KvEvent::BlockStored(Box::new(stored))],
        data_parallel_rank: Some(0),
    })
}

/// Publishes every condition once a round.
struct Driver {
    publisher: zeromq::PubSocket,
    grpc: KvIndexerClient<Channel>,
    /// The endpoint picker's ext_proc client: a pick a round.
    picker: ExternalProcessorClient<Channel>,
    /// The flooder's payload: one run of 500 blocks, the same every message.
    flood: Vec<u8>,
    round: u64,
}

impl Driver {
    async fn new(d: &RunningDaemon) -> Self {
        let blocks: Vec<BlockHash> = (0..500).map(|i| hash(7, 0, i)).collect();
        let picker = d.picker_addr.expect("the picker is on");
        Self {
            publisher: support::pods::connect(d).await,
            grpc: support::client(d).await,
            picker: ExternalProcessorClient::connect(format!("http://{picker}"))
                .await
                .expect("ext_proc connects"),
            flood: encode_batch(&EventBatch::stored_on_gpu(
                1.7e9,
                0,
                &published(&blocks),
                16,
            )),
            round: 0,
        }
    }

    async fn round(&mut self) {
        let n = self.round;
        self.round += 1;
        let tokens = |k: u64| -> Vec<u32> {
            (0..16)
                .map(|i| (mix64(k << 56 ^ n << 8 ^ i) % 50_000) as u32)
                .collect()
        };
        let refused = published(&[hash(2, n, 0)]);
        let refused = encode_batch(&EventBatch::stored_on_gpu(1.7e9, 0, &refused, 24));
        let evicted: Vec<BlockHash> = (0..200).map(|i| hash(5, n, i)).collect();
        let mut messages = vec![
            // Hashes that are not vLLM's for the tokens, under engineHashes: aligned.
            payload_message(
                ALIGNED,
                MISMATCH,
                n,
                &root_run(vec![hash(1, n, 0)], tokens(1), 16),
            ),
            // Blocks of 24 tokens under blockSize 16: refused. Twice: the second a duplicate.
            payload_message(MODEL, REFUSED, n, &refused),
            payload_message(MODEL, REFUSED, n, &refused),
            // Every other sequence number: a gap a round, lost (no replay endpoint).
            stored_message(MODEL, GAPPER, 2 * n, &[hash(3, n, 0)]),
            ranked_message(MODEL, RANKER, -1, n, &[hash(4, n, 0)]),
            stored_message(MODEL, EVICTOR, n, &evicted),
            // An auto engine whose hashes differ (translated), two hashes and tokens for one.
            payload_message(
                MODEL,
                TRANSLATED,
                n,
                &root_run(vec![hash(6, n, 0), hash(6, n, 1)], tokens(6), 16),
            ),
            // Garbage: a topic without its model, and a payload that is not msgpack.
            ZmqMessage::try_from(vec![
                Bytes::from_static(b"kv@garbage"),
                Bytes::copy_from_slice(&n.to_be_bytes()),
                Bytes::from_static(b"x"),
            ])
            .expect("frames"),
            payload_message(MODEL, GARBAGE, n, &[0xc1]),
        ];
        // A burst of 64 x 4.5 KB, far past the flooder's 64 KiB share: its queued messages shed.
        for i in 0..64 {
            messages.push(payload_message(MODEL, FLOODER, n * 64 + i, &self.flood));
        }
        for m in messages {
            self.publisher.send(m).await.expect("send");
        }
        // Reads (NOT_FOUND until the model's first events: ignored).
        let ids: Vec<u32> = (0..64).collect();
        let _ = self
            .grpc
            .score_pods(ScorePodsRequest {
                model: MODEL.into(),
                input: Some(Input::Tokens(TokenIds { ids: ids.clone() })),
                pods: vec![EVICTOR.into(), TRANSLATED.into()],
                ..Default::default()
            })
            .await;
        let _ = self
            .grpc
            .record_routing(RecordRoutingRequest {
                model: MODEL.into(),
                tokens: Some(TokenIds { ids: ids.clone() }),
                pod: EVICTOR.into(),
                ..Default::default()
            })
            .await;
        // A pick among the static pool (its live pod: the other never answers).
        let body = serde_json::json!({"model": MODEL, "prompt": ids, "max_tokens": 1}).to_string();
        let mut request = vec![support::picker::headers(
            "/v1/completions",
            None,
            None,
            false,
        )];
        request.extend(support::picker::body(body.as_bytes(), 4096));
        support::picker::exchange(&mut self.picker, request).await;
    }
}

async fn drive(mut driver: Driver, stop: Arc<AtomicBool>) {
    while !stop.load(Ordering::Relaxed) {
        driver.round().await;
        tokio::time::sleep(Duration::from_millis(300)).await;
    }
}

/// Whether `alert` is `name`, pending or firing, in the test's namespace, with `labels`.
fn is(alert: &Value, name: &str, labels: &[(&str, &str)]) -> bool {
    let l = &alert["labels"];
    l["alertname"] == name
        && l["namespace"] == NAMESPACE
        && ["pending", "firing"].contains(&alert["state"].as_str().unwrap_or_default())
        && labels.iter().all(|(k, v)| l[*k] == *v)
}

/// Non-zero kvindexer_ samples of both daemons (for failure messages).
fn nonzero_samples(daemons: &[&RunningDaemon]) -> String {
    daemons
        .iter()
        .flat_map(|d| {
            d.metrics_text()
                .lines()
                .filter(|l| l.starts_with("kvindexer_") && !l.contains("_bucket"))
                .filter(|l| !l.ends_with(" 0"))
                .map(str::to_owned)
                .collect::<Vec<_>>()
        })
        .collect::<Vec<_>>()
        .join("\n")
}

/// `expr` with the dashboard's variables as Grafana would substitute them.
fn substituted(expr: &str) -> String {
    expr.replace("$namespace", NAMESPACE)
        .replace("$model", "mon/.+")
        .replace("$__rate_interval", "1m")
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_real_prometheus_sees_each_alert_and_every_dashboard_query() {
    if !support::prometheus::available(
        "a_real_prometheus_sees_each_alert_and_every_dashboard_query",
    ) {
        return;
    }
    // The endpoint picker on, its static pool a live pod and an address nothing answers on (it
    // leaves the candidates: the pool's panels have series).
    let live = support::picker::FakePod::start().await;
    let mut c = config();
    c.endpoint_picker.enabled = true;
    c.endpoint_picker.addr = "127.0.0.1:0".into();
    c.endpoint_picker.endpoints = vec![
        live.name.clone(),
        format!("127.0.0.1:{}", support::redis::free_port()),
    ];
    let d = daemon::start(c).await.expect("daemon starts");
    let replica = daemon::start(replica_config())
        .await
        .expect("replica starts without Redis");
    let targets = [d.metrics_addr.to_string(), replica.metrics_addr.to_string()];
    let prometheus = PrometheusServer::start(
        &targets,
        &[("namespace", NAMESPACE)],
        &rules_firing_at_once(),
    )
    .await;
    let stop = Arc::new(AtomicBool::new(false));
    let driver = tokio::spawn(drive(Driver::new(&d).await, stop.clone()));

    let expected: [(&str, Vec<(&str, &str)>); 9] = [
        (
            "KvIndexerHashMismatch",
            vec![("pod", MISMATCH), ("model", ALIGNED)],
        ),
        ("KvIndexerEngineRefused", vec![("model", MODEL)]),
        ("KvIndexerMessagesLost", vec![("pod", GAPPER)]),
        ("KvIndexerSequenceGaps", vec![("pod", GAPPER)]),
        ("KvIndexerQueueShedding", vec![("reason", "over_share")]),
        ("KvIndexerBlocksDropped", vec![("reason", "uncovered_hash")]),
        ("KvIndexerPublisherRankOutOfRange", vec![("pod", RANKER)]),
        ("KvIndexerIndexEvicting", vec![("model", MODEL)]),
        ("KvIndexerRedisErrors", vec![("instance", &targets[1])]),
    ];
    let started = Instant::now();
    let (alerts, missing) = loop {
        let alerts = prometheus.alerts().await;
        let missing: Vec<String> = expected
            .iter()
            .filter(|(name, labels)| !alerts.iter().any(|a| is(a, name, labels)))
            .map(|(name, labels)| format!("{name} {labels:?}"))
            .collect();
        if missing.is_empty() || started.elapsed() > ALERTS_WITHIN {
            break (alerts, missing);
        }
        tokio::time::sleep(Duration::from_secs(1)).await;
    };
    let rules = prometheus.rules().await;
    assert!(
        missing.is_empty(),
        "never pending or firing: {missing:#?}\nalerts: {alerts:#?}\nrules: {rules:#?}\nsamples:\n{}",
        nonzero_samples(&[&d, &replica])
    );
    eprintln!(
        "every reachable alert pending or firing after {:?}",
        started.elapsed()
    );
    // A translated engine's differing hashes are not mismatches; a replica without Redis
    // neither lags nor drops appends (it has none) nor reports an old snapshot.
    for a in &alerts {
        let name = a["labels"]["alertname"].as_str().unwrap_or_default();
        if name == "KvIndexerHashMismatch" {
            assert_eq!(a["labels"]["pod"], MISMATCH, "{a:#}");
        }
        let quiet = [
            "KvIndexerReplicationLag",
            "KvIndexerReplicationAppendsDropped",
            "KvIndexerSnapshotTooOld",
        ];
        assert!(!quiet.contains(&name), "{a:#}");
    }
    assert_eq!(rules.len(), super::alert_rules().len(), "every rule loaded");
    for r in &rules {
        assert_eq!(r["health"], "ok", "{r:#}");
    }

    // Every dashboard query evaluates and returns series.
    let mut pending: Vec<(String, String)> = super::queries(&super::dashboard())
        .into_iter()
        .map(|(title, expr)| (title, substituted(&expr)))
        .collect();
    let started = Instant::now();
    let failures = loop {
        let mut failures = Vec::new();
        let mut again = Vec::new();
        for (title, expr) in pending {
            match prometheus.query(&expr).await {
                Ok(series) if !series.is_empty() => continue,
                Ok(_) => failures.push(format!("{title}: no series: {expr}")),
                Err(e) => failures.push(format!("{title}: {e}: {expr}")),
            }
            again.push((title, expr));
        }
        pending = again;
        if pending.is_empty() || started.elapsed() > QUERIES_WITHIN {
            break failures;
        }
        tokio::time::sleep(Duration::from_secs(1)).await;
    };
    assert!(
        failures.is_empty(),
        "dashboard queries:\n{}",
        failures.join("\n")
    );

    // The variables' label_values(...) list this namespace and its models.
    for var in super::dashboard()["templating"]["list"]
        .as_array()
        .expect("variables")
    {
        let Some(q) = var["query"]["query"].as_str() else {
            continue;
        };
        let args = q
            .strip_prefix("label_values(")
            .and_then(|a| a.strip_suffix(')'))
            .expect("label_values(selector, label)");
        let (selector, label) = args.rsplit_once(", ").expect("two arguments");
        let values = prometheus
            .api(
                &format!("label/{label}/values"),
                &[("match[]", &substituted(selector))],
            )
            .await
            .unwrap_or_else(|e| panic!("{q}: {e}"));
        let want: &[&str] = match label {
            "namespace" => &[NAMESPACE],
            _ => &[ALIGNED, MODEL],
        };
        assert_eq!(values, serde_json::json!(want), "{q}");
    }

    stop.store(true, Ordering::Relaxed);
    driver.await.expect("driver");
    drop(prometheus);
    replica.shutdown().await;
    d.shutdown().await;
}
