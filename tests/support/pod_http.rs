//! A fake vLLM pod's HTTP/1.1 server (the picker tests' `FakePod`): any GET is its `/metrics`
//! page (one request a connection), any POST an OpenAI request, read whole (Content-Length or
//! chunked), recorded as received for the test to inspect, and answered as vLLM answers: a JSON
//! body with `usage`, or, for `"stream": true`, server-sent events (the usage in a last event
//! with `"choices":[]` when `stream_options.include_usage` is true) and `data: [DONE]`.
//!
//! Invariants: a POST is recorded before its answer is written (a test that has the answer sees
//! the record); a pod that is down closes the connection without answering; connections that
//! carry POSTs are kept alive (Envoy pools them).

use std::sync::atomic::{AtomicBool, AtomicI64, AtomicU64, AtomicU8, Ordering};
use std::sync::{Arc, Mutex};

use serde_json::{json, Value};
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::{TcpListener, TcpStream};
use tokio::sync::Notify;

/// Largest request head read.
const MAX_HEAD: usize = 64 << 10;

/// A POST the pod received.
#[derive(Debug, Clone)]
pub struct Received {
    /// The request's path.
    pub path: String,
    /// Its `Content-Length` header as received.
    pub content_length: Option<String>,
    /// Its `Transfer-Encoding` header as received.
    pub transfer_encoding: Option<String>,
    /// The body's bytes (de-chunked).
    pub body: Vec<u8>,
    /// The body the pod answered with, whole (every event of a stream).
    pub answered: Vec<u8>,
    /// Every header line received (names lower-cased), in order.
    pub headers: Vec<(String, String)>,
}

impl Received {
    /// Every value of the header `name` (lower case), one per header line.
    pub fn values(&self, name: &str) -> Vec<String> {
        self.headers
            .iter()
            .filter(|(k, _)| k == name)
            .map(|(_, v)| v.clone())
            .collect()
    }
}

/// Whether a pod serves.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Health {
    /// Inference and metrics.
    Up = 0,
    /// Metrics only: an inference request's connection is closed unanswered.
    InferenceDown = 1,
    /// Nothing: every connection is closed at once.
    Down = 2,
}

/// What a pod's server shares with its test.
pub struct PodState {
    /// The pod's name (`ip:port`), its `x-served-by`.
    pub name: String,
    /// `vllm:num_requests_waiting`.
    pub waiting: AtomicU64,
    /// `vllm:kv_cache_usage_perc`, in thousandths.
    pub usage_millis: AtomicU64,
    /// `usage.prompt_tokens_details.cached_tokens` answered (negative: not reported).
    cached: AtomicI64,
    health: AtomicU8,
    received: Mutex<Vec<Received>>,
    /// Streams pause after their first event until released.
    hold: AtomicBool,
    release: Notify,
    /// How long a metrics page takes to answer, ms (a busy pod's API server).
    metrics_delay_ms: AtomicU64,
    /// Metrics pages answered so far.
    metrics_served: AtomicU64,
}

impl PodState {
    /// A pod `name` that is up, idle, and reports no cached tokens (vLLM's default).
    pub fn new(name: String) -> Self {
        Self {
            name,
            waiting: AtomicU64::new(0),
            usage_millis: AtomicU64::new(100),
            cached: AtomicI64::new(-1),
            health: AtomicU8::new(Health::Up as u8),
            received: Mutex::new(Vec::new()),
            hold: AtomicBool::new(false),
            release: Notify::new(),
            metrics_delay_ms: AtomicU64::new(0),
            metrics_served: AtomicU64::new(0),
        }
    }

    /// Makes every metrics page answer `delay` late (inference answers at once).
    pub fn set_metrics_delay(&self, delay: std::time::Duration) {
        self.metrics_delay_ms
            .store(delay.as_millis() as u64, Ordering::Relaxed);
    }

    /// Metrics pages answered so far.
    pub fn metrics_served(&self) -> u64 {
        self.metrics_served.load(Ordering::Relaxed)
    }

    /// Sets the cached tokens answered (`None`: `prompt_tokens_details` is null).
    pub fn set_cached_tokens(&self, cached: Option<u32>) {
        self.cached
            .store(cached.map_or(-1, i64::from), Ordering::Relaxed);
    }

    /// Sets whether it serves.
    pub fn set_health(&self, h: Health) {
        self.health.store(h as u8, Ordering::Relaxed);
    }

    fn health(&self) -> Health {
        match self.health.load(Ordering::Relaxed) {
            0 => Health::Up,
            1 => Health::InferenceDown,
            _ => Health::Down,
        }
    }

    /// The POSTs received so far.
    pub fn received(&self) -> Vec<Received> {
        self.received.lock().expect("not poisoned").clone()
    }

    /// Makes streams pause after their first event (until [`PodState::release_stream`]).
    pub fn hold_streams(&self, hold: bool) {
        self.hold.store(hold, Ordering::Relaxed);
    }

    /// Lets one held stream go on.
    pub fn release_stream(&self) {
        self.release.notify_one();
    }

    fn metrics_page(&self, model: &str) -> String {
        format!(
            "# TYPE vllm:num_requests_waiting gauge\n\
             vllm:num_requests_waiting{{model_name=\"{model}\"}} {}.0\n\
             vllm:num_requests_running{{model_name=\"{model}\"}} 1.0\n\
             vllm:kv_cache_usage_perc{{model_name=\"{model}\"}} {}\n",
            self.waiting.load(Ordering::Relaxed),
            self.usage_millis.load(Ordering::Relaxed) as f64 / 1000.0
        )
    }
}

/// Serves `listener` until the task is aborted; `model` names the metrics' model.
pub async fn serve(state: Arc<PodState>, listener: TcpListener, model: &'static str) {
    while let Ok((s, _)) = listener.accept().await {
        tokio::spawn(connection(state.clone(), s, model));
    }
}

/// A request's head.
struct Head {
    method: String,
    path: String,
    /// Lower-cased names.
    headers: Vec<(String, String)>,
}

impl Head {
    fn get(&self, name: &str) -> Option<&str> {
        self.headers
            .iter()
            .find(|(k, _)| k == name)
            .map(|(_, v)| v.as_str())
    }
}

/// A connection with what has been read past the last request.
struct Conn {
    s: TcpStream,
    buf: Vec<u8>,
}

impl Conn {
    async fn fill(&mut self) -> bool {
        let mut tmp = [0u8; 16 << 10];
        match self.s.read(&mut tmp).await {
            Ok(0) | Err(_) => false,
            Ok(n) => {
                self.buf.extend_from_slice(&tmp[..n]);
                true
            }
        }
    }

    /// The bytes up to `delim` (consumed with it).
    async fn until(&mut self, delim: &[u8]) -> Option<Vec<u8>> {
        loop {
            if let Some(i) = self.buf.windows(delim.len()).position(|w| w == delim) {
                let mut out: Vec<u8> = self.buf.drain(..i + delim.len()).collect();
                out.truncate(i);
                return Some(out);
            }
            if self.buf.len() > MAX_HEAD || !self.fill().await {
                return None;
            }
        }
    }

    async fn take(&mut self, n: usize) -> Option<Vec<u8>> {
        while self.buf.len() < n {
            if !self.fill().await {
                return None;
            }
        }
        Some(self.buf.drain(..n).collect())
    }

    async fn head(&mut self) -> Option<Head> {
        let text = String::from_utf8(self.until(b"\r\n\r\n").await?).ok()?;
        let mut lines = text.split("\r\n");
        let mut first = lines.next()?.split(' ');
        let (method, path) = (first.next()?.to_owned(), first.next()?.to_owned());
        let headers = lines
            .filter_map(|l| l.split_once(':'))
            .map(|(k, v)| (k.trim().to_ascii_lowercase(), v.trim().to_owned()))
            .collect();
        Some(Head {
            method,
            path,
            headers,
        })
    }

    /// The request's body: chunked, or of its Content-Length, or empty.
    async fn body(&mut self, head: &Head) -> Option<Vec<u8>> {
        let chunked = head
            .get("transfer-encoding")
            .is_some_and(|t| t.to_ascii_lowercase().contains("chunked"));
        if !chunked {
            let len = head
                .get("content-length")
                .map_or(Some(0), |l| l.parse().ok())?;
            return self.take(len).await;
        }
        let mut body = Vec::new();
        loop {
            let line = String::from_utf8(self.until(b"\r\n").await?).ok()?;
            let size = usize::from_str_radix(line.split(';').next()?.trim(), 16).ok()?;
            if size == 0 {
                // Trailers, up to the empty line.
                while !self.until(b"\r\n").await?.is_empty() {}
                return Some(body);
            }
            body.extend(self.take(size).await?);
            self.take(2).await?;
        }
    }
}

async fn connection(state: Arc<PodState>, s: TcpStream, model: &'static str) {
    if state.health() == Health::Down {
        return;
    }
    let mut conn = Conn { s, buf: Vec::new() };
    loop {
        let Some(head) = conn.head().await else {
            return;
        };
        let health = state.health();
        if head.method != "POST" {
            if health == Health::Down {
                return;
            }
            let delay = state.metrics_delay_ms.load(Ordering::Relaxed);
            if delay > 0 {
                tokio::time::sleep(std::time::Duration::from_millis(delay)).await;
            }
            let page = state.metrics_page(model);
            let response = format!(
                "HTTP/1.1 200 OK\r\ncontent-type: text/plain\r\ncontent-length: {}\r\n\
                 connection: close\r\n\r\n{page}",
                page.len()
            );
            if conn.s.write_all(response.as_bytes()).await.is_ok() {
                state.metrics_served.fetch_add(1, Ordering::Relaxed);
            }
            return;
        }
        if health != Health::Up {
            return;
        }
        let Some(body) = conn.body(&head).await else {
            return;
        };
        let close = head.get("connection") == Some("close");
        if !answer(&state, &mut conn.s, &head, body).await || close {
            return;
        }
    }
}

/// The prompt's token count as the pod tells it: token ids counted, text counted in words (the
/// fake pod does not tokenize).
fn prompt_tokens(request: &Value) -> usize {
    let words = |v: &Value| v.as_str().map_or(0, |s| s.split_whitespace().count());
    match (&request["prompt"], &request["messages"]) {
        (Value::Array(items), _) if items.iter().all(Value::is_number) => items.len(),
        (Value::Array(items), _) => items.iter().map(words).sum(),
        (p @ Value::String(_), _) => words(p),
        (_, Value::Array(messages)) => messages.iter().map(|m| words(&m["content"])).sum(),
        _ => 0,
    }
}

/// Answers one POST as vLLM would; `false` when the connection broke.
async fn answer(state: &PodState, s: &mut TcpStream, head: &Head, body: Vec<u8>) -> bool {
    let request: Value = serde_json::from_slice(&body).unwrap_or(Value::Null);
    let chat = head.path.ends_with("/chat/completions");
    let prompt = prompt_tokens(&request);
    let cached = state.cached.load(Ordering::Relaxed);
    let usage = json!({
        "prompt_tokens": prompt,
        "total_tokens": prompt + 3,
        "completion_tokens": 3,
        "prompt_tokens_details": (cached >= 0).then(|| json!({"cached_tokens": cached})),
    });
    let base = json!({
        "id": format!("cmpl-{}", state.name),
        "object": if chat { "chat.completion" } else { "text_completion" },
        "created": 1_700_000_000,
        "model": request["model"],
    });
    let parts: Vec<Vec<u8>> = match request["stream"] == true {
        false => vec![whole_body(base, chat, usage).into_bytes()],
        true => {
            let include_usage = request["stream_options"]["include_usage"] == true;
            events(base, chat, include_usage.then_some(usage))
        }
    };
    state.received.lock().expect("not poisoned").push(Received {
        path: head.path.clone(),
        content_length: head.get("content-length").map(str::to_owned),
        transfer_encoding: head.get("transfer-encoding").map(str::to_owned),
        body,
        answered: parts.concat(),
        headers: head.headers.clone(),
    });
    write_answer(state, s, request["stream"] == true, &parts).await
}

/// A non-streamed answer's body.
fn whole_body(mut base: Value, chat: bool, usage: Value) -> String {
    base["choices"] = match chat {
        true => json!([{"index": 0, "message": {"role": "assistant", "content": "one two three"},
                        "finish_reason": "stop"}]),
        false => json!([{"index": 0, "text": "one two three", "finish_reason": "stop"}]),
    };
    base["usage"] = usage;
    base.to_string()
}

/// A stream's events: three chunks, the usage event when asked for, `[DONE]`.
fn events(base: Value, chat: bool, usage: Option<Value>) -> Vec<Vec<u8>> {
    let mut out = Vec::new();
    for word in ["one", " two", " three"] {
        let mut e = base.clone();
        e["object"] = json!(if chat {
            "chat.completion.chunk"
        } else {
            "text_completion"
        });
        e["choices"] = match chat {
            true => json!([{"index": 0, "delta": {"content": word}, "finish_reason": null}]),
            false => json!([{"index": 0, "text": word, "finish_reason": null}]),
        };
        out.push(format!("data: {e}\n\n").into_bytes());
    }
    if let Some(usage) = usage {
        let mut e = base;
        e["choices"] = json!([]);
        e["usage"] = usage;
        out.push(format!("data: {e}\n\n").into_bytes());
    }
    out.push(b"data: [DONE]\n\n".to_vec());
    out
}

/// Writes the answer: one body with its length, or each event as a chunk of its own (a held
/// stream waits after the first).
async fn write_answer(
    state: &PodState,
    s: &mut TcpStream,
    stream: bool,
    parts: &[Vec<u8>],
) -> bool {
    let name = &state.name;
    if !stream {
        let body = &parts[0];
        let head = format!(
            "HTTP/1.1 200 OK\r\ncontent-type: application/json\r\ncontent-length: {}\r\n\
             x-served-by: {name}\r\n\r\n",
            body.len()
        );
        return s.write_all(&[head.as_bytes(), body].concat()).await.is_ok();
    }
    let head = format!(
        "HTTP/1.1 200 OK\r\ncontent-type: text/event-stream; charset=utf-8\r\n\
         transfer-encoding: chunked\r\nx-served-by: {name}\r\n\r\n"
    );
    if s.write_all(head.as_bytes()).await.is_err() {
        return false;
    }
    for (i, part) in parts.iter().enumerate() {
        if i == 1 && state.hold.load(Ordering::Relaxed) {
            state.release.notified().await;
        }
        let chunk = [format!("{:x}\r\n", part.len()).as_bytes(), part, b"\r\n"].concat();
        if s.write_all(&chunk).await.is_err() || s.flush().await.is_err() {
            return false;
        }
    }
    s.write_all(b"0\r\n\r\n").await.is_ok()
}
