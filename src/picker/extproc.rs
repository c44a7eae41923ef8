//! `envoy.service.ext_proc.v3.ExternalProcessor/Process`: one stream per HTTP request, as
//! GIE's endpoint-picker protocol (`docs/proposals/004-endpoint-picker-protocol`) and its
//! reference EPP's handlers answer it.
//!
//! Request side, by the body mode Envoy announces (`protocol_config`; absent: full duplex, as
//! GIE's EPP assumes):
//! - FULL_DUPLEX_STREAMED: the headers' answer waits for the whole body (its end, or the
//!   request trailers); then the pick (header mutation with `Content-Length` set back, and
//!   `envoy.lb` dynamic metadata) and the body handed back unchanged as streamed body responses;
//! - BUFFERED and BUFFERED_PARTIAL: the headers are answered at once; the one body message
//!   (the whole body, whether or not trailers follow it) is answered with the pick; a partial
//!   body that does not parse is picked on load alone (counted as unscored `partial_body`);
//! - STREAMED and NONE (for a request with a body): refused at the first message (500,
//!   `kvindexer_picker_refused_total{bound="body_mode"}`, a log line naming the setting to
//!   change). Envoy forwards the headers, and chooses the upstream, on the headers' answer,
//!   which must come before any body answer; with `send_body_without_waiting_for_header_response`
//!   Envoy sends chunks early, but holds each until it is answered and stops reading the client
//!   past its buffer limit, so a body larger than that never arrives whole while the headers
//!   wait (behind Envoy 1.40 with GIE's 32 KiB limit, a 72 KB body hung until its timeout).
//!
//! Response side (`response`): full duplex unless `protocol_config` announces another response
//! body mode, as GIE's EPP answers it: each chunk handed back as it comes, `usage` read on the
//! way to hold the pick's prediction against.
//!
//! Invariants: a stream ends with an ImmediateResponse (400 unreadable body, 413 a body over
//! `maxBodyBytes`, 429 shed: `maxInFlight` picks, `maxStreams` streams or
//! `maxBufferedBodyBytes` of bodies held, 500 a body mode that cannot carry a pick, 503 no
//! candidate) rather than a gRPC error for anything a client sent; a body's bytes are charged
//! to the shared budget before they are kept and given back once the body is handed on or the
//! stream ends; request trailers, response headers, bodies and trailers are answered
//! unchanged.

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
use super::bounds::{BodyBudget, Charge, StreamSlots};
use super::choose::{Chooser, Decision, Outcome};
use super::response::ResponseSide;
use crate::warn_budget::WarnThrottle;

/// The ext_proc service.
#[derive(Clone)]
pub struct ExtProc {
    pub(super) chooser: Arc<Chooser>,
    pub(super) max_body_bytes: usize,
    /// Every stream's bodies together.
    pub(super) budget: Arc<BodyBudget>,
    /// The streams open at once.
    pub(super) slots: Arc<StreamSlots>,
    /// Warnings about the gateway's body mode (one line per 10 s).
    pub(super) mode_warnings: Arc<WarnThrottle>,
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
        let slot = self.slots.enter();
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
                let (answers, done) = match &slot {
                    Some(_) => stream.handle(message).await,
                    None => stream.too_many_streams(),
                };
                for answer in answers {
                    if tx.send(Ok(answer)).await.is_err() {
                        return;
                    }
                }
                // The body handed on: its bytes go back to the budget.
                stream.settle();
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
    /// Headers answered at once; the pick in the answer to the one body message.
    Buffered,
    /// Envoy picks the upstream before the body reaches the picker (STREAMED waiting for the
    /// headers' answer, or NONE): what to set instead.
    Unpickable(&'static str),
}

/// What a gateway whose body mode cannot carry a pick is told to set.
const BODY_MODE_FIX: &str = "set the ext_proc filter's processing_mode.request_body_mode to \
     FULL_DUPLEX_STREAMED (as GIE's gateways do) or BUFFERED";

/// How a request body ended.
#[derive(Debug, Clone, Copy, PartialEq)]
enum BodyEnd {
    /// Its last chunk was marked `end_of_stream`.
    EndOfStream,
    /// Trailers followed it.
    Trailers,
    /// Envoy buffered it and sent it in one message not marked `end_of_stream` (trailers
    /// follow, or BUFFERED_PARTIAL cut it at Envoy's buffer limit).
    Buffered,
}

/// One HTTP request's state.
struct RequestStream {
    svc: ExtProc,
    mode: Option<Mode>,
    subset: Option<Vec<String>>,
    /// The request's `:path`.
    path: Option<String>,
    body: Vec<u8>,
    /// What `body` holds of the shared budget.
    charge: Charge,
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
            charge: Charge::default(),
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
            Some(c) => match BodySendMode::try_from(c.request_body_mode) {
                Ok(BodySendMode::FullDuplexStreamed) => Mode::FullDuplex,
                Ok(BodySendMode::Buffered | BodySendMode::BufferedPartial) => Mode::Buffered,
                Ok(BodySendMode::Streamed) => Mode::Unpickable("STREAMED"),
                Ok(BodySendMode::None) => Mode::Unpickable("NONE"),
                _ => Mode::Unpickable("an unknown mode"),
            },
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
                    Mode::FullDuplex => (Vec::new(), false),
                    Mode::Unpickable(name) => self.unpickable(name),
                }
            }
            Some(R::RequestBody(b)) => {
                // A buffered body comes whole in one message, whether or not trailers follow.
                let end = match (b.end_of_stream, mode) {
                    (true, _) => Some(BodyEnd::EndOfStream),
                    (false, Mode::Buffered) => Some(BodyEnd::Buffered),
                    (false, _) => None,
                };
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
            return self.too_large();
        }
        if !self.svc.budget.charge(&mut self.charge, chunk.len()) {
            return self.over_budget();
        }
        self.body.extend_from_slice(&chunk);
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
            // Cut at Envoy's buffer limit (BUFFERED_PARTIAL): picked on load alone.
            Err(_) if end == BodyEnd::Buffered => body::PickRequest::partial(self.body.len()),
            Err(e) => return self.refuse(e.reason(), &e.to_string()),
        };
        if let Some(reason) = parsed.unscored {
            self.svc.chooser.metrics.picker.unscored(reason);
        }
        let body = std::mem::take(&mut self.body);
        // Full duplex: the last chunk handed back ends the stream unless trailers follow.
        let ends = end == BodyEnd::EndOfStream;
        self.pick(Some(parsed), move |common| match mode {
            Mode::FullDuplex => {
                let mut out = vec![respond(headers_response(common))];
                out.extend(streamed(&body, true, ends));
                out
            }
            // Refused at the first message; never reaches a body.
            Mode::Buffered | Mode::Unpickable(_) => vec![respond(body_response(common))],
        })
        .await
    }

    /// Lets the body's bytes go back to the budget once the body has been handed on.
    fn settle(&mut self) {
        if self.body.is_empty() {
            self.charge.release();
        }
    }

    /// A 413 for a body over `maxBodyBytes`: logged and counted.
    fn too_large(&mut self) -> (Vec<ProcessingResponse>, bool) {
        let message = format!(
            "the request body exceeds {} bytes (endpointPicker.maxBodyBytes)",
            self.svc.max_body_bytes
        );
        self.refuse_for(
            "body_size",
            StatusCode::PayloadTooLarge,
            "PayloadTooLarge",
            &message,
        )
    }

    /// A 429 for a chunk the shared body budget cannot hold.
    fn over_budget(&mut self) -> (Vec<ProcessingResponse>, bool) {
        let message = format!(
            "the picker holds {} bytes of request bodies at most (endpointPicker.\
             maxBufferedBodyBytes); retry",
            self.svc.budget.limit()
        );
        self.refuse_for(
            "body_budget",
            StatusCode::TooManyRequests,
            "TooManyRequests",
            &message,
        )
    }

    /// A 429 for a stream past `maxStreams`, at its first message.
    fn too_many_streams(&mut self) -> (Vec<ProcessingResponse>, bool) {
        self.refuse_for(
            "streams",
            StatusCode::TooManyRequests,
            "TooManyRequests",
            "the picker serves endpointPicker.maxStreams requests at once; retry",
        )
    }

    /// A 500 at the first message of a request whose body mode cannot carry a pick.
    fn unpickable(&mut self, mode: &str) -> (Vec<ProcessingResponse>, bool) {
        let message = format!(
            "the gateway sends request bodies in mode {mode}, which picks the upstream before \
             the body reaches the endpoint picker: {BODY_MODE_FIX}"
        );
        if let Some(suppressed) = self.svc.mode_warnings.allow() {
            tracing::error!(suppressed, "endpoint picker: {message}");
        }
        let (code, kind) = (StatusCode::InternalServerError, "InternalServerError");
        self.refuse_for("body_mode", code, kind, &message)
    }

    /// An immediate answer for a request a bound refused: counted by `bound`.
    fn refuse_for(
        &mut self,
        bound: &'static str,
        code: StatusCode,
        kind: &str,
        message: &str,
    ) -> (Vec<ProcessingResponse>, bool) {
        let metrics = &self.svc.chooser.metrics;
        metrics.bounds.refused(bound);
        let outcome = match code {
            StatusCode::TooManyRequests => "shed",
            StatusCode::PayloadTooLarge => "too_large",
            _ => "refused",
        };
        metrics.picker.pick(outcome, None);
        if bound != "body_mode" {
            tracing::debug!(bound, %message, "endpoint picker: request refused");
        }
        self.body = Vec::new();
        self.charge.release();
        (vec![immediate(code, kind, message)], true)
    }

    /// A 400 for a body the picker cannot read: logged and counted.
    fn refuse(&mut self, reason: &'static str, message: &str) -> (Vec<ProcessingResponse>, bool) {
        let metrics = &self.svc.chooser.metrics.picker;
        metrics.bad_request(reason);
        metrics.pick("bad_request", None);
        tracing::warn!(reason, error = %message, "endpoint picker: unreadable request body (400)");
        self.body = Vec::new();
        self.charge.release();
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
