"""A Flax Linen decoder (nn.scan + nn.remat + logical partitioning) trained by shardmem from YAML.

    shardmem plan examples/linen_decoder.yaml --target h100-sxm
    shardmem train examples/linen_decoder.yaml --run-dir runs/linen

The blocks come from :class:`shardmem.models.linen.RematLayers`, so ``remat.policy`` and
``remat.layers`` apply per layer; the loss is shardmem's next-token cross-entropy on token rows.
"""

import flax.linen as nn
import jax
import jax.numpy as jnp
from jax.ad_checkpoint import checkpoint_name

from shardmem.models.linen import RematLayers, from_linen


def _dense(features, axes, name, **kw):
    init = nn.with_logical_partitioning(nn.initializers.lecun_normal(), axes)
    return nn.DenseGeneral(features, kernel_init=init, use_bias=False, name=name, **kw)


class Block(nn.Module):
    d_model: int
    heads: int
    d_ff: int
    dropout: float = 0.0

    @nn.compact
    def __call__(self, x_BxLxD):
        b, length, d = x_BxLxD.shape
        k = d // self.heads
        h = nn.LayerNorm(
            use_bias=False, scale_init=nn.with_logical_partitioning(nn.initializers.ones, ("norm",))
        )(x_BxLxD)
        qkv = _dense((3, self.heads, k), ("embed", None, "heads", "head_dim"), "qkv")(h)
        qkv = checkpoint_name(qkv, "qkv")
        q, kk, v = qkv[:, :, 0], qkv[:, :, 1], qkv[:, :, 2]
        mask = nn.make_causal_mask(jnp.ones((b, length)))
        ctx = nn.dot_product_attention(q, kk, v, mask=mask)
        out = _dense(d, ("heads", "head_dim", "embed"), "out", axis=(-2, -1))(ctx)
        x_BxLxD = x_BxLxD + nn.Dropout(self.dropout, deterministic=False)(out)
        h = nn.LayerNorm(
            use_bias=False, scale_init=nn.with_logical_partitioning(nn.initializers.ones, ("norm",))
        )(x_BxLxD)
        up = checkpoint_name(jax.nn.gelu(_dense(self.d_ff, ("embed", "mlp"), "up")(h)), "mlp_up")
        return x_BxLxD + _dense(d, ("mlp", "embed"), "down")(up)


class Decoder(nn.Module):
    vocab: int
    d_model: int
    layers: nn.Module

    @nn.compact
    def __call__(self, tokens_BxL):
        embed = nn.Embed(
            self.vocab,
            self.d_model,
            embedding_init=nn.with_logical_partitioning(nn.initializers.normal(0.02), ("vocab", "embed")),
        )
        x = self.layers(embed(tokens_BxL))
        norm = nn.LayerNorm(
            use_bias=False, scale_init=nn.with_logical_partitioning(nn.initializers.ones, ("norm",))
        )
        return embed.attend(norm(x))


def build(rngs, remat, *, vocab=256, d_model=64, heads=4, d_ff=256, n_layers=4, seq_len=64, dropout=0.1):
    layers = RematLayers(
        Block, remat, n_layers, dict(d_model=d_model, heads=heads, d_ff=d_ff, dropout=dropout)
    )
    decoder = Decoder(vocab, d_model, layers)
    return from_linen(decoder, jnp.zeros((1, seq_len), jnp.int32), rngs=rngs)


def batches(step, rows, seed):
    """Token rows ``start + stride * i (mod 256)``: a learnable synthetic language, the same for a given
    (seed, step, row) whichever process asks."""
    import numpy as np

    out = np.empty((len(rows), 65), np.int32)
    for i, row in enumerate(rows):
        rng = np.random.default_rng((seed, step, row))
        out[i] = (rng.integers(0, 256) + rng.choice([1, 2, 3]) * np.arange(65)) % 256
    return out
