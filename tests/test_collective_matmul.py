"""Tests for the collective matmuls (``overlap.tensor_parallel``, shardmem.parallel.collective_matmul): the
program computes the plain program's loss and gradients on 8 CPU devices, whichever way the tokens are
split and whatever the remat policy or the kind of weight; a deviceless H100 plan runs sequence
parallelism's collectives as collective-permutes, each under a matmul; the key's errors."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from strategies import assert_same_training, trained

from shardmem.config import config_from_dict
from shardmem.errors import ConfigError
from shardmem.parallel import collective_matmul
from shardmem.parallel.mesh import build_mesh
from shardmem.parallel.rules import Rules
from shardmem.planning import hlo
from shardmem.planning.memory import plan
from shardmem.program import build_program


def _config(overlap, axes=None, rules=None, **sections):
    return config_from_dict({
        "model": {"preset": "tiny", "n_layers": 2},
        "mesh": {"axes": axes or {"data": 4, "tensor": 2}},
        "rules": {"residual_seq": ["tensor"]} if rules is None else rules,
        "remat": {"policy": "none"},
        "precision": {"params": "float32", "compute": "float32"},
        "optimizer": {"name": "sgd", "warmup_steps": 0, "learning_rate": 0.1},
        "train": {"global_batch": 8, "steps": 10},
        "overlap": {"tensor_parallel": overlap},
        **sections,
    })  # fmt: skip


def _program(overlap, **kwargs):
    config = _config(overlap, **kwargs)
    return build_program(config, build_mesh(config.mesh.axes, jax.devices()))


def _loss_and_grads(program):
    """The loss of one token batch and its gradients, from the program's own (sharded) parameters."""
    state = program.init()
    tokens = jax.random.randint(jax.random.key(1), program.abstract_batch.shape, 0, 256, jnp.int32)

    def loss_and_grads(params, rest, batch, frozen):
        with program.rules.activate(program.mesh):
            return jax.value_and_grad(program.loss, has_aux=True)(params, rest, batch, frozen)

    (loss, _), grads = jax.jit(loss_and_grads)(state["params"], state.get("model_state", {}),
                                               jax.device_put(tokens, program.batch_sharding),
                                               state.get("frozen"))  # fmt: skip
    return float(loss), jax.device_get(grads)


def _assert_same_loss_and_grads(overlap_program, plain_program):
    assert overlap_program.collective_matmuls and not plain_program.collective_matmuls
    (loss, grads), (want_loss, want_grads) = _loss_and_grads(overlap_program), _loss_and_grads(plain_program)
    np.testing.assert_allclose(loss, want_loss, rtol=2e-6)
    jax.tree.map(lambda a, b: np.testing.assert_allclose(a, b, rtol=2e-5, atol=2e-6), grads, want_grads)


# Each a split of the tokens over the tensor axis, with what else it must compose with.
LAYOUTS = {
    # 2 rows per data rank: the tensor axis splits the rows (residual_spec), kept in each device's order.
    "rows": {},
    # 1 row per data rank: it splits the sequence; chunks placed at each device's index.
    "sequence, full remat": dict(train={"global_batch": 4}, remat={"policy": "full"}),
    "rows, minimal remat": dict(remat={"policy": "minimal"}),
    "context x tensor": dict(axes={"data": 2, "context": 2, "tensor": 2},
                             rules={"residual_seq": ["context", "tensor"]}),
    # The batch over an axis the weights use (FSDP): the sequence split, the weights gathered inside.
    "fsdp x tensor": dict(axes={"data": 1, "fsdp": 4, "tensor": 2},
                          rules={"residual_seq": ["tensor"], "batch": ["data", "fsdp"], "embed": "fsdp"}),
    "LoRA on an int8 base": dict(finetune={"lora": {"rank": 4, "targets": ["layers/w*"]},
                                           "quantize": {"format": "int8", "group": 32,
                                                        "targets": ["layers/w_up", "layers/wq"]}}),
}  # fmt: skip


@pytest.mark.parametrize(  # The rows' on the newest JAX too: shard_map, custom_vjp and ppermute move.
    "layout",
    [
        pytest.param(name, marks=pytest.mark.newest if name == "rows" else pytest.mark.slow)
        for name in LAYOUTS
    ],
)
def test_the_loss_and_gradients_are_the_plain_programs(layout):
    sections = LAYOUTS[layout]
    _assert_same_loss_and_grads(_program(True, **sections), _program(False, **sections))


@pytest.mark.slow
def test_accumulated_gradients_train_as_the_plain_program():
    # Two micro-batches: the accumulation's per-group vmap (spmd_axis_name=data) batches the shard_map.
    sections = dict(train={"global_batch": 16, "micro_batches": 2, "steps": 10})
    plain = trained(_program(False, **sections), steps=2)
    program, losses, params = trained(_program(True, **sections), steps=2)
    assert program.collective_matmuls
    assert_same_training(losses, params, plain)


@pytest.fixture(scope="module")
def h100_plan():
    """A tiny bf16 step planned deviceless for 8 H100s: data 4 x tensor 2 with sequence parallelism, 2
    micro-batches, the projections as collective matmuls."""
    config = _config(True, model={"preset": "tiny", "n_layers": 2, "seq_len": 128},
                     precision={"params": "float32", "compute": "bfloat16"},
                     train={"global_batch": 16, "micro_batches": 2, "steps": 10})  # fmt: skip
    return plan(config, "h100-sxm", count_remat_overhead=False)


def _is_matmul(module, ins) -> bool:
    called = module.computations.get(ins.called[0], ()) if ins.opcode == "fusion" and ins.called else ()
    return (
        ins.opcode == "dot"
        or any(i.opcode in ("dot", "custom-call") for i in called)
        or (ins.opcode == "custom-call" and "__cublas" in ins.attributes)
    )


@pytest.mark.newest
def test_the_sequence_parallel_collectives_are_permutes_under_matmuls(h100_plan):
    module = h100_plan.module
    in_layers = [(ins, instructions) for instructions in module.computations.values() for ins in instructions
                 if "layers_0-1" in (ins.op_name or "")]  # fmt: skip
    kinds = {hlo.collective_kind(ins) for ins, _ in in_layers}
    # No all-gather or reduce-scatter of the residual stream is left in the layers: every transfer around
    # the projections is a collective-permute of one device's chunk.
    assert "collective-permute" in kinds and not kinds & {"all-gather", "reduce-scatter"}, kinds
    spans = []  # Matmuls XLA's scheduler put between each permute's start and its done.
    for ins, instructions in in_layers:
        if ins.opcode == "collective-permute-start":
            start = instructions.index(ins)
            done = next(i for i, d in enumerate(instructions)
                        if d.opcode == "collective-permute-done" and d.operands[0] == ins.name)  # fmt: skip
            spans.append(sum(_is_matmul(module, i) for i in instructions[start + 1 : done]))
    # Forward and backward, attention and MLP (one body per layer loop: accumulating with no FSDP, the step
    # compiles without double buffering): nearly every transfer runs beside a matmul (at tiny widths the
    # scheduler leaves one or two of the backward's partial sums beside a norm's gradient instead).
    assert len(spans) >= 8 and sum(n >= 1 for n in spans) >= 0.75 * len(spans), spans
    assert h100_plan.tensor_parallel.startswith("collective matmuls"), h100_plan.tensor_parallel


def test_the_plan_says_how_the_collectives_run():
    mesh = build_mesh({"data": 4, "tensor": 2}, jax.devices())
    rules = Rules.from_config({"residual_seq": ["tensor"]}, mesh.axis_names)
    on = collective_matmul.describe(True, rules, mesh, reference_model=True, pipelined=False)
    off = collective_matmul.describe(False, rules, mesh, reference_model=True, pipelined=False)
    assert on == ("collective matmuls: sequence parallelism's all-gathers and reduce-scatters over tensor=2 "
                  "in 2 chunks under the projections (overlap.tensor_parallel)")  # fmt: skip
    assert off.endswith("overlap.tensor_parallel: true runs them in chunks under them"), off
    plain = Rules.from_config({}, mesh.axis_names)  # No sequence parallelism: nothing to say.
    assert collective_matmul.describe(False, plain, mesh, reference_model=True, pipelined=False) == ""


def test_the_key_needs_sequence_parallelism_the_reference_model_and_no_pipeline():
    with pytest.raises(ConfigError, match=r"^overlap.tensor_parallel=true overlaps sequence parallelism's "
                       r"all-gathers and reduce-scatters: it needs one mesh axis .* rules.residual_seq=\[\] "
                       r"adds to rules.seq=\[\] .*or remove the key$"):  # fmt: skip
        _program(True, rules={})
    with pytest.raises(ConfigError, match=r"^overlap.tensor_parallel=true: a pipeline's stages run their "
                       r"layers without collective matmuls .*remove the key or the stage axis$"):  # fmt: skip
        _program(
            True,
            axes={"data": 2, "stage": 2, "tensor": 2},
            rules={"residual_seq": ["tensor"], "layers": "stage"},
            pipeline={"schedule": "1f1b"},
            train={"global_batch": 8, "micro_batches": 2},
        )
    mesh = build_mesh({"data": 4, "tensor": 2}, jax.devices())
    rules = Rules.from_config({"residual_seq": ["tensor"]}, mesh.axis_names)
    with pytest.raises(ConfigError, match=r"^overlap.tensor_parallel=true runs the reference model's "
                       r"projections as collective matmuls, but the model is your own"):  # fmt: skip
        collective_matmul.resolve(True, rules, mesh, reference_model=False, pipelined=False)


def test_a_layout_search_turns_the_key_off_where_it_cannot_apply():
    # tune --search layout tries layouts without sequence parallelism, or with a pipeline, beside one's own:
    # there a config's overlap.tensor_parallel: true would be an error, so each such candidate turns it off.
    from shardmem.explore.layout import Layout

    config = _config(True)
    sizes = {"data": 4, "tensor": 2}
    plain, sequence = (
        Layout(tuple(sizes.items()), 1, "none"),
        Layout(tuple(sizes.items()), 1, "none", sequence=True),
    )
    assert "overlap.tensor_parallel=false" in plain.overrides(config)
    assert "overlap.tensor_parallel=false" not in sequence.overrides(config)
    assert not config.replace(*plain.overrides(config)).overlap.tensor_parallel
    assert "overlap.tensor_parallel=false" not in plain.overrides(_config(False))  # Nothing to turn off.
