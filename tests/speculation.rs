//! Routing runs ahead of events, over real sockets: `ScorePods` hands out a prompt key,
//! `RecordRouting` makes the chosen pod score as holding the prompt before any event (the
//! speculative entries), its `BlockStored` over ZeroMQ confirms them, they expire without
//! events, and a pod that publishes nothing is scored by its recorded routings alone. Bad
//! requests get a clear gRPC status.

mod support;

use std::time::{Duration, Instant};

use kv_core::BlockHash;
use kv_indexer::config::ConfigDuration;
use kv_indexer::daemon::{self, RunningDaemon};
use kv_proto::kvindexer_v1::kv_indexer_client::KvIndexerClient;
use kv_proto::kvindexer_v1::{
    score_pods_request::Input, ListPodsRequest, PodInfo, PodScore, RecordRoutingRequest,
    ScorePodsRequest, ScorePodsResponse, TokenIds,
};
use support::pods::{connect, eventually};
use tonic::transport::Channel;
use tonic::Code;
use zeromq::{PubSocket, SocketSend, ZmqMessage};

const MODEL: &str = "spec/model";
/// The speculative TTL: a recorded routing below must be confirmed before it runs out (record,
/// score, list, publish, apply: 35 ms in a debug build on a quiet machine, 2026-11-26; 2 s
/// leaves a busy machine room), and the expiry checks wait it out.
const TTL: Duration = Duration::from_secs(2);

/// A prompt of `blocks` full 16-token blocks, distinct per `seed`.
/// `blocks` full blocks and one token more: vLLM recomputes a prompt's last token, so every
/// full block of such a prompt can be reused.
fn prompt(seed: u32, blocks: u32) -> Vec<u32> {
    (0..blocks * 16 + 1).map(|i| seed * 100_000 + i).collect()
}

async fn start() -> RunningDaemon {
    let mut c = support::loopback_config();
    c.scoring.speculative_ttl = ConfigDuration(TTL);
    c.server.enable_record_routing = true;
    c.models.insert(MODEL.into(), Default::default());
    daemon::start(c).await.expect("daemon starts")
}

fn stored(pod: &str, seq: u64, hashes: &[BlockHash]) -> ZmqMessage {
    support::pods::stored_message(MODEL, pod, seq, hashes)
}

/// Publishes `hashes` as `pod`'s message `seq` until the daemon applied it (slow joiner).
async fn publish(p: &mut PubSocket, d: &RunningDaemon, pod: &str, seq: u64, hashes: &[BlockHash]) {
    let last = *hashes.last().expect("a block");
    for _ in 0..250 {
        let _ = p.send(stored(pod, seq, hashes)).await;
        tokio::time::sleep(Duration::from_millis(20)).await;
        let model = d.indexer.model(MODEL).expect("model");
        let engines = model.index().directory().engines_of(pod).to_vec();
        if model
            .index()
            .lookup(last)
            .iter()
            .any(|(e, _)| engines.contains(e))
        {
            return;
        }
    }
    panic!("{pod}'s message {seq} never arrived");
}

fn hashes_of(d: &RunningDaemon, tokens: &[u32]) -> Vec<BlockHash> {
    d.indexer
        .block_hashes(MODEL, tokens, None, None)
        .expect("model")
}

async fn score(
    c: &mut KvIndexerClient<Channel>,
    tokens: &[u32],
    pods: &[&str],
) -> ScorePodsResponse {
    c.score_pods(ScorePodsRequest {
        model: MODEL.into(),
        input: Some(Input::Tokens(TokenIds {
            ids: tokens.to_vec(),
        })),
        pods: pods.iter().map(|p| p.to_string()).collect(),
        ..Default::default()
    })
    .await
    .expect("ScorePods")
    .into_inner()
}

fn of<'a>(r: &'a ScorePodsResponse, pod: &str) -> &'a PodScore {
    r.scores
        .iter()
        .find(|s| s.pod == pod)
        .unwrap_or_else(|| panic!("{pod} not scored: {r:?}"))
}

async fn record(
    c: &mut KvIndexerClient<Channel>,
    key: &[u8],
    tokens: Option<&[u32]>,
    pod: &str,
) -> Result<u32, tonic::Status> {
    c.record_routing(RecordRoutingRequest {
        model: MODEL.into(),
        prompt_key: key.to_vec(),
        tokens: tokens.map(|t| TokenIds { ids: t.to_vec() }),
        pod: pod.into(),
        ..Default::default()
    })
    .await
    .map(|r| r.into_inner().blocks)
}

async fn list(c: &mut KvIndexerClient<Channel>) -> Vec<PodInfo> {
    c.list_pods(ListPodsRequest {
        model: MODEL.into(),
    })
    .await
    .expect("ListPods")
    .into_inner()
    .pods
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_recorded_routing_scores_before_events_then_is_confirmed_or_expires() {
    let d = start().await;
    let mut c = support::client(&d).await;
    let mut p = connect(&d).await;
    let (a, b) = ("10.0.0.1:8000", "10.0.0.2:8000");
    let tokens = prompt(1, 8);
    let hashes = hashes_of(&d, &tokens);
    // Both pods publish (a holds the first 2 blocks); nobody holds the rest.
    publish(&mut p, &d, a, 0, &hashes[..2]).await;
    publish(&mut p, &d, b, 0, &hashes_of(&d, &prompt(9, 1))).await;

    // Score: a leads with 2 blocks. The response names the prompt.
    let first = score(&mut c, &tokens, &[a, b]).await;
    assert_eq!(
        (of(&first, a).matched_blocks, of(&first, b).matched_blocks),
        (2, 0)
    );
    assert_eq!(first.prompt_key.len(), 16);

    // The gateway sends it to b: b now scores as holding all 8, before any event.
    let recorded = Instant::now();
    assert_eq!(
        record(&mut c, &first.prompt_key, None, b)
            .await
            .expect("record"),
        8
    );
    let again = score(&mut c, &tokens, &[a, b]).await;
    assert_eq!(again.scores[0].pod, b, "{again:?}");
    assert_eq!(
        (
            of(&again, b).matched_blocks,
            of(&again, b).speculative_blocks
        ),
        (8, 8)
    );
    assert_eq!(
        of(&again, b).score,
        8.0,
        "speculative weight 1.0 by default"
    );
    assert_eq!(of(&again, a).speculative_blocks, 0);
    let listed = list(&mut c).await;
    let b_info = listed.iter().find(|i| i.pod == b).expect("b listed");
    assert_eq!(
        (b_info.speculative_records, b_info.speculative_blocks),
        (1, 8)
    );
    assert!(!b_info.speculative_fallback);

    // b's events arrive: the entries are real now, nothing speculative is left.
    publish(&mut p, &d, b, 1, &hashes).await;
    eventually(Duration::from_secs(5), "never confirmed", || async {
        score(&mut c.clone(), &tokens, &[b]).await.scores[0].speculative_blocks == 0
    })
    .await;
    let confirmed = score(&mut c, &tokens, &[b]).await;
    assert_eq!(confirmed.scores[0].matched_blocks, 8);
    let page = d.metrics_text();
    assert_eq!(
        support::metric(
            &page,
            &format!(
                "kvindexer_speculative_records_ended{{model=\"{MODEL}\",reason=\"confirmed\"}}"
            )
        ),
        1.0,
        "{page}"
    );
    // Confirmed (above), so not expired: the events came within the TTL.
    eprintln!("confirmed {:?} after it was recorded", recorded.elapsed());

    // Recorded for a (by tokens, no key), never confirmed: it counts until the TTL, then a is
    // back to its 2 real blocks.
    let other = prompt(2, 6);
    let other_hashes = hashes_of(&d, &other);
    publish(&mut p, &d, a, 1, &other_hashes[..1]).await;
    let recorded = Instant::now();
    assert_eq!(
        record(&mut c, &[], Some(&other), a).await.expect("record"),
        5
    );
    let before = score(&mut c, &other, &[a]).await;
    assert_eq!(
        (
            before.scores[0].matched_blocks,
            before.scores[0].speculative_blocks
        ),
        (6, 5)
    );
    let took = eventually(Duration::from_secs(10), "never expired", || async {
        score(&mut c.clone(), &other, &[a]).await.scores[0].speculative_blocks == 0
    })
    .await;
    assert!(
        recorded.elapsed() >= TTL,
        "expired after {took:?}, before the TTL ({TTL:?})"
    );
    assert_eq!(
        score(&mut c, &other, &[a]).await.scores[0].matched_blocks,
        1
    );
    drop(p);
    d.shutdown().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_pod_without_events_is_scored_by_its_recorded_routings_alone() {
    let d = start().await;
    let mut c = support::client(&d).await;
    let silent = "10.0.0.9:8000";
    let tokens = prompt(3, 5);
    // Never published: as a candidate it scores 0, and the key remembers it was one.
    let first = score(&mut c, &tokens, &[silent]).await;
    assert_eq!(of(&first, silent).matched_blocks, 0);
    assert_eq!(
        record(&mut c, &first.prompt_key, None, silent)
            .await
            .expect("record"),
        5
    );
    let after = score(&mut c, &tokens, &[silent]).await;
    assert_eq!(
        (
            of(&after, silent).matched_blocks,
            of(&after, silent).speculative_blocks
        ),
        (5, 5)
    );
    // Listed among every pod too, and in ListPods as a fallback pod.
    let all = score(&mut c, &tokens, &[]).await;
    assert_eq!(of(&all, silent).matched_blocks, 5);
    let info = list(&mut c).await;
    assert_eq!(info.len(), 1, "{info:?}");
    assert!(info[0].speculative_fallback, "{info:?}");
    assert_eq!(
        (info[0].speculative_records, info[0].speculative_blocks),
        (1, 5)
    );
    // No events will confirm it, so no TTL: still there well past it.
    tokio::time::sleep(TTL * 2).await;
    assert_eq!(
        score(&mut c, &tokens, &[silent]).await.scores[0].matched_blocks,
        5
    );
    let page = d.metrics_text();
    assert_eq!(
        support::metric(
            &page,
            &format!("kvindexer_speculative_fallback_pods{{model=\"{MODEL}\"}}")
        ),
        1.0,
        "{page}"
    );
    // Known now: a later routing may send tokens instead of a key.
    assert_eq!(
        record(&mut c, &[], Some(&prompt(4, 2)), silent)
            .await
            .expect("record"),
        2
    );
    d.shutdown().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn record_routing_is_closed_unless_configured() {
    let d = daemon::start(support::loopback_config())
        .await
        .expect("daemon starts");
    let mut c = support::client(&d).await;
    let status = record(&mut c, &[], Some(&prompt(1, 2)), "10.0.0.1:8000")
        .await
        .expect_err("closed by default");
    assert_eq!(status.code(), Code::PermissionDenied);
    assert!(
        status.message().contains("server.enableRecordRouting"),
        "{status}"
    );
    d.shutdown().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn bad_routing_records_get_a_clear_status() {
    let d = start().await;
    let mut c = support::client(&d).await;
    let tokens = prompt(5, 3);
    let scored = score(&mut c, &tokens, &["10.0.0.1:8000"]).await;
    let cases: Vec<(RecordRoutingRequest, Code, &str)> = vec![
        (
            RecordRoutingRequest {
                model: String::new(),
                prompt_key: scored.prompt_key.clone(),
                pod: "10.0.0.1:8000".into(),
                ..Default::default()
            },
            Code::InvalidArgument,
            "model is required",
        ),
        (
            RecordRoutingRequest {
                model: "no/such-model".into(),
                prompt_key: scored.prompt_key.clone(),
                pod: "10.0.0.1:8000".into(),
                ..Default::default()
            },
            Code::NotFound,
            "unknown model",
        ),
        (
            RecordRoutingRequest {
                model: MODEL.into(),
                prompt_key: scored.prompt_key.clone(),
                pod: String::new(),
                ..Default::default()
            },
            Code::InvalidArgument,
            "pod is required",
        ),
        (
            RecordRoutingRequest {
                model: MODEL.into(),
                prompt_key: vec![7; 16],
                pod: "10.0.0.1:8000".into(),
                ..Default::default()
            },
            Code::NotFound,
            "unknown or expired",
        ),
        (
            RecordRoutingRequest {
                model: MODEL.into(),
                prompt_key: vec![1, 2, 3],
                pod: "10.0.0.1:8000".into(),
                ..Default::default()
            },
            Code::InvalidArgument,
            "16",
        ),
        (
            RecordRoutingRequest {
                model: MODEL.into(),
                pod: "10.0.0.1:8000".into(),
                ..Default::default()
            },
            Code::InvalidArgument,
            "prompt_key (from ScorePods) or tokens is required",
        ),
        (
            // Not a candidate of the scored prompt, and unknown to the index.
            RecordRoutingRequest {
                model: MODEL.into(),
                prompt_key: scored.prompt_key.clone(),
                pod: "10.0.0.77:8000".into(),
                ..Default::default()
            },
            Code::NotFound,
            "unknown pod",
        ),
        (
            RecordRoutingRequest {
                model: MODEL.into(),
                tokens: Some(TokenIds {
                    ids: tokens.clone(),
                }),
                pod: "10.0.0.77:8000".into(),
                ..Default::default()
            },
            Code::NotFound,
            "unknown pod",
        ),
    ];
    for (request, code, says) in cases {
        let status = c
            .record_routing(request.clone())
            .await
            .expect_err(&format!("{request:?} accepted"));
        assert_eq!(status.code(), code, "{request:?}: {status}");
        assert!(status.message().contains(says), "{request:?}: {status}");
    }
    // 10.0.0.1 never published: only the key that lists it as a candidate makes it known.
    assert_eq!(
        record(&mut c, &scored.prompt_key, None, "10.0.0.1:8000")
            .await
            .expect("record"),
        3
    );
    // Known now, an unknown key with the tokens beside it falls back to the tokens.
    let fallback = RecordRoutingRequest {
        model: MODEL.into(),
        prompt_key: vec![7; 16],
        tokens: Some(TokenIds { ids: tokens }),
        pod: "10.0.0.1:8000".into(),
        ..Default::default()
    };
    assert_eq!(
        c.record_routing(fallback)
            .await
            .expect("tokens stand in for the key")
            .into_inner()
            .blocks,
        3
    );
    let page = d.metrics_text();
    assert!(support::metric(&page, "kvindexer_prompt_keys_total{result=\"unknown\"}") >= 2.0);
    d.shutdown().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_routing_that_records_nothing_is_counted_by_why() {
    let mut config = support::loopback_config();
    config.server.enable_record_routing = true;
    config.scoring.speculative_pod_blocks = 4;
    config.models.insert(MODEL.into(), Default::default());
    let d = daemon::start(config).await.expect("daemon starts");
    let mut c = support::client(&d).await;
    let mut p = connect(&d).await;
    let a = "10.0.0.1:8000";
    let held = prompt(1, 3);
    publish(&mut p, &d, a, 0, &hashes_of(&d, &held)).await;
    let outcome = |page: &str, o: &str| {
        support::metric(
            page,
            &format!("kvindexer_speculative_routings_total{{outcome=\"{o}\"}}"),
        )
    };

    // Every block already held: 0, counted as already_held.
    assert_eq!(
        record(&mut c, &[], Some(&held), a).await.expect("record"),
        0
    );
    // Five blocks against a bound of four per pod: refused, counted as too_long.
    assert_eq!(
        record(&mut c, &[], Some(&prompt(2, 5)), a)
            .await
            .expect("record"),
        0
    );
    // Four fit: recorded.
    assert_eq!(
        record(&mut c, &[], Some(&prompt(3, 4)), a)
            .await
            .expect("record"),
        4
    );
    let page = d.metrics_text();
    assert_eq!(
        (
            outcome(&page, "already_held"),
            outcome(&page, "too_long"),
            outcome(&page, "recorded")
        ),
        (1.0, 1.0, 1.0),
        "{page}"
    );
    d.shutdown().await;
}
