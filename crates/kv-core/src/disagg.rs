//! Prefill/decode disaggregation (P/D): which pods may prefill and which may decode (their
//! [`Role`]), and whether a request's prefill runs on a pod of its own ([`decide`]), with no
//! I/O (the daemon's endpoint picker and the lab's simulated P/D router share both rules).
//!
//! The rules are llm-d's (llm-d-router at ebab6879, 2026-08-22):
//! - a pod's role is its `llm-d.ai/role` label ([`ROLE_LABEL`]), read as llm-d's `by-label`
//!   decode and prefill filters read it (`filter/bylabel/roles.go`): `decode` decodes,
//!   `prefill` prefills, `prefill-decode` (and its deprecated alias `both`) and
//!   `encode-prefill-decode` do both, `encode-prefill` prefills, `encode` does neither, and a
//!   pod with no label decodes only;
//! - the decision is llm-d's `prefix-based-pd-decider`
//!   (`profilehandler/disagg/prefix_based_pd_decider.go`): once the decode pod is chosen, the
//!   prompt's tokens that pod does not hold are counted, and a prefill pod is chosen when they
//!   are at least [`SplitRule::threshold`] tokens. 0 turns splitting off (llm-d's default; its
//!   shipped P/D configs use 16). A prompt shorter than [`SplitRule::min_prompt_tokens`] is
//!   never split (llm-d's `promptTokens`, 0 = off).
//!
//! Where llm-d estimates the decode pod's cached tokens (blocks of its routing history, or of
//! its own index without tiers or hybrid groups), the caller passes the hit the engine will
//! take there: the same rule, on the exact figure.
//!
//! Invariants:
//! - every label parses to a role or to [`UnknownRole`] (which callers count and treat as
//!   neither role, as llm-d's filters exclude it); nothing here panics on any input;
//! - cached tokens above the prompt's length count as the whole prompt (uncached 0), so a
//!   stale or over-long hit can only keep a request whole, never split it wrongly.

use thiserror::Error;

/// The pod label that carries a pod's P/D role (llm-d's `RoleLabel`).
pub const ROLE_LABEL: &str = "llm-d.ai/role";

/// What a pod of a P/D pool does.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum Role {
    /// Decodes only (label `decode`, or no label).
    Decode,
    /// Prefills only (`prefill`, `encode-prefill`).
    Prefill,
    /// Prefills and decodes (`prefill-decode`, `both`, `encode-prefill-decode`).
    Both,
    /// Neither (`encode`: an encoder, never a candidate here).
    Neither,
}

/// A role label no llm-d filter recognises: the pod is excluded from both roles, as llm-d
/// excludes it, and the caller says so.
#[derive(Debug, Clone, PartialEq, Eq, Error)]
#[error("unknown {ROLE_LABEL} label {0:?} (expected decode, prefill, prefill-decode, both, encode-prefill-decode, encode-prefill or encode)")]
pub struct UnknownRole(pub String);

impl Role {
    /// The role of a pod whose [`ROLE_LABEL`] is `label` (`None`: the pod has no such label).
    pub fn from_label(label: Option<&str>) -> Result<Role, UnknownRole> {
        match label {
            None => Ok(Role::Decode),
            Some("decode") => Ok(Role::Decode),
            Some("prefill" | "encode-prefill") => Ok(Role::Prefill),
            Some("prefill-decode" | "both" | "encode-prefill-decode") => Ok(Role::Both),
            Some("encode") => Ok(Role::Neither),
            Some(other) => Err(UnknownRole(other.to_owned())),
        }
    }

    /// Whether the pod may be a request's decode pod.
    pub fn decodes(self) -> bool {
        matches!(self, Role::Decode | Role::Both)
    }

    /// Whether the pod may be a request's prefill pod.
    pub fn prefills(self) -> bool {
        matches!(self, Role::Prefill | Role::Both)
    }

    /// The role's name in metrics and `ListPods` (`decode`, `prefill`, `both`, `none`).
    pub fn label(self) -> &'static str {
        match self {
            Role::Decode => "decode",
            Role::Prefill => "prefill",
            Role::Both => "both",
            Role::Neither => "none",
        }
    }
}

/// When a request's prefill runs on a pod of its own.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub struct SplitRule {
    /// Uncached prompt tokens on the decode pod from which the prefill is split off; 0: never
    /// (llm-d's `nonCachedTokens`).
    pub threshold: u32,
    /// Prompts shorter than this are never split; 0: no such floor (llm-d's `promptTokens`).
    pub min_prompt_tokens: u32,
}

/// Why a request was or was not split.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum SplitReason {
    /// The rule's threshold is 0: P/D splitting is off.
    Disabled,
    /// The prompt is shorter than [`SplitRule::min_prompt_tokens`].
    ShortPrompt,
    /// The decode pod holds all but fewer than [`SplitRule::threshold`] of its tokens.
    Cached,
    /// At least [`SplitRule::threshold`] tokens are uncached on the decode pod: split.
    Uncached,
}

impl SplitReason {
    /// The reason's name in metrics (`disabled`, `short_prompt`, `cached`, `uncached`).
    pub fn label(self) -> &'static str {
        match self {
            SplitReason::Disabled => "disabled",
            SplitReason::ShortPrompt => "short_prompt",
            SplitReason::Cached => "cached",
            SplitReason::Uncached => "uncached",
        }
    }
}

/// The decision for one request, with the figures it was taken on.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Decision {
    /// Whether a prefill pod is to be chosen.
    pub split: bool,
    /// Why.
    pub reason: SplitReason,
    /// The prompt's tokens the decode pod does not hold.
    pub uncached_tokens: u32,
}

/// Whether a prompt of `prompt_tokens` tokens, of which the chosen decode pod will reuse
/// `cached_tokens`, has its prefill split off under `rule`.
pub fn decide(rule: SplitRule, prompt_tokens: u32, cached_tokens: u32) -> Decision {
    let uncached_tokens = prompt_tokens.saturating_sub(cached_tokens);
    let reason = if rule.threshold == 0 {
        SplitReason::Disabled
    } else if prompt_tokens < rule.min_prompt_tokens {
        SplitReason::ShortPrompt
    } else if uncached_tokens < rule.threshold {
        SplitReason::Cached
    } else {
        SplitReason::Uncached
    };
    Decision {
        split: reason == SplitReason::Uncached,
        reason,
        uncached_tokens,
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn roles_as_llm_d_filters_read_labels() {
        // (label, decode filter keeps it, prefill filter keeps it): llm-d's roles.go table.
        let table: [(Option<&str>, bool, bool); 8] = [
            (None, true, false),
            (Some("decode"), true, false),
            (Some("prefill"), false, true),
            (Some("prefill-decode"), true, true),
            (Some("both"), true, true),
            (Some("encode-prefill-decode"), true, true),
            (Some("encode-prefill"), false, true),
            (Some("encode"), false, false),
        ];
        for (label, decodes, prefills) in table {
            let role = Role::from_label(label).expect("a label llm-d lists");
            assert_eq!(
                (role.decodes(), role.prefills()),
                (decodes, prefills),
                "{label:?}"
            );
        }
        // Values llm-d's filters do not list (its doc's `encode-decode` included) are neither.
        for bad in ["", "Decode", "encode-decode", "prefill,decode"] {
            assert_eq!(
                Role::from_label(Some(bad)),
                Err(UnknownRole(bad.to_owned()))
            );
        }
    }

    #[test]
    fn splits_from_the_threshold_of_uncached_tokens_up() {
        let rule = SplitRule {
            threshold: 16,
            min_prompt_tokens: 0,
        };
        // llm-d splits iff prompt - cached >= nonCachedTokens.
        assert!(decide(rule, 16, 0).split);
        assert!(!decide(rule, 15, 0).split);
        assert!(decide(rule, 1000, 984).split);
        let kept = decide(rule, 1000, 985);
        assert_eq!(
            (kept.split, kept.reason, kept.uncached_tokens),
            (false, SplitReason::Cached, 15)
        );
        // More cached than the prompt (a stale hit) keeps the request whole.
        assert_eq!(decide(rule, 10, 50).uncached_tokens, 0);
    }

    #[test]
    fn zero_threshold_is_off_and_the_prompt_floor_holds() {
        let off = decide(SplitRule::default(), 100_000, 0);
        assert_eq!((off.split, off.reason), (false, SplitReason::Disabled));
        let rule = SplitRule {
            threshold: 16,
            min_prompt_tokens: 512,
        };
        assert_eq!(decide(rule, 511, 0).reason, SplitReason::ShortPrompt);
        assert_eq!(decide(rule, 512, 0).reason, SplitReason::Uncached);
    }
}
