"""A checkpoint's config.json (shardmem.finetune.hf_config): the model section taken from it or checked
against it, and the checkpoint features it declares (Llama 3.1/3.2 rope scaling and the other scalings,
Mistral's sliding window, tied heads) giving the logits of transformers' forward pass (tests/hf_reference.py,
a numpy port written without shardmem's code) in float32, or a one-line error."""

import dataclasses
import json

import jax
import numpy as np
import pytest
from flax import nnx

pytest.importorskip("safetensors")
import hf_reference as hf  # noqa: E402

from shardmem import ConfigError, build_mesh, build_program, config_from_dict  # noqa: E402
from shardmem.finetune.hf_config import model_fields, to_hf  # noqa: E402

TOKENS = np.random.default_rng(1).integers(0, hf.V, (8, 16), dtype=np.int32)


def _config(folder, model=None, axes=None, **sections):
    axes = axes or {"data": 1}
    return config_from_dict({"model": {"seq_len": 16, **(model or {})}, "mesh": {"axes": axes},
                             "precision": {"compute": "float32"}, "train": {"global_batch": 8},
                             "finetune": {"init_from": str(folder)}, **sections})  # fmt: skip


def _logits(config, tokens=TOKENS):
    devices = jax.devices()[: int(np.prod(list(config.mesh.axes.values())))]
    program = build_program(config, build_mesh(config.mesh.axes, devices))
    state = program.init()

    @jax.jit
    def forward(params, tokens):
        with program.rules.activate(program.mesh):
            return nnx.merge(program.graphdef, params)(tokens)

    return program, state, np.asarray(forward(state["params"], tokens))


def _checkpoint(folder, model_type="llama", seed=0, **options):
    config = hf.hf_config(model_type, **options)
    tensors = hf.random_tensors(config, seed)
    hf.save(folder, config, tensors)
    return config, tensors


def _assert_matches(got, config, tensors, plain=None):
    """Within 1e-4 + 1e-4 |ref| of the reference, which differs from ``plain`` (the checkpoint read
    without the feature) by far more: the feature is what makes it match."""
    expected = hf.logits(config, tensors, TOKENS)
    assert np.abs(expected).max() > 1
    if plain is not None:
        assert np.abs(hf.logits(plain, tensors, TOKENS) - expected).max() > 0.05
    np.testing.assert_allclose(got, expected, atol=1e-4, rtol=1e-4)


LLAMA3 = {"rope_type": "llama3", "factor": 4.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
          "original_max_position_embeddings": 8}  # fmt: skip


@pytest.mark.newest
@pytest.mark.parametrize("model_type, options", [
    ("llama", {"rope_scaling": LLAMA3, "rope_theta": 500000.0}),   # Llama 3.1 / 3.2
    ("llama", {"rope_scaling": {"type": "linear", "factor": 4.0}}),
    ("llama", {"rope_scaling": {"rope_type": "dynamic", "factor": 4.0}, "max_position_embeddings": 8}),
    ("qwen2", {"rope_scaling": {"type": "yarn", "factor": 4.0, "original_max_position_embeddings": 8}}),
    ("llama", {"rope_scaling": {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 8,
                                "mscale": 1.0, "mscale_all_dim": 0.5}}),  # Was refused.
])  # fmt: skip
def test_rope_scalings_load_with_the_logits_of_transformers(tmp_path, model_type, options):
    config, tensors = _checkpoint(tmp_path, model_type, **options)
    shardmem_config = _config(tmp_path)  # The model section says only seq_len: the rest is config.json's.
    assert shardmem_config.model.rope_scaling is not None
    _, _, got = _logits(shardmem_config)
    plain = {k: v for k, v in config.items() if k != "rope_scaling"}
    _assert_matches(got, config, tensors, plain)


def test_an_original_context_written_as_a_whole_float_loads_as_transformers_reads_it(tmp_path):
    # transformers warns that it must be an integer, and computes with 8.0 as with 8 (was refused).
    config, tensors = _checkpoint(tmp_path, rope_scaling={**LLAMA3, "original_max_position_embeddings": 8.0})
    _, _, got = _logits(_config(tmp_path))
    _assert_matches(got, config, tensors, {k: v for k, v in config.items() if k != "rope_scaling"})


DEFAULT_LONGEST = {"llama": 2048, "mistral": 131072, "qwen2": 32768, "gemma": 8192}  # transformers' defaults.


@pytest.mark.parametrize("model_type", DEFAULT_LONGEST)
@pytest.mark.parametrize("rope_type", ["dynamic", "yarn"])
def test_dynamic_and_yarn_read_transformers_default_max_position_embeddings(model_type, rope_type):
    config = {k: v for k, v in hf.hf_config(model_type).items() if k != "max_position_embeddings"}
    scaling = model_fields({**config, "rope_scaling": {"rope_type": rope_type, "factor": 4.0}}, "x")[
        "rope_scaling"
    ]
    assert scaling["max_position_embeddings"] == DEFAULT_LONGEST[model_type]  # Was a ConfigError.


def test_yarn_without_max_position_embeddings_gives_transformers_logits(tmp_path):
    config, tensors = _checkpoint(tmp_path, rope_scaling={"rope_type": "yarn", "factor": 4.0})
    del config["max_position_embeddings"]
    hf.save(tmp_path, config, tensors)
    _, _, got = _logits(_config(tmp_path))
    # Its original context is transformers' default, Llama's 2048 (here, the highest frequencies' ramp).
    _assert_matches(got, {**config, "max_position_embeddings": 2048}, tensors,
                    {**config, "max_position_embeddings": 2048, "rope_scaling": None})  # fmt: skip


@pytest.mark.parametrize(
    "model_type, kv_heads", [("llama", hf.H), ("mistral", 8), ("qwen2", 32), ("gemma", 16)]
)
def test_a_config_json_without_num_key_value_heads_has_transformers_default(model_type, kv_heads):
    config = {k: v for k, v in hf.hf_config(model_type).items() if k != "num_key_value_heads"}
    assert model_fields(config, "x")["n_kv_heads"] == kv_heads  # Was num_attention_heads.
    if model_type != "gemma":  # A null is as many as the query heads (transformers' Gemma fails on it).
        assert model_fields({**config, "num_key_value_heads": None}, "x")["n_kv_heads"] == hf.H


def test_the_llama_1b_preset_has_llama_3_2s_rope_scaling(tmp_path):
    # Llama-3.2-1B's config.json, as the Hub has it (its shapes, its llama3 scaling).
    config = hf.hf_config("llama", vocab_size=128256, hidden_size=2048, intermediate_size=8192,
                          num_hidden_layers=16, num_attention_heads=32, num_key_value_heads=8, head_dim=64,
                          rms_norm_eps=1e-5, rope_theta=500000.0, max_position_embeddings=131072,
                          tie_word_embeddings=True, rope_scaling={"factor": 32.0, "high_freq_factor": 4.0,
                          "low_freq_factor": 1.0, "original_max_position_embeddings": 8192,
                          "rope_type": "llama3"})  # fmt: skip
    fields = model_fields(config, "config.json")
    from shardmem.models.llama import PRESETS

    preset = dataclasses.asdict(PRESETS["llama-1b"])
    assert {k: preset[k] for k in fields if k != "rope_scaling"} == {k: v for k, v in fields.items()
                                                                     if k != "rope_scaling"}  # fmt: skip
    assert {k: v for k, v in preset["rope_scaling"].items() if v is not None and k != "truncate"} == (
        config["rope_scaling"]
    )


@pytest.mark.newest
@pytest.mark.parametrize("attention, axes, trains", [
    ({"attention": "xla"}, {"data": 1}, False),
    ({"attention": "chunked", "attention_chunk": 4}, {"data": 1}, True),  # Blocks slice their window's keys.
    ({"attention": "chunked", "attention_chunk": 2}, {"context": 2}, False),  # A sequence over 2 devices.
])  # fmt: skip
def test_mistrals_sliding_window_gives_transformers_logits_and_trains(tmp_path, attention, axes, trains):
    config, tensors = _checkpoint(tmp_path, "mistral", sliding_window=5)
    program, state, got = _logits(_config(tmp_path, attention, axes=axes))
    assert program.config.model.sliding_window == 5
    _assert_matches(got, config, tensors, {**config, "sliding_window": None})
    if not trains:
        return
    # Training sees the same model: the first step's loss is the reference's cross-entropy.
    batch = np.random.default_rng(2).integers(0, hf.V, (8, 17), dtype=np.int32)
    _, metrics = program.step(state, jax.device_put(batch, program.batch_sharding))
    reference = hf.logits(config, tensors, batch[:, :-1])
    reference = reference - reference.max(-1, keepdims=True)
    log_probs = reference - np.log(np.exp(reference).sum(-1, keepdims=True))
    expected = -np.take_along_axis(log_probs, batch[:, 1:, None], -1).mean()
    np.testing.assert_allclose(float(metrics["loss"]), expected, rtol=1e-5)


@pytest.mark.parametrize("axes, sections", [
    ({"data": 1}, {}),
    # Accumulation with the weights whole: each device holds its own chunks of a sequence (split by hand).
    ({"context": 2}, {"train": {"global_batch": 8, "micro_batches": 2}, "rules": {"embed": None}}),
])  # fmt: skip
def test_dynamic_rope_trains_with_the_whole_sequences_length(tmp_path, axes, sections):
    config, tensors = _checkpoint(tmp_path, rope_scaling={"rope_type": "dynamic", "factor": 4.0},
                                  max_position_embeddings=8)  # fmt: skip
    program, state, _ = _logits(_config(tmp_path, axes=axes, **sections))
    batch = np.random.default_rng(2).integers(0, hf.V, (8, 17), dtype=np.int32)
    _, metrics = program.step(state, jax.device_put(batch, program.batch_sharding))
    reference = hf.logits(config, tensors, batch[:, :-1])  # Frequencies for 16 positions, over 8.
    reference = reference - reference.max(-1, keepdims=True)
    log_probs = reference - np.log(np.exp(reference).sum(-1, keepdims=True))
    expected = -np.take_along_axis(log_probs, batch[:, 1:, None], -1).mean()
    np.testing.assert_allclose(float(metrics["loss"]), expected, rtol=1e-5)


@pytest.mark.parametrize("options, window", [
    ({"use_sliding_window": True, "sliding_window": 4, "max_window_layers": 0}, 4),
    ({"use_sliding_window": True, "max_window_layers": 0}, 4096),  # transformers' default window.
    ({"use_sliding_window": True, "sliding_window": None, "max_window_layers": 0}, None),  # Was 4096.
    ({"use_sliding_window": True, "sliding_window": 4}, None),  # max_window_layers 28: no layer of 2.
    ({"use_sliding_window": False, "sliding_window": 4, "max_window_layers": 0}, None),
    ({"use_sliding_window": False, "sliding_window": 0, "max_window_layers": 0}, None),  # Unread: no window.
    ({"use_sliding_window": True, "sliding_window": 4, "layer_types": ["sliding_attention"] * 2}, 4),
])  # fmt: skip
def test_qwen2s_window_is_the_one_transformers_gives_its_layers(options, window):
    # As transformers 4.57's Qwen2Config(**options).sliding_window and .layer_types give each layer.
    assert model_fields(hf.hf_config("qwen2", **options), "config.json")["sliding_window"] == window


def test_a_qwen2_window_on_every_layer_gives_transformers_logits(tmp_path):
    config, tensors = _checkpoint(
        tmp_path, "qwen2", use_sliding_window=True, sliding_window=5, max_window_layers=0
    )
    _, _, got = _logits(_config(tmp_path))
    _assert_matches(got, config, tensors, {**config, "use_sliding_window": False})


@pytest.mark.newest
@pytest.mark.parametrize("options, axes", [
    ({}, {"data": 1}),
    ({"tie_word_embeddings": True}, {"fsdp": 2, "tensor": 2}),  # The head norms' scales replicated.
    ({"use_sliding_window": True, "sliding_window": 5, "max_window_layers": 0}, {"data": 1}),
])  # fmt: skip
def test_a_qwen3_checkpoint_norms_each_query_and_key_head_as_transformers_does(tmp_path, options, axes):
    config, tensors = _checkpoint(tmp_path, "qwen3", **options)  # Was refused: model_type 'qwen3'.
    program, state, got = _logits(_config(tmp_path, axes=axes))
    # Without the head norms: the same weights as a Llama of Qwen3's wider heads.
    _assert_matches(got, config, tensors, {**config, "model_type": "llama"})
    assert program.config.model.head_size == 24 and program.config.model.qk_norm
    assert state["params"]["layers"]["q_norm"]["scale"].shape == (hf.L, 24)
    assert sum(x.size for x in jax.tree.leaves(state["params"])) == program.config.model.param_count()


def test_a_qwen3_config_json_without_head_dim_has_transformers_default_of_128():
    config = {k: v for k, v in hf.hf_config("qwen3").items() if k != "head_dim"}
    assert model_fields(config, "x")["head_dim"] == 128  # Not hidden_size / heads (16), as Qwen2's.


#: Gemma 2 read without its caps, as a Gemma: the logits differ by far more than the tolerance.
GEMMA2_CAPS = {"attn_logit_softcapping": None, "final_logit_softcapping": None}


@pytest.mark.newest
@pytest.mark.parametrize("options, axes, sliding", [
    ({}, {"data": 1}, (0,)),  # transformers' layers: the first slides, the second attends to all.
    ({"sliding_window": 5}, {"fsdp": 2, "tensor": 2}, (0,)),  # The window active, on the first layer.
    ({"query_pre_attn_scalar": 32, "layer_types": ["full_attention", "sliding_attention"]},
     {"data": 1}, (1,)),
])  # fmt: skip
def test_a_gemma2_checkpoint_gives_transformers_logits(tmp_path, options, axes, sliding):
    # Was refused (model_type 'gemma2'): four norms a layer, the scores scaled by query_pre_attn_scalar and
    # capped, the logits capped, a window on every other layer.
    config, tensors = _checkpoint(tmp_path, "gemma2", **options)
    program, state, got = _logits(_config(tmp_path, axes=axes))
    _assert_matches(got, config, tensors, {**config, **GEMMA2_CAPS})
    model = program.config.model
    assert model.post_norms and model.sliding_layers == sliding
    assert model.sliding_window == options.get("sliding_window", 64)
    assert (model.attention_scale is None) == ("query_pre_attn_scalar" in options)  # 32 is the head's width.
    assert program.attention.name == "chunked"  # The flash kernels have no cap.
    assert sum(x.size for x in jax.tree.leaves(state["params"])) == model.param_count()


def test_gemma2s_defaults_and_null_caps_are_transformers(tmp_path):
    config = {k: v for k, v in hf.hf_config("gemma2").items()
              if k not in ("attn_logit_softcapping", "final_logit_softcapping", "query_pre_attn_scalar",
                           "sliding_window")}  # fmt: skip
    fields = model_fields(config, "x")
    assert (fields["attention_softcap"], fields["logit_softcap"]) == (50.0, 30.0)
    assert fields["sliding_window"] == 4096
    assert fields["attention_scale"] == 256**-0.5  # query_pre_attn_scalar 256, heads of 32.
    fields = model_fields({**config, **GEMMA2_CAPS}, "x")  # A null cap is none, not the default.
    assert (fields["attention_softcap"], fields["logit_softcap"]) == (None, None)


@pytest.mark.newest
@pytest.mark.parametrize("options, axes, sliding", [
    ({}, {"data": 1}, (0,)),  # The window (64) longer than the sequences: the RoPE bases alone differ.
    ({"sliding_window": 5}, {"fsdp": 2, "tensor": 2}, (0,)),  # And the first layer's window, active.
    ({"sliding_window": 5, "layer_types": ["full_attention", "sliding_attention"]},
     {"data": 2, "context": 2}, (1,)),
    # YaRN on the full layers: its factor on cos and sin picked per layer too (none on the sliding one).
    ({"sliding_window": 5, "rope_scaling": {"rope_type": "yarn", "factor": 4.0,
                                            "original_max_position_embeddings": 8}}, {"data": 1}, (0,)),
])  # fmt: skip
def test_a_gemma3_checkpoint_gives_transformers_logits(tmp_path, options, axes, sliding):
    # Was refused (model_type 'gemma3_text'): Gemma 2's layout with each head's query and key normed, no cap
    # on the scores, and the sliding layers rotating with their own base (rope_local_base_freq, unscaled;
    # the full layers' rope_theta here with a linear scaling of 8, as Gemma 3 4B's and larger).
    config, tensors = _checkpoint(tmp_path, "gemma3_text", **options)
    program, state, got = _logits(_config(tmp_path, axes=axes))
    _assert_matches(got, config, tensors, {**config, "rope_local_base_freq": config["rope_theta"]})
    model = program.config.model
    assert model.qk_norm and model.post_norms and model.sliding_layers == sliding
    scaling = options.get("rope_scaling", config["rope_scaling"])["rope_type"]
    assert (model.local_rope_theta, model.rope_scaling.rope_type) == (100.0, scaling)
    assert model.attention_softcap is None
    assert sum(x.size for x in jax.tree.leaves(state["params"])) == model.param_count()


def test_gemma3s_defaults_are_transformers_and_its_attention_takes_no_cap():
    config = {k: v for k, v in hf.hf_config("gemma3_text", num_hidden_layers=12).items()
              if k not in ("sliding_window", "sliding_window_pattern", "rope_local_base_freq", "rope_theta",
                           "query_pre_attn_scalar")}  # fmt: skip
    fields = model_fields({**config, "attn_logit_softcapping": 50.0}, "x")
    assert (fields["rope_theta"], fields["local_rope_theta"], fields["sliding_window"]) == (1e6, 1e4, 4096)
    assert fields["sliding_layers"] == (0, 1, 2, 3, 4, 6, 7, 8, 9, 10)  # All but every sixth.
    assert fields["attention_softcap"] is None  # transformers' Gemma 3 attention passes it no cap.
    assert fields["attention_scale"] == 256**-0.5 and fields["logit_softcap"] is None


def _multimodal_gemma3(folder, prefix: str, **options) -> tuple[dict, dict]:
    """A Gemma 3 checkpoint as Gemma3ForConditionalGeneration saves it: its text model's tensors under
    ``prefix``, a vision tower and projector beside them; ``(text config, text tensors)``."""
    text = hf.hf_config("gemma3_text", sliding_window=5, **options)
    tensors = hf.random_tensors(text, seed=4)
    head = "language_model.lm_head.weight" if prefix == "language_model.model." else "lm_head.weight"
    stored = {(prefix + n.removeprefix("model.") if n.startswith("model.") else head): t
              for n, t in tensors.items()}  # fmt: skip
    tower = "" if prefix == "language_model.model." else "model."
    stored |= {
        f"{tower}vision_tower.vision_model.post_layernorm.weight": np.ones(8, np.float32),
        f"{tower}multi_modal_projector.mm_input_projection_weight": np.ones((8, hf.D), np.float32),
    }
    config = {"model_type": "gemma3", "architectures": ["Gemma3ForConditionalGeneration"],
              "text_config": {k: v for k, v in text.items() if k not in ("architectures", "torch_dtype")},
              "vision_config": {"model_type": "siglip_vision_model", "hidden_size": 8},
              "torch_dtype": "float32", "eos_token_id": [1, 106]}  # fmt: skip
    hf.save(folder, config, stored)
    return text, tensors


@pytest.mark.parametrize("prefix, options", [
    ("language_model.model.", {}),  # The Hub's files (Gemma 3 4B, 12B, 27B), transformers 4.x's saves.
    ("language_model.model.", {"tie_word_embeddings": False}),  # Its head, language_model.lm_head.
    ("model.language_model.", {}),  # transformers' module names since 4.52, as other tools save them.
])  # fmt: skip
def test_a_multimodal_gemma3_checkpoint_loads_its_text_model(tmp_path, prefix, options):
    # Was refused (model_type 'gemma3'): the text model is the text_config's, its tensors under the
    # prefix, the vision tower's left out; the export is that text model, as a Gemma3ForCausalLM.
    text, tensors = _multimodal_gemma3(tmp_path / "base", prefix, **options)
    program, state, got = _logits(_config(tmp_path / "base"))
    _assert_matches(got, text, tensors, {**text, "rope_local_base_freq": text["rope_theta"]})
    assert program.config.model.tie_embeddings == options.get("tie_word_embeddings", True)
    from shardmem.finetune.export import export_safetensors

    export_safetensors(program, state, tmp_path / "out", dtype=np.float32)
    written = json.loads((tmp_path / "out" / "config.json").read_text())
    assert (written["model_type"], written["architectures"]) == ("gemma3_text", ["Gemma3ForCausalLM"])
    np.testing.assert_array_equal(_logits(_config(tmp_path / "out"))[2], got)


def test_a_multimodal_gemma3s_text_config_takes_transformers_sizes_and_refuses_adapter_files(tmp_path):
    from shardmem.finetune.export import export_safetensors
    from shardmem.finetune.hf_config import text_model

    gemma3_4b = {"model_type": "gemma3", "text_config": {  # Its config.json's, which leaves heads out.
        "hidden_size": 2560, "intermediate_size": 10240, "model_type": "gemma3_text", "num_hidden_layers": 34,
        "rope_scaling": {"factor": 8.0, "rope_type": "linear"}, "sliding_window": 1024}}  # fmt: skip
    assert text_model(gemma3_4b, "x")["max_position_embeddings"] == 131072  # Its export writes it so.
    fields = model_fields(text_model(gemma3_4b, "x"), "x")
    sizes = (fields["vocab_size"], fields["n_heads"], fields["n_kv_heads"], fields["head_dim"])
    assert sizes == (262208, 8, 4, 256)
    assert len(fields["sliding_layers"]) == 29 and fields["local_rope_theta"] == 1e4  # 34 layers, 5 of 6.
    quantized = {**gemma3_4b, "quantization_config": {"quant_method": "bitsandbytes"}}  # At the top level.
    with pytest.raises(ConfigError, match="has quantization_config .bitsandbytes-quantized weights."):
        model_fields(text_model(quantized, "x"), "x")
    _multimodal_gemma3(tmp_path, "language_model.model.")
    lora = {"rank": 2, "targets": ["layers/wq"]}
    program = build_program(_config(tmp_path, finetune={"init_from": str(tmp_path), "lora": lora}),
                            build_mesh({"data": 1}, jax.devices()[:1]))  # fmt: skip
    with pytest.raises(ConfigError, match=r"^export --adapters-only: finetune.init_from is a multimodal"):
        export_safetensors(program, program.init(), tmp_path / "out", adapters_only=True)


def test_layers_with_their_own_rope_base_in_pipeline_stages_are_refused_naming_the_keys(tmp_path):
    _checkpoint(tmp_path, "gemma3_text")  # A window of 64, longer than the sequences: still refused.
    pipelined = dict(axes={"stage": 2}, pipeline={"schedule": "1f1b"},
                     train={"global_batch": 8, "micro_batches": 2})  # fmt: skip
    with pytest.raises(ConfigError) as error:
        _logits(_config(tmp_path, **pipelined))
    message = str(error.value)
    assert message.startswith("mesh.axes.stage=2 with model.sliding_window=64 on 1 of the model's 2 layers "
                              "(model.sliding_layers) and model.local_rope_theta=100 on those")  # fmt: skip
    assert "set mesh.axes.stage=1" in message and "\n" not in message


@pytest.mark.newest
@pytest.mark.parametrize("model_type, options, axes, sliding", [
    ("gemma2", {"sliding_window": 5}, {"data": 1}, (0,)),  # Its window on the first layer, not the second.
    ("gemma2", {"sliding_window": 5}, {"data": 2, "context": 2}, (0,)),
    ("qwen2", {"use_sliding_window": True, "sliding_window": 5, "max_window_layers": 1}, {"data": 1}, (1,)),
    ("qwen3", {"use_sliding_window": True, "sliding_window": 5,  # Was refused: 1 of its 2 layers.
               "layer_types": ["sliding_attention", "full_attention"]}, {"fsdp": 2}, (0,)),
])  # fmt: skip
def test_a_window_on_some_layers_only_gives_transformers_logits(tmp_path, model_type, options, axes, sliding):
    # Each layer of the one scanned stack picks its own window by its index (Block._window).
    config, tensors = _checkpoint(tmp_path, model_type, **options)
    program, _, got = _logits(_config(tmp_path, axes=axes))
    assert program.config.model.sliding_layers == sliding and program.attention.name == "chunked"
    every = {**config, "layer_types": ["sliding_attention"] * 2, "max_window_layers": 0}
    _assert_matches(got, config, tensors, every)  # A window on every layer gives other logits.


def test_a_window_on_some_layers_only_in_pipeline_stages_is_refused_naming_the_keys(tmp_path):
    _checkpoint(tmp_path, "gemma2", sliding_window=8)
    pipelined = dict(axes={"stage": 2}, pipeline={"schedule": "1f1b"},
                     train={"global_batch": 8, "micro_batches": 2})  # fmt: skip
    with pytest.raises(ConfigError) as error:
        _logits(_config(tmp_path, **pipelined))  # seq_len 16
    message = str(error.value)
    assert message.startswith("mesh.axes.stage=2 with model.sliding_window=8 on 1 of the model's 2 layers")
    assert "set mesh.axes.stage=1, or model.seq_len to at most 8" in message and "\n" not in message
    _logits(_config(tmp_path, {"seq_len": 8}, **pipelined), TOKENS[:, :8])  # No window masks a key.


def test_soft_capped_scores_refuse_the_flash_kernels_naming_the_key(tmp_path):
    _checkpoint(tmp_path, "gemma2")
    with pytest.raises(ConfigError) as error:
        _logits(_config(tmp_path, {"attention": "pallas"}))
    message = str(error.value)
    assert message.startswith("model.attention=pallas with model.attention_softcap set")
    assert "\n" not in message


def test_a_window_refuses_the_pallas_kernel_where_it_would_run(tmp_path):
    _checkpoint(tmp_path, "mistral", sliding_window=5)
    with pytest.raises(ConfigError) as error:
        _logits(_config(tmp_path, {"attention": "pallas"}))
    message = str(error.value)
    assert "model.sliding_window=5 with model.attention=pallas" in message and "\n" not in message


def test_the_model_section_is_checked_against_config_json(tmp_path):
    config, tensors = _checkpoint(tmp_path, rope_theta=500000.0, tie_word_embeddings=True)
    with pytest.raises(ConfigError) as error:  # A Llama 3 checkpoint under Llama 2's base and an untied head.
        _config(tmp_path, {"rope_theta": 10000.0, "tie_embeddings": False, "d_ff": hf.F})
    message = str(error.value)
    assert "\n" not in message and message.startswith(
        f"model.rope_theta=10000.0 but {tmp_path / 'config.json'} says 500000.0; model.tie_embeddings=False "
        "but"
    )
    assert "d_ff" not in message  # What agrees is not listed.
    _, _, got = _logits(_config(tmp_path, {"rope_theta": 500000.0, "d_ff": hf.F}))
    _assert_matches(got, config, tensors, {**config, "rope_theta": 10000.0})


@pytest.mark.parametrize("options, words", [
    ({"model_type": "phi3"}, "model_type 'phi3'"),
    ({"attention_bias": True}, "attention_bias: true"),  # Llama's q, k, v and o projections read it,
    ({"mlp_bias": True}, "mlp_bias: true"),  # and its MLP's this one;
    ({"model_type": "gemma", "attention_bias": True}, "attention_bias: true"),  # Gemma's attention too,
    ({"model_type": "qwen3", "attention_bias": True}, "attention_bias: true"),  # Qwen3's o_proj too.
    ({"model_type": "gemma2", "attention_bias": True}, "attention_bias: true"),
    ({"model_type": "gemma2", "sliding_window": None}, "sliding_window null, with which transformers'"),
    ({"model_type": "gemma2", "layer_types": ["sliding_attention", "bogus"]}, 'layer_types with "bogus"'),
    ({"model_type": "gemma3_text", "sliding_window": None}, "sliding_window null, with which transformers'"),
    ({"model_type": "gemma3_text", "use_bidirectional_attention": True}, "use_bidirectional_attention: true"),
    ({"model_type": "gemma3_text", "attention_bias": True}, "attention_bias: true"),
    ({"model_type": "gemma3_text", "sliding_window_pattern": 0}, "sliding_window_pattern=0, where"),
    ({"model_type": "gemma3_text", "rope_local_base_freq": "1e4"}, 'rope_local_base_freq="1e4", where'),
    ({"partial_rotary_factor": 0.5}, "partial_rotary_factor 0.5"),
    ({"rope_scaling": {"rope_type": "longrope", "factor": 2.0, "short_factor": [1.0]}},
     "rope_scaling short_factor"),
    ({"quantization_config": {"quant_method": "gptq"}}, "gptq-quantized"),
    ({"hidden_act": "gelu"}, "the activation 'gelu'"),
    ({"model_type": "gemma", "hidden_act": "gelu", "hidden_activation": "gelu_pytorch_tanh"},
     "hidden_act 'gelu' and hidden_activation 'gelu_pytorch_tanh'"),
    # transformers' forward raises: sliding layers without a window, or a list for other layers.
    ({"model_type": "qwen2", "use_sliding_window": False, "layer_types": ["sliding_attention"] * 2},
     "layer_types with sliding_attention layers but no sliding window (use_sliding_window false"),
    ({"model_type": "qwen2", "use_sliding_window": True, "layer_types": ["full_attention"] * 3},
     "layer_types of 3 layers for its 2"),
    # What transformers cannot load either, loaded as another model (no scaling, a default base).
    ({"rope_scaling": {"rope_type": "linear"}}, 'rope_scaling {"rope_type": "linear"} without its factor'),
    ({"rope_theta": None}, "has rope_theta=null, where transformers writes a positive number"),
    # config.json's key and value, not the model section's (was model.rope_scaling..., model.sliding_window).
    ({"rope_scaling": {**LLAMA3, "original_max_position_embeddings": 8.5}},
     "config.json has rope_scaling.original_max_position_embeddings=8.5, where transformers writes a "
     "positive integer"),
    ({"rope_scaling": {"rope_type": "yarn", "factor": 4.0, "truncate": "false"}},
     'config.json has rope_scaling.truncate="false", where transformers writes true or false'),
    # A window of no positions: transformers' mask hides every key.
    ({"model_type": "mistral", "sliding_window": 0}, "config.json has sliding_window=0, a window under"),
    ({"model_type": "qwen2", "use_sliding_window": True, "sliding_window": 0, "max_window_layers": 0},
     "config.json has sliding_window=0"),
])  # fmt: skip
def test_what_the_reference_model_does_not_implement_is_refused_in_one_line(tmp_path, options, words):
    config = hf.hf_config(**{"model_type": "llama", **options})
    hf.save(tmp_path, config, {})
    with pytest.raises(ConfigError) as error:
        _config(tmp_path)
    assert words in str(error.value) and "\n" not in str(error.value)


@pytest.mark.parametrize("model_type, options", [
    ("mistral", {"attention_bias": True, "mlp_bias": True}),  # Its projections have no bias, whatever
    ("qwen2", {"attention_bias": True, "mlp_bias": True}),  # q, k and v always have one, no others
    ("gemma", {"mlp_bias": True}),  # Its MLP has none.
    ("mistral", {"attention_bias": "true", "mlp_bias": "false"}),  # Unread, so never type-checked.
])  # fmt: skip
def test_bias_flags_transformers_ignores_for_the_type_load_with_its_logits(tmp_path, model_type, options):
    config, tensors = _checkpoint(tmp_path, model_type, **options)  # Were refused.
    _, _, got = _logits(_config(tmp_path))
    _assert_matches(got, config, tensors)


def test_a_quoted_bias_flag_of_a_type_that_reads_it_is_refused():
    with pytest.raises(ConfigError, match=r'attention_bias="false", where transformers writes true or false'):
        model_fields(hf.hf_config("llama", attention_bias="false"), "config.json")


@pytest.mark.parametrize("model_type, options, activation", [
    # Llama's, Mistral's and Qwen2's forward run hidden_act (default silu): hidden_activation is Gemma's.
    ("llama", {"hidden_activation": "gelu_pytorch_tanh"}, "silu"),
    ("qwen2", {"hidden_act": "gelu_pytorch_tanh", "hidden_activation": "silu"}, "gelu_tanh"),
    ("gemma", {"hidden_activation": "gelu_pytorch_tanh"}, "gelu_tanh"),  # hidden_act: the same default.
    ("gemma", {"hidden_act": "gelu_pytorch_tanh", "hidden_activation": "gelu_pytorch_tanh"}, "gelu_tanh"),
])  # fmt: skip
def test_the_activation_is_the_one_transformers_forward_runs(model_type, options, activation):
    config = {k: v for k, v in hf.hf_config(model_type).items() if k != "hidden_act"} | options
    assert model_fields(config, "config.json")["mlp_activation"] == activation


def test_a_gemma_hidden_activation_other_than_its_default_hidden_act_is_refused():
    # transformers' PyTorch Gemma runs hidden_act, gelu_pytorch_tanh when config.json has none; its Flax
    # Gemma runs hidden_activation: which the weights were trained with is not known.
    config = {k: v for k, v in hf.hf_config("gemma", hidden_activation="silu").items() if k != "hidden_act"}
    with pytest.raises(ConfigError) as error:
        model_fields(config, "config.json")
    assert "hidden_act 'gelu_pytorch_tanh' (transformers' default) and hidden_activation 'silu'" in str(
        error.value
    )


@pytest.mark.parametrize("change, words", [
    ({"num_attention_heads": None}, "config.json has no num_attention_heads, where transformers writes a"),
    ({"hidden_size": "x"}, 'config.json has hidden_size="x", where transformers writes a positive integer'),
    ({"num_key_value_heads": 0}, "config.json has num_key_value_heads=0"),
    # Quoted values: "false" loaded as true (tied embeddings: wrong logits), the others as tracebacks or
    # as the model section's YAML advice.
    ({"tie_word_embeddings": "false"}, 'has tie_word_embeddings="false", where transformers writes true or'),
    ({"rms_norm_eps": "1e-5"}, 'has rms_norm_eps="1e-5", where transformers writes a positive number'),
    ({"model_type": "mistral", "sliding_window": "16"}, 'has sliding_window="16", where transformers writes'),
])  # fmt: skip
def test_a_config_json_without_a_size_or_with_a_mistyped_value_is_one_line_naming_the_file_and_key(
    tmp_path, change, words
):
    config = {k: v for k, v in {**hf.hf_config(change.get("model_type", "llama")), **change}.items()
              if v is not None}  # fmt: skip
    hf.save(tmp_path, config, {})
    with pytest.raises(ConfigError) as error:  # Was a KeyError's traceback.
        _config(tmp_path)
    assert words in str(error.value) and "\n" not in str(error.value)


def test_seq_len_is_the_one_key_a_pretrained_model_needs(tmp_path):
    _checkpoint(tmp_path)
    with pytest.raises(ConfigError, match=r"model.seq_len is required: .* max_position_embeddings=64"):
        config_from_dict({"model": {}, "finetune": {"init_from": str(tmp_path)}})


@pytest.mark.parametrize("model_type, options", [
    ("llama", {"rope_scaling": LLAMA3}), ("mistral", {"sliding_window": 5}),
    ("qwen2", {"rope_scaling": {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 8}}),
    ("gemma", {}), ("qwen3", {}), ("qwen3", {"use_sliding_window": True, "sliding_window": 5,
                                             "max_window_layers": 0}),
    # Not the type's usual activation: an export that wrote silu (Gemma: gelu_pytorch_tanh) gave other logits.
    ("llama", {"hidden_act": "gelu_pytorch_tanh"}),
    ("gemma", {"hidden_act": "silu", "hidden_activation": "silu"}),
    ("gemma2", {}), ("gemma2", {"query_pre_attn_scalar": 144, "attn_logit_softcapping": None}),
    ("gemma2", {"layer_types": ["sliding_attention"] * 2}),
    ("gemma2", {"layer_types": ["full_attention"] * 2}),  # Its window kept: transformers' Gemma 2 needs one.
    ("gemma3_text", {}), ("gemma3_text", {"rope_scaling": None, "final_logit_softcapping": 1.5}),
    ("gemma3_text", {"layer_types": ["sliding_attention"] * 2}),  # Every layer's base the local one,
    ("gemma3_text", {"layer_types": ["full_attention"] * 2}),  # or none's: the local base kept.
    ("qwen2", {"use_sliding_window": True, "sliding_window": 5, "max_window_layers": 1}),
])  # fmt: skip
def test_the_config_json_an_export_writes_reads_back_as_the_same_model(model_type, options):
    config = hf.hf_config(model_type, **options)
    model = config_from_dict({"model": {**model_fields(config, "x"), "seq_len": 16}}).model
    for base in (config, None):  # The base's config.json updated, or one written from the model.
        written = to_hf(model, base, "bfloat16")
        assert written["torch_dtype"] == "bfloat16" and written["model_type"] == model_type
        again = config_from_dict({"model": {**model_fields(written, "x"), "seq_len": 16}}).model
        assert again == model


def test_a_model_no_transformers_type_runs_writes_no_config_json():
    # Qwen2's q/k/v biases with Qwen3's head norms, or Gemma's norms with either: no type's forward.
    for options in (
        {"qkv_bias": True, "qk_norm": True},
        {"norm_offset": 1.0, "scale_embeddings": True, "qk_norm": True},
        # Gemma 3's layout with every layer's RoPE scaled: its sliding layers rotate unscaled.
        {**GEMMA3_LAYOUT, "rope_scaling": {"rope_type": "linear", "factor": 8.0}},
    ):
        model = config_from_dict({"model": {"preset": "tiny", **options}}).model
        assert to_hf(model, None, "bfloat16") is None
    local = {**GEMMA3_LAYOUT, "rope_scaling": {"rope_type": "linear", "factor": 8.0}, "local_rope_theta": 1e4}
    assert to_hf(config_from_dict({"model": {"preset": "tiny", **local}}).model, None, "bfloat16")[
        "model_type"] == "gemma3_text"  # fmt: skip


GEMMA3_LAYOUT = {"norm_offset": 1.0, "scale_embeddings": True, "qk_norm": True, "post_norms": True,
                 "sliding_window": 8, "sliding_layers": [0]}  # fmt: skip


@pytest.mark.parametrize("key, value", [
    ("local_rope_theta", 100.0), ("attention_softcap", 30.0), ("logit_softcap", 30.0), ("post_norms", True),
    ("attention_scale", 0.5),
])  # fmt: skip
def test_a_gemma_key_the_checkpoint_has_not_is_refused_not_run(tmp_path, key, value):
    # Was run: only the keys a checkpoint's type has were compared, and these change its logits.
    _checkpoint(tmp_path, "qwen2", use_sliding_window=True, sliding_window=5, max_window_layers=1)
    with pytest.raises(ConfigError, match=f"^model.{key}={value} but .*config.json says (null|False)"):
        _config(tmp_path, {key: value})
