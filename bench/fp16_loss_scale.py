"""float16 with a dynamic loss scale against bfloat16 and float32: the tiny model trained 300 steps on
8 simulated CPU devices, the same data and initialisation in every run.

    python bench/fp16_loss_scale.py [--steps 300] [--runs bfloat16:auto float16:auto float16:none]

Each run is ``configs/tiny.yaml`` with ``precision.compute`` and ``precision.loss_scale`` set; the step is
the one ``shardmem train`` runs (``build_program``), without its checkpoints. Prints one markdown row per
run: the loss at the last step, the mean over the last 20 steps (the batches differ from step to step, so
one step's loss is noisy), its ratio to the first run's, and the loss scale and skipped steps at the end.
"""

from __future__ import annotations

import argparse
import os
import time

import jax

jax.config.update("jax_num_cpu_devices", 8)

import numpy as np  # noqa: E402

import shardmem  # noqa: E402
from shardmem.parallel.mesh import build_mesh  # noqa: E402
from shardmem.program import build_program  # noqa: E402
from shardmem.run.data import batch_stream  # noqa: E402

LAST = 20


def run(compute: str, loss_scale: str, steps: int) -> dict:
    overrides = [f"precision.compute={compute}", f"precision.loss_scale={loss_scale}", f"train.steps={steps}"]
    config = shardmem.load_config("configs/tiny.yaml", overrides=overrides)
    program = build_program(config, build_mesh(config.mesh.axes, jax.devices()))
    source, state = batch_stream(config, program), program.init()
    losses, start = [], time.perf_counter()
    for step in range(steps):
        state, metrics = program.step(state, source(step))
        # One step in flight at a time, as shardmem train keeps it: hundreds queued on simulated CPU
        # devices can starve a collective's rendezvous past XLA's 40 s timeout on a loaded machine.
        losses.append(float(metrics["loss"]))
    metrics = jax.device_get(metrics)
    return {
        "losses": losses,
        "loss_scale": float(metrics.get("loss_scale", float("nan"))),
        "skipped": int(metrics.get("skipped_steps", 0)),
        "seconds": time.perf_counter() - start,
    }


def main() -> None:
    formatter = argparse.RawDescriptionHelpFormatter
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=formatter)
    parser.add_argument("--steps", type=int, default=300)
    parser.add_argument("--runs", nargs="+", default=["bfloat16:auto", "float16:auto", "float16:none"])
    args = parser.parse_args()
    print(f"load average at start: {os.getloadavg()[0]:.1f}, JAX {jax.__version__}")
    print(f"| compute | loss_scale | loss at step {args.steps} | mean of the last {LAST} | vs the first run "
          "| loss scale at the end | skipped steps | wall time |")  # fmt: skip
    print("|---|---|---|---|---|---|---|---|")
    reference = None
    for item in args.runs:
        compute, _, loss_scale = item.partition(":")
        result = run(compute, loss_scale or "auto", args.steps)
        mean = float(np.mean(result["losses"][-LAST:]))
        reference = reference or mean
        scale = "-" if np.isnan(result["loss_scale"]) else f"{result['loss_scale']:g}"
        print(f"| {compute} | {loss_scale} | {result['losses'][-1]:.4f} | {mean:.4f} "
              f"| {mean / reference - 1:+.1%} | {scale} | {result['skipped']} | {result['seconds']:.0f} s |",
              flush=True)  # fmt: skip


if __name__ == "__main__":
    main()
