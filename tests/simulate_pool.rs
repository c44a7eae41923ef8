//! The simulator's pool changing (`SimSettings::pool`): pods joining (a scale-out) and a pod
//! whose server stops answering, with kv-indexer's precise router keeping its candidates by
//! kv-core's membership rule (the daemon's), against the approximate router (the pool's Ready
//! pods, as Kubernetes says) and precise scoring among the publishers (the picker without a
//! pool, the negative control of a scale-out).

mod support;

use kv_lab::simulate::routers::{self, CapacityGuess, Router, Weights};
use kv_lab::simulate::{run, PolicyReport, SimRequest, SimSettings};

/// The small shared-prefix workload (24 system prompts x 5 questions), at `rate` requests per
/// second.
fn requests_at(rate: f64) -> Vec<SimRequest> {
    let mut spec = support::small_shared_prefix_spec();
    spec.rate_per_s = rate;
    spec.generate(16, 11)
}

fn requests() -> Vec<SimRequest> {
    requests_at(4.0)
}

fn span(requests: &[SimRequest]) -> f64 {
    requests.last().map_or(0.0, |r| r.arrival_ms)
}

fn precise() -> Box<dyn Router> {
    Box::new(routers::Precise::new(Weights::LLM_D_PRECISE, true, 1))
}

fn publishers() -> Box<dyn Router> {
    Box::new(routers::Precise::new(Weights::LLM_D_PRECISE, true, 1).publishers_only())
}

fn approx() -> Box<dyn Router> {
    Box::new(routers::ApproxPrefix::new(
        CapacityGuess::Fixed(routers::APPROX_CAPACITY_GUESS),
        Weights::EQUAL,
        1,
    ))
}

fn run_one(
    settings: &SimSettings,
    requests: &[SimRequest],
    router: Box<dyn Router>,
) -> PolicyReport {
    run(settings, requests, &mut [router])
}

#[test]
fn a_scale_out_is_filled_by_the_pool_and_starved_by_the_publishers() {
    // More than four pods serve without queueing: a fifth, idle, is the least loaded.
    let requests = requests_at(40.0);
    // Four pods from the start, a fifth joining a third of the way in.
    let mut s = SimSettings {
        pod_capacity_blocks: vec![20_000; 5],
        ..Default::default()
    };
    s.pool.joins = vec![(span(&requests) / 3.0, 4)];
    let pool = run_one(&s, &requests, precise());
    let by_approx = run_one(&s, &requests, approx());
    let by_publishers = run_one(&s, &requests, publishers());
    let share = |r: &PolicyReport| r.late_share.expect("a pod joined");
    // A fifth of the pods: the pool rule gives the new pod its share of the fresh prompts.
    assert!(share(&pool) > 0.1, "{pool:?}");
    assert!(share(&by_approx) > 0.1, "{by_approx:?}");
    // Negative control: the new pod never publishes without traffic, so never gets any.
    assert_eq!(share(&by_publishers), 0.0, "{by_publishers:?}");
    for r in [&pool, &by_approx, &by_publishers] {
        assert_eq!(r.refused, 0, "{r:?}");
        assert_eq!(r.requests, requests.len(), "{r:?}");
    }
}

#[test]
fn a_pod_that_stops_answering_is_left_by_the_picker_in_a_second_and_by_kubernetes_later() {
    let requests = requests();
    let kill_at = span(&requests) / 3.0;
    let mut s = SimSettings {
        pod_capacity_blocks: vec![20_000; 4],
        ..Default::default()
    };
    s.pool.kills = vec![(kill_at, 0)];
    s.pool.readiness_delay_ms = 10_000.0;
    let pool = run_one(&s, &requests, precise());
    let by_approx = run_one(&s, &requests, approx());
    // Arrivals in the second after the kill bound what the picker can send to the dead pod.
    let in_a_second = requests
        .iter()
        .filter(|r| (kill_at..kill_at + 1_000.0).contains(&r.arrival_ms))
        .count();
    assert!(
        pool.misrouted <= in_a_second,
        "{} > {in_a_second}",
        pool.misrouted
    );
    assert!(
        by_approx.misrouted > pool.misrouted,
        "approx {} vs precise {}",
        by_approx.misrouted,
        pool.misrouted
    );
    // Negative control: a rule that never lets the pod leave sends it as much as approx does
    // (or more: the index still names it as the prefix holder).
    s.pool.failures_to_leave = 100;
    s.pool.readiness_delay_ms = 10_000.0;
    let stuck = run_one(&s, &requests, precise());
    assert!(stuck.misrouted > in_a_second, "{stuck:?}");
}
