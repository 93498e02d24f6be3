"""Gradient accumulation over micro-batches, with the gradients reduced across devices once per step.

    loss, metrics, grads, rest = accumulate_gradients(grad_fn, params, rest, batch, micro_batches=16,
                                                      mesh=mesh, rules=rules, ...)

Summing each micro-batch's gradient as XLA partitions it would reduce it across the batch's devices
inside the accumulation loop: an all-reduce (data parallel) or reduce-scatter (FSDP) of every gradient
on every micro-batch, 16 micro-batches 16 times the traffic. Production trainers sum locally and
reduce once. Here each micro-batch is split into one group of rows per device of the *deferred* batch
mesh axes, and the gradient is taken per group (``jax.vmap`` with ``spmd_axis_name``): each device's
gradient is its own group's, summed in the loop in a ``[groups, *param]`` accumulator split over those
axes, and the sum over groups after the loop is the one reduction of the step.

Which batch axes are deferred (:func:`deferred_axes`): those the parameters are replicated over (data
parallelism), always; the accumulator then costs what the summed gradient did. Axes that also shard
parameters (FSDP) only with ``train.fsdp_reduce_once``: each device then holds its group's gradient
unsharded over them (a parameter's size / its other shards, in the parameters' dtype) instead of its
shard, PyTorch FSDP's ``no_sync``; by default FSDP gradients are reduce-scattered per micro-batch, as
PyTorch FSDP and MaxText do. With ``optimizer.shard_over_data`` (ZeRO-1) the data axes are deferred
too, so each device accumulates its whole gradient (as Megatron's distributed optimizer does) where XLA
could otherwise have reduce-scattered into a data-sharded one; the one reduction after the loop is
then a reduce-scatter onto the optimizer's shards (``grad_shardings``). Axes the model itself splits work over
(``seq``, ``expert``, ``layers`` rules) are never deferred.

Context parallelism splits each sequence over the ``seq`` rule's axes, whose devices' gradients are partial
sums over positions: where no weight is split over them (:meth:`Rules.seq_only_axes`), the micro-batch's
gradients are taken in a ``jax.shard_map`` manual over them (and the deferred axes), so each device sums
its own positions' (:func:`shardmem.parallel.context.split_by_hand`) in a ``[sums, *param]`` accumulator
split over both, and the one reduction after the loop is over both; XLA's partitioner all-reduced every
micro-batch's gradients over them.

Only a loss whose rows are independent and equal in weight may be split so: the reference model's
next-token loss. A model of your own, or a ``train.loss``, may couple rows (batch statistics, a
contrastive loss), so its gradients are reduced per micro-batch as XLA partitions them.

Each micro-batch's gradients are added into the sums as its backward pass makes them
(:func:`shardmem.gradient_sums.value_and_grad_into`, differentiated with respect to the sums): the
reference model's layers one at a time, each into its slice of the ``grad_dtype`` sums (float32 under
master weights, as Megatron adds into its float32 main gradients), so no micro-batch's whole gradient
of the layer stack is ever held. Not where FSDP reduce-scatters each micro-batch's gradients
(:func:`reduce_scatters_per_micro_batch`): there the stack's gradient is held sharded anyway, and with
each layer's reduce-scatter feeding its add into the sums XLA's scheduler hid less of the reduce-scatters
(``configs/llama-70b.yaml``, FSDP 8 x tensor 8 over 2 micro-batches: 4.8 -> 5.73 s predicted, for 4.3
GiB less peak), so the whole gradient is added after each micro-batch there. The other parameters', and
a model of your own's, are added whole.

The loss and metrics are averaged over groups and micro-batches, which equals the whole batch's when the
loss is a mean over rows (the accumulation assumes that already). Model state other than parameters
(``rest``) is averaged over groups where floating point, taken from the first group otherwise.
"""

from __future__ import annotations

import dataclasses
import functools
import math
from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

from shardmem.parallel.rules import Rules, spec_axes

#: Rules whose mesh axes the model splits its own work over: a batch axis they use is never deferred.
_WORK_RULES = ("seq", "expert", "layers")


def deferred_axes(rules: Rules, mesh: Mesh, param_shardings, batch_sharding, fsdp_reduce_once: bool = False):
    """Returns the batch mesh axes (size > 1) whose gradient reduction waits for the end of the step:
    the leading batch axes of every batch array that no work rule uses, and that shard no parameter
    unless ``fsdp_reduce_once``. Leading, so that each group of rows is one device's own."""
    busy = {a for name in _WORK_RULES for a in rules.mesh_axes(name) or ()}
    sharding_params = {a for s in jax.tree.leaves(param_shardings) for e in s.spec for a in spec_axes(e)}
    leading = [
        [a for a in spec_axes(s.spec[0] if s.spec else None) if mesh.shape[a] > 1]
        for s in jax.tree.leaves(batch_sharding)
    ]
    deferred = []
    for i, axis in enumerate(leading[0] if leading else ()):
        if axis in busy or (axis in sharding_params and not fsdp_reduce_once):
            break
        if any(len(axes) <= i or axes[i] != axis for axes in leading):
            break
        deferred.append(axis)
    return tuple(deferred)


def reduce_scatters_per_micro_batch(
    mesh: Mesh, param_shardings, batch_sharding, fsdp_reduce_once: bool
) -> bool:
    """Whether FSDP reduce-scatters the gradients on every micro-batch: a batch axis (size > 1) that also
    shards parameters, its reduction not deferred (``train.fsdp_reduce_once`` off)."""
    if fsdp_reduce_once:
        return False
    sharding_params = {a for s in jax.tree.leaves(param_shardings) for e in s.spec for a in spec_axes(e)}
    batch_axes = {a for s in jax.tree.leaves(batch_sharding) for e in s.spec[:1] for a in spec_axes(e)}
    return any(mesh.shape[a] > 1 for a in batch_axes & sharding_params)


def _without(spec: P, axes: tuple[str, ...]) -> list:
    entries = []
    for entry in spec:
        kept = tuple(a for a in spec_axes(entry) if a not in axes)
        entries.append(None if not kept else kept[0] if len(kept) == 1 else kept)
    return entries


def _inner_rules(rules: Rules, axes: tuple[str, ...]) -> Rules:
    """The rules with ``axes`` removed: inside the per-group ``vmap`` those axes carry the groups."""
    logical = tuple(
        (name, tuple(a for a in mapped or () if a not in axes) or None) for name, mapped in rules.logical
    )
    return dataclasses.replace(rules, logical=logical)


def accumulate_gradients(
    grad_fn: Callable,
    params,
    rest,
    batch,
    *,
    micro_batches: int,
    mesh: Mesh,
    rules: Rules,
    param_shardings,
    batch_sharding,
    fsdp_reduce_once: bool = False,
    rows_independent: bool = True,
    grad_shardings=None,
    grad_dtype=None,
) -> tuple[jax.Array, dict, Any, Any]:
    """Returns ``(loss, metrics, grads, rest)`` of ``grad_fn`` averaged over ``micro_batches`` of ``batch``,
    the gradients reduced across the deferred batch axes once (see the module docstring). ``grad_fn`` is
    ``(sums, params, rest, batch) -> ((loss, (metrics, rest)), sums + gradients)``
    (:func:`shardmem.gradient_sums.value_and_grad_into` of ``(params, rest, batch) -> (loss, (metrics,
    rest))``): it adds each micro-batch's gradients into the sums as its backward pass makes them. Without
    ``rows_independent`` (a loss that may couple rows) nothing is deferred: XLA reduces per micro-batch.
    ``grad_shardings`` (default ``param_shardings``) is how the step's gradients leave: split over the data
    axes for a data-sharded optimizer, the one reduction is a reduce-scatter. ``grad_dtype`` (default: each
    parameter's) is the dtype the gradients are summed in: float32 for bfloat16 weights with master
    weights (``precision.master``), as Megatron sums into float32 main gradients."""
    k = micro_batches
    axes = (
        deferred_axes(rules, mesh, param_shardings, batch_sharding, fsdp_reduce_once)
        if rows_independent
        else ()
    )
    # Context parallelism: each device sums its own positions' gradients (the sequence split by hand).
    by_hand = rules.seq_only_axes(mesh) if rows_independent else ()
    groups = math.prod(mesh.shape[a] for a in axes)
    group_entry = (axes[0] if len(axes) == 1 else axes) if axes else None
    # The accumulator: one sum per device of the sequence's axes (split by hand) and per group of rows.
    summed = (*by_hand, *axes)
    sums = math.prod(mesh.shape[a] for a in summed)
    sum_entry = (summed[0] if len(summed) == 1 else summed) if summed else None

    def split(x, sharding):
        # Micro-batch i takes every k-th row, so each device keeps its own rows; then one group per
        # device of the deferred axes: [k, groups, rows / (k * groups), ...].
        rows = x.shape[0] // k
        x = x.reshape(rows, k, *x.shape[1:]).swapaxes(0, 1).reshape(k, groups, rows // groups, *x.shape[1:])
        spec = list(sharding.spec) or [None]
        inner = _without(P(spec[0]), axes)[0]
        return jax.lax.with_sharding_constraint(
            x, NamedSharding(mesh, P(None, group_entry, inner, *spec[1:]))
        )

    micro = jax.tree.map(split, batch, batch_sharding)
    accumulator_shardings = jax.tree.map(
        lambda s: NamedSharding(mesh, P(sum_entry, *_without(s.spec, summed))), param_shardings
    )
    inner_rules = _inner_rules(rules, axes)

    def one_group(sums, params, rest, one_batch):
        first = functools.partial(jax.tree.map, lambda x: x[0])
        return jax.tree.map(lambda x: x[None], grad_fn(first(sums), params, rest, first(one_batch)))

    # Split by hand over the sequence's axes, each device takes its group of rows by hand too: [1, ...] each.
    by_device = jax.shard_map(one_group, mesh=mesh, in_specs=(P(sum_entry), P(), P(), P(group_entry)),
                              out_specs=P(sum_entry), axis_names=set(summed), check_vma=False)  # fmt: skip

    def per_group(sums, rest, one_batch):
        """``[sums, ...]``: the results of each group of rows and, split by hand, each device's positions,
        each group's gradients added into its own sums."""
        with inner_rules.activate(mesh):
            if by_hand:
                return by_device(sums, params, rest, one_batch)
            if not axes:
                return one_group(sums, params, rest, one_batch)
            vmapped = jax.vmap(grad_fn, in_axes=(0, None, None, 0), spmd_axis_name=axes)
            return vmapped(sums, params, rest, one_batch)

    def one_rest(rest_G):
        return jax.tree.map(
            lambda x: x.mean(0).astype(x.dtype) if jnp.issubdtype(x.dtype, jnp.floating) else x[0], rest_G
        )

    def accumulate(carry, one_batch):
        loss_sum, metric_sum, grad_sum, rest = carry
        (loss_G, (metrics_G, rest_G)), grad_sum = per_group(grad_sum, rest, one_batch)
        grad_sum = jax.lax.with_sharding_constraint(grad_sum, accumulator_shardings)
        # Per group, like the gradients: a sum over groups here would be a collective per micro-batch.
        metric_sum = jax.tree.map(jnp.add, metric_sum, metrics_G)
        return (loss_sum + loss_G, metric_sum, grad_sum, one_rest(rest_G)), None

    grad_zeros = jax.lax.with_sharding_constraint(
        jax.tree.map(lambda p: jnp.zeros((sums, *p.shape), grad_dtype or p.dtype), params),
        accumulator_shardings,
    )
    first = jax.tree.map(lambda x: x[0], micro)
    metric_shapes = jax.eval_shape(lambda: per_group(grad_zeros, rest, first)[0][1][0])
    zeros = (
        jnp.zeros((sums,), jnp.float32),
        jax.tree.map(lambda m: jnp.zeros(m.shape, jnp.float32), metric_shapes),
        grad_zeros,
        rest,
    )
    (loss, metrics, grads, rest), _ = jax.lax.scan(accumulate, zeros, micro)
    count = k * sums
    with jax.named_scope("gradient_reduction"):  # The step's one reduction over the deferred axes.
        grads = jax.tree.map(lambda g: g.sum(0) / count, grads)
        grads = jax.lax.with_sharding_constraint(grads, grad_shardings or param_shardings)
    return loss.sum() / count, jax.tree.map(lambda m: m.sum(0) / count, metrics), grads, rest
