//! `endpointPicker`: kv-indexer as an `InferencePool`'s endpoint picker (Envoy ext_proc, GIE's
//! endpoint-picker protocol). Off by default; its settings warn while it is off.

use std::net::SocketAddr;
use std::time::Duration;

use serde::{Deserialize, Serialize};

use super::{invalid, ConfigDuration, ConfigError, ConfigWarning, PdConfig, StaticEndpoint};

/// Most fallbacks an answer lists (Envoy's `override_host` tries each in turn on retries).
pub const MAX_FALLBACKS: usize = 16;

/// The endpoint picker (`endpointPicker`).
#[derive(Debug, Clone, Serialize, Deserialize, PartialEq)]
#[serde(rename_all = "camelCase", deny_unknown_fields, default)]
pub struct EndpointPickerConfig {
    /// Serve `envoy.service.ext_proc.v3.ExternalProcessor` as an InferencePool's endpoint
    /// picker (off by default).
    pub enabled: bool,
    /// Its listen address (plaintext, or TLS with `server.tls`).
    pub addr: String,
    /// Each pod's Prometheus endpoint; `{pod}` is the pod's name (`ip:port`, as vLLM's topic
    /// names it).
    pub metrics_url_template: String,
    /// How often each pod's metrics are read (stretched when the pool is larger than
    /// `metricsMaxScrapesPerSecond` allows).
    pub metrics_interval: ConfigDuration,
    /// All pods' metrics reads a second, at most: a fleet of more than
    /// `metricsMaxScrapesPerSecond × metricsInterval` pods is read less often than
    /// `metricsInterval` (each pod every `pods / metricsMaxScrapesPerSecond`).
    pub metrics_max_scrapes_per_second: u32,
    /// Metrics older than this are stale (or older than two stretched intervals, when longer):
    /// the pod's load is scored as the fresh pods' median (counted).
    pub metrics_stale_after: ConfigDuration,
    /// The scorers' weights, by scorer name (`kv_core::SCORERS`; one left out keeps its
    /// default, llm-d's 3:2:2).
    pub weights: kv_core::PickWeights,
    /// Request bodies larger than this are refused with 413 (GIE's EPP: 10 MiB).
    pub max_body_bytes: usize,
    /// All request bodies held at once, at most (bytes): a chunk that would pass it is answered
    /// 429 before it is kept, so bodies cannot hold more memory than this.
    pub max_buffered_body_bytes: usize,
    /// ext_proc streams (HTTP requests through the gateway) open at once, at most; past it a
    /// new one is answered 429 at its first message.
    pub max_streams: usize,
    /// Requests being picked at once at most; beyond, 429 (shedding).
    pub max_in_flight: usize,
    /// How the picker's port speaks TLS.
    pub tls: PickerTlsConfig,
    /// Fallback endpoints listed after the pick (`ip:port,ip:port,...`), for gateways whose
    /// balancer reads a list (Envoy's `override_host` policy); 0, the default, answers one
    /// endpoint, as every GIE gateway's ORIGINAL_DST cluster parses it.
    pub fallbacks: usize,
    /// The `InferencePool` whose Ready pods are the candidates (watched through the
    /// Kubernetes API); absent: `endpoints`, else DNS discovery, else the live publishers.
    pub pool: Option<PoolRefConfig>,
    /// A static pool (`ip:port` each, or `{address, role}`), outside Kubernetes.
    pub endpoints: Vec<StaticEndpoint>,
    /// Metrics reads in a row that got no connection (refused, reset, or the TCP connect timed
    /// out) that eject an endpoint from the candidates (an answer brings it back); a slow
    /// answer only ages its load sample.
    pub scrape_failures_to_leave: u32,
    /// How much of the pool health may eject (`endpointPicker.health`).
    pub health: PickerHealthConfig,
    /// Prefill/decode disaggregation (off by default).
    pub pd: PdConfig,
}

/// The `InferencePool` the picker serves (`endpointPicker.pool`), as GIE's EPP takes
/// `--pool-name` and `--pool-namespace`.
#[derive(Debug, Clone, Serialize, Deserialize, PartialEq)]
#[serde(rename_all = "camelCase", deny_unknown_fields, default)]
pub struct PoolRefConfig {
    /// The pool's name.
    pub name: String,
    /// Its namespace (empty: the daemon's own, from its service account, else the
    /// kubeconfig's).
    pub namespace: String,
    /// A kubeconfig file to reach the API server with (empty: the in-cluster service account,
    /// else `KUBECONFIG` or `~/.kube/config`).
    pub kubeconfig: String,
    /// How long a Kubernetes request may go without an answer (a list page, a watch's start, the
    /// liveness read of the pool): past it the request is abandoned, counted and retried, and
    /// the last pool keeps serving.
    pub request_timeout: ConfigDuration,
}

impl Default for PoolRefConfig {
    fn default() -> Self {
        Self {
            name: String::new(),
            namespace: String::new(),
            kubeconfig: String::new(),
            request_timeout: ConfigDuration::secs(5),
        }
    }
}

/// How much of the pool health may eject (`endpointPicker.health`), as Envoy's outlier
/// detection bounds it.
#[derive(Debug, Clone, Copy, Serialize, Deserialize, PartialEq)]
#[serde(rename_all = "camelCase", deny_unknown_fields, default)]
pub struct PickerHealthConfig {
    /// The most of the pool's Ready endpoints ejected at once, in percent (at least one is
    /// ejected whatever it says, as Envoy's `max_ejection_percent`).
    pub max_ejection_percent: u32,
    /// Below this share of the Ready endpoints left, in percent, every Ready endpoint is a
    /// candidate (panic, as Envoy's `healthy_panic_threshold`; 0 never panics).
    pub panic_threshold_percent: u32,
}

impl Default for PickerHealthConfig {
    fn default() -> Self {
        Self {
            max_ejection_percent: kv_core::DEFAULT_MAX_EJECTION_PERCENT,
            panic_threshold_percent: kv_core::DEFAULT_PANIC_THRESHOLD_PERCENT,
        }
    }
}

/// Most endpoints a static pool lists.
pub const MAX_STATIC_ENDPOINTS: usize = 16_384;

/// Largest `scrapeFailuresToLeave`.
pub const MAX_SCRAPE_FAILURES_TO_LEAVE: u32 = 100;

/// Whether `s` is a Kubernetes DNS-1123 name of at most `max` bytes (lower-case letters,
/// digits, `-`, and `.` when `dots`; alphanumeric at both ends).
fn dns1123(s: &str, max: usize, dots: bool) -> bool {
    let ok = |c: u8| c.is_ascii_lowercase() || c.is_ascii_digit();
    !s.is_empty()
        && s.len() <= max
        && s.bytes().all(|c| ok(c) || c == b'-' || (dots && c == b'.'))
        && s.bytes().next().is_some_and(ok)
        && s.bytes().last().is_some_and(ok)
}

/// How the picker's port speaks TLS (`endpointPicker.tls`).
#[derive(Debug, Clone, Default, Serialize, Deserialize, PartialEq)]
#[serde(rename_all = "camelCase", deny_unknown_fields, default)]
pub struct PickerTlsConfig {
    /// Where its certificate comes from.
    pub mode: PickerTlsMode,
    /// The certificate chain (PEM file; `mode: files`).
    pub cert_file: String,
    /// The private key (PEM file; `mode: files`).
    pub key_file: String,
    /// Clients must present a certificate issued by this CA (PEM file; `mode: files`).
    pub client_ca_file: String,
}

/// Where the picker's certificate comes from.
#[derive(Debug, Clone, Copy, Default, Serialize, Deserialize, PartialEq, Eq)]
#[serde(rename_all = "camelCase")]
pub enum PickerTlsMode {
    /// As the daemon's gRPC port (`server.tls`): plaintext unless that is set.
    #[default]
    Inherit,
    /// A self-signed certificate made at start, as GIE's EPP serves by default: gateways built
    /// from GIE dial the picker with TLS and do not verify its certificate.
    SelfSigned,
    /// `certFile` and `keyFile` (and `clientCaFile` for client certificates).
    Files,
    /// Plaintext (h2c), whatever `server.tls` says.
    Plaintext,
}

impl PickerTlsConfig {
    fn validate(&self) -> Result<(), ConfigError> {
        let files = [&self.cert_file, &self.key_file, &self.client_ca_file];
        match self.mode {
            PickerTlsMode::Files if self.cert_file.is_empty() || self.key_file.is_empty() => {
                Err(invalid(
                    "endpointPicker.tls",
                    "mode files needs certFile and keyFile",
                ))
            }
            PickerTlsMode::Files => Ok(()),
            _ if files.iter().any(|f| !f.is_empty()) => Err(invalid(
                "endpointPicker.tls",
                format!(
                    "certFile, keyFile and clientCaFile are read only with mode files (mode is \
                     {:?}): set mode: files, or remove them",
                    self.mode
                ),
            )),
            _ => Ok(()),
        }
    }
}

impl Default for EndpointPickerConfig {
    fn default() -> Self {
        Self {
            enabled: false,
            addr: "0.0.0.0:9002".into(),
            metrics_url_template: "http://{pod}/metrics".into(),
            metrics_interval: ConfigDuration::millis(50),
            metrics_max_scrapes_per_second: 2_000,
            metrics_stale_after: ConfigDuration::millis(500),
            weights: kv_core::PickWeights::default(),
            max_body_bytes: 10 << 20,
            max_buffered_body_bytes: 512 << 20,
            max_streams: 16_384,
            max_in_flight: 1024,
            tls: PickerTlsConfig::default(),
            fallbacks: 0,
            pool: None,
            endpoints: Vec::new(),
            scrape_failures_to_leave: kv_core::DEFAULT_FAILURES_TO_LEAVE,
            health: PickerHealthConfig::default(),
            pd: PdConfig::default(),
        }
    }
}

impl PickerHealthConfig {
    fn validate(&self) -> Result<(), ConfigError> {
        for (field, v) in [
            ("maxEjectionPercent", self.max_ejection_percent),
            ("panicThresholdPercent", self.panic_threshold_percent),
        ] {
            if v > 100 {
                return Err(invalid(
                    format!("endpointPicker.health.{field}"),
                    "is a percentage: 0 to 100",
                ));
            }
        }
        Ok(())
    }

    /// kv-core's ejection rule with `failures_to_leave` probes without a connection in a row.
    pub fn settings(&self, failures_to_leave: u32) -> kv_core::HealthSettings {
        kv_core::HealthSettings {
            failures_to_leave,
            max_ejection_percent: self.max_ejection_percent,
            panic_threshold_percent: self.panic_threshold_percent,
        }
    }
}

impl EndpointPickerConfig {
    /// Checks every value (also while disabled: a bad value is a typo either way).
    pub(super) fn validate(&self) -> Result<(), ConfigError> {
        self.addr.parse::<SocketAddr>().map_err(|e| {
            invalid(
                "endpointPicker.addr",
                format!("{:?} is not host:port ({e})", self.addr),
            )
        })?;
        let url = &self.metrics_url_template;
        if !url.starts_with("http://") || !url.contains("{pod}") {
            return Err(invalid(
                "endpointPicker.metricsUrlTemplate",
                format!("{url:?} must be an http:// URL containing {{pod}}"),
            ));
        }
        let interval = self.metrics_interval.0;
        if interval < Duration::from_millis(10) || interval > Duration::from_secs(60) {
            return Err(invalid(
                "endpointPicker.metricsInterval",
                "must be between 10ms and 60s",
            ));
        }
        if !(1..=100_000).contains(&self.metrics_max_scrapes_per_second) {
            return Err(invalid(
                "endpointPicker.metricsMaxScrapesPerSecond",
                "must be between 1 and 100000",
            ));
        }
        if self.metrics_stale_after.0 <= interval {
            return Err(invalid(
                "endpointPicker.metricsStaleAfter",
                "must be longer than metricsInterval",
            ));
        }
        self.weights
            .check()
            .map_err(|e| invalid("endpointPicker.weights", e.to_string()))?;
        if self.max_body_bytes < 1024 {
            return Err(invalid(
                "endpointPicker.maxBodyBytes",
                "must be at least 1024",
            ));
        }
        if self.max_buffered_body_bytes < self.max_body_bytes {
            return Err(invalid(
                "endpointPicker.maxBufferedBodyBytes",
                format!(
                    "must be at least maxBodyBytes ({}): one body must fit",
                    self.max_body_bytes
                ),
            ));
        }
        if self.max_in_flight == 0 {
            return Err(invalid("endpointPicker.maxInFlight", "must be at least 1"));
        }
        if self.max_streams < self.max_in_flight {
            return Err(invalid(
                "endpointPicker.maxStreams",
                "must be at least maxInFlight (every pick is a stream)",
            ));
        }
        self.tls.validate()?;
        if self.fallbacks > MAX_FALLBACKS {
            return Err(invalid(
                "endpointPicker.fallbacks",
                format!("must be at most {MAX_FALLBACKS}"),
            ));
        }
        if !(1..=MAX_SCRAPE_FAILURES_TO_LEAVE).contains(&self.scrape_failures_to_leave) {
            return Err(invalid(
                "endpointPicker.scrapeFailuresToLeave",
                format!("must be between 1 and {MAX_SCRAPE_FAILURES_TO_LEAVE}"),
            ));
        }
        self.health.validate()?;
        self.validate_membership()
    }

    /// The pool's reference and the static endpoints (one source of membership at most).
    fn validate_membership(&self) -> Result<(), ConfigError> {
        if let Some(pool) = &self.pool {
            if !dns1123(&pool.name, 253, true) {
                return Err(invalid(
                    "endpointPicker.pool.name",
                    format!("{:?} is not a Kubernetes object name", pool.name),
                ));
            }
            if !pool.namespace.is_empty() && !dns1123(&pool.namespace, 63, false) {
                return Err(invalid(
                    "endpointPicker.pool.namespace",
                    format!("{:?} is not a Kubernetes namespace", pool.namespace),
                ));
            }
            let timeout = pool.request_timeout.0;
            if timeout < Duration::from_millis(100) || timeout > Duration::from_secs(300) {
                return Err(invalid(
                    "endpointPicker.pool.requestTimeout",
                    "must be between 100ms and 300s",
                ));
            }
            if !self.endpoints.is_empty() {
                return Err(invalid(
                    "endpointPicker.endpoints",
                    "set with endpointPicker.pool: the pool's pods are the candidates; keep one",
                ));
            }
        }
        if self.endpoints.len() > MAX_STATIC_ENDPOINTS {
            return Err(invalid(
                "endpointPicker.endpoints",
                format!("lists more than {MAX_STATIC_ENDPOINTS} endpoints"),
            ));
        }
        for e in &self.endpoints {
            if e.address().parse::<SocketAddr>().is_err() {
                return Err(invalid(
                    "endpointPicker.endpoints",
                    format!(
                        "{:?} is not ip:port (as the picker answers it)",
                        e.address()
                    ),
                ));
            }
            e.validate()?;
        }
        Ok(())
    }

    /// Settings given while the picker is off: they do nothing.
    pub(super) fn warnings(&self, out: &mut Vec<ConfigWarning>) {
        self.pd.warnings(out);
        if self.enabled {
            return;
        }
        let d = Self::default();
        for (field, set) in [
            ("addr", self.addr != d.addr),
            (
                "metricsUrlTemplate",
                self.metrics_url_template != d.metrics_url_template,
            ),
            (
                "metricsInterval",
                self.metrics_interval != d.metrics_interval,
            ),
            (
                "metricsMaxScrapesPerSecond",
                self.metrics_max_scrapes_per_second != d.metrics_max_scrapes_per_second,
            ),
            (
                "metricsStaleAfter",
                self.metrics_stale_after != d.metrics_stale_after,
            ),
            ("weights", self.weights != d.weights),
            ("maxBodyBytes", self.max_body_bytes != d.max_body_bytes),
            (
                "maxBufferedBodyBytes",
                self.max_buffered_body_bytes != d.max_buffered_body_bytes,
            ),
            ("maxStreams", self.max_streams != d.max_streams),
            ("health", self.health != d.health),
            ("maxInFlight", self.max_in_flight != d.max_in_flight),
            ("fallbacks", self.fallbacks != d.fallbacks),
            ("tls", self.tls != d.tls),
            ("pool", self.pool != d.pool),
            ("endpoints", self.endpoints != d.endpoints),
            ("pd", self.pd != d.pd),
            (
                "scrapeFailuresToLeave",
                self.scrape_failures_to_leave != d.scrape_failures_to_leave,
            ),
        ] {
            if set {
                out.push(ConfigWarning {
                    field: format!("endpointPicker.{field}"),
                    message: "is set but endpointPicker.enabled is false: no endpoint picker \
                              is served"
                        .into(),
                });
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use crate::config::Config;

    fn load(yaml: &str) -> Config {
        Config::from_yaml(yaml, "f").unwrap_or_else(|e| panic!("{yaml}: {e}"))
    }

    #[test]
    fn the_issue_s_section_parses_and_is_off_by_default() {
        let c = load(
            "endpointPicker:\n  enabled: true\n  addr: \"0.0.0.0:9002\"\n  \
             metricsUrlTemplate: \"http://{pod}/metrics\"\n  metricsInterval: 50ms\n  \
             weights: {prefix: 3, queue: 2, kvCacheUtilization: 2}\n",
        );
        c.validate().unwrap_or_else(|e| panic!("{e}"));
        assert!(c.endpoint_picker.enabled);
        assert_eq!(c.endpoint_picker.weights, kv_core::PickWeights::default());
        assert!(!Config::default().endpoint_picker.enabled);
        assert!(c.warnings().is_empty(), "{:?}", c.warnings());
    }

    #[test]
    fn settings_of_a_disabled_picker_warn() {
        for (yaml, field) in [
            (
                "endpointPicker: {addr: \"0.0.0.0:9100\"}",
                "endpointPicker.addr",
            ),
            (
                "endpointPicker: {weights: {prefix: 1}}",
                "endpointPicker.weights",
            ),
            (
                "endpointPicker: {metricsInterval: 100ms}",
                "endpointPicker.metricsInterval",
            ),
        ] {
            let c = load(yaml);
            c.validate().unwrap_or_else(|e| panic!("{yaml}: {e}"));
            assert!(
                c.warnings().iter().any(|w| w.field == field),
                "{yaml}: {:?}",
                c.warnings()
            );
            let mut on = c.clone();
            on.endpoint_picker.enabled = true;
            assert!(
                on.warnings().is_empty(),
                "{yaml} enabled: {:?}",
                on.warnings()
            );
        }
        // An enabled picker records routings: the speculative settings are not inert then.
        let c = load("scoring: {speculativeTtl: 5s}\nendpointPicker: {enabled: true}");
        assert!(c.warnings().is_empty(), "{:?}", c.warnings());
    }

    #[test]
    fn bad_values_name_their_field() {
        for (yaml, field) in [
            ("endpointPicker: {addr: nine}", "endpointPicker.addr"),
            (
                "endpointPicker: {metricsUrlTemplate: \"http://x/metrics\"}",
                "endpointPicker.metricsUrlTemplate",
            ),
            (
                "endpointPicker: {metricsUrlTemplate: \"https://{pod}/metrics\"}",
                "endpointPicker.metricsUrlTemplate",
            ),
            (
                "endpointPicker: {metricsInterval: 1ms}",
                "endpointPicker.metricsInterval",
            ),
            (
                "endpointPicker: {metricsInterval: 1s, metricsStaleAfter: 1s}",
                "endpointPicker.metricsStaleAfter",
            ),
            (
                "endpointPicker: {weights: {prefix: -1}}",
                "endpointPicker.weights",
            ),
            (
                "endpointPicker: {weights: {prefix: 0, queue: 0, kvCacheUtilization: 0}}",
                "endpointPicker.weights",
            ),
            (
                "endpointPicker: {maxInFlight: 0}",
                "endpointPicker.maxInFlight",
            ),
            (
                "endpointPicker: {maxBodyBytes: 10}",
                "endpointPicker.maxBodyBytes",
            ),
            (
                "endpointPicker: {fallbacks: 17}",
                "endpointPicker.fallbacks",
            ),
            (
                "endpointPicker: {tls: {mode: files, certFile: a.pem}}",
                "endpointPicker.tls",
            ),
            (
                "endpointPicker: {tls: {mode: selfSigned, certFile: a.pem}}",
                "endpointPicker.tls",
            ),
            (
                "endpointPicker: {scrapeFailuresToLeave: 0}",
                "endpointPicker.scrapeFailuresToLeave",
            ),
            (
                "endpointPicker: {pool: {name: Vllm_Pool}}",
                "endpointPicker.pool.name",
            ),
            (
                "endpointPicker: {pool: {name: p, namespace: a.b}}",
                "endpointPicker.pool.namespace",
            ),
            (
                "endpointPicker: {pool: {name: p}, endpoints: [\"10.0.0.1:8000\"]}",
                "endpointPicker.endpoints",
            ),
            (
                "endpointPicker: {endpoints: [\"vllm-0:8000\"]}",
                "endpointPicker.endpoints",
            ),
        ] {
            let e = load(yaml).validate().err();
            assert!(
                e.as_ref().is_some_and(|e| e.to_string().starts_with(field)),
                "{yaml}: {e:?}"
            );
        }
        assert!(Config::from_yaml("endpointPicker: {bogus: 1}", "f").is_err());
        // Weights name scorers of kv-core's list; another name is refused when read.
        let e = Config::from_yaml("endpointPicker: {weights: {kv: 1}}", "f").err();
        assert!(
            e.as_ref()
                .is_some_and(|e| e.to_string().contains("unknown scorer \"kv\"")),
            "{e:?}"
        );
        assert!(Config::from_yaml("endpointPicker: {pool: {name: p, bogus: 1}}", "f").is_err());
    }

    #[test]
    fn the_pool_and_the_static_endpoints_parse_by_the_issue_s_names() {
        let c =
            load("endpointPicker:\n  enabled: true\n  pool: {name: vllm-pool, namespace: llm}\n");
        c.validate().unwrap_or_else(|e| panic!("{e}"));
        let pool = c.endpoint_picker.pool.as_ref().expect("a pool");
        assert_eq!(
            (pool.name.as_str(), pool.namespace.as_str()),
            ("vllm-pool", "llm")
        );
        let c = load(
            "endpointPicker:\n  enabled: true\n  endpoints: [\"10.0.0.1:8000\", \"[fd00::1]:8000\"]\n  \
             scrapeFailuresToLeave: 5\n",
        );
        c.validate().unwrap_or_else(|e| panic!("{e}"));
        assert_eq!(c.endpoint_picker.endpoints.len(), 2);
        assert_eq!(c.endpoint_picker.scrape_failures_to_leave, 5);
        assert_eq!(
            Config::default().endpoint_picker.scrape_failures_to_leave,
            kv_core::DEFAULT_FAILURES_TO_LEAVE
        );
        let off = load("endpointPicker: {pool: {name: p}}");
        assert!(
            off.warnings()
                .iter()
                .any(|w| w.field == "endpointPicker.pool"),
            "{:?}",
            off.warnings()
        );
    }
}
