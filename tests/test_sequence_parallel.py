"""Tests for sequence parallelism (``rules.residual_seq`` over the tensor axis, Korthikanti et al. 2022):
training equals one device, the tensor-parallel all-reduces become all-gathers and reduce-scatters in a
deviceless H100 plan, the saved layer inputs shrink by the tensor size, and the rule's errors."""

from __future__ import annotations

import jax
import pytest
from strategies import assert_same_training, trained

from shardmem.config import config_from_dict
from shardmem.errors import ConfigError
from shardmem.parallel.mesh import build_mesh
from shardmem.parallel.rules import Rules
from shardmem.planning.memory import plan
from shardmem.step import build_program


def _config(axes, rules=None, **sections):
    return config_from_dict({
        "model": {"preset": "tiny"},
        "mesh": {"axes": axes},
        "rules": rules or {},
        "remat": {"policy": "full"},
        "precision": {"params": "float32", "compute": "float32"},
        "optimizer": {"name": "sgd", "warmup_steps": 0, "learning_rate": 0.1},
        "train": {"global_batch": 8, "steps": 10},
        **sections,
    })  # fmt: skip


def _program(axes, devices, rules=None):
    config = _config(axes, rules)
    return build_program(config, build_mesh(config.mesh.axes, devices))


@pytest.mark.slow
def test_sequence_parallel_training_matches_one_device():
    one_device = trained(_program({"data": 1}, jax.devices()[:1]))
    program, losses, params = trained(_program({"data": 4, "tensor": 2}, jax.devices(),
                                               {"residual_seq": ["tensor"]}))  # fmt: skip
    assert program.rules.mesh_axes("residual_seq") == ("tensor",)
    assert_same_training(losses, params, one_device)


@pytest.mark.slow
def test_the_all_reduces_become_all_gathers_and_reduce_scatters_and_layer_inputs_shrink():
    def h100_plan(rules):
        config = _config({"data": 4, "tensor": 2}, rules, model={"preset": "tiny", "seq_len": 256})
        return plan(config, "h100-sxm", count_remat_overhead=False)  # Deviceless.

    def saved_layer_inputs(report):  # Full remat keeps each layer's input: [layers, batch, seq, d_model].
        return [b.shape for b in report.top_buffers if b.scope == "layers_0-3/broadcast_in_dim"]

    tensor, sequence = h100_plan({}), h100_plan({"residual_seq": ["tensor"]})
    assert tensor.collectives["reduce-scatter"] == 0 < sequence.collectives["reduce-scatter"]
    assert sequence.collectives["all-reduce"] < tensor.collectives["all-reduce"] / 5
    # 4 layers x 2 rows per device x seq 256 (then 128 with the sequence split over tensor=2) x d_model 64.
    assert saved_layer_inputs(tensor) == ["f32[4,2,256,64]"]
    assert saved_layer_inputs(sequence) == ["f32[4,2,128,64]"]
    assert sequence.per_device["temp"] < tensor.per_device["temp"]


def test_residual_seq_follows_seq_unless_set_and_must_refine_it():
    axes = ("data", "context", "tensor")
    assert Rules.from_config({}, axes).mesh_axes("residual_seq") == ("context",)
    assert Rules.from_config({"seq": None}, axes).mesh_axes("residual_seq") is None
    assert Rules.from_config({"residual_seq": ["context", "tensor"]}, axes).mesh_axes("residual_seq") == (
        "context", "tensor")  # fmt: skip
    message = (r"^rules.residual_seq=\['tensor'\] with rules.seq=\['context'\]: the residual stream splits "
               r"each sequence as the layers do \(rules.seq\), then further \(sequence parallelism\); use "
               r"rules.residual_seq: \['context', 'tensor'\]$")  # fmt: skip
    with pytest.raises(ConfigError, match=message):
        Rules.from_config({"residual_seq": "tensor"}, axes)
