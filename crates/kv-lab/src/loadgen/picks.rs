//! `--ext-proc`: the callers ask the daemon's endpoint picker instead of ScorePods, as an Envoy
//! gateway would: one ext_proc stream per request (FULL_DUPLEX_STREAMED: headers, the body in
//! 62,000-byte chunks), timed from the first message sent to the headers' answer carrying the
//! pick; the body handed back is drained. With `--pod-metrics`, the load generator also serves
//! each simulated pod's Prometheus page (`/<pod>/metrics`, loopback) for the picker's scraper.

use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use std::time::Instant;

use envoy_types::pb::envoy::config::core::v3::{HeaderMap, HeaderValue};
use envoy_types::pb::envoy::extensions::filters::http::ext_proc::v3::processing_mode::BodySendMode;
use envoy_types::pb::envoy::service::ext_proc::v3::{
    external_processor_client::ExternalProcessorClient, processing_request, processing_response,
    HttpBody, HttpHeaders, ProcessingRequest, ProtocolConfiguration,
};
use tokio::io::{AsyncReadExt, AsyncWriteExt};

use super::args::LoadgenArgs;
use super::calls::{channel, gather};
use super::documents::{request_bodies, Document};
use super::error::LoadgenError;

/// The body chunk Envoy sends at most.
const CHUNK: usize = 62_000;

/// One request's messages: headers (a POST to `path`), then `body` in chunks.
fn messages(path: &str, body: &[u8]) -> Vec<ProcessingRequest> {
    let header = |k: &str, v: &str| HeaderValue {
        key: k.into(),
        raw_value: v.as_bytes().to_vec(),
        ..Default::default()
    };
    let mut out = vec![ProcessingRequest {
        request: Some(processing_request::Request::RequestHeaders(HttpHeaders {
            headers: Some(HeaderMap {
                headers: vec![
                    header(":method", "POST"),
                    header(":path", path),
                    header("content-type", "application/json"),
                ],
            }),
            ..Default::default()
        })),
        protocol_config: Some(ProtocolConfiguration {
            request_body_mode: BodySendMode::FullDuplexStreamed as i32,
            response_body_mode: BodySendMode::FullDuplexStreamed as i32,
            send_body_without_waiting_for_header_response: false,
        }),
        ..Default::default()
    }];
    let chunks: Vec<&[u8]> = body.chunks(CHUNK).collect();
    let last = chunks.len().saturating_sub(1);
    out.extend(
        chunks
            .into_iter()
            .enumerate()
            .map(|(i, c)| ProcessingRequest {
                request: Some(processing_request::Request::RequestBody(HttpBody {
                    body: c.to_vec(),
                    end_of_stream: i == last,
                    ..Default::default()
                })),
                ..Default::default()
            }),
    );
    out
}

/// One pick: `Ok(true)` when the picker answered with a pick, `Ok(false)` for an immediate
/// response (no candidate, shed, refused).
async fn pick_once(
    client: &mut ExternalProcessorClient<tonic::transport::Channel>,
    path: &str,
    body: &[u8],
) -> Result<bool, LoadgenError> {
    let requests = messages(path, body);
    let stream = tokio_stream_iter(requests);
    let mut inbound = client
        .process(stream)
        .await
        .map_err(LoadgenError::Score)?
        .into_inner();
    let mut picked = false;
    while let Some(r) = inbound.message().await.map_err(LoadgenError::Score)? {
        match r.response {
            Some(processing_response::Response::RequestHeaders(_)) => picked = true,
            Some(processing_response::Response::ImmediateResponse(_)) => return Ok(false),
            _ => {}
        }
    }
    Ok(picked)
}

/// A stream of `items` (tonic's request stream).
fn tokio_stream_iter(
    items: Vec<ProcessingRequest>,
) -> impl futures_core::Stream<Item = ProcessingRequest> + Send + 'static {
    struct Iter(std::vec::IntoIter<ProcessingRequest>);
    impl futures_core::Stream for Iter {
        type Item = ProcessingRequest;
        fn poll_next(
            mut self: std::pin::Pin<&mut Self>,
            _: &mut std::task::Context<'_>,
        ) -> std::task::Poll<Option<Self::Item>> {
            std::task::Poll::Ready(self.0.next())
        }
    }
    Iter(items.into_iter())
}

async fn pick_loop(
    mut client: ExternalProcessorClient<tonic::transport::Channel>,
    path: &'static str,
    bodies: Arc<Vec<Vec<u8>>>,
    stop: Arc<AtomicBool>,
    offset: usize,
) -> Result<(Vec<u64>, u64), LoadgenError> {
    let mut latencies = Vec::new();
    let mut picked = 0u64;
    let mut i = offset;
    while !stop.load(Ordering::Relaxed) {
        let body = &bodies[i % bodies.len()];
        i += 1;
        let t = Instant::now();
        let ok = pick_once(&mut client, path, body).await?;
        latencies.push(t.elapsed().as_nanos() as u64);
        picked += u64::from(ok);
    }
    Ok((latencies, picked))
}

/// Asks the picker at `addr` from `score_concurrency` connections for `seconds`; every pick's
/// latency (ns, sorted) and how many were picks (not immediate responses). Documents with a
/// chat go as chat-completions bodies, the others as completions with token ids.
pub(super) async fn pick_phase(
    args: &LoadgenArgs,
    addr: &str,
    docs: &Arc<Vec<Document>>,
    seconds: u64,
) -> Result<(Vec<u64>, u64), LoadgenError> {
    let (path, bodies) = request_bodies(&args.model, docs);
    let bodies = Arc::new(bodies);
    let stop = Arc::new(AtomicBool::new(false));
    let mut tasks = Vec::new();
    for c in 0..args.score_concurrency {
        let client = ExternalProcessorClient::new(channel(addr).await?);
        tasks.push(tokio::spawn(pick_loop(
            client,
            path,
            bodies.clone(),
            stop.clone(),
            c * 7,
        )));
    }
    gather(tasks, &stop, seconds).await
}

/// Serves a vLLM-shaped Prometheus page for any pod at `/<pod>/metrics` on `addr` (loopback),
/// its waiting requests varying by pod, until the process ends.
pub(super) async fn serve_pod_metrics(addr: &str) -> Result<(), LoadgenError> {
    let listener = tokio::net::TcpListener::bind(addr)
        .await
        .map_err(|source| LoadgenError::Metrics {
            addr: addr.to_owned(),
            source,
        })?;
    tokio::spawn(async move {
        while let Ok((mut s, _)) = listener.accept().await {
            tokio::spawn(async move {
                let mut buf = [0u8; 2048];
                let n = s.read(&mut buf).await.unwrap_or(0);
                let path = std::str::from_utf8(&buf[..n])
                    .ok()
                    .and_then(|r| r.split_whitespace().nth(1))
                    .unwrap_or("/");
                let waiting = kv_core::fnv1a(path.as_bytes()) % 4;
                let page = format!(
                    "vllm:num_requests_waiting{{model_name=\"m\"}} {waiting}\n\
                     vllm:kv_cache_usage_perc{{model_name=\"m\"}} 0.5\n"
                );
                let response = format!(
                    "HTTP/1.1 200 OK\r\ncontent-length: {}\r\nconnection: close\r\n\r\n{page}",
                    page.len()
                );
                let _ = s.write_all(response.as_bytes()).await;
            });
        }
    });
    Ok(())
}
