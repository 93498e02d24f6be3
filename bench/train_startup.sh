#!/usr/bin/env bash
# Start-up cost of `shardmem train`: wall time and the first step's time, for one or more checkouts of
# shardmem, alternating between them so that machine noise hits all alike.
#
#   bash bench/train_startup.sh . /path/to/older-checkout     # e.g. made with `git worktree add`
#
# Runs `python -m shardmem train configs/tiny.yaml --set train.steps=N` from each checkout (so that its
# own shardmem is imported) in a fresh run directory, for N = 1 and 300, REPS times each (default 3).
# "first_step_s" is the first metrics record's first_step_s.
set -euo pipefail
PY="${PY:-$(cd "$(dirname "$0")/.." && pwd)/.venv/bin/python}"
REPS="${REPS:-3}"
[ $# -ge 1 ] || set -- .
for steps in 1 300; do
  for rep in $(seq "$REPS"); do
    for checkout in "$@"; do
      run=$(mktemp -d)
      start=$(date +%s.%N)
      (cd "$checkout" && "$PY" -m shardmem train configs/tiny.yaml --set "train.steps=$steps" \
        --run-dir "$run" >/dev/null 2>&1)
      end=$(date +%s.%N)
      first=$("$PY" -c "import json, sys; print(json.loads(open(sys.argv[1]).readline())['first_step_s'])" \
        "$run/metrics.jsonl")
      printf 'steps=%s checkout=%s rep=%s wall_s=%.2f first_step_s=%.3f\n' \
        "$steps" "$checkout" "$rep" "$(echo "$end - $start" | bc)" "$first"
      rm -rf "$run"
    done
  done
done
