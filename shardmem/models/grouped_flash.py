"""JAX's Pallas Triton flash-attention kernels on grouped-query heads, with no copy of the keys and values.

    ctx_BxTxHxK = causal_attention(q_BxTxHxK, k_BxTxGxK, v_BxTxGxK, blocks=blocks, interpret=False)

    out_BxTxHxK, lse_BxHxT = forward(q_BxTxHxK, k_BxTxGxK, v_BxTxGxK, causal=True, scale=k**-0.5,
                                     blocks=blocks, interpret=False)
    delta_BxHxT = delta(out_BxTxHxK, d_out_BxTxHxK, blocks=blocks, interpret=False)
    dq, dk, dv = backward(q, k, v, lse, delta_BxHxT, d_out, causal=True, scale=..., blocks=..., interpret=...)

``jax.experimental.pallas.ops.gpu.attention.mha`` takes as many key/value heads as query heads, so a
grouped-query model (Llama 3: 32 query heads, 8 key/value heads) would have to repeat each key/value head
to its ``H / G`` query heads before every call: a query-sized copy of the keys and one of the values, which
``mha`` then saves for its backward pass (``H / G`` times the grouped bytes), and in the backward pass a
sum of the per-query-head gradients. cuDNN and FlashAttention-2 read the grouped keys and values as they
are. These calls run the same kernel bodies (``mha_forward_kernel``, ``mha_backward_kernel``: the same
code, tiles and FLOPs, and the kernel names the step-time model reads) under block specs that read
key/value head ``h // (H / G)`` for query head ``h``. The backward kernel writes one key and value gradient
per query head (as FlashAttention-2's backward does for grouped heads), summed over each group here in
float32. :func:`causal_attention` is the whole differentiable attention (the ``pallas`` kernel and the
deviceless stand-in for cuDNN, :mod:`shardmem.models.attention`); :mod:`shardmem.parallel.context` runs
the three pieces on the blocks of a split sequence.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp


def _pallas():
    from jax.experimental import pallas as pl
    from jax.experimental.pallas import triton as plgpu
    from jax.experimental.pallas.ops.gpu import attention as mha  # Loads Triton support.

    return pl, plgpu, mha


def forward(q_BxTxHxK, k_BxMxGxK, v_BxMxGxK, *, causal: bool, scale: float, blocks, interpret: bool):
    """Returns flash attention's output ``[B, T, H, K]`` (in ``q``'s dtype) and its base-2 log-sum-exp
    ``[B, H, T]`` (float32), each query head ``h`` attending key/value head ``h // (H / G)``; ``causal``
    masks by index, top-left; ``blocks`` are the kernel's ``BlockSizes``."""
    pl, plgpu, mha = _pallas()
    batch, length, heads, head_dim = q_BxTxHxK.shape
    keys, group = k_BxMxGxK.shape[1], heads // k_BxMxGxK.shape[2]
    block_q, block_k = min(blocks.block_q, length), min(blocks.block_k, keys)
    padded = pl.next_power_of_2(head_dim)
    kernel = functools.partial(mha.mha_forward_kernel, sm_scale=scale, causal=causal, block_q=block_q,
                               block_k=block_k, head_dim=head_dim)  # fmt: skip
    query = pl.BlockSpec((None, block_q, None, padded), lambda i, b, h: (b, i, h, 0))
    key_value = pl.BlockSpec((None, keys, None, padded), lambda i, b, h: (b, 0, h // group, 0))
    return pl.pallas_call(
        kernel,
        grid=(pl.cdiv(length, block_q), batch, heads),
        in_specs=[query, key_value, key_value, None],
        out_specs=[query, pl.BlockSpec((None, None, block_q), lambda i, b, h: (b, h, i))],
        out_shape=[
            jax.ShapeDtypeStruct(q_BxTxHxK.shape, q_BxTxHxK.dtype),
            jax.ShapeDtypeStruct((batch, heads, length), jnp.float32),
        ],  # fmt: skip
        compiler_params=plgpu.CompilerParams(num_warps=4 if head_dim <= 64 else 8, num_stages=2),
        interpret=interpret,
        name="mha_forward",  # The step-time model reads the kernel by JAX's name (planning.hlo).
    )(q_BxTxHxK, k_BxMxGxK, v_BxMxGxK, None)


def delta(out_BxTxHxK, d_out_BxTxHxK, *, blocks, interpret: bool):
    """Returns the rows' ``sum(out * d_out)`` ``[B, H, T]`` (float32) that :func:`backward` takes: JAX's
    preprocessing kernel, run once over the whole output where the output is merged from blocks (each
    block's backward needs only its rows of it, not the output)."""
    _, _, mha = _pallas()
    batch, length, heads, _ = out_BxTxHxK.shape
    rows = jax.ShapeDtypeStruct((batch, heads, length), jnp.float32)  # The shape of the log-sum-exp.
    return mha._preprocess_backward(
        out_BxTxHxK, d_out_BxTxHxK, rows, min(blocks.block_q, length), False, interpret
    )


def backward(q_BxTxHxK, k_BxMxGxK, v_BxMxGxK, lse_BxHxT, delta_BxHxT, d_out_BxTxHxK, *, causal: bool,
             scale: float, blocks, interpret: bool):  # fmt: skip
    """Returns the gradients of :func:`forward`'s output with respect to ``q`` (float32 ``[B, T, H, K]``),
    ``k`` and ``v`` (float32 ``[B, M, G, K]``, each summed over its group of query heads), given the
    log-sum-exp and :func:`delta` of the output it is the gradient of (for a block of a longer attention:
    the merged output's); the kernel reads no output (FlashAttention-2's backward needs only those)."""
    pl, plgpu, mha = _pallas()
    batch, length, heads, head_dim = q_BxTxHxK.shape
    keys, kv_heads = k_BxMxGxK.shape[1:3]
    group = heads // kv_heads
    block_q_dkv, block_kv_dkv = min(blocks.block_q_dkv, length), min(blocks.block_kv_dkv, keys)
    block_q_dq, block_kv_dq = min(blocks.block_q_dq, length), min(blocks.block_kv_dq, keys)
    if length // block_q_dq != keys // block_kv_dkv:
        raise ValueError(f"{length} queries and {keys} keys in different numbers of backward blocks")
    padded = pl.next_power_of_2(head_dim)
    whole_queries = pl.BlockSpec((None, length, None, padded), lambda b, h, _: (b, 0, h, 0))
    whole_keys = pl.BlockSpec((None, keys, None, padded), lambda b, h, _: (b, 0, h // group, 0))
    per_head = pl.BlockSpec((None, None, length), lambda b, h, _: (b, h, 0))
    per_query_head_block = pl.BlockSpec((None, block_kv_dkv, None, padded), lambda b, h, j: (b, j, h, 0))
    kernel = functools.partial(mha.mha_backward_kernel, sm_scale=scale, causal=causal, head_dim=head_dim,
                               block_q_dkv=block_q_dkv, block_kv_dkv=block_kv_dkv, block_q_dq=block_q_dq,
                               block_kv_dq=block_kv_dq)  # fmt: skip
    small = block_q_dkv * block_kv_dkv < 128 * 128 or block_q_dq * block_kv_dq < 128 * 128
    per_query_head = jax.ShapeDtypeStruct((batch, keys, heads, head_dim), k_BxMxGxK.dtype)
    dq, dk_BxMxHxK, dv_BxMxHxK = pl.pallas_call(
        kernel,
        grid=(batch, heads, pl.cdiv(keys, block_kv_dkv)),
        in_specs=[
            whole_queries,
            whole_keys,
            whole_keys,
            None,
            None,  # The output: mha_backward_kernel does not read it.
            whole_queries,
            per_head,
            per_head,
        ],  # fmt: skip
        out_specs=[
            pl.BlockSpec((None, block_q_dq, None, padded), lambda b, h, j: (b, j, h, 0)),
            per_query_head_block,
            per_query_head_block,
        ],  # fmt: skip
        out_shape=[jax.ShapeDtypeStruct(q_BxTxHxK.shape, q_BxTxHxK.dtype), per_query_head, per_query_head],
        compiler_params=plgpu.CompilerParams(num_warps=4 if small else 8, num_stages=2),
        interpret=interpret,
        name="mha_backward",
    )(q_BxTxHxK, k_BxMxGxK, v_BxMxGxK, None, None, d_out_BxTxHxK, lse_BxHxT, delta_BxHxT)

    def grouped(d_BxMxHxK):
        return d_BxMxHxK.astype(jnp.float32).reshape(batch, keys, kv_heads, group, head_dim).sum(3)

    return dq.astype(jnp.float32), grouped(dk_BxMxHxK), grouped(dv_BxMxHxK)


def causal_attention(q_BxTxHxK, k_BxTxGxK, v_BxTxGxK, *, blocks, interpret: bool):
    """Returns causal flash attention ``[B, T, H, K]`` of grouped-query heads, differentiable: the
    kernels of :func:`forward`, :func:`delta` and :func:`backward` in one ``custom_vjp``, as JAX's ``mha``
    holds its own, saving for the backward the grouped keys and values (not ``H / G`` copies of them),
    the queries, the output and its log-sum-exp."""
    return _causal(q_BxTxHxK, k_BxTxGxK, v_BxTxGxK, blocks, interpret)


@functools.partial(jax.custom_vjp, nondiff_argnums=(3, 4))
def _causal(q, k, v, blocks, interpret):
    return _causal_forward(q, k, v, blocks, interpret)[0]


def _causal_forward(q, k, v, blocks, interpret):
    out, lse = forward(q, k, v, causal=True, scale=q.shape[3] ** -0.5, blocks=blocks, interpret=interpret)
    return out, (q, k, v, out, lse)


def _causal_backward(blocks, interpret, residuals, d_out):
    q, k, v, out, lse = residuals
    d_out = d_out.astype(q.dtype)
    rows = delta(out, d_out, blocks=blocks, interpret=interpret)
    dq, dk, dv = backward(q, k, v, lse, rows, d_out, causal=True, scale=q.shape[3] ** -0.5, blocks=blocks,
                          interpret=interpret)  # fmt: skip
    return dq.astype(q.dtype), dk.astype(k.dtype), dv.astype(v.dtype)


_causal.defvjp(_causal_forward, _causal_backward)
