"""The Pallas decode-attention kernel (shardmem.models.decode_attention), in interpret mode on CPU: the
same attention as XLA's over the cache, for grouped-query heads, each sequence at its own position, a
sliding window, any number of parts and an int8 cache's codes and scales; and, sharded by the rules, what
a decode step's layer runs."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from shardmem import build_mesh
from shardmem.models.attention import AttentionKernel, causal_attention
from shardmem.models.decode_attention import block_positions, decode_attention, splits_for
from shardmem.models.kv_cache import CacheSlot, KVCache, _quantize
from shardmem.parallel.rules import Rules
from shardmem.planning import hlo

pytestmark = pytest.mark.newest  # Pallas's API moves between JAX versions.

LAYERS, B, T, G, K, H = 3, 4, 600, 2, 16, 6  # 3 query heads per KV head: padded to Triton's 16 rows.
POSITIONS = np.array([0, 170, 599, 5], np.int32)  # The first position, the last, and two between.


def _cache(rng):
    keys, values = (jnp.asarray(rng.normal(size=(LAYERS, B, T, G, K)), jnp.float32) for _ in range(2))
    return keys, values


@pytest.mark.parametrize("window", [None, 7, 100])
@pytest.mark.parametrize("splits", [1, 4, 16])  # 600 positions in blocks of 64: 1, 4 and 10 parts.
def test_the_kernel_attends_as_xla_does_up_to_each_sequences_position(window, splits):
    rng = np.random.default_rng(0)
    keys, values = _cache(rng)
    q_BxHxK = jnp.asarray(rng.normal(size=(B, H, K)), jnp.float32)
    ctx_BxHxK = decode_attention(q_BxHxK, keys, values, jnp.int32(1), POSITIONS, window=window,
                                 splits=splits, interpret=True)  # fmt: skip
    expected = causal_attention(q_BxHxK[:, None], keys[1], values[1], q_positions=POSITIONS[:, None],
                                k_positions=jnp.arange(T), window=window)[:, 0]  # fmt: skip
    np.testing.assert_allclose(ctx_BxHxK, expected, atol=2e-6)
    # Another layer's keys give another answer: the kernel reads the layer it is given.
    other = decode_attention(q_BxHxK, keys, values, jnp.int32(2), POSITIONS, window=window, splits=splits,
                             interpret=True)  # fmt: skip
    assert not np.allclose(other, expected, atol=1e-3)


@pytest.mark.parametrize("window, splits", [(None, 1), (7, 4), (100, 16)])
def test_an_int8_caches_codes_and_scales_are_read_as_they_are(window, splits):
    # The kernel's scores and PV product on the codes, scaled in the kernel, equal XLA's attention over
    # the cache dequantized (what an int8 cache's decode step ran before), within float32 rounding.
    rng = np.random.default_rng(2)
    (k_codes, k_scales), (v_codes, v_scales) = (_quantize(x) for x in _cache(rng))
    q_BxHxK = jnp.asarray(rng.normal(size=(B, H, K)), jnp.float32)
    ctx_BxHxK = decode_attention(q_BxHxK, k_codes, v_codes, jnp.int32(1), POSITIONS, window=window,
                                 scales=(k_scales, v_scales), splits=splits, interpret=True)  # fmt: skip
    keys, values = (codes[1] * scales[1][..., None] for codes, scales in ((k_codes, k_scales),
                                                                         (v_codes, v_scales)))  # fmt: skip
    expected = causal_attention(q_BxHxK[:, None], keys, values, q_positions=POSITIONS[:, None],
                                k_positions=jnp.arange(T), window=window)[:, 0]  # fmt: skip
    np.testing.assert_allclose(ctx_BxHxK, expected, atol=2e-6)
    unscaled = decode_attention(q_BxHxK, k_codes, v_codes, jnp.int32(1), POSITIONS, window=window,
                                scales=(jnp.ones_like(k_scales), v_scales), splits=splits,
                                interpret=True)  # fmt: skip
    assert not np.allclose(unscaled, expected, atol=1e-3)  # The keys' scales are applied.


@pytest.mark.parametrize("dtype", ["float16", "bfloat16"])
def test_an_int8_caches_small_values_survive_16_bit_products(dtype):
    # Queries in 16 bits take 16-bit products. Values of magnitude 1e-4 have scales near 2e-6, and a
    # probability times one fell below float16's normal range, most of its bits lost (a mean relative
    # error of 1.9% here); over the block's largest scale, 0.05% (bfloat16's own rounding: 0.17%).
    rng = np.random.default_rng(3)
    keys, values = _cache(rng)
    (k_codes, k_scales), (v_codes, v_scales) = _quantize(keys), _quantize(values * 1e-4)
    q_BxHxK = jnp.asarray(rng.normal(size=(B, H, K)), dtype)
    ctx_BxHxK = decode_attention(q_BxHxK, k_codes, v_codes, jnp.int32(1), POSITIONS,
                                 scales=(k_scales, v_scales), interpret=True)  # fmt: skip
    dequantized = (codes[1] * scales[1][..., None] for codes, scales in ((k_codes, k_scales),
                                                                        (v_codes, v_scales)))  # fmt: skip
    expected = causal_attention(q_BxHxK[:, None].astype(jnp.float32), *dequantized,
                                q_positions=POSITIONS[:, None], k_positions=jnp.arange(T))[:, 0]  # fmt: skip
    error = np.abs(np.asarray(ctx_BxHxK, np.float32) - expected) / np.abs(expected).mean()
    assert ctx_BxHxK.dtype == dtype and error.mean() < 3e-3, error.mean()


def test_the_parts_fill_the_gpus_sms_and_the_blocks_its_shared_memory():
    assert splits_for(1, 32, 4096, sms=108) == 4  # Llama 2 7B at batch 1: 128 programs for 108 SMs.
    assert splits_for(1, 8, 4096, sms=132) == 32  # 8 KV heads: 256 programs, the most parts.
    assert splits_for(64, 32, 4096, sms=108) == 1  # A batch of 64 fills the GPU alone.
    assert splits_for(1, 2, 128, sms=108) == 2  # A part is at least a block of 64 positions.
    assert splits_for(1, 2, 4096, sms=None) == 1  # CPU.
    assert block_positions(4096) == 64 and block_positions(40) == 32
    # GPT-J's heads of 256 in 16 bits: 16 query rows and two stages of 64 keys and values take 135 KiB, more
    # than an RTX 3090's 99 KiB a block; 32 positions take 71 KiB.
    assert block_positions(4096, 256, 2, shared_memory=101_376) == 32
    assert block_positions(4096, 256, 2, shared_memory=166_912) == 64  # An A100's 163 KiB.
    # An int8 cache's blocks take its scales too (8 bytes a position, in two stages): 64 positions of 256
    # in 16 bits fit 140,000 bytes alone (139,264), not with their scales (140,288).
    assert block_positions(4096, 256, 2, shared_memory=140_000) == 64
    assert block_positions(4096, 256, 2, shared_memory=140_000, quantized=True) == 32


def test_a_decode_steps_layer_runs_the_kernel_sharded_as_the_cache_is():
    # 2 replicas x tensor 2 on 4 CPU devices: each runs its sequences' and KV heads' share of the kernel.
    mesh = build_mesh({"data": 2, "tensor": 2}, jax.devices()[:4])
    rules = Rules.from_config({"batch": ["data"], "heads": "tensor", "kv_heads": "tensor"}, mesh.axis_names)
    rng = np.random.default_rng(1)
    keys, values = _cache(rng)
    cache = KVCache(keys, values)
    q_Bx1xHxK = jnp.asarray(rng.normal(size=(B, 1, H, K)), jnp.float32)
    k_Bx1xGxK, v_Bx1xGxK = (jnp.asarray(rng.normal(size=(B, 1, G, K)), jnp.float32) for _ in range(2))

    def layer(kernel, window):
        def run(cache, q, k, v):
            with rules.activate(mesh):
                slot = CacheSlot(cache, jnp.int32(2), jnp.asarray(POSITIONS)[:, None], prefill=False)
                return slot.attend(kernel, q, k, v, window=window)

        arguments = (cache, q_Bx1xHxK, k_Bx1xGxK, v_Bx1xGxK)
        return jax.jit(run)(*arguments), hlo.fused_attention_kernels(jax.make_jaxpr(run)(*arguments))

    for window in (None, 7):
        (ctx, written), kernels = layer(AttentionKernel("pallas", interpret=True, sms=8), window)
        assert kernels["decode_attention"] == hlo.FusedKernel(2, False, decode=True, window=window)
        (expected, expected_cache), none = layer(AttentionKernel("xla"), window)
        assert not none
        np.testing.assert_allclose(ctx, expected, atol=2e-6)
        np.testing.assert_array_equal(written.keys, expected_cache.keys)
        # The step's own key is attended: it was written before the kernel read the cache.
        np.testing.assert_array_equal(written.keys[2, np.arange(B), POSITIONS], k_Bx1xGxK[:, 0])
    # An int8 cache runs the kernel too, on each device's share of its codes and their scales.
    (k_codes, k_scales), (v_codes, v_scales) = _quantize(keys), _quantize(values)
    cache = KVCache(k_codes, v_codes, k_scales, v_scales)
    for window in (None, 7):
        (ctx, written), kernels = layer(AttentionKernel("pallas", interpret=True, sms=8), window)
        assert kernels["decode_attention"] == hlo.FusedKernel(2, False, decode=True, window=window)
        (expected, expected_cache), _ = layer(AttentionKernel("xla"), window)
        np.testing.assert_allclose(ctx, expected, atol=2e-6)
        for name in ("keys", "values", "key_scales", "value_scales"):
            np.testing.assert_array_equal(getattr(written, name), getattr(expected_cache, name))


@pytest.mark.parametrize("kernel", [AttentionKernel("xla"), AttentionKernel("pallas", interpret=True, sms=8),
                                    AttentionKernel("pallas", interpret=True, sms=512)])  # fmt: skip
@pytest.mark.parametrize("window", [64, 24, 100])
def test_a_sliding_layers_ring_attends_as_the_whole_cache_does_over_its_window(kernel, window):
    # The ring (kv_cache.KVCache.ring) holds each sequence's last `window` positions, position t at place
    # t % window: a decode step writes its token at its place and attends over every place written, which
    # is what the whole cache gives over the window; the Pallas kernel reads the ring as it is (no window
    # to skip), in parts that fill 8 SMs or 512, over rings its blocks divide and do not (24, 100).
    rng = np.random.default_rng(2)
    keys, values = _cache(rng)
    layer = 1
    q_Bx1xHxK = jnp.asarray(rng.normal(size=(B, 1, H, K)), jnp.float32)
    k_Bx1xGxK, v_Bx1xGxK = (jnp.asarray(rng.normal(size=(B, 1, G, K)), jnp.float32) for _ in range(2))
    positions_Bx1 = jnp.asarray(POSITIONS)[:, None]
    places_BxW = POSITIONS[:, None] - (POSITIONS[:, None] - np.arange(window)) % window
    rows = np.arange(B)[:, None]
    ring = KVCache(*(x[:, rows, np.maximum(places_BxW, 0)] for x in (keys, values)))
    cache = KVCache(keys[:0], values[:0], ring=ring)  # Every layer slides: none in the stack.

    def attend(slot, kernel, window):
        return jax.jit(lambda *a: slot.attend(kernel, *a, window=window))(q_Bx1xHxK, k_Bx1xGxK, v_Bx1xGxK)

    whole = CacheSlot(KVCache(keys, values), layer, positions_Bx1, prefill=False)
    expected, _ = attend(whole, AttentionKernel("xla"), window)
    ringed = CacheSlot(cache, 0, positions_Bx1, prefill=False, ring=True, entry=layer)
    ctx, written = attend(ringed, kernel, window)
    np.testing.assert_allclose(ctx, expected, atol=2e-6)
    assert written.keys.shape[0] == 0 and written.ring.keys.shape == (LAYERS, B, window, G, K)
    np.testing.assert_array_equal(written.ring.keys[layer, np.arange(B), POSITIONS % window], k_Bx1xGxK[:, 0])
