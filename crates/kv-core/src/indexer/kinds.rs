//! What an event's fields mean to the index, read alike by the batch application (`apply`),
//! the hash check (`hash_check`) and translation (`translate`): the tier of a medium
//! ([`tier_of`]) and whether a block's cache kind is indexed at all ([`indexable_kind`]).

use crate::events::Medium;
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

/// Whether blocks of this KV-cache spec kind (`kv_cache_spec_kind`) are indexed: full and
/// MLA attention, and events that name no kind (vLLM before hybrid groups).
pub(super) fn indexable_kind(kind: Option<&str>) -> bool {
    matches!(kind, None | Some("full_attention") | Some("mla_attention"))
}
