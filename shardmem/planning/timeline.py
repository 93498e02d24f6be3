"""The memory timeline of a planned step: live bytes per device across the compiled schedule, before the run.

    report = shardmem.plan(config, target="h100-sxm")
    figure = shardmem.timeline(report)     # shows itself in a notebook
    figure.save_html("report.html")        # one self-contained file: inline SVG, no scripts, no network
    figure.save_png("report.png")          # the same picture with matplotlib

The picture is PyTorch's memory snapshot, drawn from XLA's buffer assignment instead of a run: every buffer
of the compiled step (see :class:`shardmem.planning.hlo.BufferSchedule`) stacked by the model scope that made
it, with the peak, the budget, where the backward pass and the optimizer update begin, and a table of the
buffers live at the peak. Its peak is the report's peak on GPU targets (XLA's, to within the few hundred bytes
of tuple index tables); on ``cpu`` the report's peak is an upper bound (arguments + outputs + all
temporaries) and both are drawn.
"""

from __future__ import annotations

import html
import math
from pathlib import Path

from shardmem.errors import PlanError
from shardmem.planning.hlo import CATEGORIES, BufferSchedule, ScheduledBuffer
from shardmem.planning.memory import MemoryReport
from shardmem.units import format_bytes

#: Colours of the categories (colour-blind safe, Okabe-Ito).
COLORS = dict(
    zip(
        CATEGORIES, ("#999999", "#E69F00", "#56B4E9", "#009E73", "#CC79A7", "#F0E442", "#0072B2"), strict=True
    )
)
_MAX_COLUMNS = 1200  # Schedules are thousands of positions long; bins keep each one's highest position.


class Timeline:
    """Live bytes per device over a planned step's schedule, stacked by category; ``report`` is its plan."""

    def __init__(self, report: MemoryReport, *, top: int = 15):
        if report.schedule is None:
            raise PlanError(
                f"the plan of {report.name!r} for {report.target} has no buffer assignment to draw: XLA "
                "wrote none for this compile; plan it again with shardmem.plan"
            )
        self.report = report
        self.schedule: BufferSchedule = report.schedule
        live = self.schedule.live_bytes()
        self.peak_position = self.schedule.peak_position
        self.peak_bytes = live[self.peak_position] if live else 0
        self.peak_buffers: list[ScheduledBuffer] = self.schedule.live_at(self.peak_position)[:top]
        self.positions = _columns(live, _MAX_COLUMNS)
        delta = {c: [0] * (self.schedule.length + 1) for c in CATEGORIES}
        for b in self.schedule.buffers:
            delta[b.category][b.start] += b.bytes
            delta[b.category][b.end + 1] -= b.bytes
        self.by_category = {}
        for c in CATEGORIES:
            row, total = [], 0
            for d in delta[c][:-1]:
                total += d
                row.append(total)
            if any(row):
                self.by_category[c] = [row[p] for p in self.positions]

    @property
    def budget_on_chart(self) -> bool:
        """Whether the budget is drawn as a line: not when it is over 3x the peak, which would flatten the
        picture into the bottom of the chart; it is then named at the top edge."""
        return self.report.budget_bytes <= 3 * max(self.peak_bytes, self.report_peak_bytes, 1)

    @property
    def y_max(self) -> float:
        shown = [self.peak_bytes, self.report_peak_bytes, 1]
        return max(shown + [self.report.budget_bytes] * self.budget_on_chart) * 1.1

    @property
    def report_peak_bytes(self) -> int:
        return self.report.per_device["peak"]

    def _summary(self) -> str:
        r = self.report
        text = (
            f"{r.name} on {r.target_label}: peak {format_bytes(self.peak_bytes)} per device at schedule "
            f"position {self.peak_position} of {self.schedule.length} ({self._phase(self.peak_position)}); "
            f"budget {format_bytes(r.budget_bytes)}: {'FITS' if r.fits else 'DOES NOT FIT'}"
        )
        if getattr(r, "step_time", None) is not None:  # What the schedule drawn costs in time.
            text += f"; predicted step time {r.step_time.summary()}"
        if r.approximate:
            text += (
                f". cpu target: the report's peak {format_bytes(self.report_peak_bytes)} is an upper bound "
                "(arguments + outputs + all temporaries), not a GPU prediction"
            )
        return text

    def _phase(self, position: int) -> str:
        s = self.schedule
        if s.optimizer_start is not None and position >= s.optimizer_start:
            return "optimizer update"
        if s.backward_start is not None and position >= s.backward_start:
            return "backward"
        return "forward"

    # --- SVG / HTML ------------------------------------------------------------------------------------

    def to_svg(self, width: int = 960, height: int = 420) -> str:
        """Returns the figure as an SVG element; hovering a band or a line names it (SVG titles)."""
        left, right, top, bottom = 78, 190, 30, 42
        plot_w, plot_h = width - left - right, height - top - bottom
        r = self.report
        y_max = self.y_max
        span = max(self.schedule.length - 1, 1)

        def px(position: int) -> float:
            return left + plot_w * position / span

        def y(v: float) -> float:
            return top + plot_h * (1 - v / y_max)

        out = [
            f'<svg xmlns="http://www.w3.org/2000/svg" width="{width}" height="{height}" '
            f'viewBox="0 0 {width} {height}" font-family="sans-serif" font-size="12" role="img">',
            f"<title>{html.escape(self._summary())}</title>",
        ]
        unit, scale = _unit(y_max)
        for tick in _round_ticks(y_max / scale):  # Axis and grid, at round values as the PNG's.
            v = tick * scale
            out.append(
                f'<line x1="{left}" x2="{left + plot_w}" y1="{y(v):.1f}" y2="{y(v):.1f}" stroke="#ddd"/>'
                f'<text x="{left - 6}" y="{y(v) + 4:.1f}" text-anchor="end">{tick:g}</text>'
            )
        out.append(
            f'<text x="16" y="{top + plot_h / 2}" transform="rotate(-90 16 {top + plot_h / 2})" '
            f'text-anchor="middle">live bytes per device ({unit})</text>'
        )
        out.append(
            f'<text x="{left + plot_w / 2}" y="{height - 8}" text-anchor="middle">position in the '
            "compiled step's schedule</text>"
        )
        base = [0] * len(self.positions)
        for category, values in self.by_category.items():  # Stacked bands, bottom up.
            upper = [b + v for b, v in zip(base, values, strict=True)]
            points = [f"{px(p):.1f},{y(u):.1f}" for p, u in zip(self.positions, upper, strict=True)]
            points += [
                f"{px(p):.1f},{y(b):.1f}" for p, b in reversed(list(zip(self.positions, base, strict=True)))
            ]
            at_peak = values[self.positions.index(self.peak_position)]
            out.append(
                f'<polygon class="band" data-category="{category}" points="{" ".join(points)}" '
                f'fill="{COLORS[category]}" fill-opacity="0.85" stroke="none"><title>{category}: '
                f"{format_bytes(at_peak)} at the peak</title></polygon>"
            )
            base = upper
        for row, (position, label) in enumerate(
            ((self.schedule.backward_start, "backward"), (self.schedule.optimizer_start, "optimizer update"))
        ):
            if position is not None:
                x = px(position)
                out.append(
                    f'<line x1="{x:.1f}" x2="{x:.1f}" y1="{top}" y2="{top + plot_h}" stroke="#444" '
                    f'stroke-dasharray="2,3"><title>{label} begins at position {position}</title></line>'
                    f'<text x="{x + 3:.1f}" y="{top + plot_h - 8 - 16 * row}" fill="#222">{label} →</text>'
                )
        budget = f"budget {format_bytes(r.budget_bytes)}"
        if self.budget_on_chart:
            budget_y = y(r.budget_bytes)
            out.append(
                f'<line id="budget" x1="{left}" x2="{left + plot_w}" y1="{budget_y:.1f}" y2="{budget_y:.1f}" '
                f'stroke="#D55E00" stroke-width="2" stroke-dasharray="8,4"><title>{budget}</title></line>'
                f'<text x="{left + plot_w + 6}" y="{budget_y + 4:.1f}" fill="#D55E00">{budget}</text>'
            )
        else:
            ratio = r.budget_bytes / max(self.peak_bytes, self.report_peak_bytes, 1)
            out.append(
                f'<text id="budget" x="{left + plot_w}" y="{top - 8}" text-anchor="end" fill="#D55E00">'
                f"↑ {budget}: {ratio:,.0f}x the peak, above the chart</text>"
            )
        if r.approximate and self.report_peak_bytes != self.peak_bytes:
            ry = y(self.report_peak_bytes)
            out.append(
                f'<line x1="{left}" x2="{left + plot_w}" y1="{ry:.1f}" y2="{ry:.1f}" stroke="#000" '
                f'stroke-dasharray="1,3"><title>the cpu report\'s peak (upper bound)</title></line>'
                f'<text x="{left + plot_w + 6}" y="{ry - 4:.1f}">report peak (bound) '
                f"{format_bytes(self.report_peak_bytes)}</text>"
            )
        peak_x, peak_y = px(self.peak_position), y(self.peak_bytes)
        out.append(
            f'<circle id="peak" cx="{peak_x:.1f}" cy="{peak_y:.1f}" r="5" fill="#000"><title>peak '
            f"{format_bytes(self.peak_bytes)} at position {self.peak_position}</title></circle>"
            f'<text x="{min(peak_x + 8, left + plot_w - 4):.1f}" y="{max(peak_y - 8, top + 26):.1f}" '
            f'font-weight="bold" text-anchor="{"end" if peak_x > left + plot_w * 0.7 else "start"}">'
            f"peak {format_bytes(self.peak_bytes)}</text>"
        )
        for i, category in enumerate(self.by_category):  # Legend, top category first like the bands.
            ly = top + 64 + 18 * (len(self.by_category) - 1 - i)
            out.append(
                f'<rect x="{left + plot_w + 8}" y="{ly - 10}" width="12" height="12" '
                f'fill="{COLORS[category]}"/><text x="{left + plot_w + 26}" y="{ly}">{category}</text>'
            )
        out.append(
            f'<rect x="{left}" y="{top}" width="{plot_w}" height="{plot_h}" fill="none" stroke="#888"/>'
        )
        out.append("</svg>")
        return "\n".join(out)

    def _table(self) -> str:
        rows = "".join(
            f"<tr><td class='num'>{format_bytes(b.bytes)}</td><td>{html.escape(b.shape)}</td>"
            f"<td>{html.escape(b.scope)}</td><td>{b.category}</td><td class='num'>{b.start}-{b.end}</td></tr>"
            for b in self.peak_buffers
        )
        shown = sum(b.bytes for b in self.peak_buffers)
        return (
            f"<table><caption>Largest buffers live at the peak ({format_bytes(shown)} of "
            f"{format_bytes(self.peak_bytes)})</caption><tr><th>bytes</th><th>shape</th><th>made by (scope)"
            f"</th><th>category</th><th>live (positions)</th></tr>{rows}</table>"
        )

    def _repr_html_(self) -> str:
        return f"<div><p>{html.escape(self._summary())}</p>{self.to_svg()}{self._table()}</div>"

    def to_html(self) -> str:
        """Returns a self-contained HTML page: summary, figure and the table of buffers at the peak."""
        r = self.report
        return f"""<!DOCTYPE html>
<html lang="en"><head><meta charset="utf-8"><title>shardmem plan: {html.escape(r.name)} on {r.target}</title>
<style>body{{font-family:sans-serif;margin:24px;color:#222}} table{{border-collapse:collapse;margin-top:12px}}
td,th{{padding:2px 10px;border-bottom:1px solid #eee;text-align:left;font-size:13px}} .num{{text-align:right}}
caption{{text-align:left;font-weight:bold;padding:6px 0}}</style></head>
<body><h2>shardmem plan: {html.escape(r.name)} · {html.escape(r.target_label)}</h2>
<p id="summary">{html.escape(self._summary())}</p>
{self.to_svg()}
{self._table()}
<p style="color:#666;font-size:12px">From XLA's buffer assignment of the compiled step (JAX {r.jax_version});
each buffer is counted once however many values XLA aliases into it. Hover a band or a line to name it.</p>
</body></html>
"""

    def save_html(self, path: str | Path) -> Path:
        """Writes :meth:`to_html` to ``path`` and returns it."""
        path = Path(path)
        path.write_text(self.to_html())
        return path

    # --- PNG --------------------------------------------------------------------------------------------

    def figure(self):
        """Returns the timeline as a matplotlib figure (object API; no global pyplot state)."""
        from matplotlib.figure import Figure

        r = self.report
        figure = Figure(figsize=(11, 4.8))
        ax = figure.add_subplot()
        y_max = self.y_max
        unit, scale = _unit(y_max)
        ax.stackplot(
            self.positions,
            *[[v / scale for v in vs] for vs in self.by_category.values()],
            labels=list(self.by_category),
            colors=[COLORS[c] for c in self.by_category],
            alpha=0.85,
        )
        if self.budget_on_chart:
            ax.axhline(
                r.budget_bytes / scale,
                color="#D55E00",
                ls="--",
                lw=2,
                label=f"budget {format_bytes(r.budget_bytes)}",
            )
        else:
            ax.set_title(f"budget {format_bytes(r.budget_bytes)}: above the chart", loc="right", fontsize=9,
                         color="#D55E00")  # fmt: skip
        if r.approximate and self.report_peak_bytes != self.peak_bytes:
            ax.axhline(
                self.report_peak_bytes / scale,
                color="black",
                ls=":",
                lw=1,
                label=f"report peak (cpu bound) {format_bytes(self.report_peak_bytes)}",
            )
        ax.plot([self.peak_position], [self.peak_bytes / scale], "ko")
        ax.annotate(
            f"peak {format_bytes(self.peak_bytes)}",
            (self.peak_position, self.peak_bytes / scale),
            textcoords="offset points",
            xytext=(6, 6),
            fontweight="bold",
        )
        for position, label in (
            (self.schedule.backward_start, "backward"),
            (self.schedule.optimizer_start, "optimizer update"),
        ):
            if position is not None:
                ax.axvline(position, color="#444", ls=(0, (2, 3)), lw=1)
                height = y_max / scale * (0.02 + 0.05 * (label != "backward"))
                ax.text(position, height, f" {label} →", va="bottom", fontsize=8, color="#222")
        ax.set_ylim(0, y_max / scale)
        ax.set_xlim(0, max(self.schedule.length - 1, 1))
        ax.set_xlabel("position in the compiled step's schedule")
        ax.set_ylabel(f"live bytes per device ({unit})")
        verdict = "fits" if r.fits else "DOES NOT FIT"
        peak, budget = format_bytes(self.report_peak_bytes), format_bytes(r.budget_bytes)
        title = f"{r.name} · {r.target}: memory timeline; peak {peak} of {budget}: {verdict}"
        ax.set_title(title, loc="left", color="black" if r.fits else "#D55E00")
        ax.legend(loc="upper left", bbox_to_anchor=(1.01, 1), fontsize=8, frameon=False)
        ax.grid(alpha=0.3)
        figure.tight_layout()
        return figure

    def save_png(self, path: str | Path) -> Path:
        """Writes the matplotlib figure to ``path`` as PNG and returns it."""
        path = Path(path)
        self.figure().savefig(path, dpi=110, format="png")
        return path


def timeline(report: MemoryReport, *, top: int = 15) -> Timeline:
    """Returns the memory timeline of a planned step (see the module docstring); ``top`` buffers at the peak
    are listed."""
    return Timeline(report, top=top)


def _columns(live: list[int], limit: int) -> list[int]:
    """Positions to draw: all of them, or per bin the one with the most live bytes (the peak survives)."""
    if len(live) <= limit:
        return list(range(len(live)))
    size = -(-len(live) // limit)
    return [max(range(i, min(i + size, len(live))), key=live.__getitem__) for i in range(0, len(live), size)]


def _round_ticks(top: float, most: int = 6) -> list[float]:
    """Returns 0, step, 2 step, ... up to ``top``: at most ``most`` ticks, the step 1, 2, 2.5 or 5 times a
    power of ten (13.3, 26.6, ... tell a reader nothing)."""
    if top <= 0:
        return [0.0]
    power = 10 ** math.floor(math.log10(top / most))
    step = next(m * power for m in (1, 2, 2.5, 5, 10, 20) if round(top / (m * power), 9) < most)
    return [round(i * step, 10) for i in range(int(top / step + 1e-9) + 1)]


def _unit(value: float) -> tuple[str, int]:
    for unit, scale in (("GiB", 2**30), ("MiB", 2**20), ("KiB", 2**10)):
        if value >= 2 * scale:
            return unit, scale
    return "bytes", 1
