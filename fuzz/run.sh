#!/usr/bin/env bash
# Runs the fuzz targets: `fuzz/run.sh [SECONDS_PER_TARGET] [TARGET...]` (default 30 s, all).
# Needs the nightly toolchain and cargo-fuzz (`cargo install cargo-fuzz --locked`).
# For 1e7+ executions of one target: `cd fuzz && cargo +nightly fuzz run decode_batch -- -runs=10000000`.
#
# Fails (exit 1) when a target does not build, when libFuzzer ends without its "Done N runs"
# line or with 0 runs, when it exits non-zero, and when fuzz/artifacts/<target>/ holds a crash,
# OOM, timeout (an input running over 60 s) or leak input (this run's or an earlier one's:
# delete it once it is fixed).
# Prints one line per target; on a failure, the end of that target's log and where the rest is.
set -euo pipefail
cd "$(dirname "$0")"
seconds="${1:-30}"
if [ $# -gt 0 ]; then shift; fi
if ! [[ "$seconds" =~ ^[1-9][0-9]*$ ]]; then
  echo "fuzz/run.sh: seconds per target must be a positive integer, not '$seconds'" >&2
  exit 2
fi
targets=("$@")
if [ ${#targets[@]} -eq 0 ]; then
  targets=(decode_batch topic config chat_input picker_body token_ids)
fi
logs="$(mktemp -d "${TMPDIR:-/tmp}/fuzz-run.XXXXXX")"

# Prints why `$1` failed, the end of its log `$2`, and exits.
fail() {
  echo "FAIL fuzz $1: $3" >&2
  tail -n 20 "$2" | sed 's/^/  | /' >&2
  echo "  full log: $2" >&2
  exit 1
}

python3 seed.py >"$logs/seed.log" 2>&1 || fail seed "$logs/seed.log" "seed.py failed"
for t in "${targets[@]}"; do
  log="$logs/$t.log"
  if ! cargo +nightly fuzz build "$t" >"$log" 2>&1; then
    fail "$t" "$log" "does not build"
  fi
  status=0
  cargo +nightly fuzz run "$t" "corpus/$t" -- -max_total_time="$seconds" -max_len=65536 \
    -rss_limit_mb=2048 -timeout=60 >>"$log" 2>&1 || status=$?
  artifacts=()
  if [ -d "artifacts/$t" ]; then
    while IFS= read -r -d '' a; do artifacts+=("$a"); done < <(
      find "artifacts/$t" -maxdepth 1 -type f \
        \( -name 'crash-*' -o -name 'oom-*' -o -name 'timeout-*' -o -name 'leak-*' \) -print0)
  fi
  runs="$(sed -n 's/^Done \([0-9]*\) runs in .*/\1/p' "$log" | tail -n 1)"
  if [ ${#artifacts[@]} -gt 0 ]; then
    fail "$t" "$log" "${#artifacts[@]} artifact(s): ${artifacts[*]/#/fuzz/}"
  elif [ "$status" -ne 0 ]; then
    fail "$t" "$log" "libFuzzer exited with status $status"
  elif [ -z "$runs" ]; then
    fail "$t" "$log" "no 'Done N runs' line: the target did not run to its end"
  elif [ "$runs" -eq 0 ]; then
    fail "$t" "$log" "0 executions"
  fi
  echo "fuzz $t: $runs runs in ${seconds}s, no artifact"
done
rm -rf "$logs"
