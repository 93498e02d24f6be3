"""Where the time of ``shardmem plan`` goes, and whether an XLA option saves any of it without changing the
plan (issue 20).

    python bench/plan_speed.py phases configs/llama-70b.yaml --repeats 3
    python bench/plan_speed.py phases configs/llama-70b.yaml --405b        # Llama-3.1-405B widths
    python bench/plan_speed.py options --option xla_backend_optimization_level=0 --repeats 2
    python bench/plan_speed.py options --kernel-cache --repeats 2    # the cache changes no figure

``phases`` runs the steps of a plan one by one in a fresh process per repeat (imports, mesh, building the
program, tracing the step, tracing the no-remat baseline, lowering, XLA's compile) and prints, for each,
wall time and CPU time (user + system). The compile is split further: CPU time in the process against
CPU time in its children (XLA runs one ``ptxas`` process per GPU kernel), and XLA's own timers
(``TF_CPP_VMODULE``): its HLO passes, which end with the fusion decisions the memory report reads, against
its backend (scheduling, buffer assignment, then LLVM and ptxas code generation, which change neither the
buffers nor the HLO), with the number of kernels it compiled.

Like a plan, ``phases`` compiles with shardmem's kernel cache (shardmem/planning/kernel_cache.py):
``SHARDMEM_KERNEL_CACHE=off`` measures a first plan, a warm folder a repeated one. Like a plan, it
generates the kernels cheaply (a stand-in ptxas, LLVM without optimization: shardmem/planning/codegen.py);
``--real-codegen`` compiles them as XLA does by default, with the ptxas of the ``nvidia-cuda-nvcc-cu12``
wheel, here and in ``options`` (against the cheap code generation, which is then the default).

``options`` plans every shipped config (``configs/*.yaml``, each for its own ``memory.target``; plus the
405B case of bench/plan_bench.py) with the CLI in a fresh process, once with the config's options and
once with ``--option`` ones added (``--set memory.compiler_options=...``), alternating, and compares
everything the plan reports that the compile decides: the per-device bytes (peak, arguments, outputs,
temporaries, aliases, host), the collective bytes, the largest buffers, the live-range peak, FLOPs and
the step-time estimate (on the ``cpu`` target only its kernel count: its rates are this machine's,
measured at each plan). Any difference is printed and the exit status is 1. CPU time is the child's own
(``os.wait4``, ptxas included); the machine may be shared, so the 1-minute load is printed beside it.
The default runs without the kernel cache; ``--kernel-cache`` gives the variant a fresh one (its first
run fills it, the next ones read it), so ``options --kernel-cache --repeats 2`` checks that a plan from
cached kernels reports what a plan without them does.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import shlex
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(Path(__file__).resolve().parent))
from plan_bench import LLAMA_405B  # noqa: E402  (one definition of the 405B case)

# XLA's scoped timers, logged at VLOG(1) by the GPU compiler, one line each (the kernel ones per kernel).
KERNEL_CACHE_ENV = "SHARDMEM_KERNEL_CACHE"
XLA_VMODULE = "gpu_compiler=1,nvptx_compiler=1,compile_module_to_llvm_ir=1"
_TIMER = re.compile(
    r"^[IWE]\d{4} (?P<clock>\d\d:\d\d:\d\d\.\d+) .*?\] (?P<what>.*?) for \S+ time: [^(]*\((?P<us>\d+) us\)",
    re.MULTILINE,
)


def _rusage() -> tuple[float, float]:
    import resource

    own, children = resource.getrusage(resource.RUSAGE_SELF), resource.getrusage(resource.RUSAGE_CHILDREN)
    return own.ru_utime + own.ru_stime, children.ru_utime + children.ru_stime


def _xla_timers(log: str) -> dict:
    """Sums XLA's timers by name and counts the kernels. From the log's clock: the time from the end of
    the HLO passes to the start of the first kernel's code generation (scheduling and buffer assignment,
    the last of what the report reads) and from there to the end of the backend (code generation)."""
    seconds: dict[str, float] = {}
    kernels = 0
    hlo_end = first_kernel = backend_end = None
    for match in _TIMER.finditer(log):
        what = match["what"].replace("NVPTXCompiler::CompileTargetBinary - ", "")
        took = int(match["us"]) / 1e6
        hour, minute, second = match["clock"].split(":")
        clock = int(hour) * 3600 + int(minute) * 60 + float(second)
        seconds[what] = seconds.get(what, 0.0) + took
        if what == "GpuCompiler::RunHloPasses":
            hlo_end = clock
        elif what == "CompileToPtx":
            kernels += 1
            first_kernel = clock - took if first_kernel is None else min(first_kernel, clock - took)
        elif what == "GpuCompiler::RunBackend":
            backend_end = clock
    spans = {}
    if None not in (hlo_end, first_kernel, backend_end):
        spans = {"schedule and assign buffers": round(first_kernel - hlo_end, 3),
                 "generate code (LLVM, ptxas)": round(backend_end - first_kernel, 3)}  # fmt: skip
    return {"seconds": {k: round(v, 3) for k, v in seconds.items()}, "kernels": kernels, "spans": spans}


def real_codegen_options() -> dict:
    """XLA's default code generation, which a plan replaces with a cheap one (shardmem/planning/codegen.py):
    LLVM at its default optimization and the real ptxas of the ``nvidia-cuda-nvcc-cu12`` wheel."""
    from shardmem.planning import codegen

    folder = codegen.wheel_cuda_dir()
    if folder is None:
        raise SystemExit(
            "--real-codegen needs the nvidia-cuda-nvcc-cu12 wheel (pip install nvidia-cuda-nvcc-cu12)"
        )
    return {codegen.CUDA_DIR: folder, **codegen.OPTIMIZED}


def child_phases(config_path: str, overrides: list[str]) -> dict:
    """The steps of ``shardmem.plan``, timed one by one (run in a fresh process: imports count)."""
    marks: list[tuple[str, float, float, float]] = []

    def mark(name: str) -> None:
        own, children = _rusage()
        marks.append((name, time.perf_counter(), own, children))

    mark("start")
    import shardmem  # noqa: F401
    from shardmem.config import load_config
    from shardmem.parallel.mesh import build_mesh
    from shardmem.planning import codegen, hlo, kernel_cache
    from shardmem.planning.memory import make_target
    from shardmem.program import build_program

    mark("imports")
    config = load_config(config_path, overrides)
    target = make_target(config)
    mesh = build_mesh(config.mesh.axes, target.devices)
    mark("config, target, mesh")
    program = build_program(config, mesh)
    mark("build program")
    traced = program.step.trace(program.abstract_state, program.abstract_batch)
    hlo.matmul_flops(traced.jaxpr)
    mark("trace step")
    policies = program.remat_plan.policies if program.remat_plan else ()
    if any(p.remats for p in policies):  # As plan_program: the FLOPs baseline without remat.
        plain = program.variant("remat.policy=none", "remat.layers={}", "remat.modules={}")
        hlo.matmul_flops(plain.function().trace().jaxpr)
    mark("trace no-remat baseline")
    lowered = traced.lower()
    mark("lower")
    options = dict(config.memory.compiler_options)
    shared = None if kernel_cache.OPTION in options else kernel_cache.cache_file(target)
    options.update(codegen.deviceless_options(target, options))  # As a plan: kernels generated cheaply.
    with (
        tempfile.TemporaryDirectory() as dump,
        tempfile.TemporaryFile() as log,
        kernel_cache.private_copy(shared) as cache,  # As a plan compiles (shardmem.planning.memory).
    ):
        if cache is not None:
            options[kernel_cache.OPTION] = cache
        saved = os.dup(2)
        os.dup2(log.fileno(), 2)  # XLA's timers; shardmem's own compile silences them.
        try:
            compiled = lowered.compile(
                compiler_options={**options, "xla_dump_to": dump, "xla_dump_hlo_as_text": True}
            )
        finally:
            os.dup2(saved, 2)
            os.close(saved)
        mark("XLA compile")
        log.seek(0)
        timers = _xla_timers(log.read().decode("utf-8", "replace"))
        compiled.memory_analysis()
        hlo.buffer_schedule(dump)
        hlo.parse_module(compiled.as_text() or "")
    mark("read dump and HLO")
    phases = []
    for (_, wall0, own0, kids0), (name, wall1, own1, kids1) in zip(marks, marks[1:], strict=False):
        phases.append({"phase": name, "wall_s": round(wall1 - wall0, 3), "cpu_s": round(own1 - own0, 3),
                       "children_cpu_s": round(kids1 - kids0, 3)})  # fmt: skip
    return {"phases": phases, "xla": timers, "kernel_cache": str(shared) if shared else None}


def run_child(argv: list[str], env: dict | None = None) -> tuple[dict, float, float, float, str]:
    """Runs a fresh Python process; returns its JSON, wall s, CPU s (with its children), load before."""
    load = os.getloadavg()[0]
    with tempfile.TemporaryFile() as out, tempfile.TemporaryFile() as err:
        start = time.perf_counter()
        proc = subprocess.Popen([sys.executable, *argv], cwd=ROOT, stdout=out, stderr=err,
                                env={**os.environ, **(env or {})})  # fmt: skip
        _, status, usage = os.wait4(proc.pid, 0)
        wall = time.perf_counter() - start
        code = os.waitstatus_to_exitcode(status)
        out.seek(0)
        err.seek(0)
        stdout, stderr = out.read().decode(), err.read().decode()
    result = json.loads(stdout) if code in (0, 3) and stdout.strip() else {}
    return result, wall, usage.ru_utime + usage.ru_stime, load, stderr.strip()[-1500:] if not result else ""


def cmd_phases(args) -> int:
    overrides = [*args.set, *(LLAMA_405B if args.llama_405b else ())]
    if args.real_codegen:
        overrides += [
            f"memory.compiler_options.{k}={json.dumps(v)}" for k, v in real_codegen_options().items()
        ]
    env = {"TF_CPP_MIN_LOG_LEVEL": "0", "TF_CPP_VMODULE": XLA_VMODULE, "JAX_PLATFORMS": "cpu"}
    runs = []
    for _ in range(args.repeats):
        argv = [str(Path(__file__).resolve()), "_phases", args.config, *overrides]
        result, wall, cpu, load, error = run_child(argv, env)
        if not result:
            print(error, file=sys.stderr)
            return 1
        runs.append({**result, "wall_s": round(wall, 2), "cpu_s": round(cpu, 2), "load_1min": round(load, 2),
                     "load_after": round(os.getloadavg()[0], 2)})  # fmt: skip
    label = shlex.join([args.config, *(f"--set {o}" for o in args.set)]) + (
        " (405B widths)" * args.llama_405b
    )
    cached = runs[0]["kernel_cache"]
    print(f"`{label}`, {args.repeats} fresh processes, kernel cache {cached or 'off'}; median, in seconds\n")
    print("| phase | wall | CPU in process | CPU in children (ptxas) |")
    print("|---|---|---|---|")
    for i, phase in enumerate(runs[0]["phases"]):
        values = [[r["phases"][i][key] for r in runs] for key in ("wall_s", "cpu_s", "children_cpu_s")]
        print(f"| {phase['phase']} | " + " | ".join(f"{statistics.median(v):.2f}" for v in values) + " |")
    print(f"| whole process | {statistics.median(r['wall_s'] for r in runs):.2f} | "
          f"{statistics.median(r['cpu_s'] for r in runs):.2f} (with children) | |")  # fmt: skip
    timers = [r["xla"]["seconds"] for r in runs]
    print("\nXLA's own timers (wall, the kernel ones summed over the compile's threads), median:")
    for name in timers[0]:
        print(f"- {name}: {statistics.median(t.get(name, 0.0) for t in timers):.2f} s")
    print(f"- kernels compiled (one ptxas process each): {runs[0]['xla']['kernels']}")
    spans = [r["xla"]["spans"] for r in runs if r["xla"]["spans"]]
    for name in spans[0] if spans else ():
        print(f"- {name} (from the log's clock): {statistics.median(s[name] for s in spans):.2f} s")
    loads = ", ".join(f"{r['load_1min']}/{r['load_after']}" for r in runs)
    print(f"\nloads (1 min, before/after): {loads}")
    if args.json:
        Path(args.json).write_text(json.dumps(runs, indent=1))
    return 0


def _figures(report: dict) -> dict:
    """What the compile decides: it must not move with an option that only changes code generation."""
    step = report.get("step_time") or {}
    keys = ("seconds", "breakdown", "communication_seconds", "kernels")
    if report.get("target") == "cpu":  # Its rates are this machine's, measured at each plan: noise.
        keys = ("kernels",)
    return {
        "fits": report.get("fits"),
        "per_device": report.get("per_device"),
        "collectives": report.get("collectives"),
        "top_buffers": [(b["bytes"], b["shape"], b["scope"]) for b in report.get("top_buffers", [])],
        "live_range_peak_bytes": report.get("cross_check", {}).get("live_range_peak_bytes"),
        "compiled_argument_bytes": report.get("cross_check", {}).get("compiled_argument_bytes"),
        "flops_per_step": report.get("flops_per_step"),
        "flops_no_remat": report.get("flops_no_remat"),
        "step_time": {k: step.get(k) for k in keys},
    }


def _diff(a, b, path="") -> list[str]:
    if isinstance(a, dict) and isinstance(b, dict):
        return [d for k in sorted(set(a) | set(b)) for d in _diff(a.get(k), b.get(k), f"{path}.{k}")]
    return [] if a == b else [f"{path.lstrip('.')}: {a!r} -> {b!r}"]


def cmd_options(args) -> int:
    options = real_codegen_options() if args.real_codegen else {}
    for item in args.option:
        key, _, value = item.partition("=")
        options[key] = json.loads(value) if value.strip()[:1] in '0123456789-tf[{"' else value
    cases = [(str(p.relative_to(ROOT)), ()) for p in sorted((ROOT / "configs").glob("*.yaml"))]
    cases.append(("configs/llama-70b.yaml", LLAMA_405B))
    if args.only:
        cases = [c for c in cases if any(o in c[0] + " ".join(c[1]) for o in args.only)]
    if not options and not args.kernel_cache:
        print("give --option XLA_FLAG=VALUE, --kernel-cache, or both", file=sys.stderr)
        return 2
    changed = 0
    # The default runs without shardmem's kernel cache; --kernel-cache gives the variant a fresh one,
    # so that its first run fills it and the next ones read it.
    cache = tempfile.TemporaryDirectory(prefix="plan-speed-kernels-") if args.kernel_cache else None
    variant_env = {KERNEL_CACHE_ENV: cache.name if cache else "off"}
    print(f"options: {options}; variant's kernel cache: {'fresh folder' if cache else 'off'}\n")
    print("| config | CPU s, default | CPU s, variant | load | figures |")
    print("|---|---|---|---|---|")
    for config, overrides in cases:
        merged = {**_config_options(config), **options}
        base = ["-m", "shardmem", "plan", config, "--json", *[a for o in overrides for a in ("--set", o)]]
        variant = [*base, "--set", f"memory.compiler_options={json.dumps(merged)}"] if options else base
        cpu = {"default": [], "variant": []}
        figures, loads, differences = None, [], []
        for _ in range(args.repeats):
            for name, argv, env in (
                ("default", base, {KERNEL_CACHE_ENV: "off"}),
                ("variant", variant, variant_env),
            ):
                report, _, seconds, load, error = run_child(argv, env)
                if not report:
                    print(f"{config}: the plan failed ({name}): {error}", file=sys.stderr)
                    return 1
                cpu[name].append(seconds)
                loads.append(load)
                if figures is None:
                    figures = _figures(report)  # Every run is compared with the first default one.
                else:
                    differences += [f"{name}: {d}" for d in _diff(figures, _figures(report))]
        changed += bool(differences)
        label = config + (" (405B widths)" if overrides else "")
        print(f"| {label} | {', '.join(f'{s:.1f}' for s in cpu['default'])} | "
              f"{', '.join(f'{s:.1f}' for s in cpu['variant'])} | {min(loads):.1f}-{max(loads):.1f} | "
              f"{'identical' if not differences else f'{len(differences)} differ'} |")  # fmt: skip
        for line in differences[:20]:
            print(f"    {line}")
    if cache:
        cache.cleanup()
    return 1 if changed else 0


def _config_options(config: str) -> dict:
    import yaml

    raw = yaml.safe_load((ROOT / config).read_text()) or {}
    return dict((raw.get("memory") or {}).get("compiler_options") or {})


def main() -> int:
    if len(sys.argv) > 1 and sys.argv[1] == "_phases":
        print(json.dumps(child_phases(sys.argv[2], sys.argv[3:])))
        return 0
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    sub = parser.add_subparsers(dest="command", required=True)
    phases = sub.add_parser("phases", help="time the steps of one plan")
    phases.add_argument("config")
    phases.add_argument("--set", action="append", default=[], metavar="KEY=VALUE")
    phases.add_argument(
        "--405b",
        dest="llama_405b",
        action="store_true",
        help="Llama-3.1-405B widths over 1,024 H100s (bench/plan_bench.py's case)",
    )
    phases.add_argument("--repeats", type=int, default=3)
    phases.add_argument(
        "--real-codegen", action="store_true", help="XLA's own code generation (ptxas, LLVM -O2)"
    )
    phases.add_argument("--json", help="write the runs here")
    options = sub.add_parser("options", help="do XLA options change the plan's figures or its CPU time?")
    options.add_argument("--option", action="append", default=[], metavar="XLA_FLAG=VALUE")
    options.add_argument(
        "--kernel-cache",
        action="store_true",
        help="the variant plans with shardmem's kernel cache (a fresh folder), the default without",
    )
    options.add_argument(
        "--real-codegen",
        action="store_true",
        help="the variant generates code as XLA does by default (ptxas, LLVM -O2)",
    )
    options.add_argument("--only", action="append", help="cases whose config or overrides contain this")
    options.add_argument("--repeats", type=int, default=2)
    args = parser.parse_args()
    return cmd_phases(args) if args.command == "phases" else cmd_options(args)


if __name__ == "__main__":
    sys.exit(main())
