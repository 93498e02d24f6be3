"""Next-token cross-entropy, whole or in chunks of positions so that the fp32 logits are never all live.

    loss = next_token_loss(model, batch_BxL1)       # chunked when the model says so (model.loss_chunk)
    loss = chunked_cross_entropy(h_BxLxD, head_DxV, targets_BxL, chunk=512)

With a vocabulary of 128,256 tokens the logits of one sequence of 2,048 positions take 1 GiB in fp32,
more than anything else a layer keeps. :func:`chunked_cross_entropy` computes the loss ``chunk`` positions
at a time in a ``lax.scan`` whose body is rematerialized: each chunk's logits are recomputed in the
backward pass, so only ``B x chunk x V`` of them are live at once, for one extra unembedding matmul.

``model.loss_chunk`` says how: an int is the chunk (in positions; the largest divisor of the length not
above it is used); ``null`` or ``0`` turns chunking off; ``auto`` (the default) uses chunks of
:data:`AUTO_CHUNK` positions when the vocabulary has more than 4 x ``d_model`` entries -- the fp32 logits
are then more than 8 x the bf16 hidden states they come from -- and no chunking otherwise.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import optax

from shardmem.parallel import context
from shardmem.parallel.rules import constrain

#: Positions per chunk of ``model.loss_chunk: auto``.
AUTO_CHUNK = 512


def resolve_loss_chunk(loss_chunk: int | str | None, vocab_size: int, d_model: int) -> int | None:
    """Returns the chunk (positions) that ``model.loss_chunk`` means for this vocabulary, or None (off)."""
    if loss_chunk == "auto":
        return AUTO_CHUNK if vocab_size > 4 * d_model else None
    return int(loss_chunk) if loss_chunk else None


def next_token_loss(model, batch_BxL1: jax.Array) -> jax.Array:
    """Mean cross-entropy of predicting ``batch[:, 1:]`` from ``batch[:, :-1]``; in chunks of positions
    when the model has a ``loss_chunk`` (and ``hidden_states``/``unembedding``, as the reference model)."""
    inputs_BxL, targets_BxL = batch_BxL1[:, :-1], batch_BxL1[:, 1:]
    chunk = _fit(getattr(model, "loss_chunk", None), inputs_BxL.shape[1] // context.shards())
    if chunk and hasattr(model, "hidden_states"):
        return chunked_cross_entropy(model.hidden_states(inputs_BxL), model.unembedding(), targets_BxL,
                                     chunk=chunk)  # fmt: skip
    logits_BxLxV = model(inputs_BxL)
    losses_BxL = optax.softmax_cross_entropy_with_integer_labels(
        logits_BxLxV.astype(jnp.float32), targets_BxL
    )
    return losses_BxL.mean()


def chunked_cross_entropy(hidden_BxLxD, head_DxV, targets_BxL, *, chunk: int) -> jax.Array:
    """Mean cross-entropy of ``softmax(hidden @ head)`` against ``targets``, ``chunk`` positions at a
    time, each chunk's logits recomputed in the backward pass. ``chunk`` must divide L (with the sequence
    split over ``context`` devices, L / context: each step takes ``chunk`` positions of every device's
    part of the sequence, so no device waits for another's)."""
    b, length, d = hidden_BxLxD.shape
    shards = context.shards()
    if shards > 1:
        return _split_cross_entropy(hidden_BxLxD, head_DxV, targets_BxL, chunk=chunk, shards=shards)
    blocks = length // chunk
    h_NxBxCxD = hidden_BxLxD.reshape(b, blocks, chunk, d).swapaxes(0, 1)
    t_NxBxC = targets_BxL.reshape(b, blocks, chunk).swapaxes(0, 1)

    @functools.partial(jax.checkpoint, prevent_cse=False)
    def chunk_loss(h_BxCxD, t_BxC):
        logits_BxCxV = constrain((h_BxCxD @ head_DxV).astype(jnp.float32), ("batch", None, "vocab"))
        return optax.softmax_cross_entropy_with_integer_labels(logits_BxCxV, t_BxC).sum()

    def body(total, chunk_inputs):
        return total + chunk_loss(*chunk_inputs), None

    with jax.named_scope("loss"):
        total, _ = jax.lax.scan(body, jnp.zeros((), jnp.float32), (h_NxBxCxD, t_NxBxC))
    return total / (b * length)


def _split_cross_entropy(hidden_BxLxD, head_DxV, targets_BxL, *, chunk: int, shards: int) -> jax.Array:
    """:func:`chunked_cross_entropy` on a sequence split in ``shards``: step ``j`` takes positions
    ``[j * chunk, (j + 1) * chunk)`` of each device's part, ``B x shards x chunk`` logits in all."""
    b, length, d = hidden_BxLxD.shape
    blocks = length // (shards * chunk)
    h_NxBxSxCxD = hidden_BxLxD.reshape(b, shards, blocks, chunk, d).transpose(2, 0, 1, 3, 4)
    t_NxBxSxC = targets_BxL.reshape(b, shards, blocks, chunk).transpose(2, 0, 1, 3)

    @functools.partial(jax.checkpoint, prevent_cse=False)
    def chunk_loss(h_BxSxCxD, t_BxSxC):
        logits = constrain((h_BxSxCxD @ head_DxV).astype(jnp.float32), ("batch", "seq", None, "vocab"))
        return optax.softmax_cross_entropy_with_integer_labels(logits, t_BxSxC).sum()

    def body(total, chunk_inputs):
        return total + chunk_loss(*chunk_inputs), None

    with jax.named_scope("loss"):
        total, _ = jax.lax.scan(body, jnp.zeros((), jnp.float32), (h_NxBxSxCxD, t_NxBxSxC))
    return total / (b * length)


def _fit(chunk: int | None, length: int) -> int | None:
    """The largest divisor of ``length`` not above ``chunk``; None when that is the whole length."""
    if not chunk or chunk >= length:
        return None
    best = max(c for c in range(1, chunk + 1) if length % c == 0)
    return best if best < length else None
