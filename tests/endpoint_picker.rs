//! kv-indexer as an InferencePool's endpoint picker, end to end over real sockets: a daemon
//! with `endpointPicker` on, fake vLLM pods that publish KV events over ZMQ and serve
//! `/metrics` over HTTP, and an ext_proc client generated from Envoy's protos (envoy-types).
//! These tests drive the protocol message by message, following GIE's endpoint-picker protocol
//! (`docs/proposals/004-endpoint-picker-protocol`) and its conformance suite point by point
//! (`tests/gateway_envoy.rs` runs the same picks behind a real Envoy):
//! - "Destination Endpoint" / conformance `GatewayFollowingEPPRouting`: the pick is in the
//!   header `x-gateway-destination-endpoint` and in the metadata `envoy.lb`, the same value
//!   (`a_chat_whose_prefix_pod_b_holds_goes_to_b`, `a_deep_queue_loses_a_tie_on_prefix`);
//! - "Endpoint Subset": only endpoints of the hint are picked, as a string or a list; an empty
//!   list, or one naming no pool pod, is 503 (`the_subset_hint_is_obeyed`);
//! - "Destination Endpoint" constraints: no ready endpoint is ImmediateResponse 503
//!   (`no_candidates_is_503`); a request shed is 429
//!   (`past_max_in_flight_requests_are_shed_with_429`); a body that is not a request is 400
//!   with a JSON error, one over `maxBodyBytes` 413, and the picker goes on
//!   (`unreadable_bodies_are_400_oversized_413_and_the_daemon_lives`);
//! - streaming mode (the protocol's MUST; llm-d's FULL_DUPLEX_STREAMED): the body in many
//!   chunks is handed back unchanged after the pick; BUFFERED answers the headers at once and
//!   picks in the body answer (`full_duplex_bodies_come_back_unchanged`);
//! - "Destination Endpoint Served" / conformance `GatewayDestinationEndpointServed`: response
//!   messages are answered, and a served fallback is counted
//!   (`response_messages_are_answered_and_a_served_fallback_counted`);
//! - the request: OpenAI completions and chat bodies, a LoRA adapter named as the model and
//!   `cache_salt` scored as ScorePods scores them
//!   (`a_lora_adapter_and_a_cache_salt_are_scored_as_score_pods_scores_them`);
//! - "Health Checking": `liveness`, `readiness` and `envoy.service.ext_proc.v3.ExternalProcessor`
//!   are SERVING (`health_reports_serving_for_the_three_names`).

mod support;

use std::time::Duration;

use envoy_types::pb::envoy::extensions::filters::http::ext_proc::v3::processing_mode::BodySendMode;
use serde_json::json;
use support::picker::{body, exchange, first, headers, read, FakePod, Fleet, Hint, MODEL};

const CHAT_PATH: &str = "/v1/chat/completions";
const COMPLETIONS_PATH: &str = "/v1/completions";

/// A request: headers then the body in chunks of `chunk` bytes.
fn request(
    path: &str,
    mode: Option<BodySendMode>,
    hint: Option<Hint<'_>>,
    body_bytes: &[u8],
    chunk: usize,
) -> Vec<envoy_types::pb::envoy::service::ext_proc::v3::ProcessingRequest> {
    let mut m = vec![headers(path, mode, hint, false)];
    m.extend(body(body_bytes, chunk));
    m
}

/// A completions body with `ids` as its prompt.
fn tokens_body(ids: &[u32]) -> Vec<u8> {
    json!({"model": MODEL, "prompt": ids, "max_tokens": 8})
        .to_string()
        .into_bytes()
}

fn prompt_ids(seed: u32, n: u32) -> Vec<u32> {
    (0..n).map(|i| 1000 + seed * 7919 + i).collect()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_chat_whose_prefix_pod_b_holds_goes_to_b() {
    let Some((dir, samples)) = support::shared_samples("qwen3") else {
        return;
    };
    let chat = &samples["chat"];
    let ids = support::u32s(&chat["ids"]);
    let pods = [
        FakePod::start().await,
        FakePod::start().await,
        FakePod::start().await,
    ];
    let mut fleet = Fleet::start(support::picker::config(Some(&dir))).await;
    let b = pods[1].name.clone();
    // A and C hold something else; B holds the chat's blocks, as vLLM would hash them.
    fleet.store(&pods[0].name, &prompt_ids(1, 64)).await;
    fleet.store(&b, &ids).await;
    fleet.store(&pods[2].name, &prompt_ids(2, 64)).await;
    fleet.scraped(3, 2).await;
    let chat_body = json!({
        "model": MODEL,
        "messages": chat["messages"],
        "chat_template_kwargs": {"enable_thinking": false},
        "stream": true
    })
    .to_string()
    .into_bytes();
    let mut client = fleet.client().await;
    // A cold tokenizer may take longer to load than a pick waits for it (a debug build on a
    // busy machine): such a pick goes on load alone (`picked_without_prefix`). Warm it first.
    let picked = |fleet: &Fleet| {
        support::metric(
            &fleet.daemon.metrics_text(),
            "kvindexer_picker_picks_total{outcome=\"picked\"}",
        )
    };
    for _ in 0..60 {
        exchange(
            &mut client,
            request(CHAT_PATH, None, None, &chat_body, 4096),
        )
        .await;
        if picked(&fleet) > 0.0 {
            break;
        }
    }
    let warm = picked(&fleet);
    assert!(warm > 0.0, "the tokenizer never loaded");
    for _ in 0..5 {
        let a = read(
            &exchange(
                &mut client,
                request(CHAT_PATH, None, None, &chat_body, 4096),
            )
            .await,
        );
        assert_eq!(first(&a), b, "{a:?}");
        assert_eq!(a.header, a.metadata, "the header and the metadata agree");
        assert_eq!(
            a.header.as_deref().map(|h| h.split(',').count()),
            Some(1),
            "one endpoint, as every GIE gateway parses it"
        );
    }
    // Negative control: a chat nobody holds is not sent to B every time (ties break at random).
    // Each chat differs from its first tokens on, so no pick's recorded routing favours a pod.
    let mut winners = std::collections::BTreeSet::new();
    for i in 0..30 {
        let other = json!({"model": MODEL, "messages": [
            {"role": "user", "content": format!("{i} apples and pears, nothing anyone holds")}
        ]})
        .to_string()
        .into_bytes();
        let a = read(&exchange(&mut client, request(CHAT_PATH, None, None, &other, 4096)).await);
        winners.insert(first(&a));
    }
    assert!(winners.len() > 1, "equal pods share the picks: {winners:?}");
    let page = fleet.daemon.metrics_text();
    assert!(
        support::metric(&page, "kvindexer_picker_picks_total{outcome=\"picked\"}") >= warm + 35.0,
        "{}",
        support::picker::picks_lines(&page)
    );
    fleet.daemon.shutdown().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_deep_queue_loses_a_tie_on_prefix() {
    let (a, b) = (FakePod::start().await, FakePod::start().await);
    let mut fleet = Fleet::start(support::picker::config(None)).await;
    let ids = prompt_ids(3, 80);
    fleet.store(&a.name, &ids).await;
    fleet.store(&b.name, &ids).await;
    let mut client = fleet.client().await;
    for (deep, short) in [(&a, &b), (&b, &a)] {
        // The negative control is the second round: the same pods, the loads swapped.
        deep.set_load(40, 0.3);
        short.set_load(0, 0.3);
        fleet.scraped(2, 3).await;
        for _ in 0..10 {
            let answer = read(
                &exchange(
                    &mut client,
                    request(COMPLETIONS_PATH, None, None, &tokens_body(&ids), 1 << 16),
                )
                .await,
            );
            assert_eq!(first(&answer), short.name, "{answer:?}");
            assert_eq!(answer.header, answer.metadata);
        }
    }
    fleet.daemon.shutdown().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_subset_hint_is_obeyed() {
    let pods = [FakePod::start().await, FakePod::start().await];
    let mut fleet = Fleet::start(support::picker::config(None)).await;
    let ids = prompt_ids(4, 48);
    // Pod 0 holds the prompt: without a hint it wins.
    fleet.store(&pods[0].name, &ids).await;
    fleet.store(&pods[1].name, &prompt_ids(5, 48)).await;
    fleet.scraped(2, 2).await;
    let mut client = fleet.client().await;
    let ask = |hint| request(COMPLETIONS_PATH, None, hint, &tokens_body(&ids), 1 << 16);
    let a = read(&exchange(&mut client, ask(None)).await);
    assert_eq!(first(&a), pods[0].name, "negative control: the holder wins");
    let only_b = pods[1].name.clone();
    let only_b_list = [only_b.as_str()];
    let none: [&str; 0] = [];
    for _ in 0..5 {
        let a = read(&exchange(&mut client, ask(Some(Hint::Text(&only_b)))).await);
        assert_eq!(a.header.as_deref(), Some(only_b.as_str()), "{a:?}");
        assert_eq!(a.header, a.metadata);
        let a = read(&exchange(&mut client, ask(Some(Hint::List(&only_b_list)))).await);
        assert_eq!(a.header.as_deref(), Some(only_b.as_str()), "{a:?}");
    }
    // A hint naming no pool pod is not routed to blindly: 503, counted.
    let a = read(&exchange(&mut client, ask(Some(Hint::Text("127.0.0.9:8000")))).await);
    assert_eq!(a.immediate.as_ref().map(|i| i.0), Some(503), "{a:?}");
    assert_eq!(a.header, None);
    assert!(
        support::metric(
            &fleet.daemon.metrics_text(),
            "kvindexer_picker_subset_outside_pool_total"
        ) >= 1.0
    );
    // An empty subset: 503.
    let a = read(&exchange(&mut client, ask(Some(Hint::List(&none)))).await);
    assert_eq!(a.immediate.as_ref().map(|i| i.0), Some(503), "{a:?}");
    assert_eq!(a.header, None);
    fleet.daemon.shutdown().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_lora_adapter_and_a_cache_salt_are_scored_as_score_pods_scores_them() {
    use kv_core::{LoraAdapter, RequestExtras};
    let (adapter_pod, salted_pod) = (FakePod::start().await, FakePod::start().await);
    let mut c = support::picker::config(None);
    c.indexer_config.token_processor_config.engine_hashes = kv_core::EngineHashes::Aligned;
    let model = c.models.get_mut(MODEL).expect("configured");
    model
        .lora_adapters
        .insert("sql-adapter".into(), "/adapters/sql".into());
    let mut fleet = Fleet::start(c).await;
    let ids = prompt_ids(9, 64);
    let adapter = LoraAdapter {
        name: "sql-adapter".into(),
        path: "/adapters/sql".into(),
    };
    fleet
        .store_with(
            &adapter_pod.name,
            &ids,
            RequestExtras {
                lora: Some(adapter),
                ..Default::default()
            },
        )
        .await;
    fleet
        .store_with(
            &salted_pod.name,
            &ids,
            RequestExtras {
                cache_salt: Some("tenant-1".into()),
                ..Default::default()
            },
        )
        .await;
    fleet.scraped(2, 2).await;
    let mut client = fleet.client().await;
    let ask = |body: serde_json::Value| {
        request(
            COMPLETIONS_PATH,
            None,
            None,
            body.to_string().as_bytes(),
            1 << 16,
        )
    };
    for _ in 0..5 {
        // The adapter's name as the model (vLLM serves an adapter as a model): its base model's
        // pods, hashed with the adapter.
        let a = read(
            &exchange(
                &mut client,
                ask(json!({"model": "sql-adapter", "prompt": ids})),
            )
            .await,
        );
        assert_eq!(first(&a), adapter_pod.name, "{a:?}");
        let a = read(
            &exchange(
                &mut client,
                ask(json!({"model": MODEL, "prompt": ids, "cache_salt": "tenant-1"})),
            )
            .await,
        );
        assert_eq!(first(&a), salted_pod.name, "{a:?}");
    }
    // Negative control: another tenant's salt matches neither pod's blocks, so the salted pod
    // does not win every time.
    let mut winners = std::collections::BTreeSet::new();
    for i in 0..30 {
        let body = json!({"model": MODEL, "prompt": ids, "cache_salt": format!("other-{i}")});
        winners.insert(first(&read(&exchange(&mut client, ask(body)).await)));
    }
    assert!(winners.len() > 1, "{winners:?}");
    fleet.daemon.shutdown().await;
}

/// A HuggingFace Hub that holds every download until released, then answers 404: a
/// tokenizer load that keeps its request in flight as long as the test wants.
struct HeldHub {
    url: String,
    asked: std::sync::Arc<std::sync::atomic::AtomicUsize>,
    release: std::sync::Arc<tokio::sync::Notify>,
    _task: tokio::task::JoinHandle<()>,
}

impl HeldHub {
    async fn start() -> Self {
        use std::sync::atomic::Ordering;
        let asked = std::sync::Arc::new(std::sync::atomic::AtomicUsize::new(0));
        let release = std::sync::Arc::new(tokio::sync::Notify::new());
        let (a, r) = (asked.clone(), release.clone());
        let app = axum::Router::new().fallback(move || {
            let (a, r) = (a.clone(), r.clone());
            async move {
                let released = r.notified();
                a.fetch_add(1, Ordering::SeqCst);
                released.await;
                axum::http::StatusCode::NOT_FOUND
            }
        });
        let listener = tokio::net::TcpListener::bind("127.0.0.1:0")
            .await
            .expect("binds");
        let url = format!("http://{}", listener.local_addr().expect("addr"));
        let task = tokio::spawn(async move {
            let _ = axum::serve(listener, app).await;
        });
        Self {
            url,
            asked,
            release,
            _task: task,
        }
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn past_max_in_flight_requests_are_shed_with_429() {
    // The model's tokenizer comes from a hub that holds the download: the first request is
    // scored (in flight) until the test releases it, so the others meet a full picker.
    let hub = HeldHub::start().await;
    let pod = FakePod::start().await;
    let mut c = support::picker::config(None);
    c.endpoint_picker.max_in_flight = 1;
    c.indexer_config.tokenizers_pool_config.offline = false;
    c.indexer_config.tokenizers_pool_config.hf_endpoint = hub.url.clone();
    let mut fleet = Fleet::start(c).await;
    fleet.store(&pod.name, &prompt_ids(10, 32)).await;
    let chat_body = json!({"model": MODEL, "messages": [{"role": "user", "content": "hi"}]})
        .to_string()
        .into_bytes();
    let mut client = fleet.client().await;
    let body = chat_body.clone();
    let first_call = tokio::spawn(async move {
        read(&exchange(&mut client, request(CHAT_PATH, None, None, &body, 4096)).await)
    });
    support::pods::eventually(
        Duration::from_secs(20),
        "the first request in flight",
        || {
            let n = hub.asked.load(std::sync::atomic::Ordering::SeqCst);
            async move { n >= 1 }
        },
    )
    .await;
    let mut client = fleet.client().await;
    for _ in 0..7 {
        let a = read(
            &exchange(
                &mut client,
                request(CHAT_PATH, None, None, &chat_body, 4096),
            )
            .await,
        );
        let (code, body) = a.immediate.clone().unwrap_or_else(|| panic!("shed: {a:?}"));
        assert_eq!(code, 429, "{body}");
        let error: serde_json::Value = serde_json::from_str(&body).expect("a JSON error");
        assert_eq!(error["error"]["code"], 429);
        assert!(body.contains("endpointPicker.maxInFlight"), "{body}");
    }
    hub.release.notify_waiters();
    let a = first_call.await.expect("the call ends");
    assert_eq!(
        first(&a),
        pod.name,
        "the first is picked (on load, no tokenizer)"
    );
    let page = fleet.daemon.metrics_text();
    assert_eq!(
        support::metric(&page, "kvindexer_picker_picks_total{outcome=\"shed\"}"),
        7.0
    );
    // Negative control: one at a time, nothing is shed.
    let mut client = fleet.client().await;
    for _ in 0..3 {
        hub.release.notify_waiters();
        let a = read(
            &exchange(
                &mut client,
                request(CHAT_PATH, None, None, &chat_body, 4096),
            )
            .await,
        );
        assert_eq!(first(&a), pod.name, "{a:?}");
    }
    fleet.daemon.shutdown().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn no_candidates_is_503() {
    let fleet = Fleet::start(support::picker::config(None)).await;
    let mut client = fleet.client().await;
    // The model is configured, but no pod has published for it.
    let a = read(
        &exchange(
            &mut client,
            request(COMPLETIONS_PATH, None, None, &tokens_body(&[1, 2, 3]), 64),
        )
        .await,
    );
    let (code, body) = a.immediate.clone().unwrap_or_else(|| panic!("{a:?}"));
    assert_eq!(code, 503);
    let error: serde_json::Value = serde_json::from_str(&body).expect("a JSON error");
    assert_eq!(error["error"]["code"], 503);
    assert_eq!(a.header, None);
    let page = fleet.daemon.metrics_text();
    assert_eq!(
        support::metric(
            &page,
            "kvindexer_picker_picks_total{outcome=\"no_candidates\"}"
        ),
        1.0
    );
    fleet.daemon.shutdown().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn unreadable_bodies_are_400_oversized_413_and_the_daemon_lives() {
    let pod = FakePod::start().await;
    let mut c = support::picker::config(None);
    c.endpoint_picker.max_body_bytes = 4096;
    let mut fleet = Fleet::start(c).await;
    let ids = prompt_ids(6, 32);
    fleet.store(&pod.name, &ids).await;
    let mut client = fleet.client().await;
    let truncated = {
        let mut b = tokens_body(&ids);
        b.truncate(b.len() / 2);
        b
    };
    let oversized = json!({"model": MODEL, "prompt": "x".repeat(10_000)})
        .to_string()
        .into_bytes();
    // Over maxBodyBytes: a 413, counted by its bound, refused before it is all held.
    let a = read(
        &exchange(
            &mut client,
            request(CHAT_PATH, None, None, &oversized, 1000),
        )
        .await,
    );
    let (code, body) = a.immediate.clone().expect("refused");
    assert_eq!(code, 413, "{body}");
    assert!(body.contains("endpointPicker.maxBodyBytes"), "{body}");
    let page = fleet.daemon.metrics_text();
    assert_eq!(
        support::metric(&page, "kvindexer_picker_refused_total{bound=\"body_size\"}"),
        1.0
    );
    let cases: [(&str, Vec<u8>); 3] = [
        ("not_json", b"\x00\x01\xffgarbage{".to_vec()),
        ("not_json", truncated),
        (
            "shape",
            br#"{"model":"Qwen/Qwen3-8B","input":"no prompt"}"#.to_vec(),
        ),
    ];
    for (reason, bad) in &cases {
        let a = read(&exchange(&mut client, request(CHAT_PATH, None, None, bad, 1000)).await);
        let (code, body) = a
            .immediate
            .clone()
            .unwrap_or_else(|| panic!("{reason}: {a:?}"));
        assert_eq!(code, 400, "{reason}");
        let error: serde_json::Value = serde_json::from_str(&body).expect("a JSON error");
        assert_eq!(error["error"]["type"], "BadRequest", "{reason}: {body}");
        assert_eq!(a.header, None, "{reason}: no pick");
        let page = fleet.daemon.metrics_text();
        assert!(
            support::metric(
                &page,
                &format!("kvindexer_picker_bad_requests_total{{reason=\"{reason}\"}}")
            ) >= 1.0,
            "{reason} counted"
        );
    }
    // The daemon lives: the next good request is picked (negative control of the 400s).
    let a = read(
        &exchange(
            &mut client,
            request(COMPLETIONS_PATH, None, None, &tokens_body(&ids), 1000),
        )
        .await,
    );
    assert_eq!(first(&a), pod.name, "{a:?}");
    let page = fleet.daemon.metrics_text();
    assert_eq!(
        support::metric(
            &page,
            "kvindexer_picker_picks_total{outcome=\"bad_request\"}"
        ),
        3.0
    );
    assert_eq!(
        support::metric(&page, "kvindexer_picker_picks_total{outcome=\"too_large\"}"),
        1.0
    );
    fleet.daemon.shutdown().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn full_duplex_bodies_come_back_unchanged() {
    let pod = FakePod::start().await;
    let mut fleet = Fleet::start(support::picker::config(None)).await;
    let ids = prompt_ids(7, 12_000);
    fleet.store(&pod.name, &ids).await;
    let mut client = fleet.client().await;
    let whole = tokens_body(&ids);
    assert!(whole.len() > 62_000, "more than one streamed answer");
    for mode in [Some(BodySendMode::FullDuplexStreamed), None] {
        let responses = exchange(
            &mut client,
            request(COMPLETIONS_PATH, mode, None, &whole, 997),
        )
        .await;
        let a = read(&responses);
        assert_eq!(a.kinds[0], "headers", "{mode:?}: headers first");
        assert!(a.kinds[1..].iter().all(|k| *k == "body"), "{:?}", a.kinds);
        assert_eq!(
            a.streamed, whole,
            "{mode:?}: the body handed back unchanged"
        );
        assert!(a.streamed_end, "the last part ends the stream");
        assert_eq!(first(&a), pod.name);
        assert_eq!(a.header, a.metadata);
    }
    // BUFFERED: the headers answered at once (no pick), the pick in the body's answer.
    let responses = exchange(
        &mut client,
        request(
            COMPLETIONS_PATH,
            Some(BodySendMode::Buffered),
            None,
            &whole,
            whole.len(),
        ),
    )
    .await;
    let a = read(&responses);
    assert_eq!(a.kinds, ["headers", "body"]);
    assert!(a.streamed.is_empty(), "buffered bodies are not handed back");
    assert_eq!(first(&a), pod.name);
    assert_eq!(a.header, a.metadata);
    fleet.daemon.shutdown().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn response_messages_are_answered_and_a_served_fallback_counted() {
    use envoy_types::pb::envoy::config::core::v3::{HeaderMap, HeaderValue};
    use envoy_types::pb::envoy::service::ext_proc::v3::{
        processing_request::Request as R, HttpBody, HttpHeaders, HttpTrailers, ProcessingRequest,
    };
    let pod = FakePod::start().await;
    let mut fleet = Fleet::start(support::picker::config(None)).await;
    let ids = prompt_ids(8, 32);
    fleet.store(&pod.name, &ids).await;
    let mut client = fleet.client().await;
    let response_headers = |served: &str| ProcessingRequest {
        request: Some(R::ResponseHeaders(HttpHeaders {
            headers: Some(HeaderMap {
                headers: vec![
                    HeaderValue {
                        key: ":status".into(),
                        raw_value: b"200".to_vec(),
                        ..Default::default()
                    },
                    HeaderValue {
                        key: "x-gateway-destination-endpoint-served".into(),
                        raw_value: served.as_bytes().to_vec(),
                        ..Default::default()
                    },
                ],
            }),
            ..Default::default()
        })),
        ..Default::default()
    };
    let tail = |served: &str| {
        vec![
            response_headers(served),
            ProcessingRequest {
                request: Some(R::ResponseBody(HttpBody {
                    body: b"data: {}\n\n".to_vec(),
                    end_of_stream: true,
                    ..Default::default()
                })),
                ..Default::default()
            },
            ProcessingRequest {
                request: Some(R::ResponseTrailers(HttpTrailers::default())),
                ..Default::default()
            },
        ]
    };
    for (served, elsewhere) in [(pod.name.as_str(), 0.0), ("127.0.0.9:8000", 1.0)] {
        let mut m = request(COMPLETIONS_PATH, None, None, &tokens_body(&ids), 4096);
        m.extend(tail(served));
        let a = read(&exchange(&mut client, m).await);
        assert_eq!(
            &a.kinds[a.kinds.len() - 3..],
            ["response_headers", "response_body", "response_trailers"],
            "{a:?}"
        );
        let page = fleet.daemon.metrics_text();
        assert_eq!(
            support::metric(&page, "kvindexer_picker_served_elsewhere_total"),
            elsewhere,
            "served by {served}"
        );
    }
    fleet.daemon.shutdown().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn health_reports_serving_for_the_three_names() {
    use tonic_health::pb::{health_client::HealthClient, HealthCheckRequest};
    let fleet = Fleet::start(support::picker::config(None)).await;
    let addr = fleet.daemon.picker_addr.expect("the picker is on");
    let channel = tonic::transport::Channel::from_shared(format!("http://{addr}"))
        .expect("uri")
        .connect()
        .await
        .expect("connects");
    let mut health = HealthClient::new(channel);
    for name in [
        "liveness",
        "readiness",
        "envoy.service.ext_proc.v3.ExternalProcessor",
    ] {
        let mut status = 0;
        for _ in 0..50 {
            status = health
                .check(HealthCheckRequest {
                    service: name.into(),
                })
                .await
                .expect("known")
                .into_inner()
                .status;
            if status == 1 {
                break;
            }
            tokio::time::sleep(std::time::Duration::from_millis(20)).await;
        }
        assert_eq!(status, 1, "{name} SERVING");
    }
    // Negative control: a name the picker does not serve is unknown.
    let e = health
        .check(HealthCheckRequest {
            service: "no.such.Service".into(),
        })
        .await
        .expect_err("unknown");
    assert_eq!(e.code(), tonic::Code::NotFound);
    fleet.daemon.shutdown().await;
}
