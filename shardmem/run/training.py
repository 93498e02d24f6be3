"""The training loop: gate on the memory plan, then train, log, checkpoint and resume.

    result = train(load_config("configs/tiny.yaml"), "runs/tiny")
    result.status, result.final_step, result.history[-1]["loss"]

Before anything the size of the model is allocated, the step is planned for the attached devices
(:func:`shardmem.planning.memory.plan_program` with target ``local``); a step that does not fit raises
:class:`DoesNotFitError` unless ``force=True``. In a single process the plan's compiled step is the
one that trains, so the step is compiled once. A run directory that holds checkpoints resumes from
the newest one, onto whatever mesh the current devices give, and the batch of step ``k`` depends only
on ``(train.seed, k)``, so a resumed run computes what an uninterrupted one would have.

The run directory holds ``run.lock`` (held by the run that owns the directory, see
:mod:`shardmem.run.lock`), ``config.yaml`` (the resolved config), ``plan.json`` (the memory report),
``metrics.jsonl`` (one record per logged step), ``checkpoints/<step>/`` (Orbax, sharded) and
``tensorboard/`` when ``train.tensorboard`` is set.
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import math
import os
import pickle
import shutil
import signal
import sys
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any, NoReturn

import jax
import jax.numpy as jnp
import numpy as np
import yaml
from rich.console import Console

from shardmem._interrupt import sigint_to_python, undone_on_interrupt
from shardmem.config import Config, load_config
from shardmem.errors import ConfigError, PlanError, ShardmemError
from shardmem.finetune.weights import check_init_from, same_init_from
from shardmem.parallel.mesh import build_mesh
from shardmem.planning.memory import MemoryReport, make_target, plan_program
from shardmem.planning.targets import peak_flops_for
from shardmem.program import LossFn, ModelFactory, TrainingProgram, build_program
from shardmem.run.checkpoint import Checkpointer, committed_steps
from shardmem.run.data import batch_stream
from shardmem.run.lock import LOCK_NAME, RunDirLock
from shardmem.run.metrics import MetricsLog, TrainProgress, tensorboard_writer_class
from shardmem.units import format_bytes

__all__ = ["DivergedError", "DoesNotFitError", "TrainResult", "start_runtime", "train"]


class DoesNotFitError(PlanError):
    """The step needs more device memory than the budget; ``report`` says what it is made of."""

    def __init__(self, message: str, report: MemoryReport) -> None:
        super().__init__(message)
        self.report = report


class DivergedError(ShardmemError):
    """The loss, the gradient norm or the trained state became NaN or infinite; nothing from that step
    on was saved."""

    def __init__(self, message: str, step: int, last_checkpoint: int | None) -> None:
        super().__init__(message)
        self.step = step
        self.last_checkpoint = last_checkpoint


@dataclasses.dataclass(frozen=True)
class TrainResult:
    """How a call to :func:`train` ended.

    ``status`` is "finished", "preempted" (SIGTERM) or "interrupted" (SIGINT); in every case the
    state at ``final_step`` is saved. ``history`` holds the logged metrics records of this call.
    """

    run_dir: Path
    status: str
    start_step: int
    final_step: int
    history: list[dict[str, Any]]
    report: MemoryReport
    state: dict | None = dataclasses.field(default=None, repr=False)

    @property
    def final_loss(self) -> float | None:
        return self.history[-1]["loss"] if self.history else None


def train(
    config: Config,
    run_dir: str | os.PathLike[str],
    *,
    force: bool = False,
    console: Console | None = None,
    model_factory: ModelFactory | None = None,
    loss_fn: LossFn | None = None,
    batch: Any = None,
) -> TrainResult:
    """Trains ``config`` for ``train.steps`` steps in ``run_dir``, resuming from its newest checkpoint.

    Raises :class:`DoesNotFitError` when the planned step exceeds the memory budget (unless
    ``force``), :class:`DivergedError` on a non-finite loss, gradient or state, and
    :class:`~shardmem.ConfigError` for a bad config or data file: before any work, except for a bad
    token id, which shows on the batch that holds it (the steps done before it are saved first).
    Multi-process runs call :func:`start_runtime` first (before any JAX work); every process calls
    ``train`` with the same arguments and ``run_dir`` must be on a file system they share. SIGTERM and
    SIGINT are handled from the first step on: the state is saved and ``status`` says which signal
    stopped the run. ``model_factory``, ``loss_fn`` and ``batch`` train a model of your own, as
    :func:`shardmem.build_program` takes them (or ``model.factory``, ``train.loss``, ``data.batch`` and
    ``data.source`` in the config).
    """
    run_dir = Path(run_dir)
    lead = jax.process_index() == 0
    console = console or Console()
    if not lead:
        console = Console(quiet=True)
    train_config = config.train
    if train_config.tensorboard:
        tensorboard_writer_class()  # Fails now, not after the first checkpoint.
    _check_run_dir(run_dir)
    _on_every_process(RunDirLock(run_dir).check)  # Another run's lock: said now, not after the compile.

    mesh = build_mesh(config.mesh.axes, jax.devices())
    program = build_program(config, mesh, model_factory=model_factory, loss_fn=loss_fn, batch=batch)
    # A resume restores the pretrained base from the run's checkpoint, not from finetune.init_from, which
    # may be gone by then (the run moved to another machine); a fresh start checks the weights' names,
    # dtypes and shapes now, before the compile too.
    resuming = bool(committed_steps(run_dir / "checkpoints"))
    if not resuming:
        check_init_from(program)
    source = batch_stream(config, program)  # A bad data file fails now, before the compile.
    report, step_fn = _plan_once(program, reads_init_from=not resuming)
    peak, limit = report.per_device["peak"], report.budget_bytes
    if not report.fits:
        message = (
            f"the step needs {format_bytes(peak)} per device but the budget is {format_bytes(limit)} "
            f"({report.target_label}; memory.usable_fraction={config.memory.usable_fraction}, "
            f"memory.reserve={format_bytes(config.memory.reserve)}); make it fit (remat.policy=full, "
            "a larger mesh.axes.fsdp, more train.micro_batches) or pass --force to run anyway"
        )
        if not force:
            raise DoesNotFitError(message, report)
        _say(console, f"[yellow]warning:[/yellow] {message.split('; make')[0]}; running anyway (--force)")

    for warning in report.warnings:  # What `plan` would warn about (a rule sharding nothing, ...).
        _say(console, f"[yellow]warning:[/yellow] {warning}")
    preallocate = os.environ.get("XLA_PYTHON_CLIENT_PREALLOCATE", "true").lower()
    if preallocate in ("false", "0") and not report.approximate:
        _say(
            console,
            "[yellow]warning:[/yellow] XLA_PYTHON_CLIENT_PREALLOCATE=false: the allocator then grows region "
            "by region and can fragment, so a step that fits the plan may still run out of memory "
            "(measured on an H200, BENCHMARKS.md); unset it to keep JAX's preallocated pool",
        )

    started = _Start(run_dir if lead else None)
    # Until the first step, Ctrl-C (in the CLI) ends the process at once: what this start made goes first.
    with undone_on_interrupt(started.undo):
        return _run(config, run_dir, program, step_fn, source, report, started, console)


def _run(config: Config, run_dir: Path, program: TrainingProgram, step_fn, source, report: MemoryReport,
         started: _Start, console: Console) -> TrainResult:  # fmt: skip
    """Sets up the run directory, then restores or initialises the state and trains; a start that fails
    before its first step leaves the run directory as it was (:class:`_Start`)."""
    train_config, lead = config.train, jax.process_index() == 0
    try:
        run_dir.mkdir(parents=True, exist_ok=True)
    except OSError as e:
        raise ConfigError(f"cannot create run directory {str(run_dir)!r}: {e.strerror}; choose another "
                          "--run-dir") from None  # fmt: skip
    try:
        lock = started.lock = _lock_run_dir(run_dir, console)
    except BaseException:
        started.keep()  # Another run holds the directory (made it, too, maybe): nothing here is ours.
        raise
    try:
        checkpointer = Checkpointer(run_dir / "checkpoints", every=train_config.checkpoint_every,
                                    keep=train_config.keep_checkpoints)  # fmt: skip
    except BaseException:
        started.undo()
        raise
    try:
        _remove_unfinished_saves(checkpointer, console)
        try:
            start, state, moved = checkpointer.restore_newest(program.abstract_state)
        except ConfigError as e:
            if checkpointer.MISMATCH in str(e):
                _name_the_changed_keys(run_dir / "config.yaml", config, e)
            raise
        for corrupt in moved:
            resumed = f"resuming from step {start}" if start is not None else "starting again from step 0"
            _say(console, f"[yellow]warning:[/yellow] checkpoint {corrupt.step} does not restore "
                          f"({corrupt.reason}); moved it to {corrupt.path}; {resumed}")  # fmt: skip
        if start is not None:
            _say_casts(checkpointer.casts(program.abstract_state, start), start, console)
        if start is None:
            start, state = 0, program.init()
        if start > 0:  # Resumed.
            _check_resumed_finetune(run_dir / "config.yaml", config)
        # Only now: a resume that cannot restore leaves the run's files as they were, and so does a start
        # with nothing left to train.
        if lead and start < train_config.steps:
            _write_config(run_dir / "config.yaml", config, console)
            _write_atomically(run_dir / "plan.json", json.dumps(report.to_json(), indent=2) + "\n")
        with _StopSignals() as signals:  # From here on a signal stops the run at a step, saved.
            status, state, loop = _begin(config, run_dir, program, step_fn, source, report, checkpointer,
                                         start, state, signals, started, console)  # fmt: skip
        if loop is None:
            return TrainResult(run_dir, status, start, start, [], report, state)
        final = loop.step
        how = {"finished": "finished", "preempted": "stopped by SIGTERM", "interrupted": "interrupted"}
        _say(
            console,
            f"{how[status]} at step {final}; checkpoint saved in {run_dir / 'checkpoints'}"
            + ("" if status == "finished" else "; run the same command again to resume"),
        )
        return TrainResult(run_dir, status, start, final, loop.history, report, state)
    finally:
        try:
            checkpointer.close()
        finally:
            lock.release()
            started.undo()  # Before the first step: what this start created.


def _begin(config: Config, run_dir: Path, program: TrainingProgram, step_fn, source, report: MemoryReport,
           checkpointer: Checkpointer, start: int, state, signals: _StopSignals, started: _Start,
           console: Console) -> tuple[str, Any, _Loop | None]:  # fmt: skip
    """Says how the run begins and trains from step ``start``; returns (status, state, the loop), the
    loop None when ``train.steps`` were already done."""
    train_config, mesh = config.train, program.mesh
    mesh_text = " ".join(f"{axis}={size}" for axis, size in mesh.shape.items())
    begin = f"resuming from step {start}" if start else "new run"
    _say(
        console,
        f"[bold]shardmem train[/bold] {config.name}: {begin} in {run_dir}, mesh {mesh_text} over "
        f"{mesh.size} devices in {jax.process_count()} process{'es' * (jax.process_count() > 1)}; plan "
        f"peak {format_bytes(report.per_device['peak'])} per device of {format_bytes(report.budget_bytes)}",
    )
    if start >= train_config.steps:
        started.keep()
        _say(console, f"already trained to step {start} (train.steps={train_config.steps}); raise "
                      "train.steps to continue (the learning-rate schedule then decays over the new "
                      "train.steps, so the rate jumps up at the resume)")  # fmt: skip
        return "finished", state, None
    loop = _Loop(config, program, step_fn, source, checkpointer, report, start)
    tensorboard_dir = run_dir / "tensorboard" if train_config.tensorboard else None
    with (
        MetricsLog(run_dir / "metrics.jsonl", tensorboard_dir=tensorboard_dir, start_step=start)
        if jax.process_index() == 0 else _NoLog() as log,
        TrainProgress(console, total=train_config.steps, start=start) as progress,
    ):  # fmt: skip
        # The run directory is the run's once its first step is under way (a failure before that, such
        # as a bad token in the first batch, leaves the directory as it was), or once the loop returns.
        status, state = loop.run(state, log, progress, signals, first_step=started.keep)
        started.keep()
        checkpointer.wait()  # Still under the signal handlers: a second Ctrl-C here exits cleanly.
    return status, state, loop


class _Start:
    """What a start makes in the run directory before its first step, undone when the start fails or is
    interrupted (:meth:`undo`): a new run directory goes, with the folders above it that it made; in one
    that was there, the lock file and the checkpoints folder it added, if still empty. ``run_dir`` None:
    a process other than the first, which leaves the files to it."""

    def __init__(self, run_dir: Path | None) -> None:
        self.lock: RunDirLock | None = None
        missing = [p for p in (run_dir, *run_dir.parents) if not p.exists()] if run_dir else []
        self.top = missing[-1] if missing else None  # The outermost folder this start creates.
        added = (run_dir / LOCK_NAME, run_dir / "checkpoints") if run_dir and not missing else ()
        self.added = [p for p in added if not p.exists()]

    def keep(self) -> None:
        """The run has begun: nothing is undone any more (the run gives its lock back itself)."""
        self.top, self.added, self.lock = None, [], None

    def undo(self) -> None:
        if self.lock is not None:
            self.lock.release()
        if self.top is not None:
            shutil.rmtree(self.top, ignore_errors=True)
        for path in self.added:
            with contextlib.suppress(OSError):
                path.rmdir() if path.is_dir() else path.unlink()
        self.keep()


def _write_atomically(path: Path, text: str) -> None:
    """Writes ``text`` to ``path`` by renaming a finished temporary file over it: an interrupt mid-write
    leaves the previous file, never half of the new one."""
    temporary = path.with_name(f".{path.name}.tmp")
    with undone_on_interrupt(lambda: temporary.unlink(missing_ok=True)):
        temporary.write_text(text)
        os.replace(temporary, path)


class _Loop:
    """One run of steps: dispatches step k+1 before reading step k's metrics, so the host never
    waits on the device except to log or to save (a state is saved only after every step before it
    is known to be finite)."""

    def __init__(self, config: Config, program, step_fn, source, checkpointer, report, start: int):
        self.config, self.program, self.step_fn, self.source = config, program, step_fn, source
        self.checkpointer, self.report = checkpointer, report
        self.start = self.step = start
        self.history: list[dict[str, Any]] = []
        first = jax.tree.leaves(program.abstract_batch)[0].shape
        # Tokens for the reference batch (its rows hold seq_len + 1 tokens); examples for any other.
        self.items_per_step = first[0] * (first[1] - 1) if program.token_batch else first[0]
        self.items = "tokens" if program.token_batch else "examples"
        device = jax.local_devices()[0]
        self.device = device
        peak = peak_flops_for(device.device_kind)
        self.peak_flops = peak * program.mesh.size if peak else None
        self._window: list[float] = []
        self._last_done = 0.0
        self._compiled = False

    def run(self, state, log, progress, signals, first_step=lambda: None) -> tuple[str, dict]:
        """Trains from ``self.step`` to ``train.steps`` (or until a signal); calls ``first_step()`` once
        the first step is dispatched."""
        train = self.config.train
        pending = None
        status = "finished"
        self._last_done = time.perf_counter()
        while self.step < train.steps:
            self.checkpointer.check_for_errors()  # A failed background save stops the run at once.
            if _any_process(signals.received is not None):
                status = "interrupted" if signals.received == signal.SIGINT else "preempted"
                break
            try:
                batch = self.source(self.step)
            except ConfigError as error:  # A bad token id shows on the batch that holds it.
                self._stop_on_bad_data(error, state, pending, log, progress)
            state, metrics = self.step_fn(state, batch)
            if self.step == self.start:
                first_step()
            self.step += 1
            if pending is not None:
                self._complete(*pending, log, progress)
            pending = (self.step, metrics)
            if self.step % train.checkpoint_every == 0:
                self._complete(*pending, log, progress)
                pending = None
                self._save(state)
        if pending is not None:
            self._complete(*pending, log, progress)
        self._save(state, force=True)
        return status, state

    def _stop_on_bad_data(self, error: ConfigError, state, pending, log, progress) -> NoReturn:
        """Keeps the steps done so far (one process: several would have to save together, and only
        this one read the bad batch), then raises ``error`` with the step it stopped at."""
        kept = ""
        if jax.process_count() == 1 and self.step > self.start:
            if pending is not None:
                self._complete(*pending, log, progress)
            self._save(state, force=True)
            self.checkpointer.wait()
            kept = f"; steps up to {self.step} are saved in {self.checkpointer.directory}, rerun to resume"
        raise ConfigError(f"the batch of step {self.step + 1}: {error}{kept}") from None

    def _save(self, state, force: bool = False) -> None:
        """Saves the state, if it is finite: an update can overflow although the loss and gradient it
        came from were finite, and a checkpoint of it would fail every resume."""
        if not bool(_all_finite(state).addressable_data(0)):
            self._diverged(self.step, "the parameters or optimizer state after it are not finite")
        self.checkpointer.save(self.step, state, force=force)

    def _diverged(self, step: int, what: str) -> NoReturn:
        self.checkpointer.wait()
        saved = self.checkpointer.latest_step()
        kept, rerun = "no checkpoint was saved", "rerun to start again from step 0"
        if saved is not None:
            kept, rerun = f"the last good checkpoint is step {saved}", f"rerun to resume from {saved}"
        raise DivergedError(
            f"non-finite training at step {step}: {what}; stopped without saving it, {kept} in "
            f"{self.checkpointer.directory}. Lower optimizer.learning_rate, raise optimizer.warmup_steps "
            f"or set optimizer.grad_clip, then {rerun}",
            step,
            saved,
        )

    def _complete(self, step: int, metrics, log, progress) -> None:
        """Waits for ``step``'s metrics, stops on a non-finite value, updates the bar and the log."""
        values = {name: float(value) for name, value in jax.device_get(metrics).items()}
        now = time.perf_counter()
        elapsed, self._last_done = now - self._last_done, now
        first, self._compiled = not self._compiled, True
        if not all(math.isfinite(v) for v in values.values()):
            shown = ", ".join(f"{name} {value}" for name, value in values.items())
            self._diverged(step, f"metrics {shown}")
        if not first:  # A process's first step pays one-off costs (and compiles, with several processes).
            self._window.append(elapsed)
        record: dict[str, Any] = {"step": step, **values}
        if self._window:
            step_time = float(np.mean(self._window[-self.config.train.log_every :]))
            record["step_time_s"] = step_time
            record[f"{self.items}_per_s"] = self.items_per_step / step_time
            record.update(_utilization(self.report, step_time, self.peak_flops))
        else:
            record["first_step_s"] = elapsed
        if self.device.platform != "cpu":
            stats = self.device.memory_stats() or {}
            if "bytes_in_use" in stats:
                record["memory_bytes_in_use"] = int(stats["bytes_in_use"])
                record["memory_peak_bytes"] = int(stats.get("peak_bytes_in_use", 0))
                record["memory_planned_bytes"] = self.report.per_device["peak"]
        progress.update(record)
        train = self.config.train
        if step % train.log_every == 0 or step == train.steps or not self.history:
            record["time"] = time.time()
            self.history.append(record)
            log.write(record)
            progress.log(record)


@jax.jit
def _all_finite(tree) -> jax.Array:
    """Whether every floating-point value in ``tree`` is finite (one scalar, on device)."""
    leaves = [x for x in jax.tree.leaves(tree) if jnp.issubdtype(x.dtype, jnp.floating)]
    return jnp.all(jnp.stack([jnp.isfinite(x).all() for x in leaves]))


def _utilization(report: MemoryReport, step_time: float, peak_flops: float | None) -> dict[str, float]:
    """Returns ``{"mfu": ..., "hfu": ...}`` for a step of ``step_time`` seconds on devices of
    ``peak_flops`` FLOP/s in all (empty when the peak is unknown).

    MFU counts the model's FLOPs (the step without rematerialization); HFU counts what the devices
    executed, recomputation included, so HFU >= MFU and they are equal without remat.
    """
    if not peak_flops:
        return {}
    per_second = peak_flops * step_time
    return {"mfu": (report.flops_no_remat or report.flops_per_step) / per_second,
            "hfu": report.flops_per_step / per_second}  # fmt: skip


def _plan_once(program: TrainingProgram, *, reads_init_from: bool) -> tuple[MemoryReport, Callable]:
    """Plans the step for the attached devices and returns the report with the step function to train
    with. One process: the plan's compiled step, so the step is compiled once. Several: process 0 plans
    and gives every process the report, so that all of them take the same decision, and each compiles
    ``program.step`` itself, with the plan's XLA options (:func:`compiled_step`). A planning error on
    process 0 is raised on every process, so that all of them exit alike. ``reads_init_from``: as
    :func:`plan_program`'s."""
    target = make_target(program.config, "local")
    if jax.process_count() == 1:
        return plan_program(program, target, top=5, reads_init_from=reads_init_from)
    from jax.experimental import multihost_utils

    payload = b""
    failure: BaseException | None = None
    if jax.process_index() == 0:
        try:
            outcome: object = plan_program(program, target, top=5, reads_init_from=reads_init_from)[0]
        except ShardmemError as error:
            # Sent as class and message, which always pickle; a subclass's own arguments may not.
            kind = next(c for c in (ConfigError, PlanError, ShardmemError) if isinstance(error, c))
            failure, outcome = error, (kind, str(error))
        except Exception as error:  # Unexpected: process 0 shows the traceback, the others need not wait.
            failure, outcome = error, (PlanError, f"process 0 failed to plan the step: {error!r}")
        payload = pickle.dumps(outcome)
    size = int(multihost_utils.broadcast_one_to_all(np.int64(len(payload))))
    buffer = np.zeros(size, np.uint8)
    buffer[: len(payload)] = np.frombuffer(payload, np.uint8)
    outcome = pickle.loads(np.asarray(multihost_utils.broadcast_one_to_all(buffer)).tobytes())
    if failure is not None:
        raise failure
    if isinstance(outcome, tuple):
        kind, message = outcome
        raise kind(message)
    return outcome, compiled_step(program, outcome)


def compiled_step(program: TrainingProgram, report: MemoryReport) -> Callable:
    """Returns ``program.step`` compiled with the XLA options its plan was compiled with (``report``'s:
    the GPU overlap options of :mod:`shardmem.planning.overlap`, the user's, any retry's), so that the
    step that trains is the one planned."""
    lowered = program.step.lower(program.abstract_state, program.abstract_batch)
    return lowered.compile(compiler_options=dict(report.compiler_options))


def _lock_run_dir(run_dir: Path, console: Console) -> RunDirLock:
    """Process 0 takes the run directory's lock (:mod:`shardmem.run.lock` says what a stale one is); when
    another run holds it, every process raises the same ConfigError, so that all exit alike."""
    lock = RunDirLock(run_dir)
    _on_every_process(lock.acquire)
    if lock.stale:
        _say(console, f"note: took over the lock of {lock.stale}, which no longer runs")
    return lock


def _say_casts(casts: dict[str, tuple[str, str]], step: int, console: Console) -> None:
    """One line when the resumed state is cast from the checkpoint's dtypes (optimizer.mu_dtype or
    precision.params changed since it was saved): values are rounded, the run goes on otherwise."""
    if not casts:
        return
    changes = sorted({f"{saved} -> {wanted}" for saved, wanted in casts.values()})
    example = next(iter(sorted(casts)))
    _say(console, f"note: checkpoint {step} casts {len(casts)} arrays on restore ({', '.join(changes)}; "
                  f"e.g. {example}): optimizer.mu_dtype or precision.params differ from the run that saved "
                  "it")  # fmt: skip


def _remove_unfinished_saves(checkpointer: Checkpointer, console: Console) -> None:
    """Process 0, holding the run lock, deletes the temporary directories of saves a killed run never
    finished (no other run writes here); every process waits for it, then one line says what went."""
    removed = checkpointer.remove_unfinished() if jax.process_index() == 0 else []
    text = _from_process_0(", ".join(os.path.basename(path) for path in removed))
    if text:
        what = f"saves {text}" if ", " in text else f"save {text}"
        _say(console, f"note: deleted the unfinished checkpoint {what} that a stopped run left in "
                      f"{checkpointer.directory}")  # fmt: skip


def _on_every_process(check: Callable[[], object]) -> None:
    """Runs ``check`` on process 0; the ConfigError it raises there is raised on every process (all of
    them must call this together), so that all exit alike."""
    message = ""
    if jax.process_index() == 0:
        try:
            check()
        except ConfigError as error:
            message = str(error)
    message = _from_process_0(message)
    if message:
        raise ConfigError(message)


def _from_process_0(text: str) -> str:
    """Returns process 0's ``text`` on every process (all of them must call this together)."""
    if jax.process_count() == 1:
        return text
    from jax.experimental import multihost_utils

    data = np.frombuffer(text.encode(), np.uint8)
    size = int(multihost_utils.broadcast_one_to_all(np.int64(len(data))))
    buffer = np.zeros(max(size, 1), np.uint8)  # Never empty: an empty message is the common case.
    buffer[: len(data)] = data
    return np.asarray(multihost_utils.broadcast_one_to_all(buffer)).tobytes()[:size].decode()


#: Files a run writes at its top level: in a folder without a run's checkpoints, they are someone else's.
_RUN_FILES = ("config.yaml", "plan.json", "metrics.jsonl")


def _check_run_dir(run_dir: Path) -> None:
    """Fails before any work when the run directory cannot be one: a file is in its way, it (or else its
    nearest existing folder) is not writable, or it holds files of the names a run writes but no run
    (no ``checkpoints`` folder), which the run would overwrite."""
    if run_dir.is_dir() and not (run_dir / "checkpoints").is_dir():
        theirs = [name for name in _RUN_FILES if (run_dir / name).exists()]
        if theirs:
            raise ConfigError(
                f"run directory {str(run_dir)!r} holds {', '.join(theirs)} but no shardmem run (no "
                f"checkpoints folder): training would overwrite {'them' if len(theirs) > 1 else 'it'}; "
                "choose a new or empty --run-dir"
            )
    for path in (run_dir, *run_dir.parents):
        if not os.path.exists(path):  # False also where a parent cannot be searched: check that one.
            continue
        if not os.path.isdir(path):
            raise ConfigError(
                f"run directory {str(run_dir)!r}: {str(path)!r} is a file; choose another --run-dir"
            )
        if not os.access(path, os.W_OK | os.X_OK):
            what = "write to it" if path == run_dir else f"create it in {str(path)!r}"
            why = "read-only file system" if _read_only(path) else "permission denied"
            raise ConfigError(
                f"run directory {str(run_dir)!r}: cannot {what} ({why}); choose another --run-dir"
            )
        return


def _read_only(path: str | os.PathLike[str]) -> bool:
    """Whether ``path`` is on a file system mounted read-only (then no permission would help)."""
    try:
        return bool(os.statvfs(path).f_flag & os.ST_RDONLY)
    except OSError:
        return False


def _any_process(flag: bool) -> bool:
    """Returns whether ``flag`` is set on any process, so that all processes stop at the same step."""
    if jax.process_count() == 1:
        return flag
    from jax.experimental import multihost_utils

    return bool(np.any(multihost_utils.process_allgather(np.asarray(flag))))


class _StopSignals:
    """While active, the first SIGTERM or SIGINT asks the loop to stop at the next step and save; a
    second one ends the process at once (exit 128 + signal number) with a one-line note; a signal the
    process ignores (SIGINT in a background job) stays ignored. Raising
    KeyboardInterrupt instead would land in whatever runs, often Orbax's wait for the save in progress,
    which then logs an ERROR and a traceback; the last committed checkpoint is intact either way, since
    Orbax commits a step by renaming its finished temporary directory."""

    # A SIGTERM that came before the loop (while compiling, say), kept by the handler start_runtime sets.
    early: int | None = None

    def __init__(self) -> None:
        self.received: int | None = _StopSignals.early
        _StopSignals.early = None
        self._previous: dict[int, Any] = {}
        self._python_handles = sigint_to_python()

    @staticmethod
    def remember_early(signum: int, frame) -> None:
        _StopSignals.early = signum

    def __enter__(self) -> _StopSignals:
        if threading.current_thread() is threading.main_thread():
            for signum in (signal.SIGINT, signal.SIGTERM):
                if signal.getsignal(signum) is not signal.SIG_IGN:
                    self._previous[signum] = signal.signal(signum, self._handle)
            self._python_handles.__enter__()  # Not the CLI's exit at once (shardmem._interrupt).
        return self

    def _handle(self, signum: int, frame) -> None:
        if self.received is None:
            self.received = signum
            return
        name = signal.Signals(signum).name
        sys.stdout.flush()
        sys.stderr.write(f"shardmem: second {name}: stopping now, without the checkpoint in progress; "
                         "the last committed one is kept; rerun to resume\n")  # fmt: skip
        sys.stderr.flush()
        os._exit(128 + signum)

    def _restore(self) -> None:
        if self._previous:
            self._python_handles.__exit__(None, None, None)
        for signum, handler in self._previous.items():
            signal.signal(signum, handler)
        self._previous = {}

    def __exit__(self, *exc_info: object) -> None:
        self._restore()


class _NoLog:
    """The metrics log of processes other than the first: they compute, the first one writes."""

    def write(self, record: dict[str, Any]) -> None:
        pass

    def __enter__(self) -> _NoLog:
        return self

    def __exit__(self, *exc_info: object) -> None:
        pass


#: What a fine-tune's checkpoints mean only with: the base the adapters were trained on (checkpointed with
#: them and restored from there, so a changed init_from would be silently ignored), and how the adapters
#: and the frozen weights are computed. The shapes the checkpoint holds are checked when it restores;
#: these are not in them.
_RESUME_FIXED = ("init_from", "base_dtype", "freeze", "quantize", "lora")


def _check_resumed_finetune(path: Path, config: Config) -> None:
    """Raises ConfigError when a resume changes a fine-tune setting its checkpoints depend on
    (:data:`_RESUME_FIXED`), against the run directory's ``config.yaml``."""
    try:
        saved = load_config(path)
    except ConfigError:
        return  # No readable record of the last start: the restore's shape checks are what there is.
    changed = config.finetune.differences(saved.finetune, _RESUME_FIXED)
    changed = [c for c in changed if c[0] != "finetune.init_from" or not same_init_from(c[1], c[2])]
    if changed:
        name, new, old = changed[0]
        raise ConfigError(
            f"{name}={new!r}, but this run's checkpoints were trained with {name}={old!r} "
            f"({path}): resuming would mix the two; set it back, or start a new --run-dir"
        )


#: The sections whose values shape the checkpointed state.
_STATE_SECTIONS = ("model", "optimizer", "precision", "finetune")


def _flat(value: Any, prefix: str) -> dict[str, Any]:
    if not isinstance(value, dict):
        return {prefix: value}
    return {k: v for key, item in value.items() for k, v in _flat(item, f"{prefix}.{key}").items()}


def _name_the_changed_keys(path: Path, config: Config, error: ConfigError) -> None:
    """Raises a one-line ConfigError naming the keys that changed since the run directory's last start
    (its ``config.yaml``), when a checkpoint does not restore into the state ``config`` makes; returns
    when there is no readable record or nothing in :data:`_STATE_SECTIONS` differs."""
    try:
        saved = load_config(path).to_dict()
    except ConfigError:
        return
    now = config.to_dict()
    changed = []
    for section in _STATE_SECTIONS:
        old, new = _flat(saved.get(section), section), _flat(now.get(section), section)
        changed += [(key, new.get(key), old.get(key)) for key in {**old, **new}
                    if old.get(key) != new.get(key)]  # fmt: skip
    if not changed:
        return
    listed = ", ".join(f"{key}={new!r} (was {old!r})" for key, new, old in changed[:3])
    more = f" and {len(changed) - 3} more" if len(changed) > 3 else ""
    raise ConfigError(
        f"{listed}{more}: this run's checkpoints were trained with the values in {path}, and their arrays "
        "have other shapes; set them back, or start a new --run-dir"
    ) from error


def _write_config(path: Path, config: Config, console: Console) -> None:
    """Writes the resolved config, noting which sections changed since the run directory's last one."""
    text = config.to_yaml()
    if path.exists():
        try:
            before = yaml.safe_load(path.read_text()) or {}
        except yaml.YAMLError:
            before = {}
        changed = [key for key, value in config.to_dict().items() if before.get(key) != value]
        if changed:
            _say(console, f"note: {', '.join(changed)} changed since this run directory's last start")
    _write_atomically(path, text)


def start_runtime(
    config: Config,
    *,
    coordinator: str | None = None,
    num_processes: int | None = None,
    process_id: int | None = None,
    local_devices: int | None = None,
) -> None:
    """Prepares JAX for training ``config``; call it before anything touches a JAX device.

    Gives GPUs the memory the plan budgets (``XLA_PYTHON_CLIENT_MEM_FRACTION`` from
    ``memory.usable_fraction``, unless already set), then :func:`shardmem.run.distributed.start`:
    simulates ``local_devices`` CPU devices (by default as many as the mesh needs, split over the
    processes) and joins a multi-process run (flags, ``SHARDMEM_*`` variables or a detected SLURM, Open
    MPI or Kubernetes job). From here on a SIGTERM no longer ends the process: the run stops at its
    first step, saved, as it would later in training.
    """
    from shardmem.planning.targets import configure_local_memory
    from shardmem.run import distributed

    configure_local_memory(config)
    distributed.start(config.mesh.device_count(), coordinator, num_processes, process_id, local_devices)
    if threading.current_thread() is threading.main_thread():
        # A scheduler may stop the job while it still compiles (SLURM's time-limit signal, a
        # preemption): then the run stops before its first step, saved, and exits 0 like later on.
        # Set after jax.distributed, whose preemption notifier would otherwise take SIGTERM over.
        signal.signal(signal.SIGTERM, _StopSignals.remember_early)


def _say(console: Console, text: str) -> None:
    """Prints one line that log files and launcher pipes keep whole (no wrapping at the width)."""
    console.print(text, soft_wrap=True)
