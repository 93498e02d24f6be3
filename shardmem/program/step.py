"""The sharded training step: loss, gradients (with micro-batch accumulation), Optax update.

    program = build_program(config, mesh)         # or model_factory=, loss_fn=, batch= of your own
    state = program.init()                        # allocated directly with its shardings
    state, metrics = program.step(state, batch)   # jit with explicit shardings, state donated

:func:`build_program` is :func:`build_training` of the config's
:class:`~shardmem.program.description.Description`, which decided everything the step reads. The model
declares logical axes; the config's rules turn them into NamedShardings for parameters and
optimizer state alike (data parallel, FSDP, tensor parallel or any mix). Parameters are kept in
``precision.params`` (float32 by default; narrower ones with a float32 copy in the optimizer state under
``precision.master``) and cast to ``precision.compute`` where they are used; in
float16 the loss is scaled by the optimizer's dynamic loss scale before differentiating and the
gradients divided by it again (:func:`scaled_value_and_grad`, :mod:`shardmem.program.optimizer`). Only
``nnx.Param`` variables are differentiated; a model's other variables (batch statistics, RNG streams)
ride along in ``state["model_state"]``. The batch is any pytree of arrays (:mod:`shardmem.program.batch`).
With a ``stage`` mesh axis the reference model runs its layers as pipeline stages, and
``train.micro_batches`` go through them in one pass instead of accumulating
(:mod:`shardmem.parallel.pipeline`). Fine-tuning (:mod:`shardmem.finetune`) is the same step over
what trains, the frozen parameters passed through untouched.
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
from collections.abc import Callable
from typing import Any, ClassVar

import jax
import jax.numpy as jnp
import optax
from flax import nnx
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

from shardmem.config import Config
from shardmem.errors import ConfigError
from shardmem.gradient_sums import value_and_grad_into
from shardmem.models.linen import remat_calls
from shardmem.program.accumulation import accumulate_gradients, reduce_scatters_per_micro_batch
from shardmem.program.description import Description, Training, describe
from shardmem.program.optimizer import loss_scale, master_weights, to_device, to_host
from shardmem.program.program import Function, Program, loading


@dataclasses.dataclass
class TrainingProgram(Program):
    """The sharded training step, ready to initialise and run (or only compile).

    The state is ``{"params", "opt_state", "step"}`` plus ``"model_state"`` when the model has
    variables other than ``nnx.Param`` (batch statistics, RNG streams, ...): those are carried through
    the step and updated, sharded by the same rules and checkpointed, but never differentiated, decayed
    or given optimizer moments. With ``finetune`` (:mod:`shardmem.finetune`), ``"params"`` holds what
    trains (adapters included) and ``"frozen"`` the frozen, possibly quantized, parameters, which the
    step passes through untouched. ``abstract_batch`` and ``batch_sharding`` are pytrees shaped like the
    batch.
    """

    step: Callable  # jitted (state, batch) -> (state, metrics); state is donated
    # (params, model_state, batch, frozen=None) -> (loss, (metrics, new model_state)): what it differentiates.
    loss: Callable
    start_from: Callable  # (model params) -> state: pretrained weights in (donated).

    kind: ClassVar[str] = "training"

    @property
    def functions(self) -> tuple[Function, ...]:
        """The step, planned with the abstract state and batch; the report lists the parameters, the
        frozen ones, the optimizer state, the model's other variables and the batch per device."""
        state = self.abstract_state
        groups = {
            "params": state["params"],
            "frozen": state.get("frozen", {}),  # Fine-tuning's frozen (and quantized) parameters.
            "optimizer": {"opt_state": state["opt_state"], "step": state["step"]},
            "model_state": state.get("model_state", {}),
            "batch": self.abstract_batch,
        }
        tokens = None
        if self.token_batch:  # [batch, length + 1]: each row predicts its last `length` tokens.
            rows, width = jax.tree.leaves(self.abstract_batch)[0].shape[:2]
            tokens = rows * (width - 1)
        return (Function("step", self.step, (state, self.abstract_batch), groups, tokens, self.overlap_off),)

    @property
    def training(self) -> Training:
        """The description's training decisions: batch, loss, optimizer, the state's layout."""
        return self.description.training

    @property
    def abstract_state(self) -> dict:
        """The state as ``jax.ShapeDtypeStruct`` with their shardings."""
        return self.training.state

    @property
    def state_shardings(self) -> dict:
        """The state's shardings."""
        return self.training.state_shardings

    @property
    def abstract_batch(self):
        """The batch as ``jax.ShapeDtypeStruct`` with their shardings."""
        return self.training.batch

    @property
    def batch_sharding(self):
        """The batch's shardings."""
        return self.training.batch_sharding

    @property
    def optimizer(self) -> optax.GradientTransformation:
        """The Optax optimizer."""
        return self.training.optimizer

    @property
    def token_batch(self) -> bool:
        """Whether the batch is the reference ``[batch, seq_len + 1]`` token array."""
        return self.training.token_batch

    @property
    def overlap_off(self) -> tuple[str, ...]:
        """The GPU overlap options (:mod:`shardmem.planning.overlap`) the step compiles without,
        plan and train alike."""
        return self.training.overlap_off


def build_program(config: Config, mesh: Mesh, **arguments: Any) -> TrainingProgram:
    """Returns the sharded step for ``config`` on ``mesh``: ``build_training(describe(config, mesh,
    **arguments))``. Nothing the size of the model is allocated until ``program.init`` is called.

    ``arguments`` are :func:`~shardmem.program.description.describe`'s: ``model_factory(rngs)`` (or
    ``model.factory`` in the config) builds any Flax NNX module whose parameters carry logical axis names
    (default: the reference :class:`~shardmem.models.llama.Llama`), ``loss_fn(model, batch)`` (or
    ``train.loss``) returns a scalar loss or ``(loss, metrics)``, ``batch`` (or ``data.batch``) declares
    the batch, ``batch_shape`` changes the token batch's shape and ``attention`` overrides the reference
    model's kernel.
    """
    return build_training(describe(config, mesh, **arguments))


def build_training(description: Description) -> TrainingProgram:
    """Returns the training program of ``description`` (resolved with ``training=True``): the jitted
    step, and ``init`` from ``train.seed`` or from the pretrained weights of ``finetune.init_from``."""
    if description.training is None:
        raise ValueError("build_training needs a description resolved with training=True")
    loss = params_loss(description)
    step = jitted_step(description, loss)
    init, start = initializers(description)

    def init_or_load():
        if description.init_from is None:
            return init(jax.random.key(description.seed))
        from shardmem.finetune.weights import load_weights  # safetensors or Orbax, only when loading

        return start(load_weights(description.init_from, program))

    program = TrainingProgram(description, init_or_load, build_training, step, loss, start)
    return program


def params_loss(description: Description) -> Callable:
    """Returns ``(params, model_state, batch, frozen=None) -> (loss, (metrics, new model_state))``: the
    training loss as a function of what trains (:attr:`TrainingProgram.loss`), the model merged from
    them, a fine-tune's frozen parameters and its other variables."""
    model_spec, finetune = description.model, description.finetune
    graphdef, keys, has_rest = model_spec.graphdef, model_spec.keys, model_spec.has_rest
    factory, loss_fn = model_spec.factory, description.training.loss_fn
    # Linen modules inside a model of your own take remat.modules when traced.
    linen_remat = functools.partial(remat_calls, factory.module_plan, factory.module_matches)

    def loss_of_params(params, rest, batch, frozen=None):
        if finetune is not None:
            params = finetune.assemble(params, frozen)
        model = nnx.merge(graphdef, params, keys.wrap(rest)) if has_rest else nnx.merge(graphdef, params)
        with linen_remat() if factory.custom else contextlib.nullcontext():
            out = loss_fn(model, batch)
        loss, metrics = out if isinstance(out, tuple) else (out, {})
        if not isinstance(metrics, dict):
            raise ConfigError(f"the loss returned metrics of type {type(metrics).__name__}; return "
                              "(loss, {name: scalar})")  # fmt: skip
        new_rest = keys.unwrap(nnx.to_pure_dict(nnx.split(model, nnx.Param, ...)[2])) if has_rest else {}
        return jnp.asarray(loss, jnp.float32), (metrics, new_rest)

    return loss_of_params


def jitted_step(description: Description, loss_of_params: Callable) -> Callable:
    """Returns the jitted ``(state, batch) -> (state, metrics)``, the state donated: gradients of
    ``loss_of_params`` (accumulated over micro-batches, or a pipeline's), then the optimizer's update."""
    d, train = description, description.training
    mesh, rules, pipeline, finetune = d.mesh, d.rules, d.pipeline, d.finetune
    tx, opt_shardings, grad_shardings = train.optimizer, train.opt_shardings, train.grad_shardings
    has_rest, master_dtype = d.model.has_rest, d.precision.master
    plain_grad_fn = jax.value_and_grad(loss_of_params, has_aux=True)
    scaled_grad_fn = scaled_value_and_grad(loss_of_params, grad_dtype=master_dtype)
    # Accumulated, each micro-batch's gradients are added into the sums as the backward pass makes them:
    # the reference model's layers one at a time (its next-token loss runs them in remat_scan), unless FSDP
    # reduce-scatters every micro-batch's (shardmem.program.accumulation's docstring says why).
    fsdp_every_micro_batch = reduce_scatters_per_micro_batch(
        mesh, d.param_shardings, train.batch_sharding, train.fsdp_reduce_once
    )
    per_layer = train.rows_independent and finetune is None and not fsdp_every_micro_batch
    stack = "layers" if per_layer else None
    summing_grad_fn = value_and_grad_into(loss_of_params, stack=stack)

    def train_step(state, batch):
        with rules.activate(mesh):
            params, rest, frozen = state["params"], state.get("model_state", {}), state.get("frozen")
            scale = loss_scale(state["opt_state"])  # None unless precision.loss_scale is on.
            grad_fn = plain_grad_fn if scale is None else functools.partial(scaled_grad_fn, scale=scale)
            if train.micro_batches == 1 or pipeline:  # A pipeline runs its micro-batches itself.
                (loss, (metrics, rest)), grads = grad_fn(params, rest, batch, frozen)
            else:
                loss, metrics, grads, rest = accumulate_gradients(
                    lambda sums, p, r, b: summing_grad_fn(sums, p, r, b, frozen, scale=scale),
                    params, rest, batch,
                    micro_batches=train.micro_batches, mesh=mesh,
                    rules=rules, param_shardings=d.param_shardings, batch_sharding=train.batch_sharding,
                    fsdp_reduce_once=train.fsdp_reduce_once, grad_shardings=grad_shardings,
                    rows_independent=train.rows_independent, grad_dtype=master_dtype)  # fmt: skip
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

    return jax.jit(
        train_step,
        in_shardings=(train.state_shardings, train.batch_sharding),
        out_shardings=(train.state_shardings, NamedSharding(mesh, P())),
        donate_argnums=0,
    )


def initializers(description: Description) -> tuple[Callable, Callable]:
    """Returns the jitted ``init(key) -> state`` (the model initialised from ``key``) and
    ``start(params) -> state`` (from the model's pretrained parameters, donated), each allocated with
    the state's shardings."""
    d, train = description, description.training
    factory, finetune, keys = d.model.factory.build, d.finetune, d.model.keys
    tx, has_rest = train.optimizer, d.model.has_rest

    def init_state(key, loaded=None):
        with nnx.use_eager_sharding(False):
            model = factory(nnx.Rngs(key))  # With loaded weights, only its other variables are kept.
        _, params, rest = nnx.split(model, nnx.Param, ...)
        params = nnx.to_pure_dict(params) if loaded is None else loaded
        if d.pipeline is not None:  # Stacks of layers as the stages split them (Pipeline.stored).
            params = d.pipeline.stored(params, d.model.param_logical)
        if finetune is not None:
            params, frozen = finetune.prepare(params, jax.random.fold_in(key, 1))
        state = {"params": params, "opt_state": tx.init(params), "step": jnp.zeros((), jnp.int32)}
        if finetune is not None:
            state["frozen"] = frozen
        if has_rest:
            state["model_state"] = keys.unwrap(nnx.to_pure_dict(rest))
        return state

    init = jax.jit(init_state, out_shardings=train.state_shardings)
    start = loading(jax.jit(lambda params: init_state(jax.random.key(d.seed), params),
                            out_shardings=train.state_shardings, donate_argnums=0))  # fmt: skip
    return init, start


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
