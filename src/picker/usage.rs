//! The `usage` a response reports, read as the body streams past: from the final JSON body, or
//! from the last server-sent event that carries it (`stream_options.include_usage`). vLLM's
//! `usage.prompt_tokens_details.cached_tokens` (`--enable-prompt-tokens-details`) is the prefix
//! the engine reused, to hold the pick's prediction against.
//!
//! Invariant: memory per response is bounded whatever its size: a JSON body keeps only its last
//! [`JSON_TAIL`] bytes (vLLM writes `usage` after `choices`, followed only by fields that are
//! null unless asked for), an event stream only its current line (up to [`SSE_LINE`] bytes;
//! longer lines are skipped) and the last usage seen.

use serde::Deserialize;

/// Bytes of a JSON body's end kept to find `usage` in.
pub const JSON_TAIL: usize = 16 << 10;
/// Longest event-stream line read.
pub const SSE_LINE: usize = 64 << 10;

/// What a response's `usage` says of its prompt.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Usage {
    /// `usage.prompt_tokens`.
    pub prompt_tokens: u32,
    /// `usage.prompt_tokens_details.cached_tokens`, when the engine reports it.
    pub cached_tokens: Option<u32>,
}

#[derive(Deserialize)]
struct UsageJson {
    prompt_tokens: Option<u32>,
    prompt_tokens_details: Option<Details>,
}

#[derive(Deserialize)]
struct Details {
    cached_tokens: Option<u32>,
}

/// Reads `usage` from a response body fed chunk by chunk.
#[derive(Debug)]
pub struct UsageReader {
    sse: bool,
    /// JSON: the body's last bytes; SSE: the current line.
    buf: Vec<u8>,
    /// SSE: the current line was over [`SSE_LINE`] and is being skipped.
    skipping: bool,
    found: Option<Usage>,
}

impl UsageReader {
    /// A reader for a body of `content_type` (`text/event-stream`: server-sent events).
    pub fn new(content_type: Option<&str>) -> Self {
        let sse = content_type.is_some_and(|c| {
            c.trim_start()
                .to_ascii_lowercase()
                .starts_with("text/event-stream")
        });
        Self {
            sse,
            buf: Vec::new(),
            skipping: false,
            found: None,
        }
    }

    /// Feeds the next chunk of the body.
    pub fn feed(&mut self, chunk: &[u8]) {
        if !self.sse {
            self.buf.extend_from_slice(chunk);
            if self.buf.len() > JSON_TAIL {
                let cut = self.buf.len() - JSON_TAIL;
                self.buf.drain(..cut);
            }
            return;
        }
        let mut rest = chunk;
        while let Some(end) = rest.iter().position(|&b| b == b'\n') {
            self.push_line_part(&rest[..end]);
            self.end_line();
            rest = &rest[end + 1..];
        }
        self.push_line_part(rest);
    }

    fn push_line_part(&mut self, part: &[u8]) {
        if self.skipping {
            return;
        }
        if self.buf.len() + part.len() > SSE_LINE {
            self.skipping = true;
            self.buf.clear();
            return;
        }
        self.buf.extend_from_slice(part);
    }

    fn end_line(&mut self) {
        if !self.skipping {
            if let Some(usage) = event_usage(&self.buf) {
                self.found = Some(usage);
            }
        }
        self.skipping = false;
        self.buf.clear();
    }

    /// The usage the body reported, once it has ended.
    pub fn finish(mut self) -> Option<Usage> {
        if self.sse {
            self.end_line();
            return self.found;
        }
        last_usage(&self.buf)
    }
}

/// The usage of one `data: {...}` event line, when it carries one.
fn event_usage(line: &[u8]) -> Option<Usage> {
    let line = line.strip_suffix(b"\r").unwrap_or(line);
    let data = line.strip_prefix(b"data:")?;
    last_usage(data)
}

/// The value of the last `"usage":` key in `text` that parses as a usage object.
fn last_usage(text: &[u8]) -> Option<Usage> {
    const KEY: &[u8] = b"\"usage\"";
    let mut end = text.len();
    while let Some(at) = text[..end].windows(KEY.len()).rposition(|w| w == KEY) {
        let after = &text[at + KEY.len()..];
        let after = trim_start(after);
        if let Some(value) = after.strip_prefix(b":") {
            let mut values = serde_json::Deserializer::from_slice(value).into_iter::<UsageJson>();
            if let Some(Ok(u)) = values.next() {
                if let Some(prompt_tokens) = u.prompt_tokens {
                    return Some(Usage {
                        prompt_tokens,
                        cached_tokens: u.prompt_tokens_details.and_then(|d| d.cached_tokens),
                    });
                }
            }
        }
        end = at;
    }
    None
}

fn trim_start(mut b: &[u8]) -> &[u8] {
    while let [first, rest @ ..] = b {
        if !first.is_ascii_whitespace() {
            break;
        }
        b = rest;
    }
    b
}

#[cfg(test)]
mod tests {
    use super::*;

    fn read(content_type: Option<&str>, body: &[u8], chunk: usize) -> Option<Usage> {
        let mut r = UsageReader::new(content_type);
        for part in body.chunks(chunk) {
            r.feed(part);
        }
        r.finish()
    }

    #[test]
    fn a_json_body_s_usage_is_read_at_any_chunking() {
        let choices = "x".repeat(100_000);
        let body = format!(
            r#"{{"id":"c","choices":[{{"text":"{choices}"}}],"usage":{{"prompt_tokens":8209,
            "total_tokens":8217,"completion_tokens":8,"prompt_tokens_details":{{"cached_tokens":8192}}}},
            "prompt_logprobs":null,"kv_transfer_params":null}}"#
        );
        for chunk in [1, 7, 4096, 1 << 20] {
            assert_eq!(
                read(Some("application/json"), body.as_bytes(), chunk),
                Some(Usage {
                    prompt_tokens: 8209,
                    cached_tokens: Some(8192)
                }),
                "chunk {chunk}"
            );
        }
        let plain = r#"{"usage":{"prompt_tokens":5,"prompt_tokens_details":null}}"#;
        assert_eq!(
            read(None, plain.as_bytes(), 3),
            Some(Usage {
                prompt_tokens: 5,
                cached_tokens: None
            })
        );
        // Negative controls: no usage, a usage that is null, a body cut inside it.
        assert_eq!(read(None, br#"{"choices":[]}"#, 4), None);
        assert_eq!(read(None, br#"{"usage":null}"#, 4), None);
        assert_eq!(read(None, br#"{"usage":{"prompt_tok"#, 4), None);
    }

    #[test]
    fn an_event_stream_s_last_usage_is_read() {
        let body = "data: {\"choices\":[{\"delta\":{\"content\":\"a\"}}],\"usage\":null}\n\n\
                    data: {\"choices\":[{\"delta\":{\"content\":\"\\\"usage\\\"\"}}]}\r\n\r\n\
                    data: {\"choices\":[],\"usage\":{\"prompt_tokens\":40,\"completion_tokens\":2,\
                    \"prompt_tokens_details\":{\"cached_tokens\":32}}}\n\n\
                    data: [DONE]\n\n";
        for chunk in [1, 5, 64, 10_000] {
            assert_eq!(
                read(
                    Some("text/event-stream; charset=utf-8"),
                    body.as_bytes(),
                    chunk
                ),
                Some(Usage {
                    prompt_tokens: 40,
                    cached_tokens: Some(32)
                }),
                "chunk {chunk}"
            );
        }
        // Without include_usage no event carries it.
        let none = "data: {\"choices\":[],\"usage\":null}\n\ndata: [DONE]\n\n";
        assert_eq!(read(Some("text/event-stream"), none.as_bytes(), 3), None);
    }

    #[test]
    fn memory_stays_bounded() {
        let mut r = UsageReader::new(Some("text/event-stream"));
        let long = vec![b'a'; SSE_LINE * 3];
        r.feed(b"data: ");
        r.feed(&long);
        assert!(r.buf.len() <= SSE_LINE);
        r.feed(b"\ndata: {\"usage\":{\"prompt_tokens\":3}}\n");
        assert_eq!(r.finish().map(|u| u.prompt_tokens), Some(3));
        let mut r = UsageReader::new(None);
        for _ in 0..10 {
            r.feed(&long);
        }
        assert!(r.buf.len() <= JSON_TAIL);
    }
}
