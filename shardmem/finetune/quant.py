"""Frozen weights stored in 8 or 4 bits, dequantized where they are used.

    packed = quantize(w_DxF, "nf4", group=64)        # Quantized(codes uint8[D, F/2], scales f32[D, F/64])
    w_DxF = packed.dequantize(jnp.bfloat16)           # inside the matmul that reads it: XLA fuses the two

Blocks of ``group`` entries along the last axis share one float32 scale, their largest magnitude (an
axis shorter than ``group`` is one block). ``int8`` rounds ``w / scale`` to 127 levels a side; ``int4``
to 7; ``nf4`` picks the nearest of QLoRA's 16 NormalFloat levels (the quantiles of a normal
distribution, Dettmers et al. 2023), which spend their codes where normally distributed weights are.
4-bit codes are packed two a byte along the last axis (entry ``2i`` in the low nibble), so the bytes a
device holds are exact in the plan: ``n/2`` (or ``n``) plus ``4 n / group`` per ``n`` weights.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np

from shardmem.errors import ConfigError

FORMATS = ("int8", "int4", "nf4")

#: QLoRA's NF4 levels (bitsandbytes' table), in code order.
NF4_LEVELS = np.array([
    -1.0, -0.6961928009986877, -0.5250730514526367, -0.39491748809814453, -0.28444138169288635,
    -0.18477343022823334, -0.09105003625154495, 0.0, 0.07958029955625534, 0.16093020141124725,
    0.24611230194568634, 0.33791524171829224, 0.44070982933044434, 0.5626170039176941, 0.7229568362236023,
    1.0,
], np.float32)  # fmt: skip
#: int4's levels: code c stands for (c - 8) / 7 of the block's largest magnitude (code 0 is unused).
INT4_LEVELS = (np.arange(16, dtype=np.float32) - 8) / 7


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class Quantized:
    """A quantized weight: ``codes`` (int8, or uint8 holding two 4-bit codes) and one float32 scale
    per block of ``group`` entries of the last axis. Any leading axes (a layer stack) slice as arrays."""

    codes: jax.Array
    scales: jax.Array
    format: str = dataclasses.field(metadata=dict(static=True), default="nf4")
    group: int = dataclasses.field(metadata=dict(static=True), default=64)

    def dequantize(self, dtype) -> jax.Array:
        """Returns the weight in ``dtype``."""
        if self.format == "int8":
            values = self.codes.astype(jnp.float32) / 127
        else:
            levels = jnp.asarray(NF4_LEVELS if self.format == "nf4" else INT4_LEVELS)
            low, high = self.codes & 0xF, self.codes >> 4
            pairs = jnp.stack([low, high], axis=-1)
            values = levels[pairs.reshape(*self.codes.shape[:-1], -1).astype(jnp.int32)]
        blocks = values.reshape(*values.shape[:-1], -1, self.group) * self.scales[..., None]
        return blocks.reshape(values.shape).astype(dtype)


def group_for(path: str, last: int, group: int, format: str, key: str = "finetune.quantize") -> int:
    """Returns the block size for a weight whose last axis has ``last`` entries: ``group``, or the whole
    axis when it is shorter; raises ConfigError naming ``path`` (and the config section ``key``) when
    ``group`` does not divide it."""
    size = min(group, last)
    if last % size or (format != "int8" and size % 2):
        fits = [g for g in range(2, min(last, 4 * group) + 1, 2) if last % g == 0]
        raise ConfigError(
            f"{key}.group={group} does not divide the last axis of {path} ({last} entries) "
            f"into blocks{' of an even size' if format != 'int8' else ''}; use one of {fits[-6:] or [last]}, "
            f"or leave it out of {key}.targets"
        )
    return size


def quantize(w: jax.Array, format: str, group: int) -> Quantized:
    """Returns ``w`` quantized in blocks of ``group`` along its last axis (``group`` must divide it)."""
    w32 = w.astype(jnp.float32)
    blocks = w32.reshape(*w.shape[:-1], -1, group)
    scales = jnp.max(jnp.abs(blocks), axis=-1)
    safe = jnp.where(scales == 0, 1.0, scales)[..., None]
    normed = (blocks / safe).reshape(w.shape)
    if format == "int8":
        return Quantized(jnp.round(normed * 127).astype(jnp.int8), scales, format, group)
    levels = jnp.asarray(NF4_LEVELS if format == "nf4" else INT4_LEVELS)
    codes = jnp.argmin(jnp.abs(normed[..., None] - levels), axis=-1).astype(jnp.uint8)
    pairs = codes.reshape(*w.shape[:-1], -1, 2)
    return Quantized(pairs[..., 0] | (pairs[..., 1] << 4), scales, format, group)
