//! ZMQ topics and endpoints: `kv@<pod>@<model>` parsing, vLLM's data-parallel port offset, and
//! the bind-mode gap-fill endpoint template (vLLM's `replay_endpoint`).
//!
//! Topics come from the network, so they are bounded before anything keeps them: at most
//! [`MAX_TOPIC_LEN`] bytes; a pod is an address (`ip`, `ip:port`, `[v6]:port`, or a DNS name)
//! of at most [`MAX_POD_LEN`] bytes; a model is a HuggingFace-style name of at most
//! [`MAX_MODEL_LEN`] bytes. Error messages quote at most 64 characters of what was sent.

use thiserror::Error;

/// The longest topic accepted, in bytes.
pub const MAX_TOPIC_LEN: usize = 512;
/// The longest pod id accepted, in bytes (defined with the config, which checks it too).
pub use crate::config::MAX_POD_LEN;
/// The longest model name accepted, in bytes.
pub const MAX_MODEL_LEN: usize = 240;

/// Why a topic was rejected.
#[derive(Debug, Error, PartialEq, Eq)]
pub enum TopicError {
    /// Not UTF-8.
    #[error("topic is not UTF-8")]
    NotUtf8,
    /// Longer than [`MAX_TOPIC_LEN`].
    #[error("topic of {0} bytes (at most {MAX_TOPIC_LEN})")]
    TooLong(usize),
    /// Does not start with the configured filter.
    #[error("topic {0:?} does not start with the topic filter")]
    WrongPrefix(String),
    /// No `@` between pod and model, or an empty part.
    #[error("topic {0:?} is not <filter><pod>@<model>")]
    Malformed(String),
    /// The pod part is not an address (characters, length).
    #[error("topic pod {0:?} is not an address (letters, digits, . - _ : [ ]; at most {MAX_POD_LEN} bytes)")]
    BadPod(String),
    /// The model part has characters outside a model name's, or is too long.
    #[error("topic model {0:?} is not a model name (letters, digits, . - _ / : @ +; at most {MAX_MODEL_LEN} bytes)")]
    BadModel(String),
}

impl TopicError {
    /// A bounded metric label.
    pub fn reason(&self) -> &'static str {
        match self {
            TopicError::NotUtf8 | TopicError::WrongPrefix(_) | TopicError::Malformed(_) => {
                "bad_topic"
            }
            TopicError::TooLong(_) => "topic_too_long",
            TopicError::BadPod(_) => "bad_topic_pod",
            TopicError::BadModel(_) => "bad_topic_model",
        }
    }
}

/// At most 64 characters of untrusted text, for error messages and logs.
fn preview(text: &str) -> String {
    match text.char_indices().nth(64) {
        Some((end, _)) => format!("{}...", &text[..end]),
        None => text.to_owned(),
    }
}

/// Whether `pod` is an address kv-indexer accepts as a pod id.
pub fn valid_pod(pod: &str) -> bool {
    !pod.is_empty()
        && pod.len() <= MAX_POD_LEN
        && pod
            .bytes()
            .all(|b| b.is_ascii_alphanumeric() || b".-_:[]".contains(&b))
}

/// Whether `model` is a name kv-indexer accepts as a model.
pub fn valid_model(model: &str) -> bool {
    !model.is_empty()
        && model.len() <= MAX_MODEL_LEN
        && model
            .bytes()
            .all(|b| b.is_ascii_alphanumeric() || b".-_/:@+".contains(&b))
}

/// Splits `kv@<pod>@<model>` (with `filter` = `"kv@"`) into `(pod, model)`. The pod is an `ip`
/// or `ip:port` (IPv6 in brackets); the model may contain `/` and `@`.
pub fn parse_topic<'a>(topic: &'a [u8], filter: &str) -> Result<(&'a str, &'a str), TopicError> {
    if topic.len() > MAX_TOPIC_LEN {
        return Err(TopicError::TooLong(topic.len()));
    }
    let topic = std::str::from_utf8(topic).map_err(|_| TopicError::NotUtf8)?;
    let rest = topic
        .strip_prefix(filter)
        .ok_or_else(|| TopicError::WrongPrefix(preview(topic)))?;
    let (pod, model) = rest
        .split_once('@')
        .ok_or_else(|| TopicError::Malformed(preview(topic)))?;
    if pod.is_empty() || model.is_empty() {
        return Err(TopicError::Malformed(preview(topic)));
    }
    if !valid_pod(pod) {
        return Err(TopicError::BadPod(preview(pod)));
    }
    if !valid_model(model) {
        return Err(TopicError::BadModel(preview(model)));
    }
    Ok((pod, model))
}

/// Whether `text` matches `pattern`, where `*` matches any run of characters (allow-lists).
pub fn glob_match(pattern: &str, text: &str) -> bool {
    let (p, t) = (pattern.as_bytes(), text.as_bytes());
    // Iterative matcher with one backtrack point (the last `*`): O(len(p) * len(t)) worst case.
    let (mut i, mut j) = (0, 0);
    let mut star: Option<(usize, usize)> = None;
    while j < t.len() {
        if i < p.len() && p[i] != b'*' && p[i] == t[j] {
            i += 1;
            j += 1;
        } else if i < p.len() && p[i] == b'*' {
            star = Some((i, j));
            i += 1;
        } else if let Some((si, sj)) = star {
            i = si + 1;
            j = sj + 1;
            star = Some((si, sj + 1));
        } else {
            return false;
        }
    }
    p[i..].iter().all(|&c| c == b'*')
}

/// The host part of a pod id: `10.0.0.1:8000` -> `10.0.0.1`, `[::1]:8000` -> `[::1]`.
pub fn pod_host(pod: &str) -> &str {
    if pod.starts_with('[') {
        return pod
            .split_once(']')
            .map_or(pod, |(h, _)| &pod[..h.len() + 1]);
    }
    match pod.rsplit_once(':') {
        // One colon: host:port. More (bare IPv6): the whole string is the host.
        Some((host, _)) if !host.contains(':') => host,
        _ => pod,
    }
}

/// vLLM's `offset_endpoint_port`: the port after the last `:` plus the data-parallel rank.
pub fn offset_port(endpoint: &str, rank: u32) -> Option<String> {
    if rank == 0 {
        return Some(endpoint.to_owned());
    }
    let (head, port) = endpoint.rsplit_once(':')?;
    let port: u32 = port.parse().ok()?;
    let shifted = u16::try_from(port + rank).ok()?;
    Some(format!("{head}:{shifted}"))
}

/// The gap-fill endpoint (vLLM's `replay_endpoint`) of `pod`'s rank `rank`, from a template
/// like `tcp://{ip}:5558`.
pub fn gap_fill_endpoint(template: &str, pod: &str, rank: u32) -> Option<String> {
    if template.is_empty() {
        return None;
    }
    let port = pod.rsplit_once(':').map(|(_, p)| p).unwrap_or("");
    let filled = template
        .replace("{ip}", pod_host(pod))
        .replace("{port}", port);
    offset_port(&filled, rank)
}

/// A listen endpoint the `zeromq` crate can bind: `*` (all interfaces) becomes `0.0.0.0`.
pub fn bindable(endpoint: &str) -> String {
    endpoint.replacen("tcp://*:", "tcp://0.0.0.0:", 1)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn topics() {
        assert_eq!(
            parse_topic(b"kv@10.0.0.1:8000@Qwen/Qwen3-8B", "kv@"),
            Ok(("10.0.0.1:8000", "Qwen/Qwen3-8B"))
        );
        assert_eq!(
            parse_topic(b"kv@10.0.0.1@m@v2", "kv@"),
            Ok(("10.0.0.1", "m@v2"))
        );
        assert!(matches!(
            parse_topic(b"kv-events", "kv@"),
            Err(TopicError::WrongPrefix(_))
        ));
        assert!(matches!(
            parse_topic(b"kv@pod", "kv@"),
            Err(TopicError::Malformed(_))
        ));
        assert!(matches!(
            parse_topic(b"kv@@m", "kv@"),
            Err(TopicError::Malformed(_))
        ));
        assert_eq!(parse_topic(&[0xff], "kv@"), Err(TopicError::NotUtf8));
    }

    #[test]
    fn topics_are_bounded_by_the_pod_and_model_grammar() {
        assert!(parse_topic(b"kv@10.0.0.1:8000@Qwen/Qwen3-8B", "kv@").is_ok());
        assert!(parse_topic(b"kv@[fd00::1]:8000@meta-llama/Llama-3.1-8B", "kv@").is_ok());
        let long = format!("kv@{}@m", "1".repeat(600));
        assert_eq!(
            parse_topic(long.as_bytes(), "kv@"),
            Err(TopicError::TooLong(long.len()))
        );
        let pod = format!("kv@{}@m", "a".repeat(MAX_POD_LEN + 1));
        assert!(
            matches!(parse_topic(pod.as_bytes(), "kv@"), Err(TopicError::BadPod(p)) if p.len() < 80)
        );
        assert!(matches!(
            parse_topic(b"kv@10.0.0.1 x@m", "kv@"),
            Err(TopicError::BadPod(_))
        ));
        assert!(matches!(
            parse_topic("kv@10.0.0.1@mod\u{0}el".as_bytes(), "kv@"),
            Err(TopicError::BadModel(_))
        ));
        assert_eq!(TopicError::TooLong(1).reason(), "topic_too_long");
    }

    #[test]
    fn glob_patterns_match_as_written() {
        assert!(glob_match("10.42.*:8000", "10.42.7.1:8000"));
        assert!(!glob_match("10.42.*:8000", "10.43.7.1:8000"));
        assert!(!glob_match("10.42.*:8000", "10.42.7.1:8001"));
        assert!(glob_match("*", "anything"));
        assert!(glob_match("a*b*c", "aXXbYYc"));
        assert!(!glob_match("a*b*c", "aXXbYY"));
        assert!(glob_match("exact", "exact"));
        assert!(!glob_match("exact", "exactly"));
    }

    #[test]
    fn gap_fill_endpoints_follow_vllm_port_offsets() {
        assert_eq!(
            gap_fill_endpoint("tcp://{ip}:5558", "10.0.0.1:8000", 0).as_deref(),
            Some("tcp://10.0.0.1:5558")
        );
        assert_eq!(
            gap_fill_endpoint("tcp://{ip}:5558", "10.0.0.1:8000", 2).as_deref(),
            Some("tcp://10.0.0.1:5560")
        );
        assert_eq!(
            gap_fill_endpoint("tcp://{ip}:5558", "[fd00::1]:8000", 1).as_deref(),
            Some("tcp://[fd00::1]:5559")
        );
        assert_eq!(gap_fill_endpoint("", "10.0.0.1", 0), None);
        assert_eq!(
            offset_port("tcp://*:5557", 2).as_deref(),
            Some("tcp://*:5559")
        );
        assert_eq!(bindable("tcp://*:5557"), "tcp://0.0.0.0:5557");
        assert_eq!(pod_host("10.0.0.1"), "10.0.0.1");
    }
}
