//! What a score lists: a pod's score ([`PodScore`]), a data-parallel rank's ([`RankScore`]),
//! and the handle that names a pod without copying its name ([`PodRef`]). The score (`score`)
//! fills them; the holder order (`order`) sorts them.

/// A pod's score for a prompt. The pod is a handle: its name is `ScoreResult::pod`.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct PodScore {
    /// The pod (resolve with `ScoreResult::pod`).
    pub pod: PodRef,
    /// Tier-weighted consecutive blocks from the prompt's start.
    pub score: f64,
    /// Consecutive blocks from the prompt's start the pod holds (speculative ones included).
    pub matched_blocks: u32,
    /// Of `matched_blocks`, those held only by speculative entries (recorded routings not yet
    /// confirmed by the pod's events), at the end of the run.
    pub speculative_blocks: u32,
    /// The data-parallel rank the score comes from, for a data-parallel pod that holds part
    /// of the prompt (the best rank; ties to the lowest): the rank a gateway pins the request
    /// to. `None` for a pod without data parallelism, and for one holding nothing.
    pub rank: Option<u32>,
}

/// One data-parallel rank's score (`ScoreResult::ranks`, for callers that place ranks
/// themselves).
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct RankScore {
    /// The pod (resolve with `ScoreResult::pod_name`).
    pub pod: PodRef,
    /// Its rank; `None` for a pod without data parallelism.
    pub rank: Option<u32>,
    /// Tier-weighted consecutive blocks from the prompt's start.
    pub score: f64,
    /// Consecutive blocks from the prompt's start this rank holds.
    pub matched_blocks: u32,
}

/// A pod named in a `ScoreResult`, without copying or reference-counting its name (listing
/// 1,024 pods by `Arc<str>` costs a cache miss per pod on the reference counts alone).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum PodRef {
    /// A pod the index knows: its index in the result's directory.
    Known(u32),
    /// A candidate the index has never heard of: its index among the result's unknown names.
    Unknown(u32),
    /// A pod known only by its speculative entries (routings recorded for a pod that
    /// publishes no events): its index in the speculative directory.
    Speculative(u32),
}
