#!/usr/bin/env bash
# Keys from tokens end to end: one daemon (release, default settings) and `kv-indexer loadgen`
# on loopback, every pod aligned against half of the pods translated (the same tokens published
# under opaque hashes, as another algorithm or seed would), rounds interleaved (aligned,
# half, aligned, half, ...), a fresh daemon per run. Prints each run, then the medians.
# Usage: benches/translation-load.sh [rounds]   (RATE, DURATION; builds --release)
set -euo pipefail
cd "$(dirname "$0")/.."
rounds="${1:-3}"
RATE="${RATE:-1000000}"
DURATION="${DURATION:-10}"
cargo build --release --quiet
bin=target/release/kv-indexer
work="$(mktemp -d)"
daemon=""
cleanup() { [ -n "$daemon" ] && kill "$daemon" 2>/dev/null; wait 2>/dev/null || true; rm -rf "$work"; }
trap cleanup EXIT
results="$work/results.tsv"
for round in $(seq "$rounds"); do
  for share in 0 0.5; do
    RUST_LOG=warn "$bin" serve --zmq-endpoint tcp://127.0.0.1:5591 --grpc-addr 127.0.0.1:50591 \
      --metrics-addr 127.0.0.1:9591 >"$work/daemon.log" 2>&1 &
    daemon=$!
    for _ in $(seq 100); do
      curl -fs http://127.0.0.1:9591/readyz >/dev/null 2>&1 && break
      sleep 0.1
    done
    "$bin" loadgen --zmq-endpoint tcp://127.0.0.1:5591 --grpc http://127.0.0.1:50591 \
      --metrics 127.0.0.1:9591 --rate "$RATE" --duration "$DURATION" --score-concurrency 1 \
      --translated-share "$share" --json 2>/dev/null >"$work/run.json"
    translated=$(curl -fs http://127.0.0.1:9591/metrics | awk '/^kvindexer_engines\{.*key_mode="translated"/ { print $2 }')
    python3 - "$share" "$round" "${translated:-0}" "$work/run.json" >>"$results" <<'PY'
import json, sys
share, rnd, translated, path = sys.argv[1:5]
r = json.load(open(path))
load = r["score_under_load"] or {}
print("\t".join(str(x) for x in [share, rnd, translated, round(r["applied_blocks_per_s"]), int(r["sequence_gaps"]),
                                 round(r["score_idle"]["p50_us"]), round(r["score_idle"]["p99_us"]),
                                 round(load.get("p50_us", 0)), round(load.get("p99_us", 0))]))
PY
    tail -n 1 "$results"
    kill "$daemon"; wait "$daemon" 2>/dev/null || true; daemon=""
  done
done
python3 - "$results" <<'PY'
import statistics, sys
rows = [l.split("\t") for l in open(sys.argv[1]) if l.strip()]
print("\n| pods translated | engines translated | applied blocks/s | gaps | idle p50 / p99 us | under load p50 / p99 us |")
print("|---|---:|---:|---:|---:|---:|")
base = None
for share in ["0", "0.5"]:
    rs = [r for r in rows if r[0] == share]
    med = lambda i: statistics.median(float(r[i]) for r in rs)
    rate = med(3)
    base = base or rate
    print(f"| {float(share):.0%} | {med(2):.0f} | {rate/1e6:.3f}M ({rate/base:.2f}x) | {med(4):.0f} | {med(5):.0f} / {med(6):.0f} | {med(7):.0f} / {med(8):.0f} |")
PY
