"""Choosing the layout that trains fastest: ``shardmem tune --search layout``.

    result = tune(load_config("configs/llama-70b.yaml"), search="layout")
    result.config.mesh.axes, result.report.step_time.seconds, result.explanation

For the config's devices and hosts, every layout is enumerated: the device count factored over the
mesh axes ``stage, data, fsdp, context, expert, tensor`` (outermost first, so that the outer axes span
hosts and ``tensor`` stays inside one), with the micro-batches, a uniform remat policy, ZeRO-1 where
the batch axes replicate parameters, the pipeline schedule where there are stages (GPipe or 1F1B, or with
``pipeline.repeats`` > 1 circular or interleaved) and sequence parallelism where there is a tensor axis.
Candidates that cannot be built are dropped by arithmetic (tensor inside a host and
dividing the heads, context dividing the sequence, expert dividing the experts, the
batch dividing over its shards). Each remaining candidate gets a pruning estimate of its peak memory
and step time from a few traced quantities (FLOPs and backward residuals per policy, parameter bytes)
and the standard communication volumes of each parallelism; the estimates are refitted to every
compile made. The config as written is compiled first (its rules, per-layer remat and stages as they
are): the baseline the choice is compared with, shown whether or not it fits. The most promising layouts
are then compiled (in parallel worker processes, like ``sweep``), their memory confirmed by XLA and their
step time predicted from the compiled HLO (:mod:`shardmem.planning.cost`), one variant per mesh, then the
best mesh with each other remat policy; the fitting ones are ranked by the objective, all at the config's
global batch (a layout that cannot hold it at once accumulates over more micro-batches). So that compiled
plans, not the estimates, compare the families (:data:`FAMILIES`: FSDP, tensor x sequence parallel, 1F1B
pipelines, context parallel), the best-looking layout of each buildable family is compiled too, within
the compile budget, and returned with the estimate it was compiled on.

The estimates only order and prune: every layout shown with a step time was compiled.
"""

from __future__ import annotations

import dataclasses
import functools
import itertools
import math
import os
from collections.abc import Callable, Sequence
from typing import Any

import numpy as np

from shardmem.config import Config, layer_index_error
from shardmem.errors import ConfigError
from shardmem.parallel.pipeline import Pipeline
from shardmem.planning.collectives import Group, ring_bandwidth
from shardmem.planning.cost import MATMUL_EFFICIENCY
from shardmem.units import clip, format_bytes, format_seconds

#: Mesh axes of a layout, outermost (across hosts) first.
AXES = ("stage", "data", "fsdp", "context", "expert", "tensor")
OBJECTIVES = ("step_time", "throughput")
#: A candidate estimated this far over the budget is not compiled (the estimates are refitted as
#: compiles come in, but start rough).
_ESTIMATE_REJECT = 1.25
#: The pipeline schedules a layout may take, by whether the config runs layer chunks (pipeline.repeats > 1).
_SCHEDULES = {False: ("gpipe", "1f1b"), True: ("circular", "interleaved")}


@dataclasses.dataclass(frozen=True)
class Layout:
    """One candidate: mesh sizes by axis, micro-batches, a uniform remat policy, ZeRO-1, the pipeline
    schedule (with a stage axis) and sequence parallelism (with a tensor axis); or, with ``own``, the
    config as written (its rules, per-layer remat and stages too), described by ``remat``."""

    sizes: tuple[tuple[str, int], ...]
    micro_batches: int
    policy: str
    zero1: bool = False
    global_batch: int | None = None  # None: the config's.
    schedule: str | None = None  # pipeline.schedule with a stage axis (None: no pipeline).
    sequence: bool = False  # Sequence parallelism: rules.residual_seq over the tensor axis too.
    own: bool = False
    remat: str = ""  # The own layout's remat plan, as RematPlan.describe() gives it.

    @property
    def axes(self) -> dict[str, int]:
        return {a: 1 for a in AXES} | dict(self.sizes)

    def overrides(self, config: Config) -> tuple[str, ...]:
        if self.own:  # The config as written: nothing replaced but a grown batch.
            return () if self.global_batch is None else (f"train.global_batch={self.global_batch}",)
        axes = ", ".join(f"{a}: {n}" for a, n in self.sizes)
        rules = "rules={residual_seq: [context, tensor]}" if self.sequence else "rules={}"
        out = (f"mesh.axes={{{axes}}}", rules, "param_rules={}",
               f"train.micro_batches={self.micro_batches}",
               f"remat.policy={self.policy}", "remat.layers={}", "pipeline.stages=null",
               f"pipeline.schedule={self.schedule or 'null'}",
               f"optimizer.shard_over_data={str(self.zero1).lower()}")  # fmt: skip
        if config.overlap.tensor_parallel and (not self.sequence or self.schedule):
            out += ("overlap.tensor_parallel=false",)  # It needs sequence parallelism and no pipeline.
        if self.global_batch is not None:
            out += (f"train.global_batch={self.global_batch}",)
        return out

    def batch(self, config: Config) -> int:
        """The global batch this layout runs (its micro-batches split it): the config's unless grown."""
        return self.global_batch or config.train.global_batch

    def describe(self, batch: bool = True) -> str:
        """``"fsdp=8 tensor=8; 2 micro-batches; full"``; without the micro-batches and a grown batch
        when ``batch`` is false (the table gives them columns of their own)."""
        mesh = " ".join(f"{a}={n}" for a, n in self.sizes if n > 1) or "one device"
        extra = ", ZeRO-1" if self.zero1 else ""
        extra += f", {self.schedule}" if self.schedule else ""
        extra += ", sequence parallel" if self.sequence else ""
        own = "as configured: " if self.own else ""
        policy = self.remat or self.policy
        if not batch:
            return f"{own}{mesh}; {policy}{extra}"
        grown = f", batch {self.global_batch}" if self.global_batch else ""
        micro = f"{self.micro_batches} micro-batch{'es' * (self.micro_batches > 1)}"
        return f"{own}{mesh}; {micro}; {policy}{extra}{grown}"


@dataclasses.dataclass(frozen=True)
class Estimate:
    """The pruning estimate of one layout (never shown as a result): ``static`` bytes (parameters,
    gradients, optimizer state) are near exact, ``activations`` are scaled by what compiles showed."""

    static: float
    activations: float
    seconds: float

    @property
    def peak_bytes(self) -> float:
        return self.static + self.activations


def _divisors(n: int) -> list[int]:
    return [d for d in range(1, n + 1) if n % d == 0]


def _factorizations(n: int, k: int) -> list[tuple[int, ...]]:
    if k == 1:
        return [(n,)]
    return [(d, *rest) for d in _divisors(n) for rest in _factorizations(n // d, k - 1)]


def enumerate_layouts(config: Config, n_devices: int, per_host: int, policies: Sequence[str]) -> list[Layout]:
    """Every layout the arithmetic allows for the reference model on ``n_devices`` (``per_host`` per host)."""
    batch = config.train.global_batch
    repeats = config.pipeline.repeats
    layouts = []
    for sizes in _factorizations(n_devices, len(AXES)):
        axes = dict(zip(AXES, sizes, strict=True))
        t, s, e = axes["tensor"], axes["stage"], axes["expert"]
        if _unbuildable(config, axes, per_host):
            continue
        shards = axes["data"] * axes["fsdp"] * e
        for micro in _divisors(batch):
            if (batch // micro) % shards or (s > 1 and micro < s):
                continue
            if s > 1 and micro not in _largest(batch, shards, s):
                continue  # A pipeline wants the most micro-batches (smallest bubble and peak).
            # A pipeline's schedule keeps the config's layer chunks per stage (pipeline.repeats).
            schedules = (None,) if s == 1 else _SCHEDULES[repeats > 1]
            sequences = (False, True) if t > 1 else (False,)
            for policy, schedule, sequence in itertools.product(policies, schedules, sequences):
                if schedule == "interleaved" and micro % s:
                    continue  # Micro-batches in groups of the stages.
                zero = (False, True) if axes["data"] * e > 1 and config.optimizer.name != "sgd" else (False,)
                for zero1 in zero:
                    sizes = tuple(axes.items())
                    layouts.append(Layout(sizes, micro, policy, zero1, None, schedule, sequence))
    return layouts


def _unbuildable(config: Config, axes: dict[str, int], per_host: int) -> str | None:
    """Why a mesh cannot be built for the reference model (the config key, its value, what it must
    divide), or None: tensor inside a host and dividing what it splits, at most one stage per layer,
    context dividing the sequence in 2 x context chunks of a dense model, expert dividing the experts."""
    model = config.model
    t, s, c, e = axes["tensor"], axes["stage"], axes["context"], axes["expert"]
    if per_host % t:
        return f"mesh.axes.tensor={t} does not divide the {per_host} devices of a host"
    for key in ("n_heads", "n_kv_heads", "d_ff", "vocab_size"):
        if getattr(model, key) % t:
            return f"mesh.axes.tensor={t} does not divide model.{key}={getattr(model, key)}"
    if s > model.n_layers:
        return f"mesh.axes.stage={s} is more stages than model.n_layers={model.n_layers}"
    if s > 1 and (error := layer_index_error(model, model.seq_len, s)) is not None:
        return str(error)  # Layers that differ by their index in the stack (Gemma 2's and 3's).
    if c > 1 and model.n_experts:
        return f"mesh.axes.context={c}: context parallelism is for dense models (model.n_experts is set)"
    if c > 1 and model.seq_len % (2 * c):
        return f"mesh.axes.context={c} does not split model.seq_len={model.seq_len} into 2 x {c} chunks"
    if e > 1 and (not model.n_experts or model.n_experts % e):
        return f"mesh.axes.expert={e} does not divide model.n_experts={model.n_experts}"
    return None


def _largest(batch: int, shards: int, stages: int, count: int = 2) -> list[int]:
    micro = [m for m in _divisors(batch) if m >= stages and (batch // m) % shards == 0]
    return micro[-count:]


def _spans_hosts(axes: dict[str, int], per_host: int) -> dict[str, bool]:
    """Whether each axis's groups span hosts, with the devices laid out host by host, axes outermost first."""
    spans, inner = {}, 1
    for axis in reversed(AXES):
        size = axes[axis]
        spans[axis] = size > 1 and inner * size > per_host
        inner *= size
    return spans


def _link(hardware, axes: dict[str, int], per_host: int, *names: str) -> float:
    """Bytes/s a collective over the mesh axes ``names`` reaches: on a GPU cluster NCCL's ring (NVLink
    inside a node, the group's share of the node's NICs across), else the fast or slow link."""
    if hardware.cluster is None:
        spans = _spans_hosts(axes, per_host)
        return hardware.link("network" if any(spans[a] for a in names) else "nvlink")
    sizes = [axes[a] for a in AXES]
    ids = np.arange(math.prod(sizes)).reshape(sizes)
    chosen = [AXES.index(a) for a in names]
    first = ids.transpose([i for i in range(len(AXES)) if i not in chosen] + chosen).reshape(
        -1, math.prod(sizes[i] for i in chosen))[0]  # fmt: skip
    return ring_bandwidth(Group.of(first.tolist(), ids.reshape(-1) // per_host), hardware.cluster)


class Estimator:
    """Pruning estimates from traced quantities, refitted to compiled plans.

    Peak: parameters, gradients and optimizer state per device from the parameter count and the
    layout's sharding, plus the backward pass's residuals (traced per policy) for the micro-batch rows a
    device holds (all of a GPipe stage's micro-batches, 1F1B's in flight; split over tensor with sequence
    parallelism), times a factor fitted to compiles.
    Time: matmul FLOPs per device (traced per policy, the pipeline's idle ticks included) at the peak's
    efficiency, memory-bound work as a fitted share of it, and each parallelism's usual communication:
    FSDP's weight all-gathers and gradient reduce-scatters per micro-batch, data parallelism's gradient
    all-reduce once per step (:mod:`shardmem.program.accumulation`), tensor parallelism's two activation
    all-reduces per layer and pass, pipeline hand-offs, context parallelism's key/value all-gathers,
    each at the bandwidth NCCL's rings reach over its group (on GPUs: NVLink inside a node, the group's
    share of the node's NICs across)."""

    def __init__(self, config: Config, hardware, per_host: int, flops: dict[str, float],
                 residuals: dict[str, float]):  # fmt: skip
        self.config, self.hardware, self.per_host = config, hardware, per_host
        self.flops, self.residuals = flops, residuals
        self.params = config.model.param_count()
        # Compiled activation bytes over estimated ones, per (policy, pipelined, sequence parallel): fitted
        # to compiles.
        self.activation_scale: dict[tuple[str, bool, bool], float] = {}
        # The time's fitted terms, per family of layouts (pipelined, sequence parallel): a pipeline's
        # compile says little of an FSDP layout's memory-bound work or misestimate, and one scale for
        # both let two pipeline compiles push every layout without stages past the search's stop.
        # A family not compiled yet takes the latest compile's (memory share, launch gaps) or the fit
        # over every compile (time scale).
        self.memory_share = {None: 0.8}  # memory-bound s per compute s (the H200 trials: 0.7-1.4)
        self.time_scale = {None: 1.0}
        self.launch_per_layer_pass = {None: 0.0}  # kernel gaps per layer and micro-batch pass, fitted
        self._activations: dict[tuple[str, bool, bool], list[tuple[float, float]]] = {}
        self._times: dict[tuple[bool, bool] | None, list[tuple[float, float]]] = {}
        self._links: dict[tuple, float] = {}

    def __call__(self, layout: Layout) -> Estimate:
        config, model, axes = self.config, self.config.model, layout.axes
        n = math.prod(axes.values())
        t, s, c, d, f, e = (axes[a] for a in ("tensor", "stage", "context", "data", "fsdp", "expert"))
        batch = layout.batch(config)
        m = layout.micro_batches
        weight_shards = t * s * f * c * (e if model.n_experts else 1)
        param_bytes = self.params * _itemsize(config.precision.params) / weight_shards
        # The optimizer's dtype: the master copy's (precision.master, itself in the state), else the
        # weights'; the gradients are summed in it.
        state_dtype = config.precision.master or config.precision.params
        moments = 1 if config.optimizer.name == "sgd" else 2
        mu = _itemsize(config.optimizer.mu_dtype or state_dtype)
        master = _itemsize(state_dtype) if config.precision.master else 0
        optimizer = self.params * (mu + _itemsize(state_dtype) * (moments - 1) + master) / weight_shards
        if layout.zero1:
            optimizer /= d * e
        grad_bytes = self.params * _itemsize(state_dtype) / weight_shards
        rows = batch / (d * f * e)  # sequences per device per step
        live_rows = rows if s > 1 else rows / m  # GPipe keeps all its micro-batches' residuals
        if layout.schedule in ("1f1b", "interleaved"):  # 1F1B: at most stages micro-batches' worth
            r = config.pipeline.repeats
            live_rows = rows / m * Pipeline(s, m, r, schedule=layout.schedule).in_flight / r
        residual = self.residuals[layout.policy] / config.train.global_batch * live_rows / c / s
        if layout.sequence:  # Sequence parallelism splits the rest over tensor too.
            residual /= t
        else:
            residual *= 1.0 if layout.policy == "full" else (1 + 1 / t) / 2  # tensor splits the wide ones
        static = param_bytes + grad_bytes + optimizer
        key = (layout.policy, s > 1, layout.sequence)
        scales = self.activation_scale
        scale = scales.get(key, 1.0)  # Unscaled until a compile of the same kind says otherwise.
        activations = residual * scale

        # Time.
        ticks = (m + s - 1) / m if s > 1 else 1.0
        flops = self.flops[layout.policy] * batch / config.train.global_batch / n * ticks
        dtype = "f32" if config.precision.compute == "float32" else "bf16"
        compute = flops / (self.hardware.peak(dtype) * MATMUL_EFFICIENCY)
        link = functools.partial(self._link, layout.sizes)
        weights_bf16 = self.params * 2 / (t * s * (e if model.n_experts else 1))
        comm = 0.0
        g = f * c
        if g > 1:
            passes = 3 if layout.policy != "none" else 2
            comm += passes * m * weights_bf16 * (g - 1) / g / link("fsdp", "context")
            # The program reduce-scatters FSDP gradients per micro-batch (train.fsdp_reduce_once: once).
            scatters = 1 if config.train.fsdp_reduce_once else m
            comm += scatters * self.params * 4 / (t * s) * (g - 1) / g / link("fsdp", "context")
        if d > 1:
            comm += 2 * (d - 1) / d * self.params * 4 / weight_shards / link("data")
        micro_rows = rows / m
        activation = micro_rows * model.seq_len / c * model.d_model * 2
        layers = model.n_layers / s
        if t > 1:
            passes = 6 if layout.policy != "none" else 4
            comm += layers * m * passes * activation * 2 * (t - 1) / t / link("tensor")
        if s > 1:
            comm += 2 * (m + s - 1) * activation / t / link("stage")
        if c > 1:
            kv = micro_rows * model.seq_len * model.n_kv_heads * model.head_size * 2 * 2 / t
            comm += layers * m * 3 * kv * (c - 1) / c / link("context")
        if e > 1:
            comm += layers * m * 4 * activation * model.experts_per_token * (e - 1) / e / link("expert")
        family = _time_group(layout)
        terms = (self.memory_share, self.launch_per_layer_pass, self.time_scale)
        share, launch, time_scale = (fitted.get(family, fitted[None]) for fitted in terms)
        work = compute * (1 + share) + launch * self._passes(layout)
        seconds = (work + max(0.0, comm - 0.5 * work)) * time_scale
        return Estimate(static, activations, seconds)

    def knows(self, layout: Layout) -> bool:
        """Whether the layout's remat policy was traced for the estimates (the config's own may not be)."""
        return layout.policy in self.flops

    def _link(self, sizes: tuple[tuple[str, int], ...], *names: str) -> float:
        """:func:`_link`, once per mesh and group: every variant of a mesh (micro-batches, remat, ZeRO-1)
        and every round of the search asks again, and 512 GPUs have ~11,000 layouts."""
        key = (sizes, names)
        if key not in self._links:
            self._links[key] = _link(self.hardware, dict(sizes), self.per_host, *names)
        return self._links[key]

    def _passes(self, layout: Layout) -> float:
        """Layer passes a device runs per step: its layers times micro-batches (a pipeline's ticks)."""
        s = layout.axes["stage"]
        m = layout.micro_batches
        return self.config.model.n_layers / s * (m + s - 1 if s > 1 else m)

    def refit(self, layout: Layout, peak: int, seconds: float | None, breakdown: dict | None) -> None:
        """Scales the estimates to a compiled plan's peak and predicted time (least squares through 0).
        A layout with a per-layer remat plan (the config's own) refits the time only: its peak is no
        uniform policy's."""
        family = _time_group(layout)
        if seconds and breakdown:  # First, so that the unscaled time below has the launch gaps in it.
            if breakdown.get("compute"):
                share = breakdown["memory_bound"] / breakdown["compute"]
                self.memory_share[family] = self.memory_share[None] = share
            launch = breakdown["launch"] / self._passes(layout)
            self.launch_per_layer_pass[family] = self.launch_per_layer_pass[None] = launch
        saved = self.activation_scale, self.time_scale
        self.activation_scale, self.time_scale = {}, {None: 1.0}
        raw = self(layout)  # Unscaled: the scales stand for themselves.
        self.activation_scale, self.time_scale = saved
        if not layout.remat:
            key = (layout.policy, layout.axes["stage"] > 1, layout.sequence)
            points = self._activations.setdefault(key, [])
            points.append((raw.activations, max(peak - raw.static, 0.0)))
            fitted = sum(x * y for x, y in points) / max(sum(x * x for x, _ in points), 1.0)
            self.activation_scale[key] = fitted
        if seconds:
            for key in (family, None):
                points = self._times.setdefault(key, [])
                points.append((raw.seconds, seconds))
                self.time_scale[key] = sum(x * y for x, y in points) / sum(x * x for x, _ in points)


def _time_group(layout: Layout) -> tuple[bool, bool]:
    """The layouts whose compiles refit a layout's time: (pipelined, sequence parallel)."""
    return layout.axes["stage"] > 1, layout.sequence


def _itemsize(dtype: str) -> int:
    return {"float32": 4, "bfloat16": 2, "float16": 2}.get(dtype, 4)


@dataclasses.dataclass(frozen=True)
class Ranked:
    """A compiled layout: its overrides, the plan's figures and the predicted step time."""

    layout: Layout
    overrides: tuple[str, ...]
    peak_bytes: int
    margin_bytes: int
    fits: bool
    step_time: dict[str, Any] | None
    host_bytes: int = 0

    @property
    def seconds(self) -> float:
        return self.step_time["seconds"] if self.step_time else math.inf

    def throughput_per_device(self, devices: int) -> float:
        tokens = self.step_time.get("tokens_per_second") if self.step_time else None
        return (tokens or 0.0) / devices


# --- families ------------------------------------------------------------------------------------

#: The families of layouts, each with the mesh axis it needs: the search compiles the best-looking
#: layout of every family that can be built, so that compiled plans, not the pruning estimates alone,
#: compare them.
FAMILIES = {
    "fsdp": ("FSDP / data (HSDP)", None),
    "tensor": ("tensor x sequence parallel x FSDP", "tensor"),
    "pipeline": ("pipeline (1F1B)", "stage"),
    "context": ("context parallel", "context"),
}


def family_of(layout: Layout) -> str | None:
    """The family a layout is compared in: with stages a 1F1B or interleaved pipeline (GPipe and circular
    ones are no family's), else context parallel, else tensor with sequence parallelism (without it no
    family's), else FSDP and data parallelism; expert parallelism is no family's."""
    axes = layout.axes
    if axes["stage"] > 1:
        return "pipeline" if layout.schedule in ("1f1b", "interleaved") else None
    if axes["context"] > 1:
        return "context"
    if axes["tensor"] > 1:
        return "tensor" if layout.sequence else None
    return "fsdp" if axes["expert"] == 1 else None


def family_name(family: str, config: Config) -> str:
    """``"pipeline (interleaved 1F1B)"`` where the config runs layer chunks (pipeline.repeats > 1)."""
    name = FAMILIES[family][0]
    return "pipeline (interleaved 1F1B)" if family == "pipeline" and config.pipeline.repeats > 1 else name


def unbuildable_families(
    config: Config, n_devices: int, per_host: int, layouts: Sequence[Layout]
) -> dict[str, str]:
    """Why each family that has no layout among ``layouts`` (the enumeration) cannot be built: the mesh
    rule its smallest degree breaks, else the batch that splits over none of its meshes."""
    present = {family_of(lay) for lay in layouts}
    batch = config.train.global_batch
    reasons = {}
    for family, (_, axis) in FAMILIES.items():
        if family in present:
            continue
        degree = min((d for d in _divisors(n_devices) if d > 1), default=None) if axis else 1
        if degree is None:
            reasons[family] = f"one device: no mesh.axes.{axis} to split it over"
            continue
        axes = dict.fromkeys(AXES, 1) | {"fsdp": n_devices // degree} | ({axis: degree} if axis else {})
        per_stage = " into at least as many micro-batches as stages" if family == "pipeline" else ""
        reasons[family] = _unbuildable(config, axes, per_host) or (
            f"train.global_batch={batch} does not split over the batch shards of any such mesh of "
            f"{n_devices} devices{per_stage}; use a multiple of {n_devices}")  # fmt: skip
    return reasons


@dataclasses.dataclass(frozen=True)
class FamilyBest:
    """The best compiled layout of a family (the fastest that fits, else the smallest peak), with the
    pruning estimate it was compiled on; or, with no ``best``, why not (not buildable, budget spent)."""

    family: str
    best: Ranked | None
    estimate: Estimate | None = None
    reason: str | None = None


def _family_bests(compiled: dict[Layout, Ranked], reasons: dict[str, str],
                  guesses: dict[Layout, Estimate]) -> list[FamilyBest]:  # fmt: skip
    out = []
    for family in FAMILIES:
        members = [r for lay, r in compiled.items()
                   if family_of(lay) == family and r.peak_bytes and lay.global_batch is None]  # fmt: skip
        if family in reasons:
            out.append(FamilyBest(family, None, reason=f"not buildable: {reasons[family]}"))
        elif not members:
            tried = any(family_of(lay) == family for lay in compiled)
            why = "its compile failed (see the notes)" if tried else "compile budget spent (--max-compiles)"
            out.append(FamilyBest(family, None, reason=f"not compiled: {why}"))
        else:
            best = min(members, key=lambda r: (not r.fits, r.seconds if r.fits else r.peak_bytes))
            out.append(FamilyBest(family, best, guesses.get(best.layout)))
    return out


def _family_picks(families: Sequence[str], layouts: Sequence[Layout], skip: Callable[[Layout], bool],
                  estimator: Estimator, budget: float) -> list[Layout]:  # fmt: skip
    """Each family's best-looking layout not compiled yet (estimated to fit first, then the fastest),
    the most promising families first: the estimate orders within a family, it never rules one out."""
    picks = []
    for family in families:
        members = [lay for lay in layouts if family_of(lay) == family and not skip(lay)]
        estimates = {lay: estimator(lay) for lay in members}
        ranked = sorted(members, key=lambda lay: (estimates[lay].peak_bytes > budget, estimates[lay].seconds,
                                                 lay.zero1))  # fmt: skip
        picks += ranked[:1]
    return sorted(picks, key=lambda lay: estimator(lay).seconds)


def search_layouts(
    config: Config,
    target: str | None,
    resolved,
    *,
    max_compiles: int,
    jobs: int | None,
    objective: str,
    allow_offload: bool,
    progress: Callable[[str], None],
    note: Callable[..., None],
) -> tuple[list[Ranked], int, list[str], list[FamilyBest]]:
    """Compiles the config as written, the most promising layouts and the best-looking layout of each
    family (:data:`FAMILIES`), and returns the fitting ones ranked by the objective (the config's own
    after them when it does not fit), the number of compiles, notes on what was pruned, and the best
    compiled layout of each family (or why it has none)."""
    import contextlib

    from shardmem.explore.search import residual_bytes
    from shardmem.explore.sweep import plan_candidates, planning_pool
    from shardmem.models.llama import ModelConfig
    from shardmem.planning import hlo
    from shardmem.planning.cost import Hardware
    from shardmem.planning.memory import op_shares
    from shardmem.program import build_program

    if not isinstance(config.model, ModelConfig):
        raise ConfigError(
            "shardmem tune --search layout lays out the reference model's axes (stage, context, expert, "
            "tensor); a model of your own has no model.preset: search its remat (--search remat) or "
            "sweep its mesh.axes"
        )
    hardware = Hardware.of(resolved, config.interconnect)
    if hardware is None and resolved.platform == "cpu":  # Ranks CPU layouts (sweep --measure checks).
        hardware = Hardware.host(len(resolved.devices))
    if hardware is None:
        raise ConfigError(
            f"shardmem tune --search layout ranks layouts by predicted step time, which target "
            f"{resolved.name!r} has no model of; use a GPU target (--target h100-sxm, ...)"
        )
    n, hosts = len(resolved.devices), config.mesh.hosts
    per_host = n // hosts
    policies = ["none", "minimal", "full"] + (["offload"] if allow_offload else [])
    progress(f"tracing {len(policies)} remat policies for the estimates")
    from shardmem.parallel.mesh import build_mesh

    mesh = build_mesh(config.mesh.axes, resolved.devices)
    flops, residuals = {}, {}
    for policy in policies:
        candidate = config.replace(f"remat.policy={policy}", "remat.layers={}")
        program = build_program(candidate, mesh)
        jaxpr = program.step.trace(program.abstract_state, program.abstract_batch).jaxpr
        flops[policy] = hlo.matmul_flops(jaxpr, op_shares(program))
        residuals[policy] = residual_bytes(candidate, program.attention) * candidate.train.micro_batches
    estimator = Estimator(config, hardware, per_host, flops, residuals)
    from shardmem.planning.memory import budget as budget_of

    budget = budget_of(
        config.memory, resolved.memory_bytes, resolved.allocator_limit, deviceless=resolved.deviceless
    )
    layouts = enumerate_layouts(config, n, per_host, policies)
    own = _own_layout(config, n)
    twin = _twin(config, own)  # Compiled as the config as written: not again.
    notes = [f"{len(layouts)} layouts enumerated over {', '.join(AXES)} x micro-batches x remat x ZeRO-1"]
    reasons = unbuildable_families(config, n, per_host, layouts)

    compiled: dict[Layout, Ranked] = {}
    guesses: dict[Layout, Estimate] = {}  # The estimate each layout was compiled on.
    refused: set[Layout] = set()  # Compiles libtpu refused as over the chip's HBM: no figures but the need.
    # Compiles kept for the best mesh's other remat policies (--objective throughput spends what is left
    # on growing batches instead).
    reserve = min(len(policies) - 1, max_compiles // 4) if objective == "step_time" else 0
    compiles = 0

    def run(batch: list[Layout]) -> None:
        nonlocal compiles
        combos = [layout.overrides(config) for layout in batch]
        for layout in batch:
            if not estimator.knows(layout):
                progress(f"compiling {layout.describe()}")
                continue
            guess = guesses[layout] = estimator(layout)
            progress(f"compiling {layout.describe()} (estimated {format_bytes(guess.peak_bytes)}, "
                     f"{format_seconds(guess.seconds)})")  # fmt: skip
        rows = plan_candidates(config, combos, target, jobs=1, pool=pool)
        for layout, overrides, row in zip(batch, combos, rows, strict=True):
            if row.error and row.fits is False and row.peak_bytes:  # libtpu refused it as over the HBM.
                compiles += 1
                refused.add(layout)
                compiled[layout] = Ranked(layout, overrides, row.peak_bytes, budget - row.peak_bytes, False,
                                          None)  # fmt: skip
                note(layout.describe(), overrides, row.peak_bytes, 0, None, False, "compiled",
                     f"does not fit (libtpu refused it: {format_bytes(row.peak_bytes)} needed)")  # fmt: skip
                continue
            if row.error:
                note(layout.describe(), overrides, None, None, None, False, "skipped", clip(row.error, 200))
                if layout.own:
                    notes.append(f"the config as written did not compile: {clip(row.error, 200)}")
                compiled[layout] = Ranked(layout, overrides, 0, 0, False, None)
                continue
            compiles += 1
            ranked = Ranked(layout, overrides, row.peak_bytes, row.margin_bytes, bool(row.fits),
                            row.step_time,
                            row.host_bytes or 0)  # fmt: skip
            compiled[layout] = ranked
            if estimator.knows(layout):
                estimator.refit(layout, row.peak_bytes, ranked.seconds if row.step_time else None,
                                row.step_time["breakdown"] if row.step_time else None)  # fmt: skip
            verdict = "fits" if row.fits else "does not fit"
            seconds = f", {format_seconds(ranked.seconds)} per step" if row.step_time else ""
            note(layout.describe(), overrides, row.peak_bytes, row.host_bytes, row.recompute_overhead,
                 bool(row.fits),
                 "compiled", f"{verdict}{seconds}", step_time=row.step_time)  # fmt: skip

    def families_left() -> list[str]:
        """The buildable families with no compiled layout that fits yet: their compiles are kept back."""
        fitting = {family_of(lay) for lay, r in compiled.items() if r.fits}
        return [f for f in FAMILIES if f not in reasons and f not in fitting]

    workers = max(1, jobs if jobs is not None else (os.cpu_count() or 1))
    with contextlib.ExitStack() as stack:  # One pool of workers for every compile of the search.
        pool = stack.enter_context(planning_pool(config, target, workers, n)) if workers > 1 else None
        run([own])  # The config as written first: the baseline the search must beat, always shown.
        # Throughput keeps a third of the compiles for growing the best layouts' batches; step time keeps
        # ``reserve`` for the best mesh's other remat policies.
        layout_compiles = max_compiles - (max(1, max_compiles // 3) if objective == "throughput" else reserve)
        while compiles < layout_compiles - len(families_left()):
            estimates = {layout: estimator(layout) for layout in layouts
                         if layout not in compiled and layout != twin}  # fmt: skip
            fitting = [lay for lay, est in estimates.items() if est.peak_bytes <= budget * _ESTIMATE_REJECT]
            best_mesh: dict[tuple, Layout] = {}

            # Estimated to fit before estimated near the budget, then the fastest-looking.
            def rank(lay: Layout, estimates=estimates) -> tuple:
                return estimates[lay].peak_bytes > budget, estimates[lay].seconds, lay.zero1

            for layout in sorted(fitting, key=rank):
                best_mesh.setdefault(layout.sizes, layout)  # The fastest-looking variant of each mesh.
            tried = {lay.sizes for lay, r in compiled.items() if r.fits}
            order = sorted((lay for lay in best_mesh.values() if lay.sizes not in tried), key=rank)
            if not order:
                break
            best = min((r.seconds for r in compiled.values() if r.fits), default=math.inf)
            if compiles >= min(8, max_compiles // 2) and estimates[order[0]].seconds > 1.3 * best:
                notes.append("stopped: no remaining layout is estimated within 1.3x of the best compiled")
                break
            run(order[: min(workers, layout_compiles - len(families_left()) - compiles)])

        # The best-looking layout of each family with no compiled layout that fits, whatever its estimate
        # (the compiles kept back for it above, before the remat variants and grown batches): a family's
        # first pick that does not fit is followed by one more, on the refitted estimates.
        family_compiles = compiles
        for _ in range(2):
            picks = _family_picks(families_left(), layouts, lambda lay: lay in compiled or lay == twin,
                                  estimator, budget)[: layout_compiles - compiles]  # fmt: skip
            if not picks:
                break
            run(picks)
        if compiles > family_compiles:
            spent = compiles - family_compiles
            notes.append(f"the best-looking layout of each family with none compiled that fits: "
                         f"{spent} compile{'s' * (spent > 1)}")  # fmt: skip

        def ranked_fits() -> list[Ranked]:
            return sorted((r for r in compiled.values() if r.fits and r.step_time), key=lambda r: r.seconds)

        fits = ranked_fits()
        variants = []
        if reserve and fits:
            variants = _other_policies(fits[0].layout, layouts, compiled, estimator, budget)
        if variants and compiles < max_compiles:
            variants = variants[: max_compiles - compiles]
            notes.append(f"the best mesh with its other remat policies: {len(variants)} compiles")
            run(variants)
            fits = ranked_fits()
        if objective == "throughput" and fits:
            fits = _grow_batches(fits[:3], config, budget, estimator, max_compiles, lambda: compiles, run,
                                 compiled) + fits  # fmt: skip
            fits = sorted({r.overrides: r for r in fits}.values(), key=lambda r: -r.throughput_per_device(n))
    if not compiled[own].fits and compiled[own].peak_bytes:
        fits.append(compiled[own])  # Shown, after the layouts that fit.
    over = sum(1 for lay, r in compiled.items() if not r.fits and (r.step_time is not None or lay in refused))
    left = sum(lay not in compiled and lay != twin for lay in layouts)
    notes.append(f"{over} compiled layouts did not fit; {left} left to the estimates")
    return fits, compiles, notes, _family_bests(compiled, reasons, guesses)


def _other_policies(best: Layout, layouts, compiled, estimator: Estimator, budget: float) -> list[Layout]:
    """The best compiled mesh with each remat policy it was not compiled with, at the fewest
    micro-batches estimated to fit. The search compiles one variant per mesh, and the estimate cannot
    rank policies of one mesh: how much of FSDP's weight gathers a policy's recomputation hides is the
    compiled schedule's to say (FSDP over 512 H100s: minimal's 1.58 s of exposed gathers against full's
    recomputation)."""
    variants: dict[str, Layout] = {}
    for lay in sorted(layouts, key=lambda lay: lay.micro_batches):
        same_mesh = (lay.sizes, lay.zero1, lay.schedule, lay.sequence) == (
            best.sizes, best.zero1, best.schedule, best.sequence)  # fmt: skip
        if not same_mesh or lay.policy == best.policy or lay in compiled:
            continue
        if lay.policy not in variants and estimator(lay).peak_bytes <= budget * _ESTIMATE_REJECT:
            variants[lay.policy] = lay
    return list(variants.values())


def _grow_batches(top, config, budget, estimator, max_compiles, count, run, compiled):
    """For ``--objective throughput``: each of the top layouts at the largest global batch the estimate
    says fits (doubling), confirmed by compiles."""
    grown = []
    for ranked in top:
        layout = ranked.layout
        if not estimator.knows(layout):
            continue
        batch = config.train.global_batch
        while count() < max_compiles:
            bigger = dataclasses.replace(layout, global_batch=batch * 2)
            if estimator(bigger).peak_bytes > budget:
                break
            run([bigger])
            result = compiled[bigger]
            if not result.fits:
                break
            grown.append(result)
            batch *= 2
            layout = bigger
    return grown


def _own_layout(config: Config, n: int) -> Layout:
    """The config as written, as a layout: its mesh (``-1`` resolved for ``n`` devices), micro-batches and
    remat plan. It is always compiled: the baseline the search must beat."""
    axes = dict(config.mesh.axes)
    fixed = math.prod(v for v in axes.values() if v > 0)
    axes = {a: (max(n // fixed, 1) if v == -1 else v) for a, v in axes.items()}
    sizes = tuple((a, axes.get(a, 1)) for a in AXES) if set(axes) <= set(AXES) else tuple(axes.items())
    remat = config.remat_plan().describe() if config.remat.layers else ""
    stages, tensor = axes.get("stage", 1), axes.get("tensor", 1)
    schedule = (config.pipeline.schedule or ("gpipe" if config.pipeline.repeats == 1 else "circular")
                if stages > 1 else None)  # fmt: skip
    sequence = tensor > 1 and "tensor" in _as_list((config.rules or {}).get("residual_seq"))
    return Layout(sizes, config.train.micro_batches, config.remat.policy, config.optimizer.shard_over_data,
                  schedule=schedule, sequence=sequence, own=True, remat=remat)  # fmt: skip


def _twin(config: Config, own: Layout) -> Layout | None:
    """The enumerated layout the config as written stands for (its rules aside), when it has one: the same
    mesh, micro-batches, uniform policy and ZeRO-1, without pipeline.stages."""
    if own.remat or config.pipeline.stages or {a for a, _ in own.sizes} != set(AXES):
        return None
    return dataclasses.replace(own, own=False)


def _as_list(axes) -> list:
    return [axes] if isinstance(axes, str) else list(axes or ())


def widest_gap(first: Ranked, second: Ranked, per_token: bool = False) -> tuple[str, float]:
    """The term of the step time (``"exposed communication"``, ``"pipeline bubble"``, ``"memory bound"``,
    ``"compute"`` with its recomputation, ...) in which ``second`` loses most to ``first``, and by how
    many seconds per step (per token with ``per_token``: the two may run different batches)."""

    def terms(r: Ranked) -> tuple[dict[str, float], float]:  # Seconds per step (per token) by term.
        tokens = r.step_time["tokens_per_second"] * r.seconds if per_token else 1.0
        by_term = {k: v / tokens for k, v in r.step_time["breakdown"].items()}
        return by_term, r.step_time["bubble_seconds"] / tokens

    (a, a_bubble), (b, b_bubble) = terms(first), terms(second)
    gains = {k: b[k] - a[k] for k in a}
    if abs(b_bubble - a_bubble) > max(abs(v) for v in gains.values()):
        gains = {"pipeline bubble": b_bubble - a_bubble}
    term, gain = max(gains.items(), key=lambda kv: kv[1])
    return term.replace("_", " "), gain


def why_winner(first: Ranked, second: Ranked | None, objective: str = "step_time", devices: int = 1) -> str:
    """One line on why the winner beats the runner-up, in what ``objective`` ranks (seconds per step, or
    tokens per second per device), and the term of the step time that differs most (per token when the
    objective is throughput: the two may run different batches)."""
    if second is None or not first.step_time or not second.step_time:
        return "the only compiled layout that fits"
    rows = (first, second)
    throughput = objective == "throughput" and all(r.step_time.get("tokens_per_second") for r in rows)
    term, gain = widest_gap(first, second, throughput)
    if throughput:
        rate, runner_up = first.throughput_per_device(devices), second.throughput_per_device(devices)
        return (f"it beats the runner-up ({second.layout.describe()}) by {rate - runner_up:,.1f} tokens/s "
                f"per device ({rate / runner_up - 1:+.1%}), most of it in {term} "
                f"({format_seconds(1000 * gain)} less per 1,000 tokens)")  # fmt: skip
    faster = second.seconds - first.seconds
    return (f"it beats the runner-up ({second.layout.describe()}) by {format_seconds(faster)} per step "
            f"({faster / second.seconds:.0%}), most of it in {term} "
            f"({format_seconds(gain)} less)")  # fmt: skip
