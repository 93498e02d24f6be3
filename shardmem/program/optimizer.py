"""The Optax optimizer and where its state lives: dtype, sharding, device or host memory.

    tx = make_optimizer(config)                                  # warmup + cosine; optimizer.mu_dtype
    shardings = optimizer_shardings(config, tx, abstract_opt, abstract_params, param_shardings, rules, mesh)
    opt_state = to_device(opt_state, shardings)   # inside the step, when memory.offload_optimizer
    opt_state = to_host(opt_state, shardings)

Adam's two moments are two thirds of a mixed-precision model's state. Three keys shrink what a device holds:
``optimizer.mu_dtype`` stores the first moment in a narrower dtype (Optax's ``mu_dtype``);
``optimizer.shard_over_data`` (ZeRO-1) splits the state over the batch axes that parameters are
replicated over, and the gradients reach the update split the same way (reduce-scattered, not
all-reduced: :func:`gradient_shardings`); ``memory.offload_optimizer`` keeps the state in pinned host
memory and moves it to the device only for the update. ``precision.master`` keeps float32 master
weights of bfloat16 ones in the state (:func:`with_master_weights`), split as the moments are.

With ``precision.compute: float16`` the optimizer keeps a dynamic loss scale (:func:`dynamic_loss_scaling`,
``precision.loss_scale``): the step multiplies the loss by ``loss_scale(opt_state)`` before differentiating,
so that small gradients survive float16's narrow range, and divides the gradients by it after; a step whose
gradients overflowed is skipped and halves the scale. The scale lives in the optimizer state, so it is
checkpointed and a resumed run goes on with it.
"""

from __future__ import annotations

from typing import NamedTuple

import jax
import jax.numpy as jnp
import optax
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

from shardmem.config import Config
from shardmem.errors import ConfigError
from shardmem.parallel.rules import Rules, split_over

HOST = "pinned_host"


#: Dynamic loss scaling as PyTorch's GradScaler and DeepMind's jmp do it: start high, halve on overflow,
#: double after this many finite steps in a row.
INITIAL_LOSS_SCALE = 2.0**15
LOSS_SCALE_GROWTH_INTERVAL = 2000
LOSS_SCALE_FACTOR = 2.0


class LossScaleState(NamedTuple):
    """The optimizer state under :func:`dynamic_loss_scaling`: the scale, the finite steps since it last
    changed, the steps skipped for non-finite gradients (over the whole run), and the inner optimizer's."""

    scale: jax.Array  # float32
    good_steps: jax.Array  # int32
    skipped_steps: jax.Array  # int32
    inner: optax.OptState


def dynamic_loss_scaling(inner: optax.GradientTransformation, *, initial: float = INITIAL_LOSS_SCALE,
                         growth_interval: int = LOSS_SCALE_GROWTH_INTERVAL,
                         factor: float = LOSS_SCALE_FACTOR) -> optax.GradientTransformation:  # fmt: skip
    """Returns ``inner`` under a dynamic loss scale kept in its state (:class:`LossScaleState`).

    It takes the gradients already divided by the scale (the step's job, see :func:`loss_scale`). Where they
    are all finite it applies ``inner`` and doubles the scale after ``growth_interval`` such steps in a row;
    where any is not, it skips the step (zero updates, ``inner``'s state unchanged), halves the scale (not
    below 1) and counts the skip, as :func:`optax.apply_if_finite` does.

    Written here rather than taken from DeepMind's jmp (its last release, 0.0.4, is from January 2023):
    jmp's ``DynamicLossScale`` is a separate value the training loop threads and checkpoints itself,
    where an Optax transformation's state is checkpointed, sharded and resumed with the optimizer's.
    """

    def init(params):
        zero = jnp.zeros((), jnp.int32)
        return LossScaleState(jnp.asarray(initial, jnp.float32), zero, zero, inner.init(params))

    def update(grads, state: LossScaleState, params=None):
        finite = jnp.all(jnp.array([jnp.all(jnp.isfinite(g)) for g in jax.tree.leaves(grads)]))
        updates, inner_state = inner.update(grads, state.inner, params)
        updates = jax.tree.map(lambda u: jnp.where(finite, u, jnp.zeros_like(u)), updates)
        inner_state = jax.tree.map(lambda new, old: jnp.where(finite, new, old), inner_state, state.inner)
        grow = finite & (state.good_steps + 1 >= growth_interval)
        scale = jnp.where(finite, jnp.where(grow, state.scale * factor, state.scale),
                          jnp.maximum(state.scale / factor, 1.0))  # fmt: skip
        good_steps = jnp.where(finite & ~grow, state.good_steps + 1, 0)
        skipped = state.skipped_steps + (~finite).astype(jnp.int32)
        return updates, LossScaleState(scale, good_steps, skipped, inner_state)

    return optax.GradientTransformation(init, update)


class MasterState(NamedTuple):
    """The optimizer state under :func:`with_master_weights`: the master copy of the weights, and the
    inner optimizer's state (of the master copy)."""

    master: optax.Params
    inner: optax.OptState


def with_master_weights(inner: optax.GradientTransformation, dtype) -> optax.GradientTransformation:
    """Runs ``inner`` on a ``dtype`` (float32) copy of narrower weights: the gradients are cast up, the
    copy is updated, and the updates it returns take the weights to the copy rounded to their dtype
    (:func:`master_weights` gives the copy; the step assigns it rounded rather than adding updates)."""

    def init(params):
        master = jax.tree.map(lambda p: p.astype(dtype), params)
        return MasterState(master, inner.init(master))

    def update(grads, state: MasterState, params=None):
        grads = jax.tree.map(lambda g: g.astype(dtype), grads)
        updates, inner_state = inner.update(grads, state.inner, state.master)
        master = optax.apply_updates(state.master, updates)
        new = MasterState(master, inner_state)
        if params is None:
            return updates, new
        return jax.tree.map(lambda m, p: m - p.astype(dtype), master, params), new

    return optax.GradientTransformation(init, update)


def master_weights(opt_state):
    """Returns the master copy of the weights in an optimizer state (None without master weights)."""
    if isinstance(opt_state, LossScaleState):
        return master_weights(opt_state.inner)
    return opt_state.master if isinstance(opt_state, MasterState) else None


def loss_scale(opt_state) -> jax.Array | None:
    """Returns the loss scale of an optimizer state under :func:`dynamic_loss_scaling` (None without)."""
    return opt_state.scale if isinstance(opt_state, LossScaleState) else None


def make_optimizer(config: Config) -> optax.GradientTransformation:
    """Returns the Optax optimizer the config describes (warmup then cosine decay), under
    :func:`dynamic_loss_scaling` where ``precision.loss_scale`` asks for it (by default with float16)."""
    opt = config.optimizer
    warmup = min(opt.warmup_steps, max(config.train.steps - 1, 0))
    schedule = optax.warmup_cosine_decay_schedule(
        0.0, opt.learning_rate, warmup, max(config.train.steps, warmup + 1), opt.learning_rate * 0.1
    )
    mu_dtype = jnp.dtype(opt.mu_dtype) if opt.mu_dtype else None
    if opt.name == "adamw":
        tx = optax.adamw(schedule, b1=opt.b1, b2=opt.b2, eps=opt.eps, weight_decay=opt.weight_decay,
                         mu_dtype=mu_dtype)  # fmt: skip
    elif opt.name == "adam":
        tx = optax.adam(schedule, b1=opt.b1, b2=opt.b2, eps=opt.eps, mu_dtype=mu_dtype)
    else:
        tx = optax.sgd(schedule)
    if opt.grad_clip:
        tx = optax.chain(optax.clip_by_global_norm(opt.grad_clip), tx)
    if config.precision.master:
        tx = with_master_weights(tx, jnp.dtype(config.precision.master))
    if config.precision.loss_scaling:
        tx = dynamic_loss_scaling(tx, initial=INITIAL_LOSS_SCALE)
    return tx


def optimizer_shardings(config: Config, tx, abstract_opt, abstract_params, param_shardings, rules: Rules,
                    mesh: Mesh):  # fmt: skip
    """Returns the optimizer state's shardings: each moment like its parameter, further split over the
    batch axes the parameter is replicated over with ``optimizer.shard_over_data``, in pinned host memory
    with ``memory.offload_optimizer``; counters replicated on the device."""
    shardings = gradient_shardings(config, abstract_params, param_shardings, rules, mesh)
    if config.memory.offload_optimizer:
        _check_host_memory(mesh)
        shardings = jax.tree.map(lambda s: s.with_memory_kind(HOST), shardings)
    replicated = NamedSharding(mesh, P())
    return optax.tree_map_params(tx, lambda _, sharding: sharding, abstract_opt, shardings,
                                 transform_non_params=lambda _: replicated)  # fmt: skip


def gradient_shardings(config: Config, abstract_params, param_shardings, rules: Rules, mesh: Mesh):
    """Returns the shardings the optimizer reads each gradient in: its parameter's, further split over the
    batch axes the parameter is replicated over with ``optimizer.shard_over_data`` (as its moments are),
    and the context axes that split no weight (the sequence's devices hold the same weights, and their
    gradients are reduced over them too: Megatron's distributed optimizer splits over data x context),
    so that the gradients are reduce-scattered over those axes, not all-reduced (half the bytes) and then
    sliced, as Megatron's distributed optimizer does."""
    if not config.optimizer.shard_over_data:
        return param_shardings
    axes = rules.gradient_axes(mesh)

    def split(leaf, sharding):
        spec = split_over(leaf.shape, sharding.spec, axes, mesh)
        return NamedSharding(mesh, spec, memory_kind=sharding.memory_kind)

    return jax.tree.map(split, abstract_params, param_shardings)


def to_device(opt_state, shardings):
    """Moves host-resident optimizer state to device memory (inside the jitted step)."""
    return jax.tree.map(
        lambda x, s: jax.device_put(x, s.with_memory_kind("device")) if s.memory_kind == HOST else x,
        opt_state,
        shardings,
    )


def to_host(opt_state, shardings):
    """Moves updated optimizer state back to where ``shardings`` keep it."""
    return jax.tree.map(
        lambda x, s: jax.device_put(x, s) if s.memory_kind == HOST else x, opt_state, shardings
    )


def _check_host_memory(mesh: Mesh) -> None:
    device = mesh.devices.flat[0]
    kinds = {m.kind for m in device.addressable_memories()}
    if HOST not in kinds:
        raise ConfigError(
            f"memory.offload_optimizer=true: the {device.device_kind} devices this plan compiles for have no "
            f"{HOST} memory in JAX {jax.__version__} (compile-only GPUs have none), so the optimizer state "
            "cannot be placed on the host; plan on the GPUs themselves (--target local) or on cpu, or set "
            "memory.offload_optimizer=false"
        )
