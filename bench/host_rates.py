"""How much do CPU plans' step times move from run to run? (issue 30, item 13)

    python bench/host_rates.py                  # 6 fresh processes
    python bench/host_rates.py --runs 10

CPU-target plans cost the step with this machine's matmul rate and copy bandwidth, measured once per
process (shardmem.planning.cost.measure_host_rates); every other figure of the plan is the compiled HLO's,
the same from run to run, so the spread of the rates is the spread of the predicted CPU step times. Each
run is a fresh process that measures the matmul rate two ways: shardmem's (the best of 5 back-to-back
runs) and the best of as many runs as fit in 0.25 s (at least 5), a candidate for a steadier figure. It
prints both per run and their spread (max / min). A search's workers take the parent's rates
(SHARDMEM_HOST_RATES), so the candidates of one search are costed alike whatever the spread.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys

os.environ.setdefault("JAX_PLATFORMS", "cpu")

CHILD = r"""
import json, time
import jax, jax.numpy as jnp
from shardmem.planning import cost

device = jax.devices("cpu")[0]
a = jax.device_put(jnp.ones((1024, 1024), jnp.float32), device)
matmul = jax.jit(lambda a: a @ a)
matmul(a).block_until_ready()

def best(runs=5, seconds=0.0):
    times, deadline = [], time.perf_counter() + seconds
    while len(times) < runs or time.perf_counter() < deadline:
        start = time.perf_counter()
        matmul(a).block_until_ready()
        times.append(time.perf_counter() - start)
    return 2 * 1024**3 / min(times) / cost.MATMUL_EFFICIENCY

flops, bandwidth = cost.measure_host_rates()
print(json.dumps({"best_of_5": flops, "best_in_window": best(seconds=0.25), "copy": bandwidth}))
"""


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--runs", type=int, default=6)
    args = parser.parse_args()
    env = {k: v for k, v in os.environ.items() if k != "SHARDMEM_HOST_RATES"}
    rows = []
    for i in range(args.runs):
        out = subprocess.run([sys.executable, "-c", CHILD], capture_output=True, text=True, env=env)
        row = json.loads(out.stdout.strip().splitlines()[-1])
        rows.append(row)
        print(f"run {i + 1}: best of 5 {row['best_of_5'] / 1e9:7.1f} GFLOP/s   best in 0.25 s "
              f"{row['best_in_window'] / 1e9:7.1f} GFLOP/s   copy {row['copy'] / 1e9:6.1f} GB/s",
              flush=True)  # fmt: skip
    for key, name in (("best_of_5", "best of 5"), ("best_in_window", "best in 0.25 s"), ("copy", "copy")):
        values = [r[key] for r in rows]
        print(f"{name:>15}: median {statistics.median(values) / 1e9:.1f} G/s, max / min "
              f"{max(values) / min(values):.2f}")  # fmt: skip
    print(f"load average {os.getloadavg()[0]:.1f}")


if __name__ == "__main__":
    main()
