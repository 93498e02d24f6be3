"""The KV cache of serving: every layer's keys and values for a batch of sequences, written by prefill
and by each decode step, read by the decode step's attention.

    cache = KVCache.zeros(layers=32, batch=8, max_len=4096, kv_heads=8, head_dim=128, dtype="int8")
    shardings = cache.by_axes(lambda axes: NamedSharding(mesh, rules.spec(axes)))
    slot = CacheSlot(cache, layer, positions_BxL, prefill=False)    # what one layer of the model sees
    ctx_BxLxHxK, cache = slot.attend(kernel, q_BxLxHxK, k_BxLxGxK, v_BxLxGxK, window=None)

``keys`` and ``values`` are ``[layers, batch, max_len, kv_heads, head_dim]``, logical axes
:data:`CACHE_AXES`: the partition rules shard the batch over the data replicas and the KV heads over
``tensor``, as they shard the projections that write them. Stacked over the layers as the model's weights
are, the layers' scan carries one array and updates it in place. ``int8`` keeps codes and one float32
scale per token and KV head (``key_scales``, ``value_scales``: ``[layers, batch, max_len, kv_heads]``,
:data:`SCALE_AXES`), each vector of ``head_dim`` entries rounded to 127 levels a side of its largest
magnitude: 1 + 4 / head_dim bytes an entry where bfloat16 takes 2.

Prefill writes positions ``0 .. P-1`` of every sequence and attends over its prompt with the model's own
kernel, exactly as the training forward does: prompts are right-padded, so a causal query never sees the
padding after it. Decode writes one token per sequence at that sequence's own position and attends over
the cache up to it (the last ``window`` positions, with ``model.sliding_window``). A short prompt's padded
positions lie past its length, and each is overwritten by decode before any query can see it.

A layer whose window is shorter than the cache keeps only the window's keys (:attr:`KVCache.ring`, a
second stack of those layers, ``window`` positions long), as vLLM and TensorRT-LLM keep a sliding
layer's: position ``p`` in place ``p % window``, which it overwrites once ``p`` has left every later
query's window. A decode step attends over all of the ring's places it has written (the order of the keys
does not matter to attention: each was rotated at its own position before it was stored); a prefill of
prompts longer than the window writes each sequence's last ``window`` positions, by its length. For
Gemma-3-12B (a window of 1,024 on 40 layers of 48) at 32,768 positions that is 0.19 of the cache.
"""

from __future__ import annotations

import contextlib
import contextvars
import dataclasses
from collections.abc import Iterator

import jax
import jax.numpy as jnp

from shardmem.parallel.rules import constrain

#: Values of ``serve.kv_dtype``.
KV_DTYPES = ("bfloat16", "float16", "float32", "int8")
#: Logical axes of the stacked keys and values.
CACHE_AXES = ("layers", "batch", "cache_seq", "kv_heads", "head_dim")
#: Logical axes of an int8 cache's scales: one per token and KV head.
SCALE_AXES = CACHE_AXES[:-1]

#: The kernel ``CacheSlot.attend(None, ...)`` attends with (:func:`attending_with`); None: XLA's.
_serving_kernel: contextvars.ContextVar = contextvars.ContextVar("serving_kernel", default=None)


@contextlib.contextmanager
def attending_with(kernel) -> Iterator[None]:
    """Makes ``CacheSlot.attend(None, ...)`` attend with ``kernel`` (an
    :class:`~shardmem.models.attention.AttentionKernel`) while the context is open: the serving program
    of a model of your own sets the kernel it resolved for the mesh's devices around ``cached_call``."""
    token = _serving_kernel.set(kernel)
    try:
        yield
    finally:
        _serving_kernel.reset(token)


@dataclasses.dataclass(frozen=True)
class CacheLayout:
    """The shape of a model's KV cache: ``layers`` attention layers, each with ``kv_heads`` key/value
    heads of ``head_dim``; and the sliding ``window`` its layers attend over (None: all positions), which
    the serving plan's decode time reads. The reference model's comes from its config; a model of your
    own's ``cache_layout()`` returns it (:mod:`shardmem.program.user_serving`):

        def cache_layout(self):
            return shardmem.CacheLayout(layers=len(self.blocks), kv_heads=2, head_dim=16)
    """

    layers: int
    kv_heads: int
    head_dim: int
    window: int | None = None
    #: The layers that slide over ``window`` (in the stack's order), whose keys a ring of the window's
    #: positions holds where it is shorter than the cache (:attr:`KVCache.ring`): the reference model's
    #: sliding layers. A model of your own's layout leaves it empty (its layers index the one stack).
    ring: tuple[int, ...] = ()

    def ringed(self, max_len: int) -> tuple[int, ...]:
        """The layers a cache of ``max_len`` positions keeps in its ring: :attr:`ring`, where the window
        is shorter than the cache; else none."""
        return self.ring if self.window is not None and self.window < max_len else ()

    def zeros(self, *, batch: int, max_len: int, dtype: str) -> KVCache:
        """Returns an empty cache of this shape for ``batch`` sequences of ``max_len`` positions."""
        ringed = len(self.ringed(max_len))
        shape = dict(batch=batch, kv_heads=self.kv_heads, head_dim=self.head_dim, dtype=dtype)
        cache = KVCache.zeros(layers=self.layers - ringed, max_len=max_len, **shape)
        if not ringed:
            return cache
        return dataclasses.replace(cache, ring=KVCache.zeros(layers=ringed, max_len=self.window, **shape))


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class KVCache:
    """Every layer's keys and values (see the module docstring); the scales are None unless int8.
    ``ring``: the sliding layers' keys and values where their window is shorter than the cache (a
    :class:`KVCache` of ``window`` positions, :meth:`CacheLayout.zeros`); the stack then holds the other
    layers only. None: every layer's are in the stack."""

    keys: jax.Array
    values: jax.Array
    key_scales: jax.Array | None = None
    value_scales: jax.Array | None = None
    ring: KVCache | None = None

    @staticmethod
    def zeros(*, layers: int, batch: int, max_len: int, kv_heads: int, head_dim: int, dtype: str) -> KVCache:
        """Returns an empty cache (all zeros) of ``dtype``, one of :data:`KV_DTYPES`."""
        shape = (layers, batch, max_len, kv_heads, head_dim)
        if dtype != "int8":
            return KVCache(jnp.zeros(shape, dtype), jnp.zeros(shape, dtype))
        scales = jnp.zeros(shape[:-1], jnp.float32)
        return KVCache(jnp.zeros(shape, jnp.int8), jnp.zeros(shape, jnp.int8), scales, scales)

    def by_axes(self, fn) -> KVCache:
        """Returns the cache's tree with ``fn(logical axes)`` in each array's place (its sharding:
        ``lambda axes: NamedSharding(mesh, rules.spec(axes))``)."""
        scales = (fn(SCALE_AXES), fn(SCALE_AXES)) if self.key_scales is not None else (None, None)
        ring = None if self.ring is None else self.ring.by_axes(fn)
        return KVCache(fn(CACHE_AXES), fn(CACHE_AXES), *scales, ring)

    @property
    def max_len(self) -> int:
        """Positions each sequence has room for."""
        return self.keys.shape[2]

    def write(self, layer, positions, k_BxLxGxK, v_BxLxGxK) -> KVCache:
        """Returns the cache with layer ``layer``'s keys and values at ``positions``: ``[L]``, the same
        first ``L`` positions of every sequence (prefill), or ``[B, 1]``, one per sequence (decode)."""
        new = {"keys": k_BxLxGxK, "values": v_BxLxGxK}
        if self.key_scales is not None:
            (k_codes, k_scales), (v_codes, v_scales) = _quantize(k_BxLxGxK), _quantize(v_BxLxGxK)
            new = {"keys": k_codes, "values": v_codes, "key_scales": k_scales, "value_scales": v_scales}
        updated = {}
        for name, x in new.items():
            stack = getattr(self, name)
            x = x.astype(stack.dtype)
            if positions.ndim == 1:  # Prefill: positions 0 .. L-1, a block of the layer's stack.
                start = (layer, 0, 0) + (0,) * (stack.ndim - 3)
                updated[name] = jax.lax.dynamic_update_slice(stack, x[None], start)
            elif x.shape[0] == 1:  # Decode, one sequence: at its position.
                # Not a scatter of one index: XLA rewrites that to this update behind a bounds check (a
                # kernel for the check, one per array to select the old entry where out of bounds), three
                # more kernels per layer than the update alone, which XLA fuses with what computes the
                # token. Positions are never past the cache (run.generation checks max_len first). An int8
                # cache's codes and scales too: on GPUs the decode kernel reads them in place. (Where XLA's
                # attention reads the layer, on CPUs, XLA copies each stack whole every step, int8 or not.)
                start = (layer, 0, positions[0, 0]) + (0,) * (stack.ndim - 3)
                updated[name] = jax.lax.dynamic_update_slice(stack, x[None], start)
            else:  # Decode: one token at each sequence's own position.
                rows_B = jnp.arange(x.shape[0])
                updated[name] = stack.at[layer, rows_B, positions[:, 0]].set(x[:, 0])
            # Kept where the rules put the cache, so that the layers' loop updates each device's share.
            updated[name] = constrain(updated[name], CACHE_AXES if name in ("keys", "values") else SCALE_AXES)
        return dataclasses.replace(self, **updated)

    def read(self, layer, dtype) -> tuple[jax.Array, jax.Array]:
        """Returns layer ``layer``'s keys and values ``[B, max_len, G, K]`` in ``dtype``."""
        k_BxTxGxK, v_BxTxGxK = self.keys[layer], self.values[layer]
        if self.key_scales is None:
            return k_BxTxGxK.astype(dtype), v_BxTxGxK.astype(dtype)
        return (_dequantize(k_BxTxGxK, self.key_scales[layer], dtype),
                _dequantize(v_BxTxGxK, self.value_scales[layer], dtype))  # fmt: skip


def _quantize(x_BxLxGxK) -> tuple[jax.Array, jax.Array]:
    """int8 codes and the float32 scale of each ``head_dim`` vector (its largest magnitude / 127)."""
    x32 = x_BxLxGxK.astype(jnp.float32)
    scales_BxLxG = jnp.max(jnp.abs(x32), axis=-1) / 127
    safe = jnp.where(scales_BxLxG == 0, 1.0, scales_BxLxG)[..., None]
    return jnp.round(x32 / safe).astype(jnp.int8), scales_BxLxG


def _dequantize(codes_BxTxGxK, scales_BxTxG, dtype) -> jax.Array:
    return (codes_BxTxGxK.astype(jnp.float32) * scales_BxTxG[..., None]).astype(dtype)


@dataclasses.dataclass(frozen=True)
class CacheSlot:
    """What one layer of the model sees of the cache in a prefill or decode step: the whole ``cache``,
    the layer's index in the model's stack, the positions of the step's tokens (``[L]`` for a prefill's
    prompts, ``[B, 1]`` for a decode step's tokens), and ``rope_length``: the step's largest position of
    a real token over the batch, plus one, from which dynamic RoPE computes its frequencies
    (:mod:`shardmem.models.rope`; None for the others).

    Where the cache has a ring (:attr:`KVCache.ring`), ``ring`` says whether this layer's keys are in it
    (the layer slides) or in the stack, and ``entry`` is their index there; a prefill's ``lengths``
    (each prompt's, ``[B]``) say which of a prompt longer than the window are its last ``window``. None
    (a model of your own's, and a cache without a ring): the layer's keys are in the stack at ``layer``.
    """

    cache: KVCache
    layer: jax.Array | int
    positions: jax.Array
    prefill: bool
    rope_length: jax.Array | None = None
    ring: bool | None = None
    entry: jax.Array | int | None = None
    lengths: jax.Array | None = None

    def attend(self, kernel, q_BxLxHxK, k_BxLxGxK, v_BxLxGxK, *, window: int | None = None,
               softcap: float | None = None):  # fmt: skip
        """Returns ``(ctx_BxLxHxK, cache)``: the step's attention, and the cache with the step's keys
        and values written. Prefill attends over the prompt with ``kernel`` (the training forward's
        attention; None, as a model of your own passes it: the kernel its serving program resolved for the
        mesh's devices, :func:`attending_with`, and outside one XLA's,
        :func:`~shardmem.models.attention.causal_attention`); decode over the cache, up to each
        sequence's position (a sliding layer's ring: every place written so far): on GPUs (a flash
        ``kernel``) with the Pallas decode kernel over the stacked cache
        (:mod:`shardmem.models.decode_attention`; an int8 cache's codes and scales as they are), else
        with XLA's. cuDNN's flash kernel takes 16-bit inputs only: a layer that attends in float32
        gets XLA's attention. Soft-capped scores (``softcap``: Gemma 2's) take ``chunked`` or ``xla``, which
        :func:`~shardmem.models.attention.resolve_attention` gives such a model."""
        from shardmem.models import decode_attention
        from shardmem.models.attention import attend, causal_attention, masking

        kernel = _serving_kernel.get() if kernel is None else kernel
        cudnn = kernel is not None and "cudnn" in (kernel.name, kernel.stands_for)
        if cudnn and q_BxLxHxK.dtype.itemsize > 2:
            kernel = None
        stack, entry, positions = self._stored(k_BxLxGxK, v_BxLxGxK)
        stack = stack.write(entry, *positions)
        cache = dataclasses.replace(self.cache, ring=stack) if self.ring else stack
        if self.prefill and kernel is None:
            window = masking(window, q_BxLxHxK.shape[1])
            return causal_attention(q_BxLxHxK, k_BxLxGxK, v_BxLxGxK, window=window, softcap=softcap), cache
        if self.prefill:
            return attend(kernel, q_BxLxHxK, k_BxLxGxK, v_BxLxGxK, window=window, softcap=softcap), cache
        positions_Bx1 = self.positions
        # Every place of a ring written so far is in the window: those up to the position, at most all
        # (no further: the decode kernel's last part would read past a ring its blocks do not divide).
        if self.ring:
            positions_Bx1, window = jnp.minimum(positions_Bx1, stack.max_len - 1), None
        window = masking(window, stack.max_len)
        # A layer's own window (traced: the window slides on some layers) is XLA's attention's.
        pallas = kernel is not None and kernel.decodes_in_pallas and isinstance(window, int | None)
        if pallas:
            scales = () if stack.key_scales is None else (stack.key_scales, stack.value_scales)
            ctx_BxLxHxK = decode_attention.attend(kernel, q_BxLxHxK, stack.keys, stack.values, entry,
                                                  positions_Bx1, window=window, scales=scales)  # fmt: skip
            if ctx_BxLxHxK is not None:
                return ctx_BxLxHxK, cache
        k_BxTxGxK, v_BxTxGxK = stack.read(entry, q_BxLxHxK.dtype)
        return _over_the_cache(q_BxLxHxK, k_BxTxGxK, v_BxTxGxK, positions_Bx1, window, softcap), cache

    def _stored(self, k_BxLxGxK, v_BxLxGxK):
        """Where this layer's keys and values go: ``(stack, entry, (positions, keys, values))``, the
        stack (the cache's, or its ring) and the layer's index in it, and what :meth:`KVCache.write`
        writes there: in a ring, a decode step's token at its position's place (``position % window``),
        a prefill's prompts as they are where they fit in the window, else each prompt's last
        ``window`` positions, each at its place."""
        entry = self.layer if self.entry is None else self.entry
        if not self.ring:
            return self.cache, entry, (self.positions, k_BxLxGxK, v_BxLxGxK)
        ring = self.cache.ring
        window = ring.max_len
        if not self.prefill:
            return ring, entry, (self.positions % window, k_BxLxGxK, v_BxLxGxK)
        if k_BxLxGxK.shape[1] <= window:  # Positions 0 .. P-1 are places 0 .. P-1.
            return ring, entry, (self.positions, k_BxLxGxK, v_BxLxGxK)
        if self.lengths is None:
            raise ValueError("a prefill of prompts longer than the ring's window needs each prompt's length")
        # Place s holds the latest position before the prompt's end that is s modulo the window (a
        # negative one, where the prompt is shorter than the window, is never attended: any position).
        places_W = jnp.arange(window)
        last_Bx1 = self.lengths[:, None] - 1
        taken_BxW = jnp.clip(places_W + window * ((last_Bx1 - places_W) // window), 0, k_BxLxGxK.shape[1] - 1)
        k_BxWxGxK, v_BxWxGxK = (jnp.take_along_axis(x, taken_BxW[:, :, None, None], axis=1)
                                for x in (k_BxLxGxK, v_BxLxGxK))  # fmt: skip
        return ring, entry, (places_W, k_BxWxGxK, v_BxWxGxK)


def _over_the_cache(q_BxLxHxK, k_BxTxGxK, v_BxTxGxK, positions_BxL, window: int | None,
                    softcap: float | None = None):  # fmt: skip
    """A decode step's attention over a layer's cache in XLA: each query (at ``positions``, its
    sequence's own) over the keys up to it (the last ``window``), as multiply-and-sum reductions in
    float32 over the keys and values as the cache lays them out. As matmuls, XLA's GPU compiler wanted
    the KV heads before the positions (its batched matmul takes the batch dimensions major) and, with
    more than one KV head a device, transposed the whole cache to get them every step (deviceless for
    an H100, a model of your own at 64 x 8,192 positions, 2 layers of 2 KV heads: 132.5 MiB of decode
    temporaries, 9 MiB as reductions; with one KV head a device, as reductions XLA may still write one
    layer's products out, as the matmuls wrote their copies: 4.5 MiB either way at 8 x 4,096)."""
    from shardmem.models.attention import soft_cap

    b, length, h, k = q_BxLxHxK.shape
    g = k_BxTxGxK.shape[2]
    q_BxLxGxRxK = q_BxLxHxK.reshape(b, length, g, h // g, k).astype(jnp.float32) * (k**-0.5)
    keys_Bx1xTxGx1xK = k_BxTxGxK[:, None, :, :, None, :].astype(jnp.float32)
    scores_BxLxTxGxR = soft_cap(jnp.sum(q_BxLxGxRxK[:, :, None] * keys_Bx1xTxGx1xK, axis=-1), softcap)
    columns_T = jnp.arange(k_BxTxGxK.shape[1])
    seen_BxLxT = columns_T <= positions_BxL[..., None]
    if window is not None:
        seen_BxLxT &= positions_BxL[..., None] - columns_T < window
    scores_BxLxTxGxR = jnp.where(seen_BxLxT[..., None, None], scores_BxLxTxGxR, -1e30)
    probs_BxLxTxGxR = jax.nn.softmax(scores_BxLxTxGxR, axis=2)
    values_Bx1xTxGx1xK = v_BxTxGxK[:, None, :, :, None, :].astype(jnp.float32)
    ctx_BxLxGxRxK = jnp.sum(probs_BxLxTxGxR[..., None] * values_Bx1xTxGx1xK, axis=2)
    return ctx_BxLxGxRxK.reshape(b, length, h, k).astype(q_BxLxHxK.dtype)
