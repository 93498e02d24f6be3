"""Tests for shardmem.parallel.pipeline: GPipe and circular stages, even and uneven, train on 8 simulated
devices as one device does, the bubble, the collective-permute in the plan, checkpoints across stage
counts and splits, and the config errors."""

from __future__ import annotations

import math
import re

import jax
import numpy as np
import pytest
from strategies import assert_same_training, planned_and_trained, train_steps, trained

import shardmem
from shardmem.config import config_from_dict
from shardmem.errors import ConfigError, PlanError
from shardmem.parallel.mesh import build_mesh
from shardmem.parallel.pipeline import Pipeline
from shardmem.planning import hlo
from shardmem.program import build_program


def _config(axes, micro_batches=1, repeats=1, n_layers=4, schedule=None, **sections):
    return config_from_dict({
        "model": {"preset": "tiny", "n_layers": n_layers},
        "mesh": {"axes": axes},
        "remat": {"policy": "minimal"},
        "precision": {"params": "float32", "compute": "float32"},
        "optimizer": {"name": "sgd", "warmup_steps": 0, "learning_rate": 0.1},
        "train": {"global_batch": 16, "micro_batches": micro_batches, "steps": 10},
        "pipeline": {"repeats": repeats, "schedule": schedule},
        **sections,
    })  # fmt: skip


def _program(axes, devices, micro_batches=1, repeats=1, n_layers=4, schedule=None, **sections):
    config = _config(axes, micro_batches, repeats, n_layers, schedule, **sections)
    return build_program(config, build_mesh(config.mesh.axes, devices))


@pytest.fixture(scope="module")
def one_device():
    """No pipeline, on one device: three steps from init."""
    program = _program({"data": 1}, jax.devices()[:1])
    return trained(program)


@pytest.fixture(scope="module")
def gpipe():
    """{stage: 2, data: 2, fsdp: 2}, 4 micro-batches, planned once; the plan's compiled step trains, as
    in ``shardmem train``. Returns the program, its report and step, and three steps from init."""
    program = _program({"stage": 2, "data": 2, "fsdp": 2}, jax.devices(), micro_batches=4)
    return planned_and_trained(program)


@pytest.fixture(scope="module")
def one_device_3():
    """Three layers, no pipeline, on one device: three steps from init."""
    program = _program({"data": 1}, jax.devices()[:1], n_layers=3)
    return trained(program)


@pytest.fixture(scope="module")
def uneven():
    """Three layers on {stage: 2, data: 2, fsdp: 2} (the default split: 2 and 1), 4 micro-batches, planned
    once; the plan's compiled step trains three steps from init."""
    program = _program({"stage": 2, "data": 2, "fsdp": 2}, jax.devices(), micro_batches=4, n_layers=3)
    return planned_and_trained(program)


def test_bubble_fraction_is_gpipes_and_shrinks_with_chunks_per_stage():
    assert Pipeline(4, 8).bubble_fraction == pytest.approx(3 / 11)  # (S - 1) / (M + S - 1)
    assert Pipeline(8, 16).ticks == 23 and Pipeline(8, 16).bubble_fraction == pytest.approx(7 / 23)
    assert Pipeline(4, 8, repeats=2).bubble_fraction == pytest.approx(3 / 19)  # (S - 1) / (M R + S - 1)
    assert Pipeline(2, 4).describe() == ("2 stages x 4 micro-batches (GPipe): bubble (2-1)/(4+2-1) = 20.0%, "
                                         "5 micro-batch passes in flight per stage")  # fmt: skip
    circular = Pipeline(8, 16, repeats=2)
    assert Pipeline.from_json(circular.to_json()) == circular
    assert circular.describe().endswith(
        "(circular, 2 layer chunks per stage): bubble (8-1)/(16x2+8-1) = 17.9%, 39 micro-batch passes in "
        "flight per stage"
    )


def test_1f1b_keeps_gpipes_bubble_and_holds_s_micro_batches_as_megatron():
    one = Pipeline(4, 16, schedule="1f1b")
    assert one.bubble_fraction == Pipeline(4, 16).bubble_fraction == pytest.approx(3 / 19)
    assert one.in_flight == 4 and Pipeline(4, 16).in_flight == 19  # GPipe saves every tick's residuals.
    assert Pipeline(4, 4, schedule="1f1b").in_flight == 4
    # A tick runs a forward or one of two backward parts: 3 ticks a micro-batch, plus S - 1 rounds of fill
    # and drain, so the idle share is the formula's.
    assert one.ticks == (16 + 4 - 1) * 3
    assert 1 - one.table.busy / one.ticks == pytest.approx(one.bubble_fraction)
    # What a step's FLOPs count of each op: a forward at a third of the busy ticks, each backward half too.
    from shardmem.parallel.schedule import BACKWARD, IDLE

    shares = one.op_shares
    assert shares[IDLE] == pytest.approx(one.bubble_fraction)
    assert sum(shares.values()) == pytest.approx(1)
    assert shares[BACKWARD + 1] == pytest.approx((1 - shares[IDLE]) / 3)
    interleaved = Pipeline(4, 16, repeats=2, schedule="interleaved")
    # Megatron's warm-up: 2 (S - 1) + (R - 1) S + 1 = 11 chunk passes of half a stage, 5.5 micro-batches'
    # worth, S (1 + (S - 1) / (S R)) in Narayanan et al.; the table idles the formula's share.
    assert interleaved.in_flight == 11
    assert (
        interleaved.bubble_fraction == pytest.approx(3 / 35) == 1 - interleaved.table.busy / interleaved.ticks
    )
    assert Pipeline.from_json(interleaved.to_json()) == interleaved
    assert interleaved.describe() == (
        "4 stages x 16 micro-batches (interleaved 1F1B, 2 layer chunks per stage): bubble (4-1)/(16x2+4-1) "
        "= 8.6%, 11 micro-batch passes in flight per stage"
    )


@pytest.mark.parametrize("stages, micro_batches, repeats, parts", [(4, 8, 1, 2), (4, 8, 1, 1), (3, 7, 1, 2),
                                                                   (2, 4, 2, 2), (4, 8, 2, 1)])  # fmt: skip
def test_the_1f1b_table_runs_every_pass_once_after_its_inputs_and_stage_s_holds_s_minus_s(
    stages, micro_batches, repeats, parts
):
    from shardmem.parallel import schedule as ops

    table = ops.schedule_table(stages, micro_batches, repeats, parts)
    done, held, most = {}, [0] * stages, [0] * stages
    for tick, row in enumerate(table.rows):
        for stage in range(stages):
            op, micro, repeat = row[:3, stage]
            chunk = repeat * stages + stage
            if op == ops.IDLE:
                continue
            if op in (ops.FORWARD, ops.FORWARD_FROM_INPUT, ops.FORWARD_AND_HEAD):
                assert (op == ops.FORWARD_AND_HEAD) == (chunk == repeats * stages - 1)
                assert (op == ops.FORWARD_FROM_INPUT) == (chunk == 0)
                assert chunk == 0 or done[("F", micro, chunk - 1)] < tick  # Its input was made before.
                key = ("F", micro, chunk)
                held[stage] += 1
            else:
                part = 0 if op == ops.BACKWARD_TO_INPUT else op - ops.BACKWARD
                assert (op == ops.BACKWARD_TO_INPUT) == ((chunk, part) == (0, 0))
                if part < parts - 1:  # After the part before it, of the same chunk.
                    before = ("B", micro, chunk, part + 1)
                elif chunk < repeats * stages - 1:  # After the next chunk's backward.
                    before = ("B", micro, chunk + 1, 0)
                else:  # After its own forward, which ran the head.
                    before = ("F", micro, chunk)
                assert done[before] < tick
                key = ("B", micro, chunk, part)
                held[stage] -= part == 0
            assert key not in done
            done[key] = tick
            most[stage] = max(most[stage], held[stage])
    assert len(done) == micro_batches * repeats * stages * (1 + parts)
    assert max(most) == table.ring_slots
    if repeats == 1 or parts > 1:  # Else the ticks keep forwards and backwards in phase: see the next test.
        assert table.ticks == (micro_batches * repeats + stages - 1) * (1 + parts)  # The bubble formula's.
    if repeats == 1:
        assert most == [stages - s for s in range(stages)]  # Megatron-LM's 1F1B.


@pytest.mark.parametrize("stages, micro_batches, repeats", [(4, 8, 2), (2, 4, 2), (8, 64, 12), (4, 64, 5)])
def test_an_interleaved_table_of_whole_backwards_takes_the_bubble_formulas_time(
    stages, micro_batches, repeats
):
    """Chunks of one layer run their backward whole, two forwards' work, and a tick lasts its slowest op:
    a forward beside a neighbour's backward waited out the backward (GPT-3's layout, 8 x 12 x 64: 3,004
    forwards' time for the formula's 2,325). In phase, the table takes the formula's ``(M R + S - 1) 3``
    forwards, within one, and holds Megatron's warm-up of chunk passes."""
    from shardmem.parallel import schedule as ops

    table = ops.schedule_table(stages, micro_batches, repeats, 1)
    forward_ops = (ops.FORWARD, ops.FORWARD_FROM_INPUT, ops.FORWARD_AND_HEAD)
    worth = [
        max((op != ops.IDLE) * (1 if op in forward_ops else 2) for op in row[ops.OP]) for row in table.rows
    ]
    assert sum(worth) - (micro_batches * repeats + stages - 1) * 3 in (0, 1)
    assert table.ring_slots == 2 * (stages - 1) + (repeats - 1) * stages + 1


@pytest.mark.newest  # Reads the compiled HLO's collective-permutes.
def test_interleaved_ticks_hand_nothing_back_when_every_stage_runs_a_forward():
    """In phase, an interleaved table of whole backwards runs forwards only on even ticks, so no stage
    sends a gradient back then: each tick sent its output both ways, zeros the stage before dropped (at
    GPT-3's layout 823 messages of 12.6 MB a step over the network, 0.24 s). The compiled step makes the
    hand-offs the table's phases need: at 4 stages x 2 repeats x 4 micro-batches, 30 ticks, 45 permutes
    (60 before), each of one micro-batch's activations. (With 2 stages both ways are one permutation, which
    XLA sends once.)"""
    from shardmem.parallel import schedule as ops

    program = _program({"stage": 4, "data": 2}, jax.devices(), micro_batches=4, repeats=2, n_layers=8,
                       schedule="interleaved")  # fmt: skip
    module = hlo.parse_module(
        program.step.lower(program.abstract_state, program.abstract_batch).compile().as_text()
    )
    permutes = [ins for instructions in module.computations.values() for ins in instructions
                if hlo.collective_kind(ins) == "collective-permute"]  # fmt: skip
    message = hlo.collective_result_bytes(permutes[0])  # [rows, positions, d_model] of a micro-batch.
    assert message == (16 // 4 // 2) * program.config.model.seq_len * program.config.model.d_model * 4
    table = ops.schedule_table(4, 4, 2, 1)
    assert table.ticks == 30 and hlo.collective_bytes(module)["collective-permute"] == 45 * message
    assert table.hand_offs == ((True, False), (True, True))  # Even ticks: forward; odd ones: both ways.


@pytest.fixture(scope="module")
def one_f_one_b():
    """4 stages x 2 data on 8 devices, 8 micro-batches through the 1F1B schedule: three steps from init."""
    program = _program({"stage": 4, "data": 2}, jax.devices(), micro_batches=8, schedule="1f1b")
    return trained(program)


def test_1f1b_training_matches_one_device(one_f_one_b, one_device):
    program, losses, params = one_f_one_b
    assert program.pipeline.schedule == "1f1b" and program.pipeline.in_flight == 4  # S, as Megatron-LM's
    assert_same_training(losses, params, one_device)


@pytest.mark.newest  # Memory spaces in traced code differ between JAX versions.
def test_1f1b_keeps_what_the_remat_policy_offloads_in_host_memory(one_device):
    """``remat.policy: offload`` moves the layers' tagged activations to host memory, so the 1F1B ring of
    those residuals is allocated in host memory too: a ring in device memory refused them ("memory_space
    of all inputs passed to `dynamic_update_slice` must be the same"). On the CPU both are the same
    memory, so this checks that the step runs and trains as one device, not where the bytes live."""
    program = _program({"stage": 2, "data": 4}, jax.devices(), micro_batches=4, schedule="1f1b",
                       remat={"policy": "offload"})  # fmt: skip
    losses, state = train_steps(program.step, program, program.init(), 3)
    assert_same_training(losses, state["params"], one_device)


@pytest.mark.newest  # What XLA's GPU compiler can compile differs between JAX versions.
def test_offloaded_residuals_plan_in_host_memory_under_1f1b_and_gpipe_says_to_use_it():
    # XLA's GPU compiler fails on residuals offloaded inside GPipe's tick loop; 1F1B's ring in host
    # memory compiles, and the failure's message names that fix.
    def config(schedule):
        return _config({"stage": 2, "data": 2, "fsdp": 2}, micro_batches=4, schedule=schedule,
                       remat={"policy": "offload"})  # fmt: skip

    report = shardmem.plan(config("1f1b"), target="h100-sxm", count_remat_overhead=False)
    assert report.per_device["host"] > 0
    with pytest.raises(PlanError, match=r"under pipeline.schedule=gpipe, .* Set pipeline.schedule: 1f1b"):
        shardmem.plan(config("gpipe"), target="h100-sxm", count_remat_overhead=False)


@pytest.mark.slow
def test_interleaved_and_uneven_1f1b_training_match_one_device(one_device, one_device_3):
    # 2 stages x 2 virtual stages: stage 0 runs layers 0 and 2, stage 1 layers 1 and 3, tensor parallel.
    interleaved = _program({"stage": 2, "data": 2, "tensor": 2}, jax.devices(), micro_batches=4, repeats=2,
                           schedule="interleaved")  # fmt: skip
    losses, state = train_steps(interleaved.step, interleaved, interleaved.init(), 3)
    assert_same_training(losses, interleaved.natural_params(state["params"]), one_device)
    uneven = _program({"stage": 2, "data": 2, "fsdp": 2}, jax.devices(), micro_batches=4, n_layers=3,
                      schedule="1f1b")  # fmt: skip
    losses, state = train_steps(uneven.step, uneven, uneven.init(), 3)
    assert_same_training(losses, state["params"], one_device_3)


@pytest.mark.slow
@pytest.mark.parametrize("axes, rules", [
    ({"stage": 2, "data": 2, "tensor": 2}, {"residual_seq": ["tensor"]}),  # sequence parallel
    ({"stage": 2, "fsdp": 2, "tensor": 2}, {}),  # the embedding split over vocab and the model dimension
])  # fmt: skip
def test_1f1b_with_two_backward_parts_trains_as_one_device(one_device, axes, rules):
    # Two layers a stage, so each backward runs in two ticks.
    program = _program(axes, jax.devices(), micro_batches=4, schedule="1f1b", rules=rules)
    assert program.pipeline.backward_parts == 2 and program.pipeline.in_flight == 2
    losses, state = train_steps(program.step, program, program.init(), 3)
    assert_same_training(losses, state["params"], one_device)


@pytest.mark.newest  # XLA's partitioner differs between JAX versions.
def test_1f1b_compiles_with_the_embedding_split_over_vocab_and_the_model_dimension():
    """Stage x fsdp x tensor, the table split over vocab by tensor: JAX 0.12's partitioner aborted the
    process partitioning the embedding's gather inside the 1F1B shard_map (a failed check expanding its
    all-reduce's device groups), so the pipeline's embed looks its rows up block by block itself. Each
    device looks up in its own half of the table: nothing gathers the whole of it."""
    program = _program({"stage": 2, "fsdp": 2, "tensor": 2}, jax.devices(), micro_batches=4, schedule="1f1b")
    module = hlo.parse_module(
        program.step.lower(program.abstract_state, program.abstract_batch).compile().as_text()
    )
    vocab, d_model = program.config.model.vocab_size, program.config.model.d_model
    gathered = [ins.shape for instructions in module.computations.values() for ins in instructions
                if hlo.collective_kind(ins) == "all-gather"]  # fmt: skip
    assert f"[{vocab // 2},{d_model}]" in " ".join(gathered)  # The device's half, gathered over fsdp.
    assert not [shape for shape in gathered if f"[{vocab},{d_model}]" in shape]


@pytest.mark.slow
@pytest.mark.newest  # The differentiated jaxpr differs between JAX versions.
@pytest.mark.parametrize("policy", ["none", "full"])
def test_1f1b_flops_are_the_steps_without_a_pipeline_and_full_remat_recomputes(policy):
    """Counted by what each stage runs at each tick, a 1F1B step's matmuls are those of the same step
    without a pipeline (idle ticks run nothing); charging every tick its costliest op (the last stage's
    head, the costliest backward part) counted more, and the same with and without remat (issue 41)."""
    from shardmem.planning.memory import model_flops, op_shares

    def flops(program):
        jaxpr = program.step.trace(program.abstract_state, program.abstract_batch).jaxpr
        return hlo.matmul_flops(jaxpr, op_shares(program)), model_flops(program, jaxpr)

    remat = {"remat": {"policy": policy}}
    piped = _program({"stage": 2, "data": 4}, jax.devices(), micro_batches=4, schedule="1f1b", **remat)
    plain = _program({"data": 4}, jax.devices()[:4], micro_batches=4, **remat)
    assert flops(piped) == flops(plain)
    executed, model = flops(piped)
    assert executed > model if policy == "full" else executed == model


def test_an_interleaved_pipeline_of_bf16_weights_trains_on_the_cpu_as_one_device():
    # bfloat16 weights with float32 master weights: XLA:CPU aborted compiling any 1F1B step of them
    # ("Invalid binary instruction opcode copy", on the copies a conditional's branches made of the tick's
    # state; the ops now run as loops run once or never). Each side rounds its gradients to bfloat16 once
    # (the pipeline sums the micro-batches' in float32 first), so they agree to a bfloat16 rounding.
    from shardmem.program.optimizer import master_weights

    precision = {"params": "bfloat16", "compute": "float32", "master": "float32"}
    pipelined = _program({"stage": 2, "data": 2, "tensor": 2}, jax.devices(), micro_batches=4, repeats=2,
                         schedule="interleaved", precision=precision)  # fmt: skip
    one = _program({"data": 1}, jax.devices()[:1], precision=precision)

    def train(program):
        state = program.init()
        before = jax.device_get(program.natural_params(master_weights(state["opt_state"])))
        losses, state = train_steps(program.step, program, state, 1)
        after = jax.device_get(program.natural_params(master_weights(state["opt_state"])))
        more, _ = train_steps(program.step, program, state, 2, first=1)
        # SGD at learning rate 0.1 on the float32 master weights: the first step's gradients.
        return losses + more, jax.tree.map(lambda a, b: (a - b) / 0.1, before, after)

    (losses, gradients), (want_losses, want_gradients) = train(pipelined), train(one)
    np.testing.assert_allclose(losses, want_losses, rtol=1e-3)
    assert losses[0] == pytest.approx(want_losses[0], rel=1e-5)  # The same weights, in float32.
    jax.tree.map(lambda a, b: np.testing.assert_allclose(a, b, rtol=1e-2, atol=1e-2 * np.abs(b).max()),
                 gradients, want_gradients)  # fmt: skip


def test_1f1b_over_data_and_context_reduces_the_gradients_once_and_trains_as_one_device(one_device):
    # Each device sums its own rows' and positions' weight gradients over the ticks (the sequence split by
    # hand in the pipeline's shard_map) and they are reduced once: XLA's partitioner all-reduced them over
    # context in every tick, 4.1 MB at 4 micro-batches, 6.4 MB at 8.
    def program(micro_batches):
        return _program({"stage": 2, "data": 2, "context": 2}, jax.devices(), micro_batches=micro_batches,
                        schedule="1f1b", rules={"embed": None})  # fmt: skip

    def reduced(program):
        compiled = program.step.lower(program.abstract_state, program.abstract_batch).compile()
        return hlo.collective_bytes(compiled.as_text())["all-reduce"]

    four, eight = program(4), program(8)
    assert reduced(four) == reduced(eight)
    losses, state = train_steps(four.step, four, four.init(), 3)
    assert_same_training(losses, state["params"], one_device)


@pytest.mark.newest  # XLA's partitioner differs between JAX versions.
def test_1f1b_reduce_scatters_the_layers_gradients_where_the_optimizer_splits_them(one_device):
    # With optimizer.shard_over_data the optimizer reads each gradient split over data (here over the
    # repeats: 2 chunks of 1 layer per stage); the schedule reduce-scatters the layers' sums to those
    # pieces and nothing gathers them back, with tensor splitting the weights inside (XLA's partitioner
    # gathered them whole for a reduce-scatter).
    def program(split):
        return _program({"stage": 2, "data": 2, "tensor": 2}, jax.devices(), micro_batches=4, repeats=2,
                        schedule="interleaved", rules={"embed": None},
                        optimizer={"name": "sgd", "warmup_steps": 0, "learning_rate": 0.1,
                                   "shard_over_data": split})  # fmt: skip

    def collectives(program):
        compiled = program.step.lower(program.abstract_state, program.abstract_batch).compile()
        return hlo.collective_bytes(compiled.as_text())

    split, whole = program(True), program(False)
    (scattered, reduced) = collectives(split), collectives(whole)
    assert scattered["reduce-scatter"] > 0
    # The all-reduce's output bytes fall by the reduce-scatter's input, twice its output over data 2 (to
    # a few scalars: the gradient norm is summed over the pieces).
    assert reduced["all-reduce"] - scattered["all-reduce"] == pytest.approx(2 * scattered["reduce-scatter"],
                                                                           rel=1e-2)  # fmt: skip
    # What is gathered is the updated weights (ZeRO-1), once: the gradients are not gathered back.
    params = split.abstract_state["params"]
    held = sum(math.prod(p.sharding.shard_shape(p.shape)) * p.dtype.itemsize for p in jax.tree.leaves(params))
    assert 0 < scattered["all-gather"] <= held
    losses, state = train_steps(split.step, split, split.init(), 3)
    assert_same_training(losses, split.natural_params(state["params"]), one_device)


@pytest.mark.slow
def test_the_measured_peak_grows_with_micro_batches_under_gpipe_and_not_under_1f1b():
    # Micro-batches of a fixed size (1 row per device), so more of them is a larger batch: GPipe keeps
    # every micro-batch's residuals until its backward, 1F1B at most 4 of them per stage (stage s, 4 - s).
    from shardmem.planning.memory import make_target, plan_program

    def peak(schedule, micro_batches):
        model = {"preset": "tiny", "n_layers": 8, "d_model": 128, "seq_len": 128}
        train = {"global_batch": 2 * micro_batches, "micro_batches": micro_batches}
        config = _config({"stage": 4, "data": 2}, micro_batches, schedule=schedule, model=model, train=train)
        program = build_program(config, build_mesh(config.mesh.axes, jax.devices()))
        report, _ = plan_program(program, make_target(config, "local"), count_remat_overhead=False)
        return report.per_device["peak"]

    gpipe_growth = peak("gpipe", 16) - peak("gpipe", 8)
    one_f_one_b_growth = peak("1f1b", 16) - peak("1f1b", 8)
    # GPipe also holds the batch's embedded inputs and their gradient (1 x 128 x 128 fp32 a micro-batch);
    # 1F1B embeds each micro-batch in its first stage's tick, so it adds only their tokens and targets.
    batch_growth = 2 * 8 * 128 * 128 * 4
    assert one_f_one_b_growth <= 0.1 * batch_growth
    assert gpipe_growth >= 5 * batch_growth


def test_the_interleaved_peak_grows_with_neither_virtual_stages_nor_micro_batches():
    # 16 layers of width 256 on 2 stages x 4 data, 2 or 4 virtual stages (chunks of 4 or 2 layers), no
    # recomputation: a layer's weights (1 M floats) outweigh a pass's residuals (one row of 64 tokens) many
    # times, so anything weight-shaped a pass keeps (a mask of all R chunks' weights, once 103 x 12 x a
    # layer on GPT-3 175B) or a copy of the weights shows at once.
    from shardmem.planning.memory import make_target, plan_program

    def peak(repeats, micro_batches):
        model = {"preset": "tiny", "n_layers": 16, "d_model": 256, "n_heads": 4, "n_kv_heads": 4,
                 "d_ff": 1024}  # fmt: skip
        train = {"global_batch": 4 * micro_batches, "micro_batches": micro_batches}
        config = _config({"stage": 2, "data": 4}, micro_batches, repeats, schedule="interleaved", model=model,
                         train=train, remat={"policy": "none"})  # fmt: skip
        program = build_program(config, build_mesh(config.mesh.axes, jax.devices()))
        report, compiled = plan_program(program, make_target(config, "local"), count_remat_overhead=False)
        if (repeats, micro_batches) == (2, 8):
            # A chunk of 4 layers runs in 2 backward parts of 2: each op reads its layers' weights out of
            # the stage's [2, 4, ...] weights one at a time and adds each layer's gradient into the stage's
            # sums at its slot, so no array holds 2 layers of an MLP matrix (each op copied its part's
            # weights out of the stage's, and its part's gradient before adding it to the sums).
            shapes = re.findall(r"f32\[([\d,]*),(?:256,1024|1024,256)\]", compiled.as_text())
            layers = {math.prod(int(d) for d in shape.split(",")) for shape in shapes}
            assert 8 in layers and layers <= {1, 8}, layers  # 8: the stage's weights and sums, [2, 4, ...]
            # And each layer writes its residuals into the ring of passes, and its backward reads them out
            # of it, one layer at a time: no array holds a part's or a pass's MLP activations (a scan's
            # stack of them, zero-filled each pass, was copied into the ring and out again: [2, 1, ...],
            # [1, 2, 1, ...]).
            shapes = re.findall(r"f32\[([\d,]*),64,1024\]", compiled.as_text())
            passes = {math.prod(int(d) for d in shape.split(",")) for shape in shapes}
            assert 20 in passes and passes <= {1, 20}, passes  # 20: the ring, 5 passes of 4 layers
        return program.pipeline, report.per_device["peak"]

    (two, at_two), (four, at_four), (_, more_micro) = peak(2, 8), peak(4, 8), peak(2, 16)
    # Megatron's warm-up: 2 (S - 1) + (R - 1) S + 1 chunk passes at the first stage, 5 of 4 layers or 9 of 2:
    # 20 or 18 layers' residuals, so the peak may fall with R, never grow (it grew 10% here, 455 -> 503 MiB).
    assert (two.in_flight, four.in_flight) == (5, 9)
    assert at_four <= at_two * 1.02
    # Twice the micro-batches hold nothing more: only the batch's tokens grow.
    assert more_micro <= at_two * 1.02
    # The stage's weights, their sums of gradients and the gradients handed back, and 20 layer passes of
    # residuals (64 tokens, under 2 MiB each): no pass keeps weights (it held 455 MiB: each pass its chunks'
    # weights and a mask of every repeat's), and no op copies its part of them (155 MB, 37 layers, with
    # the copy of the part's weights and of its gradient; 121 MB without; 108 MB with the residuals
    # written into the ring in place).
    layer = (4 * 256 * 256 + 3 * 256 * 1024) * 4  # fp32
    stage_weights = 8 * layer
    assert at_two <= 3 * stage_weights + 20 * 2 * 2**20


@pytest.mark.slow
def test_gpipe_training_matches_one_device_and_the_plan_reports_the_schedule(gpipe, one_device):
    program, report, _, losses, state = gpipe
    wq = program.abstract_state["params"]["layers"]["wq"]
    assert wq.sharding.spec[0] == "stage" and wq.sharding.shard_shape(wq.shape)[0] == 2  # Own layers only.
    assert_same_training(losses, state["params"], one_device)
    assert report.pipeline == {"stages": 2, "micro_batches": 4, "repeats": 1, "schedule": "gpipe",
                               "ticks": 5, "bubble_fraction": 0.2, "in_flight": 5, "layers_per_stage": [2, 2],
                               "padded_slots": 0, "layers_sharded_over_stage": True}  # fmt: skip
    assert report.to_json()["pipeline"]["bubble_fraction"] == pytest.approx((2 - 1) / (4 + 2 - 1))
    # Every tick shifts each device's stage state [1 stage, 16 / 4 micro-batches / 4 batch shards rows,
    # seq 64, d_model 64] in f32 to the next stage, and the backward pass shifts its gradient back.
    state_bytes = 1 * 1 * 64 * 64 * 4
    assert report.collectives["collective-permute"] >= 2 * 5 * state_bytes
    # The saved layer inputs of every tick are layer buffers in the timeline, the largest live at the peak.
    assert report.top_buffers[0].scope.startswith("pipeline")
    assert hlo.category(report.top_buffers[0].scope) == "layers (other)"


@pytest.mark.slow
def test_circular_training_matches_one_device(one_device):
    # 4 layers, 2 stages, 2 chunks per stage: stage 0 runs layers 0 and 2, stage 1 layers 1 and 3; tensor
    # parallel inside the stages, as the shipped 70B config.
    program = _program({"stage": 2, "data": 2, "tensor": 2}, jax.devices(), micro_batches=2, repeats=2)
    assert program.pipeline.bubble_fraction == pytest.approx(1 / 5)
    # Stored [repeats, layers / repeats, embed, heads, head_dim]: stage s holds its chunk of each repeat.
    wq = program.abstract_state["params"]["layers"]["wq"]
    assert wq.shape[:2] == (2, 2) and tuple(wq.sharding.spec) == (None, "stage", None, "tensor")
    losses, state = train_steps(program.step, program, program.init(), 3)
    assert_same_training(losses, program.natural_params(state["params"]), one_device)


@pytest.mark.slow
def test_a_checkpoint_saved_with_stage_2_resumes_with_stage_1(resumes_with_one_device, gpipe, one_device):
    resumes_with_one_device(gpipe, one_device[0], train_steps)


def test_config_errors_name_the_key_the_value_and_the_fix():
    devices = jax.devices()
    with pytest.raises(ConfigError, match=r"micro_batches=1 is fewer than mesh.axes.stage=2.*at least 2"):
        _program({"stage": 2, "data": 4}, devices)
    with pytest.raises(ConfigError, match=r"mesh.axes.stage=8 is more than model.n_layers=4: every stage "
                       r"needs a layer of its own; use at most 4 stages"):  # fmt: skip
        _program({"stage": 8}, devices, micro_batches=8)
    with pytest.raises(ConfigError, match=r"stage=2 x pipeline.repeats=3 = 6 layer chunks do not divide "
                       r"model.n_layers=4; the circular schedule needs equal chunks: use a stage count that "
                       r"does \(none with these repeats\), or pipeline.repeats among \[1, 2\], or "
                       r"pipeline.repeats=1 for uneven stages$"):  # fmt: skip
        _program({"stage": 2, "data": 4}, devices, micro_batches=4, repeats=3)
    with pytest.raises(ConfigError, match=r"mesh.axes.stage=4 x pipeline.repeats=2 = 8 layer chunks .*"
                       r"pipeline.repeats=1 for uneven stages"):  # fmt: skip
        _program({"stage": 4, "data": 2}, devices, micro_batches=4, repeats=2)
    config = _config({"stage": 2, "data": 4}, 4, remat={"policy": "minimal", "layers": {"3": "none"}})
    slots = r"layer 3 \(slot 1\) has 'none' but layer 1 \(slot 1 of an earlier chunk\) has 'minimal'"
    with pytest.raises(ConfigError, match=r"remat.layers: .* same policy in every stage chunk; " + slots):
        build_program(config, build_mesh(config.mesh.axes, devices))
    with pytest.raises(ConfigError, match=r"pipeline.repeats=2 needs pipeline stages: add a stage mesh axis"):
        _config({"data": 8}, 2, repeats=2)
    with pytest.raises(ConfigError, match=r"mesh.axes.stage=2: .* a model of your own \(model.factory\) "
                       r"cannot be split into stages"):  # fmt: skip
        config_from_dict({"model": {"factory": "vit:build"}, "mesh": {"axes": {"stage": 2, "data": 4}}})
    with pytest.raises(ConfigError, match=r"mesh.axes.stage=2: pipeline stages are not supported with a "
                       r"mixture of experts"):  # fmt: skip
        config_from_dict({"model": {"preset": "tiny-moe"}, "mesh": {"axes": {"stage": 2, "data": 4}}})
    with pytest.raises(ConfigError, match=r"pipeline.repeats=0: must be positive"):
        _config({"data": 8}, repeats=0)
    with pytest.raises(ConfigError, match=r"pipeline.schedule='1fb1' is not a schedule \(did you "
                       r"mean '1f1b'\?\); use gpipe, circular, 1f1b or interleaved$"):  # fmt: skip
        _config({"stage": 2, "data": 4}, 2, schedule="1fb1")
    with pytest.raises(ConfigError, match=r"pipeline.schedule=1f1b with pipeline.repeats=2: 1f1b runs one "
                       r"chunk per stage, or use pipeline.schedule=interleaved$"):  # fmt: skip
        _config({"stage": 2, "data": 4}, 2, repeats=2, schedule="1f1b")
    with pytest.raises(ConfigError, match=r"pipeline.schedule=interleaved with pipeline.repeats=1: "
                       r"interleaved runs layer chunks: set pipeline.repeats to 2 or more, or use "
                       r"pipeline.schedule=1f1b$"):  # fmt: skip
        _config({"stage": 2, "data": 4}, 2, schedule="interleaved")
    with pytest.raises(ConfigError, match=r"pipeline.schedule=1f1b needs pipeline stages: add a stage mesh "
                       r"axis, e.g. mesh.axes.stage=4, or remove pipeline.schedule$"):  # fmt: skip
        _config({"data": 8}, 2, schedule="1f1b")
    groups = r"it runs the micro-batches in groups of mesh.axes.stage=4; use a multiple of 4 \(4 or 8\)$"
    interleaved = r"train.micro_batches=6 with pipeline.schedule=interleaved: "
    with pytest.raises(ConfigError, match=interleaved + groups):
        _program({"stage": 4, "data": 2}, devices, micro_batches=6, repeats=2, n_layers=8,
                 schedule="interleaved", train={"global_batch": 24, "micro_batches": 6})  # fmt: skip
    # stage: 1 is no pipeline: micro-batches accumulate gradients as without the axis.
    assert _program({"stage": 1, "data": 8}, devices, micro_batches=2).pipeline is None


def test_tune_mixes_remat_at_the_same_positions_of_every_stage_chunk():
    from shardmem.explore.tune import _mix, _mix_name

    config = _config({"stage": 2, "data": 4}, 4).replace(*_mix("save_qkv", "minimal", 1, 2, chunks=2))
    assert config.remat.layers == {"1": "minimal", "3": "minimal"}
    plan = config.remat_plan()
    Pipeline(2, 4).check(4, plan)  # One program runs both stages.
    assert Pipeline(2, 4).chunk_plan(plan, 4).describe() == "0: save_qkv, 1: minimal"
    # Uneven stages (2 and 1 of 3 layers): the last slot is stage 0's layer 1 only.
    assert _mix("save_qkv", "minimal", 1, 2, 2, counts=(2, 1))[1] == 'remat.layers={"1": minimal}'
    even = _mix("save_qkv", "minimal", 1, 3, 2, counts=(3, 3))
    assert even == _mix("save_qkv", "minimal", 1, 3, 2)
    assert even[1] == 'remat.layers={"2": minimal, "5": minimal}'
    name = _mix_name("full", "none", 3, 10, chunks=8)
    assert name == "full, the last 3 of each stage chunk's 10 layers: none"


@pytest.mark.slow
def test_tune_gives_a_pipeline_the_most_micro_batches():
    # Fewer micro-batches only raise a pipeline's peak and bubble: tune picked 2 here (bubble 33%).
    from shardmem.explore.tune import tune

    result = tune(_config({"stage": 2, "data": 4}, 2), "cpu", search="micro_batches")
    assert result.config.train.micro_batches == 4 and result.compiles == 1  # 16 sequences over data=4.
    assert "the smallest bubble, 20.0%" in result.explanation[1]


def test_sweep_rows_carry_the_bubble_and_the_collective_permute_bytes():
    from shardmem.explore.sweep import COLUMNS, SweepRow

    moved = {"collective-permute": 311296, "all-to-all": 1024}
    row = SweepRow(("mesh.axes.stage=2",), bubble_fraction=0.2, collectives=moved)
    flat = row.flat()
    assert list(flat) == list(COLUMNS)
    assert flat["bubble_fraction"] == 0.2 and flat["collective_permute_bytes"] == 311296
    assert flat["other_collective_bytes"] == 1024  # The permute was counted in "other" too.


def test_a_stage_axis_the_layers_rule_does_not_use_is_a_config_error():
    # Without the check, layers: null planned and trained with every stage storing all layers' weights and
    # optimizer state, and a batch rule over stage was a traceback from inside the vmap over stages.
    devices = jax.devices()
    for rules, message in [
        ({"layers": None}, r"rules.layers=None with mesh.axes.stage=2: .* set rules.layers: stage"),
        ({"layers": ["stage", "data"]}, r"rules.layers=\['stage', 'data'\] with mesh.axes.stage=2"),
        (
            {"batch": ["data", "stage"]},
            r"rules.batch=\['data', 'stage'\] uses the stage mesh axis .* remove stage from rules.batch",
        ),
    ]:
        config = _config({"stage": 2, "data": 4}, 2, rules=rules)
        with pytest.raises(ConfigError, match=message):
            build_program(config, build_mesh(config.mesh.axes, devices))


def test_the_default_split_is_the_most_even_one_first_stages_one_layer_more():
    assert Pipeline(4, 4).split(30) == (8, 8, 7, 7) and Pipeline(4, 4).padded_slots(30) == 2
    assert Pipeline(2, 4).split(4) == (2, 2) and Pipeline(2, 4).padded_slots(4) == 0
    assert Pipeline(2, 4, layer_counts=(3, 1)).split(4) == (3, 1)


@pytest.mark.slow
def test_uneven_stages_train_as_one_device_and_the_plan_says_the_split(uneven, one_device_3):
    program, report, _, losses, state = uneven
    wq = program.abstract_state["params"]["layers"]["wq"]
    assert "stage" not in tuple(wq.sharding.spec)  # 3 layers cannot be split over 2 stages: stored whole.
    assert_same_training(losses, state["params"], one_device_3)
    assert report.pipeline["layers_per_stage"] == [2, 1] and report.pipeline["padded_slots"] == 1
    from shardmem.planning.report import _pipeline_line

    line = _pipeline_line(report.pipeline)
    assert "stages of 2, 1 layers, 2 slots each: 1 padded slot of 4 run masked (25.0% of the layer" in line
    assert "replicated over stage" in line


@pytest.mark.slow
def test_explicit_stage_ranges_train_as_one_device(one_device):
    # 4 layers stored 2 per stage (sharded over stage), run as 3 + 1: the step gathers them into place.
    program = _program({"stage": 2, "data": 2, "fsdp": 2}, jax.devices(), micro_batches=4,
                       pipeline={"stages": ["0-2", "3"]})  # fmt: skip
    assert program.pipeline.layer_counts == (3, 1)
    assert program.abstract_state["params"]["layers"]["wq"].sharding.spec[0] == "stage"
    losses, state = train_steps(program.step, program, program.init(), 3)
    assert_same_training(losses, state["params"], one_device)


@pytest.mark.slow
def test_a_checkpoint_saved_with_uneven_stages_resumes_with_stage_1(resumes_with_one_device, uneven,
                                                                     one_device_3):  # fmt: skip
    resumes_with_one_device(uneven, one_device_3[0], train_steps)


def test_stage_range_errors_name_the_key_the_value_and_the_fix():
    axes = {"stage": 2, "data": 4}

    def ranges(stages, **kw):
        return _config(axes, 2, pipeline={"stages": stages, **kw})

    with pytest.raises(ConfigError, match=r"pipeline.stages\[1\]='2-x' is not a layer or a range of layers; "
                       r'write e.g. "0-7" or "8"'):  # fmt: skip
        ranges(["0-1", "2-x"])
    with pytest.raises(ConfigError, match=r"pipeline.stages\[1\]='3-2': the range runs backwards; write it "
                       r'as "2-3"'):  # fmt: skip
        ranges(["0-1", "3-2"])
    with pytest.raises(ConfigError, match=r"pipeline.stages\[0\]='1-2' starts at layer 1; the first stage "
                       r"must start at layer 0"):  # fmt: skip
        ranges(["1-2", "3"])
    with pytest.raises(ConfigError, match=r"pipeline.stages\[1\]='1-3' starts at layer 1; the stages must be "
                       r"contiguous, in order: after layer 1 start at 2"):  # fmt: skip
        ranges(["0-1", "1-3"])
    with pytest.raises(ConfigError, match=r"pipeline.stages\[1\]='2' ends at layer 2 but model.n_layers=4; "
                       r"the stages must cover every layer: end the last one at 3"):  # fmt: skip
        ranges(["0-1", "2"])
    with pytest.raises(ConfigError, match=r"pipeline.stages\[1\]='2-4': layers run from 0 to 3 "
                       r"\(model.n_layers=4\); end the last stage at layer 3"):  # fmt: skip
        ranges(["0-1", "2-4"])
    with pytest.raises(ConfigError, match=r"pipeline.stages has 3 ranges but mesh.axes.stage=2; give one "
                       r"range of layers per stage"):  # fmt: skip
        ranges(["0", "1-2", "3"])
    with pytest.raises(ConfigError, match=r"pipeline.stages with pipeline.repeats=2: the circular schedule "
                       r"splits the layers into equal chunks itself"):  # fmt: skip
        ranges(["0-1", "2-3"], repeats=2)
    with pytest.raises(ConfigError, match=r"pipeline.stages=\[\]: give one range of layers per stage"):
        ranges([])
    # A per-layer remat plan works per slot: layer 1 is stage 0's second slot, which stage 1 (layer 2) lacks.
    config = _config(axes, 2, n_layers=3, remat={"policy": "minimal", "layers": {"1": "none"}})
    pipeline = Pipeline(2, 2)
    pipeline.check(3, config.remat_plan())
    assert pipeline.chunk_plan(config.remat_plan(), 3).describe() == "0: minimal, 1: none"
    config = _config(axes, 2, n_layers=3, remat={"policy": "minimal", "layers": {"2": "none"}})
    with pytest.raises(ConfigError, match=r"layer 2 \(slot 0\) has 'none' but layer 0 \(slot 0 of an earlier "
                       r"chunk\) has 'minimal'"):  # fmt: skip
        pipeline.check(3, config.remat_plan())


def test_1f1b_trains_gemma_2s_layers_and_capped_logits_as_one_device():
    # Gemma 2's four norms a layer, scale and caps of the scores, and cap of the logits in the last stage's
    # loss (Llama.pipelined_loss): the same training as without a pipeline.
    gemma2 = ["model.post_norms=true", "model.attention_scale=0.5", "model.attention_softcap=1.0",
              "model.logit_softcap=2.0", "model.norm_offset=1.0", "model.scale_embeddings=true"]  # fmt: skip
    runs = []
    for axes, devices, schedule in (({"data": 1}, jax.devices()[:1], None),
                                    ({"stage": 4, "data": 2}, jax.devices(), "1f1b")):  # fmt: skip
        config = _config(axes, micro_batches=8 if schedule else 1, schedule=schedule).replace(*gemma2)
        runs.append(trained(build_program(config, build_mesh(config.mesh.axes, devices))))
    (_, losses, params), one_device = runs[1], runs[0]
    assert_same_training(losses, params, one_device)
