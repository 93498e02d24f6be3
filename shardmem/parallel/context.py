"""Context (sequence) parallelism: each sequence split over a ``context`` mesh axis, balanced for causal
attention.

    mesh: {axes: {data: 1, fsdp: -1, context: 8}}      # rules.seq defaults to [context]
    tokens_BxL = to_zigzag(tokens_BxL, shards())       # once, at the input
    ctx_BxLxHxK = attend(kernel, q, k, v)              # keys and values all-gathered over context
    h_BxLxD = from_zigzag(h_BxLxD, shards())           # back in sequence order for the loss

Every activation of a layer is sharded over the sequence (logical axis ``seq``), so each device holds
``L / C`` positions of every sequence of its batch. Only attention needs other devices' positions: it
all-gathers the keys and values over ``context`` (the gathered ``[B, L, G, K]`` is live only while a layer
attends; the backward reduce-scatters their gradients).

**Load balancing (zigzag).** Causal attention gives late positions more keys than early ones, so a plain
split would leave the device with the first positions idle. The sequence is cut into ``2C`` chunks and
device ``i`` holds chunks ``i`` and ``2C-1-i``: every device then attends to ``2C+1`` chunks' worth of keys.
The tokens are permuted once at the input (:func:`to_zigzag`), RoPE and the causal mask use the real
positions (:func:`positions`), and the final hidden states are put back in order (:func:`from_zigzag`), so
the model's outputs, its loss and its checkpoints do not depend on ``C``.

**Kernels.** ``xla`` and ``chunked`` mask by position against the gathered keys (XLA's SPMD partitioner
inserts the all-gather). Flash kernels mask by index, top-left, with no query offset, so
:func:`flash_attention` splits the work into blocks of ``S = L / 2C`` positions: this device's two chunks
against themselves are one causal kernel over ``2S`` (chunk ``i`` comes before chunk ``2C - 1 - i`` in
index and in position, so the index mask is exact), the ``2C - 2`` blocks below them unmasked kernels, and
their outputs merge by log-sum-exp in place; the backward runs the kernel's own backward pass on each block
with the merged output and log-sum-exp, as ring/flash attention implementations do. Every device runs the
same ``2C + 1`` blocks' worth of work. The kernels read grouped-query keys and values as they are
(:mod:`shardmem.models.grouped_flash`), as TransformerEngine's ring attention does.
"""

from __future__ import annotations

import functools
import math

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import PartitionSpec as P

from shardmem.models import grouped_flash
from shardmem.parallel import rules as _rules


def shards() -> int:
    """Returns how many devices each sequence is split over (the ``seq`` rule's mesh axes) in the open
    :meth:`~shardmem.parallel.rules.Rules.activate` context; 1 outside one."""
    active = _rules.active()
    if active is None:
        return 1
    mesh, rules = active
    return math.prod(mesh.shape[a] for a in rules.mesh_axes("seq") or ())


def _seq_axes() -> tuple[str, ...]:
    active = _rules.active()
    return tuple(active[1].mesh_axes("seq") or ()) if active else ()


def split_by_hand() -> bool:
    """Whether an enclosing ``jax.shard_map`` splits the sequence by hand (manual over the ``seq`` rule's
    axes: gradient accumulation and the 1F1B pipeline, so that each device sums its own positions'
    weight gradients): the layers then see each device's own chunks, and attention gathers the keys
    and values with explicit collectives, where otherwise XLA's partitioner splits the sequence."""
    axes = _seq_axes()
    return bool(axes) and shards() > 1 and set(axes) <= _rules.manual_axes()


def own_chunks(x_BxL):
    """Whole sequences ``[B, L]`` (in order, the same on every device of the sequence) as the layers take
    them when the sequence is split by hand: this device's chunks ``i`` and ``2C - 1 - i`` of the zigzag
    order, ``[B, L / C]``."""
    n = shards()
    local = x_BxL.shape[1] // n
    return jax.lax.dynamic_slice_in_dim(to_zigzag(x_BxL, n), _shard_index() * local, local, axis=1)


def _shard_index():
    """This device's index along the (manual) ``seq`` axes, in the order their shards lie."""
    return jax.lax.axis_index(_seq_axes())


def layer_positions(length: int):
    """Returns the real positions of the ``length`` sequence places a layer sees: all of them in zigzag
    order (:func:`positions`), or, where the sequence is split by hand, this device's own."""
    n = shards()
    if not split_by_hand():
        return positions(length, n)
    return jnp.asarray(positions(length * n, n)).reshape(n, length)[_shard_index()]


def to_zigzag(x, shards: int, axis: int = 1):
    """Reorders ``axis`` (length ``L``, a multiple of ``2 * shards``) so that a contiguous split in
    ``shards`` gives device ``i`` chunks ``i`` and ``2 * shards - 1 - i`` of ``2 * shards``."""
    if shards == 1:
        return x
    lib = jnp if isinstance(x, jax.Array) else np
    shape = x.shape
    chunk = shape[axis] // (2 * shards)
    halves = x.reshape(*shape[:axis], 2, shards, chunk, *shape[axis + 1 :])
    first, second = lib.take(halves, 0, axis=axis), lib.flip(lib.take(halves, 1, axis=axis), axis=axis)
    return lib.stack([first, second], axis=axis + 1).reshape(shape)


def from_zigzag(x, shards: int, axis: int = 1):
    """The inverse of :func:`to_zigzag`."""
    if shards == 1:
        return x
    lib = jnp if isinstance(x, jax.Array) else np
    shape = x.shape
    chunk = shape[axis] // (2 * shards)
    pairs = x.reshape(*shape[:axis], shards, 2, chunk, *shape[axis + 1 :])
    first, second = lib.take(pairs, 0, axis=axis + 1), lib.flip(lib.take(pairs, 1, axis=axis + 1), axis=axis)
    return lib.concatenate([first, second], axis=axis).reshape(shape)


def positions(length: int, shards: int):
    """Returns the real position of each of ``length`` zigzag-ordered places (``jnp.arange`` when 1 shard,
    as the model had it before the sequence could be split: the same program)."""
    if shards == 1:
        return jnp.arange(length)
    return to_zigzag(np.arange(length, dtype=np.int32), shards, axis=0)


def attend(kernel, q_BxLxHxK, k_BxLxGxK, v_BxLxGxK, *, window: int | None = None,
           softcap: float | None = None):  # fmt: skip
    """Causal attention of ``kernel`` (a :class:`~shardmem.models.attention.AttentionKernel`) on
    zigzag-ordered, sequence-sharded ``q``, ``k``, ``v`` (each position attending to the last ``window``
    positions, when given; scores soft-capped at ``softcap``, in ``xla`` and ``chunked``); plain
    :func:`~shardmem.models.attention.attend` when the sequence is not split."""
    from shardmem.models import attention  # The kernels' module imports the rules, as this one does.

    n = shards()
    if n == 1:
        return attention.attend(kernel, q_BxLxHxK, k_BxLxGxK, v_BxLxGxK, window=window, softcap=softcap)
    length = q_BxLxHxK.shape[1]
    window = attention.masking(window, length)  # A longer window masks nothing.
    attention.check_takes(kernel, window, softcap)
    if kernel.name == "pallas":
        kernel.check_window(window, length)  # Its blocks have no window: only as a deviceless stand-in.
        return flash_attention(q_BxLxHxK, k_BxLxGxK, v_BxLxGxK, kernel=kernel)
    if kernel.name not in ("xla", "chunked"):
        raise ValueError(f"attention kernel {kernel.name!r} has no context-parallel form; use pallas")
    if split_by_hand():
        return _attend_by_hand(kernel, q_BxLxHxK, k_BxLxGxK, v_BxLxGxK, window, softcap)
    # The all-gather over context: keys and values whole along the sequence, still split by heads.
    k_BxLxGxK = _rules.constrain(k_BxLxGxK, ("batch", None, "kv_heads", None))
    v_BxLxGxK = _rules.constrain(v_BxLxGxK, ("batch", None, "kv_heads", None))
    positions_L = positions(length, n)
    local = length // n
    chunk = kernel.chunk if kernel.name == "chunked" else None
    if not chunk or chunk >= local:
        return attention.causal_attention(q_BxLxHxK, k_BxLxGxK, v_BxLxGxK, q_positions=positions_L,
                                          k_positions=positions_L, window=window,
                                          softcap=softcap)  # fmt: skip
    chunk = max(c for c in range(1, chunk + 1) if local % c == 0)
    return _chunked(q_BxLxHxK, k_BxLxGxK, v_BxLxGxK, positions_L, n, chunk, window, softcap)


def _attend_by_hand(kernel, q_BxLxHxK, k_BxLxGxK, v_BxLxGxK, window: int | None = None,
                    softcap: float | None = None):  # fmt: skip
    """``xla`` and ``chunked`` on this device's own chunks of a sequence split by hand: the keys and values
    all-gathered over the ``seq`` axes (their gradients reduce-scattered back in the backward pass); a
    ``window`` masks them and a ``softcap`` caps their scores as in :func:`attend`."""
    from shardmem.models.attention import causal_attention

    n, local = shards(), q_BxLxHxK.shape[1]
    k_BxLxGxK, v_BxLxGxK = (jax.lax.all_gather(a, _seq_axes(), axis=1, tiled=True)
                            for a in (k_BxLxGxK, v_BxLxGxK))  # fmt: skip
    k_positions, q_positions = positions(local * n, n), layer_positions(local)
    chunk = kernel.chunk if kernel.name == "chunked" else None
    if not chunk or chunk >= local:
        return causal_attention(q_BxLxHxK, k_BxLxGxK, v_BxLxGxK, q_positions=q_positions,
                                k_positions=k_positions, window=window, softcap=softcap)  # fmt: skip
    chunk = max(c for c in range(1, chunk + 1) if local % c == 0)
    b, _, h, k = q_BxLxHxK.shape
    q_NxBxCxHxK = q_BxLxHxK.reshape(b, local // chunk, chunk, h, k).swapaxes(0, 1)

    @functools.partial(jax.checkpoint, prevent_cse=False)
    def block(args):
        q_BxCxHxK, q_positions_C = args
        return causal_attention(q_BxCxHxK, k_BxLxGxK, v_BxLxGxK, q_positions=q_positions_C,
                                k_positions=k_positions, window=window, softcap=softcap)  # fmt: skip

    ctx_NxBxCxHxK = jax.lax.map(block, (q_NxBxCxHxK, q_positions.reshape(-1, chunk)))
    return ctx_NxBxCxHxK.swapaxes(0, 1).reshape(b, local, h, k)


def _chunked(q_BxLxHxK, k_BxLxGxK, v_BxLxGxK, positions_L, n: int, chunk: int, window: int | None = None,
             softcap: float | None = None):  # fmt: skip
    """``chunked`` on a split sequence: step ``j`` takes block ``j`` of every device's own queries, so each
    device scores ``chunk`` queries against the gathered keys at a time (a ``window`` masks them, the zigzag
    order leaving no contiguous range of keys to slice)."""
    from shardmem.models.attention import causal_attention

    b, length, h, k = q_BxLxHxK.shape
    blocks = length // (n * chunk)
    q_NxBxCxTxHxK = q_BxLxHxK.reshape(b, n, blocks, chunk, h, k).transpose(2, 0, 1, 3, 4, 5)
    pos_NxCT = jnp.asarray(positions_L.reshape(n, blocks, chunk).transpose(1, 0, 2).reshape(blocks, -1))

    @functools.partial(jax.checkpoint, prevent_cse=False)
    def block(args):
        q_BxCxTxHxK, q_positions = args
        q_BxTxHxK = _rules.constrain(q_BxCxTxHxK.reshape(b, n * chunk, h, k), ("batch", "seq", "heads", None))
        ctx = causal_attention(q_BxTxHxK, k_BxLxGxK, v_BxLxGxK, q_positions=q_positions,
                               k_positions=positions_L, window=window, softcap=softcap)  # fmt: skip
        return ctx.reshape(b, n, chunk, h, k)

    ctx_NxBxCxTxHxK = jax.lax.map(block, (q_NxBxCxTxHxK, pos_NxCT))
    return ctx_NxBxCxTxHxK.transpose(1, 2, 0, 3, 4, 5).reshape(b, length, h, k)


# --- Flash attention (Pallas) on a split sequence ------------------------------------------------


def flash_attention(q_BxLxHxK, k_BxLxGxK, v_BxLxGxK, *, kernel):
    """Causal flash attention (JAX's Pallas Triton ``mha``, tiled as ``kernel``, a ``pallas``
    :class:`~shardmem.models.attention.AttentionKernel`, says) on zigzag-ordered, sequence-sharded inputs:
    one ``shard_map`` over the mesh, keys and values all-gathered over the ``seq`` axes inside it, blocks
    merged by log-sum-exp (see the module docstring)."""
    mesh, rules = _rules.active()
    seq_axes = rules.mesh_axes("seq")
    q_spec = rules.spec(("batch", "seq", "heads", None))
    kv_spec = rules.spec(("batch", "seq", "kv_heads", None))
    if q_spec[2:3] != kv_spec[2:3]:  # Heads and KV heads split differently: split batch and sequence only.
        q_spec = kv_spec = P(*rules.spec(("batch", "seq")), None, None)
    k = q_BxLxHxK.shape[3]
    n = math.prod(mesh.shape[a] for a in seq_axes)

    def local(q, key, value):
        return _flash(q, key, value, seq_axes, n, k**-0.5, kernel)

    sharded = _rules.shard_map(local, mesh, (q_spec, kv_spec, kv_spec), q_spec)
    return sharded(q_BxLxHxK, k_BxLxGxK, v_BxLxGxK)


def _blocks(kernel, q_BxLxHxK):
    """The kernel's tiles for blocks of ``S = L / 2`` of this device's ``L`` positions
    (:meth:`AttentionKernel.flash_blocks`): they tile the local diagonal's ``2S`` as well."""
    return kernel.flash_blocks(q_BxLxHxK.shape[3], q_BxLxHxK.shape[1] // 2, q_BxLxHxK.dtype.itemsize)


def _block_scope(causal: bool):
    """Names a block's kernels by their mask: the causal diagonal block and the unmasked ones below it
    run kernels of the same name (``mha_forward``, ``mha_backward``), and the step-time model tells them
    apart by this scope in the compiled program's op names (:func:`shardmem.planning.hlo.attention_kernel`);
    a causal block does half the matmuls."""
    return jax.named_scope("causal_block" if causal else "full_block")


def _merge(out_a, lse_a, out_b, lse_b):
    """Two partial attentions over disjoint keys -> the attention over both (base-2 log-sum-exp)."""
    lse = jnp.logaddexp2(lse_a, lse_b)
    weight_a = jnp.exp2(lse_a - lse).transpose(0, 2, 1)[..., None]  # [B, H, T] -> [B, T, H, 1]
    weight_b = jnp.exp2(lse_b - lse).transpose(0, 2, 1)[..., None]
    return out_a * weight_a + out_b.astype(jnp.float32) * weight_b, lse


def _gather(x, axes, n):
    """Every device's zigzag chunks, in the order of the devices: ``[B, 2C, S, G, K]``, chunk ``j`` at
    :func:`_slot` ``j`` (left in that order: putting it in sequence order would copy it)."""
    whole = jax.lax.all_gather(x, axes, axis=1, tiled=True)
    return whole.reshape(whole.shape[0], 2 * n, x.shape[1] // 2, *whole.shape[2:])


def _slot(chunk, n):
    """Where chunk ``chunk`` of ``2C`` lies in the gathered zigzag order: device ``j``'s first for
    ``j < C``, device ``2C - 1 - j``'s second otherwise."""
    return jnp.where(chunk < n, 2 * chunk, 4 * n - 1 - 2 * chunk)


def _off_diagonal(t, device):
    """Block ``t`` of the ``2C - 2`` below the diagonal: (which local chunk, which key chunk). Local chunk
    0 is chunk ``device`` and attends chunks ``0 .. device-1``; local chunk 1 is chunk ``2C-1-device`` and
    attends chunks ``0 .. 2C-2-device`` but chunk ``device``, which the diagonal's kernel covers."""
    second = t >= device
    after = t - device
    return second.astype(jnp.int32), jnp.where(second, jnp.where(after < device, after, after + 1), t)


def _halves(x, axis=1):
    """``[..., 2S, ...]`` -> ``[..., 2, S, ...]`` along ``axis``: this device's two chunks (a reshape)."""
    return x.reshape(*x.shape[:axis], 2, x.shape[axis] // 2, *x.shape[axis + 1 :])


def _half(x_2, index, axis=1):
    return jax.lax.dynamic_index_in_dim(x_2, index, axis, keepdims=False)


def _add_to_half(x_2, index, update, axis=1):
    """``x_2`` with ``update`` added to its half ``index``: read and written in place, no scatter."""
    return jax.lax.dynamic_update_index_in_dim(x_2, _half(x_2, index, axis) + update, index, axis)


@functools.partial(jax.custom_vjp, nondiff_argnums=(3, 4, 5, 6))
def _flash(q, k, v, axes, n, scale, kernel):
    return _flash_forward(q, k, v, axes, n, scale, kernel)[0]


def _flash_forward(q, k, v, axes, n, scale, kernel):
    """The diagonal is one causal kernel over this device's ``2S`` positions: their index order (chunk
    ``i``, then chunk ``2C - 1 - i``) is their position order, so the kernel's top-left mask is exact and
    it skips the upper block; then the ``2C - 2`` unmasked blocks below, merged into their half."""
    device = jax.lax.axis_index(axes)
    options = dict(scale=scale, blocks=_blocks(kernel, q), interpret=kernel.interpret)
    k_all, v_all = _gather(k, axes, n), _gather(v, axes, n)
    with _block_scope(True):
        out, lse = grouped_flash.forward(q, k, v, causal=True, **options)
    q_2 = _halves(q)

    def below(carry, t):
        out_2, lse_2 = carry
        index, key_chunk = _off_diagonal(t, device)
        slot = _slot(key_chunk, n)
        with _block_scope(False):
            block_out, block_lse = grouped_flash.forward(
                _half(q_2, index), _half(k_all, slot), _half(v_all, slot), causal=False, **options
            )
        merged_out, merged_lse = _merge(_half(out_2, index), _half(lse_2, index, 2), block_out, block_lse)
        out_2 = jax.lax.dynamic_update_index_in_dim(out_2, merged_out, index, 1)
        return (out_2, jax.lax.dynamic_update_index_in_dim(lse_2, merged_lse, index, 2)), None

    carry = (_halves(out.astype(jnp.float32)), _halves(lse, 2))
    (out_2, lse_2), _ = jax.lax.scan(below, carry, jnp.arange(2 * n - 2))
    out = out_2.reshape(q.shape).astype(q.dtype)
    return out, (q, k, v, out, lse_2.reshape(lse.shape))


def _flash_backward(axes, n, scale, kernel, residuals, d_out):
    """Each block's kernel backward with the merged output's log-sum-exp and row sums ``sum(out * d_out)``,
    computed once (FlashAttention-2's backward needs only those, so the blocks' gradients add up to the
    whole attention's, and no block copies the output): the diagonal's whole, the
    blocks below added in place to their query half and to their key chunk's gradients, which go back to
    their devices in one reduce-scatter (the all-gather's transpose)."""
    q, k, v, out, lse = residuals
    device = jax.lax.axis_index(axes)
    options = dict(scale=scale, blocks=_blocks(kernel, q), interpret=kernel.interpret)
    d_out = d_out.astype(q.dtype)
    k_all, v_all = _gather(k, axes, n), _gather(v, axes, n)
    delta = grouped_flash.delta(out, d_out, blocks=options["blocks"], interpret=kernel.interpret)
    with _block_scope(True):
        dq, dk, dv = grouped_flash.backward(q, k, v, lse, delta, d_out, causal=True, **options)
    q_2, d_out_2, lse_2, delta_2 = _halves(q), _halves(d_out), _halves(lse, 2), _halves(delta, 2)

    def below(carry, t):
        dq_2, dk_all, dv_all = carry
        index, key_chunk = _off_diagonal(t, device)
        slot = _slot(key_chunk, n)
        with _block_scope(False):
            q, d_out, lse, delta = (
                _half(q_2, index),
                _half(d_out_2, index),
                _half(lse_2, index, 2),
                _half(delta_2, index, 2),
            )
            k, v = _half(k_all, slot), _half(v_all, slot)
            dq, dk, dv = grouped_flash.backward(q, k, v, lse, delta, d_out, causal=False, **options)
        dk_all, dv_all = _add_to_half(dk_all, slot, dk), _add_to_half(dv_all, slot, dv)
        return (_add_to_half(dq_2, index, dq), dk_all, dv_all), None

    zeros = jnp.zeros(k_all.shape, jnp.float32)
    (dq_2, dk_all, dv_all), _ = jax.lax.scan(below, (_halves(dq), zeros, zeros), jnp.arange(2 * n - 2))

    def scatter(d_all, d_diagonal, like):  # The all-gather's transpose: each device's chunks, summed.
        d_all = d_all.reshape(like.shape[0], -1, *like.shape[2:])
        mine = jax.lax.psum_scatter(d_all, axes, scatter_dimension=1, tiled=True)
        return (mine + d_diagonal).astype(like.dtype)

    return dq_2.reshape(q.shape).astype(q.dtype), scatter(dk_all, dk, k), scatter(dv_all, dv, v)


_flash.defvjp(_flash_forward, _flash_backward)
