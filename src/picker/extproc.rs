//! `envoy.service.ext_proc.v3.ExternalProcessor/Process`: one stream per HTTP request, as
//! GIE's endpoint-picker protocol (`docs/proposals/004-endpoint-picker-protocol`) and its
//! reference EPP's handlers answer it.
//!
//! Request side, by the body mode Envoy announces (`protocol_config`; absent: full duplex, as
//! GIE's EPP assumes):
//! - FULL_DUPLEX_STREAMED: the headers' answer waits for the whole body (its end, or the
//!   request trailers); then the pick (header mutation with `Content-Length` set back, and
//!   `envoy.lb` dynamic metadata) and the body handed back unchanged as streamed body responses;
//! - BUFFERED: the headers are answered at once; the body's answer carries the pick;
//! - STREAMED: as full duplex when Envoy sends the body without waiting for the headers'
//!   answer (then each chunk is answered after the pick), else as buffered.
//!
//! Response side (`response`): full duplex unless `protocol_config` announces another response
//! body mode, as GIE's EPP answers it: each chunk handed back as it comes, `usage` read on the
//! way to hold the pick's prediction against.
//!
//! Invariants: a stream ends with an ImmediateResponse (400 unreadable body, 429 shed, 503 no
//! candidate) rather than a gRPC error for anything a client sent; request trailers, response
//! headers, bodies and trailers are answered unchanged.

use std::sync::Arc;
use std::time::Instant;

use envoy_types::pb::envoy::extensions::filters::http::ext_proc::v3::processing_mode::BodySendMode;
use envoy_types::pb::envoy::r#type::v3::StatusCode;
use envoy_types::pb::envoy::service::ext_proc::v3::{
    external_processor_server::ExternalProcessor, processing_request, processing_response,
    CommonResponse, ProcessingRequest, ProcessingResponse, TrailersResponse,
};
use tokio::sync::mpsc;
use tokio_stream::wrappers::ReceiverStream;
use tokio_stream::StreamExt;
use tonic::{Request, Response, Status, Streaming};

use super::answer::{
    body_response, header_value, headers_response, immediate, metadata_list, pick_parts, respond,
    streamed, SUBSET_KEY, SUBSET_NAMESPACE,
};
use super::body;
use super::choose::{Chooser, Decision, Outcome};
use super::response::ResponseSide;

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

/// How a request body ended.
#[derive(Debug, Clone, Copy, PartialEq)]
enum BodyEnd {
    /// Its last chunk was marked `end_of_stream`.
    EndOfStream,
    /// Trailers followed it.
    Trailers,
}

/// One HTTP request's state.
struct RequestStream {
    svc: ExtProc,
    mode: Option<Mode>,
    subset: Option<Vec<String>>,
    /// The request's `:path`.
    path: Option<String>,
    body: Vec<u8>,
    chunks: usize,
    /// The pick was made (the request side is done).
    picked: bool,
    response: ResponseSide,
}

impl RequestStream {
    fn new(svc: ExtProc) -> Self {
        let response = ResponseSide::new(svc.chooser.clone());
        Self {
            svc,
            mode: None,
            subset: None,
            path: None,
            body: Vec::new(),
            chunks: 0,
            picked: false,
            response,
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
        // GIE's EPP streams responses back whatever Envoy announces (or omits).
        self.response.duplex = m
            .protocol_config
            .as_ref()
            .is_none_or(|c| c.response_body_mode == duplex);
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
                self.path = header_value(&h, ":path").map(|p| p.into_owned());
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
                let end = b.end_of_stream.then_some(BodyEnd::EndOfStream);
                self.request_body(mode, b.body, end).await
            }
            Some(R::RequestTrailers(_)) => {
                let trailers = respond(processing_response::Response::RequestTrailers(
                    TrailersResponse::default(),
                ));
                if self.picked || mode == Mode::Buffered {
                    return (vec![trailers], false);
                }
                // The body ended without end_of_stream: its trailers end it.
                let end = Some(BodyEnd::Trailers);
                let (mut out, done) = self.request_body(mode, Vec::new(), end).await;
                if !done {
                    out.push(trailers);
                }
                (out, done)
            }
            Some(R::ResponseHeaders(h)) => (self.response.headers(&h, &m.metadata_context), false),
            Some(R::ResponseBody(b)) => (self.response.body(&b.body, b.end_of_stream), false),
            Some(R::ResponseTrailers(_)) => (self.response.trailers(), false),
            None => (Vec::new(), false),
        }
    }

    /// A request body chunk; at the body's end (`end`), the pick.
    async fn request_body(
        &mut self,
        mode: Mode,
        chunk: Vec<u8>,
        end: Option<BodyEnd>,
    ) -> (Vec<ProcessingResponse>, bool) {
        if self.body.len() + chunk.len() > self.svc.max_body_bytes {
            return self.refuse(
                "too_large",
                &format!(
                    "the request body exceeds {} bytes (endpointPicker.maxBodyBytes)",
                    self.svc.max_body_bytes
                ),
            );
        }
        self.body.extend_from_slice(&chunk);
        self.chunks += 1;
        let Some(end) = end else {
            return match mode {
                Mode::Buffered => (
                    vec![respond(body_response(CommonResponse::default()))],
                    false,
                ),
                _ => (Vec::new(), false),
            };
        };
        let parsed = match body::parse(self.path.as_deref(), &self.body) {
            Ok(r) => r,
            Err(e) => return self.refuse(e.reason(), &e.to_string()),
        };
        if let Some(reason) = parsed.unscored {
            self.svc.chooser.metrics.picker.unscored(reason);
        }
        let body = std::mem::take(&mut self.body);
        let chunks = self.chunks;
        // Full duplex: the last chunk handed back ends the stream unless trailers follow.
        let ends = end == BodyEnd::EndOfStream;
        self.pick(Some(parsed), move |common| match mode {
            Mode::FullDuplex => {
                let mut out = vec![respond(headers_response(common))];
                out.extend(streamed(&body, true, ends));
                out
            }
            Mode::StreamedDeferred => {
                let mut out = vec![respond(headers_response(common))];
                out.extend((0..chunks).map(|_| respond(body_response(CommonResponse::default()))));
                out
            }
            Mode::Buffered => vec![respond(body_response(common))],
        })
        .await
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
        request: Option<body::PickRequest>,
        answer: impl FnOnce(CommonResponse) -> Vec<ProcessingResponse>,
    ) -> (Vec<ProcessingResponse>, bool) {
        let started = Instant::now();
        let chooser = &self.svc.chooser;
        let metrics = &chooser.metrics.picker;
        // Envoy drops Content-Length when it streams the body through a processor; the body
        // goes on unchanged, so its length is set back (as GIE's EPP does).
        let content_length = match (self.mode, &request) {
            (Some(Mode::Buffered), _) | (_, None) => None,
            (_, Some(r)) => Some(r.body_len),
        };
        match chooser.choose(request, self.subset.take()).await {
            Outcome::Picked(d) => {
                let outcome = match d.with_prefix {
                    true => "picked",
                    false => "picked_without_prefix",
                };
                metrics.pick(outcome, Some(started.elapsed()));
                let (common, metadata) = pick_parts(&d, content_length);
                let mut out = answer(common);
                if let Some(first) = out.first_mut() {
                    first.dynamic_metadata = Some(metadata);
                }
                self.picked(d);
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

    fn picked(&mut self, d: Decision) {
        self.picked = true;
        self.response.decision = Some(d);
    }
}
