//! Smaller hardening items, over real sockets: a forged sequence cannot wrap the loss counter;
//! a request that does not decode is INVALID_ARGUMENT, not INTERNAL; `/readyz` means what the
//! docs say.

mod support;

use std::time::Duration;

use bytes::Bytes;
use kv_core::{encode_batch, BlockHash, BlockStored, EngineHash, EventBatch, KvEvent, Medium};
use kv_indexer::daemon::{self, RunningDaemon};
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use zeromq::{PubSocket, Socket, SocketSend, ZmqMessage};

const MODEL: &str = "hard/model";
const POD: &str = "10.1.0.1:8000";

fn message(seq: u64, block: u64) -> ZmqMessage {
    support::pods::model_message(MODEL, POD, seq, block)
}

fn holds(d: &RunningDaemon, block: u64) -> bool {
    d.indexer
        .model(MODEL)
        .is_some_and(|m| !m.index().lookup(BlockHash::new(block)).is_empty())
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_forged_sequence_cannot_wrap_the_loss_counter() {
    let d = daemon::start(support::loopback_config())
        .await
        .expect("daemon starts");
    let mut p = PubSocket::new();
    p.connect(d.zmq_endpoint.as_deref().expect("bind"))
        .await
        .expect("PUB connects");
    // Slow joiner: resend seq 0 until it lands.
    for _ in 0..200 {
        let _ = p.send(message(0, 1)).await;
        tokio::time::sleep(Duration::from_millis(20)).await;
        if holds(&d, 1) {
            break;
        }
    }
    assert!(holds(&d, 1));
    let forged = [(1u64 << 63, 2u64), (u64::MAX, 3), (0, 4), (5, 5)];
    for (seq, block) in forged {
        p.send(message(seq, block)).await.expect("send");
    }
    for _ in 0..200 {
        if holds(&d, 5) {
            break;
        }
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    assert!(holds(&d, 5), "the stream goes on after the forged jumps");
    let lost = support::metric(&d.metrics_text(), "kvindexer_messages_lost_total{");
    // 0 -> 2^63 and 2^63 -> 2^64-1 are resyncs (no real gap is that long); 2^64-1 -> 0 is the
    // next message; 0 -> 5 skips four.
    assert_eq!(lost, 4.0, "messages lost");
    let state = d
        .publishers()
        .snapshot()
        .into_iter()
        .find(|(k, _)| &*k.engine.pod == POD)
        .map(|(_, s)| s)
        .expect("publisher");
    assert_eq!(state.messages_lost, 4);
    assert_eq!(state.last_seq, Some(5));
    d.shutdown().await;
}

/// `ScorePodsRequest` with its `model` (a `string`, field 1) declared as `bytes`, so the test
/// can send a value that is not UTF-8.
#[derive(Clone, PartialEq, prost::Message)]
struct RawScoreRequest {
    #[prost(bytes = "vec", tag = "1")]
    model: Vec<u8>,
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_request_that_does_not_decode_is_invalid_argument() {
    let d = daemon::start(support::loopback_config())
        .await
        .expect("daemon starts");
    let channel = tonic::transport::Endpoint::from_shared(format!("http://{}", d.grpc_addr))
        .expect("uri")
        .connect()
        .await
        .expect("connects");
    let mut grpc = tonic::client::Grpc::new(channel);
    grpc.ready().await.expect("ready");
    let codec = tonic_prost::ProstCodec::<RawScoreRequest, RawScoreRequest>::default();
    let status = grpc
        .unary(
            tonic::Request::new(RawScoreRequest {
                model: vec![0xff, 0xfe, b'x'],
            }),
            "/kvindexer.v1.KvIndexer/ScorePods".parse().expect("path"),
            codec,
        )
        .await
        .expect_err("not UTF-8");
    assert_eq!(status.code(), tonic::Code::InvalidArgument, "{status}");
    assert!(status.message().contains("UTF-8"), "{status}");
    d.shutdown().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn readyz_is_ready_with_an_empty_index_as_documented() {
    let d = daemon::start(support::loopback_config())
        .await
        .expect("daemon starts");
    let mut s = tokio::net::TcpStream::connect(d.metrics_addr)
        .await
        .expect("HTTP connects");
    s.write_all(b"GET /readyz HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\n")
        .await
        .expect("request");
    let mut body = String::new();
    s.read_to_string(&mut body).await.expect("response");
    assert!(body.starts_with("HTTP/1.1 200"), "{body}");
    assert_eq!(d.indexer.models().len(), 0, "nothing indexed yet");
    let doc = std::fs::read_to_string(
        std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("docs/operations.md"),
    )
    .expect("operations doc");
    assert!(
        doc.contains("`/readyz` is 200 once the event sockets are bound and gRPC serves, even with an empty index"),
        "docs/operations.md states what /readyz means"
    );
    d.shutdown().await;
}

/// Peak resident memory of this process (VmHWM), after resetting it (Linux `clear_refs` 5).
fn reset_peak_rss() {
    let _ = std::fs::write("/proc/self/clear_refs", "5");
}

fn peak_rss_bytes() -> u64 {
    let status = std::fs::read_to_string("/proc/self/status").unwrap_or_default();
    status
        .lines()
        .find_map(|l| l.strip_prefix("VmHWM:"))
        .and_then(|v| v.trim().trim_end_matches("kB").trim().parse::<u64>().ok())
        .map_or(0, |kb| kb * 1024)
}

fn current_rss_bytes() -> u64 {
    let status = std::fs::read_to_string("/proc/self/status").unwrap_or_default();
    status
        .lines()
        .find_map(|l| l.strip_prefix("VmRSS:"))
        .and_then(|v| v.trim().trim_end_matches("kB").trim().parse::<u64>().ok())
        .map_or(0, |kb| kb * 1024)
}

/// 4 x 16 MB of nil `extra_keys` (the tester's payload: 2.17 GB peak before): each is refused
/// by the decode budget, and peak memory grows by less than 4x what was sent (0.75x here).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn payloads_crafted_to_multiply_memory_stay_within_4x() {
    let d = daemon::start(support::loopback_config())
        .await
        .expect("daemon starts");
    let mut p = PubSocket::new();
    p.connect(d.zmq_endpoint.as_deref().expect("bind"))
        .await
        .expect("PUB connects");
    for _ in 0..200 {
        let _ = p.send(message(0, 1)).await;
        tokio::time::sleep(Duration::from_millis(20)).await;
        if holds(&d, 1) {
            break;
        }
    }
    let elements = 16 << 20;
    let mut payload = vec![0x93, 0xcb, 0, 0, 0, 0, 0, 0, 0, 0, 0x91, 0x84];
    payload.push(0xa4);
    payload.extend_from_slice(b"type");
    payload.push(0xab);
    payload.extend_from_slice(b"BlockStored");
    payload.push(0xac);
    payload.extend_from_slice(b"block_hashes");
    payload.extend_from_slice(&[0x91, 0x07]);
    payload.push(0xaa);
    payload.extend_from_slice(b"extra_keys");
    payload.push(0xdd);
    payload.extend_from_slice(&(elements as u32).to_be_bytes());
    payload.extend(std::iter::repeat_n(0xc0u8, elements));
    payload.push(0xaa);
    payload.extend_from_slice(b"block_size");
    payload.push(16);
    payload.push(0);
    let payload = Bytes::from(payload);
    let sent = 4 * payload.len() as u64;
    let before = current_rss_bytes();
    reset_peak_rss();
    for seq in 1..=4u64 {
        let msg = ZmqMessage::try_from(vec![
            Bytes::from(format!("kv@{POD}@{MODEL}")),
            Bytes::copy_from_slice(&seq.to_be_bytes()),
            payload.clone(),
        ])
        .expect("non-empty");
        p.send(msg).await.expect("send");
    }
    let mut refused = 0.0;
    for _ in 0..500 {
        refused = support::metric(
            &d.metrics_text(),
            "kvindexer_decode_errors_total{reason=\"too_large\"}",
        );
        if refused >= 4.0 {
            break;
        }
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    assert_eq!(refused, 4.0, "every crafted payload is refused");
    let grew = peak_rss_bytes().saturating_sub(before);
    eprintln!("sent {} MB, peak RSS grew {} MB", sent >> 20, grew >> 20);
    assert!(
        grew < 4 * sent,
        "peak RSS grew {grew} bytes for {sent} bytes of input"
    );
    // The pod's stream goes on.
    p.send(message(5, 9)).await.expect("send");
    for _ in 0..200 {
        if holds(&d, 9) {
            break;
        }
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    assert!(holds(&d, 9));
    d.shutdown().await;
}

/// Limits apply before work: a 3.9 MB prompt (over `maxPromptBytes`, 1 MiB) is refused by the
/// transport before it is read whole, and 300,000 empty chat messages by the message count,
/// both at once, for a model with a tokenizer and a chat template (so that rendering and
/// tokenizing are there to be skipped).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn oversize_prompts_and_chats_are_refused_before_any_work() {
    use kv_proto::kvindexer_v1::{
        kv_indexer_client::KvIndexerClient, score_pods_request::Input, ChatMessage, ChatRequest,
        ScorePodsRequest,
    };
    use std::time::Instant;
    let dir = support::temp_dir("hardening-tokenizer");
    support::tiny_tokenizer(&dir);
    let mut c = support::loopback_config();
    c.models.insert(
        MODEL.into(),
        kv_indexer::config::ModelConfig {
            tokenizer: Some(dir.join("tokenizer.json").display().to_string()),
            ..Default::default()
        },
    );
    let d = daemon::start(c).await.expect("daemon starts");
    let mut grpc = KvIndexerClient::connect(format!("http://{}", d.grpc_addr))
        .await
        .expect("gRPC");
    let request = |input| ScorePodsRequest {
        model: MODEL.into(),
        input: Some(input),
        ..Default::default()
    };
    // What a refusal cannot skip is reading the request: its encoding, timed in this process,
    // is the same work as its decoding, and the baseline each refusal is held to.
    let encoding = |r: &ScorePodsRequest| {
        let t = Instant::now();
        assert!(!prost::Message::encode_to_vec(r).is_empty());
        t.elapsed()
    };
    let prompt = request(Input::Prompt("word ".repeat(800_000)));
    let chat = request(Input::Chat(ChatRequest {
        messages: vec![ChatMessage::default(); 300_000],
        ..Default::default()
    }));
    let (prompt_encoding, chat_encoding) = (encoding(&prompt), encoding(&chat));

    let t = Instant::now();
    let e = grpc.score_pods(prompt).await.expect_err("too large");
    let prompt_refused = t.elapsed();
    assert!(
        matches!(
            e.code(),
            tonic::Code::OutOfRange | tonic::Code::ResourceExhausted
        ),
        "{e}"
    );
    let t = Instant::now();
    let e = grpc.score_pods(chat).await.expect_err("too many messages");
    let chat_refused = t.elapsed();
    assert_eq!(e.code(), tonic::Code::InvalidArgument, "{e}");
    assert!(e.message().contains("server.maxChatMessages"), "{e}");
    eprintln!(
        "refused: the prompt in {prompt_refused:?} (encoded in {prompt_encoding:?}), the chat in \
         {chat_refused:?} (encoded in {chat_encoding:?})"
    );
    // The codes say which check refused them; the times say nothing ran before it. Debug
    // build, 2026-11-26: the prompt refused in 7-11 ms (encoded in 9-12 ms), the chat in
    // 0.16-0.21 s (encoded in 0.06-0.13 s). Rendering and tokenizing the 300,000 messages
    // before counting them would take about 15 s (4,096 short messages were answered whole in
    // 0.21 s). The bound, 10x the encoding plus 250 ms, is that wide so that a busy machine
    // passes and only such work fails it.
    // Every time bound of the suite, and what finds a 2x slowdown instead: docs/testing.md.
    for (what, refused, encoded) in [
        ("prompt", prompt_refused, prompt_encoding),
        ("chat", chat_refused, chat_encoding),
    ] {
        let bound = encoded * 10 + Duration::from_millis(250);
        assert!(
            refused <= bound,
            "the {what} was refused after {refused:?}, encoded in {encoded:?} (bound {bound:?})"
        );
    }
    d.shutdown().await;
}

/// Topics name models, so they must not multiply state (the tester held 500k keys with `size`
/// 100k by naming 5,000 models): 200 models of 100 blocks each, with `size` 1,000 and
/// `maxModels` 16, leave at most 1,000 keys and 16 models; each model past the limit takes the
/// place of one holding the least (counted), so the newest name is indexed.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn models_named_by_topics_cannot_multiply_the_index() {
    let mut c = support::loopback_config();
    c.indexer_config.kv_block_index_config.in_memory_config.size = 1_000;
    c.indexer_config
        .kv_block_index_config
        .in_memory_config
        .max_models = 16;
    let d = daemon::start(c).await.expect("daemon starts");
    let mut p = PubSocket::new();
    p.connect(d.zmq_endpoint.as_deref().expect("bind"))
        .await
        .expect("PUB connects");
    tokio::time::sleep(Duration::from_millis(500)).await;
    for m in 0..200u64 {
        let payload = encode_batch(&EventBatch {
            ts: 1.7e9,
            events: vec![KvEvent::BlockStored(Box::new(BlockStored {
                block_hashes: (1..=100).map(|i| EngineHash::new(m << 32 | i)).collect(),
                block_size: 16,
                medium: Some(Medium::Gpu),
                ..Default::default()
            }))],
            data_parallel_rank: Some(0),
        });
        let msg = ZmqMessage::try_from(vec![
            Bytes::from(format!("kv@{POD}@model-{m}")),
            Bytes::copy_from_slice(&0u64.to_be_bytes()),
            Bytes::from(payload),
        ])
        .expect("non-empty");
        p.send(msg).await.expect("send");
    }
    let mut evicted = 0.0;
    for _ in 0..1_500 {
        evicted = support::metric(&d.metrics_text(), "kvindexer_models_evicted_total");
        if evicted >= 184.0 {
            break;
        }
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    assert!(
        evicted >= 184.0,
        "models that gave their place to the ones past the limit: {evicted}"
    );
    assert!(
        d.indexer.model("model-199").is_some(),
        "the newest name is indexed"
    );
    assert_eq!(d.indexer.models().len(), 16);
    let keys: u64 = d.indexer.stats().iter().map(|(_, s)| s.keys).sum();
    assert!(keys <= 1_000, "{keys} keys with size 1000");
    d.shutdown().await;
}
