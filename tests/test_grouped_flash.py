"""Tests for shardmem.models.grouped_flash: JAX's Pallas flash kernels on grouped-query heads (interpret mode,
the code a GPU compiles) against the same kernels on keys and values repeated to every query head."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from shardmem.models import grouped_flash


@pytest.mark.newest
@pytest.mark.parametrize("causal", [True, False], ids=["causal", "unmasked"])
def test_grouped_heads_match_the_kernel_on_repeated_heads_forward_and_backward(causal):
    from jax.experimental.pallas.ops.gpu import attention as mha

    keys = jax.random.split(jax.random.key(0), 4)
    q = jax.random.normal(keys[0], (2, 32, 4, 16))  # 4 query heads, 2 to each of 2 key/value heads.
    k, v = (jax.random.normal(key, (2, 32, 2, 16)) for key in keys[1:3])
    d_out = jax.random.normal(keys[3], q.shape)
    blocks = mha.BlockSizes(16, 16, block_q_dkv=16, block_kv_dkv=16, block_q_dq=16, block_kv_dq=16)  # 2 tiles
    options = dict(causal=causal, scale=16**-0.5, blocks=blocks, interpret=True)
    k_repeated, v_repeated = jnp.repeat(k, 2, axis=2), jnp.repeat(v, 2, axis=2)

    out, lse = grouped_flash.forward(q, k, v, **options)
    want_out, want_lse = mha.mha(q, k_repeated, v_repeated, None, sm_scale=16**-0.5, causal=causal,
                                 block_sizes=blocks, interpret=True, return_residuals=True)  # fmt: skip
    np.testing.assert_array_equal(out, want_out)
    np.testing.assert_array_equal(lse, want_lse)

    delta = grouped_flash.delta(out, d_out, blocks=blocks, interpret=True)
    got = grouped_flash.backward(q, k, v, lse, delta, d_out, **options)
    residuals = (q, k_repeated, v_repeated, None, want_out, want_lse)
    dq, dk, dv, _ = mha._mha_backward(16**-0.5, causal, blocks, "triton", None, 2, None, True, False, False,
                                      residuals, d_out)  # fmt: skip
    grouped = lambda d: d.reshape(2, 32, 2, 2, 16).sum(3)  # noqa: E731  Each key/value head's query heads.
    np.testing.assert_array_equal(got[0], dq)
    np.testing.assert_allclose(got[1], grouped(dk), rtol=1e-6, atol=1e-6)
    np.testing.assert_allclose(got[2], grouped(dv), rtol=1e-6, atol=1e-6)
