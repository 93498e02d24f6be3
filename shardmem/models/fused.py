"""Fused projections: a layer's query, key and value weights as one matrix, its gate and up weights as
another, so that a decode step runs one matmul for each group where it ran three and two.

    layer = fuse_layer(layer, abstract, shardings)   # a layer's weights (or ShapeDtypeStructs, shardings)
    q_BxLxHxK, k_BxLxGxK, v_BxLxGxK = layer["wqkv"].project(h_BxLxD, dtype)
    layer = unfuse_layer(layer)                 # the parts again: wq, wk, wv, w_gate, w_up

Serving stores its weights so (:mod:`shardmem.program.serving`); vLLM's ``QKVParallelLinear`` and
``MergedColumnParallelLinear`` do the same. Fused per call instead (XLA's dot merger), the weights would
be concatenated, a copy of them, at every step. The layout is tensor-parallel-aware: a part's output axis
is split into the ``shards`` its sharding splits it into, and the parts are concatenated within each
shard (``[inputs, shards, sum of the parts' widths per shard, *trailing]``), so that each device holds
its own columns of every part, contiguous, and the matmul needs no collective the parts did not.
"""

from __future__ import annotations

import dataclasses
import math

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from shardmem.finetune.lora import weight

#: The groups fused: each one's name and its parts, in order (the reference model's parameter names).
GROUPS = {"wqkv": ("wq", "wk", "wv"), "w_gate_up": ("w_gate", "w_up")}


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class Fused:
    """One fused matrix: ``weight`` ``[inputs, shards, sum(widths), *trailing]`` (an array, its
    ``ShapeDtypeStruct`` or its ``NamedSharding``), holding ``parts`` of ``widths`` per shard each."""

    weight: object
    parts: tuple[str, ...] = dataclasses.field(metadata=dict(static=True))
    widths: tuple[int, ...] = dataclasses.field(metadata=dict(static=True))

    def project(self, x_BxLxD, dtype) -> tuple[jax.Array, ...]:
        """Returns each part's projection of ``x`` (``x @ part``, in ``dtype``), from one matmul."""
        y = jnp.tensordot(x_BxLxD, weight(self.weight, dtype), axes=1)  # [B, L, shards, widths, ...]
        lead, shards = y.shape[: x_BxLxD.ndim - 1], y.shape[x_BxLxD.ndim - 1]
        pieces = jnp.split(y, np.cumsum(self.widths)[:-1], axis=x_BxLxD.ndim)
        return tuple(p.reshape(*lead, shards * w, *p.shape[x_BxLxD.ndim + 1 :])
                     for p, w in zip(pieces, self.widths, strict=True))  # fmt: skip

    def part_shapes(self) -> dict[str, jax.ShapeDtypeStruct]:
        """Returns each part's shape and dtype, ``[inputs, outputs, *trailing]``, by name."""
        inputs, shards, _, *trailing = self.weight.shape
        return {name: jax.ShapeDtypeStruct((inputs, shards * width, *trailing), self.weight.dtype)
                for name, width in zip(self.parts, self.widths, strict=True)}  # fmt: skip

    def unfused(self) -> dict:
        """Returns the parts: ``{name: array or ShapeDtypeStruct}`` of ``[inputs, outputs, *trailing]``."""
        w = self.weight
        if isinstance(w, jax.ShapeDtypeStruct):
            return self.part_shapes()
        inputs, shards, _, *trailing = w.shape
        pieces = jnp.split(w, np.cumsum(self.widths)[:-1], axis=2)
        return {name: p.reshape(inputs, shards * width, *trailing)
                for name, p, width in zip(self.parts, pieces, self.widths, strict=True)}  # fmt: skip


def fuse_layer(layer: dict, abstract: dict, shardings: dict) -> dict:
    """Returns one layer's weights ``layer`` (arrays, ``ShapeDtypeStruct`` or ``NamedSharding``) with each
    group of :data:`GROUPS` fused into a :class:`Fused`, laid out for the layer's ``shardings`` (the
    parts' shapes are ``abstract``'s). A group stays apart where a part is quantized or adapted (not a
    plain matrix) or its parts' axes are not split alike."""
    out = dict(layer)
    for name, parts in GROUPS.items():
        if not all(p in layer and _plain(layer[p]) and _plain(abstract[p]) for p in parts):
            continue
        specs = {_spec(shardings[p], len(abstract[p].shape)) for p in parts}
        if len(specs) != 1 or not isinstance(shardings[parts[0]], NamedSharding):
            continue
        spec = specs.pop()
        split = spec[1] if isinstance(spec[1], tuple) else (spec[1],)
        shards = math.prod(shardings[parts[0]].mesh.shape[a] for a in split if a is not None)
        if any(abstract[p].shape[1] % shards for p in parts):
            continue
        for p in parts:
            del out[p]
        widths = tuple(abstract[p].shape[1] // shards for p in parts)
        out[name] = Fused(_fused([layer[p] for p in parts], shards, (spec[0], spec[1], None, *spec[2:])),
                          parts, widths)  # fmt: skip
    return out


def unfuse_layer(layer: dict) -> dict:
    """Returns one layer's weights with each :class:`Fused` group split into its parts again."""
    out = {k: v for k, v in layer.items() if not isinstance(v, Fused)}
    for v in layer.values():
        if isinstance(v, Fused):
            out.update(v.unfused())
    return out


def _fused(parts: list, shards: int, spec: tuple):
    """The parts' fused matrix (see the module docstring), its ShapeDtypeStruct or its sharding."""
    first = parts[0]
    if isinstance(first, NamedSharding):
        return NamedSharding(first.mesh, P(*spec), memory_kind=first.memory_kind)
    per_shard = [(p.shape[0], shards, p.shape[1] // shards, *p.shape[2:]) for p in parts]
    if isinstance(first, jax.ShapeDtypeStruct):
        width = sum(s[2] for s in per_shard)
        return jax.ShapeDtypeStruct((first.shape[0], shards, width, *first.shape[2:]), first.dtype)
    return jnp.concatenate([p.reshape(s) for p, s in zip(parts, per_shard, strict=True)], axis=2)


def _plain(leaf) -> bool:
    return isinstance(leaf, jax.Array | np.ndarray | jax.ShapeDtypeStruct | NamedSharding)


def _spec(sharding, ndim: int) -> tuple:
    """A sharding's partition spec, one entry per axis (None: not split)."""
    spec = tuple(sharding.spec) if isinstance(sharding, NamedSharding) else ()
    return spec + (None,) * (ndim - len(spec))
