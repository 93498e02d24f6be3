"""The serving program: prefill and decode with a KV cache, sharded by the same config as training.

    program = build_serving(describe(config, mesh, serving=True))   # or serving_program(config, mesh)
    weights = program.init()              # from train.seed, or finetune.init_from's pretrained weights
    logits_BxV, cache = program.prefill(weights, prompts_BxP, lengths_B)
    logits_BxV, cache = program.decode(weights, cache, tokens_B, positions_B)   # the cache donated

``prefill`` takes a batch of prompts right-padded to ``serve.prompt_len`` with each one's length, and
returns the logits of each prompt's last token and a new KV cache (:mod:`shardmem.models.kv_cache`)
holding their keys and values. ``decode`` takes one token per sequence at each sequence's own position
(the first: its prompt's length), writes its keys and values into the cache in place (the cache is
donated) and returns the next logits. Both run the reference model's own layers
(:meth:`~shardmem.models.llama.Llama.cached_hidden_states`): the training forward with a cache. Both
are jitted with explicit shardings -- the weights by the rules, the cache's batch over the data replicas
and its KV heads over ``tensor`` -- and listed in :attr:`ServingProgram.functions` with abstract
arguments, so :func:`~shardmem.planning.memory.plan_program` compiles them for a target without
allocating anything. Sampling and the generation loop are :mod:`shardmem.run.generation`'s.
"""

from __future__ import annotations

import dataclasses
import warnings
from collections.abc import Callable
from typing import Any, ClassVar

import jax
import jax.numpy as jnp
from flax import nnx
from jax.sharding import Mesh

from shardmem.config import Config
from shardmem.models.kv_cache import KVCache
from shardmem.parallel.rules import constrain
from shardmem.program.description import Description, Serving, describe
from shardmem.program.model import sharded
from shardmem.program.program import Function, Program

#: XLA options prefill and decode compile with (and are planned with). XLA's GPU compiler merges matmuls
#: that share an input into one over their weights concatenated, a copy of those weights at every call:
#: in a decode step, which reads each weight once, that copy doubles the query, key and value weights'
#: traffic.
COMPILER_OPTIONS = {"xla_gpu_dot_merger_threshold_mb": 0}


@dataclasses.dataclass
class ServingProgram(Program):
    """The jitted prefill and decode of a serving program (see the module docstring), ready to run or
    only to compile. ``init()`` returns the weights: every parameter, frozen, in ``precision.compute``
    or quantized by ``serve.quantize`` (the description's ``abstract_frozen`` tree)."""

    prefill: Callable  # jitted (weights, prompts_BxP, lengths_B) -> (logits_BxV, cache)
    decode: Callable  # jitted (weights, cache, tokens_B, positions_B) -> (logits_BxV, cache); cache donated
    start_from: Callable  # (model params) -> weights: pretrained weights in (donated).

    kind: ClassVar[str] = "serving"

    @property
    def functions(self) -> tuple[Function, ...]:
        """Prefill and decode, planned with the abstract weights, prompts and cache; the report lists the
        weights, the KV cache (decode's argument; prefill's output) and the tokens per device."""
        s, weights = self.serving, self.abstract_weights
        rows = jax.ShapeDtypeStruct((s.batch,), jnp.int32, sharding=s.rows)
        prompts = jax.ShapeDtypeStruct((s.batch, s.prompt_len), jnp.int32, sharding=s.tokens)
        prefill = Function("prefill", self.prefill, (weights, prompts, rows),
                           {"params": weights, "batch": {"prompts": prompts, "lengths": rows}},
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
        """The weights as ``jax.ShapeDtypeStruct`` with their shardings."""
        return sharded(self.description.abstract_frozen, self.description.frozen_shardings)


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
    prefill, decode = _jitted(description)
    init, start = _initializers(description)

    def init_or_load():
        if description.init_from is None:
            return init(jax.random.key(description.seed))
        from shardmem.finetune.weights import load_weights  # safetensors or Orbax, only when loading

        params = load_weights(description.init_from, program)
        with warnings.catch_warnings():  # A quantized tensor has no output of its shape to reuse.
            warnings.filterwarnings("ignore", "Some donated buffers were not usable")
            return start(params)

    program = ServingProgram(description, init_or_load, build_serving, prefill, decode, start)
    return program


def _jitted(d: Description) -> tuple[Callable, Callable]:
    """The jitted prefill and decode (see the module docstring)."""
    s, mesh, rules, finetune = d.serving, d.mesh, d.rules, d.finetune
    m = d.config.model
    graphdef = d.model.graphdef

    def model_of(weights):
        return nnx.merge(graphdef, finetune.assemble({}, weights))

    def logits(model, h_BxD):
        logits_BxV = h_BxD @ model.unembedding()
        return constrain(logits_BxV, ("batch", "vocab")).astype(jnp.float32)

    def prefill(weights, prompts_BxP, lengths_B):
        with rules.activate(mesh):
            model = model_of(weights)
            cache = KVCache.zeros(layers=m.n_layers, batch=s.batch, max_len=s.max_len, kv_heads=m.n_kv_heads,
                                  head_dim=m.head_size, dtype=s.kv_dtype)  # fmt: skip
            cache = jax.lax.with_sharding_constraint(cache, s.cache_shardings)
            positions_P = jnp.arange(prompts_BxP.shape[1])
            h_BxPxD, cache = model.cached_hidden_states(prompts_BxP, cache, positions_P, prefill=True)
            last_Bx1x1 = (lengths_B - 1)[:, None, None]  # Each prompt's last token gives the next one.
            h_BxD = jnp.take_along_axis(h_BxPxD, last_Bx1x1, axis=1)[:, 0]
            return logits(model, h_BxD), cache

    def decode(weights, cache, tokens_B, positions_B):
        with rules.activate(mesh):
            model = model_of(weights)
            h_Bx1xD, cache = model.cached_hidden_states(tokens_B[:, None], cache, positions_B[:, None],
                                                        prefill=False)  # fmt: skip
            return logits(model, h_Bx1xD[:, 0]), cache

    rows, weights = s.rows, d.frozen_shardings
    outputs = (s.logits, s.cache_shardings)
    return (
        jax.jit(prefill, in_shardings=(weights, s.tokens, rows), out_shardings=outputs,
                compiler_options=COMPILER_OPTIONS),
        jax.jit(decode, in_shardings=(weights, s.cache_shardings, rows, rows), out_shardings=outputs,
                donate_argnums=1, compiler_options=COMPILER_OPTIONS),
    )  # fmt: skip


def _initializers(d: Description) -> tuple[Callable, Callable]:
    """The jitted ``init(key) -> weights`` (the model initialised from ``key``) and ``start(params) ->
    weights`` (from the model's pretrained parameters, donated), each with the weights' shardings."""
    factory, finetune = d.model.factory.build, d.finetune

    def init_weights(key):
        with nnx.use_eager_sharding(False):
            model = factory(nnx.Rngs(key))
        return finetune.prepare(nnx.to_pure_dict(nnx.state(model, nnx.Param)), key)[1]

    init = jax.jit(init_weights, out_shardings=d.frozen_shardings)
    start = jax.jit(lambda params: finetune.prepare(params, jax.random.key(d.seed))[1],
                    out_shardings=d.frozen_shardings, donate_argnums=0)  # fmt: skip
    return init, start
