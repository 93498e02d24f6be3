"""Where training metrics go: a JSON-lines file, optionally TensorBoard, and a live progress bar.

    with MetricsLog("runs/tiny/metrics.jsonl", tensorboard_dir=None) as log:
        log.write({"step": 10, "loss": 3.2, "tokens_per_s": 41000.0})

Only process 0 writes; :func:`read_metrics` reads the file back (one dict per logged step).
"""

from __future__ import annotations

import json
import math
import os
import time
from pathlib import Path
from types import TracebackType
from typing import Any, Self

from rich.console import Console
from rich.progress import BarColumn, MofNCompleteColumn, Progress, ProgressColumn, TextColumn
from rich.text import Text

from shardmem.errors import ConfigError
from shardmem.units import format_bytes

__all__ = ["MetricsLog", "TrainProgress", "read_metrics", "format_record"]


def read_metrics(path: str | os.PathLike[str]) -> list[dict[str, Any]]:
    """Returns the records of a ``metrics.jsonl`` file; a torn last line (a killed run) is skipped."""
    records = []
    try:
        lines = Path(path).read_text().splitlines()
    except FileNotFoundError:
        return []
    for line in lines:
        try:
            records.append(json.loads(line))
        except json.JSONDecodeError:
            continue
    return records


def tensorboard_writer_class():
    """Returns tensorboardX's SummaryWriter, or raises ConfigError saying how to install it."""
    try:
        from tensorboardX import SummaryWriter
    except ImportError:
        raise ConfigError(
            "train.tensorboard=true needs the tensorboardX package, which is not installed; "
            "run `pip install tensorboardX`, or set train.tensorboard=false (metrics.jsonl is "
            "always written)"
        ) from None
    return SummaryWriter


class MetricsLog:
    """Appends one JSON object per logged step to ``path`` (and to TensorBoard when asked).

    Records of steps after ``start_step`` are dropped first: a run killed after its last
    checkpoint logged steps that the resumed run computes again.
    """

    def __init__(
        self,
        path: str | os.PathLike[str],
        *,
        tensorboard_dir: str | os.PathLike[str] | None = None,
        start_step: int = 0,
    ) -> None:
        self.path = Path(path)
        if self.path.exists():
            kept = [r for r in read_metrics(self.path) if r.get("step", 0) <= start_step]
            tmp = self.path.with_suffix(".jsonl.tmp")
            tmp.write_text("".join(json.dumps(r) + "\n" for r in kept))
            os.replace(tmp, self.path)
        self._file = open(self.path, "a", buffering=1)
        self._tensorboard = None
        if tensorboard_dir is not None:
            self._tensorboard = tensorboard_writer_class()(str(tensorboard_dir))

    def write(self, record: dict[str, Any]) -> None:
        self._file.write(json.dumps(record) + "\n")
        if self._tensorboard is not None:
            for key, value in record.items():
                if key != "step" and isinstance(value, int | float) and math.isfinite(value):
                    self._tensorboard.add_scalar(key, value, record["step"])

    def close(self) -> None:
        self._file.close()
        if self._tensorboard is not None:
            self._tensorboard.close()

    def __enter__(self) -> Self:
        return self

    def __exit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        self.close()


def format_record(record: dict[str, Any]) -> str:
    """Returns one human line for a metrics record: step, loss, gradient norm, loss scale (and the steps
    skipped for overflow), throughput, MFU, memory."""
    parts = [f"step {record['step']}", f"loss {record['loss']:.4f}"]
    if record.get("grad_norm") is not None:
        parts.append(f"grad norm {record['grad_norm']:.3g}")
    if record.get("loss_scale") is not None:  # float16 with dynamic loss scaling.
        skipped = int(record.get("skipped_steps", 0))
        parts.append(f"loss scale {record['loss_scale']:g}" + (f" ({skipped} skipped)" if skipped else ""))
    if record.get("tokens_per_s") is not None:
        parts.append(f"{record['tokens_per_s']:,.0f} tok/s")
    if record.get("step_time_s") is not None:
        parts.append(f"{record['step_time_s'] * 1e3:.1f} ms/step")
    if record.get("mfu") is not None:
        hfu = record.get("hfu")
        recomputed = hfu is not None and round(hfu, 3) != round(record["mfu"], 3)
        parts.append(f"MFU {record['mfu']:.1%}" + (f" (HFU {hfu:.1%})" if recomputed else ""))
    if record.get("memory_bytes_in_use") is not None:
        planned = record.get("memory_planned_bytes")
        memory = format_bytes(record["memory_bytes_in_use"])
        parts.append(f"mem {memory}" + (f" / plan {format_bytes(planned)}" if planned else ""))
    return "  ".join(parts)


class StepRate:
    """Time left from the steps' own pace: wall time between logged steps after the first one (so the
    compile and the first step, which are slow, do not count), times the steps still to run."""

    def __init__(self, total: int, clock=time.monotonic) -> None:
        self.total, self.clock = total, clock
        self._first: tuple[float, int] | None = None
        self._last: tuple[float, int] | None = None

    def update(self, step: int) -> None:
        now = (self.clock(), step)
        if self._first is None:
            self._first = now
        self._last = now

    def seconds_left(self) -> float | None:
        """Returns the estimate, or None until two logged steps have been seen."""
        if self._first is None or self._last is None or self._last[1] <= self._first[1]:
            return None
        per_step = (self._last[0] - self._first[0]) / (self._last[1] - self._first[1])
        return max(self.total - self._last[1], 0) * per_step


class _TimeLeftColumn(ProgressColumn):
    def __init__(self, rate: StepRate) -> None:
        super().__init__()
        self.rate = rate

    def render(self, task) -> Text:
        left = self.rate.seconds_left()
        if left is None:
            return Text("time left: measuring", style="progress.remaining")
        minutes, seconds = divmod(int(round(left)), 60)
        hours, minutes = divmod(minutes, 60)
        shown = f"{hours}:{minutes:02d}:{seconds:02d}" if hours else f"{minutes}:{seconds:02d}"
        return Text(f"time left ~{shown}", style="progress.remaining")


class TrainProgress:
    """A live progress bar (on a terminal) plus a printed line per logged step (always).

    Off a terminal (a log file, a launcher pipe) only the lines are printed.
    """

    def __init__(self, console: Console, *, total: int, start: int, enabled: bool = True) -> None:
        self.console = console
        self.enabled = enabled
        self.rate = StepRate(total)
        self._progress = Progress(
            TextColumn("[bold]train"),
            BarColumn(),
            MofNCompleteColumn(),
            TextColumn("{task.fields[status]}"),
            _TimeLeftColumn(self.rate),
            console=console,
            disable=not (enabled and console.is_terminal),
        )
        self._task = self._progress.add_task("train", total=total, completed=start, status="compiling")

    def update(self, record: dict[str, Any]) -> None:
        if self.enabled:
            status = format_record(record).split("  ", 1)[1]
            self.rate.update(record["step"])
            self._progress.update(self._task, completed=record["step"], status=status)

    def log(self, record: dict[str, Any]) -> None:
        self.print(format_record(record))

    def print(self, *objects: Any, **kwargs: Any) -> None:
        if self.enabled:
            self._progress.console.print(*objects, soft_wrap=True, **kwargs)

    def __enter__(self) -> Self:
        self._progress.start()
        return self

    def __exit__(self, *exc_info: object) -> None:
        self._progress.stop()
