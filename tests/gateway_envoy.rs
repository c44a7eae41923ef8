//! The endpoint picker behind a real Envoy (1.40, `ENVOY_BIN`; `.ci/run` installs it), over real
//! sockets: a client's HTTP request goes through Envoy, whose ext_proc filter asks the daemon's
//! picker, to a fake vLLM pod (`support::pod_http`) that records what it received and answers
//! with `usage`. Envoy runs the configuration the project ships (`deploy/examples/envoy.yaml`,
//! GIE's e2e shape: ORIGINAL_DST by header, h2c to the picker) or a fixture of
//! `tests/fixtures/envoy/` (GIE's TLS to the picker; Istio's override_host balancer with
//! retries). `tests/endpoint_picker.rs` drives the same protocol message by message. Without
//! Envoy the tests say `SKIPPED` (under `CI=true` they fail). Each case and its negative control:
//! - GIE's configuration, h2c and TLS (the picker's certificate from files, or self-signed as
//!   the Helm chart serves it): the prefix holder serves; prompts nobody holds spread
//!   over the pods (`gie_e2e_config_over_*`); the h2c configuration against a TLS picker routes
//!   nothing (`a_plaintext_gateway_gets_nothing_from_a_tls_picker`);
//! - a chat (the tiny tokenizer, the daemon's chat template) lands on the pod holding its
//!   rendered tokens, predicted exactly; another chat on its own holder
//!   (`a_chat_prompt_lands_on_its_holder`);
//! - a deep queue loses a tie on prefix; the loads swapped, the other pod loses
//!   (`a_deep_queue_loses_behind_envoy`);
//! - a garbage body is a 400 with the picker's JSON error and reaches no pod; the next request
//!   is served (`a_garbage_body_is_400_and_the_next_request_is_served`);
//! - bodies of 0.5 KB and 130 KB reach the pod byte for byte, chunked (Envoy 1.40 drops the
//!   Content-Length the picker sets back); straight to the pod, the Content-Length is seen
//!   (`bodies_reach_the_pod_byte_for_byte`);
//! - the picker stopped: a 500 and no pod gets the request; before, it was served
//!   (`the_picker_stopped_is_a_5xx_and_nothing_is_routed`);
//! - 8,005-token prompts as token ids and an 8,000-word text land on their holders, each the
//!   others' control (`an_8000_token_prompt_lands_on_its_holder`);
//! - `usage`: cached tokens equal to the prediction count `exact`, fewer `over`, more `under`,
//!   none reported `no_cached_tokens`, with the error histogram's sum moving by the difference
//!   (`cached_tokens_are_held_against_the_prediction`); a stream reaches the client whole, in
//!   order and unbuffered, its last event's usage read; without `include_usage`, `no_usage`
//!   (`a_streamed_response_arrives_whole_in_order_and_its_usage_is_read`);
//! - override_host with retries and two fallbacks: the holder serves; with it down (its
//!   inference, then its metrics too), Envoy retries on the first fallback, which serves, and
//!   reports it (served elsewhere); up, nothing is served elsewhere
//!   (`override_host_retries_on_a_fallback_when_the_pick_is_down`);
//! - why one endpoint is the default: behind GIE's ORIGINAL_DST cluster a list is no address
//!   (503, `original_dst_host_invalid`) (`an_endpoint_list_fails_behind_gie_s_original_dst_gateway`);
//! - a block-aligned prompt held whole is predicted one block short of its blocks, as vLLM
//!   recomputes its last token (`the_last_token_of_an_aligned_prompt_is_not_predicted_cached`;
//!   it found the daemon scoring prompt keys without that rule).

mod support;

use std::time::Duration;

use kv_indexer::config::Config;
use serde_json::{json, Value};
use support::envoy::{Gateway, COMPLETIONS};
use support::picker::MODEL;
use support::pod_http::Health;

/// The gateway the project ships (GIE's e2e configuration).
const GIE: &str = "deploy/examples/envoy.yaml";
/// The same, the picker dialled over TLS as GIE dials its EPP.
const GIE_TLS: &str = "tests/fixtures/envoy/gie-tls.yaml";
/// An Istio-style override_host gateway with retries.
const OVERRIDE_HOST: &str = "tests/fixtures/envoy/istio-override-host.yaml";
/// The cached tokens vLLM reports for a prompt of `len` tokens whose first `held` tokens' blocks
/// a pod holds: whole blocks, the last token always recomputed.
fn vllm_cached(held: usize, len: usize) -> u32 {
    let blocks =
        (held / support::picker::BLOCK).min(len.saturating_sub(1) / support::picker::BLOCK);
    (blocks * support::picker::BLOCK) as u32
}

/// The picker's prediction counts, by result.
fn predictions(gw: &Gateway, result: &str) -> f64 {
    gw.metric(&format!(
        "kvindexer_picker_predictions_total{{result=\"{result}\"}}"
    ))
}

fn prompt_ids(seed: u32, n: u32) -> Vec<u32> {
    (0..n).map(|i| 1000 + seed * 7919 + i).collect()
}

/// The prefix holder serves; negative control: prompts nobody holds (each different from its
/// first token, so no recorded pick favours a pod) do not all land on one pod.
async fn the_holder_serves(mut gw: Gateway) {
    let ids = prompt_ids(1, 80);
    gw.fleet.store(&gw.pods[1].name, &ids).await;
    gw.fleet.store(&gw.pods[0].name, &prompt_ids(2, 80)).await;
    gw.fleet.store(&gw.pods[2].name, &prompt_ids(3, 80)).await;
    gw.fleet.scraped(3, 2).await;
    for _ in 0..5 {
        let r = gw.completions(&ids).await;
        assert_eq!(gw.served(&r), gw.pod(1));
    }
    let got = gw.pods[1].state().received();
    assert_eq!(got.len(), 5, "the holder got each request once");
    assert!(got.iter().all(|g| g.path == COMPLETIONS));
    let mut servers = std::collections::BTreeSet::new();
    for i in 0..30 {
        let r = gw.completions(&prompt_ids(100 + i, 40)).await;
        servers.insert(gw.served(&r).to_owned());
    }
    assert!(servers.len() > 1, "equal pods share the picks: {servers:?}");
    gw.fleet.daemon.shutdown().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn gie_e2e_config_over_h2c_routes_to_the_prefix_holder() {
    let Some(gw) = Gateway::start(3, support::picker::config(None), GIE).await else {
        return;
    };
    the_holder_serves(gw).await;
}

/// The daemon's config with the picker (and gRPC) on TLS with the test certificates in `dir`.
fn tls_config(dir: &std::path::Path) -> Config {
    let mut c = support::picker::config(None);
    c.server.tls.cert_file = dir.join("server.pem").display().to_string();
    c.server.tls.key_file = dir.join("server.key").display().to_string();
    c
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn gie_e2e_config_over_tls_routes_to_the_prefix_holder() {
    let dir = support::temp_dir("envoy-tls");
    if !support::tls::certificates_or_skip(&dir) {
        return;
    }
    let Some(gw) = Gateway::start(3, tls_config(&dir), GIE_TLS).await else {
        return;
    };
    the_holder_serves(gw).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn gie_e2e_config_over_tls_to_a_self_signed_picker_routes_to_the_prefix_holder() {
    // The Helm chart's default: the picker's own certificate, which GIE's gateway does not
    // verify (as GIE's EPP serves by default).
    let mut c = support::picker::config(None);
    c.endpoint_picker.tls.mode = kv_indexer::config::PickerTlsMode::SelfSigned;
    let Some(gw) = Gateway::start(3, c, GIE_TLS).await else {
        return;
    };
    the_holder_serves(gw).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_plaintext_gateway_gets_nothing_from_a_tls_picker() {
    // Negative control of the TLS case: the h2c configuration against the same TLS picker.
    let dir = support::temp_dir("envoy-tls-control");
    if !support::tls::certificates_or_skip(&dir) {
        return;
    }
    let Some(mut gw) = Gateway::start(1, tls_config(&dir), GIE).await else {
        return;
    };
    let ids = prompt_ids(3, 48);
    gw.fleet.store(&gw.pods[0].name, &ids).await;
    let r = gw.completions(&ids).await;
    assert!(r.status >= 500, "{r:?}");
    assert_eq!(gw.received(), 0, "nothing routed without a pick");
    gw.fleet.daemon.shutdown().await;
}

/// A chat the tiny tokenizer knows every word of: `system` repeated `times`, then a question.
fn chat_messages(system: &str, times: usize) -> Vec<(String, String)> {
    vec![
        ("system".into(), vec![system; times].join(" ")),
        ("user".into(), "what should i do first ?".into()),
    ]
}

/// The token ids the daemon renders `messages` to (its chat template, the generation prompt as
/// vLLM's chat endpoint adds it), with the tokenizer in `dir`.
fn chat_ids(dir: &std::path::Path, messages: &[(String, String)]) -> Vec<u32> {
    use kv_tokenize::{ChatInput, ChatMessage, LoadedTokenizer};
    let tok = LoadedTokenizer::from_files(MODEL, &dir.join("tokenizer.json")).expect("loads");
    let input = ChatInput {
        messages: messages
            .iter()
            .map(|(role, content)| ChatMessage {
                role: role.clone(),
                content: content.clone(),
            })
            .collect(),
        add_generation_prompt: true,
        ..Default::default()
    };
    tok.encode_chat(&input).expect("renders").1.ids
}

fn chat_body(messages: &[(String, String)]) -> Vec<u8> {
    let messages: Vec<Value> = messages
        .iter()
        .map(|(role, content)| json!({"role": role, "content": content}))
        .collect();
    json!({"model": MODEL, "messages": messages, "max_tokens": 3})
        .to_string()
        .into_bytes()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_chat_prompt_lands_on_its_holder() {
    let dir = support::temp_dir("envoy-chat");
    support::tiny_tokenizer(&dir);
    let c = support::picker::config(Some(&dir));
    let Some(mut gw) = Gateway::start(3, c, GIE).await else {
        return;
    };
    let first = chat_messages(
        "you are helpful assistant . answer question about kubernetes",
        4,
    );
    let second = chat_messages("the quick brown fox jumps over the lazy dog .", 4);
    let (b, c) = (gw.pods[1].name.clone(), gw.pods[2].name.clone());
    for (pod, chat) in [(1, &first), (2, &second)] {
        let ids = chat_ids(&dir, chat);
        gw.fleet.store(&gw.pods[pod].name, &ids).await;
        // The holder reports what vLLM would reuse: the pick must predict exactly that.
        gw.pods[pod]
            .state()
            .set_cached_tokens(Some(vllm_cached(ids.len(), ids.len())));
    }
    gw.fleet.store(&gw.pods[0].name, &prompt_ids(18, 48)).await;
    gw.fleet.scraped(3, 2).await;
    // The tokenizer loads on the first request; a pick that cannot wait for it goes on load
    // alone (counted as picked_without_prefix): warm it first.
    let picked = "kvindexer_picker_picks_total{outcome=\"picked\"}";
    for _ in 0..60 {
        gw.envoy.post(CHAT, &chat_body(&first)).await;
        if gw.metric(picked) > 0.0 {
            break;
        }
    }
    assert!(gw.metric(picked) > 0.0, "the tokenizer never loaded");
    // Negative control: the second chat goes to its own holder, not to the first's. Each pick
    // predicts every block its holder has (the rendered tokens are the ones it stored).
    let exact = predictions(&gw, "exact");
    for _ in 0..3 {
        let r = gw.envoy.post(CHAT, &chat_body(&first)).await;
        assert_eq!(gw.served(&r), b);
        let r = gw.envoy.post(CHAT, &chat_body(&second)).await;
        assert_eq!(gw.served(&r), c);
    }
    predicted(&gw, "exact", exact + 6.0).await;
    assert_eq!(gw.pods[0].state().received().len(), 0);
    gw.fleet.daemon.shutdown().await;
}

const CHAT: &str = "/v1/chat/completions";

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_deep_queue_loses_behind_envoy() {
    let Some(mut gw) = Gateway::start(2, support::picker::config(None), GIE).await else {
        return;
    };
    let ids = prompt_ids(4, 80);
    gw.fleet.store(&gw.pods[0].name, &ids).await;
    gw.fleet.store(&gw.pods[1].name, &ids).await;
    // The negative control is the second round: the same pods, the loads swapped.
    for (deep, short) in [(0, 1), (1, 0)] {
        gw.pods[deep].set_load(40, 0.3);
        gw.pods[short].set_load(0, 0.3);
        gw.fleet.scraped(2, 3).await;
        for _ in 0..5 {
            let r = gw.completions(&ids).await;
            assert_eq!(gw.served(&r), gw.pod(short));
        }
    }
    gw.fleet.daemon.shutdown().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_garbage_body_is_400_and_the_next_request_is_served() {
    let Some(mut gw) = Gateway::start(1, support::picker::config(None), GIE).await else {
        return;
    };
    let ids = prompt_ids(5, 48);
    gw.fleet.store(&gw.pods[0].name, &ids).await;
    for garbage in [
        &b"\x00\x01\xffgarbage{"[..],
        b"{\"model\": \"Qwen/Qwen3-8B\"}",
    ] {
        let r = gw.envoy.post(COMPLETIONS, garbage).await;
        assert_eq!(r.status, 400, "{r:?}");
        let error: Value = serde_json::from_slice(&r.body).expect("a JSON error");
        assert_eq!(error["error"]["type"], "BadRequest", "{error}");
        assert_eq!(gw.received(), 0, "a refused request reaches no pod");
    }
    // Negative control: the next, good, request is served.
    let r = gw.completions(&ids).await;
    assert_eq!(gw.served(&r), gw.pod(0));
    assert_eq!(
        gw.metric("kvindexer_picker_picks_total{outcome=\"bad_request\"}"),
        2.0
    );
    gw.fleet.daemon.shutdown().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn bodies_reach_the_pod_byte_for_byte() {
    let Some(mut gw) = Gateway::start(1, support::picker::config(None), GIE).await else {
        return;
    };
    let pod = gw.pods[0].name.clone();
    let small = prompt_ids(6, 48);
    gw.fleet.store(&pod, &small).await;
    // 20,000 token ids: a ~130 KB body, more than 64 KiB and than the listener's 32 KiB buffer,
    // in several ext_proc chunks each way.
    let large = prompt_ids(7, 20_000);
    for ids in [&small, &large] {
        let body =
            json!({"model": MODEL, "prompt": ids, "max_tokens": 3, "note": "x\u{e9}\u{1F600}"})
                .to_string()
                .into_bytes();
        let r = gw.envoy.post(COMPLETIONS, &body).await;
        assert_eq!(gw.served(&r), pod);
        let got = gw.pods[0].state().received().pop().expect("received");
        assert_eq!(
            got.body,
            body,
            "the body, byte for byte ({} bytes)",
            body.len()
        );
        // Envoy 1.40 drops Content-Length in FULL_DUPLEX_STREAMED, and ignores the one the
        // picker sets back: the pod gets the body chunked (HTTP/1.1 servers must read it).
        assert_eq!(got.content_length, None, "{} bytes", body.len());
        assert_eq!(got.transfer_encoding.as_deref(), Some("chunked"));
    }
    // Negative control of the framing check: straight to the pod, the Content-Length arrives.
    let body = json!({"model": MODEL, "prompt": small}).to_string();
    let direct = reqwest::Client::new()
        .post(format!("http://{pod}{COMPLETIONS}"))
        .body(body.clone())
        .send()
        .await
        .expect("the pod answers");
    assert_eq!(direct.status(), 200);
    let got = gw.pods[0].state().received().pop().expect("received");
    assert_eq!(got.content_length, Some(body.len().to_string()));
    assert_eq!(got.transfer_encoding, None);
    gw.fleet.daemon.shutdown().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_picker_stopped_is_a_5xx_and_nothing_is_routed() {
    let Some(mut gw) = Gateway::start(2, support::picker::config(None), GIE).await else {
        return;
    };
    let ids = prompt_ids(8, 48);
    gw.fleet.store(&gw.pods[0].name, &ids).await;
    // Negative control: while the picker serves, the request is served.
    let r = gw.completions(&ids).await;
    assert_eq!(gw.served(&r), gw.pod(0));
    gw.fleet.daemon.shutdown().await;
    for _ in 0..3 {
        let r = gw
            .envoy
            .post(
                COMPLETIONS,
                json!({"model": MODEL, "prompt": ids})
                    .to_string()
                    .as_bytes(),
            )
            .await;
        assert!(r.status >= 500, "{r:?}");
    }
    let received: usize = gw.pods.iter().map(|p| p.state().received().len()).sum();
    assert_eq!(received, 1, "no pod got a request without a pick");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_8000_token_prompt_lands_on_its_holder() {
    use kv_tokenize::LoadedTokenizer;
    let dir = support::temp_dir("envoy-8k");
    let vocab = support::tiny_tokenizer(&dir);
    let Some(mut gw) = Gateway::start(3, support::picker::config(Some(&dir)), GIE).await else {
        return;
    };
    // Token ids: two prompts of 8,005 tokens (not a whole number of blocks, see
    // `the_last_token_of_an_aligned_prompt_is_not_predicted_cached`), each held by its own pod
    // (each other's control).
    let (a, b) = (prompt_ids(9, 8_005), prompt_ids(10, 8_005));
    gw.fleet.store(&gw.pods[0].name, &a).await;
    gw.fleet.store(&gw.pods[1].name, &b).await;
    // Text: 8,000 words of the tiny tokenizer's vocabulary, tokenized by the daemon.
    let words: Vec<&str> = vocab[5..].iter().map(String::as_str).collect();
    let text: Vec<&str> = (0..8_000)
        .map(|i| words[(i * 7 + i / 13) % words.len()])
        .collect();
    let text = text.join(" ");
    let tok = LoadedTokenizer::from_files(MODEL, &dir.join("tokenizer.json")).expect("loads");
    let text_ids = tok.encode_prompt(&text).expect("encodes").ids;
    assert!(text_ids.len() > 8_000, "{}", text_ids.len());
    gw.fleet.store(&gw.pods[2].name, &text_ids).await;
    gw.fleet.scraped(3, 2).await;
    // Each holder reports what vLLM would reuse, for the pick's prediction to be held against.
    for (pod, len) in [(0, a.len()), (1, b.len()), (2, text_ids.len())] {
        gw.pods[pod]
            .state()
            .set_cached_tokens(Some(vllm_cached(len, len)));
    }
    let text_body = json!({"model": MODEL, "prompt": text, "max_tokens": 3}).to_string();
    // The tokenizer loads on the first text; its first pick with the prefix tokenizes the whole
    // text: exactly the tokens pod 2 holds.
    for _ in 0..60 {
        let r = gw.envoy.post(COMPLETIONS, text_body.as_bytes()).await;
        assert_eq!(r.status, 200);
        if predictions(&gw, "exact") > 0.0 {
            break;
        }
    }
    predicted(&gw, "exact", 1.0).await;
    assert_eq!(predictions(&gw, "under") + predictions(&gw, "over"), 0.0);
    for _ in 0..3 {
        assert_eq!(gw.served(&gw.completions(&a).await), gw.pod(0));
        assert_eq!(gw.served(&gw.completions(&b).await), gw.pod(1));
        let r = gw.envoy.post(COMPLETIONS, text_body.as_bytes()).await;
        assert_eq!(gw.served(&r), gw.pod(2));
    }
    // The token ids predicted exactly; a repeated text reads the tokenizer's prefix store,
    // whose hit covers the text's stored blocks only: its tail is not predicted (under).
    predicted(&gw, "exact", 7.0).await;
    assert_eq!(
        predictions(&gw, "exact") + predictions(&gw, "under"),
        10.0,
        "every response measured, none over-predicted"
    );
    gw.fleet.daemon.shutdown().await;
}

/// Waits until the daemon's metric `name_and_labels` reaches `want` (what a response tells the
/// picker arrives as the client reads it).
async fn metric_reaches(gw: &Gateway, name_and_labels: &str, want: f64) {
    for _ in 0..200 {
        if gw.metric(name_and_labels) >= want {
            return;
        }
        tokio::time::sleep(Duration::from_millis(25)).await;
    }
    let page = gw.fleet.daemon.metrics_text();
    let lines: Vec<&str> = page.lines().filter(|l| l.contains("picker")).collect();
    panic!(
        "{name_and_labels} never reached {want}:\n{}",
        lines.join("\n")
    );
}

/// Waits until the prediction count for `result` reaches `want`.
async fn predicted(gw: &Gateway, result: &str, want: f64) {
    let name = format!("kvindexer_picker_predictions_total{{result=\"{result}\"}}");
    metric_reaches(gw, &name, want).await;
}

/// A gateway on `file` whose picker lists two fallbacks after each pick.
async fn with_fallbacks(file: &str) -> Option<Gateway> {
    let mut c = support::picker::config(None);
    c.endpoint_picker.fallbacks = 2;
    Gateway::start(3, c, file).await
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn cached_tokens_are_held_against_the_prediction() {
    let Some(mut gw) = Gateway::start(1, support::picker::config(None), GIE).await else {
        return;
    };
    let held = prompt_ids(11, 80);
    gw.fleet.store(&gw.pods[0].name, &held).await;
    // The prompt: the 5 held blocks and 7 more tokens; vLLM reuses 5 x 16 = 80.
    let mut ids = held.clone();
    ids.extend(prompt_ids(12, 7));
    assert_eq!(vllm_cached(held.len(), ids.len()), 80);
    let error_sum = "kvindexer_picker_prediction_error_tokens_sum";
    for (prompt, cached, result, error) in [
        (&ids, Some(80), "exact", 0.0),
        (&ids, Some(64), "over", 16.0),
        (&ids, Some(96), "under", -16.0),
        (&ids, None, "no_cached_tokens", 0.0),
    ] {
        gw.pods[0].state().set_cached_tokens(cached);
        let (before, sum) = (predictions(&gw, result), gw.metric(error_sum));
        let r = gw.completions(prompt).await;
        assert_eq!(gw.served(&r), gw.pod(0));
        let usage: Value = serde_json::from_slice(&r.body).expect("JSON");
        assert_eq!(
            usage["usage"]["prompt_tokens"],
            prompt.len(),
            "the answer reached the client"
        );
        predicted(&gw, result, before + 1.0).await;
        assert_eq!(gw.metric(error_sum) - sum, error, "{cached:?}");
    }
    gw.fleet.daemon.shutdown().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_last_token_of_an_aligned_prompt_is_not_predicted_cached() {
    let Some(mut gw) = Gateway::start(1, support::picker::config(None), GIE).await else {
        return;
    };
    // 80 tokens, all 5 blocks held: vLLM recomputes the last token, so it reuses 4 blocks.
    let ids = prompt_ids(19, 80);
    gw.fleet.store(&gw.pods[0].name, &ids).await;
    gw.pods[0]
        .state()
        .set_cached_tokens(Some(vllm_cached(80, 80)));
    assert_eq!(vllm_cached(80, 80), 64);
    let r = gw.completions(&ids).await;
    assert_eq!(gw.served(&r), gw.pod(0));
    // Negative control: one token more and the 5 blocks are reused.
    let mut longer = ids.clone();
    longer.push(7);
    gw.pods[0]
        .state()
        .set_cached_tokens(Some(vllm_cached(80, 81)));
    let r = gw.completions(&longer).await;
    assert_eq!(gw.served(&r), gw.pod(0));
    predicted(&gw, "exact", 2.0).await;
    gw.fleet.daemon.shutdown().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_streamed_response_arrives_whole_in_order_and_its_usage_is_read() {
    let Some(mut gw) = Gateway::start(1, support::picker::config(None), GIE).await else {
        return;
    };
    let ids = prompt_ids(13, 96);
    gw.fleet.store(&gw.pods[0].name, &ids).await;
    let pod = gw.pods[0].state();
    // 96 tokens, 6 blocks held: vLLM recomputes the last token, so it reuses 5 blocks.
    pod.set_cached_tokens(Some(80));
    pod.hold_streams(true);
    for include_usage in [true, false] {
        let result = if include_usage { "exact" } else { "no_usage" };
        let before = predictions(&gw, result);
        let body = json!({"model": MODEL, "prompt": ids, "stream": true,
                          "stream_options": {"include_usage": include_usage}});
        let mut r = gw
            .envoy
            .client()
            .post(gw.envoy.url(COMPLETIONS))
            .body(body.to_string())
            .send()
            .await
            .expect("Envoy answers");
        assert_eq!(r.status(), 200);
        // The first event arrives while the pod holds the rest: nothing buffers the stream.
        let first = r.chunk().await.expect("a chunk").expect("the first event");
        assert!(first.starts_with(b"data: "), "{first:?}");
        pod.release_stream();
        let mut got = first.to_vec();
        while let Some(chunk) = r.chunk().await.expect("the stream goes on") {
            got.extend_from_slice(&chunk);
        }
        let sent = pod.received().pop().expect("received").answered;
        assert_eq!(got, sent, "the stream whole and in order");
        assert!(got.ends_with(b"data: [DONE]\n\n"));
        // Without include_usage no event carries usage: counted as such (the control).
        predicted(&gw, result, before + 1.0).await;
    }
    gw.fleet.daemon.shutdown().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn override_host_retries_on_a_fallback_when_the_pick_is_down() {
    let Some(mut gw) = with_fallbacks(OVERRIDE_HOST).await else {
        return;
    };
    // The pick A holds the prompt, B its first two blocks, C none of it: the list is A,B,C.
    let (ids, other) = (prompt_ids(14, 80), prompt_ids(15, 80));
    for prompt in [&ids, &other] {
        gw.fleet.store(&gw.pods[0].name, prompt).await;
        gw.fleet.store(&gw.pods[1].name, &prompt[..32]).await;
    }
    gw.fleet.store(&gw.pods[2].name, &prompt_ids(16, 32)).await;
    gw.fleet.scraped(3, 2).await;
    let elsewhere = "kvindexer_picker_served_elsewhere_total";
    // Negative control: the pick up, it serves, and nothing is served elsewhere.
    for _ in 0..3 {
        let r = gw.completions(&ids).await;
        assert_eq!(gw.served(&r), gw.pod(0));
    }
    assert_eq!(gw.metric(elsewhere), 0.0);
    // The pick's pod closes its connections unanswered (its metrics still served, so it is
    // still picked): Envoy retries on the next endpoint of the list.
    gw.pods[0].state().set_health(Health::InferenceDown);
    // The first fallback, B, serves (round robin, which Envoy falls back on past the list,
    // would pick B or C).
    let r = gw.completions(&ids).await;
    assert_eq!(gw.served(&r), gw.pod(1));
    assert!(
        gw.envoy
            .stat("cluster.inference_pool.upstream_rq_retry")
            .await
            >= 1
    );
    // Envoy reported the host that served (override_host's selected_host_key).
    metric_reaches(&gw, elsewhere, 1.0).await;
    assert_eq!(gw.metric(elsewhere), 1.0);
    // The routing is recorded for the pod that served, so later picks may name B first:
    // either way B serves.
    for _ in 0..3 {
        assert_eq!(gw.served(&gw.completions(&ids).await), gw.pod(1));
    }
    // A fully down (its metrics page too): another prompt it alone holds whole is still picked
    // to it first (the index says so), and retried on B.
    gw.pods[0].state().set_health(Health::Down);
    let before = gw.metric(elsewhere);
    assert_eq!(gw.served(&gw.completions(&other).await), gw.pod(1));
    metric_reaches(&gw, elsewhere, before + 1.0).await;
    assert_eq!(
        gw.pods[0].state().received().len(),
        3,
        "only the first three"
    );
    gw.fleet.daemon.shutdown().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_endpoint_list_fails_behind_gie_s_original_dst_gateway() {
    // Why one endpoint is the default: GIE's cluster parses one address, and a list is none.
    let Some(mut gw) = with_fallbacks(GIE).await else {
        return;
    };
    let ids = prompt_ids(17, 48);
    for i in 0..3 {
        gw.fleet.store(&gw.pods[i].name, &ids).await;
    }
    let r = gw.completions(&ids).await;
    assert_eq!(r.status, 503, "{r:?}");
    let invalid = "cluster.original_destination_cluster.original_dst_host_invalid";
    assert!(gw.envoy.stat(invalid).await >= 1, "{}", gw.envoy.log());
    assert_eq!(gw.received(), 0);
    gw.fleet.daemon.shutdown().await;
}
