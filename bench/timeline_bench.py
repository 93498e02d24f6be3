"""Memory timeline benchmark for issue 12: what drawing the plan costs, and whether its peak is the report's.

    python bench/timeline_bench.py            # markdown table on stdout

For each shipped config on a deviceless GPU target it plans the step once (in this process), then times
reading the step's buffers from XLA's dump (``buffer_schedule``, which every plan now does), building the
timeline, writing the HTML page and writing the PNG. It also prints the timeline's peak next to the
report's (XLA's ``peak_memory_in_bytes``) and the buffers listed as live at the peak, whose sum must not
exceed it. The 1-minute load average is printed: on a shared machine the timings stretch.
"""

from __future__ import annotations

import os
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
CASES = [("gpt2-124m", "a100-40g"), ("llama-1b", "h100-sxm"), ("llama-7b", "h100-sxm"),
         ("llama-70b", "a100-40g")]  # fmt: skip


def main() -> int:
    sys.path.insert(0, str(ROOT))
    import shardmem
    from shardmem.planning import hlo, memory

    seen: dict[str, float] = {}
    original = hlo.buffer_schedule

    def timed(dump_dir):  # Times the dump reading inside the real plan.
        start = time.perf_counter()
        schedule = original(dump_dir)
        seen["schedule_s"] = time.perf_counter() - start
        return schedule

    memory.hlo.buffer_schedule = timed
    print(
        "| config / target | plan s | read buffers s | timeline s | HTML s | PNG s | positions | buffers "
        "| report peak | timeline peak | difference | listed at peak (top 10) | load before/after |"
    )
    print("|---|---|---|---|---|---|---|---|---|---|---|---|---|")
    with tempfile.TemporaryDirectory() as out:
        for name, target in CASES:
            load = os.getloadavg()[0]
            start = time.perf_counter()
            report = shardmem.plan(shardmem.load_config(ROOT / "configs" / f"{name}.yaml"), target=target)
            plan_s = time.perf_counter() - start
            start = time.perf_counter()
            figure = shardmem.timeline(report)
            build_s = time.perf_counter() - start
            start = time.perf_counter()
            figure.save_html(Path(out) / "t.html")
            html_s = time.perf_counter() - start
            start = time.perf_counter()
            figure.save_png(Path(out) / "t.png")
            png_s = time.perf_counter() - start
            peak = report.per_device["peak"]
            listed = sum(b.bytes for b in report.top_buffers)
            read_s = seen["schedule_s"]
            print(f"| {name} / {target} | {plan_s:.1f} | {read_s:.2f} | {build_s:.2f} | {html_s:.2f} "
                  f"| {png_s:.2f} | {report.schedule.length} | {len(report.schedule.buffers)} | {peak:,} "
                  f"| {figure.peak_bytes:,} | {figure.peak_bytes - peak:+,} B | {listed / peak:.1%} of peak "
                  f"| {load:.1f}/{os.getloadavg()[0]:.1f} |", flush=True)  # fmt: skip
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
