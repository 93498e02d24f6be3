"""Rotary position embeddings, and the context-extending scalings pretrained checkpoints use.

    scaling = RopeScaling("llama3", factor=32.0, low_freq_factor=1.0, high_freq_factor=4.0,
                          original_max_position_embeddings=8192)     # model.rope_scaling, Llama 3.2
    q_BxLxHxK = rope(q_BxLxHxK, positions_L, theta=500000.0, scaling=scaling)

A :class:`RopeScaling` is ``model.rope_scaling`` parsed once; :func:`frequencies` is its one lowering:
the inverse frequencies of a head's dimension pairs, and the factor that multiplies cos and sin, as
Hugging Face ``transformers`` computes them (``modeling_rope_utils``: ``default``, ``linear``,
``dynamic``, ``yarn`` and ``llama3``), in float32 as it does. The keys are the ones a checkpoint's
``config.json`` writes under ``rope_scaling`` (``rope_type`` for its older ``type``), so the value can be
copied from there; ``max_position_embeddings`` is ``config.json``'s top-level one, which ``dynamic`` and
``yarn`` read.

``dynamic`` is the one scaling whose frequencies depend on the sequence: transformers' rotary module
(``dynamic_rope_update`` in ``modeling_rope_utils``, its inner ``dynamic_frequency_update``) recomputes
them at each forward from ``seq_len = max(position_ids) + 1`` over the whole batch, with
``max(seq_len, max_position_embeddings)`` in ``_compute_dynamic_ntk_parameters``'s formula, in float32.
shardmem gives each forward the same ``length``: a training forward its sequence length (the positions
are ``0 .. L-1``); a prefill its longest prompt (padding has no position; transformers' ``generate``
gives a left-padded batch the same positions as shardmem's right-padded one); a decode step the largest
position over the batch, plus one. A KV cache keeps each key as it was rotated, so in ``generate`` the
prompts' keys keep the prefill's frequencies and each decoded token has those of its own step -- as
transformers' cache does. transformers' module also keeps state between forwards: after a forward longer
than ``max_position_embeddings`` it keeps those frequencies for a shorter one until a forward shorter
than ``max_position_embeddings`` resets them. shardmem has no such state: its results are those of a
model as loaded (each ``generate`` a fresh model's), never the stale frequencies of an earlier, longer
call.
"""

from __future__ import annotations

import dataclasses
import math

import jax
import jax.numpy as jnp
import numpy as np

from shardmem.errors import ConfigError, did_you_mean, one_of

#: What each ``rope_type`` does, and which keys it needs besides ``factor``.
ROPE_TYPES = {
    "linear": ("every frequency divided by factor (position interpolation)", ()),
    "dynamic": ("NTK-aware: the base grows with a sequence longer than max_position_embeddings "
                "(each forward's longest position + 1, as transformers' forward; see the module docstring)",
                ("max_position_embeddings",)),
    "yarn": ("YaRN: low frequencies interpolated, high ones kept, a ramp between, cos and sin scaled by "
             "attention_factor (Qwen2's long context)", ()),
    "llama3": ("Llama 3.1/3.2: low frequencies divided by factor, high ones kept, smoothed between",
               ("low_freq_factor", "high_freq_factor", "original_max_position_embeddings")),
}  # fmt: skip


@dataclasses.dataclass(frozen=True)
class RopeScaling:
    """``model.rope_scaling``: a checkpoint's RoPE scaling (the ``rope_scaling`` of its ``config.json``)."""

    rope_type: str  # linear, dynamic, yarn or llama3 (config.json's rope_type, or its older type).
    factor: float = 1.0  # How much longer a context the scaling stretches the positions over.
    low_freq_factor: float | None = None  # llama3: wavelengths over original / this are divided by factor.
    high_freq_factor: float | None = None  # llama3: wavelengths under original / this are kept.
    original_max_position_embeddings: int | None = None  # The pretraining context (llama3, yarn).
    max_position_embeddings: int | None = (
        None  # config.json's top-level one (dynamic; yarn without the above).
    )
    beta_fast: float | None = None  # yarn: rotations where extrapolation ends (None: 32).
    beta_slow: float | None = None  # yarn: rotations where interpolation starts (None: 1).
    attention_factor: float | None = None  # yarn: multiplies cos and sin (None: 0.1 ln(factor) + 1).
    truncate: bool = True  # yarn: round the ramp's ends to whole dimensions, as transformers does.

    def validate(self) -> None:
        """Raises ConfigError naming the ``model.rope_scaling`` key that is missing or impossible."""
        key = "model.rope_scaling"
        if self.rope_type not in ROPE_TYPES:
            raise ConfigError(
                f"{key}.rope_type={self.rope_type!r}{did_you_mean(self.rope_type, ROPE_TYPES)}: shardmem "
                f"computes {one_of(ROPE_TYPES)} (null: no scaling); a checkpoint with another is not "
                "supported"
            )
        if not self.factor >= 1:
            raise ConfigError(f"{key}.factor={self.factor}: a scaling stretches positions; use 1 or more")
        for name in ROPE_TYPES[self.rope_type][1]:
            if getattr(self, name) is None:
                raise ConfigError(f"{key}.{name} is required for rope_type {self.rope_type}: copy it from "
                                  "the "
                                  "checkpoint's config.json")  # fmt: skip
        if self.rope_type == "yarn" and not (
            self.original_max_position_embeddings or self.max_position_embeddings
        ):
            raise ConfigError(f"{key}: yarn needs original_max_position_embeddings (or "
                              "max_position_embeddings): "
                              "copy it from the checkpoint's config.json")  # fmt: skip
        if self.rope_type == "llama3" and not self.high_freq_factor > self.low_freq_factor:
            raise ConfigError(f"{key}.high_freq_factor={self.high_freq_factor} must exceed low_freq_factor="
                              f"{self.low_freq_factor}")  # fmt: skip

    @property
    def per_forward(self) -> bool:
        """Whether the frequencies depend on each forward's longest position (``dynamic``)."""
        return self.rope_type == "dynamic"

    def describe(self) -> str:
        """Returns e.g. ``llama3 x32``."""
        return f"{self.rope_type} x{self.factor:g}"


def frequencies(head_dim: int, theta: float, scaling: RopeScaling | None, length) -> tuple[np.ndarray, float]:
    """Returns the float32 inverse frequencies ``[head_dim / 2]`` and the factor on cos and sin for a
    forward whose longest position is ``length - 1`` (``dynamic`` alone depends on it; ``length`` may
    be a traced scalar, and the frequencies are then a ``jax.Array``)."""
    dim = np.float32(head_dim)
    exponents = np.arange(0, head_dim, 2, dtype=np.int64).astype(np.float32) / dim

    def default(base: float) -> np.ndarray:
        return (np.float32(1.0) / (np.float32(base) ** exponents)).astype(np.float32)

    if scaling is None:
        return default(theta), 1.0
    kind, factor = scaling.rope_type, scaling.factor
    if kind == "linear":
        return (default(theta) / np.float32(factor)).astype(np.float32), 1.0
    if kind == "dynamic":
        return _dynamic(head_dim, theta, scaling, length, exponents), 1.0
    if kind == "llama3":
        inv_freq = default(theta)
        old = scaling.original_max_position_embeddings
        low, high = scaling.low_freq_factor, scaling.high_freq_factor
        wavelen = np.float32(2 * math.pi) / inv_freq
        scaled = np.where(wavelen > old / low, inv_freq / np.float32(factor), inv_freq)
        smooth = (old / wavelen - low) / (high - low)
        smoothed = (1 - smooth) * scaled / np.float32(factor) + smooth * scaled
        medium = ~(wavelen < old / high) & ~(wavelen > old / low)
        return np.where(medium, smoothed, scaled).astype(np.float32), 1.0
    return _yarn(head_dim, theta, scaling, exponents)


def _dynamic(head_dim: int, theta: float, scaling: RopeScaling, length, exponents: np.ndarray):
    """NTK-aware frequencies as ``_compute_dynamic_ntk_parameters`` computes them from a forward's
    ``seq_len`` tensor: every step in float32 (numpy for a known length, jax for a traced one)."""
    xp = jnp if isinstance(length, jax.Array) else np
    longest, f32 = scaling.max_position_embeddings, xp.float32
    seen = xp.maximum(xp.asarray(length, xp.int32), longest).astype(f32)
    stretch = f32(scaling.factor) * seen / f32(longest) - f32(scaling.factor - 1)
    base = f32(theta) * stretch ** f32(head_dim / (head_dim - 2))
    return (f32(1.0) / base ** xp.asarray(exponents)).astype(f32)


def _yarn(
    head_dim: int, theta: float, scaling: RopeScaling, exponents: np.ndarray
) -> tuple[np.ndarray, float]:
    """YaRN (Peng et al. 2023) as ``transformers``' ``_compute_yarn_parameters``."""
    factor = scaling.factor
    original = scaling.original_max_position_embeddings or scaling.max_position_embeddings
    attention = scaling.attention_factor
    if attention is None:
        attention = 0.1 * math.log(factor) + 1.0 if factor > 1 else 1.0
    fast, slow = scaling.beta_fast or 32, scaling.beta_slow or 1

    def correction_dim(rotations: float) -> float:
        return head_dim * math.log(original / (rotations * 2 * math.pi)) / (2 * math.log(theta))

    low, high = correction_dim(fast), correction_dim(slow)
    if scaling.truncate:
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, head_dim - 1)
    if low == high:
        high += 0.001  # As transformers: no division by zero.
    ramp = np.clip((np.arange(head_dim // 2, dtype=np.float32) - low) / (high - low), 0, 1).astype(np.float32)
    extrapolated = 1 - ramp
    positions = np.float32(theta) ** exponents
    inv_freq = (np.float32(1) / (np.float32(factor) * positions)) * (1 - extrapolated) + (
        np.float32(1) / positions
    ) * extrapolated
    return inv_freq.astype(np.float32), float(attention)


def rope(x_BxLxHxK, positions, theta: float, scaling: RopeScaling | None = None, length=None,
         *, shared: bool = False, local: tuple[float, bool | jax.Array] | None = None):  # fmt: skip
    """Rotary position embedding on the last axis (half-split convention, as Llama's), with
    ``scaling``'s frequencies for a forward of ``length`` positions (default: ``x``'s; a traced scalar
    in serving, see the module docstring). ``positions``
    are ``[L]``, the same for every sequence, or ``[B, L]``, each sequence's own (a KV cache's decode).
    ``shared``: the sines and cosines are computed apart from the rotation (a decode step's layers).
    ``local``: ``(base, slides)``: where ``slides`` (a bool, or a traced one: a scanned layer's), the
    frequencies of ``base`` unscaled instead (Gemma 3's sliding layers, ``rope_local_base_freq``)."""
    half = x_BxLxHxK.shape[-1] // 2
    length = x_BxLxHxK.shape[1] if length is None else length
    inv_freq_K, attention = frequencies(2 * half, theta, scaling, length)
    if local is not None and local[1] is True:
        inv_freq_K, attention = frequencies(2 * half, local[0], None, length)
    elif local is not None and local[1] is not False:  # Picked by the layer's index in the stack.
        inv_freq_K = jnp.where(local[1], frequencies(2 * half, local[0], None, length)[0], inv_freq_K)
        attention = jnp.where(local[1], 1.0, attention) if attention != 1.0 else attention
    angles_xLxK = positions[..., None].astype(jnp.float32) * jnp.asarray(inv_freq_K)
    sin, cos = jnp.sin(angles_xLxK)[..., None, :], jnp.cos(angles_xLxK)[..., None, :]
    if shared:
        # Every unrolled layer's tables are the same: kept out of the rotation's kernels, XLA computes
        # them once for all the layers and fuses the cheap rotation into what reads it (a decode step's
        # query rotation into the attention scores' kernel: one kernel less a layer, issue 39).
        sin, cos = jax.lax.optimization_barrier((sin, cos))
    if isinstance(attention, jax.Array) or attention != 1.0:  # YaRN's: on cos and sin, as transformers.
        sin, cos = sin * attention, cos * attention
    x1, x2 = jnp.split(x_BxLxHxK.astype(jnp.float32), 2, axis=-1)
    rotated = jnp.concatenate([x1 * cos - x2 * sin, x2 * cos + x1 * sin], axis=-1)
    return rotated.astype(x_BxLxHxK.dtype)
