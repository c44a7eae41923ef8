use super::*;
use kv_core::mix64;

fn unit_hash(salt: u64, k: u64) -> BlockHash {
    BlockHash::new(mix64(salt ^ mix64(k)) | 1)
}

/// A request whose first `shared` units are those of `salt`'s prompt and the rest its own.
fn request(prompt: u64, output: u64, salt: u64, shared: u64, own: u64) -> SimRequest {
    let units = prompt / 16;
    let blocks = (0..units)
        .map(|k| unit_hash(if k < shared { salt } else { own }, k))
        .collect();
    let output_blocks = (units..(prompt + output).div_ceil(16))
        .map(|k| unit_hash(own ^ 0xabc, k))
        .collect();
    SimRequest {
        arrival_ms: own as f64,
        blocks,
        output_blocks,
        prompt_tokens: prompt,
        output_tokens: output,
    }
}

fn config(budget: u64) -> EngineConfig {
    EngineConfig {
        max_num_batched_tokens: budget,
        ..Default::default()
    }
}

/// Runs every queued request to the end, checking the invariants after every step; returns
/// each request's (first tokens, finishes).
fn drain(e: &mut HybridEngine, requests: &[SimRequest]) -> Vec<(u32, u32)> {
    let mut counts = vec![(0u32, 0u32); requests.len()];
    while let Some(step) = e.schedule(requests) {
        assert!(
            step.tokens <= e.config.max_num_batched_tokens,
            "token budget"
        );
        assert!(e.resident_blocks() <= e.capacity_blocks(), "capacity");
        assert_eq!(e.held_outside_window(), 0, "freed outside the window");
        let end = e.complete(requests);
        for r in end.first_tokens {
            counts[r].0 += 1;
        }
        for r in end.finished {
            counts[r].1 += 1;
        }
        let (pins, held) = e.pin_balance();
        assert_eq!(pins, held, "every pin is a block some sequence holds");
    }
    counts
}

/// Consecutive blocks of `req` group 0 holds (what an index of full attention alone sees).
fn full_prefix_tokens(e: &HybridEngine, req: &SimRequest) -> u64 {
    let g = e.blocks.groups[0];
    let max = (req.prompt_tokens - 1) / g.block;
    let n = (0..max as usize)
        .take_while(|&i| e.cache.is_hit((0, req.block_hash(g.key_unit(i)))))
        .count();
    n as u64 * g.block
}

#[test]
fn a_sliding_window_frees_what_falls_behind_it_while_the_request_runs() {
    let mut e = HybridEngine::new(config(256), ModelFamily::GptOss, 1_000);
    let requests = vec![request(1_024, 8, 1, 0, 1)];
    e.add(0);
    let mut most_used = 0;
    while e.schedule(&requests).is_some() {
        most_used = most_used.max(e.used_blocks());
        assert_eq!(e.held_outside_window(), 0);
        e.complete(&requests);
    }
    // Full attention holds 65 blocks at the end, the window at most 8 behind a chunk of 16.
    assert!(most_used <= 65 + 8 + 16 + 1, "held {most_used}");
    assert!(
        most_used >= 65,
        "full attention keeps every block: {most_used}"
    );
    // Every computed block of both groups stays cached once freed.
    assert_eq!(e.resident_blocks(), 2 * 64);
    assert_eq!(e.pin_balance(), (0, 0));
}

#[test]
fn every_request_finishes_once_and_pins_balance_under_preemption() {
    for family in [
        ModelFamily::GptOss,
        ModelFamily::Gemma3,
        ModelFamily::Qwen3Next,
    ] {
        let mut e = HybridEngine::new(config(2_048), family, 40);
        let prompt = if family == ModelFamily::Qwen3Next {
            1_500
        } else {
            100
        };
        let output = if family == ModelFamily::Qwen3Next {
            700
        } else {
            60
        };
        let requests: Vec<SimRequest> = (0..12)
            .map(|i| request(prompt, output, 7, prompt / 32, 100 + i))
            .collect();
        for (i, r) in requests.iter().enumerate() {
            assert!(e.fits(r), "{family:?}");
            e.add(i);
        }
        let counts = drain(&mut e, &requests);
        assert!(
            counts.iter().all(|&c| c == (1, 1)),
            "{family:?}: {counts:?}"
        );
        assert!(
            e.stats.preemptions > 0,
            "{family:?}: the pool was too small"
        );
        assert_eq!(e.pin_balance(), (0, 0), "{family:?}");
    }
}

/// Runs `a` to the end, then `filler` (which evicts what was freed first), then admits
/// `probe`: returns (the hit the engine took, the rule's hit just before, the full-attention
/// group's prefix just before).
fn probe_after_pressure(
    e: &mut HybridEngine,
    a: SimRequest,
    filler: SimRequest,
    probe: SimRequest,
) -> (u64, u64, u64) {
    let requests = vec![a, filler, probe];
    e.add(0);
    drain(e, &requests[..1]);
    e.add(1);
    drain(e, &requests[..2]);
    let rule = e.hit_tokens(&requests[2], requests[2].prompt_tokens);
    let full = full_prefix_tokens(e, &requests[2]);
    e.add(2);
    let step = e.schedule(&requests).expect("work");
    (step.admitted[0].1, rule, full)
}

#[test]
fn a_window_evicted_before_the_prefix_costs_the_hit_full_attention_predicts() {
    // A: 1,024 tokens prefilled 256 at a time; the window's blocks behind it are freed as it
    // goes, so they are the first evicted when the filler needs room.
    let mut e = HybridEngine::new(config(256), ModelFamily::GptOss, 140);
    let a = request(1_024, 1, 1, 0, 1);
    let filler = request(480, 1, 2, 0, 2);
    let probe = request(800, 1, 1, 32, 3);
    let (hit, rule, full) = probe_after_pressure(&mut e, a, filler, probe);
    assert_eq!(hit, rule, "the engine takes the rule's hit");
    assert_eq!(full, 512, "full attention still holds the shared 32 blocks");
    assert!(hit < full, "the window's blocks are gone: {hit} < {full}");

    // Without the pressure, the window's blocks are there and the hit is the whole prefix.
    let mut calm = HybridEngine::new(config(256), ModelFamily::GptOss, 1_000);
    let (hit, rule, full) = probe_after_pressure(
        &mut calm,
        request(1_024, 1, 1, 0, 1),
        request(480, 1, 2, 0, 2),
        request(800, 1, 1, 32, 3),
    );
    assert_eq!((hit, rule, full), (512, 512, 512));
}

#[test]
fn a_mamba_state_evicted_before_the_prefix_costs_the_hit_full_attention_predicts() {
    // Qwen3-Next-like: blocks of 576 tokens; A's states at 576 and 1,152 are freed while it
    // runs (chunks of 576), the one at its last boundary only when it finishes.
    let mut e = HybridEngine::new(config(576), ModelFamily::Qwen3Next, 10);
    let a = request(2_400, 1, 1, 0, 1);
    let filler = request(1_100, 1, 2, 0, 2);
    // Shares A's first 1,200 tokens (75 units): two full blocks.
    let probe = request(1_700, 1, 1, 75, 3);
    let (hit, rule, full) = probe_after_pressure(&mut e, a, filler, probe);
    assert_eq!(hit, rule, "the engine takes the rule's hit");
    assert_eq!(full, 1_152, "full attention still holds two blocks");
    assert!(hit < full, "the states are gone: {hit} < {full}");

    let mut calm = HybridEngine::new(config(576), ModelFamily::Qwen3Next, 1_000);
    let (hit, _, full) = probe_after_pressure(
        &mut calm,
        request(2_400, 1, 1, 0, 1),
        request(1_100, 1, 2, 0, 2),
        request(1_700, 1, 1, 75, 3),
    );
    assert_eq!(
        (hit, full),
        (1_152, 1_152),
        "every state cached, none evicted"
    );
}
