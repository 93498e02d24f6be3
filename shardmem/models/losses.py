"""Next-token cross-entropy, whole or in chunks of the vocabulary so that the fp32 logits are never all live.

    loss = next_token_loss(model, batch_BxL1)       # chunked when the model says so (model.loss_chunk)
    loss = chunked_cross_entropy(h_BxLxD, head_DxV, targets_BxL, chunk=8192)

With a vocabulary of 128,256 tokens the logits of one sequence of 2,048 positions take 1 GiB in fp32,
more than anything else a layer keeps, and the unchunked backward keeps their fp32 gradient too.
:func:`chunked_cross_entropy` computes the loss over ``chunk`` vocabulary entries at a time, with a
backward pass of its own (the approach of Liger Kernel and of Cut Cross-Entropy, Wijmans et al. 2024):

- forward: a ``lax.scan`` over the chunks keeps a running log-sum-exp per position and picks out the
  target's logit, so only ``B x L x chunk`` logits exist at once;
- backward: a second scan recomputes each chunk's logits, turns them into ``softmax - onehot``, adds their
  product with the head's rows into ``dhidden`` and emits the head's gradient rows for that chunk, already
  sharded as the head is -- one reduce-scatter per chunk, so no full-vocabulary gradient is ever gathered.

The cost is one extra unembedding matmul (the logits are computed twice). Chunk ``j`` holds the vocabulary
entries ``j, j + N, j + 2N, ...`` (``N`` chunks): interleaved, so each chunk keeps the head's sharding over
the vocabulary and no chunk needs rows from another device.

``model.loss_chunk`` says how: an int is the chunk (in vocabulary entries; the largest divisor of the
vocabulary not above it, or, when that is under half of it, the vocabulary padded with masked entries);
``null`` or ``0`` turns chunking off; ``auto`` (the default) uses chunks of :data:`AUTO_CHUNK` entries when
the vocabulary has more than 4 x ``d_model`` entries -- the fp32 logits are then more than 8 x the bf16
hidden states they come from -- and no chunking otherwise.
"""

from __future__ import annotations

import functools
import math

import jax
import jax.numpy as jnp
import optax

from shardmem.models.attention import soft_cap
from shardmem.parallel import context
from shardmem.parallel.rules import constrain

#: Vocabulary entries per chunk of ``model.loss_chunk: auto``.
AUTO_CHUNK = 8192


def resolve_loss_chunk(loss_chunk: int | str | None, vocab_size: int, d_model: int) -> int | None:
    """Returns the chunk (vocabulary entries) that ``model.loss_chunk`` means, or None (off)."""
    if loss_chunk == "auto":
        return AUTO_CHUNK if vocab_size > 4 * d_model else None
    return int(loss_chunk) if loss_chunk else None


def next_token_loss(model, batch_BxL1: jax.Array) -> jax.Array:
    """Mean cross-entropy of predicting ``batch[:, 1:]`` from ``batch[:, :-1]``; over chunks of the
    vocabulary when the model has a ``loss_chunk`` (and ``hidden_states``/``unembedding``, as the
    reference model)."""
    inputs_BxL, targets_BxL = batch_BxL1[:, :-1], batch_BxL1[:, 1:]
    if context.split_by_hand():  # The model returns a device's own chunks of the sequence: their loss.
        targets_BxL = context.own_chunks(targets_BxL)
    pipeline = getattr(model, "pipeline", None)
    if pipeline is not None and pipeline.runs_loss:  # 1F1B: the last stage runs the loss.
        return model.pipelined_loss(inputs_BxL, targets_BxL)
    chunk = getattr(model, "loss_chunk", None)
    if chunk and hasattr(model, "hidden_states"):
        return cross_entropy(model.hidden_states(inputs_BxL), model.unembedding(), targets_BxL, chunk,
                             softcap=getattr(model, "logit_softcap", None))  # fmt: skip
    logits_BxLxV = model(inputs_BxL)
    losses_BxL = optax.softmax_cross_entropy_with_integer_labels(
        logits_BxLxV.astype(jnp.float32), targets_BxL
    )
    return losses_BxL.mean()


def cross_entropy(hidden_BxLxD, head_DxV, targets_BxL, chunk: int | None, *,
                  softcap: float | None = None) -> jax.Array:  # fmt: skip
    """Mean cross-entropy of ``softmax(hidden @ head)`` against ``targets``: over ``chunk`` vocabulary
    entries at a time when ``chunk`` is smaller than the vocabulary, else from the whole logits; the
    logits soft-capped at ``softcap`` (:func:`~shardmem.models.attention.soft_cap`) when given."""
    if chunk and chunk < head_DxV.shape[1]:
        return chunked_cross_entropy(hidden_BxLxD, head_DxV, targets_BxL, chunk=chunk, softcap=softcap)
    logits_BxLxV = constrain(hidden_BxLxD @ head_DxV, ("batch", "seq", "vocab"))
    logits_BxLxV = soft_cap(logits_BxLxV.astype(jnp.float32), softcap)
    # The target's logit as a masked sum, as the chunked loss takes it (optax gathers it: over a vocabulary
    # split across devices inside the 1F1B pipeline's shard_map, XLA's partitioner aborts on that gather).
    hit_BxLxV = targets_BxL[..., None] == jnp.arange(logits_BxLxV.shape[-1])
    target_BxL = jnp.where(hit_BxLxV, logits_BxLxV, 0.0).sum(axis=-1)
    return (jax.nn.logsumexp(logits_BxLxV, axis=-1) - target_BxL).mean()


def chunked_cross_entropy(hidden_BxLxD, head_DxV, targets_BxL, *, chunk: int,
                          softcap: float | None = None) -> jax.Array:  # fmt: skip
    """Mean cross-entropy of ``softmax(hidden @ head)`` against ``targets``, over ``chunk`` vocabulary
    entries at a time, forward and backward (see the module docstring); the logits soft-capped at
    ``softcap`` when given."""
    b, length, _ = hidden_BxLxD.shape
    vocab = head_DxV.shape[1]
    n_chunks = _chunks(vocab, chunk)
    head_VxD = head_DxV.T
    padded = n_chunks * math.ceil(vocab / n_chunks)
    if padded > vocab:  # Masked in the loss: their logits are set to -inf.
        head_VxD = jnp.pad(head_VxD, ((0, padded - vocab), (0, 0)))
    # Row v of the head goes to chunk v % N, at index v // N: the chunks are interleaved.
    head_CxNxD = head_VxD.reshape(padded // n_chunks, n_chunks, -1)
    with jax.named_scope("loss"):
        total = _chunked_loss_sum(hidden_BxLxD, head_CxNxD, targets_BxL, vocab, softcap)
    return total / (b * length)


@functools.partial(jax.custom_vjp, nondiff_argnums=(3, 4))
def _chunked_loss_sum(hidden_BxLxD, head_CxNxD, targets_BxL, vocab, cap):
    return _forward(hidden_BxLxD, head_CxNxD, targets_BxL, vocab, cap)[0]


def _chunk_logits(hidden_BxLxD, head_CxNxD, j, vocab, cap):
    """Logits (fp32, soft-capped at ``cap`` when given) of chunk ``j`` of the vocabulary; padding entries
    are -inf."""
    rows_CxD = constrain(head_CxNxD[:, j], ("vocab", "embed"))
    logits_BxLxC = constrain(jnp.einsum("bld,cd->blc", hidden_BxLxD, rows_CxD), ("batch", "seq", "vocab"))
    ids_C = jnp.arange(head_CxNxD.shape[0]) * head_CxNxD.shape[1] + j
    return jnp.where(ids_C < vocab, soft_cap(logits_BxLxC.astype(jnp.float32), cap), -jnp.inf)


def _forward(hidden_BxLxD, head_CxNxD, targets_BxL, vocab, cap):
    n_chunks = head_CxNxD.shape[1]
    row_BxL, chunk_BxL = targets_BxL // n_chunks, targets_BxL % n_chunks

    def body(carry, j):
        max_BxL, sum_BxL, target_BxL = carry
        logits_BxLxC = _chunk_logits(hidden_BxLxD, head_CxNxD, j, vocab, cap)
        new_max_BxL = jnp.maximum(max_BxL, logits_BxLxC.max(axis=-1))
        sum_BxL = sum_BxL * jnp.exp(max_BxL - new_max_BxL) + jnp.exp(
            logits_BxLxC - new_max_BxL[..., None]
        ).sum(axis=-1)
        # A masked sum, not take_along_axis: over a vocabulary split across devices it is a local sum and
        # an all-reduce of [B, L], where XLA partitions the gather as an all-to-all of the logits (inside
        # the per-group vmap of shardmem.program.accumulation, over the batch's devices: 131 MB a micro-batch
        # and layer of Nemotron-4 15B, across hosts).
        hit_BxLxC = row_BxL[..., None] == jnp.arange(logits_BxLxC.shape[-1])
        picked_BxL = jnp.where(hit_BxLxC, logits_BxLxC, 0.0).sum(axis=-1)
        target_BxL = jnp.where(chunk_BxL == j, picked_BxL, target_BxL)
        return (new_max_BxL, sum_BxL, target_BxL), None

    shape = targets_BxL.shape
    start = (jnp.full(shape, -jnp.inf), jnp.zeros(shape), jnp.zeros(shape))
    (max_BxL, sum_BxL, target_BxL), _ = jax.lax.scan(body, start, jnp.arange(n_chunks))
    lse_BxL = max_BxL + jnp.log(sum_BxL)
    return (lse_BxL - target_BxL).sum(), (hidden_BxLxD, head_CxNxD, targets_BxL, lse_BxL)


def _backward(vocab, cap, residuals, grad):
    hidden_BxLxD, head_CxNxD, targets_BxL, lse_BxL = residuals
    n_chunks = head_CxNxD.shape[1]
    row_BxL, chunk_BxL = targets_BxL // n_chunks, targets_BxL % n_chunks
    dtype = hidden_BxLxD.dtype

    def body(dhidden_BxLxD, j):
        logits_BxLxC = _chunk_logits(hidden_BxLxD, head_CxNxD, j, vocab, cap)
        probs_BxLxC = jnp.exp(logits_BxLxC - lse_BxL[..., None])
        target_BxLxC = (row_BxL[..., None] == jnp.arange(probs_BxLxC.shape[-1])) & (chunk_BxL == j)[..., None]
        dlogits_BxLxC = (probs_BxLxC - target_BxLxC) * grad
        if cap is not None:  # d(cap * tanh(x / cap)) / dx = 1 - tanh(x / cap) ** 2; padding: 0.
            capped_BxLxC = jnp.where(jnp.isfinite(logits_BxLxC), logits_BxLxC / cap, 0.0)
            dlogits_BxLxC = dlogits_BxLxC * (1 - capped_BxLxC * capped_BxLxC)
        dlogits_BxLxC = dlogits_BxLxC.astype(dtype)
        rows_CxD = constrain(head_CxNxD[:, j], ("vocab", "embed"))
        dhidden_BxLxD = dhidden_BxLxD + jnp.einsum(
            "blc,cd->bld", dlogits_BxLxC, rows_CxD, preferred_element_type=jnp.float32
        )
        drows_CxD = jnp.einsum("blc,bld->cd", dlogits_BxLxC, hidden_BxLxD, preferred_element_type=jnp.float32)
        return dhidden_BxLxD, constrain(drows_CxD.astype(head_CxNxD.dtype), ("vocab", "embed"))

    start = constrain(jnp.zeros(hidden_BxLxD.shape, jnp.float32), ("batch", "seq", None))
    dhidden_BxLxD, drows_NxCxD = jax.lax.scan(body, start, jnp.arange(n_chunks))
    dhead_CxNxD = drows_NxCxD.swapaxes(0, 1)
    return dhidden_BxLxD.astype(dtype), dhead_CxNxD, None


_chunked_loss_sum.defvjp(lambda h, w, t, vocab, cap: _forward(h, w, t, vocab, cap), _backward)


def _chunks(vocab: int, chunk: int) -> int:
    """How many chunks of at most ``chunk`` entries: a divisor of ``vocab`` when one gives chunks of at
    least half of ``chunk``; otherwise the vocabulary is padded to whole chunks."""
    fit = max(c for c in range(1, min(chunk, vocab) + 1) if vocab % c == 0)
    return vocab // fit if 2 * fit >= min(chunk, vocab) else math.ceil(vocab / chunk)
