//! The inbox's policy, without sockets: turns, byte bounds, what is dropped and what never is.

use std::sync::Arc;

use bytes::Bytes;

use super::{Budget, Inbox, JOB_OVERHEAD};
use crate::ingest::jobs::{ClearOrigin, GapFillRoute, Job, Message, Via};

fn job(pod: &str, seq: u64, bytes: usize, via: Via) -> Job {
    Job::Message(Message {
        pod: pod.into(),
        model: "m".into(),
        seq,
        payload: Bytes::from(vec![0u8; bytes]),
        via,
    })
}

/// A message from this replica's socket (the only kind ever dropped).
fn message(pod: &str, seq: u64, bytes: usize) -> Job {
    job(pod, seq, bytes, Via::Socket(GapFillRoute::None, None))
}

/// A message from the shared log.
fn from_log(pod: &str, seq: u64, bytes: usize) -> Job {
    job(pod, seq, bytes, Via::Log("other".into()))
}

/// What the worker would take, as (pod, what): `seq` of a message, `D a..=b` of a marker.
fn drain(inbox: &Inbox) -> Vec<String> {
    let mut out = Vec::new();
    while let Some(job) = inbox.take() {
        out.push(match job {
            Job::Message(m) => format!("{}:{}", m.pod, m.seq),
            Job::Dropped(d) => format!("{}:D{}-{}x{}", d.pod, d.seqs.0, d.seqs.1, d.messages),
            Job::ClearPod { pod, .. } => format!("{pod}:clear"),
            _ => "other".into(),
        });
    }
    out
}

#[test]
fn pods_are_served_in_turn() {
    let budget = Budget::new(1 << 30, 1 << 20);
    let inbox = Inbox::new(budget.clone());
    let (a, b): (Arc<str>, Arc<str>) = ("a".into(), "b".into());
    for seq in 0..3 {
        inbox.push(&a, message("a", seq, 10));
    }
    inbox.push(&b, message("b", 0, 10));
    assert_eq!(drain(&inbox), ["a:0", "b:0", "a:1", "a:2"]);
    assert_eq!(budget.used(), 0, "every byte taken is given back");
}

#[test]
fn a_pod_past_its_share_loses_its_own_queued_messages_but_never_its_newest() {
    let budget = Budget::new(1 << 30, 4 * (JOB_OVERHEAD + 1000));
    let inbox = Inbox::new(budget.clone());
    let (a, b): (Arc<str>, Arc<str>) = ("a".into(), "b".into());
    inbox.push(&b, message("b", 0, 1000));
    let mut dropped = 0;
    for seq in 0..10 {
        dropped += inbox.push(&a, message("a", seq, 1000)).over_share;
    }
    assert!(dropped > 0);
    let taken = drain(&inbox);
    // b untouched; a keeps its oldest (next to apply), one marker for the run dropped, and
    // its newest, in order.
    assert_eq!(taken[0], "b:0");
    assert_eq!(taken.last().map(String::as_str), Some("a:9"));
    let marker = taken
        .iter()
        .find(|t| t.contains(":D"))
        .expect("a marker for the dropped run");
    assert_eq!(marker, &format!("a:D{}-8x{dropped}", 9 - dropped));
    assert_eq!(taken.len(), 1 + (10 - dropped as usize) + 1);
    assert_eq!(budget.used(), 0);
}

#[test]
fn clears_and_shared_log_entries_are_never_dropped_nor_crossed() {
    let budget = Budget::new(1 << 30, 2 * (JOB_OVERHEAD + 1000));
    let inbox = Inbox::new(budget.clone());
    let a: Arc<str> = "a".into();
    inbox.push(&a, from_log("a", 0, 1000));
    inbox.push(
        &a,
        Job::ClearPod {
            model: "m".into(),
            pod: a.clone(),
            origin: ClearOrigin::Log,
        },
    );
    for seq in 1..8 {
        inbox.push(&a, message("a", seq, 1000));
    }
    let taken = drain(&inbox);
    assert_eq!(&taken[..2], ["a:0", "a:clear"]);
    assert_eq!(taken.last().map(String::as_str), Some("a:7"));
    assert_eq!(budget.used(), 0);
}

#[test]
fn past_the_total_the_pod_holding_the_most_pays() {
    let share = 100 * (JOB_OVERHEAD + 1000);
    let budget = Budget::new(12 * (JOB_OVERHEAD + 1000), share);
    let inbox = Inbox::new(budget.clone());
    let (big, small): (Arc<str>, Arc<str>) = ("big".into(), "small".into());
    for seq in 0..10 {
        inbox.push(&big, message("big", seq, 1000));
    }
    let mut dropped = 0;
    for seq in 0..4 {
        let pushed = inbox.push(&small, message("small", seq, 1000));
        assert_eq!(pushed.over_share, 0);
        dropped += pushed.over_total;
    }
    assert!(dropped > 0, "the total was passed");
    assert!(budget.used() <= 12 * (JOB_OVERHEAD + 1000));
    let taken = drain(&inbox);
    let small_taken: Vec<&String> = taken.iter().filter(|t| t.starts_with("small")).collect();
    assert_eq!(small_taken, ["small:0", "small:1", "small:2", "small:3"]);
    assert!(taken.iter().any(|t| t.starts_with("big:D")));
    assert_eq!(budget.used(), 0);
}

#[tokio::test]
async fn shared_log_entries_wait_for_room_and_a_closed_inbox_ends() {
    let budget = Budget::new(JOB_OVERHEAD + 100, JOB_OVERHEAD + 100);
    let inbox = Arc::new(Inbox::new(budget.clone()));
    let a: Arc<str> = "a".into();
    inbox.push(&a, from_log("a", 0, 1000));
    let feeder = {
        let (inbox, a) = (inbox.clone(), a.clone());
        tokio::spawn(async move { inbox.feed(&a, from_log("a", 1, 10)).await })
    };
    tokio::time::sleep(std::time::Duration::from_millis(50)).await;
    assert!(!feeder.is_finished(), "over the total, a log entry waits");
    assert!(matches!(inbox.next().await, Some(Job::Message(m)) if m.seq == 0));
    assert!(feeder.await.expect("feeder"), "queued once there was room");
    inbox.close();
    assert!(matches!(inbox.next().await, Some(Job::Message(m)) if m.seq == 1));
    assert!(inbox.next().await.is_none());
    assert!(inbox.push(&a, message("a", 2, 1)).closed);
}
