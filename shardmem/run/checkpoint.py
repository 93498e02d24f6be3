"""Sharded, asynchronous training checkpoints on Orbax.

A thin layer over ``orbax.checkpoint.CheckpointManager``: every process writes its own shards,
saves run in the background, and a restore reads straight onto the shardings you ask for, which
may belong to a different mesh than the one that saved::

    with Checkpointer("runs/a/ckpt", every=100, keep=3) as checkpointer:
        if (step := checkpointer.latest_step()) is not None:
            state = checkpointer.restore(abstract_state)  # ShapeDtypeStructs with .sharding
        ...
        checkpointer.save(step, state)  # returns at once; writes in the background
        checkpointer.save(step, state, force=True)  # at the end or on SIGTERM

Orbax writes each step to a temporary directory and renames it only once every process has
finished, so an interrupted save leaves the last good checkpoint untouched and invisible.
"""

from __future__ import annotations

import os
from collections.abc import Iterator
from types import TracebackType
from typing import Any, Self

import jax
import orbax.checkpoint as ocp

from shardmem.errors import ConfigError
from shardmem.parallel.rules import path_str

__all__ = ["Checkpointer"]

PyTree = Any


class Checkpointer:
    """Saves and restores a training-state pytree under ``directory/<step>/``.

    Args:
      directory: where checkpoints live; created if missing. Must be shared by all processes.
      every: save only steps divisible by ``every`` unless ``force=True``.
      keep: how many of the newest checkpoints to keep; older ones are deleted.
    """

    def __init__(self, directory: str | os.PathLike[str], *, every: int, keep: int) -> None:
        for name, key, value in (("every", "train.checkpoint_every", every),
                                 ("keep", "train.keep_checkpoints", keep)):  # fmt: skip
            if not isinstance(value, int) or isinstance(value, bool) or value < 1:
                raise ConfigError(f"`{name}={value!r}` ({key}) must be a positive integer.")
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
        return bool(self._manager.save(step, args=ocp.args.StandardSave(state), force=force))

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
        """Blocks until every background save has been committed."""
        self._manager.wait_until_finished()

    def close(self) -> None:
        """Waits for background saves and releases Orbax's threads."""
        self._manager.close()

    def __enter__(self) -> Self:
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        traceback: TracebackType | None,
    ) -> None:
        self.close()

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
            listed = "\n  ".join(sorted(problems)[:10])
            more = f"\n  ... and {len(problems) - 10} more" if len(problems) > 10 else ""
            raise ConfigError(
                f"The checkpoint at step {step} in {self.directory!r} does not match the "
                f"state being restored:\n  {listed}{more}\nRestore with the model and optimizer "
                "config the run was saved with, or train in a new --run-dir."
            )


def _shapes_by_path(tree: PyTree) -> Iterator[tuple[str, tuple[int, ...]]]:
    """Yields ("a/b/0/mu", shape) per leaf; dict keys, attributes and indices read alike.

    Orbax stores namedtuple fields as dict keys, so paths are compared by name alone.
    """
    for path, leaf in jax.tree_util.tree_flatten_with_path(tree)[0]:
        yield path_str(path), tuple(getattr(leaf, "shape", ()))
