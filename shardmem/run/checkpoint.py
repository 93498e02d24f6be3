"""Sharded, asynchronous training checkpoints on Orbax.

A thin layer over ``orbax.checkpoint.CheckpointManager``: every process writes its own shards,
saves run in the background, and a restore reads straight onto the shardings you ask for, which
may belong to a different mesh than the one that saved::

    with Checkpointer("runs/a/ckpt", every=100, keep=3) as checkpointer:
        step, state, moved = checkpointer.restore_newest(abstract_state)  # ShapeDtypeStructs with .sharding
        ...
        checkpointer.save(step, state)  # returns at once; writes in the background
        checkpointer.check_for_errors()  # raises CheckpointError once a background save failed
        checkpointer.save(step, state, force=True)  # at the end or on SIGTERM

Orbax writes each step to a temporary directory and renames it only once every process has
finished, so an interrupted save leaves the last good checkpoint untouched and invisible. A
checkpoint that was committed but no longer restores (a truncated or garbled file, a deleted
``_METADATA``) is renamed to ``<step>.corrupt-<time>`` by :meth:`Checkpointer.restore_newest`,
never deleted, and the next older one is tried.
"""

from __future__ import annotations

import dataclasses
import logging
import os
import re
import shutil
import sys
import time
from collections.abc import Iterator
from types import TracebackType
from typing import Any, Self

import jax
import orbax.checkpoint as ocp

from shardmem.errors import ConfigError, ShardmemError
from shardmem.parallel.rules import path_str

__all__ = ["CheckpointError", "Checkpointer", "MovedAside"]

PyTree = Any
_UNFINISHED = re.compile(r"^\d+\.orbax-checkpoint-tmp")  # Orbax's suffix (atomicity_types.TMP_DIR_SUFFIX).


class CheckpointError(ShardmemError):
    """A checkpoint could not be written (disk full, permissions, a vanished file system); the
    checkpoints committed before it are intact."""


@dataclasses.dataclass(frozen=True)
class MovedAside:
    """A committed checkpoint that did not restore, and where it was moved: ``step`` was renamed to
    ``path`` because of ``reason`` (the first line of the error)."""

    step: int
    path: str
    reason: str


class Checkpointer:
    """Saves and restores a training-state pytree under ``directory/<step>/``.

    Args:
      directory: where checkpoints live; created if missing. Must be shared by all processes.
      every: save only steps divisible by ``every`` unless ``force=True``.
      keep: how many of the newest checkpoints to keep; older ones are deleted.
    """

    #: What the error says when a checkpoint's arrays are not the state's (another model or optimizer).
    MISMATCH = "does not match the state being restored"

    def __init__(self, directory: str | os.PathLike[str], *, every: int, keep: int) -> None:
        for name, key, value in (("every", "train.checkpoint_every", every),
                                 ("keep", "train.keep_checkpoints", keep)):  # fmt: skip
            if not isinstance(value, int) or isinstance(value, bool) or value < 1:
                raise ConfigError(f"{key}={value!r} (the checkpointer's {name}) must be a positive integer; "
                                  f"use e.g. {key}=1")  # fmt: skip
        self.directory = os.path.abspath(os.fspath(directory))
        if os.path.exists(self.directory) and not os.path.isdir(self.directory):
            raise ConfigError(
                f"the checkpoint directory {self.directory!r} is a file; move it away, or choose another "
                "--run-dir (checkpoints go to <run dir>/checkpoints)."
            )
        self.every = every
        self.keep = keep
        options = ocp.CheckpointManagerOptions(
            max_to_keep=keep, save_interval_steps=every, enable_async_checkpointing=True
        )
        _QuietFailures.install()
        # Naming the handler lets `item_metadata` read shapes back without restoring.
        self._manager = ocp.CheckpointManager(
            self.directory, options=options, item_handlers=ocp.StandardCheckpointHandler()
        )

    def latest_step(self) -> int | None:
        """Returns the newest saved step, or None when the directory holds no checkpoint."""
        return self._manager.latest_step()

    def all_steps(self) -> list[int]:
        """Returns the saved steps, oldest first."""
        return sorted(self._manager.all_steps())

    def save(self, step: int, state: PyTree, *, force: bool = False) -> bool:
        """Starts saving ``state`` as ``step`` in the background; returns whether it saves.

        Without ``force`` only steps divisible by ``every`` are saved. A step that is already
        saved (say, a forced save right after resuming) is skipped and returns False.
        """
        if step in self._manager.all_steps():
            return False
        try:
            return bool(self._manager.save(step, args=ocp.args.StandardSave(state), force=force))
        except Exception as error:  # Orbax first raises the failure of the previous background save.
            raise self._write_error(error) from None

    def check_for_errors(self) -> None:
        """Raises :class:`CheckpointError` when a background save has failed; cheap, call it often."""
        try:
            self._manager.check_for_errors()
        except Exception as error:
            raise self._write_error(error) from None

    def _write_error(self, error: BaseException) -> CheckpointError:
        latest = committed_steps(self.directory)
        kept = f"the last good checkpoint is step {latest[-1]}" if latest else "no checkpoint was committed"
        text = _first_line(error, limit=10_000)
        # TensorStore puts the OS error last, after a long temporary path: say it first.
        code = re.search(r"os_error_code='?(\d+)", text)
        reason = os.strerror(int(code.group(1))) if code else _first_line(error)
        return CheckpointError(
            f"writing a checkpoint to {self.directory!r} failed: {reason}; stopped at once, "
            f"{kept}. Free space or fix the file system (or pick a --run-dir elsewhere), then rerun to resume"
        )

    def remove_unfinished(self) -> list[str]:
        """Deletes the temporary directories of saves that never finished (``<step>.orbax-checkpoint-tmp*``:
        a run killed mid-save leaves one, as large as a checkpoint, that nothing reads or removes) and
        returns their paths. Call it only while holding the run directory's lock
        (:class:`~shardmem.run.lock.RunDirLock`), from one process: another run's save in progress
        looks the same."""
        removed = []
        for name in sorted(os.listdir(self.directory)) if os.path.isdir(self.directory) else []:
            path = os.path.join(self.directory, name)
            if _UNFINISHED.match(name) and os.path.isdir(path):
                shutil.rmtree(path)
                removed.append(path)
        return removed

    def restore_newest(self, abstract_state: PyTree) -> tuple[int | None, PyTree, list[MovedAside]]:
        """Returns ``(step, state, moved)`` for the newest checkpoint that restores, or ``(None, None,
        moved)`` when none does.

        A checkpoint that fails to read is renamed to ``<step>.corrupt-<YYYYmmdd-HHMMSS>`` next to the
        others (kept for inspection, never deleted) and listed in ``moved``; then the next older one is
        tried. A checkpoint that reads but does not match ``abstract_state`` (another model or
        optimizer) is the config's problem, not the checkpoint's: that raises ConfigError and moves
        nothing. With several processes, all of them take each decision together: a checkpoint that
        fails on any process is moved aside (by process 0) for all.
        """
        self.wait()
        moved: list[MovedAside] = []
        for step in reversed(self.all_steps()):
            reason = ""
            try:
                state = self.restore(abstract_state, step)
            except ConfigError:
                raise
            except Exception as error:
                reason, state = _first_line(error), None
            failed = _any_process(bool(reason))
            if not failed:
                return step, state, moved
            moved.append(MovedAside(step, self._move_aside(step), reason or "failed on another process"))
        return None, None, moved

    def _move_aside(self, step: int) -> str:
        source = os.path.join(self.directory, str(step))
        target = f"{source}.corrupt-{time.strftime('%Y%m%d-%H%M%S')}"
        if jax.process_index() == 0:
            suffix = 1
            while os.path.exists(target):  # Two corrupt copies of one step within a second.
                target, suffix = f"{source}.corrupt-{time.strftime('%Y%m%d-%H%M%S')}-{suffix}", suffix + 1
            os.rename(source, target)
        _barrier(f"shardmem-moved-aside-{step}")
        self._manager.reload()
        return target

    def restore(self, abstract_state: PyTree, step: int | None = None) -> PyTree:
        """Returns the state saved at ``step`` (default: the newest), laid out as asked.

        ``abstract_state`` is a pytree of ``jax.ShapeDtypeStruct`` with ``.sharding`` set, of
        the same structure as the saved state (for instance ``jax.eval_shape`` of the init
        function with shardings attached). Arrays are read directly onto those shardings, so
        a checkpoint saved on 8 devices restores onto 4, or with a different PartitionSpec.
        Dtypes may differ from the saved ones; values are cast.
        """
        self.wait()
        steps = self.all_steps()
        if step is None:
            if not steps:
                raise ConfigError(
                    f"{self.directory!r} holds no checkpoint to restore; check latest_step() first, "
                    "or point --run-dir at a previous run."
                )
            step = steps[-1]
        elif step not in steps:
            raise ConfigError(
                f"`step={step}` has no checkpoint in {self.directory!r}; saved steps are {steps or 'none'}."
            )
        self._check_matches(abstract_state, step)
        return self._manager.restore(step, args=ocp.args.StandardRestore(abstract_state))

    def wait(self) -> None:
        """Blocks until every background save has been committed; raises CheckpointError if one failed."""
        try:
            self._manager.wait_until_finished()
        except Exception as error:
            raise self._write_error(error) from None

    def close(self) -> None:
        """Waits for background saves and releases Orbax's threads; raises CheckpointError if a save
        failed."""
        try:
            self._manager.close()
        except Exception as error:
            raise self._write_error(error) from None

    def __enter__(self) -> Self:
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        traceback: TracebackType | None,
    ) -> None:
        self.close()

    def casts(self, abstract_state: PyTree, step: int) -> dict[str, tuple[str, str]]:
        """Returns ``{path: (saved dtype, restored dtype)}`` for the leaves that :meth:`restore` of
        ``step`` casts (say, after ``optimizer.mu_dtype`` changed); empty when none does, or when the
        checkpoint has no metadata to tell."""
        metadata = self._manager.item_metadata(step)
        saved_tree = getattr(metadata, "tree", metadata)
        if saved_tree is None:
            return {}
        saved = dict(_dtypes_by_path(saved_tree))
        return {
            path: (saved[path], dtype)
            for path, dtype in _dtypes_by_path(abstract_state)
            if saved.get(path) not in (None, dtype)
        }

    def _check_matches(self, abstract_state: PyTree, step: int) -> None:
        """Raises ConfigError when the saved tree's keys or shapes differ from the target's."""
        metadata = self._manager.item_metadata(step)
        saved_tree = getattr(metadata, "tree", metadata)
        if saved_tree is None:
            return  # No metadata (an older Orbax layout): let Orbax report any mismatch.
        saved = dict(_shapes_by_path(saved_tree))
        wanted = dict(_shapes_by_path(abstract_state))
        problems = [f"missing from checkpoint: {path}" for path in wanted.keys() - saved.keys()]
        problems += [f"not in the state: {path}" for path in saved.keys() - wanted.keys()]
        problems += [
            f"{path}: checkpoint {saved[path]}, state {shape}"
            for path, shape in wanted.items()
            if path in saved and saved[path] != shape
        ]
        if problems:
            listed = "; ".join(sorted(problems)[:3])
            more = f"; and {len(problems) - 3} more" if len(problems) > 3 else ""
            raise ConfigError(
                f"the checkpoint at step {step} in {self.directory!r} {self.MISMATCH}: {listed}{more}; "
                "restore with the model and optimizer config the run was saved with, or train in a new "
                "--run-dir"
            )


def committed_steps(directory: str | os.PathLike[str]) -> list[int]:
    """The steps whose directories Orbax finished in ``directory``, oldest first, read from the disk
    (no Orbax state involved): a run's checkpoints folder, before its :class:`Checkpointer` opens."""
    try:
        names = os.listdir(directory)
    except OSError:
        return []
    return sorted(int(name) for name in names if name.isdigit())


def _first_line(error: BaseException, limit: int = 200) -> str:
    """The gist of an Orbax/TensorStore error, whose messages run to pages: the first line of its
    root cause (the TensorStore status, say ``OUT_OF_RANGE: ...``), cut to ``limit`` characters."""
    while error.__cause__ is not None:
        error = error.__cause__
    text = str(error).strip()
    text = text.splitlines()[0] if text else type(error).__name__
    return text if len(text) <= limit else text[: limit - 3] + "..."


class _QuietFailures(logging.Filter):
    """Drops the echoes of a failed restore or save that the error raised already says: asyncio's "Task
    exception was never retrieved" for the sibling reads (and "_GatheringFuture exception ...", with a
    page of TensorStore traceback, for a gather of them that failed after the restore had given up),
    Orbax's warning about unreadable metadata and its ERROR log (with traceback) of a failed background
    save, and the "Event loop is closed" that TensorStore's late callbacks raise once Orbax's loop is
    gone (printed as unraisable exceptions)."""

    installed = False

    @classmethod
    def install(cls) -> None:
        if cls.installed:
            return
        cls.installed = True
        for name in ("asyncio", "absl"):
            logging.getLogger(name).addFilter(cls())
        previous = sys.unraisablehook

        def hook(unraisable) -> None:
            error = unraisable.exc_value
            if isinstance(error, RuntimeError) and str(error) == "Event loop is closed":
                return
            if "Encountered error while reading" in str(error):
                return
            previous(unraisable)

        sys.unraisablehook = hook

    def filter(self, record: logging.LogRecord) -> bool:
        text = record.getMessage()
        never_retrieved = re.match(r"\w+ exception was never retrieved", text)  # Task, _GatheringFuture, ...
        if never_retrieved or "but could not be restored" in text:
            return False  # The second: item_metadata of a checkpoint whose _METADATA is gone.
        # A failed background save, logged (by several of Orbax's threads) with its traceback: the
        # Checkpointer raises it as a CheckpointError with the gist, so the log would only bury that.
        from_orbax = "orbax" in record.pathname.replace(os.sep, "/")
        failure = record.exc_info is not None or any(word in text.lower() for word in ("fail", "exception"))
        return not (from_orbax and record.levelno >= logging.ERROR and failure)


def _any_process(flag: bool) -> bool:
    """Whether ``flag`` is set on any process (all of them must call this together)."""
    if jax.process_count() == 1:
        return flag
    import numpy as np
    from jax.experimental import multihost_utils

    return bool(np.any(multihost_utils.process_allgather(np.asarray(flag))))


def _barrier(name: str) -> None:
    if jax.process_count() > 1:
        from jax.experimental import multihost_utils

        multihost_utils.sync_global_devices(name)


def _shapes_by_path(tree: PyTree) -> Iterator[tuple[str, tuple[int, ...]]]:
    """Yields ("a/b/0/mu", shape) per leaf; dict keys, attributes and indices read alike.

    Orbax stores namedtuple fields as dict keys, so paths are compared by name alone.
    """
    for path, leaf in jax.tree_util.tree_flatten_with_path(tree)[0]:
        yield path_str(path), tuple(getattr(leaf, "shape", ()))


def _dtypes_by_path(tree: PyTree) -> Iterator[tuple[str, str]]:
    """Yields ("a/b/0/mu", "bfloat16") per leaf that has a dtype, named as :func:`_shapes_by_path` does."""
    for path, leaf in jax.tree_util.tree_flatten_with_path(tree)[0]:
        if getattr(leaf, "dtype", None) is not None:
            yield path_str(path), str(jax.numpy.dtype(leaf.dtype))
