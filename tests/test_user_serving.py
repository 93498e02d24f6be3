"""Serving a model of your own (shardmem.program.user_serving, examples/cached_decoder.py): its cache-aware
call's prefill and decode give its full forward's logits at every position, sharded, with a sliding window
and an int8 cache within its tolerance, with every attention kernel its serving program resolves (flash
prefill and the Pallas decode kernel on GPUs); `shardmem generate` and `plan --serve` take its config; a
model without the call is refused in one line naming what to add."""

import json
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from shardmem import CacheLayout, CacheSlot, ConfigError, build_mesh, load_config
from shardmem.cli import main
from shardmem.models.attention import AttentionKernel, causal_attention
from shardmem.models.kv_cache import attending_with
from shardmem.planning.memory import make_target, plan_program
from shardmem.program import ServingProgram, serving_program
from shardmem.run.generation import generate
from tests.test_serving import _cached_logits  # The prefill, then decode steps fed the sequence.

pytestmark = pytest.mark.newest

EXAMPLES = Path(__file__).resolve().parents[1] / "examples"
CONFIG = EXAMPLES / "cached_decoder.yaml"
B, P_LEN, T, V = 8, 8, 16, 256
LENGTHS = np.array([8, 3, 1, 5, 8, 2, 7, 4], np.int32)  # Prompts of every length in one batch.
WINDOW = 6  # Shorter than the prompts: the window masks in the prefill and in the decode steps.


def _program(*overrides: str, attention: AttentionKernel | None = None) -> ServingProgram:
    config = load_config(CONFIG, [f"model.options.window={WINDOW}", "precision.compute=float32",
                                  "precision.params=float32", f"serve.batch={B}", f"serve.prompt_len={P_LEN}",
                                  f"serve.max_len={T}", "mesh.axes={data: 4, fsdp: 1, tensor: 2}",
                                  *overrides])  # fmt: skip
    return serving_program(config, build_mesh(config.mesh.axes, jax.devices()), attention=attention)


def _tokens():
    return np.random.default_rng(0).integers(0, V, (B, T), dtype=np.int32)


@pytest.fixture(scope="module")
def served():
    """The example on 8 devices (4 data replicas x tensor 2), its weights and teacher-forced logits."""
    program = _program()
    weights = program.init()
    return program, weights, _cached_logits(program, weights, _tokens(), LENGTHS)


def test_prefill_and_decode_give_the_models_own_forwards_logits_at_every_position(served):
    program, weights, cached = served
    s = program.serving
    assert s.layout == CacheLayout(layers=2, kv_heads=2, head_dim=16, window=WINDOW) and s.vocab == V
    spec = s.cache_shardings.keys.spec  # Its batch over the data replicas, its KV heads over tensor.
    assert "data" in spec[1] and spec[3] == "tensor"
    assert set(weights) == {"embed", "blocks", "norm", "head"}  # The model's own tree: not by_layer.
    d = program.description
    model = nnx.merge(d.model.graphdef, weights)
    full = np.asarray(jax.jit(lambda t: model(t))(_tokens()))[:, :-1]
    known = ~np.isnan(cached)
    assert known.sum() == (T - LENGTHS).sum() * V  # Every position from each prompt's end on.
    assert np.abs(full).max() > 1  # Logits of order 1: near-zero ones would meet any tolerance.
    # float32 throughout: only the order of the sums differs (the cache's attention is over max_len keys).
    np.testing.assert_allclose(cached[known], full[known], atol=2e-5, rtol=2e-5)


@pytest.mark.parametrize("kernel, window", [
    (AttentionKernel("chunked", chunk=4), WINDOW),  # Query blocks (CPU's choice for long prompts).
    (AttentionKernel("pallas", interpret=True), "null"),  # A GPU's: flash prefill, the Pallas decode kernel.
])  # fmt: skip
def test_the_kernel_the_serving_program_resolves_gives_the_models_own_logits(served, kernel, window):
    assert served[0].attention == AttentionKernel("chunked", chunk=512)  # CPU: auto's kernel.
    program = _program(f"model.options.window={window}", attention=kernel)
    assert program.attention == kernel  # CacheSlot.attend(None, ...) in the example attends with it.
    weights = program.init()
    prefill = str(program.prefill.trace(weights, program.new_cache(), _tokens()[:, :P_LEN], LENGTHS).jaxpr)
    decode = str(program.decode.trace(weights, program.new_cache(), LENGTHS, LENGTHS).jaxpr)
    pallas = kernel.name == "pallas"
    assert ("name=mha" in prefill, "name=decode_attention" in decode) == (pallas, pallas)
    model = nnx.merge(program.description.model.graphdef, weights)
    full = np.asarray(jax.jit(lambda t: model(t))(_tokens()))[:, :-1]
    cached = _cached_logits(program, weights, _tokens(), LENGTHS)
    known = ~np.isnan(cached)
    np.testing.assert_allclose(cached[known], full[known], atol=2e-5, rtol=2e-5)


def _every_positions_logits(program: ServingProgram):
    """A factory of the program's model (the example's) whose call takes no ``logits_at``: its prefill
    returns every prompt position's logits, of which the serving program takes each prompt's last."""
    model = program.description.model
    example = type(nnx.merge(model.graphdef, model.abstract_params))

    class EveryPositionsLogits(example):
        def cached_call(self, tokens_BxL, cache, positions, *, prefill):
            return super().cached_call(tokens_BxL, cache, positions, prefill=prefill)

    return lambda rngs: EveryPositionsLogits(rngs, **program.config.model.options)


def test_a_call_with_logits_at_gives_the_last_tokens_logits_of_one_with_every_positions(served):
    program, weights, cached = served
    config = program.config
    every = serving_program(config, program.mesh, model_factory=_every_positions_logits(program))
    prompts_BxP = _tokens()[:, :P_LEN]
    logits = [np.asarray(p.prefill(weights, p.new_cache(), prompts_BxP, LENGTHS)[0])
              for p in (program, every)]  # fmt: skip
    np.testing.assert_allclose(logits[0], logits[1], atol=2e-5, rtol=2e-5)


def test_a_prefill_with_logits_at_holds_no_logits_of_every_prompt_position():
    # A vocabulary of 4,096: every position's logits, 2 x 1,024 x 4,096 in bfloat16, are 16 MiB.
    config = load_config(CONFIG, ["model.options.vocab=4096", "serve.batch=2", "serve.prompt_len=1024",
                                  "serve.max_len=1024", "mesh.axes={data: 1, fsdp: 1, tensor: 1}",
                                  "mesh.devices_per_host=1"])  # fmt: skip
    target = make_target(config, "h100-sxm")
    mesh = build_mesh(config.mesh.axes, target.devices)
    program = serving_program(config, mesh)
    every = serving_program(config, mesh, model_factory=_every_positions_logits(program))
    temporaries = [plan_program(p, target, function="prefill")[0].per_device["temp"]
                   for p in (program, every)]  # fmt: skip
    logits = 2 * 1024 * 4096 * 2
    assert temporaries[1] >= logits > 8 * temporaries[0], temporaries  # 16.2 MiB, 1.5 MiB with logits_at.


def test_an_int8_kv_cache_stays_within_its_tolerance_of_float32(served):
    program, weights, cached = served
    int8 = _program("serve.kv_dtype=int8")
    assert int8.serving.cache.key_scales.shape == (2, B, T, 2)  # One scale per token and KV head.
    quantized = _cached_logits(int8, weights, _tokens(), LENGTHS)
    known = ~np.isnan(cached)
    error = np.abs(quantized[known] - cached[known])
    # Codes of 127 levels a side per head vector: logits within 3% of their largest magnitude, as the
    # reference model's (tests/test_serving.py). Prefill attends before quantizing: exact.
    assert 0 < error.max() <= 0.03 * np.abs(cached[known]).max()
    prefill = np.arange(T - 1)[None, :] == LENGTHS[:, None] - 1
    np.testing.assert_allclose(quantized[prefill], cached[prefill], atol=2e-5, rtol=2e-5)
    # A GPU's kernel decodes the codes and scales as they lie: the same logits as XLA's attention (no
    # window: Pallas's flash prefill has none).
    unwindowed = ("serve.kv_dtype=int8", "model.options.window=null")
    pallas = _program(*unwindowed, attention=AttentionKernel("pallas", interpret=True))
    assert "name=decode_attention" in str(pallas.decode.trace(weights, pallas.new_cache(), LENGTHS,
                                                              LENGTHS).jaxpr)  # fmt: skip
    np.testing.assert_allclose(_cached_logits(pallas, weights, _tokens(), LENGTHS)[known],
                               _cached_logits(_program(*unwindowed), weights, _tokens(), LENGTHS)[known],
                               atol=2e-5, rtol=2e-5)  # fmt: skip


def test_quantized_weights_serve_the_model_they_quantize():
    program = _program("serve.quantize={format: int8, targets: ['blocks/*/w*']}")
    weights = program.init()
    assert set(weights["blocks"][0]["wq"]) == {"codes", "scales"} and weights["embed"].dtype == np.float32
    d = program.description
    model = nnx.merge(d.model.graphdef, d.finetune.assemble({}, weights))  # Dequantized, as served.
    full = np.asarray(jax.jit(lambda t: model(t))(_tokens()))[:, :-1]
    cached = _cached_logits(program, weights, _tokens(), LENGTHS)
    known = ~np.isnan(cached)
    np.testing.assert_allclose(cached[known], full[known], atol=2e-5, rtol=2e-5)


def test_generate_on_the_example_prints_the_same_greedy_tokens_each_time(capsys):
    args = ["generate", str(CONFIG), "--prompt-ids", "5,8,11", "--max-new-tokens", "4", "--json"]
    runs = []
    for _ in range(2):
        assert main(args) == 0
        out, err = capsys.readouterr()
        runs.append(json.loads(out))
        assert "generated 4 tokens for 1 prompt" in err
    assert runs[0]["tokens"] == runs[1]["tokens"] and len(runs[0]["tokens"][0]) == 4
    assert all(0 <= t < V for t in runs[0]["tokens"][0])


def test_a_token_outside_the_models_vocabulary_names_its_size(capsys):
    assert main(["generate", str(CONFIG), "--prompt-ids", f"5,{V}"]) == 2
    err = capsys.readouterr().err
    assert f"prompt 0 has token id {V}, outside the model's vocabulary of {V} tokens (0 to {V - 1})" in err
    assert "Traceback" not in err and len(err.strip().splitlines()) == 1


def test_plan_serve_of_the_example_for_h100s_reports_weights_cache_and_peak(capsys):
    assert main(["plan", str(CONFIG), "--serve", "--target", "h100-sxm", "--json"]) == 0
    data = json.loads(capsys.readouterr().out)
    figures, serve = data["per_device"], data["serve"]
    assert serve == {"batch": 4, "prompt_len": 16, "max_len": 64, "kv_dtype": "bfloat16", "quantize": None}
    # 8 GPUs: 4 data replicas x tensor 2. Per device: one sequence, one of the 2 KV heads, 2 layers of
    # keys and values, 64 positions of 16 bfloat16 numbers.
    assert figures["kv_cache"] == 2 * 1 * 64 * 1 * 16 * 2 * 2
    # Every weight in bfloat16 (the compute dtype), the matrices split over tensor 2, the norms whole.
    width, hidden, vocab, heads, kv_heads, head_dim = 64, 128, 256, 4, 2, 16
    matrices = 2 * width * vocab + 2 * (width * (heads + 2 * kv_heads) * head_dim + heads * head_dim * width
                                        + 2 * width * hidden)  # fmt: skip
    assert figures["weights"] == (matrices // 2 + 5 * width) * 2
    assert figures["peak"] >= figures["weights"] + figures["kv_cache"] and data["fits"]
    assert data["time"]["output_tokens_per_second"] > 0


def test_long_prompts_planned_for_gpus_attend_in_flash_kernels_without_their_scores(capsys):
    sets = ["mesh.axes={data: 1, fsdp: 1, tensor: 1}", "mesh.devices_per_host=1", "serve.batch=2",
            "serve.prompt_len=2048", "serve.max_len=2048"]  # fmt: skip
    assert main(["plan", str(CONFIG), "--serve", "--target", "h100-sxm", "--json",
                 *(arg for item in sets for arg in ("--set", item))]) == 0  # fmt: skip
    data = json.loads(capsys.readouterr().out)
    assert data["prefill"]["attention"].startswith("pallas, standing in for cudnn")
    # XLA's attention held the prompts' scores, 2 x 4 heads x 2,048 x 2,048 float32 (128 MiB): 129.4 MiB
    # of prefill temporaries, 3 MiB in the flash kernel.
    scores = 2 * 4 * 2048 * 2048 * 4
    assert data["per_device"]["prefill_temp"] < scores / 16, data["per_device"]


def test_heads_cudnn_cannot_take_get_pallas_and_untiled_prompts_are_one_line(capsys):
    def h100(*sets):
        config = load_config(CONFIG, ["serve.prompt_len=256", "serve.max_len=256", *sets])
        return serving_program(config, build_mesh(config.mesh.axes, make_target(config, "h100-sxm").devices))

    assert h100().attention.stands_for == "cudnn"  # Heads of 16: cuDNN's, Pallas's standing in for it.
    # Heads of 12 (not a multiple of 8): cuDNN refuses them on the GPU, so the plan and the run take
    # Pallas's flash kernel itself.
    narrow = "model.options={vocab: 256, width: 48, depth: 2, heads: 4, kv_heads: 2, hidden: 128}"
    assert h100(narrow).attention == AttentionKernel("pallas", shared_memory=232448, sms=132)
    with pytest.raises(ConfigError) as refused:  # Pallas's kernel tiles blocks of 128 positions.
        h100("serve.prompt_len=200")
    message = str(refused.value)
    assert message.startswith("serve.prompt_len=200: the pallas (standing in for cudnn) flash kernel tiles")
    assert message.endswith("(e.g. 128 or 256)")  # No model.attention: a model of your own has none.


def test_a_layer_attending_in_float32_gets_xlas_attention_not_cudnns():
    q, k, v = (jax.random.normal(jax.random.key(i), (1, 8, 2, 16)) for i in range(3))
    cache = CacheLayout(layers=1, kv_heads=2, head_dim=16).zeros(batch=1, max_len=8, dtype="float32")
    slot = CacheSlot(cache, 0, jnp.arange(8), prefill=True)
    with attending_with(AttentionKernel("cudnn")):  # 16-bit inputs only (and no GPU here to run it).
        ctx, _ = slot.attend(None, q, k, v)
    np.testing.assert_allclose(ctx, causal_attention(q, k, v), atol=1e-6)


def test_a_decode_step_for_gpus_in_xla_reads_the_cache_where_it_lies():
    # As matmuls, XLA's GPU compiler transposed the whole cache every step to put the KV heads (2 on
    # the one device) before the positions: decode temporaries as large as the cache. (XLA's attention,
    # as heads narrower than 16 run it on GPUs; others run the Pallas decode kernel, above.)
    config = load_config(CONFIG, ["mesh.axes={data: 1, fsdp: 1, tensor: 1}", "mesh.devices_per_host=1",
                                  "serve.batch=16", "serve.max_len=2048"])  # fmt: skip
    target = make_target(config, "h100-sxm")
    mesh = build_mesh(config.mesh.axes, target.devices)
    program = serving_program(config, mesh, attention=AttentionKernel("xla"))
    report, _ = plan_program(program, target, function="decode")
    kv_cache = 2 * 16 * 2048 * 2 * 16 * 2 * 2  # 8 MiB: layers, batch, positions, KV heads, head_dim, ...
    assert report.per_device["temp"] < kv_cache / 4, report.per_device


def test_a_model_without_the_cached_call_is_refused_naming_what_to_add(capsys):
    config = load_config(CONFIG, ["mesh.axes={data: 1, fsdp: 1, tensor: 1}"])
    mesh = build_mesh(config.mesh.axes, jax.devices()[:1])
    with pytest.raises(ConfigError) as refused:
        serving_program(config, mesh, model_factory=lambda rngs: nnx.Linear(2, 2, rngs=rngs))
    message = str(refused.value)
    assert (
        "the model passed as model_factory: serving needs the model's cache-aware call, and Linear has "
        "no cached_call or cache_layout"
    ) in message
    assert "docs/guides/your-own-model.md#serving-it" in message and "\n" not in message
    assert main(["generate", str(EXAMPLES / "moe.yaml"), "--prompt-ids", "1,2"]) == 2
    err = capsys.readouterr().err
    assert "model.factory=moe:build: serving needs the model's cache-aware call, and MoE has no" in err
    assert "Traceback" not in err and len(err.strip().splitlines()) == 1


class WithDropout(nnx.Module):
    """A cache-aware call, and an RNG stream beside the parameters."""

    def __init__(self, rngs):
        self.embed = nnx.Param(nnx.with_partitioning(nnx.initializers.normal(1.0), ("vocab", "embed"))(
            rngs.params(), (V, 8)))  # fmt: skip
        self.drop = nnx.Dropout(0.1, rngs=rngs)

    def cache_layout(self):
        return CacheLayout(layers=1, kv_heads=1, head_dim=8)

    def cached_call(self, tokens_BxL, cache, positions, *, prefill):
        return self.drop(self.embed[...][tokens_BxL]) @ self.embed[...].T, cache


def test_a_model_with_variables_beyond_its_parameters_is_refused_for_serving():
    config = load_config(CONFIG, ["mesh.axes={data: 1, fsdp: 1, tensor: 1}"])
    with pytest.raises(ConfigError, match="WithDropout holds variables other than nnx.Param"):
        serving_program(config, build_mesh(config.mesh.axes, jax.devices()[:1]), model_factory=WithDropout)


class Tied(nnx.Module):
    """The protocol at its smallest (no attention), for its mistakes below to break one piece each."""

    def __init__(self, rngs):
        self.embed = nnx.Param(nnx.with_partitioning(nnx.initializers.normal(1.0), ("vocab", "embed"))(
            rngs.params(), (V, 8)))  # fmt: skip

    def cache_layout(self):
        return CacheLayout(layers=1, kv_heads=1, head_dim=8)

    def cached_call(self, tokens_BxL, cache, positions, *, prefill):
        return self.embed[...][tokens_BxL] @ self.embed[...].T, cache


class LayoutAsDict(Tied):
    def cache_layout(self):
        return {"layers": 1, "kv_heads": 1, "head_dim": 8}


class LayoutWithRing(Tied):
    def cache_layout(self):
        return CacheLayout(layers=1, kv_heads=1, head_dim=8, window=4, ring=(0,))


class NoPrefillArgument(Tied):
    def cached_call(self, tokens_BxL, cache, positions):
        return super().cached_call(tokens_BxL, cache, positions, prefill=True)


class LogitsOnly(Tied):
    def cached_call(self, tokens_BxL, cache, positions, *, prefill):
        return super().cached_call(tokens_BxL, cache, positions, prefill=prefill)[0]


class IgnoresLogitsAt(Tied):
    def cached_call(self, tokens_BxL, cache, positions, *, prefill, logits_at=None):
        return super().cached_call(tokens_BxL, cache, positions, prefill=prefill)


@pytest.mark.parametrize("model, message", [
    (LayoutAsDict, "LayoutAsDict.cache_layout() returned a dict; return shardmem.CacheLayout(layers=..., "),
    (LayoutWithRing, "LayoutWithRing.cache_layout().ring=(0,): a model of your own's layers keep their keys "
                     "in the one stack of the cache; leave ring out"),
    (IgnoresLogitsAt, "IgnoresLogitsAt.cached_call returned logits [4, 16, 256] for prompts [4, 16]; return "
                      "(logits [batch, 1 (its logits_at), vocab]"),
    (NoPrefillArgument, "NoPrefillArgument.cached_call cannot take (tokens_BxL, cache, positions, prefill="),
    (LogitsOnly, "LogitsOnly.cached_call returned [4, 16, 256] for prompts [4, 16]; return (logits [batch, "),
])  # fmt: skip
def test_a_cached_call_not_as_the_protocol_says_is_one_line_naming_the_piece(model, message):
    config = load_config(CONFIG, ["mesh.axes={data: 1, fsdp: 1, tensor: 1}"])
    mesh = build_mesh(config.mesh.axes, jax.devices()[:1])
    assert serving_program(config, mesh, model_factory=Tied).serving.vocab == V
    with pytest.raises(ConfigError) as refused:
        serving_program(config, mesh, model_factory=model)
    assert message in str(refused.value) and "\n" not in str(refused.value)


def test_tune_search_serve_refuses_a_model_of_your_own_in_one_line(capsys):
    assert main(["tune", str(CONFIG), "--search", "serve", "--target", "h100-sxm"]) == 2
    err = capsys.readouterr().err
    assert "a model of your own (model.factory=cached_decoder:build) is not searched" in err
    assert len(err.strip().splitlines()) == 1


@pytest.mark.slow
def test_the_example_trained_by_shardmem_then_served_from_its_run_continues_a_progression(tmp_path, capsys):
    run = tmp_path / "run"
    assert main(["train", str(CONFIG), "--run-dir", str(run), "--set", "train.steps=200"]) == 0
    capsys.readouterr()
    config = load_config(CONFIG, [f"finetune.init_from={run}"])
    program = serving_program(config, build_mesh(config.mesh.axes, jax.devices()))
    result = generate(program, program.init(), [[5, 8, 11, 14], [40, 41]], max_new_tokens=6)
    assert result.tokens == [[17, 20, 23, 26, 29, 32], [42, 43, 44, 45, 46, 47]]
