"""A decode step's attention over the KV cache as one Pallas (Triton) kernel, flash-decoding's way: the
cache's positions split into ``splits`` parts, one program per (sequence, KV head, part), and one small
XLA fusion that merges the parts by their running max and sum (two kernels past :data:`UNROLLED_PARTS`
parts).

    ctx_BxHxK = decode_attention(q_BxHxK, cache.keys, cache.values, layer, positions_B,
                                 window=None, splits=splits_for(batch, kv_heads, max_len, sms=108))

XLA runs the same attention as five kernels (scores, max, exp-sum, normalise, PV), each a launch and a
pass over the scores; a serving engine runs one. The kernel reads the stacked cache
``[layers, B, T, G, K]`` as it is and indexes the ``layer`` inside: given the layer's slice, XLA would
copy it out of the stack first (a custom call cannot fuse a dynamic slice), doubling the step's KV
traffic. Each program holds the ``H // G`` query heads of one KV head (grouped-query attention without
repeating a KV head) and reads only the blocks of its part that its sequence attends: positions up to
the sequence's own, the last ``window`` of them with a sliding window. The parts fill the GPU at batch 1
(batch x KV heads x splits >= its SMs, as flash-decoding splits the keys). An int8 cache is read as its
codes and their scales (one a position and KV head): each score is the query against a key's codes
times the key's scale, each probability times its value's scale (over the block's largest, so that
16-bit products keep a small vector's) before the PV product: a byte a code read once, as the 16-bit
cache is read. On CPU it runs in Pallas's interpret mode (tests); generation on CPU keeps XLA's
attention.

Learned from ``jax.experimental.pallas.ops.gpu.decode_attention`` (its ``gqa``), which does not fit as
it is: it takes one layer's keys transposed to ``[B, G, T, K]`` (a copy of the layer, each step), and
an optimization barrier splits its merge of the parts into several XLA kernels.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax import lax
from jax.sharding import PartitionSpec as P

from shardmem.parallel import rules as _rules

#: Triton's matrix products take blocks of at least 16 in every dimension: a KV head's queries are
#: padded to 16 rows (masked), and heads narrower than 16 keep XLA's attention.
MIN_BLOCK = 16
#: Positions a program reads per step of its loop (fewer when the cache is shorter).
BLOCK_K = 64
#: The most parts :func:`_merge` sums one by one (one kernel); more are merged by a reduction.
UNROLLED_PARTS = 8
#: Triton's pipeline depth for the loop over positions (its loads of keys and values in flight).
_STAGES = 2
#: The most parts the positions are split into.
MAX_SPLITS = 32
#: A masked score: finite, so that a block whose positions are all masked yields no NaN.
_MASKED = -0.7 * float(jnp.finfo(jnp.float32).max)
#: The kernel's name in the jaxpr and the compiled program (:data:`shardmem.planning.hlo.DECODE_ATTENTION`).
KERNEL_NAME = "decode_attention"


def attend(kernel, q_BxLxHxK, keys_NxBxTxGxK, values_NxBxTxGxK, layer, positions_Bx1, *,
           window: int | None = None, scales=()):  # fmt: skip
    """Returns the decode step's ``ctx_BxLxHxK`` (``L`` = 1) from :func:`decode_attention`, run on each
    device's sequences and heads of the stacked cache (an int8 cache's codes, and their ``scales``) as
    the rules shard it, or None where this kernel cannot run it and XLA's attention must: heads narrower
    than Triton's blocks, or a cache split otherwise than the queries (its positions over devices, or its
    KV heads not as the query heads)."""
    if not supports(q_BxLxHxK.shape[-1], keys_NxBxTxGxK.shape[2]):
        return None

    def run(q_BxLxHxK, keys_NxBxTxGxK, values_NxBxTxGxK, layer, positions_Bx1, *scales):
        b, _, _, _ = q_BxLxHxK.shape  # This device's sequences and heads.
        _, _, length, g, _ = keys_NxBxTxGxK.shape
        ctx_BxHxK = decode_attention(q_BxLxHxK[:, 0], keys_NxBxTxGxK, values_NxBxTxGxK, layer,
                                     positions_Bx1[:, 0], window=window, scales=scales,
                                     splits=splits_for(b, g, length, kernel.sms),
                                     shared_memory=kernel.shared_memory,
                                     interpret=kernel.interpret)  # fmt: skip
        return ctx_BxHxK[:, None]

    arguments = (q_BxLxHxK, keys_NxBxTxGxK, values_NxBxTxGxK, layer, positions_Bx1, *scales)
    active = _rules.active()
    if active is None:
        return run(*arguments)
    mesh, rules = active
    q_spec = _padded(rules.spec(("batch", None, "heads", None)), 4)
    cache_spec = _padded(rules.spec(("layers", "batch", "cache_seq", "kv_heads", "head_dim")), 5)
    split_alike = (q_spec[0], q_spec[2]) == (cache_spec[1], cache_spec[3])  # Sequences and KV heads.
    if not split_alike or any(cache_spec[axis] for axis in (0, 2, 4)):
        return None
    specs = (q_spec, cache_spec, cache_spec, P(), P(q_spec[0])) + (P(*cache_spec[:4]),) * len(scales)
    return _rules.shard_map(run, mesh, specs, q_spec)(*arguments)


def _padded(spec: P, ndim: int) -> P:
    return P(*spec, *(None,) * (ndim - len(spec)))


def supports(head_dim: int, max_len: int) -> bool:
    """Whether the kernel takes heads of ``head_dim`` over a cache of ``max_len`` positions: Triton's
    blocks are powers of two of at least :data:`MIN_BLOCK`."""
    return head_dim >= MIN_BLOCK and head_dim & (head_dim - 1) == 0 and max_len >= MIN_BLOCK


def block_positions(max_len: int, head_dim: int = MIN_BLOCK, itemsize: int = 2,
                    shared_memory: int | None = None, quantized: bool = False) -> int:  # fmt: skip
    """Positions one step of a program reads: :data:`BLOCK_K`, or the largest power of two within a
    shorter cache, halved until the tiles fit ``shared_memory`` bytes per thread block (Triton holds
    the queries' 16 rows and ``_STAGES`` blocks each of keys and values, as
    :meth:`~shardmem.models.attention.AttentionKernel.flash_blocks` counts them, all of ``itemsize``
    bytes: the queries'). An int8 cache's (``quantized``) are counted so too, as the 16-bit copies its
    products take, and its blocks of float32 scales beside them."""
    scales = 2 * _STAGES * 4 if quantized else 0  # Bytes a position: a key's and a value's scale.

    def tiles(block: int) -> int:
        return itemsize * head_dim * (MIN_BLOCK + 2 * _STAGES * block) + scales * block

    block = min(BLOCK_K, 1 << (max_len.bit_length() - 1))
    while shared_memory and block > MIN_BLOCK and tiles(block) > shared_memory:
        block //= 2
    return block


def splits_for(batch: int, kv_heads: int, max_len: int, sms: int | None) -> int:
    """Returns the parts to split a cache of ``max_len`` positions into, so that ``batch x kv_heads x
    splits`` programs fill ``sms`` SMs (a power of two, at most :data:`MAX_SPLITS`, each part at least a
    block of positions); 1 where the SMs are unknown (CPU)."""
    if not sms:
        return 1
    splits, blocks = 1, -(-max_len // block_positions(max_len))
    while batch * kv_heads * splits < sms and splits < min(MAX_SPLITS, blocks):
        splits *= 2
    return splits


def decode_attention(q_BxHxK, keys_NxBxTxGxK, values_NxBxTxGxK, layer, positions_B, *,
                     window: int | None = None, scales=(), splits: int = 1,
                     shared_memory: int | None = None, interpret: bool = False):  # fmt: skip
    """Returns ``ctx_BxHxK``: each sequence's query (one token, ``H`` heads) attending over layer
    ``layer``'s keys and values in the stacked cache, causally up to ``positions_B`` (its own position,
    included), with a ``window`` the last ``window`` positions; the positions split into ``splits``
    parts (see the module docstring), read in blocks whose tiles fit ``shared_memory`` bytes. An int8
    cache's keys and values are its codes, ``scales`` their ``(key_scales, value_scales)``, each
    ``[layers, B, T, G]`` (empty otherwise)."""
    from jax.experimental import pallas as pl
    from jax.experimental.pallas import triton as plgpu

    b, h, k = q_BxHxK.shape
    _, _, length, g, _ = keys_NxBxTxGxK.shape
    group = h // g
    block_h = max(MIN_BLOCK, 1 << (group - 1).bit_length())
    scales = tuple(scales)
    if len(scales) not in (0, 2):
        raise ValueError(f"scales: the keys' and the values' (two arrays), or none; got {len(scales)}")
    block_k = block_positions(length, k, q_BxHxK.dtype.itemsize, shared_memory, quantized=bool(scales))
    part = -(-length // splits // block_k) * block_k  # Positions per part: whole blocks.
    splits = -(-length // part)
    kernel = functools.partial(_kernel, scale=k**-0.5, block_k=block_k, part=part, group=group,
                               window=window, quantized=bool(scales))  # fmt: skip
    whole = pl.BlockSpec(keys_NxBxTxGxK.shape, lambda i, j, s: (0,) * 5)  # Indexed inside the kernel.
    whole_scales = [pl.BlockSpec(x.shape, lambda i, j, s: (0,) * 4) for x in scales]
    o_SxBxGxRxK, m_SxBxGxR, l_SxBxGxR = pl.pallas_call(
        kernel,
        grid=(b, g, splits),
        in_specs=[
            pl.BlockSpec((None, None, block_h, k), lambda i, j, s: (i, j, 0, 0)),
            whole,
            whole,
            pl.BlockSpec((), lambda i, j, s: ()),
            pl.BlockSpec((None,), lambda i, j, s: (i,)),
            *whole_scales,
        ],
        out_specs=[
            pl.BlockSpec((None, None, None, block_h, k), lambda i, j, s: (s, i, j, 0, 0)),
            pl.BlockSpec((None, None, None, block_h), lambda i, j, s: (s, i, j, 0)),
            pl.BlockSpec((None, None, None, block_h), lambda i, j, s: (s, i, j, 0)),
        ],
        out_shape=[
            jax.ShapeDtypeStruct((splits, b, g, group, k), jnp.float32),
            jax.ShapeDtypeStruct((splits, b, g, group), jnp.float32),
            jax.ShapeDtypeStruct((splits, b, g, group), jnp.float32),
        ],
        compiler_params=plgpu.CompilerParams(num_warps=4, num_stages=_STAGES),
        interpret=interpret,
        name=KERNEL_NAME,
        metadata={"window": str(window or 0)},  # What the cost model reads (planning/hlo.py).
    )(q_BxHxK.reshape(b, g, group, k), keys_NxBxTxGxK, values_NxBxTxGxK, jnp.asarray(layer, jnp.int32),
      jnp.asarray(positions_B, jnp.int32), *scales)  # fmt: skip
    return _merge(o_SxBxGxRxK, m_SxBxGxR, l_SxBxGxR).reshape(b, h, k).astype(q_BxHxK.dtype)


def _merge(o_SxBxGxRxK, m_SxBxGxR, l_SxBxGxR):
    """The parts' outputs weighed by their share of the softmax. Up to :data:`UNROLLED_PARTS` parts,
    summed one by one in elementwise ops, which XLA fuses into one kernel (a max over the parts and a
    sum weighed by it would be reductions, two kernels and more); more parts are merged by one
    reduction whose reducer merges two (max, sum, output) triples as flash attention merges blocks,
    then converted by a second kernel: unrolled, 32 parts took XLA 0.6 s a layer to compile."""
    parts = o_SxBxGxRxK.shape[0]
    if parts <= UNROLLED_PARTS:
        m_BxGxR = functools.reduce(jnp.maximum, (m_SxBxGxR[s] for s in range(parts)))
        weights = [jnp.exp(m_SxBxGxR[s] - m_BxGxR) for s in range(parts)]
        total_BxGxR = sum(w * l_SxBxGxR[s] for s, w in enumerate(weights))
        return sum(w[..., None] * o_SxBxGxRxK[s] for s, w in enumerate(weights)) / total_BxGxR[..., None]
    shape = o_SxBxGxRxK.shape
    m_SxBxGxRxK, l_SxBxGxRxK = (jnp.broadcast_to(x[..., None], shape) for x in (m_SxBxGxR, l_SxBxGxR))

    def merge(a, b):
        (m_a, l_a, o_a), (m_b, l_b, o_b) = a, b
        m = jnp.maximum(m_a, m_b)
        w_a, w_b = jnp.exp(m_a - m), jnp.exp(m_b - m)
        return m, w_a * l_a + w_b * l_b, w_a * o_a + w_b * o_b

    zero = jnp.float32(0)
    _, l_BxGxRxK, o_BxGxRxK = lax.reduce((m_SxBxGxRxK, l_SxBxGxRxK, o_SxBxGxRxK),
                                         (jnp.float32(_MASKED), zero, zero), merge, (0,))  # fmt: skip
    return o_BxGxRxK / l_BxGxRxK


def _kernel(q_ref, k_ref, v_ref, layer_ref, position_ref, *refs, scale, block_k, part, group, window,
            quantized):  # fmt: skip
    """One program: one sequence's queries of one KV head over one part of the positions; ``quantized``:
    the keys and values are int8 codes, and ``refs`` begin with their scales."""
    from jax.experimental import pallas as pl
    from jax.experimental.pallas import triton as plgpu

    if quantized:
        k_scales_ref, v_scales_ref, o_ref, m_ref, l_ref = refs
    else:
        o_ref, m_ref, l_ref = refs
    sequence, head, split = pl.program_id(0), pl.program_id(1), pl.program_id(2)
    layer, position = layer_ref[()], position_ref[()]
    block_h, head_dim = q_ref.shape
    rows = (jnp.arange(block_h) < group)[:, None]
    q = plgpu.load(q_ref, mask=rows, other=0)
    # The positions this program attends: its part's, up to the sequence's own, within the window.
    first = split * part
    start = first if window is None else jnp.maximum(first, position + 1 - window)
    end = jnp.minimum(first + part, position + 1)

    def step(index, carry):
        o, m, total = carry
        columns = index * block_k + jnp.arange(block_k)
        attended = (columns >= start) & (columns < end)
        at = (layer, sequence, pl.ds(index * block_k, block_k), head)
        keys = plgpu.load(k_ref.at[(*at, slice(None))], mask=attended[:, None], other=0)
        if quantized:  # Codes of at most 127 are exact in 16 bits; the scales multiply the products.
            keys = keys.astype(q.dtype)
        scores = plgpu.dot(q, keys, trans_b=True).astype(jnp.float32) * scale
        if quantized:
            scores = scores * plgpu.load(k_scales_ref.at[at], mask=attended, other=0)[None, :]
        scores = jnp.where(attended[None, :], scores, _MASKED)
        m_next = jnp.maximum(m, scores.max(axis=-1))
        correction = jnp.exp(m - m_next)
        p = jnp.where(attended[None, :], jnp.exp(scores - m_next[:, None]), 0.0)
        values = plgpu.load(v_ref.at[(*at, slice(None))], mask=attended[:, None], other=0)
        if quantized:
            # Each probability times its value's scale, over the block's largest scale: in 16 bits, a
            # probability times a scale of a small vector's (its magnitude / 127) would flush to zero.
            value_scales = plgpu.load(v_scales_ref.at[at], mask=attended, other=0)
            largest = jnp.maximum(value_scales.max(), jnp.float32(1e-30))
            weights = p * (value_scales / largest)[None, :]
            pv = plgpu.dot(weights.astype(q.dtype), values.astype(q.dtype)).astype(jnp.float32) * largest
        else:
            pv = plgpu.dot(p.astype(values.dtype), values).astype(jnp.float32)
        o = correction[:, None] * o + pv
        return o, m_next, correction * total + p.sum(axis=-1)

    o = jnp.zeros((block_h, head_dim), jnp.float32)
    m = jnp.full((block_h,), _MASKED, jnp.float32)
    total = jnp.zeros((block_h,), jnp.float32)
    o, m, total = lax.fori_loop(start // block_k, (end + block_k - 1) // block_k, step, (o, m, total))
    plgpu.store(o_ref, o, mask=rows)
    plgpu.store(m_ref, m, mask=rows[:, 0])
    plgpu.store(l_ref, total, mask=rows[:, 0])
