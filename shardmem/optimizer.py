"""The Optax optimizer and where its state lives: dtype, sharding, device or host memory.

    tx = make_optimizer(config)                                  # warmup + cosine; optimizer.mu_dtype
    shardings = optimizer_shardings(config, tx, abstract_opt, abstract_params, param_shardings, rules, mesh)
    opt_state = to_device(opt_state, shardings)   # inside the step, when memory.offload_optimizer
    opt_state = to_host(opt_state, shardings)

Adam's two moments are two thirds of a mixed-precision model's state. Three keys shrink what a device holds:
``optimizer.mu_dtype`` stores the first moment in a narrower dtype (Optax's ``mu_dtype``);
``optimizer.shard_over_data`` (ZeRO-1) splits the state over the batch axes that parameters are
replicated over; ``memory.offload_optimizer`` keeps the state in pinned host memory and moves it to the
device only for the update.
"""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp
import optax
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

from shardmem.config import Config
from shardmem.errors import ConfigError
from shardmem.parallel.rules import Rules, spec_axes

HOST = "pinned_host"


def make_optimizer(config: Config) -> optax.GradientTransformation:
    """Returns the Optax optimizer the config describes (warmup then cosine decay)."""
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
    return tx


def optimizer_shardings(config: Config, tx, abstract_opt, abstract_params, param_shardings, rules: Rules,
                    mesh: Mesh):  # fmt: skip
    """Returns the optimizer state's shardings: each moment like its parameter, further split over the
    batch axes the parameter is replicated over with ``optimizer.shard_over_data``, in pinned host memory
    with ``memory.offload_optimizer``; counters replicated on the device."""
    shardings = param_shardings
    if config.optimizer.shard_over_data:
        batch_axes = spec_axes(rules.spec(("batch",))[0] if rules.spec(("batch",)) else None)
        shardings = jax.tree.map(lambda leaf, s: _split_over(leaf.shape, s, batch_axes, mesh),
                                 abstract_params, param_shardings)  # fmt: skip
    if config.memory.offload_optimizer:
        _check_host_memory(mesh)
        shardings = jax.tree.map(lambda s: s.with_memory_kind(HOST), shardings)
    replicated = NamedSharding(mesh, P())
    return optax.tree_map_params(tx, lambda _, sharding: sharding, abstract_opt, shardings,
                                 transform_non_params=lambda _: replicated)  # fmt: skip


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


def _split_over(shape, sharding: NamedSharding, axes, mesh: Mesh) -> NamedSharding:
    """``sharding`` with the mesh ``axes`` it does not use yet added to the first dimension they divide."""
    spec = list(sharding.spec) + [None] * (len(shape) - len(sharding.spec))
    used = {a for entry in spec for a in spec_axes(entry)}
    extra = tuple(a for a in axes if a not in used and mesh.shape[a] > 1)
    if not extra:
        return sharding
    for dim, size in enumerate(shape):
        current = spec_axes(spec[dim])
        if size % (math.prod(mesh.shape[a] for a in current + extra)) == 0:
            spec[dim] = current + extra if current else (extra[0] if len(extra) == 1 else extra)
            return NamedSharding(mesh, P(*spec), memory_kind=sharding.memory_kind)
    return sharding  # No dimension divides: stays as its parameter (small tensors such as norms).


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
