#!/usr/bin/env bash
# The endpoint picker under event load: one daemon (release, endpointPicker on) and
# `kv-indexer loadgen --ext-proc` on loopback. The load generator publishes KV events at RATE
# blocks/s from 8 simulated pods, serves their vLLM metrics pages on loopback (the picker's
# scraper reads them every 50 ms), and asks the picker as Envoy would (FULL_DUPLEX_STREAMED, an
# 8,000-token prompt as token ids per request, every pod a candidate), CONCURRENCY streams at
# once: picks/s and pick latency p50/p99 (client side: first message sent to the pick), idle
# then under load, and the blocks/s the daemon applied meanwhile (gaps would show events late).
# A fresh daemon per round. Usage: benches/picker-load.sh [rounds]   (RATE, DURATION,
# CONCURRENCY; builds --release)
set -euo pipefail
cd "$(dirname "$0")/.."
rounds="${1:-3}"
RATE="${RATE:-1000000}"
DURATION="${DURATION:-10}"
CONCURRENCY="${CONCURRENCY:-4}"
cargo build --release --quiet --bin kv-indexer
bin=target/release/kv-indexer
work="$(mktemp -d)"
daemon=""
cleanup() { [ -n "$daemon" ] && kill "$daemon" 2>/dev/null; wait 2>/dev/null || true; rm -rf "$work"; }
trap cleanup EXIT
cat >"$work/config.yaml" <<'YAML'
kvEventsConfig:
  zmqEndpoint: "tcp://127.0.0.1:5592"
server:
  grpcAddr: "127.0.0.1:50592"
  metricsAddr: "127.0.0.1:9592"
endpointPicker:
  enabled: true
  addr: "127.0.0.1:9602"
  metricsUrlTemplate: "http://127.0.0.1:9612/{pod}/metrics"
YAML
for round in $(seq "$rounds"); do
  RUST_LOG=warn "$bin" serve --config "$work/config.yaml" >"$work/daemon.log" 2>&1 &
  daemon=$!
  for _ in $(seq 100); do
    curl -fs http://127.0.0.1:9592/readyz >/dev/null 2>&1 && break
    sleep 0.1
  done
  echo "== round $round"
  "$bin" loadgen --zmq-endpoint tcp://127.0.0.1:5592 --grpc http://127.0.0.1:50592 \
    --metrics 127.0.0.1:9592 --ext-proc http://127.0.0.1:9602 --pod-metrics 127.0.0.1:9612 \
    --pods 8 --documents 64 --prompt-blocks 500 --rate "$RATE" --duration "$DURATION" \
    --score-concurrency "$CONCURRENCY" 2>/dev/null
  curl -fs http://127.0.0.1:9592/metrics |
    grep -E '^kvindexer_(picker_(picks_total|metrics_unusable_total|scrapes_total|pick_latency_seconds_(sum|count))|score_latency_seconds_(sum|count))' || true
  kill "$daemon"
  wait "$daemon" 2>/dev/null || true
  daemon=""
done
