//! Model families: the KV-cache groups a simulated pod's engine has, as vLLM groups a model's
//! layers by attention type, and which of them an index is fed.
//!
//! A family is a list of groups, each a kind (full attention, sliding window, Mamba) and a
//! block in hash units (16 tokens). `full` is the plain engine of the published figures (one
//! full-attention group of one unit): it is simulated by `engine::Engine` unchanged; every
//! other family by `hybrid::HybridEngine`.
//!
//! Invariants: group 0 of every family is full attention (as vLLM orders a model's groups
//! when its first layer is full attention, and as the full-attention-only indexes of llm-d and
//! Dynamo read it); every family's layout is one [`Layout::new`] accepts.

use kv_core::{GroupKind, GroupSpec, Layout};
use serde::Serialize;
use thiserror::Error;

/// The hash unit of the simulation, tokens (the index's `blockSize` and vLLM's
/// `hash_block_size`).
pub const UNIT_TOKENS: u32 = 16;

/// A model family by its KV-cache groups (serialized by its `--model-family` name).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize)]
#[serde(rename_all = "kebab-case")]
pub enum ModelFamily {
    /// Full attention only, blocks of 16 tokens (Qwen3-32B, Llama): the plain engine.
    Full,
    /// gpt-oss-like: full attention beside a sliding window of 128 tokens, blocks of 16.
    GptOss,
    /// Gemma-3-like: full attention beside a sliding window of 1,024 tokens, blocks of 16.
    Gemma3,
    /// Qwen3-Next-like: full attention beside Mamba state (align mode), both in blocks of
    /// 576 tokens (36 hash units), hashed in units of 16 (vLLM's `--prefix-match-unit 16`).
    Qwen3Next,
}

/// A `--model-family` that is not one of [`ModelFamily::NAMES`].
#[derive(Debug, Clone, PartialEq, Eq, Error)]
#[error("unknown model family {0:?} (full, gpt-oss, gemma3, qwen3-next)")]
pub struct UnknownFamily(pub String);

impl ModelFamily {
    /// Every family, by the name `--model-family` takes.
    pub const NAMES: [(&'static str, ModelFamily); 4] = [
        ("full", ModelFamily::Full),
        ("gpt-oss", ModelFamily::GptOss),
        ("gemma3", ModelFamily::Gemma3),
        ("qwen3-next", ModelFamily::Qwen3Next),
    ];

    /// The family `name` stands for.
    pub fn parse(name: &str) -> Result<Self, UnknownFamily> {
        Self::NAMES
            .iter()
            .find(|(n, _)| *n == name)
            .map(|&(_, f)| f)
            .ok_or_else(|| UnknownFamily(name.to_owned()))
    }

    /// Its name.
    pub fn name(self) -> &'static str {
        Self::NAMES
            .iter()
            .find(|(_, f)| *f == self)
            .map_or("full", |&(n, _)| n)
    }

    /// Whether the pods have more than the one full-attention group (a hybrid engine).
    pub fn is_hybrid(self) -> bool {
        self != ModelFamily::Full
    }

    /// The groups, in `group_idx` order.
    pub fn groups(self) -> Vec<GroupSpec> {
        let full = |block_units| GroupSpec {
            kind: GroupKind::Full,
            block_units,
        };
        let swa = |window| GroupSpec {
            kind: GroupKind::SlidingWindow { window },
            block_units: 1,
        };
        match self {
            ModelFamily::Full => vec![full(1)],
            ModelFamily::GptOss => vec![full(1), swa(128)],
            ModelFamily::Gemma3 => vec![full(1), swa(1024)],
            ModelFamily::Qwen3Next => vec![
                full(36),
                GroupSpec {
                    kind: GroupKind::Mamba,
                    block_units: 36,
                },
            ],
        }
    }

    /// vLLM's hit rule over the family's groups.
    pub fn layout(self) -> Layout {
        // Every family's groups are valid: 1 or 2 groups, blocks of at least one unit.
        Layout::new(UNIT_TOKENS, self.groups())
            .unwrap_or_else(|_| Layout::full_attention(UNIT_TOKENS, 1))
    }

    /// Tokens one pool block holds in the full-attention group (the pool's page): a pod of
    /// `kv_tokens` KV tokens has `kv_tokens / page` blocks per group's share of the layers.
    pub fn page_tokens(self) -> u64 {
        let units = self.groups().first().map_or(1, |g| g.block_units);
        u64::from(units) * u64::from(UNIT_TOKENS)
    }
}

/// Which of an engine's groups an index is fed.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize)]
pub enum IndexedGroups {
    /// Every group (kv-indexer, which scores by vLLM's rule over them all).
    All,
    /// The full-attention groups only (llm-d's and Dynamo's indexes today): the other groups'
    /// events are dropped before the index sees them.
    FullAttentionOnly,
}

impl IndexedGroups {
    /// Whether events of a group of `kind` reach the index.
    pub fn feeds(self, kind: GroupKind) -> bool {
        self == IndexedGroups::All || kind == GroupKind::Full
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn every_family_parses_by_its_name_and_has_a_valid_layout() {
        for (name, family) in ModelFamily::NAMES {
            assert_eq!(ModelFamily::parse(name), Ok(family));
            assert_eq!(family.name(), name);
            let groups = family.groups();
            assert_eq!(groups[0].kind, GroupKind::Full, "{name}: group 0 is full");
            assert!(Layout::new(UNIT_TOKENS, groups).is_ok(), "{name}");
            assert_eq!(family.is_hybrid(), family.groups().len() > 1);
        }
        assert!(ModelFamily::parse("llama").is_err());
        assert!(ModelFamily::Full.layout().is_plain());
        assert_eq!(ModelFamily::Qwen3Next.page_tokens(), 576);
        assert!(IndexedGroups::FullAttentionOnly.feeds(GroupKind::Full));
        assert!(!IndexedGroups::FullAttentionOnly.feeds(GroupKind::Mamba));
    }
}
