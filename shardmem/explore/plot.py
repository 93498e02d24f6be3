"""Plots of plans for people: peak memory against compute, with the budget and the Pareto front.

    figure = plot_sweep(rows)            # rows from shardmem.explore.sweep.sweep
    figure.savefig("sweep.png")

Uses matplotlib's object API only (no global pyplot state beyond creating the figure), so it works in
scripts, the CLI (Agg backend) and notebooks alike.
"""

from __future__ import annotations

from collections.abc import Sequence

from shardmem.explore.sweep import SweepRow, pareto_front, short_label

_GIB = 2**30


def plot_sweep(rows: Sequence[SweepRow], *, x: str | None = None, title: str = "", ax=None):
    """Returns a figure of peak bytes per device against FLOPs per step (or measured step time when
    every planned row has one; force with ``x="flops"`` or ``x="step_seconds"``): fitting candidates in
    green, the others in red, the budget as a dashed line and the Pareto front (least memory for the
    compute) joined; every point is labelled."""
    if ax is None:
        from matplotlib.figure import Figure

        figure = Figure(figsize=(8, 5))
        ax = figure.add_subplot()
    else:
        figure = ax.figure
    planned = [r for r in rows if r.error is None]
    if x is None:
        x = "step_seconds" if planned and all(r.step_seconds is not None for r in planned) else "flops"
    if x not in ("flops", "step_seconds"):
        raise ValueError(f"x={x!r}: use 'flops' or 'step_seconds'")
    if x == "step_seconds":
        planned = [r for r in planned if r.step_seconds is not None]
    xs = [r.step_seconds * 1e3 if x == "step_seconds" else r.flops_per_step / 1e12 for r in planned]
    ys = [r.peak_bytes / _GIB for r in planned]
    colors = ["tab:green" if r.fits else "tab:red" for r in planned]
    ax.scatter(xs, ys, c=colors, s=36, zorder=3)
    front = pareto_front(list(zip(xs, ys, strict=True)))
    if front:
        ax.plot([xs[i] for i in front], [ys[i] for i in front], color="tab:blue", lw=1.5, zorder=2,
                label="Pareto front")  # fmt: skip
    on_front = set(front)
    for i, row in enumerate(planned):  # Every point named; the front's names in black, the rest grey.
        ax.annotate(short_label(row.overrides) or row.candidate, (xs[i], ys[i]), textcoords="offset points",
                    xytext=(5, 4), fontsize=7, color="black" if i in on_front else "dimgray")  # fmt: skip
    budgets = {r.budget_bytes for r in planned}
    if len(budgets) == 1:
        budget = budgets.pop() / _GIB
        if ys and budget > 3 * max(ys):  # Far above every point: say so rather than flatten them.
            ax.set_title(f"budget {budget:.1f} GiB, off the chart", loc="right", fontsize=8)
        else:
            ax.axhline(budget, color="black", ls="--", lw=1, label="budget")
    ax.set_xlabel("measured step time (ms)" if x == "step_seconds" else "matmul TFLOPs per step")
    ax.set_ylabel("peak memory per device (GiB)")
    ax.set_title(title or "memory against compute")
    ax.grid(alpha=0.3)
    if planned:
        ax.legend(loc="best", fontsize=8)
    return figure
