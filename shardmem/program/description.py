"""A program's description: the config resolved once, for one mesh, into the decisions of what runs.

    description = describe(config, mesh)          # every check of the config happens here, once
    description.attention, description.pipeline, description.model.factory.remat_plan
    program = build_training(description)         # the training step (shardmem.program.step)

Resolving decides in one place what the builders need: the partition rules; the model (its factory and
remat, evaluated on abstract shapes with its shardings, :mod:`~shardmem.program.model`); the attention
kernel for the mesh's devices; the precision; the pipeline schedule and context shards
(:mod:`~shardmem.program.parallelism`); a fine-tune's frozen, quantized and adapted parameters
(:mod:`shardmem.finetune`); and for training the batch, the loss, the optimizer and the state's layout.
Nothing the size of the model is allocated. Builders take a description, not a Config: fine-tuning is
training with a frozen/adapted split, and a program of another kind (serving) resolves with
``training=False``, which asks for no batch, loss or optimizer.
"""

from __future__ import annotations

import dataclasses
import functools
import math
from collections.abc import Mapping
from typing import Any

import jax
import jax.numpy as jnp
import optax
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

from shardmem.config import Config, PrecisionConfig, RematConfig, check_layer_index
from shardmem.errors import ConfigError
from shardmem.finetune import FineTune
from shardmem.models.attention import AttentionKernel, resolve_for_devices
from shardmem.models.kv_cache import CacheLayout, KVCache
from shardmem.models.llama import lora_input_dims
from shardmem.parallel import collective_matmul
from shardmem.parallel.mesh import auto_axes
from shardmem.parallel.pipeline import STAGE_AXIS, Pipeline
from shardmem.parallel.rules import Rules, check_divisible
from shardmem.program import user_serving
from shardmem.program.batch import declared_batch
from shardmem.program.batch import is_leaf as is_batch_leaf
from shardmem.program.loss import LossFn, next_token_loss, resolve_loss
from shardmem.program.model import Model, ModelFactory, abstract_model, resolve_factory, sharded
from shardmem.program.optimizer import gradient_shardings, make_optimizer, optimizer_shardings
from shardmem.program.parallelism import check_micro_batches, context_shards, overlap_exceptions, pipeline_for


@dataclasses.dataclass(frozen=True)
class Training:
    """What training adds to the model: the batch, the loss, the optimizer and the state's layout.

    ``state`` is the abstract training state (``jax.ShapeDtypeStruct`` with shardings,
    ``state_shardings``): ``{"params", "opt_state", "step"}``, plus ``"model_state"`` for the model's
    variables other than ``nnx.Param`` and ``"frozen"`` with a fine-tune. ``batch`` (abstract, with
    shardings) and ``batch_sharding`` are pytrees shaped like the batch (:mod:`shardmem.program.batch`).
    """

    batch: Any
    batch_sharding: Any
    token_batch: bool  # The batch is the reference [batch, seq_len + 1] token array.
    loss_fn: LossFn
    rows_independent: bool  # The reference next-token loss: accumulation may defer reductions.
    micro_batches: int
    fsdp_reduce_once: bool
    optimizer: optax.GradientTransformation
    opt_shardings: Any
    grad_shardings: Any  # Where the optimizer reads each gradient (ZeRO-1: split as its moments are).
    state: dict
    state_shardings: dict
    # GPU overlap options (shardmem.planning.overlap.GPU_OVERLAP names) the step compiles without.
    overlap_off: tuple[str, ...] = ()


@dataclasses.dataclass(frozen=True)
class Serving:
    """What serving adds to the model (``serve:``): a static batch of prompts and the KV cache's layout.

    ``cache`` is the abstract :class:`~shardmem.models.kv_cache.KVCache` (``jax.ShapeDtypeStruct`` with
    shardings, ``cache_shardings``: its batch over the data replicas, its KV heads over ``tensor``, by
    the rules). ``rows`` places one value per sequence (``[batch]``: lengths, positions, tokens),
    ``tokens`` a prefill's prompts ``[batch, prompt_len]`` and ``logits`` ``[batch, vocab]``.
    ``layout`` is the cache's shape (the reference model's layers, KV heads and head size, and its
    sliding window; a model of your own's ``cache_layout()``, :mod:`shardmem.program.user_serving`),
    ``vocab`` the logits' last axis.
    """

    batch: int
    prompt_len: int
    max_len: int
    kv_dtype: str
    cache: KVCache
    cache_shardings: KVCache
    rows: NamedSharding
    tokens: NamedSharding
    logits: NamedSharding
    layout: CacheLayout
    vocab: int


@dataclasses.dataclass(frozen=True)
class Description:
    """What runs, resolved once from a config for a mesh: the decisions every builder reads.

    ``abstract_params`` are what trains (all of the model's parameters without a fine-tune) and
    ``abstract_frozen`` a fine-tune's frozen, possibly quantized, parameters (None without), as
    ``jax.ShapeDtypeStruct``, each with its shardings and logical axis names. ``training`` is None for a
    description resolved with ``training=False``, ``serving`` None unless resolved with ``serving=True``
    (whose weights are all "frozen": nothing trains). ``config`` is what it was resolved from, kept for
    reports (the run's name, memory options, warnings); builders read the decisions instead.
    """

    config: Config
    mesh: Mesh  # Auto axes (shardmem.parallel.mesh.auto_axes).
    rules: Rules
    model: Model
    # The kernel resolved for the mesh's devices: the reference model's, or the one a model of your own
    # attends with in serving (user_serving.attention); None for a model of your own otherwise.
    attention: AttentionKernel | None
    precision: PrecisionConfig
    pipeline: Pipeline | None  # The layers' pipeline stages (None: no stage axis, or stage=1).
    context_shards: int  # Devices each sequence is split over (rules.seq); 1 without context parallelism.
    finetune: FineTune | None  # Frozen, adapted and quantized parameters (None: all train).
    abstract_params: Any
    param_shardings: Any
    param_logical: Any
    abstract_frozen: Any
    frozen_shardings: Any
    frozen_logical: Any
    seed: int  # train.seed: the parameters' initialisation.
    init_from: str | None  # finetune.init_from: the pretrained weights a program starts from.
    training: Training | None
    serving: Serving | None = None
    # describe()'s keyword arguments, to resolve a variant of the config alike (resolve_again).
    arguments: Mapping[str, Any] = dataclasses.field(default_factory=dict)
    # The reference model's projections run as collective matmuls (overlap.tensor_parallel, resolved).
    collective_matmuls: bool = False

    def resolve_again(self, *overrides: str) -> Description:
        """Returns the description of the config with ``key=value`` overrides, on the same mesh and with
        the same arguments (planning's step without remat, to count what remat recomputes)."""
        return describe(self.config.replace(*overrides), self.mesh, **self.arguments)


def describe(
    config: Config,
    mesh: Mesh,
    *,
    model_factory: ModelFactory | None = None,
    loss_fn: LossFn | None = None,
    batch: Any = None,
    batch_shape: tuple[int, ...] | None = None,
    attention: AttentionKernel | None = None,
    training: bool = True,
    serving: bool = False,
) -> Description:
    """Returns the :class:`Description` of ``config`` on ``mesh``, raising ConfigError for anything in
    them that cannot run. Nothing the size of the model is allocated.

    ``model_factory(rngs)`` (or ``model.factory`` in the config) builds any Flax NNX module whose
    parameters carry logical axis names (default: the reference :class:`~shardmem.models.llama.Llama`);
    one that takes a ``remat`` argument receives the config's per-layer
    :class:`~shardmem.remat.LayerPlan`; ``remat.modules`` wraps the submodules it names in any model of
    your own (:class:`~shardmem.remat.ModulePlan`). ``loss_fn(model, batch)`` (or ``train.loss``)
    returns a scalar loss or ``(loss, metrics)``. ``batch`` (or ``data.batch``) declares the batch, see
    :mod:`shardmem.program.batch`; the default is ``[train.global_batch, model.seq_len + 1]`` int32 tokens
    (``batch_shape`` changes its shape). ``attention`` overrides the reference model's kernel, resolved
    by default for the mesh's devices (:func:`shardmem.models.attention.resolve_attention`), and a model of
    your own's in serving (:func:`shardmem.program.user_serving.attention`). A mesh with
    Explicit or Manual axes (``jax.make_mesh``'s default) is planned with Auto axes, as :func:`build_mesh`
    makes them (:func:`shardmem.parallel.mesh.auto_axes`), so it builds the same program.
    ``training=False`` resolves the model alone, for a program that neither differentiates nor updates
    it: no batch, loss or optimizer is asked for (``loss_fn`` and ``batch`` are then unused).
    ``serving=True`` (which implies ``training=False``) resolves the ``serve:`` section for the serving
    program (:func:`~shardmem.program.serving.build_serving`): its weights, every parameter frozen in
    ``precision.compute`` or quantized by ``serve.quantize``, and its KV cache (:class:`Serving`); the
    config's remat does not apply (nothing is differentiated). A model of your own serves through its
    cache-aware call (:mod:`shardmem.program.user_serving`), and is refused without one.
    """
    mesh = auto_axes(mesh)
    custom = model_factory is not None or config.user_model
    if serving:
        training = False
        config = dataclasses.replace(config, remat=RematConfig())  # No backward pass to recompute for.
    rules = Rules.from_config(config.rules, mesh.axis_names, config.param_rules)
    context = context_shards(config, mesh, rules, custom, batch_shape)
    if serving:
        _check_serving(config, mesh, rules, context)
    pipeline = pipeline_for(config, mesh, custom, rules)
    if not custom:
        trained = batch_shape[1] - 1 if batch_shape is not None else config.model.seq_len
        # The longest a query attends: a decode step's reaches the cache's last position.
        longest = config.serve.max_len if serving else trained
        check_layer_index(config.model, longest, pipeline.stages if pipeline else 1)
    m = config.model
    # Serving runs its layers unrolled, each knowing whether it slides: a window on some layers only is
    # static there, as a window on every layer is (the flash kernels take it); only training's scanned
    # stack picks each layer's by a traced index.
    window = None if custom else m.layer_window or (m.sliding_window if serving and m.windows_vary else None)
    if attention is None and not custom:
        attention = resolve_for_devices(m.attention, mesh.devices.flat, chunk=m.attention_chunk,
                                        dtype=config.precision.compute, context=context,
                                        window=window is not None,
                                        head_dim=m.head_size, softcap=m.attention_softcap is not None,
                                        layer_windows=not serving and m.windows_vary
                                        and longest > m.sliding_window)  # fmt: skip
    if attention is not None and not custom:
        length = config.serve.prompt_len if serving else trained  # Prefill attends over the prompts.
        attention.check_length(length, "serve.prompt_len" if serving else "model.seq_len")
        attention.check_head_dim(config.model.head_size)
        attention.check_window(window, length)
    # Training's overlap of sequence parallelism's collectives; a decode step's single token per sequence
    # has nothing to chunk, so serving runs the plain projections whatever the key says.
    collective = not serving and collective_matmul.resolve(config.overlap.tensor_parallel, rules, mesh,
                                                           reference_model=not custom,
                                                           pipelined=pipeline is not None)  # fmt: skip
    factory = resolve_factory(config, model_factory, custom=custom, attention=attention, pipeline=pipeline,
                              collective_matmuls=collective)  # fmt: skip
    if training:
        batch_tree, token = declared_batch(config, batch, batch_shape)
        loss_fn = resolve_loss(config, loss_fn, token)
    # A stage count that does not divide the layers cannot shard their stored axis (Pipeline.storage_rules).
    storage = pipeline.storage_rules(rules, config.model.n_layers) if pipeline else rules
    model = abstract_model(factory, mesh, storage, seed=config.train.seed)
    arguments = dict(model_factory=model_factory, loss_fn=loss_fn, batch=batch, batch_shape=batch_shape,
                     training=training, serving=serving)  # fmt: skip
    if serving:
        weights = _serving_weights(config, model, custom)
    else:
        weights = _fine_tune(config, model, pipeline, custom)
    description = Description(
        config, mesh, rules, model, None if custom else attention, config.precision, pipeline, context,
        **weights, seed=config.train.seed, init_from=config.finetune.init_from, training=None,
        arguments=arguments, collective_matmuls=collective,
    )  # fmt: skip
    if serving:
        if custom:  # Its cache-aware call says the cache's shape (and refuses a model without one).
            passed = model_factory is not None
            layout, vocab = user_serving.cache_layout(config, model, mesh, rules, passed=passed)
            attention = user_serving.attention(config, mesh, layout, attention)
        else:  # The sliding layers keep only their window's keys (kv_cache.KVCache.ring).
            ring = tuple(i for i in range(m.n_layers) if m.sliding_window is not None and m.slides(i))
            layout = CacheLayout(m.n_layers, m.n_kv_heads, m.head_size,
                                 window=m.sliding_window if ring else None, ring=ring)  # fmt: skip
            vocab = m.vocab_size
        return dataclasses.replace(description, attention=attention,
                                   serving=_serving(config, mesh, rules, layout, vocab))  # fmt: skip
    if not training:
        return description
    training_part = _training(config, description, batch_tree, token, loss_fn)
    return dataclasses.replace(description, training=training_part)


def _fine_tune(config: Config, model: Model, pipeline: Pipeline | None, custom: bool) -> dict[str, Any]:
    """The parameters split by ``finetune``: what trains, and the frozen (possibly quantized) rest."""
    abstract_params, param_shardings, param_logical = (
        model.abstract_params, model.param_shardings, model.param_logical
    )  # fmt: skip
    abstract_frozen = frozen_shardings = frozen_logical = None
    finetune = FineTune.resolve(config, abstract_params, param_logical, reference_model=not custom,
                                input_dims=lora_input_dims if not custom else lambda path: 1)  # fmt: skip
    if finetune is not None and pipeline is not None and (finetune.adapted or finetune.quantized):
        raise ConfigError(
            f"mesh.axes.stage={pipeline.stages} with finetune.lora or finetune.quantize: the pipeline's "
            "stages split plain layer weights only, not adapted or quantized ones; set mesh.axes.stage=1 "
            "(shard with fsdp), or freeze without them"
        )
    if pipeline is not None:  # Stacks of layers as the stages split them (Pipeline.stored).
        abstract_params = pipeline.stored(abstract_params, model.param_logical)
        param_shardings = pipeline.stored_shardings(param_shardings, model.param_logical)
        param_logical = pipeline.stored_logical(model.param_logical)
    if finetune is not None:  # From here on "params" are what trains; the frozen ones ride along.
        abstract_params, abstract_frozen = jax.eval_shape(
            finetune.prepare, abstract_params, jax.random.key(0)
        )
        param_shardings, frozen_shardings = finetune.shardings(param_shardings)
        frozen_shardings = finetune.fit_shardings(frozen_shardings, abstract_frozen)
        param_logical, frozen_logical = finetune.logical(param_logical)
    return dict(finetune=finetune, abstract_params=abstract_params, param_shardings=param_shardings,
                param_logical=param_logical, abstract_frozen=abstract_frozen,
                frozen_shardings=frozen_shardings, frozen_logical=frozen_logical)  # fmt: skip


def _check_serving(config: Config, mesh: Mesh, rules: Rules, context: int) -> None:
    """Raises ConfigError for what the serving program cannot run: pipeline stages, a sequence split
    over devices, a batch its devices do not divide. (A model of your own without a cache-aware call
    is refused once it is built: :func:`~shardmem.program.user_serving.cache_layout`.)"""
    stages = dict(mesh.shape).get(STAGE_AXIS, 1)
    if stages > 1:
        raise ConfigError(
            f"mesh.axes.stage={stages}: serving runs every layer on every device; split the "
            "weights over tensor (heads) and the batch over data replicas, and set mesh.axes.stage=1"
        )
    if context > 1:
        raise ConfigError(
            f"rules.seq splits each sequence over {context} devices (context parallelism), which serving "
            "does not do; set mesh.axes.context=1 (and rules.seq: null)"
        )
    batch_axes = rules.mesh_axes("batch") or ()
    devices = math.prod(mesh.shape[a] for a in batch_axes)
    if config.serve.batch % devices:
        sizes = " x ".join(f"mesh.axes.{a}={mesh.shape[a]}" for a in batch_axes)
        raise ConfigError(
            f"serve.batch={config.serve.batch} does not split over the {devices} devices the batch is "
            f"sharded over ({sizes}, rules.batch); use a multiple of {devices}"
        )


def _serving_weights(config: Config, model: Model, custom: bool) -> dict[str, Any]:
    """A serving program's weights: every parameter frozen (:meth:`FineTune.serving`), nothing trains."""
    finetune = FineTune.serving(config, model.abstract_params, model.param_logical,
                                reference_model=not custom)  # fmt: skip
    _, abstract_frozen = jax.eval_shape(finetune.prepare, model.abstract_params, jax.random.key(0))
    _, frozen_shardings = finetune.shardings(model.param_shardings)
    _, frozen_logical = finetune.logical(model.param_logical)
    return dict(finetune=finetune, abstract_params={}, param_shardings={}, param_logical={},
                abstract_frozen=abstract_frozen,
                frozen_shardings=finetune.fit_shardings(frozen_shardings, abstract_frozen),
                frozen_logical=frozen_logical)  # fmt: skip


def _serving(config: Config, mesh: Mesh, rules: Rules, layout: CacheLayout, vocab: int) -> Serving:
    """The serve section resolved: the KV cache's abstract arrays (of ``layout``) and shardings, and the
    batch's."""
    serve = config.serve
    kv_dtype = serve.kv_dtype or config.precision.compute
    cache = jax.eval_shape(functools.partial(layout.zeros, batch=serve.batch, max_len=serve.max_len,
                                             dtype=kv_dtype))  # fmt: skip

    shapes = [cache.keys.shape] + ([cache.ring.keys.shape] if cache.ring is not None else [])

    def sharding(axes):
        spec = rules.spec(axes)
        for shape in shapes:  # The stack's, and the ring's (of the window's positions).
            check_divisible("the KV cache", shape, spec, mesh, axes)
        return NamedSharding(mesh, spec)

    cache_shardings = cache.by_axes(sharding)
    place = lambda *axes: NamedSharding(mesh, rules.spec(axes))  # noqa: E731
    return Serving(serve.batch, serve.prompt_len, serve.max_len, kv_dtype, sharded(cache, cache_shardings),
                   cache_shardings, place("batch"), place("batch", None), place("batch", "vocab"),
                   layout, vocab)  # fmt: skip


def _training(config: Config, d: Description, batch_tree, token: bool, loss_fn: LossFn) -> Training:
    """The optimizer and the state's layout, the batch's shardings and the step's compile options."""
    mesh, model = d.mesh, d.model
    tx = make_optimizer(config)
    abstract_opt = jax.eval_shape(tx.init, d.abstract_params)
    opt_shardings = optimizer_shardings(
        config, tx, abstract_opt, d.abstract_params, d.param_shardings, model.storage, mesh
    )
    grad_shardings = gradient_shardings(config, d.abstract_params, d.param_shardings, model.storage, mesh)
    replicated = NamedSharding(mesh, P())
    state_shardings = {"params": d.param_shardings, "opt_state": opt_shardings, "step": replicated}
    abstract_tree = {"params": d.abstract_params, "opt_state": abstract_opt,
                     "step": jax.ShapeDtypeStruct((), jnp.int32)}  # fmt: skip
    if model.has_rest:
        state_shardings["model_state"] = model.rest_shardings
        abstract_tree["model_state"] = model.abstract_rest
    if d.finetune is not None:
        state_shardings["frozen"] = d.frozen_shardings
        abstract_tree["frozen"] = d.abstract_frozen
    abstract_state = sharded(abstract_tree, state_shardings)

    batch_sharding = jax.tree.map(lambda leaf: NamedSharding(mesh, d.rules.spec(leaf.logical_axes())),
                                  batch_tree, is_leaf=is_batch_leaf)  # fmt: skip
    check_micro_batches(config, mesh, batch_tree, batch_sharding)
    abstract_batch = jax.tree.map(lambda leaf, s: leaf.abstract(s), batch_tree, batch_sharding,
                                  is_leaf=is_batch_leaf)  # fmt: skip
    # The reference model's next-token loss: rows independent, so accumulation may defer reductions.
    rows_independent = not model.factory.custom and loss_fn is next_token_loss
    overlap_off = overlap_exceptions(config, mesh, d.rules, d.param_shardings, batch_sharding,
                                     rows_independent=rows_independent,
                                     pipelined=d.pipeline is not None)  # fmt: skip
    train = config.train
    return Training(abstract_batch, batch_sharding, token, loss_fn, rows_independent, train.micro_batches,
                    train.fsdp_reduce_once, tx, opt_shardings, grad_shardings, abstract_state,
                    state_shardings, overlap_off)  # fmt: skip
