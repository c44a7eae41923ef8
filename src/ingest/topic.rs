//! ZMQ topics and endpoints: `kv@<pod>@<model>` parsing, vLLM's data-parallel port offset, and
//! the bind-mode gap-fill endpoint template (vLLM's `replay_endpoint`).

use thiserror::Error;

/// Why a topic was rejected.
#[derive(Debug, Error, PartialEq, Eq)]
pub enum TopicError {
    /// Not UTF-8.
    #[error("topic is not UTF-8")]
    NotUtf8,
    /// Does not start with the configured filter.
    #[error("topic {0:?} does not start with the topic filter")]
    WrongPrefix(String),
    /// No `@` between pod and model, or an empty part.
    #[error("topic {0:?} is not <filter><pod>@<model>")]
    Malformed(String),
}

/// Splits `kv@<pod>@<model>` (with `filter` = `"kv@"`) into `(pod, model)`. The pod is an `ip`
/// or `ip:port` (IPv6 in brackets); the model may contain `/` and `@`.
pub fn parse_topic<'a>(topic: &'a [u8], filter: &str) -> Result<(&'a str, &'a str), TopicError> {
    let topic = std::str::from_utf8(topic).map_err(|_| TopicError::NotUtf8)?;
    let rest = topic
        .strip_prefix(filter)
        .ok_or_else(|| TopicError::WrongPrefix(topic.to_owned()))?;
    let (pod, model) = rest
        .split_once('@')
        .ok_or_else(|| TopicError::Malformed(topic.to_owned()))?;
    if pod.is_empty() || model.is_empty() {
        return Err(TopicError::Malformed(topic.to_owned()));
    }
    Ok((pod, model))
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
