//! The endpoint picker's test fleet: a daemon with `endpointPicker` on, fake vLLM pods (each an
//! HTTP server on a loopback address of its own, `127.0.0.<n>:<port>`, named so as vLLM's topic
//! names a pod: its `/metrics` page, and OpenAI requests answered, `support::pod_http`),
//! publishing KV events over ZMQ, and an ext_proc client generated from Envoy's protos
//! (envoy-types, the crate the daemon serves with).

use std::collections::HashMap;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;
use std::time::Duration;

use super::pod_http::PodState;
use envoy_types::pb::envoy::config::core::v3::{HeaderMap, HeaderValue, Metadata};
use envoy_types::pb::envoy::extensions::filters::http::ext_proc::v3::processing_mode::BodySendMode;
use envoy_types::pb::envoy::service::ext_proc::v3::{
    body_mutation, external_processor_client::ExternalProcessorClient, processing_request,
    processing_response, CommonResponse, HttpBody, HttpHeaders, ProcessingRequest,
    ProcessingResponse, ProtocolConfiguration,
};
use envoy_types::pb::google::protobuf::{value::Kind, ListValue, Struct, Value};
use kv_core::{RequestExtras, TokenProcessor, TokenProcessorConfig};
use kv_indexer::config::{Config, ConfigDuration, ModelConfig};
use kv_indexer::daemon::{self, RunningDaemon};
use zeromq::{PubSocket, SocketSend};

/// The model the picker tests route.
pub const MODEL: &str = "Qwen/Qwen3-8B";
/// The fleet's block size and hash seed (the daemon's and the fake pods' hashing agree).
pub const BLOCK: usize = 16;
const SEED: &str = "12345";

/// A loopback address of its own for the next fake pod (`127.0.0.10` to `127.0.0.250`, in turn;
/// Linux routes all of 127/8 to the loopback interface).
pub fn pod_address() -> std::net::Ipv4Addr {
    static NEXT: AtomicU64 = AtomicU64::new(0);
    let n = NEXT.fetch_add(1, Ordering::Relaxed) % 241;
    std::net::Ipv4Addr::new(127, 0, 0, 10 + n as u8)
}

/// A port free on every loopback address the fake pods use (an InferencePool's target port).
pub fn shared_port() -> u16 {
    let probe = std::net::TcpListener::bind("127.0.0.1:0").expect("binds");
    probe.local_addr().expect("addr").port()
}

/// A fake vLLM pod: its load on `/metrics`, and OpenAI requests served, recorded and answered
/// with `usage` (`support::pod_http`), on an address of its own.
pub struct FakePod {
    /// Its name, `127.0.0.<n>:<port>`: each pod its own address, as pods have on a cluster.
    pub name: String,
    state: Arc<PodState>,
    task: tokio::task::JoinHandle<()>,
}

impl FakePod {
    /// A pod serving on a fresh loopback port.
    pub async fn start() -> Self {
        Self::start_at((pod_address(), 0).into()).await
    }

    /// A pod serving on `addr` (port 0: a fresh one); pods of an InferencePool share its
    /// target port, each on an address of its own.
    pub async fn start_at(addr: std::net::SocketAddr) -> Self {
        let listener = tokio::net::TcpListener::bind(addr).await.expect("binds");
        let name = listener.local_addr().expect("addr").to_string();
        let state = Arc::new(PodState::new(name.clone()));
        let task = tokio::spawn(super::pod_http::serve(state.clone(), listener, MODEL));
        Self { name, state, task }
    }

    /// Sets the load its page reports.
    pub fn set_load(&self, waiting: u64, usage: f64) {
        self.state.waiting.store(waiting, Ordering::Relaxed);
        self.state
            .usage_millis
            .store((usage * 1000.0) as u64, Ordering::Relaxed);
    }

    /// What it serves, and what it recorded.
    pub fn state(&self) -> &PodState {
        &self.state
    }
}

impl Drop for FakePod {
    fn drop(&mut self) {
        self.task.abort();
    }
}

/// The daemon, its event publisher and the block hashing vLLM would do.
pub struct Fleet {
    /// The daemon.
    pub daemon: RunningDaemon,
    publisher: PubSocket,
    processor: TokenProcessor,
    seq: HashMap<String, u64>,
}

/// The picker's test config: loopback listeners, the picker on, `tokenizer` for [`MODEL`].
pub fn config(tokenizer: Option<&std::path::Path>) -> Config {
    let mut c = super::loopback_config();
    c.indexer_config.token_processor_config.hash_seed = Some(SEED.into());
    c.indexer_config.token_processor_config.block_size = BLOCK;
    c.indexer_config.tokenizers_pool_config.offline = true;
    c.models.insert(
        MODEL.into(),
        ModelConfig {
            tokenizer: tokenizer.map(|t| t.display().to_string()),
            ..Default::default()
        },
    );
    c.endpoint_picker.enabled = true;
    c.endpoint_picker.addr = "127.0.0.1:0".into();
    c.endpoint_picker.metrics_interval = ConfigDuration::millis(20);
    c.endpoint_picker.metrics_stale_after = ConfigDuration::millis(2000);
    c
}

impl Fleet {
    /// Starts a daemon with `c`.
    pub async fn start(c: Config) -> Self {
        let daemon = daemon::start(c).await.expect("daemon starts");
        let publisher = super::pods::connect(&daemon).await;
        let processor = TokenProcessor::new(&TokenProcessorConfig {
            hash_seed: Some(SEED.into()),
            block_size: BLOCK,
            ..Default::default()
        })
        .expect("valid");
        Self {
            daemon,
            publisher,
            processor,
            seq: HashMap::new(),
        }
    }

    /// An ext_proc client of the daemon's picker.
    pub async fn client(&self) -> ExternalProcessorClient<tonic::transport::Channel> {
        let addr = self.daemon.picker_addr.expect("the picker is on");
        ExternalProcessorClient::connect(format!("http://{addr}"))
            .await
            .expect("ext_proc connects")
    }

    /// Publishes `pod` storing every full block of `ids` (with their token ids, as vLLM does),
    /// until the index holds them all.
    pub async fn store(&mut self, pod: &str, ids: &[u32]) {
        self.store_with(pod, ids, RequestExtras::default()).await;
    }

    /// [`Fleet::store`] for a request with `extras` (a LoRA adapter, a cache salt), hashed as
    /// vLLM hashes such a request; the daemon must take the engine's hashes as keys
    /// (`engineHashes: aligned`), since the events do not carry the salt.
    pub async fn store_with(&mut self, pod: &str, ids: &[u32], extras: RequestExtras) {
        self.store_as((pod, 0), ids, extras).await;
    }

    /// [`Fleet::store`] from data-parallel rank `rank` of `pod`.
    pub async fn store_ranked(&mut self, pod: &str, rank: i64, ids: &[u32]) {
        self.store_as((pod, rank), ids, RequestExtras::default())
            .await;
    }

    async fn store_as(&mut self, (pod, rank): (&str, i64), ids: &[u32], extras: RequestExtras) {
        let lora = extras.lora.as_ref().map(|l| l.name.clone());
        let salt = extras.cache_salt.clone();
        let hashes = self.processor.block_hashes(ids, &extras);
        assert!(!hashes.is_empty(), "the prompt must have full blocks");
        let tokens = &ids[..hashes.len() * BLOCK];
        // Each rank is a publisher of its own, with its own sequence.
        let seq = self.seq.entry(format!("{pod}#{rank}")).or_default();
        for _ in 0..200 {
            let msg =
                super::pods::ranked_token_message(MODEL, (pod, rank), *seq, &hashes, tokens, BLOCK);
            self.publisher.send(msg).await.expect("send");
            tokio::time::sleep(Duration::from_millis(25)).await;
            let held = self
                .daemon
                .indexer
                .score_tokens(
                    MODEL,
                    &super::past(ids),
                    &[pod],
                    lora.as_deref(),
                    salt.as_deref(),
                )
                .ok()
                .and_then(|r| r.scores.first().map(|s| s.matched_blocks as usize));
            if held == Some(hashes.len()) {
                *seq += 1;
                return;
            }
        }
        panic!("{pod}'s blocks never reached the index");
    }

    /// Waits until the picker has read every pod's page at least `rounds` times over.
    pub async fn scraped(&self, pods: usize, rounds: usize) {
        let want = (pods * rounds) as f64;
        let start = super::metric(
            &self.daemon.metrics_text(),
            "kvindexer_picker_scrapes_total{result=\"ok\"}",
        );
        for _ in 0..500 {
            let now = super::metric(
                &self.daemon.metrics_text(),
                "kvindexer_picker_scrapes_total{result=\"ok\"}",
            );
            if now - start >= want {
                return;
            }
            tokio::time::sleep(Duration::from_millis(10)).await;
        }
        panic!("the pods' metrics were never read");
    }
}

/// Waits until every pod of `pods` has answered `rounds` more metrics reads than when called
/// (the picker then holds a sample each read after the call: reads of one pod are in turn).
pub async fn each_read(pods: &[FakePod], rounds: u64) {
    let start: Vec<u64> = pods.iter().map(|p| p.state().metrics_served()).collect();
    super::pods::eventually(Duration::from_secs(30), "every pod's metrics read", || {
        let done = pods
            .iter()
            .zip(&start)
            .all(|(p, s)| p.state().metrics_served() >= s + rounds);
        async move { done }
    })
    .await;
}

/// The body mode a test announces in `protocol_config` (`None`: no protocol_config).
pub fn protocol(mode: Option<BodySendMode>) -> Option<ProtocolConfiguration> {
    mode.map(|m| ProtocolConfiguration {
        request_body_mode: m as i32,
        response_body_mode: m as i32,
        send_body_without_waiting_for_header_response: false,
    })
}

/// How a subset hint is written in the metadata.
pub enum Hint<'a> {
    /// A comma-separated string.
    Text(&'a str),
    /// A list of strings.
    List(&'a [&'a str]),
}

/// The request-headers message of a POST to `path`.
pub fn headers(
    path: &str,
    mode: Option<BodySendMode>,
    hint: Option<Hint<'_>>,
    end_of_stream: bool,
) -> ProcessingRequest {
    let header = |k: &str, v: &str| HeaderValue {
        key: k.into(),
        raw_value: v.as_bytes().to_vec(),
        ..Default::default()
    };
    let metadata = hint.map(|h| {
        let value = match h {
            Hint::Text(s) => Kind::StringValue(s.into()),
            Hint::List(l) => Kind::ListValue(ListValue {
                values: l
                    .iter()
                    .map(|s| Value {
                        kind: Some(Kind::StringValue((*s).into())),
                    })
                    .collect(),
            }),
        };
        Metadata {
            filter_metadata: HashMap::from([(
                "envoy.lb.subset_hint".to_owned(),
                Struct {
                    fields: HashMap::from([(
                        "x-gateway-destination-endpoint-subset".to_owned(),
                        Value { kind: Some(value) },
                    )]),
                },
            )]),
            ..Default::default()
        }
    });
    ProcessingRequest {
        request: Some(processing_request::Request::RequestHeaders(HttpHeaders {
            headers: Some(HeaderMap {
                headers: vec![
                    header(":method", "POST"),
                    header(":path", path),
                    header("content-type", "application/json"),
                ],
            }),
            end_of_stream,
            ..Default::default()
        })),
        metadata_context: metadata,
        protocol_config: protocol(mode),
        ..Default::default()
    }
}

/// [`headers`] (no body mode, no hint) with `extra` headers a client sent.
pub fn headers_with(path: &str, extra: &[(&str, &str)]) -> ProcessingRequest {
    let mut m = headers(path, None, None, false);
    if let Some(processing_request::Request::RequestHeaders(h)) = m.request.as_mut() {
        let map = h.headers.get_or_insert_default();
        for (k, v) in extra {
            map.headers.push(HeaderValue {
                key: (*k).into(),
                raw_value: v.as_bytes().to_vec(),
                ..Default::default()
            });
        }
    }
    m
}

/// `body` as request-body messages of at most `chunk` bytes, the last one ending the stream.
pub fn body(body: &[u8], chunk: usize) -> Vec<ProcessingRequest> {
    let parts: Vec<&[u8]> = body.chunks(chunk.max(1)).collect();
    let last = parts.len().saturating_sub(1);
    parts
        .into_iter()
        .enumerate()
        .map(|(i, part)| ProcessingRequest {
            request: Some(processing_request::Request::RequestBody(HttpBody {
                body: part.to_vec(),
                end_of_stream: i == last,
                ..Default::default()
            })),
            ..Default::default()
        })
        .collect()
}

/// Sends `messages` on one stream and collects every answer until the picker ends it.
pub async fn exchange(
    client: &mut ExternalProcessorClient<tonic::transport::Channel>,
    messages: Vec<ProcessingRequest>,
) -> Vec<ProcessingResponse> {
    let (tx, rx) = tokio::sync::mpsc::channel(messages.len().max(1));
    for m in messages {
        tx.send(m).await.expect("queued");
    }
    drop(tx);
    let mut inbound = tokio::time::timeout(
        Duration::from_secs(20),
        client.process(tokio_stream::wrappers::ReceiverStream::new(rx)),
    )
    .await
    .expect("answers in time")
    .expect("Process opens")
    .into_inner();
    let mut out = Vec::new();
    while let Some(r) = tokio::time::timeout(Duration::from_secs(20), inbound.message())
        .await
        .expect("answers in time")
        .expect("a message or the end")
    {
        out.push(r);
    }
    out
}

/// A request's outcome as a test reads it.
#[derive(Debug, Default)]
pub struct Answer {
    /// `x-gateway-destination-endpoint` from a header mutation.
    pub header: Option<String>,
    /// `envoy.lb` / `x-gateway-destination-endpoint` from the dynamic metadata.
    pub metadata: Option<String>,
    /// `x-data-parallel-rank`, when set.
    pub rank: Option<String>,
    /// An ImmediateResponse's status and body.
    pub immediate: Option<(i32, String)>,
    /// The request body handed back as streamed responses, and whether its last part ended
    /// the stream.
    pub streamed: Vec<u8>,
    /// Whether the last streamed part ended the stream.
    pub streamed_end: bool,
    /// Kinds of answers, in order (`headers`, `body`, `immediate`, `response_headers`, ...).
    pub kinds: Vec<&'static str>,
    /// `x-prefiller-host-port` set, and whether it overwrites a client's (append action
    /// `OVERWRITE_IF_EXISTS_OR_ADD`).
    pub prefiller: Option<(String, bool)>,
    /// Headers the answer removes.
    pub removed: Vec<String>,
}

fn read_common(a: &mut Answer, c: &CommonResponse) {
    for h in c
        .header_mutation
        .iter()
        .flat_map(|m| &m.set_headers)
        .filter_map(|h| h.header.as_ref())
    {
        let v = String::from_utf8_lossy(&h.raw_value).into_owned();
        match h.key.as_str() {
            "x-gateway-destination-endpoint" => a.header = Some(v),
            "x-data-parallel-rank" => a.rank = Some(v),
            "x-prefiller-host-port" => a.prefiller = Some((v, false)),
            _ => {}
        }
    }
    for o in c.header_mutation.iter().flat_map(|m| &m.set_headers) {
        let key = o.header.as_ref().map(|h| h.key.as_str());
        if let (Some("x-prefiller-host-port"), Some(p)) = (key, a.prefiller.as_mut()) {
            // OVERWRITE_IF_EXISTS_OR_ADD: a client's value is replaced, not appended to.
            p.1 = o.append_action == 2;
        }
    }
    a.removed.extend(
        c.header_mutation
            .iter()
            .flat_map(|m| m.remove_headers.iter().cloned()),
    );
    if let Some(body_mutation::Mutation::StreamedResponse(s)) =
        c.body_mutation.as_ref().and_then(|b| b.mutation.as_ref())
    {
        a.streamed.extend_from_slice(&s.body);
        a.streamed_end = s.end_of_stream;
    }
}

/// Reads a stream's answers.
pub fn read(responses: &[ProcessingResponse]) -> Answer {
    use processing_response::Response as R;
    let mut a = Answer::default();
    for r in responses {
        if let Some(Kind::StructValue(lb)) = r
            .dynamic_metadata
            .as_ref()
            .and_then(|m| m.fields.get("envoy.lb"))
            .and_then(|v| v.kind.clone())
        {
            if let Some(Kind::StringValue(v)) = lb
                .fields
                .get("x-gateway-destination-endpoint")
                .and_then(|v| v.kind.clone())
            {
                a.metadata = Some(v);
            }
        }
        match &r.response {
            Some(R::RequestHeaders(h)) => {
                a.kinds.push("headers");
                if let Some(c) = &h.response {
                    read_common(&mut a, c);
                }
            }
            Some(R::RequestBody(b)) => {
                a.kinds.push("body");
                if let Some(c) = &b.response {
                    read_common(&mut a, c);
                }
            }
            Some(R::ImmediateResponse(i)) => {
                a.kinds.push("immediate");
                a.immediate = Some((
                    i.status.map_or(0, |s| s.code),
                    String::from_utf8_lossy(&i.body).into_owned(),
                ));
            }
            Some(R::StreamedImmediateResponse(_)) => a.kinds.push("streamed_immediate"),
            Some(R::RequestTrailers(_)) => a.kinds.push("request_trailers"),
            Some(R::ResponseHeaders(_)) => a.kinds.push("response_headers"),
            Some(R::ResponseBody(_)) => a.kinds.push("response_body"),
            Some(R::ResponseTrailers(_)) => a.kinds.push("response_trailers"),
            None => a.kinds.push("none"),
        }
    }
    a
}

/// The first endpoint of an answer's pick.
pub fn first(a: &Answer) -> String {
    let h = a
        .header
        .as_deref()
        .unwrap_or_else(|| panic!("no pick: {a:?}"));
    h.split(',').next().unwrap_or_default().to_owned()
}

/// The picker's `kvindexer_picker_picks_total` lines on a metrics page (a failure's message).
pub fn picks_lines(page: &str) -> String {
    page.lines()
        .filter(|l| l.starts_with("kvindexer_picker_picks_total"))
        .collect::<Vec<_>>()
        .join("\n")
}
