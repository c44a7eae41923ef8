//! The endpoint picker's readers of untrusted HTTP bodies: a request body (any path) read into
//! the prompt to score, and a response body (JSON or server-sent events, in chunks) read for its
//! `usage`. Never a panic; a chat cut is within its messages.
//!
//! Input layout: line 0 is the request's `:path` (empty: none), line 1 the response's
//! content type, the rest the body, fed to both readers; the response reader takes it in
//! chunks whose sizes cycle through the input's first bytes.
#![no_main]

use kv_indexer::picker_body::parse;
use kv_indexer::picker_usage::UsageReader;
use libfuzzer_sys::fuzz_target;

fuzz_target!(|data: &[u8]| {
    let mut parts = data.splitn(3, |&b| b == b'\n');
    let path = parts.next().and_then(|p| std::str::from_utf8(p).ok());
    let content_type = parts.next().and_then(|c| std::str::from_utf8(c).ok());
    let body = parts.next().unwrap_or_default();
    let path = path.filter(|p| !p.is_empty());
    if let Ok(request) = parse(path, body) {
        assert!(!request.model.is_empty());
        assert_eq!(request.body_len, body.len());
        if let Some((cut, messages)) = request.chat_cut() {
            assert!(cut < messages, "cut at {cut} of {messages} messages");
        }
    }
    let mut reader = UsageReader::new(content_type);
    let sizes: Vec<usize> = data.iter().take(8).map(|&b| usize::from(b) + 1).collect();
    let mut rest = body;
    let mut i = 0;
    while !rest.is_empty() {
        let n = sizes.get(i % sizes.len().max(1)).copied().unwrap_or(7).min(rest.len());
        reader.feed(&rest[..n]);
        rest = &rest[n..];
        i += 1;
    }
    let _ = reader.finish();
});
