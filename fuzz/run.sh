#!/usr/bin/env bash
# Runs the fuzz targets: `fuzz/run.sh [SECONDS_PER_TARGET] [TARGET...]` (default 30 s, all).
# Needs the nightly toolchain and cargo-fuzz (`cargo install cargo-fuzz --locked`).
# For 1e7+ executions of one target: `cd fuzz && cargo +nightly fuzz run decode_batch -- -runs=10000000`.
set -euo pipefail
cd "$(dirname "$0")"
seconds="${1:-30}"
shift || true
targets=("$@")
if [ ${#targets[@]} -eq 0 ]; then
  targets=(decode_batch topic config chat_input)
fi
python3 seed.py
cargo +nightly fuzz build "${targets[@]/#/}" 2>/dev/null || cargo +nightly fuzz build
for t in "${targets[@]}"; do
  echo "== fuzz $t (${seconds}s)"
  cargo +nightly fuzz run "$t" "corpus/$t" -- -max_total_time="$seconds" -max_len=65536 -rss_limit_mb=2048 2>&1 \
    | grep -E "^#[0-9]+ +DONE|Done [0-9]+ runs|ERROR|panicked|SUMMARY|crash-" || true
  if [ -d "artifacts/$t" ] && ls "artifacts/$t"/crash-* >/dev/null 2>&1; then
    echo "fuzz target $t found a crash: fuzz/artifacts/$t" >&2
    exit 1
  fi
done
