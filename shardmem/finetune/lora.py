"""Low-rank adapters (LoRA, Hu et al. 2021) on frozen weight matrices, and the one way models read a
weight that may be adapted or quantized.

    value = Adapted(base_DxF, lora_a_DxR, lora_b_RxF, scale=alpha / rank)
    y_BxLxF = project("bld,df->blf", x_BxLxD, value, jnp.bfloat16)   # x W + scale (x A) B
    w_DxF = weight(value, jnp.bfloat16)                                 # W + scale A B, materialized

A weight's value is a plain array, a :class:`~shardmem.finetune.quant.Quantized` one, or an
:class:`Adapted` one whose base is either. ``project`` never forms ``A B``: the adapter's two thin
matmuls cost ``rank x (d_in + d_out)`` per token, and its backward pass needs no full-size gradient of
the frozen matrix. The reference model calls these inside its layers; a model of your own gets its
weights materialized by :meth:`shardmem.finetune.FineTune.assemble` before it is called.
"""

from __future__ import annotations

import dataclasses
import string

import jax
import jax.numpy as jnp

from shardmem.finetune.quant import Quantized


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class Adapted:
    """A frozen ``base`` (``[..., in..., out...]``) with trainable ``lora_a`` (``[..., in..., rank]``)
    and ``lora_b`` (``[..., rank, out...]``); ``...`` is any leading stack of layers."""

    base: jax.Array | Quantized
    lora_a: jax.Array
    lora_b: jax.Array
    scale: float = dataclasses.field(metadata=dict(static=True), default=1.0)
    input_dims: int = dataclasses.field(metadata=dict(static=True), default=1)

    def delta(self, dtype) -> jax.Array:
        """Returns ``scale x A B`` shaped like the base, in ``dtype``."""
        a, b = self.lora_a.astype(dtype), self.lora_b.astype(dtype)
        out_dims = b.ndim - (a.ndim - self.input_dims)  # b is [..., rank, out...].
        stack = a.ndim - 1 - self.input_dims
        letters = iter(string.ascii_letters)
        lead = "".join(next(letters) for _ in range(stack))
        ins = "".join(next(letters) for _ in range(self.input_dims))
        outs = "".join(next(letters) for _ in range(out_dims))
        rank = next(letters)
        return self.scale * jnp.einsum(f"{lead}{ins}{rank},{lead}{rank}{outs}->{lead}{ins}{outs}", a, b)


def weight(value, dtype) -> jax.Array:
    """Returns a weight's value as one array in ``dtype``: dequantized, and with its adapter added."""
    if isinstance(value, Adapted):
        return (weight(value.base, jnp.float32) + value.delta(jnp.float32)).astype(dtype)
    if isinstance(value, Quantized):
        return value.dequantize(dtype)
    return value.astype(dtype)


def project(spec: str, x: jax.Array, value, dtype) -> jax.Array:
    """Returns ``jnp.einsum(spec, x, weight(value, dtype))``; for an :class:`Adapted` value, as
    ``x W + scale (x A) B``. The weight's subscripts must list its input axes (those it shares with
    ``x``) first, as every matmul of the reference model does."""
    if not isinstance(value, Adapted):
        return jnp.einsum(spec, x, weight(value, dtype))
    inputs, out = spec.split("->")
    x_sub, w_sub = inputs.split(",")
    contracted = "".join(c for c in w_sub if c in x_sub)
    w_out = w_sub[len(contracted) :]
    if w_sub != contracted + w_out or any(c in x_sub for c in w_out):
        raise ValueError(f"project({spec!r}): the weight's input axes must come first")
    rank = next(c for c in string.ascii_letters if c not in spec)
    kept = "".join(c for c in x_sub if c not in contracted)
    xa = jnp.einsum(f"{x_sub},{contracted}{rank}->{kept}{rank}", x, value.lora_a.astype(dtype))
    adapter = jnp.einsum(f"{kept}{rank},{rank}{w_out}->{out}", xa, value.lora_b.astype(dtype))
    return jnp.einsum(spec, x, weight(value.base, dtype)) + (value.scale * adapter).astype(dtype)


def value_of(param) -> object:
    """Returns an ``nnx.Variable``'s value, whatever it holds (``param[...]`` reads arrays only)."""
    return param.get_value() if hasattr(param, "get_value") else param.value
