"""Gradients added into sums as the backward pass makes them (shardmem.gradient_sums): the sums plus the
gradient JAX takes of the weights, the layer stack's a layer at a time, through every remat segment."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from shardmem.config import config_from_dict
from shardmem.gradient_sums import value_and_grad_into
from shardmem.parallel.mesh import build_mesh
from shardmem.program import build_program
from shardmem.program.step import scaled_value_and_grad


@pytest.fixture(scope="module")
def tiny():
    """A 3-layer tiny model on one device in two remat segments (``full``, then ``none``), its loss, its
    parameters, a batch and float32 sums of random values."""
    config = config_from_dict({
        "model": {"preset": "tiny", "n_layers": 3, "seq_len": 32},
        "mesh": {"axes": {"data": 1}},
        "remat": {"policy": "full", "layers": {"2": "none"}},
        "precision": {"params": "bfloat16", "compute": "bfloat16", "master": "float32"},
        "train": {"global_batch": 2, "steps": 1},
    })  # fmt: skip
    program = build_program(config, build_mesh(config.mesh.axes, jax.devices()[:1]))
    params = program.init()["params"]
    tokens = jax.random.randint(jax.random.key(1), program.abstract_batch.shape, 0, 256, jnp.int32)
    keys = iter(jax.random.split(jax.random.key(2), len(jax.tree.leaves(params))))
    sums = jax.tree.map(lambda p: jax.random.normal(next(keys), p.shape, jnp.float32), params)
    return program.loss, params, tokens, sums


# On the newest JAX too: custom_vjp's rules and the scan's transpose carry the sums.
@pytest.mark.parametrize(
    "scale", [pytest.param(None, marks=pytest.mark.newest), 2.0**10], ids=["unscaled", "loss-scale"]
)
def test_the_new_sums_are_the_sums_plus_the_gradient(tiny, scale):
    loss_of_params, params, tokens, sums = tiny
    scale = None if scale is None else jnp.float32(scale)
    summing = value_and_grad_into(loss_of_params, stack="layers")
    into = jax.jit(lambda s, p, b: summing(s, p, {}, b, scale=scale))
    (loss, _), new_sums = into(sums, params, tokens)
    if scale is None:
        (want_loss, _), grads = jax.jit(jax.value_and_grad(loss_of_params, has_aux=True))(params, {}, tokens)
    else:
        scaled = scaled_value_and_grad(loss_of_params, grad_dtype=jnp.float32)
        (want_loss, _), grads = jax.jit(lambda p, b: scaled(p, {}, b, scale=scale))(params, tokens)
    assert float(loss) == pytest.approx(float(want_loss), rel=1e-6)
    # Each layer's bfloat16 gradient added in float32: the same sums as the whole gradient added after.
    jax.tree.map(lambda new, s, g: np.testing.assert_allclose(new, s + np.asarray(g, np.float32), rtol=1e-6,
                                                              atol=1e-6), new_sums, sums, grads)  # fmt: skip
    assert new_sums["layers"]["wq"].dtype == jnp.float32


def test_a_loss_that_runs_no_layer_scan_is_refused(tiny):
    loss_of_params, params, tokens, sums = tiny

    def head_only(params, rest, batch):  # Reads the stack's weights, but not through the layer scan.
        return jnp.mean(params["layers"]["wq"].astype(jnp.float32)), ({}, {})

    with pytest.raises(ValueError, match="no layer scan ran the parameters 'layers'"):
        value_and_grad_into(head_only, stack="layers")(sums, params, {}, tokens)
