#!/usr/bin/env bash
# The hybrid model families' tables of docs/simulation.md ("Hybrid models: what
# full-attention-only prediction costs"): for each family, 5 seeds of chat at 3,000 blocks and
# 3 of shared-prefix at 6,000, the four precise routers, then per (workload, router) the means
# over the seeds. Usage: benches/simulate-hybrid.sh [path to a release kv-indexer]
set -euo pipefail
bin="${1:-target/release/kv-indexer}"
out="$(mktemp -d)"
policies=precise-nospec,precise-full-only-nospec,precise,precise-full-only
for f in full gpt-oss gemma3 qwen3-next; do
  for s in 42 43 44 45 46; do
    "$bin" simulate --workload chat --capacity-blocks 3000 --model-family "$f" \
      --policies "$policies" --seed "$s" --json >"$out/$f-chat-$s.json"
  done
  for s in 42 43 44; do
    "$bin" simulate --workload shared-prefix --capacity-blocks 6000 --model-family "$f" \
      --policies "$policies" --seed "$s" --json >"$out/$f-shared-prefix-$s.json"
  done
done
python3 - "$out" <<'PY'
import glob, json, os, sys
out = sys.argv[1]
for family in ["full", "gpt-oss", "gemma3", "qwen3-next"]:
    print(f"\n**`{family}`**\n")
    print("| workload | router | prefix-hit rate | predicted exactly | over-predicted (tokens over, mean) | TTFT p50 ms | TTFT p90 ms | TTFT mean ms |")
    print("|---|---|---:|---:|---:|---:|---:|---:|")
    for workload in ["chat", "shared-prefix"]:
        runs = [json.load(open(p)) for p in sorted(glob.glob(os.path.join(out, f"{family}-{workload}-*.json")))]
        for policy in [r["policy"] for r in runs[0]["results"]]:
            rows = [next(r for r in run["results"] if r["policy"] == policy) for run in runs]
            mean = lambda k: sum(r[k] for r in rows) / len(rows)
            hits = [r["token_hit_rate"] * 100 for r in rows]
            pred = [r["prediction"] for r in rows]
            n = sum(p["requests"] for p in pred)
            exact = sum(p["exact"] for p in pred)
            over = sum(p["over"] for p in pred)
            over_tokens = sum(p["over_tokens"] for p in pred)
            per_over = over_tokens / over if over else 0
            print(f"| {workload} | {policy} | {sum(hits)/len(hits):.1f}% ({min(hits):.1f}-{max(hits):.1f}) "
                  f"| {100*exact/n:.1f}% | {100*over/n:.1f}% ({per_over:,.0f}) "
                  f"| {mean('ttft_p50_ms'):.0f} | {mean('ttft_p90_ms'):.0f} | {mean('ttft_mean_ms'):.0f} |")
PY
