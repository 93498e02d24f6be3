"""Gradients added into running sums as the backward pass makes them, each layer's into its slice.

    grad_fn = value_and_grad_into(loss_of_params, stack="layers")
    (loss, aux), sums = grad_fn(sums, params, rest, batch)    # sums + d loss / d params, in the sums' dtype

Gradient accumulation (:mod:`shardmem.program.accumulation`) sums each micro-batch's gradient into
float32 sums for bfloat16 weights with master weights. Differentiated with respect to the weights, the
layer scan's backward writes every layer's gradient into a whole stacked gradient in the weights' dtype
(15 GiB for Llama 3.1 8B) that is only then added to the sums. Megatron-LM adds each layer's weight
gradient into the float32 main gradient as the backward pass makes it; so does this.

The function is differentiated with respect to the sums, not the weights: each weight is "attached" to
its sums by an identity whose backward adds the weight's cotangent (in the sums' dtype, divided by the
loss scale) to them, so the gradient with respect to the sums is the new sums. The layer stack's sums ride
through the layer scan (:func:`shardmem.remat.remat_scan`) as a loop carry that the forward passes on
unchanged: the backward scan carries their cotangent, which starts as the sums themselves, and each layer
adds its gradient into its own slice of it, which XLA updates in place. No whole gradient of the stack
exists. The other weights (embeddings, the final norm, the head) have their gradient added whole.
"""

from __future__ import annotations

import contextlib
import contextvars
import dataclasses
import functools
from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
from flax import nnx


def _in_sums_dtype(cotangent, sums, scale):
    """A weight's cotangent as the sums add it: in their dtype, the loss scale divided out."""
    update = cotangent.astype(sums.dtype)
    return update if scale is None else update / scale.astype(update.dtype)


@jax.custom_vjp
def _attached(sums, weights, scale):
    """``weights``, whose gradient is added to ``sums`` as the gradient with respect to ``sums``."""
    return weights


def _attached_fwd(sums, weights, scale):
    return weights, (sums, scale)


def _attached_bwd(residuals, d_weights):
    sums, scale = residuals
    return sums + _in_sums_dtype(d_weights, sums, scale), None, None


_attached.defvjp(_attached_fwd, _attached_bwd)


@jax.custom_vjp
def _layer_of(sums_LxA, weights_A, index, scale):
    """``(sums, weights)`` unchanged; in the backward pass the weights' gradient is added at ``index`` of
    the sums' cotangent, which the layer scan carries."""
    return sums_LxA, weights_A


def _layer_of_fwd(sums_LxA, weights_A, index, scale):
    return (sums_LxA, weights_A), (index, scale)


def added_at(sums_LxA, index, d_weights_A, scale=None):
    """``sums`` with one layer's weight gradient added at ``index`` (an index, or a tuple of them), in the
    sums' dtype, the loss ``scale`` divided out: a scatter-add at one index, which XLA runs as one kernel,
    in place (a dynamic slice, add and update-slice ran as two, the old slice written out and read back)."""
    update_A = _in_sums_dtype(d_weights_A, sums_LxA, scale)
    return sums_LxA.at[index].add(update_A, indices_are_sorted=True, unique_indices=True)


def _layer_of_bwd(residuals, cotangents):
    index, scale = residuals
    d_sums_LxA, d_weights_A = cotangents
    return added_at(d_sums_LxA, index, d_weights_A, scale), None, None, None


_layer_of.defvjp(_layer_of_fwd, _layer_of_bwd)


@jax.custom_vjp
def _seeded(loss, sums):
    """``loss``; in the backward pass the cotangent of ``sums`` (the layer scan's last carry) is the sums
    themselves, so the scan's backward starts from them and adds each layer's gradient."""
    return loss


def _seeded_fwd(loss, sums):
    return loss, sums


def _seeded_bwd(sums, d_loss):
    return d_loss, sums


_seeded.defvjp(_seeded_fwd, _seeded_bwd)


@dataclasses.dataclass
class LayerSums:
    """The sums of one stack of layers while a loss is traced, each ``[n_layers, ...]`` like the stack's
    parameters: :meth:`scan` carries them through a scan over (a slice of) the layers."""

    sums: Any  # The stack's sums, as the parameters' tree (a pure dict); the carry after each scan.
    scale: jax.Array | None  # The loss scale the cotangents carry (None: none).
    scans: int = 0  # How many scans carried them.

    def scan(self, step: Callable, x, params, rest, first: int):
        """Returns ``jax.lax.scan(step, x, ((params, rest), index))`` (``params`` a slice of the stack from
        layer ``first``, ``index`` each layer's in the stack) with each layer's parameters attached to their
        slice of the sums (:func:`_layer_of`)."""
        check_pairs(self.sums, params)
        treedef, n = jax.tree.structure(params), jax.tree.leaves(params)[0].shape[0]

        def body(carry, layer):
            x, sums = carry
            (params, rest), index = layer
            pairs = [_layer_of(s, w, index, self.scale)
                     for s, w in zip(sums, jax.tree.leaves(params), strict=True)]  # fmt: skip
            y, new_rest = step(x, ((jax.tree.unflatten(treedef, [w for _, w in pairs]), rest), index))
            return (y, [s for s, _ in pairs]), new_rest

        sums = jax.tree.leaves(self.sums)
        (x, sums), new_rest = jax.lax.scan(body, (x, sums), ((params, rest), first + jnp.arange(n)))
        self.sums = jax.tree.unflatten(jax.tree.structure(self.sums), sums)
        self.scans += 1
        return x, new_rest


def check_pairs(sums, params) -> None:
    """Raises unless ``sums`` (a pure dict) pairs with ``params``'s leaves (an nnx State of the stack) in
    order."""
    # The State's leaves are its pure dict's, in the same order.
    pure = nnx.to_pure_dict(params)
    in_order = all(a is b for a, b in zip(jax.tree.leaves(pure), jax.tree.leaves(params), strict=True))
    if jax.tree.structure(pure) != jax.tree.structure(sums) or not in_order:
        raise ValueError("the layer stack's gradient sums do not have the structure of its parameters")


_ACTIVE: contextvars.ContextVar[LayerSums | None] = contextvars.ContextVar("layer_sums", default=None)


def layer_sums() -> LayerSums | None:
    """The sums the layer scans of the loss being traced add their layers' gradients into (None: a scan
    is differentiated as JAX does, with respect to its weights)."""
    return _ACTIVE.get()


@contextlib.contextmanager
def _summing(sums, scale):
    """While active, the layer scans traced add each layer's weight gradient into ``sums`` (the stack's,
    as its parameters' pure dict) as the backward pass makes it; yields the :class:`LayerSums`, whose
    ``sums`` after the scans are what to differentiate with respect to (the cotangent given for them is
    what the gradients are added to): :func:`value_and_grad_into`'s."""
    active = LayerSums(sums, scale)
    token = _ACTIVE.set(active)
    try:
        yield active
    finally:
        _ACTIVE.reset(token)


def value_and_grad_into(loss_of_params: Callable, stack: str | None = None) -> Callable:
    """Returns ``(sums, params, *args, scale=None) -> ((loss, aux), new sums)``: the sums plus the
    gradient of ``loss_of_params(params, *args) -> (loss, aux)`` with respect to ``params`` (divided by
    ``scale`` where the loss is differentiated scaled by it, as a float16 loss scale does), each added in
    the sums' dtype as the backward pass makes it. ``stack`` is the key of ``params`` whose layers
    :func:`shardmem.remat.remat_scan` runs: their gradients are added a layer at a time (see the module
    docstring); the other parameters' whole."""

    def scaled_loss(sums, params, args, scale):
        attach = functools.partial(_attached, scale=scale)
        attached = {key: value if key == stack else jax.tree.map(attach, sums[key], value)
                    for key, value in params.items()}  # fmt: skip
        with _summing(sums[stack], scale) if stack else contextlib.nullcontext() as summing:
            loss, aux = loss_of_params(attached, *args)
        if summing is not None:
            if summing.scans == 0:
                raise ValueError(f"no layer scan ran the parameters {stack!r}: their gradients would be lost")
            loss = _seeded(loss, summing.sums)
        return (loss if scale is None else loss * scale.astype(loss.dtype)), (loss, aux)

    grad = jax.grad(scaled_loss, has_aux=True)

    def value_and_grad(sums, params, *args, scale=None):
        new_sums, (loss, aux) = grad(sums, params, args, scale)
        return (loss, aux), new_sums

    return value_and_grad
