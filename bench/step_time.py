"""Predicted against measured step times: the H200 trials of BENCHMARKS.md (issue 5), replanned deviceless
for `h200` with the kernels they ran (plain attention, the loss in one piece; bench/gpu_validate.py).

    python bench/step_time.py                 # every trial, a table for BENCHMARKS.md
    python bench/step_time.py --only 1b-none  # one
    python bench/step_time.py --measured bench/out/gpu_validate.json   # a GPU round's steps, replanned here

The measured figures are the H200's (JAX 0.11.2, default allocator where it ran, else the first call's
`XLA_PYTHON_CLIENT_PREALLOCATE=false`): median step milliseconds of 5 steps, from BENCHMARKS.md's
"GPU validation (issue 5)" tables; with ``--measured``, those of a `bench/gpu_validate.py` run (issue 33:
every trial that ran), whose own table compares them with the twin planned on the GPU machine's JAX,
while this replans them with the JAX installed here.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from pathlib import Path

os.environ.setdefault("JAX_PLATFORMS", "cpu")
sys.path.insert(0, str(Path(__file__).resolve().parent))

import gpu_validate as gv  # noqa: E402

#: Measured ms per step on the lent H200 (BENCHMARKS.md, GPU validation, issue 5).
MEASURED_MS = {
    "1b-none": 17.4,
    "1b-minimal": 199.0,
    "1b-full-micro2": 727.2,
    "1b-offload": 298.0,
    "7bw-none-fits": 287.8,
    "7bw-full": 2662.2,
    "7bw-minimal": 618.2,
    "7bw-offload": 697.9,
}


def measured_from(path: Path) -> dict[str, float]:
    """Median step milliseconds of every trial that ran in a ``bench/gpu_validate.py`` run's JSON."""
    rows = json.loads(path.read_text())["rows"]
    return {row["trial"]: row["measured"]["step_s_median"] * 1e3 for row in rows
            if row["measured"].get("status") == "ok" and row["measured"].get("step_s_median")}  # fmt: skip


def predict(trial: gv.Trial, target: str) -> dict:
    from shardmem import load_config, plan

    config = load_config(trial.config, list(trial.overrides))
    start = time.perf_counter()
    report = plan(config, target)
    st = report.step_time
    return {"trial": trial.name, "plan_seconds": time.perf_counter() - start, **st.to_json(),
            "peak_bytes": report.per_device["peak"]}  # fmt: skip


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--only", action="append", default=[], help="trial name (repeatable)")
    parser.add_argument("--target", default="h200")
    parser.add_argument("--json", help="write the rows here")
    parser.add_argument("--measured", help="take the measured steps from this gpu_validate.json")
    args = parser.parse_args(argv)
    measured_ms = MEASURED_MS if not args.measured else measured_from(Path(args.measured))
    trials = [t for t in gv.GPU_TRIALS if t.name in measured_ms and (not args.only or t.name in args.only)]
    rows = []
    print(
        "| trial | measured ms | predicted ms | error | compute | memory-bound | launch | exposed comm "
        "| host (exposed) | no-overlap / full-overlap ms | MFU predicted |"
    )
    print("|---|---|---|---|---|---|---|---|---|---|---|")
    for trial in trials:
        row = predict(trial, args.target)
        measured = measured_ms[trial.name] / 1e3
        row["measured_seconds"] = measured
        row["error"] = row["seconds"] / measured - 1
        rows.append(row)
        b = row["breakdown"]
        ms = lambda s: f"{s * 1e3:.1f}"  # noqa: E731
        print(f"| {trial.name} | {ms(measured)} | {ms(row['seconds'])} | {row['error']:+.1%} "
              f"| {ms(b['compute'])} "
              f"| {ms(b['memory_bound'])} | {ms(b['launch'])} | {ms(b['exposed_communication'])} "
              f"| {ms(b['exposed_host_transfers'])} | {ms(row['bounds']['no_overlap'])} / "
              f"{ms(row['bounds']['full_overlap'])} | {row['mfu']:.1%} |", flush=True)  # fmt: skip
    errors = [abs(r["error"]) for r in rows]
    if errors:
        print(
            f"\nmedian |error| {statistics.median(errors):.1%}, worst {max(errors):.1%} "
            f"over {len(rows)} trials"
        )
    if args.json:
        Path(args.json).write_text(json.dumps(rows, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
