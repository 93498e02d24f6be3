"""What one training step consumes: a pytree of arrays, each with logical axis names.

    batch = parse_batch({"images": {"shape": ["global_batch", 224, 224, 3], "dtype": "float32",
                                    "axes": ["batch", None, None, None]},
                         "labels": {"shape": ["global_batch"], "dtype": "int32", "axes": ["batch"]}},
                        global_batch=256)
    batch["images"].shape   # (256, 224, 224, 3)

The config's ``data.batch`` is this mapping in YAML; from Python, pass the same mapping, or
:class:`BatchLeaf` values, as ``batch=`` to :func:`shardmem.build_program`, :func:`shardmem.plan` and
:func:`shardmem.train`. Logical axes go through the config's rules like a parameter's (``batch`` splits
over the data-parallel mesh axes); a leaf without ``axes`` is split along its first dimension.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from typing import TYPE_CHECKING, Any

import jax
import numpy as np

from shardmem.errors import ConfigError
from shardmem.models.llama import ModelConfig

if TYPE_CHECKING:
    from shardmem.config import Config


@dataclasses.dataclass(frozen=True)
class BatchLeaf:
    """One array of the batch: its global shape, dtype and one logical axis name (or None) per dimension."""

    shape: tuple[int, ...]
    dtype: str = "float32"
    axes: tuple[str | None, ...] | None = None

    def logical_axes(self) -> tuple[str | None, ...]:
        """The axes, defaulting to ``("batch", None, ...)``."""
        if self.axes is None:
            return ("batch",) + (None,) * (len(self.shape) - 1)
        return tuple(self.axes)

    def abstract(self, sharding=None) -> jax.ShapeDtypeStruct:
        return jax.ShapeDtypeStruct(self.shape, np.dtype(self.dtype) if self.dtype != "bfloat16"
                                    else jax.numpy.bfloat16, sharding=sharding)  # fmt: skip


def parse_batch(batch: Mapping[str, Any] | BatchLeaf, *, global_batch: int, key: str = "data.batch"):
    """Returns the pytree of :class:`BatchLeaf` that ``batch`` declares (``global_batch`` fills in the
    size of that name)."""
    if isinstance(batch, BatchLeaf):
        return batch
    if isinstance(batch, jax.ShapeDtypeStruct):
        return BatchLeaf(tuple(batch.shape), str(batch.dtype))
    if not isinstance(batch, Mapping) or not batch:
        raise ConfigError(f"{key}={batch!r}: give a mapping of names to {{shape, dtype, axes}}")
    if "shape" in batch and not isinstance(batch["shape"], Mapping):
        shape = tuple(global_batch if size == "global_batch" else size for size in batch["shape"])
        axes = batch.get("axes")
        if axes is not None and len(axes) != len(shape):
            raise ConfigError(
                f"{key}.axes={list(axes)}: give one logical name per dimension of {list(shape)}"
            )
        return BatchLeaf(shape, str(batch.get("dtype", "float32")), None if axes is None else tuple(axes))
    return {str(name): parse_batch(leaf, global_batch=global_batch, key=f"{key}.{name}")
            for name, leaf in batch.items()}  # fmt: skip


def is_leaf(x) -> bool:
    return isinstance(x, BatchLeaf)


def token_batch(global_batch: int, seq_len: int) -> BatchLeaf:
    """The reference model's batch: ``[global_batch, seq_len + 1]`` int32 tokens (inputs and targets)."""
    return BatchLeaf((global_batch, seq_len + 1), "int32", ("batch", None))


def declared_batch(config: Config, batch: Any, batch_shape: tuple[int, ...] | None):
    """Returns the batch's :class:`BatchLeaf` tree and whether it is the token batch: ``batch`` (or
    ``data.batch``) as declared, else the reference model's tokens (``batch_shape``, or
    :func:`token_batch` for ``train.global_batch`` and ``model.seq_len``)."""
    global_batch = config.train.global_batch
    declared = batch if batch is not None else config.data.batch
    if declared is not None:
        key = "batch" if batch is not None else "data.batch"
        return parse_batch(declared, global_batch=global_batch, key=key), False
    if batch_shape is not None:
        return BatchLeaf(tuple(batch_shape), "int32", ("batch",) + (None,) * (len(batch_shape) - 1)), True
    if not isinstance(config.model, ModelConfig):
        raise ConfigError(
            "data.batch is not set: a model of your own needs its batch declared, e.g. data: {batch: "
            "{images: {shape: [global_batch, 224, 224, 3], dtype: float32, axes: [batch, null, null, null]}}}"
        )
    return token_batch(global_batch, config.model.seq_len), True
