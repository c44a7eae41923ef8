//! The speculative entries' unit tests: hand-worked record, confirm, expire and bound cases.

use super::*;

fn chain(prefix: u64, n: u64) -> Arc<[BlockHash]> {
    // Distinct prompts differ from their first differing block on (as vLLM's chain does).
    (0..n).map(|i| BlockHash::new(prefix * 1_000 + i)).collect()
}

fn branch(shared: &[BlockHash], tail: u64, n: u64) -> Arc<[BlockHash]> {
    let mut v = shared.to_vec();
    v.extend((0..n).map(|i| BlockHash::new(tail * 1_000_000 + i)));
    v.into()
}

fn held(s: &Speculation, pod: &str, hashes: &[BlockHash]) -> usize {
    let e = s.index.directory().engine(pod, 0);
    hashes
        .iter()
        .filter(|h| e.is_some_and(|e| s.index.lookup(**h).iter().any(|(x, _)| *x == e)))
        .count()
}

fn settings() -> SpeculationSettings {
    SpeculationSettings {
        ttl: Duration::from_millis(100),
        ..Default::default()
    }
}

#[test]
fn common_prefix_finds_the_shared_blocks() {
    let a = chain(1, 10);
    assert_eq!(common_prefix(&a, &a), 10);
    assert_eq!(common_prefix(&a, &a[..4]), 4);
    assert_eq!(common_prefix(&a, &chain(2, 10)), 0);
    assert_eq!(common_prefix(&a[..3], &branch(&a[..3], 7, 5)), 3);
    assert_eq!(
        common_prefix(&branch(&a[..6], 8, 2), &branch(&a[..6], 9, 4)),
        6
    );
    assert_eq!(common_prefix(&a, &[]), 0);
}

#[test]
fn removing_a_record_keeps_what_another_covers() {
    let s = Speculation::new(settings()).expect("settings");
    let t = Instant::now();
    let system = chain(1, 8);
    let (a, b) = (branch(&system, 2, 4), branch(&system, 3, 4));
    assert_eq!(
        s.record("p", 0, a.clone(), 0, false, t),
        RoutingRecorded::Speculated(12)
    );
    assert_eq!(
        s.record("p", 0, b.clone(), 8, false, t),
        RoutingRecorded::Speculated(4)
    );
    assert_eq!(s.stats().entries, 16);
    // Confirming `a` (its last block stored) drops its 4 own blocks, not the system prompt.
    s.confirm("p", &[&a[8..]], t + Duration::from_millis(10));
    assert_eq!(held(&s, "p", &b), 12);
    assert_eq!(held(&s, "p", &a[8..]), 0);
    assert_eq!(s.ends()[end_slot(RecordEnd::Confirmed)], 1);
    // `b` expires: nothing is left, the pod's engine neither.
    assert_eq!(s.expire(t + Duration::from_secs(1), |_| false), 1);
    assert!(s.is_empty());
    assert!(s.index.directory().engine("p", 0).is_none());
    let stats = s.stats();
    assert_eq!((stats.records, stats.entries, stats.pods), (0, 0, 0));
}

#[test]
fn a_longer_prompt_supersedes_its_prefix_and_the_same_prompt_refreshes() {
    let s = Speculation::new(settings()).expect("settings");
    let t = Instant::now();
    let turn1 = chain(1, 5);
    let turn2 = chain(1, 9);
    s.record("p", 0, turn1.clone(), 0, false, t);
    s.record(
        "p",
        0,
        turn2.clone(),
        0,
        false,
        t + Duration::from_millis(60),
    );
    assert_eq!(s.stats().records, 1, "turn 1 is covered by turn 2");
    // At turn 1's deadline nothing expires: turn 2 lives on.
    assert_eq!(s.expire(t + Duration::from_millis(120), |_| false), 0);
    assert_eq!(held(&s, "p", &turn2), 9);
    assert_eq!(s.expire(t + Duration::from_millis(170), |_| false), 1);
    assert_eq!(held(&s, "p", &turn2), 0);
}

#[test]
fn fallback_pods_keep_records_under_the_pod_bound_oldest_first() {
    let s = Speculation::new(SpeculationSettings {
        pod_blocks: 10,
        ..settings()
    })
    .expect("settings");
    let t = Instant::now();
    let (a, b, c) = (chain(1, 4), chain(2, 4), chain(3, 4));
    s.record("p", 0, a.clone(), 0, true, t);
    s.record("p", 0, b.clone(), 0, true, t);
    assert_eq!(
        s.expire(t + Duration::from_secs(60), |_| true),
        0,
        "no deadline"
    );
    s.record("p", 0, c.clone(), 0, true, t);
    assert_eq!(held(&s, "p", &a), 0, "the oldest went for the bound");
    assert_eq!((held(&s, "p", &b), held(&s, "p", &c)), (4, 4));
    assert_eq!(s.pod("p").map(|p| (p.fallback, p.ttl)), Some((true, None)));
    // The pod starts publishing: its records get a deadline from now.
    let later = t + Duration::from_secs(61);
    assert_eq!(s.expire(later, |_| false), 0);
    assert_eq!(s.expire(later + Duration::from_millis(100), |_| false), 2);
    // A prompt longer than the bound is not recorded at all.
    assert_eq!(
        s.record("p", 0, chain(4, 11), 0, true, t),
        RoutingRecorded::TooLong
    );
}

#[test]
fn the_model_bound_drops_the_oldest_record_of_any_pod() {
    let s = Speculation::new(SpeculationSettings {
        max_blocks: 8,
        ..settings()
    })
    .expect("settings");
    let t = Instant::now();
    s.record("p", 0, chain(1, 4), 0, false, t);
    s.record("q", 0, chain(2, 4), 0, false, t);
    s.record("r", 0, chain(3, 4), 0, false, t);
    assert_eq!(s.stats().held_blocks, 8);
    assert!(s.pod("p").is_none());
    assert_eq!(s.ends()[end_slot(RecordEnd::Evicted)], 1);
}

#[test]
fn a_lagging_pod_gets_longer_deadlines_and_a_prompt_one_the_base() {
    let s = Speculation::new(settings()).expect("settings");
    let t = Instant::now();
    let ms = Duration::from_millis;
    // Confirmed 400 ms after the routing: the next record lives 2 x 400 ms.
    s.record("p", 0, chain(1, 2), 0, false, t);
    s.confirm("p", &[&chain(1, 2)[..]], t + ms(400));
    assert_eq!(
        s.pod("p").map(|p| p.records),
        Some(0),
        "confirmed, nothing left"
    );
    s.record("p", 0, chain(2, 2), 0, false, t + ms(400));
    assert_eq!(s.pod("p").and_then(|p| p.ttl), Some(ms(800)));
    // A lag past the cap is capped.
    s.confirm(
        "p",
        &[&chain(2, 2)[..]],
        t + ms(400) + Duration::from_secs(10),
    );
    s.record("p", 0, chain(3, 2), 0, false, t);
    assert_eq!(
        s.pod("p").and_then(|p| p.ttl),
        Some(ms(100) * MAX_TTL_FACTOR)
    );
    // Already held for real: nothing to speculate.
    assert_eq!(
        s.record("p", 0, chain(4, 2), 2, false, t),
        RoutingRecorded::AlreadyHeld
    );
}
