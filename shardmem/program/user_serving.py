"""Serving a model of your own: the cache-aware call it exposes, checked and run by the serving program.

    class Decoder(nnx.Module):
        def cache_layout(self) -> shardmem.CacheLayout:        # the KV cache's shape
            return shardmem.CacheLayout(layers=len(self.blocks), kv_heads=2, head_dim=16)

        def cached_call(self, tokens_BxL, cache, positions, *, prefill):   # -> (logits_BxLxV, cache)
            x_BxLxD = self.embed[...][tokens_BxL]
            for layer, block in enumerate(self.blocks):        # each attention layer, its own slot
                x_BxLxD, cache = block(x_BxLxD, shardmem.CacheSlot(cache, layer, positions, prefill))
            return self.head(x_BxLxD), cache

A prefill's ``tokens_BxL`` are the prompts, right-padded to ``serve.prompt_len``, at ``positions`` ``[L]``
(0 .. L-1); a decode step's are one token per sequence (``L`` = 1) at ``positions`` ``[B, 1]``, each
sequence's own. ``cache`` is a :class:`~shardmem.models.kv_cache.KVCache` that shardmem allocates in the
layout's shape, sharded by the rules (:data:`~shardmem.models.kv_cache.CACHE_AXES`), and donates to each
call. Inside an attention layer, ``slot.attend(None, q_BxLxHxK, k_BxLxGxK, v_BxLxGxK, window=...)``
writes the step's keys and values and returns ``(ctx_BxLxHxK, cache)``: causal attention over the prompt
in a prefill, over the cache up to each sequence's position in a decode step, with an int8 cache
quantized and read back. It attends with the kernel the reference model would run on the mesh's devices
(:func:`attention`): on GPUs cuDNN's flash attention in a prefill (no ``L x L`` scores) and the Pallas
decode kernel over the cache. The layer applies its own position embedding (rotary: at
``slot.positions``) before it. The serving program takes each prompt's logits at its last real token; a
call that takes ``logits_at`` (as transformers' ``logits_to_keep``) is given, in a prefill, each prompt's
last real token's index ``[B]`` and returns those positions' logits only (``[B, 1, V]``), where one
without it computes every position's.
"""

from __future__ import annotations

import inspect

import jax
import jax.numpy as jnp
from flax import nnx
from jax.sharding import Mesh

from shardmem.config import Config
from shardmem.errors import ConfigError
from shardmem.models.attention import AttentionKernel, resolve_for_devices
from shardmem.models.kv_cache import CacheLayout, KVCache
from shardmem.parallel.rules import Rules
from shardmem.program.model import Model

#: Where the guide says what to add.
GUIDE = "docs/guides/your-own-model.md#serving-it"


def cache_layout(config: Config, model: Model, mesh: Mesh, rules: Rules, *,
                 passed: bool) -> tuple[CacheLayout, int]:  # fmt: skip
    """Returns the model's :class:`CacheLayout` and its vocabulary (the logits' last axis, from its
    ``cached_call`` traced on abstract prompts); raises ConfigError, one line naming what to add, for a
    model without the cache-aware call, or one whose call or layout is not as the protocol says.
    ``passed``: the model came as ``model_factory=`` (in code), not from ``model.factory``."""
    factory = None if passed else getattr(config.model, "factory", None)
    where = f"model.factory={factory}" if factory else "the model passed as model_factory"
    abstract = nnx.merge(model.graphdef, model.abstract_params, model.abstract_rest)
    name = type(abstract).__name__
    missing = [m for m in ("cached_call", "cache_layout") if not callable(getattr(abstract, m, None))]
    if missing:
        raise ConfigError(
            f"{where}: serving needs the model's cache-aware call, and {name} has no "
            f"{' or '.join(missing)}; add cached_call(tokens_BxL, cache, positions, *, prefill) -> "
            f"(logits_BxLxV, cache) and cache_layout() -> shardmem.CacheLayout (see {GUIDE})"
        )
    if model.has_rest:
        raise ConfigError(
            f"{where}: {name} holds variables other than nnx.Param (batch statistics, RNG streams), which a "
            "serving program does not carry; build the model without them for serving (e.g. no dropout "
            f"rngs), see {GUIDE}"
        )
    layout = abstract.cache_layout()
    if not isinstance(layout, CacheLayout):
        raise ConfigError(f"{where}: {name}.cache_layout() returned a {type(layout).__name__}; return "
                          "shardmem.CacheLayout(layers=..., kv_heads=..., head_dim=...)")  # fmt: skip
    for field in ("layers", "kv_heads", "head_dim", "window"):
        value = getattr(layout, field)
        if (value is not None or field != "window") and (not isinstance(value, int) or value < 1):
            also = " (or None: no window)" if field == "window" else ""
            raise ConfigError(f"{where}: {name}.cache_layout().{field}={value!r}; give a positive "
                              f"integer{also}")  # fmt: skip
    if layout.ring:  # Its layers index the one stack (CacheSlot without a ring): a ring would be misread.
        raise ConfigError(f"{where}: {name}.cache_layout().ring={layout.ring!r}: a model of your own's "
                          "layers keep their keys in the one stack of the cache; leave ring out "
                          "(window= still bounds what a decode step reads)")  # fmt: skip
    try:  # What the serving program passes it, before it is traced.
        inspect.signature(abstract.cached_call).bind("tokens", "cache", "positions", prefill=True)
    except TypeError as e:
        raise ConfigError(f"{where}: {name}.cached_call cannot take (tokens_BxL, cache, positions, "
                          f"prefill=...): {e}; give it that signature (see {GUIDE})") from None  # fmt: skip
    serve = config.serve
    cache = jax.eval_shape(lambda: layout.zeros(batch=serve.batch, max_len=serve.max_len, dtype="float32"))
    prompts = jax.ShapeDtypeStruct((serve.batch, serve.prompt_len), jnp.int32)

    def call(params, prompts_BxP, cache):
        with rules.activate(mesh):
            merged = nnx.merge(model.graphdef, params)
            return prefill_call(merged, prompts_BxP, cache, jnp.full(serve.batch, serve.prompt_len - 1))

    out = jax.eval_shape(call, model.abstract_params, prompts, cache)
    length, what = (1, "1 (its logits_at)") if takes_logits_at(abstract) else (serve.prompt_len, "length")
    if not (isinstance(out, tuple) and len(out) == 2 and isinstance(out[1], KVCache)
            and getattr(out[0], "ndim", 0) == 3 and out[0].shape[:2] == (serve.batch, length)):  # fmt: skip
        got = jax.tree.map(lambda x: list(getattr(x, "shape", [])), out)
        if isinstance(out, tuple) and len(out) == 2 and isinstance(out[1], KVCache):  # The logits are off.
            got = f"logits {got[0]}"
        raise ConfigError(f"{where}: {name}.cached_call returned {got} for prompts "
                          f"{[serve.batch, serve.prompt_len]}; return (logits [batch, {what}, vocab], the "
                          "cache it was given, written)")  # fmt: skip
    return layout, out[0].shape[2]


def attention(config: Config, mesh: Mesh, layout: CacheLayout,
              requested: AttentionKernel | None) -> AttentionKernel:  # fmt: skip
    """Returns the kernel the model's ``CacheSlot.attend(None, ...)`` attends with in the serving program:
    ``requested`` (``describe``'s ``attention=``), checked as the reference model's is, or the one
    ``model.attention=auto`` resolves for the mesh's devices in ``precision.compute`` and the model's
    heads and window (cuDNN's flash attention on a GPU where it takes the heads, Pallas's where it does
    not; query blocks on CPUs). Raises ConfigError where a Pallas kernel cannot tile the prompts (a
    deviceless plan compiles one in cuDNN's place)."""
    prompt_len = config.serve.prompt_len
    if requested is None:
        requested = resolve_for_devices(
            "auto",
            mesh.devices.flat,
            dtype=config.precision.compute,
            window=layout.window is not None,
            head_dim=layout.head_dim,
        )
    requested.check_length(prompt_len, "serve.prompt_len", instead=None)  # No model.attention to set.
    requested.check_head_dim(layout.head_dim)
    requested.check_window(layout.window, prompt_len)
    return requested


def takes_logits_at(model) -> bool:
    """Whether the model's ``cached_call`` takes ``logits_at`` (see the module docstring)."""
    return "logits_at" in inspect.signature(model.cached_call).parameters


def prefill_call(model, prompts_BxP, cache, last_B) -> tuple[jax.Array, KVCache]:
    """The model's ``cached_call`` on right-padded prompts: ``(logits_BxLxV, cache)``, ``L`` = 1 (the
    positions ``last_B``, each prompt's last real token) where it takes ``logits_at``, else every position."""
    positions_P = jnp.arange(prompts_BxP.shape[1])
    if takes_logits_at(model):
        return model.cached_call(prompts_BxP, cache, positions_P, prefill=True, logits_at=last_B)
    return model.cached_call(prompts_BxP, cache, positions_P, prefill=True)
