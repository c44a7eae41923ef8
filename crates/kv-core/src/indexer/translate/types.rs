//! What translation decides and reports, as the indexer's public surface: the engine-hashes
//! setting, an engine's key mode, why a run could not be translated, the tallies of one
//! batch, and an engine's key state as a snapshot carries it.

use crate::hashing::BlockDigest;
use crate::index::Tier;
use crate::{BlockHash, EngineHash};

/// How the index keys of an engine's blocks are found (the `engineHashes` setting, per model).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default, serde::Serialize, serde::Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum EngineHashes {
    /// Decided per engine from its own events.
    #[default]
    Auto,
    /// Every engine's published hashes are the keys (no translation, no map).
    Aligned,
    /// Every engine is translated from its token ids.
    Translated,
}

/// What an engine's published hashes are, as far as its events have shown.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum KeyMode {
    /// No run has shown it yet: its hashes are stored as published meanwhile.
    #[default]
    Undecided,
    /// Its hashes are the index's keys.
    Aligned,
    /// Its keys are computed from its token ids.
    Translated,
    /// Its block size (`engine`) is not a multiple of the index's (`ours`): not indexed.
    Refused {
        /// The engine's block size.
        engine: u32,
        /// `blockSize`.
        ours: u32,
    },
}

impl KeyMode {
    /// A short, bounded label (`ListPods`, metrics).
    pub fn label(self) -> &'static str {
        match self {
            KeyMode::Undecided => "undecided",
            KeyMode::Aligned => "aligned",
            KeyMode::Translated => "translated",
            KeyMode::Refused { .. } => "refused",
        }
    }
}

/// Why a run (or a removal) could not be translated.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Untranslatable {
    /// The run continues a block the engine's map does not know.
    UnknownParent,
    /// The run names a LoRA adapter whose path is not configured (vLLM >= 0.31 hashes it).
    Lora,
    /// The run carries multimodal or prompt-embedding keys.
    ExtraKeys,
    /// The run has no tokens and its hashes are not in the map (an offload tier's event).
    NoTokens,
    /// The shared key budget (`size`) is spent.
    Full,
}

/// Translation tallies of one batch.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct TranslationReport {
    /// Runs whose keys were computed from tokens (or found in the map).
    pub translated_runs: u32,
    /// Runs skipped, by [`Untranslatable`] (unknown parent, LoRA, extra keys, no tokens, full;
    /// a run stored in part counts under `full` too).
    pub untranslatable: [u32; 5],
    /// Engine blocks of runs stored in part or skipped because the key budget (`size`) had
    /// no room for their map entries.
    pub full_blocks: u32,
    /// Removed hashes the map did not know (stored before this replica listened, never
    /// translatable, or their entry gave its place under `size`).
    pub unknown_removals: u32,
    /// Stored hashes in a run whose block size is not a multiple of `blockSize` (a partial
    /// page: SGLang's last page of a node), which never make keys.
    pub partial_blocks: u32,
    /// Stored hashes beyond what the event's `token_ids` cover (no tokens to key them by).
    pub uncovered_hashes: u32,
    /// Stored hashes of runs with fewer hashes than blocks that no evidence pairs with a block
    /// for certain (vLLM left null or masked blocks out), skipped.
    pub unplaced_hashes: u32,
    /// Runs with at least one such hash.
    pub unplaced_runs: u32,
    /// This batch showed the engine's hashes are the index's keys at this block size (its
    /// own; same seed and algorithm): `blockSize` set to it would score it aligned.
    pub alignable: Option<u32>,
    /// Map entries that gave their place to newer ones (the key budget was spent); their keys
    /// left the index with them.
    pub evicted_entries: u32,
    /// The engine's mode changed in this batch (to the new mode).
    pub mode_changed: Option<KeyMode>,
}

impl Untranslatable {
    /// Every reason, in [`TranslationReport::untranslatable`] order.
    pub const ALL: [Untranslatable; 5] = [
        Untranslatable::UnknownParent,
        Untranslatable::Lora,
        Untranslatable::ExtraKeys,
        Untranslatable::NoTokens,
        Untranslatable::Full,
    ];

    /// A short, bounded label for metrics.
    pub fn label(self) -> &'static str {
        match self {
            Untranslatable::UnknownParent => "unknown_parent",
            Untranslatable::Lora => "lora",
            Untranslatable::ExtraKeys => "extra_keys",
            Untranslatable::NoTokens => "no_tokens",
            Untranslatable::Full => "full",
        }
    }
}

/// What `ListPods` says of an engine's translation beside its mode.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct KeyNotes {
    /// Published hashes skipped because no block could be paired with them for certain, since
    /// the engine was first seen or last cleared.
    pub unplaced_hashes: u64,
    /// The block size at which the engine's published hashes are the index's keys (its own
    /// block size, with the index's seed and algorithm): set `blockSize` to it to score the
    /// engine aligned, without a translation map.
    pub alignable_block_size: Option<u32>,
}

/// One translated engine block, as a snapshot carries it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct TranslatedBlock {
    /// The engine's hash of the block, in its group's space ([`EngineHash::in_group`]: the
    /// hash itself for group 0).
    pub engine_hash: EngineHash,
    /// The KV-cache group whose block this is (`group_idx`; 0 for events naming none).
    pub group: u32,
    /// The chained digest of its last chunk (what the next block continues).
    pub tip: BlockDigest,
    /// Keys it stood for before its last (only in snapshots of versions before 6, when an
    /// engine block of `k` units stood for `k` keys; removed with the block).
    pub earlier: Vec<BlockHash>,
    /// Copies held, per tier.
    pub copies: [u16; 4],
}

/// One engine's key state as a snapshot carries it: its mode, a translated engine's map, an
/// aligned engine's second copies.
#[derive(Debug, Clone, PartialEq, Eq, Default)]
pub struct EngineKeyState {
    /// The engine's mode.
    pub mode: KeyMode,
    /// Translated engines: every map entry, oldest first (the order the budget takes them
    /// back in).
    pub translated: Vec<TranslatedBlock>,
    /// Aligned engines: blocks held more than once in a tier, with the copies beyond the first.
    pub copies: Vec<(BlockHash, Tier, u32)>,
    /// The engine's KV-cache groups as its events showed them, `(group_idx, spec)` in group
    /// order (empty: none shown, or a plain engine's group 0 alone), so a restored hybrid
    /// engine is scored by its groups' rule before its next events.
    pub groups: Vec<(u32, crate::GroupSpec)>,
}
