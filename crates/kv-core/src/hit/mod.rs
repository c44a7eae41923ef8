//! The hit vLLM will take: how many prompt tokens an engine reuses from its prefix cache, given
//! which of the prompt's blocks each of its KV-cache groups holds.
//!
//! vLLM 0.33 keeps one KV-cache group per attention type and reuses a prefix only as far as
//! every group allows (`HybridKVCacheCoordinator.find_longest_cache_hit`,
//! `vllm/v1/core/kv_cache_coordinator.py`, a fixed point over the groups' managers in
//! `single_type_kv_cache_manager.py`). This module is that rule, I/O-free: a [`Layout`] (the
//! engine's groups, as its events describe them) and a lookup `held(group, unit)` (does the
//! group hold the prompt's hash unit `unit`) give [`Layout::hit_tokens`].
//!
//! Units: the prompt is hashed in units of `unit_tokens` (vLLM's `hash_block_size`, the index's
//! `blockSize`); unit `u` covers tokens `[u * unit_tokens, (u + 1) * unit_tokens)` and its key
//! chains over the whole prefix. A group whose block is `k` units keys its block `i` by unit
//! `(i + 1) * k - 1` (vLLM's `BlockHashListWithBlockSize`, 0.24+); a partial entry (Mamba
//! "align" mode, a full-attention prompt tail) is keyed by the unit it ends on.
//!
//! Invariants:
//! - the hit is a multiple of the alignment (the scheduler block, the LCM of the groups'
//!   blocks; one unit when fine-grained partial hits are on) and never more than
//!   `max_tokens` (vLLM's `num_tokens - 1`) nor the units the prompt has;
//! - a layout of one full-attention group of one unit is the plain consecutive prefix;
//! - `held` is asked only for units below the prompt's unit count; with lookahead hashing
//!   (vLLM 0.33 `num_hash_lookahead_tokens`) the prompt's units are only those followed by
//!   `L` of its tokens (their keys hold those tokens, `crate::hashing`), so a unit whose
//!   following tokens differ from the cached block's is simply not held;
//! - what vLLM 0.33 cannot be seen to do from events is not modelled: the EAGLE last-block
//!   drop (no event says an engine drafts without lookahead hashing; with lookahead, vLLM
//!   drops nothing). Chunked local attention's chunk is not in events either: it is modelled
//!   only when the model's settings give it ([`GroupKind::parse_chunked`]), and refused
//!   otherwise.

#[cfg(test)]
mod tests;

use thiserror::Error;

/// What a KV-cache group is, as far as its hit rule goes.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum GroupKind {
    /// Full attention (and MLA): a consecutive prefix of blocks.
    Full,
    /// Sliding window (and sliding-window MLA) of `window` tokens: the rightmost point whose
    /// preceding `ceil((window - 1) / block)` blocks are all held.
    SlidingWindow {
        /// The window, in tokens.
        window: u32,
    },
    /// Mamba in "align" mode: the rightmost block boundary whose state block is held.
    Mamba,
    /// Chunked local attention (Llama 4) of `chunk` tokens: the blocks before the chunk the
    /// hit's end falls in count as computed, then the consecutive blocks held from there. The
    /// chunk size is not in the events: it comes from the model's settings.
    ChunkedLocal {
        /// The attention chunk, in tokens (the model's `attention_chunk_size`).
        chunk: u32,
    },
}

/// Why an event's group cannot be modelled.
#[derive(Debug, Clone, PartialEq, Eq, Error)]
pub enum LayoutError {
    /// A `kv_cache_spec_kind` whose hit rule is not modelled (or not in the events).
    #[error(
        "KV-cache group kind {0:?} is not modelled (its hit rule needs what events do not carry)"
    )]
    UnsupportedKind(String),
    /// A sliding-window group whose event carries no window.
    #[error("sliding-window group without kv_cache_spec_sliding_window")]
    MissingWindow,
    /// A group block that is not a whole number of the index's units.
    #[error("group block of {block} tokens is not a multiple of the {unit}-token unit")]
    BlockSize {
        /// The group's block size.
        block: u32,
        /// The unit (`blockSize`).
        unit: u32,
    },
    /// No group, or more than [`MAX_GROUPS`].
    #[error("an engine has 1 to {MAX_GROUPS} KV-cache groups, not {0}")]
    GroupCount(usize),
}

/// The most KV-cache groups an engine's layout holds (vLLM models have a handful).
pub const MAX_GROUPS: usize = 16;

impl GroupKind {
    /// The kind an event names (`kv_cache_spec_kind`, `kv_cache_spec_sliding_window`); `None`
    /// (vLLM before 0.22) is full attention. Chunked local attention is refused: see
    /// [`GroupKind::parse_chunked`].
    pub fn parse(kind: Option<&str>, window: Option<i64>) -> Result<Self, LayoutError> {
        Self::parse_chunked(kind, window, None)
    }

    /// [`GroupKind::parse`] for a model whose attention chunk is known (`chunk`, tokens):
    /// chunked local attention is modelled with it, and refused without it.
    pub fn parse_chunked(
        kind: Option<&str>,
        window: Option<i64>,
        chunk: Option<u32>,
    ) -> Result<Self, LayoutError> {
        match kind {
            None | Some("full_attention") | Some("mla_attention") => Ok(Self::Full),
            Some("sliding_window") | Some("sliding_window_mla") => match window {
                Some(w) if w > 0 && w <= i64::from(u32::MAX) => {
                    Ok(Self::SlidingWindow { window: w as u32 })
                }
                _ => Err(LayoutError::MissingWindow),
            },
            Some("mamba") => Ok(Self::Mamba),
            Some("chunked_local_attention") => match chunk.filter(|&c| c > 0) {
                Some(chunk) => Ok(Self::ChunkedLocal { chunk }),
                None => Err(LayoutError::UnsupportedKind(
                    "chunked_local_attention".to_owned(),
                )),
            },
            Some(other) => Err(LayoutError::UnsupportedKind(other.to_owned())),
        }
    }
}

/// One KV-cache group of an engine.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub struct GroupSpec {
    /// Its hit rule.
    pub kind: GroupKind,
    /// Its block, in units.
    pub block_units: u32,
}

/// An engine's KV-cache groups and what follows from them: the alignment of a hit and whether
/// partial (sub-block) hits count.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Layout {
    unit_tokens: u32,
    groups: Vec<GroupSpec>,
    /// Groups with equal specs, looked up together (vLLM's `SpecGroup`), full attention first.
    classes: Vec<Class>,
    /// The hit's alignment, in units.
    align_units: u32,
    /// vLLM's `enable_partial_hash_hits`.
    fine_grained: bool,
}

/// Groups of one spec: a block counts only if every one of them holds it.
#[derive(Debug, Clone, PartialEq, Eq)]
struct Class {
    spec: GroupSpec,
    members: Vec<usize>,
}

impl Layout {
    /// The layout of an engine whose groups (in `group_idx` order) are `groups`, hashed in
    /// units of `unit_tokens`.
    pub fn new(unit_tokens: u32, groups: Vec<GroupSpec>) -> Result<Self, LayoutError> {
        if groups.is_empty() || groups.len() > MAX_GROUPS {
            return Err(LayoutError::GroupCount(groups.len()));
        }
        if let Some(g) = groups.iter().find(|g| g.block_units == 0) {
            return Err(LayoutError::BlockSize {
                block: g.block_units,
                unit: unit_tokens,
            });
        }
        let mut classes: Vec<Class> = Vec::new();
        for (i, g) in groups.iter().enumerate() {
            match classes.iter_mut().find(|c| c.spec == *g) {
                Some(c) => c.members.push(i),
                None => classes.push(Class {
                    spec: *g,
                    members: vec![i],
                }),
            }
        }
        // Full attention first (a stable sort, as vLLM's).
        classes.sort_by_key(|c| c.spec.kind != GroupKind::Full);
        let single = groups.len() == 1;
        // Fine-grained hits: a Mamba group wider than a unit, and every group either a unit
        // wide or of a manager that looks up at unit granularity (full attention, Mamba).
        let fine_grained = !single
            && groups
                .iter()
                .any(|g| g.kind == GroupKind::Mamba && g.block_units > 1)
            && groups.iter().all(|g| {
                g.block_units == 1 || matches!(g.kind, GroupKind::Full | GroupKind::Mamba)
            });
        let scheduler_units = groups
            .iter()
            .fold(1u64, |acc, g| lcm(acc, u64::from(g.block_units)));
        let align_units = if fine_grained {
            1
        } else {
            u32::try_from(scheduler_units).map_err(|_| LayoutError::BlockSize {
                block: u32::MAX,
                unit: unit_tokens,
            })?
        };
        Ok(Self {
            unit_tokens,
            groups,
            classes,
            align_units,
            fine_grained,
        })
    }

    /// One full-attention group of `block_units` units: an engine that publishes nothing about
    /// groups (or one group).
    pub fn full_attention(unit_tokens: u32, block_units: u32) -> Self {
        let groups = vec![GroupSpec {
            kind: GroupKind::Full,
            block_units: block_units.max(1),
        }];
        Self::new(unit_tokens, groups).unwrap_or_else(|_| unreachable!("one group, a block"))
    }

    /// The groups, in `group_idx` order.
    pub fn groups(&self) -> &[GroupSpec] {
        &self.groups
    }

    /// Whether the plain consecutive-prefix walk is the whole rule (one full-attention group
    /// of one unit).
    pub fn is_plain(&self) -> bool {
        self.groups.len() == 1
            && self.groups[0]
                == GroupSpec {
                    kind: GroupKind::Full,
                    block_units: 1,
                }
    }

    /// The hit's alignment in units (vLLM's `_cache_hit_alignment_tokens / hash_block_size`).
    pub fn align_units(&self) -> u32 {
        self.align_units
    }

    /// Whether sub-block (hash-unit) hits count (vLLM's `enable_partial_hash_hits`).
    pub fn fine_grained(&self) -> bool {
        self.fine_grained
    }

    /// The tokens vLLM reuses for a prompt of `units` hash units whose hit may not exceed
    /// `max_tokens` (a prompt of `n` tokens: `n - 1`), `held(group, unit)` saying whether the
    /// group (its `group_idx`) holds the prompt's unit.
    pub fn hit_tokens(
        &self,
        units: usize,
        max_tokens: u64,
        held: impl FnMut(usize, usize) -> bool,
    ) -> u64 {
        self.hit_tokens_known(units, max_tokens, None, held)
    }

    /// [`Layout::hit_tokens`] when the consecutive prefix a group of one unit holds is known
    /// already (`known`: the group and how many units from unit 0 it holds, up to
    /// `max_tokens`): a walk over many engines measured it, and the rule does not ask again.
    pub fn hit_tokens_known(
        &self,
        units: usize,
        max_tokens: u64,
        known: Option<(usize, u64)>,
        mut held: impl FnMut(usize, usize) -> bool,
    ) -> u64 {
        let find = |class: &Class, max: u64, align: u32, held: &mut _| {
            self.find(class, units as u64, max, align, known, held)
        };
        let units = units as u64;
        let max_tokens = max_tokens.min(units * u64::from(self.unit_tokens));
        if self.groups.len() == 1 {
            let class = &self.classes[0];
            // vLLM's unitary coordinator: aligned to the one group's block.
            return find(class, max_tokens, class.spec.block_units, &mut held);
        }
        let mut hit = max_tokens;
        let mut full_hit: Option<u64> = None;
        let simple = self.classes.len() == 2 && self.classes[0].spec.kind == GroupKind::Full;
        loop {
            let mut curr = hit;
            for class in &self.classes {
                if class.spec.kind == GroupKind::Full {
                    if let Some(f) = full_hit {
                        // Downward-closed: looked up once, then trimmed.
                        curr = curr.min(f);
                        continue;
                    }
                }
                curr = find(class, curr, self.align_units, &mut held);
                if class.spec.kind == GroupKind::Full {
                    full_hit = Some(curr);
                }
            }
            if curr >= hit {
                break;
            }
            hit = curr;
            if simple {
                break;
            }
        }
        hit
    }

    /// One class's manager: its longest hit no longer than `max_tokens`, aligned to
    /// `align_units`.
    fn find(
        &self,
        class: &Class,
        units: u64,
        max_tokens: u64,
        align_units: u32,
        known: Option<(usize, u64)>,
        held: &mut impl FnMut(usize, usize) -> bool,
    ) -> u64 {
        let unit = u64::from(self.unit_tokens);
        let k = u64::from(class.spec.block_units);
        let align = u64::from(align_units) * unit;
        let block = k * unit;
        let mut all = |u: u64| class.members.iter().all(|&g| held(g, u as usize));
        // A group looks up at unit granularity when the alignment is finer than its block.
        let fine = align < block && block % align == 0;
        match class.spec.kind {
            GroupKind::Full => {
                let blocks = (max_tokens / block).min(units / k);
                let mut n = 0;
                match known {
                    Some((g, prefix)) if k == 1 && class.members == [g] => n = prefix.min(blocks),
                    _ => {
                        while n < blocks && all((n + 1) * k - 1) {
                            n += 1;
                        }
                    }
                }
                let mut hit = n * block;
                if fine {
                    // A partial entry inside the first block not held, longest first.
                    let first = n * k;
                    let last = (first + k - 1).min(max_tokens / unit).min(units);
                    if let Some(u) = (first..last).rev().find(|&u| all(u)) {
                        hit = (u + 1) * unit;
                    }
                }
                hit - hit % align
            }
            GroupKind::SlidingWindow { window } => {
                let need = u64::from(window.saturating_sub(1)).div_ceil(block);
                let blocks = (max_tokens / block).min(units / k);
                let mut run = 0;
                let mut found = None;
                for i in (0..blocks).rev() {
                    if all((i + 1) * k - 1) {
                        if run == 0 && block != align && ((i + 1) * block) % align != 0 {
                            continue;
                        }
                        run += 1;
                        if run >= need {
                            found = Some(i + run);
                            break;
                        }
                    } else {
                        run = 0;
                    }
                }
                let n = found.unwrap_or_else(|| {
                    // The run that reaches block 0 is a hit even if shorter than the window.
                    let mut n = run;
                    while block != align && (n * block) % align != 0 {
                        n -= 1;
                    }
                    n
                });
                n * block
            }
            GroupKind::ChunkedLocal { chunk } => {
                // vLLM's ChunkedLocalAttentionManager: blocks wholly before the chunk that
                // `max_tokens` falls in are computed (outside every window), the rest must be
                // held consecutively from there.
                let blocks = (max_tokens / block).min(units / k);
                let chunk = u64::from(chunk);
                let start = (max_tokens / chunk * chunk / block).min(blocks);
                let mut n = start;
                while n < blocks && all((n + 1) * k - 1) {
                    n += 1;
                }
                n * block
            }
            GroupKind::Mamba => {
                if fine {
                    let last = (max_tokens / unit).min(units);
                    return (0..last)
                        .rev()
                        .find(|&u| all(u))
                        .map_or(0, |u| (u + 1) * unit);
                }
                let blocks = (max_tokens / block).min(units / k);
                (0..blocks)
                    .rev()
                    .find(|&i| {
                        all((i + 1) * k - 1) && (block == align || ((i + 1) * block) % align == 0)
                    })
                    .map_or(0, |i| (i + 1) * block)
            }
        }
    }
}

fn gcd(a: u64, b: u64) -> u64 {
    if b == 0 {
        a
    } else {
        gcd(b, a % b)
    }
}

fn lcm(a: u64, b: u64) -> u64 {
    a / gcd(a, b) * b
}
