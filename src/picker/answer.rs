//! The ext_proc messages the picker answers with (the pick as a header mutation and `envoy.lb`
//! metadata, bodies handed back as streamed body responses, immediate responses), and the
//! reading of what Envoy sends along (metadata lists, headers).
//!
//! Invariants: the header `x-gateway-destination-endpoint` and the metadata
//! `envoy.lb/x-gateway-destination-endpoint` always carry the same value; a body handed back is
//! the bytes received, in order, in chunks of at most [`BODY_CHUNK`] bytes.

use std::borrow::Cow;
use std::collections::HashMap;

use envoy_types::pb::envoy::config::core::v3::header_value_option::HeaderAppendAction;
use envoy_types::pb::envoy::config::core::v3::{HeaderValue, HeaderValueOption, Metadata};
use envoy_types::pb::envoy::r#type::v3::{HttpStatus, StatusCode};
use envoy_types::pb::envoy::service::ext_proc::v3::{
    body_mutation, processing_response, BodyMutation, BodyResponse, CommonResponse, HeaderMutation,
    HeadersResponse, HttpHeaders, ImmediateResponse, ProcessingResponse, StreamedBodyResponse,
};
use envoy_types::pb::google::protobuf::{value::Kind, Struct, Value};

use super::choose::Decision;
use super::split::PREFILLER_HEADER;

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

/// A header to set.
pub fn header(key: &str, value: &str) -> HeaderValueOption {
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

/// The pick as a header mutation and as `envoy.lb` dynamic metadata (the same value: the
/// endpoint, then its fallbacks when configured, comma-separated), with the data-parallel rank
/// in `x-data-parallel-rank` and the prefill pod in `x-prefiller-host-port` when the pick names
/// them (else a client's header of that name removed). `content_length`: the
/// request body's length, set back as GIE's EPP does (Envoy drops the header when it streams
/// the body through a processor).
pub fn pick_parts(d: &Decision, content_length: Option<usize>) -> (CommonResponse, Struct) {
    let value = d.endpoints.join(",");
    let mut set_headers = vec![header(DESTINATION, &value)];
    if let Some(len) = content_length {
        set_headers.push(header("content-length", &len.to_string()));
    }
    // The rank and the prefill pod replace whatever a client sent; without them, a client's
    // header is removed, so no client chooses a rank or a prefiller the pick did not.
    let mut remove_headers = Vec::new();
    let rank = d.rank.map(|r| r.to_string());
    for (name, value) in [
        (RANK_HEADER, rank.as_deref()),
        (PREFILLER_HEADER, d.prefiller.as_deref()),
    ] {
        match value {
            Some(v) => set_headers.push(HeaderValueOption {
                append_action: HeaderAppendAction::OverwriteIfExistsOrAdd as i32,
                ..header(name, v)
            }),
            None => remove_headers.push(name.to_owned()),
        }
    }
    let common = CommonResponse {
        header_mutation: Some(HeaderMutation {
            set_headers,
            remove_headers,
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

/// A processing response.
pub fn respond(r: processing_response::Response) -> ProcessingResponse {
    ProcessingResponse {
        response: Some(r),
        ..Default::default()
    }
}

/// The request headers' answer.
pub fn headers_response(common: CommonResponse) -> processing_response::Response {
    processing_response::Response::RequestHeaders(HeadersResponse {
        response: Some(common),
    })
}

/// A request body's answer.
pub fn body_response(common: CommonResponse) -> processing_response::Response {
    processing_response::Response::RequestBody(BodyResponse {
        response: Some(common),
    })
}

/// `body` handed back as streamed body responses (one, empty, for an empty body); the last
/// one carries `end_of_stream`.
pub fn streamed(body: &[u8], request: bool, end_of_stream: bool) -> Vec<ProcessingResponse> {
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
                            end_of_stream: end_of_stream && i == last,
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
pub fn metadata_list(metadata: Option<&Metadata>, ns: &str, key: &str) -> Option<Vec<String>> {
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

/// A header's value (`raw_value`, else `value`), by name in any case.
pub fn header_value<'a>(headers: &'a HttpHeaders, key: &str) -> Option<Cow<'a, str>> {
    let h = headers
        .headers
        .as_ref()?
        .headers
        .iter()
        .find(|h| h.key.eq_ignore_ascii_case(key))?;
    Some(match h.raw_value.is_empty() {
        true => Cow::Borrowed(h.value.as_str()),
        false => String::from_utf8_lossy(&h.raw_value),
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn bodies_are_handed_back_whole_and_in_order() {
        let body: Vec<u8> = (0..150_000u32).map(|i| (i % 251) as u8).collect();
        for end in [true, false] {
            let out = streamed(&body, true, end);
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
            assert_eq!(ends, [false, false, end]);
        }
        assert_eq!(streamed(&[], true, true).len(), 1);
    }

    #[test]
    fn the_header_and_the_metadata_carry_one_value() {
        let d = Decision {
            endpoints: vec!["10.0.0.2:8000".into(), "10.0.0.1:8000".into()],
            targets: Vec::new(),
            rank: Some(1),
            with_prefix: true,
            record: None,
            predicted_tokens: Vec::new(),
            prefiller: None,
        };
        let (common, metadata) = pick_parts(&d, Some(1234));
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
        assert_eq!(value("content-length").as_deref(), Some("1234"));
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
