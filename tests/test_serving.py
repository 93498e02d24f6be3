"""The serving program (shardmem.program.serving, shardmem.models.kv_cache): prefill and decode with a KV
cache give the training forward's logits at every position, sharded as on one device, with an int8 cache
within its stated tolerance and quantized weights; and its plan (shardmem.planning.serving)."""

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx
from jax.sharding import PartitionSpec as P

from shardmem import ConfigError, build_mesh, config_from_dict
from shardmem.cli import main
from shardmem.finetune.quant import Quantized
from shardmem.planning import cost, hlo, memory
from shardmem.planning.report import render_serving
from shardmem.planning.serving import ServingTime, plan_serving, search_capacity, with_memory_fraction
from shardmem.planning.targets import GPU_TARGETS
from shardmem.program import ServingProgram, describe, serving_program
from shardmem.program.program import Function
from shardmem.program.serving import stacked

pytestmark = pytest.mark.newest

# Every feature the cached forward must carry over from the training one, in one tiny model: grouped-query
# attention (4 heads, 2 KV heads), a sliding window shorter than the prompts, Qwen2's qkv biases, Qwen3's
# head norms, Gemma's norm offset, embedding scale, tied head and GeGLU, Gemma 2's four norms a layer, its
# scale of the scores and its caps of the scores and the logits (low enough to bite).
MODEL = {"preset": "tiny", "n_layers": 2, "sliding_window": 6, "qkv_bias": True, "qk_norm": True,
         "norm_offset": 1.0, "scale_embeddings": True, "tie_embeddings": True,
         "mlp_activation": "gelu_tanh", "post_norms": True, "attention_scale": 0.5, "attention_softcap": 1.0,
         "logit_softcap": 2.0}  # fmt: skip
B, P_LEN, T = 8, 8, 16
LENGTHS = np.array([8, 3, 1, 5, 8, 2, 7, 4], np.int32)  # Prompts of every length in one batch.


def _program(axes: dict, **serve) -> ServingProgram:
    serve = {"batch": B, "prompt_len": P_LEN, "max_len": T, **serve}
    config = config_from_dict({"model": MODEL, "mesh": {"axes": axes}, "precision": {"compute": "float32"},
                               "serve": serve})  # fmt: skip
    devices = jax.devices()[: int(np.prod(list(axes.values())))]
    return serving_program(config, build_mesh(config.mesh.axes, devices))


def _weights(program: ServingProgram):
    """The program's weights with noise on every one, so that biases and norm scales are not their zeros."""
    weights = program.init()
    leaves, tree = jax.tree.flatten(jax.device_get(weights))
    rng = np.random.default_rng(1)
    noisy = [w + (0.1 * rng.normal(size=w.shape)).astype(w.dtype) if w.dtype.kind == "f" else w
             for w in leaves]  # fmt: skip
    return jax.device_put(jax.tree.unflatten(tree, noisy), program.weight_shardings)


def _tokens():
    return np.random.default_rng(0).integers(0, 256, (B, T), dtype=np.int32)


def _cached_logits(program: ServingProgram, weights, tokens_BxT, lengths_B=LENGTHS) -> np.ndarray:
    """``[B, T - 1, V]``: at position t, the logits that predict token t + 1, from the prefill (t = the
    prompt's last) and then from decode steps fed the sequence's own tokens; NaN before the prompt's end.
    (Also tests/test_user_serving.py's, for a model of your own.)"""
    length = tokens_BxT.shape[1]
    prompts_BxP = np.where(np.arange(program.serving.prompt_len) < lengths_B[:, None],
                           tokens_BxT[:, : program.serving.prompt_len], 0)  # fmt: skip
    logits_BxV, cache = program.prefill(weights, program.new_cache(), prompts_BxP, lengths_B)
    out = np.full((len(lengths_B), length - 1, logits_BxV.shape[-1]), np.nan, np.float32)
    positions_B = lengths_B.copy()
    rows = np.arange(len(lengths_B))
    out[rows, positions_B - 1] = np.asarray(logits_BxV)
    while positions_B.min() < length - 1:
        step = np.minimum(positions_B, length - 2)  # Rows at the end redo their last position (cache room).
        logits_BxV, cache = program.decode(weights, cache, tokens_BxT[rows, step], step)
        out[rows, step] = np.asarray(logits_BxV)
        positions_B = step + 1
    return out


def _full_logits(program: ServingProgram, weights, tokens_BxT) -> np.ndarray:
    """The training forward's logits ``[B, T - 1, V]`` of the same model and weights."""
    d = program.description
    with d.rules.activate(d.mesh):
        model = nnx.merge(d.model.graphdef, d.finetune.assemble({}, stacked(weights)))
        return np.asarray(jax.jit(lambda t: model(t))(tokens_BxT))[:, :-1]


@pytest.fixture(scope="module")
def sharded():
    """The program on 8 devices (4 data replicas x tensor 2), its noisy weights and teacher-forced logits."""
    program = _program({"data": 4, "tensor": 2})
    weights = _weights(program)
    return program, weights, _cached_logits(program, weights, _tokens())


def test_decode_with_the_cache_gives_the_full_forwards_logits_at_every_position(sharded):
    program, weights, cached = sharded
    full = _full_logits(program, weights, _tokens())
    known = ~np.isnan(cached)
    assert known.sum() == (T - LENGTHS).sum() * 256  # Every position from each prompt's end on.
    assert np.abs(full).max() > 1  # Logits of order 1: near-zero ones would meet any tolerance.
    # float32 throughout: only the order of the sums differs (the cache's attention is over max_len keys).
    np.testing.assert_allclose(cached[known], full[known], atol=2e-5, rtol=2e-5)


# Loading fused or quantized weights donates tensors no output can reuse: that is expected, not said.
@pytest.mark.filterwarnings("error:Some donated buffers were not usable")
def test_a_tensor_by_data_program_on_8_devices_gives_one_devices_logits(sharded):
    program, weights, cached = sharded
    keys = program.serving.cache_shardings.keys
    assert keys.spec == P(None, "data", None, "tensor")  # Batch over the replicas, KV heads over tensor.
    assert program.description.frozen_shardings["layers"]["wk"].spec == P(None, None, "tensor")
    # Stored by layer, the query, key and value weights fused, each device's heads of each contiguous.
    assert program.weight_shardings["layers"][1]["wqkv"].weight.spec == P(None, "tensor", None, None)
    one = _program({"data": 1})
    alone = one.start_from(jax.device_get(stacked(weights)))  # Laid out anew: one shard per fused matrix.
    single = _cached_logits(one, alone, _tokens())
    np.testing.assert_allclose(single, cached, atol=2e-5, rtol=2e-5)


def test_more_tensor_devices_than_kv_heads_hold_each_kv_head_on_several_as_the_error_says(sharded):
    program, weights, cached = sharded
    with pytest.raises(ConfigError) as refused:  # 4 devices, 2 KV heads.
        _program({"data": 1, "tensor": 4})
    advice = ("to hold each KV head on 2 devices, split the axis: mesh.axes.tensor=2 and "
              "mesh.axes.tensor_rep=2, with rules heads, mlp and vocab on [tensor, tensor_rep] (kv_heads "
              "stays on [tensor])")  # fmt: skip
    assert advice in str(refused.value)
    split = ["tensor", "tensor_rep"]
    config = config_from_dict({"model": MODEL, "mesh": {"axes": {"data": 2, "tensor": 2, "tensor_rep": 2}},
                               "rules": {"heads": split, "mlp": split, "vocab": split},
                               "precision": {"compute": "float32"},
                               "serve": {"batch": B, "prompt_len": P_LEN, "max_len": T}})  # fmt: skip
    followed = serving_program(config, build_mesh(config.mesh.axes, jax.devices()))
    assert followed.serving.cache_shardings.keys.spec == P(None, "data", None, "tensor")  # A head each.
    assert followed.description.frozen_shardings["layers"]["wq"].spec == P(None, None, tuple(split))
    laid_out = followed.start_from(jax.device_get(stacked(weights)))
    np.testing.assert_allclose(_cached_logits(followed, laid_out, _tokens()), cached, atol=2e-5, rtol=2e-5)


def test_one_sequence_decodes_to_the_full_forwards_logits(sharded):
    # A batch of one writes its cache in place with an update, not a scatter (kv_cache.KVCache.write).
    program, weights, _ = sharded
    one = _program({"data": 1}, batch=1)
    alone = one.start_from(jax.device_get(stacked(weights)))  # Laid out anew: one shard per fused matrix.
    tokens_1xT, lengths_1 = _tokens()[3:4], LENGTHS[3:4]
    cached = _cached_logits(one, alone, tokens_1xT, lengths_1)
    known = ~np.isnan(cached)
    assert known.sum() == (T - lengths_1[0]) * 256
    full = _full_logits(one, alone, tokens_1xT)
    np.testing.assert_allclose(cached[known], full[known], atol=2e-5, rtol=2e-5)


def test_an_int8_kv_cache_stays_within_its_tolerance_of_float32(sharded):
    program, weights, cached = sharded
    int8 = _program({"data": 4, "tensor": 2}, kv_dtype="int8")
    # Both layers slide over 6 positions: their keys are in the ring, codes and a scale per token and KV head.
    cache = int8.serving.cache
    assert cache.keys.shape[0] == 0 and cache.ring.keys.dtype == jnp.int8
    assert cache.ring.key_scales.shape == (2, B, 6, 2)
    quantized = _cached_logits(int8, weights, _tokens())
    known = ~np.isnan(cached)
    error = np.abs(quantized[known] - cached[known])
    # Codes of 127 levels a side per head vector: logits within 3% of their largest magnitude (measured:
    # 1.4% over these 8 sequences, a bfloat16 cache 0.4%). Prefill attends before quantizing: exact.
    assert error.max() <= 0.03 * np.abs(cached[known]).max()
    assert error.max() > 0  # Decoding did read the int8 codes.
    prefill = np.arange(T - 1)[None, :] == LENGTHS[:, None] - 1
    np.testing.assert_allclose(quantized[prefill], cached[prefill], atol=2e-5, rtol=2e-5)
    # One sequence writes its codes and scales with an update in place (no scatter): the same logits.
    one = _program({"data": 1}, batch=1, kv_dtype="int8")
    alone = one.start_from(jax.device_get(stacked(weights)))
    single = _cached_logits(one, alone, _tokens()[3:4], LENGTHS[3:4])
    np.testing.assert_allclose(single, quantized[3:4], atol=2e-5, rtol=2e-5)


def test_quantized_weights_serve_the_model_they_quantize():
    program = _program({"data": 2, "tensor": 2}, quantize={"format": "nf4", "targets": ["layers/*"]})
    weights = program.init()
    assert set(weights["layers"][0]["wq"]) == {"codes", "scales"}
    assert weights["layers"][0]["wq"]["codes"].dtype == np.uint8
    assert weights["embedding"].dtype == np.float32  # Not a layer weight: as it was.
    d = program.description
    assert isinstance(d.finetune.assemble({}, stacked(weights))["layers"]["w_up"], Quantized)
    cached = _cached_logits(program, weights, _tokens())
    full = _full_logits(program, weights, _tokens())
    known = ~np.isnan(cached)
    np.testing.assert_allclose(cached[known], full[known], atol=2e-5, rtol=2e-5)


def test_a_prefill_holds_one_layers_activations_at_a_time_and_recomputes_nothing():
    # Deviceless for an A100, whose scheduler had kept every layer's outputs (Llama 2 7B: its rotated
    # keys) until the last layer, and whose rematerialization, counting the donated cache twice,
    # recomputed q/k/v matmuls at large batches.
    def prefill(layers: int):
        config = config_from_dict({**GPU_SERVE, "model": {"preset": "tiny", "n_layers": layers},
                                   "mesh": {"axes": {"data": 1, "tensor": 1}},
                                   "serve": {"batch": 8, "prompt_len": 128, "max_len": 256}})  # fmt: skip
        return plan_serving(config).prefill

    two, four = prefill(2), prefill(4)
    one_layers_keys = 8 * 128 * 2 * 16 * 2  # batch x prompt x KV heads x head dim x bf16
    assert four.per_device["temp"] - two.per_device["temp"] < one_layers_keys  # Not one more per layer.
    assert not [name for name in four.module.by_name if ".remat" in name]
    assert four.compiler_options["xla_disable_hlo_passes"] == "rematerialization"


def test_a_serving_plan_on_trainings_fsdp_layout_warns_that_each_decode_step_gathers_the_weights():
    config = config_from_dict({"model": {"preset": "tiny"}, "mesh": {"axes": {"data": 1, "fsdp": 4}},
                               "serve": {"batch": 4, "prompt_len": 8, "max_len": 16},
                               "memory": {"target": "cpu"}})  # fmt: skip
    plan = plan_serving(config)
    (warning,) = plan.warnings
    assert "each decode step all-gathers" in warning and "mesh.axes.fsdp=4 splits them" in warning
    assert (
        plan.decode.collectives["all-gather"] >= plan.per_device["weights"] * 4 * 0.9
    )  # Nearly all of them.
    assert plan.to_json()["warnings"] == [warning]


def test_the_serving_plan_lists_the_kv_cache_and_decodes_it_in_place():
    config = config_from_dict({"model": {"preset": "tiny"}, "mesh": {"axes": {"data": 2, "tensor": 2}},
                               "serve": {"batch": 4, "prompt_len": 32, "max_len": 128, "kv_dtype": "int8"},
                               "memory": {"target": "cpu"}})  # fmt: skip
    plan = plan_serving(config)
    # 4 layers x 4 sequences x 128 positions x 2 KV heads x 16, over 2 replicas x 2 tensor shards: int8
    # codes of keys and values, and a float32 scale per token and KV head of each.
    codes, scales = 4 * 4 * 128 * 2 * 16 // 4, 4 * 4 * 128 * 2 * 4 // 4
    assert plan.decode.per_device["kv_cache"] == 2 * (codes + scales) == plan.per_device["kv_cache"]
    assert plan.decode.per_device["alias"] == plan.per_device["kv_cache"]  # Donated: updated in place.
    assert plan.prefill.per_device["alias"] == plan.per_device["kv_cache"]  # Prefill fills it in place.
    weights = plan.per_device["weights"]
    assert weights == plan.prefill.per_device["params"] > 0
    assert plan.per_device["peak"] == max(plan.prefill.per_device["peak"], plan.decode.per_device["peak"])
    assert plan.fits and plan.verdict == "fits" and plan.decode.cross_check["matches"] and not plan.warnings
    assert plan.prefill.step_time.tokens_per_second > 0 and plan.decode.flops_per_step > 0
    data = plan.to_json()
    assert data["serve"]["kv_dtype"] == "int8"
    assert data["decode"]["per_device"]["kv_cache"] == 2 * (codes + scales)
    from rich.console import Console

    console = Console(width=140, record=True)
    console.print(render_serving(plan))
    text = console.export_text()
    assert "KV cache" in text and "decode peak" in text and "shardmem plan  tiny: prefill" not in text


@pytest.mark.parametrize("change, message", [
    ({"serve": {"kv_dtype": "int4"}}, "serve.kv_dtype='int4' (did you mean 'int8'?); use bfloat16, float16"),
    ({"serve": {"prompt_len": 64, "max_len": 32}}, "serve.prompt_len=64 is longer than serve.max_len=32"),
    ({"serve": {"batch": 3}}, "serve.batch=3 does not split over the 2 devices the batch is sharded over"),
    ({"mesh": {"axes": {"stage": 2}}}, "mesh.axes.stage=2: serving runs every layer on every device"),
    ({"mesh": {"axes": {"context": 2}}}, "rules.seq splits each sequence over 2 devices"),
    ({"serve": {"quantize": {"format": "nf4", "targets": ["layers/wz"]}}},
     "serve.quantize.targets: 'layers/wz' matches no parameter of those"),
])  # fmt: skip
def test_a_serve_section_serving_cannot_run_is_one_line_naming_the_key(change, message):
    raw = {"model": {"preset": "tiny"}, "mesh": {"axes": {"data": 2}}, "serve": {"batch": 4}}
    for section, values in change.items():
        raw[section] = {**raw.get(section, {}), **values}
    with pytest.raises(ConfigError) as error:
        config = config_from_dict(raw)
        devices = jax.devices()[: config.mesh.device_count()]
        serving_program(config, build_mesh(config.mesh.axes, devices))
    assert message in str(error.value) and "\n" not in str(error.value)


def test_a_model_of_your_own_without_a_cached_call_is_refused_and_a_variant_stays_a_serving_program():
    config = config_from_dict({"model": {"preset": "tiny"}, "mesh": {"axes": {"data": 1}}})
    mesh = build_mesh(config.mesh.axes, jax.devices()[:1])
    # Serving a model of your own: tests/test_user_serving.py.
    with pytest.raises(
        ConfigError,
        match="the model passed as model_factory: serving needs the model's "
        "cache-aware call, and Linear has no cached_call or cache_layout",
    ):
        serving_program(config, mesh, model_factory=lambda rngs: nnx.Linear(2, 2, rngs=rngs))
    program = serving_program(config, mesh)
    variant = program.variant("serve.max_len=4096")
    assert isinstance(variant, ServingProgram) and variant.serving.max_len == 4096
    assert [f.name for f in variant.functions] == ["prefill", "decode"]


# A serving plan for a GPU that is not here: the tiny model at tensor 2 x 2 replicas on A100s, with a
# budget of a few MiB (--memory-fraction) so that the KV cache's room is a few dozen sequences.
GPU_SERVE = {"model": {"preset": "tiny"}, "mesh": {"axes": {"data": 2, "tensor": 2}},
             "precision": {"params": "bfloat16", "compute": "bfloat16"},
             "serve": {"batch": 4, "prompt_len": 32, "max_len": 128},
             "memory": {"target": "a100-80g"}}  # fmt: skip
FRACTION = 4e-5  # Of an A100's 85.1 GB: 3.4 MB per device.


@pytest.fixture(scope="module")
def gpu_plan():
    return plan_serving(with_memory_fraction(config_from_dict(GPU_SERVE), FRACTION))


def test_a_static_batchs_time_never_beats_its_hbm_bound(gpu_plan):
    time, figures = gpu_plan.time, gpu_plan.per_device
    assert time.time_to_first_token == gpu_plan.prefill.step_time.seconds
    assert time.decode_at_max_len == gpu_plan.decode.step_time.seconds
    bandwidth = GPU_TARGETS["a100-80g"].memory_bandwidth
    per_position = figures["kv_cache"] // 128  # Two sequences per device, 4 layers, 2 KV heads of 16, bf16.
    assert per_position == 2 * 4 * 2 * 2 * 16 * 2 // 2
    for context in time.contexts:  # 33 and 128 live positions.
        bound = (figures["weights"] + context * per_position) / bandwidth
        assert time.bound_seconds(context) == pytest.approx(bound)
        assert time.decode_seconds(context) >= bound
    # A step one position longer reads one more position of the cache, at the rate kernels stream HBM.
    step = time.decode_seconds(100) - time.decode_seconds(99)
    assert step == pytest.approx(per_position / (bandwidth * cost.MEMORY_EFFICIENCY))
    assert time.output_len == 97  # The prefill's token, then one per decode step until 128 positions.
    total = time.time_to_first_token + 96 * (time.decode_seconds(33) + time.decode_seconds(128)) / 2
    assert time.output_tokens_per_second == pytest.approx(4 * 97 / total)
    # The dot merger is off: it would copy the query, key and value weights at every decode step.
    assert gpu_plan.decode.compiler_options["xla_gpu_dot_merger_threshold_mb"] == 0


def test_a_sliding_windows_steps_read_no_more_than_the_window():
    # The compiled step (every max_len position live) reads the window's 48 positions of each sequence;
    # a step at a shorter context fewer, none past the window.
    time = ServingTime(time_to_first_token=1e-3, decode_at_max_len=2e-3, streamed=10**10,
                       weight_bytes=10**9, kv_bytes_per_position=10**4, memory_bandwidth=10**12, batch=1,
                       prompt_len=32, max_len=128, window=48)  # fmt: skip
    assert time.decode_seconds(100) == time.decode_seconds(48) == 2e-3
    assert time.decode_seconds(40) == pytest.approx(2e-3 - 8e-6)
    assert time.bound_seconds(100) == time.bound_seconds(48) == pytest.approx((10**9 + 48 * 10**4) / 10**12)
    # The steps stop slowing at the window: their mean is every step's, not the first's and last's (a
    # ring's window, and one of each, bend it twice).
    windowed = (
        time,
        dataclasses.replace(time, window=None, ring_window=48, ring_bytes_per_position=10**4),
        dataclasses.replace(time, window=100, ring_window=48, ring_bytes_per_position=10**3),
    )
    for each in windowed:
        steps = [each.decode_seconds(c) for c in range(each.contexts[0], each.contexts[1] + 1)]
        assert each.mean_decode_seconds == pytest.approx(np.mean(steps), rel=1e-12)
        assert each.mean_decode_seconds != pytest.approx(np.mean(steps[:: len(steps) - 1]), rel=1e-6)


def test_the_decode_steps_cache_write_is_costed_in_place(gpu_plan):
    module = gpu_plan.decode.module
    kernels = cost._Kernels(module, cost.Hardware.of(_a100(4)), {})
    writes = [ins for ins in module.computations[module.entry] if ins.opcode == "fusion" and any(
        inner.opcode == "scatter" for inner in module.computations.get(ins.called[0], ()))]  # fmt: skip
    assert writes  # A batch of 4 writes each sequence's token at its own position: a scatter.
    cache_bytes = 4 * 4 * 128 * 2 * 16 * 2  # One of the stacked keys or values, whole.
    assert all(kernels.bytes(ins) < cache_bytes // 16 for ins in writes)  # Its tokens, not the cache.


def test_tensor_parallel_decode_runs_the_kernel_on_each_devices_sequences_and_kv_heads(gpu_plan):
    module = gpu_plan.decode.module
    calls = [ins for ins in module.computations[module.entry]
             if ins.opcode == "custom-call" and "/decode_attention/" in ins.op_name]  # fmt: skip
    assert len(calls) == 4  # One a layer, on each device's share of the stacked cache:
    local = "bf16[4,2,128,1,16]"  # 2 of the 4 sequences, 1 of the 2 KV heads.
    assert all(module.by_name[o].shape.startswith(local) for call in calls for o in call.operands[1:3])


def test_every_layer_runs_the_first_layers_kernels(monkeypatch):
    # The layers are unrolled; their weights, stored by layer, and their index in the cache are arguments
    # of their kernels, not constants in them, so a deeper model compiles to no more matmuls.
    traces = []
    trace = Function.trace
    monkeypatch.setattr(Function, "trace", lambda self: traces.append(self.name) or trace(self))
    monkeypatch.setattr(memory, "SLOW_COMPILE_SECONDS", 0.0)  # Every compile is slow: no advice to scan.
    # Six layers against four: the first and the last layer's kernels may differ from the middle ones'
    # (with the query, key and value weights fused, a middle layer's attention scores are a kernel of
    # their own), the middle ones' must not.
    six, four = (plan_serving(with_memory_fraction(config_from_dict(
        {**GPU_SERVE, "model": {"preset": "tiny", "n_layers": layers, "d_model": 512}}), FRACTION))
        for layers in (6, 4))  # fmt: skip
    # Traced once each: without a backward pass nothing is recomputed, so no variant without remat is
    # traced for the FLOPs an MFU counts.
    assert traces == ["prefill", "decode"] * 2
    assert six.decode.flops_no_remat == six.decode.flops_per_step > 0
    assert not [w for w in six.prefill.warnings + six.decode.warnings if "scan them" in w]
    for deep, half in ((six.prefill, four.prefill), (six.decode, four.decode)):
        per_layer = (deep.step_time.kernels - half.step_time.kernels) / 2  # Launched: every layer's.
        assert per_layer > 10
        # Compiled: as many matmuls, cache writes and cache reads as four layers have. The norms' kernels
        # differ, each fused with the residual stream's sum so far (one term longer each layer).
        deep_kernels, half_kernels = deep.module.kernels(), half.module.kernels()
        assert len(deep_kernels) - len(half_kernels) < per_layer / 2
        assert _with("dot", deep_kernels) == _with("dot", half_kernels) > 0
        for op in ("scatter", "dynamic-update-slice", "dynamic-slice"):
            assert _with(op, deep_kernels) == _with(op, half_kernels)


def _one_sequence(kv_dtype: str | None = None, **model) -> tuple:
    """The decode step of one sequence, the tiny model on one A100: its plan, and its fused attention
    kernels as the step-time model reads them from its jaxpr."""
    config = config_from_dict({**GPU_SERVE, "mesh": {"axes": {"data": 1}},
                               "model": {"preset": "tiny", **model},
                               "serve": {"batch": 1, "prompt_len": 32, "max_len": 128,
                                         "kv_dtype": kv_dtype}})  # fmt: skip
    target = memory.make_target(config, None)
    program = serving_program(config, build_mesh(config.mesh.axes, target.devices))
    return plan_serving(config), hlo.fused_attention_kernels(program.function("decode").trace().jaxpr)


@pytest.fixture(scope="module")
def one_sequence_plan():
    return _one_sequence()


@pytest.fixture(scope="module")
def one_sequence_decode(one_sequence_plan):
    """The optimized HLO of a decode step of one sequence, the tiny model on one A100."""
    return one_sequence_plan[0].decode.module


def test_a_decode_step_reads_each_weight_matrix_with_one_kernel_the_fused_ones_too(one_sequence_decode):
    # Query, key and value weights fused into one matrix, gate and up into another (models/fused.py):
    # four matrices a layer, each read by one kernel (its matmul), where seven were.
    module = one_sequence_decode
    entry = module.computations[module.entry]
    matrices = {ins.name for ins in entry if ins.opcode == "parameter" and "layers" in ins.name
                and ins.shape.count(",") >= 1}  # fmt: skip
    assert len(matrices) == 4 * 4

    def source(name: str) -> str:  # Through the bitcasts that only reshape a parameter.
        ins = module.by_name.get(name)
        return source(ins.operands[0]) if ins is not None and ins.opcode == "bitcast" else name

    readers = [ins.name for ins in entry if ins.opcode == "fusion" for o in ins.operands
               if source(o) in matrices]  # fmt: skip
    assert len(readers) == len(set(readers)) == len(matrices)


def test_a_decode_step_computes_the_rotary_tables_once_for_every_layer(one_sequence_decode):
    # Computed in each layer's rotation kernels, they kept the query's rotation a kernel of its own.
    module = one_sequence_decode
    entry = module.computations[module.entry]
    trigonometric = [ins for ins in entry if ins.opcode == "fusion" and any(inner.opcode in ("sine", "cosine")
                     for c in ins.called for inner in module.computations[c])]  # fmt: skip
    assert len(trigonometric) <= 2  # The sines and the cosines, for all 4 layers.


def test_a_batch_of_one_writes_its_cache_in_the_kernels_that_compute_it(one_sequence_decode):
    # A scatter of one index would be rewritten by XLA to an update behind a bounds check: a kernel for
    # the check and one per cache array that reads the cache to keep its old entry, every layer.
    module = one_sequence_decode
    cache = "bf16[4,1,128,2,16]"  # The keys or the values of the 4 layers.
    kernels = [ins for ins in module.computations[module.entry] if ins.opcode == "fusion"]
    writes = [ins for ins in kernels if ins.shape.startswith(cache)]
    touching = [ins for ins in kernels if any(module.by_name[o].shape.startswith(cache)
                                              for o in ins.operands if o in module.by_name)]  # fmt: skip
    assert len(writes) == 2 * 4  # Keys and values of each layer updated in place,
    assert not [ins for ins in kernels if "pred[" in ins.shape]  # with no bounds check,
    assert touching == writes  # and read by no other fusion: attention is the decode kernel (below).


def test_a_decode_step_attends_over_the_cache_with_one_kernel_a_layer_copying_none(one_sequence_decode):
    # A serving engine's decode attention is one kernel (and a small merge of its parts); XLA's were five
    # (scores, max, exp-sum, normalise, PV). It reads the stacked cache as the layer's writes left it:
    # given the layer's slice, XLA would copy it out of the stack first.
    module = one_sequence_decode
    entry = module.computations[module.entry]
    cache = "bf16[4,1,128,2,16]"
    calls = [ins for ins in entry if ins.opcode == "custom-call" and "/decode_attention/" in ins.op_name]
    assert len(calls) == 4
    assert not [ins for ins in entry if ins.opcode == "custom-call" and ins not in calls]
    for call in calls:
        keys, values = (module.by_name[o] for o in call.operands[1:3])
        assert keys.shape.startswith(cache) and values.shape.startswith(cache)
        assert keys.opcode == values.opcode == "fusion"  # The layer's in-place writes, not a copy.
    assert not [ins for ins in entry if "[1,128,2,16]" in ins.shape]  # No layer's slice of the cache.
    merges = [ins for ins in entry if any(module.by_name.get(o) in calls for o in ins.operands)
              or any(module.by_name.get(module.by_name[o].operands[0]) in calls for o in ins.operands
                     if module.by_name[o].opcode == "get-tuple-element")]  # fmt: skip
    kernels = [ins for ins in merges if ins.opcode == "fusion"]
    assert len(kernels) == 4  # One fusion a layer merges the parts.


@pytest.mark.parametrize("window, kv_dtype", [(None, None), (48, None), (None, "int8")])
def test_the_decode_kernel_is_costed_by_the_layers_keys_and_values_it_reads(one_sequence_plan, window,
                                                                            kv_dtype):  # fmt: skip
    plan, attention = one_sequence_plan if window is None and kv_dtype is None else _one_sequence(
        kv_dtype, sliding_window=window)  # fmt: skip
    module = plan.decode.module
    # A window shorter than the cache: the layers' keys are in the ring of its positions, read whole.
    assert attention["decode_attention"] == hlo.FusedKernel(2, False, decode=True, window=None)
    kernels = cost._Kernels(module, cost.Hardware.of(_a100(1)), attention)
    calls = [ins for ins in module.computations[module.entry] if ins.opcode == "custom-call"]
    assert len(calls) == 4  # One a layer, an int8 cache's too: its codes are not dequantized by XLA.
    # One sequence's keys and values (an int8 cache's codes and scales too) are written by an update in
    # place, not by a scatter behind a bounds check (its kernels compute a pred).
    assert not [ins for ins in module.computations[module.entry] if ins.shape.startswith("pred")]
    read = 128 if window is None else window  # Positions of the layer's cache (or ring): all live.
    # Its keys and values (2 KV heads of 16; bf16, or int8 codes and an f32 scale a position and KV
    # head), not the stack of 4.
    layer = 2 * read * 2 * 16 * 2 if kv_dtype is None else 2 * read * 2 * (16 + 4)
    query = 4 * 16 * 2  # 4 heads of 16.
    parts = 2  # Two blocks of 64 positions: two parts, for 2 KV heads on 108 SMs.
    partials = parts * (4 * 16 + 4 + 4) * 4  # Each part's f32 output, running max and sum.
    for call in calls:
        assert kernels.bytes(call) == layer + query + 4 + 4 + partials  # And the layer index, the position.
        flops, _, fused = kernels.flops(call)
        assert fused and flops == 2 * 2 * 4 * 16 * read  # QK and PV, 4 heads, every position read.


def _with(opcode: str, kernels: set) -> int:
    return sum(f"'{opcode}'" in str(kernel) for kernel in kernels)


def _a100(n: int):
    from shardmem.planning.targets import resolve_target

    return resolve_target("a100-80g", n_devices=n)


def test_the_kv_caches_room_is_the_budget_less_the_peaks_other_bytes(gpu_plan):
    figures, room = gpu_plan.per_device, gpu_plan.capacity
    assert gpu_plan.decode.budget_bytes == int(GPU_TARGETS["a100-80g"].memory_bytes * FRACTION)
    assert room.cache_bytes == gpu_plan.decode.budget_bytes - (figures["peak"] - figures["kv_cache"])
    assert room.bytes_per_token == 4 * 2 * 2 * 16 * 2 // 2  # Layers x (keys, values) x KV heads / tensor.
    tokens = room.cache_bytes // room.bytes_per_token  # Per device: its two sequences' share.
    assert room.max_batch == tokens // 128 * 2 and room.max_len == tokens // 2 and not room.verified
    assert gpu_plan.to_json()["kv_capacity"]["tokens"] == tokens


def test_the_deviceless_margin_is_taken_on_each_functions_temporaries_alone(gpu_plan):
    """A serving peak is mostly the weights and the KV cache, arguments whose bytes are exact: the
    deviceless margin (what a GPU's own compile may decide otherwise) is taken on each function's
    temporaries, budget = usable - 0.16 x temporaries. Divided over the whole budget, as a training
    plan's is, it took 16% of what the device has from the cache's room (Llama 2 7B at 384 x 128 on an
    A100 was called tight at 65.7 of a usable 70.3 GiB)."""
    from rich.console import Console

    from shardmem.planning.report import render_serving
    from shardmem.units import format_bytes

    memory = {"target": "a100-80g", "usable_fraction": FRACTION, "reserve": 0}
    plan = plan_serving(config_from_dict({**GPU_SERVE, "memory": memory}))
    usable = int(GPU_TARGETS["a100-80g"].memory_bytes * FRACTION)
    for report in (plan.prefill, plan.decode):
        temp, peak = report.per_device["temp"], report.per_device["peak"]
        assert report.margin_on_temporaries and report.usable_bytes == usable
        assert report.budget_bytes == usable - int(0.16 * temp)
        assert report.fits == (peak <= report.budget_bytes)
    assert plan.per_device == gpu_plan.per_device  # The same compile as without the margin (same fraction).
    rooms = [r.budget_bytes - r.per_device["peak"] for r in (plan.prefill, plan.decode)]
    assert plan.margin_bytes == min(rooms) and plan.budget_bytes == plan.binding.budget_bytes
    kv = plan.per_device["kv_cache"]
    assert plan.capacity.cache_bytes == min(rooms) + kv
    assert plan.capacity.cache_bytes > int(usable / 1.16) - (plan.per_device["peak"] - kv)  # The old room.
    console = Console(width=300, record=True)
    console.print(render_serving(plan))
    text = console.export_text()
    function = plan.binding.name.rsplit(": ", 1)[-1]
    assert f"(usable {format_bytes(usable)}, less 0.16 x the {function}'s temporaries)" in text
    assert "temporaries: the deviceless margin): " in text and "/ 1.16" not in text


def test_prompts_the_gpus_flash_kernel_cannot_tile_name_serve_prompt_len():
    config = config_from_dict({**GPU_SERVE, "serve": {"batch": 4, "prompt_len": 200, "max_len": 256}})
    with pytest.raises(ConfigError, match=r"^serve\.prompt_len=200: the pallas .* use a prompt_len that is a "
                                          r"multiple of 128 \(e\.g\. 128 or 256\)"):  # fmt: skip
        plan_serving(config)


def test_the_capacity_search_finds_the_largest_batch_and_context_that_fit(capsys):
    config = with_memory_fraction(config_from_dict(GPU_SERVE), FRACTION)
    room = search_capacity(config).capacity
    assert room.verified and room.max_batch % 2 == 0 and room.max_batch > 4 and room.max_len > 128
    # One plan's bytes per token hold the temporaries as planned: more sequences' prefill needs more (70
    # sequences, where the cache alone has room for 186), a longer cache about itself (near the budget
    # the cache leaves XLA little memory, and it holds the temporaries lower than planned: 5,987 positions
    # where the one plan said 5,963).
    closed = plan_serving(config).capacity
    assert room.max_batch <= closed.max_batch
    assert 0.8 * closed.max_len <= room.max_len <= 1.05 * closed.max_len
    over = config_from_dict({**GPU_SERVE, "serve": {**GPU_SERVE["serve"], "batch": room.max_batch + 2}})
    assert not plan_serving(with_memory_fraction(over, FRACTION)).fits  # One more pair of sequences: over.
    longer = config_from_dict({**GPU_SERVE, "serve": {**GPU_SERVE["serve"], "max_len": room.max_len + 1}})
    assert not plan_serving(with_memory_fraction(longer, FRACTION)).fits  # One more position: over.


@pytest.mark.parametrize("window", [6, 10, 16])
def test_a_window_on_some_layers_only_decodes_to_the_full_forwards_logits(window):
    # Gemma 2's way: the window on the second layer only, and Gemma 3's, that layer's own RoPE base, which
    # it picks by its index in the stack. Shorter than the cache, the window's positions are all the layer
    # keeps (the cache's ring): each prompt's last 6 of up to 8 (by its length), or the prompts as they are
    # (10); as long as the cache (16), the layer's keys are in the stack with the others'.
    serve = {"batch": B, "prompt_len": P_LEN, "max_len": T}
    model = {**MODEL, "sliding_window": window, "sliding_layers": [1], "local_rope_theta": 100.0}
    config = config_from_dict({"model": model, "mesh": {"axes": {"data": 2}},
                               "precision": {"compute": "float32"}, "serve": serve})  # fmt: skip
    program = serving_program(config, build_mesh(config.mesh.axes, jax.devices()[:2]))
    cache = program.serving.cache
    if window < T:
        assert cache.keys.shape == (1, B, T, 2, 16) and cache.ring.keys.shape == (1, B, window, 2, 16)
    else:
        assert cache.keys.shape == (2, B, T, 2, 16) and cache.ring is None
    weights = _weights(program)
    cached, full = _cached_logits(program, weights, _tokens()), _full_logits(program, weights, _tokens())
    known = ~np.isnan(cached)
    np.testing.assert_allclose(cached[known], full[known], atol=2e-5, rtol=2e-5)
    every = dataclasses.replace(program.description.config.model, sliding_layers=None)
    assert every.layer_window == window and program.description.config.model.layer_window is None


def test_plan_serve_prints_json_with_times_and_room_and_draws_the_peak_functions_timeline(tmp_path, capsys):
    import json

    import yaml

    path, html = tmp_path / "serve.yaml", tmp_path / "serve.html"
    path.write_text(yaml.safe_dump(GPU_SERVE))
    assert main(["plan", str(path), "--serve", "--json", "--memory-fraction", str(FRACTION), "--html",
                 str(html)]) == 0  # fmt: skip
    out, err = capsys.readouterr()
    data = json.loads(out)
    assert data["budget_bytes"] == int(GPU_TARGETS["a100-80g"].memory_bytes * FRACTION)
    assert data["time"]["decode_seconds"]["last"] >= data["time"]["decode_bound_seconds"]["last"] > 0
    assert data["kv_capacity"]["max_batch"] > 4 and not data["kv_capacity"]["verified"]
    assert data["decode"]["compiler_options"]["xla_gpu_dot_merger_threshold_mb"] == 0
    assert "the memory timeline of the prefill (the serving peak)" in err and "peak" in html.read_text()


def test_plan_serve_that_does_not_fit_advises_the_serve_keys_not_trainings(tmp_path, capsys):
    import yaml

    path = tmp_path / "serve.yaml"
    path.write_text(yaml.safe_dump(GPU_SERVE))
    assert main(["plan", str(path), "--serve", "--memory-fraction", str(FRACTION / 50)]) == 3
    out = capsys.readouterr().out
    assert "DOES NOT FIT" in out and out.count("next: lower serve.batch or serve.max_len") == 1, out
    assert f"(device 79.26 GiB x {FRACTION / 50:g}): DOES NOT FIT" in " ".join(out.split())  # The flag's.
    assert "train.micro_batches" not in out and "remat.policy=full" not in out


def test_plan_serve_says_a_warning_of_the_program_once_not_for_the_prefill_and_the_decode(tmp_path, capsys):
    from pathlib import Path

    tiny = str(Path(__file__).parent.parent / "configs" / "tiny.yaml")
    missing = str(tmp_path / "not-downloaded")
    sets = [f"finetune.init_from={missing}", "serve.prompt_len=8", "serve.max_len=32"]
    assert main(["plan", tiny, "--serve", *[arg for value in sets for arg in ("--set", value)]]) == 0
    out = " ".join(capsys.readouterr().out.split())
    warning = f"warning: finetune.init_from={missing!r} is not there yet, so the plan could not check it"
    assert out.count(warning) == 1, out
    assert out.index(warning) < out.index("shardmem plan tiny: prefill")  # With serving's, above the two.


@pytest.mark.parametrize("args, message", [
    (["--serve", "--memory-fraction", "1.5"], "--memory-fraction=1.5: give the share of device memory"),
    (["--memory-fraction", "0.9"], "--memory-fraction sizes the serving plan's KV cache: add --serve"),
    (["--capacity"], "--capacity sizes the serving plan's KV cache: add --serve"),
])  # fmt: skip
def test_plan_serve_usage_errors_exit_2_with_one_line(args, message, capsys):
    from pathlib import Path

    tiny = str(Path(__file__).parent.parent / "configs" / "tiny.yaml")
    assert main(["plan", tiny, *args]) == 2
    err = capsys.readouterr().err
    assert message in err and len(err.strip().splitlines()) == 1


def test_tune_serve_ranks_the_layouts_that_fit_by_the_batchs_time(tmp_path, capsys):
    import json

    import yaml

    path = tmp_path / "serve.yaml"
    # A training config's mesh and rules, as the shipped configs have them: the layouts keep fsdp at 1.
    rules = {"batch": ["data", "fsdp"], "embed": "fsdp", "heads": "tensor", "kv_heads": "tensor",
             "mlp": "tensor", "vocab": "tensor"}  # fmt: skip
    mesh = {"axes": {"data": 1, "fsdp": 2, "tensor": 2}}
    path.write_text(yaml.safe_dump({**GPU_SERVE, "mesh": mesh, "rules": rules,
                                    "serve": {**GPU_SERVE["serve"], "batch": 2}}))  # fmt: skip
    assert main(["tune", str(path), "--search", "serve", "--json"]) == 0
    result = json.loads(capsys.readouterr().out)
    # 4 devices, 2 KV heads: tensor 1, 2, or 4 with each KV head on two devices. Tensor 1 leaves 4 data
    # replicas for 2 sequences: skipped.
    skipped = [t for t in result["trials"] if t["how"] == "skipped"]
    assert [t["candidate"] for t in skipped] == ["tensor 1 x data 4, KV bfloat16",
                                                 "tensor 1 x data 4, KV int8"]  # fmt: skip
    ranked = result["ranked"]
    assert [r["total_seconds"] for r in ranked] == sorted(r["total_seconds"] for r in ranked)
    assert {r["layout"] for r in ranked} == {f"{layout}, KV {kv}" for kv in ("bfloat16", "int8")
                                             for layout in ("tensor 2 x data 2",
                                                            "tensor 2 x tensor_rep 2 x data 1")}  # fmt: skip
    assert result["compiles"] == 8 and all(r["fits"] and r["batch"] == 2 for r in ranked)  # Latency: as set.
    mesh = {
        "tensor 2 x data 2": "mesh.axes={data: 2, fsdp: 1, tensor: 2}",
        "tensor 2 x tensor_rep 2 x data 1": "mesh.axes={data: 1, fsdp: 1, tensor: 2, tensor_rep: 2}",
    }
    assert result["overrides"] == ranked[0]["overrides"]
    assert ranked[0]["overrides"][0] == mesh[ranked[0]["layout"].split(",")[0]]


def test_tune_serve_says_when_its_budget_cut_the_search_and_refuses_a_batch_no_layout_splits(
    tmp_path, capsys
):
    import yaml

    path = tmp_path / "serve.yaml"
    path.write_text(yaml.safe_dump(GPU_SERVE))  # 4 devices: tensor 1, 2 or 4, each with two KV dtypes.
    assert main(["tune", str(path), "--search", "serve", "--max-compiles", "2"]) == 0
    out = capsys.readouterr().out
    said = " ".join(out.split())
    assert ("the compile budget is spent with 5 of 6 layouts unplanned (those holding the most bytes per "
            "device): raise --max-compiles") in said, out  # fmt: skip
    assert "chosen: tensor 2 x tensor_rep 2 x data 1, KV int8 at" in said  # The one holding the least.
    # 8 devices: tensor 8 would hold 2 of the 4 query heads: not a layout. Tensor 4 leaves 2 replicas.
    eight = ["--set", "mesh.axes={data: 4, tensor: 2}", "--set", "serve.batch=3"]
    assert main(["tune", str(path), "--search", "serve", *eight]) == 2
    err = capsys.readouterr().err
    assert (
        "serve.batch=3 does not split over the data replicas of any layout of 8 devices (8 at tensor 1, "
        "4 at tensor 2, 2 at tensor 4); use a multiple of 2"
        in err
        and len(err.strip().splitlines()) == 1
    )


def _usable(kib: int) -> dict:
    """A memory section whose budget is ``kib`` KiB of an A100, for serving plans and tune alike."""
    fraction = kib * 1024 / GPU_TARGETS["a100-80g"].memory_bytes
    return {"target": "a100-80g", "usable_fraction": fraction, "reserve": 0, "deviceless_margin": 0.0}


def test_tune_serve_plans_the_layouts_holding_the_least_first_and_compiles_none_that_holds_too_much():
    from shardmem.explore.tune import tune
    from shardmem.units import format_bytes

    result = tune(config_from_dict({**GPU_SERVE, "memory": _usable(400)}), search="serve")
    # Per device, weights + KV cache (bfloat16 / int8): tensor 1, 449 KiB + 64 / 40; tensor 2, 225 KiB + 64
    # / 40; tensor 4 (each KV head on two devices), 121 KiB + 128 / 80.
    pruned = [t for t in result.trials if t.how == "pruned"]
    assert [t.candidate for t in pruned] == ["tensor 1 x data 4, KV bfloat16", "tensor 1 x data 4, KV int8"]
    weights = format_bytes(449 * 1024 + 128)
    assert pruned[0].reason == (f"its weights ({weights}) and KV cache (64.00 KiB) per device are over the "
                                "400.00 KiB the device has for serving")  # fmt: skip
    compiled = [t.candidate.removesuffix(", batch 4") for t in result.trials if t.how == "compiled"]
    split, plain = "tensor 2 x tensor_rep 2 x data 1, KV", "tensor 2 x data 2, KV"
    assert compiled == [f"{split} int8", f"{split} bfloat16", f"{plain} int8", f"{plain} bfloat16"]
    assert result.compiles == 8 and result.found


def test_tune_serve_plans_for_the_target_it_is_given_not_the_configs():
    from shardmem.explore.tune import tune

    # memory.target is an A100; every plan was compiled for it whatever --target said.
    result = tune(config_from_dict(GPU_SERVE), "h100-sxm", search="serve", max_compiles=2)
    assert result.report.target == "h100-sxm" and "H100" in result.target_label, result.target_label


def test_tune_serve_skips_a_layout_whose_axes_do_not_divide_the_model_and_goes_on():
    from shardmem.explore.tune import tune

    # d_ff 255: tensor 2 divides the 2 KV heads but not the MLP, whose rule is tensor. It stopped the search.
    odd = {**GPU_SERVE, "model": {"preset": "tiny", "d_ff": 255}}
    result = tune(config_from_dict(odd), search="serve", max_compiles=4)
    skipped = {t.candidate: t.reason for t in result.trials if t.how == "skipped"}
    assert set(skipped) == {"tensor 2 x data 2, KV bfloat16", "tensor 2 x data 2, KV int8"}, skipped
    reason = skipped["tensor 2 x data 2, KV int8"]
    assert "mlp has size 255, which mesh.axes.tensor=2 does not divide" in reason, reason
    assert result.found and result.compiles == 4


def test_tune_serve_holds_each_kv_head_on_several_devices_where_more_tensor_devices_fit_and_writes_it(
    tmp_path, capsys
):
    """Two KV heads on 4 devices, in a budget only tensor 4 fits: each KV head on two devices, as the
    refusal of mesh.axes.tensor=4 advises; the config tune writes serves so."""
    import yaml

    from shardmem.config import load_config

    path, out = tmp_path / "serve.yaml", tmp_path / "tuned.yaml"
    memory = _usable(270)  # Between tensor 4's peaks (222 and 246 KiB) and tensor 2's (295 and 307 KiB).
    path.write_text(
        yaml.safe_dump({**GPU_SERVE, "memory": memory, "serve": {**GPU_SERVE["serve"], "batch": 2}})
    )
    assert main(["tune", str(path), "--search", "serve", "--out", str(out)]) == 0
    said = " ".join(capsys.readouterr().out.split())
    assert "chosen: tensor 2 x tensor_rep 2 x data 1, KV " in said, said
    assert ("each KV head on several devices (mesh.axes={data: 1, tensor: 2, tensor_rep: 2}): rules heads, "
            "mlp, vocab on [tensor, tensor_rep], kv_heads on [tensor]") in said  # fmt: skip
    tuned = load_config(str(out))
    split = ["tensor", "tensor_rep"]
    assert tuned.mesh.axes == {"data": 1, "tensor": 2, "tensor_rep": 2}
    assert tuned.rules == {"heads": split, "mlp": split, "vocab": split, "kv_heads": ["tensor"]}
    plan = plan_serving(tuned)
    assert plan.fits and plan.decode.mesh == {"data": 1, "tensor": 2, "tensor_rep": 2}


@pytest.mark.slow
def test_tune_serve_for_throughput_takes_the_largest_batch_that_fits():
    from shardmem.explore.tune import tune

    two = config_from_dict({**GPU_SERVE, "serve": {**GPU_SERVE["serve"], "batch": 2}})
    config = with_memory_fraction(two, FRACTION)
    result = tune(config, search="serve", objective="throughput", max_compiles=16)
    best = result.ranked[0]
    assert best["fits"] and best["batch"] > 2 and best["batch"] % 2 == 0
    assert [r["tokens_per_second"] for r in result.ranked] == sorted(
        (r["tokens_per_second"] for r in result.ranked), reverse=True)  # fmt: skip
    assert result.config.serve.batch == best["batch"] and result.found


def test_sliding_layers_hold_their_windows_positions_and_the_plan_times_and_sizes_them_so():
    # Gemma 3's way at a small scale: a window of 32 on three layers of four, a cache of 128 positions.
    # The ring holds the three layers' 32 positions of each sequence (kv_cache.KVCache.ring), the stack the
    # fourth layer's 128: 1 x 128 + 3 x 32 = 224 layer-positions a sequence where the whole cache had 512.
    model = {"preset": "tiny", "sliding_window": 32, "sliding_layers": [0, 1, 2]}
    plan = plan_serving(with_memory_fraction(config_from_dict({**GPU_SERVE, "model": model}), FRACTION))
    position = (
        2 * 2 * 16 * 2 // 2
    )  # A layer's keys and values of one position: 2 KV heads of 16, bf16, tensor 2.
    rows = 2  # Sequences per device.
    assert plan.ring == {"layers": 3, "window": 32, "bytes": rows * 3 * 32 * position}
    # Each layer knows whether it slides: GPUs' flash kernel (the stand-in for cuDNN, which takes the
    # window) and a decode kernel in every layer, where a window on some layers only took XLA's attention.
    assert plan.decode.attention.startswith("pallas; sliding window of 32 on 3 of the 4 layers, not in")
    calls = [
        ins
        for ins in plan.decode.module.computations[plan.decode.module.entry]
        if ins.opcode == "custom-call"
    ]
    assert len(calls) == 4
    assert plan.per_device["kv_cache"] == rows * (128 + 3 * 32) * position
    room = plan.capacity
    assert (room.bytes_per_token, room.bytes_per_sequence) == (position, 3 * 32 * position)
    assert room.max_batch == room.cache_bytes // ((128 + 3 * 32) * position) * 2
    assert room.max_len == (room.cache_bytes - rows * 3 * 32 * position) // (rows * position)
    # A decode step reads the fourth layer's live positions and the ring's, which stop at the window.
    time = plan.time
    rate = GPU_TARGETS["a100-80g"].memory_bandwidth * cost.MEMORY_EFFICIENCY
    assert time.decode_seconds(100) - time.decode_seconds(99) == pytest.approx(rows * position / rate)
    assert time.decode_seconds(20) - time.decode_seconds(19) == pytest.approx(4 * rows * position / rate)
    assert time.bound_seconds(128) - time.bound_seconds(32) == pytest.approx(
        96 * rows * position / GPU_TARGETS["a100-80g"].memory_bandwidth
    )
    # Every layer sliding: the cache is the rings alone, and no context is too long for it.
    every = {**model, "sliding_layers": None}
    plan = plan_serving(with_memory_fraction(config_from_dict({**GPU_SERVE, "model": every}), FRACTION))
    assert plan.per_device["kv_cache"] == rows * 4 * 32 * position and plan.capacity.max_len is None
    assert plan.capacity.max_batch == plan.capacity.cache_bytes // (4 * 32 * position) * 2
    everything = with_memory_fraction(config_from_dict({**GPU_SERVE, "model": every}), FRACTION)
    assert search_capacity(everything).capacity.max_len is None  # Not searched: it does not bind.
    # A window longer than the cache (none is a ring yet) bounds it too: past 256 positions it is a ring.
    longer = with_memory_fraction(config_from_dict({**GPU_SERVE, "model": {**every, "sliding_window": 256}}),
                                  FRACTION)  # fmt: skip
    unringed = plan_serving(longer)
    assert unringed.ring is None and unringed.capacity.bytes_per_token == 4 * position
    assert unringed.capacity.cache_bytes > rows * 256 * 4 * position and unringed.capacity.max_len is None
    assert search_capacity(longer).capacity.max_len is None  # One compile at 257 positions fits.
    from rich.console import Console

    console = Console(width=300, record=True)
    console.print(render_serving(plan))
    text = console.export_text()
    assert "a sequence for the window of its 4 sliding layers (32 positions); at most serve.batch=" in text
    assert "any serve.max_len at serve.batch=4" in text


def test_a_rule_that_splits_the_caches_positions_is_checked_against_the_rings_too():
    config = config_from_dict({**GPU_SERVE, "model": {"preset": "tiny", "sliding_window": 5},
                               "rules": {"cache_seq": ["tensor"], "kv_heads": None}})  # fmt: skip
    with pytest.raises(
        ConfigError, match=r"^the KV cache: cache_seq has size 5, which mesh\.axes\.tensor=2 "
    ):
        serving_program(config, build_mesh(config.mesh.axes, jax.devices()[:4]))


def test_a_window_on_some_layers_only_takes_the_flash_and_decode_kernels_in_serving():
    # Serving's layers are unrolled, each knowing whether it slides: the window is static there, so a
    # model with a window on some layers only takes Pallas's kernels (interpret mode on CPU), where
    # training's scanned stack needs chunked or xla. Prompts within the window (Pallas's flash kernel has
    # none); the cache of 32 keeps the sliding layer's 16 in its ring, which the decode kernel reads.
    model = {"preset": "tiny", "n_layers": 2, "sliding_window": 16, "sliding_layers": [1],
             "local_rope_theta": 100.0, "qk_norm": True, "attention": "pallas"}  # fmt: skip
    serve = {"batch": 4, "prompt_len": 16, "max_len": 32}
    config = config_from_dict({"model": model, "mesh": {"axes": {"data": 2}},
                               "precision": {"compute": "float32"}, "serve": serve})  # fmt: skip
    mesh = build_mesh(config.mesh.axes, jax.devices()[:2])
    program = serving_program(config, mesh)
    assert program.attention.name == "pallas" and program.serving.cache.ring.keys.shape[2] == 16
    kernels = hlo.fused_attention_kernels(program.function("decode").trace().jaxpr)
    assert {k: v for k, v in kernels.items() if v.decode}  # The Pallas decode kernel.
    weights = _weights(program)
    tokens_BxT = np.random.default_rng(0).integers(0, 256, (4, 32), dtype=np.int32)
    cached = _cached_logits(program, weights, tokens_BxT, np.array([16, 3, 9, 1], np.int32))
    xla = dataclasses.replace(config, model=dataclasses.replace(config.model, attention="xla"))
    full = _full_logits(serving_program(xla, mesh), weights, tokens_BxT)
    known = ~np.isnan(cached)
    assert np.abs(full).max() > 1
    np.testing.assert_allclose(cached[known], full[known], atol=2e-5, rtol=2e-5)
    with pytest.raises(ConfigError, match="model.attention=pallas with model.sliding_layers"):
        describe(config, mesh)  # Training: each layer's window is traced in the scan.
