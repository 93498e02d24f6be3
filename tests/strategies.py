"""What the parallel-strategy tests (test_context, test_moe, test_pipeline) share: a few training steps on
random tokens, a strategy's program planned once and trained, and the comparison with one device."""

import jax
import jax.numpy as jnp
import numpy as np

from shardmem.planning.memory import make_target, plan_program


def train_steps(step, program, state, steps, first=0):
    """Runs ``step`` ``steps`` times on random token batches (batch ``i`` from key ``i``, so two runs from
    the same ``first`` see the same data); returns the losses and the last state."""
    losses = []
    for i in range(first, first + steps):
        tokens = jax.random.randint(jax.random.key(i), program.abstract_batch.shape, 0, 256, jnp.int32)
        state, metrics = step(state, jax.device_put(tokens, program.batch_sharding))
        losses.append(float(metrics["loss"]))
    return losses, state


def trained(program, steps=3):
    """Trains ``steps`` steps from init with the program's own step; returns ``(program, losses, params)``,
    what :func:`assert_same_training` compares against."""
    losses, state = train_steps(program.step, program, program.init(), steps)
    return program, losses, jax.device_get(state["params"])


def planned_and_trained(program, steps=3):
    """Plans ``program`` for CPU once and trains ``steps`` steps from init with the plan's compiled step,
    as ``shardmem train`` does; returns ``(program, report, compiled step, losses, state)``."""
    report, compiled = plan_program(program, make_target(program.config, "cpu"), count_remat_overhead=False)
    losses, state = train_steps(compiled, program, program.init(), steps)
    return program, report, compiled, losses, state


def assert_same_training(losses, params, one_device):
    """The losses and parameters equal ``one_device``'s ``(program, losses, params)``: the same global
    computation, reduced in another order (float32 rounding)."""
    _, want_losses, want_params = one_device
    np.testing.assert_allclose(losses, want_losses, rtol=2e-5)
    jax.tree.map(lambda a, b: np.testing.assert_allclose(a, b, rtol=1e-4, atol=1e-6),
                 jax.device_get(params), want_params)  # fmt: skip
