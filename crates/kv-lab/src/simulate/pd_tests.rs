use kv_core::{mix64, BlockHash, SplitRule};

use super::super::pd_routers::{ExactPd, LlmdApproxPd, PdRouter, LLMD_PD_WEIGHTS};
use super::super::routers::RouterContext;
use super::super::{SimRequest, SimSettings};
use super::*;

/// A request whose prompt is `prefix_blocks` blocks of `group`'s shared prefix, then its own.
fn request(
    id: u64,
    group: u64,
    prefix_blocks: u64,
    prompt: u64,
    output: u64,
    at: f64,
) -> SimRequest {
    let block = |k: u64| match k < prefix_blocks {
        true => BlockHash::new(mix64(group << 32 | k) | 1),
        false => BlockHash::new(mix64(0xA11CE ^ id << 32 | k) | 1),
    };
    SimRequest {
        arrival_ms: at,
        blocks: (0..prompt / 16).map(block).collect(),
        output_blocks: (prompt / 16..(prompt + output).div_ceil(16))
            .map(|k| BlockHash::new(mix64(0xB0B ^ id << 32 | k) | 1))
            .collect(),
        prompt_tokens: prompt,
        output_tokens: output,
    }
}

/// 60 requests in 6 groups sharing 800-token prefixes, prompts 900-4,900 tokens, one every
/// 150 ms: small pods evict, some prompts are split, some are not.
fn mixed() -> Vec<SimRequest> {
    let mut rng = crate::simulate::rng(7);
    (0..60)
        .map(|i| {
            let prompt = 900 + rng.below(4_000);
            request(i, i % 6, 50, prompt, 1 + rng.below(60), i as f64 * 150.0)
        })
        .collect()
}

fn settings(prefill: usize, decode: usize, threshold: u32, capacity: usize) -> PdSettings {
    PdSettings {
        sim: SimSettings {
            pod_capacity_blocks: vec![capacity; prefill + decode],
            ..SimSettings::default()
        },
        prefill_pods: prefill,
        rule: SplitRule {
            threshold,
            min_prompt_tokens: 0,
        },
        transfer: TransferCost::default(),
    }
}

fn routers() -> Vec<Box<dyn PdRouter>> {
    vec![
        Box::new(LlmdApproxPd::new(42)),
        Box::new(ExactPd::new(LLMD_PD_WEIGHTS, 42)),
    ]
}

#[test]
fn every_request_is_served_once_and_every_block_given_back() {
    let requests = mixed();
    for mut router in routers() {
        let r = run_pd(&settings(1, 2, 1_024, 1_500), &requests, router.as_mut());
        let name = &r.policy;
        assert_eq!((r.requests, r.rejected), (requests.len(), 0), "{name}");
        for (i, o) in r.outcomes.iter().enumerate() {
            assert!(o.decode.is_some_and(|d| d >= 1), "{name} {i}: a decode pod");
            assert_eq!((o.first_tokens, o.finished), (1, 1), "{name} {i}");
            assert_eq!(o.prefilled, u32::from(o.prefill.is_some()), "{name} {i}");
            assert!(
                o.prefill.is_none_or(|p| p == 0),
                "{name} {i}: the prefill pod"
            );
        }
        let split = r.outcomes.iter().filter(|o| o.prefill.is_some()).count();
        assert_eq!(r.splits, split, "{name}");
        assert!(
            split > 0 && split < requests.len(),
            "{name}: {split} splits"
        );
        assert_eq!(r.pins_left, 0, "{name}: pins left");
        assert!(
            r.prefill_tokens_on_prefill > 0 && r.transfer_tokens > 0,
            "{name}"
        );
    }
}

/// A 1,608-token prompt (100 full blocks and 8 tokens), then the same prompt 5 s later.
fn repeated(prompt: u64) -> Vec<SimRequest> {
    let blocks = prompt / 16;
    vec![
        request(1, 9, blocks, prompt, 4, 0.0),
        request(2, 9, blocks, prompt, 4, 5_000.0),
    ]
}

#[test]
fn a_split_moves_the_kv_to_the_decode_pod_and_the_next_request_hits_it_there() {
    let requests = repeated(1_608);
    for mut router in routers() {
        let r = run_pd(&settings(1, 1, 16, 2_000), &requests, router.as_mut());
        let (first, second) = (&r.outcomes[0], &r.outcomes[1]);
        let name = &r.policy;
        assert_eq!(first.prefill, Some(0), "{name}: nothing cached, split");
        assert_eq!(first.pulled, 1_600, "{name}: the full blocks are pulled");
        assert_eq!(
            first.decode_hit,
            Some(1_600),
            "{name}: and hit on the decode pod"
        );
        assert_eq!(
            second.prefill, None,
            "{name}: 8 tokens uncached < 16, kept whole"
        );
        assert_eq!(
            second.decode_hit,
            Some(1_600),
            "{name}: the decode pod holds them"
        );
        assert_eq!(second.exact_cached, 1_600, "{name}: and the index says so");
        // The prefill pod computed the prompt once; the decode pod each request's 8 tokens.
        assert_eq!(r.prefill_tokens_on_prefill, 1_608, "{name}");
        assert_eq!(r.prefill_tokens_on_decode, 16, "{name}");
        assert_eq!((r.needless_splits, r.missed_splits), (0, 0), "{name}");
    }
}

#[test]
fn threshold_zero_never_splits_and_moves_nothing() {
    let requests = mixed();
    for mut router in routers() {
        let r = run_pd(&settings(2, 2, 0, 1_500), &requests, router.as_mut());
        assert_eq!(r.splits, 0, "{}", r.policy);
        assert_eq!(r.transfer_tokens + r.prefill_tokens_on_prefill, 0);
        assert!(r
            .outcomes
            .iter()
            .all(|o| o.prefill.is_none() && o.prefilled == 0));
        assert_eq!(r.requests, requests.len());
    }
}

/// The exact router with its belief of the decode pod's cache replaced by 0: a deliberately
/// wrong uncached count.
struct Miscounting(ExactPd);

impl PdRouter for Miscounting {
    fn name(&self) -> String {
        "miscounting".into()
    }
    fn pick_decode(&mut self, req: &SimRequest, ctx: &RouterContext<'_>) -> (usize, u64) {
        (self.0.pick_decode(req, ctx).0, 0)
    }
    fn pick_prefill(&mut self, req: &SimRequest, ctx: &RouterContext<'_>) -> usize {
        self.0.pick_prefill(req, ctx)
    }
    fn routed(&mut self, req: &SimRequest, d: usize, p: Option<usize>, ctx: &RouterContext<'_>) {
        self.0.routed(req, d, p, ctx)
    }
}

/// What the exact decision guarantees: no request is split whose decode pod held all but
/// fewer than the threshold's tokens, and the second of two equal prompts moves nothing.
fn keeps_cached_prompts_whole(r: &PdReport) -> bool {
    r.needless_splits == 0 && r.outcomes[1].prefill.is_none() && r.outcomes[1].pulled == 0
}

#[test]
fn a_router_that_miscounts_the_uncached_tokens_splits_needlessly() {
    let requests = repeated(1_608);
    let s = settings(1, 1, 16, 2_000);
    let exact = run_pd(&s, &requests, &mut ExactPd::new(LLMD_PD_WEIGHTS, 42));
    let broken = run_pd(
        &s,
        &requests,
        &mut Miscounting(ExactPd::new(LLMD_PD_WEIGHTS, 42)),
    );
    assert!(keeps_cached_prompts_whole(&exact));
    assert!(
        !keeps_cached_prompts_whole(&broken),
        "the negative control must fail"
    );
    assert_eq!(broken.needless_splits, 1);
    assert!(broken.prefill_tokens() > exact.prefill_tokens());
}

#[test]
fn past_llm_d_s_16k_match_cap_a_cached_prompt_is_split_again_and_the_exact_rule_keeps_it() {
    // 20,008 tokens: llm-d's producer hashes at most 16,384 of them, so it believes 3,624
    // are uncached on the decode pod that holds 20,000.
    let requests = repeated(20_008);
    let s = settings(1, 1, 256, 4_000);
    let approx = run_pd(&s, &requests, &mut LlmdApproxPd::new(42));
    let exact = run_pd(&s, &requests, &mut ExactPd::new(LLMD_PD_WEIGHTS, 42));
    assert_eq!(approx.outcomes[1].believed_cached, 16_384);
    assert_eq!(approx.outcomes[1].prefill, Some(0), "split again");
    assert_eq!(approx.needless_splits, 1);
    assert!(keeps_cached_prompts_whole(&exact));
    assert!(approx.outcomes[1].ttft_ms > exact.outcomes[1].ttft_ms);
}

#[test]
fn the_comparison_is_deterministic_for_a_seed() {
    let requests = mixed();
    let once = |seed: u64| -> Vec<(String, Vec<PdOutcome>)> {
        let mut s = settings(1, 3, 256, 1_500);
        s.sim.seed = seed;
        let mut rs: Vec<Box<dyn PdRouter>> = vec![
            Box::new(LlmdApproxPd::new(seed)),
            Box::new(ExactPd::new(LLMD_PD_WEIGHTS, seed)),
        ];
        rs.iter_mut()
            .map(|r| {
                let rep = run_pd(&s, &requests, r.as_mut());
                (
                    serde_json::to_string(&rep).expect("serialisable"),
                    rep.outcomes,
                )
            })
            .collect()
    };
    assert_eq!(once(5), once(5));
}

#[test]
fn pulls_into_a_small_decode_pod_under_a_burst_all_finish() {
    // 24 distinct 3,000-token prompts at once into one decode pod of 1,000 blocks (16,000
    // tokens): pulls and queued requests compete for its memory, and every one still ends.
    let requests: Vec<SimRequest> = (0..24)
        .map(|i| request(i, 100 + i, 0, 3_000, 20, 0.0))
        .collect();
    for mut router in routers() {
        let r = run_pd(&settings(2, 1, 16, 1_000), &requests, router.as_mut());
        assert_eq!(r.requests, requests.len(), "{}", r.policy);
        assert!(r
            .outcomes
            .iter()
            .all(|o| o.finished == 1 && o.prefilled == 1));
        assert_eq!(r.pins_left, 0);
    }
}

#[test]
fn llm_d_s_pd_weights_name_scorers_of_the_list() {
    // Built by name at compile time, where a misspelt name would leave the weights at 0.
    assert_eq!(LLMD_PD_WEIGHTS.get("prefix"), Some(2.0));
    assert_eq!(LLMD_PD_WEIGHTS.get("queue"), Some(1.0));
    assert_eq!(LLMD_PD_WEIGHTS.0.iter().sum::<f64>(), 3.0);
}
