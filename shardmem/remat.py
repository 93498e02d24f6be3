"""Rematerialization policies as values, and the per-layer plan that runs them as scanned segments.

    policy = RematPolicy.parse("minimal")               # one parse ...
    jax.checkpoint(f, policy=policy.lower())             # ... one lowering
    plan = LayerPlan.parse({"policy": "full", "layers": {"30-31": "none"}}, n_layers=32)
    plan.segments()  # [(0, 30, full), (30, 32, none)]: two scans, whatever the depth
    remat_modules(model, ModulePlan.parse({"blocks_*": "full"}))  # layers of a model that takes no plan

A policy decides which tagged intermediates (see ``checkpoint_name``) a layer keeps for the backward pass,
which it sends to pinned host memory, and which it recomputes.
"""

from __future__ import annotations

import contextvars
import dataclasses
import fnmatch
import functools
import re
from collections.abc import Mapping, Sequence
from typing import Literal

import jax
import numpy as np
from flax import nnx

from shardmem import gradient_sums
from shardmem.errors import ConfigError, did_you_mean, one_of

Saves = Literal["everything", "nothing", "dots", "dots_no_batch", "names"]
TagAction = Literal["save", "offload", "recompute"]

_PROJECTIONS = ("query_proj", "key_proj", "value_proj", "out_proj", "mlp_gate", "mlp_up", "mlp_out")


@dataclasses.dataclass(frozen=True)
class RematPolicy:
    """What one layer keeps for the backward pass.

    ``saves`` picks a JAX policy family; for ``"names"``, ``save`` lists tags kept on the device and
    ``offload`` tags moved to pinned host memory; every other intermediate is recomputed.
    """

    name: str
    saves: Saves
    save: tuple[str, ...] = ()
    offload: tuple[str, ...] = ()

    @property
    def remats(self) -> bool:
        """Whether the layer is wrapped in ``jax.checkpoint`` at all."""
        return self.saves != "everything"

    def lower(self):
        """Returns the ``jax.checkpoint_policies`` value for this policy (None: no checkpointing)."""
        policies = jax.checkpoint_policies
        if self.saves == "everything":
            return None
        if self.saves == "nothing":
            return policies.nothing_saveable
        if self.saves == "dots":
            return policies.dots_saveable
        if self.saves == "dots_no_batch":
            return policies.dots_with_no_batch_dims_saveable
        if self.offload:
            return policies.save_and_offload_only_these_names(
                names_which_can_be_saved=list(self.save),
                names_which_can_be_offloaded=list(self.offload),
                offload_src="device",
                offload_dst="pinned_host",
            )
        return policies.save_only_these_names(*self.save)

    @staticmethod
    def parse(
        name: str,
        custom: Mapping[str, str] | None = None,
        *,
        tags: Sequence[str] | None = None,
        named: Sequence[str] | None = None,
        key: str = "remat.policy",
    ) -> RematPolicy:
        """Returns the policy named ``name``; ``custom`` maps tag -> save/offload/recompute.

        ``tags`` are the names the model tags; a custom policy that names another tag is an error.
        ``named`` replaces the reference model's projections as the tags ``minimal`` saves and
        ``offload`` moves to the host (a model of your own declares them in ``remat.tags``).
        """
        if name == "custom":
            return _parse_custom(custom or {}, tags)
        if name not in PRESETS:
            choices = [*PRESETS, "custom"]
            raise ConfigError(
                f"{key}={name!r} is not a remat policy{did_you_mean(name, choices)}; use {one_of(choices)}"
            )
        policy = PRESETS[name]
        if named and name == "minimal":
            return dataclasses.replace(policy, save=tuple(named))
        if named and name == "offload":
            return dataclasses.replace(policy, offload=tuple(named))
        return policy

    def named_tags(self) -> tuple[str, ...]:
        """The ``checkpoint_name`` tags this policy keeps or offloads by name (empty for the others)."""
        return self.save + self.offload if self.saves == "names" else ()


PRESETS: dict[str, RematPolicy] = {
    "none": RematPolicy("none", "everything"),
    "full": RematPolicy("full", "nothing"),
    "dots": RematPolicy("dots", "dots"),
    "dots_no_batch": RematPolicy("dots_no_batch", "dots_no_batch"),
    "minimal": RematPolicy("minimal", "names", save=_PROJECTIONS),
    "save_qkv": RematPolicy("save_qkv", "names", save=("query_proj", "key_proj", "value_proj")),
    "save_out_proj": RematPolicy("save_out_proj", "names", save=("out_proj",)),
    "offload": RematPolicy("offload", "names", offload=_PROJECTIONS),
}

#: One line per policy, for help texts and the README.
DESCRIPTIONS = {
    "none": "save every intermediate (no rematerialization)",
    "full": "save only the layer input; recompute the whole layer",
    "dots": "save the outputs of all matrix multiplications",
    "dots_no_batch": "save matmul outputs that have no dot batch dimensions (here: the projections, "
    "not attention's score and context products)",
    "minimal": "save the named q/k/v/out and MLP projections, recompute the rest",
    "save_qkv": "save the query/key/value projections",
    "save_out_proj": "save the attention output projection",
    "offload": "move the named projections to pinned host memory instead of keeping them on device",
    "custom": "per tag: save, offload or recompute (remat.custom)",
}


def _parse_custom(custom: Mapping[str, str], tags: Sequence[str] | None) -> RematPolicy:
    if not custom:
        raise ConfigError(
            "remat.policy='custom' needs remat.custom, a mapping of tag -> save, offload or "
            "recompute, e.g. remat: {policy: custom, custom: {query_proj: save, mlp_out: offload}}"
        )
    actions = ("save", "offload", "recompute")
    for tag, action in custom.items():
        if tags is not None and tag not in tags:
            raise ConfigError(
                f"remat.custom.{tag}: the model tags no intermediate named {tag!r}"
                f"{did_you_mean(tag, tags)}; its tags are {one_of(tags)}"
            )
        if action not in actions:
            raise ConfigError(f"remat.custom.{tag}={action!r}: use {one_of(actions)}")
    save = tuple(t for t, a in custom.items() if a == "save")
    offload = tuple(t for t, a in custom.items() if a == "offload")
    return RematPolicy("custom", "names", save=save, offload=offload)


@dataclasses.dataclass(frozen=True)
class LayerPlan:
    """One remat policy per layer."""

    policies: tuple[RematPolicy, ...]
    any_depth: bool = False  # One policy for a model whose depth the config does not give.

    @staticmethod
    def uniform(n_layers: int, policy: str | RematPolicy = "none") -> LayerPlan:
        """Returns a plan giving every layer the same policy (a preset name or a RematPolicy)."""
        policy = PRESETS[policy] if isinstance(policy, str) else policy
        return LayerPlan((policy,) * n_layers)

    @staticmethod
    def parse(
        remat: Mapping[str, object],
        n_layers: int,
        *,
        tags: Sequence[str] | None = None,
        named: Sequence[str] | None = None,
    ) -> LayerPlan:
        """Builds the plan from the config's ``remat`` section: a default ``policy``, per-range
        ``layers`` overrides such as ``{"0-7": full, "31": none}``, and ``custom`` tag actions
        (``named``: see :meth:`RematPolicy.parse`)."""
        custom = remat.get("custom") or {}
        if custom:
            _parse_custom(custom, tags)  # Checked even where no layer uses it yet: a typo should not wait.
        default = RematPolicy.parse(str(remat.get("policy", "none")), custom, tags=tags, named=named)
        policies = [default] * n_layers
        claimed: dict[int, str] = {}
        for span, name in (remat.get("layers") or {}).items():
            start, stop = _parse_span(str(span), n_layers)
            key = f"remat.layers.{span}"
            policy = RematPolicy.parse(str(name), custom, tags=tags, named=named, key=key)
            for i in range(start, stop):
                if i in claimed:
                    raise ConfigError(
                        f"{key}: layer {i} is already given a policy by remat.layers.{claimed[i]}; "
                        "make the ranges disjoint"
                    )
                claimed[i] = str(span)
                policies[i] = policy
        return LayerPlan(tuple(policies))

    def for_layers(self, n_layers: int) -> LayerPlan:
        """Returns this plan for a stack of ``n_layers``: itself when the depths agree, the one policy
        repeated for a plan made without a depth, else a ConfigError."""
        if len(self.policies) == n_layers:
            return self
        if self.any_depth:
            return LayerPlan((self.policies[0],) * n_layers)
        raise ConfigError(
            f"the remat plan covers {len(self.policies)} layers (model.n_layers) but the model stacks "
            f"{n_layers}; set model.n_layers={n_layers}"
        )

    def segments(self) -> list[tuple[int, int, RematPolicy]]:
        """Returns ``(start, stop, policy)`` for each run of consecutive layers sharing a policy."""
        runs: list[tuple[int, int, RematPolicy]] = []
        for i, policy in enumerate(self.policies):
            if runs and runs[-1][2] == policy:
                runs[-1] = (runs[-1][0], i + 1, policy)
            else:
                runs.append((i, i + 1, policy))
        return runs

    def describe(self) -> str:
        """Returns e.g. "0-29: full, 30-31: none" ("every layer: full" for a plan without a depth)."""
        if self.any_depth:
            return f"every layer: {self.policies[0].name}"
        return ", ".join(
            f"{a}-{b - 1}: {p.name}" if b - a > 1 else f"{a}: {p.name}" for a, b, p in self.segments()
        )


@dataclasses.dataclass(frozen=True)
class ModulePlan:
    """Remat policies for submodules of a model that takes no plan (a third party's), by pattern.

        plan = ModulePlan.parse({"blocks_*": "full"})
        plan.match(("decoder", "blocks_3"), "DecoderBlock")   # ("blocks_*", full)

    A pattern is a glob (``fnmatch``, case-sensitive) matched against a submodule's path joined by
    ``/`` (``decoder/blocks_3``, ``layers/0``), its own name (``blocks_3``) or its class name
    (``DecoderBlock``). The outermost match wins: a matched module's submodules are not wrapped again.
    The model's root is never matched. :func:`remat_modules` applies a plan to an NNX model,
    :func:`shardmem.models.linen.remat_calls` to the Linen modules called inside it.
    """

    rules: tuple[tuple[str, RematPolicy], ...] = ()

    def __bool__(self) -> bool:
        return bool(self.rules)

    @staticmethod
    def parse(
        modules: Mapping[str, str],
        custom: Mapping[str, str] | None = None,
        *,
        tags: Sequence[str] | None = None,
        named: Sequence[str] | None = None,
    ) -> ModulePlan:
        """Builds the plan from ``remat.modules`` (pattern -> policy name; ``custom``, ``tags`` and
        ``named`` as for :meth:`RematPolicy.parse`)."""
        rules = []
        for pattern, name in modules.items():
            if not str(pattern).strip():
                raise ConfigError("remat.modules: a pattern is empty; name modules, e.g. 'blocks_*'")
            key = f"remat.modules.{pattern}"
            policy = RematPolicy.parse(str(name), custom, tags=tags, named=named, key=key)
            rules.append((str(pattern), policy))
        return ModulePlan(tuple(rules))

    def match(self, path: Sequence[object], class_name: str) -> tuple[str, RematPolicy] | None:
        """Returns ``(pattern, policy)`` for the submodule at ``path`` (None: no pattern names it, or
        it is the root); a ConfigError when two patterns name it."""
        if not path:
            return None
        joined = "/".join(str(part) for part in path)
        names = (joined, str(path[-1]), class_name)
        found = [(pattern, policy) for pattern, policy in self.rules
                 if any(fnmatch.fnmatchcase(name, pattern) for name in names)]  # fmt: skip
        if len(found) > 1:
            both = " and ".join(repr(pattern) for pattern, _ in found)
            raise ConfigError(
                f"remat.modules: the module {joined} ({class_name}) matches {both}; make the patterns "
                "name disjoint modules"
            )
        return found[0] if found else None

    def describe(self) -> str:
        """Returns e.g. "modules blocks_*: full" ("" for an empty plan)."""
        return "modules " + ", ".join(f"{p}: {policy.name}" for p, policy in self.rules) if self.rules else ""


def checkpointed_call(lift, method, policy: RematPolicy, module, args: tuple, kwargs: dict):
    """Calls ``method(module, *args, **kwargs)`` under ``lift`` (``nnx.remat`` or ``nn.checkpoint``,
    the transform that carries the module's variables through ``jax.checkpoint``) with ``policy``.
    Only array arguments are traced; Python values (``deterministic=True``, ``None``) stay static, as
    a block that branches on them expects."""
    leaves, tree = jax.tree.flatten((args, kwargs))
    dynamic = [i for i, leaf in enumerate(leaves) if isinstance(leaf, jax.Array | np.ndarray)]

    def call(module, *arrays):
        full = list(leaves)
        for i, array in zip(dynamic, arrays, strict=True):
            full[i] = array
        args, kwargs = jax.tree.unflatten(tree, full)
        return method(module, *args, **kwargs)

    return lift(call, policy=policy.lower())(module, *(leaves[i] for i in dynamic))


_REMAT_CLASSES: dict[tuple[type, RematPolicy], type] = {}


def remat_modules(model: nnx.Module, plan: ModulePlan, matched: set[str] | None = None) -> nnx.Module:
    """Returns ``model`` with the ``__call__`` of each NNX submodule ``plan`` names run under
    ``nnx.remat`` with its policy (changed in place: each matched module becomes an instance of a
    subclass of its class, so ``nnx.split``/``merge`` keep the wrapping). The patterns that named a
    module are added to ``matched``."""
    modules = sorted(nnx.iter_modules(model), key=lambda item: len(item[0]))  # Parents first.
    wrapped: list[tuple] = []
    for path, module in modules:
        if any(path[: len(done)] == done for done in wrapped):
            continue
        found = plan.match(path, type(module).__name__)
        if found is None:
            continue
        pattern, policy = found
        if matched is not None:
            matched.add(pattern)
        wrapped.append(tuple(path))
        if policy.remats:
            object.__setattr__(module, "__class__", _remat_class(type(module), policy))
    return model


def _remat_class(cls: type, policy: RematPolicy) -> type:
    key = (cls, policy)
    if key not in _REMAT_CLASSES:  # One class per (class, policy): graphdefs of two builds compare equal.
        call = cls.__call__

        def __call__(self, *args, **kwargs):
            return checkpointed_call(nnx.remat, call, policy, self, args, kwargs)

        namespace = {"__call__": __call__, "__module__": cls.__module__, "__qualname__": cls.__qualname__}
        _REMAT_CLASSES[key] = type(cls.__name__, (cls,), namespace)
    return _REMAT_CLASSES[key]


def layer_span(text: str) -> tuple[int, int] | None:
    """Parses a layer ("3") or an inclusive range of layers ("0-7") into ``(first, last)``; None when
    ``text`` is neither. ``remat.layers`` keys and ``pipeline.stages`` entries use it."""
    match = re.fullmatch(r"\s*(\d+)\s*(?:-\s*(\d+)\s*)?", text)
    return (int(match.group(1)), int(match.group(2) or match.group(1))) if match else None


def _parse_span(span: str, n_layers: int) -> tuple[int, int]:
    bounds = layer_span(span)
    if bounds is None:
        raise ConfigError(f'remat.layers: key {span!r} is not a layer or a range; write e.g. "3" or "0-7"')
    first, last = bounds
    if first > last:
        raise ConfigError(f'remat.layers.{span}: the range runs backwards; write it as "{last}-{first}"')
    if last >= n_layers:
        raise ConfigError(
            f"remat.layers.{span}: layers run from 0 to {n_layers - 1} (model.n_layers={n_layers}); "
            f"give a range inside that, or drop it (--set 'remat.layers={{}}' drops them all)"
        )
    return first, last + 1


_LAYER_POLICY: contextvars.ContextVar[RematPolicy | None] = contextvars.ContextVar(
    "shardmem_layer_policy", default=None
)


_LAYER_INDEX: contextvars.ContextVar[jax.Array | None] = contextvars.ContextVar(
    "shardmem_layer_index", default=None
)


def layer_index() -> jax.Array | None:
    """The index in the whole stack of the layer :func:`remat_scan` is tracing (a traced int32), where it
    was asked for (``indexed``); None otherwise (outside a scan, or in a pipeline stage's)."""
    return _LAYER_INDEX.get()


def layer_saves(names: Sequence[str]) -> bool:
    """Whether the layer :func:`remat_scan` is tracing keeps the outputs tagged ``names`` (projections)
    for its backward pass rather than recomputing them: with no remat, ``dots`` policies, or a policy
    that saves (or offloads) all of those names. Outside a scan: yes."""
    policy = _LAYER_POLICY.get()
    if policy is None or policy.saves in ("everything", "dots", "dots_no_batch"):
        return True
    return policy.saves == "names" and set(names) <= set(policy.save + policy.offload)


def remat_scan(layers: nnx.Module, x, plan: LayerPlan, *, prepare=None, mask=None, indexed: bool = False):
    """Runs stacked layers (an ``nnx.vmap``-created module with a leading ``layers`` axis) over ``x``.

    Each run of layers that shares a policy is one ``jax.lax.scan`` of a ``jax.checkpoint``-ed body, so
    compile time depends on the number of distinct segments, not on depth. With several segments each
    scans a slice of the stacked parameters, which XLA may materialize (in the compute dtype's weight
    size at most); one segment scans the stack in place. ``prepare`` maps one layer's stored parameters
    to those it runs with, inside its checkpointed body, so what it makes is recomputed rather than saved
    (the circular pipeline picks a repeat's weights with it). ``mask``, one bool per layer, skips the
    layers where it is False: they run, but pass their input through, so their parameters get zero
    gradients (a pipeline stage's padded layer slots). Inside a loss differentiated into gradient sums
    (:func:`shardmem.gradient_sums.value_and_grad_into`) each layer's weight gradient is added to its
    slice of the sums as the backward pass makes it. ``indexed``: the stack is the model's whole one, and
    each layer may read its index in it (:func:`layer_index`: a model whose layers differ by index, such as
    a window on some layers only).
    """
    graphdef, params, rest = nnx.split(layers, nnx.Param, ...)
    n_layers = jax.tree.leaves(params)[0].shape[0]
    plan = plan.for_layers(n_layers)
    # Variables other than parameters (batch statistics, RNG counters) may change in the call: each
    # layer returns its own, and the stack is updated with them after the scans.
    mutable = bool(jax.tree.leaves(rest))
    summing = gradient_sums.layer_sums()

    def body(carry, layer, policy):
        layer, index = layer
        layer, keep = layer if mask is not None else (layer, None)
        if prepare is not None:
            layer = (prepare(layer[0]), layer[1])
        module = nnx.merge(graphdef, *layer)
        y = _run_layer(module, carry, policy, index if indexed else None)
        if keep is not None:
            y = jax.numpy.where(keep, y, carry)
        return y, (nnx.split(module, nnx.Param, ...)[2] if mutable else None)

    # Under gradient accumulation each layer's weight gradient is added to the sums as it is made.
    if summing is not None and (prepare is not None or mask is not None):
        raise ValueError("remat_scan adds gradients into sums only for a plain stack (no prepare, no mask)")
    updates = []
    for start, stop, policy in plan.segments():
        segment = (params, rest) if mask is None else ((params, rest), mask)
        if (start, stop) != (0, n_layers):
            segment = jax.tree.map(lambda a, start=start, stop=stop: a[start:stop], segment)
        step = functools.partial(body, policy=policy)
        step = jax.checkpoint(step, policy=policy.lower(), prevent_cse=False) if policy.remats else step
        with jax.named_scope(_segment_scope(start, stop)):
            if summing is None:
                x, new_rest = jax.lax.scan(step, x, (segment, start + jax.numpy.arange(stop - start)))
            else:  # Its scan carries each layer's index beside it.
                x, new_rest = summing.scan(step, x, *segment, first=start)
        updates.append(new_rest)
    if mutable:
        nnx.update(layers, jax.tree.map(lambda *parts: jax.numpy.concatenate(parts), *updates))
    return x


def _run_layer(module: nnx.Module, x, policy: RematPolicy, index=None):
    token, indexing = _LAYER_POLICY.set(policy), _LAYER_INDEX.set(index)
    try:
        return module(x)
    finally:
        _LAYER_POLICY.reset(token)
        _LAYER_INDEX.reset(indexing)


def _segment_scope(start: int, stop: int) -> str:
    return f"layers_{start}-{stop - 1}" if stop - start > 1 else f"layers_{start}"


def _without_weights(pullback, weights: list) -> tuple[list, tuple]:
    """A ``jax.vjp`` pullback's residuals less ``weights`` (its primal inputs' leaves, found by identity),
    and the layout :func:`_with_weights` rebuilds it from: what a pass keeps need not hold weights that
    are there at its backward anyway."""
    leaves, treedef = jax.tree.flatten(pullback)
    weight_at = {id(w): i for i, w in enumerate(weights)}
    at = [weight_at.get(id(leaf)) for leaf in leaves]
    return [leaf for leaf, i in zip(leaves, at, strict=True) if i is None], (treedef, at)


def _with_weights(layout: tuple, kept: list, weights: list):
    """The pullback :func:`_without_weights` took apart, from what it kept and the weights again."""
    treedef, at = layout
    stored = iter(kept)
    return jax.tree.unflatten(treedef, [next(stored) if i is None else weights[i] for i in at])


class SlotRun:
    """The layers of a stack run forward and backward by hand, for a schedule that keeps the residuals
    itself: a 1F1B pipeline's ops (:meth:`shardmem.parallel.pipeline.Pipeline.loss`). ``layers`` is an
    ``nnx.vmap``-created module whose parameters are ``[*outer, layers, ...]`` (``outer`` axes before the
    layers: a pipeline stage's ``[repeats, layers, ...]``), read at the outer indices ``at`` each call
    gives (the repeat a tick runs). ``plan`` and ``mask`` (one bool per layer: False passes the input
    through) are the layers'.

    Each layer reads its weights out of the stack where they are, in its forward pass and again in its
    backward, so no layers are copied out whole. :meth:`forward` writes each layer's residuals (a
    ``jax.vjp`` pullback's, less the weights, which are there at the backward anyway) into ``rings`` at
    ``(ring, layer)``: differentiated by JAX, a scan over the layers would stack them in a buffer of its
    own, zero-filled every pass, for the caller to copy into its ring and out again. :meth:`backward` runs
    some of the layers back (a backward in parts), reading each layer's residuals from there and adding
    its weight gradient into the sums at its index as it makes it (one scatter-add, in place:
    :func:`shardmem.gradient_sums.added_at`)."""

    def __init__(self, layers: nnx.Module, plan: LayerPlan, mask=None, outer: int = 1):
        graphdef, params, rest = nnx.split(layers, nnx.Param, ...)
        if jax.tree.leaves(rest):
            raise ValueError("SlotRun runs a stack of parameters alone (no state)")
        self.params, self.mask, self.outer = params, mask, outer
        treedef, self.stack = jax.tree.structure(params), jax.tree.leaves(params)

        def runner(policy):
            def run(weights, x, keep):
                module = nnx.merge(graphdef, jax.tree.unflatten(treedef, weights), rest)
                y = _run_layer(module, x, policy)
                return y if keep is None else jax.numpy.where(keep, y, x)

            return jax.checkpoint(run, policy=policy.lower(), prevent_cse=False) if policy.remats else run

        segments = plan.for_layers(self.stack[0].shape[outer]).segments()
        self.segments = [(start, stop, runner(policy)) for start, stop, policy in segments]
        self._layouts: dict[int, tuple] = {}  # Each segment's pullback layout (_without_weights).

    def _weights(self, index, stack=None) -> list:
        """The stack's weights at ``index`` (the outer indices, then the layer), read in place."""

        def one(w):
            start = (*index, *(0,) * (w.ndim - len(index)))
            return jax.lax.dynamic_slice(w, start, (*(1,) * len(index), *w.shape[len(index):])).reshape(
                w.shape[len(index):])  # fmt: skip

        return [one(w) for w in (self.stack if stack is None else stack)]

    def _keep(self, start, stop):
        return None if self.mask is None else self.mask[start:stop]

    def _pullback(self, start, run, weights, x, keep):
        """``run``'s output and its pullback's residuals less ``weights``; records their layout."""
        y, pullback = jax.vjp(lambda w, x: run(w, x, keep), weights, x)
        kept, self._layouts[start] = _without_weights(pullback, weights)
        return y, kept

    def rings(self, x, passes: int) -> list[list[jax.Array]]:
        """Zeroed rings of ``passes`` passes' residuals on input ``x``: a list of arrays per segment of
        the plan, each ``[passes, the segment's layers, ...]``."""
        rings = []
        for start, stop, run in self.segments:
            on_host = []  # Which residuals a policy offloads: their ring is in host memory too.

            def kept(stack, x, keep, start=start, run=run, on_host=on_host):
                index = (*(0,) * self.outer, start)  # Any layer's: the same shapes.
                kept = self._pullback(start, run, self._weights(index, stack), x, keep)[1]
                on_host.extend(jax.typeof(a).memory_space == jax.memory.Space.Host for a in kept)
                return kept

            keep = None if self.mask is None else self.mask[start]
            shapes = jax.eval_shape(kept, self.stack, x, keep)
            zeros = [jax.numpy.zeros((passes, stop - start, *a.shape), a.dtype) for a in shapes]
            rings.append([jax.device_put(z, jax.memory.Space.Host) if host else z
                          for z, host in zip(zeros, on_host, strict=True)])  # fmt: skip
        return rings

    def forward(self, at: tuple, x, rings: list, ring):
        """Returns the layers' output on ``x`` and ``rings`` with their residuals at pass ``ring``."""
        out = []
        for (start, stop, run), leaves in zip(self.segments, rings, strict=True):

            def body(carry, i_keep, start=start, run=run):
                x, leaves = carry
                i, keep = i_keep
                # The layer index through a barrier with the rings, which the op changes: a layer's weight
                # slice then stays in the op. A run of one layer is no loop, its slice invariant in the
                # op's own (pipeline._run_one_of), and XLA hoisted it out into the tick, where every op's
                # slices were made and held, each tick, whichever op ran.
                i, leaves = jax.lax.optimization_barrier((i, leaves))
                y, kept = self._pullback(start, run, self._weights((*at, i)), x, keep)
                leaves = [jax.lax.dynamic_update_slice(r, k[None, None], (ring, i - start, *(0,) * k.ndim))
                          for r, k in zip(leaves, kept, strict=True)]  # fmt: skip
                return (y, leaves), None

            layers = (jax.numpy.arange(start, stop), self._keep(start, stop))
            with jax.named_scope(_segment_scope(start, stop)):
                (x, leaves), _ = jax.lax.scan(body, (x, leaves), layers)
            out.append(leaves)
        return x, out

    def backward(self, at: tuple, dy, rings: list, ring, sums, first: int = 0, stop: int | None = None):
        """The backward pass of layers ``first`` .. ``stop - 1`` of :meth:`forward`'s pass ``ring``, from
        the gradient ``dy`` of their output: returns ``(dx, sums)``, the sums (a tree like the stack's
        parameters) with each layer's weight gradient added at its index."""
        gradient_sums.check_pairs(sums, self.params)
        stop = self.segments[-1][1] if stop is None else stop
        sum_leaves = jax.tree.leaves(sums)
        for (start, end, _), leaves in reversed(list(zip(self.segments, rings, strict=True))):
            lo, hi = max(start, first), min(end, stop)
            if lo >= hi:
                continue
            layout = self._layouts[start]

            def body(carry, i, start=start, leaves=leaves, layout=layout):
                dy, sum_leaves = carry
                i, sum_leaves = jax.lax.optimization_barrier((i, sum_leaves))  # As in forward.
                index = (*at, i)
                at_pass = (ring, i - start)
                kept = [jax.lax.dynamic_slice(r, (*at_pass, *(0,) * (r.ndim - 2)), (1, 1, *r.shape[2:]))
                        .reshape(r.shape[2:]) for r in leaves]  # fmt: skip
                d_weights, dx = _with_weights(layout, kept, self._weights(index))(dy)
                sum_leaves = [gradient_sums.added_at(s, index, d)
                              for s, d in zip(sum_leaves, d_weights, strict=True)]  # fmt: skip
                return (dx, sum_leaves), None

            with jax.named_scope(_segment_scope(lo, hi)):
                layers = jax.numpy.arange(lo, hi)
                (dy, sum_leaves), _ = jax.lax.scan(body, (dy, sum_leaves), layers, reverse=True)
        return dy, jax.tree.unflatten(jax.tree.structure(sums), sum_leaves)
