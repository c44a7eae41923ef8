//! Which endpoints may serve a request: the pool's members that the pool says are Ready and
//! whose metrics endpoint answers, with no I/O (the daemon's endpoint picker and the lab's
//! simulated gateways keep their candidates with this one rule).
//!
//! An endpoint's [`Standing`]:
//! - with a pool ([`Membership::set_pool`]): [`Standing::NotInPool`] unless the pool lists it,
//!   [`Standing::NotReady`] while the pool says it is not Ready, [`Standing::Unreachable`] once
//!   its metrics endpoint has refused or timed out [`Membership::failures_to_leave`] times in a
//!   row, else [`Standing::Candidate`] (whether or not it ever published a KV event);
//! - without a pool (the daemon's picker with no pool configured: the model's live publishers
//!   are the candidates, as the caller lists them): [`Standing::Unreachable`] as above, else
//!   [`Standing::Candidate`].
//!
//! Invariants:
//! - an endpoint's first probe that answers (any HTTP answer: the server is up) ends its streak,
//!   so it is a candidate again at once ([`Probe::Answered`]);
//! - a streak belongs to one stay in the pool: an endpoint that leaves the pool or stops being
//!   Ready starts from zero when it comes back;
//! - every change of standing is returned ([`Change`]) exactly once, so a caller can count
//!   them by reason; nothing here panics on any input.

use std::collections::{BTreeMap, HashMap};

/// Refused or timed-out probes in a row that take an endpoint out of the candidates, by
/// default: at the daemon's default scrape interval (50 ms, a probe timing out after 250 ms)
/// a pod that refuses leaves within 150 ms, one that times out within 900 ms.
pub const DEFAULT_FAILURES_TO_LEAVE: u32 = 3;

/// What one read of an endpoint's metrics came to, as health counts it.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Probe {
    /// The endpoint answered (whatever the page said).
    Answered,
    /// The connection was refused or reset (nothing listens).
    Refused,
    /// No answer in time.
    TimedOut,
}

/// Where an endpoint stands.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub enum Standing {
    /// It may serve.
    Candidate,
    /// The pool lists it but says it is not Ready.
    NotReady,
    /// Its metrics endpoint refused or timed out too many times in a row.
    Unreachable,
    /// A pool is known and does not list it.
    NotInPool,
}

impl Standing {
    /// Its label in metrics and in `ListPods`.
    pub fn label(self) -> &'static str {
        match self {
            Self::Candidate => "candidate",
            Self::NotReady => "not_ready",
            Self::Unreachable => "unreachable",
            Self::NotInPool => "not_in_pool",
        }
    }
}

/// An endpoint's standing changed.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Change {
    /// The endpoint (`ip:port`).
    pub endpoint: String,
    /// Its standing before.
    pub from: Standing,
    /// Its standing now.
    pub to: Standing,
}

/// The pool (when known) and each probed endpoint's run of failed probes.
#[derive(Debug, Clone)]
pub struct Membership {
    failures_to_leave: u32,
    /// Endpoint -> Ready, as the pool says; `None`: no pool known.
    pool: Option<BTreeMap<String, bool>>,
    /// Endpoint -> refused or timed-out probes in a row.
    streaks: HashMap<String, u32>,
}

impl Membership {
    /// No pool yet; an endpoint leaves after `failures_to_leave` failed probes in a row (at
    /// least 1).
    pub fn new(failures_to_leave: u32) -> Self {
        Self {
            failures_to_leave: failures_to_leave.max(1),
            pool: None,
            streaks: HashMap::new(),
        }
    }

    /// Failed probes in a row that take an endpoint out.
    pub fn failures_to_leave(&self) -> u32 {
        self.failures_to_leave
    }

    /// Whether a pool is known (else the caller's publishers are the candidates).
    pub fn has_pool(&self) -> bool {
        self.pool.is_some()
    }

    /// Where `endpoint` stands.
    pub fn standing(&self, endpoint: &str) -> Standing {
        if let Some(pool) = &self.pool {
            match pool.get(endpoint) {
                None => return Standing::NotInPool,
                Some(false) => return Standing::NotReady,
                Some(true) => {}
            }
        }
        match self.failures(endpoint) >= self.failures_to_leave {
            true => Standing::Unreachable,
            false => Standing::Candidate,
        }
    }

    /// Whether `endpoint` may serve.
    pub fn admits(&self, endpoint: &str) -> bool {
        self.standing(endpoint) == Standing::Candidate
    }

    /// The failed probes in a row of `endpoint`.
    pub fn failures(&self, endpoint: &str) -> u32 {
        self.streaks.get(endpoint).copied().unwrap_or(0)
    }

    /// The pool's endpoints that may serve, in order (empty without a pool).
    pub fn candidates(&self) -> Vec<String> {
        self.members()
            .filter(|(_, s)| *s == Standing::Candidate)
            .map(|(e, _)| e.to_owned())
            .collect()
    }

    /// The endpoints out for failed probes, in no order (with or without a pool).
    pub fn unreachable(&self) -> Vec<String> {
        self.streaks
            .keys()
            .filter(|e| self.standing(e) == Standing::Unreachable)
            .cloned()
            .collect()
    }

    /// Every endpoint the pool lists, in order, with its standing (none without a pool).
    pub fn members(&self) -> impl Iterator<Item = (&str, Standing)> {
        self.pool
            .iter()
            .flat_map(|p| p.keys())
            .map(|e| (e.as_str(), self.standing(e)))
    }

    /// The pool is now `members` (each endpoint and whether the pool says it is Ready); the
    /// standings that changed.
    pub fn set_pool(&mut self, members: impl IntoIterator<Item = (String, bool)>) -> Vec<Change> {
        let new: BTreeMap<String, bool> = members.into_iter().collect();
        let mut touched: Vec<String> = new.keys().cloned().collect();
        if let Some(old) = &self.pool {
            touched.extend(old.keys().filter(|e| !new.contains_key(*e)).cloned());
        }
        let before: Vec<Standing> = touched.iter().map(|e| self.standing(e)).collect();
        // A streak belongs to one stay: it ends when the endpoint leaves or is not Ready.
        self.streaks
            .retain(|e, _| new.get(e).copied().unwrap_or(false));
        self.pool = Some(new);
        self.changes(touched, before)
    }

    /// Forgets the pool: the caller's publishers are the candidates again.
    pub fn clear_pool(&mut self) -> Vec<Change> {
        let touched: Vec<String> = self.members().map(|(e, _)| e.to_owned()).collect();
        let before: Vec<Standing> = touched.iter().map(|e| self.standing(e)).collect();
        self.pool = None;
        self.streaks.clear();
        self.changes(touched, before)
    }

    /// Counts a probe of `endpoint`; its change of standing, if any. A probe of an endpoint
    /// a known pool does not list, or says is not Ready, is not counted.
    pub fn probed(&mut self, endpoint: &str, probe: Probe) -> Option<Change> {
        if matches!(
            self.standing(endpoint),
            Standing::NotInPool | Standing::NotReady
        ) {
            return None;
        }
        let from = self.standing(endpoint);
        match probe {
            Probe::Answered => {
                self.streaks.remove(endpoint);
            }
            Probe::Refused | Probe::TimedOut => {
                let streak = self.streaks.entry(endpoint.to_owned()).or_insert(0);
                *streak = streak.saturating_add(1);
            }
        }
        let to = self.standing(endpoint);
        (from != to).then(|| Change {
            endpoint: endpoint.to_owned(),
            from,
            to,
        })
    }

    /// Drops the streaks of endpoints `keep` refuses (no longer probed).
    pub fn forget(&mut self, keep: impl Fn(&str) -> bool) {
        self.streaks.retain(|e, _| keep(e));
    }

    fn changes(&self, touched: Vec<String>, before: Vec<Standing>) -> Vec<Change> {
        touched
            .into_iter()
            .zip(before)
            .filter_map(|(endpoint, from)| {
                let to = self.standing(&endpoint);
                (from != to).then_some(Change { endpoint, from, to })
            })
            .collect()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn pool(m: &mut Membership, members: &[(&str, bool)]) -> Vec<Change> {
        m.set_pool(members.iter().map(|(e, r)| (e.to_string(), *r)))
    }

    #[test]
    fn ready_members_are_candidates_whether_or_not_they_published() {
        let mut m = Membership::new(3);
        assert!(!m.has_pool());
        assert!(
            m.admits("10.0.0.1:8000"),
            "no pool: the caller's publishers"
        );
        let changes = pool(&mut m, &[("10.0.0.1:8000", true), ("10.0.0.2:8000", false)]);
        assert_eq!(m.candidates(), ["10.0.0.1:8000"]);
        assert_eq!(m.standing("10.0.0.2:8000"), Standing::NotReady);
        assert_eq!(m.standing("10.0.0.9:8000"), Standing::NotInPool);
        // Only the unready one changed (from a candidate with no pool known).
        assert_eq!(
            changes,
            [Change {
                endpoint: "10.0.0.2:8000".into(),
                from: Standing::Candidate,
                to: Standing::NotReady
            }]
        );
    }

    #[test]
    fn failed_probes_in_a_row_take_an_endpoint_out_and_an_answer_brings_it_back() {
        let mut m = Membership::new(3);
        pool(&mut m, &[("a:1", true), ("b:1", true)]);
        assert_eq!(m.probed("a:1", Probe::Refused), None);
        assert_eq!(
            m.probed("a:1", Probe::Answered),
            None,
            "an answer ends the run"
        );
        assert_eq!(m.probed("a:1", Probe::Refused), None);
        assert_eq!(m.probed("a:1", Probe::TimedOut), None);
        let left = m.probed("a:1", Probe::Refused);
        assert_eq!(
            left.map(|c| (c.from, c.to)),
            Some((Standing::Candidate, Standing::Unreachable))
        );
        assert_eq!(m.candidates(), ["b:1"]);
        assert_eq!(m.probed("a:1", Probe::Refused), None, "already out");
        let back = m.probed("a:1", Probe::Answered);
        assert_eq!(
            back.map(|c| (c.from, c.to)),
            Some((Standing::Unreachable, Standing::Candidate))
        );
        assert_eq!(m.candidates(), ["a:1", "b:1"]);
    }

    #[test]
    fn a_streak_ends_with_the_stay_in_the_pool() {
        let mut m = Membership::new(2);
        pool(&mut m, &[("a:1", true)]);
        m.probed("a:1", Probe::Refused);
        m.probed("a:1", Probe::Refused);
        assert_eq!(m.standing("a:1"), Standing::Unreachable);
        pool(&mut m, &[("a:1", false)]);
        assert_eq!(m.standing("a:1"), Standing::NotReady);
        assert_eq!(m.probed("a:1", Probe::Refused), None, "not counted");
        let changes = pool(&mut m, &[("a:1", true)]);
        assert_eq!(m.standing("a:1"), Standing::Candidate, "{changes:?}");
        assert_eq!(m.failures("a:1"), 0);
        // Removed from the pool: not in it, and a probe is not counted.
        let changes = pool(&mut m, &[]);
        assert_eq!(changes[0].to, Standing::NotInPool);
        assert_eq!(m.probed("a:1", Probe::Refused), None);
        assert_eq!(m.failures("a:1"), 0);
    }

    #[test]
    fn without_a_pool_health_still_applies() {
        let mut m = Membership::new(1);
        let left = m.probed("p:1", Probe::TimedOut);
        assert_eq!(left.map(|c| c.to), Some(Standing::Unreachable));
        assert!(!m.admits("p:1"));
        assert_eq!(m.unreachable(), ["p:1"]);
        assert!(m.candidates().is_empty(), "the caller lists the publishers");
        m.forget(|_| false);
        assert!(m.admits("p:1"), "forgotten: no streak");
        pool(&mut m, &[("p:1", true)]);
        let changes = m.clear_pool();
        assert!(changes.is_empty(), "{changes:?}");
        assert!(!m.has_pool());
    }

    #[test]
    fn zero_failures_to_leave_is_one() {
        let mut m = Membership::new(0);
        assert_eq!(m.failures_to_leave(), 1);
        assert!(m.probed("x:1", Probe::Refused).is_some());
    }
}
