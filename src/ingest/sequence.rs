//! The per-publisher sequence state machine, pure: given the last sequence applied from a
//! publisher and the sequence of the message that just arrived, what happened and what to fetch.
//!
//! vLLM numbers each engine's batches 0, 1, 2, ... (`seq` frame, big-endian u64). Outcomes:
//! - **first** message from a publisher: apply it; if it is not 0, the daemon joined late (it
//!   started after the engine, or ZeroMQ's slow joiner dropped the first messages), so fetch
//!   `0..seq` first, without counting those as lost (they may never have been meant for us);
//! - **next** (`last + 1`): apply;
//! - **duplicate** (`== last`): drop;
//! - **restart** (`< last`): the engine restarted and its cache is gone: clear its blocks, then
//!   fetch `0..seq` if it is not 0, and apply;
//! - **gap** (`> last + 1`, by at most [`MAX_GAP`]): fetch `last + 1 .. seq`; what cannot be
//!   fetched is lost and counted;
//! - **resync** (a jump forward by more than [`MAX_GAP`]): no engine publishes that many messages
//!   between two of ours (vLLM buffers 10,000), so the stream is not the one we knew: clear the
//!   engine's blocks, as for a restart, and count nothing as lost (a forged or corrupt sequence
//!   cannot inflate the loss counters).
//!
//! With replication, one publisher's messages reach a replica by two paths (its own ZMQ socket
//! and the shared log, where another replica put them), so a message can come after a newer
//! one, and messages of an engine's previous incarnation can come after its restart.
//! [`SeqOutcome::classify_timed`] tells these apart by the batch's timestamp (vLLM's wall
//! clock, `ts`): a lower sequence with an older or equal timestamp is **stale** (dropped), with
//! a newer one a restart; a higher sequence more than [`INCARNATION_SKEW_SECS`] older than the last
//! applied is a message of the previous incarnation, also stale. A restarted engine takes
//! seconds to load its model, far more than any skew of one node's clock. Without replication
//! there is one path and the daemon uses [`SeqOutcome::classify`].

use std::ops::Range;

/// How much older than the last applied batch a batch with a *higher* sequence must be to
/// belong to an earlier incarnation (seconds): a clock stepped back by NTP stays far below.
pub const INCARNATION_SKEW_SECS: f64 = 1.0;

/// The largest forward jump taken as a gap (16.7M messages: hours of a busy engine's traffic).
pub const MAX_GAP: u64 = 1 << 24;

/// What a message's sequence number means for its publisher's stream.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum SeqOutcome {
    /// The publisher's first message; `missed` is what came before it (`0..seq`), if anything.
    First {
        /// Sequences to fetch first (not counted as lost when unavailable).
        missed: Option<Range<u64>>,
    },
    /// The expected next message.
    Next,
    /// The same sequence again: drop it.
    Duplicate,
    /// The sequence went backwards: a restarted engine.
    Restart {
        /// Sequences of the new incarnation to fetch first (not counted as lost).
        missed: Option<Range<u64>>,
    },
    /// The sequence jumped further than any real gap: start the stream afresh.
    Resync,
    /// Messages were skipped.
    Gap {
        /// The skipped sequences (counted as lost when they cannot be fetched).
        missing: Range<u64>,
    },
    /// An earlier message of the same incarnation, after a newer one was applied (it came
    /// the long way, through the replication log or late from the socket): drop it.
    Stale,
}

impl SeqOutcome {
    /// Classifies `seq` after `last` (the last sequence applied, `None` for a new publisher).
    pub fn classify(last: Option<u64>, seq: u64) -> Self {
        let from_zero = (seq > 0).then_some(0..seq);
        match last {
            None => SeqOutcome::First { missed: from_zero },
            Some(last) if seq == last.wrapping_add(1) => SeqOutcome::Next,
            Some(last) if seq == last => SeqOutcome::Duplicate,
            Some(last) if seq < last => SeqOutcome::Restart { missed: from_zero },
            Some(last) if seq - last > MAX_GAP => SeqOutcome::Resync,
            Some(last) => SeqOutcome::Gap {
                missing: last + 1..seq,
            },
        }
    }

    /// As [`classify`](Self::classify), with the batches' timestamps: a sequence that went
    /// backwards without a newer timestamp than the last applied is [`Stale`](Self::Stale), not
    /// a restart; a higher one far older is stale too (an earlier incarnation's). `last` is `(sequence, ts)` of the last message applied.
    pub fn classify_timed(last: Option<(u64, f64)>, seq: u64, ts: f64) -> Self {
        match last {
            // Not newer than the last applied: a copy that came the long way. (Equal timestamps
            // count as older: a real restart's clock has moved on by the model's load time.)
            Some((last_seq, last_ts)) if seq < last_seq && ts <= last_ts => SeqOutcome::Stale,
            Some((last_seq, last_ts)) if seq > last_seq && ts < last_ts - INCARNATION_SKEW_SECS => {
                SeqOutcome::Stale
            }
            _ => Self::classify(last.map(|(s, _)| s), seq),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::SeqOutcome::{self, *};

    #[test]
    fn first_message_at_zero_needs_nothing() {
        assert_eq!(SeqOutcome::classify(None, 0), First { missed: None });
    }

    #[test]
    fn first_message_late_fetches_from_zero() {
        assert_eq!(SeqOutcome::classify(None, 7), First { missed: Some(0..7) });
    }

    #[test]
    fn next_in_order() {
        assert_eq!(SeqOutcome::classify(Some(4), 5), Next);
    }

    #[test]
    fn next_across_the_u64_wrap() {
        assert_eq!(SeqOutcome::classify(Some(u64::MAX), 0), Next);
    }

    #[test]
    fn duplicate_is_dropped() {
        assert_eq!(SeqOutcome::classify(Some(9), 9), Duplicate);
    }

    #[test]
    fn backwards_to_zero_is_a_restart_with_nothing_missed() {
        assert_eq!(SeqOutcome::classify(Some(100), 0), Restart { missed: None });
    }

    #[test]
    fn backwards_past_zero_is_a_restart_that_fetches_its_start() {
        assert_eq!(
            SeqOutcome::classify(Some(100), 3),
            Restart { missed: Some(0..3) }
        );
    }

    #[test]
    fn an_implausible_jump_is_a_resync_not_a_loss() {
        assert_eq!(SeqOutcome::classify(Some(0), 1 << 63), Resync);
        assert_eq!(SeqOutcome::classify(Some(1 << 63), u64::MAX), Resync);
        assert_eq!(
            SeqOutcome::classify(Some(10), 10 + super::MAX_GAP),
            Gap {
                missing: 11..10 + super::MAX_GAP
            }
        );
        assert_eq!(SeqOutcome::classify(Some(10), 11 + super::MAX_GAP), Resync);
    }

    #[test]
    fn backwards_and_older_is_stale_backwards_and_newer_is_a_restart() {
        assert_eq!(SeqOutcome::classify_timed(Some((9, 50.0)), 7, 49.5), Stale);
        assert_eq!(
            SeqOutcome::classify_timed(Some((9, 50.0)), 0, 80.0),
            Restart { missed: None }
        );
        // Equal timestamps (a publisher that never advances its clock) cannot be a restart:
        // with two paths the lower sequence is the stale copy.
        assert_eq!(SeqOutcome::classify_timed(Some((9, 0.0)), 0, 0.0), Stale);
        assert_eq!(
            SeqOutcome::classify_timed(Some((9, 50.0)), 9, 50.0),
            Duplicate
        );
        assert_eq!(SeqOutcome::classify_timed(Some((9, 50.0)), 10, 50.1), Next);
        assert_eq!(
            SeqOutcome::classify_timed(None, 3, 1.0),
            First { missed: Some(0..3) }
        );
    }

    #[test]
    fn a_jump_is_a_gap_of_exactly_the_skipped_sequences() {
        assert_eq!(SeqOutcome::classify(Some(4), 9), Gap { missing: 5..9 });
        assert_eq!(SeqOutcome::classify(Some(4), 6), Gap { missing: 5..6 });
    }
}
