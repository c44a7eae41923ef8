//! Reusable per-id marks that are cleared in O(1): each mark records the round it was set in,
//! and starting a round invalidates every earlier mark. The scoring paths use them to intersect
//! sets and deduplicate ids without clearing (or allocating) anything per call.

/// Marks over dense ids (engine ids, pod indexes), valid for the current round only.
#[derive(Debug, Default)]
pub(crate) struct RoundMarks {
    rounds: Vec<u32>,
    round: u32,
}

impl RoundMarks {
    /// Starts a new round: every mark set before is gone.
    pub fn next_round(&mut self) {
        self.round = self.round.wrapping_add(1);
        if self.round == 0 {
            // Once every 2^32 rounds: old marks could alias the new round numbers.
            self.rounds.fill(0);
            self.round = 1;
        }
    }

    /// Marks `id` in this round; `true` if it was not marked yet.
    #[inline]
    pub fn mark(&mut self, id: usize) -> bool {
        if id >= self.rounds.len() {
            self.rounds.resize(id + 1, 0);
        }
        let fresh = self.rounds[id] != self.round;
        self.rounds[id] = self.round;
        fresh
    }

    /// Whether `id` was marked in this round.
    #[inline]
    pub fn is_marked(&self, id: usize) -> bool {
        self.round != 0 && self.rounds.get(id) == Some(&self.round)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_new_round_forgets_every_mark_even_across_wraparound() {
        let mut m = RoundMarks::default();
        assert!(!m.is_marked(3), "nothing is marked before the first round");
        m.next_round();
        assert!(m.mark(3));
        assert!(!m.mark(3), "already marked in this round");
        assert!(m.is_marked(3) && !m.is_marked(4));
        m.next_round();
        assert!(!m.is_marked(3));
        m.round = u32::MAX;
        m.mark(5);
        m.next_round();
        assert!(!m.is_marked(5), "the wrap clears old marks");
        assert_eq!(m.round, 1);
    }
}
