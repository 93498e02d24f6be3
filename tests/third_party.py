"""Decoders written as a third party writes them (DeepMind's gemma, Hugging Face's Flax models): the blocks
are plain Flax modules, called in a Python loop, with no ``remat`` argument and no knowledge of shardmem.
``remat.modules`` is the only way remat reaches them (tests/test_user_models.py).

    build_linen(rngs)   # Linen: blocks named blocks_0 ... blocks_{n-1}, made inside an nn.compact call
    build_nnx(rngs)     # NNX: DecoderBlock instances in an nnx.List, at paths blocks/0 ... blocks/{n-1}
    build_linen_jit(rngs)  # Linen, its call wrapped in nn.jit as gemma's is: traced once per process
"""

import flax.linen as nn
import jax
import jax.numpy as jnp
from flax import nnx

VOCAB, D_MODEL, HEADS, D_FF, N_LAYERS, SEQ_LEN = 256, 64, 4, 256, 4, 128


class Block(nn.Module):
    """A pre-norm attention + MLP block; ``deterministic`` is a Python flag, as third-party blocks take."""

    d_model: int
    heads: int
    d_ff: int

    @nn.compact
    def __call__(self, x_BxLxD, deterministic: bool = True):
        b, length, _ = x_BxLxD.shape
        qkv = nn.DenseGeneral((3, self.heads, self.d_model // self.heads), use_bias=False, name="qkv")(
            nn.LayerNorm(use_bias=False)(x_BxLxD)
        )
        mask = nn.make_causal_mask(jnp.ones((b, length)))
        ctx = nn.dot_product_attention(qkv[:, :, 0], qkv[:, :, 1], qkv[:, :, 2], mask=mask)
        x_BxLxD = x_BxLxD + nn.DenseGeneral(self.d_model, axis=(-2, -1), use_bias=False, name="out")(ctx)
        h_BxLxD = nn.LayerNorm(use_bias=False)(x_BxLxD)
        h_BxLxF = nn.gelu(nn.Dense(self.d_ff, use_bias=False, name="up")(h_BxLxD))
        out_BxLxD = nn.Dense(self.d_model, name="down")(h_BxLxF)
        return x_BxLxD + nn.Dropout(0.1, deterministic=deterministic)(out_BxLxD)


class Decoder(nn.Module):
    @nn.compact
    def __call__(self, tokens_BxL):
        embed = nn.Embed(VOCAB, D_MODEL)
        x = embed(tokens_BxL)
        for i in range(N_LAYERS):
            x = Block(D_MODEL, HEADS, D_FF, name=f"blocks_{i}")(x, deterministic=True)
        return embed.attend(nn.LayerNorm(use_bias=False)(x))


def build_linen(rngs):
    from shardmem.models.linen import from_linen  # The only shardmem call: Flax's own bridge.

    return from_linen(Decoder(), jnp.zeros((1, SEQ_LEN), jnp.int32), rngs=rngs)


class JitDecoder(Decoder):
    """The same decoder, its call under ``nn.jit`` (as gemma's): Flax traces it once per process and
    shape, and reuses that trace whatever surrounds a later call."""

    @nn.jit
    def __call__(self, tokens_BxL):
        return super().__call__(tokens_BxL)


def build_linen_jit(rngs):
    from shardmem.models.linen import from_linen

    return from_linen(JitDecoder(), jnp.zeros((1, SEQ_LEN), jnp.int32), rngs=rngs)


class DecoderBlock(nnx.Module):
    def __init__(self, rngs):
        self.norm1 = nnx.LayerNorm(D_MODEL, use_bias=False, rngs=rngs)
        self.attention = nnx.MultiHeadAttention(HEADS, D_MODEL, use_bias=False, decode=False, rngs=rngs)
        self.norm2 = nnx.LayerNorm(D_MODEL, use_bias=False, rngs=rngs)
        self.up = nnx.Linear(D_MODEL, D_FF, use_bias=False, rngs=rngs)
        self.down = nnx.Linear(D_FF, D_MODEL, rngs=rngs)

    def __call__(self, x_BxLxD, deterministic: bool = True):
        mask = nnx.make_causal_mask(jnp.ones(x_BxLxD.shape[:2]))
        x_BxLxD = x_BxLxD + self.attention(self.norm1(x_BxLxD), mask=mask, deterministic=deterministic)
        return x_BxLxD + self.down(jax.nn.gelu(self.up(self.norm2(x_BxLxD))))


class NnxDecoder(nnx.Module):
    def __init__(self, rngs):
        self.embed = nnx.Embed(VOCAB, D_MODEL, rngs=rngs)
        self.blocks = nnx.List([DecoderBlock(rngs) for _ in range(N_LAYERS)])
        self.norm = nnx.LayerNorm(D_MODEL, use_bias=False, rngs=rngs)

    def __call__(self, tokens_BxL):
        x = self.embed(tokens_BxL)
        for block in self.blocks:
            x = block(x, deterministic=True)
        return self.embed.attend(self.norm(x))


def build_nnx(rngs):
    return NnxDecoder(rngs)
