//! The `kvEventsConfig` section: where KV events come from (bind mode, connect mode by list or
//! by DNS discovery), how gap fill and pod lifecycles behave, and the limits that config
//! validation and ingestion share (one definition each, here).

use std::net::{IpAddr, SocketAddr};

use serde::{Deserialize, Serialize};

use super::ConfigDuration;

/// The longest pod id accepted, in bytes (a DNS name of 253 and a port; the topic grammar and
/// the `allowedPods` patterns both check it).
pub const MAX_POD_LEN: usize = 263;

/// A configured DNS server's address: `ip` (port 53) or `ip:port` (`[v6]:port`).
pub fn nameserver_address(text: &str) -> Option<SocketAddr> {
    let text = text.trim();
    text.parse::<SocketAddr>().ok().or_else(|| {
        text.parse::<IpAddr>()
            .ok()
            .map(|ip| SocketAddr::new(ip, 53))
    })
}

/// llm-d's `kvEventsConfig`, plus connect mode and gap-fill settings (vLLM's replay socket).
#[derive(Debug, Clone, Serialize, Deserialize, PartialEq)]
#[serde(rename_all = "camelCase", deny_unknown_fields, default)]
pub struct KvEventsConfig {
    /// Bind mode: the SUB socket binds here and vLLM pods connect. Empty disables bind mode.
    /// Loopback by default: opening it to the pod network (`tcp://*:5557`) is a deliberate
    /// setting, paired with a network policy, since whoever reaches it can write the index.
    pub zmq_endpoint: String,
    /// Subscription prefix; topics are `kv@<pod>@<model>`.
    pub topic_filter: String,
    /// Event-applying workers (one pod's events always go to the same worker, in order).
    pub concurrency: usize,
    /// How far below the serving threads (gRPC, the picker, HTTP) ingestion's threads run, as
    /// a nice increment (0-19): when both want the CPU, reads go first. 0 (the default) runs
    /// them at the same priority, on threads of their own.
    pub ingest_nice: i32,
    /// Bind mode: a pod's replay endpoint (vLLM's name for the socket gaps are filled from),
    /// from its address: `{ip}` and `{port}` are the topic's pod address; vLLM adds the DP rank
    /// to the port, and so does kv-indexer. Empty: no gap fill in bind mode.
    pub replay_endpoint_template: String,
    /// How long a gap-fill request may take.
    pub replay_timeout_ms: u64,
    /// Gap-fill requests in flight at most, across all publishers; a gap beyond is counted as
    /// lost at once (`kvindexer_replays_total{result="throttled"}`).
    pub max_gap_fills_in_flight: usize,
    /// Bytes of event messages queued for the workers, all pods together. The receiver never
    /// waits: past this, the pod queueing the most loses its queued messages (counted, and its
    /// publisher resynchronised), never a pod within its share.
    pub queue_bytes: usize,
    /// Bytes one pod may have queued beside its newest message; past this, its older queued
    /// messages are dropped (counted) and its publisher resynchronised. Pods are served in
    /// turn, so a pod with a long queue does not delay the others.
    pub queue_bytes_per_pod: usize,
    /// Replaced by `queueBytes` and `queueBytesPerPod` (a count of messages let a burst of
    /// many small ones be shed); accepted with a warning, and ignored.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub queue_depth: Option<usize>,
    /// Connect mode: pods that bind their PUB socket, dialled by every kv-indexer replica.
    pub endpoints: Vec<ConnectEndpoint>,
    /// Connect mode by DNS: the pods behind headless Service names, re-resolved every
    /// `refreshInterval` and dialled like `endpoints`.
    pub discovery: DiscoveryConfig,
    /// Models whose events are accepted (exact names); empty accepts any model a topic names.
    pub allowed_models: Vec<String>,
    /// Pod address patterns whose events are accepted (`*` matches any run of characters,
    /// e.g. `10.42.*:8000`); empty accepts any pod a topic names.
    pub allowed_pods: Vec<String>,
    /// How long a pod may be gone (bind mode: its last connection closed; connect mode: this
    /// replica's socket to it down, or the pod left discovery) before its blocks are dropped
    /// and it is forgotten. A reconnect within it keeps everything.
    pub publisher_grace_period: ConfigDuration,
    /// How long a pod may stay silent, connected or not, before it is forgotten; `0s` (the
    /// default) never forgets a pod for silence alone. The fallback for pods whose id names no
    /// address the daemon sees connections from.
    pub publisher_idle_timeout: ConfigDuration,
}

impl Default for KvEventsConfig {
    fn default() -> Self {
        Self {
            zmq_endpoint: "tcp://127.0.0.1:5557".into(),
            topic_filter: "kv@".into(),
            concurrency: 16,
            ingest_nice: 0,
            replay_endpoint_template: String::new(),
            replay_timeout_ms: 2_000,
            max_gap_fills_in_flight: 16,
            queue_bytes: 256 << 20,
            queue_bytes_per_pod: 8 << 20,
            queue_depth: None,
            endpoints: Vec::new(),
            discovery: DiscoveryConfig::default(),
            allowed_models: Vec::new(),
            allowed_pods: Vec::new(),
            publisher_grace_period: ConfigDuration::secs(60),
            publisher_idle_timeout: ConfigDuration::secs(0),
        }
    }
}

/// One pod in connect mode.
#[derive(Debug, Clone, Default, Serialize, Deserialize, PartialEq)]
#[serde(rename_all = "camelCase", deny_unknown_fields, default)]
pub struct ConnectEndpoint {
    /// The pod's PUB endpoint, e.g. `tcp://10.0.0.7:5557`.
    pub endpoint: String,
    /// The pod id the gateway uses; empty = from the topic.
    pub pod: String,
    /// The model; empty = from the topic.
    pub model: String,
    /// The pod's replay (ROUTER) endpoint, e.g. `tcp://10.0.0.7:5558`; empty = no replay.
    pub replay_endpoint: String,
}

/// Connect mode by DNS: a Deployment's pods have no stable names, so their addresses come from
/// a headless Service (A and AAAA records), resolved again every `refreshInterval`.
#[derive(Debug, Clone, Serialize, Deserialize, PartialEq)]
#[serde(rename_all = "camelCase", deny_unknown_fields, default)]
pub struct DiscoveryConfig {
    /// How often every name is resolved again.
    pub refresh_interval: ConfigDuration,
    /// DNS servers to ask (`ip` or `ip:port`, UDP with TCP for long answers); empty: the
    /// system's (`/etc/resolv.conf`, with its search domains). With servers given, names are
    /// asked as written (give them fully qualified).
    pub nameservers: Vec<String>,
    /// The names to resolve, each a set of vLLM pods serving the same way.
    pub services: Vec<DiscoveredService>,
}

impl Default for DiscoveryConfig {
    fn default() -> Self {
        Self {
            refresh_interval: ConfigDuration::secs(5),
            nameservers: Vec::new(),
            services: Vec::new(),
        }
    }
}

/// One DNS name whose addresses are vLLM pods that bind their publisher.
#[derive(Debug, Clone, Serialize, Deserialize, PartialEq)]
#[serde(rename_all = "camelCase", deny_unknown_fields, default)]
pub struct DiscoveredService {
    /// The name, e.g. `vllm-headless.llm.svc.cluster.local`.
    pub name: String,
    /// The port of data-parallel rank 0's PUB socket; rank r publishes on `publisherPort + r`.
    pub publisher_port: u16,
    /// The port of rank 0's replay socket (rank r: `replayPort + r`); 0: no gap fill.
    pub replay_port: u16,
    /// Data-parallel ranks per pod (one publisher each).
    pub data_parallel_size: u16,
    /// The pod id the gateway uses, from the address: `{ip}` is replaced (IPv6 in brackets),
    /// e.g. `{ip}:8000`. Empty: from the topic.
    pub pod: String,
    /// The model; empty: from the topic.
    pub model: String,
    /// Addresses taken from one answer at most (the rest are ignored, counted and logged), so
    /// a bad answer cannot open unbounded sockets.
    pub max_addresses: usize,
}

impl Default for DiscoveredService {
    fn default() -> Self {
        Self {
            name: String::new(),
            publisher_port: 5557,
            replay_port: 0,
            data_parallel_size: 1,
            pod: String::new(),
            model: String::new(),
            max_addresses: 1024,
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn nameservers_are_addresses_with_an_optional_port() {
        assert_eq!(
            nameserver_address("10.96.0.10"),
            Some("10.96.0.10:53".parse().expect("addr"))
        );
        assert_eq!(
            nameserver_address("127.0.0.1:5353"),
            Some("127.0.0.1:5353".parse().expect("addr"))
        );
        assert_eq!(
            nameserver_address("fd00::a"),
            Some("[fd00::a]:53".parse().expect("addr"))
        );
        assert_eq!(
            nameserver_address("[fd00::a]:5353"),
            Some("[fd00::a]:5353".parse().expect("addr"))
        );
        assert_eq!(nameserver_address("kube-dns"), None);
    }
}
