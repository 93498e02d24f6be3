"""Planning Mixtral-8x7B over 8 hosts x 8 H100s (issue 13): time, memory, and what expert parallelism moves.

    python bench/moe_plan.py                       # markdown on stdout
    python bench/moe_plan.py --repeats 3 --json bench/out/moe_plan.json

Each case is the real CLI in a fresh process, ``python -m shardmem plan configs/mixtral-8x7b.yaml --target
h100-sxm --json --set mesh.axes.expert=N``, timed as ``bench/plan_bench.py`` times it (wall time around the
process; the child's CPU time and peak RSS from ``os.wait4``; median of the repeats). ``expert=8`` is the
shipped config; smaller expert axes leave the rest of the 64 GPUs to FSDP (``fsdp: -1``), down to
``expert=1``, plain FSDP, where every expert's weights are all-gathered in every layer.

Bar (issue 13): the MoE preset plans for 8 hosts x 8 H100s; like llama-70b's, in under 30 s and 3 GB.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from plan_bench import GB, Case, CaseResult, run_once  # noqa: E402

CONFIG = "configs/mixtral-8x7b.yaml"
GIB = 2**30


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=1)
    parser.add_argument("--json", type=Path, help="also write the results as JSON here")
    args = parser.parse_args()
    results = []
    for expert in (8, 4, 2, 1):
        case = Case(f"expert={expert}", CONFIG, "h100-sxm", (f"mesh.axes.expert={expert}",))
        results.append(CaseResult(case, [run_once(case) for _ in range(args.repeats)]))
    print(
        "| mesh | wall s (median) | CPU s | peak RSS GB | XLA compile s | peak GiB | fits | all-gather GiB "
        "| all-to-all GiB | reduce-scatter GiB | load (1 min) before/after |"
    )
    print("|---|---|---|---|---|---|---|---|---|---|---|")
    for result in results:
        report = result.report
        moved = report.get("collectives", {})
        loads = ", ".join(f"{r.load_before:.1f}/{r.load_after:.1f}" for r in result.runs)
        fsdp = 64 // int(result.case.name.split("=")[1])
        print(f"| fsdp={fsdp} {result.case.name} | {result.wall_s:.1f} | {result.cpu_s:.1f} | "
              f"{result.rss_bytes / GB:.2f} | {report.get('compile_seconds', float('nan')):.1f} | "
              f"{report['per_device']['peak'] / GIB:.2f} | {report.get('fits')} | "
              f"{moved.get('all-gather', 0) / GIB:.2f} | {moved.get('all-to-all', 0) / GIB:.2f} | "
              f"{moved.get('reduce-scatter', 0) / GIB:.2f} | {loads} |")  # fmt: skip
    shipped = results[0]
    ok = shipped.ok and shipped.wall_s < 30 and shipped.rss_bytes < 3 * GB
    print(
        f"\nbar: shipped config plans in {shipped.wall_s:.1f} s (< 30 s), {shipped.rss_bytes / GB:.2f} GB "
        f"(< 3 GB): {'PASS' if ok else 'FAIL'}; cpus: {os.cpu_count()}"
    )
    if args.json:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps([r.summary() | {"collectives": r.report.get("collectives")}
                                         for r in results], indent=2))  # fmt: skip
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
