//! The response side of one request's ext_proc stream: the endpoint that served (a fallback is
//! counted and its routing recorded), the body handed back as it streams (full duplex) or
//! acknowledged, and the response's `usage` held against the pick's prediction of the prefix
//! the engine would reuse there.
//!
//! Invariants: every response message gets exactly one answer per message Envoy expects (a
//! full-duplex body chunk: its bytes back, `end_of_stream` as received); the prediction is
//! compared once per response, and only for a 2xx answer from an endpoint the pick listed.

use std::sync::Arc;

use envoy_types::pb::envoy::config::core::v3::Metadata;
use envoy_types::pb::envoy::service::ext_proc::v3::{
    processing_response, BodyResponse, HeadersResponse, HttpHeaders, ProcessingResponse,
    TrailersResponse,
};

use super::answer::{header_value, metadata_list, respond, streamed, LB_NAMESPACE, SERVED};
use super::choose::{Chooser, Decision};
use super::usage::UsageReader;

/// One response's state.
pub(super) struct ResponseSide {
    chooser: Arc<Chooser>,
    /// Hand response bodies back as streamed responses (full-duplex response mode).
    pub(super) duplex: bool,
    /// The pick, once made.
    pub(super) decision: Option<Decision>,
    /// The endpoint that served (the pick when Envoy does not say).
    served: Option<String>,
    /// Reading `usage`, for a 2xx response.
    usage: Option<UsageReader>,
}

impl ResponseSide {
    pub(super) fn new(chooser: Arc<Chooser>) -> Self {
        Self {
            chooser,
            duplex: true,
            decision: None,
            served: None,
            usage: None,
        }
    }

    /// The response headers: who served, and whether its body is worth reading.
    pub(super) fn headers(
        &mut self,
        h: &HttpHeaders,
        metadata: &Option<Metadata>,
    ) -> Vec<ProcessingResponse> {
        let served = metadata_list(metadata.as_ref(), LB_NAMESPACE, SERVED)
            .and_then(|l| l.into_iter().next())
            .or_else(|| header_value(h, SERVED).map(|v| v.trim().to_owned()));
        self.served(served);
        let ok = header_value(h, ":status").is_some_and(|s| s.trim().starts_with('2'));
        if ok && self.decision.as_ref().is_some_and(|d| d.with_prefix) {
            let content_type = header_value(h, "content-type");
            self.usage = Some(UsageReader::new(content_type.as_deref()));
            if h.end_of_stream {
                self.finish();
            }
        }
        vec![respond(processing_response::Response::ResponseHeaders(
            HeadersResponse::default(),
        ))]
    }

    /// A response body chunk: handed back (full duplex) or acknowledged.
    pub(super) fn body(&mut self, chunk: &[u8], end_of_stream: bool) -> Vec<ProcessingResponse> {
        if let Some(reader) = &mut self.usage {
            reader.feed(chunk);
        }
        if end_of_stream {
            self.finish();
        }
        match self.duplex {
            true => streamed(chunk, false, end_of_stream),
            false => vec![respond(processing_response::Response::ResponseBody(
                BodyResponse::default(),
            ))],
        }
    }

    /// The response trailers (they end the body).
    pub(super) fn trailers(&mut self) -> Vec<ProcessingResponse> {
        self.finish();
        vec![respond(processing_response::Response::ResponseTrailers(
            TrailersResponse::default(),
        ))]
    }

    /// The endpoint Envoy reports as having served: when it is not the pick (a fallback), the
    /// routing is recorded for it too.
    fn served(&mut self, served: Option<String>) {
        let Some(d) = &self.decision else {
            return;
        };
        let first = d.endpoints.first();
        let served = match served {
            Some(s) => s,
            None => match first {
                Some(f) => f.clone(),
                None => return,
            },
        };
        if first != Some(&served) {
            self.chooser.metrics.picker.served_elsewhere();
            if let Some((model, key)) = &d.record {
                // A listed fallback is recorded as its pod and rank; any other address as
                // itself.
                let at = d.endpoints.iter().position(|e| *e == served);
                let (pod, rank) = at
                    .and_then(|i| d.targets.get(i).cloned())
                    .unwrap_or_else(|| (served.clone(), None));
                self.chooser.record(model, &pod, rank, key);
            }
        }
        self.served = Some(served);
    }

    /// Holds the response's usage against the prediction for the endpoint that served.
    fn finish(&mut self) {
        let Some(reader) = self.usage.take() else {
            return;
        };
        let predicted = match (&self.decision, &self.served) {
            (Some(d), Some(served)) => d.predicted_on(served),
            _ => None,
        };
        let metrics = &self.chooser.metrics.picker;
        match (predicted, reader.finish()) {
            (Some(predicted), Some(usage)) => match usage.cached_tokens {
                Some(actual) => metrics.prediction(predicted, actual),
                None => metrics.prediction_unmeasured("no_cached_tokens"),
            },
            (None, _) => metrics.prediction_unmeasured("served_unlisted"),
            (Some(_), None) => metrics.prediction_unmeasured("no_usage"),
        }
    }
}
