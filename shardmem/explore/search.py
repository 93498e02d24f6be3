"""What the searches share: the planner that compiles each candidate once and keeps every trial, the
result they return, budget and batch arithmetic, and the estimate of the activation bytes a remat
policy keeps that costs no compile.

    planner = Planner(config, "h100-sxm", max_compiles=12, progress=print)
    report = planner.compile("full", ("remat.policy=full", "remat.layers={}"))
    planner.trials[-1].fits, plan_budget(config, make_target(config, "h100-sxm"))

:func:`~shardmem.explore.tune.tune` runs the searches (:mod:`~shardmem.explore.tune`,
:mod:`~shardmem.explore.layout`, :mod:`~shardmem.explore.finetune`) on these.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Callable
from typing import Any

import jax
import numpy as np
from jax.sharding import Mesh

from shardmem.config import Config
from shardmem.errors import DoesNotFit
from shardmem.models.attention import AttentionKernel
from shardmem.parallel.mesh import build_mesh
from shardmem.parallel.rules import Rules, spec_axes
from shardmem.planning.memory import MemoryReport, make_target, plan
from shardmem.program import build_program
from shardmem.units import format_bytes


@dataclasses.dataclass(frozen=True)
class Trial:
    """One candidate the search looked at: compiled, estimated, or pruned by monotonicity."""

    candidate: str
    overrides: tuple[str, ...]
    peak_bytes: int | None
    host_bytes: int | None
    recompute_overhead: float | None
    fits: bool
    how: str  # "compiled", "estimated", "pruned" or "skipped"
    reason: str = ""
    step_time: dict[str, Any] | None = None  # The compiled plan's predicted step time (StepTime.to_json()).


@dataclasses.dataclass(frozen=True)
class TuneResult:
    """The tuned config, the compiled report of the choice, and every trial with its verdict."""

    search: str
    config: Config | None
    report: MemoryReport | None
    chosen: Trial | None
    trials: list[Trial]
    compiles: int
    budget_bytes: int
    target_label: str
    explanation: list[str]
    ranked: list[dict[str, Any]] = dataclasses.field(default_factory=list)  # layout search: best first
    costs: list[dict[str, Any]] = dataclasses.field(default_factory=list)  # finetune search: per knob value
    families: list[dict[str, Any]] = dataclasses.field(default_factory=list)  # layout search: each's best

    @property
    def found(self) -> bool:
        return self.config is not None

    def to_json(self) -> dict[str, Any]:
        return {
            "search": self.search,
            "found": self.found,
            "chosen": dataclasses.asdict(self.chosen) if self.chosen else None,
            "overrides": list(self.chosen.overrides) if self.chosen else [],
            "budget_bytes": self.budget_bytes,
            "target": self.target_label,
            "compiles": self.compiles,
            "trials": [dataclasses.asdict(t) for t in self.trials],
            "explanation": self.explanation,
            "ranked": self.ranked,
            "costs": self.costs,
            "families": self.families,
            "report": self.report.to_json() if self.report else None,
        }


@dataclasses.dataclass(frozen=True)
class Refused:
    """A candidate XLA's TPU compiler refused to compile as over the chip's HBM: no report, only the
    compiler's figure of what it needed, which the searches read as the peak of a plan that does not
    fit (a lower bound: the compiler stopped at its first shortfall)."""

    per_device: dict[str, int]
    budget_bytes: int
    fits: bool = False
    recompute_overhead: float | None = None

    @classmethod
    def of(cls, error: DoesNotFit, config: Config, target: str | None) -> Refused:
        resolved = make_target(config, target)
        budget = plan_budget(config, resolved)
        needed = error.required_bytes or resolved.memory_bytes  # At least the chip's, or it would fit.
        return cls({"peak": max(needed, budget + 1), "host": 0}, budget)

    @property
    def margin_bytes(self) -> int:
        return self.budget_bytes - self.per_device["peak"]


class Planner:
    """Compiles candidates (each at most once), counts compiles and keeps every trial."""

    def __init__(self, config: Config, target: str | None, max_compiles: int, progress: Callable | None,
                 trials: list[Trial] | None = None):  # fmt: skip
        self.base, self.target, self.max_compiles = config, target, max_compiles
        self.progress = progress or (lambda message: None)
        self.compiles = 0
        self.reports: dict[tuple[str, ...], MemoryReport] = {}
        self.trials: list[Trial] = trials if trials is not None else []
        # Matmul FLOPs of the step without remat, once a search has traced it (the same for every
        # candidate): plan() then need not trace that baseline again for each compile.
        self.flops_no_remat: float | None = None

    @property
    def exhausted(self) -> bool:
        return self.compiles >= self.max_compiles

    def compile(self, candidate: str, overrides: tuple[str, ...]) -> MemoryReport | Refused:
        if overrides not in self.reports:
            self.progress(f"compiling {candidate}")
            baseline = self.flops_no_remat
            config = self.base.replace(*overrides)
            try:
                report = plan(config, self.target, top=5, count_remat_overhead=baseline is None)
            except DoesNotFit as e:  # XLA's TPU compiler refused it as over the chip's HBM.
                report = Refused.of(e, config, self.target)
            if baseline is not None and isinstance(report, MemoryReport):
                report = dataclasses.replace(report, flops_no_remat=baseline)
            self.reports[overrides] = report
            self.compiles += 1
            verdict = "fits" if report.fits else "does not fit"
            if isinstance(report, Refused):
                needed = format_bytes(report.per_device["peak"])
                verdict = f"does not fit (libtpu refused it: {needed} needed)"
            self.note(candidate, overrides, report.per_device["peak"], report.per_device["host"],
                      report.recompute_overhead or 0.0, report.fits, "compiled",
                      f"{verdict}: {margin_text(report.margin_bytes)}",
                      step_time=step_json(report))  # fmt: skip
        return self.reports[overrides]

    def note(self, *args, **kwargs) -> None:
        self.trials.append(Trial(*args, **kwargs))

    def rebase(self, overrides: tuple[str, ...]) -> None:
        """Makes ``overrides`` part of every later candidate (earlier compiles no longer apply)."""
        self.base = self.base.replace(*overrides)
        self.reports.clear()


def step_json(report) -> dict[str, Any] | None:
    step = getattr(report, "step_time", None)  # A refused compile has none.
    return step.to_json() if step else None


def margin_text(margin: int) -> str:
    return f"{format_bytes(abs(margin))} {'to spare' if margin >= 0 else 'over budget'}"


def residual_bytes(config: Config, attention: AttentionKernel | None = None) -> int:
    """Returns the global bytes the backward pass keeps for one micro-batch (the residuals of
    ``jax.vjp`` of the loss, traced on abstract shapes; host-offloaded ones included), with the attention
    kernel the plan compiles (default: the one for ``jax.devices()``)."""
    one_device = Mesh(np.array(jax.devices()[:1]).reshape((1,) * len(config.mesh.axes)),
                      tuple(config.mesh.axes))  # fmt: skip
    program = build_program(config.replace("train.micro_batches=1"), one_device, attention=attention)
    unsharded = lambda tree: jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype), tree)  # noqa: E731
    state = program.abstract_state
    params, rest = unsharded(state["params"]), unsharded(state.get("model_state", {}))
    k = config.train.micro_batches
    batch = jax.tree.map(lambda x: jax.ShapeDtypeStruct((x.shape[0] // k, *x.shape[1:]), x.dtype),
                         program.abstract_batch)  # fmt: skip

    frozen = unsharded(state["frozen"]) if "frozen" in state else None  # Fine-tuning: the frozen base.

    def vjp_residuals(params, rest, batch, frozen):
        return jax.vjp(lambda p: program.loss(p, rest, batch, frozen)[0], params)[1]

    leaves = jax.tree.leaves(jax.eval_shape(vjp_residuals, params, rest, batch, frozen))
    return sum(math.prod(leaf.shape) * leaf.dtype.itemsize for leaf in leaves)


def plan_budget(config: Config, target) -> int:
    from shardmem.planning.memory import budget

    return budget(config.memory, target.memory_bytes, target.allocator_limit, deviceless=target.deviceless)


# --- batch ---------------------------------------------------------------------------------------


def batch_shards(config: Config, target) -> int:
    mesh = build_mesh(config.mesh.axes, target.devices)
    rules = Rules.from_config(config.rules, mesh.axis_names, config.param_rules)
    return math.prod(mesh.shape[a] for a in spec_axes(rules.spec(("batch",))[0]))


def no_fit(planner: Planner, target, budget: int, search: str, explanation: list[str]) -> TuneResult:
    explanation = [*explanation, f"{planner.compiles} compiles"]
    return TuneResult(search, None, None, None, planner.trials, planner.compiles, budget, target.label,
                      explanation)  # fmt: skip
