"""Tests for sequence parallelism (``rules.residual_seq`` over the tensor axis, Korthikanti et al. 2022):
training equals one device, the tensor-parallel all-reduces become all-gathers and reduce-scatters in a
deviceless H100 plan, the saved layer inputs shrink by the tensor size, and the rule's errors."""

from __future__ import annotations

import re

import jax
import pytest
from jax.sharding import PartitionSpec as P
from strategies import assert_same_training, trained

from shardmem.config import config_from_dict
from shardmem.errors import ConfigError
from shardmem.parallel.mesh import build_mesh
from shardmem.parallel.rules import Rules
from shardmem.planning import hlo
from shardmem.planning.memory import plan
from shardmem.program import build_program


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
    # 4 layers x 2 rows per device x seq 256 x d_model 64 (then 1 row: the rows split over tensor=2).
    assert saved_layer_inputs(tensor) == ["f32[4,2,256,64]"]
    assert saved_layer_inputs(sequence) == ["f32[4,1,256,64]"]
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


@pytest.fixture(scope="module")
def sequence_parallel_accumulating_step():
    """The optimized HLO of a tiny bf16 step planned deviceless for H100s (the CPU backend computes bf16
    in fp32): data 4 x tensor 2 with sequence parallelism, 2 micro-batches (their gradients reduced once:
    shardmem.program.accumulation's per-group vmap), the vocabulary-chunked loss."""
    config = _config({"data": 4, "tensor": 2}, {"residual_seq": ["tensor"]},
                     model={"preset": "tiny", "loss_chunk": 64},
                     precision={"params": "float32", "compute": "bfloat16"},
                     train={"global_batch": 16, "micro_batches": 2, "steps": 10})  # fmt: skip
    return plan(config, "h100-sxm", count_remat_overhead=False).module


@pytest.mark.newest
def test_the_norms_outputs_are_gathered_in_the_compute_dtype(sequence_parallel_accumulating_step):
    # Each norm runs on the device's share of the sequence; what the tensor-parallel matmuls gather is its
    # bf16 output (Megatron's), not the fp32 residual the norm reads (twice the bytes).
    # The dtypes of every [rows, seq_len 64, d_model 64] array that an all-gather (or a combined one) makes.
    gathered = [dtype for instructions in sequence_parallel_accumulating_step.computations.values()
                for ins in instructions if hlo.collective_kind(ins) == "all-gather"
                for dtype in re.findall(r"(\w+)\[\d+,64,64\]", ins.shape)]  # fmt: skip
    assert gathered and set(gathered) == {"bf16"}, gathered


@pytest.mark.newest
def test_the_chunked_loss_picks_its_targets_without_an_all_to_all(sequence_parallel_accumulating_step):
    # take_along_axis over the tensor-split vocabulary became an all-to-all of the logits over the batch's
    # devices inside the accumulation's vmap; a masked sum is a local sum and a [B, L] reduction.
    computations = sequence_parallel_accumulating_step.computations.values()
    kinds = [hlo.collective_kind(ins) for instructions in computations for ins in instructions]
    assert "all-to-all" not in kinds


@pytest.mark.newest
def test_the_collectives_around_the_tensor_parallel_matmuls_need_no_transposes(
    sequence_parallel_accumulating_step,
):
    # Split along the sequence, a [batch, seq, d_model] activation is gathered and reduce-scattered along
    # its second dimension, and XLA transposed each one to and from a sequence-major layout (142 transpose
    # kernels in the layer loops of this step, a read and a write of the gathered activation each). With
    # 2 rows per device the tensor axis splits the rows instead: the collectives run along the first.
    module = sequence_parallel_accumulating_step

    def transposes_only(ins):
        if ins.opcode in ("transpose", "copy"):
            return True
        called = module.computations.get(ins.called[0], ()) if ins.opcode == "fusion" else ()
        inner = {i.opcode for i in called}
        return "transpose" in inner and inner <= {"transpose", "copy", "bitcast", "parameter"}

    def residual_shaped(ins):  # [batch, seq, d_model] in some order; not the attention's per-head arrays.
        return any(len(dims.split(",")) == 3 for dims in re.findall(r"\w+\[([\d,]+)\]", ins.shape))

    layout = [(ins.op_name, ins.shape) for instructions in module.computations.values()
              for ins in instructions
              if "layers" in ins.op_name and transposes_only(ins) and residual_shaped(ins)]  # fmt: skip
    assert not layout, layout[:4]


def test_the_residual_stream_splits_the_rows_where_the_tensor_axis_divides_them():
    from shardmem.parallel.rules import residual_spec

    mesh = build_mesh({"data": 2, "context": 2, "tensor": 2}, jax.devices())
    rules = Rules.from_config({"residual_seq": ["context", "tensor"]}, mesh.axis_names)
    axes = ("batch", "residual_seq", None)
    assert residual_spec(rules, mesh, axes, (4, 64, 8)) == P(("data", "tensor"), "context")
    assert residual_spec(rules, mesh, axes, (2, 64, 8)) is None  # One row per device: the sequence.
    assert rules.spec(axes) == P("data", ("context", "tensor"))
    stacked = ("layers", "batch", "residual_seq", None)  # A pipeline's buffers follow the layers'.
    assert residual_spec(rules, mesh, stacked, (3, 4, 64, 8)) == P(None, ("data", "tensor"), "context")
    plain = Rules.from_config({}, mesh.axis_names)  # No sequence parallelism: the rules as they are.
    assert residual_spec(plain, mesh, axes, (4, 64, 8)) is None
    # Rows split over an axis the weights use too (FSDP's): the sequence, as XLA partitions it well.
    fsdp = Rules.from_config({"residual_seq": ["context", "tensor"], "embed": "data"}, mesh.axis_names)
    assert residual_spec(fsdp, mesh, axes, (4, 64, 8)) is None


def test_the_layers_keep_their_share_of_the_sequence_not_the_gathered_one():
    # Megatron's sequence-parallel linear layers: the norm's output is saved as the device's share and
    # gathered again for the weight gradients, not saved gathered (tensor x the bytes, twice per layer).
    config = _config({"data": 4, "tensor": 2}, {"residual_seq": ["tensor"]}, remat={"policy": "none"},
                     model={"preset": "tiny", "seq_len": 256},
                     precision={"params": "float32", "compute": "bfloat16"})  # fmt: skip
    report = plan(config, "h100-sxm", count_remat_overhead=False, top=40)
    stacked = [sorted(map(int, re.findall(r"\d+", b.shape.split("[")[1]))) for b in report.top_buffers
               if "stacked" in b.scope]  # fmt: skip
    # [layers 4, rows, seq 256, d_model 64] in any order: the device's share (1 of its 2 rows: the tensor
    # axis splits the rows, residual_spec) is kept, never the gathered 2.
    assert [1, 4, 64, 256] in stacked and [2, 4, 64, 256] not in stacked, stacked


@pytest.mark.parametrize(
    "policy", ["none", "full", pytest.param("minimal", marks=pytest.mark.newest), "save_out_proj"]
)
def test_each_scattered_sum_gathers_its_gradient_once(policy):
    # The out-projection's and the down-projection's reduce-scatters: in the backward pass their gradient
    # is gathered once for both backward matmuls (dgrad, wgrad), as Megatron's: the backward layer loop
    # gathers at most twice the forward's bytes (the two gradients, and the two saved shards gathered
    # again for the weight gradients, or the recomputed forward's two where remat recomputes the
    # projections), where each matmul gathering its own made it 3x (2.3x on XLA 0.12); so did a remat
    # that recomputes the projections (full, save_out_proj) gathering the shards once more.
    config = _config({"data": 4, "tensor": 2}, {"residual_seq": ["tensor"]}, remat={"policy": policy},
                     precision={"params": "float32", "compute": "bfloat16"},
                     train={"global_batch": 16, "micro_batches": 2, "steps": 10})  # fmt: skip
    module = plan(config, "h100-sxm", count_remat_overhead=False).module
    loops = {"forward": 0, "backward": 0}  # All-gathered bytes in the layer loops' bodies.
    for instructions in module.computations.values():
        for ins in instructions:
            body = re.search(r"body=%?([\w.\-]+)", ins.attributes) if ins.opcode == "while" else None
            inner = module.computations[body.group(1)] if body else []
            names = " ".join(i.op_name or "" for i in inner)
            # A layer loop: not the accumulation's, which runs them.
            if "jvp(layers_0-3)" in names and not any(i.opcode == "while" for i in inner):
                direction = "backward" if "transpose(jvp(layers_0-3)" in names else "forward"
                loops[direction] += sum(hlo.shape_bytes(i.shape) for i in inner
                                        if hlo.collective_kind(i) == "all-gather")  # fmt: skip
    assert 0 < loops["backward"] <= 2 * loops["forward"], loops  # XLA 0.12 moves some out of the loop.
