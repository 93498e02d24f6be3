"""A sweep's results: one :class:`SweepRow` per candidate, the CSV columns it flattens to, the short labels
tables and plots show, and the Pareto front the plot draws.

    row = SweepRow(("remat.policy=full",), peak_bytes=2**30, budget_bytes=2**31, fits=True)
    row.flat()["peak_bytes"], short_label(row.overrides)      # 1073741824, "policy=full"

Read by :mod:`~shardmem.explore.sweep` (which fills the rows) and :mod:`~shardmem.explore.plot`.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from typing import Any

#: Columns of the CSV, in order.
COLUMNS = (
    "candidate", "error", "peak_bytes", "budget_bytes", "fits", "margin_bytes", "flops_per_step",
    "recompute_overhead", "host_bytes", "optimizer_bytes", "attention", "all_gather_bytes",
    "reduce_scatter_bytes", "all_reduce_bytes", "other_collective_bytes", "compile_seconds", "step_seconds",
    "measured_peak_bytes", "bubble_fraction", "collective_permute_bytes", "predicted_step_seconds",
    "tokens_per_second", "mfu", "exposed_communication_seconds", "host_transfer_bytes",
    "host_transfer_seconds", "tight",
)  # fmt: skip


@dataclasses.dataclass
class SweepRow:
    """One candidate: its overrides and what planning (and optionally measuring) it gave."""

    overrides: tuple[str, ...]
    error: str | None = None
    peak_bytes: int | None = None
    budget_bytes: int | None = None
    fits: bool | None = None
    margin_bytes: int | None = None
    tight: bool = False  # Over the budget only by the deviceless margin (MemoryReport.tight).
    flops_per_step: float | None = None
    recompute_overhead: float | None = None
    host_bytes: int | None = None
    optimizer_bytes: int | None = None  # Optimizer state on each device (mu_dtype, ZeRO-1, offload).
    attention: str = ""  # The attention kernel planned.
    collectives: dict[str, int] = dataclasses.field(default_factory=dict)
    compile_seconds: float | None = None
    approximate: bool = False
    step_seconds: float | None = None
    measured_peak_bytes: int | None = None
    bubble_fraction: float | None = None  # The pipeline's idle share of each stage (None: no stage axis).
    step_time: dict[str, Any] | None = None  # The plan's predicted step time (StepTime.to_json()).
    config_error: bool = False  # The error is the candidate's config (ConfigError): the sweep exits 2.

    def predicted(self, key: str) -> Any:
        """A figure of the predicted step time ("seconds", "mfu", ...), None without an estimate."""
        return self.step_time.get(key) if self.step_time else None

    @property
    def candidate(self) -> str:
        return " ".join(self.overrides) or "(config as is)"

    def flat(self) -> dict[str, Any]:
        """Returns the row as the CSV columns."""
        moved = self.collectives
        known = ("all-gather", "reduce-scatter", "all-reduce", "collective-permute")  # Their own columns.
        return {
            "candidate": self.candidate, "error": self.error, "peak_bytes": self.peak_bytes,
            "budget_bytes": self.budget_bytes, "fits": self.fits, "margin_bytes": self.margin_bytes,
            "flops_per_step": self.flops_per_step, "recompute_overhead": self.recompute_overhead,
            "host_bytes": self.host_bytes, "optimizer_bytes": self.optimizer_bytes,
            "attention": self.attention, "all_gather_bytes": moved.get("all-gather"),
            "reduce_scatter_bytes": moved.get("reduce-scatter"), "all_reduce_bytes": moved.get("all-reduce"),
            "other_collective_bytes": sum(v for k, v in moved.items() if k not in known) if moved else None,
            "compile_seconds": self.compile_seconds, "step_seconds": self.step_seconds,
            "measured_peak_bytes": self.measured_peak_bytes, "bubble_fraction": self.bubble_fraction,
            "collective_permute_bytes": moved.get("collective-permute"),
            "predicted_step_seconds": self.predicted("seconds"), "tokens_per_second": self.predicted(
                "tokens_per_second"), "mfu": self.predicted("mfu"),
            "exposed_communication_seconds": (self.step_time["breakdown"]["exposed_communication"]
                                              if self.step_time else None),
            "host_transfer_bytes": self.predicted("host_transfer_bytes"),
            "host_transfer_seconds": self.predicted("host_transfer_seconds"), "tight": self.tight,
        }  # fmt: skip


def short_label(overrides: Sequence[str]) -> str:
    """Returns "policy=full global_batch=8" for ("remat.policy=full", "train.global_batch=8")."""
    return " ".join(item.split("=", 1)[0].split(".")[-1] + "=" + item.split("=", 1)[1] for item in overrides)


def pareto_front(points: Sequence[tuple[float, float]]) -> list[int]:
    """Returns the indices of the points no other point beats on both coordinates (lower is better),
    sorted by the first coordinate."""
    order = sorted(range(len(points)), key=lambda i: points[i])
    front, best_y = [], float("inf")
    for i in order:
        if points[i][1] < best_y:
            front.append(i)
            best_y = points[i][1]
    return front
