//! The log's coordinates: a Redis stream entry id ([`StreamId`], the position of a replica in
//! the log and of a snapshot) and the wall clock stream ids and snapshot times are in
//! ([`now_ms`]).

use std::fmt;

/// A Redis stream entry id (`<ms>-<seq>`); log positions are these.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Default)]
pub struct StreamId {
    /// Milliseconds part.
    pub ms: u64,
    /// Sequence part.
    pub seq: u64,
}

impl StreamId {
    /// Before every entry.
    pub const ZERO: StreamId = StreamId { ms: 0, seq: 0 };

    /// Parses `<ms>-<seq>`.
    pub fn parse(text: &str) -> Option<Self> {
        let (ms, seq) = text.split_once('-')?;
        Some(Self {
            ms: ms.parse().ok()?,
            seq: seq.parse().ok()?,
        })
    }
}

impl fmt::Display for StreamId {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{}-{}", self.ms, self.seq)
    }
}

/// Wall-clock milliseconds since the epoch (stream ids and snapshot times are in these).
pub(super) fn now_ms() -> u64 {
    std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map_or(0, |d| d.as_millis() as u64)
}

#[cfg(test)]
mod tests {
    use super::StreamId;

    #[test]
    fn stream_ids_parse_print_and_order_numerically() {
        let a = StreamId::parse("1700000000000-9").expect("id");
        let b = StreamId::parse("1700000000000-10").expect("id");
        assert!(a < b);
        assert_eq!(b.to_string(), "1700000000000-10");
        assert!(StreamId::parse("nonsense").is_none());
        assert!(StreamId::parse("1-").is_none());
    }
}
