"""Context parallelism for Llama-2-7B on 8 x H100 (deviceless): peak per device at 8k and 32k tokens per
sequence with context 1, 2, 4 and 8, at the same global batch of 8 sequences.

    python bench/context_plan.py [--seq 8192 32768] [--context 1 2 4 8]

Each point plans ``configs/llama-7b-long.yaml`` with ``mesh.axes.context=C``, FSDP over the other
``8 / C`` devices and ``train.micro_batches=C``: each micro-batch holds one sequence per FSDP group, so a
device holds ``1 / C`` of one sequence (context 1: one whole sequence). Prints one markdown row per point.
"""

from __future__ import annotations

import argparse
import os
import time

import shardmem
from shardmem.units import format_bytes


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--seq", type=int, nargs="+", default=[8192, 32768])
    parser.add_argument("--context", type=int, nargs="+", default=[1, 2, 4, 8])
    args = parser.parse_args()
    print(f"load average at start: {os.getloadavg()[0]:.1f}")
    columns = [
        "seq",
        "context",
        "micro-batches",
        "tokens per device",
        "peak",
        "fits",
        "all-gather",
        "compile s",
    ]
    print("| " + " | ".join(columns) + " |\n" + "|---" * len(columns) + "|")
    for seq in args.seq:
        for context in args.context:
            config = shardmem.load_config("configs/llama-7b-long.yaml", [
                f"model.seq_len={seq}", f"mesh.axes.context={context}", "mesh.axes.fsdp=-1",
                f"train.micro_batches={context}"])  # fmt: skip
            start = time.perf_counter()
            report = shardmem.plan(config, count_remat_overhead=False)
            seconds = time.perf_counter() - start
            peak, gathered = (
                format_bytes(x) for x in (report.per_device["peak"], report.collectives["all-gather"])
            )
            fits = "yes" if report.fits else "no"
            cells = [seq, context, context, seq // context, peak, fits, gathered,
                     f"{report.compile_seconds:.1f} ({seconds:.1f} with tracing)"]  # fmt: skip
            print("| " + " | ".join(str(c) for c in cells) + " |", flush=True)


if __name__ == "__main__":
    main()
