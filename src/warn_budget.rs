//! How many warning lines the daemon prints: what input can repeat must not flood the logs.
//!
//! - [`WarnThrottle`]: at most one line per reason every 10 s (a frame error, an undecodable
//!   payload, Redis unreachable), with the count of lines held back since the last one;
//! - [`WarnBudget`]: one budget for the lines that name a publisher (a restart, a hash
//!   mismatch, a filled gap, a forgotten pod), so a fleet of 20,000 pods with the same problem
//!   prints a handful of lines and a count, not 20,000 lines. At most [`LINES_PER_WINDOW`]
//!   lines per kind are printed per [`WINDOW`]; the rest are counted, and
//!   [`WarnBudget::summarize`] (called every window) prints one line per kind: "N more like
//!   this suppressed".
//!
//! Metrics count every occurrence regardless: these decide only what is printed.

use std::sync::atomic::{AtomicU32, AtomicU64, Ordering};
use std::time::{Duration, SystemTime, UNIX_EPOCH};

/// At most one line per reason every 10 s, reporting how many were held back.
#[derive(Default)]
pub struct WarnThrottle {
    last: AtomicU64,
    suppressed: AtomicU64,
}

impl WarnThrottle {
    /// `Some(lines held back since the last one)` when a line may be printed now.
    pub fn allow(&self) -> Option<u64> {
        let now = SystemTime::now()
            .duration_since(UNIX_EPOCH)
            .map_or(0, |d| d.as_secs());
        let last = self.last.load(Ordering::Relaxed);
        if now >= last + 10
            && self
                .last
                .compare_exchange(last, now, Ordering::Relaxed, Ordering::Relaxed)
                .is_ok()
        {
            return Some(self.suppressed.swap(0, Ordering::Relaxed));
        }
        self.suppressed.fetch_add(1, Ordering::Relaxed);
        None
    }
}

/// The budget's window.
pub const WINDOW: Duration = Duration::from_secs(10);

/// Publisher lines of one kind printed per window at most.
pub const LINES_PER_WINDOW: u32 = 10;

/// The kinds of publisher lines, each with its own share of the budget and its own summary.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
#[repr(usize)]
pub enum LineKind {
    /// A publisher restarted (its blocks cleared).
    Restart,
    /// A pod's block hashes do not match kv-indexer's (with the diagnosis).
    HashMismatch,
    /// A gap was filled from the publisher's replay buffer.
    GapFilled,
    /// A pod was forgotten (gone, idle, or cleared).
    Forgotten,
    /// An engine's key mode was decided (translated, refused).
    KeyMode,
    /// A publisher's events were dropped for a reason its operator must act on (a rank out
    /// of range, blocks its tokens do not cover, a key budget too small to translate).
    Dropped,
}

const KINDS: usize = 6;

impl LineKind {
    const ALL: [LineKind; KINDS] = [
        LineKind::Restart,
        LineKind::HashMismatch,
        LineKind::GapFilled,
        LineKind::Forgotten,
        LineKind::KeyMode,
        LineKind::Dropped,
    ];

    /// What the summary line calls these lines.
    fn describe(self) -> &'static str {
        match self {
            LineKind::Restart => "publisher restarts",
            LineKind::HashMismatch => "pods with mismatched block hashes",
            LineKind::GapFilled => "gaps filled from a replay buffer",
            LineKind::Forgotten => "pods forgotten",
            LineKind::KeyMode => "engines whose key mode was decided",
            LineKind::Dropped => "publishers whose events were dropped",
        }
    }
}

/// The shared budget (cheap atomics; no lock on the logging path).
#[derive(Default)]
pub struct WarnBudget {
    /// The window the counts below belong to (seconds since the epoch / window length).
    window: AtomicU64,
    printed: [AtomicU32; KINDS],
    suppressed: [AtomicU64; KINDS],
}

impl WarnBudget {
    /// Whether a line of `kind` may be printed now; when not, it is counted for the summary.
    pub fn allow(&self, kind: LineKind) -> bool {
        self.roll();
        let i = kind as usize;
        if self.printed[i].fetch_add(1, Ordering::Relaxed) < LINES_PER_WINDOW {
            return true;
        }
        self.suppressed[i].fetch_add(1, Ordering::Relaxed);
        false
    }

    /// Prints one line per kind that had lines suppressed since the last summary, and resets
    /// the counts. Returns the lines suppressed.
    pub fn summarize(&self) -> u64 {
        let mut total = 0;
        for kind in LineKind::ALL {
            let n = self.suppressed[kind as usize].swap(0, Ordering::Relaxed);
            if n > 0 {
                total += n;
                tracing::warn!(
                    suppressed = n,
                    "{n} more like this suppressed ({}; at most {LINES_PER_WINDOW} lines each per {WINDOW:?}; metrics count them all)",
                    kind.describe()
                );
            }
        }
        total
    }

    /// Starts a new window when the clock has moved past the current one.
    fn roll(&self) {
        let now = SystemTime::now()
            .duration_since(UNIX_EPOCH)
            .map_or(0, |d| d.as_secs() / WINDOW.as_secs());
        let window = self.window.load(Ordering::Relaxed);
        if now != window
            && self
                .window
                .compare_exchange(window, now, Ordering::Relaxed, Ordering::Relaxed)
                .is_ok()
        {
            for printed in &self.printed {
                printed.store(0, Ordering::Relaxed);
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_throttle_prints_one_line_then_counts_what_it_held_back() {
        let throttle = WarnThrottle::default();
        assert_eq!(throttle.allow(), Some(0), "the first line prints");
        // Within the same 10 s (a boundary in between would print one more, never fewer).
        let held = (0..5).filter(|_| throttle.allow().is_none()).count();
        assert!(held >= 4, "{held}");
    }

    #[test]
    fn a_burst_prints_the_budget_and_counts_the_rest_per_kind() {
        let budget = WarnBudget::default();
        // 20,000 pods with a mismatch, 3 restarts, within one window (a window boundary in
        // the middle would only allow more lines, never fewer).
        let printed = (0..20_000)
            .filter(|_| budget.allow(LineKind::HashMismatch))
            .count() as u32;
        let restarts = (0..3).filter(|_| budget.allow(LineKind::Restart)).count();
        assert!(
            (LINES_PER_WINDOW..=2 * LINES_PER_WINDOW).contains(&printed),
            "{printed}"
        );
        assert_eq!(restarts, 3, "kinds have their own share");
        assert_eq!(budget.summarize(), 20_000 - printed as u64);
        assert_eq!(budget.summarize(), 0, "the summary resets the counts");
    }
}
