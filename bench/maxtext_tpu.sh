#!/usr/bin/env bash
# MaxText's train_compile against shardmem's plan: Llama-2-7B on a v5p-8 (4 chips), FSDP, compiled
# deviceless by the same JAX and libtpu on both sides (issue 21; results in BENCHMARKS.md).
#
#   MAXTEXT_PY=/path/to/maxtext-venv/bin/python bash bench/maxtext_tpu.sh [full|minimal]
#
# MaxText lives in a venv of its own, outside the repo (it needs Python >= 3.12):
#   python3.12 -m venv /work/maxtext-venv
#   /work/maxtext-venv/bin/pip install "maxtext[tpu]==0.2.5" "libtpu==0.0.50.1"
# (maxtext[tpu] pulls jax 0.12.0.1 and the newest libtpu; jax[tpu] 0.12.0.1 pins libtpu 0.0.50.*, which
# shardmem's .venv-newest has: bash scripts/setup.sh --newest.) Prints both peaks per chip, then the
# buffers live at each peak side by side (BUFFERS=0 skips that second shardmem compile).
set -euo pipefail
cd "$(dirname "$0")/.."
policy=${1:-full}
maxtext_py=${MAXTEXT_PY:?set MAXTEXT_PY to the python of the MaxText venv}
shardmem_venv=${SHARDMEM_VENV:-.venv-newest}
out=${OUT:-$(mktemp -d -t shardmem-maxtext-XXXX)}
config=bench/maxtext/llama2-7b-v5p-8.yaml
export JAX_PLATFORMS=cpu
mkdir -p "$out"

echo "MaxText $("$maxtext_py" -c 'from importlib.metadata import version as v; print(v("maxtext"), "jax", v("jax"), "libtpu", v("libtpu"))')"
"$maxtext_py" bench/maxtext_train_compile.py \
  compile_topology=v5p-8 compile_topology_num_slices=1 model_name=llama2-7b \
  per_device_batch_size=4 max_target_length=2048 ici_fsdp_parallelism=-1 \
  weight_dtype=float32 dtype=bfloat16 opt_type=adamw remat_policy="$policy" \
  attention=dot_product float32_logits=false dataset_type=synthetic enable_checkpointing=false \
  jax_cache_dir= base_output_directory="$out/maxtext" run_name=llama2-7b-v5p-8 \
  compile_xla_flags="--xla_dump_to=$out/maxtext-dump" > "$out/maxtext.log" 2> "$out/maxtext.err" \
  || { tail -20 "$out/maxtext.err"; exit 1; }
grep -E "^(Memory analysis|MEMORY_STATS_JSON)" "$out/maxtext.log"

echo "shardmem $("$shardmem_venv/bin/python" -c 'from importlib.metadata import version as v; print(v("shardmem"), "jax", v("jax"), "libtpu", v("libtpu"))')"
status=0
"$shardmem_venv/bin/shardmem" plan "$config" --target v5p-8 --set remat.policy="$policy" --json \
  > "$out/shardmem.json" || status=$?
[ "$status" -le 3 ] || exit "$status"  # 3: does not fit, still a plan

"$shardmem_venv/bin/python" - "$out/shardmem.json" "$out/maxtext.log" <<'PY'
import json, sys
ours = json.load(open(sys.argv[1]))["per_device"]
line = next(l for l in open(sys.argv[2]) if l.startswith("MEMORY_STATS_JSON "))
theirs = json.loads(line.removeprefix("MEMORY_STATS_JSON "))
total = lambda a, o, t, x: a + o + t - x
mt_total = total(theirs["argument_size_in_bytes"], theirs["output_size_in_bytes"],
                 theirs["temp_size_in_bytes"], theirs["alias_size_in_bytes"])
sm_total = total(ours["params"] + ours["optimizer"] + ours["batch"], ours["outputs"], ours["temp"], ours["alias"])
g = 2**30
print(f"peak per chip (XLA's peak_memory_in_bytes): shardmem {ours['peak'] / g:.3f} GiB, "
      f"MaxText {theirs['peak_memory_in_bytes'] / g:.3f} GiB "
      f"({(theirs['peak_memory_in_bytes'] - ours['peak']) / ours['peak']:+.2%})")
print(f"argument + output + temp - alias (MaxText's 'Total estimated memory size'): shardmem "
      f"{sm_total / g:.3f} GiB, MaxText {mt_total / g:.3f} GiB ({(mt_total - sm_total) / sm_total:+.2%})")
PY

if [ "${BUFFERS:-1}" != 0 ]; then
  "$shardmem_venv/bin/python" bench/maxtext_compare.py "$config" --target v5p-8 --set remat.policy="$policy" \
    --maxtext-log "$out/maxtext.log" --maxtext-dump "$out/maxtext-dump" --json "$out/compare.json"
fi
echo "outputs in $out"
