//! The pool's readiness, panics and publishers outside it.
use super::*;

fn health(failures_to_leave: u32) -> HealthSettings {
    HealthSettings::leaving_after(failures_to_leave)
}

fn member(address: &str, ready: bool) -> Member {
    Member {
        endpoint: PoolEndpoint::plain(address.into()),
        ready,
        unknown_role: None,
    }
}

#[test]
fn readiness_follows_membership() {
    let pool = Pool::new(SourceKind::Static, "test".into(), health(2), Metrics::new());
    assert!(pool.readiness().is_err_and(|e| e.contains("first answer")));
    pool.set_trouble(Some("the API server does not answer".into()));
    assert!(pool
        .readiness()
        .is_err_and(|e| e.contains("does not answer")));
    pool.set_members(vec![member("10.0.0.1:8000", false)]);
    assert_eq!(pool.readiness(), Ok(()), "synced: ready, if empty");
    let why = pool.why_empty().expect("no candidate");
    assert!(why.contains("1 not Ready"), "{why}");
    pool.set_members(vec![
        member("10.0.0.1:8000", true),
        member("10.0.0.2:8000", true),
    ]);
    assert_eq!(pool.why_empty(), None);
    pool.probed("10.0.0.1:8000", Probe::NoConnection);
    pool.probed("10.0.0.1:8000", Probe::NoConnection);
    assert_eq!(pool.view().candidates.len(), 1);
    assert!(pool.view().unreachable.contains("10.0.0.1:8000"));
    pool.probed("10.0.0.1:8000", Probe::Answered);
    assert_eq!(pool.view().candidates.len(), 2);
    pool.set_absent("InferencePool a/b not found".into());
    assert_eq!(pool.readiness(), Err("InferencePool a/b not found".into()));
    let publishers = Pool::new(
        SourceKind::Publishers,
        "p".into(),
        health(2),
        Metrics::new(),
    );
    assert_eq!(publishers.readiness(), Ok(()));
}

#[test]
fn a_panic_makes_every_ready_endpoint_a_candidate_and_is_counted_once() {
    let metrics = Metrics::new();
    let pool = Pool::new(SourceKind::Static, "t".into(), health(1), metrics.clone());
    pool.set_members(vec![member("10.0.0.1:8000", true)]);
    pool.probed("10.0.0.1:8000", Probe::NoConnection);
    pool.probed("10.0.0.1:8000", Probe::NoConnection);
    assert_eq!(pool.view().candidates.len(), 1, "the only one: panic");
    assert!(pool.view().unreachable.is_empty());
    assert_eq!(pool.why_empty(), None);
    let text = metrics.render(&kv_core::Indexer::new(Default::default()).expect("indexer"));
    assert!(text.contains("kvindexer_pool_panics_total 1"), "{text}");
    assert!(text.contains("kvindexer_pool_panicking 1"), "{text}");
    pool.probed("10.0.0.1:8000", Probe::Answered);
    let text = metrics.render(&kv_core::Indexer::new(Default::default()).expect("indexer"));
    assert!(text.contains("kvindexer_pool_panicking 0"), "{text}");
}

#[test]
fn publishers_outside_the_pool_are_counted_once() {
    let metrics = Metrics::new();
    let pool = Pool::new(
        SourceKind::Static,
        "test".into(),
        health(3),
        metrics.clone(),
    );
    pool.set_members(vec![member("10.0.0.1:8000", true)]);
    let publishers = vec!["10.0.0.1:8000".to_owned(), "10.0.0.9:8000".to_owned()];
    pool.note_publishers(&publishers);
    pool.note_publishers(&publishers);
    let text = metrics.render(&kv_core::Indexer::new(Default::default()).expect("indexer"));
    assert!(
        text.contains("kvindexer_pool_publishers_outside_total 1"),
        "{text}"
    );
    assert!(
        text.contains("kvindexer_pool_publishers_outside 1"),
        "{text}"
    );
}
