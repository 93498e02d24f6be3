"""One program description (shardmem.program.description): the config resolved once, the builders reading
the description rather than the config, and planning taking a program of any kind
(shardmem.program.program), as a serving program will be."""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import pytest
from flax import nnx
from jax.sharding import NamedSharding

from shardmem.config import config_from_dict
from shardmem.errors import ConfigError
from shardmem.parallel.mesh import build_mesh
from shardmem.planning.memory import make_target, per_device_bytes, plan_program
from shardmem.program import Description, Function, Program, build_training, describe
from shardmem.program.model import sharded

pytestmark = pytest.mark.newest


@pytest.fixture(scope="module")
def description() -> Description:
    config = config_from_dict({
        "model": {"preset": "tiny", "n_layers": 2, "seq_len": 64},
        "mesh": {"axes": {"data": 2, "fsdp": 2, "tensor": 2}},
        "remat": {"policy": "minimal"},
        "precision": {"params": "float32", "compute": "float32"},
        "train": {"global_batch": 8},
        "memory": {"target": "cpu"},
    })  # fmt: skip
    return describe(config, build_mesh(config.mesh.axes, jax.devices()))


def test_the_training_builder_reads_the_description_not_the_config(description):
    with pytest.raises(dataclasses.FrozenInstanceError):
        description.seed = 1  # type: ignore[misc]
    built = build_training(description)
    blind = build_training(dataclasses.replace(description, config=None))  # No config to read piecemeal.
    assert built.function().trace().lower().as_text() == blind.function().trace().lower().as_text()
    assert built.kind == "training" and [f.name for f in built.functions] == ["step"]
    with pytest.raises(ValueError, match=r"no function 'decode': \['step'\]"):
        built.function("decode")


class _Mlp(nnx.Module):
    """A model of the user's own, without logical axes."""

    def __init__(self, rngs):
        self.up = nnx.Linear(8, 32, rngs=rngs)
        self.down = nnx.Linear(32, 4, rngs=rngs)


def test_a_description_for_a_program_that_does_not_train_asks_for_no_batch_loss_or_optimizer():
    config = config_from_dict({"mesh": {"axes": {"data": 2}}, "train": {"global_batch": 4}})
    mesh = build_mesh(config.mesh.axes, jax.devices()[:2])
    with pytest.raises(ConfigError, match="data.batch is not set"):
        describe(config, mesh, model_factory=_Mlp)
    model_only = describe(config, mesh, model_factory=_Mlp, training=False)
    assert model_only.training is None and model_only.model.factory.custom
    shapes = sorted(leaf.shape for leaf in jax.tree.leaves(model_only.model.params))
    assert shapes == [(4,), (8, 32), (32,), (32, 4)]
    with pytest.raises(ValueError, match="training=True"):
        build_training(model_only)


class _Logits(Program):
    """A program of another kind: the reference model's logits for a batch of prompts, nothing trained."""

    kind = "logits"

    @property
    def functions(self) -> tuple[Function, ...]:
        d = self.description
        params = sharded(d.abstract_params, d.param_shardings)
        batch_sharding = NamedSharding(d.mesh, d.rules.spec(("batch",)))
        tokens = jax.ShapeDtypeStruct((8, 64), jnp.int32, sharding=batch_sharding)

        def logits(params, tokens_BxL):
            with d.rules.activate(d.mesh):
                return nnx.merge(d.model.graphdef, params)(tokens_BxL)

        groups = {"params": params, "batch": tokens}
        return (Function("logits", jax.jit(logits), (params, tokens), groups, tokens=8 * 64),)


def _build_logits(description: Description) -> _Logits:
    def init():
        return nnx.to_pure_dict(nnx.state(description.model.factory.build(nnx.Rngs(0)), nnx.Param))

    return _Logits(description, jax.jit(init, out_shardings=description.param_shardings), _build_logits)


def test_planning_takes_a_program_of_another_kind(description):
    program = _build_logits(describe(description.config, description.mesh, training=False))
    report, _ = plan_program(program, make_target(description.config))
    params = sharded(description.abstract_params, description.param_shardings)
    assert report.per_device["params"] == per_device_bytes(params) > 0
    assert report.per_device["optimizer"] == 0 and report.per_device["batch"] == 8 * 64 * 4 // 4
    # The model remats its layers ("minimal"), but a forward pass alone recomputes nothing: the plan's
    # baseline, the same kind of program for the config without remat (Program.variant), has its FLOPs.
    assert report.remat == "0-1: minimal" and report.recompute_overhead == 0.0
    assert report.step_time is not None and report.step_time.tokens_per_second > 0
