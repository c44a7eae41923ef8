use super::*;

fn pool(m: &mut Membership, members: &[(&str, bool)]) -> Vec<Change> {
    m.set_pool(members.iter().map(|(e, r)| (e.to_string(), *r)))
}

fn ready(n: usize) -> Vec<(String, bool)> {
    (0..n).map(|i| (format!("10.0.0.{i}:8000"), true)).collect()
}

fn refuse(m: &mut Membership, e: &str, times: u32) -> Vec<Change> {
    (0..times)
        .flat_map(|_| m.probed(e, Probe::NoConnection))
        .collect()
}

fn leaving_after(n: u32) -> Membership {
    Membership::new(HealthSettings::leaving_after(n))
}

#[test]
fn ready_members_are_candidates_whether_or_not_they_published() {
    let mut m = leaving_after(3);
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
fn refusals_in_a_row_eject_an_endpoint_and_an_answer_brings_it_back() {
    let mut m = leaving_after(3);
    pool(&mut m, &[("a:1", true), ("b:1", true), ("c:1", true)]);
    assert!(m.probed("a:1", Probe::NoConnection).is_empty());
    assert!(
        m.probed("a:1", Probe::Answered).is_empty(),
        "an answer ends the run"
    );
    assert!(refuse(&mut m, "a:1", 2).is_empty());
    let left = m.probed("a:1", Probe::NoConnection);
    assert_eq!(
        left.iter().map(|c| (c.from, c.to)).collect::<Vec<_>>(),
        [(Standing::Candidate, Standing::Unreachable)]
    );
    assert_eq!(m.candidates(), ["b:1", "c:1"]);
    assert!(
        m.probed("a:1", Probe::NoConnection).is_empty(),
        "already out"
    );
    let back = m.probed("a:1", Probe::Answered);
    assert_eq!(
        back.iter().map(|c| (c.from, c.to)).collect::<Vec<_>>(),
        [(Standing::Unreachable, Standing::Candidate)]
    );
    assert_eq!(m.candidates(), ["a:1", "b:1", "c:1"]);
}

#[test]
fn slow_is_not_dead_timeouts_never_eject() {
    let mut m = leaving_after(1);
    m.set_pool(ready(4));
    for _ in 0..100 {
        for (e, _) in ready(4) {
            assert!(m.probed(&e, Probe::Slow).is_empty());
        }
    }
    assert_eq!(m.candidates().len(), 4);
    // A timeout neither extends nor ends a run of refusals.
    let mut m = leaving_after(2);
    m.set_pool(ready(4));
    refuse(&mut m, "10.0.0.0:8000", 1);
    m.probed("10.0.0.0:8000", Probe::Slow);
    assert_eq!(m.failures("10.0.0.0:8000"), 1);
    assert_eq!(refuse(&mut m, "10.0.0.0:8000", 1).len(), 1);
}

#[test]
fn ejection_is_bounded_and_the_first_to_cross_goes_first() {
    // Every endpoint of ten refusing: half are ejected, in the order they crossed.
    let mut m = leaving_after(1);
    m.set_pool(ready(10));
    for (e, _) in ready(10).iter().rev() {
        refuse(&mut m, e, 3);
    }
    assert_eq!(m.unreachable().len(), 5);
    assert!(m
        .unreachable()
        .iter()
        .all(|e| e >= &"10.0.0.5:8000".to_owned()));
    assert_eq!(m.candidates().len(), 5);
    assert!(!m.panicking(), "half left is not below half");
    // One of the ejected answers: it is back, and the next to have crossed takes its place.
    let changes = m.probed("10.0.0.9:8000", Probe::Answered);
    let mut moved: Vec<(&str, Standing)> = changes
        .iter()
        .map(|c| (c.endpoint.as_str(), c.to))
        .collect();
    moved.sort();
    assert_eq!(
        moved,
        [
            ("10.0.0.4:8000", Standing::Unreachable),
            ("10.0.0.9:8000", Standing::Candidate)
        ]
    );
    assert_eq!(m.unreachable().len(), 5);
}

#[test]
fn at_least_one_is_ejected_whatever_the_percentage() {
    // One dead pod of three leaves (50% of 3 rounds down to 1).
    let mut m = leaving_after(3);
    m.set_pool(ready(3));
    assert_eq!(refuse(&mut m, "10.0.0.1:8000", 3).len(), 1);
    assert_eq!(m.candidates().len(), 2);
    assert_eq!(
        refuse(&mut m, "10.0.0.2:8000", 3).len(),
        0,
        "the bound: one of three"
    );
    assert_eq!(m.candidates().len(), 2);
    // With 0% one is still ejected, as Envoy ejects one host.
    let mut m = Membership::new(HealthSettings {
        max_ejection_percent: 0,
        ..HealthSettings::leaving_after(1)
    });
    m.set_pool(ready(10));
    refuse(&mut m, "10.0.0.3:8000", 1);
    refuse(&mut m, "10.0.0.4:8000", 1);
    assert_eq!(m.unreachable(), ["10.0.0.3:8000"]);
}

#[test]
fn below_the_panic_threshold_every_ready_endpoint_is_a_candidate() {
    // A pool of one whose metrics port refuses: ejected, and the pool panics.
    let mut m = leaving_after(2);
    pool(&mut m, &[("a:1", true), ("b:1", false)]);
    refuse(&mut m, "a:1", 2);
    assert_eq!(m.standing("a:1"), Standing::Unreachable);
    assert!(m.panicking());
    assert!(m.admits("a:1"));
    assert!(!m.admits("b:1"), "a pod that is not Ready never serves");
    assert_eq!(m.candidates(), ["a:1"]);
    m.probed("a:1", Probe::Answered);
    assert!(!m.panicking());
    // Ejection allowed up to every endpoint: below the threshold, all are candidates again.
    let mut m = Membership::new(HealthSettings {
        max_ejection_percent: 100,
        ..HealthSettings::leaving_after(1)
    });
    m.set_pool(ready(4));
    refuse(&mut m, "10.0.0.0:8000", 1);
    refuse(&mut m, "10.0.0.1:8000", 1);
    assert!(!m.panicking());
    assert_eq!(m.candidates().len(), 2);
    refuse(&mut m, "10.0.0.2:8000", 1);
    assert!(m.panicking(), "one of four left is below half");
    assert_eq!(m.candidates().len(), 4);
    assert_eq!(m.unreachable().len(), 3, "still ejected, as listed");
}

#[test]
fn a_streak_ends_with_the_stay_in_the_pool() {
    let mut m = leaving_after(2);
    pool(&mut m, &[("a:1", true), ("b:1", true)]);
    refuse(&mut m, "a:1", 2);
    assert_eq!(m.standing("a:1"), Standing::Unreachable);
    pool(&mut m, &[("a:1", false), ("b:1", true)]);
    assert_eq!(m.standing("a:1"), Standing::NotReady);
    assert!(
        m.probed("a:1", Probe::NoConnection).is_empty(),
        "not counted"
    );
    let changes = pool(&mut m, &[("a:1", true), ("b:1", true)]);
    assert_eq!(m.standing("a:1"), Standing::Candidate, "{changes:?}");
    assert_eq!(m.failures("a:1"), 0);
    // Removed from the pool: not in it, and a probe is not counted.
    let changes = pool(&mut m, &[("b:1", true)]);
    assert_eq!(changes[0].to, Standing::NotInPool);
    assert!(m.probed("a:1", Probe::NoConnection).is_empty());
    assert_eq!(m.failures("a:1"), 0);
}

#[test]
fn without_a_pool_the_bound_is_a_share_of_the_endpoints_probed() {
    let mut m = leaving_after(1);
    let left = m.probed("p:1", Probe::NoConnection);
    assert_eq!(
        left.iter().map(|c| c.to).collect::<Vec<_>>(),
        [Standing::Unreachable]
    );
    assert!(!m.admits("p:1") || m.panicking());
    assert!(m.panicking(), "the only endpoint probed is out");
    m.probed("q:1", Probe::Answered);
    m.probed("r:1", Probe::Answered);
    assert!(!m.panicking());
    assert!(!m.admits("p:1"));
    refuse(&mut m, "q:1", 1);
    assert!(m.admits("q:1"), "one of three is the bound");
    assert_eq!(m.unreachable(), ["p:1"]);
    assert!(m.candidates().is_empty(), "the caller lists the publishers");
    m.forget(|e| e != "p:1");
    assert!(m.admits("p:1"), "forgotten: no streak");
    assert_eq!(m.unreachable(), ["q:1"], "q:1 crossed next");
    pool(&mut m, &[("p:1", true)]);
    let changes = m.clear_pool();
    assert!(changes.is_empty(), "{changes:?}");
    assert!(!m.has_pool());
}

#[test]
fn zero_failures_to_leave_is_one() {
    let mut m = leaving_after(0);
    assert_eq!(m.failures_to_leave(), 1);
    assert!(!m.probed("x:1", Probe::NoConnection).is_empty());
}
