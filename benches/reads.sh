#!/usr/bin/env bash
# Reads under ingest: ScorePods latency (8,000-token prompts, 64 pods) idle and under 1M
# blocks/s of events, for each request form and caller count, with this build's daemon and,
# when BASELINE names another kv-indexer binary, that one's, alternated run by run (a fresh
# daemon per run, release build, default settings, this build's loadgen as the client for
# both). Prints each run, then medians per scenario and daemon.
# Usage: benches/reads.sh [rounds]   (RATE, DURATION, BASELINE, SCENARIOS; builds --release)
# SCENARIOS: space-separated from tokens packed tokens4 packed4 translated (default: all).
# OTHERS: more binaries, `name=PATH` separated by `;` (e.g. this source built without the
#   default allocator: `cargo build --release --no-default-features --features lab`).
# VARIANTS: more daemons of this build with a config each, `name=YAML` separated by `;`, e.g.
#   VARIANTS='nice0={kvEventsConfig: {ingestNice: 0}};nice2={kvEventsConfig: {ingestNice: 2}}'
set -euo pipefail
cd "$(dirname "$0")/.."
rounds="${1:-3}"
RATE="${RATE:-1000000}"
DURATION="${DURATION:-10}"
SCENARIOS="${SCENARIOS:-tokens packed tokens4 packed4 translated}"
cargo build --release --quiet
bin=target/release/kv-indexer
work="$(mktemp -d)"
daemons=("this:$bin:")
if [ -n "${BASELINE:-}" ]; then daemons+=("baseline:$BASELINE:"); fi
IFS=';' read -r -a others <<<"${OTHERS:-}"
for o in "${others[@]}"; do
  [ -n "$o" ] && daemons+=("${o%%=*}:${o#*=}:")
done
IFS=';' read -r -a variants <<<"${VARIANTS:-}"
for v in "${variants[@]}"; do
  [ -z "$v" ] && continue
  printf '%s\n' "${v#*=}" >"$work/${v%%=*}.yaml"
  daemons+=("${v%%=*}:$bin:$work/${v%%=*}.yaml")
done
daemon=""
cleanup() { [ -n "$daemon" ] && kill "$daemon" 2>/dev/null; wait 2>/dev/null || true; rm -rf "$work"; }
trap cleanup EXIT
results="$work/results.tsv"
for round in $(seq "$rounds"); do
  for scenario in $SCENARIOS; do
    case "$scenario" in
      tokens) args=(--score-concurrency 1) ;;
      packed) args=(--score-concurrency 1 --packed-tokens) ;;
      tokens4) args=(--score-concurrency 4) ;;
      packed4) args=(--score-concurrency 4 --packed-tokens) ;;
      translated) args=(--score-concurrency 1 --translated-share 0.5) ;;
      *) echo "unknown scenario $scenario" >&2; exit 2 ;;
    esac
    for d in "${daemons[@]}"; do
      name="${d%%:*}"; rest="${d#*:}"; daemon_bin="${rest%%:*}"; config="${rest#*:}"
      config_args=()
      if [ -n "$config" ]; then config_args=(--config "$config"); fi
      RUST_LOG=warn "$daemon_bin" serve "${config_args[@]}" --zmq-endpoint tcp://127.0.0.1:5592 \
        --grpc-addr 127.0.0.1:50592 --metrics-addr 127.0.0.1:9592 >"$work/daemon.log" 2>&1 &
      daemon=$!
      ready=""
      for _ in $(seq 100); do
        curl -fs http://127.0.0.1:9592/readyz >/dev/null 2>&1 && { ready=1; break; }
        sleep 0.1
      done
      if [ -z "$ready" ]; then
        echo "reads.sh: daemon $name ($daemon_bin) not ready after 10 s; its log:" >&2
        cat "$work/daemon.log" >&2
        exit 1
      fi
      "$bin" loadgen --zmq-endpoint tcp://127.0.0.1:5592 --grpc http://127.0.0.1:50592 \
        --metrics 127.0.0.1:9592 --rate "$RATE" --duration "$DURATION" "${args[@]}" \
        --json 2>/dev/null >"$work/run.json"
      python3 - "$scenario" "$name" "$round" "$work/run.json" >>"$results" <<'PY'
import json, sys
scenario, name, rnd, path = sys.argv[1:5]
r = json.load(open(path))
def need(*keys):
    # A measurement the run did not make fails the benchmark: a 0 in the medians would read
    # as a figure.
    v = r
    for k in keys:
        v = v.get(k) if isinstance(v, dict) else None
    if not isinstance(v, (int, float)) or isinstance(v, bool):
        sys.exit(f"reads.sh: {scenario}/{name} round {rnd}: loadgen reported no {'.'.join(keys)} ({path})")
    return v
row = [need("applied_blocks_per_s"), need("sequence_gaps"),
       need("score_idle", "p50_us"), need("score_idle", "p99_us"),
       need("score_under_load", "p50_us"), need("score_under_load", "p99_us")]
if row[0] <= 0:
    sys.exit(f"reads.sh: {scenario}/{name} round {rnd}: no block applied under load ({path})")
print("\t".join(str(x) for x in [scenario, name, rnd] + [round(v) for v in row]))
PY
      tail -n 1 "$results"
      kill "$daemon"; wait "$daemon" 2>/dev/null || true; daemon=""
    done
  done
done
python3 - "$results" <<'PY'
import statistics, sys
rows = [l.split("\t") for l in open(sys.argv[1]) if l.strip()]
print("\n| scenario | daemon | applied blocks/s | gaps | idle p50 / p99 us | under load p50 / p99 us |")
print("|---|---|---:|---:|---:|---:|")
for scenario in dict.fromkeys(r[0] for r in rows):
    for name in dict.fromkeys(r[1] for r in rows):
        rs = [r for r in rows if r[0] == scenario and r[1] == name]
        med = lambda i: statistics.median(float(r[i]) for r in rs)
        print(f"| {scenario} | {name} | {med(3)/1e6:.3f}M | {med(4):.0f} | {med(5):.0f} / {med(6):.0f} | {med(7):.0f} / {med(8):.0f} |")
PY
