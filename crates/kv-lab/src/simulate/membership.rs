//! Which pods a simulated gateway may route to, as time goes: the pool as Kubernetes lists it
//! (pods join at a time: a scale-out; a pod whose node is cut off is marked not Ready only once
//! its readiness probe has failed long enough), and kv-indexer's picker's rule over it,
//! kv-core's [`Membership`] (the daemon's one implementation): the pool's Ready pods less those
//! whose metrics port gives no connection, or without a pool the pods that published.
//!
//! Invariants: a pod is in the pool from its join time on (pods without a join time from the
//! start); a restarting pod is not Ready from [`CRASH_NOTICED_MS`] after its restart until it
//! serves again (the kubelet sees its container exit); a killed pod's node is cut off, so each
//! of its probes is a TCP connect that times out (`probe_timeout_ms` each, as the daemon's
//! scraper times out), while a restarting pod refuses at once; the
//! fleet's pods that were in the pool from the start count as having published (a fleet that
//! has served), a later pod once its first events are delivered.

use kv_core::{HealthSettings, Membership, Probe};

/// How long the kubelet takes to see a restarting pod's container exit and mark the pod not
/// Ready (its pod lifecycle relist runs every second), ms.
pub const CRASH_NOTICED_MS: f64 = 1_000.0;

/// Which candidates a router sees.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum CandidateRule {
    /// The pool's Ready pods, as Kubernetes says (GIE's EPP keeps the pool's Ready pods).
    Ready,
    /// kv-indexer's picker with a pool: its Ready pods whose metrics endpoint answers.
    Pool,
    /// kv-indexer's picker without a pool: the pods that published, whose metrics answer.
    Publishers,
}

/// How the pool changes over a run.
#[derive(Debug, Clone, Default, serde::Serialize)]
pub struct PoolChanges {
    /// (time ms, pod): the pod joins the pool, Ready (a scale-out); other pods are in it from
    /// the start.
    pub joins: Vec<(f64, usize)>,
    /// (time ms, pod): the pod's node is cut off for good (no connection reaches it); its
    /// blocks stay in the index.
    pub kills: Vec<(f64, usize)>,
    /// How long Kubernetes takes to mark a pod that stopped answering not Ready (its readiness
    /// probe's period times its failure threshold), ms.
    pub readiness_delay_ms: f64,
    /// How long a metrics read of a pod that does not answer takes to time out, ms.
    pub probe_timeout_ms: f64,
    /// Reads in a row without a connection that take a pod out of the picker's candidates.
    pub failures_to_leave: u32,
}

/// The pool and both forms of the picker's rule over it.
pub struct SimPool {
    names: Vec<String>,
    joined_at: Vec<f64>,
    dead_since: Vec<f64>,
    /// The last restart of each pod: (since, up again at).
    restart: Vec<(f64, f64)>,
    readiness_delay_ms: f64,
    probe_timeout_ms: f64,
    /// A read of a pod that does not answer: when it times out.
    pending: Vec<Option<f64>>,
    published: Vec<bool>,
    with_pool: Membership,
    without_pool: Membership,
}

impl SimPool {
    /// The pool of pods `names` changing as `changes` says.
    pub fn new(names: &[String], changes: &PoolChanges) -> Self {
        let n = names.len();
        let mut joined_at = vec![0.0; n];
        for &(t, p) in &changes.joins {
            if p < n {
                joined_at[p] = t;
            }
        }
        let mut dead_since = vec![f64::INFINITY; n];
        for &(t, p) in &changes.kills {
            if p < n {
                dead_since[p] = dead_since[p].min(t);
            }
        }
        Self {
            names: names.to_vec(),
            published: joined_at.iter().map(|&t| t <= 0.0).collect(),
            joined_at,
            dead_since,
            restart: vec![(f64::INFINITY, f64::NEG_INFINITY); n],
            readiness_delay_ms: changes.readiness_delay_ms,
            probe_timeout_ms: changes.probe_timeout_ms,
            pending: vec![None; n],
            with_pool: Membership::new(HealthSettings::leaving_after(changes.failures_to_leave)),
            without_pool: Membership::new(HealthSettings::leaving_after(changes.failures_to_leave)),
        }
    }

    fn joined(&self, p: usize, now: f64) -> bool {
        now >= self.joined_at[p]
    }

    /// Whether Kubernetes says pod `p` is Ready at `now`: it joined, it has not stopped
    /// answering for longer than the readiness probe's delay, and it is not restarting (its
    /// container's exit noticed, [`CRASH_NOTICED_MS`]).
    pub fn ready(&self, p: usize, now: f64) -> bool {
        let (since, until) = self.restart[p];
        let restarting = now >= since + CRASH_NOTICED_MS && now < until;
        self.joined(p, now) && now < self.dead_since[p] + self.readiness_delay_ms && !restarting
    }

    /// Pod `p` restarts at `now` and serves again at `until`.
    pub fn restarting(&mut self, p: usize, now: f64, until: f64) {
        self.restart[p] = (now, until);
    }

    /// Whether pod `p` has stopped answering for good.
    pub fn dead(&self, p: usize, now: f64) -> bool {
        now >= self.dead_since[p]
    }

    /// Pod `p`'s events reached the index.
    pub fn published(&mut self, p: usize) {
        self.published[p] = true;
    }

    /// A scrape at `now`: the pool as Kubernetes lists it, and a metrics read of each of its
    /// Ready pods (`refusing`: a pod that is down but not dead, restarting).
    pub fn scrape(&mut self, now: f64, refusing: impl Fn(usize) -> bool) {
        let members: Vec<(String, bool)> = (0..self.names.len())
            .filter(|&p| self.joined(p, now))
            .map(|p| (self.names[p].clone(), self.ready(p, now)))
            .collect();
        self.with_pool.set_pool(members);
        for p in 0..self.names.len() {
            if !self.ready(p, now) {
                continue;
            }
            let probe = if self.dead(p, now) {
                match self.pending[p] {
                    Some(at) if now >= at => {
                        self.pending[p] = None;
                        Probe::NoConnection
                    }
                    Some(_) => continue,
                    None => {
                        self.pending[p] = Some(now + self.probe_timeout_ms);
                        continue;
                    }
                }
            } else if refusing(p) {
                Probe::NoConnection
            } else {
                Probe::Answered
            };
            self.with_pool.probed(&self.names[p], probe);
            if self.published[p] {
                self.without_pool.probed(&self.names[p], probe);
            }
        }
    }

    /// The pods `rule` lets a router pick at `now`, in order.
    pub fn candidates(&self, rule: CandidateRule, now: f64) -> Vec<usize> {
        (0..self.names.len())
            .filter(|&p| match rule {
                CandidateRule::Ready => self.ready(p, now),
                CandidateRule::Pool => self.joined(p, now) && self.with_pool.admits(&self.names[p]),
                CandidateRule::Publishers => {
                    self.published[p] && self.without_pool.admits(&self.names[p])
                }
            })
            .collect()
    }

    /// Whether pod `p` joined after the start.
    pub fn joined_late(&self, p: usize) -> bool {
        self.joined_at[p] > 0.0
    }

    /// When the first late pod joins (`None`: none does).
    pub fn first_join(&self) -> Option<f64> {
        self.joined_at
            .iter()
            .copied()
            .filter(|&t| t > 0.0)
            .min_by(f64::total_cmp)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn pool(changes: PoolChanges) -> SimPool {
        let names: Vec<String> = (0..3).map(|p| format!("10.9.0.{p}:8000")).collect();
        SimPool::new(&names, &changes)
    }

    #[test]
    fn a_late_pod_is_a_pool_candidate_when_it_joins_and_a_publisher_only_once_it_published() {
        let mut s = pool(PoolChanges {
            joins: vec![(1_000.0, 2)],
            failures_to_leave: 3,
            ..Default::default()
        });
        s.scrape(0.0, |_| false);
        assert_eq!(s.candidates(CandidateRule::Pool, 0.0), [0, 1]);
        assert_eq!(s.candidates(CandidateRule::Ready, 0.0), [0, 1]);
        s.scrape(1_000.0, |_| false);
        assert_eq!(s.candidates(CandidateRule::Pool, 1_000.0), [0, 1, 2]);
        assert_eq!(s.candidates(CandidateRule::Ready, 1_000.0), [0, 1, 2]);
        assert_eq!(s.candidates(CandidateRule::Publishers, 1_000.0), [0, 1]);
        s.published(2);
        assert_eq!(s.candidates(CandidateRule::Publishers, 1_000.0), [0, 1, 2]);
    }

    #[test]
    fn a_restarting_pod_is_not_ready_once_its_exit_is_noticed_until_it_serves() {
        let mut s = pool(PoolChanges::default());
        s.restarting(1, 5_000.0, 20_000.0);
        assert!(s.ready(1, 5_500.0), "not noticed yet");
        assert!(!s.ready(1, 6_000.0));
        assert!(!s.ready(1, 19_999.0));
        assert!(s.ready(1, 20_000.0), "serving again");
    }

    #[test]
    fn a_cut_off_pod_leaves_the_picker_in_three_connect_timeouts_and_kubernetes_after_its_probe() {
        let mut s = pool(PoolChanges {
            kills: vec![(100.0, 0)],
            readiness_delay_ms: 30_000.0,
            probe_timeout_ms: 250.0,
            failures_to_leave: 3,
            ..Default::default()
        });
        let mut left = None;
        let mut t = 0.0;
        while t < 40_000.0 {
            s.scrape(t, |_| false);
            if left.is_none() && !s.candidates(CandidateRule::Pool, t).contains(&0) {
                left = Some(t);
            }
            t += 50.0;
        }
        // Reads start at 100, 400, 700 (each times out 250 ms later, read again at the next
        // scrape): out at 950 ms.
        assert_eq!(left, Some(950.0));
        assert!(s.candidates(CandidateRule::Ready, 30_050.0).contains(&0));
        assert!(!s.candidates(CandidateRule::Ready, 30_100.0).contains(&0));
        assert!(!s
            .candidates(CandidateRule::Publishers, 1_000.0)
            .contains(&0));
    }
}
