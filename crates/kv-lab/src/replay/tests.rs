//! The replay's unit tests: hand-worked traces for every policy, and the trace loader.

use super::*;

fn req(blocks: &[u64], block_size: u64) -> ReplayRequest {
    ReplayRequest {
        blocks: blocks.to_vec(),
        input_length: blocks.len() as u64 * block_size,
    }
}

#[test]
fn python_rounding() {
    assert_eq!(round_half_even(2.5), 2);
    assert_eq!(round_half_even(1.5), 2);
    assert_eq!(round_half_even(0.5), 0);
    assert_eq!(round_half_even(2.6), 3);
    assert_eq!(
        S3Fifo::new(S3FifoVariant::Paper, 25, 0.1, 3).small_capacity(),
        2
    );
    assert_eq!(
        S3Fifo::new(S3FifoVariant::Paper, 15, 0.1, 3).small_capacity(),
        2
    );
    assert_eq!(
        S3Fifo::new(S3FifoVariant::Paper, 100, 0.1, 3).small_capacity(),
        10
    );
}

#[test]
fn prefix_hits_stop_at_the_first_miss_and_cap_at_the_prompt() {
    let mut p = Lru::new(10);
    let trace = vec![
        req(&[1, 2, 3], 4),
        ReplayRequest {
            blocks: vec![1, 9, 3],
            input_length: 10,
        },
        ReplayRequest {
            blocks: vec![1, 2, 3],
            input_length: 10,
        },
    ];
    let r = replay("lru", &mut p, 10, 4, &trace, true);
    let per = r.per_request.expect("kept");
    assert_eq!(per[0].hit_tokens, 0);
    assert_eq!(
        per[1].hit_tokens, 4,
        "block 3 is resident but block 9 missed first"
    );
    assert_eq!(
        per[2].hit_tokens, 10,
        "3 blocks = 12 tokens, capped at the 10-token prompt"
    );
}

#[test]
fn lru_fifo_and_lfu_differ_where_they_should() {
    // Capacity 2: access 1, 2, 1, 3 -> LRU evicts 2, FIFO evicts 1, LFU evicts 2 (freq 1, older).
    for (name, keep) in [("lru", 1), ("fifo", 2), ("lfu", 1)] {
        let mut p = policy(name, 2, 0.1, 3).expect("known");
        for b in [1, 2, 1, 3] {
            p.access(b);
        }
        assert!(p.contains(keep) && p.contains(3) && p.len() == 2, "{name}");
    }
}

#[test]
fn the_papers_s3fifo_filters_one_hit_wonders_and_readmits_ghosts_to_main() {
    // Capacity 10: small 1, main 9, ghost up to 9.
    let mut p = S3Fifo::new(S3FifoVariant::Paper, 10, 0.1, 3);
    // A hot block accessed repeatedly, then a scan of one-hit wonders.
    for _ in 0..3 {
        p.access(100);
    }
    for b in 0..50 {
        p.access(b);
    }
    assert!(
        p.contains(100),
        "a hot block survives a scan (promoted to main)"
    );
    assert!(p.len() <= 10);
    // S may exceed its share while M has room: the scan's last 9 blocks (41..49) are still
    // resident in S; the ones before went S -> G (one hit), the ghost keeping the last 9.
    assert!((41..50).all(|b| p.resident.get(&b) == Some(&(Queue::Small, 0))));
    assert!((32..41).all(|b| !p.contains(b) && p.ghost_live.contains_key(&b)));
    assert!(
        !p.ghost_live.contains_key(&31),
        "the ghost is as large as main"
    );
    // A ghost hit is a miss that enters M with frequency 0.
    p.access(40);
    assert_eq!(p.resident.get(&40), Some(&(Queue::Main, 0)));
    assert!(!p.ghost_live.contains_key(&40));
    // Frequencies saturate at max_freq.
    for _ in 0..10 {
        p.access(40);
    }
    assert_eq!(p.resident.get(&40).map(|e| e.1), Some(3));
}

/// The published `s3fifo` with capacity `capacity`, ratio `ratio`, after `trace`.
fn published(capacity: usize, ratio: f64, trace: &[u64]) -> S3Fifo {
    let mut p = S3Fifo::new(S3FifoVariant::Published, capacity, ratio, 3);
    for &b in trace {
        p.access(b);
    }
    p
}

fn queue(q: &VecDeque<BlockId>) -> Vec<BlockId> {
    q.iter().copied().collect()
}

fn ghost(p: &S3Fifo) -> Vec<BlockId> {
    p.ghost
        .iter()
        .filter(|(id, g)| p.ghost_live.get(id) == Some(g))
        .map(|(id, _)| *id)
        .collect()
}

// Hand-worked traces. Capacity 10, ratio 0.1: S holds 1, M 9, G 9.

#[test]
fn published_s3fifo_keeps_s_to_its_share_so_the_cache_stays_below_capacity() {
    // 1: S=[1]. 2: S is at its share, 1 (freq 0) goes to G; S=[2]. 3: 2 to G; S=[3].
    let p = published(10, 0.1, &[1, 2, 3]);
    assert_eq!(queue(&p.small), [3]);
    assert!(p.main.is_empty());
    assert_eq!(ghost(&p), [1, 2]);
    assert_eq!(p.len(), 1, "one of ten slots used: M had room, S did not");
    // The paper's variant evicts nothing until the cache is full.
    let mut paper = S3Fifo::new(S3FifoVariant::Paper, 10, 0.1, 3);
    for b in [1, 2, 3] {
        paper.access(b);
    }
    assert_eq!(paper.len(), 3);
}

#[test]
fn published_s3fifo_promotes_from_s_after_one_hit_and_readmits_ghosts_to_m() {
    // 1, 1: S=[1] freq 1. 2: 1 has freq >= 1, so it moves to M keeping freq 1; S=[2].
    // 3: 2 (freq 0) to G; S=[3]. (The paper's variant needs freq > 1 to promote.)
    let p = published(10, 0.1, &[1, 1, 2, 3]);
    assert_eq!(queue(&p.small), [3]);
    assert_eq!(queue(&p.main), [1]);
    assert_eq!(p.resident.get(&1), Some(&(Queue::Main, 1)));
    assert_eq!(ghost(&p), [2]);
    // 2 again: a ghost hit, a miss that enters M with freq 0 and leaves G; S unchanged.
    let p = published(10, 0.1, &[1, 1, 2, 3, 2]);
    assert_eq!(queue(&p.main), [1, 2]);
    assert_eq!(p.resident.get(&2), Some(&(Queue::Main, 0)));
    assert_eq!(queue(&p.small), [3]);
    assert!(ghost(&p).is_empty());
}

#[test]
fn published_s3fifo_admits_to_a_full_m_after_one_second_chance_eviction_to_the_ghost() {
    // Capacity 4, ratio 0.25: S holds 1, M 3, G 3. Each of a, b, c, d is hit once in S
    // and promoted (freq 1) when the next one arrives:
    //   a a b b c c d d -> M=[a1, b1, c1], S=[d1].
    // e: d is promoted, but M is at its share: second chance requeues a, b, c with freq 0
    // and evicts a (to G); d enters M with freq 1; e enters S.
    let (a, b, c, d, e) = (1, 2, 3, 4, 5);
    let p = published(4, 0.25, &[a, a, b, b, c, c, d, d, e]);
    assert_eq!(queue(&p.main), [b, c, d]);
    assert_eq!(p.resident.get(&b), Some(&(Queue::Main, 0)));
    assert_eq!(p.resident.get(&d), Some(&(Queue::Main, 1)));
    assert_eq!(queue(&p.small), [e]);
    assert_eq!(ghost(&p), [a], "M's victim goes to the ghost");
    assert_eq!(p.len(), 4);
    // a again: a ghost hit enters M; exactly one victim (b, freq 0) leaves M, to G.
    let p = published(4, 0.25, &[a, a, b, b, c, c, d, d, e, a]);
    assert_eq!(queue(&p.main), [c, d, a]);
    assert_eq!(ghost(&p), [b]);
    assert_eq!(queue(&p.small), [e]);
    // The ghost holds as many ids as M's share (3): f, g, h, i pass through S with no
    // hit; the oldest ghost ids leave first.
    let p = published(4, 0.25, &[a, a, b, b, c, c, d, d, e, 6, 7, 8, 9]);
    assert_eq!(ghost(&p), [6, 7, 8]);
    assert_eq!(queue(&p.small), [9]);
}

#[test]
fn published_s3fifo_needs_both_queues() {
    assert!(matches!(
        policy("s3fifo", 5, 0.0, 3),
        Err(PolicyError::S3FifoShares { small: 0, .. })
    ));
    assert!(matches!(
        policy("s3fifo", 5, 1.0, 3),
        Err(PolicyError::S3FifoShares { main: 0, .. })
    ));
    assert!(policy("s3fifo-paper", 5, 0.0, 3).is_ok());
    assert!(matches!(
        policy("s3-fifo", 5, 0.1, 3),
        Err(PolicyError::Unknown(_))
    ));
}

#[test]
fn capacity_is_never_exceeded() {
    let mut x = 12345u64;
    for name in ["lru", "lfu", "fifo", "s3fifo", "s3fifo-paper"] {
        let mut p = policy(name, 37, 0.1, 3).expect("known");
        for _ in 0..5000 {
            x = x.wrapping_mul(6364136223846793005).wrapping_add(1);
            p.access((x >> 33) % 100);
            assert!(p.len() <= 37, "{name}");
        }
    }
}
