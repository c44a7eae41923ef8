#!/usr/bin/env bash
# The endpoint picker under event load: one daemon (release, endpointPicker on) and
# `kv-indexer loadgen --ext-proc` on loopback. The load generator publishes KV events at RATE
# blocks/s from 8 simulated pods, serves their vLLM metrics pages on loopback (the picker's
# scraper reads them every 50 ms), and asks the picker as Envoy would (FULL_DUPLEX_STREAMED, an
# 8,000-token prompt as token ids per request, every pod a candidate), CONCURRENCY streams at
# once: picks/s and pick latency p50/p99 (client side: first message sent to the pick), idle
# then under load, and the blocks/s the daemon applied meanwhile (gaps would show events late).
# CHAT=1: chat prompts instead of token ids, the issue's case. Both sides get the tokenizer
# folder TOKENIZER (default ../shared/tokenizers/qwen3, the real Qwen3 one) for MODEL (default
# Qwen/Qwen3-8B): the daemon as `local.modelTokenizerMap` (offline, default pool settings), the
# load generator as `--chat-tokenizer`. Each request is then a /v1/chat/completions body of
# about 8,000 tokens once rendered (one of 4 long system prompts, each shared by a quarter of
# the prompts, then user/assistant turns), so the picker renders the chat template and
# tokenizes before it scores; the pods publish the blocks of those very token ids (about
# 8,180 tokens: the last turn passes 8,000). The load generator fails the round unless the
# daemon, asked to score the first chat before the load, matches every block its pod stored,
# and unless some pick found a prefix ("index lookups under load: ...% found a prefix").
# A fresh daemon per round. Usage: [CHAT=1] benches/picker-load.sh [rounds]   (RATE, DURATION,
# CONCURRENCY, CHAT, TOKENIZER, MODEL; builds --release)
set -euo pipefail
cd "$(dirname "$0")/.."
rounds="${1:-3}"
RATE="${RATE:-1000000}"
DURATION="${DURATION:-10}"
CONCURRENCY="${CONCURRENCY:-4}"
CHAT="${CHAT:-0}"
TOKENIZER="${TOKENIZER:-../shared/tokenizers/qwen3}"
chat_args=()
if [ "$CHAT" = 1 ]; then
  MODEL="${MODEL:-Qwen/Qwen3-8B}"
  [ -f "$TOKENIZER/tokenizer.json" ] || { echo "CHAT=1: no $TOKENIZER/tokenizer.json" >&2; exit 1; }
  TOKENIZER="$(cd "$TOKENIZER" && pwd)"
  chat_args=(--chat-tokenizer "$TOKENIZER")
else
  MODEL="${MODEL:-loadgen/model}"
fi
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
if [ "$CHAT" = 1 ]; then
  cat >>"$work/config.yaml" <<YAML
indexerConfig:
  tokenizersPoolConfig:
    offline: true
    local:
      modelTokenizerMap:
        "$MODEL": "$TOKENIZER"
YAML
fi
"$bin" check-config --config "$work/config.yaml" >/dev/null
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
    --score-concurrency "$CONCURRENCY" --model "$MODEL" "${chat_args[@]}" 2>"$work/loadgen.log" ||
    { cat "$work/loadgen.log" >&2; exit 1; }
  grep '^prepared' "$work/loadgen.log" || true
  curl -fs http://127.0.0.1:9592/metrics |
    grep -E '^kvindexer_(picker_(picks_total|metrics_unusable_total|scrapes_total|pick_latency_seconds_(sum|count))|score_latency_seconds_(sum|count)|prefix_store_lookups_total)|^kvcache_(index_lookup_(requests|hits)_total|tokenization_tokenization_latency_seconds_(sum|count))' || true
  kill "$daemon"
  wait "$daemon" 2>/dev/null || true
  daemon=""
done
