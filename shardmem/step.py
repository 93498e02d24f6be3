"""The sharded training step: loss, gradients (with micro-batch accumulation), Optax update.

    program = build_program(config, mesh)
    state = program.init()                        # allocated directly with its shardings
    state, metrics = program.step(state, batch)   # jit with explicit shardings, state donated

The model declares logical axes; the config's rules turn them into NamedShardings for parameters and
optimizer state alike (data parallel, FSDP, tensor parallel or any mix). Parameters are kept in
``precision.params`` (fp32 master weights) and cast to ``precision.compute`` where they are used.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
import optax
from flax import nnx
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

from shardmem.config import Config
from shardmem.errors import ConfigError
from shardmem.models import losses
from shardmem.models.attention import AttentionKernel, device_class, resolve_attention
from shardmem.models.llama import Llama
from shardmem.optimizer import make_optimizer, optimizer_shardings, to_device, to_host
from shardmem.parallel.rules import Rules, sharding_table, spec_axes

ModelFactory = Callable[[nnx.Rngs], nnx.Module]
LossFn = Callable[[nnx.Module, jax.Array], jax.Array]


def next_token_loss(model: nnx.Module, batch_BxL1: jax.Array) -> jax.Array:
    """Mean cross-entropy of predicting ``batch[:, 1:]`` from ``batch[:, :-1]``; over the vocabulary in
    chunks of positions for the reference model's ``model.loss_chunk`` (see :mod:`shardmem.models.losses`)."""
    return losses.next_token_loss(model, batch_BxL1)


def default_model_factory(config: Config, attention: AttentionKernel | None = None) -> ModelFactory:
    plan = config.remat_plan()

    def factory(rngs: nnx.Rngs) -> nnx.Module:
        return Llama(config.model, rngs=rngs, remat=plan,
                     param_dtype=jnp.dtype(config.precision.params),
                     compute_dtype=jnp.dtype(config.precision.compute), attention=attention)  # fmt: skip

    return factory


@dataclasses.dataclass
class Program:
    """Everything needed to initialise and run (or only compile) the sharded step."""

    config: Config
    mesh: Mesh
    rules: Rules
    graphdef: Any
    abstract_state: dict  # ShapeDtypeStructs with shardings: params, opt_state, step
    abstract_batch: jax.ShapeDtypeStruct
    state_shardings: dict
    batch_sharding: NamedSharding
    param_logical: Any
    optimizer: optax.GradientTransformation
    step: Callable  # jitted (state, batch) -> (state, metrics); state is donated
    init: Callable  # () -> state, initialised from train.seed with its shardings
    custom_model: bool = False  # Built from a user's model_factory rather than the reference model.
    attention: AttentionKernel | None = None  # The reference model's kernel, resolved for the mesh's devices.

    def sharding_table(self):
        """Returns one :class:`~shardmem.parallel.rules.ShardingRow` per parameter."""
        params = self.abstract_state["params"]
        return sharding_table(params, self.state_shardings["params"], self.param_logical)


def _abstract(tree, shardings):
    return jax.tree.map(
        lambda leaf, sharding: jax.ShapeDtypeStruct(leaf.shape, leaf.dtype, sharding=sharding),
        tree,
        shardings,
    )


def build_program(
    config: Config,
    mesh: Mesh,
    *,
    model_factory: ModelFactory | None = None,
    loss_fn: LossFn = next_token_loss,
    batch_shape: tuple[int, ...] | None = None,
) -> Program:
    """Returns the sharded step for ``config`` on ``mesh``. Nothing the size of the model is allocated
    until ``program.init`` is called.

    ``model_factory(rngs)`` builds any Flax NNX module whose parameters carry logical axis names (the
    default is the reference :class:`~shardmem.models.llama.Llama`); ``loss_fn(model, batch)`` returns a
    scalar.
    ``batch_shape`` defaults to ``(train.global_batch, model.seq_len + 1)`` int32 tokens.
    """
    attention = None
    if model_factory is None:
        attention = resolve_attention(config.model.attention, chunk=config.model.attention_chunk,
                                      where=device_class(mesh.devices.flat),
                                      dtype=config.precision.compute)  # fmt: skip
    factory = model_factory or default_model_factory(config, attention)
    rules = Rules.from_config(config.rules, mesh.axis_names, config.param_rules)
    seed = config.train.seed
    with nnx.use_eager_sharding(False):
        abstract_model = nnx.eval_shape(lambda: factory(nnx.Rngs(seed)))
    graphdef, abstract_params_state = nnx.split(abstract_model)
    param_logical = nnx.to_pure_dict(nnx.get_partition_spec(abstract_params_state))
    abstract_params = nnx.to_pure_dict(abstract_params_state)
    param_shardings = rules.shardings(mesh, abstract_params_state)

    tx = make_optimizer(config)
    abstract_opt = jax.eval_shape(tx.init, abstract_params)
    replicated = NamedSharding(mesh, P())
    opt_shardings = optimizer_shardings(
        config, tx, abstract_opt, abstract_params, param_shardings, rules, mesh
    )
    state_shardings = {"params": param_shardings, "opt_state": opt_shardings, "step": replicated}
    abstract_state = _abstract(
        {"params": abstract_params, "opt_state": abstract_opt,
         "step": jax.ShapeDtypeStruct((), jnp.int32)},
        state_shardings,
    )  # fmt: skip

    train = config.train
    batch_shape = batch_shape or (train.global_batch, config.model.seq_len + 1)
    batch_spec = rules.spec(("batch",) + (None,) * (len(batch_shape) - 1))
    batch_sharding = NamedSharding(mesh, batch_spec)
    micro_rows = batch_shape[0] // train.micro_batches
    batch_shards = math.prod(mesh.shape[a] for a in spec_axes(batch_spec[0] if batch_spec else None))
    if micro_rows % batch_shards:
        axes = " x ".join(f"{a}={mesh.shape[a]}" for a in spec_axes(batch_spec[0]))
        raise ConfigError(
            f"train.global_batch={batch_shape[0]} / train.micro_batches={train.micro_batches} gives "
            f"micro-batches of {micro_rows} sequences, which the batch mesh axes ({axes}) cannot split "
            f"evenly; make train.global_batch / train.micro_batches a multiple of {batch_shards}"
        )
    abstract_batch = jax.ShapeDtypeStruct(batch_shape, jnp.int32, sharding=batch_sharding)

    def loss_of_params(params, batch):
        return loss_fn(nnx.merge(graphdef, params), batch)

    grad_fn = jax.value_and_grad(loss_of_params)
    micro_spec = P(None, *batch_spec)

    def train_step(state, batch):
        with rules.activate(mesh):
            params = state["params"]
            if train.micro_batches == 1:
                loss, grads = grad_fn(params, batch)
            else:
                # Micro-batch i takes every k-th row, so each device keeps its own rows.
                k = train.micro_batches
                micro = batch.reshape(batch.shape[0] // k, k, *batch.shape[1:]).swapaxes(0, 1)
                micro = jax.lax.with_sharding_constraint(micro, NamedSharding(mesh, micro_spec))

                def accumulate(carry, one_batch):
                    loss_sum, grad_sum = carry
                    loss, grads = grad_fn(params, one_batch)
                    return (loss_sum + loss, jax.tree.map(jnp.add, grad_sum, grads)), None

                zeros = jax.tree.map(jnp.zeros_like, params)
                (loss, grads), _ = jax.lax.scan(accumulate, (jnp.zeros((), jnp.float32), zeros),
                                                micro)  # fmt: skip
                loss, grads = loss / k, jax.tree.map(lambda g: g / k, grads)
            opt_state = to_device(state["opt_state"], opt_shardings)  # No-op unless offloaded.
            updates, opt_state = tx.update(grads, opt_state, params)
            opt_state = to_host(opt_state, opt_shardings)
            new_state = {
                "params": optax.apply_updates(params, updates),
                "opt_state": opt_state,
                "step": state["step"] + 1,
            }
        metrics = {"loss": loss, "grad_norm": optax.tree.norm(grads)}
        return new_state, metrics

    step = jax.jit(
        train_step,
        in_shardings=(state_shardings, batch_sharding),
        out_shardings=(state_shardings, replicated),
        donate_argnums=0,
    )

    def init_state(key):
        with nnx.use_eager_sharding(False):
            model = factory(nnx.Rngs(key))
        params = nnx.to_pure_dict(nnx.split(model)[1])
        return {"params": params, "opt_state": tx.init(params), "step": jnp.zeros((), jnp.int32)}

    init = jax.jit(init_state, out_shardings=state_shardings)
    return Program(config, mesh, rules, graphdef, abstract_state, abstract_batch, state_shardings,
                   batch_sharding, param_logical, tx, step, lambda: init(jax.random.key(seed)),
                   custom_model=model_factory is not None, attention=attention)  # fmt: skip
