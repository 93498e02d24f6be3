"""A decoder of your own in Flax NNX that shardmem trains and serves: its cache-aware call runs prefill and
KV-cache decode (``shardmem generate``, ``shardmem plan --serve``).

    shardmem train examples/cached_decoder.yaml --run-dir runs/cached
    shardmem generate examples/cached_decoder.yaml --prompt-ids 5,8,11 --set finetune.init_from=runs/cached
    shardmem plan examples/cached_decoder.yaml --serve --target h100-sxm

Grouped-query attention with rotary positions and an optional sliding window. ``__call__`` is the training
forward; ``cached_call`` the same layers with a KV cache, each attention layer reading and writing it
through its :class:`shardmem.CacheSlot`; ``cache_layout`` says the cache's shape. The synthetic language
of :func:`batches` (``start + stride * i`` mod 256) is learned in a few hundred steps, after which greedy
generation continues a prompt's progression.
"""

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

import shardmem


def _param(rngs, shape, axes, fan_in):
    return nnx.Param(nnx.with_partitioning(nnx.initializers.normal(fan_in**-0.5), axes)(rngs.params(), shape))


def _norm(width, rngs):
    return nnx.RMSNorm(width, scale_init=nnx.with_partitioning(nnx.initializers.ones, ("norm",)), rngs=rngs)


def rope(x_BxLxHxK, positions):
    """Rotary position embedding at ``positions``: ``[L]`` (every sequence alike) or ``[B, L]``."""
    half = x_BxLxHxK.shape[-1] // 2
    frequencies = 10000.0 ** (-jnp.arange(half, dtype=jnp.float32) / half)
    angles = positions[..., None].astype(jnp.float32) * frequencies  # [L, K/2] or [B, L, K/2]
    cos, sin = jnp.cos(angles)[..., None, :], jnp.sin(angles)[..., None, :]  # Over the heads.
    x1, x2 = x_BxLxHxK[..., :half].astype(jnp.float32), x_BxLxHxK[..., half:].astype(jnp.float32)
    return jnp.concatenate([x1 * cos - x2 * sin, x2 * cos + x1 * sin], -1).astype(x_BxLxHxK.dtype)


class Block(nnx.Module):
    def __init__(self, width, heads, kv_heads, hidden, window, rngs):
        head_dim = width // heads
        self.window = window
        self.attn_norm, self.mlp_norm = _norm(width, rngs), _norm(width, rngs)
        self.wq = _param(rngs, (width, heads, head_dim), ("embed", "heads", "head_dim"), width)
        self.wk = _param(rngs, (width, kv_heads, head_dim), ("embed", "kv_heads", "head_dim"), width)
        self.wv = _param(rngs, (width, kv_heads, head_dim), ("embed", "kv_heads", "head_dim"), width)
        self.wo = _param(rngs, (heads, head_dim, width), ("heads", "head_dim", "embed"), width)
        self.w_in = _param(rngs, (width, hidden), ("embed", "mlp"), width)
        self.w_out = _param(rngs, (hidden, width), ("mlp", "embed"), hidden)

    def __call__(self, x_BxLxD, slot: shardmem.CacheSlot | None = None):
        """The layer's output; with a cache ``slot`` (serving), ``(output, cache)``."""
        h_BxLxD = self.attn_norm(x_BxLxD)
        q_BxLxHxK = jnp.einsum("bld,dhk->blhk", h_BxLxD, self.wq[...])
        k_BxLxGxK = jnp.einsum("bld,dgk->blgk", h_BxLxD, self.wk[...])
        v_BxLxGxK = jnp.einsum("bld,dgk->blgk", h_BxLxD, self.wv[...])
        positions = jnp.arange(x_BxLxD.shape[1]) if slot is None else slot.positions
        q_BxLxHxK, k_BxLxGxK = rope(q_BxLxHxK, positions), rope(k_BxLxGxK, positions)
        if slot is None:
            local = None if self.window is None else (self.window - 1, 0)  # Itself and window - 1 before.
            ctx_BxLxHxK = jax.nn.dot_product_attention(q_BxLxHxK, k_BxLxGxK, v_BxLxGxK, is_causal=True,
                                                       local_window_size=local)  # fmt: skip
        else:  # XLA's attention over the prompt (prefill) or the cache (decode): kernel None.
            ctx_BxLxHxK, cache = slot.attend(None, q_BxLxHxK, k_BxLxGxK, v_BxLxGxK, window=self.window)
        x_BxLxD = x_BxLxD + jnp.einsum("blhk,hkd->bld", ctx_BxLxHxK, self.wo[...])
        x_BxLxD = x_BxLxD + jax.nn.silu(self.mlp_norm(x_BxLxD) @ self.w_in[...]) @ self.w_out[...]
        return x_BxLxD if slot is None else (x_BxLxD, cache)


class CachedDecoder(nnx.Module):
    def __init__(self, rngs, *, vocab=256, width=64, depth=2, heads=4, kv_heads=2, hidden=128, window=None):
        self.embed = _param(rngs, (vocab, width), ("vocab", "embed"), 1)
        self.blocks = nnx.List([Block(width, heads, kv_heads, hidden, window, rngs) for _ in range(depth)])
        self.norm = _norm(width, rngs)
        self.head = _param(rngs, (width, vocab), ("embed", "vocab"), width)
        self.kv_heads, self.head_dim, self.window = kv_heads, width // heads, window

    def __call__(self, tokens_BxL):
        """The training forward: logits ``[B, L, vocab]``."""
        x_BxLxD = self.embed[...][tokens_BxL]
        for block in self.blocks:
            x_BxLxD = block(x_BxLxD)
        return self.norm(x_BxLxD) @ self.head[...]

    def cache_layout(self) -> shardmem.CacheLayout:
        """The KV cache's shape: one layer per block, its KV heads and head size, the window."""
        return shardmem.CacheLayout(layers=len(self.blocks), kv_heads=self.kv_heads, head_dim=self.head_dim,
                                    window=self.window)  # fmt: skip

    def cached_call(self, tokens_BxL, cache, positions, *, prefill, logits_at=None):
        """The same forward with a KV cache: ``(logits_BxLxV, cache)``; positions ``[L]`` in a prefill,
        ``[B, 1]`` in a decode step. A prefill's ``logits_at`` (``[B]``, each prompt's last token) keeps
        those positions' logits only (``L`` = 1): the head's matmul and the logits of a long prompt's
        every position are not computed."""
        x_BxLxD = self.embed[...][tokens_BxL]
        for layer, block in enumerate(self.blocks):
            x_BxLxD, cache = block(x_BxLxD, shardmem.CacheSlot(cache, layer, positions, prefill))
        if logits_at is not None:
            x_BxLxD = jnp.take_along_axis(x_BxLxD, logits_at[:, None, None], axis=1)
        return self.norm(x_BxLxD) @ self.head[...], cache


def build(rngs, **options):
    return CachedDecoder(rngs, **options)


def batches(step, rows, seed, *, vocab=256, length=65):
    """Token rows ``start + stride * i`` (mod 256), the same for a given (seed, step, row) in any process."""
    out = np.empty((len(rows), length), np.int32)
    for i, row in enumerate(rows):
        rng = np.random.default_rng((seed, step, row))
        out[i] = (rng.integers(0, vocab) + rng.choice([1, 2, 3]) * np.arange(length)) % vocab
    return out
