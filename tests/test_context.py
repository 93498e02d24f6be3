"""Tests for context (sequence) parallelism, shardmem.parallel.context: the zigzag order by hand, each
attention kernel on a split sequence against one device, the tiny model trained with context 2 and 4 beside
data and FSDP against one device, a checkpoint resumed across context sizes, the gather in the plan, and the
config errors."""

from __future__ import annotations

from functools import partial
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx
from strategies import assert_same_training, planned_and_trained, train_steps, trained

from shardmem.config import config_from_dict, load_config
from shardmem.errors import ConfigError
from shardmem.models.attention import AttentionKernel, causal_attention, resolve_attention
from shardmem.parallel import context
from shardmem.parallel.mesh import build_mesh
from shardmem.parallel.rules import Rules, constrain
from shardmem.planning.memory import make_target, plan, plan_program
from shardmem.program import build_program

ROOT = Path(__file__).resolve().parents[1]


def test_zigzag_gives_device_i_chunks_i_and_2c_minus_1_minus_i():
    # 2 devices, 4 chunks of 2 positions: device 0 holds chunks 0 and 3, device 1 chunks 1 and 2.
    np.testing.assert_array_equal(context.positions(8, 2), [0, 1, 6, 7, 2, 3, 4, 5])
    np.testing.assert_array_equal(context.positions(8, 1), np.arange(8))
    x = np.arange(2 * 24 * 3).reshape(2, 24, 3)
    for shards in (1, 2, 3, 4):
        zig = context.to_zigzag(x, shards)
        np.testing.assert_array_equal(context.from_zigzag(zig, shards), x)
        np.testing.assert_array_equal(
            zig[:, :, 0] // 3 % 24, np.broadcast_to(context.positions(24, shards), (2, 24))
        )
        # Every device attends to the same number of keys: sum of (position + 1) over its part.
        work = (np.asarray(context.positions(24, shards)) + 1).reshape(shards, -1).sum(1)
        assert len(set(work)) == 1
    np.testing.assert_array_equal(context.to_zigzag(jnp.asarray(x), 4), context.to_zigzag(x, 4))


def _qkv(dtype, length=64, heads=4, kv_heads=2):
    keys = jax.random.split(jax.random.key(0), 3)
    q = jax.random.normal(keys[0], (4, length, heads, 16), dtype)
    k, v = (jax.random.normal(key, (4, length, kv_heads, 16), dtype) for key in keys[1:])
    return q, k, v


KERNELS = [
    AttentionKernel("xla"),
    AttentionKernel("chunked", chunk=4),
    AttentionKernel("pallas", interpret=True),
]


@pytest.mark.newest
@pytest.mark.parametrize(
    "kernel, shards",
    [(kernel, 4) for kernel in KERNELS] + [(KERNELS[-1], 2)],  # Context 2: NeMo's and DGX Cloud's Llamas.
    ids=lambda p: p.name if isinstance(p, AttentionKernel) else f"context{p}",
)
def test_each_kernel_on_a_split_sequence_matches_one_device_with_its_gradients(kernel, shards):
    """context=4 (or 2) beside data=2 (or 4); the Pallas kernel in interpret mode: the code a GPU compiles,
    forward and backward, with 2 query heads to a key/value head; the loss weighs every position
    differently, so any misplaced position shows."""
    q, k, v = _qkv(jnp.float32)
    weight = jax.random.normal(jax.random.key(3), q.shape)

    def loss(attend, q, k, v):
        return (attend(q, k, v) * weight).sum()

    want = jax.value_and_grad(lambda *a: loss(causal_attention, *a), argnums=(0, 1, 2))(q, k, v)
    mesh = build_mesh({"data": 8 // shards, "context": shards}, jax.devices())
    rules = Rules.from_config({"heads": None, "kv_heads": None}, mesh.axis_names)

    @jax.jit
    def split(q, k, v):
        with rules.activate(mesh):

            def attend(q, k, v):  # The model's order: zigzag in, attention, back in order.
                q, k, v = (constrain(context.to_zigzag(x, shards), ("batch", "seq")) for x in (q, k, v))
                return context.from_zigzag(context.attend(kernel, q, k, v), shards)

            return jax.value_and_grad(lambda *a: loss(attend, *a), argnums=(0, 1, 2))(q, k, v)

    got = split(q, k, v)
    np.testing.assert_allclose(got[0], want[0], rtol=1e-5)
    for a, b in zip(got[1], want[1], strict=True):
        np.testing.assert_allclose(a, b, rtol=1e-4, atol=1e-5)


@pytest.mark.parametrize("kernel", KERNELS[:2], ids=lambda k: k.name)
def test_soft_capped_scores_on_a_split_sequence_match_one_device_with_their_gradients(kernel):
    """Gemma 2's cap (model.attention_softcap) over context 4: each block of queries caps its scores."""
    q, k, v = _qkv(jnp.float32)
    q, weight = q * 4, jax.random.normal(jax.random.key(3), q.shape)  # Scores past the cap.

    def loss(attend, q, k, v):
        return (attend(q, k, v) * weight).sum()

    want = jax.value_and_grad(lambda *a: loss(partial(causal_attention, softcap=1.0), *a), (0, 1, 2))(q, k, v)
    mesh = build_mesh({"data": 2, "context": 4}, jax.devices())
    rules = Rules.from_config({"heads": None, "kv_heads": None}, mesh.axis_names)

    @jax.jit
    def split(q, k, v):
        with rules.activate(mesh):

            def attend(q, k, v):
                q, k, v = (constrain(context.to_zigzag(x, 4), ("batch", "seq")) for x in (q, k, v))
                return context.from_zigzag(context.attend(kernel, q, k, v, softcap=1.0), 4)

            return jax.value_and_grad(lambda *a: loss(attend, *a), argnums=(0, 1, 2))(q, k, v)

    got = split(q, k, v)
    np.testing.assert_allclose(got[0], want[0], rtol=1e-5)
    assert abs(float(loss(causal_attention, q, k, v)) - float(want[0])) > 1  # The cap changes the loss.
    for a, b in zip(got[1], want[1], strict=True):
        np.testing.assert_allclose(a, b, rtol=1e-4, atol=1e-5)


@pytest.mark.slow
def test_the_pallas_blocks_in_bf16_match_one_device_within_bf16_tolerance():
    q, k, v = (x[:2, :32] for x in _qkv(jnp.bfloat16))
    mesh = build_mesh({"data": 2, "context": 4}, jax.devices())
    rules = Rules.from_config({}, mesh.axis_names)
    kernel = AttentionKernel("pallas", interpret=True)

    def split(q, k, v):
        with rules.activate(mesh):
            q, k, v = (constrain(context.to_zigzag(x, 4), ("batch", "seq")) for x in (q, k, v))
            return context.from_zigzag(context.attend(kernel, q, k, v), 4)

    def grads(fn):
        return jax.jit(jax.grad(lambda *a: (fn(*a).astype(jnp.float32) ** 2).sum(), argnums=(0, 1, 2)))(
            q, k, v
        )

    out = jax.jit(split)(q, k, v).astype(jnp.float32)
    assert jnp.abs(out - causal_attention(q, k, v).astype(jnp.float32)).max() < 0.05  # 8 mantissa bits
    for a, b in zip(grads(split), grads(causal_attention), strict=True):
        a, b = a.astype(jnp.float32), b.astype(jnp.float32)
        assert jnp.abs(a - b).max() <= 0.05 * jnp.abs(b).max()


# --- The tiny model on 8 simulated devices -------------------------------------------------------


def _config(axes, **model):
    return config_from_dict({
        "model": {"preset": "tiny", "n_layers": 2, "loss_chunk": 8, "attention_chunk": 16, **model},
        "mesh": {"axes": axes},
        "remat": {"policy": "minimal"},
        "precision": {"params": "float32", "compute": "float32"},
        "optimizer": {"name": "sgd", "warmup_steps": 0, "learning_rate": 0.1},
        "train": {"global_batch": 4, "steps": 10},
    })  # fmt: skip


def _program(axes, devices):
    config = _config(axes)
    return build_program(config, build_mesh(config.mesh.axes, devices))


@pytest.fixture(scope="module")
def one_device():
    """context=1 on one device: three steps from init."""
    program = _program({"data": 1}, jax.devices()[:1])
    return trained(program)


@pytest.fixture(scope="module")
def context_2():
    """{data: 2, fsdp: 2, context: 2}, planned once; the plan's compiled step trains, as in
    ``shardmem train``. Returns the program, its report and step, and three steps from init."""
    program = _program({"data": 2, "fsdp": 2, "context": 2}, jax.devices())
    return planned_and_trained(program)


def test_context_2_with_data_and_fsdp_trains_as_one_device(context_2, one_device):
    program, _, _, losses, state = context_2
    assert program.attention.context == 2
    wq = program.abstract_state["params"]["layers"]["wq"]
    assert wq.sharding.spec[1] == ("fsdp", "context"), "the weights are split over the context devices too"
    assert_same_training(losses, state["params"], one_device)


@pytest.mark.slow
def test_context_4_with_fsdp_trains_as_one_device(one_device):
    program = _program({"fsdp": 2, "context": 4}, jax.devices())
    losses, state = train_steps(program.step, program, program.init(), 3)
    assert_same_training(losses, state["params"], one_device)


@pytest.mark.slow
def test_the_plan_reports_the_key_value_all_gather_over_context(context_2):
    assert "context parallel over 2 devices" in context_2[1].attention
    config = _config({"data": 4, "context": 2}).replace("rules={embed: null}")  # No weight gathers.
    program = build_program(config, build_mesh(config.mesh.axes, jax.devices()))
    report, _ = plan_program(program, make_target(config, "cpu"), count_remat_overhead=False)
    cfg = config.model
    # Per layer, the gathered f32 keys and values of this device's sequence: 2 x [1, seq_len, kv_heads, head].
    gathered = 2 * 1 * cfg.seq_len * cfg.n_kv_heads * cfg.head_size * 4
    # Every layer's in the forward pass, and again where minimal remat recomputes them for the backward
    # pass (XLA 0.10 keeps one of those: 3 in all for 2 layers).
    moved = report.collectives["all-gather"]
    assert moved % gathered == 0 and cfg.n_layers * gathered < moved <= 2 * cfg.n_layers * gathered, moved


@pytest.mark.slow
def test_a_checkpoint_saved_with_context_2_resumes_with_context_1(
    resumes_with_one_device, context_2, one_device
):
    resumes_with_one_device(context_2, one_device[0], train_steps)


# --- Errors --------------------------------------------------------------------------------------


def _build(config):
    return build_program(config, build_mesh(config.mesh.axes, jax.devices()))


def test_a_sequence_that_does_not_split_in_2c_chunks_is_a_config_error():
    message = (r"model.seq_len=60 is not a multiple of 2 x 4 = 8: rules.seq=\['context'\] splits each "
               r"sequence over 4 devices.*multiple of 8 \(e.g. 56 or 64\), or mesh.axes.context among "
               r"\[1, 2\]$")  # fmt: skip
    with pytest.raises(ConfigError, match=message):
        _build(_config({"data": 2, "context": 4}, seq_len=60, attention_chunk=None))


def test_context_parallelism_where_it_cannot_apply_is_a_config_error():
    with pytest.raises(
        ConfigError, match=r"model.n_experts=8: the experts' capacity fills in sequence order"
    ):
        _build(_config({"data": 4, "context": 2}, preset="tiny-moe"))
    with pytest.raises(ConfigError, match=r"mesh.axes.context=2 but rules.seq=None does not use it"):
        _build(_config({"data": 4, "context": 2}).replace("rules={seq: null}"))
    with pytest.raises(ConfigError, match=r"rules.batch=\['data', 'context'\] uses context too"):
        _build(_config({"data": 4, "context": 2}).replace("rules={batch: [data, context]}"))
    with pytest.raises(ConfigError, match=r"a model of your own cannot use it: set mesh.axes.context=1"):
        config = _config({"data": 4, "context": 2})
        build_program(config, build_mesh(config.mesh.axes, jax.devices()),
                      model_factory=lambda rngs: nnx.Linear(4, 4, rngs=rngs))  # fmt: skip
    with pytest.raises(ConfigError, match=r"model.attention=cudnn has no context-parallel form"):
        resolve_attention("cudnn", chunk=None, where="deviceless-gpu", context=8)
    assert resolve_attention("auto", chunk=None, where="deviceless-gpu", context=8) == AttentionKernel(
        "pallas", context=8
    ), "auto plans the flash kernel a GPU runs with context parallelism: Pallas's, not a stand-in"


def test_the_shipped_long_context_config_splits_each_sequence_over_8_gpus():
    config = load_config(ROOT / "configs" / "llama-7b-long.yaml")
    assert config.model.seq_len == 32768 and config.memory.target == "h100-sxm"
    assert config.mesh.axes["context"] == -1 and config.mesh.device_count() == 8


@pytest.mark.slow
def test_the_shipped_long_context_config_plans_deviceless_with_the_pallas_blocks():
    """Two of its layers, compiled for 8 H100s: the Pallas (Triton) kernels of the block formulation
    compile deviceless, and the keys and values of each layer are gathered in bf16."""
    config = load_config(ROOT / "configs" / "llama-7b-long.yaml", ["model.n_layers=2"])
    report = plan(config, count_remat_overhead=False)
    assert report.mesh == {"data": 1, "fsdp": 1, "context": 8} and report.fits
    assert report.attention.startswith("pallas; context parallel over 8 devices")
    cfg = config.model
    gathered = 2 * cfg.seq_len * cfg.n_kv_heads * cfg.head_size * 2  # Keys and values of one sequence.
    micro = config.train.micro_batches
    assert report.collectives["all-gather"] >= micro * cfg.n_layers * 2 * gathered  # Forward and backward.


@pytest.mark.newest
def test_the_split_sequences_flash_blocks_fit_a_192_wide_head_deviceless():
    """Nemotron-4 340B's heads (192, padded to 256) on a split sequence, compiled for 2 H100s: each block's
    kernels are tiled for the H100's shared memory (the default tiles asked 320 KiB of its 227)."""
    from shardmem.models.attention import device_class, shared_memory_per_block
    from shardmem.planning import codegen
    from shardmem.planning.targets import resolve_target

    target = resolve_target("h100-sxm", n_devices=2)
    mesh = build_mesh({"context": 2}, target.devices)
    rules = Rules.from_config({}, mesh.axis_names)
    kernel = resolve_attention("auto", chunk=None, where=device_class(target.devices), context=2,
                               shared_memory=shared_memory_per_block(target.devices))  # fmt: skip
    assert kernel == AttentionKernel("pallas", context=2, shared_memory=232448)
    q = jax.ShapeDtypeStruct((1, 1024, 2, 192), jnp.bfloat16)

    def loss(q, k, v):
        with rules.activate(mesh):
            q, k, v = (constrain(x, ("batch", "seq")) for x in (q, k, v))
            return context.attend(kernel, q, k, v).astype(jnp.float32).sum()

    with jax.default_device(target.devices[0]):  # JAX 0.12's Triton lowering reads the default device.
        lowered = jax.jit(jax.grad(loss, argnums=(0, 1, 2))).lower(q, q, q)
        lowered.compile(compiler_options=codegen.deviceless_options(target, {}))


#: A split sequence's attention step compiled for 2 H100s: grouped-query heads (Llama 3's 4 query heads
#: to a key/value head), 1,024 positions, each device holding 2 zigzag chunks of 256.
BATCH, LENGTH, HEADS, KV_HEADS, HEAD_DIM = 1, 1024, 8, 2, 64


@pytest.fixture(scope="module")
def deviceless_split_attention():
    """(the step's jaxpr, its compiled HLO module, the step-time model's estimate) of the split attention's
    gradient, compiled deviceless for 2 H100s as a plan compiles it."""
    from shardmem.models.attention import device_class, shared_memory_per_block
    from shardmem.planning import codegen, cost, hlo
    from shardmem.planning.targets import resolve_target

    target = resolve_target("h100-sxm", n_devices=2)
    mesh = build_mesh({"context": 2}, target.devices)
    rules = Rules.from_config({}, mesh.axis_names)
    kernel = resolve_attention("auto", chunk=None, where=device_class(target.devices), context=2,
                               shared_memory=shared_memory_per_block(target.devices))  # fmt: skip
    q = jax.ShapeDtypeStruct((BATCH, LENGTH, HEADS, HEAD_DIM), jnp.bfloat16)
    kv = jax.ShapeDtypeStruct((BATCH, LENGTH, KV_HEADS, HEAD_DIM), jnp.bfloat16)

    def loss(q, k, v):
        with rules.activate(mesh):
            q, k, v = (constrain(x, ("batch", "seq")) for x in (q, k, v))
            return context.attend(kernel, q, k, v).astype(jnp.float32).sum()

    step = jax.grad(loss, argnums=(0, 1, 2))
    with jax.default_device(target.devices[0]):
        jaxpr = jax.make_jaxpr(step)(q, kv, kv)
        options = codegen.deviceless_options(target, {})
        compiled = jax.jit(step).lower(q, kv, kv).compile(compiler_options=options)
    module = hlo.parse_module(compiled.as_text())
    estimate = cost.estimate_step_time(module, cost.Hardware.of(target), [0, 0],
                                       attention=hlo.fused_attention_kernels(jaxpr))  # fmt: skip
    return jaxpr, module, estimate, cost.Hardware.of(target)


@pytest.mark.newest
def test_the_step_time_charges_a_split_sequences_causal_blocks_half_their_pairs(deviceless_split_attention):
    """A split sequence's causal diagonal and its unmasked blocks below run Pallas kernels of the same names;
    the step-time model charged all of them as unmasked (1.25x the attention's matmuls at context 2).
    Compiled for 2 H100s, the kernels' FLOPs are those of the positions each device attends."""
    _, _, estimate, _ = deviceless_split_attention
    chunk = LENGTH // 4  # Each device holds 2 of the 4 zigzag chunks.
    pairs = (2 * chunk) ** 2 // 2 + 2 * chunk**2  # Its two chunks, causal; two unmasked blocks below them.
    forward = 2 * 2 * BATCH * HEADS * HEAD_DIM * pairs  # QK and PV.
    assert estimate.kernel_flops == forward + 7 * forward // 2  # The Pallas backward runs 7 matmuls.


@pytest.mark.newest
def test_the_split_sequences_flash_kernels_read_grouped_kv_heads_as_they_are(deviceless_split_attention):
    """Every flash kernel of the split attention reads the model's 2 key/value heads, not a copy repeated to
    the 8 query heads per block (before, each block's keys and values were repeated, forward and backward,
    and the kernels read 8 heads), and the step's memory-bound kernels move 38% less (before: 50.5 MB
    with the repeats, the blocks' stacks, slices and scatter-adds; after: 31.4 MB)."""
    _, module, estimate, hardware = deviceless_split_attention
    kernels = [
        ins
        for computation in module.computations.values()
        for ins in computation
        if ins.opcode == "custom-call" and ("/mha_forward/" in ins.op_name or "/mha_backward/" in ins.op_name)
    ]
    assert len(kernels) >= 4  # The diagonal's and a block's below, forward and backward.
    for ins in kernels:
        q, k, v = (module.by_name[name].shape for name in ins.operands[:3])
        assert f",{HEADS},{HEAD_DIM}]" in q, q
        assert f",{KV_HEADS},{HEAD_DIM}]" in k and f",{KV_HEADS},{HEAD_DIM}]" in v, (k, v)
    memory_bound_bytes = estimate.memory_bound * hardware.memory_bandwidth
    assert memory_bound_bytes < 40e6, memory_bound_bytes


@pytest.mark.slow
def test_sweep_varies_the_context_axis():
    from shardmem.explore.sweep import sweep

    config = _config({"data": 2, "fsdp": -1, "context": 1}).replace(
        "rules={embed: fsdp}", "train.global_batch=8"
    )
    two, three = sweep(config, {"mesh.axes.context": [2, 3]}, target="cpu", jobs=1)
    assert two.error is None and two.fits and "context parallel over 2 devices" in two.attention
    assert two.collectives["all-gather"] > 0  # The keys and values (and FSDP's weights).
    assert three.candidate == "mesh.axes.context=3" and "does not divide" in three.error, three.error
