//! `endpointPicker.pd`: prefill/decode disaggregation in the endpoint picker (llm-d's
//! `prefix-based-pd-decider` on the exact hit), and the static pool's entries, which may name
//! a pod's P/D role as llm-d's `llm-d.ai/role` label does.
//!
//! Invariants: `threshold: 0` (the default) never splits, as llm-d's `nonCachedTokens: 0`; a
//! static entry's role is one of the label values llm-d's filters know, else the config is
//! refused.

use serde::{Deserialize, Serialize};

use super::{invalid, ConfigError, ConfigWarning};
use kv_core::{Role, SplitRule};

/// When the picker splits a request's prefill off to a pod of its own (`endpointPicker.pd`).
#[derive(Debug, Clone, Default, Serialize, Deserialize, PartialEq, Eq)]
#[serde(rename_all = "camelCase", deny_unknown_fields, default)]
pub struct PdConfig {
    /// Uncached prompt tokens on the chosen decode pod from which a prefill pod is chosen too
    /// (llm-d's `nonCachedTokens`: split when the uncached tokens are at least this); 0, the
    /// default, never splits.
    pub threshold: u32,
    /// Prompts of fewer tokens are never split (llm-d's `promptTokens`); 0: no floor.
    pub min_prompt_tokens: u32,
}

impl PdConfig {
    /// The rule kv-core decides with.
    pub fn rule(&self) -> SplitRule {
        SplitRule {
            threshold: self.threshold,
            min_prompt_tokens: self.min_prompt_tokens,
        }
    }

    /// A floor without a threshold does nothing.
    pub(super) fn warnings(&self, out: &mut Vec<ConfigWarning>) {
        if self.threshold == 0 && self.min_prompt_tokens > 0 {
            out.push(ConfigWarning {
                field: "endpointPicker.pd.minPromptTokens".into(),
                message: "is set but endpointPicker.pd.threshold is 0: no request is split".into(),
            });
        }
    }
}

/// An entry of the static pool (`endpointPicker.endpoints`): `ip:port`, or
/// `{address: ip:port, role: <llm-d.ai/role value>}`.
#[derive(Debug, Clone, Serialize, Deserialize, PartialEq, Eq)]
#[serde(untagged)]
pub enum StaticEndpoint {
    /// An endpoint that decodes only (as a pod without the role label).
    Address(String),
    /// An endpoint with its role.
    WithRole(RoledEndpoint),
}

/// A static endpoint with its P/D role.
#[derive(Debug, Clone, Serialize, Deserialize, PartialEq, Eq)]
#[serde(rename_all = "camelCase", deny_unknown_fields)]
pub struct RoledEndpoint {
    /// `ip:port`.
    pub address: String,
    /// Its role, as llm-d's `llm-d.ai/role` label names it (`decode`, `prefill`,
    /// `prefill-decode`, ...); absent: decode only.
    #[serde(default)]
    pub role: Option<String>,
}

impl StaticEndpoint {
    /// Its `ip:port`.
    pub fn address(&self) -> &str {
        match self {
            Self::Address(a) => a,
            Self::WithRole(r) => &r.address,
        }
    }

    /// Its role label, if it names one.
    pub fn role(&self) -> Option<&str> {
        match self {
            Self::Address(_) => None,
            Self::WithRole(r) => r.role.as_deref(),
        }
    }

    /// A role label llm-d's filters do not know is the config's error.
    pub(super) fn validate(&self) -> Result<(), ConfigError> {
        Role::from_label(self.role()).map(|_| ()).map_err(|e| {
            invalid(
                "endpointPicker.endpoints",
                format!("{}: {e}", self.address()),
            )
        })
    }
}

impl From<String> for StaticEndpoint {
    fn from(address: String) -> Self {
        Self::Address(address)
    }
}

impl From<&str> for StaticEndpoint {
    fn from(address: &str) -> Self {
        Self::Address(address.to_owned())
    }
}

#[cfg(test)]
mod tests {
    use crate::config::Config;
    use kv_core::Role;

    fn load(yaml: &str) -> Config {
        Config::from_yaml(yaml, "f").unwrap_or_else(|e| panic!("{yaml}: {e}"))
    }

    #[test]
    fn pd_is_off_by_default_and_parses_by_its_names() {
        assert_eq!(Config::default().endpoint_picker.pd.threshold, 0);
        let c = load("endpointPicker: {enabled: true, pd: {threshold: 16, minPromptTokens: 64}}");
        c.validate().unwrap_or_else(|e| panic!("{e}"));
        let rule = c.endpoint_picker.pd.rule();
        assert_eq!((rule.threshold, rule.min_prompt_tokens), (16, 64));
        assert!(c.warnings().is_empty(), "{:?}", c.warnings());
        assert!(Config::from_yaml("endpointPicker: {pd: {threshold: -1}}", "f").is_err());
        assert!(Config::from_yaml("endpointPicker: {pd: {nonCachedTokens: 16}}", "f").is_err());
        let floor = load("endpointPicker: {enabled: true, pd: {minPromptTokens: 64}}");
        assert!(floor
            .warnings()
            .iter()
            .any(|w| w.field == "endpointPicker.pd.minPromptTokens"));
        let off = load("endpointPicker: {pd: {threshold: 16}}");
        assert!(off
            .warnings()
            .iter()
            .any(|w| w.field == "endpointPicker.pd"));
    }

    #[test]
    fn static_entries_may_name_a_role() {
        let c = load(
            "endpointPicker:\n  enabled: true\n  endpoints:\n    - \"10.0.0.1:8000\"\n    \
             - {address: \"10.0.0.2:8000\", role: prefill}\n    \
             - {address: \"[fd00::3]:8000\", role: prefill-decode}\n",
        );
        c.validate().unwrap_or_else(|e| panic!("{e}"));
        let roles: Vec<(&str, Role)> = c
            .endpoint_picker
            .endpoints
            .iter()
            .map(|e| (e.address(), Role::from_label(e.role()).expect("known")))
            .collect();
        assert_eq!(
            roles,
            [
                ("10.0.0.1:8000", Role::Decode),
                ("10.0.0.2:8000", Role::Prefill),
                ("[fd00::3]:8000", Role::Both)
            ]
        );
        for bad in [
            "endpointPicker: {endpoints: [{address: \"10.0.0.1:8000\", role: Prefill}]}",
            "endpointPicker: {endpoints: [{address: \"vllm-0:8000\", role: prefill}]}",
        ] {
            let e = load(bad).validate().err();
            assert!(
                e.as_ref()
                    .is_some_and(|e| e.to_string().starts_with("endpointPicker.endpoints")),
                "{bad}: {e:?}"
            );
        }
        assert!(Config::from_yaml(
            "endpointPicker: {endpoints: [{address: \"10.0.0.1:8000\", rol: prefill}]}",
            "f"
        )
        .is_err());
    }
}
