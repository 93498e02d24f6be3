"""The serving program (shardmem.program.serving, shardmem.models.kv_cache): prefill and decode with a KV
cache give the training forward's logits at every position, sharded as on one device, with an int8 cache
within its stated tolerance and quantized weights; and its plan (shardmem.planning.serving)."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx
from jax.sharding import PartitionSpec as P

from shardmem import ConfigError, build_mesh, config_from_dict
from shardmem.finetune.quant import Quantized
from shardmem.planning.report import render_serving
from shardmem.planning.serving import plan_serving
from shardmem.program import ServingProgram, serving_program

pytestmark = pytest.mark.newest

# Every feature the cached forward must carry over from the training one, in one tiny model: grouped-query
# attention (4 heads, 2 KV heads), a sliding window shorter than the prompts, Qwen2's qkv biases, Gemma's
# norm offset, embedding scale, tied head and GeGLU.
MODEL = {"preset": "tiny", "n_layers": 2, "sliding_window": 6, "qkv_bias": True, "norm_offset": 1.0,
         "scale_embeddings": True, "tie_embeddings": True, "mlp_activation": "gelu_tanh"}  # fmt: skip
B, P_LEN, T = 8, 8, 16
LENGTHS = np.array([8, 3, 1, 5, 8, 2, 7, 4], np.int32)  # Prompts of every length in one batch.


def _program(axes: dict, **serve) -> ServingProgram:
    config = config_from_dict({"model": MODEL, "mesh": {"axes": axes}, "precision": {"compute": "float32"},
                               "serve": {"batch": B, "prompt_len": P_LEN, "max_len": T, **serve}})  # fmt: skip
    devices = jax.devices()[: int(np.prod(list(axes.values())))]
    return serving_program(config, build_mesh(config.mesh.axes, devices))


def _weights(program: ServingProgram):
    """The program's weights with noise on every one, so that biases and norm scales are not their zeros."""
    weights = program.init()
    leaves, tree = jax.tree.flatten(jax.device_get(weights))
    rng = np.random.default_rng(1)
    noisy = [w + (0.1 * rng.normal(size=w.shape)).astype(w.dtype) if w.dtype.kind == "f" else w for w in leaves]
    return jax.device_put(jax.tree.unflatten(tree, noisy), program.description.frozen_shardings)


def _tokens():
    return np.random.default_rng(0).integers(0, 256, (B, T), dtype=np.int32)


def _cached_logits(program: ServingProgram, weights, tokens_BxT) -> np.ndarray:
    """``[B, T - 1, V]``: at position t, the logits that predict token t + 1, from the prefill (t = the
    prompt's last) and then from decode steps fed the sequence's own tokens; NaN before the prompt's end."""
    prompts_BxP = np.where(np.arange(P_LEN) < LENGTHS[:, None], tokens_BxT[:, :P_LEN], 0)
    out = np.full((B, T - 1, 256), np.nan, np.float32)
    logits_BxV, cache = program.prefill(weights, prompts_BxP, LENGTHS)
    positions_B = LENGTHS.copy()
    rows = np.arange(B)
    out[rows, positions_B - 1] = np.asarray(logits_BxV)
    while positions_B.min() < T - 1:
        step = np.minimum(positions_B, T - 2)  # Rows at the end redo their last position (cache room).
        logits_BxV, cache = program.decode(weights, cache, tokens_BxT[rows, step], step)
        out[rows, step] = np.asarray(logits_BxV)
        positions_B = step + 1
    return out


def _full_logits(program: ServingProgram, weights, tokens_BxT) -> np.ndarray:
    """The training forward's logits ``[B, T - 1, V]`` of the same model and weights."""
    d = program.description
    with d.rules.activate(d.mesh):
        model = nnx.merge(d.model.graphdef, d.finetune.assemble({}, weights))
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


def test_a_tensor_by_data_program_on_8_devices_gives_one_devices_logits(sharded):
    program, weights, cached = sharded
    keys = program.serving.cache_shardings.keys
    assert keys.spec == P(None, "data", None, "tensor")  # Batch over the replicas, KV heads over tensor.
    assert program.description.frozen_shardings["layers"]["wk"].spec == P(None, None, "tensor")
    one = _program({"data": 1})
    alone = jax.device_put(jax.device_get(weights), one.description.frozen_shardings)
    single = _cached_logits(one, alone, _tokens())
    np.testing.assert_allclose(single, cached, atol=2e-5, rtol=2e-5)


def test_an_int8_kv_cache_stays_within_its_tolerance_of_float32(sharded):
    program, weights, cached = sharded
    int8 = _program({"data": 4, "tensor": 2}, kv_dtype="int8")
    cache = int8.serving.cache
    assert cache.keys.dtype == jnp.int8 and cache.key_scales.shape == (2, B, T, 2)  # Per token and KV head.
    quantized = _cached_logits(int8, weights, _tokens())
    known = ~np.isnan(cached)
    error = np.abs(quantized[known] - cached[known])
    # Codes of 127 levels a side per head vector: logits within 3% of their largest magnitude (measured:
    # 1.4% over these 8 sequences, a bfloat16 cache 0.4%). Prefill attends before quantizing: exact.
    assert error.max() <= 0.03 * np.abs(cached[known]).max()
    assert error.max() > 0  # Decoding did read the int8 codes.
    prefill = np.arange(T - 1)[None, :] == LENGTHS[:, None] - 1
    np.testing.assert_allclose(quantized[prefill], cached[prefill], atol=2e-5, rtol=2e-5)


def test_quantized_weights_serve_the_model_they_quantize():
    program = _program({"data": 2, "tensor": 2}, quantize={"format": "nf4", "targets": ["layers/*"]})
    weights = program.init()
    assert set(weights["layers"]["wq"]) == {"codes", "scales"} and weights["layers"]["wq"]["codes"].dtype == np.uint8
    assert weights["embedding"].dtype == np.float32  # Not a layer weight: as it was.
    d = program.description
    assert isinstance(d.finetune.assemble({}, weights)["layers"]["w_up"], Quantized)
    cached = _cached_logits(program, weights, _tokens())
    full = _full_logits(program, weights, _tokens())
    known = ~np.isnan(cached)
    np.testing.assert_allclose(cached[known], full[known], atol=2e-5, rtol=2e-5)


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
    assert plan.prefill.per_device["outputs"] >= plan.per_device["kv_cache"]  # Prefill makes it.
    weights = plan.per_device["weights"]
    assert weights == plan.prefill.per_device["params"] > 0
    assert plan.per_device["peak"] == max(plan.prefill.per_device["peak"], plan.decode.per_device["peak"])
    assert plan.fits and plan.verdict == "fits" and plan.decode.cross_check["matches"]
    assert plan.prefill.step_time.tokens_per_second > 0 and plan.decode.flops_per_step > 0
    data = plan.to_json()
    assert data["serve"]["kv_dtype"] == "int8" and data["decode"]["per_device"]["kv_cache"] == 2 * (codes + scales)
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


def test_a_model_of_your_own_is_refused_and_a_variant_stays_a_serving_program():
    config = config_from_dict({"model": {"preset": "tiny"}, "mesh": {"axes": {"data": 1}}})
    mesh = build_mesh(config.mesh.axes, jax.devices()[:1])
    with pytest.raises(ConfigError, match="serving runs the reference decoder"):
        serving_program(config, mesh, model_factory=lambda rngs: nnx.Linear(2, 2, rngs=rngs))
    program = serving_program(config, mesh)
    variant = program.variant("serve.max_len=4096")
    assert isinstance(variant, ServingProgram) and variant.serving.max_len == 4096
    assert [f.name for f in variant.functions] == ["prefill", "decode"]
