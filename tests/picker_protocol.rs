//! The endpoint picker's protocol as GIE's gateways and EPP use it, message by message over a
//! real ext_proc stream (a daemon with the picker on, fake pods publishing over ZMQ):
//! - one endpoint by default, fallbacks only when configured;
//! - `Content-Length` set back in the header answer (Envoy drops it in full-duplex mode);
//! - without `protocol_config` (Envoy <= 1.33, GIE's own test client) response bodies are handed
//!   back as streamed responses, chunk by chunk;
//! - request trailers end a body that had no `end_of_stream`;
//! - the response's `usage.prompt_tokens_details.cached_tokens` held against the prediction
//!   (exact, under, over, not measured);
//! - bodies of every API GIE routes: a completions batch by its first prompt, embeddings,
//!   a chat with an image part scored up to the image, other paths on load alone;
//! - every body mode Envoy offers picks or is refused at the first message: BUFFERED whether
//!   trailers follow or not, BUFFERED_PARTIAL cut short on load alone, STREAMED and NONE (with
//!   a body) a 500 naming the setting to change; a client's `x-data-parallel-rank` removed
//!   unless the pick names a rank (`every_body_mode_picks_or_is_refused_at_the_first_message`).

mod support;

use envoy_types::pb::envoy::config::core::v3::{HeaderMap, HeaderValue};
use envoy_types::pb::envoy::extensions::filters::http::ext_proc::v3::processing_mode::BodySendMode;
use envoy_types::pb::envoy::service::ext_proc::v3::{
    body_mutation, processing_request::Request as R, processing_response::Response as A, HttpBody,
    HttpHeaders, HttpTrailers, ProcessingRequest, ProcessingResponse,
};
use serde_json::json;
use support::picker::{body, exchange, first, headers, read, FakePod, Fleet, MODEL};

const COMPLETIONS: &str = "/v1/completions";

fn prompt_ids(seed: u32, n: u32) -> Vec<u32> {
    (0..n).map(|i| 2000 + seed * 7919 + i).collect()
}

fn tokens_body(ids: &[u32]) -> Vec<u8> {
    json!({"model": MODEL, "prompt": ids})
        .to_string()
        .into_bytes()
}

fn request(path: &str, mode: Option<BodySendMode>, bytes: &[u8]) -> Vec<ProcessingRequest> {
    let mut m = vec![headers(path, mode, None, false)];
    m.extend(body(bytes, 4096));
    m
}

fn message(r: R) -> ProcessingRequest {
    ProcessingRequest {
        request: Some(r),
        ..Default::default()
    }
}

/// A response's headers, with `:status` and `content-type`.
fn response_headers(status: &str, content_type: &str) -> ProcessingRequest {
    let h = |k: &str, v: &str| HeaderValue {
        key: k.into(),
        raw_value: v.as_bytes().to_vec(),
        ..Default::default()
    };
    message(R::ResponseHeaders(HttpHeaders {
        headers: Some(HeaderMap {
            headers: vec![h(":status", status), h("content-type", content_type)],
        }),
        ..Default::default()
    }))
}

/// A response body in `chunk`-byte messages, the last ending the stream.
fn response_body(bytes: &[u8], chunk: usize) -> Vec<ProcessingRequest> {
    let parts: Vec<&[u8]> = bytes.chunks(chunk).collect();
    let last = parts.len() - 1;
    parts
        .into_iter()
        .enumerate()
        .map(|(i, p)| {
            message(R::ResponseBody(HttpBody {
                body: p.to_vec(),
                end_of_stream: i == last,
                ..Default::default()
            }))
        })
        .collect()
}

/// A header the request-headers answer sets.
fn header_set(responses: &[ProcessingResponse], key: &str) -> Option<String> {
    responses.iter().find_map(|r| match &r.response {
        Some(A::RequestHeaders(h)) => h
            .response
            .as_ref()?
            .header_mutation
            .as_ref()?
            .set_headers
            .iter()
            .filter_map(|o| o.header.as_ref())
            .find(|h| h.key == key)
            .map(|h| String::from_utf8_lossy(&h.raw_value).into_owned()),
        _ => None,
    })
}

/// The response body handed back as streamed responses, and whether the last part ended it.
fn response_streamed(responses: &[ProcessingResponse]) -> (Vec<u8>, usize, bool) {
    let (mut bytes, mut parts, mut end) = (Vec::new(), 0, false);
    for r in responses {
        if let Some(A::ResponseBody(b)) = &r.response {
            let streamed = b
                .response
                .as_ref()
                .and_then(|c| c.body_mutation.as_ref())
                .and_then(|m| m.mutation.as_ref());
            if let Some(body_mutation::Mutation::StreamedResponse(s)) = streamed {
                bytes.extend_from_slice(&s.body);
                parts += 1;
                end = s.end_of_stream;
            }
        }
    }
    (bytes, parts, end)
}

fn metric(fleet: &Fleet, name: &str) -> f64 {
    support::metric(&fleet.daemon.metrics_text(), name)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn one_endpoint_by_default_and_fallbacks_when_asked() {
    let pods = [FakePod::start().await, FakePod::start().await];
    for (fallbacks, listed) in [(0, 1), (1, 2), (4, 2)] {
        let mut c = support::picker::config(None);
        c.endpoint_picker.fallbacks = fallbacks;
        let mut fleet = Fleet::start(c).await;
        let ids = prompt_ids(1, 40);
        fleet.store(&pods[0].name, &ids).await;
        fleet.store(&pods[1].name, &prompt_ids(2, 40)).await;
        fleet.scraped(2, 2).await;
        let mut client = fleet.client().await;
        let a = read(&exchange(&mut client, request(COMPLETIONS, None, &tokens_body(&ids))).await);
        let header = a.header.clone().unwrap_or_default();
        let endpoints: Vec<&str> = header.split(',').collect();
        assert_eq!(endpoints.len(), listed, "fallbacks {fallbacks}: {header}");
        assert_eq!(endpoints[0], pods[0].name, "the holder first");
        assert_eq!(a.header, a.metadata);
        fleet.daemon.shutdown().await;
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn content_length_is_set_back_and_trailers_end_a_body() {
    let pod = FakePod::start().await;
    let mut fleet = Fleet::start(support::picker::config(None)).await;
    let ids = prompt_ids(3, 9000);
    fleet.store(&pod.name, &ids).await;
    let mut client = fleet.client().await;
    let whole = tokens_body(&ids);
    for mode in [None, Some(BodySendMode::FullDuplexStreamed)] {
        let responses = exchange(&mut client, request(COMPLETIONS, mode, &whole)).await;
        let len = header_set(&responses, "content-length");
        assert_eq!(len, Some(whole.len().to_string()), "{mode:?}");
    }
    // Buffered: the headers are answered before the body is known; Envoy keeps its header.
    let responses = exchange(
        &mut client,
        request(COMPLETIONS, Some(BodySendMode::Buffered), &whole),
    )
    .await;
    assert_eq!(header_set(&responses, "content-length"), None);
    // A body whose last chunk does not end the stream: the trailers end it.
    let mut m = vec![headers(COMPLETIONS, None, None, false)];
    let mut parts = body(&whole, 50_000);
    for p in &mut parts {
        if let Some(R::RequestBody(b)) = &mut p.request {
            b.end_of_stream = false;
        }
    }
    m.extend(parts);
    m.push(message(R::RequestTrailers(HttpTrailers::default())));
    let responses = exchange(&mut client, m).await;
    let a = read(&responses);
    assert_eq!(first(&a), pod.name, "{:?}", a.kinds);
    assert_eq!(a.streamed, whole, "the body handed back whole");
    assert!(
        !a.streamed_end,
        "trailers follow: the body does not end the stream"
    );
    assert_eq!(a.kinds.last(), Some(&"request_trailers"));
    fleet.daemon.shutdown().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn responses_stream_back_and_their_usage_meets_the_prediction() {
    let pod = FakePod::start().await;
    let mut fleet = Fleet::start(support::picker::config(None)).await;
    // 70 tokens: 4 full blocks held, so vLLM reuses 64 (never the last token).
    let ids = prompt_ids(4, 70);
    fleet.store(&pod.name, &ids).await;
    let mut client = fleet.client().await;
    let usage = |cached: u32| {
        json!({"id": "c", "choices": [{"text": "x".repeat(5000)}],
               "usage": {"prompt_tokens": 70, "completion_tokens": 1,
                         "prompt_tokens_details": {"cached_tokens": cached}}})
        .to_string()
    };
    let sse = "data: {\"choices\":[{\"delta\":{\"content\":\"a\"}}],\"usage\":null}\n\n\
               data: {\"choices\":[],\"usage\":{\"prompt_tokens\":70,\
               \"prompt_tokens_details\":{\"cached_tokens\":64}}}\n\ndata: [DONE]\n\n";
    let cases = [
        ("application/json", usage(64), "exact"),
        ("application/json", usage(48), "over"),
        ("application/json", usage(70), "under"),
        ("text/event-stream", sse.to_owned(), "exact"),
        (
            "application/json",
            "{\"choices\":[]}".to_owned(),
            "no_usage",
        ),
    ];
    for (content_type, answer, result) in cases {
        let before = metric(
            &fleet,
            &format!("kvindexer_picker_predictions_total{{result=\"{result}\"}}"),
        );
        // No protocol_config: full duplex both ways, as GIE's EPP assumes.
        let mut m = request(COMPLETIONS, None, &tokens_body(&ids));
        m.push(response_headers("200", content_type));
        m.extend(response_body(answer.as_bytes(), 7));
        let responses = exchange(&mut client, m).await;
        let (back, parts, end) = response_streamed(&responses);
        assert_eq!(back, answer.as_bytes(), "{result}: handed back whole");
        assert_eq!(parts, answer.len().div_ceil(7), "{result}: chunk by chunk");
        assert!(end, "the last part ends the stream");
        let after = metric(
            &fleet,
            &format!("kvindexer_picker_predictions_total{{result=\"{result}\"}}"),
        );
        assert_eq!(after, before + 1.0, "{content_type} {result}");
    }
    // A 5xx answer is not measured (negative control of the counting).
    let measured = |f: &Fleet| {
        ["exact", "over", "under", "no_usage"]
            .iter()
            .map(|r| {
                metric(
                    f,
                    &format!("kvindexer_picker_predictions_total{{result=\"{r}\"}}"),
                )
            })
            .sum::<f64>()
    };
    let before = measured(&fleet);
    let mut m = request(COMPLETIONS, None, &tokens_body(&ids));
    m.push(response_headers("503", "application/json"));
    m.extend(response_body(usage(64).as_bytes(), 4096));
    exchange(&mut client, m).await;
    assert_eq!(measured(&fleet), before);
    // The histogram saw the errors: 0, +16, -6, 0.
    let page = fleet.daemon.metrics_text();
    assert_eq!(
        support::metric(&page, "kvindexer_picker_prediction_error_tokens_count"),
        4.0
    );
    assert_eq!(
        support::metric(&page, "kvindexer_picker_prediction_error_tokens_sum"),
        10.0
    );
    fleet.daemon.shutdown().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn every_api_gie_routes_is_picked() {
    let (a, b) = (FakePod::start().await, FakePod::start().await);
    let mut fleet = Fleet::start(support::picker::config(None)).await;
    let (first_prompt, second_prompt) = (prompt_ids(5, 64), prompt_ids(6, 64));
    fleet.store(&a.name, &first_prompt).await;
    fleet.store(&b.name, &second_prompt).await;
    fleet.scraped(2, 2).await;
    let mut client = fleet.client().await;
    let ask =
        |path: &str, body: serde_json::Value| request(path, None, body.to_string().as_bytes());
    for _ in 0..5 {
        // A batch of token-id prompts, by its first.
        let batch = json!({"model": MODEL, "prompt": [&first_prompt, &second_prompt]});
        let got = read(&exchange(&mut client, ask(COMPLETIONS, batch)).await);
        assert_eq!(first(&got), a.name, "{got:?}");
        let batch = json!({"model": MODEL, "prompt": [&second_prompt, &first_prompt]});
        let got = read(&exchange(&mut client, ask(COMPLETIONS, batch)).await);
        assert_eq!(first(&got), b.name, "{got:?}");
        // Embeddings of token ids.
        let e = json!({"model": MODEL, "input": &second_prompt});
        let got = read(&exchange(&mut client, ask("/v1/embeddings", e)).await);
        assert_eq!(first(&got), b.name, "{got:?}");
    }
    // A path the picker does not score: picked on load, counted, never refused.
    let before = metric(
        &fleet,
        "kvindexer_picker_unscored_requests_total{reason=\"path\"}",
    );
    let got = read(
        &exchange(
            &mut client,
            ask(
                "/v1/rerank",
                json!({"model": MODEL, "query": "q", "documents": ["d"]}),
            ),
        )
        .await,
    );
    assert!(got.immediate.is_none(), "{got:?}");
    assert!([&a.name, &b.name].contains(&&first(&got)));
    assert_eq!(
        metric(
            &fleet,
            "kvindexer_picker_unscored_requests_total{reason=\"path\"}"
        ),
        before + 1.0
    );
    fleet.daemon.shutdown().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_chat_with_an_image_is_scored_up_to_the_image() {
    let Some((dir, samples)) = support::shared_samples("qwen3") else {
        return;
    };
    let chat = &samples["chat"];
    let (holder, other) = (FakePod::start().await, FakePod::start().await);
    let mut fleet = Fleet::start(support::picker::config(Some(&dir))).await;
    // The holder holds the text-only chat as the daemon renders it (tests/tokenizers_real.rs
    // holds that rendering to the reference's); the request adds an image to its last message.
    let mut messages: Vec<serde_json::Value> =
        chat["messages"].as_array().expect("messages").clone();
    let tok = kv_tokenize::LoadedTokenizer::from_files(MODEL, &dir.join("tokenizer.json"))
        .expect("loads");
    let input = kv_tokenize::ChatInput {
        messages: messages
            .iter()
            .map(|m| kv_tokenize::ChatMessage {
                role: m["role"].as_str().unwrap_or_default().into(),
                content: m["content"].as_str().unwrap_or_default().into(),
            })
            .collect(),
        add_generation_prompt: true,
        template_kwargs: serde_json::from_value(json!({"enable_thinking": false})).expect("kwargs"),
        ..Default::default()
    };
    let (_, whole) = tok.encode_chat(&input).expect("renders");
    fleet.store(&holder.name, &whole.ids).await;
    fleet.store(&other.name, &prompt_ids(7, 64)).await;
    fleet.scraped(2, 2).await;
    let last = messages.last_mut().expect("a message");
    let text = last["content"].as_str().unwrap_or_default().to_owned();
    last["content"] = json!([
        {"type": "image_url", "image_url": {"url": "data:image/png;base64,AAAA"}},
        {"type": "text", "text": text}
    ]);
    let body = json!({"model": MODEL, "messages": messages,
                      "chat_template_kwargs": {"enable_thinking": false}});
    let mut client = fleet.client().await;
    let mut picked = 0.0;
    for _ in 0..60 {
        let got = read(
            &exchange(
                &mut client,
                request("/v1/chat/completions", None, body.to_string().as_bytes()),
            )
            .await,
        );
        picked = metric(&fleet, "kvindexer_picker_picks_total{outcome=\"picked\"}");
        if picked > 0.0 {
            assert_eq!(first(&got), holder.name, "{got:?}");
            break;
        }
    }
    assert!(picked > 0.0, "the tokenizer never loaded");
    for _ in 0..5 {
        let got = read(
            &exchange(
                &mut client,
                request("/v1/chat/completions", None, body.to_string().as_bytes()),
            )
            .await,
        );
        assert_eq!(first(&got), holder.name, "{got:?}");
    }
    // What the engine reuses of the image prompt: the whole blocks before the image, i.e.
    // of the tokens that end before the last message's content in the text chat's rendering.
    let rendered = tok.render_chat(&input).expect("renders");
    let content_at = rendered
        .rfind(text.as_str())
        .expect("the content is rendered");
    let before_image = whole.offsets.iter().filter(|o| o.1 <= content_at).count();
    let true_hit = (before_image / support::picker::BLOCK * support::picker::BLOCK) as u32;
    assert!(true_hit >= 16, "the chat has whole blocks before the image");
    let answer = json!({"choices": [], "usage": {"prompt_tokens": before_image + 300,
        "prompt_tokens_details": {"cached_tokens": true_hit}}})
    .to_string();
    let sum = |f: &Fleet| metric(f, "kvindexer_picker_prediction_error_tokens_sum");
    let before = sum(&fleet);
    let mut m = request("/v1/chat/completions", None, body.to_string().as_bytes());
    m.push(response_headers("200", "application/json"));
    m.extend(response_body(answer.as_bytes(), 1024));
    exchange(&mut client, m).await;
    let error = sum(&fleet) - before;
    // Exact but for the cut's last token (dropped: it might merge with what follows), never
    // more than the engine reuses; a picker scoring the text parts alone would over-predict.
    assert!(
        (-16.0..=0.0).contains(&error),
        "predicted minus reused: {error} (true hit {true_hit})"
    );
    fleet.daemon.shutdown().await;
}

/// `messages`' answers as an Answer, with the ImmediateResponse's status (0: none).
async fn answer_of(
    client: &mut envoy_types::pb::envoy::service::ext_proc::v3::external_processor_client::ExternalProcessorClient<tonic::transport::Channel>,
    messages: Vec<ProcessingRequest>,
) -> support::picker::Answer {
    read(&exchange(client, messages).await)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn every_body_mode_picks_or_is_refused_at_the_first_message() {
    let pod = FakePod::start().await;
    let mut fleet = Fleet::start(support::picker::config(None)).await;
    let ids = prompt_ids(9, 600);
    fleet.store(&pod.name, &ids).await;
    let mut client = fleet.client().await;
    let whole = tokens_body(&ids);
    let one_message = |end_of_stream: bool, bytes: &[u8]| {
        message(R::RequestBody(HttpBody {
            body: bytes.to_vec(),
            end_of_stream,
            ..Default::default()
        }))
    };
    // BUFFERED, trailers following (the body's message not ending the stream): picked on it.
    let mode = Some(BodySendMode::Buffered);
    let m = vec![
        headers(COMPLETIONS, mode, None, false),
        one_message(false, &whole),
        message(R::RequestTrailers(HttpTrailers::default())),
    ];
    let a = answer_of(&mut client, m).await;
    assert_eq!(first(&a), pod.name, "{:?}", a.kinds);
    assert_eq!(a.kinds, ["headers", "body", "request_trailers"]);
    // BUFFERED_PARTIAL cut at Envoy's limit: not JSON, picked on load alone and counted.
    let mode = Some(BodySendMode::BufferedPartial);
    let m = vec![
        headers(COMPLETIONS, mode, None, false),
        one_message(false, &whole[..whole.len() / 2]),
    ];
    let a = answer_of(&mut client, m).await;
    assert_eq!(first(&a), pod.name, "the only pod, on load");
    let page = fleet.daemon.metrics_text();
    let unscored = "kvindexer_picker_unscored_requests_total{reason=\"partial_body\"}";
    assert_eq!(support::metric(&page, unscored), 1.0);
    // STREAMED (with or without waiting) and NONE with a body: refused at the first message.
    for mode in [BodySendMode::Streamed, BodySendMode::None] {
        let a = answer_of(&mut client, request(COMPLETIONS, Some(mode), &whole)).await;
        let (code, body) = a
            .immediate
            .clone()
            .unwrap_or_else(|| panic!("{mode:?}: {a:?}"));
        assert_eq!(code, 500, "{mode:?}");
        assert!(body.contains("FULL_DUPLEX_STREAMED"), "{mode:?}: {body}");
        assert_eq!(a.kinds, ["immediate"], "{mode:?}: at the first message");
    }
    let page = fleet.daemon.metrics_text();
    let refused = "kvindexer_picker_refused_total{bound=\"body_mode\"}";
    assert_eq!(support::metric(&page, refused), 2.0);
    // NONE for a request without a body (a GET): picked on load, as GIE's EPP does.
    let a = answer_of(
        &mut client,
        vec![headers(COMPLETIONS, Some(BodySendMode::None), None, true)],
    )
    .await;
    assert_eq!(first(&a), pod.name);
    // A client's rank header is removed when the pick names no rank (a plain pod).
    let mut m = vec![support::picker::headers_with(
        COMPLETIONS,
        &[("x-data-parallel-rank", "3")],
    )];
    m.extend(body(&whole, 4096));
    let a = answer_of(&mut client, m).await;
    assert_eq!(a.rank, None);
    assert!(
        a.removed.iter().any(|h| h == "x-data-parallel-rank"),
        "{:?}",
        a.removed
    );
    fleet.daemon.shutdown().await;
}
