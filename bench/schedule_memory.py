"""The measured peak of each pipeline schedule as the micro-batches grow, on 8 simulated CPU devices.

    python bench/schedule_memory.py [--micro-batches 4 8 16] [--schedules gpipe 1f1b interleaved]

A tiny Llama (8 layers of width 128, sequences of 128, minimal remat, fp32) over 4 stages x 2 data,
compiled for ``--target local``: micro-batches of one sequence per device, so M micro-batches are a batch
of 2 M. GPipe keeps every tick's residuals until the backward pass, 1F1B at most ``S`` passes' (the
report's ``in_flight``). Prints one markdown row per schedule: the peak and the passes held at each M.
"""

from __future__ import annotations

import argparse

import jax

jax.config.update("jax_num_cpu_devices", 8)

from shardmem.config import config_from_dict  # noqa: E402
from shardmem.planning.memory import plan  # noqa: E402
from shardmem.units import format_bytes  # noqa: E402


def peak(schedule: str, micro_batches: int) -> tuple[int, int]:
    """Returns the planned peak bytes per device and the passes of residuals a stage holds."""
    config = config_from_dict({
        "model": {"preset": "tiny", "n_layers": 8, "d_model": 128, "seq_len": 128},
        "mesh": {"axes": {"stage": 4, "data": 2}},
        "remat": {"policy": "minimal"},
        "precision": {"params": "float32", "compute": "float32"},
        "optimizer": {"name": "sgd", "warmup_steps": 0, "learning_rate": 0.1},
        "train": {"global_batch": 2 * micro_batches, "micro_batches": micro_batches},
        "pipeline": {"schedule": schedule, "repeats": 2 if schedule in ("circular", "interleaved") else 1},
    })  # fmt: skip
    report = plan(config, "local", count_remat_overhead=False)
    return report.per_device["peak"], report.pipeline["in_flight"]


def main() -> None:
    formatter = argparse.RawDescriptionHelpFormatter
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=formatter)
    parser.add_argument("--micro-batches", type=int, nargs="+", default=[4, 8, 16])
    parser.add_argument("--schedules", nargs="+", default=["gpipe", "1f1b", "interleaved"])
    args = parser.parse_args()
    print("| schedule | " + " | ".join(f"M = {m}" for m in args.micro_batches) + " |")
    print("|---|" + "---|" * len(args.micro_batches))
    for schedule in args.schedules:
        cells = [peak(schedule, m) for m in args.micro_batches]
        row = " | ".join(f"{format_bytes(b)} / {n}" for b, n in cells)
        print(f"| {schedule} | {row} |", flush=True)


if __name__ == "__main__":
    main()
