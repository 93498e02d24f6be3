"""The serving program: prefill and decode with a KV cache, sharded by the same config as training.

    program = build_serving(describe(config, mesh, serving=True))   # or serving_program(config, mesh)
    weights = program.init()              # from train.seed, or finetune.init_from's pretrained weights
    cache = program.new_cache()            # the KV cache, allocated once, as serving engines do
    logits_BxV, cache = program.prefill(weights, cache, prompts_BxP, lengths_B)   # the cache donated
    logits_BxV, cache = program.decode(weights, cache, tokens_B, positions_B)     # the cache donated

The weights are stored by layer (:func:`by_layer`: ``weights["layers"]`` a tuple of each layer's
parameters, not one stack of them), so that XLA compiles the identical layers to the same kernels, and
each layer's query, key and value weights fused into one matrix, its gate and up weights into another
(:func:`serving_layout`, :mod:`shardmem.models.fused`), so that a decode step runs one matmul for each.
``new_cache`` allocates the KV cache (:mod:`shardmem.models.kv_cache`) in its shardings, once, as a
serving engine does at start-up. ``prefill`` takes it with a batch of prompts right-padded to
``serve.prompt_len`` and each one's length, writes every layer's keys and values of the prompts into it
in place as the layer runs (the cache is donated), and returns the logits of each prompt's last token and
the cache. ``decode`` takes one token per sequence at each sequence's own position (the first: its
prompt's length), writes its keys and values into the cache in place (donated too) and returns the next
logits. Both run the reference model's own layers
(:meth:`~shardmem.models.llama.Llama.cached_hidden_states`): the training forward with a cache. A model
of your own runs its ``cached_call`` instead (:mod:`shardmem.program.user_serving`), its weights its own
parameter tree (neither by layer nor fused), the cache in the shape its ``cache_layout()`` gives. Both
are jitted with explicit shardings -- the weights by the rules, the cache's batch over the data replicas
and its KV heads over ``tensor`` -- and listed in :attr:`ServingProgram.functions` with abstract
arguments, so :func:`~shardmem.planning.memory.plan_program` compiles them for a target without
allocating anything. Sampling and the generation loop are :mod:`shardmem.run.generation`'s.
"""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Callable
from typing import Any, ClassVar

import jax
import jax.numpy as jnp
from flax import nnx
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

from shardmem.config import Config
from shardmem.models.attention import soft_cap
from shardmem.models.fused import Fused, fuse_layer, unfuse_layer
from shardmem.models.kv_cache import attending_with
from shardmem.parallel.rules import constrain
from shardmem.program import user_serving
from shardmem.program.description import Description, Serving, describe
from shardmem.program.model import sharded
from shardmem.program.program import Function, Program, loading

#: XLA options prefill and decode compile with (and are planned with). XLA's GPU compiler merges matmuls
#: that share an input into one over their weights concatenated, a copy of those weights at every call:
#: in a decode step, which reads each weight once, that copy doubles the query, key and value weights'
#: traffic. And its rematerialization, which recomputes values to bring a program under the memory
#: limit, counts a donated KV cache twice (its limit is less the outputs, its peak holds the arguments,
#: and the cache is both): once weights and twice the cache pass 80% of the allocator's memory, it
#: recomputed a prefill's q/k/v matmuls for room that was never short (Llama 2 7B, 384 prompts of 128
#: tokens on an A100: 31 of 32 layers', +24% FLOPs). Serving's forward-only programs keep nothing it
#: could save, so they compile without it.
COMPILER_OPTIONS = {"xla_gpu_dot_merger_threshold_mb": 0, "xla_disable_hlo_passes": "rematerialization"}


@dataclasses.dataclass
class ServingProgram(Program):
    """The jitted prefill and decode of a serving program (see the module docstring), ready to run or
    only to compile, of the reference model or of a model of your own with a cache-aware call.
    ``init()`` returns the weights: every parameter, frozen, in ``precision.compute`` or quantized by
    ``serve.quantize`` (the description's ``abstract_frozen`` tree, laid out by :func:`serving_layout`)."""

    prefill: Callable  # jitted (weights, cache, prompts_BxP, lengths_B) -> (logits_BxV, cache); cache donated
    decode: Callable  # jitted (weights, cache, tokens_B, positions_B) -> (logits_BxV, cache); cache donated
    start_from: Callable  # (model params) -> weights: pretrained weights in (donated).
    new_cache: Callable  # jitted () -> the KV cache, zeros, in its shardings.

    kind: ClassVar[str] = "serving"

    @property
    def functions(self) -> tuple[Function, ...]:
        """Prefill and decode, planned with the abstract weights, prompts and cache; the report lists the
        weights, the KV cache (both functions' argument, donated) and the tokens per device."""
        s, weights = self.serving, self.abstract_weights
        rows = jax.ShapeDtypeStruct((s.batch,), jnp.int32, sharding=s.rows)
        prompts = jax.ShapeDtypeStruct((s.batch, s.prompt_len), jnp.int32, sharding=s.tokens)
        batch = {"prompts": prompts, "lengths": rows}
        prefill = Function("prefill", self.prefill, (weights, s.cache, prompts, rows),
                           {"params": weights, "kv_cache": s.cache, "batch": batch},
                           tokens=s.batch * s.prompt_len, compiler_options=COMPILER_OPTIONS)  # fmt: skip
        groups = {"params": weights, "kv_cache": s.cache, "batch": {"tokens": rows, "positions": rows}}
        decode = Function("decode", self.decode, (weights, s.cache, rows, rows), groups, tokens=s.batch,
                          compiler_options=COMPILER_OPTIONS)  # fmt: skip
        return prefill, decode

    @property
    def serving(self) -> Serving:
        """The description's serving decisions: the batch, the lengths, the KV cache's layout."""
        return self.description.serving

    @property
    def abstract_weights(self):
        """The weights as ``jax.ShapeDtypeStruct`` with their shardings (:func:`serving_layout`)."""
        d = self.description
        return sharded(serving_layout(d.abstract_frozen, d), self.weight_shardings)

    @property
    def weight_shardings(self):
        """The weights' shardings: the description's ``frozen_shardings``, :func:`serving_layout`."""
        d = self.description
        return serving_layout(d.frozen_shardings, d)


def by_layer(tree, layers: int) -> dict:
    """Returns a tree of the model's parameters (arrays, ``ShapeDtypeStruct``, or their shardings) with
    its ``layers`` subtree, stacked over a leading axis of ``layers``, split into a tuple of each layer's.

    The serving program stores its weights so: its prefill and decode run the layers unrolled (see
    :meth:`~shardmem.models.llama.Llama.cached_hidden_states`), and each layer's matmuls read arrays of
    their own. Given slices of one stack instead, XLA fuses each slice into its layer's kernels, so no
    two layers' kernels are the same and a plan generates every layer's (BENCHMARKS.md, issue 39). The
    bytes are the same; :func:`stacked` undoes it."""
    return {**tree, "layers": tuple(jax.tree.map(functools.partial(_layer, index), tree["layers"])
                                    for index in range(layers))}  # fmt: skip


def serving_layout(tree, description: Description) -> dict:
    """Returns the model's parameters ``tree`` (arrays, ``ShapeDtypeStruct`` or their shardings, stacked
    as the description's ``abstract_frozen``) as the serving program stores its weights: by layer
    (:func:`by_layer`), each layer's query, key and value weights fused into one matrix and its gate and
    up weights into another (:func:`~shardmem.models.fused.fuse_layer`), so that a decode step runs one
    matmul for each group and reads each weight once. A model of your own's are its own tree as it is."""
    if description.model.factory.custom:
        return tree
    layers = description.config.model.n_layers
    abstract = by_layer(description.abstract_frozen, layers)["layers"]
    shardings = by_layer(description.frozen_shardings, layers)["layers"]
    tree = by_layer(tree, layers)
    return {**tree, "layers": tuple(fuse_layer(layer, shapes, layout)
                                    for layer, shapes, layout in zip(tree["layers"], abstract, shardings,
                                                                     strict=True))}  # fmt: skip


def stacked(weights) -> dict:
    """Returns the reference model's serving ``weights`` (:func:`serving_layout`) with their layers
    unfused and stacked again: the model's own parameter tree (a copy of the layers' arrays). A model of
    your own's weights are its tree already."""
    layers = [unfuse_layer(layer) for layer in weights["layers"]]
    return {**weights, "layers": jax.tree.map(lambda *each: jnp.stack(each), *layers)}


def _layer(index: int, leaf):
    """One layer's part of a stacked ``leaf``: an array's row, a ``ShapeDtypeStruct``'s or a sharding's
    without the layer axis (never sharded: serving has no pipeline stages)."""
    if isinstance(leaf, NamedSharding):
        return NamedSharding(leaf.mesh, P(*leaf.spec[1:]), memory_kind=leaf.memory_kind)
    if isinstance(leaf, jax.ShapeDtypeStruct):
        sharding = None if leaf.sharding is None else _layer(index, leaf.sharding)
        return jax.ShapeDtypeStruct(leaf.shape[1:], leaf.dtype, sharding=sharding)
    return leaf[index]


def serving_program(config: Config, mesh: Mesh, **arguments: Any) -> ServingProgram:
    """Returns the serving program of ``config`` on ``mesh``: ``build_serving(describe(config, mesh,
    serving=True, **arguments))``; ``arguments`` are :func:`~shardmem.program.description.describe`'s
    (``attention=`` overrides the prefill's kernel). Nothing the size of the model is allocated until
    ``program.init`` is called."""
    return build_serving(describe(config, mesh, serving=True, **arguments))


def build_serving(description: Description) -> ServingProgram:
    """Returns the serving program of ``description`` (resolved with ``serving=True``): the jitted
    prefill and decode, and ``init`` from ``train.seed`` or from ``finetune.init_from``'s weights."""
    if description.serving is None:
        raise ValueError("build_serving needs a description resolved with serving=True")
    prefill, decode, new_cache = _jitted(description)
    init, start = _initializers(description)

    def init_or_load():
        if description.init_from is None:
            return init(jax.random.key(description.seed))
        from shardmem.finetune.weights import load_weights  # safetensors or Orbax, only when loading

        return start(load_weights(description.init_from, program))

    program = ServingProgram(description, init_or_load, build_serving, prefill, decode, start, new_cache)
    return program


def _jitted(d: Description) -> tuple[Callable, Callable, Callable]:
    """The jitted prefill, decode and new_cache (see the module docstring), of the reference model or
    of a model of your own (:func:`_user_functions`), with the same signatures and shardings."""
    s = d.serving
    prefill, decode = _user_functions(d) if d.model.factory.custom else _reference_functions(d)

    def new_cache():
        return s.layout.zeros(batch=s.batch, max_len=s.max_len, dtype=s.kv_dtype)

    rows, weights = s.rows, serving_layout(d.frozen_shardings, d)
    outputs = (s.logits, s.cache_shardings)
    return (
        jax.jit(prefill, in_shardings=(weights, s.cache_shardings, s.tokens, rows), out_shardings=outputs,
                donate_argnums=1, compiler_options=COMPILER_OPTIONS),
        jax.jit(decode, in_shardings=(weights, s.cache_shardings, rows, rows), out_shardings=outputs,
                donate_argnums=1, compiler_options=COMPILER_OPTIONS),
        jax.jit(new_cache, out_shardings=s.cache_shardings),
    )  # fmt: skip


def _logits(logits_BxV, cap: float | None = None):
    """The step's logits in float32, soft-capped at ``cap`` (``model.logit_softcap``) when given."""
    return soft_cap(constrain(logits_BxV, ("batch", "vocab")).astype(jnp.float32), cap)


def _reference_functions(d: Description) -> tuple[Callable, Callable]:
    """The reference model's prefill and decode, its layers reading their weights by layer."""
    mesh, rules, finetune = d.mesh, d.rules, d.finetune
    m = d.config.model
    graphdef = d.model.graphdef

    def model_of(weights):
        """The model, whose layers' parameters are stand-ins, and each layer's parameters (by_layer), its
        fused groups (models/fused.py) as they are."""
        layers = weights["layers"]
        shapes = [unfuse_layer(jax.tree.map(lambda w: jax.ShapeDtypeStruct(w.shape, w.dtype), layer))
                  for layer in layers]  # fmt: skip
        stand_ins = jax.tree.map(lambda *each: jax.ShapeDtypeStruct((len(each), *each[0].shape),
                                                                    each[0].dtype), *shapes)  # fmt: skip
        model = nnx.merge(graphdef, finetune.assemble({}, {**weights, "layers": stand_ins}))
        return model, [{**finetune.assemble({}, {"layers": _apart(layer, False)})["layers"],
                        **_apart(layer, True)} for layer in layers]  # fmt: skip

    # Dynamic RoPE's frequencies follow each step's longest real token over the batch (models/rope.py).
    per_forward = m.rope_scaling is not None and m.rope_scaling.per_forward

    # The prefill writes into the cache it is given (donated), as a serving engine fills the cache it
    # allocated at start-up: made inside, it was a broadcast of zeros every prefill wrote in full.
    def prefill(weights, cache, prompts_BxP, lengths_B):
        with rules.activate(mesh):
            model, layers = model_of(weights)
            positions_P = jnp.arange(prompts_BxP.shape[1])
            longest = jnp.max(lengths_B) if per_forward else None  # Padding has no position.
            h_BxPxD, cache = model.cached_hidden_states(prompts_BxP, cache, positions_P, layers, prefill=True,
                                                        rope_length=longest, lengths=lengths_B)  # fmt: skip
            last_Bx1x1 = (lengths_B - 1)[:, None, None]  # Each prompt's last token gives the next one.
            h_BxD = jnp.take_along_axis(h_BxPxD, last_Bx1x1, axis=1)[:, 0]
            return _logits(h_BxD @ model.unembedding(), m.logit_softcap), cache

    def decode(weights, cache, tokens_B, positions_B):
        with rules.activate(mesh):
            model, layers = model_of(weights)
            longest = jnp.max(positions_B) + 1 if per_forward else None
            h_Bx1xD, cache = model.cached_hidden_states(
                tokens_B[:, None], cache, positions_B[:, None], layers, prefill=False, rope_length=longest
            )
            return _logits(h_Bx1xD[:, 0] @ model.unembedding(), m.logit_softcap), cache

    return prefill, decode


def _user_functions(d: Description) -> tuple[Callable, Callable]:
    """A model of your own's prefill and decode: its ``cached_call`` (:mod:`shardmem.program.user_serving`)
    on its own parameter tree, attending with the description's kernel, the logits of each prompt's last
    real token."""
    mesh, rules, finetune, graphdef = d.mesh, d.rules, d.finetune, d.model.graphdef

    def prefill(weights, cache, prompts_BxP, lengths_B):
        with rules.activate(mesh), attending_with(d.attention):
            model = nnx.merge(graphdef, finetune.assemble({}, weights))
            last_B = lengths_B - 1  # Each prompt's last token gives the next one.
            logits_BxLxV, cache = user_serving.prefill_call(model, prompts_BxP, cache, last_B)
            if logits_BxLxV.shape[1] > 1:  # Every position's (a call without logits_at).
                logits_BxLxV = jnp.take_along_axis(logits_BxLxV, last_B[:, None, None], axis=1)
            return _logits(logits_BxLxV[:, 0]), cache

    def decode(weights, cache, tokens_B, positions_B):
        with rules.activate(mesh), attending_with(d.attention):
            model = nnx.merge(graphdef, finetune.assemble({}, weights))
            logits_Bx1xV, cache = model.cached_call(tokens_B[:, None], cache, positions_B[:, None],
                                                    prefill=False)  # fmt: skip
            return _logits(logits_Bx1xV[:, 0]), cache

    return prefill, decode


def _initializers(d: Description) -> tuple[Callable, Callable]:
    """The jitted ``init(key) -> weights`` (the model initialised from ``key``) and ``start(params) ->
    weights`` (from the model's pretrained parameters, donated), each with the weights' shardings."""
    factory, finetune = d.model.factory.build, d.finetune

    def init_weights(key):
        with nnx.use_eager_sharding(False):
            model = factory(nnx.Rngs(key))
        return serving_layout(finetune.prepare(nnx.to_pure_dict(nnx.state(model, nnx.Param)), key)[1], d)

    shardings = serving_layout(d.frozen_shardings, d)
    init = jax.jit(init_weights, out_shardings=shardings)

    def start_weights(params):
        return serving_layout(finetune.prepare(params, jax.random.key(d.seed))[1], d)

    start = loading(jax.jit(start_weights, out_shardings=shardings, donate_argnums=0))
    return init, start


def _apart(layer: dict, fused: bool) -> dict:
    """A layer's fused groups (``fused``), or its other weights."""
    return {name: w for name, w in layer.items() if isinstance(w, Fused) == fused}
