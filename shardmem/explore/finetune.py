"""Tuning a fine-tune to its card: ``shardmem tune`` on a config with a ``finetune:`` section.

    result = tune(load_config("configs/llama3-8b-qlora.yaml"), target="rtx-4090")  # search="finetune"
    result.chosen.candidate     # what moved from the config's setting, e.g. "quantize none"
    result.costs                # what each knob's values cost against the config's own setting

The knobs are the LoRA rank, the frozen base's quantization (none, int8, nf4), a uniform remat policy,
the micro-batches of the global batch and, where ``min_seq_len`` allows it, shorter sequences (halvings
of ``model.seq_len``). The config's own setting is compiled first; then each knob alone is moved to each
of its other values and compiled: the difference to the config's peak and predicted step time is what
that value costs (the cost table). The quality knobs (base, sequence, rank) are then taken level by
level in order of preference; a level is feasible when it fits with the time knobs at their leanest
(full remat, the most micro-batches: memory only falls along those), compiled, and a level that needs
no less memory than one that failed is skipped. In the first feasible level the time knobs' settings
are estimated by adding their costs (weights, adapters and activations add up) and compiled fastest
first until one fits. The order of preference:

1. the least quantized base (none, int8, nf4, int4): quantization costs accuracy;
2. the longest sequence (shorter ones only where allowed): the sequence is what the model learns from;
3. the highest rank up to the config's (a higher one is costed, not chosen: the rank is the user's);
4. the shortest predicted step time: remat and micro-batches trade memory for time only.

Every figure shown as compiled was compiled; estimated combinations are never reported as fitting.
"""

from __future__ import annotations

import dataclasses
import itertools
import json
from typing import Any

from shardmem.config import Config
from shardmem.errors import ConfigError
from shardmem.explore.search import TuneResult, batch_shards, margin_text, no_fit, plan_budget
from shardmem.models.llama import ModelConfig
from shardmem.units import format_bytes, format_seconds

#: Base formats, the most faithful first (what the preference order reads).
QUANTIZATION = ("none", "int8", "nf4", "int4")
#: Uniform remat policies the search tries (offload is a layout question: ``--search remat``).
POLICIES = ("none", "dots", "minimal", "full")


@dataclasses.dataclass(frozen=True)
class Setting:
    """One value of one knob: its label, the overrides that set it (none for the config's own value),
    its place in the preference order (0: the most wanted; time-only knobs all 0) and whether the
    search may choose it (a rank above the config's is costed only)."""

    knob: str
    value: Any
    overrides: tuple[str, ...] = ()
    quality: int = 0
    choosable: bool = True

    @property
    def own(self) -> bool:
        return not self.overrides

    def describe(self) -> str:
        return f"{self.knob} {self.value}"


def knobs(config: Config, shards: int, min_seq_len: int | None = None) -> dict[str, list[Setting]]:
    """Returns each knob's settings, the config's own first, for a config with a ``finetune:`` section
    (``shards``: the batch shards a micro-batch is split over)."""
    ft = config.finetune
    out: dict[str, list[Setting]] = {}
    own_format = ft.quantize.format if ft.quantize else "none"
    formats = [own_format] + [f for f in QUANTIZATION[:3] if f != own_format]
    group = ft.quantize.group if ft.quantize else 64
    targets = ft.quantize.targets if ft.quantize else ["layers/*"]
    settings = []
    for fmt in formats:
        if fmt == own_format:
            overrides = ()
        elif fmt == "none":
            overrides = ("finetune.quantize=null",)
        else:
            section = {"format": fmt, "group": group, "targets": list(targets)}
            overrides = (f"finetune.quantize={json.dumps(section)}",)
        settings.append(Setting("quantize", fmt, overrides, QUANTIZATION.index(fmt)))
    out["quantize"] = settings

    if ft.lora is not None:
        rank, ratio = ft.lora.rank, ft.lora.alpha / ft.lora.rank

        def rank_setting(r: int, quality: int, choosable: bool = True) -> Setting:
            # alpha follows the rank: alpha / rank, the adapters' scale, stays the config's.
            overrides = () if r == rank else (f"finetune.lora.rank={r}", f"finetune.lora.alpha={r * ratio:g}")
            return Setting("rank", r, overrides, quality, choosable)

        ranks = [rank_setting(rank, 0)]
        if rank >= 2:
            ranks.append(rank_setting(rank // 2, 1))
        ranks.append(rank_setting(2 * rank, 0, choosable=False))
        out["rank"] = ranks

    own_remat = config.remat.policy if not config.remat.layers else config.remat_plan().describe()
    remat = [Setting("remat", own_remat)]
    for policy in POLICIES:
        if policy != own_remat:
            remat.append(Setting("remat", policy, (f"remat.policy={policy}", "remat.layers={}")))
    out["remat"] = remat

    batch, k = config.train.global_batch, config.train.micro_batches
    counts = [c for c in range(1, batch + 1) if batch % c == 0 and (batch // c) % shards == 0]
    if len(counts) > 1 and k in counts:
        i = counts.index(k)
        near = counts[max(i - 1, 0) : i] + counts[i + 1 : i + 3]  # One fewer, two more.
        out["micro_batches"] = [Setting("micro_batches", k)] + [
            Setting("micro_batches", c, (f"train.micro_batches={c}",)) for c in near
        ]

    if min_seq_len is not None:
        if not isinstance(config.model, ModelConfig):
            raise ConfigError(
                f"--min-seq-len {min_seq_len}: a model of your own sets its own sequence length; "
                "shorten it in your batch and leave --min-seq-len out"
            )
        seq = config.model.seq_len
        if min_seq_len < 1 or min_seq_len > seq:
            raise ConfigError(f"--min-seq-len {min_seq_len}: use a length from 1 to model.seq_len={seq}")
        lengths = [seq]
        while lengths[-1] % 2 == 0 and lengths[-1] // 2 >= min_seq_len:
            lengths.append(lengths[-1] // 2)
        out["seq_len"] = [Setting("seq_len", s, () if s == seq else (f"model.seq_len={s}",), i)
                          for i, s in enumerate(lengths)]  # fmt: skip
    return out


@dataclasses.dataclass(frozen=True)
class Point:
    """A compiled setting's figures."""

    peak_bytes: int
    fits: bool
    seconds: float | None
    trainable_bytes: int
    frozen_bytes: int


#: A combination estimated this far over the budget is not compiled (its knobs' costs add up roughly).
_ESTIMATE_REJECT = 1.15


def _overrides(chosen: dict[str, Setting]) -> tuple[str, ...]:
    return tuple(o for s in chosen.values() for o in s.overrides)


def _at(points: dict, chosen: dict[str, Setting]) -> Point | None:
    return points.get(_overrides(chosen))


def point_of(report) -> Point:
    step = getattr(report, "step_time", None)
    per_device = report.per_device
    return Point(per_device["peak"], report.fits, step.seconds if step else None,
                 per_device.get("params", 0), per_device.get("frozen", 0))  # fmt: skip


def tune_finetune(planner, target, min_seq_len: int | None = None):
    """The fine-tuning knob search (see the module docstring); returns a TuneResult."""
    config = planner.base
    if not config.finetune.active:
        raise ConfigError(
            "shardmem tune --search finetune tunes a fine-tune: add a finetune section (finetune.lora "
            "or finetune.freeze) to the config, or use --search remat"
        )
    budget = plan_budget(config, target)
    settings = knobs(config, batch_shards(config, target), min_seq_len)
    own = {name: values[0] for name, values in settings.items()}

    def name_of(chosen: dict[str, Setting]) -> str:
        moved = [s.describe() for s in chosen.values() if not s.own]
        return ", ".join(moved) or "the config's own setting"

    points: dict[tuple[str, ...], Point] = {}

    def compile_(chosen: dict[str, Setting]) -> Point | None:
        overrides = _overrides(chosen)
        if not overrides:  # The config's own setting: its errors are the user's to see.
            points[overrides] = point_of(planner.compile(name_of(chosen), overrides))
        if overrides not in points:
            if planner.exhausted:
                return None
            try:
                points[overrides] = point_of(planner.compile(name_of(chosen), overrides))
            except ConfigError as e:  # A value this model cannot take (a group that does not divide).
                planner.note(name_of(chosen), overrides, None, None, None, False, "skipped", str(e))
                return None
        return points[overrides]

    base = compile_(own)
    costs: list[dict[str, Any]] = []
    deltas: dict[tuple[str, Any], tuple[int, float | None]] = {}
    for name, values in settings.items():
        for setting in values:
            point = base if setting.own else compile_({**own, name: setting})
            if point is None:
                costs.append({"knob": name, "value": setting.value, "own": setting.own, "how": "skipped"})
                continue
            step = point.seconds - base.seconds if point.seconds is not None and base.seconds else None
            deltas[(name, setting.value)] = (point.peak_bytes - base.peak_bytes, step)
            costs.append({
                "knob": name, "value": setting.value, "own": setting.own, "how": "compiled",
                "peak_bytes": point.peak_bytes, "delta_peak_bytes": point.peak_bytes - base.peak_bytes,
                "seconds": point.seconds, "delta_seconds": step, "fits": point.fits,
                "trainable_bytes": point.trainable_bytes, "frozen_bytes": point.frozen_bytes,
            })  # fmt: skip

    # Quality levels (base format x sequence x rank), the most wanted first. A level is feasible when
    # it fits with the time knobs at their leanest (full remat, the most micro-batches): memory only
    # falls along those two. Within the first feasible level, the time knobs are estimated from their
    # costs at the config's own level (differences add up), and compiled fastest first until one fits.
    quality_knobs = [k for k in ("quantize", "seq_len", "rank") if k in settings]
    time_knobs = [k for k in ("remat", "micro_batches") if k in settings]

    def costed(name: str) -> list[Setting]:
        return [v for v in settings[name] if v.choosable and (name, v.value) in deltas]

    def leanest(name: str) -> Setting:
        values = costed(name)
        if name == "remat":
            return next((v for v in values if v.value == "full"), None)
        return max(values, key=lambda v: v.value)

    levels = sorted(itertools.product(*(costed(k) for k in quality_knobs)),
                    key=lambda combo: tuple(v.quality for v in combo))  # fmt: skip
    lean = {k: leanest(k) for k in time_knobs}
    lean = {k: v for k, v in lean.items() if v is not None}
    failed: list[dict[str, Setting]] = []
    best = None

    def dominated(level: dict[str, Setting]) -> bool:
        """Whether a level known not to fit needs no more memory than this one (same base format, a
        sequence and a rank no longer)."""
        return any(f["quantize"].value == level["quantize"].value
                   and all(level[k].value >= f[k].value for k in ("seq_len", "rank") if k in level)
                   for f in failed)  # fmt: skip

    for combo in levels:
        level = {v.knob: v for v in combo}
        if dominated(level):
            continue
        at_own = {**own, **level}
        point = _at(points, at_own)
        if point is None or not point.fits:
            point = compile_({**at_own, **lean})
            if point is None:
                break  # The compile budget is spent.
            if not point.fits:
                failed.append(level)
                continue
        # Feasible: the fastest time setting estimated to fit, confirmed by a compile.
        options = []
        for times in itertools.product(*(costed(k) for k in time_knobs)):
            chosen = {**at_own, **{v.knob: v for v in times}}
            peak_moves = sum(deltas[(v.knob, v.value)][0] for v in times)
            time_moves = sum(deltas[(v.knob, v.value)][1] or 0.0 for v in times)
            options.append((time_moves, peak_moves, chosen))
        # Estimates start from a compiled point of this level, less its own time knobs' moves.
        ref = at_own if _at(points, at_own) else {**at_own, **lean}
        moved = sum(deltas[(ref[k].knob, ref[k].value)][0] for k in time_knobs)
        ref_peak = _at(points, ref).peak_bytes - moved
        for _, peak_moves, chosen in sorted(options, key=lambda o: o[0]):
            compiled = _at(points, chosen)
            if compiled is None and ref_peak + peak_moves > budget * _ESTIMATE_REJECT:
                continue
            found = compiled or compile_(chosen)
            if found is not None and found.fits:
                best = (chosen, _overrides(chosen), found)
                break
        if best is None:  # The budget ran out before a faster one: the lean setting is known to fit.
            chosen = {**at_own, **lean} if _at(points, {**at_own, **lean}) else at_own
            best = (chosen, _overrides(chosen), _at(points, chosen))
        break

    if best is None:
        smallest = min(points.values(), key=lambda p: p.peak_bytes)
        spent = " (the compile budget is spent: raise --max-compiles)" if planner.exhausted else ""
        result = no_fit(planner, target, budget, "finetune", [
            f"no fine-tuning setting tried fits{spent}: the smallest peak compiled is "
            f"{format_bytes(smallest.peak_bytes)} against a budget of {format_bytes(budget)}",
            "quantize the base (finetune.quantize.format=nf4), lower train.global_batch, allow shorter "
            "sequences (--min-seq-len), or shard over more devices",
        ])  # fmt: skip
        return dataclasses.replace(result, costs=costs)

    chosen, overrides, point = best
    report = planner.reports[overrides]
    trial = next(t for t in reversed(planner.trials) if t.overrides == overrides and t.how == "compiled")
    choice = ", ".join(s.describe() for s in chosen.values())
    step = f", predicted {format_seconds(point.seconds)} per step" if point.seconds else ""
    explanation = [
        f"budget {format_bytes(budget)} per device on {target.label}",
        f"chose {choice}: peak {format_bytes(point.peak_bytes)}, {margin_text(report.margin_bytes)}{step}; "
        f"trainable {format_bytes(point.trainable_bytes)}, frozen {format_bytes(point.frozen_bytes)}",
        "the config's own setting ("
        + ", ".join(s.describe() for s in own.values())
        + f"): peak {format_bytes(base.peak_bytes)}, {'fits' if base.fits else 'does not fit'}"
        + (f", {format_seconds(base.seconds)} per step" if base.seconds else ""),
        "preference: the least quantized base, the longest sequence, the config's rank, then the "
        "fastest step",
        f"{planner.compiles} compiles",
    ]
    tuned = planner.base.replace(*overrides)
    return TuneResult("finetune", tuned, report, trial, planner.trials, planner.compiles, budget,
                      target.label, explanation, costs=costs)  # fmt: skip


def render_costs(result):
    """The knob-cost table, the compiled combinations and the explanation as a rich renderable."""
    from rich.console import Group
    from rich.table import Table
    from rich.text import Text

    table = Table(title="shardmem tune --search finetune: what each knob costs against the config's own "
                  "setting", title_justify="left", show_edge=False)  # fmt: skip
    columns = ("knob", "value", "peak / device", "Δ peak", "trainable", "frozen", "step", "Δ step", "verdict")
    for column in columns:
        table.add_column(column, justify="left" if column in ("knob", "value", "verdict") else "right")
    for row in result.costs:
        value = f"{row['value']}" + (" (config)" if row["own"] else "")
        if row["how"] != "compiled":
            table.add_row(row["knob"], value, *["-"] * 6, "skipped: compile budget spent")
            continue
        seconds, delta = row["seconds"], row["delta_seconds"]
        table.add_row(
            row["knob"], value, format_bytes(row["peak_bytes"]),
            "" if row["own"] else _signed_bytes(row["delta_peak_bytes"]),
            format_bytes(row["trainable_bytes"]), format_bytes(row["frozen_bytes"]),
            format_seconds(seconds) if seconds else "-",
            "" if row["own"] or delta is None else ("+" if delta >= 0 else "-") + format_seconds(abs(delta)),
            Text("fits", style="green") if row["fits"] else Text("over", style="red"),
        )  # fmt: skip
    combined = [t for t in result.trials if t.how == "compiled" and t.candidate.count(",")]
    style = "bold green" if result.found else "bold red"
    lines = [Text(result.explanation[0]), table]
    if combined:
        lines.append(Text("combinations compiled: " + "; ".join(
            f"{t.candidate} ({format_bytes(t.peak_bytes)}, {'fits' if t.fits else 'over'})"
            for t in combined), style="dim"))  # fmt: skip
    lines += [Text(line, style=style if i == 0 else None) for i, line in enumerate(result.explanation[1:])]
    return Group(*lines)


def _signed_bytes(delta: int) -> str:
    return ("+" if delta >= 0 else "-") + format_bytes(abs(delta))
