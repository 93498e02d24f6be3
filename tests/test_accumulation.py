"""Gradient accumulation reduces the gradients across devices once per step (shardmem.program.accumulation):
over the data axes, and over the context axes, whose devices each sum their own positions' gradients."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from shardmem.config import config_from_dict
from shardmem.parallel.mesh import build_mesh
from shardmem.planning import hlo
from shardmem.planning.memory import plan
from shardmem.program import build_program
from shardmem.program.accumulation import deferred_axes

REDUCTIONS = ("all-reduce", "reduce-scatter")


def _config(axes, micro_batches, rules=None, **train):
    return config_from_dict({
        "model": {"preset": "tiny", "n_layers": 2},
        "mesh": {"axes": axes},
        "rules": rules or {},
        "remat": {"policy": "minimal"},
        "precision": {"params": "float32", "compute": "float32"},
        "optimizer": {"name": "sgd", "warmup_steps": 0, "learning_rate": 1.0, "grad_clip": None},
        "train": {"global_batch": 128, "micro_batches": micro_batches, "steps": 10, **train},
    })  # fmt: skip


def _one_step(axes, micro_batches, rules=None, **train):
    """(bytes per device of each collective kind in the compiled step, loss, grad_norm, the gradients)."""
    config = _config(axes, micro_batches, rules, **train)
    program = build_program(config, build_mesh(config.mesh.axes, jax.devices()))
    compiled = program.step.lower(program.abstract_state, program.abstract_batch).compile()
    state = program.init()
    before = jax.device_get(state["params"])
    tokens = jax.random.randint(jax.random.key(1), program.abstract_batch.shape, 0, 256, jnp.int32)
    new, metrics = compiled(state, jax.device_put(tokens, program.batch_sharding))
    grads = jax.tree.map(np.subtract, before, jax.device_get(new["params"]))  # SGD, learning rate 1.
    loss, grad_norm = float(metrics["loss"]), float(metrics["grad_norm"])
    return hlo.collective_bytes(compiled.as_text()), loss, grad_norm, grads


# On the newest JAX too: FSDP's case, the one whose reduce-scatters XLA could place otherwise.
FSDP_ONCE = pytest.param(({"fsdp": 8}, {"fsdp_reduce_once": True}), marks=pytest.mark.newest)


@pytest.fixture(scope="module", params=[({"data": 8}, {}), FSDP_ONCE], ids=["data", "fsdp-reduce-once"])
def one_and_sixteen(request):
    axes, train = request.param
    return _one_step(axes, 1, **train), _one_step(axes, 16, **train)


def test_gradient_reductions_do_not_grow_with_micro_batches(one_and_sixteen):
    (one, *_), (sixteen, *_) = one_and_sixteen
    reduced_one = sum(one[kind] for kind in REDUCTIONS)
    reduced_sixteen = sum(sixteen[kind] for kind in REDUCTIONS)
    assert reduced_one > 200_000  # The tiny model's gradients (fp32), reduced once.
    # Inside the accumulation loop they were 16 x reduced_one; a few bytes of scalars may differ.
    assert reduced_one <= reduced_sixteen <= reduced_one + 1024


def test_accumulated_loss_and_gradients_equal_the_whole_batch(one_and_sixteen):
    (_, loss_one, norm_one, grads_one), (_, loss_sixteen, norm_sixteen, grads_sixteen) = one_and_sixteen
    assert loss_sixteen == pytest.approx(loss_one, rel=1e-5)
    assert norm_sixteen == pytest.approx(norm_one, rel=1e-4)
    close = lambda a, b: np.testing.assert_allclose(a, b, rtol=1e-3, atol=1e-7)  # noqa: E731
    jax.tree.map(close, grads_sixteen, grads_one)


@pytest.fixture(scope="module")
def context_steps():
    """Data 4 x context 2, the weights whole on every device (rules.embed: null): one step without
    accumulation and with 2 and 8 micro-batches."""
    axes, rules = {"data": 4, "context": 2}, {"embed": None}
    return {k: _one_step(axes, k, rules) for k in (1, 2, 8)}


def test_context_parallel_gradients_are_reduced_once_whatever_the_micro_batches(context_steps):
    # Each device sums its own positions' gradients over the micro-batches (the sequence split by hand),
    # reduced over data x context after the loop: XLA's partitioner all-reduced every micro-batch's over
    # context (and data), 1.8 MB at 2 micro-batches, 5.0 MB at 8.
    one, two, eight = (context_steps[k][0] for k in (1, 2, 8))
    assert two == eight
    # No more than the step without accumulation reduces (the fp32 gradients, once).
    assert 200_000 < sum(eight[kind] for kind in REDUCTIONS) <= sum(one[kind] for kind in REDUCTIONS)


def test_context_parallel_accumulation_gives_the_whole_batchs_loss_and_gradients(context_steps):
    _, loss_one, norm_one, grads_one = context_steps[1]
    for k in (2, 8):
        _, loss, norm, grads = context_steps[k]
        assert loss == pytest.approx(loss_one, rel=1e-5) and norm == pytest.approx(norm_one, rel=1e-4)
        jax.tree.map(lambda a, b: np.testing.assert_allclose(a, b, rtol=1e-3, atol=1e-7), grads, grads_one)


def _deferred(axes, **train):
    config = _config(axes, 16, **train)
    program = build_program(config, build_mesh(config.mesh.axes, jax.devices()))
    params = program.state_shardings["params"]
    return deferred_axes(program.rules, program.mesh, params, program.batch_sharding,
                         config.train.fsdp_reduce_once)  # fmt: skip


def test_fsdp_gradients_wait_for_the_step_only_when_asked():
    assert _deferred({"data": 2, "fsdp": 4}) == ("data",)  # Replicated over data: deferred for free.
    assert _deferred({"fsdp": 8}) == ()  # A sharded gradient per micro-batch, as PyTorch FSDP does.
    assert _deferred({"data": 2, "fsdp": 4}, fsdp_reduce_once=True) == ("data", "fsdp")
    assert _deferred({"data": 4, "tensor": 2}) == ("data",)


@pytest.mark.parametrize("micro_batches", [1, pytest.param(4, marks=pytest.mark.newest)])
def test_a_data_sharded_optimizer_reduce_scatters_the_gradients(micro_batches):
    # With optimizer.shard_over_data each device updates its share of every parameter, so the step's one
    # gradient reduction is a reduce-scatter (Megatron's distributed optimizer). With 4 micro-batches it
    # was an all-reduce of the whole fp32 gradient (twice the bytes), then sliced. Planned deviceless for
    # H100s: the CPU compiler leaves an all-reduce and a slice where the GPU's makes a reduce-scatter.
    config = _config({"data": 8}, micro_batches).replace("optimizer.name=adamw",
                                                         "optimizer.shard_over_data=true")  # fmt: skip
    report = plan(config, "h100-sxm", count_remat_overhead=False)
    gradient_bytes = report.per_device["params"]  # fp32, replicated over data: the whole gradient.
    assert report.collectives["all-reduce"] < 1024  # The loss and the gradient norm: scalars.
    # Each device's result is its eighth (small tensors such as the norms' scales stay whole).
    assert gradient_bytes / 8 <= report.collectives["reduce-scatter"] <= gradient_bytes / 4


@pytest.mark.newest
def _backward_loops(axes):
    """The compiled step's layer-scan backward loops (their text) for bfloat16 weights with float32 master
    weights over 4 micro-batches, and the stack's w_gate shape."""
    config = _config(axes, 4).replace("precision.params=bfloat16", "precision.compute=bfloat16",
                                      "precision.master=float32")  # fmt: skip
    program = build_program(config, build_mesh(config.mesh.axes, jax.devices()))
    text = program.step.lower(program.abstract_state, program.abstract_batch).compile().as_text()
    backward = [line for line in text.splitlines() if " while(" in line and "transpose(jvp(layers_" in line]
    assert backward
    return backward, program.abstract_state["params"]["layers"]["w_gate"].shape


def test_each_layers_gradient_is_added_to_the_float32_sums_as_the_backward_pass_makes_it():
    # Over data 8 (a group of rows each): the layer scan's backward loop carries each group's float32
    # sums of the stack and adds every layer's gradient into its slice. It returned the micro-batch's
    # whole bfloat16 gradient of the stack ([layers, group, ...]), added to the sums only after the loop:
    # 15 GiB on Llama 3.1 8B.
    backward, (layers, *shape) = _backward_loops({"data": 8})
    dims = ",".join(map(str, shape))
    assert any(f"f32[1,{layers},{dims}]" in line for line in backward)  # The sums, one group's.
    assert not any(f"bf16[{layers},1,{dims}]" in line for line in backward)  # No whole gradient.


def test_where_fsdp_reduce_scatters_every_micro_batch_the_sharded_gradient_is_added_after_it():
    # FSDP 8: each layer's gradient is reduce-scattered in the backward loop into the stack's sharded
    # gradient, added to the sums after the micro-batch (with the adds in the loop XLA hid less of the
    # reduce-scatters: llama-70b.yaml 4.8 -> 5.73 s predicted). The loop builds the stack's bfloat16
    # gradient, sharded; with the per-layer adds it held only the float32 sums.
    backward, (layers, d_model, d_ff) = _backward_loops({"fsdp": 8})
    assert any(f"bf16[{layers},{d_model // 8},{d_ff}]" in line for line in backward), backward
