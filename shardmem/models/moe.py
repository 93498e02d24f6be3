"""A mixture-of-experts SwiGLU feed-forward with top-k routing, a capacity factor and expert parallelism.

    moe = MoEFeedForward(d_model=64, d_ff=64, n_experts=8, rngs=nnx.Rngs(0))
    y_BxLxD = moe(x_BxLxD)          # each token's top-2 experts, weighted by their renormalised gates

The reference decoder uses it in place of the dense MLP when ``model.n_experts > 0`` (the ``mixtral-8x7b``
and ``tiny-moe`` presets). The expert weights carry a logical ``expert`` axis (``layers/moe/w_up`` is
``[layers, expert, embed, mlp]``), which the default rule ``expert: expert`` puts on an ``expert`` mesh axis.

**Routing** (Mixtral): a linear router gives one logit per expert; each token goes to its
``experts_per_token`` highest-scoring experts with gates that are the softmax over those chosen logits.
**Capacity** (GShard, Switch, MaxText's dropping path): tokens are routed within groups (one group per
sequence), and each expert takes at most ``capacity = ceil(experts_per_token * capacity_factor * seq_len /
n_experts)`` tokens of a group; an assignment past that is dropped (the token keeps only its residual, or
its other expert). Slots fill in sequence order, so whether a token is dropped depends only on the tokens
before it and the model stays causal. **Load balancing** (Switch): ``n_experts * sum_e f_e * p_e``, with
``f_e`` the fraction of assignments and ``p_e`` the mean router probability of expert ``e``, is 1 when
routing is uniform; its gradient, times ``load_balance_weight``, is added in the backward pass
(as Megatron's ``MoEAuxLossAutoScaler``), so the model's call signature and the reported loss -- the
cross-entropy -- stay those of the dense model.

**Expert parallelism** is left to XLA's SPMD partitioner, with sharding constraints rather than a
``shard_map``: tokens are dispatched into per-expert slots with a one-hot einsum, giving ``x_ExGxCxD`` whose
group axis is still sharded like the batch; constraining it to ``("expert", "batch", ...)`` moves the expert
axis of the mesh from the groups to the experts, which XLA compiles into one all-to-all over that axis (the
batch rule defaults to ``[data, fsdp, expert]``, and a mesh axis is used once per array, so the groups stay
sharded over data and FSDP). Both layouts are pinned (:data:`GROUPED_AXES` where the einsum makes the
tensor, then :data:`DISPATCHED_AXES`): given only the second, XLA moved the dispatch mask instead and
all-gathered every token over the expert axis. The experts' outputs come back by the same move in reverse.
Top-k is taken as k argmaxes, which stay on each device's tokens where ``lax.top_k`` made XLA gather the
whole batch. The constraints keep the layer one global-view function -- the same code on one device or 64,
differentiable, remat-able and plannable deviceless -- and lets the planner report the all-to-all bytes. The
price of the one-hot dispatch and combine is two matmuls of ``seq_len x n_experts x capacity x d_model`` per
group (a fifth of the experts' FLOPs at Mixtral's sizes) and a ``[seq_len, n_experts, capacity]`` mask per
group, the same trade MaxText's dropping path makes.

The experts' projections are tagged ``mlp_gate``, ``mlp_up`` and ``mlp_out`` like the dense MLP's, so every
remat policy means the same thing for both.
"""

from __future__ import annotations

import functools
import math

import jax
import jax.numpy as jnp
from flax import nnx
from jax.ad_checkpoint import checkpoint_name

from shardmem.finetune.lora import value_of, weight
from shardmem.parallel.rules import constrain

#: Logical axes of the dispatched tokens: experts on the expert mesh axis, groups on the rest of the batch's.
DISPATCHED_AXES = ("expert", "batch", None, None)
#: The same tensor where it is made and consumed: groups on all the batch's axes, every expert local.
GROUPED_AXES = (None, "batch", None, None)


def expert_capacity(
    tokens_per_group: int, n_experts: int, experts_per_token: int, capacity_factor: float
) -> int:
    """Returns how many tokens of one group each expert takes: the balanced share times the factor,
    at least 1 and at most the group (a token picks an expert once)."""
    balanced = experts_per_token * tokens_per_group / n_experts
    return max(1, min(tokens_per_group, math.ceil(balanced * capacity_factor)))


def route(logits_GxSxE, experts_per_token: int, capacity: int):
    """Returns ``(combine_GxSxExC, dispatch_GxSxExC, balance_loss)`` for router logits.

    ``dispatch[g, s, e, c]`` is 1 where token ``s`` of group ``g`` fills slot ``c`` of expert ``e``;
    ``combine`` holds the token's gate there instead. Assignments past ``capacity`` are dropped.
    """
    groups, tokens, n_experts = logits_GxSxE.shape
    logits_GxSxE = logits_GxSxE.astype(jnp.float32)
    top_GxSxK, chosen_GxSxK = _top_k(logits_GxSxE, experts_per_token)
    gates_GxSxK = jax.nn.softmax(top_GxSxK, axis=-1)
    chosen_GxSxKxE = jax.nn.one_hot(chosen_GxSxK, n_experts, dtype=jnp.int32)
    # Slots fill token by token (each token's choices in rank order): a token's slot counts only
    # earlier assignments, so dropping never looks ahead in the sequence.
    in_order_GxTxE = chosen_GxSxKxE.reshape(groups, tokens * experts_per_token, n_experts)
    slot_GxTxE = jnp.cumsum(in_order_GxTxE, axis=1) - 1
    slot_GxSxK = (slot_GxTxE.reshape(chosen_GxSxKxE.shape) * chosen_GxSxKxE).sum(-1)
    slot_GxSxKxC = jax.nn.one_hot(slot_GxSxK, capacity, dtype=jnp.float32)  # All zero past capacity.
    chosen_f_GxSxKxE = chosen_GxSxKxE.astype(jnp.float32)
    dispatch_GxSxExC = jnp.einsum("gske,gskc->gsec", chosen_f_GxSxKxE, slot_GxSxKxC)
    combine_GxSxExC = jnp.einsum("gske,gskc,gsk->gsec", chosen_f_GxSxKxE, slot_GxSxKxC, gates_GxSxK)

    assigned_E = chosen_f_GxSxKxE.sum(2).mean((0, 1)) / experts_per_token
    mean_prob_E = jax.nn.softmax(logits_GxSxE, axis=-1).mean((0, 1))
    balance_loss = n_experts * jnp.sum(assigned_E * mean_prob_E)
    return combine_GxSxExC, dispatch_GxSxExC, balance_loss


def _top_k(x_GxSxE, k: int):
    """``jax.lax.top_k`` on the last axis as k argmaxes: XLA's SPMD partitioner gathers the whole
    batch for a top-k op, but keeps a reduction on each device's own tokens (k is 1 or 2 here)."""
    values, indices = [], []
    for _ in range(k):
        index_GxS = jnp.argmax(x_GxSxE, axis=-1)
        values.append(jnp.max(x_GxSxE, axis=-1))
        indices.append(index_GxS)
        x_GxSxE = jnp.where(jax.nn.one_hot(index_GxS, x_GxSxE.shape[-1], dtype=bool), -jnp.inf, x_GxSxE)
    return jnp.stack(values, -1), jnp.stack(indices, -1).astype(jnp.int32)


@functools.partial(jax.custom_vjp, nondiff_argnums=(2,))
def add_loss_gradient(x, loss, weight: float):
    """Returns ``x``; in the backward pass ``loss`` gets the cotangent ``weight``, as if ``weight * loss``
    had been added to the objective."""
    return x


def _add_loss_gradient_fwd(x, loss, weight):
    return x, jnp.zeros((), loss.dtype)


def _add_loss_gradient_bwd(weight, zero, cotangent):
    return cotangent, zero + weight


add_loss_gradient.defvjp(_add_loss_gradient_fwd, _add_loss_gradient_bwd)


def _param(rngs: nnx.Rngs, shape: tuple[int, ...], axes: tuple[str | None, ...], dtype, fan_in: int):
    init = nnx.with_partitioning(nnx.initializers.truncated_normal(1.0 / math.sqrt(fan_in)), axes)
    return nnx.Param(init(rngs.params(), shape, dtype))


class MoEFeedForward(nnx.Module):
    """Top-k routed SwiGLU experts with a capacity factor; see the module docstring."""

    def __init__(
        self,
        d_model: int,
        d_ff: int,
        n_experts: int,
        *,
        rngs: nnx.Rngs,
        experts_per_token: int = 2,
        capacity_factor: float = 1.25,
        load_balance_weight: float = 0.01,
        param_dtype=jnp.float32,
        compute_dtype=jnp.bfloat16,
    ):
        d, f, e = d_model, d_ff, n_experts
        self.experts_per_token = experts_per_token
        self.capacity_factor = capacity_factor
        self.load_balance_weight = load_balance_weight
        self.compute_dtype = compute_dtype
        # The router's expert dimension stays whole: every token scores every expert.
        self.router = _param(rngs, (d, e), ("embed", None), param_dtype, d)
        self.w_gate = _param(rngs, (e, d, f), ("expert", "embed", "mlp"), param_dtype, d)
        self.w_up = _param(rngs, (e, d, f), ("expert", "embed", "mlp"), param_dtype, d)
        self.w_down = _param(rngs, (e, f, d), ("expert", "mlp", "embed"), param_dtype, f)

    def __call__(self, x_BxLxD):
        out_BxLxD, balance_loss = self.forward(x_BxLxD)
        if self.load_balance_weight:
            out_BxLxD = add_loss_gradient(out_BxLxD, balance_loss, self.load_balance_weight)
        return out_BxLxD

    def forward(self, x_GxSxD):
        """Returns the layer's output and its load-balancing loss (groups are the batch's sequences)."""
        dtype = self.compute_dtype
        n_experts = self.router.shape[-1]
        capacity = expert_capacity(x_GxSxD.shape[1], n_experts, self.experts_per_token, self.capacity_factor)
        with jax.named_scope("router"):
            logits_GxSxE = jnp.einsum("gsd,de->gse", x_GxSxD.astype(jnp.float32),
                                      weight(value_of(self.router), jnp.float32))  # fmt: skip
            combine_GxSxExC, dispatch_GxSxExC, balance_loss = route(logits_GxSxE, self.experts_per_token,
                                                                    capacity)  # fmt: skip
        with jax.named_scope("dispatch"):
            # Pinning both layouts makes XLA move the tokens (not the mask, nor all the groups).
            x_ExGxCxD = jnp.einsum("gsec,gsd->egcd", dispatch_GxSxExC.astype(dtype), x_GxSxD.astype(dtype))
            x_ExGxCxD = constrain(constrain(x_ExGxCxD, GROUPED_AXES), DISPATCHED_AXES)  # The all-to-all.
        with jax.named_scope("experts"):
            hidden = ("expert", "batch", None, "mlp")
            w_gate, w_up = weight(value_of(self.w_gate), dtype), weight(value_of(self.w_up), dtype)
            gate_ExGxCxF = constrain(jnp.einsum("egcd,edf->egcf", x_ExGxCxD, w_gate), hidden)
            up_ExGxCxF = constrain(jnp.einsum("egcd,edf->egcf", x_ExGxCxD, w_up), hidden)
            gate_ExGxCxF = checkpoint_name(gate_ExGxCxF, "mlp_gate")
            up_ExGxCxF = checkpoint_name(up_ExGxCxF, "mlp_up")
            act_ExGxCxF = jax.nn.silu(gate_ExGxCxF) * up_ExGxCxF
            out_ExGxCxD = jnp.einsum("egcf,efd->egcd", act_ExGxCxF, weight(value_of(self.w_down), dtype))
            out_ExGxCxD = checkpoint_name(constrain(out_ExGxCxD, DISPATCHED_AXES), "mlp_out")
        with jax.named_scope("combine"):
            out_ExGxCxD = constrain(out_ExGxCxD, GROUPED_AXES)  # The all-to-all back.
            out_GxSxD = jnp.einsum("egcd,gsec->gsd", out_ExGxCxD, combine_GxSxExC.astype(dtype))
            out_GxSxD = constrain(out_GxSxD, ("batch", "seq", None))
        return out_GxSxD, balance_loss
