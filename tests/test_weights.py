"""Pretrained weights in and out (shardmem.finetune.weights): a Hugging Face Llama-layout safetensors
checkpoint written here with numpy, loaded into the reference model, compared with a hand-written
forward pass of Hugging Face's Llama on the same tokens."""

import json
import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

pytest.importorskip("safetensors")
import hf_reference as hf  # noqa: E402
from hf_reference import D, F, G, H, K, L, V  # noqa: E402
from safetensors.numpy import load_file, save_file  # noqa: E402

from shardmem import ConfigError, build_mesh, build_program, config_from_dict  # noqa: E402
from shardmem.finetune.export import export_safetensors  # noqa: E402

# On the newest JAX too (.ci/run): checkpoint formats: safetensors, transformers' Flax models, Orbax.
pytestmark = pytest.mark.newest

MODEL = {"vocab_size": V, "d_model": D, "n_layers": L, "n_heads": H, "n_kv_heads": G, "d_ff": F,
         "seq_len": 16, "norm_eps": 1e-6, "rope_theta": 10000.0}  # fmt: skip
LLAMA = hf.hf_config("llama")


def _hf_checkpoint(folder, seed=0):
    """Random weights under Hugging Face LlamaForCausalLM's names and [out, in] layout, in two files with no
    index and no config.json (the model section says what they are)."""
    tensors = hf.random_tensors(LLAMA, seed)
    hf.save(folder, None, tensors, shards=2, index=False)
    return tensors


def _hf_llama_logits(t, tokens):
    return hf.logits(LLAMA, t, tokens)


def _program(folder, axes, finetune=None):
    config = config_from_dict({"model": MODEL, "mesh": {"axes": axes}, "precision": {"compute": "float32"},
                               "train": {"global_batch": 8},
                               "finetune": {"init_from": str(folder), **(finetune or {})}})  # fmt: skip
    return build_program(config, build_mesh(config.mesh.axes, jax.devices()[: np.prod(list(axes.values()))]))


def _logits(program, params, tokens):
    @jax.jit
    def forward(params, tokens):
        with program.rules.activate(program.mesh):
            return nnx.merge(program.graphdef, params)(tokens)

    return np.asarray(forward(params, tokens))


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    folder = tmp_path_factory.mktemp("llama")
    return folder, _hf_checkpoint(folder)


@pytest.mark.parametrize("axes", [{"data": 1}, {"fsdp": 8}])
def test_a_hugging_face_llama_checkpoint_loads_into_its_shards_with_the_same_logits(checkpoint, axes):
    folder, tensors = checkpoint
    program = _program(folder, axes)
    tokens = np.random.default_rng(1).integers(0, V, (8, 16), dtype=np.int32)
    state = program.init()
    wq = state["params"]["layers"]["wq"]
    assert wq.sharding == program.state_shardings["params"]["layers"]["wq"]
    if axes.get("fsdp"):  # Each device holds its own block of the model dimension, read from the file.
        assert {s.data.shape for s in wq.addressable_shards} == {(L, D // 8, H, K)}
    got = _logits(program, state["params"], tokens)
    np.testing.assert_allclose(got, _hf_llama_logits(tensors, tokens), atol=1e-4, rtol=1e-4)


def test_export_writes_hugging_face_names_back_and_lora_merged(checkpoint, tmp_path):
    folder, tensors = checkpoint
    program = _program(folder, {"fsdp": 8}, {"lora": {"rank": 2, "targets": ["layers/wq", "layers/wo"]},
                                             "base_dtype": "float32"})  # fmt: skip
    state = program.init()
    file = export_safetensors(program, state, tmp_path / "plain", dtype=jnp.float32)
    written = load_file(str(file))
    assert set(written) == set(tensors)  # B is zero: the adapted model is still the checkpoint's.
    for name, value in tensors.items():
        np.testing.assert_allclose(written[name], value, atol=1e-6)
    b = state["params"]["layers"]["wq"]["lora_b"]
    state["params"]["layers"]["wq"]["lora_b"] = jax.device_put(jnp.ones(b.shape, b.dtype), b.sharding)
    merged = load_file(str(export_safetensors(program, state, tmp_path / "merged", dtype=jnp.float32)))
    a = np.asarray(state["params"]["layers"]["wq"]["lora_a"])  # [L, D, r]
    delta = (16.0 / 2) * a[0] @ np.ones((2, H * K))  # alpha / rank x A B, for layer 0, [D, H K]
    q0 = "model.layers.0.self_attn.q_proj.weight"
    np.testing.assert_allclose(merged[q0], tensors[q0] + delta.T, atol=1e-5)
    adapters = export_safetensors(
        program, state, tmp_path / "adapters", dtype=jnp.float32, adapters_only=True
    )
    peft = load_file(str(adapters))
    assert peft["base_model.model.model.layers.1.self_attn.o_proj.lora_A.weight"].shape == (2, H * K)
    np.testing.assert_allclose(peft["base_model.model.model.layers.0.self_attn.q_proj.lora_A.weight"], a[0].T)
    config = json.loads((tmp_path / "adapters" / "adapter_config.json").read_text())
    assert config["r"] == 2 and config["target_modules"] == ["o_proj", "q_proj"]


def test_a_quantized_base_loads_from_the_checkpoint(checkpoint):
    folder, tensors = checkpoint
    quantize = {"format": "int8", "group": 32, "targets": ["layers/w*"]}
    program = _program(folder, {"fsdp": 8}, {"freeze": ["layers/*"], "quantize": quantize})
    state = program.init()
    codes = np.asarray(state["frozen"]["layers"]["w_up"]["codes"])
    assert codes.dtype == np.int8 and codes.shape == (L, D, F)
    full = program.finetune.assemble(state["params"], state["frozen"])
    w_up = np.asarray(full["layers"]["w_up"].dequantize(jnp.float32))[1]
    np.testing.assert_allclose(w_up, tensors["model.layers.1.mlp.up_proj.weight"].T, atol=0.4 / 127)


@pytest.mark.parametrize("change, message", [
    ({"d_ff": 128}, "model.layers.0.mlp.down_proj.weight has shape [64, 96], but the model's layers/w_down "
                    "needs [64, 128]"),
    ({"n_layers": 3}, "has no tensor model.layers.2."),
    ({"n_layers": 1}, "has tensors the model has no place for, such as model.layers.1."),
])  # fmt: skip
def test_mismatched_checkpoints_are_one_line_errors_naming_the_tensor(checkpoint, change, message):
    folder, _ = checkpoint
    config = config_from_dict({"model": {**MODEL, **change}, "mesh": {"axes": {"fsdp": 8}},
                               "train": {"global_batch": 8},
                               "finetune": {"init_from": str(folder)}})  # fmt: skip
    program = build_program(config, build_mesh(config.mesh.axes, jax.devices()))
    with pytest.raises(ConfigError) as error:
        program.init()
    assert message in str(error.value) and "\n" not in str(error.value)


def test_a_folder_without_safetensors_is_a_config_error(tmp_path):
    with pytest.raises(ConfigError, match="no .safetensors file there"):
        _program(tmp_path, {"data": 1}).init()
    # A shardmem run that saved nothing yet (its folder, or its empty checkpoints folder): say so.
    (tmp_path / "config.yaml").write_text("model: {preset: tiny}\n")
    (tmp_path / "checkpoints").mkdir()
    for given in (tmp_path, tmp_path / "checkpoints"):
        says = f"the shardmem run at '{tmp_path}' has no checkpoint saved yet; train it first .*--run-dir"
        with pytest.raises(ConfigError, match=f"{says} {tmp_path}\\)"):
            _program(given, {"data": 1}).init()


def test_train_starts_from_the_checkpoint_and_export_writes_the_adapters(checkpoint, tmp_path, capsys):
    import yaml

    from shardmem import cli

    folder, _ = checkpoint
    config = {"model": MODEL, "mesh": {"axes": {"fsdp": 8}}, "train": {"global_batch": 8, "steps": 3,
              "log_every": 1}, "finetune": {"init_from": str(folder), "lora": {"rank": 2,
              "targets": ["layers/w[qv]"]}, "quantize": {"format": "nf4", "group": 32,
              "targets": ["layers/*"]}}}  # fmt: skip
    path = tmp_path / "lora.yaml"
    path.write_text(yaml.safe_dump(config))
    run = tmp_path / "run"
    assert cli.main(["train", str(path), "--run-dir", str(run)]) == 0
    assert "frozen" in json.loads((run / "plan.json").read_text())["per_device"]
    assert cli.main(["export", str(path), "--run-dir", str(run), "--out", str(tmp_path / "out"),
                     "--adapters-only"]) == 0  # fmt: skip
    assert "wrote the adapters of step 3" in capsys.readouterr().err
    peft = load_file(str(tmp_path / "out" / "adapter_model.safetensors"))
    assert len(peft) == 2 * 2 * L and peft[
        "base_model.model.model.layers.0.self_attn.v_proj.lora_B.weight"
    ].shape == (G * K, 2)
    assert (
        np.abs(
            peft["base_model.model.model.layers.0.self_attn.v_proj.lora_B.weight"].astype(np.float32)
        ).max()
        > 0
    )
    assert cli.main(["export", str(path), "--run-dir", str(tmp_path / "none"), "--out", str(tmp_path)]) == 2


def test_the_plan_says_the_host_memory_a_load_holds_and_plans_before_the_download(tmp_path):
    from shardmem.planning import memory

    program = _program(tmp_path / "not-downloaded-yet", {"fsdp": 8})  # A plan may come before the download.
    report, _ = memory.plan_program(program, memory.make_target(program.config, "cpu"))
    # The largest block one device reads: the embedding's [256, 64 / 8], float32 as read and as kept.
    assert report.load_host_bytes == 256 * 8 * (4 + 4)
    unchecked = f"finetune.init_from={str(tmp_path / 'not-downloaded-yet')!r} is not there yet, so the plan"
    assert any(w.startswith(unchecked) for w in report.warnings)


def test_a_folder_of_only_its_config_json_plans_with_a_warning_and_does_not_train(tmp_path):
    from shardmem.finetune.weights import check_init_from
    from shardmem.planning import memory

    (tmp_path / "config.json").write_text(json.dumps(LLAMA))  # Downloaded as far as its config.json.
    program = _program(tmp_path, {"fsdp": 8})
    report, _ = memory.plan_program(program, memory.make_target(program.config, "cpu"))  # Was an error.
    said = f"finetune.init_from={str(tmp_path)!r} has its config.json but no weights yet: the plan is of"
    assert any(w.startswith(said) for w in report.warnings), report.warnings
    with pytest.raises(ConfigError, match="has a config.json but no .safetensors file; download the model's"):
        check_init_from(program)
    (tmp_path / "model.safetensors.index.json").write_text(json.dumps({"weight_map": {"x": "a.safetensors"}}))
    with pytest.raises(ConfigError, match="a.safetensors"):  # A download cut short stays an error.
        check_init_from(program, planning=True)


GEMMA = {**MODEL, "head_dim": 32, "tie_embeddings": True, "norm_offset": 1.0, "scale_embeddings": True,
         "mlp_activation": "gelu_tanh"}  # fmt: skip


@pytest.mark.parametrize("axes", [{"data": 1}, {"fsdp": 8}])
def test_a_hugging_face_gemma_checkpoint_loads_with_the_same_logits(tmp_path_factory, axes):
    folder = tmp_path_factory.mktemp("gemma")
    tensors = hf.random_tensors(hf.hf_config("gemma"), seed=2)
    hf.save(folder, None, tensors)  # No config.json: the model section says Gemma's options.
    config = config_from_dict({"model": GEMMA, "mesh": {"axes": axes}, "precision": {"compute": "float32"},
                               "train": {"global_batch": 8},
                               "finetune": {"init_from": str(folder)}})  # fmt: skip
    devices = jax.devices()[: np.prod(list(axes.values()))]
    program = build_program(config, build_mesh(config.mesh.axes, devices))
    tokens = np.random.default_rng(3).integers(0, V, (8, 16), dtype=np.int32)
    got = _logits(program, program.init()["params"], tokens)
    np.testing.assert_allclose(got, hf.logits(hf.hf_config("gemma"), tensors, tokens), atol=1e-4, rtol=1e-4)


def test_a_qwen2_checkpoint_with_qkv_biases_loads_with_the_same_logits(tmp_path):
    tensors = _hf_checkpoint(tmp_path / "qwen2", seed=4)
    rng = np.random.default_rng(5)
    for i in range(L):  # Qwen2 is Llama's layout with biases on q, k and v.
        for n, width in (("q", H * K), ("k", G * K), ("v", G * K)):
            tensors[f"model.layers.{i}.self_attn.{n}_proj.bias"] = (rng.normal(size=width) * 0.1).astype(
                np.float32
            )
    save_file(tensors, str(tmp_path / "qwen2" / "model-00001-of-00002.safetensors"))
    (tmp_path / "qwen2" / "model-00002-of-00002.safetensors").unlink()
    config = config_from_dict({"model": {**MODEL, "qkv_bias": True}, "mesh": {"axes": {"fsdp": 8}},
                               "precision": {"compute": "float32"}, "train": {"global_batch": 8},
                               "finetune": {"init_from": str(tmp_path / "qwen2")}})  # fmt: skip
    program = build_program(config, build_mesh(config.mesh.axes, jax.devices()))
    state = program.init()
    tokens = np.random.default_rng(6).integers(0, V, (8, 16), dtype=np.int32)
    got = _logits(program, state["params"], tokens)
    np.testing.assert_allclose(got, _hf_llama_logits(tensors, tokens), atol=1e-4, rtol=1e-4)
    assert state["params"]["layers"]["bq"].shape == (L, H, K)
    assert sum(x.size for x in jax.tree.leaves(state["params"])) == program.config.model.param_count()
    written = load_file(str(export_safetensors(program, state, tmp_path / "out", dtype=jnp.float32)))
    np.testing.assert_allclose(written["model.layers.1.self_attn.k_proj.bias"],
                               tensors["model.layers.1.self_attn.k_proj.bias"], atol=1e-7)  # fmt: skip


@pytest.mark.parametrize("model_type, norm, names", [
    ("qwen3", "q_norm", ("model.layers.1.self_attn.q_norm.weight", "model.layers.0.self_attn.k_norm.weight")),
    # Gemma 2's post_attention_layernorm norms attention's output, where the others' norms the MLP's input.
    ("gemma2", "post_mlp_norm", ("model.layers.1.post_attention_layernorm.weight",
                                 "model.layers.0.pre_feedforward_layernorm.weight",
                                 "model.layers.1.post_feedforward_layernorm.weight")),
])  # fmt: skip
def test_a_checkpoint_trains_adapters_and_exports_its_own_norms_and_config(tmp_path, model_type, norm, names):
    config = hf.hf_config(model_type, tie_word_embeddings=True)
    tensors = hf.random_tensors(config, seed=7)
    hf.save(tmp_path / model_type, config, tensors, shards=2)
    shardmem_config = config_from_dict({
        "model": {"seq_len": 16}, "mesh": {"axes": {"fsdp": 2, "tensor": 2}},
        "precision": {"compute": "float32"}, "train": {"global_batch": 8},
        "finetune": {"init_from": str(tmp_path / model_type), "base_dtype": "float32",
                     "lora": {"rank": 2, "targets": ["layers/wq", "layers/wk"]}},
    })  # fmt: skip
    program = build_program(shardmem_config, build_mesh(shardmem_config.mesh.axes, jax.devices()[:4]))
    state = program.init()
    assert norm in state["frozen"]["layers"]  # Not adapted, not trained: frozen as the norms are.
    exported = tmp_path / "out"
    written = load_file(str(export_safetensors(program, state, exported, dtype=jnp.float32)))
    assert set(written) == set(tensors)  # B is zero: the checkpoint's own tensors, its norms' too.
    for name in names:
        np.testing.assert_allclose(written[name], tensors[name], atol=1e-7)
    again = json.loads((exported / "config.json").read_text())
    assert again["model_type"] == model_type and again["head_dim"] == hf.head_dim(config)
    reloaded = config_from_dict({"model": {"seq_len": 16}, "finetune": {"init_from": str(exported)}})
    assert reloaded.model == program.config.model


def test_an_orbax_checkpoint_of_a_run_loads_its_parameters_into_a_lora_program(tmp_path):
    from shardmem.run.checkpoint import Checkpointer

    config = config_from_dict({"model": MODEL, "mesh": {"axes": {"fsdp": 8}}, "train": {"global_batch": 8}})
    pretrained = build_program(config, build_mesh(config.mesh.axes, jax.devices()))
    state = pretrained.init()
    checkpointer = Checkpointer(tmp_path / "run" / "checkpoints", every=1, keep=1)
    checkpointer.save(7, state, force=True)
    checkpointer._manager.wait_until_finished()
    saved = np.asarray(state["params"]["layers"]["w_up"])
    lora = config.replace(
        f"finetune.init_from={tmp_path / 'run'}", "finetune.lora={rank: 2, targets: [layers/wq]}"
    )
    program = build_program(lora, pretrained.mesh)
    loaded = program.init()
    got = loaded["frozen"]["layers"]["w_up"]
    assert got.dtype == jnp.bfloat16 and got.sharding == program.state_shardings["frozen"]["layers"]["w_up"]
    np.testing.assert_array_equal(np.asarray(got), saved.astype(jnp.bfloat16))
    wrong = build_program(lora.replace("model.d_ff=128"), pretrained.mesh)
    with pytest.raises(ConfigError, match="do not restore into the model's") as error:
        wrong.init()
    # Orbax names the first mismatched tensor it meets: w_down (2, 96, 64) or w_gate / w_up (2, 64, 96).
    assert "\n" not in str(error.value) and re.search(r"\(2, (96, 64|64, 96)\)", str(error.value))


def test_a_runs_checkpoint_loads_without_orbax_warnings(tmp_path, caplog):
    """The item folder holds no step metadata (the step folder above does): reading the saved tree through
    a PyTreeCheckpointer warned, at every plan, train and generate, that the file does not exist."""
    from shardmem.finetune.weights import check_init_from
    from shardmem.run.checkpoint import Checkpointer

    config = config_from_dict({"model": MODEL, "mesh": {"axes": {"data": 1}}, "train": {"global_batch": 8}})
    pretrained = build_program(config, build_mesh(config.mesh.axes, jax.devices()[:1]))
    with Checkpointer(tmp_path / "run" / "checkpoints", every=1, keep=1) as checkpointer:
        checkpointer.save(7, pretrained.init(), force=True)
    program = build_program(config.replace(f"finetune.init_from={tmp_path / 'run'}"), pretrained.mesh)
    with caplog.at_level("WARNING"):
        check_init_from(program)
        program.init()
    assert not [r.getMessage() for r in caplog.records if r.levelno >= 30]


@pytest.mark.parametrize("damage", ["deleted", "garbled"])
def test_a_run_whose_checkpoint_metadata_is_damaged_is_a_one_line_error_naming_it(tmp_path, damage):
    from shardmem.finetune.weights import check_init_from
    from shardmem.run.checkpoint import Checkpointer

    config = config_from_dict({"model": MODEL, "mesh": {"axes": {"data": 1}}, "train": {"global_batch": 8}})
    pretrained = build_program(config, build_mesh(config.mesh.axes, jax.devices()[:1]))
    with Checkpointer(tmp_path / "run" / "checkpoints", every=1, keep=1) as checkpointer:
        checkpointer.save(7, pretrained.init(), force=True)
    metadata = tmp_path / "run" / "checkpoints" / "7" / "default" / "_METADATA"
    metadata.unlink() if damage == "deleted" else metadata.write_text("{not json")
    program = build_program(config.replace(f"finetune.init_from={tmp_path / 'run'}"), pretrained.mesh)
    for call in (lambda: check_init_from(program), program.init):
        message = _one_line_error(call)
        assert message.startswith("finetune.init_from: the checkpoint in") and "7/default" in message
        assert "name an older step's folder" in message


# The bar against the real library: Hugging Face `transformers` 4.x (the last line with Flax models, so no
# torch) random-initialises a tiny Llama and Gemma. Two checkpoints of each: the Flax-layout one its own
# save_pretrained writes, and the PyTorch-layout one (what the Hub holds) written here from its parameters
# and read back by its from_pretrained (the torch-free PyTorch-to-Flax path) to prove the layout its own.
TRANSFORMERS_REASON = "needs transformers<5 (its Flax Llama and Gemma; pip install -e '.[dev]')"


def _pt_layout(params) -> dict:
    """A transformers Flax model's parameters under its PyTorch twin's names and layout: the inverse of
    transformers' ``rename_key_and_reshape_tensor`` (``kernel`` [in, out] -> ``weight`` [out, in],
    ``embedding`` -> ``weight``, norms' ``weight`` as they are)."""
    from flax.traverse_util import flatten_dict

    tensors = {}
    for (*module, leaf), value in flatten_dict(params).items():
        value = np.asarray(value, np.float32)
        name = ".".join((*module, "weight" if leaf in ("kernel", "embedding") else leaf))
        tensors[name] = np.ascontiguousarray(value.T if leaf == "kernel" else value)
    return tensors


def _transformers_checkpoints(folder, model_class, config, seed):
    """Random-initialises ``model_class(config)`` in transformers (its norm scales random too, where it
    starts them at 1 or 0), writes ``folder/pt`` and ``folder/flax``, and returns the model transformers
    loads back from ``pt``: the one whose logits shardmem's must equal."""
    from flax.traverse_util import flatten_dict, unflatten_dict

    model = model_class(config, seed=seed, dtype=jnp.float32)
    rng = np.random.default_rng(seed)
    flat = flatten_dict(model.params)
    for path in [p for p in flat if "norm" in p[-2]]:
        flat[path] = flat[path] + (rng.normal(size=flat[path].shape) * 0.1).astype(np.float32)
    model.params = unflatten_dict(flat)
    model.save_pretrained(folder / "flax", safe_serialization=True)  # Metadata format: flax.
    (folder / "pt").mkdir()
    save_file(_pt_layout(model.params), str(folder / "pt" / "model.safetensors"), metadata={"format": "pt"})
    config.save_pretrained(folder / "pt")
    loaded = model_class.from_pretrained(folder / "pt", dtype=jnp.float32)
    for path, value in flatten_dict(loaded.params).items():
        np.testing.assert_array_equal(np.asarray(value), np.asarray(flat[path]), err_msg="/".join(path))
    return loaded


def _transformers_models(transformers) -> dict:
    """{name: (transformers' Flax class, its config, shardmem's model section)} for Llama, Gemma and
    Mistral."""
    # Weights of 0.2 (not 0.02) for logits of order 1; RoPE's base is 10,000 (transformers' Flax ignores
    # rope_theta), as MODEL's.
    common = dict(vocab_size=V, hidden_size=D, intermediate_size=F, num_hidden_layers=L,
                  num_attention_heads=H, num_key_value_heads=G, rms_norm_eps=1e-6,
                  max_position_embeddings=64, initializer_range=0.2)  # fmt: skip
    llama = transformers.LlamaConfig(**common, tie_word_embeddings=False)
    gemma = transformers.GemmaConfig(**common, head_dim=GEMMA["head_dim"],
                                     hidden_activation="gelu_pytorch_tanh")  # fmt: skip
    # Mistral's layout is Llama's (its sliding window, 4,096 by default, is longer than these sequences).
    mistral = transformers.MistralConfig(**common, tie_word_embeddings=False)
    return {"llama": (transformers.FlaxLlamaForCausalLM, llama, MODEL),
            "gemma": (transformers.FlaxGemmaForCausalLM, gemma, GEMMA),
            "mistral": (transformers.FlaxMistralForCausalLM, mistral, MODEL)}  # fmt: skip


@pytest.fixture(scope="module")
def transformers_models(tmp_path_factory):
    """{name: (model section, checkpoints folder, transformers' logits)} for a random Llama, Gemma and
    Mistral, and the tokens."""
    import os

    os.environ.setdefault("HF_HUB_OFFLINE", "1")  # Everything is local; never ask the Hub.
    transformers = pytest.importorskip("transformers", "4", reason=TRANSFORMERS_REASON)
    if not hasattr(transformers, "FlaxLlamaForCausalLM"):
        pytest.skip(f"transformers {transformers.__version__} has no Flax models; {TRANSFORMERS_REASON}")
    tokens = np.random.default_rng(7).integers(0, V, (8, 16), dtype=np.int32)
    models = {}
    for name, (model_class, config, section) in _transformers_models(transformers).items():
        folder = tmp_path_factory.mktemp(f"transformers-{name}")
        loaded = _transformers_checkpoints(folder, model_class, config, seed=len(models))
        models[name] = section, folder, np.asarray(loaded(tokens).logits)
    return models, tokens


@pytest.mark.parametrize("layout, axes", [("pt", {"data": 1}), ("pt", {"fsdp": 8}), ("flax", {"fsdp": 8})])
@pytest.mark.parametrize("name", ["llama", "gemma", "mistral"])
def test_a_checkpoint_of_transformers_loads_with_its_logits(transformers_models, name, layout, axes):
    models, tokens = transformers_models
    section, folder, expected = models[name]
    config = config_from_dict({"model": section, "mesh": {"axes": axes}, "precision": {"compute": "float32"},
                               "train": {"global_batch": 8},
                               "finetune": {"init_from": str(folder / layout)}})  # fmt: skip
    devices = jax.devices()[: np.prod(list(axes.values()))]
    program = build_program(config, build_mesh(config.mesh.axes, devices))
    got = _logits(program, program.init()["params"], tokens)
    assert np.abs(expected).max() > 1  # Logits of order 1: near-zero ones would meet any tolerance.
    # fp32's rounding over two layers: 1e-4 absolute and of the logit. Gemma's logits (up to 13) are further
    # from exact: transformers' fp32 forward is 1e-4 (JAX 0.10) to 3e-4 (0.12) from a float64 one, and moves
    # by 3.4e-4 between LLVM -O2 and -O0 (conftest.py) at its worst position (BENCHMARKS.md, "Checkpoints
    # written by transformers"), so 1e-3 there; a checkpoint loaded wrong is off by far more.
    np.testing.assert_allclose(got, expected, atol=1e-3 if name == "gemma" else 1e-4, rtol=1e-4)


def test_a_misshapen_flax_layout_checkpoint_is_a_one_line_error_naming_its_kernel(
    transformers_models, tmp_path
):
    import shutil

    models, _ = transformers_models
    _, folder, _ = models["llama"]
    # Beside its config.json the model section is checked against that (tests/test_hf_config.py); alone,
    # against the tensors' shapes.
    with pytest.raises(ConfigError, match=r"model.d_ff=128 but .*flax/config.json says 96"):
        config_from_dict({"model": {**MODEL, "d_ff": 128}, "finetune": {"init_from": str(folder / "flax")}})
    shutil.copy(folder / "flax" / "model.safetensors", tmp_path)
    config = config_from_dict({"model": {**MODEL, "d_ff": 128}, "mesh": {"axes": {"fsdp": 8}},
                               "train": {"global_batch": 8},
                               "finetune": {"init_from": str(tmp_path)}})  # fmt: skip
    with pytest.raises(ConfigError) as error:
        build_program(config, build_mesh(config.mesh.axes, jax.devices())).init()
    message = "model.layers.0.mlp.down_proj.kernel has shape [96, 64], but the model's layers/w_down needs"
    assert f"{message} [128, 64]" in str(error.value) and "\n" not in str(error.value)


class _Mlp(nnx.Module):
    """A model of the user's own, nothing like the reference model."""

    def __init__(self, rngs):
        self.up = nnx.Linear(8, 32, rngs=rngs)
        self.down = nnx.Linear(32, 4, rngs=rngs)

    def __call__(self, x):
        return self.down(jax.nn.relu(self.up(x)))


def _mlp_loss(model, batch):
    import optax

    return optax.softmax_cross_entropy_with_integer_labels(model(batch["x"]), batch["y"]).mean()


_MLP_BATCH = {"x": {"shape": ["global_batch", 8], "dtype": "float32", "axes": ["batch", None]},
              "y": {"shape": ["global_batch"], "dtype": "int32", "axes": ["batch"]}}  # fmt: skip
_MLP_BASE = {"mesh": {"axes": {"data": 1}}, "train": {"global_batch": 4},
             "precision": {"params": "float32", "compute": "float32"}}  # fmt: skip


def _mlp_program(finetune: dict | None = None):
    """The user's MLP (``_Mlp``) on one device, with ``finetune`` if given."""
    config = config_from_dict({**_MLP_BASE, **({"finetune": finetune} if finetune else {})})
    return build_program(config, build_mesh({"data": 1}, jax.devices()[:1]), model_factory=_Mlp,
                         loss_fn=_mlp_loss, batch=_MLP_BATCH)  # fmt: skip


def test_a_users_own_model_loads_its_checkpoint_by_path_into_a_lora_program(tmp_path):
    # Issue 32 item 1: weights into "a user's model" as well as the reference one, tensors named by path.
    plain = _mlp_program()
    original = jax.device_get(plain.init()["params"])
    original["up"]["kernel"] = original["up"]["kernel"] + 1.0  # Not what a fresh init would give.
    export_safetensors(plain, {"params": original}, tmp_path, dtype=jnp.float32)
    adapted = _mlp_program({"init_from": str(tmp_path), "base_dtype": "float32",
                            "lora": {"rank": 2, "targets": ["up/kernel"]}})  # fmt: skip
    state = adapted.init()
    loaded = jax.device_get(adapted.finetune.assemble(state["params"], state["frozen"]))
    jax.tree.map(np.testing.assert_array_equal, loaded, original)  # LoRA's B starts at zero.


def test_init_names_renames_a_users_tensors_and_a_path_it_does_not_have_is_named(tmp_path):
    """A key of finetune.init_names that is no parameter path was ignored: the error then asked for the
    path's own tensor name and suggested another parameter's (up/kernal -> "did you mean 'down.kernel'?");
    on the reference model the whole mapping was ignored."""
    plain = _mlp_program()
    original = jax.device_get(plain.init()["params"])
    export_safetensors(plain, {"params": original}, tmp_path, dtype=jnp.float32)
    tensors = load_file(str(tmp_path / "model.safetensors"))
    tensors["encoder.fc1.w"] = tensors.pop("up.kernel")  # Another library's name for it.
    save_file(tensors, str(tmp_path / "model.safetensors"))

    def program(names):
        return _mlp_program({"init_from": str(tmp_path), "init_names": names,
                             "lora": {"rank": 2, "targets": ["up/kernel"]}})  # fmt: skip

    state = program({"up/kernel": "encoder.fc1.w"}).init()
    np.testing.assert_array_equal(np.asarray(state["frozen"]["up"]["kernel"]), original["up"]["kernel"])
    message = _one_line_error(program({"up/kernal": "encoder.fc1.w"}).init)
    said = "finetune.init_names: 'up/kernal' is not a parameter path of the model (did you mean 'up/kernel'?)"
    assert message.startswith(said) and "down.kernel" not in message
    finetune = {"init_from": str(tmp_path), "init_names": {"a": "b"}}
    reference = config_from_dict({"model": MODEL, "mesh": {"axes": {"data": 1}}, "train": {"global_batch": 8},
                                  "finetune": finetune})  # fmt: skip
    message = _one_line_error(build_program(reference, build_mesh({"data": 1}, jax.devices()[:1])).init)
    assert message.startswith("finetune.init_names={'a': 'b'}: it renames a model of your own's parameters")


# --- Issue 40: checkpoints load exactly or not at all -------------------------------------------------


def _plain_program(folder, model=None, axes=None):
    config = config_from_dict({"model": model or MODEL, "mesh": {"axes": axes or {"data": 1}},
                               "precision": {"compute": "float32"}, "train": {"global_batch": 8},
                               "finetune": {"init_from": str(folder)}})  # fmt: skip
    devices = jax.devices()[: int(np.prod(list(config.mesh.axes.values())))]
    return build_program(config, build_mesh(config.mesh.axes, devices))


def _one_line_error(call) -> str:
    with pytest.raises(ConfigError) as error:
        call()
    assert "\n" not in str(error.value)
    return str(error.value)


@pytest.mark.newest
def test_an_index_names_the_files_and_a_stray_consolidated_file_is_not_read(tmp_path):
    # Mistral-7B-Instruct-v0.3's layout on the Hub: shards with an index, and consolidated.safetensors holding
    # the same weights under Mistral's own names, which the index does not list.
    config = hf.hf_config("mistral", sliding_window=None)
    tensors = hf.random_tensors(config, seed=3)
    hf.save(tmp_path, config, tensors, shards=2)
    save_file({"layers.0.attention.wq.weight": tensors["model.layers.0.self_attn.q_proj.weight"]},
              str(tmp_path / "consolidated.safetensors"))  # fmt: skip
    program = _plain_program(tmp_path, {"seq_len": 16})
    tokens = np.random.default_rng(4).integers(0, V, (8, 16), dtype=np.int32)
    got = _logits(program, program.init()["params"], tokens)
    np.testing.assert_allclose(got, hf.logits(config, tensors, tokens), atol=1e-4, rtol=1e-4)
    (tmp_path / "model-00002-of-00002.safetensors").unlink()  # An interrupted download.
    message = _one_line_error(lambda: _plain_program(tmp_path, {"seq_len": 16}).init())
    assert "model.safetensors.index.json lists 1 file(s) the folder does not have, such as " in message
    assert "model-00002-of-00002.safetensors; the download is incomplete" in message


@pytest.mark.parametrize("dtype", [np.int8, np.uint8, np.bool_])
def test_an_integer_or_bool_tensor_is_no_weight(tmp_path, dtype):
    tensors = hf.random_tensors(LLAMA)
    tensors["model.layers.1.mlp.up_proj.weight"] = (tensors["model.layers.1.mlp.up_proj.weight"] > 0).astype(
        dtype
    )
    hf.save(tmp_path, None, tensors)
    from shardmem.finetune.weights import check_init_from

    program = _plain_program(tmp_path)
    code = {np.int8: "I8", np.uint8: "U8", np.bool_: "BOOL"}[dtype]
    for planning in (True, False):  # plan and train alike, before anything is compiled or read.
        message = _one_line_error(lambda: check_init_from(program, planning=planning))  # noqa: B023
        assert f"model.layers.1.mlp.up_proj.weight is stored as {code}, which no weight is" in message


@pytest.mark.newest
@pytest.mark.parametrize("content", [b"", b"garbage" * 50, "truncated"])
def test_an_empty_truncated_or_garbage_file_is_a_one_line_error_naming_it(tmp_path, content):
    from shardmem.finetune.weights import check_init_from

    hf.save(tmp_path, None, hf.random_tensors(LLAMA))
    file = tmp_path / "model.safetensors"
    file.write_bytes(file.read_bytes()[:5000] if content == "truncated" else content)
    message = _one_line_error(lambda: check_init_from(_plain_program(tmp_path), planning=True))
    assert message.startswith(f"finetune.init_from: {file} is not a readable safetensors file (")
    assert message.endswith("it is empty, truncated or not safetensors: download it again")


@pytest.mark.parametrize("name", ["config.json", "config.yaml", "pytorch_model.bin"])
def test_a_file_that_is_not_weights_is_named_with_its_folder_not_download_it_again(tmp_path, name):
    """init_from naming a checkpoint's config.json, a run's config.yaml or a PyTorch pickle, beside a model
    section that says the whole model: the mistake is the path, not a broken download."""
    from shardmem.finetune.weights import check_init_from

    (tmp_path / name).write_text('{"model_type": "llama"}')
    program = _plain_program(tmp_path / name)
    for call in (lambda: check_init_from(program, planning=True), program.init):
        message = _one_line_error(call)
        given = str(tmp_path / name)
        assert message.startswith(f"finetune.init_from={given!r} is a file, not weights; give ")
        assert f"the folder it is in ({str(tmp_path)!r})" in message and "download" not in message


def test_plan_on_a_bad_checkpoint_exits_2_with_one_line_before_compiling(tmp_path, capsys):
    import yaml

    from shardmem import cli

    tensors = hf.random_tensors(LLAMA)
    hf.save(tmp_path / "good", None, tensors)
    (tmp_path / "bad").mkdir()
    (tmp_path / "bad" / "model.safetensors").write_bytes(b"\0" * 3)
    for folder, model, says in [
        ("bad", MODEL, "is not a readable safetensors file"),
        ("good", {**MODEL, "d_ff": 128}, "has shape [64, 96], but the model's layers/w_down needs [64, 128]"),
    ]:
        path = tmp_path / f"{folder}.yaml"
        path.write_text(yaml.safe_dump({"model": model, "mesh": {"axes": {"data": 1}},
                                        "finetune": {"init_from": str(tmp_path / folder)}}))  # fmt: skip
        assert cli.main(["plan", str(path)]) == 2
        err = capsys.readouterr().err
        assert err.count("\n") == 1 and says in err and "Traceback" not in err


def test_a_path_not_there_is_a_train_error_before_anything_is_made(tmp_path):
    from shardmem.run.training import train

    config = config_from_dict({"model": MODEL, "mesh": {"axes": {"data": 8}}, "train": {"global_batch": 8},
                               "finetune": {"init_from": "not/downloaded/yet"}})  # fmt: skip
    message = _one_line_error(lambda: train(config, tmp_path / "run"))
    assert message.startswith("finetune.init_from='not/downloaded/yet': no such file or folder (a relative")
    assert not (tmp_path / "run").exists()


def test_an_untied_head_under_tie_embeddings_is_an_error_and_a_copy_of_the_embedding_loads(tmp_path):
    tied = {**MODEL, "tie_embeddings": True}
    tensors = hf.random_tensors(LLAMA)  # lm_head.weight of its own.
    hf.save(tmp_path / "untied", None, tensors)
    message = _one_line_error(lambda: _plain_program(tmp_path / "untied", tied).init())
    assert (
        "has lm_head.weight, an output head of its own (not a copy of model.embed_tokens.weight)" in message
    )
    assert message.endswith("set model.tie_embeddings: false")
    tensors["lm_head.weight"] = tensors["model.embed_tokens.weight"].copy()  # Some exports keep a copy.
    hf.save(tmp_path / "copy", None, tensors)
    tokens = np.random.default_rng(5).integers(0, V, (8, 16), dtype=np.int32)
    program = _plain_program(tmp_path / "copy", tied)
    expected = hf.logits({**LLAMA, "tie_word_embeddings": True}, tensors, tokens)
    np.testing.assert_allclose(
        _logits(program, program.init()["params"], tokens), expected, atol=1e-4, rtol=1e-4
    )


@pytest.mark.newest
def test_a_lora_run_loads_as_its_merged_model_from_a_relative_path(tmp_path, monkeypatch):
    import shutil

    from shardmem.finetune import weight
    from shardmem.run.checkpoint import Checkpointer

    finetune = {"lora": {"rank": 2, "alpha": 6, "targets": ["layers/wq", "lm_head"]},
                "quantize": {"format": "int8", "group": 32, "targets": ["layers/w*"]}}  # fmt: skip
    lora = config_from_dict({"model": MODEL, "mesh": {"axes": {"data": 1}}, "train": {"global_batch": 8},
                             "finetune": finetune})  # fmt: skip
    run = build_program(lora, build_mesh(lora.mesh.axes, jax.devices()[:1]))
    state = run.init()
    for path in ("layers", "wq"), ("lm_head",):
        adapters = state["params"][path[0]] if len(path) == 1 else state["params"]["layers"]["wq"]
        b = adapters["lora_b"]
        adapters["lora_b"] = jax.device_put(jnp.full(b.shape, 0.01, b.dtype), b.sharding)
    merged = jax.tree.map(lambda v: np.asarray(weight(v, jnp.float32)),
                          run.finetune.assemble(state["params"], state["frozen"]),
                          is_leaf=lambda x: not isinstance(x, dict))  # fmt: skip
    (tmp_path / "run").mkdir()
    (tmp_path / "run" / "config.yaml").write_text(lora.to_yaml())
    with Checkpointer(tmp_path / "run" / "checkpoints", every=1, keep=1) as checkpointer:
        checkpointer.save(5, state, force=True)
    monkeypatch.chdir(tmp_path)  # init_from relative to the working directory, as data.path is.
    plain = config_from_dict(
        {"model": {"seq_len": 16}, "mesh": {"axes": {"data": 1}}, "finetune": {"init_from": "run"}}
    )  # The model: the run's config.yaml.
    program = build_program(plain, build_mesh(plain.mesh.axes, jax.devices()[:1]))
    loaded = jax.device_get(program.init()["params"])
    jax.tree.map(lambda got, want: np.testing.assert_allclose(got, want, atol=1e-6), loaded, merged)
    assert np.abs(merged["lm_head"] - np.asarray(state["frozen"]["lm_head"], np.float32)).max() > 0.01
    shutil.copytree(tmp_path / "run" / "checkpoints", tmp_path / "copied")  # Without its config.yaml.
    moved = build_program(plain.replace("finetune.init_from=copied"), program.mesh)
    message = _one_line_error(moved.init)
    assert (
        "is a fine-tuning run's checkpoint (adapters and a frozen base), but not inside its run folder"
        in message
    )
