#!/usr/bin/env bash
# Restarts `shardmem train` on a run whose newest checkpoint is corrupt, N times (issue 20, item 3):
# each restart must print the one-line "does not restore ... moved it to" warning and nothing on stderr
# (no asyncio "exception was never retrieved", no TensorStore traceback).
#   bash scripts/corrupt_restart.sh [N=20] [CONFIG=configs/tiny.yaml]
set -euo pipefail
runs=${1:-20}
config=${2:-configs/tiny.yaml}
here=$(cd "$(dirname "$0")/.." && pwd)
shardmem="$here/.venv/bin/shardmem"
work=$(mktemp -d)
trap 'rm -rf "$work"' EXIT
sets=(--set train.steps=20 --set train.checkpoint_every=10)
export JAX_PLATFORMS=cpu
"$shardmem" train "$config" --run-dir "$work/base" "${sets[@]}" > /dev/null
clean=0
for i in $(seq 1 "$runs"); do
  run="$work/run-$i"
  cp -r "$work/base" "$run"
  largest=$(find "$run/checkpoints/20" -type f -printf '%s %p\n' | sort -n | tail -1 | cut -d' ' -f2-)
  truncate -s 100 "$largest"
  "$shardmem" train "$config" --run-dir "$run" "${sets[@]}" > "$run.out" 2> "$run.err" || true
  warned=$(grep -c "does not restore" "$run.out" || true)
  if [[ ! -s "$run.err" && $warned == 1 ]]; then
    clean=$((clean + 1))
  else
    echo "run $i: $(wc -l < "$run.err") lines on stderr, $warned warnings; first: $(head -1 "$run.err")"
  fi
  rm -rf "$run"
done
echo "$clean of $runs restarts printed the one warning line and nothing on stderr"
[[ $clean == "$runs" ]]
