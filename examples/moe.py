"""A mixture-of-experts language model of your own in Flax NNX: 8 experts, top-2 routing, the experts'
weights on an ``expert`` mesh axis. Planned and trained by shardmem from YAML.

    shardmem plan examples/moe.yaml --target h100-sxm
    shardmem train examples/moe.yaml --run-dir runs/moe

Routing is the dense formulation (every token's combine weights over all experts, zero outside its
top 2), which is exact and shards over the ``expert`` axis with no dispatch code; the loss adds the
Switch Transformer's load-balancing term and reports it as a metric.
"""

import jax
import jax.numpy as jnp
import numpy as np
import optax
from flax import nnx
from jax.ad_checkpoint import checkpoint_name

import shardmem


def _param(rngs, shape, axes, scale=None):
    init = nnx.initializers.normal(scale or shape[-2] ** -0.5 if len(shape) > 1 else 0.02)
    return nnx.Param(nnx.with_partitioning(init, axes)(rngs.params(), shape))


class MoEBlock(nnx.Module):
    def __init__(self, width, heads, experts, hidden, top_k, rngs):
        self.top_k = top_k
        self.heads = heads
        self.norm1 = nnx.RMSNorm(
            width, scale_init=nnx.with_partitioning(nnx.initializers.ones, ("norm",)), rngs=rngs
        )
        self.qkv = _param(rngs, (width, 3, heads, width // heads), ("embed", None, "heads", "head_dim"))
        self.out = _param(rngs, (heads, width // heads, width), ("heads", "head_dim", "embed"), width**-0.5)
        self.norm2 = nnx.RMSNorm(
            width, scale_init=nnx.with_partitioning(nnx.initializers.ones, ("norm",)), rngs=rngs
        )
        self.router = _param(rngs, (width, experts), ("embed", None))
        self.w_in = _param(rngs, (experts, width, hidden), ("expert", "embed", "mlp"))
        self.w_out = _param(rngs, (experts, hidden, width), ("expert", "mlp", "embed"))

    def __call__(self, carry):
        x_BxLxD, aux = carry
        h = self.norm1(x_BxLxD)
        qkv = checkpoint_name(jnp.einsum("bld,dthk->tblhk", h, self.qkv[...]), "qkv")
        ctx = jax.nn.dot_product_attention(qkv[0], qkv[1], qkv[2], is_causal=True)
        x_BxLxD = x_BxLxD + jnp.einsum("blhk,hkd->bld", ctx, self.out[...])

        h = self.norm2(x_BxLxD)
        probs_BxLxE = jax.nn.softmax(h @ self.router[...], axis=-1)
        top_BxLxK, chosen_BxLxK = jax.lax.top_k(probs_BxLxE, self.top_k)
        experts = probs_BxLxE.shape[-1]
        mask_BxLxE = jax.nn.one_hot(chosen_BxLxK, experts).sum(-2)
        combine_BxLxE = probs_BxLxE * mask_BxLxE / top_BxLxK.sum(-1, keepdims=True)
        hidden_BxLxExF = checkpoint_name(
            jax.nn.silu(jnp.einsum("bld,edf->blef", h, self.w_in[...])), "expert_hidden"
        )
        out_BxLxD = jnp.einsum("blef,efd,ble->bld", hidden_BxLxExF, self.w_out[...], combine_BxLxE)
        # Switch Transformer load balancing: experts x sum(fraction routed x mean router probability).
        balance = experts * jnp.sum(mask_BxLxE.mean((0, 1)) / self.top_k * probs_BxLxE.mean((0, 1)))
        return x_BxLxD + out_BxLxD, aux + balance


class MoE(nnx.Module):
    def __init__(self, rngs, remat, *, vocab=256, width=64, depth=2, heads=4, experts=8, hidden=128, top_k=2):
        self.remat = remat
        self.embed = _param(rngs, (vocab, width), ("vocab", "embed"), 0.02)

        @nnx.split_rngs(splits=depth)
        @nnx.vmap(in_axes=(0,), out_axes=0, transform_metadata={nnx.PARTITION_NAME: "layers"})
        def blocks(rngs):
            return MoEBlock(width, heads, experts, hidden, top_k, rngs)

        self.blocks = blocks(rngs)
        self.norm = nnx.RMSNorm(
            width, scale_init=nnx.with_partitioning(nnx.initializers.ones, ("norm",)), rngs=rngs
        )

    def __call__(self, tokens_BxL):
        x_BxLxD = self.embed[...][tokens_BxL]
        x_BxLxD, balance = shardmem.remat_scan(self.blocks, (x_BxLxD, jnp.zeros((), jnp.float32)), self.remat)
        return self.norm(x_BxLxD) @ self.embed[...].T, balance


def build(rngs, remat, **options):
    return MoE(rngs, remat, **options)


def loss(model, batch_BxL1):
    logits, balance = model(batch_BxL1[:, :-1])
    tokens = optax.softmax_cross_entropy_with_integer_labels(logits.astype(jnp.float32), batch_BxL1[:, 1:])
    return tokens.mean() + 0.01 * balance, {"load_balance": balance}


def batches(step, rows, seed, *, vocab=256, length=65):
    out = np.empty((len(rows), length), np.int32)
    for i, row in enumerate(rows):
        rng = np.random.default_rng((seed, step, row))
        out[i] = (rng.integers(0, vocab) + rng.choice([1, 2, 3]) * np.arange(length)) % vocab
    return out
