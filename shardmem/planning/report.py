"""Rendering memory reports and sharding tables for people (rich tables on the terminal)."""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from typing import Any

from rich.console import Group
from rich.table import Table
from rich.text import Text

from shardmem.errors import DoesNotFit
from shardmem.parallel.pipeline import Pipeline
from shardmem.parallel.rules import ShardingRow
from shardmem.planning.memory import MemoryReport
from shardmem.planning.serving import ServingPlan
from shardmem.units import format_bytes, format_flops, format_seconds

_LABELS = {
    "params": "parameters",
    "frozen": "frozen parameters",
    "optimizer": "optimizer state",
    "model_state": "model state (statistics, RNG)",
    "batch": "batch",
    "kv_cache": "KV cache",
    "outputs": "outputs",
    "temp": "temporaries (activations, workspace)",
    "alias": "aliased with inputs (donated)",
    "host": "host memory (offloaded)",
    "code": "generated code",
    "peak": "peak",
}


#: What to try when a training step does not fit (``render``'s default advice).
TRAINING_ADVICE = ("next: shard more (mesh.axes.fsdp over more devices), recompute more (remat.policy=full), "
                   "add train.micro_batches or lower train.global_batch; shardmem tune with the same config "
                   "and --target searches these")  # fmt: skip
#: What to try when serving does not fit.
SERVING_ADVICE = ("next: lower serve.batch or serve.max_len, store the cache in int8 (serve.kv_dtype=int8), "
                  "quantize the weights (serve.quantize) or split them over more devices (mesh.axes.tensor); "
                  "shardmem plan --serve --capacity finds the largest batch, shardmem tune --search serve "
                  "the layout")  # fmt: skip


def render(report: MemoryReport, *, sharding: bool = False, advice: str = TRAINING_ADVICE) -> Group:
    """Returns the report as a rich renderable: per-device figures, verdict, FLOPs, live buffers;
    ``advice`` is printed when it does not fit (none where empty)."""
    parts: list = []
    mesh = " ".join(f"{axis}={size}" for axis, size in report.mesh.items())
    head = Text.assemble(("shardmem plan", "bold"), f"  {report.name}  ·  {report.target}: ",
                         report.target_label)  # fmt: skip
    parts.append(head)
    parts.append(Text(f"mesh {mesh}" + (f"   remat {report.remat}" if report.remat else "")))
    if report.attention:
        parts.append(Text(f"attention {report.attention}"))
    if report.tensor_parallel:
        parts.append(Text(f"tensor parallel: {report.tensor_parallel}"))
    if report.pipeline:
        parts.append(Text(_pipeline_line(report.pipeline)))

    table = Table(title="Per device", title_justify="left", show_edge=False, pad_edge=False)
    table.add_column("")
    table.add_column("bytes", justify="right")
    table.add_column("", justify="right", style="dim")
    for key, label in _LABELS.items():
        value = report.per_device.get(key, 0)
        if key in ("model_state", "frozen", "kv_cache") and not value:
            continue
        sign = "-" if key == "alias" and value else ""
        share = ""
        if key == "peak":  # A cpu target's "device" is a share of this machine's RAM, not a GPU.
            share = f"{value / report.device_memory_bytes:.1%} of " + ("its RAM share" if report.approximate
                                                                      else "device")  # fmt: skip
        style = "bold" if key == "peak" else None
        table.add_row(Text(label, style=style), Text(sign + format_bytes(value), style=style), share)
    parts.append(table)

    if report.approximate:
        parts.append(Text("approximate: compiled for CPU, not a GPU prediction; the cpu target's budget is "
                          "this machine's RAM shared by the simulated devices", style="yellow"))  # fmt: skip
    verdict = {"fits": "FITS", "tight": "TIGHT, LIKELY FITS", "does not fit": "DOES NOT FIT"}[report.verdict]
    how = "to spare" if report.fits else "over budget"
    style = {"fits": "bold green", "tight": "bold yellow", "does not fit": "bold red"}[report.verdict]
    device = f"device {format_bytes(report.device_memory_bytes)}"
    if report.approximate:
        device = (f"this machine's RAM / {report.devices} simulated devices = "
                  f"{format_bytes(report.device_memory_bytes)}")  # fmt: skip
    parts.append(Text.assemble(
        "budget ", format_bytes(report.budget_bytes),
        f" ({device} x {_usable_terms(report)}{_margin_terms(report)}): ",
        (verdict, style),
        f", {format_bytes(abs(report.margin_bytes))} {how}",
    ))  # fmt: skip
    if report.tight:
        parts.append(Text(_tight_line(report), style="yellow"))
    elif not report.fits and advice:  # What to try next, as the TPU compiler's refusal says it.
        parts.append(Text(advice, style="red"))

    flops = f"FLOPs per step {format_flops(report.flops_per_step)} (matmuls, all devices"
    if report.attention.startswith(("pallas", "cudnn")):  # Their matmuls are inside one fused kernel.
        flops += ", fused attention from its shapes"
    if report.recompute_overhead is not None:
        flops += f"; recomputation +{report.recompute_overhead:.1%} over the model's"
    if report.pipeline.get("schedule") in ("1f1b", "interleaved"):  # Each op as often as the table runs it.
        flops += "; each stage's ops as the schedule runs them"
    elif report.pipeline:  # Idle stages still run their layers, on the fill and drain's placeholders.
        flops += "; the bubble's idle-stage work included"
    parts.append(Text(flops + ")"))
    moved = {k: v for k, v in report.collectives.items() if v}
    if moved:
        parts.append(Text("collectives per step per device: " + ", ".join(
            f"{kind} {format_bytes(v)}" for kind, v in moved.items())))  # fmt: skip
    parts += _step_time_lines(report)
    if report.load_host_bytes:
        parts.append(Text(f"loading finetune.init_from holds at most {format_bytes(report.load_host_bytes)} "
                          "of host memory at once (one device's block of one parameter, as read and "
                          "converted)"))  # fmt: skip
    check = report.cross_check
    if "analytic_argument_bytes" in check:
        ok = "matches" if check["matches"] else "DIFFERS FROM"
        if check.get("tile_padding_bytes"):
            ok += f", padded to TPU tiles (+{format_bytes(check['tile_padding_bytes'])}),"
        parts.append(Text(
            f"cross-check: parameters + optimizer + batch from shapes and shardings "
            f"({format_bytes(check['analytic_argument_bytes'])}) {ok} XLA's arguments "
            f"({format_bytes(check['compiled_argument_bytes'])})"
        ))  # fmt: skip

    if report.top_buffers:
        live = Table(title="Largest buffers live at the peak", title_justify="left",
                     show_edge=False, pad_edge=False)  # fmt: skip
        live.add_column("bytes", justify="right")
        live.add_column("shape")
        live.add_column("made by (scope)")
        for buffer in report.top_buffers:
            live.add_row(format_bytes(buffer.bytes), buffer.shape, buffer.scope)
        parts.append(live)
    if sharding and report.sharding:
        parts.append(render_sharding(report.sharding))
    for warning in report.warnings:
        parts.append(Text(f"warning: {warning}", style="yellow"))
    options = ", ".join(f"{k}={v}" for k, v in report.compiler_options.items())
    parts.append(Text(f"compiled in {report.compile_seconds:.1f} s by JAX {report.jax_version}"
                      + (f" with {options}" if options else ""), style="dim"))  # fmt: skip
    return Group(*parts)


def render_serving(plan: ServingPlan, *, sharding: bool = False) -> Group:
    """Returns a serving plan as a rich renderable: what serving holds per device and its verdict, then
    the prefill's and the decode step's reports."""
    serve = plan.serve
    quantized = f", weights {serve['quantize']['format']}" if serve.get("quantize") else ""
    name = plan.decode.name.removesuffix(": decode")
    head = Text.assemble(("shardmem plan --serve", "bold"), f"  {name}  ·  {plan.decode.target}: ",
                         plan.decode.target_label)  # fmt: skip
    what = Text(f"serve batch {serve['batch']}, prompts of {serve['prompt_len']}, room for "
                f"{serve['max_len']} positions per sequence, KV cache {serve['kv_dtype']}"
                + quantized)  # fmt: skip
    table = Table(title="Serving, per device", title_justify="left", show_edge=False, pad_edge=False)
    table.add_column("")
    table.add_column("bytes", justify="right")
    table.add_column("", style="dim")
    figures = plan.per_device
    rows = (("weights", "weights", "held throughout"), ("KV cache", "kv_cache", "held throughout"),
            ("prefill temporaries", "prefill_temp", ""), ("decode temporaries", "decode_temp", ""),
            ("prefill peak", "prefill_peak", "the cache donated, written in place"),
            ("decode peak", "decode_peak", "the cache donated, updated in place"))  # fmt: skip
    for label, key, note in rows:
        table.add_row(label, format_bytes(figures[key]), note)
    table.add_row(Text("peak", style="bold"), Text(format_bytes(figures["peak"]), style="bold"),
                  f"the {plan.peaked_function}'s: one function runs at a time")  # fmt: skip
    verdict = {"fits": "FITS", "tight": "TIGHT, LIKELY FITS", "does not fit": "DOES NOT FIT"}[plan.verdict]
    style = {"fits": "bold green", "tight": "bold yellow", "does not fit": "bold red"}[plan.verdict]
    binding = plan.binding
    margin = (f", less {binding.deviceless_margin:g} x the {plan.binding_function}'s temporaries"
              if binding.margin_on_temporaries else "")  # fmt: skip
    fit = Text.assemble("budget ", format_bytes(plan.budget_bytes),
                        f" (usable {format_bytes(binding.usable_bytes)}{margin})" if margin else "", ": ",
                        (verdict, style),
                        f" (prefill {plan.prefill.verdict}, decode {plan.decode.verdict})")  # fmt: skip
    warnings = [Text(f"warning: {w}", style="yellow") for w in plan.warnings]
    advice = [Text(SERVING_ADVICE, style="red")] if plan.verdict == "does not fit" else []
    parts: list = [head, what, table, fit, *advice, *warnings, *_serving_time(plan), *_serving_capacity(plan)]
    shared = plan.shared_warnings
    for report in (plan.prefill, plan.decode):  # The serving advice and the shared warnings above, once.
        own = dataclasses.replace(report, warnings=[w for w in report.warnings if w not in shared])
        parts += [Text(""), render(own, sharding=sharding and report is plan.decode, advice="")]
    return Group(*parts)


def _serving_time(plan: ServingPlan) -> list:
    """The static batch's predicted times, each decode step beside its HBM bound."""
    time = plan.time
    if time is None:
        return [Text(plan.decode.step_time_note or "no time estimate for this target", style="dim")]
    table = Table(title=f"Time, a static batch of {time.batch} x {time.output_len} new tokens",
                  title_justify="left", show_edge=False, pad_edge=False)  # fmt: skip
    table.add_column("")
    table.add_column("predicted", justify="right")
    table.add_column("HBM bound", justify="right")
    table.add_column("", style="dim")
    table.add_row("time to first token", format_seconds(time.time_to_first_token), "", "the prefill")
    for label, context in zip(("first decode step", "last decode step"), time.contexts, strict=True):
        table.add_row(label, format_seconds(time.decode_seconds(context)),
                      format_seconds(time.bound_seconds(context)), f"{context:,} live positions")  # fmt: skip
    table.add_row("whole batch", format_seconds(time.total_seconds), "", "prefill and every decode step")
    table.add_row(Text("output tokens/s", style="bold"), Text(f"{time.output_tokens_per_second:,.0f}",
                  style="bold"), "", "new tokens of every sequence, prefill included")  # fmt: skip
    return [Text(""), table]


def _serving_capacity(plan: ServingPlan) -> list:
    """What the KV cache has room for beside the weights and the temporaries."""
    room = plan.capacity
    if room is None:
        return []
    how = "compiled and fit" if room.verified else "from this plan's bytes per token; --capacity compiles"
    if plan.ring is None:
        held = f"{room.tokens:,} positions of {format_bytes(room.bytes_per_token)}"
    else:  # The sliding layers keep their window's positions: a sequence's share of them is fixed.
        stack = f", then {format_bytes(room.bytes_per_token)} a position" if room.bytes_per_token else ""
        held = (
            f"{format_bytes(room.bytes_per_sequence)} a sequence for the window of its "
            f"{plan.ring['layers']} sliding layers ({plan.ring['window']:,} positions){stack}"
        )
    longest = "any serve.max_len" if room.max_len is None else f"serve.max_len={room.max_len:,}"
    lines = (f"KV cache room per device: {format_bytes(room.cache_bytes)}: {held}; at most "
             f"serve.batch={room.max_batch:,} at serve.max_len={plan.serve['max_len']:,}, {longest} at "
             f"serve.batch={plan.serve['batch']:,} ({how})")  # fmt: skip
    return [Text(lines)]


def render_refused(error: DoesNotFit, name: str, target: str) -> Group:
    """Returns what is known per chip of a step libtpu refused as over the chip's HBM (no report): the
    bytes from shapes and shardings, and the figures libtpu's message states."""
    table = Table(title=f"shardmem plan  {name}  ·  {target}: libtpu refused the step; per chip",
                  title_justify="left", show_edge=False, pad_edge=False)  # fmt: skip
    table.add_column("")
    table.add_column("bytes", justify="right")
    table.add_column("", style="dim")
    for key, value in error.per_device.items():
        if value or key not in ("model_state", "frozen", "kv_cache"):
            table.add_row(_LABELS[key], format_bytes(value), "from shapes and shardings")
    for label, value in (("temporaries (HLO temporaries, libtpu)", error.required_bytes),
                         ("available HBM (libtpu)", error.available_bytes)):  # fmt: skip
        if value is not None:
            table.add_row(label, format_bytes(value), "libtpu's message")
    known = sum(error.per_device.values()) + (error.required_bytes or 0)
    parts: list = [table]
    if error.required_bytes is not None and error.per_device:
        parts.append(Text(f"at least {format_bytes(known)} per chip in all (a lower bound: libtpu stops at "
                          "its first shortfall); no compiled step, so no buffers or step time",
                          style="red"))  # fmt: skip
    return Group(*parts)


def _usable_terms(report: MemoryReport) -> str:
    """The usable share of the device as the budget took it: "0.9 - 1.00 GiB reserve" (the allocator's
    limit where it is lower; the words alone for a report that does not carry the numbers)."""
    if not report.usable_fraction:
        return "usable fraction - reserve"
    terms = f"{report.usable_fraction:g}" + (f" - {format_bytes(report.reserve_bytes)} reserve"
                                             if report.reserve_bytes else "")  # fmt: skip
    share = int(report.device_memory_bytes * report.usable_fraction) - report.reserve_bytes
    capped = 0 < report.usable_bytes < share
    return terms + (", capped by the allocator" if capped else "")


def _margin_terms(report: MemoryReport) -> str:
    """How the budget takes the deviceless margin: over the whole budget (a training step), or on the
    temporaries alone (a serving function, whose weights and cache are exact)."""
    if not report.deviceless_margin:
        return ""
    if report.margin_on_temporaries:
        return (f", less {report.deviceless_margin:g} x its {format_bytes(report.per_device['temp'])} of "
                "temporaries: the deviceless margin")  # fmt: skip
    return f", / {1 + report.deviceless_margin:g} deviceless margin"


def _tight_line(report: MemoryReport) -> str:
    """Why a tight plan likely fits, and why it may not."""
    spare = report.usable_bytes - report.per_device["peak"]
    return (
        f"tight: {format_bytes(spare)} under what the device has for the step "
        f"({format_bytes(report.usable_bytes)}: device x {_usable_terms(report)}), over the budget only by "
        f"the deviceless margin ({report.deviceless_margin:g}). The margin covers the largest gap measured "
        "between a deviceless compile and the real GPU's (+15.5%, in one configuration; the others within "
        "2.2%), so this likely fits, but it may not: plan with --target local on the GPU for an exact "
        "verdict, or make room (remat.policy, mesh.axes.fsdp, train.micro_batches)"
    )


def _step_time_lines(report: MemoryReport) -> list[Text]:
    """The predicted step time: the estimate with its breakdown and bounds, and the costliest collectives."""
    st = report.step_time
    if st is None:
        return [Text(f"step time: {report.step_time_note}", style="dim")] if report.step_time_note else []
    band = f" (±{st.uncertainty:.0%} against measured steps)" if st.uncertainty else ""
    lines = [Text.assemble(("predicted step time ", "bold"), (st.summary(), "bold"), band)]
    bounds = (
        f"  bounds: {format_seconds(st.full_overlap_seconds)} if communication hid entirely, "
        f"{format_seconds(st.no_overlap_seconds)} if nothing overlapped; communication "
        f"{format_seconds(st.communication)} in all, {format_seconds(st.exposed_communication)} exposed"
    )
    if st.host_transfers:
        bounds += (f"; host transfers {format_seconds(st.host_transfers)}, "
                   f"{format_seconds(st.exposed_host_transfers)} exposed")  # fmt: skip
    if st.bubble:
        bounds += f"; pipeline bubble {format_seconds(st.bubble)} of it"
    lines.append(Text(bounds, style="dim"))
    if st.links:
        lines.append(Text(f"  links: {st.links['description']}", style="dim"))
    costly = sorted(st.collectives, key=lambda c: -c.seconds)[:3]
    if costly and costly[0].seconds:
        lines.append(Text("  costliest collectives: " + "; ".join(
            f"{c.kind} over {c.group_size} ({c.link}{', ' + c.algorithm if c.algorithm else ''}) x{c.count}: "
            f"{format_bytes(c.bytes)}, "
            f"{format_seconds(c.seconds)}" for c in costly if c.seconds), style="dim"))  # fmt: skip
    layer = max(st.loops, key=lambda loop: loop.trips * loop.seconds_per_trip, default=None)
    if layer is not None and layer.trips > 1:
        lines.append(Text(f"  one trip of {layer.scope} (x{layer.trips}): "
                          f"{format_seconds(layer.seconds_per_trip)} per trip, "
                          f"{format_seconds(layer.exposed_communication_per_trip)} exposed communication",
                          style="dim"))  # fmt: skip
    if report.step_time_note:
        lines.append(Text(f"  model: {report.step_time_note}", style="dim"))
    return lines


def _pipeline_line(pipeline: dict[str, Any]) -> str:
    stages = pipeline["stages"]
    line = (f"pipeline {Pipeline.from_json(pipeline).describe()}; every stage runs the same program on "
            "same-shaped buffers, so the peak per device is the worst stage's")  # fmt: skip
    counts = pipeline.get("layers_per_stage")
    if not counts:
        return line
    line += f"; stages of {', '.join(map(str, counts))} layers"
    padded = pipeline["padded_slots"]
    if padded:  # Every stage runs max(counts) slots; the others' extra slots run masked.
        slots = stages * max(counts)
        line += (f", {max(counts)} slots each: {padded} padded slot{'s' * (padded > 1)} of {slots} run "
                 f"masked ({padded / slots:.1%} of the layer work, in the FLOPs)")  # fmt: skip
    if not pipeline.get("layers_sharded_over_stage", True):
        line += (f"; {sum(counts)} layers do not divide into {stages} stages, so every stage stores all "
                 "of them (replicated over stage) and picks its own")  # fmt: skip
    return line


def render_sharding(rows: Sequence[ShardingRow]) -> Table:
    """Returns the sharding table: path, shape, logical axes, PartitionSpec, bytes per device."""
    table = Table(title="Parameter sharding", title_justify="left", show_edge=False, pad_edge=False)
    for column in ("parameter", "shape", "logical axes", "PartitionSpec"):
        table.add_column(column)
    table.add_column("per device", justify="right")
    for row in rows:
        spec = ", ".join("-" if e is None else str(e) for e in row.spec) or "replicated"
        table.add_row(row.path, "x".join(map(str, row.shape)), ", ".join(map(str, row.logical)),
                      spec, format_bytes(row.bytes_per_device))  # fmt: skip
    return table


def sharding_json(rows: Sequence[ShardingRow]) -> list[dict[str, Any]]:
    """Returns the sharding table as JSON-ready rows (``plan --json --sharding``); a PartitionSpec entry is
    null (replicated), a mesh axis name, or a list of them."""
    return [
        {"path": row.path, "shape": list(row.shape), "dtype": row.dtype, "logical": list(row.logical),
         "spec": [list(e) if isinstance(e, tuple) else e for e in row.spec],
         "bytes_per_device": row.bytes_per_device, "bytes_total": row.bytes_total}
        for row in rows
    ]  # fmt: skip
