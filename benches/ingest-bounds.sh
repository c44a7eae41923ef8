#!/usr/bin/env bash
# The ingest bounds' figures in a release build: tests/ingest_bounds.rs's scenarios over real
# sockets (20,000 pods in one burst; a publisher flooding past its share beside four healthy
# pods, measured against the same healthy pods without the flood; 500 junk model names, then
# a real model), each round one test at a time. Prints what each round measured. The tests
# assert what must hold (nothing lost, the flooder resynchronised, healthy pods not slowed by
# the flood); the release figures in docs/operations.md come from here. A busy machine shows
# in them: run it on a quiet one.
# Usage: benches/ingest-bounds.sh [rounds]   (default 3; builds the test --release)
set -euo pipefail
cd "$(dirname "$0")/.."
rounds="${1:-3}"
bin="$(cargo test --release --locked --quiet --test ingest_bounds --no-run --message-format=json |
  grep '"kind":\["test"\],[^}]*"name":"ingest_bounds"' |
  sed -n 's/.*"executable":"\([^"]*\)".*/\1/p' | tail -n 1)"
[ -x "$bin" ] || { echo "benches/ingest-bounds.sh: no test executable built" >&2; exit 1; }
for round in $(seq "$rounds"); do
  echo "== round $round"
  if ! out="$("$bin" --nocapture --test-threads=1 2>&1)"; then
    echo "$out" >&2
    exit 1
  fi
  grep -oE "(20000 pods sent in|healthy pods' apply latency alone|the flood's 500 models applied).*" <<<"$out"
done
