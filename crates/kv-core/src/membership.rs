//! Which endpoints may serve a request: the pool's members that the pool says are Ready, less
//! those whose server has been seen dead, within a bound, with no I/O (the daemon's endpoint
//! picker and the lab's simulated gateways keep their candidates with this one rule).
//!
//! Health follows Envoy's outlier detection, not a scrape's latency:
//! - no connection (refused, reset, or a TCP connect that timed out: nothing listens, or the
//!   node is cut off) is evidence of a dead server ([`Probe::NoConnection`]);
//!   [`HealthSettings::failures_to_leave`] of them in a row eject the endpoint;
//! - a slow answer is not ([`Probe::Slow`]: connected, no page in time, changes nothing here:
//!   the caller's load sample ages instead), so a busy pod whose metrics page answers late
//!   keeps serving, and a hung server whose kernel still accepts leaves when its pod stops
//!   being Ready;
//! - ejection is bounded: at most [`HealthSettings::max_ejection_percent`] of the Ready
//!   endpoints (and always at least one, as Envoy ejects one host whatever the percentage),
//!   the first to cross the streak first;
//! - when fewer than [`HealthSettings::panic_threshold_percent`] of the Ready endpoints would
//!   remain, every Ready endpoint is a candidate again ([`Membership::panicking`]), as Envoy's
//!   `healthy_panic_threshold` routes to every host rather than none.
//!
//! An endpoint's [`Standing`]:
//! - with a pool ([`Membership::set_pool`]): [`Standing::NotInPool`] unless the pool lists it,
//!   [`Standing::NotReady`] while the pool says it is not Ready, [`Standing::Unreachable`] while
//!   it is ejected, else [`Standing::Candidate`] (whether or not it ever published a KV event);
//! - without a pool (the daemon's picker with no pool configured: the model's live publishers
//!   are the candidates, as the caller lists them): [`Standing::Unreachable`] while ejected,
//!   else [`Standing::Candidate`]; the bound's base is then the endpoints probed.
//!
//! Invariants:
//! - an endpoint's first probe that answers (any HTTP answer: the server is up) ends its streak,
//!   so it is a candidate again at once ([`Probe::Answered`]);
//! - a streak belongs to one stay in the pool: an endpoint that leaves the pool or stops being
//!   Ready starts from zero when it comes back;
//! - at most `max(1, ready * max_ejection_percent / 100)` endpoints are ejected, and while
//!   panicking [`Membership::admits`] every Ready endpoint;
//! - every change of standing is returned ([`Change`]) exactly once, so a caller can count
//!   them by reason; nothing here panics on any input, and a probe that changes no streak's
//!   crossing costs no pass over the pool.

use std::collections::{BTreeMap, BTreeSet, HashMap};

/// Probes in a row without a connection that eject an endpoint, by default: at the daemon's
/// default scrape interval (50 ms) a pod whose port refuses leaves within 150 ms.
pub const DEFAULT_FAILURES_TO_LEAVE: u32 = 3;

/// The most of the Ready endpoints ejected at once, by default (Envoy's outlier detection
/// bounds it likewise; GIE's EPP never ejects on metrics).
pub const DEFAULT_MAX_EJECTION_PERCENT: u32 = 50;

/// Below this share of Ready endpoints left, every Ready endpoint is a candidate, by default
/// (Envoy's `healthy_panic_threshold`).
pub const DEFAULT_PANIC_THRESHOLD_PERCENT: u32 = 50;

/// How health takes endpoints out, and how far.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct HealthSettings {
    /// Probes in a row without a connection that eject an endpoint (at least 1).
    pub failures_to_leave: u32,
    /// The most of the Ready endpoints ejected at once, 0-100 (at least one is, whatever it
    /// says).
    pub max_ejection_percent: u32,
    /// Below this share (0-100) of Ready endpoints left, every Ready endpoint is a candidate.
    pub panic_threshold_percent: u32,
}

impl Default for HealthSettings {
    fn default() -> Self {
        Self {
            failures_to_leave: DEFAULT_FAILURES_TO_LEAVE,
            max_ejection_percent: DEFAULT_MAX_EJECTION_PERCENT,
            panic_threshold_percent: DEFAULT_PANIC_THRESHOLD_PERCENT,
        }
    }
}

impl HealthSettings {
    /// The defaults with `failures_to_leave` probes without a connection in a row.
    pub fn leaving_after(failures_to_leave: u32) -> Self {
        Self {
            failures_to_leave,
            ..Self::default()
        }
    }

    /// How many of `base` endpoints may be ejected at once (at least one).
    pub fn max_ejected(&self, base: usize) -> usize {
        let percent = self.max_ejection_percent.min(100) as usize;
        (base * percent / 100).max(1)
    }

    /// Whether `left` of `base` endpoints is below the panic threshold.
    pub fn panics(&self, left: usize, base: usize) -> bool {
        base > 0 && left * 100 < base * self.panic_threshold_percent.min(100) as usize
    }
}

/// What one read of an endpoint's metrics came to, as health counts it.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Probe {
    /// The endpoint answered (whatever the page said).
    Answered,
    /// No connection: refused or reset (nothing listens), or the TCP connect timed out (the
    /// node is down or cut off): evidence of a dead server.
    NoConnection,
    /// Connected, but no answer in time: the server may be busy, so health counts nothing (the
    /// load sample ages instead).
    Slow,
}

/// Where an endpoint stands.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub enum Standing {
    /// It may serve.
    Candidate,
    /// The pool lists it but says it is not Ready.
    NotReady,
    /// Ejected: its metrics port gave no connection too many times in a row (a candidate again
    /// while the pool panics).
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

/// The pool (when known), each probed endpoint's run of probes without a connection, and who
/// is ejected.
#[derive(Debug, Clone)]
pub struct Membership {
    settings: HealthSettings,
    /// Endpoint -> Ready, as the pool says; `None`: no pool known.
    pool: Option<BTreeMap<String, bool>>,
    /// Endpoint -> probes without a connection in a row.
    streaks: HashMap<String, u32>,
    /// The endpoints whose streak reached `failures_to_leave`, by when they reached it.
    over: BTreeMap<u64, String>,
    /// Where each endpoint of `over` is in it.
    crossed_at: HashMap<String, u64>,
    crossings: u64,
    /// Without a pool: the endpoints probed (the bound's base).
    seen: BTreeSet<String>,
    /// The endpoints ejected now: the first of `over`, within the bound.
    ejected: BTreeSet<String>,
    panicking: bool,
}

impl Membership {
    /// No pool yet; endpoints are ejected as `settings` says.
    pub fn new(settings: HealthSettings) -> Self {
        Self {
            settings: HealthSettings {
                failures_to_leave: settings.failures_to_leave.max(1),
                ..settings
            },
            pool: None,
            streaks: HashMap::new(),
            over: BTreeMap::new(),
            crossed_at: HashMap::new(),
            crossings: 0,
            seen: BTreeSet::new(),
            ejected: BTreeSet::new(),
            panicking: false,
        }
    }

    /// How endpoints are ejected.
    pub fn settings(&self) -> HealthSettings {
        self.settings
    }

    /// Probes without a connection in a row that eject an endpoint.
    pub fn failures_to_leave(&self) -> u32 {
        self.settings.failures_to_leave
    }

    /// Whether a pool is known (else the caller's publishers are the candidates).
    pub fn has_pool(&self) -> bool {
        self.pool.is_some()
    }

    /// Whether too few endpoints would be left, so every Ready one is a candidate.
    pub fn panicking(&self) -> bool {
        self.panicking
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
        match self.ejected.contains(endpoint) {
            true => Standing::Unreachable,
            false => Standing::Candidate,
        }
    }

    /// Whether `endpoint` may serve (an ejected one too while the pool panics).
    pub fn admits(&self, endpoint: &str) -> bool {
        match self.standing(endpoint) {
            Standing::Candidate => true,
            Standing::Unreachable => self.panicking,
            Standing::NotReady | Standing::NotInPool => false,
        }
    }

    /// The probes without a connection in a row of `endpoint`.
    pub fn failures(&self, endpoint: &str) -> u32 {
        self.streaks.get(endpoint).copied().unwrap_or(0)
    }

    /// The pool's endpoints that may serve, in order (empty without a pool).
    pub fn candidates(&self) -> Vec<String> {
        self.members()
            .filter(|(e, _)| self.admits(e))
            .map(|(e, _)| e.to_owned())
            .collect()
    }

    /// The endpoints ejected now, in order (with or without a pool; see [`Self::panicking`]).
    pub fn unreachable(&self) -> Vec<String> {
        self.ejected.iter().cloned().collect()
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
        self.changing(touched, |m| {
            // A streak belongs to one stay: it ends when the endpoint leaves or is not Ready.
            let ended: Vec<String> = m
                .streaks
                .keys()
                .filter(|e| !new.get(*e).copied().unwrap_or(false))
                .cloned()
                .collect();
            for e in ended {
                m.end_streak(&e);
            }
            m.pool = Some(new);
            m.seen.clear();
        })
    }

    /// Forgets the pool: the caller's publishers are the candidates again.
    pub fn clear_pool(&mut self) -> Vec<Change> {
        let touched: Vec<String> = self.members().map(|(e, _)| e.to_owned()).collect();
        self.changing(touched, |m| {
            m.pool = None;
            m.streaks.clear();
            m.over.clear();
            m.crossed_at.clear();
        })
    }

    /// Counts a probe of `endpoint`; the changes of standing it makes (its own, and others'
    /// when the bound lets another in or out). A probe of an endpoint a known pool does not
    /// list, or says is not Ready, is not counted.
    pub fn probed(&mut self, endpoint: &str, probe: Probe) -> Vec<Change> {
        if matches!(
            self.standing(endpoint),
            Standing::NotInPool | Standing::NotReady
        ) {
            return Vec::new();
        }
        let newly_seen = self.pool.is_none() && !self.seen.contains(endpoint);
        let crossing = match probe {
            Probe::Slow => false,
            Probe::Answered => self.end_streak(endpoint),
            Probe::NoConnection => {
                let streak = self.streaks.entry(endpoint.to_owned()).or_insert(0);
                *streak = streak.saturating_add(1);
                *streak == self.settings.failures_to_leave && self.cross(endpoint)
            }
        };
        if !newly_seen && !crossing {
            return Vec::new();
        }
        self.changing(vec![endpoint.to_owned()], |m| {
            if newly_seen {
                m.seen.insert(endpoint.to_owned());
            }
        })
    }

    /// Drops what is known of endpoints `keep` refuses (no longer probed).
    pub fn forget(&mut self, keep: impl Fn(&str) -> bool) {
        let gone: Vec<String> = self
            .streaks
            .keys()
            .chain(self.seen.iter())
            .filter(|e| !keep(e))
            .cloned()
            .collect();
        if gone.is_empty() {
            return;
        }
        self.changing(gone.clone(), |m| {
            for e in &gone {
                m.end_streak(e);
                m.seen.remove(e);
            }
        });
    }

    /// Puts `endpoint` over the streak; whether it was not already.
    fn cross(&mut self, endpoint: &str) -> bool {
        if self.crossed_at.contains_key(endpoint) {
            return false;
        }
        self.crossings += 1;
        self.over.insert(self.crossings, endpoint.to_owned());
        self.crossed_at.insert(endpoint.to_owned(), self.crossings);
        true
    }

    /// Ends `endpoint`'s streak; whether it was over the streak.
    fn end_streak(&mut self, endpoint: &str) -> bool {
        self.streaks.remove(endpoint);
        match self.crossed_at.remove(endpoint) {
            Some(at) => {
                self.over.remove(&at);
                true
            }
            None => false,
        }
    }

    /// How many endpoints the bound is a share of: the pool's Ready ones, or those probed.
    fn base(&self) -> usize {
        match &self.pool {
            Some(pool) => pool.values().filter(|ready| **ready).count(),
            None => self.seen.len(),
        }
    }

    /// Runs `change`, then decides again who is ejected and whether the pool panics; every
    /// standing that changed among `touched`, the ejected and those over the streak.
    fn changing(
        &mut self,
        mut touched: Vec<String>,
        change: impl FnOnce(&mut Self),
    ) -> Vec<Change> {
        touched.extend(self.ejected.iter().cloned());
        touched.extend(self.over.values().cloned());
        let before: Vec<Standing> = touched.iter().map(|e| self.standing(e)).collect();
        change(self);
        let allowed = self.settings.max_ejected(self.base());
        self.ejected = self
            .over
            .values()
            .filter(|e| self.pool.as_ref().is_none_or(|p| p.get(*e) == Some(&true)))
            .take(allowed)
            .cloned()
            .collect();
        let base = self.base();
        self.panicking = self
            .settings
            .panics(base - self.ejected.len().min(base), base);
        // Each endpoint once (it may be touched, ejected and over the streak at once).
        let mut listed = BTreeSet::new();
        touched
            .into_iter()
            .zip(before)
            .filter_map(|(endpoint, from)| {
                let to = self.standing(&endpoint);
                (from != to && listed.insert(endpoint.clone())).then_some(Change {
                    endpoint,
                    from,
                    to,
                })
            })
            .collect()
    }
}

#[cfg(test)]
mod tests;
