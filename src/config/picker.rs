//! `endpointPicker`: kv-indexer as an `InferencePool`'s endpoint picker (Envoy ext_proc, GIE's
//! endpoint-picker protocol). Off by default; its settings warn while it is off.

use std::net::SocketAddr;
use std::time::Duration;

use serde::{Deserialize, Serialize};

use super::{invalid, ConfigDuration, ConfigError, ConfigWarning};

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
    /// How often each pod's metrics are read.
    pub metrics_interval: ConfigDuration,
    /// Metrics older than this are stale: picks fall back to the index alone (counted).
    pub metrics_stale_after: ConfigDuration,
    /// The scorers' weights.
    pub weights: PickWeightsConfig,
    /// Request bodies larger than this are refused with 400 (as GIE's EPP, 10 MiB).
    pub max_body_bytes: usize,
    /// Requests being picked at once at most; beyond, 429 (shedding).
    pub max_in_flight: usize,
    /// How the picker's port speaks TLS.
    pub tls: PickerTlsConfig,
    /// Fallback endpoints listed after the pick (`ip:port,ip:port,...`), for gateways whose
    /// balancer reads a list (Envoy's `override_host` policy); 0, the default, answers one
    /// endpoint, as every GIE gateway's ORIGINAL_DST cluster parses it.
    pub fallbacks: usize,
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

/// The scorers' weights (llm-d's default profile: 3:2:2).
#[derive(Debug, Clone, Serialize, Deserialize, PartialEq)]
#[serde(rename_all = "camelCase", deny_unknown_fields, default)]
pub struct PickWeightsConfig {
    /// The index's prefix score.
    pub prefix: f64,
    /// Waiting requests (`vllm:num_requests_waiting`).
    pub queue: f64,
    /// KV-cache usage (`vllm:kv_cache_usage_perc`).
    pub kv_cache_utilization: f64,
}

impl Default for PickWeightsConfig {
    fn default() -> Self {
        let w = kv_core::PickWeights::default();
        Self {
            prefix: w.prefix,
            queue: w.queue,
            kv_cache_utilization: w.kv_cache_utilization,
        }
    }
}

impl From<&PickWeightsConfig> for kv_core::PickWeights {
    fn from(w: &PickWeightsConfig) -> Self {
        Self {
            prefix: w.prefix,
            queue: w.queue,
            kv_cache_utilization: w.kv_cache_utilization,
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
            metrics_stale_after: ConfigDuration::millis(500),
            weights: PickWeightsConfig::default(),
            max_body_bytes: 10 << 20,
            max_in_flight: 1024,
            tls: PickerTlsConfig::default(),
            fallbacks: 0,
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
        if self.metrics_stale_after.0 <= interval {
            return Err(invalid(
                "endpointPicker.metricsStaleAfter",
                "must be longer than metricsInterval",
            ));
        }
        kv_core::PickWeights::from(&self.weights)
            .check()
            .map_err(|e| invalid("endpointPicker.weights", e.to_string()))?;
        if self.max_body_bytes < 1024 {
            return Err(invalid(
                "endpointPicker.maxBodyBytes",
                "must be at least 1024",
            ));
        }
        if self.max_in_flight == 0 {
            return Err(invalid("endpointPicker.maxInFlight", "must be at least 1"));
        }
        self.tls.validate()?;
        if self.fallbacks > MAX_FALLBACKS {
            return Err(invalid(
                "endpointPicker.fallbacks",
                format!("must be at most {MAX_FALLBACKS}"),
            ));
        }
        Ok(())
    }

    /// Settings given while the picker is off: they do nothing.
    pub(super) fn warnings(&self, out: &mut Vec<ConfigWarning>) {
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
                "metricsStaleAfter",
                self.metrics_stale_after != d.metrics_stale_after,
            ),
            ("weights", self.weights != d.weights),
            ("maxBodyBytes", self.max_body_bytes != d.max_body_bytes),
            ("maxInFlight", self.max_in_flight != d.max_in_flight),
            ("fallbacks", self.fallbacks != d.fallbacks),
            ("tls", self.tls != d.tls),
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
        assert_eq!(
            kv_core::PickWeights::from(&c.endpoint_picker.weights),
            kv_core::PickWeights::default()
        );
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
        ] {
            let e = load(yaml).validate().err();
            assert!(
                e.as_ref().is_some_and(|e| e.to_string().starts_with(field)),
                "{yaml}: {e:?}"
            );
        }
        assert!(Config::from_yaml("endpointPicker: {bogus: 1}", "f").is_err());
    }
}
