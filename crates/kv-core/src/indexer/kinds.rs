//! What an event's fields mean to the index, read alike by the batch application (`apply`),
//! the hash check (`hash_check`) and translation (`translate`): the tier of a medium
//! ([`tier_of`]) and whether a block's cache kind is full attention ([`full_attention_kind`]).

use crate::events::Medium;
use crate::hit::GroupKind;
use crate::index::Tier;

/// The index tier of an event's medium; no medium (vLLM < 0.10.2) means GPU.
pub(super) fn tier_of(medium: Option<&Medium>) -> Tier {
    match medium {
        None | Some(Medium::Gpu) => Tier::Gpu,
        Some(Medium::Cpu) => Tier::Cpu,
        Some(Medium::Storage) => Tier::Storage,
        Some(Medium::Other(_)) => Tier::Other,
    }
}

/// Whether blocks of this KV-cache spec kind (`kv_cache_spec_kind`) are full attention (MLA
/// included; events that name no kind come from vLLM before hybrid groups): the blocks whose
/// hashes decide and check an engine's key mode. Read through [`GroupKind::parse`], the one
/// reading of kinds.
pub(super) fn full_attention_kind(kind: Option<&str>) -> bool {
    matches!(GroupKind::parse(kind, None), Ok(GroupKind::Full))
}
