//! Pods and clients over HTTP, for a gateway in the loop:
//! - `--serve-pods PORT`: every simulated pod is a real HTTP endpoint at its name
//!   (`127.0.0.<10+p>:PORT`, an address of its own on the loopback interface, as pods have on a
//!   cluster), serving vLLM's `/metrics` page (its load) and answering any POST (the OpenAI
//!   API) at once with a short vLLM-shaped completion, the header `x-served-by: <pod>` and
//!   `usage.prompt_tokens` (the prompt's token ids counted, 0 for text);
//! - `--http URL`: the callers send each document as an OpenAI request (a completions body
//!   with token ids, or a chat with `--chat-tokenizer`) to `URL` (a gateway, or a pod
//!   straight), over keep-alive connections, timed from sending to the whole response read.

use std::net::SocketAddr;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use std::time::Instant;

use axum::body::Bytes;
use axum::http::{header, HeaderValue, StatusCode};
use axum::response::{IntoResponse, Response};
use axum::routing::get;
use axum::Router;

use super::args::LoadgenArgs;
use super::calls::gather;
use super::documents::{request_bodies, Document};
use super::error::LoadgenError;

/// Loopback addresses the pods get: `127.0.0.10` onwards.
const FIRST_HOST: u32 = 10;

/// The names of `pods` simulated pods: served at `127.0.0.<10+p>:port`, else the default
/// unroutable `10.200.x.y:8000`.
pub(super) fn pod_names(pods: u32, serve_port: Option<u16>) -> Vec<String> {
    (0..pods)
        .map(|p| match serve_port {
            Some(port) => format!("127.0.0.{}:{port}", FIRST_HOST + p),
            None => format!("10.200.{}.{}:8000", p / 250, p % 250),
        })
        .collect()
}

/// vLLM's answer to a request, as short as it gets.
fn completion(pod: &str, model: &str, body: &[u8]) -> Response {
    let prompt_tokens = serde_json::from_slice::<serde_json::Value>(body)
        .ok()
        .and_then(|v| v.get("prompt").and_then(|p| p.as_array()).map(Vec::len))
        .unwrap_or(0);
    let answer = serde_json::json!({
        "id": "cmpl-kv-indexer-lab",
        "object": "text_completion",
        "model": model,
        "choices": [{"index": 0, "text": " ok", "finish_reason": "length"}],
        "usage": {"prompt_tokens": prompt_tokens, "completion_tokens": 1,
                  "total_tokens": prompt_tokens + 1},
    });
    let mut r = (StatusCode::OK, answer.to_string()).into_response();
    let headers = r.headers_mut();
    headers.insert(
        header::CONTENT_TYPE,
        HeaderValue::from_static("application/json"),
    );
    if let Ok(v) = HeaderValue::from_str(pod) {
        headers.insert("x-served-by", v);
    }
    r
}

/// Serves every pod of `pods` (named `ip:port`) until the process ends.
pub(super) async fn serve_pods(pods: &[String], model: &str) -> Result<(), LoadgenError> {
    for (p, name) in pods.iter().enumerate() {
        let addr: SocketAddr = name
            .parse()
            .map_err(|_| LoadgenError::InvalidArgs("--serve-pods: a pod name is not an ip:port"))?;
        let listener = tokio::net::TcpListener::bind(addr)
            .await
            .map_err(|source| LoadgenError::Metrics {
                addr: name.clone(),
                source,
            })?;
        let page = format!(
            "vllm:num_requests_waiting{{model_name=\"{model}\"}} {}\n\
             vllm:kv_cache_usage_perc{{model_name=\"{model}\"}} 0.5\n",
            p % 4
        );
        let (pod, model) = (name.clone(), model.to_owned());
        let app = Router::new()
            .route("/metrics", get(move || async move { page }))
            .fallback(move |body: Bytes| {
                let (pod, model) = (pod.clone(), model.clone());
                async move { completion(&pod, &model, &body) }
            });
        tokio::spawn(async move {
            let _ = axum::serve(listener, app).await;
        });
    }
    Ok(())
}

async fn http_loop(
    client: reqwest::Client,
    url: String,
    bodies: Arc<Vec<Vec<u8>>>,
    stop: Arc<AtomicBool>,
    offset: usize,
) -> Result<(Vec<u64>, u64), LoadgenError> {
    let mut latencies = Vec::new();
    let mut ok = 0u64;
    let mut i = offset;
    while !stop.load(Ordering::Relaxed) {
        let body = bodies[i % bodies.len()].clone();
        i += 1;
        let t = Instant::now();
        let sent = client
            .post(&url)
            .header(header::CONTENT_TYPE, "application/json")
            .body(body)
            .send()
            .await;
        let done = match sent {
            Ok(r) => {
                let success = r.status().is_success();
                r.bytes().await.is_ok() && success
            }
            Err(_) => false,
        };
        latencies.push(t.elapsed().as_nanos() as u64);
        ok += u64::from(done);
    }
    Ok((latencies, ok))
}

/// Sends the documents as OpenAI requests to `base` (a gateway or a pod) from
/// `score_concurrency` connections for `seconds`; every request's latency (ns, sorted) and
/// how many were answered 2xx.
pub(super) async fn http_phase(
    args: &LoadgenArgs,
    base: &str,
    docs: &Arc<Vec<Document>>,
    seconds: u64,
) -> Result<(Vec<u64>, u64), LoadgenError> {
    let (path, bodies) = request_bodies(&args.model, docs);
    let bodies = Arc::new(bodies);
    let url = format!("{}{path}", base.trim_end_matches('/'));
    let stop = Arc::new(AtomicBool::new(false));
    let mut tasks = Vec::new();
    for c in 0..args.score_concurrency {
        let client = reqwest::Client::builder()
            .pool_max_idle_per_host(1)
            .tcp_nodelay(true)
            .build()
            .map_err(|e| LoadgenError::Task(format!("an HTTP client: {e}")))?;
        tasks.push(tokio::spawn(http_loop(
            client,
            url.clone(),
            bodies.clone(),
            stop.clone(),
            c * 7,
        )));
    }
    gather(tasks, &stop, seconds).await
}
