#!/usr/bin/env bash
# A soak and fault run, on one machine: two kv-indexer replicas sharing a redis-server, load
# from `kv-indexer loadgen` for DURATION seconds (default 3600):
#   - replica r1: 64 steady pods publishing RATE blocks/s (default 300,000; 500-block prompts
#     stored and evicted), plus CHURN pods a second (default 10) that join on a socket of their
#     own, store a prompt and leave (forgotten after publisherIdleTimeout, 15 s);
#   - replica r2: 16 steady pods of another model at RATE2 blocks/s (default 20,000), so both
#     replicas receive events and both follow the other through the log;
#   - Redis restarted every REDIS_EVERY seconds (default 600): `SHUTDOWN SAVE`, then started
#     again from its dump (the log and snapshot it held survive; the replicas reconnect and
#     append what they queued meanwhile). At 300k blocks/s the log takes ~24 MB/s, so the
#     replicas snapshot every 10 s (a smaller log restarts faster) and their append queues hold
#     1 GiB (~40 s of outage; the defaults, 512 MiB, hold ~20 s);
#   - a TRANSLATED share of each replica's steady pods (default 0.25: the first quarter) hash
#     with another seed (vLLM's sha256_cbor, seed "-translated"), so the replicas translate
#     them from their token ids (maps, replication and snapshots of translated engines);
#   - every SAMPLE seconds (default 60) the RSS of r1, r2 and Redis is written to rss.csv.
# At the end loadgen waits until r2 holds what r1 holds per (model, pod, rank) (`--agree-with`)
# and the script prints the memory verdict (the largest RSS after the first WARMUP seconds,
# default 660: after the first Redis restart) against the one at WARMUP, and the counters of
# anything lost.
# Usage: benches/soak.sh [out-dir]   (needs redis-server and redis-cli on PATH; builds --release
# unless BIN names a binary)
set -euo pipefail
cd "$(dirname "$0")/.."
out="${1:-$(mktemp -d)}"
mkdir -p "$out"
DURATION="${DURATION:-3600}"
RATE="${RATE:-300000}"
RATE2="${RATE2:-20000}"
CHURN="${CHURN:-10}"
REDIS_EVERY="${REDIS_EVERY:-600}"
SAMPLE="${SAMPLE:-60}"
WARMUP="${WARMUP:-660}"
TRANSLATED="${TRANSLATED:-0.25}"
# BIN: a kv-indexer binary built beforehand (else this checkout, built here in release).
bin="${BIN:-}"
if [ -z "$bin" ]; then
  cargo build --release --quiet
  bin=target/release/kv-indexer
fi
work="$(mktemp -d)"
pids=()
redis_port=6391
cleanup() {
  for p in "${pids[@]}"; do kill "$p" 2>/dev/null || true; done
  redis-cli -p "$redis_port" shutdown nosave >/dev/null 2>&1 || true
  wait 2>/dev/null || true
  rm -rf "$work"
}
trap cleanup EXIT

start_redis() {
  redis-server --port "$redis_port" --bind 127.0.0.1 --save "" --appendonly no \
    --dir "$work" --dbfilename soak.rdb --daemonize no >>"$out/redis.log" 2>&1 &
  redis_pid=$!
  for _ in $(seq 100); do redis-cli -p "$redis_port" ping >/dev/null 2>&1 && return 0; sleep 0.1; done
  echo "redis did not start" >&2; return 1
}
start_redis

config() { # name zmq grpc metrics
  cat >"$work/$1.yaml" <<YAML
indexerConfig: {tokenProcessorConfig: {blockSize: 16}}
kvEventsConfig: {zmqEndpoint: "tcp://127.0.0.1:$2", publisherIdleTimeout: 15s}
server: {grpcAddr: "127.0.0.1:$3", metricsAddr: "127.0.0.1:$4"}
replication: {enabled: true, redisUrl: "redis://127.0.0.1:$redis_port", keyPrefix: soak, replicaId: "$1", snapshotInterval: 10s, appendQueue: 262144, appendQueueBytes: 1073741824}
YAML
}
ready() { # metrics port
  for _ in $(seq 300); do
    curl -fs "http://127.0.0.1:$1/readyz" >/dev/null 2>&1 && return 0
    sleep 0.1
  done
  echo "not ready: $1" >&2; return 1
}
config r1 16557 16051 16090
config r2 16558 16052 16091
RUST_LOG=warn "$bin" serve --config "$work/r1.yaml" >"$out/r1.log" 2>&1 &
r1=$!; pids+=("$r1")
RUST_LOG=warn "$bin" serve --config "$work/r2.yaml" >"$out/r2.log" 2>&1 &
r2=$!; pids+=("$r2")
ready 16090; ready 16091

rss() { awk '/VmRSS/ {print $2}' "/proc/$1/status" 2>/dev/null || echo 0; }
echo "t_s,r1_rss_kb,r2_rss_kb,redis_rss_kb,redis_restarts" >"$out/rss.csv"
(
  restarts=0; t=0
  while [ "$t" -lt "$DURATION" ]; do
    sleep "$SAMPLE"; t=$((t + SAMPLE))
    if [ $((t % REDIS_EVERY)) -eq 0 ] && [ "$t" -lt "$DURATION" ]; then
      redis-cli -p "$redis_port" shutdown save >/dev/null 2>&1 || true
      sleep 3   # Redis down: the replicas queue their appends and retry
      start_redis; restarts=$((restarts + 1))
      echo "t=${t}s: redis restarted" >>"$out/events.log"
    fi
    echo "$t,$(rss "$r1"),$(rss "$r2"),$(rss "$(pgrep -f "redis-server 127.0.0.1:$redis_port" | head -1)"),$restarts" >>"$out/rss.csv"
  done
) &
sampler=$!; pids+=("$sampler")

"$bin" loadgen --zmq-endpoint tcp://127.0.0.1:16558 --grpc http://127.0.0.1:16052 \
  --metrics 127.0.0.1:16091 --model soak/second --pods 16 --rate "$RATE2" \
  --duration "$DURATION" --score-concurrency 1 --translated-share "$TRANSLATED" \
  --json >"$out/loadgen-r2.json" 2>"$out/loadgen-r2.log" &
second=$!; pids+=("$second")
"$bin" loadgen --zmq-endpoint tcp://127.0.0.1:16557 --grpc http://127.0.0.1:16051 \
  --metrics 127.0.0.1:16090 --model soak/first --pods 64 --rate "$RATE" --churn "$CHURN" \
  --duration "$DURATION" --score-concurrency 1 --soak-sample "$SAMPLE" --translated-share "$TRANSLATED" \
  --agree-with http://127.0.0.1:16052 --json >"$out/loadgen-r1.json" 2>"$out/loadgen-r1.log"
wait "$second"
wait "$sampler" || true

for r in 16090 16091; do
  curl -fs "http://127.0.0.1:$r/metrics" >"$out/metrics-$r.txt"
done
python3 - "$out" "$WARMUP" <<'PY'
import csv, json, sys
out, warmup = sys.argv[1], int(sys.argv[2])
rows = list(csv.DictReader(open(f"{out}/rss.csv")))
def verdict(col):
    after = [r for r in rows if int(r["t_s"]) >= warmup]
    if not after:
        return "no sample after warm-up"
    base = int(after[0][col]); peak = max(int(r[col]) for r in after); last = int(after[-1][col])
    return f"{base/1024:.0f} MB at {after[0]['t_s']}s, peak {peak/1024:.0f} MB ({(peak-base)/max(base,1)*100:+.1f}%), last {last/1024:.0f} MB ({(last-base)/max(base,1)*100:+.1f}%)"
for col in ["r1_rss_kb", "r2_rss_kb", "redis_rss_kb"]:
    print(f"{col}: {verdict(col)}")
def total(page, name):
    return sum(float(l.rsplit(" ", 1)[1]) for l in open(page) if l.startswith(name) and not l.startswith("#"))
for port in ["16090", "16091"]:
    page = f"{out}/metrics-{port}.txt"
    names = ["kvindexer_messages_lost_total", "kvindexer_sequence_gaps_total", "kvindexer_messages_shed_total",
             "kvindexer_replication_append_dropped_total", "kvindexer_blocks_applied_total", "kvindexer_pods_forgotten_total"]
    print(port, {n: total(page, n) for n in names})
report = json.load(open(f"{out}/loadgen-r1.json"))
print("r1 load:", {k: report.get(k) for k in ["duration_s", "sent_blocks_per_s", "applied_blocks_per_s", "sequence_gaps", "messages_lost", "churn", "agreement", "soak"]})
PY
echo "results in $out"
