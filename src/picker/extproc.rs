//! `envoy.service.ext_proc.v3.ExternalProcessor/Process`: one stream per HTTP request, as
//! GIE's endpoint-picker protocol (`docs/proposals/004-endpoint-picker-protocol`) and its
//! reference EPP's handlers answer it.
//!
//! Request side, by the body mode Envoy announces (`protocol_config`; absent: full duplex, as
//! GIE's EPP assumes):
//! - FULL_DUPLEX_STREAMED: the headers' answer waits for the whole body; then the pick (header
//!   mutation and `envoy.lb` dynamic metadata) and the body handed back unchanged as streamed
//!   body responses (at most [`BODY_CHUNK`] bytes each, the last one ending the stream);
//! - BUFFERED: the headers are answered at once; the body's answer carries the pick;
//! - STREAMED: as full duplex when Envoy sends the body without waiting for the headers'
//!   answer (then each chunk is answered after the pick), else as buffered.
//!
//! Invariants: the header `x-gateway-destination-endpoint` and the metadata
//! `envoy.lb/x-gateway-destination-endpoint` always carry the same value; a stream ends with an
//! ImmediateResponse (400 unreadable body, 429 shed, 503 no candidate) rather than a gRPC error
//! for anything a client sent; response headers, bodies and trailers are answered unchanged.

use std::collections::HashMap;
use std::sync::Arc;
use std::time::Instant;

use envoy_types::pb::envoy::config::core::v3::{HeaderValue, HeaderValueOption, Metadata};
use envoy_types::pb::envoy::extensions::filters::http::ext_proc::v3::processing_mode::BodySendMode;
use envoy_types::pb::envoy::r#type::v3::{HttpStatus, StatusCode};
use envoy_types::pb::envoy::service::ext_proc::v3::{
    body_mutation, external_processor_server::ExternalProcessor, processing_request,
    processing_response, BodyMutation, BodyResponse, CommonResponse, HeaderMutation,
    HeadersResponse, HttpHeaders, ImmediateResponse, ProcessingRequest, ProcessingResponse,
    StreamedBodyResponse, TrailersResponse,
};
use envoy_types::pb::google::protobuf::{value::Kind, Struct, Value};
use tokio::sync::mpsc;
use tokio_stream::wrappers::ReceiverStream;
use tokio_stream::StreamExt;
use tonic::{Request, Response, Status, Streaming};

use super::body;
use super::choose::{Chooser, Decision, Outcome};

/// The pick's header and metadata key.
pub const DESTINATION: &str = "x-gateway-destination-endpoint";
/// The metadata namespace of the pick and of the served endpoint.
pub const LB_NAMESPACE: &str = "envoy.lb";
/// The subset hint's namespace.
pub const SUBSET_NAMESPACE: &str = "envoy.lb.subset_hint";
/// The subset hint's key.
pub const SUBSET_KEY: &str = "x-gateway-destination-endpoint-subset";
/// The endpoint that served, as Envoy reports it.
pub const SERVED: &str = "x-gateway-destination-endpoint-served";
/// The data-parallel rank header (for a data-parallel pod).
pub const RANK_HEADER: &str = "x-data-parallel-rank";
/// Largest streamed body chunk handed back (GIE's EPP: 62,000, under Envoy's 64 KiB).
pub const BODY_CHUNK: usize = 62_000;

/// The ext_proc service.
#[derive(Clone)]
pub struct ExtProc {
    pub(super) chooser: Arc<Chooser>,
    pub(super) max_body_bytes: usize,
}

#[tonic::async_trait]
impl ExternalProcessor for ExtProc {
    type ProcessStream = ReceiverStream<Result<ProcessingResponse, Status>>;

    async fn process(
        &self,
        request: Request<Streaming<ProcessingRequest>>,
    ) -> Result<Response<Self::ProcessStream>, Status> {
        let mut inbound = request.into_inner();
        let (tx, rx) = mpsc::channel(16);
        let mut stream = RequestStream::new(self.clone());
        tokio::spawn(async move {
            while let Some(message) = inbound.next().await {
                let message = match message {
                    Ok(m) => m,
                    Err(s) => {
                        tracing::debug!(code = ?s.code(), "ext_proc stream ended by the proxy");
                        return;
                    }
                };
                let (answers, done) = stream.handle(message).await;
                for answer in answers {
                    if tx.send(Ok(answer)).await.is_err() {
                        return;
                    }
                }
                if done {
                    return;
                }
            }
        });
        Ok(Response::new(ReceiverStream::new(rx)))
    }
}

#[derive(Debug, Clone, Copy, PartialEq)]
enum Mode {
    /// Headers answered after the body; the body handed back as streamed responses.
    FullDuplex,
    /// Headers answered after the body; each body chunk answered (empty) after the pick.
    StreamedDeferred,
    /// Headers answered at once; the pick in the (last) body answer.
    Buffered,
}

/// One HTTP request's state.
struct RequestStream {
    svc: ExtProc,
    mode: Option<Mode>,
    /// Echo response bodies back as streamed responses (full-duplex response mode).
    duplex_response: bool,
    subset: Option<Vec<String>>,
    body: Vec<u8>,
    chunks: usize,
    picked: Option<Decision>,
}

fn header(key: &str, value: &str) -> HeaderValueOption {
    HeaderValueOption {
        header: Some(HeaderValue {
            key: key.to_owned(),
            raw_value: value.as_bytes().to_vec(),
            ..Default::default()
        }),
        ..Default::default()
    }
}

fn string_value(s: &str) -> Value {
    Value {
        kind: Some(Kind::StringValue(s.to_owned())),
    }
}

/// The pick as a header mutation and as `envoy.lb` dynamic metadata (the same value).
fn pick_parts(d: &Decision) -> (CommonResponse, Struct) {
    let value = d.endpoints.join(",");
    let mut set_headers = vec![header(DESTINATION, &value)];
    if let Some(rank) = d.rank {
        set_headers.push(header(RANK_HEADER, &rank.to_string()));
    }
    let common = CommonResponse {
        header_mutation: Some(HeaderMutation {
            set_headers,
            ..Default::default()
        }),
        clear_route_cache: true,
        ..Default::default()
    };
    let lb = Struct {
        fields: HashMap::from([(DESTINATION.to_owned(), string_value(&value))]),
    };
    let metadata = Struct {
        fields: HashMap::from([(
            LB_NAMESPACE.to_owned(),
            Value {
                kind: Some(Kind::StructValue(lb)),
            },
        )]),
    };
    (common, metadata)
}

fn respond(r: processing_response::Response) -> ProcessingResponse {
    ProcessingResponse {
        response: Some(r),
        ..Default::default()
    }
}

fn headers_response(common: CommonResponse) -> processing_response::Response {
    processing_response::Response::RequestHeaders(HeadersResponse {
        response: Some(common),
    })
}

fn body_response(common: CommonResponse) -> processing_response::Response {
    processing_response::Response::RequestBody(BodyResponse {
        response: Some(common),
    })
}

/// `body` handed back as streamed body responses (one, empty, for an empty body).
fn streamed(body: &[u8], request: bool) -> Vec<ProcessingResponse> {
    let mut chunks: Vec<&[u8]> = body.chunks(BODY_CHUNK).collect();
    if chunks.is_empty() {
        chunks.push(&[]);
    }
    let last = chunks.len() - 1;
    chunks
        .into_iter()
        .enumerate()
        .map(|(i, chunk)| {
            let common = CommonResponse {
                body_mutation: Some(BodyMutation {
                    mutation: Some(body_mutation::Mutation::StreamedResponse(
                        StreamedBodyResponse {
                            body: chunk.to_vec(),
                            end_of_stream: i == last,
                            ..Default::default()
                        },
                    )),
                }),
                ..Default::default()
            };
            let body = BodyResponse {
                response: Some(common),
            };
            respond(match request {
                true => processing_response::Response::RequestBody(body),
                false => processing_response::Response::ResponseBody(body),
            })
        })
        .collect()
}

/// An ImmediateResponse with an OpenAI-style JSON error.
pub fn immediate(code: StatusCode, kind: &str, message: &str) -> ProcessingResponse {
    let body = serde_json::json!({
        "error": {"message": message, "type": kind, "code": code as i32}
    });
    respond(processing_response::Response::ImmediateResponse(
        ImmediateResponse {
            status: Some(HttpStatus { code: code as i32 }),
            headers: Some(HeaderMutation {
                set_headers: vec![header("content-type", "application/json")],
                ..Default::default()
            }),
            body: body.to_string().into_bytes(),
            details: format!("kv-indexer endpoint picker: {kind}"),
            ..Default::default()
        },
    ))
}

/// A string or a list of strings in `ns`/`key` of the metadata, split at commas.
fn metadata_list(metadata: Option<&Metadata>, ns: &str, key: &str) -> Option<Vec<String>> {
    let value = metadata?.filter_metadata.get(ns)?.fields.get(key)?;
    let mut out = Vec::new();
    let mut push = |s: &str| {
        out.extend(
            s.split(',')
                .map(str::trim)
                .filter(|e| !e.is_empty())
                .map(str::to_owned),
        )
    };
    match &value.kind {
        Some(Kind::StringValue(s)) => push(s),
        Some(Kind::ListValue(list)) => {
            for v in &list.values {
                if let Some(Kind::StringValue(s)) = &v.kind {
                    push(s);
                }
            }
        }
        _ => {}
    }
    Some(out)
}

fn header_value<'a>(headers: &'a HttpHeaders, key: &str) -> Option<std::borrow::Cow<'a, str>> {
    let h = headers
        .headers
        .as_ref()?
        .headers
        .iter()
        .find(|h| h.key.eq_ignore_ascii_case(key))?;
    Some(match h.raw_value.is_empty() {
        true => std::borrow::Cow::Borrowed(h.value.as_str()),
        false => String::from_utf8_lossy(&h.raw_value),
    })
}

impl RequestStream {
    fn new(svc: ExtProc) -> Self {
        Self {
            svc,
            mode: None,
            duplex_response: false,
            subset: None,
            body: Vec::new(),
            chunks: 0,
            picked: None,
        }
    }

    fn learn_mode(&mut self, m: &ProcessingRequest) {
        if self.mode.is_some() {
            return;
        }
        let duplex = BodySendMode::FullDuplexStreamed as i32;
        self.mode = Some(match &m.protocol_config {
            None => Mode::FullDuplex,
            Some(c) if c.request_body_mode == duplex => Mode::FullDuplex,
            Some(c)
                if c.request_body_mode == BodySendMode::Streamed as i32
                    && c.send_body_without_waiting_for_header_response =>
            {
                Mode::StreamedDeferred
            }
            Some(_) => Mode::Buffered,
        });
        self.duplex_response = m
            .protocol_config
            .as_ref()
            .is_some_and(|c| c.response_body_mode == duplex);
    }

    /// Answers one message; `true` when the stream is done (an ImmediateResponse was sent).
    async fn handle(&mut self, m: ProcessingRequest) -> (Vec<ProcessingResponse>, bool) {
        use processing_request::Request as R;
        self.learn_mode(&m);
        let mode = self.mode.unwrap_or(Mode::FullDuplex);
        match m.request {
            Some(R::RequestHeaders(h)) => {
                self.subset =
                    metadata_list(m.metadata_context.as_ref(), SUBSET_NAMESPACE, SUBSET_KEY);
                if h.end_of_stream {
                    // No body (a GET): pick on load alone, as GIE's EPP picks at random.
                    return self
                        .pick(None, |d| vec![respond(headers_response(d))])
                        .await;
                }
                match mode {
                    Mode::Buffered => (
                        vec![respond(headers_response(CommonResponse::default()))],
                        false,
                    ),
                    Mode::FullDuplex | Mode::StreamedDeferred => (Vec::new(), false),
                }
            }
            Some(R::RequestBody(b)) => {
                if self.body.len() + b.body.len() > self.svc.max_body_bytes {
                    return self.refuse(
                        "too_large",
                        &format!(
                            "the request body exceeds {} bytes (endpointPicker.maxBodyBytes)",
                            self.svc.max_body_bytes
                        ),
                    );
                }
                self.body.extend_from_slice(&b.body);
                self.chunks += 1;
                if !b.end_of_stream {
                    return match mode {
                        Mode::Buffered => (
                            vec![respond(body_response(CommonResponse::default()))],
                            false,
                        ),
                        _ => (Vec::new(), false),
                    };
                }
                let parsed = match body::parse(&self.body) {
                    Ok(r) => r,
                    Err(e) => return self.refuse(e.reason(), &e.to_string()),
                };
                let body = std::mem::take(&mut self.body);
                let chunks = self.chunks;
                self.pick(Some(parsed), move |common| match mode {
                    Mode::FullDuplex => {
                        let mut out = vec![respond(headers_response(common))];
                        out.extend(streamed(&body, true));
                        out
                    }
                    Mode::StreamedDeferred => {
                        let mut out = vec![respond(headers_response(common))];
                        out.extend(
                            (0..chunks).map(|_| respond(body_response(CommonResponse::default()))),
                        );
                        out
                    }
                    Mode::Buffered => vec![respond(body_response(common))],
                })
                .await
            }
            Some(R::RequestTrailers(_)) => (
                vec![respond(processing_response::Response::RequestTrailers(
                    TrailersResponse::default(),
                ))],
                false,
            ),
            Some(R::ResponseHeaders(h)) => {
                let served = metadata_list(m.metadata_context.as_ref(), LB_NAMESPACE, SERVED)
                    .and_then(|l| l.into_iter().next())
                    .or_else(|| header_value(&h, SERVED).map(|v| v.trim().to_owned()));
                self.served(served.as_deref());
                (
                    vec![respond(processing_response::Response::ResponseHeaders(
                        HeadersResponse::default(),
                    ))],
                    false,
                )
            }
            Some(R::ResponseBody(b)) => {
                let answer = match self.duplex_response {
                    true => {
                        let mut out = streamed(&b.body, false);
                        if let Some(processing_response::Response::ResponseBody(BodyResponse {
                            response: Some(c),
                        })) = out.last_mut().and_then(|r| r.response.as_mut())
                        {
                            if let Some(BodyMutation {
                                mutation: Some(body_mutation::Mutation::StreamedResponse(s)),
                            }) = c.body_mutation.as_mut()
                            {
                                s.end_of_stream = b.end_of_stream;
                            }
                        }
                        out
                    }
                    false => vec![respond(processing_response::Response::ResponseBody(
                        BodyResponse::default(),
                    ))],
                };
                (answer, false)
            }
            Some(R::ResponseTrailers(_)) => (
                vec![respond(processing_response::Response::ResponseTrailers(
                    TrailersResponse::default(),
                ))],
                false,
            ),
            None => (Vec::new(), false),
        }
    }

    /// A 400 for a body the picker cannot read: logged and counted.
    fn refuse(&mut self, reason: &'static str, message: &str) -> (Vec<ProcessingResponse>, bool) {
        let metrics = &self.svc.chooser.metrics.picker;
        metrics.bad_request(reason);
        metrics.pick("bad_request", None);
        tracing::warn!(reason, error = %message, "endpoint picker: unreadable request body (400)");
        self.body = Vec::new();
        (
            vec![immediate(StatusCode::BadRequest, "BadRequest", message)],
            true,
        )
    }

    async fn pick(
        &mut self,
        request: Option<body::OpenAiRequest>,
        answer: impl FnOnce(CommonResponse) -> Vec<ProcessingResponse>,
    ) -> (Vec<ProcessingResponse>, bool) {
        let started = Instant::now();
        let chooser = &self.svc.chooser;
        let metrics = &chooser.metrics.picker;
        match chooser.choose(request, self.subset.take()).await {
            Outcome::Picked(d) => {
                metrics.pick(
                    if d.with_prefix {
                        "picked"
                    } else {
                        "picked_without_prefix"
                    },
                    Some(started.elapsed()),
                );
                let (common, metadata) = pick_parts(&d);
                let mut out = answer(common);
                if let Some(first) = out.first_mut() {
                    first.dynamic_metadata = Some(metadata);
                }
                self.picked = Some(d);
                (out, false)
            }
            Outcome::NoCandidates(why) => {
                let (code, kind) = (StatusCode::ServiceUnavailable, "ServiceUnavailable");
                metrics.pick("no_candidates", None);
                tracing::warn!(%why, "endpoint picker: no candidate (503)");
                (vec![immediate(code, kind, &why)], true)
            }
            Outcome::Shed(why) => {
                let (code, kind) = (StatusCode::TooManyRequests, "TooManyRequests");
                metrics.pick("shed", None);
                tracing::warn!(%why, "endpoint picker: shedding (429)");
                (vec![immediate(code, kind, &why)], true)
            }
            Outcome::BadRequest(reason, why) => self.refuse(reason, &why),
        }
    }

    /// The endpoint Envoy reports as having served: when it is not the pick (a fallback), the
    /// routing is recorded for it too.
    fn served(&mut self, served: Option<&str>) {
        let (Some(served), Some(d)) = (served, &self.picked) else {
            return;
        };
        if d.endpoints.first().is_some_and(|first| first == served) {
            return;
        }
        self.svc.chooser.metrics.picker.served_elsewhere();
        if let Some((model, key)) = &d.record {
            self.svc.chooser.record(model, served, None, key);
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn bodies_are_handed_back_whole_and_in_order() {
        let body: Vec<u8> = (0..150_000u32).map(|i| (i % 251) as u8).collect();
        let out = streamed(&body, true);
        assert_eq!(out.len(), 3);
        let mut back = Vec::new();
        let mut ends = Vec::new();
        for r in out {
            let Some(processing_response::Response::RequestBody(BodyResponse {
                response: Some(c),
            })) = r.response
            else {
                panic!("not a request body response")
            };
            let Some(BodyMutation {
                mutation: Some(body_mutation::Mutation::StreamedResponse(s)),
            }) = c.body_mutation
            else {
                panic!("not streamed")
            };
            assert!(s.body.len() <= BODY_CHUNK);
            back.extend(s.body);
            ends.push(s.end_of_stream);
        }
        assert_eq!(back, body);
        assert_eq!(ends, [false, false, true]);
        assert_eq!(streamed(&[], true).len(), 1);
    }

    #[test]
    fn the_header_and_the_metadata_carry_one_value() {
        let d = Decision {
            endpoints: vec!["10.0.0.2:8000".into(), "10.0.0.1:8000".into()],
            rank: Some(1),
            with_prefix: true,
            record: None,
        };
        let (common, metadata) = pick_parts(&d);
        let headers = common
            .header_mutation
            .map(|m| m.set_headers)
            .unwrap_or_default();
        let value = |key: &str| {
            headers
                .iter()
                .filter_map(|h| h.header.as_ref())
                .find(|h| h.key == key)
                .map(|h| String::from_utf8_lossy(&h.raw_value).into_owned())
        };
        assert_eq!(
            value(DESTINATION).as_deref(),
            Some("10.0.0.2:8000,10.0.0.1:8000")
        );
        assert_eq!(value(RANK_HEADER).as_deref(), Some("1"));
        let Some(Kind::StructValue(lb)) = metadata
            .fields
            .get(LB_NAMESPACE)
            .and_then(|v| v.kind.clone())
        else {
            panic!("no envoy.lb")
        };
        assert_eq!(
            lb.fields.get(DESTINATION).and_then(|v| v.kind.clone()),
            Some(Kind::StringValue("10.0.0.2:8000,10.0.0.1:8000".into()))
        );
    }
}
