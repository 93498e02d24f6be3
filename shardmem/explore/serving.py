"""Tuning a serving program to its devices: ``shardmem tune CONFIG --search serve``.

    result = tune(config, target="h100-sxm", search="serve", objective="latency")
    result.chosen.overrides     # e.g. ("mesh.axes={data: 2, tensor: 4}", "serve.kv_dtype=int8")
    result.ranked               # every layout planned: its time, tokens/s, peak, verdict

The knobs are the tensor-parallel degree (the config's devices split into ``tensor`` x ``data``
replicas) and the KV cache's dtype (the compute dtype, or int8); with ``objective="throughput"`` also
the batch. A tensor degree divides the KV heads, or is a multiple of them that divides the query heads,
the MLP and the vocabulary: then each KV head is held on several devices, as vLLM holds them
(``mesh.axes {tensor: 8, tensor_rep: 2}`` for 8 KV heads on 16 devices, ``heads``, ``mlp`` and
``vocab`` on ``[tensor, tensor_rep]``, ``kv_heads`` on ``tensor``; the chosen config says so). Each
candidate is a serving plan (:func:`~shardmem.planning.serving.plan_serving`: two compiles, prefill and
decode):

- ``latency``: the config's ``serve.batch``; the best candidate takes the least time for the whole
  static batch (time to first token and every decode step), among those that fit.
- ``throughput``: each candidate's batch is the largest that fits: read off its first plan's KV room
  (an upper bound, the temporaries held as planned), compiled, and where that is over, the line through
  the two compiled points solved for the budget and compiled again (as ``plan --serve --capacity``
  does); the best has the most output tokens/s.

Candidates whose ``serve.batch`` the data replicas do not divide are skipped and say so. Before any
compile, each layout's weights and KV cache per device come from their shapes and shardings: a layout
whose two are over what the device has for serving is pruned (not compiled), and the rest are planned
holding the fewest bytes first (what a decode step reads, and what leaves room for sequences), so that
a compile budget too small for all of them goes to the likeliest winners. The search splits the
reference decoder's ``model.n_kv_heads``; a model of your own is refused (plan its layouts with
``shardmem plan CONFIG --serve --set mesh.axes...``).
"""

from __future__ import annotations

from typing import Any

from shardmem.config import Config
from shardmem.errors import ConfigError
from shardmem.explore.search import Planner, TuneResult, margin_text, no_fit
from shardmem.parallel.mesh import build_mesh
from shardmem.planning.memory import budget, per_device_bytes
from shardmem.planning.serving import ServingPlan, plan_serving, room_limit
from shardmem.planning.targets import Target
from shardmem.program.serving import serving_program
from shardmem.units import format_bytes, format_seconds

#: What ``--objective`` may ask of a serving search.
SERVING_OBJECTIVES = ("latency", "throughput")


def tune_serving(planner: Planner, target: Target, objective: str | None) -> TuneResult:
    """The serving search (see the module docstring) within ``planner.max_compiles`` compiles."""
    objective = objective or "latency"
    if objective not in SERVING_OBJECTIVES:
        raise ConfigError(f"--objective {objective!r}: --search serve ranks by latency or throughput")
    config = planner.base
    if config.user_model:  # Its KV heads are its cache_layout()'s, known only once it is built.
        raise ConfigError(
            f"shardmem tune --search serve splits the reference decoder's model.n_kv_heads over tensor; a "
            f"model of your own (model.factory={getattr(config.model, 'factory', None)}) is not searched: "
            "compare layouts with shardmem plan CONFIG --serve --set mesh.axes.tensor=N"
        )
    devices = len(target.devices)
    compute = config.precision.compute
    kv_dtypes = list(dict.fromkeys([config.serve.kv_dtype or compute, "int8"]))
    budget_bytes = None
    ranked: list[dict[str, Any]] = []
    layouts = {t: _tensor_layout(config, t) for t in range(1, devices + 1) if devices % t == 0}
    tensors = [t for t, layout in layouts.items() if layout is not None]
    candidates = [(t, kv_dtype) for t in tensors for kv_dtype in kv_dtypes]
    if all(config.serve.batch % (devices // t) for t in tensors):
        each = ", ".join(f"{devices // t} at tensor {t}" for t in tensors)
        raise ConfigError(
            f"serve.batch={config.serve.batch} does not split over the data replicas of any layout of "
            f"{devices} devices ({each}); use a multiple of {devices // tensors[-1]}"
        )
    usable = budget(config.memory, target.memory_bytes, target.allocator_limit)  # No margin: an upper bound.
    queue = _queue(planner, target, candidates, layouts, usable)
    planned = 0
    for _, label, layout, replicas in queue:
        if planner.exhausted:
            break
        row = _best_batch(planner, config, target, label, layout, replicas, objective)
        if row is None:
            break  # Out of compiles.
        budget_bytes = row.pop("budget_bytes")
        ranked.append(row)
        planned += 1
    spent = [f"the compile budget is spent with {len(queue) - planned} of {len(candidates)} layouts "
             "unplanned (those holding the most bytes per device): raise --max-compiles"
             ] if planned < len(queue) else []  # fmt: skip
    fitting = [r for r in ranked if r["fits"]]
    key = (lambda r: r["total_seconds"]) if objective == "latency" else (lambda r: -r["tokens_per_second"])
    ranked = sorted(fitting, key=key) + [r for r in ranked if not r["fits"]]
    if not fitting:
        return no_fit(planner, target, budget_bytes or usable, "serve", [
            f"no layout of {devices} devices fits serve.batch={config.serve.batch} with either KV dtype",
            "lower serve.batch or serve.max_len, quantize the weights (serve.quantize), or plan more devices",
            *spent,
        ])  # fmt: skip
    best = ranked[0]
    chosen = next(t for t in planner.trials if t.overrides == tuple(best["overrides"]) and t.fits)
    goal = ("the least time for the static batch" if objective == "latency"
            else "the most output tokens/s")  # fmt: skip
    explanation = [
        f"serving layouts of {devices} devices for {goal} ({objective}), each planned deviceless "
        f"(prefill and decode) on {target.label}",
        f"chosen: {best['layout']} at serve.batch={best['batch']}: {format_seconds(best['total_seconds'])} "
        f"for the batch, {best['tokens_per_second']:,.0f} output tokens/s, first token in "
        f"{format_seconds(best['ttft'])}",
        *_split_text(best["overrides"]),
        f"{planner.compiles} compiles",
        *spent,
    ]
    return TuneResult("serve", config.replace(*best["overrides"]), best.pop("report"), chosen, planner.trials,
                      planner.compiles, budget_bytes, target.label, explanation,
                      ranked=[{k: v for k, v in r.items() if k != "report"} for r in ranked])  # fmt: skip


def _queue(planner: Planner, target: Target, candidates: list[tuple[int, str]],
           layouts: dict[int, tuple[dict[str, int], tuple[str, ...]] | None],
           usable: int) -> list[tuple[int, str, tuple[str, ...], int]]:  # fmt: skip
    """The layouts to plan, each ``(bytes held per device, label, overrides, data replicas)``, fewest
    bytes first; noting those skipped (``serve.batch`` does not split over their replicas, or the
    program cannot be built: a size their axes do not divide) and pruned (their weights and KV cache
    alone are over the ``usable`` bytes)."""
    config, devices = planner.base, len(target.devices)
    queue = []
    for tensor, kv_dtype in candidates:
        replicas = devices // tensor
        axes, rules = layouts[tensor]
        shown = {axis: size for axis, size in axes.items() if size > 1 or axis == "tensor"}
        label = " x ".join(f"{axis} {size}" for axis, size in {**shown, "data": replicas}.items())
        label += f", KV {kv_dtype}"
        layout = (_mesh(config, replicas, axes), *rules, f"serve.kv_dtype={kv_dtype}")
        if config.serve.batch % replicas:
            why = f"serve.batch={config.serve.batch} does not split over {replicas} data replicas"
            planner.note(label, layout, None, None, None, False, "skipped", why)
            continue
        try:
            weights, cache = _held_bytes(config.replace(*layout), target)
        except ConfigError as error:  # A size its axes do not divide (vocabulary, d_ff, batch rows).
            planner.note(label, layout, None, None, None, False, "skipped", str(error))
            continue
        if weights + cache > usable:
            why = (f"its weights ({format_bytes(weights)}) and KV cache ({format_bytes(cache)}) per device "
                   f"are over the {format_bytes(usable)} the device has for serving")  # fmt: skip
            planner.note(label, layout, weights + cache, None, None, False, "pruned", why)
            continue
        queue.append((weights + cache, label, layout, replicas))
    # Fewest bytes first: a decode step reads them all (the least time where it is memory bound), and
    # they leave the most room for sequences; the compile budget goes to the likeliest winners.
    return sorted(queue, key=lambda queued: queued[0])


def _held_bytes(config: Config, target: Target) -> tuple[int, int]:
    """The weights and the KV cache a device holds throughout serving, from their shapes and shardings
    (no compile): every plan's peak holds both."""
    program = serving_program(config, build_mesh(config.mesh.axes, target.devices))
    return per_device_bytes(program.abstract_weights), per_device_bytes(program.serving.cache)


#: The mesh axis that holds each KV head on several devices when the tensor degree is above the KV heads.
_REPLICA_AXIS = "tensor_rep"

#: What ``tensor`` x ``tensor_rep`` splits (``kv_heads`` stays on ``tensor`` alone).
_SPLIT_RULES = ("heads", "mlp", "vocab")


def _tensor_layout(config: Config, tensor: int) -> tuple[dict[str, int], tuple[str, ...]] | None:
    """The tensor axes of a serving layout ``tensor`` devices wide, and its rule overrides: ``{tensor:
    t}`` where ``t`` divides the KV heads; above them, ``{tensor: KV heads, tensor_rep: t / KV heads}``
    with ``heads``, ``mlp`` and ``vocab`` on both and ``kv_heads`` on ``tensor`` (each KV head, and its
    cache, held on ``t / KV heads`` devices), where ``t`` divides the query heads, ``d_ff`` and the
    vocabulary; None for a degree neither layout splits evenly."""
    m = config.model
    if m.n_kv_heads % tensor == 0:
        return {"tensor": tensor, **({_REPLICA_AXIS: 1} if _REPLICA_AXIS in config.mesh.axes else {})}, ()
    if tensor % m.n_kv_heads or any(size % tensor for size in (m.n_heads, m.d_ff, m.vocab_size)):
        return None
    both = f"[tensor, {_REPLICA_AXIS}]"
    rules = (*(f"rules.{name}={both}" for name in _SPLIT_RULES), "rules.kv_heads=[tensor]")
    return {"tensor": m.n_kv_heads, _REPLICA_AXIS: tensor // m.n_kv_heads}, rules


def _split_text(overrides: list[str]) -> list[str]:
    """The line that spells out a chosen layout holding each KV head on several devices (none for
    another)."""
    if "rules.kv_heads=[tensor]" not in overrides:
        return []
    return [f"each KV head on several devices ({overrides[0]}): rules {', '.join(_SPLIT_RULES)} on "
            f"[tensor, {_REPLICA_AXIS}], kv_heads on [tensor]"]  # fmt: skip


def _mesh(config, replicas: int, tensor_axes: dict[str, int]) -> str:
    """The ``mesh.axes`` override of a serving layout: ``replicas`` x the ``tensor_axes``, the config's
    other axes (``fsdp``, ``context``, ...) kept at 1, so that partition rules naming them still hold."""
    axes = {**{axis: 1 for axis in config.mesh.axes}, "data": replicas, **tensor_axes}
    return "mesh.axes={" + ", ".join(f"{axis}: {size}" for axis, size in axes.items()) + "}"


def _best_batch(planner: Planner, config: Config, target: Target, label: str, layout: tuple[str, ...],
                replicas: int, objective: str) -> dict[str, Any] | None:  # fmt: skip
    """Plans one layout for ``target``: at the config's batch, and for throughput at the largest batch
    that fits. Returns its row (None when the compile budget ran out first)."""
    plans: dict[int, ServingPlan] = {}

    def planned(batch: int) -> ServingPlan | None:
        if batch not in plans:
            if planner.max_compiles - planner.compiles < 2:
                return None
            overrides = (*layout, f"serve.batch={batch}")
            planner.progress(f"planning {label}, batch {batch}")
            plans[batch] = plan_serving(config.replace(*overrides), target.name)  # Not memory.target.
            planner.compiles += 2
            p = plans[batch]
            why = f"{p.verdict}: {margin_text(p.margin_bytes)}"
            planner.note(f"{label}, batch {batch}", overrides, p.per_device["peak"], 0, None, p.fits,
                         "compiled", why, step_time=p.time.to_json() if p.time else None)  # fmt: skip
        return plans[batch]

    batch = config.serve.batch
    first = planned(batch)
    if first is None:
        return None
    chosen = first
    if objective == "throughput" and first.fits and first.capacity.max_batch > batch:
        points = [(batch, first)]
        guess = first.capacity.max_batch // replicas * replicas
        for _ in range(3):  # The room read off the first plan, then the line through the last two points.
            trial = planned(guess) if guess > batch else None
            if trial is None:
                break
            if trial.fits:
                chosen = trial
                break
            points.append((guess, trial))
            guess = room_limit(points[-2:]) // replicas * replicas
    return _row(chosen, label, layout)


def _row(plan: ServingPlan, label: str, layout: tuple[str, ...]) -> dict[str, Any]:
    time = plan.time
    return {
        "layout": label, "overrides": [*layout, f"serve.batch={plan.serve['batch']}"],
        "batch": plan.serve["batch"], "fits": plan.fits, "verdict": plan.verdict,
        "peak_bytes": plan.per_device["peak"], "kv_cache_bytes": plan.per_device["kv_cache"],
        "ttft": time.time_to_first_token if time else None,
        "mean_decode_seconds": time.mean_decode_seconds if time else None,
        "total_seconds": time.total_seconds if time else float("inf"),
        "tokens_per_second": time.output_tokens_per_second if time else 0.0,
        "budget_bytes": plan.budget_bytes, "report": plan.decode,
    }  # fmt: skip


def render_serving_tune(result: TuneResult):
    """The ranked serving layouts and the why, as a rich renderable."""
    from rich.console import Group
    from rich.table import Table
    from rich.text import Text

    table = Table(title="shardmem tune --search serve", title_justify="left", show_edge=False)
    for column in ("#", "layout", "batch", "peak / device", "first token", "decode step", "batch time",
                   "tokens/s"):  # fmt: skip
        table.add_column(column, justify="left" if column == "layout" else "right")
    for i, row in enumerate(result.ranked, 1):
        fits = row["fits"]
        table.add_row(str(i) if fits else "-", row["layout"], str(row["batch"]),
                      Text(format_bytes(row["peak_bytes"]), style=None if fits else "red"),
                      format_seconds(row["ttft"]) if row["ttft"] else "-",
                      format_seconds(row["mean_decode_seconds"]) if row["mean_decode_seconds"] else "-",
                      format_seconds(row["total_seconds"]) if fits else "over",
                      f"{row['tokens_per_second']:,.0f}")  # fmt: skip
    lines = [Text(result.explanation[0]), table]
    for how in ("skipped", "pruned"):
        trials = [t for t in result.trials if t.how == how]
        if trials:
            why = "; ".join(f"{t.candidate} ({t.reason})" for t in trials)
            lines.append(Text(f"{how}{', not compiled' if how == 'pruned' else ''}: {why}", style="dim"))
    style = "bold green" if result.found else "bold red"
    lines += [Text(line, style=style if i == 0 else None) for i, line in enumerate(result.explanation[1:])]
    return Group(*lines)
