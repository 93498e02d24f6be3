#!/usr/bin/env bash
# The GPU round (issues 5, 14, 33 and 42) on one attached NVIDIA GPU: the single command to give the
# `device` tool, from the repo root.
#
#   device run, timeout_s=600, command:  bash bench/run_gpu_validate.sh
#   PYTHON=.venv/bin/python bash bench/run_gpu_validate.sh --cpu     # the dry run, on a machine without one
#
# What it needs on the GPU machine:
# - python3 (or $PYTHON) with a CUDA-enabled jax/jaxlib, flax (NNX, with nnx.use_eager_sharding), optax,
#   orbax, numpy, PyYAML and rich. The project's default assumption is an install from the registry:
#       python3 -m pip install -q -e '.[cuda12]'
#   This script runs that only when those imports fail: the workplace's H200 image already holds jax,
#   flax and optax and cannot reach a registry, so there it would fail. shardmem itself is used from the
#   source tree (PYTHONPATH), so nothing needs installing when the imports work.
# - Wheels carried in .whl/ (see /work/.library/device/README.md), if any, are installed first into
#   /tmp/site: the way to bring a missing or too old package to a machine without a registry.
# - About 9 minutes (--deadline, 510 s, shared by five parts, each with its own deadline so that one hang
#   costs only its part: gradients 90 s, train 60 s, trials 165 s, GEMMs 45 s, serving 150 s; see
#   gpu_validate.py):
#   a probe; the offload gradient checks (fp32 and today's bf16 program, none vs offload on the GPU); a
#   short `shardmem train` run (its live-memory line); then one fresh child per trial (today's program on
#   llama-7b widths first: remat none and offload, LoRA, QLoRA, cuDNN's sliding window, the other
#   policies; then issue 5's trials, then issue 10's), each planned for the GPU and run, while the
#   deviceless twin plans run on the CPUs beside them; then llama-7b's layer GEMMs at decode and prefill
#   rows against the step-time model (issue 39's short prompts); then serving (skipped where the CLI has no
#   `generate`): prefill and decode of a 128-token prompt at batch 1, at two larger batches and with an int8
#   cache, against `plan --serve`, and `generate` on the GPU
#   against the CPU's tokens. `--autotune-off` adds a local plan without autotuning per trial; `--autotune-results` a
#   deviceless twin plan that loads the GPU's autotune results (issue 14). Results go to $OUT
#   (gpu_validate.md: the tables and bars to paste into BENCHMARKS.md; gpu_validate.json;
#   gpu_validate.log) after every piece, so a run cut short keeps what it measured.
set -uo pipefail
cd "$(dirname "$0")/.."
export PYTHONUNBUFFERED=1
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"
OUT="${OUT:-bench/out}"
mkdir -p "$OUT"
LOG="$OUT/gpu_validate.log"
PYTHON="${PYTHON:-python3}"

if compgen -G ".whl/*.whl" >/dev/null; then
  "$PYTHON" -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site \
    .whl/*.whl && export PYTHONPATH="/tmp/site${PYTHONPATH:+:$PYTHONPATH}"
fi
if ! "$PYTHON" -c "import jax, flax, optax, orbax.checkpoint, yaml, rich; from flax import nnx; nnx.use_eager_sharding" \
  2>>"$LOG"; then
  echo "imports failed; installing: $PYTHON -m pip install -q -e '.[cuda12]'" | tee -a "$LOG"
  "$PYTHON" -m pip install -q -e '.[cuda12]' 2>&1 | tee -a "$LOG"
fi
{
  "$PYTHON" -c "import jax, flax, optax; print('jax', jax.__version__, 'flax', flax.__version__, 'optax', optax.__version__)"
  if command -v nvidia-smi >/dev/null; then
    nvidia-smi --query-gpu=name,memory.total,memory.used,driver_version --format=csv,noheader
  fi
} 2>&1 | tee -a "$LOG"

"$PYTHON" bench/gpu_validate.py --out "$OUT" "$@" 2>&1 | tee -a "$LOG"
