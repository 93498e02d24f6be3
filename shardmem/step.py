"""The sharded training step: loss, gradients (with micro-batch accumulation), Optax update.

    program = build_program(config, mesh)         # or model_factory=, loss_fn=, batch= of your own
    state = program.init()                        # allocated directly with its shardings
    state, metrics = program.step(state, batch)   # jit with explicit shardings, state donated

The model declares logical axes; the config's rules turn them into NamedShardings for parameters and
optimizer state alike (data parallel, FSDP, tensor parallel or any mix). Parameters are kept in
``precision.params`` (float32 by default; narrower ones with a float32 copy in the optimizer state under
``precision.master``) and cast to ``precision.compute`` where they are used; in
float16 the loss is scaled by the optimizer's dynamic loss scale before differentiating and the
gradients divided by it again (:func:`scaled_value_and_grad`, :mod:`shardmem.optimizer`). Only
``nnx.Param`` variables are differentiated; a model's other variables (batch statistics, RNG streams)
ride along in ``state["model_state"]``. The batch is any pytree of arrays (:mod:`shardmem.batch`).
With a ``stage`` mesh axis the reference model runs its layers as pipeline stages, and
``train.micro_batches`` go through them in one pass instead of accumulating
(:mod:`shardmem.parallel.pipeline`).
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import math
import warnings
from collections.abc import Callable
from typing import Any

import flax.linen as nn
import jax
import jax.numpy as jnp
import optax
from flax import nnx
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

from shardmem.accumulation import accumulate_gradients, deferred_axes
from shardmem.batch import BatchLeaf, parse_batch, token_batch
from shardmem.batch import is_leaf as is_batch_leaf
from shardmem.config import Config
from shardmem.errors import ConfigError, one_of
from shardmem.finetune import FineTune
from shardmem.models import losses
from shardmem.models.attention import (
    AttentionKernel,
    device_class,
    resolve_attention,
    shared_memory_per_block,
)
from shardmem.models.linen import remat_calls
from shardmem.models.llama import CHECKPOINT_TAGS, PRESETS, Llama, ModelConfig, lora_input_dims
from shardmem.models.user import import_object, search_from, takes
from shardmem.optimizer import (
    gradient_shardings,
    loss_scale,
    make_optimizer,
    master_weights,
    optimizer_shardings,
    to_device,
    to_host,
)
from shardmem.parallel import collective_matmul
from shardmem.parallel.mesh import auto_axes
from shardmem.parallel.pipeline import STAGE_AXIS, Pipeline, parse_stages
from shardmem.parallel.rules import Rules, sequence_parallel, sharding_table, spec_axes
from shardmem.remat import LayerPlan, ModulePlan, remat_modules

ModelFactory = Callable[..., nnx.Module]
LossFn = Callable[[nnx.Module, Any], Any]


def next_token_loss(model: nnx.Module, batch_BxL1: jax.Array) -> jax.Array:
    """Mean cross-entropy of predicting ``batch[:, 1:]`` from ``batch[:, :-1]``; over chunks of the
    vocabulary for the reference model's ``model.loss_chunk`` (see :mod:`shardmem.models.losses`)."""
    return losses.next_token_loss(model, batch_BxL1)


def default_model_factory(config: Config, attention: AttentionKernel | None = None,
                          pipeline: Pipeline | None = None,
                          collective_matmuls: bool = False) -> ModelFactory:  # fmt: skip
    """Returns ``rngs -> model`` for the config: the reference Llama (its layers in ``pipeline`` stages,
    where given; its projections as collective matmuls with ``collective_matmuls``), or ``model.factory``
    called with ``model.options`` (and ``remat=`` the per-layer plan, where it takes one)."""
    if config.model is None:
        raise ConfigError(
            "the config has no model section; add e.g. model: {preset: tiny} (presets: "
            f"{one_of(PRESETS)}), model: {{factory: mypkg.models:build}}, or pass model_factory="
        )
    plan = config.remat_plan()
    if config.user_model:
        with search_from(config.folder):
            build = import_object(config.model.factory, "model.factory")
        return _with_options(build, plan, config.model.options)

    def factory(rngs: nnx.Rngs) -> nnx.Module:
        return Llama(config.model, rngs=rngs, remat=plan,
                     param_dtype=jnp.dtype(config.precision.params),
                     compute_dtype=jnp.dtype(config.precision.compute), attention=attention,
                     pipeline=pipeline, collective_matmuls=collective_matmuls)  # fmt: skip

    return factory


def _with_options(build: Callable, plan: LayerPlan, options: dict) -> ModelFactory:
    extra = dict(options)
    if takes(build, "remat"):
        extra["remat"] = plan

    def factory(rngs: nnx.Rngs) -> nnx.Module:
        try:
            return build(rngs, **extra)
        except TypeError as e:
            if options and any(f"'{name}'" in str(e) for name in options):
                raise ConfigError(f"model.options={options}: {build.__name__}() says {e}") from None
            raise

    factory.takes_remat = "remat" in extra  # type: ignore[attr-defined]
    return factory


def _with_module_remat(factory: ModelFactory, modules: ModulePlan, matched: set[str]) -> ModelFactory:
    """The factory, its NNX submodules that ``remat.modules`` names wrapped in ``nnx.remat``."""

    def build(rngs: nnx.Rngs) -> nnx.Module:
        model = factory(rngs)  # Anything else is _checked_model's to refuse.
        return remat_modules(model, modules, matched) if isinstance(model, nnx.Module) else model

    return build


@dataclasses.dataclass
class Program:
    """Everything needed to initialise and run (or only compile) the sharded step.

    The state is ``{"params", "opt_state", "step"}`` plus ``"model_state"`` when the model has
    variables other than ``nnx.Param`` (batch statistics, RNG streams, ...): those are carried through
    the step and updated, sharded by the same rules and checkpointed, but never differentiated, decayed
    or given optimizer moments. With ``finetune`` (:mod:`shardmem.finetune`), ``"params"`` holds what
    trains (adapters included) and ``"frozen"`` the frozen, possibly quantized, parameters, which the
    step passes through untouched. ``abstract_batch`` and ``batch_sharding`` are pytrees shaped like the
    batch.
    """

    config: Config
    mesh: Mesh
    rules: Rules
    graphdef: Any
    abstract_state: dict  # ShapeDtypeStructs with shardings
    abstract_batch: Any
    state_shardings: dict
    batch_sharding: Any
    param_logical: Any
    optimizer: optax.GradientTransformation
    step: Callable  # jitted (state, batch) -> (state, metrics); state is donated
    init: Callable  # () -> state, initialised from train.seed with its shardings
    custom_model: bool = False  # Built from a user's model rather than the reference model.
    remat_plan: LayerPlan | None = None  # The plan the model applies (None: the model remats itself).
    module_plan: ModulePlan = dataclasses.field(default_factory=ModulePlan)  # remat.modules, applied to it.
    # The module_plan patterns that named a module: NNX ones when the model is built, Linen ones when traced.
    module_matches: set[str] = dataclasses.field(default_factory=set)
    token_batch: bool = True  # The batch is the reference [batch, seq_len + 1] token array.
    build_args: dict = dataclasses.field(default_factory=dict)  # build_program's keywords, to rebuild it.
    # (params, model_state, batch) -> (loss, (metrics, new model_state)): what the step differentiates.
    loss: Callable | None = None
    attention: AttentionKernel | None = None  # The reference model's kernel, resolved for the mesh's devices.
    # The reference model's projections run as collective matmuls (overlap.tensor_parallel, resolved).
    collective_matmuls: bool = False
    pipeline: Pipeline | None = None  # The layers' pipeline stages (None: no stage axis, or stage=1).
    finetune: FineTune | None = None  # Frozen, adapted and quantized parameters (None: all train).
    # The model's own parameters (before the fine-tune split), with their shardings: what weights load into.
    model_params: Any = None
    start_from: Callable | None = None  # (model params) -> state: pretrained weights in (donated).
    frozen_logical: Any = None  # The logical axis names of state["frozen"] (with finetune).
    # GPU overlap options (names of shardmem.planning.overlap.GPU_OVERLAP) this step compiles without,
    # plan and train alike: see overlap_exceptions().
    overlap_off: tuple[str, ...] = ()

    def sharding_table(self):
        """Returns one :class:`~shardmem.parallel.rules.ShardingRow` per parameter (trainable ones,
        then frozen ones)."""
        rows = sharding_table(
            self.abstract_state["params"], self.state_shardings["params"], self.param_logical
        )
        if "frozen" in self.abstract_state:
            rows += sharding_table(self.abstract_state["frozen"], self.state_shardings["frozen"],
                                   self.frozen_logical)  # fmt: skip
        return rows


def _abstract(tree, shardings):
    return jax.tree.map(
        lambda leaf, sharding: jax.ShapeDtypeStruct(leaf.shape, leaf.dtype, sharding=sharding),
        tree,
        shardings,
    )


def _is_key(x) -> bool:
    return jax.dtypes.issubdtype(x.dtype, jax.dtypes.prng_key)


class _Keys:
    """Typed PRNG keys in the model's variables travel as their raw ``uint32`` data (checkpoints hold
    plain arrays); ``wrap`` turns them back into keys of the same implementation."""

    def __init__(self, abstract_rest):
        found = {}

        def record(tree):  # key_impl needs a (traced) key array, not a ShapeDtypeStruct.
            found["impls"] = jax.tree.map(lambda x: jax.random.key_impl(x) if _is_key(x) else None, tree)

        jax.eval_shape(record, abstract_rest)
        self.impls = found["impls"]

    def unwrap(self, tree):
        return jax.tree.map(lambda x: jax.random.key_data(x) if _is_key(x) else x, tree)

    def wrap(self, tree):
        return jax.tree.map(lambda x, impl: x if impl is None else jax.random.wrap_key_data(x, impl=impl),
                            tree, self.impls, is_leaf=lambda x: x is None)  # fmt: skip


def resolve_loss(config: Config, loss_fn: LossFn | None, token_batch: bool) -> LossFn:
    """The loss: ``loss_fn``, else ``train.loss``, else next-token cross-entropy on a token batch."""
    if loss_fn is not None:
        return loss_fn
    if config.train.loss is not None:
        with search_from(config.folder):
            return import_object(config.train.loss, "train.loss")
    if not token_batch:
        raise ConfigError(
            "train.loss is not set, and the batch is not the token batch next-token cross-entropy "
            "needs; set train.loss: mypkg.module:loss (loss(model, batch) -> loss or (loss, metrics)) "
            "or pass loss_fn="
        )
    return next_token_loss


def build_program(
    config: Config,
    mesh: Mesh,
    *,
    model_factory: ModelFactory | None = None,
    loss_fn: LossFn | None = None,
    batch: Any = None,
    batch_shape: tuple[int, ...] | None = None,
    attention: AttentionKernel | None = None,
) -> Program:
    """Returns the sharded step for ``config`` on ``mesh``. Nothing the size of the model is allocated
    until ``program.init`` is called.

    ``model_factory(rngs)`` (or ``model.factory`` in the config) builds any Flax NNX module whose
    parameters carry logical axis names (default: the reference :class:`~shardmem.models.llama.Llama`);
    one that takes a ``remat`` argument receives the config's per-layer
    :class:`~shardmem.remat.LayerPlan`; ``remat.modules`` wraps the submodules it names in any model of
    your own (:class:`~shardmem.remat.ModulePlan`). ``loss_fn(model, batch)`` (or ``train.loss``)
    returns a scalar loss or ``(loss, metrics)``. ``batch`` (or ``data.batch``) declares the batch, see
    :mod:`shardmem.batch`; the default is ``[train.global_batch, model.seq_len + 1]`` int32 tokens
    (``batch_shape`` changes its shape). ``attention`` overrides the reference model's kernel, resolved
    by default for the mesh's devices (:func:`shardmem.models.attention.resolve_attention`). A mesh with
    Explicit or Manual axes (``jax.make_mesh``'s default) is planned with Auto axes, as :func:`build_mesh`
    makes them (:func:`shardmem.parallel.mesh.auto_axes`), so it builds the same program.
    """
    mesh = auto_axes(mesh)
    train = config.train
    custom = model_factory is not None or config.user_model
    rules = Rules.from_config(config.rules, mesh.axis_names, config.param_rules)
    context = _context_shards(config, mesh, rules, custom, batch_shape)
    pipeline = pipeline_for(config, mesh, custom, rules)
    if attention is None and not custom:
        attention = resolve_attention(config.model.attention, chunk=config.model.attention_chunk,
                                      where=device_class(mesh.devices.flat),
                                      dtype=config.precision.compute, context=context,
                                      shared_memory=shared_memory_per_block(mesh.devices.flat))  # fmt: skip
    collective = collective_matmul.resolve(config.overlap.tensor_parallel, rules, mesh,
                                           reference_model=not custom,
                                           pipelined=pipeline is not None)  # fmt: skip
    if attention is not None and not custom:
        attention.check_length(batch_shape[1] - 1 if batch_shape is not None else config.model.seq_len)
        attention.check_head_dim(config.model.head_size)
    if not custom and config.remat.tags:
        raise ConfigError(
            f"remat.tags={config.remat.tags} lists the checkpoint_name tags of a model of your own, but the "
            f"model is the reference one (model.preset or model fields), which tags "
            f"{', '.join(CHECKPOINT_TAGS)}; "
            "remove remat.tags (remat.custom picks among those), or pass your model as model_factory="
        )
    if not custom and config.remat.modules:
        raise ConfigError(
            f"remat.modules={config.remat.modules} wraps layers of a model of your own, but the model is the "
            "reference one (model.preset or model fields), whose layers take remat.policy and remat.layers; "
            "use those, or pass your model as model_factory="
        )
    if model_factory is not None:
        plan = config.remat_plan(user_model=True)  # A model passed in code is the user's, whatever the YAML.
        factory = _with_options(model_factory, plan, {}) if takes(model_factory, "remat") else model_factory
    else:
        factory = default_model_factory(config, None if custom else attention, pipeline, collective)
    takes_remat = getattr(factory, "takes_remat", not custom)
    modules = config.module_plan(user_model=True) if custom else ModulePlan()
    matched: set[str] = set()  # The remat.modules patterns that named a module, for the plan's warnings.
    if modules:
        factory = _with_module_remat(factory, modules, matched)
    batch_tree, token = _batch_leaves(config, batch, batch_shape)
    loss_fn = resolve_loss(config, loss_fn, token)

    seed = config.train.seed
    with nnx.use_eager_sharding(False):
        abstract_model = nnx.eval_shape(lambda: _checked_model(factory(nnx.Rngs(seed))))
    graphdef, abstract_params_state, abstract_rest_state = nnx.split(abstract_model, nnx.Param, ...)
    param_logical = nnx.to_pure_dict(nnx.get_partition_spec(abstract_params_state))
    abstract_params = nnx.to_pure_dict(abstract_params_state)
    if not jax.tree.leaves(abstract_params):
        raise ConfigError("the model has no nnx.Param variables: there is nothing to train")
    # A stage count that does not divide the layers cannot shard their stored axis (Pipeline.storage_rules).
    storage = pipeline.storage_rules(rules, config.model.n_layers) if pipeline else rules
    param_shardings = storage.shardings(mesh, abstract_params_state)
    model_params = _abstract(abstract_params, param_shardings)
    frozen_logical = None
    finetune = FineTune.resolve(config, abstract_params, param_logical, reference_model=not custom,
                                input_dims=lora_input_dims if not custom else lambda path: 1)  # fmt: skip
    if finetune is not None and pipeline is not None and (finetune.adapted or finetune.quantized):
        raise ConfigError(
            f"mesh.axes.stage={pipeline.stages} with finetune.lora or finetune.quantize: the pipeline's "
            "stages split plain layer weights only, not adapted or quantized ones; set mesh.axes.stage=1 "
            "(shard with fsdp), or freeze without them"
        )
    if finetune is not None:  # From here on "params" are what trains; the frozen ones ride along.
        abstract_params, abstract_frozen = jax.eval_shape(
            finetune.prepare, abstract_params, jax.random.key(0)
        )
        param_shardings, frozen_shardings = finetune.shardings(param_shardings)
        frozen_shardings = finetune.fit_shardings(frozen_shardings, abstract_frozen)
        param_logical, frozen_logical = finetune.logical(param_logical)
    keys = _Keys(nnx.to_pure_dict(abstract_rest_state))
    replicated = NamedSharding(mesh, P())
    rest_shardings = storage.shardings(mesh, abstract_rest_state)
    rest_shardings = jax.tree.map(lambda s, impl: s if impl is None else replicated, rest_shardings,
                                  keys.impls, is_leaf=lambda x: x is None)  # fmt: skip
    abstract_rest = jax.eval_shape(keys.unwrap, nnx.to_pure_dict(abstract_rest_state))
    has_rest = bool(jax.tree.leaves(abstract_rest))

    tx = make_optimizer(config)
    abstract_opt = jax.eval_shape(tx.init, abstract_params)
    opt_shardings = optimizer_shardings(
        config, tx, abstract_opt, abstract_params, param_shardings, storage, mesh
    )
    grad_shardings = gradient_shardings(config, abstract_params, param_shardings, storage, mesh)
    state_shardings = {"params": param_shardings, "opt_state": opt_shardings, "step": replicated}
    abstract_tree = {"params": abstract_params, "opt_state": abstract_opt,
                     "step": jax.ShapeDtypeStruct((), jnp.int32)}  # fmt: skip
    if has_rest:
        state_shardings["model_state"] = rest_shardings
        abstract_tree["model_state"] = abstract_rest
    if finetune is not None:
        state_shardings["frozen"] = frozen_shardings
        abstract_tree["frozen"] = abstract_frozen
    abstract_state = _abstract(abstract_tree, state_shardings)

    batch_sharding = jax.tree.map(lambda leaf: NamedSharding(mesh, rules.spec(leaf.logical_axes())),
                                  batch_tree, is_leaf=is_batch_leaf)  # fmt: skip
    _check_micro_batches(config, mesh, batch_tree, batch_sharding)
    abstract_batch = jax.tree.map(lambda leaf, s: leaf.abstract(s), batch_tree, batch_sharding,
                                  is_leaf=is_batch_leaf)  # fmt: skip

    def loss_of_params(params, rest, batch, frozen=None):
        if finetune is not None:
            params = finetune.assemble(params, frozen)
        model = nnx.merge(graphdef, params, keys.wrap(rest)) if has_rest else nnx.merge(graphdef, params)
        with remat_calls(modules, matched) if custom else contextlib.nullcontext():  # Linen modules inside.
            out = loss_fn(model, batch)
        loss, metrics = out if isinstance(out, tuple) else (out, {})
        if not isinstance(metrics, dict):
            raise ConfigError(f"the loss returned metrics of type {type(metrics).__name__}; return "
                              "(loss, {name: scalar})")  # fmt: skip
        new_rest = keys.unwrap(nnx.to_pure_dict(nnx.split(model, nnx.Param, ...)[2])) if has_rest else {}
        return jnp.asarray(loss, jnp.float32), (metrics, new_rest)

    # The reference model's next-token loss: rows independent, so accumulation may defer reductions.
    rows_independent = not custom and loss_fn is next_token_loss
    plain_grad_fn = jax.value_and_grad(loss_of_params, has_aux=True)
    scaled_grad_fn = scaled_value_and_grad(loss_of_params, grad_dtype=config.precision.master)

    def train_step(state, batch):
        with rules.activate(mesh):
            params, rest, frozen = state["params"], state.get("model_state", {}), state.get("frozen")
            scale = loss_scale(state["opt_state"])  # None unless precision.loss_scale is on.
            grad_fn = plain_grad_fn if scale is None else functools.partial(scaled_grad_fn, scale=scale)
            if train.micro_batches == 1 or pipeline:  # A pipeline runs its micro-batches itself.
                (loss, (metrics, rest)), grads = grad_fn(params, rest, batch, frozen)
            else:
                loss, metrics, grads, rest = accumulate_gradients(
                    lambda p, r, b: grad_fn(p, r, b, frozen), params, rest, batch,
                    micro_batches=train.micro_batches, mesh=mesh,
                    rules=rules, param_shardings=param_shardings, batch_sharding=batch_sharding,
                    fsdp_reduce_once=train.fsdp_reduce_once, grad_shardings=grad_shardings,
                    rows_independent=rows_independent, grad_dtype=config.precision.master)  # fmt: skip
            grads = jax.lax.with_sharding_constraint(grads, grad_shardings)
            with jax.named_scope("optimizer_update"):  # Names its buffers in the plan's timeline.
                opt_state = to_device(state["opt_state"], opt_shardings)  # No-op unless offloaded.
                updates, opt_state = tx.update(grads, opt_state, params)
                master = master_weights(opt_state)  # precision.master: the weights are it, rounded.
                new_params = (
                    optax.apply_updates(params, updates)
                    if master is None
                    else jax.tree.map(lambda m, p: m.astype(p.dtype), master, params)
                )
                opt_state = to_host(opt_state, opt_shardings)
                new_state = {
                    "params": new_params,
                    "opt_state": opt_state,
                    "step": state["step"] + 1,
                }
            if has_rest:
                new_state["model_state"] = rest
            if finetune is not None:
                new_state["frozen"] = frozen
        metrics = {**metrics, "loss": loss, "grad_norm": optax.tree.norm(grads)}
        if scale is not None:
            metrics = loss_scale_metrics(metrics, scale, new_state["opt_state"])
        return new_state, metrics

    step = jax.jit(
        train_step,
        in_shardings=(state_shardings, batch_sharding),
        out_shardings=(state_shardings, replicated),
        donate_argnums=0,
    )

    def init_state(key, loaded=None):
        with nnx.use_eager_sharding(False):
            model = factory(nnx.Rngs(key))  # With loaded weights, only its other variables are kept.
        _, params, rest = nnx.split(model, nnx.Param, ...)
        params = nnx.to_pure_dict(params) if loaded is None else loaded
        if finetune is not None:
            params, frozen = finetune.prepare(params, jax.random.fold_in(key, 1))
        state = {"params": params, "opt_state": tx.init(params), "step": jnp.zeros((), jnp.int32)}
        if finetune is not None:
            state["frozen"] = frozen
        if has_rest:
            state["model_state"] = keys.unwrap(nnx.to_pure_dict(rest))
        return state

    init = jax.jit(init_state, out_shardings=state_shardings)
    start = jax.jit(lambda params: init_state(jax.random.key(seed), params), out_shardings=state_shardings,
                    donate_argnums=0)  # fmt: skip

    def init_or_load():
        if config.finetune.init_from is None:
            return init(jax.random.key(seed))
        from shardmem.finetune.weights import load_weights  # safetensors or Orbax, only when loading

        params = load_weights(config.finetune.init_from, program)
        with warnings.catch_warnings():  # A quantized or adapted tensor has no output of its shape to reuse.
            warnings.filterwarnings("ignore", "Some donated buffers were not usable")
            return start(params)

    program = Program(config, mesh, rules, graphdef, abstract_state, abstract_batch, state_shardings,
                   batch_sharding, param_logical, tx, step, init_or_load,
                   custom_model=custom, remat_plan=config.remat_plan(custom) if takes_remat else None,
                   module_plan=modules, module_matches=matched,
                   token_batch=token, loss=loss_of_params, attention=None if custom else attention,
                   collective_matmuls=collective, pipeline=pipeline, finetune=finetune,
                   model_params=model_params, start_from=start,
                   frozen_logical=frozen_logical,
                   overlap_off=overlap_exceptions(config, mesh, rules, param_shardings, batch_sharding,
                                                  rows_independent=rows_independent,
                                                  pipelined=pipeline is not None),
                   build_args=dict(model_factory=model_factory, loss_fn=loss_fn, batch=batch,
                                   batch_shape=batch_shape))  # fmt: skip
    return program


def overlap_exceptions(
    config: Config,
    mesh: Mesh,
    rules: Rules,
    param_shardings,
    batch_sharding,
    *,
    rows_independent: bool,
    pipelined: bool,
) -> tuple[str, ...]:
    """Returns the GPU overlap options the step compiles without (:data:`overlap.GPU_OVERLAP` names).

    One so far: with sequence parallelism and gradients accumulated per device over data axes
    (:mod:`shardmem.accumulation`), XLA's all-gather pipeliner moves the next micro-batch's sequence
    gathers into the accumulation loop's previous trip and clones the whole forward layer loop that
    feeds them: every micro-batch's forward ran twice (tests/test_overlap.py; Nemotron-4 15B at tensor 4
    x data 4, BENCHMARKS.md). It is there to prefetch FSDP weight gathers across layers, which such a
    step has none of when no parameter is split over a batch axis; with FSDP as well, XLA did not clone
    (data 2 x FSDP 2 x tensor 4) and the prefetch stays.
    """
    if pipelined or config.train.micro_batches == 1 or not rows_independent:
        return ()
    with rules.activate(mesh):
        if not sequence_parallel():
            return ()
    batch_axes = set(rules.mesh_axes("batch") or ())
    fsdp = any(a in batch_axes and mesh.shape[a] > 1
               for s in jax.tree.leaves(param_shardings) for e in s.spec for a in spec_axes(e))  # fmt: skip
    axes = deferred_axes(rules, mesh, param_shardings, batch_sharding, config.train.fsdp_reduce_once)
    return ("pipelined all-gather",) if axes and not fsdp else ()


def scaled_value_and_grad(loss_of_params: Callable, grad_dtype=None) -> Callable:
    """Returns ``(params, rest, batch, frozen=None, *, scale) -> ((loss, aux), grads)``:
    ``jax.value_and_grad`` of ``loss_of_params`` (see :attr:`Program.loss`) differentiated as
    ``loss x scale``, so that float16 gradients too small for its range are scaled into it, with the
    loss and the gradients divided by ``scale`` again, in ``grad_dtype`` (default: the parameters' own;
    float32 for float16 weights with master weights, ``precision.master``, where a gradient divided in
    float16 would underflow before it reached the float32 copy)."""

    def scaled(params, rest, batch, frozen, scale):
        loss, aux = loss_of_params(params, rest, batch, frozen)
        return loss * scale.astype(loss.dtype), (loss, aux)

    grad = jax.grad(scaled, has_aux=True)

    def value_and_grad(params, rest, batch, frozen=None, *, scale):
        grads, (loss, aux) = grad(params, rest, batch, frozen, scale)

        def unscale(g):
            g = g.astype(grad_dtype or g.dtype)
            return g / scale.astype(g.dtype)

        return (loss, aux), jax.tree.map(unscale, grads)

    return value_and_grad


def loss_scale_metrics(metrics: dict, scale: jax.Array, opt_state) -> dict:
    """The step's metrics under a loss scale: ``loss_scale`` (the scale this step used) and
    ``skipped_steps`` (the run's steps skipped so far for gradients that overflowed); a skipped step's
    ``grad_norm`` is 0 rather than inf, which the training loop would take for divergence."""
    grad_norm = metrics["grad_norm"]
    return {**metrics, "grad_norm": jnp.where(jnp.isfinite(grad_norm), grad_norm, 0.0),
            "loss_scale": scale, "skipped_steps": opt_state.skipped_steps}  # fmt: skip


def _checked_model(model: Any) -> nnx.Module:
    """Returns ``model`` if it is an NNX module, else raises the ConfigError that says how to make one.
    Called inside ``nnx.eval_shape``, before JAX refuses a non-NNX return value with a TypeError."""
    if isinstance(model, nn.Module):
        name = type(model).__name__
        raise ConfigError(
            f"the model factory returned the Flax Linen module {name}, not a Flax NNX module; wrap it with "
            f"shardmem.models.linen.from_linen: return from_linen({name}(...), example_input, rngs=rngs)"
        )
    if not isinstance(model, nnx.Module):
        raise ConfigError(
            f"the model factory returned a {type(model).__name__}, not a Flax NNX module; return an "
            "nnx.Module (a Linen module: shardmem.models.linen.from_linen(module, example_input, rngs=rngs))"
        )
    return model


def _context_shards(config: Config, mesh: Mesh, rules: Rules, custom: bool, batch_shape) -> int:
    """Returns how many devices each sequence is split over (``rules.seq``), checking that context
    parallelism applies: the reference dense model, a sequence of 2 x context chunks, the batch elsewhere."""
    seq_axes = rules.mesh_axes("seq") or ()
    shards = math.prod(mesh.shape[a] for a in seq_axes)
    idle = mesh.shape.get("context", 1) > 1 and "context" not in seq_axes
    if idle and "context" not in (rules.mesh_axes("batch") or ()):
        raise ConfigError(
            f"mesh.axes.context={mesh.shape['context']} but rules.seq={list(seq_axes) or None} does not use "
            "it, so its devices would repeat the same work; set rules.seq: context (the default) or "
            "mesh.axes.context=1"
        )
    if shards == 1:
        return 1
    where = f"rules.seq={list(seq_axes)} splits each sequence over {shards} devices"
    if custom:
        raise ConfigError(
            f"{where}, but context parallelism is the reference model's (its attention gathers keys and "
            "values over the sequence's devices); a model of your own cannot use it: set "
            "mesh.axes.context=1 (and rules.seq: null)"
        )
    if config.model.n_experts:
        raise ConfigError(
            f"{where}, but model.n_experts={config.model.n_experts}: the experts' capacity fills in "
            "sequence order, which a split sequence does not keep; set mesh.axes.context=1, or use an "
            "expert axis instead"
        )
    shared = set(seq_axes) & set(rules.mesh_axes("batch") or ())
    if shared:
        raise ConfigError(
            f"{where}, and rules.batch={list(rules.mesh_axes('batch'))} uses {', '.join(sorted(shared))} "
            "too; a mesh axis splits either the batch or the sequence: remove it from rules.batch"
        )
    length = batch_shape[1] - 1 if batch_shape is not None else config.model.seq_len
    if length % (2 * shards):
        step = 2 * shards
        below, above = length // step * step, (length // step + 1) * step
        fits = [c for c in range(1, mesh.size + 1) if mesh.size % c == 0 and length % (2 * c) == 0]
        raise ConfigError(
            f"model.seq_len={length} is not a multiple of 2 x {shards} = {step}: {where}, in "
            f"2 x {shards} chunks for causal load balance; use a seq_len that is a multiple of {step} "
            f"(e.g. {' or '.join(str(x) for x in (below, above) if x)}), or mesh.axes.context among {fits}"
        )
    return shards


def pipeline_for(
    config: Config, mesh: Mesh, custom: bool = False, rules: Rules | None = None
) -> Pipeline | None:
    """Returns the pipeline schedule for a mesh with a ``stage`` axis of size > 1 (None otherwise),
    checked against the model's depth, remat plan and partition rules."""
    stages = dict(mesh.shape).get(STAGE_AXIS, 1)
    if stages == 1:
        return None
    if custom:
        raise ConfigError(
            f"mesh.axes.stage={stages}: pipeline parallelism splits the reference decoder's layer stack; a "
            "model of your own cannot be split into stages; shard it with data, fsdp or tensor axes, or "
            "set mesh.axes.stage=1"
        )
    n_layers, ranges = config.model.n_layers, config.pipeline.stages
    counts = parse_stages(ranges, n_layers) if ranges is not None else ()
    train, schedule = config.train, config.pipeline
    pipeline = Pipeline(stages, train.micro_batches, schedule.repeats, counts, schedule.schedule)
    pipeline.check(n_layers, config.remat_plan())
    # 1F1B splits a chunk's backward in two parts of its layers, each about a forward's work, so that a
    # tick's ops cost alike (three parts under full remat, a forward each by FLOPs, planned slower on
    # Megatron-LM's 39B: the forward's tensor-parallel all-reduces are exposed); a chunk of one layer
    # runs its backward whole.
    pipeline = dataclasses.replace(pipeline, backward_parts=min(2, pipeline.chunk_layers(n_layers)))
    rules = rules or Rules.from_config(config.rules, mesh.axis_names, config.param_rules)
    stage_users = [
        (name, axes) for name, axes in rules.logical if name != "layers" and STAGE_AXIS in (axes or ())
    ]
    pipeline.check_rules(rules.mesh_axes("layers"), stage_users)
    return pipeline


def _batch_leaves(config: Config, batch: Any, batch_shape: tuple[int, ...] | None):
    """Returns the batch's :class:`~shardmem.batch.BatchLeaf` tree and whether it is the token batch."""
    global_batch = config.train.global_batch
    declared = batch if batch is not None else config.data.batch
    if declared is not None:
        key = "batch" if batch is not None else "data.batch"
        return parse_batch(declared, global_batch=global_batch, key=key), False
    if batch_shape is not None:
        return BatchLeaf(tuple(batch_shape), "int32", ("batch",) + (None,) * (len(batch_shape) - 1)), True
    if not isinstance(config.model, ModelConfig):
        raise ConfigError(
            "data.batch is not set: a model of your own needs its batch declared, e.g. data: {batch: "
            "{images: {shape: [global_batch, 224, 224, 3], dtype: float32, axes: [batch, null, null, null]}}}"
        )
    return token_batch(global_batch, config.model.seq_len), True


def _check_micro_batches(config: Config, mesh: Mesh, batch_tree, shardings) -> None:
    train = config.train
    for leaf, sharding in zip(jax.tree.leaves(batch_tree, is_leaf=is_batch_leaf), jax.tree.leaves(shardings),
                              strict=True):  # fmt: skip
        rows = leaf.shape[0]
        if train.micro_batches > 1 and rows % train.micro_batches:
            raise ConfigError(
                f"train.micro_batches={train.micro_batches} does not divide the batch's first dimension "
                f"({rows}, shape {list(leaf.shape)}); every batch array must lead with the global batch"
            )
        spec = sharding.spec
        micro_rows = rows // train.micro_batches
        shards = math.prod(mesh.shape[a] for a in spec_axes(spec[0] if spec else None))
        if micro_rows % shards:
            axes = " x ".join(f"{a}={mesh.shape[a]}" for a in spec_axes(spec[0]))
            raise ConfigError(
                f"train.global_batch={rows} / train.micro_batches={train.micro_batches} gives "
                f"micro-batches of {micro_rows} {'rows' if config.user_model else 'sequences'}, which the "
                f"batch mesh axes ({axes}) cannot split evenly; make train.global_batch / "
                f"train.micro_batches a multiple of {shards}"
            )
