"""Flax Linen models in shardmem: wrap them as NNX, and give their layers the config's remat plan.

    def build(rngs, remat):                      # model.factory in the config
        decoder = Decoder(vocab=512, layers=RematLayers(Block, remat, n_layers=4))
        return from_linen(decoder, jnp.zeros((1, 128), jnp.int32), rngs=rngs)

:func:`from_linen` is Flax's own bridge (``nnx.bridge.ToNNX`` plus ``lazy_init`` on example inputs):
Linen's ``nn.with_logical_partitioning`` names become the NNX sharding metadata the config's rules read,
``params`` become ``nnx.Param`` (trained) and every other collection (``batch_stats``, RNG streams)
is carried through the step like any NNX variable. :class:`RematLayers` runs a stack of Linen blocks as
one ``nn.scan`` per segment of the per-layer plan, each under ``nn.remat`` with that segment's policy,
so ``remat.policy`` and ``remat.layers`` from YAML reach a Linen model as they reach the reference one.
A model whose blocks take no plan (a third party's) gets ``remat.modules`` through :func:`remat_calls`.
"""

from __future__ import annotations

import contextlib
import threading
from collections.abc import Iterator
from typing import Any

import flax.linen as nn
import jax
from flax import nnx
from flax.nnx import bridge
from flax.nnx.bridge import variables as bridge_variables

from shardmem.remat import LayerPlan, ModulePlan, checkpointed_call


def from_linen(module: nn.Module, *example_args: Any, rngs: nnx.Rngs, **example_kwargs: Any) -> nnx.Module:
    """Returns ``module`` as an NNX module, initialised by calling it on the example inputs (abstract
    when planning: nothing is allocated inside ``nnx.eval_shape``). RNG streams the module asks for
    (``dropout``, ...) are drawn from ``rngs``; calls may update every collection (``batch_stats``, ...),
    as a training step needs."""
    model = _Trainable(module, rngs=rngs)
    bridge.lazy_init(model, *example_args, **example_kwargs)
    attrs = {k: v for k, v in vars(model).items() if not k.startswith(("to_nnx__", "_pytree__"))}
    # The bridge reads every attribute but its own ``to_nnx__*`` ones as a Linen collection.
    model.to_nnx__mutable = tuple(c for c in bridge_variables.nnx_attrs_to_linen_vars(attrs) if c != "params")
    return model


class _Trainable(bridge.ToNNX):
    """Flax's bridge, called with every collection but ``params`` mutable unless the caller says
    otherwise (its default, immutable, fails on a BatchNorm in training mode)."""

    def __call__(self, *args: Any, mutable: Any = None, **kwargs: Any) -> Any:
        if mutable is None:
            mutable = list(getattr(self, "to_nnx__mutable", ())) or False
        return super().__call__(*args, mutable=mutable, **kwargs)


class _Carried(nn.Module):
    """Adapts a block ``x -> x`` to the ``(carry, x) -> (carry, out)`` form ``nn.scan`` runs."""

    block: Any
    options: dict

    @nn.compact
    def __call__(self, x, _):
        return self.block(**self.options)(x), None


class RematLayers(nn.Module):
    """``n_layers`` copies of the Linen module class ``block`` (built with ``options``), applied in turn
    to ``x``, their parameters stacked on a leading ``layers`` axis; each run of layers that shares a
    policy in ``plan`` is one scanned, rematerialized segment named ``layers_{first}-{last}``."""

    block: Any
    plan: LayerPlan
    n_layers: int
    options: dict | None = None

    @nn.compact
    def __call__(self, x):
        plan = self.plan.for_layers(self.n_layers)
        for start, stop, policy in plan.segments():
            body = _Carried
            if policy.remats:
                body = nn.remat(body, policy=policy.lower(), prevent_cse=False)
            scanned = nn.scan(
                body,
                variable_axes={True: 0},  # Every collection is per layer: params, batch_stats, ...
                split_rngs={True: True},
                length=stop - start,
                metadata_params={nn.PARTITION_NAME: "layers"},
            )
            name = f"layers_{start}-{stop - 1}" if stop - start > 1 else f"layers_{start}"
            x, _ = scanned(self.block, dict(self.options or {}), name=name)(x, None)
        return x


_INSIDE = threading.local()  # Set while a matched module runs: its submodules are not wrapped again.


@contextlib.contextmanager
def remat_calls(plan: ModulePlan, matched: set[str] | None = None) -> Iterator[None]:
    """While open, each Linen module ``plan`` names (by path, name or class, see
    :class:`~shardmem.remat.ModulePlan`) runs its ``__call__`` under ``nn.checkpoint`` with its policy,
    through ``nn.intercept_methods``: the model's code is not edited. The patterns that named a module
    are added to ``matched``."""

    _fresh_traces(plan)
    if not plan:  # Nothing to intercept; the caches are fresh for a plan without remat.
        yield
        return

    def interceptor(next_fun, args, kwargs, context):
        module = context.module
        if context.method_name != "__call__" or getattr(_INSIDE, "active", False) or module.scope is None:
            return next_fun(*args, **kwargs)
        found = plan.match(module.path, type(module).__name__)
        if found is None:
            return next_fun(*args, **kwargs)
        pattern, policy = found
        if matched is not None:
            matched.add(pattern)
        if not policy.remats:
            return _outermost(lambda: next_fun(*args, **kwargs))

        def call(clone, *args, **kwargs):  # The lifted transform calls a clone bound to its scope.
            return _outermost(lambda: clone(*args, **kwargs))

        return checkpointed_call(nn.checkpoint, call, policy, module, args, kwargs)

    with nn.intercept_methods(interceptor):
        yield


_TRACED_UNDER: list[str] = []  # The plan (describe()) of the last trace through remat_calls, in this process.


def _fresh_traces(plan: ModulePlan) -> None:
    """Clears JAX's trace caches when ``plan`` differs from the last traced plan. ``nn.jit`` (gemma wraps
    its call in it), like any ``jax.jit`` inside a model, reuses its first trace for the same shapes in
    a process, and the interceptor is no part of that trace's key: a later trace under another plan
    would get the earlier plan's remat (or none), and say nothing."""
    key = plan.describe()
    if not _TRACED_UNDER or _TRACED_UNDER[-1] != key:  # The first: traces made before shardmem's.
        jax.clear_caches()
    _TRACED_UNDER[:] = [key]


def _outermost(run):
    _INSIDE.active, before = True, getattr(_INSIDE, "active", False)
    try:
        return run()
    finally:
        _INSIDE.active = before
