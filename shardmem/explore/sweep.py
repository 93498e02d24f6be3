"""Planning every combination of a grid of config overrides, side by side.

    grid = parse_grid(["remat.policy=none,minimal,full", "train.global_batch=8,16"])
    rows = sweep(load_config("configs/llama-7b.yaml"), grid, target="h100-sxm", jobs=2)
    write_outputs(rows, "sweep-out")   # sweep.csv, sweep.json, sweep.png

Each candidate is ``config.replace(*overrides)`` planned by :func:`shardmem.plan_program` (compiled
ahead of time; deviceless for GPU targets), in a pool of spawned worker processes because one XLA compile
uses about one core. A candidate that fails, for a bad override or anything else, is a row with its
error, not a crash. With ``measure=True`` each candidate also runs a few real steps of the step its plan
compiled on the attached (or simulated CPU) devices, each in a fresh process so that the measured peak
memory is its own.
"""

from __future__ import annotations

import concurrent.futures
import csv
import dataclasses
import itertools
import json
import multiprocessing
import os
import statistics
import time
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

import yaml

from shardmem.config import Config
from shardmem.errors import ConfigError, DoesNotFit, ShardmemError, at_least
from shardmem.explore.rows import COLUMNS, SweepRow, short_label
from shardmem.units import format_bytes, format_flops, format_seconds

if TYPE_CHECKING:
    from shardmem.program import TrainingProgram


def check_grid_and_sets(grid: dict[str, list[Any]], overrides: Sequence[str]) -> None:
    """Raises ConfigError for a ``--set`` of a key the grid varies (or of a key inside a section it varies):
    each candidate's grid value would replace it without a word. A ``--set`` of a section holding a varied
    key stays: the grid varies that key within it."""
    for override in overrides:
        key = override.partition("=")[0].strip()
        for varied in grid:
            if key == varied or key.startswith(f"{varied}."):
                raise ConfigError(f"--set {override!r} and --grid {varied}=...: every candidate takes "
                                  f"{varied} from the grid, which would replace the --set; drop the --set, "
                                  "or list its value in the --grid")  # fmt: skip


def parse_grid(items: Sequence[str]) -> dict[str, list[Any]]:
    """Parses ``KEY=V1,V2,...`` strings (values as YAML) into ``{key: [values]}``.

    A value containing commas can be quoted or bracketed: ``remat.layers={"0-3": full},{}``. A value
    given twice is kept once.
    """
    grid: dict[str, list[Any]] = {}
    for item in items:
        key, sep, text = item.partition("=")
        key = key.strip()
        if not sep or not key or not text.strip():
            raise ConfigError(f"--grid {item!r}: write KEY=V1,V2,..., e.g. --grid remat.policy=none,full")
        if key in grid:
            raise ConfigError(f"--grid {item!r}: {key} is given twice; list all its values in one --grid")
        try:
            values = yaml.safe_load(f"[{text}]")
        except yaml.YAMLError:
            values = None
        if not isinstance(values, list) or not values:
            raise ConfigError(
                f"--grid {item!r}: cannot read {text!r} as a comma-separated list of values; quote values "
                "that contain commas, e.g. --grid 'remat.layers={\"0-3\": full},{}'"
            )
        unique: dict[str, Any] = {}
        for value in values:  # A value given twice compiles once.
            unique.setdefault(_dump(value), value)
        grid[key] = list(unique.values())
    if not grid:
        raise ConfigError(
            "give at least one --grid KEY=V1,V2,..., e.g. --grid remat.policy=none,minimal,full"
        )
    return grid


def _dump(value: Any) -> str:
    return yaml.safe_dump(value, default_flow_style=True, width=10**6).strip().removesuffix("...").strip()


def candidates(grid: Mapping[str, Sequence[Any]]) -> list[tuple[str, ...]]:
    """Returns every combination of the grid as a tuple of ``key=value`` overrides."""
    keys = list(grid)
    return [
        tuple(f"{key}={_dump(value)}" for key, value in zip(keys, values, strict=True))
        for values in itertools.product(*(grid[k] for k in keys))
    ]


def check_candidates(config: Config, combos: Sequence[tuple[str, ...]]) -> None:
    """Raises ConfigError, before anything is compiled, when a candidate's overrides do not make a valid
    config (a mistyped grid value): the error of the first, and how many there are."""
    invalid = []
    for overrides in combos:
        try:
            config.replace(*overrides)
        except ConfigError as e:
            invalid.append((overrides, str(e).splitlines()[0]))
    if invalid:
        overrides, message = invalid[0]
        raise ConfigError(f"{len(invalid)} of {len(combos)} candidates are not valid configs (nothing was "
                          f"compiled); first {' '.join(overrides)}: {message}")  # fmt: skip


def _error_text(error: Exception) -> str:
    """A user's mistake as its message; anything unexpected with its type, which says more."""
    return str(error) if isinstance(error, ShardmemError) else f"{type(error).__name__}: {error}"


def plan_candidate(
    config: Config, overrides: tuple[str, ...], target: str | None, measure_steps: int = 0
) -> SweepRow:
    """Plans one candidate; with ``measure_steps``, also times that many real steps of the step the
    plan compiled. Any error (a config or plan error, or an unexpected one) becomes the row's
    ``error``, so that one candidate cannot end the sweep."""
    from shardmem.parallel.mesh import build_mesh
    from shardmem.planning.memory import make_target, plan_program
    from shardmem.program import build_program

    try:
        candidate = config.replace(*overrides)
        resolved = make_target(candidate, target)
        program = build_program(candidate, build_mesh(candidate.mesh.axes, resolved.devices))
        report, compiled = plan_program(program, resolved, top=3)
    except DoesNotFit as e:  # XLA's TPU compiler refused it as over the chip's HBM: a verdict, no figures.
        return SweepRow(overrides, error=_error_text(e), fits=False, peak_bytes=e.required_bytes)
    except Exception as e:
        return SweepRow(overrides, error=_error_text(e), config_error=isinstance(e, ConfigError))
    row = SweepRow(
        overrides, peak_bytes=report.per_device["peak"], budget_bytes=report.budget_bytes, fits=report.fits,
        margin_bytes=report.margin_bytes, tight=report.tight, flops_per_step=report.flops_per_step,
        recompute_overhead=report.recompute_overhead if report.recompute_overhead is not None else 0.0,
        host_bytes=report.per_device["host"], optimizer_bytes=report.per_device["optimizer"],
        attention=report.attention, collectives=dict(report.collectives),
        compile_seconds=round(report.compile_seconds, 3), approximate=report.approximate,
        bubble_fraction=report.pipeline.get("bubble_fraction"),
        step_time=report.step_time.to_json() if getattr(report, "step_time", None) else None,
    )  # fmt: skip
    if measure_steps:
        try:
            row.step_seconds, row.measured_peak_bytes = time_steps(program, compiled, measure_steps)
        except Exception as e:
            row.error = f"measuring: {_error_text(e)}"
    return row


def time_steps(program: TrainingProgram, step_fn: Callable, steps: int) -> tuple[float, int | None]:
    """Runs ``steps`` real training steps of ``step_fn`` (``program``'s step, after one more that warms
    up) on synthetic data; returns the median step time in seconds and the peak bytes in use of the
    mesh's devices (None where the backend does not say)."""
    import jax

    from shardmem.run import data

    config = program.config
    stream = data.batch_stream(config.replace("data.path=null"), program, synthetic=True)
    batches = [stream(i) for i in range(steps + 1)]
    state = program.init()
    state, metrics = step_fn(state, batches[0])
    jax.block_until_ready(metrics)
    times = []
    for batch in batches[1:]:
        start = time.perf_counter()
        state, metrics = step_fn(state, batch)
        jax.block_until_ready(metrics)
        times.append(time.perf_counter() - start)
    peaks = [(d.memory_stats() or {}).get("peak_bytes_in_use") for d in program.mesh.devices.flat]
    peaks = [p for p in peaks if p is not None]
    return statistics.median(times), (max(peaks) if peaks else None)


def _worker_init(cpu_devices: int, cpu_only: bool, local_memory: Config | None,
                 host_rates: tuple[float, float] | None = None) -> None:  # fmt: skip
    """Prepares a worker before JAX starts: ``cpu_only`` (any target but ``local``) keeps it off an
    attached GPU, whose client would otherwise start in every worker; ``local_memory`` is the config
    whose allocator limit a worker planning or measuring on the attached devices gets, as ``shardmem
    train`` would; ``host_rates`` are the parent's measured CPU rates, which every worker's CPU plans
    use (each measuring its own made the candidates' step times incomparable)."""
    # Planning allocates nothing; several workers (and the measuring one) may share one GPU.
    os.environ.setdefault("XLA_PYTHON_CLIENT_PREALLOCATE", "false")
    if host_rates is not None:
        from shardmem.planning.cost import HOST_RATES_ENV

        os.environ[HOST_RATES_ENV] = ",".join(repr(rate) for rate in host_rates)
    import shardmem  # noqa: F401  Sets JAX_PLATFORMS=cpu on machines without a GPU driver.
    from shardmem.planning.targets import configure_local_memory, ensure_cpu_devices

    if cpu_only:
        import jax

        jax.config.update("jax_platforms", "cpu")
    if local_memory is not None:
        configure_local_memory(local_memory)
    ensure_cpu_devices(cpu_devices)


def _cpu_devices(config: Config, rows: Sequence[tuple[str, ...]]) -> int:
    counts = [config.mesh.device_count()]
    for overrides in rows:
        try:
            counts.append(config.replace(*overrides).mesh.device_count())
        except ConfigError:
            pass
    return max(counts)


JOBS_FIX = "use 1 or more worker processes, or omit it for one per CPU"


def check_options(
    config: Config, target: str | None, *, jobs: int | None, measure: bool, measure_steps: int | None
) -> None:
    """Raises ConfigError for options :func:`sweep` cannot run with, before any work (or output) starts;
    ``measure_steps`` None: not given."""
    at_least("--jobs", jobs, 1, JOBS_FIX)
    at_least("--steps", measure_steps, 1, "time at least 1 step per candidate")
    if measure_steps is not None and not measure:
        raise ConfigError(f"--steps {measure_steps}: only --measure times steps (a sweep plans, by default); "
                          "add --measure, or drop --steps")  # fmt: skip
    if measure:
        name = target or config.memory.target
        if name not in ("local", "cpu"):  # Every other target is compiled without its devices.
            raise ConfigError(
                f"--measure runs real steps, but target {name!r} is compiled deviceless; use --target "
                "local (the attached devices) or --target cpu"
            )


def sweep(
    config: Config,
    grid: Mapping[str, Sequence[Any]],
    target: str | None = None,
    *,
    jobs: int | None = None,
    measure: bool = False,
    measure_steps: int = 5,
    progress: Callable[[int, int, SweepRow], None] | None = None,
) -> list[SweepRow]:
    """Plans every combination of ``grid`` (``{key: [values]}``) applied to ``config``; returns one row
    per candidate in grid order. ``jobs`` worker processes (default: CPUs, at most one per candidate;
    1 plans in this process). ``measure`` also runs real steps (target ``local`` or ``cpu``). A grid
    value that makes no valid config is a ConfigError before anything is compiled."""
    check_options(
        config, target, jobs=jobs, measure=measure, measure_steps=measure_steps if measure else None
    )
    check_candidates(config, candidates(grid))
    return plan_candidates(config, candidates(grid), target, jobs=jobs, measure=measure,
                           measure_steps=measure_steps, progress=progress)  # fmt: skip


def plan_candidates(
    config: Config,
    combos: Sequence[tuple[str, ...]],
    target: str | None = None,
    *,
    jobs: int | None = None,
    measure: bool = False,
    measure_steps: int = 5,
    progress: Callable[[int, int, SweepRow], None] | None = None,
    pool: concurrent.futures.Executor | None = None,
) -> list[SweepRow]:
    """Plans each tuple of overrides in ``combos`` applied to ``config`` (what :func:`sweep` does for a
    grid's combinations; ``tune --search layout`` for the layouts it chose); one row per candidate.
    ``pool`` (from :func:`planning_pool`) keeps worker processes across calls."""
    combos = list(combos)
    jobs = min(jobs or os.cpu_count() or 1, len(combos)) or 1
    done = 0
    rows: list[SweepRow | None] = [None] * len(combos)

    def finished(index: int, row: SweepRow) -> None:
        nonlocal done
        rows[index], done = row, done + 1
        if progress:
            progress(done, len(combos), row)

    cpu_devices = _cpu_devices(config, combos)
    local = (target or config.memory.target) == "local"
    context = multiprocessing.get_context("spawn")
    rates = _shared_host_rates(config, target) if pool is None and (measure or jobs != 1) else None
    if measure:
        # One fresh process per candidate, one at a time: timings are not shared with other work, and
        # the device's peak-bytes counter (which cannot be reset) is the candidate's own.
        for i, overrides in enumerate(combos):
            settings = (cpu_devices, not local, _replaced(config, overrides) if local else None, rates)
            with concurrent.futures.ProcessPoolExecutor(1, mp_context=context, initializer=_worker_init,
                                                        initargs=settings) as pool:  # fmt: skip
                future = pool.submit(plan_candidate, config, overrides, target, measure_steps)
                finished(i, _result(future, overrides))
        return rows  # type: ignore[return-value]
    # The budget is the lower of the allocator's limit and each candidate's usable_fraction: the
    # largest fraction of the grid leaves every candidate its own.
    settings = (cpu_devices, not local, _widest_memory(config, combos) if local else None, rates)
    if pool is not None:
        futures = {pool.submit(plan_candidate, config, o, target): i for i, o in enumerate(combos)}
        for future in concurrent.futures.as_completed(futures):
            finished(futures[future], _result(future, combos[futures[future]]))
    elif jobs == 1:
        _worker_init(*settings[:3])  # This process: its own rates.
        for i, overrides in enumerate(combos):
            finished(i, plan_candidate(config, overrides, target))
    else:
        with concurrent.futures.ProcessPoolExecutor(jobs, mp_context=context, initializer=_worker_init,
                                                    initargs=settings) as pool:  # fmt: skip
            futures = {pool.submit(plan_candidate, config, o, target): i for i, o in enumerate(combos)}
            for future in concurrent.futures.as_completed(futures):
                finished(futures[future], _result(future, combos[futures[future]]))
    return rows  # type: ignore[return-value]


def planning_pool(config: Config, target: str | None, jobs: int, cpu_devices: int):
    """Worker processes that plan candidates of ``config`` (``jobs`` of them), for several
    :func:`plan_candidates` calls; use it as a context manager."""
    local = (target or config.memory.target) == "local"
    return concurrent.futures.ProcessPoolExecutor(
        jobs, mp_context=multiprocessing.get_context("spawn"), initializer=_worker_init,
        initargs=(cpu_devices, not local, config if local else None, _shared_host_rates(config, target)),
    )  # fmt: skip


def _shared_host_rates(config: Config, target: str | None) -> tuple[float, float] | None:
    """For a ``cpu`` target, this process's host rates, which its workers plan with (each measuring its
    own, under a load that changes, costed the candidates of one search unalike)."""
    if (target or config.memory.target) != "cpu":
        return None
    from shardmem.planning.cost import host_rates

    return host_rates()


def _result(future: concurrent.futures.Future, overrides: tuple[str, ...]) -> SweepRow:
    """The future's row, or a row with its error when the worker itself failed (say, it was killed)."""
    try:
        return future.result()
    except Exception as e:
        return SweepRow(overrides, error=_error_text(e))


def _replaced(config: Config, overrides: tuple[str, ...]) -> Config:
    try:
        return config.replace(*overrides)
    except ConfigError:
        return config  # The candidate's row reports the error.


def _widest_memory(config: Config, combos: Sequence[tuple[str, ...]]) -> Config:
    """The candidate config with the largest ``memory.usable_fraction``."""
    return max((_replaced(config, o) for o in combos), key=lambda c: c.memory.usable_fraction, default=config)


def write_outputs(rows: Sequence[SweepRow], out_dir: str | Path, *, title: str = "") -> dict[str, Path]:
    """Writes ``sweep.csv``, ``sweep.json`` and ``sweep.png`` into ``out_dir``, all three or none (a
    full disk or an error leaves an earlier sweep's as they were); returns their paths."""
    from shardmem._files import make_folder, staged
    from shardmem.explore.plot import plot_sweep

    out = make_folder(out_dir, "--out")
    paths = {"csv": out / "sweep.csv", "json": out / "sweep.json", "png": out / "sweep.png"}
    with staged(list(paths.values()), "--out") as (csv_file, json_file, png_file):
        with csv_file.open("w", newline="") as f:
            writer = csv.DictWriter(f, fieldnames=COLUMNS)
            writer.writeheader()
            for row in rows:
                writer.writerow(row.flat())
        json_file.write_text(json.dumps([{**dataclasses.asdict(r), "candidate": r.candidate} for r in rows],
                                        indent=2))  # fmt: skip
        figure = plot_sweep(rows, title=title)
        figure.savefig(png_file, dpi=120, bbox_inches="tight", format="png")
    return paths


def progress_line(done: int, total: int, row: SweepRow, elapsed_s: float) -> str:
    """Returns the line a sweep prints as a candidate finishes when its output is not a terminal (a log, a
    pipe), where no live bar is drawn: "[3/8 after 41 s] policy=full global_batch=8: 12.30 GiB, fits"."""
    head = f"[{done}/{total} after {elapsed_s:.0f} s] {short_label(row.overrides) or row.candidate}: "
    if row.error is not None:
        return head + "error: " + row.error.splitlines()[0]
    verdict = "fits" if row.fits else "tight, likely fits" if row.tight else "does not fit"
    return head + f"{format_bytes(row.peak_bytes)}, {verdict}"


def render_sweep(rows: Sequence[SweepRow], *, title: str = "shardmem sweep"):
    """Returns the rows as a rich renderable: one table row per candidate, then the errors.

    Nothing is cut short with an ellipsis: on a console too narrow for the whole table the candidate
    column wraps first, then the figures (between number and unit while they can)."""
    from rich.console import Group
    from rich.table import Table
    from rich.text import Text

    measured = any(r.step_seconds is not None for r in rows)
    headers = ["peak", "margin", "FLOPs", "recompute", "host", "all-gather", "reduce-sc.", "all-reduce"]
    moves = ["all-gather", "reduce-scatter", "all-reduce"]
    if any(r.collectives.get("all-to-all") for r in rows):  # Expert parallelism's token dispatch.
        headers.append("all-to-all")
        moves.append("all-to-all")
    pipelined = any(r.bubble_fraction is not None for r in rows)
    if pipelined:  # Pipeline stages hand activations on by collective-permute.
        headers.append("coll.-permute")
        moves.append("collective-permute")
        headers.append("bubble")
    predicted = any(r.step_time for r in rows)
    if predicted:  # Host transfers cost time: an offloading candidate is not free.
        headers += ["pred. step", "MFU", "exp. comm", "host xfer"]
    if measured:
        headers += ["step time", "meas. peak"]
    cells, errors = [], []
    for r in rows:
        label = short_label(r.overrides) or r.candidate
        if r.error:
            cells.append([label, Text("error", style="red")])
            errors.append(Text(f"{label}: {r.error}", style="red"))
            continue
        moved = r.collectives
        row = [
            label, format_bytes(r.peak_bytes),
            Text(("+" if r.fits else "") + format_bytes(r.margin_bytes),
                 style="green" if r.fits else "yellow" if r.tight else "red"),
            format_flops(r.flops_per_step), f"+{r.recompute_overhead:.1%}",
            format_bytes(r.host_bytes),
            *(format_bytes(moved.get(k, 0)) for k in moves),
        ]  # fmt: skip
        if pipelined:
            row.append("-" if r.bubble_fraction is None else f"{r.bubble_fraction:.1%}")
        if predicted:
            st = r.step_time
            row += ["-", "-", "-", "-"] if not st else [
                format_seconds(st["seconds"]), "-" if st["mfu"] is None else f"{st['mfu']:.1%}",
                format_seconds(st["breakdown"]["exposed_communication"]),
                f"{format_bytes(st['host_transfer_bytes'])} / "
                f"{format_seconds(st['host_transfer_seconds'])}"]  # fmt: skip
        if measured:
            row.append("-" if r.step_seconds is None else f"{r.step_seconds * 1e3:.1f} ms")
            row.append("-" if r.measured_peak_bytes is None else format_bytes(r.measured_peak_bytes))
        cells.append(row)
    table = Table(title=title, title_justify="left", show_edge=False, pad_edge=False)
    table.add_column("candidate", overflow="fold")
    for header in headers:
        table.add_column(header, justify="right", overflow="fold")
    for row in cells:
        table.add_row(*row)
    table.caption = (
        "per device and step; margin: budget - peak (negative: does not fit; yellow: tight, likely fits); "
        "recompute: extra matmul FLOPs over the model's (remat and the attention kernel recompute)"
    )
    parts: list = [table]
    if any(r.approximate for r in rows):
        parts.append(Text("approximate: compiled for CPU, not a GPU prediction", style="yellow"))
    budgets = sorted({r.budget_bytes for r in rows if r.budget_bytes is not None})
    if budgets:
        parts.append(Text("budget per device: " + ", ".join(format_bytes(b) for b in budgets)))
    return Group(*parts, *errors)
