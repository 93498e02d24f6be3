"""Planning benchmarks for issue 2: how long ``shardmem plan`` takes, and how much memory, on this machine.

    python bench/plan_bench.py                      # all cases, 3 runs each, markdown on stdout
    python bench/plan_bench.py --repeats 5 --json bench/out/plan_bench.json

Each run is the real CLI in a fresh process (``python -m shardmem plan CONFIG --target T --json``), so the
figures include Python and JAX start-up, tracing, XLA's deviceless GPU compile and the report: what a user
waits for. Wall time is measured around the process; CPU time (user + system) and peak resident memory
(``ru_maxrss``) are the child's own, from ``os.wait4`` (``RUSAGE_CHILDREN`` would give the maximum RSS over
every child so far, not this one's). The median of the repeats is compared with the bars:

- llama-70b over 64 H100s: under 30 s and under 3 GB (3e9 bytes) resident;
- llama-7b over 8 H100s: under 15 s;
- depth: planning llama-7b widths at 80 layers takes at most 1.25x the time at 8 layers;
- remat: on llama-7b over 8 H100s, temporaries fall by at least 60% from ``remat.policy=none`` to ``full``
  (with ``remat.layers={}`` so that every layer follows the policy);
- issue 10: llama-7b over 8 H100s with ``remat.policy=none`` plans at most 70 GiB per device (flash
  attention, the lean layer) and compiles in under 15 s; Llama-3.2-1B (vocabulary 128,256), sequences of
  2,048, global batch 16, FSDP over 8 H100s, no remat: the chunked loss lowers the peak by at least the
  fp32 logits (2 sequences x 2,048 x 128,256 x 4 bytes per device).
- issue 20: llama-70b over 64 H100s under 5 s idle; llama-405b widths over 1,024 H100s under 10 s (measured,
  not a bar here, since they hold only on an idle machine: BENCHMARKS.md, "Planning speed", has the idle
  runs with ``SHARDMEM_KERNEL_CACHE=off``, 4.8 s and 7.3 s);
- issue 13: llama-70b over 64 H100s with ``stage: 8`` (``configs/llama-70b-pipeline.yaml``) plans in under
  30 s and 3 GB resident, and its bubble is (stages - 1) / (micro-batches + stages - 1).

The 1-minute load average is recorded before and after each run: the machine may be shared, and a
contended run should be repeated, not reported. CPU time is shown beside wall time because it moves
less when other work competes for the cores.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import platform
import shlex
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
GB = 1e9


@dataclasses.dataclass(frozen=True)
class Case:
    """One ``shardmem plan`` invocation to time."""

    name: str
    config: str
    target: str
    overrides: tuple[str, ...] = ()

    def argv(self) -> list[str]:
        sets = [arg for item in self.overrides for arg in ("--set", item)]
        command = ["-m", "shardmem", "plan", self.config, "--target", self.target, "--json"]
        return [sys.executable, *command, *sets]


UNIFORM = ("remat.layers={}",)  # Every layer follows remat.policy.
LLAMA_1B = ("model.seq_len=2048", "train.global_batch=16", "remat.policy=none", *UNIFORM)
CASES = (
    Case("llama-70b / 64 x H100", "configs/llama-70b.yaml", "h100-sxm"),
    Case("llama-7b / 8 x H100", "configs/llama-7b.yaml", "h100-sxm"),
    Case("llama-7b widths, 8 layers, full", "configs/llama-7b.yaml", "h100-sxm",
         ("model.n_layers=8", "remat.policy=full", *UNIFORM)),
    Case("llama-7b widths, 80 layers, full", "configs/llama-7b.yaml", "h100-sxm",
         ("model.n_layers=80", "remat.policy=full", *UNIFORM)),
    Case("llama-7b / 8 x H100, remat none", "configs/llama-7b.yaml", "h100-sxm",
         ("remat.policy=none", *UNIFORM)),
    Case("llama-7b / 8 x H100, remat full", "configs/llama-7b.yaml", "h100-sxm",
         ("remat.policy=full", *UNIFORM)),
    Case("llama-1b / 8 x H100, seq 2048, loss whole", "configs/llama-1b.yaml", "h100-sxm",
         (*LLAMA_1B, "model.loss_chunk=null")),
    Case("llama-1b / 8 x H100, seq 2048, loss chunked", "configs/llama-1b.yaml", "h100-sxm",
         (*LLAMA_1B, "model.loss_chunk=auto")),
    Case("llama-70b / 64 x H100, stage 8", "configs/llama-70b-pipeline.yaml", "h100-sxm"),
)  # fmt: skip
# Llama-3.1-405B widths over 128 hosts x 8 H100s (1,024 devices), from the 70B config's layout (issue 20).
LLAMA_405B = ("model.d_model=16384", "model.n_layers=126", "model.n_heads=128", "model.n_kv_heads=8",
              "model.d_ff=53248", "model.vocab_size=128256", "mesh.hosts=128",
              "train.global_batch=1024")  # fmt: skip
CASES += (Case("llama-405b widths / 1,024 x H100", "configs/llama-70b.yaml", "h100-sxm", LLAMA_405B),)
LOGITS_1B = 2 * 2048 * 128256 * 4  # fp32 logits per device: 16 sequences over fsdp 8.


@dataclasses.dataclass
class Run:
    wall_s: float
    cpu_s: float  # User + system time of the process: less sensitive than wall time to a busy machine.
    max_rss_bytes: int
    exit_code: int
    load_before: float
    load_after: float
    report: dict | None
    stderr_tail: str


def run_once(case: Case) -> Run:
    """Runs the CLI once in a fresh process; returns its wall time, peak RSS and parsed JSON report."""
    with tempfile.TemporaryFile() as out, tempfile.TemporaryFile() as err:
        load_before = os.getloadavg()[0]
        start = time.perf_counter()
        proc = subprocess.Popen(case.argv(), cwd=ROOT, stdout=out, stderr=err)
        _, status, usage = os.wait4(proc.pid, 0)
        wall = time.perf_counter() - start
        proc.returncode = os.waitstatus_to_exitcode(status)  # Reaped here; keep Popen consistent.
        load_after = os.getloadavg()[0]
        out.seek(0)
        err.seek(0)
        stdout, stderr = out.read().decode(), err.read().decode()
    report = None
    if proc.returncode in (0, 3):  # 0: fits, 3: does not fit; both print the JSON report.
        report = json.loads(stdout)
    # Linux reports ru_maxrss in KiB.
    cpu = usage.ru_utime + usage.ru_stime
    return Run(wall, cpu, usage.ru_maxrss * 1024, proc.returncode, load_before, load_after, report,
               stderr.strip()[-2000:])  # fmt: skip


@dataclasses.dataclass
class CaseResult:
    case: Case
    runs: list[Run]

    @property
    def ok(self) -> bool:
        return all(r.report is not None for r in self.runs)

    @property
    def wall_s(self) -> float:
        return statistics.median(r.wall_s for r in self.runs)

    @property
    def cpu_s(self) -> float:
        return statistics.median(r.cpu_s for r in self.runs)

    @property
    def rss_bytes(self) -> float:
        return statistics.median(r.max_rss_bytes for r in self.runs)

    @property
    def report(self) -> dict:
        return self.runs[-1].report or {}

    def summary(self) -> dict:
        report = self.report
        return {
            "case": self.case.name,
            "command": shlex.join(["python", *self.case.argv()[1:]]),
            "ok": self.ok,
            "wall_s_median": round(self.wall_s, 2),
            "wall_s_runs": [round(r.wall_s, 2) for r in self.runs],
            "cpu_s_runs": [round(r.cpu_s, 2) for r in self.runs],
            "max_rss_bytes_median": int(self.rss_bytes),
            "max_rss_bytes_runs": [r.max_rss_bytes for r in self.runs],
            "exit_codes": [r.exit_code for r in self.runs],
            "load_1min": [[round(r.load_before, 2), round(r.load_after, 2)] for r in self.runs],
            "compile_seconds": [r.report.get("compile_seconds") if r.report else None for r in self.runs],
            "per_device": report.get("per_device"),
            "fits": report.get("fits"),
            "remat": report.get("remat"),
            "pipeline": report.get("pipeline"),
            "errors": [r.stderr_tail for r in self.runs if r.report is None],
        }


@dataclasses.dataclass
class Bar:
    name: str
    measured: str
    limit: str
    passed: bool | None  # None: could not be measured (a run failed).


def check_bars(results: dict[str, CaseResult]) -> list[Bar]:
    """Compares the medians with issue 2's bars."""
    r70, r7 = results.get(CASES[0].name), results.get(CASES[1].name)
    shallow, deep = results.get(CASES[2].name), results.get(CASES[3].name)
    none, full = results.get(CASES[4].name), results.get(CASES[5].name)
    bars = []

    def usable(*items):
        return all(item is not None and item.ok for item in items)

    if usable(r70):
        bars.append(Bar("llama-70b / 64 x H100: wall time", f"{r70.wall_s:.1f} s", "< 30 s", r70.wall_s < 30))
        bars.append(Bar("llama-70b / 64 x H100: peak resident memory", f"{r70.rss_bytes / GB:.2f} GB",
                        "< 3 GB", r70.rss_bytes < 3 * GB))  # fmt: skip
    else:
        bars.append(Bar("llama-70b / 64 x H100", "not run or failed", "< 30 s, < 3 GB", None))
    if usable(r7):
        bars.append(Bar("llama-7b / 8 x H100: wall time", f"{r7.wall_s:.1f} s", "< 15 s", r7.wall_s < 15))
    else:
        bars.append(Bar("llama-7b / 8 x H100: wall time", "not run or failed", "< 15 s", None))
    if usable(shallow, deep):
        ratio = deep.wall_s / shallow.wall_s
        bars.append(Bar("planning time, 80 layers / 8 layers",
                        f"{ratio:.2f}x ({deep.wall_s:.1f} s / {shallow.wall_s:.1f} s)", "<= 1.25x",
                        ratio <= 1.25))  # fmt: skip
    else:
        bars.append(Bar("planning time, 80 layers / 8 layers", "not run or failed", "<= 1.25x", None))
    if usable(none, full):
        temp_none, temp_full = none.report["per_device"]["temp"], full.report["per_device"]["temp"]
        drop = 1 - temp_full / temp_none
        bars.append(Bar("llama-7b temporaries, remat none -> full",
                        f"-{drop:.1%} ({temp_none / 2**30:.2f} GiB -> {temp_full / 2**30:.2f} GiB)",
                        ">= 60% less", drop >= 0.6))  # fmt: skip
    else:
        bars.append(Bar("llama-7b temporaries, remat none -> full", "not run or failed", ">= 60% less", None))
    if usable(none):
        peak, compile_s = none.report["per_device"]["peak"], none.report["compile_seconds"]
        bars.append(Bar("llama-7b / 8 x H100, remat none: peak (issue 10)", f"{peak / 2**30:.2f} GiB",
                        "<= 70 GiB", peak <= 70 * 2**30))  # fmt: skip
        bars.append(Bar("llama-7b / 8 x H100, remat none: compile (issue 10)", f"{compile_s:.1f} s", "< 15 s",
                        compile_s < 15))  # fmt: skip
    whole, chunked = results.get(CASES[6].name), results.get(CASES[7].name)
    if usable(whole, chunked):
        drop = whole.report["per_device"]["peak"] - chunked.report["per_device"]["peak"]
        bars.append(Bar("llama-1b peak, loss whole -> chunked (issue 10)",
                        f"-{drop / 2**30:.2f} GiB ({whole.report['per_device']['peak'] / 2**30:.2f} -> "
                        f"{chunked.report['per_device']['peak'] / 2**30:.2f} GiB)",
                        f">= {LOGITS_1B / 2**30:.2f} GiB (fp32 logits)", drop >= LOGITS_1B))  # fmt: skip
    else:
        bars.append(Bar("llama-1b peak, loss whole -> chunked (issue 10)", "not run or failed", "", None))
    staged = results.get(CASES[8].name)
    if usable(staged):
        pipeline = staged.report["pipeline"]
        stages, micro = pipeline["stages"], pipeline["micro_batches"]
        gpipe = (stages - 1) / (micro + stages - 1)
        bars.append(Bar("llama-70b / 64 x H100, stage 8: wall time (issue 13)", f"{staged.wall_s:.1f} s",
                        "< 30 s", staged.wall_s < 30))  # fmt: skip
        bars.append(Bar("llama-70b / 64 x H100, stage 8: peak resident memory (issue 13)",
                        f"{staged.rss_bytes / GB:.2f} GB", "< 3 GB", staged.rss_bytes < 3 * GB))  # fmt: skip
        formula = f"({stages}-1)/({micro}+{stages}-1) = {gpipe:.4f}"
        bars.append(Bar("llama-70b, stage 8: bubble in the report (issue 13)",
                        f"{pipeline['bubble_fraction']:.4f}", formula,
                        abs(pipeline["bubble_fraction"] - gpipe) < 1e-12))  # fmt: skip
    else:
        bars.append(Bar("llama-70b / 64 x H100, stage 8 (issue 13)", "not run or failed", "< 30 s, < 3 GB",
                        None))  # fmt: skip
    return bars


def markdown(results: dict[str, CaseResult], bars: list[Bar], repeats: int) -> str:
    lines = [
        f"| case | wall s (median of {repeats}) | runs, s | CPU s (median) | peak RSS GB (median) "
        "| XLA compile s | per-device peak GiB | temp GiB | fits | load (1 min) before/after |",
        "|---|---|---|---|---|---|---|---|---|---|",
    ]
    for result in results.values():
        runs = ", ".join(f"{r.wall_s:.1f}" for r in result.runs)
        loads = ", ".join(f"{r.load_before:.1f}/{r.load_after:.1f}" for r in result.runs)
        if result.ok:
            per_device = result.report["per_device"]
            compile_s = statistics.median(r.report["compile_seconds"] for r in result.runs)
            lines.append(
                f"| {result.case.name} | {result.wall_s:.1f} | {runs} | {result.cpu_s:.1f} "
                f"| {result.rss_bytes / GB:.2f} "
                f"| {compile_s:.1f} | {per_device['peak'] / 2**30:.2f} | {per_device['temp'] / 2**30:.2f} "
                f"| {result.report['fits']} | {loads} |"
            )
        else:
            codes = ", ".join(str(r.exit_code) for r in result.runs)
            lines.append(f"| {result.case.name} | failed (exit {codes}) | {runs} | | | | | | | {loads} |")
    lines += ["", "| bar | measured | required | result |", "|---|---|---|---|"]
    for bar in bars:
        verdict = {True: "PASS", False: "FAIL", None: "NOT MEASURED"}[bar.passed]
        lines.append(f"| {bar.name} | {bar.measured} | {bar.limit} | {verdict} |")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--repeats", type=int, default=3, help="runs per case (the median is reported)")
    parser.add_argument("--only", action="append", default=[], metavar="TEXT",
                        help="run only cases whose name contains TEXT (repeatable)")  # fmt: skip
    parser.add_argument("--json", type=Path, help="also write the raw results here")
    args = parser.parse_args(argv)

    cases = [c for c in CASES if not args.only or any(text in c.name for text in args.only)]
    print(f"# {platform.node()}: {os.cpu_count()} CPUs, Python {platform.python_version()}, "
          f"load {os.getloadavg()[0]:.2f}", file=sys.stderr)  # fmt: skip
    results: dict[str, CaseResult] = {}
    for case in cases:
        runs = []
        for i in range(args.repeats):
            run = run_once(case)
            runs.append(run)
            print(f"{case.name} [{i + 1}/{args.repeats}]: {run.wall_s:.1f} s ({run.cpu_s:.1f} s CPU), "
                  f"{run.max_rss_bytes / GB:.2f} GB, exit {run.exit_code}, "
                  f"load {run.load_before:.1f}->{run.load_after:.1f}", file=sys.stderr)  # fmt: skip
            if run.report is None:
                print(run.stderr_tail, file=sys.stderr)
        results[case.name] = CaseResult(case, runs)

    bars = check_bars(results)
    print(markdown(results, bars, args.repeats))
    if args.json:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        payload = {
            "machine": {"cpus": os.cpu_count(), "python": platform.python_version()},
            "repeats": args.repeats,
            "cases": [r.summary() for r in results.values()],
            "bars": [dataclasses.asdict(b) for b in bars],
        }
        args.json.write_text(json.dumps(payload, indent=2) + "\n")
    measured = [b.passed for b in bars if b.passed is not None]
    return 0 if measured and all(measured) and len(measured) == len(bars) else 1


if __name__ == "__main__":
    sys.exit(main())
