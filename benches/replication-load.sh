#!/usr/bin/env bash
# Replication under load, on one machine: a redis-server, kv-indexer replicas and
# `kv-indexer loadgen`, all on loopback. Three rounds of each scenario, interleaved:
#   single    one daemon, replication off, events at RATE_SCORE blocks/s: ScorePods latency
#             (the baseline);
#   replicated  two replicas sharing a Redis, the same load on replica 1: ScorePods latency
#             there, and replica 2 following through the log;
#   throughput  two replicas, events as fast as replica 1 takes them: the rate at which
#             replica 2 applies them end to end (ZMQ -> replica 1 -> Redis -> replica 2).
# PIN=1 pins the daemon under test and loadgen to CPU 0, the second replica and Redis to CPU 1
# (taskset), so the scored replica competes for its core with the same processes in both
# setups; without it everything shares both cores.
# Usage: benches/replication-load.sh [rounds]   (needs redis-server on PATH; builds --release)
set -euo pipefail
cd "$(dirname "$0")/.."
rounds="${1:-3}"
RATE_SCORE="${RATE_SCORE:-100000}"
DURATION="${DURATION:-10}"
if [ "${PIN:-0}" = 1 ]; then near=(taskset -c 0); far=(taskset -c 1); else near=(); far=(); fi
cargo build --release --quiet
bin=target/release/kv-indexer
work="$(mktemp -d)"
pids=()
cleanup() { for p in "${pids[@]}"; do kill "$p" 2>/dev/null || true; done; wait 2>/dev/null || true; rm -rf "$work"; }
trap cleanup EXIT

${far[@]+"${far[@]}"} redis-server --port 6390 --bind 127.0.0.1 --save "" --appendonly no --dir "$work" --daemonize no >/dev/null &
pids+=($!)
sleep 0.5

config() { # name zmq grpc metrics replication(true|false) prefix
  cat >"$work/$1.yaml" <<YAML
indexerConfig: {tokenProcessorConfig: {blockSize: 16}}
kvEventsConfig: {zmqEndpoint: "tcp://127.0.0.1:$2"}
server: {grpcAddr: "127.0.0.1:$3", metricsAddr: "127.0.0.1:$4"}
YAML
  # Replication settings without enabled: true are refused: written only when it is on.
  if [ "$5" = true ]; then
    echo "replication: {enabled: true, redisUrl: \"redis://127.0.0.1:6390\", keyPrefix: \"$6\", replicaId: \"$1\", snapshotInterval: 30s}" >>"$work/$1.yaml"
  fi
}
start() { # name [pin...]
  local name=$1; shift
  RUST_LOG=warn "$@" "$bin" serve --config "$work/$name.yaml" >"$work/$name.log" 2>&1 &
  pids+=($!)
  echo $!
}
ready() { # metrics port
  for _ in $(seq 100); do
    curl -fs "http://127.0.0.1:$1/readyz" >/dev/null 2>&1 && return 0
    sleep 0.1
  done
  echo "not ready: $1" >&2; return 1
}
cpu() { # pid -> CPU seconds used so far (user + system)
  awk -v hz="$(getconf CLK_TCK)" '{ printf "%.2f\n", ($14 + $15) / hz }' "/proc/$1/stat"
}
stop() { kill "$1"; wait "$1" 2>/dev/null || true; }
loadgen() { # zmq grpc metrics rate [extra...]
  local zmq=$1 grpc=$2 metrics=$3 rate=$4; shift 4
  ${near[@]+"${near[@]}"} "$bin" loadgen --zmq-endpoint "tcp://127.0.0.1:$zmq" --grpc "http://127.0.0.1:$grpc" \
    --metrics "127.0.0.1:$metrics" --rate "$rate" --duration "$DURATION" --json "$@" 2>/dev/null
}

for round in $(seq "$rounds"); do
  prefix="bench-$round-$RANDOM"
  # single
  config solo 15557 15051 15090 false "$prefix-solo"
  p=$(start solo ${near[@]+"${near[@]}"}); ready 15090
  loadgen 15557 15051 15090 "$RATE_SCORE" >"$work/single-$round.json"
  cpu "$p" >"$work/single-$round.cpu"
  stop "$p"
  # replicated: the same load on replica 1, replica 2 following
  config r1 15557 15051 15090 true "$prefix-a"
  config r2 15558 15052 15091 true "$prefix-a"
  p1=$(start r1 ${near[@]+"${near[@]}"}); p2=$(start r2 ${far[@]+"${far[@]}"}); ready 15090; ready 15091
  loadgen 15557 15051 15090 "$RATE_SCORE" --replica-metrics 127.0.0.1:15091 >"$work/replicated-$round.json"
  cpu "$p1" >"$work/replicated-$round.cpu"; cpu "$p2" >"$work/follower-$round.cpu"
  stop "$p1"; stop "$p2"
  # throughput: as fast as replica 1 takes events
  config r1 15557 15051 15090 true "$prefix-b"
  config r2 15558 15052 15091 true "$prefix-b"
  p1=$(start r1 ${near[@]+"${near[@]}"}); p2=$(start r2 ${far[@]+"${far[@]}"}); ready 15090; ready 15091
  loadgen 15557 15051 15090 1200000 --score-concurrency 1 --replica-metrics 127.0.0.1:15091 >"$work/throughput-$round.json"
  stop "$p1"; stop "$p2"
  echo "round $round done" >&2
done

python3 - "$work" "$rounds" "$RATE_SCORE" "$DURATION" <<'PY'
import json, statistics, sys
work, rounds, rate, duration = sys.argv[1], int(sys.argv[2]), sys.argv[3], sys.argv[4]
load = lambda name, r: json.load(open(f"{work}/{name}-{r}.json"))
med = lambda xs: statistics.median(xs)
single = [load("single", r) for r in range(1, rounds + 1)]
repl = [load("replicated", r) for r in range(1, rounds + 1)]
thr = [load("throughput", r) for r in range(1, rounds + 1)]
p = lambda runs, k: med([x["score_under_load"][k] for x in runs])
print(f"pinned: {__import__('os').environ.get('PIN', '0') == '1'}")
print(f"ScorePods under {rate} blocks/s of events ({duration}s, 64 pods, 500-block prompts, 4 callers); medians of {rounds} rounds")
print("| setup | applied blocks/s during the load | gaps | ScorePods p50 us | p99 us |")
print("| --- | --- | --- | --- | --- |")
for name, runs in [("one daemon, replication off (baseline)", single), ("replica 1 of 2, replication on", repl)]:
    print(f"| {name} | {med([x['applied_blocks_per_s'] for x in runs]):.0f} | {sum(x['sequence_gaps'] for x in runs):.0f} | {p(runs, 'p50_us'):.0f} | {p(runs, 'p99_us'):.0f} |")
cpu = lambda name: med([float(open(f"{work}/{name}-{r}.cpu").read()) for r in range(1, rounds + 1)])
print(f"CPU seconds over the whole run (start, warm-up, idle baseline, load): one daemon {cpu('single'):.1f}; replica 1 {cpu('replicated'):.1f} ({cpu('replicated') / cpu('single'):.2f}x); replica 2 {cpu('follower'):.1f}")
print(f"ratio (replicated / single): p50 {p(repl, 'p50_us') / p(single, 'p50_us'):.2f}x, p99 {p(repl, 'p99_us') / p(single, 'p99_us'):.2f}x")
print(f"replica 2 followed at {med([x['replicas'][0]['applied_blocks_per_s'] for x in repl]):.0f} blocks/s (caught up: {[x['replicas'][0]['caught_up'] for x in repl]})")
print()
print(f"end-to-end replication throughput (events as fast as replica 1 takes them, {duration}s); medians of {rounds} rounds")
print(f"replica 1 applied {med([x['applied_blocks_per_s'] for x in thr]):.0f} blocks/s from ZMQ; replica 2 applied {med([x['replicas'][0]['applied_blocks_per_s'] for x in thr]):.0f} blocks/s through Redis (caught up: {[x['replicas'][0]['caught_up'] for x in thr]}; after {[round(x['replicas'][0]['caught_up_after_s'], 1) for x in thr]} s)")
PY
