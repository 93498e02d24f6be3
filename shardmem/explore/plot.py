"""Plots of plans for people: peak memory against compute, with the budget and the Pareto fronts.

    figure = plot_sweep(rows)            # rows from shardmem.explore.sweep.sweep
    figure.savefig("sweep.png")

Readable at a glance: fitting and non-fitting candidates in two colours with a legend; a log scale when the
peaks span more than a factor of 10 (one 393 GiB outlier would squash the rest into the bottom tenth); units
chosen for the figures' scale; labels placed where they collide with no other label; and a Pareto front per
global batch size among the candidates that fit (FLOPs of different batch sizes are not comparable, and a
point that does not fit is no option). Uses matplotlib's object API only, so it works in scripts, the CLI
(Agg backend) and notebooks alike.
"""

from __future__ import annotations

from collections.abc import Sequence

from shardmem.explore.rows import SweepRow, pareto_front, short_label

_BYTE_UNITS = (("TiB", 2**40), ("GiB", 2**30), ("MiB", 2**20), ("KiB", 2**10))
_FLOP_UNITS = (("PFLOP", 1e15), ("TFLOP", 1e12), ("GFLOP", 1e9), ("MFLOP", 1e6))
# Label offsets (points) tried in order: right-above, right-below, left-above, left-below, farther out.
_OFFSETS = [(5, 4), (5, -11), (-5, 4), (-5, -11), (5, 13), (5, -20), (-5, 13), (-5, -20), (5, 22), (-5, 22)]


def plot_sweep(rows: Sequence[SweepRow], *, x: str | None = None, title: str = "", ax=None):
    """Returns a figure of peak bytes per device against step time: measured when every planned row has one,
    else predicted when every row has an estimate (it counts host transfers and exposed communication,
    which FLOPs do not), else FLOPs per step; force with ``x="flops"``, ``x="predicted_step_seconds"``
    or ``x="step_seconds"``. Candidates that fit in green,
    the others in red, the budget as a dashed line and, per global batch size, the Pareto front of the
    fitting candidates (least memory for the compute) joined; every point is labelled."""
    if ax is None:
        from matplotlib.figure import Figure

        figure = Figure(figsize=(9, 5.5))
        ax = figure.add_subplot()
    else:
        figure = ax.figure
    planned = [r for r in rows if r.error is None]
    times = {
        "step_seconds": lambda r: r.step_seconds,
        "predicted_step_seconds": lambda r: r.predicted("seconds"),
    }
    if x is None:
        x = next((name for name, of in times.items() if planned and all(of(r) is not None for r in planned)),
                 "flops")  # fmt: skip
    if x not in ("flops", *times):
        raise ValueError(f"x={x!r}: use 'flops', 'predicted_step_seconds' or 'step_seconds'")
    if x in times:
        planned = [r for r in planned if times[x](r) is not None]
    raw_x = [times[x](r) if x in times else r.flops_per_step for r in planned]
    if x in times:
        x_unit, x_scale = ("s", 1.0) if raw_x and max(raw_x) >= 2 else ("ms", 1e-3)
        x_label = f"{'measured' if x == 'step_seconds' else 'predicted'} step time ({x_unit})"
    else:
        x_unit, x_scale = _unit(max(raw_x, default=0), _FLOP_UNITS, "FLOP")
        x_label = f"matmul {x_unit}s per step (all devices)"
    budgets = {r.budget_bytes for r in planned}
    budget = budgets.pop() if len(budgets) == 1 else None
    peaks = [r.peak_bytes for r in planned]
    y_unit, y_scale = _unit(
        max(peaks, default=0), _BYTE_UNITS, "bytes"
    )  # The points' scale, not the budget's.
    xs = [v / x_scale for v in raw_x]
    ys = [p / y_scale for p in peaks]

    for fits, color, label in ((True, "tab:green", "fits"), (False, "tab:red", "does not fit")):
        chosen = [i for i, r in enumerate(planned) if bool(r.fits) == fits]
        if chosen:
            ax.scatter([xs[i] for i in chosen], [ys[i] for i in chosen], c=color, s=40, zorder=3, label=label)
    on_front: set[int] = set()
    groups = _by_batch(planned)
    for n, (batch, members) in enumerate(groups.items()):
        fitting = [i for i in members if planned[i].fits]
        front = [fitting[j] for j in pareto_front([(xs[i], ys[i]) for i in fitting])]
        on_front |= set(front)
        if front:  # Markers too: a front of one point is still visible, and so is its legend entry.
            name = "Pareto front" + (f", global_batch={batch}" if batch and len(groups) > 1 else "")
            color = f"C{n}" if len(groups) > 1 else "tab:blue"
            ax.plot([xs[i] for i in front], [ys[i] for i in front], "-", marker="o", mfc="none", ms=11,
                    color=color, lw=1.5, zorder=2, label=name)  # fmt: skip
    if budget is not None:
        if ys and budget / y_scale > 20 * max(ys):  # Far above every point: say so rather than flatten them.
            ax.set_title(f"budget {budget / y_scale:.3g} {y_unit}, above the chart", loc="right", fontsize=8)
        else:
            ax.axhline(budget / y_scale, color="black", ls="--", lw=1, label=f"budget {budget / y_scale:.3g} "
                       f"{y_unit}")  # fmt: skip
    if ys and max(ys) > 10 * min(ys) > 0:
        ax.set_yscale("log")
        from matplotlib.ticker import FuncFormatter

        ax.yaxis.set_major_formatter(FuncFormatter(lambda v, _: f"{v:g}"))
        ax.yaxis.set_minor_formatter(FuncFormatter(lambda v, _: f"{v:g}" if f"{v:g}"[0] in "25" else ""))
    ax.set_xlabel(x_label)
    ax.set_ylabel(f"peak memory per device ({y_unit})" + (", log scale" if ax.get_yscale() == "log" else ""))
    ax.set_title(title or "memory against compute", loc="left")
    ax.grid(alpha=0.3, which="both")
    if planned:  # Beside the chart, where no point or label can be under it.
        ax.legend(loc="upper left", bbox_to_anchor=(1.01, 1), fontsize=8, frameon=False)
        if ax is figure.axes[0] and len(figure.axes) == 1:
            figure.subplots_adjust(left=0.09, right=0.7)
    _place_labels(ax, planned, xs, ys, on_front)
    return figure


def _unit(value: float, units, base: str) -> tuple[str, float]:
    """The largest unit in which ``value`` is at least 1 (so 0.003 GiB reads 3.07 MiB)."""
    for unit, scale in units:
        if value >= scale:
            return unit, scale
    return base, 1.0


def _by_batch(rows: Sequence[SweepRow]) -> dict[str, list[int]]:
    """Row indices grouped by their ``train.global_batch`` override ("" where it is not overridden)."""
    groups: dict[str, list[int]] = {}
    for i, row in enumerate(rows):
        batch = next((o.split("=", 1)[1] for o in row.overrides if o.startswith("train.global_batch=")), "")
        groups.setdefault(batch, []).append(i)
    return dict(sorted(groups.items(), key=lambda kv: (len(kv[0]), kv[0])))


def _place_labels(ax, rows, xs, ys, on_front) -> None:
    """Names every point, each at the first offset where its text overlaps no label placed before it (the
    Pareto front's first, in black; the others grey) and inside the axes; a point with no free place keeps
    the first offset."""
    figure = ax.figure
    if not hasattr(figure.canvas, "get_renderer"):
        from matplotlib.backends.backend_agg import FigureCanvasAgg

        FigureCanvasAgg(figure)
    ax.autoscale_view()
    renderer = figure.canvas.get_renderer()
    area = ax.get_window_extent(renderer)
    texts = [
        ax.annotate(short_label(row.overrides) or row.candidate, (xs[i], ys[i]), textcoords="offset points",
                    xytext=_OFFSETS[0], fontsize=7, color="black" if i in on_front else "dimgray")
        for i, row in enumerate(rows)
    ]  # fmt: skip
    placed = []
    for i in sorted(range(len(rows)), key=lambda i: (i not in on_front, i)):
        text = texts[i]
        for dx, dy in [*_OFFSETS, _OFFSETS[0]]:
            text.set_position((dx, dy))
            text.set_horizontalalignment("left" if dx > 0 else "right")
            box = text.get_window_extent(renderer)
            inside = area.x0 <= box.x0 and box.x1 <= area.x1 and area.y0 <= box.y0 and box.y1 <= area.y1
            if inside and not any(box.overlaps(other) for other in placed):
                break
        placed.append(box)
